"""The abort record (engine/_aborts.py): an abort of a tree writes one record listing the lean
rows it ended instead of rewriting each row's fixed record; a reload applies it to rows whose
stored record is older than the abort, and a reclaimed row leaves it at once (a reused row is
never aborted by a reload)."""

import dataclasses
import random

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import ActionSpec, Engine, ManualClock, Phase, parse_config
from engine._codes import LeaseKind, Verdict
from storage import SCHEMA_VERSION, CorruptRecord, MemoryStore, Puts, Records, StoreError
from storage._store import check_schema

CONFIG = {
    "resources": ["cpu", "memory"],
    "clusters": {"east": {"capacity": {"cpu": 64, "memory": "256Gi"}}},
    "queues": {"cpu": {"scheduling": "GREEDY_CAPACITY", "depth": 5000}},
    "engine": {"default_queue": "cpu", "initial_capacity": 16},
}
SECRET = bytes(range(16))


class RecordingStore(MemoryStore):
    """A MemoryStore that keeps every batch it was given."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.batches = []

    def commit(self, batch):
        self.batches.append(batch)
        super().commit(batch)


def engine(store=None, slots=1000):
    eng = Engine(parse_config(CONFIG), clock=ManualClock(), store=store or MemoryStore(4),
                 secret=SECRET)
    eng.register_worker("w", "east", slots)
    return eng


def reopen(eng, slots=1000, crash=False):
    """A new Engine on ``eng``'s store: after a close, or as after a crash (no close)."""
    store = eng.store
    if not crash:
        eng.close()
    again = Engine(eng.config, clock=eng.clock, secret=SECRET,
                   store=MemoryStore(store.partitions, backing=store.backing))
    again.register_worker("w", "east", slots)
    return again


def spec(name, parent=None):
    return ActionSpec(id=f"acme/p/d/r/{name}", task="t", resources={"cpu": "100m"},
                      parent=None if parent is None else str(parent))


def written(batch, db):
    """Records of ``db`` a batch writes (Records blocks and triples)."""
    n = 0
    for ops in batch.values():
        for op in ops:
            if isinstance(op, (Records, Puts)):
                n += len(op) if op.db == db else 0
            elif op[0] == db:
                n += 1
    return n


def seen(eng, ids):
    """What a user sees of ``ids``: phase and every attempt (cleanup included). A wait
    reason is the last tick's (memory only): waiting reads as queued."""
    def phase(a):
        p = eng.phase(a)
        return Phase.QUEUED if p == Phase.WAITING_FOR_RESOURCES else p
    return {a: (phase(a), [dataclasses.asdict(t) for t in eng.attempts(a)]) for a in ids}


def counts(eng):
    """The queue's counters (its ETA projection moves with the clock: left out)."""
    return {k: v for k, v in eng.queue_metrics()["cpu"].items() if k != "projection"}


def test_an_abort_writes_one_record_not_the_rows_it_ends_and_a_reload_ends_them():
    store = RecordingStore(4)
    eng = engine(store, slots=10)
    [root] = eng.enqueue_many([spec("root")])
    kids = eng.enqueue_fanout(spec("k", root), [f"k{i}" for i in range(500)])
    eng.clock.advance(1)
    placed = eng.tick()
    for a in placed[:4]:
        eng.report(a.token, Phase.RUNNING)
    eng.clock.advance(1)
    before = len(store.batches)
    ended = eng.abort(root, reason="stop")
    assert len(ended) == 501
    [batch] = store.batches[before:]
    # No action record: the abort record (and the reason) and the 10 cleanup leases.
    assert written(batch, "actions") == 0
    assert written(batch, "attempts") == 2 and written(batch, "finalize") == 10
    view = eng.inspect()
    assert view.abort_rows()[view.row_of(root)].tolist() == sorted(
        view.row_of(a) for a in (root, *kids))
    fins = [a for a in eng.tick() if a.kind == LeaseKind.FINALIZE]
    assert len(fins) == 10
    assert eng.report(fins[0].token, Phase.SUCCEEDED) == Verdict.OK
    want = seen(eng, [root, *kids])
    for k, how in enumerate(("close", "crash"), start=1):
        eng = reopen(eng, slots=10, crash=how == "crash")
        assert seen(eng, [root, *kids]) == want
        m = eng.queue_metrics()["cpu"]
        assert (m["depth"], m["actions_in_flight"]) == (0, 0)
        # The aborted leases stay refused; their cleanup is still held.
        assert {r.verdict for r in eng.heartbeat("w", [a.token for a in placed])} == {
            Verdict.ABORTED}
        assert eng.report(fins[k].token, Phase.SUCCEEDED) == Verdict.OK
        want = seen(eng, [root, *kids])


