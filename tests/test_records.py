"""The durable record formats: the Cython codec and the numpy dtype reload reads them with
must agree field by field (they are two spellings of one layout)."""

from types import SimpleNamespace

import numpy as np

from cext import RecordCodec
from cext._records import ACTION_HEAD_SIZE
from engine import ActionSpec
from engine._records import action_dtype
from tests.conftest import make_engine

CONFIG = {
    "resources": ["cpu", "memory", "gpu:H100"],
    "clusters": {"east": {"capacity": {"cpu": 8, "memory": "64Gi", "gpu:H100": 8}}},
    "queues": {"q": {}},
    "engine": {"default_queue": "q"},
}


def test_codec_and_dtype_agree_on_every_field():
    eng, clock = make_engine(CONFIG)
    eng.enqueue_many([ActionSpec(id=f"acme/p/d/r/a{i}", task="t",
                                 resources={"cpu": 1 + i, "gpu:H100": i % 2})
                      for i in range(5)])
    eng.tick()
    # The codec reads a State's columns: bind it to a copy of the engine's (inspection
    # arrays are read-only), then make every field distinct.
    st = SimpleNamespace(n_res=3, **eng.inspect().arrays.copy())
    st.a_deadline_due[:5] = np.arange(5) * 7 + 11          # distinct values in every field
    st.a_attempt[:5] = np.arange(5) + 3
    rows = np.array([4, 0, 2], dtype=np.int64)
    codec = RecordCodec()
    codec.bind(st)
    dtype = action_dtype(3)
    assert codec.action_size == dtype.itemsize == ACTION_HEAD_SIZE + 3 * 8
    buf = bytearray(rows.size * codec.action_size)
    codec.encode_actions(rows, buf)
    recs = np.frombuffer(bytes(buf), dtype=dtype)
    for name in dtype.names:
        if name in ("holder", "fast", "row", "pad"):
            continue
        np.testing.assert_array_equal(recs[name], getattr(st, "a_" + name)[rows], err_msg=name)
    holders = np.where(st.a_worker[rows] >= 0, st.w_ident[np.maximum(st.a_worker[rows], 0)], -1)
    np.testing.assert_array_equal(recs["holder"], holders)
    np.testing.assert_array_equal(recs["fast"], st.a_lane[rows] & 1)
    np.testing.assert_array_equal(recs["row"], rows)
    # Placed rows carry their holder's identity, the unplaced one none.
    assert ((recs["gen"] == 1) == (recs["holder"] >= 0)).all() and (recs["gen"] == 1).sum() == 2


def test_codec_refuses_rows_outside_the_table_and_short_buffers():
    eng, _ = make_engine(CONFIG)
    codec = RecordCodec()
    codec.bind(SimpleNamespace(n_res=3, **eng.inspect().arrays.copy()))
    import pytest
    with pytest.raises(IndexError):
        codec.encode_actions(np.array([10**9], dtype=np.int64), bytearray(codec.action_size))
    with pytest.raises(ValueError):
        codec.encode_actions(np.array([0, 1], dtype=np.int64), bytearray(codec.action_size))
