"""Leases: worker sessions and adoption, the drain of the dispatch channel, heartbeats, reports
(one and a message's worth) and expiry, and finalize leases.

A part of :class:`engine.Engine` (a mixin over its shared state); see engine/_engine.py."""

from dataclasses import dataclass

import msgpack
import numpy as np

from cext._bulk import drain_dispatch, held_rows, move_holder, push_finalize_many, release_many
from cext._lease import validate
from engine._codes import (
    PHASE_CODE,
    T_FINALIZE,
    T_RUNTIME,
    TERMINAL_PHASES,
    LeaseKind,
    Phase,
    Verdict,
)
from engine._dispatch import DispatchBatch
from engine._errors import NotFound, SpecError
from engine._leases import KIND_BIT as _KIND_BIT
from engine._leases import ErrorKind
from engine._nodes import node_index, unknown_node
from engine._records import (
    row_key,
)
from engine._rows import (
    BOUNDS,
    END_ABORTED,
    END_COMPLETED,
    END_EXPIRED,
    END_LIVE,
    FZ_OUTCOME_CODE,
    KIND_FINALIZE,
    LIVE_STATES,
    PH_INIT,
    PH_RUNNING,
    PH_SUCCEEDED,
    ST_DONE,
    ST_FREE,
    ST_QUEUED,
    ST_RUNNING,
    ST_SENT,
    set_state,
)
from engine._state import NEVER, W_DRAINING, W_SUSPECT

__all__ = ["LeasingMixin"]

_OK = int(Verdict.OK)   # (compared with a uint8 column: an int, not the enum)

# Leases a tick's sweep expires at most (~30 ms of the loop here), and a new session of a
# worker ends at once; the rest wait for the next tick, which a caller that ticks on events
# runs at once (Engine.expiries_waiting). All at once, a worker dying with 100,000 leases
# held the shard's loop ~3 s, in which every other worker's heartbeats went unread.
EXPIRY_BATCH = 1024
# The phases a lean row's report may apply in columns (report_many's fast path).
_LEAN_CODES = frozenset((PH_INIT, PH_RUNNING, PH_SUCCEEDED))
# Why a finalize lease's report of another phase is refused (report and report_many).
_FINALIZE_ENDS = "a finalize lease ends SUCCEEDED or FAILED"


@dataclass(frozen=True)
class Refusal:
    """A token the engine refused, and why (the worker stops the attempt behind it)."""

    token: bytes
    verdict: Verdict


