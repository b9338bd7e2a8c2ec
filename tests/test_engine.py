"""Engine behaviour beyond the seed scenarios: ordering, caps, budgets, fast lane,
dispatch back-pressure, wait reasons, metrics and refusals."""

import time

import pytest

from engine import (
    ActionSpec,
    AlreadyExists,
    NotFound,
    Phase,
    ResourceExhausted,
    RetryPolicy,
    ReusePolicy,
    SpecError,
    Timeouts,
    WaitCode,
)
from tests.conftest import make_engine

NODE = {"cpu": 64, "memory": "512Gi", "gpu:H100": 8}


def config(queues=None, clusters=None, engine=None):
    return {
        "resources": ["cpu", "memory", "gpu:H100"],
        "clusters": clusters or {"east": {"node_shapes": [{"count": 2, "allocatable": NODE}]}},
        "queues": queues or {"q": {}},
        "engine": {"default_queue": next(iter(queues or {"q": {}})), **(engine or {})},
    }


def spec(run, name="a", task="t", **kw):
    kw.setdefault("resources", {"cpu": 1})
    return ActionSpec(id=f"acme/p/d/{run}/{name}", task=task, **kw)


def test_round_robin_across_runs_oldest_first_within_a_run():
    eng, _ = make_engine(config({"q": {"action_concurrency": 6}}))
    eng.enqueue_many([spec("A", f"a{i}") for i in range(5)] + [spec("B", f"b{i}")
                                                                for i in range(5)])
    placed = [str(a.action).split("/")[-1] for a in eng.tick()]
    assert placed == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_queues_by_priority_and_higher_priority_takes_capacity_a_head_waits_for():
    eng, _ = make_engine(config(
        {"low": {"priority": "MIN"}, "high": {"priority": "MAX"}},
        clusters={"east": {"node_shapes": [{"count": 1, "allocatable": NODE}]}}))
    eng.enqueue(spec("busy", resources={"gpu": 4}, run_queue="low"))
    eng.tick()
    eng.enqueue(spec("gang", resources={"gpu": 8}, run_queue="low"))
    eng.tick()
    assert eng.explain("acme/p/d/gang/a").wait == WaitCode.CLUSTER_CAPACITY
    eng.enqueue(spec("urgent", resources={"gpu": 4}, run_queue="high"))
    eng.enqueue(spec("low2", resources={"gpu": 1}, run_queue="low"))
    placed = eng.tick()
    assert [a.action.run for a in placed] == ["urgent"]
    assert eng.explain("acme/p/d/low2/a").wait == WaitCode.CLUSTER_CAPACITY


def test_run_concurrency_and_run_max_action_concurrency():
    eng, _ = make_engine(config({"q": {"run_concurrency": 2}}))
    eng.enqueue_many([spec(f"r{i}", f"x{j}", run_max_action_concurrency=2)
                      for i in range(3) for j in range(3)])
    placed = eng.tick()
    assert sorted((a.action.run, a.action.action) for a in placed) == [
        ("r0", "x0"), ("r0", "x1"), ("r1", "x0"), ("r1", "x1")]
    assert eng.explain("acme/p/d/r2/x0").wait == WaitCode.QUEUE_RUNS
    assert eng.explain("acme/p/d/r0/x2").wait == WaitCode.RUN_ACTIONS
    assert eng.explain("acme/p/d/r0/x2").reason == (
        "run acme/p/d/r0: max_action_concurrency 2 reached")
    assert eng.queue_metrics("q")["runs_in_flight"] == 2


def test_queue_budget_strict_blocks_the_queue_greedy_packs_past_it():
    cases = (("STRICT_FIFO", ["r0"], 4), ("GREEDY_CAPACITY", ["r0", "r2"], 6))
    for policy, expect, used in cases:
        eng, _ = make_engine(config({"q": {"scheduling": policy,
                                           "max_accelerators": {"gpu:H100": 6}}}))
        eng.enqueue_many([spec("r0", resources={"gpu": 4}), spec("r1", resources={"gpu": 4}),
                          spec("r2", resources={"gpu": 2})])
        placed = eng.tick()
        assert [a.action.run for a in placed] == expect, policy
        why = eng.explain("acme/p/d/r1/a")
        assert why.wait == WaitCode.QUEUE_BUDGET
        assert f"max_resources reached (needs gpu:H100=4; {used} of 6 in flight)" in why.reason
        if policy == "STRICT_FIFO":
            assert eng.explain("acme/p/d/r2/a").wait == WaitCode.HEAD_BUDGET


