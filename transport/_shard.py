"""The shard loop: one engine served over one ZeroMQ ROUTER (``docs/shard.md``).

One decision thread owns the engine, the socket and every session. A loop turn:

1. poll the ROUTER (the timeout is the backstop tick's due time) and the committer;
2. settle the turns whose commit returned, oldest first, and only then send what each
   decided: the answers in the order the requests came, the stops, the LEASES pushes, the
   EVENTs;
3. take every message waiting (up to ``BATCH`` of them), decode, authorise, apply each to the
   engine inside one deferred engine turn, collecting the answers in the turn's outbox;
4. tick when an event asked for it (enqueue, register, report, heartbeat freeing capacity,
   abort) or the backstop timer is due, and drain the dispatch channel into the outbox;
5. leave the turn: its group goes to the committer thread (``transport/_committer.py``),
   which writes and syncs it while this thread decides the next turn. At most
   ``transport.commit_pipeline`` turns are in commit at once.

A shard of a config with several endpoints owns the tenants ``transport.tenant_shard`` maps
to its index: a request naming any other tenant is refused whole, before it is applied
(``WRONG_SHARD``, ``transport/_shards.py``).

A failed commit restores the engine's memory to what the store holds, and nothing decided in
that turn or any later one is sent: every request of them is answered UNAVAILABLE (retry)
and their leases are decided again from the restored state. Only the store's I/O runs on the
committer thread; the engine's memory (dirty sets, arrays, the restore) is the decision
thread's alone, which settles each group with ``Engine.settle``.
"""

import collections
import dataclasses
import importlib
import itertools
import logging
import os
import signal
import threading
import time

import numpy as np
import zmq

from engine._codes import PHASES, TERMINAL_PHASES, Phase, Verdict
from engine._commands import CommandError, freeze_heap
from engine._config import Config, load_config
from engine._engine import Engine
from engine._errors import LeaseholdError, NotFound
from engine._model import ActionId
from storage import LmdbStore, StoreError
from transport import _protocol as p
from transport import _schema as sc
from transport._auth import (
    ADMIN,
    INSECURE,
    PermissionDenied,
    Unauthenticated,
    authorize,
    check_tenants,
    message_keys,
    peer_of,
    visible_metrics,
)
from transport._committer import Committer, CommitterStore
from transport._keys import load_keyring
from transport._lease_map import LeaseBatch, LeaseMap
from transport._locks import SHARD_LOCK_NAME, LockHeld, hold_lock
from transport._shards import check_owned, shard_config
from transport._sockets import send, server_socket
from transport._status import SHARD_COUNTERS, StatusWriter
from transport._watch import RECHECK, WatchGap, WatchLog

__all__ = ["Shard", "BATCH"]

log = logging.getLogger("leasehold.shard")

#: Messages taken in one loop turn (one group commit); the rest wait for the next turn.
BATCH = 512
# How long a closing shard's socket keeps trying to deliver answers already sent (ms), and
# how long after its last answer it stays open (s).
CLOSE_LINGER_MS = 1000
CLOSE_GRACE_S = 0.5
_POLLIN = int(zmq.POLLIN)
_SPEC_CACHE = 4096          # enqueue groups whose wire spec is kept for LEASES
# Handlers whose time is counted (Shard.counters): the read paths that grow with a run.
_HANDLER_NS = {p.MsgType.WATCH: "watch_ns", p.MsgType.STATUS: "status_ns"}
_AUTH_COUNTERS = ("handshakes_accepted", "handshakes_refused")

_CODE_OF = {  # engine error class name -> wire code, for errors without a ``code``
    "SpecError": "INVALID_ARGUMENT", "ConfigError": "INVALID_CONFIG",
    "NotFound": "NOT_FOUND", "AlreadyExists": "ALREADY_EXISTS",
}
_KNOWN_CODES = frozenset(p.ERROR_CODES)
# Reported phases that are, once accepted, the action's phase (a failure may be a retry).
_AS_REPORTED = frozenset({Phase.INITIALIZING, Phase.RUNNING, Phase.SUCCEEDED})
# Phases of an action that waits for an assignment.
_WAITING = frozenset({Phase.QUEUED, Phase.WAITING_FOR_RESOURCES})
# Endings whose event carries the engine's reason as its detail.
_FAILURES = frozenset({Phase.FAILED, Phase.TIMED_OUT, Phase.ABORTED})


def _code(exc):
    code = getattr(exc, "code", None)
    if code in _KNOWN_CODES:
        return code
    return _CODE_OF.get(type(exc).__name__, "INVALID_ARGUMENT")


def _plain(value):
    """A value as plain data for a reply body (enums by value, tuples as lists)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):   # a queue's budget vector: a list, not its str()
        return value.tolist()
    if isinstance(value, Phase):
        return value.value
    if hasattr(value, "value") and not isinstance(value, (str, int, float, bool)):
        return value.value
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


class _Conn:
    """One connection (routing id): its requests outstanding this turn, its worker."""

    __slots__ = ("outstanding", "worker", "displaced")

    def __init__(self):
        self.outstanding = 0
        self.worker = None
        self.displaced = None   # the worker id another connection registered after this one


class Shard:
    """Serve one engine (shard ``shard_index`` of ``config``) on a ZeroMQ ROUTER.

    ``endpoint`` overrides ``config.transport.endpoints[shard_index]`` (``tcp://127.0.0.1:0``
    binds an ephemeral port: read :attr:`endpoint` after :meth:`start`). ``store`` and
    ``clock`` go to the :class:`~engine.Engine` (default: the config's LMDB store, the wall
    clock). ``watch_ring``/``watch_runs``/``watch_live`` bound the watch log
    (``transport._watch``: ``RING``, ``MAX_RUNS``, ``MAX_LIVE``).
