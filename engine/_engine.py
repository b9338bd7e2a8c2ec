"""The in-process engine: one shard's decision core over numpy arrays and the Cython tick.

Everything later (storage, transport, supervisor) wraps this class; none of it reimplements
scheduling. Python keeps the edges (names to rows, specs, history); the arrays and the tick
keep the decision state. Time comes from an injectable clock.
"""

import collections
import itertools
import time

import msgpack
import numpy as np

from cext import RecordCodec, TickKernel
from cext._bulk import decided_rows
from engine._admission import AdmissionMixin, AlreadyExists
from engine._attempts import AttemptsMixin
from engine._clock import SystemClock
from engine._codes import LeaseKind, Phase, WaitCode
from engine._config import STRICT_FIFO, Config, load_config, update_queue
from engine._dispatch import Assignment, DispatchBatch
from engine._errors import ConfigError, NotFound, SpecError
from engine._explain import ExplainMixin, Explanation
from engine._history import ShapePriors, shape_key
from engine._index import IndexMixin
from engine._inspect import Inspection
from engine._journal import Group, JournalMixin, _DeferredTurn
from engine._leases import TokenCodec
from engine._leasing import EXPIRY_BATCH, LeasingMixin, Refusal
from engine._model import compile_spec
from engine._projection import ProjectionMixin
from engine._reclaimed import ReclaimedNames
from engine._records import (
    LAYOUT_KEY,
    SECRET_KEY,
)
from engine._retain import RETENTION_BATCH, RetentionMixin
from engine._rows import (
    ST_DONE,
    ST_FREE,
)
from engine._state import NEVER, State, check_fits_memory
from engine._timers import TimersMixin
from storage import (
    CorruptRecord,
    LmdbStore,
    OwnershipError,
    StoreLost,
    partition_of,
)

# decided_changes() when the last decide changed nothing on its own.
_NO_CHANGES = ((), (), (), ())

__all__ = ["Engine", "Assignment", "DispatchBatch", "Explanation", "AlreadyExists", "Refusal",
           "Group", "kernel_pass"]


def kernel_pass(kernel, now):
    """The Cython tick alone: a function of its own so that a profile or an allocation
    trace can attribute what the kernel call itself costs."""
    return kernel.run(now)


