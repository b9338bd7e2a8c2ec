"""A server process's heap once started (``engine._commands.freeze_heap``): ``leasehold
shard`` and ``leasehold worker`` freeze what they hold after start-up, so full collections
(~30 ms each over it here) stop walking it, and collect less often from then on
(``SERVER_GC_THRESHOLD``); a ``Shard`` inside someone else's process does neither.
"""

import gc

from engine import parse_config
from engine._commands import SERVER_GC_THRESHOLD, freeze_heap
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
    before = gc.get_threshold()
    kept = [[i] for i in range(5_000)]      # tracked containers alive now
    try:
        freeze_heap()
        assert gc.get_freeze_count() >= len(kept)
        made = [[i] for i in range(100)]
        # What is made afterwards is tracked (and collected) as before, less often.
        assert not any(o is kept[0] for o in gc.get_objects())
        assert any(o is made[0] for o in gc.get_objects(generation=0))
        assert gc.get_threshold() == SERVER_GC_THRESHOLD != before
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
    assert gc.get_freeze_count() == 0


def _started_heap(tmp_path, **kw):
    """(objects frozen, collector thresholds) once a Shard has started here."""
    gc.unfreeze()
    before = gc.get_threshold()
    shard = Shard(_config(tmp_path), store=MemoryStore(1), **kw).start(timeout=30)
    try:
        return gc.get_freeze_count(), gc.get_threshold()
    finally:
        shard.stop(timeout=30)
        gc.unfreeze()
        gc.set_threshold(*before)


def test_a_shard_freezes_its_heap_only_when_asked(tmp_path):
    default = gc.get_threshold()
    assert _started_heap(tmp_path) == (0, default)      # the default: a library object
    # run_shard's way: frozen once its engine has loaded, then collected less often.
    frozen, thresholds = _started_heap(tmp_path, freeze_heap=True)
    assert frozen > 10_000 and thresholds == SERVER_GC_THRESHOLD
