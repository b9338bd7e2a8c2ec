"""Runtime history per task name: a fixed log-spaced histogram per task, rolled up to
percentiles for EASY backfill.

Task names are stable across runs (``ActionSpec.task``), so the history of a task outlives
any one run. Each task costs one row of :data:`N_BUCKETS` ``uint64`` counts (768 bytes)
whatever the number of samples: memory is bounded per task, and the storage layer persists a
task's row as one fixed-size record (:meth:`RuntimeHistory.encode` / :meth:`load`).

Buckets are log-spaced between :data:`LO_NS` (10 ms) and :data:`HI_NS` (60 days): bucket 0
holds ``[0, LO]``, bucket ``i`` (1..94) holds ``(edge[i-1], edge[i]]``, the last bucket
everything above ``HI``. Adjacent edges differ by a factor of about 1.24, so a percentile is
known to within one bucket (about 24%). A percentile is reported as the *upper* edge of its
bucket: a prediction errs long, never short, which is the safe side for backfill (a job
predicted to end by the shadow time really has). Edges are integer nanoseconds, so a sample
equal to an edge lands in the bucket whose upper edge it is, and predicts itself exactly.
"""

import struct

import numpy as np

__all__ = ["RuntimeHistory", "N_BUCKETS", "LO_NS", "HI_NS", "bucket_edges_ns"]

N_BUCKETS = 96
LO_NS = 10_000_000                      # 10 ms: everything shorter is one bucket
HI_NS = 60 * 86400 * 1_000_000_000      # 60 days: everything longer is one bucket
# Upper edges of buckets 0..94 (the last bucket has none): log-spaced, integer ns.
_EDGES = np.unique(np.round(np.geomspace(LO_NS, HI_NS, N_BUCKETS - 1)).astype(np.int64))
assert _EDGES.shape[0] == N_BUCKETS - 1 and _EDGES[0] == LO_NS and _EDGES[-1] == HI_NS

# Record layout: magic, version, bucket count, then N_BUCKETS little-endian uint64 counts.
_MAGIC = b"LHRH"
_VERSION = 1
_HEADER = struct.Struct("<4sHH")
RECORD_SIZE = _HEADER.size + 8 * N_BUCKETS


def bucket_edges_ns():
    """The upper edge (ns) of each bucket but the last, as a read-only array."""
    out = _EDGES.copy()
    out.flags.writeable = False
    return out


