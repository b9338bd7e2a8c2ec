"""EASY backfill in STRICT_FIFO queues: the seed's example, the two rules, overruns, bounds,
ETAs, reservations across queues, and a property: with exact predictions backfill never delays
the first blocked head (of the first queue visited, with several queues)."""

import heapq
from dataclasses import replace

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import ActionSpec, Engine, PodGroup, WaitCode
from engine._history import RuntimeHistory
from storage import MemoryStore, partition_of
from tests.conftest import make_engine, start_running

NODE = {"cpu": 96, "memory": "1Ti", "gpu:H100": 8}
S = 1_000_000_000
# A history of equal runtimes predicts them exactly (the mean of the last two).
EDGES = [int(1e9 * 1.24 ** i) for i in range(75)]     # 1 s to ~ 2.6 h, 24% apart
T10 = 4_400_000_000     # 4.4 s
T100 = 56_000_000_000   # 56 s
T500 = 311_000_000_000  # 311 s


def config(backfill=True, nodes=1, max_candidates=4096, **queue):
    return {
        "resources": ["cpu", "memory", "gpu:H100"],
        "clusters": {"east": {"node_shapes": [{"name": "h100", "count": nodes,
                                               "allocatable": NODE}]}},
        "queues": {"gpu": {"scheduling": "STRICT_FIFO", "backfill": backfill, **queue}},
        # Leases outlive every runtime here without heartbeats (the tests drive no workers).
        "engine": {"default_queue": "gpu", "max_candidates": max_candidates,
                   "heartbeat_interval": 1e7},
    }


def _task(eng, action):
    view = eng.inspect()
    return view.record(view.row_of(action)).spec.task


def act(run, task, name="a", **kw):
    return ActionSpec(id=f"acme/ml/prod/{run}/{name}", task=task, **kw)


def gpus(run, task, n, cpu=1, name="a"):
    return act(run, task, name, resources={"cpu": cpu, "gpu": n})


def cpu_job(run, task, cpu=4, name="a"):
    return act(run, task, name, resources={"cpu": cpu})


def gang(run, task="train", pods=3, per_pod=2):
    return act(run, task, pods=(PodGroup("worker", pods, {"cpu": 4, "gpu": per_pod}),))


def warm(eng, *specs, **runtimes_ns):
    """Give tasks a history of exact runtimes by loading records (as storage would). History
    is per task and shape: each task is taught at the shapes of ``gpus(run, task, 1 or 2)``
    and ``cpu_job(run, task)``, and at the shape of each spec of ``specs`` (its task's
    runtime)."""
    h = RuntimeHistory()
    shapes = [spec for task in runtimes_ns
              for spec in (gpus("w", task, 1), gpus("w", task, 2), cpu_job("w", task))]
    for spec in (*shapes, *specs):
        key = eng.history_key(spec)
        for _ in range(5):
            h.record_ns(key, runtimes_ns[spec.task])
        eng.load_history(key, h.encode(key))


def start(eng, clock, specs):
    """Enqueue and place ``specs`` now, running; returns the assignments."""
    return start_running(eng, specs)


def runs(placed):
    return sorted(a.action.run for a in placed)


# ---------------------------------------------------------------------------------------------
# The seed's example


def _seed_example(backfill):
    """A 6-GPU gang blocked behind four running 2-GPU actions on an 8-GPU cluster, and a
    CPU-only job behind it. History comes from running and completing earlier attempts.
    Returns (when the CPU job started, when the gang started), in ns."""
    eng, clock = make_engine(config(backfill=backfill))
    # Teach the history: one earlier attempt of each task, run to success.
    for task, ns in (("small", T100), ("etl", T10), ("train", T500)):
        spec = gpus(f"hist-{task}", task, 2) if task != "etl" else cpu_job("hist-etl", "etl")
        [a] = start(eng, clock, [spec])
        clock.advance(ns / 1e9)
        eng.complete(a.action, a.generation)
    assert eng.history.count(eng.history_key(gpus("x", "small", 2))) == 1
    assert eng.predicted_runtime(eng.history_key(cpu_job("x", "etl"))) == T10 / 1e9
    t0 = clock.now_ns()
    smalls = start(eng, clock, [gpus(f"s{i}", "small", 2) for i in range(4)])
    assert len(smalls) == 4
    eng.enqueue(gang("g"))
    eng.enqueue(cpu_job("c", "etl"))
    started = {}
    live = {a.action.run: (a, t0 + T100) for a in smalls}
    now = t0
    while "g" not in started:
        for a in eng.tick():
            eng.mark_running(a.action, a.generation)
            started[a.action.run] = now
            rt = {"etl": T10, "train": T500}[_task(eng, a.action)]
            live[a.action.run] = (a, now + rt)
        due = min(end for _a, end in live.values())
        clock.set_ns(due)
        now = due
        for run, (a, end) in list(live.items()):
            if end == due:
                eng.complete(a.action, a.generation)
                del live[run]
        assert now < t0 + 10 * T500, "the gang never started"
    return started["c"] - t0, started["g"] - t0, eng


def test_seed_example_cpu_job_backfills_and_the_gang_is_not_delayed():
    c_off, g_off, eng_off = _seed_example(backfill=False)
    c_on, g_on, eng_on = _seed_example(backfill=True)
    assert c_off == T100          # without backfill the CPU job waits for the gang's start
    assert c_on == 0              # with backfill it runs in the gap at once
    assert g_on <= g_off == T100  # and the gang starts no later
    assert eng_on.queue_metrics("gpu")["backfilled"] == 1
    assert eng_off.queue_metrics("gpu")["backfilled"] == 0


