"""Tick benchmark: prints ONE JSON object on stdout (nothing else).

    .venv/bin/python bench/tick.py [--seed N] [--warmup N] [--ticks N] [--gate-ticks N] [--cpu K]

What it measures (bench/README.md has the goals and how to read each number):

* ``tick_ms`` / ``tick_ms_p90``: wall time of the tick's decision (due timers, the periodic
  lease-expiry sweep, the kernel tick, then the engine's handling of UNSCHEDULABLE failures) in
  the steady state of ``bench/workload.py``: 1,000 pending actions over 100 queues, 3 clusters,
  12 workers. Everything between two timed calls (drain, mark running, complete, heartbeats,
  enqueue replacements, advancing the ManualClock) is untimed. ``tick_ms`` is
  ``Engine.decide()``, whose turn ends by encoding the decided rows into its group;
  ``tick_commit_ms`` is ``Engine.commit()`` of that group on the in-memory store (an LMDB
  commit adds its fdatasync: ``sync_commit_ms`` of ``bench/reload.py``).
  ``tick_kernel_ms`` is the Cython kernel's pass alone within those decisions
  (``Inspection.last_kernel_ns``), ``tick_python_ms`` the rest of each (medians of each).
* ``gate_ms_per_1000``: the resource gate's cost per 1,000 actions: the tick's own gate
  function timed in a C loop over the steady state's pending actions (see
  :func:`measure_gate`).
* ``admission_check_ns``: one queue admission check in the C loop of
  ``cext.admission_check_bench`` (median of several runs).
* ``tick_allocations`` / ``engine_tick_allocations``: Python allocations per steady-state tick
  traced by tracemalloc (see :func:`measure_allocations`).
"""

import argparse
import gc
import inspect
import json
import os
import platform
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import numpy as np  # noqa: E402
from workload import SEED, Workload  # noqa: E402

import cext  # noqa: E402
from engine._codes import WaitCode  # noqa: E402
from engine._engine import kernel_pass  # noqa: E402

WARMUP_TICKS = 600      # long enough for in-flight work to reach its steady level
TIMED_TICKS = 500       # timed Engine.schedule() calls (>= 200)
GATE_ITERATIONS = 200   # passes over the pending actions per gate timing
GATE_RUNS = 9           # gate timings (median)
ALLOC_TICKS = 60        # traced ticks for each allocation figure
ADMISSION_ITERATIONS = 20_000_000
ADMISSION_RUNS = 9
ADMISSION_ROWS = 256    # demand rows cycled by the C loop (fits L1: 256 x R x 8 bytes)


def _median(values):
    return float(statistics.median(values))


def _p90(values):
    return float(np.percentile(np.asarray(values, dtype=np.float64), 90))


# --------------------------------------------------------------------------------- tick_ms