def test_over_the_queue_hard_cap_fails_unschedulable_at_once():
    eng, _ = make_engine(config({"q": {"max_accelerators": {"gpu:H100": 4}}}))
    eng.enqueue(spec("big", resources={"gpu": 8}))
    assert eng.tick() == []
    why = eng.explain("acme/p/d/big/a")
    assert why.phase == Phase.FAILED
    assert why.reason == "UNSCHEDULABLE: needs gpu:H100=8, more than queue q's max gpu:H100=4"
    assert eng.queue_metrics("q")["depth"] == 0


def test_unknown_capacity_is_open_and_the_cluster_with_most_free_gpu_wins():
    eng, _ = make_engine(config(clusters={
        "small": {"capacity": {"cpu": 100, "memory": "1Ti", "gpu:H100": 4}},
        "big": {"capacity": {"cpu": 100, "memory": "1Ti", "gpu:H100": 16}},
        "cpus": {},   # unknown: open
    }, queues={"q": {"clusters": ["small", "big"]}, "c": {"clusters": ["cpus"]}}))
    eng.enqueue(spec("g", resources={"gpu": 2}))
    eng.enqueue(spec("huge", resources={"cpu": 100000}, run_queue="c"))
    placed = {a.action.run: a.cluster for a in eng.tick()}
    assert placed == {"g": "big", "huge": "cpus"}


def test_fast_lane_counts_the_pool_footprint_once_and_skips_the_gate():
    eng, clock = make_engine(config())
    reuse = ReusePolicy(replicas=2, concurrency=2, idle_ttl=60)

    def pooled(run, name):
        return spec(run, name, environment="env", reuse=reuse, resources={"cpu": 4, "gpu": 1})

    eng.enqueue(pooled("r", "p0"))
    first = eng.tick()
    assert len(first) == 1
    # The pool's footprint (2 replicas x the pod) is charged once, on admission.
    assert eng.cluster_in_flight("east")["gpu:H100"] == 2
    eng.enqueue_many([pooled("r", f"p{i}") for i in range(1, 6)])
    more = eng.tick()
    assert len(more) == 3                                # 2 x 2 slots in all
    assert {a.cluster for a in more} == {"east"}
    assert eng.cluster_in_flight("east")["gpu:H100"] == 2
    assert eng.explain("acme/p/d/r/p4").wait == WaitCode.POOL_BUSY
    for a in first + more:
        eng.complete(a.action, a.generation)
    last = eng.tick()                                    # p4, p5 run in the warm pool
    assert sorted(a.action.action for a in last) == ["p4", "p5"]
    assert eng.cluster_in_flight("east")["gpu:H100"] == 2
    for a in last:
        eng.complete(a.action, a.generation)
    clock.advance(59)
    eng.tick()
    assert eng.cluster_in_flight("east")["gpu:H100"] == 2   # idle, not yet past idle_ttl
    clock.advance(2)
    eng.tick()
    assert eng.cluster_in_flight("east")["gpu:H100"] == 0   # freed after idle_ttl


def test_fast_lane_and_regular_lane_interleave_one_to_one():
    eng, _ = make_engine(config({"q": {"action_concurrency": 7}}))
    reuse = ReusePolicy(replicas=1, concurrency=100, idle_ttl=600)
    eng.enqueue(spec("warm", "p0", environment="env", reuse=reuse))
    eng.tick()
    eng.enqueue_many([spec("warm", f"p{i}", environment="env", reuse=reuse)
                      for i in range(1, 10)])
    eng.enqueue_many([spec("cold", f"c{i}") for i in range(10)])
    placed = [a.action.run for a in eng.tick()]
    assert placed == ["cold", "warm", "cold", "warm", "cold", "warm"]


def test_full_dispatch_channel_takes_no_reservation_and_the_action_goes_next_tick():
    eng, _ = make_engine(config(engine={"dispatch_capacity": 2}))
    eng.enqueue_many([spec(f"r{i}") for i in range(3)])
    assert eng.schedule() == 2
    assert eng.queue_metrics("q")["actions_in_flight"] == 2
    why = eng.explain("acme/p/d/r2/a")
    assert why.wait == WaitCode.DISPATCH_FULL
    assert eng.schedule() == 0                      # still full: nothing reserved
    assert eng.queue_metrics("q")["actions_in_flight"] == 2
    assert len(eng.drain_dispatch()) == 2
    assert eng.schedule() == 1
    assert [a.action.run for a in eng.drain_dispatch()] == ["r2"]