def test_without_backfill_the_cpu_job_waits_head_of_line():
    eng, clock = make_engine(config(backfill=False))
    warm(eng, small=T100, etl=T10)
    start(eng, clock, [gpus(f"s{i}", "small", 2) for i in range(4)])
    eng.enqueue(gang("g"))
    eng.enqueue(cpu_job("c", "etl"))
    assert eng.tick() == []
    why = eng.explain("acme/ml/prod/c/a")
    assert why.wait == WaitCode.HEAD_OF_LINE
    assert "position 2 in queue gpu" in why.reason and why.position == 2


# ---------------------------------------------------------------------------------------------
# Rule (a): ends before the shadow time


def _gap_setup(backfill=True, **queue):
    """Two 2-GPU actions run (history T100); an 8-GPU head waits for both: its shadow time is
    T100 and it leaves no extra GPU, so only rule (a) can place GPU work in the gap."""
    eng, clock = make_engine(config(backfill=backfill, **queue))
    warm(eng, small=T100, quick=T10, slow=T500)
    start(eng, clock, [gpus(f"s{i}", "small", 2) for i in range(2)])
    eng.enqueue(act("g", "train", resources={"cpu": 8, "gpu": 8}))
    return eng, clock


def test_rule_a_places_what_ends_before_the_shadow_time():
    eng, clock = _gap_setup()
    eng.enqueue(gpus("q", "quick", 2))
    eng.enqueue(gpus("sl", "slow", 2))          # would end after the shadow time
    placed = eng.tick()
    assert runs(placed) == ["q"]
    assert eng.explain("acme/ml/prod/sl/a").wait == WaitCode.HEAD_OF_LINE
    head = eng.explain("acme/ml/prod/g/a")
    assert head.wait == WaitCode.CLUSTER_CAPACITY
    assert head.eta_ns == clock.now_ns() + T100
    assert f"estimated start in {T100 / 1e9:.1f}s" in head.reason
    m = eng.queue_metrics("gpu")
    assert m["head_eta_ns"] == head.eta_ns and m["backfilled"] == 1


def test_no_history_never_backfills_by_rule_a():
    eng, _ = _gap_setup()
    # A shape no task ran at (3 cpu): no history of its own, no prior of its shape.
    eng.enqueue(gpus("n", "never-seen", 2, cpu=3))
    assert eng.tick() == []
    assert eng.predicted_runtime_of("acme/ml/prod/n/a") is None
    assert eng.explain("acme/ml/prod/n/a").wait == WaitCode.HEAD_OF_LINE
    # Once the task has history, the same action backfills.
    warm(eng, gpus("w", "never-seen", 2, cpu=3), **{"never-seen": T10})
    assert runs(eng.tick()) == ["n"]


def test_a_task_without_history_is_predicted_its_shapes_runtime_but_not_backfilled_on_it():
    # small (T100) and quick (T10) ran at 2 GPUs: a new task at that shape is predicted
    # their mean (30.2 s). Two of it run; the 8-GPU head waits for both.
    eng, clock = make_engine(config())
    warm(eng, small=T100, quick=T10)
    start(eng, clock, [gpus(f"s{i}", "never-seen", 2) for i in range(2)])
    prior = (T100 + T10) // 2
    assert eng.predicted_runtime_of("acme/ml/prod/s0/a") == prior / S
    assert eng.predicted_runtime(eng.history_key(gpus("n", "never-seen", 2))) is None
    eng.enqueue(act("g", "train", resources={"cpu": 8, "gpu": 8}))
    eng.enqueue(gpus("q", "quick", 2))          # its own history: ends before the shadow
    eng.enqueue(gpus("n", "other-new", 2))      # predicted by the prior alone
    # The prior gives the live leases an end, so the head a shadow time and a gap that
    # history-proven work backfills; it proves nothing for a candidate (rule (a)).
    assert runs(eng.tick()) == ["q"]
    assert eng.explain("acme/ml/prod/g/a").eta_ns == clock.now_ns() + prior
    assert eng.explain("acme/ml/prod/n/a").wait == WaitCode.HEAD_OF_LINE
    # A first success of its own replaces the prior, and moves the prior of the shape's
    # other keys without history: (T100 + T10 + 3 s) / 3.
    clock.advance(3)
    eng.complete("acme/ml/prod/s0/a", 1)
    assert eng.predicted_runtime(eng.history_key(gpus("n", "never-seen", 2))) == 3
    assert eng.predicted_runtime_of("acme/ml/prod/n/a") == pytest.approx(
        (T100 + T10 + 3 * S) / 3 / S)
    # Another shape's prior is its own.
    eng.enqueue(gpus("c", "other-new", 2, cpu=3))
    assert eng.predicted_runtime_of("acme/ml/prod/c/a") is None


def test_head_without_known_shadow_time_gets_no_eta_and_no_gap():
    eng, clock = make_engine(config())
    warm(eng, quick=T10)
    # No history, and no task ran at their shape (3 cpu): no prior either.
    start(eng, clock, [gpus(f"s{i}", "unknown", 2, cpu=3) for i in range(2)])
    eng.enqueue(act("g", "train", resources={"cpu": 8, "gpu": 8}))
    eng.enqueue(gpus("q", "quick", 2))
    assert eng.tick() == []
    assert eng.explain("acme/ml/prod/g/a").eta_ns is None
    assert eng.queue_metrics("gpu")["head_eta_ns"] is None


def test_overrun_closes_the_gap_and_the_head_keeps_its_hold():
    eng, clock = _gap_setup()
    eng.enqueue(gpus("q1", "quick", 2))
    [q1] = eng.tick()
    eng.mark_running(q1.action, q1.generation)
    clock.advance(2 * T10 / 1e9)                # q1 outlives its prediction, still live
    eng.enqueue(gpus("q2", "quick", 2))
    assert eng.tick() == []                      # no rule (a) while the overrun lasts
    assert eng.explain("acme/ml/prod/q2/a").wait == WaitCode.HEAD_OF_LINE
    head = eng.explain("acme/ml/prod/g/a")
    assert head.wait == WaitCode.CLUSTER_CAPACITY
    assert eng.queue_metrics("gpu")["head_blocked"]["action"] == "acme/ml/prod/g/a"
    eng.complete(q1.action, q1.generation)       # the overrun ends: the gap reopens
    assert runs(eng.tick()) == ["q2"]


