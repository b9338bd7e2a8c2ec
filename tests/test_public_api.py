"""Tests and benches use the public API only; the inspection view and the decide/commit split
behave as documented."""

import ast
from pathlib import Path

import numpy as np
import pytest

from cext import TickKernel
from engine import (
    ActionSpec,
    Engine,
    Group,
    Inspection,
    ManualClock,
    NotFound,
    Phase,
    Timeouts,
    parse_config,
)
from storage import MemoryStore, StoreError, StoreFull
from tests.conftest import make_engine as _make_engine

ROOT = Path(__file__).resolve().parent.parent
CONFIG = {
    "resources": ["cpu", "memory"],
    "clusters": {"east": {"capacity": {"cpu": 64, "memory": "256Gi"}}},
    "queues": {"cpu": {"scheduling": "GREEDY_CAPACITY", "depth": 10000}},
    "engine": {"default_queue": "cpu"},
}


def make_engine(config):
    return _make_engine(config, workers={})


def spec(run, name, **kw):
    return ActionSpec(id=f"acme/p/d/{run}/{name}", task="t", resources={"cpu": 1}, **kw)


def _private_names():
    """Every private attribute an Engine or its kernel has: instance and class names."""
    eng, _ = make_engine(CONFIG)
    names = {n for n in vars(eng) if n.startswith("_") and not n.startswith("__")}
    names |= {n for n in dir(Engine) if n.startswith("_") and not n.startswith("__")}
    names |= {n for n in dir(TickKernel) if n.startswith("_") and not n.startswith("__")}
    eng.close()
    return names


