"""A read-only, documented view of one engine's state: for tests, benches and the metrics
reader. Nothing here changes the engine; arrays come back as read-only views, mappings and
lists as copies. ``Engine.inspect()`` returns one; it stays valid for the engine's life (it
reads the current arrays on every call, so a table growth or a reload is seen at once).

Row numbers are the engine's own (an action's row, a finalize row, a worker session row);
names of columns are the kernel's (``a_state``, ``q_adm``, ``c_cap``, ... in
:mod:`engine._state`).
"""

from dataclasses import dataclass, replace

import numpy as np

from cext._lease import validate
from engine._aborts import rows_of
from engine._codes import LeaseKind, Phase, RowState
from engine._errors import NotFound
from engine._model import ActionId
from engine._nodes import node_names
from engine._rows import ST_FREE, ST_QUEUED
from engine._units import UNLIMITED

__all__ = ["Inspection", "ActionRecord", "DispatchEntry", "PendingTimer"]


@dataclass(frozen=True)
class ActionRecord:
    """The Python edges of one action row: its id, outcome and attempt history (copies)."""

    row: int
    action: object            # ActionId
    phase: Phase
    message: str
    error_kind: str | None
    cause: str | None
    attempts: tuple           # Attempt copies, oldest first
    user_retries: int
    system_retries: int
    spec: object              # the ActionSpec as stored


@dataclass(frozen=True)
class DispatchEntry:
    """One decision waiting in the dispatch channel (not handed out yet)."""

    kind: LeaseKind
    row: int                  # action row (run) or finalize row (finalize)
    generation: int
    cluster: int
    worker: str


@dataclass(frozen=True)
class PendingTimer:
    """A timer that has not fired yet (it may find its row moved on when it does)."""

    due_ns: int
    kind: int                 # engine._codes.T_*
    row: int
    ref: int


class _ReadOnlyArrays:
    """Attribute access to the shard's arrays, each a read-only view."""

    __slots__ = ("_state",)

    def __init__(self, state):
        object.__setattr__(self, "_state", state)

    def __getattr__(self, name):
        value = getattr(object.__getattribute__(self, "_state"), name)
        if isinstance(value, np.ndarray):
            view = value.view()
            view.flags.writeable = False
            return view
        if isinstance(value, (dict, list, set)):
            raise AttributeError(f"{name} is not an array")
        return value

    def __setattr__(self, name, value):
        raise AttributeError(f"inspection is read-only: cannot set {name}")

    def names(self):
        """Names of every array of the shard."""
        st = object.__getattribute__(self, "_state")
        return sorted(k for k, v in vars(st).items() if isinstance(v, np.ndarray))

    def copy(self):
        """A copy of every array, by name."""
        st = object.__getattribute__(self, "_state")
        return {k: v.copy() for k, v in vars(st).items() if isinstance(v, np.ndarray)}


