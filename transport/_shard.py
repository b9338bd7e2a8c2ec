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
import importlib
import logging
import os
import signal
import threading
import time

import zmq

from engine._codes import Phase
from engine._commands import CommandError, freeze_heap
from engine._config import Config, load_config
from engine._engine import Engine
from engine._errors import LeaseholdError
from engine._model import ActionId
from storage import LmdbStore, StoreError
from transport import _protocol as p
from transport._auth import (
    PermissionDenied,
    Unauthenticated,
    authorize,
    message_keys,
    peer_of,
)
from transport._committer import Committer, CommitterStore
from transport._keys import load_keyring
from transport._lease_map import LeaseBatch, LeaseMap
from transport._locks import SHARD_LOCK_NAME, LockHeld, hold_lock
from transport._shard_clients import ClientsMixin
from transport._shard_watches import WatchesMixin, _Changes, _Queued
from transport._shard_workers import WorkersMixin
from transport._shards import check_owned, shard_config
from transport._sockets import send, server_socket
from transport._status import SHARD_COUNTERS, StatusWriter
from transport._watch import WatchLog

__all__ = ["Shard", "BATCH"]

log = logging.getLogger("leasehold.shard")

#: Messages taken in one loop turn (one group commit); the rest wait for the next turn.
BATCH = 512
# How long a closing shard's socket keeps trying to deliver answers already sent (ms), and
# how long after its last answer it stays open (s).
CLOSE_LINGER_MS = 1000
CLOSE_GRACE_S = 0.5
_POLLIN = int(zmq.POLLIN)
# Handlers whose time is counted (Shard.counters): the read paths that grow with a run.
_HANDLER_NS = {p.MsgType.WATCH: "watch_ns", p.MsgType.STATUS: "status_ns"}
_AUTH_COUNTERS = ("handshakes_accepted", "handshakes_refused")

_CODE_OF = {  # engine error class name -> wire code, for errors without a ``code``
    "SpecError": "INVALID_ARGUMENT", "ConfigError": "INVALID_CONFIG",
    "NotFound": "NOT_FOUND", "AlreadyExists": "ALREADY_EXISTS",
}
_KNOWN_CODES = frozenset(p.ERROR_CODES)


def _code(exc):
    code = getattr(exc, "code", None)
    if code in _KNOWN_CODES:
        return code
    return _CODE_OF.get(type(exc).__name__, "INVALID_ARGUMENT")


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
        self._stop_error = None

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

    @property
    def stop_error(self):
        """None when the last stop was clean; else why not: the commit of a turn decided
        before the stop failed (its requests were answered UNAVAILABLE, nothing of it was
        acknowledged), or a turn was still in commit when the stop gave up waiting."""
        return self._stop_error

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


class _Loop(ClientsMixin, WorkersMixin, WatchesMixin):
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
            failed = self.shard._counters["failed_commits"]
            self.room()
            self.turn([], False)
            self.settle_all()
            if self.inflight:
                self.shard._stop_error = (f"{len(self.inflight)} turn(s) still in commit "
                                          f"when the stop gave up waiting")
            elif self.shard._counters["failed_commits"] > failed:
                self.shard._stop_error = ("a commit failed while stopping: its requests "
                                          "were answered UNAVAILABLE (see the log)")
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
        """After a tick: tick again at once when its lease-expiry sweep left expired leases
        to the next one (``Engine.expiries_waiting``), when it stopped a queue short of its work
        (``Engine.cut_short``), while ticks place something, and after one that placed
        nothing until the deepest such queue has been examined all the way round (its
        depth / (``max_candidates`` - 1) ticks). Unlike the simulator, a message does not
        start another idle rotation: on a deep queue where nothing fits, with a small
        ``max_candidates``, a rotation a heartbeat kept the loop ticking thousands of times
        a second. Only a tick that places something, or one that cuts nothing short, ends
        the count; later ticks each examine the next ``max_candidates`` of the queue."""
        if self.eng.expiries_waiting:
            # The sweep left expired leases to the next tick (a bounded turn each).
            self.idle_reticks = 0
            self.retick = True
            return
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


def run_shard(config_path, shard_index):
    """``leasehold shard``: serve until SIGTERM/SIGINT, then commit, close, return 0
    (UNAVAILABLE when that last commit failed: :attr:`Shard.stop_error`)."""
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
    if shard.stop_error is not None:
        # Stopped, but not cleanly: an exit 0 would tell the supervisor (and whoever
        # stopped it) that everything decided before the stop was written.
        raise CommandError("UNAVAILABLE", f"shard {shard.name}: stopped, but {shard.stop_error}")
    return 0


def action_run(action):
    """The run key of an action id string."""
    return ActionId.parse(action).run_key
