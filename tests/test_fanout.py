"""Fan-out enqueue and lean rows: one spec for many actions, the common path in columns,
the Python record only where something unusual happens; all of it across restarts."""

import dataclasses

import numpy as np
import pytest

from engine import (
    ActionSpec,
    AlreadyExists,
    Engine,
    ManualClock,
    Phase,
    ResourceExhausted,
    RetryPolicy,
    SpecError,
    Timeouts,
    WaitCode,
    parse_config,
)
from engine._codes import LeaseKind, Verdict
from storage import MemoryStore
from tests.conftest import hash_names_with

CONFIG = {
    "resources": ["cpu", "memory"],
    "clusters": {"east": {"capacity": {"cpu": 64, "memory": "256Gi"}}},
    "queues": {"cpu": {"scheduling": "GREEDY_CAPACITY", "depth": 500}},
    "engine": {"default_queue": "cpu", "system_retries": 1},
}


def engine(store=None, clock=None):
    eng = Engine(parse_config(CONFIG), clock=clock or ManualClock(), store=store or MemoryStore(4))
    eng.register_worker("w", "east", 1000)
    return eng


def restart(eng):
    store = eng.store
    eng.close()
    again = Engine(eng.config, clock=eng.clock,
                   store=MemoryStore(store.partitions, backing=store.backing))
    again.register_worker("w", "east", 1000)
    return again


def template(name="map", **kw):
    kw.setdefault("resources", {"cpu": 1})
    return ActionSpec(id=f"acme/p/d/r/{name}", task="square", **kw)


def history(eng, aid):
    return [(a.number, a.generation, a.cluster, a.worker, a.start_ns, a.running_ns, a.end_ns,
             a.phase) for a in eng.attempts(aid)]


def test_a_fan_out_shares_one_group_and_runs_the_common_path_in_columns():
    eng = engine()
    ids = eng.enqueue_fanout(template(), [f"i{k}" for k in range(5)],
                             inputs=[f"s3://in/{k}" for k in range(5)])
    assert [str(a) for a in ids] == [f"acme/p/d/r/i{k}" for k in range(5)]
    view = eng.inspect()
    rows = [view.row_of(a) for a in ids]
    assert len(set(view.arrays.a_group[rows].tolist())) == 1
    assert eng.phase(ids[0]) == Phase.QUEUED
    eng.clock.advance(1)
    out = eng.tick()
    assert sorted(a.input_ref for a in out) == [f"s3://in/{k}" for k in range(5)]
    assert {a.action for a in out} == set(ids)
    by_id = {a.action: a for a in out}
    eng.clock.advance(2)
    for a in out:
        assert eng.report(a.token, Phase.RUNNING) == Verdict.OK
    eng.clock.advance(3)
    for a in out:
        assert eng.report(a.token, Phase.SUCCEEDED) == Verdict.OK
    a0 = by_id[ids[0]]
    assert eng.phase(ids[0]) == Phase.SUCCEEDED
    assert history(eng, ids[0]) == [(1, a0.generation, "east", "w", 10**9, 3 * 10**9,
                                     6 * 10**9, "SUCCEEDED")]
    assert eng.history.count(eng.history_key(template())) == 5
    # A finished lease refuses its token.
    assert eng.report(a0.token, Phase.RUNNING) == Verdict.COMPLETED


@pytest.mark.parametrize("stage", ["queued", "sent", "drained", "running", "succeeded"])
def test_lean_rows_come_back_the_same_after_a_restart(stage):
    eng = engine()
    ids = eng.enqueue_fanout(template(), ["a", "b", "c"])
    out = []
    if stage != "queued":
        eng.clock.advance(1)
        if stage == "sent":
            eng.schedule()
        else:
            out = eng.tick()
    if stage in ("running", "succeeded"):
        eng.clock.advance(1)
        for a in out:
            eng.report(a.token, Phase.RUNNING)
    if stage == "succeeded":
        eng.clock.advance(1)
        for a in out:
            eng.report(a.token, Phase.SUCCEEDED)
    before = {a: (eng.phase(a), history(eng, a)) for a in ids}
    again = restart(eng)
    assert {a: (again.phase(a), history(again, a)) for a in ids} == before
    # The restored shard carries on: every action ends SUCCEEDED.
    if stage == "sent":
        out = again.drain_dispatch()
        assert len(out) == 3            # never handed out: dispatched again, same generation
    elif stage == "queued":
        again.clock.advance(1)
        out = again.tick()
    for a in out:
        if stage != "succeeded":
            assert again.report(a.token, Phase.SUCCEEDED) == Verdict.OK
    assert all(again.phase(a) == Phase.SUCCEEDED for a in ids)


