"""The lease life cycle: the seed's races, tokens, heartbeats, reports, retries, timeouts,
abort and finalize leases. Time is a ManualClock; lease ttl = 10 s x 3 beats + 2 s = 32 s."""

import numpy as np
import pytest

from engine import ActionSpec, Phase, RetryPolicy, SpecError, Timeouts, WaitCode
from engine._codes import LeaseKind, Verdict
from tests.conftest import make_engine

TTL = 32


def config(**engine):
    return {
        "resources": ["cpu", "memory", "gpu:H100"],
        "clusters": {
            "east": {"node_shapes": [{"count": 1, "allocatable": {"cpu": 64, "memory": "256Gi",
                                                                  "gpu:H100": 8}}]},
            "west": {"node_shapes": [{"count": 1, "allocatable": {"cpu": 64, "memory": "256Gi",
                                                                  "gpu:H100": 8}}]},
        },
        "queues": {"q": {"clusters": ["east"]}},
        "engine": {"default_queue": "q", "heartbeat_interval": 10, "expiry_missed_beats": 3,
                   "expiry_jitter": 2, "system_retries": 2, **engine},
    }


def spec(run="r", name="a", **kw):
    kw.setdefault("resources", {"cpu": 1})
    return ActionSpec(id=f"acme/p/d/{run}/{name}", task="t", **kw)


def engine(workers=None, **settings):
    return make_engine(config(**settings), workers if workers is not None
                       else {"A": ("east", 10), "B": ("east", 10)})


def only(assignments, kind=LeaseKind.RUN):
    [a] = [a for a in assignments if a.kind == kind]
    return a


def test_worker_reconnecting_within_the_expiry_window_is_refused_and_its_lease_reassigned():
    eng, clock = engine({"A": ("east", 10)})
    eng.enqueue(spec())
    a1 = only(eng.tick())
    assert eng.heartbeat("A", [a1.token]) == []
    clock.advance(5)
    # Crashed and came back within the window: the new session proves the old one gone,
    # so the old session's lease expires now instead of after its ttl.
    eng.register_worker("A", "east", 10)
    [refused] = eng.heartbeat("A", a1.token)
    assert refused.verdict == Verdict.EXPIRED
    assert eng.report(a1.token, Phase.SUCCEEDED) == Verdict.EXPIRED
    att = eng.attempts(a1.action)
    assert (att[0].phase, att[0].error_kind, att[0].cause) == ("FAILED", "SYSTEM", "EXPIRED")
    assert eng.queue_metrics("q")["actions_in_flight"] == 0
    clock.advance(1)                                 # system retry backoff (base 1 s)
    placed = eng.tick()
    a2 = only(placed)
    assert a2.action == a1.action and a2.generation == a1.generation + 1
    assert only(placed, LeaseKind.FINALIZE).worker == "A"   # cleanup of the old attempt
    assert eng.heartbeat("A", [a2.token]) == []
    assert [r.verdict for r in eng.heartbeat("A", [a1.token])] == [Verdict.STALE]
    assert eng.report(a1.token, Phase.SUCCEEDED) == Verdict.STALE


def test_a_worker_registering_again_while_it_holds_nothing_adds_no_session_row():
    # Every registration was a session row for the life of the process, and the tick walks
    # them all for each placement: a worker that reconnected (or registered) in a loop made
    # placing ~200 times slower after 200,000 of them.
    eng, clock = engine({"A": ("east", 10)})
    rows = eng.inspect().worker_sessions
    for _ in range(1000):
        eng.register_worker("A", "east", 10)
    assert eng.inspect().worker_sessions == rows
    eng.enqueue(spec(name="a"))
    a = only(eng.tick())
    assert eng.heartbeat("A", [a.token]) == []
    # Holding a lease, a registration is a new session and the old one's lease expires.
    eng.register_worker("A", "east", 10)
    assert eng.inspect().worker_sessions == rows + 1
    assert [r.verdict for r in eng.heartbeat("A", [a.token])] == [Verdict.EXPIRED]
    # The reused row starts afresh: the new session gets leases and slots as a new row.
    clock.advance(1)
    placed = eng.tick()
    assert only(placed).action == a.action and only(placed).worker == "A"
    assert eng.heartbeat("A", [only(placed).token]) == []


