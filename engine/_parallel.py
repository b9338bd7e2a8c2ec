"""The reload's whole-table passes split over this machine's cores. The record codec
releases the GIL and so do numpy's copies, so threads run them side by side: the second core
is otherwise idle there, and the first writes to fresh memory that each part pays are paid
on both cores at once."""

import os
from concurrent.futures import ThreadPoolExecutor

__all__ = ["halves", "in_threads"]

# Below this many rows one thread does the whole pass (a thread costs more than it saves).
MIN_ROWS = 100_000


def halves(n, align=1):
    """Row ranges ``(lo, hi)`` covering ``0 .. n``: two halves (cut at a multiple of
    ``align``) for a large table on a machine of several cores, else the one range."""
    if n < MIN_ROWS or (os.cpu_count() or 1) < 2:
        return [(0, n)]
    mid = n // 2 // align * align
    return [(0, mid), (mid, n)]


def in_threads(fn, items):
    """``[fn(item) for item in items]``, one thread per item (``fn`` releases the GIL)."""
    if len(items) == 1:
        return [fn(items[0])]
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))
