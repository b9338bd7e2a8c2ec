"""``LmdbStore``: the production store, one LMDB environment per partition plus a journal.

Layout of ``path``::

    path/p00 ... path/pNN   one LMDB environment per partition, named databases storage.DBS
    path/journal            the group-commit journal (an LMDB environment: "log", "meta")

Group commit and cross-partition atomicity
------------------------------------------
LMDB transactions do not span environments, so a group touching several partitions is made
atomic with a small redo journal. ``commit(batch)``:

1. *Write phase.* Begins one write transaction per touched partition (in partition order,
   the lock order every writer follows), checks in each that the partition's claim is still
   ours, applies the ops, and records the group number (``meta/applied``). For a group that
   touches more than one partition it then writes the whole batch (msgpack) as one journal
   record, in a journal write transaction. Nothing is committed yet; any failure here
   (``StoreFull``, ``OwnershipError``, ``InvalidBatch``, an LMDB error, ``fail_next``,
   ``KeyboardInterrupt``) aborts every transaction: **nothing is applied anywhere**.
2. *Commit point.* The journal transaction commits (and syncs). From here on the group is
   durable even if the process dies before the next step.
3. *Apply.* Each partition transaction commits (its data pages synced, its meta page not
   -- LMDB ``metasync=False``, which keeps the database intact on power loss but may lose the
   last transaction, which the journal still holds).

A group that touches a single partition skips the journal: its transaction commits and the
environment is synced (``env.sync(True)``): one transaction, atomic by itself.

``open`` replays the journal: for every record whose group a partition has not applied
(``meta/applied`` < group number) it applies that partition's ops, then syncs every partition
and empties the journal. Replay is exact because every partition applies groups in group
order and records the last one in the same transaction. The journal is also emptied
(checkpoint: sync every partition, then delete the records) when it passes
``journal_checkpoint_bytes`` and at ``close``.

What is applied when ``commit`` fails part-way:

* failure in the write phase: nothing, anywhere (the store stays usable);
* failure at the commit point (``StoreFailed``, ``outcome="unknown"``): the journal commit
  may or may not have reached the disk; the store refuses further writes; after a reopen the
  group is either entirely present or entirely absent;
* failure after the commit point (``StoreFailed``, ``outcome="durable"``): some partitions
  show the group, some do not, until the reopen, which completes it from the journal.

So, as seen after a reopen, a group is all or nothing, whatever failed and wherever the
process was killed (``tests/test_storage_crash.py`` SIGKILLs a writer at random points and
checks exactly this).

Durability
----------
With ``sync=True`` (the default) ``commit`` returns only when the group survives a power
loss: the journal commit is synced (data then meta), or for a single-partition group the
partition's commit and ``env.sync(True)``. Partition environments run with ``metasync=False``
(data synced at commit, meta page synced by the next sync); LMDB documents that mode as
keeping the database intact (ACI) while possibly losing the last transaction -- which, here,
the journal still holds until a checkpoint has synced the partition. ``writemap`` is not used:
measured here it made bulk writes slower (0.92 s vs 0.61 s for 1M 128-byte puts) and small
synced commits slower (0.23 vs 0.16 ms), and it preallocates each data file to the map size.
``sync=False`` opens every environment ``sync=False``: nothing is fsynced; a killed process
still loses nothing it committed (the page cache survives it) and groups stay atomic, but a
power loss may lose or corrupt recent transactions. For tests and benchmarks only.

Map size
--------
``map_size`` is per partition (the journal gets ``map_size * partitions``). Only the pages
used are allocated on disk. When a partition's map is full, ``commit`` raises ``StoreFull``
with nothing applied; ``resize(new_map_size)`` grows every map (no transaction may be open
in this process, i.e. not while a ``scan`` generator is alive) and the same commit can then
be retried.
"""

from __future__ import annotations

import mmap
import os
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
    Store,
    StoreError,
    StoreFailed,
    StoreFull,
    check_held,
    check_open_claim,
    check_partition,
    check_schema,
    new_claim,
)

__all__ = ["LmdbStore", "partition_dir"]

DEFAULT_MAP_SIZE = 1 << 30
DEFAULT_CHECKPOINT_BYTES = 64 << 20
_DB_INDEX = {name: i for i, name in enumerate(DBS)}
_ZERO = (0).to_bytes(8, "big")

#: Testing hook: if set, called with a stage name at the points of a group commit where a
#: crash matters ("journal-committed", "partition-committed"); it may raise (an injected I/O
#: error) or kill the process. Production code never sets it.
_crash_hook = None


