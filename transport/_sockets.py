"""Socket setup shared by the shard (one ROUTER it binds), its workers and its clients
(DEALERs that dial out), and bounded send and receive.

Every socket has linger 0 (closing never blocks on unsent messages), high-water marks from
``[transport] hwm`` (a slow or gone peer bounds what queues for it), and CURVE unless the
config says ``insecure = true``. A shard's ROUTER also refuses oversized frames at the socket
(``ZMQ_MAXMSGSIZE``: the connection is dropped before the frame is buffered) and reports an
unroutable send instead of dropping it silently (``ROUTER_MANDATORY``).

An ``ipc://PATH`` endpoint is held with an advisory lock, ``PATH.lock`` (``flock``), for as
long as the socket is open: libzmq's bind unlinks whatever is at PATH and binds anew, so a
second shard on the same endpoint would silently take the socket of a live one. A second
bind is refused (``zmq.ZMQError`` EADDRINUSE, naming the endpoint and the holder's pid), as
is a PATH some other program is listening on. The kernel drops the lock when its process
dies, however it dies: a killed shard's leftover files never block its restart.
"""

import errno
import fcntl
import logging
import os
import socket
import time
import weakref

import zmq

from engine._config import TransportSettings, tcp_host_port
from engine._errors import LeaseholdError
from transport._auth import ZAP_DOMAIN

__all__ = ["server_socket", "client_socket", "send", "recv", "Unreachable"]

log = logging.getLogger("leasehold.transport")

#: How long a closed ROUTER's ipc endpoint may keep accepting (libzmq closes its listener on
#: its own thread) before the endpoint's lock is released anyway, in seconds.
IPC_RELEASE_WAIT_S = 2.0


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


class _Router(zmq.Socket):
    """A ROUTER that releases its endpoint's lock (``_ipc_lock``) when it is closed."""

    # Class attributes: pyzmq takes other names for socket options.
    _ipc_release = None
    _ipc_path = None

    def close(self, linger=None):
        super().close(linger)
        if self._ipc_release is not None:
            # libzmq closes the listener on its own thread after close() returns: the lock
            # goes once nothing accepts on the path any more (bounded), or a bind just after
            # this close finds a listener without its lock and is refused.
            deadline = time.monotonic() + IPC_RELEASE_WAIT_S
            while _listening(self._ipc_path) and time.monotonic() < deadline:
                time.sleep(0.001)
            self._ipc_release()


def _in_use(endpoint, message):
    return zmq.ZMQError(errno.EADDRINUSE, f"{endpoint}: {message}")


def _unlock(fd, lock_path):
    # Unlinked while still locked, and only when it is still this file: a process that opened
    # it just before finds it gone after its flock (the inode check below) and retries.
    try:
        if os.stat(lock_path).st_ino == os.fstat(fd).st_ino:
            os.unlink(lock_path)
    except OSError:
        pass
    os.close(fd)


