"""The Leasehold config file: resources, clusters, queues and engine settings.

A config is a TOML file (see ``engine/examples/leasehold.toml`` and ``docs/configuration.md``).
:func:`load_config` reads one, :func:`parse_config` validates an already-parsed mapping, and
:func:`update_queue` validates a live change to one queue. Everything is checked up front: any
problem raises :class:`~engine._errors.ConfigError` with a message of the form
``"{source}: {key.path}: {bad value!r} is invalid; allowed: {what}"``, and nothing is applied.

Vectors (capacities, node shapes, queue budgets) are read-only ``int64`` arrays in the order of
``Config.resources``; :data:`~engine._units.UNLIMITED` marks "no limit".
"""

import math
import re
import socket
import tomllib
from dataclasses import dataclass, replace

import numpy as np

from engine._errors import ConfigError
from engine._execution import PLUGINS
from engine._units import BYTES, DEVICE, MAX_SECONDS, UNLIMITED, ResourceSet, parse_quantity

__all__ = [
    "tcp_host_port",
    "Config",
    "ClusterConfig",
    "NodeShape",
    "QueueConfig",
    "TenantConfig",
    "EngineSettings",
    "StorageSettings",
    "TransportSettings",
    "SecuritySettings",
    "WorkerSettings",
    "StatusSettings",
    "SupervisorSettings",
    "PeerConfig",
    "PEER_ROLES",
    "load_config",
    "parse_config",
    "update_queue",
    "STRICT_FIFO",
    "GREEDY_CAPACITY",
    "PRIORITY_NAMES",
    "MAX_CLUSTERS",
    "ADMISSION_MODES",
]

STRICT_FIFO = "STRICT_FIFO"
GREEDY_CAPACITY = "GREEDY_CAPACITY"
SCHEDULING_POLICIES = (STRICT_FIFO, GREEDY_CAPACITY)
PRIORITY_NAMES = {"MIN": 0, "MEDIUM": 500, "MAX": 1000}
MAX_PRIORITY = 1000
# Clusters are a uint64 bitmask in the tick.
MAX_CLUSTERS = 64
MAX_INT32 = 2**31 - 1
#: Pods one action may place on nodes (engine.max_node_pods): the placement's width.
MAX_NODE_PODS = 1024
RESOURCE_GATES = ("enforce", "off")

_NAME = re.compile(r"^[A-Za-z0-9_.-]+\Z")
_NAME_RULE = "a non-empty name of letters, digits, '_', '.', '-'"
_ALL_CLUSTERS = "*"

_TOP_KEYS = ("resources", "engine", "clusters", "queues", "tenants", "tenant_defaults",
             "storage", "transport", "security", "worker", "status", "supervisor")
_STORAGE_KEYS = ("path", "shard", "partitions", "map_size", "max_map_size", "sync", "claim_ttl",
                 "retention")
MAX_PARTITIONS = 256
_ENGINE_KEYS = (
    "default_queue",
    "max_candidates",
    "dispatch_capacity",
    "resource_gate",
    "initial_capacity",
    "heartbeat_interval",
    "expiry_missed_beats",
    "expiry_jitter",
    "system_retries",
    "runtime_grace",
    "finalize_timeout",
    "pause_on_expiry",
    "eta_horizon",
    "max_node_pods",
)
_CLUSTER_KEYS = ("capacity", "node_shapes", "admission")
#: How the gate decides that an action fits a cluster (``clusters.NAME.admission``): against
#: its totals and node *shapes* (every pod fits some shape), or by placing every pod on its
#: *nodes* (first fit decreasing on each node's free vector; docs/nodes.md).
ADMISSION_MODES = ("shapes", "nodes")
_SHAPE_KEYS = ("name", "count", "allocatable")
_QUEUE_KEYS = (
    "priority",
    "scheduling",
    "run_concurrency",
    "action_concurrency",
    "depth",
    "max_resources",
    "max_accelerators",
    "clusters",
    "backfill",
    "paused",
    "draining",
)
_DEFAULT_DEPTH = 10000
_TENANT_KEYS = ("run_concurrency", "action_concurrency")
# A tenant is the first segment of an action id (engine/_model.py's segment rule).
_TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*\Z")


@dataclass(frozen=True, eq=False)
class NodeShape:
    """One kind of node in a cluster: how many there are and what each can allocate."""

    name: str
    count: int  # >= 1
    allocatable: np.ndarray  # int64[R]; resources not given = 0


@dataclass(frozen=True, eq=False)
class ClusterConfig:
    """A place that runs pods.

    ``capacity`` is None when neither ``capacity`` nor ``node_shapes`` is configured: unknown
    capacity, treated as unlimited. Without a ``capacity`` table but with node shapes, the
    capacity is the sum of ``count * allocatable``. A resource omitted from a given capacity
    table is 0 (the cluster has none of it). Empty ``node_shapes`` = shapes unknown (every pod
    fits).
    """

    name: str
    capacity: np.ndarray | None  # int64[R] or None = unknown = unlimited
    node_shapes: tuple  # tuple[NodeShape]
    admission: str = "shapes"  # ADMISSION_MODES: "nodes" places every pod on a node


@dataclass(frozen=True, eq=False)
class QueueConfig:
    """A named backlog and its policy."""

    name: str
    priority: int  # 0..1000 (MIN=0, MEDIUM=500, MAX=1000)
    scheduling: str  # STRICT_FIFO | GREEDY_CAPACITY
    run_concurrency: int  # max runs with work in flight; 0 = unlimited
    action_concurrency: int  # max actions in flight; 0 = unlimited
    depth: int  # max queued (not yet running) actions; >= 1
    max_resources: np.ndarray  # int64[R]; UNLIMITED where no limit (max_accelerators merged in)
    clusters: tuple  # tuple[str] of cluster names the queue may use
    backfill: bool = False  # EASY backfill behind a blocked head (STRICT_FIFO only)
    # Live operations (``leasehold queue update|drain``), also settable in the file:
    paused: bool = False  # the tick places nothing from it; what it holds runs on
    draining: bool = False  # it takes no new actions (enqueue refused); what it has runs on


@dataclass(frozen=True)
class TenantConfig:
    """Concurrency caps of one tenant (``[tenants.NAME]``), or of every tenant not named
    (``[tenant_defaults]``, ``name`` None). Counted over all queues of the shard."""

    name: str | None = None
    run_concurrency: int = 0  # max runs of the tenant with work in flight; 0 = unlimited
    action_concurrency: int = 0  # max actions of the tenant in flight; 0 = unlimited


