"""The shard's watch path at scale: prints ONE JSON object on stdout (nothing else).

    .venv/bin/python bench/watch.py [--runs 4] [--actions 10000] [--backstops 5]

One shard in process (memory store, no worker: every action stays queued), ``--runs`` runs of
``--actions`` actions each (one ENQUEUE_FANOUT a run, enqueued before the run is watched, so
a fresh WATCH finds every one of them live), then one client WATCHes each run.

* ``fresh_watch_ms``: the decision thread's time in the handler of one fresh WATCH (the
  run's live actions read and tracked for the re-check), median over the runs.
* ``backstop_recheck_ms``: the re-check of one turn that re-reads tracked live actions (a
  backstop turn, or one going on with the re-check's round), median over ``--backstops`` such
  turns; ``backstop_turn_ms`` such a turn's decision on the decision thread (its messages
  handled, tick, drain, re-check and group encoded; not its commit and sends);
  ``..._max`` the largest.
* ``recheck_reads_per_turn``: tracked live actions re-read in one such turn (median).
* ``ping_ms_p50`` / ``ping_ms_max``: a client's PING round trip while the backstop turns run
  (the latency every other client of the shard sees).
* ``status_ms``: the decision thread's time in the handler of one STATUS of a watched run's
  ``--actions`` ids (at most ``max_batch``; every one still queued), median over
  ``--statuses`` of them (each answered with the phases; the live ones the log does not
  follow yet are followed from their attempt).

Every timing is the difference of two snapshots of ``Shard.counters`` (``watch_ns``,
``status_ns`` and the re-check counters, documented there) around the request, or over a
poll interval holding one re-check turn (``recheck_turns`` moved by one; an interval holding
more gives each of its turns their mean).
"""

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine import parse_config  # noqa: E402
from storage import MemoryStore  # noqa: E402
from transport import Client, Shard  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--actions", type=int, default=10000)
    ap.add_argument("--backstops", type=int, default=5)
    ap.add_argument("--statuses", type=int, default=5)
    args = ap.parse_args()

    times = {"watch": [], "recheck": [], "turn": [], "reads": [], "status": []}
    pings = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = parse_config({
            "resources": ["cpu"],
            "clusters": {"east": {"capacity": {"cpu": 64}}},
            "queues": {"q": {"scheduling": "GREEDY_CAPACITY", "depth": 10_000_000}},
            "engine": {"default_queue": "q", "heartbeat_interval": 1.0},
            "storage": {"path": str(Path(tmp) / "data"), "partitions": 2},
            "transport": {"endpoints": [f"ipc://{tmp}/shard.sock"],
                          "max_fanout": max(args.actions, 1)},
            "security": {"insecure": True}})
        shard = Shard(cfg, store=MemoryStore()).start()
        try:
            c = Client(endpoint=shard.endpoint, timeout=120.0)
            try:
                runs = [f"acme/bench/prod/r{i}" for i in range(args.runs)]
                spec = {"id": "", "task": "t", "resources": {"cpu": 1}}
                for run in runs:
                    c.enqueue_fanout(dict(spec, id=f"{run}/x"),
                                     [f"a{i}" for i in range(args.actions)])
                for run in runs:
                    before = shard.counters["watch_ns"]
                    c.subscribe(run)
                    times["watch"].append(shard.counters["watch_ns"] - before)
                asked = [f"{runs[0]}/a{i}" for i in range(min(args.actions, 10_000))]
                for _ in range(args.statuses):
                    before = shard.counters["status_ns"]
                    c.status(asked)
                    times["status"].append(shard.counters["status_ns"] - before)
                deadline = time.monotonic() + 600
                last = shard.counters
                while len(times["recheck"]) < args.backstops and time.monotonic() < deadline:
                    t0 = time.perf_counter_ns()
                    c.ping()
                    pings.append(time.perf_counter_ns() - t0)
                    time.sleep(0.002)
                    now = shard.counters
                    turns = now["recheck_turns"] - last["recheck_turns"]
                    if turns:
                        for key, name in (("recheck", "recheck_ns"),
                                          ("turn", "recheck_turn_ns"),
                                          ("reads", "recheck_reads")):
                            times[key].append((now[name] - last[name]) / turns)
                    last = now
            finally:
                c.close()
        finally:
            shard.stop()

    def ms(xs, f=statistics.median):
        return round(f(xs) / 1e6, 3) if xs else None

    out = {
        "runs": args.runs, "actions": args.actions,
        "fresh_watch_ms": ms(times["watch"]),
        "backstop_recheck_ms": ms(times["recheck"]),
        "backstop_recheck_ms_max": ms(times["recheck"], max),
        "backstop_turn_ms": ms(times["turn"]),
        "backstop_turn_ms_max": ms(times["turn"], max),
        "recheck_reads_per_turn": statistics.median(times["reads"]) if times["reads"] else None,
        "ping_ms_p50": ms(pings), "ping_ms_max": ms(pings, max),
        "status_ms": ms(times["status"]), "status_ms_max": ms(times["status"], max),
        "python": platform.python_version(), "cpu_count": os.cpu_count(),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
