"""Property tests (hypothesis) over the in-process ``Engine`` with a ``ManualClock``.

``EngineMachine`` (a ``RuleBasedStateMachine``) builds a small random config (cpu, memory,
gpu:H100; 2-3 clusters with known capacities and node shapes, maybe one of unknown capacity;
2-3 queues mixing STRICT_FIFO and GREEDY_CAPACITY with small action/run concurrency, budgets
and cluster lists; the gate mostly enforcing) and interleaves: enqueue (single pods, gangs,
warm-pool actions, batches, children, with run_max_action_concurrency and retries), refused
enqueues, ticks (draining the dispatch channel fully or partly), mark_running, complete
(SUCCEEDED; FAILED, retried or not), reports with stale generations, heartbeats (with foreign
or old tokens and free capacity), finalize reports, abort, worker (re)connects and
disconnects, live queue updates, clock advances (leases expire when heartbeats stop) and
busy worker loop turns. After every step it checks the engine against a recount over its own
arrays and against an independent model (what was assigned where, which pools are up, which
leases live until when, what every queue, run, worker and cluster allows):

 1. a cluster with a known capacity is never over-committed while the gate enforces, and the
    gate never admits past what a worker last reported free;
 2. a tick never admits past a queue's action/run concurrency or max_resources budget, nor a
    run's max_action_concurrency (a lowered cap admits nothing until in-flight is back under);
 3. no in-flight count is negative; a worker never holds more leases than its slots;
 4. every in-flight counter (queue, cluster, worker, run, pool, admitted totals) equals the
    recount and the model;
 5. one live holder per lease, generations strictly increasing, each recorded on its attempt;
    stale / expired / foreign tokens get the right verdict and change nothing;
 6. completing everything and letting pools idle out brings every counter back to zero, and no
    action stays queued with workers everywhere;
 7. every action ends exactly once (or is queued / backing off); UNSCHEDULABLE only hits what
    can never fit, and what can never fit fails once examined;
plus STRICT_FIFO holds (a blocked head's clusters stay closed to what comes after it), warm
pools (footprint counted once, actions on the pool's cluster, within its slots, freed after
idle_ttl) and finalize leases first, on a worker of their cluster.

Focused properties follow the machine: gangs under STRICT_FIFO / GREEDY_CAPACITY,
UNSCHEDULABLE exactly when it can never fit, the blocked STRICT head and action_concurrency,
late draining of the dispatch channel, and batch vs one-by-one enqueue validation.
"""

import copy
import os
from collections import deque
from dataclasses import asdict, replace

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import Phase as HPhase
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from engine import (
    ActionId,
    ActionSpec,
    AlreadyExists,
    Engine,
    ManualClock,
    NotFound,
    Phase,
    PodGroup,
    ResourceExhausted,
    RetryPolicy,
    ReusePolicy,
    SpecError,
    WaitCode,
    parse_config,
)
from engine._codes import RESOURCE_WAITS, TERMINAL_PHASES, LeaseKind, RowState, Verdict
from engine._records import action_columns, finalize_columns
from storage import MemoryStore, StoreError

GI = 2**30
RES = ("cpu", "memory", "gpu:H100")
UNLIMITED = 1 << 62
PRIORITIES = {"MIN": 0, "MEDIUM": 500, "MAX": 1000}
STRICT, GREEDY = "STRICT_FIFO", "GREEDY_CAPACITY"
N_RUNS = 4
WORKERS_PER_CLUSTER = 6  # 3-4 clusters x 6 ids (and reconnects) > 16 rows: the table grows
SECRET = bytes(range(16))
LIVE = ("sent", "running")
ACTION_COLUMNS = action_columns(0, 1)


def vec(cpu_m=0, mem_gi=0, gpu=0):
    return np.array([cpu_m, mem_gi * GI, gpu], dtype=np.int64)


# ------------------------------------------------------------------------------- strategies


@st.composite
def res_spec(draw, max_cpu=4000, max_mem=16, max_gpu=4):
    """A Flyte-style resources table and the int64 vector it must compile to."""
    cpu = draw(st.sampled_from([m for m in (0, 500, 1000, 1500, 2000, 3000, 4000, 6000)
                                if m <= max_cpu]))
    mem = draw(st.integers(0, max_mem))
    gpu = draw(st.integers(0, max_gpu))
    table = {}
    if cpu or draw(st.booleans()):
        table["cpu"] = cpu // 1000 if cpu % 1000 == 0 else f"{cpu}m"
    if mem or draw(st.booleans()):
        table["memory"] = f"{mem}Gi"
    if gpu or draw(st.booleans()):
        form = draw(st.integers(0, 2))
        if form == 0:
            table["gpu:H100"] = gpu
        elif form == 1:
            table["gpu"] = f"H100:{gpu}"
        else:
            table["gpu"] = gpu
    return table, vec(cpu, mem, gpu)


@st.composite
def configs(draw):
    """A small config dict: 2 known clusters, maybe a third (known or unknown), 2-3 queues."""
    clusters = {
        "east": {
            "capacity": {"cpu": draw(st.integers(4, 16)),
                         "memory": f"{draw(st.integers(8, 64))}Gi",
                         "gpu:H100": draw(st.integers(0, 8))},
            "node_shapes": [
                {"name": "big", "count": draw(st.integers(1, 3)),
                 "allocatable": {"cpu": draw(st.integers(4, 8)),
                                 "memory": f"{draw(st.integers(16, 32))}Gi",
                                 "gpu:H100": draw(st.integers(0, 4))}},
                {"name": "small", "count": 2,
                 "allocatable": {"cpu": draw(st.integers(2, 4)), "memory": "8Gi"}},
            ],
        },
        "west": {
            "node_shapes": [
                {"count": draw(st.integers(1, 3)),
                 "allocatable": {"cpu": draw(st.integers(2, 8)),
                                 "memory": f"{draw(st.integers(8, 32))}Gi",
                                 "gpu:H100": draw(st.integers(0, 8))}},
            ],
        },
    }
    third = draw(st.sampled_from([None, "pool", "burst"]))
    if third == "pool":
        clusters["pool"] = {"capacity": {"cpu": draw(st.integers(4, 24)),
                                         "memory": f"{draw(st.integers(8, 64))}Gi"}}
    elif third == "burst":
        clusters["burst"] = {}  # unknown capacity: unlimited
    names = list(clusters)
    queues = {}
    for i in range(draw(st.integers(2, 3))):
        q = {
            "priority": draw(st.sampled_from([0, 500, 700, 1000, "MIN", "MAX", "MEDIUM"])),
            "scheduling": draw(st.sampled_from([STRICT, GREEDY])),
            "action_concurrency": draw(st.integers(0, 4)),
            "run_concurrency": draw(st.integers(0, 3)),
            "depth": draw(st.integers(2, 12)),
        }
        subset = draw(st.lists(st.sampled_from(names), min_size=1, unique=True))
        q["clusters"] = ["*"] if draw(st.booleans()) else subset
        if draw(st.booleans()):
            mr = {}
            if draw(st.booleans()):
                mr["cpu"] = draw(st.integers(2, 16))
            if draw(st.booleans()):
                mr["memory"] = f"{draw(st.integers(4, 64))}Gi"
            q["max_resources"] = mr
        if draw(st.booleans()):
            q["max_accelerators"] = {"gpu:H100": draw(st.integers(0, 6))}
        queues[f"q{i}"] = q
    eng = {
        "resource_gate": draw(st.sampled_from(["enforce"] * 5 + ["off"])),
        "max_candidates": draw(st.sampled_from([2, 3, 4096])),
        "dispatch_capacity": draw(st.sampled_from([2, 3, 65536])),
        "initial_capacity": 16,
        "heartbeat_interval": draw(st.sampled_from([5.0, 10.0, 20.0])),
        "expiry_missed_beats": draw(st.integers(1, 3)),
        "expiry_jitter": draw(st.sampled_from([0.0, 2.0])),
        "system_retries": draw(st.integers(0, 2)),
        "finalize_timeout": draw(st.sampled_from([60.0, 600.0])),
        # A small horizon: explain's projection stops before most of the queued actions.
        "eta_horizon": draw(st.sampled_from([1, 2, 10_000])),
    }
    if draw(st.booleans()):
        eng["default_queue"] = "q0"
    return {"resources": list(RES), "clusters": clusters, "queues": queues, "engine": eng}


QUEUE_CHANGES = st.fixed_dictionaries({}, optional={
    "action_concurrency": st.integers(0, 4),
    "run_concurrency": st.integers(0, 3),
    "priority": st.sampled_from([0, 300, 500, 1000, "MAX"]),
    "scheduling": st.sampled_from([STRICT, GREEDY]),
    "depth": st.integers(1, 12),
    "max_resources": st.fixed_dictionaries({}, optional={
        "cpu": st.integers(0, 16), "memory": st.integers(0, 64).map(lambda g: f"{g}Gi")}),
    "max_accelerators": st.fixed_dictionaries({}, optional={"gpu:H100": st.integers(0, 6)}),
    "clusters": st.integers(1, 15),  # a bitmask over the configured clusters
})

RETRIES = st.sampled_from([None, RetryPolicy(count=1, backoff_base=1.0),
                           RetryPolicy(count=2, backoff_base=0.5, backoff_factor=3.0)])


# ------------------------------------------------------------------------------- the model


class MQueue:
    """What the model knows of one queue's policy."""

    def __init__(self, name, table, cluster_names):
        self.name = name
        self.priority = 500
        self.strict = True
        self.action_cap = 0
        self.run_cap = 0
        self.depth = 10000
        self.max = np.full(len(RES), UNLIMITED, dtype=np.int64)
        self.clusters = tuple(cluster_names)
        self.apply(table, cluster_names)

    def apply(self, t, cluster_names):
        if "priority" in t:
            p = t["priority"]
            self.priority = PRIORITIES[p] if isinstance(p, str) else p
        if "scheduling" in t:
            self.strict = t["scheduling"] == STRICT
        self.action_cap = t.get("action_concurrency", self.action_cap)
        self.run_cap = t.get("run_concurrency", self.run_cap)
        self.depth = t.get("depth", self.depth)
        if "clusters" in t:
            c = t["clusters"]
            self.clusters = tuple(cluster_names) if c == ["*"] else tuple(c)
        if "max_resources" in t:
            mr = t["max_resources"]
            self.max[0] = mr["cpu"] * 1000 if "cpu" in mr else UNLIMITED
            self.max[1] = int(mr["memory"][:-2]) * GI if "memory" in mr else UNLIMITED
        if "max_accelerators" in t:
            self.max[2] = t["max_accelerators"].get("gpu:H100", UNLIMITED)


class MAction:
    """What the model knows of one action and of its run lease's current generation."""

    def __init__(self, aid, spec, row, queue, run, env, demand, pods):
        self.aid, self.spec, self.row = aid, spec, row
        self.queue, self.run, self.env = queue, run, env
        self.demand, self.pods = demand, pods  # total vector; list of per-pod vectors
        self.children = []
        self.status = "queued"  # queued | sent | running | backoff | done
        self.attempt = 1
        self.user_retries = self.system_retries = 0
        self.ready_ns = 0
        self.retry_seq = 0
        self.gen_attempt = {}  # generation -> the attempt it was assigned for
        self.link_seq = 0  # when it (re)joined the tail of its lane
        self.enq_seq = 0  # when it was first enqueued (its lane position after a reload)
        self.gen = 0
        self.end = None  # how the current generation ended: completed | expired | aborted
        self.expiry = 0
        self.cluster = self.worker = None  # cluster name, worker row
        self.mode = None  # regular | pool | fast
        self.drained = False
        self.token = None
        self.tokens = []  # (generation, token) of every run lease drained for it
        self.phase = None
        self.unschedulable = False


