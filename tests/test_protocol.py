"""The wire protocol (transport/_protocol.py, docs/protocol.md): every message type round-trips;
columns arrive as views of the received frames; every malformed, oversized, unknown-type or
wrong-version message is a ProtocolError naming what was wrong, and nothing else ever comes
out of decode, whatever the bytes (property tests)."""

import dataclasses
import re

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import ActionSpec, ConfigError, Engine, ManualClock, Phase, Timeouts, parse_config
from engine._codes import PHASE_CODE, Verdict
from engine._config import TransportSettings
from storage import MemoryStore
from transport import (
    VERSION,
    Abort,
    Bye,
    Decoder,
    Enqueue,
    EnqueueFanout,
    EnqueueFlyte,
    Error,
    Event,
    Events,
    Explain,
    Heartbeat,
    Leases,
    Message,
    MsgType,
    Ping,
    ProtocolError,
    QueueMetrics,
    QueueUpdate,
    Refused,
    Register,
    Registered,
    Reply,
    Report,
    Status,
    Unwatch,
    Watch,
    decode,
    encode,
    tokens_array,
)

SPEC = {"id": "acme/ml/prod/r1/train", "task": "train", "resources": {"cpu": 2, "memory": "8Gi"},
        "timeouts": {"max_runtime": 60.0}}


def toks(n, start=0):
    return np.arange(start, start + 3 * n, dtype=np.uint64).reshape(n, 3)


def samples():
    """One valid message of every type (most with their optional fields set)."""
    n = 4
    return [
        Enqueue(rid=1, specs=[SPEC, {**SPEC, "id": "acme/ml/prod/r1/eval",
                                     "parent": "acme/ml/prod/r1/train"}]),
        EnqueueFanout(rid=2, template=SPEC, names=["a", "b", "c"], inputs=["s3://x", None, "y"]),
        Abort(rid=3, action="acme/ml/prod/r1/train", reason="user asked"),
        Status(rid=4, actions=["acme/ml/prod/r1/train", "acme/ml/prod/r1/eval"]),
        Explain(rid=5, action="acme/ml/prod/r1/train"),
        QueueMetrics(rid=6, queue="gpu"),
        QueueUpdate(rid=7, queue="gpu", changes={"priority": 900, "max_resources": {"cpu": 8}}),
        Watch(rid=8, run="acme/ml/prod/r1", since=41),
        Unwatch(rid=9, run="acme/ml/prod/r1"),
        Ping(rid=10),
        Reply(rid=11, body={"ids": ["acme/ml/prod/r1/train"], "n": 1, "x": [1.5, None, True]}),
        Error(rid=12, code="NOT_FOUND", message="action acme/ml/prod/r1/x does not exist"),
        Event(run="acme/ml/prod/r1", seq=42, action="acme/ml/prod/r1/train", phase="RUNNING",
              attempt=1, time_ns=1_700_000_000_000_000_000, detail="started"),
        EnqueueFlyte(rid=16, requests=[b"\x0a\x02ab", b"\x12\x00"], kind="queue"),
        Events(run="acme/ml/prod/r1", seq=43, actions=["acme/ml/prod/r1/a", "acme/ml/prod/r1/b"],
               phases=np.array([3, 4], np.uint8), attempts=np.array([1, 2], np.int32),
               time_ns=np.array([5, 6], np.int64), details=[None, "done"]),
        Register(rid=13, worker="east-1", cluster="east", slots=100,
                 capacity={"cpu": 64, "memory": "256Gi"},
                 node_shapes=[{"name": "big", "count": 2, "allocatable": {"cpu": 32}}]),
        Heartbeat(rid=14, tokens=toks(n), free={"cpu": "12", "gpu:H100": 4}),
        Heartbeat(rid=15, tokens=toks(n), node_free={"h100-0": {"gpu:H100": 8},
                                                      "h100-1": {"cpu": "12"}}),
        Report(rid=15, tokens=toks(n),
               phases=np.array([PHASE_CODE[Phase.SUCCEEDED], PHASE_CODE[Phase.FAILED],
                                PHASE_CODE[Phase.RUNNING], PHASE_CODE[Phase.TIMED_OUT]],
                               np.uint8),
               details=[{"i": 1, "error_kind": "SYSTEM", "cause": "OOM", "message": "killed",
                         "recoverable": True},
                        {"i": 3, "cause": "max_runtime", "cleanup": True}]),
        Bye(rid=16, reason="draining"),
        Registered(rid=17, worker="east-1", session=3, heartbeat_interval=10.0, lease_ttl=32.0,
                   max_tokens=1000),
        Leases(tokens=toks(n), kind=np.array([0, 0, 1, 0], np.uint8),
               attempt=np.array([1, 1, 2, 1], np.int32), group=np.array([0, 0, 1, 0], np.int32),
               deadline_ns=np.array([-1, 5, 6, -1], np.int64),
               queued_deadline_ns=np.array([7, -1, -1, 8], np.int64),
               groups=[{"run": "acme/ml/prod/r1", "spec": SPEC},
                       {"run": "acme/ml/prod/r2", "spec": {**SPEC, "id": "acme/ml/prod/r2/x"}}],
               names=["a", "b", "x", "c"], inputs=["i0", None, None, "i3"],
               nodes=[["h100-0", "h100-1"], None, None, ["h100-2"]]),
        Refused(rid=18, tokens=toks(2), verdicts=np.array([Verdict.STALE, Verdict.ABORTED],
                                                          np.uint8)),
        Refused(rid=None, tokens=toks(1), verdicts=np.array([Verdict.ABORTED], np.uint8)),
        Refused(rid=19, tokens=toks(0), verdicts=np.zeros(0, np.uint8)),
        Error(rid=None, code="BAD_MESSAGE", message=""),
        Reply(rid=20),
    ]