def _reaches_inside(path, private):
    """Lines of ``path`` that read or write ``<expr>._name`` for a private Engine/kernel
    name, other than on ``self``/``cls`` (a test's own helpers may use such names)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    where = path.relative_to(ROOT) if ROOT in path.parents else path
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in private:
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            out.append(f"{where}:{node.lineno}: .{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in private):
            out.append(f"{where}:{node.lineno}: {node.func.id} "
                       f"{node.args[1].value}")
    return out


def test_no_test_or_bench_reaches_inside_the_engine_or_the_kernel():
    private = _private_names()
    assert {"_state", "_kernel", "_commit", "_rec"} <= private   # the check sees them
    files = sorted((ROOT / "tests").glob("*.py")) + sorted((ROOT / "bench").glob("*.py"))
    found = [hit for f in files for hit in _reaches_inside(f, private)]
    assert not found, "private attributes used:\n" + "\n".join(found)


def test_the_private_attribute_check_fails_on_a_reach_inside(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f(eng, self):\n"
                     "    self._state = 1\n"                       # a test's own: allowed
                     "    return eng._state.a_gen, getattr(eng, '_kernel')\n")
    hits = sorted(_reaches_inside(probe, _private_names()))
    assert len(hits) == 2 and "._state" in hits[0] and "getattr _kernel" in hits[1]


# ----------------------------------------------------------------------------- inspection


def test_inspection_arrays_are_read_only_views_of_the_live_state():
    eng, clock = make_engine(CONFIG)
    view = eng.inspect()
    assert isinstance(view, Inspection)
    [aid] = eng.enqueue_many([spec("r", "a")])
    row = view.row_of(aid)
    assert view.action_rows == 1 and view.find("acme/p/d/r/zz") is None
    with pytest.raises(ValueError):
        view.arrays.a_gen[row] = 5
    with pytest.raises(AttributeError):
        view.arrays.a_gen = np.zeros(3)
    eng.register_worker("w", "east", 4)
    [asg] = eng.tick()
    # The same view sees the change (and a table growth) without being made again.
    assert int(view.arrays.a_gen[row]) == asg.generation == 1
    assert view.record(row).phase == Phase.INITIALIZING
    assert view.worker_at(view.arrays.a_worker[row]) == "w"
    copy = view.arrays.copy()
    copy["a_gen"][row] = 99                       # a copy, not the engine's
    assert int(view.arrays.a_gen[row]) == 1
    eng.enqueue_many([spec("r", f"b{i}") for i in range(3000)])
    assert view.action_rows == 3001 and view.arrays.a_gen.shape[0] >= 3001


def test_inspection_lists_the_dispatch_channel_and_the_timers():
    eng, clock = make_engine(CONFIG)
    eng.register_worker("w", "east", 4)
    view = eng.inspect()
    [aid] = eng.enqueue_many([spec("r", "a", timeouts=Timeouts(max_queued_time=30))])
    [timer] = view.timers()
    assert timer.row == view.row_of(aid) and timer.due_ns == clock.now_ns() + 30 * 10**9
    assert eng.schedule() == 1
    [entry] = view.dispatch()
    assert (entry.row, entry.generation, entry.worker) == (view.row_of(aid), 1, "w")
    assert view.dispatch_tail - view.dispatch_head == 1
    eng.drain_dispatch()
    assert view.dispatch() == []


def test_inspection_counts_the_compiled_spec_contents_once_each():
    eng, _ = make_engine(CONFIG)
    view = eng.inspect()
    before = view.compiled_specs
    eng.enqueue_many([spec("r", "a"), spec("r", "b")])      # one content: names differ
    assert view.compiled_specs == before + 1
    eng.enqueue_many([ActionSpec(id="acme/p/d/r/c", task="t", resources={"cpu": 2})])
    assert view.compiled_specs == before + 2


# ---------------------------------------------------------------------- decide and commit


def test_decide_then_commit_is_schedule_and_nothing_is_handed_out_before_the_commit():
    eng, clock = make_engine(CONFIG)
    eng.register_worker("w", "east", 4)
    store = eng.store
    eng.enqueue_many([spec("r", f"a{i}") for i in range(3)])
    commits = store.commits
    group = eng.decide()
    assert isinstance(group, Group) and group.state == "pending" and group.placed == 3
    assert store.commits == commits                 # decided, not written
    assert eng.pending_groups == (group,)
    # While it is pending, only deferred turns run: an immediate one is refused.
    with pytest.raises(StoreError, match="not committed"):
        eng.drain_dispatch()
    with eng.deferred_turn() as later:
        assert eng.drain_dispatch() == []        # not durable yet: nothing leaves
    eng.commit(group)
    assert group.state == "committed" and store.commits == commits + 1
    eng.commit(later)
    assert [a.action.action for a in eng.drain_dispatch()] == ["a0", "a1", "a2"]


def test_groups_commit_in_order_and_a_failed_commit_discards_every_later_group():
    eng, clock = make_engine(CONFIG)
    eng.register_worker("w", "east", 4)
    store = eng.store
    eng.enqueue_many([spec("r", "a")])
    first = eng.decide()
    clock.advance(1)
    second = eng.decide()
    with pytest.raises(StoreError, match="commits after"):
        eng.commit(second)
    store.fail_next(StoreFull(0, 1 << 20))
    with pytest.raises(StoreFull):
        eng.commit(first)
    assert first.state == second.state == "discarded" and eng.pending_groups == ()
    with pytest.raises(StoreError, match="discarded"):
        eng.commit(second)
    # Memory is what the store holds: the decision is gone, the action queued again.
    view = eng.inspect()
    assert view.dispatch() == [] and eng.phase("acme/p/d/r/a") == Phase.QUEUED
    assert len(eng.tick()) == 1


def test_a_deferred_turn_hands_out_only_what_committed_groups_decided():
    eng, clock = make_engine(CONFIG)
    eng.register_worker("w", "east", 4)
    eng.enqueue_many([spec("r", "a")])
    g1 = eng.decide()
    with eng.deferred_turn() as g2:
        assert eng.drain_dispatch() == []        # g1 is not durable yet
    eng.commit(g1)
    eng.commit(g2)
    with eng.deferred_turn() as g3:
        [asg] = eng.drain_dispatch()             # g1 committed: its decision may leave
    eng.commit(g3)
    assert asg.action.action == "a" and asg.generation == 1


def test_a_deferred_turn_that_hands_out_its_own_decisions_and_settle_after_a_store_commit():
    """A pipelined shard's use: decide and drain in one deferred turn (the leases wait for
    the group's commit), write the batch elsewhere, then settle."""
    eng, clock = make_engine(CONFIG)
    eng.register_worker("w", "east", 4)
    store = eng.store
    with eng.deferred_turn(hand_out_own=True) as group:
        eng.enqueue_many([spec("r", "a")])
        assert eng.schedule() == 1
        [asg] = eng.drain_dispatch()             # its own decision, held by the caller
    assert asg.action.action == "a" and group.state == "pending"
    commits = store.commits
    store.commit(group.batch)                    # as the committer thread does
    eng.settle(group)
    assert group.state == "committed" and store.commits == commits + 1
    assert eng.pending_groups == ()
    assert eng.drain_dispatch() == []            # handed out once, durably


