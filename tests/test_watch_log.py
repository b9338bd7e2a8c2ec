"""The shard's watch log: a fan-out's batched QUEUED records are exactly the one-by-one
records (same events, same sequence numbers, same live tracking), whatever came before."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import Phase, ResourceExhausted
from transport import WatchLog
from transport._watch import WatchGap

RUN = "acme/p/d/r"
names = st.lists(st.sampled_from([f"{RUN}/a{i}" for i in range(6)]), max_size=12)
earlier = st.lists(st.tuples(st.sampled_from([f"{RUN}/a{i}" for i in range(6)]),
                             st.sampled_from([Phase.QUEUED, Phase.RUNNING, Phase.SUCCEEDED]),
                             st.integers(0, 2)), max_size=10)


def _log(max_live, ring=64):
    log = WatchLog(ring=ring, max_live=max_live, epoch=1000)
    log.watch(RUN, "conn", 0)
    return log


def _watch(log, since, conn="conn"):
    """``watch``'s answer with its events as tuples, whatever parts the log holds them in."""
    latest, logged = log.watch(RUN, conn, since)
    return latest, [e for c in logged for e in c.events()]


@settings(max_examples=200, deadline=None)
@given(before=earlier, batch=names, max_live=st.integers(1, 8))
def test_record_many_is_record_one_by_one(before, batch, max_live):
    one, many = _log(max_live), _log(max_live)
    for log in (one, many):
        for action, phase, attempt in before:
            log.record(RUN, action, phase, attempt, 5)
    want = [e for a in batch
            if (hit := one.record(RUN, a, Phase.QUEUED, 0, 7)) is not None
            for e in hit[0].events()]
    got, watchers = many.record_many(RUN, batch, Phase.QUEUED, 0, 7)
    assert (got.events() if got is not None else []) == want and watchers == {"conn"}
    assert sorted(one.live()) == sorted(many.live())
    assert _watch(one, 0) == _watch(many, 0)


def test_record_many_of_an_unwatched_run_records_nothing_and_refuses_terminal_phases():
    log = _log(4)
    assert log.record_many("acme/p/d/other", [f"{RUN}/a0"], Phase.QUEUED, 0, 1) == (None,
                                                                                    set())
    with pytest.raises(ValueError, match="non-terminal"):
        log.record_many(RUN, [f"{RUN}/a0"], Phase.SUCCEEDED, 1, 1)


changes = st.lists(st.tuples(st.sampled_from([f"{RUN}/a{i}" for i in range(6)]),
                             st.sampled_from([Phase.QUEUED, Phase.RUNNING, Phase.SUCCEEDED,
                                              Phase.FAILED]),
                             st.integers(0, 2)), max_size=30)


@settings(max_examples=200, deadline=None)
@given(seq=changes, cut=st.integers(0, 30), max_live=st.integers(1, 8))
def test_record_changes_in_batches_is_record_one_by_one(seq, cut, max_live):
    one, batched = _log(max_live), _log(max_live)
    want = [e for a, ph, att in seq
            if (hit := one.record(RUN, a, ph, att, 9, f"d{att}")) is not None
            for e in hit[0].events()]
    got = []
    for part in (seq[:cut], seq[cut:]):       # the state carries across batches
        events, watchers = batched.record_changes(
            RUN, [c[0] for c in part], [c[1] for c in part], [c[2] for c in part], 9,
            [f"d{c[2]}" for c in part])
        got += events.events() if events is not None else []
        assert watchers == {"conn"}
    assert got == want
    assert sorted(one.live()) == sorted(batched.live())
    # Sequence numbers are gap-free from the epoch, whatever was suppressed.
    assert [e[0] for e in got] == list(range(1001, 1001 + len(got)))


@settings(max_examples=200, deadline=None)
@given(seq=changes, cuts=st.lists(st.integers(0, 30), max_size=4), ring=st.integers(1, 9))
def test_a_ring_of_batches_replays_what_a_ring_of_single_events_does(seq, cuts, ring):
    """The ring keeps the last ``ring`` events however they were recorded (a batch larger
    than the ring, or one straddling its edge, is cut): every resume answers the same."""
    one, batched = _log(8, ring), _log(8, ring)
    for a, ph, att in seq:
        one.record(RUN, a, ph, att, 9)
    bounds = sorted({0, len(seq), *(min(c, len(seq)) for c in cuts)})
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        part = seq[lo:hi]
        batched.record_changes(RUN, [c[0] for c in part], [c[1] for c in part],
                               [c[2] for c in part], 9)
    latest = one.watch(RUN, "conn", 0)[0]
    assert batched.watch(RUN, "conn", 0)[0] == latest
    for since in range(1000, latest + 1):
        try:
            want = _watch(one, since)
        except WatchGap:
            with pytest.raises(WatchGap):
                batched.watch(RUN, "conn", since)
            continue
        assert _watch(batched, since) == want
        assert len(want[1]) <= ring


