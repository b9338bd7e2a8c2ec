"""The devbox's start and a supervised shard's restart: prints ONE JSON object on stdout.

    .venv/bin/python bench/devbox.py [--repeats 5] [--kills 3] [--leases 100000]

* ``devbox_start_s``: ``leasehold devbox --no-workload --dir FRESH`` as a new process, from
  the spawn to its "devbox ready" line on stdout: the config and keys made, the supervisor's
  checks, the shard process serving, the worker process registered (counted in the shard's
  status file). Median over ``--repeats`` runs, each on a fresh directory, each then stopped
  with SIGTERM. ``devbox_start_reported_s`` is what the devbox itself printed (from its
  ``start()``, without the interpreter's start and imports).
* ``shard_restart_s``: ``leasehold serve`` with one shard and a ``leasehold worker`` process
  holding ``--leases`` sim actions that run for an hour; the shard process is killed with
  SIGKILL, and the time from the kill to the first PING answered by its successor (the
  supervisor notices the exit, spawns, the new shard reloads every lease from LMDB and binds)
  is measured, ``--kills`` times (each kill once the previous successor has served for more
  than the supervisor's ``STABLE_S``, so every restart is immediate), median.
  ``restart_reload_s`` is the successor's own reload time (its status file), median;
  ``leases_after_restart`` the leases its status shows once the worker re-registered (the
  adopted ones).
* ``status_read_us``: one consistent copy of that shard's status file
  (``StatusReader.read()``), median of 20,000, while the shard serves its 100,000 leases.

The store is LMDB with ``sync = true`` in a temporary directory; ports are ephemeral.
"""

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
from _harness import free_port, until  # noqa: E402  (bench/ is sys.path[0])

from transport import (  # noqa: E402
    STABLE_S,
    Client,
    ShardTimeout,
    StatusReader,
    generate_keypair,
    load_client_keys,
)

RUN = "acme/bench/prod/hold"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}



def devbox_start(repeats):
    wall, reported = [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="bench-devbox-") as tmp:
            t0 = time.monotonic()
            proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "devbox",
                                     "--no-workload", "--dir", str(Path(tmp) / "box")],
                                    env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
            try:
                line = proc.stdout.readline()
                wall.append(time.monotonic() - t0)
                if not line.startswith("devbox ready in "):
                    raise SystemExit(f"bench/devbox.py: the devbox said {line!r}: "
                                     f"{proc.stderr.read() if proc.poll() is not None else ''}")
                reported.append(float(line.split("devbox ready in ")[1].split("s:")[0]))
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
    return statistics.median(wall), statistics.median(reported)


def write_config(tmp, port):
    keys = tmp / "keys"
    for name in ("shard", "east-1", "app"):
        generate_keypair(keys, name)
    path = tmp / "leasehold.toml"
    path.write_text(textwrap.dedent(f"""
        resources = ["cpu"]
        [clusters.east]
        capacity = {{ cpu = 1000000 }}
        [queues.q]
        scheduling = "GREEDY_CAPACITY"
        depth = 200000
        [engine]
        default_queue = "q"
        heartbeat_interval = 5.0
        expiry_missed_beats = 3
        expiry_jitter = 5.0
        [storage]
        path = "{tmp / 'data'}"
        partitions = 16
        [transport]
        endpoints = ["tcp://127.0.0.1:{port}"]
        [status]
        metrics = false
        [security]
        keys_dir = "{keys}"
        [security.peers.east-1]
        role = "worker"
        cluster = "east"
        [security.peers.app]
        role = "client"
        tenants = ["acme"]
        [worker]
        capacity = {{ cpu = 1000000 }}
        work_dir = "{tmp / 'work'}"
        log_dir = "{tmp / 'logs'}"
        drain_timeout = 1
        """))
    return path, keys


def snapshot(path):
    try:
        with StatusReader(path) as r:
            return r.snapshot()
    except Exception:       # being remade by a restarting shard
        return None


