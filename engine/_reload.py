"""Rebuild a shard's memory from its store: :func:`load` reads it and returns a
:class:`Restored`, which the engine adopts (start-up, and the restore after a failed commit:
memory := disk). It reads through the :class:`storage.Store` interface only.

Everything the decision path needs comes back as a bulk copy of fixed records into numpy,
then vectorised derivations: (queue, run) pairs and lanes, in-flight counters recounted
from the unreleased leases (admitted = recount, released = 0), live warm pools, the queued
lanes, timers as sorted arrays. The Python edges (spec, outcome, attempts) stay on disk and
are decoded on first use of a row.
"""

import sys
from dataclasses import dataclass

import msgpack
import numpy as np

from cext import RecordCodec
from cext._bulk import add_by
from cext._tree import link_roots
from engine._aborts import (
    ABORT_ROWS_START,
    ABORT_ROWS_STOP,
    apply_abort,
    decode_abort_rows,
    rows_of,
)
from engine._codes import (
    LeaseEnd,
    RowState,
)
from engine._errors import ConfigError
from engine._history import RuntimeHistory
from engine._parallel import halves, in_threads
from engine._records import FINALIZE_DTYPE, action_columns, action_dtype, finalize_columns
from engine._state import State
from engine._timers import armed_timers
from storage import CorruptRecord

__all__ = ["Restored", "load"]


@dataclass(eq=False)
class Restored:
    """A shard's memory as its store holds it (what :func:`load` returns).

    ``state`` holds every table, counters recounted and lease holders as session rows: one
    detached session per durable worker identity, session row = identity. The rest are the
    Python edges and what the kernel is told when the engine adopts it (lanes, dispatch)."""

    state: State
    workers: list           # identity -> (worker id, cluster name)
    run_keys: list          # run row -> run key (None: a free row)
    tenants: dict           # tenant name -> tenant row (the tenants of the stored runs)
    envs: dict              # environment key -> env row
    history: RuntimeHistory
    task_names: list        # history key row -> (task name, shape)
    queue_changes: dict     # queue name -> its durable live changes (not applied)
    rows: int               # action rows in use: actions or FREE below it
    free_rows: np.ndarray   # reclaimed rows, ascending
    next_gid: int           # next enqueue group id
    next_seq: int           # next enqueue order
    group_rows: dict        # group id -> its rows in the table
    qruns: dict             # (queue row, run row) -> qrun row
    name_hashes: np.ndarray  # name hash of each held row (for the name index) ...
    name_rows: np.ndarray   # ... and the row
    finalize_rows: int      # finalize rows in use: leases or FREE below it
    fz_free: np.ndarray     # freed finalize rows, ascending
    pools_live: int         # warm pools holding leases
    queued: np.ndarray      # queued rows in enqueue order: into their lanes
    redispatch: np.ndarray  # run leases decided but never handed out: dispatch again
    fz_queued: np.ndarray   # finalize leases waiting for a worker
    fz_redispatch: np.ndarray  # finalize leases decided but never handed out
    timers: tuple           # (due, kind, row, ref), sorted by due
    abort_rows: dict        # root -> (partition, [(done_ns, starts, lengths)]): engine/_aborts.py


def _unpack(part, db, key, raw):
    try:
        return msgpack.unpackb(raw, raw=False)
    except Exception as exc:
        raise CorruptRecord(part, db, key, f"undecodable record: {exc}") from None


def _fixed(store, db, dtype):
    """All fixed records of ``db``: (records, rows, partitions), through the Store interface.
    Records carry their row, so a store may skip the keys; where it reads them, they are
    checked against the rows."""
    scan = store.scan_fixed(db, dtype, keys=False)
    recs = scan.values
    rows = recs["row"].astype(np.int64)
    if scan.keys is not None and (scan.keys.astype(np.int64) != rows).any():
        bad = int(np.flatnonzero(scan.keys.astype(np.int64) != rows)[0])
        raise CorruptRecord(int(scan.partition[bad]), db, int(scan.keys[bad]).to_bytes(8, "big"),
                            f"record of row {int(rows[bad])} stored under another key")
    return recs, rows, scan.partition


