"""Kernel moves over many rows at once: ``TickKernel.remove``, ``release`` and
``push_finalize`` for an array of rows, the same moves in the same order, in one nogil loop
(a Python call per row was a third of aborting 100,000 actions); and the drain of the
dispatch ring into a batch's columns in one pass (``drain_dispatch``); and the passes over
the whole table a request needs, each one nogil loop: an action's place in its queue
(``queued_ahead``), a worker session's leases (``held_rows``, ``move_holder``), a reload's
sums of demand by queue and cluster (``add_by``)."""

cimport numpy as cnp

from cext._tick cimport TickKernel
from cext._types cimport (
    END_LIVE,
    KIND_BIT,
    KIND_FINALIZE,
    NEVER,
    ST_DONE,
    ST_QUEUED,
    ST_RUNNING,
    ST_SENT,
    check_index,
    i32,
    i64,
    u8,
    u64,
)

__all__ = ["remove_many", "release_many", "push_finalize_many", "drain_dispatch",
           "decided_rows", "queued_ahead", "held_rows", "move_holder", "add_by"]

cnp.import_array()


def remove_many(TickKernel k not None, const i64[::1] rows not None):
    """``k.remove(r)`` for every row of ``rows`` in order: each must be a queued action row
    (checked for all before any is moved, so a bad one leaves every lane as it was)."""
    cdef Py_ssize_t i, n = k.a_state.shape[0]
    cdef i64 r
    for i in range(rows.shape[0]):
        r = rows[i]
        if not 0 <= r < n:      # (the message only when it fails: it costs a string)
            check_index(r, n, f"rows[{i}]", "an action row")
        if k.a_state[r] != ST_QUEUED:
            raise ValueError(f"action row a={r} is not queued")
    with nogil:
        _remove_many(k, rows)


cdef void _remove_many(TickKernel k, const i64[::1] rows) noexcept nogil:
    cdef Py_ssize_t i
    cdef i32 a
    for i in range(rows.shape[0]):
        a = <i32>rows[i]
        k._unlink(a)
        k.a_state[a] = ST_DONE


def release_many(TickKernel k not None, const i64[::1] rows not None, i64 now):
    """``k.release(r, now)`` for every row of ``rows`` in order (once per generation)."""
    cdef Py_ssize_t i, n = k.a_state.shape[0]
    for i in range(rows.shape[0]):
        if not 0 <= rows[i] < n:
            check_index(rows[i], n, f"rows[{i}]", "an action row")
    with nogil:
        _release_many(k, rows, now)


cdef void _release_many(TickKernel k, const i64[::1] rows, i64 now) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(rows.shape[0]):
        k._release(<i32>rows[i], now)


def push_finalize_many(TickKernel k not None, const i64[::1] rows not None):
    """``k.push_finalize(f)`` for every finalize row of ``rows`` in order."""
    cdef Py_ssize_t i, n = k.fz_state.shape[0]
    for i in range(rows.shape[0]):
        if not 0 <= rows[i] < n:
            check_index(rows[i], n, f"rows[{i}]", "a finalize row")
    with nogil:
        _push_finalize_many(k, rows)


cdef void _push_finalize_many(TickKernel k, const i64[::1] rows) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(rows.shape[0]):
        k._push_finalize(<i32>rows[i])


def queued_ahead(TickKernel k not None, const i64[:] seq not None, i64 n, i64 row):
    """How many queued actions of row ``row``'s queue were enqueued before it (``seq``: the
    enqueue order of each row; rows ``0 .. n`` are in use). One pass over the table's rows
    without the GIL: a numpy expression over the same strided columns took ~19 ms a million
    rows, most of it in its temporaries."""
    cdef i64 count = 0, a, s
    cdef i32 q
    _check_rows_in_use(k, n)
    if n > seq.shape[0]:
        raise ValueError(f"n={n} is more rows than seq has")
    check_index(row, n, "row", "an action row in use")
    q = k.a_queue[row]
    s = seq[row]
    with nogil:
        for a in range(n):
            # seq first: the one contiguous column, and false for about half the rows.
            if seq[a] < s and k.a_state[a] == ST_QUEUED and k.a_queue[a] == q:
                count += 1
    return count


