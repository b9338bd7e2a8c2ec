"""Pipelined commits (transport/_committer.py, docs/shard.md "Pipelined commits"): the shard
decides turn N+1 while turn N's group commit is in progress; nothing of a turn is sent
before its own commit returned, turns leave in order, and a failed commit sends nothing of
its turn or of any turn decided after it. Real sockets on loopback; a store whose commits
a test holds at a gate; every wait bounded."""

import threading

import pytest
import zmq

from engine import Phase, parse_config
from storage import LmdbStore, MemoryStore, OwnershipError, StoreError, StoreFull
from tests.conftest import until
from transport import Client, Enqueue, Error, Reply, Shard, client_socket, decode, encode

RUN = "acme/ml/prod/r1"
WAITING = Phase.WAITING_FOR_RESOURCES   # no worker is connected: enqueued, never placed


def config(tmp_path, pipeline=2, inline=False):
    return parse_config({
        "resources": ["cpu"],
        "clusters": {"east": {"capacity": {"cpu": 64}}},
        "queues": {"q": {"scheduling": "GREEDY_CAPACITY", "depth": 1000}},
        "engine": {"default_queue": "q", "heartbeat_interval": 1.0},
        "storage": {"path": str(tmp_path / "data"), "partitions": 2},
        "transport": {"endpoints": ["tcp://127.0.0.1:0"], "commit_pipeline": pipeline,
                      # These tests hold a lone turn in the pipeline: not committed inline.
                      "idle_commit_inline": inline},
        "security": {"insecure": True},
    })


class Gate:
    """Holds store commits (while ``held``) until :meth:`open`; counts the commits that
    reached the store."""

    def __init__(self):
        self.held = False
        self.entered = threading.Event()
        self.release = threading.Event()
        self.commits = 0

    def __call__(self, batch):
        self.commits += 1
        if self.held:
            self.entered.set()
            assert self.release.wait(10), "the test never opened the gate"

    def open(self):
        self.held = False
        self.release.set()


class GatedMemoryStore(MemoryStore):
    def __init__(self, gate):
        super().__init__(2)
        self.gate = gate

    def commit(self, batch):
        self.gate(batch)
        return super().commit(batch)


class GatedLmdbStore(LmdbStore):
    def __init__(self, path, gate):
        super().__init__(path, partitions=2, map_size=1 << 20)
        self.gate = gate

    def commit(self, batch):
        self.gate(batch)
        return super().commit(batch)


def spec(name):
    return {"id": f"{RUN}/{name}", "task": "t", "resources": {"cpu": 1}}


class Raw:
    """A DEALER sending requests without waiting for their answers."""

    def __init__(self, endpoint):
        self.ctx = zmq.Context()
        self.sock = client_socket(self.ctx, endpoint, None)

    def enqueue(self, rid, name):
        self.sock.send_multipart(encode(Enqueue(rid=rid, specs=[spec(name)])))

    def answer(self, timeout):
        """The next answer, or None when none came within ``timeout`` seconds."""
        if not self.sock.poll(int(timeout * 1000)):
            return None
        return decode(self.sock.recv_multipart())

    def close(self):
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def rig(tmp_path):
    made = []

    def make(store, pipeline=2, inline=False):
        shard = Shard(config(tmp_path, pipeline, inline), store=store).start()
        raw = Raw(shard.endpoint)
        made.append((shard, raw))
        return shard, raw

    yield make
    for shard, raw in made:
        raw.close()
        shard.stop()


def hold_two_turns(shard, raw, gate):
    """Enqueue ``a`` and hold its commit at the gate; enqueue ``b``, decided as the next
    turn while ``a`` is still in commit. Returns once both turns were decided."""
    gate.held = True
    raw.enqueue(1, "a")
    assert gate.entered.wait(10), "the first turn's commit never started"
    turns = shard.counters["turns"]
    raw.enqueue(2, "b")
    until(lambda: shard.counters["turns"] > turns, 10, "the second turn was never decided")


def test_the_next_turn_is_decided_while_a_commit_is_held_and_answers_wait_for_it(rig):
    gate = Gate()
    shard, raw = rig(GatedMemoryStore(gate))
    hold_two_turns(shard, raw, gate)
    # Decided, not durable: nothing of either turn has left the shard.
    assert raw.answer(0.3) is None
    gate.open()
    first, second = raw.answer(10), raw.answer(10)
    assert isinstance(first, Reply) and first.rid == 1 and first.body["ids"] == [f"{RUN}/a"]
    assert isinstance(second, Reply) and second.rid == 2 and second.body["ids"] == [f"{RUN}/b"]
    with Client(endpoint=shard.endpoint, timeout=5.0) as c:
        assert c.status(f"{RUN}/a") == WAITING
        assert c.status(f"{RUN}/b") == WAITING