def test_a_row_reclaimed_from_an_abort_and_reused_is_not_aborted_by_a_reload():
    eng = engine(slots=2)
    [root] = eng.enqueue_many([spec("root")])
    [mid] = eng.enqueue_many([spec("mid", root)])
    old = eng.enqueue_fanout(spec("o", mid), [f"o{i}" for i in range(12)])
    eng.clock.advance(1)
    eng.tick()                                   # root and mid run, the twelve wait
    eng.abort(old[0], reason="first")            # one leaf alone: its own record
    ended = eng.abort(mid, reason="enough")
    assert set(ended) == {mid, *old[1:]}
    view = eng.inspect()
    mid_row = view.row_of(mid)
    assert set(view.abort_rows()) == {view.row_of(old[0]), mid_row}
    old_rows = sorted(view.row_of(a) for a in old)
    for a in eng.tick():                         # mid's cleanup: done
        assert eng.report(a.token, Phase.SUCCEEDED) == Verdict.OK
    # The leaves go first (mid still has children when they are picked).
    assert eng.reclaim() == 12
    assert view.abort_rows() == {mid_row: np.array([mid_row])}
    # Their rows go to new actions of the same run, queued.
    new = eng.enqueue_fanout(spec("n", root), [f"n{i}" for i in range(12)])
    assert sorted(view.row_of(a) for a in new) == old_rows
    for crash in (True, False):
        eng = reopen(eng, slots=2, crash=crash)
        assert {eng.phase(a) for a in new} == {Phase.QUEUED}
        assert {eng.phase(a) for a in (mid, *old)} == {Phase.ABORTED}
        assert eng.attempts(old[0])[0].message == "first"
        assert eng.attempts(old[5])[0].message == "enough"
        assert eng.queue_metrics()["cpu"]["depth"] == 12
    # The last listed row reclaimed: the record goes with it.
    assert eng.reclaim() == 1
    assert eng.inspect().abort_rows() == {}
    eng = reopen(eng, slots=2, crash=True)
    assert eng.inspect().abort_rows() == {}
    assert {eng.phase(a) for a in new} == {Phase.QUEUED}
    eng.clock.advance(1)
    eng.abort(root)
    assert {eng.phase(a) for a in new} == {Phase.ABORTED}


def test_a_failed_abort_commit_leaves_every_row_as_it_was_before_the_abort():
    eng = engine(slots=3)
    [root] = eng.enqueue_many([spec("root")])
    kids = eng.enqueue_fanout(spec("k", root), [f"k{i}" for i in range(20)])
    eng.clock.advance(1)
    placed = eng.tick()
    eng.report(placed[1].token, Phase.RUNNING)
    before = seen(eng, [root, *kids])
    metrics = counts(eng)
    eng.clock.advance(1)
    eng.store.fail_next(StoreError("disk on fire"))
    with pytest.raises(StoreError, match="disk on fire"):
        eng.abort(root)
    assert seen(eng, [root, *kids]) == before
    assert counts(eng) == metrics
    assert eng.inspect().abort_rows() == {}
    again = reopen(eng, slots=3, crash=True)
    assert seen(again, [root, *kids]) == before
    # The abort again, committed this time.
    assert len(again.abort(root)) == 21
    again = reopen(again, slots=3, crash=True)
    assert {again.phase(a) for a in (root, *kids)} == {Phase.ABORTED}


def _view(eng, ids):
    """What a reload must give back, read without giving lean rows a Python record (that
    would send the next abort of them down the path one by one): phases, the counters, the
    abort records, the columns an abort changes and the free rows."""
    ins = eng.inspect()
    n = ins.action_rows
    a = ins.arrays
    cols = {k: getattr(a, k)[:n].tolist() for k in (
        "a_state", "a_phase", "a_done", "a_start", "a_abort", "a_end", "a_gen",
        "a_released_gen")}
    phases = [Phase.QUEUED if p == Phase.WAITING_FOR_RESOURCES else p
              for p in eng.phases(ids)]
    return (phases, counts(eng), eng.cluster_in_flight("east"),
            {k: v.tolist() for k, v in ins.abort_rows().items()}, cols, ins.free_rows.tolist())


