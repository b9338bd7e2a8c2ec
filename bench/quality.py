"""Decision quality (issue 14): how close backfill on learned predictions comes to backfill
with exact runtimes, on a seeded trace model in which runtimes depend on the task. Prints ONE
JSON object.

The model (``generate``; everything drawn from one ``random.Random(seed)``):

* **Clusters and queues**: ``bench/quality.toml``: ``east`` (8 nodes of 8 H100, 8 nodes of
  96 cpu) and ``west`` (6 nodes of 8 H100, 12 nodes of 64 cpu), 112 GPUs; queues by team,
  each open to both clusters: ``prod`` (priority 300), ``research`` (200), ``batch`` (100).
* **Tasks**: ``TASKS`` (80) tasks of Zipf popularity (weight ``1 / rank^1.1``). Each has a
  class (10% gangs of 2-6 pods of one whole 8-GPU node, 30% one pod of 1-8 GPUs, 60% one pod
  of 1-32 cpu), a queue (gangs: research; GPU work: prod or research; CPU work: prod,
  research or batch, 30/30/40), one or (30% of tasks) two resource shapes, the larger
  running 0.6x as long, and its own lognormal runtime: median log-uniform per class (gangs
  20 min-4 h, GPU 2 min-1 h, CPU 30 s-30 min), sigma uniform 0.2-1.2, capped at 12 h.
* **Arrivals**: Poisson, at the rate that offers ``LOAD`` (0.85) of the GPUs; ``DAYS`` (2).
* **Policies**: ``fifo`` (STRICT_FIFO), ``backfill`` (EASY, predictions learned from the
  history of each task and shape: the engine is told nothing), ``greedy``
  (GREEDY_CAPACITY), and ``backfill_exact`` (EASY with every job's exact runtime given as its
  ``runtime_estimate``). Pods are placed on the nodes (the simulator's node model).
* **Metrics** per policy (``docs/simulator.md``): mean and p95 wait, mean bounded slowdown
  (10 s bound), longest gang wait, GPU utilisation, jobs completed; and the issue's ratios:
  ``backfill_learned_vs_exact_mean_wait`` (goal <= 1.15), ``backfill_vs_greedy_mean_wait``
  (goal <= 1.5), ``backfill_vs_fifo_gang_max_wait`` (goal <= 1.05), each with a ``goal_*``
  flag. Printed as measured, met or not.
* **ETAs** (issue 14, item 6): every job's projected start (``Engine.projected_start``),
  taken when it is enqueued, against its actual start: ``eta_abs_error_p50_s`` and
  ``eta_abs_error_p90_s`` (|start - ETA|, seconds), ``eta_coverage`` (the share of started
  jobs that got an ETA) for ``backfill``; the same per policy as ``eta_*_{policy}``, with
  the error over the jobs projected to wait (``eta_abs_error_waiting_p50/p90``) and the
  shares that started late or early (by more than 1 s).

    .venv/bin/python bench/quality.py [--seed N] [--days D] [--admission shapes|nodes]
                                      [--oracle]

``--oracle`` adds the bound on what any predictor that learns from history can reach here.
In this model a job's runtime is drawn independently from its task-and-shape law, so nothing
in the history of a key says more about its next job than the law itself. Backfill is run
again with every job's estimate set from its own key's *true* law: its mean
(``oracle_mean``: of the runtime as capped, computed exactly) and its quantiles 0.5 to 0.9
(``oracle_q50`` ... ``oracle_q90``). Per oracle: ``mean_wait_oracle_<law>_s``,
``gang_max_wait_oracle_<law>_s``, ``oracle_<law>_vs_exact_mean_wait``,
``oracle_<law>_vs_greedy_mean_wait`` and ``oracle_<law>_vs_fifo_gang_max_wait``; then
``oracle_best_vs_exact_mean_wait`` and ``oracle_best_vs_greedy_mean_wait`` (the best law for
each). About 5 x 2-10 s more.

``--admission nodes`` sets every cluster's ``admission = "nodes"``: the engine itself places
pods on nodes (nothing it admits pends in the node model) and backfill reserves nodes.
"""

import argparse
import json
import math
import random
import sys
import time
import tomllib
from dataclasses import replace
from pathlib import Path
from statistics import NormalDist

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "bench"):       # bench/ too when imported as a module (tests)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from _harness import round_or_none  # noqa: E402

from engine._config import parse_config  # noqa: E402
from engine._sim import prepare, simulate  # noqa: E402
from engine._trace import Job  # noqa: E402

CONFIG_PATH = ROOT / "bench" / "quality.toml"
TASKS = 80
ZIPF = 1.1
LOAD = 0.85
GPUS = 112
DAYS = 2.0
CAP_S = 12 * 3600
CLASSES = (("gang", 0.10), ("gpu", 0.30), ("cpu", 0.60))
MEDIANS = {"gang": (1200, 4 * 3600), "gpu": (120, 3600), "cpu": (30, 1800)}
# Each task's queue, by class: (queue, weight).
QUEUES = {"gang": (("research", 1.0),), "gpu": (("prod", 0.5), ("research", 0.5)),
          "cpu": (("prod", 0.3), ("research", 0.3), ("batch", 0.4))}


