"""The whole life cycle in process, over the real LmdbStore with sync on: prints ONE JSON object.

* ``lifecycle_per_s``: ``N`` (100,000) actions through fan-out enqueue (``enqueue_fanout``,
  batches of ``BATCH`` actions of one task, one synced group commit), the tick and the columnar
  drain in one loop turn (``Engine.schedule`` then ``drain_columns`` inside ``Engine.turn``:
  one synced group commit, the leases used only once it returned) and one ``report_many`` of
  SUCCEEDED per drained batch, as a worker would send it (one synced group commit). Every
  transition is durable before the next one acts on it. Wall time from the first enqueue to
  the last report's return.
* ``abort_100k_ms``: ``Engine.abort`` of the root of a run of 100,000 actions (half of them
  running, half queued): one call, one group commit; the median of 3 (a fresh engine and
  store each), ``abort_runs_ms`` each.
* ``bytes_per_live_action``: memory (tracemalloc: the Python heap and numpy buffers) the
  engine holds per live fan-out action, with ``LIVE`` (100,000) actions enqueued on a
  table sized for them; ``table_bytes_per_row`` is the part of it that is the action table's
  columns.
* ``rss_growth_pct``: process RSS after ``CHURN`` (5,000,000) actions went through the life
  cycle with about ``LIVE_CHURN`` (10,000) live at any time, against RSS once warm (after
  200,000: the store holds a full retention's outcomes by then); memory should be bounded by
  live work, not by history. The churn's store keeps outcomes for ``CHURN_RETENTION`` (1 s)
  of its clock, which advances ``CHURN_BATCH_S`` (10 ms) a batch, so about 100,000 outcomes
  are retained at any time and ``schedule()``'s sweep deletes the expired ones, as a shard
  does. RSS counts the pages of LMDB's memory map the process has touched (page cache of
  the retained outcomes), so the same growth is also given for anonymous memory alone
  (``anon_growth_pct``: RSS less file-backed pages, /proc/self/smaps_rollup) and for the
  Python heap and numpy buffers (``heap_growth_pct``, tracemalloc); ``churn_retained_end``
  and ``churn_runs_end`` are the retained outcomes and the runs in memory at the end.
  ``rss_growth_second_half_pct`` / ``anon_growth_second_half_pct``: the same growth from
  the churn's half-way point to its end, when another 2,500,000 actions of history pass
  through a store whose file has reached its size (LMDB reuses freed pages; the file stops
  growing after about 700,000 here, but RSS keeps counting pages of it the process touches
  for the first time, which the figure from 200,000 includes).

Usage: ``python bench/lifecycle.py [--n N] [--churn N] [--only PART]``.
"""

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import psutil  # noqa: E402

from engine import ActionSpec, Engine, ManualClock, Phase, parse_config  # noqa: E402
from engine._state import ACTION_FIELDS  # noqa: E402

BATCH = 1000
N = 100_000
LIVE = 100_000
CHURN = 5_000_000
LIVE_CHURN = 10_000
# The churn's store keeps outcomes for CHURN_RETENTION seconds of its clock, which advances
# CHURN_BATCH_S a batch: about 100 batches (100,000 outcomes) retained at any time.
CHURN_RETENTION = 1.0
CHURN_BATCH_S = 0.01


def config(path, capacity=1 << 17, retention="7d"):
    return {
        "resources": ["cpu", "memory"],
        "clusters": {"east": {}},          # unknown capacity: unlimited
        "queues": {"batch": {"scheduling": "GREEDY_CAPACITY", "depth": 4_000_000}},
        "engine": {"default_queue": "batch", "initial_capacity": capacity,
                   "max_candidates": 1 << 16, "dispatch_capacity": 1 << 17,
                   "heartbeat_interval": 3600},
        "storage": {"path": str(path), "partitions": 16, "map_size": "1Gi",
                    "max_map_size": "64Gi", "retention": retention},
    }


def template(run, task="work"):
    return ActionSpec(id=f"tenant{run % 64}/p/d/run{run}/map", task=task,
                      resources={"cpu": "250m", "memory": "512Mi"})