def test_no_worker_reason_and_placement_after_a_worker_connects():
    eng, _ = make_engine(config(), workers={})
    eng.enqueue(spec("r"))
    assert eng.tick() == []
    why = eng.explain("acme/p/d/r/a")
    assert why.wait == WaitCode.NO_WORKER
    assert why.reason == "queue q: no connected worker with a free slot on east"
    eng.register_worker("w1", "east", 1)
    [a] = eng.tick()
    assert a.worker == "w1"


def test_worker_slots_bound_placement_and_disconnect_stops_new_work():
    eng, _ = make_engine(config(), workers={"w1": ("east", 2)})
    eng.enqueue_many([spec(f"r{i}") for i in range(4)])
    placed = eng.tick()
    assert len(placed) == 2
    assert sorted(str(a) for a in eng.unregister_worker("w1")) == sorted(
        str(a.action) for a in placed)
    eng.complete(placed[0].action, placed[0].generation)
    assert eng.tick() == []
    assert eng.explain("acme/p/d/r2/a").wait == WaitCode.NO_WORKER


def test_release_is_applied_once_per_generation():
    eng, _ = make_engine(config())
    eng.enqueue(spec("r", resources={"gpu": 2}))
    [a] = eng.tick()
    eng.mark_running(a.action, a.generation)
    assert eng.phase(a.action) == Phase.RUNNING
    with pytest.raises(SpecError, match="generation 7 refused: UNKNOWN"):
        eng.complete(a.action, 7)
    eng.complete(a.action, a.generation)
    with pytest.raises(SpecError, match="refused: COMPLETED"):
        eng.complete(a.action, a.generation)
    m = eng.queue_metrics("q")
    assert m["actions_in_flight"] == 0 and m["in_flight_resources"]["gpu:H100"] == 0
    assert eng.cluster_in_flight("east")["gpu:H100"] == 0


def test_head_blocked_metric_reports_since_action_reason_and_demand():
    eng, clock = make_engine(config(clusters={"east": {"node_shapes": [
        {"count": 1, "allocatable": NODE}]}}))
    eng.enqueue(spec("busy", resources={"gpu": 4}))
    eng.tick()
    clock.advance(5)
    eng.enqueue(spec("gang", resources={"gpu": 8}))
    eng.tick()
    clock.advance(5)
    eng.tick()
    head = eng.queue_metrics("q")["head_blocked"]
    assert head["action"] == "acme/p/d/gang/a"
    assert head["since_ns"] == 5_000_000_000
    assert head["code"] == "CLUSTER_CAPACITY"
    assert head["demand"] == "gpu:H100=8"
    assert "cluster east has 4 free" in head["reason"]


def test_depth_refuses_with_resource_exhausted_and_stores_nothing():
    eng, _ = make_engine(config({"q": {"depth": 3}}))
    eng.enqueue_many([spec("a", f"x{i}") for i in range(2)])
    with pytest.raises(ResourceExhausted, match="queue q: depth 3 reached"):
        eng.enqueue_many([spec("b", f"y{i}") for i in range(2)])
    assert eng.queue_metrics("q")["depth"] == 2
    with pytest.raises(NotFound):
        eng.explain("acme/p/d/b/y0")


def test_bad_spec_in_a_batch_stores_nothing_and_says_what_is_wrong():
    eng, _ = make_engine(config())
    with pytest.raises(SpecError, match=r"batch item 1: action acme/p/d/r/b: resources: "
                                        r"unknown resource 'tpu'"):
        eng.enqueue_many([spec("r", "a"), spec("r", "b", resources={"tpu": 1})])
    assert eng.queue_metrics("q")["depth"] == 0
    with pytest.raises(SpecError, match="run_queue 'nope' does not exist"):
        eng.enqueue(spec("r", run_queue="nope"))
    with pytest.raises(SpecError, match="parent acme/p/d/r/zz not found"):
        eng.enqueue(spec("r", parent="acme/p/d/r/zz"))


def test_re_enqueue_is_idempotent_and_a_different_spec_is_refused():
    eng, _ = make_engine(config())
    eng.enqueue(spec("r"))
    eng.enqueue(spec("r"))
    assert eng.queue_metrics("q")["depth"] == 1
    with pytest.raises(AlreadyExists):
        eng.enqueue(spec("r", resources={"cpu": 2}))


def test_unknown_names_are_not_found():
    eng, _ = make_engine(config())
    with pytest.raises(NotFound):
        eng.update_queue("nope", depth=3)
    with pytest.raises(NotFound):
        eng.register_worker("w", "mars", 1)
    with pytest.raises(NotFound):
        eng.unregister_worker("ghost")