def add_by(u64[:, ::1] out not None, const i32[:] index not None,
           const i64[:, :] values not None):
    """``out[index[i]] += values[i]`` for every ``i``, as unsigned 64-bit sums (a reload's
    recount of the demand charged to each queue and cluster). Every index is checked before
    anything is added (an IndexError adds nothing). One nogil pass: numpy's weighted
    bincount per resource took ~40 ms a million rows, ``np.add.at`` several times that."""
    cdef Py_ssize_t i, r, m = index.shape[0], width = out.shape[1]
    cdef Py_ssize_t rows = out.shape[0], bad = -1
    cdef i32 at
    if values.shape[0] != m or values.shape[1] != width:
        raise ValueError(f"values of shape ({values.shape[0]}, {values.shape[1]}) for "
                         f"{m} indexes into rows of {width}")
    with nogil:
        for i in range(m):
            if not 0 <= index[i] < rows:
                bad = i
                break
        if bad < 0:
            for i in range(m):
                at = index[i]
                for r in range(width):
                    out[at, r] += <u64>values[i, r]
    if bad >= 0:
        check_index(index[bad], rows, f"index[{bad}]", "a row of out")


cdef int _check_rows_in_use(TickKernel k, i64 n) except -1:
    if not 0 <= n <= k.a_state.shape[0]:
        raise ValueError(f"n={n} is not a row count of the table")
    return 0


def held_rows(TickKernel k not None, i64 n, i32 worker, bint expiring=False):
    """The rows among ``0 .. n`` held by worker session ``worker``, ascending (int64): with
    a live lease (SENT or RUNNING), or with ``expiring``, with a run lease expiry (its
    lease has not ended). One nogil pass over the table (a worker's registration or
    disconnection; a numpy expression over the strided columns took ~4x longer)."""
    cdef cnp.npy_intp dims[1]
    cdef cnp.ndarray out
    cdef i64* o
    cdef i64 a, m = 0
    _check_rows_in_use(k, n)
    dims[0] = n
    out = cnp.PyArray_EMPTY(1, dims, cnp.NPY_INT64, 0)    # pages only as they are written
    o = <i64*>cnp.PyArray_DATA(out)
    with nogil:
        for a in range(n):
            if k.a_worker[a] == worker and (
                    (k.a_expiry[a] != NEVER) if expiring
                    else (k.a_state[a] == ST_SENT or k.a_state[a] == ST_RUNNING)):
                o[m] = a
                m += 1
    return out[:m].copy()


def move_holder(TickKernel k not None, i64 n, i32 old, i32 new):
    """The rows among ``0 .. n`` held by worker session ``old`` become ``new``'s (a
    restored worker's leases adopted by its new session); returns how many. One nogil
    pass over the table."""
    cdef i64 a, m = 0
    _check_rows_in_use(k, n)
    with nogil:
        for a in range(n):
            if k.a_worker[a] == old:
                k.a_worker[a] = new
                m += 1
    return m


