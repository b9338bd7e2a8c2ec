"""The ETA projection: a predicted start for every queued action (issue 14, item 6).

Like Slurm's backfill planner (what ``squeue --start`` shows): each cluster's free vector now
plus the predicted end of each live lease on it (the tick's own predictor, ``_live_end``)
make a timeline of free capacity; the queued actions are walked in the order the tick visits
them (queues by priority, each queue's STRICT head first, then round robin over its runs,
regular and fast lane 1:1), and each gets the earliest time its demand fits on a cluster it
may use for its whole predicted runtime, where that capacity is then reserved. Rules (the
documented approximations are in docs/architecture.md, "ETA projection"):

* STRICT_FIFO without backfill: an action starts no earlier than the one ahead of it.
* STRICT_FIFO (with or without backfill): an action projected to wait holds the clusters it
  may use until its start against every later queue, as a blocked head does in the tick.
* Honesty: capacity reserved by something with no predicted end (a live lease, or a queued
  action with no prediction, or a warm pool's footprint) is never released; an action that
  needs it gets no ETA (NEVER, why = ETA_UNKNOWN_END), never a made-up one.
"""

cimport cython

from cext._gate cimport covers, lowest_bit
from cext._tick cimport TickKernel
from cext._types cimport NEVER, ST_QUEUED, UNLIMITED, W_HEAD_OF_LINE, i32, i64, u8, u64

# Why an action has the ETA it has (mirrored in engine/_projection.py, ETA_WHY).
cpdef enum EtaWhy:
    ETA_KNOWN = 0          # projected
    ETA_PAUSED = 1         # its queue is paused: it starts when resumed
    ETA_NO_WORKER = 2      # no allowed cluster has a connected worker
    ETA_UNKNOWN_END = 3    # what it needs is held by something with no predicted end
    ETA_BEHIND = 4         # STRICT_FIFO: an action ahead of it in its queue has no ETA
    ETA_NEVER_FITS = 5     # no allowed cluster can ever hold it (fails UNSCHEDULABLE)
    ETA_POOL = 6           # waits for a slot of its running warm pool (not projected)
    ETA_NOT_QUEUED = 7     # not a queued action (no projection)
    ETA_HORIZON = 8        # past the first `horizon` actions in the tick's order


# Runtime buckets of the lower bounds (_earliest): by bit length (a factor of 2 each).
DEF N_BUCKETS = 64


cdef inline Py_ssize_t _bucket(i64 rt) noexcept nogil:
    if rt <= 0:
        return 0
    return 64 - __builtin_clzll(<unsigned long long>rt)


cdef extern from *:
    int __builtin_clzll(unsigned long long) nogil


cdef inline i64 _add_sat(i64 t, i64 d) noexcept nogil:
    # t + d, NEVER when d is NEVER or the sum would pass it.
    if d >= NEVER - t:
        return NEVER
    return t + d


cdef inline void _hold(i64[::1] hold, u64 mask, i64 t) noexcept nogil:
    cdef int c
    while mask != 0:
        c = lowest_bit(mask)
        mask &= ~((<u64>1) << c)
        if t > hold[c]:
            hold[c] = t