def test_a_failed_lean_row_keeps_its_history_across_restarts_and_retries():
    eng = engine()
    retry = RetryPolicy(count=1, backoff_base=1.0)
    [a, b] = eng.enqueue_fanout(template(retries=retry), ["a", "b"])
    eng.clock.advance(1)
    out = {x.action: x for x in eng.tick()}
    assert eng.report(out[a].token, Phase.FAILED, error_kind="USER",
                      message="exit 3") == Verdict.OK
    eng.explain(b)                    # gives b its Python record; nothing changes
    eng = restart(eng)
    assert [h[-1] for h in history(eng, a)] == ["FAILED", None]
    assert eng.report(out[b].token, Phase.SUCCEEDED) == Verdict.OK
    eng.clock.advance(2)
    retry = {x.action: x for x in eng.tick()}
    assert retry[a].attempt == 2
    assert eng.report(retry[a].token, Phase.SUCCEEDED) == Verdict.OK
    eng = restart(eng)
    assert [h[-1] for h in history(eng, a)] == ["FAILED", "SUCCEEDED"]
    assert eng.attempts(a)[0].message == "exit 3"
    assert [h[-1] for h in history(eng, b)] == ["SUCCEEDED"]
    assert eng.phase(a) == eng.phase(b) == Phase.SUCCEEDED


def test_a_fan_out_again_is_a_no_op_and_only_new_names_are_added():
    eng = engine()
    store = eng.store
    first = eng.enqueue_fanout(template(), ["a", "b"], inputs=["x", "y"])
    assert first.added.tolist() == [True, True]
    commits = store.commits
    again = eng.enqueue_fanout(template(), ["a", "b"], inputs=["x", "y"])
    assert again == first and again.added.tolist() == [False, False]
    assert store.commits == commits and eng.inspect().action_rows == 2
    ids = eng.enqueue_fanout(template(), ["b", "c", "a", "d"], inputs=["y", "z", "x", "w"])
    assert [a.action for a in ids] == ["b", "c", "a", "d"]
    assert ids.added.tolist() == [False, True, False, True]      # what this call enqueued
    assert eng.inspect().action_rows == 4
    with pytest.raises(AlreadyExists):
        eng.enqueue_fanout(template(resources={"cpu": 2}), ["a"])
    with pytest.raises(AlreadyExists):
        eng.enqueue_fanout(template(), ["a"], inputs=["other"])
    # enqueue_many and a fan-out see the same actions.
    assert eng.enqueue_many([dataclasses.replace(template(), id="acme/p/d/r/c")]) == [ids[1]]
    eng = restart(eng)
    ids = eng.enqueue_fanout(template(), ["d", "e"], inputs=["w", "v"])
    assert ids[1].action == "e" and ids.added.tolist() == [False, True]
    assert eng.inspect().action_rows == 5


@pytest.mark.parametrize("names, inputs, match", [
    ("abc", None, "list of action names"),
    ([], None, "at least one name"),
    (["ok", "bad/name"], None, r"names\[1\]"),
    (["ok", "-dash"], None, r"names\[1\]"),
    # Names are checked joined by newlines: one holding a newline is still refused.
    (["ok", "two\nparts"], None, r"names\[1\]"),
    (["ok", "end\n"], None, r"names\[1\]"),
    (["ok", ""], None, r"names\[1\]"),
    (["ok", 7], None, r"names\[1\]"),
    (["a", "b", "a"], None, r"names\[2\]: 'a' appears twice"),
    (["a", "b"], ["x"], "inputs has 1 items for 2 names"),
    (["a"], [3], r"inputs\[0\]"),
    (["a"], ["x" * 5000], r"inputs\[0\]"),
    # It reaches the attempt as an environment variable: no process can take a NUL byte.
    (["a", "b"], ["ok", "s3://x\0y"], r"inputs\[1\]: .* without a NUL byte"),
])
def test_bad_fan_outs_are_refused_naming_the_item_and_store_nothing(names, inputs, match):
    eng = engine()
    commits = eng.store.commits
    with pytest.raises(SpecError, match=match):
        eng.enqueue_fanout(template(), names, inputs=inputs)
    assert eng.inspect().action_rows == 0 and eng.store.commits == commits


