"""The in-process engine: one shard's decision core over numpy arrays and the Cython tick.

Everything later (storage, transport, supervisor) wraps this class; none of it reimplements
scheduling. Python keeps the edges (names to rows, specs, history); the arrays and the tick
keep the decision state. Time comes from an injectable clock.
"""

from dataclasses import dataclass, field

import numpy as np

from cext import TickKernel
from engine._clock import SystemClock
from engine._codes import RESOURCE_WAITS, TERMINAL_PHASES, Phase, RowState, WaitCode
from engine._config import STRICT_FIFO, Config, load_config, update_queue
from engine._errors import NotFound, ResourceExhausted, SpecError
from engine._model import ActionId, compile_spec
from engine._state import State
from engine._units import format_quantity

__all__ = ["Engine", "Assignment", "Explanation", "AlreadyExists"]


class AlreadyExists(SpecError):
    """An action with this id exists with a different spec; nothing was stored."""

    code = "ALREADY_EXISTS"


@dataclass(frozen=True)
class Assignment:
    """A decision of the tick: run ``action`` (lease ``generation``) on ``worker``."""

    action: ActionId
    generation: int
    queue: str
    cluster: str
    worker: str


@dataclass(frozen=True)
class Explanation:
    """What an action is doing, and if it waits, what for."""

    action: ActionId
    phase: Phase
    wait: WaitCode | None
    reason: str


@dataclass
class _Action:
    """Python-side record of one action (the edges: spec, names, outcome)."""

    compiled: object
    row: int
    phase: Phase = Phase.QUEUED
    message: str = ""
    error_kind: str | None = None
    cause: str | None = None
    attempts: int = 0
    history: list = field(default_factory=list)


