"""The trace simulator: a trace's jobs through the real Engine tick on a virtual clock.

:func:`simulate` is event-driven. The clock jumps to the next event (the next submission or
the next completion); at each event it completes what finished (reported SUCCEEDED at
start + runtime), enqueues what was submitted, ticks, and hands what was assigned to the
cluster's scheduler. Nothing sleeps. Each cluster gets one worker with a slot per job, so
worker slots never bind: only the config's resources, queues and the policy decide.

The cluster's scheduler (:mod:`engine._nodes`): a cluster with node shapes is its nodes, and
an assigned action starts (is reported RUNNING) only when every one of its pods is placed on
a node, first fit decreasing; until then it pends, and is retried whenever capacity frees up.
A cluster without node shapes, or every cluster with ``nodes=False``, starts an assigned
action at once (the engine's view: totals and shapes only).

Policies (:data:`POLICIES`) rewrite every queue of the config through :func:`policy_config`:
``fifo`` = STRICT_FIFO without backfill, ``backfill`` = STRICT_FIFO with the queue key
``backfill = true``, ``greedy`` = GREEDY_CAPACITY.

Metrics (``docs/simulator.md`` defines each): utilisation of the primary resource (all GPUs,
else cpu) between the first and the last submission, mean and p95 wait (submit to start),
mean bounded slowdown, the longest wait of a gang (a job of more than one pod), jobs
completed, the backfill count the engine reports per queue, and the time assigned actions
pended for nodes (assignment to start).
"""

import heapq
import time
from dataclasses import dataclass, field, fields, replace

import numpy as np

from engine._clock import ManualClock
from engine._config import GREEDY_CAPACITY, STRICT_FIFO
from engine._engine import Engine
from engine._errors import ResourceExhausted, SpecError
from engine._model import ActionSpec, PodGroup, compile_spec, fit_problem
from engine._nodes import Nodes, Placer
from engine._trace import TraceError
from engine._units import UNLIMITED, format_quantity
from storage import MemoryStore

__all__ = [
    "POLICIES",
    "SimResult",
    "policy_config",
    "prepare",
    "simulate",
]

# Queue settings per policy.
POLICIES = {
    "fifo": {"scheduling": STRICT_FIFO, "backfill": False},
    "backfill": {"scheduling": STRICT_FIFO, "backfill": True},
    "greedy": {"scheduling": GREEDY_CAPACITY, "backfill": False},
}

# Workers in the simulator always heartbeat: a lease must not expire between two events.
# A heartbeat interval of ~3 years keeps every lease live for any trace (ttl ~ 9.5 years).
_NO_EXPIRY_HEARTBEAT_S = 1e8
# Bounded slowdown: runtimes below this count as this long (the usual 10 s).
SLOWDOWN_BOUND_S = 10.0
_NEVER = 1 << 62


def policy_config(config, policy):
    """``config`` with every queue set to ``policy`` (and leases that never expire)."""
    if policy not in POLICIES:
        raise SpecError(f"unknown policy {policy!r}; allowed: {', '.join(POLICIES)}")
    queues = tuple(replace(q, **POLICIES[policy]) for q in config.queues)
    settings = replace(config.engine, heartbeat_interval=_NO_EXPIRY_HEARTBEAT_S)
    return replace(config, queues=queues, engine=settings)


def _new_engine(config, clock):
    """The engine the simulator drives (the one place it is built). A simulation keeps no
    state, so it runs on the in-memory store: the write-through path (records encoded, one
    group commit per loop turn) still runs, without a disk."""
    return Engine(config, clock=clock, store=MemoryStore())


# ---------------------------------------------------------------------------------------------
# Checking a trace against a config


@dataclass
class Prepared:
    """Jobs checked against a config, with their specs and their pod groups (engine units:
    ``(pods [P, R], counts [P])`` per job); ``unfit`` were dropped (skip_unfit)."""

    jobs: list
    specs: list
    unfit: list = field(default_factory=list)   # (job, reason)
    pods: list = field(default_factory=list)


def _spec(i, job):
    if len(job.pods) == 1 and job.pods[0][0] == 1:
        shape = {"resources": job.pods[0][1]}
    else:
        shape = {"pods": tuple(PodGroup(f"g{k}", count, res)
                               for k, (count, res) in enumerate(job.pods))}
    # The trace's runtime estimate, when it has one, is the action's (docs/predictions.md).
    return ActionSpec(id=f"sim/trace/prod/r{i}/job", task=job.task, run_queue=job.queue,
                      runtime_estimate=job.estimate, **shape)


