"""The supervisor (`leasehold serve`) and the devbox (`leasehold devbox`) as real processes on
loopback: a shard killed with SIGKILL is restarted and its in-flight work completes; a second
supervisor on the same data directory, a store held by a hand-started shard or open in another
process (and not a claim whose pid now runs something else), a taken port and
an invalid config are each refused with one line; SIGTERM stops everything cleanly (no
process left); two shards run on stores of their own; the metrics endpoint serves the
shards' status; the devbox runs its example workload end to end. Also the shard fix the
devbox needed: an idle worker's heartbeat of no tokens still reports its free capacity.
Ephemeral ports and temporary directories; every wait is bounded; every process is killed in
teardown."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from engine import LeaseholdError, Phase, load_config, parse_config
from storage import LmdbStore, MemoryStore
from tests.conftest import free_port, until
from transport import (
    Client,
    Shard,
    SimPlugin,
    StatusReader,
    Worker,
    generate_keypair,
    load_client_keys,
    shard_config,
    shard_store_path,
    status_path,
    tenant_shard,
)

ROOT = Path(__file__).resolve().parent.parent
RUN = "acme/ml/prod/r1"


def alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Rig:
    """Config files, keys and the processes of one test; everything is stopped at the end."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.keys = tmp / "keys"
        for name in ("shard", "east-1", "acme-app", "both-app", "ops"):
            generate_keypair(self.keys, name)
        self.procs = []
        self.seen = set()           # every pid started below us (for the teardown check)
        self.env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def config(self, name="leasehold.toml", shards=1, data="data", metrics=True,
               extra="", storage=""):
        ports = [free_port() for _ in range(shards)]
        eps = ", ".join(f'"tcp://127.0.0.1:{p}"' for p in ports)
        self.metrics_port = free_port()
        metrics_line = f'metrics = "127.0.0.1:{self.metrics_port}"' if metrics else \
            "metrics = false"
        path = self.tmp / name
        path.write_text(textwrap.dedent(f"""
            resources = ["cpu", "memory"]
            [clusters.east]
            capacity = {{ cpu = 100000, memory = "100Ti" }}
            [queues.q]
            scheduling = "GREEDY_CAPACITY"
            depth = 100000
            [engine]
            default_queue = "q"
            heartbeat_interval = 1.0
            expiry_missed_beats = 3
            expiry_jitter = 2.0
            [storage]
            path = "{self.tmp / data}"
            partitions = 2
            {storage}
            [transport]
            endpoints = [{eps}]
            [status]
            {metrics_line}
            [security]
            keys_dir = "{self.keys}"
            [security.peers.east-1]
            role = "worker"
            cluster = "east"
            [security.peers.acme-app]
            role = "client"
            tenants = ["acme"]
            [security.peers.both-app]
            role = "client"
            tenants = ["acme", "globex"]
            [security.peers.ops]
            role = "admin"
            [worker]
            capacity = {{ cpu = 100000, memory = "100Ti" }}
            work_dir = "{self.tmp / 'work'}"
            log_dir = "{self.tmp / 'logs'}"
            drain_timeout = 5
            kill_grace = 0.5
            """) + extra)
        self.ports = ports
        return path

    def spawn(self, label, *args):
        out = open(self.tmp / f"{label}.log", "wb")      # noqa: SIM115
        proc = subprocess.Popen([sys.executable, "-m", "engine.cli", *args], env=self.env,
                                cwd=self.tmp, stdout=out, stderr=subprocess.STDOUT)
        out.close()
        proc.label = label
        self.procs.append(proc)
        self.seen.add(proc.pid)
        return proc

    def log(self, proc):
        return (self.tmp / f"{proc.label}.log").read_text(errors="replace")

    def serve(self, config, label="serve"):
        proc = self.spawn(label, "serve", "--config", str(config))
        until(lambda: "serving 1 shard" in self.log(proc) or "serving 2 shard" in
              self.log(proc) or proc.poll() is not None, 60, "the supervisor to serve")
        assert proc.poll() is None, self.log(proc)
        self.note_children(proc)
        return proc

    def note_children(self, proc):
        try:
            self.seen.update(c.pid for c in psutil.Process(proc.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass

    def run(self, *args, timeout=60):
        return subprocess.run([sys.executable, "-m", "engine.cli", *args], env=self.env,
                              cwd=self.tmp, capture_output=True, text=True, timeout=timeout)

    def client(self, port):
        return Client(endpoint=f"tcp://127.0.0.1:{port}",
                      keys=load_client_keys(self.keys, "acme-app", "shard"), timeout=10.0)

    def close(self):
        for proc in self.procs:
            self.note_children(proc)
        # Workers first (they drain against a live shard), then the supervisors.
        order = sorted(self.procs, key=lambda p: p.label.startswith("serve"))
        for proc in order:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
        for pid in self.seen:
            if alive(pid):
                with_kill(pid)


def with_kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path)
    yield r
    r.close()


def shard_pid(config_path, index=0):
    from engine import load_config

    cfg = load_config(config_path)
    try:
        with StatusReader(status_path(cfg, index)) as r:
            s = r.snapshot()
    except Exception:   # not made yet / being replaced
        return None
    return s.pid if s.state == "running" and alive(s.pid) else None


def one_line(stderr):
    lines = [x for x in stderr.splitlines() if x.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("leasehold: "), stderr
    return lines[0]


# ------------------------------------------------------------------------------ restart


def test_a_killed_shard_is_restarted_and_its_in_flight_work_completes(rig):
    cfg = rig.config()
    sup = rig.serve(cfg)
    worker = rig.spawn("worker", "worker", "--config", str(cfg), "--cluster", "east",
                       "--name", "east-1", "--slots", "100")
    until(lambda: "registered with shard" in rig.log(worker), 30, "the worker to register")
    first = shard_pid(cfg)
    assert first is not None
    assert psutil.Process(first).cpu_affinity() == [sorted(psutil.Process().cpu_affinity())[0]]
    with rig.client(rig.ports[0]) as c:
        names = [f"a{i:02d}" for i in range(20)]
        ids = [f"{RUN}/{n}" for n in names]
        c.enqueue_fanout({"id": f"{RUN}/x", "task": "t", "resources": {"cpu": "10m"},
                          "execute": {"plugin": "sim", "duration": 3.0}}, names)
        until(lambda: c.status(ids) == [Phase.RUNNING] * 20, 30, "every action RUNNING")
        os.kill(first, signal.SIGKILL)
        t_kill = time.monotonic()
        second = until(lambda: (pid := shard_pid(cfg)) not in (None, first) and pid, 30,
                       "the shard to be restarted")
        restart_s = time.monotonic() - t_kill
        rig.note_children(sup)
        c.reconnect()
        got = c.wait(ids, timeout=60)
    assert got == dict.fromkeys(ids, Phase.SUCCEEDED)
    log = rig.log(sup)
    assert "exited by signal SIGKILL; restarting it" in log, log
    assert "serving again" in log, log
    assert second != first and restart_s < 15
    # The worker kept its attempts: it never declared the shard lost (it re-registered).
    wlog = rig.log(worker)
    assert "silent for" not in wlog, wlog
    assert wlog.count("registered with shard") >= 2, wlog


def test_two_shards_run_on_stores_of_their_own_and_one_killed_is_restarted(rig):
    cfg = rig.config(shards=2)
    sup = rig.serve(cfg)
    pids = [shard_pid(cfg, i) for i in (0, 1)]
    assert None not in pids and pids[0] != pids[1]
    from engine import load_config
    conf = load_config(cfg)
    for i in (0, 1):
        assert Path(shard_store_path(conf, i)) == rig.tmp / "data" / f"shard-{i}"
        assert (Path(shard_store_path(conf, i)) / "p00").is_dir()
        assert shard_config(conf, i).storage.shard == f"shard-0.{i}"
    cpus = sorted(psutil.Process().cpu_affinity())
    for i, pid in enumerate(pids):
        assert psutil.Process(pid).cpu_affinity() == [cpus[i % len(cpus)]]
    for port in rig.ports:
        with rig.client(port) as c:
            assert c.ping()
    os.kill(pids[1], signal.SIGKILL)
    until(lambda: shard_pid(cfg, 1) not in (None, pids[1]), 30, "shard 1 to be restarted")
    assert shard_pid(cfg, 0) == pids[0]     # the other one was left alone
    with rig.client(rig.ports[1]) as c:
        assert c.ping()
    assert tenant_shard("acme", 2) == tenant_shard("acme", 2) in (0, 1)
    sup.terminate()
    assert sup.wait(30) == 0


# ------------------------------------------------------------------------------ refusals


def test_a_second_supervisor_on_the_same_data_directory_refuses_naming_the_holder(rig):
    a = rig.serve(rig.config("a.toml"))
    b = rig.config("b.toml")            # other ports, the same storage.path
    done = rig.run("serve", "--config", str(b))
    assert done.returncode == 2
    line = one_line(done.stderr)
    assert f"is held by supervisor pid {a.pid}" in line, line
    assert "a.toml" in line, line
    assert a.poll() is None             # the first one serves on


def test_a_store_held_by_a_hand_started_shard_is_refused_naming_it(rig):
    cfg = rig.config()
    shard = rig.spawn("shard", "shard", "--config", str(cfg))
    until(lambda: shard_pid(cfg) == shard.pid, 30, "the shard to serve")
    other = rig.config("other.toml")    # other ports, the same store
    done = rig.run("serve", "--config", str(other))
    assert done.returncode == 2
    line = one_line(done.stderr)
    assert "held by a live shard" in line and f"pid {shard.pid}" in line, line


def _store_holder(rig, cfg, then):
    """A process that opens ``cfg``'s store as its shard would (claiming it), prints "open",
    then runs ``then`` (Python source) in the same process; its command line names neither
    leasehold nor a shard."""
    conf = load_config(cfg)
    code = textwrap.dedent(f"""
        import os, sys, time
        from storage import LmdbStore
        store = LmdbStore({str(conf.storage.path)!r}, partitions={conf.storage.partitions})
        store.open({conf.storage.shard!r}, time.time_ns())
        print("open", flush=True)
        """) + textwrap.dedent(then)
    proc = subprocess.Popen([sys.executable, "-c", code], env=rig.env, cwd=rig.tmp,
                            stdout=subprocess.PIPE, text=True)
    proc.label = "holder"
    rig.procs.append(proc)
    rig.seen.add(proc.pid)
    assert proc.stdout.readline().strip() == "open"
    return proc


def test_a_store_open_in_another_process_is_refused_naming_its_pid(rig):
    # A program using the engine in process holds the store as a shard would: the
    # supervisor's shard would take its claim over and fence it out.
    cfg = rig.config()
    holder = _store_holder(rig, cfg, "time.sleep(60)\n")
    done = rig.run("serve", "--config", str(cfg))
    assert done.returncode == 2
    line = one_line(done.stderr)
    assert "held by a live process that has it open" in line, line
    assert f"pid {holder.pid}" in line, line
    assert holder.poll() is None


def test_a_claim_whose_pid_now_runs_something_else_is_taken_over(rig):
    # The claim's process is gone as the store's holder but its pid lives on, running
    # another program whose command line looks like a shard's (a pid reused after a
    # container restart): the supervisor takes the claim over and serves.
    cfg = rig.config()
    holder = _store_holder(rig, cfg, """
        os.closerange(3, 65536)     # nothing of the store's files is carried over
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)",
                                  "leasehold", "shard"])
        """)
    until(lambda: "shard" in psutil.Process(holder.pid).cmdline(), 10, "the exec")
    sup = rig.serve(cfg)
    until(lambda: shard_pid(cfg) is not None, 30, "the shard to serve")
    with rig.client(rig.ports[0]) as c:
        c.enqueue_fanout({"id": f"{RUN}/x", "task": "t", "resources": {"cpu": "10m"}}, ["a"])
        assert c.status([f"{RUN}/a"]) == [Phase.WAITING_FOR_RESOURCES]   # no worker
    assert sup.poll() is None and holder.poll() is None


def test_a_second_shard_on_a_live_shards_store_is_refused_and_the_first_serves_on(rig):
    # The store lets a shard of the same name take a live claim over (a restart); started by
    # hand next to a running one, that left the first fenced out and serving nothing.
    cfg = rig.config()
    first = rig.spawn("shard", "shard", "--config", str(cfg))
    until(lambda: shard_pid(cfg) == first.pid, 30, "the shard to serve")
    port = rig.ports[0]
    other = rig.config("other.toml")    # other ports, the same store
    done = rig.run("shard", "--config", str(other))
    assert done.returncode != 0
    line = one_line(done.stderr)
    assert "UNAVAILABLE" in line and f"is held by shard pid {first.pid} on host" in line, line
    assert f"(config {cfg}, started" in line, line    # the holder's config file, from its lock
    assert "Config(" not in line, line
    with rig.client(port) as c:
        c.enqueue_fanout({"id": f"{RUN}/x", "task": "t", "resources": {"cpu": "10m"}}, ["a"])
        assert c.status([f"{RUN}/a"]) == [Phase.WAITING_FOR_RESOURCES]   # no worker
    assert first.poll() is None


def serve_then_take_over(rig, claim_ttl):
    """A ``leasehold shard`` serving, and its store opened by a second incarnation of the
    same shard name, which takes the claim over (the store allows it; the CLI refuses it,
    above). Returns the shard's process and that store (open: close it)."""
    cfg = rig.config(storage=f"claim_ttl = {claim_ttl}")
    shard = rig.spawn("shard", "shard", "--config", str(cfg))
    until(lambda: shard_pid(cfg) == shard.pid, 30, "the shard to serve")
    conf = load_config(cfg)
    thief = LmdbStore(conf.storage.path, partitions=conf.storage.partitions)
    thief.open(conf.storage.shard, time.time_ns())
    return shard, thief


def test_a_shard_whose_store_is_taken_over_exits_non_zero(rig):
    # A long claim: a renewal (every claim_ttl / 3) that found the takeover before the request
    # came would stop the shard first (the next test), leaving the request unanswered.
    shard, thief = serve_then_take_over(rig, 3600)
    try:
        with rig.client(rig.ports[0]) as c:
            with pytest.raises(LeaseholdError, match="UNAVAILABLE|taken over"):
                c.enqueue_fanout({"id": f"{RUN}/x", "task": "t",
                                  "resources": {"cpu": "10m"}}, ["a"])
        rc = shard.wait(timeout=30)
    finally:
        thief.close()
    assert rc != 0
    log = rig.log(shard)
    assert "stopped serving: ownership lost" in log and "was taken over" in log, log


def test_an_idle_shard_whose_store_is_taken_over_finds_it_at_its_renewal_and_exits(rig):
    shard, thief = serve_then_take_over(rig, 1)
    try:
        rc = shard.wait(timeout=30)     # no request: the renewal (every 1/3 s) finds it
    finally:
        thief.close()
    assert rc != 0
    log = rig.log(shard)
    assert "stopped serving: ownership lost" in log and "detected during renew" in log, log


def test_a_taken_port_is_refused_with_one_line_before_anything_starts(rig):
    cfg = rig.config()
    with socket.socket() as s:
        s.bind(("127.0.0.1", rig.ports[0]))
        s.listen()
        done = rig.run("serve", "--config", str(cfg))
    assert done.returncode == 2
    line = one_line(done.stderr)
    assert f"port {rig.ports[0]} on 127.0.0.1 is taken" in line, line
    assert "transport.endpoints[0]" in line, line
    assert not (rig.tmp / "data" / "run").exists()      # no shard was started


def test_a_taken_metrics_port_is_refused_with_one_line(rig):
    cfg = rig.config()
    with socket.socket() as s:
        s.bind(("127.0.0.1", rig.metrics_port))
        s.listen()
        done = rig.run("serve", "--config", str(cfg))
    assert done.returncode == 2
    assert "status.metrics" in one_line(done.stderr)


@pytest.mark.parametrize("extra, key", [
    ('[status2]\n', "status2"),
])
def test_an_unknown_table_is_refused_naming_it(rig, extra, key):
    done = rig.run("serve", "--config", str(rig.config(extra=extra)))
    assert done.returncode == 2
    assert key in one_line(done.stderr)


@pytest.mark.parametrize("old, new, key", [
    ('metrics = "127.0.0.1:', 'metrics = "nowhere', "status.metrics"),
    ("heartbeat_interval = 1.0", "heartbeat_interval = -1", "engine.heartbeat_interval"),
    ('endpoints = ["tcp://127.0.0.1:', 'endpoints = ["tcp://127.0.0.1:0", "tcp://127.0.0.1:',
     "transport.endpoints[0]"),
    ('keys_dir = "', 'keys_dir = "/nonexistent', "shard.key_secret"),
])
def test_an_invalid_config_is_refused_with_one_line_naming_the_key(rig, old, new, key):
    cfg = rig.config()
    text = cfg.read_text()
    assert old in text
    cfg.write_text(text.replace(old, new, 1))
    done = rig.run("serve", "--config", str(cfg))
    assert done.returncode == 2
    line = one_line(done.stderr)
    assert key in line, line
    assert "Traceback" not in done.stderr


# ------------------------------------------------------------------------------ stop, metrics


def test_sigterm_stops_everything_cleanly_and_releases_the_claims(rig):
    cfg = rig.config()
    sup = rig.serve(cfg)
    url = f"http://127.0.0.1:{rig.metrics_port}/metrics"
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    assert 'leasehold_shard_up{shard="0"} 1.0' in body, body
    children = psutil.Process(sup.pid).children(recursive=True)
    assert children
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(30) == 0, rig.log(sup)
    assert not [c.pid for c in children if alive(c.pid)]
    assert "shard 0: pid" in rig.log(sup) and "stopped" in rig.log(sup)
    # The claims were released: another shard name may open the store at once (a killed
    # shard's claims would stay live for storage.claim_ttl and refuse it).
    store = LmdbStore(rig.tmp / "data", partitions=2)
    store.open("someone-else", time.time_ns())
    store.close()
    # And a new supervisor starts at once on the same store.
    again = rig.serve(cfg, label="serve-again")
    again.send_signal(signal.SIGINT)
    assert again.wait(30) == 0, rig.log(again)


def test_an_idle_workers_empty_heartbeat_still_reports_its_free_capacity(tmp_path):
    # The cluster and the worker hold one action at a time (cpu = 1), so the engine caps
    # what is free by the worker's reports: the second action starts only once a heartbeat
    # of the idle worker (no tokens) says it is free again.
    cfg = parse_config({
        "resources": ["cpu"],
        "clusters": {"east": {"capacity": {"cpu": 1}}},
        "queues": {"q": {"scheduling": "GREEDY_CAPACITY"}},
        "engine": {"default_queue": "q", "heartbeat_interval": 0.2},
        "storage": {"path": str(tmp_path / "data"), "partitions": 1},
        "transport": {"endpoints": ["tcp://127.0.0.1:0"]},
        "status": {"metrics": False},
        "security": {"insecure": True},
        "worker": {"capacity": {"cpu": 1}, "work_dir": str(tmp_path / "w"),
                   "log_dir": str(tmp_path / "l")},
    })
    shard = Shard(cfg, store=MemoryStore()).start()
    worker = client = None
    try:
        worker = Worker(cfg, "east", name="east-1", slots=10, plugins={"sim": SimPlugin()},
                        endpoints=[shard.endpoint], timeout=2.0).start()
        client = Client(endpoint=shard.endpoint, keys=None, timeout=5.0)
        ids = client.enqueue_many([{"id": f"{RUN}/a{i}", "task": "t", "resources": {"cpu": 1},
                                    "execute": {"plugin": "sim", "duration": 0.5}}
                                   for i in range(2)])
        assert client.wait(ids, timeout=15) == dict.fromkeys(ids, Phase.SUCCEEDED)
    finally:
        if client is not None:
            client.close()
        if worker is not None:
            worker.stop(timeout=10)
        shard.stop()


# ------------------------------------------------------------------------------ devbox


def end_devbox(proc, before):
    """Kill a devbox process still running, and every process below this one that was not
    there ``before`` (pids)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(5)
    for c in psutil.Process().children(recursive=True):
        if c.pid not in before and c.pid != proc.pid:
            with_kill(c.pid)


def test_the_devbox_runs_its_example_workload_end_to_end(tmp_path):
    box = tmp_path / "box"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "devbox", "--dir", str(box)],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        end_devbox(proc, before)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, out + err
    assert elapsed < 60, elapsed
    assert "devbox ready in" in out
    summary = [x for x in out.splitlines() if x.startswith("summary: ")]
    assert len(summary) == 1, out
    assert "56 actions, 56 SUCCEEDED; 1 retry;" in summary[0], summary
    for needle in ("queue batch:", "queue interactive:", "queue train:",
                   "reason seen: CLUSTER_CAPACITY", "estimated start shown:",
                   "short actions backfilled meanwhile", "warm pool: 6 calls ran in 1 process",
                   "HEAD_OF_LINE", "ETA", "stopped the worker, the shard and the supervisor"):
        assert needle in out, (needle, out)
    backfilled = int(out.split(" short actions backfilled")[0].rsplit("; ", 1)[1])
    assert backfilled >= 1, out
    # Everything it started is gone, and its directory stays (it was given).
    assert not [c for c in psutil.Process().children(recursive=True) if c.pid not in before]
    assert (box / "leasehold.toml").exists() and (box / "logs" / "worker.log").exists()


def test_a_serving_devbox_whose_worker_dies_says_so_and_stops_everything(tmp_path):
    # --no-workload serves until Ctrl-C; a worker gone meanwhile was left a zombie and the
    # devbox went on "serving" what nothing would run.
    # Its own temporary directory (no --dir): kept, and said so once.
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "devbox", "--no-workload"],
                            env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)},
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        first = proc.stdout.readline()      # bounded: the devbox gives up on its own in 60 s
        assert "devbox ready in" in first, first
        [worker] = [c for c in psutil.Process(proc.pid).children(recursive=True)
                    if "worker" in c.cmdline()]
        worker.kill()
        out, err = proc.communicate(timeout=60)
    finally:
        end_devbox(proc, before)
    assert proc.returncode == 2, out + err
    line = one_line(err)
    assert "the worker was killed by SIGKILL" in line and "worker.log" in line, line
    assert "stopped the rest" in line and line.count("directory kept: ") == 1, line
    assert Path(line.rsplit("directory kept: ", 1)[1]).parent == tmp_path, line
    assert not [c for c in psutil.Process().children(recursive=True) if c.pid not in before]


def test_the_devbox_names_a_dir_it_cannot_use(tmp_path, capsys):
    from engine.cli import main
    afile = tmp_path / "afile"
    afile.write_text("")
    for d, why in ((afile, "not a directory"),
                   (afile / "sub", "cannot make it: Not a directory")):
        assert main(["devbox", "--dir", str(d)]) == 2
        assert capsys.readouterr().err == f"leasehold: INVALID_ARGUMENT: --dir {d}: {why}\n"
    assert afile.read_text() == ""
