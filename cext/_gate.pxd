# The resource gate: the three questions the tick asks of each candidate, as inline
# integer compares over raw int64 rows (R = number of configured resources).
from cext._types cimport i64, u64


cdef extern from *:
    int __builtin_ctzll(unsigned long long) nogil


cdef inline int first_short_dim(const i64* demand, const i64* free, Py_ssize_t n) noexcept nogil:
    """Index of the first resource where ``demand > free``, or -1 if ``free`` covers it."""
    cdef Py_ssize_t r
    for r in range(n):
        if demand[r] > free[r]:
            return <int>r
    return -1


cdef inline bint covers(const i64* demand, const i64* free, Py_ssize_t n) noexcept nogil:
    """True when ``free`` covers ``demand`` in every resource.

    ORs the differences and tests the sign once: subtraction and OR vectorise with plain SSE2
    (a 64-bit compare would need SSE4.2). Quantities are below 2**62, so no difference
    overflows.
    """
    cdef Py_ssize_t r
    cdef i64 acc = 0
    for r in range(n):
        acc |= free[r] - demand[r]
    return acc >= 0


cdef inline bint queue_admits(i64 actions_left, const i64* demand, const i64* budget_left,
                              Py_ssize_t n) noexcept nogil:
    """One queue admission check: an action slot left and the demand within the budget."""
    return actions_left > 0 and covers(demand, budget_left, n)


cdef inline int lowest_bit(u64 mask) noexcept nogil:
    """Index of the lowest set bit of a non-zero mask (the next cluster to try)."""
    return __builtin_ctzll(mask)
