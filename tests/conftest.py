"""Shared helpers: small configs and engines on a manual clock."""

import gc
import os
import sys

import pytest
from hypothesis import settings

import cext
from engine import Engine, ManualClock
from engine._config import parse_config
from storage import MemoryStore

pytest_plugins = ["pytester"]   # tests/test_debug_traps.py runs a suite of its own


def pytest_report_header(config):
    build = "debug (bounds and initialisation checks)" if cext.DEBUG else "release"
    return f"cext: {build} build, {sys.modules[cext.TickKernel.__module__].__file__}"


def pytest_configure(config):
    # make test-debug sets LEASEHOLD_DEBUG for pytest too: a run meant for the debug build must
    # not pass against a release build that happens to be in place.
    if os.environ.get("LEASEHOLD_DEBUG", "") not in ("", "0") and not cext.DEBUG:
        raise pytest.UsageError("LEASEHOLD_DEBUG is set but cext is a release build: "
                                "rebuild with LEASEHOLD_DEBUG=1 (make test-debug does)")


def hash_names_with(monkeypatch, name_hash):
    """Make the engine hash action ids with ``name_hash`` (text -> int) for this test
    (``name_hashes`` alike): how tests make ids share a 64-bit name hash."""
    import numpy as np

    def name_hashes(texts):
        return np.array([name_hash(t) for t in texts], np.uint64)

    for name, module in list(sys.modules.items()):
        if name.startswith("engine.") and hasattr(module, "name_hash"):
            monkeypatch.setattr(module, "name_hash", name_hash)
        if name.startswith("engine.") and hasattr(module, "name_hashes"):
            monkeypatch.setattr(module, "name_hashes", name_hashes)


def make_engine(config, workers=None, store=None):
    """An Engine over ``config`` (a dict) on a ManualClock and an in-memory store (or
    ``store``), with ``workers`` registered as ``{worker_id: (cluster, slots)}`` (default:
    one 1000-slot worker per cluster)."""
    cfg = parse_config(config, source="<test>")
    clock = ManualClock()
    eng = Engine(cfg, clock=clock, store=store if store is not None else MemoryStore())
    if workers is None:
        workers = {f"w-{c.name}": (c.name, 1000) for c in cfg.clusters}
    for wid, (cluster, slots) in workers.items():
        eng.register_worker(wid, cluster, slots)
    return eng, clock


def start_running(eng, specs):
    """Enqueue ``specs`` and place them in one tick, each marked running at once; returns
    the assignments."""
    eng.enqueue_many(specs)
    placed = eng.tick()
    for a in placed:
        eng.mark_running(a.action, a.generation)
    return placed


@pytest.fixture
def engine_factory():
    return make_engine


# CI runs the property tests derandomized (a fixed example sequence, no example database), so a
# landing never depends on a lucky draw; local runs keep exploring new examples every time.
if os.environ.get("CI"):
    settings.register_profile("ci", derandomize=True, database=None)
    settings.load_profile("ci")


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago (for a process told its port)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def until(cond, timeout=10.0, what="condition"):
    """``cond()``'s first truthy value, polled every 20 ms for at most ``timeout`` seconds;
    AssertionError naming ``what`` when it never comes."""
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture(autouse=True)
def _collector_as_found():
    """A command run in process (``leasehold worker`` or ``shard`` in a CLI test) freezes the
    heap and raises the collector's thresholds, as it does in a process of its own: both
    are put back after the test, so no later test on the same pytest worker sees them."""
    thresholds, frozen = gc.get_threshold(), gc.get_freeze_count()
    yield
    gc.set_threshold(*thresholds)
    if gc.get_freeze_count() > frozen:
        gc.unfreeze()