def lifecycle(path, n):
    eng = Engine(parse_config(config(path)), clock=ManualClock(time.time_ns()))
    eng.register_worker("w", "east", 1 << 30)
    names = [f"i{k}" for k in range(BATCH)]
    done = 0
    t0 = time.perf_counter()
    for b in range(n // BATCH):
        eng.enqueue_fanout(template(b), names)
        with eng.turn():            # decide and hand out in one group commit: the batch is
            eng.schedule()          # used only once the turn (its commit) has returned
            batch = eng.drain_columns()
        refused = eng.report_many(batch.tokens, Phase.SUCCEEDED, worker="w")
        if refused:
            raise SystemExit(f"{len(refused)} reports refused")
        done += len(batch)
    elapsed = time.perf_counter() - t0
    eng.close()
    if done != n:
        raise SystemExit(f"{done} of {n} actions went through")
    return n / elapsed


def abort_run(path, n):
    eng = Engine(parse_config(config(path)), clock=ManualClock(time.time_ns()))
    eng.register_worker("w", "east", n // 2)     # half of them run, half wait for a slot
    [root] = eng.enqueue_many([ActionSpec(id="acme/p/d/big/root", task="root",
                                          resources={"cpu": "250m"})])
    kids = ActionSpec(id="acme/p/d/big/k", task="k", parent=str(root),
                      resources={"cpu": "250m"})
    for start in range(0, n - 1, 10_000):
        eng.enqueue_fanout(kids, [f"k{i}" for i in range(start, min(n - 1, start + 10_000))])
    while eng.schedule():
        eng.drain_columns()
    t = time.perf_counter()
    ended = eng.abort(root)
    ms = (time.perf_counter() - t) * 1e3
    eng.close()
    if len(ended) != n:
        raise SystemExit(f"abort ended {len(ended)} of {n}")
    return ms


def memory_per_action(path, n):
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    eng = Engine(parse_config(config(path, capacity=n)), clock=ManualClock(time.time_ns()))
    empty = tracemalloc.get_traced_memory()[0]
    names = [f"i{k}" for k in range(BATCH)]
    for b in range(n // BATCH):
        eng.enqueue_fanout(template(b), names)
    gc.collect()
    full = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    view = eng.inspect()
    table = sum(getattr(view.arrays, k).nbytes for k in ACTION_FIELDS)
    rows = view.arrays.a_state.shape[0]
    eng.close()
    del base
    return (full - empty + table) / n, table / rows


def _anon_bytes():
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) * 1024
    return 0


def churn(path, total, live):
    tracemalloc.start()
    clock = ManualClock(time.time_ns())
    eng = Engine(parse_config(config(path, capacity=1 << 14, retention=CHURN_RETENTION)),
                 clock=clock)
    eng.register_worker("w", "east", live)
    proc = psutil.Process()
    names = [f"i{k}" for k in range(BATCH)]
    rss_warm = anon_warm = heap_warm = rss_half = anon_half = None
    # Warm once the store holds a full retention's worth of outcomes (and at least 10x live).
    warm = max(live * 10, 2 * round(CHURN_RETENTION / CHURN_BATCH_S) * BATCH)
    done = b = 0
    t0 = time.perf_counter()
    while done < total:
        eng.enqueue_fanout(template(b), names)
        b += 1
        with eng.turn():
            eng.schedule()
            batch = eng.drain_columns()
        eng.report_many(batch.tokens, Phase.SUCCEEDED)
        done += len(batch)
        clock.advance(CHURN_BATCH_S)
        if rss_warm is None and done >= warm:
            gc.collect()
            rss_warm, anon_warm = proc.memory_info().rss, _anon_bytes()
            heap_warm = tracemalloc.get_traced_memory()[0]
        if rss_half is None and done >= total // 2:
            gc.collect()
            rss_half, anon_half = proc.memory_info().rss, _anon_bytes()
    elapsed = time.perf_counter() - t0
    gc.collect()
    rss_end, anon_end = proc.memory_info().rss, _anon_bytes()
    heap_end = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    rows = eng.inspect().arrays.a_state.shape[0]
    retained = sum(1 for _ in eng.store.scan("retained"))
    runs = len(eng.inspect().runs())
    eng.close()
    return {"rss_growth_pct": round((rss_end - rss_warm) / rss_warm * 100, 1),
            "churn_retained_end": retained,
            "churn_runs_end": runs,
            "anon_growth_pct": round((anon_end - anon_warm) / anon_warm * 100, 1),
            # The second half adds as much history as the first: growth here is what more
            # history costs once the store's file has been cycled through.
            "rss_growth_second_half_pct": round((rss_end - rss_half) / rss_half * 100, 1),
            "anon_growth_second_half_pct": round((anon_end - anon_half) / anon_half * 100, 1),
            "heap_growth_pct": round((heap_end - heap_warm) / heap_warm * 100, 1),
            "rss_warm_bytes": rss_warm, "rss_end_bytes": rss_end,
            "anon_warm_bytes": anon_warm, "anon_end_bytes": anon_end,
            "heap_warm_bytes": heap_warm, "heap_end_bytes": heap_end,
            "churn_table_rows": rows,
            "churn_retention_s": CHURN_RETENTION, "churn_clock_per_batch_s": CHURN_BATCH_S,
            # Through the whole life cycle including reclaiming every row (traced: slower).
            "churn_per_s": round(done / elapsed)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=N)
    ap.add_argument("--churn", type=int, default=CHURN)
    ap.add_argument("--only", choices=("lifecycle", "abort", "memory", "churn"),
                    help="measure one part only")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="leasehold-lifecycle-"))
    out = {}
    try:
        if args.only in (None, "lifecycle"):
            rates = [lifecycle(base / f"l{i}", args.n) for i in range(3)]
            out.update(lifecycle_per_s=round(float(np.median(rates))),
                       lifecycle_runs_per_s=[round(r) for r in rates], actions=args.n)
        if args.only in (None, "abort"):
            runs = [abort_run(base / f"abort{i}", 100_000) for i in range(3)]
            out.update(abort_100k_ms=round(float(np.median(runs)), 1),
                       abort_runs_ms=[round(r, 1) for r in runs])
        if args.only in (None, "memory"):
            per_action, per_row = memory_per_action(base / "mem", LIVE)
            out.update(bytes_per_live_action=round(per_action),
                       table_bytes_per_row=round(per_row))
        if args.only in (None, "churn"):
            out.update(churn(base / "churn", args.churn, LIVE_CHURN),
                       churn_actions=args.churn)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps({
        **out,
        "cpus": os.cpu_count(),
        "goal_lifecycle_per_s": 150_000,
        "goal_abort_100k_ms": 100,
        "goal_bytes_per_live_action": 1024,
        "goal_rss_growth_pct": 10,
    }))


if __name__ == "__main__":
    main()