def test_a_fan_out_is_atomic_on_its_parent_its_depth_and_its_template():
    eng = engine()
    with pytest.raises(SpecError, match="parent acme/p/d/r/root not found"):
        eng.enqueue_fanout(template(parent="acme/p/d/r/root"), ["a"])
    with pytest.raises(SpecError, match="resources"):
        eng.enqueue_fanout(template(resources={"gpu": 1}), ["a"])
    with pytest.raises(ResourceExhausted, match="depth 500"):
        eng.enqueue_fanout(template(), [f"n{k}" for k in range(501)])
    [root] = eng.enqueue_many([template("root")])
    with pytest.raises(SpecError, match="its own parent"):
        eng.enqueue_fanout(template(parent=str(root)), ["a", "root"])
    assert eng.inspect().action_rows == 1
    kids = eng.enqueue_fanout(template(parent=str(root)), ["k1", "k2"])
    view = eng.inspect()
    assert view.children(view.row_of(root)) == sorted(view.row_of(k) for k in kids)
    ended = eng.abort(root)
    assert {str(a) for a in ended} == {str(root), *map(str, kids)}
    with pytest.raises(SpecError, match="was aborted"):
        eng.enqueue_fanout(template(parent=str(root)), ["k3"])


def test_identical_content_in_enqueue_many_is_one_group_in_batch_order():
    eng = engine()
    same = [template(f"s{k}") for k in range(3)]
    other = template("o", resources={"cpu": 2})
    ids = eng.enqueue_many([same[0], same[1], other, same[2]])
    view = eng.inspect()
    groups = [int(view.arrays.a_group[view.row_of(a)]) for a in ids]
    assert groups[0] == groups[1] != groups[2] != groups[3]
    assert [view.row_of(a) for a in ids] == [0, 1, 2, 3]
    assert [view.record(r).spec for r in range(4)] == [same[0], same[1], other, same[2]]
    # Durations given as timedelta come back as seconds for every member of a group.
    from datetime import timedelta
    tds = [template(f"t{k}", timeouts=Timeouts(max_runtime=timedelta(minutes=1)))
           for k in range(2)]
    for aid in eng.enqueue_many(tds):
        assert view.record(view.row_of(aid)).spec.timeouts.max_runtime == 60.0


def test_enqueue_many_says_which_ids_it_added():
    # ``added``: False for an id that existed with the same spec (a no-op), True for the
    # ids this call enqueued.
    eng = engine()
    first = eng.enqueue_many([template("a"), template("b")])
    assert first.added.tolist() == [True, True]
    again = eng.enqueue_many([template("c"), template("a"), template("d")])
    assert [str(a) for a in again] == [f"acme/p/d/r/{n}" for n in ("c", "a", "d")]
    assert again.added.tolist() == [True, False, True]
    assert eng.enqueue_many([template("b")]).added.tolist() == [False]


def test_specs_enqueued_one_by_one_are_checked_and_stored_as_if_compiled_afresh():
    # Compiled specs are kept by content across calls (dicts by their own bytes too): a
    # spec of seen content still gets its own id, its own checks and its idempotency.
    from datetime import timedelta
    eng = engine()
    view = eng.inspect()
    first = {"id": "acme/p/d/r/a0", "task": "square", "resources": {"cpu": 1},
             "timeouts": {"max_runtime": 60}}
    ids = [eng.enqueue(first)]
    ids += [eng.enqueue({**first, "id": f"acme/p/d/r/a{k}"}) for k in (1, 2)]
    ids.append(eng.enqueue(ActionSpec(id="acme/p/d/r/a3", task="square",
                                      resources={"cpu": 1},
                                      timeouts=Timeouts(max_runtime=timedelta(minutes=1)))))
    assert [str(a) for a in ids] == [f"acme/p/d/r/a{k}" for k in range(4)]
    for k, aid in enumerate(ids):
        stored = view.record(view.row_of(aid)).spec
        assert stored.id == f"acme/p/d/r/a{k}" and stored.timeouts.max_runtime == 60.0
    # The same content under a bad id, or naming itself as parent: refused as before.
    with pytest.raises(SpecError, match="5 parts"):
        eng.enqueue({**first, "id": "acme/p/d/a4"})
    with pytest.raises(SpecError, match="string"):
        eng.enqueue({**first, "id": 7})
    child = {**first, "id": "acme/p/d/r/c0", "parent": "acme/p/d/r/a0"}
    eng.enqueue(child)
    with pytest.raises(SpecError, match="own parent"):
        eng.enqueue({**child, "id": "acme/p/d/r/a0"})
    # Idempotent on the same declaration, AlreadyExists on another one.
    assert eng.enqueue({**first, "id": "acme/p/d/r/a1"}) == ids[1]
    with pytest.raises(AlreadyExists):
        eng.enqueue({**first, "id": "acme/p/d/r/a1", "resources": {"cpu": 2}})
    assert eng.queue_metrics("cpu")["depth"] == 5


