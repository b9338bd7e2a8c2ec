"""Name hashes of many action ids in one C loop: BLAKE2b with an 8-byte digest (RFC 7693),
the same value as ``hashlib.blake2b(text.encode(), digest_size=8)`` read little-endian
(engine._records.name_hash). A fan-out hashes every name it enqueues: a hashlib object per
name cost about a microsecond, a third of enqueueing a small action."""

cimport numpy as cnp
from cpython.unicode cimport PyUnicode_Check
from libc.string cimport memcpy, memset

from cext._types cimport u64

import numpy as np

cnp.import_array()

__all__ = ["name_hashes"]

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object text, Py_ssize_t* size) except NULL

cdef u64 IV[8]
IV[:] = [0x6a09e667f3bcc908, 0xbb67ae8584caa73b, 0x3c6ef372fe94f82b, 0xa54ff53a5f1d36f1,
         0x510e527fade682d1, 0x9b05688c2b3e6c1f, 0x1f83d9abfb41bd6b, 0x5be0cd19137e2179]

# The message schedule: rounds 10 and 11 repeat rounds 0 and 1.
cdef unsigned char SIGMA[12][16]
_SIGMA = (
    (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
    (14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3),
    (11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4),
    (7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8),
    (9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13),
    (2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9),
    (12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11),
    (13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10),
    (6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5),
    (10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0),
)
for _r in range(12):
    for _i in range(16):
        SIGMA[_r][_i] = _SIGMA[_r % 10][_i]


cdef inline u64 _rotr(u64 x, int k) noexcept nogil:
    return (x >> k) | (x << (64 - k))


cdef inline void _g(u64* v, int a, int b, int c, int d, u64 x, u64 y) noexcept nogil:
    v[a] = v[a] + v[b] + x
    v[d] = _rotr(v[d] ^ v[a], 32)
    v[c] = v[c] + v[d]
    v[b] = _rotr(v[b] ^ v[c], 24)
    v[a] = v[a] + v[b] + y
    v[d] = _rotr(v[d] ^ v[a], 16)
    v[c] = v[c] + v[d]
    v[b] = _rotr(v[b] ^ v[c], 63)


cdef void _compress(u64* h, const unsigned char* block, u64 t, bint last) noexcept nogil:
    cdef u64 v[16]
    cdef u64 m[16]
    cdef int i, r
    cdef const unsigned char* s
    memcpy(m, block, 128)       # little-endian words (x86-64, aarch64)
    for i in range(8):
        v[i] = h[i]
        v[i + 8] = IV[i]
    v[12] ^= t                  # byte counter (high word 0: names are short)
    if last:
        v[14] = ~v[14]
    for r in range(12):
        s = SIGMA[r]
        _g(v, 0, 4, 8, 12, m[s[0]], m[s[1]])
        _g(v, 1, 5, 9, 13, m[s[2]], m[s[3]])
        _g(v, 2, 6, 10, 14, m[s[4]], m[s[5]])
        _g(v, 3, 7, 11, 15, m[s[6]], m[s[7]])
        _g(v, 0, 5, 10, 15, m[s[8]], m[s[9]])
        _g(v, 1, 6, 11, 12, m[s[10]], m[s[11]])
        _g(v, 2, 7, 8, 13, m[s[12]], m[s[13]])
        _g(v, 3, 4, 9, 14, m[s[14]], m[s[15]])
    for i in range(8):
        h[i] ^= v[i] ^ v[i + 8]


cdef u64 blake2b64(const unsigned char* data, Py_ssize_t n) noexcept nogil:
    """BLAKE2b-64 of ``n`` bytes: the digest's 8 bytes as a little-endian integer."""
    cdef u64 h[8]
    cdef unsigned char block[128]
    cdef int i
    cdef u64 t = 0
    for i in range(8):
        h[i] = IV[i]
    h[0] ^= 0x01010000 ^ 8      # parameter block: fanout 1, depth 1, no key, digest 8
    while n > 128:              # every full block but the last
        t += 128
        _compress(h, data, t, False)
        data += 128
        n -= 128
    memset(block, 0, 128)
    if n:
        memcpy(block, data, n)
    _compress(h, block, t + <u64>n, True)
    return h[0]


def name_hashes(texts):
    """The name hash of each ``str`` of the sequence ``texts``, as a uint64 array."""
    cdef Py_ssize_t i, size, n = len(texts)
    cdef const char* utf8
    out = np.empty(n, dtype=np.uint64)
    cdef u64[::1] view = out
    for i in range(n):
        text = texts[i]
        if not PyUnicode_Check(text):
            raise TypeError(f"an action id is a str, not {type(text).__name__}")
        utf8 = PyUnicode_AsUTF8AndSize(text, &size)
        view[i] = blake2b64(<const unsigned char*>utf8, size)
    return out