# ---------------------------------------------------------------------------------------------
# Rule (b): extra capacity at the shadow time


def _extra_setup():
    """Four 1-cpu 2-GPU actions run (history T100); a 6-GPU gang (12 cpu) waits: at its
    shadow time 96 cpu and 8 GPUs are free, so its extra is 84 cpu and 2 GPUs."""
    eng, clock = make_engine(config())
    warm(eng, small=T100)
    start(eng, clock, [gpus(f"s{i}", "small", 2) for i in range(4)])
    eng.enqueue(gang("g"))
    return eng, clock


def test_rule_b_places_work_without_history_inside_the_extra_capacity():
    eng, _ = _extra_setup()
    # No history: only rule (b). 30 + 30 cpu fit the 84 cpu extra; the third 30 would not
    # (24 left) although 32 cpu are free now.
    eng.enqueue_many([cpu_job(f"c{i}", "etl-unknown", cpu=30) for i in range(3)])
    placed = eng.tick()
    assert runs(placed) == ["c0", "c1"]
    assert eng.explain("acme/ml/prod/c2/a").wait == WaitCode.HEAD_OF_LINE
    assert eng.cluster_in_flight("east")["cpu"] == 4_000 + 60_000
    assert eng.queue_metrics("gpu")["backfilled"] == 2


def test_rule_b_never_takes_what_the_head_needs():
    eng, _ = _extra_setup()
    # No GPU is free now. When one small ends early, 2 GPUs are free and the extra at the
    # shadow time is 2 GPUs: one 2-GPU job without history may take them, not two.
    eng.enqueue_many([gpus(f"x{i}", "unknown", 2) for i in range(2)])
    assert eng.tick() == []
    eng.complete("acme/ml/prod/s0/a", 1)
    assert runs(eng.tick()) == ["x0"]
    assert eng.explain("acme/ml/prod/x1/a").wait == WaitCode.CLUSTER_CAPACITY
    assert eng.explain("acme/ml/prod/g/a").wait == WaitCode.CLUSTER_CAPACITY


# ---------------------------------------------------------------------------------------------
# Bounds and the rest of the gate


def test_max_candidates_bounds_the_backfill_tests_per_tick():
    # Backfill has no bound of its own: each test is part of one candidate's examination,
    # so the queue's candidate budget bounds them (the head is one of the three).
    eng, clock = make_engine(config(max_candidates=3))
    warm(eng, gpus("w", "small", 4), small=T100, etl=T10)
    assert len(start(eng, clock, [gpus(f"s{i}", "small", 4) for i in range(2)])) == 2
    eng.enqueue(gang("g"))
    eng.enqueue_many([cpu_job(f"c{i}", "etl") for i in range(5)])
    assert len(eng.tick()) == 2
    assert len(eng.tick()) == 2
    assert len(eng.tick()) == 1
    assert eng.queue_metrics("gpu")["backfilled"] == 5


# ---------------------------------------------------------------------------------------------
# Reservations across queues

T200 = 200_000_000_000  # 200 s


def _queues_setup(lo_backfill=True, mid=None):
    """One 8-GPU node; queues hi (300) and lo (100), STRICT_FIFO with backfill (and ``mid``
    (200), a queue config, when given). Running in hi: two 2-GPU ``small`` (T100) and two
    2-GPU ``slow`` (T500). hi's head, a 6-GPU gang (12 cpu), waits until T500 (at T100 only 4
    GPUs are free) and leaves 84 cpu at its shadow time."""
    cfg = config()
    cfg["queues"] = {"hi": {"scheduling": "STRICT_FIFO", "backfill": True, "priority": 300},
                     "lo": {"scheduling": "STRICT_FIFO", "backfill": lo_backfill,
                            "priority": 100}}
    if mid is not None:
        cfg["queues"]["mid"] = {"scheduling": "STRICT_FIFO", "priority": 200, **mid}
    cfg["engine"]["default_queue"] = "hi"
    eng, clock = make_engine(cfg)
    warm(eng, small=T100, slow=T500, etl=T10, mid=T200)
    start(eng, clock, [gpus(f"s{i}", "small", 2) for i in range(2)]
          + [gpus(f"l{i}", "slow", 2) for i in range(2)])
    eng.enqueue(gang("g"))
    return eng, clock


def lo(spec, queue="lo"):
    return replace(spec, task_queue=queue)


def enqueue_warm(eng, *specs):
    """Enqueue ``specs`` with an exact history of their task's runtime at their shape."""
    rt = {"etl": T10, "mid": T200, "slow": T500, "small": T100, "long": 2 * T500}
    for spec in specs:
        warm(eng, spec, **{spec.task: rt[spec.task]})
    eng.enqueue_many(list(specs))


def test_a_lower_queue_backfills_under_a_higher_queues_head():
    eng, clock = _queues_setup()
    enqueue_warm(eng, lo(cpu_job("e", "etl")),              # ends at T10 < T500: rule (a)
                 lo(cpu_job("fits", "long", cpu=80)),       # runs past T500, within the 84
                 lo(cpu_job("more", "long", cpu=8)))        # 80 taken: 4 left
    assert runs(eng.tick()) == ["e", "fits"]
    assert eng.explain("acme/ml/prod/g/a").wait == WaitCode.CLUSTER_CAPACITY
    view = eng.explain("acme/ml/prod/more/a")
    assert view.wait == WaitCode.HEAD_OF_LINE
    assert "g/train" in view.reason, view.reason
    assert eng.queue_metrics("lo")["backfilled"] == 2
    assert eng.queue_metrics("hi")["backfilled"] == 0


