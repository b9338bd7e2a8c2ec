# Record codecs: the fixed-size durable record of an action row, packed straight from the
# shard's column arrays (engine/_records.py has the same layout as a numpy dtype, which
# reload uses to read them back in bulk; tests/test_records.py keeps the two in step).
from cext._types cimport i32, i64, u8, u64


cdef packed struct ActionHead:
    i64 row                 # the row itself (its key): reload reads values only
    u8 state                # RowState
    u8 end                  # LeaseEnd of the current generation
    u8 charged              # demand charged to queue and cluster
    u8 part                 # partition (the tenant's)
    i32 queue               # queue index in the layout
    i32 run                 # run row
    i32 env                 # environment row, -1
    i32 cluster             # cluster of the current lease, -1
    i32 holder              # worker identity holding the current lease, -1
    i32 parent              # parent action row, -1
    i32 attempt             # current attempt number
    i32 fast                # 1 when queued on its warm pool's fast lane
    i32 task                # history key row (task name, shape)
    i32 backfilled          # 1 when the current generation was placed by backfill
    u64 fit                 # clusters it could ever fit (bitmask)
    i64 gen                 # lease generation
    i64 released_gen        # generation whose in-flight counts were released
    i64 delivered_gen       # generation handed to the dispatcher
    i64 enqueued            # first enqueue (ns)
    i64 deadline_due        # timer dues (ns; NEVER when none)
    i64 queued_due          # max_queued_time of the current attempt
    i64 retry_due           # end of the retry backoff
    i64 runtime_due         # engine backstop of max_runtime
    u64 name_hash           # hash of the action id
    i64 pred_end            # predicted end of the live lease (ns; NEVER unknown)
    i64 group               # enqueue group (shared spec and names)
    i32 gidx                # index in the group
    u8 lean                 # 1: this record is the whole outcome
    u8 phase                # phase code of a lean row
    u8 pad0                 # (alignment, always 0)
    u8 pad1
    i64 start               # lean: assignment of its attempt
    i64 running             # lean: first RUNNING report
    i64 done                # lean: end of its attempt
    i64 abort               # lean ABORTED: the row whose abort ended it
    i64 seq                 # enqueue order (FIFO across reused rows)
    i64 est_rt              # the spec's runtime_estimate (ns; NEVER none)
    i64 max_rt              # the spec's max_runtime (ns; NEVER none)


cdef class RecordCodec:
    cdef readonly Py_ssize_t n_res          # resources per demand vector
    cdef readonly Py_ssize_t n_pods         # node placement entries per record (0: none)
    cdef readonly Py_ssize_t action_size    # bytes per action record
    cdef u8[:] a_state                      # the bound action columns (engine/_state.py)
    cdef u8[:] a_end                        # lease end
    cdef u8[:] a_charged                    # charged flag
    cdef u8[::1] a_part                     # partition
    cdef i32[:] a_queue                     # queue
    cdef i32[:] a_run                       # run
    cdef i32[:] a_env                       # environment
    cdef i32[:] a_cluster                   # cluster
    cdef i32[:] a_worker                    # holder session row
    cdef i32[::1] a_parent                  # parent row
    cdef i32[::1] a_attempt                 # attempt number
    cdef i32[:] a_lane                      # lane (bit 0: fast)
    cdef u64[:] a_fit                       # fit mask
    cdef i64[:] a_gen                       # generation
    cdef i64[:] a_released_gen              # released generation
    cdef i64[::1] a_delivered_gen           # delivered generation
    cdef i64[::1] a_enqueued                # first enqueue
    cdef i64[::1] a_deadline_due            # deadline due
    cdef i64[::1] a_queued_due              # max_queued_time due
    cdef i64[::1] a_retry_due               # retry due
    cdef i64[::1] a_runtime_due             # runtime backstop due
    cdef u64[::1] a_name_hash               # name hash
    cdef i32[:] a_task                      # history key row
    cdef u8[:] a_backfilled                 # placed by backfill
    cdef i64[:] a_pred_end                  # predicted end
    cdef i64[::1] a_group                   # enqueue group
    cdef i32[::1] a_gidx                    # index in the group
    cdef u8[::1] a_lean                     # lean flag
    cdef u8[::1] a_edges                    # 1: the row's Python record is its truth
    cdef u8[::1] a_phase                    # lean phase code
    cdef i64[::1] a_start                   # lean assignment time
    cdef i64[::1] a_running                 # lean RUNNING time
    cdef i64[::1] a_done                    # lean end time
    cdef i64[::1] a_abort                   # lean abort root
    cdef i64[::1] a_seq                     # enqueue order
    cdef i64[::1] a_est_rt                  # runtime estimate
    cdef i64[::1] a_max_rt                  # max_runtime
    cdef i64[:, ::1] a_demand               # demand vectors
    cdef i32[:, ::1] a_pnode                # node placement of the live lease (n_pods wide)
    cdef i32[::1] w_ident                   # session row -> worker identity
    cdef u64[::1] _scratch                  # encode_into: sort keys, then heavy rows
    cdef Py_ssize_t _scratch_n              # ... its length (0: not made yet)

    cdef int _check_rows(self, const i64[::1] rows) except -1
    cdef Py_ssize_t _pack(self, const i64* rows, Py_ssize_t m, u64* scratch, u8* keys,
                          u8* values, i64* heavy, Py_ssize_t* n_heavy) noexcept nogil
    cdef list _blocks(self, const u64* scratch, Py_ssize_t n)

    cdef void _encode(self, i64 a, u8* dst) noexcept nogil
    cdef int _decode(self, const u8* src, i32[::1] holder, i64 rows) noexcept nogil