def test_a_batch_where_two_names_share_a_hash_keeps_both_findable(monkeypatch):
    hash_names_with(monkeypatch, lambda text: 7)      # every name collides
    eng = engine()
    ids = list(eng.enqueue_fanout(template(), ["a", "b", "c"]))
    ids += eng.enqueue_many([template("d")])
    view = eng.inspect()
    assert [view.row_of(a) for a in ids] == [0, 1, 2, 3]
    assert eng.enqueue_fanout(template(), ["c", "a"]) == [ids[2], ids[0]]
    assert view.find("acme/p/d/r/zz") is None
    eng = restart(eng)
    view = eng.inspect()
    assert [view.row_of(a) for a in ids] == [0, 1, 2, 3]
    assert view.find("acme/p/d/r/zz") is None


def test_lean_rows_hold_no_python_record_until_asked():
    eng = engine()
    ids = eng.enqueue_fanout(template(), [f"n{k}" for k in range(200)])
    eng.clock.advance(1)
    out = eng.tick()
    for a in out:
        eng.report(a.token, Phase.RUNNING)
        eng.report(a.token, Phase.SUCCEEDED)
    view = eng.inspect()
    edges = view.arrays.a_edges[:view.action_rows]
    assert not edges.any()              # the whole life cycle in columns
    assert eng.explain(ids[7]).phase == Phase.SUCCEEDED     # read from its columns
    assert not view.arrays.a_edges[:view.action_rows].any()
    assert eng.attempts(ids[7])[0].phase == "SUCCEEDED"     # its record, made on demand
    assert np.flatnonzero(view.arrays.a_edges[:view.action_rows]).tolist() == [7]


# ------------------------------------------------------------------- columnar drain, reports

SECRET = bytes(range(16))


def twin():
    """Two engines that will mint the same tokens for the same decisions."""
    out = []
    for _ in range(2):
        eng = Engine(parse_config(CONFIG), clock=ManualClock(), store=MemoryStore(4),
                     secret=SECRET)
        eng.register_worker("w", "east", 1000)
        out.append(eng)
    return out


def state(eng):
    view = eng.inspect()
    n = view.action_rows
    arrays = {k: v[:n].copy() for k, v in view.arrays.copy().items()
              if k.startswith("a_") and k != "a_pred_end"}
    arrays.update({k: v.copy() for k, v in view.arrays.copy().items()
                   if k[:2] in ("q_", "c_", "w_")})
    recs = [(eng.phase(view.action_at(r)), history(eng, view.action_at(r))) for r in range(n)]
    key = eng.history_key(template())
    return arrays, recs, view.timers(), (eng.history.encode(key)
                                         if eng.history.count(key) else None)


def assert_same_state(a, b):
    (xa, ra, ta, ha), (xb, rb, tb, hb) = state(a), state(b)
    assert xa.keys() == xb.keys()
    for k in xa:
        np.testing.assert_array_equal(xa[k], xb[k], err_msg=k)
    assert ra == rb and ta == tb and ha == hb


def test_drain_columns_is_drain_dispatch_in_columns():
    a, b = twin()
    for eng in (a, b):
        eng.enqueue_fanout(template(timeouts=Timeouts(deadline=600, max_queued_time=60)),
                           [f"n{k}" for k in range(30)], inputs=[f"in{k}" for k in range(30)])
        eng.enqueue_many([template("solo")])
        eng.clock.advance(1)
        eng.schedule()
    batch = a.drain_columns()
    listed = b.drain_dispatch()
    assert len(batch) == len(listed) == 31
    assert batch.assignments() == listed
    assert batch.tokens.tobytes() == b"".join(x.token for x in listed)
    assert [batch.action(i) for i in range(len(batch))] == [x.action for x in listed]
    assert_same_state(a, b)
    assert len(a.drain_columns()) == 0


def test_the_drain_skips_ended_leases_and_hands_out_the_rest_in_ring_order():
    # The compiled drain (cext._bulk.drain_dispatch) against what each entry must become:
    # an entry whose lease ended before the drain is not delivered; a delivered lean run
    # lease is stamped (start, INITIALIZING, attempt 1) and its columns name its action.
    eng = engine()
    ids = eng.enqueue_fanout(template(), [f"n{k}" for k in range(4)])
    eng.clock.advance(1)
    enq = eng.clock.now_ns()
    eng.schedule()
    eng.abort(ids[1])                   # ended in the ring, before the drain
    eng.clock.advance(2)
    batch = eng.drain_columns()
    assert [batch.action(i) for i in range(len(batch))] == [ids[0], ids[2], ids[3]]
    view = eng.inspect()
    rows = batch.action_row.tolist()
    assert batch.lease_row.tolist() == rows and batch.kind.tolist() == [0, 0, 0]
    assert batch.attempt.tolist() == [1, 1, 1]
    assert batch.attempt_enqueued_ns.tolist() == [enq - 1_000_000_000] * 3
    assert batch.first_enqueued_ns.tolist() == [enq - 1_000_000_000] * 3
    assert (view.arrays.a_start[rows] == eng.clock.now_ns()).all()
    assert [eng.phase(a) for a in (ids[0], ids[2], ids[3])] == [Phase.INITIALIZING] * 3
    assert eng.phase(ids[1]) == Phase.ABORTED
    assert eng.heartbeat("w", batch.tokens.tobytes()) == []    # every token is valid
    assert len(eng.drain_columns()) == 0