SAMPLES = samples()
BY_TYPE = {}
for _m in SAMPLES:
    BY_TYPE.setdefault(_m.TYPE, _m)     # the first sample of each type


def wire(msg):
    """The frames of ``msg`` as bytes, as they travel."""
    return [bytes(memoryview(f).cast("B")) for f in encode(msg)]


def fields(msg):
    """A message's fields, arrays as (dtype, shape, bytes), for comparison."""
    out = {}
    for f in dataclasses.fields(msg):
        v = getattr(msg, f.name)
        out[f.name] = (v.dtype.str, v.shape, v.tobytes()) if isinstance(v, np.ndarray) else v
    return out


def test_events_unpack_to_the_events_they_carry():
    evs = Events(run="a/b/c/d", seq=7, actions=["a/b/c/d/x", "a/b/c/d/y"],
                 phases=np.array([3, 4], np.uint8), attempts=np.array([1, 1], np.int32),
                 time_ns=np.array([10, 20], np.int64), details=[None, "ok"])
    got = decode(wire(evs)).events()
    assert [(e.seq, e.action, e.phase, e.attempt, e.time_ns, e.detail) for e in got] == [
        (7, "a/b/c/d/x", "RUNNING", 1, 10, None), (8, "a/b/c/d/y", "SUCCEEDED", 1, 20, "ok")]


def test_every_message_type_has_a_sample():
    assert {type(m).TYPE for m in SAMPLES} == set(MsgType)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_type_round_trips(msg):
    frames = wire(msg)
    assert frames[0] == bytes([VERSION << 5 | int(msg.TYPE)])
    got = decode(frames)
    assert type(got) is type(msg)
    assert fields(got) == fields(msg)
    assert wire(got) == frames


def test_frame_zero_is_one_byte_of_version_and_type():
    frames = wire(Ping(rid=1))
    assert frames[0] == bytes([0b001_01010])
    assert msgpack.unpackb(frames[1]) == {"rid": 1}


def test_columns_are_views_of_the_received_frames_and_travel_without_a_copy():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        for s in (a, b):
            s.linger = 0
        a.bind("inproc://columns")
        b.connect("inproc://columns")
        tokens = toks(1000)
        a.send_multipart(encode(Heartbeat(rid=7, tokens=tokens)), copy=False)
        assert b.poll(2000)
        frames = b.recv_multipart(copy=False)
        msg = decode(frames)
        assert msg.tokens.shape == (1000, 3) and msg.tokens.dtype == np.dtype("<u8")
        assert np.array_equal(msg.tokens, tokens)
        assert np.shares_memory(msg.tokens, np.frombuffer(frames[2].buffer, np.uint8))
    finally:
        a.close()
        b.close()
        ctx.term()


def test_tokens_array_takes_bytes_lists_and_arrays():
    t = toks(3)
    raw = t.astype("<u8").tobytes()
    assert np.array_equal(tokens_array(raw), t)
    assert np.array_equal(tokens_array([raw[:24], raw[24:48], raw[48:]]), t)
    assert np.array_equal(tokens_array(t), t)
    with pytest.raises(ValueError, match="not whole 24-byte tokens"):
        tokens_array(raw[:-1])


# ---------------------------------------------------------------------------------------------
# Every kind of malformed message, and what the error says


def header(msg):
    return msgpack.unpackb(wire(msg)[1])


def with_header(msg, change=None, drop=()):
    """``msg``'s frames with its header edited: ``change`` keys set, ``drop`` keys removed."""
    frames = wire(msg)
    h = msgpack.unpackb(frames[1])
    h.update(change or {})
    for k in drop:
        h.pop(k, None)
    frames[1] = msgpack.packb(h, use_bin_type=True)
    return frames