def test_a_child_of_an_aborted_parent_is_refused():
    eng, _ = engine()
    eng.enqueue(spec("r", "parent"))
    eng.abort("acme/p/d/r/parent")
    with pytest.raises(SpecError, match="parent acme/p/d/r/parent was aborted"):
        eng.enqueue(spec("r", "child", parent="acme/p/d/r/parent"))


def test_late_success_from_a_partitioned_worker_is_dropped_and_the_new_holders_result_wins():
    eng, clock = engine()
    eng.enqueue(spec())
    a = only(eng.tick())
    assert eng.report(a.token, Phase.RUNNING) == Verdict.OK
    eng.unregister_worker(a.worker)                  # partitioned: no more heartbeats
    clock.advance(TTL + 1)
    eng.tick()                                       # expired, retried after backoff
    clock.advance(1)
    b = only(eng.tick())
    assert b.worker != a.worker and b.generation == a.generation + 1
    assert eng.report(a.token, Phase.SUCCEEDED) == Verdict.STALE
    assert eng.phase(a.action) == Phase.INITIALIZING
    assert eng.report(b.token, Phase.SUCCEEDED) == Verdict.OK
    hist = eng.attempts(a.action)
    assert [(h.worker, h.phase, h.cause) for h in hist] == [
        (a.worker, "FAILED", "EXPIRED"), (b.worker, "SUCCEEDED", None)]
    assert eng.phase(a.action) == Phase.SUCCEEDED
    assert eng.queue_metrics("q")["actions_in_flight"] == 0


def test_an_expiry_snapshot_older_than_a_reassignment_is_refused():
    eng, clock = engine()
    eng.enqueue(spec())
    a = only(eng.tick())
    clock.advance(TTL + 1)
    stale_snapshot = eng.expired_leases()
    assert stale_snapshot == [(LeaseKind.RUN, 0, a.generation, stale_snapshot[0][3])]
    assert eng.expire(stale_snapshot[0]) is True     # first application expires it
    clock.advance(1)
    b = only(eng.tick())                             # reassigned: generation + 1
    assert eng.expire(stale_snapshot[0]) is False    # the old observation is refused
    assert eng.heartbeat(b.worker, [b.token]) == []
    assert eng.phase(a.action) == Phase.INITIALIZING


def test_an_expiry_snapshot_is_refused_when_a_heartbeat_extended_the_lease():
    eng, clock = engine()
    eng.enqueue(spec())
    a = only(eng.tick())
    clock.advance(TTL + 1)
    [snap] = eng.expired_leases()
    # The heartbeat is itself refused (the lease is past its expiry) ...
    assert [r.verdict for r in eng.heartbeat(a.worker, [a.token])] == [Verdict.EXPIRED]
    # ... but one that arrives in time extends it and wins against an older snapshot.
    eng2, clock2 = engine()
    eng2.enqueue(spec())
    a2 = only(eng2.tick())
    clock2.advance(TTL - 1)
    snap2 = (LeaseKind.RUN, 0, a2.generation, snap[3])
    assert eng2.heartbeat(a2.worker, [a2.token]) == []
    clock2.advance(2)
    assert eng2.expire(snap2) is False


def test_forged_and_edited_tokens_are_refused_as_unknown():
    eng, _ = engine()
    eng.enqueue(spec())
    a = only(eng.tick())
    words = np.frombuffer(a.token, dtype="<u8").copy()
    gen_up = words.copy()
    gen_up[1] += 1
    gen_down = words.copy()
    gen_down[1] -= 1
    other_row = words.copy()
    other_row[0] ^= 1
    forged = bytes(range(24))
    tokens = [t.tobytes() for t in (gen_up, gen_down, other_row)] + [forged]
    refused = eng.heartbeat(a.worker, tokens)
    assert [r.verdict for r in refused] == [Verdict.UNKNOWN] * 4
    assert eng.report(gen_up.tobytes(), Phase.SUCCEEDED) == Verdict.UNKNOWN
    assert eng.phase(a.action) == Phase.INITIALIZING
    with pytest.raises(SpecError, match="not a whole number of 24-byte tokens"):
        eng.heartbeat(a.worker, a.token[:20])


