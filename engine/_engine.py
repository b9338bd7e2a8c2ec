"""The in-process engine: one shard's decision core over numpy arrays and the Cython tick.

Everything later (storage, transport, supervisor) wraps this class; none of it reimplements
scheduling. Python keeps the edges (names to rows, specs, history); the arrays and the tick
keep the decision state. Time comes from an injectable clock.
"""

import heapq
import itertools
from dataclasses import dataclass, field, replace

import numpy as np

from cext import TickKernel
from cext._lease import validate
from engine._clock import SystemClock
from engine._codes import (
    RESOURCE_WAITS,
    TERMINAL_PHASES,
    LeaseEnd,
    LeaseKind,
    Phase,
    RowState,
    Verdict,
    WaitCode,
)
from engine._config import STRICT_FIFO, Config, load_config, update_queue
from engine._errors import NotFound, ResourceExhausted, SpecError
from engine._history import RuntimeHistory
from engine._leases import Attempt, ErrorKind, TokenCodec
from engine._model import ActionId, compile_spec
from engine._state import NEVER, State
from engine._units import format_quantity

# Timer kinds (a heap of (due_ns, seq, kind, row, ref); ref detects a timer that no longer
# applies: the attempt number, or the lease generation).
T_DEADLINE, T_QUEUED, T_RETRY, T_RUNTIME, T_FINALIZE = range(5)
LIVE_STATES = (RowState.SENT, RowState.RUNNING)
BOUNDS = ("deadline", "max_queued_time", "max_runtime")

__all__ = ["Engine", "Assignment", "Explanation", "AlreadyExists", "Refusal"]


class AlreadyExists(SpecError):
    """An action with this id exists with a different spec; nothing was stored."""

    code = "ALREADY_EXISTS"


@dataclass(frozen=True)
class Assignment:
    """A decision of the tick, pushed to ``worker``: run ``action`` (kind ``run``) or clean
    up one of its attempts (kind ``finalize``) under lease ``generation``. The worker presents
    ``token`` on every heartbeat and report; the bounds let it enforce max_queued_time (until
    running), max_runtime and the deadline."""

    action: ActionId
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


@dataclass(frozen=True)
class Refusal:
    """A token the engine refused, and why (the worker stops the attempt behind it)."""

    token: bytes
    verdict: Verdict


@dataclass(frozen=True)
class Explanation:
    """What an action is doing, and if it waits, what for."""

    action: ActionId
    phase: Phase
    wait: WaitCode | None
    reason: str
    # --- backfill (issue 5) ---
    eta_ns: int | None = None     # a blocked head's shadow time (estimated start); None unknown
    position: int | None = None   # 1-based place among its queue's queued actions, by enqueue


@dataclass
class _Action:
    """Python-side record of one action (the edges: spec, names, outcome)."""

    compiled: object
    row: int
    first_enqueued_ns: int = 0
    phase: Phase = Phase.QUEUED
    message: str = ""
    error_kind: str | None = None
    cause: str | None = None
    attempts: list = field(default_factory=list)   # Attempt records, oldest first
    user_retries: int = 0
    system_retries: int = 0
    children: list = field(default_factory=list)   # ActionIds of direct children

    @property
    def attempt(self):
        return self.attempts[-1]


