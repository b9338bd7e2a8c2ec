"""The ``leasehold`` command line."""

import argparse
import json
import sys
from pathlib import Path

from engine._clock import ManualClock
from engine._codes import LeaseKind, Phase
from engine._config import load_config
from engine._engine import Engine
from engine._errors import LeaseholdError
from engine._model import ActionSpec, PodGroup, ReusePolicy
from engine._units import format_quantity
from storage import MemoryStore

__all__ = ["main"]

EXAMPLE_CONFIG = Path(__file__).parent / "examples" / "leasehold.toml"


def _check_config(args):
    cfg = load_config(args.config)
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


def main(argv=None):
    """Entry point of the ``leasehold`` console script."""
    parser = argparse.ArgumentParser(prog="leasehold", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check-config", help="validate a config file and summarise it")
    p.add_argument("config", nargs="?", default=str(EXAMPLE_CONFIG))
    p.set_defaults(func=_check_config)
    p = sub.add_parser("demo", help="run a small workload through the real tick and explain it")
    p.add_argument("--config", default=str(EXAMPLE_CONFIG))
    p.add_argument("--ticks", type=int, default=2)
    p.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except LeaseholdError as exc:
        print(f"leasehold: {exc.code}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
