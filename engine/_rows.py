"""Shared constants of the engine's concern modules: row states, lease ends and phase codes
as plain ints (numpy probes an IntEnum value for the array protocols on every assignment, a
slow attribute miss per write on Python 3.11), the live states, the lease kind bit, the
durable column of each action timer and the bounds a worker may report."""

import numpy as np

from cext import DEBUG
from engine._codes import (
    PHASE_CODE,
    T_DEADLINE,
    T_QUEUED,
    T_RETRY,
    T_RUNTIME,
    LeaseEnd,
    LeaseKind,
    Phase,
    RowState,
)

__all__ = ["ST_QUEUED", "ST_SENT", "ST_RUNNING", "ST_DONE", "ST_BACKOFF", "END_LIVE",
           "END_COMPLETED", "END_EXPIRED", "END_ABORTED", "PH_QUEUED", "PH_INIT", "PH_RUNNING",
           "PH_SUCCEEDED", "PH_ABORTED", "LEAN_TERMINAL", "LIVE_STATES", "KIND_FINALIZE",
           "DUE_COLUMNS", "BOUNDS", "TRANSITIONS", "set_state", "FZ_OUTCOMES",
           "FZ_OUTCOME_CODE", "ST_FREE"]

# How a finalize lease ended (fz_outcome), by code; 0: it has not.
FZ_OUTCOMES = (None, "SUCCEEDED", "FAILED", "ABANDONED")
FZ_OUTCOME_CODE = {name: i for i, name in enumerate(FZ_OUTCOMES)}

ST_QUEUED, ST_SENT, ST_RUNNING, ST_DONE, ST_BACKOFF = (
    int(RowState.QUEUED), int(RowState.SENT), int(RowState.RUNNING), int(RowState.DONE),
    int(RowState.BACKOFF))
END_LIVE, END_COMPLETED, END_EXPIRED, END_ABORTED = (
    int(LeaseEnd.LIVE), int(LeaseEnd.COMPLETED), int(LeaseEnd.EXPIRED), int(LeaseEnd.ABORTED))
# The phase codes a lean row may hold (its one attempt on the common path: queued,
# dispatched, running, succeeded, or aborted); anything else gives the row its Python record
# (engine/_index.py).
PH_QUEUED = PHASE_CODE[Phase.QUEUED]
PH_INIT = PHASE_CODE[Phase.INITIALIZING]
PH_RUNNING = PHASE_CODE[Phase.RUNNING]
PH_SUCCEEDED = PHASE_CODE[Phase.SUCCEEDED]
PH_ABORTED = PHASE_CODE[Phase.ABORTED]
LEAN_TERMINAL = (PH_SUCCEEDED, PH_ABORTED)


LIVE_STATES = (int(RowState.SENT), int(RowState.RUNNING))
KIND_FINALIZE = int(LeaseKind.FINALIZE)
# The durable column of each action timer (reload rebuilds the timers from them).
DUE_COLUMNS = {T_DEADLINE: "a_deadline_due", T_QUEUED: "a_queued_due", T_RETRY: "a_retry_due",
                T_RUNTIME: "a_runtime_due"}
BOUNDS = ("deadline", "max_queued_time", "max_runtime")

# The row state machine: the states a row may enter, by the states it may leave. The kernel
# makes the tick's moves (FREE or BACKOFF -> QUEUED on push, QUEUED -> SENT on placement,
# QUEUED -> DONE on remove); every move the engine makes goes through set_state, which the
# debug build checks against this table.
ST_FREE = int(RowState.FREE)
TRANSITIONS = {
    ST_RUNNING: frozenset({ST_SENT, ST_RUNNING}),            # a worker reported RUNNING
    ST_DONE: frozenset({ST_QUEUED, ST_SENT, ST_RUNNING, ST_BACKOFF, ST_DONE}),
    ST_BACKOFF: frozenset({ST_DONE}),                        # an attempt failed: retry later
}


def set_state(st, rows, new):
    """Move action ``rows`` (an index or an array of them) of State ``st`` to state ``new``:
    the one place the engine changes a row's state. In the debug build a move the table
    does not allow raises ``AssertionError`` naming the row and both states."""
    if DEBUG:
        allowed = TRANSITIONS[new]
        old = np.atleast_1d(st.a_state[rows])
        bad = ~np.isin(old, tuple(allowed))
        if bad.any():
            row = np.atleast_1d(np.arange(st.a_state.shape[0])[rows])[bad][0]
            raise AssertionError(f"illegal row transition: row {int(row)} "
                                 f"{RowState(int(old[bad][0])).name} -> {RowState(new).name}")
    st.a_state[rows] = new