@dataclass(frozen=True)
class EngineSettings:
    """The ``[engine]`` table."""

    default_queue: str = "default"  # queue for actions that name none
    max_candidates: int = 4096  # candidates the tick examines per queue per tick (>= 1)
    dispatch_capacity: int = 65536  # bounded dispatch channel size (>= 1)
    resource_gate: str = "enforce"  # "enforce" | "off" (off = count caps only)
    initial_capacity: int = 4096  # initial action-table rows (grows by doubling), >= 16
    heartbeat_interval: float = 10.0  # seconds between a worker's heartbeat batches (> 0)
    expiry_missed_beats: int = 3  # beats a lease may miss before it expires (>= 1)
    expiry_jitter: float = 2.0  # seconds of slack on top of the missed beats (>= 0)
    system_retries: int = 3  # retries of system errors (EXPIRED, OOM, ...) per action (>= 0)
    runtime_grace: float = 60.0  # engine backstop: seconds past max_runtime before expiry
    finalize_timeout: float = 3600.0  # a finalize lease's own bound, in seconds (> 0)
    # Pods one action may have on a cluster with admission = "nodes": the width of the
    # per-lease placement record (one node per pod), allocated once (docs/nodes.md).
    max_node_pods: int = 16
    # A worker that lets a lease expire gets nothing new until its next heartbeat proves it
    # alive (a killed worker is not handed the work that just expired on it).
    pause_on_expiry: bool = True
    # Queued actions the ETA projection places, in the tick's order (>= 1): it runs on the
    # shard's thread when asked (explain, queue metrics), so a deep backlog is bounded.
    eta_horizon: int = 10_000

    @property
    def lease_ttl_ns(self):
        """How long a lease lives without a heartbeat: missed beats x interval + jitter."""
        return int((self.heartbeat_interval * self.expiry_missed_beats + self.expiry_jitter)
                   * 1e9)


@dataclass(frozen=True)
class StorageSettings:
    """The ``[storage]`` table: where and how a shard keeps its durable state."""

    path: str = "leasehold-data"  # directory of the LMDB store (relative: to the working dir)
    shard: str = "shard-0"  # this shard's name in ownership claims (unique per store)
    partitions: int = 16  # tenants map to this many partitions (fixed once the store exists)
    map_size: int = 1 << 30  # bytes of address space per partition at open
    max_map_size: int = 64 << 30  # a full map grows by doubling up to this, then refuses
    sync: bool = True  # fdatasync every group commit (off: fast, loses the tail on power loss)
    claim_ttl: float = 30.0  # seconds a partition claim lives without renewal
    # Seconds an ended action's outcome stays in the store after its row was reclaimed
    # (attempts() and explain() read it, a re-enqueue of its id is idempotent against it).
    retention: float = 7 * 86400.0


@dataclass(frozen=True)
class TransportSettings:
    """The ``[transport]`` table: the wire protocol's limits (``docs/protocol.md``) and the
    sockets' queues. A message over a limit is refused with an error naming it."""

    max_frames: int = 16  # frames in one message (>= 2)
    max_frame_bytes: int = 4 << 20  # bytes in one raw (columnar) frame
    max_header_bytes: int = 4 << 20  # bytes in one msgpack header frame
    max_tokens: int = 1000  # tokens in one HEARTBEAT
    max_batch: int = 10000  # specs in an ENQUEUE, ids in a STATUS, entries of REPORT/LEASES
    max_fanout: int = 100000  # names in one ENQUEUE_FANOUT
    max_name: int = 1024  # bytes of an id or name (action id, run key, queue, worker)
    max_text: int = 4096  # bytes of a free text (reason, message, input reference)
    hwm: int = 1000  # ZeroMQ send/receive high-water mark per connection, in messages
    max_outstanding: int = 64  # requests a client may have unanswered (the shard loop refuses more)
    commit_pipeline: int = 2  # loop turns in commit at once (1: each turn waits for its commit)
    # A turn decided while no message waits is committed on the decision thread itself
    # (nothing to overlap its sync with; no hand-off to the committer and back).
    idle_commit_inline: bool = True
    # The ZeroMQ endpoint each shard binds, by shard index (``leasehold shard --shard N``
    # binds ``endpoints[N]``; clients and workers dial the same strings).
    endpoints: tuple = ("tcp://127.0.0.1:7700",)


@dataclass(frozen=True)
class WorkerSettings:
    """The ``[worker]`` table: how a cluster worker started from this file runs
    (``docs/worker.md``). Capacity and node shapes not given are measured on the machine."""

    slots: int = 0  # leases held at once; 0 = the machine's CPU count
    capacity: np.ndarray | None = None  # int64[R] registered and reported; None = measured
    node_shapes: tuple = ()  # tuple[NodeShape]; () = one node of the capacity
    on_shard_lost: str = "reconnect"  # a shard silent past the lease ttl: "reconnect" | "exit"
    drain_timeout: float = 30.0  # SIGTERM: seconds running attempts may take before stopped
    kill_grace: float = 2.0  # seconds between SIGTERM and SIGKILL of a stopped attempt
    work_dir: str = "leasehold-work"  # attempts' scratch directories (removed at cleanup)
    log_dir: str = "leasehold-logs"  # attempts' output, one file an attempt (kept)
    max_log_bytes: int = 10 << 30  # an attempt writing more to one log is stopped; 0 = none
    default_plugin: str | None = None  # runs actions that declare no execute; None = refuse
    report_free: bool = True  # heartbeats carry the free capacity (capacity minus held)


#: The roles a key can have (``docs/security.md``).
PEER_ROLES = ("worker", "client", "admin")


@dataclass(frozen=True)
class PeerConfig:
    """One ``[security.peers.NAME]`` table: a key name and what its holder may do."""

    name: str
    role: str  # worker | client | admin
    cluster: str | None = None  # the worker's one cluster
    tenants: tuple = ()  # the client's tenant prefixes: "org", "org/project", "org/project/domain"
    public_key: str | None = None  # Z85 (40 characters); None: read KEYS_DIR/NAME.key


@dataclass(frozen=True)
class SecuritySettings:
    """The ``[security]`` table: CURVE keys and the role of every public key. Without it
    a shard runs CURVE and needs keys; ``insecure = true`` is the only way to run without."""

    insecure: bool = False
    keys_dir: str = "keys"  # NAME.key / NAME.key_secret files (relative: to the working dir)
    server_key: str = "shard"  # the shard's own key pair: KEYS_DIR/NAME.key_secret
    peers: tuple = ()  # tuple[PeerConfig], in file order


@dataclass(frozen=True)
class StatusSettings:
    """The ``[status]`` table: the shard's shared-memory status file (``docs/status.md``)."""

    # Directory of the status files (shard N writes ``DIR/shard-N.status``); None: the
    # ``run`` directory under ``storage.path``. Relative: to the working directory.
    dir: str | None = None
    interval: float = 0.05  # seconds between two publishes of a busy shard (>= 0)
    # Where ``leasehold serve`` serves the Prometheus metrics read from the status files:
    # "HOST:PORT" (port 0: any free port, logged), or None (``metrics = false``): none.
    metrics: str | None = "127.0.0.1:9464"


