"""A server process's heap once started (``engine._commands.freeze_heap``): ``leasehold
shard`` and ``leasehold worker`` freeze what they hold after start-up, so full collections
(~30 ms each over it here) stop walking it; a ``Shard`` inside someone else's process does not.
"""

import gc

from engine import parse_config
from engine._commands import freeze_heap
from storage import MemoryStore
from transport import Shard


def _config(tmp_path):
    return parse_config({
        "resources": ["cpu"],
        "clusters": {"east": {"capacity": {"cpu": 8}}},
        "queues": {"q": {"scheduling": "GREEDY_CAPACITY"}},
        "engine": {"default_queue": "q"},
        "storage": {"path": str(tmp_path / "data"), "partitions": 1},
        "transport": {"endpoints": ["tcp://127.0.0.1:0"]},
        "security": {"insecure": True},
    })


def test_freeze_heap_takes_what_is_alive_out_of_the_collector():
    gc.unfreeze()
    kept = [[i] for i in range(5_000)]      # tracked containers alive now
    try:
        freeze_heap()
        assert gc.get_freeze_count() >= len(kept)
        made = [[i] for i in range(100)]
        # What is made afterwards is tracked (and collected) as before.
        assert not any(o is kept[0] for o in gc.get_objects())
        assert any(o is made[0] for o in gc.get_objects(generation=0))
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def _started_freeze_count(tmp_path, **kw):
    gc.unfreeze()
    shard = Shard(_config(tmp_path), store=MemoryStore(1), **kw).start(timeout=30)
    try:
        return gc.get_freeze_count()
    finally:
        shard.stop(timeout=30)
        gc.unfreeze()


def test_a_shard_freezes_its_heap_only_when_asked(tmp_path):
    assert _started_freeze_count(tmp_path) == 0          # the default: a library object
    # run_shard's way: frozen once its engine has loaded.
    assert _started_freeze_count(tmp_path, freeze_heap=True) > 10_000
