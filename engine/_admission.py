"""Admission: enqueue (one spec, a batch, a fan-out), the checks that make a batch atomic, and the
rows, runs, lanes, warm pools and fit masks a new action takes.

A part of :class:`engine.Engine` (a mixin over its shared state); see engine/_engine.py."""

from dataclasses import replace

import msgpack
import numpy as np

from engine._codes import (
    T_DEADLINE,
    T_QUEUED,
    TERMINAL_PHASES,
    Phase,
)
from engine._errors import ResourceExhausted, SpecError
from engine._groups import (
    ActionIds,
    EnqueueGroup,
    check_names,
    encode_group,
    group_key,
)
from engine._history import shape_key
from engine._model import ActionId, ActionSpec, compile_spec, fit_problem
from engine._nodes import Nodes, size_order
from engine._records import (
    dict_content,
    name_hashes,
    row_key,
    same_spec,
    spec_content,
)
from engine._rows import (
    PH_QUEUED,
)
from engine._state import NEVER
from engine._units import format_quantity

__all__ = ["AdmissionMixin"]

# The action columns an enqueue group gives all its rows (_insert_groups).
_GROUP_COLUMNS = ("queue", "run", "qrun", "lane", "env", "part", "task", "group", "parent",
                  "est_rt", "max_rt")

# Compiled specs kept by content (Engine._templates); past this many they are dropped.
_TEMPLATES_KEPT = 4096


def _clone(obj):
    # A shallow copy of a dataclass instance without dataclasses.replace's __init__ (whose
    # checks the original passed): a spec taken from the compiled templates costs ~1 us.
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    return new


class AlreadyExists(SpecError):
    """An action with this id exists with a different spec; nothing was stored."""

    code = "ALREADY_EXISTS"


