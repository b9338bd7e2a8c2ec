"""``LmdbStore``: the production store, one LMDB environment per partition.

Layout of ``path``::

    path/p00 ... path/pNN   one LMDB environment per partition: the named databases
                            storage.DBS, and "carried" (redo records, below)

Group commit and cross-partition atomicity
------------------------------------------
LMDB transactions do not span environments, so a group touching several partitions is made
atomic by a redo record that one of its partitions carries. ``commit(batch)``:

1. *Write phase.* Begins one write transaction per touched partition (in partition order,
   the lock order every writer follows), checks in each that the partition's claim is still
   ours and applies the ops. For a group that touches more than one partition it records the
   group number in each (``meta/applied``) and writes the ops of every partition but one, the
   *carrier* (the one with the most to write), as one redo record (msgpack) in the carrier's
   own transaction (database ``carried``, keyed by the group number). (A single partition's
   group leaves ``meta/applied`` alone: nothing replays it, and not touching the meta
   database spares its commit the pages: 28-29 us of a ~360 us synced commit here.) Nothing
   is committed yet; any failure here (``StoreFull``, ``OwnershipError``, ``InvalidBatch``,
   an LMDB error, ``fail_next``, ``KeyboardInterrupt``) aborts every transaction: **nothing
   is applied anywhere**.
2. *Commit point.* The carrier's transaction commits and its environment is synced: its own
   part and the redo record of the others are durable together, so from here on the group
   is durable even if the process dies before the next step.
3. *Apply.* Each other partition transaction commits (its data pages synced, its meta page
   not -- LMDB ``metasync=False``, which keeps the database intact on power loss but may lose
   the last transaction, which the carrier's record still holds).

So a group writes its data once, plus a copy of what its smaller partitions write: a turn
of a large fan-out that also touches a small run writes the small run's part twice, not the
fan-out's. (Until 2026-12-04 a separate journal environment took a copy of the whole group:
a 4,000-action turn with 10 actions of another run packed and synced a 6 MB journal record,
25-38 ms of the committer's CPU.)

A group that touches a single partition has no record: its transaction commits and the
environment is synced (``env.sync(True)``): one transaction, atomic by itself.

A :class:`storage.Records` block is written with ``Cursor.putmulti`` over ``(key, value)``
pairs of ``bytes`` made in one C loop (``cext._records.fixed_pairs``), one call per 1,024
records (``_PUT_CHUNK``: the pairs of a chunk are freed before the next is made, so a large
block reuses the same memory; an abort's 150,000 records took 33 ms to pair as one list and
5 ms in chunks). Measured for 1,000
180-byte records: 0.23 ms for that ``putmulti``, against 0.78 ms fed with memoryview slices
(made by ``map`` over ``slice`` objects: a memoryview costs more to make and to read than a
small ``bytes``) and 1.07 ms for 1,000 ``txn.put``. LMDB's append mode (``MDB_APPEND``) is
not used by default (``_APPEND``: measured, it does not pay at these sizes). With it, if a
block's keys are strictly ascending, the part beyond the database's last key goes in with
``append=True``; LMDB refuses, without writing, an appended key that is not greater than the
last one (``MDB_KEYEXIST``, which ``putmulti`` only counts), so the store checks the order
first and, should the count ever come up short, puts that part again the ordinary way. A redo record
carries a block as a msgpack extension type (header, keys, values: ``_EXT_RECORDS``; a
:class:`Puts` block as its two lists: ``_EXT_PUTS``), never as triples, and the replay applies
it with the same code.

``open`` replays the redo records of every partition, in group order: for every record whose
group a partition it names has not applied (``meta/applied`` < group number) it applies that
partition's ops, then syncs every partition and deletes the records. Replay is exact because
every partition applies groups in group order and records the last one in the same
transaction. The records are also deleted (checkpoint: sync every partition, then delete
them) when those written since the last checkpoint pass ``journal_checkpoint_bytes`` (or a
quarter of a partition's map, if smaller) and at ``close``.

What is applied when ``commit`` fails part-way:

* failure in the write phase: nothing, anywhere (the store stays usable);
* failure at the commit point (``StoreFailed``, ``outcome="unknown"``): the carrier's commit
  or sync may or may not have reached the disk; the store refuses further writes; after a
  reopen the group is either entirely present or entirely absent (a full map at the
  carrier's commit is not that: LMDB wrote nothing, and it is ``StoreFull``);
* failure after the commit point (``StoreFailed``, ``outcome="durable"``): some partitions
  show the group, some do not, until the reopen, which completes it from the carrier's
  record. A full map there is not a failure: the store completes the group itself (see *Map
  size*).

So, as seen after a reopen, a group is all or nothing, whatever failed and wherever the
process was killed (``tests/test_storage_crash.py`` SIGKILLs a writer at random points and
checks exactly this).

Durability
----------
With ``sync=True`` (the default) ``commit`` returns only when the group survives a power
loss: the carrier's (or the single partition's) commit and ``env.sync(True)``. Partition
environments run with ``metasync=False`` (data synced at commit, meta page synced by the next
sync); LMDB documents that mode as keeping the database intact (ACI) while possibly losing
the last transaction -- which, for a group's other partitions, the carrier's record still
holds until a checkpoint has synced them. ``writemap`` is not used:
measured here it made bulk writes slower (0.92 s vs 0.61 s for 1M 128-byte puts) and small
synced commits slower (0.23 vs 0.16 ms), and it preallocates each data file to the map size.
``sync=False`` opens every environment ``sync=False``: nothing is fsynced; a killed process
still loses nothing it committed (the page cache survives it) and groups stay atomic, but a
power loss may lose or corrupt recent transactions. For tests and benchmarks only.

Map size
--------
``map_size`` is per partition. Only the pages used are allocated on disk. How far maps grow
is the caller's policy (the engine doubles them up to ``storage.max_map_size``): when the
write phase of a group finds a partition's map full, ``commit`` raises ``StoreFull`` with
nothing applied; ``resize(new_map_size)`` grows every map (no transaction may be open in
this process, i.e. not while a ``scan`` generator is alive) and the same commit can then be
retried. The store grows a map by itself only to finish what
is already decided, for as long as that one write needs it, and then sets it back:

* *after the commit point*: near a full map LMDB's commit of a partition often needs a page or
  two more than the write phase used, and fails (it writes nothing). The group is durable, so
  it is completed: that partition's map is grown and its part applied again in a new
  transaction (exactly the replay). (The carrier's own commit failing so is the commit point
  failing: nothing was written anywhere, ``StoreFull`` names the carrier.) If the data now
  passes the map, the partition is *over* and refuses every new group with ``StoreFull``
  until ``resize`` grows it: so a partition passes its map by at most what one commit
  needed, and the caller's limit holds otherwise;
* *at open*: claims and the replay. LMDB opens a map no smaller than the data it
  holds, but with no room to spare, whatever the configured ``map_size``; a replay that needs
  room grows the map until it fits. A store therefore always reopens with its own config;
* the store's own records (``renew``, the claims released at ``close``, checkpoints).

A carrier's redo records count against its map like its data; they are deleted at the
checkpoint, so they hold at most ``journal_checkpoint_bytes`` (or a quarter of a map) past
what the groups in flight need.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from bisect import bisect_right
from collections.abc import Iterator
from pathlib import Path

import lmdb
import msgpack

from storage._store import (
    DBS,
    DEFAULT_CLAIM_TTL_S,
    META_APPLIED,
    META_CLAIM,
    META_LAYOUT,
    META_SCHEMA,
    RESERVED_META_KEYS,
    SCHEMA_VERSION,
    Batch,
    Claim,
    CorruptRecord,
    InvalidBatch,
    OwnershipError,
    Puts,
    Records,
    Store,
    StoreError,
    StoreFailed,
    StoreFull,
    StoreLost,
    check_held,
    check_open_claim,
    check_partition,
    check_records,
    check_schema,
    new_claim,
)

__all__ = ["LmdbStore", "data_file", "partition_dir"]

DEFAULT_MAP_SIZE = 1 << 30
DEFAULT_CHECKPOINT_BYTES = 64 << 20
#: A map the store grows by itself, for as long as one write needs it (finishing a group the
#: redo record holds, or the store's own records: claims, the replay, checkpoints), grows by
#: 1/16 of its size, at least 32 pages; the step doubles on every further try of the same
#: write, at most _GROW_TRIES times. Afterwards the map is set back (see ``_restore_map``).
_GROW_DIV = 16
_GROW_MIN = 32 * mmap.PAGESIZE
_GROW_TRIES = 20
_DB_INDEX = {name: i for i, name in enumerate(DBS)}
#: The database of a partition's redo records (the other partitions' ops of the groups it
#: carried, keyed by group number): the store's own, not one of ``DBS``.
_CARRIED = "carried"
_ENV_DBS = (*DBS, _CARRIED)
_ZERO = (0).to_bytes(8, "big")

#: Testing hook: if set, called with a stage name at the points of a group commit where a
#: crash matters ("carrier-committed": the carrier committed and synced, no other partition
#: yet; "partition-committed": before a partition's commit, after the commit point when the
#: group has one); it may raise (an injected I/O error) or kill the process. Production code
#: never sets it.
_crash_hook = None


def partition_dir(path: str | os.PathLike, partition: int) -> Path:
    """The directory of ``partition``'s LMDB environment under a store at ``path``."""
    return Path(path) / f"p{partition:02d}"


