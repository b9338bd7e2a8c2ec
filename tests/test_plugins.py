"""The worker's execution plugins (transport/_sim_plugin.py, _process_plugin.py, _pool.py),
driven directly: no shard, no worker. Every wait is bounded."""

import collections
import itertools
import select
import time

import psutil
import pytest

from engine._codes import Phase
from engine._model import ActionSpec
from transport._plugins import Attempt, Outcome, Pod
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
