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

import hashlib
import heapq
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

import msgpack
import numpy as np
import psutil
import zmq

from engine._codes import PHASE_CODE, LeaseKind, Phase, Verdict
from engine._commands import CommandError, freeze_heap
from engine._config import Config, load_config
from engine._errors import ConfigError, SpecError
from engine._execution import Execution
from engine._model import ActionSpec
from engine._nodes import node_index, unknown_node
from engine._units import BYTES, format_quantity, parse_quantity
from transport import _protocol as p
from transport._keys import load_client_keys
from transport._plugins import (
    Attempt,
    Outcome,
    PluginError,
    Pod,
    UserError,
    make_attempt,
)
from transport._worker import ShardError, ShardTimeout, WorkerConnection, lease_rows

__all__ = ["Worker", "measured_capacity", "run_worker"]

log = logging.getLogger("leasehold.worker")

_RUNNING = PHASE_CODE[Phase.RUNNING]
_SUCCEEDED = PHASE_CODE[Phase.SUCCEEDED]
_INITIALIZING = PHASE_CODE[Phase.INITIALIZING]
# Enum members read once: ``Phase.RUNNING`` is a metaclass lookup (~0.2 us), paid several
# times an action on the hot path otherwise.
_PHASE_INITIALIZING = Phase.INITIALIZING
_PHASE_RUNNING = Phase.RUNNING
_PHASE_SUCCEEDED = Phase.SUCCEEDED
_FINALIZE = LeaseKind.FINALIZE
_SPEC_CACHE = 256           # parsed specs kept, by the content of their wire map
#: How long a report that only says an attempt is on its way (INITIALIZING, RUNNING) may
#: wait for that attempt's next one, in seconds: a short attempt (a warm pool's call) then
#: sends its outcome alone, not three REPORTs, each a shard turn and an answer to wake for.
REPORT_HOLD = 0.005
_OUTCOME_COUNTER = {Phase.SUCCEEDED: "succeeded", Phase.FAILED: "failed",
                    Phase.TIMED_OUT: "timed_out"}


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


class _Held:
    """One lease this worker holds: the fields of its lease (``transport.Lease``: ``number``
    is its attempt number, ``spec`` its spec map; the worker makes no Lease object, one a
    lease was ~1 us and two objects for the garbage collector to trace) and its attempt."""

    __slots__ = ("token", "action", "number", "spec", "input_ref", "env", "deadline_ns",
                 "queued_deadline_ns", "finalize", "shard", "attempt", "plugin", "phase",
                 "demand", "cleanup")

    def __init__(self, shard, action, token, kind, number, spec, input_ref, deadline_ns,
                 queued_deadline_ns, env):
        self.token = token
        self.action = action
        self.number = number
        self.spec = spec
        self.input_ref = input_ref
        self.env = env
        self.deadline_ns = deadline_ns
        self.queued_deadline_ns = queued_deadline_ns
        self.finalize = kind == _FINALIZE
        self.shard = shard
        self.attempt = None
        self.plugin = None
        self.phase = _PHASE_INITIALIZING
        self.demand = None
        self.cleanup = False


class _Pending:
    """The reports to one shard not sent yet: ``codes`` ``{token: phase code}`` and
    ``details`` ``{token: detail}`` of outcomes (``urgent`` once there is one: sent at the
    end of the turn), and ``fresh``, the held leases whose phase (INITIALIZING, RUNNING)
    is to be said, read when the reports leave (``REPORT_HOLD`` after ``since``, the
    oldest, unless an outcome goes first): a lease let go by then is left out, so a lease
    that starts and ends in one turn costs two list appends, not three rows made and
    replaced."""

    __slots__ = ("codes", "details", "urgent", "since", "fresh")

    def __init__(self):
        self.codes = {}
        self.details = {}
        self.urgent = False
        self.since = None
        self.fresh = []


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


