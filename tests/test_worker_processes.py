"""End to end with real processes on loopback: `leasehold shard` and `leasehold worker`
processes (CURVE keys), driven by a Client. A fan-out of 10,000; a 4-pod gang that starts
together and fails as one; a warm pool that runs 1,000 follow-on actions on the same
processes; a worker killed with SIGKILL whose leases are reassigned; a worker stopped past
the expiry window whose late reports are refused and whose attempts stop; an action over its
memory limit reported SYSTEM/OOM and retried; one writing past the worker's log limit
stopped as a USER failure; max_runtime; an abort that stops attempts on
two workers. Every wait is bounded; every process is killed in teardown."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from engine import Phase
from tests.conftest import free_port as _free_port
from tests.conftest import until
from transport import Client, generate_keypair, load_client_keys

ROOT = Path(__file__).resolve().parent.parent
RUN = "acme/ml/prod/r1"


def pid_gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class Cluster:
    """A shard process, worker processes and a client over CURVE; all stopped at the end."""

    def __init__(self, tmp_path, system_retries=3, heartbeat=0.5, worker_extra=""):
        self.tmp = tmp_path
        keys = tmp_path / "keys"
        for name in ("shard", "east-1", "east-2", "acme-app"):
            generate_keypair(keys, name)
        self.port = _free_port()
        self.jobs = tmp_path / "jobs"
        self.jobs.mkdir()
        (self.jobs / "pidjob.py").write_text(textwrap.dedent("""
            import os

            def run(out, inputs=None):
                with open(out, "a") as f:
                    f.write(f"{os.getpid()} {inputs}\\n")
            """))
        self.config = tmp_path / "leasehold.toml"
        self.config.write_text(textwrap.dedent(f"""
            resources = ["cpu", "memory"]
            [clusters.east]
            capacity = {{ cpu = 100000, memory = "100Ti" }}
            [queues.q]
            scheduling = "GREEDY_CAPACITY"
            depth = 100000
            [engine]
            default_queue = "q"
            heartbeat_interval = {heartbeat}
            expiry_missed_beats = 2
            expiry_jitter = 0.2
            system_retries = {system_retries}
            [storage]
            path = "{tmp_path / 'data'}"
            partitions = 2
            [transport]
            endpoints = ["tcp://127.0.0.1:{self.port}"]
            [security]
            keys_dir = "{keys}"
            [security.peers.east-1]
            role = "worker"
            cluster = "east"
            [security.peers.east-2]
            role = "worker"
            cluster = "east"
            [security.peers.acme-app]
            role = "client"
            tenants = ["acme"]
            [worker]
            capacity = {{ cpu = 100000, memory = "100Ti" }}
            work_dir = "{tmp_path / 'work'}"
            log_dir = "{tmp_path / 'logs'}"
            drain_timeout = 1
            kill_grace = 0.5
            """) + worker_extra)
        self.procs = []
        self.logs = {}
        self.env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{self.jobs}"}
        self.shard = self._spawn("shard", "shard", "--config", str(self.config))
        self.client = Client(endpoint=f"tcp://127.0.0.1:{self.port}",
                             keys=load_client_keys(keys, "acme-app", "shard"), timeout=20.0)
        until(lambda: self._pings(), 30, "the shard to answer")

    def _pings(self):
        try:
            self.client.ping()
            return True
        except Exception:       # not up yet
            self.client.reconnect()
            return False

    def _spawn(self, label, *args):
        log = open(self.tmp / f"{label}.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "engine.cli", *args], env=self.env,
                                cwd=self.tmp, stdout=log, stderr=subprocess.STDOUT)
        self.logs[proc.pid] = self.tmp / f"{label}.log"
        log.close()
        self.procs.append(proc)
        return proc

    def worker(self, name="east-1", slots=100):
        proc = self._spawn(name, "worker", "--config", str(self.config), "--cluster", "east",
                           "--name", name, "--slots", str(slots))
        until(lambda: "registered with shard" in self.log_of(proc), 30,
              f"worker {name} to register")
        return proc

    def log_of(self, proc):
        return self.logs[proc.pid].read_text(errors="replace")

    def close(self):
        self.client.close()
        # Workers first (they drain against a live shard), then the shard.
        workers = [p for p in self.procs if p is not self.shard]
        for group in (workers, [self.shard]):
            for proc in group:
                if proc.poll() is None:
                    try:
                        os.kill(proc.pid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass
                    proc.terminate()
            for proc in group:
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)


@pytest.fixture
def cluster(tmp_path):
    made = []

    def make(**kw):
        c = Cluster(tmp_path, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def spec(name, execute, **kw):
    return {"id": f"{RUN}/{name}", "task": "t", "resources": {"cpu": "10m"},
            "execute": execute, **kw}


def test_a_fanout_of_10000_completes_on_a_worker_process(cluster):
    c = cluster()
    c.worker(slots=2000)
    names = [f"a{i:05d}" for i in range(10000)]
    for lo in range(0, len(names), 1000):
        c.client.enqueue_fanout(spec("x", {"plugin": "sim"}), names[lo:lo + 1000])
    phases = c.client.wait([f"{RUN}/{n}" for n in names], timeout=120)
    assert len(phases) == 10000 and set(phases.values()) == {Phase.SUCCEEDED}


def test_a_gang_starts_together_and_one_failing_pod_fails_it(cluster, tmp_path):
    c = cluster(system_retries=0)
    w = c.worker()
    stamp = ("import os, sys, time; "
             "open(os.environ['STAMPS'] + '/' + os.environ['LEASEHOLD_POD_ROLE'] + "
             "os.environ['LEASEHOLD_POD_INDEX'], 'w').write(repr(time.time())); "
             "time.sleep(0.5); "
             "sys.exit(7 if os.environ['LEASEHOLD_POD_ROLE'] == os.environ['FAIL'] else 0)")
    pods = [{"role": "head", "replicas": 1, "resources": {"cpu": "10m"}},
            {"role": "worker", "replicas": 3, "resources": {"cpu": "10m"}}]
    for name, fail in (("ok", "none"), ("bad", "head")):
        stamps = tmp_path / f"stamps-{name}"
        stamps.mkdir()
        c.client.enqueue({"id": f"{RUN}/{name}", "task": "t", "pods": pods, "execute": {
            "plugin": "process", "command": [sys.executable, "-c", stamp],
            "env": {"STAMPS": str(stamps), "FAIL": fail}}})
    got = c.client.wait([f"{RUN}/ok", f"{RUN}/bad"], timeout=60)
    assert got == {f"{RUN}/ok": Phase.SUCCEEDED, f"{RUN}/bad": Phase.FAILED}, \
        (c.client.explain(f"{RUN}/ok"), c.log_of(w)[-3000:])
    times = [float(p.read_text()) for p in (tmp_path / "stamps-ok").iterdir()]
    assert len(times) == 4 and max(times) - min(times) < 1.0
    e = str(c.client.explain(f"{RUN}/bad"))
    assert "head/0" in e and "7" in e


def test_a_warm_pool_runs_1000_follow_on_actions_on_the_same_processes(cluster, tmp_path):
    c = cluster()
    c.worker(slots=8)
    out = tmp_path / "pids.txt"
    execute = {"plugin": "python", "function": "pidjob:run", "args": {"out": str(out)}}
    reuse = {"replicas": 2, "concurrency": 2, "idle_ttl": 60}
    names = [f"f{i:04d}" for i in range(1000)]
    for lo in range(0, 1000, 250):
        c.client.enqueue_fanout(spec("x", execute, environment="pool", reuse=reuse),
                                names[lo:lo + 250], [f"in-{n}" for n in names[lo:lo + 250]])
    phases = c.client.wait([f"{RUN}/{n}" for n in names], timeout=120)
    assert set(phases.values()) == {Phase.SUCCEEDED}
    rows = [line.split() for line in out.read_text().splitlines()]
    assert len(rows) == 1000
    assert sorted(r[1] for r in rows) == sorted(f"in-{n}" for n in names)
    assert len({r[0] for r in rows}) <= 2     # replicas = 2: the same two processes


def events_until_done(c, actions, timeout):
    """The run's events until every action is terminal (subscribe before enqueueing)."""
    seen, done = [], {}
    deadline = time.monotonic() + timeout
    while len(done) < len(actions):
        e = c.client.next_event(timeout=max(0.1, deadline - time.monotonic()))
        seen.append(e)
        if e.action in actions and e.phase in ("SUCCEEDED", "FAILED", "ABORTED", "TIMED_OUT"):
            done[e.action] = e.phase
    return seen, done


