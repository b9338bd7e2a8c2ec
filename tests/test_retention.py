"""Bounded memory: ended actions' rows are reclaimed, their outcomes retained in the store.

What a user sees: an ended action stays answerable (explain, attempts, phase) for
``storage.retention`` after its row went back to the free list; re-enqueueing its id is
idempotent against the retained outcome; a token of the row's old action is refused forever;
memory (the action table) is bounded by live work; a reload keeps all of it.
"""

import copy
from dataclasses import replace

import lmdb
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import (
    ActionSpec,
    AlreadyExists,
    Engine,
    ManualClock,
    NotFound,
    Phase,
    SpecError,
    Timeouts,
    is_content_key,
    parse_config,
)
from engine._codes import PHASES, LeaseKind, RowState, Verdict
from engine._retain import RETENTION_BATCH
from storage import SCHEMA_VERSION, CorruptRecord, LmdbStore, MemoryStore, partition_of
from tests.conftest import hash_names_with, make_engine


def config(capacity=16, retention=None, scheduling="GREEDY_CAPACITY", path=None):
    cfg = {
        "resources": ["cpu"],
        "clusters": {"east": {}},
        "queues": {"main": {"scheduling": scheduling, "depth": 100000}},
        "engine": {"default_queue": "main", "initial_capacity": capacity},
    }
    if retention is not None or path is not None:
        cfg["storage"] = {}
        if retention is not None:
            cfg["storage"]["retention"] = retention
        if path is not None:
            cfg["storage"].update(path=str(path), partitions=4, map_size="4Mi")
    return cfg


def template(run, tenant="acme", **kw):
    return ActionSpec(id=f"{tenant}/p/d/{run}/x", task="t", resources={"cpu": 1}, **kw)


def run_to_success(eng, batch=None):
    tokens = {}
    for a in eng.tick():
        tokens[str(a.action)] = a.token
        assert eng.report(a.token, Phase.SUCCEEDED) == Verdict.OK
    return tokens


def test_reclaimed_action_answers_from_the_store_and_its_row_is_reused():
    eng, clock = make_engine(config())
    ids = eng.enqueue_fanout(template("r1"), [f"a{i}" for i in range(10)])
    clock.advance(1)
    tokens = run_to_success(eng)
    before = {str(a): eng.attempts(a) for a in ids}
    assert eng.reclaim() == 10
    view = eng.inspect()
    assert view.free_rows.tolist() == list(range(10))
    for a in ids:
        assert view.find(a) is None
        assert eng.explain(a).phase == Phase.SUCCEEDED
        assert eng.phase(a) == Phase.SUCCEEDED
        assert eng.attempts(a) == before[str(a)]
    gens = view.arrays.a_gen[:10].copy()
    # New work takes the reclaimed rows: the table does not grow.
    new = eng.enqueue_fanout(template("r2"), [f"b{i}" for i in range(10)])
    view = eng.inspect()
    assert view.action_rows == 10 and view.free_rows.size == 0
    assert sorted(view.find(a) for a in new) == list(range(10))
    # ... and their generations count on from the old ones: an old token is refused, first
    # with how its lease ended, and STALE once the row has a newer lease.
    np.testing.assert_array_equal(view.arrays.a_gen[:10], gens)
    old = tokens[str(ids[0])]
    assert eng.report(old, Phase.RUNNING) == Verdict.COMPLETED
    run_to_success(eng)
    assert eng.report(old, Phase.SUCCEEDED) == Verdict.STALE
    assert [r.verdict for r in eng.heartbeat("w-east", [old])] == [Verdict.STALE]


@pytest.mark.parametrize("kept_first", [True, False])
def test_a_reclaim_where_every_name_shares_one_hash_keeps_the_others_findable(
        monkeypatch, kept_first):
    """The index holds one row a name hash (the others are the collisions'): reclaiming
    rows of that hash takes out their own entries only, whichever row the index held."""
    hash_names_with(monkeypatch, lambda text: 7)      # every name collides
    eng, clock = make_engine(config())
    order = [("kept", ["k0", "k1"]), ("gone", ["g0", "g1", "g2"])]
    ids = {run: eng.enqueue_fanout(template(run), names)
           for run, names in (order if kept_first else order[::-1])}
    clock.advance(1)
    for a in eng.tick():
        if a.action.run == "gone":
            assert eng.report(a.token, Phase.SUCCEEDED) == Verdict.OK
    assert eng.reclaim() == 3
    view = eng.inspect()
    assert all(view.find(a) is not None for a in ids["kept"])
    assert len({view.find(a) for a in ids["kept"]}) == 2
    assert all(view.find(a) is None for a in ids["gone"])
    assert all(eng.phase(a) == Phase.SUCCEEDED for a in ids["gone"])
    assert all(eng.phase(a) == Phase.INITIALIZING for a in ids["kept"])


def test_a_reclaim_of_a_collision_below_the_row_the_index_holds_leaves_no_stale_entry(
        monkeypatch):
    """A name hash's index entry can name a row above one of its collisions (the first
    holder was reclaimed, a later name of that hash took a new row): reclaiming both
    leaves the hash unindexed, and the names answer from the store."""
    from engine._records import name_hash as real_hash

    hash_names_with(monkeypatch, lambda text: 7 if text.rsplit("/", 1)[1].startswith("c")
                    else real_hash(text))
    assert real_hash("acme/p/d/three/u0") != 7
    eng, clock = make_engine(config())
    view = eng.inspect()
    c0, = eng.enqueue_fanout(template("one"), ["c0"])      # row 0 holds hash 7
    c1, = eng.enqueue_fanout(template("two"), ["c1"])      # row 1, a collision
    clock.advance(1)
    held = {str(a.action): a.token for a in eng.tick()}
    assert eng.report(held[str(c0)], Phase.SUCCEEDED) == Verdict.OK
    assert eng.reclaim() == 1                               # row 0 free, hash 7 unheld
    eng.enqueue_fanout(template("three"), ["u0"])           # takes row 0
    c2, = eng.enqueue_fanout(template("four"), ["c2"])     # row 2 holds hash 7
    assert (view.find(c1), view.find(c2)) == (1, 2)
    clock.advance(1)
    held.update({str(a.action): a.token for a in eng.tick()})
    for a in (c1, c2):
        assert eng.report(held[str(a)], Phase.SUCCEEDED) == Verdict.OK
    assert eng.reclaim() == 2                               # rows 1 and 2, in that order
    assert view.find(c1) is None and view.find(c2) is None
    assert eng.phase(c1) == eng.phase(c2) == Phase.SUCCEEDED
    c3, = eng.enqueue_fanout(template("five"), ["c3"])
    assert view.find(c3) is not None and eng.phase(c3) == Phase.QUEUED