def partition_dir(path: str | os.PathLike, partition: int) -> Path:
    """The directory of ``partition``'s LMDB environment under a store at ``path``."""
    return Path(path) / f"p{partition:02d}"


def _to_bytes(obj):
    """msgpack ``default``: any other bytes-like object (a numpy slice) as bytes."""
    try:
        return bytes(memoryview(obj))
    except TypeError:
        raise TypeError(f"cannot journal a {type(obj).__name__}") from None


def _page_round(n: int) -> int:
    return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE


def _abort(txns) -> None:
    for txn in txns:
        try:
            txn.abort()
        except Exception:  # noqa: BLE001, S110 - aborting is best effort, nothing to report
            pass


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
        self._jenv: lmdb.Environment | None = None
        self._jlog = None
        self._claim: Claim | None = None
        self._shard: str | None = None
        self._next_gid = 1
        self._journal_bytes = 0
        self._readers = 0
        self._failed: StoreFailed | None = None
        self._lost: OwnershipError | None = None
        self._fail_next: BaseException | None = None

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
        return dict(subdir=True, create=True, max_dbs=len(DBS), sync=self._sync,
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
        self.path.mkdir(parents=True, exist_ok=True)
        self._check_dirs()
        envs: list[lmdb.Environment] = []
        jenv = None
        try:
            for p in range(self.partitions):
                try:
                    envs.append(lmdb.open(str(partition_dir(self.path, p)),
                                          map_size=self._map_size, **self._env_kwargs()))
                except lmdb.Error as e:
                    if "already open" in str(e):
                        raise StoreError(f"{self.path} is already open in this process (LMDB "
                                         f"allows one open per process)") from None
                    raise CorruptRecord(p, "meta", None,
                                        f"cannot open the LMDB environment: {e}") from None
            try:
                jenv = lmdb.open(str(self.path / "journal"),
                                 map_size=self._map_size * self.partitions,
                                 subdir=True, create=True, max_dbs=2, sync=self._sync,
                                 metasync=self._sync, max_spare_txns=1)
            except lmdb.Error as e:
                raise CorruptRecord(None, "meta", None,
                                    f"cannot open the journal environment: {e}") from None
            self._open_locked(envs, jenv, shard, now_ns)
        except BaseException:
            for env in [*envs, *([jenv] if jenv is not None else [])]:
                env.close()
            self._envs, self._dbh, self._jenv = [], [], None
            raise

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

    def _open_locked(self, envs, jenv, shard: str, now_ns: int) -> None:
        P = self.partitions
        txns = []
        jtxn = None
        try:
            handles = []
            for p, env in enumerate(envs):
                txn = env.begin(write=True)
                txns.append(txn)
                handles.append(self._init_env(p, env, txn,
                                              {"partitions": P, "partition": p}, DBS))
            # ownership: all or nothing
            for p, txn in enumerate(txns):
                raw = txn.get(META_CLAIM, db=handles[p]["meta"])
                current = Claim.decode(raw, p) if raw is not None else None
                check_open_claim(p, current, shard, now_ns)
            claim = new_claim(shard, now_ns + self._ttl_ns)
            enc = claim.encode()
            for p, txn in enumerate(txns):
                txn.put(META_CLAIM, enc, db=handles[p]["meta"])
            # journal: replay what a crash left unapplied
            jtxn = jenv.begin(write=True)
            jh = self._init_env(None, jenv, jtxn, {"partitions": P, "journal": 1},
                                ("log", "meta"))
            applied = []
            for p, txn in enumerate(txns):
                raw = txn.get(META_APPLIED, db=handles[p]["meta"])
                applied.append(int.from_bytes(raw, "big") if raw is not None else 0)
            last = max(applied)
            self._dbh = handles
            for gkey, raw in jtxn.cursor(db=jh["log"]):
                gid = int.from_bytes(gkey, "big")
                last = max(last, gid)
                try:
                    entry = msgpack.unpackb(raw, use_list=False)
                    parts = [(int(p), ops) for p, ops in entry]
                except Exception as e:  # noqa: BLE001
                    raise CorruptRecord(None, "log", gkey,
                                        f"undecodable journal record ({e})") from None
                for p, ops in parts:
                    if not 0 <= p < P:
                        raise CorruptRecord(None, "log", gkey, f"partition {p} out of range")
                    if applied[p] < gid:
                        self._apply(p, txns[p], ops)
                        txns[p].put(META_APPLIED, gkey, db=handles[p]["meta"])
                        applied[p] = gid
            for txn in txns:
                txn.commit()
            txns = []
            for env in envs:
                env.sync(True)
            jtxn.drop(jh["log"], delete=False)
            jtxn.commit()
            jtxn = None
        except lmdb.MapFullError as e:
            raise StoreError(f"store {self.path}: map full while opening (claims or journal "
                             f"replay) at map_size {self._map_size}: open with a larger "
                             f"map_size ({e})") from None
        except lmdb.Error as e:
            raise StoreError(f"store {self.path}: LMDB error while opening: {e}") from None
        finally:
            _abort(txns)
            if jtxn is not None:
                _abort([jtxn])
        self._envs, self._jenv, self._jlog = envs, jenv, jh["log"]
        # LMDB keeps the larger of the configured and the recorded map size
        self._map_size = max(self._map_size, *(env.info()["map_size"] for env in envs))
        self._claim, self._shard = claim, shard
        self._next_gid = last + 1
        self._journal_bytes = 0
        self._failed = self._lost = None

    def close(self) -> None:
        """Checkpoint the journal, release the claims still ours (expiry 0, so another shard
        may open at once), close. After a :class:`StoreFailed` or a lost claim it only closes
        (the next ``open`` repairs). Idempotent."""
        if not self._envs:
            return
        error = None
        if self._failed is None and self._lost is None:
            try:
                self._checkpoint()
                released = Claim(self._claim.shard, self._claim.pid, self._claim.host, 0,
                                 self._claim.token).encode()
                for p, env in enumerate(self._envs):
                    with env.begin(write=True) as txn:
                        meta = self._dbh[p]["meta"]
                        raw = txn.get(META_CLAIM, db=meta)
                        if raw is not None and Claim.decode(raw, p).token == self._claim.token:
                            txn.put(META_CLAIM, released, db=meta)
                    if self._sync:
                        env.sync(True)
            except Exception as e:  # noqa: BLE001 - close anyway, then report
                error = e
        for env in self._envs:
            env.close()
        if self._jenv is not None:
            self._jenv.close()
        self._envs, self._dbh, self._jenv, self._jlog = [], [], None, None
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

    def _apply(self, p: int, txn, ops) -> None:
        """Apply ``ops`` to partition ``p`` inside its write transaction ``txn``."""
        h = self._dbh[p]
        meta = h["meta"]
        for op in ops:
            try:
                db, key, value = op
                dbh = h[db]
                if dbh is meta and bytes(key) in RESERVED_META_KEYS:
                    raise InvalidBatch(f"partition {p}: meta key {bytes(key)!r} is reserved for "
                                       f"the store", partition=p, db=db, key=bytes(key))
                if value is None:
                    txn.delete(key, db=dbh)
                else:
                    txn.put(key, value, db=dbh)
            except lmdb.MapFullError:
                raise StoreFull(p, self._envs[p].info()["map_size"] if self._envs
                                else self._map_size) from None
            except (KeyError, TypeError, ValueError, BufferError, lmdb.BadValsizeError) as e:
                if isinstance(e, InvalidBatch):
                    raise
                raise InvalidBatch(f"partition {p}: bad op {op!r:.200}: "
                                   f"{type(e).__name__}: {e}", partition=p) from None

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
        journaled = len(parts) > 1
        if journaled and self._journal_bytes >= self._checkpoint_bytes:
            try:
                self._checkpoint()
            except lmdb.Error as e:
                raise StoreError(f"store {self.path}: journal checkpoint failed: {e}; nothing "
                                 f"of this commit was applied") from e
        gid = self._next_gid
        gkey = gid.to_bytes(8, "big")
        txns = []
        jtxn = None
        where = None
        try:
            # 1. write phase: nothing is committed until every write succeeded
            for p, ops in parts:
                where = p
                txn = self._envs[p].begin(write=True)
                txns.append(txn)
                meta = self._dbh[p]["meta"]
                raw = txn.get(META_CLAIM, db=meta)
                try:
                    check_held(p, Claim.decode(raw, p) if raw is not None else None,
                               self._claim, "commit")
                except OwnershipError as e:
                    self._lost = e
                    raise
                self._apply(p, txn, ops)
                txn.put(META_APPLIED, gkey, db=meta)
            if self._fail_next is not None:
                exc, self._fail_next = self._fail_next, None
                raise exc
            if journaled:
                where = None
                try:
                    entry = msgpack.packb(parts, default=_to_bytes)
                except (TypeError, ValueError) as e:
                    raise InvalidBatch(f"batch cannot be journaled: {e}") from None
                jtxn = self._jenv.begin(write=True)
                jtxn.put(gkey, entry, db=self._jlog)
        except BaseException as e:
            _abort(txns)
            if jtxn is not None:
                _abort([jtxn])
            if isinstance(e, lmdb.MapFullError):
                raise StoreFull(where, self._jenv.info()["map_size"] if where is None
                                else self._envs[where].info()["map_size"]) from None
            if isinstance(e, lmdb.Error):
                w = "journal" if where is None else f"partition {where}"
                raise StoreError(f"{w}: LMDB error while writing: {e}; nothing of this commit "
                                 f"was applied") from e
            raise
        # 2. commit point
        if journaled:
            try:
                jtxn.commit()
            except lmdb.MapFullError:
                # LMDB aborted the transaction before writing anything
                _abort(txns)
                raise StoreFull(None, self._jenv.info()["map_size"]) from None
            except BaseException as e:
                _abort(txns)
                self._failed = StoreFailed(
                    f"journal commit of group {gid} failed ({type(e).__name__}: {e}); outcome "
                    f"unknown until the store is reopened (then all or nothing)", None,
                    "unknown")
                raise self._failed from e
            self._journal_bytes += len(entry) + 64
        # 3. apply
        for i, (p, _ops) in enumerate(parts):
            try:
                if _crash_hook is not None:
                    _crash_hook("journal-committed" if i == 0 and journaled
                                else "partition-committed")
                txns[i].commit()
                if not journaled and self._sync:
                    self._envs[p].sync(True)
            except BaseException as e:
                _abort(txns[i:])
                if not journaled and isinstance(e, lmdb.MapFullError):
                    raise StoreFull(p, self._envs[p].info()["map_size"]) from None
                outcome = "durable" if journaled else "unknown"
                self._failed = StoreFailed(
                    f"partition {p}: commit of group {gid} failed after "
                    f"{'the journal commit' if journaled else 'the write phase'} "
                    f"({type(e).__name__}: {e}); "
                    + ("the group is durable and a reopen completes it" if journaled
                       else "outcome unknown until the store is reopened"),
                    p, outcome)
                raise self._failed from e
        self._next_gid = gid + 1

    def _checkpoint(self) -> None:
        """Sync every partition, then delete this store's journal records (every one of them
        is applied). Only records up to our last group are deleted, never a newer owner's:
        a process that lost its claims without noticing yet cannot delete the journal record
        of a group the new owner has not applied yet."""
        if self._journal_bytes == 0:
            return
        for env in self._envs:
            env.sync(True)
        with self._jenv.begin(write=True, db=self._jlog) as jtxn:
            cur = jtxn.cursor()
            if cur.first():
                while int.from_bytes(cur.key() or b"\xff" * 8, "big") < self._next_gid:
                    if not cur.delete():
                        break
        self._journal_bytes = 0

    def renew(self, now_ns: int) -> int:
        self._check_writable()
        expiry = int(now_ns) + self._ttl_ns
        claim = Claim(self._claim.shard, self._claim.pid, self._claim.host, expiry,
                      self._claim.token)
        enc = claim.encode()
        txns = []
        try:
            for p, env in enumerate(self._envs):
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
            for txn in txns:
                txn.commit()
            txns = []
            if self._sync:
                for env in self._envs:
                    env.sync(True)
        except lmdb.Error as e:
            raise StoreError(f"store {self.path}: LMDB error while renewing claims: {e}") from e
        finally:
            _abort(txns)
        self._claim = claim
        return expiry

    def resize(self, new_map_size: int) -> None:
        """Grow every partition's map to ``new_map_size`` bytes (the journal's to
        ``new_map_size * partitions``). Only growth; no transaction may be open in this
        process (not while a :meth:`scan` generator is alive). Before :meth:`open` it only
        sets the size to open with."""
        new = _page_round(int(new_map_size))
        if new < self._map_size:
            raise ValueError(f"map_size can only grow: {new} < {self._map_size}")
        if self._readers:
            raise StoreError(f"cannot resize {self.path}: {self._readers} scan(s) still hold a "
                             f"read transaction")
        try:
            for env in self._envs:
                env.set_mapsize(new)
            if self._jenv is not None:
                self._jenv.set_mapsize(new * self.partitions)
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

    def scan(self, db: str) -> Iterator[tuple[int, bytes, bytes]]:
        self._handle(0, db)
        return self._scan(db)

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
