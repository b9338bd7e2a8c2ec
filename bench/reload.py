"""Durable-state benchmark: prints ONE JSON object.

* ``enqueue_durable_per_s``: sustained durable enqueues through ``Engine.enqueue_fanout`` over
  the default LmdbStore (sync on): fan-out batches of ``BATCH`` actions of one task, one group
  commit each, acknowledged after the commit. Measured while building the store below.
* ``enqueue_distinct_per_s``: the same through ``Engine.enqueue_many`` with ``BATCH``
  distinct specs per batch (64 tenants, so each group commit spans all 16 partitions, one
  carrying the others' redo record).
* ``reload_1m_s``: a store holding ``N`` (1,000,000) actions, every one holding a delivered
  lease (placed by the real tick, handed out by ``drain_dispatch``), across 16 partitions
  (tenants spread by hash). Timed from just before starting a fresh interpreter to the line it
  prints once ``Engine(config)`` returned (ready to tick): interpreter start, imports, claims,
  parallel scan, rebuild. Median of 3 (each listed).
* ``first_watch_ms``: a run's first watch on that reloaded table (``Engine.live_states`` of
  one run of ``BATCH`` live actions among the million, what a shard reads when a run is
  first watched): median of 9 runs in each reloaded process, then of the three.
* ``sync_commit_ms``: one small durable transition's commit (``LmdbStore.commit`` of one
  action's records, the engine's store): median of 200. ``enqueue_one_ms``: the whole
  ``Engine.enqueue`` of one action (compile, encode, commit), median of 200.

Usage: ``python bench/reload.py [--n N] [--dir DIR] [--keep]`` (``--keep`` reuses a store
built by an earlier run in DIR).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine import ActionSpec, Engine, ManualClock, parse_config  # noqa: E402
from engine._records import action_dtype  # noqa: E402

BATCH = 1000
TENANTS = [f"tenant{i}" for i in range(64)]


def config(path):
    return {
        "resources": ["cpu", "memory", "gpu:H100"],
        # No capacity table: unknown = unlimited, so every action gets a lease.
        "clusters": {"east": {}, "west": {}},
        "queues": {"batch": {"scheduling": "GREEDY_CAPACITY", "depth": 2_000_000}},
        "engine": {"default_queue": "batch", "initial_capacity": 1 << 20,
                   "max_candidates": 1 << 16, "dispatch_capacity": 1 << 17},
        "storage": {"path": str(path), "partitions": 16, "shard": "bench",
                    "map_size": "2Gi", "max_map_size": "64Gi"},
    }


def build(path, n):
    """The store to reload: ``n`` actions in fan-out batches of ``BATCH`` (one task and
    tenant per batch, tenants spread over the partitions), timed as
    ``enqueue_durable_per_s``, then every one placed and handed out."""
    eng = Engine(parse_config(config(path)), clock=ManualClock(time.time_ns()))
    eng.register_worker("w-east", "east", 1 << 30)
    eng.register_worker("w-west", "west", 1 << 30)
    enq_s = 0.0
    for b, start in enumerate(range(0, n, BATCH)):
        template = ActionSpec(id=f"{run_key(b)}/map",
                              task=f"task{b % 50}",
                              resources={"cpu": 1 + b % 4, "memory": "2Gi"})
        names = [f"a{i}" for i in range(start, min(n, start + BATCH))]
        t = time.perf_counter()
        eng.enqueue_fanout(template, names)
        enq_s += time.perf_counter() - t
    leases = 0
    while leases < n:
        out = eng.tick()
        if not out:
            break
        leases += len(out)
    eng.close()
    return n / enq_s, leases


CHILD = r"""
import sys, time
sys.path.insert(0, {root!r})
from engine import Engine, ManualClock, parse_config
eng = Engine(parse_config({cfg!r}), clock=ManualClock(time.time_ns()))
view = eng.inspect()
print("READY", view.action_rows, int((view.arrays.q_adm - view.arrays.q_rel).sum()), flush=True)
# A run's first watch reads its live actions (Engine.live_states): timed on the reloaded
# table, one run of BATCH actions at a time.
took = []
for run in {runs!r}:
    t = time.perf_counter()
    ids = eng.live_states(run)[0]
    took.append(time.perf_counter() - t)
    assert len(ids) > 0, run
