"""Wire protocol benchmark: prints ONE JSON object on stdout (nothing else).

    .venv/bin/python bench/protocol.py [--repeats N]

For each message below, ``*_encode_us`` times :func:`transport.encode` (the frames ready for
``send_multipart(copy=False)``) and ``*_decode_us`` times :func:`transport.decode` on the
frames as ``zmq.Frame`` objects, as a ROUTER hands them over with ``copy=False`` (the columns
become views of those frames). Each figure is the median over ``--repeats`` runs (default 3)
of the mean over a timed loop sized to about 0.2 s; ``*_per_s`` are the rates they imply.

* ``heartbeat_1000``: HEARTBEAT of 1,000 tokens (the per-message maximum) with a free
  capacity map; ``heartbeat_tokens_decoded_per_s`` is tokens per second through decode.
* ``report_1000``: REPORT of 1,000 tokens and phase codes, 1% of them failures with details.
* ``leases_1000``: LEASES of 1,000 leases of one fan-out group (one spec, 1,000 names and
  input references), the shape the columnar drain produces.
* ``refused_100``: REFUSED of 100 tokens with verdicts (a heartbeat answer).
* ``fanout_1000``: ENQUEUE_FANOUT of one template and 1,000 names.
* ``enqueue_100``: ENQUEUE of 100 distinct specs (the per-spec plain-data check shows here).
* ``ping``: the smallest request, the fixed cost of any message.
"""

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import zmq  # noqa: E402

from engine._codes import PHASE_CODE, Phase  # noqa: E402
from transport import (  # noqa: E402
    Enqueue,
    EnqueueFanout,
    Heartbeat,
    Leases,
    Ping,
    Refused,
    Report,
    decode,
    encode,
)

SPEC = {"id": "acme/ml/prod/r1/map", "task": "square", "resources": {"cpu": 1, "memory": "2Gi"},
        "timeouts": {"max_runtime": 600.0}, "retries": {"count": 2}}


def tokens(n):
    rng = np.random.default_rng(7)
    return rng.integers(0, 1 << 63, size=(n, 3), dtype=np.int64).astype(np.uint64)


def messages():
    n = 1000
    phases = np.full(n, PHASE_CODE[Phase.SUCCEEDED], np.uint8)
    phases[::100] = PHASE_CODE[Phase.FAILED]
    details = [{"i": i, "error_kind": "USER", "message": "ValueError: bad input",
                "recoverable": True} for i in range(0, n, 100)]
    return {
        "heartbeat_1000": Heartbeat(rid=1, tokens=tokens(n), free={"cpu": 4000, "memory": "8Gi"}),
        "report_1000": Report(rid=2, tokens=tokens(n), phases=phases, details=details),
        "leases_1000": Leases(
            tokens=tokens(n), kind=np.zeros(n, np.uint8), attempt=np.ones(n, np.int32),
            group=np.zeros(n, np.int32), deadline_ns=np.full(n, -1, np.int64),
            queued_deadline_ns=np.full(n, -1, np.int64),
            groups=[{"run": "acme/ml/prod/r1", "spec": SPEC}],
            names=[f"n{i}" for i in range(n)], inputs=[f"s3://bucket/in/{i}" for i in range(n)]),
        "refused_100": Refused(rid=3, tokens=tokens(100), verdicts=np.ones(100, np.uint8)),
        "fanout_1000": EnqueueFanout(rid=4, template=SPEC, names=[f"n{i}" for i in range(n)]),
        "enqueue_100": Enqueue(rid=5, specs=[{**SPEC, "id": f"acme/ml/prod/r{i}/a"}
                                             for i in range(100)]),
        "ping": Ping(rid=6),
    }


def per_call_us(fn, target_s=0.2):
    """Mean microseconds of ``fn()`` over a loop sized to about ``target_s``."""
    fn()
    k = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        dt = time.perf_counter() - t0
        if dt >= target_s / 4 or k >= 1 << 20:
            break
        k *= 4
    k = max(1, int(k * target_s / max(dt, 1e-9)))
    t0 = time.perf_counter()
    for _ in range(k):
        fn()
    return (time.perf_counter() - t0) / k * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    out = {}
    for name, msg in messages().items():
        frames = [zmq.Frame(bytes(memoryview(f).cast("B"))) for f in encode(msg)]
        decode(frames)      # it is valid
        enc = statistics.median(per_call_us(lambda m=msg: encode(m)) for _ in range(args.repeats))
        dec = statistics.median(per_call_us(lambda f=frames: decode(f))
                                for _ in range(args.repeats))
        out[f"{name}_encode_us"] = round(enc, 2)
        out[f"{name}_decode_us"] = round(dec, 2)
        out[f"{name}_decode_per_s"] = round(1e6 / dec)
        out[f"{name}_bytes"] = sum(len(f.buffer) for f in frames)
    out["heartbeat_tokens_decoded_per_s"] = round(1000 * out["heartbeat_1000_decode_per_s"])
    out["repeats"] = args.repeats
    out["python"] = platform.python_version()
    out["pyzmq"] = zmq.__version__
    print(json.dumps(out))


if __name__ == "__main__":
    main()