def _shape(rng, kind):
    if kind == "gang":
        n = rng.choice((2, 2, 3, 4, 4, 6))
        return f"{n}x8", ((n, {"cpu": 64, "memory": "512Gi", "gpu:H100": 8}),)
    if kind == "gpu":
        g = rng.choice((1, 1, 2, 4, 8))
        return f"{g}gpu", ((1, {"cpu": 8 * g, "memory": f"{64 * g}Gi", "gpu:H100": g}),)
    c = rng.choice((1, 2, 4, 8, 16, 32))
    return f"{c}cpu", ((1, {"cpu": c, "memory": f"{4 * c}Gi"}),)


def tasks(rng):
    """The task catalogue: ``[(name, queue, weight, [(pods, runtime factor)], median,
    sigma)]``."""
    out = []
    kinds, weights = [k for k, _ in CLASSES], [w for _, w in CLASSES]
    for rank in range(1, TASKS + 1):
        kind = rng.choices(kinds, weights)[0]
        lo, hi = MEDIANS[kind]
        median = math.exp(rng.uniform(math.log(lo), math.log(hi)))
        sigma = rng.uniform(0.2, 1.2)
        label, pods = _shape(rng, kind)
        shapes = [(pods, 1.0)]
        if rng.random() < 0.3:
            label2, pods2 = _shape(rng, kind)
            if label2 != label:
                big = _gpus(pods2) + _cpus(pods2) > _gpus(pods) + _cpus(pods)
                shapes.append((pods2, 0.6 if big else 1 / 0.6))
        queue = rng.choices([q for q, _ in QUEUES[kind]], [w for _, w in QUEUES[kind]])[0]
        out.append((f"{kind}-{rank}", queue, 1 / rank ** ZIPF, shapes, median, sigma))
    return out


def _gpus(pods):
    return sum(n * r.get("gpu:H100", 0) for n, r in pods)


def _cpus(pods):
    return sum(n * r["cpu"] for n, r in pods)


def _draw(rng, catalogue, weights):
    """One job of the model: ``(task, queue, pods, runtime, law)``, its runtime drawn from
    its task-and-shape law ``(scale, sigma)``: ``scale * lognormal(0, sigma)`` clipped to
    1 s .. ``CAP_S``."""
    name, queue, _w, shapes, median, sigma = rng.choices(catalogue, weights)[0]
    pods, factor = rng.choice(shapes)
    runtime = min(CAP_S, max(1.0, factor * rng.lognormvariate(math.log(median), sigma)))
    return name, queue, pods, runtime, (factor * median, sigma)


_NORMAL = NormalDist()


def law_quantile(law, q):
    """Quantile ``q`` of a runtime law ``(scale, sigma)`` (as clipped to 1 s .. ``CAP_S``)."""
    scale, sigma = law
    return min(CAP_S, max(1.0, scale * math.exp(sigma * _NORMAL.inv_cdf(q))))


def law_mean(law):
    """The mean of a runtime law ``(scale, sigma)`` capped at ``CAP_S``, exactly:
    E[min(X, C)] = scale e^(s^2/2) Phi((ln(C/scale) - s^2) / s) + C (1 - Phi(ln(C/scale) / s)).
    (The 1 s floor is left out: below 1% of any task's mass here, and under 1 s of it.)"""
    scale, sigma = law
    z = math.log(CAP_S / scale) / sigma
    return (scale * math.exp(sigma * sigma / 2) * _NORMAL.cdf(z - sigma)
            + CAP_S * (1 - _NORMAL.cdf(z)))


#: The oracles of ``--oracle``: name -> estimate of a law.
ORACLES = {"mean": law_mean,
           **{f"q{round(q * 100)}": (lambda law, q=q: law_quantile(law, q))
              for q in (0.5, 0.6, 0.7, 0.8, 0.9)}}


def generate(seed, days, laws=None):
    """The trace: a list of Jobs sorted by submission (no runtime estimates). ``laws``: a
    list to which each job's runtime law ``(scale, sigma)`` is appended, in job order."""
    rng = random.Random(seed)
    catalogue = tasks(rng)
    weights = [t[2] for t in catalogue]
    # The offered load, measured on a sample of the model (the cap and the Zipf weights make
    # a closed form awkward): jobs per second so that GPU-seconds arrive at LOAD x GPUS.
    probe = random.Random(seed + 1)
    gpu_s = sum(_gpus(p) * r for _, _, p, r, _law in (_draw(probe, catalogue, weights)
                                                for _ in range(20000))) / 20000
    rate = LOAD * GPUS / gpu_s
    jobs, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= days * 86400:
            break
        name, queue, pods, runtime, law = _draw(rng, catalogue, weights)
        if laws is not None:
            laws.append(law)
        jobs.append(Job(id=str(len(jobs)), submit=round(t, 3), runtime=round(runtime, 3),
                        pods=pods, task=name, queue=queue, where=f"quality:{len(jobs)}"))
    return jobs


