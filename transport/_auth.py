"""Who is on the other end, and what they may do (``docs/security.md``).

Every connection to a shard is CURVE: its public key is checked during the handshake by a
ZAP handler (:class:`Authenticator`, pyzmq's ``zmq.auth`` thread) against the shard's
:class:`~transport._keys.Keyring`. An unknown key is refused there, so nothing it sends ever
reaches the shard; it is counted. An accepted connection's messages carry the ZAP User-Id,
the key's name, which :func:`peer_of` turns into the :class:`Peer` that sent them, and
:func:`authorize` says whether that peer may send that message.
"""

import logging
import threading
from dataclasses import dataclass, field

import zmq
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator

from engine._errors import LeaseholdError
from transport import _protocol as p

__all__ = [
    "check_tenants",
    "message_keys",
    "WORKER",
    "CLIENT",
    "ADMIN",
    "INSECURE",
    "ZAP_DOMAIN",
    "Peer",
    "INSECURE_PEER",
    "Unauthenticated",
    "PermissionDenied",
    "Authenticator",
    "peer_of",
    "authorize",
    "visible_metrics",
]

WORKER, CLIENT, ADMIN = "worker", "client", "admin"
#: The role of every peer of a shard run with ``insecure = true`` (no keys, no checks).
INSECURE = "insecure"
#: The ZAP domain of a shard's sockets (the authenticator answers for this domain only).
ZAP_DOMAIN = "leasehold"

log = logging.getLogger("leasehold.auth")


class Unauthenticated(LeaseholdError):
    """A message whose sender the shard cannot name (no ZAP User-Id, or an unknown one)."""

    code = "UNAUTHENTICATED"


class PermissionDenied(LeaseholdError):
    """The sender's role does not allow this message; nothing was done."""

    code = "PERMISSION_DENIED"


@dataclass(frozen=True)
class Peer:
    """An authenticated key: its ``role`` (worker, client, admin, or insecure), its
    ``name`` in the config, the ``cluster`` of a worker and the ``tenants`` of a client
    (prefixes ``org``, ``org/project`` or ``org/project/domain``)."""

    role: str
    name: str
    cluster: str | None = None
    tenants: tuple = ()
    _prefixes: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_prefixes", tuple(
            (tuple(t.split("/")), len(t.split("/"))) for t in self.tenants))

    def owns(self, key):
        """Whether an action id or run key ``key`` (``tenant/project/domain/run[/action]``)
        is inside this peer's tenants (segment by segment: ``acme`` does not own
        ``acme2/...``). Admin and insecure peers own everything."""
        if self.role in (ADMIN, INSECURE):
            return True
        if self.role != CLIENT:
            return False
        parts = tuple(key.split("/", 3)[:3])
        return any(parts[:n] == prefix for prefix, n in self._prefixes)


#: The peer behind every message of a shard run with ``insecure = true``.
INSECURE_PEER = Peer(role=INSECURE, name="insecure")


def _a(role):
    # "an admin key", "a worker key"
    return f"an {role}" if role[:1] in "aeiou" else f"a {role}"


class _Zap(ThreadAuthenticator):
    """pyzmq's ZAP thread, naming each connection by its key's name (the User-Id)."""

    def __init__(self, context, keyring, owner):
        super().__init__(context)
        self._keyring = keyring
        self._owner = owner

    def curve_user_id(self, client_public_key):
        peer = self._keyring.peer_of_key(zmq.utils.z85.encode(client_public_key))
        return peer.name    # only called for a key callback() accepted


class _Keys:
    """The credentials provider: is this Z85 public key in the keyring? Counts both ways."""

    def __init__(self, keyring, owner):
        self._keyring = keyring
        self._owner = owner

    def callback(self, domain, key):
        if self._keyring.peer_of_key(key) is not None:
            self._owner._count(True, key)
            return True
        self._owner._count(False, key)
        return False


