"""The shard loop over real sockets (tcp on loopback, ephemeral ports): enqueue, dispatch to
a test worker built on WorkerConnection, reports, watches, aborts, refusals, restarts,
authorisation, and a fuzz of random and mutated messages. Every wait is bounded; every
socket, thread and store is closed in teardown."""

import random
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import zmq

from engine import ManualClock, Phase, SpecError, parse_config
from engine._codes import LeaseKind, Verdict
from engine._retain import retained_key
from storage import LmdbStore, MemoryStore, StoreError
from tests.conftest import free_port as _free_port
from transport import (
    Client,
    ClientKeys,
    Enqueue,
    Error,
    Events,
    Ping,
    Refused,
    Shard,
    ShardError,
    ShardTimeout,
    Status,
    Watch,
    WatchLost,
    WorkerConnection,
    decode,
    encode,
    generate_keypair,
    load_client_keys,
    load_secret_key,
)

RUN = "acme/ml/prod/r1"

ROOT = Path(__file__).resolve().parent.parent


def base_config(tmp_path, security=None, scheduling="GREEDY_CAPACITY", **engine):
    data = {
        "resources": ["cpu"],
        "clusters": {"east": {"capacity": {"cpu": 64}}, "west": {"capacity": {"cpu": 64}}},
        "queues": {"q": {"scheduling": scheduling, "depth": 100000}},
        "engine": {"default_queue": "q", "heartbeat_interval": 1.0, **engine},
        "storage": {"path": str(tmp_path / "data"), "partitions": 2},
        "transport": {"endpoints": ["tcp://127.0.0.1:0"], "max_outstanding": 64},
        "security": security or {"insecure": True},
    }
    return parse_config(data)


@pytest.fixture
def keys(tmp_path):
    d = tmp_path / "keys"
    generate_keypair(d, "shard")
    for name in ("east-1", "east-2", "acme-app", "globex-app", "ops", "west-1"):
        generate_keypair(d, name)
    return d


def secure_config(tmp_path, keys, scheduling="GREEDY_CAPACITY", **engine):
    peers = {
        "east-1": {"role": "worker", "cluster": "east"},
        "east-2": {"role": "worker", "cluster": "east"},
        "west-1": {"role": "worker", "cluster": "west"},
        "acme-app": {"role": "client", "tenants": ["acme"]},
        "globex-app": {"role": "client", "tenants": ["globex"]},
        "ops": {"role": "admin"},
    }
    return base_config(tmp_path, {"keys_dir": str(keys), "server_key": "shard",
                                  "peers": peers}, scheduling, **engine)


class Harness:
    """A shard on a thread, and the clients and workers a test makes (closed at the end)."""

    def __init__(self, config, keys_dir=None, store=None):
        self.config = config
        self.keys_dir = keys_dir
        self.store = store
        self.closing = []
        self.shard = None
        self.endpoint = None

    def start(self, endpoint=None, **shard):
        """Start the shard (``shard``: more arguments of :class:`Shard`, e.g. its watch
        log's sizes)."""
        store = self.store() if callable(self.store) else self.store
        self.shard = Shard(self.config, endpoint=endpoint, store=store, **shard).start()
        self.endpoint = self.shard.endpoint
        return self.shard

    def stop(self):
        if self.shard is not None:
            self.shard.stop()
            self.shard = None

    def keys(self, name):
        return None if self.keys_dir is None else load_client_keys(self.keys_dir, name, "shard")

    def client(self, name="acme-app", **kw):
        c = Client(endpoint=self.endpoint, keys=self.keys(name), timeout=5.0, **kw)
        self.closing.append(c)
        return c

    def worker(self, name="east-1", cluster="east", slots=100, connect=True, **kw):
        w = WorkerConnection(self.endpoint, self.keys(name), name, cluster, slots,
                             timeout=5.0, **kw)
        self.closing.append(w)
        if connect:
            w.connect()
        return w

    def silent_peer(self):
        """A raw DEALER connected to the shard that reads only what a test asks it to (its
        queue holds one message): a watcher too slow for its pushes. Closed at the end."""
        ctx = zmq.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.linger = 0
        raw.rcvhwm = 1
        raw.connect(self.endpoint)
        self.closing.append(_Closing(lambda: (raw.close(0), ctx.term())))
        return raw

    def close(self):
        for c in reversed(self.closing):
            c.close()
        self.stop()


class _Closing:
    """Something a Harness closes at the end, by a function."""

    def __init__(self, close):
        self.close = close


@pytest.fixture
def insecure(tmp_path):
    h = Harness(base_config(tmp_path), store=MemoryStore())
    h.start()
    yield h
    h.close()


@pytest.fixture
def secure(tmp_path, keys):
    h = Harness(secure_config(tmp_path, keys), keys_dir=keys,
                store=lambda: LmdbStore(str(tmp_path / "data"), partitions=2))
    h.start()
    yield h
    h.close()


def spec(name, run=RUN, **kw):
    return {"id": f"{run}/{name}", "task": "t", "resources": {"cpu": 1}, **kw}


def test_enqueue_dispatch_report_and_completion_seen_by_watch(secure):
    c = secure.client()
    w = secure.worker()
    c.subscribe(RUN)
    ids = c.enqueue_many([spec("a"), spec("b")])
    assert ids == [f"{RUN}/a", f"{RUN}/b"]
    leases = w.leases(timeout=5, want=2)
    assert sorted(x.action for x in leases) == ids
    assert all(x.attempt == 1 and x.spec["task"] == "t" for x in leases)
    toks = [x.token for x in leases]
    assert w.heartbeat(toks, free={"cpu": 60}) == []
    assert w.report(toks, Phase.RUNNING) == []
    assert w.report(toks, Phase.SUCCEEDED) == []
    done = c.wait(ids, timeout=10)
    assert done == {a: Phase.SUCCEEDED for a in ids}
    # The watch saw every transition of each action, in seq order, gap-free.
    seen = {}
    fresh = secure.client()
    fresh.subscribe(RUN, 0)
    last = None
    while True:
        try:
            e = fresh.next_event(timeout=0.5, runs=(RUN,))
        except Exception:
            break
        if last is not None:
            assert e.seq == last + 1
        last = e.seq
        seen.setdefault(e.action, []).append(e.phase)
    for a in ids:
        assert seen[a] == ["QUEUED", "INITIALIZING", "RUNNING", "SUCCEEDED"]
    # A second copy of an applied report is refused, changing nothing.
    again = w.report(toks[:1], Phase.SUCCEEDED)
    assert [v for _t, v in again] == [Verdict.COMPLETED]


def test_fanout_status_explain_and_metrics(insecure):
    c = insecure.client()
    n = c.enqueue_fanout(spec("map"), [f"n{i}" for i in range(50)],
                         inputs=[f"s3://in/{i}" for i in range(50)])
    assert n == 50
    assert c.status(f"{RUN}/n3") in (Phase.QUEUED, Phase.WAITING_FOR_RESOURCES)
    assert c.explain(f"{RUN}/n3")["phase"] in ("QUEUED", "WAITING_FOR_RESOURCES")
    assert c.queue_metrics("q")["depth"] >= 0
    w = insecure.worker()
    leases = w.leases(timeout=5, want=50)
    assert len(leases) == 50
    assert {x.input_ref for x in leases} == {f"s3://in/{i}" for i in range(50)}


def test_each_lease_carries_its_own_actions_spec_when_two_share_a_template_id(insecure):
    # The shard sends a lease's spec as the client sent it (no rebuild from the compiled
    # spec), found by the spec's id; two fan-outs of one template id queued together went
    # out both with the second's spec (the worker ran the wrong image and task).
    c = insecure.client()
    assert c.enqueue_fanout(spec("map", image="img-one", task="train"), ["a1"]) == 1
    assert c.enqueue_fanout(spec("map", image="img-two", task="eval"), ["b1"]) == 1
    assert c.enqueue(spec("prep", image="img-one", task="prep")) == f"{RUN}/prep"
    assert c.enqueue_fanout(spec("prep", image="img-two", task="shard"), ["s1"]) == 1
    leases = insecure.worker().leases(timeout=5, want=4)
    got = {x.action: (x.spec["task"], x.spec["image"]) for x in leases}
    assert got == {f"{RUN}/a1": ("train", "img-one"), f"{RUN}/b1": ("eval", "img-two"),
                   f"{RUN}/prep": ("prep", "img-one"), f"{RUN}/s1": ("shard", "img-two")}


def test_a_heartbeat_before_register_is_refused_naming_its_type_once(insecure):
    # ("HEARTBEAT: HEARTBEAT: this connection ...": the handler and the loop both named it.)
    from transport._protocol import Heartbeat

    raw = insecure.silent_peer()
    raw.send_multipart(encode(Heartbeat(rid=7, tokens=np.zeros((0, 3), np.uint64))))
    assert raw.poll(5000, zmq.POLLIN)
    err = decode(raw.recv_multipart())
    assert (err.rid, err.code) == (7, "NOT_FOUND")
    assert err.message == ("HEARTBEAT: this connection has not registered a worker (send "
                           "REGISTER first)")


def test_client_arguments_of_the_wrong_kind_are_refused_before_anything_is_sent(insecure):
    from engine import SpecError
    from transport import Client, ClientClosed, ShardError

    c = insecure.client()
    # A string of names was taken for its characters: three actions a, b and c.
    for call in (lambda: c.enqueue_fanout(spec("map"), "abc"),
                 lambda: c.enqueue_fanout(spec("map"), ["a"], inputs="s"),
                 lambda: c.run_fanout(spec("map"), "abc", timeout=1),
                 lambda: c.enqueue(None), lambda: c.enqueue("id"),
                 lambda: c.enqueue_many(spec("a")), lambda: c.enqueue_flyte(None),
                 lambda: c.enqueue_flyte({"a": 1}), lambda: c.enqueue_flyte([None]),
                 lambda: c.status(None), lambda: c.wait(None, timeout=1)):
        with pytest.raises(SpecError, match="must be a list|ActionSpec or a map|requests\\[0\\]"):
            call()
    with pytest.raises(ShardError):
        c.status([f"{RUN}/a", f"{RUN}/map"])              # nothing was enqueued
    for bad in (0, -1, None, float("nan"), float("inf"), "5", True):
        with pytest.raises(ValueError, match="timeout must be a positive number"):
            Client(endpoint=insecure.endpoint, keys=None, timeout=bad)
    # A refused subscribe leaves the run unwatched: it failed every later event read.
    with pytest.raises(ShardError, match="since"):
        c.subscribe(RUN, since=-1)
    c.subscribe(RUN)
    c.enqueue(spec("e1"))
    assert c.next_event(timeout=5).action == f"{RUN}/e1"
    c.close()
    c.close()
    for call in (c.ping, c.reconnect, lambda: c.status([f"{RUN}/e1"]),
                 lambda: c.next_event(timeout=5), lambda: c.next_events(),
                 lambda: c.unsubscribe(RUN), lambda: c.wait([f"{RUN}/e1"], timeout=5)):
        with pytest.raises(ClientClosed, match="closed"):
            call()


