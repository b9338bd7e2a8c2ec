"""The shard's state as structure-of-arrays: numpy buffers the Cython kernel binds to.

Tables (actions, (queue, run) pairs and their lanes, runs, workers, environments) start at a
configured size and grow by doubling; rows are recycled through free lists kept here, at the
edge, in Python. Queue and cluster tables are sized by the config.
"""

import numpy as np
import psutil

from engine._errors import ConfigError
from engine._parallel import halves, in_threads
from engine._units import UNLIMITED

__all__ = ["State", "start_bytes", "check_fits_memory"]

I64, I32, U8, U64 = np.int64, np.int32, np.uint8, np.uint64
# Expiry of a lease that is not live: the expiry sweep is then one compare per row.
NEVER = np.iinfo(np.int64).max

# name -> (dtype, fill, per-row shape suffix ("R" = one entry per resource)) for each table.
ACTION_FIELDS = {
    "a_state": (U8, 0, ()),
    "a_queue": (I32, -1, ()),
    "a_run": (I32, -1, ()),
    "a_qrun": (I32, -1, ()),
    "a_lane": (I32, -1, ()),
    "a_env": (I32, -1, ()),
    "a_next": (I32, -1, ()),
    "a_prev": (I32, -1, ()),
    "a_fit": (U64, 0, ()),
    "a_demand": (I64, 0, ("R",)),
    "a_gen": (I64, 0, ()),
    "a_released_gen": (I64, 0, ()),
    "a_charged": (U8, 0, ()),
    "a_cluster": (I32, -1, ()),
    "a_worker": (I32, -1, ()),
    "a_wait_code": (U8, 0, ()),
    "a_wait_tick": (I64, -1, ()),
    "a_wait_cluster": (I32, -1, ()),
    "a_wait_dim": (I32, -1, ()),
    "a_wait_blocker": (I32, -1, ()),
    # In memory only: the kernel's tick_no when the row's current attempt joined its lane,
    # and, stamped when the tick places it, the WaitCode that held it until then (W_NONE:
    # no tick did). The queue-wait histogram's reason (docs/status.md, DispatchBatch).
    "a_queued_tick": (I64, -1, ()),
    "a_held_code": (U8, 0, ()),
    "a_enqueued": (I64, 0, ()),
    "a_expiry": (I64, NEVER, ()),
    "a_end": (U8, 0, ()),
    # Durable columns (engine/_records.py): partition, parent row, attempt number, the
    # generation last handed to the dispatcher, timer dues (NEVER = none), name hash.
    "a_part": (U8, 0, ()),
    "a_parent": (I32, -1, ()),
    # Children index (derived, rebuilt at reload): the newest child, then the next older
    # sibling, so a cascade visits only the descendants. A parentless action is in its
    # run's list instead (u_child), linked the same way.
    "a_child": (I32, -1, ()),
    "a_sibling": (I32, -1, ()),
    "a_attempt": (I32, 0, ()),
    "a_delivered_gen": (I64, 0, ()),
    "a_deadline_due": (I64, NEVER, ()),
    "a_queued_due": (I64, NEVER, ()),
    "a_retry_due": (I64, NEVER, ()),
    "a_runtime_due": (I64, NEVER, ()),
    "a_name_hash": (U64, 0, ()),
    # Lean rows (engine/_engine.py): the enqueue group (its shared spec and the names), the
    # row's index in it, and while a_lean the whole outcome of its one attempt: phase code
    # and assignment, RUNNING and end times (NEVER = not yet).
    "a_group": (I64, -1, ()),
    "a_gidx": (I32, -1, ()),
    "a_lean": (U8, 0, ()),
    "a_phase": (U8, 0, ()),
    "a_start": (I64, NEVER, ()),
    "a_running": (I64, NEVER, ()),
    "a_done": (I64, NEVER, ()),
    "a_abort": (I64, -1, ()),           # lean ABORTED: the row whose abort ended it
    # Enqueue order (shard-wide, monotonic): lanes are rebuilt in it at reload, since a
    # reclaimed row is reused by a later action (engine/_retain.py).
    "a_seq": (I64, 0, ()),
    # In memory only (derived at reload): the finalize lease of a lean row's attempt, -1.
    "a_final": (I64, -1, ()),
    # In memory only: 1 when the row's Python record (spec, outcome, attempts) is its truth.
    "a_edges": (U8, 0, ()),
    # --- backfill (see docs/architecture.md, "Backfill") ---
    "a_task": (I32, -1, ()),            # history key row: (task name, shape)
    "a_est_rt": (I64, NEVER, ()),       # its spec's runtime_estimate (ns; NEVER = none)
    "a_max_rt": (I64, NEVER, ()),       # its spec's max_runtime (ns; NEVER = none)
    "a_pred_end": (I64, NEVER, ()),     # predicted end (ns) of the live lease; NEVER = unknown
    "a_backfilled": (U8, 0, ()),        # 1 when the current generation was placed by backfill
    "a_lnext": (I32, -1, ()),           # next live charged lease on its cluster
    "a_lprev": (I32, -1, ()),           # previous one
    "s_bf_key": (I64, 0, ()),           # tick scratch: predicted ends being sorted
    "s_bf_row": (I32, -1, ()),          # tick scratch: ... and their rows
    "f_action": (I32, -1, ()),
    "f_code": (U8, 0, ()),
    # --- node-aware admission (docs/nodes.md; in memory only) ---
    "a_pg_first": (I32, -1, ()),        # its first pod group row (largest first), -1 none
    "a_pg_n": (I32, 0, ()),             # ... and how many
    "a_pnode": (I32, -1, ("P",)),       # node of each pod of the lease (pod-group order)
}
QRUN_FIELDS = {
    "qr_queue": (I32, -1, ()),
    "qr_run": (I32, -1, ()),
    "qr_adm": (U64, 0, ()),
    "qr_rel": (U64, 0, ()),
}
# Two lanes per (queue, run) pair: lane = 2 * qrun + fast.
LANE_FIELDS = {
    "ln_head": (I32, -1, ()),
    "ln_tail": (I32, -1, ()),
    "ln_next": (I32, -1, ()),
    "ln_prev": (I32, -1, ()),
    "ln_in_ring": (U8, 0, ()),
    "ln_scan": (I32, -1, ()),
    "ln_scan_tick": (I64, -1, ()),
    "ln_park": (I32, -1, ()),
    "ln_skip_code": (U8, 0, ()),
    "ln_skip_tick": (I64, -1, ()),
}
# One row per history key (task name, resource shape): what its runtime history predicts
# (set by the engine; docs/predictions.md).
TASK_FIELDS = {
    # the key's prediction (ns): its history, else its shape's prior; NEVER none
    "t_pred_rt": (I64, NEVER, ()),
    # 1 while t_pred_rt is its shape's prior (the key has no success of its own)
    "t_prior": (U8, 0, ()),
}
RUN_FIELDS = {
    "u_cap": (I64, 0, ()),
    "u_adm": (U64, 0, ()),
    "u_rel": (U64, 0, ()),
    "u_tenant": (I32, -1, ()),          # tenant row (the first segment of the run key)
    # The run's newest parentless action, linked to the older ones through a_sibling (the
    # children index's roots: derived, rebuilt at reload); every action of the run is one
    # of them or a descendant.
    "u_child": (I32, -1, ()),
}
# One row per tenant seen (in memory only: derived from the run keys at reload; caps from
# the config's [tenants.NAME] or [tenant_defaults]). In flight = adm - rel, as everywhere.
# Pod groups of the actions that may run on a cluster with admission = "nodes", interned by
# content (engine/_admission.py): an action's groups are rows a_pg_first .. + a_pg_n - 1,
# largest first (engine/_nodes.py's size_order), so the gate's first fit decreasing reads them
# in order. Rows are never reused (one per distinct gang, like history keys).
PODGROUP_FIELDS = {
    "pg_vec": (I64, 0, ("R",)),         # the per-pod vector of the group
    "pg_count": (I64, 0, ()),           # its replicas
}
# One row per node of the clusters with admission = "nodes" (sized by the config: each
# cluster's shapes in order, count nodes each, as engine/_nodes.py numbers them).
NODE_FIELDS = {
    "n_cluster": (I32, -1, ()),         # cluster row
    "n_alloc": (I64, 0, ("R",)),        # allocatable vector
    "n_used": (I64, 0, ("R",)),         # placed pods of live leases (credited at release)
    # In memory only: what a worker last reported free on the node (UNLIMITED: no report),
    # and n_adm, the pods charged to it ever (cumulative), at that report; free is then at
    # most n_obs - (n_adm - n_obs_mark), as for a cluster's c_obs.
    "n_obs": (I64, UNLIMITED, ("R",)),
    "n_obs_mark": (I64, 0, ("R",)),
    "n_adm": (I64, 0, ("R",)),
}
TENANT_FIELDS = {
    "tn_action_cap": (I64, 0, ()),      # action_concurrency, 0 = unlimited
    "tn_run_cap": (I64, 0, ()),         # run_concurrency, 0 = unlimited
    "tn_adm": (U64, 0, ()),             # actions admitted
    "tn_rel": (U64, 0, ()),             # actions released
    "tn_runs_adm": (U64, 0, ()),        # runs that went from 0 to >0 actions in flight
    "tn_runs_rel": (U64, 0, ()),        # runs that went back to 0
}
WORKER_FIELDS = {
    "w_cluster": (I32, -1, ()),
    "w_slots": (I64, 0, ()),
    "w_adm": (U64, 0, ()),
    "w_rel": (U64, 0, ()),
    "w_connected": (U8, 0, ()),
    "w_ident": (I32, -1, ()),
    "w_paused": (U8, 0, ()),            # W_DRAINING | W_SUSPECT: nothing new is placed on it
}
#: ``w_paused`` bits. Draining (``Engine.drain_worker``) lasts for the session; a suspect (it
#: let a lease expire, ``engine.pause_on_expiry``) is cleared by its next heartbeat.
W_DRAINING = 1
W_SUSPECT = 2
ENV_FIELDS = {
    "e_queue": (I32, -1, ()),
    "e_cluster": (I32, -1, ()),
    "e_slots": (I64, 0, ()),
    "e_idle_ttl": (I64, 0, ()),
    "e_last_active": (I64, 0, ()),
    "e_adm": (U64, 0, ()),
    "e_rel": (U64, 0, ()),
    "e_footprint": (I64, 0, ("R",)),
    "e_gen": (I64, 0, ()),
    "e_released_gen": (I64, 0, ()),
}
FINALIZE_FIELDS = {
    "fz_state": (U8, 0, ()),
    "fz_action": (I32, -1, ()),
    "fz_cluster": (I32, -1, ()),
    "fz_pref": (I32, -1, ()),
    "fz_worker": (I32, -1, ()),
    "fz_gen": (I64, 0, ()),
    "fz_released_gen": (I64, 0, ()),
    "fz_expiry": (I64, NEVER, ()),
    "fz_end": (U8, 0, ()),
    "fz_next": (I32, -1, ()),
    "fz_attempt": (I32, 0, ()),
    "fz_delivered_gen": (I64, 0, ()),
    "fz_give_up": (I64, NEVER, ()),
    "fz_outcome": (U8, 0, ()),          # engine._rows.FZ_OUTCOMES: how it ended (0: not yet)
}
# The action columns the tick reads or stamps for each candidate it examines, stored
# interleaved: one record of PACKED_BYTES per row (two cache lines, 64-byte aligned), each
# column a strided view of it. A candidate then costs two line fills, not one per column
# (the kernel's time is its cache misses: bench/README.md). Widest first, so every field is
# naturally aligned; what a candidate that only waits touches comes first (one line).
ACTION_PACKED = (
    "a_fit", "a_wait_tick",
    "a_state", "a_wait_code", "a_held_code", "a_end", "a_charged", "a_backfilled",
    "a_run", "a_qrun", "a_env", "a_next", "a_prev", "a_lane", "a_queue",
    "a_wait_cluster", "a_wait_dim", "a_wait_blocker",
    # the second line: placement stamps (not a_expiry: the expiry sweep compares the whole
    # column, which must stay contiguous: 8 ms against 0.5 over a million strided rows)
    "a_gen", "a_released_gen", "a_pred_end", "a_queued_tick",
    "a_cluster", "a_worker", "a_lnext", "a_lprev", "a_task",
)
PACKED_BYTES = 128
_LINE = 64


