"""Record codecs: action rows packed into their durable fixed-size records in one C loop.

The engine encodes the rows a loop turn touched right before its group commit; doing it
column by column in numpy cost ~25 us per turn even for one row (one fancy index per
column), this is ~50 ns per row.
"""

cimport cython
cimport numpy as cnp
from cpython.bytes cimport (
    PyBytes_AS_STRING, PyBytes_Check, PyBytes_FromStringAndSize, PyBytes_GET_SIZE,
)
from cpython.memoryview cimport PyMemoryView_FromObject
from libc.stdlib cimport qsort
from libc.string cimport memcpy

from cext._types cimport check_index, i32, i64, u8

import numpy as np

cnp.import_array()

__all__ = ["RecordCodec", "ACTION_HEAD_SIZE", "copy_fixed", "fixed_pairs"]

ACTION_HEAD_SIZE = sizeof(ActionHead)

# A row and its partition as one sortable key: (partition << 56) | row.
DEF PART_SHIFT = 56


cdef int _cmp_u64(const void* a, const void* b) noexcept nogil:
    cdef u64 x = (<const u64*>a)[0]
    cdef u64 y = (<const u64*>b)[0]
    return (x > y) - (x < y)


cdef Py_ssize_t _sorted_distinct(u64* c, Py_ssize_t m) noexcept nogil:
    """Sort ``c[:m]`` ascending and drop repeats; returns how many stay. Already ascending
    (one fan-out's rows) costs one pass; a handful (one action's turn) an insertion sort."""
    cdef Py_ssize_t i, j, n
    cdef u64 v
    for i in range(1, m):
        if c[i] <= c[i - 1]:
            break
    else:
        return m
    if m <= 32:
        for i in range(1, m):
            v = c[i]
            j = i - 1
            while j >= 0 and c[j] > v:
                c[j + 1] = c[j]
                j -= 1
            c[j + 1] = v
    else:
        qsort(c, m, sizeof(u64), _cmp_u64)
    n = 1
    for i in range(1, m):
        if c[i] != c[n - 1]:
            c[n] = c[i]
            n += 1
    return n


def copy_fixed(values, Py_ssize_t size, Py_ssize_t count, u8[::1] out not None,
               Py_ssize_t offset):
    """Copy the fixed-size ``bytes`` that iterator ``values`` yields back to back into
    ``out`` from byte ``offset``: the bulk scan's copy of cursor values (a join of chunks
    allocated and copied every record twice).

    Copies at most ``count`` items, then takes one more to see whether there is one.
    Returns ``(items, bad)``: the items seen (``count + 1`` when there were more) and the
    index of the first item that is not ``bytes`` of ``size`` (nothing of it or after it
    copied), or -1."""
    cdef Py_ssize_t i = 0
    cdef char* dst
    if size < 1 or count < 0 or offset < 0 or offset + count * size > out.shape[0]:
        raise ValueError(f"{count} records of {size} bytes from byte {offset} do not fit "
                         f"an output of {out.shape[0]} bytes")
    dst = <char*>&out[0] if out.shape[0] else NULL
    for item in values:
        if i == count:
            return count + 1, -1
        if not PyBytes_Check(item) or PyBytes_GET_SIZE(item) != size:
            return i, i
        memcpy(dst + offset + i * size, PyBytes_AS_STRING(item), size)
        i += 1
    return i, -1


def fixed_pairs(const u8[::1] keys not None, const u8[::1] values not None,
                Py_ssize_t key_size, Py_ssize_t value_size, Py_ssize_t start,
                Py_ssize_t stop):
    """The ``(key, value)`` 2-tuples of ``bytes`` of fixed-size records ``start .. stop-1``
    of two flat buffers, as a list (what ``Cursor.putmulti`` takes: storage.Records.pairs).
    Made in one C loop: numpy's ``tolist`` of a void dtype and ``zip`` cost about twice as
    much, and ``putmulti`` pulling them one by one from an iterator was slower than from a
    list made beforehand (measured, 1,000 records of 212 bytes)."""
    cdef Py_ssize_t i
    if key_size < 1 or value_size < 0 or not 0 <= start <= stop:
        raise ValueError(f"bad record sizes or range: {key_size}, {value_size}, "
                         f"[{start}, {stop})")
    if stop * key_size > keys.shape[0] or stop * value_size > values.shape[0]:
        raise ValueError(f"records [{start}, {stop}) outside the buffers")
    out = [None] * (stop - start)
    for i in range(start, stop):
        key = PyBytes_FromStringAndSize(<const char*>&keys[i * key_size], key_size)
        if value_size:
            out[i - start] = (key, PyBytes_FromStringAndSize(
                <const char*>&values[i * value_size], value_size))
        else:
            out[i - start] = (key, b"")
    return out