class AdmissionMixin:
    """Admission (a part of Engine)."""

    def enqueue(self, spec):
        """Enqueue one action; returns its ``ActionId``. See :meth:`enqueue_many`."""
        return self.enqueue_many([spec])[0]

    def enqueue_many(self, specs):
        """Enqueue a batch atomically: every spec is checked first, and if any is bad (or a
        queue would pass its depth) nothing is stored. Re-enqueueing an existing id with the
        same spec is a no-op (clients may retry); with another spec it is ``AlreadyExists``.
        Specs of identical content (all but the action name) are compiled and stored once.
        Returns the ids in order (an :class:`~engine.ActionIds` sequence of ``ActionId``,
        whose ``added`` says which of them this call enqueued).
        """
        plan, ids, seen, per_queue, batch_run_caps = [], [], set(), {}, {}
        added = np.ones(len(specs), dtype=bool)
        for i, spec in enumerate(specs):
            try:
                spec, c, key = self._compiled(spec)
            except SpecError as exc:
                raise type(exc)(f"batch item {i}: {exc}") if len(specs) > 1 else exc from None
            existing = self._lookup(c.id)
            if existing is not None:
                if not self._same_spec(existing, spec):
                    raise AlreadyExists(f"action {c.id} exists with a different spec")
                ids.append(c.id)
                added[i] = False
                continue
            ret = self._retained(c.id)
            if ret is not None:
                # Ended and reclaimed, its outcome retained: the same idempotency (the
                # input reference a fan-out gave it is not compared, as in the table).
                if not self._same_retained(ret, spec, any_input=True):
                    raise AlreadyExists(f"action {c.id} exists with a different spec "
                                        f"(ended {ret.record.phase.value})")
                ids.append(c.id)
                added[i] = False
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
        ids = ActionIds(ids.__getitem__, len(ids), added)
        if not plan:
            return ids
        with self._turn():
            now = self.clock.now_ns()
            # Consecutive actions of identical content form one group (rows in batch order).
            groups, start = [], 0
            for k in range(1, len(plan) + 1):
                if k == len(plan) or plan[k][0] is None or plan[k][0] != plan[start][0]:
                    run = plan[start:k]
                    c0 = run[0][1]
                    content = run[0][0] if run[0][0] is not None else spec_content(c0.spec)
                    groups.append((c0, [c.id.action for _key, c in run], None,
                                   name_hashes([str(c.id) for _k, c in run]), content))
                    start = k
            rows = self._insert_groups(groups, now)
            self._kernel.push_many(rows.astype(np.int32))
        return ids

    def content_of(self, spec):
        """The content a spec (an ActionSpec or its dict) is kept under, as an enqueue
        group's ``content`` holds it: equal for two specs of the same declaration but for
        the action name; None when not plain data. ``SpecError`` if the spec is invalid.
        Cheap for a spec enqueued lately (its compiled form is kept by content)."""
        return self._compiled(spec)[2]

    def _compiled(self, spec):
        """``(spec, compiled, content)`` of ``spec`` (an ActionSpec or its dict): the spec as
        an ActionSpec, checked and compiled (``SpecError`` naming what is wrong), and its
        :func:`spec_content` (None when not plain data). Compiled specs are kept by content
        (and by the dict's own bytes): what is compiled depends on the spec and on the
        config's resources and queue names alone, so a spec whose content was seen before
        (every action of a run enqueued one by one) is taken from there, checked once."""
        templates = self._templates
        raw = dict_content(spec) if isinstance(spec, dict) else None
        hit = templates.get(raw) if raw is not None else None
        if hit is None:
            if isinstance(spec, dict):
                spec = ActionSpec.from_dict(spec)
            key = spec_content(spec) if isinstance(spec, ActionSpec) else None
            hit = templates.get(key) if key is not None else None
            if hit is None:
                c = compile_spec(spec, self._resources, self._queues,
                                 self.config.engine.default_queue)
                if key is not None:
                    if len(templates) >= _TEMPLATES_KEPT:
                        templates.clear()
                    templates[key] = (c, key)
                    if raw is not None:
                        templates[raw] = (c, key)
                return spec, c, key
            aid = spec.id
        else:
            aid = spec["id"]
        # The same content as a spec compiled before: its checks hold; this spec is the
        # template's compiled form (durations as seconds) under this action's id.
        template, key = hit
        c = _clone(template)
        c.id = ActionId.parse(aid)
        if c.parent == c.id:
            raise SpecError(f"action {c.id}: an action cannot be its own parent")
        c.spec = _clone(template.spec)
        c.spec.__dict__["id"] = aid     # (a frozen dataclass: its fields live in __dict__)
        return c.spec, c, key

    def enqueue_fanout(self, template, names, inputs=None):
        """Enqueue ``len(names)`` actions that share ``template`` (an ActionSpec) and differ
        only in their names: action ``i`` is the template's id with its last part replaced by
        ``names[i]`` (the template's own name is not enqueued), with the optional input
        reference ``inputs[i]`` (a string handed to the worker with the lease). The spec is
        compiled, checked and stored once; the batch is one group commit. Atomic like
        :meth:`enqueue_many`: a name that exists with the same spec is a no-op, with another
        spec ``AlreadyExists``. Returns the ids of every name, in order (an
        :class:`~engine.ActionIds` sequence of ``ActionId``, whose ``added`` says which of
        them this call enqueued)."""
        _spec, c, _key = self._compiled(template)
        names, inputs = check_names(names, inputs)
        aid = c.id
        if c.parent is not None and c.parent.run_key == aid.run_key and c.parent.action in (
                set(names)):
            raise SpecError(f"fan-out of {aid.run_key}: action {c.parent} cannot be its own "
                            f"parent")
        prefix = aid.run_key + "/"
        texts = [prefix + name for name in names]
        hashes = name_hashes(texts)
        rows = self._probe(hashes, texts)
        new = rows < 0
        if new.any() and self._run_may_have_retained(aid):
            # Names of the run may be retained outcomes (ended, reclaimed). A run whose
            # every retained outcome was reclaimed since the filter of reclaimed names
            # began (engine/_reclaimed.py) probes the store only for the names it may hold.
            fresh = np.flatnonzero(new)
            if self._runs.get(aid.run_key) in self._runs_fresh:
                fresh = fresh[self._reclaimed_names.may_hold(hashes[fresh])]
            fresh = fresh.tolist()
            for i, ret in zip(fresh, self._retained_names(
                    aid, [names[i] for i in fresh], [texts[i] for i in fresh]),
                              strict=True):
                if ret is None:
                    continue
                if not self._same_retained(ret, replace(c.spec, id=texts[i]),
                                           inputs[i] if inputs is not None else None):
                    raise AlreadyExists(f"action {texts[i]} exists with a different spec "
                                        f"(ended {ret.record.phase.value})")
                new[i] = False
        parts = (aid.tenant, aid.project, aid.domain, aid.run)
        for i in np.flatnonzero(rows >= 0).tolist():
            spec = replace(c.spec, id=texts[i])
            old_ref = self._input_ref(int(rows[i]))
            if not self._same_spec(int(rows[i]), spec) or old_ref != (
                    inputs[i] if inputs is not None else None):
                raise AlreadyExists(f"action {texts[i]} exists with a different spec")
        ids = ActionIds.of_names(parts, names, new)
        if not new.any():
            return ids
        if c.parent is not None:
            self._check_parent(c, "")
        self._check_run_cap(c, {}, "")
        self._check_depth({c.queue: int(new.sum())})
        idx = np.flatnonzero(new)
        with self._turn():
            now = self.clock.now_ns()
            content = spec_content(c.spec)
            if idx.size == len(names):
                rows = self._insert_groups([(c, names, inputs, hashes, content)], now)
            else:
                rows = self._insert_groups([(c, [names[i] for i in idx.tolist()],
                                             None if inputs is None else [inputs[i] for i in
                                                                          idx.tolist()],
                                             hashes[idx], content)], now)
            self._kernel.push_many(rows.astype(np.int32))
        return ids

    def _check_parent(self, c, where):
        """Refuse a child of an unknown or ended parent. An ended action starts no children:
        abort cascades through the children of actions still in the table, and an ended
        parent's row is reclaimed (its outcome retained), after which a child could not be
        linked to it, so taking one would make the cascade depend on when reclaim ran."""
        prow = self._lookup(c.parent)
        if prow is None:
            ret = self._retained(c.parent)
            if ret is None:
                raise SpecError(f"{where}action {c.id}: parent {c.parent} not found")
            phase = ret.record.phase
        else:
            phase = self._phase_of(prow)
        if phase == Phase.ABORTED:
            raise SpecError(f"{where}action {c.id}: parent {c.parent} was aborted")
        if phase in TERMINAL_PHASES:
            raise SpecError(f"{where}action {c.id}: parent {c.parent} has ended "
                            f"({phase.value}); an ended action starts no children")

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
            if n and self._queues[qname].draining:
                # A drain lets what the queue has run out; retries of it still re-queue
                # (they are not new actions), re-enqueues of known ids stay no-ops.
                raise ResourceExhausted(
                    f"queue {qname}: draining: it takes no new actions ({n} asked; "
                    f"`leasehold queue update {qname} --draining false` reopens it); "
                    f"nothing was enqueued")
            depth = self._queues[qname].depth
            if self._state.q_pending[q] + n > depth:
                raise ResourceExhausted(
                    f"queue {qname}: depth {depth} reached ({self._state.q_pending[q]} queued, "
                    f"{n} more asked); nothing was enqueued")

    def _same_spec(self, row, spec):
        return same_spec(self._spec_of(row), spec)

    def _insert_groups(self, groups, now):
        """Insert enqueue groups ``[(compiled, names, inputs, hashes, content)]`` as new
        rows in order (reclaimed rows first, ascending, then new ones): per group what it
        shares (run, lanes, pool, fit, task, its record), per row vector operations over the
        whole batch. Returns the rows, in batch order."""
        st = self._state
        sizes = [len(g[1]) for g in groups]
        n = sum(sizes)
        counts = np.array(sizes, dtype=np.int64)
        # Parents of this batch stay in the table (reclaiming makes room only from others).
        keep = set()
        for g in groups:
            if g[0].parent is not None:
                prow = self._lookup(g[0].parent)
                if prow is not None:
                    keep.add(prow)
        # ... and so do their runs: a run retired by that reclaim would come back with the
        # first group's declared cap, which the batch was not checked against.
        keep_runs = {u for u in (self._runs.get(g[0].id.run_key) for g in groups)
                     if u is not None}
        rows = self._alloc_rows(n, keep, keep_runs)
        cols = {k: [] for k in _GROUP_COLUMNS}     # per group: lists (numpy takes them whole)
        fits = np.empty(len(groups), dtype=np.uint64)
        demand = np.empty((len(groups), st.n_res), dtype=np.int64)
        deadlines, queued = [], []
        # One row a group (single enqueues, batches of distinct specs): the per-group
        # columns are the per-row ones, no repeat needed.
        single = n == len(groups)
        offsets = list(range(n)) if single else (np.cumsum(counts) - counts).tolist()
        local, done = {}, 0         # id text -> row of this batch's earlier groups
        st.a_child[rows] = -1       # (before the loop: a parent may be in this batch)
        for k, (c, names, inputs, _hashes, content) in enumerate(groups):
            gid = self._next_gid
            self._next_gid += 1
            q = self._queue_index[c.queue]
            part = self._part_of(c.id.tenant)
            u = self._run_row(c, part)
            qr = self._qrun_row(q, u)
            env = self._env_row(c, q, part) if c.env_key is not None else -1
            fast = env >= 0 and st.e_cluster[env] >= 0
            m = len(names)
            mine = rows[offsets[k]:offsets[k] + m]
            parent = -1
            if c.parent is not None:
                # The parent may be earlier in this batch (its columns are not set yet).
                while done < k:
                    g0, lo = groups[done][0], offsets[done]
                    prefix = g0.id.run_key + "/"
                    local.update((prefix + name, int(rows[lo + i]))
                                 for i, name in enumerate(groups[done][1]))
                    done += 1
                parent = local.get(str(c.parent))
                if parent is None:
                    # In the table: _check_parent refused any other, and keep (above)
                    # holds it there through _alloc_rows.
                    parent = self._lookup(c.parent)
            for key, value in (("queue", q), ("run", u), ("qrun", qr),
                               ("lane", 2 * qr + int(fast)), ("env", env), ("part", part),
                               ("task", self._task_row(self._history_key(c))),
                               ("group", gid), ("parent", parent),
                               ("est_rt", _ns(c.spec.runtime_estimate)),
                               ("max_rt", _ns(c.spec.timeouts.max_runtime))):
                cols[key].append(value)
            fits[k] = self._fit_mask(c)
            if int(fits[k]) & self._node_mask:
                # May be placed on nodes: its pod groups, largest first, for the gate.
                st.a_pg_first[mine], st.a_pg_n[mine] = self._podgroup_rows(c)
            else:
                st.a_pg_first[mine], st.a_pg_n[mine] = -1, 0
            demand[k] = c.demand
            # Newest first: each row's next sibling is the one inserted before it, in its
            # parent's children or, parentless, in its run's list.
            heads = st.a_child if parent >= 0 else st.u_child
            owner = parent if parent >= 0 else u
            st.a_sibling[mine[0]] = heads[owner]
            st.a_sibling[mine[1:]] = mine[:-1]
            heads[owner] = mine[-1]
            if c.spec.id != str(c.id):
                c.spec = replace(c.spec, id=str(c.id))
            self._groups[gid] = EnqueueGroup(gid, c, names, inputs, content)
            self._group_rows[gid] = m
            self._op(part, "specs", group_key(gid), encode_group(content, names, inputs))
            t = c.spec.timeouts
            if t.deadline is not None:
                deadlines.append((mine, now + int(t.deadline * 1e9)))
            if t.max_queued_time is not None:
                queued.append((mine, now + int(t.max_queued_time * 1e9)))
        contiguous = n and int(rows[-1]) - int(rows[0]) == n - 1
        sl = slice(int(rows[0]), int(rows[0]) + n) if contiguous else rows
        for key in _GROUP_COLUMNS:
            getattr(st, "a_" + key)[sl] = cols[key] if single else np.repeat(cols[key], counts)
        st.a_fit[sl] = fits if single else np.repeat(fits, counts)
        st.a_demand[sl] = demand if single else np.repeat(demand, counts, axis=0)
        st.a_gidx[sl] = 0 if single else np.arange(n, dtype=np.int32) - np.repeat(
            np.asarray(offsets, dtype=np.int32), counts)
        # a_gen and a_released_gen stay: a reclaimed row counts on from its last generation
        # (equal, so nothing is in flight), a new row starts at 0.
        st.a_enqueued[sl] = now
        st.a_seq[sl] = np.arange(self._next_seq, self._next_seq + n, dtype=np.int64)
        self._next_seq += n
        st.a_attempt[sl] = 1
        st.a_lean[sl] = 1
        st.a_edges[sl] = 0
        st.a_phase[sl] = PH_QUEUED
        st.a_start[sl] = NEVER
        st.a_running[sl] = NEVER
        st.a_done[sl] = NEVER
        hashes = groups[0][3] if len(groups) == 1 else np.concatenate([g[3] for g in groups])
        st.a_name_hash[sl] = hashes
        self._index_new(hashes, rows, groups)
        for mine, due in deadlines:
            self._timer_block(due, T_DEADLINE, mine, 0)
        for mine, due in queued:
            self._timer_block(due, T_QUEUED, mine, 1)
        self._touch_many(rows)
        return rows

    def _history_key(self, c):
        """The runtime history key of compiled action ``c``: (task name, resource shape)."""
        # Shapes repeat: their strings are cached by the pod matrix (bounded: cleared past
        # _SHAPES_CACHED), so a batch of distinct specs does not format one per action.
        raw = c.pods.tobytes() + c.pod_counts.tobytes()
        cache = self._shape_names
        shape = cache.get(raw)
        if shape is None:
            if len(cache) >= _SHAPES_CACHED:
                cache.clear()
            shape = cache[raw] = shape_key(self._resources.names, c.pods, c.pod_counts)
        return (c.spec.task, shape)

    def _index_new(self, hashes, rows, groups):
        index = self._hash_rows
        hl = hashes.tolist()
        rl = rows.tolist()
        n = len(hl)
        before = len(index)
        taken = {} if index.keys().isdisjoint(hl) else {h: index[h] for h in hl if h in index}
        index.update(zip(hl, rl, strict=True))
        if taken or len(index) - before != n:
            # A 64-bit hash shared with another id (astronomically rare): the first row keeps
            # the hash, every later one is found by its id.
            index.update(taken)
            owner = dict(taken)
            for h, r in zip(hl, rl, strict=True):
                if owner.setdefault(h, r) != r:
                    index[h] = owner[h]
                    self._collided[self._aid(r)] = r

    def _run_row(self, c, part):
        st = self._state
        row = self._runs.get(c.id.run_key)
        if row is None:
            if self._free_runs:
                row = self._free_runs.pop()
                self._run_keys[row] = c.id.run_key
            else:
                row = len(self._run_keys)
                if st.ensure("runs", row + 1):
                    self._bind()
                self._run_keys.append(c.id.run_key)
            self._runs[c.id.run_key] = row
            st.u_cap[row] = c.spec.run_max_action_concurrency
            tenant, grown = st.tenant_row(self._tenants, self.config, c.id.tenant)
            if grown:
                self._bind()
            st.u_tenant[row] = tenant
            self._op(part, "runs", row_key(row), msgpack.packb(
                [c.id.run_key, c.spec.run_max_action_concurrency]))
        return row

    def _qrun_row(self, q, u):
        st = self._state
        row = self._qruns.get((q, u))
        if row is None:
            if self._free_qruns:
                row = self._free_qruns.pop()
            else:
                row = self._n_qruns
                if st.ensure("qruns", row + 1):
                    self._bind()
                self._n_qruns += 1
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

    def _podgroup_rows(self, c):
        """``(first, n)``: the pod group rows of compiled action ``c``, largest first (the
        order of engine/_nodes.py's first fit decreasing), interned by content."""
        key = (c.pods.tobytes(), c.pod_counts.tobytes())
        hit = self._podgroups.get(key)
        if hit is not None:
            return hit
        st = self._state
        first = self._n_podgroups
        n = c.pods.shape[0]
        if st.ensure("podgroups", first + n):
            self._bind()
        order = size_order(self._resources, c.pods)
        st.pg_vec[first:first + n] = c.pods[order]
        st.pg_count[first:first + n] = c.pod_counts[order]
        self._n_podgroups = first + n
        hit = self._podgroups[key] = (first, n)
        return hit

    def _fit_mask(self, c):
        # Clusters that could ever hold it: total within capacity, every pod on some shape
        # (admission = "nodes": all its pods at once on the empty nodes).
        key = (c.pods.tobytes(), c.pod_counts.tobytes(), c.demand.tobytes(),
               c.env_key is not None)
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
        if problem is None and self.config.clusters[i].admission == "nodes":
            problem = self._node_problem(c, i)
        if problem is None:
            return None
        kind, k = problem
        if kind == "nodes":
            return k
        if kind == "capacity":
            name = res.names[k]
            return (f"cluster {self._clusters[i]} has {format_quantity(name, int(cap[k]))} "
                    f"{name} in all, it needs {format_quantity(name, int(c.demand[k]))}")
        role = c.spec.pods[k].role if c.spec.pods else "pod"
        return (f"{role} ({res.describe(c.pods[k])}) fits no node shape of cluster "
                f"{self._clusters[i]}")


    def _node_problem(self, c, i):
        """Why ``c`` can never be placed on the nodes of cluster ``i`` (admission = "nodes"),
        as ``("nodes", reason)``, or None."""
        name = self._clusters[i]
        n_pods = int(c.pod_counts.sum())
        limit = self.config.engine.max_node_pods
        if c.env_key is not None:
            return ("nodes", f"cluster {name} places pods on nodes (admission = 'nodes'), "
                             f"which does not take reusable environments yet")
        if n_pods > limit:
            return ("nodes", f"cluster {name} places at most engine.max_node_pods = {limit} "
                             f"pods per action on its nodes, it has {n_pods}")
        if Nodes(self.config.clusters[i], self._resources).place(c.pods, c.pod_counts) is None:
            return ("nodes", f"its {n_pods} pods cannot all be placed on the nodes of "
                             f"cluster {name} even when they are empty")
        return None


_SHAPES_CACHED = 4096


def _ns(seconds):
    """A spec duration (seconds; None) as the int64 ns a column holds (NEVER: none, or too
    long to matter: a stored spec may predate the 10-year bound)."""
    if seconds is None:
        return NEVER
    ns = seconds * 1e9
    return int(ns) if ns < NEVER else NEVER