class LeasingMixin:
    """Leases (a part of Engine)."""

    def register_worker(self, worker_id, cluster, slots, capacity=None):
        """Connect a worker of ``cluster`` offering ``slots`` lease slots (reconnect: same id).
        ``capacity`` (``{resource: quantity}``, what the worker measured) is checked, not
        used yet: the cluster's capacity is the config's, its free capacity what heartbeats
        say.

        After a restart, a worker that held leases adopts them when it registers again
        (same id): its next heartbeat validates them. A worker registering again within a
        running shard starts a new session, and its old session's leases expire (an old
        session that holds nothing lends the new one its session row)."""
        if not isinstance(worker_id, str) or not worker_id:
            raise SpecError(f"worker id must be a non-empty string, not {worker_id!r}")
        if capacity is not None:
            try:
                self._resources.vector(capacity, unset=-1)
            except ValueError as exc:   # (as a heartbeat's free_capacity)
                raise SpecError(f"worker {worker_id}: capacity: {exc}") from None
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
        if old is not None and st.w_adm[old] == st.w_rel[old]:
            # Its last session holds nothing (no lease of it can be presented): that row
            # serves the new one. A row per registration made a worker that reconnects
            # again and again grow the tables the tick walks for every placement.
            self._adoptable.discard(old)
            st.w_cluster[old] = c
            st.w_slots[old] = slots
            st.w_paused[old] = 0
            st.w_connected[old] = 1
            return
        # Otherwise a new session row: leases of the earlier session are refused as stale
        # when the worker presents them again, and expire.
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
        move_holder(self._kernel, n, old, row)
        st.fz_worker[:nf][st.fz_worker[:nf] == old] = row
        st.fz_pref[:nf][st.fz_pref[:nf] == old] = row
        st.w_adm[row] += held
        st.w_rel[old] = st.w_adm[old]

    def _end_session(self, old):
        # A new session proves the old one is gone: its leases expire now (the tokens it
        # still presents are refused on heartbeat and report alike) and are reassigned.
        # Past EXPIRY_BATCH, the rest are made due at once for the next ticks' sweeps.
        st = self._state
        n, nf = self._next_row, self._n_finalize
        rows = held_rows(self._kernel, n, old, expiring=True)
        for r in rows[:EXPIRY_BATCH].tolist():
            self._expire_lease((LeaseKind.RUN, r, int(st.a_gen[r]), old))
        if rows.size > EXPIRY_BATCH:
            st.a_expiry[rows[EXPIRY_BATCH:]] = self.clock.now_ns() - 1
            self._next_sweep_ns = 0
        for f in np.flatnonzero((st.fz_worker[:nf] == old) & (st.fz_expiry[:nf] != NEVER)):
            self._expire_lease((LeaseKind.FINALIZE, int(f), int(st.fz_gen[f]), old))

    def unregister_worker(self, worker_id):
        """Disconnect a worker: nothing new is placed on it. Its leases stay in flight until
        they are reported or expire; returns their action ids."""
        row = self._worker_row(worker_id)
        st = self._state
        st.w_connected[row] = 0
        return [self._aid(a) for a in held_rows(self._kernel, self._next_row, row).tolist()]

    def drain_worker(self, worker_id):
        """Place nothing new on a worker, keeping its session: its heartbeats and reports
        of what it holds are accepted as before (a SIGTERM'd worker finishing its work). A
        new registration of the worker ends the drain."""
        row = self._worker_row(worker_id)
        if not self._state.w_connected[row]:
            raise NotFound(f"worker {worker_id!r} is not connected")
        st = self._state
        st.w_paused[row] = int(st.w_paused[row]) | W_DRAINING    # a heartbeat keeps it

    def _worker_row(self, worker_id):
        try:
            return self._workers[worker_id]
        except KeyError:
            raise NotFound(f"worker {worker_id!r} is not registered") from None

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
        n = (self._committed_tail if self._deferring and not self._hand_out_own
             else k.d_tail) - k.d_head
        if limit is not None:
            n = min(n, limit)
        if n <= 0:
            return DispatchBatch(DispatchBatch.empty_columns(), {}, self._clusters,
                                 self._worker_names, self._queue_names)
        cols = DispatchBatch.new_columns(n)
        lean = np.empty(n, dtype=np.uint8)
        cols["lean"] = lean
        # One compiled pass: entries whose lease ended before the drain (expired, aborted)
        # are never delivered; lean run leases are handed out there (cext/_bulk.pyx).
        m = drain_dispatch(k, n, self.clock.now_ns(), PH_INIT, st.a_start, st.a_phase,
                           st.a_delivered_gen, st.a_edges, st.a_enqueued, st.a_queue,
                           st.a_group, st.a_gidx, st.a_held_code, st.fz_action, st.fz_attempt,
                           cols)
        del cols["lean"]
        if m < n:
            cols = {name: col[:m] for name, col in cols.items()}
        lean = lean[:m].view(bool)
        rows, arows = cols["lease_row"], cols["action_row"]
        attempt, att_enq = cols["attempt"], cols["attempt_enqueued_ns"]
        if lean.any():
            self._touch_many(rows[lean])
        fin = cols["kind"] == KIND_FINALIZE
        gens = cols["generation"]
        for i in np.flatnonzero(~lean).tolist():
            row, gen = int(rows[i]), int(gens[i])
            if fin[i]:
                arow, number = int(arows[i]), int(attempt[i])
                st.fz_delivered_gen[row] = gen
                self._dirty_fz.add(row)
                if st.a_edges[arow]:    # a lean row's attempt reads it from the finalize row
                    rec = self._rec(arow)
                    rec.attempts[number - 1].finalize = "SENT"
                    self._touch(arow)
                    att_enq[i] = rec.attempts[number - 1].enqueued_ns
                else:
                    att_enq[i] = st.a_enqueued[arow]
                continue
            rec = self._rec(row)
            att = self._stamp_attempt(rec)
            if rec.phase not in TERMINAL_PHASES and st.a_state[row] == ST_SENT:
                rec.phase = Phase.INITIALIZING
            st.a_delivered_gen[row] = gen
            self._touch(row)
            attempt[i] = att.number
            att_enq[i] = att.enqueued_ns
        self._codec.mint_array(cols["tokens"])
        group = cols["group"]
        if m <= 16:     # a few leases (an idle round trip): no sort
            groups = {}
            for gid, arow in zip(group.tolist(), arows.tolist(), strict=True):
                if gid not in groups:
                    groups[gid] = self._group_of(arow)
        else:
            groups = {int(gid): self._group_of(int(arows[i])) for gid, i in zip(
                *np.unique(group, return_index=True), strict=True)}
        nodes = self._node_hints(cols) if self._node_mask else None
        return DispatchBatch(cols, groups, self._clusters,
                             self._worker_names, self._queue_names, nodes)

    def _node_hints(self, cols):
        # Run leases on clusters with admission = "nodes": the node name of each pod, read
        # now (the drain follows the tick; the row may move on before the push).
        st = self._state
        hints = {}
        on_nodes = (cols["kind"] == LeaseKind.RUN) & (st.c_nodes[cols["cluster"]] != 0)
        for i in np.flatnonzero(on_nodes).tolist():
            row, c = int(cols["action_row"][i]), int(cols["cluster"][i])
            names = self._node_names[c]
            first = int(st.c_node_first[c])
            hints[i] = tuple(names[int(n) - first] for n in st.a_pnode[row] if n >= 0)
        return hints

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

    def lease_actions(self, tokens, runs):
        """For each token of ``tokens`` (an n x 3 uint64 array: lease id, generation, MAC),
        the id (text) of the action whose live run lease it names (the row's current
        generation, not yet ended) when that action belongs to one of the run keys
        ``runs`` (an iterable); None otherwise. Not a validation (the MAC is not checked):
        the shard names the actions of a worker's reports before applying them. One numpy
        pass over the tokens; an id is made only for a match."""
        n = tokens.shape[0]
        out = [None] * n
        st = self._state
        mine = [self._runs[k] for k in runs if k in self._runs]
        if not n or not mine:
            return out
        watched = np.zeros(len(self._run_keys), bool)
        watched[mine] = True
        ids = tokens[:, 0]
        rows = (ids & np.uint64(~_KIND_BIT & (2**64 - 1))).astype(np.int64)
        ok = ((ids & np.uint64(_KIND_BIT)) == 0) & (rows < self._next_row)
        rows = np.where(ok, rows, 0)
        ok &= st.a_gen[rows].astype(np.uint64) == tokens[:, 1]
        ok &= (st.a_state[rows] != ST_FREE) & (st.a_end[rows] == END_LIVE)
        ok &= watched[st.a_run[rows]]
        for i in np.flatnonzero(ok).tolist():
            out[i] = str(self._aid(int(rows[i])))
        return out

    def expired_leases(self, now=None, limit=None):
        """Snapshot of leases past their expiry: ``(kind, row, generation, worker row)``, run
        leases first, each kind by row; at most ``limit`` of them (None: all). Apply each
        with :meth:`expire`, which refuses a lease that moved on since."""
        now = self.clock.now_ns() if now is None else now
        st = self._state
        # Rows that are not live carry expiry NEVER, so this is one compare per row.
        rows = np.flatnonzero(st.a_expiry[:self._next_row] < now)
        rows = rows[np.isin(st.a_state[rows], LIVE_STATES) & (st.a_end[rows] == END_LIVE)]
        rows = rows[:limit]
        out = [(LeaseKind.RUN, int(r), int(st.a_gen[r]), int(st.a_worker[r])) for r in rows]
        if limit is not None and len(out) >= limit:
            return out
        frows = np.flatnonzero(st.fz_expiry[:self._n_finalize] < now)
        frows = frows[(st.fz_state[frows] == ST_SENT) & (st.fz_end[frows] == END_LIVE)]
        frows = frows[:None if limit is None else limit - len(out)]
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

    def _suspect(self, worker):
        # A worker that let a lease expire may be dead or stalled: place nothing new on it
        # until its next heartbeat proves it alive (else a killed worker, still registered,
        # would be handed the very work that just expired on it).
        st = self._state
        if self.config.engine.pause_on_expiry and worker >= 0:
            st.w_paused[worker] = int(st.w_paused[worker]) | W_SUSPECT

    def _expire_lease(self, lease):
        kind, row, gen, worker = lease
        st = self._state
        if kind == LeaseKind.FINALIZE:
            if (int(st.fz_gen[row]) != gen or int(st.fz_worker[row]) != worker
                    or st.fz_state[row] != ST_SENT or st.fz_end[row] != END_LIVE):
                return False
            self._suspect(worker)
            st.fz_end[row] = END_EXPIRED
            st.fz_expiry[row] = NEVER
            self._kernel.release_finalize(row)
            arow = int(st.fz_action[row])
            if st.a_edges[arow]:    # a lean row's attempt reads it from the finalize row
                self._rec(arow).attempts[int(st.fz_attempt[row]) - 1].finalize = "PENDING"
                self._touch(arow)
            self._dirty_fz.add(row)
            self._kernel.push_finalize(row)   # sticky: its preferred worker, else its cluster
            return True
        if (int(st.a_gen[row]) != gen or int(st.a_worker[row]) != worker
                or st.a_state[row] not in LIVE_STATES or st.a_end[row] != END_LIVE):
            return False
        self._suspect(worker)
        rec = self._rec(row)
        self._stamp_attempt(rec)
        self._end_lease(row, END_EXPIRED)
        self._attempt_failed(rec, Phase.FAILED, ErrorKind.SYSTEM, "EXPIRED",
                             "lease expired: heartbeats stopped", True, cleanup=True)
        return True

    def heartbeat(self, worker_id, tokens, free_capacity=None, node_free=None):
        """Validate and extend a batch of tokens from one worker in one Cython pass (check
        all, then extend the valid ones); record the free capacity it sees in its cluster
        (``{resource: quantity}``) and, on a cluster with admission = "nodes", on each of
        the nodes it names (``node_free``: ``{node name: {resource: quantity}}``), for the
        gate. A bad report raises ``SpecError`` naming it, before anything is recorded.
        Returns the refused tokens with verdicts; the worker stops the attempt behind each
        one. Extension is best-effort."""
        row = self._worker_row(worker_id)
        st = self._state
        if not st.w_connected[row]:
            raise NotFound(f"worker {worker_id!r} is not connected")
        arr = self._codec.parse(tokens)
        c = int(st.w_cluster[row])
        vec = nodes = None
        if free_capacity is not None:
            try:
                vec = self._resources.vector(free_capacity, unset=-1)
            except ValueError as exc:
                raise SpecError(f"worker {worker_id}: free_capacity: {exc}") from None
        if node_free is not None:
            nodes = self._node_reports(worker_id, c, node_free)
        st.w_paused[row] = int(st.w_paused[row]) & ~W_SUSPECT    # alive: it may take work
        if vec is not None:
            given = vec >= 0
            st.c_obs[c, given] = vec[given]
            st.c_obs_mark[c, given] = st.c_adm[c, given]
        for node, nvec in nodes or ():
            given = nvec >= 0
            st.n_obs[node, given] = nvec[given]
            st.n_obs_mark[node, given] = st.n_adm[node, given]
        verdicts = np.empty(arr.shape[0], dtype=np.uint8)
        validate(self._kernel, arr, row, self.clock.now_ns(), self._codec.k0,
                 self._codec.k1, verdicts, True)
        bad = np.nonzero(verdicts)[0]
        return [Refusal(arr[i].astype("<u8").tobytes(), Verdict(int(verdicts[i]))) for i in bad]

    def _node_reports(self, worker_id, c, node_free):
        """``[(node row, free vector (-1 = not reported))]`` of a heartbeat's ``node_free``
        for cluster row ``c``; ``SpecError`` naming the first bad entry."""
        cluster = self.config.clusters[c]
        index = self._node_index.get(c)
        if index is None:       # once per cluster: a heartbeat builds no map of its nodes
            try:
                index = self._node_index[c] = node_index(cluster)
            except ValueError as exc:
                raise SpecError(f"worker {worker_id}: node_free: {exc}") from None
        if not isinstance(node_free, dict):
            raise SpecError(f"worker {worker_id}: node_free must be a map of node name to "
                            f"free capacity, not {type(node_free).__name__}")
        first = int(self._state.c_node_first[c])
        out = []
        for name, free in node_free.items():
            k = index.get(name)
            if k is None:
                raise SpecError(f"worker {worker_id}: node_free: "
                                f"{unknown_node(cluster, name)}")
            try:
                out.append((first + k, self._resources.vector(free, unset=-1)))
            except (ValueError, TypeError, AttributeError) as exc:
                raise SpecError(f"worker {worker_id}: node_free.{name}: {exc}") from None
        return out

    def _check_token(self, token):
        arr = self._codec.parse(token)
        if arr.shape[0] != 1:
            raise SpecError(f"a report carries exactly one token, not {arr.shape[0]}")
        verdict = np.empty(1, dtype=np.uint8)
        validate(self._kernel, arr, -1, self.clock.now_ns(), self._codec.k0, self._codec.k1,
                 verdict, False)
        lease = int(arr[0, 0])
        return Verdict(int(verdict[0])), LeaseKind(lease >> 63), lease & ((1 << 63) - 1)

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
        # One phase for every report and no per-report kinds or causes (a worker's batch of
        # successes): the arguments are the same for all, so they are checked once.
        uniform = isinstance(phases, (Phase, str)) and error_kinds is None and causes is None
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
        if uniform and n:
            try:
                checked = [self._check_report(phases[0], None, None)] * n
            except SpecError as exc:
                raise SpecError(f"report 0: {exc}") from None
        for i in range(len(checked), n):
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
        # One phase for all (a worker's batch of successes): its code, else None.
        code = PHASE_CODE[checked[0][0]] if uniform and n else None
        codes = np.full(n, code, dtype=np.uint8) if code is not None else (
            np.fromiter((PHASE_CODE[p] for p, _k in checked), dtype=np.uint8, count=n))
        timed_out = np.flatnonzero(~is_run & (codes == PHASE_CODE[Phase.TIMED_OUT]))
        if timed_out.size:
            # (Checked with the others, before anything is applied: _report would refuse
            # it after the reports before it in the message were.)
            raise SpecError(f"report {int(timed_out[0])}: {_FINALIZE_ENDS}")
        st = self._state
        ok = verdicts == _OK
        fast = ok & is_run
        if not plain:
            fast &= np.fromiter((not messages[i] and not cleanup[i] for i in range(n)),
                                dtype=bool, count=n)
        if code is None:
            fast &= (codes == PH_INIT) | (codes == PH_RUNNING) | (codes == PH_SUCCEEDED)
        elif code not in _LEAN_CODES:
            fast[:] = False
        fast[fast] = st.a_edges[rows[fast]] == 0
        if fast.any():
            # A lease reported twice in one message takes the ordered path. (Rows strictly
            # ascending, as a drain hands them out, cannot repeat: no sort needed.)
            fr = rows[fast]
            if fr.size > 1 and not (fr[1:] > fr[:-1]).all():
                uniq, counts = np.unique(fr, return_counts=True)
                if (counts > 1).any():
                    fast[fast] = ~np.isin(fr, uniq[counts > 1])
        refused = []
        with self._turn():
            if fast.any():
                self._report_lean_many(rows[fast], codes[fast], code)
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

    def _report_lean_many(self, rows, codes, code=None):
        # _report_lean over distinct lean rows, in vector operations; ``code``: the one
        # phase code of them all when the reports share it (its masks are then not built).
        st = self._state
        now = self.clock.now_ns()
        start = st.a_start[rows]
        fresh = start == NEVER
        st.a_start[rows] = np.where(fresh, now, start)
        if code == PH_SUCCEEDED:
            self._touch_many(rows)          # every row ends (a worker's batch of successes)
            run = rows[:0]
        else:
            # Only rows a report changes are written: an INITIALIZING or RUNNING that
            # repeats what the row already says (the hand-out made it INITIALIZING) is
            # acknowledged without a write, so it costs its turn no commit.
            waiting = st.a_state[rows] != ST_RUNNING
            starts = (codes == PH_RUNNING) & waiting
            changed = fresh | (codes == PH_SUCCEEDED) | starts
            if code is None or code == PH_INIT:
                init = (codes == PH_INIT) & waiting
                changed |= init & (st.a_phase[rows] != PH_INIT)
                st.a_phase[rows[init]] = PH_INIT
            self._touch_many(rows[changed])
            run = rows[starts]
        if run.size:
            set_state(st, run, ST_RUNNING)      # stops the queued-time clock
            st.a_running[run] = now
            st.a_phase[run] = PH_RUNNING
            # Predictions count from RUNNING, as history measures (docs/predictions.md).
            pred = self._predicted_rt(run)
            later = (pred != NEVER) & (now + np.minimum(pred, NEVER - now) > st.a_pred_end[run])
            st.a_pred_end[run[later]] = now + pred[later]
            grace = self.config.engine.runtime_grace
            for gid in np.unique(st.a_group[run]).tolist():
                t = self._group_of(int(run[st.a_group[run] == gid][0])).compiled.spec.timeouts
                if t.max_runtime is not None:
                    due = now + int((t.max_runtime + grace) * 1e9)
                    for r in run[st.a_group[run] == gid].tolist():
                        self._timer(due, T_RUNTIME, r, int(st.a_gen[r]))
        done = rows if code == PH_SUCCEEDED else rows[codes == PH_SUCCEEDED]
        if done.size:
            began = np.where(st.a_running[done] != NEVER, st.a_running[done], st.a_start[done])
            tasks = st.a_task[done]
            distinct = dict.fromkeys(tasks.tolist())
            for t in distinct:
                key = self._task_names[t]
                ran = now - (began if len(distinct) == 1 else began[tasks == t])
                self.history.record_many_ns(key, np.maximum(0, ran))
                self._add_sample(key)
                self._refresh_prediction(key, t)
            self._end_leases_lean(done, END_COMPLETED, PH_SUCCEEDED, now)

    def _end_leases_lean(self, rows, end, phase, now):
        # _end_lease for many lean rows, which end their one attempt in ``phase`` now.
        st = self._state
        st.a_end[rows] = end
        st.a_expiry[rows] = NEVER
        release_many(self._kernel, np.ascontiguousarray(rows, dtype=np.int64), now)
        set_state(st, rows, ST_DONE)
        st.a_done[rows] = now
        st.a_phase[rows] = phase

    def _report(self, kind, row, phase, kind_, cause, recoverable, message, cleanup):
        verdict = Verdict.OK
        if kind == LeaseKind.FINALIZE:
            if phase in (Phase.SUCCEEDED, Phase.FAILED):
                self._end_finalize(row, END_COMPLETED, phase.value)
            elif phase == Phase.TIMED_OUT:
                raise SpecError(_FINALIZE_ENDS)
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
            if st.a_state[row] != ST_RUNNING and rec.phase != Phase.INITIALIZING:
                rec.phase = Phase.INITIALIZING
                self._touch(row)
            return verdict
        if phase == Phase.RUNNING:
            if st.a_state[row] != ST_RUNNING:
                self._touch(row)
                set_state(st, row, ST_RUNNING)   # stops the queued-time clock
                att.running_ns = now
                rec.phase = Phase.RUNNING
                # Backfill (issue 5): history measures from RUNNING, so the prediction does.
                pred = int(self._predicted_rt(np.array([row]))[0])
                if pred != NEVER and pred < NEVER - now and now + pred > st.a_pred_end[row]:
                    st.a_pred_end[row] = now + pred
                t = rec.compiled.spec.timeouts
                if t.max_runtime is not None:
                    grace = self.config.engine.runtime_grace
                    self._timer(now + int((t.max_runtime + grace) * 1e9), T_RUNTIME, row,
                                int(st.a_gen[row]))
            return verdict
        if phase == Phase.SUCCEEDED:
            # Backfill (issue 5): a success teaches its history key (failures do not).
            began = att.running_ns if att.running_ns is not None else att.start_ns
            if began is not None:
                self._record_runtime(self._task_names[int(st.a_task[row])], now - began)
            self._end_lease(row, END_COMPLETED)
            self._end_attempt(rec, Phase.SUCCEEDED, message=message, cleanup=cleanup)
            self._finish(rec, Phase.SUCCEEDED, message)
            return verdict
        if phase == Phase.FAILED:
            self._end_lease(row, END_COMPLETED)
            self._attempt_failed(rec, Phase.FAILED, kind_, cause, message,
                                 bool(recoverable), cleanup=cleanup)
            return verdict
        # TIMED_OUT, with the bound the worker enforced.
        self._end_lease(row, END_COMPLETED)
        self._attempt_failed(rec, Phase.TIMED_OUT, None, cause, message, True, cleanup=cleanup)
        return verdict

    def _report_lean(self, row, phase):
        # One report of a lean row: the vector path of report_many with one row.
        self._report_lean_many(np.array([row], dtype=np.int64),
                               np.array([PHASE_CODE[phase]], dtype=np.uint8))
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
        row, ret = self._row_or_retained(action)
        if ret is not None:
            raise SpecError(f"action {ret.id}: report for generation {generation} refused: "
                            f"the action has ended ({ret.record.phase.value})")
        token = self._codec.mint(LeaseKind.RUN, row, generation)
        verdict = self.report(token, phase, **kw)
        if verdict != Verdict.OK:
            raise SpecError(f"action {self._aid(row)}: report for generation {generation} "
                            f"refused: {verdict.name}")

    def _end_lease(self, row, end):
        # The current generation ends: later tokens for it get `end` as their verdict, and
        # its in-flight counts are released (once per generation).
        st = self._state
        st.a_end[row] = end
        st.a_expiry[row] = NEVER
        self._kernel.release(row, self.clock.now_ns())
        set_state(st, row, ST_DONE)
        self._touch(row)

    def _new_finalize(self, rec, att):
        st = self._state
        f = int(self._alloc_finalize(1)[0])
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

    def _new_finalize_lean(self, rows):
        """Finalize leases for the attempts of lean ``rows`` (one each), in vector
        operations; their attempts read them from the finalize rows (a_final)."""
        st = self._state
        f = self._alloc_finalize(rows.size)
        give_up = self.clock.now_ns() + int(self.config.engine.finalize_timeout * 1e9)
        st.fz_action[f] = rows
        st.fz_attempt[f] = 1
        st.fz_cluster[f] = st.a_cluster[rows]
        st.fz_pref[f] = st.a_worker[rows]
        st.fz_give_up[f] = give_up
        st.fz_outcome[f] = 0
        st.a_final[rows] = f
        push_finalize_many(self._kernel, np.ascontiguousarray(f, dtype=np.int64))
        self._timer_block(give_up, T_FINALIZE, f, 0)
        self._touch_fz_many(f)

    def _end_finalize(self, f, end, outcome):
        st = self._state
        st.fz_end[f] = end
        st.fz_expiry[f] = NEVER
        self._kernel.release_finalize(f)
        st.fz_state[f] = ST_DONE
        st.fz_outcome[f] = FZ_OUTCOME_CODE[outcome]
        arow = int(st.fz_action[f])
        if st.a_edges[arow]:        # a lean row's attempt reads it from the finalize row
            self._rec(arow).attempts[int(st.fz_attempt[f]) - 1].finalize = outcome
            self._touch(arow)
        self._dirty_fz.add(f)

    def _finalize_give_up(self, f, _ref):
        # Its own generous bound passed: record the leak loudly rather than retry forever.
        st = self._state
        if st.fz_state[f] == ST_DONE:
            return
        end = END_ABORTED
        if st.fz_state[f] == ST_QUEUED:
            self._kernel.remove_finalize(f)
            # Never granted: no lease of its generation to end. The row's end stays its
            # last lease's (a reused row's: the previous action's), as its records say.
            end = int(st.fz_end[f])
        self._end_finalize(f, end, "ABANDONED")