class Worker:
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

    def _on_leases(self, sh, msg, now):
        """Hold and start the leases of a LEASES message, in order. What starting one needs
        of its spec (parsed, its plugin, demand and pods) is worked out once a group, and
        consecutive leases of one spec map (a fan-out's) start with one ``start_many``."""
        held = self._held
        counts = self._counts
        index = sh.index
        made = {}                   # id(spec map) -> what _how returned
        group, group_spec = [], None    # consecutive leases of one spec map, not started yet
        for action, token, kind, number, spec, ref, d, q, env, _nodes in lease_rows(msg):
            if token in held:
                continue            # a duplicate push of a lease we run
            h = _Held(index, action, token, kind, number, spec, ref, d, q, env)
            held[token] = h
            if spec is not group_spec and group:
                self._start_group(group, made, now)
                group = []
            group_spec = spec
            if h.finalize:
                if group:
                    self._start_group(group, made, now)
                    group = []
                counts["finalize"] += 1
                self._finalize(h)
                continue
            counts["leases"] += 1
            if self._drain.is_set():
                self._end(h, Outcome.system("EVICTED", f"worker {self.name} is draining"),
                          now)
                continue
            group.append(h)
        if group:
            self._start_group(group, made, now)

    def _start_group(self, hs, made, now):
        """Start held leases ``hs`` (of one spec map): their attempts made alike, handed to
        the plugin in one ``start_many``; each that cannot start reports its own failure."""
        h0 = hs[0]
        how = made.get(id(h0.spec))
        if how is None:
            try:
                how = made[id(h0.spec)] = self._how(h0)
            except Exception:
                # Not kept: each lease's own start raises it again and reports its own.
                for h in hs:
                    self._start(h, made, now)
                return
        spec, ex, plugin, demand, pods = how
        attempts = []
        try:
            for h in hs:
                h.demand = demand
                h.attempt = self._attempt(h, spec, ex, plugin, pods)
                h.plugin, h.cleanup = plugin, plugin.finalizes
                attempts.append(h.attempt)
        except Exception:   # (a workdir that cannot be made): one at a time, each its own
            for h in hs:
                h.demand = h.attempt = h.plugin = None
            for h in hs:
                self._start(h, made, now)
            return
        held = self._held_shapes.get(id(demand))
        if held is None:
            self._held_shapes[id(demand)] = [demand, len(hs)]
        else:
            held[1] += len(hs)
        t = spec.timeouts
        if t.max_runtime is not None or any(
                h.queued_deadline_ns is not None or h.deadline_ns is not None for h in hs):
            for h in hs:
                self._arm(h, spec, now)
        try:
            failed = plugin.start_many(attempts)
        except Exception as exc:
            # A plugin's bug (start_many answers each attempt's own failure): none is taken
            # to have started; any it did start is stopped.
            for a in attempts:
                self._stop_quietly(plugin, a.key)
            failed = [(a, exc) for a in attempts]
        if failed:
            why = {a.key: exc for a, exc in failed}
            for h in hs:
                exc = why.get(h.token)
                if exc is not None:
                    self._end(h, self._start_failure(exc, h), now)
            hs = [h for h in hs if h.token not in why]
        self._counts["started"] += len(hs)
        if hs:
            rows = self._reports.get(h0.shard)
            if rows is None:
                rows = self._reports[h0.shard] = _Pending()
            rows.fresh.extend(hs)       # as _progress, for each
            if rows.since is None:
                rows.since = now

    def _how(self, h):
        """``(spec, execute, plugin, demand, pods)`` of a lease: raises UserError,
        PluginError or SpecError when it cannot start."""
        spec, entry = self._spec(h.spec)
        ex = spec.execute
        name = ex.plugin if ex is not None else self.settings.default_plugin
        if name is None:
            raise UserError(f"action {h.action} declares no execute and worker "
                            f"{self.name} has no worker.default_plugin")
        plugin = self.plugins.get(name)
        if plugin is None:
            raise PluginError(f"worker {self.name} has no {name} plugin "
                              f"(it has {', '.join(self.plugins)})", cause="NO_PLUGIN")
        if ex is None:
            ex = Execution(plugin=name)
        shape = entry[1]
        if shape is None:
            shape = entry[1] = self._make_shape(spec)
        demand, pods = shape
        return spec, ex, plugin, demand, pods

    def _start(self, h, made, now):
        try:
            how = made.get(id(h.spec))
            if how is None:         # a failure is not kept: each lease reports its own
                how = made[id(h.spec)] = self._how(h)
            spec, ex, plugin, demand, pods = how
            att = self._attempt(h, spec, ex, plugin, pods)
            h.attempt, h.plugin = att, plugin
            h.cleanup = plugin.finalizes
            # Set only where it is counted: an attempt that failed before (its directory
            # could not be made) has nothing to uncount when it ends.
            h.demand = demand
            held = self._held_shapes.get(id(demand))
            if held is None:
                self._held_shapes[id(demand)] = [demand, 1]
            else:
                held[1] += 1
            self._arm(h, spec, now)
            plugin.start(att)
        except Exception as exc:
            self._end(h, self._start_failure(exc, h), now)
            return
        self._counts["started"] += 1
        self._progress(h, now)

    def _start_failure(self, exc, h):
        """The outcome of lease ``h`` whose start raised ``exc``: USER for a fault of its
        declaration, SYSTEM (the error's cause) for one of the machine or the plugin; any
        other exception is a plugin's bug: logged, counted, and the worker goes on."""
        if isinstance(exc, UserError):
            return Outcome.user(str(exc), recoverable=False)
        if isinstance(exc, (PluginError, OSError)):
            return Outcome.system(getattr(exc, "cause", "START_FAILED"), str(exc))
        if isinstance(exc, SpecError):
            return Outcome.user(f"the lease's spec: {exc}", recoverable=False)
        log.error("worker %s: starting %s failed", self.name, h.action,
                  exc_info=(type(exc), exc, exc.__traceback__))
        self._counts["plugin_errors"] += 1
        return Outcome.system("PLUGIN_ERROR", f"{type(exc).__name__}: {exc}")

    def _stop_quietly(self, plugin, key):
        try:
            plugin.stop(key, "its start failed")
        except Exception:   # a plugin bug must not stop the worker
            log.exception("worker %s: stopping %s failed", self.name, key.hex())

    def _spec(self, wire):
        """``(ActionSpec, cache entry)`` of a lease's spec map (SpecError when it is not
        one). A spec seen before under another id is a copy of the one parsed then, with
        this map's id (a frozen dataclass copied without ``__init__``, ~1 us against ~15 us
        for ``ActionSpec.from_dict`` and ~8 us for its pods and demand)."""
        try:
            key = msgpack.packb([(k, v) for k, v in wire.items() if k != "id"])
        except (AttributeError, TypeError, ValueError, OverflowError):
            return ActionSpec.from_dict(wire), [None, None]     # its own error, if any
        entry = self._parsed.get(key)
        if entry is None:
            entry = [ActionSpec.from_dict(wire), None]
            if len(self._parsed) >= _SPEC_CACHE:
                del self._parsed[next(iter(self._parsed))]
            self._parsed[key] = entry
        spec = entry[0]
        wid = wire.get("id")
        if spec.id != wid:
            if type(wid) is not str:
                return ActionSpec.from_dict(wire), [None, None]
            spec = object.__new__(ActionSpec)
            spec.__dict__.update(entry[0].__dict__)
            spec.__dict__["id"] = wid
        return spec, entry

    def _attempt(self, h, spec, ex, plugin, pods):
        # Paths as _paths makes them; each made only when its plugin needs it (a workdir
        # only where a finalize lease will remove it), each directory with one mkdir.
        if not (plugin.finalizes or plugin.logs):
            return make_attempt(h.token, h.action, h.number, spec, ex, pods, None, None,
                                h.input_ref, h.env)
        workdir = log_path = None
        work, logs, log = self._path_strings(h.action, h.number)
        if plugin.finalizes:
            _make_dir(work)
            workdir = Path(work)
        if plugin.logs:
            # One directory a run, made by its first attempt (a directory an action cost
            # its attempt an ext4 mkdir, 0.3-0.8 ms while the shard's commits sync).
            _make_dir(logs)
            log_path = Path(log)
        return make_attempt(h.token, h.action, h.number, spec, ex, pods, workdir, log_path,
                            h.input_ref, h.env)

    def _path_strings(self, action, attempt):
        # (workdir, its run's log directory, log file) of an attempt. Action ids are
        # segments of [A-Za-z0-9_.-] starting alphanumeric: safe as paths. Strings (joining
        # Path objects cost more than the sim plugin's start).
        run, _, name = action.rpartition("/")
        if len(action) > _SHORT_SEGMENTS:
            # A segment may pass a file system's 255-byte name limit (ids allow 1,024
            # characters): a long one is cut and told apart by a digest of it.
            run = "/".join(map(_path_segment, run.split("/")))
            name = _path_segment(name)
            action = f"{run}/{name}"
        logs = f"{self._logs}/{run}"
        return f"{self._work}/{action}/{attempt}", logs, f"{logs}/{name}.{attempt}.log"

    def _paths(self, action, attempt):
        work, _, log = self._path_strings(action, attempt)
        return Path(work), Path(log)

    def _make_shape(self, spec):
        pods = []
        if spec.pods:
            for g in spec.pods:
                for i in range(g.replicas):
                    pods.append(Pod(g.role, i, dict(g.resources), _memory(g.resources)))
        else:
            res = dict(spec.resources or {})
            pods.append(Pod("main", 0, res, _memory(res)))
        return self._demand_of(spec), tuple(pods)

    def _demand_of(self, spec):
        if spec.pods:
            return sum((self.resources.vector(g.resources) * g.replicas for g in spec.pods),
                       np.zeros(len(self.resources), np.int64))
        return self.resources.vector(spec.resources or {})

    # ------------------------------------------------------------------ bounds

    def _arm(self, h, spec, now):
        t = spec.timeouts
        if t.max_runtime is not None:
            self._timer(now + float(t.max_runtime), h.token, "max_runtime")
        if h.queued_deadline_ns is None and h.deadline_ns is None:
            return
        wall = time.time_ns()
        if h.queued_deadline_ns is not None:
            self._timer(now + (h.queued_deadline_ns - wall) / 1e9, h.token, "max_queued_time")
        if h.deadline_ns is not None:
            self._timer(now + (h.deadline_ns - wall) / 1e9, h.token, "deadline")

    def _timer(self, due, token, bound):
        self._seq += 1
        heapq.heappush(self._timers, (due, self._seq, token, bound))

    def _fire_timers(self, now):
        while self._timers and self._timers[0][0] <= now:
            _due, _s, token, bound = heapq.heappop(self._timers)
            h = self._held.get(token)
            if h is None or h.finalize or h.attempt is None:
                continue
            if bound == "max_queued_time" and h.phase == Phase.RUNNING:
                continue        # it ran in time: the bound no longer applies
            spec = h.attempt.spec
            limit = {"max_runtime": spec.timeouts.max_runtime,
                     "max_queued_time": spec.timeouts.max_queued_time,
                     "deadline": spec.timeouts.deadline}[bound]
            self._stop_attempt(h, f"{bound} reached")
            self._end(h, Outcome(Phase.TIMED_OUT, None, bound,
                                 f"{bound} of {limit}s reached", True), now)

    # ------------------------------------------------------------------ plugin changes

    def _on_changes(self, changes, now):
        """Take a poll's ``changes``, in order: RUNNING is said with the next reports, an
        outcome reported (:meth:`_end`); a success of an attempt without cleanup (a
        fan-out's, the common case) is reported and let go here, without a call of its
        own. A change of an attempt no longer held (stopped, refused) is dropped."""
        held = self._held
        rows = None
        ok = 0
        for ch in changes:
            h = held.get(ch.key)
            if h is None:
                continue            # stopped or refused meanwhile
            out = ch.outcome
            if out is None:
                if ch.phase == _PHASE_RUNNING and h.phase != _PHASE_RUNNING:
                    h.phase = _PHASE_RUNNING
                    self._progress(h, now)
                continue
            if out.phase is not _PHASE_SUCCEEDED or h.cleanup:
                self._end(h, out, now)
                continue
            # _end, _report and _forget of a success, inline.
            if rows is None or rows[0] != h.shard:
                got = self._reports.get(h.shard)
                if got is None:
                    got = self._reports[h.shard] = _Pending()
                rows = (h.shard, got)
            pending = rows[1]
            codes, token = pending.codes, h.token
            if token in codes:
                del codes[token]    # the latest goes last
                pending.details.pop(token, None)
            codes[token] = _SUCCEEDED
            pending.urgent = True
            ok += 1
            del held[token]
            if h.demand is not None:
                shape = self._held_shapes[id(h.demand)]
                shape[1] -= 1
                if not shape[1]:
                    del self._held_shapes[id(h.demand)]
        if ok:
            self._counts["succeeded"] += ok

    def _end(self, h, outcome, now):
        """Report ``outcome`` for ``h`` and let it go (its cleanup comes as a finalize)."""
        detail = None
        if outcome.phase != _PHASE_SUCCEEDED:
            detail = {"error_kind": outcome.error_kind, "cause": outcome.cause,
                      "message": _message(outcome), "recoverable": outcome.recoverable}
        self._counts[_OUTCOME_COUNTER[outcome.phase]] += 1
        if h.cleanup:
            detail = dict(detail or {}, cleanup=True)
        self._report(h, PHASE_CODE[outcome.phase], detail)
        self._forget(h)

    def _forget(self, h):
        if self._held.pop(h.token, None) is not None and h.demand is not None:
            held = self._held_shapes[id(h.demand)]
            held[1] -= 1
            if not held[1]:
                del self._held_shapes[id(h.demand)]

    def _stop_attempt(self, h, reason):
        if h.plugin is not None and h.attempt is not None:
            try:
                h.plugin.stop(h.token, reason)
            except Exception:   # a plugin bug must not stop the worker
                log.exception("worker %s: stopping %s failed", self.name, h.action)
            self._count("stopped")

    # ------------------------------------------------------------------ finalize

    def _finalize(self, h):
        for other in list(self._held.values()):
            if (not other.finalize and other.action == h.action
                    and other.number == h.number):
                self._stop_attempt(other, "cleanup of an ended attempt")
                self._forget(other)
        workdir, _log = self._paths(h.action, h.number)
        try:
            spec, _entry = self._spec(h.spec)
            name = spec.execute.plugin if spec.execute is not None \
                else self.settings.default_plugin
            plugin = self.plugins.get(name) if name else None
            if plugin is not None and spec.execute is not None:
                plugin.cleanup(self._attempt_for_cleanup(h, spec))
            if workdir.exists():
                shutil.rmtree(workdir)
            self._count("cleanups")
            outcome = Outcome.succeeded()
        except (PluginError, OSError, SpecError) as exc:
            outcome = Outcome.system("CLEANUP_FAILED", f"cleanup of {h.action} attempt "
                                     f"{h.number}: {exc}")
        detail = None if outcome.phase == Phase.SUCCEEDED else {
            "error_kind": outcome.error_kind, "cause": outcome.cause,
            "message": outcome.message}
        self._report(h, PHASE_CODE[outcome.phase], detail)
        self._forget(h)

    def _attempt_for_cleanup(self, h, spec):
        workdir, log_path = self._paths(h.action, h.number)
        return Attempt(key=h.token, action=h.action, attempt=h.number,
                       spec=spec, execute=spec.execute, pods=(), workdir=workdir,
                       log_path=log_path, input_ref=h.input_ref, env=h.env)

    # ------------------------------------------------------------------ reports

    def _progress(self, h, now):
        """Say ``h.phase`` (INITIALIZING, RUNNING) with the next reports to its shard, at
        most ``REPORT_HOLD`` after ``now``, unless ``h`` is let go first (its outcome
        says it)."""
        rows = self._reports.get(h.shard)
        if rows is None:
            rows = self._reports[h.shard] = _Pending()
        rows.fresh.append(h)
        if rows.since is None:
            rows.since = now

    def _report(self, h, code, detail=None):
        """Queue the report of an outcome of ``h`` (sent at the end of the turn)."""
        rows = self._reports.get(h.shard)
        if rows is None:
            rows = self._reports[h.shard] = _Pending()
        codes = rows.codes
        token = h.token
        if token in codes:
            del codes[token]    # the latest goes last
            rows.details.pop(token, None)
        codes[token] = code
        if detail is not None:
            rows.details[token] = detail
        rows.urgent = True

    def _flush_reports(self, now=None):
        """Send the reports due: every one when ``now`` is None, else those of shards with
        an outcome to report or a report held ``REPORT_HOLD``."""
        held = self._held
        for index, rows in self._reports.items():
            codes = rows.codes
            if not rows.urgent and (rows.since is None or (
                    now is not None and now < rows.since + REPORT_HOLD)):
                continue
            for h in rows.fresh:
                if h.token not in codes and held.get(h.token) is h:
                    codes[h.token] = _RUNNING if h.phase is _PHASE_RUNNING else _INITIALIZING
            if not codes:
                self._reports[index] = _Pending()
                continue
            sh = self._shards[index]
            details = rows.details
            tokens = b"".join(codes)
            phases = np.fromiter(codes.values(), np.uint8, len(codes))
            out = {k: details[t] for k, t in enumerate(codes) if t in details} \
                if details else None
            self._reports[index] = _Pending()
            if sh.lost_at is not None:
                continue        # the shard was lost: it expired these leases itself
            try:
                msgs = sh.conn.send_report(tokens, phases, out)
            except ShardTimeout as exc:
                log.error("worker %s: %s", self.name, exc)
                continue
            self._count("reports", len(codes))
            self._track(sh, msgs)

    def _track(self, sh, msgs):
        now = time.monotonic()
        for m in msgs:
            self._inflight[(sh.index, m.rid)] = (m, now)

    def _await_reports(self, timeout):
        deadline = time.monotonic() + timeout
        def unanswered():
            return sum(isinstance(m, p.Report) for m, _at in self._inflight.values())

        while unanswered():
            if time.monotonic() >= deadline:
                log.error("worker %s: %d report(s) unanswered at exit", self.name,
                          unanswered())
                return
            for sh in self._shards:
                if sh.conn.socket is not None and sh.conn.socket.poll(20, zmq.POLLIN):
                    for msg in sh.conn.take():
                        self._on_message(sh, msg, time.monotonic())

    # ------------------------------------------------------------------ heartbeats

    def _free(self):
        """``(free, node_free)`` for a heartbeat: the capacity less what the held attempts
        declared, as the cluster's, or as its node's when it is one (``node``)."""
        if not self.settings.report_free:
            return None, None
        free = self.free_capacity()
        return (None, {self.node: free}) if self.node is not None else (free, None)

    def free_capacity(self):
        """What this worker's heartbeats report free (``{resource: quantity}``, with
        ``worker.report_free``): its capacity less what the attempts it holds declared,
        never below zero."""
        held = np.zeros(len(self.resources), np.int64)
        for demand, count in list(self._held_shapes.values()):   # one C pass: thread-safe
            held += demand * count
        return self._quantities(np.maximum(self.capacity - held, 0))

    def _heartbeats(self, now):
        for sh in self._shards:
            if sh.lost_at is not None or now < sh.next_beat:
                continue
            tokens = b"".join(t for t, h in self._held.items() if h.shard == sh.index)
            try:
                msgs = sh.conn.send_heartbeat(tokens, *self._free())
            except ShardTimeout as exc:
                log.error("worker %s: %s", self.name, exc)
                msgs = []
            self._count("heartbeats", len(msgs))
            self._track(sh, msgs)
            sh.next_beat = now + sh.interval

    def _check_shards(self, now):
        for sh in self._shards:
            if sh.lost_at is None and now - sh.last_ok > sh.lease_ttl:
                self._lose(sh, now)
            elif sh.lost_at is not None and now >= sh.retry_at:
                try:
                    self._register(sh, sh.conn.reconnect)
                except (ShardTimeout, ShardError) as exc:
                    log.warning("worker %s: shard %s still unreachable: %s", self.name,
                                sh.conn.endpoint, exc)
                    sh.retry_at = time.monotonic() + 1.0

    def _displaced(self, sh, why):
        # Another worker took this one's name at the shard: serving on would take it back
        # at every request, and both workers' leases would expire. Stop, loudly.
        held = [h for h in self._held.values() if h.shard == sh.index]
        log.error("worker %s: shard %s: %s; stopping the %d attempt(s) held from it and "
                  "exiting", self.name, sh.conn.endpoint, why, len(held))
        for h in held:
            self._stop_attempt(h, "another worker took this one's name")
            self._forget(h)
        self.exit_code = 2
        self._stop.set()

    def _lose(self, sh, now):
        held = [h for h in self._held.values() if h.shard == sh.index]
        log.error("worker %s: shard %s silent for %.1fs (lease ttl %.1fs): stopping the %d "
                  "attempt(s) held from it (their leases expire there and are reassigned)",
                  self.name, sh.conn.endpoint, now - sh.last_ok, sh.lease_ttl, len(held))
        self._count("shard_lost")
        for h in held:
            self._stop_attempt(h, "shard lost")
            self._forget(h)
        for key in [k for k in self._inflight if k[0] == sh.index]:
            del self._inflight[key]
        self._reports.pop(sh.index, None)
        if self.settings.on_shard_lost == "exit":
            self.exit_code = 3
            self._stop.set()
            return
        sh.lost_at = now
        sh.retry_at = now

    # ------------------------------------------------------------------ drain

    def _drain_step(self, now):
        """One turn of a drain; True when it is finished."""
        if not self._drained:
            self._drained = True
            self._drain_deadline = now + self.settings.drain_timeout
            log.info("worker %s: draining (%d held, at most %.0fs)", self.name,
                     len(self._held), self.settings.drain_timeout)
            for sh in self._shards:
                if sh.lost_at is None:
                    try:
                        sh.conn.drain(timeout=self.timeout)
                    except (ShardTimeout, ShardError) as exc:
                        log.error("worker %s: %s", self.name, exc)
        running = [h for h in self._held.values() if not h.finalize]
        if running and now < self._drain_deadline:
            return False
        for h in running:
            self._stop_attempt(h, "drain timeout")
            self._end(h, Outcome.system("EVICTED", f"worker {self.name} drained: still "
                                        f"running after {self.settings.drain_timeout}s"), now)
        self._flush_reports()
        return True

    # ------------------------------------------------------------------ helpers

    def _quantities(self, vec):
        return {n: format_quantity(n, int(v)) for n, v in zip(self.resources.names, vec,
                                                               strict=True)}