def test_a_killed_worker_has_its_leases_reassigned_and_finished(cluster):
    c = cluster()
    a = c.worker("east-1", slots=10)
    names = [f"k{i}" for i in range(5)]
    ids = [f"{RUN}/{n}" for n in names]
    c.client.subscribe(RUN)
    c.client.enqueue_fanout(spec("x", {"plugin": "sim", "duration": 2.0}), names)
    until(lambda: c.client.status(ids) == [Phase.RUNNING] * 5, 30, "every action RUNNING")
    t_kill = time.time_ns()
    os.kill(a.pid, signal.SIGKILL)
    a.wait(timeout=10)
    c.worker("east-2", slots=10)
    seen, done = events_until_done(c, set(ids), 60)
    assert done == {i: "SUCCEEDED" for i in ids}
    # Each finished in a second attempt: the first expired with its worker.
    for i in ids:
        final = [e for e in seen if e.action == i and e.phase == "SUCCEEDED"]
        assert final and final[-1].attempt == 2, [(e.phase, e.attempt, e.time_ns - t_kill)
                                                  for e in seen if e.action == i]


def test_a_worker_stopped_past_expiry_stops_its_attempts_when_resumed(cluster, tmp_path):
    c = cluster()
    a = c.worker("east-1", slots=10)
    pidfile = tmp_path / "pid"
    c.client.enqueue(spec("long", {"plugin": "process", "command": [
        "sh", "-c", f"echo $$ > {pidfile}; exec sleep 60"]}))
    pid = int(until(lambda: pidfile.exists() and pidfile.read_text().strip(), 30,
                    "the attempt's process"))
    os.kill(a.pid, signal.SIGSTOP)
    b = c.worker("east-2", slots=10)
    # The lease expires (ttl 1.2 s) and the action is placed on the second worker.
    until(lambda: pidfile.exists() and pidfile.read_text().strip() != str(pid), 30,
          "the second attempt on the other worker")
    assert not pid_gone(pid)            # the stopped worker could not stop it
    os.kill(a.pid, signal.SIGCONT)
    until(lambda: pid_gone(pid), 10, "the resumed worker to stop its stale attempt")
    log = c.log_of(a)
    assert "silent" in log or "refused" in log, log
    assert b.poll() is None