def test_report_many_equals_the_same_reports_one_by_one():
    a, b = twin()
    for eng in (a, b):
        eng.enqueue_fanout(template(retries=RetryPolicy(count=1, backoff_base=1.0),
                                    timeouts=Timeouts(max_runtime=30)),
                           [f"n{k}" for k in range(12)])
        eng.clock.advance(1)
    out = a.tick()
    assert b.tick() == out
    tok = [x.token for x in out]
    forged = bytes(24)
    reports = [
        (tok[0], "RUNNING", {}), (tok[1], "RUNNING", {}), (tok[2], "SUCCEEDED", {}),
        (tok[3], "INITIALIZING", {}), (tok[4], "RUNNING", {}), (tok[4], "SUCCEEDED", {}),
        (tok[5], "FAILED", {"error_kinds": "USER", "messages": "exit 1"}),
        (tok[6], "SUCCEEDED", {"messages": "done, with a note"}),
        (tok[7], "TIMED_OUT", {"causes": "max_runtime"}),
        (tok[8], "SUCCEEDED", {}), (tok[8], "RUNNING", {}),        # late RUNNING: refused
        (forged, "RUNNING", {}),
        (tok[9], "FAILED", {"error_kinds": "SYSTEM", "causes": "OOM", "cleanup": True}),
    ]
    for eng in (a, b):
        eng.clock.advance(2)
    columns = {k: [r[2].get(k) for r in reports] for k in
               ("error_kinds", "causes", "messages", "cleanup")}
    columns["messages"] = [m or "" for m in columns["messages"]]
    columns["cleanup"] = [bool(c) for c in columns["cleanup"]]
    refused = a.report_many(b"".join(r[0] for r in reports), [r[1] for r in reports],
                            **columns)
    one_by_one = []
    for token, phase, kw in reports:
        kw = {{"error_kinds": "error_kind", "causes": "cause", "messages": "message"}.get(
            k, k): v for k, v in kw.items()}
        verdict = b.report(token, phase, **kw)
        if verdict != Verdict.OK:
            one_by_one.append((token, verdict))
    assert [(r.token, r.verdict) for r in refused] == one_by_one
    assert [v for _t, v in one_by_one] == [Verdict.COMPLETED, Verdict.UNKNOWN]
    assert_same_state(a, b)
    # Durable: a restart of the batched engine sees the same.
    again = restart(a)
    assert [again.phase(x.action) for x in out] == [b.phase(x.action) for x in out]


@pytest.mark.parametrize("phase, extra", [
    ("INITIALIZING", {}), ("RUNNING", {}), ("SUCCEEDED", {}),
    ("FAILED", {"error_kinds": "USER"}), ("TIMED_OUT", {"causes": "max_runtime"})])
def test_report_many_of_one_phase_for_all_equals_the_reports_one_by_one(phase, extra):
    # One phase for every token (a worker's batch): the lean phases in columns, the others
    # one by one; a token repeated or ended before is refused as report() refuses it.
    a, b = twin()
    for eng in (a, b):
        eng.enqueue_fanout(template(timeouts=Timeouts(max_runtime=30)),
                           [f"n{k}" for k in range(6)])
        eng.clock.advance(1)
    out = a.tick()
    assert b.tick() == out
    tok = [x.token for x in out]
    for eng in (a, b):
        assert eng.report(tok[5], "SUCCEEDED") == Verdict.OK      # ended before the batch
        eng.clock.advance(2)
    batch = tok[:4] + [tok[0], tok[5]]
    refused = a.report_many(b"".join(batch), phase,
                            **{k: [v] * len(batch) for k, v in extra.items()})
    single = {{"error_kinds": "error_kind", "causes": "cause"}[k]: v for k, v in extra.items()}
    one_by_one = [(t, v) for t in batch if (v := b.report(t, phase, **single)) != Verdict.OK]
    assert [(r.token, r.verdict) for r in refused] == one_by_one
    assert any(v == Verdict.COMPLETED for _t, v in one_by_one)
    assert [a.phase(x.action) for x in out] == [b.phase(x.action) for x in out]
    assert_same_state(a, b)


