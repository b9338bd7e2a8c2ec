"""The shard's shared-memory status (transport/_status.py) and the Prometheus metrics read from
it (transport/_metrics.py): layout round trip, the seqlock under a writer process hammering
publish, refusal of another layout, a live shard whose published figures match queue_metrics,
the collector's families over a registry and over HTTP, the queue wait by reason (each lease's
reason is what explain said just before the tick that placed it), and a shard process frozen
with SIGSTOP whose status and metrics still answer (nothing reads them through the shard).
Every wait is bounded; every thread, process, socket and mapping is closed in teardown."""

import contextlib
import json
import mmap
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import tomllib
import urllib.request
from pathlib import Path

import numpy as np
import psutil
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine import ActionSpec, Phase, Refusal, parse_config
from engine._codes import RowState, Verdict, WaitCode
from storage import MemoryStore
from tests.conftest import free_port, make_engine, until
from transport import (
    Client,
    ClusterStatus,
    QueueStatus,
    Shard,
    ShardError,
    ShardTimeout,
    StatusBusy,
    StatusCollector,
    StatusError,
    StatusLayoutError,
    StatusReader,
    StatusSnapshot,
    StatusWriter,
    WorkerConnection,
    serve_metrics,
    snapshot_dict,
    status_path,
)
from transport._metrics import METRIC_NAMES
from transport._status import (
    LAYOUT_HASH,
    LAYOUT_VERSION,
    SHARD_COUNTERS,
    SPARE_QUEUES,
    WAIT_REASONS,
    _layout_hash,
)

ROOT = Path(__file__).resolve().parent.parent
RUN = "acme/ml/prod/r1"


def config_data(tmp_path, queues=None, **status):
    return {
        "resources": ["cpu", "memory"],
        "clusters": {"east": {"capacity": {"cpu": 4, "memory": "64Gi"}}, "west": {}},
        "queues": queues or {
            "fifo": {"scheduling": "STRICT_FIFO", "depth": 10000, "clusters": ["east"]},
            "greedy": {"scheduling": "GREEDY_CAPACITY", "depth": 10000},
        },
        "engine": {"default_queue": "fifo", "heartbeat_interval": 1.0},
        "storage": {"path": str(tmp_path / "data"), "partitions": 2},
        "transport": {"endpoints": ["tcp://127.0.0.1:0"]},
        "security": {"insecure": True},
        "status": status,
    }


def action(name, queue="fifo", cpu=1, run="r"):
    return ActionSpec(id=f"acme/p/d/{run}/{name}", task="t", resources={"cpu": cpu},
                      task_queue=queue)


@pytest.fixture
def held_engine(tmp_path):
    """An engine whose STRICT_FIFO head waits for capacity: 4 of 1 cpu run on east (4 cpu),
    5 queue behind them."""
    eng, clock = make_engine(config_data(tmp_path))
    eng.enqueue_many([action(f"a{i}") for i in range(9)] + [action("g", "greedy")])
    eng.schedule()
    yield eng, clock
    eng.close()


@pytest.fixture
def writer(held_engine):
    eng, _ = held_engine
    w = StatusWriter(eng.config, 0)
    yield w
    w.close()


# ------------------------------------------------------------------------- round trip


def test_status_path_defaults_under_storage_and_follows_status_dir(tmp_path):
    cfg = parse_config(config_data(tmp_path))
    assert status_path(cfg, 3) == tmp_path / "data" / "run" / "shard-3.status"
    cfg = parse_config(config_data(tmp_path, dir=str(tmp_path / "elsewhere")))
    assert status_path(cfg, 0) == tmp_path / "elsewhere" / "shard-0.status"