def prepare(config, jobs, skip_unfit=False, nodes=True):
    """Check every job against ``config``: its queue and resources exist, and some cluster
    its queue may use can ever hold it (capacity, node shapes, the queue's budget; with
    ``nodes``, on a cluster with node shapes, its pods placed on the empty nodes as the
    simulation places them). A job that cannot raises :class:`TraceError` naming it (its file
    and line), or with ``skip_unfit`` is dropped and listed in ``unfit``."""
    res = config.resources
    queues = {q.name: q for q in config.queues}
    kept, specs, pods, unfit = [], [], [], []
    for job in jobs:
        spec = _spec(len(specs), job)
        try:
            c = compile_spec(spec, res, queues, config.engine.default_queue)
        except SpecError as exc:
            msg = str(exc).split(": ", 1)[-1]
            raise TraceError(f"{job.where}: job {job.id}: {msg}") from None
        why = _never_fits(config, c, nodes)
        if why is not None:
            if not skip_unfit:
                raise TraceError(f"{job.where}: job {job.id} can never run: {why} "
                                 f"(--skip-unfit drops such jobs and counts them)")
            unfit.append((job, why))
            continue
        kept.append(job)
        specs.append(spec)
        pods.append((c.pods, c.pod_counts))
    return Prepared(jobs=kept, specs=specs, unfit=unfit, pods=pods)


def _never_fits(config, c, nodes):
    res = config.resources
    q = config.queue(c.queue)
    over = np.nonzero(c.demand > q.max_resources)[0]
    if over.size:
        r = int(over[0])
        name = res.names[r]
        return (f"it needs {name}={format_quantity(name, int(c.demand[r]))}, more than queue "
                f"{q.name}'s max_resources {format_quantity(name, int(q.max_resources[r]))}")
    reasons = []
    for name in q.clusters:
        cl = config.cluster(name)
        shapes = (np.stack([s.allocatable for s in cl.node_shapes]) if cl.node_shapes
                  else None)
        problem = fit_problem(c, cl.capacity, shapes)
        if problem is None:
            if not nodes or not cl.node_shapes:
                return None
            if Nodes(cl, res).place(c.pods, c.pod_counts) is not None:
                return None
            # Every pod fits some shape and the totals fit, but not all pods at once.
            reasons.append(f"its {int(c.pod_counts.sum())} pods cannot all be placed on the "
                           f"nodes of cluster {name}, even empty (--no-nodes does not place "
                           f"pods on nodes)")
            continue
        kind, k = problem
        if kind == "capacity":
            rn = res.names[k]
            reasons.append(f"cluster {name} has {rn}={format_quantity(rn, int(cl.capacity[k]))}"
                           f" in all, it needs {format_quantity(rn, int(c.demand[k]))}")
        else:
            reasons.append(f"a pod ({res.describe(c.pods[k])}) fits no node shape "
                           f"of cluster {name}")
    return "; ".join(reasons) or f"queue {q.name} may use no cluster"


# ---------------------------------------------------------------------------------------------
# The primary resource (utilisation)


def primary_resource(config, resource=None):
    """``(label, dims)``: the resource(s) utilisation is measured on: ``resource`` if given,
    else every ``gpu:*`` resource together, else cpu, else the first resource."""
    names = config.resources.names
    if resource is not None:
        if resource not in names:
            raise SpecError(f"resource {resource!r} is not configured "
                            f"(configured: {', '.join(names)})")
        return resource, [names.index(resource)]
    gpus = [i for i, n in enumerate(names) if n.startswith("gpu:")]
    if gpus:
        return "gpu", gpus
    if "cpu" in names:
        return "cpu", [names.index("cpu")]
    return names[0], [0]


def _capacity(config, dims):
    total = 0
    for c in config.clusters:
        if c.capacity is None or any(int(c.capacity[d]) >= UNLIMITED for d in dims):
            return None   # unknown capacity: utilisation is undefined
        total += sum(int(c.capacity[d]) for d in dims)
    return total


# ---------------------------------------------------------------------------------------------
# Results


