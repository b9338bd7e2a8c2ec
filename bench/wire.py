"""The shard on the wire: prints ONE JSON object on stdout (nothing else).

    .venv/bin/python bench/wire.py [--repeats 3] [--batches 100] [--rtt 300]

Client, shard and worker are separate processes (the shard is ``leasehold shard`` on an LMDB
store in a temporary directory, ``sync = true``: every group commit is an fdatasync).

* ``enqueue_wire_per_s``: durable enqueues acknowledged over CURVE: ``--batches`` fan-out
  batches of 1,000 names (ENQUEUE_FANOUT), 8 requests in flight on one connection, each
  acknowledged only after the commit that made it durable; actions per second from the first
  send to the last acknowledgement. No worker is connected (nothing is dispatched).
* ``idle_rtt_p50_ms`` / ``idle_rtt_p99_ms``: one action at a time (``--rtt`` of them): the
  client enqueues it, the shard pushes its lease to the worker process, the worker reports
  SUCCEEDED, the client sees SUCCEEDED on its watch. Every transition is durable before
  anything of it leaves the shard.
* ``commits_per_action``: store group commits during the RTT phase per action (the shard's
  counters, read with PING by the admin key).
* ``rtt_cpu_ms_shard`` / ``_worker`` / ``_client``: CPU (user + system, every thread) each
  process spent per action during the RTT phase: the round trip is mostly these in series.
* ``rtt_shard_decide_us`` / ``_commit_us`` / ``_send_us``: where the shard loop's time went
  per action during the RTT phase (its ``decide_ns``, ``commit_ns`` and ``send_ns`` counters:
  requests handled, tick, drain and group encoded; group commits with their syncs; answers,
  leases and events sent), means over both of an action's turns (and the backstop's).
* ``fdatasync_p50_ms``: one fdatasync on this disk, and ``nosync_*``: the same runs with
  ``storage.sync = false`` (CURVE on): what is left of the round trip without the syncs is
  the wire, the three processes' Python and the engine.
* ``curve_cost_pct``: the RTT p50 with CURVE over the same run without (``insecure``), minus
  one, in percent; ``curve_cost_enqueue_pct`` the same for the enqueue rate (plain over
  CURVE, minus one).

Each figure is the median over ``--repeats`` runs (a fresh shard and store each).
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

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
import zmq  # noqa: E402
from _harness import cpu_seconds, free_port, stop, wait_up  # noqa: E402  (bench/ is sys.path[0])

from transport import (  # noqa: E402
    Client,
    EnqueueFanout,
    Error,
    WorkerConnection,
    client_socket,
    decode,
    encode,
    generate_keypair,
    load_client_keys,
)

RUN = "acme/bench/prod"


def write_config(tmp, secure, port, sync=True, pipeline=None):
    keys = tmp / "keys"
    if secure and not keys.exists():
        generate_keypair(keys, "shard")
        for name in ("east-1", "app", "ops"):
            generate_keypair(keys, name)
    sec = (f'[security]\nkeys_dir = "{keys}"\nserver_key = "shard"\n'
           '[security.peers.east-1]\nrole = "worker"\ncluster = "east"\n'
           '[security.peers.app]\nrole = "client"\ntenants = ["acme"]\n'
           '[security.peers.ops]\nrole = "admin"\n') if secure else \
        "[security]\ninsecure = true\n"
    data = tmp / f"data-{time.monotonic_ns()}"
    text = f"""resources = ["cpu"]