def test_heartbeat_batch_validates_all_then_extends_the_valid_and_learns_free_capacity():
    eng, clock = engine({"A": ("east", 10)})
    eng.enqueue_many([spec(f"r{i}") for i in range(3)])
    a, b, c = eng.tick()
    eng.report(b.token, Phase.SUCCEEDED)
    eng.abort(c.action)
    clock.advance(TTL - 2)
    refused = eng.heartbeat("A", a.token + b.token + c.token,
                            free_capacity={"gpu": 0, "cpu": 64})
    assert [(r.token, r.verdict) for r in refused] == [
        (b.token, Verdict.COMPLETED), (c.token, Verdict.ABORTED)]
    clock.advance(TTL - 2)                           # past the first expiry, within the new
    eng.tick()
    assert eng.phase(a.action) == Phase.INITIALIZING
    # The worker said its cluster has no free GPU: the gate believes it.
    eng.enqueue(spec("g", resources={"gpu": 1}))
    eng.tick()
    why = eng.explain("acme/p/d/g/a")
    assert why.wait == WaitCode.CLUSTER_CAPACITY
    assert "cluster east has 0 free" in why.reason


def test_expiry_is_a_system_error_retried_under_the_system_budget_then_failed():
    eng, clock = engine({"A": ("east", 10)})
    eng.enqueue(spec(retries=RetryPolicy(count=5)))
    for _ in range(3):                               # system_retries = 2: three attempts
        only(eng.tick())
        clock.advance(TTL + 1)
        eng.schedule()
        eng.heartbeat("A", b"")                      # alive again: it may take work
        clock.advance(10)
    hist = eng.attempts("acme/p/d/r/a")
    assert [h.cause for h in hist] == ["EXPIRED"] * 3
    why = eng.explain("acme/p/d/r/a")
    assert why.phase == Phase.FAILED and why.reason.startswith("EXPIRED")
    assert eng.queue_metrics("q")["actions_in_flight"] == 0


def _holding(n):
    """An engine whose worker A holds the leases of ``n`` actions: (engine, clock, leases)."""
    eng, clock = make_engine({"resources": ["cpu"], "clusters": {"east": {}},
                              "queues": {"q": {"scheduling": "GREEDY_CAPACITY",
                                               "depth": n}},
                              "engine": {"default_queue": "q", "heartbeat_interval": 10,
                                         "max_candidates": n, "initial_capacity": 4096}},
                             {"A": ("east", n)})
    eng.enqueue_fanout(spec(name="map"), [f"a{i}" for i in range(n)])
    placed = []
    while len(placed) < n:
        placed += eng.tick()
    return eng, clock, placed


def test_a_mass_expiry_is_spread_over_bounded_ticks_in_lease_order():
    # A worker dying with thousands of leases: one tick expired them all (~30 ms a 1,000
    # here), holding the loop while every other worker's heartbeats went unread. Now each
    # tick expires a bounded batch and says more wait, until none does.
    n = 3000
    eng, clock, placed = _holding(n)
    assert not eng.expiries_waiting
    clock.advance(3600)                             # A stopped heartbeating long ago
    batches, seen = [], []
    while True:
        eng.schedule()
        ids = eng.decided_changes()[0]
        batches.append(len(ids))
        seen += ids
        if not eng.expiries_waiting:
            break
        assert len(batches) < n, "the sweep never finished"
    assert len(batches) > 1 and max(batches) < n, batches      # bounded, not all at once
    assert all(b == batches[0] for b in batches[:-1]) and 0 < batches[-1] <= batches[0]
    assert sorted(seen) == sorted(str(a.action) for a in placed)   # each expired once
    assert eng.expired_leases() == []
    assert {e.cause for a in placed for e in eng.attempts(a.action)[:1]} == {"EXPIRED"}


