"""Which new names may be retained outcomes: a bounded Bloom filter of reclaimed names.

A fan-out enqueue checks each new name of its run against the store's retained outcomes
(an action reclaimed earlier under the same name makes the enqueue idempotent, or refused).
A run that has reclaimed work probes the store for every name of every batch, though new
names almost never are reclaimed ones. This filter holds the name hashes (``a_name_hash``)
of the actions reclaimed since it was made or last cleared: a name it says is absent was not
reclaimed in that time, so a run whose every retained outcome is that recent (the engine
asks the store once, at the run's first reclaim in memory, and keeps which:
``_runs_fresh``) probes only the names the filter may hold.

It never forgets a name (no deletion: an expired outcome stays a possible hit, which only
costs a probe). It is bounded: past ``capacity`` names it is cleared, and the engine then
treats every run alive as one that may have older retained outcomes (probed as before).
"""

import numpy as np

__all__ = ["ReclaimedNames"]

#: Bits of the filter (a power of two; 256 KiB) and the names it takes before it is cleared:
#: at capacity, three bits a name, about 1.5% of absent names are reported possible.
BITS = 1 << 21
CAPACITY = 200_000
_SHIFTS = (0, 21, 42)   # three 21-bit positions from a name's 64-bit hash


class ReclaimedNames:
    """A Bloom filter of the 64-bit name hashes of reclaimed actions (see the module)."""

    def __init__(self, bits=None, capacity=None):
        bits = BITS if bits is None else bits
        if bits < 64 or bits & (bits - 1):
            raise ValueError(f"bits must be a power of two of at least 64, not {bits}")
        self._words = np.zeros(bits // 64, np.uint64)
        self._mask = np.uint64(bits - 1)
        self._capacity = CAPACITY if capacity is None else capacity
        self.count = 0          # names added since made or cleared

    def _positions(self, hashes):
        h = np.asarray(hashes, np.uint64)
        return [(h >> np.uint64(s)) & self._mask for s in _SHIFTS]

    def add(self, hashes):
        """Add ``hashes`` (uint64 name hashes). Returns True when the filter was full and
        has been cleared first: names added before are no longer held."""
        cleared = False
        n = len(hashes)
        if self.count + n > self._capacity:
            self._words[:] = 0
            self.count = 0
            cleared = True
        one = np.uint64(1)
        for p in self._positions(hashes):
            np.bitwise_or.at(self._words, (p >> np.uint64(6)).astype(np.intp),
                             one << (p & np.uint64(63)))
        self.count += n
        return cleared

    def may_hold(self, hashes):
        """A bool array: False where a hash was surely not added since the last clear."""
        out = np.ones(len(hashes), bool)
        one = np.uint64(1)
        for p in self._positions(hashes):
            out &= ((self._words[(p >> np.uint64(6)).astype(np.intp)] >> (p & np.uint64(63)))
                    & one).astype(bool)
        return out
