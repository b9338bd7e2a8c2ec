"""Timers: deadline, max_queued_time, retry backoff, the max_runtime backstop and the finalize
bound, in a heap (set since the load) and sorted arrays (restored).

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

__all__ = ["TimersMixin"]


class TimersMixin:
    """Timers (a part of Engine)."""

    def _timer(self, due_ns, kind, row, ref):
        heapq.heappush(self._timers, (due_ns, next(self._seq), kind, row, ref))
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
        self._timer_blocks.append([due[order].copy(), np.full(rows.size, kind, np.int8),
                                   rows[order], refs[order].copy(), 0])
        column = DUE_COLUMNS.get(kind)
        if column is not None:
            getattr(self._state, column)[rows] = due
            self._touch_many(rows)

    def _due_timers(self, now):
        """Pop every due timer, from the heap and the sorted blocks (restored at load, or
        set for many rows at once)."""
        due = []
        while self._timers and self._timers[0][0] <= now:
            t = heapq.heappop(self._timers)
            due.append((t[0], t[1], t[2], t[3], t[4]))
        for block in self._timer_blocks:
            times, kinds, rows, refs, pos = block
            if pos < times.size and times[pos] <= now:
                end = int(np.searchsorted(times, now, side="right"))
                due += zip(times[pos:end].tolist(), [-1] * (end - pos),
                           kinds[pos:end].tolist(), rows[pos:end].tolist(),
                           refs[pos:end].tolist(), strict=True)
                block[4] = end
        if self._timer_blocks and any(b[4] == b[0].size for b in self._timer_blocks):
            self._timer_blocks = [b for b in self._timer_blocks if b[4] < b[0].size]
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
