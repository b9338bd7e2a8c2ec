# The ETA projection: when each queued action is predicted to start, planned like Slurm's
# backfill planner over a timeline of free capacity per cluster (docs/architecture.md, "ETA
# projection"). Computed on demand, never in the tick. Every array is allocated (and grown)
# in Python by engine/_projection.py; the projection itself runs without the GIL.
cimport cython

from cext._tick cimport TickKernel
from cext._types cimport i32, i64, u8, u64


@cython.final
cdef class EtaProjector:
    cdef Py_ssize_t n_res              # R
    cdef readonly Py_ssize_t n_seg     # timeline nodes in use (last run)
    cdef readonly i64 n_steps          # segments the searches of the last run stepped over
    cdef Py_ssize_t n_clusters         # C (as bound)
    # --- timeline: per cluster a list of segments sorted by start time; a segment's free
    # vector holds from its start to the next segment's (the last one's: for ever) ---
    cdef i64[::1] sg_t                 # [M] segment start (ns)
    cdef i32[::1] sg_next              # [M] next segment of the cluster, -1 last
    cdef i64[:, ::1] sg_free           # [M, R] free from sg_t on
    cdef i32[::1] c_first              # [C] first segment of each cluster (starts at now)
    cdef i64[::1] c_hold               # [C] held until (STRICT heads of earlier queues)
    cdef i64[::1] c_hold_q             # [C] ... by the queue being walked (merged after it)
    cdef i32[::1] c_hint               # [C] segment the last search on the cluster began in
    # Demand classes (equal demand vectors), assigned as the walk meets them (_class_of):
    cdef i64[::1] cls_vec              # [K, R] each class's demand vector
    cdef i32[::1] cls_hash             # [H] open-addressed table of classes by demand, -1 free
    cdef Py_ssize_t n_cls              # classes assigned in this run (at most K)
    cdef Py_ssize_t cls_max            # K
    cdef i32[::1] cls_ptr              # [K, C] per class: segments before it are short of it
    cdef i32[::1] lb_seg               # [K, C, 64] per class and runtime bucket: lower bound
    cdef i64[::1] lb_t                 # ... of the start from now (segment, time); -1 none
    # --- scratch ---
    cdef i64[::1] s_key                # [L] live leases' predicted ends, being sorted
    cdef i32[::1] s_row                # [L] ... and their rows
    cdef i32[::1] s_lanes              # [2 * lanes] a queue's lanes per kind, ring order
    cdef i32[::1] s_cur                # [lanes] next action of each lane in the walk
    cdef Py_ssize_t k_n[2]             # lanes still active per kind
    cdef Py_ssize_t k_pos[2]           # position in the current round
    cdef Py_ssize_t k_w[2]             # lanes kept for the next round
    # --- outputs ---
    cdef readonly i64[::1] eta         # [N] projected start (ns) per action row; NEVER none
    cdef readonly u8[::1] why          # [N] EtaWhy code
    cdef readonly i32[::1] order       # [N] queued rows in the order they were projected
    cdef readonly Py_ssize_t n_order   # entries of order
    cdef u8[::1] q_rest                # [Q] EtaWhy of each queue's queued rows not reached
    cdef Py_ssize_t horizon            # actions projected at most (the rest: ETA_HORIZON)
    cdef Py_ssize_t n_projected        # ... so far in this run

    cdef void _seed(self, TickKernel k, int c, i64 now, u64 wmask) noexcept nogil
    cdef i64 _earliest(self, TickKernel k, int c, const i64* need, i64 t_min, i64 rt,
                       i32 cls, bint from_now, i32* seg) noexcept nogil
    cdef void _reserve(self, TickKernel k, int c, i32 seg, const i64* need, i64 start,
                       i64 rt) noexcept nogil
    cdef i32 _split(self, TickKernel k, i32 seg, i64 t) noexcept nogil
    cdef i32 _take(self, TickKernel k, int kind, Py_ssize_t nl) noexcept nogil
    cdef i32 _class_of(self, TickKernel k, i32 a) noexcept nogil
    cdef void _project_one(self, TickKernel k, i32 a, i64 now, i64 t_min, u64 wmask,
                           bint strict) noexcept nogil
    cdef void _run(self, TickKernel k, i64 now) noexcept nogil
    cdef u8 _why_of(self, TickKernel k, i32 a) noexcept