def test_without_backfill_in_the_lower_queue_it_waits_behind_the_higher_head():
    eng, clock = _queues_setup(lo_backfill=False)
    enqueue_warm(eng, lo(cpu_job("e", "etl")))
    assert eng.tick() == []
    assert eng.explain("acme/ml/prod/e/a").wait == WaitCode.HEAD_OF_LINE


def test_a_candidate_respects_every_reservation_before_it():
    # lo's own head (4 GPUs, 20 cpu) reserves too: it could start at T100 and leaves 74 cpu
    # then. A 200 s job ends before hi's head (T500) can start, not before lo's: against lo's
    # reservation it may take only those 74 cpu.
    eng, clock = _queues_setup()
    eng.enqueue(lo(gpus("h", "big", 4, cpu=20)))
    enqueue_warm(eng, lo(cpu_job("m80", "mid", cpu=80)), lo(cpu_job("m70", "mid", cpu=70)))
    assert runs(eng.tick()) == ["m70"]
    assert eng.explain("acme/ml/prod/m80/a").wait == WaitCode.HEAD_OF_LINE


def test_a_head_of_a_queue_without_backfill_closes_its_clusters_to_later_queues():
    eng, clock = _queues_setup(mid={"backfill": False})
    eng.enqueue(lo(gpus("m", "small", 2), "mid"))
    enqueue_warm(eng, lo(cpu_job("e", "etl")))
    assert eng.tick() == []
    assert eng.explain("acme/ml/prod/e/a").wait == WaitCode.HEAD_OF_LINE


def test_queue_action_concurrency_still_applies_to_backfill():
    eng, _ = _gap_setup(action_concurrency=3)     # 2 running: one slot left
    eng.enqueue_many([gpus(f"q{i}", "quick", 1) for i in range(3)])
    assert len(eng.tick()) == 1
    assert eng.queue_metrics("gpu")["actions_in_flight"] == 3


def test_queue_budget_still_applies_to_backfill():
    eng, _ = _gap_setup(max_resources={"cpu": 4})  # 2 cpu in flight, 2 left
    eng.enqueue(cpu_job("big", "quick", cpu=3))
    assert eng.tick() == []
    assert eng.explain("acme/ml/prod/big/a").wait in (WaitCode.QUEUE_BUDGET,
                                                      WaitCode.HEAD_BUDGET)
    assert eng.queue_metrics("gpu")["backfilled"] == 0


def test_backfill_can_be_switched_live():
    eng, _ = _gap_setup(backfill=False)
    eng.enqueue(gpus("q", "quick", 2))
    assert eng.tick() == []
    eng.update_queue("gpu", backfill=True)
    assert runs(eng.tick()) == ["q"]
    eng.update_queue("gpu", backfill=False)
    eng.enqueue(gpus("q2", "quick", 2))
    assert eng.tick() == []


def test_history_records_successes_only():
    eng, clock = make_engine(config())
    [a] = start(eng, clock, [cpu_job("ok", "etl")])
    clock.advance(3)
    eng.complete(a.action, a.generation)
    [b] = start(eng, clock, [cpu_job("bad", "etl")])
    clock.advance(100)
    eng.complete(b.action, b.generation, "FAILED", recoverable=False)
    key = eng.history_key(cpu_job("x", "etl"))
    assert eng.history.count(key) == 1
    assert eng.predicted_runtime(key) == 3
    # The history is durable: a restart on the same store predicts the same.
    store = eng.store
    eng.close()
    again = Engine(eng.config, clock=clock,
                   store=MemoryStore(store.partitions, backing=store.backing))
    assert again.history.count(key) == 1 and again.predicted_runtime(key) == 3


class RecordingStore(MemoryStore):
    """A MemoryStore remembering the partitions each group commit wrote."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.groups = []

    def commit(self, batch):
        self.groups.append(sorted(p for p, ops in batch.items() if ops))
        return super().commit(batch)


def test_runtime_samples_leave_a_success_on_its_partition_and_reach_the_store_within_1s():
    """A success's runtime sample is history, not a transition: the group that records the
    success writes the tenant's partition only; the sample follows within a second (engine
    clock) with the next group, or with close."""
    store = RecordingStore(16)
    eng, clock = make_engine(config(), store=store)
    clock.advance(5)                    # past the first flush's due time
    a_run = act("r1", "etl").id.rsplit("/", 1)[0]
    part = partition_of(a_run.split("/")[0], 16)
    assert part != 0                    # else the sample would ride along at once
    [a] = start(eng, clock, [cpu_job("r1", "etl")])
    clock.advance(3)
    eng.complete(a.action, a.generation)
    assert store.groups[-1] == [part]   # the success alone: no partition 0, no redo record
    key = eng.history_key(cpu_job("r1", "etl"))
    assert eng.predicted_runtime(key) is not None
    assert stored_samples(store, "etl") == 0    # not in the store yet (a crash loses it)
    clock.advance(1)
    eng.enqueue(cpu_job("r2", "etl"))   # any group after the flush is due carries it
    assert 0 in store.groups[-1] and stored_samples(store, "etl") == 1
    clock.advance(3)
    [b] = [x for x in eng.tick() if x.action.run == "r2"]
    eng.mark_running(b.action, b.generation)
    clock.advance(3)
    eng.complete(b.action, b.generation)
    eng.close()                         # close writes what is left
    twin = Engine(eng.config, clock=clock, store=MemoryStore(16, backing=store.backing))
    assert twin.history.count(key) == 2


def stored_samples(store, task):
    """How many runtime samples of ``task`` the store's history record holds."""
    for _p, _key, raw in store.scan("history"):
        name, shape, data = msgpack.unpackb(raw)
        if name == task and data is not None:
            h = RuntimeHistory()
            h.load((name, shape), data)
            return h.count((name, shape))
    return 0