def data_file(path: str | os.PathLike, partition: int) -> Path:
    """The LMDB data file of ``partition`` under a store at ``path`` (what LMDB maps)."""
    return partition_dir(path, partition) / "data.mdb"


#: Journal encoding of a :class:`Records` block: msgpack extension type ``_EXT_RECORDS`` whose
#: data is this header (database index in ``DBS``, key size, value size, record count), then
#: the keys, then the values: the block as it came, never expanded into triples.
_EXT_RECORDS = 1
_RECORDS_HEADER = struct.Struct(">BHII")
#: Journal encoding of a :class:`Puts` block: extension type ``_EXT_PUTS`` whose data is the
#: msgpack array ``[database index in DBS, [keys], [values]]``.
_EXT_PUTS = 2

#: Whether a block whose keys are strictly ascending writes the records past the database's
#: last key with ``putmulti(append=True)`` (MDB_APPEND). Off: measured, it does not pay for
#: itself at the engine's block sizes (``storage/README.md``, decision 8); the path is kept,
#: tested, for blocks far larger than a loop turn's (``bench/store_commit.py`` measures both).
_APPEND = False
# Records per ``putmulti`` call: pairs made and freed a chunk at a time reuse the same
# memory, where one list of a large block's pairs (150,000 records, 450,000 objects) cost
# more to allocate than LMDB took to write them (abort of 100,000 actions: 33 -> 5 ms).
_PUT_CHUNK = 1024


def _redo_default(obj):
    """msgpack ``default``: a :class:`Records` or :class:`Puts` block as its extension type,
    any other bytes-like object (a numpy slice) as bytes."""
    if isinstance(obj, Puts):
        return msgpack.ExtType(_EXT_PUTS, msgpack.packb(
            [_DB_INDEX[obj.db], obj.keys, obj.values], use_bin_type=True))
    if isinstance(obj, Records):
        n = len(obj)
        if n > 0xFFFFFFFF or obj.value_size > 0xFFFFFFFF:
            raise ValueError(f"{obj!r} is too large for one redo record")
        return msgpack.ExtType(_EXT_RECORDS, b"".join((
            _RECORDS_HEADER.pack(_DB_INDEX[obj.db], obj.key_size, obj.value_size, n),
            obj.keys, obj.values)))
    try:
        return bytes(memoryview(obj))
    except TypeError:
        raise TypeError(f"cannot write a {type(obj).__name__} in a redo record") from None


def _touch(txn, db) -> None:
    """A write that leaves nothing (LMDB commits no transaction without a change)."""
    txn.put(_ZERO, b"", db=db)      # group 0 never exists
    txn.delete(_ZERO, db=db)


def _weight(ops) -> int:
    """Roughly the bytes ``ops`` write (which partition of a group carries the others)."""
    n = 0
    for op in ops:
        if isinstance(op, Records):
            n += len(op) * (op.key_size + op.value_size)
        elif isinstance(op, Puts):
            n += len(op) * 64
        else:
            try:
                n += 16 + len(op[1]) + (len(op[2]) if op[2] is not None else 0)
            except (TypeError, IndexError):
                n += 64     # malformed: the write phase names it
    return n