def shard_restart(kills, leases):
    tmp = Path(tempfile.mkdtemp(prefix="bench-restart-"))
    port = free_port()
    cfg, keys = write_config(tmp, port)
    status = tmp / "data" / "run" / "shard-0.status"
    procs = []
    out = {}
    try:
        logs = [open(tmp / f"{n}.log", "wb") for n in ("serve", "worker")]   # noqa: SIM115
        sup = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--config",
                                str(cfg)], env=ENV, cwd=tmp, stdout=logs[0],
                               stderr=subprocess.STDOUT)
        procs.append(sup)
        until(lambda: (s := snapshot(status)) is not None and s.state == "running", 60,
              "the shard to serve")
        worker = subprocess.Popen([sys.executable, "-m", "engine.cli", "worker", "--config",
                                   str(cfg), "--cluster", "east", "--name", "east-1",
                                   "--slots", str(leases + 1000)], env=ENV, cwd=tmp,
                                  stdout=logs[1], stderr=subprocess.STDOUT)
        procs.append(worker)
        client = Client(endpoint=f"tcp://127.0.0.1:{port}",
                        keys=load_client_keys(keys, "app", "shard"), timeout=30.0)
        until(lambda: (s := snapshot(status)) and s.clusters["east"].workers_connected, 60,
              "the worker to register")
        names = [f"h{i:06d}" for i in range(leases)]
        template = {"id": f"{RUN}/x", "task": "hold", "resources": {"cpu": "1m"},
                    "execute": {"plugin": "sim", "duration": 3600.0}}
        for lo in range(0, leases, 10_000):
            client.enqueue_fanout(template, names[lo:lo + 10_000])
        until(lambda: (s := snapshot(status)) and s.clusters["east"].leases_in_flight
              >= leases, 300, f"{leases} leases held")
        client.close()
        times, reloads, adopted = [], [], []
        for _ in range(kills):
            s = snapshot(status)
            served_for = time.time() - s.start_ns / 1e9
            if served_for < STABLE_S + 0.5:
                time.sleep(STABLE_S + 0.5 - served_for)
            old = snapshot(status).pid
            probe = Client(endpoint=f"tcp://127.0.0.1:{port}",
                           keys=load_client_keys(keys, "app", "shard"), timeout=0.2)
            os.kill(old, signal.SIGKILL)
            t0 = time.monotonic()
            while True:
                try:
                    probe.ping()
                    break
                except ShardTimeout:
                    if time.monotonic() - t0 > 60:
                        raise SystemExit("bench/devbox.py: the shard did not come back "
                                         "within 60s") from None
                    probe.reconnect()
            times.append(time.monotonic() - t0)
            probe.close()
            s = until(lambda o=old: (x := snapshot(status)) and x.pid != o
                      and x.state == "running" and x, 30, "the new status file")
            reloads.append(s.reload_s)
            s = until(lambda: (x := snapshot(status)) and x.clusters["east"].leases_in_flight
                      >= leases and x, 120, "the worker's leases adopted again")
            adopted.append(s.clusters["east"].leases_in_flight)
        reads = []
        with StatusReader(status) as r:
            for _ in range(20_000):
                t = time.perf_counter_ns()
                r.read()
                reads.append(time.perf_counter_ns() - t)
        out = {"shard_restart_s": round(statistics.median(times), 4),
               "shard_restart_max_s": round(max(times), 4),
               "restart_reload_s": round(statistics.median(reloads), 4),
               "leases_after_restart": min(adopted),
               "status_read_us": round(statistics.median(reads) / 1000, 2)}
    finally:
        for proc in reversed(procs):        # the worker first (it drains), then serve
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        for proc in procs:
            try:
                for c in psutil.Process(proc.pid).children(recursive=True):
                    c.kill()
            except psutil.Error:
                pass
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5, help="devbox starts (default 5)")
    ap.add_argument("--kills", type=int, default=3, help="shard kills (default 3)")
    ap.add_argument("--leases", type=int, default=100_000, help="leases held (default 100000)")
    args = ap.parse_args()
    start, reported = devbox_start(args.repeats)
    out = {"devbox_start_s": round(start, 4), "devbox_start_reported_s": round(reported, 4)}
    out.update(shard_restart(args.kills, args.leases))
    out.update({"leases": args.leases, "repeats": args.repeats, "kills": args.kills,
                "cpu_count": os.cpu_count(), "python": platform.python_version()})
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