class MFinalize:
    """A finalize lease (cleanup of one attempt), sticky to the cluster that ran it."""

    def __init__(self, f, aid, attempt, cluster, pref, give_up):
        self.f, self.aid, self.attempt = f, aid, attempt
        self.cluster, self.pref, self.give_up = cluster, pref, give_up
        self.status = "pending"  # pending | sent | done
        self.gen = 0
        self.end = None
        self.worker = None
        self.expiry = 0
        self.drained = False
        self.token = None


class MPool:
    def __init__(self, footprint, slots, ttl_ns):
        self.footprint, self.slots, self.ttl_ns = footprint, slots, ttl_ns
        self.cluster = None
        self.inflight = 0
        self.last_active = 0


def _snapshot(eng):
    ins = eng.inspect()
    arrays = ins.arrays.copy()
    scalars = (ins.tick_no, ins.dispatch_head, ins.dispatch_tail, ins.action_rows,
               ins.worker_sessions, ins.env_rows, ins.finalize_rows, tuple(ins.timers()))
    recs = {}
    scalars += (tuple(ins.free_rows.tolist()),)
    for row in range(ins.action_rows):
        if ins.arrays.a_state[row] == RowState.FREE:
            continue
        r = ins.record(row)
        recs[r.action] = (r.phase, r.message, len(r.attempts), r.user_retries,
                          r.system_retries)
    return arrays, scalars, recs


def _assert_unchanged(before, after, what):
    a0, s0, r0 = before
    a1, s1, r1 = after
    assert s0 == s1, f"{what} changed the engine's counters: {s0} -> {s1}"
    assert r0 == r1, f"{what} changed an action record"
    assert a0.keys() == a1.keys()
    for k in a0:
        assert np.array_equal(a0[k], a1[k]), f"{what} changed state array {k}"


def _assert_same_memory(want, got):
    """``got`` holds what ``want`` (a fresh reload of the same store) holds: every array,
    the dispatch channel, the timers, the free rows, abort records and the Python edges."""
    iw, ig = want.inspect(), got.inspect()
    aw, ag = iw.arrays.copy(), ig.arrays.copy()
    assert aw.keys() == ag.keys()
    diff = [k for k in aw if not np.array_equal(aw[k], ag[k])]
    assert not diff, f"memory after a failed commit differs from a reload in {diff}"
    for what in ("action_rows", "finalize_rows", "worker_sessions", "env_rows",
                 "dispatch_head", "dispatch_tail"):
        assert getattr(iw, what) == getattr(ig, what), what
    assert iw.free_rows.tolist() == ig.free_rows.tolist()
    assert iw.dispatch() == ig.dispatch()
    assert iw.timers() == ig.timers()
    assert {k: v.tolist() for k, v in iw.abort_rows().items()} == {
        k: v.tolist() for k, v in ig.abort_rows().items()}
    assert iw.worker_sessions_by_id() == ig.worker_sessions_by_id()
    assert iw.runs() == ig.runs() and iw.qruns() == ig.qruns()