def test_a_snapshot_round_trips_what_the_engine_and_the_loop_recorded(held_engine, writer):
    eng, clock = held_engine
    clock.advance(2.5)
    batch = eng.drain_columns()
    writer.record_turn(batch, eng.clock.now_ns())
    writer.record_tick(30_000)              # 30 us
    writer.record_tick(2_000_000)           # 2 ms
    writer.record_commit(700_000)
    writer.record_commit(3_000_000, ok=False)
    writer.record_refusals("heartbeat", [Refusal(b"\0" * 24, Verdict.STALE)] * 2)
    writer.record_refusals("report", [])
    writer.record_error("NOT_FOUND")
    writer.record_error("SOMETHING_NEW")
    writer.set_reload(0.25)
    counters = {k: i for i, k in enumerate(SHARD_COUNTERS)}
    gen = writer.publish(eng, counters)
    with StatusReader(writer.path) as r:
        s = r.snapshot()
    assert isinstance(s, StatusSnapshot) and s.generation == gen and s.state == "running"
    assert (s.shard_index, s.pid, s.resources) == (0, os.getpid(), ("cpu", "memory"))
    assert list(s.queues) == ["fifo", "greedy"] and list(s.clusters) == ["east", "west"]
    metrics = eng.queue_metrics()
    for name, q in s.queues.items():
        m = metrics[name]
        assert isinstance(q, QueueStatus)
        assert (q.depth, q.actions_in_flight, q.runs_in_flight, q.backfilled) == (
            m["depth"], m["actions_in_flight"], m["runs_in_flight"], m["backfilled"])
        assert q.in_flight_resources == m["in_flight_resources"]
        hb = m["head_blocked"]
        if hb is None:
            assert q.head_blocked is None
        else:
            assert (q.head_blocked.action, q.head_blocked.code, q.head_blocked.reason,
                    q.head_blocked.since_ns) == (hb["action"], hb["code"], hb["reason"],
                                                 hb["since_ns"])
            assert q.head_blocked.eta_ns == m["head_eta_ns"]
    fifo = s.queues["fifo"]
    assert fifo.strict and fifo.depth == 5 and fifo.head_blocked.code == "CLUSTER_CAPACITY"
    assert fifo.head_blocked.blocked_s == pytest.approx(2.5)
    assert fifo.dispatched == 4 and fifo.wait.count == 4
    assert fifo.wait.sum == pytest.approx(4 * 2.5) and fifo.wait.quantile(0.5) == 5.0
    east, west = s.clusters["east"], s.clusters["west"]
    assert isinstance(east, ClusterStatus)
    assert east.capacity == {"cpu": 4000, "memory": 64 << 30}
    assert east.in_flight_resources == eng.cluster_in_flight("east") == {"cpu": 4000,
                                                                         "memory": 0}
    assert east.free["cpu"] == 0 and east.leases_in_flight == 4 and east.dispatched == 4
    assert (east.workers_connected, east.slots) == (1, 1000)
    assert west.capacity == {"cpu": None, "memory": None} and west.free["cpu"] is None
    assert s.dispatches == len(batch) == 5
    assert s.tick_latency.counts[2] == 1 and s.tick_latency.count == 2    # 30 us <= 50 us
    assert s.tick_latency.sum == pytest.approx(0.00203)
    assert s.commit_latency.count == 2 and (s.commits, s.commit_failures) == (1, 1)
    assert s.heartbeat_refusals["STALE"] == 2 and "OK" not in s.heartbeat_refusals
    assert sum(s.report_refusals.values()) == 0
    assert s.errors["NOT_FOUND"] == 1 and s.errors["OTHER"] == 1
    assert s.reload_s == 0.25 and s.counters["turns"] == counters["turns"]
    assert s.last_turn_ns > 0 and s.tick_no == eng.tick_count
    assert json.dumps(snapshot_dict(s))         # plain data
    writer.close()
    with StatusReader(writer.path) as r:
        assert r.snapshot().state == "stopped"


def test_the_raw_copy_is_the_layout_and_every_record_carries_the_generation(held_engine,
                                                                             writer):
    eng, _ = held_engine
    writer.publish(eng)
    with StatusReader(writer.path) as r:
        raw = r.read()
        assert os.path.getsize(writer.path) == r.layout.file_bytes
        assert raw.dtype == r.layout.body and r.layout.queue_slots == 2 + SPARE_QUEUES
        gen = int(raw["shard"]["generation"])
        assert gen == writer.generation
        assert (raw["queues"]["generation"] == gen).all()
        assert (raw["clusters"]["generation"] == gen).all()
        with pytest.raises(ValueError):
            raw["shard"]["generation"] = 0          # a read-only copy


def test_counters_must_name_every_shard_counter(held_engine, writer):
    eng, _ = held_engine
    with pytest.raises(KeyError, match="no 'received'"):
        writer.publish(eng, {"turns": 1})


def test_the_publish_interval_and_a_dirty_mark(held_engine, tmp_path):
    eng, _ = held_engine
    with StatusWriter(eng.config, 0, tmp_path / "s.status", interval=10.0) as w:
        assert w.due()                  # never published
        w.publish(eng)
        assert not w.due()
        assert w.due(time.monotonic_ns() + 11 * 10**9)
        w.mark_dirty()
        assert w.due()


# ------------------------------------------------------------------------- queues added live


def test_a_queue_added_live_takes_a_spare_slot_then_the_file_is_remade(tmp_path):
    small = config_data(tmp_path)
    eng, clock = make_engine(small)
    w = StatusWriter(eng.config, 0)
    eng.enqueue_many([action("a0"), action("a1")])
    clock.advance(3.0)
    eng.schedule()
    w.record_turn(eng.drain_columns(), eng.clock.now_ns())      # two waits of 3 s
    w.publish(eng)
    r = StatusReader(w.path)
    ino = os.stat(w.path).st_ino
    one_more = dict(small, queues={**small["queues"], "late": {"depth": 10}})
    eng2, _ = make_engine(one_more)
    w.publish(eng2)                 # same resources and clusters, one queue appended
    assert os.stat(w.path).st_ino == ino and list(r.snapshot().queues) == [
        "fifo", "greedy", "late"]
    many = dict(small, queues={**one_more["queues"], **{f"q{i}": {} for i in range(20)}})
    eng3, _ = make_engine(many)
    w.publish(eng3)                 # past the spare slots: a larger file renamed over it
    assert os.stat(w.path).st_ino != ino
    s = r.snapshot()                # the reader follows the rename
    assert len(s.queues) == 23 and r.layout.queue_slots >= 23 + SPARE_QUEUES
    # ... and the larger file kept the queue wait published before it.
    assert s.queues["fifo"].wait_by_reason["NONE"].count == 2
    assert s.queues["fifo"].wait.sum == pytest.approx(6.0)
    reordered = dict(small, queues={"greedy": {}, "fifo": {}})
    eng4, _ = make_engine(reordered)
    with pytest.raises(ValueError, match="only appended"):
        w.publish(eng4)
    r.close()
    w.close()
    for e in (eng, eng2, eng3, eng4):
        e.close()