@dataclass
class SimResult:
    """What one policy did with a trace. Times in seconds of virtual time; None when there is
    nothing to measure (no gang, no capacity of the primary resource, no node model, ...)."""

    policy: str
    jobs: int                        # jobs given (after the fit check)
    completed: int
    rejected: int                    # refused at enqueue (a queue's depth)
    unfinished: int                  # neither completed nor rejected when events ran out
    resource: str                    # what utilisation is measured on
    utilization: float | None
    mean_wait_s: float | None
    p95_wait_s: float | None
    bounded_slowdown: float | None
    gang_max_wait_s: float | None
    gangs: int
    backfilled: int
    makespan_s: float | None         # first submission to last completion
    ticks: int
    wall_s: float
    # The node model: clusters whose pods are placed on nodes ([] = none: starts at
    # assignment); over started jobs, the time from assignment to start (pending for nodes).
    nodes: list = field(default_factory=list)
    pended: int | None = None        # started jobs that pended at all (> 0 s)
    pend_mean_s: float | None = None
    pend_p95_s: float | None = None
    pend_max_s: float | None = None
    # Share of the primary resource's capacity charged to pending actions (admitted by the
    # engine, not placed: held idle), over the utilisation window.
    pend_held: float | None = None
    pending_at_end: int | None = None   # assigned, never placed when events ran out
    # The ETA projection (``etas=True``; docs/simulator.md): each job's projected start,
    # taken when it is enqueued (before the first tick that sees it), against its start.
    eta_jobs: int | None = None          # started jobs whose ETA was taken
    eta_coverage: float | None = None    # ... share of them that got one (not None)
    eta_abs_error_p50_s: float | None = None   # |start - ETA| over those, 50th percentile
    eta_abs_error_p90_s: float | None = None   # ... 90th percentile
    eta_abs_error_mean_s: float | None = None
    eta_waiting: int | None = None       # ... of them projected to wait (ETA after enqueue)
    eta_abs_error_waiting_p50_s: float | None = None   # |start - ETA| over those, p50
    eta_abs_error_waiting_p90_s: float | None = None   # ... p90
    eta_late_share: float | None = None  # share that started after their ETA (+1 s)
    eta_early_share: float | None = None  # ... before it (-1 s)
    series: dict | None = None       # t_s, queued, pending, utilization: one point per event

    def to_dict(self, with_series=False):
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "series"}
        if with_series:
            out["series"] = self.series
        return out


