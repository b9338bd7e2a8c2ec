# The tick: one scheduling pass of a shard over structure-of-arrays state.
# Every array is a numpy buffer allocated (and grown) by engine/_state.py and bound here
# with bind(); the kernel never allocates. Counters named *_adm / *_rel are monotonic
# (admitted / released); in flight is always their difference, never a separate count.
cimport cython

from cext._types cimport i32, i64, u8, u64


@cython.final
cdef class TickKernel:
    # --- dimensions and settings ---
    cdef Py_ssize_t n_res              # R: configured resources
    cdef Py_ssize_t n_clusters         # C: clusters (<= 64, a bitmask)
    cdef Py_ssize_t n_queues           # Q: queues
    cdef Py_ssize_t n_workers          # workers rows in use
    cdef Py_ssize_t n_envs             # environment (warm pool) rows in use
    cdef i64 n_pools_live              # pools currently holding a footprint (reap skips at 0)
    cdef readonly i64 tick_no          # ticks run so far (wait reasons are stamped with it)
    cdef readonly i64 last_run_ns      # wall time of the last run() (monotonic clock)
    cdef i64 max_candidates            # candidates examined per queue per tick
    cdef bint gate_on                  # resource gate: enforce (1) or count caps only (0)
    cdef int cpu_dim                   # index of cpu in vectors, -1 if not configured
    cdef readonly i64 lease_ttl        # ns a lease lives without a heartbeat
    cdef u64 bf_held                   # clusters with a reservation this tick (s_rv_*)
    cdef u64 bf_contested              # held clusters closed to backfill for the rest of it
    cdef u64 s_held                    # clusters held by blocked heads when the tick ended
    cdef u64 s_avail                   # clusters with a free worker slot when it ended
    cdef u64 s_prev_held               # s_held and s_avail of the tick before this one
    cdef u64 s_prev_avail
    # Examine every queued action each tick, as before queues held behind their blocked
    # head were cut short (for tests and benches: decisions are the same either way).
    cdef public bint examine_all

    cdef u8[::1] res_accel             # [R] 1 where the resource is an accelerator

    # --- actions (one row per action; its run lease lives in the same row) ---
    cdef u8[:] a_state                 # ActionState
    cdef i32[:] a_queue                # queue row
    cdef i32[:] a_run                  # run row
    cdef i32[:] a_qrun                 # (queue, run) row; lane = 2 * qrun + fast
    cdef i32[:] a_lane                 # lane row it waits in
    cdef i32[:] a_env                  # environment row, -1 when not reusable
    cdef i32[:] a_next                 # next action in its lane, -1 at the tail
    cdef i32[:] a_prev                 # previous action in its lane, -1 at the head
    cdef u64[:] a_fit                  # clusters that could ever hold it (shapes, capacity)
    cdef i64[:, ::1] a_demand          # [N, R] total demand (a pool's footprint if reusable)
    cdef i64[:] a_gen                  # lease generation, +1 per assignment
    cdef i64[:] a_released_gen         # generation whose in-flight counts were released
    cdef u8[:] a_charged               # 1 when its demand was charged to queue and cluster
    cdef i32[:] a_cluster              # cluster of the current assignment, -1 none
    cdef i32[:] a_worker               # worker of the current assignment, -1 none
    cdef u8[:] a_wait_code             # WaitCode from the last tick that examined it
    cdef i64[:] a_wait_tick            # tick_no of that examination
    cdef i32[:] a_wait_cluster         # cluster the wait is about, -1 none
    cdef i32[:] a_wait_dim             # resource the wait is about, -1 none
    cdef i32[:] a_wait_blocker         # action row blocking it (head of line), -1 none
    cdef i64[:] a_queued_tick          # tick_no when it joined its lane (this attempt)
    cdef u8[:] a_held_code             # WaitCode that held it before the tick placing it
    cdef i64[::1] a_expiry             # run lease expiry (ns) while sent or running
    cdef u8[:] a_end                   # LeaseEnd of the current generation
    cdef i32[:] a_task                 # history key row (task name, shape)
    cdef i64[::1] a_est_rt             # its spec's runtime estimate (ns), NEVER = none
    cdef i64[::1] a_max_rt             # its spec's max_runtime (ns), NEVER = none
    cdef i64[::1] a_runtime_due        # engine backstop of max_runtime while running, NEVER
    cdef i64[:] a_pred_end             # predicted end (ns) of the live lease, NEVER = unknown
    cdef u8[:] a_backfilled            # 1 when the current generation was placed by backfill
    cdef i32[:] a_lnext                # next live charged lease on its cluster, -1 at the end
    cdef i32[:] a_lprev                # previous one, -1 at the start

    # --- (queue, run) pairs and their two lanes (regular, fast) ---
    cdef i32[::1] qr_queue             # queue row of the pair
    cdef i32[::1] qr_run               # run row of the pair
    cdef u64[::1] qr_adm               # actions of this run admitted in this queue
    cdef u64[::1] qr_rel               # ... and released
    cdef i32[::1] ln_head              # oldest pending action of the lane, -1 empty
    cdef i32[::1] ln_tail              # newest pending action, -1 empty
    cdef i32[::1] ln_next              # next lane in the queue's round-robin ring
    cdef i32[::1] ln_prev              # previous lane in that ring
    cdef u8[::1] ln_in_ring            # 1 while linked in the ring
    cdef i32[::1] ln_scan              # next action to examine in this tick
    cdef i64[::1] ln_scan_tick         # tick_no ln_scan belongs to (lazy reset)
    cdef i32[::1] ln_park              # next lane in the tick-local parked list
    cdef u8[::1] ln_skip_code          # why the lane was skipped (run caps), for its actions
    cdef i64[::1] ln_skip_tick         # tick_no of that skip

    # --- queues ---
    cdef i32[::1] q_order              # queue rows by priority, highest first
    cdef i64[::1] q_priority           # priority (queues of one level are retried together)
    cdef u8[::1] q_strict              # 1 = STRICT_FIFO, 0 = GREEDY_CAPACITY
    cdef i64[::1] q_action_cap         # action_concurrency, 0 = unlimited
    cdef i64[::1] q_run_cap            # run_concurrency, 0 = unlimited
    cdef i64[:, ::1] q_max             # [Q, R] max_resources, UNLIMITED where none
    cdef u64[::1] q_clusters           # clusters the queue may use (bitmask)
    cdef u64[::1] q_adm                # actions admitted
    cdef u64[::1] q_rel                # actions released
    cdef u64[::1] q_runs_adm           # runs that went from 0 to >0 in flight
    cdef u64[::1] q_runs_rel           # runs that went back to 0
    cdef u64[:, ::1] q_res_adm         # [Q, R] resources charged
    cdef u64[:, ::1] q_res_rel         # [Q, R] resources released
    cdef i64[::1] q_pending            # queued actions (depth)
    cdef i64[::1] q_env_pending        # ... of them with a reusable environment (fast lane)
    cdef i64[::1] q_doomed             # ... of them the gate would fail (never fit the queue)
    cdef i32[:, ::1] q_ring            # [Q, 2] ring cursor lane per lane kind, -1 empty
    cdef u8[::1] q_stop_code           # why the last tick stopped scanning the queue
    cdef u8[::1] q_prev_stop           # q_stop_code as the tick before this one left it
    cdef i32[::1] q_stop_blocker       # action behind that stop, -1 none
    cdef i32[::1] q_head               # head blocked on resources in the last tick, -1 none
    cdef u8[::1] q_head_code           # its WaitCode
    cdef i64[::1] q_head_since         # when that head was first seen blocked (ns)
    cdef u8[::1] q_backfill            # 1 = EASY backfill behind a blocked head (STRICT only)
    cdef u8[::1] q_paused              # 1 = paused: the queue places nothing (live drain/pause)
    cdef u64[::1] q_backfilled         # placements made by backfill (cumulative)

    # --- clusters ---
    cdef i64[:, ::1] c_cap             # [C, R] capacity, UNLIMITED when unknown
    cdef u64[:, ::1] c_adm             # [C, R] resources charged
    cdef u64[:, ::1] c_rel             # [C, R] resources released
    cdef i64[:, ::1] c_obs             # [C, R] free capacity last reported by a worker
    cdef u64[:, ::1] c_obs_mark        # [C, R] c_adm when it was reported
    cdef i32[::1] c_live               # [C] first live charged lease (list via a_lnext)

    # --- nodes (clusters with admission = "nodes"; docs/nodes.md) ---
    cdef u8[::1] c_nodes               # [C] 1: the gate places every pod on a node
    cdef i32[::1] c_node_first         # [C] its first node row
    cdef i32[::1] c_node_n             # [C] ... and how many
    cdef i64[:, ::1] n_alloc           # [Nn, R] allocatable vector of each node
    cdef i64[:, ::1] n_used            # [Nn, R] taken by the placed pods of live leases
    cdef i64[:, ::1] n_obs             # [Nn, R] a worker's last free report (UNLIMITED none)
    cdef i64[:, ::1] n_obs_mark        # [Nn, R] n_adm at that report
    cdef i64[:, ::1] n_adm             # [Nn, R] pods charged ever (cumulative)
    cdef bint s_node_obs               # node fits bound by reports (off while projecting)
    cdef i64[:, ::1] pg_vec            # [G, R] per-pod vector of each interned pod group
    cdef i64[::1] pg_count             # [G] its replicas
    cdef i32[::1] a_pg_first           # first pod group row of the action (largest first)
    cdef i32[::1] a_pg_n               # ... and how many
    cdef i32[:, ::1] a_pnode           # [N, P] node of each pod of the live lease
    cdef i32[::1] s_pnode              # [P] scratch: the gate's last successful placement
    cdef i32 s_pnode_row               # ... of this action row (-1 none)
    cdef i32 s_pnode_cluster           # ... on this cluster
    cdef i32 s_nofit                   # cluster the gate's last call found fragmented, -1

    # --- workers ---
    cdef i32[::1] w_cluster            # cluster row
    cdef i64[::1] w_slots              # slots it offers
    cdef u64[::1] w_adm                # leases assigned to it
    cdef u64[::1] w_rel                # leases released from it
    cdef u8[::1] w_connected           # 1 while registered
    cdef i32[::1] w_ident              # the worker's stable identity (rows are sessions)
    cdef u8[::1] w_paused              # non-zero: draining or suspect, place nothing new

    # --- history keys (task name, shape) ---
    cdef i64[::1] t_pred_rt            # predicted runtime (ns): history, else shape prior
    cdef u8[::1] t_prior               # 1: t_pred_rt is the shape's prior

    # --- runs ---
    cdef i64[::1] u_cap                # max_action_concurrency, 0 = unlimited
    cdef u64[::1] u_adm                # actions admitted
    cdef u64[::1] u_rel                # actions released
    cdef i32[::1] u_tenant             # tenant row

    # --- tenants (first segment of the action id; caps over every queue) ---
    cdef i64[::1] tn_action_cap        # action_concurrency, 0 = unlimited
    cdef i64[::1] tn_run_cap           # run_concurrency, 0 = unlimited
    cdef u64[::1] tn_adm               # actions admitted
    cdef u64[::1] tn_rel               # actions released
    cdef u64[::1] tn_runs_adm          # runs that went from 0 to >0 in flight
    cdef u64[::1] tn_runs_rel          # runs that went back to 0

    # --- environments (warm pools) ---
    cdef i32[::1] e_queue              # queue the pool is charged to
    cdef i32[::1] e_cluster            # cluster it runs on, -1 when not running
    cdef i64[::1] e_slots              # replicas x concurrency
    cdef i64[::1] e_idle_ttl           # idle time (ns) before its footprint is released
    cdef i64[::1] e_last_active        # last admission or release (ns)
    cdef u64[::1] e_adm                # actions admitted into it
    cdef u64[::1] e_rel                # actions released from it
    cdef i64[:, ::1] e_footprint       # [E, R] replicas x per-pod vector, charged once
    cdef i64[::1] e_gen                # +1 each time the pool starts
    cdef i64[::1] e_released_gen       # pool generation whose footprint was released

    # --- finalize leases (cleanup of an attempt, sticky to its cluster and worker) ---
    cdef u8[::1] fz_state              # ActionState (QUEUED, SENT, DONE)
    cdef i32[::1] fz_action            # action row whose attempt it cleans up
    cdef i32[::1] fz_cluster           # cluster that ran the attempt
    cdef i32[::1] fz_pref              # worker that ran it (preferred while connected)
    cdef i32[::1] fz_worker            # worker of the current assignment, -1 none
    cdef i64[::1] fz_gen               # generation, +1 per assignment
    cdef i64[::1] fz_released_gen      # generation whose worker slot was released
    cdef i64[::1] fz_expiry            # expiry (ns) while sent
    cdef u8[::1] fz_end                # LeaseEnd of the current generation
    cdef i32[::1] fz_next              # next pending finalize lease, -1 at the tail
    cdef i32 fz_head                   # oldest pending finalize lease, -1 none
    cdef i32 fz_tail                   # newest pending finalize lease, -1 none

    # --- outputs ---
    cdef i32[::1] d_action             # dispatch ring: action row
    cdef i64[::1] d_gen                # ... lease generation
    cdef i32[::1] d_cluster            # ... cluster
    cdef i32[::1] d_worker             # ... worker
    cdef u8[::1] d_kind                # ... LeaseKind
    cdef readonly i64 d_head           # next entry to consume (monotonic)
    cdef readonly i64 d_tail           # next entry to fill (monotonic)
    cdef i32[::1] f_action             # actions failed UNSCHEDULABLE this tick
    cdef u8[::1] f_code                # ... and why
    cdef readonly i64 f_count          # entries in f_action

    # --- tick scratch (allocated once) ---
    cdef i64[::1] s_budget             # [R] queue budget left
    cdef i64[::1] s_free               # [R] cluster free vector (explain, cluster_free)
    cdef i64[:, ::1] s_cfree           # [C, R] each cluster's free vector, this tick
    cdef i64[:, ::1] s_prev_cfree      # [C, R] ... as the tick before this one left them
    cdef i64[::1] s_slots              # [C] free worker slots
    cdef i32[::1] s_held_by            # [C] action holding the cluster (STRICT_FIFO head)
    cdef i32[::1] s_cursor             # [C] last worker picked (round robin)
    cdef i32[::1] s_first              # [Q] STRICT head retried before its level, -1 none
    cdef u8[::1] s_first_res           # [Q] the outcome of that retry
    cdef i32[::1] s_bf_head            # [Q] backfill: the head blocked this tick, -1 none
    cdef i32[::1] s_bq_head            # [Q] budget backfill: the head blocked on the budget
    cdef i64[::1] s_bq_shadow          # [Q] its budget shadow time (ns); -1 not computed yet
    cdef u8[::1] s_bq_gap              # [Q] 1 = rule (a) open (known, no backfilled overrun)
    cdef i64[::1] s_bq_free            # [R] scratch: budget left while releases accumulate
    cdef i64[::1] s_shadow             # [C] backfill: the holding head's shadow time (ns)
    cdef i64[:, ::1] s_extra           # [C, R] backfill: free at the shadow time beyond its need
    cdef u8[::1] s_bf_gap              # [C] backfill: 1 = rule (a) open (known, no overrun)
    cdef i32[::1] s_rv_n               # [C] reservations on the cluster this tick
    cdef i32[:, ::1] s_rv_head         # [C, Q] the head of each, in the order of the pass
    cdef i64[:, ::1] s_rv_shadow       # [C, Q] its shadow time (ns); -1 not computed yet
    cdef u8[:, ::1] s_rv_gap           # [C, Q] 1 = rule (a) open (known, no overrun)
    cdef i64[:, :, ::1] s_rv_extra     # [C, Q, R] free at its shadow time beyond its need
    # Node clusters: reservation k of cluster c keeps, for the nodes of c, what each node is
    # predicted to have free at its shadow time (before the head's pods), in s_rv_nfree[k].
    cdef i64[:, :, ::1] s_rv_nfree     # [Q, Nn, R]
    cdef i64[:, ::1] s_nsave           # [Nn, R] scratch: n_used saved around a projection
    cdef i32[::1] s_bf_pnode           # [P] scratch: a backfill candidate's placement
    cdef i64[::1] s_bf_key             # [N] scratch: predicted ends being sorted
    cdef i32[::1] s_bf_row             # [N] scratch: ... and their rows

    cdef int _check_counts(self, Py_ssize_t n_workers, Py_ssize_t n_envs) except -1
    cdef void _cluster_free(self, int c) noexcept nogil
    cdef void _snapshot_free(self) noexcept nogil
    cdef void _queue_budget(self, i32 q) noexcept nogil
    cdef i64 _actions_left(self, i32 q) noexcept nogil
    cdef i64 _runs_left(self, i32 q) noexcept nogil
    cdef u8 _tenant_capped(self, i32 u) noexcept nogil
    cdef int _place_finalize(self, i64 now, u64* avail) noexcept nogil
    cdef void _push_dispatch(self, u8 kind, i32 row, i64 gen, int c, i32 w) noexcept nogil
    cdef void _ring_insert(self, i32 lane) noexcept nogil
    cdef void _ring_remove(self, i32 lane) noexcept nogil
    cdef void _link(self, i32 a) noexcept nogil
    cdef void _unlink(self, i32 a) noexcept nogil
    cdef void _count_pending(self, i32 a, i64 k) noexcept nogil
    cdef bint _doomed(self, i32 q, i32 a) noexcept nogil
    cdef bint _queue_held(self, i32 q, u64 held, u64 avail) noexcept nogil
    cdef u8 _held_resolved(self, i32 a) noexcept nogil
    cdef bint _release(self, i32 a, i64 now) noexcept nogil
    cdef void _push_finalize(self, i32 f) noexcept nogil
    cdef void _reap_pools(self, i64 now) noexcept nogil
    cdef u64 _count_slots(self) noexcept nogil
    cdef int _retry_heads(self, Py_ssize_t lo, Py_ssize_t hi, i64 now, u64* held,
                          u64* avail) noexcept nogil
    cdef int _tick_queue(self, i32 q, i64 now, u64* held, u64* avail) noexcept nogil
    cdef void _end_queue(self, i32 q, i64 now, u8 stop, i32 stop_blocker, i32 head,
                         u8 head_code) noexcept nogil
    cdef int _try_place(self, i32 q, i32 a, i64 now, u64* held, u64* avail,
                        i64* actions_left, i64* runs_left) noexcept nogil
    cdef int _gate(self, i32 a, u64 fit, u64 held, u64 avail, int* dim) noexcept nogil
    cdef int _choose_cluster(self, i32 a, u64 candidates) noexcept nogil
    cdef i32 _pick_worker(self, int c) noexcept nogil
    cdef void _place(self, i32 a, int c, int mode, i64 now, u64* avail,
                     i64* actions_left, i64* runs_left) noexcept nogil
    cdef void _wait(self, i32 a, u8 code, i32 cluster, i32 dim, i32 blocker) noexcept nogil
    cdef u8 _held_code(self, i32 a) noexcept nogil
    cdef void _fail(self, i32 a, u8 code) noexcept nogil
    cdef void _live_link(self, i32 a, int c) noexcept nogil
    cdef void _live_unlink(self, i32 a) noexcept nogil
    cdef void _sift_down(self, Py_ssize_t root, Py_ssize_t n) noexcept nogil
    cdef Py_ssize_t _pop_end(self, Py_ssize_t n) noexcept nogil
    cdef i64 _pred_rt(self, i32 a) noexcept nogil
    cdef i64 _candidate_rt(self, i32 a) noexcept nogil
    cdef i64 _live_end(self, i32 a, i64 now) noexcept nogil
    cdef Py_ssize_t _push_end(self, i32 a, Py_ssize_t n, i64 now, bint* overrun) noexcept nogil
    cdef i64 _first_cover(self, const i64* need, i64* free, Py_ssize_t n, i64 now, i32 h,
                          int c, i64* nfree) noexcept nogil
    cdef i64 _shadow(self, i32 h, int c, const i64* free_now, i64 now) noexcept nogil
    cdef i64 _shadow_into(self, i32 h, int c, const i64* free_now, i64 now, i64* extra,
                          u8* gap, i64* nfree) noexcept nogil
    cdef bint _fits_beside(self, i32 h, int c, const i64* nfree, i32 a,
                           const i32* nodes) noexcept nogil
    cdef void _reserve(self, i32 q, i32 h, u64 mine) noexcept nogil
    cdef void _take_reservations(self, i32 a, int c, i64 now) noexcept nogil
    cdef bint _budget_gap(self, i32 q, i32 h, i32 a, i64 now) noexcept nogil
    cdef i64 _budget_shadow(self, i32 q, i32 h, i64 now) noexcept nogil
    cdef int _backfill(self, i32 a, u64 cands, i64 now) noexcept nogil
    cdef bint _node_fit(self, i32 a, int c) noexcept nogil
    cdef void _node_charge(self, const i32* nodes, i32 a, Py_ssize_t n_pods,
                           i64 sign) noexcept nogil
    cdef void _pods_add(self, i64* target, const i32* nodes, i32 a, Py_ssize_t n_pods,
                        i64 sign) noexcept nogil
    cdef void _prefetch_candidates(self) noexcept nogil
    cdef i64 _run(self, i64 now) noexcept nogil