def test_an_oversized_item_refuses_the_whole_batch_and_stores_nothing():
    eng, _ = make_engine(config())
    huge = spec("r", "b", environment="e", resources={"memory": "1Ei"},
                reuse=ReusePolicy(replicas=8, concurrency=1))
    bad = spec("r", "c", resources={"cpu": 2**70})
    for item in (huge, bad):
        with pytest.raises(SpecError):
            eng.enqueue_many([spec("r", "a"), item])
    with pytest.raises(NotFound):
        eng.explain("acme/p/d/r/a")
    eng.enqueue(spec("r", "a"))
    assert [a.action.action for a in eng.tick()] == ["a"]


def test_bad_free_capacity_in_a_heartbeat_is_a_clear_error_and_changes_nothing():
    eng, _ = make_engine(config())
    eng.enqueue(spec("r"))
    [a] = eng.tick()
    for bad in ({"cpu": float("inf")}, {"cpu": 2**70}, {"tpu": 1}, {"cpu": "lots"}):
        with pytest.raises(SpecError, match="worker w-east: free_capacity: "):
            eng.heartbeat("w-east", [a.token], free_capacity=bad)
    assert eng.inspect().cluster_free(0)[2] == 16          # the gate's view is unchanged


def test_every_action_behind_a_capped_run_says_why():
    eng, _ = make_engine(config({"q": {"run_concurrency": 1}}))
    eng.enqueue_many([spec("r", f"a{i}", run_max_action_concurrency=2) for i in range(5)]
                     + [spec("s", f"b{i}") for i in range(3)])
    assert len(eng.tick()) == 2
    for i in range(2, 5):
        why = eng.explain(f"acme/p/d/r/a{i}")
        assert (why.wait, why.reason) == (
            WaitCode.RUN_ACTIONS, "run acme/p/d/r: max_action_concurrency 2 reached")
    for i in range(3):
        assert eng.explain(f"acme/p/d/s/b{i}").wait == WaitCode.QUEUE_RUNS


def test_a_placed_action_not_yet_dispatched_says_so():
    eng, _ = make_engine(config())
    eng.enqueue(spec("r"))
    assert eng.schedule() == 1
    why = eng.explain("acme/p/d/r/a")
    assert (why.phase, why.wait) == (Phase.QUEUED, WaitCode.PLACED)
    assert why.reason == ("queue q: assigned to east/w-east (generation 1); "
                          "waiting in the dispatch channel")
    eng.drain_dispatch()
    assert eng.phase("acme/p/d/r/a") == Phase.INITIALIZING


def test_a_warm_pool_on_a_cluster_the_queue_no_longer_allows_is_waited_for_truthfully():
    eng, clock = make_engine(config(clusters={
        "east": {"node_shapes": [{"count": 2, "allocatable": NODE}]},
        "west": {"node_shapes": [{"count": 2, "allocatable": NODE}]},
    }, queues={"q": {"clusters": ["east"]}}))
    reuse = ReusePolicy(replicas=1, concurrency=4, idle_ttl=30)
    eng.enqueue(spec("r", "p0", environment="env", reuse=reuse))
    [first] = eng.tick()
    assert first.cluster == "east"
    eng.update_queue("q", clusters=["west"])
    eng.enqueue(spec("r", "p1", environment="env", reuse=reuse))
    assert eng.tick() == []
    why = eng.explain("acme/p/d/r/p1")
    assert why.wait == WaitCode.POOL_ELSEWHERE
    assert why.reason == ("queue q: its warm pool runs on east, which the queue no longer "
                          "allows; it waits until that pool idles out")
    eng.complete(first.action, first.generation)
    clock.advance(31)
    [second] = eng.tick()                          # the old pool idled out: a new one, west
    assert second.cluster == "west"


def test_durations_given_as_timedelta_are_seconds_everywhere():
    from datetime import timedelta

    from engine import RetryPolicy, Timeouts
    eng, clock = make_engine(config(), workers={})
    slow = spec("r", "slow", timeouts=Timeouts(deadline=timedelta(seconds=5)),
                retries=RetryPolicy(count=1, backoff_base=timedelta(seconds=2)))
    pooled = spec("r", "pool", environment="env",
                  reuse=ReusePolicy(idle_ttl=timedelta(minutes=1)))
    eng.enqueue_many([slow, pooled])
    view = eng.inspect()
    assert eng.enqueue_many([slow, pooled]) == [view.action_at(0), view.action_at(1)]
    stored = view.record(view.row_of(slow.id)).spec
    assert stored.timeouts.deadline == 5.0 and stored.retries.backoff_base == 2.0
    assert view.record(view.row_of(pooled.id)).spec.reuse.idle_ttl == 60.0
    clock.advance(6)
    eng.schedule()
    assert eng.phase(slow.id) == Phase.TIMED_OUT


