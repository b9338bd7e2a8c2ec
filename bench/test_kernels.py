"""Micro-benchmarks of the Cython kernels (pytest-benchmark); each also checks its result.

    .venv/bin/python -m pytest bench/test_kernels.py --benchmark-only

Not part of the main suite (``testpaths = ["tests"]``). Every state change a benchmark makes is
undone or churned away in an untimed ``setup``, so each round times the same kind of work.
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from workload import Workload  # noqa: E402

import cext  # noqa: E402
from engine import ActionSpec, Engine, ManualClock, parse_config  # noqa: E402
from engine._codes import RowState  # noqa: E402
from storage import MemoryStore  # noqa: E402

WARMUP_TICKS = 300
ROUNDS = 200


@pytest.fixture(scope="module")
def steady():
    """The bench workload (bench/workload.py) in its steady state: ~1,000 pending actions."""
    w = Workload()
    w.warm_up(WARMUP_TICKS)
    return w


def test_engine_decide(benchmark, steady):
    """``Engine.decide()``: the tick's decision over ~1,000 pending candidates (timers, the
    expiry sweep, the nogil kernel, the failures it found), without its group commit."""
    w = steady
    eng = w.engine
    rounds = {"placed": [], "candidates": [], "pending": []}
    groups = []

    def setup():
        if groups:   # commit and churn after the previous round (untimed)
            eng.commit(groups[-1])
            rounds["placed"].append(groups[-1].placed)
            rounds["candidates"].append(w.candidates_last_tick())
            w.after_tick()
        rounds["pending"].append(w.pending())
        w.advance()
        return (), {}

    def target():
        groups.append(eng.decide())

    benchmark.pedantic(target, setup=setup, rounds=ROUNDS, warmup_rounds=1)
    eng.commit(groups[-1])
    rounds["placed"].append(groups[-1].placed)
    rounds["candidates"].append(w.candidates_last_tick())
    w.after_tick()
    benchmark.extra_info["candidates_median"] = float(np.median(rounds["candidates"]))
    benchmark.extra_info["placed_median"] = float(np.median(rounds["placed"]))
    assert sum(rounds["placed"]) > 0, "the steady state must keep placing work"
    assert np.median(rounds["candidates"]) > 500
    assert min(rounds["pending"]) >= 990
    # Every in-flight count is admitted minus released; none may have gone negative.
    st = w.state
    assert (st.q_adm >= st.q_rel).all() and (st.c_adm >= st.c_rel).all()


def test_engine_schedule(benchmark, steady):
    """``Engine.schedule()``: the kernel plus the engine's failure handling (the real path)."""
    w = steady
    placed = []
    started = []

    def setup():
        if started:
            w.after_tick()
        started.append(1)
        w.advance()
        return (), {}

    def target():
        placed.append(w.engine.schedule())

    benchmark.pedantic(target, setup=setup, rounds=ROUNDS, warmup_rounds=1)
    w.after_tick()
    benchmark.extra_info["placed_median"] = float(np.median(placed))
    assert sum(placed) > 0


@pytest.fixture(scope="module")
def admission_inputs(steady):
    st = steady.state
    n = steady.view.action_rows
    rows = np.nonzero(st.a_state[:n] == RowState.QUEUED)[0][:256]
    demands = np.ascontiguousarray(st.a_demand[rows], dtype=np.int64)
    # A budget that admits part of the rows: the column-wise median demand.
    budget = np.ascontiguousarray(np.median(demands, axis=0).astype(np.int64))
    return demands, budget