@dataclass(frozen=True)
class SupervisorSettings:
    """The ``[supervisor]`` table: bounds of ``leasehold serve`` (``docs/operations.md``)."""

    start_timeout: float = 60.0  # seconds a shard may take from its spawn to serving (> 0)
    stop_timeout: float = 15.0  # seconds the shards get after SIGTERM before SIGKILL (> 0)


@dataclass(frozen=True, eq=False)
class Config:
    """A validated configuration. Clusters and queues are in file order."""

    source: str  # file path or "<config>"
    resources: ResourceSet
    clusters: tuple  # tuple[ClusterConfig]
    queues: tuple  # tuple[QueueConfig]
    engine: EngineSettings
    storage: StorageSettings = StorageSettings()
    transport: TransportSettings = TransportSettings()
    security: SecuritySettings = SecuritySettings()
    worker: WorkerSettings = WorkerSettings()
    status: StatusSettings = StatusSettings()
    supervisor: SupervisorSettings = SupervisorSettings()
    tenants: tuple = ()  # tuple[TenantConfig] of the named tenants, in file order
    tenant_defaults: TenantConfig = TenantConfig()  # caps of every tenant not named

    def __post_init__(self):
        by_name = {
            "cluster": {c.name: c for c in self.clusters},
            "queue": {q.name: q for q in self.queues},
            "tenant": {t.name: t for t in self.tenants},
        }
        object.__setattr__(self, "_by_name", by_name)

    def tenant(self, name):
        """The caps of tenant ``name``: its ``[tenants.NAME]`` table, else the defaults
        (returned with ``name`` filled in)."""
        named = self._by_name["tenant"].get(name)
        return named if named is not None else replace(self.tenant_defaults, name=name)

    def queue(self, name):
        """The queue called ``name``; ``KeyError`` if there is none."""
        return self._by_name["queue"][name]

    def cluster(self, name):
        """The cluster called ``name``; ``KeyError`` if there is none."""
        return self._by_name["cluster"][name]


# ---------------------------------------------------------------------------------------------
# Public entry points


#: The largest config file read (bytes).
MAX_CONFIG_BYTES = 16 << 20


def load_config(path):
    """Read and validate the TOML config file at ``path``.

    A missing or unreadable file, invalid TOML, or any invalid setting raises ``ConfigError``
    naming the file.
    """
    source = str(path)
    try:
        with open(path, "rb") as f:
            # Read one byte more than a config may hold: a device or a huge file is refused,
            # not read into memory.
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{source}: not a config file: larger than "
                              f"{MAX_CONFIG_BYTES // (1 << 20)} MiB")
        data = tomllib.loads(raw.decode("utf-8"))
    except RecursionError:
        raise ConfigError(f"{source}: invalid TOML: nested too deeply") from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read the config file: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: invalid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: invalid TOML: not UTF-8 text ({exc.reason} at byte "
                          f"{exc.start})") from None
    return parse_config(data, source)


def parse_config(data, source="<config>"):
    """Validate an already-parsed config mapping (the TOML document) into a :class:`Config`.

    ``source`` names where the data came from in error messages.
    """
    if not isinstance(data, dict):
        raise _invalid(source, "(top level)", data, "a table")
    _check_keys(source, "", data, _TOP_KEYS)
    resources = _parse_resources(source, data)
    engine = _parse_engine(source, _table(source, "engine", data.get("engine", {})))
    storage = _parse_storage(source, _table(source, "storage", data.get("storage", {})))

    clusters_table = _table(source, "clusters", data.get("clusters"), required=True)
    if not clusters_table:
        raise _invalid(source, "clusters", clusters_table, "at least one [clusters.NAME] table")
    if len(clusters_table) > MAX_CLUSTERS:
        raise ConfigError(
            f"{source}: clusters: {len(clusters_table)} clusters configured; "
            f"allowed: at most {MAX_CLUSTERS}"
        )
    clusters = tuple(
        _parse_cluster(source, resources, name, table) for name, table in clusters_table.items()
    )
    cluster_names = tuple(c.name for c in clusters)
    transport = _parse_transport(source, _table(source, "transport", data.get("transport", {})))
    security = _parse_security(source, _table(source, "security", data.get("security", {})),
                               cluster_names)
    status = _parse_status(source, _table(source, "status", data.get("status", {})))
    supervisor = _parse_supervisor(source, _table(source, "supervisor",
                                                  data.get("supervisor", {})))

    worker = _parse_worker(source, resources, _table(source, "worker", data.get("worker", {})))

    queues_table = _table(source, "queues", data.get("queues", {}))
    queues = [
        _build_queue(source, resources, cluster_names, _check_name(source, "queues", name), table)
        for name, table in queues_table.items()
    ]
    tenant_defaults = _parse_tenant(
        source, "tenant_defaults", None,
        _table(source, "tenant_defaults", data.get("tenant_defaults", {})), TenantConfig())
    tenants_table = _table(source, "tenants", data.get("tenants", {}))
    tenants = tuple(
        _parse_tenant(source, f"tenants.{name}", name, table, tenant_defaults)
        for name, table in tenants_table.items())
    if engine.default_queue not in queues_table:
        if engine.default_queue != "default":
            raise _invalid(
                source,
                "engine.default_queue",
                engine.default_queue,
                f"a configured queue ({_listing(queues_table)}), or 'default' for an "
                f"implicit default queue" if queues_table else
                "'default' (no queues are configured: an implicit default queue)",
            )
        queues.append(_build_queue(source, resources, cluster_names, "default", {}))
    _check_admission(source, engine, clusters, queues)
    _check_ports(source, transport, status)
    return Config(
        source=source,
        resources=resources,
        clusters=clusters,
        queues=tuple(queues),
        engine=engine,
        storage=storage,
        transport=transport,
        security=security,
        worker=worker,
        status=status,
        supervisor=supervisor,
        tenants=tenants,
        tenant_defaults=tenant_defaults,
    )


def update_queue(existing, changes, config, source="<queue update>"):
    """Validate a live change to one queue and return the updated :class:`QueueConfig`.

    ``changes`` uses the keys of a ``[queues.NAME]`` table; keys not given keep their current
    value. A queue cannot be renamed. ``max_resources`` and ``max_accelerators`` each replace
    their part of the budget when given: the current budget's device entries count as its
    ``max_accelerators`` and the others as its ``max_resources``. Nothing is changed on error.
    """
    path = f"queues.{existing.name}"
    if not isinstance(changes, dict):
        raise _invalid(source, path, changes, "a table of queue settings")
    changes = dict(changes)
    if "name" in changes:
        new_name = changes.pop("name")
        if new_name != existing.name:
            raise _invalid(
                source, f"{path}.name", new_name,
                f"{existing.name!r} (a queue cannot be renamed)",
            )
    cluster_names = tuple(c.name for c in config.clusters)
    queue = _build_queue(source, config.resources, cluster_names, existing.name, changes,
                         existing)
    _check_admission(source, config.engine, config.clusters, (queue,))
    return queue


