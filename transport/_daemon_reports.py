"""The cluster worker's side of a lease's liveness (``docs/worker.md``): reports batched
a shard a turn, heartbeats of everything held with the free capacity, shards that
stopped answering (fail loudly), and the drain after SIGTERM. A part of
``transport._daemon.Worker``."""

import logging
import time

import numpy as np
import zmq

from engine._codes import PHASE_CODE, Phase
from transport import _protocol as p
from transport._plugins import (
    Outcome,
)
from transport._worker import ShardError, ShardTimeout

__all__ = []
log = logging.getLogger("leasehold.worker")

_RUNNING = PHASE_CODE[Phase.RUNNING]
_SUCCEEDED = PHASE_CODE[Phase.SUCCEEDED]
_INITIALIZING = PHASE_CODE[Phase.INITIALIZING]

# Enum members read once: ``Phase.RUNNING`` is a metaclass lookup (~0.2 us), paid several
# times an action on the hot path otherwise.
_PHASE_INITIALIZING = Phase.INITIALIZING
_PHASE_RUNNING = Phase.RUNNING
_PHASE_SUCCEEDED = Phase.SUCCEEDED

#: How long a report that only says an attempt is on its way (INITIALIZING, RUNNING) may
#: wait for that attempt's next one, in seconds: a short attempt (a warm pool's call) then
#: sends its outcome alone, not three REPORTs, each a shard turn and an answer to wake for.
REPORT_HOLD = 0.005


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


class ReportsMixin:
    """Reports, heartbeats and drain of a worker (a part of ``Worker``)."""

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
