# Lease tokens: a keyed MAC (SipHash-2-4, 128-bit per-shard key) over (lease id, generation),
# and the batched two-phase validation of heartbeats. A token is three uint64 words:
# lease id (top bit = LeaseKind, the rest = row), generation, MAC.
from cext._types cimport u64


cdef inline u64 _rotl(u64 x, int b) noexcept nogil:
    return (x << b) | (x >> (64 - b))


cdef inline u64 siphash24(u64 k0, u64 k1, u64 m0, u64 m1) noexcept nogil:
    """SipHash-2-4 of the 16-byte message m0 || m1 (little-endian words) under key k0 || k1."""
    cdef u64 v0 = k0 ^ 0x736f6d6570736575ULL
    cdef u64 v1 = k1 ^ 0x646f72616e646f6dULL
    cdef u64 v2 = k0 ^ 0x6c7967656e657261ULL
    cdef u64 v3 = k1 ^ 0x7465646279746573ULL
    cdef u64 block
    cdef u64 words[3]
    cdef int i, _j, rounds
    words[0] = m0
    words[1] = m1
    words[2] = (<u64>16) << 56   # final block: message length, no tail bytes
    for i in range(4):
        if i < 3:
            block = words[i]
            v3 ^= block
            rounds = 2
        else:
            v2 ^= 0xff
            rounds = 4
        for _j in range(rounds):
            v0 += v1
            v1 = _rotl(v1, 13)
            v1 ^= v0
            v0 = _rotl(v0, 32)
            v2 += v3
            v3 = _rotl(v3, 16)
            v3 ^= v2
            v0 += v3
            v3 = _rotl(v3, 21)
            v3 ^= v0
            v2 += v1
            v1 = _rotl(v1, 17)
            v1 ^= v2
            v2 = _rotl(v2, 32)
        if i < 3:
            v0 ^= block
    return v0 ^ v1 ^ v2 ^ v3