class _Progress:
    """A one-line progress report on an interactive terminal (silent otherwise)."""

    def __init__(self, total_steps):
        self.on = sys.stderr.isatty()
        self.total = total_steps
        self.n = 0

    def step(self, what):
        if not self.on:
            return
        self.n += 1
        width = 24
        done = width * self.n // self.total
        sys.stderr.write(f"\rreload [{'#' * done}{'.' * (width - done)}] {what:<28}")
        sys.stderr.flush()

    def close(self):
        if self.on:
            sys.stderr.write("\n")


# Action columns reload writes for every row (the rest keep their fill values): the record's
# columns, and those rebuilt from it (holders, lanes, (queue, run) pairs, the edges flag).
_PRESET = frozenset({"a_" + f for f in action_columns(0, 1)}
                    | {"a_worker", "a_qrun", "a_lane", "a_edges"})


class _Loading:
    """The working set of one :func:`load` (what becomes its :class:`Restored`)."""

    def __init__(self, config, state, now):
        self.config = config
        self.st = state
        self.now = now
        self.queue_names = [q.name for q in config.queues]
        self.cluster_index = {c.name: i for i, c in enumerate(config.clusters)}
        self.workers = []
        self.run_keys = []
        self.tenants = {}
        self.envs = {}
        self.history = RuntimeHistory()
        self.task_names = []
        self.queue_changes = {}
        self.n_fz = 0
        self.fz_free = np.zeros(0, dtype=np.int64)
        self.holder = None          # restored holder identities (action rows)
        self.fz_holder = self.fz_pref = None


def load(store, config, now):
    """Read the shard's memory from ``store`` (a :class:`storage.Store`) for ``config`` at
    engine time ``now``: a :class:`Restored`. :class:`CorruptRecord` names a record that
    cannot be part of it; ``ConfigError`` a stored record the config no longer allows."""
    progress = _Progress(8)
    progress.step("actions")
    recs, rows, parts = _fixed(store, "actions", action_dtype(len(config.resources),
                                                               State.pods_of(config)))
    recs, rows, parts = _one_per_row(recs, rows, parts, "actions")
    n = _check_dense(rows, parts, "actions")
    ld = _Loading(config, State.for_config(config, preset_rows=n, preset=_PRESET,
                                           packed=False), now)
    progress.step("workers, runs, environments")
    _load_small(ld, store)
    progress.step("action columns")
    edges = _fill_actions(ld, recs, rows, parts, n) if n else None
    progress.step("aborts")
    aborts = _apply_aborts(ld, store, n)
    progress.step("finalize leases")
    _load_finalize(ld, store, n)
    progress.step("lanes and counters")
    out = _rebuild(ld, n)
    progress.step("timers")
    timers = armed_timers(ld.st, n, ld.n_fz)
    ld.st.pack()        # the tick's layout, once every whole-column pass is done
    progress.step("ready")
    progress.close()
    empty = np.zeros(0, dtype=np.int64)
    free_rows, next_gid, next_seq, group_rows, hashes, held = edges or (
        empty, 0, 0, {}, np.zeros(0, dtype=np.uint64), empty)
    return Restored(
        state=ld.st, workers=ld.workers, run_keys=ld.run_keys, tenants=ld.tenants,
        envs=ld.envs,
        history=ld.history, task_names=ld.task_names, queue_changes=ld.queue_changes,
        rows=n, free_rows=free_rows, next_gid=next_gid, next_seq=next_seq,
        group_rows=group_rows, name_hashes=hashes, name_rows=held, finalize_rows=ld.n_fz,
        fz_free=ld.fz_free, timers=timers, abort_rows=aborts, **out)


