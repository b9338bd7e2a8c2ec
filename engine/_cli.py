"""The ``leasehold`` command line (its commands; the entry point is ``engine/cli.py``)."""

import argparse
import json
import re
import sys
from pathlib import Path

from engine._clock import ManualClock
from engine._codes import LeaseKind, Phase
from engine._commands import CommandError, guard, load, positive_seconds
from engine._commands import register as register_commands
from engine._config import _NAME as _CLUSTER_NAME
from engine._config import _TENANT as _TENANT_PREFIX
from engine._config import load_config
from engine._engine import Engine
from engine._errors import LeaseholdError, SpecError, empty_file
from engine._model import ActionSpec, PodGroup, ReusePolicy
from engine._sim import POLICIES, prepare, simulate
from engine._state import check_fits_memory
from engine._trace import SwfMapping, load_trace
from engine._units import _ALIASES as _RESOURCE_ALIASES
from engine._units import _kind_of as resource_kind
from engine._units import format_quantity, parse_quantity
from storage import MemoryStore

__all__ = ["main"]

EXAMPLE_CONFIG = Path(__file__).parent / "examples" / "leasehold.toml"
SIMULATE_CONFIG = Path(__file__).parent / "examples" / "simulate.toml"


def _check_config(args):
    cfg = load_config(args.config)
    check_fits_memory(cfg)      # as a shard's start refuses it (config check does too)
    res = cfg.resources
    print(f"{cfg.source}: ok")
    print(f"  resources: {', '.join(res.names)}")
    for c in cfg.clusters:
        cap = "unknown (open)" if c.capacity is None else res.describe(c.capacity)
        shapes = ", ".join(f"{s.count}x {s.name}" for s in c.node_shapes) or "unknown"
        print(f"  cluster {c.name}: capacity {cap}; node shapes {shapes}")
    for q in sorted(cfg.queues, key=lambda q: -q.priority):
        limits = ", ".join(
            f"{n}={format_quantity(n, int(v))}"
            for n, v in zip(res.names, q.max_resources, strict=True) if v < (1 << 62)
        ) or "none"
        print(f"  queue {q.name}: priority {q.priority}, {q.scheduling}, "
              f"action_concurrency {q.action_concurrency or 'unlimited'}, "
              f"run_concurrency {q.run_concurrency or 'unlimited'}, depth {q.depth}, "
              f"budget {limits}, clusters {', '.join(q.clusters)}")
    return 0