[clusters.east]
capacity = {{ cpu = 1000000 }}
[queues.q]
scheduling = "GREEDY_CAPACITY"
depth = 10000000
[engine]
default_queue = "q"
heartbeat_interval = 10.0
[storage]
path = "{data}"
partitions = 16
sync = {"true" if sync else "false"}
map_size = 4294967296
[transport]
endpoints = ["tcp://127.0.0.1:{port}"]
max_outstanding = 64
{f"commit_pipeline = {pipeline}" if pipeline else ""}
{sec}"""
    path = tmp / f"{'secure' if secure else 'plain'}-{'sync' if sync else 'nosync'}.toml"
    path.write_text(text)
    return path


def keys_of(tmp, secure, name):
    return load_client_keys(tmp / "keys", name, "shard") if secure else None


def start_shard(config):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "shard", "--config",
                             str(config)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    return proc


def wait_for(endpoint, keys, timeout=30):
    c = Client(endpoint=endpoint, keys=keys, timeout=1.0)
    try:
        return wait_up(c, timeout)
    finally:
        c.close()


def enqueue_rate(endpoint, keys, batches, window=8):
    ctx = zmq.Context()
    sock = client_socket(ctx, endpoint, keys)
    template = {"id": f"{RUN}/fan/x", "task": "t", "resources": {"cpu": 1}}
    try:
        msgs = [encode(EnqueueFanout(rid=i, template={**template, "id": f"{RUN}/f{i}/x"},
                                     names=[f"n{k}" for k in range(1000)]))
                for i in range(batches)]
        sent = acked = 0
        t0 = time.perf_counter()
        while acked < batches:
            while sent < batches and sent - acked < window:
                sock.send_multipart(msgs[sent], copy=False)
                sent += 1
            if not sock.poll(30000):
                raise RuntimeError("enqueue: no answer within 30 s")
            got = decode(sock.recv_multipart(copy=False))
            if isinstance(got, Error):
                raise RuntimeError(f"enqueue: {got.code}: {got.message}")
            acked += 1
        return batches * 1000 / (time.perf_counter() - t0)
    finally:
        sock.close(0)
        ctx.term()


def worker_main(endpoint, tmp, secure):
    """The worker process: report SUCCEEDED for every lease, until the parent kills it."""
    w = WorkerConnection(endpoint, keys_of(Path(tmp), secure, "east-1"), "east-1", "east",
                         1000, timeout=30.0)
    w.connect()
    print("ready", flush=True)
    while True:
        leases = w.leases(timeout=1.0)
        if leases:
            w.report([x.token for x in leases], "SUCCEEDED")


def rtt(endpoint, tmp, secure, count, shard_pid):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    worker = subprocess.Popen([sys.executable, __file__, "--worker", endpoint, str(tmp),
                               "1" if secure else "0"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    c = Client(endpoint=endpoint, keys=keys_of(tmp, secure, "app"), timeout=30.0)
    admin = Client(endpoint=endpoint, keys=keys_of(tmp, secure, "ops"), timeout=30.0)
    try:
        if worker.stdout.readline().strip() != "ready":
            raise RuntimeError("the worker process did not start")
        run = f"{RUN}/rtt{time.monotonic_ns()}"
        c.subscribe(run)
        times = []
        before = admin.ping()["counters"]
        procs = [psutil.Process(shard_pid), psutil.Process(worker.pid), psutil.Process()]
        cpu0 = [cpu_seconds(x) for x in procs]
        for i in range(count):
            aid = f"{run}/a{i}"
            t0 = time.perf_counter()
            c.enqueue({"id": aid, "task": "t", "resources": {"cpu": 1}})
            while True:
                e = c.next_event(timeout=30)
                if e.action == aid and e.phase == "SUCCEEDED":
                    break
            times.append(time.perf_counter() - t0)
        cpu = [(cpu_seconds(x) - c0) * 1e3 / count for x, c0 in zip(procs, cpu0, strict=True)]
        after = admin.ping()["counters"]
        times.sort()
        loop = [(after[k] - before[k]) / count / 1e3 for k in ("decide_ns", "commit_ns",
                                                               "send_ns")]
        return (times[len(times) // 2] * 1e3, times[min(len(times) - 1,
                                                         int(len(times) * 0.99))] * 1e3,
                (after["store_commits"] - before["store_commits"]) / count, *cpu, *loop)
    finally:
        c.close()
        admin.close()
        worker.kill()
        worker.wait()


def one_run(tmp, secure, batches, count, sync=True, pipeline=None):
    """The enqueue rate, then the round trip on another shard process and store: the
    fan-outs stay queued (no worker ran them), and a worker connecting to that shard would
    drain them while the round trips are timed, which would then not be idle."""
    out = []
    for phase in ("enqueue", "rtt"):
        port = free_port()
        config = write_config(tmp, secure, port, sync, pipeline)
        endpoint = f"tcp://127.0.0.1:{port}"
        proc = start_shard(config)
        try:
            wait_for(endpoint, keys_of(tmp, secure, "app"))
            if phase == "enqueue":
                out.append(enqueue_rate(endpoint, keys_of(tmp, secure, "app"), batches))
            else:
                out.extend(rtt(endpoint, tmp, secure, count, proc.pid))
        finally:
            stop(proc)
    return tuple(out)


def fdatasync_ms(tmp, n=200):
    """The median cost of one fdatasync of a 4 KiB page on this disk (what a synced LMDB
    commit pays about twice: the data pages, then the meta page)."""
    path = tmp / "sync-probe"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        times = []
        for i in range(n):
            os.pwrite(fd, b"x" * 4096, (i % 16) * 4096)
            t = time.perf_counter()
            os.fdatasync(fd)
            times.append(time.perf_counter() - t)
    finally:
        os.close(fd)
    return statistics.median(times) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=int, default=100)
    ap.add_argument("--rtt", type=int, default=300)
    ap.add_argument("--commit-pipeline", type=int, default=None,
                    help="transport.commit_pipeline of the shard (default: the config's)")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        endpoint, tmp, secure = args.worker
        return worker_main(endpoint, tmp, secure == "1")
    out = {}
    with tempfile.TemporaryDirectory(prefix="leasehold-wire-") as d:
        tmp = Path(d)
        res = {True: [], False: []}
        nosync = []
        for _ in range(args.repeats):
            for secure in (True, False):
                res[secure].append(one_run(tmp, secure, args.batches, args.rtt,
                                           pipeline=args.commit_pipeline))
            nosync.append(one_run(tmp, True, args.batches, args.rtt, sync=False,
                                  pipeline=args.commit_pipeline))
        out["fdatasync_p50_ms"] = round(fdatasync_ms(tmp), 3)
    med = {s: [statistics.median(col) for col in zip(*res[s], strict=True)] for s in res}
    out["enqueue_wire_per_s"] = round(med[True][0])
    out["idle_rtt_p50_ms"] = round(med[True][1], 3)
    out["idle_rtt_p99_ms"] = round(med[True][2], 3)
    out["commits_per_action"] = round(med[True][3], 2)
    # CPU (user + system, every thread) per action of the RTT phase, by process: the round
    # trip is mostly these in series (the client's includes its ZeroMQ I/O thread: CURVE).
    out["rtt_cpu_ms_shard"] = round(med[True][4], 3)
    out["rtt_cpu_ms_worker"] = round(med[True][5], 3)
    out["rtt_cpu_ms_client"] = round(med[True][6], 3)
    # Where the shard loop's time went per action (Shard.counters decide_ns, commit_ns,
    # send_ns over the RTT phase, means): the rest of the round trip is the hops between
    # the processes and the worker's and client's own work.
    out["rtt_shard_decide_us"] = round(med[True][7], 1)
    out["rtt_shard_commit_us"] = round(med[True][8], 1)
    out["rtt_shard_send_us"] = round(med[True][9], 1)
    out["curve_cost_pct"] = round((med[True][1] / med[False][1] - 1) * 100, 1)
    out["curve_cost_enqueue_pct"] = round((med[False][0] / med[True][0] - 1) * 100, 1)
    out["plain_enqueue_wire_per_s"] = round(med[False][0])
    out["plain_idle_rtt_p50_ms"] = round(med[False][1], 3)
    nos = [statistics.median(col) for col in zip(*nosync, strict=True)]
    out["nosync_enqueue_wire_per_s"] = round(nos[0])
    out["nosync_idle_rtt_p50_ms"] = round(nos[1], 3)
    out["commit_pipeline"] = args.commit_pipeline or 2
    out["repeats"] = args.repeats
    out["fanout_batch"] = 1000
    out["batches"] = args.batches
    out["rtt_actions"] = args.rtt
    out["python"] = platform.python_version()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
