"""Crash test of the Engine over LMDB: a child process runs the engine on a random workload
(enqueues in batches, ticks, RUNNING and terminal reports, aborts, heartbeats) and logs what
was acknowledged (each line written after the call returned); the parent SIGKILLs it at a
random moment, reloads the store, and checks:

* every acknowledged enqueue exists;
* no generation went backwards (every acknowledged assignment's generation <= the row's);
* no lease has two holders: each in-flight lease has exactly one live holder session, and no
  action that ended has a lease in flight;
* every in-flight count equals a recount from the leases, after the reloaded engine has
  carried on for a while (ticks and reports), not just at load.

Then the next child carries on from the same store, and so on: many kills in a row. The
store runs on the smallest map the config allows (``storage.map_size = "1Mi"``): the busiest
partitions pass it, so maps fill (in write phases and in partition commits after the
commit point), grow, and every restart opens them again at the configured size.
Run by pytest; the same file is the child (``python tests/test_engine_crash.py child ...``).
"""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine import ActionSpec, Engine, ManualClock, Phase, PodGroup, parse_config  # noqa: E402
from engine._codes import TERMINAL_PHASES, LeaseKind, RowState  # noqa: E402

KILLS = 12
WORKERS = {"we": ("east", 40), "ww": ("west", 40)}


def config(path):
    return parse_config({
        "resources": ["cpu", "gpu:H100"],
        "clusters": {"east": {"capacity": {"cpu": 64, "gpu:H100": 16}},
                     "west": {"capacity": {"cpu": 32}}},
        "queues": {"gpu": {"clusters": ["east"]},
                   "cpu": {"scheduling": "GREEDY_CAPACITY", "max_resources": {"cpu": 60},
                           "depth": 100000}},
        "engine": {"default_queue": "cpu", "initial_capacity": 64, "heartbeat_interval": 10},
        "storage": {"path": str(path), "partitions": 4, "shard": "crash", "map_size": "1Mi"},
    })


def child(path, log_path, seed):
    rng = random.Random(seed)
    # A clock that never goes back across incarnations (leases and timers are absolute ns).
    clock = ManualClock(time.time_ns())
    eng = Engine(config(path), clock=clock)
    for wid, (cluster, slots) in WORKERS.items():
        eng.register_worker(wid, cluster, slots)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    live, enqueued = {}, []
    n = 0
    os.write(fd, b"")
    print("READY", flush=True)
    while True:
        op = rng.random()
        if op < 0.35:
            batch = []
            for _ in range(rng.randint(1, 6)):
                n += 1
                tenant = rng.choice(["acme", "beta", "corp", "dyn"])
                name = f"{tenant}/p/d/r{seed}-{n % 7}/a{seed}-{n}"
                if rng.random() < 0.2:
                    batch.append(ActionSpec(id=name, task="t", run_queue="gpu", pods=(
                        PodGroup(role="w", replicas=2, resources={"cpu": 2, "gpu:H100": 4}),)))
                else:
                    batch.append(ActionSpec(id=name, task="t", resources={"cpu": 1}))
            ids = eng.enqueue_many(batch)
            enqueued.extend(ids)
            os.write(fd, "".join(f"E {a}\n" for a in ids).encode())
        elif op < 0.6:
            out = eng.tick()
            for a in out:
                live[a.token] = a
            os.write(fd, "".join(f"A {a.action} {a.kind.value} {a.generation}\n"
                                 for a in out).encode())
        elif op < 0.7 and live:
            eng.report(rng.choice(list(live)), Phase.RUNNING)
        elif op < 0.92 and live:
            tok = rng.choice(list(live))
            a = live.pop(tok)
            if a.kind == LeaseKind.RUN and rng.random() < 0.3:
                eng.report(tok, Phase.FAILED, error_kind="USER", recoverable=True,
                           cleanup=rng.random() < 0.3)
            else:
                eng.report(tok, Phase.SUCCEEDED)
        elif op < 0.95 and enqueued:
            eng.abort(rng.choice(enqueued))
        else:
            clock.advance(rng.choice([0.5, 2.0]))
            for wid in WORKERS:
                eng.heartbeat(wid, [t for t, a in live.items() if a.worker == wid])


