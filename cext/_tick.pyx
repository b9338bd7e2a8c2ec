"""The tick: one scheduling pass over a shard's numpy-backed state, without the GIL.

Order, as in DESIGN.md: reap idle warm pools; snapshot free worker slots per cluster; then
for each queue by priority, candidates round-robin across its runs (oldest first within a
run), regular and fast lane interleaved 1:1; caps first, then the resource gate (queue
budget; a cluster whose capacity minus in-flight covers the total and whose node shapes
hold every pod; the one with most free accelerators, then cpu); a worker slot reserved and
the assignment pushed to the bounded dispatch ring. STRICT_FIFO heads that do not fit hold
their clusters against everything later in the tick; GREEDY_CAPACITY skips and packs.
"""

cimport cython

from cext._gate cimport covers, first_short_dim, lowest_bit
from cext._types cimport (
    DEBUG_BUILD, END_LIVE, KIND_FINALIZE, KIND_RUN, NEVER, ST_DONE, ST_QUEUED, ST_RUNNING, ST_SENT,
    UNLIMITED, W_CANDIDATE_LIMIT,
    W_CLUSTER_CAPACITY, W_DISPATCH_FULL,
    W_HEAD_BUDGET, W_HEAD_OF_LINE, W_NO_WORKER, W_NONE, W_PLACED, W_POOL_BUSY, W_POOL_ELSEWHERE,
    W_QUEUE_ACTIONS, W_QUEUE_BUDGET, W_QUEUE_HELD, W_QUEUE_PAUSED, W_QUEUE_RUNS, W_RUN_ACTIONS,
    W_NO_NODE_FIT, W_TENANT_ACTIONS, W_TENANT_RUNS, W_UNSCHEDULABLE_CAP,
    W_UNSCHEDULABLE_SHAPE, check_index, i32, i64, u8, u64,
)

from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec


cdef extern from *:
    void __builtin_prefetch(const void*) nogil

cdef i64 NO_CAP = UNLIMITED   # an uncapped count

# EASY++'s extension of a lease that overran its prediction (Tsafrir, Etsion, Feitelson,
# IEEE TPDS 2007): its predicted end steps up by the first of these (ns) that puts it in the
# future: 1, 5, 15, 30 minutes, 1, 2, 5, 10, 20, 50, 100 hours.
DEF N_OVERRUN_STEPS = 11
cdef i64[N_OVERRUN_STEPS] OVERRUN_STEPS = [
    60_000_000_000, 300_000_000_000, 900_000_000_000, 1_800_000_000_000, 3_600_000_000_000,
    7_200_000_000_000, 18_000_000_000_000, 36_000_000_000_000, 72_000_000_000_000,
    180_000_000_000_000, 360_000_000_000_000]

# Rows prefetched at a tick's start (_prefetch_candidates): a bound, so a tick over many
# lanes does not evict what it asked for before it gets there (512 x 3 lines: 96 KiB).
cdef enum:
    PREFETCH_ROWS = 512

# Outcomes of one candidate.
cdef enum:
    R_PLACED = 0        # reserved and dispatched
    R_SKIP_ACTION = 1   # this action waits; the lane's next action may still go
    R_SKIP_LANE = 2     # nothing of this run can go this tick
    R_FAILED = 3        # can never fit: removed and reported UNSCHEDULABLE
    R_STOP_QUEUE = 4    # nothing more of this queue this tick
    R_STOP_TICK = 5     # dispatch ring full: stop the whole tick

# What the gate says when it chooses no cluster.
cdef enum:
    GATE_BUDGET = -1        # over the queue's remaining budget
    GATE_NO_CLUSTER = -2    # no open cluster covers it

# How a placement is charged.
cdef enum:
    M_REGULAR = 0       # the action's demand is charged
    M_POOL_START = 1    # the pool's footprint is charged once, on the pool
    M_FAST = 2          # warm pool already charged: nothing more


cdef inline int _spare_short(const i64* demand, const i64* need, const i64* budget,
                             Py_ssize_t n) noexcept nogil:
    # The first dimension in which demand, taken from the budget left, would leave less than
    # need; -1 when none (or when demand is over the budget itself: the gate says so).
    cdef Py_ssize_t r
    cdef int short = -1
    for r in range(n):
        if budget[r] < UNLIMITED and demand[r] > 0:
            if demand[r] > budget[r]:
                return -1
            if short < 0 and demand[r] + need[r] > budget[r]:
                short = <int>r
    return short


cdef inline i64 _now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <i64>ts.tv_sec * 1000000000 + ts.tv_nsec


