"""The user CLI (docs/cli.md) as a user runs it: ``python -m engine.cli ...`` subprocesses
against a real shard (``transport.Shard`` on a thread, tcp on loopback, its engine on a
manual clock that starts at the wall clock, so runtimes and ETAs are what the test says),
with a worker the test drives (``WorkerConnection``): submit, status, explain (a gang held
under STRICT_FIFO: its reason and ETA, and the head-of-line reason of what waits behind it),
abort, live queue updates (applied on the next tick, nothing in flight stopped), pause,
drain, top and queue list from the status file (without messaging the shard), watch over
the push stream, config check (the effective config, and a message naming every kind of bad
value), CURVE keys and roles, and errors as one line. Every wait is bounded; every process,
socket and thread is closed at the end."""

import json
import os
import queue
import subprocess
import sys
import textwrap
import threading
import time
import tomllib
from pathlib import Path

import pytest

from engine import ManualClock, Phase, load_config, parse_config
from engine._config_view import effective_config
from tests.conftest import free_port as _free_port
from transport import Client, Shard, WorkerConnection, generate_keypair, load_client_keys

ROOT = Path(__file__).resolve().parent.parent
RUN = "acme/p/d"


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200",
            "LEASEHOLD_TRACEBACK": ""}


def cli(*args, timeout=60, cwd=None):
    """Run the CLI to completion; a CompletedProcess with text output."""
    return subprocess.run([sys.executable, "-m", "engine.cli", *map(str, args)], env=_env(),
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


def one_error_line(proc, code):
    """The process failed with exactly one line ``leasehold: CODE: ...`` on stderr."""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"leasehold: {code}: "), proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


CONFIG = """\
resources = ["cpu", "memory"]
[clusters.east]
capacity = {{ cpu = 8, memory = "64Gi" }}
[queues.q]
scheduling = "STRICT_FIFO"
[queues.other]
scheduling = "GREEDY_CAPACITY"
priority = "MIN"
[engine]
default_queue = "q"
heartbeat_interval = 30.0
[storage]
path = "{tmp}/data"
partitions = 2
sync = false
[transport]
endpoints = ["tcp://127.0.0.1:{port}"]
[status]
dir = "{tmp}/run"
interval = 0.0
{security}
"""

SECURE = """\
[security]
keys_dir = "{tmp}/keys"
[security.peers.east-1]
role = "worker"
cluster = "east"
[security.peers.acme-app]
role = "client"
tenants = ["acme"]
[security.peers.ops]
role = "admin"
"""


class Env:
    """A shard on a thread (engine on a manual clock), a test-driven worker, CLI processes;
    all stopped at the end."""

    def __init__(self, tmp_path, secure=False):
        self.tmp = tmp_path
        self.keys = None
        if secure:
            self.keys = tmp_path / "keys"
            for name in ("shard", "east-1", "acme-app", "ops"):
                generate_keypair(self.keys, name)
        self.port = _free_port()
        security = SECURE.format(tmp=tmp_path) if secure else "[security]\ninsecure = true"
        self.config = tmp_path / "leasehold.toml"
        self.config.write_text(CONFIG.format(tmp=tmp_path, port=self.port, security=security))
        self.clock = ManualClock(time.time_ns())
        self.procs = []
        self.closing = []
        self.shard = Shard(load_config(self.config), clock=self.clock).start()
        self.endpoint = self.shard.endpoint
        self.worker = self._closing(WorkerConnection(
            self.endpoint, self._keys("east-1"), "east-1", "east", 100, timeout=10.0))
        self.worker.connect()
        self.client = self._closing(Client(endpoint=self.endpoint,
                                           keys=self._keys("acme-app"), timeout=10.0))

    def _keys(self, name):
        return None if self.keys is None else load_client_keys(self.keys, name, "shard")

    def _closing(self, x):
        self.closing.append(x)
        return x

    def cli(self, *args, key=None, timeout=60):
        extra = ["--config", self.config] + (["--key", key] if key else [])
        return cli(*args, *extra, timeout=timeout)

    def popen(self, *args, key=None):
        extra = ["--config", str(self.config)] + (["--key", key] if key else [])
        p = subprocess.Popen([sys.executable, "-m", "engine.cli", *map(str, args), *extra],
                             env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        self.procs.append(p)
        return p

    def leases(self, n, timeout=10.0):
        got = self.worker.leases(timeout=timeout, want=n)
        assert len(got) == n, f"{len(got)} of {n} leases within {timeout}s"
        return got

    def report(self, leases, phase, details=None):
        assert self.worker.report([x.token for x in leases], phase, details) == []

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=10)
        for x in reversed(self.closing):
            x.close()
        self.shard.stop()