def _load_small(ld, store):
    """Workers (identities), runs, environments, task histories and live queue changes:
    small tables of msgpack records."""
    st, config = ld.st, ld.config
    n_res = len(config.resources)
    for p, key, raw in store.scan("workers"):
        name, cluster = _unpack(p, "workers", key, raw)
        ident = int.from_bytes(key, "big")
        while len(ld.workers) <= ident:
            ld.workers.append(None)
        ld.workers[ident] = (name, cluster)
    if None in ld.workers:
        raise CorruptRecord(0, "workers", None, "worker identities are not dense")
    for p, key, raw in store.scan("runs"):
        run_key, cap = _unpack(p, "runs", key, raw)
        row = int.from_bytes(key, "big")
        st.ensure("runs", row + 1)
        while len(ld.run_keys) <= row:
            ld.run_keys.append(None)
        ld.run_keys[row] = run_key
        st.u_cap[row] = cap
        st.u_tenant[row] = st.tenant_row(ld.tenants, config, run_key.split("/", 1)[0])[0]
    queue_index = {name: i for i, name in enumerate(ld.queue_names)}
    n_envs = 0
    for p, key, raw in store.scan("envs"):
        env_key, qname, slots, ttl, footprint = _unpack(p, "envs", key, raw)
        row = int.from_bytes(key, "big")
        if qname not in queue_index:
            raise ConfigError(f"{config.source}: queue {qname!r} of a stored warm pool "
                              f"is not configured")
        if len(footprint) != n_res:
            raise CorruptRecord(p, "envs", key, "footprint has the wrong resource count")
        st.ensure("envs", row + 1)
        ld.envs[env_key] = row
        st.e_queue[row] = queue_index[qname]
        st.e_slots[row] = slots
        st.e_idle_ttl[row] = ttl
        st.e_footprint[row] = footprint
        n_envs = max(n_envs, row + 1)
    st.n_envs = n_envs
    for p, key, raw in store.scan("history"):
        # [task, shape, record or None] per history key row (schema 2; docs/predictions.md).
        value = _unpack(p, "history", key, raw)
        if (not isinstance(value, list) or len(value) != 3 or not isinstance(value[0], str)
                or not isinstance(value[1], str)):
            raise CorruptRecord(p, "history", key, f"expected [task, shape, record], not "
                                                   f"{str(value)[:80]}")
        hkey, data = (value[0], value[1]), value[2]
        row = int.from_bytes(key, "big")
        if row != len(ld.task_names):
            raise CorruptRecord(p, "history", key, "history key rows are not dense")
        if data is not None:
            try:
                ld.history.load(hkey, data)
            except ValueError as exc:
                raise CorruptRecord(p, "history", key, str(exc)) from None
        st.ensure("tasks", row + 1)
        ld.task_names.append(hkey)     # its prediction: Engine._refresh_predictions
    for p, key, raw in store.scan("queues"):
        qname = key.decode()
        if qname in queue_index:
            ld.queue_changes[qname] = _unpack(p, "queues", key, raw)


def _apply_aborts(ld, store, n):
    """Apply every abort record (engine/_aborts.py) to the rows it lists whose loaded record
    is still their pre-abort one, before anything is derived from the columns (lanes,
    counters, timers, dispatch). Returns the records: root -> (partition, entries)."""
    aborts = {}
    for part in range(store.partitions):
        for key, raw in store.scan_range(part, "attempts", ABORT_ROWS_START, ABORT_ROWS_STOP):
            if len(key) != 9:
                continue        # (no other attempts key starts with b"r")
            root = int.from_bytes(key[1:], "big")
            entries = decode_abort_rows(part, key, raw)
            if root >= n:
                raise CorruptRecord(part, "attempts", key, f"abort of row {root}, past the "
                                                          f"table ({n})")
            for done, starts, lengths in entries:
                apply_abort(ld.st, n, part, root, done, rows_of(starts, lengths))
            aborts[root] = (part, entries)
    return aborts