def refused(frames, code, text, limits=None):
    with pytest.raises(ProtocolError) as info:
        Decoder(limits).decode(frames) if limits is not None else decode(frames)
    assert info.value.code == code
    assert text in str(info.value), str(info.value)
    return info.value


HB = Heartbeat(rid=9, tokens=toks(5))


def test_wrong_version_and_unknown_type():
    refused([bytes([2 << 5 | MsgType.PING]), b"\x80"], "BAD_VERSION",
            "protocol version 2 is not supported (this side speaks 1)")
    refused([b"\x00", b"\x80"], "BAD_VERSION", "protocol version 0")
    refused([bytes([1 << 5 | 31]), b"\x80"], "UNKNOWN_TYPE", "unknown message type 31")
    refused([b"", b"\x80"], "BAD_MESSAGE", "frame 0 must be 1 byte")
    refused([b"\x21\x00", b"\x80"], "BAD_MESSAGE", "it is 2 bytes")


def test_frame_counts():
    refused([wire(HB)[0]], "BAD_MESSAGE", "at least 2 frames")
    refused([], "BAD_MESSAGE", "this one has 0")
    refused(wire(HB)[:2], "BAD_MESSAGE", "2 frames; it takes 3 (type byte, header, tokens)")
    refused(wire(Ping(rid=1)) + [b"x"], "BAD_MESSAGE", "3 frames; it takes 2")
    refused(wire(HB) + [b""] * 14, "TOO_LARGE", "too many frames: 17 > 16 (transport.max_frames)")
    refused("not frames", "BAD_MESSAGE", "not a list of byte frames")
    refused([1, 2], "BAD_MESSAGE", "not a list of byte frames")
    refused(None, "BAD_MESSAGE", "not a list of byte frames")


def test_header_must_be_a_msgpack_map():
    f0 = wire(HB)[0]
    refused([f0, b"\xc1"], "BAD_MESSAGE", "HEARTBEAT header is not valid msgpack")
    refused([f0, b""], "BAD_MESSAGE", "not valid msgpack")
    refused([f0, b"\x80\x80"], "BAD_MESSAGE", "not valid msgpack: ExtraData")
    refused([f0, msgpack.packb([1, 2])], "BAD_MESSAGE", "HEARTBEAT header must be a map, not list")
    refused([f0, msgpack.packb({1: 2})], "BAD_MESSAGE", "not valid msgpack")
    refused([f0, b"\x91" * 3000], "BAD_MESSAGE", "not valid msgpack")     # nesting past the stack
    refused([f0, msgpack.packb({"rid": msgpack.ExtType(5, b"x")})], "BAD_MESSAGE",
            "'rid' must be an integer, not ExtType")
    # A large header unpacks with explicit bounds, and refuses extension types at once.
    big = {"rid": msgpack.ExtType(5, b"x"), "free": {f"r{i:060d}": 1 for i in range(100)}}
    refused([f0, msgpack.packb(big)], "BAD_MESSAGE", "extension type 5 is not allowed")
    wide = {"rid": 1, "n": 0, "free": {"cpu": [0] * 200_000}}
    refused([f0, msgpack.packb(wide), b""], "BAD_MESSAGE", "exceeds max_array_len")