@pytest.fixture
def env(tmp_path):
    e = Env(tmp_path)
    yield e
    e.close()


def _line(stream, timeout=30.0):
    """The next line of a process pipe, within ``timeout`` seconds."""
    q = queue.Queue()
    threading.Thread(target=lambda: q.put(stream.readline()), daemon=True).start()
    try:
        return q.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(f"no line within {timeout}s") from None


def _json_of(proc):
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


# ------------------------------------------------------------------------------ submit etc.

def test_submit_status_explain_show_a_held_gang_its_reason_and_eta(env, tmp_path):
    # History: a "short" action ran 60 s (the engine's clock), so the next one's end is
    # predictable, and so is the start of the gang that waits for it.
    out = env.cli("submit", "--id", f"{RUN}/h/short", "--task", "short", "--cpu", "6")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"{RUN}/h/short"]
    (h,) = env.leases(1)
    env.report([h], Phase.RUNNING)
    env.clock.advance(60)
    env.report([h], Phase.SUCCEEDED)
    # A JSON list of specs, then a TOML file with the gang and a small action behind it.
    specs = tmp_path / "short.json"
    specs.write_text(json.dumps([{"id": f"{RUN}/r1/short", "task": "short",
                                  "resources": {"cpu": 6}}]))
    out = env.cli("submit", specs, "--json")
    assert _json_of(out) == {"ids": [f"{RUN}/r1/short"]}
    (r1,) = env.leases(1)
    env.report([r1], Phase.RUNNING)
    gang = tmp_path / "gang.toml"
    gang.write_text(textwrap.dedent(f"""\
        [[actions]]
        id = "{RUN}/r2/gang"
        task = "train"
        pods = [{{ role = "worker", replicas = 4, resources = {{ cpu = 2 }} }}]

        [[actions]]
        id = "{RUN}/r3/after"
        task = "etl"
        resources = {{ cpu = 1 }}
        """))
    out = env.cli("submit", gang)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"{RUN}/r2/gang", f"{RUN}/r3/after"]

    e = _json_of(env.cli("explain", f"{RUN}/r2/gang", "--json"))
    assert e["phase"] == "WAITING_FOR_RESOURCES" and e["wait"] == "CLUSTER_CAPACITY"
    assert "waiting for capacity (needs cpu=8; cluster east has 2 free)" in e["reason"]
    assert "estimated start in" in e["reason"]
    assert e["eta_ns"] is not None and e["eta_s"] > 0 and e["position"] == 1
    # The projection (every queued action) over the wire: the head's is its shadow time.
    assert e["projected_start_ns"] == e["eta_ns"] and e["projected_why"] == ""
    human = env.cli("explain", f"{RUN}/r2/gang")
    assert human.returncode == 0, human.stderr
    assert "CLUSTER_CAPACITY" in human.stdout and "eta" in human.stdout
    assert "(at " in human.stdout       # the ETA as a time of day
    assert "projected start" in human.stdout
    behind = _json_of(env.cli("explain", f"{RUN}/r3/after", "--json"))
    assert behind["wait"] == "HEAD_OF_LINE"
    assert "head-of-line blocked by r2/train" in behind["reason"]
    assert behind["position"] == 2

    st = _json_of(env.cli("status", f"{RUN}/h/short", f"{RUN}/r1/short", f"{RUN}/r2/gang",
                          "--json"))
    assert st == {f"{RUN}/h/short": "SUCCEEDED", f"{RUN}/r1/short": "RUNNING",
                  f"{RUN}/r2/gang": "WAITING_FOR_RESOURCES"}
    table = env.cli("status", f"{RUN}/r1/short")
    assert table.returncode == 0 and "RUNNING" in table.stdout
    missing = env.cli("status", f"{RUN}/nope/x")
    assert missing.returncode == 1
    one_error_line(missing, "NOT_FOUND")
    missing = env.cli("explain", f"{RUN}/nope/x")
    assert missing.returncode == 1


