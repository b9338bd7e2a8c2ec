"""Drive steady-state kernel ticks for callgrind (instructions per tick / per candidate).

    valgrind --tool=callgrind --instr-atstart=no --dump-instr=yes \\
        --toggle-collect='__pyx_f_4cext_5_tick_10TickKernel__run' \\
        --callgrind-out-file=/tmp/tick.callgrind \\
        .venv/bin/python bench/callgrind_tick.py --control
    callgrind_annotate /tmp/tick.callgrind cext/_tick.c

Warms the bench workload up natively-fast (instrumentation off), then switches callgrind's
instrumentation on (``--control`` runs ``callgrind_control -i on`` on this process) and runs
``--ticks`` kernel ticks with the usual untimed churn between them; ``--toggle-collect`` keeps
only what runs inside the kernel's ``_run``. Prints one JSON line (ticks, candidates examined,
placements) so instructions can be divided per tick and per candidate; the number of ticks
callgrind saw is the call count of ``_run`` in its output.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from workload import SEED, Workload  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--warmup", type=int, default=600)
    ap.add_argument("--ticks", type=int, default=100)
    ap.add_argument("--gate", choices=("enforce", "off"), default="enforce")
    ap.add_argument("--admission", choices=("shapes", "nodes"), default="shapes",
                    help="every cluster's admission (nodes: pods placed on nodes)")
    ap.add_argument("--plain-pools", action="store_true",
                    help="warm-pool queues submit plain pods (implied by --admission nodes)")
    ap.add_argument("--control", action="store_true",
                    help="run `callgrind_control -i on` after the warm-up")
    args = ap.parse_args(argv)

    w = Workload(seed=args.seed, resource_gate=args.gate, admission=args.admission,
                 plain_pools=args.plain_pools or None)
    w.warm_up(args.warmup)
    if args.control:
        # callgrind_control talks to valgrind, which answers while this process runs code:
        # do not block on it; keep running plain Python (outside the collected function, so
        # no tick is counted before the measured ones) until it has returned.
        proc = subprocess.Popen(["callgrind_control", "-i", "on", str(os.getpid())],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while proc.poll() is None:
            sum(range(10_000))
            time.sleep(0.001)
    eng = w.engine
    ticks = cands = placed = 0
    for _ in range(args.ticks):
        w.advance()
        # The real path; callgrind collects only the kernel (--toggle-collect).
        placed += eng.schedule()
        cands += w.candidates_last_tick()
        ticks += 1
        w.after_tick()
    print(json.dumps({"ticks": ticks, "candidates": cands, "placed": placed,
                      "candidates_per_tick": cands / ticks, "gate": args.gate,
                      "admission": args.admission, "plain_pools": w.plain_pools}))


if __name__ == "__main__":
    main()