def test_reenqueue_of_a_retained_action_is_idempotent_and_a_different_spec_refused():
    eng, clock = make_engine(config())
    spec = template("r1")
    ids = eng.enqueue_fanout(spec, ["a0", "a1"], inputs=["s3://in/0", "s3://in/1"])
    [single] = eng.enqueue_many([ActionSpec(id="acme/p/d/r1/solo", task="t",
                                            resources={"cpu": 1})])
    run_to_success(eng)
    assert eng.reclaim() == 3
    commits = eng.store.commits
    assert list(eng.enqueue_fanout(spec, ["a0", "a1"], inputs=["s3://in/0", "s3://in/1"])) \
        == list(ids)
    assert eng.enqueue(ActionSpec(id="acme/p/d/r1/solo", task="t",
                                  resources={"cpu": 1})) == single
    assert eng.store.commits == commits and eng.inspect().free_rows.size == 3
    with pytest.raises(AlreadyExists, match="a0 exists with a different spec"):
        eng.enqueue_fanout(spec, ["a0"], inputs=["s3://other"])
    with pytest.raises(AlreadyExists, match="solo exists with a different spec"):
        eng.enqueue(ActionSpec(id="acme/p/d/r1/solo", task="t", resources={"cpu": 2}))
    assert eng.store.commits == commits


def test_a_row_with_children_in_the_table_is_not_reclaimed():
    eng, clock = make_engine(config())
    [parent] = eng.enqueue_many([ActionSpec(id="acme/p/d/r/root", task="t",
                                            resources={"cpu": 1})])
    [lease] = eng.tick()
    eng.report(lease.token, Phase.RUNNING)
    kids = eng.enqueue_fanout(ActionSpec(id="acme/p/d/r/k", task="t", parent=str(parent),
                                         resources={"cpu": 1}), ["k0", "k1"])
    eng.report(lease.token, Phase.SUCCEEDED)
    assert eng.reclaim() == 0          # the parent has ended, but has children in the table
    for a in eng.tick():
        if a.action == kids[0]:
            eng.report(a.token, Phase.SUCCEEDED)
    assert eng.reclaim() == 1          # k0; k1 still runs, so the parent stays
    view = eng.inspect()
    assert view.find(parent) is not None and view.children(view.find(parent)) == [
        view.find(kids[1])]
    eng.abort(parent)                  # reaches k1 through the children index
    assert eng.phase(kids[1]) == Phase.ABORTED
    assert eng.reclaim() == 0          # k1's finalize lease has not ended
    assert eng.explain(kids[0]).phase == Phase.SUCCEEDED


def test_a_stale_timer_of_a_reclaimed_row_does_not_act_on_its_next_action():
    eng, clock = make_engine(config())
    [a] = eng.enqueue_many([template("r1", timeouts=Timeouts(deadline=100))])
    run_to_success(eng)
    assert eng.reclaim() == 1
    eng.unregister_worker("w-east")    # nothing runs: the next action stays queued
    [b] = eng.enqueue_many([template("r2")])
    assert eng.inspect().find(b) == 0
    clock.advance(200)                 # past a's deadline
    eng.schedule()
    assert eng.phase(b) == Phase.WAITING_FOR_RESOURCES and eng.phase(a) == Phase.SUCCEEDED
    assert eng.inspect().arrays.a_state[0] == RowState.QUEUED


def test_retained_keys_sort_a_runs_outcomes_by_name_and_long_names_stay_distinct():
    """A retained key is the run's digest then the name, so a fan-out's outcomes (numbered
    names) land side by side in the store in name order; names too long for a key whole are
    cut and end in their digest, and still answer (and expire) each for itself."""
    eng, clock = make_engine(config(retention="10s"))
    long_a, long_b = "n" * 450 + "a", "n" * 450 + "b"      # the same first 391 bytes
    names = [f"a{i:03d}" for i in range(12)] + [long_a, long_b]
    spec = template("r1")
    ids = eng.enqueue_fanout(spec, names)
    run_to_success(eng)
    assert eng.reclaim() == len(names)
    stored = [key for p in range(eng.store.partitions)
              for key, _ in eng.store.scan_range(p, "retained", b"", b"\xff" * 9)]
    keys = [key for key in stored if not is_content_key(key)]
    # The fan-out's spec once, beside its outcomes (they name it).
    assert len([key for key in stored if is_content_key(key)]) == 1
    assert len(keys) == len(names) and max(map(len, keys)) <= 511
    assert [key[8:] for key in keys[:12]] == [n.encode() for n in names[:12]]
    assert len({key[8:400] for key in keys[12:]}) == 1 and keys[12] != keys[13]
    for a in ids:
        assert eng.phase(a) == Phase.SUCCEEDED
    assert list(eng.enqueue_fanout(spec, names)) == list(ids)         # idempotent
    with pytest.raises(AlreadyExists, match="exists with a different spec"):
        eng.enqueue_fanout(spec, [long_b], inputs=["s3://other"])
    clock.advance(11)
    assert eng.sweep_retention() == len(names)
    with pytest.raises(NotFound):
        eng.explain(ids[-1])
    for db in ("expiry", "retained"):       # the spec's content went with its outcomes
        assert not [key for p in range(eng.store.partitions)
                    for key, _ in eng.store.scan_range(p, db, b"", b"\xff" * 9)]