def test_abort_cascades_and_the_worker_is_refused(insecure):
    c = insecure.client()
    w = insecure.worker()
    c.enqueue(spec("parent"))
    (lease,) = w.leases(timeout=5)
    c.enqueue_many([spec("child", parent=f"{RUN}/parent"), spec("child2",
                                                                 parent=f"{RUN}/child")])
    c.abort(f"{RUN}/parent", reason="user")
    got = c.status([f"{RUN}/child", f"{RUN}/child2"])
    assert got == [Phase.ABORTED, Phase.ABORTED]
    refused = w.heartbeat([lease.token])
    assert [v for _t, v in refused] == [Verdict.ABORTED]


def test_an_abort_pushes_the_refusal_to_every_holder_at_once(insecure):
    c = insecure.client()
    east = insecure.worker("east-1", "east", slots=1)
    west = insecure.worker("west-1", "west", slots=1)
    c.enqueue(spec("root"))
    c.enqueue(spec("kid", parent=f"{RUN}/root"))
    mine = {}       # worker -> the one lease it holds (one slot each: one lease each)
    for w in (east, west):
        (lease,) = w.leases(timeout=5)
        mine[w] = lease
    got = list(mine.values())
    assert sorted(lease.action for lease in got) == [f"{RUN}/kid", f"{RUN}/root"]
    held = {lease.action: lease.token for lease in got}
    c.abort(f"{RUN}/root", reason="user")
    # No heartbeat sent: each holder is pushed the refusal of its own lease, before the
    # finalize lease of its cleanup.
    for w, action in ((w, lease.action) for w, lease in mine.items()):
        msg = w.receive(timeout=5)
        assert isinstance(msg, Refused) and msg.rid is None
        (fin,) = w.leases(timeout=5)
        assert fin.kind == LeaseKind.FINALIZE and fin.action == action
        assert msg.tokens.astype("<u8").tobytes() == held[action]
        assert msg.verdicts.tolist() == [Verdict.ABORTED]
    assert insecure.shard.counters["stops_pushed"] == 2


def test_heartbeat_of_a_stale_token_is_refused(insecure):
    c = insecure.client()
    w = insecure.worker()
    c.enqueue(spec("a"))
    (lease,) = w.leases(timeout=5)
    forged = bytearray(lease.token)
    forged[8] ^= 1              # another generation: the MAC no longer matches
    refused = w.heartbeat([bytes(forged), lease.token])
    assert len(refused) == 1 and refused[0][0] == bytes(forged)


def test_a_token_held_by_another_worker_is_refused(secure):
    c = secure.client()
    w1 = secure.worker("east-1")
    c.enqueue(spec("a"))
    (lease,) = w1.leases(timeout=5)
    w2 = secure.worker("east-2", slots=1)
    assert [v for _t, v in w2.heartbeat([lease.token])] != []
    assert [v for _t, v in w2.report([lease.token], Phase.SUCCEEDED)] != []
    assert c.status(f"{RUN}/a") != Phase.SUCCEEDED
    assert w1.heartbeat([lease.token]) == []


def test_worker_reconnects_after_the_shard_restarted(tmp_path, keys):
    h = Harness(secure_config(tmp_path, keys), keys_dir=keys,
                store=lambda: LmdbStore(str(tmp_path / "data"), partitions=2))
    try:
        h.start()
        endpoint = h.endpoint
        c = h.client()
        w = h.worker()
        c.enqueue_many([spec("a"), spec("b")])
        leases = w.leases(timeout=5, want=2)
        h.stop()
        h.start(endpoint=endpoint)      # same port: the DEALERs reconnect by themselves
        # The worker's next heartbeat finds the connection unknown, registers again (same
        # worker id: its leases are adopted) and validates.
        assert w.heartbeat([x.token for x in leases]) == []
        assert w.report([x.token for x in leases], Phase.SUCCEEDED) == []
        assert c.wait([x.action for x in leases], timeout=10) == {
            x.action: Phase.SUCCEEDED for x in leases}
    finally:
        h.close()


def test_wait_reads_ended_actions_at_once_and_leaves_no_watch_behind(insecure):
    """``wait`` sends its WATCH and STATUS back to back (one round trip): an action that
    ended before the call is answered from the STATUS, one still running times out naming
    it, and neither wait leaves the run watched (no EVENTS reach the client after)."""
    c = insecure.client()
    w = insecure.worker()
    (done,) = c.enqueue_many([spec("done")])
    (lease,) = w.leases(timeout=5)
    assert w.report([lease.token], Phase.SUCCEEDED) == []
    received = insecure.shard.counters["received"]
    assert c.wait([done], timeout=5) == {done: Phase.SUCCEEDED}
    # WATCH and STATUS, then UNWATCH (not answered).
    assert insecure.shard.counters["received"] >= received + 2
    (busy,) = c.enqueue_many([spec("busy")])
    w.leases(timeout=5)
    with pytest.raises(ShardTimeout, match="busy"):
        c.wait([busy, done], timeout=0.3)
    assert c.status(busy) == Phase.INITIALIZING
    # Nothing is watched any more: a change of the run sends the client no event.
    (later,) = c.enqueue_many([spec("later")])
    with pytest.raises(ShardTimeout):
        c.next_event(timeout=0.3)


def test_next_events_takes_the_same_events_in_batches_and_mixes_with_next_event(insecure):
    """``next_events`` gives the events ``next_event`` would, in the same order, as
    columnar batches of one run; taking one event first leaves the rest of its batch."""
    c = insecure.client()
    w = insecure.worker()
    c.subscribe(RUN)
    ids = c.enqueue_many([spec(f"a{i}") for i in range(6)])
    leases = w.leases(timeout=5, want=6)
    w.report([x.token for x in leases], Phase.SUCCEEDED)
    first = c.next_event(timeout=5)
    seen = [(first.seq, first.action, first.phase)]
    while len(seen) < 18:       # QUEUED, INITIALIZING, SUCCEEDED of each
        batch = c.next_events(timeout=5)
        assert isinstance(batch, Events) and batch.run == RUN
        assert len(batch.actions) == len(batch.phases) == len(batch.attempts) >= 1
        seen += [(e.seq, e.action, e.phase) for e in batch.events()]
    seqs = [s for s, _a, _p in seen]
    assert seqs == list(range(seqs[0], seqs[0] + 18))
    per = {}
    for _s, a, ph in seen:
        per.setdefault(a, []).append(ph)
    assert per == {a: ["QUEUED", "INITIALIZING", "SUCCEEDED"] for a in ids}
    with pytest.raises(ShardTimeout):
        c.next_events(timeout=0.2)


def test_a_watch_that_reconnects_mid_run_misses_nothing(insecure):
    c = insecure.client()
    w = insecure.worker()
    c.subscribe(RUN)
    ids = c.enqueue_many([spec(f"a{i}") for i in range(5)])
    leases = w.leases(timeout=5, want=5)
    seen = []
    for _ in range(3):
        seen.append(c.next_event(timeout=5))
    c.reconnect()           # a new connection resumes from the last seq seen
    w.report([x.token for x in leases], Phase.SUCCEEDED)
    while len([e for e in seen if e.phase == "SUCCEEDED"]) < 5:
        seen.append(c.next_event(timeout=5))
    seqs = [e.seq for e in seen]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    per = {}
    for e in seen:
        per.setdefault(e.action, []).append(e.phase)
    assert all(per[a] == ["QUEUED", "INITIALIZING", "SUCCEEDED"] for a in ids)


def test_every_completion_of_a_fanout_with_more_leases_out_than_100k_reaches_the_watch(
        tmp_path):
    """The shard maps the leases of watched runs to their actions so that a report names
    its action; that map once dropped its oldest entries past 100,000, and the completions
    of those leases were never recorded: a watcher (and ``Client.wait``) waited for events
    of actions that had long succeeded. 120,000 leases out at once, then every SUCCEEDED."""
    n = 120_000
    cfg = parse_config({
        "resources": ["cpu"],
        "clusters": {"east": {"capacity": {"cpu": 1_000_000}}},
        "queues": {"q": {"scheduling": "GREEDY_CAPACITY", "depth": 200_000}},
        "engine": {"default_queue": "q", "heartbeat_interval": 600.0},
        "storage": {"path": str(tmp_path / "data"), "partitions": 2},
        "transport": {"endpoints": ["tcp://127.0.0.1:0"]},
        "security": {"insecure": True},
    })
    h = Harness(cfg, store=MemoryStore())
    h.start()
    try:
        c = h.client()
        c.timeout = 60.0
        w = h.worker(slots=n)
        c.subscribe(RUN)
        names = [f"a{i}" for i in range(n)]
        for lo in range(0, n, 60_000):
            assert c.enqueue_fanout(spec("x"), names[lo:lo + 60_000]) == 60_000
        leases = []
        while len(leases) < n:
            got = w.leases(timeout=30, want=n - len(leases))
            assert got, f"{len(leases)} of {n} leases arrived"
            leases += got
        tokens = [x.token for x in leases]
        for lo in range(0, n, 10_000):
            assert w.report(tokens[lo:lo + 10_000], Phase.SUCCEEDED, timeout=30) == []
        done = set()
        while len(done) < n:
            e = c.next_event(timeout=30, runs=(RUN,))
            if e.phase == "SUCCEEDED":
                done.add(e.action)
        assert done == {f"{RUN}/{x}" for x in names}
    finally:
        h.close()


def test_a_tick_cut_short_by_its_candidate_budget_is_followed_at_once_by_another(tmp_path):
    """A fan-out deeper than ``engine.max_candidates`` is leased out over several ticks in a
    row, not one tick per event or backstop (a minute here: nothing else would come)."""
    h = Harness(base_config(tmp_path, heartbeat_interval=240.0, max_candidates=16),
                store=MemoryStore())
    h.start()
    try:
        c = h.client()
        w = h.worker(slots=1000)
        assert c.enqueue_fanout(spec("x"), [f"a{i}" for i in range(50)]) == 50
        leases = []
        deadline = time.monotonic() + 5.0
        while len(leases) < 50 and time.monotonic() < deadline:
            leases += w.leases(timeout=0.5, want=50 - len(leases))
        assert sorted(x.action for x in leases) == sorted(f"{RUN}/a{i}" for i in range(50))
    finally:
        h.close()


