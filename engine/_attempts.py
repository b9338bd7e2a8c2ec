"""Attempts: how an attempt ends (outcome, retries with backoff, UNSCHEDULABLE, abort of a tree)
and the row's terminal phase.

A part of :class:`engine.Engine` (a mixin over its shared state); see engine/_engine.py."""


import msgpack
import numpy as np

from cext import DEBUG
from cext._bulk import remove_many
from cext._tree import descendants
from engine._aborts import abort_rows_key, encode_abort_rows, ranges_of, rows_of
from engine._codes import (
    T_QUEUED,
    T_RETRY,
    TERMINAL_PHASES,
    Phase,
    WaitCode,
)
from engine._errors import SpecError
from engine._groups import (
    ActionIds,
    abort_key,
)
from engine._leases import Attempt, ErrorKind
from engine._rows import (
    END_ABORTED,
    END_LIVE,
    LEAN_TERMINAL,
    LIVE_STATES,
    PH_ABORTED,
    PH_QUEUED,
    ST_BACKOFF,
    ST_DONE,
    ST_QUEUED,
    ST_RUNNING,
    ST_SENT,
    set_state,
)
from engine._state import NEVER
from engine._units import format_quantity
from storage import (
    CorruptRecord,
)

__all__ = ["AttemptsMixin"]


def backoff_delay(retries, n):
    """Seconds before the retry that follows ``n`` spent ones: ``min(base * factor**n,
    cap)``. Computed in floats that may not hold ``factor**n`` (2.0**1025, 1e308**2): the
    cap is then the delay (the power raised OverflowError inside an engine turn)."""
    if retries.backoff_base == 0:
        return 0.0
    try:
        delay = retries.backoff_base * float(retries.backoff_factor) ** n
    except OverflowError:
        return float(retries.backoff_cap)
    return min(delay, retries.backoff_cap)


