"""Scrapes under load: prints ONE JSON object on stdout (nothing else).

    .venv/bin/python bench/scrape_load.py [--repeats 5] [--phase-s 4] [--rate 400]
                                          [--scrapers 4] [--scraper-cpu K]

Does a metrics scrape change the tick latency of a shard under load? A real shard process
(``leasehold shard``, insecure loopback, ``storage.sync = false`` so fsync noise stays out of
the loop) pinned to CPU 0, as ``leasehold serve`` pins shards. This process, on the other CPU,
drives it: ``--rate`` actions a second enqueued in batches every 10 ms over four queues (two
STRICT_FIFO, two GREEDY_CAPACITY, one cluster of 200 cpu), and one worker connection that takes
every lease pushed and reports it SUCCEEDED ``--hold-s`` later (a steady state of ~100 leases
in flight: each tick places the few actions enqueued since the last one). Phases alternate
``quiet`` (no scraper) and ``scraped``: a separate process (the supervisor's role) serves
``serve_metrics`` over the shard's status file and ``--scrapers`` threads of it fetch
``/metrics`` back to back (niced, so the driver keeps its rate). The order alternates per
repeat (quiet first, then scraped first, ...) so a drift of the machine falls on both. The
scraper runs on the driver's CPU unless ``--scraper-cpu`` says otherwise (``--scraper-cpu 0``:
on the shard's CPU, which measures CPU sharing, not the scrape's path).

Per phase, from the shard's own tick histogram in its status file (``tick_counts``, the wall
time of ``Engine.schedule()`` in its loop; the difference of the snapshots at the phase's ends),
``tick_p50_us`` / ``tick_p99_us`` interpolated inside the bucket as Prometheus'
``histogram_quantile`` does, and ``tick_p50_le_us`` / ``tick_p99_le_us`` the bucket's upper
bound; ``ticks``, ``dispatches_per_s`` (achieved load) and ``scrapes_per_s``. The top level
gives the medians over the repeats per kind of phase. Reading the status file at a phase's
ends is itself a copy of shared memory: it sends the shard nothing.
"""

import argparse
import collections
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
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from _harness import free_port, stop  # noqa: E402  (bench/ is sys.path[0])

from engine import Phase, load_config  # noqa: E402
from transport import Client, StatusReader, WorkerConnection, status_path  # noqa: E402
from transport._status import TICK_EDGES_US  # noqa: E402

QUEUES = ("fifo-a", "fifo-b", "greedy-a", "greedy-b")
BATCH_EVERY_S = 0.01
SCRAPER_NICE = 10

CONFIG = """
resources = ["cpu", "memory"]
[clusters.east]
capacity = {{ cpu = 200, memory = "1Ti" }}
""" + "".join(f"""[queues.{q}]
scheduling = "{"STRICT_FIFO" if q.startswith("fifo") else "GREEDY_CAPACITY"}"
depth = 1000000
""" for q in QUEUES) + """[engine]
default_queue = "greedy-a"
[storage]
path = "{data}"
partitions = 2
sync = false
[transport]
endpoints = ["tcp://127.0.0.1:{port}"]
[status]
metrics = false
[security]
insecure = true
"""

# The scraper process: serve_metrics over the status file, threads fetching it back to back
# until stdin closes; prints the number of scrapes.
_SCRAPER = r"""
import sys, threading, urllib.request
sys.path.insert(0, sys.argv[1])
from transport import serve_metrics
server = serve_metrics([sys.argv[2]], "127.0.0.1", 0)
stop = threading.Event()
counts = []
def hammer():
    n = 0
    while not stop.is_set():
        with urllib.request.urlopen(server.url, timeout=10) as resp:
            resp.read()
        n += 1
    counts.append(n)
threads = [threading.Thread(target=hammer) for _ in range(int(sys.argv[3]))]
for t in threads:
    t.start()
print("ready", flush=True)
sys.stdin.read()
stop.set()
for t in threads:
    t.join(30)
server.close()
print(sum(counts), flush=True)
"""


