"""The partition map (docs/operations.md, "Several shards"): the ownership rule and its
helpers as functions, and two in-process shards of one 2-endpoint config over real sockets on
loopback: each refuses, whole and with WRONG_SHARD naming the tenant and both shards, every
request about a tenant it does not own, and keeps nothing of it. Every wait is bounded;
every shard, client and store is closed in teardown."""

import pytest

from engine import Phase, parse_config
from storage import MemoryStore
from tests.conftest import free_port
from transport import (
    ERROR_CODES,
    Client,
    Enqueue,
    Shard,
    ShardError,
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
from transport._auth import INSECURE_PEER

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