``freeze_heap`` freezes the heap once the engine is loaded and raises the collector's
thresholds (``engine._commands.freeze_heap``: for a process of its own, as ``leasehold
shard`` runs it).

    :meth:`start` runs the loop on a thread of its own and returns once the socket is bound
    (or raises what stopped it); :meth:`serve` runs it on the calling thread until
    :meth:`stop`. Either way the engine lives on the loop's thread only."""

    def __init__(self, config, shard_index=0, *, endpoint=None, store=None, clock=None,
                 context=None, heartbeat=None, watch_ring=None, watch_runs=None,
                 watch_live=None, freeze_heap=False):
        config = config if isinstance(config, Config) else load_config(config)
        eps = config.transport.endpoints
        if endpoint is None:
            if not 0 <= shard_index < len(eps):
                raise LeaseholdError(f"shard {shard_index}: transport.endpoints has "
                                     f"{len(eps)} endpoint(s)")
            endpoint = eps[shard_index]
        # Several shards cannot share one store (its open claims every partition): each
        # runs on a store directory of its own (transport/_shards.py).
        self.config = shard_config(config, shard_index)
        self.shard_index = shard_index
        # The partition map: this shard owns the tenants that tenant_shard puts on its index
        # among the config's endpoints (every tenant when there is one); it refuses requests
        # about the others (WRONG_SHARD).
        self.n_shards = len(eps)
        self.name = f"{self.config.storage.shard}@{endpoint}"
        self._bind_to = endpoint
        self._store = store
        self._clock = clock
        self._context = context
        self._heartbeat = heartbeat
        self._freeze_heap = freeze_heap     # once loaded: a process of its own (run_shard)
        self._watch_kw = {k: v for k, v in (("ring", watch_ring), ("max_runs", watch_runs),
                                            ("max_live", watch_live)) if v is not None}
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error = None
        self._thread = None
        self.endpoint = None
        # The counters are declared once, in the status file's layout (the two handshake
        # counts are the authenticator's, added to each snapshot).
        self._counters = dict.fromkeys((k for k in SHARD_COUNTERS if k not in _AUTH_COUNTERS),
                                       0)
        # Each counter has one writer at a time (the decision thread; store_commits and
        # commit_ns also the committer thread, whose commits never overlap the decision
        # thread's own), so an increment needs no lock; a snapshot is one dict copy under
        # the GIL.
        self._status = None         # the shared-memory status (transport/_status.py)
        self._loop = None           # the decision thread's state while it serves

    # ------------------------------------------------------------------ running

    def start(self, timeout=30.0):
        """Run the loop on a thread; returns self once bound. Raises what stopped it."""
        self._thread = threading.Thread(target=self._run_safely, name=f"shard-{self.name}",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            self.stop()
            raise LeaseholdError(f"shard {self.name}: not serving after {timeout}s")
        if self._error is not None:
            raise self._error
        return self

    def _run_safely(self):
        try:
            self.serve()
        except BaseException as exc:     # reported to start() / join()
            self._error = exc
            self._ready.set()

    def stop(self, timeout=30.0):
        """Ask the loop to stop (it finishes its turn: commit, sends, close) and wait."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def install_signal_handlers(self):
        """SIGTERM and SIGINT stop the loop cleanly (call from the main thread)."""
        def handler(signum, frame):
            self._stop.set()
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    @property
    def counters(self):
        """A snapshot of the loop's counters: messages received, replies, errors (of which
        protocol errors, authorisation refusals, unauthenticated, RESOURCE_EXHAUSTED),
        leases pushed or unsent, events pushed or unsent, loop turns, store group commits
        (turns that changed nothing write nothing), failed turns, ticks,
        and the ZAP handshakes accepted and refused; and where the loop's time went, in
        nanoseconds summed over its turns: ``decide_ns`` (a turn's messages handled, its
        tick and drain, its group encoded: from the turn's start until its group went to
        commit), ``commit_ns`` (the store's group commits, each with its sync) and
        ``send_ns`` (a committed turn's answers, leases and events sent). The read paths
        whose cost grows with a run's size: ``watch_ns`` and ``status_ns`` (the WATCH and
        STATUS handlers), and the watch re-check's turns (a backstop turn, or one going on
        with the re-check's round): ``recheck_turns`` of them, ``recheck_turn_ns`` their
        decide time (counted in ``decide_ns`` too), ``recheck_ns`` the re-check's part of
        it and ``recheck_reads`` the tracked live actions it re-read. The four re-check
        counters move together (one update at the turn's end), so the difference of two
        snapshots one re-check turn apart is that turn's."""
        out = dict(self._counters)
        auth = getattr(self, "_auth", None)
        out["handshakes_accepted"] = auth.accepted if auth is not None else 0
        out["handshakes_refused"] = auth.refused if auth is not None else 0
        return out

    def _count(self, key, n=1):
        self._counters[key] += n

    def _count_many(self, deltas):
        # One dict update: a snapshot sees all of ``deltas`` or none of them.
        c = self._counters
        c.update({k: c[k] + n for k, n in deltas.items()})

    def _on_commit(self, ns, ok):
        # On the committer thread: the status's commit histogram is updated there too
        # (a reader racing it sees one commit more or less, never a torn figure).
        self._status.record_commit(ns, ok=ok)
        if ok:
            self._count("store_commits")
            self._count("commit_ns", ns)

    def serve(self):
        """Run the loop on this thread until :meth:`stop` (or a signal handler) asks."""
        from transport._auth import Authenticator

        cfg = self.config
        keyring = load_keyring(cfg.security)
        own_ctx = self._context is None
        ctx = zmq.Context() if own_ctx else self._context
        self._auth = None
        sock = None
        eng = None
        try:
            if keyring is not None:
                self._auth = Authenticator(ctx, keyring).start()
            sock = server_socket(ctx, self._bind_to, keyring, self._auth, cfg.transport,
                                 heartbeat=self._heartbeat)
            # A worker reconnecting under its fixed routing id takes its old one over.
            sock.router_handover = 1
            self.endpoint = sock.last_endpoint.decode()
            store = self._store
            if store is None:
                sc = cfg.storage
                store = LmdbStore(sc.path, partitions=sc.partitions, map_size=sc.map_size,
                                  sync=sc.sync, claim_ttl_s=sc.claim_ttl)
            committed = CommitterStore(store, self._on_commit)
            kw = {"store": committed}
            if self._clock is not None:
                kw["clock"] = self._clock
            self._status = StatusWriter(cfg, self.shard_index)
            loading = time.perf_counter()
            eng = Engine(cfg, **kw)
            self._status.set_reload(time.perf_counter() - loading)
            self._loop = _Loop(self, eng, committed, sock, keyring)
            # numpy imports numpy.ma on the first plain np.unique() (~50 ms here): done now,
            # not inside whichever loop turn first deduplicates something.
            importlib.import_module("numpy.ma")
            if self._freeze_heap:
                freeze_heap()
            log.info("shard %s serving on %s", cfg.storage.shard, self.endpoint)
            self._ready.set()
            self._loop.run(self._stop)
        finally:
            if eng is not None:
                try:
                    eng.close()
                except Exception:       # closing after a failure: report the first
                    log.exception("shard %s: closing the engine", self.name)
            if sock is not None:
                # The last turn's answers (and a stopping shard's UNAVAILABLE) may still be
                # queued: they get a bounded time to leave (close(0) dropped them). And a
                # client's socket (ZMQ_IMMEDIATE) discards what it received but has not read
                # yet when the connection closes: the socket stays open a moment after the
                # last answer, so its peer reads it instead of waiting out its timeout.
                loop = self._loop
                if loop is not None:
                    rest = loop.last_send + CLOSE_GRACE_S - time.monotonic()
                    if rest > 0:
                        time.sleep(rest)
                sock.close(linger=CLOSE_LINGER_MS)
            if self._auth is not None:
                self._auth.stop()
            if self._status is not None:
                self._status.close()    # readers see "stopped" and the last figures
            if own_ctx:
                ctx.term()


class _Loop:
    """The decision thread's state: the engine, the socket, sessions, watches."""

    def __init__(self, shard, eng, store, sock, keyring):
        self.shard = shard
        self.eng = eng
        self.store = store          # the engine's store (a CommitterStore), for the committer
        self.sock = sock
        self.last_send = float("-inf")  # when the last answer was sent (monotonic)
        self.keyring = keyring
        cfg = shard.config
        self.settings = cfg.transport
        self.decoder = p.Decoder(cfg.transport)
        self.conns = {}             # routing id -> _Conn (bounded: dropped when idle)
        self.worker_conn = {}       # worker id -> routing id
        self.watch = WatchLog(**shard._watch_kw)
        self.specs = {}             # enqueue group id -> (run, spec map, group)
        # Spec maps as enqueued (by spec id), so a LEASES push need not rebuild them from the
        # compiled spec; bounded, oldest dropped (then the map is rebuilt).
        self.wire_specs = {}
        # Run leases of watched runs: lease id (token word 0: the action's row) ->
        # (generation, run, action, attempt), so a report names its action and attempt
        # without asking the engine or the log.
        # Not capped: one entry a row at most (a new lease of the row replaces it), so the
        # map is bounded by the action table, which is bounded by live work. (A cap that
        # dropped the oldest entries lost the completions of a fan-out with more leases out
        # than it held: a watcher waited for events that were never recorded.)
        self.leases = LeaseMap()
        self.new_leases = LeaseBatch()   # this turn's entries for it (joined at its flush)
        self.box = _Outbox()         # the turn being made (its records: attempt_of)
        self.backstop_s = max(0.005, cfg.engine.heartbeat_interval / 4)
        self.next_backstop = time.monotonic() + self.backstop_s
        # The re-check of tracked live actions (expiry, retry, timeouts) reads RECHECK of
        # them a turn (WatchLog.sweep): a round starts at a backstop tick and, while it has
        # more, goes on in turns of its own, paced to at most a third of the loop's time.
        self.sweep_more = False
        self.next_sweep = 0.0
        self.sweep_due = False
        # A tick that stopped a queue short of its work (candidate budget, full dispatch
        # channel) is followed at once by another, not by the next event or the backstop;
        # ticks that place nothing stop once the deepest such queue has come round.
        self.retick = False
        self.idle_reticks = 0
        self.per_tick = max(1, cfg.engine.max_candidates - 1)
        self.reg = dict(heartbeat_interval=float(cfg.engine.heartbeat_interval),
                        lease_ttl=cfg.engine.lease_ttl_ns / 1e9,
                        max_tokens=cfg.transport.max_tokens)
        self.session_no = 0
        # Pipelined commits (transport/_committer.py): turns decided, their commit not yet
        # settled, oldest first; at most ``depth`` of them.
        self.committer = None
        self.inflight = collections.deque()
        self.depth = cfg.transport.commit_pipeline

    # ------------------------------------------------------------------ the loop

    def run(self, stop):
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        committer = self.committer = Committer(self.store, f"{self.shard.name} committer")
        poller.register(committer.fd, zmq.POLLIN)
        try:
            while not stop.is_set():
                due = min(self.next_backstop, self.next_sweep) if self.sweep_more else \
                    self.next_backstop
                wait = 0.0 if self.retick else max(0.0, min(due - time.monotonic(), 0.1))
                poller.poll(int(wait * 1000) + (0 if wait == 0 else 1))
                self.settle_done()
                msgs = []
                # Asking the socket first (ZMQ_EVENTS) ends the batch without the zmq.Again
                # exception a last non-blocking receive would raise every turn.
                while len(msgs) < BATCH and self.waiting():
                    try:
                        msgs.append(self.sock.recv_multipart(zmq.NOBLOCK, copy=False))
                    except zmq.Again:
                        break
                now = time.monotonic()
                backstop = now >= self.next_backstop
                self.sweep_due = backstop or (self.sweep_more and now >= self.next_sweep)
                if msgs or self.sweep_due or self.retick:
                    self.room()
                    try:
                        self.turn(msgs, backstop)
                    except Exception:   # a bug: log it, keep serving (memory was restored)
                        log.exception("shard %s: loop turn failed", self.shard.name)
                        self.shard._count("failed_commits")
                if self.eng.stopped is not None:
                    # Another shard took the store over: this one owns nothing it holds and
                    # must not linger bound to its endpoint answering UNAVAILABLE. The turns
                    # still in commit are answered first (each was written or refused).
                    self.settle_all()
                    raise StoreError(f"shard {self.shard.name} stopped serving: "
                                     f"{self.eng.stopped}")
                # Published when no turn is in commit, so the status shows durable state
                # (what the last sent answers said); a shard always busy publishes anyway
                # once it is overdue.
                status = self.shard._status
                if status.due() and (not self.inflight or status.overdue()):
                    self.publish_status()
            # A last turn: whatever was decided is committed before the store closes.
            self.room()
            self.turn([], False)
            self.settle_all()
        finally:
            committer.close()
        self.publish_status()

    def waiting(self):
        """Whether a message waits at the socket (it can be received without blocking)."""
        return self.sock.getsockopt(zmq.EVENTS) & _POLLIN

    def room(self):
        """Wait (settling what finished) until fewer than ``commit_pipeline`` turns are in
        commit, so a turn may start; with 1, until the previous turn has left."""
        while len(self.inflight) >= self.depth:
            if not self.committer.wait(60.0):
                raise LeaseholdError(f"shard {self.shard.name}: a group commit has not "
                                     f"returned for 60 s")
            self.settle_done()

    def settle_all(self, timeout=60.0):
        """Settle every turn in commit (the loop is stopping)."""
        deadline = time.monotonic() + timeout
        while self.inflight and time.monotonic() < deadline:
            self.committer.wait(max(0.0, deadline - time.monotonic()))
            self.settle_done()

    def settle_done(self):
        """Settle the turns whose commit finished, in order, and send what each decided."""
        for job in self.committer.done():
            head = self.inflight.popleft()
            assert head is job, "the committer finished jobs out of order"
            try:
                self.settle(job)
            except Exception as exc:
                # A bug (flush has its own guard: this is the rest of settling). Raised
                # here, it would escape the loop (a turn settled outside any turn) and stop
                # the shard, and the jobs after it, taken from the committer already, would
                # never be settled.
                log.exception("shard %s: settling a turn failed", self.shard.name)
                self.salvage(job.outbox, exc)
        if not self.inflight:
            self.committer.resume()     # after a failure, once every skipped turn is back

    def settle(self, job):
        group, box = job.group, job.outbox
        if group.state != "pending":
            if job.written:
                # Discarded by a later turn that failed before its commit, after the
                # committer had written it: memory was restored from the store, which holds
                # it, so what it decided is true and is sent as committed. (Answered
                # UNAVAILABLE, its changes were durable yet never became events, and its
                # leases, handed out in the store, were never pushed.)
                self.flush(box)
                return
            # The engine discarded it (a turn failed and memory was restored) before it was
            # written: its answers say so; memory holds what the store holds.
            self.unavailable(box, "another turn failed and memory was restored")
            return
        if job.skipped:
            # An earlier commit failed and was mended (its store grew): the committer
            # skipped this turn behind it, so it is written here, in order.
            self.conclude(box, self.eng.commit, group)
        else:
            self.conclude(box, self.eng.settle, group, job.error)

    def conclude(self, box, commit, *args):
        """``commit(*args)`` (the engine's commit or settle of a turn's group), then send
        the turn's outbox; on failure memory is what the store holds and nothing of this
        turn (or any later one, all discarded with it) leaves."""
        try:
            commit(*args)
        except (StoreError, LeaseholdError, OSError) as exc:
            self.shard._count("failed_commits")
            log.error("shard %s: commit failed, nothing of its turn sent: %s",
                      self.shard.name, exc)
            self.unavailable(box, f"the commit failed ({exc})")
            return
        except Exception as exc:
            # Anything else the store's commit raised (a bug in it, a MemoryError): the
            # engine restored memory all the same, so it fails this turn like a store
            # error. Raised here, it escaped the loop from settle_done (a commit on the
            # committer thread is settled outside any turn) and the shard thread died.
            self.shard._count("failed_commits")
            log.exception("shard %s: commit failed, nothing of its turn sent",
                          self.shard.name)
            self.unavailable(box, f"the commit failed ({type(exc).__name__}: {exc})")
            return
        self.flush(box)

    def unavailable(self, box, why):
        """Answer every request of a turn that will never leave UNAVAILABLE (retry)."""
        # Memory was restored: what a re-tick would place, it placed in that turn, and the
        # store just failed it; the next message or the backstop ticks again.
        self.retick = False
        box.recorded = True         # none of its records is true: none joins the log
        for i, (rid_conn, msg, is_req) in enumerate(box.out):
            box.sent = i
            if is_req:
                rid = getattr(msg, "rid", None)
                self.send(rid_conn, p.Error(rid=rid, code="UNAVAILABLE",
                                            message=f"shard {self.shard.name}: {why}; retry"))
        box.sent = len(box.out)
        box.pushed = len(box.pushes)    # never pushed: their hand-out was undone
        for c in self.conns.values():
            c.outstanding = 0

    def unreached(self, msgs, why):
        """Answer UNAVAILABLE (retry) the requests among ``msgs`` that a failed turn did not
        reach (nothing of them was applied)."""
        for frames in msgs:
            if len(frames) < 2:
                continue
            try:
                msg = self.decoder.decode(frames[1:])
            except p.ProtocolError as exc:
                rid = exc.rid
            else:
                if msg.TYPE == p.MsgType.BYE:
                    continue
                rid = getattr(msg, "rid", None)
            self.send(frames[0].bytes, p.Error(
                rid=rid, code="UNAVAILABLE", message=f"shard {self.shard.name}: {why}; retry"))

    def publish_status(self):
        """The shared-memory status (transport/_status.py), after the turn's sends."""
        try:
            self.shard._status.publish(self.eng, self.shard.counters)
        except Exception:   # the status goes stale (readers see its age); the shard serves on
            log.exception("shard %s: publishing the status failed", self.shard.name)

    def turn(self, msgs, backstop):
        """One loop turn over ``msgs``; a request that hits a bug is answered INTERNAL and
        the turn runs again without it (its memory was restored)."""
        self.shard._count("received", len(msgs))
        while True:
            try:
                return self._turn(msgs, backstop)
            except _Poison as exc:
                self.shard._count("failed_commits")
                log.error("shard %s: %s", self.shard.name, exc.text)
                self.send(exc.conn, p.Error(rid=exc.rid, code="INTERNAL", message=exc.text))
                msgs = msgs[:exc.index] + msgs[exc.index + 1:]

    def _turn(self, msgs, backstop):
        started = time.perf_counter_ns()
        eng = self.eng
        box = self.box = _Outbox()
        # The handlers collect into the turn's outbox (sent after its commit).
        self.out, self.pushes, self.stops, self.records = box.out, box.pushes, box.stops, \
            box.records
        self.new_leases = box.leases
        self.want_tick = backstop or self.retick
        self.check = set()          # (run, action) whose phase to re-read after the turn
        self.check_all = self.sweep_due or backstop
        self.recheck_ns = None      # set by a re-check of the tracked actions (recheck)
        self.recheck_reads = 0
        self.sweep_due = False
        self.index = None           # the message being applied (None: none is)
        try:
            # Draining hands out this turn's own decisions: its leases wait in the outbox
            # until this group (which holds both the decisions and their hand-out) commits.
            with eng.deferred_turn(hand_out_own=True) as group:
                for i, frames in enumerate(msgs):
                    self.index, self.answered = i, len(box.out)
                    self.handle(frames)
                self.index = None
                if self.want_tick:
                    t0 = time.perf_counter_ns()
                    placed = eng.schedule()
                    self.shard._status.record_tick(time.perf_counter_ns() - t0)
                    self.shard._count("ticks")
                    self.plan_retick(placed)
                    if len(self.watch):
                        self.record_decided()
                box.batch = eng.drain_columns()
                if len(box.batch):
                    self.push_leases(box.batch)
                self.recheck()
            self.shard._count("turns")
        except _Poison:
            for c in self.conns.values():
                c.outstanding = 0
            raise
        except (StoreError, LeaseholdError, OSError) as exc:
            # The turn failed in the engine: memory is what the store holds (every turn
            # still in commit was discarded with it); nothing of this turn may leave.
            self.shard._count("failed_commits")
            log.error("shard %s: turn failed, nothing of it sent: %s", self.shard.name, exc)
            self.unavailable(box, f"the turn failed ({exc})")
            if self.index is not None:
                # It failed applying a message: that one (unless it was answered before it
                # failed) and those after it are not in the outbox, yet are requests of
                # this turn too (they went unanswered, their senders waited out a timeout).
                failed_on = msgs[self.index + any(
                    is_req for _c, _m, is_req in box.out[self.answered:]):]
                self.unreached(failed_on, f"the turn failed ({exc})")
            return
        finally:
            if backstop:
                self.next_backstop = time.monotonic() + self.backstop_s
        box.now_ns = eng.clock.now_ns()
        if group.state != "pending":        # the engine stopped (ownership lost)
            self.unavailable(box, "the shard stopped")
            return
        decided = time.perf_counter_ns() - started
        if self.recheck_ns is None:
            self.shard._count("decide_ns", decided)
        else:
            self.shard._count_many({"decide_ns": decided, "recheck_turns": 1,
                                    "recheck_turn_ns": decided,
                                    "recheck_ns": self.recheck_ns,
                                    "recheck_reads": self.recheck_reads})
        if not self.inflight and (self.depth == 1 or not group.batch or (
                self.settings.idle_commit_inline and not self.waiting())):
            # Nothing before it in commit, and nothing to write, no pipeline, or no message
            # waiting to be decided while it syncs: committed on this thread, so an idle
            # round trip pays no hand-off to the committer thread and back.
            self.conclude(box, eng.commit, group)
            return
        self.inflight.append(self.committer.submit(group, box))

    def plan_retick(self, placed):
        """After a tick: tick again at once when it stopped a queue short of its work
        (``Engine.cut_short``), while ticks place something, and after one that placed
        nothing until the deepest such queue has been examined all the way round (its
        depth / (``max_candidates`` - 1) ticks). Unlike the simulator, a message does not
        start another idle rotation: on a deep queue where nothing fits, with a small
        ``max_candidates``, a rotation a heartbeat kept the loop ticking thousands of times
        a second. Only a tick that places something, or one that cuts nothing short, ends
        the count; later ticks each examine the next ``max_candidates`` of the queue."""
        depth = self.eng.cut_short()
        if not depth:
            self.idle_reticks = 0
            self.retick = False
        elif placed:
            self.idle_reticks = 0
            self.retick = True
        else:
            self.idle_reticks += 1
            self.retick = self.idle_reticks <= -(-depth // self.per_tick)

    def flush(self, box):
        """Send what one committed turn decided, in order: stops, leases, answers, events.
        A bug on the way (an unexpected exception) is logged with its traceback and the
        rest of the turn salvaged (:meth:`salvage`); the loop serves on."""
        try:
            self._flush(box)
        except Exception as exc:
            log.exception("shard %s: sending a committed turn failed", self.shard.name)
            self.salvage(box, exc)

    def salvage(self, box, exc):
        """After a bug while a turn was settled or sent (``exc``, logged): what it committed
        stays; each request of it not answered yet is answered INTERNAL, each of its lease
        pushes not sent counts as unsent (the lease expires and is assigned again, as after
        a push that cannot go), each WATCH replay not sent ends that watch (the watcher
        resumes), and if its watch records had not all joined the log, the logs of their
        runs are dropped: their watchers are refused when they resume (``WatchLost``) and
        re-read the status, instead of missing those changes silently. Never raises."""
        why = (f"shard {self.shard.name}: internal error while sending a committed turn "
               f"(its changes are durable; the shard's log has the traceback): "
               f"{type(exc).__name__}: {exc}")[:self.settings.max_text]
        try:
            for conn, msg, is_req in box.out[box.sent:]:
                if type(msg) is p.Events:
                    self.shard._count("events_unsent", len(msg.actions))
                    self.watch.unwatch(msg.run, conn)
                elif is_req:
                    self.send(conn, p.Error(rid=getattr(msg, "rid", None), code="INTERNAL",
                                            message=why))
            box.sent = len(box.out)
            for _conn, _frames, n in box.pushes[box.pushed:]:
                self.shard._count("leases_unsent", n)
            box.pushed = len(box.pushes)
            if not box.recorded:
                box.recorded = True
                for args in box.records:
                    run = args[0] if type(args) is tuple else args.run
                    self.watch.forget(run)
            for c in self.conns.values():
                c.outstanding = 0
        except Exception:
            log.exception("shard %s: salvaging a turn after an error failed", self.shard.name)

    def _flush(self, box):
        started = time.perf_counter_ns()
        dropped = set()     # (watcher, run) that could not take an EVENTS message of this turn
        # Only now, committed, do this turn's watched leases name their actions (a turn
        # that failed would leave entries naming actions memory no longer holds), and
        # before the pushes leave: a report can only follow its push.
        self.leases.join(box.leases)
        # Stops before leases: an aborted attempt is stopped before its cleanup arrives.
        for conn, frames, n in box.stops:
            self.shard._count("stops_pushed" if send(self.sock, frames, conn)
                              else "stops_unsent", n)
        # Leases before answers: a worker's lease is the next step of an action's path, an
        # answer the end of a request's (each send may wake a peer, on two cores in place
        # of this loop; the enqueue's answer first held its own lease back by that much).
        for i, (conn, frames, n) in enumerate(box.pushes):
            # A push that cannot go (peer gone, queue full) is not retried under this
            # generation: the lease misses its heartbeats and is assigned again.
            box.pushed = i
            self.shard._count("leases_pushed" if send(self.sock, frames, conn)
                              else "leases_unsent", n)
        box.pushed = len(box.pushes)
        for i, (conn, msg, _) in enumerate(box.out):
            box.sent = i                # (what salvage answers if this send raises)
            if type(msg) is p.Events:
                # A WATCH's replay, sent as a push is.
                self.send_events(conn, msg, p.encode(msg), dropped)
                continue
            self.send(conn, msg)
        box.sent = len(box.out)
        # Durable: the turn's watch records join the log (numbered now, so a seq never
        # names a change that was undone); after the leases, which wait for nothing here.
        by_run = {}     # run -> (watchers, its events in seq order: Logged parts)
        for args in box.records:
            if type(args) is _Queued:
                run = args.run
                logged, watchers = self.watch.record_many(run, args.ids, Phase.QUEUED, 0,
                                                          args.now_ns)
            elif type(args) is _Changes:
                run = args.run
                logged, watchers = self.watch.record_changes(run, args.actions, args.phases,
                                                             args.attempts, args.now_ns)
            else:
                run = args[0]
                logged, watchers = self.watch.record(*args) or (None, None)
            if logged is not None and watchers:
                got = by_run.get(run)
                if got is None:
                    by_run[run] = (watchers, [logged])
                else:
                    got[1].append(logged)
        box.recorded = True
        self.push_events(by_run, dropped)
        for c in self.conns.values():
            c.outstanding = 0
        if box.batch is not None:
            self.shard._status.record_turn(box.batch, box.now_ns)
        self.shard._count("send_ns", time.perf_counter_ns() - started)

    def send(self, conn, msg):
        if isinstance(msg, p.Error) and len(msg.message) > self.settings.max_text:
            # It may repeat what was wrong (a long name): over the peer's limit, the answer
            # would be dropped and the request time out instead of failing.
            msg = p.Error(rid=msg.rid, code=msg.code,
                          message=p.clip_text(msg.message, self.settings.max_text))
        try:
            frames = p.encode(msg)
        except (TypeError, ValueError, OverflowError) as exc:
            frames = p.encode(p.Error(rid=getattr(msg, "rid", None), code="INTERNAL",
                                      message=f"reply not encodable: {exc}"))
        if isinstance(msg, p.Error):
            self.shard._count("errors")
            self.shard._status.record_error(msg.code)
        else:
            self.shard._count("replies")
        send(self.sock, frames, conn)
        self.last_send = time.monotonic()

    def reply(self, conn, rid, body=None):
        self.out.append((conn, p.Reply(rid=rid, body=body), True))

    def error(self, conn, rid, code, message):
        self.out.append((conn, p.Error(rid=rid, code=code, message=message), True))

    # ------------------------------------------------------------------ one message

    def handle(self, frames):
        if len(frames) < 2:
            self.shard._count("protocol_errors")
            return              # not even a routing id and a frame: nothing to answer
        conn = frames[0].bytes
        body = frames[1:]
        c = self.conns.get(conn)
        if c is None:
            if len(self.conns) > 65536:
                self._forget_idle()
            c = self.conns[conn] = _Conn()
        try:
            msg = self.decoder.decode(body)
        except p.ProtocolError as exc:
            self.shard._count("protocol_errors")
            self.error(conn, exc.rid, exc.code, exc.text)
            return
        rid = getattr(msg, "rid", None)
        if msg.TYPE != p.MsgType.BYE:
            c.outstanding += 1
            if c.outstanding > self.settings.max_outstanding:
                self.shard._count("exhausted")
                self.error(conn, rid, "RESOURCE_EXHAUSTED",
                           f"{msg.TYPE.name}: more than {self.settings.max_outstanding} "
                           f"requests outstanding on this connection "
                           f"(transport.max_outstanding)")
                return
        try:
            peer = peer_of(body[0], self.keyring)
            authorize(peer, msg)
        except Unauthenticated as exc:
            self.shard._count("unauthenticated")
            self.error(conn, rid, "UNAUTHENTICATED", str(exc))
            return
        except PermissionDenied as exc:
            self.shard._count("refused_auth")
            self.error(conn, rid, "PERMISSION_DENIED", str(exc))
            return
        method = getattr(self, "on_" + msg.TYPE.name.lower())
        timed = _HANDLER_NS.get(msg.TYPE)
        started = time.perf_counter_ns() if timed else 0
        try:
            # Before anything is applied: a request naming a tenant another shard owns is
            # refused whole, so a tenant's runs never split over two shards' stores.
            check_owned(message_keys(msg), self.shard.shard_index, self.shard.n_shards)
            method(conn, c, peer, msg)
        except (StoreError, OSError):
            raise           # the turn fails as a whole
        except LeaseholdError as exc:
            self.error(conn, rid, _code(exc), f"{msg.TYPE.name}: {exc}")
        except Exception as exc:
            if isinstance(exc, (ValueError, TypeError)) and not self.eng.turn_failed:
                # An argument refused before the engine changed anything.
                self.error(conn, rid, "INVALID_ARGUMENT", f"{msg.TYPE.name}: {exc}")
                return
            # A bug (or an error part-way through an engine call): the turn is undone and
            # runs again without this request.
            log.exception("shard %s: %s failed", self.shard.name, msg.TYPE.name)
            raise _Poison(self.index, conn, rid, f"{msg.TYPE.name}: internal error in the shard: "
                                     f"{type(exc).__name__}: {exc}"[:4000]) from exc
        finally:
            if timed:
                self.shard._count(timed, time.perf_counter_ns() - started)

    def _forget_idle(self):
        bound = set(self.worker_conn.values())
        for conn in [k for k in self.conns if k not in bound]:
            del self.conns[conn]

    # ------------------------------------------------------------------ clients

    def on_ping(self, conn, c, peer, msg):
        body = {"shard": self.shard.name, "version": p.VERSION}
        if peer.role in (ADMIN, INSECURE):
            body["counters"] = self.shard.counters   # operators (and benches) read them
        self.reply(conn, msg.rid, body)

    def _keep_spec(self, spec):
        if len(self.wire_specs) >= _SPEC_CACHE:
            self.wire_specs.pop(next(iter(self.wire_specs)))
        self.wire_specs[spec["id"]] = spec

    def on_enqueue(self, conn, c, peer, msg):
        ids = self.eng.enqueue_many(msg.specs)
        out = [str(a) for a in ids]
        for spec in msg.specs[:_SPEC_CACHE]:
            self._keep_spec(spec)
        self.reply(conn, msg.rid, {"ids": out})
        self.want_tick = True
        if len(self.watch):
            # The ids it enqueued (one that existed is a no-op: no event), as the engine's
            # own checks found them (Engine.known asked first read the store twice an id).
            self.record_queued(out if ids.added.all() else
                               [a for a, new in zip(out, ids.added.tolist(), strict=True)
                                if new])

    def on_enqueue_flyte(self, conn, c, peer, msg):
        try:
            from engine.flyte import enqueue_fanouts, flyte_fanouts
        except ImportError as exc:
            raise _Unimplemented(f"this shard cannot read Flyte messages: {exc}") from None
        fanouts = flyte_fanouts(msg.requests, resources=self.eng.config.resources,
                                kind=msg.kind)
        # The tenants are known only now: every action and parent is checked before any
        # is enqueued.
        keys = [key for f in fanouts for key in (
            [f"{f.template.id.rsplit('/', 1)[0]}/{n}" for n in f.names]
            + ([f.template.parent] if f.template.parent else []))]
        check_tenants(peer, "ENQUEUE_FLYTE", keys)
        check_owned(keys, self.shard.shard_index, self.shard.n_shards)
        self._check_flyte_limits(fanouts)
        known = self.known_watched([f"{f.template.id.rsplit('/', 1)[0]}/{n}" for f in fanouts
                                    for n in f.names]) if len(self.watch) else ()
        try:
            out = [str(a) for a in enqueue_fanouts(self.eng, fanouts)]
        except LeaseholdError as exc:
            # A later fan-out refused: the earlier ones are enqueued, and watched (the error
            # names them).
            done = getattr(exc, "enqueued", None)
            if done:
                self.want_tick = True
                self.record_queued(done, known)
            raise
        self.reply(conn, msg.rid, {"ids": out})
        self.want_tick = True
        self.record_queued(out, known)

    def _check_flyte_limits(self, fanouts):
        """Each decoded fan-out within the limits its ENQUEUE_FANOUT would meet and every
        lease of it must meet on its way to a worker: its ids, parent and the spec's names
        within ``transport.max_name``, its inputs within ``max_text`` (an over-long name was
        stored, and every LEASES message carrying it was dropped by the worker, with the
        other leases in it). TOO_LARGE names the request; nothing is enqueued."""
        s = self.settings
        name, text = s.max_name, s.max_text
        first = 0
        for f in fanouts:
            t = f.template
            run = t.id.rsplit("/", 1)[0]
            bad = None
            j = p.long_action_id(run, f.names, name)
            if j is not None:
                bad = (j, f"the action id is {len(run) + 1 + len(f.names[j])} characters, "
                          f"over the limit {name} (transport.max_name)")
            elif t.parent is not None and len(t.parent) > name:
                bad = (0, f"the parent id is {len(t.parent)} characters, over the limit "
                          f"{name} (transport.max_name)")
            elif f.inputs is not None and max(
                    (len(r) for r in f.inputs if r is not None), default=0) > text:
                j = next(j for j, r in enumerate(f.inputs) if r is not None and len(r) > text)
                bad = (j, f"input_uri is {len(f.inputs[j])} characters, over the limit {text} "
                          f"(transport.max_text)")
            else:
                for field, value in sc.spec_names(t):
                    if len(value) > name:
                        bad = (0, f"its {field} is {len(value)} characters, over the limit "
                                  f"{name} (transport.max_name)")
                        break
            if bad is not None:
                raise p.ProtocolError("TOO_LARGE", f"requests[{first + bad[0]}]: {bad[1]}")
            first += len(f.names)

    def on_enqueue_fanout(self, conn, c, peer, msg):
        run = msg.template["id"].rsplit("/", 1)[0]
        done = self.eng.enqueue_fanout(msg.template, msg.names, msg.inputs)
        self._keep_spec(msg.template)
        self.reply(conn, msg.rid, {"n": len(done)})
        self.want_tick = True
        if run in self.watch:
            # The names it enqueued (a name that existed is a no-op: no event), as the
            # engine's own probe found them (Engine.known asked first cost ~2.5 us a name).
            names = msg.names
            added = done.added
            prefix = run + "/"
            self.record_queued(list(map(prefix.__add__, names if added.all() else map(
                names.__getitem__, np.flatnonzero(added).tolist()))), run=run)

    def known_watched(self, ids):
        """The ids (texts; None or another type for a spec without one) of watched runs
        among ``ids`` that the engine knows already (``Engine.known``), read before their
        enqueue: an enqueue of a known id with its spec changes nothing (with another it is
        refused), so it records no event. (Until 2026-12-03 every id an enqueue answered was
        recorded QUEUED of attempt 0: a client's retried enqueue told the watchers that a
        running action, or one that had ended, was queued again.)"""
        watched = [a for a in ids if type(a) is str and a.rsplit("/", 1)[0] in self.watch]
        if not watched:
            return ()
        return {a for a, k in zip(watched, self.eng.known(watched).tolist(), strict=True)
                if k}

    def record_queued(self, ids, known=(), run=None):
        """QUEUED watch records of the enqueued ids (action id texts) of watched runs, but
        for those in ``known`` (:meth:`known_watched`: they existed before; ENQUEUE and
        ENQUEUE_FANOUT pass only the ids their enqueue added instead). ``run``: every id
        is of that watched run (a fan-out's)."""
        if not len(self.watch):
            return
        if run is not None:
            if ids:
                self.records.append(_Queued(run, ids, self.eng.clock.now_ns()))
            return
        by_run = {}
        for a in ids:
            run = a.rsplit("/", 1)[0]
            if run in self.watch and a not in known:
                by_run.setdefault(run, []).append(a)
        # One entry a run (a fan-out's thousands of records in one record_many pass).
        now = self.eng.clock.now_ns()
        for run, run_ids in by_run.items():
            self.records.append(_Queued(run, run_ids, now))

    def on_abort(self, conn, c, peer, msg):
        held = self.eng.live_leases(msg.action)
        ended = [str(a) for a in self.eng.abort(msg.action, msg.reason or "aborted")]
        self.reply(conn, msg.rid, {"ended": ended})
        # Their holders stop now (an unsolicited REFUSED after the commit), not at their
        # next heartbeat; a holder that is not connected learns it from that heartbeat.
        for worker, tokens in held.items():
            wconn = self.worker_conn.get(worker)
            if wconn is None:
                continue
            for lo in range(0, tokens.shape[0], self.settings.max_batch):
                part = tokens[lo:lo + self.settings.max_batch]
                self.stops.append((wconn, p.encode(p.Refused(
                    rid=None, tokens=part,
                    verdicts=np.full(part.shape[0], int(Verdict.ABORTED), np.uint8))),
                    part.shape[0]))
        self.want_tick = True       # ended work frees capacity
        run = msg.action.rsplit("/", 1)[0]
        if run in self.watch:
            self.check.update((a.rsplit("/", 1)[0], a) for a in ended)
            # The run's other tracked actions too (a cleanup ends, a queued one is gone).
            self.check.update((run, a) for a in self.watch.tracked(run))

    def on_status(self, conn, c, peer, msg):
        # In one pass (Engine.phases / states: one by one, 10,000 ids held the loop for
        # 140-160 ms); the attempts only when a run is watched.
        actions = msg.actions
        watching = len(self.watch) > 0
        if watching:
            phases, attempts = self.eng.states(actions)
        else:
            phases, attempts = self.eng.phases(actions), None
        if None in phases:
            # Unknown: the engine's own NOT_FOUND for the first such id.
            missing = actions[phases.index(None)]
            self.eng.phase(missing)
            raise NotFound(f"action {missing} not found")
        self.reply(conn, msg.rid, {"phases": [ph.value for ph in phases]})
        if watching:
            # A watcher reads STATUS once after subscribing (Client.wait): what it found
            # still running may have been assigned before the watch began, so no report
            # of it would be recorded; the backstop re-check follows it from now on, from
            # its attempt now (until 2026-12-03 from attempt 0: the events of one assigned
            # before said attempt 0 until its next assignment).
            by_run = {}             # watched run -> indexes of its ids, in order
            last = hit = None
            for i, a in enumerate(actions):
                run = a.rpartition("/")[0]
                if run != last:
                    last = run
                    hit = by_run.get(run)
                    if hit is None and run in self.watch:
                        hit = by_run[run] = []
                if hit is not None:
                    hit.append(i)
            for run, idx in by_run.items():
                ph = [phases[i] for i in idx]
                self.watch.track_many(run, [actions[i] for i in idx], ph,
                                      _wire_attempts(ph, [attempts[i] for i in idx]))

    def on_explain(self, conn, c, peer, msg):
        e = self.eng.explain(msg.action)
        body = {f.name: _plain(getattr(e, f.name)) for f in dataclasses.fields(e)} \
            if dataclasses.is_dataclass(e) else _plain(e._asdict())
        self.reply(conn, msg.rid, body)

    def on_queue_metrics(self, conn, c, peer, msg):
        m = self.eng.queue_metrics(msg.queue)
        self.reply(conn, msg.rid, _plain(visible_metrics(peer, m)))

    def on_queue_update(self, conn, c, peer, msg):
        q = self.eng.update_queue(msg.queue, **msg.changes)
        self.reply(conn, msg.rid, _plain(dataclasses.asdict(q)))
        self.want_tick = True
        self.shard._status.mark_dirty()     # published after this turn, whatever the interval

    def on_watch(self, conn, c, peer, msg):
        fresh = msg.run not in self.watch
        try:
            latest, events = self.watch.watch(msg.run, conn, msg.since)
        except WatchGap as exc:
            self.error(conn, msg.rid, "NOT_FOUND", str(exc))
            return
        if fresh:
            # The run's changes before its first WATCH (in this process: a restart starts
            # every log afresh) were not recorded: have the re-check follow what is live,
            # from its phase and attempt now (read in one pass: one by one, a run of 10,000
            # live actions held the loop for 230 ms).
            ids, phases, attempts = self.eng.live_states(msg.run, self.watch.max_live)
            self.watch.track_many(msg.run, ids, phases, _wire_attempts(phases, attempts))
        # "first": the seq the replay starts at (latest + 1 when it is empty), so a watcher
        # from since=0 knows which seq comes next and sees a gap even before its first event.
        self.reply(conn, msg.rid, {"seq": latest, "first": events[0].seq if events else latest + 1})
        for batch in self._batches(msg.run, events):    # the replay, after the reply
            self.out.append((conn, batch, False))

    def on_unwatch(self, conn, c, peer, msg):
        self.watch.unwatch(msg.run, conn)
        self.reply(conn, msg.rid)

    # ------------------------------------------------------------------ workers

    def on_register(self, conn, c, peer, msg):
        current = self.worker_conn.get(msg.worker)
        if c.displaced == msg.worker and current not in (None, conn) and current in self.conns:
            # Registered again from another connection since: two live workers share one
            # name, each taking the name back from the other at its next request (every
            # lease of both then expired). The later one keeps it; this one is told so.
            raise _Displaced(_displaced_text(msg.worker))
        self.eng.register_worker(msg.worker, msg.cluster, msg.slots, capacity=msg.capacity)
        c.displaced = None
        old = current
        if old is not None and old != conn and old in self.conns:
            self.conns[old].worker = None
            self.conns[old].displaced = msg.worker
        self.worker_conn[msg.worker] = conn
        c.worker = msg.worker
        self.session_no += 1
        self.out.append((conn, p.Registered(rid=msg.rid, worker=msg.worker,
                                            session=self.session_no, **self.reg), True))
        self.want_tick = True

    def _worker(self, conn, c, msg):
        if c.worker is None and c.displaced is not None:
            raise _Displaced(f"{msg.TYPE.name}: {_displaced_text(c.displaced)}")
        if c.worker is None or self.worker_conn.get(c.worker) != conn:
            raise _NotRegistered(f"{msg.TYPE.name}: this connection has not registered a "
                                 f"worker (send REGISTER first)")
        return c.worker

    def on_heartbeat(self, conn, c, peer, msg):
        worker = self._worker(conn, c, msg)
        # An empty heartbeat still counts: its free capacity (an idle worker's is the only
        # report that the capacity its last leases held is free again) and its proof that
        # the worker is alive (a worker paused after an expiry takes work again).
        refused = self.eng.heartbeat(worker, msg.tokens, msg.free, msg.node_free)
        self.shard._status.record_refusals("heartbeat", refused)
        self.out.append((conn, _refused(msg.rid, refused), True))
        if msg.free is not None or msg.node_free is not None or refused:
            self.want_tick = True       # capacity seen, or work ended

    def on_report(self, conn, c, peer, msg):
        worker = self._worker(conn, c, msg)
        n = msg.tokens.shape[0]
        codes = msg.phases.tolist()
        phases = [PHASES[x] for x in codes]
        kw = {}
        if msg.details:
            cols = {k: [None] * n for k in ("error_kinds", "causes", "messages")}
            cols["recoverable"] = [True] * n
            cols["cleanup"] = [False] * n
            cols["messages"] = [""] * n
            for d in msg.details:
                i = d["i"]
                for wire, col in (("error_kind", "error_kinds"), ("cause", "causes"),
                                  ("message", "messages"), ("recoverable", "recoverable"),
                                  ("cleanup", "cleanup")):
                    if d.get(wire) is not None:
                        cols[col][i] = d[wire]
            kw = cols
        # One phase for the whole batch (a worker's successes): given once, so the engine
        # checks it once instead of per report.
        same = not kw and n and codes.count(codes[0]) == n
        # What each report names, read before they are applied (the engine names only
        # live leases): when the lease map names them all, of one run (a fan-out's), in
        # columns; else a name a report.
        watching = len(self.watch) > 0
        named = self.leases.named_run(msg.tokens) if watching else None
        names = self._lease_names(msg.tokens) if watching and named is None else None
        refused = self.eng.report_many(msg.tokens, phases[0] if same else phases,
                                       worker=worker, **kw)
        self.shard._status.record_refusals("report", refused)
        self.out.append((conn, _refused(msg.rid, refused), True))
        self.want_tick = True
        if not watching:
            return
        if named is not None and same and not refused and phases[0] in _AS_REPORTED:
            # All accepted, of one phase the actions are now in (a worker's successes):
            # the records and the lease map's removals without a step a report.
            run, aids, attempts = named
            changes = _Changes(run, self.eng.clock.now_ns())
            changes.extend(aids, phases[0], attempts)
            self.records.append(changes)
            if phases[0] in TERMINAL_PHASES:
                self.leases.drop(msg.tokens[:, 0])
            return
        if names is None:
            names = self.leases.names(msg.tokens)   # (every one in the map: no engine read)
        self._watched_reports(msg.tokens, names, phases, refused, msg.details)

    def _lease_names(self, tokens):
        """``(run, action, attempt)`` of each token's lease where its run is watched (None
        elsewhere), read before the reports are applied (the engine names only live
        leases): from the lease map, else, for a lease it does not hold (pushed before its
        run was first watched: ``Client.wait`` subscribes after its enqueue), from the
        engine (``Engine.lease_actions``), its attempt then None (not known here)."""
        # The entry is this lease's only if the generations agree (a stale token of the
        # row, or an entry left by a lease that expired unreported, is not).
        names = self.leases.names(tokens)
        miss = [i for i, name in enumerate(names) if name is None]
        watched = self.watch.watched() if miss else ()
        if watched:
            for i, aid in zip(miss, self.eng.lease_actions(tokens[miss], watched),
                              strict=True):
                if aid is not None:
                    names[i] = (None, aid.rsplit("/", 1)[0], aid, None)
        return names

    def _watched_reports(self, tokens, names, phases, refused, details=None):
        """The watch records of a report message's accepted reports of watched runs
        (``names`` from :meth:`_lease_names`), in the message's order; a failure's (it may
        be a retry) from the phase the engine shows at once, before this turn's tick may
        lease a retry again (``details``: the message's, for the failure's text)."""
        skip = _refused_copies(tokens, names, refused) if refused else ()
        by_run = {}
        failed = []
        ended = []
        for i, name in enumerate(names):
            if name is None or i in skip:
                continue
            _gen, run, aid, attempt = name
            ph = phases[i]
            if ph in _AS_REPORTED:
                # An accepted report of these is the phase the action is now in: no need
                # to ask the engine (which would give a lean row its record). Its attempt
                # is its lease's (kept with the lease when it was pushed).
                changes = by_run.get(run)
                if changes is None:
                    changes = by_run[run] = _Changes(run, self.eng.clock.now_ns())
                changes.add(aid, ph, attempt if attempt is not None else
                            self.attempt_of(run, aid))
            else:
                failed.append((run, aid))
                self.check.add((run, aid))  # and after the turn (an abort's cleanup)
            if ph in TERMINAL_PHASES:
                ended.append(i)
        if ended:
            self.leases.drop(tokens[ended, 0])
        self.records.extend(by_run.values())
        if failed:
            # Read now: a retry due at once is leased again by this turn's tick, and read
            # after it the action was INITIALIZING again, so the failure of the attempt
            # before never became an event (docs/protocol.md promises QUEUED on a retry).
            why = {}
            for d in details or ():
                text = ": ".join(x for x in (d.get("cause"), d.get("message")) if x)
                name = names[d["i"]]
                if text and name is not None:
                    why[name[2]] = text
            self.reread(failed, self.eng.clock.now_ns(), why)

    def on_bye(self, conn, c, peer, msg):
        if msg.drain:
            self.eng.drain_worker(self._worker(conn, c, msg))
            self.reply(conn, msg.rid)
            return
        if c.worker is not None and self.worker_conn.get(c.worker) == conn:
            self.eng.unregister_worker(c.worker)
            del self.worker_conn[c.worker]
        c.worker = None
        self.conns.pop(conn, None)

    # ------------------------------------------------------------------ leases

    def push_leases(self, batch):
        """LEASES messages, one a worker (at most max_batch rows each), sent after commit."""
        workers = batch.worker
        distinct = dict.fromkeys(workers.tolist())
        for w in distinct:
            # (one worker, the common case: every row, no comparison)
            idx = np.arange(len(workers)) if len(distinct) == 1 else \
                np.flatnonzero(workers == w)
            wid = batch.worker_id(int(idx[0]))
            conn = self.worker_conn.get(wid)
            for lo in range(0, idx.size, self.settings.max_batch):
                part = idx[lo:lo + self.settings.max_batch]
                if conn is None:
                    self.shard._count("leases_unsent", int(part.size))
                    continue
                for frames, n in self._lease_frames(batch, part):
                    self.pushes.append((conn, frames, n))
        if len(self.watch):
            self._watched_leases(batch)

    def _lease_frames(self, batch, part):
        """``[(frames, leases)]``: the LEASES of rows ``part`` of ``batch``, halved until each
        message is within the frame limits a worker decodes with (leases of many distinct,
        large specs could pass them; the worker would drop the message whole)."""
        frames = p.encode(self._leases(batch, part))
        s = self.settings
        if part.size > 1 and (len(frames[1]) > s.max_header_bytes or any(
                memoryview(f).nbytes > s.max_frame_bytes for f in frames[2:])):
            half = part.size // 2
            return (self._lease_frames(batch, part[:half])
                    + self._lease_frames(batch, part[half:]))
        return [(frames, int(part.size))]

    def _watched_leases(self, batch):
        """The INITIALIZING watch records of the run leases of ``batch`` whose runs are
        watched, in the batch's order, and the lease map entries that name their actions
        when they are reported: a segment of consecutive leases of one enqueue group (a
        fan-out's, usually the whole batch) at a time, no Python loop over its leases
        beyond making their ids (text, from the group's names: no ActionId a lease)."""
        runs = np.flatnonzero(batch.kind == 0)   # (a finalize lease changes no action)
        if not runs.size:
            return
        now = self.eng.clock.now_ns()
        gids = batch.group[runs]
        cuts = np.flatnonzero(gids[1:] != gids[:-1]) + 1
        watched = {}            # group id -> (run key, names, its changes), None: unwatched
        by_run = {}
        initializing = Phase.INITIALIZING   # (an enum member read is a metaclass lookup)
        new_leases = self.new_leases
        for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), runs.size], strict=True):
            seg = runs[lo:hi]
            gid = int(gids[lo])
            hit = watched.get(gid, False)
            if hit is False:
                g = batch.group_of(int(seg[0]))
                run = g.compiled.id.run_key
                if run in self.watch:
                    changes = by_run.get(run)
                    if changes is None:
                        changes = by_run[run] = _Changes(run, now)
                    hit = (run, g.names, changes)
                else:
                    hit = None
                watched[gid] = hit
            if hit is None:
                continue
            run, names, changes = hit
            prefix = run + "/"
            aids = list(map(prefix.__add__, map(names.__getitem__,
                                                batch.index[seg].tolist())))
            # The lease map's entries: lease id -> (generation, run, action, attempt).
            new_leases.add(batch.tokens[seg, 0], batch.tokens[seg, 1], run, aids,
                           batch.attempt[seg])
            changes.extend(aids, initializing, batch.attempt[seg].tolist())
        self.records.extend(by_run.values())

    def _leases(self, batch, idx):
        # Groups in order of first appearance: lists and a dict, no sort (a LEASES message
        # of one lease, the idle round trip, costs what its one group costs).
        gids = batch.group[idx]
        if gids.size and (gids == gids[0]).all():
            # One group (a fan-out's leases, the common case): no step a lease.
            slot, firsts = {int(gids[0]): 0}, [int(idx[0])]
            inverse = np.zeros(idx.size, np.int32)
        else:
            slot, firsts = {}, []  # group id -> its index in groups; first entry of each
            inverse = []
            for i, gid in zip(idx.tolist(), gids.tolist(), strict=True):
                k = slot.get(gid)
                if k is None:
                    k = slot[gid] = len(firsts)
                    firsts.append(i)
                inverse.append(k)
            inverse = np.array(inverse, dtype=np.int32)
        groups, objs, bounds = [], [], []
        for gid, first in zip(slot, firsts, strict=True):
            g = batch.group_of(first)
            objs.append(g)
            entry = self.specs.get(gid)
            if entry is None or entry[2] is not g:
                aid = batch.action(first)
                spec = self.wire_specs.pop(str(g.compiled.spec.id), None)
                if spec is None:
                    spec = _plain(dataclasses.asdict(g.compiled.spec))
                entry = (aid.run_key, spec, g)
                if len(self.specs) >= _SPEC_CACHE:
                    self.specs.pop(next(iter(self.specs)))
                self.specs[gid] = entry
            env = g.compiled.env_key
            groups.append({"run": entry[0], "spec": entry[1]} if env is None else
                          {"run": entry[0], "spec": entry[1], "env": env})
            t = g.compiled.spec.timeouts
            bounds.append((t.deadline, t.max_queued_time))
        n = idx.size
        deadline = np.full(n, -1, np.int64)
        queued = np.full(n, -1, np.int64)
        if any(d is not None or q is not None for d, q in bounds):
            run = batch.kind[idx] == 0      # a finalize lease has neither bound
            for k, (d, q) in enumerate(bounds):
                sel = (inverse == k) & run
                if d is not None:
                    deadline[sel] = batch.first_enqueued_ns[idx[sel]] + int(d * 1e9)
                if q is not None:
                    queued[sel] = batch.attempt_enqueued_ns[idx[sel]] + int(q * 1e9)
        # Names (and input references) by group and index: lists, no numpy scalar a lease.
        at = batch.index[idx].tolist()
        if len(objs) == 1:
            names = list(map(objs[0].names.__getitem__, at))
        else:
            at = list(zip(inverse.tolist(), at, strict=True))
            names = [objs[k].names[j] for k, j in at]
        inputs = None
        if any(g.inputs is not None for g in objs):
            inputs = (list(map(objs[0].input_ref, at)) if len(objs) == 1 else
                      [objs[k].input_ref(j) for k, j in at])
            if all(ref is None for ref in inputs):
                inputs = None
        # The node hint (admission = "nodes"): each lease's pods' nodes, nil for the others.
        hints = batch.nodes
        nodes = [list(hints[i]) if i in hints else None for i in idx.tolist()] if hints else None
        return p.Leases(tokens=batch.tokens[idx], kind=batch.kind[idx],
                        attempt=batch.attempt[idx], group=inverse,
                        deadline_ns=deadline, queued_deadline_ns=queued, groups=groups,
                        names=names, inputs=inputs,
                        nodes=nodes if nodes and any(n is not None for n in nodes) else None)

    # ------------------------------------------------------------------ watches

    def record(self, run, action, phase, attempt, now, detail=None):
        self.records.append((run, action, phase, attempt, now, detail))

    def attempt_of(self, run, action):
        # The log learns a turn's records only after its commit: an attempt recorded
        # earlier in this turn is in its outbox's records, one of a turn still in commit in
        # that turn's (newest first; a discarded turn's do not count), not yet in the log.
        att = self.box.attempts().get(action)
        if att is not None:
            return att
        for job in reversed(self.inflight):
            if job.group.state == "pending":
                att = job.outbox.attempts().get(action)
                if att is not None:
                    return att
        return self.watch.attempt_of(run, action)

    def record_decided(self):
        """The watch records of what the tick changed on its own (``Engine.decided_changes``:
        timers, lease expiry, unschedulable), as of each change, before the records of its
        leases: a retry the tick leased again is seen QUEUED (of the failed attempt, its
        failure the detail) before INITIALIZING of the next. (Until 2026-12-03 only the
        re-check read them, after the tick, or at a later backstop: an expiry or a timeout
        whose retry was leased again by then showed RUNNING of attempt n, then INITIALIZING
        of n+1.)"""
        ids, phases, attempts, details = self.eng.decided_changes()
        if not ids:
            return
        now = self.eng.clock.now_ns()
        cut = self.settings.max_text
        for aid, phase, att, detail in zip(ids, phases, _wire_attempts(phases, attempts),
                                           details, strict=True):
            run = aid.rpartition("/")[0]
            if run in self.watch:
                self.record(run, aid, phase, att, now, detail[:cut] if detail else None)

    def recheck(self):
        """Re-read the phase of actions the turn may have changed (reports, aborts) and, on
        a backstop tick or a turn going on with its round, the next part of the tracked live
        actions (expiry, retry, timeouts: :meth:`sweep`)."""
        if not len(self.watch):
            return
        started = time.perf_counter_ns()
        if self.check:
            self.reread(list(self.check), self.eng.clock.now_ns())
        if self.check_all:
            self.sweep()
            self.recheck_ns = time.perf_counter_ns() - started

    def sweep(self):
        """The next RECHECK tracked live actions of the re-check's round (``WatchLog.sweep``),
        each read and recorded where its phase moved on from the last recorded; the round
        goes on in the next turns (``sweep_more``). Reading every one in one backstop turn
        (up to 1,024 logs x 10,000 actions) held the loop for seconds: 8 runs of 10,000
        took 970 ms a turn, every 250 ms, and a PING's p50 was 510 ms."""
        started = time.monotonic()
        part, done = self.watch.sweep(RECHECK)
        if part:
            # Not those whose end a record not in the log yet says (the log learns it after
            # the commit): an ended action does not change, and a reclaimed row's outcome
            # is a store read. Nor those this turn re-read already.
            pending, ended = self._pending_actions()
            check = self.check
            part = [x for x in part if x[1] not in ended and x not in check]
            self.reread(part, self.eng.clock.now_ns(), pending=pending)
        self.recheck_reads = len(part)
        self.sweep_more = not done
        if not done:
            self.next_sweep = time.monotonic() + max(0.005, 2 * (time.monotonic() - started))

    def _pending_actions(self):
        """``(actions, ended)``: the actions named by watch records not in the log yet (this
        turn's, and those of the turns in commit), and those of them a record ends."""
        acts, ended = set(), set()
        boxes = [job.outbox.records for job in self.inflight if job.group.state == "pending"]
        boxes.append(self.records)
        for records in boxes:
            for r in records:
                kind = type(r)
                if kind is tuple:
                    acts.add(r[1])
                    if r[2] in TERMINAL_PHASES:
                        ended.add(r[1])
                elif kind is _Changes:
                    acts.update(r.actions)
                    ended.update(a for a, ph in zip(r.actions, r.phases, strict=True)
                                 if ph in TERMINAL_PHASES)
                else:
                    acts.update(r.ids)
        return acts, ended

    def reread(self, todo, now, why=None, pending=None):
        """Record the phase the engine shows now of each ``(run, action)`` of ``todo`` (a
        repeat of the last recorded is dropped when the records join the log); the detail
        of an ending is its reason, that of a retry (QUEUED again) its failure's text when
        ``why`` (action -> text) has it. With ``pending`` (the actions with records not in
        the log yet), an action not among them whose phase is the last the log recorded
        makes no record (the re-check's common case: nothing moved)."""
        # The phases alone, in one pass (explain's reason and queue position are not needed,
        # and a queued action's position is a scan of the table); the reason of an ending.
        try:
            phases = self.eng.phases([action for _run, action in todo])
        except LeaseholdError:      # one unreadable record: ask one by one, skip it
            phases = [self._phase_or_none(action) for _run, action in todo]
        last = self.watch.last
        for (run, action), phase in zip(todo, phases, strict=True):
            if phase is None:
                continue
            if pending is not None and action not in pending:
                seen = last(run, action)
                if seen is not None and seen[0] is phase:
                    continue
            detail = None
            if phase in _FAILURES:
                try:
                    detail = self.eng.explain(action).reason
                except LeaseholdError:
                    continue
            elif why and phase in _WAITING:
                detail = why.get(action)
            att = self.attempt_of(run, action)
            self.record(run, action, phase, att, now,
                        detail[:self.settings.max_text] if detail else None)

    def _phase_or_none(self, action):
        try:
            return self.eng.phase(action)
        except LeaseholdError:
            return None

    def _batches(self, run, logged):
        """EVENTS messages of consecutive events of ``run`` (``logged``: the log's
        :class:`~transport.Logged` parts, in seq order), at most max_batch events each."""
        step = self.settings.max_batch
        parts, n = [], 0
        for c in logged:
            lo, size = 0, len(c)
            while lo < size:
                take = min(step - n, size - lo)
                parts.append(c if take == size else c.part(lo, lo + take))
                lo += take
                n += take
                if n == step:
                    yield _events(run, parts)
                    parts, n = [], 0
        if parts:
            yield _events(run, parts)

    def push_events(self, by_run, dropped):
        """Push ``{run: (watchers, [Logged])}``: one EVENTS message a run a turn (its events
        are consecutive: nothing else numbers them), to each of its watchers (those of the
        turn's first message of it: one dropped on the way counts its share of the later
        ones unsent)."""
        for run, (watchers, events) in by_run.items():
            targets = list(watchers)
            for msg in self._batches(run, events):
                frames = p.encode(msg)
                for conn in targets:
                    self.send_events(conn, msg, frames, dropped)

    def send_events(self, conn, msg, frames, dropped):
        """Send EVENTS ``msg`` (``frames``, encoded once for every watcher) to watcher
        ``conn``, a WATCH's replay or a push: its events count as sent (``events``) or not
        (``events_unsent``). One that cannot go (the watcher is gone, or its queue is full)
        ends that watch (its log stays: the client resumes with WATCH since=its last seq,
        at its refresh); it is noted in ``dropped`` (``(conn, run)``, one turn's sends), and
        the later messages of the run to that watcher in the turn count as unsent without
        being tried (one would arrive after a gap). Returns whether it went."""
        n = len(msg.actions)
        key = (conn, msg.run)
        if key not in dropped:
            if send(self.sock, frames, conn):
                self.shard._count("events", n)
                return True
            self.watch.unwatch(msg.run, conn)
            dropped.add(key)
        self.shard._count("events_unsent", n)
        return False