class Engine:
    """One shard's scheduling engine.

    ``config`` is a :class:`~engine._config.Config` or a path to a TOML file; ``clock`` any
    object with ``now_ns()`` (default: wall clock); ``secret`` the shard's 16-byte token key
    (random when not given; storage persists it so tokens survive a restart).

    Guarantees: assignment is at-most-once (only the holder of a lease's current generation
    can heartbeat or report it); execution is at-least-once (after an expiry or a partition an
    attempt may run twice, so tasks should be idempotent or carry the action name and
    generation into external writes).
    """

    def __init__(self, config, *, clock=None, secret=None):
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
            bf_max_candidates=settings.backfill_max_candidates,
        )
        # --- backfill (issue 5): runtime history per task name, predictions in t_pred_rt ---
        self.history = RuntimeHistory()
        self._tasks = {}                # task name -> task row
        self._history_dirty = set()     # tasks recorded since take_dirty_history()
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
        self._codec = TokenCodec(secret)
        self._timers = []           # heap of (due_ns, seq, kind, row, ref)
        self._seq = itertools.count()
        self._finalize = {}         # finalize row -> (ActionId, attempt number, give-up ns)
        self._next_sweep_ns = 0
        self._sweep_period_ns = int(settings.heartbeat_interval * 1e9 / 4)
        self._kernel = TickKernel()
        self._kernel.bind(st)
        self._kernel.set_lease_ttl(settings.lease_ttl_ns)

    # ------------------------------------------------------------------ queues

    def _apply_queue(self, q):
        st = self._state
        i = self._queue_index[q.name]
        st.q_strict[i] = q.scheduling == STRICT_FIFO
        st.q_priority[i] = q.priority
        st.q_action_cap[i] = q.action_concurrency
        st.q_run_cap[i] = q.run_concurrency
        st.q_max[i] = q.max_resources
        mask = 0
        for name in q.clusters:
            mask |= 1 << self._cluster_index[name]
        st.q_clusters[i] = mask
        st.q_backfill[i] = q.backfill   # backfill (issue 5)
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
        old = self._workers.get(worker_id)
        if old is not None and st.w_cluster[old] != c:
            raise SpecError(f"worker {worker_id} is registered in cluster "
                            f"{self._clusters[st.w_cluster[old]]}, not {cluster}")
        # Every connection is a new session row: leases of an earlier session are refused
        # as stale when the worker presents them again, and expire.
        row = len(self._worker_names)
        if st.ensure("workers", row + 1):
            self._kernel.bind(st)
        if old is not None:
            st.w_connected[old] = 0
            st.w_ident[row] = st.w_ident[old]
        else:
            st.w_ident[row] = len(self._workers)
        self._workers[worker_id] = row
        self._worker_names.append(worker_id)
        st.n_workers = row + 1
        self._kernel.set_counts(st.n_workers, st.n_envs)
        st.w_cluster[row] = c
        st.w_slots[row] = slots
        st.w_connected[row] = 1
        if old is not None:
            self._end_session(old)

    def _end_session(self, old):
        # A new session proves the old one is gone: its leases expire now (the tokens it
        # still presents are refused on heartbeat and report alike) and are reassigned.
        st = self._state
        n, nf = self._next_row, len(self._finalize)
        for r in np.flatnonzero((st.a_worker[:n] == old) & (st.a_expiry[:n] != NEVER)):
            self._expire_lease((LeaseKind.RUN, int(r), int(st.a_gen[r]), old))
        for f in np.flatnonzero((st.fz_worker[:nf] == old) & (st.fz_expiry[:nf] != NEVER)):
            self._expire_lease((LeaseKind.FINALIZE, int(f), int(st.fz_gen[f]), old))

    def unregister_worker(self, worker_id):
        """Disconnect a worker: nothing new is placed on it. Its leases stay in flight until
        they are reported or expire; returns their action ids."""
        row = self._worker_row(worker_id)
        st = self._state
        st.w_connected[row] = 0
        n = self._next_row
        held = np.nonzero((st.a_worker[:n] == row) & np.isin(st.a_state[:n], LIVE_STATES))[0]
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
        compiled, ids, seen, per_queue, batch_run_caps = [], [], set(), {}, {}
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
            if c.parent in self._actions and self._actions[c.parent].phase == Phase.ABORTED:
                raise SpecError(f"batch item {i}: action {c.id}: parent {c.parent} was aborted")
            run = self._runs.get(c.id.run_key)
            mac = c.spec.run_max_action_concurrency
            if run is not None:
                run_cap = int(self._state.u_cap[run])
            else:
                # A run new in this batch takes the cap of its first action here.
                run_cap = batch_run_caps.setdefault(c.id.run_key, mac)
            if mac and run_cap != mac:
                raise SpecError(f"batch item {i}: action {c.id}: run {c.id.run_key} already "
                                f"has max_action_concurrency {run_cap}")
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
        st.a_task[row] = self._task_row(c.spec.task)   # backfill (issue 5)
        rec = _Action(compiled=c, row=row, first_enqueued_ns=now)
        self._actions[c.id] = rec
        self._row_action[row] = c.id
        if c.parent is not None:
            self._actions[c.parent].children.append(c.id)
        t = c.spec.timeouts
        if t.deadline is not None:
            self._timer(now + int(t.deadline * 1e9), T_DEADLINE, row, 0)
        self._new_attempt(rec, now)
        return row

    def _new_attempt(self, rec, now):
        rec.attempts.append(Attempt(number=len(rec.attempts) + 1, enqueued_ns=now))
        t = rec.compiled.spec.timeouts
        if t.max_queued_time is not None:
            self._timer(now + int(t.max_queued_time * 1e9), T_QUEUED, rec.row,
                        len(rec.attempts))

    def _timer(self, due_ns, kind, row, ref):
        heapq.heappush(self._timers, (due_ns, next(self._seq), kind, row, ref))

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
        """Run one tick now: fire due timers (deadline, max_queued_time, retry backoff,
        runtime backstop), expire leases whose heartbeats stopped, then the Cython tick.
        Assignments wait in the dispatch channel (:meth:`drain_dispatch`); actions that can
        never fit end FAILED (SYSTEM, UNSCHEDULABLE). Returns the number of assignments."""
        now = self.clock.now_ns()
        self._fire_timers(now)
        if now >= self._next_sweep_ns:
            for lease in self.expired_leases():
                self.expire(lease)
            self._next_sweep_ns = now + self._sweep_period_ns
        kernel = self._kernel
        placed = kernel.run(now)
        st = self._state
        for i in range(kernel.f_count):
            self._fail_unschedulable(int(st.f_action[i]), WaitCode(int(st.f_code[i])))
        return placed

    def drain_dispatch(self, limit=None):
        """Take assignments out of the dispatch channel, oldest first, with their tokens. An
        entry whose lease ended before it was drained (expired, aborted) is dropped: it is
        never delivered, so nothing can run under a generation that already ended."""
        k, st = self._kernel, self._state
        n = k.d_tail - k.d_head
        if limit is not None:
            n = min(n, limit)
        cap = st.d_action.shape[0]
        out = []
        for j in range(k.d_head, k.d_head + n):
            slot = j % cap
            row, gen = int(st.d_action[slot]), int(st.d_gen[slot])
            cluster = self._clusters[st.d_cluster[slot]]
            worker = self._worker_names[st.d_worker[slot]]
            if st.d_kind[slot] == LeaseKind.FINALIZE:
                if int(st.fz_gen[row]) != gen or st.fz_end[row] != LeaseEnd.LIVE:
                    continue   # ended before it was dispatched: nothing to send
                aid, number, _ = self._finalize[row]
                rec = self._actions[aid]
                rec.attempts[number - 1].finalize = "SENT"
                out.append(Assignment(
                    action=aid, generation=gen, queue=rec.compiled.queue, cluster=cluster,
                    worker=worker, kind=LeaseKind.FINALIZE, attempt=number,
                    token=self._codec.mint(LeaseKind.FINALIZE, row, gen)))
                continue
            if (int(st.a_gen[row]) != gen or st.a_end[row] != LeaseEnd.LIVE
                    or st.a_state[row] not in LIVE_STATES):
                continue   # ended (expired, aborted) before it was dispatched
            aid = self._row_action[row]
            rec = self._actions[aid]
            att = self._stamp_attempt(rec)
            if rec.phase not in TERMINAL_PHASES and st.a_state[row] == RowState.SENT:
                rec.phase = Phase.INITIALIZING
            t = rec.compiled.spec.timeouts
            out.append(Assignment(
                action=aid, generation=gen, queue=rec.compiled.queue, cluster=cluster,
                worker=worker, kind=LeaseKind.RUN, attempt=att.number,
                token=self._codec.mint(LeaseKind.RUN, row, gen),
                deadline_ns=(rec.first_enqueued_ns + int(t.deadline * 1e9)
                             if t.deadline is not None else None),
                queued_deadline_ns=(att.enqueued_ns + int(t.max_queued_time * 1e9)
                                    if t.max_queued_time is not None else None),
                max_runtime_s=t.max_runtime,
            ))
        k.consume_dispatch(n)
        return out

    def tick(self):
        """Schedule once and return the assignments made (the in-process dispatcher)."""
        self.schedule()
        return self.drain_dispatch()

    def _stamp_attempt(self, rec):
        # Record where the current attempt went, once per generation.
        st = self._state
        att = rec.attempt
        gen = int(st.a_gen[rec.row])
        if att.generation != gen:
            att.generation = gen
            att.cluster = self._clusters[st.a_cluster[rec.row]]
            att.worker = self._worker_names[st.a_worker[rec.row]]
            att.start_ns = self.clock.now_ns()
        return att

    # ------------------------------------------------------------------ timers

    def _fire_timers(self, now):
        st = self._state
        while self._timers and self._timers[0][0] <= now:
            _due, _seq, kind, row, ref = heapq.heappop(self._timers)
            if kind == T_FINALIZE:
                self._finalize_give_up(row, ref)
                continue
            rec = self._actions[self._row_action[row]]
            if rec.phase in TERMINAL_PHASES:
                continue
            state = st.a_state[row]
            if kind == T_DEADLINE:
                # The engine enforces the deadline before dispatch; a running attempt is
                # bounded by its worker, which was given the deadline with the lease.
                if state in (RowState.QUEUED, RowState.BACKOFF):
                    self._end_attempt(rec, Phase.TIMED_OUT, cause="deadline",
                                      message="deadline passed before dispatch")
                    self._finish(rec, Phase.TIMED_OUT, "deadline passed before dispatch",
                                 cause="deadline")
            elif kind == T_QUEUED:
                if state == RowState.QUEUED and len(rec.attempts) == ref:
                    self._kernel.remove(row)          # leaves the row in state DONE
                    self._attempt_failed(rec, Phase.TIMED_OUT, None, "max_queued_time",
                                         "max_queued_time passed while queued", True)
            elif kind == T_RETRY:
                if state == RowState.BACKOFF and len(rec.attempts) == ref:
                    self._kernel.push(row)
            elif kind == T_RUNTIME:
                # Engine backstop for max_runtime: the worker should have ended it.
                if (state == RowState.RUNNING and int(st.a_gen[row]) == ref
                        and st.a_end[row] == LeaseEnd.LIVE):
                    self._stamp_attempt(rec)
                    self._end_lease(row, LeaseEnd.EXPIRED)
                    self._attempt_failed(
                        rec, Phase.TIMED_OUT, None, "max_runtime",
                        "engine backstop: still running past max_runtime plus grace", True,
                        cleanup=True)

    # ------------------------------------------------------------------ expiry

    def expired_leases(self, now=None):
        """Snapshot of leases past their expiry: ``(kind, row, generation, worker row)``.
        Apply each with :meth:`expire`, which refuses a lease that moved on since."""
        now = self.clock.now_ns() if now is None else now
        st = self._state
        # Rows that are not live carry expiry NEVER, so this is one compare per row.
        rows = np.flatnonzero(st.a_expiry[:self._next_row] < now)
        rows = rows[np.isin(st.a_state[rows], LIVE_STATES) & (st.a_end[rows] == LeaseEnd.LIVE)]
        out = [(LeaseKind.RUN, int(r), int(st.a_gen[r]), int(st.a_worker[r])) for r in rows]
        frows = np.flatnonzero(st.fz_expiry[:len(self._finalize)] < now)
        frows = frows[(st.fz_state[frows] == RowState.SENT) & (st.fz_end[frows] == LeaseEnd.LIVE)]
        out += [(LeaseKind.FINALIZE, int(f), int(st.fz_gen[f]), int(st.fz_worker[f]))
                for f in frows]
        return out

    def expire(self, lease):
        """Expire one lease from :meth:`expired_leases`; True if applied. Refused (False)
        when its generation or holder is no longer the one observed, it already ended, or a
        heartbeat extended it since the snapshot."""
        kind, row, _gen, _worker = lease
        st = self._state
        expiry = st.fz_expiry[row] if kind == LeaseKind.FINALIZE else st.a_expiry[row]
        if expiry >= self.clock.now_ns():
            return False
        return self._expire_lease(lease)

    def _expire_lease(self, lease):
        kind, row, gen, worker = lease
        st = self._state
        if kind == LeaseKind.FINALIZE:
            if (int(st.fz_gen[row]) != gen or int(st.fz_worker[row]) != worker
                    or st.fz_state[row] != RowState.SENT or st.fz_end[row] != LeaseEnd.LIVE):
                return False
            st.fz_end[row] = LeaseEnd.EXPIRED
            st.fz_expiry[row] = NEVER
            self._kernel.release_finalize(row)
            aid, number, _give_up = self._finalize[row]
            self._actions[aid].attempts[number - 1].finalize = "PENDING"
            self._kernel.push_finalize(row)   # sticky: its preferred worker, else its cluster
            return True
        if (int(st.a_gen[row]) != gen or int(st.a_worker[row]) != worker
                or st.a_state[row] not in LIVE_STATES or st.a_end[row] != LeaseEnd.LIVE):
            return False
        rec = self._actions[self._row_action[row]]
        self._stamp_attempt(rec)
        self._end_lease(row, LeaseEnd.EXPIRED)
        self._attempt_failed(rec, Phase.FAILED, ErrorKind.SYSTEM, "EXPIRED",
                             "lease expired: heartbeats stopped", True, cleanup=True)
        return True

    # ------------------------------------------------------------------ heartbeats

    def heartbeat(self, worker_id, tokens, free_capacity=None):
        """Validate and extend a batch of tokens from one worker in one Cython pass (check
        all, then extend the valid ones); record the free capacity it sees in its cluster
        (``{resource: quantity}``) for the gate. Returns the refused tokens with verdicts;
        the worker stops the attempt behind each one. Extension is best-effort."""
        row = self._worker_row(worker_id)
        st = self._state
        if not st.w_connected[row]:
            raise NotFound(f"worker {worker_id!r} is not connected")
        arr = self._codec.parse(tokens)
        if free_capacity is not None:
            try:
                vec = self._resources.vector(free_capacity, unset=-1)
            except ValueError as exc:
                raise SpecError(f"worker {worker_id}: free_capacity: {exc}") from None
            c = int(st.w_cluster[row])
            given = vec >= 0
            st.c_obs[c, given] = vec[given]
            st.c_obs_mark[c, given] = st.c_adm[c, given]
        verdicts = np.empty(arr.shape[0], dtype=np.uint8)
        validate(self._kernel, arr, row, self.clock.now_ns(), self._codec.k0,
                 self._codec.k1, verdicts, True)
        bad = np.nonzero(verdicts)[0]
        return [Refusal(arr[i].astype("<u8").tobytes(), Verdict(int(verdicts[i]))) for i in bad]

    def _check_token(self, token):
        arr = self._codec.parse(token)
        if arr.shape[0] != 1:
            raise SpecError(f"a report carries exactly one token, not {arr.shape[0]}")
        verdict = np.empty(1, dtype=np.uint8)
        validate(self._kernel, arr, -1, self.clock.now_ns(), self._codec.k0, self._codec.k1,
                 verdict, False)
        lease = int(arr[0, 0])
        return Verdict(int(verdict[0])), LeaseKind(lease >> 63), lease & ((1 << 63) - 1)

    # ------------------------------------------------------------------ reports

    def report(self, token, phase, *, error_kind=None, cause=None, recoverable=True,
               message="", cleanup=False):
        """A worker's report on the lease behind ``token``: progress (INITIALIZING, RUNNING)
        or a terminal outcome (SUCCEEDED; FAILED with ``error_kind`` USER (``recoverable``
        or not) or SYSTEM with a ``cause`` such as OOM, EVICTED, NODE_LOST; TIMED_OUT with
        ``cause`` naming the bound). ``cleanup`` asks for a finalize lease for this attempt.
        Returns the verdict: anything but ``Verdict.OK`` means the report was refused (for
        example a late report from an older generation) and changed nothing."""
        try:
            phase = Phase(phase)
        except ValueError:
            raise SpecError(f"unknown phase {phase!r}") from None
        if phase in (Phase.QUEUED, Phase.WAITING_FOR_RESOURCES, Phase.ABORTED):
            raise SpecError(f"a worker cannot report {phase}")
        kind_ = None
        if phase == Phase.FAILED:
            try:
                kind_ = ErrorKind(error_kind)
            except ValueError:
                raise SpecError(f"FAILED needs error_kind USER or SYSTEM, not "
                                f"{error_kind!r}") from None
            if kind_ == ErrorKind.SYSTEM and not cause:
                raise SpecError("a SYSTEM failure needs a cause (OOM, EVICTED, ...)")
        if phase == Phase.TIMED_OUT and cause not in BOUNDS:
            raise SpecError(f"TIMED_OUT needs cause naming the bound "
                            f"({', '.join(BOUNDS)}), not {cause!r}")
        verdict, kind, row = self._check_token(token)
        if verdict != Verdict.OK:
            return verdict
        if kind == LeaseKind.FINALIZE:
            if phase in (Phase.SUCCEEDED, Phase.FAILED):
                self._end_finalize(row, LeaseEnd.COMPLETED, phase.value)
            elif phase == Phase.TIMED_OUT:
                raise SpecError("a finalize lease ends SUCCEEDED or FAILED")
            return verdict
        rec = self._actions[self._row_action[row]]
        st = self._state
        now = self.clock.now_ns()
        att = self._stamp_attempt(rec)
        if phase == Phase.INITIALIZING:
            # Reports may arrive out of order: a running attempt never goes back.
            if st.a_state[row] != RowState.RUNNING:
                rec.phase = Phase.INITIALIZING
            return verdict
        if phase == Phase.RUNNING:
            if st.a_state[row] != RowState.RUNNING:
                st.a_state[row] = RowState.RUNNING   # stops the queued-time clock
                att.running_ns = now
                rec.phase = Phase.RUNNING
                # Backfill (issue 5): history measures from RUNNING, so the prediction does.
                pred = int(st.t_pred_rt[st.a_task[row]])
                if pred != NEVER and now + pred > st.a_pred_end[row]:
                    st.a_pred_end[row] = now + pred
                t = rec.compiled.spec.timeouts
                if t.max_runtime is not None:
                    grace = self.config.engine.runtime_grace
                    self._timer(now + int((t.max_runtime + grace) * 1e9), T_RUNTIME, row,
                                int(st.a_gen[row]))
            return verdict
        if phase == Phase.SUCCEEDED:
            # Backfill (issue 5): a success teaches the task's history (failures do not).
            began = att.running_ns if att.running_ns is not None else att.start_ns
            if began is not None:
                self._record_runtime(rec.compiled.spec.task, now - began)
            self._end_lease(row, LeaseEnd.COMPLETED)
            self._end_attempt(rec, Phase.SUCCEEDED, message=message, cleanup=cleanup)
            self._finish(rec, Phase.SUCCEEDED, message)
            return verdict
        if phase == Phase.FAILED:
            self._end_lease(row, LeaseEnd.COMPLETED)
            self._attempt_failed(rec, Phase.FAILED, kind_, cause, message,
                                 bool(recoverable), cleanup=cleanup)
            return verdict
        # TIMED_OUT, with the bound the worker enforced.
        self._end_lease(row, LeaseEnd.COMPLETED)
        self._attempt_failed(rec, Phase.TIMED_OUT, None, cause, message, True, cleanup=cleanup)
        return verdict

    def mark_running(self, action, generation):
        """In-process convenience: the holder of ``generation`` reports RUNNING."""
        self._report_as_holder(action, generation, Phase.RUNNING)

    def complete(self, action, generation, phase=Phase.SUCCEEDED, message="", **kw):
        """In-process convenience: the holder of ``generation`` reports a terminal phase
        (same rules as :meth:`report`); a refused report raises ``SpecError``."""
        phase = Phase(phase)
        if phase not in TERMINAL_PHASES:
            raise SpecError(f"{phase} is not a terminal phase")
        if phase == Phase.FAILED and "error_kind" not in kw:
            kw["error_kind"] = ErrorKind.USER
        self._report_as_holder(action, generation, phase, message=message, **kw)

    def _report_as_holder(self, action, generation, phase, **kw):
        rec = self._record(action)
        token = self._codec.mint(LeaseKind.RUN, rec.row, generation)
        verdict = self.report(token, phase, **kw)
        if verdict != Verdict.OK:
            raise SpecError(f"action {rec.compiled.id}: report for generation {generation} "
                            f"refused: {verdict.name}")

    # ------------------------------------------------------------------ abort

    def abort(self, action, reason="aborted"):
        """Abort ``action`` and every descendant: queued ones end at once; sent or running
        ones are refused at their next heartbeat (their worker stops them) and get a
        finalize lease for cleanup. Returns the ids that ended."""
        ended = []
        stack = [ActionId.parse(action)]
        if stack[0] not in self._actions:
            raise NotFound(f"action {stack[0]} not found")
        while stack:
            aid = stack.pop()
            rec = self._actions[aid]
            stack.extend(rec.children)
            if rec.phase in TERMINAL_PHASES:
                continue
            row = rec.row
            state = self._state.a_state[row]
            cleanup = False
            if state in LIVE_STATES:
                self._stamp_attempt(rec)
                self._end_lease(row, LeaseEnd.ABORTED)
                cleanup = True
            self._end_attempt(rec, Phase.ABORTED, message=reason, cleanup=cleanup)
            self._finish(rec, Phase.ABORTED, reason)
            ended.append(aid)
        return ended

    # ------------------------------------------------------------------ transitions

    def _end_lease(self, row, end):
        # The current generation ends: later tokens for it get `end` as their verdict, and
        # its in-flight counts are released (once per generation).
        st = self._state
        st.a_end[row] = end
        st.a_expiry[row] = NEVER
        self._kernel.release(row, self.clock.now_ns())
        st.a_state[row] = RowState.DONE

    def _end_attempt(self, rec, phase, kind=None, cause=None, message="", recoverable=None,
                     cleanup=False):
        att = rec.attempt
        att.end_ns = self.clock.now_ns()
        att.phase = phase.value
        att.error_kind = kind.value if kind is not None else None
        att.cause = cause
        att.message = message
        att.recoverable = recoverable
        if cleanup and att.generation:
            self._new_finalize(rec, att)

    def _attempt_failed(self, rec, phase, kind, cause, message, recoverable, cleanup=False):
        """End the current attempt and retry it if its budget allows, else finish."""
        self._end_attempt(rec, phase, kind, cause, message, recoverable, cleanup)
        spec = rec.compiled.spec
        if phase == Phase.TIMED_OUT and cause == "deadline":
            retry = False
        elif kind == ErrorKind.SYSTEM:
            retry = cause != "UNSCHEDULABLE" and (
                rec.system_retries < self.config.engine.system_retries)
            if retry:
                rec.system_retries += 1
        else:
            # USER errors and the per-attempt bounds spend the user's retries.
            retry = recoverable and rec.user_retries < spec.retries.count
            if retry:
                rec.user_retries += 1
        if not retry:
            text = f"{cause}: {message}" if cause else message
            self._finish(rec, phase, text, kind=kind.value if kind else None, cause=cause)
            return
        now = self.clock.now_ns()
        r = spec.retries
        n = rec.user_retries + rec.system_retries - 1
        delay = min(r.backoff_base * r.backoff_factor ** n, r.backoff_cap)
        ready = now + int(delay * 1e9)
        t = spec.timeouts
        if t.deadline is not None and ready >= rec.first_enqueued_ns + int(t.deadline * 1e9):
            self._finish(rec, Phase.TIMED_OUT, "deadline passes before the retry is due",
                         cause="deadline")
            return
        self._state.a_state[rec.row] = RowState.BACKOFF
        rec.phase = Phase.QUEUED
        self._new_attempt(rec, ready)
        self._timer(ready, T_RETRY, rec.row, len(rec.attempts))

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
        message = f"UNSCHEDULABLE: {why}"
        self._end_attempt(rec, Phase.FAILED, ErrorKind.SYSTEM, "UNSCHEDULABLE", message, False)
        self._finish(rec, Phase.FAILED, message, kind=ErrorKind.SYSTEM.value,
                     cause="UNSCHEDULABLE")

    def _finish(self, rec, phase, message, kind=None, cause=None):
        st = self._state
        row = rec.row
        if st.a_state[row] == RowState.QUEUED:
            self._kernel.remove(row)
        self._kernel.release(row, self.clock.now_ns())
        st.a_state[row] = RowState.DONE
        rec.phase = phase
        rec.message = message
        rec.error_kind = kind
        rec.cause = cause

    # ------------------------------------------------------------------ finalize leases

    def _new_finalize(self, rec, att):
        st = self._state
        f = len(self._finalize)
        if st.ensure("finalize", f + 1):
            self._kernel.bind(st)
        row = rec.row
        st.fz_action[f] = row
        st.fz_cluster[f] = self._cluster_index[att.cluster]
        st.fz_pref[f] = st.a_worker[row]
        give_up = self.clock.now_ns() + int(self.config.engine.finalize_timeout * 1e9)
        self._finalize[f] = (rec.compiled.id, att.number, give_up)
        att.finalize = "PENDING"
        self._kernel.push_finalize(f)
        self._timer(give_up, T_FINALIZE, f, 0)

    def _end_finalize(self, f, end, outcome):
        st = self._state
        st.fz_end[f] = end
        st.fz_expiry[f] = NEVER
        self._kernel.release_finalize(f)
        st.fz_state[f] = RowState.DONE
        aid, number, _ = self._finalize[f]
        self._actions[aid].attempts[number - 1].finalize = outcome

    def _finalize_give_up(self, f, _ref):
        # Its own generous bound passed: record the leak loudly rather than retry forever.
        st = self._state
        if st.fz_state[f] == RowState.DONE:
            return
        if st.fz_state[f] == RowState.QUEUED:
            self._kernel.remove_finalize(f)
        self._end_finalize(f, LeaseEnd.ABORTED, "ABANDONED")

    # ------------------------------------------------------------------ backfill (issue 5)
    # Runtime history per task name feeds EASY backfill: each task row of t_pred_rt holds
    # the backfill percentile of its successful runtimes (NEVER without history); the tick
    # predicts a lease's end from it at assignment (a_pred_end).

    def _task_row(self, task):
        row = self._tasks.get(task)
        if row is None:
            st = self._state
            row = len(self._tasks)
            if st.ensure("tasks", row + 1):
                self._kernel.bind(st)
            self._tasks[task] = row
            self._refresh_prediction(task, row)
        return row

    def _refresh_prediction(self, task, row):
        ns = self.history.percentile_ns(task, self.config.engine.backfill_percentile)
        self._state.t_pred_rt[row] = NEVER if ns is None else ns

    def _record_runtime(self, task, ns):
        self.history.record_ns(task, max(0, int(ns)))
        self._history_dirty.add(task)
        if task in self._tasks:
            self._refresh_prediction(task, self._tasks[task])

    def load_history(self, task, data):
        """Load ``task``'s runtime history from a record made by ``history.encode(task)``
        (reload from the store); queued and later actions of the task predict from it at
        once. A malformed record raises ``ValueError`` naming the task; nothing changes."""
        self.history.load(task, data)
        if task in self._tasks:
            self._refresh_prediction(task, self._tasks[task])

    def take_dirty_history(self):
        """Task names whose history changed since the last call (for storage to persist
        ``history.encode(task)`` of each); the set is cleared."""
        out, self._history_dirty = self._history_dirty, set()
        return out

    def predicted_runtime(self, task):
        """What the task's history predicts (seconds, at ``backfill_percentile``), or None."""
        return self.history.percentile(task, self.config.engine.backfill_percentile)

    def _head_eta(self, row):
        # The shadow time of a blocked head, from the current state (None: unknown).
        return self._kernel.head_eta(row, self.clock.now_ns())

    def _position(self, row):
        st = self._state
        n = self._next_row
        q = st.a_queue[row]
        queued = (st.a_state[:n] == RowState.QUEUED) & (st.a_queue[:n] == q)
        enq = st.a_enqueued[:n]
        ahead = queued & ((enq < enq[row]) | ((enq == enq[row]) & (np.arange(n) < row)))
        return int(np.count_nonzero(ahead)) + 1

    # ------------------------------------------------------------------ queries

    def phase(self, action):
        """The action's phase."""
        return self.explain(action).phase

    def _record(self, action):
        aid = ActionId.parse(action)
        rec = self._actions.get(aid)
        if rec is None:
            raise NotFound(f"action {aid} not found")
        return rec

    def explain(self, action):
        """The action's phase and, while it waits, the reason (code and message), its
        position in its queue (by enqueue time) and, for a blocked head, its estimated start
        (``eta_ns``: its shadow time from the runtime history of what runs; None unknown)."""
        rec = self._record(action)
        aid = rec.compiled.id
        st = self._state
        row = rec.row
        if st.a_state[row] == RowState.BACKOFF:
            att = rec.attempt
            wait_s = max(0.0, (att.enqueued_ns - self.clock.now_ns()) / 1e9)
            prev = rec.attempts[-2]
            return Explanation(aid, Phase.QUEUED, None,
                               f"attempt {att.number} waits {wait_s:.1f}s of retry backoff "
                               f"(attempt {prev.number}: {prev.phase} {prev.cause or ''})")
        if st.a_state[row] in LIVE_STATES and rec.phase == Phase.QUEUED:
            return Explanation(
                aid, Phase.QUEUED, WaitCode.PLACED,
                f"queue {rec.compiled.queue}: assigned to "
                f"{self._clusters[st.a_cluster[row]]}/{self._worker_names[st.a_worker[row]]} "
                f"(generation {int(st.a_gen[row])}); waiting in the dispatch channel")
        if st.a_state[row] != RowState.QUEUED:
            return Explanation(aid, rec.phase, None, rec.message)
        q = int(st.a_queue[row])
        lane = int(st.a_lane[row])
        if int(st.a_wait_tick[row]) == self._kernel.tick_no:
            code = WaitCode(int(st.a_wait_code[row]))
            reason = self._reason(row, code, int(st.a_wait_cluster[row]),
                                  int(st.a_wait_dim[row]), int(st.a_wait_blocker[row]))
        elif int(st.ln_skip_tick[lane]) == self._kernel.tick_no:
            code = WaitCode(int(st.ln_skip_code[lane]))   # behind a capped run
            reason = self._reason(row, code, -1, -1, -1)
        else:
            code = WaitCode(int(st.q_stop_code[q]))
            reason = self._reason(row, code, -1, -1, int(st.q_stop_blocker[q]))
        phase = Phase.WAITING_FOR_RESOURCES if code in RESOURCE_WAITS else Phase.QUEUED
        # Backfill (issue 5): a blocked head gets its shadow time as an estimated start;
        # every queued action its position in the queue.
        eta = None
        if int(st.q_head[q]) == row and st.q_strict[q] and code in (
                WaitCode.CLUSTER_CAPACITY, WaitCode.HEAD_OF_LINE):
            # Only a STRICT_FIFO head holds what frees up; a GREEDY one may be passed over.
            eta = self._head_eta(row)
            if eta is not None:
                wait_s = max(0.0, (eta - self.clock.now_ns()) / 1e9)
                reason += f"; estimated start in {wait_s:.1f}s (runtime history)"
        position = self._position(row)
        if code in (WaitCode.HEAD_OF_LINE, WaitCode.HEAD_BUDGET) and eta is None:
            reason += f"; position {position} in queue {self._queue_names[q]}"
        return Explanation(aid, phase, code, reason, eta_ns=eta, position=position)

    def attempts(self, action):
        """The action's attempts, oldest first (copies): cluster, worker, start, end,
        phase, error kind, cause, message, finalize outcome."""
        return [replace(a) for a in self._record(action).attempts]

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
        if code == WaitCode.POOL_ELSEWHERE:
            return (f"queue {qname}: its warm pool runs on {self._clusters[cluster]}, which the "
                    f"queue no longer allows; it waits until that pool idles out")
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
        free = np.array(self._kernel.cluster_free(cluster), dtype=np.int64)
        short = np.nonzero(self._state.a_demand[row] > free)[0]
        return int(short[0]) if short.size else -1

    def _need(self, row, cluster, dim):
        st = self._state
        res = self._resources
        if cluster < 0 or dim < 0:
            return f"needs {res.describe(st.a_demand[row])}"
        name = res.names[dim]
        free = int(self._kernel.cluster_free(cluster)[dim])
        return (f"needs {name}={format_quantity(name, int(st.a_demand[row, dim]))}; "
                f"cluster {self._clusters[cluster]} has {format_quantity(name, free)} free")

    def queue_metrics(self, name=None):
        """Per queue: runs and actions in flight, in-flight resources, depth and head_blocked
        (since, action, reason, demand) or None; ``backfilled`` (placements made by EASY
        backfill, cumulative) and ``head_eta_ns`` (the blocked head's shadow time, None when
        not blocked or unknown). One queue when ``name`` is given."""
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
            eta = None
            if blocked is not None and exp.wait in (WaitCode.CLUSTER_CAPACITY,
                                                    WaitCode.HEAD_OF_LINE):
                eta = exp.eta_ns
            out[qname] = {
                "backfilled": int(st.q_backfilled[q]),     # backfill (issue 5)
                "head_eta_ns": eta,                        # backfill (issue 5)
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


