"""Predictions (issue 14 item 3, docs/predictions.md): max_runtime as a bound, the action's
runtime estimate, history per task and shape from recent successes, overruns extended."""

import math
from dataclasses import replace
from datetime import timedelta

import msgpack
import pytest
from conftest import make_engine
from hypothesis import given, settings
from hypothesis import strategies as st
from test_backfill import T10, T100, T500, act, config, gpus, runs, start, warm

from engine import Engine
from engine._codes import WaitCode
from engine._config import parse_config
from engine._errors import SpecError
from engine._model import ActionSpec, Timeouts
from engine._sim import prepare, simulate
from engine._trace import Job
from storage import SCHEMA_VERSION, CorruptRecord, MemoryStore
from storage._store import check_schema

S = 1_000_000_000


def _gap():
    """Two 2-GPU actions run (history T100, 56 s); an 8-GPU head waits for both: its shadow
    time is now + T100 and it leaves no extra, so only rule (a) can place GPU work."""
    eng, clock = make_engine(config())
    warm(eng, small=T100, quick=T10, slow=T500)
    start(eng, clock, [gpus(f"s{i}", "small", 2) for i in range(2)])
    eng.enqueue(act("g", "train", resources={"cpu": 8, "gpu": 8}))
    return eng, clock


def bounded(run, task, seconds, n=2, **kw):
    return act(run, task, resources={"cpu": 1, "gpu": n},
               timeouts=Timeouts(max_runtime=seconds), **kw)


# ---------------------------------------------------------------------------------------------
# The order: max_runtime bound, estimate, history by task and shape


def test_max_runtime_alone_is_a_prediction_that_serves_rule_a():
    eng, _ = _gap()
    eng.enqueue(bounded("in", "never-seen", 30))       # ends by 30 s < 56 s: proven
    eng.enqueue(bounded("out", "never-seen-2", 90))    # may run past the shadow time
    assert runs(eng.tick()) == ["in"]
    assert eng.explain("acme/ml/prod/out/a").wait == WaitCode.HEAD_OF_LINE
    assert eng.predicted_runtime_of("acme/ml/prod/out/a") == 90
    assert eng.predicted_runtime_of("acme/ml/prod/g/a") is None        # nothing known


def test_max_runtime_caps_what_history_predicts():
    eng, _ = _gap()
    eng.enqueue(bounded("sl", "slow", 30))             # history says 311 s, the bound 30 s
    assert eng.predicted_runtime_of("acme/ml/prod/sl/a") == 30
    assert runs(eng.tick()) == ["sl"]


def test_the_estimate_wins_over_history():
    eng, clock = _gap()
    eng.enqueue(act("q", "quick", resources={"cpu": 1, "gpu": 2},
                    runtime_estimate=200))              # history 4.4 s, the client says 200
    eng.enqueue(act("sl", "slow", resources={"cpu": 1, "gpu": 2},
                    runtime_estimate=timedelta(seconds=20)))   # history 311 s, client 20
    assert eng.predicted_runtime_of("acme/ml/prod/q/a") == 200
    assert eng.predicted_runtime_of("acme/ml/prod/sl/a") == 20
    assert runs(eng.tick()) == ["sl"]
    assert eng.explain("acme/ml/prod/q/a").wait == WaitCode.HEAD_OF_LINE
    # The placed lease's predicted end is the estimate's (the head's ETA is unchanged: the
    # smalls still end first).
    assert eng.explain("acme/ml/prod/g/a").eta_ns == clock.now_ns() + T100


def test_history_is_per_task_and_shape():
    eng, clock = make_engine(config(nodes=2))
    [a] = start(eng, clock, [gpus("one", "etl", 2)])
    clock.advance(7)
    eng.complete(a.action, a.generation)
    two = eng.history_key(gpus("x", "etl", 2))
    four = eng.history_key(gpus("x", "etl", 4))
    assert two[0] == four[0] == "etl" and two != four
    assert eng.predicted_runtime(two) == 7 and eng.history.count(four) == 0
    eng.enqueue_many([gpus("p2", "etl", 2), gpus("p4", "etl", 4)])
    assert eng.predicted_runtime_of("acme/ml/prod/p2/a") == 7
    assert eng.predicted_runtime_of("acme/ml/prod/p4/a") is None   # another shape: unknown


def test_history_predicts_the_mean_of_the_last_two_successes():
    eng, clock = make_engine(config())
    for i, seconds in enumerate((100, 10, 20, 40)):
        [a] = start(eng, clock, [cpu(f"r{i}")])
        clock.advance(seconds)
        eng.complete(a.action, a.generation)
    key = eng.history_key(cpu("x"))
    assert eng.history.count(key) == 4
    assert eng.history.recent_ns(key) == [40 * S, 20 * S]
    assert eng.predicted_runtime(key) == 30
    # A failure teaches nothing.
    [b] = start(eng, clock, [cpu("bad")])
    clock.advance(1000)
    eng.complete(b.action, b.generation, "FAILED", recoverable=False)
    assert eng.predicted_runtime(key) == 30
    eng.enqueue(cpu("next"))
    assert eng.predicted_runtime_of("acme/ml/prod/next/a") == 30