@settings(max_examples=300, deadline=None)
@given(before=changes, batch=st.lists(st.sampled_from([f"{RUN}/a{i}" for i in range(6)]),
                                      min_size=2, max_size=8),
       phase=st.sampled_from([Phase.INITIALIZING, Phase.RUNNING, Phase.SUCCEEDED,
                              Phase.FAILED]),
       attempt=st.integers(0, 2), after=changes, max_live=st.integers(1, 8),
       ring=st.integers(1, 9))
def test_a_batch_of_one_phase_is_record_one_by_one(before, batch, phase, attempt, after,
                                                   max_live, ring):
    """A batch of one phase (applied whole when nothing in it repeats) leaves the log as
    its changes one at a time do: the same events, live tracking and memory of ended
    actions (what later changes are compared with)."""
    one, batched = _log(max_live, ring), _log(max_live, ring)
    for log in (one, batched):
        for a, ph, att in before:
            log.record(RUN, a, ph, att, 3)
    want = [e for a in batch
            if (hit := one.record(RUN, a, phase, attempt, 5)) is not None
            for e in hit[0].events()]
    got, _ = batched.record_changes(RUN, batch, [phase] * len(batch), [attempt] * len(batch),
                                    5)
    assert (got.events() if got is not None else []) == want
    for log in (one, batched):                  # what the log remembers answers alike
        for a, ph, att in after:
            log.record(RUN, a, ph, att, 7)
    assert sorted(one.live()) == sorted(batched.live())
    assert _watch(one, 0) == _watch(batched, 0)


def test_record_changes_suppresses_repeats_and_bounds_live_tracking():
    log = _log(2)
    a, b, c = (f"{RUN}/{n}" for n in "abc")
    events, _ = log.record_changes(
        RUN, [a, a, b, c, a, a, b],
        [Phase.QUEUED, Phase.QUEUED, Phase.RUNNING, Phase.QUEUED, Phase.SUCCEEDED,
         "SUCCEEDED", Phase.RUNNING], [0, 0, 1, 0, 1, 1, 1], 5)
    # a's second QUEUED, its second SUCCEEDED (given by name) and b's repeat add nothing;
    # c is recorded but not tracked (two live actions at most).
    assert [(e[1], e[2]) for e in events.events()] == [
        (a, "QUEUED"), (b, "RUNNING"), (c, "QUEUED"), (a, "SUCCEEDED")]
    assert sorted(x[1] for x in log.live()) == [b]
    assert log.record_changes("acme/p/d/other", [a], [Phase.RUNNING], [1], 5) == (None, set())
    with pytest.raises(ValueError):
        log.record_changes(RUN, [a], ["NOT_A_PHASE"], [1], 5)


def test_a_resume_into_a_log_made_again_after_its_eviction_is_refused():
    """A run's log evicted (more than ``max_runs`` runs watched) and made again by a later
    WATCH numbers its events afresh: a watcher of the first log resuming from its last seq
    must be refused (WatchGap), not handed the new log's later events as if they followed
    it (it would silently miss the changes between, and those the new log numbered up to
    its seq)."""
    log = WatchLog(ring=64, max_runs=1, epoch=1000)
    other = "acme/p/d/other"
    log.watch(RUN, "old", 0)
    first, _ = log.record_changes(RUN, [f"{RUN}/a", f"{RUN}/b"], [Phase.QUEUED] * 2,
                                  [0, 0], 5)
    last_seen = first.last
    log.unwatch(RUN, "old")                     # (its watcher went away)
    log.watch(other, "x", 0)                    # evicts RUN's log
    assert RUN not in log
    log.unwatch(other, "x")
    log.watch(RUN, "new", 0)                    # a new log of the same run
    log.record_changes(RUN, [f"{RUN}/c", f"{RUN}/d", f"{RUN}/e"], [Phase.QUEUED] * 3,
                       [0, 0, 0], 6)
    with pytest.raises(WatchGap):
        log.watch(RUN, "old", last_seen)
    # The new log's own watcher resumes as usual, from the seq before its first event.
    latest, events = _watch(log, 0, "new")
    assert [e[1] for e in events] == [f"{RUN}/c", f"{RUN}/d", f"{RUN}/e"]
    assert _watch(log, events[0][0] - 1, "new")[1] == events
    assert log.watch(RUN, "new", latest) == (latest, [])


