"""Timers: deadline, max_queued_time, retry backoff, the max_runtime backstop and the finalize
bound, in a heap (set one at a time) and a heap of sorted blocks (restored at load, or set for
many rows at once), each ordered by its next due time, so a tick with nothing due looks at
two heads only.

A timer is not removed when its row moves on (an action that succeeds keeps its deadline's
entry): it finds its row's due column changed when it fires, and does nothing. So that such
entries do not pile up with history (a day's deadline of every action enqueued in that day),
the timers are rebuilt from the due columns, as a reload derives them (:func:`armed_timers`),
once they outnumber twice the armed ones at the last rebuild plus the table's rows.

A part of :class:`engine.Engine` (a mixin over its shared state); see engine/_engine.py."""

import heapq

import numpy as np

from engine._codes import (
    T_DEADLINE,
    T_FINALIZE,
    T_QUEUED,
    T_RETRY,
    T_RUNTIME,
    TERMINAL_PHASES,
    Phase,
    RowState,
)
from engine._rows import (
    DUE_COLUMNS,
    END_EXPIRED,
    END_LIVE,
    ST_BACKOFF,
    ST_DONE,
    ST_QUEUED,
    ST_RUNNING,
)
from engine._state import NEVER

__all__ = ["TimersMixin", "armed_timers"]

# Pending timer entries allowed past twice the armed ones before a rebuild, at least (the
# table's rows when more): a rebuild is a few passes over the table, paid once in that many.
TIMER_SLACK = 65_536


def armed_timers(st, n, nf):
    """Every armed timer of action rows ``[:n]`` and finalize rows ``[:nf]`` of State ``st``,
    from their due columns: (due, kind, row, ref) arrays, sorted by due. What a reload
    restores, and what a rebuild keeps."""
    state = st.a_state[:n]
    parts = []
    active = np.flatnonzero((state != RowState.DONE) & (st.a_deadline_due[:n] != NEVER))
    parts.append((st.a_deadline_due[active], T_DEADLINE, active, np.zeros(active.size, np.int64)))
    # A retry's max_queued_time is armed when its backoff begins (due after the retry).
    qd = np.flatnonzero(((state == RowState.QUEUED) | (state == RowState.BACKOFF))
                        & (st.a_queued_due[:n] != NEVER))
    parts.append((st.a_queued_due[qd], T_QUEUED, qd, st.a_attempt[qd].astype(np.int64)))
    bo = np.flatnonzero(state == RowState.BACKOFF)
    parts.append((st.a_retry_due[bo], T_RETRY, bo, st.a_attempt[bo].astype(np.int64)))
    rt = np.flatnonzero((state == RowState.RUNNING) & (st.a_runtime_due[:n] != NEVER))
    parts.append((st.a_runtime_due[rt], T_RUNTIME, rt, st.a_gen[rt].astype(np.int64)))
    fz_state = st.fz_state[:nf]
    fz = np.flatnonzero((fz_state != RowState.DONE) & (fz_state != RowState.FREE))
    parts.append((st.fz_give_up[fz], T_FINALIZE, fz, np.zeros(fz.size, np.int64)))
    due = np.concatenate([p[0] for p in parts]).astype(np.int64)
    kind = np.concatenate([np.full(p[2].size, p[1], np.int8) for p in parts])
    row = np.concatenate([p[2] for p in parts]).astype(np.int64)
    ref = np.concatenate([p[3] for p in parts])
    order = np.argsort(due, kind="stable")
    return due[order], kind[order], row[order], ref[order]


