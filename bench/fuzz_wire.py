"""The issue's fuzz at full size: 100,000 random and mutated valid messages (of every type)
sent to a shard on loopback; it must stay up, count them, and answer a well-formed client
afterwards. Prints ONE JSON object.

    .venv/bin/python bench/fuzz_wire.py [--count 100000] [--seed 0]

The suite runs the same fuzz (``tests/test_shard.py``) with 5,000 messages.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from storage import MemoryStore  # noqa: E402
from tests.test_shard import base_config, fuzz  # noqa: E402
from transport import Client, Shard  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="leasehold-fuzz-") as d:
        shard = Shard(base_config(Path(d)), store=MemoryStore()).start()
        try:
            t0 = time.perf_counter()
            answers = fuzz(shard.endpoint, args.count, args.seed)
            took = time.perf_counter() - t0
            c = Client(endpoint=shard.endpoint, keys=None, timeout=10.0)
            try:
                alive = c.ping()["version"] == 1
            finally:
                c.close()
            counters = shard.counters
        finally:
            shard.stop()
    print(json.dumps({"sent": args.count, "answers": answers, "seconds": round(took, 1),
                      "received": counters["received"],
                      "protocol_errors": counters["protocol_errors"],
                      "errors": counters["errors"], "replies": counters["replies"],
                      "failed_turns": counters["failed_commits"],
                      "answers_well_formed_client_after": alive}))
    return 0 if alive else 1


if __name__ == "__main__":
    sys.exit(main())
