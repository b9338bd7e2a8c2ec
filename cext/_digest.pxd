# BLAKE2b with an 8-byte digest (RFC 7693, no key): the name hashes of action ids, which are
# durable (fixed records, retained keys), so it must equal hashlib.blake2b(digest_size=8).
from cext._types cimport u64

cdef u64 blake2b64(const unsigned char* data, Py_ssize_t n) noexcept nogil