def test_keys_are_checked_by_name():
    e = refused(with_header(HB, drop=["rid"]), "BAD_MESSAGE", "HEARTBEAT: missing key 'rid'")
    assert e.rid is None and e.type == MsgType.HEARTBEAT
    e = refused(with_header(HB, {"colour": 1}), "BAD_MESSAGE", "unknown key(s) 'colour'")
    assert e.rid == 9       # the header was readable: the error reply can echo the request id
    refused(with_header(HB, drop=["n"]), "BAD_MESSAGE", "missing key 'n'")
    refused(with_header(HB, {"n": "5"}), "BAD_MESSAGE", "'n' must be an integer, not str")
    refused(with_header(HB, {"rid": "9"}), "BAD_MESSAGE", "'rid' must be an integer, not str")
    refused(with_header(HB, {"rid": -1}), "BAD_MESSAGE", "'rid' = -1 is out of range")
    refused(with_header(HB, {"rid": True}), "BAD_MESSAGE", "'rid' must be an integer, not bool")
    refused(with_header(HB, {"free": [1]}), "BAD_MESSAGE", "'free' must be a map")
    refused(with_header(HB, {"free": {"cpu": -1}}), "BAD_MESSAGE", "free.cpu = -1")
    refused(with_header(Register(rid=1, worker="w", cluster="east", slots=1), {"slots": 0}),
            "BAD_MESSAGE", "'slots' = 0 is out of range 1..")
    refused(with_header(Register(rid=1, worker="w", cluster="east", slots=1),
                        {"worker": "w 1"}), "BAD_MESSAGE", "'worker' = 'w 1' is not a name")
    refused(with_header(Event(run="a/b/c/d", seq=1, action="a/b/c/d/e", phase="RUNNING",
                              attempt=1, time_ns=0), {"phase": "DANCING"}),
            "BAD_MESSAGE", "'phase' = 'DANCING' is not one of QUEUED")
    fl = EnqueueFlyte(rid=1, requests=[b"x"])
    refused(with_header(fl, {"requests": ["text"]}), "BAD_MESSAGE",
            "requests[0] must be bytes, not str")
    refused(with_header(fl, {"requests": [b""]}), "BAD_MESSAGE", "has 0 bytes")
    refused(with_header(fl, {"kind": "other"}), "BAD_MESSAGE", "'kind'")
    evs = Events(run="a/b/c/d", seq=1, actions=["a/b/c/d/e"], phases=np.array([3], np.uint8),
                 attempts=np.array([1], np.int32), time_ns=np.array([0], np.int64))
    refused(with_header(evs, {"actions": ["a/b/c/d/e", "a/b/c/d/f"]}), "BAD_MESSAGE",
            "'actions' has 2 items for 1 events")
    bad = Events(run="a/b/c/d", seq=1, actions=["a/b/c/d/e"], phases=np.array([99], np.uint8),
                 attempts=np.array([1], np.int32), time_ns=np.array([0], np.int64))
    refused(wire(bad), "BAD_MESSAGE", "'phases'[0] = 99 is not a phase code")
    refused(with_header(Watch(rid=1, run="a/b/c/d"), {"run": "a/b/c"}), "BAD_MESSAGE",
            "is not a run key tenant/project/domain/run")
    refused(with_header(Abort(rid=1, action="a/b/c/d/e"), {"action": "a/b"}), "BAD_MESSAGE",
            "is not an action id")
    # A final newline is not part of any name ("$" would have matched before it).
    refused(with_header(Watch(rid=1, run="a/b/c/d"), {"run": "a/b/c/d\n"}), "BAD_MESSAGE",
            "is not a run key tenant/project/domain/run")
    refused(with_header(Abort(rid=1, action="a/b/c/d/e"), {"action": "a/b/c/d/e\n"}),
            "BAD_MESSAGE", "is not an action id")
    refused(with_header(Registered(rid=1, worker="w", session=1, heartbeat_interval=1.0,
                                   lease_ttl=3.0, max_tokens=10), {"lease_ttl": float("nan")}),
            "BAD_MESSAGE", "'lease_ttl' must be a finite number > 0")
    refused(with_header(Error(rid=1, code="X", message=""), {"code": "lower"}),
            "BAD_MESSAGE", "is not an error code")


def test_free_form_values_must_be_plain_data():
    q = QueueUpdate(rid=1, queue="gpu", changes={"priority": 1})
    refused(with_header(q, {"changes": {}}), "BAD_MESSAGE", "'changes' must not be empty")
    refused(with_header(q, {"changes": {"x": b"bytes"}}), "BAD_MESSAGE",
            "changes.x holds bytes, not plain data")
    refused(with_header(q, {"changes": {"x": float("inf")}}), "BAD_MESSAGE",
            "changes.x = inf is not a finite number")
    deep = 1
    for _ in range(20):
        deep = [deep]
    refused(with_header(q, {"changes": {"x": deep}}), "BAD_MESSAGE", "nests deeper than 16")
    ts = [wire(q)[0], msgpack.packb({"rid": 1, "queue": "q",
                                     "changes": {"t": msgpack.Timestamp(1, 0)}}, datetime=False)]
    refused(ts, "BAD_MESSAGE", "changes.t holds Timestamp")
    e = Enqueue(rid=1, specs=[SPEC])
    refused(with_header(e, {"specs": []}), "BAD_MESSAGE", "'specs' must have at least 1")
    refused(with_header(e, {"specs": [{"task": "t"}]}), "BAD_MESSAGE", "specs[0] has no 'id'")
    refused(with_header(e, {"specs": [SPEC, 5]}), "BAD_MESSAGE", "specs[1] must be a map")
    refused(with_header(e, {"specs": [{**SPEC, "parent": 7}]}), "BAD_MESSAGE",
            "specs[0].parent' must be a string")