def test_waiting_actions_report_their_position():
    eng, _ = _gap_setup(backfill=False)
    eng.enqueue_many([gpus(f"w{i}", "slow", 2) for i in range(3)])
    eng.tick()
    assert [eng.explain(f"acme/ml/prod/w{i}/a").position for i in range(3)] == [2, 3, 4]
    assert eng.explain("acme/ml/prod/g/a").position == 1


# ---------------------------------------------------------------------------------------------
# Property: with exact predictions, backfill never delays the first blocked head


def two_clusters(backfill, budget=None, admission="shapes"):
    """east: two 8-GPU nodes; west: one. The queue may use both (with a GPU budget)."""
    cfg = config(backfill=backfill, **({"max_resources": {"gpu:H100": budget}}
                                       if budget is not None else {}))
    cfg["clusters"] = {
        "east": {"admission": admission,
                 "node_shapes": [{"name": "h100", "count": 2, "allocatable": NODE}]},
        "west": {"admission": admission,
                 "node_shapes": [{"name": "h100", "count": 1, "allocatable": NODE}]},
    }
    return cfg


QUEUES = (("hi", 300), ("mid", 200), ("lo", 100))


def simulate(jobs, runtimes, backfill, budget=None, queues=False, admission="shapes"):
    """Deterministic event-driven run of ``jobs`` [(submit_ns, task, gpus, cpu, pods[,
    queue])] on :func:`two_clusters` (``queues``: with the three STRICT_FIFO queues of
    ``QUEUES`` instead of one, every one with ``backfill``). Tasks run exactly
    ``runtimes[task]`` ns, which their warm history predicts. Returns (first blocked head,
    its queue, {run: start_ns}): the head of the first queue, by priority, with a head
    blocked in the first tick that blocked any."""
    cfg = two_clusters(backfill, budget, admission)
    names = ["gpu"]
    if queues:
        cfg["queues"] = {name: {"scheduling": "STRICT_FIFO", "backfill": backfill,
                                "priority": priority} for name, priority in QUEUES}
        cfg["engine"]["default_queue"] = "hi"
        names = [name for name, _ in QUEUES]
    eng, clock = make_engine(cfg)
    events = []          # (time, kind, seq, payload): completions (0) before submissions (1)
    for i, (t, task, g, c, pods, *queue) in enumerate(jobs):
        heapq.heappush(events, (t, 1, i, (task, g, c, pods, *queue)))
    starts, first_head, first_queue, seq = {}, None, None, 0
    while events:
        now = events[0][0]
        clock.set_ns(now)
        while events and events[0][0] == now:
            _t, kind, i, payload = heapq.heappop(events)
            if kind == 0:
                eng.complete(payload[0], payload[1])
                continue
            task, g, c, pods, *queue = payload
            where = {"task_queue": queue[0]} if queue else {}
            if pods > 1:
                group = PodGroup("worker", pods, {"cpu": c, "gpu": max(g, 1)})
                spec = act(f"j{i}", task, pods=(group,), **where)
            else:
                spec = act(f"j{i}", task, resources={"cpu": c, "gpu": g} if g else {"cpu": c},
                           **where)
            if eng.history.count(eng.history_key(spec)) == 0:
                warm(eng, spec, **{task: runtimes[task]})   # history per task and shape
            eng.enqueue(spec)
        for a in eng.tick():
            eng.mark_running(a.action, a.generation)
            starts[a.action.run] = now
            task = _task(eng, a.action)
            seq += 1
            heapq.heappush(events, (now + runtimes[task], 0, seq, (a.action, a.generation)))
        for name in names if first_head is None else ():
            blocked = eng.queue_metrics(name)["head_blocked"]
            if blocked is not None:
                first_head, first_queue = blocked["action"].split("/")[3], name
                break
    return first_head, first_queue if first_head is not None else None, starts


job = st.tuples(st.integers(0, 20), st.sampled_from(["a", "b", "c", "d"]),
                st.integers(0, 8), st.integers(1, 64), st.sampled_from([1, 1, 1, 2, 3]))
queued_job = st.tuples(st.integers(0, 20), st.sampled_from(["a", "b", "c", "d"]),
                       st.integers(0, 8), st.integers(1, 64), st.sampled_from([1, 1, 1, 2, 3]),
                       st.sampled_from(["hi", "hi", "mid", "lo"]))


@settings(max_examples=60, deadline=None)
@given(st.lists(job, min_size=2, max_size=16),
       st.lists(st.sampled_from(EDGES[40:70]), min_size=4, max_size=4))
def test_backfill_never_delays_the_first_blocked_head(raw, edges):
    _never_delays(raw, edges, budget=None)


@settings(max_examples=60, deadline=None)
@given(st.lists(job, min_size=2, max_size=16),
       st.lists(st.sampled_from(EDGES[40:70]), min_size=4, max_size=4),
       st.sampled_from([8, 12, 16]))
def test_budget_backfill_never_delays_the_first_blocked_head(raw, edges, budget):
    # The same, with a GPU budget below the clusters' 24 GPUs: heads wait for the budget.
    _never_delays([j for j in raw if j[2] * j[4] <= budget], edges, budget=budget)


@settings(max_examples=80, deadline=None)
@given(st.lists(queued_job, min_size=2, max_size=16),
       st.lists(st.sampled_from(EDGES[40:70]), min_size=4, max_size=4))
def test_backfill_across_queues_never_delays_the_first_queues_blocked_head(raw, edges):
    # Three queues, every one with backfill: a candidate of any queue may start on a cluster
    # held by a head of its own queue or of a higher one when it respects every reservation
    # made before it in the pass. The first queue visited has no reservation before its own
    # head's, so that head starts no later than without backfill anywhere. (A head of a
    # later queue has no such guarantee: a higher queue may take what it waits for, with or
    # without backfill.)
    _never_delays(raw, edges, budget=None, queues=True)


