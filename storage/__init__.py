"""Durable state of a shard: the narrow store interface the engine writes through.

Public names::

    partition_of(tenant, partitions)      tenant -> partition, stable forever (blake2b)
    Store                                 the interface (abstract): open, commit, get, scan,
                                          renew, close, partitions, claim_ttl_ns
    LmdbStore(path, partitions=16, ...)   production: one LMDB environment per partition, a
                                          group of several made atomic by a redo record the
                                          largest carries; resize(new_map_size)
    MemoryStore(partitions=16, ...)       dicts, for pure-logic tests; fail_next(exc)
    scan_parallel(store_or_path, db, record_size=..., ...) -> FixedScan
                                          bulk reload of fixed-size records into numpy
    StoreError > StoreFull, OwnershipError, CorruptRecord, InvalidBatch, StoreFailed,
                 StoreLost
    Claim                                 a partition's ownership record
    Records(db, keys, values, key_size, value_size)
                                          a block of fixed-size records: one op of a batch
                                          (written with LMDB putmulti)
    Puts(db, keys, values)                a block of variable-size puts (lists of bytes):
                                          one op of a batch, one putmulti
    DBS, SCHEMA_VERSION, MAX_KEY_SIZE, RESERVED_META_KEYS

Typical use (the engine's)::

    store = LmdbStore(cfg.storage.path, partitions=cfg.storage.partitions)
    store.open(shard="shard-0", now_ns=time.time_ns())    # OwnershipError: another shard runs
    rows = scan_parallel(store, "actions", record_size=RECORD.itemsize, dtype=RECORD)
    ...
    store.commit({partition_of(tenant, 16): [("actions", row.to_bytes(8, "big"), rec)]})
    store.renew(time.time_ns())                           # every claim_ttl_ns / 3 or so
    store.close()

See ``storage/README.md`` for the design decisions (atomic groups, sync mode, ownership, reload)
and the measurements behind them; each module's docstring has the details.
"""

from storage._lmdb import LmdbStore
from storage._memory import MemoryBacking, MemoryStore
from storage._partition import partition_of
from storage._scan import FixedScan, scan_parallel
from storage._store import (
    DBS,
    MAX_KEY_SIZE,
    RESERVED_META_KEYS,
    SCHEMA_VERSION,
    Batch,
    Claim,
    CorruptRecord,
    InvalidBatch,
    Op,
    OwnershipError,
    Puts,
    Records,
    Store,
    StoreError,
    StoreFailed,
    StoreFull,
    StoreLost,
)

__all__ = [
    "DBS",
    "MAX_KEY_SIZE",
    "RESERVED_META_KEYS",
    "SCHEMA_VERSION",
    "Batch",
    "Claim",
    "CorruptRecord",
    "FixedScan",
    "InvalidBatch",
    "LmdbStore",
    "MemoryBacking",
    "MemoryStore",
    "Op",
    "OwnershipError",
    "Puts",
    "Records",
    "Store",
    "StoreError",
    "StoreFailed",
    "StoreLost",
    "StoreFull",
    "partition_of",
    "scan_parallel",
]