def test_known_answers_a_malformed_id_of_a_run_retired_by_a_turn_not_yet_committed():
    # A run whose last actions a pending turn reclaimed is noted under a marker key; an id
    # with an empty name must not read that marker as its retained outcome.
    eng, clock = make_engine(config())
    ids = eng.enqueue_fanout(template("r1"), ["a0", "a1"])
    run_to_success(eng)
    bad = str(ids[0]).rpartition("/")[0] + "/"
    assert eng.known([str(ids[0]), bad]).tolist() == [True, False]
    with eng.deferred_turn() as reclaimed:
        assert eng.reclaim() == 2
    with eng.deferred_turn() as again:
        assert eng.known([str(ids[0]), bad]).tolist() == [True, False]
    eng.commit(reclaimed)
    eng.commit(again)
    assert eng.known([str(ids[0]), bad]).tolist() == [True, False]


def test_a_store_of_the_schema_before_retained_specs_by_key_is_refused_by_name(tmp_path):
    # Schema 4 kept a copy of the spec in each retained outcome: this code would read it as
    # a content key and find no spec, so it does not open that store.
    store = LmdbStore(tmp_path / "db", partitions=2, map_size=1 << 20)
    store.open("s", 1)
    store.close()
    env = lmdb.open(str(tmp_path / "db" / "p00"), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.put(b"schema", msgpack.packb(4), db=env.open_db(b"meta", txn=txn))
    env.close()
    with pytest.raises(CorruptRecord, match="schema 4: a store written by older code"):
        LmdbStore(tmp_path / "db", partitions=2, map_size=1 << 20).open("s", 2)
    assert SCHEMA_VERSION > 4


def test_retention_deletes_expired_outcomes_in_batches_and_frees_the_id():
    eng, clock = make_engine(config(retention="10s"))
    spec = template("r1")
    ids = eng.enqueue_fanout(spec, [f"a{i}" for i in range(5)])
    run_to_success(eng)
    assert eng.reclaim() == 5
    clock.advance(9)
    assert eng.sweep_retention() == 0 and eng.phase(ids[0]) == Phase.SUCCEEDED
    clock.advance(2)
    assert eng.sweep_retention(limit=2) == 2     # per partition, at most the limit
    assert eng.sweep_retention() == 3
    for a in ids:
        with pytest.raises(NotFound):
            eng.explain(a)
    # The id is free again: a new action of it is enqueued (and queued).
    eng.enqueue_fanout(spec, ["a0"])
    assert eng.phase(ids[0]) == Phase.QUEUED


def _contents(eng):
    """The spec contents stored beside retained outcomes, over every partition."""
    return [key for p in range(eng.store.partitions)
            for key, _ in eng.store.scan_range(p, "retained", b"", b"\xff" * 9)
            if is_content_key(key)]


def test_a_spec_is_kept_once_while_any_retained_outcome_names_it():
    # Two fan-outs of one run (one spec), reclaimed 5 s apart: one stored content serves
    # both; the first's expiry leaves it for the second, whose own takes it.
    eng, clock = make_engine(config(retention="10s"))
    first = eng.enqueue_fanout(template("r1"), ["a0", "a1", "a2"])
    run_to_success(eng)
    assert eng.reclaim() == 3
    clock.advance(5)
    second = eng.enqueue_fanout(template("r1"), ["b0", "b1"])
    run_to_success(eng)
    assert eng.reclaim() == 2
    assert len(_contents(eng)) == 1
    clock.advance(6)
    assert eng.sweep_retention() == 3
    assert len(_contents(eng)) == 1
    for a in second:
        assert eng.explain(a).phase == Phase.SUCCEEDED
    assert list(eng.enqueue_fanout(template("r1"), ["b0", "b1"])) == list(second)
    with pytest.raises(NotFound):
        eng.explain(first[0])
    clock.advance(5)
    assert eng.sweep_retention() == 2
    assert _contents(eng) == []


def test_a_spec_outlives_its_outcomes_when_a_later_reclaim_has_a_shorter_retention(
        tmp_path):
    # Reopened with a shorter retention, a later reclaim of the same spec must not bring
    # the stored content's end forward: the first run's outcomes still name it.
    clock = ManualClock()

    def reopen(retention):
        cfg = parse_config(config(retention=retention, path=tmp_path / "db"), source="<t>")
        eng = Engine(cfg, clock=clock)
        eng.register_worker("w", "east", 100)
        return eng

    eng = reopen("100s")
    first = eng.enqueue_fanout(template("r1"), ["a0"])
    run_to_success(eng)
    assert eng.reclaim() == 1
    eng.close()
    eng = reopen("10s")
    second = eng.enqueue_fanout(template("r1"), ["b0"])
    run_to_success(eng)
    assert eng.reclaim() == 1
    clock.advance(11)
    assert eng.sweep_retention() == 1
    with pytest.raises(NotFound):
        eng.explain(second[0])
    assert eng.explain(first[0]).phase == Phase.SUCCEEDED
    assert list(eng.enqueue_fanout(template("r1"), ["a0"])) == list(first)
    eng.close()


def test_a_sweep_keeps_a_spec_a_reclaim_not_yet_committed_names():
    eng, clock = make_engine(config(retention="10s"))
    first = eng.enqueue_fanout(template("r1"), ["a0"])
    run_to_success(eng)
    assert eng.reclaim() == 1
    clock.advance(5)
    second = eng.enqueue_fanout(template("r1"), ["b0"])
    run_to_success(eng)
    clock.advance(6)
    with eng.deferred_turn() as reclaimed:
        assert eng.reclaim() == 1
    with eng.deferred_turn() as swept:
        assert eng.sweep_retention() == 1
    eng.commit(reclaimed)
    eng.commit(swept)
    with pytest.raises(NotFound):
        eng.explain(first[0])
    assert eng.explain(second[0]).phase == Phase.SUCCEEDED
    assert len(_contents(eng)) == 1


def test_a_retained_outcome_whose_spec_is_missing_is_a_corrupt_record_naming_it():
    eng, clock = make_engine(config())
    ids = eng.enqueue_fanout(template("r1"), ["a0"])
    run_to_success(eng)
    assert eng.reclaim() == 1
    [key] = _contents(eng)
    part = next(p for p in range(eng.store.partitions)
                if eng.store.get(p, "retained", key) is not None)
    eng.store.commit({part: [("retained", key, None)]})
    with pytest.raises(CorruptRecord, match=f"spec content the retained outcome of {ids[0]}"):
        eng.explain(ids[0])


def test_schedule_sweeps_expired_outcomes_about_once_a_second():
    eng, clock = make_engine(config(retention=5))
    ids = eng.enqueue_fanout(template("r1"), ["a0"])
    run_to_success(eng)
    eng.reclaim()
    clock.advance(6)
    eng.schedule()
    with pytest.raises(NotFound):
        eng.explain(ids[0])


def fifty_runs_through():
    """An engine after 50 runs of 20 actions each went through on a 64-row table."""
    eng, _clock = make_engine(config(capacity=64), workers={"w": ("east", 32)})
    for b in range(50):
        eng.enqueue_fanout(template(f"r{b}"), [f"a{i}" for i in range(20)])
        for a in eng.tick():
            eng.report(a.token, Phase.SUCCEEDED)
    return eng


def test_the_table_is_bounded_by_live_work_not_by_history():
    eng = fifty_runs_through()
    view = eng.inspect()
    assert view.arrays.a_state.shape[0] == 64     # never grew
    assert view.action_rows <= 64
    assert eng.explain("acme/p/d/r0/x".replace("/x", "/a3")).phase == Phase.SUCCEEDED


def test_reload_keeps_free_rows_generations_retained_outcomes_and_fifo(tmp_path):
    cfg = parse_config(config(path=tmp_path / "s", scheduling="STRICT_FIFO"), source="<t>")
    clock = ManualClock()
    eng = Engine(cfg, clock=clock)
    eng.register_worker("w", "east", 100)
    first = eng.enqueue_fanout(template("r1", tenant="acme"), [f"a{i}" for i in range(8)])
    tokens = run_to_success(eng)
    assert eng.reclaim() == 8
    eng.unregister_worker("w")
    # Another tenant (another partition) reuses rows 0..3; then more work on new rows.
    clock.advance(1)
    early = eng.enqueue_fanout(template("r2", tenant="zeta"), [f"b{i}" for i in range(4)])
    clock.advance(1)
    late = eng.enqueue_fanout(template("r3", tenant="acme"), [f"c{i}" for i in range(6)])
    view = eng.inspect()
    before = {n: getattr(view.arrays, n)[:view.action_rows].copy()
              for n in ("a_state", "a_gen", "a_released_gen", "a_end", "a_seq")}
    free_before = view.free_rows.tolist()
    eng.close()

    eng = Engine(cfg, clock=clock)
    view = eng.inspect()
    assert view.free_rows.tolist() == free_before
    for name, values in before.items():
        np.testing.assert_array_equal(getattr(view.arrays, name)[:view.action_rows], values,
                                      err_msg=name)
    assert eng.explain(first[5]).phase == Phase.SUCCEEDED
    assert eng.report(tokens[str(first[1])], Phase.RUNNING) in (Verdict.COMPLETED,
                                                                Verdict.STALE)
    # Lanes come back in enqueue order, whatever the row numbers: the reloaded engine
    # places exactly what one that never restarted places, in the same order.
    eng.register_worker("w", "east", 100)
    order = [str(a.action) for a in eng.tick()]
    eng.close()
    twin = Engine(parse_config(config(path=tmp_path / "twin", scheduling="STRICT_FIFO"),
                               source="<t>"), clock=ManualClock())
    twin.register_worker("w", "east", 100)
    twin.enqueue_fanout(template("r1", tenant="acme"), [f"a{i}" for i in range(8)])
    run_to_success(twin)
    twin.reclaim()
    twin.unregister_worker("w")
    twin.enqueue_fanout(template("r2", tenant="zeta"), [f"b{i}" for i in range(4)])
    twin.enqueue_fanout(template("r3", tenant="acme"), [f"c{i}" for i in range(6)])
    twin.register_worker("w", "east", 100)
    assert order == [str(a.action) for a in twin.tick()]
    assert sorted(order) == sorted(str(a) for a in [*early, *late])
    twin.close()


def reused_across_partitions(tmp_path, names, finish):
    """An engine on LMDB whose rows four runs took in turn, each of another tenant than the
    one before (another partition), each run finished by ``finish(eng, clock)`` and its rows
    reclaimed. Returns (config, clock, engine)."""
    cfg = parse_config(config(path=tmp_path / "s"), source="<t>")
    clock = ManualClock()
    eng = Engine(cfg, clock=clock)
    eng.register_worker("w-east", "east", 100)
    for tenant in ("acme", "zeta", "acme", "beta"):
        eng.enqueue_fanout(template(f"r-{tenant}-{clock.now_ns()}", tenant=tenant), names)
        finish(eng, clock)
        assert eng.reclaim() == len(names)
        clock.advance(1)
    return cfg, clock, eng


def test_a_reload_takes_the_newest_free_record_of_a_row_reused_across_partitions(tmp_path):
    cfg, clock, eng = reused_across_partitions(tmp_path, ["a"],
                                               lambda eng, _clock: run_to_success(eng))
    gen = int(eng.inspect().arrays.a_gen[0])
    assert gen == 4
    eng.close()
    eng = Engine(cfg, clock=clock)
    assert eng.inspect().free_rows.tolist() == [0]
    assert int(eng.inspect().arrays.a_gen[0]) == gen
    eng.close()


# ------------------------------------------------------------------ property

ops = st.lists(st.sampled_from(["enqueue", "tick", "succeed", "fail", "abort", "reclaim",
                                "advance"]), min_size=5, max_size=60)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, seed=st.integers(0, 1 << 16))