def test_a_writer_refuses_an_engine_of_other_resources(held_engine, writer, tmp_path):
    other = config_data(tmp_path)
    other["resources"] = ["cpu", "memory", "gpu:H100"]
    eng, _ = make_engine(other)
    with pytest.raises(ValueError, match="resources or clusters"):
        writer.publish(eng)
    eng.close()


# ------------------------------------------------------------------------- refusals


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_a_reader_of_another_layout_refuses_clearly(held_engine, writer, tmp_path):
    eng, _ = held_engine
    writer.publish(eng)
    raw = Path(writer.path).read_bytes()
    cases = {
        "hash": (16, bytes(16), StatusLayoutError,
                 f"layout version {LAYOUT_VERSION} .*hash 0000"),
        "version": (8, (7).to_bytes(4, "little"), StatusLayoutError, "version 7"),
        "magic": (0, b"NOTMAGIC", StatusError, "not a Leasehold status file"),
    }
    for name, (offset, data, exc, text) in cases.items():
        p = tmp_path / f"{name}.status"
        p.write_bytes(raw)
        _patch(p, offset, data)
        with pytest.raises(exc, match=text):
            StatusReader(p)
    short = tmp_path / "short.status"
    short.write_bytes(raw[:-8])
    with pytest.raises(StatusError, match="damaged"):
        StatusReader(short)
    with pytest.raises(StatusError, match="no status file"):
        StatusReader(tmp_path / "missing.status")
    # The hash covers the declaration: any change of a field list changes it.
    import transport._status as st
    fields = st.QUEUE_FIELDS
    try:
        st.QUEUE_FIELDS = fields + (("extra", "<i8", ()),)
        assert _layout_hash() != LAYOUT_HASH
    finally:
        st.QUEUE_FIELDS = fields
    assert _layout_hash() == LAYOUT_HASH


def test_a_sequence_left_odd_makes_a_bounded_read_fail_naming_the_writer(held_engine, writer):
    eng, _ = held_engine
    writer.publish(eng)
    r = StatusReader(writer.path, timeout=0.05)
    seq = 2 * writer.generation
    _patch(writer.path, 32, (seq + 1).to_bytes(8, "little"))     # as if killed mid-copy
    t0 = time.monotonic()
    with pytest.raises(StatusBusy, match=f"pid {os.getpid()}, is alive"):
        r.read()
    assert time.monotonic() - t0 < 1.0 and r.retries > 0
    _patch(writer.path, 32, seq.to_bytes(8, "little"))
    assert int(r.read()["shard"]["generation"]) == writer.generation
    r.close()


# ------------------------------------------------------------------------- the seqlock


HAMMER = r"""
import json, sys, time
from pathlib import Path
from engine import ActionSpec, Engine, ManualClock, parse_config
from storage import MemoryStore
from transport import StatusWriter

cfg = parse_config(json.loads(sys.argv[1]))
eng = Engine(cfg, clock=ManualClock(), store=MemoryStore())
eng.register_worker("w", "east", 100)
eng.enqueue_many([ActionSpec(id=f"acme/p/d/r/a{i}", task="t", resources={"cpu": 1},
                             task_queue="fifo") for i in range(9)])
eng.schedule()
w = StatusWriter(cfg, 0, sys.argv[2])
w.publish(eng)
stop = Path(sys.argv[3])
print("ready", flush=True)
deadline = time.monotonic() + 30
n = 0
while time.monotonic() < deadline:
    for _ in range(50):
        w.publish(eng)
    n += 50
    if stop.exists():
        break
w.close()
print(n, flush=True)
"""


def test_the_seqlock_never_returns_a_torn_snapshot_under_a_writer_process(tmp_path):
    # Many queue slots make the body long (~45 KB), so a copy racing the writer's is likely.
    queues = {"fifo": {"scheduling": "STRICT_FIFO", "clusters": ["east"]},
              **{f"q{i:02d}": {} for i in range(63)}}
    data = config_data(tmp_path, queues=queues)
    path, stop = tmp_path / "hammer.status", tmp_path / "stop"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", HAMMER, json.dumps(data), str(path),
                             str(stop)], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        r = StatusReader(path, timeout=1.0)
        reads, gens = 0, set()
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            raw = r.read()
            gen = raw["shard"]["generation"]
            assert (raw["queues"]["generation"] == gen).all(), "torn: queue records"
            assert (raw["clusters"]["generation"] == gen).all(), "torn: cluster records"
            assert raw["queues"]["depth"][0] == 5
            reads += 1
            gens.add(int(gen))
        # The writer really was publishing all along: most reads saw a new generation.
        assert reads > 100 and len(gens) > 50, (reads, len(gens))
        if (os.cpu_count() or 1) >= 2:
            # The check has teeth: copies of the same bytes without the seqlock do tear (on
            # this 2-core VM about a quarter of them), and the seqlock threw some away.
            assert r.retries > 0
            lo, hi = r.layout.body_offset, r.layout.file_bytes
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                torn = False
                end = time.monotonic() + 1.5
                while not torn and time.monotonic() < end:
                    raw = np.ndarray((), r.layout.body, buffer=m[lo:hi])
                    torn = not (raw["queues"]["generation"] == raw["shard"]["generation"]).all()
                assert torn, "no torn copy without the seqlock: the test proves nothing here"
        r.close()
        stop.touch()
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0 and int(out.split()[-1]) > 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