@settings(max_examples=80, deadline=None)
@given(st.lists(job, min_size=2, max_size=16),
       st.lists(st.sampled_from(EDGES[40:70]), min_size=4, max_size=4))
def test_backfill_on_nodes_never_delays_the_first_blocked_head(raw, edges):
    # The same with every pod placed on nodes (admission = "nodes"): the head's shadow time
    # is when its pods can be placed, and rule (b) keeps them placeable beside a backfill.
    _never_delays(raw, edges, budget=None, admission="nodes")


def _never_delays(raw, edges, budget, queues=False, admission="shapes"):
    runtimes = dict(zip("abcd", edges, strict=True))
    jobs = [(t * S, *rest) for t, *rest in raw]
    head_off, queue_off, starts_off = simulate(jobs, runtimes, False, budget, queues,
                                               admission)
    head_on, queue_on, starts_on = simulate(jobs, runtimes, True, budget, queues, admission)
    assert (head_on, queue_on) == (head_off, queue_off)    # identical until the first block
    assert set(starts_on) == set(starts_off)   # the same jobs ran (a gang too big fails)
    if head_off is not None and queue_off in ("gpu", "hi"):
        assert starts_on[head_off] <= starts_off[head_off]


def test_budget_backfill_regression_the_heads_budget_is_not_backfilled():
    # Found by the property above (a pre-existing bug): at 51 s j0 ends and the head j1
    # (6 GPUs, 96 cpu) is within the 8-GPU budget but short of cpu on both clusters, its
    # shadow time on east 63 s. j4 (6 GPUs, 78 s) fit east's extra capacity then (rule (b)),
    # so it was backfilled and took the 6 GPUs of budget the head needed: the head started
    # at 129 s (when j4 ended) instead of 63 s.
    raw = [(0, "a", 0, 10, 3), (7, "d", 2, 32, 3), (0, "b", 0, 49, 2), (0, "c", 0, 1, 1),
           (7, "c", 3, 5, 2)]
    edges = [51_093_785_693, 63_252_440_114, 78_304_457_697, 819_573_124_867]
    _never_delays(raw, edges, budget=8)
    runtimes = dict(zip("abcd", edges, strict=True))
    jobs = [(t * S, *rest) for t, *rest in raw]
    head, _queue, starts = simulate(jobs, runtimes, backfill=True, budget=8)
    assert head == "j1" and starts["j1"] == edges[1] and starts["j4"] == edges[1] + edges[3]


def test_cluster_backfill_spends_only_the_budget_beyond_the_heads_demand():
    """One 2-node cluster, 8 GPUs of budget: two 49-cpu 1-GPU actions run (history T100), a
    96-cpu 6-GPU head is within budget (6 left) but short of cpu (94 free). Its extra at the
    shadow time is 96 cpu and 10 GPUs, but none of the budget: GPU work may not backfill by
    either rule; cpu-only work still may."""
    eng, clock = make_engine(config(nodes=2, max_resources={"gpu:H100": 8}))
    warm(eng, gpus("s", "small", 1, cpu=49), small=T100, quick=T10)
    start(eng, clock, [gpus(f"s{i}", "small", 1, cpu=49) for i in range(2)])
    eng.enqueue(act("g", "train", resources={"cpu": 96, "gpu": 6}))
    eng.enqueue(gpus("x", "unknown", 6, cpu=10))     # rule (b) by capacity: the head's budget
    eng.enqueue(gpus("q", "quick", 2))               # rule (a) by time: budget too
    eng.enqueue(cpu_job("c", "unknown", cpu=30))     # no GPU: inside the extra, budget spared
    assert runs(eng.tick()) == ["c"]
    assert eng.explain("acme/ml/prod/g/a").wait == WaitCode.CLUSTER_CAPACITY
    for run in ("x", "q"):      # as without backfill: behind the head's hold on east
        assert eng.explain(f"acme/ml/prod/{run}/a").wait == WaitCode.HEAD_OF_LINE
    # The smalls end at the shadow time: the head starts then, with its budget intact.
    clock.set_ns(clock.now_ns() + T100)
    for i in range(2):
        eng.complete(f"acme/ml/prod/s{i}/a", 1)
    assert "g" in runs(eng.tick())


def _assert_waits_for_heads_budget(eng, run, dim="gpu:H100"):
    view = eng.inspect()
    row = view.row_of(f"acme/ml/prod/{run}/a")
    assert eng.explain(f"acme/ml/prod/{run}/a").wait == WaitCode.HEAD_BUDGET
    assert view.arrays.a_wait_dim[row] == ["cpu", "memory", "gpu:H100"].index(dim)
    assert view.arrays.a_wait_blocker[row] == view.row_of("acme/ml/prod/g/a")
    # The reason names the budget dimension this row is short of, not the head's own wait.
    assert f"(needs {dim}=" in eng.explain(f"acme/ml/prod/{run}/a").reason


def test_budget_backfill_regression_no_later_action_takes_the_heads_budget_elsewhere():
    # Found by the property with more examples once the rule (b) case was fixed: at 0 s the
    # head j5 (9 GPUs, fits east only) is within the 12-GPU budget (10 left) but short of cpu
    # on east until 51 s. At 1 s j7 (1 GPU) is backfilled on east by rule (b) within the
    # budget beyond the head's demand; without backfill it would have waited holding west.
    # So j8 (3 GPUs), which no longer waited behind j7's hold, started on west as ordinary
    # work and took 3 GPUs of the head's budget: the head started at 52 s instead of 51 s.
    raw = [(0, "a", 0, 1, 1), (0, "a", 0, 1, 1), (0, "a", 0, 1, 1), (0, "a", 0, 1, 1),
           (0, "a", 0, 42, 2), (0, "a", 3, 35, 3), (0, "a", 0, 60, 1), (1, "a", 1, 37, 1),
           (1, "a", 0, 1, 3)]
    t = 51_093_785_693
    _never_delays(raw, [t] * 4, budget=12)
    head, _queue, starts = simulate([(s * S, *rest) for s, *rest in raw], dict.fromkeys("abcd", t),
                            backfill=True, budget=12)
    assert head == "j5" and starts["j5"] == t and starts["j7"] == S and starts["j8"] == S + t