class Inspection:
    """Read-only view of an :class:`~engine.Engine` (``engine.inspect()``)."""

    def __init__(self, engine):
        self._engine = engine

    # ----------------------------------------------------------------- arrays and sizes

    @property
    def arrays(self):
        """The decision arrays by kernel name (read-only views; tables at their allocated
        size: rows past :attr:`action_rows` etc. are unused)."""
        return _ReadOnlyArrays(self._engine._state)

    def table_bytes(self, table):
        """Bytes the arrays of ``table`` (``"actions"``, ``"runs"``, ...) take at their
        allocated size."""
        return self._engine._state.table_bytes(table)

    @property
    def action_rows(self):
        """The action table's high-water row: rows below it hold actions (ended or not),
        except the reclaimed ones (:attr:`free_rows`, state FREE)."""
        return self._engine._next_row

    @property
    def free_rows(self):
        """Reclaimed action rows below :attr:`action_rows` waiting for new work (state
        FREE), ascending."""
        return self._engine._free_rows.copy()

    @property
    def finalize_rows(self):
        """Finalize rows below the high-water mark: leases, and the freed ones
        (:attr:`free_finalize_rows`, state FREE)."""
        return self._engine._n_finalize

    @property
    def free_finalize_rows(self):
        """Freed finalize rows (their action's row was reclaimed), ascending: new finalize
        leases take them first."""
        return self._engine._free_fz.copy()

    def abort_rows(self):
        """The abort records held (engine/_aborts.py): ``{row an abort was called on:
        ascending rows it lists}``, the lean rows whose stored records a reload brings to
        ABORTED. A reclaimed row leaves its record at once."""
        out = {}
        for root, (_part, entries) in self._engine._abort_rows.items():
            rows = [rows_of(s, n) for _t, s, n in entries]
            out[root] = np.unique(np.concatenate(rows)) if len(rows) > 1 else rows[0]
        return out

    @property
    def worker_sessions(self):
        """Worker session rows in use (one per registration)."""
        return self._engine._state.n_workers

    @property
    def env_rows(self):
        """Environment (warm pool) rows in use."""
        return self._engine._state.n_envs

    @property
    def tick_no(self):
        """Ticks run so far (the kernel's counter)."""
        return self._engine._kernel.tick_no

    @property
    def last_kernel_ns(self):
        """Wall time of the last tick's kernel pass (the Cython tick alone, run without the
        GIL), in ns; 0 before the first tick. ``Engine.decide()`` is this plus its timers,
        expiry sweep and the encoding of what the tick decided."""
        return self._engine._kernel.last_run_ns

    @property
    def dispatch_head(self):
        """Position of the oldest undrained entry of the dispatch ring (monotonic)."""
        return self._engine._kernel.d_head

    @property
    def dispatch_tail(self):
        """Position after the newest entry of the dispatch ring (monotonic)."""
        return self._engine._kernel.d_tail

    @property
    def dispatch_capacity(self):
        """Slots of the dispatch ring."""
        return int(self._engine._state.d_action.shape[0])

    @property
    def compiled_specs(self):
        """Spec contents in the engine's cache of compiled specs (bounded: it is emptied
        when it reaches its size, engine/_admission.py)."""
        return len(self._engine._templates)

    @property
    def unschedulable_count(self):
        """Actions the last tick found can never fit (failed after the kernel)."""
        return self._engine._kernel.f_count

    @property
    def kernel(self):
        """The compiled tick (:class:`cext.TickKernel`) bound to these arrays, for kernel
        micro-benchmarks and profiles: its queries (``gate_bench``, ``cluster_free``,
        ``head_eta``, ``tick_no``) are safe; its mutators (``run``, ``push``, ``remove``,
        ...) bypass the engine's bookkeeping and durability, so call them only on an engine
        made for that measurement."""
        return self._engine._kernel

    def check_tokens(self, tokens, session, verdicts, extend=False):
        """Run the heartbeat's token pass (the nogil Cython check ``Engine.heartbeat`` uses)
        over a parsed ``(n, 3)`` uint64 token array for worker session row ``session``,
        writing each verdict into ``verdicts``; returns how many were valid. With
        ``extend`` the valid leases are extended as a heartbeat would (for benchmarks)."""
        e = self._engine
        codec = e._codec
        return validate(e._kernel, tokens, int(session), e.clock.now_ns(), codec.k0,
                        codec.k1, verdicts, bool(extend))

    # ----------------------------------------------------------------- channel and timers

    def dispatch(self):
        """The entries of the dispatch ring not drained yet, oldest first (including ones
        whose lease ended since: the drain drops those)."""
        e = self._engine
        st, k = e._state, e._kernel
        cap = st.d_action.shape[0]
        out = []
        for j in range(k.d_head, k.d_tail):
            slot = j % cap
            out.append(DispatchEntry(LeaseKind(int(st.d_kind[slot])), int(st.d_action[slot]),
                                     int(st.d_gen[slot]), int(st.d_cluster[slot]),
                                     e._worker_names[int(st.d_worker[slot])]))
        return out

    def timers(self):
        """Every timer not fired yet, by due time: set since the load and restored."""
        e = self._engine
        items = [PendingTimer(t[0], t[2], t[3], t[4]) for t in e._timers]
        for _next, _seq, due, kind, row, ref, pos in e._timer_blocks:
            items += [PendingTimer(int(due[i]), int(kind[i]), int(row[i]), int(ref[i]))
                      for i in range(pos, due.size)]
        items.sort(key=lambda t: (t.due_ns, t.kind, t.row, t.ref))
        return items

    # ----------------------------------------------------------------- nodes

    def node_names(self, cluster):
        """The node names of ``cluster`` (admission = "nodes"), by node row from its first:
        ``<shape>-<k>`` as engine/_nodes.py names them; [] for a cluster of shapes."""
        e = self._engine
        c = e.config.clusters[e._cluster_index[cluster]]
        if c.admission != "nodes":
            return []
        return node_names(c)

    def node_free(self, cluster):
        """``{node name: free vector}`` of ``cluster`` as the gate sees it now (allocatable
        minus the placed pods of its live leases, and no more than a worker last reported
        free on the node less what was placed there since); {} for a cluster of shapes."""
        e = self._engine
        st = e._state
        i = e._cluster_index[cluster]
        first = int(st.c_node_first[i])
        rows = slice(first, first + len(self.node_names(cluster)))
        free = st.n_alloc[rows] - st.n_used[rows]
        seen = st.n_obs[rows] - (st.n_adm[rows] - st.n_obs_mark[rows])
        free = np.where(st.n_obs[rows] < UNLIMITED, np.minimum(free, seen), free)
        return {name: free[k].copy() for k, name in enumerate(self.node_names(cluster))}

    def placement(self, action):
        """The node of each pod of ``action``'s live lease (names, in its pod groups' order,
        largest group first), or None when it holds no lease on a cluster with admission =
        "nodes". The same list is the node hint of the lease (docs/nodes.md)."""
        e = self._engine
        st = e._state
        row = e._row_of(action)
        c = int(st.a_cluster[row])
        live = (st.a_state[row] in (RowState.SENT, RowState.RUNNING) and st.a_charged[row]
                and st.a_released_gen[row] != st.a_gen[row])
        if not live or c < 0 or not st.c_nodes[c]:
            return None
        names = self.node_names(e._clusters[c])
        first = int(st.c_node_first[c])
        return [names[int(n) - first] for n in st.a_pnode[row] if n >= 0]

    # ----------------------------------------------------------------- rows and edges

    def find(self, action):
        """The row of ``action`` (an ActionId or its string), or None."""
        return self._engine._lookup(ActionId.parse(action))

    def row_of(self, action):
        """The row of ``action``; ``NotFound`` if it does not exist."""
        return self._engine._row_of(action)

    def record(self, row):
        """The :class:`ActionRecord` of action ``row`` (read from the store on first use
        after a load); ``NotFound`` for a reclaimed (FREE) row."""
        eng = self._engine
        row = int(row)
        if not 0 <= row < eng._next_row or eng._state.a_state[row] == ST_FREE:
            raise NotFound(f"action row {row} holds no action")
        rec = eng._rec(row)
        return ActionRecord(
            row=rec.row, action=rec.compiled.id, phase=rec.phase, message=rec.message,
            error_kind=rec.error_kind, cause=rec.cause,
            attempts=tuple(replace(a) for a in rec.attempts),
            user_retries=rec.user_retries, system_retries=rec.system_retries,
            spec=self._engine._spec_of(rec.row))

    def action_at(self, row):
        """The ActionId of action ``row``."""
        return self._engine._aid(int(row))

    def parent(self, row):
        """The parent row of action ``row``, or -1."""
        return int(self._engine._state.a_parent[row])

    def children(self, row):
        """Rows whose parent is action ``row``, ascending."""
        st = self._engine._state
        kids, kid = [], int(st.a_child[row])
        while kid >= 0:
            kids.append(kid)
            kid = int(st.a_sibling[kid])
        return sorted(kids)

    def worker_sessions_by_id(self):
        """Worker id -> its current session row."""
        return dict(self._engine._workers)

    def worker_at(self, session):
        """The worker id of session row ``session``."""
        return self._engine._worker_names[int(session)]

    def runs(self):
        """Run key -> run row, of the runs with actions in the table (a run whose actions
        were all reclaimed leaves: engine/_retain.py)."""
        return dict(self._engine._runs)

    def run_keys(self):
        """Run keys by run row (the table's high water; None: a free run row)."""
        return list(self._engine._run_keys)

    def qruns(self):
        """(queue index, run row) -> (queue, run) pair row."""
        return dict(self._engine._qruns)

    def tenants(self):
        """Tenant name -> tenant row (the ``tn_*`` columns; a run row's tenant is
        ``u_tenant``): every tenant seen since the engine (re)loaded, a copy."""
        return dict(self._engine._tenants)

    def tasks(self):
        """History keys ``(task name, shape)`` by row of the task table (``a_task``,
        ``t_pred_rt``, ``t_prior``): runtime history is per task and shape, a key without
        its own taking its shape's prior (docs/predictions.md)."""
        return list(self._engine._task_names)

    def queue_names(self):
        """Queue names by queue index (the ``q_*`` rows), a copy."""
        return list(self._engine._queue_names)

    def queue_index(self, name):
        """The index of queue ``name`` in the arrays (``q_*`` columns)."""
        return self._engine._queue_index[name]

    def queue(self, name):
        """The live config of queue ``name`` (the file's table plus live changes)."""
        return self._engine._queues[name]

    def queue_changes(self):
        """Live queue changes as persisted: queue name -> changed keys."""
        return {k: dict(v) for k, v in self._engine._queue_changes.items()}

    # ----------------------------------------------------------------- derived figures

    def cluster_free(self, cluster):
        """The gate's free vector of cluster index ``cluster`` (capacity less in flight,
        capped by what its workers report)."""
        return np.array(self._engine._kernel.cluster_free(int(cluster)), dtype=np.int64)

    def head_eta(self, row):
        """The shadow time of a blocked head ``row`` from the current state (None unknown)."""
        return self._engine._head_eta(int(row))

    def wait(self, row):
        """Why queued action ``row`` waits: ``(WaitCode, reason, eta_ns or None)``, worded as
        ``Engine.explain`` words it but without the position (a scan of every row) and
        without making the row a record; ``ValueError`` if the row is not queued."""
        e = self._engine
        row = int(row)
        if not 0 <= row < e._next_row or e._state.a_state[row] != ST_QUEUED:
            raise ValueError(f"action row {row} is not queued")
        return e._queued_wait(row)

    def project(self, classes=True):
        """Run the ETA projection now, whatever ``Engine``'s cached one says (for benches):
        ``(eta_ns per action row (int64, NEVER none), EtaWhy code per row, queued rows in
        projection order)``, copies. ``classes=False`` searches every action from scratch
        (no per-demand bounds: the same answers, slower; for tests)."""
        e = self._engine
        p = e._run_projector(e.clock.now_ns(), classes)
        e._eta_cache = None
        return (np.array(p.eta), np.frombuffer(p.why_codes(e._kernel), np.uint8),
                np.array(p.order[:p.n_order]))

    def position(self, row):
        """1-based place of queued action ``row`` among its queue's queued actions."""
        return self._engine._position(int(row))

    def live_lists(self):
        """Per cluster: the rows of its live charged leases (the backfill shadow lists)."""
        st = self._engine._state
        out = []
        for c in range(st.n_clusters):
            rows, r = [], int(st.c_live[c])
            while r >= 0:
                rows.append(r)
                r = int(st.a_lnext[r])
            out.append(rows)
        return out
