"""ETA projection (issue 14, item 6): a predicted start for every queued action, for
``explain`` and ``queue_metrics``.

The projection itself is :class:`cext._eta.EtaProjector` (docs/architecture.md, "ETA
projection"); this mixin sizes its arrays, runs it on demand (never in the tick) and keeps
the last answer while nothing it reads has changed, so explaining many actions of one state
projects once.

A part of :class:`engine.Engine` (a mixin over its shared state); see engine/_engine.py."""

from dataclasses import dataclass

import numpy as np

from cext._eta import EtaProjector, EtaWhy
from engine._rows import ST_QUEUED
from engine._state import NEVER

__all__ = ["ETA_WHY", "Projected", "ProjectionMixin"]

# Why a queued action has no projected start (EtaWhy), worded for explain.
ETA_WHY = {
    EtaWhy.ETA_KNOWN: "",
    EtaWhy.ETA_PAUSED: "its queue is paused: it starts only once resumed",
    EtaWhy.ETA_NO_WORKER: "no cluster its queue may use has a connected worker",
    EtaWhy.ETA_UNKNOWN_END: ("what it needs is held by a lease or an action ahead of it "
                             "with no predicted runtime (no estimate, max_runtime or history)"),
    EtaWhy.ETA_BEHIND: "an action ahead of it in its STRICT_FIFO queue has no ETA",
    EtaWhy.ETA_NEVER_FITS: "no cluster its queue may use can ever hold it",
    EtaWhy.ETA_POOL: "it waits for a slot of its warm pool, which is not projected",
    EtaWhy.ETA_NOT_QUEUED: "not queued",
    EtaWhy.ETA_HORIZON: ("the projection stops after the first engine.eta_horizon queued "
                         "actions in the tick's order; it is further back"),
}


@dataclass(frozen=True)
class Projected:
    """One queued action's projected start: ``eta_ns`` on the engine's clock (None when
    unknown) and, when None, ``why`` (else "")."""

    eta_ns: int | None
    why: str


# (demand class, cluster) pairs the projector keeps search bounds for (the most common
# demand vectors; 65 slots of 4 or 8 bytes each: ~12 MB at most); actions of other demands
# are searched from scratch.
MAX_CLASS_SLOTS = 16384