def _demo(args):
    """A small mixed workload on a virtual clock: what the tick decides and why others wait."""
    cfg = load_config(args.config)
    clock = ManualClock()
    eng = Engine(cfg, clock=clock, store=MemoryStore())
    for c in cfg.clusters:
        eng.register_worker(f"worker-{c.name}", c.name, 10_000)
    queues = {q.name for q in cfg.queues}
    gpu_q = "gpu" if "gpu" in queues else cfg.engine.default_queue
    gpu_name = next((n for n in cfg.resources.names if n.startswith("gpu:")), None)
    specs = []
    for i in range(6):
        if gpu_name:
            specs.append(ActionSpec(
                id=f"acme/ml/prod/train{i}/fit", task="train", run_queue=gpu_q,
                pods=(PodGroup("worker", 2, {"cpu": 16, "memory": "64Gi", gpu_name: 8}),)))
    for i in range(20):
        specs.append(ActionSpec(id=f"acme/etl/prod/etl{i % 4}/step{i}", task="etl",
                                resources={"cpu": 2, "memory": "8Gi"}))
    for i in range(8):
        specs.append(ActionSpec(
            id=f"acme/app/prod/chat/call{i}", task="chat", environment="chat-pool",
            reuse=ReusePolicy(replicas=2, concurrency=2, idle_ttl=60),
            resources={"cpu": 4, "memory": "16Gi"}))
    eng.enqueue_many(specs)
    held = {}   # the leases each worker holds: what it heartbeats
    for t in range(args.ticks):
        _demo_tick(eng, f"tick {t + 1}", held)
        clock.advance(1)
    print("waiting:")
    for s in specs:
        exp = eng.explain(s.id)
        if exp.wait is not None:
            print(f"  {s.id}: {exp.phase}: {exp.reason}")
    print("queues:")
    print(json.dumps(eng.queue_metrics(), indent=2))
    if not held:
        return 0

    print("lease life cycle:")
    runs = {a.action: a for leases in held.values() for a in leases}
    for worker, leases in held.items():
        refused = eng.heartbeat(worker, [a.token for a in leases])
        print(f"  {worker} heartbeats {len(leases)} leases in one batch: {len(refused)} refused")
        for a in leases:
            eng.report(a.token, Phase.RUNNING)
    first = next(a for a in runs.values() if a.action.run == "etl0")
    eng.report(first.token, Phase.FAILED, error_kind="SYSTEM", cause="OOM",
               message="container killed at its memory limit", cleanup=True)
    print(f"  {first.action}: FAILED SYSTEM OOM -> retried under the system budget")
    aborted = [a for a in runs.values() if a.action.run == "etl3"]
    for aid in eng.abort(aborted[0].action.run_key + "/" + aborted[0].action.action):
        print(f"  {aid}: aborted")
    worker = aborted[0].worker
    refused = eng.heartbeat(worker, [a.token for a in held[worker]])
    print(f"  {worker} heartbeats again: refused "
          f"{sorted({r.verdict.name for r in refused})} x{len(refused)} (it stops those)")
    train = next((a for a in runs.values() if a.action.run == "train0"), None)
    if train is not None:
        eng.report(train.token, Phase.SUCCEEDED)
        print(f"  {train.action}: SUCCEEDED; its GPUs return to queue {train.queue}'s budget")
    clock.advance(2)
    _demo_tick(eng, "next tick (cleanup first, then the retry and freed capacity)", {})
    for n, att in enumerate(eng.attempts(first.action), 1):
        print(f"  {first.action} attempt {n}: cluster {att.cluster}, worker {att.worker}, "
              f"{att.phase or 'running'} {att.cause or ''}".rstrip())
    return 0


def _demo_tick(eng, title, held):
    placed = eng.tick()
    print(f"{title}: {len(placed)} assigned")
    for a in placed:
        kind = "" if a.kind == LeaseKind.RUN else " [finalize]"
        print(f"  {a.action}{kind} -> {a.cluster}/{a.worker} (generation {a.generation})")
        if a.kind == LeaseKind.RUN:
            held.setdefault(a.worker, []).append(a)


def _duration(seconds):
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        m, s = divmod(round(seconds), 60)
        return f"{m}m{s:02d}s"
    h, m = divmod(round(seconds / 60), 60)
    return f"{h}h{m:02d}m"


_COLUMNS = ("policy", "utilisation", "mean wait", "p95 wait", "bounded slowdown",
            "gang max wait", "backfilled", "jobs")
# With the node model: the time assigned actions pended for nodes (assignment to start).
_NODE_COLUMNS = ("pended", "pend mean", "pend p95", "pend max", "pend held")


def _row(r, node_columns=False):
    util = "-" if r.utilization is None else f"{100 * r.utilization:.1f}%"
    slow = "-" if r.bounded_slowdown is None else f"{r.bounded_slowdown:.2f}"
    jobs = f"{r.completed}/{r.jobs}"
    if r.rejected:
        jobs += f" ({r.rejected} rejected)"
    if r.unfinished:
        jobs += f" ({r.unfinished} unfinished)"
    row = (r.policy, util, _duration(r.mean_wait_s), _duration(r.p95_wait_s), slow,
           _duration(r.gang_max_wait_s), str(r.backfilled))
    if node_columns:
        pended = "-" if r.pended is None else str(r.pended)
        if r.pending_at_end:
            pended += f" ({r.pending_at_end} never placed)"
        held = "-" if r.pend_held is None else f"{100 * r.pend_held:.1f}%"
        row += (pended, _duration(r.pend_mean_s), _duration(r.pend_p95_s),
                _duration(r.pend_max_s), held)
    return (*row, jobs)