class EngineMachine(RuleBasedStateMachine):
    """Random interleavings of the engine's public operations, checked after every step."""

    def __init__(self):
        super().__init__()
        self.eng = None
        self.healthy = True

    # --------------------------------------------------------------- set-up

    @initialize(
        cfg=configs(),
        runs=st.lists(st.sampled_from([0, 0, 2, 3]), min_size=N_RUNS, max_size=N_RUNS),
        envs=st.lists(
            st.tuples(res_spec(max_cpu=2000, max_mem=8, max_gpu=2),
                      st.integers(1, 2), st.integers(1, 3), st.sampled_from([1.0, 5.0, 30.0])),
            min_size=2, max_size=2),
        slots=st.lists(st.integers(1, 3), min_size=4, max_size=4),
    )
    def setup(self, cfg, runs, envs, slots):
        self.cfg_dict = cfg
        self.clock = ManualClock(1_000_000_000)
        self.eng = Engine(parse_config(cfg), clock=self.clock, store=MemoryStore(), secret=SECRET)
        self.ins = self.eng.inspect()
        e = cfg["engine"]
        # The expiry sweep: the first tick runs it, then the first tick at least
        # heartbeat_interval / 4 after the last sweep (the model keeps its own schedule).
        self.sweep_period_ns = int(e["heartbeat_interval"] * 1e9 / 4)
        self.next_sweep_ns = 0
        self.gate = e["resource_gate"] == "enforce"
        self.dispatch_cap = e["dispatch_capacity"]
        self.ttl_ns = int((e["heartbeat_interval"] * e["expiry_missed_beats"]
                           + e["expiry_jitter"]) * 1e9)
        self.system_retries = e["system_retries"]
        self.finalize_timeout_ns = int(e["finalize_timeout"] * 1e9)
        self.cluster_names = list(cfg["clusters"])
        self.cap = {}
        self.shapes = {}
        for name, c in cfg["clusters"].items():
            shapes = [self._vec(s["allocatable"]) for s in c.get("node_shapes", [])]
            counts = [s["count"] for s in c.get("node_shapes", [])]
            self.shapes[name] = shapes or None
            if "capacity" in c:
                self.cap[name] = self._vec(c["capacity"])
            elif shapes:
                self.cap[name] = sum(n * s for n, s in zip(counts, shapes, strict=True))
            else:
                self.cap[name] = None  # unknown: unlimited, excluded from over-commit checks
        self.queues = {n: MQueue(n, t, self.cluster_names) for n, t in cfg["queues"].items()}
        self.default_queue = e.get("default_queue", "default")
        if self.default_queue not in self.queues:
            self.queues["default"] = MQueue("default", {}, self.cluster_names)
        self.queue_names = list(self.queues)
        self.run_mac = runs
        self.live_runs, self.retired_runs = set(), set()   # run keys, as the engine has them
        self.envs = []  # (name, resources table, pod vector, ReusePolicy)
        for i, ((table, pod), replicas, conc, ttl) in enumerate(envs):
            self.envs.append((f"env{i}", table, pod, ReusePolicy(replicas, conc, ttl)))
        self.actions = {}  # ActionId -> MAction
        self.by_row = {}
        self.finals = []  # finalize row -> MFinalize (its current lease, or a freed one)
        self.pools = {}  # (queue, env name) -> MPool
        self.workers = {}  # worker id -> current session row
        self.idents = []  # worker ids by durable identity (first registration order)
        self.adoptable = set()  # identity rows restored by a reload, worker not back yet
        self.rows = []  # worker session row -> [id, cluster, slots, connected]
        self.undrained = deque()  # dispatched, not drained: (kind, key, gen, cluster, row)
        self.adm = {c: vec() for c in self.cluster_names}  # cumulative charges per cluster
        self.obs = {}  # cluster -> (reported free vector, -1 = not given; adm at report)
        self.n = 0
        self.seq = 0
        for cluster, n in zip(self.cluster_names, slots, strict=False):
            self._register(f"{cluster}-w0", cluster, n)

    @staticmethod
    def _vec(table):
        cpu = table.get("cpu", 0)
        mem = table.get("memory", "0Gi")
        return vec(int(cpu) * 1000, int(mem[:-2]), table.get("gpu:H100", 0))

    # --------------------------------------------------------------- helpers

    def _register(self, wid, cluster, slots, call=True):
        if call:    # (else the engine registered it: the restore after a failed commit)
            self.eng.register_worker(wid, cluster, slots)
        old = self.workers.get(wid)
        new = len(self.rows)
        if wid not in self.idents:
            self.idents.append(wid)
        if old is not None and self._row_load(old) == 0:
            # Its last session holds nothing: the new session takes its row.
            event("an idle session's row reused")
            self.adoptable.discard(old)
            self.rows[old] = [wid, cluster, slots, True]
            assert self.ins.worker_sessions_by_id()[wid] == old
            return
        if old is not None and old in self.adoptable:
            # Back after a reload: the new session adopts what its identity held.
            event("restored leases adopted")
            self.adoptable.discard(old)
            for a in self._live(False):
                if a.worker == old:
                    a.worker = new
            for f in self.finals:
                f.worker = new if f.worker == old else f.worker
                f.pref = new if f.pref == old else f.pref
        elif old is not None:
            # A reconnect is a new session: the old one is gone, its leases expire now.
            self.rows[old][3] = False
            now = self.clock.now_ns()
            for a in sorted(self._live(False), key=lambda a: a.row):
                if a.worker == old:
                    self._expire(a, now)
            for f in self._finals_live():
                if f.worker == old:
                    f.status, f.end = "pending", "expired"
        self.workers[wid] = len(self.rows)
        self.rows.append([wid, cluster, slots, True])
        assert self.ins.worker_sessions_by_id()[wid] == self.workers[wid]

    def _connected(self):
        return sorted(w for w, row in self.workers.items() if self.rows[row][3])

    def _qname(self, qi):
        return None if qi is None else self.queue_names[qi % len(self.queue_names)]

    def _new_spec(self, run, qi, kind, res=None, pods=None, env=None, retries=None,
                  parent=None):
        self.n += 1
        rid = f"t/p/d/r{run}/a{self.n}"
        common = dict(id=rid, task="t", run_queue=self._qname(qi),
                      run_max_action_concurrency=self.run_mac[run])
        if retries is not None:
            common["retries"] = retries
        if parent is not None:
            common["parent"] = str(parent)
        if kind == "single":
            table, v = res
            return ActionSpec(resources=table, **common), v, [v], None
        if kind == "gang":
            groups, total, pod_vecs = [], vec(), []
            for j, ((table, v), replicas) in enumerate(pods):
                groups.append(PodGroup(f"role{j}", replicas, table))
                total = total + v * replicas
                pod_vecs.append(v)
            return ActionSpec(pods=tuple(groups), **common), total, pod_vecs, None
        name, table, pod, reuse = self.envs[env % len(self.envs)]
        spec = ActionSpec(resources=table, environment=name, reuse=reuse, **common)
        return spec, pod * reuse.replicas, [pod], name

    def _record(self, spec, demand, pods, env):
        aid = ActionId.parse(spec.id)
        queue = spec.run_queue or self.default_queue
        row = self.ins.row_of(aid)
        a = MAction(aid, spec, row, queue, int(aid.run[1:]), env, demand, pods)
        # A reclaimed row counts on from its last generation (0 for a new row): an old
        # token of the row is never current again.
        a.gen = int(self.ins.arrays.a_gen[row])
        assert a.gen == int(self.ins.arrays.a_released_gen[row]), "a new action has a lease"
        self.actions[aid] = a
        self.by_row[row] = a
        self.seq += 1
        a.link_seq = a.enq_seq = self.seq
        if spec.parent is not None:
            self.actions[ActionId.parse(spec.parent)].children.append(aid)
        if env is not None and (queue, env) not in self.pools:
            _name, _t, _pod, reuse = next(e for e in self.envs if e[0] == env)
            self.pools[(queue, env)] = MPool(demand, reuse.replicas * reuse.concurrency,
                                             int(reuse.idle_ttl * 1e9))
        return a

    def _queued(self, qname):
        return sum(1 for a in self.actions.values() if a.status == "queued" and a.queue == qname)

    def _fits(self, cluster, a):
        """Could ``a`` ever run on ``cluster`` (total within capacity, each pod on a shape)?"""
        cap = self.cap[cluster]
        if cap is not None and (a.demand > cap).any():
            return False
        shapes = self.shapes[cluster]
        if shapes is None:
            return True
        return all(any((p <= s).all() for s in shapes) for p in a.pods)

    def _never_fits(self, a):
        q = self.queues[a.queue]
        if (a.demand > q.max).any():
            return True
        return not any(self._fits(c, a) for c in q.clusters)

    def _order(self):
        return sorted(range(len(self.queue_names)),
                      key=lambda i: (-self.queues[self.queue_names[i]].priority, i))

    def _live(self, drained_only=True):
        return [a for a in self.actions.values()
                if a.status in LIVE and (a.drained or not drained_only)]

    def _finals_live(self):
        return [f for f in self.finals if f.status == "sent"]

    def _row_load(self, row):
        return (sum(1 for a in self._live(False) if a.worker == row)
                + sum(1 for f in self._finals_live() if f.worker == row))

    def _release(self, a, now):
        """The current generation of ``a`` stops counting (its pool may start idling)."""
        if a.env is not None:
            pool = self.pools[(a.queue, a.env)]
            pool.inflight -= 1
            pool.last_active = now

    def _retry_or_finish(self, a, now, system, phase):
        spec_r = a.spec.retries
        if system:
            retry = self.system_retries > a.system_retries
            a.system_retries += retry
        else:
            retry = a.user_retries < spec_r.count
            a.user_retries += retry
        if not retry:
            a.status, a.phase = "done", phase
            return
        n = a.user_retries + a.system_retries - 1
        delay = min(spec_r.backoff_base * spec_r.backoff_factor ** n, spec_r.backoff_cap)
        a.status, a.ready_ns = "backoff", now + int(delay * 1e9)
        self.seq += 1
        a.retry_seq = self.seq
        event("retry (system)" if system else "retry (user)")
        a.attempt += 1

    def _free_finals(self):
        # Ended finalize leases whose action's row was reclaimed (when an enqueue needed
        # rows): the engine freed their rows with it.
        for f in self.finals:
            if f.status == "done" and self.ins.find(f.aid) is None:
                f.status = "free"

    def _new_finalize(self, a, now):
        # Freed rows first, lowest first; a reused row counts on from its last generation
        # and keeps how its last lease ended until the new one is placed.
        self._free_finals()
        free = [f.f for f in self.finals if f.status == "free"]
        row = min(free) if free else len(self.finals)
        f = MFinalize(row, a.aid, a.attempt, a.cluster, a.worker,
                      now + self.finalize_timeout_ns)
        if free:
            old = self.finals[row]
            f.gen, f.end = old.gen, old.end
            self.finals[row] = f
            event("finalize row reused")
        else:
            self.finals.append(f)

    def _verdict(self, kind, key, gen, presenter, now):
        """What the engine must answer to a token (``presenter``: worker row, -1 = any)."""
        lease = self.actions[key] if kind == LeaseKind.RUN else self.finals[key]
        # A reclaimed row holds a later action: its generations count on from the old one's.
        current = self.by_row.get(lease.row, lease) if kind == LeaseKind.RUN else lease
        if gen < max(lease.gen, current.gen):
            return Verdict.STALE
        if lease.end == "completed":
            return Verdict.COMPLETED
        if lease.end == "aborted":
            return Verdict.ABORTED
        if lease.end == "expired" or lease.expiry < now:
            return Verdict.EXPIRED
        if kind == LeaseKind.FINALIZE and lease.status != "sent":
            return Verdict.EXPIRED
        if presenter >= 0 and lease.worker != presenter:
            same = self.rows[lease.worker][0] == self.rows[presenter][0]
            return Verdict.STALE if same else Verdict.UNKNOWN
        return Verdict.OK

    def _enqueue_expect(self, specs, extras):
        """Enqueue ``specs`` (all new); expect ResourceExhausted iff a queue passes its depth."""
        per_q = {}
        for spec, *_ in specs:
            q = spec.run_queue or self.default_queue
            per_q[q] = per_q.get(q, 0) + 1
        over = any(self._queued(q) + n > self.queues[q].depth for q, n in per_q.items())
        before = _snapshot(self.eng)
        all_specs = [s for s, *_ in specs] + extras
        if over:
            event("depth refused")
            with pytest.raises(ResourceExhausted):
                self.eng.enqueue_many(all_specs)
            _assert_unchanged(before, _snapshot(self.eng), "a refused enqueue")
            self._assert_not_stored([s for s, *_ in specs], "a refused enqueue")
            return
        ids = self.eng.enqueue_many(all_specs)
        assert ids == [ActionId.parse(s.id) for s in all_specs]
        for spec, demand, pods, env in specs:
            a = self._record(spec, demand, pods, env)
            got = self.ins.arrays.a_demand[a.row]
            assert np.array_equal(got, demand), f"{a.aid}: demand {got} != {demand}"

    def _assert_not_stored(self, specs, what):
        """No id of ``specs`` (refused, never enqueued before) can be found."""
        for spec in specs:
            assert self.ins.find(spec.id) is None, f"{what} stored {spec.id}"

    def _pick(self, items, i):
        return items[i % len(items)]

    # --------------------------------------------------------------- enqueue rules

    @rule(run=st.integers(0, N_RUNS - 1), qi=st.none() | st.integers(0, 2), res=res_spec(),
          retries=RETRIES, parent=st.none() | st.integers(0, 10**6))
    def enqueue_single(self, run, qi, res, retries, parent):
        self.healthy = False
        same_run = sorted(a for a in self.actions if a.run == f"r{run}")
        p = self._pick(same_run, parent) if parent is not None and same_run else None
        new = self._new_spec(run, qi, "single", res=res, retries=retries, parent=p)
        if p is not None and self.actions[p].status == "done":
            # An ended parent (aborted or any other end) starts no children, whether or not
            # its row has been reclaimed yet.
            before = _snapshot(self.eng)
            match = "aborted" if self.actions[p].phase == Phase.ABORTED else "has ended"
            with pytest.raises(SpecError, match=match):
                self.eng.enqueue(new[0])
            _assert_unchanged(before, _snapshot(self.eng), "a child of an ended parent")
            self._assert_not_stored([new[0]], "a child of an ended parent")
            return
        self._enqueue_expect([new], [])

    @rule(run=st.integers(0, N_RUNS - 1), qi=st.none() | st.integers(0, 2),
          pods=st.lists(st.tuples(res_spec(max_cpu=3000, max_mem=8, max_gpu=4),
                                  st.integers(1, 3)), min_size=1, max_size=2),
          retries=RETRIES)
    def enqueue_gang(self, run, qi, pods, retries):
        self.healthy = False
        self._enqueue_expect([self._new_spec(run, qi, "gang", pods=pods, retries=retries)], [])

    @rule(run=st.integers(0, N_RUNS - 1), qi=st.none() | st.integers(0, 2),
          env=st.integers(0, 1), retries=RETRIES)
    def enqueue_reusable(self, run, qi, env, retries):
        self.healthy = False
        self._enqueue_expect([self._new_spec(run, qi, "env", env=env, retries=retries)], [])

    @rule(items=st.lists(st.tuples(st.integers(0, N_RUNS - 1), st.none() | st.integers(0, 2),
                                   res_spec(), st.none() | st.integers(0, 1)),
                         min_size=2, max_size=3),
          again=st.none() | st.integers(0, 10**6))
    def enqueue_batch(self, items, again):
        self.healthy = False
        specs = [self._new_spec(run, qi, "single", res=res) if env is None
                 else self._new_spec(run, qi, "env", env=env) for run, qi, res, env in items]
        # Re-sending an existing action with the same spec is a no-op inside a batch.
        extras = []
        if again is not None and self.actions:
            extras.append(self.actions[self._pick(sorted(self.actions), again)].spec)
        self._enqueue_expect(specs, extras)

    @precondition(lambda self: self.eng is not None and self.actions)
    @rule(i=st.integers(0, 10**6), how=st.sampled_from(["spec", "twice", "mac", "parent"]))
    def enqueue_refused(self, i, how):
        """A changed spec for an existing id, one id twice in a batch, a run's
        max_action_concurrency changed, a parent that does not exist: refused, nothing
        stored."""
        self.healthy = False
        keys = sorted(self.actions)
        if how == "mac":
            # A run's cap holds while it has actions in the table; a run whose actions were
            # all reclaimed left memory, and its next action starts it afresh.
            live = self.ins.runs()
            keys = [k for k in keys if self.actions[k].aid.run_key in live]
            if not keys:
                event("cap change of a retired run (not refused)")
                return
        a = self.actions[self._pick(keys, i)]
        before = _snapshot(self.eng)
        fresh = self._new_spec(a.run, None, "single", res=({"cpu": 1}, vec(1000)))[0]
        if how == "spec":
            with pytest.raises(AlreadyExists):
                self.eng.enqueue(replace(a.spec, task=a.spec.task + "-v2"))
        elif how == "twice":
            with pytest.raises(SpecError):
                self.eng.enqueue_many([fresh, fresh])
        elif how == "mac":
            with pytest.raises(SpecError):
                self.eng.enqueue(replace(fresh,
                                         run_max_action_concurrency=self.run_mac[a.run] + 2))
        else:
            with pytest.raises(SpecError):
                self.eng.enqueue(replace(fresh, parent=f"{a.aid.run_key}/nope"))
        _assert_unchanged(before, _snapshot(self.eng), f"a refused enqueue ({how})")
        self._assert_not_stored([fresh], f"a refused enqueue ({how})")

    # --------------------------------------------------------------- workers

    @precondition(lambda self: self.eng is not None)
    @rule(ci=st.integers(0, 3), k=st.integers(0, WORKERS_PER_CLUSTER - 1),
          slots=st.integers(1, 3))
    def register_worker(self, ci, k, slots):
        self.healthy = False
        cluster = self.cluster_names[ci % len(self.cluster_names)]
        wid = f"{cluster}-w{k}"
        self._register(wid, cluster, slots)
        # The same id in another cluster is refused and changes nothing.
        other = self.cluster_names[(ci + 1) % len(self.cluster_names)]
        before = _snapshot(self.eng)
        with pytest.raises(SpecError):
            self.eng.register_worker(wid, other, slots)
        _assert_unchanged(before, _snapshot(self.eng), "a refused worker registration")

    @precondition(lambda self: self.eng is not None and self.workers)
    @rule(i=st.integers(0, 10**6))
    def unregister_worker(self, i):
        self.healthy = False
        wid = self._pick(sorted(self.workers), i)
        row = self.workers[wid]
        held = self.eng.unregister_worker(wid)
        self.rows[row][3] = False
        expect = {a.aid for a in self._live(drained_only=False) if a.worker == row}
        assert set(held) == expect and len(held) == len(expect), (held, expect)

    @precondition(lambda self: self.eng is not None and self.workers)
    @rule(i=st.integers(0, 10**6), extra=st.sampled_from([None, "history", "other"]),
          free=st.none() | st.fixed_dictionaries({}, optional={
              "cpu": st.integers(0, 16), "memory": st.integers(0, 64),
              "gpu:H100": st.integers(0, 8)}))
    def heartbeat(self, i, extra, free):
        """A worker presents the tokens it holds (plus maybe an old or foreign one): each gets
        the verdict the model predicts, valid ones are extended; its free capacity caps the
        gate for its cluster from now on."""
        self.healthy = False
        wid = self._pick(sorted(self.workers), i)
        row = self.workers[wid]
        now = self.clock.now_ns()
        if not self.rows[row][3]:
            before = _snapshot(self.eng)
            with pytest.raises(NotFound):
                self.eng.heartbeat(wid, [])
            _assert_unchanged(before, _snapshot(self.eng), "a disconnected heartbeat")
            return
        toks = [(LeaseKind.RUN, a.aid, a.gen, a.token) for a in self._live()
                if a.worker == row]
        toks += [(LeaseKind.FINALIZE, f.f, f.gen, f.token) for f in self._finals_live()
                 if f.worker == row and f.drained]
        if extra == "history":
            old = [(LeaseKind.RUN, a.aid, g, t) for a in self.actions.values()
                   for g, t in a.tokens]
            if old:
                toks.append(self._pick(old, i // 7))
        elif extra == "other":
            others = [(LeaseKind.RUN, a.aid, a.gen, a.token) for a in self._live()
                      if a.worker != row]
            if others:
                toks.append(self._pick(others, i // 7))
        expect = {}
        for kind, key, gen, token in toks:
            v = self._verdict(kind, key, gen, row, now)
            if v != Verdict.OK:
                expect[token] = v
        free_table = None
        if free is not None:
            free_table = {k: (f"{v}Gi" if k == "memory" else v) for k, v in free.items()}
        refused = self.eng.heartbeat(wid, [t for *_, t in toks], free_table)
        got = {r.token: r.verdict for r in refused}
        for v in got.values():
            event(f"heartbeat refused {v.name}")
        assert got == expect, f"heartbeat verdicts {got} != model {expect}"
        for kind, key, _gen, token in toks:
            if token not in expect:
                lease = self.actions[key] if kind == LeaseKind.RUN else self.finals[key]
                lease.expiry = now + self.ttl_ns
        if free is not None:
            cluster = self.rows[row][1]
            f = np.array([free.get("cpu", -1), free.get("memory", -1), free.get("gpu:H100", -1)],
                         dtype=np.int64)
            f = np.where(f >= 0, f * np.array([1000, GI, 1]), -1)
            prev, prev_mark = self.obs.get(cluster, (np.full(3, -1), vec()))
            mark = np.where(f >= 0, self.adm[cluster], prev_mark)
            self.obs[cluster] = (np.where(f >= 0, f, prev), mark)

    # --------------------------------------------------------------- queues and clock

    @precondition(lambda self: self.eng is not None)
    @rule(qi=st.integers(0, 2), changes=QUEUE_CHANGES)
    def update_queue(self, qi, changes):
        self.healthy = False
        name = self.queue_names[qi % len(self.queue_names)]
        changes = dict(changes)
        if "clusters" in changes:
            mask = changes["clusters"]
            picked = [c for i, c in enumerate(self.cluster_names) if mask >> i & 1]
            changes["clusters"] = picked or ["*"]
        new = self.eng.update_queue(name, **changes)
        q = self.queues[name]
        q.apply(changes, self.cluster_names)
        assert new.action_concurrency == q.action_cap and new.run_concurrency == q.run_cap
        assert new.priority == q.priority and (new.scheduling == STRICT) == q.strict
        assert new.depth == q.depth and new.clusters == q.clusters
        assert np.array_equal(new.max_resources, q.max), (new.max_resources, q.max)

    @precondition(lambda self: self.eng is not None)
    @rule(seconds=st.sampled_from([0.5, 1, 2, 5, 10, 31]))
    def advance_clock(self, seconds):
        self.healthy = False
        self.clock.advance(seconds)

    # --------------------------------------------------------------- tick

    def _expire(self, a, now):
        """The current generation of ``a`` expires: released, cleaned up by a finalize lease
        on its cluster, retried as a system error while the budget allows."""
        event("lease expired")
        a.end = "expired"
        self._release(a, now)
        self._new_finalize(a, now)
        self._retry_or_finish(a, now, system=True, phase=Phase.FAILED)

    def _model_timers_and_sweep(self, now):
        """What ``schedule`` does before the kernel: timers, then (maybe) the expiry sweep."""
        due = [a for a in self.actions.values() if a.status == "backoff" and a.ready_ns <= now]
        for a in sorted(due, key=lambda a: (a.ready_ns, a.retry_seq)):
            a.status = "queued"  # back at the tail of its lane
            self.seq += 1
            a.link_seq = self.seq
        for f in self.finals:
            if f.status in ("pending", "sent") and f.give_up <= now:
                f.status, f.end = "done", "aborted"
        if now < self.next_sweep_ns:
            return
        self.next_sweep_ns = now + self.sweep_period_ns
        for a in sorted(self._live(False), key=lambda a: a.row):
            if a.expiry < now:
                self._expire(a, now)
        for f in self.finals:
            if f.status == "sent" and f.expiry < now:
                f.status, f.end = "pending", "expired"

    def _do_tick(self, drain=None):
        """One tick, checked against the model; returns (run placements, failures, number
        of leases dispatched)."""
        eng, ins = self.eng, self.ins
        s = ins.arrays
        now = self.clock.now_ns()
        ring_full = ins.dispatch_tail - ins.dispatch_head >= self.dispatch_cap
        q_adm0 = s.q_adm.copy()
        q_runs0 = (s.q_runs_adm - s.q_runs_rel).astype(np.int64)
        q_res_adm0 = s.q_res_adm.copy()
        q_head0 = s.q_head.copy()
        q_head_code0 = s.q_head_code.copy()
        self._model_timers_and_sweep(now)
        queued_before = [a for a in self.actions.values() if a.status == "queued"]

        d_tail0 = ins.dispatch_tail
        if drain is None:
            got = eng.tick()  # schedule and drain everything, as the in-process dispatcher
        else:
            eng.schedule()
            got = None
        d_head, d_tail = ins.dispatch_head, ins.dispatch_tail
        placed = d_tail - d_tail0
        tick_no = ins.tick_no
        cap = ins.dispatch_capacity
        assert cap == s.d_action.shape[0]
        assert 0 <= d_tail - d_head <= cap, "dispatch ring over its capacity"
        entries = []
        for j in range(d_tail - placed, d_tail):
            slot = j % cap
            entries.append((LeaseKind(int(s.d_kind[slot])), int(s.d_action[slot]),
                            int(s.d_gen[slot]), int(s.d_cluster[slot]), int(s.d_worker[slot])))
        if ring_full:
            event("ring full")
            assert placed == 0, "a tick placed work with a full dispatch channel"
        kinds = [e[0] for e in entries]
        assert kinds == sorted(kinds, reverse=True), f"finalize leases go first: {kinds}"

        # Idle pools past their ttl give their footprint back first thing in the tick.
        for pool in self.pools.values():
            if (pool.cluster is not None and pool.inflight == 0
                    and now - pool.last_active >= pool.ttl_ns):
                pool.cluster = None
                event("pool reaped")
        assigned_q, assigned_run, assigned_w = set(), set(), set()
        charged_q, charged_c = set(), set()
        placements = []
        for kind, row, gen, ci, wi in entries:
            cluster = self.cluster_names[ci]
            w = self.rows[wi]
            assert w[1] == cluster and w[3], f"lease placed on worker row {wi} {w} of {cluster}"
            assigned_w.add(wi)
            if kind == LeaseKind.FINALIZE:
                f = self.finals[row]
                assert f.status == "pending" and gen > f.gen, (f.__dict__, gen)
                assert cluster == f.cluster, f"finalize of {f.aid} on {cluster}, not {f.cluster}"
                f.status, f.gen, f.end, f.worker = "sent", gen, None, wi
                event("finalize placed")
                f.expiry, f.drained = now + self.ttl_ns, False
                self.undrained.append((kind, row, gen, cluster, wi))
                continue
            a = self.by_row[row]
            q = self.queues[a.queue]
            # 5. one live holder: only a queued action is assigned, with a newer generation.
            assert a.status == "queued", f"{a.aid} assigned while {a.status}"
            assert gen > a.gen, f"{a.aid}: generation {gen} not above {a.gen}"
            assert cluster in q.clusters, f"{a.aid} placed on {cluster}, not in {q.clusters}"
            mode = "regular"
            if a.env is not None:
                pool = self.pools[(a.queue, a.env)]
                if pool.cluster is None:
                    mode = "pool"
                    pool.cluster = cluster
                else:
                    mode = "fast"
                    assert cluster == pool.cluster, f"{a.aid}: pool is on {pool.cluster}"
                pool.inflight += 1
                pool.last_active = now
                assert pool.inflight <= pool.slots, f"{a.aid}: pool over its slots"
            assert bool(s.a_charged[row]) == (mode == "regular"), (a.aid, mode)
            if self.gate and mode != "fast":
                assert self._fits(cluster, a), f"{a.aid} placed on {cluster} where it never fits"
                assert not (a.demand > q.max).any(), f"{a.aid} above the queue's hard max"
            if mode != "fast":
                charged_q.add(a.queue)
                charged_c.add(cluster)
                self.adm[cluster] = self.adm[cluster] + a.demand
            a.status, a.gen, a.cluster, a.worker, a.mode = "sent", gen, cluster, wi, mode
            event(f"placed {mode}" + (" (retry)" if gen > 1 else ""))
            a.end, a.expiry, a.drained = None, now + self.ttl_ns, False
            a.gen_attempt[gen] = a.attempt
            self.undrained.append((kind, a.aid, gen, cluster, wi))
            assigned_q.add(a.queue)
            assigned_run.add(a.run)
            placements.append(a)

        # 3. a worker never holds more leases than its slots at assignment.
        for wi in assigned_w:
            load = int(s.w_adm[wi] - s.w_rel[wi])
            assert load == self._row_load(wi) <= self.rows[wi][2], (
                f"worker row {wi} {self.rows[wi]}: {load} leases")
        # 1. the gate never admits past what a worker last reported free.
        if self.gate:
            for c in charged_c:
                if c in self.obs:
                    free, mark = self.obs[c]
                    since = self.adm[c] - mark
                    assert ((free < 0) | (since <= free)).all(), (
                        f"{c}: admitted {since} since a report of {free} free")
        # 2. admission never passes a queue cap or budget, nor a run cap.
        metrics = eng.queue_metrics()
        for qi, qname in enumerate(self.queue_names):
            q, m = self.queues[qname], metrics[qname]
            if qname in assigned_q and q.action_cap > 0:
                assert m["actions_in_flight"] <= q.action_cap, (qname, m, q.action_cap)
            if q.run_cap > 0 and m["runs_in_flight"] > q_runs0[qi]:
                assert m["runs_in_flight"] <= q.run_cap, (qname, m, q.run_cap)
            if self.gate and (qname in charged_q
                              or (s.q_res_adm[qi] != q_res_adm0[qi]).any()):
                used = np.array([m["in_flight_resources"][r] for r in RES])
                assert (used <= q.max).all(), f"{qname}: {used} in flight, max {q.max}"
            if s.q_adm[qi] == q_adm0[qi]:
                assert qname not in assigned_q
        for u in assigned_run:
            if self.run_mac[u]:
                live = sum(1 for a in self._live(False) if a.run == u)
                assert live <= self.run_mac[u], f"run r{u}: {live} in flight"

        # 7. UNSCHEDULABLE only for what can never fit; what can never fit, once examined,
        # either fails or waits on a count cap.
        failures = []
        for a in queued_before:
            state = s.a_state[a.row]
            if a.status == "sent":
                continue
            if state == RowState.DONE:
                exp = eng.explain(a.aid)
                assert exp.phase == Phase.FAILED and exp.reason.startswith("UNSCHEDULABLE"), exp
                assert self.gate, f"{a.aid} failed UNSCHEDULABLE with the gate off"
                assert self._never_fits(a), f"{a.aid} failed UNSCHEDULABLE but fits: {exp}"
                a.status, a.phase, a.unschedulable = "done", Phase.FAILED, True
                event("unschedulable")
                failures.append(a)
                continue
            assert state == RowState.QUEUED, f"{a.aid}: row state {RowState(state).name}"
            if (self.gate and int(s.a_wait_tick[a.row]) == tick_no and self._never_fits(a)
                    and not (a.env is not None
                             and self.pools[(a.queue, a.env)].cluster is not None)):
                code = WaitCode(int(s.a_wait_code[a.row]))
                assert code in (WaitCode.QUEUE_RUNS, WaitCode.RUN_ACTIONS,
                                WaitCode.DISPATCH_FULL), (
                    f"{a.aid} can never fit but waits with {code.name}")

        # STRICT_FIFO: a head that does not fit holds the clusters it could use against
        # everything after it in the tick: the rest of its queue when it went first (the
        # head blocked in an earlier tick), later actions of its lane, lower-priority queues.
        if self.gate:
            pos = {self.queue_names[i]: p for p, i in enumerate(self._order())}
            for x in queued_before:
                if x.status != "queued" or int(s.a_wait_tick[x.row]) != tick_no:
                    continue
                qx = self.queue_names.index(x.queue)
                if not self.queues[x.queue].strict:
                    continue
                code = WaitCode(int(s.a_wait_code[x.row]))
                if code not in (WaitCode.CLUSTER_CAPACITY, WaitCode.HEAD_OF_LINE):
                    continue
                def retried(qi, row):
                    # The engine retries a STRICT queue's blocked head before its whole
                    # priority level, unless it only waited behind another head's hold.
                    return (int(q_head0[qi]) == row
                            and int(q_head_code0[qi]) != WaitCode.HEAD_OF_LINE)

                went_first = retried(qx, x.row)
                event(f"strict head blocked {code.name}" + (" (first)" if went_first else ""))
                held = {c for c in self.queues[x.queue].clusters if self._fits(c, x)}
                for p in placements:
                    if p.mode == "fast" or p.cluster not in held:
                        continue
                    qp = self.queue_names.index(p.queue)
                    if (retried(qp, p.row) and self.queues[p.queue].strict
                            and self.queues[p.queue].priority == self.queues[x.queue].priority
                            and not went_first):
                        # p was its queue's blocked head, retried at the start of the level,
                        # before x (not itself retried) was examined and held anything.
                        continue
                    later = (pos[p.queue] > pos[x.queue]
                             or (p.queue == x.queue and went_first)
                             or (p.queue == x.queue and p.link_seq > x.link_seq
                                 and s.a_lane[p.row] == s.a_lane[x.row]))
                    assert not later, (
                        f"{p.aid} ({p.queue}) took {p.cluster} held by blocked head "
                        f"{x.aid} ({x.queue}, {code.name}, first={went_first})")

        self._drain(drain, got)
        return placements, failures, len(entries)

    def _drain(self, limit, got=None):
        """Check what the dispatch channel hands out: its oldest ``limit`` entries, except
        those whose lease ended (expired, aborted) before they were drained: never sent."""
        if got is None:
            got = self.eng.drain_dispatch(limit)
        n = len(self.undrained) if limit is None else min(limit, len(self.undrained))
        delivered = []
        for _ in range(n):
            kind, key, gen, cluster, wi = self.undrained.popleft()
            lease = self.finals[key] if kind == LeaseKind.FINALIZE else self.actions[key]
            status = ("sent",) if kind == LeaseKind.FINALIZE else LIVE
            if lease.gen == gen and lease.status in status and lease.end is None:
                delivered.append((kind, key, gen, cluster, wi))
            else:
                event("dispatch entry dropped")
        assert len(got) == len(delivered), (got, delivered)
        for asg, (kind, key, gen, cluster, wi) in zip(got, delivered, strict=True):
            assert (asg.kind, asg.generation, asg.cluster, asg.worker) == (
                kind, gen, cluster, self.rows[wi][0]), (asg, kind, key, gen)
            if kind == LeaseKind.FINALIZE:
                f = self.finals[key]
                assert asg.action == f.aid and asg.attempt == f.attempt, (asg, f.__dict__)
                f.token, f.drained = asg.token, True
                continue
            a = self.actions[key]
            assert asg.action == a.aid and asg.queue == a.queue, asg
            assert asg.attempt == a.gen_attempt[gen] == a.attempt, (
                f"{a.aid}: generation {gen} of attempt {a.gen_attempt[gen]} dispatched as "
                f"attempt {asg.attempt}")
            a.tokens.append((gen, asg.token))
            a.token, a.drained = asg.token, True

    @precondition(lambda self: self.eng is not None)
    @rule()
    def tick(self):
        self.healthy = False
        self._do_tick()

    @precondition(lambda self: self.eng is not None)
    @rule(limit=st.integers(0, 2))
    def tick_partial_drain(self, limit):
        self.healthy = False
        self._do_tick(drain=limit)

    @precondition(lambda self: self.eng is not None)
    @rule(seconds=st.sampled_from([0, 0.5, 1, 3]),
          fates=st.lists(st.sampled_from(["keep", "running", "ok", "fail"]), max_size=6))
    def cycle(self, seconds, fates):
        """A busy loop turn: time passes, workers heartbeat what they hold, a tick, then
        workers report on some of their leases (and finish every cleanup)."""
        self.healthy = False
        self.clock.advance(seconds)
        self._beat_all(report_free=False)
        self._do_tick()
        # A lease past its expiry but not yet swept is refused EXPIRED (the mark_running and
        # complete rules check that case); the busy loop only reports on unexpired ones.
        now = self.clock.now_ns()
        for a, fate in zip([a for a in self._live() if a.expiry >= now], fates, strict=False):
            if fate == "running":
                self.eng.mark_running(a.aid, a.gen)
                a.status = "running"
            elif fate != "keep":
                self._complete(a, Phase.SUCCEEDED if fate == "ok" else Phase.FAILED)
        for f in self._finals_live():
            if f.drained and f.expiry >= now:
                assert self.eng.report(f.token, Phase.SUCCEEDED) == Verdict.OK
                f.status, f.end = "done", "completed"

    # --------------------------------------------------------------- reports

    @precondition(lambda self: self.eng is not None and self._live())
    @rule(i=st.integers(0, 10**6))
    def mark_running(self, i):
        self.healthy = False
        a = self._pick(self._live(), i)
        if a.expiry < self.clock.now_ns():
            before = _snapshot(self.eng)
            with pytest.raises(SpecError, match="EXPIRED"):
                self.eng.mark_running(a.aid, a.gen)
            _assert_unchanged(before, _snapshot(self.eng), "a report on an expired lease")
            return
        self.eng.mark_running(a.aid, a.gen)
        a.status = "running"

    @precondition(lambda self: self.eng is not None and self._live())
    @rule(i=st.integers(0, 10**6), phase=st.sampled_from([Phase.SUCCEEDED, Phase.FAILED]))
    def complete(self, i, phase):
        self.healthy = False
        a = self._pick(self._live(), i)
        if a.expiry < self.clock.now_ns():
            before = _snapshot(self.eng)
            with pytest.raises(SpecError, match="EXPIRED"):
                self.eng.complete(a.aid, a.gen, phase)
            _assert_unchanged(before, _snapshot(self.eng), "a report on an expired lease")
            return
        self._complete(a, phase)

    def _complete(self, a, phase):
        now = self.clock.now_ns()
        self.eng.complete(a.aid, a.gen, phase)
        a.end = "completed"
        self._release(a, now)
        if phase == Phase.SUCCEEDED:
            a.status, a.phase = "done", phase
        else:
            self._retry_or_finish(a, now, system=False, phase=phase)

    @precondition(lambda self: self.eng is not None and self.actions)
    @rule(i=st.integers(0, 10**6), delta=st.sampled_from([-1, 1, 2]),
          how=st.sampled_from(["complete", "running", "phase"]))
    def report_stale(self, i, delta, how):
        """A report with a generation that is not the current holder's (or a non-terminal
        phase) is refused with SpecError and changes nothing."""
        self.healthy = False
        a = self.actions[self._pick(sorted(self.actions), i)]
        live = a.status in LIVE
        gen = a.gen + delta if live else a.gen + max(delta, 0)
        if how == "phase" and live:
            gen, phase = a.gen, Phase.RUNNING  # current holder, but not a terminal phase
        else:
            phase = Phase.SUCCEEDED
        before = _snapshot(self.eng)
        with pytest.raises(SpecError):
            if how == "running":
                self.eng.mark_running(a.aid, gen)
            else:
                self.eng.complete(a.aid, gen, phase)
        _assert_unchanged(before, _snapshot(self.eng), f"a refused report ({how}, gen {gen})")

    @precondition(lambda self: self.eng is not None and any(
        f.drained for f in self.finals if f.status == "sent"))
    @rule(i=st.integers(0, 10**6), phase=st.sampled_from([Phase.SUCCEEDED, Phase.FAILED]))
    def report_finalize(self, i, phase):
        self.healthy = False
        f = self._pick([f for f in self._finals_live() if f.drained], i)
        now = self.clock.now_ns()
        want = self._verdict(LeaseKind.FINALIZE, f.f, f.gen, -1, now)
        before = _snapshot(self.eng)
        kw = {"error_kind": "USER"} if phase == Phase.FAILED else {}
        got = self.eng.report(f.token, phase, **kw)
        assert got == want, (got, want)
        if got == Verdict.OK:
            f.status, f.end = "done", "completed"
        else:
            _assert_unchanged(before, _snapshot(self.eng), "a refused finalize report")

    @precondition(lambda self: self.eng is not None and self.actions)
    @rule(i=st.integers(0, 10**6))
    def abort(self, i):
        """Abort ends the action and its descendants that have not ended; live leases end
        ABORTED and get a finalize lease on the cluster that ran them."""
        self.healthy = False
        root = self.actions[self._pick(sorted(self.actions), i)]
        now = self.clock.now_ns()
        expect, stack = set(), [root.aid]
        while stack:
            a = self.actions[stack.pop()]
            stack.extend(a.children)
            if a.status == "done":
                continue
            if a.status in LIVE:
                a.end = "aborted"
                self._release(a, now)
                self._new_finalize(a, now)
            a.status, a.phase = "done", Phase.ABORTED
            expect.add(a.aid)
        ended = self.eng.abort(root.aid)
        assert set(ended) == expect and len(ended) == len(expect), (ended, expect)

    # --------------------------------------------------------------- restarts (8)

    @precondition(lambda self: self.eng is not None)
    @rule(crash=st.booleans(), back=st.just(-1) | st.integers(0, 255))
    def restart(self, crash, back):
        """A new Engine on the same store, after a close or as after a crash (no close):
        everything observable is as the engine that committed it left it, up to what
        docs/storage.md ("Semantics a restart changes") lists; the connected workers in
        ``back`` (a bitmask over them in identity order, -1: all) register again and adopt
        their leases, the others stay detached."""
        self.healthy = False
        before = self._observed()
        store = self.eng.store
        if not crash:
            self.eng.close()
        event("restart (crash)" if crash else "restart (close)")
        self.eng = Engine(parse_config(self.cfg_dict), clock=self.clock, secret=SECRET,
                          store=MemoryStore(store.partitions, backing=store.backing))
        self.ins = self.eng.inspect()
        returning = [w for k, w in enumerate(self._connected_by_ident()) if back >> k & 1]
        self._model_reload(returning)
        self._assert_observed(before, self._observed(), crash)
        self._check_tokens()

    @precondition(lambda self: self.eng is not None)
    @rule(op=st.sampled_from(["tick", "tick", "enqueue", "abort", "complete", "update_queue"]),
          i=st.integers(0, 10**6), res=res_spec())
    def failed_commit(self, op, i, res):
        """A transition whose group commit fails raises the store's error and leaves memory
        exactly as a reload of the store (plus the connected workers registered again, in
        identity order) gives it: nothing of the transition, nothing acknowledged lost."""
        self.healthy = False
        eng, store = self.eng, self.eng.store
        now = self.clock.now_ns()
        live = [a for a in self._live() if a.expiry >= now]
        open_ = sorted(a for a, m in self.actions.items() if m.status != "done")
        if op == "abort" and not open_ or op == "complete" and not live:
            op = "update_queue"
        if op == "enqueue":
            spec = self._new_spec(i % N_RUNS, None, "single", res=res)[0]
            q = self.default_queue
            if self._queued(q) + 1 > self.queues[q].depth:
                op = "update_queue"   # refused before any commit
        before = self._observed()
        connected = self._connected_by_ident()
        store.fail_next(StoreError("injected I/O error"))
        try:
            if op == "tick":
                got = eng.tick()
            elif op == "enqueue":
                eng.enqueue(spec)
            elif op == "abort":
                eng.abort(self._pick(open_, i))
            elif op == "complete":
                a = self._pick(live, i)
                eng.complete(a.aid, a.gen, Phase.SUCCEEDED)
            else:
                qname = self._pick(self.queue_names, i)
                eng.update_queue(qname, depth=self.queues[qname].depth)
        except StoreError as exc:
            assert "injected" in str(exc)
        else:
            # Only a tick may write nothing (nothing fired, placed, swept or drained).
            assert op == "tick", f"{op} committed nothing"
            store.clear_failure()
            event("failed commit: the tick wrote nothing")
            assert got == []
            statuses = {k: (a.status, a.end) for k, a in self.actions.items()}
            self._model_timers_and_sweep(now)
            assert statuses == {k: (a.status, a.end) for k, a in self.actions.items()}
            for pool in self.pools.values():
                if (pool.cluster is not None and pool.inflight == 0
                        and now - pool.last_active >= pool.ttl_ns):
                    pool.cluster = None
            return
        event(f"failed commit ({op})")
        self._model_reload(connected, call=False)
        # Memory is what a reload of the store gives (a copy: this engine keeps the store).
        copy_store = MemoryStore(store.partitions, backing=copy.deepcopy(store.backing))
        fresh = Engine(parse_config(self.cfg_dict), clock=self.clock, secret=SECRET,
                       store=copy_store)
        for wid in connected:
            row = self.workers[wid]
            fresh.register_worker(wid, self.rows[row][1], self.rows[row][2])
        _assert_same_memory(fresh, self.eng)
        fresh.close()
        self._assert_observed(before, self._observed(), crash=False, failed=True)
        self._check_tokens()

    def _connected_by_ident(self):
        return [w for w in self.idents if self.rows[self.workers[w]][3]]

    def _model_reload(self, returning, call=True):
        """The model after a reload at the clock's time (docs/storage.md, "Reload" and
        "Semantics a restart changes"), then ``returning`` workers registered again (by
        the model too when ``call``)."""
        now = self.clock.now_ns()
        slots = {w: self.rows[self.workers[w]][2] for w in returning}
        ident = {w: k for k, w in enumerate(self.idents)}
        # One detached session per durable identity (session row = identity).
        remap = {r: ident[w] for r, (w, *_rest) in enumerate(self.rows)}
        self.rows = [[w, self.rows[self.workers[w]][1], 0, False] for w in self.idents]
        self.workers = dict(ident)
        self.adoptable = set(range(len(self.idents)))
        # Every lease in flight gets a fresh window (heartbeat extension is not durable).
        for a in self._live(False):
            a.worker = remap[a.worker]
            a.expiry = now + self.ttl_ns
        for f in self.finals:
            f.worker = remap.get(f.worker, f.worker)
            f.pref = remap.get(f.pref, f.pref)
            if f.status == "sent":
                f.expiry = now + self.ttl_ns
        # Warm pools with no live lease are not restored; live ones are active now.
        for pool in self.pools.values():
            if pool.inflight == 0:
                pool.cluster = None
            elif pool.cluster is not None:
                pool.last_active = now
        # Counters are a recount (admitted = in flight); reported free capacity is
        # forgotten; the first tick sweeps.
        self.adm = self._cluster_charges()
        self.obs = {}
        self.next_sweep_ns = 0
        # Queued actions go back to their lanes in first-enqueue order.
        for a in sorted((a for a in self.actions.values() if a.status == "queued"),
                        key=lambda a: a.enq_seq):
            self.seq += 1
            a.link_seq = self.seq
        # Decided, never handed out: dispatched again (same lease and holder), run leases
        # by row, then finalize leases by row; entries of ended leases are gone.
        self.undrained = deque(
            [(LeaseKind.RUN, a.aid, a.gen, a.cluster, a.worker)
             for a in sorted(self._live(False), key=lambda a: a.row) if not a.drained]
            + [(LeaseKind.FINALIZE, f.f, f.gen, f.cluster, f.worker)
               for f in self.finals if f.status == "sent" and not f.drained])
        if self.undrained:
            event("decisions dispatched again after a reload")
        for w in returning:
            self._register(w, self.rows[self.workers[w]][1], slots[w], call)

    def _cluster_charges(self):
        out = {c: vec() for c in self.cluster_names}
        for a in self._live(False):
            if a.mode == "regular":
                out[a.cluster] = out[a.cluster] + a.demand
        for pool in self.pools.values():
            if pool.cluster is not None:
                out[pool.cluster] = out[pool.cluster] + pool.footprint
        return out

    def _observed(self):
        """What users and workers see: every action's phase (a wait reason is the last
        tick's, memory only: waiting reads as queued) and attempts, the queues' counts and
        settings, runtime histories, worker identities, runs."""
        eng, ins = self.eng, self.ins

        def phase(aid):
            p = eng.phase(aid)
            return Phase.QUEUED if p == Phase.WAITING_FOR_RESOURCES else p
        acts = {aid: (phase(aid), [asdict(t) for t in eng.attempts(aid)])
                for aid in self.actions}
        metrics = {q: (m["actions_in_flight"], m["runs_in_flight"], m["depth"])
                   for q, m in eng.queue_metrics().items()}
        queues = {q: {k: v.tolist() if isinstance(v, np.ndarray) else v
                      for k, v in asdict(ins.queue(q)).items()} for q in self.queue_names}
        history = {t: eng.history.encode(t) for t in ins.tasks() if eng.history.count(t)}
        # The durable columns of every row as memory holds them: a change a turn made in
        # memory but did not write shows here (holders, expiries and lanes are rebuilt).
        arrays, n, n_f = ins.arrays, ins.action_rows, ins.finalize_rows
        cols = {c: getattr(arrays, "a_" + c)[:n].tolist() for c in ACTION_COLUMNS}
        cols.update({"fz_" + c: getattr(arrays, "fz_" + c)[:n_f].tolist()
                     for c in finalize_columns()})
        return (acts, metrics, queues, history, set(ins.worker_sessions_by_id()),
                ins.runs(), cols, ins.free_rows.tolist())

    def _assert_observed(self, before, after, crash, failed=False):
        acts0, metrics0, queues0, hist0, idents0, runs0, cols0, free0 = before
        acts1, metrics1, queues1, hist1, idents1, runs1, cols1, free1 = after
        for c, v0 in cols0.items():
            bad = [r for r, (x, y) in enumerate(zip(v0, cols1[c], strict=True)) if x != y]
            assert not bad, (f"column {c} of rows {bad} differs after a reload: "
                             f"{[v0[r] for r in bad]} -> {[cols1[c][r] for r in bad]}")
        assert free1 == free0
        for aid, (p0, att0) in acts0.items():
            p1, att1 = acts1[aid]
            assert p1 == p0, f"{aid}: phase {p0} became {p1} after a reload"
            assert att1 == att0, f"{aid}: attempts changed by a reload:\n{att0}\n{att1}"
        assert metrics1 == metrics0, (metrics0, metrics1)
        assert queues1 == queues0
        assert idents1 == idents0, (idents0, idents1)
        assert runs1.keys() == runs0.keys(), (runs0, runs1)
        if crash or failed:
            # Runtime samples reach the store within a second of the engine's clock: a crash
            # (or a failed commit's reload) may lose the last second of them
            # (docs/architecture.md, "Runtime history"); a key is never lost.
            assert hist1.keys() <= hist0.keys()
        else:
            assert hist1 == hist0

    def _check_tokens(self):
        """Every token ever handed out gets the verdict the model gives (presented by its
        lease's holder when it is live): one refused stays refused, a live one is valid."""
        now = self.clock.now_ns()
        toks, want, who = [], [], []
        for a in self.actions.values():
            for gen, tok in a.tokens:
                live = a.status in LIVE and gen == a.gen
                session = a.worker if live else 0
                toks.append(tok)
                who.append(session)
                want.append(self._verdict(LeaseKind.RUN, a.aid, gen, session, now))
        for f in self.finals:
            if f.token is not None and f.status != "free":
                session = f.worker if f.status == "sent" else 0
                toks.append(f.token)
                who.append(session)
                want.append(self._verdict(LeaseKind.FINALIZE, f.f, f.gen, session, now))
        for tok, session, w in zip(toks, who, want, strict=True):
            arr = np.frombuffer(tok, dtype="<u8").reshape(1, 3).astype(np.uint64)
            got = np.zeros(1, dtype=np.uint8)
            self.ins.check_tokens(arr, session, got)
            got = Verdict(int(got[0]))
            assert got == w, f"token {tok.hex()}: {got.name}, model {w.name}"

    # --------------------------------------------------------------- drain everything (6)

    @precondition(lambda self: self.eng is not None)
    @rule()
    def drain_all(self):
        """Workers everywhere; heartbeat, tick, complete, let pools idle out, until nothing
        moves: then every action is terminal and every counter is zero."""
        self.healthy = False
        for c in self.cluster_names:
            self._register(f"{c}-drain", c, 64)
        step = max([p.ttl_ns for p in self.pools.values()] + [0]) / 1e9 + 1
        quiet = 0
        for _ in range(400):
            self.clock.advance(step)
            self._beat_all()
            _placements, failures, dispatched = self._do_tick()
            now = self.clock.now_ns()
            live = self._live(False)
            for a in live:
                if a.drained and a.expiry >= now:
                    self._complete(a, Phase.SUCCEEDED)
            for f in self._finals_live():
                if f.drained and f.expiry >= now:
                    assert self.eng.report(f.token, Phase.SUCCEEDED) == Verdict.OK
                    f.status, f.end = "done", "completed"
            self._check()
            pending = any(a.status in ("backoff", *LIVE) for a in self.actions.values())
            pending = pending or any(f.status in ("pending", "sent") for f in self.finals)
            pending = pending or any(p.cluster is not None for p in self.pools.values())
            # Two quiet ticks in a row: the second saw fresh reports of the freed capacity.
            quiet = quiet + 1 if not (dispatched or failures or live or pending) else 0
            if quiet == 2:
                break
        else:
            raise AssertionError("the engine did not quiesce")
        stuck = [(str(a.aid), self.eng.explain(a.aid)) for a in self.actions.values()
                 if a.status == "queued"]
        assert not stuck, f"queued forever with workers everywhere and nothing in flight: {stuck}"
        s = self.ins.arrays
        for qname, m in self.eng.queue_metrics().items():
            assert m["actions_in_flight"] == 0 and m["runs_in_flight"] == 0, (qname, m)
            assert all(v == 0 for v in m["in_flight_resources"].values()), (qname, m)
            assert m["depth"] == 0, (qname, m)
        for c in self.cluster_names:
            assert all(v == 0 for v in self.eng.cluster_in_flight(c).values()), c
        n_w, n_e = self.ins.worker_sessions, self.ins.env_rows
        assert (s.w_adm[:n_w] == s.w_rel[:n_w]).all(), "a worker slot leaked"
        assert (s.e_adm[:n_e] == s.e_rel[:n_e]).all()
        assert (s.e_cluster[:n_e] == -1).all(), "a warm pool outlived its idle_ttl"
        for a in self.actions.values():
            assert a.status == "done"
            assert self.eng.phase(a.aid) == a.phase

    def _beat_all(self, report_free=True):
        """Every connected worker heartbeats what it holds (reporting its true free
        capacity)."""
        now = self.clock.now_ns()
        for wid in self._connected():
            row = self.workers[wid]
            toks = [a for a in self._live() if a.worker == row and a.expiry >= now]
            toks += [f for f in self._finals_live() if f.worker == row and f.drained
                     and f.expiry >= now]
            cluster = self.rows[row][1]
            cap = self.cap[cluster]
            used = self.eng.cluster_in_flight(cluster)
            if cap is None:
                vfree = np.array([10**9, 2**50, 10**6], dtype=np.int64)
            else:
                vfree = np.maximum(cap - np.array([used[r] for r in RES]), 0)
            free = {"cpu": f"{vfree[0]}m", "memory": int(vfree[1]), "gpu:H100": int(vfree[2])}
            assert self.eng.heartbeat(wid, [t.token for t in toks],
                                      free if report_free else None) == []
            for t in toks:
                t.expiry = now + self.ttl_ns
            if not report_free:
                continue
            self.obs[cluster] = (vfree, self.adm[cluster].copy())

    def teardown(self):
        if self.eng is not None and self.healthy:
            self.drain_all()

    # --------------------------------------------------------------- invariants

    @invariant()
    def consistent(self):
        if self.eng is not None:
            self._check()

    def _check(self):
        self.healthy = False
        eng, ins = self.eng, self.ins
        self._free_finals()
        s, n = ins.arrays, ins.action_rows
        n_q, n_c = len(self.queue_names), len(self.cluster_names)
        n_e, n_w, n_f = ins.env_rows, ins.worker_sessions, ins.finalize_rows
        state = s.a_state[:n]
        live = (state == RowState.SENT) | (state == RowState.RUNNING)
        charged = live & (s.a_charged[:n] == 1)
        pool_live = s.e_cluster[:n_e] >= 0
        assert np.array_equal(pool_live, s.e_released_gen[:n_e] != s.e_gen[:n_e]), (
            "a pool's cluster and its footprint release disagree")
        assert list(s.q_order) == self._order(), (list(s.q_order), self._order())

        # The model's view, aggregated once.
        m_actions, m_queued = np.zeros(n_q, np.int64), np.zeros(n_q, np.int64)
        m_qres, m_cres = np.zeros((n_q, 3), np.int64), np.zeros((n_c, 3), np.int64)
        m_load = np.zeros(n_w, np.int64)
        qidx = {q: i for i, q in enumerate(self.queue_names)}
        cidx = {c: i for i, c in enumerate(self.cluster_names)}
        for a in self.actions.values():
            if a.status == "queued":
                m_queued[qidx[a.queue]] += 1
            elif a.status in LIVE:
                m_actions[qidx[a.queue]] += 1
                m_load[a.worker] += 1
                if a.mode == "regular":
                    m_qres[qidx[a.queue]] += a.demand
                    m_cres[cidx[a.cluster]] += a.demand
        for (pq, _env), pool in self.pools.items():
            if pool.cluster is not None:
                m_qres[qidx[pq]] += pool.footprint
                m_cres[cidx[pool.cluster]] += pool.footprint
        for f in self.finals:
            if f.status == "sent":
                m_load[f.worker] += 1

        # 4. counts equal a recount over the arrays, and the model.
        metrics = eng.queue_metrics()
        a_queue, a_demand = s.a_queue[:n], s.a_demand[:n]
        e_fp = s.e_footprint[:n_e]
        for qi, qname in enumerate(self.queue_names):
            m = metrics[qname]
            inq = live & (a_queue == qi)
            used = np.array([m["in_flight_resources"][r] for r in RES])
            recount = (a_demand[charged & (a_queue == qi)].sum(axis=0)
                       + e_fp[pool_live & (s.e_queue[:n_e] == qi)].sum(axis=0))
            assert (used >= 0).all() and m["actions_in_flight"] >= 0, (qname, m)
            assert m["actions_in_flight"] == int(inq.sum()) == m_actions[qi], (
                qname, m, m_actions[qi])
            assert m["runs_in_flight"] == len(set(s.a_run[:n][inq].tolist())), (qname, m)
            assert np.array_equal(used, recount), f"{qname}: {used} != recount {recount}"
            assert np.array_equal(used, m_qres[qi]), f"{qname}: {used} != model {m_qres[qi]}"
            assert m["depth"] == m_queued[qi] == int(
                ((state == RowState.QUEUED) & (a_queue == qi)).sum()), (qname, m)
            hb = m["head_blocked"]
            if hb is not None:
                head = self.actions[ActionId.parse(hb["action"])]
                assert head.status == "queued" and head.queue == qname, hb
        for ci, cname in enumerate(self.cluster_names):
            used = np.array([eng.cluster_in_flight(cname)[r] for r in RES])
            recount = (a_demand[charged & (s.a_cluster[:n] == ci)].sum(axis=0)
                       + e_fp[pool_live & (s.e_cluster[:n_e] == ci)].sum(axis=0))
            assert (used >= 0).all(), (cname, used)
            assert np.array_equal(used, recount), f"{cname}: {used} != recount {recount}"
            assert np.array_equal(used, m_cres[ci]), f"{cname}: {used} != model {m_cres[ci]}"
            assert np.array_equal(s.c_adm[ci].astype(np.int64), self.adm[cname]), (
                f"{cname}: admitted {s.c_adm[ci]} != model {self.adm[cname]}")
            # 1. never over-commit a cluster with a known capacity while the gate enforces.
            if self.gate and self.cap[cname] is not None:
                assert (used <= self.cap[cname]).all(), (
                    f"cluster {cname} over-committed: {used} > {self.cap[cname]}")
        # 3. workers (run and finalize leases), runs and pools: never negative, = recount.
        fz_live = s.fz_state[:n_f] == RowState.SENT
        assert np.array_equal(fz_live, s.fz_released_gen[:n_f] != s.fz_gen[:n_f])
        assert n_f == len(self.finals) and n_w == len(self.rows), (n_f, n_w)
        w_used = (s.w_adm[:n_w] - s.w_rel[:n_w]).astype(np.int64)
        recount = (np.bincount(s.a_worker[:n][live], minlength=n_w)
                   + np.bincount(s.fz_worker[:n_f][fz_live], minlength=n_w))
        assert (w_used >= 0).all(), w_used
        assert np.array_equal(w_used, recount), (w_used, recount)
        assert np.array_equal(w_used, m_load), (w_used, m_load)
        n_u = len(ins.run_keys())
        runs = set(ins.runs())
        if self.live_runs - runs:
            event("run retired")
        if runs & self.retired_runs:
            event("retired run started afresh")
        self.retired_runs = (self.retired_runs | (self.live_runs - runs)) - runs
        self.live_runs = runs
        u_used = (s.u_adm[:n_u] - s.u_rel[:n_u]).astype(np.int64)
        assert np.array_equal(u_used, np.bincount(s.a_run[:n][live], minlength=n_u)), u_used
        e_used = (s.e_adm[:n_e] - s.e_rel[:n_e]).astype(np.int64)
        env_rows = live & (s.a_env[:n] >= 0)
        assert np.array_equal(e_used, np.bincount(s.a_env[:n][env_rows], minlength=n_e))
        assert (e_used <= s.e_slots[:n_e]).all(), ("pool over its slots", e_used)
        on_pool = s.a_cluster[:n][env_rows] == s.e_cluster[:n_e][s.a_env[:n][env_rows]]
        assert on_pool.all(), "an action of a warm pool runs off the pool's cluster"
        for f in self.finals:
            want = {"pending": RowState.QUEUED, "sent": RowState.SENT, "done": RowState.DONE,
                    "free": RowState.FREE}
            assert s.fz_state[f.f] == want[f.status], (f.__dict__, s.fz_state[f.f])
            assert int(s.fz_gen[f.f]) == f.gen, f.__dict__
            if f.status == "sent":
                assert int(s.fz_expiry[f.f]) == f.expiry, f.__dict__
        # 8. each run's live actions, read from the run's own trees (its parentless actions'
        # list and the children index, never a table scan), are the model's, in row order.
        by_run = {}
        for a in self.actions.values():
            if a.status != "done":
                by_run.setdefault(a.aid.run_key, set()).add(str(a.aid))
        for run in {a.aid.run_key for a in self.actions.values()}:
            ids = eng.live_actions(run)
            assert set(ids) == by_run.get(run, set()), (run, ids, by_run.get(run))
            rows = [ins.find(ActionId.parse(x)) for x in ids]
            assert rows == sorted(rows), (run, rows)
            assert eng.live_states(run)[0] == ids, run
        # 5 and 7: one state per action, agreeing with the model; phases as reported.
        assert ins.dispatch_tail - ins.dispatch_head == len(self.undrained)
        # A queued action's place in its queue: 1 + the queued ones enqueued before it.
        firsts = {}
        for a in self.actions.values():
            if a.status == "queued":
                firsts.setdefault(a.queue, []).append(a.enq_seq)
        want = {"queued": RowState.QUEUED, "sent": RowState.SENT, "backoff": RowState.BACKOFF,
                "running": RowState.RUNNING, "done": RowState.DONE}
        for a in self.actions.values():
            if a.status == "done" and ins.find(a.aid) is None:
                # Ended and its row reclaimed for new work: the outcome is retained.
                assert s.a_state[a.row] == RowState.FREE or ins.record(a.row).action != a.aid
                exp = eng.explain(a.aid)
                assert exp.phase == a.phase and exp.phase in TERMINAL_PHASES, exp
                assert eng.phase(a.aid) == exp.phase, a.aid
                assert exp.reason.startswith("UNSCHEDULABLE") == a.unschedulable, exp
                assert len(eng.attempts(a.aid)) == a.attempt, a.aid
                continue
            assert ins.find(a.aid) == a.row, f"{a.aid} moved from row {a.row}"
            row_state = RowState(int(s.a_state[a.row]))
            assert row_state == want[a.status], f"{a.aid}: row {row_state.name}, model {a.status}"
            assert int(s.a_gen[a.row]) == a.gen, a.aid
            if a.status in LIVE:
                assert int(s.a_expiry[a.row]) == a.expiry, (a.aid, s.a_expiry[a.row], a.expiry)
            exp = eng.explain(a.aid)
            # phase() is explain's phase without the reason or the position (no table scan).
            assert eng.phase(a.aid) == exp.phase, (a.aid, exp)
            if a.status == "queued":
                assert exp.wait is not None and exp.reason, exp
                assert exp.position == 1 + sum(x < a.enq_seq for x in firsts[a.queue]), (
                    a.aid, exp.position)
                # Projected or not, never "not queued" (the walk may stop before it).
                assert exp.projected_why != "not queued", exp
                assert exp.phase == (Phase.WAITING_FOR_RESOURCES if exp.wait in RESOURCE_WAITS
                                     else Phase.QUEUED), exp
            elif a.status == "backoff":
                assert exp.phase == Phase.QUEUED and exp.wait is None, exp
            elif a.status == "done":
                assert exp.phase == a.phase and exp.phase in TERMINAL_PHASES, exp
                assert exp.reason.startswith("UNSCHEDULABLE") == a.unschedulable, exp
            elif a.drained:
                assert exp.phase == (Phase.RUNNING if a.status == "running"
                                     else Phase.INITIALIZING), exp
            # Attempt history: one record per attempt, generations strictly increasing.
            atts = ins.record(ins.row_of(a.aid)).attempts
            assert len(atts) == a.attempt, (a.aid, len(atts), a.attempt)
            gens = [t.generation for t in atts if t.generation]
            assert gens == sorted(set(gens)), f"{a.aid}: attempt generations {gens}"
        self.healthy = True


# LEASEHOLD_PROP_EXAMPLES / _STEPS raise the example count / length for a long local hunt.
EngineMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("LEASEHOLD_PROP_EXAMPLES", 200)),
    stateful_step_count=int(os.environ.get("LEASEHOLD_PROP_STEPS", 40)), deadline=None,
    # No explain phase: on a failure it re-runs the (slow) machine for minutes.
    phases=[HPhase.explicit, HPhase.reuse, HPhase.generate, HPhase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestEngineMachine = EngineMachine.TestCase


# ------------------------------------------------------------------------------- focused tests


def _gang_config(scheduling, gpus):
    return parse_config({
        "resources": list(RES),
        "clusters": {"east": {"capacity": {"cpu": 64, "memory": "256Gi", "gpu:H100": gpus},
                              "node_shapes": [{"count": 4, "allocatable": {
                                  "cpu": 16, "memory": "64Gi", "gpu:H100": gpus}}]}},
        "queues": {"q": {"scheduling": scheduling}},
        "engine": {"default_queue": "q"},
    })


@settings(max_examples=60, deadline=None)
@given(gpus=st.integers(4, 8), first=st.integers(1, 3), stream=st.integers(3, 10),
       done=st.lists(st.booleans(), min_size=40, max_size=40))
def test_strict_fifo_gang_is_not_starved(gpus, first, stream, done):
    """STRICT_FIFO: a gang that does not fit holds its cluster; nothing enqueued after it is
    placed before it, and it is placed as soon as the capacity ahead of it drains."""
    eng = Engine(_gang_config(STRICT, gpus), clock=ManualClock(), store=MemoryStore())
    eng.register_worker("w", "east", 100)
    small = {"cpu": 1, "gpu:H100": 1}
    for i in range(first):
        eng.enqueue(ActionSpec(id=f"t/p/d/r/s{i}", task="small", resources=small))
    eng.enqueue(ActionSpec(id="t/p/d/r/gang", task="ray", pods=(
        PodGroup("head", 1, {"cpu": 1}), PodGroup("workers", 1, {"gpu:H100": gpus}))))
    for i in range(stream):
        eng.enqueue(ActionSpec(id=f"t/p/d/r/l{i}", task="small", resources=small))
    gang = ActionId.parse("t/p/d/r/gang")
    inflight, gang_placed, step = {}, False, 0
    while True:
        for asg in eng.tick():
            if asg.action.action.startswith("l"):
                assert gang_placed, f"{asg.action} placed before the blocked gang"
            gang_placed = gang_placed or asg.action == gang
            inflight[asg.action] = asg.generation
        if not inflight:
            break
        # Complete some of what runs (at least one, so the loop ends).
        for j, (aid, gen) in enumerate(sorted(inflight.items())):
            if j == 0 or done[(step + j) % len(done)]:
                eng.complete(aid, gen)
                del inflight[aid]
        step += 1
        assert step < 100
    assert gang_placed
    for aid in [*(f"s{i}" for i in range(first)), "gang", *(f"l{i}" for i in range(stream))]:
        assert eng.phase(f"t/p/d/r/{aid}") == Phase.SUCCEEDED, aid
    assert eng.queue_metrics("q")["actions_in_flight"] == 0
    assert eng.cluster_in_flight("east") == {r: 0 for r in RES}


@settings(max_examples=60, deadline=None)
@given(gpus=st.integers(4, 8), first=st.integers(1, 3), stream=st.integers(1, 6))
def test_greedy_packs_past_a_gang_that_does_not_fit(gpus, first, stream):
    """GREEDY_CAPACITY: a gang that does not fit is skipped and the work behind it that fits
    is placed in the same tick, up to the cluster's capacity and never past it."""
    eng = Engine(_gang_config(GREEDY, gpus), clock=ManualClock(), store=MemoryStore())
    eng.register_worker("w", "east", 100)
    small = {"cpu": 1, "gpu:H100": 1}
    for i in range(first):
        eng.enqueue(ActionSpec(id=f"t/p/d/r/s{i}", task="small", resources=small))
    eng.enqueue(ActionSpec(id="t/p/d/r/gang", task="ray",
                           pods=(PodGroup("workers", 1, {"gpu:H100": gpus}),)))
    for i in range(stream):
        eng.enqueue(ActionSpec(id=f"t/p/d/r/l{i}", task="small", resources=small))
    placed = {a.action.action for a in eng.tick()}
    assert "gang" not in placed
    assert placed == {f"s{i}" for i in range(first)} | {
        f"l{i}" for i in range(min(stream, gpus - first))}
    assert eng.cluster_in_flight("east")["gpu:H100"] == min(first + stream, gpus)
    assert eng.explain("t/p/d/r/gang").wait == WaitCode.CLUSTER_CAPACITY


@settings(max_examples=60, deadline=None)
@given(extra=st.integers(1, 4), cpu=st.integers(1, 8), queue_max=st.integers(1, 8))
def test_unschedulable_exactly_when_it_can_never_fit(extra, cpu, queue_max):
    """A pod bigger than every node shape, or a demand above the queue's hard max, fails at
    once as UNSCHEDULABLE; anything else is placed."""
    eng = Engine(parse_config({
        "resources": list(RES),
        "clusters": {"east": {"node_shapes": [{"count": 2, "allocatable": {
            "cpu": 4, "memory": "16Gi", "gpu:H100": 2}}]}},
        "queues": {"q": {"max_resources": {"cpu": queue_max}}},
        "engine": {"default_queue": "q"},
    }), clock=ManualClock(), store=MemoryStore())
    eng.register_worker("w", "east", 10)
    eng.enqueue(ActionSpec(id="t/p/d/r/gpu", task="x", resources={"gpu:H100": 2 + extra}))
    eng.enqueue(ActionSpec(id="t/p/d/r/cpu", task="x", resources={"cpu": cpu}))
    placed = {a.action.action for a in eng.tick()}
    gpu = eng.explain("t/p/d/r/gpu")
    assert gpu.phase == Phase.FAILED and gpu.reason.startswith("UNSCHEDULABLE"), gpu
    never = cpu > 4 or cpu > queue_max
    exp = eng.explain("t/p/d/r/cpu")
    if never:
        assert exp.phase == Phase.FAILED and exp.reason.startswith("UNSCHEDULABLE"), exp
        assert placed == set()
    else:
        assert placed == {"cpu"} and exp.phase == Phase.INITIALIZING, exp
    with pytest.raises(NotFound):
        eng.explain("t/p/d/r/nope")


@settings(max_examples=40, deadline=None)
@given(cap=st.integers(1, 2), how=st.sampled_from(["pool reaped", "cap lowered"]))
def test_strict_blocked_head_respects_action_concurrency(cap, how):
    """A STRICT_FIFO head blocked in an earlier tick is tried first in the next one; that is
    still an admission: it must not take the queue past action_concurrency (also after a live
    update lowered it). Here the queue is exactly at its cap when the head's capacity frees."""
    eng = Engine(parse_config({
        "resources": ["cpu"],
        "clusters": {"east": {"capacity": {"cpu": 4}}, "west": {"capacity": {"cpu": 2}}},
        "queues": {"q": {"scheduling": STRICT, "clusters": ["east"],
                         "action_concurrency": cap if how == "pool reaped" else cap + 1}},
        "engine": {"default_queue": "q"},
    }), clock=(clock := ManualClock()), store=MemoryStore())
    eng.register_worker("E", "east", 8)
    eng.register_worker("W", "west", 8)

    def spec(name, cpu, **kw):
        return ActionSpec(id=f"t/p/d/r/{name}", task="t", resources={"cpu": cpu}, **kw)

    # East is taken whole: by a warm pool that then idles, or by a running action.
    if how == "pool reaped":
        eng.enqueue(spec("first", 4, environment="env", reuse=ReusePolicy(1, 1, idle_ttl=5)))
    else:
        eng.enqueue(spec("first", 4))
    [first] = eng.tick()
    if how == "pool reaped":
        eng.complete(first.action, first.generation)
    eng.update_queue("q", clusters=["east", "west"])
    eng.enqueue(spec("big", 4))  # fits east only: blocked, the queue's head, holds east
    for i in range(cap):
        eng.enqueue(spec(f"small{i}", 1))  # go to west
    placed = {a.action.action for a in eng.tick()}
    assert placed == {f"small{i}" for i in range(cap)}
    assert eng.explain("t/p/d/r/big").wait == WaitCode.CLUSTER_CAPACITY
    if how == "pool reaped":
        clock.advance(6)  # the idle pool gives east back at the next tick
    else:
        eng.update_queue("q", action_concurrency=cap)
        eng.complete(first.action, first.generation)
    assert eng.queue_metrics("q")["actions_in_flight"] == cap
    placed = eng.tick()
    in_flight = eng.queue_metrics("q")["actions_in_flight"]
    assert in_flight <= cap, (
        f"{[a.action.action for a in placed]} admitted: {in_flight} in flight, "
        f"action_concurrency {cap}")


@settings(max_examples=80, deadline=None)
@given(plan=st.lists(st.tuples(st.booleans(), st.sampled_from([1.0, 11.0]), st.booleans()),
                     min_size=1, max_size=8))
def test_late_drain_keeps_attempts_and_finalize_leases_consistent(plan):
    """The dispatch channel may be drained late (after the lease it carries expired and was
    retried). Every lease still goes to a worker of the cluster it names, each generation is
    recorded on the attempt that it was assigned for, and an Assignment names that attempt."""
    eng = Engine(parse_config({
        "resources": ["cpu"],
        "clusters": {"east": {"capacity": {"cpu": 8}}, "west": {"capacity": {"cpu": 8}}},
        "queues": {"q": {}},
        "engine": {"default_queue": "q", "heartbeat_interval": 5, "expiry_missed_beats": 2,
                   "expiry_jitter": 0, "system_retries": 8},
    }), clock=(clock := ManualClock()), store=MemoryStore())
    where = {"E": "east", "W": "west"}
    current = "E"
    eng.register_worker(current, where[current], 4)
    aid = eng.enqueue(ActionSpec(id="t/p/d/r/a", task="t", resources={"cpu": 1}))
    ins = eng.inspect()
    row = ins.row_of(aid)
    attempt_of, seen = {}, []

    def drain():
        for asg in eng.drain_dispatch():
            assert where[asg.worker] == asg.cluster, (
                f"{asg.kind.name} lease for cluster {asg.cluster} sent to worker {asg.worker} "
                f"of {where[asg.worker]}")
            seen.append(asg)

    def schedule():
        eng.schedule()
        gen = int(ins.arrays.a_gen[row])
        if gen and gen not in attempt_of:
            attempt_of[gen] = len(eng.attempts(aid))  # the attempt this generation runs

    for do_drain, dt, swap in plan:
        schedule()
        if do_drain:
            drain()
        clock.advance(dt)
        if swap:
            eng.unregister_worker(current)
            current = "W" if current == "E" else "E"
            eng.register_worker(current, where[current], 4)
    schedule()
    drain()
    for asg in seen:
        if asg.kind == LeaseKind.RUN:
            assert asg.attempt == attempt_of[asg.generation], (
                f"generation {asg.generation} (attempt {attempt_of[asg.generation]}) was "
                f"dispatched as attempt {asg.attempt}")
    for att in eng.attempts(aid):
        if att.generation:
            assert attempt_of[att.generation] == att.number, (
                f"attempt {att.number} records generation {att.generation}, which ran "
                f"attempt {attempt_of[att.generation]}")


@settings(max_examples=60, deadline=None)
@given(macs=st.lists(st.sampled_from([0, 2, 3]), min_size=2, max_size=4))
def test_batch_enqueue_agrees_with_one_by_one_on_run_max_action_concurrency(macs):
    """enqueue_many is atomic but must check what enqueue checks: a batch is accepted exactly
    when each of its actions would be accepted sent one by one, in order (a run's
    max_action_concurrency is fixed by its first action; a different non-zero value later is
    refused), and then the run's cap is the same."""
    cfg = parse_config({"resources": ["cpu"], "clusters": {"east": {"capacity": {"cpu": 8}}},
                        "queues": {"q": {}}, "engine": {"default_queue": "q"}})
    specs = [ActionSpec(id=f"t/p/d/r/a{i}", task="t", resources={"cpu": 1},
                        run_max_action_concurrency=m) for i, m in enumerate(macs)]
    one = Engine(cfg, clock=ManualClock(), store=MemoryStore())
    each_ok = True
    for spec in specs:
        try:
            one.enqueue(spec)
        except SpecError:
            each_ok = False
            break
    batch = Engine(cfg, clock=ManualClock(), store=MemoryStore())
    try:
        batch.enqueue_many(specs)
        batch_ok = True
    except SpecError:
        batch_ok = False
        b = batch.inspect()
        assert b.action_rows == 0 and all(b.find(x.id) is None for x in specs), (
            "a refused batch stored something")
    assert batch_ok == each_ok, f"macs {macs}: batch accepted={batch_ok}, one by one={each_ok}"
    if batch_ok:
        assert batch.inspect().arrays.u_cap[0] == one.inspect().arrays.u_cap[0]