def _redo_ext(code: int, data: bytes) -> Records | Puts:
    """msgpack ``ext_hook`` of a redo record: a :class:`Records` block back (views of ``data``)
    or a :class:`Puts` block; anything else is a corrupt record (``ValueError``)."""
    if code == _EXT_PUTS:
        try:
            db, keys, values = msgpack.unpackb(data, raw=False)
            return Puts(DBS[db], keys, values)
        except (ValueError, TypeError, IndexError, InvalidBatch,
                msgpack.exceptions.ExtraData) as e:
            raise ValueError(f"malformed Puts block: {e}") from None
    if code != _EXT_RECORDS:
        raise ValueError(f"unknown msgpack extension type {code}")
    h = _RECORDS_HEADER.size
    if len(data) < h:
        raise ValueError("truncated Records block")
    db, ks, vs, n = _RECORDS_HEADER.unpack_from(data)
    if db >= len(DBS) or len(data) != h + n * (ks + vs):
        raise ValueError(f"malformed Records block (db {db}, {n} x ({ks} + {vs}) bytes in "
                         f"{len(data) - h})")
    m = memoryview(data)
    try:
        return Records(DBS[db], m[h:h + n * ks], m[h + n * ks:], ks, vs)
    except InvalidBatch as e:
        raise ValueError(str(e)) from None


def _file_id(f: Path):
    """``(device, inode)`` of ``f``, or None when it does not exist."""
    try:
        st = f.stat()
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _peek(data_file: Path, read):
    """``read(env, txn)`` of the LMDB environment holding ``data_file``, opened read-only
    and closed again (LMDB reads only its meta pages to open it); None when it cannot be
    opened so (the real open says why)."""
    try:
        env = lmdb.open(str(data_file.parent), readonly=True, lock=False, create=False,
                        subdir=True, max_dbs=len(_ENV_DBS))
    except lmdb.Error:
        return None
    try:
        with env.begin() as txn:
            return read(env, txn)
    except lmdb.Error:
        return None
    finally:
        env.close()


def _store_partitions(data_file: Path) -> int | None:
    """The partition count the layout record of ``data_file``'s environment names, or None
    when it has none (a file merely created by an open that went no further, or no store:
    the open itself then says what is wrong)."""
    def count(env, txn):
        try:
            meta = env.open_db(b"meta", txn=txn, create=False)
        except lmdb.NotFoundError:
            return None
        raw = txn.get(META_LAYOUT, db=meta)
        try:
            layout = msgpack.unpackb(raw) if raw is not None else None
        except Exception:  # noqa: BLE001  (a bad record: the open names it)
            return None
        return layout.get("partitions") if isinstance(layout, dict) else None
    return _peek(data_file, count)


def _page_round(n: int) -> int:
    return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE


def _abort(txns) -> None:
    for txn in txns:
        try:
            txn.abort()
        except Exception:  # noqa: BLE001, S110 - aborting is best effort, nothing to report
            pass


class _MapFull(Exception):
    """Internal to ``open``: partition ``where`` is full; everything was aborted and the
    attempt is to be retried after growing it."""

    def __init__(self, where: int):
        self.where = where
        super().__init__(where)