def recount_ok(eng):
    view = eng.inspect()
    st, n = view.arrays, view.action_rows
    gen, rel = st.a_gen[:n], st.a_released_gen[:n]
    live = np.flatnonzero((gen != 0) & (rel != gen))
    nq = len(eng.config.queues)
    assert (st.q_adm - st.q_rel == np.bincount(st.a_queue[live], minlength=nq)).all()
    charged = live[st.a_charged[live] == 1]
    c_used = np.zeros_like(st.c_adm, dtype=np.int64)
    np.add.at(c_used, st.a_cluster[charged], st.a_demand[charged])
    assert ((st.c_adm - st.c_rel).astype(np.int64) == c_used).all()
    nw = st.n_workers
    f = view.finalize_rows
    flive = np.flatnonzero((st.fz_gen[:f] != 0) & (st.fz_released_gen[:f] != st.fz_gen[:f]))
    w_used = (np.bincount(st.a_worker[live], minlength=nw)
              + np.bincount(st.fz_worker[flive], minlength=nw))
    assert ((st.w_adm[:nw] - st.w_rel[:nw]).astype(np.int64) == w_used[:nw]).all()


def check(path, log_path):
    eng = Engine(config(path), clock=ManualClock(time.time_ns()))
    try:
        view = eng.inspect()
        st = view.arrays
        lines = Path(log_path).read_text().splitlines()
        # A line cut by the kill is the one in flight: only whole lines were acknowledged.
        for line in lines:
            parts = line.split()
            if parts[0] == "E" and len(parts) == 2:
                # In the table, or ended and its row reclaimed (the outcome retained).
                eng.explain(parts[1])
            elif parts[0] == "A" and len(parts) == 4:
                row = view.find(parts[1])
                if parts[2] != "run":
                    continue
                if row is not None:
                    assert int(st.a_gen[row]) >= int(parts[3]), f"generation back: {line}"
                else:
                    gens = [a.generation or 0 for a in eng.attempts(parts[1])]
                    assert max(gens) >= int(parts[3]), f"generation back: {line}"
        n = view.action_rows
        states = st.a_state[:n]
        in_flight = np.flatnonzero((states == RowState.SENT) | (states == RowState.RUNNING))
        for r in in_flight.tolist():
            rec = view.record(r)
            assert rec.phase not in TERMINAL_PHASES, f"{rec.action} ended but in flight"
            w = int(st.a_worker[r])
            assert w >= 0 and view.worker_at(w) in WORKERS
        # Carry on a little as the next incarnation, then recount.
        for wid, (cluster, slots) in WORKERS.items():
            eng.register_worker(wid, cluster, slots)
        recount_ok(eng)
        for _ in range(5):
            for a in eng.tick():
                eng.report(a.token, Phase.SUCCEEDED)
        recount_ok(eng)
        return n
    finally:
        eng.close()


def test_engine_survives_sigkill_at_random_points(tmp_path):
    rng = random.Random(424242)
    path, log_path = tmp_path / "store", tmp_path / "acked.log"
    rows_seen = []
    for kill in range(KILLS):
        proc = subprocess.Popen(
            [sys.executable, __file__, "child", str(path), str(log_path), str(kill)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = proc.stdout.readline()          # bounded: the child prints READY or dies
            assert line.strip() == "READY", proc.stderr.read()
            time.sleep(rng.uniform(0.05, 0.6))     # a random point in the workload
            assert proc.poll() is None, proc.stderr.read()
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(timeout=30)
        rows_seen.append(check(path, log_path))
    # The workload made progress across incarnations.
    assert rows_seen[-1] > rows_seen[0] > 0


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "child":
    child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