def _one_per_row(recs, rows, parts, db):
    """One record per row (action or finalize rows). A freed row reused by another
    partition's action leaves its FREE record behind in the old partition: per row the
    occupied record wins, else the FREE one with the highest generation. Two occupied
    records of one row are corrupt."""
    if not rows.size:
        return recs, rows, parts
    n = int(rows.max()) + 1
    if rows.size == n and np.bincount(rows, minlength=n).max() == 1:
        return recs, rows, parts          # the common case: nothing left behind
    occupied = recs["state"] != RowState.FREE
    order = np.lexsort((recs["gen"], occupied, rows))
    last = np.ones(order.size, dtype=bool)
    last[:-1] = rows[order][1:] != rows[order][:-1]
    busy = np.bincount(rows[occupied], minlength=n)
    if busy.size and busy.max() > 1:
        row = int(np.argmax(busy))
        bad = int(np.flatnonzero(occupied & (rows == row))[1])
        raise CorruptRecord(int(parts[bad]), db, row.to_bytes(8, "big"),
                            f"two records hold row {row}")
    keep = order[last]
    return recs[keep], rows[keep], parts[keep]


def _check_dense(rows, parts, db):
    """Rows must be exactly 0..n-1 (in any order: partitions interleave them); returns n."""
    if not rows.size:
        return 0
    n = int(rows.max()) + 1
    seen = np.zeros(n, dtype=bool)
    seen[rows] = True
    if rows.size != n or not seen.all():
        # Name a record that does not belong: a repeated row (or the highest one).
        order = np.argsort(rows, kind="stable")
        dup = np.flatnonzero(np.diff(rows[order]) == 0)
        bad = int(order[dup[0] + 1]) if dup.size else int(np.argmax(rows))
        raise CorruptRecord(int(parts[bad]), db, int(rows[bad]).to_bytes(8, "big"),
                            f"rows are not dense ({rows.size} records, max row {n - 1})")
    return n


def _fill_actions(ld, recs, rows, parts, n):
    """The action columns from their records; returns the table's edges: (free rows, next
    group id, next enqueue order, rows per group, name hashes and rows of held rows)."""
    st = ld.st
    if (recs["part"] != parts).any():
        bad = int(np.flatnonzero(recs["part"] != parts)[0])
        raise CorruptRecord(int(parts[bad]), "actions", int(rows[bad]).to_bytes(8, "big"),
                            "record belongs to another partition")
    # One pass over the records, in Cython with the GIL released: two halves on two cores.
    raw = np.ascontiguousarray(recs).view(np.uint8)
    holder = np.empty(n, dtype=np.int32)
    codec = RecordCodec()
    codec.bind(st)
    bad = in_threads(lambda part: codec.decode_actions(raw, part[0], part[1], holder),
                     halves(n))
    if any(b >= 0 for b in bad):     # (dense rows were checked: a codec/layout mismatch)
        i = min(b for b in bad if b >= 0)
        raise CorruptRecord(int(parts[i]), "actions", int(rows[i]).to_bytes(8, "big"),
                            "record's row is outside the table")
    occupied = st.a_state[:n] != RowState.FREE
    free = ~occupied
    if free.any() and (st.a_released_gen[:n][free] != st.a_gen[:n][free]).any():
        raise CorruptRecord(None, "actions", None, "a FREE row has a lease in flight")
    queue = st.a_queue[:n][occupied]
    if queue.size and (int(queue.max()) >= len(ld.queue_names) or int(queue.min()) < 0):
        raise CorruptRecord(None, "actions", None, "queue index outside the layout")
    runs = st.a_run[:n][occupied]
    known = np.fromiter((k is not None for k in ld.run_keys), dtype=bool,
                        count=len(ld.run_keys))     # run rows may be free (engine/_retain.py)
    if runs.size and (int(runs.max()) >= known.size or int(runs.min()) < 0
                      or not known[runs].all()):
        raise CorruptRecord(None, "actions", None, "run row without a run record")
    if int(st.a_task[:n].max()) >= len(ld.task_names):
        raise CorruptRecord(None, "actions", None, "history key row without a history record")
    link_children(st, n, occupied)
    # A row with an attempts record has its Python record as truth (decoded on first use).
    st.a_edges[:n] = (st.a_lean[:n] == 0) & occupied
    ld.holder = holder      # identities, turned into session rows in _rebuild
    held = np.flatnonzero(occupied)
    return (np.flatnonzero(free).astype(np.int64), int(st.a_group[:n].max()) + 1,
            int(st.a_seq[:n].max()) + 1, _counts(st.a_group[:n][occupied]),
            st.a_name_hash[held], held.astype(np.int64))