class RuntimeHistory:
    """Histograms of successful runtimes, one row per task, in one growing 2-D array.

    ``record`` adds a sample; ``percentile`` answers from the counts (None without history);
    ``encode``/``load`` move one task's row in and out as bytes; ``merge`` adds another
    history's counts. Not thread-safe (the shard is single-threaded).
    """

    def __init__(self, initial_tasks=16):
        self._rows = {}                                          # task -> row
        self._counts = np.zeros((max(1, initial_tasks), N_BUCKETS), dtype=np.uint64)
        self._cache = {}                                         # (task, p) -> ns

    # ------------------------------------------------------------------ rows

    def _row(self, task, create):
        row = self._rows.get(task)
        if row is None and create:
            if not isinstance(task, str) or not task:
                raise ValueError(f"a task name is a non-empty string, not {task!r}")
            row = len(self._rows)
            if row >= self._counts.shape[0]:
                grown = np.zeros((2 * self._counts.shape[0], N_BUCKETS), dtype=np.uint64)
                grown[:row] = self._counts
                self._counts = grown
            self._rows[task] = row
        return row

    def _forget(self, task):
        for key in [k for k in self._cache if k[0] == task]:
            del self._cache[key]

    # ------------------------------------------------------------------ samples

    def record(self, task, seconds):
        """Add one runtime of ``task``, in seconds (>= 0)."""
        if not seconds >= 0:
            raise ValueError(f"task {task!r}: a runtime is >= 0 seconds, not {seconds!r}")
        self.record_ns(task, int(round(seconds * 1e9)))

    def record_ns(self, task, ns):
        """Add one runtime of ``task`` in integer nanoseconds (>= 0)."""
        if ns < 0:
            raise ValueError(f"task {task!r}: a runtime is >= 0 ns, not {ns!r}")
        row = self._row(task, True)
        b = int(np.searchsorted(_EDGES, ns, side="left"))
        self._counts[row, b] += np.uint64(1)
        self._forget(task)

    def record_many_ns(self, task, ns):
        """Record many runtimes (ns, an integer array) of ``task`` in one pass."""
        ns = np.asarray(ns, dtype=np.int64)
        if not ns.size:
            return
        row = self._row(task, True)
        buckets = np.searchsorted(_EDGES, np.maximum(ns, 0), side="left")
        self._counts[row] += np.bincount(buckets, minlength=N_BUCKETS).astype(np.uint64)
        self._forget(task)

    def count(self, task):
        """Samples recorded for ``task`` (0 when none)."""
        row = self._rows.get(task)
        return 0 if row is None else int(self._counts[row].sum())

    def percentile_ns(self, task, p):
        """The ``p`` quantile (0 < p <= 1) of ``task``'s runtimes in ns, as the upper edge of
        its bucket (an over-estimate by less than one bucket); None without history. A
        quantile in the last bucket reports 60 days (it is at least that)."""
        if not 0 < p <= 1:
            raise ValueError(f"a percentile is in (0, 1], not {p!r}")
        key = (task, p)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        row = self._rows.get(task)
        if row is None:
            return None
        cum = np.cumsum(self._counts[row])
        n = int(cum[-1])
        if n == 0:
            return None
        rank = max(1, int(np.ceil(p * n)))
        b = int(np.searchsorted(cum, rank, side="left"))
        ns = int(_EDGES[min(b, N_BUCKETS - 2)])
        self._cache[key] = ns
        return ns

    def percentile(self, task, p):
        """The ``p`` quantile (0 < p <= 1) of ``task``'s runtimes in seconds; None when the
        task has no history. See :meth:`percentile_ns`."""
        ns = self.percentile_ns(task, p)
        return None if ns is None else ns / 1e9

    def tasks(self):
        """Task names with a row, in the order they were first seen."""
        return list(self._rows)

    def __contains__(self, task):
        return self.count(task) > 0

    def __len__(self):
        return len(self._rows)

    @property
    def nbytes(self):
        """Bytes held by the count table (bounded: one fixed row per task, doubling)."""
        return int(self._counts.nbytes)

    # ------------------------------------------------------------------ moving rows

    def merge(self, other):
        """Add every count of ``other`` (a RuntimeHistory) into this one."""
        for task, row in other._rows.items():
            mine = self._row(task, True)
            self._counts[mine] += other._counts[row]
            self._forget(task)

    def encode(self, task):
        """``task``'s row as one fixed-size record (:data:`RECORD_SIZE` bytes); ``KeyError``
        when the task has no row."""
        row = self._rows.get(task)
        if row is None:
            raise KeyError(f"no runtime history for task {task!r}")
        return (_HEADER.pack(_MAGIC, _VERSION, N_BUCKETS)
                + self._counts[row].astype("<u8").tobytes())

    @staticmethod
    def decode(task, data):
        """The counts in a record made by :meth:`encode`; ``ValueError`` naming ``task`` when
        the record is malformed (wrong length, magic, version or bucket count)."""
        data = bytes(data)
        if len(data) != RECORD_SIZE:
            raise ValueError(f"runtime history for task {task!r}: record is {len(data)} bytes; "
                             f"expected {RECORD_SIZE}")
        magic, version, nb = _HEADER.unpack_from(data)
        if magic != _MAGIC or version != _VERSION or nb != N_BUCKETS:
            raise ValueError(f"runtime history for task {task!r}: bad record header "
                             f"(magic {magic!r}, version {version}, {nb} buckets); expected "
                             f"{_MAGIC!r}, version {_VERSION}, {N_BUCKETS} buckets")
        return np.frombuffer(data, dtype="<u8", offset=_HEADER.size).astype(np.uint64)

    def load(self, task, data):
        """Replace ``task``'s row with a record made by :meth:`encode` (reload from the
        store). Nothing changes when the record is malformed (``ValueError``)."""
        counts = self.decode(task, data)
        row = self._row(task, True)
        self._counts[row] = counts
        self._forget(task)
