"""The in-process engine: one shard's decision core over numpy arrays and the Cython tick.

Everything later (storage, transport, supervisor) wraps this class; none of it reimplements
scheduling. Python keeps the edges (names to rows, specs, history); the arrays and the tick
keep the decision state. Time comes from an injectable clock.
"""

import collections
import contextlib
import copy
import heapq
import itertools
import threading
import time
from dataclasses import dataclass, field, replace

import msgpack
import numpy as np

from cext import RecordCodec, TickKernel
from cext._lease import validate
from cext._tree import descendants
from engine._clock import SystemClock
from engine._codes import (
    PHASE_CODE,
    PHASES,
    RESOURCE_WAITS,
    T_DEADLINE,
    T_FINALIZE,
    T_QUEUED,
    T_RETRY,
    T_RUNTIME,
    TERMINAL_PHASES,
    LeaseEnd,
    LeaseKind,
    Phase,
    RowState,
    Verdict,
    WaitCode,
)
from engine._config import STRICT_FIFO, Config, load_config, update_queue
from engine._dispatch import Assignment, DispatchBatch
from engine._errors import ConfigError, NotFound, ResourceExhausted, SpecError
from engine._groups import (
    ActionIds,
    EnqueueGroup,
    abort_key,
    check_names,
    decode_group,
    encode_group,
    group_key,
)
from engine._history import RuntimeHistory
from engine._inspect import Inspection
from engine._leases import Attempt, ErrorKind, TokenCodec
from engine._model import ActionId, ActionSpec, compile_spec, fit_problem
from engine._records import (
    FINALIZE_DTYPE,
    LAYOUT_KEY,
    SECRET_KEY,
    action_dtype,
    decode_content,
    decode_outcome,
    decode_spec,
    encode_outcome,
    encode_spec,
    finalize_columns,
    name_hash,
    row_key,
    spec_content,
)
from engine._reload import load
from engine._state import NEVER, State
from engine._units import format_quantity
from storage import (
    CorruptRecord,
    LmdbStore,
    OwnershipError,
    StoreError,
    StoreFailed,
    StoreFull,
    partition_of,
)

LIVE_STATES = (int(RowState.SENT), int(RowState.RUNNING))
_FINALIZE = int(LeaseKind.FINALIZE)
# The durable column of each action timer (reload rebuilds the timers from them).
_DUE_COLUMNS = {T_DEADLINE: "a_deadline_due", T_QUEUED: "a_queued_due", T_RETRY: "a_retry_due",
                T_RUNTIME: "a_runtime_due"}
BOUNDS = ("deadline", "max_queued_time", "max_runtime")

__all__ = ["Engine", "Assignment", "DispatchBatch", "Explanation", "AlreadyExists", "Refusal",
           "Group", "kernel_pass"]


class AlreadyExists(SpecError):
    """An action with this id exists with a different spec; nothing was stored."""

    code = "ALREADY_EXISTS"


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

    @property
    def attempt(self):
        return self.attempts[-1]


class Group:
    """One deferred loop turn (:meth:`Engine.decide`, :meth:`Engine.deferred_turn`): its
    encoded store group, waiting for :meth:`Engine.commit`. ``state`` is ``"open"`` while
    its turn runs, then ``"pending"``, then ``"committed"`` or ``"discarded"`` (an earlier
    or its own commit failed: nothing of it may be acted on)."""

    __slots__ = ("seq", "state", "batch", "dispatch_tail", "placed", "swept")

    def __init__(self, seq):
        self.seq = seq
        self.state = "open"
        self.batch = None
        self.dispatch_tail = 0
        self.placed = 0         # assignments the decision made (decide)
        self.swept = False      # the decision ran the periodic lease-expiry sweep (decide)

    def __repr__(self):
        return f"Group({self.seq}, {self.state}, placed={self.placed})"


def kernel_pass(kernel, now):
    """The Cython tick alone: a function of its own so that a profile or an allocation
    trace can attribute what the kernel call itself costs."""
    return kernel.run(now)


# Row states and lease ends as plain ints: numpy probes an IntEnum value for the array
# protocols on every assignment (a slow attribute miss per write on Python 3.11).
_ST_QUEUED, _ST_SENT, _ST_RUNNING, _ST_DONE, _ST_BACKOFF = (
    int(RowState.QUEUED), int(RowState.SENT), int(RowState.RUNNING), int(RowState.DONE),
    int(RowState.BACKOFF))
_END_LIVE, _END_COMPLETED, _END_EXPIRED, _END_ABORTED = (
    int(LeaseEnd.LIVE), int(LeaseEnd.COMPLETED), int(LeaseEnd.EXPIRED), int(LeaseEnd.ABORTED))
_Q = PHASE_CODE[Phase.QUEUED]
_INIT = PHASE_CODE[Phase.INITIALIZING]
_RUNNING = PHASE_CODE[Phase.RUNNING]
_SUCCEEDED = PHASE_CODE[Phase.SUCCEEDED]
_ABORTED = PHASE_CODE[Phase.ABORTED]
_LEAN_TERMINAL = (_SUCCEEDED, _ABORTED)