def decided_rows(TickKernel k not None, i64 since):
    """The rows of the dispatch entries from ``since`` to the ring's tail (what one tick
    decided), in ring order: ``(actions, finalizes)``, int64 arrays of their action rows and
    finalize rows, ``finalizes`` None when there are none (the common case). The arrays are
    made here (no Python around the kernel's call but this one: right after the kernel,
    every Python step costs several times what it does alone)."""
    cdef Py_ssize_t cap = k.d_action.shape[0]
    cdef i64 n = k.d_tail - since, s
    cdef Py_ssize_t na = 0, nf = 0
    cdef cnp.npy_intp dims[1]
    cdef cnp.ndarray actions, finalizes
    cdef i64* ap
    cdef i64* fp = NULL      # (set when there are finalize rows; only read then)
    if since < k.d_head or n < 0:
        raise ValueError(f"dispatch entries from {since}: the ring holds "
                         f"{k.d_head} .. {k.d_tail}")
    with nogil:
        for s in range(since, k.d_tail):
            if k.d_kind[s % cap] == KIND_FINALIZE:
                nf += 1
    dims[0] = n - nf
    actions = cnp.PyArray_EMPTY(1, dims, cnp.NPY_INT64, 0)
    ap = <i64*>cnp.PyArray_DATA(actions)
    if nf:
        dims[0] = nf
        finalizes = cnp.PyArray_EMPTY(1, dims, cnp.NPY_INT64, 0)
        fp = <i64*>cnp.PyArray_DATA(finalizes)
        nf = 0
    with nogil:
        for s in range(since, k.d_tail):
            if k.d_kind[s % cap] == KIND_FINALIZE:
                fp[nf] = k.d_action[s % cap]
                nf += 1
            else:
                ap[na] = k.d_action[s % cap]
                na += 1
    return actions, (finalizes if nf else None)


def drain_dispatch(TickKernel k not None, i64 n, i64 now, u8 ph_init,
                   i64[::1] a_start not None, u8[::1] a_phase not None,
                   i64[::1] a_delivered_gen not None, const u8[::1] a_edges not None,
                   const i64[::1] a_enqueued not None, const i32[:] a_queue not None,
                   const i64[::1] a_group not None, const i32[::1] a_gidx not None,
                   const u8[:] a_held_code not None, const i32[::1] fz_action not None,
                   const i32[::1] fz_attempt not None, dict out not None):
    """Consume the ``n`` oldest dispatch entries into the columns of ``out`` (arrays of at
    least ``n`` entries, named as :class:`engine.DispatchBatch`'s columns, plus ``lean``,
    uint8), in ring order, skipping entries whose lease ended before the drain; returns how
    many were kept. A kept run lease of a lean row (no Python record) is handed out here:
    its start stamped once, INITIALIZING (``ph_init``) while sent, its generation recorded
    as delivered, attempt 1 (``lean`` = 1). Every other kept entry (``lean`` = 0) is left to
    the caller, with its attempt filled for a finalize lease. ``tokens`` gets the lease id
    and generation words (the caller mints the third)."""
    cdef Py_ssize_t cap = k.d_action.shape[0]
    if n < 0 or n > k.d_tail - k.d_head:
        raise ValueError("cannot drain more than the ring holds")
    cdef u8[::1] kind = out["kind"], wait_code = out["wait_code"], lean = out["lean"]
    cdef i64[::1] lease_row = out["lease_row"], action_row = out["action_row"]
    cdef i64[::1] generation = out["generation"], group = out["group"]
    cdef i64[::1] first_enq = out["first_enqueued_ns"], att_enq = out["attempt_enqueued_ns"]
    cdef i32[::1] cluster = out["cluster"], worker = out["worker"], attempt = out["attempt"]
    cdef i32[::1] queue = out["queue"], index = out["index"]
    cdef u64[:, ::1] tokens = out["tokens"]
    if (kind.shape[0] < n or wait_code.shape[0] < n or lean.shape[0] < n
            or lease_row.shape[0] < n or action_row.shape[0] < n
            or generation.shape[0] < n or group.shape[0] < n or first_enq.shape[0] < n
            or att_enq.shape[0] < n or cluster.shape[0] < n or worker.shape[0] < n
            or attempt.shape[0] < n or queue.shape[0] < n or index.shape[0] < n
            or tokens.shape[0] < n or tokens.shape[1] != 3):
        raise ValueError(f"drain_dispatch: an output column is shorter than {n} entries")
    cdef Py_ssize_t na = k.a_state.shape[0], nf = k.fz_state.shape[0]
    if (a_start.shape[0] < na or a_phase.shape[0] < na or a_delivered_gen.shape[0] < na
            or a_edges.shape[0] < na or a_enqueued.shape[0] < na or a_queue.shape[0] < na
            or a_group.shape[0] < na or a_gidx.shape[0] < na or a_held_code.shape[0] < na
            or fz_action.shape[0] < nf or fz_attempt.shape[0] < nf):
        raise ValueError("drain_dispatch: a state column is shorter than the kernel's table")
    cdef i64 m
    with nogil:
        m = _drain(k, n, now, ph_init, cap, a_start, a_phase, a_delivered_gen, a_edges,
                   a_enqueued, a_queue, a_group, a_gidx, a_held_code, fz_action, fz_attempt,
                   kind, lease_row, action_row, generation, cluster, worker, attempt, queue,
                   group, index, first_enq, att_enq, wait_code, tokens, lean)
    return m


