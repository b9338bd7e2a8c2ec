"""The worker side of the protocol (``docs/protocol.md``): a library class the cluster
worker executable drives, and tests drive directly.

:class:`WorkerConnection` dials one shard (a DEALER, CURVE with the worker's key), registers,
receives LEASES batches, sends HEARTBEAT batches (at most ``max_tokens`` tokens each, several
in flight) and REPORT batches, and hands back what the shard refused. Every wait is bounded
by a timeout; a wait that runs out raises :class:`ShardTimeout` naming the shard and what was
waited for. Not thread-safe: one thread drives one connection.

The DEALER has a fixed routing id (the worker id and a per-process suffix), so when the TCP
connection drops and ZeroMQ reconnects, the shard still knows the connection as this
worker's. When the shard answers that the connection is not registered (it restarted), the
class registers again with the same worker id and resends the request once: after a restart
the shard adopts the worker's leases, and its next heartbeat validates or refuses them.
"""

import collections
import itertools
import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import zmq

from engine._codes import PHASE_CODE, LeaseKind, Phase, Verdict
from engine._config import TransportSettings
from engine._errors import LeaseholdError
from transport import _protocol as p
from transport._plugins import frozen_instance
from transport._sockets import client_socket, send

log = logging.getLogger("leasehold.worker")

__all__ = ["WorkerConnection", "Lease", "ShardError", "ShardTimeout", "lease_rows", "leases_of"]


class ShardError(LeaseholdError):
    """The shard answered a request with ERROR: ``code`` is its code; the text names the
    shard, the request and what was wrong."""

    def __init__(self, shard, what, code, message):
        super().__init__(f"shard {shard}: {what}: {code}: {message}")
        self.code = code
        self.shard = shard
        self.error_message = message


class ShardTimeout(LeaseholdError):
    """No answer from the shard within the timeout (it is down, unreachable, or refused the
    key: CURVE failures are silent by design)."""

    code = "UNAVAILABLE"


@dataclass(frozen=True)
class Lease:
    """One lease pushed to this worker: run ``action`` (kind RUN) or clean up one of its
    attempts (FINALIZE); present ``token`` on every heartbeat and report. ``spec`` is the
    action spec as a map; the bounds are nanoseconds on the shard's clock (None: none);
    ``env`` is the engine's identity of the action's warm pool (reusable actions only);
    ``nodes`` the node of each pod when its cluster has admission = "nodes" (pod groups
    largest first; a hint a plugin may pass on to the cluster's scheduler or ignore)."""

    action: str
    token: bytes
    kind: LeaseKind
    attempt: int
    spec: dict
    input_ref: str | None = None
    deadline_ns: int | None = None
    queued_deadline_ns: int | None = None
    env: str | None = None
    nodes: tuple | None = None


def leases_of(msg):
    """The :class:`Lease` entries of a decoded LEASES message."""
    return [frozen_instance(Lease, {
                "action": action, "token": token, "kind": kind, "attempt": attempt,
                "spec": spec, "input_ref": ref, "deadline_ns": d, "queued_deadline_ns": q,
                "env": env, "nodes": hint})
            for action, token, kind, attempt, spec, ref, d, q, env, hint in lease_rows(msg)]


def lease_rows(msg):
    """The leases of a decoded LEASES message as tuples of the fields of :class:`Lease`, in
    its order: what :func:`leases_of` makes its objects of, for a caller (the worker's loop)
    that keeps the fields without a Lease object."""
    n = msg.tokens.shape[0]
    raw = msg.tokens.astype("<u8", copy=False).tobytes()
    inputs = msg.inputs or itertools.repeat(None, n)
    nodes = msg.nodes or itertools.repeat(None, n)
    # Columns to Python lists in one call each (an element of an array read one at a
    # time costs a numpy scalar, and the kind an enum call); each group's fields read once.
    groups = [(g["run"], g["spec"], g.get("env")) for g in msg.groups]
    return ((f"{run}/{name}", raw[24 * i:24 * i + 24], _LEASE_KINDS[kind], attempt, spec,
             ref, d if d >= 0 else None, q if q >= 0 else None, env,
             tuple(hint) if hint is not None else None)
            for i, (run, spec, env), name, kind, attempt, d, q, ref, hint in zip(
                range(n), [groups[k] for k in msg.group.tolist()], msg.names,
                msg.kind.tolist(), msg.attempt.tolist(), msg.deadline_ns.tolist(),
                msg.queued_deadline_ns.tolist(), inputs, nodes, strict=True))


