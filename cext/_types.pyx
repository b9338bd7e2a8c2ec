"""The codes and constants of ``cext/_types.pxd`` as the compiled kernel sees them.

Each ``cpdef enum`` of the .pxd is a Python ``IntEnum`` here (``ActionState``, ``WaitCode``,
``LeaseEnd``, ``TokenVerdict``, ``LeaseKind``); tests/test_layout.py checks them and
:func:`constants` against their mirrors in ``engine``. :data:`DEBUG` says which build this
is, and :func:`bounds_probe` is the debug build's trap, on demand.
"""

# The names of cext/_types.pxd (this module's own .pxd) are in scope without a cimport.

__all__ = ["DEBUG", "constants", "bounds_probe", "ActionState", "WaitCode", "LeaseEnd",
           "TokenVerdict", "LeaseKind"]

DEBUG = bool(DEBUG_BUILD)  # built with LEASEHOLD_DEBUG=1 (bounds and initialisation checks)


def constants():
    """The kernel's shared constants: UNLIMITED, NEVER, KIND_BIT and MAX_CLUSTERS (clusters
    are bits of a uint64 mask)."""
    return {"UNLIMITED": UNLIMITED, "NEVER": NEVER, "KIND_BIT": KIND_BIT,
            "MAX_CLUSTERS": 8 * sizeof(u64)}


cdef i64 _read(const i64[::1] values, Py_ssize_t i) noexcept nogil:
    # Like every kernel helper: a failed bounds check in here cannot propagate, so Cython
    # reports it through sys.unraisablehook and returns 0.
    return values[i]


def bounds_probe(const i64[::1] values not None, Py_ssize_t i):
    """Read ``values[i]`` inside ``noexcept nogil`` code (a test hook for the debug trap).

    Debug build: the read is bounds checked and wraparound is off, so an ``i`` outside
    ``0 <= i < len(values)`` (-1 included) raises IndexError inside noexcept code. That can
    only be reported through ``sys.unraisablehook`` ("Exception ignored in ..."), which the
    test suite turns into a failure; the probe then returns 0.
    Release build: nothing would trap, so the probe checks ``i`` itself before reading and
    raises IndexError like any entry point.
    """
    cdef i64 v
    if not DEBUG_BUILD:
        check_index(i, values.shape[0], "i", "an index of values")
    with nogil:
        v = _read(values, i)
    return v