def test_columns_must_match_n_and_their_dtype():
    frames = wire(HB)
    refused(frames[:2] + [frames[2][:-1]], "BAD_MESSAGE",
            "'tokens' frame of 119 bytes is not a multiple of 24 (24 bytes a row)")
    refused(frames[:2] + [frames[2][:-24]], "BAD_MESSAGE",
            "'tokens' frame of 96 bytes is 4 rows, not n = 5")
    r = wire(BY_TYPE[MsgType.REPORT])
    assert decode(r).TYPE == MsgType.REPORT
    refused(r[:3] + [r[3] + b"\x00"], "BAD_MESSAGE",
            "'phases' frame of 5 bytes is 5 rows, not n = 4")
    refused(with_header(HB, {"n": -1}), "BAD_MESSAGE", "'n' = -1; at least 0")


def test_column_values_are_in_range():
    rep = BY_TYPE[MsgType.REPORT]
    bad = dataclasses.replace(rep, phases=np.array([0, 1, 99, 2], np.uint8))
    refused(wire(bad), "BAD_MESSAGE", "'phases'[2] = 99 is not a phase code")
    refused(with_header(rep, {"details": [{"i": 4}]}), "BAD_MESSAGE",
            "'details'[0].i = 4 is not a row (n = 4)")
    refused(with_header(rep, {"details": [{"i": 1}, {"i": 1}]}), "BAD_MESSAGE", "appears twice")
    refused(with_header(rep, {"details": [{"i": 1, "why": "?"}]}), "BAD_MESSAGE",
            "details[0]: unknown key(s) 'why'")
    refused(with_header(rep, {"details": [{"i": 1}, {"i": 2, "message": 5}]}), "BAD_MESSAGE",
            "details[1]: 'message' must be a string, not int")
    ref = BY_TYPE[MsgType.REFUSED]
    refused(wire(dataclasses.replace(ref, verdicts=np.array([0, 1], np.uint8))), "BAD_MESSAGE",
            "'verdicts'[0] = 0 is not a refusal verdict")
    refused(wire(dataclasses.replace(ref, verdicts=np.array([1, 9], np.uint8))), "BAD_MESSAGE",
            "'verdicts'[1] = 9")
    lz = BY_TYPE[MsgType.LEASES]
    refused(wire(dataclasses.replace(lz, group=np.array([0, 0, 2, 0], np.int32))), "BAD_MESSAGE",
            "'group'[2] = 2 is not an index into 'groups' (0..1)")
    refused(wire(dataclasses.replace(lz, kind=np.array([0, 3, 0, 0], np.uint8))), "BAD_MESSAGE",
            "'kind'[1] = 3 is not a lease kind")
    refused(wire(dataclasses.replace(lz, attempt=np.array([1, 0, 1, 1], np.int32))),
            "BAD_MESSAGE", "'attempt'[1] = 0 is not an attempt number")
    refused(wire(dataclasses.replace(lz, deadline_ns=np.array([-1, -2, 0, 0], np.int64))),
            "BAD_MESSAGE", "'deadline_ns'[1] = -2")
    refused(wire(dataclasses.replace(lz, names=["a"])), "BAD_MESSAGE", "'names' has 1 items for 4")
    refused(wire(dataclasses.replace(lz, inputs=[None])), "BAD_MESSAGE", "'inputs' has 1 items")
    fan = BY_TYPE[MsgType.ENQUEUE_FANOUT]
    refused(wire(dataclasses.replace(fan, inputs=["x"])), "BAD_MESSAGE",
            "'inputs' has 1 items for 3 names")
    refused(wire(dataclasses.replace(fan, names=["a", 5])), "BAD_MESSAGE",
            "names[1] must be a string, not int")


def test_lease_columns_of_a_large_message_are_checked_as_a_small_ones_are():
    # LEASES bounds are checked as lists for a few leases and by numpy above that: both
    # name the first bad entry of the first bad column the same way.
    lz = BY_TYPE[MsgType.LEASES]
    n = 40
    big = dataclasses.replace(
        lz, tokens=np.tile(lz.tokens[:1], (n, 1)), kind=np.zeros(n, np.uint8),
        attempt=np.ones(n, np.int32), group=np.zeros(n, np.int32),
        deadline_ns=np.full(n, -1, np.int64), queued_deadline_ns=np.full(n, -1, np.int64),
        names=[f"a{i}" for i in range(n)], inputs=None, nodes=None)
    assert decode(wire(big)).names == big.names
    for key, i, value, text in (
            ("kind", 31, 3, "'kind'[31] = 3 is not a lease kind"),
            ("attempt", 17, 0, "'attempt'[17] = 0 is not an attempt number"),
            ("group", 22, len(lz.groups), f"'group'[22] = {len(lz.groups)} is not an index"),
            ("group", 5, -1, "'group'[5] = -1 is not an index"),
            ("queued_deadline_ns", 39, -5, "'queued_deadline_ns'[39] = -5")):
        col = getattr(big, key).copy()
        col[i] = value
        refused(wire(dataclasses.replace(big, **{key: col})), "BAD_MESSAGE", text)