def _check_admission(source, engine, clusters, queues):
    """Refuse what node-aware admission does not support (docs/nodes.md), naming the key,
    instead of approximating it: the resource gate off (nothing would place pods)."""
    by_nodes = [c.name for c in clusters if c.admission == "nodes"]
    if not by_nodes:
        return
    if engine.resource_gate != "enforce":
        raise ConfigError(
            f"{source}: clusters.{by_nodes[0]}.admission: 'nodes' is invalid with "
            f"engine.resource_gate = {engine.resource_gate!r}; allowed: admission = 'nodes' "
            f"only with resource_gate = 'enforce'"
        )


# ---------------------------------------------------------------------------------------------
# Sections


def _parse_resources(source, data):
    if "resources" not in data:
        raise ConfigError(
            f"{source}: resources: missing; allowed: a non-empty list of resource names, "
            'e.g. ["cpu", "memory", "gpu:H100"]'
        )
    names = data["resources"]
    allowed = 'a non-empty list of resource names, e.g. ["cpu", "memory", "gpu:H100"]'
    if not isinstance(names, list) or not names:
        raise _invalid(source, "resources", names, allowed)
    try:
        return ResourceSet(tuple(names))
    except ValueError as exc:
        raise ConfigError(f"{source}: resources: {exc}") from exc


def _parse_engine(source, table):
    if "backfill_percentile" in table:
        # Issue 14: predictions are no longer one percentile per task (docs/predictions.md).
        raise ConfigError(f"{source}: engine.backfill_percentile was removed: backfill "
                          f"predicts from runtime estimates, max_runtime and the last two "
                          f"successes of each task and shape (docs/predictions.md); "
                          f"delete the key")
    if "backfill_max_candidates" in table:
        # Issue 14: a fixed number of backfill tests per head cost mean wait on deep queues.
        raise ConfigError(f"{source}: engine.backfill_max_candidates was removed: every "
                          f"action the tick examines is tested for backfill, so the work is "
                          f"bounded by engine.max_candidates per queue per tick "
                          f"(docs/architecture.md, \"Backfill\"); delete the key")
    _check_keys(source, "engine", table, _ENGINE_KEYS)
    values = {}
    if "default_queue" in table:
        values["default_queue"] = _check_name(
            source, "engine.default_queue", table["default_queue"], key_is_name=False
        )
    for key, minimum in (("max_candidates", 1), ("eta_horizon", 1)):
        if key in table:
            values[key] = _int(source, f"engine.{key}", table[key], minimum)
    # Rows of the action table and of the dispatch channel are int32 indices.
    for key, minimum in (("dispatch_capacity", 1), ("initial_capacity", 16)):
        if key in table:
            values[key] = _int(source, f"engine.{key}", table[key], minimum,
                               maximum=(MAX_INT32, "rows are int32"))
    if "resource_gate" in table:
        values["resource_gate"] = _choice(
            source, "engine.resource_gate", table["resource_gate"], RESOURCE_GATES
        )
    for key, minimum in (("expiry_missed_beats", 1), ("system_retries", 0)):
        if key in table:
            values[key] = _int(source, f"engine.{key}", table[key], minimum)
    if "max_node_pods" in table:
        values["max_node_pods"] = _int(
            source, "engine.max_node_pods", table["max_node_pods"], 1,
            maximum=(MAX_NODE_PODS, "4 bytes a pod in every action row and record"))
    for key, positive in (("heartbeat_interval", True), ("expiry_jitter", False),
                          ("runtime_grace", False), ("finalize_timeout", True)):
        if key in table:
            values[key] = _seconds(source, f"engine.{key}", table[key], positive)
    if "pause_on_expiry" in table:
        values["pause_on_expiry"] = _parse_bool(source, "engine.pause_on_expiry",
                                                table["pause_on_expiry"])
    out = replace(EngineSettings(), **values)
    ttl = out.heartbeat_interval * out.expiry_missed_beats + out.expiry_jitter
    if ttl > MAX_SECONDS:
        key = next(k for k in ("expiry_missed_beats", "heartbeat_interval", "expiry_jitter")
                   if k in table)
        raise _invalid(source, f"engine.{key}", table[key],
                       f"heartbeat_interval x expiry_missed_beats + expiry_jitter (the lease "
                       f"ttl, {ttl}s here) {_MAX_SECONDS_RULE}")
    return out


def _parse_storage(source, table):
    _check_keys(source, "storage", table, _STORAGE_KEYS)
    values = {}
    if "path" in table:
        values["path"] = _dir_path(source, "storage.path", table["path"])
    if "shard" in table:
        values["shard"] = _check_name(source, "storage.shard", table["shard"], key_is_name=False)
    if "partitions" in table:
        values["partitions"] = _int(source, "storage.partitions", table["partitions"], 1)
        if values["partitions"] > MAX_PARTITIONS:
            raise _invalid(source, "storage.partitions", table["partitions"],
                           f"an integer from 1 to {MAX_PARTITIONS}")
    for key in ("map_size", "max_map_size"):
        if key in table:
            try:
                values[key] = int(parse_quantity("memory", BYTES, table[key]))
            except ValueError as exc:
                raise _invalid(source, f"storage.{key}", table[key],
                               f"a size in bytes such as \"1Gi\" ({exc})") from None
            if values[key] < 1 << 20:
                raise _invalid(source, f"storage.{key}", table[key], "a size of at least 1Mi")
    if "sync" in table:
        if not isinstance(table["sync"], bool):
            raise _invalid(source, "storage.sync", table["sync"], "true or false")
        values["sync"] = table["sync"]
    if "claim_ttl" in table:
        values["claim_ttl"] = _seconds(source, "storage.claim_ttl", table["claim_ttl"], True)
    if "retention" in table:
        values["retention"] = _duration(source, "storage.retention", table["retention"])
    out = replace(StorageSettings(), **values)
    if out.max_map_size < out.map_size:
        if "max_map_size" not in table:
            raise _invalid(source, "storage.map_size", table["map_size"],
                           f"a size <= storage.max_map_size ({out.max_map_size} bytes, its "
                           f"default)")
        raise _invalid(source, "storage.max_map_size", table["max_map_size"],
                       f"a size >= storage.map_size ({out.map_size} bytes)")
    return out


_STATUS_KEYS = ("dir", "interval", "metrics")
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})\Z")


def _parse_status(source, table):
    _check_keys(source, "status", table, _STATUS_KEYS)
    values = {}
    if "dir" in table:
        values["dir"] = _dir_path(source, "status.dir", table["dir"])
    if "interval" in table:
        values["interval"] = _seconds(source, "status.interval", table["interval"], False)
    if "metrics" in table:
        v = table["metrics"]
        m = _HOST_PORT.match(v) if isinstance(v, str) else None
        if v is False:
            values["metrics"] = None
        elif m is None or int(m.group(2)) > 65535:
            raise _invalid(source, "status.metrics", v,
                           '"HOST:PORT" (e.g. "127.0.0.1:9464"; port 0: any free port), '
                           "or false for no metrics endpoint")
        else:
            values["metrics"] = v
    return replace(StatusSettings(), **values)