def measure_tick(seed, warmup, ticks, admission="shapes", plain_pools=None, cpu_clock=False):
    """Median (and p90) wall time of the tick's decision (``Engine.decide()``) over ``ticks``
    steady-state ticks; its group commit (``Engine.commit()``) is timed apart."""
    w = Workload(seed=seed, resource_gate="enforce", admission=admission,
                 plain_pools=plain_pools)
    w.warm_up(warmup)
    # --clock cpu: this thread's CPU time instead of wall time (steadier on a busy machine).
    clock = time.thread_time_ns if cpu_clock else time.perf_counter_ns
    samples = [w.tick_timed(clock) for _ in range(ticks)]
    ms = [s["ns"] / 1e6 for s in samples]
    out = {
        "tick_ms": round(_median(ms), 4),
        "tick_ms_p90": round(_p90(ms), 4),
        "tick_ms_max": round(max(ms), 4),
        # The Cython kernel's pass alone (Inspection.last_kernel_ns), and the rest of the
        # same decisions (timers, the expiry sweep, encoding the decided rows: Python).
        "tick_kernel_ms": round(_median([s["kernel_ns"] / 1e6 for s in samples]), 4),
        "tick_python_ms": round(
            _median([(s["ns"] - s["kernel_ns"]) / 1e6 for s in samples]), 4),
        # The group commit of the same ticks (encoding the decided rows and the in-memory
        # store's commit), and the two together (what Engine.schedule() costs).
        "tick_commit_ms": round(_median([s["commit_ns"] / 1e6 for s in samples]), 4),
        "tick_with_commit_ms": round(
            _median([(s["ns"] + s["commit_ns"]) / 1e6 for s in samples]), 4),
        "ticks": len(samples),
        "pending_median": _median([s["pending"] for s in samples]),
        "assigned_per_tick_median": _median([s["placed"] for s in samples]),
        "candidates_per_tick_median": _median([s["candidates"] for s in samples]),
        "failed_unschedulable_total": int(sum(s["failed"] for s in samples)),
        "in_flight_end": w.in_flight(),
        "tick_ns_per_candidate_median": round(
            _median([s["ns"] / max(1, s["candidates"]) for s in samples]), 1),
    }
    sweeps = [s["ns"] / 1e6 for s in samples if s["sweep"]]
    plain = [s["ns"] / 1e6 for s in samples if not s["sweep"]]
    # Ticks that ran Engine.schedule()'s periodic lease-expiry sweep (a scan of every action
    # row) are part of tick_ms; shown apart here so their cost is visible.
    out["sweep_ticks"] = len(sweeps)
    out["sweep_tick_ms_median"] = round(_median(sweeps), 4) if sweeps else None
    out["non_sweep_tick_ms_median"] = round(_median(plain), 4) if plain else None
    out["action_rows_end"] = int(w.view.action_rows)
    # Why the candidates of the last timed tick waited (or PLACED), for context.
    st, n = w.state, w.view.action_rows
    codes = st.a_wait_code[:n][st.a_wait_tick[:n] == w.view.tick_no]
    out["last_tick_wait_codes"] = {
        WaitCode(int(c)).name: int(k) for c, k in zip(*np.unique(codes, return_counts=True),
                                                       strict=True)}
    return w, out


# ------------------------------------------------------------------------------------ gate


def measure_gate(w, iterations, runs):
    """The resource gate's cost per 1,000 actions, timed in a C loop.

    ``TickKernel.gate_bench`` runs the very function the tick calls for each candidate that
    passed the caps (``_gate``: the queue's remaining budget, then the open clusters whose
    free vector covers the total and whose node shapes hold every pod, choosing the one with
    most free accelerators then cpu) over the actions pending in each queue of the steady
    state, against the current budgets and free vectors, without placing anything. The figure
    is the median over ``runs`` of (elapsed / evaluations) * 1000, in ms.

    Replaying the workload with ``resource_gate = "off"`` and subtracting does not measure the
    gate: with the gate off the engine places different work (count caps only), so the two
    runs do different work per tick; that comparison came out at about zero either way.
    """
    st, k = w.state, w.view.kernel
    n = w.view.action_rows
    queued = np.nonzero(st.a_state[:n] == 1)[0]
    by_queue = {}
    for row in queued:
        by_queue.setdefault(int(st.a_queue[row]), []).append(int(row))
    per_action = []
    evaluations = passed = 0
    for _ in range(runs):
        elapsed = count = 0
        for q, rows in by_queue.items():
            ns, evals, ok = k.gate_bench(q, np.asarray(rows, dtype=np.int32), iterations)
            elapsed += ns
            count += evals
            passed += ok
        per_action.append(elapsed / count)
        evaluations += count
    detail = {
        "ns_per_action_median": round(_median(per_action), 2),
        "actions": len(queued),
        "queues": len(by_queue),
        "evaluations": evaluations,
        "passed_fraction": round(passed / max(1, evaluations), 3),
        "runs": runs,
    }
    return round(_median(per_action) * 1000 / 1e6, 4), detail


# ------------------------------------------------------------------------------- admission