def test_submit_a_fanout_and_wait_for_the_outcomes(env, tmp_path):
    fan = tmp_path / "fan.json"
    fan.write_text(json.dumps({"template": {"id": f"{RUN}/f/x", "task": "map",
                                            "resources": {"cpu": "500m"}},
                               "names": ["m0", "m1", "m2"], "inputs": ["a", "b", "c"]}))
    p = env.popen("submit", fan, "--wait", "--timeout", "30", "--json")
    leases = env.leases(3)
    assert sorted(x.input_ref for x in leases) == ["a", "b", "c"]
    env.report(leases, Phase.RUNNING)
    env.report(leases[:2], Phase.SUCCEEDED)
    env.report(leases[2:], Phase.FAILED, {0: {"error_kind": "USER", "message": "bad row"}})
    out, err = p.communicate(timeout=30)
    assert p.returncode == 1, err       # one ended FAILED
    got = json.loads(out)
    assert got["ids"] == [f"{RUN}/f/m0", f"{RUN}/f/m1", f"{RUN}/f/m2"]
    assert sorted(got["phases"].values()) == ["FAILED", "SUCCEEDED", "SUCCEEDED"]
    # Flags, a sim execute, a wait that runs out of time.
    out = env.cli("submit", "--id", f"{RUN}/s/one", "--cpu", "1", "--memory", "1Gi",
                  "--plugin", "sim", "--duration", "5", "--runtime-estimate", "5",
                  "--wait", "--timeout", "0.5")
    assert out.returncode == 1
    assert out.stdout.strip() == ""
    one_error_line(out, "DEADLINE_EXCEEDED")
    (lease,) = env.leases(1)
    assert lease.spec["execute"] == {"plugin": "sim", "duration": 5.0}
    assert lease.spec["resources"] == {"cpu": 1, "memory": "1Gi"}
    assert lease.spec["runtime_estimate"] == 5.0     # over the wire to the worker too


def test_submit_refuses_bad_input_naming_it(env, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"id": f"{RUN}/b/a", "task": "t", "resources": {"cpu": 1}},
                               {"id": f"{RUN}/b/b", "task": "t", "resourcez": {}}]))
    out = env.cli("submit", bad)
    assert out.returncode == 2
    assert "bad.json: item 1: action spec: unknown key(s) resourcez" in \
        one_error_line(out, "INVALID_ARGUMENT")
    out = env.cli("submit", bad, "--cpu", "1")
    assert "give FILE or flags, not both" in one_error_line(out, "INVALID_ARGUMENT")
    out = env.cli("submit", "--id", f"{RUN}/b/c")
    assert "resources" in one_error_line(out, "INVALID_ARGUMENT")
    out = env.cli("submit", "--id", f"{RUN}/b/c", "--cpu", "1", "--duration", "3")
    assert "--duration is for --plugin sim" in one_error_line(out, "INVALID_ARGUMENT")
    out = env.cli("submit", "--id", f"{RUN}/b/c", "--cpu", "1", "--max-runtime", "5",
                  "--runtime-estimate", "9")
    assert "runtime_estimate 9s exceeds timeouts.max_runtime 5s" in one_error_line(
        out, "INVALID_ARGUMENT")
    out = env.cli("submit", "--id", f"{RUN}/b/c", "--cpu", "1", "--queue", "nope")
    assert out.returncode == 2
    assert "run_queue 'nope' does not exist" in one_error_line(out, "INVALID_ARGUMENT")
    # An empty --task was the action's name, silently (an empty --image was refused).
    out = env.cli("submit", "--id", f"{RUN}/b/c", "--cpu", "1", "--task", "")
    assert "task" in one_error_line(out, "INVALID_ARGUMENT")
    text = tmp_path / "specs.txt"
    text.write_text("{}")
    assert ".json, .jsonl or .toml" in one_error_line(env.cli("submit", text),
                                                      "INVALID_ARGUMENT")