def _parse_supervisor(source, table):
    _check_keys(source, "supervisor", table, ("start_timeout", "stop_timeout"))
    values = {key: _seconds(source, f"supervisor.{key}", table[key], True)
              for key in ("start_timeout", "stop_timeout") if key in table}
    return replace(SupervisorSettings(), **values)


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)([a-z])", re.ASCII)


def _duration(source, path, value):
    """Seconds (a number >= 0) or a string such as "7d", "12h", "30m", "45s"."""
    if isinstance(value, str):
        # ASCII digits only: float() also reads "1_0", " 7 " and other scripts' digits.
        m = _DURATION.fullmatch(value)
        unit = _DURATION_UNITS.get(m.group(2)) if m else None
        number = float(m.group(1)) if unit else None
        if (unit is None or number is None or not math.isfinite(number) or number < 0
                or number * unit > MAX_SECONDS):
            raise _invalid(source, path, value,
                           'a duration such as "7d", "12h", "30m" or "45s", or seconds, '
                           f"{_MAX_SECONDS_RULE}")
        return number * unit
    return _seconds(source, path, value, False)


#: Loop turns a shard may have decided and not yet committed (``transport.commit_pipeline``).
MAX_COMMIT_PIPELINE = 16
#: The longest ipc:// path, in bytes: a Unix socket's path (sun_path, 108 bytes with its NUL).
MAX_IPC_PATH = 107

# Other processes must reach a shard: tcp (a host name, an IPv4 address, an interface, "*",
# or a bracketed IPv6 address) or ipc, not inproc.
_ENDPOINT = re.compile(r"^(tcp://([A-Za-z0-9_.*-]+|\[[0-9A-Za-z:.%_-]+\]):[0-9]+"
                       r"|ipc://[^\s\0]+)\Z")