class Engine(AdmissionMixin, IndexMixin, LeasingMixin, AttemptsMixin, TimersMixin,
             JournalMixin, ExplainMixin, ProjectionMixin, RetentionMixin):
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
        check_fits_memory(config)
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
        if store is None:
            sc = config.storage
            store = LmdbStore(sc.path, partitions=sc.partitions, map_size=sc.map_size,
                              sync=sc.sync, claim_ttl_s=sc.claim_ttl)
        self._store = store
        self._stopped = None        # why the shard stopped (lost ownership), or None
        self._tenant_parts = {}     # tenant -> partition (a cache of partition_of)
        self._depth = 0             # nesting of transitions in the current loop turn
        self._turn_failed = False   # a call inside this turn raised something unexpected
        self._deferring = False     # the current turn is deferred (decide / deferred_turn)
        self._hand_out_own = False  # ... and may hand out what is not committed yet
        self._pending = collections.deque()   # deferred groups not committed yet, in order
        self._pending_batch = None  # the batch a deferred turn just encoded
        self._pending_retained = None   # ... and the retained outcomes it writes
        self._history_samples = set()   # history keys with samples not yet in the store
        self._shape_names = {}          # pod matrix bytes -> its shape_key (a cache)
        self._templates = {}            # spec content -> (compiled, content) (a cache)
        self._node_index = {}           # cluster row -> {node name: index} (node reports)
        self._history_flush_ns = 0      # engine clock: when they are written at the latest
        self._group_seq = itertools.count(1)
        self._committed_tail = 0    # dispatch ring position up to which decisions are durable
        self._store.open(config.storage.shard, self._wall.time_ns())
        # Claims are renewed from the loop (schedule) well within their ttl (wall clock:
        # they are judged by other processes).
        self._next_renew_ns = self._wall.time_ns() + self._store.claim_ttl_ns // 3
        try:
            secret, meta = self._load_meta(secret)
            self._codec = TokenCodec(secret)
            self._load()
            if self._refit_layout is not None:
                self._refit()
            if meta:
                # Written once the memory is made: a first start that fails leaves a store
                # any config can start on, not one that holds this config's layout.
                self._store.commit({0: meta})
        except BaseException:
            self._store.close()
            raise

    # ------------------------------------------------------------------ durable state

    def _take_over(self, restored):
        """Take over a :class:`~engine._reload.Restored` (what :func:`~engine._reload.load`
        read from the store) as this engine's memory: the arrays, the kernel told of its
        lanes and dispatch, the Python edges."""
        settings = self.config.engine
        self._queues = {q.name: q for q in self.config.queues}
        self._state = st = restored.state
        self.history = restored.history
        self._task_names = restored.task_names
        self._tasks = {task: row for row, task in enumerate(self._task_names)}
        self._refresh_predictions()
        # History key -> (its store key, its record's packed [task, shape] prefix): rows
        # are the store's, so they go with the memory they came with.
        self._history_prefix = {}
        self._recs = {}             # row -> _Action: rows whose Python record is their truth
        self._hash_rows = {}        # name hash -> row (rows created or looked up since load)
        self._collided = {}         # ActionId -> row, for the rare hash taken by another id
        # Names reclaimed since this load (a bounded filter); the run rows whose first
        # reclaim has been (judged), and those of them whose every retained outcome is in
        # the filter (none was stored then, and it has not been cleared since: fresh).
        self._reclaimed_names = ReclaimedNames()
        self._runs_judged = set()
        self._runs_fresh = set()
        self._groups = {}           # group id -> EnqueueGroup (loaded on first use)
        self._abort_reasons = {}    # row an abort was called on -> its reason (lean rows)
        # Row an abort was called on -> (partition, [(done_ns, starts, lengths)]): the lean
        # rows it ended whose records it did not rewrite (engine/_aborts.py).
        self._abort_rows = restored.abort_rows
        self._next_gid = restored.next_gid
        self._idx_hash = np.zeros(0, dtype=np.uint64)   # restored rows: sorted name hashes
        self._idx_row = np.zeros(0, dtype=np.int64)     # ... and their rows
        self._index_thread = None   # builds the index above after a load
        self._run_keys = restored.run_keys      # run row -> run key (None: a free row)
        self._runs = {key: row for row, key in enumerate(self._run_keys) if key is not None}
        self._free_runs = [row for row, key in enumerate(self._run_keys) if key is None]
        # Tenant name -> tenant row (caps and in-flight counts; rows are kept while the
        # engine lives: one per tenant seen, rebuilt from the live runs at reload).
        self._tenants = restored.tenants
        self._qruns = restored.qruns            # (queue row, run row) -> qrun row
        self._n_qruns = len(self._qruns)        # high-water qrun row
        self._free_qruns = []                   # freed qrun rows (their lanes too)
        self._envs = restored.envs              # env key -> env row
        # Durable worker identities, each restored as a detached session (row = identity):
        # disconnected, adopting nothing until the worker registers again.
        self._ident_names = restored.workers    # identity -> (worker id, cluster name)
        self._idents = {name: i for i, (name, _c) in enumerate(self._ident_names)}
        self._worker_names = [name for name, _c in self._ident_names]   # session -> id
        self._workers = dict(self._idents)      # worker id -> its current session row
        self._adoptable = set(range(len(self._ident_names)))    # restored, not yet back
        self._fit_cache = {}        # pod matrix bytes -> cluster bitmask
        # Node-aware admission (docs/nodes.md): clusters placing pods on nodes, and the pod
        # group rows interned for the gate (content -> (first, n); rebuilt at load).
        self._node_mask = sum(1 << i for i, c in enumerate(self.config.clusters)
                              if c.admission == "nodes")
        self._podgroups = {}
        self._n_podgroups = 0
        # Node names by cluster, from its first node row (engine/_nodes.py's naming).
        self._node_names = [[f"{s.name}-{k}" for s in c.node_shapes for k in range(s.count)]
                            if c.admission == "nodes" else [] for c in self.config.clusters]
        self._next_row = restored.rows  # high-water row: rows below it are actions or FREE
        self._free_rows = restored.free_rows    # reclaimed rows, ascending
        self._group_rows = restored.group_rows  # group id -> its rows still in the table
        self._next_seq = restored.next_seq      # enqueue order of the next action (a_seq)
        self._next_retention_ns = 0  # next sweep of expired retained outcomes
        self._n_finalize = restored.finalize_rows  # high-water finalize row
        self._free_fz = restored.fz_free        # freed finalize rows, ascending
        self._seq = itertools.count()
        # The timers (engine/_timers.py): a heap of (due_ns, seq, kind, row, ref) set one at
        # a time, and a heap of sorted blocks [next due, seq, due, kind, row, ref, next
        # position]: restored at load, set for many rows at once, or a rebuild's.
        self._adopt_timers(restored.timers)
        self._next_sweep_ns = 0
        self._expiries_waiting = False  # the last sweep left expired leases to the next
        # Rows whose phase the current decide changed on its own (timers, expiry), and what
        # the last one changed (decided_changes); empty on the common path.
        self._decided_rows = []
        self._decided = _NO_CHANGES
        self._queue_changes = {}    # queue name -> live changes (persisted)
        for q in self.config.queues:
            self._apply_queue(q)
        for name, changes in restored.queue_changes.items():
            self._queue_changes[name] = changes
            self._apply_queue(self._update_queue_config(name, changes))
        self._kernel = k = TickKernel()
        self._codec_records = RecordCodec()
        self._bind()
        k.set_lease_ttl(settings.lease_ttl_ns)
        k.set_counts(st.n_workers, st.n_envs)
        k.set_pools_live(restored.pools_live)
        k.relink_live(restored.rows)        # backfill's per-cluster lists of live leases
        if self._node_mask:
            self._relink_nodes(restored.rows)
        for f in restored.fz_queued.tolist():
            k.push_finalize(f)
        queued = restored.queued
        st.a_state[queued] = ST_DONE        # push() links a row and marks it QUEUED
        k.push_many(queued)
        for r in restored.redispatch.tolist():
            k.push_dispatch(LeaseKind.RUN, r, int(st.a_gen[r]), int(st.a_cluster[r]),
                            int(st.a_worker[r]))
        for f in restored.fz_redispatch.tolist():
            k.push_dispatch(LeaseKind.FINALIZE, f, int(st.fz_gen[f]), int(st.fz_cluster[f]),
                            int(st.fz_worker[f]))
        # The name index (sorted hashes) is not needed to tick: built on another core while
        # the shard starts; the first lookup of a restored name waits for it.
        if restored.name_rows.size:
            self._start_name_index(restored.name_hashes, restored.name_rows)
        self._clear_dirty()

    def _relink_nodes(self, n_rows):
        # After a load: the pod groups of every action that may still be placed on nodes
        # or holds a placement (not stored: interned again from its spec, once per content),
        # then the nodes' used vectors from the stored placements of the live leases.
        st = self._state
        state = st.a_state[:n_rows]
        rows = np.flatnonzero((state != ST_DONE) & (state != ST_FREE)
                              & ((st.a_fit[:n_rows] & np.uint64(self._node_mask)) != 0))
        for r in rows.tolist():
            st.a_pg_first[r], st.a_pg_n[r] = self._podgroup_rows(self._compiled_of(r))
        try:
            self._kernel.relink_nodes(n_rows)
        except ValueError as exc:
            raise ConfigError(
                f"{self.config.source}: clusters.*.node_shapes / admission: {exc}; start with "
                f"the configuration its live leases were placed under until they end") from None

    def _bind(self):
        # After a table grew (its arrays were replaced): rebind everything compiled.
        self._kernel.bind(self._state)
        self._codec_records.bind(self._state)

    def _part_of(self, tenant):
        part = self._tenant_parts.get(tenant)
        if part is None:
            part = self._tenant_parts[tenant] = partition_of(tenant, self._store.partitions)
        return part

    def _load_meta(self, secret):
        """Check the shard layout against the store's: the token secret, and the meta
        records to write (a new store's layout and secret, a changed layout)."""
        store = self._store
        layout = {"resources": list(self._resources.names), "clusters": self._clusters,
                  "queues": self._queue_names,
                  # What the stored fit masks were computed from (capacities, node shapes).
                  "fit": [[None if c.capacity is None else c.capacity.tolist(),
                           [sh.allocatable.tolist() for sh in c.node_shapes]]
                          + ([c.admission, [sh.count for sh in c.node_shapes],
                              self.config.engine.max_node_pods]
                             if c.admission == "nodes" else [])
                          for c in self.config.clusters]}
        pods = State.pods_of(self.config)
        if pods:
            # The width of the placement in every action record (admission = "nodes").
            layout["record_pods"] = pods
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
            if old.get("record_pods", 0) != pods:
                raise ConfigError(
                    f"{self.config.source}: engine.max_node_pods / clusters.*.admission: the "
                    f"action records of this store hold {old.get('record_pods', 0)} node "
                    f"placements each, this config {pods}: a shard with state cannot change "
                    f"whether (or how many pods) it places on nodes")
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
        return secret, ops

    def _refit(self):
        # The cluster config changed since the fit masks were stored: recompute them for
        # every action that may still be placed, durably with the new layout.
        st = self._state
        with self._turn():
            state = st.a_state[:self._next_row]
            for r in np.flatnonzero((state != ST_DONE) & (state != ST_FREE)).tolist():
                c = self._compiled_of(r)
                st.a_fit[r] = self._fit_mask(c)
                if int(st.a_fit[r]) & self._node_mask and st.a_pg_first[r] < 0:
                    st.a_pg_first[r], st.a_pg_n[r] = self._podgroup_rows(c)
                self._touch(r)
            for q in range(len(self._queue_names)):
                self._kernel.recount_queue(q)   # the gate may fail other actions on sight
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
        st.q_paused[i] = q.paused
        st.q_draining[i] = q.draining
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

    def update_queue(self, name, /, **changes):
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
            # Its clusters or hard cap may have changed what the gate would fail on sight.
            self._kernel.recount_queue(self._queue_index[name])
            self._queue_changes[name] = merged
            self._op(0, "queues", name.encode(), raw)
        return new

    # ------------------------------------------------------------------ loop turns

    def decide(self):
        """One tick's decision without its commit (:meth:`schedule` is ``decide`` then
        :meth:`commit`): fire due timers, expire leases whose heartbeats stopped, run the
        Cython tick. Returns the pending :class:`Group`; its ``placed`` is the number of
        assignments, which reach the dispatch channel's drainable end once it is
        committed."""
        # deferred_turn()'s context manager itself: one cold call less a tick.
        with _DeferredTurn(self, False) as group:
            group.placed, group.swept = self._decide_body()
        return group

    @property
    def expiries_waiting(self):
        """True when the last tick's lease-expiry sweep found more expired leases than a
        tick expires (1,024: a bounded turn): the next tick expires the next of them. A
        caller that ticks on events ticks again at once, as after :meth:`cut_short`."""
        return self._expiries_waiting

    def decided_changes(self):
        """``(ids, phases, attempts, details)``: the actions whose phase the last
        :meth:`decide` / :meth:`schedule` changed on its own, not by an assignment (those
        are drained): a timer (deadline, max_queued_time, the runtime backstop), a lease
        expiry, an action found unschedulable. Each once, in the order changed, as of its
        change, before that call's tick placed anything (a retry leased again by the same
        call is QUEUED here), with the number of its current attempt (a retry queues the
        next one, as :meth:`live_states` counts) and the change's text (a retry's: the
        failed attempt's cause and message; an end's: its reason). Four sequences, empty
        when nothing changed (the common path, which pays one empty-list check for this). The
        shard's watch records them: what a tick does on its own became an event only when
        the re-check read it, after the tick, which might have leased the retry again."""
        return self._decided

    def _decided_snapshot(self, rows, out=None):
        """The :meth:`decided_changes` entries of changed ``rows`` (each has its record),
        added to ``out``."""
        ids, phases, attempts, details = out if out is not None else ([], [], [], [])
        st = self._state
        for row in dict.fromkeys(rows):
            rec = self._rec(row)
            phase = rec.phase
            if phase == Phase.QUEUED and len(rec.attempts) > 1:
                prev = rec.attempts[-2]
                text = ": ".join(x for x in (prev.cause, prev.message) if x)
            else:
                text = rec.message
            ids.append(str(rec.compiled.id))
            phases.append(phase)
            attempts.append(int(st.a_attempt[row]))
            details.append(text or None)
        return ids, phases, attempts, details

    def close(self):
        """Write the runtime samples not yet in the store (when no decided group waits for
        its commit), then release the store (claims are released so a successor can start
        at once)."""
        try:
            if self._history_samples and not self._pending and self._stopped is None:
                self.flush_history()
        finally:
            self._store.close()     # the claims go even when that last write failed

    @property
    def turn_failed(self):
        """True when a call inside the current loop turn raised something other than the
        engine's own refusals (a bug, an overflow): memory may hold part of that call, so
        the turn is undone when it ends (memory restored to what the store holds) and
        nothing of it is written, even if the caller went on after the error."""
        return self._turn_failed

    @property
    def stopped(self):
        """Why this engine serves no more (``"ownership lost: ..."``: another shard took its
        store over, so every further turn is refused), or None while it serves. A process
        whose engine stopped must exit: it no longer owns anything it holds in memory."""
        return self._stopped

    def renew(self):
        """Renew the shard's partition claims (call well within ``storage.claim_ttl``);
        ``OwnershipError`` means another shard took over, ``StoreLost`` that a data file
        went from under it: either way this one stops (``stopped`` says why)."""
        try:
            now = self._wall.time_ns()
            out = self._store.renew(now)
            self._next_renew_ns = now + self._store.claim_ttl_ns // 3
            return out
        except OwnershipError as exc:
            self._stopped = f"ownership lost: {exc}"
            raise
        except StoreLost as exc:
            self._stopped = f"store lost: {exc}"
            raise

    # ------------------------------------------------------------------ workers

    # ------------------------------------------------------------------ enqueue

    # ------------------------------------------------------------------ rows and their edges
    # A row is *lean* (a_edges 0) while its columns are its whole outcome: one attempt on the
    # common path (queued, dispatched, running, succeeded), its spec in its enqueue group.
    # It has no Python object; anything else (explain, attempts, a failure, a retry, an
    # abort) gives it its Python record (_materialize), which is its truth from then on.

    # ------------------------------------------------------------------ the tick

    def schedule(self):
        """Run one tick now: fire due timers (deadline, max_queued_time, retry backoff,
        runtime backstop), expire leases whose heartbeats stopped, then the Cython tick.
        Every decision is durable (one group commit) before this returns; assignments then
        wait in the dispatch channel (:meth:`drain_dispatch`). Actions that can never fit
        end FAILED (SYSTEM, UNSCHEDULABLE). Returns the number of assignments."""
        with self._turn():
            placed = self._decide_body()[0]
            now = self.clock.now_ns()
            if now >= self._next_retention_ns:
                # Expired retained outcomes, a small batch about once a second (store reads:
                # here, not in decide(), which a pipelined loop runs on its hot path and
                # pairs with sweep_retention() when idle).
                full = self._sweep_retention(now, RETENTION_BATCH)[1]
                # Behind (a batch came back full): again next tick, until caught up, so the
                # sweep keeps pace with reclaiming at any completion rate.
                self._next_retention_ns = now if full else now + 1_000_000_000
            return placed

    def _decide_body(self):
        wall = self._wall.time_ns()
        if wall >= self._next_renew_ns:
            self.renew()
        now = self.clock.now_ns()
        changed = self._decided_rows
        if changed:
            changed.clear()
        self._decided = _NO_CHANGES
        if self._timer_entries > self._timer_compact_at:
            self._compact_timers()      # (between calls: every row's columns are settled)
        timers, blocks = self._timers, self._timer_blocks
        if (timers and timers[0][0] <= now) or (blocks and blocks[0][0] <= now):
            # (Most ticks have no timer due: no pass over them.)
            self._fire_timers(now)      # (appends the rows it changes to ``changed``)
        swept = now >= self._next_sweep_ns
        if swept:
            leases = self.expired_leases(limit=EXPIRY_BATCH + 1)
            waiting = self._expiries_waiting = len(leases) > EXPIRY_BATCH
            for lease in leases[:EXPIRY_BATCH]:
                if self.expire(lease) and lease[0] == LeaseKind.RUN:
                    changed.append(lease[1])
            self._next_sweep_ns = now if waiting else now + self._sweep_period_ns
        if changed:                 # as of now: the tick may lease a retry again
            self._decided = self._decided_snapshot(changed)
        kernel = self._kernel
        st = self._state
        before = kernel.d_tail
        placed = kernel_pass(kernel, now)
        if kernel.d_tail > before:
            # The rows this tick decided (fixed records only: the edges did not change).
            rows, fz = decided_rows(kernel, before)
            if rows.size:
                self._dirty_arrays.append(rows)     # (_touch_many, without the call)
            if fz is not None:
                self._touch_fz_many(fz)
        if kernel.f_count:
            failed = [int(st.f_action[i]) for i in range(kernel.f_count)]
            for row, i in zip(failed, range(kernel.f_count), strict=True):
                self._fail_unschedulable(row, WaitCode(int(st.f_code[i])))
            self._decided = self._decided_snapshot(
                failed, None if self._decided is _NO_CHANGES else self._decided)
        return placed, swept

    def tick(self):
        """Schedule once and return the assignments made (the in-process dispatcher), in
        one loop turn (one group commit)."""
        with self._turn():
            self.schedule()
            return self._drain(None)

    # ------------------------------------------------------------------ timers

    # ------------------------------------------------------------------ expiry

    # ------------------------------------------------------------------ heartbeats

    # ------------------------------------------------------------------ reports

    # ------------------------------------------------------------------ abort

    # ------------------------------------------------------------------ transitions

    # ------------------------------------------------------------------ finalize leases

    # ------------------------------------------------------------------ backfill (issue 5)
    # Predictions feed EASY backfill (docs/predictions.md). Runtime history is per history
    # key, (task name, resource shape): each key row of t_pred_rt holds the mean of its last
    # two successful runtimes, else its shape's prior (NEVER when neither); the tick
    # combines it with the action's own runtime estimate and max_runtime (a_est_rt,
    # a_max_rt) at assignment (a_pred_end) and for every backfill candidate.

    def _task_row(self, key):
        row = self._tasks.get(key)
        if row is None:
            st = self._state
            row = len(self._tasks)
            if st.ensure("tasks", row + 1):
                self._bind()
            self._tasks[key] = row
            self._task_names.append(key)
            self._refresh_prediction(key, row)
            self._history_dirty.add(key)        # the key row itself is durable
        return row

    def _refresh_prediction(self, key, row):
        """Key row ``row``'s prediction after its history changed: its own (the mean of its
        last two successes), else its shape's prior; a changed prior reaches every key of
        the shape that has no history of its own."""
        ns = self.history.predict_ns(key)
        changed = self._own_prediction(key, row, ns)
        cold = self._cold_keys[key[1]]
        if changed and cold:            # the shape's prior moved: every key still on it
            self._state.t_pred_rt[np.fromiter(cold, np.int64, len(cold))] = \
                self._prior_of(key[1])
        elif ns is None:                # a key new to the prior: just this row
            self._state.t_pred_rt[row] = self._prior_of(key[1])

    def _own_prediction(self, key, row, ns):
        """Record key row ``row``'s own prediction ``ns`` (None: none); whether its shape's
        prior changed. A key without one joins its shape's cold keys (t_prior 1)."""
        st = self._state
        cold = self._cold_keys.setdefault(key[1], set())
        if ns is None:
            cold.add(row)
            st.t_prior[row] = 1
        else:
            cold.discard(row)
            st.t_pred_rt[row] = min(ns, NEVER - 1)
            st.t_prior[row] = 0
        return self._priors.set(key, ns)

    def _prior_of(self, shape):
        prior = self._priors.prior_ns(shape)
        return NEVER if prior is None else min(prior, NEVER - 1)

    def _refresh_predictions(self):
        """Every key row's prediction from the histories (after a load): the keys' own
        first, then each shape's prior once for its keys without history."""
        self._priors = ShapePriors()
        self._cold_keys = {}        # shape -> rows of its keys without history of their own
        for row, key in enumerate(self._task_names):
            self._own_prediction(key, row, self.history.predict_ns(key))
        for shape, cold in self._cold_keys.items():
            if cold:
                self._state.t_pred_rt[np.fromiter(cold, np.int64, len(cold))] = \
                    self._prior_of(shape)

    def _record_runtime(self, key, ns):
        self.history.record_ns(key, max(0, int(ns)))
        self._add_sample(key)
        if key in self._tasks:
            self._refresh_prediction(key, self._tasks[key])

    def history_key(self, spec):
        """The runtime history key of an action spec (an :class:`ActionSpec` or its dict):
        ``(task name, shape)``, the shape from :func:`engine._history.shape_key` in this
        shard's resources. Raises ``SpecError`` for a bad spec."""
        c = compile_spec(spec, self._resources, self._queues, self.config.engine.default_queue)
        return (c.spec.task, shape_key(self._resources.names, c.pods, c.pod_counts))

    def load_history(self, key, data):
        """Load the runtime history of ``key`` (``(task, shape)``, see :meth:`history_key`)
        from a record made by ``history.encode(key)`` (e.g. seeded from another shard);
        queued and later actions of the key predict from it at once. Durable like every
        transition. A malformed record or key raises ``ValueError`` naming the key; nothing
        changes."""
        self.history.load(key, data)    # (before the turn: a refusal changes nothing)
        with self._turn():
            self._task_row(key)
            self._history_dirty.add(key)
            self._refresh_prediction(key, self._tasks[key])

    def predicted_runtime(self, key):
        """What the history of ``key`` (``(task, shape)``) predicts one attempt runs, in
        seconds (the mean of its last two successes), or None without history. An action's
        own prediction also weighs its spec's ``runtime_estimate`` and ``max_runtime``:
        :meth:`predicted_runtime_of`."""
        return self.history.predict(key)

    def predicted_runtime_of(self, action):
        """The runtime (seconds) the tick predicts for one attempt of ``action`` (an id in
        the table), in the order of ``docs/predictions.md``: its ``runtime_estimate``, else
        its history key's recent successes, each at most its ``max_runtime``; its
        ``max_runtime`` alone when neither is known; None when nothing is known."""
        row = self._row_of(action)
        ns = int(self._predicted_rt(np.array([row], dtype=np.int64))[0])
        return None if ns == NEVER else ns / 1e9

    def _predicted_rt(self, rows):
        """The kernel's ``_pred_rt`` for many rows (ns; NEVER unknown), in numpy."""
        st = self._state
        task = st.a_task[rows]
        hist = np.where(task >= 0, st.t_pred_rt[np.maximum(task, 0)], NEVER)
        return np.where(st.a_est_rt[rows] != NEVER, st.a_est_rt[rows],
                        np.minimum(hist, st.a_max_rt[rows]))

    # ------------------------------------------------------------------ queries

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


