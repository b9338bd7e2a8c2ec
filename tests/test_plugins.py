"""The worker's execution plugins (transport/_sim_plugin.py, _process_plugin.py, _pool.py),
driven directly: no shard, no worker. Every wait is bounded."""

import collections
import itertools
import os
import select
import signal
import sys
import time

import psutil
import pytest

from engine._codes import Phase
from engine._model import ActionSpec
from transport import _process_plugin
from transport._plugins import Attempt, Outcome, PluginError, Pod, UserError, make_plugins
from transport._pool import PythonPlugin
from transport._process_plugin import ProcessPlugin, find_memory_cgroup, pod_log_path
from transport._sim_plugin import SimPlugin

_keys = itertools.count(1)


def make_attempt(tmp_path, execute, *, groups=None, memory_limit=None, reuse=None, env=None,
                 attempt=1, input_ref=None, key=None):
    """An Attempt as the worker builds it: a real ActionSpec with ``execute``, one Pod per
    replica of each group (``groups``: ``[(role, replicas)]``; None: one pod ``main/0``), the
    workdir created and the log's directory too."""
    data = {"id": "t/p/d/r/a", "task": "t", "execute": execute}
    if groups is None:
        data["resources"] = {"cpu": 1}
        pods = (Pod("main", 0, {"cpu": 1}, memory_limit),)
    else:
        data["pods"] = [{"role": r, "replicas": n, "resources": {"cpu": 1}} for r, n in groups]
        pods = tuple(Pod(r, i, {"cpu": 1}, memory_limit) for r, n in groups for i in range(n))
    if reuse is not None:
        data["reuse"] = reuse
        data["environment"] = "env"
    spec = ActionSpec.from_dict(data)
    key = key if key is not None else next(_keys).to_bytes(8, "big")
    workdir = tmp_path / "work" / key.hex()
    workdir.mkdir(parents=True)
    log_path = tmp_path / "logs" / f"{key.hex()}.log"
    log_path.parent.mkdir(exist_ok=True)
    return Attempt(key, "t/p/d/r/a", attempt, spec, spec.execute, pods, workdir, log_path,
                   input_ref=input_ref, env=env)


def wait(plugin, until):
    """Sleep on the plugin's descriptors, or until its due time, but never past ``until``."""
    now = time.monotonic()
    due = plugin.due()
    left = until - now if due is None else min(due - now, until - now)
    left = max(0.0, min(left, 0.5))
    fds = plugin.fds()
    if fds:
        select.select(list(fds), [], [], left)
    elif left > 0:
        time.sleep(left)


def drive(plugin, keys, timeout=10.0):
    """Poll until every key in ``keys`` has a terminal change, at most ``timeout`` seconds;
    returns ``{key: [Change, ...]}`` (every change seen, any key)."""
    pending = set(keys)
    seen = collections.defaultdict(list)
    until = time.monotonic() + timeout
    while pending:
        assert time.monotonic() < until, f"no outcome within {timeout}s for {len(pending)}"
        wait(plugin, until)
        for change in plugin.poll():
            seen[change.key].append(change)
            if change.outcome is not None:
                pending.discard(change.key)
    return seen


def run_for(plugin, seconds):
    """Poll for ``seconds``; every change seen."""
    out = []
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        wait(plugin, until)
        out.extend(plugin.poll())
    return out


def outcome_of(changes):
    """The one terminal outcome in ``changes``, after a RUNNING (checked)."""
    terminal = [c for c in changes if c.outcome is not None]
    assert len(terminal) == 1, changes
    assert changes[-1] is terminal[0], "nothing comes after the outcome"
    return terminal[0].outcome


def children_left():
    return [p for p in psutil.Process().children(recursive=True) if p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]


@pytest.fixture
def plugins():
    """Build plugins with ``plugins(cls, options)``; all are closed after the test, and no
    process they started may be left."""
    made = []

    def make(cls, options=None, **kw):
        plugin = cls(options, **kw)
        made.append(plugin)
        return plugin

    yield make
    for plugin in made:
        plugin.close(2.0)
    until = time.monotonic() + 3.0
    while children_left() and time.monotonic() < until:
        time.sleep(0.02)
    assert children_left() == [], "a plugin left processes behind after close()"


# ---------------------------------------------------------------------------------------------
# sim


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_sim_holds_each_attempt_for_its_duration(tmp_path, plugins):
    clock = FakeClock()
    sim = plugins(SimPlugin, {"seed": 1}, clock=clock)
    a = make_attempt(tmp_path, {"plugin": "sim", "duration": 5.0})
    b = make_attempt(tmp_path, {"plugin": "sim", "duration": [1.0, 2.0]})
    c = make_attempt(tmp_path, {"plugin": "sim"})          # duration 0
    for att in (a, b, c):
        sim.start(att)
    assert sim.due() <= clock.now                           # RUNNING to report
    first = sim.poll()
    # RUNNING for all three, and the zero-duration one's outcome in the same poll, after its
    # RUNNING.
    assert [(ch.key, ch.phase) for ch in first] == [
        (a.key, Phase.RUNNING), (b.key, Phase.RUNNING), (c.key, Phase.RUNNING),
        (c.key, Phase.SUCCEEDED)]
    b_due = sim.due()
    assert clock.now + 1.0 <= b_due <= clock.now + 2.0      # sampled in [low, high]
    clock.now = b_due - 1e-6
    assert sim.poll() == []
    clock.now = b_due
    assert [(ch.key, ch.phase) for ch in sim.poll()] == [(b.key, Phase.SUCCEEDED)]
    assert sim.due() == 105.0
    clock.now = 104.999
    assert sim.poll() == []
    clock.now = 105.0
    [done] = sim.poll()
    assert (done.key, done.outcome) == (a.key, Outcome.succeeded())
    assert sim.due() is None and sim.running() == 0


def test_sim_seed_makes_the_sampled_durations_repeatable(tmp_path, plugins):
    atts = [make_attempt(tmp_path, {"plugin": "sim", "duration": [0.0, 100.0]})
            for _ in range(5)]

    def dues(seed):
        clock = FakeClock()
        sim = plugins(SimPlugin, {"seed": seed}, clock=clock)
        out = []
        for att in atts:
            sim.start(att)
            sim.poll()
            out.append(sim.due() - clock.now)
            clock.now = sim.due()
            assert sim.poll()[0].outcome == Outcome.succeeded()
        return out

    assert dues(7) == dues(7)
    assert dues(7) != dues(8)