def _wire_attempts(phases, attempts):
    """Each event's ``attempt`` for actions in ``phases`` whose current attempts (the
    engine's numbers) are ``attempts``: that attempt once assigned; while it waits to be
    (first queued, or queued again for a retry), the one before (0 before the first
    assignment, the failed one on a retry), as the watch numbers them (docs/protocol.md,
    "EVENT")."""
    out = []
    given = waiting = None
    for ph, n in zip(phases, attempts, strict=True):
        if ph is not given:         # (a Phase hashes in Python: once a run of equal ones)
            given, waiting = ph, ph in _WAITING
        out.append(n - 1 if waiting else n)
    return out


def _refused_copies(tokens, names, refused):
    """Indexes of the refused reports among the named ones: for a token refused r times,
    its last r copies (a message may carry a token twice: the first copy applies, a later
    one is refused as COMPLETED, and only that one is dropped)."""
    left = collections.Counter(r.token for r in refused)
    skip = set()
    for i in range(len(names) - 1, -1, -1):
        if names[i] is None:
            continue
        tb = tokens[i].astype("<u8").tobytes()
        if left.get(tb, 0) > 0:
            left[tb] -= 1
            skip.add(i)
    return skip


def _events(run, parts):
    """The EVENTS message of ``parts`` (consecutive :class:`~transport.Logged` of ``run``):
    their columns joined, a part's one time repeated for each of its events."""
    if len(parts) == 1:
        c = parts[0]
        return p.Events(run=run, seq=c.seq, actions=c.actions, phases=c.codes,
                        attempts=c.attempts,
                        time_ns=np.full(len(c), c.time_ns, np.int64), details=c.details)
    details = None
    if any(c.details is not None for c in parts):
        details = []
        for c in parts:
            details.extend(c.details if c.details is not None else [None] * len(c))
    return p.Events(run=run, seq=parts[0].seq,
                    actions=list(itertools.chain.from_iterable(c.actions for c in parts)),
                    phases=np.concatenate([c.codes for c in parts]),
                    attempts=np.concatenate([c.attempts for c in parts]),
                    time_ns=np.repeat(np.array([c.time_ns for c in parts], np.int64),
                                      [len(c) for c in parts]),
                    details=details)