class Engine:
    """One shard's scheduling engine.

    ``config`` is a :class:`~engine._config.Config` or a path to a TOML file; ``clock`` any
    object with ``now_ns()`` (default: wall clock); ``secret`` the shard's 16-byte token key
    (random when not given; storage persists it so tokens survive a restart); ``store`` a
    :class:`~storage.Store` (default: the config's LMDB store); ``wall_clock`` any object
    with ``time_ns()`` for the partition claims (default: :mod:`time`).

    Guarantees: assignment is at-most-once (only the holder of a lease's current generation
    can heartbeat or report it); execution is at-least-once (after an expiry or a partition an
    attempt may run twice, so tasks should be idempotent or carry the action name and
    generation into external writes).
    """

    def __init__(self, config, *, clock=None, secret=None, store=None, wall_clock=None):
        if not isinstance(config, Config):
            config = load_config(config)
        self.config = config
        self.clock = clock or SystemClock()
        # Wall time for the partition claims, which other processes judge (``time_ns()``).
        self._wall = wall_clock or time
        res = config.resources
        self._resources = res
        self._clusters = [c.name for c in config.clusters]
        self._cluster_index = {n: i for i, n in enumerate(self._clusters)}
        self._queue_names = [q.name for q in config.queues]
        self._queue_index = {n: i for i, n in enumerate(self._queue_names)}
        # Per cluster: node shapes as a [S, R] matrix (None = shapes unknown, every pod fits).
        self._shapes = [
            np.stack([s.allocatable for s in c.node_shapes]) if c.node_shapes else None
            for c in config.clusters
        ]
        self._sweep_period_ns = int(config.engine.heartbeat_interval * 1e9 / 4)
        self._action_dtype = action_dtype(len(res))
        if store is None:
            sc = config.storage
            store = LmdbStore(sc.path, partitions=sc.partitions, map_size=sc.map_size,
                              sync=sc.sync, claim_ttl_s=sc.claim_ttl)
        self._store = store
        self._stopped = None        # why the shard stopped (lost ownership), or None
        self._tenant_parts = {}     # tenant -> partition (a cache of partition_of)
        self._depth = 0             # nesting of transitions in the current loop turn
        self._deferring = False     # the current turn is deferred (decide / deferred_turn)
        self._pending = collections.deque()   # deferred groups not committed yet, in order
        self._pending_batch = None  # the batch a deferred turn just encoded
        self._group_seq = itertools.count(1)
        self._committed_tail = 0    # dispatch ring position up to which decisions are durable
        self._store.open(config.storage.shard, self._wall.time_ns())
        # Claims are renewed from the loop (schedule) well within their ttl (wall clock:
        # they are judged by other processes).
        self._next_renew_ns = self._wall.time_ns() + self._store.claim_ttl_ns // 3
        try:
            self._codec = TokenCodec(self._load_meta(secret))
            self._load()
            if self._refit_layout is not None:
                self._refit()
        except BaseException:
            self._store.close()
            raise

    # ------------------------------------------------------------------ durable state

    def _reset(self, preset_rows=0, preset=()):
        """Empty in-memory state (the arrays, the kernel and the Python edges). Reload sizes
        the action table for ``preset_rows`` rows whose ``preset`` columns it writes."""
        settings = self.config.engine
        self._queues = {q.name: q for q in self.config.queues}
        self._state = st = State(
            n_res=len(self._resources), n_clusters=len(self._clusters),
            n_queues=len(self._queue_names),
            initial_rows=settings.initial_capacity,
            dispatch_capacity=settings.dispatch_capacity,
            max_candidates=settings.max_candidates,
            gate_on=settings.resource_gate == "enforce",
            cpu_dim=self._resources.cpu_index, res_accel=self._resources.accelerator_mask,
            bf_max_candidates=settings.backfill_max_candidates,
            preset_rows=preset_rows, preset=preset,
        )
        # Backfill: runtime history per task name, its predictions in t_pred_rt (durable in
        # the store's history database, partition 0, one record per task row).
        self.history = RuntimeHistory()
        self._tasks = {}                # task name -> task row
        self._task_names = []           # task row -> task name
        for i, cluster in enumerate(self.config.clusters):
            if cluster.capacity is not None:
                st.c_cap[i] = cluster.capacity
        for q in self.config.queues:
            self._apply_queue(q)
        self._recs = {}             # row -> _Action: rows whose Python record is their truth
        self._hash_rows = {}        # name hash -> row (rows created or looked up since load)
        self._collided = {}         # ActionId -> row, for the rare hash taken by another id
        self._groups = {}           # group id -> EnqueueGroup (loaded on first use)
        self._abort_reasons = {}    # row an abort was called on -> its reason (lean rows)
        self._next_gid = 0
        self._idx_hash = np.zeros(0, dtype=np.uint64)   # restored rows: sorted name hashes
        self._idx_row = np.zeros(0, dtype=np.int64)     # ... and their rows
        self._index_thread = None   # builds the index above after a load
        self._runs = {}             # run key -> run row
        self._run_keys = []         # run row -> run key
        self._qruns = {}            # (queue row, run row) -> qrun row
        self._envs = {}             # env key -> env row
        self._workers = {}          # worker id -> its current session row
        self._worker_names = []     # session row -> worker id
        self._idents = {}           # worker id -> durable identity (index)
        self._ident_names = []      # identity -> (worker id, cluster name)
        self._adoptable = set()     # session rows restored at load, waiting for reconnect
        self._fit_cache = {}        # pod matrix bytes -> cluster bitmask
        self._next_row = 0
        self._n_finalize = 0
        self._timers = []           # heap of (due_ns, seq, kind, row, ref) set since load
        self._seq = itertools.count()
        self._restored_timers = None   # (due, kind, row, ref) arrays sorted by due, at load
        self._rt_pos = 0
        self._next_sweep_ns = 0
        self._queue_changes = {}    # queue name -> live changes (persisted)
        self._kernel = TickKernel()
        self._codec_records = RecordCodec()
        self._bind()
        self._kernel.set_lease_ttl(settings.lease_ttl_ns)
        self._clear_dirty()

    def _bind(self):
        # After a table grew (its arrays were replaced): rebind everything compiled.
        self._kernel.bind(self._state)
        self._codec_records.bind(self._state)

    def _clear_dirty(self):
        self._history_dirty = set()  # tasks whose history record to write
        self._dirty = set()         # action rows: fixed record and outcome to write
        self._dirty_fixed = set()   # action rows: fixed record only
        self._dirty_fz = set()      # finalize rows
        self._ops = {}              # partition -> [(db, key, value)] of the edges

    def _part_of(self, tenant):
        part = self._tenant_parts.get(tenant)
        if part is None:
            part = self._tenant_parts[tenant] = partition_of(tenant, self._store.partitions)
        return part

    def _op(self, part, db, key, value):
        self._ops.setdefault(part, []).append((db, key, value))

    def _load_meta(self, secret):
        """Check (or write) the shard layout and return the token secret."""
        store = self._store
        layout = {"resources": list(self._resources.names), "clusters": self._clusters,
                  "queues": self._queue_names,
                  # What the stored fit masks were computed from (capacities, node shapes).
                  "fit": [[None if c.capacity is None else c.capacity.tolist(),
                           [sh.allocatable.tolist() for sh in c.node_shapes]]
                          for c in self.config.clusters]}
        raw = store.get(0, "meta", LAYOUT_KEY)
        stored_secret = store.get(0, "meta", SECRET_KEY)
        if raw is not None:
            try:
                old = msgpack.unpackb(raw)
            except Exception:
                raise CorruptRecord(0, "meta", LAYOUT_KEY, "undecodable engine layout") from None
            for key in ("resources", "clusters", "queues"):
                have, want = list(old[key]), layout[key]
                if want[:len(have)] != have or (key == "resources" and want != have):
                    raise ConfigError(
                        f"{self.config.source}: {key} {want} do not match the store's "
                        f"{have} ({store.path if hasattr(store, 'path') else 'store'}): a "
                        f"shard with state can only append {key}" +
                        (" (resources cannot change)" if key == "resources" else ""))
        if stored_secret is not None:
            if secret is not None and bytes(secret) != stored_secret:
                raise SpecError("the given shard secret differs from the store's; tokens "
                                "already issued would be refused")
            secret = stored_secret
        elif secret is None:
            secret = TokenCodec().secret
        ops = []
        # Clusters appended or resized: the fit masks are recomputed after the load, and the
        # layout is written with them (one group).
        self._refit_layout = None
        if raw is not None and msgpack.unpackb(raw).get("fit") != layout["fit"]:
            self._refit_layout = layout
        elif raw is None or msgpack.unpackb(raw) != layout:
            ops.append(("meta", LAYOUT_KEY, msgpack.packb(layout)))
        if stored_secret is None:
            ops.append(("meta", SECRET_KEY, bytes(secret)))
        if ops:
            store.commit({0: ops})
        return secret

    def _refit(self):
        # The cluster config changed since the fit masks were stored: recompute them for
        # every action that may still be placed, durably with the new layout.
        st = self._state
        with self._turn():
            for r in np.flatnonzero(st.a_state[:self._next_row] != _ST_DONE).tolist():
                st.a_fit[r] = self._fit_mask(self._compiled_of(r))
                self._dirty_fixed.add(r)
            self._op(0, "meta", LAYOUT_KEY, msgpack.packb(self._refit_layout))
        self._refit_layout = None

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

    def _update_queue_config(self, name, changes):
        try:
            return update_queue(self._queues[name], changes, self.config)
        except ConfigError as exc:
            raise ConfigError(f"queue {name}: stored live change no longer valid: {exc}") \
                from None

    def update_queue(self, name, **changes):
        """Change a queue live (same keys as its config table). In-flight work is untouched;
        the new limits gate the next admission. The change is durable (it survives a
        restart, on top of the config file's table). Returns the new queue config."""
        if name not in self._queues:
            raise NotFound(f"queue {name!r} does not exist")
        new = update_queue(self._queues[name], changes, self.config)
        merged = {**self._queue_changes.get(name, {}), **changes}
        try:
            raw = msgpack.packb(merged)
        except (TypeError, ValueError) as exc:
            raise SpecError(f"queue {name}: change is not plain data: {exc}") from None
        with self._turn():
            self._apply_queue(new)
            self._queue_changes[name] = merged
            self._op(0, "queues", name.encode(), raw)
        return new

    # ------------------------------------------------------------------ loop turns

    @contextlib.contextmanager
    def turn(self):
        """Group everything done inside into one loop turn: one store transaction and one
        sync at the end, and nothing acknowledged before it (calls inside return as usual,
        but the group becomes durable only when the block exits without error). On a
        failed commit memory is restored to what the store holds and the error raised."""
        with self._turn():
            yield self

    @contextlib.contextmanager
    def deferred_turn(self):
        """A loop turn whose commit is left to the caller: the block's transitions are
        applied in memory and encoded, when it exits, into a :class:`Group` (yielded at
        entry, filled at exit) to pass to :meth:`commit`. Nothing done inside is durable,
        nor may it be acknowledged, until that commit returns; decisions it makes stay in
        the dispatch channel until then. Several groups may be pending (decide turn N+1
        while turn N syncs); they commit in order. While any is pending only deferred
        turns may run."""
        if self._depth:
            raise StoreError("a deferred turn cannot be nested in another turn")
        group = Group(next(self._group_seq))
        self._deferring = True
        try:
            with self._turn():
                yield group
        finally:
            self._deferring = False
        if self._stopped is None and group.state == "open":
            group.batch = self._pending_batch
            group.dispatch_tail = self._kernel.d_tail
            group.state = "pending"
            self._pending_batch = None
            self._pending.append(group)

    def decide(self):
        """One tick's decision without its commit (:meth:`schedule` is ``decide`` then
        :meth:`commit`): fire due timers, expire leases whose heartbeats stopped, run the
        Cython tick. Returns the pending :class:`Group`; its ``placed`` is the number of
        assignments, which reach the dispatch channel's drainable end once it is
        committed."""
        with self.deferred_turn() as group:
            group.placed, group.swept = self._decide_body()
        return group

    def commit(self, group):
        """Make a pending :class:`Group` durable (groups commit in the order they were
        decided). On failure memory is restored to what the store holds, which discards
        this group and every later pending one (their state becomes ``"discarded"``), and
        the error is raised: nothing of them may be acted on."""
        if group.state != "pending":
            raise StoreError(f"group {group.seq} is {group.state}, not pending")
        if self._pending[0] is not group:
            raise StoreError(f"group {group.seq} commits after group {self._pending[0].seq}")
        try:
            self._write(group.batch)
        except BaseException:
            for g in self._pending:
                g.state = "discarded"
                g.batch = None
            self._pending.clear()
            raise
        self._pending.popleft()
        group.state = "committed"
        group.batch = None
        self._committed_tail = group.dispatch_tail

    @property
    def pending_groups(self):
        """Deferred groups decided but not committed yet, oldest first."""
        return tuple(self._pending)

    @contextlib.contextmanager
    def _turn(self):
        if self._stopped is not None:
            raise StoreError(f"shard stopped: {self._stopped}")
        if self._depth == 0 and self._pending and not self._deferring:
            raise StoreError(f"{len(self._pending)} decided group(s) not committed yet: "
                             f"commit them before another turn")
        self._depth += 1
        ok = False
        try:
            yield
            ok = True
        finally:
            self._depth -= 1
            if self._depth == 0:
                if ok and self._deferring:
                    self._pending_batch = self._encode() if self._has_dirty() else {}
                    self._clear_dirty()
                elif ok:
                    self._commit()
                elif self._has_dirty():
                    # An error after memory changed: put memory back to what disk holds
                    # (which also discards every pending deferred group).
                    for g in self._pending:
                        g.state = "discarded"
                        g.batch = None
                    self._pending.clear()
                    self._restore()

    def _has_dirty(self):
        return bool(self._dirty or self._dirty_fixed or self._dirty_fz or self._ops
                    or self._history_dirty)

    def _touch(self, row):
        self._dirty.add(row)

    def _commit(self):
        if self._has_dirty():
            self._write(self._encode())
        self._committed_tail = self._kernel.d_tail

    def _write(self, batch):
        """Commit one encoded group; on failure restore memory := disk and raise."""
        if not batch:
            self._clear_dirty()
            return
        store = self._store
        while True:
            try:
                store.commit(batch)
                break
            except StoreFull:
                grow = getattr(store, "resize", None)
                size = getattr(store, "map_size", None)
                limit = self.config.storage.max_map_size
                if grow is not None and size is not None and size < limit:
                    grow(min(size * 2, limit))   # nothing was applied: retry the group
                    continue
                self._restore()
                raise
            except OwnershipError as exc:
                self._stopped = f"ownership lost: {exc}"
                raise
            except StoreFailed:
                # Unknown outcome: reopen (finishes or discards the group) and reload.
                store.close()
                store.open(self.config.storage.shard, self._wall.time_ns())
                self._restore()
                raise
            except BaseException:
                self._restore()
                raise
        self._clear_dirty()

    def _restore(self):
        """Memory := disk, keeping the connected workers' sessions."""
        connected = [(name, self._clusters[self._state.w_cluster[row]],
                      int(self._state.w_slots[row]))
                     for name, row in self._workers.items() if self._state.w_connected[row]]
        self._clear_dirty()
        self._load()
        for name, cluster, slots in connected:
            # Only workers whose identity is durable: a registration that failed with this
            # turn is undone (re-registering it here would drop its identity record).
            if name in self._idents:
                self._register(name, cluster, slots)
        self._clear_dirty()

    def _load(self):
        load(self)
        self._committed_tail = self._kernel.d_tail   # restored decisions are durable

    def _encode(self):
        """The turn's group: dirty rows' fixed records, outcomes, and the edges."""
        st = self._state
        batch = {p: list(ops) for p, ops in self._ops.items()}
        for task in self._history_dirty:
            data = self.history.encode(task) if self.history.count(task) else None
            batch.setdefault(0, []).append(
                ("history", row_key(self._tasks[task]), msgpack.packb([task, data])))
        rows = self._dirty | self._dirty_fixed
        if rows:
            idx = np.fromiter(rows, dtype=np.int64, count=len(rows))
            idx.sort()
            # Rows whose Python record is their truth get an attempts record, and their
            # fixed record says so; a lean row's fixed record is its whole outcome.
            heavy = idx[st.a_edges[idx] == 1]
            st.a_lean[heavy] = 0
            size = self._codec_records.action_size
            buf = bytearray(idx.size * size)
            self._codec_records.encode_actions(idx, buf)
            view = memoryview(buf)
            keys = idx.astype(">u8").tobytes()       # row_key of every row, in one pass
            parts = st.a_part[idx].tolist()
            recs = self._recs
            for i in range(idx.size):
                ops = batch.setdefault(parts[i], [])
                key = keys[8 * i:8 * i + 8]
                ops.append(("actions", key, view[i * size:(i + 1) * size]))
            for r in heavy.tolist():
                rec = recs.get(r)
                if rec is not None:   # else restored and untouched: its record stands
                    batch.setdefault(int(st.a_part[r]), []).append(
                        ("attempts", row_key(r), encode_outcome(rec)))
        if self._dirty_fz:
            idx = np.fromiter(self._dirty_fz, dtype=np.int64, count=len(self._dirty_fz))
            idx.sort()
            recs = np.zeros(idx.size, FINALIZE_DTYPE)
            recs["row"] = idx
            for name in finalize_columns():
                recs[name] = getattr(st, "fz_" + name)[idx]
            rows_ = st.fz_action[idx]
            recs["pref"] = self._ident_of_rows(st.fz_pref[idx])
            recs["holder"] = self._ident_of_rows(st.fz_worker[idx])
            parts = st.a_part[rows_].tolist()
            for i, f in enumerate(idx.tolist()):
                batch.setdefault(parts[i], []).append(
                    ("finalize", row_key(f), recs[i:i + 1].tobytes()))
        return batch

    def _ident_of_rows(self, rows):
        rows = np.asarray(rows)
        return np.where(rows >= 0, self._state.w_ident[np.maximum(rows, 0)], -1)

    def close(self):
        """Release the store (claims are released so a successor can start at once)."""
        self._store.close()

    def renew(self):
        """Renew the shard's partition claims (call well within ``storage.claim_ttl``);
        ``OwnershipError`` means another shard took over: this one must stop."""
        try:
            now = self._wall.time_ns()
            out = self._store.renew(now)
            self._next_renew_ns = now + self._store.claim_ttl_ns // 3
            return out
        except OwnershipError as exc:
            self._stopped = f"ownership lost: {exc}"
            raise

    # ------------------------------------------------------------------ workers

    def register_worker(self, worker_id, cluster, slots):
        """Connect a worker of ``cluster`` offering ``slots`` lease slots (reconnect: same id).

        After a restart, a worker that held leases adopts them when it registers again
        (same id): its next heartbeat validates them. A worker registering again within a
        running shard starts a new session, and its old session's leases expire."""
        if not isinstance(worker_id, str) or not worker_id:
            raise SpecError(f"worker id must be a non-empty string, not {worker_id!r}")
        if cluster not in self._cluster_index:
            raise NotFound(f"worker {worker_id}: cluster {cluster!r} is not configured "
                           f"(clusters: {', '.join(self._clusters)})")
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise SpecError(f"worker {worker_id}: slots {slots!r} must be an integer >= 1")
        old = self._workers.get(worker_id)
        c = self._cluster_index[cluster]
        if old is not None and self._state.w_cluster[old] != c:
            raise SpecError(f"worker {worker_id} is registered in cluster "
                            f"{self._clusters[self._state.w_cluster[old]]}, not {cluster}")
        with self._turn():
            self._register(worker_id, cluster, slots)

    def _register(self, worker_id, cluster, slots):
        st = self._state
        c = self._cluster_index[cluster]
        old = self._workers.get(worker_id)
        # Every connection is a new session row: leases of an earlier session are refused
        # as stale when the worker presents them again, and expire.
        row = len(self._worker_names)
        if st.ensure("workers", row + 1):
            self._bind()
        ident = self._idents.get(worker_id)
        if ident is None:
            ident = len(self._ident_names)
            self._idents[worker_id] = ident
            self._ident_names.append((worker_id, cluster))
            self._op(0, "workers", row_key(ident), msgpack.packb([worker_id, cluster]))
        if old is not None:
            st.w_connected[old] = 0
        st.w_ident[row] = ident
        self._workers[worker_id] = row
        self._worker_names.append(worker_id)
        st.n_workers = row + 1
        self._kernel.set_counts(st.n_workers, st.n_envs)
        st.w_cluster[row] = c
        st.w_slots[row] = slots
        st.w_connected[row] = 1
        if old is not None and old in self._adoptable:
            self._adopt(old, row)
        elif old is not None:
            self._end_session(old)

    def _adopt(self, old, row):
        # Restored leases of this worker move to its new session (tokens carry no session).
        st = self._state
        self._adoptable.discard(old)
        n, nf = self._next_row, self._n_finalize
        held = int(st.w_adm[old] - st.w_rel[old])
        st.a_worker[:n][st.a_worker[:n] == old] = row
        st.fz_worker[:nf][st.fz_worker[:nf] == old] = row
        st.fz_pref[:nf][st.fz_pref[:nf] == old] = row
        st.w_adm[row] += held
        st.w_rel[old] = st.w_adm[old]

    def _end_session(self, old):
        # A new session proves the old one is gone: its leases expire now (the tokens it
        # still presents are refused on heartbeat and report alike) and are reassigned.
        st = self._state
        n, nf = self._next_row, self._n_finalize
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
        return [self._aid(int(a)) for a in held]

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
        Specs of identical content (all but the action name) are compiled and stored once.
        """
        cfg = self.config
        plan, ids, seen, per_queue, batch_run_caps = [], [], set(), {}, {}
        cache = {}      # (run key, content) -> (compiled template, content bytes)
        for i, spec in enumerate(specs):
            try:
                if isinstance(spec, dict):
                    spec = ActionSpec.from_dict(spec)
                key = spec_content(spec) if isinstance(spec, ActionSpec) else None
                hit = cache.get(key) if key is not None else None
                if hit is None:
                    c = compile_spec(spec, self._resources, self._queues,
                                     cfg.engine.default_queue)
                    if key is not None:
                        cache[key] = (c, key)
                else:
                    # The same content in this run: the template's checks hold (its spec
                    # stands for this one but for the id, which only the group records).
                    c = copy.copy(hit[0])
                    c.id = ActionId.parse(spec.id)
                    if c.parent == c.id:
                        raise SpecError(f"action {c.id}: an action cannot be its own parent")
            except SpecError as exc:
                raise type(exc)(f"batch item {i}: {exc}") if len(specs) > 1 else exc from None
            existing = self._lookup(c.id)
            if existing is not None:
                if not self._same_spec(existing, spec):
                    raise AlreadyExists(f"action {c.id} exists with a different spec")
                ids.append(c.id)
                continue
            if c.id in seen:
                raise SpecError(f"batch item {i}: action {c.id} appears twice in the batch")
            if c.parent is not None and c.parent not in seen:
                self._check_parent(c, f"batch item {i}: ")
            self._check_run_cap(c, batch_run_caps, f"batch item {i}: ")
            seen.add(c.id)
            per_queue[c.queue] = per_queue.get(c.queue, 0) + 1
            plan.append((key, c))
            ids.append(c.id)
        self._check_depth(per_queue)
        if not plan:
            return ids
        with self._turn():
            now = self.clock.now_ns()
            first = self._next_row
            # Consecutive actions of identical content form one group (rows in batch order).
            groups, start = [], 0
            for k in range(1, len(plan) + 1):
                if k == len(plan) or plan[k][0] is None or plan[k][0] != plan[start][0]:
                    run = plan[start:k]
                    c0 = run[0][1]
                    content = run[0][0] if run[0][0] is not None else spec_content(c0.spec)
                    groups.append((c0, [c.id.action for _key, c in run], None,
                                   np.fromiter((name_hash(str(c.id)) for _k, c in run),
                                               dtype=np.uint64, count=len(run)), content))
                    start = k
            self._insert_groups(groups, now)
            self._kernel.push_many(np.arange(first, self._next_row, dtype=np.int32))
        return ids

    def enqueue_fanout(self, template, names, inputs=None):
        """Enqueue ``len(names)`` actions that share ``template`` (an ActionSpec) and differ
        only in their names: action ``i`` is the template's id with its last part replaced by
        ``names[i]`` (the template's own name is not enqueued), with the optional input
        reference ``inputs[i]`` (a string handed to the worker with the lease). The spec is
        compiled, checked and stored once; the batch is one group commit. Atomic like
        :meth:`enqueue_many`: a name that exists with the same spec is a no-op, with another
        spec ``AlreadyExists``. Returns the ids of every name, in order (an
        :class:`~engine.ActionIds` sequence of ``ActionId``)."""
        if isinstance(template, dict):
            template = ActionSpec.from_dict(template)
        c = compile_spec(template, self._resources, self._queues,
                         self.config.engine.default_queue)
        names, inputs = check_names(names, inputs)
        aid = c.id
        if c.parent is not None and c.parent.run_key == aid.run_key and c.parent.action in (
                set(names)):
            raise SpecError(f"fan-out of {aid.run_key}: action {c.parent} cannot be its own "
                            f"parent")
        prefix = aid.run_key + "/"
        texts = [prefix + name for name in names]
        hashes = np.fromiter((name_hash(t) for t in texts), dtype=np.uint64, count=len(texts))
        rows = self._probe(hashes, texts)
        new = rows < 0
        parts = (aid.tenant, aid.project, aid.domain, aid.run)
        for i in np.flatnonzero(~new).tolist():
            spec = replace(c.spec, id=texts[i])
            old_ref = self._input_ref(int(rows[i]))
            if not self._same_spec(int(rows[i]), spec) or old_ref != (
                    inputs[i] if inputs is not None else None):
                raise AlreadyExists(f"action {texts[i]} exists with a different spec")
        ids = ActionIds.of_names(parts, names)
        if not new.any():
            return ids
        if c.parent is not None:
            self._check_parent(c, "")
        self._check_run_cap(c, {}, "")
        self._check_depth({c.queue: int(new.sum())})
        idx = np.flatnonzero(new)
        with self._turn():
            now = self.clock.now_ns()
            first = self._next_row
            content = spec_content(c.spec)
            if idx.size == len(names):
                self._insert_groups([(c, names, inputs, hashes, content)], now)
            else:
                self._insert_groups([(c, [names[i] for i in idx.tolist()],
                                      None if inputs is None else [inputs[i] for i in
                                                                   idx.tolist()],
                                      hashes[idx], content)], now)
            self._kernel.push_many(np.arange(first, self._next_row, dtype=np.int32))
        return ids

    def _check_parent(self, c, where):
        prow = self._lookup(c.parent)
        if prow is None:
            raise SpecError(f"{where}action {c.id}: parent {c.parent} not found")
        if self._phase_of(prow) == Phase.ABORTED:
            raise SpecError(f"{where}action {c.id}: parent {c.parent} was aborted")

    def _check_run_cap(self, c, batch_run_caps, where):
        run = self._runs.get(c.id.run_key)
        mac = c.spec.run_max_action_concurrency
        if run is not None:
            run_cap = int(self._state.u_cap[run])
        else:
            # A run new in this batch takes the cap of its first action here.
            run_cap = batch_run_caps.setdefault(c.id.run_key, mac)
        if mac and run_cap != mac:
            raise SpecError(f"{where}action {c.id}: run {c.id.run_key} already "
                            f"has max_action_concurrency {run_cap}")

    def _check_depth(self, per_queue):
        for qname, n in per_queue.items():
            q = self._queue_index[qname]
            depth = self._queues[qname].depth
            if self._state.q_pending[q] + n > depth:
                raise ResourceExhausted(
                    f"queue {qname}: depth {depth} reached ({self._state.q_pending[q]} queued, "
                    f"{n} more asked); nothing was enqueued")

    def _same_spec(self, row, spec):
        old = self._spec_of(row)
        # A restored spec comes back in its stored form (pods a tuple): compare the stored
        # forms when the objects differ.
        return old == spec or decode_spec(encode_spec(old)) == decode_spec(encode_spec(spec))

    def _start_name_index(self, hashes):
        """Sort restored name hashes into the lookup index in a background thread."""
        def build():
            order = np.argsort(hashes, kind="stable")
            self._idx_hash, self._idx_row = hashes[order], order.astype(np.int64)

        self._index_thread = threading.Thread(target=build, name="leasehold-name-index",
                                              daemon=True)
        self._index_thread.start()

    def _lookup(self, aid):
        """The row of action ``aid``, or None."""
        text = str(aid)
        return self._find(name_hash(text), text, aid)

    def _find(self, h, text, aid=None):
        row = self._hash_rows.get(h)
        if row is not None and str(self._aid(row)) == text:
            return row
        if self._collided:
            row = self._collided.get(aid if aid is not None else ActionId.parse(text))
            if row is not None:
                return row
        if self._index_thread is not None:
            self._index_thread.join()
            self._index_thread = None
        if not self._idx_hash.size:
            return None
        i = int(np.searchsorted(self._idx_hash, np.uint64(h)))
        while i < self._idx_hash.size and self._idx_hash[i] == h:
            r = int(self._idx_row[i])
            if str(self._aid(r)) == text:   # a 64-bit hash may collide: verify
                self._index_row(h, r, aid if aid is not None else ActionId.parse(text))
                return r
            i += 1
        return None

    def _index_row(self, h, row, aid):
        if self._hash_rows.setdefault(h, row) != row:
            self._collided[aid] = row

    def _probe(self, hashes, texts):
        """Rows of the given names (-1 where new): one pass over the batch."""
        out = np.full(len(texts), -1, dtype=np.int64)
        get = self._hash_rows.get
        hits = [i for i, h in enumerate(hashes.tolist()) if get(h) is not None]
        if self._index_thread is not None:
            self._index_thread.join()
            self._index_thread = None
        if self._idx_hash.size:
            pos = np.searchsorted(self._idx_hash, hashes)
            pos = np.minimum(pos, self._idx_hash.size - 1)
            hits += np.flatnonzero(self._idx_hash[pos] == hashes).tolist()
        if self._collided:
            hits = range(len(texts))
        for i in sorted(set(hits)):
            row = self._find(int(hashes[i]), texts[i])
            if row is not None:
                out[i] = row
        return out

    # ------------------------------------------------------------------ rows and their edges
    # A row is *lean* (a_edges 0) while its columns are its whole outcome: one attempt on the
    # common path (queued, dispatched, running, succeeded), its spec in its enqueue group.
    # It has no Python object; anything else (explain, attempts, a failure, a retry, an
    # abort) gives it its Python record (_materialize), which is its truth from then on.

    def _group_of(self, row):
        gid = int(self._state.a_group[row])
        g = self._groups.get(gid)
        if g is None:
            g = self._load_group(gid, int(self._state.a_part[row]))
        return g

    def _load_group(self, gid, part):
        key = group_key(gid)
        raw = self._store.get(part, "specs", key)
        if raw is None:
            raise CorruptRecord(part, "specs", key, f"enqueue group {gid} has no record")
        try:
            content, names, inputs = decode_group(raw)
            spec = decode_content(content, names[0])
            c = compile_spec(spec, self._resources, self._queues,
                             self.config.engine.default_queue)
        except Exception as exc:
            raise CorruptRecord(part, "specs", key, f"undecodable enqueue group: {exc}") \
                from None
        g = self._groups[gid] = EnqueueGroup(gid, c, names, inputs, content)
        return g

    def _compiled_of(self, row):
        """The compiled spec of ``row`` (its group's template for a lean row: the same but
        for the id)."""
        rec = self._recs.get(row)
        return rec.compiled if rec is not None else self._group_of(row).compiled

    def _spec_of(self, row):
        """The exact spec of ``row`` (its group's, with its own id)."""
        g = self._group_of(row)
        aid = g.action_id(int(self._state.a_gidx[row]))
        return g.compiled.spec if aid == g.compiled.id else replace(g.compiled.spec,
                                                                      id=str(aid))

    def _input_ref(self, row):
        return self._group_of(row).input_ref(int(self._state.a_gidx[row]))

    def _phase_of(self, row):
        rec = self._recs.get(row)
        if rec is not None:
            return rec.phase
        if self._state.a_edges[row]:
            return self._rec(row).phase
        return PHASES[self._state.a_phase[row]]

    def _rec(self, row):
        """The Python record of ``row``, made from its columns (a lean row) or decoded from
        the store on first use after a load."""
        rec = self._recs.get(row)
        if rec is None:
            rec = self._materialize(row)
        return rec

    def _aid(self, row):
        rec = self._recs.get(row)
        if rec is not None:
            return rec.compiled.id
        return self._group_of(row).action_id(int(self._state.a_gidx[row]))

    def _materialize(self, row):
        st = self._state
        part, key = int(st.a_part[row]), row_key(row)
        g = self._group_of(row)
        aid = g.action_id(int(st.a_gidx[row]))
        # The group's compiled template with this row's id; its spec stays the group's (the
        # same but for the id: _spec_of gives the exact one).
        c = copy.copy(g.compiled)
        c.id = aid
        c.queue = self._queue_names[int(st.a_queue[row])]
        if st.a_lean[row] and not st.a_edges[row]:
            # Its columns are its outcome: one attempt on the common path.
            if int(st.a_attempt[row]) != 1:
                raise CorruptRecord(part, "actions", key, f"lean action row {row} is on "
                                                          f"attempt {int(st.a_attempt[row])}")
            att = Attempt(number=1, enqueued_ns=int(st.a_enqueued[row]))
            start = int(st.a_start[row])
            if start != NEVER:
                att.generation = int(st.a_gen[row])
                att.cluster = self._clusters[st.a_cluster[row]]
                att.worker = self._worker_names[st.a_worker[row]]
                att.start_ns = start
            if int(st.a_running[row]) != NEVER:
                att.running_ns = int(st.a_running[row])
            phase = PHASES[st.a_phase[row]]
            message = ""
            if phase in (Phase.SUCCEEDED, Phase.ABORTED):
                att.end_ns = int(st.a_done[row])
                att.phase = phase.value
            if phase == Phase.ABORTED:
                message = att.message = self._abort_reason(row)
            rec = _Action(compiled=c, row=row, first_enqueued_ns=int(st.a_enqueued[row]),
                          phase=phase, message=message, attempts=[att])
        else:
            raw_out = self._store.get(part, "attempts", key)
            if raw_out is None:
                raise CorruptRecord(part, "attempts", key, f"action row {row} has no such "
                                                           f"record")
            try:
                phase, message, kind, cause, ur, sr, attempts = decode_outcome(raw_out)
            except Exception as exc:
                raise CorruptRecord(part, "attempts", key, f"undecodable action record: "
                                                           f"{exc}") from None
            rec = _Action(compiled=c, row=row, first_enqueued_ns=int(st.a_enqueued[row]),
                          phase=Phase(phase), message=message, error_kind=kind, cause=cause,
                          attempts=attempts, user_retries=ur, system_retries=sr)
        self._recs[row] = rec
        st.a_edges[row] = 1
        return rec

    def _insert_groups(self, groups, now):
        """Insert enqueue groups ``[(compiled, names, inputs, hashes, content)]`` as new
        rows in order: per group what it shares (run, lanes, pool, fit, task, its record),
        per row vector operations over the whole batch."""
        st = self._state
        counts = np.fromiter((len(g[1]) for g in groups), dtype=np.int64, count=len(groups))
        n = int(counts.sum())
        first = self._next_row
        if st.ensure("actions", first + n):
            self._bind()
        self._next_row += n
        sl = slice(first, first + n)
        cols = {k: np.empty(len(groups), dtype=np.int64) for k in (
            "queue", "run", "qrun", "lane", "env", "part", "task", "group", "parent")}
        fits = np.empty(len(groups), dtype=np.uint64)
        demand = np.empty((len(groups), st.n_res), dtype=np.int64)
        start = first
        deadlines, queued = [], []
        offsets = (first + np.cumsum(counts) - counts).tolist()
        local, done = {}, 0         # id text -> row of this batch's earlier groups
        st.a_child[sl] = -1         # (before the loop: a parent may be in this batch)
        for k, (c, names, inputs, _hashes, content) in enumerate(groups):
            gid = self._next_gid
            self._next_gid += 1
            q = self._queue_index[c.queue]
            part = self._part_of(c.id.tenant)
            u = self._run_row(c, part)
            qr = self._qrun_row(q, u)
            env = self._env_row(c, q, part) if c.env_key is not None else -1
            fast = env >= 0 and st.e_cluster[env] >= 0
            parent = -1
            if c.parent is not None:
                # The parent may be earlier in this batch (its columns are not set yet).
                while done < k:
                    g0, lo = groups[done][0], offsets[done]
                    prefix = g0.id.run_key + "/"
                    local.update((prefix + name, lo + i)
                                 for i, name in enumerate(groups[done][1]))
                    done += 1
                parent = local.get(str(c.parent))
                if parent is None:
                    parent = self._lookup(c.parent)
            for key, value in (("queue", q), ("run", u), ("qrun", qr),
                               ("lane", 2 * qr + int(fast)), ("env", env), ("part", part),
                               ("task", self._task_row(c.spec.task)), ("group", gid),
                               ("parent", parent)):
                cols[key][k] = value
            fits[k] = self._fit_mask(c)
            demand[k] = c.demand
            m = len(names)
            if parent >= 0:
                # Newest child first: each row's next sibling is the one inserted before it.
                st.a_sibling[start] = st.a_child[parent]
                st.a_sibling[start + 1:start + m] = np.arange(start, start + m - 1)
                st.a_child[parent] = start + m - 1
            else:
                st.a_sibling[start:start + m] = -1
            if c.spec.id != str(c.id):
                c.spec = replace(c.spec, id=str(c.id))
            self._groups[gid] = EnqueueGroup(gid, c, names, inputs, content)
            self._op(part, "specs", group_key(gid), encode_group(content, names, inputs))
            t = c.spec.timeouts
            if t.deadline is not None:
                deadlines.append((start, start + m, now + int(t.deadline * 1e9)))
            if t.max_queued_time is not None:
                queued.append((start, start + m, now + int(t.max_queued_time * 1e9)))
            start += m
        for key in ("queue", "run", "qrun", "lane", "env", "part", "task", "group", "parent"):
            getattr(st, "a_" + key)[sl] = np.repeat(cols[key], counts)
        st.a_fit[sl] = np.repeat(fits, counts)
        st.a_demand[sl] = np.repeat(demand, counts, axis=0)
        st.a_gidx[sl] = np.arange(n, dtype=np.int32) - np.repeat(
            (np.cumsum(counts) - counts).astype(np.int32), counts)
        st.a_gen[sl] = 0
        st.a_released_gen[sl] = 0
        st.a_enqueued[sl] = now
        st.a_attempt[sl] = 1
        st.a_lean[sl] = 1
        st.a_edges[sl] = 0
        st.a_phase[sl] = _Q
        st.a_start[sl] = NEVER
        st.a_running[sl] = NEVER
        st.a_done[sl] = NEVER
        hashes = groups[0][3] if len(groups) == 1 else np.concatenate([g[3] for g in groups])
        st.a_name_hash[sl] = hashes
        self._index_new(hashes, first, groups)
        for lo, hi, due in deadlines:
            for r in range(lo, hi):
                self._timer(due, T_DEADLINE, r, 0)
        for lo, hi, due in queued:
            for r in range(lo, hi):
                self._timer(due, T_QUEUED, r, 1)
        self._dirty_fixed.update(range(first, first + n))

    def _index_new(self, hashes, first, groups):
        index = self._hash_rows
        hl = hashes.tolist()
        n = len(hl)
        before = len(index)
        taken = {h: index[h] for h in hl if h in index}
        index.update(zip(hl, range(first, first + n), strict=True))
        if taken or len(index) - before != n:
            # A 64-bit hash shared with another id (astronomically rare): the first row keeps
            # the hash, every later one is found by its id.
            index.update(taken)
            owner = dict(taken)
            for i, h in enumerate(hl):
                if owner.setdefault(h, first + i) != first + i:
                    index[h] = owner[h]
                    self._collided[self._aid(first + i)] = first + i

    def _new_attempt(self, rec, now):
        rec.attempts.append(Attempt(number=len(rec.attempts) + 1, enqueued_ns=now))
        self._state.a_attempt[rec.row] = len(rec.attempts)
        self._touch(rec.row)
        t = rec.compiled.spec.timeouts
        if t.max_queued_time is not None:
            self._timer(now + int(t.max_queued_time * 1e9), T_QUEUED, rec.row,
                        len(rec.attempts))

    def _timer(self, due_ns, kind, row, ref):
        heapq.heappush(self._timers, (due_ns, next(self._seq), kind, row, ref))
        column = _DUE_COLUMNS.get(kind)
        if column is not None:
            getattr(self._state, column)[row] = due_ns
            self._touch(row)

    def _run_row(self, c, part):
        st = self._state
        row = self._runs.get(c.id.run_key)
        if row is None:
            row = len(self._runs)
            if st.ensure("runs", row + 1):
                self._bind()
            self._runs[c.id.run_key] = row
            self._run_keys.append(c.id.run_key)
            st.u_cap[row] = c.spec.run_max_action_concurrency
            self._op(part, "runs", row_key(row), msgpack.packb(
                [c.id.run_key, c.spec.run_max_action_concurrency]))
        return row

    def _qrun_row(self, q, u):
        st = self._state
        row = self._qruns.get((q, u))
        if row is None:
            row = len(self._qruns)
            if st.ensure("qruns", row + 1):
                self._bind()
            self._qruns[(q, u)] = row
            st.qr_queue[row] = q
            st.qr_run[row] = u
        return row

    def _env_row(self, c, q, part):
        st = self._state
        row = self._envs.get(c.env_key)
        if row is None:
            row = len(self._envs)
            if st.ensure("envs", row + 1):
                self._bind()
            self._envs[c.env_key] = row
            st.e_queue[row] = q
            st.e_slots[row] = c.env_slots
            st.e_idle_ttl[row] = c.env_idle_ttl_ns
            st.e_footprint[row] = c.demand
            st.n_envs = row + 1
            self._op(part, "envs", row_key(row), msgpack.packb(
                [c.env_key, c.queue, c.env_slots, c.env_idle_ttl_ns, c.demand.tolist()]))
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
        problem = fit_problem(c, cap, self._shapes[i])
        if problem is None:
            return None
        kind, k = problem
        if kind == "capacity":
            name = res.names[k]
            return (f"cluster {self._clusters[i]} has {format_quantity(name, int(cap[k]))} "
                    f"{name} in all, it needs {format_quantity(name, int(c.demand[k]))}")
        role = c.spec.pods[k].role if c.spec.pods else "pod"
        return (f"{role} ({res.describe(c.pods[k])}) fits no node shape of cluster "
                f"{self._clusters[i]}")

    # ------------------------------------------------------------------ the tick

    def schedule(self):
        """Run one tick now: fire due timers (deadline, max_queued_time, retry backoff,
        runtime backstop), expire leases whose heartbeats stopped, then the Cython tick.
        Every decision is durable (one group commit) before this returns; assignments then
        wait in the dispatch channel (:meth:`drain_dispatch`). Actions that can never fit
        end FAILED (SYSTEM, UNSCHEDULABLE). Returns the number of assignments."""
        with self._turn():
            return self._decide_body()[0]

    def _decide_body(self):
        wall = self._wall.time_ns()
        if wall >= self._next_renew_ns:
            self.renew()
        now = self.clock.now_ns()
        self._fire_timers(now)
        swept = now >= self._next_sweep_ns
        if swept:
            for lease in self.expired_leases():
                self.expire(lease)
            self._next_sweep_ns = now + self._sweep_period_ns
        kernel = self._kernel
        st = self._state
        before = kernel.d_tail
        placed = kernel_pass(kernel, now)
        if kernel.d_tail > before:
            # The rows this tick decided (fixed records only: the edges did not change).
            slots = np.arange(before, kernel.d_tail) % st.d_action.shape[0]
            rows, kinds = st.d_action[slots], st.d_kind[slots]
            fin = kinds == _FINALIZE
            self._dirty_fixed.update(rows[~fin].tolist())
            if fin.any():
                self._dirty_fz.update(rows[fin].tolist())
        for i in range(kernel.f_count):
            self._fail_unschedulable(int(st.f_action[i]), WaitCode(int(st.f_code[i])))
        return placed, swept

    def drain_dispatch(self, limit=None):
        """Take assignments out of the dispatch channel, oldest first, with their tokens. An
        entry whose lease ended before it was drained (expired, aborted) is dropped: it is
        never delivered, so nothing can run under a generation that already ended. Handing
        an assignment out is recorded durably (a restart re-dispatches only what was never
        handed out)."""
        with self._turn():
            return self._drain(limit)

    def drain_columns(self, limit=None):
        """The columnar :meth:`drain_dispatch`: the same entries, bookkeeping and durability,
        returned as one :class:`DispatchBatch` of arrays (tokens minted in one pass) instead
        of an ``Assignment`` per lease."""
        with self._turn():
            return self._drain_columns(limit)

    def _drain(self, limit):
        return self._drain_columns(limit).assignments()

    def _drain_columns(self, limit):
        k, st = self._kernel, self._state
        # A deferred turn hands out only what committed groups decided.
        n = (self._committed_tail if self._deferring else k.d_tail) - k.d_head
        if limit is not None:
            n = min(n, limit)
        if n <= 0:
            return DispatchBatch(DispatchBatch.empty_columns(), {}, self._clusters,
                                 self._worker_names, self._queue_names)
        slots = np.arange(k.d_head, k.d_head + n) % st.d_action.shape[0]
        rows = st.d_action[slots].astype(np.int64)
        gens = st.d_gen[slots].copy()
        kinds = st.d_kind[slots].copy()
        fin = kinds == _FINALIZE
        run = ~fin
        keep = np.zeros(n, dtype=bool)
        # Entries whose lease ended before the drain (expired, aborted) are never delivered.
        r = rows[run]
        keep[run] = ((st.a_gen[r] == gens[run]) & (st.a_end[r] == _END_LIVE)
                     & ((st.a_state[r] == _ST_SENT) | (st.a_state[r] == _ST_RUNNING)))
        f = rows[fin]
        keep[fin] = (st.fz_gen[f] == gens[fin]) & (st.fz_end[f] == _END_LIVE)
        k.consume_dispatch(n)
        rows, gens, kinds, fin, slots = rows[keep], gens[keep], kinds[keep], fin[keep], \
            slots[keep]
        m = rows.size
        arows = rows.copy()
        attempt = np.empty(m, dtype=np.int32)
        att_enq = np.empty(m, dtype=np.int64)
        if fin.any():
            arows[fin] = st.fz_action[rows[fin]]
            attempt[fin] = st.fz_attempt[rows[fin]]
        lean = ~fin & (st.a_edges[arows] == 0)
        if lean.any():
            # The common path in columns: stamped once, INITIALIZING while sent, delivered.
            lr = rows[lean]
            now = self.clock.now_ns()
            st.a_start[lr] = np.where(st.a_start[lr] == NEVER, now, st.a_start[lr])
            sent = lr[st.a_state[lr] == _ST_SENT]
            st.a_phase[sent] = _INIT
            st.a_delivered_gen[lr] = gens[lean]
            attempt[lean] = 1
            att_enq[lean] = st.a_enqueued[lr]
            self._dirty_fixed.update(lr.tolist())
        for i in np.flatnonzero(~lean).tolist():
            row, gen = int(rows[i]), int(gens[i])
            if fin[i]:
                arow, number = int(arows[i]), int(attempt[i])
                rec = self._rec(arow)
                rec.attempts[number - 1].finalize = "SENT"
                st.fz_delivered_gen[row] = gen
                self._dirty_fz.add(row)
                self._touch(arow)
                att_enq[i] = rec.attempts[number - 1].enqueued_ns
                continue
            rec = self._rec(row)
            att = self._stamp_attempt(rec)
            if rec.phase not in TERMINAL_PHASES and st.a_state[row] == _ST_SENT:
                rec.phase = Phase.INITIALIZING
            st.a_delivered_gen[row] = gen
            self._touch(row)
            attempt[i] = att.number
            att_enq[i] = att.enqueued_ns
        tokens = np.empty((m, 3), dtype=np.uint64)
        tokens[:, 0] = (kinds.astype(np.uint64) << np.uint64(63)) | rows.astype(np.uint64)
        tokens[:, 1] = gens.astype(np.uint64)
        self._codec.mint_array(tokens)
        group = st.a_group[arows].copy()
        cols = {
            "kind": kinds, "lease_row": rows, "action_row": arows, "generation": gens,
            "cluster": st.d_cluster[slots].copy(), "worker": st.d_worker[slots].copy(),
            "attempt": attempt, "queue": st.a_queue[arows].copy(), "group": group,
            "index": st.a_gidx[arows].copy(), "first_enqueued_ns": st.a_enqueued[arows].copy(),
            "attempt_enqueued_ns": att_enq, "tokens": tokens,
        }
        groups = {gid: self._group_of(int(arows[i])) for gid, i in zip(
            *np.unique(group, return_index=True), strict=True)}
        return DispatchBatch(cols, {int(g): v for g, v in groups.items()}, self._clusters,
                             self._worker_names, self._queue_names)

    def _stamp_lean(self, row):
        # A lean row has one attempt and one generation: stamped once, at its first use.
        st = self._state
        if st.a_start[row] == NEVER:
            st.a_start[row] = self.clock.now_ns()
            self._dirty_fixed.add(row)

    def tick(self):
        """Schedule once and return the assignments made (the in-process dispatcher), in
        one loop turn (one group commit)."""
        with self._turn():
            self.schedule()
            return self._drain(None)

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
            self._touch(rec.row)
        return att

    # ------------------------------------------------------------------ timers

    def _due_timers(self, now):
        """Pop every due timer, from the heap (set since load) and the restored arrays."""
        due = []
        while self._timers and self._timers[0][0] <= now:
            t = heapq.heappop(self._timers)
            due.append((t[0], t[1], t[2], t[3], t[4]))
        rt = self._restored_timers
        if rt is not None and self._rt_pos < rt[0].size and rt[0][self._rt_pos] <= now:
            end = int(np.searchsorted(rt[0], now, side="right"))
            for i in range(self._rt_pos, end):
                due.append((int(rt[0][i]), -1, int(rt[1][i]), int(rt[2][i]), int(rt[3][i])))
            self._rt_pos = end
        due.sort()
        return due

    def _fire_timers(self, now):
        while True:
            due = self._due_timers(now)
            if not due:
                return
            for _due, _seq, kind, row, ref in due:
                self._fire(kind, row, ref)

    def _fire(self, kind, row, ref):
        st = self._state
        if kind == T_FINALIZE:
            self._finalize_give_up(row, ref)
            return
        state = st.a_state[row]
        if state == _ST_DONE:
            return
        if self._phase_of(row) in TERMINAL_PHASES:
            return
        if kind == T_DEADLINE:
            # The engine enforces the deadline before dispatch; a running attempt is
            # bounded by its worker, which was given the deadline with the lease.
            if state in (_ST_QUEUED, _ST_BACKOFF):
                rec = self._rec(row)
                self._end_attempt(rec, Phase.TIMED_OUT, cause="deadline",
                                  message="deadline passed before dispatch")
                self._finish(rec, Phase.TIMED_OUT, "deadline passed before dispatch",
                             cause="deadline")
        elif kind == T_QUEUED:
            if state == _ST_QUEUED and int(st.a_attempt[row]) == ref:
                rec = self._rec(row)
                self._kernel.remove(row)          # leaves the row in state DONE
                self._attempt_failed(rec, Phase.TIMED_OUT, None, "max_queued_time",
                                     "max_queued_time passed while queued", True)
        elif kind == T_RETRY:
            if state == _ST_BACKOFF and int(st.a_attempt[row]) == ref:
                self._kernel.push(row)
                self._touch(row)
        elif kind == T_RUNTIME:
            # Engine backstop for max_runtime: the worker should have ended it.
            if (state == _ST_RUNNING and int(st.a_gen[row]) == ref
                    and st.a_end[row] == _END_LIVE):
                rec = self._rec(row)
                self._stamp_attempt(rec)
                self._end_lease(row, _END_EXPIRED)
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
        rows = rows[np.isin(st.a_state[rows], LIVE_STATES) & (st.a_end[rows] == _END_LIVE)]
        out = [(LeaseKind.RUN, int(r), int(st.a_gen[r]), int(st.a_worker[r])) for r in rows]
        frows = np.flatnonzero(st.fz_expiry[:self._n_finalize] < now)
        frows = frows[(st.fz_state[frows] == _ST_SENT) & (st.fz_end[frows] == _END_LIVE)]
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
        with self._turn():
            return self._expire_lease(lease)

    def _expire_lease(self, lease):
        kind, row, gen, worker = lease
        st = self._state
        if kind == LeaseKind.FINALIZE:
            if (int(st.fz_gen[row]) != gen or int(st.fz_worker[row]) != worker
                    or st.fz_state[row] != _ST_SENT or st.fz_end[row] != _END_LIVE):
                return False
            st.fz_end[row] = _END_EXPIRED
            st.fz_expiry[row] = NEVER
            self._kernel.release_finalize(row)
            arow = int(st.fz_action[row])
            self._rec(arow).attempts[int(st.fz_attempt[row]) - 1].finalize = "PENDING"
            self._touch(arow)
            self._dirty_fz.add(row)
            self._kernel.push_finalize(row)   # sticky: its preferred worker, else its cluster
            return True
        if (int(st.a_gen[row]) != gen or int(st.a_worker[row]) != worker
                or st.a_state[row] not in LIVE_STATES or st.a_end[row] != _END_LIVE):
            return False
        rec = self._rec(row)
        self._stamp_attempt(rec)
        self._end_lease(row, _END_EXPIRED)
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
        phase, kind_ = self._check_report(phase, error_kind, cause)
        verdict, kind, row = self._check_token(token)
        if verdict != Verdict.OK:
            return verdict
        with self._turn():
            return self._report(kind, row, phase, kind_, cause, recoverable, message, cleanup)

    def _check_report(self, phase, error_kind, cause):
        """Check one report's arguments (as :meth:`report` does); returns (phase, kind)."""
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
        return phase, kind_

    def report_many(self, tokens, phases, *, worker=None, error_kinds=None, causes=None,
                    recoverable=None, messages=None, cleanup=None):
        """The reports of one worker message, in one loop turn (one group commit): each is
        what :meth:`report` would do with ``tokens[i]`` (24-byte tokens back to back, a list,
        or an n x 3 uint64 array) and ``phases[i]`` (a Phase or its name), and the optional
        per-report ``error_kinds``, ``causes``, ``recoverable``, ``messages`` and ``cleanup``
        sequences. All tokens are checked in one nogil pass (against ``worker``'s sessions
        when given, else any holder); the common transitions of lean rows (INITIALIZING,
        RUNNING, SUCCEEDED) apply as vector operations, the rest one by one in order.
        Arguments are checked first: a bad one raises ``SpecError`` naming its index and
        nothing is applied. Returns the refused reports as :class:`Refusal` (token,
        verdict); they changed nothing."""
        arr = self._codec.parse(tokens)
        n = arr.shape[0]
        if isinstance(phases, (Phase, str)):
            phases = [phases] * n       # one phase for every report
        phases = list(phases)
        if len(phases) != n:
            raise SpecError(f"{len(phases)} phases for {n} tokens")

        def column(name, values, default):
            if values is None:
                return [default] * n
            values = list(values)
            if len(values) != n:
                raise SpecError(f"{name} has {len(values)} items for {n} tokens")
            return values

        plain = messages is None and cleanup is None
        kinds_in = column("error_kinds", error_kinds, None)
        causes = column("causes", causes, None)
        recoverable = column("recoverable", recoverable, True)
        messages = column("messages", messages, "")
        cleanup = column("cleanup", cleanup, False)
        checked, seen = [], {}
        for i in range(n):
            key = (phases[i], kinds_in[i], causes[i])
            try:
                hit = seen.get(key)
            except TypeError:           # unhashable: checked (and refused) below
                hit = None
            if hit is None:
                try:
                    hit = self._check_report(*key)
                except SpecError as exc:
                    raise SpecError(f"report {i}: {exc}") from None
                try:
                    seen[key] = hit
                except TypeError:
                    pass
            checked.append(hit)
        session = -1
        if worker is not None:
            session = self._worker_row(worker)
        verdicts = np.empty(n, dtype=np.uint8)
        validate(self._kernel, arr, session, self.clock.now_ns(), self._codec.k0,
                 self._codec.k1, verdicts, False)
        lease = arr[:, 0]
        is_run = (lease >> np.uint64(63)) == 0
        rows = (lease & np.uint64((1 << 63) - 1)).astype(np.int64)
        codes = np.fromiter((PHASE_CODE[p] for p, _k in checked), dtype=np.uint8, count=n)
        st = self._state
        ok = verdicts == Verdict.OK
        simple = np.ones(n, dtype=bool) if plain else np.fromiter(
            (not messages[i] and not cleanup[i] for i in range(n)), dtype=bool, count=n)
        fast = ok & is_run & simple & np.isin(codes, (_INIT, _RUNNING, _SUCCEEDED))
        fast[fast] = st.a_edges[rows[fast]] == 0
        if fast.any():
            # A lease reported twice in one message takes the ordered path.
            fr = rows[fast]
            uniq, counts = np.unique(fr, return_counts=True)
            if (counts > 1).any():
                fast[fast] = ~np.isin(fr, uniq[counts > 1])
        refused = []
        with self._turn():
            if fast.any():
                self._report_lean_many(rows[fast], codes[fast])
            for i in np.flatnonzero(~fast).tolist():
                if ok[i]:
                    # Earlier reports of this message may have moved this lease on.
                    verdict, kind, row = self._check_token(arr[i:i + 1])
                else:
                    verdict = Verdict(int(verdicts[i]))
                if verdict != Verdict.OK:
                    refused.append(Refusal(arr[i].astype("<u8").tobytes(), verdict))
                    continue
                phase, kind_ = checked[i]
                self._report(kind, row, phase, kind_, causes[i], recoverable[i], messages[i],
                             cleanup[i])
        return refused

    def _report_lean_many(self, rows, codes):
        # _report_lean over distinct lean rows, in vector operations.
        st = self._state
        now = self.clock.now_ns()
        st.a_start[rows] = np.where(st.a_start[rows] == NEVER, now, st.a_start[rows])
        self._dirty_fixed.update(rows.tolist())
        init = rows[(codes == _INIT) & (st.a_state[rows] != _ST_RUNNING)]
        st.a_phase[init] = _INIT
        run = rows[(codes == _RUNNING) & (st.a_state[rows] != _ST_RUNNING)]
        if run.size:
            st.a_state[run] = _ST_RUNNING      # stops the queued-time clock
            st.a_running[run] = now
            st.a_phase[run] = _RUNNING
            pred = st.t_pred_rt[st.a_task[run]]
            later = (pred != NEVER) & (now + np.minimum(pred, NEVER - now) > st.a_pred_end[run])
            st.a_pred_end[run[later]] = now + pred[later]
            grace = self.config.engine.runtime_grace
            for gid in np.unique(st.a_group[run]).tolist():
                t = self._group_of(int(run[st.a_group[run] == gid][0])).compiled.spec.timeouts
                if t.max_runtime is not None:
                    due = now + int((t.max_runtime + grace) * 1e9)
                    for r in run[st.a_group[run] == gid].tolist():
                        self._timer(due, T_RUNTIME, r, int(st.a_gen[r]))
        done = rows[codes == _SUCCEEDED]
        if done.size:
            began = np.where(st.a_running[done] != NEVER, st.a_running[done], st.a_start[done])
            tasks = st.a_task[done]
            for t in np.unique(tasks).tolist():
                name = self._task_names[t]
                self.history.record_many_ns(name, np.maximum(0, now - began[tasks == t]))
                self._history_dirty.add(name)
                self._refresh_prediction(name, t)
            st.a_end[done] = _END_COMPLETED
            st.a_expiry[done] = NEVER
            release = self._kernel.release
            for r in done.tolist():
                release(r, now)
            st.a_state[done] = _ST_DONE
            st.a_done[done] = now
            st.a_phase[done] = _SUCCEEDED

    def _report(self, kind, row, phase, kind_, cause, recoverable, message, cleanup):
        verdict = Verdict.OK
        if kind == LeaseKind.FINALIZE:
            if phase in (Phase.SUCCEEDED, Phase.FAILED):
                self._end_finalize(row, _END_COMPLETED, phase.value)
            elif phase == Phase.TIMED_OUT:
                raise SpecError("a finalize lease ends SUCCEEDED or FAILED")
            return verdict
        st = self._state
        if not st.a_edges[row] and (phase in (Phase.INITIALIZING, Phase.RUNNING) or (
                phase == Phase.SUCCEEDED and not message and not cleanup)):
            return self._report_lean(row, phase)
        rec = self._rec(row)
        now = self.clock.now_ns()
        att = self._stamp_attempt(rec)
        if phase == Phase.INITIALIZING:
            # Reports may arrive out of order: a running attempt never goes back.
            if st.a_state[row] != _ST_RUNNING and rec.phase != Phase.INITIALIZING:
                rec.phase = Phase.INITIALIZING
                self._touch(row)
            return verdict
        if phase == Phase.RUNNING:
            if st.a_state[row] != _ST_RUNNING:
                self._touch(row)
                st.a_state[row] = _ST_RUNNING   # stops the queued-time clock
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
            self._end_lease(row, _END_COMPLETED)
            self._end_attempt(rec, Phase.SUCCEEDED, message=message, cleanup=cleanup)
            self._finish(rec, Phase.SUCCEEDED, message)
            return verdict
        if phase == Phase.FAILED:
            self._end_lease(row, _END_COMPLETED)
            self._attempt_failed(rec, Phase.FAILED, kind_, cause, message,
                                 bool(recoverable), cleanup=cleanup)
            return verdict
        # TIMED_OUT, with the bound the worker enforced.
        self._end_lease(row, _END_COMPLETED)
        self._attempt_failed(rec, Phase.TIMED_OUT, None, cause, message, True, cleanup=cleanup)
        return verdict

    def _report_lean(self, row, phase):
        # The common path of a lean row, in its columns (same rules as _report).
        st = self._state
        self._stamp_lean(row)
        self._dirty_fixed.add(row)
        if phase == Phase.INITIALIZING:
            if st.a_state[row] != _ST_RUNNING:
                st.a_phase[row] = _INIT
            return Verdict.OK
        now = self.clock.now_ns()
        g = self._group_of(row)
        if phase == Phase.RUNNING:
            if st.a_state[row] != _ST_RUNNING:
                st.a_state[row] = _ST_RUNNING   # stops the queued-time clock
                st.a_running[row] = now
                st.a_phase[row] = _RUNNING
                pred = int(st.t_pred_rt[st.a_task[row]])
                if pred != NEVER and now + pred > st.a_pred_end[row]:
                    st.a_pred_end[row] = now + pred
                t = g.compiled.spec.timeouts
                if t.max_runtime is not None:
                    grace = self.config.engine.runtime_grace
                    self._timer(now + int((t.max_runtime + grace) * 1e9), T_RUNTIME, row,
                                int(st.a_gen[row]))
            return Verdict.OK
        began = int(st.a_running[row])
        if began == NEVER:
            began = int(st.a_start[row])
        self._record_runtime(g.compiled.spec.task, now - began)
        self._end_lease(row, _END_COMPLETED)
        st.a_done[row] = now
        st.a_phase[row] = _SUCCEEDED
        return Verdict.OK

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
        row = self._row_of(action)
        token = self._codec.mint(LeaseKind.RUN, row, generation)
        verdict = self.report(token, phase, **kw)
        if verdict != Verdict.OK:
            raise SpecError(f"action {self._aid(row)}: report for generation {generation} "
                            f"refused: {verdict.name}")

    # ------------------------------------------------------------------ abort

    def abort(self, action, reason="aborted"):
        """Abort ``action`` and every descendant: queued ones end at once; sent or running
        ones are refused at their next heartbeat (their worker stops them) and get a
        finalize lease for cleanup. Returns the ids that ended (an ``ActionIds``
        sequence)."""
        if not isinstance(reason, str):
            raise SpecError(f"an abort reason is a string, not {reason!r}")
        root = self._row_of(action)
        st = self._state
        out = np.empty(self._next_row, dtype=np.int64)
        rows = out[:descendants(st.a_child, st.a_sibling, root, out)]
        with self._turn():
            now = self.clock.now_ns()
            lean = st.a_edges[rows] == 0
            phase = st.a_phase[rows]
            # Lean rows still queued end in their columns, with the reason stored once.
            quick = lean & (st.a_state[rows] == _ST_QUEUED) & (phase == _Q)
            q = rows[quick]
            if q.size:
                remove = self._kernel.remove
                for r in q.tolist():
                    remove(r)
                st.a_state[q] = _ST_DONE
                st.a_phase[q] = _ABORTED
                st.a_done[q] = now
                st.a_abort[q] = root
                self._dirty_fixed.update(q.tolist())
                self._op(int(st.a_part[root]), "attempts", abort_key(root),
                         msgpack.packb(reason))
                self._abort_reasons[root] = reason
            # The rest one by one: what still runs gets its finalize lease.
            done = lean & ~quick & np.isin(phase, _LEAN_TERMINAL)
            ended = quick.copy()
            for i in np.flatnonzero(~quick & ~done).tolist():
                row = int(rows[i])
                if self._phase_of(row) in TERMINAL_PHASES:
                    continue
                rec = self._rec(row)
                cleanup = False
                if st.a_state[row] in LIVE_STATES:
                    self._stamp_attempt(rec)
                    self._end_lease(row, _END_ABORTED)
                    cleanup = True
                self._end_attempt(rec, Phase.ABORTED, message=reason, cleanup=cleanup)
                self._finish(rec, Phase.ABORTED, reason)
                ended[i] = True
            hit = rows[ended]
            gids = st.a_group[hit]
            groups = {g: self._group_of(int(hit[k])) for g, k in zip(
                *np.unique(gids, return_index=True), strict=True)}
            return ActionIds.of_rows({int(g): v for g, v in groups.items()}, gids,
                                     st.a_gidx[hit])

    def _abort_reason(self, row):
        # The reason of the abort that ended lean row ``row`` (stored once per abort).
        root = int(self._state.a_abort[row])
        reason = self._abort_reasons.get(root)
        if reason is None:
            part = int(self._state.a_part[root])
            raw = self._store.get(part, "attempts", abort_key(root))
            if raw is None:
                raise CorruptRecord(part, "attempts", abort_key(root),
                                    f"aborted row {row} has no abort reason")
            reason = self._abort_reasons[root] = msgpack.unpackb(raw)
        return reason

    # ------------------------------------------------------------------ transitions

    def _end_lease(self, row, end):
        # The current generation ends: later tokens for it get `end` as their verdict, and
        # its in-flight counts are released (once per generation).
        st = self._state
        st.a_end[row] = end
        st.a_expiry[row] = NEVER
        self._kernel.release(row, self.clock.now_ns())
        st.a_state[row] = _ST_DONE
        self._touch(row)

    def _end_attempt(self, rec, phase, kind=None, cause=None, message="", recoverable=None,
                     cleanup=False):
        att = rec.attempt
        self._touch(rec.row)
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
        self._state.a_state[rec.row] = _ST_BACKOFF
        rec.phase = Phase.QUEUED
        self._new_attempt(rec, ready)
        self._timer(ready, T_RETRY, rec.row, len(rec.attempts))

    def _fail_unschedulable(self, row, code):
        rec = self._rec(row)
        self._touch(row)
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
        self._touch(row)
        if st.a_state[row] == _ST_QUEUED:
            self._kernel.remove(row)
        self._kernel.release(row, self.clock.now_ns())
        st.a_state[row] = _ST_DONE
        rec.phase = phase
        rec.message = message
        rec.error_kind = kind
        rec.cause = cause

    # ------------------------------------------------------------------ finalize leases

    def _new_finalize(self, rec, att):
        st = self._state
        f = self._n_finalize
        if st.ensure("finalize", f + 1):
            self._bind()
        self._n_finalize += 1
        row = rec.row
        st.fz_action[f] = row
        st.fz_attempt[f] = att.number
        st.fz_cluster[f] = self._cluster_index[att.cluster]
        st.fz_pref[f] = st.a_worker[row]
        give_up = self.clock.now_ns() + int(self.config.engine.finalize_timeout * 1e9)
        st.fz_give_up[f] = give_up
        att.finalize = "PENDING"
        self._kernel.push_finalize(f)
        self._dirty_fz.add(f)
        self._touch(row)
        self._timer(give_up, T_FINALIZE, f, 0)

    def _end_finalize(self, f, end, outcome):
        st = self._state
        st.fz_end[f] = end
        st.fz_expiry[f] = NEVER
        self._kernel.release_finalize(f)
        st.fz_state[f] = _ST_DONE
        arow = int(st.fz_action[f])
        self._rec(arow).attempts[int(st.fz_attempt[f]) - 1].finalize = outcome
        self._dirty_fz.add(f)
        self._touch(arow)

    def _finalize_give_up(self, f, _ref):
        # Its own generous bound passed: record the leak loudly rather than retry forever.
        st = self._state
        if st.fz_state[f] == _ST_DONE:
            return
        if st.fz_state[f] == _ST_QUEUED:
            self._kernel.remove_finalize(f)
        self._end_finalize(f, _END_ABORTED, "ABANDONED")

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
                self._bind()
            self._tasks[task] = row
            self._task_names.append(task)
            self._refresh_prediction(task, row)
            self._history_dirty.add(task)       # the task row itself is durable
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
        (e.g. seeded from another shard); queued and later actions of the task predict from
        it at once. Durable like every transition. A malformed record raises ``ValueError``
        naming the task; nothing changes."""
        with self._turn():
            self.history.load(task, data)
            self._task_row(task)
            self._history_dirty.add(task)
            self._refresh_prediction(task, self._tasks[task])

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
        queued = (st.a_state[:n] == _ST_QUEUED) & (st.a_queue[:n] == q)
        enq = st.a_enqueued[:n]
        ahead = queued & ((enq < enq[row]) | ((enq == enq[row]) & (np.arange(n) < row)))
        return int(np.count_nonzero(ahead)) + 1

    # ------------------------------------------------------------------ queries

    def phase(self, action):
        """The action's phase."""
        return self.explain(action).phase

    def _row_of(self, action):
        aid = ActionId.parse(action)
        row = self._lookup(aid)
        if row is None:
            raise NotFound(f"action {aid} not found")
        return row

    def _record(self, action):
        return self._rec(self._row_of(action))

    def explain(self, action):
        """The action's phase and, while it waits, the reason (code and message), its
        position in its queue (by enqueue time) and, for a blocked head, its estimated start
        (``eta_ns``: its shadow time from the runtime history of what runs; None unknown)."""
        rec = self._record(action)
        aid = rec.compiled.id
        st = self._state
        row = rec.row
        if st.a_state[row] == _ST_BACKOFF:
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
        if st.a_state[row] != _ST_QUEUED:
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
                WaitCode.CLUSTER_CAPACITY, WaitCode.HEAD_OF_LINE, WaitCode.QUEUE_BUDGET):
            # Only a STRICT_FIFO head holds what frees up; a GREEDY one may be passed over.
            # A head short of budget starts when its queue's leases release enough of it.
            if code == WaitCode.QUEUE_BUDGET:
                eta = self._kernel.budget_eta(row, self.clock.now_ns())
            else:
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
            return (f"run {self._run_keys[u]}: max_action_concurrency "
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
            b = self._aid(blocker)
            btask = self._compiled_of(blocker).spec.task
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
            return (f"queue {qname}: warm pool {self._aid(row).run}/"
                    f"{self._compiled_of(row).spec.environment} on "
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
            if head >= 0 and st.a_state[head] == _ST_QUEUED:
                exp = self.explain(self._aid(head))
                blocked = {
                    "since_ns": int(st.q_head_since[q]),
                    "action": str(self._aid(head)),
                    "reason": exp.reason,
                    "code": exp.wait.name if exp.wait is not None else None,
                    "demand": self._resources.describe(st.a_demand[head]),
                }
            eta = None
            if blocked is not None and exp.wait in (WaitCode.CLUSTER_CAPACITY,
                                                    WaitCode.HEAD_OF_LINE,
                                                    WaitCode.QUEUE_BUDGET):
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

    def inspect(self):
        """A read-only :class:`~engine.Inspection` of this engine's state (arrays, counters,
        timers, the dispatch channel, the edges of a row), for tests, benches and metrics."""
        return Inspection(self)

    @property
    def store(self):
        """The :class:`~storage.Store` this engine writes through."""
        return self._store

    @property
    def resources(self):
        """The shard's :class:`~engine._units.ResourceSet`."""
        return self._resources

    @property
    def tick_count(self):
        """Ticks run so far."""
        return self._kernel.tick_no