class AttemptsMixin:
    """Attempts (a part of Engine)."""

    def live_leases(self, action):
        """The live run leases of ``action`` and its descendants, by holder: ``{worker id:
        n x 3 uint64 tokens}``. What an abort of ``action`` refuses: the shard pushes these
        to their workers so they stop at once, not at their next heartbeat."""
        root, ret = self._row_or_retained(action)
        if ret is not None:
            return {}
        st = self._state
        out = np.empty(self._next_row, dtype=np.int64)
        rows = out[:descendants(st.a_child, st.a_sibling, root, out)]
        rows = rows[np.isin(st.a_state[rows], LIVE_STATES) & (st.a_end[rows] == END_LIVE)]
        held = {}
        if not rows.size:
            return held
        tokens = np.zeros((rows.size, 3), dtype=np.uint64)
        tokens[:, 0] = rows.astype(np.uint64)       # kind RUN: the top bit clear
        tokens[:, 1] = st.a_gen[rows].astype(np.uint64)
        self._codec.mint_array(tokens)
        workers = st.a_worker[rows]
        for w in np.unique(workers).tolist():
            held[self._worker_names[w]] = tokens[workers == w]
        return held

    def abort(self, action, reason="aborted"):
        """Abort ``action`` and every descendant: queued ones end at once; sent or running
        ones are refused at their next heartbeat (their worker stops them) and get a
        finalize lease for cleanup. Returns the ids that ended (an ``ActionIds``
        sequence)."""
        if not isinstance(reason, str):
            raise SpecError(f"an abort reason is a string, not {reason!r}")
        root, ret = self._row_or_retained(action)
        if ret is not None:
            return ActionIds(None, 0)   # ended long since, and so has its whole tree
        st = self._state
        out = np.empty(self._next_row, dtype=np.int64)
        rows = out[:descendants(st.a_child, st.a_sibling, root, out)]
        with self._turn():
            now = self.clock.now_ns()
            lean = st.a_edges[rows] == 0
            phase = st.a_phase[rows]
            # Lean rows still queued end in their columns, with the reason stored once.
            quick = lean & (st.a_state[rows] == ST_QUEUED) & (phase == PH_QUEUED)
            q = rows[quick]
            if q.size:
                remove_many(self._kernel, np.ascontiguousarray(q, dtype=np.int64))
                set_state(st, q, ST_DONE)
                st.a_phase[q] = PH_ABORTED
                st.a_done[q] = now
                st.a_abort[q] = root
            # Lean rows in flight end in their columns too; their cleanup is a finalize
            # lease each, made in one pass.
            state = st.a_state[rows]
            flying = lean & ~quick & ((state == ST_SENT) | (state == ST_RUNNING)) & ~np.isin(
                phase, LEAN_TERMINAL)
            live = rows[flying]
            if live.size:
                st.a_start[live] = np.where(st.a_start[live] == NEVER, now, st.a_start[live])
                self._end_leases_lean(live, END_ABORTED, PH_ABORTED, now)
                st.a_abort[live] = root
                self._new_finalize_lean(live)
            if q.size or live.size:
                # Lean rows read the reason from one record per abort, and their records are
                # not rewritten: one abort record lists them (reload applies it).
                part = int(st.a_part[root])
                self._op(part, "attempts", abort_key(root), msgpack.packb(reason))
                self._abort_reasons[root] = reason
                self._note_abort_rows(root, part, np.sort(np.concatenate([q, live])), now)
            # The rest one by one.
            done = lean & ~quick & ~flying & np.isin(phase, LEAN_TERMINAL)
            ended = quick | flying
            for i in np.flatnonzero(~quick & ~flying & ~done).tolist():
                row = int(rows[i])
                if self._phase_of(row) in TERMINAL_PHASES:
                    continue
                rec = self._rec(row)
                cleanup = False
                if st.a_state[row] in LIVE_STATES:
                    self._stamp_attempt(rec)
                    self._end_lease(row, END_ABORTED)
                    cleanup = True
                self._end_attempt(rec, Phase.ABORTED, message=reason, cleanup=cleanup)
                self._finish(rec, Phase.ABORTED, reason)
                ended[i] = True
            hit = rows[ended]
            gids = st.a_group[hit]
            groups = {g: self._group_of(int(hit[k])) for g, k in zip(
                *np.unique(gids, return_index=True), strict=True)}
            return ActionIds.of_rows({int(g): v for g, v in groups.items()}, gids,
                                     st.a_gidx[hit])

    def _note_abort_rows(self, root, part, rows, now):
        # The abort record of ``root`` lists ``rows`` (ascending) too, ended at ``now``.
        if DEBUG and (self._state.a_part[rows] != part).any():
            raise AssertionError(f"abort of row {root}: its tree spans partitions")
        _, entries = self._abort_rows.get(root, (part, []))
        entries = [*entries, (now, *ranges_of(rows))]
        self._abort_rows[root] = (part, entries)
        self._op(part, "attempts", abort_rows_key(root), encode_abort_rows(entries))

    def _prune_abort_rows(self, rows):
        """Rows among ``rows`` (being reclaimed) leave the abort records that list them, in
        the reclaim's group: a record lists only rows its aborted actions still hold, so a
        reload never aborts the next action of a reused row. A record left empty goes, and
        the abort's reason with it (only the rows it lists read the reason)."""
        if not self._abort_rows:
            return
        roots = self._state.a_abort[rows]
        for root in np.unique(roots[roots >= 0]).tolist():
            held = self._abort_rows.get(root)
            if held is None:
                continue
            part, entries = held
            gone = rows[roots == root]
            left = []
            for done, starts, lengths in entries:
                listed = rows_of(starts, lengths)
                keep = listed[~np.isin(listed, gone)]
                if keep.size:
                    left.append((done, *ranges_of(keep)))
            if left:
                self._abort_rows[root] = (part, left)
                self._op(part, "attempts", abort_rows_key(root), encode_abort_rows(left))
            else:
                # No row reads the reason any more (each reclaimed row took its message
                # into its retained outcome): it goes with the list.
                del self._abort_rows[root]
                self._op(part, "attempts", abort_rows_key(root), None)
                self._op(part, "attempts", abort_key(root), None)
                self._abort_reasons.pop(root, None)

    def _abort_reason(self, row):
        # The reason of the abort that ended lean row ``row`` (stored once per abort).
        root = int(self._state.a_abort[row])
        reason = self._abort_reasons.get(root)
        if reason is None:
            part = int(self._state.a_part[root])
            raw = self._store.get(part, "attempts", abort_key(root))
            if raw is None:
                raise CorruptRecord(part, "attempts", abort_key(root),
                                    f"aborted row {row} has no abort reason")
            reason = self._abort_reasons[root] = msgpack.unpackb(raw)
        return reason

    def _new_attempt(self, rec, now):
        rec.attempts.append(Attempt(number=len(rec.attempts) + 1, enqueued_ns=now))
        self._state.a_attempt[rec.row] = len(rec.attempts)
        self._touch(rec.row)
        t = rec.compiled.spec.timeouts
        if t.max_queued_time is not None:
            self._timer(now + int(t.max_queued_time * 1e9), T_QUEUED, rec.row,
                        len(rec.attempts))

    def _end_attempt(self, rec, phase, kind=None, cause=None, message="", recoverable=None,
                     cleanup=False):
        att = rec.attempt
        self._touch(rec.row)
        att.end_ns = self.clock.now_ns()
        att.phase = phase.value
        att.error_kind = kind.value if kind is not None else None
        att.cause = cause
        att.message = message
        att.recoverable = recoverable
        if cleanup and att.generation:
            self._new_finalize(rec, att)

    def _attempt_failed(self, rec, phase, kind, cause, message, recoverable, cleanup=False):
        """End the current attempt and retry it if its budget allows, else finish."""
        self._end_attempt(rec, phase, kind, cause, message, recoverable, cleanup)
        spec = rec.compiled.spec
        if phase == Phase.TIMED_OUT and cause == "deadline":
            retry = False
        elif kind == ErrorKind.SYSTEM:
            retry = cause != "UNSCHEDULABLE" and (
                rec.system_retries < self.config.engine.system_retries)
            if retry:
                rec.system_retries += 1
        else:
            # USER errors and the per-attempt bounds spend the user's retries.
            retry = recoverable and rec.user_retries < spec.retries.count
            if retry:
                rec.user_retries += 1
        if not retry:
            text = f"{cause}: {message}" if cause else message
            self._finish(rec, phase, text, kind=kind.value if kind else None, cause=cause)
            return
        now = self.clock.now_ns()
        r = spec.retries
        n = rec.user_retries + rec.system_retries - 1
        delay = backoff_delay(r, n)
        ready = now + int(delay * 1e9)
        t = spec.timeouts
        if t.deadline is not None and ready >= rec.first_enqueued_ns + int(t.deadline * 1e9):
            self._finish(rec, Phase.TIMED_OUT, "deadline passes before the retry is due",
                         cause="deadline")
            return
        set_state(self._state, rec.row, ST_BACKOFF)
        rec.phase = Phase.QUEUED
        self._new_attempt(rec, ready)
        self._timer(ready, T_RETRY, rec.row, len(rec.attempts))

    def _fail_unschedulable(self, row, code):
        rec = self._rec(row)
        self._touch(row)
        c = rec.compiled
        qname = c.queue
        if code == WaitCode.UNSCHEDULABLE_CAP:
            q = self._queues[qname]
            dim = int(self._state.a_wait_dim[row])
            name = self._resources.names[dim]
            cap = format_quantity(name, int(q.max_resources[dim]))
            why = (f"needs {name}={format_quantity(name, int(c.demand[dim]))}, more than "
                   f"queue {qname}'s max {name}={cap}")
        else:
            allowed = [self._cluster_index[n] for n in self._queues[qname].clusters]
            why = "; ".join(self._never_fits(c, i) or f"cluster {self._clusters[i]}: ?"
                            for i in allowed) or f"queue {qname} allows no cluster"
        message = f"UNSCHEDULABLE: {why}"
        self._end_attempt(rec, Phase.FAILED, ErrorKind.SYSTEM, "UNSCHEDULABLE", message, False)
        self._finish(rec, Phase.FAILED, message, kind=ErrorKind.SYSTEM.value,
                     cause="UNSCHEDULABLE")

    def _finish(self, rec, phase, message, kind=None, cause=None):
        st = self._state
        row = rec.row
        self._touch(row)
        if st.a_state[row] == ST_QUEUED:
            self._kernel.remove(row)
        self._kernel.release(row, self.clock.now_ns())
        set_state(st, row, ST_DONE)
        rec.phase = phase
        rec.message = message
        rec.error_kind = kind
        rec.cause = cause
