"""The partition map (docs/operations.md, "Several shards"): the ownership rule and its
helpers as functions, and two in-process shards of one 2-endpoint config over real sockets on
loopback: each refuses, whole and with WRONG_SHARD naming the tenant and both shards, every
request about a tenant it does not own, and keeps nothing of it; a Client of the config
routes each request to the owner, refuses a batch spanning shards before sending it, splits
a STATUS, watches runs on both shards at once, and sends per-shard requests to every shard.
(The same over real processes: tests/test_serve.py.) Every wait is bounded; every shard,
client and store is closed in teardown."""

import time

import pytest

from engine import Phase, parse_config
from storage import MemoryStore
from tests.conftest import free_port
from transport import (
    ERROR_CODES,
    INSECURE_PEER,
    Client,
    CrossShardBatch,
    Enqueue,
    Shard,
    ShardError,
    ShardTimeout,
    Status,
    WrongShard,
    authorize,
    check_owned,
    message_keys,
    shard_of,
    split_by_shard,
    tenant_of,
    tenant_shard,
)

# Tenants on either side of the map of two shards (asserted below, so a changed hash fails
# loudly here instead of making the tests vacuous).
ON_0, ON_1 = "globex", "acme"


def spec(tenant, name="a", run="r1", **kw):
    return {"id": f"{tenant}/ml/prod/{run}/{name}", "task": "t", "resources": {"cpu": 1}, **kw}


def test_the_tenants_used_here_hash_to_different_shards():
    assert tenant_shard(ON_0, 2) == 0 and tenant_shard(ON_1, 2) == 1


# ------------------------------------------------------------------------------ the rule


def test_tenant_of_is_the_first_segment():
    assert tenant_of("acme/ml/prod/r1/a") == "acme"
    assert tenant_of("acme/ml/prod/r1") == "acme"
    assert tenant_of("acme") == "acme"


def test_shard_of_is_tenant_shard_of_the_tenant():
    for n in (1, 2, 3, 7):
        for t in ("acme", "globex", "zeta", "initech"):
            assert shard_of(f"{t}/p/d/r/a", n) == tenant_shard(t, n)
    assert {shard_of("x/p/d/r/a", 1), shard_of("acme/p/d/r", 1)} == {0}


def test_split_by_shard_groups_positions_in_order():
    keys = [f"{ON_1}/p/d/r/a", f"{ON_0}/p/d/r/a", f"{ON_1}/p/d/r/b", f"{ON_0}/p/d/q"]
    assert split_by_shard(keys, 2) == {1: [0, 2], 0: [1, 3]}
    assert split_by_shard(keys, 1) == {0: [0, 1, 2, 3]}
    assert split_by_shard([], 2) == {}


def test_check_owned_refuses_a_foreign_tenant_naming_it_and_both_shards():
    check_owned([f"{ON_0}/p/d/r/a", f"{ON_0}/p/d/r"], 0, 2)          # its own: fine
    check_owned([f"{ON_1}/p/d/r/a"], 0, 1)                             # one shard owns all
    with pytest.raises(WrongShard) as ei:
        check_owned([f"{ON_0}/p/d/r/a", f"{ON_1}/p/d/r/b"], 0, 2, what="ENQUEUE")
    e = ei.value
    assert (e.code, e.tenant, e.owner, e.shard) == ("WRONG_SHARD", ON_1, 1, 0)
    text = str(e)
    assert text.startswith("ENQUEUE: ") and repr(ON_1) in text
    assert "owned by shard 1 of 2" in text and "not by this shard 0" in text, text


def test_wrong_shard_is_a_wire_error_code():
    assert "WRONG_SHARD" in ERROR_CODES


def test_message_keys_name_ids_parents_and_runs():
    msg = Enqueue(rid=1, specs=[spec(ON_0), spec(ON_1, "b", parent=f"{ON_1}/ml/prod/r1/a")])
    assert message_keys(msg) == [f"{ON_0}/ml/prod/r1/a", f"{ON_1}/ml/prod/r1/b",
                                 f"{ON_1}/ml/prod/r1/a"]
    assert message_keys(Status(rid=1, actions=["a/b/c/d/e"])) == ["a/b/c/d/e"]
    authorize(INSECURE_PEER, msg)       # the authorisation reads the same keys


