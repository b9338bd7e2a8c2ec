"""Explain: an action's phase and what it waits for (wait reasons worded), its position and ETA,
attempts, queue and cluster metrics.

A part of :class:`engine.Engine` (a mixin over its shared state); see engine/_engine.py."""

from dataclasses import dataclass, replace

import numpy as np

from cext._bulk import queued_ahead
from cext._tree import run_rows
from engine._codes import (
    PHASE_CODE,
    PHASES,
    RESOURCE_WAITS,
    Phase,
    WaitCode,
)
from engine._errors import NotFound, SpecError
from engine._model import ActionId
from engine._records import name_hashes
from engine._rows import (
    LIVE_STATES,
    ST_BACKOFF,
    ST_DONE,
    ST_FREE,
    ST_QUEUED,
)
from engine._units import format_quantity

__all__ = ["ExplainMixin"]

_CANDIDATE_LIMIT, _DISPATCH_FULL = int(WaitCode.CANDIDATE_LIMIT), int(WaitCode.DISPATCH_FULL)
_RESOURCE_WAIT_CODES = np.array(sorted(int(c) for c in RESOURCE_WAITS), np.int64)


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
    # --- ETA projection (issue 14, item 6): every queued action ---
    projected_start_ns: int | None = None   # projected start (engine clock); None unknown
    projected_why: str | None = None        # why None ("" when projected; None: not queued)


