"""The durable record formats: the Cython codec and the numpy dtype reload reads them with
must agree field by field (they are two spellings of one layout)."""

from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st_

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


def five_rows():
    """An engine with five actions, two placed, and a copy of its arrays (inspection arrays
    are read-only; the codec binds a State's columns) with distinct values in every field."""
    eng, _ = make_engine(CONFIG)
    eng.enqueue_many([ActionSpec(id=f"acme/p/d/r/a{i}", task="t",
                                 resources={"cpu": 1 + i, "gpu:H100": i % 2})
                      for i in range(5)])
    eng.tick()
    st = SimpleNamespace(n_res=3, **eng.inspect().arrays.copy())
    st.a_deadline_due[:5] = np.arange(5) * 7 + 11
    st.a_attempt[:5] = np.arange(5) + 3
    return eng, st


def test_codec_and_dtype_agree_on_every_field():
    _eng, st = five_rows()
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


def test_decode_puts_every_record_back_at_its_row():
    eng, src = five_rows()
    enc = RecordCodec()
    enc.bind(src)
    rows = np.array([4, 0, 2, 3, 1], dtype=np.int64)
    buf = bytearray(rows.size * enc.action_size)
    enc.encode_actions(rows, buf)
    # Decoded into a blank copy of the same layout, in two calls (the reload's halves).
    blank = {name: np.zeros_like(arr) for name, arr in eng.inspect().arrays.copy().items()}
    dst = SimpleNamespace(n_res=3, **blank)
    dec = RecordCodec()
    dec.bind(dst)
    holder = np.full(5, -7, dtype=np.int32)
    raw = np.frombuffer(bytes(buf), dtype=np.uint8)
    assert dec.decode_actions(raw, 0, 2, holder) == -1
    assert dec.decode_actions(raw, 2, 5, holder) == -1
    for name in action_dtype(3).names:
        if name in ("holder", "fast", "row", "pad"):
            continue
        np.testing.assert_array_equal(getattr(dst, "a_" + name)[:5],
                                      getattr(src, "a_" + name)[:5], err_msg=name)
    expect = np.where(src.a_worker[:5] >= 0, src.w_ident[np.maximum(src.a_worker[:5], 0)], -1)
    np.testing.assert_array_equal(holder, expect)
    # A record whose row is outside the holder array is named by its index, not written.
    short = np.full(3, -7, dtype=np.int32)
    dst.a_state[:] = 0
    assert dec.decode_actions(raw, 0, 5, short) == 0       # record 0 is row 4
    assert (dst.a_state == 0).all()


def test_copy_fixed_copies_in_place_and_names_a_wrong_size():
    import pytest

    from cext._records import copy_fixed
    out = bytearray(12)
    assert copy_fixed(iter([b"abc", b"def", b"ghi"]), 3, 3, out, 2) == (3, -1)
    assert out == b"\0\0abcdefghi\0"
    # One more than counted is reported as count + 1; a wrong size by its index.
    assert copy_fixed(iter([b"abc", b"def", b"xyz"]), 3, 2, out, 0)[0] == 3
    assert copy_fixed(iter([b"abc", b"de", b"xyz"]), 3, 3, out, 0) == (1, 1)
    assert copy_fixed(iter([b"abc", "def"]), 3, 2, out, 0) == (1, 1)
    assert copy_fixed(iter([]), 3, 2, out, 0) == (0, -1)
    with pytest.raises(ValueError):
        copy_fixed(iter([]), 3, 5, out, 0)


def test_name_hashes_are_the_name_hash_of_each_id():
    from engine._records import name_hash, name_hashes
    texts = ["acme/p/d/r/a", "acme/p/d/r/ü-名前", "", "x" * 500]
    got = name_hashes(texts)
    assert got.dtype == np.uint64 and got.tolist() == [name_hash(t) for t in texts]
    assert name_hashes([]).size == 0


def test_name_hashes_are_blake2b_across_block_boundaries():
    # The C hash (cext._digest) must be hashlib's BLAKE2b-64 byte for byte: the hashes are
    # durable. Lengths around each 128-byte block edge, multi-byte UTF-8 and every byte value.
    from hashlib import blake2b

    import pytest

    from engine._records import name_hashes
    texts = ["".join(chr(32 + (i * 7 + k) % 95) for k in range(n))
             for i, n in enumerate([0, 1, 7, 8, 9, 63, 64, 127, 128, 129, 255, 256, 257, 1000])]
    texts += ["é" * 64, "名" * 43, "🙂" * 32, "".join(chr(c) for c in range(1, 0x800, 3))]
    want = [int.from_bytes(blake2b(t.encode(), digest_size=8).digest(), "little")
            for t in texts]
    assert name_hashes(texts).tolist() == want
    with pytest.raises(TypeError):
        name_hashes(["a", b"b"])


