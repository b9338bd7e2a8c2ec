# The retained outcome of a reclaimed lean row, as msgpack, packed from the columns (the record
# engine/_retain.py writes; engine/_records.py encode_outcome is the same outcome for a record).
from cext._types cimport i64, u8

cdef Py_ssize_t int_size(i64 v) noexcept nogil
cdef Py_ssize_t put_int(u8* p, i64 v) noexcept nogil
cdef Py_ssize_t head_size(Py_ssize_t n) noexcept nogil
cdef Py_ssize_t put_head(u8* p, Py_ssize_t n, u8 fix, u8 tag8) noexcept nogil
