"""The abort record: what an abort of a tree wrote instead of every lean row's fixed record.

An abort ends a tree's lean rows (no Python record: their columns are their outcome) in
vector operations. Rewriting each one's fixed record in the abort's group commit was most of
the abort's cost (100,000 rows: ~23 MB of LMDB leaf pages copied and synced, a B-tree search a
record). Instead the abort writes, in the same group, one record in the ``attempts`` database
of the partition its rows live in (a run is one tenant's, so one partition; key
:func:`abort_rows_key` of the row the abort was called on, its *root*)::

    msgpack [[done_ns, starts, lengths], ...]

one entry per abort of that root (in practice one: an ended action starts no children),
``starts`` and ``lengths`` the ascending rows it ended as runs of consecutive rows, each an
array of little-endian int64 as bytes (a fan-out's rows are mostly consecutive: a few bytes
for 100,000 rows). The reason stays where it was, once per abort under
``engine._groups.abort_key(root)``.

Reload (:func:`apply_abort`) gives every listed row whose stored record is still its
pre-abort one (occupied, lean, queued or in flight) what :meth:`Engine.abort` did to it in
memory, before anything is derived from the columns. A row whose record was written since
(terminal already) is left alone, so applying is idempotent. A listed row stays listed only
while the aborted action holds it: reclaiming it rewrites the record without it (and
deletes the record when none is left) in the reclaim's own group, so a reused row is never
aborted by a reload.
"""

import msgpack
import numpy as np

from engine._rows import (
    END_ABORTED,
    LEAN_TERMINAL,
    PH_ABORTED,
    PH_QUEUED,
    ST_DONE,
    ST_FREE,
    ST_QUEUED,
    ST_RUNNING,
    ST_SENT,
)
from engine._state import NEVER
from storage import CorruptRecord

__all__ = ["ABORT_ROWS_START", "ABORT_ROWS_STOP", "abort_rows_key", "apply_abort",
           "decode_abort_rows", "encode_abort_rows", "ranges_of", "rows_of"]

#: The ``attempts`` key range of abort records (9-byte keys ``b"r"`` + root; a row's key is
#: 8 bytes and a reason's starts with ``b"a"``).
ABORT_ROWS_START, ABORT_ROWS_STOP = b"r", b"s"


def abort_rows_key(root):
    """The ``attempts`` key of the abort record of the aborts called on row ``root``."""
    return b"r" + int(root).to_bytes(8, "big")


def ranges_of(rows):
    """Ascending distinct ``rows`` as runs of consecutive rows: (starts, lengths), int64."""
    rows = np.asarray(rows, dtype=np.int64)
    if not rows.size:
        return rows[:0], rows[:0]
    first = np.flatnonzero(np.diff(rows) != 1) + 1
    bounds = np.concatenate([[0], first, [rows.size]])
    return rows[bounds[:-1]], np.diff(bounds).astype(np.int64)


def rows_of(starts, lengths):
    """The rows of runs (starts, lengths), ascending: the inverse of :func:`ranges_of`."""
    total = int(lengths.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    # Each run's rows are its start plus 0..length-1: a cumulative sum of ones, with each
    # run's first step jumping from the previous run's last row to its start.
    steps = np.ones(total, dtype=np.int64)
    heads = np.cumsum(lengths[:-1])
    steps[heads] = starts[1:] - (starts[:-1] + lengths[:-1] - 1)
    steps[0] = starts[0]
    return np.cumsum(steps)


def encode_abort_rows(entries):
    """The stored value of an abort record: ``entries`` is ``[(done_ns, starts, lengths)]``."""
    return msgpack.packb([[int(t), s.astype("<i8").tobytes(), n.astype("<i8").tobytes()]
                          for t, s, n in entries])


def decode_abort_rows(part, key, raw):
    """``[(done_ns, starts, lengths)]`` of a stored abort record; CorruptRecord if it is
    not one."""
    try:
        entries = msgpack.unpackb(raw)
        out = []
        for t, s, n in entries:
            starts, lengths = np.frombuffer(s, "<i8"), np.frombuffer(n, "<i8")
            if not isinstance(t, int) or starts.size != lengths.size or not starts.size or (
                    lengths < 1).any() or (starts < 0).any():
                raise ValueError("malformed entry")
            out.append((t, starts.astype(np.int64), lengths.astype(np.int64)))
    except Exception as exc:
        raise CorruptRecord(part, "attempts", key, f"undecodable abort record: {exc}") from None
    if not out:
        raise CorruptRecord(part, "attempts", key, "abort record without rows")
    return out


def apply_abort(st, n, part, root, done, rows):
    """At reload: give each of ``rows`` (listed by an abort of ``root`` at ``done``, its
    record in partition ``part``) whose loaded record is still its pre-abort one what
    :meth:`Engine.abort` did to it: queued rows end ABORTED; rows in flight also end their
    lease (ABORTED, its in-flight counts released) with their attempt started if it had
    not. The finalize leases are records of their own. Returns how many rows it changed."""
    if (rows >= n).any():
        raise CorruptRecord(part, "attempts", abort_rows_key(root),
                            f"abort record lists row {int(rows.max())}, past the table ({n})")
    state, phase = st.a_state[rows], st.a_phase[rows]
    # The aborted action still holds the row (reclaiming a listed row rewrites the record)
    # and its record is the pre-abort one: lean, occupied, in this partition and run.
    ours = ((state != ST_FREE) & (st.a_lean[rows] == 1) & (st.a_part[rows] == part)
            & (st.a_run[rows] == st.a_run[root]))
    quick = rows[ours & (state == ST_QUEUED) & (phase == PH_QUEUED)]
    flying = rows[ours & ((state == ST_SENT) | (state == ST_RUNNING))
                  & ~np.isin(phase, LEAN_TERMINAL)]
    if flying.size:
        st.a_start[flying] = np.where(st.a_start[flying] == NEVER, done, st.a_start[flying])
        st.a_end[flying] = END_ABORTED
        gen = st.a_gen[flying]
        released = flying[(gen != 0) & (st.a_released_gen[flying] != gen)]
        st.a_released_gen[released] = st.a_gen[released]
        st.a_pred_end[released] = NEVER
    hit = np.concatenate([quick, flying])
    st.a_state[hit] = ST_DONE
    st.a_phase[hit] = PH_ABORTED
    st.a_done[hit] = done
    st.a_abort[hit] = root
    return int(hit.size)