def _partitioned_rows(n, parts):
    """A codec bound to a copy of ``five_rows``' arrays grown to ``n`` rows, each row in
    partition ``parts[row]``, row 3 with a Python record (``a_edges`` 1)."""
    eng, _ = make_engine(CONFIG)
    small = eng.inspect().arrays.copy()
    arrays = {}
    for name, arr in small.items():
        if name.startswith("a_"):
            big = np.zeros((n,) + arr.shape[1:], dtype=arr.dtype)
            big[:] = arr[0]
            arrays[name] = big
        else:
            arrays[name] = arr
    st = SimpleNamespace(n_res=3, **arrays)
    st.a_part[:] = parts
    st.a_seq[:] = np.arange(n) * 3 + 1        # distinct per row, so records differ
    st.a_lean[:] = 1
    st.a_edges[:] = 0
    st.a_edges[3] = 1
    codec = RecordCodec()
    codec.bind(st)
    return st, codec


# A turn's dirty rows of a 40-row table (any order, repeats) and each row's partition.
_DIRTY_ROWS = st_.lists(st_.integers(0, 39), max_size=80)
_PARTITIONS = st_.lists(st_.integers(0, 3), min_size=40, max_size=40)


def _blocks(codec, rows):
    m = rows.size
    keys, values = np.empty(8 * m, np.uint8), np.empty(codec.action_size * m, np.uint8)
    heavy = np.empty(m, np.int64)
    n, blocks, n_heavy = codec.encode_blocks(rows, np.empty(m, np.uint64), keys, values, heavy)
    return n, blocks, keys[:8 * n], values[:codec.action_size * n], heavy[:n_heavy]


@settings(max_examples=150, deadline=None)
@given(_DIRTY_ROWS, _PARTITIONS)
def test_blocks_are_the_distinct_rows_by_partition_and_row_each_packed_as_alone(rows, parts):
    # What the journal hands the store for a turn's dirty rows (any order, repeats): one
    # block per partition, rows ascending and distinct within it, keys big-endian rows, each
    # record byte for byte encode_actions' of that row.
    st, codec = _partitioned_rows(40, parts)
    arr = np.array(rows, dtype=np.int64)
    n, blocks, keys, values, heavy = _blocks(codec, arr)
    want = sorted(set(rows), key=lambda r: (parts[r], r))
    assert n == len(want)
    assert [(p, lo, hi) for p, lo, hi in blocks] == [
        (p, want.index(g[0]), want.index(g[-1]) + 1)
        for p in sorted({parts[r] for r in want})
        for g in [[r for r in want if parts[r] == p]]]
    assert np.frombuffer(keys.tobytes(), ">u8").tolist() == want
    alone = bytearray(codec.action_size * n)
    codec.encode_actions(np.array(want, dtype=np.int64), alone)
    assert values.tobytes() == bytes(alone)
    # Row 3 has a Python record: listed once if present, and its fixed record is not lean.
    assert heavy.tolist() == ([3] if 3 in rows else [])
    assert st.a_lean[3] == (0 if 3 in rows else 1) and st.a_lean[:3].all()


@settings(max_examples=100, deadline=None)
@given(_DIRTY_ROWS, _PARTITIONS)
def test_encode_into_appends_the_blocks_encode_blocks_makes(rows, parts):
    # The journal's one-call path: the same records, keys and partition blocks as
    # encode_blocks, each handed to ``packed`` (storage.Records.packed), appended after what
    # the batch already holds; the heavy rows returned as a list.
    from storage import Records
    st, codec = _partitioned_rows(40, parts)
    arr = np.array(rows, dtype=np.int64)
    n, blocks, keys, values, heavy = _blocks(codec, arr)
    st.a_lean[:] = 1
    size = codec.action_size
    batch = {1: ["edge"]}
    got = codec.encode_into(arr, batch, Records.packed)
    assert got == heavy.tolist()
    want = {1: ["edge"]}
    for p, lo, hi in blocks:
        want.setdefault(p, []).append((keys[8 * lo:8 * hi].tobytes(),
                                       values[size * lo:size * hi].tobytes()))
    assert sorted(batch) == sorted(want)
    for p, ops in batch.items():
        assert [op if op == "edge" else (bytes(op.keys), bytes(op.values)) for op in ops] \
            == want[p]
        assert all(op.db == "actions" and (op.key_size, op.value_size) == (8, size)
                   for op in ops if op != "edge")
    assert codec.encode_into(np.empty(0, dtype=np.int64), batch, Records.packed) == []


def test_blocks_refuse_rows_outside_the_table_and_short_buffers():
    import pytest
    _st, codec = _partitioned_rows(8, [0] * 8)
    with pytest.raises(IndexError):
        _blocks(codec, np.array([2, 8], dtype=np.int64))
    rows = np.array([1, 2], dtype=np.int64)
    with pytest.raises(ValueError, match="too small"):
        codec.encode_blocks(rows, np.empty(2, np.uint64), np.empty(16, np.uint8),
                            np.empty(codec.action_size, np.uint8), np.empty(2, np.int64))
    assert _blocks(codec, np.empty(0, dtype=np.int64))[:2] == (0, [])


def test_packed_records_equal_checked_ones():
    from storage import Records
    keys = memoryview(np.arange(6, dtype=">u8").view(np.uint8))
    values = memoryview(np.arange(6 * 5, dtype=np.uint8))
    packed, checked = (Records.packed("actions", keys, values, 8, 5),
                       Records("actions", keys, values, 8, 5))
    assert len(packed) == len(checked) == 6
    assert list(packed.pairs()) == list(checked.pairs())
    assert (packed.db, packed.key_size, packed.value_size) == ("actions", 8, 5)
