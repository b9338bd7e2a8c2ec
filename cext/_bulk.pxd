# Kernel moves over many rows: the TickKernel's own single-row moves (cext/_tick.pxd) run
# in one nogil loop, for the engine's vector paths (abort of a tree, reports of a batch).
from cext._tick cimport TickKernel
from cext._types cimport i64

cdef void _remove_many(TickKernel k, const i64[::1] rows) noexcept nogil
cdef void _release_many(TickKernel k, const i64[::1] rows, i64 now) noexcept nogil
cdef void _push_finalize_many(TickKernel k, const i64[::1] rows) noexcept nogil
