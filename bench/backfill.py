"""Backfill benchmark: one seeded trace of gangs and small actions under load, run through the
simulator (the real Engine tick on a virtual clock) under the fifo, backfill and greedy
policies. Prints ONE JSON object.

The model (everything drawn from one ``random.Random(seed)``):

* **Cluster**: ``engine/examples/simulate.toml``: one cluster, 16 nodes of 8 H100 (96 cpu,
  1000Gi each) and 8 cpu nodes (96 cpu, 384Gi each): 128 GPUs, 2304 cpu. One queue, so gangs
  and small work compete for one FIFO.
* **Arrivals**: a non-homogeneous Poisson process with a daily cycle,
  ``rate(t) = mean_rate * (1 + 0.6 * sin(2 pi t / 1 day - pi / 2))`` (quiet at midnight, peak
  at noon), drawn by thinning. ``mean_rate`` is set so the offered GPU load is ``LOAD`` (0.85)
  of the 128 GPUs averaged over a day; 7 days by default.
* **Job classes**: 8% gangs of 2-8 pods x 8 H100 (``train-<n>x8``; runtime lognormal, median
  1 h, sigma 0.8, capped at 12 h); 27% small GPU actions, one pod of 1, 2 or 4 H100
  (``finetune-<g>``; lognormal, median 10 min, sigma 1.2, capped at 6 h); 65% CPU actions of
  1-16 cpu (``etl-<c>``; lognormal, median 3 min, sigma 1.5, with a Pareto tail: 3% of them
  run ``10 min * Pareto(1.5)``, capped at 12 h). Task names repeat, so the engine has a
  runtime history per task to backfill on.
* **Metrics** are the simulator's (``docs/simulator.md``): utilisation of the GPUs between the
  first and the last submission, mean wait, mean bounded slowdown (10 s bound), longest wait
  of a gang, and how long assigned work pended for nodes. Pods are placed on the config's
  nodes (the simulator's node model); ``--no-nodes`` starts every assignment at once.

Goals (informational fields ``goal_*``): backfill cuts fifo's mean wait at least 10x, does not
lower utilisation, keeps the longest gang wait within 5% of fifo's and far below greedy's.
    .venv/bin/python bench/backfill.py [--seed N] [--days D] [--load L] [--no-nodes]
"""

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "bench"):       # bench/ too when imported as a module (tests)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from _harness import round_or_none  # noqa: E402

from engine._config import load_config  # noqa: E402
from engine._sim import prepare, simulate  # noqa: E402
from engine._trace import Job  # noqa: E402

POLICIES = ("fifo", "backfill", "greedy")
DAY = 86400.0
GPUS = 128
LOAD = 0.85
AMPLITUDE = 0.6
CLASSES = (("gang", 0.08), ("small_gpu", 0.27), ("cpu", 0.65))

# The cluster and queue: the simulator's bundled config (one source for both).
CONFIG_PATH = ROOT / "engine" / "examples" / "simulate.toml"


def _lognormal(rng, median, sigma, cap):
    return min(cap, max(1.0, rng.lognormvariate(math.log(median), sigma)))


def _job(rng, kind):
    if kind == "gang":
        n = rng.choice((2, 2, 3, 4, 4, 6, 8))
        runtime = _lognormal(rng, 3600, 0.8, 12 * 3600)
        return f"train-{n}x8", runtime, ((n, {"cpu": 64, "memory": "512Gi", "gpu:H100": 8}),)
    if kind == "small_gpu":
        g = rng.choice((1, 1, 2, 4))
        runtime = _lognormal(rng, 600, 1.2, 6 * 3600)
        return f"finetune-{g}", runtime, ((1, {"cpu": 8 * g, "memory": f"{64 * g}Gi",
                                               "gpu:H100": g}),)
    c = rng.choice((1, 2, 4, 8, 16))
    if rng.random() < 0.03:
        runtime = min(12 * 3600, 600 * rng.paretovariate(1.5))
    else:
        runtime = _lognormal(rng, 180, 1.5, 12 * 3600)
    return f"etl-{c}", runtime, ((1, {"cpu": c, "memory": f"{4 * c}Gi"}),)


