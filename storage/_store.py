"""The narrow storage interface: ``Store``, its errors, and the claim (ownership) record.

Everything the engine persists goes through :meth:`Store.commit`; everything it reads back at
start-up comes from :meth:`Store.scan` (or :func:`storage.scan_parallel` for the fixed-size
records). After start-up nothing on the decision path reads the store.

Data model
----------
A store has ``partitions`` partitions (tenants map to them with
:func:`storage.partition_of`). Each partition holds the named databases in :data:`DBS`; each
database maps ``bytes`` keys (1 to :data:`MAX_KEY_SIZE` bytes, compared as unsigned bytes, so
big-endian integers scan in numeric order) to ``bytes`` values. A batch is::

    {partition: [(db_name, key, value_or_None), ...], ...}

applied in list order (a later op on the same key wins); ``None`` deletes (deleting a missing
key is not an error). Keys and values may be any bytes-like object (``bytes``, ``bytearray``,
``memoryview``, a contiguous numpy slice); they are copied during :meth:`Store.commit`, so the
caller may reuse its buffers as soon as the call returns.

Bulk op: a block of fixed-size records
--------------------------------------
A partition's op list may also hold :class:`Records` blocks, alongside the triples::

    {partition: [Records(db, keys, values, key_size, value_size), (db, key, value), ...]}

``Records("actions", keys, values, 8, 180)`` is ``n`` puts into one database: ``keys`` is one
contiguous bytes-like of ``n * key_size`` bytes (record ``i``'s key is bytes
``i*key_size .. (i+1)*key_size``), ``values`` one of ``n * value_size`` bytes. It means exactly
the same as the ``n`` triples ``(db, key_i, value_i)`` at its place in the list: applied in list
order with the ops around it, and within the block in record order (a later record, block or
triple on the same key wins). A block only puts (no deletes: give those as triples). ``n == 0``
is allowed (it writes nothing, but still counts as an op of its partition). The store copies
the bytes during :meth:`Store.commit`; the block holds views of the caller's buffers (no copy)
until it is dropped, so keep them unchanged until ``commit`` returns.

Keys in ascending unsigned byte order, without duplicates, are recommended (the order scans
return, and the one ``LmdbStore``'s optional append path needs: off by default, see its module
docstring). Unsorted or duplicate keys are correct all the same (same semantics, the later
record wins) and, measured, hardly slower: LMDB searches every key anyway (1,000 overwrites at
random rows of a 200k-record database, as one block: 5.15 ms shuffled, 5.05 ms sorted).
``MemoryStore`` applies a block record by record.

A block is validated when built (``InvalidBatch``: database name, ``key_size`` 1 to
:data:`MAX_KEY_SIZE`, ``value_size`` >= 0, buffers bytes-like and contiguous, lengths multiples
of the sizes and of the same record count) and at ``commit`` (a ``meta`` block may not hold a
reserved key); like any invalid op it fails the whole commit with nothing applied.

Bulk op: a block of variable-size puts
--------------------------------------
``Puts(db, keys, values)`` (``keys`` and ``values`` lists of ``bytes``, the same length) means
the triples ``(db, keys[i], values[i])`` in order, at its place in the list, as a
:class:`Records` block does for fixed sizes: only puts, never into ``meta``. A store applies
it with one ``putmulti`` and carries it in a redo record as its two lists; what LMDB refuses
in it (an empty or too long key) fails the commit naming the pair. Built, it checks its
database and lists (every pair too, in the ``LEASEHOLD_DEBUG=1`` build).

The ``meta`` database is shared with the store itself: the keys in
:data:`RESERVED_META_KEYS` (``schema``, ``layout``, ``claim``, ``applied``) are the store's own
and a batch that writes one is refused with :class:`InvalidBatch`. Reading them with
:meth:`Store.get` is fine (``claim`` decodes with :meth:`Claim.decode`).

Errors
------
Every failure of a store operation is a :class:`StoreError`; the subclasses say what the caller
should do:

* :class:`StoreFull` -- the map of a partition is full. Nothing of the commit was applied;
  grow the map (``LmdbStore.resize``) and retry, or refuse the transition. A group is refused
  this way only before its commit point: once a partition's redo record holds it,
  ``LmdbStore`` completes it, growing the map it needs (see its "Map size" section).
* :class:`OwnershipError` -- another shard holds (``open``) or took over (``renew``,
  ``commit``) a partition. Nothing was applied; after ``renew``/``commit`` raise it the caller
  no longer owns the store and **must stop** (split-brain guard).
* :class:`CorruptRecord` -- a record that cannot be this store's: a foreign or newer schema, a
  different partition count, an undecodable claim, a fixed-size record of the wrong size.
  Names the partition, database and key.
* :class:`InvalidBatch` (also a ``ValueError``) -- the batch itself is wrong (unknown database,
  partition out of range, empty or oversized key, non-bytes value, reserved ``meta`` key, a
  malformed :class:`Records` block). Nothing was applied. A programming error.
* :class:`StoreFailed` -- an I/O (or other) error *at or after the commit point*. The store
  refuses every further write; close it, reopen it (the reopen finishes or discards the group
  atomically, see :class:`storage.LmdbStore`) and rebuild memory from disk.

Any other ``StoreError`` raised by ``commit`` (for instance an LMDB error while writing) also
means nothing was applied.
"""