class _Changes:
    """The watch records of one report message's actions of one run (their phases as
    reported), applied to the log in one :meth:`WatchLog.record_changes` pass."""

    __slots__ = ("run", "now_ns", "actions", "phases", "attempts")

    def __init__(self, run, now_ns):
        self.run, self.now_ns = run, now_ns
        self.actions, self.phases, self.attempts = [], [], []

    def add(self, action, phase, attempt):
        self.actions.append(action)
        self.phases.append(phase)
        self.attempts.append(attempt)

    def extend(self, actions, phase, attempts):
        """:meth:`add` of each of ``actions`` in ``phase``, with its entry of ``attempts``."""
        self.actions.extend(actions)
        self.phases.extend([phase] * len(actions))
        self.attempts.extend(attempts)


class _Queued:
    """The QUEUED watch records of one enqueue's actions of one run: one entry, not one an
    action."""

    __slots__ = ("run", "ids", "now_ns")

    def __init__(self, run, ids, now_ns):
        self.run, self.ids, self.now_ns = run, ids, now_ns


class _Outbox:
    """What one loop turn sends once its commit returned: the answers (in request order),
    the REFUSED stops, the LEASES pushes, the watch records (events), the dispatch batch
    (for the status)."""

    __slots__ = ("out", "pushes", "stops", "records", "leases", "_attempts", "_attempts_of",
                 "batch", "now_ns", "sent", "pushed", "recorded")

    def __init__(self):
        self.out = []           # (routing id, message, request?)
        self.pushes = []        # (routing id, frames, leases)
        self.stops = []         # (routing id, frames, tokens) of aborted leases
        self.records = []       # watch records, applied to the log after the commit
        self.leases = LeaseBatch()  # watched leases pushed: (gen, run, action, attempt)
        # action -> attempt of its records, made from them when first asked (attempt_of:
        # rare) and kept up to date with the records added since.
        self._attempts = {}
        self._attempts_of = 0
        self.batch = None
        self.now_ns = 0
        # How far its sending got (for salvage, after a bug): answers sent (box.out[:sent]),
        # lease pushes sent, whether its watch records joined the log.
        self.sent = 0
        self.pushed = 0
        self.recorded = False

    def attempts(self):
        """Action -> the attempt its latest watch record of this turn names."""
        att, records = self._attempts, self.records
        for rec in records[self._attempts_of:]:
            kind = type(rec)
            if kind is _Queued:
                att.update(dict.fromkeys(rec.ids, 0))
            elif kind is _Changes:
                att.update(zip(rec.actions, rec.attempts, strict=True))
            else:
                att[rec[1]] = rec[3]
        self._attempts_of = len(records)
        return att