def test_abort_ends_an_action_and_its_worker_is_told(env):
    assert env.cli("submit", "--id", f"{RUN}/a/x", "--cpu", "1").returncode == 0
    (lease,) = env.leases(1)
    env.report([lease], Phase.RUNNING)
    out = _json_of(env.cli("abort", f"{RUN}/a/x", "--reason", "no longer needed", "--json"))
    assert out["ended"] == [f"{RUN}/a/x"]
    assert _json_of(env.cli("status", f"{RUN}/a/x", "--json")) == {f"{RUN}/a/x": "ABORTED"}
    assert env.worker.heartbeat([lease.token])[0][1].name == "ABORTED"
    gone = env.cli("abort", f"{RUN}/a/none")
    assert gone.returncode == 1
    one_error_line(gone, "NOT_FOUND")


# ------------------------------------------------------------------------------ queues

def test_a_live_queue_update_applies_on_the_next_tick_and_kills_nothing(env):
    out = env.cli("queue", "update", "q", "--action-concurrency", "1", "--json")
    assert _json_of(out)["action_concurrency"] == 1
    # An empty item was dropped silently ("c," is not "c").
    assert "--clusters 'east,': an empty cluster name" in one_error_line(
        env.cli("queue", "update", "q", "--clusters", "east,"), "INVALID_ARGUMENT")
    env.cli("submit", "--id", f"{RUN}/u/a", "--cpu", "1")
    (a,) = env.leases(1)
    env.report([a], Phase.RUNNING)
    assert env.cli("submit", "--id", f"{RUN}/u/b", "--cpu", "1").returncode == 0
    assert env.worker.leases(timeout=0.5) == []         # held by action_concurrency = 1
    held = _json_of(env.cli("explain", f"{RUN}/u/b", "--json"))
    assert held["wait"] == "QUEUE_ACTIONS" and "action_concurrency 1 reached" in held["reason"]
    out = env.cli("queue", "update", "q", "--action-concurrency", "2")
    assert out.returncode == 0, out.stderr
    assert "action_concurrency" in out.stdout and "the next tick uses it" in out.stdout
    (b,) = env.leases(1)                                 # admitted on the next tick
    assert b.action == f"{RUN}/u/b"
    assert env.client.status(f"{RUN}/u/a") == Phase.RUNNING     # nothing in flight stopped
    assert env.worker.heartbeat([a.token, b.token]) == []

    # Paused: the tick places nothing from the queue; what runs keeps running.
    assert env.cli("queue", "update", "q", "--paused", "true").returncode == 0
    assert env.cli("submit", "--id", f"{RUN}/u/c", "--cpu", "1").returncode == 0
    assert env.worker.leases(timeout=0.5) == []
    paused = _json_of(env.cli("explain", f"{RUN}/u/c", "--json"))
    assert paused["wait"] == "QUEUE_PAUSED" and "paused" in paused["reason"]
    assert env.client.status([f"{RUN}/u/a", f"{RUN}/u/b"]) == [Phase.RUNNING,
                                                               Phase.INITIALIZING]
    listed = _json_of(env.cli("queue", "list", "--json"))["queues"]
    q = next(x for x in listed if x["name"] == "q")
    assert q["paused"] is True and q["action_concurrency"] == 2 and q["depth"] == 1
    out = env.cli("queue", "update", "q", "--paused", "false", "--action-concurrency", "0")
    assert out.returncode == 0, out.stderr
    (c,) = env.leases(1)
    assert c.action == f"{RUN}/u/c"

    # Bad changes name what is wrong; an unknown queue is not found.
    bad = env.cli("queue", "update", "q", "--depth", "0")
    assert bad.returncode == 2
    assert "queues.q.depth" in one_error_line(bad, "INVALID_CONFIG")
    bad = env.cli("queue", "update", "q", "--max-resources", "gpu=1")
    assert "queues.q.max_resources.gpu" in one_error_line(bad, "INVALID_CONFIG")
    gone = env.cli("queue", "update", "nope", "--priority", "MAX")
    assert gone.returncode == 1
    one_error_line(gone, "NOT_FOUND")
    none = env.cli("queue", "update", "q")
    assert none.returncode == 2
    assert "at least one change" in one_error_line(none, "INVALID_ARGUMENT")


