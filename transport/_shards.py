"""How the shards of one config share out the data (``docs/operations.md``, "Several shards").

A store is opened whole: :meth:`storage.LmdbStore.open` claims *every* partition or none
(``storage/README.md``, decision 4), and a live claim by the same shard name is taken over.
So several shard processes cannot split one LMDB directory between them by partition claims:
the second one would either be refused or, under the same name, fence the first out. Each
shard of a config with more than one endpoint therefore gets a store of its own,
``<storage.path>/shard-N``, claimed under the name ``<storage.shard>.N``; a config with one
endpoint keeps ``storage.path`` and ``storage.shard`` as written. Status files stay where
:func:`~transport.status_path` of the config as written puts them, so readers find every
shard's file from that one config.

The partition map is :func:`tenant_shard`: a tenant (``org``, the first segment of an action
id or run key) belongs to shard ``tenant_shard(tenant, len(transport.endpoints))``, the
storage layer's partition hash over the shard count. Both sides use it from here: a shard
refuses a request about a tenant it does not own (:func:`check_owned`, :class:`WrongShard`),
and :class:`~transport.Client` sends each request to the owner (:func:`shard_of`,
:func:`split_by_shard`). So a tenant's runs live on exactly one shard; a config with one
endpoint owns every tenant.
"""

import os
from dataclasses import replace

from engine._config import Config
from engine._errors import LeaseholdError
from storage import partition_of

__all__ = ["WrongShard", "check_owned", "shard_config", "shard_of", "shard_store_path",
           "split_by_shard", "tenant_of", "tenant_shard"]


def shard_store_path(config, shard_index):
    """The store directory shard ``shard_index`` of ``config`` opens (see the module text)."""
    if len(config.transport.endpoints) <= 1:
        return config.storage.path
    return os.path.join(config.storage.path, f"shard-{int(shard_index)}")


def shard_config(config, shard_index):
    """The config shard ``shard_index`` runs with: ``config`` itself for a one-endpoint
    config; otherwise its own store directory and claim name, and ``status.dir`` pinned to
    the directory the config as written names (so the status file does not move)."""
    if not isinstance(config, Config):
        raise TypeError(f"shard_config: {config!r} is not a Config")
    if len(config.transport.endpoints) <= 1:
        return config
    n = int(shard_index)
    status_dir = config.status.dir if config.status.dir is not None else \
        os.path.join(config.storage.path, "run")
    return replace(
        config,
        storage=replace(config.storage, path=shard_store_path(config, n),
                        shard=f"{config.storage.shard}.{n}"),
        status=replace(config.status, dir=status_dir),
    )


def tenant_shard(tenant, n_shards):
    """The shard index a tenant (``org``, the first segment of an action id) belongs to among
    ``n_shards``: a stable hash (BLAKE2b, ``storage.partition_of``), never changing."""
    if n_shards < 1:
        raise ValueError(f"tenant_shard: n_shards {n_shards!r} must be >= 1")
    return partition_of(tenant, n_shards)


def tenant_of(key):
    """The tenant of an action id or run key (``tenant/project/domain/run[/action]``): its
    first segment."""
    key = str(key)
    cut = key.find("/")
    return key if cut < 0 else key[:cut]


def shard_of(key, n_shards):
    """The shard that owns the tenant of action id or run key ``key`` among ``n_shards``."""
    return tenant_shard(tenant_of(key), n_shards)


def split_by_shard(keys, n_shards):
    """``{shard: [index, ...]}``: the positions of ``keys`` (action ids or run keys) grouped
    by the shard owning each one's tenant, each list in the order given; shards in order of
    their first key. One hash per distinct tenant."""
    out = {}
    memo = {}
    for i, key in enumerate(keys):
        tenant = tenant_of(key)
        owner = memo.get(tenant)
        if owner is None:
            owner = memo[tenant] = tenant_shard(tenant, n_shards)
        out.setdefault(owner, []).append(i)
    return out


class WrongShard(LeaseholdError):
    """A request names a tenant another shard owns (``docs/operations.md``, "Several
    shards"); it was refused whole, nothing of it applied. ``tenant``, ``owner`` (the index
    of the shard that owns it) and ``shard`` (the one that refused) say where to send it."""

    code = "WRONG_SHARD"

    def __init__(self, key, owner, shard, n_shards, what=None):
        tenant = tenant_of(key)
        prefix = f"{what}: " if what else ""
        super().__init__(f"{prefix}tenant {tenant!r} ({key}) is owned by shard {owner} of "
                         f"{n_shards}, not by this shard {shard}; send it to "
                         f"transport.endpoints[{owner}] (a Client of the whole config "
                         f"routes by tenant)")
        self.tenant = tenant
        self.owner = owner
        self.shard = shard


def check_owned(keys, shard_index, n_shards, what=None):
    """Raise :class:`WrongShard` (naming the first foreign key, after ``what`` when given)
    unless shard ``shard_index`` of ``n_shards`` owns the tenant of every action id or run
    key of ``keys``. With one shard it owns everything."""
    if n_shards <= 1:
        return
    memo = {}
    for key in keys:
        tenant = tenant_of(key)
        owner = memo.get(tenant)
        if owner is None:
            owner = memo[tenant] = tenant_shard(tenant, n_shards)
        if owner != shard_index:
            raise WrongShard(key, owner, shard_index, n_shards, what)