def test_eviction_takes_a_log_nobody_watches_before_a_watched_one():
    """More than ``max_runs`` logs evicts the least recently watched log nobody watches now,
    not a run whose watcher is taking its events (it sends no WATCH while they come, so its
    log was the least recently watched and went first: the watcher stopped receiving and
    learnt it only at its next resume)."""
    log = WatchLog(ring=64, max_runs=2, epoch=1000)
    busy, idle, new = "acme/p/d/busy", "acme/p/d/idle", "acme/p/d/new"
    log.watch(busy, "a", 0)
    log.watch(idle, "b", 0)
    log.unwatch(idle, "b")                      # its log stays, for a resume
    log.watch(new, "c", 0)
    assert busy in log and new in log and idle not in log
    events, watchers = log.record_changes(busy, [f"{busy}/x"], [Phase.QUEUED], [0], 5)
    assert len(events) == 1 and watchers == {"a"}
    # Every log watched by another connection: the new one is refused, and none stops.
    with pytest.raises(ResourceExhausted, match="2 runs are watched, each by another"):
        log.watch("acme/p/d/fourth", "d", 0)
    assert busy in log and new in log and "acme/p/d/fourth" not in log and log.evicted == 1
    # A connection's own logs make room for its next: the least recently watched of them.
    log.watch("acme/p/d/fourth", "a", 0)
    assert busy not in log and new in log and "acme/p/d/fourth" in log and log.evicted == 2


def test_sweep_reads_every_tracked_action_once_a_round_a_bounded_number_a_call():
    """The backstop re-check reads the tracked live actions of every log in rounds of
    ``budget`` a call (reading them all in one loop turn held the shard for seconds): each
    action tracked when the round reached its run comes once a round, in calls of at most
    ``budget``; one that ended meanwhile is skipped, a log evicted meanwhile too."""
    log = WatchLog(ring=64, max_runs=3, epoch=1000)
    runs = [f"acme/p/d/r{i}" for i in range(3)]
    for k, run in enumerate(runs):
        log.watch(run, "c", 0)
        log.record_many(run, [f"{run}/a{i}" for i in range(5 + k)], Phase.QUEUED, 0, 1)
    every = sorted((run, a) for run, a, _ph, _at in log.live())
    assert len(every) == 18
    for _round in range(2):
        got, done, calls = [], False, 0
        while not done:
            part, done = log.sweep(4)
            assert len(part) <= 4
            got += part
            calls += 1
        assert sorted(got) == every and calls == 5     # 18 in calls of 4
    # Changes meanwhile: an action ends, a log is evicted, an action is tracked.
    part, done = log.sweep(4)
    assert part == [(runs[0], f"{runs[0]}/a{i}") for i in range(4)] and not done
    log.record(runs[0], f"{runs[0]}/a4", Phase.SUCCEEDED, 1, 2)     # ended: skipped
    log.record(runs[2], f"{runs[2]}/new", Phase.QUEUED, 0, 2)       # not reached yet
    log.forget(runs[1])                                             # gone: skipped
    log.record(runs[0], f"{runs[0]}/new", Phase.QUEUED, 0, 2)       # the next round
    rest = []
    while not done:
        part, done = log.sweep(4)
        assert len(part) <= 4
        rest += part
    assert rest == [(runs[2], f"{runs[2]}/a{i}") for i in range(7)] + [
        (runs[2], f"{runs[2]}/new")]
    got = []
    done = False
    while not done:
        part, done = log.sweep(100)
        got += part
    assert (runs[0], f"{runs[0]}/new") in got and len(got) == 5 + 8
    assert WatchLog().sweep(10) == ([], True)


def test_a_repeated_end_is_dropped_for_at_least_the_last_ring_ended_actions():
    """A log remembers the actions that ended last, at least ``ring`` of them and at most
    twice that, so a second report of an end is not a second event; one that ended longer
    ago than that is recorded again (memory stays bounded)."""
    ring = 3
    log = _log(8, ring)
    ended = [f"{RUN}/e{i}" for i in range(2 * ring + 1)]

    def again(action):      # whether a repeat of its SUCCEEDED is recorded
        return log.record(RUN, action, Phase.SUCCEEDED, 1, 9) is not None

    for i, action in enumerate(ended):
        assert log.record(RUN, action, Phase.SUCCEEDED, 1, 5) is not None
        # The last `ring` are always remembered (a repeat of them adds nothing).
        assert not any(again(a) for a in ended[max(0, i + 1 - ring):i + 1])
    # Past twice the bound, the first has been forgotten: its repeat is an event again.
    assert again(ended[0])
    # A batch of new ends (applied whole) remembers as one at a time does.
    batch = [f"{RUN}/b{i}" for i in range(2 * ring)]
    got, _ = log.record_changes(RUN, batch, [Phase.SUCCEEDED] * len(batch),
                                [1] * len(batch), 6)
    assert len(got) == len(batch)
    assert not any(again(a) for a in batch[-ring:])
