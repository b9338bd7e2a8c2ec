"""Runtime history per history key (task name and resource shape): the most recent
successful runtimes, from which EASY backfill predicts as EASY++ does (Tsafrir, Etsion and
Feitelson, "Backfilling using system-generated predictions rather than user runtime
estimates", IEEE TPDS 2007): the mean of the last two successes of the key.

A key is ``(task, shape)``: the task name (``ActionSpec.task``, stable across runs) and the
action's resource shape (:func:`shape_key`: its pods and their vectors), so a task run at
two sizes learns two histories. Each key costs one row of :data:`RECENT` ``int64`` samples
and one ``uint64`` count whatever the number of samples: memory is bounded per key, and the
storage layer persists a key's row as one fixed-size record (:meth:`RuntimeHistory.encode`
/ :meth:`load`). The predictor and its failure modes: ``docs/predictions.md``.
"""

import struct

import numpy as np

__all__ = ["RuntimeHistory", "ShapePriors", "RECENT", "RECORD_SIZE", "shape_key"]

#: Successful runtimes kept per key (newest first): what the predictor averages.
RECENT = 2

# Record layout: magic, version, samples kept, then the count of samples ever recorded
# (uint64) and RECENT int64 runtimes (ns, newest first; -1 where fewer were recorded).
# Version 1 was a 96-bucket histogram (a percentile per task name); it is not read.
_MAGIC = b"LHRH"
_VERSION = 2
_HEADER = struct.Struct("<4sHH")
_BODY = struct.Struct("<Q" + "q" * RECENT)
RECORD_SIZE = _HEADER.size + _BODY.size
# The whole record as one struct (a flush packs many: one call each).
_RECORD = struct.Struct("<4sHHQ" + "q" * RECENT)
assert _RECORD.size == RECORD_SIZE


def shape_key(names, pods, counts):
    """The resource shape of an action as a stable string: each pod group as
    ``<replicas>x(<resource>=<amount>,...)`` (non-zero amounts, the config's resource
    ``names`` and units), groups joined by ``+``. Two actions with the same pods share it."""
    groups = []
    for row, n in zip(pods.tolist(), counts.tolist(), strict=True):
        parts = ",".join(f"{name}={v}" for name, v in zip(names, row, strict=True) if v)
        groups.append(f"{n}x({parts})")
    return "+".join(groups)


def _check_key(key):
    if (not isinstance(key, tuple) or len(key) != 2 or not isinstance(key[0], str)
            or not key[0] or not isinstance(key[1], str)):
        raise ValueError(f"a history key is (task name, shape), not {key!r}")