class ExplainMixin:
    """Explain (a part of Engine)."""

    def phase(self, action):
        """The action's phase: what :meth:`explain` says, without its reason, queue position
        or estimate (a queued action's position is a scan of the table; the shard's watch
        re-check asks this of every live action it tracks)."""
        row, ret = self._row_or_retained(action)
        if ret is not None:
            return ret.record.phase
        if self._state.a_state[row] == ST_QUEUED:
            return (Phase.WAITING_FOR_RESOURCES if self._wait_code(row)[0] in RESOURCE_WAITS
                    else Phase.QUEUED)
        return self.explain(action).phase

    def phases(self, actions):
        """:meth:`phase` of each of ``actions`` (ids or id texts), in order, with None for an
        action this engine does not know. The rows the name index holds and whose columns
        are their whole state (lean rows) are read in one numpy pass; the others take
        :meth:`phase`'s path one by one. The shard's watch re-check asks this of every live
        action it follows."""
        return self._states(actions, False)[0]

    def states(self, actions):
        """``(phases, attempts)``: :meth:`phases` of ``actions``, and the number of each one's
        current attempt (as :meth:`live_states` counts it: 1 from its enqueue, a retry queues
        the next number; the last for one that ended), None for an action this engine does
        not know; read as :meth:`phases` reads them (the attempts of lean rows from their
        column in the same pass). The shard's ``STATUS`` asks this when a run is watched:
        the watch follows the live actions it names from their attempt."""
        return self._states(actions, True)

    def _states(self, actions, attempts):
        texts = [str(a) for a in actions]
        out = [None] * len(texts)
        numbers = [None] * len(texts) if attempts else None
        if not texts:
            return out, numbers
        get, recs = self._hash_rows.get, self._recs
        hashes = name_hashes(texts)
        rows = np.fromiter((get(h, -1) for h in hashes.tolist()), np.int64, len(texts))
        miss = np.flatnonzero(rows < 0)
        restored = self._restored_index() if miss.size else ()
        if len(restored):           # rows restored at load that no lookup has touched yet
            pos = np.minimum(np.searchsorted(restored, hashes[miss]), restored.size - 1)
            found = restored[pos] == hashes[miss]
            rows[miss[found]] = self._idx_row[pos[found]]
        st = self._state
        ok = rows >= 0
        r = np.maximum(rows, 0)
        ok &= (st.a_state[r] != ST_FREE) & (st.a_lean[r] != 0) & (st.a_edges[r] == 0)
        ok &= st.a_state[r] != ST_BACKOFF
        idx = np.flatnonzero(ok)
        # The index maps a 64-bit name hash to a row: the row's own name confirms it (a
        # hash may collide; such a name takes the path one by one).
        seen = {}                   # group id -> (its actions' id prefix, their names)
        hit = rows[idx]
        for i, row, gid, k in zip(idx.tolist(), hit.tolist(), st.a_group[hit].tolist(),
                                  st.a_gidx[hit].tolist(), strict=True):
            names = seen.get(gid)
            if names is None:
                g = self._group_of(row)
                names = seen[gid] = ("/".join(g.parts) + "/", g.names)
            if row in recs or texts[i] != names[0] + names[1][k]:
                ok[i] = False
        idx = np.flatnonzero(ok)
        lean = rows[idx]
        for i, c in zip(idx.tolist(), self._column_phases(lean).tolist(), strict=True):
            out[i] = PHASES[c]
        if attempts:
            for i, n in zip(idx.tolist(), st.a_attempt[lean].tolist(), strict=True):
                numbers[i] = n
        for i in np.flatnonzero(~ok).tolist():
            try:
                out[i] = self.phase(texts[i])
                if attempts:
                    numbers[i] = self._attempt_number(texts[i])
            except NotFound:
                pass
        return out, numbers

    def _attempt_number(self, action):
        row, ret = self._row_or_retained(action)
        return len(ret.record.attempts) if ret is not None else int(self._state.a_attempt[row])

    def known(self, actions):
        """Whether each of ``actions`` (ids or id texts) exists here: in the action table, or
        ended with its outcome retained (what an enqueue of its id leaves as it is: the same
        spec is a no-op, another one ``AlreadyExists``). A bool array, False for a malformed
        id. One pass over the name index; the retained outcomes of the others read a run
        at a time in one batch, and not at all for a run that has none. The shard asks it
        before an enqueue of a watched run's ids: an enqueue of a known one records no watch
        event."""
        texts = [str(a) for a in actions]
        out = np.zeros(len(texts), dtype=bool)
        if not texts:
            return out
        try:
            rows = self._probe(name_hashes(texts), texts)
        except SpecError:           # a malformed id met a colliding hash: one by one
            rows = np.array([self._known_row(t) for t in texts], dtype=np.int64)
        out[rows >= 0] = True
        by_run = {}                 # run key -> indexes of its names not in the table
        for i in np.flatnonzero(rows < 0).tolist():
            by_run.setdefault(texts[i].rpartition("/")[0], []).append(i)
        for idx in by_run.values():
            # Their run key is one prefix, so one tenant: the first id that parses says it
            # (a malformed one has no retained outcome: its lookup finds none).
            aid = None
            for i in idx:
                try:
                    aid = ActionId.parse(texts[i])
                    break
                except SpecError:
                    continue
            if aid is None or not self._run_may_have_retained(aid):
                continue
            for i, ret in zip(idx, self._retained_many(aid.tenant, [texts[i] for i in idx]),
                              strict=True):
                out[i] = ret is not None
        return out

    def _known_row(self, text):
        try:
            row = self._lookup(ActionId.parse(text))
        except SpecError:
            return -1
        return -1 if row is None else row

    def _column_phases(self, r):
        """Phase codes (``PHASES`` indexes) of lean rows ``r`` from their columns: a queued
        row is WAITING_FOR_RESOURCES or QUEUED by its wait code."""
        st = self._state
        codes = st.a_phase[r].astype(np.intp)
        queued = st.a_state[r] == ST_QUEUED
        if queued.any():
            waiting = np.isin(self._wait_codes(r[queued]), _RESOURCE_WAIT_CODES)
            codes[np.flatnonzero(queued)] = np.where(
                waiting, PHASE_CODE[Phase.WAITING_FOR_RESOURCES], PHASE_CODE[Phase.QUEUED])
        return codes

    def live_actions(self, run, limit=10_000):
        """Ids of the actions of run key ``run`` that have not ended (queued, waiting,
        assigned, running, in retry backoff), at most ``limit``, in row order; [] for a
        run this shard does not know."""
        r = self._runs.get(str(run))
        if r is None:
            return []
        return [str(self._aid(int(row))) for row in self._live_rows(r, limit)]

    def _live_rows(self, r, limit):
        """The rows of run row ``r`` that have not ended, at most ``limit``, ascending: from
        the run's own trees (``u_child`` and the children index), not a table scan."""
        st = self._state
        out = np.empty(self._next_row, dtype=np.int64)
        rows = out[:run_rows(st.u_child, st.a_child, st.a_sibling, r, out)]
        state = st.a_state[rows]
        rows = rows[(state != ST_FREE) & (state != ST_DONE)]
        rows.sort()
        return rows[:limit]

    def live_states(self, run, limit=10_000):
        """The actions of run key ``run`` that have not ended (:meth:`live_actions`: at most
        ``limit``, in row order), each with its phase (:meth:`phase`) and the number of its
        current attempt (1 from its enqueue; a retry queues the next number): ``(ids,
        phases, attempts)``, three lists, empty for a run this shard does not know. One pass
        over the run's columns; ids from their enqueue groups, phases of lean rows from
        their columns, the others by :meth:`phase` one by one. The shard's watch follows
        these when a run is first watched (a run of 10,000 live actions asked one by one
        took 230 ms of the shard loop)."""
        r = self._runs.get(str(run))
        if r is None:
            return [], [], []
        st = self._state
        rows = self._live_rows(r, limit)
        recs = self._recs
        ids, seen = [], {}          # group id -> (its actions' id prefix, their names)
        lean = ((st.a_lean[rows] != 0) & (st.a_edges[rows] == 0)
                & (st.a_state[rows] != ST_BACKOFF))
        for i, (row, gid, k) in enumerate(zip(rows.tolist(), st.a_group[rows].tolist(),
                                              st.a_gidx[rows].tolist(), strict=True)):
            rec = recs.get(row)
            if rec is not None:
                ids.append(str(rec.compiled.id))
                lean[i] = False
                continue
            names = seen.get(gid)
            if names is None:
                g = self._group_of(row)
                names = seen[gid] = ("/".join(g.parts) + "/", g.names)
            ids.append(names[0] + names[1][k])
        phases = [None] * len(ids)
        idx = np.flatnonzero(lean)
        for i, c in zip(idx.tolist(), self._column_phases(rows[idx]).tolist(), strict=True):
            phases[i] = PHASES[c]
        for i in np.flatnonzero(~lean).tolist():
            phases[i] = self.phase(ids[i])
        return ids, phases, st.a_attempt[rows].tolist()

    def explain(self, action, *, reveal=None):
        """The action's phase and, while it waits, the reason (code and message), its
        position in its queue (by enqueue time) and, for a blocked head, its estimated start
        (``eta_ns``: its shadow time from the predicted ends of what runs, docs/predictions.md;
        None unknown). ``reveal`` (a function of an ActionId, for a caller that may not see
        every tenant): whether the head an action waits behind may be named by its run and
        task; when it says no, the reason says "another tenant's action" instead."""
        row, ret = self._row_or_retained(action)
        if ret is not None:
            return Explanation(ActionId.parse(ret.id), ret.record.phase, None,
                               ret.record.message)
        st = self._state
        if st.a_state[row] == ST_QUEUED:
            # Explained from its columns alone: making its record here would take a lean row
            # off the columnar paths for the rest of its life (and the status file explains
            # every blocked head).
            rec, aid = None, self._aid(row)
        elif st.a_lean[row] and not st.a_edges[row] and row not in self._recs:
            # A lean row in flight or ended: its columns are its whole outcome (the shard's
            # watch re-check explains every live action of a watched run).
            aid = self._aid(row)
            phase = PHASES[st.a_phase[row]]
            if st.a_state[row] in LIVE_STATES and phase == Phase.QUEUED:
                return self._placed(aid, row, self._queue_names[int(st.a_queue[row])])
            return Explanation(aid, phase, None, self._abort_reason(row)
                               if phase == Phase.ABORTED else "")
        else:
            rec = self._rec(row)
            aid = rec.compiled.id
        if st.a_state[row] == ST_BACKOFF:
            att = rec.attempt
            wait_s = max(0.0, (att.enqueued_ns - self.clock.now_ns()) / 1e9)
            prev = rec.attempts[-2]
            cause = f" {prev.cause}" if prev.cause else ""
            return Explanation(aid, Phase.QUEUED, None,
                               f"attempt {att.number} waits {wait_s:.1f}s of retry backoff "
                               f"(attempt {prev.number}: {prev.phase}{cause})")
        if st.a_state[row] in LIVE_STATES and rec.phase == Phase.QUEUED:
            return self._placed(aid, row, rec.compiled.queue)
        if st.a_state[row] != ST_QUEUED:
            return Explanation(aid, rec.phase, None, rec.message)
        code, reason, eta = self._queued_wait(row, reveal)
        phase = Phase.WAITING_FOR_RESOURCES if code in RESOURCE_WAITS else Phase.QUEUED
        position = self._position(row)
        if code in (WaitCode.HEAD_OF_LINE, WaitCode.HEAD_BUDGET) and eta is None:
            reason += f"; position {position} in queue {self._queue_names[int(st.a_queue[row])]}"
        proj = self._projected_row(row)
        return Explanation(aid, phase, code, reason, eta_ns=eta, position=position,
                           projected_start_ns=proj.eta_ns, projected_why=proj.why)

    def _placed(self, aid, row, queue):
        st = self._state
        return Explanation(
            aid, Phase.QUEUED, WaitCode.PLACED,
            f"queue {queue}: assigned to "
            f"{self._clusters[st.a_cluster[row]]}/{self._worker_names[st.a_worker[row]]} "
            f"(generation {int(st.a_gen[row])}); waiting in the dispatch channel")

    def _wait_code(self, row):
        """``(code, cluster, dim, blocker)`` of queued ``row`` (-1 where none): its own stamp
        from the last tick, its lane's (behind a capped run), its queue's stop, or, when
        that stop left it unexamined behind a blocked head (QUEUE_HELD), resolved now by the
        kernel as the tick would have stamped it."""
        st = self._state
        if int(st.a_wait_tick[row]) == self._kernel.tick_no:
            return (WaitCode(int(st.a_wait_code[row])), int(st.a_wait_cluster[row]),
                    int(st.a_wait_dim[row]), self._blocker(int(st.a_wait_blocker[row])))
        lane = int(st.a_lane[row])
        if int(st.ln_skip_tick[lane]) == self._kernel.tick_no:
            return WaitCode(int(st.ln_skip_code[lane])), -1, -1, -1
        q = int(st.a_queue[row])
        code = int(st.q_stop_code[q])
        if code == WaitCode.QUEUE_HELD:
            code, cluster, dim, blocker = self._kernel.resolve_wait(row)
            return WaitCode(code), cluster, dim, self._blocker(blocker)
        return WaitCode(code), -1, -1, self._blocker(int(st.q_stop_blocker[q]))

    def _blocker(self, row):
        """``row``, the blocker the last tick named, or -1 when it has left the queue since
        (placed, aborted, or its row reclaimed and reused by a later action, which joined
        after that tick): a stamp is as of the last tick, but a blocker is named only while
        it still holds the line."""
        st = self._state
        if row < 0 or (int(st.a_state[row]) == ST_QUEUED
                       and int(st.a_queued_tick[row]) < self._kernel.tick_no):
            return row
        return -1

    def _wait_codes(self, rows):
        """:meth:`_wait_code`'s code of each of queued ``rows`` (an int array), read from
        the columns in one pass; only rows left QUEUE_HELD ask the kernel one by one."""
        st = self._state
        tick = self._kernel.tick_no
        code = st.q_stop_code[st.a_queue[rows]].astype(np.int64)
        lane = st.a_lane[rows]
        by_lane = st.ln_skip_tick[lane] == tick
        code = np.where(by_lane, st.ln_skip_code[lane], code)
        own = st.a_wait_tick[rows] == tick
        code = np.where(own, st.a_wait_code[rows], code)
        for i in np.flatnonzero(~own & ~by_lane & (code == WaitCode.QUEUE_HELD)).tolist():
            code[i] = self._kernel.resolve_wait(int(rows[i]))[0]
        return code

    def _queued_wait(self, row, reveal=None):
        """``(code, reason, eta_ns)`` of queued ``row``: its explanation but for the position
        (a scan of the action table), from its columns alone (``reveal`` as in explain)."""
        st = self._state
        q = int(st.a_queue[row])
        code, cluster, dim, blocker = self._wait_code(row)
        reason = self._reason(row, code, cluster, dim, blocker, reveal)
        # Backfill (issue 5): a blocked head gets its shadow time as an estimated start;
        # every queued action its position in the queue (explain).
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
                reason += f"; estimated start in {wait_s:.1f}s (predicted ends)"
        return code, reason, eta

    def attempts(self, action):
        """The action's attempts, oldest first (copies): cluster, worker, start, end,
        phase, error kind, cause, message, finalize outcome."""
        row, ret = self._row_or_retained(action)
        rec = ret.record if ret is not None else self._rec(row)
        return [replace(a) for a in rec.attempts]

    def _reason(self, row, code, cluster, dim, blocker, reveal=None):
        st = self._state
        res = self._resources
        q = int(st.a_queue[row])
        qname = self._queue_names[q]
        queue = self._queues[qname]
        if code == WaitCode.NONE:
            return f"queue {qname}: queued, not examined by a tick yet"
        if code == WaitCode.QUEUE_PAUSED:
            return (f"queue {qname}: paused: it places nothing until resumed "
                    f"(leasehold queue update {qname} --paused false)")
        if code == WaitCode.QUEUE_ACTIONS:
            return f"queue {qname}: action_concurrency {queue.action_concurrency} reached"
        if code == WaitCode.QUEUE_RUNS:
            return (f"queue {qname}: run_concurrency {queue.run_concurrency} reached "
                    f"({int(st.q_runs_adm[q] - st.q_runs_rel[q])} runs in flight)")
        if code == WaitCode.RUN_ACTIONS:
            u = int(st.a_run[row])
            return (f"run {self._run_keys[u]}: max_action_concurrency "
                    f"{int(st.u_cap[u])} reached")
        if code in (WaitCode.TENANT_ACTIONS, WaitCode.TENANT_RUNS):
            return self._tenant_reason(row, code)
        if code == WaitCode.QUEUE_BUDGET:
            name = res.names[dim]
            used = int(st.q_res_adm[q, dim] - st.q_res_rel[q, dim])
            return (f"queue {qname}: max_resources reached (needs {name}="
                    f"{format_quantity(name, int(st.a_demand[row, dim]))}; "
                    f"{format_quantity(name, used)} of "
                    f"{format_quantity(name, int(queue.max_resources[dim]))} in flight)")
        if code == WaitCode.CLUSTER_CAPACITY:
            return f"queue {qname}: waiting for capacity ({self._need(row, cluster, dim)})"
        if code == WaitCode.NO_NODE_FIT:
            n_pods = int(self._compiled_of(row).pod_counts.sum())
            return (f"queue {qname}: nodes fragmented: cluster {self._clusters[cluster]} has "
                    f"enough free in total, but its {n_pods} pod(s) cannot all be placed on "
                    f"its nodes now (admission = 'nodes')")
        if code in (WaitCode.HEAD_OF_LINE, WaitCode.HEAD_BUDGET):
            if blocker < 0:
                return f"queue {qname}: head-of-line blocked"
            b = self._aid(blocker)
            head = (f"{b.run}/{self._compiled_of(blocker).spec.task}"
                    if reveal is None or reveal(b) else "another tenant's action")
            if code == WaitCode.HEAD_BUDGET:
                # The budget dimension this row is short of, when the tick recorded it (the
                # head's share is reserved); else the one the head itself waits for.
                bdim = dim if dim >= 0 else int(st.a_wait_dim[blocker])
                name = res.names[bdim]
                need = f"{name}={format_quantity(name, int(st.a_demand[blocker, bdim]))}"
                return (f"queue {qname}: head-of-line blocked by {head} "
                        f"(needs {need} of the queue budget)")
            bdim = self._short_dim(blocker, cluster)
            return (f"queue {qname}: head-of-line blocked by {head} "
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

    def _tenant_reason(self, row, code):
        st = self._state
        u = int(st.a_run[row])
        t = int(st.u_tenant[u])
        tenant = self._run_keys[u].split("/", 1)[0]
        # Where the cap comes from: the tenant's own table, or the defaults.
        where = (f"[tenants.{tenant}]" if any(c.name == tenant for c in self.config.tenants)
                 else "[tenant_defaults]")
        if code == WaitCode.TENANT_RUNS:
            return (f"tenant {tenant}: run_concurrency {int(st.tn_run_cap[t])} reached "
                    f"({int(st.tn_runs_adm[t] - st.tn_runs_rel[t])} runs in flight; {where})")
        return (f"tenant {tenant}: action_concurrency {int(st.tn_action_cap[t])} reached "
                f"({int(st.tn_adm[t] - st.tn_rel[t])} actions in flight; {where})")

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
        not blocked or unknown); ``paused`` and ``draining`` (the live flags); ``projection``
        (the ETA projection of its queued actions: ``queued``, ``with_eta``, and the
        projected starts ``p50_ns``, ``p90_ns`` and ``last_ns`` of the actions at those
        places of its order, None unknown; docs/architecture.md, "ETA projection"). One
        queue when ``name`` is given."""
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
            if head >= 0 and st.a_state[head] == ST_QUEUED:
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
                "paused": bool(self._queues[qname].paused),
                "draining": bool(self._queues[qname].draining),
                "projection": self._queue_projection(q),      # ETA projection (issue 14)
            }
        return out[name] if name is not None else out

    def cut_short(self):
        """How many actions the deepest queue holds whose scan the last tick stopped before
        the end of its work (at its candidate budget, ``engine.max_candidates``, or with the
        dispatch channel full); 0 when no queue was cut short. Work it did not reach may fit
        now: a caller that ticks on events (the shard loop, the simulator) ticks again at
        once rather than waiting for the next event (docs/shard.md, "Ticks")."""
        # Two compares, not np.isin (20 us a call here: the shard asks after every tick).
        codes = self._state.q_stop_code
        cut = (codes == _CANDIDATE_LIMIT) | (codes == _DISPATCH_FULL)
        return int(self._state.q_pending[cut].max()) if cut.any() else 0

    def cluster_in_flight(self, cluster):
        """In-flight resources charged to ``cluster`` as ``{resource: amount}``."""
        if cluster not in self._cluster_index:
            raise NotFound(f"cluster {cluster!r} is not configured")
        c = self._cluster_index[cluster]
        st = self._state
        used = (st.c_adm[c] - st.c_rel[c]).astype(np.int64)
        return {n: int(v) for n, v in zip(self._resources.names, used, strict=True)}

    def _head_eta(self, row):
        # The shadow time of a blocked head, from the current state (None: unknown).
        return self._kernel.head_eta(row, self.clock.now_ns())

    def _position(self, row):
        # 1-based, in enqueue order among the queue's queued actions.
        return queued_ahead(self._kernel, self._state.a_seq, self._next_row, row) + 1