# ------------------------------------------------------------------------------ two shards


def two_shard_config(tmp_path):
    eps = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    return parse_config({
        "resources": ["cpu"],
        "clusters": {"east": {"capacity": {"cpu": 64}}},
        "queues": {"q": {"scheduling": "GREEDY_CAPACITY", "depth": 1000}},
        "engine": {"default_queue": "q", "heartbeat_interval": 1.0},
        "storage": {"path": str(tmp_path / "data"), "partitions": 2},
        "transport": {"endpoints": eps},
        "status": {"metrics": False},
        "security": {"insecure": True},
    })


@pytest.fixture
def pair(tmp_path):
    cfg = two_shard_config(tmp_path)
    shards = []
    clients = []
    try:
        for i in (0, 1):
            shards.append(Shard(cfg, i, store=MemoryStore()).start())

        def client(**kw):
            c = Client(cfg, timeout=5.0, **kw)
            clients.append(c)
            return c
        yield cfg, shards, client
    finally:
        for c in clients:
            c.close()
        for s in shards:
            s.stop()


def test_a_shard_refuses_every_request_about_a_tenant_it_does_not_own(pair):
    _cfg, _shards, client = pair
    pinned = client(shard=0)
    aid = f"{ON_1}/ml/prod/r1/a"
    calls = {
        "ENQUEUE": lambda: pinned.enqueue(spec(ON_1)),
        "ENQUEUE_FANOUT": lambda: pinned.enqueue_fanout(spec(ON_1), ["x", "y"]),
        "ABORT": lambda: pinned.abort(aid),
        "STATUS": lambda: pinned.status([aid]),
        "EXPLAIN": lambda: pinned.explain(aid),
        "WATCH": lambda: pinned.subscribe(f"{ON_1}/ml/prod/r1"),
    }
    for what, call in calls.items():
        with pytest.raises(ShardError) as ei:
            call()
        e = ei.value
        assert e.code == "WRONG_SHARD", (what, e)
        assert e.error_message.startswith(f"{what}: tenant {ON_1!r}"), e.error_message
        assert "owned by shard 1 of 2, not by this shard 0" in e.error_message
        assert e.shard.startswith("0 at tcp://"), e.shard      # the client names it too


def test_a_refused_batch_stores_nothing_of_it(pair):
    _cfg, _shards, client = pair
    pinned0 = client(shard=0)
    # Its own tenant first, a foreign one after: refused whole (neither is enqueued).
    batch = [spec(ON_0, "mine"), spec(ON_1, "theirs")]
    with pytest.raises(ShardError) as ei:
        pinned0.enqueue_many(batch)
    assert ei.value.code == "WRONG_SHARD"
    with pytest.raises(ShardError) as ei:
        pinned0.status([f"{ON_0}/ml/prod/r1/mine"])
    assert ei.value.code == "NOT_FOUND"
    # A parent of a foreign tenant is refused too (nothing stored either).
    with pytest.raises(ShardError) as ei:
        pinned0.enqueue(spec(ON_0, "child", parent=f"{ON_1}/ml/prod/r1/p"))
    assert ei.value.code == "WRONG_SHARD"
    # The owner never heard of it.
    with pytest.raises(ShardError) as ei:
        client(shard=1).status([f"{ON_1}/ml/prod/r1/theirs"])
    assert ei.value.code == "NOT_FOUND"


def test_each_shard_takes_its_own_tenants(pair):
    _cfg, _shards, client = pair
    p0, p1 = client(shard=0), client(shard=1)
    assert p0.enqueue(spec(ON_0)) == f"{ON_0}/ml/prod/r1/a"
    assert p1.enqueue(spec(ON_1)) == f"{ON_1}/ml/prod/r1/a"
    assert p0.status(f"{ON_0}/ml/prod/r1/a") in (Phase.QUEUED, Phase.WAITING_FOR_RESOURCES)
    assert p1.status(f"{ON_1}/ml/prod/r1/a") in (Phase.QUEUED, Phase.WAITING_FOR_RESOURCES)
    # Per-shard requests name no tenant: any shard answers them.
    assert set(p0.queue_metrics()) == {"q"} and set(p1.queue_metrics()) == {"q"}
    assert p0.ping()["version"] == 1