def test_a_report_that_changes_nothing_writes_nothing():
    store = MemoryStore(4)                  # counts the groups committed to it
    eng = engine(store=store)
    eng.enqueue_fanout(template(), ["a", "b"])
    with eng.turn():
        eng.schedule()
        batch = eng.drain_columns()
    ids = ["acme/p/d/r/a", "acme/p/d/r/b"]
    assert [eng.phase(x) for x in ids] == [Phase.INITIALIZING] * 2
    n = store.commits
    # The hand-out made them INITIALIZING: the worker's INITIALIZING is acknowledged as is.
    assert eng.report_many(batch.tokens, Phase.INITIALIZING, worker="w") == []
    assert store.commits == n
    assert eng.report_many(batch.tokens[:1], Phase.RUNNING, worker="w") == []
    assert store.commits == n + 1
    # Mixed: a repeated RUNNING (no change) and a new RUNNING: one write, of the second.
    assert eng.report_many(batch.tokens, [Phase.RUNNING, Phase.RUNNING], worker="w") == []
    assert store.commits == n + 2
    assert eng.report_many(batch.tokens, Phase.RUNNING, worker="w") == []
    assert store.commits == n + 2
    assert [eng.phase(x) for x in ids] == [Phase.RUNNING] * 2
    assert eng.report_many(batch.tokens, Phase.SUCCEEDED, worker="w") == []
    assert store.commits == n + 3
    again = restart(eng)
    assert [again.phase(x) for x in ids] == [Phase.SUCCEEDED] * 2
    assert [h[-1] for x in ids for h in history(again, x)] == ["SUCCEEDED"] * 2


def test_report_many_checks_every_argument_before_applying_any():
    eng = engine()
    eng.enqueue_fanout(template(), ["a", "b"])
    eng.clock.advance(1)
    out = eng.tick()
    commits = eng.store.commits
    tokens = b"".join(x.token for x in out)
    with pytest.raises(SpecError, match="report 1: FAILED needs error_kind"):
        eng.report_many(tokens, ["SUCCEEDED", "FAILED"])
    with pytest.raises(SpecError, match="report 0: a worker cannot report QUEUED"):
        eng.report_many(tokens, ["QUEUED", "SUCCEEDED"])
    with pytest.raises(SpecError, match="1 phases for 2 tokens"):
        eng.report_many(tokens, ["SUCCEEDED"])
    with pytest.raises(SpecError, match="whole number"):
        eng.report_many(tokens[:-1], ["SUCCEEDED", "SUCCEEDED"])
    # One phase for all (checked once): the same refusals, named at report 0.
    with pytest.raises(SpecError, match="report 0: a worker cannot report QUEUED"):
        eng.report_many(tokens, "QUEUED")
    with pytest.raises(SpecError, match="report 0: FAILED needs error_kind"):
        eng.report_many(tokens, Phase.FAILED)
    with pytest.raises(SpecError, match="report 1: FAILED needs error_kind"):
        eng.report_many(tokens, "FAILED", error_kinds=["USER", None])
    assert eng.store.commits == commits
    assert all(eng.phase(x.action) == Phase.INITIALIZING for x in out)
    # Checked against the worker named: another worker's reports are refused.
    eng.register_worker("v", "east", 10)
    refused = eng.report_many(tokens, ["SUCCEEDED", "SUCCEEDED"], worker="v")
    assert [r.verdict for r in refused] == [Verdict.UNKNOWN, Verdict.UNKNOWN]
    # The same lease twice in one message, side by side: the second is refused COMPLETED.
    twice = out[0].token * 2 + out[1].token
    refused = eng.report_many(twice, Phase.SUCCEEDED, worker="w")
    assert [(r.token, r.verdict) for r in refused] == [(out[0].token, Verdict.COMPLETED)]
    assert all(eng.phase(x.action) == Phase.SUCCEEDED for x in out)


def test_a_finalize_lease_reported_timed_out_is_refused_before_any_report_applies():
    # The refusal came from the report itself, after the reports before it in the message
    # had been applied: an error answered, and part of the message committed.
    eng = engine()
    eng.enqueue_fanout(template(), ["a", "b"])
    a, b = eng.tick()
    eng.complete(a.action, a.generation, Phase.FAILED, error_kind="USER",
                 recoverable=False, cleanup=True)
    [fin] = eng.tick()
    assert fin.kind == LeaseKind.FINALIZE
    commits = eng.store.commits
    with pytest.raises(SpecError, match="report 1: a finalize lease ends SUCCEEDED or FAILED"):
        eng.report_many(b.token + fin.token, ["SUCCEEDED", "TIMED_OUT"],
                        causes=[None, "deadline"])
    assert eng.store.commits == commits
    assert eng.phase(b.action) == Phase.INITIALIZING
    assert eng.report_many(b.token + fin.token, ["SUCCEEDED", "SUCCEEDED"]) == []
    assert eng.phase(b.action) == Phase.SUCCEEDED