#: Action ids up to this long have no path segment that needs cutting (_path_segment).
_SHORT_SEGMENTS = 200
_SEGMENT_KEEP = 160


def _path_segment(segment):
    """``segment`` as a file name: itself up to _SHORT_SEGMENTS characters, else its first
    _SEGMENT_KEEP and a digest of the whole (room is left for ``.ATTEMPT.log``)."""
    if len(segment) <= _SHORT_SEGMENTS:
        return segment
    digest = hashlib.blake2b(segment.encode(), digest_size=8).hexdigest()
    return f"{segment[:_SEGMENT_KEEP]}~{digest}"


def _make_dir(path):
    """``Path(path).mkdir(parents=True, exist_ok=True)`` in one system call when the parent
    exists (a directory an attempt, made on the way to starting it)."""
    try:
        os.mkdir(path)
    except FileExistsError:
        if not os.path.isdir(path):
            raise
    except FileNotFoundError:
        os.makedirs(path, exist_ok=True)


def _memory(resources):
    v = (resources or {}).get("memory")
    return None if v is None else parse_quantity("memory", BYTES, v)


def _message(outcome):
    return outcome.message if outcome.pod is None or outcome.pod in outcome.message \
        else f"pod {outcome.pod}: {outcome.message}"


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
    except (ShardTimeout, ShardError) as exc:
        # The shard's code stays (UNAVAILABLE: no answer), not INTERNAL as if a bug.
        raise CommandError(exc.code, f"worker {w.name}: {exc}") from None

