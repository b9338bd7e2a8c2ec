"""Runtime history per (task, shape) (engine/_history.py): recent successes, the EASY++
prediction, memory, records."""

import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine._history import RECENT, RECORD_SIZE, RuntimeHistory, shape_key

K = ("train", "2x(gpu:H100=8)")
S = 1_000_000_000


def test_no_history_is_none():
    h = RuntimeHistory()
    assert h.predict(K) is None and h.predict_ns(K) is None
    assert h.count(K) == 0
    assert K not in h


@given(st.lists(st.integers(0, 10**15), min_size=1, max_size=50))
def test_the_prediction_is_the_mean_of_the_last_two_successes(samples):
    h = RuntimeHistory()
    for ns in samples:
        h.record_ns(K, ns)
    last = samples[-2:]
    assert h.predict_ns(K) == -(-sum(last) // len(last))      # rounded up, never short
    assert h.recent_ns(K) == last[::-1]
    assert h.count(K) == len(samples)


def test_record_many_is_record_one_by_one_in_order():
    a, b = RuntimeHistory(), RuntimeHistory()
    a.record_many_ns(K, [5 * S, 7 * S, 11 * S])
    for ns in (5 * S, 7 * S, 11 * S):
        b.record_ns(K, ns)
    assert a.recent_ns(K) == b.recent_ns(K) == [11 * S, 7 * S]
    a.record_many_ns(K, [3 * S])
    assert a.recent_ns(K) == [3 * S, 11 * S] and a.predict_ns(K) == 7 * S
    assert a.count(K) == 4


def test_keys_are_task_and_shape_apart():
    h = RuntimeHistory()
    h.record(("etl", "1x(cpu=4000)"), 10)
    h.record(("etl", "1x(cpu=32000)"), 100)
    assert h.predict(("etl", "1x(cpu=4000)")) == 10
    assert h.predict(("etl", "1x(cpu=32000)")) == 100
    with pytest.raises(ValueError, match="history key"):
        h.record("etl", 1)          # a task name alone is not a key
    with pytest.raises(ValueError, match=">= 0"):
        h.record(K, -1)


def test_shape_key_names_pods_and_their_vectors():
    names = ("cpu", "memory", "gpu:H100")
    pods = np.array([[4000, 0, 0], [64000, 2**39, 8]], dtype=np.int64)
    assert shape_key(names, pods, np.array([1, 3])) == (
        "1x(cpu=4000)+3x(cpu=64000,memory=549755813888,gpu:H100=8)")
    assert shape_key(names, pods[:1], np.array([2])) != shape_key(names, pods[:1], np.array([1]))


def test_memory_is_bounded_per_key_not_per_sample():
    h = RuntimeHistory(initial_keys=4)
    for i in range(10_000):
        h.record(K, 1 + i % 100)
    per_row = RECENT * 8 + 8
    assert h.nbytes == 4 * per_row
    for i in range(100):
        h.record((f"task{i}", ""), 1.0)
    assert len(h) == 101
    assert h.nbytes == 128 * per_row            # doubling: 4 -> 128 rows
    assert h.count(K) == 10_000


def test_encode_load_round_trip():
    a = RuntimeHistory()
    for s in (0.5, 1, 2, 4, 8, 100):
        a.record(K, s)
    data = a.encode(K)
    assert isinstance(data, bytes) and len(data) == RECORD_SIZE
    b = RuntimeHistory()
    b.record(K, 1000)                 # replaced by load
    b.load(K, data)
    assert b.count(K) == 6 and b.predict(K) == a.predict(K) == 54
    assert b.encode(K) == data
    one = RuntimeHistory()
    one.record(K, 3)
    again = RuntimeHistory()
    again.load(K, one.encode(K))
    assert again.recent_ns(K) == [3 * S] and again.predict(K) == 3
    with pytest.raises(KeyError):
        a.encode(("nope", ""))


def test_a_bad_record_is_refused_naming_the_key():
    h = RuntimeHistory()
    h.record(K, 1)
    good = h.encode(K)
    other = ("etl", "1x(cpu=1000)")
    with pytest.raises(ValueError, match=r"'etl'.*expected"):
        h.load(other, good[:-1])
    with pytest.raises(ValueError, match=r"'etl'.*header"):
        h.load(other, b"XXXX" + good[4:])
    # Samples that contradict the count (two kept, one ever recorded).
    bad = good[:8] + struct.pack("<Q" + "q" * RECENT, 1, 5, 6)
    with pytest.raises(ValueError, match="do not match the count"):
        h.load(other, bad)
    # A version 1 record (the histogram per task name) is refused by name, not misread.
    v1 = struct.pack("<4sHH", b"LHRH", 1, 96) + bytes(8 * 96)
    with pytest.raises(ValueError, match="version 1 record"):
        h.load(other, v1)
    assert h.count(other) == 0          # nothing loaded
    assert h.count(K) == 1


def test_records_are_encode_of_each_and_none_without_a_sample():
    h = RuntimeHistory()
    keys = [(f"t{i}", "") for i in range(5)]
    for i, k in enumerate(keys):
        for s in range(i + 1):
            h.record(k, s + 0.5)
    h.record_many_ns(("empty", ""), [])          # no sample: no row either
    unknown = [("never", ""), ("empty", "")]
    assert h.records(keys + unknown) == [h.encode(k) for k in keys] + [None, None]
    assert h.records([]) == []