def _counts(values):
    """``{value: how many times}`` of a non-negative int array; a bincount where the values'
    range is small against their number (group ids of live work mostly are), else a sort."""
    if not values.size:
        return {}
    low = int(values.min())
    if int(values.max()) - low <= 4 * values.size:
        counts = np.bincount(values - low)
        present = np.flatnonzero(counts)
        return dict(zip((present + low).tolist(), counts[present].tolist(), strict=True))
    uniq, counts = np.unique(values, return_counts=True)
    return dict(zip(uniq.tolist(), counts.tolist(), strict=True))


def link_children(st, n, occupied):
    """Rebuild the children index (``a_child``, ``a_sibling``) of rows ``[:n]`` from their
    parents, newest child first, as inserts leave it; and each run's list of its parentless
    actions (``u_child``; ``occupied`` marks the rows in use), newest row first."""
    parent = st.a_parent[:n]
    st.a_child[:n] = -1
    st.a_sibling[:n] = -1
    st.u_child[:] = -1
    link_roots(st.u_child, st.a_sibling, st.a_run,
               np.flatnonzero(occupied & (parent < 0)).astype(np.int64, copy=False))
    kids = np.flatnonzero(parent >= 0).astype(np.int32)
    if not kids.size:
        return
    # By parent, newest (latest enqueued) first.
    kids = kids[np.lexsort((-st.a_seq[kids], parent[kids]))]
    par = parent[kids]
    first = np.ones(kids.size, dtype=bool)
    first[1:] = par[1:] != par[:-1]
    st.a_child[par[first]] = kids[first]
    sibling = np.full(kids.size, -1, dtype=np.int32)
    same = ~first[1:]
    sibling[:-1][same] = kids[1:][same]
    st.a_sibling[kids] = sibling


def _load_finalize(ld, store, n):
    st = ld.st
    recs, rows, parts = _fixed(store, "finalize", FINALIZE_DTYPE)
    recs, rows, parts = _one_per_row(recs, rows, parts, "finalize")
    nf = _check_dense(rows, parts, "finalize")
    order = np.argsort(rows)
    recs = recs[order]
    st.ensure("finalize", max(nf, 1))
    ld.n_fz = nf
    if nf and int(recs["action"].max()) >= n:
        raise CorruptRecord(None, "finalize", None, "finalize lease of an unknown action")
    for name in finalize_columns():
        getattr(st, "fz_" + name)[:nf] = recs[name]
    # A lean row's attempt reads its finalize lease from the finalize row.
    act = st.fz_action[:nf]
    # (A finalize row of a reclaimed action points at none: act -1.)
    lean = (act >= 0) & (st.fz_attempt[:nf] == 1) & (st.a_lean[np.maximum(act, 0)] == 1)
    st.a_final[act[lean]] = np.flatnonzero(lean)
    ld.fz_holder = recs["holder"]
    ld.fz_pref = recs["pref"]
    ld.fz_free = np.flatnonzero(st.fz_state[:nf] == RowState.FREE).astype(np.int64)