def test_one_endpoint_owns_every_tenant(tmp_path):
    cfg = parse_config({
        "resources": ["cpu"], "clusters": {"east": {"capacity": {"cpu": 8}}},
        "queues": {"q": {}}, "engine": {"default_queue": "q"},
        "storage": {"path": str(tmp_path / "data"), "partitions": 2},
        "transport": {"endpoints": ["tcp://127.0.0.1:0"]}, "status": {"metrics": False},
        "security": {"insecure": True}})
    shard = Shard(cfg, store=MemoryStore()).start()
    try:
        with Client(endpoint=shard.endpoint, keys=None, timeout=5.0) as c:
            assert c.enqueue_many([spec(ON_0), spec(ON_1)]) == [
                f"{ON_0}/ml/prod/r1/a", f"{ON_1}/ml/prod/r1/a"]
    finally:
        shard.stop()


# ------------------------------------------------------------------------------ the client


def test_a_client_of_the_config_routes_each_tenant_to_its_owner(pair):
    cfg, _shards, client = pair
    c = client()
    assert c.routed and c.endpoint is None and c.endpoints == tuple(cfg.transport.endpoints)
    a0, a1 = f"{ON_0}/ml/prod/r1/a", f"{ON_1}/ml/prod/r1/a"
    assert c.endpoint_of(a0) == cfg.transport.endpoints[0]
    assert c.endpoint_of(f"{ON_1}/ml/prod/r1") == cfg.transport.endpoints[1]
    assert c.enqueue(spec(ON_0)) == a0
    assert c.enqueue_many([spec(ON_1), spec(ON_1, "b")]) == [a1, f"{ON_1}/ml/prod/r1/b"]
    assert c.enqueue_fanout(spec(ON_0, run="r2"), ["x", "y"]) == 2
    # Each landed on its owner only: the other shard refuses to even look.
    p0, p1 = client(shard=0), client(shard=1)
    assert p0.status([a0, f"{ON_0}/ml/prod/r2/y"])[1] != Phase.ABORTED
    assert p1.status(a1) in (Phase.QUEUED, Phase.WAITING_FOR_RESOURCES)
    for pinned, foreign in ((p0, a1), (p1, a0)):
        with pytest.raises(ShardError) as ei:
            pinned.status([foreign])
        assert ei.value.code == "WRONG_SHARD"
    # A STATUS over both shards is split, and answered in the order asked.
    mixed = [a1, a0, f"{ON_1}/ml/prod/r1/b", f"{ON_0}/ml/prod/r2/x"]
    assert len(c.status(mixed)) == 4
    assert c.status(mixed) == [p1.status(a1), p0.status(a0),
                               p1.status(f"{ON_1}/ml/prod/r1/b"),
                               p0.status(f"{ON_0}/ml/prod/r2/x")]
    assert c.explain(a1)["action"] == a1 and c.explain(a0)["action"] == a0
    assert c.abort(a1) == [a1]
    assert p1.status(a1) == Phase.ABORTED and p0.status(a0) != Phase.ABORTED
    with pytest.raises(ShardError) as ei:
        c.status([a0, f"{ON_1}/ml/prod/nope/z"])
    assert ei.value.code == "NOT_FOUND" and ei.value.shard.startswith("1 at tcp://")