@pytest.mark.parametrize("pipeline, inline", [(1, False), (2, True)],
                         ids=["pipeline-of-one", "idle-commit-inline"])
def test_a_turn_committed_on_the_decision_thread_makes_the_next_one_wait(rig, pipeline,
                                                                        inline):
    # With a pipeline of one every turn is committed on the decision thread; with
    # idle_commit_inline (the default) so is a turn decided while no message waited. Either
    # way the next message waits for that commit to return.
    gate = Gate()
    shard, raw = rig(GatedMemoryStore(gate), pipeline=pipeline, inline=inline)
    gate.held = True
    raw.enqueue(1, "a")
    assert gate.entered.wait(10)
    turns = shard.counters["turns"]
    raw.enqueue(2, "b")
    assert raw.answer(0.3) is None
    assert shard.counters["turns"] == turns       # b waits for a's commit to return
    gate.open()
    assert [raw.answer(10).rid, raw.answer(10).rid] == [1, 2]


def test_a_failed_commit_sends_nothing_of_its_turn_nor_of_the_turn_decided_after_it(rig):
    gate = Gate()
    store = GatedMemoryStore(gate)
    shard, raw = rig(store)
    hold_two_turns(shard, raw, gate)
    store.fail_next(StoreError("injected: the disk said no"))
    gate.open()
    first, second = raw.answer(10), raw.answer(10)
    assert isinstance(first, Error) and first.rid == 1 and first.code == "UNAVAILABLE"
    assert isinstance(second, Error) and second.rid == 2 and second.code == "UNAVAILABLE"
    assert shard.counters["failed_commits"] >= 1
    with Client(endpoint=shard.endpoint, timeout=5.0) as c:
        # Memory is what the store holds: neither enqueue happened...
        for name in ("a", "b"):
            with pytest.raises(Exception, match="NOT_FOUND"):
                c.status(f"{RUN}/{name}")
        # ...and the shard serves on: the retried enqueues are acknowledged and durable.
        assert c.enqueue_many([spec("a"), spec("b")]) == [f"{RUN}/a", f"{RUN}/b"]
        assert c.status(f"{RUN}/b") == WAITING


def test_a_shard_whose_commit_finds_its_store_taken_over_answers_every_turn_it_decided(rig):
    # The first failure stops the engine while the turn decided after it is still with the
    # committer: that turn is answered too before the loop ends (it waited out its timeout).
    gate = Gate()
    store = GatedMemoryStore(gate)
    shard, raw = rig(store)
    hold_two_turns(shard, raw, gate)
    store.fail_next(OwnershipError(0, None, "shard-0", "commit"))
    gate.open()
    first, second = raw.answer(10), raw.answer(10)
    assert isinstance(first, Error) and first.rid == 1 and first.code == "UNAVAILABLE"
    assert isinstance(second, Error) and second.rid == 2 and second.code == "UNAVAILABLE"
    assert "taken over" in first.message


def test_a_full_store_grows_and_both_turns_are_written_in_order(rig, tmp_path):
    gate = Gate()
    store = GatedLmdbStore(str(tmp_path / "data"), gate)
    shard, raw = rig(store)
    hold_two_turns(shard, raw, gate)
    size = store.map_size
    store.fail_next(StoreFull(0, size))
    gate.open()
    first, second = raw.answer(10), raw.answer(10)
    assert isinstance(first, Reply) and first.rid == 1
    assert isinstance(second, Reply) and second.rid == 2
    assert store.map_size > size                   # the mend: the map grew
    shard.stop()
    # Both turns are in the store: a shard started afresh on it knows both actions.
    again = Shard(config(tmp_path), store=LmdbStore(str(tmp_path / "data"), partitions=2,
                                                     map_size=store.map_size)).start()
    try:
        with Client(endpoint=again.endpoint, timeout=5.0) as c:
            ids = [f"{RUN}/a", f"{RUN}/b"]
            assert all(ph in (Phase.QUEUED, WAITING) for ph in c.status(ids))   # both known
    finally:
        again.stop()


def test_commit_pipeline_out_of_range_is_refused_naming_the_key(tmp_path):
    for bad in (0, 17, "two"):
        with pytest.raises(Exception, match="transport.commit_pipeline"):
            config(tmp_path, bad)