cdef void _sift(i64* key, i32* row, Py_ssize_t root, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t child
    cdef i64 kk
    cdef i32 w
    while True:
        child = 2 * root + 1
        if child >= n:
            return
        if child + 1 < n and key[child + 1] > key[child]:
            child += 1
        if key[root] >= key[child]:
            return
        kk = key[root]
        key[root] = key[child]
        key[child] = kk
        w = row[root]
        row[root] = row[child]
        row[child] = w
        root = child


cdef void _heapsort(i64* key, i32* row, Py_ssize_t n) noexcept nogil:
    # Ascending by key, rows alongside.
    cdef Py_ssize_t i
    cdef i64 kk
    cdef i32 w
    i = n // 2
    while i > 0:
        i -= 1
        _sift(key, row, i, n)
    i = n
    while i > 1:
        i -= 1
        kk = key[0]
        key[0] = key[i]
        key[i] = kk
        w = row[0]
        row[0] = row[i]
        row[i] = w
        _sift(key, row, 0, i)


@cython.final
cdef class EtaProjector:
    """Projected starts of every queued action, from a :class:`cext.TickKernel`'s state.
    ``bind`` gives it its arrays (sized by engine/_projection.py); ``project`` fills ``eta``,
    ``why`` (per action row) and ``order`` (the queued rows in projection order)."""

    def bind(self, Py_ssize_t n_res, i64[::1] sg_t not None, i32[::1] sg_next not None,
             i64[:, ::1] sg_free not None, i32[::1] c_first not None,
             i64[::1] c_hold not None, i64[::1] c_hold_q not None, i64[::1] s_key not None,
             i32[::1] s_row not None, i32[::1] s_lanes not None, i32[::1] s_cur not None,
             i64[::1] eta not None, u8[::1] why not None, i32[::1] order not None,
             i32[::1] c_hint not None, u8[::1] q_rest not None):
        """Bind the timeline, scratch and output arrays (allocated once, grown in Python;
        ``eta`` and ``why`` are cleared here: a run resets only the rows it listed)."""
        if sg_free.shape[1] != n_res or sg_free.shape[0] != sg_t.shape[0]:
            raise ValueError("sg_free must be [len(sg_t), n_res]")
        if s_lanes.shape[0] != 2 * s_cur.shape[0]:
            raise ValueError("s_lanes must be twice as long as s_cur")
        if why.shape[0] != eta.shape[0]:
            raise ValueError("eta and why must be as long")
        eta[:] = NEVER
        why[:] = ETA_NOT_QUEUED
        q_rest[:] = ETA_HORIZON
        self.q_rest = q_rest
        self.n_res = n_res
        self.sg_t = sg_t
        self.sg_next = sg_next
        self.sg_free = sg_free
        self.c_first = c_first
        self.c_hold = c_hold
        self.c_hold_q = c_hold_q
        self.s_key = s_key
        self.s_row = s_row
        self.s_lanes = s_lanes
        self.s_cur = s_cur
        self.eta = eta
        self.why = why
        self.order = order
        self.c_hint = c_hint
        self.n_order = 0
        self.n_clusters = c_first.shape[0]

    def project(self, TickKernel k not None, i64 now, i32[::1] cls_ptr not None,
                i32[::1] lb_seg not None, i64[::1] lb_t not None, i64[::1] cls_vec not None,
                i32[::1] cls_hash not None, Py_ssize_t horizon=-1):
        """Project the queued actions of ``k`` at time ``now`` (ns): the first ``horizon``
        in the tick's order (every one when -1), listed in ``order``. The walk stops there,
        and at a STRICT_FIFO queue's first action with no ETA when every later one of the
        queue starts no earlier: the actions not reached are not listed, and
        :meth:`why_of` says why (``ETA_HORIZON``, ``ETA_BEHIND``). So a deep backlog costs
        the walk of ``horizon`` actions, not of every queued one. Demand classes (equal
        demand vectors share what their searches found) are assigned as the walk meets
        them, at most K (``cls_ptr`` K x C, ``lb_seg`` and ``lb_t`` K x C x 64,
        ``cls_vec`` K x R, ``cls_hash`` a power of two >= 2 K, or empty when K is 0: no
        classes, the same answers, slower); an action of a demand met after K others is
        searched from scratch. Sizes are checked here (the caller sizes the arrays from the
        engine's tables): the timeline holds ``C + 2 x rows`` segments, the outputs one
        entry per action row. Nothing here is O(queued) or O(rows): the walk, and the
        timeline seeded from the live leases."""
        cdef Py_ssize_t n_rows = k.a_state.shape[0]
        cdef Py_ssize_t n_lanes = k.ln_head.shape[0]
        cdef Py_ssize_t n_cls, h
        if self.n_res != k.n_res:
            raise ValueError("bound for another number of resources")
        if (self.eta.shape[0] < n_rows or self.why.shape[0] < n_rows
                or self.order.shape[0] < n_rows or self.s_key.shape[0] < n_rows
                or self.s_row.shape[0] < n_rows):
            raise ValueError("output and scratch arrays must cover the action table")
        if self.s_cur.shape[0] < n_lanes or self.c_first.shape[0] < k.n_clusters:
            raise ValueError("scratch arrays must cover the lanes and clusters")
        if self.sg_t.shape[0] < k.n_clusters + 2 * n_rows:
            raise ValueError("the timeline must hold C + 2 x action rows segments")
        if self.c_hint.shape[0] < k.n_clusters:
            raise ValueError("c_hint must cover the clusters")
        if self.q_rest.shape[0] < k.n_queues:
            raise ValueError("q_rest must cover the queues")
        if self.n_clusters < k.n_clusters:
            raise ValueError("bound for fewer clusters")
        n_cls = cls_ptr.shape[0] // self.n_clusters
        if cls_ptr.shape[0] != n_cls * self.n_clusters:
            raise ValueError("cls_ptr must be K x C")
        if lb_seg.shape[0] != cls_ptr.shape[0] * N_BUCKETS or lb_t.shape[0] != lb_seg.shape[0]:
            raise ValueError("lb_seg and lb_t must be 64 x as long as cls_ptr")
        if cls_vec.shape[0] != n_cls * self.n_res:
            raise ValueError("cls_vec must be K x R")
        h = cls_hash.shape[0]
        if (h & (h - 1)) != 0 or (n_cls and h < 2 * n_cls):
            raise ValueError("cls_hash must be a power of two >= 2 K (or empty when K is 0)")
        if horizon < -1:
            raise ValueError(f"horizon {horizon} must be >= 0, or -1 for every action")
        self.horizon = horizon if horizon >= 0 else n_rows
        cls_hash[:] = -1
        self.cls_vec = cls_vec
        self.cls_hash = cls_hash
        self.n_cls = 0
        self.cls_max = n_cls
        self.cls_ptr = cls_ptr
        self.lb_seg = lb_seg
        self.lb_t = lb_t
        with nogil:
            self._run(k, now)
        return self.n_order

    def why_of(self, TickKernel k not None, i32 a):
        """The ``EtaWhy`` of action row ``a`` in the last run (of ``k``'s state, unchanged
        since): its own code when the walk listed it, else, when it is queued, the code
        of the rows its queue's walk did not reach."""
        if not 0 <= a < self.why.shape[0] or a >= k.a_state.shape[0]:
            raise IndexError(f"action row {a} is out of range")
        return EtaWhy(self._why_of(k, a))

    def why_codes(self, TickKernel k not None):
        """Every action row's ``EtaWhy`` in the last run, as :meth:`why_of` (a copy; a pass
        over the table, for tests and benches)."""
        cdef Py_ssize_t n = min(self.why.shape[0], k.a_state.shape[0])
        cdef Py_ssize_t a
        out = bytearray(n)
        cdef unsigned char[::1] o = out
        for a in range(n):
            o[a] = self._why_of(k, <i32>a)
        return out

    cdef u8 _why_of(self, TickKernel k, i32 a) noexcept:
        if self.why[a] == ETA_NOT_QUEUED and k.a_state[a] == ST_QUEUED:
            return self.q_rest[k.a_queue[a]]
        return self.why[a]

    # ------------------------------------------------------------------ timeline

    cdef void _seed(self, TickKernel k, int c, i64 now, u64 wmask) noexcept nogil:
        # Cluster c's timeline: free now (as the gate sees it), then one segment per distinct
        # predicted end of its live charged leases, each adding what that lease releases.
        # Leases with no predicted end release nothing (NEVER sorts last and is cut off).
        cdef Py_ssize_t n = 0, i, j, r, R = self.n_res
        cdef i32 a, s, prev
        cdef i64 t, key
        k._cluster_free(c)
        s = <i32>self.n_seg
        self.n_seg += 1
        self.sg_t[s] = now
        self.sg_next[s] = -1
        for r in range(R):
            self.sg_free[s, r] = k.s_free[r]
        self.c_first[c] = s
        if not (wmask >> c) & 1:
            return
        a = k.c_live[c]
        while a >= 0:
            key = k.a_pred_end[a]
            if key < now:
                key = k._live_end(a, now)
            self.s_key[n] = key
            self.s_row[n] = a
            n += 1
            a = k.a_lnext[a]
        # Insertion sort is quadratic; a heap sort keeps a cluster of many leases cheap.
        _heapsort(&self.s_key[0], &self.s_row[0], n)
        prev = s
        i = 0
        while i < n:
            t = self.s_key[i]
            if t >= NEVER:
                break
            s = <i32>self.n_seg
            self.n_seg += 1
            self.sg_t[s] = t if t > now else now
            self.sg_next[s] = -1
            self.sg_next[prev] = s
            for r in range(R):
                self.sg_free[s, r] = self.sg_free[prev, r]
            j = i
            while j < n and self.s_key[j] == t:
                a = self.s_row[j]
                for r in range(R):
                    if self.sg_free[s, r] < UNLIMITED:
                        self.sg_free[s, r] += k.a_demand[a, r]
                j += 1
            i = j
            if self.sg_t[s] == self.sg_t[prev]:
                # A lease past its end releases no earlier than now: fold into the first.
                for r in range(R):
                    self.sg_free[prev, r] = self.sg_free[s, r]
                self.sg_next[prev] = -1
                self.n_seg -= 1
                continue
            prev = s

    cdef i64 _earliest(self, TickKernel k, int c, const i64* need, i64 t_min, i64 rt,
                       i32 cls, bint from_now, i32* seg) noexcept nogil:
        # The earliest time >= t_min at which need fits on c's timeline for rt (NEVER: for
        # ever); NEVER when none. seg: the segment the start falls in.
        # Free only shrinks while a projection runs, so (per demand class cls, equal demand
        # vectors; -1 none) what a search found stays true for later ones: a segment short
        # of the demand stays short (cls_ptr: the first segment not known short), and the
        # earliest start found from now for a runtime bounds, from below, every later
        # search from now for a runtime at least as long (lb_t/lb_seg per runtime bucket:
        # a deep backlog's searches begin near where the last one of their class ended,
        # instead of at now). c_hint: where the last search on c began (STRICT_FIFO queues
        # search from ever later times).
        cdef i32 s = self.c_first[c], j, nx
        cdef i32* front = NULL
        cdef Py_ssize_t base = 0, bk = _bucket(rt), i
        cdef i64 start, end, t_lo = t_min
        cdef bint leading, jumped = False
        if cls >= 0:
            front = &self.cls_ptr[cls * self.n_clusters + c]
            if front[0] >= 0:
                s = front[0]
            base = (cls * self.n_clusters + c) * N_BUCKETS
            if self.lb_t[base + bk] > t_lo:
                t_lo = self.lb_t[base + bk]
                if t_lo >= NEVER:
                    return NEVER
                if self.sg_t[self.lb_seg[base + bk]] > self.sg_t[s]:
                    s = self.lb_seg[base + bk]
                    jumped = True
        # Leading: the scan starts at the class's front, so a segment it finds short is the
        # first not known short. Not after the runtime bound's jump: the segments skipped
        # are too early for this runtime, not short of the demand (a shorter one may fit).
        leading = not jumped and self.sg_t[s] >= t_lo
        if not leading:
            j = self.c_hint[c]
            if j >= 0 and self.sg_t[j] > self.sg_t[s] and self.sg_t[j] <= t_lo:
                s = j
            while self.sg_next[s] >= 0 and self.sg_t[self.sg_next[s]] <= t_lo:
                s = self.sg_next[s]
            self.c_hint[c] = s
        start = t_lo if t_lo > self.sg_t[s] else self.sg_t[s]
        while True:
            end = _add_sat(start, rt)
            j = s
            while True:
                self.n_steps += 1
                if not covers(need, &self.sg_free[j, 0], self.n_res):
                    break
                leading = False
                nx = self.sg_next[j]
                if nx < 0 or self.sg_t[nx] >= end:
                    seg[0] = s
                    if cls >= 0 and from_now:
                        for i in range(bk + 1, N_BUCKETS):
                            if start > self.lb_t[base + i]:
                                self.lb_t[base + i] = start
                                self.lb_seg[base + i] = s
                    return start
                j = nx
            # Segment j is short: no start before its end works.
            s = self.sg_next[j]
            if leading and s >= 0 and front != NULL:
                front[0] = s        # j is short of this demand class for good
            if s < 0:
                if cls >= 0 and from_now:
                    for i in range(bk + 1, N_BUCKETS):
                        self.lb_t[base + i] = NEVER
                return NEVER
            start = self.sg_t[s]

    cdef i32 _split(self, TickKernel k, i32 seg, i64 t) noexcept nogil:
        # A segment starting at t, split off seg (which starts before t and is the one t
        # falls in); returns it.
        cdef i32 s = <i32>self.n_seg
        cdef Py_ssize_t r
        self.n_seg += 1
        self.sg_t[s] = t
        self.sg_next[s] = self.sg_next[seg]
        self.sg_next[seg] = s
        for r in range(self.n_res):
            self.sg_free[s, r] = self.sg_free[seg, r]
        return s

    cdef void _reserve(self, TickKernel k, int c, i32 seg, const i64* need, i64 start,
                       i64 rt) noexcept nogil:
        # Take need from c's timeline over [start, start + rt) (for ever when rt is NEVER).
        cdef i64 end = _add_sat(start, rt)
        cdef i32 s = seg, nx
        cdef Py_ssize_t r
        if end <= start:
            return      # a zero runtime takes nothing
        if self.sg_t[s] < start:
            s = self._split(k, s, start)
        while s >= 0:
            nx = self.sg_next[s]
            if end < NEVER and (nx < 0 or self.sg_t[nx] > end):
                nx = self._split(k, s, end)      # the part from end on keeps its free
            for r in range(self.n_res):
                if self.sg_free[s, r] < UNLIMITED:
                    self.sg_free[s, r] -= need[r]
            if nx >= 0 and self.sg_t[nx] >= end:
                return
            s = nx

    # ------------------------------------------------------------------ the walk

    cdef i32 _take(self, TickKernel k, int kind, Py_ssize_t nl) noexcept nogil:
        # The next action of one lane kind of the queue being walked, round robin over its
        # lanes from the ring's cursor (one action per lane per round); -1 when exhausted.
        cdef Py_ssize_t base = kind * nl
        cdef i32 lane, a
        while self.k_n[kind] > 0:
            if self.k_pos[kind] >= self.k_n[kind]:
                self.k_n[kind] = self.k_w[kind]
                self.k_pos[kind] = 0
                self.k_w[kind] = 0
                continue
            lane = self.s_lanes[base + self.k_pos[kind]]
            self.k_pos[kind] += 1
            a = self.s_cur[lane]
            if a < 0:
                continue
            self.s_cur[lane] = k.a_next[a]
            if k.a_next[a] >= 0:
                self.s_lanes[base + self.k_w[kind]] = lane
                self.k_w[kind] += 1
            return a
        return -1

    cdef i32 _class_of(self, TickKernel k, i32 a) noexcept nogil:
        # The demand class of a's demand vector: found in the table, else the next one
        # (its bounds start unknown), else -1 once K are taken. The table is at least twice
        # K long, so a probe always ends at a free slot or its class.
        cdef Py_ssize_t R = self.n_res, r, c, mask
        cdef const i64* need = &k.a_demand[a, 0]
        cdef u64 x = 14695981039346656037ULL      # FNV-1a over the vector's words
        cdef i32 slot
        if self.cls_max == 0:
            return -1
        for r in range(R):
            x = (x ^ <u64>need[r]) * 1099511628211ULL
        mask = self.cls_hash.shape[0] - 1
        slot = <i32>((x ^ (x >> 32)) & <u64>mask)
        while True:
            c = self.cls_hash[slot]
            if c < 0:
                break
            r = 0
            while r < R and self.cls_vec[c * R + r] == need[r]:
                r += 1
            if r == R:
                return <i32>c
            slot = <i32>((slot + 1) & mask)
        if self.n_cls == self.cls_max:
            return -1
        c = self.n_cls
        self.n_cls += 1
        self.cls_hash[slot] = <i32>c
        for r in range(R):
            self.cls_vec[c * R + r] = need[r]
        for r in range(c * self.n_clusters, (c + 1) * self.n_clusters):
            self.cls_ptr[r] = -1
        for r in range(c * self.n_clusters * N_BUCKETS, (c + 1) * self.n_clusters * N_BUCKETS):
            self.lb_t[r] = -1
        return <i32>c

    cdef void _project_one(self, TickKernel k, i32 a, i64 now, i64 t_min, u64 wmask,
                           bint strict) noexcept nogil:
        cdef i32 q = k.a_queue[a]
        cdef i32 e = k.a_env[a]
        cdef u64 fit, bit
        cdef int c, best = -1
        cdef i32 seg = -1, best_seg = -1
        cdef i64 t, t0, rt, best_t = NEVER, acc, best_acc = -1, cpu, best_cpu = -1
        cdef Py_ssize_t r
        cdef i32 cls = -2       # its demand class, looked up at its first search
        cdef const i64* need = &k.a_demand[a, 0]
        self.order[self.n_order] = a
        self.n_order += 1
        self.eta[a] = NEVER
        self.n_projected += 1
        if k.q_paused[q]:
            self.why[a] = ETA_PAUSED
            return
        if e >= 0 and k.e_cluster[e] >= 0:
            # Fast lane: its pool's footprint is charged already; it starts when a slot of
            # the pool is free (now, if one is), which the timeline does not model.
            if ((k.q_clusters[q] >> k.e_cluster[e]) & 1 and (wmask >> k.e_cluster[e]) & 1
                    and <i64>(k.e_adm[e] - k.e_rel[e]) < k.e_slots[e]):
                self.eta[a] = t_min
                self.why[a] = ETA_KNOWN
            else:
                self.why[a] = ETA_POOL
            return
        fit = k.a_fit[a] & k.q_clusters[q]
        if fit == 0:
            self.why[a] = ETA_NEVER_FITS
            return
        fit &= wmask
        if fit == 0:
            self.why[a] = ETA_NO_WORKER
            return
        # A warm pool's footprint outlives the action that starts it: reserved for ever.
        rt = k._pred_rt(a) if e < 0 else NEVER
        while fit != 0:
            c = lowest_bit(fit)
            bit = (<u64>1) << c
            fit &= ~bit
            t0 = t_min if t_min > self.c_hold[c] else self.c_hold[c]
            if t0 >= NEVER:
                continue
            if not k.gate_on:
                t = t0
                seg = self.c_first[c]
            else:
                if cls == -2:
                    cls = self._class_of(k, a)
                t = self._earliest(k, c, need, t0, rt, cls, t0 == now, &seg)
            if t >= NEVER or t > best_t:
                continue
            # Ties go where the gate would send them: most free accelerators, then cpu.
            acc = 0
            for r in range(self.n_res):
                if k.res_accel[r]:
                    acc += self.sg_free[seg, r]
            cpu = self.sg_free[seg, k.cpu_dim] if k.cpu_dim >= 0 else 0
            if t < best_t or acc > best_acc or (acc == best_acc and cpu > best_cpu):
                best, best_t, best_seg, best_acc, best_cpu = c, t, seg, acc, cpu
        if best < 0:
            self.why[a] = ETA_UNKNOWN_END
            fit = k.a_fit[a] & k.q_clusters[q] & wmask
            if strict:
                # A head with no ETA holds what it could use for ever, as in the tick.
                _hold(self.c_hold_q, fit, NEVER)
            return
        self.eta[a] = best_t
        self.why[a] = ETA_KNOWN
        if k.gate_on:
            self._reserve(k, best, best_seg, need, best_t, rt)
        if strict and best_t > now:
            _hold(self.c_hold_q, k.a_fit[a] & k.q_clusters[q] & wmask, best_t)

    cdef void _run(self, TickKernel k, i64 now) noexcept nogil:
        cdef Py_ssize_t i, j, nl = k.ln_head.shape[0]
        cdef int c, kind
        cdef u64 wmask = 0
        cdef i32 q, lane, start, a, first
        cdef i64 t_min
        cdef bint strict, chain
        # Clear what the last run wrote: only the rows it listed (bind cleared the rest).
        for i in range(self.n_order):
            a = self.order[i]
            self.eta[a] = NEVER
            self.why[a] = ETA_NOT_QUEUED
        for j in range(k.n_queues):
            self.q_rest[j] = ETA_HORIZON
        self.n_seg = 0
        self.n_steps = 0
        self.n_order = 0
        self.n_projected = 0
        # Clusters with a connected worker that takes work: nothing starts anywhere else.
        for i in range(k.n_workers):
            if k.w_connected[i] and not k.w_paused[i]:
                wmask |= (<u64>1) << k.w_cluster[i]
        for c in range(k.n_clusters):
            self.c_hint[c] = -1
            self.c_hold[c] = now
            self.c_hold_q[c] = now
            self._seed(k, c, now, wmask)
        for j in range(k.n_queues):
            q = k.q_order[j]
            if k.q_pending[q] == 0:
                continue
            if self.n_projected >= self.horizon:
                return      # the queued rows of this queue and every later one: q_rest
            strict = k.q_strict[q]
            chain = strict and not k.q_backfill[q]
            t_min = now
            # The STRICT head blocked in the last tick is retried first (_retry_heads).
            first = k.q_head[q]
            if (not strict or first < 0 or k.a_state[first] != ST_QUEUED
                    or k.a_queue[first] != q or k.q_head_code[q] == W_HEAD_OF_LINE):
                first = -1
            # Each lane kind's lanes in ring order from its cursor.
            for kind in range(2):
                self.k_n[kind] = 0
                self.k_pos[kind] = 0
                self.k_w[kind] = 0
                start = k.q_ring[q, kind]
                lane = start
                while lane >= 0:
                    self.s_lanes[kind * nl + self.k_n[kind]] = lane
                    self.k_n[kind] += 1
                    self.s_cur[lane] = k.ln_head[lane]
                    lane = k.ln_next[lane]
                    if lane == start:
                        break
                self.k_w[kind] = 0
            kind = 0
            a = first
            while True:
                if a < 0:
                    a = self._take(k, kind, nl)
                    if a < 0:
                        kind ^= 1
                        a = self._take(k, kind, nl)
                        if a < 0:
                            break
                    kind ^= 1
                    if a == first or k.a_state[a] != ST_QUEUED:
                        a = -1
                        continue
                if self.n_projected >= self.horizon:
                    return      # this row and every one after it: ETA_HORIZON (q_rest)
                if chain and t_min >= NEVER and not k.q_paused[q]:
                    # Every later action of the queue starts no earlier than this one.
                    self.q_rest[q] = ETA_BEHIND
                    break
                self._project_one(k, a, now, t_min, wmask, strict)
                if chain:
                    t_min = self.eta[a]
                a = -1
            # This queue's holds bind the queues after it.
            for c in range(k.n_clusters):
                if self.c_hold_q[c] > self.c_hold[c]:
                    self.c_hold[c] = self.c_hold_q[c]