def test_size_limits_name_the_setting():
    refused(wire(Heartbeat(rid=1, tokens=toks(1001))), "TOO_LARGE",
            "HEARTBEAT: too many tokens: 1001 > 1000 (transport.max_tokens)")
    assert len(decode(wire(Heartbeat(rid=1, tokens=toks(1000)))).tokens) == 1000
    small = TransportSettings(max_tokens=10, max_batch=3, max_fanout=5, max_name=64,
                              max_text=64, max_header_bytes=1024, max_frame_bytes=1024,
                              max_frames=4)
    refused(wire(Heartbeat(rid=1, tokens=toks(11))), "TOO_LARGE", "11 > 10", small)
    assert len(Decoder(small).decode(wire(Heartbeat(rid=1, tokens=toks(10)))).tokens) == 10
    refused(wire(Status(rid=1, actions=["a/b/c/d/e"] * 4)), "TOO_LARGE",
            "too many items in 'actions': 4 > 3 (transport.max_batch)", small)
    refused(wire(EnqueueFanout(rid=1, template=SPEC, names=list("abcdef"))), "TOO_LARGE",
            "6 > 5 (transport.max_fanout)", small)
    # Each name within max_name, but not the action id it makes with its run (15 + 1 + 49):
    # STATUS, EXPLAIN and ABORT of it would be refused.
    refused(wire(EnqueueFanout(rid=1, template=SPEC, names=["a", "n" * 49])), "TOO_LARGE",
            "'names'[1]: the action id is 65 characters, over the limit 64", small)
    assert Decoder(small).decode(wire(EnqueueFanout(rid=1, template=SPEC,
                                                    names=["n" * 48]))).names == ["n" * 48]
    refused(wire(Abort(rid=1, action="a/b/c/d/e", reason="x" * 65)), "TOO_LARGE",
            "'reason' is 65 characters, over the limit 64", small)
    refused(wire(Enqueue(rid=1, specs=[{**SPEC, "pad": "x" * 2000}])), "TOO_LARGE",
            "ENQUEUE header of 2", small)
    refused(wire(Refused(rid=1, tokens=toks(50), verdicts=np.ones(50, np.uint8))), "TOO_LARGE",
            "too many rows: 50 > 3", small)
    big = TransportSettings(max_batch=100, max_frame_bytes=1024)
    refused(wire(Refused(rid=1, tokens=toks(50), verdicts=np.ones(50, np.uint8))), "TOO_LARGE",
            "'tokens' frame of 1200 bytes > 1024 (transport.max_frame_bytes)", big)
    refused(wire(HB) + [b"", b""], "TOO_LARGE", "too many frames: 5 > 4", small)


def test_limits_come_from_the_transport_config_table():
    base = {"resources": ["cpu"], "clusters": {"east": {}}}
    cfg = parse_config({**base, "transport": {"max_tokens": 10, "hwm": 50}})
    assert cfg.transport.max_tokens == 10 and cfg.transport.hwm == 50
    assert cfg.transport.max_batch == TransportSettings().max_batch
    refused(wire(Heartbeat(rid=1, tokens=toks(11))), "TOO_LARGE", "11 > 10", cfg.transport)
    for table, text in (({"max_tokenz": 1}, "transport.max_tokenz: unknown key"),
                        ({"max_frames": 1}, "transport.max_frames: 1 is invalid; allowed: an "
                                            "integer >= 2"),
                        ({"hwm": "many"}, "transport.hwm: 'many' is invalid")):
        with pytest.raises(ConfigError, match=re.escape(text)):
            parse_config({**base, "transport": table})


def test_an_error_carries_the_request_id_when_the_header_was_readable():
    e = refused(with_header(Explain(rid=77, action="a/b/c/d/e"), {"action": 5}), "BAD_MESSAGE",
                "'action' must be a string")
    assert e.rid == 77
    e = refused([wire(HB)[0], b"\xc1"], "BAD_MESSAGE", "not valid msgpack")
    assert e.rid is None


# ---------------------------------------------------------------------------------------------
# The columnar drain goes on the wire as it is