class Authenticator:
    """The ZAP handler of one ZeroMQ context: accepts a CURVE handshake only for a public
    key in ``keyring`` and gives its connection the key's name as User-Id. Start it before
    binding a CURVE ROUTER in that context (without a handler libzmq accepts any key), stop
    it after closing the sockets. ``accepted`` and ``refused`` count handshakes; each
    unknown key is logged once (a retrying stranger is counted, not logged every time)."""

    _LOGGED_KEYS = 1024     # unknown keys remembered for log-once (bounded: a flood of keys)

    def __init__(self, context, keyring, domain=ZAP_DOMAIN):
        self.keyring = keyring
        self.domain = domain
        self._lock = threading.Lock()
        self._accepted = 0
        self._refused = 0
        self._seen = set()
        self._zap = _Zap(context, keyring, self)
        self._running = False

    def start(self):
        """Bind the ZAP socket and start its thread."""
        self._zap.start()
        self._zap.configure_curve_callback(self.domain, credentials_provider=_Keys(
            self.keyring, self))
        self._running = True
        return self

    def stop(self):
        """Stop the thread and close its socket (idempotent)."""
        if self._running:
            self._running = False
            self._zap.stop()

    @property
    def running(self):
        """Whether the handler is serving."""
        return self._running and self._zap.is_alive()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    @property
    def accepted(self):
        """Handshakes accepted so far."""
        return self._accepted

    @property
    def refused(self):
        """Handshakes refused (unknown public key) so far."""
        return self._refused

    def _count(self, ok, key):
        with self._lock:
            if ok:
                self._accepted += 1
                return
            self._refused += 1
            first = key not in self._seen and len(self._seen) < self._LOGGED_KEYS
            if first:
                self._seen.add(key)
        if first:
            log.warning("refused a CURVE handshake from unknown public key %s",
                        key.decode("ascii", "replace"))


def peer_of(frame, keyring):
    """The :class:`Peer` that sent a message, from one of its frames (received with
    ``copy=False``: a ``zmq.Frame`` carries the connection's ZAP User-Id). ``keyring`` None
    (insecure) gives :data:`INSECURE_PEER`. Raises :class:`Unauthenticated` when the frame
    has no User-Id or names no configured key."""
    if keyring is None:
        return INSECURE_PEER
    try:
        user = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        raise Unauthenticated("the message carries no ZAP User-Id (not authenticated)") \
            from None
    peer = keyring.peer_named(user)
    if peer is None:
        raise Unauthenticated(f"User-Id {user!r} names no configured key")
    return peer


_CLIENT_TYPES = frozenset({
    p.MsgType.ENQUEUE, p.MsgType.ENQUEUE_FANOUT, p.MsgType.ENQUEUE_FLYTE, p.MsgType.ABORT,
    p.MsgType.STATUS, p.MsgType.EXPLAIN, p.MsgType.QUEUE_METRICS, p.MsgType.WATCH,
    p.MsgType.UNWATCH,
})
_WORKER_TYPES = frozenset({p.MsgType.REGISTER, p.MsgType.HEARTBEAT, p.MsgType.REPORT,
                           p.MsgType.BYE})
_ADMIN_TYPES = frozenset({p.MsgType.QUEUE_UPDATE})
_ANY_TYPES = frozenset({p.MsgType.PING})


def message_keys(msg):
    """The action ids and run keys a client message names (an enqueued spec's id and
    parent, a fan-out template's, ABORT/EXPLAIN's action, STATUS's actions, WATCH/UNWATCH's
    run); empty for the others. ENQUEUE_FLYTE names its actions only once decoded."""
    t = msg.TYPE
    if t == p.MsgType.ENQUEUE:
        out = []
        for spec in msg.specs:
            out.append(spec["id"])
            if spec.get("parent") is not None:
                out.append(spec["parent"])
        return out
    if t == p.MsgType.ENQUEUE_FANOUT:
        parent = msg.template.get("parent")
        return [msg.template["id"]] + ([parent] if parent is not None else [])
    if t in (p.MsgType.ABORT, p.MsgType.EXPLAIN):
        return [msg.action]
    if t == p.MsgType.STATUS:
        return msg.actions
    if t in (p.MsgType.WATCH, p.MsgType.UNWATCH):
        return [msg.run]
    return []


