"""The filter of reclaimed names (engine/_reclaimed.py) and the fan-out enqueue built on it:
new names of a run that reclaimed work are not looked up in the store, and a reclaimed
name is always found (idempotent re-enqueue, a different spec refused), however often the
filter fills and starts afresh."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import engine._reclaimed as reclaimed
from engine import ActionSpec, AlreadyExists, Phase, Verdict
from engine._reclaimed import ReclaimedNames
from storage import MemoryStore
from tests.conftest import make_engine
from tests.test_retention import config


@settings(max_examples=200, deadline=None)
@given(batches=st.lists(st.lists(st.integers(0, 2**64 - 1), max_size=40), max_size=12),
       capacity=st.integers(1, 100))
def test_every_name_added_since_the_last_clear_may_be_held(batches, capacity):
    f = ReclaimedNames(bits=1024, capacity=capacity)
    since = []
    for batch in batches:
        hashes = np.array(batch, np.uint64)
        if f.add(hashes):
            since = []
        since.extend(batch)
        assert f.may_hold(np.array(since, np.uint64)).all()
    assert f.count == len(since)


def test_absent_names_are_mostly_reported_absent_and_a_full_filter_is_cleared():
    rng = np.random.default_rng(1)
    f = ReclaimedNames(capacity=200_000)
    added = rng.integers(0, 2**63, 200_000, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    assert not f.add(added)
    absent = rng.integers(0, 2**63, 100_000, dtype=np.uint64) * np.uint64(2)
    assert f.may_hold(absent).mean() < 0.03     # at capacity: ~1.5%
    assert f.add(absent[:1])                    # past capacity: cleared first
    assert f.count == 1 and f.may_hold(absent[:1]).all()
    assert f.may_hold(added).mean() < 0.01
    with pytest.raises(ValueError, match="power of two"):
        ReclaimedNames(bits=1000)


class CountingStore(MemoryStore):
    """Counts the keys looked up in the retained-outcomes database."""

    def __init__(self):
        super().__init__()
        self.retained_lookups = 0
        self.retained_scans = 0

    def scan_range(self, partition, db, start=b"", stop=None, limit=None):
        if db == "retained":
            self.retained_scans += 1
        return super().scan_range(partition, db, start, stop, limit)

    def get_many(self, partition, db, keys):
        keys = list(keys)
        if db == "retained":
            self.retained_lookups += len(keys)
        return super().get_many(partition, db, keys)


def template(run, cpu=1):
    return ActionSpec(id=f"acme/p/d/{run}/x", task="t", resources={"cpu": cpu})


def finish(eng, clock, names):
    """Place what is queued; report SUCCEEDED for the actions named (the rest run on)."""
    clock.advance(1)
    for a in eng.tick():
        if a.action.action in names:
            assert eng.report(a.token, Phase.SUCCEEDED) == Verdict.OK


def test_new_names_of_a_run_that_reclaimed_work_are_not_looked_up_in_the_store():
    store = CountingStore()
    eng, clock = make_engine(config(capacity=64), store=store)
    ids = eng.enqueue_fanout(template("r"), [f"a{i}" for i in range(10)])
    finish(eng, clock, {f"a{i}" for i in range(8)})
    assert eng.reclaim() == 8               # a8 and a9 run on: the run stays in memory
    before = store.retained_lookups
    new = eng.enqueue_fanout(template("r"), [f"b{i}" for i in range(500)])
    assert new.added.all()
    # The filter may report a few of 500 absent names possible (~1.5% at capacity, far
    # fewer this empty): only those are looked up.
    assert store.retained_lookups - before <= 5
    # The reclaimed names are found: idempotent with the same spec, refused with another.
    again = eng.enqueue_fanout(template("r"), ["a0", "a3", "c0"])
    assert list(again)[:2] == [ids[0], ids[3]] and again.added.tolist() == [False, False,
                                                                            True]
    with pytest.raises(AlreadyExists, match="a1 exists with a different spec"):
        eng.enqueue_fanout(template("r", cpu=2), ["a1"])


def test_a_run_made_while_the_store_holds_its_outcomes_looks_every_new_name_up():
    store = CountingStore()
    eng, clock = make_engine(config(capacity=64), store=store)
    eng.enqueue_fanout(template("r"), ["a0", "a1"])
    finish(eng, clock, {"a0", "a1"})
    assert eng.reclaim() == 2               # the run leaves memory; its outcomes stay
    eng.enqueue_fanout(template("r"), ["keep"])     # the run again: made anew
    before = store.retained_lookups
    assert eng.enqueue_fanout(template("r"), [f"b{i}" for i in range(50)]).added.all()
    assert store.retained_lookups - before == 50
    assert not eng.enqueue_fanout(template("r"), ["a1"]).added.any()


def test_a_run_is_judged_at_its_first_reclaim_and_its_enqueue_probes_the_store_once():
    """Whether a run's retained outcomes are all in the filter is asked at its first
    reclaim (off the enqueue path): a new run's fan-out probes the store's retained keys
    once; a run made again while the store holds its older outcomes is found not fresh
    then, and keeps looking every new name up."""
    store = CountingStore()
    eng, clock = make_engine(config(capacity=64), store=store)
    eng.enqueue_fanout(template("r"), ["a0", "a1"])
    assert store.retained_scans == 1
    finish(eng, clock, {"a0", "a1"})
    assert eng.reclaim() == 2               # the run leaves memory; its outcomes stay
    eng.enqueue_fanout(template("r"), ["keep", "live"])     # made anew
    finish(eng, clock, {"keep"})
    assert eng.reclaim() == 1               # its first reclaim: the store holds a0, a1
    before = store.retained_lookups
    assert eng.enqueue_fanout(template("r"), [f"b{i}" for i in range(50)]).added.all()
    assert store.retained_lookups - before == 50
    assert not eng.enqueue_fanout(template("r"), ["a0"]).added.any()


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["r1", "r2"]),
                                st.lists(st.integers(0, 11), min_size=1, max_size=6),
                                st.sets(st.integers(0, 11))), min_size=1, max_size=12),
       capacity=st.integers(1, 8))
def test_a_reclaimed_name_is_always_found_however_often_the_filter_fills(steps, capacity):
    """Fan-outs of names already enqueued (live or reclaimed) add nothing and answer the
    same ids, a spec of another size is refused, across reclaims that fill the filter."""
    reclaimed.CAPACITY, saved = capacity, reclaimed.CAPACITY
    try:
        eng, clock = make_engine(config(capacity=16))
        ids = {}
        for run, numbers, done in steps:
            names = list(dict.fromkeys(f"n{k}" for k in numbers))
            got = eng.enqueue_fanout(template(run), names)
            for name, aid, added in zip(names, got, got.added.tolist(), strict=True):
                assert added == ((run, name) not in ids)
                assert ids.setdefault((run, name), aid) == aid
            seen = [name for (r, name) in ids if r == run]
            with pytest.raises(AlreadyExists):
                eng.enqueue_fanout(template(run, cpu=2), seen[:1])
            finish(eng, clock, {f"n{k}" for k in done})
            eng.reclaim()
    finally:
        reclaimed.CAPACITY = saved
