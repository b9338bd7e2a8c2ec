"""Commit of fixed-size records: triples vs one ``storage.Records`` block. Prints ONE JSON object.

    .venv/bin/python bench/store_commit.py [--records 1000] [--size 180] [--repeats 36]
                                           [--partitions 16] [--dir DIR]

Each figure is the median wall time of ``store.commit(batch)`` (the batch built before the
clock starts, the cyclic GC off while it runs) over ``--repeats`` commits, the variants
interleaved commit by commit (in every order in turn) so that drift on a shared machine hits
them alike, on the real ``LmdbStore`` in a temporary directory (``--dir``, default the system
temp dir, removed afterwards). ``--records`` records of ``--size`` bytes (random bytes),
8-byte big-endian row keys, ascending:

* ``tuples_ms``, ``block_ms``: ``sync=True``, one partition (commit, then ``env.sync``), new
  keys past the last one (as rows appended by ``enqueue``): ``("actions", key, value)``
  triples (value a memoryview slice of one buffer, as the engine's ``_encode`` makes them)
  vs one ``Records`` block over the same two buffers.
* ``block_append_ms``: the block with the store's optional use of ``MDB_APPEND`` switched on
  (``storage._lmdb._APPEND = True``; off by default): what appending would save.
* ``tuples_overwrite_ms``, ``block_overwrite_ms``: the same keys again (every record
  overwrites one in place, no append possible).
* ``tuples_16p_ms``, ``block_16p_ms``: the records spread over ``--partitions`` partitions
  (row % partitions; per partition one block, or its triples): a group of several
  partitions, made atomic by the redo record of the others that the largest one carries.
* ``block_skewed_ms``: the block in partition 0 and one record in partition 1 (a turn of a
  large run that also touches another tenant's action): partition 0 carries the one record,
  so this costs about a single partition's commit plus partition 1's (compare ``block_ms``).
* ``*_nosync_ms``: the same single-partition commits with ``sync=False``: the CPU part alone.
* ``build_tuples_ms``, ``build_block_ms``: building the batch from the two buffers (the
  engine's per-row loop of today vs one ``Records(...)``), not included above.
"""

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from itertools import permutations
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import lmdb  # noqa: E402
import numpy as np  # noqa: E402

import storage._lmdb as lmdb_store  # noqa: E402
from storage import LmdbStore, Records  # noqa: E402

T0 = time.time_ns()


def triples(rows, buf, size, db="actions"):
    """The engine's per-row loop (``engine/_engine.py`` ``_encode``)."""
    keys = rows.astype(">u8").tobytes()
    view = memoryview(buf)
    return [(db, keys[8 * i:8 * i + 8], view[i * size:(i + 1) * size]) for i in range(rows.size)]


def spread(rows, buf, size, P, as_block):
    """The records over ``P`` partitions (row % P), each partition's rows contiguous and in
    order: one block per partition, or its triples."""
    part = rows % P
    order = np.argsort(part, kind="stable")
    sbuf = np.frombuffer(buf, np.uint8).reshape(rows.size, size)[order].tobytes()
    srows = rows[order]
    cuts = np.searchsorted(part[order], np.arange(P + 1))
    batch = {}
    for p in range(P):
        lo, hi = int(cuts[p]), int(cuts[p + 1])
        chunk = memoryview(sbuf)[lo * size:hi * size]
        batch[p] = ([Records("actions", srows[lo:hi].astype(">u8"), chunk, 8, size)]
                    if as_block else triples(srows[lo:hi], chunk, size))
    return batch


def ms_of(fn, *args):
    """Wall time of ``fn(*args)`` in ms, with the cyclic GC off (as ``timeit`` does: a
    collection triggered by the garbage of the previous variant must not land in this one)."""
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter_ns()
        fn(*args)
        return (time.perf_counter_ns() - t0) / 1e6
    finally:
        gc.enable()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=1000)
    ap.add_argument("--size", type=int, default=180)
    ap.add_argument("--repeats", type=int, default=36)
    ap.add_argument("--partitions", type=int, default=16)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    n, size, P = args.records, args.size, args.partitions
    rng = np.random.default_rng(9)
    buf = rng.integers(0, 256, n * size, dtype=np.uint8).tobytes()
    base = Path(tempfile.mkdtemp(prefix="store_commit-", dir=args.dir))
    times: dict[str, list[float]] = {}

    def add(name, ms):
        times.setdefault(name, []).append(ms)

    try:
        stores = {sync: LmdbStore(base / f"sync-{sync}", partitions=P, sync=sync)
                  for sync in (True, False)}
        for s in stores.values():
            s.open("bench", T0)
        next_row = {True: 0, False: 0}
        orders = list(permutations(["tuples", "block", "block_append"]))
        for rep in range(args.repeats):
            for sync, s in stores.items():
                tag = "" if sync else "_nosync"
                # new keys past the last one: triples, block, block with MDB_APPEND, in every
                # order in turn (a commit's cost depends on the one before it)
                for variant in orders[rep % len(orders)]:
                    rows = np.arange(next_row[sync], next_row[sync] + n, dtype=np.int64)
                    next_row[sync] += n
                    if variant == "tuples":
                        batch = {0: triples(rows, buf, size)}
                    else:
                        batch = {0: [Records("actions", rows.astype(">u8"), buf, 8, size)]}
                    lmdb_store._APPEND = variant == "block_append"
                    try:
                        add(variant + tag, ms_of(s.commit, batch))
                    finally:
                        lmdb_store._APPEND = False
                if not sync:
                    continue
                # the first n rows again: overwrites in place
                rows = np.arange(n, dtype=np.int64)
                add("tuples_overwrite", ms_of(s.commit, {0: triples(rows, buf, size)}))
                add("block_overwrite", ms_of(s.commit, {0: [
                    Records("actions", rows.astype(">u8"), buf, 8, size)]}))
                # spread over the partitions (one carries the rest), new keys for each variant
                for variant in ("tuples_16p", "block_16p"):
                    rows = np.arange(next_row[sync], next_row[sync] + n, dtype=np.int64)
                    next_row[sync] += n
                    add(variant, ms_of(s.commit, spread(rows, buf, size, P,
                                                        variant == "block_16p")))
                rows = np.arange(next_row[sync], next_row[sync] + n, dtype=np.int64)
                next_row[sync] += n
                add("block_skewed", ms_of(s.commit, {
                    0: [Records("actions", rows.astype(">u8"), buf, 8, size)],
                    1: [("actions", rows[:1].astype(">u8").tobytes(), buf[:size])]}))
            rows = np.arange(n, dtype=np.int64)
            add("build_tuples", ms_of(triples, rows, buf, size))
            add("build_block", ms_of(lambda r: Records("actions", r.astype(">u8"), buf, 8, size),
                                     rows))
        for s in stores.values():
            s.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)

    names = ["tuples", "block", "block_append", "tuples_overwrite", "block_overwrite",
             "tuples_16p", "block_16p", "block_skewed", "tuples_nosync", "block_nosync",
             "block_append_nosync", "build_tuples", "build_block"]
    out = {f"{name}_ms": round(statistics.median(times[name]), 4) for name in names}
    out.update({
        "records": n, "record_size": size, "repeats": args.repeats, "partitions": P,
        "python": platform.python_version(), "numpy": np.__version__,
        "lmdb": lmdb.__version__, "cpu_count": os.cpu_count(),
    })
    print(json.dumps(out))


if __name__ == "__main__":
    main()
