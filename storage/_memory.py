"""``MemoryStore``: the :class:`storage.Store` interface over dicts, for pure-logic tests.

Same validation, same claim (ownership) rules, same errors as ``LmdbStore``, no disk. A
:class:`storage.Records` block is copied at ``commit`` and applied record by record, in order
(the same semantics as ``LmdbStore``'s ``putmulti``). Two ``MemoryStore`` objects built on the
same :class:`MemoryBacking` behave like two processes opening the same store directory (one
shard refused while the other's claim is live, takeover after expiry, fencing of the old
holder). :meth:`MemoryStore.fail_next` injects a failure
(:meth:`MemoryStore.clear_failure` withdraws it).
There is no map size (never ``StoreFull`` unless injected) and no crash to recover from.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgpack

from storage._store import (
    DBS,
    DEFAULT_CLAIM_TTL_S,
    MAX_KEY_SIZE,
    META_CLAIM,
    META_LAYOUT,
    META_SCHEMA,
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
    check_held,
    check_op,
    check_open_claim,
    check_partition,
    check_schema,
    new_claim,
)

__all__ = ["MemoryBacking", "MemoryStore"]


class MemoryBacking:
    """The "disk" of a :class:`MemoryStore`: ``data[partition][db][key] -> value``.
    Share it between stores to simulate several processes on one store directory; tests may
    edit ``data`` directly to plant corrupt records."""

    def __init__(self, partitions: int):
        self.partitions = partitions
        self.data: list[dict[str, dict[bytes, bytes]]] = [
            {db: {} for db in DBS} for _ in range(partitions)
        ]
        for p, part in enumerate(self.data):
            part["meta"][META_SCHEMA] = msgpack.packb(SCHEMA_VERSION)
            part["meta"][META_LAYOUT] = msgpack.packb({"partitions": partitions, "partition": p})


class MemoryStore(Store):
    """``MemoryStore(partitions=16, claim_ttl_s=30.0, backing=None)``: a :class:`Store` in
    memory. ``backing`` (a :class:`MemoryBacking`, e.g. ``other.backing``) shares the data
    with another store, as a second process on the same directory would."""

    def __init__(self, partitions: int = 16, *, claim_ttl_s: float = DEFAULT_CLAIM_TTL_S,
                 backing: MemoryBacking | None = None):
        if type(partitions) is not int or partitions < 1:
            raise ValueError(f"partitions must be an int >= 1, not {partitions!r}")
        if not claim_ttl_s > 0:
            raise ValueError(f"claim_ttl_s must be > 0, not {claim_ttl_s!r}")
        self.partitions = partitions
        self.backing = backing if backing is not None else MemoryBacking(partitions)
        self._ttl_ns = int(claim_ttl_s * 1e9)
        self._claim: Claim | None = None
        self._shard: str | None = None
        self._open = False
        self._lost: OwnershipError | None = None
        self._fail_next: BaseException | None = None
        #: Number of successful non-empty commits (tests use it to count group commits).
        self.commits = 0

    @property
    def claim_ttl_ns(self) -> int:
        return self._ttl_ns

    @property
    def shard(self) -> str | None:
        return self._shard

    def fail_next(self, exc: BaseException) -> None:
        """Make the next commit that passes validation and the claim check raise ``exc``
        without applying its batch (once; a later ``fail_next`` replaces a pending one)."""
        self._fail_next = exc

    def clear_failure(self) -> None:
        """Drop a failure injected by :meth:`fail_next` that no commit has raised yet (a
        no-op when none is pending)."""
        self._fail_next = None

    def _claim_of(self, p: int) -> Claim | None:
        raw = self.backing.data[p]["meta"].get(META_CLAIM)
        return Claim.decode(raw, p) if raw is not None else None

    def open(self, shard: str, now_ns: int) -> None:
        if self._open:
            raise StoreError(f"store is already open (shard {self._shard!r})")
        if type(shard) is not str or not shard:
            raise ValueError(f"shard must be a non-empty str, not {shard!r}")
        data = self.backing.data
        if self.backing.partitions != self.partitions:
            raise CorruptRecord(0, "meta", META_LAYOUT,
                                f"layout {{'partitions': {self.backing.partitions}}}, opened "
                                f"with partitions={self.partitions}")
        for p in range(self.partitions):
            check_schema(p, data[p]["meta"].get(META_SCHEMA))
        for p in range(self.partitions):
            check_open_claim(p, self._claim_of(p), shard, int(now_ns))
        claim = new_claim(shard, int(now_ns) + self._ttl_ns)
        enc = claim.encode()
        for p in range(self.partitions):
            data[p]["meta"][META_CLAIM] = enc
        self._claim, self._shard, self._open, self._lost = claim, shard, True, None

    def _check_writable(self) -> None:
        if not self._open:
            raise StoreError("store is not open")
        if self._lost is not None:
            raise self._lost

    def commit(self, batch: Batch) -> None:
        self._check_writable()
        staged = []
        for p, ops in batch.items():
            p = check_partition(p, self.partitions)
            ops = [check_op(p, op) for op in ops]
            if ops:
                staged.append((p, ops))
        for p, _ops in sorted(staged):
            try:
                check_held(p, self._claim_of(p), self._claim, "commit")
            except OwnershipError as e:
                self._lost = e
                raise
        if self._fail_next is not None:
            exc, self._fail_next = self._fail_next, None
            raise exc
        data = self.backing.data
        for p, ops in staged:
            part = data[p]
            for op in ops:
                if isinstance(op, (Records, Puts)):    # check_op copied its bytes
                    part[op.db].update(op.pairs())
                    continue
                db, key, value = op
                if value is None:
                    part[db].pop(key, None)
                else:
                    part[db][key] = value
        if staged:
            self.commits += 1

    def renew(self, now_ns: int) -> int:
        self._check_writable()
        for p in range(self.partitions):
            try:
                check_held(p, self._claim_of(p), self._claim, "renew", int(now_ns))
            except OwnershipError as e:
                self._lost = e
                raise
        c = self._claim
        self._claim = Claim(c.shard, c.pid, c.host, int(now_ns) + self._ttl_ns, c.token)
        enc = self._claim.encode()
        for p in range(self.partitions):
            self.backing.data[p]["meta"][META_CLAIM] = enc
        return self._claim.expiry_ns

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        if self._lost is not None:
            return
        c = self._claim
        released = Claim(c.shard, c.pid, c.host, 0, c.token).encode()
        for p in range(self.partitions):
            current = self._claim_of(p)
            if current is not None and current.token == c.token:
                self.backing.data[p]["meta"][META_CLAIM] = released

    def _check_read(self, partition: int, db: str) -> int:
        if not self._open:
            raise StoreError("store is not open")
        if db not in DBS:
            raise ValueError(f"unknown database {db!r} (known: {', '.join(DBS)})")
        try:
            return check_partition(partition, self.partitions)
        except InvalidBatch as e:
            raise ValueError(str(e)) from None

    def get(self, partition: int, db: str, key: bytes) -> bytes | None:
        partition = self._check_read(partition, db)
        key = bytes(memoryview(key))
        if not 0 < len(key) <= MAX_KEY_SIZE:
            raise ValueError(f"bad key {key!r:.80}: length {len(key)}")
        return self.backing.data[partition][db].get(key)

    def get_many(self, partition: int, db: str, keys) -> list:
        return [self.get(partition, db, k) for k in keys]

    def scan_range(self, partition: int, db: str, start: bytes = b"",
                   stop: bytes | None = None, limit: int | None = None) -> list:
        partition = self._check_read(partition, db)
        data = self.backing.data[partition][db]
        keys = sorted(k for k in data if k >= start and (stop is None or k < stop))
        return [(k, data[k]) for k in keys[:limit]]

    def scan(self, db: str) -> Iterator[tuple[int, bytes, bytes]]:
        self._check_read(0, db)
        return self._scan(db)

    def scan_fixed(self, db: str, dtype, *, keys: bool = True):
        import numpy as np

        from storage._scan import FixedScan

        dtype = np.dtype(dtype)
        parts, found, values = [], [], []
        for p, key, value in self.scan(db):
            if len(value) != dtype.itemsize or len(key) != 8:
                raise CorruptRecord(p, db, key, f"record of {len(value)} bytes under a key of "
                                                f"{len(key)}, expected {dtype.itemsize} and 8")
            parts.append(p)
            found.append(key)
            values.append(value)
        recs = np.frombuffer(b"".join(values), dtype=dtype) if values else np.zeros(0, dtype)
        part = np.asarray(parts, dtype=np.uint16)
        return FixedScan(values=recs, keys=np.frombuffer(b"".join(found), dtype=">u8"),
                         partition=part,
                         counts=np.bincount(part, minlength=self.partitions).astype(np.int64))

    def _scan(self, db: str) -> Iterator[tuple[int, bytes, bytes]]:
        for p in range(self.partitions):
            for key, value in sorted(self.backing.data[p][db].items()):
                yield p, key, value
