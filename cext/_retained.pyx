"""The retained outcomes of reclaimed lean rows, packed from their columns in one pass.

A reclaim moves the outcome of every ended action to the store (engine/_retain.py). A lean
row's outcome is its columns: one attempt on the common path. Building the msgpack of each
with Python lists and two ``packb`` calls cost ~6 us a row, most of a reclaim; this writes the
same bytes (msgpack-python's encoding: the smallest form of each integer, ``str`` for text,
``bin`` for bytes) straight into one ``bytes`` per row. tests/test_retention.py checks it
against ``msgpack.packb`` of the same lists.

Layout of one value (``engine._retain``)::

    [id, spec content, input ref | nil, end ns, queue,
     outcome: bin of [phase, message, nil, nil, 0, 0, [attempt]]]

with the attempt's fields in ``engine._records.ATTEMPT_FIELDS`` order (``number`` 1, the
generation, cluster, worker, enqueued, start, running and end times, phase, error kind and
cause nil, message, recoverable nil, finalize).
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_AsUTF8AndSize
from libc.string cimport memcpy

from cext._types cimport NEVER, i32, i64, u8

__all__ = ["pack_lean_retained"]

# Attempt fields (engine._records.ATTEMPT_FIELDS): checked by engine/_retain.py at import.
ATTEMPT_LAYOUT = ("number", "generation", "cluster", "worker", "enqueued_ns", "start_ns",
                  "running_ns", "end_ns", "phase", "error_kind", "cause", "message",
                  "recoverable", "finalize")
cdef enum:
    N_ATTEMPT = 14      # fields of an attempt
    NIL = 0xc0          # msgpack nil


cdef Py_ssize_t int_size(i64 v) noexcept nogil:
    """Bytes msgpack-python uses for integer ``v``."""
    if v >= 0:
        if v < 128:
            return 1
        if v < 256:
            return 2
        if v < 65536:
            return 3
        if v < 4294967296LL:
            return 5
        return 9
    if v >= -32:
        return 1
    if v >= -128:
        return 2
    if v >= -32768:
        return 3
    if v >= -2147483648LL:
        return 5
    return 9


cdef inline void _be(u8* p, unsigned long long v, int n) noexcept nogil:
    cdef int k
    for k in range(n):
        p[k] = <u8>(v >> (8 * (n - 1 - k)))


cdef Py_ssize_t put_int(u8* p, i64 v) noexcept nogil:
    """Write integer ``v`` as msgpack-python does; returns the bytes written."""
    cdef Py_ssize_t n = int_size(v)
    if n == 1:
        p[0] = <u8>(v & 0xff)
        return 1
    if v >= 0:
        p[0] = 0xcc if n == 2 else 0xcd if n == 3 else 0xce if n == 5 else 0xcf
    else:
        p[0] = 0xd0 if n == 2 else 0xd1 if n == 3 else 0xd2 if n == 5 else 0xd3
    _be(p + 1, <unsigned long long>v, <int>(n - 1))
    return n


cdef Py_ssize_t head_size(Py_ssize_t n) noexcept nogil:
    """Bytes of a str (or bin, or array) header for ``n``, beyond the fix forms."""
    return 2 if n < 256 else 3 if n < 65536 else 5


cdef Py_ssize_t put_head(u8* p, Py_ssize_t n, u8 fix, u8 tag8) noexcept nogil:
    """A length header: ``fix | n`` when ``fix`` is given and ``n`` fits it (str: < 32,
    array: < 16), else ``tag8`` / ``tag8 + 1`` / ``tag8 + 2`` with 1, 2 or 4 length bytes
    (str: d9, bin: c4; arrays have no 8-bit form, their tag8 is dc - 1)."""
    if fix == 0xa0 and n < 32 or fix == 0x90 and n < 16:
        p[0] = fix | <u8>n
        return 1
    if n < 256 and tag8 != 0xdb:
        p[0] = tag8
        p[1] = <u8>n
        return 2
    if n < 65536:
        p[0] = tag8 + 1
        _be(p + 1, <unsigned long long>n, 2)
        return 3
    p[0] = tag8 + 2
    _be(p + 1, <unsigned long long>n, 4)
    return 5


cdef inline Py_ssize_t _str_size(Py_ssize_t n) noexcept nogil:
    return n + (1 if n < 32 else head_size(n))


cdef inline Py_ssize_t _put_str(u8* p, const char* s, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t h = put_head(p, n, 0xa0, 0xd9)
    memcpy(p + h, s, n)
    return h + n


cdef inline Py_ssize_t _put_opt(u8* p, i64 v, bint on) noexcept nogil:
    if on:
        return put_int(p, v)
    p[0] = NIL
    return 1


cdef inline const char* _utf8(object text, Py_ssize_t* n) except NULL:
    return PyUnicode_AsUTF8AndSize(text, n)


def pack_lean_retained(list prefixes, list names, list contents, list inputs,
                       const i32[::1] queue not None, tuple queue_names,
                       const u8[::1] phase not None, tuple phase_names,
                       const i64[::1] enqueued not None, const i64[::1] gen not None,
                       const i64[::1] start not None, const i64[::1] running not None,
                       const i64[::1] done not None,
                       const i32[::1] cluster not None, tuple cluster_names,
                       const i32[::1] worker not None, tuple worker_names,
                       list messages, list finalizes, u8 succeeded, u8 aborted):
    """The retained value (``bytes``) of each lean row ``i``: its id ``prefixes[i] +
    names[i]`` (str), spec ``contents[i]`` (bytes), input ref ``inputs[i]`` (str or None),
    queue ``queue_names[queue[i]]``, and the outcome of its one attempt from its phase code,
    times (``NEVER``: not reached) and lease (generation, ``cluster_names[cluster[i]]``,
    ``worker_names[worker[i]]``, set when it started); ``messages[i]`` (str) is its abort
    reason (ABORTED) and ``finalizes[i]`` its finalize status (str or None)."""
    cdef Py_ssize_t n = len(names), i, size, osize, lp, ln, lc, li, lq, lph, lm, lcl, lw, lf
    cdef Py_ssize_t k, pos
    cdef const char *sp
    cdef const char *sn
    cdef const char *sq
    cdef const char *sph
    cdef const char *sm
    cdef const char *scl
    cdef const char *sw
    cdef const char *sf
    cdef const char *si
    cdef bytes content, value
    cdef u8* p
    cdef i64 ended
    cdef bint started, ran, ends
    for arr_n in (len(prefixes), len(contents), len(inputs), queue.shape[0], phase.shape[0],
                  enqueued.shape[0], gen.shape[0], start.shape[0], running.shape[0],
                  done.shape[0], cluster.shape[0], worker.shape[0], len(messages),
                  len(finalizes)):
        if arr_n != n:
            raise ValueError(f"pack_lean_retained: columns of {arr_n} rows for {n} names")
    out = [None] * n
    for i in range(n):
        sp = _utf8(prefixes[i], &lp)
        sn = _utf8(names[i], &ln)
        content = contents[i]
        lc = PyBytes_GET_SIZE(content)
        inp = inputs[i]
        si = NULL
        li = 0
        if inp is not None:
            si = _utf8(inp, &li)
        sq = _utf8(queue_names[queue[i]], &lq)
        sph = _utf8(phase_names[phase[i]], &lph)
        sm = _utf8(messages[i] if phase[i] == aborted else "", &lm)
        started = start[i] != NEVER
        ran = running[i] != NEVER
        ends = phase[i] == succeeded or phase[i] == aborted
        scl = sw = NULL
        lcl = lw = 0
        if started:
            scl = _utf8(cluster_names[cluster[i]], &lcl)
            sw = _utf8(worker_names[worker[i]], &lw)
        fin = finalizes[i]
        sf = NULL
        lf = 0
        if fin is not None:
            sf = _utf8(fin, &lf)
        ended = done[i] if done[i] != NEVER else 0
        # The outcome: [phase, message, nil, nil, 0, 0, [attempt]].
        osize = 1 + _str_size(lph) + _str_size(lm) + 4 + 1 + 1
        osize += 1 + int_size(gen[i] if started else 0)                  # number, generation
        osize += (_str_size(lcl) + _str_size(lw)) if started else 2        # cluster, worker
        osize += int_size(enqueued[i])
        osize += int_size(start[i]) if started else 1
        osize += int_size(running[i]) if ran else 1
        osize += int_size(done[i]) if ends else 1                          # end
        osize += _str_size(lph) if ends else 1                             # attempt phase
        osize += 2 + _str_size(lm if ends and phase[i] == aborted else 0)  # kind, cause, msg
        osize += 1 + (_str_size(lf) if sf != NULL else 1)                  # recoverable, fin
        size = 1 + _str_size(lp + ln) + lc + head_size(lc)
        size += (_str_size(li) if si != NULL else 1) + int_size(ended) + _str_size(lq)
        size += osize + head_size(osize)
        value = PyBytes_FromStringAndSize(NULL, size)
        p = <u8*>PyBytes_AS_STRING(value)
        pos = 0
        p[pos] = 0x96
        pos += 1
        pos += put_head(p + pos, lp + ln, 0xa0, 0xd9)
        memcpy(p + pos, sp, lp)
        memcpy(p + pos + lp, sn, ln)
        pos += lp + ln
        pos += put_head(p + pos, lc, 0, 0xc4)
        memcpy(p + pos, PyBytes_AS_STRING(content), lc)
        pos += lc
        if si != NULL:
            pos += _put_str(p + pos, si, li)
        else:
            p[pos] = NIL
            pos += 1
        pos += put_int(p + pos, ended)
        pos += _put_str(p + pos, sq, lq)
        pos += put_head(p + pos, osize, 0, 0xc4)
        k = pos
        p[pos] = 0x97
        pos += 1
        pos += _put_str(p + pos, sph, lph)
        pos += _put_str(p + pos, sm, lm)
        p[pos] = NIL
        p[pos + 1] = NIL
        p[pos + 2] = 0
        p[pos + 3] = 0
        p[pos + 4] = 0x91
        p[pos + 5] = 0x90 | N_ATTEMPT
        p[pos + 6] = 1                                      # number
        pos += 7
        pos += put_int(p + pos, gen[i] if started else 0)
        if started:
            pos += _put_str(p + pos, scl, lcl)
            pos += _put_str(p + pos, sw, lw)
        else:
            p[pos] = NIL
            p[pos + 1] = NIL
            pos += 2
        pos += put_int(p + pos, enqueued[i])
        pos += _put_opt(p + pos, start[i], started)
        pos += _put_opt(p + pos, running[i], ran)
        pos += _put_opt(p + pos, done[i], ends)
        if ends:
            pos += _put_str(p + pos, sph, lph)
        else:
            p[pos] = NIL
            pos += 1
        p[pos] = NIL                                        # error kind
        p[pos + 1] = NIL                                    # cause
        pos += 2
        if ends and phase[i] == aborted:
            pos += _put_str(p + pos, sm, lm)
        else:
            p[pos] = 0xa0                                   # ""
            pos += 1
        p[pos] = NIL                                        # recoverable
        pos += 1
        if sf != NULL:
            pos += _put_str(p + pos, sf, lf)
        else:
            p[pos] = NIL
            pos += 1
        if pos != size or pos - k != osize:
            raise AssertionError(f"pack_lean_retained: row {i} sized {size}, wrote {pos}")
        out[i] = value
    return out