def test_a_resume_starts_after_the_last_event_seen_not_after_the_last_answer(insecure):
    """A WATCH answered while its replay still waits unread in the socket, then the
    connection goes (a reconnect): the watch resumes from the last event seen, so that
    replay comes again, instead of from the answer's latest seq, which skipped it."""
    c = insecure.client()
    w = insecure.worker()
    c.subscribe(RUN)
    ids = c.enqueue_many([spec(f"a{i}") for i in range(4)])
    w.leases(timeout=5, want=4)
    seen = [c.next_event(timeout=5) for _ in range(8)]      # QUEUED, INITIALIZING each
    late = insecure.client()
    late.subscribe(RUN, seen[0].seq)    # answered; its replay of 7 waits in the socket
    late.reconnect()                    # and goes with that socket
    got = [late.next_event(timeout=5, refresh=0.5) for _ in range(7)]
    assert [(e.seq, e.action, e.phase) for e in got] == \
        [(e.seq, e.action, e.phase) for e in seen[1:]]
    assert {e.action for e in got} == set(ids)


def test_a_resume_from_a_seq_no_longer_kept_is_refused(tmp_path):
    h = Harness(base_config(tmp_path), store=MemoryStore())
    h.start()
    try:
        c = h.client()
        latest = c.subscribe(RUN)
        with pytest.raises(WatchLost, match="restarted|past the latest"):
            c.subscribe(RUN, latest + 10)
    finally:
        h.close()


def test_wait_recovers_when_its_watch_cannot_resume(tmp_path, keys):
    # The shard restarts under a watch: the watch's seqs are gone with the old process, so
    # resuming is refused (WatchLost); wait() must re-watch and read status, not raise.
    h = Harness(secure_config(tmp_path, keys), keys_dir=keys,
                store=lambda: LmdbStore(str(tmp_path / "data"), partitions=2))
    try:
        h.start()
        endpoint = h.endpoint
        c = h.client()
        w = h.worker()
        c.subscribe(RUN)
        c.enqueue_many([spec("a"), spec("b")])
        leases = w.leases(timeout=5, want=2)
        h.stop()
        h.start(endpoint=endpoint)
        w.heartbeat([x.token for x in leases])      # re-registers: the leases are adopted
        later = threading.Timer(0.5, w.report, ([x.token for x in leases], Phase.SUCCEEDED))
        later.start()
        try:
            assert c.wait([x.action for x in leases], timeout=20) == {
                x.action: Phase.SUCCEEDED for x in leases}
        finally:
            later.join()
    finally:
        h.close()


def test_authorisation_refusals(secure):
    acme = secure.client("acme-app")
    globex = secure.client("globex-app")
    ops = secure.client("ops")
    with pytest.raises(ShardError, match="PERMISSION_DENIED.*outside the tenants"):
        globex.enqueue(spec("a"))
    acme.enqueue(spec("a"))
    with pytest.raises(ShardError, match="PERMISSION_DENIED"):
        globex.status(f"{RUN}/a")
    with pytest.raises(ShardError, match="PERMISSION_DENIED.*admin"):
        acme.queue_update("q", depth=5)
    assert ops.queue_update("q", depth=50)["depth"] == 50
    # A worker key may not register for another cluster, nor act as a client.
    w = secure.worker("west-1", cluster="east", connect=False)
    with pytest.raises(ShardError, match="PERMISSION_DENIED.*cluster"):
        w.connect()
    west = secure.client("west-1")
    with pytest.raises(ShardError, match="PERMISSION_DENIED"):
        west.enqueue(spec("b"))


def test_explain_does_not_name_a_head_of_another_tenant(tmp_path, keys):
    # QUEUE_METRICS blanks a blocked head outside the client's tenants; EXPLAIN of the
    # client's own action queued behind it named the head's run and task.
    h = Harness(secure_config(tmp_path, keys, scheduling="STRICT_FIFO"), keys_dir=keys,
                store=MemoryStore())
    h.start()
    try:
        acme, globex = h.client("acme-app"), h.client("globex-app")
        h.worker("east-1")
        acme.enqueue(spec("big", resources={"cpu": 60}))
        globex.enqueue(spec("head", run="globex/ml/prod/secret-merger", task="acquire",
                            resources={"cpu": 10}))
        acme.enqueue(spec("small"))
        deadline = time.monotonic() + 10
        while "head-of-line" not in acme.explain(f"{RUN}/small")["reason"]:
            assert time.monotonic() < deadline, acme.explain(f"{RUN}/small")
            time.sleep(0.02)
        reason = acme.explain(f"{RUN}/small")["reason"]
        assert "blocked by another tenant's action (needs cpu=10" in reason, reason
        assert "secret-merger" not in reason and "acquire" not in reason
        # An admin sees who holds the line.
        assert "secret-merger/acquire" in h.client("ops").explain(f"{RUN}/small")["reason"]
        assert globex.explain("globex/ml/prod/secret-merger/head")["phase"] in (
            "QUEUED", "WAITING_FOR_RESOURCES")
    finally:
        h.close()


def test_unknown_key_and_no_key_get_nothing(secure, tmp_path):
    generate_keypair(tmp_path / "strangers", "stranger")
    good = secure.keys("acme-app")
    pub, sec = load_secret_key(tmp_path / "strangers" / "stranger.key_secret")
    stranger = ClientKeys(public=pub, secret=sec, server_public=good.server_public)
    c = Client(endpoint=secure.endpoint, keys=stranger, timeout=1.0)
    plain = Client(endpoint=secure.endpoint, keys=None, timeout=1.0)
    try:
        with pytest.raises(ShardTimeout):
            c.ping()
        with pytest.raises(ShardTimeout):
            plain.ping()
    finally:
        c.close()
        plain.close()
    assert secure.shard.counters["handshakes_refused"] >= 1


def test_too_many_outstanding_requests_are_refused(insecure):
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.connect(insecure.endpoint)
    try:
        n = 400
        for i in range(n):
            s.send_multipart(encode(Ping(rid=i)))
        codes = []
        poller = zmq.Poller()
        poller.register(s, zmq.POLLIN)
        while len(codes) < n and poller.poll(5000):
            m = decode(s.recv_multipart())
            codes.append(m.code if isinstance(m, Error) else "OK")
        assert len(codes) == n
        assert "OK" in codes
        # Either all fit in turns of at most max_outstanding, or the rest were refused.
        assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}
    finally:
        s.close(0)
        ctx.term()


def _mutations(rng, frames):
    frames = [bytearray(f) for f in frames]
    op = rng.randrange(6)
    if op == 0 and frames[1]:
        i = rng.randrange(len(frames[1]))
        frames[1][i] = rng.randrange(256)
    elif op == 1:
        frames[0] = bytearray([rng.randrange(256)])
    elif op == 2:
        frames.append(bytearray(rng.randbytes(rng.randrange(64))))
    elif op == 3 and len(frames) > 1:
        frames.pop(rng.randrange(len(frames)))
    elif op == 4:
        frames[-1] = frames[-1][: rng.randrange(len(frames[-1]) + 1)]
    else:
        return [rng.randbytes(rng.randrange(1, 40)) for _ in range(rng.randrange(1, 5))]
    return [bytes(f) for f in frames]


def fuzz(endpoint, count, seed=0):
    """Send ``count`` random and mutated messages of every type; returns how many answers
    came back."""
    from tests.test_protocol import SAMPLES
    rng = random.Random(seed)
    wire = [[bytes(memoryview(f).cast("B")) for f in encode(m)] for m in SAMPLES]
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.sndhwm = 100000
    s.rcvhwm = 100000
    s.connect(endpoint)
    answers = 0
    try:
        for i in range(count):
            frames = _mutations(rng, rng.choice(wire)) if rng.random() < 0.9 else rng.choice(wire)
            s.send_multipart(frames)
            while s.poll(0):
                s.recv_multipart()
                answers += 1
            if i % 200 == 0:
                while s.poll(50):
                    s.recv_multipart()
                    answers += 1
        while s.poll(500):
            s.recv_multipart()
            answers += 1
    finally:
        s.close(0)
        ctx.term()
    return answers


def test_fuzz_the_shard_stays_up_counts_and_answers_afterwards(insecure):
    answers = fuzz(insecure.endpoint, 5000)
    assert answers > 1000
    counters = insecure.shard.counters
    assert counters["protocol_errors"] > 1000
    assert counters["received"] >= 4000
    c = insecure.client()
    assert c.ping()["version"] == 1
    c.enqueue(spec("after-fuzz", run="acme/ml/prod/rz"))
    assert c.status("acme/ml/prod/rz/after-fuzz") in (
        Phase.QUEUED, Phase.WAITING_FOR_RESOURCES, Phase.INITIALIZING)


def _write_config(tmp_path, keys, port):
    text = f"""resources = ["cpu"]
[clusters.east]
capacity = {{ cpu = 64 }}
[queues.q]
scheduling = "GREEDY_CAPACITY"
[engine]
default_queue = "q"
heartbeat_interval = 1.0
[storage]
path = "{tmp_path / 'data'}"
partitions = 2
[transport]
endpoints = ["tcp://127.0.0.1:{port}"]
[security]
keys_dir = "{keys}"
server_key = "shard"
[security.peers.east-1]
role = "worker"
cluster = "east"
[security.peers.acme-app]
role = "client"
tenants = ["acme"]
"""
    path = tmp_path / "leasehold.toml"
    path.write_text(text)
    return path


def _shard_process(config):
    import os
    import subprocess
    import sys
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "engine.cli", "shard", "--config",
                             str(config)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _stop(proc):
    import signal
    import subprocess
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return proc.returncode, err


def test_leasehold_shard_process_restarts_and_the_worker_adopts_its_leases(tmp_path, keys):
    port = _free_port()
    config = _write_config(tmp_path, keys, port)
    endpoint = f"tcp://127.0.0.1:{port}"
    k = load_client_keys(keys, "acme-app", "shard")
    c = Client(endpoint=endpoint, keys=k, timeout=20.0)
    w = WorkerConnection(endpoint, load_client_keys(keys, "east-1", "shard"), "east-1", "east",
                         10, timeout=20.0)
    proc = _shard_process(config)
    try:
        w.connect()
        c.enqueue(spec("a"))
        (lease,) = w.leases(timeout=20)
        code, err = _stop(proc)
        assert code == 0, err
        proc = _shard_process(config)
        # A new process on the same port: the worker's heartbeat re-registers (its lease is
        # adopted) and validates; its report then completes the action.
        assert w.heartbeat([lease.token], timeout=20) == []
        assert w.report([lease.token], Phase.SUCCEEDED, timeout=20) == []
        assert c.wait(lease.action, timeout=20) == {lease.action: Phase.SUCCEEDED}
    finally:
        c.close()
        w.close()
        if proc.poll() is None:
            _stop(proc)


