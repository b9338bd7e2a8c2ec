"""Socket setup shared by the shard (one ROUTER it binds), its workers and its clients
(DEALERs that dial out), and bounded send and receive.

Every socket has linger 0 (closing never blocks on unsent messages), high-water marks from
``[transport] hwm`` (a slow or gone peer bounds what queues for it), and CURVE unless the
config says ``insecure = true``. A shard's ROUTER also refuses oversized frames at the socket
(``ZMQ_MAXMSGSIZE``: the connection is dropped before the frame is buffered) and reports an
unroutable send instead of dropping it silently (``ROUTER_MANDATORY``).
"""

import errno
import logging

import zmq

from engine._config import TransportSettings
from transport._auth import ZAP_DOMAIN

__all__ = ["server_socket", "client_socket", "send", "recv"]

log = logging.getLogger("leasehold.transport")


def _common(sock, settings, heartbeat):
    sock.linger = 0
    sock.sndhwm = settings.hwm
    sock.rcvhwm = settings.hwm
    if heartbeat is not None:
        # ZMTP pings: a peer silent for 3 intervals is disconnected (a ROUTER then forgets
        # it, a DEALER reconnects), instead of a half-open TCP connection lingering.
        ms = max(1, int(heartbeat * 1000))
        sock.heartbeat_ivl = ms
        sock.heartbeat_timeout = 3 * ms
        sock.heartbeat_ttl = 3 * ms


def server_socket(context, endpoint, keyring=None, authenticator=None, settings=None,
                  heartbeat=None):
    """A ROUTER bound to ``endpoint``: CURVE with the keyring's server pair, checked by
    ``authenticator`` (which must be running: without a ZAP handler libzmq would accept
    any key), or plain when ``keyring`` is None (insecure; logged at CRITICAL).
    ``heartbeat``: seconds between ZMTP pings (None: off), see :func:`client_socket`."""
    settings = settings if settings is not None else TransportSettings()
    sock = context.socket(zmq.ROUTER)
    try:
        _common(sock, settings, heartbeat)
        sock.router_mandatory = 1
        # A frame past the larger of the two frame limits is never valid: refuse it before
        # it is buffered (libzmq drops the connection).
        sock.maxmsgsize = max(settings.max_header_bytes, settings.max_frame_bytes)
        if keyring is None:
            log.critical("INSECURE: %s serves without CURVE (security.insecure = true): no "
                         "encryption, no authentication, every peer may do anything", endpoint)
        else:
            if authenticator is None or not authenticator.running:
                raise RuntimeError("a CURVE server socket needs a running Authenticator "
                                   "(without one every key would be accepted)")
            sock.curve_server = True
            sock.curve_publickey = keyring.server_public
            sock.curve_secretkey = keyring.server_secret
            sock.zap_domain = ZAP_DOMAIN.encode()
        sock.bind(endpoint)
    except BaseException:
        sock.close(0)
        raise
    return sock


def client_socket(context, endpoint, keys=None, settings=None, routing_id=None,
                  heartbeat=None):
    """A DEALER connected to ``endpoint``: CURVE with ``keys`` (a ClientKeys), or plain when
    ``keys`` is None (a shard run insecure). Messages queue only to a completed connection
    (``ZMQ_IMMEDIATE``), so a send to a shard that is down or refused the key fails with
    :func:`send` returning False instead of piling up. ``heartbeat``: seconds between ZMTP
    pings; a connection silent for three of them is dropped (None: off)."""
    settings = settings if settings is not None else TransportSettings()
    sock = context.socket(zmq.DEALER)
    try:
        _common(sock, settings, heartbeat)
        sock.immediate = 1
        if routing_id is not None:
            sock.routing_id = routing_id
        if keys is not None:
            sock.curve_serverkey = keys.server_public
            sock.curve_publickey = keys.public
            sock.curve_secretkey = keys.secret
        sock.connect(endpoint)
    except BaseException:
        sock.close(0)
        raise
    return sock


_MORE = int(zmq.SNDMORE) | int(zmq.NOBLOCK)   # the first frame: may find the queue full
_MORE_QUEUED = int(zmq.SNDMORE)                # after the first: the message is taken
_LAST = int(zmq.NOBLOCK)


def send(sock, frames, routing_id=None):
    """Send ``frames`` (from :func:`~transport._protocol.encode`) without blocking and
    without copying the columns; on a ROUTER, to ``routing_id``. Returns False when the
    message cannot go now (the peer's queue is at its high-water mark, it is not connected,
    or it is gone): the caller decides (count, drop, retry later); never blocks."""
    if not frames:
        raise ValueError("a message has at least one frame")
    try:
        # Frame by frame with the flags as plain ints: send_multipart would check every
        # part and combine enum flags per frame, a cost per message on the idle round trip.
        # The first frame decides: once it is queued, libzmq takes the rest of the message.
        if routing_id is not None:
            sock.send(routing_id, _MORE, copy=False)
            more = _MORE_QUEUED
        else:
            more = _MORE
        last = len(frames) - 1
        for i, frame in enumerate(frames):
            sock.send(frame, more if i < last else _LAST, copy=False)
            more = _MORE_QUEUED
    except zmq.Again:
        return False
    except zmq.ZMQError as exc:
        if exc.errno == errno.EHOSTUNREACH:     # ROUTER_MANDATORY: no such peer
            return False
        raise
    return True


def recv(sock, timeout):
    """The next message on ``sock`` as a list of ``zmq.Frame`` (with the routing id first
    on a ROUTER), or None when nothing came within ``timeout`` seconds. Never waits longer."""
    if not sock.poll(int(timeout * 1000), zmq.POLLIN):
        return None
    try:
        return sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return None
