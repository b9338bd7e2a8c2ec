"""The shard's map of the run leases it pushed for watched runs: what action a reported
token names, read before the report is applied (the engine names only live leases).

A run lease's id is its action's row (``engine._leasing``: a finalize lease's id has its
kind bit set, far above any row), so the map is columns indexed by lease id: the lease's
generation (0: none), its run, its action id (text) and its attempt. A turn's entries are
collected in a :class:`LeaseBatch` and joined to the map once the turn has committed (a
turn that failed would leave entries naming actions memory no longer holds); a report
names an entry only when its token's generation is the entry's. Whole batches of tokens go
in and out in numpy passes: no Python object a lease but its action id.
"""

import numpy as np

__all__ = ["LeaseBatch", "LeaseMap"]


class LeaseBatch:
    """The watched run leases one turn pushed: segments of (ids, generations, run, action
    ids, attempts), joined to a :class:`LeaseMap` with :meth:`LeaseMap.join`."""

    __slots__ = ("segments",)

    def __init__(self):
        self.segments = []

    def add(self, ids, gens, run, aids, attempts):
        """Leases ``ids`` (uint64 array) of generations ``gens`` of actions ``aids`` (a
        list of ids, text) of ``run``, in attempts ``attempts`` (an int array)."""
        self.segments.append((ids, gens, run, aids, attempts))

    def __bool__(self):
        return bool(self.segments)


class LeaseMap:
    """Lease id -> (generation, run, action id, attempt) of watched run leases (see the
    module)."""

    def __init__(self):
        self._gen = np.zeros(0, np.uint64)
        self._att = np.zeros(0, np.int64)
        self._run = np.empty(0, object)
        self._aid = np.empty(0, object)

    def __len__(self):
        return int(np.count_nonzero(self._gen))

    def _grow(self, top):
        n = max(top + 1, 2 * self._gen.size, 1024)
        for name in ("_gen", "_att", "_run", "_aid"):
            old = getattr(self, name)
            new = np.zeros(n, old.dtype) if old.dtype != object else np.empty(n, object)
            new[:old.size] = old
            setattr(self, name, new)

    def join(self, batch):
        """Take the entries of ``batch`` (a later entry of an id replaces an earlier)."""
        for ids, gens, run, aids, attempts in batch.segments:
            if not ids.size:
                continue
            top = int(ids.max())
            if top >= self._gen.size:
                self._grow(top)
            rows = ids.astype(np.intp)
            self._gen[rows] = gens
            self._att[rows] = attempts
            self._run[rows] = run
            self._aid[rows] = aids

    def _rows(self, ids, gens):
        """Rows of the entries ``ids`` name at generations ``gens``, and the mask of
        those that do."""
        inside = ids < self._gen.size
        rows = np.where(inside, ids, 0).astype(np.intp)
        if not self._gen.size:
            return rows, inside
        return rows, inside & (self._gen[rows] == gens) & (gens != 0)

    def names(self, tokens):
        """``(gen, run, action id, attempt)`` of each token's entry (``tokens``: n x 3 uint64:
        lease id, generation, MAC), None where the map holds none of that generation."""
        rows, hit = self._rows(tokens[:, 0], tokens[:, 1])
        out = [None] * len(rows)
        at = np.flatnonzero(hit)
        if at.size:
            r = rows[at]
            for i, name in zip(at.tolist(), zip(
                    tokens[at, 1].tolist(), self._run[r].tolist(), self._aid[r].tolist(),
                    self._att[r].tolist(), strict=True), strict=True):
                out[i] = name
        return out

    def named_run(self, tokens):
        """When every token names an entry and all of one run: ``(run, action ids,
        attempts)`` (lists, in the tokens' order); else None."""
        rows, hit = self._rows(tokens[:, 0], tokens[:, 1])
        if not hit.all() or not rows.size:
            return None
        runs = self._run[rows]
        run = runs[0]
        if not (runs == run).all():
            return None
        return run, self._aid[rows].tolist(), self._att[rows].tolist()

    def drop(self, ids):
        """Forget the entries of lease ids ``ids`` (a report ended their leases)."""
        ids = ids[ids < self._gen.size].astype(np.intp)
        self._gen[ids] = 0
        self._aid[ids] = None
        self._run[ids] = None
