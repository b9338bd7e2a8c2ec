"""The ``leasehold`` command line."""

import argparse
import json
import sys
from pathlib import Path

from engine._clock import ManualClock
from engine._config import load_config
from engine._engine import Engine
from engine._errors import LeaseholdError
from engine._model import ActionSpec, PodGroup, ReusePolicy
from engine._units import format_quantity

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
    eng = Engine(cfg, clock=clock)
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
    for t in range(args.ticks):
        placed = eng.tick()
        print(f"tick {t + 1}: {len(placed)} assigned")
        for a in placed:
            print(f"  {a.action} -> {a.cluster}/{a.worker} (generation {a.generation})")
        clock.advance(1)
    print("waiting:")
    for s in specs:
        exp = eng.explain(s.id)
        if exp.wait is not None:
            print(f"  {s.id}: {exp.phase}: {exp.reason}")
    print("queues:")
    print(json.dumps(eng.queue_metrics(), indent=2))
    return 0


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
