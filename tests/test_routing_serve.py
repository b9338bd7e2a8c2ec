"""Routing over real processes: `leasehold serve` of a 2-endpoint config (two shard
processes on stores of their own) and a worker dialling both. One Client of the config puts
each tenant on the shard that owns it, a pinned client sending a foreign tenant is refused
and nothing is stored, one wait follows runs on both shards at once, and the CLI routes
submit/status/watch without --shard and acts on every shard for the queue commands. Temporary
directories and ephemeral ports; every wait is bounded; every process is killed in teardown
(the Rig of tests/test_serve.py)."""

import json

import pytest

from engine import Phase
from tests.conftest import until
from tests.test_serve import Rig
from transport import Client, ShardError, tenant_shard

# acme is owned by shard 1 of 2, globex by shard 0 (asserted: a changed hash fails here).
ACME, GLOBEX = "acme/ml/prod/r1", "globex/ml/prod/r1"


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path)
    yield r
    r.close()


def sim(aid, duration=0.3):
    return {"id": aid, "task": "t", "resources": {"cpu": "10m"},
            "execute": {"plugin": "sim", "duration": duration}}


def one_error_line(done, code):
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"leasehold: {code}: "), done.stderr
    assert "Traceback" not in done.stderr
    return lines[0]


def test_two_shards_each_own_their_tenants_and_the_client_and_cli_route(rig):
    assert tenant_shard("acme", 2) == 1 and tenant_shard("globex", 2) == 0
    cfg = rig.config(shards=2)
    rig.serve(cfg)
    worker = rig.spawn("worker", "worker", "--config", str(cfg), "--cluster", "east",
                       "--name", "east-1", "--slots", "100")
    until(lambda: rig.log(worker).count("registered with shard") >= 2, 30,
          "the worker to register with both shards")
    clients = []

    def client(**kw):
        c = Client(cfg, key=kw.pop("key", "both-app"), timeout=10.0, **kw)
        clients.append(c)
        return c
    try:
        c, on0, on1 = client(), client(shard=0), client(shard=1)
        a, g = f"{ACME}/a", f"{GLOBEX}/g"
        assert c.enqueue(sim(a, 1.0)) == a
        assert c.enqueue(sim(g, 1.0)) == g
        # One wait over runs on both shards (events from both connections).
        assert c.wait([a, g], timeout=30) == {a: Phase.SUCCEEDED, g: Phase.SUCCEEDED}
        # Each landed on its owner; the other shard refuses to answer for it.
        assert on1.status(a) == Phase.SUCCEEDED and on0.status(g) == Phase.SUCCEEDED
        for pinned, foreign, owner in ((on0, a, 1), (on1, g, 0)):
            with pytest.raises(ShardError) as ei:
                pinned.status([foreign])
            assert ei.value.code == "WRONG_SHARD"
            assert f"owned by shard {owner} of 2" in ei.value.error_message
        # A pinned client sending a foreign tenant's enqueue: refused, stored nowhere.
        stray = f"{ACME}/stray"
        with pytest.raises(ShardError) as ei:
            on0.enqueue(sim(stray))
        assert ei.value.code == "WRONG_SHARD" and "tenant 'acme'" in str(ei.value)
        with pytest.raises(ShardError) as ei:
            on1.status([stray])
        assert ei.value.code == "NOT_FOUND"

        # The CLI: submit and status route without --shard.
        base = ("--config", str(cfg), "--key", "both-app")
        done = rig.run("submit", *base, "--id", f"{GLOBEX}/cli", "--cpu", "10m", "--plugin",
                       "sim", "--duration", "0.2", "--wait", "--timeout", "30", "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["phases"] == {f"{GLOBEX}/cli": "SUCCEEDED"}
        specs = rig.tmp / "mixed.jsonl"
        mixed = [f"{ACME}/f1", f"{GLOBEX}/f2", f"{ACME}/f3"]
        specs.write_text("".join(json.dumps(sim(x, 0.1)) + "\n" for x in mixed))
        done = rig.run("submit", str(specs), *base, "--wait", "--timeout", "30", "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["ids"] == mixed          # the file's order
        assert on1.status([f"{ACME}/f1", f"{ACME}/f3"]) == [Phase.SUCCEEDED] * 2
        assert on0.status(f"{GLOBEX}/f2") == Phase.SUCCEEDED
        done = rig.run("status", *base, a, f"{GLOBEX}/cli", "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {a: "SUCCEEDED", f"{GLOBEX}/cli": "SUCCEEDED"}
        done = rig.run("watch", *base, ACME, "a", "--timeout", "20", "--json")
        assert done.returncode == 0, done.stderr
        assert f"watching {ACME} on tcp://127.0.0.1:{rig.ports[1]} " in done.stderr
        done = rig.run("status", *base, "--shard", "0", a)
        line = one_error_line(done, "WRONG_SHARD")
        assert done.returncode == 2 and "owned by shard 1 of 2" in line, line

        # Queue commands reach every shard.
        admin = ("--config", str(cfg), "--key", "ops")
        done = rig.run("queue", "update", "q", "--paused", "true", *admin, "--json")
        assert done.returncode == 0, done.stderr
        got = json.loads(done.stdout)
        assert set(got["shards"]) == {"0", "1"}
        assert all(q["paused"] for q in got["shards"].values())
        for pinned in (on0, on1):
            assert pinned.queue_metrics("q")["paused"] is True
        done = rig.run("queue", "list", *admin, "--remote", "--json")
        assert done.returncode == 0, done.stderr
        rows = json.loads(done.stdout)["queues"]
        assert sorted((r["shard"], r["name"], r["paused"]) for r in rows) == [
            (0, "q", True), (1, "q", True)]
        # The status files: no key (queue list refuses one without --remote).
        done = rig.run("queue", "list", "--config", str(cfg), "--json")
        assert done.returncode == 0, done.stderr
        assert sorted(r["shard"] for r in json.loads(done.stdout)["queues"]) == [0, 1]
        done = rig.run("queue", "update", "q", "--paused", "false", *admin, "--shard", "1")
        assert done.returncode == 0, done.stderr
        assert on1.queue_metrics("q")["paused"] is False
        assert on0.queue_metrics("q")["paused"] is True       # --shard pinned it
        done = rig.run("queue", "drain", "q", *admin, "--wait", "--timeout", "20", "--json")
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout)
        assert out["empty"] and set(out["shards"]) == {"0", "1"}
        assert on0.queue_metrics("q")["draining"] and on1.queue_metrics("q")["draining"]
    finally:
        for cl in clients:
            cl.close()