def test_settle_of_a_failed_store_commit_restores_memory_and_discards_later_groups():
    eng, clock = make_engine(CONFIG)
    eng.register_worker("w", "east", 4)
    with eng.deferred_turn() as first:
        eng.enqueue_many([spec("r", "a")])
    with eng.deferred_turn() as second:
        eng.enqueue_many([spec("r", "b")])
    with pytest.raises(StoreError, match="disk said no"):
        eng.settle(first, StoreError("the disk said no"))
    assert first.state == second.state == "discarded" and eng.pending_groups == ()
    for name in ("a", "b"):
        with pytest.raises(NotFound):
            eng.phase(f"acme/p/d/r/{name}")     # memory is what the store holds


def test_the_store_holds_a_committed_group_across_a_restart():
    cfg = parse_config(CONFIG)
    store = MemoryStore(4)
    eng = Engine(cfg, clock=ManualClock(), store=store)
    eng.register_worker("w", "east", 4)
    eng.enqueue_many([spec("r", "a")])
    eng.commit(eng.decide())
    eng.close()
    again = Engine(cfg, clock=ManualClock(), store=MemoryStore(4, backing=store.backing))
    view = again.inspect()
    assert int(view.arrays.a_gen[view.row_of("acme/p/d/r/a")]) == 1


# -------------------------------------------------------------------------- children index


def test_abort_follows_the_children_index_and_the_index_survives_a_restart():
    cfg = parse_config(CONFIG)
    store = MemoryStore(4)
    eng = Engine(cfg, clock=ManualClock(), store=store)
    root = spec("r", "root")
    kids = [spec("r", f"k{i}", parent=root.id) for i in range(20)]
    grand = [spec("r", f"g{i}-{j}", parent=kids[i].id) for i in range(20) for j in range(3)]
    eng.enqueue_many([root, *kids])
    eng.enqueue_many(grand)
    view = eng.inspect()
    row = view.row_of
    assert view.children(row(root.id)) == sorted(row(k.id) for k in kids)
    assert view.children(row(kids[7].id)) == [row(f"acme/p/d/r/g7-{j}") for j in range(3)]
    before = {r: view.children(r) for r in range(view.action_rows)}
    ended = eng.abort(kids[7].id)
    assert sorted(str(a) for a in ended) == sorted(
        [str(kids[7].id)] + [f"acme/p/d/r/g7-{j}" for j in range(3)])
    eng.close()
    again = Engine(cfg, clock=ManualClock(), store=MemoryStore(4, backing=store.backing))
    view = again.inspect()
    assert {r: view.children(r) for r in range(view.action_rows)} == before
    again.enqueue_many([spec("r", "late", parent=kids[3].id)])   # appended after the load
    assert view.children(view.row_of(kids[3].id))[-1] == view.row_of("acme/p/d/r/late")
    ended = again.abort(root.id)
    assert len(ended) == 1 + 19 + 19 * 3 + 1
    assert all(again.phase(a) == Phase.ABORTED for a in ended)


def test_the_row_state_machine_refuses_an_illegal_move_in_the_debug_build():
    from types import SimpleNamespace

    from cext import DEBUG
    from engine._rows import ST_BACKOFF, ST_DONE, ST_QUEUED, ST_RUNNING, set_state

    st = SimpleNamespace(a_state=np.array([ST_QUEUED, ST_DONE], dtype=np.uint8))
    set_state(st, np.array([1]), ST_BACKOFF)        # a failed attempt waits for its retry
    assert st.a_state.tolist() == [ST_QUEUED, ST_BACKOFF]
    if DEBUG:
        with pytest.raises(AssertionError, match="row 0 QUEUED -> RUNNING"):
            set_state(st, 0, ST_RUNNING)            # only a sent lease starts running
        assert st.a_state[0] == ST_QUEUED
    else:
        set_state(st, 0, ST_RUNNING)                # the release build does not check
        assert st.a_state[0] == ST_RUNNING