def test_a_new_session_of_a_worker_holding_many_leases_ends_them_over_bounded_ticks():
    # Its leases expire at once when it registers again; past a batch, the rest are due at
    # once for the next ticks' sweeps (one turn ending them all held the loop for seconds).
    n = 3000
    eng, _clock, placed = _holding(n)
    eng.register_worker("A", "east", n)             # crashed and came back: a new session
    ended = sum(eng.phase(a.action) == Phase.QUEUED for a in placed)
    assert 0 < ended < n                            # a bounded batch at once
    ticks = 0
    while True:
        eng.schedule()
        ticks += 1
        if not eng.expiries_waiting:
            break
        assert ticks < n, "the sweep never finished"
    assert all(eng.attempts(a.action)[0].cause == "EXPIRED" for a in placed)
    assert all(eng.phase(a.action) == Phase.QUEUED for a in placed)   # retries, backing off


def test_a_worker_that_let_a_lease_expire_gets_nothing_until_it_heartbeats():
    eng, clock = engine({"A": ("east", 10)})
    eng.enqueue(spec(retries=RetryPolicy(count=5)))
    first = only(eng.tick())
    clock.advance(TTL + 1)
    eng.schedule()                                   # expired: retried after its backoff
    assert eng.attempts("acme/p/d/r/a")[0].cause == "EXPIRED"
    clock.advance(2)
    assert eng.tick() == []                          # A may be dead: not placed on it again
    assert "worker" in eng.explain("acme/p/d/r/a").reason
    assert [r.verdict for r in eng.heartbeat("A", [first.token])] == [Verdict.EXPIRED]
    again = only(eng.tick())                         # alive: it takes work again
    assert again.worker == "A" and again.action == first.action
    eng.register_worker("B", "east", 10)
    clock.advance(TTL + 1)
    eng.schedule()                                   # A lets this one expire too ...
    clock.advance(5)
    got = only(eng.tick())
    assert got.worker == "B"                         # ... so B takes it


def test_user_errors_retry_with_backoff_and_a_non_recoverable_one_does_not():
    eng, clock = engine()
    retries = RetryPolicy(count=3, backoff_base=2, backoff_factor=3, backoff_cap=10)
    eng.enqueue(spec("r1", retries=retries))
    eng.enqueue(spec("r2", retries=retries))
    a1, a2 = eng.tick()
    eng.report(a1.token, Phase.FAILED, error_kind="USER", message="boom")
    eng.report(a2.token, Phase.FAILED, error_kind="USER", recoverable=False, message="bad")
    assert eng.phase(a2.action) == Phase.FAILED
    assert eng.phase(a1.action) == Phase.QUEUED
    assert "waits 2.0s of retry backoff" in eng.explain(a1.action).reason
    clock.advance(1.9)
    assert eng.tick() == []                          # backoff through the clock
    clock.advance(0.1)
    b = only(eng.tick())
    eng.report(b.token, Phase.FAILED, error_kind="USER")
    clock.advance(5.9)
    assert eng.tick() == []                          # second backoff: 2 x 3 = 6 s
    clock.advance(0.1)
    c = only(eng.tick())
    eng.report(c.token, Phase.FAILED, error_kind="USER")
    clock.advance(9.9)
    assert eng.tick() == []                          # third: min(18, cap 10) = 10 s
    clock.advance(0.1)
    d = only(eng.tick())
    eng.report(d.token, Phase.FAILED, error_kind="USER", message="still")
    assert eng.phase(a1.action) == Phase.FAILED
    assert [h.attempt for h in (a1, b, c, d)] == [1, 2, 3, 4]


def test_a_backoff_whose_power_overflows_waits_the_cap():
    # base * factor**n overflowed a float (1e308**2; 2.0**1025 after 1,025 retries) inside
    # the REPORT's turn: every report of the attempt failed the turn, for good.
    eng, clock = engine()
    eng.enqueue(spec("r1", retries=RetryPolicy(count=5, backoff_base=1, backoff_factor=1e308,
                                               backoff_cap=3)))
    a = only(eng.tick())
    waits = []
    for _ in range(3):
        eng.report(a.token, Phase.FAILED, error_kind="USER", message="boom")
        assert eng.phase(a.action) == Phase.QUEUED
        waited = 0.0
        while not (got := eng.tick()):
            clock.advance(0.5)
            waited += 0.5
        waits.append(waited)
        a = only(got)
    # 1 s (base), then 1e308 s capped at 3 s, then 1e308**2 (no float holds it): the cap.
    assert waits == [1.0, 3.0, 3.0], waits
    assert a.attempt == 4