def cpu(run):
    return act(run, "etl", resources={"cpu": 4})


# ---------------------------------------------------------------------------------------------
# Overruns: extended in steps, never assumed to end now


def _blocked_behind(seconds, max_runtime=None):
    """An 8-GPU action x runs (history ``seconds`` at its shape; optionally a max_runtime);
    an 8-GPU head waits for it. Returns (engine, clock)."""
    eng, clock = make_engine(config())
    spec = act("x", "job", resources={"cpu": 8, "gpu": 8},
               timeouts=Timeouts(max_runtime=max_runtime))
    warm(eng, spec, job=seconds * S)
    start(eng, clock, [spec])
    eng.enqueue(act("g", "train", resources={"cpu": 8, "gpu": 8}))
    eng.tick()
    return eng, clock


def test_an_overrun_is_extended_step_by_step_not_assumed_to_end_now():
    eng, clock = _blocked_behind(10)
    eta = lambda: eng.explain("acme/ml/prod/g/a").eta_ns     # noqa: E731
    assert eta() == 10 * S
    clock.set_ns(15 * S)                 # 5 s past its prediction: + 1 minute from it
    assert eta() == 70 * S
    clock.set_ns(69 * S)
    assert eta() == 70 * S
    clock.set_ns(71 * S)                 # past 1 minute of overrun: + 5 minutes
    assert eta() == 310 * S
    clock.set_ns(10 * S + 100 * 3600 * S + 1)   # past every step, no bound: unknown
    assert eta() is None


def test_an_overrun_is_bounded_by_the_max_runtime_backstop():
    eng, clock = _blocked_behind(10, max_runtime=100)
    grace = eng.config.engine.runtime_grace
    backstop = int((100 + grace) * S)            # it ran from 0: the engine ends it there
    assert eng.explain("acme/ml/prod/g/a").eta_ns == 10 * S
    assert backstop < 310 * S
    clock.set_ns(80 * S)                         # the extension alone would say 310 s
    assert eng.explain("acme/ml/prod/g/a").eta_ns == backstop


def test_a_backfilled_overrun_still_closes_the_gap_until_it_ends():
    eng, clock = _gap()
    eng.enqueue(gpus("q1", "quick", 2))
    [q1] = eng.tick()
    eng.mark_running(q1.action, q1.generation)
    clock.advance(2 * T10 / S)               # q1 overran: extended by a minute
    eng.enqueue(gpus("q2", "quick", 2))
    assert eng.tick() == []
    # The head's shadow now waits for q1's extended end (past the smalls' T100).
    assert eng.explain("acme/ml/prod/g/a").eta_ns == T10 + 60 * S


def test_a_lease_not_running_yet_has_not_overrun_its_prediction():
    # Predictions are of running time (history counts from RUNNING): a lease whose RUNNING
    # has not come (its pods pend) ends no sooner than its prediction from now, and a
    # backfilled one past its first prediction does not close the gap as a running one does.
    eng, clock = _gap()
    eng.enqueue(gpus("q1", "quick", 2))
    [q1] = eng.tick()                        # sent; no RUNNING yet
    clock.advance(2 * T10 / S)
    eng.enqueue(gpus("q2", "quick", 2))
    [q2] = eng.tick()                        # rule (a) stays open: q2 ends by the shadow
    assert str(q2.action) == "acme/ml/prod/q2/a"
    assert eng.explain("acme/ml/prod/g/a").eta_ns == T100
    eng.complete(q2.action, q2.generation)
    eng.mark_running(q1.action, q1.generation)
    clock.advance(2 * T10 / S)               # now it runs past its prediction: an overrun
    eng.enqueue(gpus("q3", "quick", 2))
    assert eng.tick() == []
    assert eng.explain("acme/ml/prod/q3/a").wait == WaitCode.HEAD_OF_LINE


# ---------------------------------------------------------------------------------------------
# Durability


def test_estimates_bounds_and_history_keys_survive_a_restart():
    eng, clock = _gap()
    eng.enqueue(bounded("b", "never-seen", 500, runtime_estimate=40))
    eng.enqueue(act("e", "slow", resources={"cpu": 1, "gpu": 2}, runtime_estimate=300))
    eng.enqueue(gpus("p", "new-task", 2))      # no history: its shape's prior
    before = {a: eng.predicted_runtime_of(f"acme/ml/prod/{a}/a")
              for a in ("b", "e", "g", "p")}
    prior = math.ceil((T100 + T10 + T500) / 3) / S
    assert before == {"b": 40, "e": 300, "g": None, "p": prior}
    key = eng.history_key(gpus("x", "small", 2))
    count = eng.history.count(key)
    store = eng.store
    eng.close()
    again = Engine(eng.config, clock=clock,
                   store=MemoryStore(store.partitions, backing=store.backing))
    assert {a: again.predicted_runtime_of(f"acme/ml/prod/{a}/a") for a in before} == before
    assert again.history.count(key) == count and again.predicted_runtime(key) == T100 / S
    again.register_worker("w-east", "east", 1000)
    assert runs(again.tick()) == ["b"]           # 40 s < 56 s: rule (a) from the estimate
    assert again.explain("acme/ml/prod/g/a").eta_ns == clock.now_ns() + T100