from __future__ import annotations

import operator
import os
import socket
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import msgpack

from cext._records import fixed_pairs
from cext._types import DEBUG

__all__ = [
    "DBS",
    "MAX_KEY_SIZE",
    "RESERVED_META_KEYS",
    "SCHEMA_VERSION",
    "Batch",
    "Claim",
    "CorruptRecord",
    "InvalidBatch",
    "Op",
    "OwnershipError",
    "Puts",
    "Records",
    "Store",
    "StoreError",
    "StoreFailed",
    "StoreFull",
]

#: The named databases of every partition, in a fixed order (the order is part of the redo
#: record format: a record names a database by its index in this tuple).
DBS: tuple[str, ...] = (
    "actions", "specs", "attempts", "envs", "finalize", "history", "queues", "meta", "runs",
    "workers", "retained", "expiry",
)
#: On-disk format version, written as ``meta/schema`` in every partition at creation. A store
#: with another version is refused (:class:`CorruptRecord`), never converted in place.
#: Version 2 (issue 14, predictions): action records carry the spec's runtime estimate and
#: max_runtime, and runtime history records are per (task, shape) with recent successes.
#: Version 3: an abort lists the lean rows it ended in one record (``attempts``, ``r`` + the
#: root's row; engine/_aborts.py) instead of rewriting their action records, so older code
#: would read those rows as still queued or running and run them again.
#: Version 4: a retained outcome's key is its run's digest then its name (it was then a
#: digest of the name), and its expiry entry's key ends in that key, so older code would miss
#: retained outcomes (re-running an id it should find done) and this code would miss theirs.
#: Version 5: a retained outcome names its spec's content by key (``engine._retain``,
#: ``content_key``), stored once a partition beside the outcomes, instead of holding a copy;
#: older code would read the key as the spec.
#: Version 6: a group of several partitions is made atomic by a redo record its largest
#: partition carries (``storage._lmdb``), not by a journal environment: older code would not
#: replay those records, and this code does not read an older store's journal.
SCHEMA_VERSION = 6
#: LMDB's default key size limit, enforced by every store so that a batch accepted by
#: ``MemoryStore`` is also accepted by ``LmdbStore``.
MAX_KEY_SIZE = 511

META_SCHEMA = b"schema"
META_LAYOUT = b"layout"
META_CLAIM = b"claim"
META_APPLIED = b"applied"
#: ``meta`` keys owned by the store; a batch may not write them.
RESERVED_META_KEYS: frozenset[bytes] = frozenset(
    {META_SCHEMA, META_LAYOUT, META_CLAIM, META_APPLIED}
)

Op = tuple[str, bytes, "bytes | None"]
Batch = Mapping[int, Sequence["Op | Records | Puts"]]

DEFAULT_CLAIM_TTL_S = 30.0

_HOST = socket.gethostname()