class _Poison(Exception):
    """A request that raised something unexpected: the turn is undone."""

    def __init__(self, index, conn, rid, text):
        super().__init__(text)
        self.index, self.conn, self.rid, self.text = index, conn, rid, text


class _NotRegistered(LeaseholdError):
    code = "NOT_FOUND"


class _Unimplemented(LeaseholdError):
    code = "UNIMPLEMENTED"


class _Displaced(LeaseholdError):
    code = "ALREADY_EXISTS"


def _displaced_text(worker):
    return (f"worker {worker!r} was {p.DISPLACED} after this one: a "
            f"worker's name must be unique (is another process running as {worker!r}?); "
            f"this connection holds no session")


def _refused(rid, refused):
    if not refused:
        return p.Refused(rid=rid, tokens=np.zeros((0, 3), np.uint64),
                         verdicts=np.zeros(0, np.uint8))
    toks = b"".join(r.token for r in refused)
    return p.Refused(rid=rid, tokens=toks,
                     verdicts=np.array([int(r.verdict) for r in refused], np.uint8))


def run_shard(config_path, shard_index):
    """``leasehold shard``: serve until SIGTERM/SIGINT, then commit, close, return 0."""
    shard = Shard(config_path, shard_index, freeze_heap=True)
    try:
        # The store would let this process take a running shard's claim over (a restart
        # of the same shard name), leaving that one fenced and serving nothing: one shard
        # process a store on this host, held by a lock the kernel drops when it dies.
        # (The lock file names the config file; ``config_path`` may be a parsed Config.)
        lock = hold_lock(shard.config.storage.path, SHARD_LOCK_NAME, "shard",
                         getattr(config_path, "source", config_path))
    except (LockHeld, OSError) as exc:
        raise CommandError("UNAVAILABLE", f"shard {shard.name}: {exc}") from None
    try:
        shard.install_signal_handlers()
        shard.serve()
    except (zmq.ZMQError, StoreError) as exc:
        # It cannot serve here now (its endpoint is taken, its store is held or broken):
        # UNAVAILABLE, not INTERNAL as if a bug.
        raise CommandError("UNAVAILABLE", f"shard {shard.name}: {exc}") from None
    finally:
        os.close(lock)
    return 0


def action_run(action):
    """The run key of an action id string."""
    return ActionId.parse(action).run_key