def measure_admission(w, iterations, runs):
    """ns per queue admission check, median over ``runs`` C loops of ``iterations`` each.

    The demand rows are real: ADMISSION_ROWS demand vectors of actions pending in the steady
    state; the budget is the remaining budget (max_resources minus in flight) of the queue with
    the tightest finite cpu budget, so a realistic share of checks pass and fail.
    """
    st = w.state
    n = w.view.action_rows
    pending = np.nonzero(st.a_state[:n] == 1)[0]
    rng = np.random.default_rng(SEED)
    rows = rng.choice(pending, size=min(ADMISSION_ROWS, pending.size), replace=False)
    demands = np.ascontiguousarray(st.a_demand[np.sort(rows)], dtype=np.int64)
    inflight = (st.q_res_adm - st.q_res_rel).astype(np.int64)
    finite = np.nonzero(st.q_max[:, 0] < (1 << 62))[0]
    q = int(finite[np.argmin(st.q_max[finite, 0])]) if finite.size else 0
    budget = np.where(st.q_max[q] >= (1 << 62), st.q_max[q], st.q_max[q] - inflight[q])
    budget = np.ascontiguousarray(budget, dtype=np.int64)
    per_check = []
    admitted = 0
    for _ in range(runs):
        elapsed, admitted = cext.admission_check_bench(demands, budget, 1, iterations)
        per_check.append(elapsed / iterations)
    # Sanity: the C loop's count must match numpy's answer for the same cycle of rows.
    fits = (demands <= budget).all(axis=1)
    k = demands.shape[0]
    expected = int(fits.sum()) * (iterations // k) + int(fits[: iterations % k].sum())
    if admitted != expected:
        raise AssertionError(f"admission_check_bench admitted {admitted}, expected {expected}")
    return round(_median(per_check), 3), {
        "iterations": iterations,
        "runs": runs,
        "rows": int(k),
        "resources": int(demands.shape[1]),
        "admitted_fraction": round(admitted / iterations, 3),
        "min_ns": round(min(per_check), 3),
    }


# ----------------------------------------------------------------------------- allocations


def _probe(fn, arg):
    return fn(arg)


# The line of the call above: allocations whose traceback passes through it were made by it.
_PROBE_LINE = _probe.__code__.co_firstlineno + 1


def _traced_call(fn, arg, probe_filter):
    """Call ``fn(arg)`` and return (result, new blocks still alive, their bytes, peak bytes).

    tracemalloc's traces are cleared just before the call, so a snapshot right after it
    holds exactly the blocks allocated since; the filter keeps those whose traceback passes
    through the probe line (the call), dropping the snapshot machinery's own allocations. The
    peak (reset before the call) also catches blocks allocated and freed inside the call.
    """
    tracemalloc.clear_traces()
    tracemalloc.reset_peak()
    result = _probe(fn, arg)
    _, peak = tracemalloc.get_traced_memory()
    snap = tracemalloc.take_snapshot().filter_traces([probe_filter])
    blocks = len(snap.traces)
    size = sum(t.size for t in snap.traces)
    return result, blocks, size, peak


def _kernel_call_line():
    # The line of engine._engine.kernel_pass that calls the kernel: allocations whose
    # traceback passes through it were made by the Cython tick itself.
    lines, first = inspect.getsourcelines(kernel_pass)
    return first + next(i for i, line in enumerate(lines) if "kernel.run(" in line)


def measure_allocations(w, ticks):
    """Python allocations per steady-state tick (tracemalloc): the kernel, the decision and
    the whole ``Engine.tick()``.

    ``tick_allocations``: new allocation blocks made by the Cython tick per tick, traced
    inside ``Engine.decide()`` (the real path) and kept when their traceback passes through
    the kernel call (``engine._engine.kernel_pass``); median over ``ticks`` steady-state
    ticks with the churn in between as in the timed run. ``decide_allocations``: the same for
    all of ``Engine.decide()`` (timers, sweep, dirty marks, the group it returns).
    ``engine_tick_allocations``: the whole ``Engine.tick()`` (schedule plus the drain, which
    builds one frozen ``Assignment`` per placement, so it is not expected to be 0). Counted
    are blocks allocated during the call and still alive when it returns; ``*_peak_bytes`` is
    the most traced memory seen during the call, which also shows allocate-and-free inside it.
    """
    tracemalloc.start(32)
    try:
        probe_filter = tracemalloc.Filter(True, _probe.__code__.co_filename,
                                          lineno=_PROBE_LINE, all_frames=True)
        kernel_filter = tracemalloc.Filter(True, kernel_pass.__code__.co_filename,
                                           lineno=_kernel_call_line(), all_frames=True)
        # Self-test: the probe must see a call that does allocate (one bytes object: one
        # block), so that a 0 below means "no allocation", not "nothing traced".
        _, selftest, size, _ = _traced_call(bytes, 1000, probe_filter)
        if selftest != 1 or size < 1000:
            raise AssertionError(f"allocation probe self-test saw {selftest} blocks "
                                 f"({size} bytes), not 1 of >= 1000 bytes")
        eng = w.engine
        k_blocks, k_bytes, d_blocks, d_peak = [], [], [], []
        for _ in range(ticks):
            w.advance()
            tracemalloc.clear_traces()
            tracemalloc.reset_peak()
            group = _probe(type(eng).decide, eng)
            _, peak = tracemalloc.get_traced_memory()
            snap = tracemalloc.take_snapshot()
            kern = snap.filter_traces([kernel_filter]).traces
            k_blocks.append(len(kern))
            k_bytes.append(sum(t.size for t in kern))
            d_blocks.append(len(snap.filter_traces([probe_filter]).traces))
            d_peak.append(peak)
            eng.commit(group)
            w.after_tick()
        e_blocks, e_bytes, e_peak, placed = [], [], [], []
        for _ in range(ticks):
            w.advance()
            assignments, blocks, size, peak = _traced_call(type(eng).tick, eng, probe_filter)
            e_blocks.append(blocks)
            e_bytes.append(size)
            e_peak.append(peak)
            placed.append(len(assignments))
            w.after_tick(assignments)
    finally:
        tracemalloc.stop()
    return {
        "tick_allocations": _median(k_blocks),
        "tick_alloc_bytes": _median(k_bytes),
        "tick_allocations_max": int(max(k_blocks)),
        "decide_allocations": _median(d_blocks),
        "decide_alloc_peak_bytes_max": int(max(d_peak)),
        "engine_tick_allocations": _median(e_blocks),
        "engine_tick_alloc_bytes": _median(e_bytes),
        "engine_tick_alloc_peak_bytes_median": _median(e_peak),
        "engine_tick_assigned_median": _median(placed),
        "alloc_ticks": ticks,
    }


# ------------------------------------------------------------------------------------ main


def huge_pages_kb():
    """This process's anonymous memory in transparent huge pages (kB; None where the kernel
    does not say): a table's columns share one buffer, which numpy asks to be backed by
    huge pages (engine/_state.py, _arena); with THP off, every column read misses the TLB."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--warmup", type=int, default=WARMUP_TICKS)
    ap.add_argument("--ticks", type=int, default=TIMED_TICKS)
    ap.add_argument("--cpu", type=int, default=None, help="pin the process to this CPU")
    ap.add_argument("--admission", choices=("shapes", "nodes"), default="shapes",
                    help="every cluster's admission (nodes: pods placed on nodes, docs/nodes.md)")
    ap.add_argument("--plain-pools", action="store_true",
                    help="warm-pool queues submit plain pods (implied by --admission nodes)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="time tick_ms by wall clock or by the thread's CPU time")
    ap.add_argument("--tick-only", action="store_true",
                    help="only the tick_ms figures (skip the gate, admission, allocations)")
    args = ap.parse_args(argv)
    if args.ticks < 200:
        ap.error("--ticks must be at least 200")
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})

    w, result = measure_tick(args.seed, args.warmup, args.ticks, args.admission,
                             args.plain_pools or None, args.clock == "cpu")
    result["clock"] = args.clock
    result["anon_huge_pages_kb"] = huge_pages_kb()
    if args.tick_only:
        result["admission"] = args.admission
        result["plain_pools"] = w.plain_pools
        print(json.dumps(result))
        return
    gate, gate_detail = measure_gate(w, GATE_ITERATIONS, GATE_RUNS)
    result["gate_ms_per_1000"] = gate
    result["gate"] = gate_detail
    result["admission_check_ns"], result["admission"] = measure_admission(
        w, ADMISSION_ITERATIONS, ADMISSION_RUNS)
    gc.collect()
    result.update(measure_allocations(w, ALLOC_TICKS))
    result["workload"] = {
        "seed": args.seed,
        "warmup_ticks": args.warmup,
        "queues": len(w.streams),
        "clusters": [c.name for c in w.config.clusters],
        "workers": w.view.worker_sessions,
        "resources": list(w.config.resources.names),
        "tick_interval_s": w.dt,
        "admission": args.admission,
        "plain_pools": w.plain_pools,
    }
    result["python"] = platform.python_version()
    result["numpy"] = np.__version__
    result["cpu_count"] = os.cpu_count()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