def test_sim_declared_failures_and_fail_attempts(tmp_path, plugins):
    clock = FakeClock()
    sim = plugins(SimPlugin, clock=clock)
    user = [make_attempt(tmp_path, {"plugin": "sim", "fail": "USER", "fail_attempts": 2},
                         attempt=n) for n in (1, 2, 3)]
    system = [make_attempt(tmp_path, {"plugin": "sim", "fail": "SYSTEM:OOM"}, attempt=n)
              for n in (1, 7)]
    gang = make_attempt(tmp_path, {"plugin": "sim", "fail": "SYSTEM:EVICTED"},
                        groups=[("head", 1), ("worker", 3)])
    for att in (*user, *system, gang):
        sim.start(att)
    got = {ch.key: ch.outcome for ch in sim.poll() if ch.outcome is not None}
    for att in user[:2]:
        out = got[att.key]
        assert (out.phase, out.error_kind, out.cause) == (Phase.FAILED, "USER", None)
        assert "declared sim failure" in out.message and out.pod is None
    assert got[user[2].key].phase == Phase.SUCCEEDED        # past fail_attempts
    for att in system:                                      # no fail_attempts: every attempt
        out = got[att.key]
        assert (out.phase, out.error_kind, out.cause) == (Phase.FAILED, "SYSTEM", "OOM")
    out = got[gang.key]
    assert (out.error_kind, out.cause, out.pod) == ("SYSTEM", "EVICTED", "worker/2")
    assert "worker/2" in out.message


def test_sim_start_many_is_start_of_each_and_refuses_a_duplicate_alone(tmp_path, plugins):
    """The worker starts a fan-out's attempts with one start_many: the same changes as a
    start of each, in the same order, durations and declared failures included; an
    attempt already running is returned as failed and the others start."""
    specs = [{"plugin": "sim"}, {"plugin": "sim", "duration": 3.0},
             {"plugin": "sim", "fail": "SYSTEM:OOM"}, {"plugin": "sim", "duration": [1.0, 2.0]}]
    atts = [make_attempt(tmp_path, x) for x in specs]

    def run(start):
        clock = FakeClock()
        sim = plugins(SimPlugin, {"seed": 3}, clock=clock)
        failed = start(sim)
        seen = []
        while sim.due() is not None:
            clock.now = max(clock.now, sim.due())
            seen += [(ch.key, ch.phase, ch.outcome and ch.outcome.cause, clock.now)
                     for ch in sim.poll()]
        return failed, seen

    def one_by_one(sim):
        for att in atts:
            sim.start(att)
        return []

    def together(sim):
        return sim.start_many([*atts[:2], atts[0], *atts[2:]])

    failed, seen = run(together)
    assert run(one_by_one) == ([], seen)
    assert [(a.key, type(e).__name__) for a, e in failed] == [(atts[0].key, "PluginError")]
    assert (atts[2].key, Phase.FAILED, "OOM", 100.0) in seen


def test_sim_a_stopped_attempt_is_never_reported(tmp_path, plugins):
    clock = FakeClock()
    sim = plugins(SimPlugin, clock=clock)
    a = make_attempt(tmp_path, {"plugin": "sim", "duration": 1.0})
    b = make_attempt(tmp_path, {"plugin": "sim", "duration": 2.0})
    z = make_attempt(tmp_path, {"plugin": "sim"})
    for att in (a, b, z):
        sim.start(att)
    sim.stop(z.key, "refused")                              # before its first poll
    assert [ch.key for ch in sim.poll()] == [a.key, b.key]  # RUNNING of a and b only
    sim.stop(a.key, "refused")
    clock.now += 10
    assert [(ch.key, ch.phase) for ch in sim.poll()] == [(b.key, Phase.SUCCEEDED)]
    assert sim.poll() == [] and sim.due() is None


def test_sim_stopping_many_long_attempts_keeps_the_heap_small(tmp_path, plugins):
    sim = plugins(SimPlugin, clock=FakeClock())
    ex = {"plugin": "sim", "duration": 3600.0}
    spec = make_attempt(tmp_path, ex)
    atts = [Attempt(i.to_bytes(8, "big"), spec.action, 1, spec.spec, spec.execute, spec.pods,
                    spec.workdir, spec.log_path) for i in range(5000)]
    for att in atts:
        sim.start(att)
    sim.poll()
    for att in atts[:4900]:
        sim.stop(att.key, "refused")
    assert sim.running() == 100
    assert len(sim._heap) < 2600                            # rebuilt, not 5000 entries


def test_sim_100k_zero_duration_attempts_all_complete(tmp_path, plugins):
    sim = plugins(SimPlugin)
    one = make_attempt(tmp_path, {"plugin": "sim"})
    n = 100_000
    running, done = collections.Counter(), collections.Counter()
    for lo in range(0, n, 5000):
        for i in range(lo, lo + 5000):
            sim.start(Attempt(i.to_bytes(8, "big"), one.action, 1, one.spec, one.execute,
                              one.pods, one.workdir, one.log_path))
        for ch in sim.poll():
            if ch.phase == Phase.RUNNING:
                assert ch.key not in done
                running[ch.key] += 1
            else:
                assert ch.outcome.phase == Phase.SUCCEEDED
                done[ch.key] += 1
    assert len(done) == n and set(done.values()) == {1}
    assert len(running) == n and set(running.values()) == {1}
    assert sim.running() == 0 and sim.due() is None


# ---------------------------------------------------------------------------------------------
# process

PY = sys.executable


def proc(*argv, env=None):
    ex = {"plugin": "process", "command": list(argv)}
    if env is not None:
        ex["env"] = env
    return ex


def py(code, env=None):
    return proc(PY, "-c", code, env=env)


def wait_for_file(path, timeout=5.0):
    until = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < until, f"{path} never written"
        time.sleep(0.01)
    return path.read_text()


def gone(pids, timeout):
    """Whether every pid in ``pids`` has exited (reaped or a zombie) within ``timeout``."""
    until = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() >= until:
            return not alive
        time.sleep(0.01)


def test_process_success_env_cwd_and_log(tmp_path, plugins):
    plugin = plugins(ProcessPlugin)
    code = ("import os, sys; print('to stdout'); print('to stderr', file=sys.stderr); "
            "open('env.txt', 'w').write(repr({k: v for k, v in os.environ.items() "
            "if k.startswith(('LEASEHOLD_', 'MY_'))})); open('cwd.txt', 'w').write(os.getcwd())")
    att = make_attempt(tmp_path, py(code, env={"MY_VAR": "42"}), attempt=3,
                       input_ref="s3://in/put")
    t0 = time.monotonic()
    plugin.start(att)
    assert time.monotonic() - t0 < 0.5                      # start does not wait for it
    changes = drive(plugin, [att.key])[att.key]
    assert [c.phase for c in changes] == [Phase.RUNNING, Phase.SUCCEEDED]
    env = eval((att.workdir / "env.txt").read_text())
    env.pop("LEASEHOLD_DEBUG", None)    # the debug build's switch, inherited like any other
    assert env == {"MY_VAR": "42", "LEASEHOLD_ACTION": "t/p/d/r/a", "LEASEHOLD_ATTEMPT": "3",
                   "LEASEHOLD_POD_ROLE": "main", "LEASEHOLD_POD_INDEX": "0",
                   "LEASEHOLD_GANG_SIZE": "1", "LEASEHOLD_INPUT": "s3://in/put"}
    assert (att.workdir / "cwd.txt").read_text() == str(att.workdir)
    text = att.log_path.read_text()
    assert "to stdout" in text and "to stderr" in text