def test_queue_drain_stops_admission_and_reports_when_empty(env):
    env.cli("submit", "--id", f"{RUN}/d/a", "--cpu", "1")
    (a,) = env.leases(1)
    env.report([a], Phase.RUNNING)
    p = env.popen("queue", "drain", "q", "--wait", "--timeout", "60")
    first = _line(p.stdout)
    assert first.startswith("queue q: draining (new actions refused): 0 queued, 1 in flight")
    refused = env.cli("submit", "--id", f"{RUN}/d/new", "--cpu", "1")
    assert refused.returncode == 2
    assert "queue q: draining" in one_error_line(refused, "RESOURCE_EXHAUSTED")
    ok = env.cli("submit", "--id", f"{RUN}/d/other", "--cpu", "1", "--queue", "other")
    assert ok.returncode == 0, ok.stderr               # other queues still take work
    (o,) = env.leases(1)
    assert p.poll() is None                             # a is still in flight
    env.report([a], Phase.SUCCEEDED)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    assert out.strip().endswith("queue q: empty (nothing queued or in flight)")
    listed = {x["name"]: x for x in _json_of(env.cli("queue", "list", "--json"))["queues"]}
    assert listed["q"]["draining"] is True and listed["other"]["draining"] is False
    remote = {x["name"]: x for x in
              _json_of(env.cli("queue", "list", "--remote", "--json"))["queues"]}
    assert remote["q"]["draining"] is True and remote["other"]["actions_in_flight"] == 1
    again = _json_of(env.cli("queue", "drain", "q", "--json"))
    assert again == {"queue": "q", "draining": True, "empty": True, "depth": 0,
                     "actions_in_flight": 0}
    assert env.cli("queue", "update", "q", "--draining", "false").returncode == 0
    assert env.cli("submit", "--id", f"{RUN}/d/new", "--cpu", "1").returncode == 0


# ------------------------------------------------------------------------------ top, watch

def test_top_reads_the_status_file_without_messaging_the_shard(env):
    env.cli("submit", "--id", f"{RUN}/t/big", "--task", "big", "--cpu", "6")
    (big,) = env.leases(1)
    env.report([big], Phase.RUNNING)
    env.cli("submit", "--id", f"{RUN}/t/gang", "--task", "gang", "--cpu", "4")
    time.sleep(0.2)       # the publish after the turn that blocked it
    before = env.shard.counters["received"]
    snap = _json_of(env.cli("top", "--json"))
    once = env.cli("top", "--once")
    assert env.shard.counters["received"] == before      # read from shared memory only
    assert snap["errors"] == []
    (s,) = snap["shards"]
    assert s["state"] == "running" and s["alive"] is True
    q = s["queues"]["q"]
    assert q["depth"] == 1 and q["actions_in_flight"] == 1
    assert q["in_flight_resources"]["cpu"] == 6000
    assert q["head_blocked"]["code"] == "CLUSTER_CAPACITY"
    assert q["head_blocked"]["action"] == f"{RUN}/t/gang"
    east = s["clusters"]["east"]
    assert east["workers_connected"] == 1 and east["free"]["cpu"] == 2000
    assert set(s["tick_latency_quantiles"]) == {"p50", "p90", "p99"}
    assert once.returncode == 0, once.stderr
    for text in ("shard 0 running", "tick #", "queues", "clusters", "CLUSTER_CAPACITY",
                 "east", "cpu=6"):
        assert text in once.stdout, once.stdout
    # A shard index the config does not have; a status file that is not there.
    bad = env.cli("top", "--once", "--shard", "3")
    assert bad.returncode == 2
    one_error_line(bad, "INVALID_ARGUMENT")
    other = env.tmp / "other.toml"
    other.write_text(env.config.read_text().replace(f'dir = "{env.tmp}/run"',
                                                    f'dir = "{env.tmp}/nowhere"'))
    missing = cli("top", "--once", "--config", other)
    assert missing.returncode == 2
    assert "nowhere/shard-0.status" in one_error_line(missing, "UNAVAILABLE")


