"""The columnar drain of the dispatch channel: one :class:`DispatchBatch` of arrays per drain
(tokens, actions, generations, clusters, workers), so the transport can send leases as raw
frames without a Python object per lease; :meth:`DispatchBatch.assignment` builds the
in-process :class:`~engine.Assignment` of one entry when wanted."""

from dataclasses import dataclass

import numpy as np

from engine._codes import LeaseKind

__all__ = ["DispatchBatch", "Assignment"]

# A batch's columns of one entry each, and their dtypes (``tokens`` is n x 3 uint64).
_COLUMNS = (("kind", np.uint8), ("lease_row", np.int64), ("action_row", np.int64),
            ("generation", np.int64), ("cluster", np.int32), ("worker", np.int32),
            ("attempt", np.int32), ("queue", np.int32), ("group", np.int64),
            ("index", np.int32), ("first_enqueued_ns", np.int64),
            ("attempt_enqueued_ns", np.int64), ("wait_code", np.uint8))


@dataclass(frozen=True)
class Assignment:
    """A decision of the tick, pushed to ``worker``: run ``action`` (kind ``run``) or clean
    up one of its attempts (kind ``finalize``) under lease ``generation``. The worker presents
    ``token`` on every heartbeat and report; the bounds let it enforce max_queued_time (until
    running), max_runtime and the deadline."""

    action: object            # ActionId
    generation: int
    queue: str
    cluster: str
    worker: str
    kind: LeaseKind = LeaseKind.RUN
    token: bytes = b""
    attempt: int = 1
    deadline_ns: int | None = None
    queued_deadline_ns: int | None = None
    max_runtime_s: float | None = None
    input_ref: str | None = None   # a fan-out action's input reference (enqueue_fanout)
    # admission = "nodes" (docs/nodes.md): the node of each pod, as the gate placed them
    # (pod groups largest first): a hint the worker may pass on or ignore.
    nodes: tuple | None = None


class DispatchBatch:
    """Leases drained from the dispatch channel, oldest first, as columns (numpy arrays of
    one entry each): ``kind`` (LeaseKind), ``lease_row`` (the action row of a run lease, the
    finalize row of a finalize lease), ``action_row``, ``generation``, ``cluster`` (index in
    the config's clusters), ``worker`` (worker session row), ``attempt``, ``queue`` (index),
    ``group`` and ``index`` (the action's enqueue group and its place in it: its name),
    ``first_enqueued_ns``, ``attempt_enqueued_ns``, ``wait_code`` (uint8, a run lease's: the
    ``WaitCode`` that ``Engine.explain`` gave its action just before the tick that placed it,
    ``NONE`` when it joined its queue after the previous tick, so no tick held it; ``NONE``
    for a finalize lease and for a lease the shard decided before its last load), and
    ``tokens`` (n x 3 uint64, the 24-byte tokens back to back: ``tokens.tobytes()`` is the
    frame). Entries whose lease ended before the drain are not in it. ``nodes``: entry ->
    the node names of its pods (run leases on a cluster with admission = "nodes"; the node
    hint, docs/nodes.md), empty when there are none."""

    __slots__ = (*(name for name, _ in _COLUMNS), "tokens", "nodes", "_groups", "_clusters",
                 "_workers", "_queues")

    def __init__(self, columns, groups, clusters, workers, queues, nodes=None):
        for name, values in columns.items():
            setattr(self, name, values)
        self.nodes = nodes or {}
        self._groups = groups        # group id -> EnqueueGroup (those of this batch)
        self._clusters = clusters
        self._workers = workers
        self._queues = queues

    def __len__(self):
        return int(self.kind.shape[0])

    def action(self, i):
        """The ActionId of entry ``i``."""
        return self._groups[int(self.group[i])].action_id(int(self.index[i]))

    def worker_id(self, i):
        """The worker id entry ``i`` goes to."""
        return self._workers[int(self.worker[i])]

    def token(self, i):
        """The 24-byte token of entry ``i``."""
        return self.tokens[i].astype("<u8").tobytes()

    def group_of(self, i):
        """The :class:`~engine._groups.EnqueueGroup` of entry ``i`` (its spec and names)."""
        return self._groups[int(self.group[i])]

    def assignment(self, i):
        """Entry ``i`` as an :class:`Assignment`."""
        g = self._groups[int(self.group[i])]
        gi = int(self.index[i])
        kind = LeaseKind(int(self.kind[i]))
        common = dict(action=g.action_id(gi), generation=int(self.generation[i]),
                      queue=self._queues[int(self.queue[i])],
                      cluster=self._clusters[int(self.cluster[i])],
                      worker=self._workers[int(self.worker[i])], kind=kind,
                      token=self.token(i), attempt=int(self.attempt[i]))
        if kind == LeaseKind.FINALIZE:
            return Assignment(**common)
        t = g.compiled.spec.timeouts
        return Assignment(
            **common,
            deadline_ns=(int(self.first_enqueued_ns[i]) + int(t.deadline * 1e9)
                         if t.deadline is not None else None),
            queued_deadline_ns=(int(self.attempt_enqueued_ns[i]) + int(t.max_queued_time * 1e9)
                                if t.max_queued_time is not None else None),
            max_runtime_s=t.max_runtime, input_ref=g.input_ref(gi), nodes=self.nodes.get(i))

    def assignments(self):
        """Every entry as an :class:`Assignment`, in order."""
        return [self.assignment(i) for i in range(len(self))]

    @staticmethod
    def empty_columns():
        """The columns of an empty batch (shared, read-only: nothing can be written to a
        column of no entries anyway)."""
        return dict(_EMPTY)

    @staticmethod
    def new_columns(n):
        """Uninitialised columns for ``n`` entries (each its own array)."""
        cols = {name: np.empty(n, dtype) for name, dtype in _COLUMNS}
        cols["tokens"] = np.empty((n, 3), np.uint64)
        return cols


_EMPTY = DispatchBatch.new_columns(0)
for _col in _EMPTY.values():
    _col.flags.writeable = False