def test_process_nonzero_exit_is_user_with_code_and_log_tail(tmp_path, plugins):
    plugin = plugins(ProcessPlugin)
    code = ("import sys\nfor i in range(200): print(f'line {i}', file=sys.stderr)\n"
            "sys.exit(3)")
    att = make_attempt(tmp_path, py(code))
    plugin.start(att)
    out = outcome_of(drive(plugin, [att.key])[att.key])
    assert (out.phase, out.error_kind, out.pod) == (Phase.FAILED, "USER", None)
    assert "exited with code 3" in out.message
    assert "line 199" in out.message and "line 180" in out.message
    assert "line 150" not in out.message                    # a tail, not the log
    assert len(out.message) < 2500


def test_process_command_not_found_or_not_executable_is_a_user_error(tmp_path, plugins):
    plugin = plugins(ProcessPlugin)
    with pytest.raises(UserError, match="no-such-command-xyz.*not found"):
        plugin.start(make_attempt(tmp_path, proc("no-such-command-xyz", "arg")))
    script = tmp_path / "not-executable.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    with pytest.raises(UserError, match="not-executable"):
        plugin.start(make_attempt(tmp_path, proc(str(script))))
    # Said as what it is (the OS says "Permission denied" of a directory, and "not found" of
    # a script whose interpreter is missing); not a program at all is the user's too (it was
    # a system error, retried).
    with pytest.raises(UserError, match="cannot be run: it is a directory"):
        plugin.start(make_attempt(tmp_path, proc(str(tmp_path))))
    orphan = tmp_path / "orphan.sh"
    orphan.write_text("#!/no/such/interpreter\nexit 0\n")
    orphan.chmod(0o755)
    with pytest.raises(UserError, match=r"not found \(its #! interpreter\?\)"):
        plugin.start(make_attempt(tmp_path, proc(str(orphan))))
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"\x00\x01\x02 not a program")
    garbage.chmod(0o755)
    with pytest.raises(UserError, match="cannot be run: Exec format error"):
        plugin.start(make_attempt(tmp_path, proc(str(garbage))))
    assert plugin.poll() == [] and children_left() == []


def test_process_missing_workdir_is_a_system_error_not_a_missing_command(tmp_path, plugins):
    plugin = plugins(ProcessPlugin)
    att = make_attempt(tmp_path, proc("true"))
    att.workdir.rmdir()
    with pytest.raises(PluginError, match="workdir") as info:
        plugin.start(att)
    assert not isinstance(info.value, UserError)


def test_process_killed_by_a_signal_is_system_killed(tmp_path, plugins):
    plugin = plugins(ProcessPlugin)
    att = make_attempt(tmp_path, py("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"))
    plugin.start(att)
    out = outcome_of(drive(plugin, [att.key])[att.key])
    assert (out.error_kind, out.cause) == ("SYSTEM", "KILLED")
    assert "SIGKILL" in out.message


def test_process_memory_limit_breach_is_system_oom(tmp_path, plugins):
    plugin = plugins(ProcessPlugin)
    assert plugin.memory_mechanism in ("rss",) or plugin.memory_mechanism.startswith("cgroup:")
    limit = 50 * 2**20
    hog = make_attempt(tmp_path, py("import time; x = 'x' * (200 * 2**20); time.sleep(30)"),
                       memory_limit=limit)
    small = make_attempt(tmp_path, py("import time; time.sleep(0.3)"), memory_limit=limit)
    plugin.start(hog)
    plugin.start(small)
    seen = drive(plugin, [hog.key, small.key])
    out = outcome_of(seen[hog.key])
    assert (out.phase, out.error_kind, out.cause) == (Phase.FAILED, "SYSTEM", "OOM")
    assert "50.0 MiB" in out.message
    assert outcome_of(seen[small.key]).phase == Phase.SUCCEEDED   # under the limit: runs


def test_process_a_pod_writing_past_max_log_bytes_is_stopped_as_a_user_failure(tmp_path,
                                                                              plugins):
    plugin = plugins(ProcessPlugin, {"max_log_bytes": 64 * 1024, "log_interval": 0.05})
    chatty = make_attempt(tmp_path, py("import sys, time\n"
                                       "for _ in range(2000):\n"
                                       "    sys.stdout.write('x' * 1023 + '\\n'); "
                                       "sys.stdout.flush(); time.sleep(0.001)\n"
                                       "time.sleep(30)"))
    quiet = make_attempt(tmp_path, py("import time; print('y' * 1000); time.sleep(0.5)"))
    plugin.start(chatty)
    plugin.start(quiet)
    t0 = time.monotonic()
    seen = drive(plugin, [chatty.key, quiet.key])
    out = outcome_of(seen[chatty.key])
    assert (out.phase, out.error_kind) == (Phase.FAILED, "USER")
    assert str(chatty.log_path) in out.message and "65536 bytes" in out.message, out.message
    assert "worker.max_log_bytes" in out.message
    assert time.monotonic() - t0 < 10      # stopped, not left to its 30 s sleep
    assert outcome_of(seen[quiet.key]).phase == Phase.SUCCEEDED      # under the limit
    # Bounded by the check's period: ~1 KiB a ms written, checked every 50 ms.
    assert chatty.log_path.stat().st_size < 64 * 1024 + 1024 * 1024


def test_process_max_log_bytes_zero_is_no_limit_and_bad_values_are_refused(tmp_path, plugins):
    plugin = plugins(ProcessPlugin, {"max_log_bytes": 0, "log_interval": 0.01})
    att = make_attempt(tmp_path, py("print('z' * 200000)"))
    plugin.start(att)
    assert outcome_of(drive(plugin, [att.key])[att.key]).phase == Phase.SUCCEEDED
    assert plugin.due() is None     # nothing runs: no check is due
    for bad in ({"max_log_bytes": -1}, {"max_log_bytes": "1Gi"}, {"log_interval": 0}):
        with pytest.raises(PluginError, match="max_log_bytes|log_interval") as err:
            ProcessPlugin(bad)
        assert err.value.cause == "CONFIG"