def test_an_abort_ends_queued_lean_rows_in_columns_and_what_runs_gets_cleanup():
    eng = engine()
    eng.register_worker("small", "east", 1)
    [root] = eng.enqueue_many([template("root")])
    kids = eng.enqueue_fanout(template("k", parent=str(root)), [f"k{i}" for i in range(6)])
    eng.clock.advance(1)
    placed = {a.action: a for a in eng.tick()}
    assert len(placed) == 7                      # the root and its six children run
    more = eng.enqueue_fanout(template("m", parent=str(kids[0])), [f"m{i}" for i in range(40)])
    eng.clock.advance(1)
    ended = eng.abort(root, reason="user pressed stop")
    assert len(ended) == 47 and set(ended) == {root, *kids, *more}
    view = eng.inspect()
    rows = [view.row_of(m) for m in more]
    assert not view.arrays.a_edges[rows].any()   # the queued ones ended in their columns
    assert eng.attempts(more[3])[0].message == "user pressed stop"
    for a in placed.values():
        [r] = eng.heartbeat(a.worker, [a.token])
        assert r.verdict == Verdict.ABORTED
    fins = [a for a in eng.tick() if a.kind.name == "FINALIZE"]
    assert len(fins) == 7
    again = restart(eng)
    for aid in (root, kids[2], more[0], more[39]):
        assert again.phase(aid) == Phase.ABORTED
    [att] = again.attempts(more[5])
    assert (att.phase, att.message, att.generation) == ("ABORTED", "user pressed stop", 0)
    assert att.end_ns == 2 * 10**9
    assert again.attempts(kids[1])[0].finalize in ("PENDING", "SENT")
    with pytest.raises(SpecError, match="was aborted"):
        again.enqueue_fanout(template("x", parent=str(root)), ["x"])
    assert list(again.abort(root)) == []         # nothing left to end
    with pytest.raises(SpecError, match="reason is a string"):
        again.abort(root, reason=3)


def test_aborting_lean_rows_in_flight_equals_aborting_their_python_records():
    # Twin shards: in one the rows stay lean, in the other attempts() gave every row its
    # Python record first. The same abort, cleanup and restart look the same from outside.
    a, b = twin()
    outs = []
    for eng in (a, b):
        eng.register_worker("v", "east", 3)
        [root] = eng.enqueue_many([template("root")])
        kids = eng.enqueue_fanout(template("k", parent=str(root)), [f"k{i}" for i in range(8)])
        eng.clock.advance(1)
        out = eng.tick()
        for x in out[:4]:
            eng.report(x.token, Phase.RUNNING)
        outs.append((root, kids, out))
    root, kids, out = outs[0]
    assert outs[1][2] == out
    for aid in (root, *kids):
        b.attempts(aid)
    assert b.inspect().arrays.a_edges[:9].all() and not a.inspect().arrays.a_edges[:9].any()
    for eng in (a, b):
        eng.clock.advance(1)
        assert set(eng.abort(root, reason="stop")) == {root, *kids}
    assert not a.inspect().arrays.a_edges[:9].any()      # still lean, cleanup included

    def seen(eng):
        return [(eng.phase(x), [dataclasses.asdict(t) for t in eng.attempts(x)])
                for x in (root, *kids)]

    assert seen(a) == seen(b)
    for eng in (a, b):
        eng.clock.advance(1)
    fa, fb = a.tick(), b.tick()
    assert fa == fb and len(fa) == 9 and {f.kind.name for f in fa} == {"FINALIZE"}
    assert seen(a) == seen(b)
    for f in fa[:5]:
        assert a.report(f.token, Phase.SUCCEEDED) == b.report(f.token, Phase.SUCCEEDED)
    assert a.report(fa[5].token, Phase.FAILED, error_kind="USER") == Verdict.OK
    assert b.report(fa[5].token, Phase.FAILED, error_kind="USER") == Verdict.OK
    assert seen(a) == seen(b)
    assert {att["finalize"] for _p, hist in seen(a) for att in hist} == {
        "SUCCEEDED", "FAILED", "SENT"}
    ra, rb = restart(a), restart(b)
    assert seen(ra) == seen(rb) == seen(b)


