"""Flyte 2 enqueues decoded and enqueued: prints ONE JSON object.

* ``flyte_decode_per_s``: serialised queue-service ``EnqueueActionRequest`` s turned into
  enqueued actions per second, same-task fan-out: ``RUNS`` runs, each a root action (with its
  ``RunSpec``: the run's queue) and ``FANOUT`` children of it that share one ``TaskAction`` (a
  GPU task built and serialised with the flyte SDK: requests, accelerator, retries with
  backoff, the three timeouts, its environment's queue) and differ in their action names and
  input references. Each run's bytes go through ``engine.flyte.enqueue_flyte`` as a client
  batch would arrive: parse, check every field, derive the spec (the ``TaskAction``'s part is
  cached by its bytes), group, ``enqueue_fanout`` (compile, admission checks, one group
  commit over the real ``LmdbStore`` with sync on). Wall time from the first byte decoded to
  the last commit returned; the median of ``REPEATS`` runs, each on a fresh store, is
  reported and every run is listed in ``runs``.
* ``decode_only_per_s``: the decode alone (``flyte_fanouts``), same bytes, median.
* ``memory_store_per_s``: ``flyte_decode_per_s`` over the in-memory store (no disk).
* ``request_bytes``: the size of one child's serialised request.

Usage: ``python bench/flyte.py [--runs N] [--fanout N]``. Needs ``leasehold[flyte]``.
"""

import argparse
import json
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# This file is bench/flyte.py: with bench/ first on the path (as for any script) it would
# shadow the flyte SDK it measures.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import flyte  # noqa: E402
import flyte.extras  # noqa: E402
from flyte.models import SerializationContext  # noqa: E402
from flyteidl2.common import identifier_pb2  # noqa: E402
from flyteidl2.task import run_pb2, task_definition_pb2  # noqa: E402
from flyteidl2.workflow import queue_service_pb2, run_definition_pb2  # noqa: E402

from engine import Engine, ManualClock, parse_config  # noqa: E402
from engine.flyte import enqueue_flyte, flyte_fanouts  # noqa: E402
from storage import MemoryStore  # noqa: E402

RUNS = 100
FANOUT = 1000
REPEATS = 3

env = flyte.TaskEnvironment(name="trainer", queue="gpu",
                            resources=flyte.Resources(cpu=8, memory="64Gi", gpu="H100:8"))


@env.task(retries=flyte.RetryStrategy(count=3, backoff=flyte.Backoff(
    base=timedelta(seconds=5), factor=2.0, cap=timedelta(minutes=1))),
    timeout=flyte.Timeout(max_runtime=timedelta(minutes=30), max_queued_time=600,
                          deadline=timedelta(hours=2)))
async def train(shard: int) -> int:
    return shard


def config(path, n):
    cfg = {
        "resources": ["cpu", "memory", "ephemeral_storage", "gpu:H100"],
        "clusters": {"east": {}},
        "queues": {"gpu": {"depth": 4_000_000}, "batch": {"depth": 4_000_000}},
        "engine": {"default_queue": "batch", "initial_capacity": 1 << (n - 1).bit_length()},
    }
    if path is not None:
        cfg["storage"] = {"path": str(path), "partitions": 16, "map_size": "1Gi",
                          "max_map_size": "64Gi"}
    return cfg


def requests(runs, fanout):
    """Per run: the root's bytes and its children's, built as a Flyte client builds them."""
    spec = flyte.extras.serialize(train, SerializationContext(
        version="bench", org="acme", project="ml", domain="prod", root_dir=ROOT))
    tid = spec.task_template.id
    action = run_definition_pb2.TaskAction(
        id=task_definition_pb2.TaskIdentifier(org=tid.org, project=tid.project,
                                              domain=tid.domain, name=tid.name,
                                              version=tid.version),
        spec=spec, queue=train.queue)
    out = []
    for r in range(runs):
        run = identifier_pb2.RunIdentifier(org="acme", project="ml", domain="prod",
                                           name=f"run{r}")
        root = queue_service_pb2.EnqueueActionRequest(
            action_id=identifier_pb2.ActionIdentifier(run=run, name="a0"), task=action,
            run_spec=run_pb2.RunSpec(queue="gpu", max_action_concurrency=0),
            input_uri=f"s3://bucket/run{r}/a0/inputs.pb").SerializeToString()
        kids = [queue_service_pb2.EnqueueActionRequest(
            action_id=identifier_pb2.ActionIdentifier(run=run, name=f"m{i}"),
            parent_action_name="a0", task=action,
            input_uri=f"s3://bucket/run{r}/m{i}/inputs.pb",
            run_output_base=f"s3://bucket/run{r}").SerializeToString()
            for i in range(fanout)]
        out.append((root, kids))
    return out


def enqueue(batches, path):
    n = sum(1 + len(kids) for _root, kids in batches)
    store = MemoryStore() if path is None else None
    eng = Engine(parse_config(config(path, n), source="<bench>"),
                 clock=ManualClock(time.time_ns()), store=store)
    t0 = time.perf_counter()
    done = 0
    for root, kids in batches:
        done += len(enqueue_flyte(eng, [root]))
        done += len(enqueue_flyte(eng, kids))
    elapsed = time.perf_counter() - t0
    rows = eng.inspect().action_rows
    eng.close()
    if done != n or rows != n:
        raise SystemExit(f"{done} ids, {rows} rows for {n} requests")
    return n / elapsed


def decode_only(batches):
    n = sum(1 + len(kids) for _root, kids in batches)
    cfg = parse_config(config(None, n), source="<bench>")
    t0 = time.perf_counter()
    for root, kids in batches:
        flyte_fanouts([root], resources=cfg.resources)
        flyte_fanouts(kids, resources=cfg.resources)
    return n / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=RUNS)
    ap.add_argument("--fanout", type=int, default=FANOUT)
    args = ap.parse_args()
    batches = requests(args.runs, args.fanout)
    runs, memory, decode = [], [], []
    for _ in range(REPEATS):
        tmp = pathlib.Path(tempfile.mkdtemp(prefix="leasehold-flyte-bench-"))
        try:
            runs.append(enqueue(batches, tmp / "store"))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        memory.append(enqueue(batches, None))
        decode.append(decode_only(batches))
    print(json.dumps({
        "flyte_decode_per_s": round(statistics.median(runs)),
        "runs": [round(r) for r in runs],
        "decode_only_per_s": round(statistics.median(decode)),
        "memory_store_per_s": round(statistics.median(memory)),
        "requests": sum(1 + len(k) for _r, k in batches),
        "request_bytes": len(batches[0][1][0]),
        "flyte": flyte.version(),
    }))


if __name__ == "__main__":
    main()