def test_a_token_of_a_reclaimed_rows_old_action_is_always_refused(ops, seed):
    """Every token ever handed out for an action that has since ended (or been superseded)
    is refused by heartbeat and report, whatever rows are reclaimed and reused between."""
    import random
    rng = random.Random(seed)
    eng, clock = make_engine(config(capacity=16), store=MemoryStore(2),
                             workers={"w": ("east", 6)})
    live = {}        # token -> action id (its lease is current)
    dead = []        # tokens whose lease ended
    run = 0
    for op in ops:
        if op == "enqueue":
            run += 1
            eng.enqueue_fanout(template(f"r{run}", tenant=rng.choice(["acme", "zeta"])),
                               [f"a{i}" for i in range(rng.randint(1, 5))])
        elif op == "tick":
            for a in eng.tick():
                if a.kind == LeaseKind.FINALIZE:
                    # Cleanup after an abort: done at once (then the row may be reclaimed).
                    assert eng.report(a.token, Phase.SUCCEEDED) == Verdict.OK
                    dead.append(a.token)
                else:
                    live[a.token] = str(a.action)
        elif op in ("succeed", "fail") and live:
            tok = rng.choice(sorted(live))
            phase = Phase.SUCCEEDED if op == "succeed" else Phase.FAILED
            kw = {} if op == "succeed" else {"error_kind": "USER", "recoverable": False}
            eng.report(tok, phase, **kw)    # (refused if its lease expired meanwhile)
            del live[tok]
            dead.append(tok)
        elif op == "abort" and live:
            tok = rng.choice(sorted(live))
            eng.abort(live.pop(tok))
            dead.append(tok)
        elif op == "reclaim":
            eng.reclaim()
        else:
            clock.advance(rng.choice([0.1, 1.0]))
            eng.heartbeat("w", sorted(live))
        if dead:
            refused = {r.token: r.verdict for r in eng.heartbeat("w", dead)}
            assert set(refused) == set(dead), "a dead token was accepted"
            assert Verdict.OK not in refused.values()
            tok = rng.choice(dead)
            assert eng.report(tok, Phase.SUCCEEDED) != Verdict.OK
    view = eng.inspect()
    free = view.free_rows
    assert (view.arrays.a_state[free] == RowState.FREE).all()