def test_watch_prints_events_until_the_run_ends(env):
    run = f"{RUN}/w"
    p = env.popen("watch", run, "--json", "--timeout", "60")
    assert _line(p.stderr).startswith(f"watching {run} on ")
    bars = env.popen("watch", run, "--timeout", "60")
    assert _line(bars.stderr).startswith(f"watching {run} on ")
    assert env.cli("submit", "--id", f"{run}/a", "--cpu", "1").returncode == 0
    assert env.cli("submit", "--id", f"{run}/b", "--cpu", "1").returncode == 0
    a, b = sorted(env.leases(2), key=lambda x: x.action)
    env.report([a, b], Phase.RUNNING)
    env.report([a], Phase.SUCCEEDED)
    assert p.poll() is None                     # b has not ended
    env.report([b], Phase.FAILED, {0: {"error_kind": "USER", "message": "boom"}})
    out, err = p.communicate(timeout=30)
    assert p.returncode == 1, err               # one action ended FAILED
    events = [json.loads(line) for line in out.splitlines()]
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    by = {}
    for e in events:
        by.setdefault(e["action"], []).append(e["phase"])
    assert by[f"{run}/a"] == ["QUEUED", "INITIALIZING", "RUNNING", "SUCCEEDED"]
    assert by[f"{run}/b"][-1] == "FAILED"
    failed = next(e for e in events if e["phase"] == "FAILED")
    assert "boom" in (failed["detail"] or "")
    out, err = bars.communicate(timeout=30)
    assert bars.returncode == 1, err
    assert "FAILED" in out and f"run {run}: 2 action(s) ended (1 SUCCEEDED, 1 FAILED)" in out
    # Given the ids, a watch of an ended run reads their phases and ends at once.
    done = env.cli("watch", run, "a", "--timeout", "30")
    assert done.returncode == 0, done.stderr
    assert "1 action(s) ended (1 SUCCEEDED)" in done.stdout
    late = env.cli("watch", f"{RUN}/idle", "--json", "--timeout", "0.5")
    assert late.returncode == 1 and late.stdout == ""
    watching, error = late.stderr.strip().splitlines()
    assert watching.startswith(f"watching {RUN}/idle on ")
    assert error.startswith("leasehold: DEADLINE_EXCEEDED: watch acme/p/d/idle: 0 of 0 action")


# ------------------------------------------------------------------------------ keys, errors

def test_keys_and_roles(tmp_path):
    e = Env(tmp_path, secure=True)
    try:
        nokey = e.cli("status", f"{RUN}/k/a")
        assert nokey.returncode == 2
        assert "--key NAME is needed" in one_error_line(nokey, "INVALID_ARGUMENT")
        out = e.cli("submit", "--id", f"{RUN}/k/a", "--cpu", "1", key="acme-app")
        assert out.returncode == 0, out.stderr
        denied = e.cli("queue", "update", "q", "--priority", "MAX", key="acme-app")
        assert denied.returncode == 2
        one_error_line(denied, "PERMISSION_DENIED")
        other = e.cli("status", "globex/p/d/k/a", key="acme-app")
        assert other.returncode == 2
        one_error_line(other, "PERMISSION_DENIED")
        ok = e.cli("queue", "update", "q", "--priority", "MAX", "--json", key="ops")
        assert _json_of(ok)["priority"] == 1000
        nofile = e.cli("status", f"{RUN}/k/a", key="nobody")
        assert "nobody.key_secret" in one_error_line(nofile, "INVALID_CONFIG")
    finally:
        e.close()


def test_a_worker_started_with_another_roles_key_says_the_code_once(tmp_path):
    # It said "PERMISSION_DENIED: worker acme-app: shard ...: REGISTER: PERMISSION_DENIED:
    # REGISTER: key ...": the code (and the request) twice.
    e = Env(tmp_path, secure=True)
    try:
        out = cli("worker", "--config", e.config, "--cluster", "east", "--name", "acme-app")
        assert out.returncode == 2
        assert one_error_line(out, "PERMISSION_DENIED") == (
            f"leasehold: PERMISSION_DENIED: worker acme-app: REGISTER: key 'acme-app' is a "
            f"client key; only worker keys may send it (shard {e.endpoint})")
    finally:
        e.close()