def test_leasehold_shard_with_a_bad_config_prints_one_line_and_exits_2(tmp_path):
    import subprocess
    import sys
    bad = tmp_path / "bad.toml"
    bad.write_text('resources = ["cpu"]\n[clusters.east]\ncapacity = { cpu = 1 }\n'
                   '[queues.q]\n[engine]\ndefault_queue = "q"\n[security]\n')
    out = subprocess.run([sys.executable, "-m", "engine.cli", "shard", "--config", str(bad)],
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "security.peers" in lines[0], out.stderr
    assert "Traceback" not in out.stderr


class FlakyStore(MemoryStore):
    """A memory store whose next commits fail while ``failing`` is set (a test's switch)."""

    failing = False

    def commit(self, batch):
        if self.failing:
            raise StoreError("injected: the disk said no")
        return super().commit(batch)


def test_a_failed_commit_sends_nothing_of_its_turn(tmp_path):
    store = FlakyStore()
    h = Harness(base_config(tmp_path), store=store)
    h.start()
    try:
        c = h.client()
        w = h.worker()
        store.failing = True
        with pytest.raises(ShardError, match="UNAVAILABLE"):
            c.enqueue(spec("a"))
        assert w.leases(timeout=0.5) == []
        store.failing = False
        with pytest.raises(ShardError, match="NOT_FOUND"):
            c.status(f"{RUN}/a")      # memory was restored: the enqueue never happened
        c.enqueue(spec("a"))
        (lease,) = w.leases(timeout=5)
        assert lease.action == f"{RUN}/a"
        assert h.shard.counters["failed_commits"] >= 1
    finally:
        h.close()


def test_a_token_of_an_earlier_session_is_refused_stale_after_reassignment(secure):
    """A worker that registers again (a new session) proves the old one gone: its lease
    expires and is placed again under a newer generation; the old token is STALE."""
    c = secure.client()
    first = secure.worker("east-1")
    c.enqueue(spec("a", retries={"backoff_base": 0}))     # its system retry at once
    (old,) = first.leases(timeout=5)
    again = secure.worker("east-1")          # the same worker id, a new connection
    got = again.leases(timeout=5, want=2)    # cleanup of attempt 1, and attempt 2
    assert sorted((lease.kind.name, lease.attempt) for lease in got) == [
        ("FINALIZE", 1), ("RUN", 2)]
    new = next(lease for lease in got if lease.kind.name == "RUN")
    assert [v for _t, v in again.heartbeat([old.token])] == [Verdict.STALE]
    assert again.heartbeat([new.token]) == []


def test_a_worker_receives_leases_of_its_own_cluster_only(tmp_path, keys):
    data = {
        "resources": ["cpu"],
        "clusters": {"east": {"capacity": {"cpu": 64}}, "west": {"capacity": {"cpu": 64}}},
        "queues": {"q": {"scheduling": "GREEDY_CAPACITY", "depth": 1000},
                   "westonly": {"clusters": ["west"]}},
        "engine": {"default_queue": "q", "heartbeat_interval": 1.0},
        "storage": {"path": str(tmp_path / "data"), "partitions": 2},
        "transport": {"endpoints": ["tcp://127.0.0.1:0"], "max_outstanding": 64},
        "security": {"keys_dir": str(keys), "server_key": "shard", "peers": {
            "east-1": {"role": "worker", "cluster": "east"},
            "west-1": {"role": "worker", "cluster": "west"},
            "acme-app": {"role": "client", "tenants": ["acme"]}}},
    }
    h = Harness(parse_config(data), keys_dir=keys, store=MemoryStore())
    h.start()
    try:
        c = h.client()
        east = h.worker("east-1", cluster="east")
        c.enqueue(spec("w", run_queue="westonly"))
        assert east.leases(timeout=1.0) == []        # the only worker is of another cluster
        west = h.worker("west-1", cluster="west")
        (lease,) = west.leases(timeout=5)
        assert str(lease.action) == f"{RUN}/w"
        assert east.leases(timeout=0.3) == []
    finally:
        h.close()


def test_a_turn_whose_commit_failed_is_not_ticked_again_at_once(tmp_path):
    """A tick that placed work and was cut short asks for another at once; if its commit
    failed, memory was restored and the next tick would place the same work and fail the
    same way: no re-tick then, only the next message or the backstop."""
    store = FlakyStore()
    h = Harness(base_config(tmp_path, heartbeat_interval=240.0, max_candidates=16),
                store=store)
    h.start()
    try:
        c = h.client()
        assert c.enqueue_fanout(spec("x"), [f"a{i}" for i in range(50)]) == 50
        store.failing = True
        w = h.worker(connect=False)
        with pytest.raises(ShardError, match="UNAVAILABLE"):
            w.connect()                 # the register turn ticks, places 16 and fails
        before = h.shard.counters["ticks"]
        time.sleep(1.0)
        assert h.shard.counters["ticks"] - before < 5
    finally:
        h.close()


def test_an_idle_shard_with_a_deep_queue_cut_short_stops_ticking(tmp_path):
    """A queue cut short where nothing fits gets one rotation of idle re-ticks, not one
    per message: the worker's heartbeats do not keep the loop ticking."""
    h = Harness(base_config(tmp_path, heartbeat_interval=1.0, max_candidates=4),
                store=MemoryStore())
    h.start()
    try:
        c = h.client()
        w = h.worker()
        c.enqueue(spec("hog", run="acme/ml/prod/hog1", resources={"cpu": 63}))
        c.enqueue(spec("hog", run="acme/ml/prod/hog2", resources={"cpu": 1}))
        assert len(w.leases(timeout=5, want=2)) == 2
        c.enqueue_fanout(spec("wide", run="acme/ml/prod/wide", resources={"cpu": 2}),
                         [f"a{i}" for i in range(3000)])
        time.sleep(2.0)
        before = h.shard.counters["ticks"]
        for _ in range(4):              # heartbeats carrying free capacity ask for ticks
            w.heartbeat([], free={"cpu": 0})
            time.sleep(0.25)
        assert h.shard.counters["ticks"] - before < 100
    finally:
        h.close()


def pipelined_config(tmp_path):
    """base_config's shard, but every turn that writes goes through the committer thread
    (``transport.idle_commit_inline = false``): turns wait in the commit pipeline."""
    return parse_config({
        "resources": ["cpu"],
        "clusters": {"east": {"capacity": {"cpu": 64}}},
        "queues": {"q": {"scheduling": "GREEDY_CAPACITY"}},
        "engine": {"default_queue": "q"},
        "storage": {"path": str(tmp_path / "data"), "partitions": 2},
        "transport": {"endpoints": ["tcp://127.0.0.1:0"], "idle_commit_inline": False},
        "security": {"insecure": True},
    })


class SlowStore(MemoryStore):
    """A memory store whose commits take ``delay`` seconds (turns pile up in the pipeline)."""

    delay = 0.3

    def commit(self, batch):
        time.sleep(self.delay)
        return super().commit(batch)


def test_a_watch_from_zero_keeps_events_pushed_before_its_answer(tmp_path):
    """With turns in commit while a WATCH from since=0 is decided, the events of the turn
    committed just before it reach the new watcher ahead of the answer and of the replay;
    they are kept and delivered after the replay, in order, not dropped and fetched again
    (which a small ring can no longer serve: WatchLost)."""
    cfg = pipelined_config(tmp_path)
    h = Harness(cfg, store=SlowStore())
    h.start(watch_ring=8)
    try:
        a = h.client()
        b = h.client()
        a.subscribe(RUN)                # the run has a log
        t = threading.Thread(target=a.enqueue_fanout,
                             args=(spec("x"), [f"a{i}" for i in range(50)]))
        t.start()
        time.sleep(0.1)
        b.subscribe(RUN)
        t.join(10)
        got = [b.next_event(timeout=5, refresh=0.5) for _ in range(8)]
        seqs = [e.seq for e in got]
        assert seqs == list(range(seqs[0], seqs[0] + 8))
        assert all(e.phase == "QUEUED" for e in got)
    finally:
        h.close()


def test_a_lease_of_a_turn_whose_commit_failed_names_no_action_later(tmp_path):
    """The map from watched leases to their actions takes a turn's entries only once its
    commit returned: after a failed turn, the next action in the same row (another run's)
    is not reported to the first run's watcher."""
    store = FlakyStore()
    h = Harness(base_config(tmp_path), store=store)
    h.start()
    try:
        c = h.client()
        watcher = h.client()
        w = h.worker()
        watcher.subscribe("acme/ml/prod/watched")
        store.failing = True
        with pytest.raises(ShardError, match="UNAVAILABLE"):
            c.enqueue(spec("x", run="acme/ml/prod/watched"))
        store.failing = False
        c.enqueue(spec("y", run="acme/ml/prod/other"))
        (lease,) = w.leases(timeout=5)
        assert lease.action == "acme/ml/prod/other/y"
        assert w.report([lease.token], Phase.SUCCEEDED) == []
        with pytest.raises(ShardTimeout):
            e = watcher.next_event(timeout=1.0, refresh=0.5)
            pytest.fail(f"an event of a run nobody enqueued into: {e}")
    finally:
        h.close()


def test_a_run_watched_after_its_leases_went_out_sees_their_reports_at_once(tmp_path):
    """``Client.wait`` subscribes after the enqueue, by which time the tick may have pushed
    the leases: their reports become events in the turn that takes them, not at the next
    backstop re-check (a minute away here)."""
    h = Harness(base_config(tmp_path, heartbeat_interval=240.0), store=MemoryStore())
    h.start()
    try:
        c = h.client()
        w = h.worker()
        ids = c.enqueue_many([spec(f"a{i}") for i in range(3)])
        leases = w.leases(timeout=5, want=3)
        assert len(leases) == 3
        watcher = h.client()
        watcher.subscribe(RUN)
        assert w.report([x.token for x in leases], Phase.SUCCEEDED) == []
        got = {}
        while len(got) < 3:
            e = watcher.next_event(timeout=3, refresh=10)
            got[e.action] = e.phase
        assert got == {a: "SUCCEEDED" for a in ids}
    finally:
        h.close()


def test_events_of_a_watch_whose_answer_never_came_are_fetched_again(tmp_path):
    """A WATCH from since=0 that timed out (its turn behind a slow commit) leaves the run
    watched by the shard but not told where its log starts: its events flag a resume (which
    replays them) instead of being held for an answer that never comes."""
    store = SlowStore()
    store.delay = 0.0
    cfg = pipelined_config(tmp_path)
    h = Harness(cfg, store=store)
    h.start()
    ra, rb = "acme/ml/prod/ra", "acme/ml/prod/rb"
    try:
        p = h.client()
        c = Client(endpoint=h.endpoint, timeout=0.2)
        h.closing.append(c)
        c.subscribe(ra)
        store.delay = 0.8
        t = threading.Thread(target=p.enqueue, args=(spec("slow", run=ra),))
        t.start()
        time.sleep(0.1)
        with pytest.raises(ShardTimeout):
            c.subscribe(rb)
        t.join(5)
        store.delay = 0.0
        c.timeout = 5.0
        p.enqueue(spec("y", run=rb))
        deadline = time.monotonic() + 4.0
        seen = []
        while time.monotonic() < deadline and not any(e.run == rb for e in seen):
            seen.append(c.next_event(timeout=2.0, refresh=10))
        assert any(e.run == rb and e.action == f"{rb}/y" for e in seen)
    finally:
        h.close()


def test_a_report_sent_twice_in_one_message_still_becomes_its_event(tmp_path):
    """The second copy of a report in one message is refused (COMPLETED); the first applied,
    and the watcher sees its SUCCEEDED at once (the refusal drops that copy only), not at
    the backstop re-check (a minute away here)."""
    h = Harness(base_config(tmp_path, heartbeat_interval=240.0), store=MemoryStore())
    h.start()
    try:
        c = h.client()
        w = h.worker()
        c.subscribe(RUN)
        [aid] = c.enqueue_many([spec("twice")])
        [lease] = w.leases(timeout=5)
        refused = w.report([lease.token, lease.token], Phase.SUCCEEDED)
        assert [v for _t, v in refused] == [Verdict.COMPLETED]
        phases = []
        while "SUCCEEDED" not in phases:
            e = c.next_event(timeout=3, refresh=10)
            assert e.action == aid
            phases.append(e.phase)
        assert phases == ["QUEUED", "INITIALIZING", "SUCCEEDED"]
    finally:
        h.close()


def overflowing_shard(tmp_path):
    """A started shard (Harness) whose peers' queues overflow on a burst of events: one event
    per EVENTS message and short queues per peer, over a unix socket (small kernel buffers),
    so 10,000 events to a peer that reads nothing overflow, while a client that reads its
    answers never nears the mark. Its watch ring holds 20,000 events. No backstop re-check
    runs during a test: one after a fan-out records each action's WAITING_FOR_RESOURCES
    too, and counts of events then exceed what a test enqueued (a flake on a busy machine)."""
    data = {"resources": ["cpu"], "clusters": {"east": {"capacity": {"cpu": 64}}},
            "queues": {"q": {"scheduling": "GREEDY_CAPACITY", "depth": 100000}},
            "engine": {"default_queue": "q", "heartbeat_interval": 240.0},
            "storage": {"path": str(tmp_path / "data"), "partitions": 2},
            "transport": {"endpoints": [f"ipc://{tmp_path}/shard.sock"], "hwm": 100,
                          "max_batch": 1, "max_outstanding": 64},
            "security": {"insecure": True}}
    h = Harness(parse_config(data), store=MemoryStore())
    h.start(watch_ring=20000)
    return h


def test_a_watch_replay_that_cannot_go_is_counted_and_ends_that_watch(tmp_path):
    """A WATCH's replay to a watcher whose queue is full is not silently lost: its events
    count as unsent, and that watch ends (the client resumes from its last seq) instead of
    receiving the later events of the run over a gap."""
    h = overflowing_shard(tmp_path)
    try:
        a = h.client()
        a.subscribe(RUN)                # the run has a log (kept once nobody watches)
        a.unsubscribe(RUN)
        a.enqueue_fanout(spec("x"), [f"a{i}" for i in range(10000)])
        assert a.ping()["counters"]["events_unsent"] == 0
        raw = h.silent_peer()
        raw.send_multipart(encode(Watch(rid=1, run=RUN, since=0)))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            counters = a.ping()["counters"]
            if counters["events"] + counters["events_unsent"] >= 10000:
                break
            time.sleep(0.05)
        # Every replayed event is accounted for, sent or not, and some could not go.
        assert counters["events"] + counters["events_unsent"] == 10000
        assert counters["events_unsent"] > 0
        # The watch ended: a new event of the run is not pushed to that peer (pushed, it
        # would be counted unsent too: its queue is still full). Its push is part of the
        # turn the enqueue's answer leaves with.
        unsent = counters["events_unsent"]
        a.enqueue(spec("later"))
        assert a.ping()["counters"]["events_unsent"] == unsent
    finally:
        h.close()


def test_a_watch_of_an_evicted_log_is_lost_not_resumed_into_the_new_log(tmp_path):
    """More runs watched than ``watch_runs`` evicts the least recently watched log (of the
    connection asking for a new one: its own); a later WATCH of that run makes a new one.
    The first log's watcher, resuming from its last seq, is told its events are gone
    (WatchLost) instead of being handed the new log's events after that seq (the new log
    numbered from the same start: it missed the ones before)."""
    h = Harness(base_config(tmp_path, heartbeat_interval=240.0), store=MemoryStore())
    h.start(watch_runs=1)
    try:
        old = h.client()
        old.subscribe(RUN)
        old.enqueue(spec("a"))
        assert old.next_event(timeout=3, refresh=10).action == f"{RUN}/a"
        old.subscribe("acme/ml/prod/other")             # evicts RUN's log (its own)
        old.unsubscribe("acme/ml/prod/other")           # (room for another connection's)
        new = h.client()
        new.subscribe(RUN)                              # a new log of RUN
        new.enqueue_many([spec("b"), spec("c")])
        assert [new.next_event(timeout=3, refresh=10).action for _ in range(2)] == [
            f"{RUN}/b", f"{RUN}/c"]
        with pytest.raises(WatchLost, match="evicted"):
            e = old.next_event(timeout=3, refresh=0.3)     # silence: it resumes
            pytest.fail(f"resumed into the new log, over b's event: {e}")
    finally:
        h.close()


class BuggyStore(MemoryStore):
    """A memory store whose next commit raises something that is not a StoreError (a bug in
    the store, a MemoryError) while ``broken`` is set, once."""

    broken = False

    def commit(self, batch):
        if self.broken:
            self.broken = False
            raise RuntimeError("injected: a bug in the store")
        return super().commit(batch)


def test_a_commit_failing_with_an_unexpected_error_on_the_committer_does_not_stop_the_shard(
        tmp_path):
    """A group commit on the committer thread that raises something other than a store
    error (memory is restored all the same) fails its turn: UNAVAILABLE, and the shard
    serves on, as it does when the same commit runs inline. It used to escape the loop
    from the settling of the turn, and the shard thread died."""
    store = BuggyStore()
    h = Harness(pipelined_config(tmp_path), store=store)
    h.start()
    try:
        c = h.client()
        c.timeout = 3.0
        store.broken = True
        with pytest.raises(ShardError, match="UNAVAILABLE"):
            c.enqueue(spec("a"))
        assert c.enqueue(spec("b")) == f"{RUN}/b"
        with pytest.raises(ShardError, match="NOT_FOUND"):
            c.status(f"{RUN}/a")      # memory was restored: that enqueue never happened
        assert h.shard.counters["failed_commits"] == 1
    finally:
        h.close()


def test_every_pushed_event_counts_as_sent_or_unsent_when_a_watcher_drops_mid_turn(tmp_path):
    """A turn's events of one run go in several EVENTS messages (max_batch each); a watcher
    whose queue fills on one of them is dropped, and its share of the later ones counts as
    unsent too (it was counted for the first only: events + events_unsent fell short of
    what the turn recorded)."""
    h = overflowing_shard(tmp_path)
    try:
        a = h.client()
        raw = h.silent_peer()
        raw.send_multipart(encode(Watch(rid=1, run=RUN, since=0)))
        assert raw.poll(5000, zmq.POLLIN)       # answered: it watches (and reads no more)
        raw.recv_multipart()
        a.enqueue_fanout(spec("x"), [f"a{i}" for i in range(10000)])    # one turn
        counters = a.ping()["counters"]
        assert counters["events_unsent"] > 0
        assert counters["events"] + counters["events_unsent"] == 10000
    finally:
        h.close()


class SlowFlakyStore(MemoryStore):
    """A memory store whose commits take ``delay`` seconds and fail while ``failing``."""

    delay = 0.0
    failing = False

    def commit(self, batch):
        time.sleep(self.delay)
        if self.failing:
            raise StoreError("injected: the disk said no")
        return super().commit(batch)


def test_a_commit_that_fails_while_the_shard_stops_makes_the_stop_unclean(tmp_path):
    """A turn still in commit when the stop comes is settled before the store closes; when
    that commit fails, the stop says so (``stop_error``: ``leasehold shard`` then exits
    UNAVAILABLE, not 0 as if everything decided had been written)."""
    class Store(SlowFlakyStore):
        entered = threading.Event()     # a failing commit started

        def commit(self, batch):
            if self.failing:
                self.entered.set()
            return super().commit(batch)

    store = Store()
    h = Harness(pipelined_config(tmp_path), store=store)
    shard = h.start()
    c = h.client()
    c.timeout = 5.0
    assert c.enqueue(spec("a")) == f"{RUN}/a"
    store.delay, store.failing = 1.0, True
    errors = []

    def enqueue():
        try:
            c.enqueue(spec("b"))
        except ShardError as exc:
            errors.append(exc)

    t = threading.Thread(target=enqueue)
    t.start()
    try:
        assert store.entered.wait(5)        # b's turn is in commit (for 1 s)
        shard.stop()
    finally:
        t.join(10)
        h.close()
    assert not t.is_alive()
    assert [e.code for e in errors] == ["UNAVAILABLE"]
    assert shard.stop_error is not None and "a commit failed while stopping" in shard.stop_error


def test_a_clean_stop_has_no_stop_error(tmp_path):
    h = Harness(pipelined_config(tmp_path), store=SlowFlakyStore())
    shard = h.start()
    try:
        assert h.client().enqueue(spec("a")) == f"{RUN}/a"
    finally:
        h.close()
    assert shard.stop_error is None


def test_a_watch_resume_answered_unavailable_keeps_the_watch_going(tmp_path):
    """The WATCH a watcher re-sends after silence lands in a turn behind a commit that
    fails: it is answered UNAVAILABLE (retry). That is no reason to end the watch (nor
    ``Client.wait``): the watcher retries at its next refresh and sees the later events;
    the ShardError used to escape from ``next_event``."""
    store = SlowFlakyStore()
    h = Harness(pipelined_config(tmp_path), store=store)
    h.start()
    try:
        p = h.client()
        c = h.client()
        c.subscribe(RUN)
        store.delay, store.failing = 1.0, True
        t = threading.Thread(target=lambda: pytest.raises(ShardError, p.enqueue, spec("x")))
        t.start()
        try:
            with pytest.raises(ShardTimeout):       # its refreshes meet the failing commit
                c.next_event(timeout=1.5, refresh=0.2)
        finally:
            t.join(10)
        store.delay, store.failing = 0.0, False
        p.enqueue(spec("y"))
        e = c.next_event(timeout=5, refresh=0.3)
        assert (e.action, e.phase) == (f"{RUN}/y", "QUEUED")
    finally:
        h.close()


class ReadFailStore(MemoryStore):
    """A memory store whose next read of a retained outcome fails while ``failing``, once."""

    failing = False

    def get(self, partition, db, key):
        if self.failing and db == "retained":
            self.failing = False
            raise StoreError("injected: a read failed")
        return super().get(partition, db, key)


def test_the_request_a_turn_failed_on_and_those_after_it_are_answered_unavailable(tmp_path):
    """A store error while a request is applied fails the whole turn; every request of it
    is answered UNAVAILABLE (retry), the one that hit the error and those the turn had not
    reached included. Only those already answered in the turn were: the others got
    nothing, and their senders waited out their timeout."""
    store = ReadFailStore()
    h = Harness(base_config(tmp_path), store=store)
    h.start()
    ctx = zmq.Context()
    try:
        c = h.client()
        c.timeout = 2.0
        c.enqueue(spec("a"))
        store.failing = True
        with pytest.raises(ShardError, match="UNAVAILABLE"):
            c.enqueue(spec("b"))        # its retained-outcome check reads the store
        assert c.enqueue(spec("b")) == f"{RUN}/b"
        # A request behind the failing one in the same turn (when they arrive together) is
        # answered too: UNAVAILABLE then, its answer otherwise.
        raw = ctx.socket(zmq.DEALER)
        raw.linger = 0
        raw.connect(h.endpoint)
        store.failing = True
        raw.send_multipart(encode(Enqueue(rid=1, specs=[spec("c")])))
        raw.send_multipart(encode(Ping(rid=2)))
        got = {}
        while len(got) < 2 and raw.poll(3000, zmq.POLLIN):
            msg = decode(raw.recv_multipart())
            got[msg.rid] = msg
        raw.close(0)
        assert sorted(got) == [1, 2]
        assert isinstance(got[1], Error) and got[1].code == "UNAVAILABLE"
    finally:
        h.close()
        ctx.term()


def test_a_turn_in_commit_when_a_later_turn_fails_is_sent_once_it_is_written(tmp_path):
    """A turn that fails before its commit (a store read failing while a request is applied)
    restores memory from the store, discarding the turns still in commit; one the committer
    had already written is in the store, and so in memory again. It is sent as committed:
    it was answered UNAVAILABLE (its enqueue durable all the same) and its watch records
    were never numbered (the watcher never saw those actions QUEUED)."""
    bad = f"{RUN}/nosuch"

    class ReadFailSlowStore(SlowStore):
        delay = 0.0

        def get(self, partition, db, key):
            if db == "retained" and key == retained_key(bad):
                raise StoreError("injected: a read failed")
            return super().get(partition, db, key)

    store = ReadFailSlowStore()
    h = Harness(pipelined_config(tmp_path), store=store)
    h.start()
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.linger = 0
    try:
        cs = [h.client() for _ in range(3)]
        watcher = h.client()
        watcher.subscribe(RUN)
        raw.connect(h.endpoint)
        raw.send_multipart(encode(Ping(rid=1)))
        assert raw.poll(5000, zmq.POLLIN)
        raw.recv_multipart()
        store.delay = 0.5
        got = {}

        def enqueue(c, name):
            try:
                got[name] = c.enqueue(spec(name))
            except ShardError as exc:
                got[name] = exc.code

        # Two turns in commit, a third waiting for room; then a turn that enqueues and
        # fails (both raw messages arrive while the loop waits), with the third in commit.
        threads = []
        for c, name in zip(cs, ("a1", "a2", "a3"), strict=True):
            threads.append(threading.Thread(target=enqueue, args=(c, name)))
            threads[-1].start()
            time.sleep(0.05)
        time.sleep(0.1)
        raw.send_multipart(encode(Enqueue(rid=2, specs=[spec("b")])))
        raw.send_multipart(encode(Status(rid=3, actions=[bad])))
        for t in threads:
            t.join(10)
        store.delay = 0.0
        seen = set()
        try:
            while True:
                e = watcher.next_event(timeout=1.0, refresh=0.5)
                if e.phase == "QUEUED":
                    seen.add(e.action)
        except ShardTimeout:
            pass
        for name in ("a1", "a2", "a3"):
            aid = f"{RUN}/{name}"
            try:
                cs[0].status(aid)
            except ShardError:
                assert got[name] == "UNAVAILABLE"   # undone with the failed turn
                continue
            assert got[name] == aid, f"{name} is durable, yet was answered {got[name]}"
            assert aid in seen, f"{name} is durable, yet its watcher never saw it QUEUED"
    finally:
        raw.close(0)
        ctx.term()
        h.close()


def test_a_refused_first_watch_does_not_stop_the_next_from_following_live_actions(tmp_path):
    """A run's first WATCH has the re-check follow its live actions (those assigned before
    it, whose changes the log never saw). A first WATCH refused (a since from before a
    restart, or past the latest) made the run's log all the same, so the WATCH after it was
    not the first: the running action was never followed, and its expiry never became an
    event (the watcher waited for it for ever)."""
    h = Harness(base_config(tmp_path, heartbeat_interval=0.2, expiry_missed_beats=1,
                            expiry_jitter=0.0, system_retries=0), store=MemoryStore())
    h.start()
    try:
        c = h.client()
        w = h.worker()
        aid = c.enqueue(spec("x"))
        (lease,) = w.leases(timeout=5)      # assigned before anyone watches the run
        watcher = h.client()
        with pytest.raises(WatchLost):
            watcher.subscribe(RUN, 1 << 62)     # past the latest: refused
        watcher.subscribe(RUN, 0)
        # The worker sends no heartbeat: the lease expires, and with no retry left the
        # action ends; only the backstop re-check can see it.
        e = watcher.next_event(timeout=5, refresh=10)
        assert e.action == aid and e.phase in ("FAILED", "TIMED_OUT"), e
    finally:
        h.close()


def test_one_client_watching_many_runs_does_not_stop_another_clients_watch(tmp_path):
    # Every log watched: a WATCH of one more run evicted the least recently watched log,
    # whoever watched it; a client watching many runs (they need not exist) stopped another
    # tenant's watch. Now it may evict only its own logs, or is refused.
    h = Harness(base_config(tmp_path, heartbeat_interval=240.0), store=MemoryStore())
    h.start(watch_runs=2)
    try:
        watcher, greedy = h.client(), h.client()
        watcher.subscribe(RUN)
        greedy.subscribe("acme/ml/prod/g0")
        greedy.subscribe("acme/ml/prod/g1")            # evicts its own g0, not RUN
        with pytest.raises(ShardError, match="RESOURCE_EXHAUSTED.*2 runs are watched"):
            h.client().subscribe("acme/ml/prod/g2")    # every log another connection's
        aid = greedy.enqueue(spec("x"))
        e = watcher.next_event(timeout=3, refresh=0.3, runs=(RUN,))
        assert (e.action, e.phase) == (aid, "QUEUED")
    finally:
        h.close()


def test_a_lost_watch_of_another_run_does_not_end_the_wait_for_this_one(tmp_path):
    """A client watching two runs waits for events of one (``next_event(runs=...)``, which
    ``watch`` and ``wait`` use): a silence resumes that run, not the other. It resumed every
    run, so the other's WatchLost (its log evicted) ended the wait for this one (and a
    ``watch`` iterator of this run) instead of waiting for the caller to ask for the other."""
    other = "acme/ml/prod/other"
    h = Harness(base_config(tmp_path, heartbeat_interval=240.0), store=MemoryStore())
    h.start(watch_runs=2)
    try:
        c = h.client()
        c.subscribe(other)
        c.subscribe(RUN)
        c.subscribe("acme/ml/prod/third")               # evicts the other run's log
        with pytest.raises(ShardTimeout):
            c.next_event(timeout=1.0, refresh=0.3, runs=(RUN,))    # silence: resumes
        aid = c.enqueue(spec("x"))
        e = c.next_event(timeout=3, refresh=0.3, runs=(RUN,))
        assert (e.action, e.phase) == (aid, "QUEUED")
        with pytest.raises(WatchLost, match="other"):
            c.next_event(timeout=3, refresh=0.3, runs=(other,))
    finally:
        h.close()


def test_events_of_an_action_assigned_before_the_watch_carry_its_attempt(tmp_path):
    """A run's first WATCH has the log follow its live actions from their phase and attempt
    now: the reports of an action assigned before it are events of attempt 1, as its lease
    said (they carried attempt 0 until its next assignment)."""
    h = Harness(base_config(tmp_path, heartbeat_interval=240.0), store=MemoryStore())
    h.start()
    try:
        c = h.client()
        w = h.worker()
        aid = c.enqueue(spec("x"))
        (lease,) = w.leases(timeout=5)
        assert lease.attempt == 1
        watcher = h.client()
        watcher.subscribe(RUN)
        assert w.report([lease.token], Phase.RUNNING) == []
        assert w.report([lease.token], Phase.SUCCEEDED) == []
        got = [watcher.next_event(timeout=3, refresh=10) for _ in range(2)]
        assert [(e.action, e.phase, e.attempt) for e in got] == [
            (aid, "RUNNING", 1), (aid, "SUCCEEDED", 1)]
    finally:
        h.close()


def test_a_retry_leased_again_in_the_turn_of_its_failure_is_seen_queued_in_between(tmp_path):
    """A retryable failure whose retry is due at once is leased again by the tick of the
    turn that took the report. The watcher is promised the phase each change entered
    (docs/protocol.md: QUEUED on a retry), so it sees the retry: RUNNING of attempt 1, QUEUED
    (the failure of attempt 1, its message the detail), INITIALIZING of attempt 2. The
    re-read after the turn found the action assigned again, and attempt 1's failure never
    became an event."""
    h = Harness(base_config(tmp_path, heartbeat_interval=240.0), store=MemoryStore())
    h.start()
    try:
        c = h.client()
        w = h.worker()
        c.subscribe(RUN)
        aid = c.enqueue(spec("x", retries={"count": 1, "backoff_base": 0}))
        (lease,) = w.leases(timeout=5)
        assert w.report([lease.token], Phase.RUNNING) == []
        assert w.report([lease.token], Phase.FAILED, {0: {
            "error_kind": "USER", "message": "boom", "recoverable": True}}) == []
        (again,) = w.leases(timeout=5)
        assert again.attempt == 2
        got = [c.next_event(timeout=3, refresh=10) for _ in range(5)]
        assert [(e.action, e.phase, e.attempt) for e in got] == [
            (aid, "QUEUED", 0), (aid, "INITIALIZING", 1), (aid, "RUNNING", 1),
            (aid, "QUEUED", 1), (aid, "INITIALIZING", 2)]
        assert "boom" in got[3].detail
    finally:
        h.close()


def _bug_once(monkeypatch, cls, name, when=lambda *a: True):
    """Make ``cls.name`` raise RuntimeError("injected bug") on its first call that ``when``
    accepts (a bug in the shard), and behave as before afterwards."""
    real = getattr(cls, name)
    armed = [True]

    def buggy(self, *args, **kw):
        if armed[0] and when(*args):
            armed[0] = False
            raise RuntimeError("injected bug")
        return real(self, *args, **kw)
    monkeypatch.setattr(cls, name, buggy)


@pytest.mark.parametrize("pipelined", [False, True], ids=["inline", "committer"])
def test_a_bug_while_a_turns_events_are_recorded_loses_the_watch_not_the_shard(
        tmp_path, monkeypatch, caplog, pipelined):
    """A bug while a committed turn's watch records join the log (after its answers left)
    is logged with its traceback; the shard serves on, and the run's watchers are told
    their events are gone (WatchLost at their resume) instead of missing the change
    silently. On the committer's path the exception escaped the loop and stopped the
    shard; inline, the log numbered on and the watcher never saw the enqueue."""
    from transport import WatchLog

    cfg = pipelined_config(tmp_path) if pipelined else base_config(
        tmp_path, heartbeat_interval=240.0)
    h = Harness(cfg, store=MemoryStore())
    h.start()
    try:
        c = h.client()
        c.timeout = 3.0
        watcher = h.client()
        watcher.subscribe(RUN)
        _bug_once(monkeypatch, WatchLog, "record_many")
        with caplog.at_level("ERROR", logger="leasehold.shard"):
            aid = c.enqueue(spec("a"))          # answered before the records join the log
            assert c.ping()["shard"]            # the shard serves on
        assert any(r.exc_info and "injected bug" in str(r.exc_info[1])
                   for r in caplog.records), caplog.text
        with pytest.raises(WatchLost):
            e = watcher.next_event(timeout=3, refresh=0.3)
            pytest.fail(f"an event after the lost one, over the gap: {e}")
        watcher.subscribe(RUN)                  # from now on (it re-reads the status)
        assert c.status(aid) in (Phase.QUEUED, Phase.WAITING_FOR_RESOURCES)   # durable
        bid = c.enqueue(spec("b"))
        e = watcher.next_event(timeout=3, refresh=10)
        assert (e.action, e.phase) == (bid, "QUEUED")
    finally:
        h.close()


@pytest.mark.parametrize("pipelined", [False, True], ids=["inline", "committer"])
def test_a_bug_while_a_committed_turn_is_answered_answers_internal_and_serves_on(
        tmp_path, monkeypatch, caplog, pipelined):
    """A bug while a committed turn's answers are sent leaves no request unanswered: the
    ones not answered yet get INTERNAL (their changes are durable: the enqueue is there),
    the traceback goes to the shard's log, and the shard serves on. On the committer's path
    the exception stopped the shard and the client waited out its timeout."""
    from transport import _shard as shard_module
    from transport._protocol import Reply

    cfg = pipelined_config(tmp_path) if pipelined else base_config(
        tmp_path, heartbeat_interval=240.0)
    h = Harness(cfg, store=MemoryStore())
    h.start()
    try:
        c = h.client()
        c.timeout = 3.0
        _bug_once(monkeypatch, shard_module._Loop, "send",
                  when=lambda conn, msg: type(msg) is Reply)
        with caplog.at_level("ERROR", logger="leasehold.shard"):
            with pytest.raises(ShardError, match="INTERNAL") as err:
                c.enqueue(spec("a"))
            assert "durable" in str(err.value)
            assert c.status(f"{RUN}/a") in (Phase.QUEUED, Phase.WAITING_FOR_RESOURCES)
            assert c.ping()["shard"]
        assert any(r.exc_info and "injected bug" in str(r.exc_info[1])
                   for r in caplog.records), caplog.text
    finally:
        h.close()


def test_the_recheck_spread_over_turns_still_sees_every_expiry(tmp_path, monkeypatch):
    """The backstop re-check reads ``RECHECK`` tracked actions a turn, its round going on in
    the next turns (reading every one in one turn held the loop for seconds at scale): with
    a budget of 4, each of 30 leases that expire (assigned before the WATCH: only the
    re-check sees them end) still becomes its event."""
    from transport import _shard_watches

    monkeypatch.setattr(_shard_watches, "RECHECK", 4)
    h = Harness(base_config(tmp_path, heartbeat_interval=0.2, expiry_missed_beats=1,
                            expiry_jitter=0.0, system_retries=0), store=MemoryStore())
    h.start()
    try:
        c = h.client()
        w = h.worker()
        ids = c.enqueue_many([spec(f"a{i}") for i in range(30)])
        leases = w.leases(timeout=5, want=30)
        assert len(leases) == 30
        watcher = h.client()
        watcher.subscribe(RUN)
        # The worker sends no heartbeat: every lease expires, and with no retry left each
        # action ends; only the re-check can see it.
        ended = {}
        deadline = time.monotonic() + 15
        while len(ended) < 30 and time.monotonic() < deadline:
            e = watcher.next_event(timeout=5, refresh=10)
            assert e.attempt == 1, e
            if e.phase in ("FAILED", "TIMED_OUT"):
                ended[e.action] = e.phase
        assert sorted(ended) == sorted(ids)
    finally:
        h.close()


def test_the_read_paths_and_the_recheck_are_counted_one_turn_at_a_time(tmp_path):
    """Shard.counters times the WATCH and STATUS handlers, and each re-check turn moves
    recheck_turns by one with its decide time, its re-check's part and the tracked actions
    it read (bench/watch.py reads these, not the loop's methods)."""
    h = Harness(base_config(tmp_path, heartbeat_interval=0.2), store=MemoryStore())
    shard = h.start()
    try:
        c = h.client()
        ids = c.enqueue_many([spec(f"a{i}") for i in range(10)])   # no worker: all queued
        assert shard.counters["watch_ns"] == shard.counters["status_ns"] == 0
        c.subscribe(RUN)
        assert shard.counters["watch_ns"] > 0
        assert shard.counters["status_ns"] == 0
        assert c.status(ids) == [Phase.WAITING_FOR_RESOURCES] * 10     # no worker yet
        assert shard.counters["status_ns"] > 0
        deadline = time.monotonic() + 10
        while shard.counters["recheck_turns"] < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        got = shard.counters
        assert got["recheck_turns"] >= 3
        # Each backstop turn re-read the run's 10 live actions, a whole round a turn.
        assert got["recheck_reads"] == 10 * got["recheck_turns"]
        assert 0 < got["recheck_ns"] <= got["recheck_turn_ns"] <= got["decide_ns"]
    finally:
        h.close()


def _events_until_quiet(c, quiet=0.5):
    """The watcher's events until none comes for ``quiet`` seconds (bounded by it)."""
    got = []
    while True:
        try:
            got.append(c.next_event(timeout=quiet, refresh=10))
        except ShardTimeout:
            return got


def test_an_idempotent_re_enqueue_of_a_watched_run_records_no_event(tmp_path):
    """Re-enqueueing an id with the same spec is a no-op (a client's retry): the watcher
    sees no change. Every id an ENQUEUE answered was recorded QUEUED of attempt 0, so a
    retried enqueue of a running action told its watcher it was queued again (attempt 0),
    one of an ended action that it was queued after it ended (and the re-check then told it
    the end once more); by every enqueue path."""
    h = Harness(base_config(tmp_path, heartbeat_interval=240.0), store=MemoryStore())
    h.start()
    try:
        c = h.client()
        w = h.worker()
        c.subscribe(RUN)
        a, b = c.enqueue_many([spec("a"), spec("b")])
        leases = w.leases(timeout=5, want=2)
        by = {x.action: x for x in leases}
        assert w.report([by[a].token], Phase.RUNNING) == []
        assert w.report([by[b].token], Phase.SUCCEEDED) == []
        before = _events_until_quiet(c)
        assert [(e.action, e.phase) for e in before if e.action == b][-1] == (b, "SUCCEEDED")
        assert c.enqueue_many([spec("a"), spec("b")]) == [a, b]
        assert c.enqueue(spec("a")) == a
        c.enqueue_fanout(spec("x"), ["a", "b"])
        new = c.enqueue(spec("c"))
        got = _events_until_quiet(c)
        # Only the new action's changes: nothing of the re-enqueued ones.
        assert {e.action for e in got} == {new}, [(e.action, e.phase, e.attempt) for e in got]
        assert (got[0].phase, got[0].attempt) == ("QUEUED", 0)
    finally:
        h.close()


def test_an_action_a_status_has_the_watch_follow_carries_its_attempt(tmp_path):
    """A STATUS of a watched run's live actions has the re-check follow those the log does
    not (here: past its ``watch_live`` bound at the first WATCH) from their phase and
    attempt now: the reports of one assigned before the watch are events of attempt 1, as its
    lease said (the STATUS followed each at attempt 0, so they said attempt 0)."""
    h = Harness(base_config(tmp_path, heartbeat_interval=240.0), store=MemoryStore())
    h.start(watch_live=1)
    try:
        c = h.client()
        w = h.worker()
        a, b = c.enqueue_many([spec("a"), spec("b")])
        by = {x.action: x for x in w.leases(timeout=5, want=2)}
        assert by[b].attempt == 1
        watcher = h.client()
        watcher.subscribe(RUN)                  # follows a only (watch_live=1)
        assert w.report([by[a].token], Phase.SUCCEEDED) == []
        e = watcher.next_event(timeout=3, refresh=10)
        assert (e.action, e.phase, e.attempt) == (a, "SUCCEEDED", 1)
        assert watcher.status([a, b]) == [Phase.SUCCEEDED, Phase.INITIALIZING]
        assert w.report([by[b].token], Phase.RUNNING) == []
        e = watcher.next_event(timeout=3, refresh=10)
        assert (e.action, e.phase, e.attempt) == (b, "RUNNING", 1)
    finally:
        h.close()


def test_a_status_answers_each_phase_and_refuses_an_unknown_action(insecure):
    """STATUS (read in one pass) answers the phase of each id in order, whether the run is
    watched or not, and NOT_FOUND naming an id the shard does not know."""
    c = insecure.client()
    w = insecure.worker()
    a, b = c.enqueue_many([spec("a"), spec("b")])
    other = c.enqueue(spec("x", run="acme/ml/prod/r2"))
    leases = w.leases(timeout=5, want=3)
    tok = {x.action: x.token for x in leases}
    assert w.report([tok[a]], Phase.SUCCEEDED) == []
    assert w.report([tok[other]], Phase.RUNNING) == []
    for watched in (False, True):
        if watched:
            c.subscribe(RUN)
        assert c.status([b, other, a, b]) == [Phase.INITIALIZING, Phase.RUNNING,
                                              Phase.SUCCEEDED, Phase.INITIALIZING]
        with pytest.raises(ShardError, match="r1/nope") as err:
            c.status([a, f"{RUN}/nope", b])
        assert err.value.code == "NOT_FOUND"


def _clocked(tmp_path, **engine):
    """A shard on a ManualClock, no backstop tick within a test (its ticks come from
    messages), and a client and a worker of it."""
    clock = ManualClock(1_000_000_000_000)
    h = Harness(base_config(tmp_path, heartbeat_interval=240.0, expiry_missed_beats=1,
                            expiry_jitter=0.0, pause_on_expiry=False, **engine),
                store=MemoryStore())
    h.start(clock=clock)
    return h, clock


def test_a_runtime_backstop_retry_leased_again_in_its_tick_is_seen_queued_in_between(
        tmp_path):
    """The engine's runtime backstop ends an attempt running past max_runtime + grace, and
    its retry (no backoff) is leased again by the same schedule() call: the watcher sees
    the retry (QUEUED of attempt 1, the timeout's text the detail) before INITIALIZING of
    attempt 2. The loop learnt only what the turn's leases said: RUNNING of attempt 1,
    then INITIALIZING of attempt 2."""
    h, clock = _clocked(tmp_path, runtime_grace=1.0)
    try:
        c = h.client()
        w = h.worker()
        c.subscribe(RUN)
        aid = c.enqueue(spec("x", retries={"count": 1, "backoff_base": 0},
                             timeouts={"max_runtime": 10}))
        (lease,) = w.leases(timeout=5)
        assert w.report([lease.token], Phase.RUNNING) == []
        clock.advance(60)
        w.heartbeat([lease.token], free={"cpu": 64})    # a tick: the runtime backstop
        again = [(x.action, x.attempt) for x in w.leases(timeout=5, want=2)
                 if x.kind == LeaseKind.RUN]     # (and the timed out attempt's cleanup)
        assert again == [(aid, 2)], again
        got = _events_until_quiet(c)
        assert [(e.action, e.phase, e.attempt) for e in got] == [
            (aid, "QUEUED", 0), (aid, "INITIALIZING", 1), (aid, "RUNNING", 1),
            (aid, "QUEUED", 1), (aid, "INITIALIZING", 2)]
        assert "max_runtime" in got[3].detail
    finally:
        h.close()


def test_a_lease_expiry_leased_again_before_the_re_check_read_it_is_seen_queued(tmp_path):
    """A lease expires in a tick the re-check does not follow (a message's, not the
    backstop's); its retry is leased again by the next tick. The watcher sees the expiry
    (QUEUED of attempt 1, its reason the detail) before INITIALIZING of attempt 2: the
    engine names what its ticks changed on their own (Engine.decided_changes). The re-check
    read the action only at the next backstop, assigned again by then: RUNNING of attempt
    1, then INITIALIZING of attempt 2."""
    h, clock = _clocked(tmp_path)
    try:
        c = h.client()
        w = h.worker()
        c.subscribe(RUN)
        aid = c.enqueue(spec("x", retries={"count": 0, "backoff_base": 0}))
        (lease,) = w.leases(timeout=5)
        assert w.report([lease.token], Phase.RUNNING) == []
        clock.advance(300)                          # past the lease's ttl (240 s)
        c.enqueue(spec("y", run="acme/ml/prod/other"))   # a tick: the lease expires
        assert c.status(aid) == Phase.QUEUED        # retry backoff, due now
        clock.advance(1)
        c.enqueue(spec("z", run="acme/ml/prod/other"))   # a tick: the retry is leased
        got = [(x.action, x.attempt) for x in w.leases(timeout=5, want=4)
               if x.kind == LeaseKind.RUN]      # (and the expired attempt's cleanup)
        assert got == [(f"{RUN.rsplit('/', 1)[0]}/other/y", 1),
                       (f"{RUN.rsplit('/', 1)[0]}/other/z", 1), (aid, 2)], got
        events = _events_until_quiet(c)
        assert [(e.action, e.phase, e.attempt) for e in events] == [
            (aid, "QUEUED", 0), (aid, "INITIALIZING", 1), (aid, "RUNNING", 1),
            (aid, "QUEUED", 1), (aid, "INITIALIZING", 2)]
        assert "expired" in events[3].detail
    finally:
        h.close()


def test_an_error_repeating_a_long_input_is_cut_to_the_limit_not_dropped(insecure):
    # An unknown resource's name is repeated by its error: over max_text the client dropped
    # the answer and the request timed out as UNAVAILABLE.
    c = insecure.client()
    limit = insecure.config.transport.max_text
    name = "r" * (2 * limit)
    started = time.monotonic()
    with pytest.raises(ShardError, match="INVALID_ARGUMENT") as err:
        c.enqueue(spec("a", resources={name: 1}))
    assert time.monotonic() - started < 4.0     # answered, not the 5 s timeout
    message = str(err.value)
    assert name[:200] in message
    assert len(err.value.error_message) == limit and err.value.error_message.endswith("\u2026")


def test_every_name_of_a_spec_is_bounded_on_the_wire_as_its_id_is(insecure):
    c = insecure.client()
    long = "t" * (insecure.config.transport.max_name + 1)
    for field, value in (("task", long), ("environment", long), ("image", long)):
        with pytest.raises(ShardError, match=f"TOO_LARGE.*{field}.*over the limit"):
            c.enqueue(spec("a", **{field: value}))
    with pytest.raises(ShardError, match=r"TOO_LARGE.*pods\[0\]\.role"):
        c.enqueue({"id": f"{RUN}/a", "task": "t",
                   "pods": [{"role": long, "replicas": 1, "resources": {"cpu": 1}}]})
    c.enqueue(spec("a", task="t" * insecure.config.transport.max_name))   # at the limit


def test_a_report_with_a_long_message_is_cut_not_refused(insecure):
    # A plugin's long message (an import error naming a long path) made the whole REPORT
    # TOO_LARGE: the attempt's outcome was lost and the lease expired as a system error.
    c = insecure.client()
    w = insecure.worker()
    c.subscribe(RUN)
    c.enqueue(spec("a"))
    (lease,) = w.leases(timeout=5, want=1)
    limit = insecure.config.transport.max_text
    text = "cannot import " + "x" * (3 * limit)
    assert w.report([lease.token], Phase.FAILED, {0: {
        "error_kind": "USER", "message": text, "recoverable": False}}) == []
    assert c.wait([f"{RUN}/a"], timeout=10) == {f"{RUN}/a": Phase.FAILED}
    details = []
    while True:
        try:
            e = c.next_event(timeout=0.5, runs=(RUN,))
        except Exception:
            break
        if e.phase == "FAILED":
            details.append(e.detail)
    assert details and details[-1].startswith("cannot import xxx")
    assert len(details[-1]) <= limit


def test_an_integer_past_64_bits_is_refused_by_the_client_naming_it(insecure):
    # msgpack cannot carry it: the client raised its OverflowError ("Integer value out of
    # range"), which the CLI reported as INTERNAL (a bug).
    c = insecure.client()
    with pytest.raises(SpecError, match=r"ENQUEUE: cannot be sent: specs\[0\]\.retries\.count = "
                                        r"100000000000000000000 does not fit in 64 bits"):
        c.enqueue(spec("a", retries={"count": 10**20}))
    c.enqueue(spec("a"))            # the connection serves on
    assert c.status([f"{RUN}/a"]) == [Phase.WAITING_FOR_RESOURCES]


def test_a_registration_with_a_capacity_that_is_no_quantity_is_refused_naming_it(insecure):
    with pytest.raises(ShardError, match="INVALID_ARGUMENT.*capacity: cpu: '5 parsecs' has "
                                         "unit 'parsecs'"):
        insecure.worker(capacity={"cpu": "5 parsecs"})
    w = insecure.worker(name="east-2", capacity={"cpu": "500m"})     # a good one registers
    assert w.heartbeat([], free={"cpu": 0.5}) == []


def test_leases_of_many_large_specs_go_in_messages_a_worker_can_decode(tmp_path):
    # One LEASES message a worker: of many distinct large specs it passed the frame limit,
    # and the worker dropped it whole (every lease then expired).
    cfg = base_config(tmp_path)
    cfg = replace(cfg, transport=replace(cfg.transport, max_header_bytes=64 << 10))
    h = Harness(cfg, store=MemoryStore())
    h.start()
    try:
        c = h.client()
        # Registered after the enqueues: one tick leases all of them out at once.
        w = h.worker(slots=1000, settings=cfg.transport, connect=False)
        big = "v" * 2000
        ids = []
        for k in range(20):
            specs = [spec(f"a{k}-{i}", resources={"cpu": "10m"},
                          execute={"plugin": "process", "command": ["true"],
                                   "env": {"PAD": big, "N": f"{k}-{i}"}})
                     for i in range(10)]
            ids += c.enqueue_many(specs)
        w.connect()
        got = w.leases(timeout=10, want=len(ids))
        assert sorted(x.action for x in got) == sorted(ids)
        assert h.shard.counters["leases_unsent"] == 0
    finally:
        h.close()


def test_a_request_over_the_frame_limits_is_refused_by_the_client_at_once(insecure):
    # The shard drops a frame over its limit with the connection: the request went
    # unanswered and timed out as UNAVAILABLE ("no answer within 10 s").
    c = insecure.client()
    limit = insecure.config.transport.max_header_bytes
    big = "x" * (limit + 1)
    started = time.monotonic()
    with pytest.raises(SpecError, match="ENQUEUE: cannot be sent: its header is .* bytes, over "
                                        "the limit .* \\(transport.max_header_bytes\\)"):
        c.enqueue(spec("a", execute={"plugin": "process", "command": ["echo", big]}))
    assert time.monotonic() - started < 1.0
    c.enqueue(spec("a"))            # nothing was sent: the connection serves on
    assert c.status([f"{RUN}/a"]) == [Phase.WAITING_FOR_RESOURCES]