def _rebuild(ld, n):
    """Sessions, (queue, run) pairs, lanes and in-flight counters from the columns; returns
    the :class:`Restored` fields for the kernel (lanes and dispatch)."""
    st, now = ld.st, ld.now
    ttl = ld.config.engine.lease_ttl_ns
    # Detached sessions: one per known worker identity, disconnected, adopting nothing
    # until the worker registers again (then its restored leases move to the new session).
    n_idents = len(ld.workers)
    st.ensure("workers", max(n_idents, 1))
    for ident, (_name, cluster) in enumerate(ld.workers):
        st.w_ident[ident] = ident           # session row = identity
        st.w_cluster[ident] = ld.cluster_index.get(cluster, -1)
        st.w_slots[ident] = 0
        st.w_connected[ident] = 0
    st.n_workers = n_idents
    ident_row = np.arange(n_idents, dtype=np.int64)

    # (queue, run) pairs and lanes.
    qruns = {}
    if n:
        holder = ld.holder
        if (holder >= n_idents).any():
            raise CorruptRecord(None, "actions", None, "lease holder is not a known worker")
        st.a_worker[:n] = np.where(holder >= 0, ident_row[np.maximum(holder, 0)]
                                   if ident_row.size else -1, -1)
        occ = np.flatnonzero(st.a_state[:n] != RowState.FREE)
        uniq, inv = _pairs(st.a_queue[occ], st.a_run[occ], len(ld.queue_names),
                           len(ld.run_keys))
        nq = uniq.size
        st.ensure("qruns", nq)
        st.qr_queue[:nq] = (uniq >> 32).astype(np.int32)
        st.qr_run[:nq] = (uniq & 0xFFFFFFFF).astype(np.int32)
        st.a_qrun[:n] = -1
        st.a_qrun[occ] = inv.astype(np.int32)
        qruns = dict(zip(zip(st.qr_queue[:nq].tolist(), st.qr_run[:nq].tolist(),
                                  strict=True), range(nq), strict=True))

    # In-flight counters: a recount of the unreleased leases (released counters start at 0).
    live = np.flatnonzero((st.a_gen[:n] != 0) & (st.a_released_gen[:n] != st.a_gen[:n]))
    states = st.a_state[live]
    if not np.isin(states, (RowState.SENT, RowState.RUNNING)).all():
        raise CorruptRecord(None, "actions", None, "an unreleased lease is not in flight")
    if (st.a_end[live] != LeaseEnd.LIVE).any() or (st.a_worker[live] < 0).any():
        raise CorruptRecord(None, "actions", None, "an in-flight lease has no live holder")
    q, c = st.a_queue[live], st.a_cluster[live]
    qr, e = st.a_qrun[live], st.a_env[live]
    nq_ = len(ld.queue_names)
    st.q_adm[:] = np.bincount(q, minlength=nq_).astype(np.uint64)
    nqr = len(qruns)
    st.qr_adm[:nqr] = np.bincount(qr, minlength=nqr)[:nqr].astype(np.uint64)
    busy_pairs = np.flatnonzero(st.qr_adm[:nqr] > 0)
    st.q_runs_adm[:] = np.bincount(st.qr_queue[busy_pairs], minlength=nq_).astype(np.uint64)
    nu = len(ld.run_keys)
    st.u_adm[:nu] = np.bincount(st.a_run[live], minlength=nu)[:nu].astype(np.uint64)
    # A tenant's actions and runs in flight: its runs' (every live run row has a tenant).
    nt = len(ld.tenants)
    st.tn_adm[:nt] = np.bincount(st.u_tenant[st.a_run[live]], minlength=nt)[:nt].astype(
        np.uint64)
    busy_runs = np.flatnonzero(st.u_adm[:nu] > 0)
    st.tn_runs_adm[:nt] = np.bincount(st.u_tenant[busy_runs], minlength=nt)[:nt].astype(
        np.uint64)
    if live.size == n and (st.a_charged[:n] == 1).all():     # all in flight: no gather
        add_by(st.q_res_adm, st.a_queue[:n], st.a_demand[:n])
        add_by(st.c_adm, st.a_cluster[:n], st.a_demand[:n])
    else:
        charged = live[st.a_charged[live] == 1]
        demand = st.a_demand[charged]
        add_by(st.q_res_adm, st.a_queue[charged], demand)
        add_by(st.c_adm, st.a_cluster[charged], demand)
    nw = st.n_workers
    st.w_adm[:nw] = np.bincount(st.a_worker[live], minlength=nw)[:nw].astype(np.uint64)
    pooled = e >= 0
    pools = 0
    if pooled.any():
        ne = st.n_envs
        st.e_adm[:ne] = np.bincount(e[pooled], minlength=ne)[:ne].astype(np.uint64)
        # A live pool runs where its leases run: one vectorised pass, not a scan per pool.
        envs, first = np.unique(e[pooled], return_index=True)
        clusters = c[pooled][first]
        st.e_cluster[envs] = clusters
        st.e_gen[envs] = 1
        st.e_released_gen[envs] = 0
        st.e_last_active[envs] = now
        footprint = st.e_footprint[envs].astype(np.uint64)
        np.add.at(st.q_res_adm, st.e_queue[envs], footprint)
        np.add.at(st.c_adm, clusters, footprint)
        pools = int(envs.size)
    st.a_expiry[live] = now + ttl        # a fresh window: reconnecting workers validate

    # Finalize leases: holders, worker slots, pending list, fresh windows.
    nf = ld.n_fz
    if nf:
        for col, src in ((st.fz_worker, ld.fz_holder), (st.fz_pref, ld.fz_pref)):
            if (src >= n_idents).any():
                raise CorruptRecord(None, "finalize", None, "holder is not a known worker")
            col[:nf] = np.where(src >= 0, ident_row[np.maximum(src, 0)]
                                if ident_row.size else -1, -1)
        fl = np.flatnonzero((st.fz_gen[:nf] != 0) & (st.fz_released_gen[:nf] != st.fz_gen[:nf]))
        np.add.at(st.w_adm, st.fz_worker[fl], np.uint64(1))
        st.fz_expiry[fl] = now + ttl
    # Queued actions back into their lanes (fast lane while their pool lives), in row
    # order, which is first-enqueue order.
    if n:
        fast = (st.a_env[:n] >= 0) & (st.e_cluster[np.maximum(st.a_env[:n], 0)] >= 0)
        st.a_lane[:n] = np.where(st.a_qrun[:n] >= 0, 2 * st.a_qrun[:n] + fast.astype(np.int32),
                                 -1)
    queued = np.flatnonzero(st.a_state[:n] == RowState.QUEUED).astype(np.int32)
    # In enqueue order (a reclaimed row is reused by later work: rows are not in order).
    seq = st.a_seq[queued]
    if seq.size > 1 and (seq[1:] < seq[:-1]).any():
        queued = queued[np.argsort(seq, kind="stable")]
    # Decided but never handed to the dispatcher: dispatch again (same lease, same holder).
    again = live[(st.a_state[live] == RowState.SENT)
                 & (st.a_delivered_gen[live] != st.a_gen[live])]
    fz_again = np.flatnonzero((st.fz_state[:nf] == RowState.SENT)
                              & (st.fz_delivered_gen[:nf] != st.fz_gen[:nf]))
    return {"qruns": qruns, "pools_live": pools, "queued": queued,
            "redispatch": again.astype(np.int64),
            "fz_queued": np.flatnonzero(st.fz_state[:nf] == RowState.QUEUED),
            "fz_redispatch": fz_again}


def _pairs(queue, run, n_queues, n_runs):
    """Distinct (queue, run) pairs (as queue << 32 | run, ascending) and each row's index."""
    if n_queues * n_runs <= 1 << 24:
        key = queue.astype(np.int64) * n_runs + run
        present = np.zeros(n_queues * n_runs, dtype=bool)
        present[key] = True
        ids = np.cumsum(present, dtype=np.int64) - 1
        keys = np.flatnonzero(present)
        uniq = ((keys // n_runs) << 32) | (keys % n_runs)
        return uniq, ids[key]
    pair = (queue.astype(np.int64) << 32) | run.astype(np.int64)
    order = np.argsort(pair, kind="stable")
    ordered = pair[order]
    first = np.empty(pair.size, dtype=bool)
    first[:1] = True
    first[1:] = ordered[1:] != ordered[:-1]
    inv = np.empty(pair.size, dtype=np.int64)
    inv[order] = np.cumsum(first) - 1
    return ordered[first], inv
