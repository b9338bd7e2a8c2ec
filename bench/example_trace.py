"""Generate ``engine/examples/trace.jsonl``, the bundled trace of ``make run`` (seeded).

Written for ``engine/examples/leasehold.toml`` (queues ``gpu``, ``batch``, ``interactive``;
H100 nodes on ``east``, A100 nodes on ``west``). Over three virtual hours:

* ``gpu``: gangs of 2-3 pods x 8 H100 (or 2 x 8 A100), 15-45 minutes; between them many
  single pods of 1-4 GPUs for 2-15 minutes. The queue's H100 budget is 24, so a 3-pod gang
  needs the whole budget: STRICT_FIFO holds the small GPU work behind it, GREEDY_CAPACITY lets
  the small work pass and the gang waits.
* ``batch``: CPU steps, lognormal runtimes (median ~2 minutes) with a long tail to 2 hours.
* ``interactive``: short CPU calls of 10-60 seconds.

    .venv/bin/python bench/example_trace.py > engine/examples/trace.jsonl
"""

import json
import math
import random
import sys

SEED = 12
HOURS = 3.0


def jobs(seed=SEED, hours=HOURS):
    rng = random.Random(seed)
    span = hours * 3600
    out = []

    def add(submit, runtime, queue, task, pods):
        out.append({"submit": round(submit, 1), "runtime": round(runtime, 1), "queue": queue,
                    "task": task, "pods": pods})

    h100 = {"cpu": 32, "memory": "256Gi", "gpu:H100": 8}
    a100 = {"cpu": 32, "memory": "256Gi", "gpu:A100": 8}
    for _ in range(9):
        t = rng.uniform(0, span)
        if rng.random() < 0.25:
            add(t, rng.uniform(900, 2700), "gpu", "train-a100", [{"count": 2, "resources": a100}])
        else:
            n = rng.choice((2, 3, 3))
            add(t, rng.uniform(900, 2700), "gpu", f"train-h100x{n}",
                [{"count": n, "resources": h100}])
    for _ in range(90):
        t = rng.uniform(0, span)
        g = rng.choice((1, 1, 2, 4))
        kind = "gpu:H100" if rng.random() < 0.7 else "gpu:A100"
        add(t, rng.uniform(120, 900), "gpu", f"finetune-{kind[4:].lower()}-{g}",
            [{"count": 1, "resources": {"cpu": 4 * g, "memory": f"{32 * g}Gi", kind: g}}])
    for _ in range(220):
        t = rng.uniform(0, span)
        runtime = min(7200.0, max(5.0, rng.lognormvariate(math.log(120), 1.2)))
        c = rng.choice((1, 2, 4, 8, 16))
        add(t, runtime, "batch", f"etl-{c}", [{"count": 1, "resources": {
            "cpu": c, "memory": f"{4 * c}Gi"}}])
    for _ in range(60):
        t = rng.uniform(0, span)
        add(t, rng.uniform(10, 60), "interactive", "chat",
            [{"count": 1, "resources": {"cpu": 2, "memory": "8Gi"}}])
    out.sort(key=lambda j: j["submit"])
    for i, job in enumerate(out):
        job["id"] = i
    return out


def main():
    for job in jobs():
        sys.stdout.write(json.dumps(job, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
