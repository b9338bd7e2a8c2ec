"""End-to-end dispatch: prints ONE JSON object on stdout (nothing else).

    .venv/bin/python bench/dispatch.py [--repeats 3] [--actions 50000] [--rtt 200] [--slots N]

One ``leasehold shard`` process (LMDB, ``sync = true``: every group commit is an fdatasync,
CURVE on) and one worker process (``transport.Worker`` with the ``sim`` plugin at zero
duration, and the ``python`` plugin for the warm pool), driven by clients in this process.

* ``dispatch_per_s``: ``--actions`` actions enqueued as a parent fanning out would: fan-out
  batches of 1,000 (ENQUEUE_FANOUT), at most 4 batches unacknowledged at a time (4 client
  connections, one batch in flight each); from the first enqueue sent to the last SUCCEEDED
  seen by a watching client (every transition durable before it left the shard), which
  takes the run's events in batches (``Client.next_events``: no object an event).
* ``dispatch_p99_ms`` / ``dispatch_p50_ms``: per action, from its batch's acknowledgement
  (client clock) to the worker receiving its lease (the worker's clock, the same machine):
  the plugin's ``start`` (or ``start_many``) call, in the loop turn that decoded the LEASES
  message.
* ``small_run_p50_ms`` / ``small_run_p99_ms``: while the fan-out drains, a client of another
  tenant enqueues a 10-action run and waits for all 10 to succeed (``Client.run_fanout``:
  the run's WATCH, the enqueue and a STATUS in one round trip, then its events), one run
  after the other; ``small_runs`` how many fit in the drain.
* ``fanout_cpu_us_shard`` / ``_worker`` / ``_client``: CPU time (user + system) each process
  spent per action during the fan-out (this process is the client: the enqueuers, the
  watcher and the small runs). Unlike the rates, these hold up on a busy machine.
* ``idle_rtt_p50_ms``: afterwards, one action at a time: enqueue to SUCCEEDED seen.
* ``warm_pool_rtt_p50_ms``: one ``python``-plugin action at a time in a reusable environment
  whose pool is already warm (the first action, which starts it, is not counted).

``--slots``: the worker's slots (leases it holds at once; default 1,000,000, more than the
run, so every admitted lease is pushed at once and the backlog waits in the sockets between
the processes; a few thousand keep it in the engine's queue, where runs take turns).

Each figure is the median over ``--repeats`` runs (a fresh shard, worker and store each).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import psutil  # noqa: E402
from _harness import cpu_seconds, free_port, stop, wait_up  # noqa: E402  (bench/ is sys.path[0])

from engine._codes import PHASE_CODE, Phase  # noqa: E402
from transport import Client, generate_keypair, load_client_keys  # noqa: E402

SUCCEEDED = PHASE_CODE[Phase.SUCCEEDED]
ENDED_BADLY = [PHASE_CODE[ph] for ph in (Phase.FAILED, Phase.ABORTED, Phase.TIMED_OUT)]

BATCH = 1000
WINDOW = 4
# The worker's slots (leases held at once) by default: more than the run, so the backlog
# waits in the pipeline (the worker's and the shard's sockets), not in the engine's queue.
SLOTS = 1_000_000


def write_config(tmp, port, pipeline=None):
    keys = tmp / "keys"
    if not keys.exists():
        generate_keypair(keys, "shard")
        for name in ("east-1", "acme-app", "globex-app"):
            generate_keypair(keys, name)
    path = tmp / "leasehold.toml"
    path.write_text(f"""resources = ["cpu", "memory"]
