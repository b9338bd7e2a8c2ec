"""The cluster worker (``leasehold worker``, ``docs/worker.md``): dials out to every shard,
holds leases, runs them through plugins, heartbeats what it holds, reports outcomes.

One loop thread drives everything: one :class:`~transport.WorkerConnection` a shard (its
non-blocking calls), the plugins, the timeout heap. A turn of the loop: wait on the sockets
and the plugins' descriptors until something is readable or due; take every message (leases
start attempts, refusals stop them); poll the plugins (RUNNING, outcomes); end attempts past
a bound; send the turn's reports, one REPORT a shard; heartbeat each shard whose interval
is up; check that every shard still answers.

Failing loudly: a lease is alive at the shard only as long as its heartbeats are answered.
When the last answered heartbeat to a shard was sent more than the lease ttl ago, the shard
has (or may have) expired and reassigned every lease this worker holds from it, so the
worker stops every one of those attempts before anyone else can run them twice, then
reconnects or exits non-zero (``worker.on_shard_lost``).
"""

import logging
import math
import os
import shutil
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import zmq

from engine._codes import Verdict
from engine._commands import CommandError, freeze_heap
from engine._config import Config, load_config
from engine._errors import ConfigError
from engine._nodes import node_index, unknown_node
from engine._units import format_quantity
from transport import _protocol as p
from transport._daemon_attempts import AttemptsMixin, _make_dir
from transport._daemon_reports import REPORT_HOLD, ReportsMixin
from transport._keys import load_client_keys
from transport._plugins import (
    Outcome,
)
from transport._worker import ShardError, ShardTimeout, WorkerConnection

__all__ = ["Worker", "measured_capacity", "run_worker"]

log = logging.getLogger("leasehold.worker")


def measured_capacity(resources, work_dir="."):
    """This machine's capacity as ``{resource: quantity}`` for the configured resources:
    cpu (logical CPUs), memory (total bytes), ephemeral_storage (free bytes of the file
    system holding ``work_dir``). Devices are not measured (0): give them in the config."""
    out = {}
    for name in resources.names:
        if name == "cpu":
            out[name] = psutil.cpu_count(logical=True) or 1
        elif name == "memory":
            out[name] = psutil.virtual_memory().total
        elif name == "ephemeral_storage":
            probe = Path(work_dir)
            while not probe.exists() and probe != probe.parent:
                probe = probe.parent
            out[name] = shutil.disk_usage(probe).free
    return out


@dataclass
class _Shard:
    """One shard as this worker sees it."""

    index: int
    conn: WorkerConnection
    lease_ttl: float = 30.0
    interval: float = 10.0
    next_beat: float = 0.0
    last_ok: float = 0.0         # send time of the latest answered heartbeat
    lost_at: float | None = None  # when it was declared lost (reconnecting since)
    retry_at: float = 0.0