def test_an_older_store_is_refused_by_its_schema():
    check_schema(0, msgpack.packb(SCHEMA_VERSION))
    with pytest.raises(CorruptRecord, match="schema 1: a store written by older code"):
        check_schema(0, msgpack.packb(1))


# ---------------------------------------------------------------------------------------------
# Bad spec values


@pytest.mark.parametrize("value,fragment", [
    (0, "must be positive"), (-5, "must be positive"), (math.nan, "is not a duration"),
    ("10s", "is not a duration"), (True, "is not a duration"),
    (math.inf, "is not a duration")])
def test_a_bad_runtime_estimate_is_refused_naming_it(value, fragment):
    eng, _ = make_engine(config())
    with pytest.raises(SpecError, match=f"runtime_estimate.*{fragment}"):
        eng.enqueue(act("r", "t", resources={"cpu": 1}, runtime_estimate=value))
    with pytest.raises(SpecError, match="runtime_estimate"):    # the plain-data path too
        eng.enqueue({"id": "acme/ml/prod/r/a", "task": "t", "resources": {"cpu": 1},
                     "runtime_estimate": value})
    assert eng.inspect().action_rows == 0


def test_an_estimate_above_max_runtime_is_refused():
    eng, _ = make_engine(config())
    with pytest.raises(SpecError, match=r"runtime_estimate 120s exceeds timeouts.max_runtime "
                                        r"60s"):
        eng.enqueue(bounded("r", "t", 60, runtime_estimate=120))


def test_the_estimate_travels_as_plain_data():
    spec = ActionSpec.from_dict({"id": "acme/ml/prod/r/a", "task": "t",
                                 "resources": {"cpu": 1}, "runtime_estimate": 12.5})
    assert spec.runtime_estimate == 12.5
    eng, _ = make_engine(config())
    eng.enqueue(spec)
    assert eng.predicted_runtime_of("acme/ml/prod/r/a") == 12.5
    assert eng.inspect().record(0).spec.runtime_estimate == 12.5


# ---------------------------------------------------------------------------------------------
# The simulator passes a trace's estimates


def test_the_simulator_passes_trace_estimates_into_the_action():
    cfg = parse_config(config(), source="<test>")
    node = {"cpu": 1, "gpu:H100": 4}
    jobs = [Job(id="0", submit=0, runtime=100, pods=((1, node),), task="long", estimate=100),
            Job(id="1", submit=1, runtime=50, pods=((1, {"cpu": 8, "gpu:H100": 8}),),
                task="big"),
            Job(id="2", submit=2, runtime=10, pods=((1, node),), task="short", estimate=10)]
    assert [s.runtime_estimate for s in prepare(cfg, jobs).specs] == [100, None, 10]
    with_estimate = simulate(cfg, jobs, "backfill", nodes=False)
    without = simulate(cfg, [*jobs[:2], replace(jobs[2], estimate=None)], "backfill",
                       nodes=False)
    # Job 1 waits for job 0 (its end known from its estimate); job 2 has no history, and
    # backfills into the gap only by its own estimate (rule (a)).
    assert with_estimate.backfilled == 1 and without.backfilled == 0
    assert with_estimate.mean_wait_s < without.mean_wait_s


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3600), st.one_of(st.none(), st.integers(1, 200_000)),
       st.lists(st.integers(0, 400_000), min_size=1, max_size=12))
def test_an_extended_end_never_falls_before_now_nor_moves_earlier(seconds, bound, times):
    # The head waits for one lease predicted to run ``seconds`` (bounded by ``bound``): its
    # ETA is that lease's end, which is known until the steps run out (no bound), never
    # before now, never earlier than it said before, and within the backstop when bounded.
    eng, clock = _blocked_behind(seconds, max_runtime=bound)
    backstop = None if bound is None else int((bound + eng.config.engine.runtime_grace) * S)
    last = 0
    for t in sorted(times):
        clock.set_ns(t * S)
        eta = eng.explain("acme/ml/prod/g/a").eta_ns
        if eta is None:
            assert bound is None and t * S >= (seconds + 100 * 3600) * S
            continue
        assert eta >= clock.now_ns() and eta >= last
        if backstop is not None:
            assert eta <= max(backstop, clock.now_ns())
        last = eta