cdef i64 _drain(TickKernel k, i64 n, i64 now, u8 ph_init, Py_ssize_t cap,
                i64[::1] a_start, u8[::1] a_phase, i64[::1] a_delivered_gen,
                const u8[::1] a_edges, const i64[::1] a_enqueued, const i32[:] a_queue,
                const i64[::1] a_group, const i32[::1] a_gidx, const u8[:] a_held_code,
                const i32[::1] fz_action, const i32[::1] fz_attempt,
                u8[::1] kind, i64[::1] lease_row, i64[::1] action_row, i64[::1] generation,
                i32[::1] cluster, i32[::1] worker, i32[::1] attempt, i32[::1] queue,
                i64[::1] group, i32[::1] index, i64[::1] first_enq, i64[::1] att_enq,
                u8[::1] wait_code, u64[:, ::1] tokens, u8[::1] lean) noexcept nogil:
    cdef i64 i, m = 0, gen
    cdef Py_ssize_t slot
    cdef i32 row, arow
    cdef u8 knd, st
    for i in range(n):
        slot = <Py_ssize_t>((k.d_head + i) % cap)
        row = k.d_action[slot]
        gen = k.d_gen[slot]
        knd = k.d_kind[slot]
        if knd == KIND_FINALIZE:
            # A finalize lease ended (expired, aborted) before the drain is not delivered.
            if k.fz_gen[row] != gen or k.fz_end[row] != END_LIVE:
                continue
            arow = fz_action[row]
            attempt[m] = fz_attempt[row]
            att_enq[m] = 0
            lean[m] = 0
            wait_code[m] = 0
        else:
            st = k.a_state[row]
            if (k.a_gen[row] != gen or k.a_end[row] != END_LIVE
                    or (st != ST_SENT and st != ST_RUNNING)):
                continue
            arow = row
            wait_code[m] = a_held_code[row]
            if a_edges[row] == 0:
                # The common path: stamped once, INITIALIZING while sent, delivered.
                if a_start[row] == NEVER:
                    a_start[row] = now
                if st == ST_SENT:
                    a_phase[row] = ph_init
                a_delivered_gen[row] = gen
                attempt[m] = 1
                att_enq[m] = a_enqueued[row]
                lean[m] = 1
            else:
                attempt[m] = 0
                att_enq[m] = 0
                lean[m] = 0
        kind[m] = knd
        lease_row[m] = row
        action_row[m] = arow
        generation[m] = gen
        cluster[m] = k.d_cluster[slot]
        worker[m] = k.d_worker[slot]
        queue[m] = a_queue[arow]
        group[m] = a_group[arow]
        index[m] = a_gidx[arow]
        first_enq[m] = a_enqueued[arow]
        tokens[m, 0] = (KIND_BIT if knd == KIND_FINALIZE else 0) | <u64>row
        tokens[m, 1] = <u64>gen
        tokens[m, 2] = 0
        m += 1
    k.d_head += n
    return m