class Worker(AttemptsMixin, ReportsMixin):
    """A cluster worker (``docs/worker.md``).

    ``config``: a Config or a path (endpoints, keys, ``[worker]``); ``cluster``: the
    cluster it serves; ``name``: its worker id (default: the first ``[security.peers]``
    worker key of that cluster, or ``CLUSTER-HOSTNAME`` on an insecure shard); ``slots``:
    leases held at once (default ``worker.slots``, else the CPU count); ``plugins``:
    ``{name: Plugin}`` (default: ``process``, ``python`` and ``sim``). ``start()`` runs it
    on a thread, ``serve()`` on the calling thread; ``node``: the node of its cluster it is
    (admission = "nodes"): its heartbeats report its free capacity as that node's, not
    the cluster's (``node_free``); ``drain()`` stops taking work and lets
    what runs finish; ``stop()`` ends it. ``exit_code`` says how it ended (0: asked to stop;
    3: a shard was lost and ``on_shard_lost = "exit"``)."""

    def __init__(self, config, cluster, *, name=None, slots=None, plugins=None,
                 endpoints=None, keys=None, timeout=5.0, node=None):
        if not isinstance(config, Config):
            config = load_config(config)
        self.config = config
        ws = config.worker
        if cluster not in {c.name for c in config.clusters}:
            raise ConfigError(f"{config.source}: worker: cluster {cluster!r} is not configured "
                              f"(clusters: {', '.join(c.name for c in config.clusters)})")
        self.cluster = cluster
        self.name = name or _default_name(config, cluster)
        if node is not None:
            spec = next(c for c in config.clusters if c.name == cluster)
            try:
                known = node in node_index(spec)
            except ValueError as exc:
                raise ConfigError(f"worker {self.name}: --node {node!r}: {exc}") from None
            if not known:
                raise ConfigError(f"worker {self.name}: --node {unknown_node(spec, node)}")
        self.node = node
        self.slots = int(slots or ws.slots or psutil.cpu_count(logical=True) or 1)
        if self.slots < 1:
            raise ConfigError(f"worker {self.name}: slots {self.slots} must be >= 1")
        self.settings = ws
        self.resources = config.resources
        self.work_dir = Path(ws.work_dir).resolve()
        self.log_dir = Path(ws.log_dir).resolve()
        self._work, self._logs = str(self.work_dir), str(self.log_dir)
        if ws.capacity is not None:
            self.capacity = ws.capacity.copy()
        else:
            self.capacity = self.resources.vector(measured_capacity(self.resources,
                                                                    self.work_dir))
        shapes = ws.node_shapes or ()
        self.node_shapes = [{"name": s.name, "count": s.count,
                             "allocatable": self._quantities(s.allocatable)} for s in shapes] \
            or [{"name": f"{self.name}-node", "count": 1,
                 "allocatable": self._quantities(self.capacity)}]
        if keys is None and not config.security.insecure:
            keys = load_client_keys(config.security.keys_dir, _key_name(self.name),
                                    config.security.server_key)
        self.keys = keys
        self.endpoints = tuple(endpoints or config.transport.endpoints)
        self.timeout = timeout
        if plugins is None:
            from transport._plugins import make_plugins
            common = {"kill_grace": ws.kill_grace, "max_log_bytes": ws.max_log_bytes}
            plugins = make_plugins({"process": dict(common), "python": dict(common)})
        self.plugins = plugins
        self.exit_code = None
        self._ctx = zmq.Context()
        self._shards = []
        self._held = {}             # token -> _Held
        self._timers = []           # (due monotonic, seq, token, bound)
        self._seq = 0
        # Reports not sent yet, shard index -> _Pending: one row a token, the latest (a
        # RUNNING and the outcome of one attempt: the outcome says both), in the order of
        # those latest reports.
        self._reports = {}
        self._inflight = {}         # (shard index, rid) -> REPORT message sent
        # Spec maps by their content less their id (msgpack of the other items) -> [the
        # ActionSpec parsed, its (demand, pods) or None], the last _SPEC_CACHE kept: a spec
        # is parsed once and its pods and demand made once, whether it comes in one LEASES
        # message for many leases (a fan-out's group) or in one message a lease (actions
        # enqueued one at a time send the same declaration under new ids).
        self._parsed = {}
        # What the held attempts declared, as {id(demand vector): [vector, attempts]}: a
        # count a lease (the vectors are shared by every lease of a spec), summed only when
        # a heartbeat reports free capacity (a numpy add a lease cost ~1.5 us each way).
        self._held_shapes = {}
        self._stop = threading.Event()
        self._drain = threading.Event()
        self._drained = False
        self._drain_deadline = None
        self._ready = threading.Event()
        self._thread = None
        self._error = None
        self._counts = dict(leases=0, finalize=0, started=0, reports=0, succeeded=0, failed=0,
                            timed_out=0, stopped=0, refused=0, evicted=0, shard_lost=0,
                            heartbeats=0, report_errors=0, cleanups=0, plugin_errors=0)

    # ------------------------------------------------------------------ running

    def start(self, timeout=30.0):
        """Run the loop on a thread of its own; returns once every shard is registered."""
        self._thread = threading.Thread(target=self._serve_safely, name=f"worker-{self.name}",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            self.stop()
            raise ShardTimeout(f"worker {self.name}: not registered with every shard within "
                               f"{timeout}s")
        if self._error is not None:
            raise self._error
        return self

    def _serve_safely(self):
        try:
            self.serve()
        except BaseException as exc:  # reported by start() / join()
            self._error = exc
            self._ready.set()
            log.exception("worker %s: stopped by an error", self.name)

    def serve(self):
        """Connect, register, run the loop until stopped (or a shard is lost and
        ``on_shard_lost`` is "exit"); returns the exit code."""
        try:
            self._connect_all()
            self._ready.set()
            self._loop()
        finally:
            self._shutdown()
        if self.exit_code is None:
            self.exit_code = 0
        # The last line of its log says it ended, and how (a drain, a stop, a lost shard).
        log.info("worker %s: stopped (%s), exit code %d", self.name,
                 "drained" if self._drain.is_set() else "stopped", self.exit_code)
        return self.exit_code

    def stop(self, timeout=30.0):
        """End the loop now: every attempt still running is stopped (and reported SYSTEM /
        EVICTED), then BYE to every shard."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def drain(self):
        """Take no new leases; let running attempts finish within ``worker.drain_timeout``
        (then stop and report them), then end (what SIGTERM does)."""
        self._drain.set()

    def wait(self, timeout=None):
        """Wait for the loop thread to end; returns the exit code (None: still running)."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.exit_code

    def install_signal_handlers(self):
        """SIGTERM and SIGHUP (its terminal or session gone) drain; SIGINT stops."""
        signal.signal(signal.SIGTERM, lambda *_: self.drain())
        signal.signal(signal.SIGHUP, lambda *_: self.drain())
        signal.signal(signal.SIGINT, lambda *_: self.stop(timeout=0))

    def stats(self):
        """Counters (leases, started, reports, succeeded, failed, timed_out, stopped,
        refused, evicted, shard_lost, heartbeats, report_errors, cleanups, plugin_errors)
        and ``held``."""
        out = dict(self._counts)
        out["held"] = len(self._held)
        return out

    def _count(self, key, n=1):
        # Only the loop thread writes (its keys are fixed): readers copy whole ints.
        self._counts[key] += n

    # ------------------------------------------------------------------ connections

    def _connect_all(self):
        for i, ep in enumerate(self.endpoints):
            conn = WorkerConnection(ep, self.keys, self.name, self.cluster, self.slots,
                                    capacity=self._quantities(self.capacity),
                                    node_shapes=self.node_shapes,
                                    settings=self.config.transport, timeout=self.timeout,
                                    context=self._ctx)
            sh = _Shard(i, conn)
            self._shards.append(sh)
            self._register(sh, conn.connect)

    def _register(self, sh, how):
        reg = how()
        now = time.monotonic()
        sh.lease_ttl = float(reg.lease_ttl)
        sh.interval = float(reg.heartbeat_interval)
        sh.last_ok = now
        sh.next_beat = now          # heartbeat at once: adopts (or refuses) what we hold
        sh.lost_at = None
        log.info("worker %s: registered with shard %s (session %s)", self.name,
                 sh.conn.endpoint, reg.session)

    def _shutdown(self):
        now = time.monotonic()
        for h in list(self._held.values()):
            if not h.finalize:
                self._end(h, Outcome.system("EVICTED", f"worker {self.name} stopped"), now)
            else:
                self._forget(h)
        self._flush_reports()
        self._await_reports(min(self.timeout, 5.0))
        for name, plugin in self.plugins.items():
            try:
                plugin.close(timeout=self.settings.kill_grace + 1.0)
            except Exception:       # one plugin's failure must not leak the others
                log.exception("worker %s: plugin %s did not close cleanly", self.name, name)
        for sh in self._shards:
            sh.conn.close(reason="worker stopping")
        self._ctx.term()

    # ------------------------------------------------------------------ the loop

    def _loop(self):
        poller = zmq.Poller()
        socks = {}
        fds = ()
        owner = {}                  # a plugin descriptor -> its plugin
        plugins = list(self.plugins.items())
        while not self._stop.is_set():
            for sh in self._shards:
                s = sh.conn.socket
                if s is not None and socks.get(sh.index) is not s:
                    if socks.get(sh.index) is not None:
                        poller.unregister(socks[sh.index])
                    poller.register(s, zmq.POLLIN)
                    socks[sh.index] = s
            want = tuple(fd for _name, pl in plugins for fd in pl.fds())
            if want != fds:         # registered again only when the descriptors change
                for fd in set(fds) - set(want):
                    poller.unregister(fd)
                for fd in set(want) - set(fds):
                    poller.register(fd, zmq.POLLIN)
                fds = want
                owner = {fd: pl for _name, pl in plugins for fd in pl.fds()}
            now = time.monotonic()
            ready = dict(poller.poll(max(0, math.ceil((self._next_due(now) - now) * 1000))))
            now = time.monotonic()
            # A shard silent past the lease ttl is lost before anything of it is taken or
            # sent: after a pause (SIGSTOP, a frozen VM) a lease pushed meanwhile would be
            # started, or a heartbeat would tell the shard the old session lives and has room
            # (so it places work there), and the worker would then abandon that session, the
            # lease just given expiring with it.
            self._check_shards(now)
            for sh in self._shards:
                # A socket with nothing to read is not asked (a receive that finds nothing
                # raises, ~8 us), unless a blocking call queued pushes on it meanwhile.
                if sh.lost_at is None and (sh.conn.socket in ready or sh.conn.has_pushed):
                    for msg in sh.conn.take():
                        self._on_message(sh, msg, now)
            woken = {owner[fd] for fd in ready if fd in owner} if owner else ()
            for name, plugin in plugins:
                try:
                    if plugin not in woken:
                        # Polled when its descriptors say it has news or its due() time
                        # came (asked after the turn's messages: a start makes news).
                        due = plugin.due()
                        if due is None or due > time.monotonic():
                            continue
                    changes = plugin.poll()
                except Exception:   # a plugin's bug: log it, keep every other attempt going
                    log.exception("worker %s: plugin %s failed to poll", self.name, name)
                    self._count("plugin_errors")
                    continue
                if changes:
                    self._on_changes(changes, now)
            self._fire_timers(now)
            self._flush_reports(now)
            self._heartbeats(now)
            if self._drain.is_set() and self._drain_step(now):
                break

    def _next_due(self, now):
        due = now + 0.25        # the stop flag is checked at least this often
        for sh in self._shards:
            due = min(due, sh.next_beat if sh.lost_at is None else sh.retry_at)
        if self._timers:
            due = min(due, self._timers[0][0])
        for rows in self._reports.values():
            if rows.since is not None:
                due = min(due, rows.since + REPORT_HOLD)
        for plugin in self.plugins.values():
            d = plugin.due()
            if d is not None:
                due = min(due, d)
        return due

    # ------------------------------------------------------------------ messages

    def _on_message(self, sh, msg, now):
        if isinstance(msg, p.Leases):
            self._on_leases(sh, msg, now)
        elif isinstance(msg, p.Refused):
            sent, at = self._inflight.pop((sh.index, msg.rid), (None, 0.0)) \
                if msg.rid is not None else (None, 0.0)
            if isinstance(sent, p.Heartbeat):
                sh.last_ok = max(sh.last_ok, at)
            self._on_refused(msg, now)
        elif isinstance(msg, p.Error):
            sent, _at = self._inflight.pop((sh.index, msg.rid), (None, 0.0))
            if msg.code == "NOT_FOUND" and "not registered" in msg.message:
                self._reregister(sh, sent)
            elif msg.code == "ALREADY_EXISTS" and p.DISPLACED in msg.message:
                self._displaced(sh, msg.message)
            else:
                self._count("report_errors")
                log.error("worker %s: shard %s answered %s with %s: %s", self.name,
                          sh.conn.endpoint, type(sent).__name__ if sent else "a request",
                          msg.code, msg.message)
        # REPLY / REGISTERED to a blocking call that timed out: nothing to do.

    def _reregister(self, sh, sent):
        # The shard restarted: register again (it adopts our leases), then resend every
        # report it has not answered (a report is never dropped) and heartbeat at once.
        try:
            self._register(sh, sh.conn.register)
        except (ShardTimeout, ShardError) as exc:
            log.error("worker %s: re-registering with %s failed: %s", self.name,
                      sh.conn.endpoint, exc)
            return
        pending = [m for (i, _rid), (m, _at) in self._inflight.items() if i == sh.index]
        if sent is not None:
            pending.append(sent)
        for key in [k for k in self._inflight if k[0] == sh.index]:
            del self._inflight[key]
        for m in pending:
            if isinstance(m, p.Report):
                self._track(sh, [sh.conn.resend(m)])

    def _on_refused(self, msg, now):
        toks = msg.tokens
        for i in range(toks.shape[0]):
            token = toks[i].astype("<u8").tobytes()
            verdict = Verdict(int(msg.verdicts[i]))
            h = self._held.get(token)
            if h is None:
                continue
            self._count("refused")
            log.info("worker %s: shard refused %s attempt %s (%s): stopping it", self.name,
                     h.action, h.number, verdict.name)
            self._stop_attempt(h, f"token refused ({verdict.name})")
            self._forget(h)


    # ------------------------------------------------------------------ helpers

    def _quantities(self, vec):
        return {n: format_quantity(n, int(v)) for n, v in zip(self.resources.names, vec,
                                                               strict=True)}


def _key_name(worker):
    # A worker id is its key's name or NAME.<suffix> (docs/security.md).
    return worker.split(".", 1)[0]


def _default_name(config, cluster):
    for peer in config.security.peers:
        if peer.role == "worker" and peer.cluster == cluster:
            return peer.name
    if not config.security.insecure:
        raise ConfigError(f"{config.source}: no [security.peers] worker key for cluster "
                          f"{cluster!r}: add one or pass --name")
    return f"{cluster}-{socket.gethostname().split('.')[0]}.{os.getpid()}"


def run_worker(config_path, cluster, name=None, slots=None, node=None):
    """``leasehold worker``: serve until SIGTERM (drain) or SIGINT; returns the exit code."""
    w = Worker(config_path, cluster, name=name, slots=slots, node=node)
    for what, path in (("worker.work_dir", w.work_dir), ("worker.log_dir", w.log_dir)):
        # Made now: one it cannot make would fail every attempt it takes.
        try:
            _make_dir(path)
        except OSError as exc:
            raise CommandError("INVALID_CONFIG", f"worker {w.name}: {what} {path}: cannot "
                               f"make the directory: {exc.strerror or exc}") from None
    w.install_signal_handlers()
    freeze_heap()       # its own process: start-up objects leave the collector's view
    try:
        return w.serve()
    except ShardError as exc:
        # The shard's code, once: the CLI prints it before the message (as talk() does).
        raise CommandError(exc.code, f"worker {w.name}: {exc.error_message} (shard "
                                     f"{exc.shard})") from None
    except ShardTimeout as exc:
        # The shard's code stays (UNAVAILABLE: no answer), not INTERNAL as if a bug.
        raise CommandError(exc.code, f"worker {w.name}: {exc}") from None