def test_retained_outcomes_of_lean_rows_are_what_the_table_said():
    """Reclaiming writes lean rows' outcomes from their columns: attempts() and explain()
    after it give exactly what they gave before, for every way a lean row ends."""
    eng, clock = make_engine(config(), workers={"w": ("east", 2)})
    [root] = eng.enqueue_many([ActionSpec(id="acme/p/d/r/root", task="t",
                                          resources={"cpu": 1})])
    kids = eng.enqueue_fanout(ActionSpec(id="acme/p/d/r/k", task="t", parent=str(root),
                                         resources={"cpu": 1}), ["k0", "k1", "k2", "k3"])
    clock.advance(1)
    placed = eng.tick()                 # root and one kid run; the rest wait for a slot
    running = [a for a in placed if a.action != root]
    eng.report(running[0].token, Phase.RUNNING)
    clock.advance(1)
    eng.abort(root, reason="operator said stop")
    for a in eng.tick():                # the finalize leases of what was running
        assert a.kind == LeaseKind.FINALIZE
        clock.advance(1)
        eng.report(a.token, Phase.SUCCEEDED)
    every = [root, *kids]
    before = {str(a): (eng.attempts(a), eng.explain(a)) for a in every}
    assert {e.phase for _atts, e in before.values()} == {Phase.ABORTED}
    assert eng.reclaim() == len(kids)   # children first: the root's row goes next time
    assert eng.reclaim() == 1
    for a in every:
        assert eng.inspect().find(a) is None
        atts, exp = before[str(a)]
        assert eng.attempts(a) == atts
        assert (eng.explain(a).phase, eng.explain(a).reason) == (exp.phase, exp.reason)
    assert any(t.finalize == "SUCCEEDED" for a in every for t in eng.attempts(a))
    assert {t.message for a in kids for t in eng.attempts(a)} == {"operator said stop"}


def test_an_outcome_retained_by_a_group_not_yet_committed_keeps_reenqueue_idempotent():
    """A pipelined shard decides the next turn before the last one's commit returns: an
    action reclaimed in a pending group is found in that group, not taken for a new one."""
    eng, clock = make_engine(config())
    spec = template("r1")
    ids = eng.enqueue_fanout(spec, ["a0", "a1"])
    solo = ActionSpec(id="acme/p/d/r1/solo", task="t", resources={"cpu": 1})
    [single] = eng.enqueue_many([solo])
    run_to_success(eng)
    with eng.deferred_turn() as reclaimed:
        assert eng.reclaim() == 3
    with eng.deferred_turn() as again:
        assert list(eng.enqueue_fanout(spec, ["a0", "a1"])) == list(ids)
        assert eng.enqueue(solo) == single
        assert eng.phase(single) == Phase.SUCCEEDED
    assert eng.inspect().free_rows.size == 3     # nothing enqueued anew
    eng.commit(reclaimed)
    eng.commit(again)
    assert eng.phase(single) == Phase.SUCCEEDED and eng.inspect().free_rows.size == 3


def test_a_reclaimed_blocked_head_is_not_named_as_its_queues_head_once_its_row_is_reused():
    """A queue's blocked head is a row number kept until the kernel scans the queue again:
    reclaimed and reused by another queue's action, it must not be reported as the head
    (regression: the engine state machine found queue_metrics naming the new action)."""
    eng, clock = make_engine({
        "resources": ["cpu"],
        "clusters": {"east": {"capacity": {"cpu": 4}}},
        "queues": {"fifo": {"scheduling": "STRICT_FIFO"},
                   "other": {"scheduling": "GREEDY_CAPACITY"}},
        "engine": {"default_queue": "fifo", "initial_capacity": 16},
    })
    eng.enqueue(ActionSpec(id="acme/p/d/r1/small", task="t", resources={"cpu": 2}))
    assert len(eng.tick()) == 1                       # holds 2 of the 4 cpus
    head = eng.enqueue(ActionSpec(id="acme/p/d/r1/big", task="t", resources={"cpu": 4}))
    assert eng.tick() == []
    assert eng.queue_metrics("fifo")["head_blocked"]["action"] == str(head)
    eng.abort(head)
    assert eng.reclaim() == 1
    [row] = eng.inspect().free_rows.tolist()
    other = eng.enqueue(ActionSpec(id="acme/p/d/r2/x", task="t", task_queue="other",
                                   resources={"cpu": 8}))
    assert eng.inspect().find(other) == row           # the head's old row, reused
    assert eng.queue_metrics("fifo")["head_blocked"] is None