def test_admission_check_bench(benchmark, admission_inputs):
    """``cext.admission_check_bench``: the queue admission check in a C loop."""
    demands, budget = admission_inputs
    iterations = 2_000_000
    elapsed, admitted = benchmark(cext.admission_check_bench, demands, budget, 1, iterations)
    fits = (demands <= budget).all(axis=1)
    k = demands.shape[0]
    expected = int(fits.sum()) * (iterations // k) + int(fits[: iterations % k].sum())
    assert admitted == expected
    assert 0 < admitted < iterations, "the budget should admit some rows and refuse others"
    assert elapsed > 0
    benchmark.extra_info["ns_per_check_last"] = elapsed / iterations
    # No action slot left: nothing is admitted, whatever the demand.
    assert cext.admission_check_bench(demands, budget, 0, 1000)[1] == 0


def test_push_many(benchmark):
    """``TickKernel.push_many``: link 1,000 filled-in rows into their lanes and rings."""
    w = Workload()    # fresh: exactly 1,000 pending rows, pushed by enqueue_many
    st, k = w.state, w.view.kernel
    rows = np.nonzero(st.a_state[: w.view.action_rows] == RowState.QUEUED)[0].astype(np.int32)
    assert rows.size == 1000

    def setup():
        for r in rows.tolist():
            k.remove(r)
        assert st.q_pending.sum() == 0
        return (rows,), {}

    benchmark.pedantic(k.push_many, setup=setup, rounds=ROUNDS, warmup_rounds=1)
    assert st.q_pending.sum() == 1000
    # Every row is reachable from a lane head, in push order within its lane.
    seen = []
    for lane in np.unique(st.a_lane[rows]).tolist():
        a = int(st.ln_head[lane])
        while a >= 0:
            seen.append(a)
            a = int(st.a_next[a])
        assert st.ln_in_ring[lane] == 1
    assert sorted(seen) == sorted(rows.tolist())
    # And the pushed rows schedule: a tick places some of them.
    w.advance()
    assert w.engine.schedule() > 0


RELEASE_BATCH = 256
_RELEASE_CONFIG = {
    "resources": ["cpu", "memory", "gpu:H100"],
    "engine": {"initial_capacity": 4096},
    "clusters": {"c": {"capacity": {"cpu": 100000, "memory": "100Ti", "gpu:H100": 4096}}},
    "queues": {"q": {"scheduling": "GREEDY_CAPACITY"}},
}


def test_release(benchmark):
    """``TickKernel.release``: give back the in-flight counts of 256 placed leases."""
    clock = ManualClock(start_ns=10**18)
    eng = Engine(parse_config(_RELEASE_CONFIG), clock=clock, store=MemoryStore())
    eng.register_worker("w", "c", 1_000_000)
    view = eng.inspect()
    st, k = view.arrays, view.kernel
    batch = [0]

    def setup():
        batch[0] += 1
        specs = [ActionSpec(id=f"t/p/d/r{batch[0]}/a{i}", task="x", run_queue="q",
                            resources={"cpu": 1, "memory": "1Gi", "gpu": i % 2})
                 for i in range(RELEASE_BATCH)]
        eng.enqueue_many(specs)
        clock.advance(0.1)
        assert eng.schedule() == RELEASE_BATCH
        rows = [int(st.d_action[j % st.d_action.shape[0]]) for j in range(k.d_head, k.d_tail)]
        k.consume_dispatch(k.d_tail - k.d_head)
        return (rows, clock.now_ns()), {}

    def release_all(rows, now):
        release = k.release
        return sum(release(r, now) for r in rows)

    released = benchmark.pedantic(release_all, setup=setup, rounds=ROUNDS, warmup_rounds=1)
    assert released == RELEASE_BATCH
    # Everything placed was released exactly once: nothing in flight, a second release is a
    # no-op, and the counters never went past each other.
    assert int(st.q_adm[0] - st.q_rel[0]) == 0
    assert (st.c_adm == st.c_rel).all()
    last = [int(r) for r in np.nonzero(st.a_gen[: view.action_rows] > 0)[0][-RELEASE_BATCH:]]
    assert not any(k.release(r, clock.now_ns()) for r in last)
    benchmark.extra_info["batch"] = RELEASE_BATCH