def test_process_stop_kills_the_process_group_and_never_reports(tmp_path, plugins):
    plugin = plugins(ProcessPlugin, {"kill_grace": 5.0})
    # A shell with a child of its own: both are in the pod's process group.
    att = make_attempt(tmp_path, proc("sh", "-c", "sleep 60 & echo $! > bg.pid; sleep 60"))
    plugin.start(att)
    assert [c.phase for c in plugin.poll()] == [Phase.RUNNING]
    bg = int(wait_for_file(att.workdir / "bg.pid"))
    pids = [p.pid for p in children_left()]
    assert bg in pids and len(pids) == 3               # sh, the background and the foreground sleep
    t0 = time.monotonic()
    plugin.stop(att.key, "refused")
    assert time.monotonic() - t0 < 0.1                      # signals, does not wait
    late = run_for(plugin, 0.5)
    assert gone(pids, 1.0)                                  # SIGTERM took the whole group
    assert [c for c in late + run_for(plugin, 0.2) if c.key == att.key] == []


def test_process_exit_kills_what_the_pod_left_in_its_group(tmp_path, plugins):
    plugin = plugins(ProcessPlugin)
    att = make_attempt(tmp_path, proc("sh", "-c", "sleep 60 & echo $! > bg.pid"))
    plugin.start(att)
    assert outcome_of(drive(plugin, [att.key])[att.key]).phase == Phase.SUCCEEDED
    assert gone([int((att.workdir / "bg.pid").read_text())], 1.0)


def test_process_stop_kills_after_the_grace_when_sigterm_is_ignored(tmp_path, plugins):
    plugin = plugins(ProcessPlugin, {"kill_grace": 0.4})
    code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "open('ready', 'w').write('1'); time.sleep(60)")
    att = make_attempt(tmp_path, py(code))
    plugin.start(att)
    wait_for_file(att.workdir / "ready")
    [pid] = [p.pid for p in children_left()]
    plugin.stop(att.key, "timeout")
    t0 = time.monotonic()
    assert run_for(plugin, 0.2) == []
    assert psutil.pid_exists(pid)                           # the grace is honoured
    assert plugin.due() is not None and plugin.due() <= t0 + 0.45   # the SIGKILL is due
    changes = run_for(plugin, 0.6)
    assert gone([pid], 0.5) and changes == []


def test_process_gang_starts_together_one_log_per_pod(tmp_path, plugins):
    plugin = plugins(ProcessPlugin)
    code = ("import os, time; open(os.environ['LEASEHOLD_POD_ROLE'] + '-' + "
            "os.environ['LEASEHOLD_POD_INDEX'] + '.t', 'w').write(repr(time.time())); "
            "print('pod', os.environ['LEASEHOLD_POD_ROLE'], os.environ['LEASEHOLD_POD_INDEX'],"
            " os.environ['LEASEHOLD_GANG_SIZE']); time.sleep(0.2)")
    att = make_attempt(tmp_path, py(code), groups=[("head", 1), ("worker", 3)])
    plugin.start(att)
    changes = drive(plugin, [att.key])[att.key]
    assert [c.phase for c in changes] == [Phase.RUNNING, Phase.SUCCEEDED]
    names = ["head-0", "worker-0", "worker-1", "worker-2"]
    times = [float((att.workdir / f"{n}.t").read_text()) for n in names]
    assert max(times) - min(times) < 1.0
    index = att.log_path.read_text()
    for pod in att.pods:
        path = pod_log_path(att, pod)
        assert path.name == f"{att.key.hex()}.{pod.role}-{pod.index}.log"
        assert path.read_text() == f"pod {pod.role} {pod.index} 4\n"
        assert f"pod {pod.name}: pid " in index and str(path) in index


def test_process_gang_one_failing_pod_fails_it_and_stops_the_others(tmp_path, plugins):
    plugin = plugins(ProcessPlugin, {"kill_grace": 5.0})
    code = ("import os, sys, time\n"
            "if os.environ['LEASEHOLD_POD_INDEX'] == '2':\n"
            "    time.sleep(0.3); print('worker two fails', file=sys.stderr); sys.exit(5)\n"
            "time.sleep(60)")
    att = make_attempt(tmp_path, py(code), groups=[("worker", 4)])
    plugin.start(att)
    assert [c.phase for c in plugin.poll()] == [Phase.RUNNING]
    pids = [p.pid for p in children_left()]
    assert len(pids) == 4
    out = outcome_of(drive(plugin, [att.key])[att.key])
    assert (out.error_kind, out.pod) == ("USER", "worker/2")
    assert "pod worker/2" in out.message and "code 5" in out.message
    assert "worker two fails" in out.message
    late = run_for(plugin, 0.3)
    assert gone(pids, 1.0)                                  # the others were stopped
    assert late == []


def test_process_gang_pods_that_exit_at_once_with_one_failing_fail_it_once(tmp_path, plugins):
    # Every pod exits before the plugin looks: the failing pod ends the gang and stops its
    # siblings, which are in the same batch of exits (the case that once raised).
    plugin = plugins(ProcessPlugin)
    code = "import os, sys; sys.exit(3 if os.environ['LEASEHOLD_POD_INDEX'] == '0' else 0)"
    att = make_attempt(tmp_path, py(code), groups=[("worker", 4)])
    plugin.start(att)
    deadline = time.monotonic() + 10
    while len(children_left()) and time.monotonic() < deadline:
        time.sleep(0.02)            # all four are zombies now, none reaped yet
    changes = drive(plugin, [att.key])[att.key]
    # (Polling before the exits raced them: a pod could exit before the first poll.)
    assert [c.phase for c in changes] == [Phase.RUNNING, Phase.FAILED]
    out = outcome_of(changes)
    assert out.phase == Phase.FAILED and out.pod == "worker/0"
    assert run_for(plugin, 0.2) == []


def test_process_gang_spawn_failure_kills_the_pods_already_started(tmp_path, plugins):
    plugin = plugins(ProcessPlugin)
    real = plugin._reaper.spawn
    pids = []

    def failing_third(*args, **kw):
        if len(pids) == 2:
            raise FileNotFoundError(2, "No such file or directory", "sleep")
        group = real(*args, **kw)
        pids.append(group.pid)
        return group

    plugin._reaper.spawn = failing_third
    att = make_attempt(tmp_path, proc("sleep", "60"), groups=[("worker", 4)])
    with pytest.raises(UserError, match="pod worker/2"):
        plugin.start(att)
    assert len(pids) == 2
    assert run_for(plugin, 0.3) == []
    assert gone(pids, 1.0)