def test_a_worker_resumed_after_a_pause_runs_the_retry_it_is_given(cluster, tmp_path):
    # Resumed, it heartbeated the old session first (the shard then placed the retry there)
    # and abandoned that session a moment later: the retry's lease expired unused and the
    # action needed a third attempt.
    c = cluster()
    a = c.worker("east-1", slots=10)
    marks = tmp_path / "attempts"
    c.client.subscribe(RUN)
    c.client.enqueue(spec("p", {"plugin": "process", "command": [
        "sh", "-c", f"echo $$ >> {marks}; sleep 2"]}))
    until(lambda: marks.exists() and marks.read_text().strip(), 30, "the first attempt")
    os.kill(a.pid, signal.SIGSTOP)
    time.sleep(3.0)                     # past the lease ttl (1.2 s): the lease expires
    os.kill(a.pid, signal.SIGCONT)
    seen, done = events_until_done(c, {f"{RUN}/p"}, 60)
    assert done == {f"{RUN}/p": "SUCCEEDED"}
    final = [e for e in seen if e.action == f"{RUN}/p" and e.phase == "SUCCEEDED"]
    assert final[-1].attempt == 2, [(e.phase, e.attempt, e.detail) for e in seen]
    assert len(marks.read_text().split()) == 2      # two processes started, not three
    assert a.poll() is None


