"""Shared helpers: small configs and engines on a manual clock."""

import os

import pytest
from hypothesis import settings

from engine import Engine, ManualClock
from engine._config import parse_config
from storage import MemoryStore


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


@pytest.fixture
def engine_factory():
    return make_engine


# CI runs the property tests derandomized (a fixed example sequence, no example database), so a
# landing never depends on a lucky draw; local runs keep exploring new examples every time.
if os.environ.get("CI"):
    settings.register_profile("ci", derandomize=True, database=None)
    settings.load_profile("ci")