class Engine:
    """One shard's scheduling engine.

    ``config`` is a :class:`~engine._config.Config` or a path to a TOML file; ``clock`` any
    object with ``now_ns()`` (default: wall clock).
    """

    def __init__(self, config, *, clock=None):
        if not isinstance(config, Config):
            config = load_config(config)
        self.config = config
        self.clock = clock or SystemClock()
        res = config.resources
        settings = config.engine
        self._resources = res
        self._clusters = [c.name for c in config.clusters]
        self._cluster_index = {n: i for i, n in enumerate(self._clusters)}
        self._queues = {q.name: q for q in config.queues}
        self._queue_names = [q.name for q in config.queues]
        self._queue_index = {n: i for i, n in enumerate(self._queue_names)}
        self._state = st = State(
            n_res=len(res), n_clusters=len(self._clusters), n_queues=len(self._queue_names),
            initial_rows=settings.initial_capacity,
            dispatch_capacity=settings.dispatch_capacity,
            max_candidates=settings.max_candidates,
            gate_on=settings.resource_gate == "enforce",
            cpu_dim=res.cpu_index, res_accel=res.accelerator_mask,
        )
        for i, cluster in enumerate(config.clusters):
            if cluster.capacity is not None:
                st.c_cap[i] = cluster.capacity
        # Per cluster: node shapes as a [S, R] matrix (None = shapes unknown, every pod fits).
        self._shapes = [
            np.stack([s.allocatable for s in c.node_shapes]) if c.node_shapes else None
            for c in config.clusters
        ]
        for q in config.queues:
            self._apply_queue(q)
        self._actions = {}          # ActionId -> _Action
        self._row_action = {}       # row -> ActionId
        self._runs = {}             # run key -> run row
        self._qruns = {}            # (queue row, run row) -> qrun row
        self._envs = {}             # env key -> env row
        self._workers = {}          # worker id -> worker row
        self._worker_names = []     # worker row -> id
        self._fit_cache = {}        # pod matrix bytes -> cluster bitmask
        self._next_row = 0
        self._kernel = TickKernel()
        self._kernel.bind(st)

    # ------------------------------------------------------------------ queues

    def _apply_queue(self, q):
        st = self._state
        i = self._queue_index[q.name]
        st.q_strict[i] = q.scheduling == STRICT_FIFO
        st.q_action_cap[i] = q.action_concurrency
        st.q_run_cap[i] = q.run_concurrency
        st.q_max[i] = q.max_resources
        mask = 0
        for name in q.clusters:
            mask |= 1 << self._cluster_index[name]
        st.q_clusters[i] = mask
        self._queues[q.name] = q
        # Priority descending; equal priorities keep config order.
        order = sorted(range(len(self._queue_names)),
                       key=lambda k: (-self._queues[self._queue_names[k]].priority, k))
        st.q_order[:] = order

    def update_queue(self, name, **changes):
        """Change a queue live (same keys as its config table). In-flight work is untouched;
        the new limits gate the next admission. Returns the new queue config."""
        if name not in self._queues:
            raise NotFound(f"queue {name!r} does not exist")
        new = update_queue(self._queues[name], changes, self.config)
        self._apply_queue(new)
        return new

    # ------------------------------------------------------------------ workers

    def register_worker(self, worker_id, cluster, slots):
        """Connect a worker of ``cluster`` offering ``slots`` lease slots (reconnect: same id)."""
        if not isinstance(worker_id, str) or not worker_id:
            raise SpecError(f"worker id must be a non-empty string, not {worker_id!r}")
        if cluster not in self._cluster_index:
            raise NotFound(f"worker {worker_id}: cluster {cluster!r} is not configured "
                           f"(clusters: {', '.join(self._clusters)})")
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise SpecError(f"worker {worker_id}: slots {slots!r} must be an integer >= 1")
        st = self._state
        c = self._cluster_index[cluster]
        row = self._workers.get(worker_id)
        if row is None:
            row = len(self._worker_names)
            if st.ensure("workers", row + 1):
                self._kernel.bind(st)
            self._workers[worker_id] = row
            self._worker_names.append(worker_id)
            st.n_workers = row + 1
            self._kernel.set_counts(st.n_workers, st.n_envs)
        elif st.w_cluster[row] != c:
            raise SpecError(f"worker {worker_id} is registered in cluster "
                            f"{self._clusters[st.w_cluster[row]]}, not {cluster}")
        st.w_cluster[row] = c
        st.w_slots[row] = slots
        st.w_connected[row] = 1

    def unregister_worker(self, worker_id):
        """Disconnect a worker: nothing new is placed on it. Its leases stay in flight until
        they are reported or expire; returns their action ids."""
        row = self._worker_row(worker_id)
        st = self._state
        st.w_connected[row] = 0
        held = np.nonzero((st.a_worker == row) & ((st.a_state == RowState.SENT)
                                                  | (st.a_state == RowState.RUNNING)))[0]
        return [self._row_action[int(a)] for a in held]

    def _worker_row(self, worker_id):
        try:
            return self._workers[worker_id]
        except KeyError:
            raise NotFound(f"worker {worker_id!r} is not registered") from None

    # ------------------------------------------------------------------ enqueue

    def enqueue(self, spec):
        """Enqueue one action; returns its ``ActionId``. See :meth:`enqueue_many`."""
        return self.enqueue_many([spec])[0]

    def enqueue_many(self, specs):
        """Enqueue a batch atomically: every spec is checked first, and if any is bad (or a
        queue would pass its depth) nothing is stored. Re-enqueueing an existing id with the
        same spec is a no-op (clients may retry); with another spec it is ``AlreadyExists``.
        """
        cfg = self.config
        compiled, ids, seen, per_queue = [], [], set(), {}
        for i, spec in enumerate(specs):
            try:
                c = compile_spec(spec, self._resources, self._queues, cfg.engine.default_queue)
            except SpecError as exc:
                raise type(exc)(f"batch item {i}: {exc}") if len(specs) > 1 else exc from None
            existing = self._actions.get(c.id)
            if existing is not None:
                if existing.compiled.spec != c.spec:
                    raise AlreadyExists(f"action {c.id} exists with a different spec")
                ids.append(c.id)
                continue
            if c.id in seen:
                raise SpecError(f"batch item {i}: action {c.id} appears twice in the batch")
            if c.parent is not None and c.parent not in self._actions and c.parent not in seen:
                raise SpecError(f"batch item {i}: action {c.id}: parent {c.parent} not found")
            run = self._runs.get(c.id.run_key)
            mac = c.spec.run_max_action_concurrency
            if run is not None and mac and self._state.u_cap[run] != mac:
                raise SpecError(f"action {c.id}: run {c.id.run_key} already has "
                                f"max_action_concurrency {self._state.u_cap[run]}")
            seen.add(c.id)
            per_queue[c.queue] = per_queue.get(c.queue, 0) + 1
            compiled.append(c)
            ids.append(c.id)
        for qname, n in per_queue.items():
            q = self._queue_index[qname]
            depth = self._queues[qname].depth
            if self._state.q_pending[q] + n > depth:
                raise ResourceExhausted(
                    f"queue {qname}: depth {depth} reached ({self._state.q_pending[q]} queued, "
                    f"{n} more asked); nothing was enqueued")
        now = self.clock.now_ns()
        rows = [self._store(c, now) for c in compiled]
        if rows:
            self._kernel.push_many(np.asarray(rows, dtype=np.int32))
        return ids

    def _store(self, c, now):
        st = self._state
        row = self._next_row
        if st.ensure("actions", row + 1):
            self._kernel.bind(st)
        self._next_row += 1
        q = self._queue_index[c.queue]
        u = self._run_row(c)
        qr = self._qrun_row(q, u)
        env = self._env_row(c, q) if c.env_key is not None else -1
        fast = env >= 0 and st.e_cluster[env] >= 0
        st.a_queue[row] = q
        st.a_run[row] = u
        st.a_qrun[row] = qr
        st.a_lane[row] = 2 * qr + int(fast)
        st.a_env[row] = env
        st.a_fit[row] = self._fit_mask(c)
        st.a_demand[row] = c.demand
        st.a_gen[row] = 0
        st.a_released_gen[row] = 0
        st.a_enqueued[row] = now
        self._actions[c.id] = _Action(compiled=c, row=row)
        self._row_action[row] = c.id
        return row

    def _run_row(self, c):
        st = self._state
        row = self._runs.get(c.id.run_key)
        if row is None:
            row = len(self._runs)
            if st.ensure("runs", row + 1):
                self._kernel.bind(st)
            self._runs[c.id.run_key] = row
            st.u_cap[row] = c.spec.run_max_action_concurrency
        return row

    def _qrun_row(self, q, u):
        st = self._state
        row = self._qruns.get((q, u))
        if row is None:
            row = len(self._qruns)
            if st.ensure("qruns", row + 1):
                self._kernel.bind(st)
            self._qruns[(q, u)] = row
            st.qr_queue[row] = q
            st.qr_run[row] = u
        return row

    def _env_row(self, c, q):
        st = self._state
        row = self._envs.get(c.env_key)
        if row is None:
            row = len(self._envs)
            if st.ensure("envs", row + 1):
                self._kernel.bind(st)
            self._envs[c.env_key] = row
            st.e_queue[row] = q
            st.e_slots[row] = c.env_slots
            st.e_idle_ttl[row] = c.env_idle_ttl_ns
            st.e_footprint[row] = c.demand
            st.n_envs = row + 1
            self._kernel.set_counts(st.n_workers, st.n_envs)
        return row

    def _fit_mask(self, c):
        # Clusters that could ever hold it: total within capacity, every pod on some shape.
        key = (c.pods.tobytes(), c.pod_counts.tobytes(), c.demand.tobytes())
        mask = self._fit_cache.get(key)
        if mask is None:
            mask = 0
            for i, _name in enumerate(self._clusters):
                if self._never_fits(c, i) is None:
                    mask |= 1 << i
            self._fit_cache[key] = mask
        return mask

    def _never_fits(self, c, i):
        """Why action ``c`` can never run on cluster ``i`` (None if it could)."""
        res = self._resources
        cap = self._state.c_cap[i]
        short = np.nonzero(c.demand > cap)[0]
        if short.size:
            r = int(short[0])
            name = res.names[r]
            return (f"cluster {self._clusters[i]} has {format_quantity(name, int(cap[r]))} "
                    f"{name} in all, it needs {format_quantity(name, int(c.demand[r]))}")
        shapes = self._shapes[i]
        if shapes is None:
            return None
        for p in range(c.pods.shape[0]):
            if not (c.pods[p] <= shapes).all(axis=1).any():
                role = c.spec.pods[p].role if c.spec.pods else "pod"
                return (f"{role} ({res.describe(c.pods[p])}) fits no node shape of cluster "
                        f"{self._clusters[i]}")
        return None

    # ------------------------------------------------------------------ the tick

    def schedule(self):
        """Run one tick now. Assignments wait in the dispatch channel (:meth:`drain_dispatch`);
        actions that can never fit end as FAILED (SYSTEM, UNSCHEDULABLE). Returns the number
        of assignments made."""
        now = self.clock.now_ns()
        kernel = self._kernel
        placed = kernel.run(now)
        st = self._state
        for i in range(kernel.f_count):
            self._fail_unschedulable(int(st.f_action[i]), WaitCode(int(st.f_code[i])))
        return placed

    def drain_dispatch(self, limit=None):
        """Take assignments out of the dispatch channel, oldest first."""
        k, st = self._kernel, self._state
        n = k.d_tail - k.d_head
        if limit is not None:
            n = min(n, limit)
        cap = st.d_action.shape[0]
        out = []
        for j in range(k.d_head, k.d_head + n):
            slot = j % cap
            aid = self._row_action[int(st.d_action[slot])]
            rec = self._actions[aid]
            rec.phase = Phase.INITIALIZING
            rec.attempts += 1
            out.append(Assignment(
                action=aid, generation=int(st.d_gen[slot]),
                queue=rec.compiled.queue,
                cluster=self._clusters[st.d_cluster[slot]],
                worker=self._worker_names[st.d_worker[slot]],
            ))
        k.consume_dispatch(n)
        return out

    def tick(self):
        """Schedule once and return the assignments made (the in-process dispatcher)."""
        self.schedule()
        return self.drain_dispatch()

    def _fail_unschedulable(self, row, code):
        aid = self._row_action[row]
        rec = self._actions[aid]
        c = rec.compiled
        qname = c.queue
        if code == WaitCode.UNSCHEDULABLE_CAP:
            q = self._queues[qname]
            dim = int(self._state.a_wait_dim[row])
            name = self._resources.names[dim]
            cap = format_quantity(name, int(q.max_resources[dim]))
            why = (f"needs {name}={format_quantity(name, int(c.demand[dim]))}, more than "
                   f"queue {qname}'s max {name}={cap}")
        else:
            allowed = [self._cluster_index[n] for n in self._queues[qname].clusters]
            why = "; ".join(self._never_fits(c, i) or f"cluster {self._clusters[i]}: ?"
                            for i in allowed) or f"queue {qname} allows no cluster"
        self._finish(row, Phase.FAILED, f"UNSCHEDULABLE: {why}", kind="SYSTEM",
                     cause="UNSCHEDULABLE")

    def _finish(self, row, phase, message, kind=None, cause=None):
        st = self._state
        aid = self._row_action[row]
        rec = self._actions[aid]
        if st.a_state[row] == RowState.QUEUED:
            self._kernel.remove(row)
        self._kernel.release(row, self.clock.now_ns())
        st.a_state[row] = RowState.DONE
        rec.phase = phase
        rec.message = message
        rec.error_kind = kind
        rec.cause = cause

    # ------------------------------------------------------------------ reports

    def _current(self, action, generation):
        aid = ActionId.parse(action)
        rec = self._actions.get(aid)
        if rec is None:
            raise NotFound(f"action {aid} not found")
        st = self._state
        row = rec.row
        if st.a_state[row] not in (RowState.SENT, RowState.RUNNING):
            raise SpecError(f"action {aid} is not assigned (phase {rec.phase})")
        if int(st.a_gen[row]) != generation:
            raise SpecError(f"action {aid}: generation {generation} is stale "
                            f"(current {int(st.a_gen[row])})")
        return rec

    def mark_running(self, action, generation):
        """The holder of ``generation`` reports the action running."""
        rec = self._current(action, generation)
        self._state.a_state[rec.row] = RowState.RUNNING
        rec.phase = Phase.RUNNING

    def complete(self, action, generation, phase=Phase.SUCCEEDED, message=""):
        """The holder of ``generation`` reports a terminal phase; its in-flight counts are
        released exactly once."""
        phase = Phase(phase)
        if phase not in TERMINAL_PHASES:
            raise SpecError(f"{phase} is not a terminal phase")
        rec = self._current(action, generation)
        self._finish(rec.row, phase, message)

    # ------------------------------------------------------------------ queries

    def phase(self, action):
        """The action's phase."""
        return self.explain(action).phase

    def explain(self, action):
        """The action's phase and, while it waits, the reason (code and message)."""
        aid = ActionId.parse(action)
        rec = self._actions.get(aid)
        if rec is None:
            raise NotFound(f"action {aid} not found")
        st = self._state
        row = rec.row
        if st.a_state[row] != RowState.QUEUED:
            return Explanation(aid, rec.phase, None, rec.message)
        q = int(st.a_queue[row])
        if int(st.a_wait_tick[row]) == self._kernel.tick_no:
            code = WaitCode(int(st.a_wait_code[row]))
            reason = self._reason(row, code, int(st.a_wait_cluster[row]),
                                  int(st.a_wait_dim[row]), int(st.a_wait_blocker[row]))
        else:
            code = WaitCode(int(st.q_stop_code[q]))
            reason = self._reason(row, code, -1, -1, int(st.q_stop_blocker[q]))
        phase = Phase.WAITING_FOR_RESOURCES if code in RESOURCE_WAITS else Phase.QUEUED
        return Explanation(aid, phase, code, reason)

    def _reason(self, row, code, cluster, dim, blocker):
        st = self._state
        res = self._resources
        q = int(st.a_queue[row])
        qname = self._queue_names[q]
        queue = self._queues[qname]
        if code == WaitCode.NONE:
            return f"queue {qname}: queued, not examined by a tick yet"
        if code == WaitCode.QUEUE_ACTIONS:
            return f"queue {qname}: action_concurrency {queue.action_concurrency} reached"
        if code == WaitCode.QUEUE_RUNS:
            return (f"queue {qname}: run_concurrency {queue.run_concurrency} reached "
                    f"({int(st.q_runs_adm[q] - st.q_runs_rel[q])} runs in flight)")
        if code == WaitCode.RUN_ACTIONS:
            u = int(st.a_run[row])
            return (f"run {self._row_action[row].run_key}: max_action_concurrency "
                    f"{int(st.u_cap[u])} reached")
        if code == WaitCode.QUEUE_BUDGET:
            name = res.names[dim]
            used = int(st.q_res_adm[q, dim] - st.q_res_rel[q, dim])
            return (f"queue {qname}: max_resources reached (needs {name}="
                    f"{format_quantity(name, int(st.a_demand[row, dim]))}; "
                    f"{format_quantity(name, used)} of "
                    f"{format_quantity(name, int(queue.max_resources[dim]))} in flight)")
        if code == WaitCode.CLUSTER_CAPACITY:
            return f"queue {qname}: waiting for capacity ({self._need(row, cluster, dim)})"
        if code in (WaitCode.HEAD_OF_LINE, WaitCode.HEAD_BUDGET):
            if blocker < 0:
                return f"queue {qname}: head-of-line blocked"
            b = self._row_action[blocker]
            btask = self._actions[b].compiled.spec.task
            if code == WaitCode.HEAD_BUDGET:
                bdim = int(st.a_wait_dim[blocker])
                name = res.names[bdim]
                need = f"{name}={format_quantity(name, int(st.a_demand[blocker, bdim]))}"
                return (f"queue {qname}: head-of-line blocked by {b.run}/{btask} "
                        f"(needs {need} of the queue budget)")
            bdim = self._short_dim(blocker, cluster)
            return (f"queue {qname}: head-of-line blocked by {b.run}/{btask} "
                    f"({self._need(blocker, cluster, bdim)})")
        if code == WaitCode.NO_WORKER:
            names = ", ".join(self._queues[qname].clusters)
            return f"queue {qname}: no connected worker with a free slot on {names}"
        if code == WaitCode.POOL_BUSY:
            e = int(st.a_env[row])
            return (f"queue {qname}: warm pool {self._row_action[row].run}/"
                    f"{self._actions[self._row_action[row]].compiled.spec.environment} on "
                    f"{self._clusters[cluster]} has all {int(st.e_slots[e])} slots busy")
        if code == WaitCode.DISPATCH_FULL:
            return (f"queue {qname}: dispatch channel full "
                    f"({st.d_action.shape[0]} waiting); retried next tick")
        if code == WaitCode.CANDIDATE_LIMIT:
            return (f"queue {qname}: not reached this tick (max_candidates "
                    f"{self.config.engine.max_candidates} examined first)")
        if code == WaitCode.PLACED:
            return f"queue {qname}: placed"
        return f"queue {qname}: {code.name}"

    def _short_dim(self, row, cluster):
        st = self._state
        free = st.c_cap[cluster] - (st.c_adm[cluster] - st.c_rel[cluster]).astype(np.int64)
        short = np.nonzero(st.a_demand[row] > free)[0]
        return int(short[0]) if short.size else -1

    def _need(self, row, cluster, dim):
        st = self._state
        res = self._resources
        if cluster < 0 or dim < 0:
            return f"needs {res.describe(st.a_demand[row])}"
        name = res.names[dim]
        free = int(st.c_cap[cluster, dim]) - int(st.c_adm[cluster, dim] - st.c_rel[cluster, dim])
        return (f"needs {name}={format_quantity(name, int(st.a_demand[row, dim]))}; "
                f"cluster {self._clusters[cluster]} has {format_quantity(name, free)} free")

    def queue_metrics(self, name=None):
        """Per queue: runs and actions in flight, in-flight resources, depth and head_blocked
        (since, action, reason, demand) or None. One queue when ``name`` is given."""
        st = self._state
        names = [name] if name is not None else self._queue_names
        out = {}
        for qname in names:
            if qname not in self._queue_index:
                raise NotFound(f"queue {qname!r} does not exist")
            q = self._queue_index[qname]
            inflight = (st.q_res_adm[q] - st.q_res_rel[q]).astype(np.int64)
            head = int(st.q_head[q])
            blocked = None
            if head >= 0 and st.a_state[head] == RowState.QUEUED:
                exp = self.explain(self._row_action[head])
                blocked = {
                    "since_ns": int(st.q_head_since[q]),
                    "action": str(self._row_action[head]),
                    "reason": exp.reason,
                    "code": exp.wait.name if exp.wait is not None else None,
                    "demand": self._resources.describe(st.a_demand[head]),
                }
            out[qname] = {
                "runs_in_flight": int(st.q_runs_adm[q] - st.q_runs_rel[q]),
                "actions_in_flight": int(st.q_adm[q] - st.q_rel[q]),
                "in_flight_resources": {
                    n: int(v) for n, v in zip(self._resources.names, inflight, strict=True)
                },
                "depth": int(st.q_pending[q]),
                "head_blocked": blocked,
            }
        return out[name] if name is not None else out

    def cluster_in_flight(self, cluster):
        """In-flight resources charged to ``cluster`` as ``{resource: amount}``."""
        if cluster not in self._cluster_index:
            raise NotFound(f"cluster {cluster!r} is not configured")
        c = self._cluster_index[cluster]
        st = self._state
        used = (st.c_adm[c] - st.c_rel[c]).astype(np.int64)
        return {n: int(v) for n, v in zip(self._resources.names, used, strict=True)}

    @property
    def resources(self):
        """The shard's :class:`~engine._units.ResourceSet`."""
        return self._resources

    @property
    def tick_count(self):
        """Ticks run so far."""
        return self._kernel.tick_no