def test_backfill_head_reserves_its_budget_against_work_on_other_clusters():
    """Two clusters, 12 GPUs of budget: a 9-GPU gang (fits east only) is within budget (11
    left) but short of cpu on east. With backfill on, later work of the queue may start on
    west, which the head does not hold, only within the budget beyond the head's demand.
    Without backfill it takes what it fits (the head holds clusters, not budget)."""
    started = {}
    for backfill in (False, True):
        eng, clock = make_engine(two_clusters(backfill, budget=12))
        warm(eng, gpus("s0", "small", 1, cpu=90), small=T100)
        assert [a.cluster for a in start(eng, clock, [gpus("s0", "small", 1, cpu=90)])] == [
            "east"]
        eng.enqueue(act("g", "train", pods=(PodGroup("worker", 3, {"cpu": 35, "gpu": 3}),)))
        eng.enqueue(gpus("y", "unknown", 3))            # 3 of the 11 GPUs: 8 left < 9
        eng.enqueue(cpu_job("z", "unknown", cpu=30))    # no GPU
        eng.enqueue(gpus("w", "unknown", 2))            # 2 of the 11: 9 left, enough
        placed = eng.tick()
        assert {a.cluster for a in placed} == {"west"}
        assert eng.explain("acme/ml/prod/g/a").wait == WaitCode.CLUSTER_CAPACITY
        started[backfill] = runs(placed)
        if backfill:
            _assert_waits_for_heads_budget(eng, "y")
            assert eng.queue_metrics("gpu")["backfilled"] == 0   # ordinary work on west
            # s0 ends at the shadow time: the head starts then, its budget intact.
            clock.set_ns(clock.now_ns() + T100)
            eng.complete("acme/ml/prod/s0/a", 1)
            assert "g" in runs(eng.tick())
    assert started == {False: ["w", "y", "z"], True: ["w", "z"]}


def _live_lists(eng):
    return [set(rows) for rows in eng.inspect().live_lists()]


def test_live_lists_follow_assignments_and_releases_and_can_be_rebuilt():
    eng, clock = make_engine(config(nodes=2))
    placed = start(eng, clock, [gpus(f"s{i}", "small", 2) for i in range(6)])
    view = eng.inspect()
    rows = {view.row_of(a.action) for a in placed}
    assert _live_lists(eng) == [rows]
    eng.complete(placed[0].action, placed[0].generation)
    eng.abort(placed[1].action)
    rows -= {view.row_of(a.action) for a in placed[:2]}
    assert _live_lists(eng) == [rows]
    # The lists are derived state: a restart on the same store rebuilds them.
    store = eng.store
    eng.close()
    again = Engine(eng.config, clock=clock,
                   store=MemoryStore(store.partitions, backing=store.backing))
    assert _live_lists(again) == [rows]


def test_eta_is_given_to_strict_heads_only_and_without_backfill_too():
    eng, clock = _gap_setup(backfill=False)
    eng.tick()
    assert eng.explain("acme/ml/prod/g/a").eta_ns == clock.now_ns() + T100
    cfg = config(backfill=False, scheduling="GREEDY_CAPACITY")
    eng, clock = make_engine(cfg)
    warm(eng, small=T100)
    start(eng, clock, [gpus(f"s{i}", "small", 2) for i in range(2)])
    eng.enqueue(act("g", "train", resources={"cpu": 8, "gpu": 8}))
    eng.tick()
    assert eng.explain("acme/ml/prod/g/a").eta_ns is None


def test_backfill_state_survives_a_restart():
    # Predicted ends, the backfilled flag, task rows and histories are durable; the live
    # lists are rebuilt at load: the restarted shard keeps the head's ETA and backfills the
    # rest of the gap exactly as before.
    eng, clock = _gap_setup()
    eng.enqueue(gpus("q", "quick", 2))
    assert runs(eng.tick()) == ["q"]
    view = eng.inspect()
    before = {name: getattr(view.arrays, name)[:view.action_rows].copy()
              for name in ("a_task", "a_pred_end", "a_backfilled")}
    assert before["a_backfilled"].sum() == 1
    eta = eng.explain("acme/ml/prod/g/a").eta_ns
    store = eng.store
    eng.close()
    again = Engine(eng.config, clock=clock,
                   store=MemoryStore(store.partitions, backing=store.backing))
    view = again.inspect()
    for name, values in before.items():
        assert (getattr(view.arrays, name)[:view.action_rows] == values).all(), name
    assert again.predicted_runtime(again.history_key(gpus("x", "quick", 2))) == T10 / S
    again.register_worker("w-east", "east", 1000)
    assert again.tick() == []
    assert again.explain("acme/ml/prod/g/a").eta_ns == eta
    again.enqueue(gpus("q2", "quick", 2))         # 2 GPUs left in the gap: rule (a)
    again.enqueue(gpus("sl", "slow", 2))          # ends after the shadow time: waits
    assert runs(again.tick()) == ["q2"]
    assert again.queue_metrics("gpu")["backfilled"] == 1   # counted since the restart


# ---------------------------------------------------------------------------------------------
# Behind a head blocked by its queue's budget (rule (a) only)