def test_explain_of_a_lean_row_equals_explain_of_its_record_at_every_stage():
    # Twin shards, the same decisions: in one every row keeps its columns, in the other
    # attempts() gives each its Python record first; explain() must read the same.
    a, b = twin()
    ids = {}
    for eng in (a, b):
        ids[eng] = eng.enqueue_fanout(template(), [f"n{k}" for k in range(6)])
        eng.clock.advance(1)
    names = [str(x) for x in ids[a]]

    def same():
        for x in names:
            b.attempts(x)
        got = [dataclasses.astuple(a.explain(x)) for x in names]
        assert got == [dataclasses.astuple(b.explain(x)) for x in names]
        return got

    for eng in (a, b):
        eng.schedule()                        # placed, still in the dispatch channel
    assert {e[2] for e in same()} == {WaitCode.PLACED}
    outs = [eng.drain_dispatch() for eng in (a, b)]
    same()
    for eng, out in zip((a, b), outs, strict=True):
        eng.report(out[0].token, Phase.RUNNING)
        eng.report(out[1].token, Phase.RUNNING)
        eng.report(out[1].token, Phase.SUCCEEDED)
        eng.clock.advance(1)
        eng.abort(str(out[2].action), reason="enough")
    phases = [e[1] for e in same()]
    assert phases[:3] == [Phase.RUNNING, Phase.SUCCEEDED, Phase.ABORTED]
    assert not a.inspect().arrays.a_edges[:a.inspect().action_rows].any()



def _deadline_fanout(eng, n, run="r", batch=1_000):
    """A root and ``n`` children in fan-out batches, each child with a deadline and a
    max_queued_time (two timers); a failed child is retried after 60 s; returns the root."""
    [root] = eng.enqueue_many([ActionSpec(id=f"acme/p/d/{run}/root", task="root",
                                          resources={"cpu": "1m"})])
    kids = ActionSpec(id=f"acme/p/d/{run}/k", task="k", parent=str(root),
                      resources={"cpu": "1m"}, retries=RetryPolicy(count=1, backoff_base=60),
                      timeouts=Timeouts(deadline=3600, max_queued_time=1800, max_runtime=600))
    for start in range(0, n, batch):
        eng.enqueue_fanout(kids, [f"k{i}" for i in range(start, min(n, start + batch))])
    return root


def _big_config():
    return parse_config(dict(CONFIG, queues={"cpu": {"scheduling": "GREEDY_CAPACITY",
                                                      "depth": 200_000}}))


def test_the_timers_of_ended_actions_do_not_pile_up():
    # A timer stays until due when its action ends: 70,000 ended actions with a deadline and
    # a max_queued_time each kept 140,000 entries for an hour (memory bounded by history,
    # not by live work). Once they outnumber the table's rows (and twice the armed ones), a
    # tick rebuilds the timers from the due columns, as a reload derives them.
    eng = Engine(_big_config(), clock=ManualClock(), store=MemoryStore(4))
    root = _deadline_fanout(eng, 70_000)
    assert len(eng.inspect().timers()) == 140_000
    assert len(eng.abort(root)) == 70_001
    eng.schedule()
    assert eng.inspect().timers() == []


def test_rebuilt_timers_are_the_armed_ones_of_before():
    from tests.test_review import _pending_timers

    clock = ManualClock()
    eng = Engine(_big_config(), clock=clock, store=MemoryStore(4))
    eng.register_worker("w", "east", 500)           # 500 leased, the rest wait for a slot
    _deadline_fanout(eng, 20_000)
    placed = eng.tick()
    assert len(placed) == 500
    for a in placed[:300]:                          # the max_runtime backstop armed
        eng.mark_running(a.action, a.generation)
    for a in placed[:100]:                          # a retry in backoff (retry timers)
        eng.complete(a.action, a.generation, Phase.FAILED, error_kind="USER")
    eng.abort(placed[300].action)                   # a finalize lease (its give-up bound)
    assert eng.tick()                               # the slots they freed taken again
    armed = _pending_timers(eng)
    kinds = {t.kind for t in eng.inspect().timers()}
    assert len(kinds) == 5, kinds                   # every kind of timer is pending
    entries = len(eng.inspect().timers())
    # 30,000 more timers, of actions that end at once: past the bound.
    other = _deadline_fanout(eng, 15_000, run="r2")
    assert len(eng.abort(other)) == 15_001
    assert len(eng.inspect().timers()) == entries + 30_000 > 65_536
    assert eng.schedule() == 0                      # nothing due, no slot free
    assert _pending_timers(eng) == armed
    assert len(eng.inspect().timers()) < entries