def _fmt_size(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % (size // 16) == 0:
            return f"{n / size:g} {unit}"
    return f"{n} bytes"


def _fmt_ns(ns: int) -> str:
    """Wall-clock ns since the epoch as an ISO-8601 UTC time (ms precision)."""
    try:
        return datetime.fromtimestamp(ns / 1e9, UTC).isoformat(timespec="milliseconds")
    except (OverflowError, OSError, ValueError):
        return f"{ns} ns"


# --------------------------------------------------------------------------------------------
# errors


class StoreError(Exception):
    """Base of every storage error. See the module docstring for what each subclass means."""


class InvalidBatch(StoreError, ValueError):
    """The batch is malformed; nothing was applied. ``partition``, ``db`` and ``key`` name the
    offending op where known."""

    def __init__(self, message: str, partition: int | None = None, db: str | None = None,
                 key: bytes | None = None):
        self.partition, self.db, self.key = partition, db, key
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (self.args[0], self.partition, self.db, self.key))


class StoreFull(StoreError):
    """The LMDB map of ``partition`` is full at ``map_size`` bytes. The transaction was
    aborted: nothing of the commit was applied, anywhere."""

    def __init__(self, partition: int, map_size: int):
        self.partition, self.map_size = partition, map_size
        super().__init__(
            f"map full: partition {partition}, map_size {_fmt_size(map_size)}; a shard grows "
            f"a full map by doubling up to storage.max_map_size: raise that setting (with "
            f"LmdbStore directly: LmdbStore(map_size=...) or LmdbStore.resize(new_map_size)). "
            f"Nothing of this commit was applied."
        )

    def __reduce__(self):
        return (type(self), (self.partition, self.map_size))


class CorruptRecord(StoreError):
    """A record that this store cannot have written: ``partition`` (``None``: the store as a
    whole),
    database ``db``, ``key`` (``None`` when the whole environment is unreadable), and
    ``problem`` (what was wrong)."""

    def __init__(self, partition: int | None, db: str, key: bytes | None, problem: str):
        self.partition, self.db, self.key, self.problem = partition, db, key, problem
        where = "the store" if partition is None else f"partition {partition}"
        what = f"key {key!r}" if key is not None else "environment"
        super().__init__(f"corrupt or foreign record: {where}, db {db!r}, {what}: {problem}")

    def __reduce__(self):
        return (type(self), (self.partition, self.db, self.key, self.problem))


class StoreLost(StoreError):
    """A data file this process opened is no longer at its path (deleted, or replaced by
    another file) while the store is open: what it writes goes to a file no restart will
    read. Raised by ``renew``, and by a ``commit`` that wrote to such a file (written, but
    into that file: not to be acknowledged); the store refuses every later write, and the
    process must stop at once (as for ``OwnershipError``)."""


class StoreFailed(StoreError):
    """An error at or after the commit point of a group commit; the store is now unusable.

    ``outcome`` is ``"unknown"`` (the failure hit the commit point itself: after a reopen the
    group is either entirely present or entirely absent) or ``"durable"`` (the group had
    passed its commit point: after a reopen it is entirely present). Either way some partitions
    may show the group and others not *until the store is reopened*, which is why every
    further ``commit``/``renew`` raises: close, reopen, reload memory from disk."""

    def __init__(self, message: str, partition: int | None = None, outcome: str = "unknown"):
        self.partition, self.outcome = partition, outcome
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (self.args[0], self.partition, self.outcome))


def _flat_bytes(obj, what: str, db: str) -> memoryview:
    """``obj`` as a flat, unsigned-byte memoryview (no copy); InvalidBatch if it is not a
    contiguous bytes-like object."""
    try:
        m = memoryview(obj)
    except TypeError:
        raise InvalidBatch(f"Records({db!r}): {what} of type {type(obj).__name__} is not "
                           f"bytes-like", db=db) from None
    if m.nbytes == 0:
        return memoryview(b"")
    if not m.c_contiguous:
        raise InvalidBatch(f"Records({db!r}): {what} must be C-contiguous", db=db)
    return m if m.ndim == 1 and m.format == "B" else m.cast("B")