# The dispatch channel: a ring of decided leases (engine.dispatch_capacity slots).
DISPATCH_FIELDS = {
    "d_action": (I32, -1, ()),
    "d_gen": (I64, 0, ()),
    "d_cluster": (I32, -1, ()),
    "d_worker": (I32, -1, ()),
    "d_kind": (U8, 0, ()),
}


def _packed_dtype():
    offsets, at = [], 0
    for name in ACTION_PACKED:
        size = np.dtype(ACTION_FIELDS[name][0]).itemsize
        at = -(-at // size) * size                  # naturally aligned
        offsets.append(at)
        at += size
    assert at <= PACKED_BYTES, f"the packed action columns take {at} bytes"
    return np.dtype({"names": list(ACTION_PACKED),
                     "formats": [ACTION_FIELDS[n][0] for n in ACTION_PACKED],
                     "offsets": offsets, "itemsize": PACKED_BYTES})


PACKED_DTYPE = _packed_dtype()


_FILL = np.zeros(1, PACKED_DTYPE)
for _name in ACTION_PACKED:
    _FILL[_name] = ACTION_FIELDS[_name][1]
# Rows copied at a time into a packed array (a 1 MiB slice of it, which stays in cache
# while each of its columns is written).
_PACK_ROWS = 8192


def _packed_rows(rows):
    # 64-byte aligned: each record is its two lines, not parts of three.
    raw = np.empty(rows * PACKED_BYTES + _LINE, dtype=np.uint8)
    skip = -raw.ctypes.data % _LINE
    return raw[skip:skip + rows * PACKED_BYTES].view(PACKED_DTYPE)


def _words(rec):
    # A packed array as rows of 64-bit words: whole-record copies and fills run as plain
    # integer copies (a structured array's own assignment goes field by field, ~15x slower).
    return rec.view(np.uint64).reshape(len(rec), PACKED_BYTES // 8)


def _alloc_packed(rows, old=None):
    """The packed record array of ``rows`` rows, the rows of ``old`` (a packed array)
    copied in, every other row its columns' fill."""
    rec = _packed_rows(rows)
    words = _words(rec)
    first = 0 if old is None else len(old)
    if first:
        words[:first] = _words(old)
    words[first:] = _FILL.view(np.uint64)
    return rec


def _packed_columns(rec):
    return {name: rec[name] for name in ACTION_PACKED}


TABLES = {
    "actions": ACTION_FIELDS,
    "qruns": QRUN_FIELDS,
    "lanes": LANE_FIELDS,
    "runs": RUN_FIELDS,
    "workers": WORKER_FIELDS,
    "envs": ENV_FIELDS,
    "finalize": FINALIZE_FIELDS,
    "tasks": TASK_FIELDS,
    "tenants": TENANT_FIELDS,
    "podgroups": PODGROUP_FIELDS,
}


# numpy asks the kernel for transparent huge pages for a buffer of this size or more
# (``madvise``; NUMPY_MADVISE_HUGEPAGE=0 turns it off).
_HUGE_MIN = 4 << 20


def _arena(nbytes):
    """A zeroed byte buffer of ``nbytes``, 64-byte aligned. Zeros come from calloc: pages
    are mapped (and counted) when first written."""
    raw = np.zeros(nbytes + _LINE, dtype=np.uint8)
    skip = -raw.ctypes.data % _LINE
    return raw[skip:skip + nbytes]


def _alloc(fields, rows, n_res, preset_rows=0, preset=(), n_pods=1, packed=False, old=None):
    """The columns of a table of ``rows`` rows.

    A column of ``_HUGE_MIN`` bytes or more is a buffer of its own, in huge pages; the
    smaller ones share one buffer, which is in huge pages when they add up to that: a tick
    and its encode read ~45 columns of rows scattered over the table, and 45 small buffers
    each take a TLB entry per 4 KiB page (3-8% of a 65,536-row tick, bench/README.md).

    Suffix "R": one entry per resource; "P": one per pod of a node placement. ``packed``:
    the ACTION_PACKED columns are views of one packed record array (State.pack); not
    packed, they are buffers of their own (none shared: State.pack frees them).
    ``preset`` columns' first ``preset_rows`` rows are left for the caller to write (reload:
    memory touched once). ``old`` (name -> array, fewer rows): a growth, whose rows are
    copied in; every other row is its column's fill."""
    out = {}
    if packed:
        out["a_packed"] = rec = _alloc_packed(rows, None if old is None else old["a_packed"])
        out.update(_packed_columns(rec))
    shared, offsets, at = [], [], 0
    for name, (dtype, _fill, suffix) in fields.items():
        if name in out:
            continue
        dtype = np.dtype(dtype)
        shape = (rows,) + _shape(suffix, n_res, n_pods)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if nbytes >= _HUGE_MIN or name in ACTION_PACKED:
            out[name] = np.zeros(shape, dtype=dtype)
        else:
            shared.append(name)
            offsets.append(at)
            at += -(-nbytes // _LINE) * _LINE
            out[name] = (shape, dtype)
    if shared:
        arena = _arena(at)
        for name, at in zip(shared, offsets, strict=True):
            shape, dtype = out[name]
            out[name] = arena[at:at + int(np.prod(shape)) * dtype.itemsize].view(
                dtype).reshape(shape)
    for name, (_dtype, fill, _suffix) in fields.items():
        if packed and name in ACTION_PACKED:
            continue
        arr, first = out[name], 0
        if old is not None:
            first = len(old[name])
            arr[:first] = old[name]
        elif name in preset:
            first = preset_rows
        if fill != 0:
            arr[first:] = fill
    return out


def _start_rows(initial_rows, preset_rows=0):
    # Each table's rows when a State is made (they grow by doubling from there).
    small = max(16, initial_rows // 4)
    return {"actions": max(initial_rows, preset_rows), "qruns": small, "lanes": 2 * small,
            "runs": small, "workers": 16, "envs": small, "finalize": small, "tasks": small,
            "tenants": 16, "podgroups": 16}


def _shape(suffix, n_res, n_pods):
    # A column's shape past its rows: "R" one entry per resource, "P" one per pod.
    return tuple(n_res if s == "R" else n_pods if s == "P" else s for s in suffix)


def start_bytes(config):
    """Bytes the tables of a shard of ``config`` take when made (``engine.initial_capacity``
    rows of actions, and the dispatch channel), before any growth: what a start must be
    able to allocate."""
    n_res, pods = len(config.resources), State.pods_of(config)
    total = 0
    for table, rows in _start_rows(config.engine.initial_capacity).items():
        for dtype, _fill, suffix in TABLES[table].values():
            total += rows * int(np.prod(_shape(suffix, n_res, pods))) * np.dtype(dtype).itemsize
    slot = sum(np.dtype(dtype).itemsize for dtype, _fill, _suffix in DISPATCH_FIELDS.values())
    return total + config.engine.dispatch_capacity * slot


def check_fits_memory(config):
    """Refuse a config whose tables cannot be made on this machine (``engine.initial_capacity``,
    ``dispatch_capacity``, ``max_node_pods``): a clear error instead of a process that grows
    until the system kills it. A shard's start checks it, and ``leasehold config check``."""
    need = start_bytes(config)
    have = psutil.virtual_memory().total
    if need > have:
        raise ConfigError(
            f"{config.source}: engine.initial_capacity {config.engine.initial_capacity} / "
            f"dispatch_capacity {config.engine.dispatch_capacity}: the shard's tables would "
            f"take {need / 2**30:.1f} GiB when made, more than this machine's "
            f"memory ({have / 2**30:.1f} GiB); start smaller (the tables grow by "
            f"doubling as work arrives)")


class State:
    """All arrays of one shard. Attribute names are the kernel's field names."""

    @classmethod
    def for_config(cls, config, *, preset_rows=0, preset=(), packed=True):
        """The arrays of a shard of ``config`` (a :class:`~engine.Config`): its layout and
        engine settings, cluster capacities set. ``preset_rows`` and ``preset`` as in
        :func:`_alloc` (reload writes those columns of those rows itself). ``packed=False``:
        every action column a plain array until :meth:`pack` (reload's whole-column passes
        are then sequential)."""
        settings = config.engine
        res = config.resources
        st = cls(n_res=len(res), n_clusters=len(config.clusters), n_queues=len(config.queues),
                 initial_rows=settings.initial_capacity,
                 dispatch_capacity=settings.dispatch_capacity,
                 max_candidates=settings.max_candidates,
                 gate_on=settings.resource_gate == "enforce",
                 cpu_dim=res.cpu_index, res_accel=res.accelerator_mask,
                 preset_rows=preset_rows, preset=preset, packed=packed,
                 n_nodes=sum(s.count for c in config.clusters if c.admission == "nodes"
                             for s in c.node_shapes),
                 node_pods=settings.max_node_pods)
        for i, cluster in enumerate(config.clusters):
            if cluster.capacity is not None:
                st.c_cap[i] = cluster.capacity
        node = 0
        for i, cluster in enumerate(config.clusters):
            if cluster.admission != "nodes":
                continue
            st.c_nodes[i] = 1
            st.c_node_first[i] = node
            for shape in cluster.node_shapes:
                st.n_alloc[node:node + shape.count] = shape.allocatable
                st.n_cluster[node:node + shape.count] = i
                node += shape.count
            st.c_node_n[i] = node - st.c_node_first[i]
        return st

    @staticmethod
    def pods_of(config):
        """The width of the per-lease node placement (a_pnode and the record's ``pnode``)
        for ``config``: ``engine.max_node_pods`` when a cluster has admission = "nodes"."""
        if any(c.admission == "nodes" for c in config.clusters):
            return config.engine.max_node_pods
        return 0

    def __init__(self, *, n_res, n_clusters, n_queues, initial_rows, dispatch_capacity,
                 max_candidates, gate_on, cpu_dim, res_accel, preset_rows=0, preset=(),
                 n_nodes=0, node_pods=16, packed=True):
        self.n_res = n_res
        self.n_clusters = n_clusters
        self.n_queues = n_queues
        self.n_workers = 0
        self.n_envs = 0
        self.max_candidates = max_candidates
        self.gate_on = gate_on
        self.cpu_dim = cpu_dim
        self.res_accel = np.asarray(res_accel, dtype=U8)
        sizes = _start_rows(initial_rows, preset_rows)
        # Placements are recorded only when some cluster places pods on nodes: no column
        # otherwise (State.pods_of; the durable record has the same width).
        self.node_pods = node_pods if n_nodes else 0
        self.rows = {}
        for table, fields in TABLES.items():
            self.rows[table] = sizes[table]
            self.__dict__.update(_alloc(fields, sizes[table], n_res,
                                        preset_rows if table == "actions" else 0, preset,
                                        self.node_pods, packed and table == "actions"))
        # The node table is sized by the config once (at least one row: never read then).
        self.n_nodes = n_nodes
        self.__dict__.update(_alloc(NODE_FIELDS, max(1, n_nodes), n_res))

        q, c, r = n_queues, n_clusters, n_res
        self.q_order = np.arange(q, dtype=I32)
        self.q_priority = np.zeros(q, dtype=I64)
        self.q_strict = np.ones(q, dtype=U8)
        self.q_action_cap = np.zeros(q, dtype=I64)
        self.q_run_cap = np.zeros(q, dtype=I64)
        self.q_max = np.full((q, r), UNLIMITED, dtype=I64)
        self.q_clusters = np.zeros(q, dtype=U64)
        self.q_adm = np.zeros(q, dtype=U64)
        self.q_rel = np.zeros(q, dtype=U64)
        self.q_runs_adm = np.zeros(q, dtype=U64)
        self.q_runs_rel = np.zeros(q, dtype=U64)
        self.q_res_adm = np.zeros((q, r), dtype=U64)
        self.q_res_rel = np.zeros((q, r), dtype=U64)
        self.q_pending = np.zeros(q, dtype=I64)
        # Of the queued actions: those with a reusable environment, and those the gate would
        # fail; while either is non-zero the tick examines every action of the queue (kept by
        # the kernel's link and unlink; TickKernel.recount_queue after a queue change).
        self.q_env_pending = np.zeros(q, dtype=I64)
        self.q_doomed = np.zeros(q, dtype=I64)
        self.q_ring = np.full((q, 2), -1, dtype=I32)
        self.q_stop_code = np.zeros(q, dtype=U8)
        self.q_prev_stop = np.zeros(q, dtype=U8)    # tick scratch: q_stop_code before it
        self.q_stop_blocker = np.full(q, -1, dtype=I32)
        self.q_head = np.full(q, -1, dtype=I32)
        self.q_head_code = np.zeros(q, dtype=U8)
        self.q_head_since = np.zeros(q, dtype=I64)
        self.q_backfill = np.zeros(q, dtype=U8)
        self.q_paused = np.zeros(q, dtype=U8)      # queues.NAME.paused: the tick places none
        # queues.NAME.draining: admission refuses new actions (Python reads the config; the
        # column is for readers of the arrays, the status file's vectorised publish)
        self.q_draining = np.zeros(q, dtype=U8)
        self.q_backfilled = np.zeros(q, dtype=U64)

        self.c_cap = np.full((c, r), UNLIMITED, dtype=I64)
        self.c_adm = np.zeros((c, r), dtype=U64)
        self.c_rel = np.zeros((c, r), dtype=U64)
        self.c_obs = np.full((c, r), UNLIMITED, dtype=I64)
        self.c_obs_mark = np.zeros((c, r), dtype=U64)
        self.c_live = np.full(c, -1, dtype=I32)
        self.c_nodes = np.zeros(c, dtype=U8)            # 1: admission = "nodes"
        self.c_node_first = np.zeros(c, dtype=I32)      # its first node row
        self.c_node_n = np.zeros(c, dtype=I32)          # ... and how many

        self.__dict__.update(_alloc(DISPATCH_FIELDS, dispatch_capacity, n_res))

        self.s_budget = np.zeros(r, dtype=I64)
        self.s_free = np.zeros(r, dtype=I64)
        self.s_cfree = np.zeros((c, r), dtype=I64)
        self.s_prev_cfree = np.zeros((c, r), dtype=I64)    # ... as the tick before ended
        self.s_slots = np.zeros(c, dtype=I64)
        self.s_held_by = np.full(c, -1, dtype=I32)
        self.s_cursor = np.full(c, -1, dtype=I32)
        self.s_first = np.full(q, -1, dtype=I32)
        self.s_first_res = np.zeros(q, dtype=U8)
        self.s_bf_head = np.full(q, -1, dtype=I32)
        self.s_bq_head = np.full(q, -1, dtype=I32)
        self.s_bq_shadow = np.full(q, -1, dtype=I64)
        self.s_bq_gap = np.zeros(q, dtype=U8)
        self.s_bq_free = np.zeros(r, dtype=I64)
        self.s_shadow = np.full(c, NEVER, dtype=I64)
        self.s_extra = np.zeros((c, r), dtype=I64)
        self.s_bf_gap = np.zeros(c, dtype=U8)
        # Backfill reservations of one tick: at most one per queue on each cluster (its head
        # blocked this tick), in the order of the pass (TickKernel._reserve).
        self.s_rv_n = np.zeros(c, dtype=I32)
        self.s_rv_head = np.full((c, q), -1, dtype=I32)
        self.s_rv_shadow = np.full((c, q), -1, dtype=I64)
        self.s_rv_gap = np.zeros((c, q), dtype=U8)
        self.s_rv_extra = np.zeros((c, q, r), dtype=I64)
        self.s_pnode = np.full(self.node_pods, -1, dtype=I32)  # the gate's trial placement
        # Node clusters: each reservation's per-node free at its shadow time (rows of the
        # reservation's slot k, node rows of its cluster), n_used saved around a projection,
        # and a backfill candidate's placement while reservations are tested against it.
        nn = max(1, self.n_nodes)
        self.s_rv_nfree = np.zeros((q if self.n_nodes else 1, nn, r), dtype=I64)
        self.s_nsave = np.zeros((nn, r), dtype=I64)
        self.s_bf_pnode = np.full(self.node_pods, -1, dtype=I32)

    def tenant_row(self, tenants, config, tenant):
        """``(row, grown)``: the row of tenant ``tenant`` in ``tenants`` (name -> row, in row
        order), a new row with its caps from ``config`` (``Config.tenant``) when it has none.
        ``grown``: the tenant table was replaced (the caller rebinds the kernel)."""
        row = tenants.get(tenant)
        if row is not None:
            return row, False
        row = len(tenants)
        grown_ = self.ensure("tenants", row + 1)
        caps = config.tenant(tenant)
        self.tn_action_cap[row] = caps.action_concurrency
        self.tn_run_cap[row] = caps.run_concurrency
        tenants[tenant] = row
        return row, grown_

    @property
    def packed(self):
        """Whether the ACTION_PACKED columns are views of one packed record array."""
        return "a_packed" in self.__dict__

    def table_bytes(self, table):
        """Bytes the arrays of ``table`` take at its allocated size (the packed record
        array once, with its padding, for the packed action columns)."""
        packed = TABLES[table] is ACTION_FIELDS and self.packed
        out = self.a_packed.nbytes if packed else 0
        for name in TABLES[table]:
            if not (packed and name in ACTION_PACKED):
                out += getattr(self, name).nbytes
        return out

    def pack(self, parts=None):
        """Move the ACTION_PACKED columns into one packed record array (their values kept),
        a slice of rows at a time; a no-op when they are packed already. ``parts``: row
        ranges ``(lo, hi)`` covering the table, each copied by a thread of its own (default:
        two halves of a large table on a machine of several cores). The caller rebinds the
        kernel (arrays were replaced)."""
        if self.packed:
            return
        rows = self.rows["actions"]
        rec = _packed_rows(rows)
        columns = [(name, getattr(self, name)) for name in ACTION_PACKED]

        def copy(part):
            for lo in range(part[0], part[1], _PACK_ROWS):
                hi = min(lo + _PACK_ROWS, part[1])
                chunk = rec[lo:hi]
                for name, column in columns:
                    chunk[name] = column[lo:hi]

        parts = halves(rows, _PACK_ROWS) if parts is None else list(parts)
        if [lo for lo, _hi in parts] != [0] + [hi for _lo, hi in parts[:-1]] \
                or parts[-1][1] != rows:
            raise ValueError(f"pack: parts {parts} do not cover rows 0 .. {rows}")
        in_threads(copy, parts)
        self.a_packed = rec
        self.__dict__.update(_packed_columns(rec))

    def _resize(self, table, rows):
        fields = TABLES[table]
        old = {name: getattr(self, name) for name in fields}
        packed = fields is ACTION_FIELDS and self.packed
        if packed:
            old["a_packed"] = self.a_packed
        self.__dict__.update(_alloc(fields, rows, self.n_res, n_pods=self.node_pods,
                                    packed=packed, old=old))
        self.rows[table] = rows

    def reset_rows(self, table, rows, names=None):
        """Set ``rows`` of ``table`` back to each column's fill (``names``: only those
        columns), as a freed row reads before its next use."""
        fields = TABLES[table]
        for name in fields if names is None else names:
            getattr(self, name)[rows] = fields[name][1]

    def ensure(self, table, needed):
        """Grow ``table`` by doubling until it has ``needed`` rows; True if it grew.

        The caller must rebind the kernel after a growth (arrays were replaced).
        """
        rows = self.rows[table]
        if needed <= rows:
            return False
        while rows < needed:
            rows *= 2
        self._resize(table, rows)
        if table == "qruns":
            self._resize("lanes", rows * 2)
        return True
