"""The packed action columns (engine/_state.py ACTION_PACKED): what the tick reads and stamps
for a candidate is one 128-byte record per row, 64-byte aligned, each column a strided view
of it; the layout holds on a new engine, after the table grows and after a reload (a plain
column left behind there would cost the tick a cache line per column again, silently)."""

import numpy as np
import pytest

from engine import Engine, parse_config
from engine._state import ACTION_FIELDS, ACTION_PACKED, PACKED_BYTES, State
from storage import LmdbStore
from tests.test_durable import CONFIG, WORKERS, open_engine, restart, spec

LINE = 64
# What a candidate that only waits reads and stamps: its record's first line.
WAITING_CANDIDATE = ("a_fit", "a_wait_tick", "a_state", "a_wait_code", "a_run", "a_qrun",
                     "a_env", "a_next", "a_wait_cluster", "a_wait_dim", "a_wait_blocker")


def assert_packed(view):
    arrays = view.arrays
    packed = arrays.a_packed
    assert packed.dtype.itemsize == PACKED_BYTES == 2 * LINE
    assert packed.ctypes.data % LINE == 0
    assert packed.shape[0] == arrays.a_demand.shape[0]          # one record per row
    for name in ACTION_PACKED:
        column = getattr(arrays, name)
        assert column.dtype == np.dtype(ACTION_FIELDS[name][0]), name
        assert column.strides == (PACKED_BYTES,), name
        assert np.shares_memory(column, packed), name
        offset = packed.dtype.fields[name][1]
        assert offset % column.dtype.itemsize == 0, name       # naturally aligned
    for name in WAITING_CANDIDATE:
        field = packed.dtype.fields[name]
        assert field[1] + field[0].itemsize <= LINE, name


def test_a_new_engine_keeps_the_candidate_columns_in_one_aligned_record_per_row():
    eng = Engine(parse_config(CONFIG))
    assert_packed(eng.inspect())
    eng.close()


def test_the_records_stay_packed_and_keep_their_values_when_the_table_grows(tmp_path):
    store = LmdbStore(str(tmp_path / "data"), partitions=4)
    eng, clock = open_engine(store)
    view = eng.inspect()
    before = view.arrays.a_packed.shape[0]              # initial_capacity 16
    ids = eng.enqueue_many([spec(i) for i in range(200)])
    assert view.arrays.a_packed.shape[0] > before       # grew, by doubling
    assert_packed(view)
    placed = eng.tick()
    assert placed
    rows = [view.row_of(a.action) for a in placed]
    gens = view.arrays.a_gen[rows]
    assert (gens == [a.generation for a in placed]).all()
    phases = [eng.phase(i) for i in ids]
    # Rows past the high-water mark read as never used (every column's fill).
    unused = view.arrays.a_packed[view.action_rows:]
    for name in ACTION_PACKED:
        assert (unused[name] == ACTION_FIELDS[name][1]).all(), name

    eng2, _ = restart(eng, clock, WORKERS, CONFIG)
    view2 = eng2.inspect()
    assert_packed(view2)                               # reload packs what it filled
    assert (view2.arrays.a_gen[[view2.row_of(a.action) for a in placed]] == gens).all()
    assert [eng2.phase(i) for i in ids] == phases
    eng2.close()


@pytest.mark.parametrize("name", ACTION_PACKED)
def test_every_packed_column_is_a_declared_action_column(name):
    assert name in ACTION_FIELDS and ACTION_FIELDS[name][2] == ()


def test_a_pack_split_over_threads_writes_what_one_thread_writes():
    # Reload packs a large table in two halves on two threads (engine/_parallel.py); any
    # cut of the rows must give the same records as one pass.
    config = parse_config(CONFIG)
    rng = np.random.default_rng(7)
    one, split = (State.for_config(config, packed=False) for _ in range(2))
    for name in ACTION_PACKED:
        column = getattr(one, name)
        info = np.iinfo(column.dtype)
        values = rng.integers(info.min, info.max, size=column.shape, dtype=column.dtype,
                              endpoint=True)
        column[:] = values
        getattr(split, name)[:] = values
    rows = one.rows["actions"]
    one.pack(parts=[(0, rows)])
    split.pack(parts=[(0, 3), (3, rows - 5), (rows - 5, rows)])
    for name in ACTION_PACKED:
        assert (getattr(split, name) == getattr(one, name)).all(), name
        assert (split.a_packed[name] == one.a_packed[name]).all(), name
    with pytest.raises(ValueError, match="do not cover"):
        State.for_config(config, packed=False).pack(parts=[(0, 3), (4, rows)])