def _quantile(edges_us, counts, q):
    """(interpolated, upper bound) of quantile ``q`` of bucket ``counts`` (len(edges) + 1),
    as Prometheus' histogram_quantile: linear inside the bucket, its lower bound 0 for the
    first; a quantile in the +Inf bucket is the last edge. None without observations."""
    total = sum(counts)
    if total == 0:
        return None, None
    rank = q * total
    seen = 0
    for i, n in enumerate(counts):
        if seen + n >= rank and n > 0:
            if i == len(edges_us):
                return float(edges_us[-1]), float("inf")
            lo = 0.0 if i == 0 else float(edges_us[i - 1])
            hi = float(edges_us[i])
            return round(lo + (hi - lo) * (rank - seen) / n, 1), hi
        seen += n
    return float(edges_us[-1]), float("inf")


class Driver:
    """From one thread: enqueues at a fixed rate, takes every lease pushed, and reports
    each SUCCEEDED ``hold`` seconds later (so some hundred are in flight, well within the
    cluster's capacity: a steady state, not a backlog that grows through the run)."""

    def __init__(self, endpoint, rate, hold):
        self.client = Client(endpoint=endpoint, keys=None, timeout=10.0)
        self.worker = WorkerConnection(endpoint, None, "east-1", "east", 100_000, timeout=10.0)
        self.worker.connect()
        self.per_batch = max(1, round(rate * BATCH_EVERY_S))
        self.hold = hold
        self.held = collections.deque()     # (due, token), due ascending
        self.n = 0

    def run_for(self, seconds):
        """Drive for ``seconds``; returns the leases completed."""
        done = 0
        end = time.monotonic() + seconds
        next_at = time.monotonic()
        while time.monotonic() < end:
            specs = []
            for _ in range(self.per_batch):
                q = QUEUES[self.n % len(QUEUES)]
                specs.append({"id": f"acme/p/d/r{self.n // 200}/a{self.n}", "task": "t",
                              "resources": {"cpu": "500m", "memory": "1Gi"},
                              "task_queue": q})
                self.n += 1
            self.client.enqueue_many(specs)
            now = time.monotonic()
            for lease in self.worker.leases(timeout=0.002, want=1 << 30):
                self.held.append((now + self.hold, lease.token))
            due = []
            while self.held and self.held[0][0] <= now:
                due.append(self.held.popleft()[1])
            if due:
                self.worker.report(due, Phase.SUCCEEDED)
                done += len(due)
            next_at += BATCH_EVERY_S
            pause = next_at - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            else:
                next_at = time.monotonic()      # behind: do not try to catch up in a burst
        return done

    def close(self):
        self.worker.close()
        self.client.close()


def _phase(kind, driver, reader, seconds, path, scrapers, scraper_cpu):
    scraper = None
    if kind == "scraped":
        # Niced: it takes what CPU the driver leaves, so the load stays the quiet phase's
        # (on 2 cores it shares the driver's; the shard's CPU is the shard's alone).
        scraper = subprocess.Popen([sys.executable, "-c", _SCRAPER, str(ROOT), str(path),
                                    str(scrapers)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True,
                                   preexec_fn=lambda: os.nice(SCRAPER_NICE))
        if scraper_cpu is not None:
            os.sched_setaffinity(scraper.pid, {scraper_cpu})
        line = scraper.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"the scraper process did not start: {line!r}")
    try:
        before = reader.snapshot()
        t0 = time.monotonic()
        driver.run_for(seconds)
        after = reader.snapshot()
        elapsed = time.monotonic() - t0
        scrapes = 0
        if scraper is not None:
            out, _ = scraper.communicate("", timeout=60)
            scrapes = int(out.split()[-1])
    finally:
        if scraper is not None and scraper.poll() is None:
            scraper.kill()
            scraper.wait(10)
    counts = [b - a for a, b in zip(before.tick_latency.counts, after.tick_latency.counts,
                                    strict=True)]
    p50, p50_le = _quantile(TICK_EDGES_US, counts, 0.5)
    p99, p99_le = _quantile(TICK_EDGES_US, counts, 0.99)
    ticks = sum(counts)
    return {
        "kind": kind,
        "tick_p50_us": p50, "tick_p99_us": p99,
        "tick_p50_le_us": p50_le, "tick_p99_le_us": p99_le,
        "tick_mean_us": round((after.tick_latency.sum - before.tick_latency.sum) * 1e6
                              / max(1, ticks), 1),
        "ticks": ticks,
        "dispatches_per_s": round((after.dispatches - before.dispatches) / elapsed, 1),
        "scrapes_per_s": round(scrapes / elapsed, 1),
        "depth_at_end": sum(q.depth for q in after.queues.values()),
    }