@cython.final
cdef class RecordCodec:
    """Encodes action rows of one shard's arrays (rebind after a table grows)."""

    def __cinit__(self):
        self.n_res = 0
        self.action_size = 0
        self._scratch_n = 0

    def bind(self, state):
        """Bind the arrays of an ``engine._state.State``."""
        self.n_res = state.n_res
        self.n_pods = state.a_pnode.shape[1]
        self.action_size = sizeof(ActionHead) + 8 * self.n_res + 4 * self.n_pods
        self.a_state = state.a_state
        self.a_end = state.a_end
        self.a_charged = state.a_charged
        self.a_part = state.a_part
        self.a_queue = state.a_queue
        self.a_run = state.a_run
        self.a_env = state.a_env
        self.a_cluster = state.a_cluster
        self.a_worker = state.a_worker
        self.a_parent = state.a_parent
        self.a_attempt = state.a_attempt
        self.a_lane = state.a_lane
        self.a_fit = state.a_fit
        self.a_gen = state.a_gen
        self.a_released_gen = state.a_released_gen
        self.a_delivered_gen = state.a_delivered_gen
        self.a_enqueued = state.a_enqueued
        self.a_deadline_due = state.a_deadline_due
        self.a_queued_due = state.a_queued_due
        self.a_retry_due = state.a_retry_due
        self.a_runtime_due = state.a_runtime_due
        self.a_name_hash = state.a_name_hash
        self.a_task = state.a_task
        self.a_backfilled = state.a_backfilled
        self.a_pred_end = state.a_pred_end
        self.a_group = state.a_group
        self.a_gidx = state.a_gidx
        self.a_lean = state.a_lean
        self.a_edges = state.a_edges
        self.a_phase = state.a_phase
        self.a_start = state.a_start
        self.a_running = state.a_running
        self.a_done = state.a_done
        self.a_abort = state.a_abort
        self.a_seq = state.a_seq
        self.a_est_rt = state.a_est_rt
        self.a_max_rt = state.a_max_rt
        self.a_demand = state.a_demand
        self.a_pnode = state.a_pnode
        self.w_ident = state.w_ident

    def encode_actions(self, const i64[::1] rows not None, u8[::1] out not None):
        """Pack the records of ``rows`` back to back into ``out``."""
        cdef Py_ssize_t n = rows.shape[0]
        cdef Py_ssize_t i
        if out.shape[0] < n * self.action_size:
            raise ValueError("output buffer too small")
        for i in range(n):
            if not 0 <= rows[i] < self.a_state.shape[0]:
                check_index(rows[i], self.a_state.shape[0], f"rows[{i}]", "an action row")
        with nogil:
            for i in range(n):
                self._encode(rows[i], &out[i * self.action_size])

    def encode_blocks(self, const i64[::1] rows not None, u64[::1] scratch not None,
                      u8[::1] keys not None, u8[::1] values not None,
                      i64[::1] heavy not None):
        """A turn's action records, ready for the store: the distinct rows of ``rows`` (any
        order, repeats allowed), ordered by (partition, row); each row's key (its number,
        8 bytes big-endian) into ``keys`` and its record into ``values``, back to back.

        A row whose Python record is its truth (``a_edges`` 1) is no longer lean: its
        ``a_lean`` is cleared before its record is packed, and it is listed in ``heavy``
        (its attempts record is the caller's to write). ``scratch``, ``heavy``: room for
        ``len(rows)`` items; ``keys``, ``values``: for ``len(rows)`` records.

        Returns ``(n, blocks, n_heavy)``: ``n`` records written, ``blocks`` a list of
        ``(partition, lo, hi)`` (records ``lo .. hi-1`` belong to that partition), and
        ``heavy[:n_heavy]`` the rows above, ascending within their partition."""
        cdef Py_ssize_t m = rows.shape[0]
        cdef Py_ssize_t n, n_heavy = 0
        if self.action_size == 0:
            raise ValueError("codec is not bound")
        if (scratch.shape[0] < m or heavy.shape[0] < m or keys.shape[0] < 8 * m
                or values.shape[0] < self.action_size * m):
            raise ValueError(f"encode_blocks: buffers too small for {m} rows")
        self._check_rows(rows)
        if m == 0:
            return 0, [], 0
        with nogil:
            n = self._pack(&rows[0], m, &scratch[0], &keys[0], &values[0], &heavy[0],
                           &n_heavy)
        return n, self._blocks(&scratch[0], n), n_heavy

    def encode_into(self, const i64[::1] rows not None, dict batch not None, packed):
        """:meth:`encode_blocks` and the store's blocks in one call (a turn's group): the
        records of the distinct rows of ``rows`` appended to ``batch`` (partition -> list of
        operations), one ``packed("actions", keys, values, 8, action_size)`` per partition
        (``storage.Records.packed``: flat byte memoryviews of fresh buffers), partitions
        ascending. Returns the rows whose Python record is their truth, as a list (see
        encode_blocks). One call instead of four buffers and a loop over the blocks in
        Python: ~20 us of a tick's decide, where the kernel has just evicted that code."""
        cdef Py_ssize_t m = rows.shape[0]
        cdef Py_ssize_t size = self.action_size
        cdef Py_ssize_t n, n_heavy = 0, i, lo, hi
        cdef cnp.npy_intp dims[1]
        cdef u64* scratch
        cdef i64* heavy
        cdef cnp.ndarray keys, values
        cdef u8* kp
        cdef u8* vp
        if size == 0:
            raise ValueError("codec is not bound")
        self._check_rows(rows)
        if m == 0:
            return []
        if self._scratch_n < 2 * m:
            # Sort keys and heavy rows, kept between calls (grown, never shrunk).
            self._scratch_n = max(2 * m, 256)
            self._scratch = np.empty(self._scratch_n, dtype=np.uint64)
        scratch = <u64*>&self._scratch[0]
        heavy = <i64*>&self._scratch[m]
        dims[0] = 8 * m
        keys = cnp.PyArray_EMPTY(1, dims, cnp.NPY_UINT8, 0)
        dims[0] = size * m
        values = cnp.PyArray_EMPTY(1, dims, cnp.NPY_UINT8, 0)
        kp = <u8*>cnp.PyArray_DATA(keys)
        vp = <u8*>cnp.PyArray_DATA(values)
        with nogil:
            n = self._pack(&rows[0], m, scratch, kp, vp, heavy, &n_heavy)
        # Everything read of the scratch buffer first: ``packed`` is a Python call.
        out = [heavy[i] for i in range(n_heavy)]
        blocks = self._blocks(scratch, n)
        kv = PyMemoryView_FromObject(keys)
        vv = PyMemoryView_FromObject(values)
        for part, lo, hi in blocks:
            ops = batch.get(part)
            if ops is None:
                ops = batch[part] = []
            ops.append(packed("actions", kv[8 * lo:8 * hi], vv[size * lo:size * hi], 8, size))
        return out

    cdef int _check_rows(self, const i64[::1] rows) except -1:
        cdef Py_ssize_t i
        for i in range(rows.shape[0]):
            if not 0 <= rows[i] < self.a_state.shape[0]:
                check_index(rows[i], self.a_state.shape[0], f"rows[{i}]", "an action row")
        return 0

    cdef Py_ssize_t _pack(self, const i64* rows, Py_ssize_t m, u64* scratch, u8* keys,
                          u8* values, i64* heavy, Py_ssize_t* n_heavy) noexcept nogil:
        # The distinct rows, by (partition, row), keyed and packed; returns how many.
        cdef Py_ssize_t i, n
        cdef Py_ssize_t size = self.action_size
        cdef i64 r
        cdef int b
        for i in range(m):
            scratch[i] = (<u64>self.a_part[rows[i]] << PART_SHIFT) | <u64>rows[i]
        n = _sorted_distinct(scratch, m)
        for i in range(n):
            r = <i64>(scratch[i] & ((<u64>1 << PART_SHIFT) - 1))
            if self.a_edges[r] == 1:
                self.a_lean[r] = 0
                heavy[n_heavy[0]] = r
                n_heavy[0] += 1
            for b in range(8):
                keys[8 * i + b] = <u8>(<u64>r >> (56 - 8 * b))
            self._encode(r, &values[i * size])
        return n

    cdef list _blocks(self, const u64* scratch, Py_ssize_t n):
        # (partition, lo, hi) of each partition's run of the n sorted keys.
        cdef Py_ssize_t i, lo = 0
        cdef int part = <int>(scratch[0] >> PART_SHIFT)
        blocks = []
        for i in range(1, n):
            if <int>(scratch[i] >> PART_SHIFT) != part:
                blocks.append((part, lo, i))
                lo, part = i, <int>(scratch[i] >> PART_SHIFT)
        blocks.append((part, lo, n))
        return blocks

    def decode_actions(self, const u8[::1] records not None, Py_ssize_t start,
                       Py_ssize_t stop, i32[::1] holder not None):
        """Reload: scatter records ``[start, stop)`` of ``records`` (back to back) into the
        bound columns at their own rows, and each holder's identity into ``holder[row]``.

        One pass over the records (a column-by-column copy reads every record once per
        column). The GIL is released, so two threads can decode two halves. Returns -1, or
        the index of the first record whose row is outside the table or ``holder``
        (records before it are written)."""
        cdef Py_ssize_t size = self.action_size
        cdef Py_ssize_t i
        cdef i64 bad = -1
        if size == 0:
            raise ValueError("codec is not bound")
        if not 0 <= start <= stop or stop * size > records.shape[0]:
            raise ValueError(f"records [{start}, {stop}) outside a buffer of "
                             f"{records.shape[0] // size} records")
        cdef i64 rows = min(self.a_state.shape[0], holder.shape[0])
        with nogil:
            for i in range(start, stop):
                if self._decode(&records[i * size], holder, rows) < 0:
                    bad = i
                    break
        return bad

    cdef int _decode(self, const u8* src, i32[::1] holder, i64 rows) noexcept nogil:
        cdef ActionHead h
        memcpy(&h, src, sizeof(ActionHead))
        cdef i64 a = h.row
        if a < 0 or a >= rows:
            return -1
        self.a_state[a] = h.state
        self.a_end[a] = h.end
        self.a_charged[a] = h.charged
        self.a_part[a] = h.part
        self.a_queue[a] = h.queue
        self.a_run[a] = h.run
        self.a_env[a] = h.env
        self.a_cluster[a] = h.cluster
        holder[a] = h.holder
        self.a_parent[a] = h.parent
        self.a_attempt[a] = h.attempt
        self.a_fit[a] = h.fit
        self.a_gen[a] = h.gen
        self.a_released_gen[a] = h.released_gen
        self.a_delivered_gen[a] = h.delivered_gen
        self.a_enqueued[a] = h.enqueued
        self.a_deadline_due[a] = h.deadline_due
        self.a_queued_due[a] = h.queued_due
        self.a_retry_due[a] = h.retry_due
        self.a_runtime_due[a] = h.runtime_due
        self.a_name_hash[a] = h.name_hash
        self.a_task[a] = h.task
        self.a_backfilled[a] = h.backfilled
        self.a_pred_end[a] = h.pred_end
        self.a_group[a] = h.group
        self.a_gidx[a] = h.gidx
        self.a_lean[a] = h.lean
        self.a_phase[a] = h.phase
        self.a_start[a] = h.start
        self.a_running[a] = h.running
        self.a_done[a] = h.done
        self.a_abort[a] = h.abort
        self.a_seq[a] = h.seq
        self.a_est_rt[a] = h.est_rt
        self.a_max_rt[a] = h.max_rt
        memcpy(&self.a_demand[a, 0], src + sizeof(ActionHead), 8 * self.n_res)
        if self.n_pods:
            memcpy(&self.a_pnode[a, 0], src + sizeof(ActionHead) + 8 * self.n_res,
                   4 * self.n_pods)
        return 0

    cdef void _encode(self, i64 a, u8* dst) noexcept nogil:
        cdef ActionHead h
        cdef i32 w = self.a_worker[a]
        h.row = a
        h.state = self.a_state[a]
        h.end = self.a_end[a]
        h.charged = self.a_charged[a]
        h.part = self.a_part[a]
        h.queue = self.a_queue[a]
        h.run = self.a_run[a]
        h.env = self.a_env[a]
        h.cluster = self.a_cluster[a]
        h.holder = self.w_ident[w] if w >= 0 else -1
        h.parent = self.a_parent[a]
        h.attempt = self.a_attempt[a]
        h.fast = self.a_lane[a] & 1
        h.fit = self.a_fit[a]
        h.gen = self.a_gen[a]
        h.released_gen = self.a_released_gen[a]
        h.delivered_gen = self.a_delivered_gen[a]
        h.enqueued = self.a_enqueued[a]
        h.deadline_due = self.a_deadline_due[a]
        h.queued_due = self.a_queued_due[a]
        h.retry_due = self.a_retry_due[a]
        h.runtime_due = self.a_runtime_due[a]
        h.name_hash = self.a_name_hash[a]
        h.task = self.a_task[a]
        h.backfilled = self.a_backfilled[a]
        h.pred_end = self.a_pred_end[a]
        h.group = self.a_group[a]
        h.gidx = self.a_gidx[a]
        h.lean = self.a_lean[a]
        h.phase = self.a_phase[a]
        h.pad0 = 0
        h.pad1 = 0
        h.start = self.a_start[a]
        h.running = self.a_running[a]
        h.done = self.a_done[a]
        h.abort = self.a_abort[a]
        h.seq = self.a_seq[a]
        h.est_rt = self.a_est_rt[a]
        h.max_rt = self.a_max_rt[a]
        memcpy(dst, &h, sizeof(ActionHead))
        memcpy(dst + sizeof(ActionHead), &self.a_demand[a, 0], 8 * self.n_res)
        if self.n_pods:
            memcpy(dst + sizeof(ActionHead) + 8 * self.n_res, &self.a_pnode[a, 0],
                   4 * self.n_pods)
