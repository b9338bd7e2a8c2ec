"""Leasehold's compiled hot path: the tick, the resource gate, lease tokens and record
codecs (Cython)."""

from cext._gate import admission_check_bench
from cext._records import RecordCodec
from cext._tick import TickKernel
from cext._types import DEBUG

__all__ = ["DEBUG", "RecordCodec", "TickKernel", "admission_check_bench"]