def _mean_gpu_seconds(rng, samples=20000):
    total = 0.0
    for _ in range(samples):
        kind = rng.choices([k for k, _ in CLASSES], [w for _, w in CLASSES])[0]
        _, runtime, pods = _job(rng, kind)
        total += runtime * sum(n * r.get("gpu:H100", 0) for n, r in pods)
    return total / samples


def generate(seed, days, load=LOAD):
    """The trace: a list of Jobs, sorted by submission."""
    rng = random.Random(seed)
    mean_rate = load * GPUS / _mean_gpu_seconds(random.Random(seed + 1))   # jobs per second
    peak = mean_rate * (1 + AMPLITUDE)
    jobs, t = [], 0.0
    kinds, weights = [k for k, _ in CLASSES], [w for _, w in CLASSES]
    while True:
        t += rng.expovariate(peak)
        if t >= days * DAY:
            break
        rate = mean_rate * (1 + AMPLITUDE * math.sin(2 * math.pi * t / DAY - math.pi / 2))
        if rng.random() * peak > rate:
            continue
        task, runtime, pods = _job(rng, rng.choices(kinds, weights)[0])
        jobs.append(Job(id=str(len(jobs)), submit=round(t, 3), runtime=round(runtime, 3),
                        pods=pods, task=task, where=f"bench:{len(jobs)}"))
    return jobs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--days", type=float, default=7.0)
    parser.add_argument("--load", type=float, default=LOAD,
                        help="offered GPU load (default 0.85; near 1 the queue runs deep)")
    parser.add_argument("--no-nodes", action="store_true",
                        help="start assigned work at once (no pods placed on nodes)")
    args = parser.parse_args(argv)
    nodes = not args.no_nodes
    wall0 = time.perf_counter()
    cfg = load_config(CONFIG_PATH)
    jobs = generate(args.seed, args.days, args.load)
    prepared = prepare(cfg, jobs, nodes=nodes)
    out = {"bench": "backfill", "seed": args.seed, "days": args.days, "jobs": len(jobs),
           "gangs": sum(j.n_pods > 1 for j in jobs), "target_gpu_load": args.load,
           "nodes": nodes}
    results = {}
    for policy in POLICIES:
        r = results[policy] = simulate(cfg, jobs, policy, prepared=prepared, nodes=nodes)
        out[f"utilization_{policy}"] = round_or_none(r.utilization, 4)
        out[f"mean_wait_{policy}_s"] = round_or_none(r.mean_wait_s, 1)
        out[f"p95_wait_{policy}_s"] = round_or_none(r.p95_wait_s, 1)
        out[f"bounded_slowdown_{policy}"] = round_or_none(r.bounded_slowdown, 2)
        out[f"gang_max_wait_{policy}_s"] = round_or_none(r.gang_max_wait_s, 1)
        out[f"completed_{policy}"] = r.completed
        out[f"backfilled_{policy}"] = r.backfilled
        out[f"pended_{policy}"] = r.pended                    # None without nodes
        out[f"pend_mean_{policy}_s"] = round_or_none(r.pend_mean_s, 1)
        out[f"pend_max_{policy}_s"] = round_or_none(r.pend_max_s, 1)
        out[f"pend_held_{policy}"] = round_or_none(r.pend_held, 4)
        out[f"sim_wall_{policy}_s"] = round_or_none(r.wall_s, 2)
    fifo, bf, greedy = results["fifo"], results["backfill"], results["greedy"]
    out["goal_mean_wait_cut_10x"] = bool(bf.mean_wait_s * 10 <= fifo.mean_wait_s)
    out["goal_utilization_not_lower"] = bool(bf.utilization >= fifo.utilization)
    out["goal_gang_wait_within_5pct_of_fifo"] = bool(
        bf.gang_max_wait_s <= 1.05 * fifo.gang_max_wait_s)
    # "Far below": at most half of greedy's longest gang wait.
    out["goal_gang_wait_far_below_greedy"] = bool(bf.gang_max_wait_s * 2 <= greedy.gang_max_wait_s)
    out["wall_s"] = round(time.perf_counter() - wall0, 2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
