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

Nothing routes a tenant to a shard by itself: :class:`~transport.Client` talks to the one
shard it is given (``shard=N``). :func:`tenant_shard` is the stable rule a client of a
several-shard config should use (the storage layer's partition hash, over the shard count);
a tenant enqueued on two shards would be two independent sets of runs.
"""

import os
from dataclasses import replace

from engine._config import Config
from storage import partition_of

__all__ = ["shard_config", "shard_store_path", "tenant_shard"]


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
