# The tree of a run: its children index (engine/_state.py a_child, a_sibling).
from cext._types cimport i32, i64

cdef Py_ssize_t _descendants(const i32[::1] child, const i32[::1] sibling, i64 root,
                             i64[::1] out) noexcept nogil
