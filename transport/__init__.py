"""Leasehold on the wire: the ZeroMQ protocol (``docs/protocol.md``), CURVE keys and the
authorisation of peers (``docs/security.md``), and the socket setup shared by the shard,
its workers and its clients; the shard loop (``docs/shard.md``), the worker side of the
protocol and the client; the shard's shared-memory status and the Prometheus metrics read
from it (``docs/status.md``); the supervisor and how shards share out the data, and the
devbox with its example workload (``docs/operations.md``, ``docs/devbox.md``)."""

import importlib

from transport._auth import (
    ADMIN,
    CLIENT,
    INSECURE,
    INSECURE_PEER,
    WORKER,
    Authenticator,
    Peer,
    PermissionDenied,
    Unauthenticated,
    authorize,
    peer_of,
    visible_metrics,
)
from transport._client import Client, WatchLost
from transport._daemon import Worker, measured_capacity, run_worker
from transport._keys import (
    ClientKeys,
    Keyring,
    generate_keypair,
    load_client_keys,
    load_keyring,
    load_public_key,
    load_secret_key,
)
from transport._metrics import MetricsServer, StatusCollector, serve_metrics
from transport._plugins import (
    Attempt,
    Change,
    Outcome,
    Plugin,
    PluginError,
    Pod,
    UserError,
    make_plugins,
)
from transport._pool import PoolInfo, PythonPlugin
from transport._process_plugin import ProcessPlugin
from transport._protocol import (
    ERROR_CODES,
    TOKEN_DTYPE,
    VERSION,
    Abort,
    Bye,
    Decoder,
    Enqueue,
    EnqueueFanout,
    EnqueueFlyte,
    Error,
    Event,
    Events,
    Explain,
    Heartbeat,
    Leases,
    Message,
    MsgType,
    Ping,
    ProtocolError,
    QueueMetrics,
    QueueUpdate,
    Refused,
    Register,
    Registered,
    Reply,
    Report,
    Status,
    Unwatch,
    Watch,
    decode,
    encode,
    tokens_array,
)
from transport._shard import Shard
from transport._shards import shard_config, shard_store_path, tenant_shard
from transport._sim_plugin import SimPlugin
from transport._sockets import client_socket, recv, send, server_socket
from transport._status import (
    ClusterStatus,
    HeadBlocked,
    Histogram,
    QueueStatus,
    StatusBusy,
    StatusError,
    StatusLayoutError,
    StatusReader,
    StatusSnapshot,
    StatusWriter,
    snapshot_dict,
    status_path,
)
from transport._supervisor import (
    MAX_FAILURES,
    STABLE_S,
    Supervisor,
    SupervisorError,
    run_supervisor,
)
from transport._watch import WatchLog
from transport._worker import Lease, ShardError, ShardTimeout, WorkerConnection

__all__ = [
    "Supervisor",
    "SupervisorError",
    "run_supervisor",
    "STABLE_S",
    "MAX_FAILURES",
    "shard_config",
    "shard_store_path",
    "tenant_shard",
    "Devbox",
    "DevboxError",
    "run_devbox",
    "ExampleWorkload",
    "WorkloadFailed",
    "Attempt",
    "Change",
    "Outcome",
    "Plugin",
    "PluginError",
    "Pod",
    "UserError",
    "PoolInfo",
    "ProcessPlugin",
    "PythonPlugin",
    "SimPlugin",
    "make_plugins",
    "Worker",
    "measured_capacity",
    "run_worker",
    "Client",
    "Lease",
    "Shard",
    "ShardError",
    "ShardTimeout",
    "WatchLog",
    "WatchLost",
    "WorkerConnection",
    "StatusWriter",
    "StatusReader",
    "StatusSnapshot",
    "QueueStatus",
    "ClusterStatus",
    "HeadBlocked",
    "Histogram",
    "StatusError",
    "StatusLayoutError",
    "StatusBusy",
    "status_path",
    "snapshot_dict",
    "StatusCollector",
    "MetricsServer",
    "serve_metrics",
    "ADMIN",
    "CLIENT",
    "INSECURE",
    "INSECURE_PEER",
    "WORKER",
    "Authenticator",
    "ClientKeys",
    "Keyring",
    "Peer",
    "PermissionDenied",
    "Unauthenticated",
    "authorize",
    "client_socket",
    "generate_keypair",
    "load_client_keys",
    "load_keyring",
    "load_public_key",
    "load_secret_key",
    "peer_of",
    "recv",
    "send",
    "server_socket",
    "visible_metrics",
    "ERROR_CODES",
    "TOKEN_DTYPE",
    "VERSION",
    "Abort",
    "Bye",
    "Decoder",
    "Enqueue",
    "EnqueueFanout",
    "EnqueueFlyte",
    "Error",
    "Event",
    "Events",
    "Explain",
    "Heartbeat",
    "Leases",
    "Message",
    "MsgType",
    "Ping",
    "ProtocolError",
    "QueueMetrics",
    "QueueUpdate",
    "Refused",
    "Register",
    "Registered",
    "Reply",
    "Report",
    "Status",
    "Unwatch",
    "Watch",
    "decode",
    "encode",
    "tokens_array",
]

# The devbox and its workload pull in rich's live display, which no shard or worker process
# needs: they are imported on first use.
_LAZY = {"Devbox": "transport._devbox", "DevboxError": "transport._devbox",
         "run_devbox": "transport._devbox", "ExampleWorkload": "transport._workload",
         "WorkloadFailed": "transport._workload"}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'transport' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