@cython.final
cdef class TickKernel:
    """Scheduling kernel bound to the arrays of an ``engine._state.State``."""

    def __cinit__(self):
        self.tick_no = 0
        self.d_head = 0
        self.d_tail = 0
        self.f_count = 0
        self.n_pools_live = 0
        self.fz_head = -1
        self.fz_tail = -1
        self.lease_ttl = 0
        self.bf_held = 0
        self.bf_contested = 0
        self.s_held = 0
        self.s_avail = 0
        self.s_prev_held = 0
        self.s_prev_avail = 0
        self.examine_all = False
        self.s_pnode_row = -1
        self.s_pnode_cluster = -1
        self.s_nofit = -1

    def bind(self, state):
        """(Re)bind every array from ``state``; called once and after every growth."""
        self.n_res = state.n_res
        self.n_clusters = state.n_clusters
        self.n_queues = state.n_queues
        self.n_workers = state.n_workers
        self.n_envs = state.n_envs
        self.max_candidates = state.max_candidates
        self.gate_on = state.gate_on
        self.cpu_dim = state.cpu_dim
        self.res_accel = state.res_accel
        self.a_state = state.a_state
        self.a_queue = state.a_queue
        self.a_run = state.a_run
        self.a_qrun = state.a_qrun
        self.a_lane = state.a_lane
        self.a_env = state.a_env
        self.a_next = state.a_next
        self.a_prev = state.a_prev
        self.a_fit = state.a_fit
        self.a_demand = state.a_demand
        self.a_gen = state.a_gen
        self.a_released_gen = state.a_released_gen
        self.a_charged = state.a_charged
        self.a_cluster = state.a_cluster
        self.a_worker = state.a_worker
        self.a_wait_code = state.a_wait_code
        self.a_wait_tick = state.a_wait_tick
        self.a_wait_cluster = state.a_wait_cluster
        self.a_wait_dim = state.a_wait_dim
        self.a_wait_blocker = state.a_wait_blocker
        self.a_queued_tick = state.a_queued_tick
        self.a_held_code = state.a_held_code
        self.a_expiry = state.a_expiry
        self.a_end = state.a_end
        self.a_task = state.a_task
        self.t_pred_rt = state.t_pred_rt
        self.t_prior = state.t_prior
        self.a_est_rt = state.a_est_rt
        self.a_max_rt = state.a_max_rt
        self.a_runtime_due = state.a_runtime_due
        self.a_pred_end = state.a_pred_end
        self.a_backfilled = state.a_backfilled
        self.a_lnext = state.a_lnext
        self.a_lprev = state.a_lprev
        self.qr_queue = state.qr_queue
        self.qr_run = state.qr_run
        self.qr_adm = state.qr_adm
        self.qr_rel = state.qr_rel
        self.ln_head = state.ln_head
        self.ln_tail = state.ln_tail
        self.ln_next = state.ln_next
        self.ln_prev = state.ln_prev
        self.ln_in_ring = state.ln_in_ring
        self.ln_scan = state.ln_scan
        self.ln_scan_tick = state.ln_scan_tick
        self.ln_park = state.ln_park
        self.ln_skip_code = state.ln_skip_code
        self.ln_skip_tick = state.ln_skip_tick
        self.q_order = state.q_order
        self.q_priority = state.q_priority
        self.q_strict = state.q_strict
        self.q_action_cap = state.q_action_cap
        self.q_run_cap = state.q_run_cap
        self.q_max = state.q_max
        self.q_clusters = state.q_clusters
        self.q_adm = state.q_adm
        self.q_rel = state.q_rel
        self.q_runs_adm = state.q_runs_adm
        self.q_runs_rel = state.q_runs_rel
        self.q_res_adm = state.q_res_adm
        self.q_res_rel = state.q_res_rel
        self.q_pending = state.q_pending
        self.q_env_pending = state.q_env_pending
        self.q_doomed = state.q_doomed
        self.q_ring = state.q_ring
        self.q_stop_code = state.q_stop_code
        self.q_prev_stop = state.q_prev_stop
        self.q_stop_blocker = state.q_stop_blocker
        self.q_head = state.q_head
        self.q_head_code = state.q_head_code
        self.q_head_since = state.q_head_since
        self.q_backfill = state.q_backfill
        self.q_paused = state.q_paused
        self.q_backfilled = state.q_backfilled
        self.c_cap = state.c_cap
        self.c_adm = state.c_adm
        self.c_rel = state.c_rel
        self.c_obs = state.c_obs
        self.c_obs_mark = state.c_obs_mark
        self.c_live = state.c_live
        self.c_nodes = state.c_nodes
        self.c_node_first = state.c_node_first
        self.c_node_n = state.c_node_n
        self.n_alloc = state.n_alloc
        self.n_used = state.n_used
        self.n_obs = state.n_obs
        self.n_obs_mark = state.n_obs_mark
        self.n_adm = state.n_adm
        self.s_node_obs = True
        self.pg_vec = state.pg_vec
        self.pg_count = state.pg_count
        self.a_pg_first = state.a_pg_first
        self.a_pg_n = state.a_pg_n
        self.a_pnode = state.a_pnode
        self.s_pnode = state.s_pnode
        self.s_pnode_row = -1
        self.fz_state = state.fz_state
        self.fz_action = state.fz_action
        self.fz_cluster = state.fz_cluster
        self.fz_pref = state.fz_pref
        self.fz_worker = state.fz_worker
        self.fz_gen = state.fz_gen
        self.fz_released_gen = state.fz_released_gen
        self.fz_expiry = state.fz_expiry
        self.fz_end = state.fz_end
        self.fz_next = state.fz_next
        self.w_cluster = state.w_cluster
        self.w_slots = state.w_slots
        self.w_adm = state.w_adm
        self.w_rel = state.w_rel
        self.w_connected = state.w_connected
        self.w_ident = state.w_ident
        self.w_paused = state.w_paused
        self.u_cap = state.u_cap
        self.u_adm = state.u_adm
        self.u_rel = state.u_rel
        self.u_tenant = state.u_tenant
        self.tn_action_cap = state.tn_action_cap
        self.tn_run_cap = state.tn_run_cap
        self.tn_adm = state.tn_adm
        self.tn_rel = state.tn_rel
        self.tn_runs_adm = state.tn_runs_adm
        self.tn_runs_rel = state.tn_runs_rel
        self.e_queue = state.e_queue
        self.e_cluster = state.e_cluster
        self.e_slots = state.e_slots
        self.e_idle_ttl = state.e_idle_ttl
        self.e_last_active = state.e_last_active
        self.e_adm = state.e_adm
        self.e_rel = state.e_rel
        self.e_footprint = state.e_footprint
        self.e_gen = state.e_gen
        self.e_released_gen = state.e_released_gen
        self.d_action = state.d_action
        self.d_gen = state.d_gen
        self.d_cluster = state.d_cluster
        self.d_worker = state.d_worker
        self.d_kind = state.d_kind
        self.f_action = state.f_action
        self.f_code = state.f_code
        self.s_budget = state.s_budget
        self.s_free = state.s_free
        self.s_cfree = state.s_cfree
        self.s_prev_cfree = state.s_prev_cfree
        self.s_slots = state.s_slots
        self.s_held_by = state.s_held_by
        self.s_cursor = state.s_cursor
        self.s_first = state.s_first
        self.s_first_res = state.s_first_res
        self.s_bf_head = state.s_bf_head
        self.s_bq_head = state.s_bq_head
        self.s_bq_shadow = state.s_bq_shadow
        self.s_bq_gap = state.s_bq_gap
        self.s_bq_free = state.s_bq_free
        self.s_shadow = state.s_shadow
        self.s_extra = state.s_extra
        self.s_bf_gap = state.s_bf_gap
        self.s_rv_n = state.s_rv_n
        self.s_rv_head = state.s_rv_head
        self.s_rv_shadow = state.s_rv_shadow
        self.s_rv_gap = state.s_rv_gap
        self.s_rv_extra = state.s_rv_extra
        self.s_rv_nfree = state.s_rv_nfree
        self.s_nsave = state.s_nsave
        self.s_bf_pnode = state.s_bf_pnode
        self.s_bf_key = state.s_bf_key
        self.s_bf_row = state.s_bf_row
        if self.s_pnode.shape[0] != self.a_pnode.shape[1]:
            raise ValueError("the placement scratch and a_pnode differ in width")
        if self.n_clusters > 8 * <Py_ssize_t>sizeof(u64):
            raise ValueError(f"{self.n_clusters} clusters do not fit the uint64 cluster masks")
        self._check_counts(self.n_workers, self.n_envs)

    cdef int _check_counts(self, Py_ssize_t n_workers, Py_ssize_t n_envs) except -1:
        # The tick loops over rows 0..n-1 of these tables unchecked.
        if not 0 <= n_workers <= self.w_connected.shape[0]:
            raise ValueError(f"n_workers={n_workers} is not in "
                             f"[0, {self.w_connected.shape[0]}] (the worker table)")
        if not 0 <= n_envs <= self.e_cluster.shape[0]:
            raise ValueError(f"n_envs={n_envs} is not in "
                             f"[0, {self.e_cluster.shape[0]}] (the environment table)")
        return 0

    def set_counts(self, Py_ssize_t n_workers, Py_ssize_t n_envs):
        """Rows in use in the worker and environment tables."""
        self._check_counts(n_workers, n_envs)
        self.n_workers = n_workers
        self.n_envs = n_envs

    def set_lease_ttl(self, i64 ttl_ns):
        """How long a lease lives without a heartbeat (ns), from its assignment on."""
        if ttl_ns <= 0:
            raise ValueError("lease ttl must be positive")
        self.lease_ttl = ttl_ns

    # ---------------------------------------------------------------- capacity

    cdef void _cluster_free(self, int c) noexcept nogil:
        # Free = capacity minus in flight, and no more than what a worker last reported free
        # minus what was admitted since that report (UNLIMITED until a report arrives).
        cdef Py_ssize_t r
        cdef i64 free, seen
        for r in range(self.n_res):
            free = self.c_cap[c, r] - <i64>(self.c_adm[c, r] - self.c_rel[c, r])
            if self.c_obs[c, r] < UNLIMITED:
                seen = self.c_obs[c, r] - <i64>(self.c_adm[c, r] - self.c_obs_mark[c, r])
                if seen < free:
                    free = seen
            self.s_free[r] = free

    cdef void _snapshot_free(self) noexcept nogil:
        # Free vectors once per tick; placements subtract what they charge (exact: nothing
        # is released during a tick).
        cdef Py_ssize_t c, r
        for c in range(self.n_clusters):
            self._cluster_free(<int>c)
            for r in range(self.n_res):
                self.s_cfree[c, r] = self.s_free[r]

    cdef inline i64 _actions_left(self, i32 q) noexcept nogil:
        # Actions the queue may still admit: action_concurrency minus in flight; none while
        # it is paused (what it holds runs on; its queued actions wait).
        if self.q_paused[q]:
            return 0
        if self.q_action_cap[q] <= 0:
            return NO_CAP
        return self.q_action_cap[q] - <i64>(self.q_adm[q] - self.q_rel[q])

    cdef inline i64 _runs_left(self, i32 q) noexcept nogil:
        # Runs that may still start in the queue: run_concurrency minus runs in flight.
        if self.q_run_cap[q] <= 0:
            return NO_CAP
        return self.q_run_cap[q] - <i64>(self.q_runs_adm[q] - self.q_runs_rel[q])

    cdef inline u8 _tenant_capped(self, i32 u) noexcept nogil:
        # Which cap of run u's tenant stops it now (W_NONE: neither): run_concurrency when
        # the run has nothing in flight (starting would make one run more), else
        # action_concurrency. Counted over every queue, so neither depends on this one.
        cdef i32 t = self.u_tenant[u]
        if (self.tn_run_cap[t] > 0 and self.u_adm[u] == self.u_rel[u]
                and <i64>(self.tn_runs_adm[t] - self.tn_runs_rel[t]) >= self.tn_run_cap[t]):
            return W_TENANT_RUNS
        if (self.tn_action_cap[t] > 0
                and <i64>(self.tn_adm[t] - self.tn_rel[t]) >= self.tn_action_cap[t]):
            return W_TENANT_ACTIONS
        return W_NONE

    cdef void _queue_budget(self, i32 q) noexcept nogil:
        # The queue's remaining budget: max_resources minus its in-flight resources. (Row
        # pointers: once per queue a tick, the 2-D index cost more than the arithmetic.)
        cdef Py_ssize_t r
        cdef const i64* cap = &self.q_max[q, 0]
        cdef const u64* adm = &self.q_res_adm[q, 0]
        cdef const u64* rel = &self.q_res_rel[q, 0]
        cdef i64* budget = &self.s_budget[0]
        for r in range(self.n_res):
            if cap[r] >= UNLIMITED:
                budget[r] = UNLIMITED
            else:
                budget[r] = cap[r] - <i64>(adm[r] - rel[r])

    def cluster_free(self, int c):
        """The free vector of cluster ``c`` as the gate sees it now (a copy)."""
        check_index(c, self.n_clusters, "c", "a cluster row")
        self._cluster_free(c)
        return [self.s_free[r] for r in range(self.n_res)]

    # ---------------------------------------------------------------- lanes and rings

    cdef void _ring_insert(self, i32 lane) noexcept nogil:
        # A lane joins its queue's ring just before the cursor: last in the rotation.
        cdef i32 q = self.qr_queue[lane >> 1]
        cdef int kind = lane & 1
        cdef i32 cur = self.q_ring[q, kind]
        cdef i32 p
        if cur < 0:
            self.ln_next[lane] = lane
            self.ln_prev[lane] = lane
            self.q_ring[q, kind] = lane
        else:
            p = self.ln_prev[cur]
            self.ln_next[p] = lane
            self.ln_prev[lane] = p
            self.ln_next[lane] = cur
            self.ln_prev[cur] = lane
        self.ln_in_ring[lane] = 1

    cdef void _ring_remove(self, i32 lane) noexcept nogil:
        cdef i32 q = self.qr_queue[lane >> 1]
        cdef int kind = lane & 1
        cdef i32 n = self.ln_next[lane]
        cdef i32 p
        if n == lane:
            self.q_ring[q, kind] = -1
        else:
            p = self.ln_prev[lane]
            self.ln_next[p] = n
            self.ln_prev[n] = p
            if self.q_ring[q, kind] == lane:
                self.q_ring[q, kind] = n
        self.ln_in_ring[lane] = 0

    cdef void _link(self, i32 a) noexcept nogil:
        cdef i32 lane = self.a_lane[a]
        cdef i32 tail = self.ln_tail[lane]
        self.a_next[a] = -1
        self.a_prev[a] = tail
        if tail >= 0:
            self.a_next[tail] = a
        else:
            self.ln_head[lane] = a
        self.ln_tail[lane] = a
        # A lane scanned to its end this tick must see the newcomer next tick only.
        if not self.ln_in_ring[lane]:
            self._ring_insert(lane)
        self._count_pending(a, 1)
        self.a_state[a] = ST_QUEUED
        self.a_wait_code[a] = W_NONE
        self.a_wait_tick[a] = -1
        self.a_queued_tick[a] = self.tick_no

    cdef void _unlink(self, i32 a) noexcept nogil:
        cdef i32 lane = self.a_lane[a]
        cdef i32 n = self.a_next[a]
        cdef i32 p = self.a_prev[a]
        if p >= 0:
            self.a_next[p] = n
        else:
            self.ln_head[lane] = n
        if n >= 0:
            self.a_prev[n] = p
        else:
            self.ln_tail[lane] = p
        if self.ln_scan[lane] == a:
            self.ln_scan[lane] = n
        self.a_next[a] = -1
        self.a_prev[a] = -1
        if self.ln_head[lane] < 0 and self.ln_in_ring[lane]:
            self._ring_remove(lane)
        self._count_pending(a, -1)

    cdef void _count_pending(self, i32 a, i64 k) noexcept nogil:
        # A queue's depth, and the two kinds of queued action that keep the tick examining
        # every action of the queue (see _tick_queue): fast-lane candidates and doomed ones.
        cdef i32 q = self.a_queue[a]
        self.q_pending[q] += k
        if self.a_env[a] >= 0:
            self.q_env_pending[q] += k
        if self._doomed(q, a):
            self.q_doomed[q] += k

    cdef bint _doomed(self, i32 q, i32 a) noexcept nogil:
        # What the gate fails on sight (UNSCHEDULABLE): no cluster of the queue could ever
        # hold it, or its demand exceeds the queue's hard cap. A function of the queue's
        # settings and the action's fixed columns: recount_queue after a queue change.
        return self.gate_on and (
            (self.a_fit[a] & self.q_clusters[q]) == 0
            or first_short_dim(&self.a_demand[a, 0], &self.q_max[q, 0], self.n_res) >= 0)

    def recount_queue(self, i32 q):
        """Recount queue ``q``'s doomed actions after its clusters or hard cap changed (or
        the actions' fit masks did); call between ticks."""
        cdef i32 lane, start, a
        cdef int kind
        cdef i64 n = 0
        check_index(q, self.n_queues, "q", "a queue row")
        for kind in range(2):
            # Between ticks every lane with queued actions is in its queue's ring.
            start = self.q_ring[q, kind]
            lane = start
            while lane >= 0:
                a = self.ln_head[lane]
                while a >= 0:
                    n += self._doomed(q, a)
                    a = self.a_next[a]
                lane = self.ln_next[lane]
                if lane == start:
                    break
        self.q_doomed[q] = n

    def push(self, i32 a):
        """Append queued action ``a`` to the tail of its lane (its row must be filled in)."""
        check_index(a, self.a_state.shape[0], "a", "an action row")
        self._link(a)

    def push_many(self, i32[::1] rows not None):
        """Append many filled-in rows, in order."""
        cdef Py_ssize_t i
        # Checked before linking any: a bad row leaves every lane as it was.
        for i in range(rows.shape[0]):
            if not 0 <= rows[i] < self.a_state.shape[0]:
                check_index(rows[i], self.a_state.shape[0], f"rows[{i}]", "an action row")
        with nogil:
            for i in range(rows.shape[0]):
                self._link(rows[i])

    def remove(self, i32 a):
        """Take queued action ``a`` out of its lane (abort, deadline, timeout); the row is
        left in state DONE for the caller to set what comes next."""
        check_index(a, self.a_state.shape[0], "a", "an action row")
        if self.a_state[a] != ST_QUEUED:
            raise ValueError(f"action row a={a} is not queued")
        self._unlink(a)
        self.a_state[a] = ST_DONE

    # ---------------------------------------------------------------- release

    cdef bint _release(self, i32 a, i64 now) noexcept nogil:
        # Applied once per (lease, generation): a second release of the same generation,
        # or of a never-assigned row, changes nothing.
        cdef i64 gen = self.a_gen[a]
        if gen == 0 or self.a_released_gen[a] == gen:
            return False
        self.a_released_gen[a] = gen
        cdef i32 q = self.a_queue[a]
        cdef i32 c = self.a_cluster[a]
        cdef i32 qr = self.a_qrun[a]
        cdef i32 e = self.a_env[a]
        cdef Py_ssize_t r
        if self.a_charged[a]:
            for r in range(self.n_res):
                self.q_res_rel[q, r] += <u64>self.a_demand[a, r]
                self.c_rel[c, r] += <u64>self.a_demand[a, r]
            self._live_unlink(a)
            if self.c_nodes[c]:
                # Its pods leave their nodes (once: this generation is released now).
                self._node_charge(&self.a_pnode[a, 0], a, self.a_pnode.shape[1], -1)
        self.a_pred_end[a] = NEVER
        self.q_rel[q] += 1
        self.qr_rel[qr] += 1
        if self.qr_adm[qr] == self.qr_rel[qr]:
            self.q_runs_rel[q] += 1
        cdef i32 u = self.a_run[a]
        cdef i32 t = self.u_tenant[u]
        self.u_rel[u] += 1
        self.tn_rel[t] += 1
        if self.u_adm[u] == self.u_rel[u]:
            self.tn_runs_rel[t] += 1
        self.w_rel[self.a_worker[a]] += 1
        if e >= 0:
            self.e_rel[e] += 1
            self.e_last_active[e] = now
        return True

    def release(self, i32 a, i64 now):
        """Release the in-flight counts of ``a``'s current generation; False if already done."""
        check_index(a, self.a_state.shape[0], "a", "an action row")
        return self._release(a, now)

    cdef void _reap_pools(self, i64 now) noexcept nogil:
        # An idle warm pool past its idle_ttl gives its footprint back, once per pool start.
        cdef Py_ssize_t e, r
        cdef i32 q, c
        for e in range(self.n_envs):
            c = self.e_cluster[e]
            if c < 0 or self.e_adm[e] != self.e_rel[e]:
                continue
            if now - self.e_last_active[e] < self.e_idle_ttl[e]:
                continue
            if self.e_released_gen[e] != self.e_gen[e]:
                q = self.e_queue[e]
                for r in range(self.n_res):
                    self.q_res_rel[q, r] += <u64>self.e_footprint[e, r]
                    self.c_rel[c, r] += <u64>self.e_footprint[e, r]
                self.e_released_gen[e] = self.e_gen[e]
                self.n_pools_live -= 1
            self.e_cluster[e] = -1

    # ---------------------------------------------------------------- the tick

    cdef u64 _count_slots(self) noexcept nogil:
        cdef Py_ssize_t w
        cdef i64 free
        cdef u64 avail = 0
        for w in range(self.n_clusters):
            self.s_slots[w] = 0
        for w in range(self.n_workers):
            if not self.w_connected[w] or self.w_paused[w]:
                continue
            free = self.w_slots[w] - <i64>(self.w_adm[w] - self.w_rel[w])
            if free > 0:
                self.s_slots[self.w_cluster[w]] += free
        for w in range(self.n_clusters):
            if self.s_slots[w] > 0:
                avail |= (<u64>1) << w
        return avail

    cdef void _prefetch_candidates(self) noexcept nogil:
        # Each lane's first action is a row the tick will most likely examine, and a cold
        # one: its packed record (two lines: engine/_state.py ACTION_PACKED) and its demand
        # are asked of memory for every lane at once, before the scan needs the first of
        # them. (Measured: a second pass for each lane's second action gains nothing; the
        # same prefetch over unpacked columns gained nothing either, a line of 13 each.)
        cdef Py_ssize_t j
        cdef i32 q, lane, start, a
        cdef int kind, n
        cdef int budget = PREFETCH_ROWS
        for j in range(self.n_queues):
            q = self.q_order[j]
            if self.q_pending[q] == 0:
                continue
            for kind in range(2):
                start = self.q_ring[q, kind]
                lane = start
                n = 0
                while lane >= 0 and n < self.max_candidates:
                    a = self.ln_head[lane]
                    if a >= 0:
                        __builtin_prefetch(&self.a_fit[a])
                        __builtin_prefetch(<const char*>&self.a_fit[a] + 64)
                        __builtin_prefetch(&self.a_demand[a, 0])
                        budget -= 1
                        if budget == 0:
                            return
                    n += 1
                    lane = self.ln_next[lane]
                    if lane == start:
                        break

    cdef i64 _run(self, i64 now) noexcept nogil:
        cdef Py_ssize_t i, j, lo, full_from
        cdef i64 level
        cdef i32 q
        cdef u64 held = 0
        cdef u64 avail
        cdef i64 before = self.d_tail
        self.tick_no += 1
        self.f_count = 0
        if self.n_pools_live > 0:
            self._reap_pools(now)
        avail = self._count_slots()
        for i in range(self.n_clusters):
            self.s_held_by[i] = -1
            self.s_rv_n[i] = 0
        for i in range(self.n_queues):
            self.s_bf_head[i] = -1
            self.s_bq_head[i] = -1
        self.bf_held = 0
        self.bf_contested = 0
        # What the previous tick said of each queue's scan, for _held_code: this tick
        # overwrites q_stop_code before it places anything of the queue.
        for i in range(self.n_queues):
            self.q_prev_stop[i] = self.q_stop_code[i]
        # What the tick before left, for _held_code (an action it did not examine).
        self.s_prev_cfree[:, :] = self.s_cfree
        self.s_prev_held = self.s_held
        self.s_prev_avail = self.s_avail
        self._snapshot_free()
        self.s_held = 0
        self.s_avail = avail
        self._prefetch_candidates()
        if self.fz_head >= 0 and self._place_finalize(now, &avail):
            for j in range(self.n_queues):
                q = self.q_order[j]
                if self.q_pending[q] > 0:
                    self.q_stop_code[q] = W_DISPATCH_FULL
                    self.q_stop_blocker[q] = -1
            return self.d_tail - before
        i = 0
        full_from = -1
        while i < self.n_queues and full_from < 0:
            # One priority level: queues lo..hi-1. Their STRICT heads blocked in an earlier
            # tick are retried first, all of them, so what they hold binds every queue of the
            # level: only a queue of higher priority may take what a head waits for.
            level = self.q_priority[self.q_order[i]]
            lo = i
            while i < self.n_queues and self.q_priority[self.q_order[i]] == level:
                i += 1
            if self._retry_heads(lo, i, now, &held, &avail):
                full_from = lo
                break
            for j in range(lo, i):
                if self._tick_queue(self.q_order[j], now, &held, &avail):
                    full_from = j + 1
                    break
        if full_from >= 0:
            # Dispatch ring full: every later queue waits for the next tick.
            for j in range(full_from, self.n_queues):
                q = self.q_order[j]
                if self.q_pending[q] > 0:
                    self.q_stop_code[q] = W_DISPATCH_FULL
                    self.q_stop_blocker[q] = -1
        # What resolve_wait reads of this tick, with its free vectors (s_cfree, s_held_by).
        self.s_held = held
        self.s_avail = avail
        return self.d_tail - before

    cdef int _retry_heads(self, Py_ssize_t lo, Py_ssize_t hi, i64 now, u64* held,
                          u64* avail) noexcept nogil:
        # STRICT_FIFO: the head blocked in an earlier tick goes first, before any round
        # robin, so capacity freed since then accumulates for it instead of going to
        # whichever run comes first. If it still does not fit, it holds its clusters now.
        # Returns 1 when the dispatch ring is full.
        cdef Py_ssize_t k
        cdef i32 q, head
        cdef i64 actions_left, runs_left
        cdef int res
        for k in range(lo, hi):
            q = self.q_order[k]
            self.s_first[q] = -1
            head = self.q_head[q]
            # Only a head waiting on its own resources goes first; one that waited behind
            # another head's hold (HEAD_OF_LINE) takes its turn in the round robin.
            if (not self.q_strict[q] or head < 0 or self.a_state[head] != ST_QUEUED
                    or self.q_head_code[q] == W_HEAD_OF_LINE):
                continue
            actions_left = self._actions_left(q)
            if actions_left <= 0:
                continue
            runs_left = self._runs_left(q)
            self._queue_budget(q)
            res = self._try_place(q, head, now, held, avail, &actions_left, &runs_left)
            if res == R_STOP_TICK:
                return 1
            if res == R_PLACED or res == R_FAILED:
                self._unlink(head)
            self.s_first[q] = head
            self.s_first_res[q] = res
        return 0

    def run(self, i64 now):
        """Run one tick at time ``now`` (ns); returns the number of assignments made. Its
        wall time is kept as ``last_run_ns`` (two clock readings: the decision's own part of
        ``Engine.decide()``, apart from the engine's Python around it)."""
        cdef i64 placed, t0
        with nogil:
            t0 = _now_ns()
            placed = self._run(now)
            self.last_run_ns = _now_ns() - t0
        return placed

    cdef int _place_finalize(self, i64 now, u64* avail) noexcept nogil:
        # Cleanup never waits behind new work: finalize leases go first, to the worker that
        # ran the attempt while it is connected with a free slot, else to any worker of
        # that cluster. One that cannot be placed now stays pending without blocking others.
        # Returns 1 when the dispatch ring is full.
        cdef i32 f = self.fz_head, prev = -1, nxt, w, p
        cdef int c
        while f >= 0:
            nxt = self.fz_next[f]
            if self.d_tail - self.d_head >= self.d_action.shape[0]:
                return 1
            c = self.fz_cluster[f]
            p = self.fz_pref[f]
            w = -1
            if (p >= 0 and self.w_connected[p] and not self.w_paused[p]
                    and self.w_slots[p] > <i64>(self.w_adm[p] - self.w_rel[p])):
                w = p
            elif self.s_slots[c] > 0:
                w = self._pick_worker(c)
            if w < 0:
                prev = f
                f = nxt
                continue
            if prev >= 0:
                self.fz_next[prev] = nxt
            else:
                self.fz_head = nxt
            if self.fz_tail == f:
                self.fz_tail = prev
            self.fz_next[f] = -1
            self.fz_gen[f] += 1
            self.fz_state[f] = ST_SENT
            self.fz_worker[f] = w
            self.fz_expiry[f] = now + self.lease_ttl
            self.fz_end[f] = END_LIVE
            self.w_adm[w] += 1
            self.s_slots[c] -= 1
            if self.s_slots[c] <= 0:
                avail[0] &= ~((<u64>1) << c)
            self._push_dispatch(KIND_FINALIZE, f, self.fz_gen[f], c, w)
            f = nxt
        return 0

    def push_finalize(self, i32 f):
        """Queue finalize lease ``f`` (its row filled in) for placement first next tick."""
        check_index(f, self.fz_state.shape[0], "f", "a finalize row")
        self._push_finalize(f)

    cdef void _push_finalize(self, i32 f) noexcept nogil:
        self.fz_state[f] = ST_QUEUED
        self.fz_next[f] = -1
        if self.fz_tail >= 0:
            self.fz_next[self.fz_tail] = f
        else:
            self.fz_head = f
        self.fz_tail = f

    def remove_finalize(self, i32 f):
        """Take pending finalize lease ``f`` out of the pending list."""
        cdef i32 g = self.fz_head, prev = -1
        check_index(f, self.fz_state.shape[0], "f", "a finalize row")
        while g >= 0 and g != f:
            prev = g
            g = self.fz_next[g]
        if g < 0:
            raise ValueError(f"finalize lease {f} is not pending")
        if prev >= 0:
            self.fz_next[prev] = self.fz_next[f]
        else:
            self.fz_head = self.fz_next[f]
        if self.fz_tail == f:
            self.fz_tail = prev
        self.fz_next[f] = -1

    def release_finalize(self, i32 f):
        """Release the worker slot of ``f``'s current generation once; False if done."""
        check_index(f, self.fz_state.shape[0], "f", "a finalize row")
        cdef i64 gen = self.fz_gen[f]
        if gen == 0 or self.fz_released_gen[f] == gen:
            return False
        self.fz_released_gen[f] = gen
        self.w_rel[self.fz_worker[f]] += 1
        return True

    cdef int _tick_queue(self, i32 q, i64 now, u64* held, u64* avail) noexcept nogil:
        cdef i64 actions_left, runs_left
        cdef i64 cand = 0
        cdef int kind = 0
        cdef int res
        cdef i32 lane, a, first
        cdef i32 park_head = -1, park_tail = -1
        cdef u8 stop = W_NONE
        cdef i32 stop_blocker = -1
        cdef i32 head = -1
        cdef u8 head_code = W_NONE
        cdef int stop_tick = 0

        self.q_stop_code[q] = W_NONE
        self.q_stop_blocker[q] = -1
        if self.q_pending[q] == 0:
            self.q_head[q] = -1
            return 0
        actions_left = self._actions_left(q)
        runs_left = self._runs_left(q)
        self._queue_budget(q)

        # A STRICT head retried before this level (see _retry_heads) is not examined again.
        first = self.s_first[q]
        if first >= 0:
            cand += 1
            res = self.s_first_res[q]
            if res == R_PLACED or res == R_FAILED:
                first = -1
            elif res == R_STOP_QUEUE:
                self._end_queue(q, now, W_HEAD_BUDGET, first, first, self.a_wait_code[first])
                return 0
            elif res == R_SKIP_ACTION:
                head = first
                head_code = self.a_wait_code[first]
            else:
                # Its run is capped: the head is not blocked on resources any more.
                first = -1

        while True:
            if self.q_ring[q, kind] < 0:
                kind ^= 1
                if self.q_ring[q, kind] < 0:
                    break
            if actions_left <= 0:
                stop = W_QUEUE_PAUSED if self.q_paused[q] else W_QUEUE_ACTIONS
                break
            if cand >= self.max_candidates:
                stop = W_CANDIDATE_LIMIT
                break
            if head >= 0 and self._queue_held(q, held[0], avail[0]):
                # Nothing more of this queue can be placed this tick, and examining the rest
                # would change nothing but their wait stamps (most of a saturated tick's
                # work): explain resolves those on demand (resolve_wait).
                stop = W_QUEUE_HELD
                break
            lane = self.q_ring[q, kind]
            if self.ln_scan_tick[lane] != self.tick_no:
                self.ln_scan_tick[lane] = self.tick_no
                self.ln_scan[lane] = self.ln_head[lane]
            a = self.ln_scan[lane]
            if a < 0:
                # Every action of this lane was examined this tick: park it.
                self._ring_remove(lane)
                self.ln_park[lane] = -1
                if park_tail >= 0:
                    self.ln_park[park_tail] = lane
                else:
                    park_head = lane
                park_tail = lane
                continue
            if a == first:
                # Already examined first this tick.
                self.ln_scan[lane] = self.a_next[a]
                self.q_ring[q, kind] = self.ln_next[lane]
                continue
            cand += 1
            res = self._try_place(q, a, now, held, avail, &actions_left, &runs_left)
            if res == R_PLACED or res == R_FAILED:
                self._unlink(a)
                if self.ln_in_ring[lane]:
                    self.q_ring[q, kind] = self.ln_next[lane]
            elif res == R_SKIP_ACTION:
                if head < 0 and self.a_wait_code[a] != W_NO_WORKER:
                    head = a
                    head_code = self.a_wait_code[a]
                self.ln_scan[lane] = self.a_next[a]
                self.q_ring[q, kind] = self.ln_next[lane]
            elif res == R_SKIP_LANE:
                # The run is capped: every action behind this one waits for the same reason.
                self.ln_skip_code[lane] = self.a_wait_code[a]
                self.ln_skip_tick[lane] = self.tick_no
                self._ring_remove(lane)
                self.ln_park[lane] = -1
                if park_tail >= 0:
                    self.ln_park[park_tail] = lane
                else:
                    park_head = lane
                park_tail = lane
            elif res == R_STOP_QUEUE:
                if head < 0:
                    head = a
                    head_code = self.a_wait_code[a]
                stop = W_HEAD_BUDGET
                stop_blocker = a
                break
            else:
                stop = W_DISPATCH_FULL
                stop_tick = 1
                break
            kind ^= 1

        # Parked lanes rejoin at the end of the rotation, in the order they were parked.
        while park_head >= 0:
            lane = park_head
            park_head = self.ln_park[lane]
            if self.ln_head[lane] >= 0:
                self._ring_insert(lane)

        self._end_queue(q, now, stop, stop_blocker, head, head_code)
        return stop_tick

    cdef bint _queue_held(self, i32 q, u64 held, u64 avail) noexcept nogil:
        # True when examining the rest of queue q's actions this tick (its head blocked)
        # could neither place nor fail any of them, nor change anything another queue's
        # decision reads: every cluster open to it is held by a blocked head or has no free
        # worker; no backfill runs behind its own head; nothing queued could take the fast
        # lane or fail on sight; and, STRICT_FIFO, its waiting actions would add no hold
        # (every cluster it may use is held already) and no cluster it may use has a
        # reservation still open (they could backfill there, reserve, or close it).
        cdef u64 mine
        if (self.examine_all or not self.gate_on or self.q_env_pending[q] != 0
                or self.q_doomed[q] != 0
                or (self.q_clusters[q] & avail & ~held) != 0
                or (self.q_backfill[q] and self.s_bf_head[q] >= 0)):
            return False
        if not self.q_strict[q]:
            return True
        mine = self.q_clusters[q]
        if (mine & ~held) != 0:
            return False
        return (mine & self.bf_held & ~self.bf_contested) == 0

    cdef void _end_queue(self, i32 q, i64 now, u8 stop, i32 stop_blocker, i32 head,
                         u8 head_code) noexcept nogil:
        self.q_stop_code[q] = stop
        self.q_stop_blocker[q] = stop_blocker
        if head != self.q_head[q]:
            self.q_head_since[q] = now
        self.q_head[q] = head
        self.q_head_code[q] = head_code

    cdef void _wait(self, i32 a, u8 code, i32 cluster, i32 dim, i32 blocker) noexcept nogil:
        self.a_wait_code[a] = code
        self.a_wait_tick[a] = self.tick_no
        self.a_wait_cluster[a] = cluster
        self.a_wait_dim[a] = dim
        self.a_wait_blocker[a] = blocker

    cdef int _try_place(self, i32 q, i32 a, i64 now, u64* held, u64* avail,
                        i64* actions_left, i64* runs_left) noexcept nogil:
        cdef i32 qr = self.a_qrun[a]
        cdef i32 u = self.a_run[a]
        cdef i32 e = self.a_env[a]
        cdef i32 ec
        cdef u64 fit, open_, bit
        cdef int c, dim, cap_dim
        cdef u64 mine, cands
        cdef bint bq = False
        cdef u8 tcode
        cdef i32 h, t
        cdef const i64* demand = &self.a_demand[a, 0]

        # Caps first: they are about counts, not resources. (The queue's runs left first: a
        # local, so the run's counters are read only when that cap binds.)
        if runs_left[0] <= 0 and self.qr_adm[qr] == self.qr_rel[qr]:
            self._wait(a, W_QUEUE_RUNS, -1, -1, -1)
            return R_SKIP_LANE
        if self.u_cap[u] > 0 and <i64>(self.u_adm[u] - self.u_rel[u]) >= self.u_cap[u]:
            self._wait(a, W_RUN_ACTIONS, -1, -1, -1)
            return R_SKIP_LANE
        # The tenant's caps, as the run's: the lane (one run, so one tenant) is skipped, and
        # the action neither becomes its queue's head nor holds anything, so other tenants'
        # work behind it goes on (and a STRICT_FIFO queue is not blocked by it).
        t = self.u_tenant[u]
        if (self.tn_run_cap[t] | self.tn_action_cap[t]) != 0:
            # (Most tenants have no cap: one test, no call, on their path.)
            tcode = self._tenant_capped(u)
            if tcode != W_NONE:
                self._wait(a, tcode, -1, -1, -1)
                return R_SKIP_LANE
        if self.d_tail - self.d_head >= self.d_action.shape[0]:
            # Checked before reserving, so a full channel never leaves a reservation behind.
            self._wait(a, W_DISPATCH_FULL, -1, -1, -1)
            return R_STOP_TICK

        # Fast lane: a warm pool of its environment already runs; its footprint is charged.
        if e >= 0 and self.e_cluster[e] >= 0:
            ec = self.e_cluster[e]
            if not (self.q_clusters[q] >> ec) & 1:
                # One pool per environment: it waits until that pool idles out.
                self._wait(a, W_POOL_ELSEWHERE, ec, -1, -1)
                return R_SKIP_ACTION
            if <i64>(self.e_adm[e] - self.e_rel[e]) >= self.e_slots[e]:
                self._wait(a, W_POOL_BUSY, ec, -1, -1)
                return R_SKIP_ACTION
            if not (avail[0] >> ec) & 1:
                self._wait(a, W_NO_WORKER, ec, -1, -1)
                return R_SKIP_ACTION
            self._place(a, ec, M_FAST, now, avail, actions_left, runs_left)
            return R_PLACED

        if not self.gate_on:
            open_ = self.q_clusters[q] & avail[0]
            if open_ == 0:
                self._wait(a, W_NO_WORKER, -1, -1, -1)
                return R_SKIP_ACTION
            c = self._choose_cluster(a, open_)
            self._place(a, c, M_POOL_START if e >= 0 else M_REGULAR, now, avail,
                        actions_left, runs_left)
            return R_PLACED

        # Never fits: no allowed cluster could ever hold it (or, below, over the hard cap).
        fit = self.a_fit[a] & self.q_clusters[q]
        if fit == 0:
            self._wait(a, W_UNSCHEDULABLE_SHAPE, -1, -1, -1)
            self._fail(a, W_UNSCHEDULABLE_SHAPE)
            return R_FAILED
        # Budget backfill: behind a head that waits for its queue's budget, a later action
        # may start only if its prediction says it ends before the head's budget shadow
        # time (rule (a) only: the head's need at that time is its whole demand, and what it
        # will need of the clusters then is not known here).
        h = self.s_bq_head[q]
        if h >= 0 and h != a:
            if not self._budget_gap(q, h, a, now):
                self._wait(a, W_HEAD_BUDGET, -1, -1, h)
                return R_SKIP_ACTION
            bq = True
        c = self._gate(a, fit, held[0], avail[0], &dim)
        if c >= 0:
            # Behind a head blocked on capacity (backfill on), the head's share of the queue
            # budget is reserved: the budget is not per cluster, and what a later action takes
            # of it on a cluster the head does not hold, the head may need when one of its own
            # frees up. Without backfill that work would often be waiting behind a later
            # action's hold; with it, that action may be running (backfilled) instead. So a
            # later action spends only the budget left beyond the head's demand.
            h = self.s_bf_head[q]
            if h >= 0 and h != a:
                dim = _spare_short(demand, &self.a_demand[h, 0], &self.s_budget[0],
                                   self.n_res)
                if dim >= 0:
                    self._wait(a, W_HEAD_BUDGET, -1, dim, h)
                    return R_SKIP_ACTION
            self._place(a, c, M_POOL_START if e >= 0 else M_REGULAR, now, avail,
                        actions_left, runs_left)
            if bq:
                self.a_backfilled[a] = 1
                self.q_backfilled[q] += 1
            return R_PLACED
        if c == GATE_BUDGET:
            # The budget left never exceeds the hard cap, so the cap is only consulted
            # when the budget says no.
            cap_dim = first_short_dim(demand, &self.q_max[q, 0], self.n_res)
            if cap_dim >= 0:
                self._wait(a, W_UNSCHEDULABLE_CAP, -1, cap_dim, -1)
                self._fail(a, W_UNSCHEDULABLE_CAP)
                return R_FAILED
            self._wait(a, W_QUEUE_BUDGET, -1, dim, -1)
            if not self.q_strict[q]:
                return R_SKIP_ACTION
            if self.q_backfill[q]:
                # The head the budget backfill protects (the first one blocked this tick);
                # a backfill candidate short of budget just waits.
                if self.s_bq_head[q] < 0:
                    self.s_bq_head[q] = a
                    self.s_bq_shadow[q] = -1
                return R_SKIP_ACTION
            return R_STOP_QUEUE

        # EASY backfill: a later action may use a cluster held by a blocked head earlier in
        # the pass (of its own queue or of another) when it respects every reservation made
        # on that cluster so far (per reservation, rule (a): it ends before that head's
        # shadow time; rule (b): it fits in what that head will not need then), and only
        # within the budget its own queue's head leaves (by either rule: a rule (b) action
        # keeps its share for good, and the head may start on another cluster before a rule
        # (a) action ends). Refused, it waits as without backfill, holding what it could use.
        cands = fit & avail[0] & held[0] & self.bf_held & ~self.bf_contested
        h = self.s_bf_head[q]
        if (cands != 0 and self.q_backfill[q]
                and (h < 0 or h == a
                     or _spare_short(demand, &self.a_demand[h, 0], &self.s_budget[0],
                                     self.n_res) < 0)):
            c = self._backfill(a, cands, now)
            if c >= 0:
                self._take_reservations(a, c, now)
                self._place(a, c, M_POOL_START if e >= 0 else M_REGULAR, now, avail,
                            actions_left, runs_left)
                self.a_backfilled[a] = 1
                self.q_backfilled[q] += 1
                return R_PLACED

        # Not placed: say why, and under STRICT_FIFO hold what it could use.
        if (fit & avail[0]) == 0:
            self._wait(a, W_NO_WORKER, -1, -1, -1)
            return R_SKIP_ACTION
        # Blocked by a head only if a held cluster would otherwise have room for it now.
        c = self._choose_cluster(a, fit & avail[0] & held[0])
        if c >= 0:
            self._wait(a, W_HEAD_OF_LINE, c, -1, self.s_held_by[c])
        elif self.s_nofit >= 0:
            self._wait(a, W_NO_NODE_FIT, self.s_nofit, -1, -1)
        else:
            c = lowest_bit(fit & avail[0])
            dim = first_short_dim(demand, &self.s_cfree[c, 0], self.n_res)
            self._wait(a, W_CLUSTER_CAPACITY, c, dim, -1)
        if self.q_strict[q]:
            open_ = fit & ~held[0]
            while open_ != 0:
                c = lowest_bit(open_)
                bit = (<u64>1) << c
                open_ &= ~bit
                self.s_held_by[c] = a
            # Who may backfill under this hold. The first action of a backfill queue blocked
            # this tick is the head its queue protects: it adds a reservation on every
            # cluster it wants that is not closed, behind the reservations made earlier in
            # the pass (higher priority first). Any other blocked action of a backfill queue
            # reserves nothing (as in EASY, one reservation per head): the clusters it newly
            # holds are closed. A head of a queue without backfill is protected by its hold
            # alone, so every cluster it wants is closed, to every queue after it.
            mine = fit & ~self.bf_contested
            if self.q_backfill[q] and self.s_bf_head[q] < 0 and mine != 0:
                self._reserve(q, a, mine)
            elif self.q_backfill[q]:
                self.bf_contested |= fit & ~held[0]
            else:
                self.bf_contested |= fit
            held[0] |= fit
        return R_SKIP_ACTION

    # ---------------------------------------------------------------- backfill

    cdef void _live_link(self, i32 a, int c) noexcept nogil:
        cdef i32 h = self.c_live[c]
        self.a_lprev[a] = -1
        self.a_lnext[a] = h
        if h >= 0:
            self.a_lprev[h] = a
        self.c_live[c] = a

    cdef void _live_unlink(self, i32 a) noexcept nogil:
        cdef i32 n = self.a_lnext[a]
        cdef i32 p = self.a_lprev[a]
        if p >= 0:
            self.a_lnext[p] = n
        elif self.c_live[self.a_cluster[a]] == a:
            self.c_live[self.a_cluster[a]] = n
        if n >= 0:
            self.a_lprev[n] = p
        self.a_lnext[a] = -1
        self.a_lprev[a] = -1

    cdef void _sift_down(self, Py_ssize_t root, Py_ssize_t n) noexcept nogil:
        # Restore the min-heap order of s_bf_key[:n] (s_bf_row alongside) below root.
        cdef Py_ssize_t child
        cdef i64 k
        cdef i32 w
        while True:
            child = 2 * root + 1
            if child >= n:
                return
            if child + 1 < n and self.s_bf_key[child + 1] < self.s_bf_key[child]:
                child += 1
            if self.s_bf_key[root] <= self.s_bf_key[child]:
                return
            k = self.s_bf_key[root]
            self.s_bf_key[root] = self.s_bf_key[child]
            self.s_bf_key[child] = k
            w = self.s_bf_row[root]
            self.s_bf_row[root] = self.s_bf_row[child]
            self.s_bf_row[child] = w
            root = child

    cdef Py_ssize_t _pop_end(self, Py_ssize_t n) noexcept nogil:
        # Move the earliest end of the heap s_bf_key[:n] to slot n - 1; returns n - 1.
        cdef i64 k = self.s_bf_key[0]
        cdef i32 w = self.s_bf_row[0]
        n -= 1
        self.s_bf_key[0] = self.s_bf_key[n]
        self.s_bf_row[0] = self.s_bf_row[n]
        self.s_bf_key[n] = k
        self.s_bf_row[n] = w
        self._sift_down(0, n)
        return n

    cdef inline i64 _pred_rt(self, i32 a) noexcept nogil:
        # What the predictor expects one attempt of a to run (ns; NEVER unknown), in the
        # order of docs/predictions.md: its spec's runtime estimate (at most its max_runtime,
        # checked at enqueue), else its history key's recent successes, each bounded by its
        # max_runtime; the max_runtime alone when neither is known.
        cdef i64 rt = self.a_est_rt[a]
        if rt < NEVER:
            return rt
        if self.a_task[a] >= 0:
            rt = self.t_pred_rt[self.a_task[a]]
        if self.a_max_rt[a] < rt:
            rt = self.a_max_rt[a]
        return rt

    cdef i64 _candidate_rt(self, i32 a) noexcept nogil:
        # _pred_rt for a backfill candidate under rule (a): a shape's prior does not prove
        # that an action ends in time (it may serve a live lease's end, not a candidate).
        cdef i64 rt = self.a_est_rt[a]
        if rt < NEVER:
            return rt
        rt = NEVER
        if self.a_task[a] >= 0 and not self.t_prior[self.a_task[a]]:
            rt = self.t_pred_rt[self.a_task[a]]
        if self.a_max_rt[a] < rt:
            rt = self.a_max_rt[a]
        return rt

    cdef i64 _live_end(self, i32 a, i64 now) noexcept nogil:
        # When live lease a is predicted to end. A lease past its predicted end is extended
        # as EASY++ does, never assumed to end now: its end steps up by the first of
        # OVERRUN_STEPS that puts it in the future, bounded by the engine's max_runtime
        # backstop (a_runtime_due) when the attempt runs under one. Computed, not stored: the
        # same end every time for the same now, and nothing to write or allocate.
        cdef i64 end = self.a_pred_end[a]
        cdef i64 cap = NEVER, rt
        cdef Py_ssize_t i
        if end >= now:
            return end
        if self.a_state[a] == ST_SENT:
            # Not running yet (its pods pend, or no RUNNING came): a prediction of running
            # time cannot have been overrun; it ends no sooner than that time from now.
            rt = self._pred_rt(a)
            return now + rt if rt < NEVER - now else NEVER
        if self.a_state[a] == ST_RUNNING:
            cap = self.a_runtime_due[a]     # armed at RUNNING (a sent lease's is stale)
        if cap <= now:
            return now          # past the backstop: the engine ends it at this tick's timers
        for i in range(N_OVERRUN_STEPS):
            if end + OVERRUN_STEPS[i] > now:
                end += OVERRUN_STEPS[i]
                return end if end < cap else cap
        return cap              # NEVER when no bound is declared: no longer predictable

    cdef inline Py_ssize_t _push_end(self, i32 a, Py_ssize_t n, i64 now,
                                     bint* overrun) noexcept nogil:
        # Live lease a into the scratch heap at slot n, keyed by its predicted end, extended
        # when it overran (a backfilled lease past its first prediction is an overrun).
        cdef i64 key = self.a_pred_end[a]
        if key < now:
            if self.a_backfilled[a] and self.a_state[a] != ST_SENT:
                overrun[0] = True
            key = self._live_end(a, now)
        self.s_bf_key[n] = key
        self.s_bf_row[n] = a
        return n + 1

    cdef i64 _first_cover(self, const i64* need, i64* free, Py_ssize_t n, i64 now, i32 h,
                          int c, i64* nfree) noexcept nogil:
        # The earliest time at which free plus the demand of the leases in the scratch heap
        # s_bf_key/s_bf_row[:n] (predicted ends) released by then covers need; NEVER when
        # unknown. free accumulates the releases (it ends as what is free at that time).
        # A min-heap (O(n) to build) popped only until covered: the usual case needs a few
        # releases out of many live leases, not a full sort. With node cluster c >= 0 also
        # h's pods must be placeable (first fit decreasing, as the gate will place them) on
        # the nodes as those releases leave them: each released lease's pods come off n_used
        # for the projection and are charged back before returning, and nfree (when not
        # NULL) gets what each node of c has free then (row node * R, before h's pods).
        cdef Py_ssize_t total = n, i, r, node
        cdef Py_ssize_t width = self.a_pnode.shape[1]
        cdef i64 t, shadow = NEVER
        cdef i32 a
        # A worker's report says what is free now, not later: the projection runs on the
        # engine's own accounting (the gate's placements, which are now, do read it).
        self.s_node_obs = c < 0
        if covers(need, free, self.n_res) and (c < 0 or self._node_fit(h, c)):
            shadow = now
        else:
            i = n // 2
            while i > 0:
                i -= 1
                self._sift_down(i, n)
            while n > 0:
                t = self.s_bf_key[0]
                if t == NEVER:
                    break
                while n > 0 and self.s_bf_key[0] == t:
                    n = self._pop_end(n)
                    a = self.s_bf_row[n]
                    for r in range(self.n_res):
                        if free[r] < UNLIMITED:
                            free[r] += self.a_demand[a, r]
                    if c >= 0:
                        self._node_charge(&self.a_pnode[a, 0], a, width, -1)
                if covers(need, free, self.n_res) and (c < 0 or self._node_fit(h, c)):
                    shadow = t
                    break
        if c >= 0:
            if nfree != NULL and shadow < NEVER:
                for node in range(self.c_node_first[c],
                                  self.c_node_first[c] + self.c_node_n[c]):
                    for r in range(self.n_res):
                        nfree[node * self.n_res + r] = (self.n_alloc[node, r]
                                                        - self.n_used[node, r])
            for i in range(n, total):      # the popped leases, back on their nodes
                a = self.s_bf_row[i]
                self._node_charge(&self.a_pnode[a, 0], a, width, 1)
        self.s_node_obs = True
        return shadow

    cdef i64 _shadow(self, i32 h, int c, const i64* free_now, i64 now) noexcept nogil:
        # The shadow time of head h on cluster c (_shadow_into) into s_shadow[c], s_extra[c]
        # and s_bf_gap[c] (head_eta's scratch).
        cdef u8 gap
        cdef i64 shadow = self._shadow_into(h, c, free_now, now, &self.s_extra[c, 0], &gap,
                                            NULL)
        self.s_shadow[c] = shadow
        self.s_bf_gap[c] = gap
        return shadow

    cdef i64 _shadow_into(self, i32 h, int c, const i64* free_now, i64 now, i64* extra,
                          u8* gap, i64* nfree) noexcept nogil:
        # The shadow time of head h on cluster c: the earliest predicted time at which what
        # is free now plus what the live charged leases of c release covers h's demand (on
        # a node cluster: and h's pods can be placed on the nodes, _first_cover, which writes
        # nfree when not NULL). Writes extra (free then, beyond h's demand; -1 when unknown)
        # and gap (rule (a) open: the time is known and no backfilled lease overran). A lease
        # past its predicted end still releases no earlier than now.
        cdef const i64* need = &self.a_demand[h, 0]
        cdef i64* free = extra
        cdef i64 shadow
        cdef Py_ssize_t n = 0, r
        cdef bint overrun = False
        cdef i32 a = self.c_live[c]
        for r in range(self.n_res):
            free[r] = free_now[r]
        while a >= 0:
            n = self._push_end(a, n, now, &overrun)
            a = self.a_lnext[a]
        shadow = self._first_cover(need, free, n, now, h, c if self.c_nodes[c] else -1, nfree)
        gap[0] = shadow < NEVER and not overrun
        for r in range(self.n_res):
            free[r] = free[r] - need[r] if shadow < NEVER else -1
        return shadow

    cdef bint _fits_beside(self, i32 h, int c, const i64* nfree, i32 a,
                           const i32* nodes) noexcept nogil:
        # Rule (b) on node cluster c: whether head h's pods can still be placed at its shadow
        # time, on the nodes as its reservation predicts them free then (nfree), with a
        # holding its pods (placed on nodes) all the while. The nodes' n_used is swapped for
        # that projection for one placement trial, then restored.
        cdef Py_ssize_t node, r
        cdef Py_ssize_t first = self.c_node_first[c], end = first + self.c_node_n[c]
        cdef bint ok
        for node in range(first, end):
            for r in range(self.n_res):
                self.s_nsave[node, r] = self.n_used[node, r]
                self.n_used[node, r] = self.n_alloc[node, r] - nfree[node * self.n_res + r]
        self._pods_add(&self.n_used[0, 0], nodes, a, self.s_bf_pnode.shape[0], 1)
        self.s_node_obs = False         # a projection of the shadow time: no report applies
        ok = self._node_fit(h, c)
        self.s_node_obs = True
        for node in range(first, end):
            for r in range(self.n_res):
                self.n_used[node, r] = self.s_nsave[node, r]
        return ok

    cdef void _reserve(self, i32 q, i32 h, u64 mine) noexcept nogil:
        # h is the first action of backfill queue q blocked this tick: it is the head the
        # backfill protects, with a reservation on each cluster of mine (it holds them, and
        # none is closed), after the reservations already made there this tick. One head per
        # queue, so a cluster has at most Q. Their shadow times are computed lazily, by the
        # first candidate that tests the cluster (_backfill), so a head with nothing behind
        # it costs nothing. Until then nothing is placed on the cluster (every placement
        # there passes every reservation on it), so what the shadow time is computed from is
        # the cluster as it was when h reserved it.
        cdef int c
        cdef i32 k
        self.s_bf_head[q] = h
        self.bf_held |= mine
        while mine != 0:
            c = lowest_bit(mine)
            mine &= ~((<u64>1) << c)
            k = self.s_rv_n[c]
            self.s_rv_head[c, k] = h
            self.s_rv_shadow[c, k] = -1
            self.s_rv_n[c] = k + 1

    cdef bint _budget_gap(self, i32 q, i32 h, i32 a, i64 now) noexcept nogil:
        # Rule (a) behind budget head h of queue q: a (not a warm-pool start) has a runtime
        # history and ends before h's budget shadow time (computed once per head per tick).
        cdef i64 rt = NEVER
        if self.s_bq_shadow[q] < 0:
            self.s_bq_shadow[q] = self._budget_shadow(q, h, now)
        if self.a_env[a] < 0:
            rt = self._candidate_rt(a)
        return (self.s_bq_gap[q] and rt < NEVER and self.s_bq_shadow[q] < NEVER
                and rt <= self.s_bq_shadow[q] - now)

    cdef i64 _budget_shadow(self, i32 q, i32 h, i64 now) noexcept nogil:
        # The budget shadow time of head h of queue q: the earliest predicted time at which
        # the queue's budget left (s_budget, this tick's) plus what its live charged leases
        # release covers h's demand. Sets s_bq_gap[q] (known, and no backfilled lease of the
        # queue overran its prediction). Leases in flight are found on the per-cluster live
        # lists; warm-pool footprints are not (counted as never released: later, not earlier).
        cdef const i64* need = &self.a_demand[h, 0]
        cdef i64* free = &self.s_bq_free[0]
        cdef i64 shadow
        cdef Py_ssize_t n = 0, r
        cdef bint overrun = False
        cdef int c
        cdef i32 a
        for r in range(self.n_res):
            free[r] = self.s_budget[r]
        for c in range(self.n_clusters):
            a = self.c_live[c]
            while a >= 0:
                if self.a_queue[a] == q:
                    n = self._push_end(a, n, now, &overrun)
                a = self.a_lnext[a]
        shadow = self._first_cover(need, free, n, now, -1, -1, NULL)
        self.s_bq_gap[q] = shadow < NEVER and not overrun
        return shadow

    cdef int _backfill(self, i32 a, u64 cands, i64 now) noexcept nogil:
        # Which cluster of cands (fit, free worker, held, with reservations, not closed)
        # action a may backfill now, or -1: one whose free vector covers a and where a
        # respects every reservation, each by rule (a) or rule (b). Clusters where rule (a)
        # admits it for every reservation come first (they leave the extra capacity alone).
        cdef const i64* demand = &self.a_demand[a, 0]
        # A warm pool's footprint outlives the action that starts it (until idle_ttl), so
        # starting a pool is never proven to end in time: rule (b) only.
        cdef i64 rt = NEVER
        if self.a_env[a] < 0:
            rt = self._candidate_rt(a)
        cdef u64 by_gap = 0, by_extra = 0, bit
        cdef int c
        cdef i32 k
        cdef Py_ssize_t j
        cdef bint all_gap, ok, nodes
        while cands != 0:
            c = lowest_bit(cands)
            bit = (<u64>1) << c
            cands &= ~bit
            if not covers(demand, &self.s_cfree[c, 0], self.n_res):
                continue
            nodes = self.c_nodes[c]
            # The shadow times first: on a node cluster each runs placement trials, which
            # use the scratch placement a's own is kept in.
            for k in range(self.s_rv_n[c]):
                if self.s_rv_shadow[c, k] < 0:
                    self.s_rv_shadow[c, k] = self._shadow_into(
                        self.s_rv_head[c, k], c, &self.s_cfree[c, 0], now,
                        &self.s_rv_extra[c, k, 0], &self.s_rv_gap[c, k],
                        &self.s_rv_nfree[k, 0, 0] if nodes else NULL)
            if nodes:
                # a itself must be placed on the nodes now, where the gate would put it.
                if not self._node_fit(a, c):
                    continue
                for j in range(self.s_bf_pnode.shape[0]):
                    self.s_bf_pnode[j] = self.s_pnode[j]
            all_gap = True
            ok = True
            for k in range(self.s_rv_n[c]):
                if (self.s_rv_gap[c, k] and rt < NEVER
                        and rt <= self.s_rv_shadow[c, k] - now):
                    continue
                all_gap = False
                if not covers(demand, &self.s_rv_extra[c, k, 0], self.n_res):
                    ok = False
                    break
                # On nodes, rule (b) also needs the head's pods placeable at its shadow
                # time beside a's: a fit in the totals may still take the node it needs.
                if nodes and (self.s_rv_shadow[c, k] == NEVER or not self._fits_beside(
                        self.s_rv_head[c, k], c, &self.s_rv_nfree[k, 0, 0], a,
                        &self.s_bf_pnode[0])):
                    ok = False
                    break
            if not ok:
                continue
            if all_gap:
                by_gap |= bit
            else:
                by_extra |= bit
        if by_gap != 0:
            c = self._choose_cluster(a, by_gap)
        elif by_extra != 0:
            c = self._choose_cluster(a, by_extra)
        else:
            return -1
        # The gate's placement of a on the chosen node cluster, for _place (the trials
        # above overwrote it); the state is as when it was found, so it is found again.
        if self.c_nodes[c] and not self._node_fit(a, c):
            if DEBUG_BUILD:
                with gil:
                    raise AssertionError(f"backfill of row {a} on node cluster {c}: its "
                                         f"placement was not found again")
            return -1
        return c

    cdef void _take_reservations(self, i32 a, int c, i64 now) noexcept nogil:
        # a backfills cluster c (_backfill said yes): every reservation there that admits it
        # by rule (b) only gives up a's demand of its extra capacity, for good this tick.
        cdef const i64* demand = &self.a_demand[a, 0]
        cdef i64 rt = NEVER
        cdef i32 k
        cdef Py_ssize_t r
        if self.a_env[a] < 0:
            rt = self._candidate_rt(a)
        for k in range(self.s_rv_n[c]):
            if self.s_rv_gap[c, k] and rt < NEVER and rt <= self.s_rv_shadow[c, k] - now:
                continue
            for r in range(self.n_res):
                self.s_rv_extra[c, k, r] -= demand[r]
            if self.c_nodes[c]:
                # ... and on nodes, the nodes a's pods take (the gate's placement, s_pnode).
                self._pods_add(&self.s_rv_nfree[k, 0, 0], &self.s_pnode[0], a,
                               self.s_pnode.shape[0], -1)

    def relink_live(self, Py_ssize_t n_rows):
        """Rebuild the per-cluster lists of live charged leases from rows ``0..n_rows-1``
        (after a reload filled the arrays): every sent or running row whose current
        generation is charged and not yet released."""
        cdef Py_ssize_t c, a
        if n_rows < 0 or n_rows > self.a_state.shape[0]:
            raise ValueError(f"n_rows {n_rows} is outside the action table")
        with nogil:
            for c in range(self.n_clusters):
                self.c_live[c] = -1
            for a in range(n_rows):
                self.a_lnext[a] = -1
                self.a_lprev[a] = -1
                if ((self.a_state[a] == ST_SENT or self.a_state[a] == ST_RUNNING)
                        and self.a_charged[a] and self.a_gen[a] > 0
                        and self.a_released_gen[a] != self.a_gen[a]
                        and self.a_cluster[a] >= 0):
                    self._live_link(<i32>a, self.a_cluster[a])

    def relink_nodes(self, Py_ssize_t n_rows):
        """Rebuild the nodes' used vectors (admission = "nodes") from rows ``0..n_rows-1``
        after a reload: every live charged lease on a node cluster charges its recorded
        placement (a_pnode) again; a_pg_first / a_pg_n must be set first."""
        cdef Py_ssize_t a, n, r, k
        cdef i32 c, node
        if n_rows < 0 or n_rows > self.a_state.shape[0]:
            raise ValueError(f"n_rows {n_rows} is outside the action table")
        for a in range(n_rows):
            c = self.a_cluster[a]
            if not ((self.a_state[a] == ST_SENT or self.a_state[a] == ST_RUNNING)
                    and self.a_charged[a] and self.a_gen[a] > 0
                    and self.a_released_gen[a] != self.a_gen[a] and c >= 0
                    and self.c_nodes[c]):
                continue
            if self.a_pg_first[a] < 0:
                raise ValueError(f"action row {a} holds a node placement but has no pod groups")
            # A stored placement must name nodes of its cluster as configured now: one made
            # before the cluster's nodes (or its admission) changed cannot be charged.
            if self.a_pnode.shape[1] == 0 or self.a_pnode[a, 0] < 0:
                raise ValueError(f"action row {a} runs on cluster row {c} without a node "
                                 f"placement: the cluster's admission changed while it ran")
            for k in range(self.a_pnode.shape[1]):
                node = self.a_pnode[a, k]
                if node >= 0 and not (self.c_node_first[c] <= node
                                      < self.c_node_first[c] + self.c_node_n[c]):
                    raise ValueError(f"action row {a}'s placement names node row {node}, not "
                                     f"a node of cluster row {c}: its nodes changed while it ran")
        with nogil:
            for n in range(self.n_used.shape[0]):
                for r in range(self.n_res):
                    self.n_used[n, r] = 0
            for a in range(n_rows):
                c = self.a_cluster[a]
                if ((self.a_state[a] == ST_SENT or self.a_state[a] == ST_RUNNING)
                        and self.a_charged[a] and self.a_gen[a] > 0
                        and self.a_released_gen[a] != self.a_gen[a] and c >= 0
                        and self.c_nodes[c]):
                    self._node_charge(&self.a_pnode[a, 0], <i32>a, self.a_pnode.shape[1], 1)

    def head_eta(self, i32 h, i64 now):
        """The shadow time (ns) of queued action ``h`` from the current state: the earliest
        predicted time enough is free for it on one of its queue's clusters it fits, by the
        predicted ends of the live leases there; None when unknown (a lease it waits for has
        no runtime history). Uses the tick's scratch between ticks."""
        cdef i64 best = NEVER, t
        cdef int c
        cdef u64 fit
        check_index(h, self.a_state.shape[0], "h", "an action row")
        if self.a_state[h] != ST_QUEUED:
            raise ValueError(f"action row h={h} is not queued")
        fit = self.a_fit[h] & self.q_clusters[self.a_queue[h]]
        with nogil:
            while fit != 0:
                c = lowest_bit(fit)
                fit &= ~((<u64>1) << c)
                self._cluster_free(c)
                t = self._shadow(h, c, &self.s_free[0], now)
                if t < best:
                    best = t
        return None if best == NEVER else best

    def budget_eta(self, i32 h, i64 now):
        """The budget shadow time (ns) of queued action ``h``: the earliest predicted time its
        queue's budget left plus what the queue's live leases release covers it; None when
        unknown. Uses the tick's scratch between ticks."""
        cdef i64 t
        check_index(h, self.a_state.shape[0], "h", "an action row")
        if self.a_state[h] != ST_QUEUED:
            raise ValueError(f"action row h={h} is not queued")
        with nogil:
            self._queue_budget(self.a_queue[h])
            t = self._budget_shadow(self.a_queue[h], h, now)
        return None if t == NEVER else t

    def resolve_wait(self, i32 a):
        """``(code, cluster, dim, blocker)``: what queued ``a`` waits for, as the last tick
        would have stamped it had it examined ``a`` (its queue stopped with W_QUEUE_HELD
        before reaching it): the count caps (the queue's runs, the run's, its tenant's), the
        queue budget, a free worker, then whether
        a held cluster would have room (HEAD_OF_LINE, naming its holder) or none has
        (CLUSTER_CAPACITY, naming the cluster and the resource short). Read from the state
        the last tick left: its holds, free vectors and worker slots."""
        cdef i32 q, qr, u
        cdef u64 fit
        cdef int c = -1, dim = -1
        cdef u8 code
        cdef const i64* demand
        check_index(a, self.a_state.shape[0], "a", "an action row")
        if self.a_state[a] != ST_QUEUED:
            raise ValueError(f"action row a={a} is not queued")
        with nogil:
            q = self.a_queue[a]
            qr = self.a_qrun[a]
            u = self.a_run[a]
            demand = &self.a_demand[a, 0]
            if self.qr_adm[qr] == self.qr_rel[qr] and self._runs_left(q) <= 0:
                code = W_QUEUE_RUNS
            elif self.u_cap[u] > 0 and <i64>(self.u_adm[u] - self.u_rel[u]) >= self.u_cap[u]:
                code = W_RUN_ACTIONS
            elif self._tenant_capped(u) != W_NONE:
                code = self._tenant_capped(u)
            else:
                self._queue_budget(q)
                dim = first_short_dim(demand, &self.s_budget[0], self.n_res)
                fit = self.a_fit[a] & self.q_clusters[q] & self.s_avail
                if dim >= 0:
                    code = W_QUEUE_BUDGET
                elif fit == 0:
                    code = W_NO_WORKER
                else:
                    c = self._choose_cluster(a, fit & self.s_held)
                    if c >= 0:
                        code = W_HEAD_OF_LINE
                    else:
                        c = lowest_bit(fit)
                        dim = first_short_dim(demand, &self.s_cfree[c, 0], self.n_res)
                        code = W_CLUSTER_CAPACITY
        return code, c, dim, self.s_held_by[c] if code == W_HEAD_OF_LINE else -1

    cdef inline int _gate(self, i32 a, u64 fit, u64 held, u64 avail, int* dim) noexcept nogil:
        # The resource gate, in order: (1) the demand within the queue's remaining budget
        # (s_budget); (2) a cluster with a free worker, not held by a head, whose capacity
        # minus in-flight covers the total; (3) whose node shapes hold every pod (a_fit).
        # Returns the chosen cluster, GATE_BUDGET (dim set) or GATE_NO_CLUSTER.
        dim[0] = first_short_dim(&self.a_demand[a, 0], &self.s_budget[0], self.n_res)
        if dim[0] >= 0:
            return GATE_BUDGET
        cdef u64 open_ = fit & avail & ~held
        self.s_nofit = -1
        if open_ == 0:
            return GATE_NO_CLUSTER
        cdef int c = self._choose_cluster(a, open_)
        # (4) admission = "nodes": every pod placed on a node of it now (first fit
        # decreasing); else the next best cluster, and the wait names the fragmented one.
        while c >= 0 and self.c_nodes[c] and not self._node_fit(a, c):
            self.s_nofit = c
            open_ &= ~((<u64>1) << c)
            c = self._choose_cluster(a, open_)
        return c if c >= 0 else GATE_NO_CLUSTER

    cdef bint _node_fit(self, i32 a, int c) noexcept nogil:
        # First fit decreasing of a's pods on the nodes of cluster c, as engine/_nodes.py
        # places them: groups largest first (interned in that order), each pod on the first
        # node (in config order) with room for all of it; identical pods of a group fill a
        # node as far as it goes, so each node takes min(room, left) at once. On success the
        # nodes are in s_pnode (one per pod, group order) for _place; nothing is kept
        # charged either way. Cost: O(groups x nodes of c x R) per call, no allocation.
        cdef i32 g, g0 = self.a_pg_first[a], last, node, end
        cdef Py_ssize_t k = 0, held = 0, width = self.s_pnode.shape[0], r, j
        cdef i64 left, room, free, seen
        cdef const i64* vec
        cdef bint ok = True
        if DEBUG_BUILD and g0 < 0:
            with gil:
                raise AssertionError(f"action row {a} has no pod groups on node cluster {c}")
        if g0 < 0:
            return False
        last = g0 + self.a_pg_n[a] - 1
        for g in range(g0, last + 1):
            left = self.pg_count[g]
            vec = &self.pg_vec[g, 0]
            node = self.c_node_first[c]
            end = node + self.c_node_n[c]
            while left > 0 and node < end:
                # How many of the group's pods this node takes: all that are left unless a
                # resource is short (no division on the common single-pod path).
                room = left
                for r in range(self.n_res):
                    if vec[r] > 0:
                        free = self.n_alloc[node, r] - self.n_used[node, r]
                        if self.s_node_obs and self.n_obs[node, r] < UNLIMITED:
                            # No more than a worker last reported free, less what was
                            # placed on the node since.
                            seen = self.n_obs[node, r] - (self.n_adm[node, r]
                                                          - self.n_obs_mark[node, r])
                            if seen < free:
                                free = seen
                        if vec[r] > free:
                            room = 0
                            break
                        if room > 1 and vec[r] > free // room:
                            room = free // vec[r]
                if room > 0:
                    if k + room > width:
                        # More pods than the placement record holds (enqueue refuses
                        # those): never placed, never written past the record.
                        ok = False
                        break
                    if g < last:
                        # A later group must see these pods on the node: charged for the
                        # trial (the last group's pods need not be).
                        for r in range(self.n_res):
                            self.n_used[node, r] += room * vec[r]
                            self.n_adm[node, r] += room * vec[r]
                        held += room
                    for j in range(room):
                        self.s_pnode[k + j] = node
                    k += room
                    left -= room
                node += 1
            if left > 0:
                ok = False
                break
        # Trial only: give back what it charged (the pods of the groups before the last).
        if held:
            self._node_charge(&self.s_pnode[0], a, held, -1)
            self._pods_add(&self.n_adm[0, 0], &self.s_pnode[0], a, held, -1)
        if ok:
            self.s_pnode_row = a
            self.s_pnode_cluster = c
            for j in range(k, width):
                self.s_pnode[j] = -1
        return ok

    cdef void _node_charge(self, const i32* nodes, i32 a, Py_ssize_t n_pods,
                           i64 sign) noexcept nogil:
        # Add (sign 1) or take back (-1) the first n_pods pods of a, in pod-group order, on
        # their nodes' n_used; a node of -1 ends the record (fewer pods than its width).
        cdef Py_ssize_t k, r
        self._pods_add(&self.n_used[0, 0], nodes, a, n_pods, sign)
        if DEBUG_BUILD and sign < 0:
            for k in range(n_pods):
                if nodes[k] < 0:
                    break
                for r in range(self.n_res):
                    if self.n_used[nodes[k], r] < 0:
                        with gil:
                            raise AssertionError(f"node {nodes[k]} resource {r} went "
                                                 f"negative releasing row {a}")

    cdef void _pods_add(self, i64* target, const i32* nodes, i32 a, Py_ssize_t n_pods,
                        i64 sign) noexcept nogil:
        # sign x the first n_pods pods of a (pod-group order) on their nodes, into target
        # (a node-by-resource matrix, row node * R); a node of -1 ends the record.
        cdef i32 g, g0 = self.a_pg_first[a], node
        cdef Py_ssize_t k = 0, r
        cdef i64 _j
        if g0 < 0:
            return
        for g in range(g0, g0 + self.a_pg_n[a]):
            for _j in range(self.pg_count[g]):
                if k >= n_pods:
                    return
                node = nodes[k]
                if node < 0:
                    return
                for r in range(self.n_res):
                    target[node * self.n_res + r] += sign * self.pg_vec[g, r]
                k += 1

    def gate_bench(self, i32 q, i32[::1] rows not None, long iterations):
        """Time the gate on queued ``rows`` of queue ``q`` in a C loop, against the current
        state (budget left, free vectors, every cluster with a connected worker; nothing is
        placed). Returns (elapsed_ns, evaluations, passed)."""
        cdef Py_ssize_t i, n = rows.shape[0]
        cdef long _it
        cdef long passed = 0
        cdef int dim
        cdef u64 avail
        cdef i64 start, end
        check_index(q, self.n_queues, "q", "a queue row")
        for i in range(n):
            if rows[i] < 0 or rows[i] >= self.a_state.shape[0] or self.a_queue[rows[i]] != q:
                raise ValueError(f"row {rows[i]} is not an action of queue {q}")
        with nogil:
            self._queue_budget(q)
            avail = self._count_slots()
            self._snapshot_free()
            start = _now_ns()
            for _it in range(iterations):
                for i in range(n):
                    passed += self._gate(rows[i], self.a_fit[rows[i]] & self.q_clusters[q], 0,
                                         avail, &dim) >= 0
            end = _now_ns()
        return end - start, iterations * n, passed

    cdef int _choose_cluster(self, i32 a, u64 candidates) noexcept nogil:
        # Among clusters that cover the demand: most free accelerators of the kinds it asks
        # for, then most free cpu. With the gate off: most free worker slots.
        cdef int best = -1, c
        cdef i64 best_acc = -1, best_cpu = -1, acc, cpu
        cdef Py_ssize_t r
        cdef u64 bit
        cdef const i64* demand = &self.a_demand[a, 0]
        cdef const i64* free
        if candidates == 0:
            return -1
        if self.gate_on and (candidates & (candidates - 1)) == 0:
            # One cluster to weigh (most calls): nothing to rank it against.
            c = lowest_bit(candidates)
            return c if covers(demand, &self.s_cfree[c, 0], self.n_res) else -1
        while candidates != 0:
            c = lowest_bit(candidates)
            bit = (<u64>1) << c
            candidates &= ~bit
            if not self.gate_on:
                if self.s_slots[c] > best_cpu:
                    best_cpu = self.s_slots[c]
                    best = c
                continue
            free = &self.s_cfree[c, 0]
            if not covers(demand, free, self.n_res):
                continue
            acc = 0
            for r in range(self.n_res):
                if self.res_accel[r] and demand[r] > 0:
                    acc += free[r]
            cpu = free[self.cpu_dim] if self.cpu_dim >= 0 else 0
            if acc > best_acc or (acc == best_acc and cpu > best_cpu):
                best_acc = acc
                best_cpu = cpu
                best = c
        return best

    cdef i32 _pick_worker(self, int c) noexcept nogil:
        # Round robin over the cluster's connected workers with a free slot.
        cdef Py_ssize_t n = self.n_workers, _k
        cdef i32 w = self.s_cursor[c]
        for _k in range(n):
            w += 1
            if w >= n:
                w = 0
            if (self.w_cluster[w] == c and self.w_connected[w] and not self.w_paused[w]
                    and self.w_slots[w] > <i64>(self.w_adm[w] - self.w_rel[w])):
                self.s_cursor[c] = w
                return w
        return -1

    cdef void _place(self, i32 a, int c, int mode, i64 now, u64* avail,
                     i64* actions_left, i64* runs_left) noexcept nogil:
        cdef i32 q = self.a_queue[a]
        cdef i32 qr = self.a_qrun[a]
        cdef i32 e = self.a_env[a]
        cdef i32 w = self._pick_worker(c)
        cdef i32 u, t
        cdef Py_ssize_t r
        cdef i64 d
        self.a_gen[a] += 1
        self.a_charged[a] = mode == M_REGULAR
        if mode != M_FAST:
            for r in range(self.n_res):
                d = self.a_demand[a, r]
                self.q_res_adm[q, r] += <u64>d
                self.c_adm[c, r] += <u64>d
                self.s_cfree[c, r] -= d
                if self.s_budget[r] < UNLIMITED:
                    self.s_budget[r] -= d
        if self.c_nodes[c] and mode == M_REGULAR:
            # The placement the gate found for a on c (nothing ran in between): its pods
            # are charged to their nodes and recorded with the lease (the node hint).
            if DEBUG_BUILD and (self.s_pnode_row != a or self.s_pnode_cluster != c):
                with gil:
                    raise AssertionError(f"action row {a} placed on node cluster {c} "
                                         f"without a node placement from the gate")
            for r in range(self.a_pnode.shape[1]):
                self.a_pnode[a, r] = self.s_pnode[r]
            self._node_charge(&self.a_pnode[a, 0], a, self.a_pnode.shape[1], 1)
            self._pods_add(&self.n_adm[0, 0], &self.a_pnode[a, 0], a, self.a_pnode.shape[1], 1)
            self.s_pnode_row = -1
        if mode == M_POOL_START:
            self.e_cluster[e] = c
            self.e_gen[e] += 1
            self.n_pools_live += 1
        if self.qr_adm[qr] == self.qr_rel[qr]:
            self.q_runs_adm[q] += 1
            runs_left[0] -= 1
        self.qr_adm[qr] += 1
        self.q_adm[q] += 1
        u = self.a_run[a]
        t = self.u_tenant[u]
        if self.u_adm[u] == self.u_rel[u]:
            self.tn_runs_adm[t] += 1
        self.u_adm[u] += 1
        self.tn_adm[t] += 1
        self.w_adm[w] += 1
        if e >= 0:
            self.e_adm[e] += 1
            self.e_last_active[e] = now
        actions_left[0] -= 1
        self.s_slots[c] -= 1
        if self.s_slots[c] <= 0:
            avail[0] &= ~((<u64>1) << c)
        self.a_state[a] = ST_SENT
        self.a_cluster[a] = c
        self.a_worker[a] = w
        # Backfill reads what charged leases will release, and when: a per-cluster list of
        # them, and the end the predictor gives (NEVER when it knows nothing, _pred_rt).
        self.a_backfilled[a] = 0
        if mode == M_REGULAR:
            self._live_link(a, c)
        d = self._pred_rt(a)
        if d < NEVER - now:
            self.a_pred_end[a] = now + d
        else:
            self.a_pred_end[a] = NEVER
        self.a_expiry[a] = now + self.lease_ttl
        self.a_end[a] = END_LIVE
        self.a_held_code[a] = self._held_code(a)
        self._wait(a, W_PLACED, c, -1, -1)
        self._push_dispatch(KIND_RUN, a, self.a_gen[a], c, w)

    cdef u8 _held_code(self, i32 a) noexcept nogil:
        # The WaitCode Engine.explain gave queued ``a`` just before this tick (the queue-wait
        # histogram's reason, docs/status.md): its own wait of the previous tick, else its
        # lane's skip then, else where its queue's scan stopped then; W_NONE when it joined
        # its lane after the previous tick (no tick held it). Read before _wait(PLACED).
        cdef i64 prev = self.tick_no - 1
        cdef i32 lane
        if self.a_queued_tick[a] >= prev:
            return W_NONE
        if self.a_wait_tick[a] == prev:
            return self.a_wait_code[a]
        lane = self.a_lane[a]
        if self.ln_skip_tick[lane] == prev:
            return self.ln_skip_code[lane]
        if self.q_prev_stop[self.a_queue[a]] == W_QUEUE_HELD:
            return self._held_resolved(a)
        return self.q_prev_stop[self.a_queue[a]]

    cdef u8 _held_resolved(self, i32 a) noexcept nogil:
        # resolve_wait as it answered between the previous tick and this one, for an action
        # that tick did not examine and this one places: neither a count cap nor the budget
        # held it then (it would not be placed now), so what remains is a free worker, then
        # a held cluster with room (HEAD_OF_LINE) or none (CLUSTER_CAPACITY).
        cdef u64 fit = self.a_fit[a] & self.q_clusters[self.a_queue[a]] & self.s_prev_avail
        cdef u64 held = fit & self.s_prev_held
        cdef int c
        if fit == 0:
            return W_NO_WORKER
        while held != 0:
            c = lowest_bit(held)
            held &= ~((<u64>1) << c)
            if covers(&self.a_demand[a, 0], &self.s_prev_cfree[c, 0], self.n_res):
                return W_HEAD_OF_LINE
        return W_CLUSTER_CAPACITY

    cdef void _push_dispatch(self, u8 kind, i32 row, i64 gen, int c, i32 w) noexcept nogil:
        cdef i64 slot = self.d_tail % self.d_action.shape[0]
        self.d_kind[slot] = kind
        self.d_action[slot] = row
        self.d_gen[slot] = gen
        self.d_cluster[slot] = c
        self.d_worker[slot] = w
        self.d_tail += 1

    cdef void _fail(self, i32 a, u8 code) noexcept nogil:
        # f_action has one row per action row, so it cannot overflow within a tick.
        self.a_state[a] = ST_DONE
        self.f_action[self.f_count] = a
        self.f_code[self.f_count] = code
        self.f_count += 1

    # ---------------------------------------------------------------- outputs

    def push_dispatch(self, u8 kind, i32 row, i64 gen, int c, i32 w):
        """Append one entry to the dispatch ring (reload: a decided lease never handed out)."""
        if kind == KIND_RUN:
            check_index(row, self.a_state.shape[0], "row", "an action row")
        elif kind == KIND_FINALIZE:
            check_index(row, self.fz_state.shape[0], "row", "a finalize row")
        else:
            raise ValueError(f"kind={kind} is not a LeaseKind")
        check_index(c, self.n_clusters, "c", "a cluster row")
        check_index(w, self.n_workers, "w", "a worker row in use")
        if self.d_tail - self.d_head >= self.d_action.shape[0]:
            raise OverflowError("dispatch channel full")
        self._push_dispatch(kind, row, gen, c, w)

    def set_pools_live(self, i64 n):
        """Set the number of warm pools holding a footprint (reload recounts them)."""
        if not 0 <= n <= self.n_envs:
            raise ValueError(f"n={n} is not in [0, {self.n_envs}] (environment rows in use)")
        self.n_pools_live = n

    def consume_dispatch(self, i64 n):
        """Mark ``n`` dispatch entries consumed (after the caller copied them)."""
        if n < 0 or n > self.d_tail - self.d_head:
            raise ValueError("cannot consume more than the ring holds")
        self.d_head += n
