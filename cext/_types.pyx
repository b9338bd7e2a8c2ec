"""The codes and constants of ``cext/_types.pxd`` as the compiled kernel sees them.

Each ``cpdef enum`` of the .pxd is a Python ``IntEnum`` here (``ActionState``, ``WaitCode``,
``LeaseEnd``, ``TokenVerdict``, ``LeaseKind``); tests/test_layout.py checks them and
:func:`constants` against their mirrors in ``engine``.
"""

# The names of cext/_types.pxd (this module's own .pxd) are in scope without a cimport.

__all__ = ["constants", "ActionState", "WaitCode", "LeaseEnd", "TokenVerdict", "LeaseKind"]


def constants():
    """The kernel's shared constants: UNLIMITED, NEVER, KIND_BIT and MAX_CLUSTERS (clusters
    are bits of a uint64 mask)."""
    return {"UNLIMITED": UNLIMITED, "NEVER": NEVER, "KIND_BIT": KIND_BIT,
            "MAX_CLUSTERS": 8 * sizeof(u64)}