def _table(rows, node_columns=False):
    columns = _COLUMNS[:-1] + (_NODE_COLUMNS if node_columns else ()) + _COLUMNS[-1:]
    widths = [max(len(str(row[k])) for row in [columns, *rows]) for k in range(len(columns))]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)).rstrip()
             for row in [columns, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _node_model(cfg, nodes):
    """One line saying where pods are placed on nodes and where they are not."""
    if not nodes:
        return "nodes: not modelled (--no-nodes): an assigned action starts at once"
    shaped = [c for c in cfg.clusters if c.node_shapes]
    parts = [f"{c.name} ({', '.join(f'{s.count}x {s.name}' for s in c.node_shapes)})"
             for c in shaped]
    line = ("nodes: pods placed first fit decreasing on " + "; ".join(parts) +
            "; an action starts when all its pods are placed (waits include pending)"
            if shaped else "nodes: not modelled (no cluster has node shapes)")
    bare = [c.name for c in cfg.clusters if not c.node_shapes]
    if shaped and bare:
        line += (f"; {', '.join(bare)} without node shapes: an assigned action starts "
                 f"at once")
    return line


def _check_swf_flags(cfg, swf, args):
    """--swf-resource, --swf-per-proc and --swf-queue are the user's, not the trace's: checked
    (and named) before the trace is read, where an SWF line would otherwise be blamed."""
    name = _RESOURCE_ALIASES.get(swf.resource, swf.resource)
    if name not in cfg.resources.names:
        raise CommandError("INVALID_ARGUMENT", f"--swf-resource {swf.resource!r}: not a "
                           f"resource of {_shown(cfg.source)} (configured: "
                           f"{', '.join(cfg.resources.names)})")
    try:
        amount = parse_quantity(name, resource_kind(name), swf.per_processor)
    except ValueError as exc:
        raise CommandError("INVALID_ARGUMENT", f"--swf-per-proc {args.swf_per_proc!r}: "
                           f"{exc}") from None
    if amount <= 0:
        # Jobs asking for nothing would all start at once: a table that means nothing.
        raise CommandError("INVALID_ARGUMENT", f"--swf-per-proc {args.swf_per_proc!r}: a "
                           f"quantity > 0 of {name} per processor")
    queues = [q.name for q in cfg.queues]
    if swf.queue is not None and swf.queue not in queues:
        raise CommandError("INVALID_ARGUMENT", f"--swf-queue {swf.queue!r}: not a queue of "
                           f"{_shown(cfg.source)} (queues: {', '.join(queues)})")


def _simulate(args):
    """Run a trace through the real tick once per policy and compare."""
    cfg = load_config(args.config)
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        print(f"leasehold: INVALID_ARGUMENT: --policy {args.policy!r}: unknown "
              f"{', '.join(unknown) or 'empty list'}; allowed: {', '.join(POLICIES)}",
              file=sys.stderr)
        return 2
    twice = sorted({p for p in policies if policies.count(p) > 1})
    if twice:
        # Run twice, the table shows two rows of one policy and --json keeps one of them.
        raise CommandError("INVALID_ARGUMENT", f"--policy {args.policy!r}: "
                           f"{', '.join(twice)} given twice")
    fmt = args.format or ("swf" if Path(args.trace).suffix.lower() == ".swf" else "jsonl")
    for flag, value in (("--swf-resource", args.swf_resource),
                        ("--swf-per-proc", args.swf_per_proc), ("--swf-queue", args.swf_queue)):
        if value is not None and fmt != "swf":
            raise CommandError("INVALID_ARGUMENT", f"{flag} is for SWF traces; {args.trace} is "
                               f"read as JSON lines (--format swf, or a .swf file)")
    if args.plot is not None:
        # Before the runs, not after them.
        plot = Path(args.plot)
        if plot.is_dir():
            raise CommandError("INVALID_ARGUMENT", f"--plot {plot}: a directory, not a file")
        if not plot.resolve().parent.is_dir():
            raise CommandError("INVALID_ARGUMENT", f"--plot {plot}: its directory does not "
                               f"exist")
    swf = SwfMapping(resource=args.swf_resource or "cpu",
                     per_processor=_qty(args.swf_per_proc or "1"), queue=args.swf_queue)
    if fmt == "swf":
        _check_swf_flags(cfg, swf, args)
    trace = load_trace(args.trace, fmt=args.format, swf=swf)
    nodes = not args.no_nodes
    prepared = prepare(cfg, trace.jobs, skip_unfit=args.skip_unfit, nodes=nodes)
    if not prepared.jobs:
        # --skip-unfit dropped every job: a table of zeros would read as a result.
        job, why = prepared.unfit[0]
        raise CommandError("INVALID_TRACE", f"{trace.source}: none of its {len(trace.jobs)} "
                           f"jobs can ever run on {_shown(cfg.source)} (--skip-unfit dropped "
                           f"them all; first: {job.where}: {why})")
    results = [simulate(cfg, trace.jobs, policy, resource=args.resource,
                        series=bool(args.plot), prepared=prepared, nodes=nodes)
               for policy in policies]
    node_columns = any(r.nodes for r in results)
    jobs = prepared.jobs
    span = (max(j.submit for j in jobs) - min(j.submit for j in jobs)) if jobs else 0.0
    gangs = sum(j.n_pods > 1 for j in jobs)
    if args.json:
        out = {
            "trace": trace.source, "config": cfg.source, "jobs": len(jobs), "gangs": gangs,
            "skipped": trace.skipped, "skipped_reasons": trace.skipped_reasons,
            "unfit": len(prepared.unfit), "submission_span_s": span,
            "node_model": _node_model(cfg, nodes),
            "policies": {r.policy: r.to_dict() for r in results},
        }
        print(json.dumps(out, indent=2))
    else:
        resource = results[0].resource if results else "-"
        print(f"trace {trace.source}: {len(jobs)} jobs ({gangs} gangs) submitted over "
              f"{_duration(span)} of virtual time; config {_shown(cfg.source)}")
        if trace.skipped:
            why = ", ".join(f"{n} {r}" for r, n in sorted(trace.skipped_reasons.items()))
            print(f"skipped {trace.skipped} SWF jobs ({why})")
        if prepared.unfit:
            print(f"dropped {len(prepared.unfit)} jobs that can never run "
                  f"(first: {prepared.unfit[0][0].where}: {prepared.unfit[0][1]})")
        print(f"utilisation: {resource} in use / capacity, first to last submission; "
              f"waits: submit to start")
        print(_node_model(cfg, nodes))
        if node_columns:
            print(f"pended: started jobs that waited for nodes after assignment; pend mean, "
                  f"p95, max: assignment to start, over started jobs; pend held: {resource} "
                  f"charged to pending jobs (admitted, not placed) / capacity")
        print()
        print(_table([_row(r, node_columns) for r in results], node_columns))
        if results:
            ticks = ", ".join(f"{r.policy} {r.ticks} ticks in {r.wall_s:.2f}s" for r in results)
            print(f"\nreal engine tick on a virtual clock: {ticks}")
    if args.plot and results:
        try:
            _plot(results, args.plot, trace.source)
        except OSError as exc:
            raise CommandError("INVALID_ARGUMENT", f"--plot {args.plot}: cannot write it: "
                               f"{exc.strerror or exc}") from None
        except ImportError:
            print("leasehold: UNAVAILABLE: --plot needs matplotlib: install it with "
                  "`pip install matplotlib` (or `pip install -e '.[test]'` in a checkout)",
                  file=sys.stderr)
            return 2
        if not args.json:
            print(f"plot: {args.plot}")
    return 0 if results else 2


def _flyte_decode(args):
    """Decode one serialised flyteidl2 enqueue message and print the action it becomes."""
    try:
        from engine.flyte import flyte_action
    except ImportError as exc:
        print(f"leasehold: UNAVAILABLE: {exc}", file=sys.stderr)
        return 2
    from engine._model import compile_spec

    cfg = load_config(args.config)
    try:
        raw = Path(args.file).read_bytes()
    except OSError as exc:
        print(f"leasehold: INVALID_ARGUMENT: cannot read {args.file}: {exc.strerror}",
              file=sys.stderr)
        return 2
    if not raw:
        # (An empty message decodes, to "the request carries no task action".)
        print(f"leasehold: INVALID_ARGUMENT: {empty_file(args.file)}", file=sys.stderr)
        return 2
    kinds = ("queue", "actions") if args.kind == "auto" else (args.kind,)
    first = None
    for kind in kinds:
        try:
            fa = flyte_action(raw, resources=cfg.resources, kind=kind)
            break
        except LeaseholdError as exc:
            first = first or exc
    else:
        raise first
    c = compile_spec(fa.spec, cfg.resources, {q.name for q in cfg.queues},
                     cfg.engine.default_queue)
    spec = fa.spec
    out = {
        "id": str(c.id), "task": spec.task, "parent": spec.parent,
        "environment": spec.environment, "image": spec.image, "queue": c.queue,
        "task_queue": spec.task_queue, "run_queue": spec.run_queue,
        "resources": spec.resources,
        "pods": None if spec.pods is None else [
            {"role": g.role, "replicas": g.replicas, "resources": g.resources}
            for g in spec.pods],
        "demand": cfg.resources.describe(c.demand),
        "reuse": None if spec.reuse is None else vars(spec.reuse),
        "environment_key": c.env_key,
        "retries": vars(spec.retries), "timeouts": vars(spec.timeouts),
        "run_max_action_concurrency": spec.run_max_action_concurrency,
        "input_uri": fa.input_uri,
    }
    print(json.dumps(out, indent=2))
    return 0


def _shown(path):
    """``path`` relative to the working directory when it is under it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _qty(text):
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def _plot(results, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_q, ax_u) = plt.subplots(2, 1, sharex=True, figsize=(10, 6.5))
    for r in results:
        s = r.series
        hours = [t / 3600 for t in s["t_s"]]
        ax_q.step(hours, s["queued"], where="post", label=r.policy, linewidth=1)
        util = [float("nan") if u is None else 100 * u for u in s["utilization"]]
        ax_u.step(hours, util, where="post", label=r.policy, linewidth=1)
    ax_q.set_ylabel("jobs queued")
    ax_q.set_title(f"{Path(title).name}: queue depth and {results[0].resource} utilisation")
    ax_q.legend()
    ax_u.set_ylabel(f"{results[0].resource} in use (%)")
    ax_u.set_xlabel("virtual time (hours)")
    ax_u.set_ylim(0, 105)
    ax_u.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _keys_generate(args):
    """Write a CURVE key pair and print the config lines that go with it."""
    generate_keypair = load("transport", "generate_keypair")  # no ZeroMQ for the others

    if not re.fullmatch(r"[A-Za-z0-9_.-]+", args.name):
        raise SpecError(f"--name {args.name!r}: a name of letters, digits, '_', '.', '-'")
    if args.role == "worker" and not args.cluster:
        raise SpecError("--role worker needs --cluster (a worker key is bound to one cluster)")
    if args.role == "client" and not args.tenant:
        raise SpecError("--role client needs --tenant (org, org/project or org/project/domain; "
                        "repeat for several)")
    if args.cluster and args.role != "worker":
        raise SpecError("--cluster is for --role worker only")
    if args.tenant and args.role != "client":
        raise SpecError("--tenant is for --role client only")
    # The rules of [security.peers] (engine/_config.py): the printed lines must load.
    if args.cluster and not _CLUSTER_NAME.match(args.cluster):
        raise SpecError(f"--cluster {args.cluster!r}: a cluster name of letters, digits, '_', "
                        f"'.', '-'")
    for t in args.tenant:
        if not _TENANT_PREFIX.match(t):
            raise SpecError(f"--tenant {t!r}: a tenant prefix org, org/project or "
                            f"org/project/domain")
    meta = {"role": args.role or "shard"}
    if args.cluster:
        meta["cluster"] = args.cluster
    if args.tenant:
        meta["tenants"] = ",".join(args.tenant)
    try:
        public, secret = generate_keypair(args.dir, args.name, metadata=meta, force=args.force)
    except ValueError as exc:
        raise SpecError(str(exc)) from None
    except OSError as exc:
        if exc.errno is None:       # the pair exists (without --force)
            raise SpecError(str(exc)) from None
        raise SpecError(f"--dir {args.dir}: cannot write the key pair there: "
                        f"{exc.strerror}") from None
    print(f"wrote {public} (public: give it to the other side) and {secret} (secret, mode 0600:"
          f" keep it where the key's owner runs)")
    print("# the shard's config:")
    if args.role is None:
        print(f'[security]\nkeys_dir = "{args.dir}"\nserver_key = "{args.name}"')
    else:
        print(f'[security.peers.{args.name}]\nrole = "{args.role}"')
        if args.cluster:
            print(f'cluster = "{args.cluster}"')
        if args.tenant:
            print("tenants = [" + ", ".join(f'"{t}"' for t in args.tenant) + "]")
    return 0


#: The largest count a flag takes (slots, ticks): far past any use, far inside 64 bits.
MAX_FLAG_COUNT = 1_000_000_000


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_FLAG_COUNT:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer from 1 to "
                                         f"{MAX_FLAG_COUNT}")
    return value


def _worker(args):
    """Run a cluster worker until SIGTERM (drain) or SIGINT (docs/worker.md)."""
    import logging

    run_worker = load("transport._daemon", "run_worker")

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s "
                        "%(message)s")
    try:
        return run_worker(args.config, args.cluster, name=args.name, slots=args.slots,
                          node=args.node)
    except OSError as exc:
        raise SpecError(f"worker: {exc}") from None


def _shard(args):
    """Serve one shard until SIGTERM/SIGINT (docs/shard.md)."""
    import logging

    run_shard = load("transport._shard", "run_shard")  # no ZeroMQ for the other commands

    cfg = load_config(args.config)
    eps = cfg.transport.endpoints
    if not 0 <= args.shard < len(eps):
        raise CommandError("INVALID_ARGUMENT", f"--shard {args.shard}: {cfg.source} has "
                           f"{len(eps)} endpoint(s) in transport.endpoints (0..{len(eps) - 1})")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s "
                        "%(message)s")
    try:
        return run_shard(cfg, args.shard)
    except OSError as exc:
        raise SpecError(f"shard {args.shard}: {exc}") from None


def _serve(args):
    """Run the supervisor until SIGTERM/SIGINT (docs/operations.md)."""
    import logging

    run_supervisor = load("transport._supervisor", "run_supervisor")

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s "
                        "%(message)s")
    try:
        return run_supervisor(args.config, start_timeout=args.start_timeout,
                              stop_timeout=args.stop_timeout)
    except OSError as exc:
        raise SpecError(f"serve: {exc}") from None


def _devbox(args):
    """A supervisor, its shards and a local worker, then the example workload
    (docs/devbox.md)."""
    run_devbox = load("transport._devbox", "run_devbox")

    return run_devbox(args.dir, workload=None if args.no_workload else args.workload,
                      keep=args.keep)


def main(argv=None):
    """Parse ``argv`` and run its command (called by the entry point, ``engine.cli.main``)."""
    parser = argparse.ArgumentParser(prog="leasehold",
                                     description="The ``leasehold`` command line.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check-config", help="validate a config file and summarise it")
    p.add_argument("config", nargs="?", default=str(EXAMPLE_CONFIG))
    p.set_defaults(func=_check_config)
    p = sub.add_parser("demo", help="run a small workload through the real tick and explain it")
    p.add_argument("--config", default=str(EXAMPLE_CONFIG))
    p.add_argument("--ticks", type=_positive_int, default=2)
    p.set_defaults(func=_demo)
    p = sub.add_parser("simulate", help="run a workload trace through the real tick on a "
                       "virtual clock and compare scheduling policies")
    p.add_argument("trace", help="a .jsonl trace (docs/simulator.md) or an SWF .swf file")
    p.add_argument("--config", default=str(SIMULATE_CONFIG),
                   help="engine config (default: engine/examples/simulate.toml)")
    p.add_argument("--policy", default=",".join(POLICIES),
                   help=f"comma-separated, from {', '.join(POLICIES)} (default: all)")
    p.add_argument("--plot", metavar="PNG", help="write queue depth and utilisation over time")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--format", choices=("jsonl", "swf"),
                   help="trace format (default: .swf files are SWF, others JSON lines)")
    p.add_argument("--resource", help="utilisation on this resource (default: all gpu:*, "
                   "else cpu)")
    p.add_argument("--swf-resource",
                   help="SWF: the resource one processor asks for (default cpu)")
    p.add_argument("--swf-per-proc",
                   help="SWF: quantity of --swf-resource per processor (default 1)")
    p.add_argument("--swf-queue", help="SWF: queue of every job (default: the default queue)")
    p.add_argument("--skip-unfit", action="store_true",
                   help="drop (and count) jobs no cluster of their queue can ever hold")
    p.add_argument("--no-nodes", action="store_true",
                   help="do not place pods on nodes: an assigned action starts at once "
                   "(the engine's view, for comparison)")
    p.set_defaults(func=_simulate)
    p = sub.add_parser("flyte-decode", help="print the action a serialised Flyte 2 enqueue "
                       "message becomes (docs/flyte.md; needs leasehold[flyte])")
    p.add_argument("file", help="a serialised flyteidl2 EnqueueActionRequest (queue service) "
                   "or EnqueueRequest (actions service)")
    p.add_argument("--kind", choices=("auto", "queue", "actions"), default="auto",
                   help="which message the file holds (default: try queue, then actions)")
    p.add_argument("--config", default=str(EXAMPLE_CONFIG),
                   help="engine config whose resources and queues it is checked against")
    p.set_defaults(func=_flyte_decode)
    p = sub.add_parser("shard", help="serve one shard over ZeroMQ until SIGTERM/SIGINT "
                       "(docs/shard.md)")
    p.add_argument("--config", required=True, help="the config file")
    p.add_argument("--shard", type=int, default=0,
                   help="shard index: binds transport.endpoints[N] (default 0)")
    p.set_defaults(func=_shard)
    p = sub.add_parser("worker", help="run a cluster worker: dial every shard, run leases "
                       "through plugins until SIGTERM (drain) or SIGINT (docs/worker.md)")
    p.add_argument("--config", required=True, help="the config file (endpoints, keys, [worker])")
    p.add_argument("--cluster", required=True, help="the cluster this worker serves")
    p.add_argument("--slots", type=_positive_int, help="leases held at once (default: "
                   "worker.slots, else the CPU count)")
    p.add_argument("--name", help="the worker id: its key's name or NAME.<suffix> (default: "
                   "the first worker key of the cluster in [security.peers])")
    p.add_argument("--node", help="the node of the cluster (admission = \"nodes\") this "
                   "worker is: its heartbeats report its free capacity as that node's")
    p.set_defaults(func=_worker)
    p = sub.add_parser("serve", help="the supervisor: one pinned shard process per endpoint, "
                       "restarted when it dies, metrics; until SIGTERM/SIGINT "
                       "(docs/operations.md)")
    p.add_argument("--config", required=True, help="the config file")
    p.add_argument("--start-timeout", type=positive_seconds,
                   help="seconds a shard may take to serve after its start (default: "
                   "supervisor.start_timeout, 60)")
    p.add_argument("--stop-timeout", type=positive_seconds,
                   help="seconds the shards get after SIGTERM before SIGKILL (default: "
                   "supervisor.stop_timeout, 15)")
    p.set_defaults(func=_serve)
    p = sub.add_parser("devbox", help="a local engine (supervisor, shard, worker) on a fresh "
                       "directory, running the bundled example workload (docs/devbox.md)")
    p.add_argument("--dir", help="the directory for config, keys, data and logs (default: a "
                   "new temporary directory, removed afterwards)")
    wl = p.add_mutually_exclusive_group()
    wl.add_argument("--workload", default="example",
                    help="the bundled workload to run (default: example)")
    wl.add_argument("--no-workload", action="store_true",
                    help="start everything, print how to reach it, serve until Ctrl-C")
    p.add_argument("--keep", action="store_true",
                   help="keep the temporary directory (its path is printed)")
    p.set_defaults(func=_devbox)
    p = sub.add_parser("keys", help="CURVE keys (docs/security.md)")
    keys = p.add_subparsers(dest="keys_command", required=True)
    p = keys.add_parser("generate", help="write a key pair NAME.key / NAME.key_secret")
    p.add_argument("--dir", required=True, help="the keys directory (created 0700)")
    p.add_argument("--name", required=True, help="the key's name (its config table name)")
    p.add_argument("--role", choices=("worker", "client", "admin"),
                   help="what the key may do; omit for the shard's own key")
    p.add_argument("--cluster", help="worker: the one cluster it serves")
    p.add_argument("--tenant", action="append", default=[],
                   help="client: a tenant prefix it may act for (repeatable)")
    p.add_argument("--force", action="store_true", help="replace an existing pair")
    p.set_defaults(func=_keys_generate)
    register_commands(sub)      # config check, submit, status, explain, abort, top, watch, queue
    args = parser.parse_args(argv)
    # Every command behind the user commands' guard: an error is one line
    # ``leasehold: CODE: message`` and its exit code, Ctrl-C is 130, never a traceback.
    return guard(args.func)(args)
