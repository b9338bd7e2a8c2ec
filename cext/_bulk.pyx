"""Kernel moves over many rows at once: ``TickKernel.remove``, ``release`` and
``push_finalize`` for an array of rows, the same moves in the same order, in one nogil loop
(a Python call per row was a third of aborting 100,000 actions)."""

from cext._tick cimport TickKernel
from cext._types cimport ST_DONE, ST_QUEUED, check_index, i32, i64

__all__ = ["remove_many", "release_many", "push_finalize_many"]


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
