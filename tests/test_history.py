"""Runtime history per task (engine/_history.py): percentiles, memory, records."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine._history import (
    HI_NS,
    LO_NS,
    N_BUCKETS,
    RECORD_SIZE,
    RuntimeHistory,
    bucket_edges_ns,
)

# Adjacent bucket edges differ by this factor at most: the error bound of a percentile.
RATIO = float(np.max(bucket_edges_ns()[1:] / bucket_edges_ns()[:-1]))


def test_no_history_is_none():
    h = RuntimeHistory()
    assert h.percentile("train", 0.9) is None
    assert h.count("train") == 0
    assert "train" not in h


def test_edges_cover_10ms_to_60_days_in_96_buckets():
    edges = bucket_edges_ns()
    assert edges.shape == (N_BUCKETS - 1,)
    assert edges[0] == LO_NS == 10_000_000 and edges[-1] == HI_NS == 60 * 86400 * 10**9
    assert (np.diff(edges) > 0).all()
    assert RATIO < 1.25


@given(st.lists(st.floats(0.011, 5e6), min_size=1, max_size=200),
       st.sampled_from([0.5, 0.9, 0.99, 1.0]))
def test_percentile_within_one_bucket_and_never_short(samples, p):
    h = RuntimeHistory()
    for s in samples:
        h.record("t", s)
    exact = float(np.sort(samples)[max(1, int(np.ceil(p * len(samples)))) - 1])
    got = h.percentile("t", p)
    assert exact * (1 - 1e-9) <= got <= exact * RATIO * (1 + 1e-9)
    assert h.count("t") == len(samples)


def test_an_edge_predicts_itself_exactly():
    h = RuntimeHistory()
    edge = int(bucket_edges_ns()[40])
    for _ in range(5):
        h.record_ns("t", edge)
    assert h.percentile_ns("t", 0.9) == edge


def test_extremes_land_in_the_end_buckets():
    h = RuntimeHistory()
    h.record("fast", 0.0)
    h.record("slow", 1e9)
    assert h.percentile_ns("fast", 1.0) == LO_NS
    assert h.percentile_ns("slow", 1.0) == HI_NS
    with pytest.raises(ValueError):
        h.record("t", -1)
    with pytest.raises(ValueError):
        h.percentile("fast", 0)
    with pytest.raises(ValueError):
        h.percentile("fast", 1.5)


def test_memory_is_bounded_per_task_not_per_sample():
    h = RuntimeHistory(initial_tasks=4)
    for i in range(10_000):
        h.record("one", 1 + i % 100)
    assert h.nbytes == 4 * N_BUCKETS * 8
    for i in range(100):
        h.record(f"task{i}", 1.0)
    assert len(h) == 101
    assert h.nbytes == 128 * N_BUCKETS * 8      # doubling: 4 -> 128 rows
    assert h.count("one") == 10_000


def test_encode_load_round_trip_and_merge():
    a = RuntimeHistory()
    for s in (0.5, 1, 2, 4, 8, 100):
        a.record("t", s)
    data = a.encode("t")
    assert isinstance(data, bytes) and len(data) == RECORD_SIZE
    b = RuntimeHistory()
    b.record("t", 1000)                 # replaced by load
    b.load("t", data)
    assert b.count("t") == 6
    assert b.percentile("t", 0.5) == a.percentile("t", 0.5)
    assert b.encode("t") == data
    c = RuntimeHistory()
    c.record("t", 3)
    c.record("u", 7)
    c.merge(a)
    assert c.count("t") == 7 and c.count("u") == 1
    assert c.percentile("t", 1.0) == a.percentile("t", 1.0)
    with pytest.raises(KeyError):
        a.encode("nope")


def test_a_bad_record_is_refused_naming_the_task():
    h = RuntimeHistory()
    h.record("t", 1)
    good = h.encode("t")
    with pytest.raises(ValueError, match=r"task 'etl'.*expected"):
        h.load("etl", good[:-1])
    with pytest.raises(ValueError, match=r"task 'etl'.*header"):
        h.load("etl", b"XXXX" + good[4:])
    assert h.count("etl") == 0          # nothing loaded
    assert h.count("t") == 1


def test_percentile_cache_follows_new_samples():
    h = RuntimeHistory()
    h.record("t", 1)
    first = h.percentile("t", 1.0)
    h.record("t", 100)
    assert h.percentile("t", 1.0) > first