def simulate(config, jobs, policy, *, resource=None, series=False, skip_unfit=False,
             prepared=None, nodes=True, etas=False):
    """Run ``jobs`` (a list of :class:`~engine._trace.Job`) under ``policy`` through the real
    engine on a virtual clock; returns a :class:`SimResult`. ``prepared`` (from
    :func:`prepare`) skips re-checking the jobs when several policies share one trace.
    ``nodes``: place pods on the nodes of clusters with node shapes (``False``: every
    assigned action starts at once, as before the node model). ``etas``: take each job's
    projected start (``Engine.projected_start``) when it is enqueued and report the error
    against its actual start (the ``eta_*`` fields)."""
    wall0 = time.perf_counter()
    cfg = policy_config(config, policy)
    if prepared is None:
        prepared = prepare(config, jobs, skip_unfit=skip_unfit, nodes=nodes)
    jobs, specs = prepared.jobs, prepared.specs
    n = len(jobs)
    label, dims = primary_resource(config, resource)
    capacity = _capacity(config, dims)

    clock = ManualClock(0)
    eng = _new_engine(cfg, clock)
    for c in cfg.clusters:
        eng.register_worker(f"sim-{c.name}", c.name, max(1, n))
    placers = {c.name: Placer(Nodes(c, config.resources))
               for c in cfg.clusters if nodes and c.node_shapes}
    # Re-ticking an instant: a queue cut short by its candidate budget examines at least this
    # many new candidates a tick (a STRICT head retried first counts as one), so after
    # depth / per_tick ticks in a row that placed nothing its rotation has come round.
    per_tick = max(1, cfg.engine.max_candidates - 1)

    res = config.resources
    submit_ns = np.array([round(j.submit * 1e9) for j in jobs], dtype=np.int64)
    run_ns = np.array([max(1, round(j.runtime * 1e9)) for j in jobs], dtype=np.int64)
    use = np.zeros(n, dtype=np.float64)   # primary resource held while running
    for i, job in enumerate(jobs):
        for count, r in job.pods:
            vec = res.vector(r)
            use[i] += count * float(sum(int(vec[d]) for d in dims))
    assign_ns = np.full(n, -1, dtype=np.int64)
    start_ns = np.full(n, -1, dtype=np.int64)
    end_ns = np.full(n, -1, dtype=np.int64)
    rejected = np.zeros(n, dtype=bool)
    eta_ns = np.full(n, -2, dtype=np.int64)     # -2 not taken, -1 none (unknown)

    running = []          # heap of (end_ns, index, action, generation, cluster)
    leases = {}           # index -> (action, generation, cluster) of a pending action
    nxt = 0               # next job to submit
    queued = 0
    pending = 0           # assigned, waiting for nodes
    in_use = 0.0
    ticks = 0
    pts_t, pts_q, pts_p, pts_u = [], [], [], []

    def start(i, action, gen, cluster, now):
        nonlocal in_use
        eng.mark_running(action, gen)
        start_ns[i] = now
        in_use += use[i]
        heapq.heappush(running, (now + int(run_ns[i]), i, action, gen, cluster))

    while True:
        t_sub = int(submit_ns[nxt]) if nxt < n else _NEVER
        t_end = running[0][0] if running else _NEVER
        now = min(t_sub, t_end)
        if now == _NEVER:
            break
        clock.set_ns(now)
        freed = False
        while running and running[0][0] <= now:
            _, i, action, gen, cluster = heapq.heappop(running)
            eng.complete(action, gen)
            end_ns[i] = now
            in_use -= use[i]
            if cluster in placers:
                placers[cluster].finish(i)
                freed = True
        batch = []
        while nxt < n and submit_ns[nxt] <= now:
            batch.append(nxt)
            nxt += 1
        if batch:
            queued += len(batch) - _enqueue(eng, specs, batch, rejected)
            if etas:
                for i in batch:
                    if not rejected[i]:
                        t = eng.projected_start(specs[i].id).eta_ns
                        eta_ns[i] = -1 if t is None else t
        idle = 0
        admitted = False
        while queued:
            placed = eng.tick()
            ticks += 1
            for a in placed:
                i = int(a.action.run[1:])
                assign_ns[i] = now
                placer = placers.get(a.cluster)
                if placer is None:
                    start(i, a.action, a.generation, a.cluster, now)
                else:
                    pods, counts = prepared.pods[i]
                    placer.admit(i, pods, counts)
                    leases[i] = (a.action, a.generation, a.cluster)
                    pending += 1
                    admitted = True
            queued -= len(placed)
            if placed:
                idle = 0
                continue
            # Nothing placed: tick again only if a queue stopped at its candidate budget
            # (work it did not reach may fit), until its rotation has come round.
            idle += 1
            if idle > -(-eng.cut_short() // per_tick):
                break
        if freed or admitted:      # else nothing that pends can fit now either
            for placer in placers.values():
                for i in placer.place_pending():
                    start(i, *leases.pop(i), now)
                    pending -= 1
        if series:
            pts_t.append(now / 1e9)
            pts_q.append(queued)
            pts_p.append(pending)
            pts_u.append(float(in_use) / capacity if capacity else None)

    backfilled = sum(int(m.get("backfilled", 0)) for m in eng.queue_metrics().values())
    out = _result(policy, jobs, submit_ns, run_ns, start_ns, end_ns, rejected, use, capacity,
                  label, backfilled, ticks, time.perf_counter() - wall0,
                  {"t_s": pts_t, "queued": pts_q, "pending": pts_p, "utilization": pts_u}
                  if series else None)
    if placers:
        _pending_figures(out, list(placers), assign_ns, start_ns, pending, use, submit_ns,
                         capacity)
    if etas:
        _eta_figures(out, eta_ns, start_ns, submit_ns)
    return out


def _eta_figures(out, eta_ns, start_ns, submit_ns):
    """The ETA projection's figures on ``out``: over started jobs whose ETA was taken, the
    share that got one, and the distribution of ``|start - ETA|`` over those, and over
    those projected to wait (an ETA after their enqueue: the ones an ETA is for)."""
    taken = (start_ns >= 0) & (eta_ns >= -1)
    out.eta_jobs = int(np.count_nonzero(taken))
    if not out.eta_jobs:
        return
    known = taken & (eta_ns >= 0)
    out.eta_coverage = float(np.count_nonzero(known)) / out.eta_jobs
    if known.any():
        err = (start_ns[known] - eta_ns[known]) / 1e9
        out.eta_abs_error_p50_s = float(np.percentile(np.abs(err), 50))
        out.eta_abs_error_p90_s = float(np.percentile(np.abs(err), 90))
        out.eta_abs_error_mean_s = float(np.mean(np.abs(err)))
        out.eta_late_share = float(np.mean(err > 1.0))
        waiting = known & (eta_ns > submit_ns)
        out.eta_waiting = int(np.count_nonzero(waiting))
        if out.eta_waiting:
            werr = np.abs(start_ns[waiting] - eta_ns[waiting]) / 1e9
            out.eta_abs_error_waiting_p50_s = float(np.percentile(werr, 50))
            out.eta_abs_error_waiting_p90_s = float(np.percentile(werr, 90))
        out.eta_early_share = float(np.mean(err < -1.0))


def _pending_figures(out, clusters, assign_ns, start_ns, pending, use, submit_ns, capacity):
    """The node model's figures on ``out``: over started jobs, assignment to start; and the
    primary resource charged to assigned actions until they start (or the window ends), over
    capacity x the utilisation window."""
    started = start_ns >= 0
    delay = (start_ns[started] - assign_ns[started]) / 1e9
    out.nodes = clusters
    out.pended = int(np.count_nonzero(delay > 0))
    out.pending_at_end = pending
    if delay.size:
        out.pend_mean_s = float(np.mean(delay))
        out.pend_p95_s = float(np.percentile(delay, 95))
        out.pend_max_s = float(np.max(delay))
    if out.utilization is not None:
        # Actions never placed hold their share to the end of the window.
        t0, t1 = int(submit_ns.min()), int(submit_ns.max())
        assigned = assign_ns >= 0
        a = np.clip(assign_ns[assigned], t0, t1)
        s = np.clip(np.where(started, start_ns, t1)[assigned], t0, t1)
        out.pend_held = float(np.sum(use[assigned] * (s - a))) / (capacity * (t1 - t0))


def _enqueue(eng, specs, batch, rejected):
    """Enqueue a batch; a queue at its depth refuses jobs, which are counted. Returns how
    many were refused."""
    try:
        eng.enqueue_many([specs[i] for i in batch])
        return 0
    except ResourceExhausted:
        pass
    refused = 0
    for i in batch:
        try:
            eng.enqueue(specs[i])
        except ResourceExhausted:
            rejected[i] = True
            refused += 1
    return refused


def _result(policy, jobs, submit_ns, run_ns, start_ns, end_ns, rejected, use, capacity, label,
            backfilled, ticks, wall_s, series):
    n = len(jobs)
    done = end_ns >= 0
    started = start_ns >= 0
    wait = (start_ns[started] - submit_ns[started]) / 1e9
    runtime = run_ns[started] / 1e9
    gangs = np.array([j.n_pods > 1 for j in jobs], dtype=bool)
    gang_waits = (start_ns[started & gangs] - submit_ns[started & gangs]) / 1e9

    utilization = None
    if n and capacity:
        t0, t1 = int(submit_ns.min()), int(submit_ns.max())
        if t1 > t0:
            s = np.clip(start_ns[started], t0, t1)
            e = np.clip(np.where(done[started], end_ns[started], t1), t0, t1)
            used = float(np.sum(use[started] * (e - s)))
            utilization = used / (capacity * (t1 - t0))

    def stat(values, fn):
        return float(fn(values)) if values.size else None

    slowdown = np.maximum(1.0, (wait + runtime) / np.maximum(runtime, SLOWDOWN_BOUND_S))
    return SimResult(
        policy=policy, jobs=n, completed=int(done.sum()), rejected=int(rejected.sum()),
        unfinished=int(n - done.sum() - rejected.sum()), resource=label,
        utilization=utilization,
        mean_wait_s=stat(wait, np.mean),
        p95_wait_s=stat(wait, lambda v: np.percentile(v, 95)),
        bounded_slowdown=stat(slowdown, np.mean),
        gang_max_wait_s=stat(gang_waits, np.max),
        gangs=int(gangs.sum()), backfilled=backfilled,
        makespan_s=(float(end_ns[done].max() - submit_ns.min()) / 1e9 if done.any() else None),
        ticks=ticks, wall_s=wall_s, series=series,
    )