def test_deadline_times_out_before_dispatch_even_with_retries_left():
    eng, clock = engine({"A": ("east", 1)})
    eng.enqueue(spec("busy"))
    eng.tick()
    eng.enqueue(spec("late", retries=RetryPolicy(count=5), timeouts=Timeouts(deadline=30)))
    clock.advance(29)
    eng.tick()
    assert eng.explain("acme/p/d/late/a").wait == WaitCode.NO_WORKER
    clock.advance(1)
    eng.tick()
    why = eng.explain("acme/p/d/late/a")
    assert why.phase == Phase.TIMED_OUT and "deadline" in why.reason
    assert eng.queue_metrics("q")["depth"] == 0


def test_a_retry_due_after_the_deadline_ends_timed_out():
    eng, clock = engine()
    eng.enqueue(spec(retries=RetryPolicy(count=3, backoff_base=20),
                     timeouts=Timeouts(deadline=30)))
    a = only(eng.tick())
    clock.advance(15)
    eng.report(a.token, Phase.FAILED, error_kind="USER")
    assert eng.phase(a.action) == Phase.TIMED_OUT
    assert a.deadline_ns == 30_000_000_000


def test_max_queued_time_is_per_attempt_and_reset_on_retry():
    eng, clock = engine({"A": ("east", 1)})
    eng.enqueue(spec("busy"))
    busy = only(eng.tick())
    eng.enqueue(spec("w", retries=RetryPolicy(count=1, backoff_base=1),
                     timeouts=Timeouts(max_queued_time=10)))
    clock.advance(10)
    eng.tick()
    hist = eng.attempts("acme/p/d/w/a")
    assert (hist[0].phase, hist[0].cause) == ("TIMED_OUT", "max_queued_time")
    eng.report(busy.token, Phase.SUCCEEDED)
    clock.advance(1)
    b = only(eng.tick())                             # the retry's clock started afresh
    assert b.attempt == 2 and b.queued_deadline_ns == clock.now_ns() + 10_000_000_000
    assert eng.report(b.token, Phase.RUNNING) == Verdict.OK
    clock.advance(20)                                # RUNNING stopped the queued-time clock
    eng.heartbeat("A", [b.token])
    eng.tick()
    assert eng.phase(b.action) == Phase.RUNNING


def test_max_runtime_engine_backstop_expires_a_lease_running_past_it_plus_grace():
    eng, clock = engine({"A": ("east", 10)}, runtime_grace=5)
    eng.enqueue(spec(timeouts=Timeouts(max_runtime=20)))
    a = only(eng.tick())
    assert a.max_runtime_s == 20
    eng.report(a.token, Phase.RUNNING)
    for _ in range(2):
        clock.advance(12)
        assert eng.heartbeat("A", [a.token]) == []
        eng.tick()
    clock.advance(2)                                 # 26 s > 20 + 5
    placed = eng.tick()
    hist = eng.attempts(a.action)
    assert (hist[0].phase, hist[0].cause) == ("TIMED_OUT", "max_runtime")
    assert eng.phase(a.action) == Phase.TIMED_OUT
    fin = only(placed, LeaseKind.FINALIZE)           # its pods are cleaned up
    assert fin.worker == "A"
    assert [r.verdict for r in eng.heartbeat("A", [a.token])] == [Verdict.EXPIRED]


def test_abort_cascades_and_running_work_is_refused_then_finalized_first_and_sticky():
    eng, clock = engine({"A": ("east", 2), "B": ("east", 5)})
    eng.enqueue(spec("r", "parent"))
    eng.enqueue(spec("r", "child", parent="acme/p/d/r/parent"))
    eng.enqueue(spec("r", "grandchild", parent="acme/p/d/r/child"))
    placed = eng.tick()
    by = {a.action.action: a for a in placed}
    assert set(by) == {"parent", "child", "grandchild"}
    ended = eng.abort("acme/p/d/r/parent", reason="user pressed stop")
    assert {a.action for a in ended} == {"parent", "child", "grandchild"}
    for a in placed:
        assert eng.phase(a.action) == Phase.ABORTED
        [r] = eng.heartbeat(a.worker, [a.token])
        assert r.verdict == Verdict.ABORTED
    eng.enqueue_many([spec(f"new{i}") for i in range(7)])
    nxt = eng.tick()
    fins = [a for a in nxt if a.kind == LeaseKind.FINALIZE]
    assert len(fins) == 3
    assert nxt[:3] == fins                           # cleanup first, before new work
    assert sorted(f.worker for f in fins) == sorted(by[n].worker for n in by)
    for f in fins:
        assert eng.report(f.token, Phase.SUCCEEDED) == Verdict.OK
    assert {h.finalize for a in placed for h in eng.attempts(a.action)} == {"SUCCEEDED"}


