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
* ``rss_growth_pct``: process RSS growth over ``CHURN`` (5,000,000) actions through the life
  cycle with about ``LIVE_CHURN`` (10,000) live at any time, measured from a steady state;
  memory should be bounded by live work, not by history. The churn's store keeps outcomes
  for ``CHURN_RETENTION`` (1 s) of its clock, which advances ``CHURN_BATCH_S`` (10 ms) a
  batch, so about 100,000 outcomes are retained at any time and ``schedule()``'s sweep
  deletes the expired ones, as a shard does. Each action has a deadline of an hour
  (``CHURN_TIMEOUTS``): a timer that outlives it, as most actions' do, and must not pile
  up. The steady state: a warm-up runs until the store's LMDB data files (16 partitions;
  LMDB extends a file when it first writes a page past its end, and reuses freed pages)
  grew less than ``WARM_TOL`` (0.5%)
  over the last ``WARM_WINDOW`` x ``WARM_STEP`` (500,000) actions (``churn_warm_actions``
  is where; ``churn_steady`` false if ``WARM_MAX`` came first), then ``CHURN`` more actions
  are measured (``churn_actions_in_all`` in all). Before that point RSS counts the filling of
  bounded things: the files (about 41,000 pages at 200,000 actions, 51,000 at 700,000, then
  flat) and the pages of LMDB's map the process touches for the first time. RSS is split
  into ``anon_growth_pct`` (anonymous memory, /proc/self/smaps_rollup) and
  ``file_rss_growth_pct`` (RSS less anonymous: mostly the map's page cache), and the
  Python heap and numpy buffers (tracemalloc) give ``heap_growth_pct``. The engine's cache
  of compiled specs (``_TEMPLATES_KEPT`` = 4,096, engine/_admission.py) takes one entry per
  batch here (each batch is a new run with a new spec content) and empties when full, so the
  heap is a saw-tooth of period 4,096 batches: ``heap_growth_pct`` depends on where in it
  the two points fall (``specs_warm`` / ``specs_end``: entries at each point).
  ``rss_growth_second_half_pct`` / ``anon_growth_second_half_pct``: from the measured
  window's half-way point to its end. ``rss_growth_from_200k_pct``,
  ``anon_growth_from_200k_pct``, ``heap_growth_from_200k_pct``: the definition used until
  2026-12-03, from 200,000 actions (a full retention's outcomes stored) to ``CHURN`` in all,
  which includes the filling above. ``rss_*``, ``anon_*``, ``file_*``, ``heap_*``,
  ``store_*`` (data files' bytes), ``specs_*`` at ``200k``, ``warm``, ``half``, ``end``:
  the raw samples; ``churn_store_files_mb``: the files' size every ``WARM_STEP`` of warm-up.
  ``churn_retained_end`` and ``churn_runs_end``: retained outcomes and runs in memory at
  the end. ``churn_per_s``: the measured window's rate (under tracemalloc: slower).

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

from engine import (  # noqa: E402
    ActionSpec,
    Engine,
    ManualClock,
    Phase,
    Timeouts,
    is_content_key,
    parse_config,
)

BATCH = 1000
N = 100_000
LIVE = 100_000
CHURN = 5_000_000
LIVE_CHURN = 10_000
# The churn's store keeps outcomes for CHURN_RETENTION seconds of its clock, which advances
# CHURN_BATCH_S a batch: about 100 batches (100,000 outcomes) retained at any time.
CHURN_RETENTION = 1.0
CHURN_BATCH_S = 0.01
# Each churned action has a deadline (a timer each, due long after the action ended).
CHURN_TIMEOUTS = Timeouts(deadline=3600)
# The churn measures from a steady state: the store's data files (LMDB extends a file the
# first time a page past its end is written; freed pages are reused) grew less than WARM_TOL
# over the last WARM_WINDOW checks, one every WARM_STEP actions; at most WARM_MAX actions.
WARM_STEP = 250_000
WARM_WINDOW = 2
WARM_TOL = 0.005
WARM_MAX = 5_000_000


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


def template(run, task="work", timeouts=None):
    return ActionSpec(id=f"tenant{run % 64}/p/d/run{run}/map", task=task,
                      resources={"cpu": "250m", "memory": "512Mi"},
                      timeouts=timeouts or Timeouts())


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
    table = view.table_bytes("actions")
    rows = view.arrays.a_state.shape[0]
    eng.close()
    del base
    return (full - empty + table) / n, table / rows


def _memory():
    """``(rss, anon, file)`` bytes of this process: RSS, its anonymous part and its
    file-backed part (/proc/self/smaps_rollup: Rss and Anonymous; file = the rest, mostly
    pages of LMDB's memory map the process has touched)."""
    kb = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Rss", "Anonymous"):
                kb[key] = int(rest.split()[0]) * 1024
    return kb["Rss"], kb["Anonymous"], kb["Rss"] - kb["Anonymous"]


def _store_bytes(path):
    """Bytes of the store's LMDB data files (its 16 partitions): LMDB
    extends a file as it first writes a page past its end, so this is how many pages the
    store has ever used at once (freed pages are reused)."""
    return sum(f.stat().st_size for f in Path(path).rglob("data.mdb"))


def _pct(end, start):
    return round((end - start) / start * 100, 2)


def churn(path, total, live):
    tracemalloc.start()
    clock = ManualClock(time.time_ns())
    eng = Engine(parse_config(config(path, capacity=1 << 14, retention=CHURN_RETENTION)),
                 clock=clock)
    eng.register_worker("w", "east", live)
    names = [f"i{k}" for k in range(BATCH)]

    def sample():
        gc.collect()
        rss, anon, file = _memory()
        return {"rss": rss, "anon": anon, "file": file,
                "heap": tracemalloc.get_traced_memory()[0],
                "store": _store_bytes(path),
                # the engine's bounded cache of compiled specs (engine/_admission.py): read
                # only to say how full it is, as it is most of the heap's growth
                "specs": eng.inspect().compiled_specs, "done": done}

    # The old warm point: the store holds a full retention's outcomes (and at least 10x live).
    early = max(live * 10, 2 * round(CHURN_RETENTION / CHURN_BATCH_S) * BATCH)
    s_early = s_old_end = s_warm = s_half = None
    stores = []                 # the store's file size every WARM_STEP actions of warm-up
    done = b = 0
    check = WARM_STEP
    end = None                  # set once warm: the warm point + total
    t_warm = time.perf_counter()
    while end is None or done < end:
        eng.enqueue_fanout(template(b, timeouts=CHURN_TIMEOUTS), names)
        b += 1
        with eng.turn():
            eng.schedule()
            batch = eng.drain_columns()
        eng.report_many(batch.tokens, Phase.SUCCEEDED)
        done += len(batch)
        clock.advance(CHURN_BATCH_S)
        if s_early is None and done >= early:
            s_early = sample()
        if s_old_end is None and done >= total:
            s_old_end = sample()
        if end is None and done >= check:
            check += WARM_STEP
            stores.append(_store_bytes(path))
            # Steady once the store's files grew less than WARM_TOL over the last
            # WARM_WINDOW steps (or WARM_MAX passed: then churn_steady is false).
            if (len(stores) > WARM_WINDOW
                    and stores[-1] <= stores[-1 - WARM_WINDOW] * (1 + WARM_TOL)
                    or done >= WARM_MAX):
                s_warm = sample()
                end = done + total
                t_warm = time.perf_counter()
        if end is not None and s_half is None and done >= s_warm["done"] + total // 2:
            s_half = sample()
    elapsed = time.perf_counter() - t_warm
    s_end = sample()
    tracemalloc.stop()
    rows = eng.inspect().arrays.a_state.shape[0]
    retained = sum(1 for _p, key, _v in eng.store.scan("retained") if not is_content_key(key))
    runs = len(eng.inspect().runs())
    eng.close()
    w, h, e, o, z = s_warm, s_half, s_end, s_early, s_old_end
    return {
        # From the steady state (the store's files stopped growing) over `total` actions.
        "rss_growth_pct": _pct(e["rss"], w["rss"]),
        "anon_growth_pct": _pct(e["anon"], w["anon"]),
        "file_rss_growth_pct": _pct(e["file"], w["file"]),
        "heap_growth_pct": _pct(e["heap"], w["heap"]),
        "rss_growth_second_half_pct": _pct(e["rss"], h["rss"]),
        "anon_growth_second_half_pct": _pct(e["anon"], h["anon"]),
        "churn_warm_actions": w["done"], "churn_steady": w["done"] < WARM_MAX,
        "churn_actions_in_all": done,
        # The definition before 2026-12-03 (late): from `early` (200,000) to `total`
        # actions in all, the store's files and the spec cache still filling.
        **{f"{k}_growth_from_200k_pct": (_pct(z[k], o[k]) if o and z and z["done"] > o["done"]
                                                     else None)
           for k in ("rss", "anon", "heap")},
        "churn_retained_end": retained,
        "churn_runs_end": runs,
        "churn_table_rows": rows,
        "churn_store_files_mb": [round(s / 2**20, 1) for s in stores],
        **{f"{k}_{at}": s[k] for at, s in (("200k", o), ("warm", w), ("half", h),
                                            ("end", e))
           for k in ("rss", "anon", "file", "heap", "store", "specs") if s},
        "churn_retention_s": CHURN_RETENTION, "churn_clock_per_batch_s": CHURN_BATCH_S,
        # The measured actions through the whole life cycle including reclaiming every row
        # (traced: slower).
        "churn_per_s": round(total / elapsed)}


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