def test_process_without_pidfd_polls_through_due(tmp_path, plugins):
    plugin = plugins(ProcessPlugin, {"pidfd": False, "poll_interval": 0.02})
    assert plugin.fds() == () or all(isinstance(fd, int) for fd in plugin.fds())
    att = make_attempt(tmp_path, py("import time; time.sleep(0.2)"))
    plugin.start(att)
    plugin.poll()
    assert plugin.due() is not None and plugin.due() - time.monotonic() <= 0.05
    out = outcome_of(drive(plugin, [att.key])[att.key])
    assert out.phase == Phase.SUCCEEDED


def test_process_close_stops_everything(tmp_path, plugins):
    plugin = plugins(ProcessPlugin, {"kill_grace": 10.0})
    ignore = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              "time.sleep(60)")
    for code in ("import time; time.sleep(60)", ignore):
        plugin.start(make_attempt(tmp_path, py(code)))
    time.sleep(0.3)
    assert len(children_left()) == 2
    t0 = time.monotonic()
    plugin.close(0.5)                                       # SIGTERM, then SIGKILL at 0.5 s
    assert time.monotonic() - t0 < 2.0
    assert children_left() == []


def test_find_memory_cgroup_reads_the_v2_hierarchy(tmp_path):
    root = tmp_path / "cg"
    (root / "work").mkdir(parents=True)
    (root / "work" / "cgroup.subtree_control").write_text("cpu memory\n")
    cg = tmp_path / "cgroup"
    cg.write_text("0::/work\n")
    mi = tmp_path / "mountinfo"
    mi.write_text(f"41 31 0:38 / {root} rw,relatime - cgroup2 cgroup2 rw\n")
    assert find_memory_cgroup(cg, mi) == (root / "work", None)
    (root / "work" / "cgroup.subtree_control").write_text("cpu\n")
    path, why = find_memory_cgroup(cg, mi)
    assert path is None and "memory controller is not enabled" in why
    # The usual delegation: the worker in a leaf, the pods next to it.
    (root / "work" / "worker").mkdir()
    cg.write_text("0::/work/worker\n")
    (root / "work" / "worker" / "cgroup.subtree_control").write_text("")
    (root / "work" / "cgroup.subtree_control").write_text("cpu memory pids\n")
    assert find_memory_cgroup(cg, mi) == (root / "work", None)
    cg.write_text("4:memory:/x\n")
    assert find_memory_cgroup(cg, mi)[0] is None
    # This machine, whatever it is: an answer, with a reason when there is no cgroup.
    path, why = find_memory_cgroup()
    assert (path is None) != (why is None)