def test_finalize_goes_to_another_worker_of_the_same_cluster_when_its_worker_is_gone():
    eng, clock = engine({"A": ("east", 5), "W": ("west", 5)})
    eng.enqueue(spec())
    a = only(eng.tick())
    eng.abort(a.action)
    eng.unregister_worker("A")
    assert [x for x in eng.tick() if x.kind == LeaseKind.FINALIZE] == []   # never to west
    eng.register_worker("A2", "east", 5)
    fin = only(eng.tick(), LeaseKind.FINALIZE)
    assert (fin.cluster, fin.worker) == ("east", "A2")


def test_a_user_deadline_never_kills_a_finalize_lease_but_its_own_bound_does():
    eng, clock = engine({"A": ("east", 5)}, finalize_timeout=100)
    eng.enqueue(spec(timeouts=Timeouts(deadline=10)))
    a = only(eng.tick())
    eng.report(a.token, Phase.FAILED, error_kind="SYSTEM", cause="OOM", cleanup=True)
    fin = only(eng.tick(), LeaseKind.FINALIZE)
    for _ in range(4):                                # past the user deadline, heartbeating
        clock.advance(20)
        assert eng.heartbeat("A", [fin.token]) == []
        eng.tick()
    assert eng.attempts(a.action)[0].finalize == "SENT"
    clock.advance(25)                                 # 105 s > finalize_timeout
    eng.tick()
    assert eng.attempts(a.action)[0].finalize == "ABANDONED"
    assert [r.verdict for r in eng.heartbeat("A", [fin.token])] == [Verdict.ABORTED]


def test_a_system_failure_with_a_cause_retries_and_history_records_everything():
    eng, clock = engine({"A": ("east", 5)})
    eng.enqueue(spec())
    a = only(eng.tick())
    eng.report(a.token, Phase.INITIALIZING)
    eng.report(a.token, Phase.RUNNING)
    clock.advance(3)
    eng.report(a.token, Phase.FAILED, error_kind="SYSTEM", cause="EVICTED", message="node")
    clock.advance(1)
    b = only(eng.tick())
    eng.report(b.token, Phase.SUCCEEDED)
    h1, h2 = eng.attempts(a.action)
    assert (h1.number, h1.cluster, h1.worker, h1.start_ns, h1.running_ns, h1.end_ns) == (
        1, "east", "A", 0, 0, 3_000_000_000)
    assert (h1.phase, h1.error_kind, h1.cause, h1.message) == (
        "FAILED", "SYSTEM", "EVICTED", "node")
    assert (h2.number, h2.phase) == (2, "SUCCEEDED")
    with pytest.raises(SpecError, match="needs a cause"):
        eng.report(b.token, Phase.FAILED, error_kind="SYSTEM")
    with pytest.raises(SpecError, match="error_kind USER or SYSTEM"):
        eng.report(b.token, Phase.FAILED, error_kind="OOPS")


def test_an_assignment_whose_lease_ended_before_dispatch_is_never_delivered():
    eng, clock = engine({"A": ("east", 10)})
    eng.enqueue(spec())
    assert eng.schedule() == 1                       # decided, still in the channel
    eng.register_worker("A", "east", 10)            # the worker's session ends meanwhile
    assert eng.drain_dispatch() == []
    att, retry = eng.attempts("acme/p/d/r/a")
    assert (att.generation, att.worker, att.cause) == (1, "A", "EXPIRED")
    assert (retry.number, retry.generation) == (2, 0)
    clock.advance(1)
    placed = eng.tick()
    assert [(a.kind, a.generation, a.attempt) for a in placed] == [
        (LeaseKind.FINALIZE, 1, 1), (LeaseKind.RUN, 2, 2)]