class ProjectionMixin:
    """ETA projection (a part of Engine)."""

    def projected_start(self, action):
        """The projected start of queued ``action`` (:class:`Projected`): the earliest time
        its demand fits a cluster it may use, after what runs ends as predicted and what is
        ahead of it in the tick's order has started (docs/architecture.md, "ETA
        projection"); None with why when unknown. Raises NotFound for an unknown action and
        ValueError for one that is not queued."""
        row, ret = self._row_or_retained(action)
        if ret is not None or self._state.a_state[row] != ST_QUEUED:
            raise ValueError(f"action {action} is not queued")
        return self._projected_row(row)

    def projection(self):
        """The queued actions' projected starts in the order the projection walked them
        (the tick's order): ``(action ids, eta_ns (int64, -1 unknown), queue names)``, three
        equal-length lists (for simulations and benches; ``explain`` gives one). Those it
        did not reach are not listed: past ``engine.eta_horizon``, or behind a STRICT_FIFO
        action with no ETA (``explain`` says which)."""
        eta, order, _ = self._project()
        rows = order.tolist()
        e = np.where(eta[order] == NEVER, -1, eta[order]).tolist()
        qs = self._state.a_queue[order].tolist()
        return ([str(self._aid(r)) for r in rows], e, [self._queue_names[q] for q in qs])

    def _projected_row(self, row):
        eta, _order, _ = self._project()
        t = int(eta[row])
        return Projected(None if t == NEVER else t,
                         ETA_WHY[self._eta_projector.why_of(self._kernel, row)])

    def _queue_projection(self, q):
        """Per queue ``q``: how many queued actions have an ETA, and the projected starts
        (ns) at the 50th and 90th percentiles of the queue's order and of its last action
        (None when that action has none): when the queue's backlog is predicted to have
        started."""
        eta, order, qcol = self._project()
        # The queue's actions the walk reached, in its order; those it did not (past the
        # horizon, or behind an action with no ETA) come after them and have no ETA.
        t = eta[order[qcol == q]]
        n = int(self._state.q_pending[q])
        out = {"queued": n, "with_eta": int(np.count_nonzero(t != NEVER)), "p50_ns": None,
               "p90_ns": None, "last_ns": None}
        for key, frac in (("p50_ns", 0.5), ("p90_ns", 0.9), ("last_ns", 1.0)):
            # The action at that share of the queue's order (nearest rank).
            i = int(np.ceil(frac * n)) - 1
            if 0 <= i < t.size and t[i] != NEVER:
                out[key] = int(t[i])
        return out

    def _project(self):
        """``(eta, order, queue of each ordered row)`` from the projector, re-run only
        when what it reads may have changed (the tick, the clock, queue depths, releases,
        workers and their reports, pauses)."""
        st, k = self._state, self._kernel
        now = self.clock.now_ns()
        key = (k.tick_no, now, k.d_tail, self._next_row, st.q_pending.tobytes(),
               st.q_rel.tobytes(), st.q_paused.tobytes(), st.c_obs.tobytes(),
               st.c_rel.tobytes(), st.w_connected.tobytes(), st.w_paused.tobytes(),
               st.t_pred_rt.tobytes(), st.a_state.shape[0])
        cached = getattr(self, "_eta_cache", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        p = self._run_projector(now)
        order = np.array(p.order[:p.n_order], dtype=np.int32)
        got = (np.asarray(p.eta), order, st.a_queue[order])
        self._eta_cache = (key, got)
        return got

    def _run_projector(self, now, classes=True):
        """Run the projector at ``now`` and return it. Demand classes (actions with equal
        demand vectors share one) let it skip, per class, what is already too full; the
        projector assigns them as it meets them, at most ``MAX_CLASS_SLOTS / C``
        (``classes=False``: none, every search from scratch; the same answers, slower).
        Nothing here reads the whole table: a deep backlog costs the walk of its first
        ``engine.eta_horizon`` actions, not a pass over every queued one or every row."""
        p = self._projector()
        ptr, seg, t, vec, table = self._eta_classes
        if not classes:
            ptr, seg, t, vec, table = ptr[:0], seg[:0], t[:0], vec[:0], table[:0]
        p.project(self._kernel, now, ptr, seg, t, vec, table, self.config.engine.eta_horizon)
        return p

    def _projector(self):
        # Arrays sized to the action table and grown with it (allocation here, never in
        # the projection): the timeline holds C + 2 x rows segments (each cluster's first,
        # one per live lease, two per reservation).
        st = self._state
        rows = int(st.a_state.shape[0])
        lanes = int(st.ln_head.shape[0])
        p = getattr(self, "_eta_projector", None)
        if p is not None and self._eta_dims == (rows, lanes):
            return p
        c, r = len(self._clusters), len(self._resources)
        segs = c + 2 * rows
        p = EtaProjector()
        p.bind(r, np.zeros(segs, np.int64), np.zeros(segs, np.int32),
               np.zeros((segs, r), np.int64), np.zeros(max(1, c), np.int32),
               np.zeros(max(1, c), np.int64), np.zeros(max(1, c), np.int64),
               np.zeros(rows, np.int64), np.zeros(rows, np.int32),
               np.zeros(2 * lanes, np.int32), np.zeros(lanes, np.int32),
               np.zeros(rows, np.int64), np.zeros(rows, np.uint8), np.zeros(rows, np.int32),
               np.zeros(max(1, c), np.int32), np.zeros(int(st.q_pending.shape[0]), np.uint8))
        # The demand classes' scratch (bounded: K x C x 65 slots of 4 or 8 bytes, ~12 MB at
        # most; each class's part is set when the projector assigns it).
        k = max(1, MAX_CLASS_SLOTS // max(1, c))
        self._eta_classes = (np.empty(k * max(1, c), np.int32),
                             np.empty(k * max(1, c) * 64, np.int32),
                             np.empty(k * max(1, c) * 64, np.int64),
                             np.empty(k * r, np.int64),
                             np.empty(1 << (2 * k - 1).bit_length(), np.int32))
        self._eta_projector, self._eta_dims = p, (rows, lanes)
        return p