print("WATCH", sorted(took)[len(took) // 2] * 1e3, flush=True)
eng.close()
"""


def run_key(b):
    """The run key of batch ``b`` of :func:`build`."""
    return f"{TENANTS[b % len(TENANTS)]}/p/d/run{b}"


def reload_once(path, n):
    batches = -(-n // BATCH)
    runs = [run_key(b) for b in range(0, batches, max(1, batches // 9))][:9]
    code = CHILD.format(root=str(ROOT), cfg=config(path), runs=runs)
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    ready = time.perf_counter() - t
    watch = proc.stdout.readline()
    err = proc.communicate(timeout=300)[1]
    if not line.startswith("READY") or not watch.startswith("WATCH"):
        raise SystemExit(f"reload failed: {err[-3000:]}")
    _, rows, in_flight = line.split()
    return ready, int(rows), int(in_flight), float(watch.split()[1])


def distinct_rate(path, batches=20):
    """``enqueue_distinct_per_s``: ``enqueue_many`` of ``BATCH`` distinct specs per batch
    (tenants, runs, tasks and resources vary), one synced group commit each."""
    shutil.rmtree(path, ignore_errors=True)
    eng = Engine(parse_config(config(path)), clock=ManualClock(time.time_ns()))
    try:
        spent = 0.0
        for b in range(batches):
            specs = [ActionSpec(id=f"{TENANTS[i % len(TENANTS)]}/p/d/d{b}r{i % 7}/a{i}",
                                task=f"task{i % 50}",
                                resources={"cpu": 1 + i % 4, "memory": f"{1 + i % 3}Gi"})
                     for i in range(BATCH)]
            t = time.perf_counter()
            eng.enqueue_many(specs)
            spent += time.perf_counter() - t
        return batches * BATCH / spent
    finally:
        eng.close()
        shutil.rmtree(path, ignore_errors=True)


def commit_latency(path):
    # A store of its own: the measured writes must not change the reloaded one. The raw
    # commits below write scratch records, so it is thrown away afterwards.
    shutil.rmtree(path, ignore_errors=True)
    eng = Engine(parse_config(config(path)), clock=ManualClock(time.time_ns()))
    try:
        store = eng.store
        rec = b"\0" * action_dtype(len(eng.resources.names)).itemsize
        commits, enqueues = [], []
        for i in range(200):
            t = time.perf_counter()
            store.commit({i % 16: [("actions", (10**9 + i).to_bytes(8, "big"), rec)]})
            commits.append(time.perf_counter() - t)
        for i in range(200):
            spec = ActionSpec(id=f"tenant{i % 64}/p/d/lat/a{i}", task="t",
                              resources={"cpu": 1})
            t = time.perf_counter()
            eng.enqueue(spec)
            enqueues.append(time.perf_counter() - t)
        return statistics.median(commits) * 1e3, statistics.median(enqueues) * 1e3
    finally:
        eng.close()
        shutil.rmtree(path, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="leasehold-reload-"))
    path = base / "store"
    rate = None
    leases = None
    if not (args.keep and path.exists()):
        shutil.rmtree(path, ignore_errors=True)
        rate, leases = build(path, args.n)
    runs = [reload_once(path, args.n) for _ in range(3)]
    sync_ms, enqueue_ms = commit_latency(base / "latency")
    distinct = distinct_rate(base / "distinct")
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    out = {
        "reload_1m_s": round(statistics.median(r[0] for r in runs), 4),
        "reload_runs_s": [round(r[0], 4) for r in runs],
        "actions": runs[0][1],
        # A run's first watch on the reloaded table (Engine.live_states of one run of BATCH
        # actions, median of 9 runs, then of the three reloads).
        "first_watch_ms": round(statistics.median(r[3] for r in runs), 4),
        "leases_in_flight": runs[0][2],
        "enqueue_durable_per_s": round(rate) if rate else None,
        "enqueue_distinct_per_s": round(distinct),
        "sync_commit_ms": round(sync_ms, 4),
        "enqueue_one_ms": round(enqueue_ms, 4),
        "store_bytes": size,
        "partitions": 16,
        "leases_built": leases,
        "cpus": os.cpu_count(),
        "goal_reload_1m_s": 1.0,
        "goal_enqueue_durable_per_s": 200000,
    }
    print(json.dumps(out))
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