# ------------------------------------------------------------------------- a live shard


class Live:
    """A shard on a thread, a client and a worker, closed at the end."""

    def __init__(self, tmp_path, **status):
        self.config = parse_config(config_data(tmp_path, **status))
        self.shard = Shard(self.config, endpoint="tcp://127.0.0.1:0",
                           store=MemoryStore()).start()
        self.closing = []
        self.path = status_path(self.config, 0)

    def client(self):
        c = Client(endpoint=self.shard.endpoint, keys=None, timeout=5.0)
        self.closing.append(c)
        return c

    def worker(self, name="east-1", cluster="east", slots=100):
        w = WorkerConnection(self.shard.endpoint, None, name, cluster, slots, timeout=5.0)
        self.closing.append(w)
        w.connect()
        return w

    def close(self):
        for c in reversed(self.closing):
            c.close()
        self.shard.stop()


@pytest.fixture
def live(tmp_path):
    h = Live(tmp_path, interval=0.01)
    yield h
    h.close()


def spec(name, **kw):
    return {"id": f"{RUN}/{name}", "task": "t", "resources": {"cpu": 1}, **kw}


def _until(read, check, timeout=5.0):
    """``read()`` until ``check(value)`` holds (returns it) or ``timeout`` passes (fails with
    the last value)."""
    end = time.monotonic() + timeout
    while True:
        value = read()
        if check(value):
            return value
        if time.monotonic() > end:
            pytest.fail(f"not reached in {timeout}s: {value!r}")
        time.sleep(0.01)


def _published(q):
    hb = q.head_blocked
    return {"depth": q.depth, "actions_in_flight": q.actions_in_flight,
            "runs_in_flight": q.runs_in_flight, "in_flight_resources": q.in_flight_resources,
            "backfilled": q.backfilled,
            "head": None if hb is None else (hb.action, hb.code)}


def _asked(m):
    hb = m["head_blocked"]
    return {k: m[k] for k in ("depth", "actions_in_flight", "runs_in_flight",
                              "in_flight_resources", "backfilled")} | {
        "head": None if hb is None else (hb["action"], hb["code"])}


def test_a_shard_publishes_what_queue_metrics_answers(live):
    c = live.client()
    w = live.worker()
    ids = c.enqueue_many([spec(f"a{i}") for i in range(9)])
    leases = w.leases(timeout=5, want=4)            # east holds 4 cpu
    assert len(leases) == 4
    r = StatusReader(live.path)
    try:
        asked = _asked(c.queue_metrics("fifo"))
        assert asked["depth"] == 5 and asked["head"] == (ids[4], "CLUSTER_CAPACITY")
        s = _until(r.snapshot, lambda s: _published(s.queues["fifo"]) == asked)
        east = s.clusters["east"]
        assert east.in_flight_resources["cpu"] == 4000 and east.leases_in_flight == 4
        assert (east.workers_connected, east.slots, east.dispatched) == (1, 100, 4)
        assert s.queues["fifo"].dispatched == 4 and s.queues["fifo"].wait.count == 4
        assert s.tick_latency.count >= 1 and s.commit_latency.count >= 1 and s.commits >= 1
        assert s.reload_s > 0 and s.counters["turns"] >= 1 and s.state == "running"
        # Refusals by verdict and errors by code reach the status too.
        forged = bytearray(leases[0].token)
        forged[8] ^= 1
        assert len(w.heartbeat([bytes(forged)])) == 1
        with pytest.raises(ShardError):
            c.explain(f"{RUN}/nothing")
        _until(r.snapshot, lambda s: sum(s.heartbeat_refusals.values()) >= 1
               and s.errors["NOT_FOUND"] >= 1)
        # Two finish: two more run; the published figures follow queue_metrics again.
        w.report([x.token for x in leases[:2]], Phase.SUCCEEDED)
        w.leases(timeout=5, want=2)
        asked = _asked(c.queue_metrics("fifo"))
        assert asked["depth"] == 3
        _until(r.snapshot, lambda s: _published(s.queues["fifo"]) == asked)
    finally:
        r.close()
    live.shard.stop()
    with StatusReader(live.path) as r:
        assert r.snapshot().state == "stopped"


def test_the_loop_says_where_its_time_went(live):
    # decide_ns, commit_ns and send_ns (Shard.counters, the status, leasehold_loop_seconds)
    # grow with every turn that handles a request, writes a group and answers it.
    c = live.client()
    r = StatusReader(live.path)
    try:
        before = _until(r.snapshot, lambda s: s.state == "running").counters
        c.enqueue_many([spec("timed")])
        after = _until(r.snapshot, lambda s: s.counters["replies"] > before["replies"]
                       and s.counters["send_ns"] > before["send_ns"]).counters
        for part in ("decide_ns", "commit_ns", "send_ns"):
            assert after[part] > before[part], part
        assert after["store_commits"] > before["store_commits"]
    finally:
        r.close()


def test_a_queue_update_is_published_at_once_whatever_the_interval(tmp_path):
    h = Live(tmp_path, interval=60.0)
    try:
        c = h.client()
        r = StatusReader(h.path)
        first = _until(r.snapshot, lambda s: s.state == "running")
        c.enqueue_many([spec("a")])         # a change, but the next publish is 60 s away
        c.queue_update("fifo", priority=900)
        s = _until(r.snapshot, lambda s: s.queues["fifo"].priority == 900, timeout=2.0)
        assert s.generation > first.generation and s.queues["fifo"].depth == 1
        r.close()
    finally:
        h.close()