def test_an_action_over_its_memory_limit_is_oom_and_retried(cluster):
    c = cluster(system_retries=1)
    c.worker()
    hog = "b = bytearray(300 * 1024 * 1024); import time; time.sleep(5)"
    c.client.subscribe(RUN)
    c.client.enqueue(spec("hog", {"plugin": "process", "command": [sys.executable, "-c", hog]},
                          resources={"cpu": "10m", "memory": "64Mi"}))
    seen, done = events_until_done(c, {f"{RUN}/hog"}, 60)
    assert done == {f"{RUN}/hog": "FAILED"}
    attempts = {e.attempt for e in seen if e.action == f"{RUN}/hog"}
    assert max(attempts) == 2           # one system retry, as configured
    assert "OOM" in str(c.client.explain(f"{RUN}/hog"))


def test_an_attempt_writing_past_worker_max_log_bytes_is_stopped_and_fails_user(cluster):
    c = cluster(worker_extra='max_log_bytes = "64Ki"\n')
    c.worker()
    chatty = ("import sys, time\nfor _ in range(100000):\n"
              "    sys.stdout.write('x' * 1023 + '\\n'); sys.stdout.flush(); time.sleep(0.0005)")
    c.client.enqueue(spec("chatty", {"plugin": "process",
                                     "command": [sys.executable, "-c", chatty]}))
    t0 = time.monotonic()
    got = c.client.wait(f"{RUN}/chatty", timeout=30)
    assert got == {f"{RUN}/chatty": Phase.FAILED}
    assert time.monotonic() - t0 < 20       # stopped, not run to its end (~50 s)
    text = str(c.client.explain(f"{RUN}/chatty"))
    assert "worker.max_log_bytes" in text and "65536 bytes" in text, text
    # A USER failure spends the spec's retries (none): one attempt; a SYSTEM one would have
    # been retried (system_retries = 3), its reason naming a later attempt's log.
    assert "chatty.1.log" in text, text


def test_max_runtime_ends_a_long_process_timed_out(cluster, tmp_path):
    c = cluster()
    c.worker()
    pidfile = tmp_path / "pid"
    c.client.enqueue(spec("slow", {"plugin": "process", "command": [
        "sh", "-c", f"echo $$ > {pidfile}; exec sleep 60"]}, timeouts={"max_runtime": 1.0}))
    got = c.client.wait(f"{RUN}/slow", timeout=30)
    assert got == {f"{RUN}/slow": Phase.TIMED_OUT}
    assert "max_runtime" in str(c.client.explain(f"{RUN}/slow"))
    until(lambda: pid_gone(int(pidfile.read_text())), 10, "the process to be stopped")


def test_an_abort_stops_attempts_running_on_two_workers(cluster, tmp_path):
    c = cluster()
    c.worker("east-1", slots=1)
    c.worker("east-2", slots=1)
    pids = [tmp_path / "p1", tmp_path / "p2"]
    c.client.enqueue(spec("root", {"plugin": "process", "command": [
        "sh", "-c", f"echo $$ > {pids[0]}; exec sleep 60"]}))
    c.client.enqueue(spec("kid", {"plugin": "process", "command": [
        "sh", "-c", f"echo $$ > {pids[1]}; exec sleep 60"]}, parent=f"{RUN}/root"))
    got = [int(until(lambda f=f: f.exists() and f.read_text().strip(), 30, "both attempts"))
           for f in pids]
    c.client.abort(f"{RUN}/root", reason="test")
    for pid in got:
        until(lambda pid=pid: pid_gone(pid), 10, "the aborted attempts to stop")
    assert c.client.status([f"{RUN}/root", f"{RUN}/kid"]) == [Phase.ABORTED] * 2