def _median(phases, kind, key):
    values = [p[key] for p in phases if p["kind"] == kind and p[key] is not None]
    return statistics.median(values) if values else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="pairs of phases (quiet, scraped)")
    ap.add_argument("--phase-s", type=float, default=4.0, help="seconds per phase")
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--rate", type=float, default=400.0, help="actions enqueued per second")
    ap.add_argument("--hold-s", type=float, default=0.25,
                    help="seconds the worker holds a lease before reporting it SUCCEEDED")
    ap.add_argument("--scrapers", type=int, default=4, help="threads fetching /metrics")
    ap.add_argument("--shard-cpu", type=int, default=0)
    ap.add_argument("--scraper-cpu", type=int, default=None,
                    help="pin the scraper process (default: the driver's CPU, not the shard's)")
    args = ap.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    others = [c for c in cpus if c != args.shard_cpu] or cpus
    os.sched_setaffinity(0, set(others))        # the driver (and the scraper) off the shard
    scraper_cpu = args.scraper_cpu if args.scraper_cpu is not None else None

    with tempfile.TemporaryDirectory(prefix="leasehold-scrape-") as tmp:
        tmp = Path(tmp)
        port = free_port()
        cfg_path = tmp / "leasehold.toml"
        cfg_path.write_text(CONFIG.format(data=tmp / "data", port=port))
        path = status_path(load_config(cfg_path), 0)
        log = open(tmp / "shard.log", "wb")     # noqa: SIM115
        shard = subprocess.Popen([sys.executable, "-m", "engine.cli", "shard", "--config",
                                  str(cfg_path)], cwd=tmp, stdout=log, stderr=subprocess.STDOUT,
                                 env=dict(os.environ, PYTHONPATH=str(ROOT)))
        log.close()
        driver = reader = None
        try:
            os.sched_setaffinity(shard.pid, {args.shard_cpu})
            deadline = time.monotonic() + 60
            while True:
                try:
                    reader = StatusReader(path, timeout=1.0)
                    if reader.snapshot().state == "running" and reader.pid == shard.pid:
                        break
                    reader.close()
                    reader = None
                except Exception:               # not made yet / being replaced
                    reader = None
                if shard.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the shard did not start: "
                                       + (tmp / "shard.log").read_text(errors="replace"))
                time.sleep(0.05)
            driver = Driver(f"tcp://127.0.0.1:{port}", args.rate, args.hold_s)
            driver.run_for(args.warmup_s)
            phases = []
            for r in range(args.repeats):
                order = ("quiet", "scraped") if r % 2 == 0 else ("scraped", "quiet")
                for kind in order:
                    phases.append(_phase(kind, driver, reader, args.phase_s, path,
                                         args.scrapers, scraper_cpu))
        finally:
            if driver is not None:
                driver.close()
            if reader is not None:
                reader.close()
            if shard.poll() is None:
                stop(shard, 20)

    keys = ("tick_p50_us", "tick_p99_us", "tick_p50_le_us", "tick_p99_le_us", "tick_mean_us",
            "dispatches_per_s", "scrapes_per_s")
    result = {kind: {k: _median(phases, kind, k) for k in keys} for kind in ("quiet", "scraped")}
    result |= {
        "phases": phases,
        "settings": {"repeats": args.repeats, "phase_s": args.phase_s, "rate": args.rate,
                     "hold_s": args.hold_s,
                     "scrapers": args.scrapers, "shard_cpu": args.shard_cpu,
                     "driver_cpus": others,
                     "scraper_cpu": scraper_cpu if scraper_cpu is not None else others,
                     "scraper_nice": SCRAPER_NICE, "queues": list(QUEUES),
                     "storage_sync": False},
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