def _ipc_lock(endpoint):
    """Lock ``endpoint`` (``ipc://PATH``) for this socket: ``(fd, lock_path)``, or raise
    EADDRINUSE when another process holds it or something else listens on PATH."""
    path = endpoint[len("ipc://"):]
    lock_path = path + ".lock"
    for _ in range(10):
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise _in_use(endpoint, f"cannot create its lock file {lock_path}: "
                                    f"{exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            who = "this process" if holder.startswith(f" (pid {os.getpid()}") else \
                "another process"
            raise _in_use(endpoint, f"{who} holds it{holder} (lock file "
                                    f"{lock_path}); stop it, or give this one another "
                                    f"endpoint") from None
        try:
            current = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)        # its holder removed it as we locked it: lock the new one
    else:
        raise _in_use(endpoint, f"its lock file {lock_path} keeps being replaced")
    try:
        listening = _listening(path)
    except BaseException:
        _unlock(fd, lock_path)
        raise
    if listening:
        _unlock(fd, lock_path)
        raise _in_use(endpoint, f"something is listening on {path} without its lock file "
                                f"(another program, or an older Leasehold); stop it, or give "
                                f"this one another endpoint")
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd, lock_path


def _holder(fd):
    """`` (pid N: command line)`` of the lock's holder as it wrote it, when known."""
    try:
        pid = int(os.pread(fd, 32, 0).split()[0])
    except (OSError, ValueError, IndexError):
        return ""
    try:
        import psutil
        return f" (pid {pid}: {' '.join(psutil.Process(pid).cmdline())[:200]})"
    except Exception:           # naming the holder is a courtesy; the refusal stands
        return f" (pid {pid})"


def _listening(path):
    """Whether something accepts connections on the Unix socket ``path`` (a file left by a
    dead process refuses them)."""
    if not os.path.exists(path):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.setblocking(False)
        try:
            s.connect(path)
        except BlockingIOError:
            return True         # a full backlog: someone listens
        except OSError:
            return False        # refused (stale), not a socket, a path too long: bind says
    return True


def server_socket(context, endpoint, keyring=None, authenticator=None, settings=None,
                  heartbeat=None):
    """A ROUTER bound to ``endpoint``: CURVE with the keyring's server pair, checked by
    ``authenticator`` (which must be running: without a ZAP handler libzmq would accept
    any key), or plain when ``keyring`` is None (insecure; logged at CRITICAL).
    ``heartbeat``: seconds between ZMTP pings (None: off), see :func:`client_socket`.
    An ``ipc://`` endpoint is locked while the socket is open (module docstring): a second
    bind raises ``zmq.ZMQError`` EADDRINUSE naming it."""
    settings = settings if settings is not None else TransportSettings()
    sock = context.socket(zmq.ROUTER, socket_class=_Router)
    try:
        _common(sock, settings, heartbeat)
        sock.router_mandatory = 1
        # A frame past the larger of the two frame limits is never valid: refuse it before
        # it is buffered (libzmq drops the connection).
        sock.maxmsgsize = max(settings.max_header_bytes, settings.max_frame_bytes)
        if keyring is not None:
            if authenticator is None or not authenticator.running:
                raise RuntimeError("a CURVE server socket needs a running Authenticator "
                                   "(without one every key would be accepted)")
            sock.curve_server = True
            sock.curve_publickey = keyring.server_public
            sock.curve_secretkey = keyring.server_secret
            sock.zap_domain = ZAP_DOMAIN.encode()
        if endpoint.startswith("ipc://") and endpoint != "ipc://*":
            fd, lock_path = _ipc_lock(endpoint)
            # Released by close(), or when the socket is collected unclosed.
            sock._ipc_release = weakref.finalize(sock, _unlock, fd, lock_path)
            sock._ipc_path = endpoint[len("ipc://"):]
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            if exc.errno in (errno.ENODEV, errno.EADDRNOTAVAIL):
                # ZeroMQ's words for a host that is no address or interface of this machine.
                host = tcp_host_port(endpoint)[0]
                raise zmq.ZMQError(exc.errno, f"{endpoint}: {host!r} is not an address or "
                                              f"interface of this machine (or does not "
                                              f"resolve)") from None
            raise
    except BaseException:
        sock.close(0)
        raise
    if keyring is None:     # once it serves (a refused bind serves nothing)
        log.critical("INSECURE: %s serves without CURVE (security.insecure = true): no "
                     "encryption, no authentication, every peer may do anything", endpoint)
    return sock


class Unreachable(LeaseholdError):
    """A shard's endpoint cannot be dialled at all: an ipc path too long for the system
    (ZeroMQ refused the connect itself), or a tcp host that does not resolve."""

    code = "UNAVAILABLE"


#: getaddrinfo's answers that are final: the name has no address (EAI_AGAIN, a resolver
#: that did not answer now, is left to ZeroMQ, which resolves again as it reconnects).
_NO_ADDRESS = {getattr(socket, name) for name in ("EAI_NONAME", "EAI_NODATA", "EAI_FAIL",
                                                  "EAI_ADDRFAMILY") if hasattr(socket, name)}


def _check_resolves(endpoint):
    """Raise :class:`Unreachable` naming the host of a ``tcp://`` endpoint that does not
    resolve. ZeroMQ resolves it on its own thread and retries for ever: the caller only saw
    its requests time out ("not connected within ..."), as if the shard were down."""
    if not endpoint.startswith("tcp://"):
        return
    host = tcp_host_port(endpoint)[0]
    if not host or host == "*":
        return                              # ZeroMQ's connect refuses these itself
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in _NO_ADDRESS:
            raise Unreachable(f"{endpoint}: cannot connect: host {host!r} does not resolve "
                              f"({exc.strerror})") from None
    except UnicodeError:
        raise Unreachable(f"{endpoint}: cannot connect: {host!r} is not a host name") from None


def client_socket(context, endpoint, keys=None, settings=None, routing_id=None,
                  heartbeat=None):
    """A DEALER connected to ``endpoint``: CURVE with ``keys`` (a ClientKeys), or plain when
    ``keys`` is None (a shard run insecure). Messages queue only to a completed connection
    (``ZMQ_IMMEDIATE``), so a send to a shard that is down or refused the key fails with
    :func:`send` returning False instead of piling up. ``heartbeat``: seconds between ZMTP
    pings; a connection silent for three of them is dropped (None: off). An endpoint ZeroMQ
    cannot dial at all, or a tcp host that does not resolve, raises :class:`Unreachable`."""
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
        _check_resolves(endpoint)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            raise Unreachable(f"{endpoint}: cannot connect: {zmq.strerror(exc.errno)}") from None
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