class Records:
    """``Records(db, keys, values, key_size, value_size)``: ``n`` fixed-size records for one
    database, as one op of a :meth:`Store.commit` batch (the module docstring has the rules).

    ``keys``: a contiguous bytes-like of ``n * key_size`` bytes, ``values`` one of
    ``n * value_size`` bytes (``bytes``, ``bytearray``, ``memoryview``, a C-contiguous numpy
    array of any dtype). Nothing is copied: the block holds read views of both buffers (a
    ``bytearray`` cannot be resized while it does) and the store copies the bytes at
    ``commit``. Ascending keys are recommended (see the module docstring); a block means the
    same as the triples ``(db, key_i, value_i)``, ``i = 0 .. n-1``, in that order. Raises
    :class:`InvalidBatch` naming the problem if a size, a length or the database is wrong.
    """

    __slots__ = ("_db", "_keys", "_values", "_key_size", "_value_size", "_n")

    def __init__(self, db: str, keys, values, key_size: int, value_size: int):
        if db not in DBS:
            raise InvalidBatch(f"Records: unknown database {db!r} (known: {', '.join(DBS)})",
                               db=db if isinstance(db, str) else None)
        sizes = []
        for name, raw in (("key_size", key_size), ("value_size", value_size)):
            try:
                size = operator.index(raw) if not isinstance(raw, bool) else None
            except TypeError:
                size = None
            if size is None:
                raise InvalidBatch(f"Records({db!r}): {name} must be an int, not "
                                   f"{type(raw).__name__}", db=db)
            sizes.append(size)
        key_size, value_size = sizes
        if not 0 < key_size <= MAX_KEY_SIZE:
            raise InvalidBatch(f"Records({db!r}): key_size {key_size} must be 1..{MAX_KEY_SIZE}",
                               db=db)
        if value_size < 0:
            raise InvalidBatch(f"Records({db!r}): value_size {value_size} must be >= 0", db=db)
        km = _flat_bytes(keys, "keys", db)
        vm = _flat_bytes(values, "values", db)
        n, rest = divmod(len(km), key_size)
        if rest:
            raise InvalidBatch(f"Records({db!r}): keys have {len(km)} bytes, not a multiple of "
                               f"key_size {key_size}", db=db)
        if len(vm) != n * value_size:
            raise InvalidBatch(f"Records({db!r}): values have {len(vm)} bytes, expected "
                               f"{n} records * value_size {value_size} = {n * value_size}",
                               db=db)
        self._db, self._keys, self._values = db, km, vm
        self._key_size, self._value_size, self._n = key_size, value_size, n

    @classmethod
    def packed(cls, db: str, keys: memoryview, values: memoryview, key_size: int,
               value_size: int) -> Records:
        """A block of buffers the caller packed itself (the engine's record codec): ``keys``
        and ``values`` flat unsigned-byte memoryviews of exactly ``n * key_size`` and
        ``n * value_size`` bytes. The constructor's checks cost about as much as packing a
        handful of records, so this skips them; the ``LEASEHOLD_DEBUG=1`` build runs them."""
        if DEBUG:
            return cls(db, keys, values, key_size, value_size)
        self = object.__new__(cls)
        self._db, self._keys, self._values = db, keys, values
        self._key_size, self._value_size = key_size, value_size
        self._n = len(keys) // key_size
        return self

    db = property(lambda self: self._db, doc="The database name.")
    keys = property(lambda self: self._keys, doc="The keys: a flat byte memoryview.")
    values = property(lambda self: self._values, doc="The values: a flat byte memoryview.")
    key_size = property(lambda self: self._key_size, doc="Bytes per key.")
    value_size = property(lambda self: self._value_size, doc="Bytes per value.")

    def __len__(self) -> int:
        return self._n

    def key(self, i: int) -> bytes:
        """Record ``i``'s key (a copy)."""
        ks = self._key_size
        return bytes(self._keys[i * ks:(i + 1) * ks]) if 0 <= i < self._n else self._oob(i)

    def value(self, i: int) -> bytes:
        """Record ``i``'s value (a copy)."""
        vs = self._value_size
        return bytes(self._values[i * vs:(i + 1) * vs]) if 0 <= i < self._n else self._oob(i)

    def _oob(self, i):
        raise IndexError(f"record {i} of a block of {self._n}")

    def pairs(self, start: int = 0, stop: int | None = None):
        """An iterator of ``(key, value)`` 2-tuples of ``bytes`` for records ``start ..
        stop-1``, as ``Cursor.putmulti`` takes them: made in one C loop
        (``cext._records.fixed_pairs``), no Python code per record."""
        stop = self._n if stop is None else min(stop, self._n)
        start = min(max(start, 0), stop)
        return iter(fixed_pairs(self._keys, self._values, self._key_size, self._value_size,
                                start, stop))

    def __iter__(self):
        return self.pairs()

    def ascending(self) -> bool:
        """Whether the keys are strictly ascending in unsigned byte order (sorted, no
        duplicates): one numpy pass over the keys."""
        import numpy as np

        n, ks = self._n, self._key_size
        if n < 2:
            return True
        w = -(-ks // 8)
        a = np.frombuffer(self._keys, np.uint8).reshape(n, ks)
        if ks != 8 * w:               # zero-pad to whole words: same order for equal lengths
            padded = np.zeros((n, 8 * w), np.uint8)
            padded[:, :ks] = a
            a = padded
        words = a.view(">u8")         # (n, w) big-endian words compare like the bytes
        hi, lo = words[1:], words[:-1]
        if w == 1:
            return bool((hi[:, 0] > lo[:, 0]).all())
        ne = hi != lo
        first = ne.argmax(axis=1)
        r = np.arange(n - 1)
        return bool((ne[r, first] & (hi[r, first] > lo[r, first])).all())

    def __eq__(self, other):
        if not isinstance(other, Records):
            return NotImplemented
        return (self._db == other._db and self._key_size == other._key_size
                and self._value_size == other._value_size and self._keys == other._keys
                and self._values == other._values)

    __hash__ = None

    def __repr__(self) -> str:
        return (f"Records({self._db!r}, {self._n} records, key_size={self._key_size}, "
                f"value_size={self._value_size})")


def check_records(p: int, rec: Records) -> None:
    """The checks of a block that depend on its content, at commit: a ``meta`` block may not
    write a key reserved for the store."""
    if rec.db != "meta":
        return
    for key in RESERVED_META_KEYS:
        if len(key) != rec.key_size:
            continue
        for i in range(len(rec)):
            if rec.key(i) == key:
                raise InvalidBatch(f"partition {p}: meta key {key!r} (record {i} of a Records "
                                   f"block) is reserved for the store", partition=p, db="meta",
                                   key=key)


class Puts:
    """``Puts(db, keys, values)``: ``len(keys)`` puts of variable-size records into one
    database, as one op of a :meth:`Store.commit` batch (the module docstring has the rules):
    ``keys`` and ``values`` are lists of ``bytes`` of the same length, and the block means
    exactly the triples ``(db, keys[i], values[i])`` in order. Only puts (no deletes), and
    not into ``meta``. Raises :class:`InvalidBatch` when built if the database, the lists or
    their lengths are wrong; a key or value LMDB refuses fails the commit naming it (the
    ``LEASEHOLD_DEBUG=1`` build checks every pair when built). What the engine writes a
    reclaimed action (its retained outcome, its expiry entry): one op for thousands, put
    with one ``putmulti`` and carried in a redo record as two lists, not a triple each."""

    __slots__ = ("_db", "_keys", "_values")

    def __init__(self, db: str, keys: list, values: list):
        if db not in DBS or db == "meta":
            raise InvalidBatch(f"Puts: database {db!r} is not one a block may write (known: "
                               f"{', '.join(d for d in DBS if d != 'meta')})",
                               db=db if isinstance(db, str) else None)
        if type(keys) is not list or type(values) is not list:
            raise InvalidBatch(f"Puts({db!r}): keys and values must be lists, not "
                               f"{type(keys).__name__} and {type(values).__name__}", db=db)
        if len(keys) != len(values):
            raise InvalidBatch(f"Puts({db!r}): {len(keys)} keys but {len(values)} values",
                               db=db)
        if DEBUG:
            for key, value in zip(keys, values, strict=True):
                check_op(0, (db, key, value))
        self._db, self._keys, self._values = db, keys, values

    @property
    def db(self) -> str:
        return self._db

    @property
    def keys(self) -> list:
        return self._keys

    @property
    def values(self) -> list:
        return self._values

    def __len__(self) -> int:
        return len(self._keys)

    def pairs(self):
        """An iterator of the ``(key, value)`` pairs, in order (as ``Cursor.putmulti`` takes
        them: no list of tuples made first)."""
        return zip(self._keys, self._values, strict=True)

    def __eq__(self, other):
        if not isinstance(other, Puts):
            return NotImplemented
        return (self._db, self._keys, self._values) == (other._db, other._keys, other._values)

    __hash__ = None

    def __repr__(self) -> str:
        return f"Puts({self._db!r}, {len(self._keys)} records)"


@dataclass(frozen=True)
class Claim:
    """A partition's ownership record (``meta/claim``): who holds it, until when.

    ``expiry_ns`` is wall-clock ns since the epoch (the caller's ``now_ns``); ``0`` means
    released (a clean ``close``). ``token`` is random per :meth:`Store.open`, so two
    incarnations of the same shard name are told apart: a restarted shard takes over its own
    old claim, and the old process (if it is somehow still running) is then fenced out.
    """

    shard: str
    pid: int
    host: str
    expiry_ns: int
    token: bytes

    def encode(self) -> bytes:
        return msgpack.packb(
            {"shard": self.shard, "pid": self.pid, "host": self.host,
             "expiry_ns": self.expiry_ns, "token": self.token}
        )

    @classmethod
    def decode(cls, raw: bytes, partition: int | None = None) -> Claim:
        """Decode a ``meta/claim`` value; :class:`CorruptRecord` if it is not one."""
        try:
            d = msgpack.unpackb(raw)
            c = cls(d["shard"], d["pid"], d["host"], d["expiry_ns"], d["token"])
            ok = (type(c.shard) is str and type(c.pid) is int and type(c.host) is str
                  and type(c.expiry_ns) is int and type(c.token) is bytes)
        except Exception as e:  # noqa: BLE001 - any decode failure is a corrupt record
            raise CorruptRecord(partition, "meta", META_CLAIM,
                                f"undecodable claim ({type(e).__name__}: {e})") from None
        if not ok:
            raise CorruptRecord(partition, "meta", META_CLAIM, f"malformed claim {d!r}")
        return c

    def live(self, now_ns: int) -> bool:
        return self.expiry_ns > now_ns

    def describe(self, now_ns: int | None = None) -> str:
        s = f"shard {self.shard!r} (pid {self.pid} on host {self.host!r}), "
        if self.expiry_ns == 0:
            return s + "released"
        s += f"claim expires {_fmt_ns(self.expiry_ns)}"
        if now_ns is not None:
            left = (self.expiry_ns - now_ns) / 1e9
            s += f" (in {left:.3f} s)" if left > 0 else f" (expired {-left:.3f} s ago)"
        return s


def new_claim(shard: str, expiry_ns: int) -> Claim:
    return Claim(shard, os.getpid(), _HOST, expiry_ns, os.urandom(16))


class OwnershipError(StoreError):
    """Another shard owns a partition: the split-brain guard.

    ``partition``, ``holder`` (the :class:`Claim` found, ``None`` if the claim record is
    missing), ``shard`` (who we are), ``during`` (``"open"``, ``"renew"`` or ``"commit"``).
    From ``open``: refuse to start (nothing was claimed). From ``renew`` or ``commit``: this
    process has lost the store, nothing of the call was applied, and it **must stop** at once;
    every further write is refused the same way."""

    def __init__(self, partition: int, holder: Claim | None, shard: str, during: str,
                 now_ns: int | None = None):
        self.partition, self.holder, self.shard, self.during = partition, holder, shard, during
        self.now_ns = now_ns
        who = holder.describe(now_ns) if holder is not None else "nobody (claim record missing)"
        if during == "open":
            msg = (f"partition {partition} is claimed by {who}; refusing to open it as shard "
                   f"{shard!r}. Another shard is running on this store: stop it, or wait until "
                   f"its claim expires.")
        else:
            msg = (f"partition {partition} was taken over: now held by {who}. Shard {shard!r} "
                   f"no longer owns this store and must stop (detected during {during}; "
                   f"nothing was written).")
        super().__init__(msg)

    def __reduce__(self):
        return (type(self), (self.partition, self.holder, self.shard, self.during, self.now_ns))


def check_open_claim(partition: int, current: Claim | None, shard: str, now_ns: int) -> None:
    """The claim rule at :meth:`Store.open`: a missing, expired or released claim, or one by
    the same shard name (a restart), may be taken; a live claim by another shard may not."""
    if current is None or not current.live(now_ns) or current.shard == shard:
        return
    raise OwnershipError(partition, current, shard, "open", now_ns)


def check_held(partition: int, current: Claim | None, mine: Claim, during: str,
               now_ns: int | None = None) -> None:
    """The fencing rule at :meth:`Store.renew` and :meth:`Store.commit`: the claim record
    must still be the one this open wrote (same token), expired or not."""
    if current is None or current.token != mine.token:
        raise OwnershipError(partition, current, mine.shard, during, now_ns)


# --------------------------------------------------------------------------------------------
# the interface


class Store(ABC):
    """The storage interface the engine writes through (abstract).

    Life cycle: construct, :meth:`open` (claims every partition), then any number of
    :meth:`commit`, :meth:`get`, :meth:`scan`, with :meth:`renew` before half of
    :attr:`claim_ttl_ns` has passed since the last ``open``/``renew``, and finally
    :meth:`close`. A store is used from one thread; it is a context manager (``close`` on
    exit).

    Time is never read inside a store: ``open`` and ``renew`` take ``now_ns``, wall-clock
    nanoseconds since the epoch (``time.time_ns()`` in production, a manual clock in tests).
    It must be comparable between processes (claims written by one are judged by another), so
    not a monotonic clock.
    """

    #: Number of partitions; fixed for the life of the store's data.
    partitions: int

    @property
    @abstractmethod
    def claim_ttl_ns(self) -> int:
        """How long a claim lasts after ``open``/``renew``, in ns."""

    @property
    @abstractmethod
    def shard(self) -> str | None:
        """The shard name given to :meth:`open` (``None`` before)."""

    @abstractmethod
    def open(self, shard: str, now_ns: int) -> None:
        """Claim every partition for ``shard`` until ``now_ns + claim_ttl_ns``.

        All or nothing: if any partition has a live claim by another shard name, nothing is
        claimed and :class:`OwnershipError` names the holder (shard, pid, host, expiry). A
        missing, expired or released claim is taken over; a claim by the same shard name is
        taken over too (a restart; the old incarnation is fenced out by the new token).
        Creates the store if it does not exist; a store of another schema or partition count
        raises :class:`CorruptRecord`. For ``LmdbStore`` it also finishes any group commit a
        crash interrupted (the replay of its redo records) before returning.
        """

    @abstractmethod
    def commit(self, batch: Batch) -> None:
        """Apply ``batch`` (``{partition: [(db, key, value_or_None), Records or Puts, ...]}``)
        as one group; the ops of a partition apply in list order (a :class:`Records` or
        :class:`Puts` block as its records in order, see the module docstring).

        One write transaction per touched partition, then durability (sync) before
        returning: when ``commit`` returns, the whole group survives a crash; acknowledge
        nothing before it returns. Groups are atomic across partitions: after any failure,
        and after a crash at any point, the group is either entirely present or entirely
        absent (for ``LmdbStore``, as seen after a reopen; see there).

        Every touched partition's claim must still be this store's (a takeover raises
        :class:`OwnershipError`). If ``commit`` raises any :class:`StoreError` other than
        :class:`StoreFailed`, nothing of the batch was applied anywhere; on
        :class:`StoreFailed` the store must be reopened. An empty batch (or only empty op
        lists) is a no-op that does not sync.
        """

    @abstractmethod
    def get(self, partition: int, db: str, key: bytes) -> bytes | None:
        """The committed value of ``key`` in ``db`` of ``partition``, or ``None``."""

    @abstractmethod
    def get_many(self, partition: int, db: str, keys) -> list:
        """The committed values of ``keys`` (a sequence of bytes) in ``db`` of ``partition``,
        in order, ``None`` where absent; one consistent snapshot."""

    @abstractmethod
    def scan_range(self, partition: int, db: str, start: bytes = b"",
                   stop: bytes | None = None, limit: int | None = None) -> list:
        """At most ``limit`` committed ``(key, value)`` pairs of ``db`` in ``partition`` with
        ``start <= key < stop`` (``stop`` None: no upper bound), in key order."""

    @abstractmethod
    def scan(self, db: str) -> Iterator[tuple[int, bytes, bytes]]:
        """Every committed ``(partition, key, value)`` of ``db``: partitions in order, keys
        in unsigned byte order within each. Each partition is read in one consistent
        snapshot. For the bulk fixed-size records use :func:`storage.scan_parallel`."""

    @abstractmethod
    def scan_fixed(self, db: str, dtype, *, keys: bool = True):
        """Every record of ``db`` as one :class:`storage.FixedScan` of fixed-size records
        (``dtype``; every value must be ``dtype.itemsize`` bytes and every key 8 bytes, else
        :class:`CorruptRecord` names the partition and key), partitions in order, keys in
        order within each. ``keys=False`` lets a store skip reading the keys (records that
        carry their own key); ``FixedScan.keys`` may then be None. ``LmdbStore`` scans in
        parallel (:func:`storage.scan_parallel`)."""

    @abstractmethod
    def renew(self, now_ns: int) -> int:
        """Extend every claim to ``now_ns + claim_ttl_ns`` and return that expiry.

        Raises :class:`OwnershipError` if any partition's claim is no longer this store's
        (another shard took it over after it expired): **the caller must stop at once**; it
        has no right to write and every further ``commit`` is refused. Call it before half of
        the TTL has passed since the last ``open``/``renew``. Renewing a claim that expired
        but was not taken over succeeds.
        """

    @abstractmethod
    def close(self) -> None:
        """Release the claims (expiry 0, only where still ours) and close. Idempotent.
        A crashed shard's claims are not released: they expire."""

    @abstractmethod
    def fail_next(self, exc: BaseException) -> None:
        """Testing hook: the next :meth:`commit` raises ``exc`` and applies nothing."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


def check_schema(partition, raw: bytes | None) -> None:
    """Raise ``CorruptRecord`` unless ``raw`` is this code's ``meta/schema`` record. A store
    of another schema is foreign or newer; it is never converted in place."""
    if raw is None:
        raise CorruptRecord(partition, "meta", META_SCHEMA, "missing schema record")
    try:
        schema = msgpack.unpackb(raw)
    except Exception as e:  # noqa: BLE001 - any decode failure means a corrupt record
        raise CorruptRecord(partition, "meta", META_SCHEMA,
                            f"undecodable schema record {raw[:32]!r} ({e})") from None
    if isinstance(schema, int) and 0 < schema < SCHEMA_VERSION:
        raise CorruptRecord(partition, "meta", META_SCHEMA,
                            f"schema {schema}: a store written by older code; this code reads "
                            f"schema {SCHEMA_VERSION} and never converts a store in place "
                            f"(drain it with the older code, or start on an empty store)")
    if schema != SCHEMA_VERSION:
        raise CorruptRecord(partition, "meta", META_SCHEMA,
                            f"schema {schema!r}, this code reads schema {SCHEMA_VERSION} "
                            f"(a foreign or newer store; it is never converted in place)")


def check_partition(p, partitions: int) -> int:
    """``p`` as an ``int`` (numpy integers are accepted, bools are not), if in range."""
    try:
        q = operator.index(p) if not isinstance(p, bool) else None
    except TypeError:
        q = None
    if q is None or not 0 <= q < partitions:
        raise InvalidBatch(f"partition {p!r} out of range 0..{partitions - 1}", partition=None)
    return q


def check_op(p: int, op) -> tuple[str, bytes, bytes | None] | Records | Puts:
    """Validate one op and return it with key and value copied to ``bytes`` (a
    :class:`Records` or :class:`Puts` block: checked and returned as a copy over
    ``bytes``)."""
    if isinstance(op, Records):
        check_records(p, op)
        return Records(op.db, bytes(op.keys), bytes(op.values), op.key_size, op.value_size)
    if isinstance(op, Puts):
        checked = [check_op(p, (op.db, key, value))
                   for key, value in zip(op.keys, op.values, strict=True)]
        return Puts(op.db, [t[1] for t in checked], [t[2] for t in checked])
    try:
        db, key, value = op
    except (TypeError, ValueError):
        raise InvalidBatch(f"partition {p}: op {op!r} is not a (db, key, value) triple",
                           partition=p) from None
    if db not in DBS:
        raise InvalidBatch(f"partition {p}: unknown database {db!r} (known: {', '.join(DBS)})",
                           partition=p, db=db)
    try:
        key = bytes(memoryview(key))
    except TypeError:
        raise InvalidBatch(f"partition {p}, db {db!r}: key {key!r} is not bytes-like",
                           partition=p, db=db) from None
    if not 0 < len(key) <= MAX_KEY_SIZE:
        raise InvalidBatch(f"partition {p}, db {db!r}: key {key[:32]!r} has length {len(key)}, "
                           f"must be 1..{MAX_KEY_SIZE}", partition=p, db=db, key=key)
    if db == "meta" and key in RESERVED_META_KEYS:
        raise InvalidBatch(f"partition {p}: meta key {key!r} is reserved for the store",
                           partition=p, db=db, key=key)
    if value is not None:
        try:
            value = bytes(memoryview(value))
        except TypeError:
            raise InvalidBatch(f"partition {p}, db {db!r}, key {key!r}: value of type "
                               f"{type(value).__name__} is not bytes-like or None",
                               partition=p, db=db, key=key) from None
    return db, key, value
