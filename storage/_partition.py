"""Tenant -> partition: the one mapping every store layout depends on.

``partition_of(tenant, partitions)`` is part of the on-disk format. A store written with one
mapping and read with another would find every tenant's rows in the "wrong" partition, and the
ownership claims, the reload and the write path would all silently disagree. So:

**This function must never change.** Not the hash (BLAKE2b, 8-byte digest, no key, no salt,
no person), not the encoding of the tenant (UTF-8, strict), not the byte order (big-endian),
not the reduction (plain modulo). ``tests/test_storage.py`` pins known values; if you need
another mapping, it is a new schema version with a migration, not an edit here.

Python's ``hash()`` is not usable: it is salted per process (``PYTHONHASHSEED``).
"""

from hashlib import blake2b

__all__ = ["partition_of"]


def partition_of(tenant: str, partitions: int) -> int:
    """The partition (``0 <= p < partitions``) that owns ``tenant``; stable forever.

    ``int.from_bytes(blake2b(tenant.encode("utf-8"), digest_size=8).digest(), "big") %
    partitions``. The same tenant and partition count give the same answer in every process,
    on every machine, in every version. Changing ``partitions`` of an existing store moves
    tenants; :class:`storage.LmdbStore` refuses to open a store with a different count.

    Raises ``TypeError`` for a non-``str`` tenant (bytes would hash differently from the
    same text) and ``ValueError`` for ``partitions < 1`` or a tenant that is not valid UTF-8
    (a lone surrogate).
    """
    if type(tenant) is not str:
        raise TypeError(f"tenant must be str, not {type(tenant).__name__}")
    if type(partitions) is not int or partitions < 1:
        raise ValueError(f"partitions must be an int >= 1, not {partitions!r}")
    try:
        data = tenant.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"tenant {tenant!r} is not encodable as UTF-8: {e}") from None
    return int.from_bytes(blake2b(data, digest_size=8).digest(), "big") % partitions