# ------------------------------------------------------------------------- metrics


def _families(text):
    return {f.name: f for f in text_string_to_metric_families(text)}


def _scrape(paths):
    """One scrape of a StatusCollector over the status files ``paths``: its families."""
    collector = StatusCollector(paths)
    registry = CollectorRegistry()
    registry.register(collector)
    try:
        return _families(generate_latest(registry).decode())
    finally:
        collector.close()


def _sample(fams, family, sample, **labels):
    for s in fams[family].samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"no {sample}{labels} in {family}")


def test_the_collector_exports_every_family_with_the_shards_figures(held_engine, writer,
                                                                    tmp_path):
    eng, clock = held_engine
    clock.advance(1.0)
    writer.record_turn(eng.drain_columns(), eng.clock.now_ns())
    writer.record_tick(40_000)
    writer.record_commit(800_000)
    writer.record_error("INTERNAL")
    writer.publish(eng)
    fams = _scrape([writer.path, tmp_path / "run" / "shard-7.status"])
    expected = {n.removesuffix("_total") for n in METRIC_NAMES}
    assert expected <= set(fams)
    for name, (kind, _labels, _doc) in METRIC_NAMES.items():
        assert fams[name].type == kind, name
    assert _sample(fams, "leasehold_shard_up", "leasehold_shard_up", shard="0") == 1
    assert _sample(fams, "leasehold_shard_up", "leasehold_shard_up", shard="7") == 0
    q = {"shard": "0", "queue": "fifo"}
    assert _sample(fams, "leasehold_queue_depth", "leasehold_queue_depth", **q) == 5
    assert _sample(fams, "leasehold_queue_actions_in_flight",
                   "leasehold_queue_actions_in_flight", **q) == 4
    assert _sample(fams, "leasehold_queue_resources_in_flight",
                   "leasehold_queue_resources_in_flight", resource="cpu", **q) == 4000
    assert _sample(fams, "leasehold_queue_head_blocked", "leasehold_queue_head_blocked",
                   reason="CLUSTER_CAPACITY", **q) == 1
    assert _sample(fams, "leasehold_queue_head_blocked_seconds",
                   "leasehold_queue_head_blocked_seconds", **q) >= 1.0
    assert _sample(fams, "leasehold_dispatches", "leasehold_dispatches_total", **q) == 4
    assert _sample(fams, "leasehold_queue_wait_seconds", "leasehold_queue_wait_seconds_count",
                   **q) == 4
    assert _sample(fams, "leasehold_queue_wait_seconds", "leasehold_queue_wait_seconds_bucket",
                   le="1.0", **q) == 4
    assert _sample(fams, "leasehold_tick_latency_seconds",
                   "leasehold_tick_latency_seconds_bucket", shard="0", le="5e-05") == 1
    assert _sample(fams, "leasehold_tick_latency_seconds",
                   "leasehold_tick_latency_seconds_count", shard="0") == 1
    assert _sample(fams, "leasehold_commit_latency_seconds",
                   "leasehold_commit_latency_seconds_sum", shard="0") == pytest.approx(0.0008)
    assert _sample(fams, "leasehold_errors", "leasehold_errors_total", shard="0",
                   kind="INTERNAL") == 1
    assert _sample(fams, "leasehold_heartbeat_refusals", "leasehold_heartbeat_refusals_total",
                   shard="0", verdict="STALE") == 0
    c = {"shard": "0", "cluster": "west", "resource": "cpu"}
    assert _sample(fams, "leasehold_cluster_capacity", "leasehold_cluster_capacity",
                   **c) == float("inf")
    assert _sample(fams, "leasehold_cluster_resources_in_flight",
                   "leasehold_cluster_resources_in_flight", **dict(c, cluster="east")) == 4000
    assert _sample(fams, "leasehold_cluster_workers_connected",
                   "leasehold_cluster_workers_connected", shard="0", cluster="east") == 1


def test_serve_metrics_answers_over_http(held_engine, writer):
    eng, _ = held_engine
    writer.publish(eng)
    with serve_metrics([writer.path], "127.0.0.1", 0) as server:
        assert server.port > 0
        with urllib.request.urlopen(server.url, timeout=5) as resp:
            assert resp.status == 200
            text = resp.read().decode()
    fams = _families(text)
    assert _sample(fams, "leasehold_queue_depth", "leasehold_queue_depth", shard="0",
                   queue="fifo") == 5
    # close() let the port go: a new server binds it again.
    serve_metrics([writer.path], "127.0.0.1", server.port).close()


def test_a_port_in_use_is_refused_naming_it(held_engine, writer):
    eng, _ = held_engine
    writer.publish(eng)
    with serve_metrics([writer.path], "127.0.0.1", 0) as server, \
            pytest.raises(OSError, match=f"127.0.0.1:{server.port}"):
        serve_metrics([writer.path], "127.0.0.1", server.port)