def test_a_batch_spanning_shards_is_refused_before_anything_is_sent(pair):
    _cfg, _shards, client = pair
    c = client()
    batch = [spec(ON_0, "a"), spec(ON_1, "b"), spec(ON_0, "c")]
    with pytest.raises(CrossShardBatch) as ei:
        c.enqueue_many(batch)
    e = ei.value
    assert e.code == "INVALID_ARGUMENT" and e.shards == {0: [0, 2], 1: [1]}
    assert "spans 2 shards" in str(e) and repr(ON_1) in str(e) and repr(ON_0) in str(e)
    for pinned, aid in ((client(shard=0), f"{ON_0}/ml/prod/r1/a"),
                        (client(shard=1), f"{ON_1}/ml/prod/r1/b")):
        with pytest.raises(ShardError) as ei:
            pinned.status([aid])
        assert ei.value.code == "NOT_FOUND"
    # split_by_shard is the way to send it: one atomic batch a shard.
    ids = []
    for _shard, idx in split_by_shard([s["id"] for s in batch], 2).items():
        ids += c.enqueue_many([batch[i] for i in idx])
    assert sorted(ids) == sorted(s["id"] for s in batch)


def test_a_routing_client_refuses_a_spec_without_an_id_naming_it(pair):
    _cfg, _shards, client = pair
    from engine import SpecError
    with pytest.raises(SpecError, match=r"specs\[1\] has no string id"):
        client().enqueue_many([spec(ON_0), {"task": "t", "resources": {"cpu": 1}}])


def test_wait_follows_runs_on_both_shards_at_once(pair):
    _cfg, _shards, client = pair
    c = client()
    a0, a1 = f"{ON_0}/ml/prod/r1/a", f"{ON_1}/ml/prod/r1/a"
    # A cpu no cluster has: both stay queued (no worker either) until aborted.
    c.enqueue(spec(ON_0))
    c.enqueue(spec(ON_1))
    c.subscribe(f"{ON_0}/ml/prod/r1")
    c.subscribe(f"{ON_1}/ml/prod/r1")
    other = client()
    other.abort(a1)
    other.abort(a0)
    seen = {}
    deadline = time.monotonic() + 10
    while len(seen) < 2 and time.monotonic() < deadline:
        e = c.next_event(timeout=10)
        if e.phase == Phase.ABORTED.value:
            seen[e.action] = e.run
    assert seen == {a0: f"{ON_0}/ml/prod/r1", a1: f"{ON_1}/ml/prod/r1"}
    c.unsubscribe(f"{ON_0}/ml/prod/r1")
    c.unsubscribe(f"{ON_1}/ml/prod/r1")
    # wait() over both: one already ended on each shard, then two ended while it waits.
    b0, b1 = f"{ON_0}/ml/prod/r3/b", f"{ON_1}/ml/prod/r3/b"
    c.enqueue(spec(ON_0, "b", run="r3"))
    c.enqueue(spec(ON_1, "b", run="r3"))
    with pytest.raises(ShardTimeout) as ei:
        c.wait([a0, a1, b0, b1], timeout=0.5)
    assert "2 action(s) not ended" in str(ei.value)
    assert "0 at tcp://" in str(ei.value) and "1 at tcp://" in str(ei.value)
    other.abort(b1)
    other.abort(b0)
    assert c.wait([a0, a1, b0, b1], timeout=10) == dict.fromkeys([a0, a1, b0, b1],
                                                                 Phase.ABORTED)


def test_per_shard_requests_go_to_every_shard(pair):
    _cfg, shards, client = pair
    c = client()
    assert set(c.ping()) == {0, 1}
    assert {b["shard"] for b in c.ping().values()} == {s.name for s in shards}
    c.enqueue(spec(ON_1))
    m = c.queue_metrics()
    assert set(m) == {0, 1} and m[1]["q"]["depth"] == 1 and m[0]["q"]["depth"] == 0
    assert c.queue_metrics("q")[1]["depth"] == 1
    got = c.queue_update("q", paused=True)
    assert set(got) == {0, 1} and got[0]["paused"] and got[1]["paused"]
    for i in (0, 1):
        assert client(shard=i).queue_metrics("q")["paused"] is True
    with pytest.raises(ShardError) as ei:
        c.queue_update("nope", paused=True)
    assert ei.value.code == "NOT_FOUND" and ei.value.shard.startswith("0 at tcp://")
    assert "took it already" not in str(ei.value)