def _budget_setup(backfill=True, max_candidates=4096):
    """Two nodes (16 GPUs) but a queue budget of 8 GPUs: two 2-GPU actions run (history
    T100), an 8-GPU head waits for the budget, not for the cluster: its budget shadow time is
    T100, when both have ended."""
    eng, clock = make_engine(config(backfill=backfill, nodes=2,
                                    max_candidates=max_candidates,
                                    max_resources={"gpu:H100": 8}))
    warm(eng, small=T100, quick=T10, slow=T500)
    start(eng, clock, [gpus(f"s{i}", "small", 2) for i in range(2)])
    eng.enqueue(act("g", "train", resources={"cpu": 8, "gpu": 8}))
    return eng, clock


def test_budget_head_lets_work_that_ends_before_its_budget_frees_run():
    eng, clock = _budget_setup()
    eng.enqueue(gpus("q", "quick", 2))           # ends at T10 < T100
    eng.enqueue(gpus("sl", "slow", 2))           # would still run at T100: waits
    eng.enqueue(gpus("n", "never-seen", 2))      # no history: never by rule (a)
    assert runs(eng.tick()) == ["q"]
    head = eng.explain("acme/ml/prod/g/a")
    assert head.wait == WaitCode.QUEUE_BUDGET
    assert head.eta_ns == clock.now_ns() + T100        # when both smalls have ended
    assert eng.queue_metrics("gpu")["head_eta_ns"] == head.eta_ns
    for run in ("sl", "n"):
        assert eng.explain(f"acme/ml/prod/{run}/a").wait == WaitCode.HEAD_BUDGET
    assert eng.queue_metrics("gpu")["backfilled"] == 1


def test_budget_head_without_backfill_stops_its_queue():
    eng, clock = _budget_setup(backfill=False)
    eng.enqueue(gpus("q", "quick", 2))
    assert eng.tick() == []
    assert eng.explain("acme/ml/prod/q/a").wait == WaitCode.HEAD_BUDGET


def test_budget_head_is_not_delayed_and_an_overrun_closes_the_gap():
    eng, clock = _budget_setup()
    eng.enqueue(gpus("q", "quick", 2))
    [q] = eng.tick()
    eng.mark_running(q.action, q.generation)
    clock.advance(2 * T10 / S)                   # q overruns its prediction (T10)
    eng.enqueue(gpus("q2", "quick", 2, name="b"))
    assert eng.tick() == []                      # the gap closed: nothing more backfills
    assert eng.explain("acme/ml/prod/q2/b").wait == WaitCode.HEAD_BUDGET
    eng.complete(q.action, q.generation)         # the overrun ends: the gap reopens
    assert runs(eng.tick()) == ["q2"]
    eng.complete("acme/ml/prod/q2/b", 1)
    # The two smalls end at T100: the head starts then, not later.
    clock.set_ns(T100)
    for i in range(2):
        eng.complete(f"acme/ml/prod/s{i}/a", 1)
    assert runs(eng.tick()) == ["g"]


def test_budget_backfill_is_bounded_per_tick():
    eng, clock = _budget_setup(max_candidates=2)
    eng.update_queue("gpu", backfill=True)
    eng.enqueue_many([gpus(f"q{i}", "quick", 1) for i in range(3)])
    assert len(eng.tick()) == 1                  # one candidate tested behind the head
    assert len(eng.tick()) == 1


# ---------------------------------------------------------------------------------------------
# Backfill on nodes (admission = "nodes")


def test_a_backfill_never_lands_on_the_node_a_blocked_head_needs():
    """Three 8-GPU nodes, each with a 60-cpu lease (so no two share a node): 6 GPUs of a long
    one on node 0, 4 of a short one (ends at T100) on node 1, 2 of a long one on node 2. A
    head of one 8-GPU pod fits the totals (12 free) but no node: its shadow time is T100,
    when node 1 is whole again. A long 4-GPU action fits the totals' extra then, but first
    fit puts it on node 1: refused. A long 2-GPU one goes to node 0 and is backfilled (rule
    (b)); a short 4-GPU one ends before T100 and may use node 1 (rule (a)). The head starts at
    its shadow time."""
    cfg = config(nodes=3)
    cfg["clusters"]["east"]["admission"] = "nodes"
    eng, clock = make_engine(cfg)
    base = [act("l0", "long", resources={"cpu": 60, "gpu": 6}),
            act("l1", "small", resources={"cpu": 60, "gpu": 4}),
            act("l2", "long", resources={"cpu": 60, "gpu": 2})]
    head = act("h", "train", pods=(PodGroup("worker", 1, {"cpu": 1, "gpu": 8}),))
    z = act("z", "long", resources={"cpu": 1, "gpu": 4})
    w = act("w", "long", resources={"cpu": 1, "gpu": 2})
    v = act("v", "quick", resources={"cpu": 1, "gpu": 4})
    warm(eng, *base, head, z, w, v, long=T500, small=T100, quick=T10, train=T500)
    placed = {a.action.run: a for a in start(eng, clock, base)}
    view = eng.inspect()
    assert [view.placement(placed[r].action) for r in ("l0", "l1", "l2")] == [
        ["h100-0"], ["h100-1"], ["h100-2"]]
    eng.enqueue_many([head, z, w])
    got = {a.action.run: a for a in eng.tick()}
    assert set(got) == {"w"} and view.placement(got["w"].action) == ["h100-0"]
    assert eng.explain(head.id).wait == WaitCode.NO_NODE_FIT
    assert eng.explain(z.id).wait in (WaitCode.HEAD_OF_LINE, WaitCode.CLUSTER_CAPACITY)
    eng.enqueue(v)
    [quick] = eng.tick()
    assert quick.action.run == "v" and view.placement(quick.action) == ["h100-1"]
    t0 = clock.now_ns()
    clock.set_ns(t0 + T10)
    eng.complete(quick.action, quick.generation)
    assert eng.tick() == []            # z still may not take node 1
    clock.set_ns(t0 + T100)
    eng.complete(placed["l1"].action, placed["l1"].generation)
    started = {a.action.run: a for a in eng.tick()}
    assert "h" in started and view.placement(started["h"].action) == ["h100-1"]

