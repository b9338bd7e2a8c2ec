"""``Engine.phases``: the phase of many actions in one pass is what ``Engine.phase`` says of
each (None for an action the engine does not know), whatever state the rows are in, before
and after a reload."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import (
    ActionSpec,
    Engine,
    ManualClock,
    NotFound,
    Phase,
    RetryPolicy,
    Verdict,
    parse_config,
)
from tests.conftest import make_engine


def config(path=None, capacity=3):
    cfg = {
        "resources": ["cpu"],
        "clusters": {"east": {"capacity": {"cpu": capacity}}},
        "queues": {"main": {"scheduling": "STRICT_FIFO", "depth": 10_000},
                   "side": {"scheduling": "GREEDY_CAPACITY", "depth": 10_000}},
        "engine": {"default_queue": "main", "initial_capacity": 16,
                   "heartbeat_interval": 10},
    }
    if path is not None:
        cfg["storage"] = {"path": str(path), "partitions": 2, "map_size": "4Mi"}
    return cfg


def spec(run, name="x", cpu=1, queue=None, retries=0):
    kw = {"run_queue": queue} if queue else {}
    if retries:
        kw["retries"] = RetryPolicy(count=retries, backoff_base=30.0)
    return ActionSpec(id=f"acme/p/d/{run}/{name}", task="t", resources={"cpu": cpu}, **kw)


def one_by_one(eng, ids):
    out = []
    for a in ids:
        try:
            out.append(eng.phase(a))
        except NotFound:
            out.append(None)
    return out


OPS = st.lists(st.sampled_from(["fanout", "distinct", "tick", "run", "succeed", "fail",
                                "abort", "advance", "reclaim"]), min_size=1, max_size=25)


def drive(eng, clock, ops):
    """Apply ``ops`` and return every id ever enqueued (plus two never enqueued)."""
    ids, tokens, n = [], [], 0
    for op in ops:
        n += 1
        if op == "fanout":
            ids += [str(a) for a in eng.enqueue_fanout(spec(f"r{n}", queue="side"),
                                                       [f"a{i}" for i in range(4)])]
        elif op == "distinct":
            ids += [str(a) for a in eng.enqueue_many(
                [spec(f"d{n}", f"b{i}", cpu=1 + i % 3, retries=1) for i in range(3)])]
        elif op == "tick":
            tokens += [a.token for a in eng.tick()]
        elif op == "run" and tokens:
            eng.report(tokens[0], Phase.RUNNING)
        elif op == "succeed" and tokens:
            eng.report(tokens.pop(0), Phase.SUCCEEDED)
        elif op == "fail" and tokens:
            eng.report(tokens.pop(), Phase.FAILED, error_kind="USER", message="boom")
        elif op == "abort" and ids:
            try:
                eng.abort(ids[n % len(ids)])
            except NotFound:
                pass
        elif op == "advance":
            clock.advance(25)           # expiries, retry backoffs
        elif op == "reclaim":
            eng.reclaim()
    return ids + ["acme/p/d/nowhere/x", "acme/p/d/r1/a99"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_phases_is_phase_of_each(ops):
    eng, clock = make_engine(config(), workers={"w": ("east", 100)})
    ids = drive(eng, clock, ops)
    assert eng.phases(ids) == one_by_one(eng, ids)
    assert eng.phases([]) == []


def test_phases_of_every_state_by_name():
    eng, clock = make_engine(config(capacity=2), workers={"w": ("east", 100)})
    fan = [str(a) for a in eng.enqueue_fanout(spec("f", queue="side"), ["a0", "a1", "a2"])]
    tokens = {str(a.action): a.token for a in eng.tick()}
    assert set(tokens) == {fan[0], fan[1]}          # two cpus: the rest wait
    [retrying] = [str(a) for a in eng.enqueue_many([spec("r", retries=1)])]
    assert not eng.tick()
    assert eng.report(tokens[fan[0]], Phase.SUCCEEDED) == Verdict.OK
    assert eng.report(tokens[fan[1]], Phase.RUNNING) == Verdict.OK
    got = eng.phases(fan + [retrying, "acme/p/d/f/none"])
    assert got == [Phase.SUCCEEDED, Phase.RUNNING, Phase.WAITING_FOR_RESOURCES,
                   Phase.WAITING_FOR_RESOURCES, None]
    assert got[:-1] == [eng.phase(a) for a in fan + [retrying]]


def test_phases_after_a_reload_reads_the_restored_rows(tmp_path):
    cfg = parse_config(config(path=tmp_path / "s"), source="<t>")
    clock = ManualClock()
    eng = Engine(cfg, clock=clock)
    eng.register_worker("w", "east", 100)
    ids = [str(a) for a in eng.enqueue_fanout(spec("f", queue="side"),
                                              [f"a{i}" for i in range(6)])]
    tokens = [a.token for a in eng.tick()]
    assert eng.report(tokens[0], Phase.SUCCEEDED) == Verdict.OK
    before = eng.phases(ids)
    eng.close()

    eng = Engine(cfg, clock=clock)
    try:
        after = eng.phases(ids)
        assert after == one_by_one(eng, ids)
        # What ended or was assigned stays; what waits is QUEUED until a tick examines it.
        assert after[:3] == before[:3] and before[0] == Phase.SUCCEEDED
        assert before[3:] == [Phase.WAITING_FOR_RESOURCES] * 3
        assert after[3:] == [Phase.QUEUED] * 3
    finally:
        eng.close()


def each_live_state(eng, run):
    """``Engine.live_states`` asked one action at a time: the live actions, each one's phase
    and current attempt number."""
    ids = eng.live_actions(run)
    return ids, [eng.phase(a) for a in ids], [len(eng.attempts(a)) for a in ids]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_live_states_is_live_actions_with_the_phase_and_attempt_of_each(ops):
    eng, clock = make_engine(config(), workers={"w": ("east", 100)})
    ids = drive(eng, clock, ops)
    for run in sorted({a.rsplit("/", 1)[0] for a in ids}):
        assert eng.live_states(run) == each_live_state(eng, run)
    assert eng.live_states("acme/p/d/nowhere") == ([], [], [])


def test_live_states_of_a_retry_counts_its_next_attempt_and_bounds_by_limit():
    eng, clock = make_engine(config(), workers={"w": ("east", 100)})
    [retrying] = [str(a) for a in eng.enqueue_many([spec("r", retries=1)])]
    fan = [str(a) for a in eng.enqueue_fanout(spec("r", queue="side"), ["a0", "a1", "a2"])]
    tokens = {str(a.action): a.token for a in eng.tick()}
    assert eng.report(tokens[retrying], Phase.RUNNING) == Verdict.OK
    assert eng.live_states("acme/p/d/r")[1:] == (
        [Phase.RUNNING, Phase.INITIALIZING, Phase.INITIALIZING, Phase.WAITING_FOR_RESOURCES],
        [1, 1, 1, 1])
    assert eng.report(tokens[retrying], Phase.FAILED, error_kind="USER", message="boom",
                      recoverable=True) == Verdict.OK
    ids, phases, attempts = eng.live_states("acme/p/d/r")
    assert (ids[0], phases[0], attempts[0]) == (retrying, Phase.QUEUED, 2)   # in backoff
    assert eng.live_states("acme/p/d/r", limit=2) == (ids[:2], phases[:2], attempts[:2])
    assert ids == [retrying] + fan and (ids, phases, attempts) == each_live_state(
        eng, "acme/p/d/r")


def each_state(eng, ids):
    """``Engine.states`` asked one action at a time: each one's phase and the number of its
    current attempt (None for an action the engine does not know)."""
    attempts = []
    for a in ids:
        try:
            attempts.append(len(eng.attempts(a)))
        except NotFound:
            attempts.append(None)
    return one_by_one(eng, ids), attempts


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_states_is_phase_and_attempt_of_each(ops):
    eng, clock = make_engine(config(), workers={"w": ("east", 100)})
    ids = drive(eng, clock, ops)
    assert eng.states(ids) == each_state(eng, ids)
    assert eng.states([]) == ([], [])


def test_states_of_a_retry_counts_its_next_attempt():
    eng, clock = make_engine(config(), workers={"w": ("east", 100)})
    [retrying] = [str(a) for a in eng.enqueue_many([spec("r", retries=1)])]
    fan = [str(a) for a in eng.enqueue_fanout(spec("r", queue="side"), ["a0", "a1"])]
    tokens = {str(a.action): a.token for a in eng.tick()}
    assert eng.report(tokens[fan[0]], Phase.SUCCEEDED) == Verdict.OK
    assert eng.report(tokens[retrying], Phase.FAILED, error_kind="USER", message="boom",
                      recoverable=True) == Verdict.OK
    ids = [retrying, *fan, "acme/p/d/r/none"]
    assert eng.states(ids) == ([Phase.QUEUED, Phase.SUCCEEDED, Phase.INITIALIZING, None],
                               [2, 1, 1, None])
    eng.reclaim()
    assert eng.states(ids) == each_state(eng, ids)
    assert eng.states(ids)[1][:3] == [2, 1, 1]


def test_known_is_in_the_table_or_retained():
    eng, clock = make_engine(config(), workers={"w": ("east", 100)})
    fan = [str(a) for a in eng.enqueue_fanout(spec("k", queue="side"), ["a0", "a1"])]
    tokens = {str(a.action): a.token for a in eng.tick()}
    assert eng.report(tokens[fan[0]], Phase.SUCCEEDED) == Verdict.OK
    asked = fan + ["acme/p/d/k/new", "acme/p/d/other/x", "not/an/id", "acme/p/d/k/"]
    assert eng.known(asked).tolist() == [True, True, False, False, False, False]
    assert eng.reclaim()                        # the ended one leaves the table
    assert eng.phase(fan[0]) == Phase.SUCCEEDED     # (retained)
    assert eng.known(asked).tolist() == [True, True, False, False, False, False]
    assert eng.known([]).tolist() == []