class TimersMixin:
    """Timers (a part of Engine)."""

    def _adopt_timers(self, timers):
        """Replace every timer by ``timers`` (:func:`armed_timers`' arrays): one block."""
        due, kind, row, ref = timers
        self._timers = []
        self._timer_blocks = []
        self._timer_entries = 0
        self._push_block(due, kind, row, ref)
        self._timer_compact_at = 2 * due.size + max(TIMER_SLACK, self._next_row)

    def _compact_timers(self):
        """Rebuild the timers from the due columns: entries whose row moved on are dropped.
        Call between engine calls (a call in progress may have armed a timer before setting
        the state that keeps it armed)."""
        self._adopt_timers(armed_timers(self._state, self._next_row, self._n_finalize))

    def _push_block(self, due, kind, row, ref, pos=0):
        if pos < due.size:
            heapq.heappush(self._timer_blocks,
                           [int(due[pos]), next(self._seq), due, kind, row, ref, pos])
            self._timer_entries += due.size - pos

    def _timer(self, due_ns, kind, row, ref):
        heapq.heappush(self._timers, (due_ns, next(self._seq), kind, row, ref))
        self._timer_entries += 1
        column = DUE_COLUMNS.get(kind)
        if column is not None:
            getattr(self._state, column)[row] = due_ns
            self._touch(row)

    def _timer_block(self, due_ns, kind, rows, refs):
        """Timers of one kind for many rows at once (due ``due_ns``: one time or an array):
        one sorted block beside the heap, their due columns set in one pass."""
        rows = np.asarray(rows, dtype=np.int64)
        if not rows.size:
            return
        due = np.broadcast_to(np.asarray(due_ns, dtype=np.int64), rows.shape)
        refs = np.broadcast_to(np.asarray(refs, dtype=np.int64), rows.shape)
        order = np.argsort(due, kind="stable")
        self._push_block(due[order].copy(), np.full(rows.size, kind, np.int8), rows[order],
                         refs[order].copy())
        column = DUE_COLUMNS.get(kind)
        if column is not None:
            getattr(self._state, column)[rows] = due
            self._touch_many(rows)

    def _due_timers(self, now):
        """Pop every due timer, from the heap and the heap of sorted blocks."""
        due = []
        heap, blocks = self._timers, self._timer_blocks
        while heap and heap[0][0] <= now:
            t = heapq.heappop(heap)
            due.append((t[0], t[1], t[2], t[3], t[4]))
        self._timer_entries -= len(due)
        while blocks and blocks[0][0] <= now:
            _next, _seq, times, kinds, rows, refs, pos = heapq.heappop(blocks)
            end = int(np.searchsorted(times, now, side="right"))
            due += zip(times[pos:end].tolist(), [-1] * (end - pos),
                       kinds[pos:end].tolist(), rows[pos:end].tolist(),
                       refs[pos:end].tolist(), strict=True)
            self._timer_entries -= times.size - pos      # (what is left goes back in)
            self._push_block(times, kinds, rows, refs, end)
        due.sort()
        return due

    def _fire_timers(self, now):
        while True:
            due = self._due_timers(now)
            if not due:
                return
            for at, _seq, kind, row, ref in due:
                self._fire(kind, row, ref, at)

    def _fire(self, kind, row, ref, at):
        # A row whose phase it changes goes to _decided_rows (Engine.decided_changes).
        st = self._state
        if kind == T_FINALIZE:
            # Only the bound its finalize row holds (the row may be free, or reused since).
            if int(st.fz_give_up[row]) == at:
                self._finalize_give_up(row, ref)
            return
        column = DUE_COLUMNS.get(kind)
        if column is not None and int(getattr(st, column)[row]) != at:
            # Not the timer its row has armed (re-armed since, or the row was reclaimed and
            # holds another action now).
            return
        state = st.a_state[row]
        if state == ST_DONE:
            return
        if self._phase_of(row) in TERMINAL_PHASES:
            return
        if kind == T_DEADLINE:
            # The engine enforces the deadline before dispatch; a running attempt is
            # bounded by its worker, which was given the deadline with the lease.
            if state in (ST_QUEUED, ST_BACKOFF):
                self._decided_rows.append(row)
                rec = self._rec(row)
                self._end_attempt(rec, Phase.TIMED_OUT, cause="deadline",
                                  message="deadline passed before dispatch")
                self._finish(rec, Phase.TIMED_OUT, "deadline passed before dispatch",
                             cause="deadline")
        elif kind == T_QUEUED:
            if state == ST_QUEUED and int(st.a_attempt[row]) == ref:
                self._decided_rows.append(row)
                rec = self._rec(row)
                self._kernel.remove(row)          # leaves the row in state DONE
                self._attempt_failed(rec, Phase.TIMED_OUT, None, "max_queued_time",
                                     "max_queued_time passed while queued", True)
        elif kind == T_RETRY:
            if state == ST_BACKOFF and int(st.a_attempt[row]) == ref:
                self._kernel.push(row)
                self._touch(row)
        elif kind == T_RUNTIME:
            # Engine backstop for max_runtime: the worker should have ended it.
            if (state == ST_RUNNING and int(st.a_gen[row]) == ref
                    and st.a_end[row] == END_LIVE):
                self._decided_rows.append(row)
                rec = self._rec(row)
                self._stamp_attempt(rec)
                self._end_lease(row, END_EXPIRED)
                self._attempt_failed(
                    rec, Phase.TIMED_OUT, None, "max_runtime",
                    "engine backstop: still running past max_runtime plus grace", True,
                    cleanup=True)
