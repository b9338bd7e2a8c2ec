"""Raw storage benchmark (no engine): prints ONE JSON object on stdout.

    .venv/bin/python bench/reload_raw.py [--records 1000000] [--partitions 16] [--dir DIR]

What it measures, each the median of ``--repeats`` (3) runs, on ``LmdbStore(sync=True)``:

* ``write_1m_group_commit_s``: writing ``--records`` 128-byte records (a numpy structured
  dtype; key = big-endian row number; partition = row % partitions) into a fresh store as
  ``store.commit`` calls of ``--group`` (10,000) records each. Every group spans all
  partitions, so it is the multi-partition path: one write transaction per partition, the
  largest (here the first of equal ones) carrying the redo record of the others; its
  commit and sync, then the other partition commits (data synced). The
  batches are built before the clock starts; only the commits are timed.
* ``scan_1m_single_s``: ``scan_parallel(store, "actions", record_size=128, dtype=RECORD,
  processes=1)``: one process, cursor scan of every partition straight into one numpy
  structured array.
* ``scan_1m_parallel_s``: the same with one process per core (``processes=None``: this
  process plus ``cpu_count - 1`` worker interpreters writing into shared memory), including
  the workers' start-up.
* ``sync_commit_ms``: median wall time of ``store.commit`` of one 64-byte record in one
  partition (the single-partition path: commit, then ``env.sync(True)``), over 3 x 100 commits.
  ``sync_commit_16p_ms``: the same with one record in each of the 16 partitions (one carries
  the others' redo record).

Scans run with a warm page cache (the data was just written). Both scans are checked against
the written records. Data goes to a temporary directory under ``--dir`` (default: the system
temp dir), removed afterwards.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import lmdb  # noqa: E402
import numpy as np  # noqa: E402

from storage import LmdbStore, scan_parallel  # noqa: E402

RECORD = np.dtype([
    ("row", "<u8"), ("generation", "<u8"), ("lease_end", "<i8"), ("state", "u1"),
    ("phase", "u1"), ("queue", "<u2"), ("cluster", "<u2"), ("pad0", "V2"),
    ("demand", "<f8", (8,)), ("pad", "V32"),
])
assert RECORD.itemsize == 128


def records(n):
    rec = np.zeros(n, RECORD)
    rec["row"] = np.arange(n)
    rec["generation"] = np.arange(n) % 7
    rec["lease_end"] = -1
    rec["state"] = np.arange(n) % 5
    rec["demand"] = np.arange(n, dtype=np.float64)[:, None] * np.arange(1, 9)
    return rec


def batches(rec, partitions, group):
    raw = rec.tobytes()
    size = RECORD.itemsize
    out = []
    for start in range(0, len(rec), group):
        batch = {p: [] for p in range(partitions)}
        for row in range(start, min(start + group, len(rec))):
            batch[row % partitions].append(
                ("actions", row.to_bytes(8, "big"), raw[row * size:(row + 1) * size]))
        out.append(batch)
    return out


def write_once(base, groups, partitions):
    path = Path(tempfile.mkdtemp(prefix="reload-raw-", dir=base))
    store = LmdbStore(path, partitions=partitions, map_size=1 << 30)
    store.open("bench", time.time_ns())
    t0 = time.perf_counter()
    for batch in groups:
        store.commit(batch)
    elapsed = time.perf_counter() - t0
    return path, store, elapsed


def check(scan, rec, partitions):
    n = len(rec)
    assert len(scan) == n, (len(scan), n)
    order = np.lexsort((np.arange(n), np.arange(n) % partitions))
    assert np.array_equal(scan.keys, order.astype(np.uint64))
    assert scan.values.tobytes() == rec[order].tobytes()
    assert np.array_equal(scan.partition, (order % partitions).astype(np.uint16))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--partitions", type=int, default=16)
    ap.add_argument("--group", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()

    rec = records(args.records)
    groups = batches(rec, args.partitions, args.group)
    base = tempfile.mkdtemp(prefix="leasehold-bench-", dir=args.dir)
    try:
        writes = []
        store = None
        for _ in range(args.repeats):
            if store is not None:
                store.close()
                shutil.rmtree(store.path)
            path, store, elapsed = write_once(base, groups, args.partitions)
            writes.append(elapsed)
        store.close()
        store = LmdbStore(path, partitions=args.partitions, map_size=1 << 30)
        store.open("bench", time.time_ns())

        single, parallel = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            scan = scan_parallel(store, "actions", record_size=128, dtype=RECORD, processes=1)
            single.append(time.perf_counter() - t0)
            check(scan, rec, args.partitions)
            del scan
            t0 = time.perf_counter()
            scan = scan_parallel(store, "actions", record_size=128, dtype=RECORD)
            parallel.append(time.perf_counter() - t0)
            check(scan, rec, args.partitions)
            del scan

        one, multi = [], []
        small = b"s" * 64
        for i in range(300):
            key = (args.records + i).to_bytes(8, "big")
            t0 = time.perf_counter_ns()
            store.commit({i % args.partitions: [("finalize", key, small)]})
            one.append(time.perf_counter_ns() - t0)
            t0 = time.perf_counter_ns()
            store.commit({p: [("finalize", key, small)] for p in range(args.partitions)})
            multi.append(time.perf_counter_ns() - t0)
        store.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)

    out = {
        "scan_1m_single_s": round(statistics.median(single), 4),
        "scan_1m_parallel_s": round(statistics.median(parallel), 4),
        "write_1m_group_commit_s": round(statistics.median(writes), 4),
        "sync_commit_ms": round(statistics.median(one) / 1e6, 4),
        "sync_commit_16p_ms": round(statistics.median(multi) / 1e6, 4),
        "runs": {"scan_single_s": [round(x, 4) for x in single],
                 "scan_parallel_s": [round(x, 4) for x in parallel],
                 "write_s": [round(x, 4) for x in writes]},
        "records": args.records, "record_size": RECORD.itemsize,
        "partitions": args.partitions, "group": args.group,
        "parallel_processes": min(os.cpu_count() or 1, args.partitions),
        "python": platform.python_version(), "numpy": np.__version__,
        "lmdb": lmdb.__version__, "cpu_count": os.cpu_count(),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