def test_a_dispatch_batch_becomes_leases_and_its_tokens_come_back_as_heartbeat_and_report():
    cfg = parse_config({"resources": ["cpu"], "clusters": {"east": {"capacity": {"cpu": 64}}},
                        "queues": {"q": {"scheduling": "GREEDY_CAPACITY"}},
                        "engine": {"default_queue": "q"}})
    eng = Engine(cfg, clock=ManualClock(), store=MemoryStore())
    try:
        eng.register_worker("east-1", "east", 100)
        template = ActionSpec(id="acme/p/d/r/map", task="sq", resources={"cpu": 1},
                              timeouts=Timeouts(deadline=600))
        eng.enqueue_fanout(template, [f"n{k}" for k in range(20)],
                           inputs=[f"s3://in/{k}" for k in range(20)])
        eng.enqueue_many([ActionSpec(id="acme/p/d/r2/solo", task="t", resources={"cpu": 1})])
        eng.clock.advance(1)
        eng.schedule()
        batch = eng.drain_columns()
        assert len(batch) == 21

        # Shard side: each group's spec once, the columns as they are.
        uniq, first, inverse = np.unique(batch.group, return_index=True, return_inverse=True)
        groups = []
        for i in first:
            g = batch.group_of(int(i))
            aid = batch.action(int(i))
            groups.append({"run": f"{aid.tenant}/{aid.project}/{aid.domain}/{aid.run}",
                           "spec": dataclasses.asdict(g.compiled.spec)})
        names, inputs = [], []
        for i in range(len(batch)):
            names.append(batch.action(i).action)
            inputs.append(batch.group_of(i).input_ref(int(batch.index[i])))
        deadlines = [a.deadline_ns if a.deadline_ns is not None else -1
                     for a in batch.assignments()]
        msg = Leases(tokens=batch.tokens, kind=batch.kind, attempt=batch.attempt,
                     group=inverse.astype(np.int32), deadline_ns=np.array(deadlines, np.int64),
                     queued_deadline_ns=np.full(len(batch), -1, np.int64), groups=groups,
                     names=names, inputs=inputs)

        # Worker side: the ids, inputs and tokens it needs, then heartbeat and report them.
        got = decode(wire(msg))
        ids = [f"{got.groups[g]['run']}/{nm}" for g, nm in zip(got.group, got.names, strict=True)]
        assert ids == [str(batch.action(i)) for i in range(len(batch))]
        assert got.inputs[:3] == inputs[:3] and got.inputs[0] is not None
        assert ActionSpec.from_dict(got.groups[0]["spec"]) == batch.group_of(0).compiled.spec
        assert got.tokens.tobytes() == batch.tokens.tobytes()
        hb = decode(wire(Heartbeat(rid=1, tokens=got.tokens, free={"cpu": 40})))
        assert eng.heartbeat("east-1", hb.tokens, free_capacity=hb.free) == []
        codes = np.full(len(batch), PHASE_CODE[Phase.SUCCEEDED], np.uint8)
        rep = decode(wire(Report(rid=2, tokens=hb.tokens, phases=codes)))
        from engine._codes import PHASES
        assert eng.report_many(rep.tokens, [PHASES[c] for c in rep.phases],
                               worker="east-1") == []
        assert eng.phase("acme/p/d/r/n7") == Phase.SUCCEEDED
        # A stale token comes back refused; the refusal goes on the wire as REFUSED.
        out = eng.heartbeat("east-1", hb.tokens[:2])
        assert [r.verdict for r in out] == [Verdict.COMPLETED] * 2
        ref = decode(wire(Refused(rid=1, tokens=[r.token for r in out],
                                  verdicts=np.array([r.verdict for r in out], np.uint8))))
        assert ref.tokens.tobytes() == hb.tokens[:2].tobytes()
    finally:
        eng.close()


# ---------------------------------------------------------------------------------------------
# Properties: decode never raises anything but ProtocolError


def decoded_or_refused(frames, decoder=None):
    try:
        msg = (decoder or Decoder()).decode(frames)
    except ProtocolError as exc:
        assert exc.code in ("BAD_VERSION", "UNKNOWN_TYPE", "TOO_LARGE", "BAD_MESSAGE")
        assert str(exc)
        return None
    assert isinstance(msg, Message)
    # Whatever decodes is a message that encodes back to something that decodes the same.
    again = decode(wire(msg))
    assert fields(again) == fields(msg)
    return msg


SMALL = Decoder(TransportSettings(max_tokens=8, max_batch=8, max_fanout=8, max_name=64,
                                  max_text=64, max_header_bytes=2048, max_frame_bytes=2048,
                                  max_frames=8))

# Generation speed checks are timing: on a shared 2-core machine they fail by load alone.
SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]

plain_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats()
    | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.text(max_size=6) | st.integers(0, 3), inner, max_size=4),
    max_leaves=12)


@settings(max_examples=400, deadline=None, suppress_health_check=SLOW_OK)
@given(st.lists(st.binary(max_size=64), max_size=10))
def test_random_frames_are_refused_or_decoded(frames):
    decoded_or_refused(frames)
    decoded_or_refused(frames, SMALL)