def test_a_pinned_client_talks_to_one_shard_and_a_bad_index_is_refused(pair):
    cfg, _shards, client = pair
    p1 = client(shard=1)
    assert not p1.routed and p1.endpoint == cfg.transport.endpoints[1]
    assert p1.endpoints == (cfg.transport.endpoints[1],)
    assert p1.ping()["version"] == 1                   # one answer, not a map per shard
    assert set(p1.queue_metrics()) == {"q"}
    with pytest.raises(ValueError, match=r"shard 2: .* has 2 endpoint\(s\)"):
        Client(cfg, shard=2)


def test_a_silent_shard_is_named(tmp_path):
    cfg = two_shard_config(tmp_path)
    shard = Shard(cfg, 0, store=MemoryStore()).start()   # shard 1 never starts
    try:
        with Client(cfg, timeout=0.5) as c:
            assert c.enqueue(spec(ON_0)) == f"{ON_0}/ml/prod/r1/a"
            with pytest.raises(ShardTimeout) as ei:
                c.status([f"{ON_0}/ml/prod/r1/a", f"{ON_1}/ml/prod/r1/a"])
            assert f"shard 1 at {cfg.transport.endpoints[1]}: STATUS" in str(ei.value)
            with pytest.raises(ShardTimeout) as ei:
                c.queue_update("q", paused=True)
            assert "shard 1 at" in str(ei.value) and "shard(s) 0 took it already" in \
                str(ei.value)
    finally:
        shard.stop()


# ------------------------------------------------------------------------------ the CLI


def test_the_cli_routes_by_tenant_and_updates_every_shard(tmp_path, capsys):
    import json

    from engine.cli import main

    cfg = two_shard_config(tmp_path)
    path = tmp_path / "leasehold.toml"
    path.write_text(f"""resources = ["cpu"]
[clusters.east]
capacity = {{ cpu = 64 }}
[queues.q]
scheduling = "GREEDY_CAPACITY"
[engine]
default_queue = "q"
[storage]
path = "{tmp_path / 'data'}"
partitions = 2
[transport]
endpoints = {json.dumps(list(cfg.transport.endpoints))}
[status]
metrics = false
[security]
insecure = true
""")
    shards = [Shard(path, i, store=MemoryStore()).start() for i in (0, 1)]
    try:
        specs = tmp_path / "mixed.jsonl"
        items = [spec(ON_1, "x"), spec(ON_0, "y"), spec(ON_1, "z")]
        mixed = [x["id"] for x in items]
        specs.write_text("".join(json.dumps(x) + "\n" for x in items))
        capsys.readouterr()
        assert main(["submit", str(specs), "--config", str(path), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["ids"] == mixed
        with Client(path, shard=1, timeout=5.0) as p1:
            assert len(p1.status([mixed[0], mixed[2]])) == 2
        assert main(["status", mixed[1], mixed[0], "--config", str(path), "--json"]) == 0
        assert list(json.loads(capsys.readouterr().out)) == [mixed[1], mixed[0]]
        # Pinned to the wrong shard: one line naming the owner, exit 2.
        assert main(["explain", mixed[0], "--config", str(path), "--shard", "0"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("leasehold: WRONG_SHARD: "), err
        assert "owned by shard 1 of 2" in err[0] and "(shard 0 at tcp://" in err[0], err
        # A queue update goes to every shard: a table each.
        assert main(["queue", "update", "q", "--paused", "true", "--config", str(path)]) == 0
        out = capsys.readouterr().out
        assert "queue q on shard 0: updated (paused)" in out
        assert "queue q on shard 1: updated (paused)" in out
        for i in (0, 1):
            with Client(path, shard=i, timeout=5.0) as pinned:
                assert pinned.queue_metrics("q")["paused"] is True
        assert main(["queue", "drain", "q", "--config", str(path)]) == 0
        out = capsys.readouterr().out
        assert "3 queued, 0 in flight (shard 0: 1 queued" in out, out
        assert "shard 1: 2 queued, 0 in flight)" in out, out
    finally:
        for s in shards:
            s.stop()