def check_tenants(peer, what, keys):
    """Raise :class:`PermissionDenied` unless ``peer`` owns every action id or run key of
    ``keys`` (what a client message names only once decoded, such as Flyte enqueues)."""
    for key in keys:
        if not peer.owns(key):
            raise PermissionDenied(f"{what}: {key} is outside the tenants of key "
                                   f"{peer.name!r} ({', '.join(peer.tenants)})")


def authorize(peer, msg):
    """Whether ``peer`` may send ``msg`` (a decoded message) to a shard; raises
    :class:`PermissionDenied` naming why not. The rules:

    - PING: anyone;
    - ENQUEUE, ENQUEUE_FANOUT, ABORT, STATUS, EXPLAIN, WATCH, UNWATCH: a client, for
      actions and runs of its tenants only (an enqueued spec's id and parent both), or an
      admin (every tenant); QUEUE_METRICS: a client or an admin; ENQUEUE_FLYTE: a client
      or an admin here, its actions' tenants checked by the shard once it decoded them
      (:func:`check_tenants`);
    - QUEUE_UPDATE: an admin;
    - REGISTER: a worker, for its own cluster and as worker id its key's name or
      ``NAME.<suffix>``; HEARTBEAT, REPORT, BYE: a worker (that it holds the tokens it
      presents is the engine's check, per session);
    - messages a shard sends (REPLY, ERROR, EVENT, REGISTERED, LEASES, REFUSED): nobody.

    An insecure peer may send anything a peer may."""
    t = msg.TYPE
    role = peer.role
    if t in _ANY_TYPES:
        return
    if t in _CLIENT_TYPES:
        if role not in (CLIENT, ADMIN, INSECURE):
            raise PermissionDenied(f"{t.name}: key {peer.name!r} is {_a(role)} key; only "
                                   f"client and admin keys may send it")
        check_tenants(peer, t.name, message_keys(msg))
        return
    if t in _ADMIN_TYPES:
        if role not in (ADMIN, INSECURE):
            raise PermissionDenied(f"{t.name}: key {peer.name!r} is {_a(role)} key; queue "
                                   f"changes need an admin key")
        return
    if t in _WORKER_TYPES:
        if role not in (WORKER, INSECURE):
            raise PermissionDenied(f"{t.name}: key {peer.name!r} is {_a(role)} key; only "
                                   f"worker keys may send it")
        if t == p.MsgType.REGISTER and role == WORKER:
            if msg.cluster != peer.cluster:
                raise PermissionDenied(f"REGISTER: key {peer.name!r} is bound to cluster "
                                       f"{peer.cluster}, not {msg.cluster}")
            if msg.worker != peer.name and not msg.worker.startswith(peer.name + "."):
                raise PermissionDenied(f"REGISTER: key {peer.name!r} may register as worker "
                                       f"{peer.name!r} or {peer.name}.<suffix>, not "
                                       f"{msg.worker!r}")
        return
    raise PermissionDenied(f"{t.name} is sent by a shard, not to one")


def visible_metrics(peer, metrics):
    """``Engine.queue_metrics`` output (one queue's map, or ``{queue: map}``) as ``peer`` may
    see it: queues are shared, so a client sees every queue's counts, but a blocked head
    outside its tenants shows as ``{"action": None, "reason": None, ...}`` (its wait code,
    age and demand stay: they say why the queue is stuck, not whose work it is). Returns a
    copy; admins and insecure peers see everything."""
    if peer.role in (ADMIN, INSECURE):
        return metrics
    if "depth" in metrics:      # one queue's map
        return _visible_queue(peer, metrics)
    return {name: _visible_queue(peer, q) for name, q in metrics.items()}


def _visible_queue(peer, q):
    head = q.get("head_blocked")
    if head is None or (head.get("action") and peer.owns(head["action"])):
        return dict(q)
    return {**q, "head_blocked": {**head, "action": None, "reason": None}}
