"""The cluster worker's core (transport.Worker) against a real shard over loopback, with a
plugin the test controls: leases start attempts, outcomes are reported with their tokens,
aborts and refusals stop attempts, bounds end them TIMED_OUT, a silent shard makes the
worker stop everything it holds from it, a drain finishes what runs. Every wait is bounded;
every shard, worker and client is closed in teardown."""

import threading
import time

import pytest

from engine import Phase, SpecError, parse_config
from storage import MemoryStore
from tests.conftest import until
from transport import (
    Change,
    Client,
    Outcome,
    Plugin,
    PluginError,
    Shard,
    ShardError,
    ShardTimeout,
    Worker,
)

RUN = "acme/ml/prod/r1"


class Controlled(Plugin):
    """Runs nothing: an attempt is RUNNING once started and ends when the test says (or at
    once, with ``instant``). Records every call."""

    name = "sim"
    finalizes = False           # as the sim plugin it stands for
    logs = False

    def __init__(self, instant=False):
        self.instant = instant
        self.started = {}           # key -> Attempt
        self.stopped = {}           # key -> reason
        self.cleaned = []           # (action, attempt)
        self._changes = []
        self._lock = threading.Lock()

    def start(self, attempt):
        with self._lock:
            self.started[attempt.key] = attempt
            self._changes.append(Change(attempt.key, Phase.RUNNING))
            if self.instant:
                self._changes.append(Change(attempt.key, Phase.SUCCEEDED,
                                            Outcome.succeeded()))

    def finish(self, action, outcome):
        with self._lock:
            for key, att in self.started.items():
                if att.action == action:
                    self._changes.append(Change(key, outcome.phase, outcome))

    def poll(self):
        with self._lock:
            out, self._changes = self._changes, []
        return out

    def due(self):
        return time.monotonic() if self._changes else None

    def stop(self, key, reason):
        with self._lock:
            self.stopped[key] = reason

    def cleanup(self, attempt):
        self.cleaned.append((attempt.action, attempt.attempt))

    def actions_started(self):
        with self._lock:
            return sorted(a.action for a in self.started.values())


def config(tmp_path, engine=None, **worker):
    return parse_config({
        "resources": ["cpu", "memory"],
        "clusters": {"east": {"capacity": {"cpu": 64, "memory": "64Gi"}}},
        "queues": {"q": {"scheduling": "GREEDY_CAPACITY", "depth": 100000}},
        "engine": {"default_queue": "q", "heartbeat_interval": 0.2, "expiry_missed_beats": 2,
                   "expiry_jitter": 0.1, **(engine or {})},
        "storage": {"path": str(tmp_path / "data"), "partitions": 2},
        "transport": {"endpoints": ["tcp://127.0.0.1:0"]},
        "security": {"insecure": True},
        "worker": {"capacity": {"cpu": 64, "memory": "64Gi"}, "work_dir": str(tmp_path / "w"),
                   "log_dir": str(tmp_path / "logs"), "drain_timeout": 2.0, **worker},
    })


def spec(name, **kw):
    d = {"id": f"{RUN}/{name}", "task": "t", "resources": {"cpu": 1},
         "execute": {"plugin": "sim"}}
    d.update(kw)
    return d


class Rig:
    def __init__(self, tmp_path, plugin, slots=100, others=None, engine=None, **worker):
        self.cfg = config(tmp_path, engine, **worker)
        self.shard = Shard(self.cfg, store=MemoryStore()).start()
        self.plugin = plugin
        self.worker = Worker(self.cfg, "east", name="east-1", slots=slots,
                             plugins={"sim": plugin, **(others or {})},
                             endpoints=[self.shard.endpoint], timeout=2.0).start()
        self.client = Client(endpoint=self.shard.endpoint, keys=None, timeout=5.0)

    def close(self):
        self.client.close()
        self.worker.stop(timeout=10)
        if self.shard is not None:
            self.shard.stop()