def test_decided_changes_name_what_a_tick_changed_on_its_own_before_it_placed_anything():
    """``Engine.decided_changes``: the actions whose phase the last schedule() changed on its
    own (runtime backstop, lease expiry, deadline, max_queued_time, unschedulable), each as
    of its change: a retry the same call leased again is QUEUED there, with its next attempt
    and the failure's text; nothing else (an assignment, a heartbeat) is named."""
    eng, clock = make_engine(config(engine={"heartbeat_interval": 10, "expiry_missed_beats": 1,
                                            "expiry_jitter": 0, "runtime_grace": 1,
                                            "pause_on_expiry": False}))
    assert eng.decided_changes() == ((), (), (), ())
    no_wait = RetryPolicy(count=1, backoff_base=0)
    slow = str(eng.enqueue(spec("rt", retries=no_wait, timeouts=Timeouts(max_runtime=5))))
    quiet = str(eng.enqueue(spec("ex", retries=RetryPolicy(count=0, backoff_base=0))))
    tokens = {str(a.action): a for a in eng.tick()}
    assert eng.decided_changes() == ((), (), (), ())        # assignments are drained, not here
    eng.mark_running(slow, tokens[slow].generation)
    clock.advance(7)                        # past max_runtime + grace; leases live (10 s)
    assert eng.heartbeat("w-east", [tokens[quiet].token]) == []
    eng.schedule()
    ids, phases, attempts, details = eng.decided_changes()
    assert (ids, phases, attempts) == ([slow], [Phase.QUEUED], [2])
    assert details[0].startswith("max_runtime: ")
    again = {str(a.action): a for a in eng.drain_dispatch()}
    assert again[slow].attempt == 2         # leased again by that same schedule()
    # The lease of ``quiet`` expires (no heartbeat); deadlines and unschedulable too.
    late = str(eng.enqueue(spec("dl", resources={"gpu": 8}, timeouts=Timeouts(deadline=1))))
    eng.enqueue(spec("hog", resources={"gpu": 8}))
    huge = str(eng.enqueue(spec("big", resources={"cpu": 1000})))
    clock.advance(5)
    assert eng.heartbeat("w-east", [again[slow].token]) == []
    clock.advance(6)                        # quiet's lease expired (last beat 11 s ago)
    eng.schedule()
    ids, phases, attempts, details = eng.decided_changes()
    got = dict(zip(ids, zip(phases, attempts, details, strict=True), strict=True))
    assert got[quiet][:2] == (Phase.QUEUED, 2) and "expired" in got[quiet][2]
    assert got[late][:2] == (Phase.TIMED_OUT, 1) and "deadline" in got[late][2]
    assert got[huge][:2] == (Phase.FAILED, 1) and "UNSCHEDULABLE" in got[huge][2]
    assert slow not in got and eng.phase(quiet) == Phase.QUEUED
    eng.schedule()                          # (the expiry's retry is due now: pushed, no change)
    assert quiet not in eng.decided_changes()[0]


def test_the_last_kernel_pass_is_timed_within_its_decision():
    eng, _ = make_engine(config({"q": {"action_concurrency": 1000}}, clusters={
        "east": {"node_shapes": [{"count": 40, "allocatable": NODE}]}}))
    view = eng.inspect()
    assert view.last_kernel_ns == 0         # no tick yet
    eng.enqueue_many([spec("A", f"a{i}") for i in range(1000)])
    t0 = time.perf_counter_ns()
    group = eng.decide()
    elapsed = time.perf_counter_ns() - t0
    eng.commit(group)
    first = view.last_kernel_ns
    assert group.placed == 1000
    assert 0 < first <= elapsed             # the kernel's pass is a part of the decision
    # The second tick has nothing to place: its pass is far shorter than the first's, so a
    # value left from the first tick would not fit within this decision's wall time.
    t0 = time.perf_counter_ns()
    group = eng.decide()
    elapsed = time.perf_counter_ns() - t0
    eng.commit(group)
    assert view.tick_no == 2 and group.placed == 0
    assert 0 < view.last_kernel_ns <= elapsed