# ------------------------------------------------------------------ finalize rows


def _run_with_cleanup(eng, clock):
    """Every placed attempt succeeds asking for cleanup; every finalize lease then succeeds.
    Returns the finalize tokens."""
    done = []
    for a in eng.tick():
        assert eng.report(a.token, Phase.SUCCEEDED, cleanup=True) == Verdict.OK
    clock.advance(1)
    for a in eng.tick():
        assert a.kind == LeaseKind.FINALIZE
        assert eng.report(a.token, Phase.SUCCEEDED) == Verdict.OK
        done.append(a.token)
    return done


def test_finalize_rows_are_freed_with_their_actions_and_reused():
    eng, clock = make_engine(config())
    ids = eng.enqueue_fanout(template("r0"), ["a0", "a1", "a2"])
    old = _run_with_cleanup(eng, clock)
    assert len(old) == 3 and eng.inspect().finalize_rows == 3
    assert all(t.finalize == "SUCCEEDED" for a in ids for t in eng.attempts(a))
    assert eng.reclaim() == 3
    view = eng.inspect()
    assert view.free_finalize_rows.tolist() == [0, 1, 2]
    assert (view.arrays.fz_state[:3] == RowState.FREE).all()
    gens = view.arrays.fz_gen[:3].copy()
    # The retained outcomes still say how cleanup went.
    assert all(t.finalize == "SUCCEEDED" for a in ids for t in eng.attempts(a))
    for r in range(1, 30):
        eng.enqueue_fanout(template(f"r{r}"), ["a0", "a1", "a2"])
        _run_with_cleanup(eng, clock)
        assert eng.reclaim() == 3
    view = eng.inspect()
    assert view.finalize_rows == 3, "finalize rows grew with history"
    assert (view.arrays.fz_gen[:3] > gens).all()    # generations count on
    # The first round's finalize tokens are refused forever, never accepted.
    for tok in old:
        assert eng.report(tok, Phase.SUCCEEDED) != Verdict.OK
        assert [r.verdict for r in eng.heartbeat("w-east", [tok])] != []


def test_a_freed_finalize_rows_stale_give_up_timer_does_not_abandon_its_next_lease():
    cfg = config()
    cfg["engine"]["finalize_timeout"] = 10
    eng, clock = make_engine(cfg)
    eng.enqueue_fanout(template("r0"), ["a0"])
    _run_with_cleanup(eng, clock)          # its give-up timer stays armed, due at ~11 s
    assert eng.reclaim() == 1
    clock.advance(5)
    [a] = eng.enqueue_fanout(template("r1"), ["b0"])
    for x in eng.tick():
        eng.report(x.token, Phase.SUCCEEDED, cleanup=True)
    [fz] = eng.tick()
    assert fz.kind == LeaseKind.FINALIZE and eng.inspect().finalize_rows == 1
    clock.advance(7)                       # the old bound passed, the new one has not
    eng.tick()
    assert eng.report(fz.token, Phase.SUCCEEDED) == Verdict.OK
    assert [t.finalize for t in eng.attempts(a)] == ["SUCCEEDED"]


def test_reload_keeps_freed_finalize_rows_reused_across_partitions(tmp_path):
    cfg, clock, eng = reused_across_partitions(tmp_path, ["a", "b"], _run_with_cleanup)
    view = eng.inspect()
    gens = view.arrays.fz_gen[:2].copy()
    assert view.finalize_rows == 2 and (gens == 4).all()
    eng.close()
    eng = Engine(cfg, clock=clock)
    view = eng.inspect()
    assert view.free_finalize_rows.tolist() == [0, 1]
    np.testing.assert_array_equal(view.arrays.fz_gen[:2], gens)
    eng.register_worker("w-east", "east", 100)
    eng.enqueue_fanout(template("r-last", tenant="zeta"), ["a"])
    _run_with_cleanup(eng, clock)
    assert eng.inspect().finalize_rows == 2
    eng.close()


def test_runs_whose_actions_were_all_reclaimed_leave_memory_and_the_store():
    """A run is a row, (queue, run) pairs and lanes in memory and a record in the store;
    once every action of it is reclaimed they go, so they are bounded by live runs too."""
    eng = fifty_runs_through()
    view = eng.inspect()
    assert len(view.runs()) <= 4                # runs with actions still in the table
    assert len(view.run_keys()) <= 5            # run rows are reused ...
    assert len(view.qruns()) == len(view.runs())
    assert sorted(view.runs()) == sorted(run for _p, _k, raw in eng.store.scan("runs")
                                         for run in [msgpack.unpackb(raw)[0]])
    # ... and an action of a retired run still answers from its retained outcome.
    assert "acme/p/d/r0" not in view.runs()
    assert eng.explain("acme/p/d/r0/a3").phase == Phase.SUCCEEDED