def test_an_unreachable_shard_is_one_line_and_exit_2(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.format(tmp=tmp_path, port=_free_port(),
                                 security="[security]\ninsecure = true"))
    out = cli("status", f"{RUN}/x/a", "--config", cfg, "--request-timeout", "0.5")
    assert out.returncode == 2
    assert "within 0.5s" in one_error_line(out, "UNAVAILABLE")


def test_a_spec_file_that_is_not_utf8_is_one_line_naming_it(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.format(tmp=tmp_path, port=_free_port(),
                                 security="[security]\ninsecure = true"))
    specs = tmp_path / "specs.jsonl"
    specs.write_bytes(b'{"id": "a/b/c/d/e"}\n\xff\n')
    out = cli("submit", specs, "--config", cfg, "--request-timeout", "0.5")
    assert out.returncode == 2
    assert one_error_line(out, "INVALID_ARGUMENT") == (
        f"leasehold: INVALID_ARGUMENT: {specs}: not UTF-8 text (invalid start byte at "
        f"byte 20)")


def test_a_spec_file_nested_too_deeply_is_one_line_naming_it(tmp_path):
    # json's RecursionError reached the CLI as INTERNAL (a bug).
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.format(tmp=tmp_path, port=_free_port(),
                                 security="[security]\ninsecure = true"))
    specs = tmp_path / "specs.json"
    specs.write_text("[" * 100_000)
    out = cli("submit", specs, "--config", cfg, "--request-timeout", "0.5")
    assert out.returncode == 2
    assert one_error_line(out, "INVALID_ARGUMENT") == (
        f"leasehold: INVALID_ARGUMENT: {specs}: invalid JSON: nested too deeply")


def test_an_idle_workers_heartbeat_refreshes_the_free_capacity_it_reports(env):
    # A worker reported 2 cpu free while a 6-cpu action ran; once idle, its empty
    # heartbeats say 8 again, and the gang that needs all 8 is placed.
    env.cli("submit", "--id", f"{RUN}/i/big", "--cpu", "6")
    (big,) = env.leases(1)
    assert env.worker.heartbeat([big.token], free={"cpu": 2}) == []
    env.report([big], Phase.SUCCEEDED)
    env.cli("submit", "--id", f"{RUN}/i/gang", "--cpu", "2", "--replicas", "4")
    assert env.worker.leases(timeout=0.5) == []
    assert env.worker.heartbeat([], free={"cpu": 8, "memory": "64Gi"}) == []
    (gang,) = env.leases(1)
    assert gang.action == f"{RUN}/i/gang"


# ------------------------------------------------------------------------------ config check

MINIMAL = """\
resources = ["cpu", "memory"]
[clusters.east]
capacity = { cpu = 8, memory = "64Gi" }
"""


def test_config_check_prints_the_effective_config_with_every_default(tmp_path):
    f = tmp_path / "min.toml"
    f.write_text(MINIMAL)
    out = cli("config", "check", f)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for line in ("max_candidates = 4096", "heartbeat_interval = 10.0", 'map_size = "1Gi"',
                 'endpoints = ["tcp://127.0.0.1:7700"]', "retention = 604800.0",
                 "[queues.default]", 'scheduling = "STRICT_FIFO"', "depth = 10000",
                 "action_concurrency = 0   # unlimited", "paused = false", "draining = false",
                 "insecure = false", 'dir = "leasehold-data/run"', "[worker]",
                 "# capacity: not set: measured", "max_outstanding = 64",
                 "[tenant_defaults]", "run_concurrency = 0   # unlimited"):
        assert line in text, line
    # The text is a config file that means the same.
    again = parse_config(tomllib.loads(text), "<printed>")
    assert effective_config(again) == effective_config(load_config(f))
    js = _json_of(cli("config", "check", f, "--json"))
    assert js["ok"] is True
    assert set(js["config"]) == {"resources", "engine", "storage", "transport", "security",
                                 "worker", "status", "supervisor", "clusters", "queues",
                                 "tenants", "tenant_defaults"}
    assert js["config"]["tenant_defaults"] == {"run_concurrency": 0, "action_concurrency": 0}
    assert js["config"]["tenants"] == {}
    assert js["config"]["queues"]["default"]["max_resources"] == {}
    assert js["config"]["engine"]["system_retries"] == 3
    # The example config round-trips too (node shapes, budgets, several clusters).
    example = ROOT / "engine" / "examples" / "leasehold.toml"
    out = cli("config", "check", example)
    assert out.returncode == 0, out.stderr
    assert effective_config(parse_config(tomllib.loads(out.stdout))) == \
        effective_config(load_config(example))


