"""Lease tokens and heartbeat validation (the C side of engine._leases)."""

from cext._tick cimport TickKernel
from cext._types cimport (
    END_ABORTED, END_COMPLETED, END_EXPIRED, KIND_BIT, TOK_ABORTED,
    TOK_COMPLETED, TOK_EXPIRED, TOK_OK, TOK_STALE, TOK_UNKNOWN, check_index, i32, i64, u8, u64,
)


def mint(u64[:, ::1] tokens not None, u64 k0, u64 k1):
    """Fill column 2 of ``tokens`` (n x 3: lease id, generation, MAC) with the MACs."""
    if tokens.shape[1] != 3:
        raise ValueError("tokens must be an n x 3 uint64 array")
    cdef Py_ssize_t i
    with nogil:
        for i in range(tokens.shape[0]):
            tokens[i, 2] = siphash24(k0, k1, tokens[i, 0], tokens[i, 1])


cdef inline u8 _not_holder(TickKernel k, i32 holder, i32 worker) noexcept nogil:
    # Held by an earlier connection of the same worker: that session's leases moved on.
    if holder >= 0 and k.w_ident[holder] == k.w_ident[worker]:
        return TOK_STALE
    return TOK_UNKNOWN


cdef inline u8 _verdict(TickKernel k, i64 current, u8 end, i64 expiry, i32 holder, i64 gen,
                        i32 worker, i64 now) noexcept nogil:
    # One lease's columns (a run lease's a_*, a finalize lease's fz_*), read by the caller
    # (the run lease columns are strided views of the packed action record). The order is
    # the documented one: existence, generation, how it ended, expiry, holder.
    if current == 0:
        return TOK_UNKNOWN
    if gen < current:
        return TOK_STALE
    if gen > current:
        return TOK_UNKNOWN
    if end == END_COMPLETED:
        return TOK_COMPLETED
    if end == END_ABORTED:
        return TOK_ABORTED
    if end == END_EXPIRED or expiry < now:
        return TOK_EXPIRED
    if worker >= 0 and holder != worker:
        return _not_holder(k, holder, worker)
    return TOK_OK


def validate(TickKernel k not None, const u64[:, ::1] tokens not None, i32 worker, i64 now,
             u64 k0, u64 k1, u8[::1] verdicts not None, bint extend):
    """Check every token (phase 1), then extend the valid ones by the lease ttl (phase 2).

    ``worker`` is the presenting worker's row (-1: any holder). ``verdicts[i]`` receives the
    TokenVerdict of token ``i``. Returns the number of valid tokens. Extension is the only
    best-effort transition: nothing here is persisted.
    """
    cdef Py_ssize_t n = tokens.shape[0], i
    if tokens.shape[1] != 3:
        raise ValueError("tokens must be an n x 3 uint64 array")
    if verdicts.shape[0] < n:
        raise ValueError("verdicts is shorter than tokens")
    if worker != -1:
        check_index(worker, k.n_workers, "worker", "-1 or a worker row in use")
    cdef u64 lease, row
    cdef i64 gen, until
    cdef u8 v
    cdef i64 valid = 0
    with nogil:
        for i in range(n):
            lease = tokens[i, 0]
            gen = <i64>tokens[i, 1]
            if siphash24(k0, k1, lease, tokens[i, 1]) != tokens[i, 2]:
                v = TOK_UNKNOWN
            else:
                row = lease & ~KIND_BIT
                if lease & KIND_BIT:
                    v = TOK_UNKNOWN if row >= <u64>k.fz_gen.shape[0] else _verdict(
                        k, k.fz_gen[row], k.fz_end[row], k.fz_expiry[row], k.fz_worker[row],
                        gen, worker, now)
                else:
                    v = TOK_UNKNOWN if row >= <u64>k.a_gen.shape[0] else _verdict(
                        k, k.a_gen[row], k.a_end[row], k.a_expiry[row], k.a_worker[row],
                        gen, worker, now)
            verdicts[i] = v
            valid += v == TOK_OK
        if extend and valid:
            until = now + k.lease_ttl
            for i in range(n):
                if verdicts[i] != TOK_OK:
                    continue
                row = tokens[i, 0] & ~KIND_BIT
                if tokens[i, 0] & KIND_BIT:
                    k.fz_expiry[row] = until
                else:
                    k.a_expiry[row] = until
    return valid