OPS = st.lists(st.sampled_from(["fanout", "fanout", "tick", "running", "succeed", "abort",
                                "abort", "cleanup", "reclaim", "advance", "restart",
                                "crash"]), min_size=4, max_size=40)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, seed=st.integers(0, 1 << 16))
def test_a_reload_after_any_aborts_reclaims_and_reuse_gives_memory_back(ops, seed):
    rng = random.Random(seed)
    eng = engine(slots=4)
    roots = eng.enqueue_many([spec("r0"), spec("r1")])
    ids = list(roots)
    live = {}       # token -> lease (run and finalize leases handed out)
    n = 0
    for op in ops:
        if op == "fanout":
            parents = [a for a in ids if eng.phase(a) not in (
                Phase.ABORTED, Phase.SUCCEEDED, Phase.FAILED)]
            if parents:
                n += 1
                ids += eng.enqueue_fanout(spec(f"f{n}", rng.choice(parents)),
                                          [f"f{n}x{i}" for i in range(rng.randint(1, 6))])
        elif op == "tick":
            live.update((a.token, a) for a in eng.tick())
        elif op in ("running", "succeed") and live:
            tok = rng.choice(sorted(live))
            if live[tok].kind != LeaseKind.FINALIZE:
                eng.report(tok, Phase.RUNNING if op == "running" else Phase.SUCCEEDED)
                if op == "succeed":
                    del live[tok]
        elif op == "abort":
            eng.abort(rng.choice(ids), reason=f"stop {n}")
        elif op == "cleanup":
            for tok in sorted(live):
                if live[tok].kind == LeaseKind.FINALIZE:
                    eng.report(tok, Phase.SUCCEEDED)
                    del live[tok]
        elif op == "reclaim":
            eng.reclaim(limit=rng.randint(1, 8))
        elif op == "advance":
            eng.clock.advance(rng.choice([0.5, 1.0]))
            eng.heartbeat("w", sorted(live))
        else:
            want = _view(eng, ids)
            eng = reopen(eng, slots=4, crash=op == "crash")
            assert _view(eng, ids) == want
    want = _view(eng, ids), seen(eng, ids)
    again = reopen(eng, slots=4, crash=True)
    assert (_view(again, ids), seen(again, ids)) == want


def test_a_store_of_the_schema_before_abort_records_is_refused_by_name():
    # Schema 2 code reads an abort's lean rows from their own records: a store it wrote has
    # none, and one this code wrote would be misread by it, so neither opens the other's.
    with pytest.raises(CorruptRecord, match="schema 2: a store written by older code"):
        check_schema(0, msgpack.packb(2))
    assert SCHEMA_VERSION > 3


def abort_keys(store):
    """The keys of abort records (``a`` + row: the reason; ``r`` + row: the rows) held."""
    return [key for p in range(store.partitions)
            for key, _ in store.scan_range(p, "attempts", b"a", b"s")
            if len(key) == 9 and key[:1] in (b"a", b"r")]


@pytest.mark.parametrize("reload_at", [None, "before_reclaim", "between_reclaims"])
def test_an_aborts_records_leave_the_store_with_its_last_row(reload_at):
    # The root has a Python record (its attempts were read), so it ends one by one and its
    # own row does not point at the abort: only the lean children do.
    eng = engine(slots=2)
    [root] = eng.enqueue_many([spec("root")])
    kids = eng.enqueue_fanout(spec("k", root), [f"k{i}" for i in range(6)])
    eng.clock.advance(1)
    eng.tick()
    eng.attempts(root)
    eng.clock.advance(1)
    eng.abort(root, reason="enough")
    assert len(abort_keys(eng.store)) == 2
    if reload_at == "before_reclaim":
        eng = reopen(eng, slots=2, crash=True)
    for a in eng.tick():    # the cleanup of what ran
        assert eng.report(a.token, Phase.SUCCEEDED) == Verdict.OK
    assert eng.attempts(kids[3])[0].message == "enough"
    assert eng.reclaim() == 6           # the children first, then their parent
    if reload_at == "between_reclaims":     # the reason cached in memory is gone
        eng = reopen(eng, slots=2, crash=True)
    assert eng.reclaim() == 1
    assert eng.inspect().abort_rows() == {}
    assert abort_keys(eng.store) == []
    eng = reopen(eng, slots=2, crash=True)
    assert abort_keys(eng.store) == []