def _ratio(num, den):
    if num is None or den is None:
        return None
    if den == 0:
        return 1.0 if num == 0 else None
    return num / den


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--days", type=float, default=DAYS)
    parser.add_argument("--admission", choices=("shapes", "nodes"), default="shapes",
                        help="every cluster's admission (docs/nodes.md): 'nodes' places pods "
                             "on nodes in the engine too, backfill reserving nodes")
    parser.add_argument("--oracle", action="store_true",
                        help="also run backfill with estimates from each job's true runtime "
                             "law (its mean, quantiles 0.5-0.9): the bound for learned ones")
    args = parser.parse_args(argv)
    wall0 = time.perf_counter()
    data = tomllib.loads(CONFIG_PATH.read_text())
    for cluster in data["clusters"].values():
        cluster["admission"] = args.admission
    cfg = parse_config(data, source=str(CONFIG_PATH))
    laws = []
    jobs = generate(args.seed, args.days, laws)
    exact = [replace(j, estimate=j.runtime) for j in jobs]
    out = {"bench": "quality", "seed": args.seed, "days": args.days, "jobs": len(jobs),
           "tasks": len({j.task for j in jobs}), "gangs": sum(j.n_pods > 1 for j in jobs),
           "target_gpu_load": LOAD, "nodes": True, "admission": args.admission}
    results = {}
    for policy, trace in (("fifo", jobs), ("backfill", jobs), ("greedy", jobs),
                          ("backfill_exact", exact)):
        prepared = prepare(cfg, trace)
        engine_policy = "backfill" if policy == "backfill_exact" else policy
        r = results[policy] = simulate(cfg, trace, engine_policy, prepared=prepared,
                                       etas=True)
        out[f"mean_wait_{policy}_s"] = round_or_none(r.mean_wait_s, 1)
        out[f"p95_wait_{policy}_s"] = round_or_none(r.p95_wait_s, 1)
        out[f"bounded_slowdown_{policy}"] = round_or_none(r.bounded_slowdown, 2)
        out[f"gang_max_wait_{policy}_s"] = round_or_none(r.gang_max_wait_s, 1)
        out[f"utilization_{policy}"] = round_or_none(r.utilization, 4)
        out[f"completed_{policy}"] = r.completed
        out[f"backfilled_{policy}"] = r.backfilled
        for key in ("eta_coverage", "eta_late_share", "eta_early_share"):
            out[f"{key}_{policy}"] = round_or_none(getattr(r, key), 4)
        for key in ("eta_abs_error_p50", "eta_abs_error_p90", "eta_abs_error_waiting_p50",
                    "eta_abs_error_waiting_p90"):
            out[f"{key}_{policy}_s"] = round_or_none(getattr(r, f"{key}_s"), 1)
    learned, ex = results["backfill"], results["backfill_exact"]
    # The ETA figures (item 6): backfill on learned predictions.
    out["eta_abs_error_p50_s"] = round_or_none(learned.eta_abs_error_p50_s, 1)
    out["eta_abs_error_p90_s"] = round_or_none(learned.eta_abs_error_p90_s, 1)
    out["eta_coverage"] = round_or_none(learned.eta_coverage, 4)
    fifo, greedy = results["fifo"], results["greedy"]
    ratios = {
        "backfill_learned_vs_exact_mean_wait": (learned.mean_wait_s, ex.mean_wait_s, 1.15),
        "backfill_vs_greedy_mean_wait": (learned.mean_wait_s, greedy.mean_wait_s, 1.5),
        "backfill_vs_fifo_gang_max_wait": (learned.gang_max_wait_s, fifo.gang_max_wait_s, 1.05),
    }
    for name, (num, den, goal) in ratios.items():
        value = _ratio(num, den)
        out[name] = round_or_none(value, 3)
        out[f"goal_{name}"] = value is not None and value <= goal
    if args.oracle:
        best = {"exact": None, "greedy": None}
        for law_name, estimate in ORACLES.items():
            trace = [replace(j, estimate=round(estimate(law), 3))
                     for j, law in zip(jobs, laws, strict=True)]
            r = simulate(cfg, trace, "backfill", prepared=prepare(cfg, trace))
            key = f"oracle_{law_name}"
            out[f"mean_wait_{key}_s"] = round_or_none(r.mean_wait_s, 1)
            out[f"gang_max_wait_{key}_s"] = round_or_none(r.gang_max_wait_s, 1)
            for other, den in (("exact", ex.mean_wait_s), ("greedy", greedy.mean_wait_s)):
                value = _ratio(r.mean_wait_s, den)
                out[f"{key}_vs_{other}_mean_wait"] = round_or_none(value, 3)
                if value is not None and (best[other] is None or value < best[other]):
                    best[other] = value
            out[f"{key}_vs_fifo_gang_max_wait"] = round_or_none(
                _ratio(r.gang_max_wait_s, fifo.gang_max_wait_s), 3)
        out["oracle_best_vs_exact_mean_wait"] = round_or_none(best["exact"], 3)
        out["oracle_best_vs_greedy_mean_wait"] = round_or_none(best["greedy"], 3)
    out["wall_s"] = round(time.perf_counter() - wall0, 2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
