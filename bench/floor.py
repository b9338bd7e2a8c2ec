"""The idle round trip with no scheduler in it: prints ONE JSON object on stdout.

    .venv/bin/python bench/floor.py [--count 2000] [--warmup 300] [--repeats 3]

The floor under ``wire.py``'s ``idle_rtt_p50_ms``: the same three processes and the same
stack (pyzmq ROUTER/DEALER over loopback TCP with CURVE, msgpack, py-lmdb opened as the
store opens a partition: ``sync=True, metasync=False`` and an ``env.sync(True)`` after each
commit, so two flushes a commit), doing only what every idle round trip must: the client
sends an enqueue; the shard writes it and its assignment in one synced commit (a record and
a spec, ~300 bytes each: what an enqueue turn of the real shard writes) and pushes the lease
to the worker; the worker reports SUCCEEDED; the shard writes that in a second synced commit
(one record) and sends the event to the client. No scheduling, no validation, no tokens, no
watch log: each process does a receive, a decode, at most a commit and a send.

* ``bare_rtt_p50_ms`` / ``bare_rtt_p99_ms``: enqueue sent to SUCCEEDED seen, one action at a
  time, ``--count`` of them after ``--warmup``, CURVE on. ``plain_bare_rtt_p50_ms``: the same
  without CURVE.
* ``bare_commit_p50_us``: the shard's synced commit (the transaction's commit and the
  ``env.sync``), median over both commits of every timed action.
* ``bare_cpu_ms_shard`` / ``_worker`` / ``_client``: CPU (user + system, every thread) per
  action in each process: what three Python processes cost with nothing to decide.

Each figure is the median over ``--repeats`` runs (fresh processes and store each).
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

import lmdb
import msgpack
import psutil
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import cpu_seconds, free_port  # noqa: E402  (bench/ is sys.path[0])

RECORD = b"r" * 300
SPEC = b"s" * 300


def _dealer(ctx, endpoint, server_public, keys):
    sock = ctx.socket(zmq.DEALER)
    if server_public is not None:
        sock.curve_serverkey = server_public
        sock.curve_publickey, sock.curve_secretkey = keys
    sock.linger = 0
    sock.connect(endpoint)
    return sock


def shard_main(endpoint, data, public, secret):
    """ROUTER: enqueue -> commit (record + spec) -> lease to the worker and ack; report ->
    commit (record) -> event to the client. ``stats`` answers the commit times."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    if public:
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = public.encode(), secret.encode()
    sock.bind(endpoint)
    env = lmdb.open(data, map_size=1 << 30, max_dbs=4, sync=True, metasync=False)
    records, specs = env.open_db(b"records"), env.open_db(b"specs")
    worker = client = None
    commits = []

    def commit(puts):
        t0 = time.perf_counter_ns()
        with env.begin(write=True) as txn:
            for db, key, value in puts:
                txn.put(key, value, db=db)
        env.sync(True)
        commits.append(time.perf_counter_ns() - t0)

    print("ready", flush=True)
    while True:
        ident, body = sock.recv_multipart()
        msg = msgpack.unpackb(body)
        kind = msg[0]
        if kind == "enqueue":
            client = ident
            key = msg[1].encode()
            commit([(records, key, RECORD), (specs, key, SPEC)])
            sock.send_multipart([worker, msgpack.packb(["lease", msg[1]])])
            sock.send_multipart([client, msgpack.packb(["ack", msg[1]])])
        elif kind == "report":
            commit([(records, msg[1].encode(), RECORD)])
            sock.send_multipart([client, msgpack.packb(["event", msg[1], "SUCCEEDED"])])
        elif kind == "hello":
            worker = ident
            sock.send_multipart([ident, msgpack.packb(["welcome"])])
        elif kind == "stats":
            sock.send_multipart([ident, msgpack.packb(["stats", commits[msg[1]:]])])
            return


def worker_main(endpoint, server_public):
    ctx = zmq.Context()
    keys = zmq.curve_keypair()
    sock = _dealer(ctx, endpoint, server_public.encode() if server_public else None, keys)
    sock.send(msgpack.packb(["hello"]))
    sock.recv()
    print("ready", flush=True)
    while True:
        msg = msgpack.unpackb(sock.recv())
        sock.send(msgpack.packb(["report", msg[1]]))


def _spawn(*args):
    proc = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        proc.wait()
        raise RuntimeError(f"bench/floor.py {args[0]} did not start")
    return proc


def one_run(secure, count, warmup):
    public, secret = (k.decode() for k in zmq.curve_keypair()) if secure else ("", "")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory(prefix="leasehold-floor-") as data:
        procs = []
        ctx = zmq.Context()
        try:
            procs.append(_spawn("--shard", endpoint, data, public, secret))
            procs.append(_spawn("--worker", endpoint, public))
            sock = _dealer(ctx, endpoint, public.encode() if secure else None,
                           zmq.curve_keypair())
            watched = [psutil.Process(procs[0].pid), psutil.Process(procs[1].pid),
                       psutil.Process()]
            times = []
            for i in range(warmup + count):
                if i == warmup:
                    cpu0 = [cpu_seconds(p) for p in watched]
                t0 = time.perf_counter()
                sock.send(msgpack.packb(["enqueue", f"acme/bench/prod/floor/a{i}"]))
                while True:
                    if not sock.poll(30000):
                        raise RuntimeError("bench/floor.py: no answer within 30 s")
                    if msgpack.unpackb(sock.recv())[0] == "event":
                        break
                times.append(time.perf_counter() - t0)
            cpu = [(cpu_seconds(p) - c0) * 1e3 / count for p, c0 in zip(watched, cpu0, strict=True)]
            sock.send(msgpack.packb(["stats", 2 * warmup]))
            if not sock.poll(30000):
                raise RuntimeError("bench/floor.py: no stats within 30 s")
            commits = msgpack.unpackb(sock.recv())[1]
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
            ctx.destroy(linger=0)   # closes the client's socket too, even after an error
    times = sorted(times[warmup:])
    return (statistics.median(times) * 1e3, times[min(len(times) - 1, int(len(times) * 0.99))]
            * 1e3, statistics.median(commits) / 1e3, *cpu)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--shard":
        return shard_main(*sys.argv[2:6])
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker_main(*sys.argv[2:4])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.count < 1 or args.warmup < 0 or args.repeats < 1:
        ap.error("--count and --repeats must be >= 1, --warmup >= 0")
    runs = {True: [], False: []}
    for _ in range(args.repeats):
        for secure in (True, False):
            runs[secure].append(one_run(secure, args.count, args.warmup))

    def med(secure, i):
        return round(statistics.median(r[i] for r in runs[secure]), 3)

    print(json.dumps({
        "bare_rtt_p50_ms": med(True, 0), "bare_rtt_p99_ms": med(True, 1),
        "plain_bare_rtt_p50_ms": med(False, 0), "bare_commit_p50_us": med(True, 2),
        "bare_cpu_ms_shard": med(True, 3), "bare_cpu_ms_worker": med(True, 4),
        "bare_cpu_ms_client": med(True, 5),
        "count": args.count, "repeats": args.repeats, "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }))


if __name__ == "__main__":
    main()