class RuntimeHistory:
    """The last :data:`RECENT` successful runtimes of each key, in one growing 2-D array.

    ``record_ns`` adds a sample; ``predict_ns`` is the mean of the last two (None without
    history); ``encode``/``load`` move one key's row in and out as bytes. Not thread-safe
    (the shard is single-threaded).
    """

    def __init__(self, initial_keys=16):
        self._rows = {}                                              # key -> row
        n = max(1, initial_keys)
        self._recent = np.full((n, RECENT), -1, dtype=np.int64)      # newest first
        self._count = np.zeros(n, dtype=np.uint64)

    # ------------------------------------------------------------------ rows

    def _row(self, key, create):
        row = self._rows.get(key)
        if row is None and create:
            _check_key(key)
            row = len(self._rows)
            if row >= self._count.shape[0]:
                m = 2 * self._count.shape[0]
                recent = np.full((m, RECENT), -1, dtype=np.int64)
                recent[:row] = self._recent
                count = np.zeros(m, dtype=np.uint64)
                count[:row] = self._count
                self._recent, self._count = recent, count
            self._rows[key] = row
        return row

    # ------------------------------------------------------------------ samples

    def record(self, key, seconds):
        """Add one successful runtime of ``key``, in seconds (>= 0)."""
        if not seconds >= 0:
            raise ValueError(f"history {key!r}: a runtime is >= 0 seconds, not {seconds!r}")
        self.record_ns(key, int(round(seconds * 1e9)))

    def record_ns(self, key, ns):
        """Add one successful runtime of ``key`` in integer nanoseconds (>= 0)."""
        if ns < 0:
            raise ValueError(f"history {key!r}: a runtime is >= 0 ns, not {ns!r}")
        self.record_many_ns(key, np.array([ns], dtype=np.int64))

    def record_many_ns(self, key, ns):
        """Record many runtimes (ns, an integer array, oldest first) of ``key``."""
        ns = np.maximum(np.asarray(ns, dtype=np.int64), 0)
        if not ns.size:
            return
        row = self._row(key, True)
        last = ns[::-1][:RECENT]                    # the newest of them, newest first
        keep = RECENT - last.size
        recent = self._recent[row]
        recent[last.size:] = recent[:keep].copy()
        recent[:last.size] = last
        self._count[row] += np.uint64(ns.size)

    def count(self, key):
        """Samples ever recorded for ``key`` (0 when none)."""
        row = self._rows.get(key)
        return 0 if row is None else int(self._count[row])

    def recent_ns(self, key):
        """The last successful runtimes of ``key`` (ns), newest first (at most RECENT)."""
        row = self._rows.get(key)
        if row is None:
            return []
        return [v for v in self._recent[row].tolist() if v >= 0]

    def predict_ns(self, key):
        """EASY++'s prediction for ``key`` in ns: the mean of its last two successful
        runtimes (the one runtime after one success, rounded up); None without history."""
        last = self.recent_ns(key)
        if not last:
            return None
        return -(-sum(last) // len(last))

    def predict(self, key):
        """:meth:`predict_ns` in seconds; None without history."""
        ns = self.predict_ns(key)
        return None if ns is None else ns / 1e9

    def keys(self):
        """Keys with a row, in the order they were first seen."""
        return list(self._rows)

    def __contains__(self, key):
        return self.count(key) > 0

    def __len__(self):
        return len(self._rows)

    @property
    def nbytes(self):
        """Bytes held by the sample table (bounded: one fixed row per key, doubling)."""
        return int(self._recent.nbytes + self._count.nbytes)

    # ------------------------------------------------------------------ moving rows

    def encode(self, key):
        """``key``'s row as one fixed-size record (:data:`RECORD_SIZE` bytes); ``KeyError``
        when the key has no row."""
        row = self._rows.get(key)
        if row is None:
            raise KeyError(f"no runtime history for {key!r}")
        return (_HEADER.pack(_MAGIC, _VERSION, RECENT)
                + _BODY.pack(int(self._count[row]), *self._recent[row].tolist()))

    def records(self, keys):
        """The :meth:`encode` record of each key of ``keys``, ``None`` for a key without a
        sample (no row, or a row not yet learnt): one gather for all of them, a struct
        pack each (what a flush of the samples of a second writes)."""
        rows = [self._rows.get(k, -1) for k in keys]
        if not rows:
            return []
        sel = np.array(rows, dtype=np.int64)
        counts = self._count[sel].tolist()
        recent = self._recent[sel].tolist()
        pack = _RECORD.pack
        return [pack(_MAGIC, _VERSION, RECENT, c, *r) if row >= 0 and c else None
                for row, c, r in zip(rows, counts, recent, strict=True)]

    @staticmethod
    def decode(key, data):
        """``(count, recent)`` of a record made by :meth:`encode`; ``ValueError`` naming
        ``key`` when the record is malformed (wrong length, magic, version or sample count).
        A version 1 record (a histogram, before predictions were per task and shape) is
        refused by name."""
        data = bytes(data)
        if len(data) >= _HEADER.size:
            magic, version, n = _HEADER.unpack_from(data)
            if magic == _MAGIC and version == 1:
                raise ValueError(f"runtime history {key!r}: a version 1 record (a percentile "
                                 f"histogram per task name); this code reads version "
                                 f"{_VERSION} (recent successes per task and shape)")
        if len(data) != RECORD_SIZE:
            raise ValueError(f"runtime history {key!r}: record is {len(data)} bytes; "
                             f"expected {RECORD_SIZE}")
        magic, version, n = _HEADER.unpack_from(data)
        if magic != _MAGIC or version != _VERSION or n != RECENT:
            raise ValueError(f"runtime history {key!r}: bad record header (magic {magic!r}, "
                             f"version {version}, {n} samples); expected {_MAGIC!r}, "
                             f"version {_VERSION}, {RECENT} samples")
        count, *recent = _BODY.unpack_from(data, _HEADER.size)
        kept = [v for v in recent if v >= 0]
        if (any(v < -1 for v in recent) or recent[:len(kept)] != kept
                or len(kept) != min(count, RECENT)):
            raise ValueError(f"runtime history {key!r}: samples {recent} do not match the "
                             f"count {count}")
        return count, np.array(recent, dtype=np.int64)

    def load(self, key, data):
        """Replace ``key``'s row with a record made by :meth:`encode` (reload from the
        store). Nothing changes when the record is malformed (``ValueError``)."""
        count, recent = self.decode(key, data)
        row = self._row(key, True)
        self._recent[row] = recent
        self._count[row] = np.uint64(count)


class ShapePriors:
    """What a key without history of its own predicts: the mean of the predictions of the
    keys of the same resource shape that have history (each key counted once, whatever its
    popularity). A task seen for the first time at a shape other tasks ran at gets their
    typical runtime instead of nothing (docs/predictions.md). Derived from the keys'
    histories alone, so nothing more is stored and a reload rebuilds it exactly.

    ``set(key, ns)`` records ``key``'s own prediction (ns, None without history) and says
    whether its shape's prior changed; ``prior_ns(shape)`` is the prior (None when no key
    of the shape has history)."""

    def __init__(self):
        self._own = {}      # key -> its prediction (ns), keys with history only
        self._sum = {}      # shape -> sum of its keys' predictions
        self._n = {}        # shape -> number of them

    def set(self, key, ns):
        shape = key[1]
        old = self._own.get(key)
        if ns == old:
            return False
        if old is None:
            self._n[shape] = self._n.get(shape, 0) + 1
            self._sum[shape] = self._sum.get(shape, 0)
        else:
            self._sum[shape] -= old
        if ns is None:
            del self._own[key]
            self._n[shape] -= 1
        else:
            self._own[key] = ns
            self._sum[shape] += ns
        return True

    def prior_ns(self, shape):
        n = self._n.get(shape)
        return -(-self._sum[shape] // n) if n else None
