"""Leasehold's compiled hot path: the tick and the resource gate (Cython)."""

from cext._gate import admission_check_bench
from cext._tick import TickKernel

__all__ = ["TickKernel", "admission_check_bench"]