def test_a_status_file_of_a_reader_is_never_written(held_engine, writer):
    # A reader maps read-only: the bytes on disk are exactly what the writer published.
    eng, _ = held_engine
    writer.publish(eng)
    before = Path(writer.path).read_bytes()
    with StatusReader(writer.path) as r:
        for _ in range(10):
            r.snapshot()
    assert Path(writer.path).read_bytes() == before
    with open(writer.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert np.frombuffer(m[:8], "S8")[0] == b"LHSTATUS"


def test_publishing_words_heads_without_giving_them_records(held_engine, writer):
    # Inspection.wait (what the writer words heads with) and explain of a queued row read
    # its columns only: a lean row stays lean (off the record paths) however often it is
    # published or explained.
    eng, _ = held_engine
    view = eng.inspect()
    head = view.arrays.q_head[view.queue_index("fifo")]
    before = view.arrays.a_edges.copy()
    for _ in range(3):
        writer.publish(eng)
    code, reason, eta = view.wait(head)
    e = eng.explain(view.action_at(head))
    assert (code, eta) == (e.wait, e.eta_ns) and e.reason.startswith(reason)
    assert (view.arrays.a_edges == before).all()
    assert before[head] == 0            # it was lean to begin with
    sent = view.arrays.a_state[:view.action_rows] == RowState.SENT
    running = int(np.flatnonzero(sent)[0])
    with pytest.raises(ValueError, match="not queued"):
        view.wait(running)


def test_the_grafana_dashboard_is_json_over_exported_metric_names_only():
    dash = json.loads((ROOT / "docs" / "grafana" / "leasehold.json").read_text())
    exported = set()
    for name, (kind, _labels, _doc) in METRIC_NAMES.items():
        exported |= {f"{name}_total"} if kind == "counter" else \
            {name, f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" \
            else {name}
    used = set()
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert panels
    for p in panels:
        assert p["targets"], p["title"]
        for t in p["targets"]:
            used |= set(re.findall(r"leasehold_[a-z_]+", t["expr"]))
    assert used and used <= exported, used - exported
    # Every family the collector exports is on some panel.
    families = {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in used}
    assert set(METRIC_NAMES) <= families, set(METRIC_NAMES) - families
    # ... and the queue wait by its reason label too (what the histogram is for).
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    assert any("leasehold_queue_wait_seconds_bucket" in e and re.search(r"by \([^)]*reason", e)
               for e in exprs), exprs


@pytest.mark.parametrize("table, text", [
    ({"interval": -1}, "status.interval: -1 is invalid; allowed: a number of seconds >= 0"),
    ({"interval": "fast"}, "status.interval"),
    ({"dir": ""}, "status.dir: '' is invalid; allowed: a non-empty directory path"),
    ({"path": "x"}, "status.path: unknown key 'path'; allowed keys: dir, interval"),
])
def test_bad_status_settings_are_refused_naming_the_key(tmp_path, table, text):
    from engine import ConfigError
    with pytest.raises(ConfigError, match=re.escape(text)):
        parse_config(config_data(tmp_path, **table))


def test_a_shard_that_cannot_make_its_status_file_refuses_to_start(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg = parse_config(config_data(tmp_path, dir=str(blocker / "run")))
    shard = Shard(cfg, endpoint="tcp://127.0.0.1:0", store=MemoryStore())
    with pytest.raises(StatusError, match="cannot make the status file") as info:
        shard.start(timeout=10)
    shard.stop()
    # Not a bug of the shard's (it said "leasehold: INTERNAL: ..."): the file cannot be made.
    assert info.value.code == "UNAVAILABLE"


def test_the_status_copies_every_counter_the_shard_keeps(live):
    # SHARD_COUNTERS names each of Shard.counters: a counter added to the loop and not to the
    # layout would be missing from every snapshot.
    assert set(live.shard.counters) == set(SHARD_COUNTERS)


# ------------------------------------------------------------------------- wait reasons


def reason_config(tmp_path):
    """Queues that make actions wait for different reasons: capacity and head-of-line
    (STRICT_FIFO on a 4-cpu cluster), an action cap, runs capped by max_action_concurrency,
    a cluster with no worker yet, and a queue that gets paused."""
    return config_data(tmp_path, queues={
        "fifo": {"scheduling": "STRICT_FIFO", "depth": 1000, "clusters": ["east"]},
        "capped": {"scheduling": "GREEDY_CAPACITY", "action_concurrency": 2, "clusters": ["west"]},
        "runcap": {"scheduling": "GREEDY_CAPACITY", "clusters": ["west"]},
        "lonely": {"scheduling": "GREEDY_CAPACITY", "clusters": ["north"]},
        "paused": {"scheduling": "GREEDY_CAPACITY", "clusters": ["west"]},
    }) | {"clusters": {"east": {"capacity": {"cpu": 4, "memory": "64Gi"}}, "west": {},
                       "north": {}}}


def drive_reason_scenario(eng, clock, steps=24):
    """Ticks of a workload whose actions wait for several reasons, every lease finishing
    two ticks after it was handed out. Before each tick every queued action is explained
    (the public way to ask why it waits). Returns ``[(batch, now_ns, expected), ...]`` per
    tick: ``expected`` is, per entry of the drained batch, the WaitCode explain gave that
    action just before the tick, or NONE for an action enqueued since the previous tick."""
    queued = set()          # ids queued, not placed yet
    before_tick = set()     # ... as the previous tick left them
    running = []            # (finish at step, token)
    out = []
    n = 0

    def enqueue(queue, count, run="r", **kw):
        nonlocal n
        specs = [ActionSpec(id=f"acme/p/d/{run}/x{n + i}", task="t", resources={"cpu": 1},
                            task_queue=queue, **kw) for i in range(count)]
        n += count
        eng.enqueue_many(specs)
        queued.update(s.id for s in specs)

    for step in range(steps):
        if step % 3 == 0:
            enqueue("fifo", 8)
            enqueue("capped", 5, run="c")
            enqueue("runcap", 2, run=f"u{step}", run_max_action_concurrency=2)
            enqueue("runcap", 3, run="u", run_max_action_concurrency=2)
            enqueue("lonely", 1, run="l")
            enqueue("paused", 1, run="p")
        if step == 2:
            eng.update_queue("paused", paused=True)
        if step == 8:
            eng.update_queue("paused", paused=False)
        if step == 10:
            eng.register_worker("w-north", "north", 10)
        for due, token in [x for x in running if x[0] <= step]:
            assert eng.report(token, Phase.SUCCEEDED) == Verdict.OK
            running.remove((due, token))
        said = {a: eng.explain(a).wait for a in queued}
        clock.advance(1.0)
        eng.schedule()
        batch = eng.drain_columns()
        expected = []
        for i in range(len(batch)):
            aid = str(batch.action(i))
            expected.append(said[aid] if aid in before_tick else WaitCode.NONE)
            queued.discard(aid)
            running.append((step + 2, batch.token(i)))
        out.append((batch, eng.clock.now_ns(), expected))
        before_tick = set(queued)
    return out


def test_a_leases_wait_code_is_what_explain_said_just_before_the_tick_that_placed_it(
        tmp_path):
    eng, clock = make_engine(reason_config(tmp_path), workers={
        "w-east": ("east", 1000), "w-west": ("west", 1000)})
    try:
        seen = set()
        for batch, _now, expected in drive_reason_scenario(eng, clock):
            got = [WaitCode(int(c)) for c in batch.wait_code]
            assert got == expected, [str(batch.action(i)) for i in range(len(batch))]
            seen.update(got)
        # The scenario reaches the reasons a placed action can have waited for: its own
        # wait (capacity, no worker), its lane's (a capped run), its queue's scan stop (the
        # action cap, paused), and none at all.
        assert {WaitCode.NONE, WaitCode.CLUSTER_CAPACITY, WaitCode.QUEUE_ACTIONS,
                WaitCode.RUN_ACTIONS, WaitCode.NO_WORKER, WaitCode.QUEUE_PAUSED} <= seen, seen
    finally:
        eng.close()


def test_the_queue_wait_is_published_and_exported_per_queue_and_reason(tmp_path):
    eng, clock = make_engine(reason_config(tmp_path), workers={
        "w-east": ("east", 1000), "w-west": ("west", 1000)})
    w = StatusWriter(eng.config, 0)
    try:
        want = {}           # (queue, reason) -> [count, sum of waits in ns]
        names = eng.inspect().queue_names()
        for batch, now, expected in drive_reason_scenario(eng, clock):
            w.record_turn(batch, now)
            for i, code in enumerate(expected):
                got = want.setdefault((names[int(batch.queue[i])], code.name), [0, 0])
                got[0] += 1
                got[1] += now - int(batch.attempt_enqueued_ns[i])
        w.publish(eng)
        with StatusReader(w.path) as r:
            s = r.snapshot()
        published = {(q.name, reason): [h.count, round(h.sum * 1e9)]
                     for q in s.queues.values() for reason, h in q.wait_by_reason.items()}
        assert published == want
        assert len({reason for _q, reason in want}) >= 5
        for q in s.queues.values():
            # The per-queue histogram is every reason's together, bucket by bucket.
            parts = list(q.wait_by_reason.values())
            total = np.sum([h.counts for h in parts], axis=0).tolist() if parts else \
                [0] * len(q.wait.counts)
            assert list(q.wait.counts) == total
            assert q.wait.sum == pytest.approx(sum(h.sum for h in parts))
            assert list(q.wait_by_reason) == [r for r in WAIT_REASONS if r in q.wait_by_reason]
        fifo = s.queues["fifo"].wait_by_reason
        assert fifo["CLUSTER_CAPACITY"].quantile(1.0) > fifo["NONE"].quantile(1.0)
        d = json.loads(json.dumps(snapshot_dict(s)))        # the --json form carries them
        held = d["queues"]["capped"]["wait_by_reason"]["QUEUE_ACTIONS"]
        assert held["counts"] == list(s.queues["capped"].wait_by_reason["QUEUE_ACTIONS"].counts)
        assert held["counts"] and sum(held["counts"]) == want[("capped", "QUEUE_ACTIONS")][0]

        fams = _scrape([w.path])
        exported = {}
        for sample in fams["leasehold_queue_wait_seconds"].samples:
            key = (sample.labels["queue"], sample.labels["reason"])
            if sample.name == "leasehold_queue_wait_seconds_count":
                exported.setdefault(key, [0, 0])[0] = sample.value
            elif sample.name == "leasehold_queue_wait_seconds_sum":
                exported.setdefault(key, [0, 0])[1] = round(sample.value * 1e9)
        # One series per (queue, reason) that saw a placement, none for the others.
        assert exported == want
    finally:
        w.close()
        eng.close()


def test_every_wait_code_is_a_reason_of_the_status_file():
    # A wait code added to the engine gets a reason of its own (and a new layout hash).
    assert WAIT_REASONS == tuple(c.name for c in WaitCode)
    assert WAIT_REASONS.index("NONE") == WaitCode.NONE


# ------------------------------------------------------------------------- scrapes never wait


SHARD_TOML = """
resources = ["cpu", "memory"]
[clusters.east]
capacity = {{ cpu = 4, memory = "64Gi" }}
[queues.fifo]
scheduling = "STRICT_FIFO"
depth = 1000
[engine]
default_queue = "fifo"
[storage]
path = "{data}"
partitions = 1
[transport]
endpoints = ["tcp://127.0.0.1:{port}"]
[status]
interval = 0.01
metrics = false
[security]
insecure = true
"""


def _running_snapshot(path, pid):
    try:
        with StatusReader(path) as r:
            s = r.snapshot()
    except StatusError:         # not made yet
        return None
    return s if s.state == "running" and s.pid == pid else None


def test_a_stopped_shard_still_answers_scrapes_and_status_reads_with_its_last_figures(
        tmp_path):
    # The mechanism behind "scrapes do not change the shard's tick latency": a scrape and a
    # status read copy the shard's shared memory and never message it nor wait on it. So with
    # the shard process frozen (SIGSTOP), both still answer within their bounds, with what it
    # published last, while a request to the shard itself gets no answer (the control: it
    # really cannot answer anything). Every wait is bounded; the shard is killed at the end.
    cfg_path = tmp_path / "leasehold.toml"
    port = free_port()
    cfg_path.write_text(SHARD_TOML.format(data=tmp_path / "data", port=port))
    path = status_path(parse_config(tomllib.loads(cfg_path.read_text())), 0)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    log = open(tmp_path / "shard.log", "wb")        # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "shard", "--config",
                             str(cfg_path)], env=env, cwd=tmp_path, stdout=log,
                            stderr=subprocess.STDOUT)
    log.close()
    closing = []
    try:
        until(lambda: _running_snapshot(path, proc.pid) or proc.poll() is not None, 60,
              "the shard to publish running")
        assert proc.poll() is None, (tmp_path / "shard.log").read_text()
        client = Client(endpoint=f"tcp://127.0.0.1:{port}", keys=None, timeout=10.0)
        closing.append(client)
        client.enqueue_many([spec(f"a{i}") for i in range(3)])     # no worker: they stay
        reader = StatusReader(path, timeout=0.5)
        closing.append(reader)
        until(lambda: reader.snapshot().queues["fifo"].depth == 3, 10, "depth 3 published")
        server = serve_metrics([path], "127.0.0.1", 0)
        closing.append(server)

        os.kill(proc.pid, signal.SIGSTOP)
        until(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED, 10,
              "the shard to be stopped")
        frozen = reader.snapshot()
        for _ in range(20):
            # Each scrape and each read returns (urlopen raises past its timeout, a read
            # raises StatusBusy past the reader's): nothing in them waits for the shard.
            with urllib.request.urlopen(server.url, timeout=5) as resp:
                fams = _families(resp.read().decode())
            assert _sample(fams, "leasehold_queue_depth", "leasehold_queue_depth",
                           shard="0", queue="fifo") == 3
            assert _sample(fams, "leasehold_shard_up", "leasehold_shard_up", shard="0") == 1
            s = reader.snapshot()
            # The last published figures, and no publish since: the shard is frozen.
            assert s.generation == frozen.generation and s.queues["fifo"].depth == 3
        assert psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED
        # The control: the shard itself answers nothing while stopped.
        probe = Client(endpoint=f"tcp://127.0.0.1:{port}", keys=None, timeout=0.5)
        closing.append(probe)
        with pytest.raises(ShardTimeout):
            probe.queue_metrics("fifo")

        os.kill(proc.pid, signal.SIGCONT)
        # Running again: it publishes again, and the same reader follows.
        until(lambda: reader.snapshot().generation > frozen.generation, 10,
              "a publish after SIGCONT")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        for c in reversed(closing):
            c.close()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def test_a_status_file_on_a_full_disk_is_a_status_error_not_a_bus_error(tmp_path):
    # The file was made sparse (ftruncate) and written through its map: on a full disk the
    # first store was a SIGBUS, and a shard restarted there died with no word. This needs a
    # file system that can be filled: a 1 MiB tmpfs, which only a privileged user mounts.
    fs = tmp_path / "fs"
    fs.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(fs)],
                      capture_output=True).returncode != 0:
        pytest.skip("needs to mount a tmpfs (root): not run here, so not proven here")
    try:
        with open(fs / "filler", "wb") as f:
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
        code = textwrap.dedent(f"""
            from engine import parse_config
            from transport import StatusError, StatusWriter
            cfg = parse_config({{"resources": ["cpu"], "clusters": {{"east": {{}}}},
                                 "queues": {{"q": {{}}}},
                                 "engine": {{"default_queue": "q"}}}})
            try:
                StatusWriter(cfg, 0, {str(fs / "s.status")!r})
            except StatusError as exc:
                print("refused:", exc)
            """)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
        assert "refused:" in done.stdout and "No space left on device" in done.stdout, \
            done.stdout
        assert [p.name for p in fs.iterdir()] == ["filler"]     # no temporary file left
    finally:
        subprocess.run(["umount", str(fs)], capture_output=True)