def test_a_retired_run_keeps_reenqueue_idempotent_across_a_reload_and_starts_afresh(
        tmp_path):
    cfg = parse_config(config(path=tmp_path / "s"), source="<t>")
    clock = ManualClock()
    eng = Engine(cfg, clock=clock)
    eng.register_worker("w", "east", 100)
    spec = template("r1", run_max_action_concurrency=2)
    ids = eng.enqueue_fanout(spec, ["a0", "a1", "a2"])
    run_to_success(eng)
    run_to_success(eng)                         # two at a time: the run's cap
    assert eng.reclaim() == 3 and "acme/p/d/r1" not in eng.inspect().runs()
    eng.close()

    eng = Engine(cfg, clock=clock)
    assert "acme/p/d/r1" not in eng.inspect().runs()
    # Its ended actions are found in the store: the same spec is a no-op, another refused.
    assert list(eng.enqueue_fanout(spec, ["a0", "a1", "a2"])) == list(ids)
    assert eng.enqueue(replace(spec, id="acme/p/d/r1/a1")) == ids[1]
    assert eng.inspect().free_rows.size == 3 and not eng.inspect().runs()
    with pytest.raises(AlreadyExists, match="a2 exists with a different spec"):
        eng.enqueue_fanout(replace(spec, resources={"cpu": 2}), ["a2"])
    # A new action of the run starts it afresh, with the cap it declares now.
    eng.enqueue_fanout(template("r1", run_max_action_concurrency=3), ["b0"])
    assert eng.phase("acme/p/d/r1/a0") == Phase.SUCCEEDED     # still the retained one
    assert eng.phase("acme/p/d/r1/b0") == Phase.QUEUED
    assert eng.inspect().arrays.u_cap[eng.inspect().runs()["acme/p/d/r1"]] == 3
    eng.close()


def test_the_retention_sweep_keeps_pace_with_a_backlog():
    """``schedule()`` sweeps about once a second, but again on every tick while a batch
    came back full: expired outcomes never pile up behind a fast shard."""
    eng, clock = make_engine(config(retention=1, capacity=1024))
    n = RETENTION_BATCH * 2 + 10                # one tenant: one partition
    ids = eng.enqueue_fanout(template("r1"), [f"a{i}" for i in range(n)])
    run_to_success(eng)
    assert eng.reclaim() == n
    clock.advance(2)
    for _ in range(3):                          # no clock advance between these ticks
        eng.schedule()
    for a in (ids[0], ids[n // 2], ids[-1]):
        with pytest.raises(NotFound):
            eng.explain(a)
    assert not list(eng.store.scan("retained"))


NEVER_NS = np.iinfo(np.int64).max
PHASE_NAMES = tuple(p.value for p in PHASES)
ints = st.one_of(st.sampled_from([0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32,
                                  2**62, 2**63 - 2]), st.integers(0, 2**63 - 2))
texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=300)
lean_rows = st.lists(st.fixed_dictionaries({
    "prefix": st.sampled_from(["acme/p/d/r/", "t" * 40 + "/p/d/" + "r" * 200 + "/"]),
    "name": st.text("abc_.-0123456789", min_size=1, max_size=40),
    "content": st.binary(max_size=70_000).filter(lambda b: len(b) < 300 or len(b) > 65_000),
    "input": st.none() | texts,
    "queue": st.integers(0, 1),
    "phase": st.sampled_from([Phase.SUCCEEDED, Phase.ABORTED, Phase.QUEUED]),
    "enqueued": ints, "gen": ints, "start": ints | st.just(NEVER_NS),
    "running": ints | st.just(NEVER_NS), "done": ints | st.just(NEVER_NS),
    "cluster": st.integers(0, 1), "worker": st.integers(0, 1),
    "message": texts, "finalize": st.none() | st.sampled_from(["SUCCEEDED", "PENDING"]),
}), min_size=0, max_size=6)


def reference_value(r, queues, clusters, workers):
    """A lean row's retained value as the record path makes it (encode_outcome of its
    one attempt), with msgpack.packb."""
    from engine._index import ActionEdges
    from engine._leases import Attempt
    from engine._records import ATTEMPT_FIELDS, encode_outcome

    phase = r["phase"]
    ends = phase in (Phase.SUCCEEDED, Phase.ABORTED)
    message = r["message"] if phase == Phase.ABORTED else ""
    att = Attempt(number=1, enqueued_ns=r["enqueued"])
    if r["start"] != NEVER_NS:
        att.generation, att.start_ns = r["gen"], r["start"]
        att.cluster, att.worker = clusters[r["cluster"]], workers[r["worker"]]
    if r["running"] != NEVER_NS:
        att.running_ns = r["running"]
    if ends:
        att.end_ns, att.phase = r["done"], phase.value
    att.message = message
    att.finalize = r["finalize"]
    assert len(ATTEMPT_FIELDS) == 14
    rec = ActionEdges(compiled=None, row=0, phase=phase, message=message, attempts=[att])
    ended = r["done"] if r["done"] != NEVER_NS else 0
    return msgpack.packb([r["prefix"] + r["name"], r["content"], r["input"], ended,
                          queues[r["queue"]], encode_outcome(rec)], use_bin_type=True)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=lean_rows)
def test_lean_retained_values_are_msgpack_of_the_record(rows):
    """cext._retained packs a lean row's retained value byte for byte as msgpack.packb of
    its record would (every integer width, str and bin header, nil)."""
    from cext._retained import pack_lean_retained

    queues, clusters, workers = ("main", "q" * 40), ("east", "c" * 300), ("w", "ü" * 20)
    col = {k: [r[k] for r in rows] for k in (
        "prefix", "name", "content", "input", "queue", "phase", "enqueued", "gen", "start",
        "running", "done", "cluster", "worker", "message", "finalize")}
    i32 = lambda k: np.array(col[k], np.int32)      # noqa: E731
    i64 = lambda k: np.array(col[k], np.int64)      # noqa: E731
    got = pack_lean_retained(
        col["prefix"], col["name"], col["content"], col["input"], i32("queue"), queues,
        np.array([PHASES.index(p) for p in col["phase"]], np.uint8), PHASE_NAMES,
        i64("enqueued"), i64("gen"), i64("start"), i64("running"), i64("done"),
        i32("cluster"), clusters, i32("worker"), workers, col["message"], col["finalize"],
        PHASES.index(Phase.SUCCEEDED), PHASES.index(Phase.ABORTED))
    assert got == [reference_value(r, queues, clusters, workers) for r in rows]


