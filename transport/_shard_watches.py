"""The shard loop's watches (``docs/shard.md``, "Watches"): the records a turn makes of
state changes, the re-check of what a tick changed on its own, and the EVENTS sent to
whoever watches a run. A part of ``transport._shard._Loop``."""

import itertools
import logging
import time

import numpy as np

from engine._codes import TERMINAL_PHASES, Phase
from engine._errors import LeaseholdError
from transport import _protocol as p
from transport._sockets import send
from transport._watch import RECHECK

__all__ = []

log = logging.getLogger("leasehold.shard")

# Phases of an action that waits for an assignment.
_WAITING = frozenset({Phase.QUEUED, Phase.WAITING_FOR_RESOURCES})

# Endings whose event carries the engine's reason as its detail.
_FAILURES = frozenset({Phase.FAILED, Phase.TIMED_OUT, Phase.ABORTED})


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


class WatchesMixin:
    """The watch records and events of the shard loop (a part of ``_Loop``)."""

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
