# Shared dtype-named typedefs, codes and constants for every Cython module of Leasehold.
# Codes are mirrored in engine/_codes.py (constants in engine/_units.py, engine/_state.py,
# engine/_leases.py, engine/_config.py); cext/_types.pyx exposes these values to Python and
# tests/test_layout.py fails when the two sides differ.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t

ctypedef int64_t i64    # counts, quantities, nanosecond times (numpy int64)
ctypedef int32_t i32    # row indices (numpy int32); -1 = none
ctypedef uint8_t u8     # states, codes, flags (numpy uint8)
ctypedef uint64_t u64   # monotonic counters and cluster bitmasks (numpy uint64)

# Macros, not module globals: each is one compile-time constant in every module.
cdef extern from *:
    """
    #ifndef LEASEHOLD_DEBUG
    #define LEASEHOLD_DEBUG 0
    #endif
    #define LH_UNLIMITED ((int64_t)1 << 62)
    #define LH_NEVER INT64_MAX
    #define LH_KIND_BIT ((uint64_t)1 << 63)
    """
    const bint DEBUG_BUILD "LEASEHOLD_DEBUG"   # setup.py: 1 in the LEASEHOLD_DEBUG=1 build
    const i64 UNLIMITED "LH_UNLIMITED"         # no limit (quantities stay below it)
    const i64 NEVER "LH_NEVER"                 # a time that never comes
    const u64 KIND_BIT "LH_KIND_BIT"           # LeaseKind bit of a token's lease id

# Row state of an action / its run lease.
cpdef enum ActionState:
    ST_FREE = 0        # row unused
    ST_QUEUED = 1      # pending: in a lane, waiting for the tick
    ST_SENT = 2        # assigned to a worker by the tick, not yet reported running
    ST_RUNNING = 3     # the worker reported it running
    ST_DONE = 4        # terminal; row kept for history
    ST_BACKOFF = 5     # between attempts: waiting out its retry backoff (not in a lane)

# Why the tick did not place a queued action (or stopped a queue).
cpdef enum WaitCode:
    W_NONE = 0                 # never examined
    W_PLACED = 1               # placed by the tick
    W_QUEUE_ACTIONS = 2        # queue action_concurrency reached
    W_QUEUE_RUNS = 3           # queue run_concurrency reached (run has nothing in flight)
    W_RUN_ACTIONS = 4          # the run's max_action_concurrency reached
    W_QUEUE_BUDGET = 5         # demand exceeds the queue's remaining max_resources
    W_CLUSTER_CAPACITY = 6     # no allowed cluster has that much free now
    W_HEAD_OF_LINE = 7         # the clusters it could use are held by a blocked head
    W_NO_WORKER = 8            # no connected worker with a free slot on an allowed cluster
    W_POOL_BUSY = 9            # its warm pool has no free slot
    W_DISPATCH_FULL = 10       # dispatch channel full; reservation not taken
    W_CANDIDATE_LIMIT = 11     # the tick's per-queue candidate budget ran out first
    W_UNSCHEDULABLE_SHAPE = 12  # no allowed cluster can ever hold its pods / total
    W_UNSCHEDULABLE_CAP = 13   # demand exceeds the queue's hard cap
    W_HEAD_BUDGET = 14         # STRICT_FIFO: behind a head blocked on the queue budget
    W_POOL_ELSEWHERE = 15      # its warm pool runs on a cluster the queue no longer allows
    W_QUEUE_PAUSED = 16        # the queue is paused (queues.NAME.paused): it places nothing
    # not examined: after its blocked head, every cluster open to the queue was held or
    # without a worker (explain resolves what it waits for)
    W_QUEUE_HELD = 17
    W_TENANT_ACTIONS = 18      # its tenant's action_concurrency reached ([tenants.NAME])
    W_TENANT_RUNS = 19         # its tenant's run_concurrency reached (run has nothing in flight)
    # admission = "nodes": a cluster's free totals cover it, but its pods cannot all be
    # placed on that cluster's nodes now (fragmented free capacity)
    W_NO_NODE_FIT = 20

# How the current generation of a lease ended (a heartbeat for it is refused with this).
cpdef enum LeaseEnd:
    END_LIVE = 0        # still held
    END_COMPLETED = 1   # a terminal report was recorded
    END_EXPIRED = 2     # heartbeats stopped; expired by the engine
    END_ABORTED = 3     # the action (or an ancestor) was aborted

# Verdict on one presented token.
cpdef enum TokenVerdict:
    TOK_OK = 0          # valid: the lease is extended
    TOK_STALE = 1       # an older generation: the lease moved on
    TOK_EXPIRED = 2     # this generation expired
    TOK_COMPLETED = 3   # this generation already completed
    TOK_ABORTED = 4     # this generation was aborted: stop now
    TOK_UNKNOWN = 5     # forged, altered, not this worker's, or no such lease

# Lease kinds, in the top bit of a token's lease id.
cpdef enum LeaseKind:
    KIND_RUN = 0        # the run lease of an action (id = action row)
    KIND_FINALIZE = 1   # a finalize lease (id = finalize row)


# Row arguments from Python are checked once where they enter the kernel: past that point
# the release build indexes unchecked, so a bad row would read or write outside a table.
cdef inline int check_index(Py_ssize_t value, Py_ssize_t n, str name, str what) except -1:
    if value < 0 or value >= n:
        raise IndexError(f"{name}={value} is not {what} (0 <= {name} < {n})")
    return 0
