"""Python-visible helpers around the resource gate (the checks live inline in _gate.pxd)."""

from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

from cext._types cimport i64


cdef inline i64 _now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <i64>ts.tv_sec * 1000000000 + ts.tv_nsec


def admission_check_bench(i64[:, ::1] demands not None, i64[::1] budget_left not None,
                          i64 actions_left, long iterations):
    """Time ``iterations`` queue admission checks in a C loop; returns (elapsed_ns, admitted).

    The demand row cycles through ``demands`` so the compiler cannot hoist the check out of
    the loop; ``admitted`` (how many passed) is returned so it cannot drop it either.
    """
    cdef Py_ssize_t rows = demands.shape[0], n = demands.shape[1]
    if budget_left.shape[0] != n:
        raise ValueError("budget_left must have one entry per resource")
    if rows == 0 or iterations <= 0:
        raise ValueError("need at least one demand row and one iteration")
    cdef long _i
    cdef Py_ssize_t row = 0
    cdef long admitted = 0
    cdef i64 start, end
    with nogil:
        start = _now_ns()
        for _i in range(iterations):
            admitted += queue_admits(actions_left, &demands[row, 0], &budget_left[0], n)
            row += 1
            if row == rows:
                row = 0
        end = _now_ns()
    return end - start, admitted