def test_a_worker_that_let_a_lease_expire_gets_nothing_new_until_its_next_heartbeat():
    eng, clock = engine({"A": ("east", 10)})
    eng.enqueue(spec(name="a"))
    a = only(eng.tick())
    clock.advance(TTL + 1)                           # A went silent: a expires
    eng.tick()
    clock.advance(1)
    eng.enqueue(spec(name="b"))
    assert eng.tick() == []                          # A is suspect: nothing placed on it
    assert eng.explain("acme/p/d/r/b").phase == Phase.WAITING_FOR_RESOURCES
    assert eng.heartbeat("A", []) == []              # alive after all
    placed = {x.action.action for x in eng.tick() if x.kind == LeaseKind.RUN}
    assert placed == {"a", "b"} and a.worker == "A"


def test_a_drained_worker_keeps_its_session_and_gets_nothing_new_even_after_a_heartbeat():
    eng, clock = engine({"A": ("east", 10)})
    eng.enqueue(spec(name="a"))
    a = only(eng.tick())
    eng.drain_worker("A")
    eng.enqueue(spec(name="b"))
    assert eng.tick() == []
    assert eng.heartbeat("A", [a.token]) == []       # what it holds is still its own
    assert eng.tick() == []                          # the heartbeat does not end the drain
    clock.advance(TTL + 1)                           # and neither does a suspect's heartbeat
    eng.tick()
    assert eng.heartbeat("A", []) == []
    assert [x for x in eng.tick() if x.kind == LeaseKind.RUN] == []
    eng.register_worker("A", "east", 10)             # a new session ends the drain
    assert {x.action.action for x in eng.tick() if x.kind == LeaseKind.RUN} >= {"b"}


def _lease_cfg():
    return {"resources": ["cpu"], "clusters": {"east": {"capacity": {"cpu": 64}}},
            "queues": {"q": {}}, "engine": {"default_queue": "q"}}


def test_lease_actions_names_live_run_leases_of_the_given_runs_only():
    eng, _ = make_engine(_lease_cfg())
    eng.enqueue(ActionSpec(id="acme/p/d/r1/a", task="t", resources={"cpu": 1}))
    eng.enqueue(ActionSpec(id="acme/p/d/r2/b", task="t", resources={"cpu": 1}))
    a, b = sorted(eng.tick(), key=lambda x: str(x.action))
    toks = np.frombuffer(a.token + b.token, dtype="<u8").reshape(2, 3)
    assert eng.lease_actions(toks, ["acme/p/d/r1", "acme/p/d/r2"]) == \
        ["acme/p/d/r1/a", "acme/p/d/r2/b"]
    assert eng.lease_actions(toks, ["acme/p/d/r2", "acme/p/d/nope"]) == [None, "acme/p/d/r2/b"]
    assert eng.lease_actions(toks, []) == [None, None]
    odd = toks.copy()
    odd[0, 1] += 1                              # another generation of the row
    odd[1, 0] |= np.uint64(1 << 63)             # a finalize lease id
    assert eng.lease_actions(odd, ["acme/p/d/r1", "acme/p/d/r2"]) == [None, None]
    far = toks[:1].copy()
    far[0, 0] = np.uint64(10**9)                # a row past the table
    assert eng.lease_actions(far, ["acme/p/d/r1"]) == [None]


def test_lease_actions_names_no_action_for_a_token_of_an_ended_or_reclaimed_lease():
    eng, _ = make_engine(_lease_cfg())
    eng.enqueue(ActionSpec(id="acme/p/d/r1/a", task="t", resources={"cpu": 1}))
    [a] = eng.tick()
    tok = np.frombuffer(a.token, dtype="<u8").reshape(1, 3)
    eng.report(a.token, Phase.SUCCEEDED)
    assert eng.lease_actions(tok, ["acme/p/d/r1"]) == [None]     # ended
    assert eng.reclaim() == 1
    eng.enqueue(ActionSpec(id="acme/p/d/r2/b", task="t", resources={"cpu": 1}))
    assert eng.lease_actions(tok, ["acme/p/d/r1", "acme/p/d/r2"]) == [None]