def test_an_ended_parent_starts_no_children_before_or_after_its_row_is_reclaimed():
    """A child of an ended parent is refused whether the parent's row is still in the table
    or reclaimed: else an abort of the parent would cascade to it only before reclaim."""
    eng, clock = make_engine(config())
    [parent] = eng.enqueue_many([ActionSpec(id="acme/p/d/r/root", task="t",
                                            resources={"cpu": 1})])
    eng.enqueue_many([ActionSpec(id="acme/p/d/r/other", task="t", resources={"cpu": 1})])
    run_to_success(eng)
    child = ActionSpec(id="acme/p/d/r/k", task="t", parent=str(parent), resources={"cpu": 1})
    for in_table in (True, False):
        assert (eng.inspect().find(parent) is not None) == in_table
        commits = eng.store.commits
        with pytest.raises(SpecError, match="parent acme/p/d/r/root has ended \\(SUCCEEDED\\)"):
            eng.enqueue(child)
        with pytest.raises(SpecError, match="has ended"):
            eng.enqueue_fanout(child, ["k0", "k1"])
        assert eng.store.commits == commits
        assert eng.inspect().find("acme/p/d/r/k") is None
        if in_table:
            assert eng.reclaim() == 2


def test_a_sweep_keeps_an_outcome_reclaimed_again_since_an_earlier_sweep_not_committed():
    # The sweep lists expired entries from the store; one whose deletion an earlier sweep
    # of the same turn (or of a group still in commit) made is listed again, and its
    # outcome, retained anew by a later reclaim in between, was deleted with it: an
    # acknowledged outcome lost, and its id enqueued afresh.
    eng, clock = make_engine(config(retention=10))
    x = replace(template("r1"), id="acme/p/d/r1/a0")
    eng.enqueue(x)
    run_to_success(eng)
    assert eng.reclaim() == 1
    clock.advance(11)                               # its retention passed
    with eng.turn():
        assert eng.sweep_retention() == 1
        assert eng.enqueue_many([x]).added.tolist() == [True]    # (swept: a new action)
        run_to_success(eng)
        assert eng.reclaim() == 1                   # retained again, for 10 s from now
        assert eng.sweep_retention() == 0
    assert eng.phase(x.id) == Phase.SUCCEEDED
    assert eng.enqueue_many([x]).added.tolist() == [False]
    clock.advance(9)
    assert eng.sweep_retention() == 0
    assert eng.phase(x.id) == Phase.SUCCEEDED
    clock.advance(2)
    assert eng.sweep_retention() == 1               # its own retention, in full


def test_a_run_an_enqueue_was_checked_against_is_not_retired_by_its_own_reclaim():
    # The batch is checked against the run's cap (3), then makes room by reclaiming: the
    # run's one action had ended, so the run was retired and made again with the batch's
    # first declared cap (none): 7 of its actions in flight.
    eng, _clock = make_engine(config(capacity=16))
    run = "acme/p/d/r1"

    def act(name, cap):
        return ActionSpec(id=f"{run}/{name}", task="t", resources={"cpu": 1},
                          run_max_action_concurrency=cap)

    eng.enqueue(act("first", 3))
    run_to_success(eng)
    eng.enqueue_fanout(template("other"), [f"o{i}" for i in range(15)])   # the table full
    eng.enqueue_many([act("a0", 0)] + [act(f"b{i}", 3) for i in range(6)])
    view = eng.inspect()
    assert int(view.arrays.u_cap[view.runs()[run]]) == 3
    placed = [a for a in eng.tick() if str(a.action).startswith(run + "/")]
    assert len(placed) == 3


def test_giving_up_a_cleanup_never_granted_keeps_its_reused_rows_last_verdict():
    # A finalize row freed and reused by a lease that is given up before any worker took it
    # had its end overwritten (ABORTED) without a generation of its own: the previous
    # action's token was then refused ABORTED in memory but COMPLETED after a reload, which
    # read the older of two FREE records of one generation.
    cfg = config()
    cfg["engine"]["finalize_timeout"] = 60
    eng, clock = make_engine(cfg, store=MemoryStore(4))
    tenants = sorted(("echo", "beta", "corp", "delta", "zulu"),
                     key=lambda t: partition_of(t, 4))
    first, second = tenants[-1], tenants[0]     # two partitions, the second's scanned first
    assert partition_of(first, 4) != partition_of(second, 4)
    eng.enqueue(template("r1", tenant=first))
    (a,) = eng.tick()
    eng.report(a.token, Phase.SUCCEEDED, cleanup=True)
    (f,) = eng.tick()                           # its cleanup lease
    assert eng.report(f.token, Phase.SUCCEEDED) == Verdict.OK
    assert eng.reclaim() == 1
    eng.enqueue(template("r2", tenant=second))
    (b,) = eng.tick()
    eng.unregister_worker("w-east")             # nobody to take its cleanup
    eng.report(b.token, Phase.SUCCEEDED, cleanup=True)      # the freed finalize row, QUEUED
    clock.advance(61)
    eng.schedule()                              # given up, never granted
    assert eng.reclaim() == 1
    again = Engine(eng.config, clock=clock,
                   store=MemoryStore(4, backing=copy.deepcopy(eng.store.backing)))
    assert eng.report(f.token, Phase.SUCCEEDED) == Verdict.COMPLETED
    assert again.report(f.token, Phase.SUCCEEDED) == Verdict.COMPLETED



def test_enqueue_many_of_a_fanout_action_is_a_no_op_in_the_table_and_retained_alike():
    # Whether the same enqueue was a no-op depended on whether the row had been reclaimed:
    # in the table enqueue_many does not compare the input reference a fan-out gave (it
    # gives none), retained it did (AlreadyExists).
    eng, _clock = make_engine(config())
    [a0] = eng.enqueue_fanout(template("r1"), ["a0"], inputs=["s3://in/0"])
    plain = replace(template("r1"), id="acme/p/d/r1/a0")
    assert eng.enqueue_many([plain]).added.tolist() == [False]
    run_to_success(eng)
    assert eng.reclaim() == 1
    assert eng.enqueue_many([plain]).added.tolist() == [False]
    assert eng.phase(a0) == Phase.SUCCEEDED
    # A fan-out compares its input references, in the table and retained alike.
    with pytest.raises(AlreadyExists, match="exists with a different spec"):
        eng.enqueue_fanout(template("r1"), ["a0"], inputs=["s3://in/other"])