class LmdbStore(Store):
    """The LMDB store. See the module docstring for layout, atomicity and durability.

    ``LmdbStore(path, partitions=16, map_size=1 GiB, sync=True, claim_ttl_s=30.0,
    journal_checkpoint_bytes=64 MiB)``; nothing touches the disk until :meth:`open`.
    ``map_size`` is per partition and can grow (:meth:`resize`); ``partitions`` must match
    the store's (a mismatch raises :class:`CorruptRecord` at ``open``).

    LMDB allows one open of an environment per process, so one ``LmdbStore`` per path per
    process; other processes may open it too (a second shard is refused by the claims,
    :func:`storage.scan_parallel` workers read it read-only).
    """

    def __init__(self, path: str | os.PathLike, partitions: int = 16,
                 map_size: int = DEFAULT_MAP_SIZE, sync: bool = True,
                 claim_ttl_s: float = DEFAULT_CLAIM_TTL_S,
                 journal_checkpoint_bytes: int = DEFAULT_CHECKPOINT_BYTES):
        if type(partitions) is not int or partitions < 1:
            raise ValueError(f"partitions must be an int >= 1, not {partitions!r}")
        if map_size < mmap.PAGESIZE * 8:
            raise ValueError(f"map_size {map_size} is too small")
        if not claim_ttl_s > 0:
            raise ValueError(f"claim_ttl_s must be > 0, not {claim_ttl_s!r}")
        self.path = Path(path)
        self.partitions = partitions
        self._map_size = _page_round(int(map_size))
        self._sync = bool(sync)
        self._ttl_ns = int(claim_ttl_s * 1e9)
        self._checkpoint_bytes = int(journal_checkpoint_bytes)
        self._envs: list[lmdb.Environment] = []
        self._dbh: list[dict[str, object]] = []
        self._claim: Claim | None = None
        self._claim_raw = None     # the claim record as this store last wrote it
        self._shard: str | None = None
        self._next_gid = 1
        self._carried_bytes = 0     # redo records written since the last checkpoint
        self._carriers: set[int] = set()    # partitions holding some of them
        self._readers = 0
        self._failed: StoreFailed | None = None
        self._lost: OwnershipError | None = None
        self._gone: StoreLost | None = None    # a data file opened is no longer at its path
        self._fail_next: BaseException | None = None
        #: partitions whose data passed their map size when the store grew the map for one
        #: write of its own (_restore_map); they take no new group until resize grows them
        self._over: set[int] = set()

    # ------------------------------------------------------------------ properties

    @property
    def claim_ttl_ns(self) -> int:
        return self._ttl_ns

    @property
    def shard(self) -> str | None:
        return self._shard

    @property
    def map_size(self) -> int:
        """The map size of each partition, in bytes."""
        return self._map_size

    @property
    def sync(self) -> bool:
        return self._sync

    @property
    def is_open(self) -> bool:
        return bool(self._envs)

    def fail_next(self, exc: BaseException) -> None:
        """Testing hook: the next :meth:`commit` raises ``exc`` after its writes are done in
        the open transactions and before the commit point, so it exercises the abort path:
        nothing is applied."""
        self._fail_next = exc

    # ------------------------------------------------------------------ open / close

    def _env_kwargs(self) -> dict:
        return dict(subdir=True, create=True, max_dbs=len(_ENV_DBS), sync=self._sync,
                    metasync=False, max_spare_txns=1)

    def _check_dirs(self) -> None:
        for entry in self.path.iterdir() if self.path.exists() else ():
            name = entry.name
            if len(name) >= 3 and name[0] == "p" and name[1:].isdigit():
                idx = int(name[1:])
                if idx >= self.partitions:
                    raise CorruptRecord(idx, "meta", None,
                                        f"the store has a partition directory {name!r} but was "
                                        f"opened with partitions={self.partitions}")

    def open(self, shard: str, now_ns: int) -> None:
        if self._envs:
            raise StoreError(f"store {self.path} is already open (shard {self._shard!r})")
        if type(shard) is not str or not shard:
            raise ValueError(f"shard must be a non-empty str, not {shard!r}")
        now_ns = int(now_ns)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise StoreError(f"store {self.path}: exists and is not a directory") from None
        except OSError as exc:
            raise StoreError(f"store {self.path}: cannot make the directory: "
                             f"{exc.strerror or exc}") from None
        self._check_dirs()
        self._check_files()
        envs: list[lmdb.Environment] = []
        try:
            for p in range(self.partitions):
                try:
                    envs.append(lmdb.open(str(partition_dir(self.path, p)),
                                          map_size=self._map_size, **self._env_kwargs()))
                except lmdb.Error as e:
                    if "already open" in str(e):
                        raise StoreError(f"{self.path} is already open in this process (LMDB "
                                         f"allows one open per process)") from None
                    if isinstance(e, lmdb.MemoryError) or "Cannot allocate memory" in str(e):
                        # The map did not fit the address space left (ulimit -v, many large
                        # partitions): nothing is wrong with the data.
                        raise StoreError(
                            f"{partition_dir(self.path, p)}: cannot map the partition "
                            f"({self._map_size} bytes) into memory: {e}; lower storage."
                            f"map_size or raise the address-space limit (ulimit -v). The "
                            f"store itself is intact.") from None
                    if not isinstance(e, (lmdb.CorruptedError, lmdb.InvalidError,
                                          lmdb.VersionMismatchError, lmdb.PanicError,
                                          lmdb.PageNotFoundError, lmdb.BadChecksumError)):
                        # Permissions, a read-only file system, a lock: the data may be
                        # fine, so not "corrupt" (an operator might delete a healthy store).
                        raise StoreError(f"{partition_dir(self.path, p)}: cannot open the "
                                         f"LMDB environment: {e}") from None
                    raise CorruptRecord(p, "meta", None,
                                        f"cannot open the LMDB environment: {e}") from None
            self._open_locked(envs, shard, now_ns)
        except BaseException:
            for env in envs:
                env.close()
            self._envs, self._dbh = [], []
            raise

    def _check_same_files(self, partitions=None) -> None:
        """``StoreLost`` when a data file opened (of ``partitions``, default all) is no longer
        the one at its path. Checked after each commit, for the partitions it wrote (so the
        group that found its file gone is not acknowledged), and at each renewal; the store
        refuses every later write."""
        for p in range(len(self._files)) if partitions is None else partitions:
            f = self._paths[p]
            now = _file_id(f)
            if now != self._files[p]:
                what = "is gone" if now is None else "was replaced by another file"
                self._gone = StoreLost(
                    f"store {self.path}: {f} {what} since this shard opened it: its writes "
                    f"since then are in a file no restart reads; stopped (restore the file "
                    f"from a backup, or restart on what is there)")
                raise self._gone

    def _check_files(self) -> None:
        """Before anything is opened (LMDB would create a missing file, and map a short one
        until a read past its end kills the process with SIGBUS): every partition's data
        file present once one holds a store of this partition count (of another, the
        layout check refuses it), and none shorter than the pages its meta page says it
        has."""
        files = [data_file(self.path, p) for p in range(self.partitions)]
        present = [f for f in files if f.exists()]
        for f in present:
            self._check_length(f)
        if present and len(present) < len(files) and any(
                _store_partitions(f) == self.partitions for f in present):
            missing = [str(f) for f in files if not f.exists()]
            raise StoreError(f"store {self.path}: {', '.join(missing)} missing while the "
                             f"other partitions hold data: a data file was deleted or moved. "
                             f"Not started with that partition empty (its work would be "
                             f"lost without a word): put the file back, or move the store "
                             f"aside to start afresh")

    @staticmethod
    def _check_length(f: Path) -> None:
        size = f.stat().st_size
        need = _peek(f, lambda env, txn: (env.info()["last_pgno"] + 1) * env.stat()["psize"])
        if need is not None and size < need:
            raise CorruptRecord(None, "meta", None,
                                f"{f} is {size} bytes, shorter than the {need} its meta "
                                f"pages say it holds (truncated?): not opened (reading past "
                                f"its end would kill the process)")

    def _init_env(self, p: int | None, env, txn, expected_layout: dict, names) -> dict:
        """Check (or, for a new environment, create) schema and layout inside ``txn``; return
        the database handles."""
        where = p
        try:
            meta = env.open_db(b"meta", txn=txn, create=False)
        except lmdb.NotFoundError:
            meta = None
        if meta is None:
            entries = txn.stat()["entries"]
            if entries:
                raise CorruptRecord(where, "meta", None,
                                    f"not a leasehold store: no meta database and {entries} "
                                    f"other entries")
            handles = {n: env.open_db(n.encode(), txn=txn, create=True) for n in names}
            txn.put(META_SCHEMA, msgpack.packb(SCHEMA_VERSION), db=handles["meta"])
            txn.put(META_LAYOUT, msgpack.packb(expected_layout), db=handles["meta"])
            return handles
        check_schema(where, txn.get(META_SCHEMA, db=meta))
        raw = txn.get(META_LAYOUT, db=meta)
        try:
            layout = msgpack.unpackb(raw) if raw is not None else None
        except Exception:  # noqa: BLE001
            layout = raw
        if layout != expected_layout:
            raise CorruptRecord(where, "meta", META_LAYOUT,
                                f"layout {layout!r}, expected {expected_layout!r} (a store "
                                f"with another partition count, or a directory copied from "
                                f"another partition)")
        return {n: env.open_db(n.encode(), txn=txn, create=True) for n in names}

    def _open_locked(self, envs, shard: str, now_ns: int) -> None:
        """Claims, the replay of the redo records and their deletion, retried after growing
        whichever map was full: a group a carrier's record holds is always completed,
        whatever map size the store is opened with (LMDB opens a map no smaller than the data
        it holds, but possibly with no room to spare). A map grown here is set back
        afterwards (``_restore_map``)."""
        P = self.partitions
        tries = [0] * P                 # growth steps per partition
        before = {}                     # partition -> its map size before growing
        while True:
            try:
                claim, last = self._open_attempt(envs, shard, now_ns)
                break
            except _MapFull as full:
                where = full.where
            env = envs[where]
            before.setdefault(where, env.info()["map_size"])
            if tries[where] >= _GROW_TRIES:
                name = f"partition {where}"
                raise StoreError(f"store {self.path}: map full while opening (claims or the "
                                 f"replay): {name} still full at map_size "
                                 f"{env.info()['map_size']} after growing it "
                                 f"{_GROW_TRIES} times")
            try:
                self._grow(env, tries[where])
            except lmdb.Error as e:
                raise StoreError(f"store {self.path}: growing a full map while opening "
                                 f"failed: {e}") from None
            tries[where] += 1
        over = set()
        for where, size in before.items():
            try:
                if self._restore_map(envs[where], size):
                    over.add(where)
            except lmdb.Error as e:
                raise StoreError(f"store {self.path}: LMDB error while opening: {e}") from None
        self._envs = envs
        # Each data file's path and (device, inode) as opened (_check_same_files).
        self._paths = [data_file(self.path, p) for p in range(P)]
        self._files = [_file_id(f) for f in self._paths]
        self._over = over
        # LMDB keeps the larger of the configured and the used size
        self._map_size = max(self._map_size, *(env.info()["map_size"] for env in envs))
        self._claim, self._shard = claim, shard
        self._claim_raw = claim.encode()
        self._next_gid = last + 1
        self._carried_bytes = 0
        self._carriers = set()
        self._failed = self._lost = self._gone = None

    def _open_attempt(self, envs, shard: str, now_ns: int):
        """One attempt of :meth:`_open_locked`: ``(claim, last group number)``;
        :class:`_MapFull` (everything aborted) names the partition that was full. Retrying
        after a partial success is exact: a partition that committed holds our claim (same
        shard: taken over again) and ``meta/applied`` (its replayed groups are skipped)."""
        P = self.partitions
        txns = []
        where = None
        try:
            handles = []
            for p, env in enumerate(envs):
                where = p
                txn = env.begin(write=True)
                txns.append(txn)
                handles.append(self._init_env(p, env, txn,
                                              {"partitions": P, "partition": p}, _ENV_DBS))
            # ownership: all or nothing
            for p, txn in enumerate(txns):
                raw = txn.get(META_CLAIM, db=handles[p]["meta"])
                current = Claim.decode(raw, p) if raw is not None else None
                check_open_claim(p, current, shard, now_ns)
            claim = new_claim(shard, now_ns + self._ttl_ns)
            enc = claim.encode()
            for p, txn in enumerate(txns):
                where = p
                txn.put(META_CLAIM, enc, db=handles[p]["meta"])
            # the redo records: replay what a crash left unapplied, in group order
            applied = []
            for p, txn in enumerate(txns):
                raw = txn.get(META_APPLIED, db=handles[p]["meta"])
                applied.append(int.from_bytes(raw, "big") if raw is not None else 0)
            last = max(applied)
            self._dbh = handles
            records = sorted(
                (int.from_bytes(gkey, "big"), p, gkey, raw)
                for p, txn in enumerate(txns)
                for gkey, raw in txn.cursor(db=handles[p][_CARRIED]))
            carriers = {p for _gid, p, _gkey, _raw in records}
            for gid, carrier, gkey, raw in records:
                last = max(last, gid)
                try:
                    entry = msgpack.unpackb(raw, use_list=False, ext_hook=_redo_ext)
                    parts = [(int(p), ops) for p, ops in entry]
                except Exception as e:  # noqa: BLE001
                    raise CorruptRecord(carrier, _CARRIED, gkey,
                                        f"undecodable redo record ({e})") from None
                for p, ops in parts:
                    if not 0 <= p < P or p == carrier:
                        raise CorruptRecord(carrier, _CARRIED, gkey,
                                            f"redo record names partition {p}")
                    if applied[p] < gid:
                        where = p
                        self._apply(p, txns[p], ops)
                        txns[p].put(META_APPLIED, gkey, db=handles[p]["meta"])
                        applied[p] = gid
            for p, txn in enumerate(txns):
                where = p
                txn.commit()
            txns = []
            for env in envs:
                env.sync(True)
            # Every record is applied and synced: delete them (a crash before this only
            # replays them again, and each is then skipped).
            for p in sorted(carriers):
                where = p
                txn = envs[p].begin(write=True)
                txns.append(txn)
                txn.drop(handles[p][_CARRIED], delete=False)
                txn.commit()
                txns = []
        except lmdb.MapFullError:
            raise _MapFull(where) from None
        except lmdb.Error as e:
            raise StoreError(f"store {self.path}: LMDB error while opening: {e}") from None
        finally:
            _abort(txns)
        return claim, last

    def close(self) -> None:
        """Checkpoint (delete the redo records), release the claims still ours (expiry 0, so
        another shard may open at once), close. After a :class:`StoreFailed` or a lost claim it
        only closes (the next ``open`` repairs). Idempotent."""
        if not self._envs:
            return
        error = None
        if self._failed is None and self._lost is None:
            try:
                self._checkpoint()
                released = Claim(self._claim.shard, self._claim.pid, self._claim.host, 0,
                                 self._claim.token).encode()
                for p, env in enumerate(self._envs):
                    meta = self._dbh[p]["meta"]

                    def release(txn, p=p, meta=meta):
                        raw = txn.get(META_CLAIM, db=meta)
                        if raw is not None and Claim.decode(raw, p).token == self._claim.token:
                            txn.put(META_CLAIM, released, db=meta)

                    self._write_growing(env, release)
                    if self._sync:
                        env.sync(True)
            except Exception as e:  # noqa: BLE001 - close anyway, then report
                error = e
        for env in self._envs:
            env.close()
        self._envs, self._dbh = [], []
        if error is not None:
            raise StoreError(f"store {self.path}: error while closing: {error}") from error

    # ------------------------------------------------------------------ writes

    def _check_writable(self) -> None:
        if not self._envs:
            raise StoreError(f"store {self.path} is not open")
        if self._failed is not None:
            raise StoreFailed(f"store {self.path} failed earlier and refuses writes until it is "
                              f"closed and reopened: {self._failed}",
                              self._failed.partition, self._failed.outcome)
        if self._lost is not None:
            raise self._lost
        if self._gone is not None:
            raise self._gone

    def _apply(self, p: int, txn, ops) -> None:
        """Apply ``ops`` to partition ``p`` inside its write transaction ``txn`` (a full map
        raises ``lmdb.MapFullError``: the caller knows what to do). Consecutive puts to one
        database go to LMDB in one ``putmulti`` (in order, so a later put of a key still
        wins): a turn's per-action triples (the retained outcomes of the rows it reclaimed)
        cost a quarter of what a ``txn.put`` each does."""
        h = self._dbh[p]
        meta = h["meta"]
        run_db, run = None, []      # puts to one database not yet written, in order
        for op in ops:
            if isinstance(op, Records):
                if run:
                    self._put_run(p, txn, h, run_db, run)
                    run = []
                self._put_records(p, txn, h, op)
                continue
            if isinstance(op, Puts):
                if run:
                    self._put_run(p, txn, h, run_db, run)
                    run = []
                if len(op):
                    self._put_run(p, txn, h, op.db, op)
                continue
            try:
                db, key, value = op
                dbh = h[db]
                if dbh is meta and bytes(key) in RESERVED_META_KEYS:
                    raise InvalidBatch(f"partition {p}: meta key {bytes(key)!r} is reserved for "
                                       f"the store", partition=p, db=db, key=bytes(key))
            except (KeyError, TypeError, ValueError, BufferError) as e:
                if isinstance(e, InvalidBatch):
                    raise
                raise InvalidBatch(f"partition {p}: bad op {op!r:.200}: "
                                   f"{type(e).__name__}: {e}", partition=p) from None
            if value is not None:
                if run and db != run_db:
                    self._put_run(p, txn, h, run_db, run)
                    run = []
                run_db = db
                run.append((key, value))
                continue
            if run:
                self._put_run(p, txn, h, run_db, run)
                run = []
            try:
                txn.delete(key, db=dbh)
            except (TypeError, ValueError, BufferError, lmdb.BadValsizeError) as e:
                raise InvalidBatch(f"partition {p}: bad op {op!r:.200}: "
                                   f"{type(e).__name__}: {e}", partition=p) from None
        if run:
            self._put_run(p, txn, h, run_db, run)

    @staticmethod
    def _put_run(p: int, txn, h, db: str, run: list | Puts) -> None:
        """Put ``run`` (``(key, value)`` pairs in op order, or a :class:`Puts` block) into
        database ``db``: one ``putmulti`` (one ``put`` for a single pair). A pair LMDB
        refuses raises ``InvalidBatch`` naming that op, found by putting the run again one
        pair at a time (in order, so if every pair goes in that way the result is the run's
        all the same)."""
        dbh = h[db]
        block = type(run) is Puts
        try:
            if block:
                txn.cursor(db=dbh).putmulti(run.pairs())
            elif len(run) == 1:
                txn.put(run[0][0], run[0][1], db=dbh)
            else:
                txn.cursor(db=dbh).putmulti(run)
            return
        except (TypeError, ValueError, BufferError, lmdb.BadValsizeError):
            pass
        for key, value in (run.pairs() if block else run):
            try:
                txn.put(key, value, db=dbh)
            except (TypeError, ValueError, BufferError, lmdb.BadValsizeError) as e:
                raise InvalidBatch(f"partition {p}: bad op {(db, key, value)!r:.200}: "
                                   f"{type(e).__name__}: {e}", partition=p) from None

    def _put_records(self, p: int, txn, h, rec: Records) -> None:
        """Apply a :class:`Records` block inside ``txn`` with ``Cursor.putmulti``: the same
        as its triples in order. With ``_APPEND``, if its keys are strictly ascending, the
        records past the database's last key (a suffix of the block) are appended
        (``MDB_APPEND``: no search, pages filled, not split), the rest put ordinarily; LMDB
        refuses (does not write) an appended key that is not above the last one, so should
        that ever happen the suffix is put again ordinarily, which gives the same result."""
        check_records(p, rec)
        n = len(rec)
        if n == 0:
            return
        try:
            cur = txn.cursor(db=h[rec.db])
            split = n                       # records [split:] are appended
            if _APPEND:
                last = cur.key() if cur.last() else None
                if (last is None or rec.key(n - 1) > last) and rec.ascending():
                    split = (0 if last is None or rec.key(0) > last
                             else bisect_right(range(n), last, key=rec.key))
            for lo in range(0, split, _PUT_CHUNK):
                cur.putmulti(rec.pairs(lo, min(split, lo + _PUT_CHUNK)))
            if split < n:
                _consumed, added = cur.putmulti(rec.pairs(split, n), append=True)
                if added != n - split:
                    cur.putmulti(rec.pairs(split, n))
        except lmdb.BadValsizeError as e:
            raise InvalidBatch(f"partition {p}: bad {rec!r}: {e}", partition=p,
                               db=rec.db) from None

    def commit(self, batch: Batch) -> None:
        self._check_writable()
        parts = []
        for p, ops in batch.items():
            p = check_partition(p, self.partitions)
            if not isinstance(ops, (list, tuple)):
                ops = list(ops)
            if ops:
                parts.append((p, ops))
        if not parts:
            if self._fail_next is not None:
                exc, self._fail_next = self._fail_next, None
                raise exc
            return
        parts.sort(key=lambda t: t[0])
        for p, _ops in parts:
            if p in self._over:
                raise StoreFull(p, self._envs[p].info()["map_size"])
        several = len(parts) > 1
        if several and self._carried_bytes >= min(self._checkpoint_bytes,
                                                    self._map_size // 4):
            self._checkpoint_before(None)
        gid = self._next_gid
        gkey = gid.to_bytes(8, "big")
        # The carrier (the commit point) writes its own part and a copy of the others': the
        # partition with the most to write, so the copy is the smaller share.
        carrier = max(range(len(parts)), key=lambda i: _weight(parts[i][1])) \
            if several else 0
        try:
            txns, entry = self._write_phase(parts, carrier if several else None, gkey)
        except StoreFull as full:
            if not (several and self._carriers):
                raise
            # The redo records since the last checkpoint may be what fills the map: delete
            # them (nothing of this group is applied) and try once more.
            self._checkpoint_before(full)
            txns, entry = self._write_phase(parts, carrier, gkey)
        if several:
            self._carried_bytes += len(entry) + 64
            self._carriers.add(parts[carrier][0])
        # The carrier first: its commit (and sync) is the commit point.
        order = [carrier, *(i for i in range(len(parts)) if i != carrier)]
        for n, i in enumerate(order):
            p, ops = parts[i]
            point = n == 0      # the group's commit point (a single partition's: its commit)
            try:
                if _crash_hook is not None and not (several and point):
                    _crash_hook("carrier-committed" if n == 1 else "partition-committed")
                try:
                    txns[i].commit()
                except lmdb.MapFullError:
                    # LMDB aborted the transaction before writing anything
                    if point:
                        raise StoreFull(p, self._envs[p].info()["map_size"]) from None
                    self._complete(p, ops, gkey)
                if point and self._sync:
                    self._envs[p].sync(True)
            except BaseException as e:
                _abort([txns[j] for j in order[n:]])
                if isinstance(e, StoreFull) or (isinstance(e, OwnershipError)
                                                and e is self._lost):
                    raise
                durable = several and not point
                self._failed = StoreFailed(
                    f"partition {p}: commit of group {gid} failed "
                    + (f"after its commit point (partition {parts[carrier][0]}'s commit)"
                       if durable else "at its commit point")
                    + f" ({type(e).__name__}: {e}); "
                    + ("the group is durable and a reopen completes it" if durable
                       else "outcome unknown until the store is reopened (then all or "
                            "nothing)"),
                    p, "durable" if durable else "unknown")
                raise self._failed from e
        self._next_gid = gid + 1
        # Written (and synced) into the files this store has open: still the ones a
        # restart reads? A stat each (~1 us): the group is refused rather than acknowledged.
        self._check_same_files([p for p, _ops in parts])

    def _write_phase(self, parts, carrier: int | None, gkey: bytes):
        """Begin a write transaction per partition of ``parts``, check the claims, apply the
        ops, and for a group of several partitions (``carrier``: the index in ``parts`` of
        the one that carries the others' redo record) record the group number in each and
        write that record in the carrier's transaction: ``(txns, record)``, nothing
        committed. Any failure aborts everything (nothing applied) and raises."""
        txns = []
        entry = None
        where = None
        try:
            for p, ops in parts:
                where = p
                txn = self._envs[p].begin(write=True)
                txns.append(txn)
                meta = self._dbh[p]["meta"]
                raw = txn.get(META_CLAIM, db=meta)
                # The record this store last wrote holds our token: no decode needed (any
                # other record is decoded and checked).
                if raw != self._claim_raw:
                    try:
                        check_held(p, Claim.decode(raw, p) if raw is not None else None,
                                   self._claim, "commit")
                    except OwnershipError as e:
                        self._lost = e
                        raise
                self._apply(p, txn, ops)
                if carrier is not None:
                    # Only a group of several partitions needs its number here (the replay
                    # skips what a partition applied); a single partition's group is atomic
                    # by itself, and leaving the meta database alone spares the commit its
                    # pages.
                    txn.put(META_APPLIED, gkey, db=meta)
            if self._fail_next is not None:
                exc, self._fail_next = self._fail_next, None
                raise exc
            if carrier is not None:
                try:
                    entry = msgpack.packb([part for i, part in enumerate(parts) if i != carrier],
                                          default=_redo_default)
                except (TypeError, ValueError) as e:
                    raise InvalidBatch(f"batch cannot be written as a redo record: {e}") from None
                where = parts[carrier][0]
                txns[carrier].put(gkey, entry, db=self._dbh[where][_CARRIED])
        except BaseException as e:
            _abort(txns)
            if isinstance(e, lmdb.MapFullError):
                raise StoreFull(where, self._envs[where].info()["map_size"]) from None
            if isinstance(e, lmdb.Error):
                raise StoreError(f"partition {where}: LMDB error while writing: {e}; nothing "
                                 f"of this commit was applied") from e
            raise
        return txns, entry

    def _checkpoint_before(self, full: StoreFull | None) -> None:
        """Checkpoint before the write phase of a commit (nothing of it applied); ``full``:
        a map was full (raised if the checkpoint fails)."""
        try:
            self._checkpoint(settle=full is not None)
        except lmdb.Error as e:
            if full is not None:
                raise full from e
            raise StoreError(f"store {self.path}: checkpoint failed: {e}; nothing "
                             f"of this commit was applied") from e

    def _complete(self, p: int, ops, gkey: bytes) -> None:
        """Partition ``p``'s commit of a group its carrier already holds failed on a full map
        (LMDB's commit needs pages of its own, past those the write phase used) and LMDB
        aborted it. The group is durable and must be completed: grow ``p``'s map for as long
        as it takes and apply its part again, exactly as the replay at open would."""
        meta = self._dbh[p]["meta"]

        def redo(txn):
            raw = txn.get(META_CLAIM, db=meta)
            try:
                check_held(p, Claim.decode(raw, p) if raw is not None else None,
                           self._claim, "commit")
            except OwnershipError as e:
                self._lost = e          # the new owner's open replays the group
                raise
            self._apply(p, txn, ops)
            txn.put(META_APPLIED, gkey, db=meta)

        self._write_growing(self._envs[p], redo, full=True)

    def _grow(self, env, tries: int) -> None:
        """Grow ``env``'s map by one step (the ``tries``-th for the same write: steps
        double). No transaction of ``env`` may be open in this process."""
        if self._readers:
            raise StoreError(f"cannot grow a map of {self.path}: {self._readers} scan(s) still "
                             f"hold a read transaction")
        size = env.info()["map_size"]
        env.set_mapsize(_page_round(size + (max(size // _GROW_DIV, _GROW_MIN) << tries)))

    def _restore_map(self, env, size: int) -> bool:
        """Set ``env``'s map back to ``size`` after the store grew it for one write: maps grow
        for good only by :meth:`resize` (the caller's policy, e.g. ``storage.max_map_size``).
        LMDB keeps at least the size of the data, so the pages that write needed stay: then
        (returns True) a partition is marked *over* its map and refuses new groups with
        ``StoreFull`` until :meth:`resize` (else the store's own writes would let it creep
        past any limit: near a full map it is often LMDB's commit, not the write phase, that
        needs the next page)."""
        if env.info()["map_size"] != size:
            env.set_mapsize(size)
        now = env.info()["map_size"]
        for p, e in enumerate(self._envs):
            if env is e:
                self._map_size = max(self._map_size, now)
                if now > size:
                    self._over.add(p)
        return now > size

    def _write_growing(self, env, write, full: bool = False) -> None:
        """``write(txn)`` in one write transaction of ``env``, committed; on a full map (or
        at once if ``full``: the map was just found full) the map is grown (:meth:`_grow`)
        and the write tried again; then the map is set back (:meth:`_restore_map`). For the
        store's own records and for finishing a durable group, never for a new group (that
        one is refused with ``StoreFull``: the caller decides how far maps grow)."""
        before = env.info()["map_size"]
        tries = 0
        try:
            while True:
                if full:
                    self._grow(env, tries)
                    tries += 1
                txn = env.begin(write=True)
                try:
                    write(txn)
                    txn.commit()
                    return
                except lmdb.MapFullError:
                    _abort([txn])
                    if tries >= _GROW_TRIES:
                        raise
                    full = True
                except BaseException:
                    _abort([txn])
                    raise
        finally:
            if tries:
                self._restore_map(env, before)

    def _checkpoint(self, settle: bool = False) -> None:
        """Sync every partition, then delete the redo records this store wrote since the last
        checkpoint (every one of them is applied). Only records up to our last group are
        deleted, never a newer owner's: a process that lost its claims without noticing yet
        cannot delete the record of a group the new owner has not applied yet.

        LMDB reuses the pages a transaction frees only two transactions later; ``settle``
        (a map was full) commits one more, empty-handed write transaction in each carrier so
        that the very next one can use them."""
        if not self._carriers:
            return
        for env in self._envs:
            env.sync(True)

        for p in sorted(self._carriers):
            db = self._dbh[p][_CARRIED]

            def delete_applied(txn, db=db):
                cur = txn.cursor(db=db)
                if cur.first():
                    while int.from_bytes(cur.key() or b"\xff" * 8, "big") < self._next_gid:
                        if not cur.delete():
                            break

            self._write_growing(self._envs[p], delete_applied)
            if settle:
                self._write_growing(self._envs[p], functools.partial(_touch, db=db))
        self._carriers.clear()
        self._carried_bytes = 0

    def renew(self, now_ns: int) -> int:
        self._check_writable()
        self._check_same_files()
        expiry = int(now_ns) + self._ttl_ns
        claim = Claim(self._claim.shard, self._claim.pid, self._claim.host, expiry,
                      self._claim.token)
        enc = claim.encode()
        tries = [0] * self.partitions
        before = {}                     # partition -> its map size before growing
        while True:
            txns = []
            where = None
            try:
                for p, env in enumerate(self._envs):
                    where = p
                    txn = env.begin(write=True)
                    txns.append(txn)
                    meta = self._dbh[p]["meta"]
                    raw = txn.get(META_CLAIM, db=meta)
                    try:
                        check_held(p, Claim.decode(raw, p) if raw is not None else None,
                                   self._claim, "renew", int(now_ns))
                    except OwnershipError as e:
                        self._lost = e
                        raise
                    txn.put(META_CLAIM, enc, db=meta)
                for p, txn in enumerate(txns):
                    where = p
                    txn.commit()
                txns = []
                if self._sync:
                    for env in self._envs:
                        env.sync(True)
                break
            except lmdb.MapFullError as e:
                # A claim is the store's own record: grow the full map and renew again (the
                # partitions renewed already pass the check: the token is unchanged).
                _abort(txns)
                txns = []
                if tries[where] >= _GROW_TRIES:
                    raise StoreError(f"store {self.path}: map full while renewing claims: "
                                     f"{e}") from e
                before.setdefault(where, self._envs[where].info()["map_size"])
                try:
                    self._grow(self._envs[where], tries[where])
                except lmdb.Error as e2:
                    raise StoreError(f"store {self.path}: LMDB error while renewing claims: "
                                     f"{e2}") from e2
                tries[where] += 1
            except lmdb.Error as e:
                raise StoreError(f"store {self.path}: LMDB error while renewing claims: "
                                 f"{e}") from e
            finally:
                _abort(txns)
        try:
            for p, size in before.items():
                self._restore_map(self._envs[p], size)
        except lmdb.Error as e:
            raise StoreError(f"store {self.path}: LMDB error after renewing claims: {e}") from e
        self._claim = claim
        self._claim_raw = enc
        return expiry

    def resize(self, new_map_size: int) -> None:
        """Grow every partition's map to ``new_map_size`` bytes. Only growth; no transaction
        may be open in this process (not while a :meth:`scan` generator is alive). Before
        :meth:`open` it only sets the size to open with."""
        new = _page_round(int(new_map_size))
        if new < self._map_size:
            raise ValueError(f"map_size can only grow: {new} < {self._map_size}")
        if self._readers:
            raise StoreError(f"cannot resize {self.path}: {self._readers} scan(s) still hold a "
                             f"read transaction")
        try:
            # a map is never shrunk (the store may have grown one for a write of its own)
            for p, env in enumerate(self._envs):
                if env.info()["map_size"] < new:
                    env.set_mapsize(new)
                    self._over.discard(p)
        except lmdb.Error as e:
            raise StoreError(f"store {self.path}: resize to {new} failed: {e}") from e
        self._map_size = new

    # ------------------------------------------------------------------ reads

    def _handle(self, partition: int, db: str):
        if not self._envs:
            raise StoreError(f"store {self.path} is not open")
        if db not in _DB_INDEX:
            raise ValueError(f"unknown database {db!r} (known: {', '.join(DBS)})")
        try:
            partition = check_partition(partition, self.partitions)
        except InvalidBatch as e:
            raise ValueError(str(e)) from None
        return self._envs[partition], self._dbh[partition][db]

    def get(self, partition: int, db: str, key: bytes) -> bytes | None:
        env, h = self._handle(partition, db)
        try:
            with env.begin(db=h) as txn:
                return txn.get(key)
        except lmdb.BadValsizeError as e:
            raise ValueError(f"bad key {key!r:.80}: {e}") from None

    def get_many(self, partition: int, db: str, keys) -> list:
        env, h = self._handle(partition, db)
        try:
            with env.begin(db=h) as txn:
                # One C loop over the keys (py-lmdb's getmulti gives the pairs found): most
                # lookups miss (an enqueue checking for retained outcomes of its ids).
                found = txn.cursor().getmulti(keys)
        except lmdb.BadValsizeError as e:
            raise ValueError(f"bad key in get_many: {e}") from None
        if not found:
            return [None] * len(keys)
        found = dict(found)
        return [found.get(k) for k in keys]

    def scan_range(self, partition: int, db: str, start: bytes = b"",
                   stop: bytes | None = None, limit: int | None = None) -> list:
        env, h = self._handle(partition, db)
        out = []
        with env.begin(db=h) as txn:
            cur = txn.cursor()
            if not (cur.set_range(start) if start else cur.first()):
                return out
            for key, value in cur:
                if (stop is not None and key >= stop) or (limit is not None
                                                          and len(out) >= limit):
                    break
                out.append((key, value))
        return out

    def scan(self, db: str) -> Iterator[tuple[int, bytes, bytes]]:
        self._handle(0, db)
        return self._scan(db)

    def scan_fixed(self, db: str, dtype, *, keys: bool = True):
        import numpy as np

        from storage._scan import scan_parallel

        dtype = np.dtype(dtype)
        return scan_parallel(self, db, record_size=dtype.itemsize, dtype=dtype, keys=keys)

    def _scan(self, db: str) -> Iterator[tuple[int, bytes, bytes]]:
        for p in range(self.partitions):
            env, h = self._handle(p, db)
            self._readers += 1
            try:
                with env.begin(db=h) as txn:
                    for key, value in txn.cursor():
                        yield p, key, value
            finally:
                self._readers -= 1