def test_process_cgroup_mode_sets_memory_max_and_reports_a_kernel_oom_kill(tmp_path, plugins,
                                                                          monkeypatch):
    # A directory that looks like a delegated cgroup v2: the plugin writes the pod's limit
    # and moves the pod in (here plain files), and reads memory.events at exit.
    base = tmp_path / "cg"
    base.mkdir()
    (base / "cgroup.subtree_control").write_text("memory\n")
    with pytest.raises(PluginError, match="cgroup.subtree_control"):
        ProcessPlugin({"cgroup": str(tmp_path)})
    plugin = plugins(ProcessPlugin, {"cgroup": str(base)})
    assert plugin.memory_mechanism == f"cgroup:{base}"
    real_init = _process_plugin._Cgroup.__init__

    def init(self, *args):
        real_init(self, *args)
        (self.path / "cgroup.procs").touch()                # the kernel's file, faked

    monkeypatch.setattr(_process_plugin._Cgroup, "__init__", init)
    att = make_attempt(tmp_path, proc("sleep", "60"), memory_limit=64 * 2**20)
    plugin.start(att)
    [pod_cg] = list(base.glob("leasehold-*"))
    assert (pod_cg / "memory.max").read_text() == f"{64 * 2**20}\n"
    assert (pod_cg / "cgroup.procs").read_text() == "0\n"   # written by the pod itself
    (pod_cg / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 1\noom_kill 1\n")
    [pid] = [p.pid for p in children_left()]
    os.kill(pid, signal.SIGKILL)                            # as the kernel would
    out = outcome_of(drive(plugin, [att.key])[att.key])
    assert (out.error_kind, out.cause) == ("SYSTEM", "OOM")
    assert "64.0 MiB" in out.message and "OOM killer" in out.message
    for f in pod_cg.iterdir():                              # the kernel's files, faked
        f.unlink()
    run_for(plugin, 0.1)
    assert not pod_cg.exists()                              # removed once empty


# ---------------------------------------------------------------------------------------------
# python

FUNCS = """
import os, sys, threading, time

# One line per import of this module: a warm pool imports it once per process.
with open(os.environ["LH_IMPORTS"], "a") as f:
    f.write(f"{os.getpid()}\\n")

_lock = threading.Lock()
_running = 0


def ok(x=1, inputs=None):
    print("hello from", os.getpid(), "x =", x, "inputs =", inputs)
    print("on stderr", file=sys.stderr)
    return {"doubled": x * 2}


def boom(word="kaput"):
    def inner():
        raise ValueError(f"bad value {word}")
    inner()


def whoami(path):
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\\n")


def which_thread(path):
    import threading
    with open(path, "a") as f:
        f.write(f"{os.getpid()} {threading.get_native_id()}\\n")


def overlap(path, secs=0.15):
    global _running
    with _lock:
        _running += 1
        now = _running
    with open(path, "a") as f:
        f.write(f"{now}\\n")
    time.sleep(secs)
    with _lock:
        _running -= 1


def sleep(secs):
    time.sleep(secs)


def scribble():
    # Writes on the result pipe (its descriptor is the child's second argument).
    os.write(int(sys.argv[2]), b"\\xff\\xff\\xff\\xff")
    time.sleep(30)


def binary_out():
    sys.stdout.buffer.write(b"raw bytes\\n")
    sys.stdout.flush()


def chatter(lines):
    for _ in range(lines):
        print("x" * 1023, flush=True)
        time.sleep(0.001)
    time.sleep(30)


def hog(mb, secs):
    x = "x" * (mb * 2**20)
    time.sleep(secs)
    return len(x)


class _BadRepr:
    def __repr__(self):
        raise ValueError("repr fails")


def bad_repr():
    return _BadRepr()
"""


@pytest.fixture
def funcs(tmp_path):
    """The execute table of a function in a module the pool imports (``execute.imports``:
    the file each import of the module appends its pid to)."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "lh_test_funcs.py").write_text(FUNCS)
    imports = tmp_path / "imports.txt"
    imports.touch()

    def execute(name, **args):
        return {"plugin": "python", "function": f"lh_test_funcs:{name}", "args": args,
                "env": {"PYTHONPATH": str(mods), "LH_IMPORTS": str(imports)}}

    execute.imports = imports
    return execute


def imported_by(funcs):
    return funcs.imports.read_text().split()


def warm(replicas=1, concurrency=1, idle_ttl=60.0):
    return {"replicas": replicas, "concurrency": concurrency, "idle_ttl": idle_ttl}


def test_python_success_output_in_the_log_with_the_pid(tmp_path, plugins, funcs):
    plugin = plugins(PythonPlugin)
    att = make_attempt(tmp_path, funcs("ok", x=21), input_ref="s3://bucket/in")
    t0 = time.monotonic()
    plugin.start(att)
    assert time.monotonic() - t0 < 0.5
    changes = drive(plugin, [att.key])[att.key]
    assert [c.phase for c in changes] == [Phase.RUNNING, Phase.SUCCEEDED]
    [pid] = imported_by(funcs)
    text = att.log_path.read_text()
    assert f"pool process pid {pid}: lh_test_funcs:ok" in text
    assert f"hello from {pid} x = 21 inputs = s3://bucket/in" in text
    assert "on stderr" in text and "returned {'doubled': 42}" in text
    run_for(plugin, 0.2)
    assert plugin.pools() == [] and gone([int(pid)], 1.0)   # a pool of one, freed


def test_python_a_call_writing_past_max_log_bytes_fails_user_and_its_pool_mate_is_evicted(
        tmp_path, plugins, funcs):
    plugin = plugins(PythonPlugin, {"max_log_bytes": 64 * 1024, "log_interval": 0.05})
    pool = warm(replicas=1, concurrency=2)
    chatty = make_attempt(tmp_path, funcs("chatter", lines=2000), reuse=pool, env=b"e1")
    mate = make_attempt(tmp_path, funcs("sleep", secs=30), reuse=pool, env=b"e1")
    plugin.start(chatty)
    plugin.start(mate)
    seen = drive(plugin, [chatty.key, mate.key])
    out = outcome_of(seen[chatty.key])
    assert (out.phase, out.error_kind) == (Phase.FAILED, "USER")
    assert str(chatty.log_path) in out.message and "65536 bytes" in out.message, out.message
    evicted = outcome_of(seen[mate.key])
    assert (evicted.error_kind, evicted.cause) == ("SYSTEM", "EVICTED"), evicted


def test_python_a_return_value_whose_repr_raises_still_succeeds(tmp_path, plugins, funcs):
    # The value is ignored; its repr raising was taken for a failure to open the log and the
    # call ran again as a system error.
    plugin = plugins(PythonPlugin)
    att = make_attempt(tmp_path, funcs("bad_repr"))
    plugin.start(att)
    changes = drive(plugin, [att.key])[att.key]
    assert [c.phase for c in changes] == [Phase.RUNNING, Phase.SUCCEEDED]
    assert "returned a _BadRepr (its repr raised ValueError)" in att.log_path.read_text()


def test_process_a_last_line_longer_than_the_tail_is_shown_cut(tmp_path, plugins):
    plugin = plugins(ProcessPlugin)
    att = make_attempt(tmp_path, py("raise ValueError('bad config: ' + 'k=v,' * 1000)"))
    plugin.start(att)
    out = outcome_of(drive(plugin, [att.key])[att.key])
    assert out.error_kind == "USER" and "exited with code 1" in out.message
    tail = out.message.split("tail of its log", 1)[1]
    assert "k=v,k=v," in tail and "\u2026" in tail      # its end, marked as cut


def test_python_exception_is_user_with_the_traceback_tail(tmp_path, plugins, funcs):
    plugin = plugins(PythonPlugin)
    att = make_attempt(tmp_path, funcs("boom", word="zonk"))
    plugin.start(att)
    out = outcome_of(drive(plugin, [att.key])[att.key])
    assert (out.phase, out.error_kind, out.recoverable) == (Phase.FAILED, "USER", True)
    assert "lh_test_funcs:boom raised ValueError: bad value zonk" in out.message
    assert "in inner" in out.message and 'raise ValueError(f"bad value {word}")' in out.message
    assert "_pool_child" not in out.message                 # from the function down
    assert "ValueError: bad value zonk" in att.log_path.read_text()


def test_python_unimportable_function_is_a_user_error_not_recoverable(tmp_path, plugins,
                                                                      funcs):
    plugin = plugins(PythonPlugin)
    att = make_attempt(tmp_path, {"plugin": "python", "function": "no_such_mod_xyz:f"})
    missing = make_attempt(tmp_path, funcs("no_such_function"))
    plugin.start(att)
    plugin.start(missing)
    seen = drive(plugin, [att.key, missing.key])
    out = outcome_of(seen[att.key])
    assert (out.error_kind, out.recoverable) == ("USER", False)
    assert "cannot import no_such_mod_xyz:f" in out.message
    assert "ModuleNotFoundError" in out.message
    out = outcome_of(seen[missing.key])
    assert "AttributeError" in out.message and not out.recoverable


def test_python_warm_pool_reuses_its_processes(tmp_path, plugins, funcs):
    plugin = plugins(PythonPlugin)
    pids = tmp_path / "pids.txt"
    reuse = warm(replicas=2, concurrency=2)
    atts = [make_attempt(tmp_path, funcs("whoami", path=str(pids)), reuse=reuse, env="E1")
            for _ in range(50)]
    first, rest = atts[:4], atts[4:]
    for att in first:
        plugin.start(att)
    [pool] = plugin.pools()
    assert pool.env == "E1" and len(pool.pids) == 2 and pool.busy == 4
    for changes in drive(plugin, [a.key for a in first]).values():
        assert outcome_of(changes).phase == Phase.SUCCEEDED
    for i in range(0, len(rest), 4):                        # follow-on actions, 4 at a time
        batch = rest[i:i + 4]
        for att in batch:
            plugin.start(att)
        for changes in drive(plugin, [a.key for a in batch]).values():
            assert [c.phase for c in changes] == [Phase.RUNNING, Phase.SUCCEEDED]
    ran_on = pids.read_text().split()
    assert len(ran_on) == 50
    assert set(map(int, ran_on)) == set(pool.pids)          # every call, the same two
    assert plugin.pools()[0].pids == pool.pids
    assert sorted(imported_by(funcs)) == sorted(map(str, pool.pids))   # imported once each


@pytest.mark.parametrize("concurrency", [1, 2])
def test_python_a_call_wakes_the_worker_with_its_outcome_and_says_running_by_its_due(
        tmp_path, plugins, funcs, concurrency):
    # A call's "started" wakes nobody (a short call's RUNNING comes with its outcome, one
    # wake); a call that goes on is still seen RUNNING, at the plugin's due time.
    plugin = plugins(PythonPlugin)
    reuse = warm(replicas=1, concurrency=concurrency)
    first = make_attempt(tmp_path, funcs("ok"), reuse=reuse, env=f"P{concurrency}")
    plugin.start(first)
    assert [c.phase for c in drive(plugin, [first.key])[first.key]] == [
        Phase.RUNNING, Phase.SUCCEEDED]
    assert plugin.due() > time.monotonic() + 30         # idle_ttl only: no progress to read
    att = make_attempt(tmp_path, funcs("sleep", secs=0.6), reuse=reuse, env=f"P{concurrency}")
    plugin.start(att)
    assert plugin.due() <= time.monotonic() + 0.01      # its progress is read soon
    readable, _, _ = select.select(list(plugin.fds()), [], [], 0.3)
    assert readable == []                               # started, and nobody woken
    assert [c.phase for c in plugin.poll()] == [Phase.RUNNING]
    assert plugin.due() is None or plugin.due() > time.monotonic()
    changes = drive(plugin, [att.key])[att.key]
    assert [c.phase for c in changes] == [Phase.SUCCEEDED]
    path = tmp_path / f"threads{concurrency}.txt"
    for _ in range(3):
        one = make_attempt(tmp_path, funcs("which_thread", path=str(path)), reuse=reuse,
                           env=f"P{concurrency}")
        plugin.start(one)
        assert [c.phase for c in drive(plugin, [one.key])[one.key]] == [
            Phase.RUNNING, Phase.SUCCEEDED]
    rows = [line.split() for line in path.read_text().splitlines()]
    assert len({tid for _pid, tid in rows}) == 1        # one kept call thread ...
    assert all(pid != tid for pid, tid in rows)         # ... not the process's main one


def test_python_warm_pool_respects_concurrency_slots(tmp_path, plugins, funcs):
    plugin = plugins(PythonPlugin)
    path = tmp_path / "overlap.txt"
    reuse = warm(replicas=1, concurrency=2)
    atts = [make_attempt(tmp_path, funcs("overlap", path=str(path)), reuse=reuse, env="E2")
            for _ in range(6)]
    for att in atts:
        plugin.start(att)
    busiest = 0
    pending = {a.key for a in atts}
    until = time.monotonic() + 10
    while pending:
        assert time.monotonic() < until
        wait(plugin, until)
        for c in plugin.poll():
            if c.outcome is not None:
                assert c.outcome.phase == Phase.SUCCEEDED
                pending.discard(c.key)
        busiest = max(busiest, plugin.pools()[0].busy)
    seen = [int(n) for n in path.read_text().split()]
    assert len(seen) == 6 and max(seen) == 2                # two at once, never three
    assert busiest == 2


def test_python_follow_on_calls_reuse_the_pool_processes_threads(tmp_path, plugins, funcs):
    # A pool process keeps the threads its calls ran on: follow-on calls start none (at
    # most as many threads as calls ran at once, the pool's concurrency).
    plugin = plugins(PythonPlugin)
    path = tmp_path / "threads.txt"
    reuse = warm(replicas=1, concurrency=2)
    for _ in range(10):
        batch = [make_attempt(tmp_path, funcs("which_thread", path=str(path)), reuse=reuse,
                              env="E3") for _ in range(2)]
        for att in batch:
            plugin.start(att)
        for changes in drive(plugin, [a.key for a in batch]).values():
            assert outcome_of(changes).phase == Phase.SUCCEEDED
    rows = [line.split() for line in path.read_text().splitlines()]
    assert len(rows) == 20 and len({pid for pid, _tid in rows}) == 1
    assert 1 <= len({tid for _pid, tid in rows}) <= 2


def test_python_idle_ttl_frees_the_pool(tmp_path, plugins, funcs):
    plugin = plugins(PythonPlugin)
    att = make_attempt(tmp_path, funcs("ok"), reuse=warm(idle_ttl=0.3), env="E3")
    plugin.start(att)
    drive(plugin, [att.key])
    [pool] = plugin.pools()
    done = time.monotonic()
    assert plugin.due() is not None and plugin.due() <= done + 0.31
    run_for(plugin, 0.1)
    assert plugin.pools() != []                             # kept warm for idle_ttl
    until = time.monotonic() + 3
    while plugin.pools() and time.monotonic() < until:
        wait(plugin, until)
        plugin.poll()
    assert plugin.pools() == [] and time.monotonic() - done >= 0.3
    assert gone(pool.pids, 2.0)
    again = make_attempt(tmp_path, funcs("ok"), reuse=warm(idle_ttl=0.3), env="E3")
    plugin.start(again)                                     # a new pool for the same env
    assert plugin.pools()[0].pids != pool.pids
    drive(plugin, [again.key])


@pytest.mark.parametrize("pidfd", [True, False])
def test_python_a_pool_process_killed_mid_call_is_system_and_replaced(tmp_path, plugins,
                                                                      funcs, pidfd):
    plugin = plugins(PythonPlugin, {"pidfd": pidfd})
    reuse = warm(replicas=1, concurrency=2)
    atts = [make_attempt(tmp_path, funcs("sleep", secs=30), reuse=reuse, env="E4")
            for _ in range(2)]
    for att in atts:
        plugin.start(att)
    [old] = plugin.pools()[0].pids
    started = [c.key for c in run_for(plugin, 0.5) if c.phase == Phase.RUNNING]
    assert sorted(started) == sorted(a.key for a in atts)
    os.kill(old, signal.SIGKILL)
    seen = drive(plugin, [a.key for a in atts])
    for att in atts:
        out = outcome_of(seen[att.key])
        assert (out.error_kind, out.cause) == ("SYSTEM", "KILLED")
        assert f"pid {old} killed by SIGKILL" in out.message
    [new] = plugin.pools()[0].pids
    assert new != old
    follow = make_attempt(tmp_path, funcs("ok"), reuse=reuse, env="E4")
    plugin.start(follow)
    assert outcome_of(drive(plugin, [follow.key])[follow.key]).phase == Phase.SUCCEEDED
    assert f"pid {new}:" in follow.log_path.read_text()


def test_python_memory_breach_kills_the_pool_process_and_its_calls(tmp_path, plugins, funcs):
    plugin = plugins(PythonPlugin)
    reuse = warm(replicas=1, concurrency=2)
    limit = 50 * 2**20
    small = make_attempt(tmp_path, funcs("sleep", secs=30), reuse=reuse, env="E5",
                         memory_limit=limit)
    hog = make_attempt(tmp_path, funcs("hog", mb=200, secs=30), reuse=reuse, env="E5",
                       memory_limit=limit)
    plugin.start(small)
    plugin.start(hog)
    [old] = plugin.pools()[0].pids
    seen = drive(plugin, [small.key, hog.key])
    for att in (small, hog):
        out = outcome_of(seen[att.key])
        assert (out.error_kind, out.cause) == ("SYSTEM", "OOM")
        assert "50.0 MiB" in out.message and f"pid {old}" in out.message
    assert gone([old], 1.0)
    assert plugin.pools()[0].pids != (old,)                 # replaced
    # Under the limit, a call runs to completion in the replacement.
    ok = make_attempt(tmp_path, funcs("ok"), reuse=reuse, env="E5", memory_limit=limit)
    plugin.start(ok)
    assert outcome_of(drive(plugin, [ok.key])[ok.key]).phase == Phase.SUCCEEDED


def test_python_stop_kills_the_process_and_evicts_its_other_calls(tmp_path, plugins, funcs):
    plugin = plugins(PythonPlugin, {"kill_grace": 0.5})
    reuse = warm(replicas=1, concurrency=2)
    a, b = (make_attempt(tmp_path, funcs("sleep", secs=30), reuse=reuse, env="E6")
            for _ in range(2))
    waiting = make_attempt(tmp_path, funcs("ok"), reuse=reuse, env="E6")
    plugin.start(a)
    plugin.start(b)
    plugin.start(waiting)                                   # no slot: waits
    [old] = plugin.pools()[0].pids
    assert {c.key for c in run_for(plugin, 0.5) if c.phase == Phase.RUNNING} == {a.key, b.key}
    t0 = time.monotonic()
    plugin.stop(a.key, "refused")
    assert time.monotonic() - t0 < 0.2
    seen = drive(plugin, [b.key, waiting.key])
    out = outcome_of(seen[b.key])
    assert (out.error_kind, out.cause) == ("SYSTEM", "EVICTED")
    assert f"pid {old}" in out.message
    assert outcome_of(seen[waiting.key]).phase == Phase.SUCCEEDED   # on the replacement
    assert a.key not in seen and not [c for c in run_for(plugin, 0.3) if c.key == a.key]
    assert gone([old], 1.0)
    [new] = plugin.pools()[0].pids
    assert new != old and f"pid {new}:" in waiting.log_path.read_text()


def test_python_stop_of_a_waiting_call_leaves_the_pool_alone(tmp_path, plugins, funcs):
    plugin = plugins(PythonPlugin)
    reuse = warm(replicas=1, concurrency=1)
    running = make_attempt(tmp_path, funcs("sleep", secs=0.3), reuse=reuse, env="E7")
    queued = make_attempt(tmp_path, funcs("ok"), reuse=reuse, env="E7")
    plugin.start(running)
    plugin.start(queued)
    pids = plugin.pools()[0].pids
    plugin.stop(queued.key, "refused")
    seen = drive(plugin, [running.key])
    assert outcome_of(seen[running.key]).phase == Phase.SUCCEEDED
    assert queued.key not in seen and plugin.pools()[0].pids == pids
    assert not queued.log_path.exists()


def test_python_a_pool_that_cannot_start_fails_its_calls_and_is_freed(tmp_path, plugins,
                                                                      funcs):
    plugin = plugins(PythonPlugin)
    ex = funcs("ok")
    ex["env"]["PYTHONHOME"] = str(tmp_path / "no-such-home")   # the interpreter cannot start
    att = make_attempt(tmp_path, ex, reuse=warm(), env="E8")
    plugin.start(att)
    out = outcome_of(drive(plugin, [att.key])[att.key])
    assert (out.error_kind, out.cause) == ("SYSTEM", "KILLED")
    assert "before it was ready" in out.message
    until = time.monotonic() + 5                             # replaced, at most 3 times
    while plugin.pools() and time.monotonic() < until:
        wait(plugin, until)
        assert plugin.poll() == []
    assert plugin.pools() == []
    once = make_attempt(tmp_path, ex)
    plugin.start(once)
    out = outcome_of(drive(plugin, [once.key])[once.key])
    assert "before it was ready; tail of its output" in out.message
    assert "Fatal Python error" in out.message


def test_python_garbage_on_the_result_pipe_kills_the_process(tmp_path, plugins, funcs):
    plugin = plugins(PythonPlugin)
    att = make_attempt(tmp_path, funcs("scribble"), reuse=warm(), env="E9")
    plugin.start(att)
    [old] = plugin.pools()[0].pids
    out = outcome_of(drive(plugin, [att.key])[att.key])
    assert (out.error_kind, out.cause) == ("SYSTEM", "KILLED")
    assert "a frame of" in out.message
    assert gone([old], 1.0) and plugin.pools()[0].pids != (old,)


def test_python_a_call_can_write_bytes_to_stdout(tmp_path, plugins, funcs):
    plugin = plugins(PythonPlugin)
    att = make_attempt(tmp_path, funcs("binary_out"), reuse=warm(), env="E10")
    plugin.start(att)
    assert outcome_of(drive(plugin, [att.key])[att.key]).phase == Phase.SUCCEEDED
    assert "raw bytes" in att.log_path.read_text()


def test_python_close_leaves_no_process(tmp_path, plugins, funcs):
    plugin = plugins(PythonPlugin)
    plugin.start(make_attempt(tmp_path, funcs("sleep", secs=30)))
    for env in ("C1", "C2"):
        plugin.start(make_attempt(tmp_path, funcs("sleep", secs=30),
                                  reuse=warm(replicas=2), env=env))
    assert len(children_left()) == 5
    t0 = time.monotonic()
    plugin.close(1.0)
    assert time.monotonic() - t0 < 2.5
    assert children_left() == [] and plugin.pools() == []


# ---------------------------------------------------------------------------------------------
# the registry


def test_make_plugins_builds_the_three_with_their_options(tmp_path):
    got = make_plugins({"process": {"kill_grace": 0.25}, "sim": {"seed": 3}})
    try:
        assert {name: type(p) for name, p in got.items()} == {
            "process": ProcessPlugin, "python": PythonPlugin, "sim": SimPlugin}
        assert all(p.name == name for name, p in got.items())
        assert got["process"].kill_grace == 0.25 and got["python"].kill_grace == 2.0
    finally:
        for p in got.values():
            p.close(1.0)
    with pytest.raises(PluginError, match="unknown plugin.*k8s"):
        make_plugins({"k8s": {}})
    with pytest.raises(PluginError, match="unknown option.*bogus"):
        make_plugins({"python": {"bogus": 1}})