@settings(max_examples=400, deadline=None, suppress_health_check=SLOW_OK)
@given(st.integers(0, 255), st.lists(st.binary(max_size=64), max_size=6), plain_values)
def test_any_type_byte_with_random_headers(byte, rest, value):
    decoded_or_refused([bytes([byte]), msgpack.packb(value, use_bin_type=True), *rest])
    if isinstance(value, dict):
        decoded_or_refused([bytes([byte]), msgpack.packb(value, use_bin_type=True), *rest],
                           SMALL)


@st.composite
def mutated(draw):
    """A valid message of any type, then one to three byte or frame mutations."""
    frames = wire(draw(st.sampled_from(SAMPLES)))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "cut", "grow", "drop", "dup", "swap", "insert"]))
        i = draw(st.integers(0, len(frames) - 1)) if frames else 0
        if op == "drop" and frames:
            frames.pop(i)
        elif op == "dup" and frames:
            frames.insert(i, frames[i])
        elif op == "swap" and len(frames) > 1:
            j = draw(st.integers(0, len(frames) - 1))
            frames[i], frames[j] = frames[j], frames[i]
        elif op == "insert":
            frames.insert(i, draw(st.binary(max_size=32)))
        elif frames:
            f = bytearray(frames[i])
            if op == "flip" and f:
                k = draw(st.integers(0, len(f) - 1))
                f[k] ^= 1 << draw(st.integers(0, 7))
            elif op == "cut" and f:
                f = f[:draw(st.integers(0, len(f) - 1))]
            elif op == "grow":
                f += draw(st.binary(min_size=1, max_size=32))
            frames[i] = bytes(f)
    return frames


@settings(max_examples=1500, deadline=None, suppress_health_check=SLOW_OK)
@given(mutated())
def test_mutated_valid_messages_are_refused_or_decoded(frames):
    decoded_or_refused(frames)
    decoded_or_refused(frames, SMALL)


@st.composite
def mutated_headers(draw):
    """A valid message with one header value replaced by an arbitrary value (a structural
    mutation the byte flips rarely reach), or a key added or removed."""
    msg = draw(st.sampled_from(SAMPLES))
    frames = wire(msg)
    h = msgpack.unpackb(frames[1])
    keys = sorted(h) + ["n", "rid", "extra"]
    key = draw(st.sampled_from(keys))
    if draw(st.booleans()) and key in h:
        del h[key]
    else:
        h[key] = draw(plain_values)
    frames[1] = msgpack.packb(h, use_bin_type=True)
    return frames


@settings(max_examples=1500, deadline=None, suppress_health_check=SLOW_OK)
@given(mutated_headers())
def test_valid_messages_with_any_header_value_changed_are_refused_or_decoded(frames):
    decoded_or_refused(frames)
    decoded_or_refused(frames, SMALL)


def test_decode_takes_bytes_frames_and_buffers_alike():
    frames = encode(BY_TYPE[MsgType.HEARTBEAT])
    as_bytes = [bytes(memoryview(f).cast("B")) for f in frames]
    as_zmq = [zmq.Frame(b) for b in as_bytes]
    as_views = [memoryview(b) for b in as_bytes]
    for form in (frames, as_bytes, as_zmq, as_views, [bytearray(b) for b in as_bytes]):
        assert fields(decode(form)) == fields(BY_TYPE[MsgType.HEARTBEAT])


def test_the_leases_of_a_message_equal_leases_built_by_their_constructor():
    # The worker builds its Lease entries without running __init__ (a cost per lease): they
    # must be the same frozen values the constructor makes.
    from engine._codes import LeaseKind
    from transport import Lease, leases_of

    msg = Leases(tokens=toks(2), kind=np.array([0, 1], np.uint8),
                 attempt=np.array([1, 3], np.int32), group=np.array([0, 0], np.int32),
                 deadline_ns=np.array([-1, 5], np.int64),
                 queued_deadline_ns=np.array([7, -1], np.int64),
                 groups=[{"run": "acme/ml/prod/r1", "spec": SPEC, "env": "e1"}],
                 names=["a", "b"], inputs=["i0", None], nodes=[["h100-0"], None])
    got = leases_of(decode(encode(msg)))
    raw = toks(2).astype("<u8").tobytes()
    want = [Lease(action="acme/ml/prod/r1/a", token=raw[:24], kind=LeaseKind.RUN, attempt=1,
                  spec=SPEC, input_ref="i0", deadline_ns=None, queued_deadline_ns=7,
                  env="e1", nodes=("h100-0",)),
            Lease(action="acme/ml/prod/r1/b", token=raw[24:], kind=LeaseKind.FINALIZE,
                  attempt=3, spec=SPEC, deadline_ns=5, env="e1")]
    assert got == want
    assert repr(got[1]) == repr(want[1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        got[0].attempt = 2
