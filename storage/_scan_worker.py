"""The worker half of :func:`storage.scan_parallel`.

Deliberately small: it imports only the standard library, ``lmdb``, ``msgpack`` and the
compiled record copy (no numpy, nothing else of this package), because
:func:`storage.scan_parallel` runs it as a script in a fresh interpreter
(``python _scan_worker.py JOB``), where every import is start-up time.
The in-process path (``processes=1``) imports it and calls :func:`scan_fixed` directly.

A job scans the fixed-size records of one database in some partitions and copies them into
two shared files (mapped by the parent): values at ``offset * record_size`` of the value
file, keys at ``offset * key_size`` of the key file, in key order. It prints one JSON line:
``{"ok": true}`` or ``{"error": {"partition", "db", "key" (hex or null), "problem"}}``.
"""

import json
import mmap
import os
import sys

import lmdb
import msgpack

from cext._records import copy_fixed


class ScanProblem(Exception):
    """A record that cannot be copied: reported as ``CorruptRecord`` by the parent."""

    def __init__(self, partition, db, key, problem):
        super().__init__(problem)
        self.partition, self.db, self.key, self.problem = partition, db, key, problem

    def as_json(self):
        return {"partition": self.partition, "db": self.db,
                "key": None if self.key is None else self.key.hex(), "problem": self.problem}


def check_meta(txn, meta, partition, expected_schema, expected_layout):
    """Schema and layout of a partition, as ``LmdbStore.open`` checks them."""
    raw = txn.get(b"schema", db=meta)
    if raw is None:
        raise ScanProblem(partition, "meta", b"schema", "missing schema record")
    try:
        schema = msgpack.unpackb(raw)
    except Exception as e:  # noqa: BLE001
        raise ScanProblem(partition, "meta", b"schema", f"undecodable schema ({e})") from None
    if schema != expected_schema:
        raise ScanProblem(partition, "meta", b"schema",
                          f"schema {schema!r}, this code reads schema {expected_schema}")
    raw = txn.get(b"layout", db=meta)
    try:
        layout = msgpack.unpackb(raw) if raw is not None else None
    except Exception:  # noqa: BLE001
        layout = raw
    if layout != expected_layout:
        raise ScanProblem(partition, "meta", b"layout",
                          f"layout {layout!r}, expected {expected_layout!r}")


def _copy(cur, want_keys, size, count, out, base, partition, db, txn, dbh):
    """Copy ``count`` fixed-size keys or values from ``cur`` into ``out[base:]``."""
    cur.first()
    n, bad = copy_fixed(cur.iternext(keys=want_keys, values=not want_keys), size, count,
                        out, base)
    if bad >= 0:
        what = "key" if want_keys else "value"
        for key, value in txn.cursor(db=dbh):
            item = key if want_keys else value
            if len(item) != size:
                raise ScanProblem(partition, db, key,
                                  f"{what} of {len(item)} bytes, expected {size}")
    if n > count:
        raise ScanProblem(partition, db, None,
                          f"more than the {count} records counted: the partition changed "
                          f"during the scan (is another process writing?)")
    if n != count:
        raise ScanProblem(partition, db, None,
                          f"{n} records, {count} counted: the partition changed during the "
                          f"scan (is another process writing?)")


# madvise(MADV_POPULATE_WRITE) (Linux 5.14+): fault a range in with one call; Python 3.11's
# mmap module does not name it yet.
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform == "linux" else None)


def prefault(out, start, length):
    """Map the pages of shared ``out[start:start + length]`` in with one call before they are
    written: faulted one by one during the copy they cost about as much as the copy itself.
    A hint only: elsewhere (another kernel, a buffer that is not a mapping) the copy faults
    them in as it goes."""
    if _POPULATE_WRITE is None or not isinstance(out, mmap.mmap) or length <= 0:
        return
    low = start - start % mmap.PAGESIZE
    try:
        out.madvise(_POPULATE_WRITE, low, length + start - low)
    except (OSError, ValueError):
        pass


def scan_fixed(env, dbh, partition, db, count, record_size, key_size, vout, kout, offset):
    """Copy the ``count`` records of ``dbh`` (one snapshot) into ``vout``/``kout`` at record
    ``offset`` (``kout`` None: values only); :class:`ScanProblem` names the first bad
    record."""
    try:
        _scan_fixed(env, dbh, partition, db, count, record_size, key_size, vout, kout, offset)
    except lmdb.Error as e:
        # A damaged page (CorruptedError, PageNotFoundError, ...): the store's, named by
        # its file, not a bug of the scan.
        raise ScanProblem(partition, db, None,
                          f"{os.path.join(env.path(), 'data.mdb')}: {e}") from None


def _scan_fixed(env, dbh, partition, db, count, record_size, key_size, vout, kout, offset):
    with env.begin(db=dbh, buffers=False) as txn:
        n = txn.stat(dbh)["entries"]
        if n != count:
            raise ScanProblem(partition, db, None,
                              f"{n} records, {count} counted: the partition changed during the "
                              f"scan (is another process writing?)")
        cur = txn.cursor(db=dbh)
        prefault(vout, offset * record_size, count * record_size)
        _copy(cur, False, record_size, count, vout, offset * record_size, partition, db, txn,
              dbh)
        if kout is not None:
            _copy(cur, True, key_size, count, kout, offset * key_size, partition, db, txn,
                  dbh)


def open_readonly(path, max_dbs):
    return lmdb.open(path, readonly=True, lock=True, subdir=True, create=False,
                     max_dbs=max_dbs, max_spare_txns=0)


def run(job):
    """Execute one job (a dict, see :func:`storage._scan._job`); return the JSON reply."""
    with open(job["vfile"], "r+b") as vf:
        vmm = mmap.mmap(vf.fileno(), job["vsize"])
    kmm = None
    if job["kfile"] is not None:
        with open(job["kfile"], "r+b") as kf:
            kmm = mmap.mmap(kf.fileno(), job["ksize"])
    try:
        for partition, dirname, count, offset in job["partitions"]:
            try:
                env = open_readonly(dirname, job["max_dbs"])
            except lmdb.Error as e:
                raise ScanProblem(partition, "meta", None,
                                  f"cannot open the LMDB environment read-only: {e}") from None
            try:
                try:
                    meta = env.open_db(b"meta", create=False)
                    dbh = env.open_db(job["db"].encode(), create=False)
                except lmdb.Error as e:
                    raise ScanProblem(partition, job["db"], None,
                                      f"database missing: {e}") from None
                with env.begin() as txn:
                    check_meta(txn, meta, partition, job["schema"],
                               {"partitions": job["npartitions"], "partition": partition})
                scan_fixed(env, dbh, partition, job["db"], count, job["record_size"],
                           job["key_size"], vmm, kmm, offset)
            finally:
                env.close()
        return {"ok": True}
    except ScanProblem as e:
        return {"error": e.as_json()}
    finally:
        vmm.close()
        if kmm is not None:
            kmm.close()


if __name__ == "__main__":
    reply = run(json.loads(sys.argv[1]))
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
