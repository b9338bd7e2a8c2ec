"""ETA projection benchmark (issue 14, item 6): prints ONE JSON object on stdout.

    .venv/bin/python bench/eta.py [--queued 100000] [--samples 7] [--seed 1]

The projection (``cext/_eta.pyx``, docs/architecture.md "ETA projection") over a deep
backlog: two clusters of 16 nodes of 8 GPUs, a queue of 1,000 runs of ``--queued / 1000``
actions each (1 to 8 GPUs, runtime estimates 1 min to 2 h), the capacity filled by live
leases placed by the real tick (each with its estimate, so every release is predicted).
Per scheduling policy (STRICT_FIFO with backfill, STRICT_FIFO, GREEDY_CAPACITY):

* ``project_ms_{policy}``: median CPU time (``time.process_time``) of one projection
  (``Inspection.project``: the Cython walk, uncached, of the first ``engine.eta_horizon``
  queued actions, default 10,000, and the copies of its per-row answers).
* ``explain_first_ms_{policy}``: ``Engine.explain`` of the last action enqueued (past the
  horizon) right after a tick (the projection plus explain's own position count);
  ``explain_cached_ms_{policy}``: the same again on the unchanged state (the projection is
  reused).
* ``queued_{policy}``: queued actions (the queue's depth); ``walked_{policy}``: those the
  projection walked; ``with_eta_share_{policy}``: the share of the queued ones with an ETA.
"""

import argparse
import functools
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from engine import ActionSpec, Engine  # noqa: E402
from engine._clock import ManualClock  # noqa: E402
from engine._config import parse_config  # noqa: E402
from storage import MemoryStore  # noqa: E402

NODE = {"cpu": 96, "memory": "1Ti", "gpu:H100": 8}
RUNS = 1000


def config(scheduling, backfill, depth):
    return parse_config({
        "resources": ["cpu", "memory", "gpu:H100"],
        "clusters": {c: {"node_shapes": [{"name": "h100", "count": 16, "allocatable": NODE}]}
                     for c in ("east", "west")},
        "queues": {"gpu": {"scheduling": scheduling, "backfill": backfill,
                           "depth": depth + 1000}},
        "engine": {"default_queue": "gpu", "heartbeat_interval": 1e7,
                   "max_candidates": 1000},
    }, source="<bench/eta.py>")


def build(scheduling, backfill, queued, seed):
    rng = random.Random(seed)
    clock = ManualClock(0)
    eng = Engine(config(scheduling, backfill, queued), clock=clock, store=MemoryStore())
    for c in ("east", "west"):
        eng.register_worker(f"w-{c}", c, queued + 1000)
    per_run = max(1, queued // RUNS)
    specs = []
    for i in range(queued):
        run, k = divmod(i, per_run)
        specs.append(ActionSpec(id=f"acme/ml/prod/r{run}/a{k}", task=f"t{i % 50}",
                                resources={"cpu": 1, "gpu": rng.randint(1, 8)},
                                runtime_estimate=rng.uniform(60, 7200)))
    for lo in range(0, len(specs), 10_000):
        eng.enqueue_many(specs[lo:lo + 10_000])
    for a in eng.tick():       # the live leases: what fits now, with their estimates
        eng.mark_running(a.action, a.generation)
    clock.set_ns(30_000_000_000)
    eng.tick()
    return eng, specs[-1].id


def cpu_ms(fn):
    t = time.process_time()
    fn()
    return (time.process_time() - t) * 1e3


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queued", type=int, default=100_000)
    parser.add_argument("--samples", type=int, default=7)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    out = {"bench": "eta", "queued": args.queued, "samples": args.samples,
           "clock": "cpu (time.process_time)"}
    for policy, scheduling, backfill in (("backfill", "STRICT_FIFO", True),
                                         ("fifo", "STRICT_FIFO", False),
                                         ("greedy", "GREEDY_CAPACITY", False)):
        eng, last = build(scheduling, backfill, args.queued, args.seed)
        view = eng.inspect()
        eta, _why, order = view.project()
        queued = eng.queue_metrics("gpu")["depth"]
        out[f"queued_{policy}"] = queued
        out[f"walked_{policy}"] = int(order.size)
        out[f"live_{policy}"] = sum(len(x) for x in view.live_lists())
        out[f"with_eta_share_{policy}"] = round(
            float(np.count_nonzero(eta[order] != np.iinfo(np.int64).max)) / max(1, queued), 4)
        out[f"project_ms_{policy}"] = round(statistics.median(
            cpu_ms(view.project) for _ in range(args.samples)), 2)
        eng.tick()
        explain = functools.partial(eng.explain, last)
        out[f"explain_first_ms_{policy}"] = round(cpu_ms(explain), 2)
        out[f"explain_cached_ms_{policy}"] = round(cpu_ms(explain), 2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
