"""Status benchmark: prints ONE JSON object on stdout (nothing else).

    .venv/bin/python bench/status.py [--seed N] [--warmup 300] [--samples 2000] [--cpu K]

The shard's shared-memory status (``transport/_status.py``, ``docs/status.md``) over the
steady state of ``bench/workload.py`` (100 queues, 3 clusters, 5 resources, ~5,000 leases in
flight, blocked STRICT_FIFO heads):

* ``publish_us``: median wall time of ``StatusWriter.publish(engine, counters)``, one steady
  tick (untimed) between two publishes, so heads move and their explanations are re-read as
  in a live shard; ``publish_share_pct`` is that cost over the default ``status.interval``
  (50 ms): the share of a busy shard's decision thread it takes.
* ``record_per_turn_us``: what the loop's hooks add to every turn, whatever the interval:
  ``record_tick``, ``record_commit`` and ``record_turn`` of a steady tick's dispatch batch
  (the columns are kept; their counts are folded in at the next publish, which
  ``publish_us`` includes).
* ``status_read_us``: median wall time of ``StatusReader.read()``: one consistent copy of the
  whole block (seqlock, copy, re-check; the path's inode checked), while nothing writes.
* ``status_read_contended_us``: the same while another process publishes back to back (the
  worst case for a reader: every copy may race a publish); ``contended_retries_per_read``.
* ``snapshot_us``: median wall time of ``StatusReader.snapshot()``: the consistent copy decoded
  into ``StatusSnapshot`` dataclasses (every queue and cluster), what the CLI and the metrics
  collector use; ``scrape_us``: one Prometheus scrape body (``generate_latest``) of it;
  ``wait_reason_series``: the (queue, reason) queue-wait histograms it exports (one per pair
  that saw a placement), ``scrape_samples`` the samples in all.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import numpy as np  # noqa: E402
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from workload import SEED, Workload  # noqa: E402

from transport import StatusCollector, StatusReader, StatusWriter  # noqa: E402
from transport._status import SHARD_COUNTERS  # noqa: E402

WARMUP_TICKS = 300
SAMPLES = 2000
CONTENDED_S = 2.0
INTERVAL_S = 0.05       # the default status.interval

# A writer process publishing the same layout back to back (its engine: the workload's).
_WRITER = r"""
import sys, time
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/bench"]
from pathlib import Path
from workload import Workload
from transport import StatusWriter
w = Workload(seed=int(sys.argv[2]))
w.warm_up(int(sys.argv[3]))
writer = StatusWriter(w.config, 0, sys.argv[4])
writer.publish(w.engine)
print("ready", flush=True)
stop, n = Path(sys.argv[5]), 0
deadline = time.monotonic() + 120
while not stop.exists() and time.monotonic() < deadline:
    for _ in range(20):
        writer.publish(w.engine)
    n += 20
writer.close()
print(n, flush=True)
"""


def _median_us(ns):
    return round(statistics.median(ns) / 1000, 2)


def _p90_us(ns):
    return round(float(np.percentile(np.asarray(ns, dtype=np.float64), 90)) / 1000, 2)


def _timed(fn, n):
    clock = time.perf_counter_ns
    out = []
    for _ in range(n):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


def measure_publish(w, writer, samples):
    """(publish ns, record-per-turn ns): a steady tick whose drained batch the hooks record,
    then one publish."""
    counters = dict.fromkeys(SHARD_COUNTERS, 0)
    clock = time.perf_counter_ns
    publish, record = [], []
    eng = w.engine
    for _ in range(samples):
        w.advance()
        eng.schedule()
        batch = eng.drain_columns()
        t0 = clock()
        writer.record_tick(100_000)
        writer.record_commit(500_000)
        writer.record_turn(batch, eng.clock.now_ns())
        t1 = clock()
        writer.publish(eng, counters)
        t2 = clock()
        record.append(t1 - t0)
        publish.append(t2 - t1)
        w.after_tick(batch.assignments())
    return publish, record


def measure_contended(tmp, seed, warmup):
    path, stop = Path(tmp) / "contended.status", Path(tmp) / "stop"
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(ROOT), str(seed), str(warmup),
                             str(path), str(stop)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"the writer process did not start: {line!r}")
        reader = StatusReader(path, timeout=1.0)
        clock = time.perf_counter_ns
        out = []
        end = time.monotonic() + CONTENDED_S
        while time.monotonic() < end:
            t0 = clock()
            reader.read()
            out.append(clock() - t0)
        retries = reader.retries
        reader.close()
        stop.touch()
        published = int(proc.communicate(timeout=60)[0].split()[-1])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return out, retries, published


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--warmup", type=int, default=WARMUP_TICKS)
    ap.add_argument("--samples", type=int, default=SAMPLES)
    ap.add_argument("--cpu", type=int, default=None, help="pin the process to this CPU")
    args = ap.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    w = Workload(seed=args.seed)
    w.warm_up(args.warmup)
    with tempfile.TemporaryDirectory(prefix="leasehold-status-") as tmp:
        writer = StatusWriter(w.config, 0, Path(tmp) / "shard-0.status")
        publish, record = measure_publish(w, writer, args.samples)
        reader = StatusReader(writer.path)
        read = _timed(reader.read, args.samples * 5)
        snap = _timed(reader.snapshot, args.samples)
        collector = StatusCollector([writer.path])
        registry = CollectorRegistry()
        registry.register(collector)
        scrape = _timed(lambda: generate_latest(registry), max(50, args.samples // 20))
        samples = sum(len(f.samples) for f in registry.collect())
        last = reader.snapshot()
        layout = reader.layout
        collector.close()
        reader.close()
        writer.close()
        contended, retries, published = measure_contended(tmp, args.seed, args.warmup)
    blocked = sum(q.head_blocked is not None for q in last.queues.values())
    result = {
        "status_read_us": _median_us(read),
        "status_read_us_p90": _p90_us(read),
        "publish_us": _median_us(publish),
        "publish_us_p90": _p90_us(publish),
        "publish_share_pct": round(statistics.median(publish) / (INTERVAL_S * 1e9) * 100, 3),
        "record_per_turn_us": _median_us(record),
        "status_read_contended_us": _median_us(contended),
        "status_read_contended_us_p90": _p90_us(contended),
        "contended_reads": len(contended),
        "contended_retries_per_read": round(retries / max(1, len(contended)), 3),
        "contended_publishes": published,
        "snapshot_us": _median_us(snap),
        "scrape_us": _median_us(scrape),
        "scrape_samples": samples,
        "wait_reason_series": sum(len(q.wait_by_reason) for q in last.queues.values()),
        "file_bytes": layout.file_bytes,
        "workload": {
            "seed": args.seed,
            "warmup_ticks": args.warmup,
            "queues": len(last.queues),
            "queue_slots": layout.queue_slots,
            "clusters": list(last.clusters),
            "resources": list(last.resources),
            "blocked_heads": blocked,
            "leases_in_flight": sum(c.leases_in_flight for c in last.clusters.values()),
        },
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cpu_count": os.cpu_count(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