@pytest.fixture
def rig(tmp_path):
    made = []

    def make(plugin=None, **kw):
        r = Rig(tmp_path, plugin or Controlled(), **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def test_a_fanout_runs_to_completion_through_the_worker(rig):
    r = rig(Controlled(instant=True))
    names = [f"a{i}" for i in range(300)]
    assert r.client.enqueue_fanout(spec("x"), names) == 300
    ids = [f"{RUN}/{n}" for n in names]
    phases = r.client.wait(ids, timeout=20)
    assert set(phases.values()) == {Phase.SUCCEEDED}
    assert r.plugin.actions_started() == sorted(f"{RUN}/{n}" for n in names)
    s = r.worker.stats()
    assert s["succeeded"] == 300 and s["held"] == 0 and s["report_errors"] == 0


class Picky(Controlled):
    """Starts a fan-out's attempts in one ``start_many`` call each, refusing those whose
    action name ends in ``bad`` (or, with ``broken``, raising for the whole call)."""

    def __init__(self, broken=False):
        super().__init__(instant=True)
        self.broken = broken
        self.calls = []             # len(attempts) of each start_many

    def start_many(self, attempts):
        self.calls.append(len(attempts))
        if self.broken:
            self.start(attempts[0])     # started, then the call fails: it must be stopped
            raise RuntimeError("start_many blew up")
        failed = []
        for a in attempts:
            if a.action.endswith("bad"):
                failed.append((a, PluginError(f"{a.action} refused", cause="NO_ROOM")))
            else:
                self.start(a)
        return failed


def test_a_fanout_starts_with_one_start_many_and_each_refused_attempt_fails_alone(rig):
    r = rig(Picky(), engine={"system_retries": 0})
    names = [f"a{i}" for i in range(40)] + ["xbad", "ybad"]
    assert r.client.enqueue_fanout(spec("x"), names) == 42
    phases = r.client.wait([f"{RUN}/{n}" for n in names], timeout=20)
    assert {n: phases[f"{RUN}/{n}"] for n in ("xbad", "ybad")} == {
        "xbad": Phase.FAILED, "ybad": Phase.FAILED}
    assert {phases[f"{RUN}/a{i}"] for i in range(40)} == {Phase.SUCCEEDED}
    # Consecutive leases of the fan-out's spec start together: fewer calls than attempts.
    assert sum(r.plugin.calls) == 42 and len(r.plugin.calls) < 10
    detail = r.client.explain(f"{RUN}/xbad")
    assert "NO_ROOM" in str(detail) and "refused" in str(detail)
    s = r.worker.stats()
    assert s["started"] == 40 and s["held"] == 0


def test_a_start_many_that_raises_fails_each_attempt_and_stops_what_it_started(rig):
    r = rig(Picky(broken=True), engine={"system_retries": 0})
    names = [f"a{i}" for i in range(5)]
    r.client.enqueue_fanout(spec("x"), names)
    phases = r.client.wait([f"{RUN}/{n}" for n in names], timeout=20)
    assert set(phases.values()) == {Phase.FAILED}
    assert "RuntimeError: start_many blew up" in str(r.client.explain(f"{RUN}/a0"))
    # What the broken call did start is stopped (every attempt of the call is told).
    assert r.plugin.started and set(r.plugin.started) <= set(r.plugin.stopped)
    s = r.worker.stats()
    assert s["plugin_errors"] == 5 and s["started"] == 0 and s["held"] == 0


def test_run_fanout_enqueues_and_waits_in_one_call_and_leaves_no_watch(rig):
    r = rig(Controlled(instant=True))
    names = [f"n{i}" for i in range(30)]
    got = r.client.run_fanout(spec("x"), names, timeout=20)
    assert got == {f"{RUN}/{n}": Phase.SUCCEEDED for n in names}
    # Again: the same fan-out is already done (an idempotent enqueue adds nothing): its
    # phases come from the STATUS read after it, with no event to wait for.
    t0 = time.monotonic()
    assert r.client.run_fanout(spec("x"), names, timeout=20) == got
    assert time.monotonic() - t0 < 5
    # A fan-out the shard refuses raises its error; nothing of it is enqueued or watched.
    with pytest.raises(ShardError, match="INVALID_ARGUMENT"):
        r.client.run_fanout(spec("x"), ["ok", "not a name!"], timeout=5)
    with pytest.raises(ShardError, match="NOT_FOUND"):
        r.client.status(f"{RUN}/ok")
    with pytest.raises(ShardTimeout):
        r.client.next_event(timeout=0.3)
    with pytest.raises(SpecError):
        r.client.run_fanout({**spec("x"), "id": "no-slashes"}, ["a"], timeout=5)


def test_the_free_capacity_reported_is_the_capacity_less_what_held_attempts_declared(rig):
    r = rig()
    assert r.worker.free_capacity() == {"cpu": "64", "memory": "64Gi"}
    r.client.enqueue(spec("one"))
    r.client.enqueue_fanout(spec("x", resources={"cpu": 4, "memory": "1Gi"}), ["a", "b"])
    until(lambda: len(r.plugin.started) == 3, what="three attempts")
    assert r.worker.free_capacity() == {"cpu": "55", "memory": "62Gi"}
    r.plugin.finish(f"{RUN}/a", Outcome.succeeded())
    until(lambda: r.worker.stats()["held"] == 2, what="one attempt let go")
    assert r.worker.free_capacity() == {"cpu": "59", "memory": "63Gi"}
    for name in ("one", "b"):
        r.plugin.finish(f"{RUN}/{name}", Outcome.succeeded())
    until(lambda: r.worker.stats()["held"] == 0, what="every attempt let go")
    assert r.worker.free_capacity() == {"cpu": "64", "memory": "64Gi"}


def test_a_short_attempt_is_reported_once_and_a_long_one_is_seen_running(rig):
    # An attempt that ends within the report hold (a few ms) sends its outcome alone: its
    # INITIALIZING and RUNNING wait for it and are superseded (one REPORT row, one shard
    # turn); an attempt that goes on is still reported RUNNING soon after it starts.
    from transport import SimPlugin
    r = rig(SimPlugin())
    for i in range(5):
        r.client.enqueue(spec(f"short{i}", execute={"plugin": "sim", "duration": 0.001}))
        assert r.client.wait([f"{RUN}/short{i}"], timeout=10) == {
            f"{RUN}/short{i}": Phase.SUCCEEDED}
    until(lambda: r.worker.stats()["reports"] == 5, timeout=2, what="five reports")
    r.client.enqueue(spec("long", execute={"plugin": "sim", "duration": 30}))
    until(lambda: r.client.status([f"{RUN}/long"]) == [Phase.RUNNING], timeout=2,
          what="the long attempt RUNNING at the shard")
    time.sleep(0.1)
    assert r.worker.stats()["reports"] == 6


def test_leases_of_one_declaration_under_new_ids_each_get_their_own_spec(rig):
    # The worker parses a declaration once and reuses it for later leases of the same one
    # under other ids: each attempt still sees its own id, and another declaration its own
    # resources and pods.
    r = rig(Controlled(instant=True))
    names = ["one", "two", "three"]
    for name in names:
        r.client.enqueue(spec(name, resources={"cpu": 2}))
    r.client.enqueue(spec("four", resources={"cpu": 3}))
    ids = [f"{RUN}/{n}" for n in [*names, "four"]]
    assert set(r.client.wait(ids, timeout=10).values()) == {Phase.SUCCEEDED}
    atts = {a.action: a for a in r.plugin.started.values()}
    for action, att in atts.items():
        assert att.spec.id == action
    assert [atts[i].pods[0].resources for i in ids] == [{"cpu": 2}] * 3 + [{"cpu": 3}]
    assert atts[ids[1]].spec.resources == {"cpu": 2} and atts[ids[3]].spec.resources == {
        "cpu": 3}
    assert r.worker.free_capacity() == {"cpu": "64", "memory": "64Gi"}


class Idle(Plugin):
    """A plugin with nothing to do: no descriptors, nothing due. Counts its polls."""

    name = "idle"

    def __init__(self):
        self.polls = 0

    def start(self, attempt):
        raise AssertionError("nothing is sent to it")

    def poll(self):
        self.polls += 1
        return []

    def stop(self, key, reason):
        pass


def test_a_plugin_is_polled_only_when_its_descriptors_or_its_due_time_say_so(rig):
    # The loop turns for leases, reports' answers and heartbeats; a plugin with no news
    # (no readable descriptor, no due time) is not polled in them.
    idle = Idle()
    r = rig(Controlled(instant=True), others={"idle": idle})
    names = [f"a{i}" for i in range(20)]
    for name in names:
        r.client.enqueue(spec(name))
    assert set(r.client.wait([f"{RUN}/{n}" for n in names], timeout=10).values()) == {
        Phase.SUCCEEDED}
    time.sleep(0.5)                 # heartbeats (every 0.2 s) and their answers
    assert r.worker.stats()["heartbeats"] >= 2
    assert idle.polls == 0


def test_take_returns_every_message_waiting_in_order(tmp_path):
    # WorkerConnection.take() reads until the socket has nothing more (asked, not found by
    # a receive that fails): three answers that arrived are taken at once, in order.
    from transport import WorkerConnection
    cfg = config(tmp_path)
    shard = Shard(cfg, store=MemoryStore()).start()
    conn = WorkerConnection(shard.endpoint, None, "east-1", "east", 4, timeout=2.0)
    try:
        conn.connect()
        sent = [m.rid for _ in range(3) for m in conn.send_heartbeat(b"")]
        until(lambda: conn.socket.poll(0), what="an answer")
        time.sleep(0.3)                 # the other two too
        got = conn.take()
        assert [m.rid for m in got] == sent
        assert conn.take() == [] and not conn.has_pushed
    finally:
        conn.close()
        shard.stop()


def test_outcomes_reach_the_engine_with_their_cause_and_drive_retries(rig):
    r = rig()
    r.client.enqueue(spec("u", retries={"count": 1, "backoff_base": 0}))
    until(lambda: r.plugin.actions_started() == [f"{RUN}/u"], what="the first attempt")
    r.plugin.finish(f"{RUN}/u", Outcome.system("OOM", "over its memory"))
    until(lambda: len(r.plugin.started) == 2, what="the retry")
    r.plugin.finish(f"{RUN}/u", Outcome.user("exit 3", recoverable=False))
    until(lambda: r.client.status([f"{RUN}/u"]) == [Phase.FAILED], what="FAILED")
    e = r.client.explain(f"{RUN}/u")
    assert "exit 3" in str(e)
    attempts = sorted(r.plugin.started.values(), key=lambda a: a.attempt)
    assert [a.attempt for a in attempts] == [1, 2]


def test_an_abort_stops_the_running_attempt_at_once_and_cleans_it_up(rig):
    r = rig()
    r.client.enqueue(spec("p"))
    until(lambda: r.plugin.actions_started() == [f"{RUN}/p"], what="start")
    (key,) = r.plugin.started
    r.client.abort(f"{RUN}/p", reason="user")
    until(lambda: key in r.plugin.stopped, timeout=1.0, what="the stop (pushed, no heartbeat)")
    until(lambda: r.plugin.cleaned == [(f"{RUN}/p", 1)], what="the cleanup lease")
    assert r.client.status([f"{RUN}/p"]) == [Phase.ABORTED]


class Finalizing(Controlled):
    finalizes = True            # leaves something behind: each attempt is cleaned up


class Logging(Controlled):
    logs = True                 # its attempts write a log of their own


@pytest.mark.parametrize("plugin_cls", [Controlled, Finalizing])
def test_an_attempt_ends_with_a_finalize_lease_only_when_its_plugin_finalizes(rig, plugin_cls):
    r = rig(plugin_cls(instant=True))
    r.client.enqueue(spec("f"))
    assert r.client.wait([f"{RUN}/f"], timeout=10) == {f"{RUN}/f": Phase.SUCCEEDED}
    if plugin_cls.finalizes:
        until(lambda: r.plugin.cleaned == [(f"{RUN}/f", 1)], what="the cleanup lease")
        until(lambda: r.worker.stats()["cleanups"] == 1, what="the cleanup counted")
    else:
        time.sleep(0.3)         # a finalize lease would be pushed at once
        assert r.plugin.cleaned == [] and r.worker.stats()["cleanups"] == 0
    # A workdir is made only for an attempt that a finalize lease will remove.
    (att,) = r.plugin.started.values()
    assert (att.workdir is not None) == plugin_cls.finalizes
    assert att.log_path is None


def test_an_attempt_gets_a_log_path_only_when_its_plugin_logs(rig, tmp_path):
    r = rig(Logging(instant=True))
    r.client.enqueue(spec("l"))
    assert r.client.wait([f"{RUN}/l"], timeout=10) == {f"{RUN}/l": Phase.SUCCEEDED}
    (att,) = r.plugin.started.values()
    assert att.workdir is None              # no finalize lease to remove one
    assert att.log_path == tmp_path / "logs" / RUN / "l.1.log"   # one directory a run
    assert att.log_path.parent.is_dir()     # made for the plugin before start


class LoggingFinalizing(Controlled):
    logs = True
    finalizes = True


def test_an_id_whose_segments_pass_a_file_name_limit_runs_and_the_worker_serves_on(rig):
    # Ids allow 1,024 characters; a segment over 255 bytes made the attempt's mkdir fail, and
    # the worker crashed ending it (KeyError: its demand was set but never counted).
    r = rig(LoggingFinalizing(instant=True))
    run = "acme/ml/prod/" + "r" * 300
    long_id, short_id = f"{run}/" + "n" * 400, f"{RUN}/after"
    r.client.enqueue(spec("x", id=long_id))
    r.client.enqueue(spec("x", id=short_id))
    got = r.client.wait([long_id, short_id], timeout=10)
    assert got == {long_id: Phase.SUCCEEDED, short_id: Phase.SUCCEEDED}
    att = next(a for a in r.plugin.started.values() if a.action == long_id)
    assert all(len(part) <= 255 for part in att.log_path.parts)
    assert all(len(part) <= 255 for part in att.workdir.parts)
    assert att.log_path.parent.is_dir()     # (the workdir: its finalize lease removes it)
    assert r.worker.stats()["plugin_errors"] == 0


def test_an_attempt_whose_directory_cannot_be_made_fails_alone(rig, tmp_path):
    # Its start failed before its demand was counted, and ending it raised KeyError out of
    # the worker's loop: the worker died with every attempt it held.
    (tmp_path / "afile").write_text("a regular file")
    r = rig(Logging(instant=True), log_dir=str(tmp_path / "afile" / "logs"))
    r.client.enqueue(spec("x", retries={"count": 0}))
    assert r.client.wait([f"{RUN}/x"], timeout=10) == {f"{RUN}/x": Phase.FAILED}
    exp = r.client.explain(f"{RUN}/x")
    assert "START_FAILED" in str(exp) and "afile" in str(exp), exp
    assert r.worker.wait(timeout=0.5) is None       # still serving
    r.client.enqueue(spec("y", retries={"count": 0}))
    assert r.client.wait([f"{RUN}/y"], timeout=10) == {f"{RUN}/y": Phase.FAILED}


def test_a_second_worker_of_the_same_name_displaces_the_first_which_exits_loudly(rig, caplog):
    # Both registered again at every request, taking the name from each other: every lease
    # of both expired. The later one keeps the name; the earlier one stops and exits 2.
    r = rig(Controlled(instant=True))
    second = Worker(r.cfg, "east", name="east-1", slots=10,
                    plugins={"sim": Controlled(instant=True)},
                    endpoints=[r.shard.endpoint], timeout=2.0).start()
    try:
        assert r.worker.wait(timeout=10) == 2       # the first one, at its next heartbeat
        assert "registered by another connection" in caplog.text
        r.client.enqueue(spec("after"))
        assert r.client.wait([f"{RUN}/after"], timeout=10) == {f"{RUN}/after": Phase.SUCCEEDED}
        assert second.wait(timeout=0.5) is None     # the second one serves on
    finally:
        second.stop(timeout=10)


def test_max_runtime_ends_the_attempt_timed_out(rig):
    r = rig()
    r.client.enqueue(spec("slow", timeouts={"max_runtime": 0.3}))
    until(lambda: r.client.status([f"{RUN}/slow"]) == [Phase.TIMED_OUT], what="TIMED_OUT")
    (key,) = r.plugin.started
    assert r.plugin.stopped[key] == "max_runtime reached"
    assert "max_runtime" in str(r.client.explain(f"{RUN}/slow"))


def test_a_silent_shard_makes_the_worker_stop_what_it_holds_and_exit(rig):
    r = rig(on_shard_lost="exit")
    r.client.enqueue(spec("held"))
    until(lambda: r.plugin.actions_started() == [f"{RUN}/held"], what="start")
    (key,) = r.plugin.started
    r.shard.stop()
    r.shard = None
    # lease ttl = 2 beats x 0.2 s + 0.1 s: the worker stops the attempt soon after.
    until(lambda: key in r.plugin.stopped, timeout=5.0, what="the stop of a lost shard")
    assert r.plugin.stopped[key] == "shard lost"
    assert r.worker.wait(timeout=10) == 3
    assert r.worker.stats()["shard_lost"] == 1


def test_a_drain_takes_no_new_work_and_lets_running_attempts_finish(rig, caplog):
    caplog.set_level("INFO", logger="leasehold.worker")
    r = rig(slots=1)
    r.client.enqueue(spec("first"))
    until(lambda: r.plugin.actions_started() == [f"{RUN}/first"], what="start")
    r.worker.drain()
    time.sleep(0.3)
    r.client.enqueue(spec("second"))
    r.plugin.finish(f"{RUN}/first", Outcome.succeeded())
    until(lambda: r.client.status([f"{RUN}/first"]) == [Phase.SUCCEEDED], what="SUCCEEDED")
    assert r.worker.wait(timeout=10) == 0
    assert "worker east-1: stopped (drained), exit code 0" in caplog.text    # said at the end
    # The drained worker took nothing new: the second action waits for another worker.
    assert r.plugin.actions_started() == [f"{RUN}/first"]
    assert r.client.status([f"{RUN}/second"])[0] in (Phase.QUEUED,
                                                     Phase.WAITING_FOR_RESOURCES)


def _cli(*args, timeout=60):
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    return subprocess.run([sys.executable, "-m", "engine.cli", *args],
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=timeout)


def test_leasehold_worker_refuses_a_bad_invocation_in_one_line(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('resources = ["cpu"]\n[clusters.east]\n[security]\ninsecure = true\n'
                   '[transport]\nendpoints = ["tcp://127.0.0.1:9"]\n'
                   '[worker]\non_shard_lost = "maybe"\n')
    out = _cli("worker", "--config", str(cfg), "--cluster", "east")
    assert out.returncode == 2 and "worker.on_shard_lost" in out.stderr
    cfg.write_text('resources = ["cpu"]\n[clusters.east]\n[security]\ninsecure = true\n'
                   '[transport]\nendpoints = ["tcp://127.0.0.1:9"]\n')
    out = _cli("worker", "--config", str(cfg), "--cluster", "west")
    assert out.returncode == 2 and "cluster 'west' is not configured" in out.stderr
    out = _cli("worker", "--config", str(cfg), "--cluster", "east", "--slots", "0")
    assert out.returncode == 2 and "--slots" in out.stderr
    # A log directory it cannot make would fail every attempt it took: refused at start.
    (tmp_path / "afile").write_text("a regular file")
    cfg.write_text('resources = ["cpu"]\n[clusters.east]\n[security]\ninsecure = true\n'
                   '[transport]\nendpoints = ["tcp://127.0.0.1:9"]\n'
                   f'[worker]\nlog_dir = "{tmp_path / "afile" / "logs"}"\n')
    made = _cli("worker", "--config", str(cfg), "--cluster", "east")
    assert made.returncode == 2 and "INVALID_CONFIG" in made.stderr
    assert "worker.log_dir" in made.stderr and "cannot make the directory" in made.stderr
    for o in (out, made):
        assert "Traceback" not in o.stderr


def test_leasehold_worker_exits_2_when_no_shard_answers(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('resources = ["cpu"]\n[clusters.east]\n[security]\ninsecure = true\n'
                   '[transport]\nendpoints = ["tcp://127.0.0.1:9"]\n'
                   f'[worker]\nwork_dir = "{tmp_path}/w"\nlog_dir = "{tmp_path}/l"\n')
    out = _cli("worker", "--config", str(cfg), "--cluster", "east", "--name", "east-1")
    assert out.returncode == 2, out.stderr
    last = [x for x in out.stderr.splitlines() if x.strip()][-1]
    assert last.startswith("leasehold: ") and "tcp://127.0.0.1:9" in last
    assert "Traceback" not in out.stderr


class Broken(Controlled):
    """Raises where a buggy plugin would: in start() for one action, in poll() once."""

    def __init__(self):
        super().__init__(instant=True)
        self.poll_failures = 1

    def start(self, attempt):
        if attempt.action.endswith("/boom"):
            raise RuntimeError("a bug in start")
        super().start(attempt)

    def poll(self):
        if self.poll_failures:
            self.poll_failures -= 1
            raise RuntimeError("a bug in poll")
        return super().poll()


def test_a_plugins_bug_fails_its_attempt_and_the_worker_keeps_serving(rig):
    r = rig(Broken())
    r.client.enqueue(spec("boom"))
    r.client.enqueue(spec("fine"))
    got = r.client.wait([f"{RUN}/boom", f"{RUN}/fine"], timeout=20)
    assert got == {f"{RUN}/boom": Phase.FAILED, f"{RUN}/fine": Phase.SUCCEEDED}
    assert "PLUGIN_ERROR" in str(r.client.explain(f"{RUN}/boom"))
    # A SYSTEM failure is retried (engine.system_retries = 3): four starts failed, one poll.
    assert r.worker.stats()["plugin_errors"] == 5 and r.worker.wait(timeout=0) is None