[clusters.east]
capacity = {{ cpu = 10000000, memory = "1000Ti" }}
[queues.q]
scheduling = "GREEDY_CAPACITY"
depth = 10000000
[engine]
default_queue = "q"
heartbeat_interval = 10.0
[storage]
path = "{tmp / 'data'}"
partitions = 16
sync = true
map_size = 4294967296
[transport]
endpoints = ["tcp://127.0.0.1:{port}"]
{f"commit_pipeline = {pipeline}" if pipeline else ""}
[security]
keys_dir = "{keys}"
server_key = "shard"
[security.peers.east-1]
role = "worker"
cluster = "east"
[security.peers.acme-app]
role = "client"
tenants = ["acme"]
[security.peers.globex-app]
role = "client"
tenants = ["globex"]
[worker]
capacity = {{ cpu = 10000000, memory = "1000Ti" }}
work_dir = "{tmp / 'work'}"
log_dir = "{tmp / 'logs'}"
""")
    return path


def worker_main(config, receipts_path, slots):
    """The worker process: transport.Worker with the real plugins; the sim plugin's start
    also notes when each lease arrived (written out at SIGTERM)."""
    import signal

    from engine._commands import freeze_heap
    from transport import Worker, make_plugins

    plugins = make_plugins()
    sim = plugins["sim"]
    arrived = []
    start, start_many = sim.start, sim.start_many

    # One entry a call, the attempts it was given and when: the bench's own bookkeeping
    # stays off the worker's per-lease path (a tuple a lease cost ~5% of its CPU).
    def start_noting(attempt):
        arrived.append(((attempt,), time.time_ns()))
        return start(attempt)

    def start_many_noting(attempts):
        arrived.append((attempts, time.time_ns()))
        return start_many(attempts)

    sim.start, sim.start_many = start_noting, start_many_noting
    w = Worker(config, "east", name="east-1", slots=int(slots), plugins=plugins)
    freeze_heap()               # as `leasehold worker` does once started
    ending = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: ending.set())
    w.start()                   # returns once registered
    print("ready", flush=True)
    while not ending.wait(0.5):
        pass
    w.stop()
    with open(receipts_path, "w") as f:
        for attempts, t in arrived:
            for a in attempts:
                f.write(f"{a.action} {t}\n")


def start_processes(tmp, config, slots):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    shard = subprocess.Popen([sys.executable, "-m", "engine.cli", "shard", "--config",
                              str(config)], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    worker = subprocess.Popen([sys.executable, __file__, "--worker", str(config),
                               str(tmp / "receipts.txt"), str(slots)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return shard, worker


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))]


def one_run(actions, rtt_count, pipeline=None, slots=SLOTS):
    with tempfile.TemporaryDirectory(prefix="leasehold-dispatch-") as d:
        tmp = Path(d)
        port = free_port()
        config = write_config(tmp, port, pipeline)
        endpoint = f"tcp://127.0.0.1:{port}"
        keys = tmp / "keys"

        def client(name):
            return Client(endpoint=endpoint, keys=load_client_keys(keys, name, "shard"),
                          timeout=60.0)

        shard, worker = start_processes(tmp, config, slots)
        watcher = client("acme-app")
        try:
            wait_up(watcher)
            if worker.stdout.readline().strip() != "ready":
                raise RuntimeError("the worker process did not start")
            run = "acme/bench/prod/fan"
            watcher.subscribe(run)
            batches = [[f"a{b:03d}-{i:04d}" for i in range(BATCH)]
                       for b in range(actions // BATCH)]
            acks = {}
            t_first = [None]

            def enqueuer(k):
                c = client("acme-app")
                try:
                    for b in range(k, len(batches), WINDOW):
                        if t_first[0] is None:
                            t_first[0] = time.time_ns()
                        c.enqueue_fanout({"id": f"{run}/x", "task": "t",
                                          "resources": {"cpu": "1m"},
                                          "execute": {"plugin": "sim"}}, batches[b])
                        acks[b] = time.time_ns()
                finally:
                    c.close()

            small = []
            draining = threading.Event()
            draining.set()

            def small_runs():
                c = client("globex-app")
                try:
                    n = 0
                    while draining.is_set():
                        n += 1
                        r = f"globex/bench/prod/small{n}"
                        t0 = time.perf_counter()
                        got = c.run_fanout({"id": f"{r}/x", "task": "t",
                                            "resources": {"cpu": "1m"},
                                            "execute": {"plugin": "sim"}},
                                           [f"s{i}" for i in range(10)], timeout=60)
                        if set(got.values()) != {Phase.SUCCEEDED}:
                            raise RuntimeError(f"small run {r}: {got}")
                        if draining.is_set():
                            small.append((time.perf_counter() - t0) * 1e3)
                finally:
                    c.close()

            threads = [threading.Thread(target=enqueuer, args=(k,)) for k in range(WINDOW)]
            side = threading.Thread(target=small_runs)
            procs = {"shard": psutil.Process(shard.pid), "worker": psutil.Process(worker.pid)}
            cpu0 = {k: cpu_seconds(p) for k, p in procs.items()}
            cpu0["client"] = time.process_time()
            for t in threads:
                t.start()
            side.start()
            done = 0
            t_last = None
            while done < len(batches) * BATCH:
                # In batches (a pushed message's events as columns): a watcher following a
                # 50,000-action run makes no object an event.
                got = watcher.next_events(timeout=60)
                ok = int(np.count_nonzero(got.phases == SUCCEEDED))
                if ok:
                    done += ok
                    t_last = time.time_ns()
                bad = np.flatnonzero(np.isin(got.phases, ENDED_BADLY))
                if bad.size:
                    e = got.events()[int(bad[0])]
                    raise RuntimeError(f"{e.action} ended {e.phase}: {e.detail}")
            cpu1 = {k: cpu_seconds(p) for k, p in procs.items()}
            cpu1["client"] = time.process_time()
            draining.clear()
            for t in threads:
                t.join()
            side.join(60)
            watcher.unsubscribe(run)
            rate = done / ((t_last - t_first[0]) / 1e9)

            # One at a time: the idle round trip, then the warm pool.
            rt = client("acme-app")
            idle, warm = [], []
            try:
                for kind, out, count in (("sim", idle, rtt_count), ("pool", warm, rtt_count + 1)):
                    r = f"acme/bench/prod/{kind}"
                    rt.subscribe(r)
                    for i in range(count):
                        aid = f"{r}/a{i}"
                        s = {"id": aid, "task": "t", "resources": {"cpu": "1m"},
                             "execute": {"plugin": "sim"}}
                        if kind == "pool":
                            s.update(execute={"plugin": "python", "function": "os:getpid"},
                                     environment="bench-pool",
                                     reuse={"replicas": 1, "concurrency": 1, "idle_ttl": 600})
                        t0 = time.perf_counter()
                        rt.enqueue(s)
                        while True:
                            e = rt.next_event(timeout=60)
                            if e.action == aid and e.phase in ("SUCCEEDED", "FAILED"):
                                break
                        if e.phase != "SUCCEEDED":
                            raise RuntimeError(f"{aid}: {e.phase}: {e.detail}")
                        if kind == "sim" or i > 0:
                            out.append((time.perf_counter() - t0) * 1e3)
                    rt.unsubscribe(r)
            finally:
                rt.close()
        finally:
            watcher.close()
            stop(worker)
            stop(shard)
        lat = []
        for line in (tmp / "receipts.txt").read_text().splitlines():
            action, t = line.split()
            name = action.rsplit("/", 1)[1]
            if name.startswith("a") and "-" in name and action.startswith(run):
                b = int(name[1:4])
                lat.append((int(t) - acks[b]) / 1e6)
        return {
            "dispatch_per_s": rate,
            "dispatch_p50_ms": pct(lat, 0.5) if lat else None,
            "dispatch_p99_ms": pct(lat, 0.99) if lat else None,
            "small_run_p50_ms": pct(small, 0.5) if small else None,
            "small_run_p99_ms": pct(small, 0.99) if small else None,
            "small_runs": len(small),
            **{f"fanout_cpu_us_{k}": (cpu1[k] - cpu0[k]) / done * 1e6 for k in cpu0},
            "idle_rtt_p50_ms": pct(idle, 0.5),
            "warm_pool_rtt_p50_ms": pct(warm, 0.5),
        }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--actions", type=int, default=50000)
    ap.add_argument("--rtt", type=int, default=200)
    ap.add_argument("--commit-pipeline", type=int, default=None,
                    help="transport.commit_pipeline of the shard (default: the config's)")
    ap.add_argument("--slots", type=int, default=SLOTS,
                    help="the worker's slots: leases it holds at once (default %(default)s)")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(*args.worker)
        return
    runs = [one_run(args.actions, args.rtt, args.commit_pipeline, args.slots)
            for _ in range(args.repeats)]
    out = {}
    for key in runs[0]:
        vals = [r[key] for r in runs if r[key] is not None]
        out[key] = round(statistics.median(vals), 3) if vals else None
        out[f"{key}_runs"] = [None if r[key] is None else round(r[key], 3) for r in runs]
    out.update(actions=args.actions, commit_pipeline=args.commit_pipeline or 2, batch=BATCH,
               window=WINDOW, slots=args.slots, repeats=args.repeats,
               goals={"dispatch_per_s": ">= 100000", "dispatch_p99_ms": "<= 50",
                      "small_run_p50_ms": "<= 2", "idle_rtt_p50_ms": "<= 1.5",
                      "warm_pool_rtt_p50_ms": "<= 2.0"},
               machine={"cpus": os.cpu_count(), "python": platform.python_version()})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
