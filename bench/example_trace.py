"""Generate ``engine/examples/trace.jsonl``, the bundled trace of ``make simulate`` (seeded).

One virtual day of the workload model of ``bench/backfill.py`` (its docstring describes it)
for ``engine/examples/simulate.toml``: gangs of 2-8 pods x 8 H100, single-pod GPU fine-tunes
and CPU steps with a long tail, arriving on a daily cycle at 85% of the GPUs on average.

    .venv/bin/python bench/example_trace.py > engine/examples/trace.jsonl
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.backfill import generate  # noqa: E402

SEED = 1
DAYS = 1.0


def jobs(seed=SEED, days=DAYS):
    """The trace as JSON-lines objects (the format of docs/simulator.md)."""
    out = []
    for job in generate(seed, days):
        out.append({"submit": job.submit, "runtime": job.runtime, "queue": "main",
                    "task": job.task, "id": int(job.id),
                    "pods": [{"count": n, "resources": res} for n, res in job.pods]})
    return out


def main():
    for job in jobs():
        sys.stdout.write(json.dumps(job, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