def tcp_host_port(endpoint):
    """``(host, port)`` of a ``tcp://[SOURCE;]HOST:PORT`` endpoint: the host dialled or bound
    (an IPv6 address without its brackets, a connect's source address dropped) and the port
    (int, None when it is not digits); None for another transport."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    host = host.rpartition(";")[2]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port) if port.isascii() and port.isdigit() else None


def _parse_transport(source, table):
    minimums = {"max_frames": 2, "max_frame_bytes": 1024, "max_header_bytes": 1024,
                "max_tokens": 1, "max_batch": 1, "max_fanout": 1, "max_name": 64,
                "max_text": 64, "hwm": 1, "max_outstanding": 1, "commit_pipeline": 1}
    _check_keys(source, "transport", table, (*minimums, "endpoints", "idle_commit_inline"))
    values = {key: _int(source, f"transport.{key}", table[key], minimums[key])
              for key in minimums if key in table}
    if "hwm" in table:
        values["hwm"] = _int(source, "transport.hwm", table["hwm"], 1,
                             maximum=(MAX_INT32, "a ZeroMQ int"))
    if "idle_commit_inline" in table:
        values["idle_commit_inline"] = _parse_bool(source, "transport.idle_commit_inline",
                                                   table["idle_commit_inline"])
    if values.get("commit_pipeline", 1) > MAX_COMMIT_PIPELINE:
        raise _invalid(source, "transport.commit_pipeline", table["commit_pipeline"],
                       f"an integer from 1 to {MAX_COMMIT_PIPELINE}")
    if "endpoints" in table:
        eps = table["endpoints"]
        if (not isinstance(eps, list) or not eps
                or not all(isinstance(e, str) and _ENDPOINT.match(e) for e in eps)):
            raise _invalid(source, "transport.endpoints", eps,
                           "a non-empty list of ZeroMQ endpoints (tcp://HOST:PORT or "
                           "ipc://PATH), one per shard")
        for i, e in enumerate(eps):
            if e.startswith("ipc://") and len(e[len("ipc://"):].encode()) > MAX_IPC_PATH:
                raise _invalid(source, "transport.endpoints", e,
                               f"an ipc path of at most {MAX_IPC_PATH} bytes (the system's "
                               f"limit for a socket's path)")
            port = tcp_host_port(e)[1] if e.startswith("tcp://") else None
            if port is not None and port > 65535:
                raise _invalid(source, "transport.endpoints", e, "a tcp port 0..65535")
            # Port 0 binds an ephemeral port: each shard gets its own.
            if eps.index(e) < i and port != 0:
                raise _invalid(source, "transport.endpoints", e,
                               f"each endpoint once (shards {eps.index(e)} and {i} would bind "
                               f"the same one)")
        values["endpoints"] = tuple(eps)
    return replace(TransportSettings(), **values)


#: Hosts that bind a port on every address of the machine.
_EVERY_ADDRESS = ("*", "0.0.0.0", "::")


def _check_ports(source, transport, status):
    """Two sockets of one config that would bind one tcp port on one address: the config
    check passed them, then the second bind failed "Address already in use" (a shard the
    supervisor restarted for ever, or the metrics). Spellings differ: a name and its address
    (``localhost``, ``127.0.0.1``), an interface and its address, every address (``*``,
    ``0.0.0.0``) and any one. Hosts are resolved only for endpoints that share a port."""
    binds = []          # (key, value, host, port)
    for i, e in enumerate(transport.endpoints):
        if e.startswith("tcp://"):
            binds.append((f"transport.endpoints[{i}]", e, *tcp_host_port(e)))
    if status.metrics is not None:
        binds.append(("status.metrics", status.metrics,
                      *tcp_host_port(f"tcp://{status.metrics}")))
    addresses = {}
    for j, (key, value, host, port) in enumerate(binds):
        for okey, ovalue, ohost, oport in binds[:j]:
            if port == 0 or port != oport:
                continue    # (port 0: any free port, a new one for each)
            mine = addresses.setdefault(host, _bind_addresses(host))
            theirs = addresses.setdefault(ohost, _bind_addresses(ohost))
            if mine is None or theirs is None:
                there = _listing(sorted(theirs)) if theirs is not None else "every address"
                here = _listing(sorted(mine)) if mine is not None else "every address"
            else:
                common = sorted(mine & theirs)
                if not common:
                    continue
                there, here = common[0], f"{common[0]} too"
            other = "no other endpoint" if key.startswith("transport") else "no endpoint"
            raise _invalid(source, key, value,
                           f"a port {other} binds on the same address ({okey} {ovalue!r} "
                           f"binds port {port} on {there}, this one on {here})")


def _bind_addresses(host):
    """The addresses a bind to ``host`` takes, as ZeroMQ resolves it (an interface's name,
    else the name's addresses, IPv4 when it has any): None for every address; the host
    itself when it does not resolve here."""
    if host in _EVERY_ADDRESS:
        return None
    import psutil

    found = psutil.net_if_addrs().get(host)
    if found:
        addrs = [(a.family, a.address.split("%")[0]) for a in found
                 if a.family in (socket.AF_INET, socket.AF_INET6)]
    else:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError):
            return {host}
        addrs = [(family, sockaddr[0].split("%")[0]) for family, _, _, _, sockaddr in infos]
    v4 = {a for family, a in addrs if family == socket.AF_INET}
    out = v4 or {a for _family, a in addrs}
    if out & {"0.0.0.0", "::"}:
        return None
    return out or {host}


_WORKER_KEYS = ("slots", "capacity", "node_shapes", "on_shard_lost", "drain_timeout",
                "kill_grace", "work_dir", "log_dir", "max_log_bytes", "default_plugin",
                "report_free")


def _parse_worker(source, resources, table):
    _check_keys(source, "worker", table, _WORKER_KEYS)
    values = {}
    if "slots" in table:
        values["slots"] = _int(source, "worker.slots", table["slots"], 0)
    if "capacity" in table or "node_shapes" in table:
        # The same rules as a cluster's (shapes without a capacity: their sum).
        sub = {k: table[k] for k in ("capacity", "node_shapes") if k in table}
        c = _parse_cluster(source, resources, "worker", sub, path="worker")
        values["capacity"] = c.capacity
        values["node_shapes"] = c.node_shapes
    if "on_shard_lost" in table:
        v = table["on_shard_lost"]
        if v not in ("reconnect", "exit"):
            raise _invalid(source, "worker.on_shard_lost", v, '"reconnect" or "exit"')
        values["on_shard_lost"] = v
    for key in ("drain_timeout", "kill_grace"):
        if key in table:
            values[key] = _seconds(source, f"worker.{key}", table[key], False)
    for key in ("work_dir", "log_dir"):
        if key in table:
            values[key] = _dir_path(source, f"worker.{key}", table[key])
    if "max_log_bytes" in table:
        v = table["max_log_bytes"]
        try:
            values["max_log_bytes"] = int(parse_quantity("memory", BYTES, v))
        except ValueError as exc:
            raise _invalid(source, "worker.max_log_bytes", v,
                           f"a size in bytes such as \"10Gi\", or 0 for no limit ({exc})"
                           ) from None
        if 0 < values["max_log_bytes"] < 1 << 10:
            raise _invalid(source, "worker.max_log_bytes", v,
                           "a size of at least 1Ki, or 0 for no limit")
    if "default_plugin" in table:
        v = table["default_plugin"]
        if not isinstance(v, str) or v not in PLUGINS:
            raise _invalid(source, "worker.default_plugin", v,
                           f"one of {', '.join(PLUGINS)} (or absent: refuse actions that "
                           f"declare no execute)")
        values["default_plugin"] = v
    if "report_free" in table:
        values["report_free"] = _parse_bool(source, "worker.report_free", table["report_free"])
    return replace(WorkerSettings(), **values)


# A tenant prefix: org, org/project or org/project/domain (engine/_model.py's segment rule).
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*){0,2}\Z")
_Z85 = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}\Z")
_SECURITY_KEYS = ("insecure", "keys_dir", "server_key", "peers")
_PEER_KEYS = ("role", "cluster", "tenants", "public_key")


def _parse_security(source, table, cluster_names):
    _check_keys(source, "security", table, _SECURITY_KEYS)
    values = {}
    if "insecure" in table:
        values["insecure"] = _parse_bool(source, "security.insecure", table["insecure"])
    if "keys_dir" in table:
        values["keys_dir"] = _dir_path(source, "security.keys_dir", table["keys_dir"])
    if "server_key" in table:
        values["server_key"] = _check_name(source, "security.server_key", table["server_key"],
                                           key_is_name=False)
    peers = _table(source, "security.peers", table.get("peers", {}))
    if values.get("insecure") and peers:
        # Keys that would silently do nothing: the choice must be one or the other.
        raise _invalid(source, "security.insecure", True,
                       "false while security.peers are configured (insecure ignores keys)")
    values["peers"] = tuple(_parse_peer(source, name, peer, cluster_names)
                            for name, peer in peers.items())
    keys = [p.public_key for p in values["peers"] if p.public_key is not None]
    for key in keys:
        if keys.count(key) > 1:
            raise _invalid(source, "security.peers", key, "each public key under one name")
    # A worker key NAME registers as worker NAME or NAME.<suffix>: a worker key named NAME.x
    # would share its worker ids (the key NAME could end its sessions).
    workers = {p.name for p in values["peers"] if p.role == "worker"}
    for name in sorted(workers):
        for at in (i for i, ch in enumerate(name) if ch == "."):
            if name[:at] in workers:
                raise ConfigError(
                    f"{source}: security.peers.{name}: worker key {name[:at]!r} may register "
                    f"as worker {name!r} (a worker key registers as its name or "
                    f"NAME.<suffix>); name worker keys so that none is another's name and a "
                    f"dot")
    return replace(SecuritySettings(), **values)


def _parse_peer(source, name, table, cluster_names):
    path = f"security.peers.{name}"
    _check_name(source, "security.peers", name)
    table = _table(source, path, table)
    _check_keys(source, path, table, _PEER_KEYS)
    if "role" not in table:
        raise ConfigError(f"{source}: {path}.role: missing; allowed: {_listing(PEER_ROLES)}")
    role = _choice(source, f"{path}.role", table["role"], PEER_ROLES)
    cluster, tenants = None, ()
    if role == "worker":
        if "cluster" not in table:
            raise ConfigError(f"{source}: {path}.cluster: missing; allowed: a configured "
                              f"cluster ({_listing(cluster_names)}) (a worker key is bound "
                              f"to one cluster)")
        cluster = table["cluster"]
        if cluster not in cluster_names:
            raise _invalid(source, f"{path}.cluster", cluster,
                           f"a configured cluster ({_listing(cluster_names)})")
    elif "cluster" in table:
        raise _invalid(source, f"{path}.cluster", table["cluster"],
                       "no cluster for a client or admin key (only a worker is bound to one)")
    if role == "client":
        value = table.get("tenants")
        allowed = ('a non-empty list of tenant prefixes "org", "org/project" or '
                   '"org/project/domain"')
        if not isinstance(value, list) or not value:
            raise _invalid(source, f"{path}.tenants", value, allowed)
        for t in value:
            if not isinstance(t, str) or not _TENANT.match(t):
                raise _invalid(source, f"{path}.tenants", t, allowed)
        tenants = tuple(dict.fromkeys(value))
    elif "tenants" in table:
        raise _invalid(source, f"{path}.tenants", table["tenants"],
                       "no tenants for a worker or admin key (only a client is bound to them)")
    public_key = table.get("public_key")
    if public_key is not None and (not isinstance(public_key, str)
                                   or not _Z85.match(public_key)):
        raise _invalid(source, f"{path}.public_key", public_key,
                       "a Z85 CURVE public key of 40 characters (leasehold keys generate)")
    return PeerConfig(name=name, role=role, cluster=cluster, tenants=tenants,
                      public_key=public_key)


_MAX_SECONDS_RULE = f"at most {MAX_SECONDS} (10 years)"


def _seconds(source, path, value, positive):
    # A positive duration is at least a microsecond: less is 0 once made nanoseconds (a
    # heartbeat interval of 5e-324 s made every lease expire as it was handed out).
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and math.isfinite(value) and (value >= 1e-6 if positive else value >= 0)
          and value <= MAX_SECONDS)
    if not ok:
        raise _invalid(source, path, value,
                       "a number of seconds " + (">= 0.000001" if positive else ">= 0")
                       + f" and {_MAX_SECONDS_RULE}")
    return float(value)


def _parse_cluster(source, resources, name, table, path=None):
    # ``path``: where the table is in the file (the worker's own capacity is "worker").
    path = path or f"clusters.{name}"
    _check_name(source, "clusters", name)
    table = _table(source, path, table)
    _check_keys(source, path, table, _CLUSTER_KEYS)

    shapes_list = table.get("node_shapes", [])
    if not isinstance(shapes_list, list):
        raise _invalid(
            source, f"{path}.node_shapes", shapes_list, "a list of [[node_shapes]] tables"
        )
    shapes = []
    seen = set()
    for i, shape_table in enumerate(shapes_list):
        shape = _parse_shape(source, resources, name, i, shape_table, path)
        if shape.name in seen:
            raise _invalid(
                source, f"{path}.node_shapes[{i}].name", shape.name,
                "a name not used by another node shape of this cluster",
            )
        seen.add(shape.name)
        shapes.append(shape)

    if "capacity" in table:
        capacity = _vector(source, f"{path}.capacity", resources, table["capacity"], unset=0)
    elif shapes:
        totals = [
            sum(s.count * int(s.allocatable[r]) for s in shapes) for r in range(len(resources))
        ]
        for r, total in enumerate(totals):
            if total > UNLIMITED:
                raise ConfigError(
                    f"{source}: {path}.node_shapes: the derived {resources.names[r]} capacity "
                    f"{total} is too large; allowed: at most {UNLIMITED}"
                )
        capacity = _frozen(np.array(totals, dtype=np.int64))
    else:
        capacity = None
    admission = "shapes"
    if "admission" in table:
        admission = _choice(source, f"{path}.admission", table["admission"], ADMISSION_MODES)
        if admission == "nodes" and not shapes:
            raise ConfigError(
                f"{source}: {path}.admission: 'nodes' needs the cluster's nodes; allowed: "
                f"admission = 'nodes' only with [[{path}.node_shapes]] (each with a count), "
                f"else 'shapes'"
            )
        nodes = sum(s.count for s in shapes)
        if admission == "nodes" and nodes > MAX_NODES:
            # Each node is a row of the shard's node table, made at start.
            raise ConfigError(
                f"{source}: {path}.node_shapes: {nodes} nodes in all; allowed: at most "
                f"{MAX_NODES} nodes a cluster with admission = 'nodes' (each is tracked), "
                f"or admission = 'shapes'"
            )
    return ClusterConfig(name=name, capacity=capacity, node_shapes=tuple(shapes),
                         admission=admission)


#: Nodes a cluster with admission = "nodes" may have (each is a row of the node table).
MAX_NODES = 100_000


def _parse_shape(source, resources, cluster, i, table, where):
    path = f"{where}.node_shapes[{i}]"
    table = _table(source, path, table)
    _check_keys(source, path, table, _SHAPE_KEYS)
    name = (
        _check_name(source, f"{path}.name", table["name"], key_is_name=False)
        if "name" in table else f"{cluster}-{i}"
    )
    if "count" not in table:
        raise ConfigError(f"{source}: {path}.count: missing; allowed: an integer >= 1")
    count = _int(source, f"{path}.count", table["count"], 1)
    if "allocatable" not in table:
        raise ConfigError(
            f"{source}: {path}.allocatable: missing; allowed: a table of resource = quantity"
        )
    allocatable = table["allocatable"]
    if isinstance(allocatable, dict) and not allocatable:
        raise _invalid(
            source, f"{path}.allocatable", allocatable,
            f"a non-empty table of resource = quantity ({_listing(resources.names)})",
        )
    vec = _vector(source, f"{path}.allocatable", resources, allocatable, unset=0)
    return NodeShape(name=name, count=count, allocatable=vec)


def _build_queue(source, resources, cluster_names, name, table, existing=None):
    """A queue from its table; keys not given take ``existing``'s values, else the defaults."""
    path = f"queues.{name}"
    table = _table(source, path, table)
    _check_keys(source, path, table, _QUEUE_KEYS)
    parsers = {
        "priority": _parse_priority,
        "scheduling": lambda s, p, v: _choice(s, p, v, SCHEDULING_POLICIES),
        "run_concurrency": lambda s, p, v: _int(s, p, v, 0),
        "action_concurrency": lambda s, p, v: _int(s, p, v, 0),
        "depth": lambda s, p, v: _int(s, p, v, 1),
        "clusters": lambda s, p, v: _parse_queue_clusters(s, p, v, cluster_names),
        "backfill": _parse_bool,
        "paused": _parse_bool,
        "draining": _parse_bool,
    }
    defaults = {
        "priority": PRIORITY_NAMES["MEDIUM"],
        "scheduling": STRICT_FIFO,
        "run_concurrency": 0,
        "action_concurrency": 0,
        "depth": _DEFAULT_DEPTH,
        "clusters": tuple(cluster_names),
        "backfill": False,
        "paused": False,
        "draining": False,
    }
    values = {}
    for key, parse in parsers.items():
        if key in table:
            values[key] = parse(source, f"{path}.{key}", table[key])
        elif existing is not None:
            values[key] = getattr(existing, key)
        else:
            values[key] = defaults[key]
    if values["backfill"] and values["scheduling"] != STRICT_FIFO:
        raise ConfigError(
            f"{source}: {path}.backfill: true is invalid with scheduling "
            f"{values['scheduling']}; allowed: backfill = true only with scheduling = "
            f"{STRICT_FIFO} (queue {name!r})"
        )
    base = existing.max_resources if existing is not None else None
    budget = _parse_budget(source, path, resources, table, base=base)
    return QueueConfig(name=name, max_resources=budget, **values)


def _parse_tenant(source, path, name, table, defaults):
    """One tenant's caps (``name`` None: the defaults); a key not given takes ``defaults``'
    value."""
    if name is not None and (not isinstance(name, str) or not _TENANT_NAME.match(name)):
        raise _invalid(source, path, name,
                       "a tenant name (the first segment of an action id: letters, digits, "
                       "'_', '.', '-', starting with a letter or digit)")
    table = _table(source, path, table)
    _check_keys(source, path, table, _TENANT_KEYS)
    values = {key: _int(source, f"{path}.{key}", table[key], 0) if key in table
              else getattr(defaults, key) for key in _TENANT_KEYS}
    return TenantConfig(name=name, **values)


def _parse_bool(source, path, value):
    if not isinstance(value, bool):
        raise _invalid(source, path, value, "true or false")
    return value


def _parse_priority(source, path, value):
    allowed = f"an integer 0..{MAX_PRIORITY} or {', '.join(PRIORITY_NAMES)}"
    if isinstance(value, str):
        if value in PRIORITY_NAMES:
            return PRIORITY_NAMES[value]
        raise _invalid(source, path, value, allowed)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(source, path, value, allowed)
    if not 0 <= value <= MAX_PRIORITY:
        raise _invalid(source, path, value, allowed)
    return value


def _parse_queue_clusters(source, path, value, cluster_names):
    allowed = (
        f'["*"] (all clusters) or a non-empty list of cluster names ({_listing(cluster_names)})'
    )
    if not isinstance(value, list) or not value:
        raise _invalid(source, path, value, allowed)
    if value == [_ALL_CLUSTERS]:
        return tuple(cluster_names)
    seen = []
    for name in value:
        if name == _ALL_CLUSTERS:
            raise _invalid(source, path, value, '"*" alone, or cluster names without "*"')
        if name not in cluster_names:
            raise _invalid(source, path, name, f"a configured cluster ({_listing(cluster_names)})")
        if name in seen:
            raise _invalid(source, path, name, "each cluster named once")
        seen.append(name)
    return tuple(seen)


def _parse_budget(source, path, resources, table, base):
    """Merge ``max_resources`` and ``max_accelerators`` into one int64 budget vector.

    Resources no table limits are UNLIMITED. With ``base`` (a live update), a table that is not
    given keeps its part of ``base``: device entries for ``max_accelerators``, the others for
    ``max_resources``.
    """
    devices = np.array([resources.kind(n) == DEVICE for n in resources.names], dtype=bool)
    budget = np.full(len(resources), UNLIMITED, dtype=np.int64)
    if base is not None:
        if "max_resources" not in table:
            budget[~devices] = base[~devices]
        if "max_accelerators" not in table:
            budget[devices] = base[devices]

    given = np.zeros(len(resources), dtype=bool)
    if "max_resources" in table:
        vec = _vector(source, f"{path}.max_resources", resources, table["max_resources"], unset=-1)
        given = vec >= 0
        budget[given] = vec[given]
    if "max_accelerators" in table:
        key = f"{path}.max_accelerators"
        accel = _table(source, key, table["max_accelerators"])
        device_names = [n for n, d in zip(resources.names, devices, strict=True) if d]
        for name in accel:
            if name not in device_names:
                raise _invalid(
                    source, key, name,
                    f"a configured device resource ({_listing(device_names) or 'none configured'})",
                )
        vec = _vector(source, key, resources, accel, unset=-1, flyte_spellings=False)
        for r in np.flatnonzero(vec >= 0):
            if given[r]:
                raise _invalid(
                    source, key, resources.names[r],
                    "a device not also limited in max_resources (give each device once)",
                )
            budget[r] = vec[r]
    return _frozen(budget)


# ---------------------------------------------------------------------------------------------
# Small checks


def _invalid(source, path, value, allowed):
    return ConfigError(f"{source}: {path}: {value!r} is invalid; allowed: {allowed}")


def _listing(names):
    return ", ".join(str(n) for n in names)


def _check_keys(source, path, table, allowed):
    for key in table:
        if key not in allowed:
            where = f"{path}.{key}" if path else key
            raise ConfigError(
                f"{source}: {where}: unknown key {key!r}; allowed keys: {_listing(allowed)}"
            )


def _table(source, path, value, required=False):
    if value is None and required:
        raise ConfigError(f"{source}: {path}: missing; allowed: a table")
    if not isinstance(value, dict):
        raise _invalid(source, path, value, "a table")
    return value


def _check_name(source, path, name, key_is_name=True):
    """Validate a cluster/queue/shape name; ``path`` is its parent table (or its own key)."""
    if not isinstance(name, str) or not _NAME.match(name):
        where = f"{path}.{name}" if key_is_name and isinstance(name, str) and name else path
        raise _invalid(source, where, name, _NAME_RULE)
    return name


def _int(source, path, value, minimum, maximum=None):
    """An integer >= ``minimum``; ``maximum``, when given, is ``(bound, why)``."""
    allowed = (f"an integer >= {minimum}" if maximum is None
               else f"an integer from {minimum} to {maximum[0]} ({maximum[1]})")
    top = UNLIMITED if maximum is None else maximum[0]
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(source, path, value, allowed)
    if value < minimum or value > top:
        raise _invalid(source, path, value, allowed)
    return value


def _dir_path(source, path, value):
    """A directory path: a non-empty string without a NUL byte (no system call takes one)."""
    if not isinstance(value, str) or not value or "\0" in value:
        raise _invalid(source, path, value, "a non-empty directory path (no NUL byte)")
    return value


def _choice(source, path, value, choices):
    if not isinstance(value, str) or value not in choices:
        raise _invalid(source, path, value, _listing(choices))
    return value


def _vector(source, path, resources, mapping, unset, flyte_spellings=True):
    """A ``{resource: quantity}`` table as a read-only int64 vector (``unset`` where absent).

    Entries are parsed one by one so that errors name the entry; a resource given twice (e.g.
    ``memory`` and ``mem``) is refused.
    """
    mapping = _table(source, path, mapping)
    vec = np.full(len(resources), unset, dtype=np.int64)
    given = set()
    for key, value in mapping.items():
        if isinstance(value, float) and value != value:  # NaN
            raise _invalid(source, f"{path}.{key}", value, "a non-negative quantity")
        try:
            one = resources.vector({key: value}, unset=-1, flyte_spellings=flyte_spellings)
        except ValueError as exc:
            # Name the entry; drop the resource name the message already starts with.
            head, _, rest = str(exc).partition(": ")
            msg = rest if rest and (head == key or head in resources.names) else str(exc)
            raise ConfigError(f"{source}: {path}.{key}: {msg}") from exc
        r = int(np.flatnonzero(one >= 0)[0])
        if r in given:
            raise _invalid(
                source, f"{path}.{key}", value,
                f"each resource once ({resources.names[r]!r} is already given)",
            )
        given.add(r)
        vec[r] = one[r]
    return _frozen(vec)


def _frozen(arr):
    arr.flags.writeable = False
    return arr