@pytest.mark.parametrize("extra, names", [
    ('[engine]\nmax_candidates = "many"', ["engine.max_candidates", "'many'", "integer"]),
    ("[queues.q]\npriority = 5000", ["queues.q.priority", "5000", "0..1000"]),
    ("[engine]\nbogus = 1", ["engine.bogus", "unknown key 'bogus'"]),
    ("[clusters.west]\ncapacity = { cpu = 8, gpu_x = 1 }",
     ["clusters.west.capacity.gpu_x", "unknown resource 'gpu_x'"]),
    ('[storage]\nretention = "7 weeks"', ["storage.retention", "'7 weeks'", '"7d"']),
    ('[transport]\nendpoints = ["http://x:1"]',
     ["transport.endpoints", "http://x:1", "tcp://HOST:PORT"]),
    ('[clusters.west]\ncapacity = { cpu = "lots" }', ["clusters.west.capacity.cpu", "lots"]),
    ('[queues.q]\nclusters = ["mars"]', ["queues.q.clusters", "'mars'", "east"]),
    ("[status]\ninterval = -1", ["status.interval", "-1", ">= 0"]),
    ("[engine]\nheartbeat_interval = true", ["engine.heartbeat_interval", "True"]),
    ("[tenants.acme]\naction_concurrency = -1",
     ["tenants.acme.action_concurrency", "-1", "integer >= 0"]),
    ("[tenant_defaults]\nruns = 3", ["tenant_defaults.runs", "unknown key 'runs'"]),
])
def test_config_check_names_each_kind_of_bad_value(tmp_path, extra, names):
    f = tmp_path / "bad.toml"
    f.write_text(MINIMAL + extra + "\n")
    out = cli("config", "check", f)
    assert out.returncode == 2
    line = one_error_line(out, "INVALID_CONFIG")
    assert str(f) in line
    for n in names:
        assert n in line, (n, line)


def test_config_check_shows_each_tenants_effective_caps(tmp_path):
    f = tmp_path / "tenants.toml"
    f.write_text(MINIMAL + "[tenant_defaults]\nrun_concurrency = 4\n"
                 "[tenants.acme]\naction_concurrency = 100\n"
                 "[tenants.\"big.co\"]\nrun_concurrency = 0\n")
    out = cli("config", "check", f)
    assert out.returncode == 0, out.stderr
    # A key a tenant's table does not give is the default's, shown as such.
    assert "[tenants.acme]\nrun_concurrency = 4\naction_concurrency = 100\n" in out.stdout
    assert ('[tenants."big.co"]\nrun_concurrency = 0   # unlimited\n'
            "action_concurrency = 0   # unlimited\n") in out.stdout
    js = _json_of(cli("config", "check", f, "--json"))["config"]
    assert js["tenant_defaults"] == {"run_concurrency": 4, "action_concurrency": 0}
    assert js["tenants"] == {"acme": {"run_concurrency": 4, "action_concurrency": 100},
                             "big.co": {"run_concurrency": 0, "action_concurrency": 0}}
    assert effective_config(parse_config(tomllib.loads(out.stdout))) == \
        effective_config(load_config(f))


def test_config_check_of_a_missing_or_broken_file(tmp_path):
    out = cli("config", "check", tmp_path / "none.toml")
    assert "cannot read the config file" in one_error_line(out, "INVALID_CONFIG")
    broken = tmp_path / "broken.toml"
    broken.write_text("resources = [")
    assert "invalid TOML" in one_error_line(cli("config", "check", broken), "INVALID_CONFIG")