_LEASE_KINDS = {int(k): k for k in LeaseKind}


class WorkerConnection:
    """A worker's connection to one shard.

    ``endpoint``: the shard's ROUTER; ``keys``: a :class:`~transport.ClientKeys` (None for
    a shard run insecure); ``worker``: the worker id (the key's name or ``NAME.<suffix>``);
    ``cluster``, ``slots``, and optionally ``capacity`` and ``node_shapes`` as REGISTER takes
    them. ``timeout``: the default bound, in seconds, of every wait."""

    def __init__(self, endpoint, keys, worker, cluster, slots, *, capacity=None,
                 node_shapes=None, settings=None, timeout=5.0, context=None, heartbeat=None):
        self.endpoint = endpoint
        self.keys = keys
        self.worker = worker
        self.cluster = cluster
        self.slots = slots
        self.capacity = capacity
        self.node_shapes = node_shapes
        self.settings = settings if settings is not None else TransportSettings()
        self.timeout = timeout
        self._own_ctx = context is None
        self._ctx = context if context is not None else zmq.Context()
        self._heartbeat = heartbeat
        self._decoder = p.Decoder(self.settings)
        self._rids = itertools.count(1)
        self._routing_id = f"w:{worker}:{os.getpid()}:{id(self) & 0xffffff:x}".encode()
        self._sock = None
        self._pushed = collections.deque()       # LEASES and unsolicited REFUSED, in order
        self.registered = None                   # the last REGISTERED
        self.max_tokens = self.settings.max_tokens

    # ------------------------------------------------------------------ connection

    def connect(self):
        """Open the socket (idempotent) and register; returns the REGISTERED message."""
        if self._sock is None:
            self._sock = client_socket(self._ctx, self.endpoint, self.keys, self.settings,
                                       routing_id=self._routing_id, heartbeat=self._heartbeat)
        return self.register()

    def reconnect(self):
        """Close the socket, open a new one (same routing id), register again."""
        self._close_socket()
        return self.connect()

    def register(self):
        """Send REGISTER and wait for REGISTERED."""
        msg = p.Register(rid=next(self._rids), worker=self.worker, cluster=self.cluster,
                         slots=self.slots, capacity=self.capacity,
                         node_shapes=self.node_shapes)
        reg = self._call(msg, "REGISTER", retry=False)
        self.registered = reg
        self.max_tokens = min(self.max_tokens, reg.max_tokens)
        return reg

    def close(self, reason=None):
        """Say BYE (best effort) and close; the context too when this class made it."""
        if self._sock is not None:
            send(self._sock, p.encode(p.Bye(rid=next(self._rids), reason=reason)))
        self._close_socket()
        if self._own_ctx:
            self._ctx.destroy(linger=0)     # as Client.close: never blocked by a stray socket
            self._own_ctx = False

    def _close_socket(self):
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def __enter__(self):
        self.connect()
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ leases

    def receive(self, timeout=None):
        """The next pushed message (a decoded LEASES, or an unsolicited REFUSED: stop those
        attempts now), or None when nothing came within ``timeout``."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            if self._pushed:
                return self._pushed.popleft()
            if self._recv_until(deadline) is None:      # pushes land in self._pushed
                return None

    def leases(self, timeout=None, want=1):
        """Leases pushed to this worker: waits up to ``timeout`` until at least ``want``
        arrived, returns what came (possibly fewer). Unsolicited refusals are kept for
        :meth:`refusals`."""
        out = []
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        keep = []
        while len(out) < want:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            msg = self.receive(left)
            if msg is None:
                break
            if isinstance(msg, p.Leases):
                out.extend(leases_of(msg))
            else:
                keep.append(msg)
        while self._pushed and isinstance(self._pushed[0], p.Leases):
            out.extend(leases_of(self._pushed.popleft()))
        self._pushed.extend(keep)
        return out

    # ------------------------------------------------------------------ heartbeats, reports

    def heartbeat(self, tokens, free=None, timeout=None, *, node_free=None):
        """Present ``tokens`` (24-byte tokens, a list of them, or ``n x 3`` uint64) in
        batches of at most ``max_tokens``, all in flight at once, with the free capacity
        seen (``{resource: quantity}``) and, for a cluster with admission = "nodes", the free
        capacity of nodes (``node_free``: ``{node name: {resource: quantity}}``), both on the
        first batch. Returns the refused tokens as ``[(token bytes, Verdict)]``: stop the
        attempt behind each."""
        return self._calls(self._heartbeats(tokens, free, node_free), "HEARTBEAT", timeout)

    def report(self, tokens, phases, details=None, timeout=None):
        """Report on leases: ``phases[i]`` (a Phase or its name, or one for all; or a uint8
        array of phase codes, ``engine._codes.PHASE_CODE``) for ``tokens[i]``; ``details``:
        ``{i: {error_kind, cause, message, recoverable, cleanup}}`` for the rows that need
        more. Returns once the shard made the reports durable: the refused ones as
        ``[(token bytes, Verdict)]``."""
        return self._calls(self._reports(tokens, phases, details), "REPORT", timeout)

    # The same without waiting, for a worker that drives several shards from one loop: each
    # returns the messages sent (their ``rid`` and columns); the answers come from take().

    def send_heartbeat(self, tokens, free=None, node_free=None):
        """:meth:`heartbeat` without waiting: the HEARTBEAT messages sent."""
        msgs = self._heartbeats(tokens, free, node_free)
        for m in msgs:
            self._send(m, "HEARTBEAT")
        return msgs

    def send_report(self, tokens, phases, details=None):
        """:meth:`report` without waiting: the REPORT messages sent."""
        msgs = self._reports(tokens, phases, details)
        for m in msgs:
            self._send(m, "REPORT")
        return msgs

    def resend(self, msg):
        """Send ``msg`` again under a new request id (after a re-registration); returns the
        message sent."""
        m = type(msg)(**{**{f: getattr(msg, f) for f in msg.__slots__},
                         "rid": next(self._rids)})
        self._send(m, msg.TYPE.name)
        return m

    def take(self):
        """Every message waiting now, in arrival order, without blocking: pushes (LEASES,
        unsolicited REFUSED) and answers (REFUSED, ERROR, REPLY, REGISTERED) alike."""
        out = list(self._pushed)
        self._pushed.clear()
        sock = self._sock
        while sock is not None:
            try:
                # Copied: the frames of a shard's message are small, and bytes cost less
                # to make than zmq.Frame objects (~4 us less for a LEASES of one lease).
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                out.append(self._decoder.decode(frames))
            except p.ProtocolError as exc:
                # Nothing a shard should send: dropped, but said (its leases will expire).
                log.warning("%s: a message from the shard was dropped: %s", self.endpoint, exc)
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                break           # asked, not found by a receive that raises (~4 us more)
        return out

    @property
    def has_pushed(self):
        """Whether pushes received during a blocking call (register, drain, ...) wait for
        :meth:`take` (the socket may then have nothing left to read)."""
        return bool(self._pushed)

    @property
    def socket(self):
        """The connection's DEALER (to poll it beside others); None when not connected."""
        return self._sock

    def drain(self, timeout=None):
        """Stop taking leases (``BYE drain``); the session stays for heartbeats and reports
        of what this worker holds. Waits for the shard's REPLY."""
        self._call(p.Bye(rid=next(self._rids), reason="draining", drain=True), "BYE",
                   retry=False, timeout=timeout)

    def _heartbeats(self, tokens, free, node_free=None):
        arr = p.tokens_array(tokens)
        step = self.max_tokens
        return [p.Heartbeat(rid=next(self._rids), tokens=arr[lo:lo + step],
                            free=free if lo == 0 else None,
                            node_free=node_free if lo == 0 else None)
                for lo in range(0, max(1, arr.shape[0]), step)]

    def _reports(self, tokens, phases, details):
        arr = p.tokens_array(tokens)
        n = arr.shape[0]
        if isinstance(phases, np.ndarray) and phases.dtype == np.uint8:
            codes = phases
        else:
            if isinstance(phases, (Phase, str)):
                phases = [phases] * n
            codes = np.array([PHASE_CODE[Phase(ph)] for ph in phases], np.uint8)
        step = self.settings.max_batch
        msgs = []
        for lo in range(0, n, step):
            det = None
            if details:
                # A plugin's message may be long (an import error naming a long path, a
                # stderr tail): cut to the limit, not refused whole with the report.
                cut = self.settings.max_text
                det = [{"i": i - lo, **{k: p.clip_text(v, cut) if isinstance(v, str) else v
                                        for k, v in d.items()}}
                       for i, d in sorted(details.items()) if lo <= i < lo + step]
                det = det or None
            msgs.append(p.Report(rid=next(self._rids), tokens=arr[lo:lo + step],
                                 phases=codes[lo:lo + step], details=det))
        return msgs

    def refusals(self):
        """Unsolicited refusals received so far (aborts): ``[(token bytes, Verdict)]``."""
        out, keep = [], collections.deque()
        for m in self._pushed:
            if isinstance(m, p.Refused):
                out.extend(_pairs(m))
            else:
                keep.append(m)
        self._pushed = keep
        return out

    def ping(self, timeout=None):
        """PING the shard; returns its REPLY body."""
        return self._call(p.Ping(rid=next(self._rids)), "PING", timeout=timeout).body

    # ------------------------------------------------------------------ plumbing

    def _send(self, msg, what):
        if self._sock is None:
            raise ShardTimeout(f"shard {self.endpoint}: {what}: not connected")
        frames = p.encode_request(msg, what, self.settings)
        if not send(self._sock, frames):
            # ZMQ_IMMEDIATE: no completed connection yet (or the queue is full). Wait for
            # one within the timeout instead of queuing blindly.
            deadline = time.monotonic() + self.timeout
            while time.monotonic() < deadline:
                if self._sock.poll(20, zmq.POLLOUT) and send(self._sock, frames):
                    return
            raise ShardTimeout(f"shard {self.endpoint}: {what}: cannot send (not connected "
                               f"within {self.timeout}s: down, unreachable or key refused)")

    def _call(self, msg, what, retry=True, timeout=None):
        return self._calls([msg], what, timeout, retry=retry, raw=True)[0]

    def _calls(self, msgs, what, timeout, retry=True, raw=False):
        for m in msgs:
            self._send(m, what)
        want = {m.rid: i for i, m in enumerate(msgs)}
        answers = [None] * len(msgs)
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        redo = []
        while want:
            msg = self._recv_until(deadline)
            if msg is None:
                raise ShardTimeout(f"shard {self.endpoint}: {what}: no answer to {len(want)} "
                                   f"request(s) within {wait}s")
            rid = getattr(msg, "rid", None)
            if rid not in want:
                continue
            i = want.pop(rid)
            if isinstance(msg, p.Error):
                if retry and msg.code == "NOT_FOUND" and "not registered" in msg.message:
                    redo.append(i)
                    continue
                raise ShardError(self.endpoint, what, msg.code, msg.message)
            answers[i] = msg
        if redo:
            # The shard restarted (or forgot this connection): register again, resend once.
            self.register()
            again = []
            for i in redo:
                m = msgs[i]
                m = type(m)(**{**{f: getattr(m, f) for f in m.__slots__},
                               "rid": next(self._rids)})
                again.append((i, m))
            got = self._calls([m for _i, m in again], what, timeout, retry=False, raw=True)
            for (i, _m), a in zip(again, got, strict=True):
                answers[i] = a
        if raw:
            return answers
        out = []
        for a in answers:
            out.extend(_pairs(a))
        return out

    def _recv_until(self, deadline):
        """The next decoded message before ``deadline``; pushes are queued for
        :meth:`receive`, and returned too so that a caller waiting for them sees them."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self._sock is None:
                return None
            if not self._sock.poll(max(1, int(left * 1000)), zmq.POLLIN):
                return None
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)     # as take(): bytes
            except zmq.Again:
                continue
            try:
                msg = self._decoder.decode(frames)
            except p.ProtocolError as exc:
                log.warning("%s: a message from the shard was dropped: %s", self.endpoint, exc)
                continue
            if isinstance(msg, p.Leases) or (isinstance(msg, p.Refused) and msg.rid is None):
                self._pushed.append(msg)
                return msg
            return msg


def _pairs(refused):
    toks = refused.tokens
    return [(toks[i].astype("<u8").tobytes(), Verdict(int(refused.verdicts[i])))
            for i in range(toks.shape[0])]
