"""Parallel bulk reload of fixed-size records: :func:`scan_parallel`.

The reload path of the engine: every record of one database (``actions``: one fixed-size
record per action, big-endian row keys) of every partition, copied into one numpy array in
partition-then-key order, using one process per core.

How: the parent counts each partition's records (one read transaction each) and so knows
where every partition's records go; it creates two shared files (``/dev/shm``) sized for all
values and all keys and maps them. It scans one share of the partitions itself and starts
``processes - 1`` workers (``storage/_scan_worker.py``, a fresh interpreter each, started with
``subprocess``) for the others. Each opens its partitions read-only, checks schema and layout,
and copies its records straight into the shared files at their offsets (a compiled loop over
the cursor's values, so Python touches each record once). The parent then wraps the
shared memory as numpy arrays without copying (``np.frombuffer``).

Why not ``multiprocessing`` with ``fork``: LMDB forbids using an environment handle in a
forked child, and py-lmdb refuses to reopen an environment the (forked) process already has
open, so a forked child of a process holding the store could not read it at all. ``spawn``
re-imports the parent's ``__main__`` (pytest, a benchmark, the engine's CLI) in every child.
A standalone worker script costs one interpreter start plus ``import lmdb`` (~40 ms).
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import lmdb
import msgpack

import cext
from storage import _scan_worker as worker
from storage._lmdb import LmdbStore, partition_dir
from storage._store import DBS, SCHEMA_VERSION, CorruptRecord, StoreError

if TYPE_CHECKING:
    import numpy as np

__all__ = ["FixedScan", "scan_parallel"]

#: Below this many records per process, extra processes cost more than they save.
MIN_RECORDS_PER_PROCESS = 50_000
#: About as many records as this process copies while a worker's interpreter starts.
WORKER_START_RECORDS = 60_000
_WORKER = str(Path(worker.__file__).resolve())


@dataclass
class FixedScan:
    """The result of :func:`scan_parallel`: ``n`` records in partition-then-key order.

    ``values``: ``(n,)`` array of ``dtype`` if one was given, else ``(n, record_size)``
    uint8. ``keys``: ``(n,)`` array of ``key_dtype`` (default ``>u8`` for 8-byte keys,
    ``>u4`` for 4, else ``V{key_size}``). ``partition``: ``(n,)`` uint16, the partition of
    each record. ``counts``: ``(partitions,)`` int64 records per partition. ``values`` and
    ``keys`` may be views of shared memory; they stay valid as long as they are referenced.
    """

    values: np.ndarray
    keys: np.ndarray | None
    partition: np.ndarray
    counts: np.ndarray

    def __len__(self) -> int:
        return len(self.values)


def _worker_env() -> dict:
    """The worker's environment: this one, with the directory holding ``cext`` first on its
    path (a script's own directory is all Python puts there)."""
    env = dict(os.environ)
    root = str(Path(cext.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _shared(size: int) -> tuple[str, mmap.mmap]:
    """A shared file of ``size`` bytes (``/dev/shm`` if possible) and a mapping of it."""
    d = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    fd, name = tempfile.mkstemp(prefix="leasehold-scan-", dir=d)
    try:
        os.ftruncate(fd, max(size, 1))
        mm = mmap.mmap(fd, max(size, 1))
    except BaseException:
        os.unlink(name)
        raise
    finally:
        os.close(fd)
    return name, mm


def _corrupt(err: dict) -> CorruptRecord:
    key = err.get("key")
    return CorruptRecord(err["partition"], err["db"],
                         bytes.fromhex(key) if key is not None else None, err["problem"])


def _shares(counts: list[int], processes: int) -> list[list[int]]:
    """Partitions split into ``processes`` shares (the first is this process's) of about
    equal time: record counts, a worker's counting :data:`WORKER_START_RECORDS` for its start
    (greedy, largest first); each share in partition order."""
    shares: list[list[int]] = [[] for _ in range(processes)]
    load = [0] + [WORKER_START_RECORDS] * (processes - 1)
    for p in sorted(range(len(counts)), key=lambda p: -counts[p]):
        if counts[p] == 0:
            continue
        i = load.index(min(load))
        shares[i].append(p)
        load[i] += counts[p]
    return [sorted(s) for s in shares if s]


class _Source:
    """Environment handles for the parent's own share: the store's, or opened read-only."""

    def __init__(self, source):
        self.owned: list = []
        if isinstance(source, LmdbStore):
            if not source.is_open:
                raise StoreError(f"store {source.path} is not open")
            self.path, self.partitions = source.path, source.partitions
            self.envs = source._envs
            self.handles = source._dbh
            return
        self.path = Path(source)
        try:
            env0 = worker.open_readonly(str(partition_dir(self.path, 0)), len(DBS))
        except lmdb.Error as e:
            if "already open" in str(e):
                raise StoreError(f"{self.path} is open as an LmdbStore in this process: pass "
                                 f"the store itself to scan_parallel") from None
            raise CorruptRecord(0, "meta", None,
                                f"cannot open the LMDB environment read-only: {e}") from None
        self.owned.append(env0)
        try:
            meta = env0.open_db(b"meta", create=False)
            with env0.begin(db=meta) as txn:
                raw = txn.get(b"layout")
            self.partitions = msgpack.unpackb(raw)["partitions"]
        except Exception as e:  # noqa: BLE001
            self.close()
            raise CorruptRecord(0, "meta", b"layout", f"unreadable layout ({e})") from None
        self.envs = [env0]
        self.handles = []
        try:
            for p in range(1, self.partitions):
                env = worker.open_readonly(str(partition_dir(self.path, p)), len(DBS))
                self.owned.append(env)
                self.envs.append(env)
        except lmdb.Error as e:
            self.close()
            raise CorruptRecord(len(self.envs), "meta", None,
                                f"cannot open the LMDB environment read-only: {e}") from None

    def handle(self, p: int, db: str):
        if self.handles:
            return self.handles[p][db], self.handles[p]["meta"]
        env = self.envs[p]
        try:
            return env.open_db(db.encode(), create=False), env.open_db(b"meta", create=False)
        except lmdb.Error as e:
            raise CorruptRecord(p, db, None, f"database missing: {e}") from None

    def close(self) -> None:
        for env in self.owned:
            env.close()
        self.owned = []


def scan_parallel(source: LmdbStore | str | os.PathLike, db: str, *, record_size: int,
                  key_size: int = 8, dtype=None, key_dtype=None, processes: int | None = None,
                  timeout_s: float | None = None, keys: bool = True) -> FixedScan:
    """Every record of ``db`` in every partition as numpy arrays, scanned in parallel.

    ``source`` is an open :class:`storage.LmdbStore` (the engine's reload: its handles are
    used for the parent's share) or a store directory (opened read-only, without claims; not
    a directory this process has open as a store). Every value must be ``record_size`` bytes
    and every key ``key_size`` bytes, else :class:`CorruptRecord` names the partition and key;
    schema and layout are checked as ``open`` checks them. ``processes`` (counting this one)
    defaults to the CPU count, or 1 when there are fewer than
    ``2 * MIN_RECORDS_PER_PROCESS`` records. Each partition is read in one snapshot; another
    process writing meanwhile makes the scan fail (``CorruptRecord``: changed during the
    scan) rather than return a mix. ``keys=False`` skips reading the keys (records that carry
    their own key: half the per-record work); ``FixedScan.keys`` is then None. Returns a
    :class:`FixedScan`.
    """
    import numpy as np

    if db not in DBS:
        raise ValueError(f"unknown database {db!r} (known: {', '.join(DBS)})")
    if record_size < 1 or key_size < 1:
        raise ValueError("record_size and key_size must be >= 1")
    if dtype is not None and np.dtype(dtype).itemsize != record_size:
        raise ValueError(f"dtype itemsize {np.dtype(dtype).itemsize} != record_size "
                         f"{record_size}")
    if key_dtype is None:
        key_dtype = {8: ">u8", 4: ">u4"}.get(key_size, f"V{key_size}")
    if np.dtype(key_dtype).itemsize != key_size:
        raise ValueError(f"key_dtype itemsize {np.dtype(key_dtype).itemsize} != key_size "
                         f"{key_size}")
    src = _Source(source)
    try:
        P = src.partitions
        counts = []
        for p in range(P):
            dbh, meta = src.handle(p, db)
            with src.envs[p].begin() as txn:
                if not src.handles:
                    try:
                        worker.check_meta(txn, meta, p, SCHEMA_VERSION,
                                          {"partitions": P, "partition": p})
                    except worker.ScanProblem as e:
                        raise _corrupt(e.as_json()) from None
                counts.append(txn.stat(dbh)["entries"])
        total = sum(counts)
        offsets = [0] * P
        for p in range(1, P):
            offsets[p] = offsets[p - 1] + counts[p - 1]
        if processes is None:
            processes = os.cpu_count() or 1
            if total < 2 * MIN_RECORDS_PER_PROCESS:
                processes = 1
        shares = _shares(counts, max(1, int(processes)))
        vname = kname = None
        if len(shares) <= 1:
            vbuf = np.empty(total * record_size, np.uint8)
            kbuf = np.empty(total * key_size, np.uint8) if keys else None
            vout = memoryview(vbuf)
            kout = memoryview(kbuf) if keys else None
            children = []
        else:
            vname, vbuf = _shared(total * record_size)
            kname, kbuf = _shared(total * key_size) if keys else (None, None)
            vout, kout = vbuf, kbuf
            children = []
            for share in shares[1:]:
                job = {"db": db, "record_size": record_size, "key_size": key_size,
                       "vfile": vname, "kfile": kname, "vsize": len(vbuf),
                       "ksize": len(kbuf) if keys else 0,
                       "schema": SCHEMA_VERSION, "npartitions": P, "max_dbs": len(DBS),
                       "partitions": [[p, str(partition_dir(src.path, p)), counts[p],
                                       offsets[p]] for p in share]}
                children.append(subprocess.Popen(
                    [sys.executable, _WORKER, json.dumps(job)], env=_worker_env(),
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        try:
            for p in shares[0] if shares else ():
                dbh, _meta = src.handle(p, db)
                try:
                    worker.scan_fixed(src.envs[p], dbh, p, db, counts[p], record_size,
                                      key_size, vout, kout, offsets[p])
                except worker.ScanProblem as e:
                    raise _corrupt(e.as_json()) from None
            for child in children:
                out, err = child.communicate(timeout=timeout_s)
                try:
                    reply = json.loads(out.decode().strip().splitlines()[-1])
                except (ValueError, IndexError):
                    reply = None
                if child.returncode != 0 or reply is None:
                    raise StoreError(f"scan worker failed (exit {child.returncode}): "
                                     f"{err.decode(errors='replace')[-2000:]}")
                if "error" in reply:
                    raise _corrupt(reply["error"])
        finally:
            for child in children:
                if child.poll() is None:
                    child.kill()
                    child.wait()
            for name in (vname, kname):
                if name is not None:
                    os.unlink(name)
        values = np.frombuffer(vbuf, np.uint8, count=total * record_size)
        values = (values.view(dtype) if dtype is not None
                  else values.reshape(total, record_size))
        key_arr = (np.frombuffer(kbuf, np.uint8, count=total * key_size).view(key_dtype)
                   if keys else None)
        partition = np.repeat(np.arange(P, dtype=np.uint16), counts)
        return FixedScan(values, key_arr, partition, np.asarray(counts, dtype=np.int64))
    finally:
        src.close()
