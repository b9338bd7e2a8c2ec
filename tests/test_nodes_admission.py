"""Node-aware admission (clusters.NAME.admission = "nodes", docs/nodes.md): the gate places
every pod of an action on the cluster's nodes (first fit decreasing) before it admits it,
charges the nodes, records the placement with the lease and gives it back at release."""

import dataclasses
import re

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine import ActionSpec, ConfigError, PodGroup, SpecError
from engine._codes import LeaseKind, Phase, RowState, WaitCode
from engine._config import parse_config, update_queue
from engine._dispatch import DispatchBatch
from engine._engine import Engine
from engine._model import ReusePolicy
from engine._nodes import Nodes
from engine._units import UNLIMITED
from storage import MemoryStore
from tests.conftest import ManualClock, make_engine
from transport import Client, Shard, ShardError, Worker, WorkerConnection, leases_of
from transport._protocol import Leases, ProtocolError, decode, encode

# Four nodes of 8 GPUs and 8 cpu each.
NODE = {"cpu": 8, "gpu:H100": 8}


def config(admission="nodes", count=4, queue=None, **engine):
    return {
        "resources": ["cpu", "gpu:H100"],
        "clusters": {"east": {"admission": admission,
                              "node_shapes": [{"name": "h100", "count": count,
                                               "allocatable": NODE}]}},
        "queues": {"gpu": {"scheduling": "STRICT_FIFO", **(queue or {})}},
        "engine": {"default_queue": "gpu", "heartbeat_interval": 1e7, **engine},
    }


def act(run, name="a", **kw):
    return ActionSpec(id=f"acme/ml/prod/{run}/{name}", task=name, **kw)


def blocker(run):
    # 4 GPUs and 5 cpu: no node holds two of them, so each takes a node of its own.
    return act(run, resources={"cpu": 5, "gpu": 4})


def gang(run, pods=2, gpu=8, cpu=1, name="train"):
    return act(run, name, pods=(PodGroup("worker", pods, {"cpu": cpu, "gpu": gpu}),))


def fragment(admission):
    """Four blockers, one per node: each node keeps 4 free GPUs (16 free in all), then a
    gang of two 8-GPU pods; returns (engine, clock, what the tick placed of the gang)."""
    eng, clock = make_engine(config(admission))
    eng.enqueue_many([blocker(f"b{i}") for i in range(4)])
    assert len(eng.tick()) == 4
    eng.enqueue(gang("g"))
    return eng, clock, eng.tick()


# ----------------------------------------------------------------------------- the gate


def test_gang_is_not_admitted_onto_fragmented_nodes_under_nodes():
    eng, _clock, placed = fragment("nodes")
    assert placed == []
    view = eng.inspect()
    assert {name: int(v[1]) for name, v in view.node_free("east").items()} == {
        "h100-0": 4, "h100-1": 4, "h100-2": 4, "h100-3": 4}
    exp = eng.explain("acme/ml/prod/g/train")
    assert exp.wait == WaitCode.NO_NODE_FIT
    assert exp.phase == Phase.WAITING_FOR_RESOURCES
    assert "nodes fragmented: cluster east" in exp.reason
    assert "its 2 pod(s) cannot all be placed" in exp.reason


def test_the_same_gang_is_admitted_under_shapes():
    eng, _clock, placed = fragment("shapes")
    assert [a.action.run for a in placed] == ["g"]
    assert eng.inspect().placement("acme/ml/prod/g/train") is None   # no nodes: no hint


def test_the_gang_is_placed_once_two_nodes_free_up_and_records_its_nodes():
    eng, _clock, _ = fragment("nodes")
    view = eng.inspect()
    # Blockers 1 and 3 end: nodes 1 and 3 are empty again.
    for run in ("b1", "b3"):
        a = f"acme/ml/prod/{run}/a"
        eng.complete(a, int(view.arrays.a_gen[view.row_of(a)]))
    [g] = eng.tick()
    assert g.action.run == "g"
    assert view.placement("acme/ml/prod/g/train") == ["h100-1", "h100-3"]
    free = {name: v.tolist() for name, v in view.node_free("east").items()}
    assert free == {"h100-0": [3000, 4], "h100-1": [7000, 0], "h100-2": [3000, 4],
                    "h100-3": [7000, 0]}     # (cpu in millicores)
    eng.complete(g.action, g.generation)
    free = {name: v.tolist() for name, v in view.node_free("east").items()}
    assert free["h100-1"] == [8000, 8] and free["h100-3"] == [8000, 8]


def test_placement_is_first_fit_decreasing_like_the_simulator():
    # Pod groups out of size order in the spec: the 6-GPU pods go first (largest), then the
    # 2-GPU ones fill the gaps, as the simulator's node model places them.
    eng, _clock = make_engine(config(count=3))
    eng.enqueue(act("r", pods=(PodGroup("small", 2, {"cpu": 1, "gpu": 2}),
                               PodGroup("big", 2, {"cpu": 1, "gpu": 6}))))
    [a] = eng.tick()
    got = eng.inspect().placement(a.action)
    # The big group first (nodes 0 and 1), then the small pods on the first node with room.
    assert got == ["h100-0", "h100-1", "h100-0", "h100-1"]
    cfg = parse_config(config(count=3), source="<test>")
    nodes = Nodes(cfg.clusters[0], cfg.resources)
    small, big = nodes.place(np.array([[1000, 2], [1000, 6]], dtype=np.int64),
                             np.array([2, 2]))
    assert [f"h100-{n}" for n in [*big, *small]] == got


def test_a_gang_that_no_empty_nodes_can_hold_fails_at_once():
    # Two nodes of 8 GPUs and a capacity table above their sum: three 8-GPU pods fit the
    # totals and the node shape each, never all at once on the nodes.
    cfg = config(count=2)
    cfg["clusters"]["east"]["capacity"] = {"cpu": 64, "gpu:H100": 64}
    eng, _clock = make_engine(cfg)
    eng.enqueue(gang("g", pods=3))
    assert eng.tick() == []
    rec = eng.inspect().record(eng.inspect().row_of("acme/ml/prod/g/train"))
    assert rec.phase == Phase.FAILED
    assert ("its 3 pods cannot all be placed on the nodes of cluster east even when they are "
            "empty") in rec.message


def test_more_pods_than_max_node_pods_never_fit_a_node_cluster():
    eng, _clock = make_engine(config(max_node_pods=2))
    eng.enqueue(gang("g", pods=3, gpu=1))
    assert eng.tick() == []
    rec = eng.inspect().record(eng.inspect().row_of("acme/ml/prod/g/train"))
    assert rec.phase == Phase.FAILED
    assert "engine.max_node_pods = 2" in rec.message


def test_a_reusable_environment_never_fits_a_node_cluster():
    eng, _clock = make_engine(config())
    eng.enqueue(act("r", resources={"cpu": 1}, environment="env",
                    reuse=ReusePolicy(replicas=1, concurrency=1)))
    assert eng.tick() == []
    rec = eng.inspect().record(eng.inspect().row_of("acme/ml/prod/r/a"))
    assert rec.phase == Phase.FAILED and "reusable environments" in rec.message


def test_strict_fifo_head_waiting_for_nodes_holds_the_cluster():
    # The gang waits for nodes; a 1-GPU action behind it in the same STRICT_FIFO queue is not
    # placed on the free GPUs (no backfill): the head is not delayed by it.
    eng, _clock, _ = fragment("nodes")
    eng.enqueue(act("x", resources={"cpu": 1, "gpu": 1}))
    assert eng.tick() == []
    assert eng.explain("acme/ml/prod/g/train").wait == WaitCode.NO_NODE_FIT


def test_the_lease_carries_its_placement_as_a_node_hint_to_the_worker():
    eng, _clock = make_engine(config())
    eng.enqueue_many([gang("g", pods=2, gpu=4, cpu=2), act("c", resources={"cpu": 5})])
    placed = {a.action.run: a for a in eng.tick()}
    assert placed["g"].nodes == ("h100-0", "h100-0")       # both 4-GPU pods on node 0
    assert placed["c"].nodes == ("h100-1",)     # node 0 has 4 cpu left, not 5
    # Over the wire: LEASES carries the hint per lease, and the worker reads it.
    batch = DispatchBatch(DispatchBatch.empty_columns(), {}, [], [], [])
    assert batch.nodes == {}
    msg = Leases(tokens=np.zeros((2, 3), np.uint64), kind=np.zeros(2, np.uint8),
                 attempt=np.ones(2, np.int32), group=np.zeros(2, np.int32),
                 deadline_ns=np.full(2, -1, np.int64), queued_deadline_ns=np.full(2, -1, np.int64),
                 groups=[{"run": "acme/ml/prod/g", "spec": {"id": "acme/ml/prod/g/train",
                                                           "task": "train"}}],
                 names=["train", "other"], nodes=[list(placed["g"].nodes), None])
    [lease, other] = leases_of(decode(encode(msg)))
    assert lease.nodes == ("h100-0", "h100-0") and other.nodes is None
    bad = Leases(**{**vars_of(msg), "nodes": [["h100-0"]]})
    with pytest.raises(ProtocolError, match="LEASES: 'nodes' has 1 items for 2 leases"):
        decode(encode(bad))


def vars_of(msg):
    return {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(("cluster", "engine", "queue", "message"), [
    ({"admission": "nodes", "capacity": {"cpu": 8}}, {}, {},
     "clusters.east.admission: 'nodes' needs the cluster's nodes"),
    ({"admission": "pods"}, {}, {},
     "clusters.east.admission: 'pods' is invalid; allowed: shapes, nodes"),
    ({"admission": "nodes", "node_shapes": [{"count": 1, "allocatable": NODE}]},
     {"resource_gate": "off"}, {},
     "clusters.east.admission: 'nodes' is invalid with engine.resource_gate = 'off'"),
    ({"admission": "nodes", "node_shapes": [{"count": 1, "allocatable": NODE}]},
     {"max_node_pods": 0}, {}, "engine.max_node_pods"),
    # Each node is a row made at start: 200 million ran the shard out of memory there.
    ({"admission": "nodes", "node_shapes": [{"count": 60_000, "allocatable": NODE},
                                            {"count": 40_001, "allocatable": NODE}]}, {}, {},
     "clusters.east.node_shapes: 100001 nodes in all; allowed: at most 100000 nodes"),
])
def test_bad_admission_config_is_refused_naming_the_key(cluster, engine, queue, message):
    cfg = {"resources": ["cpu", "gpu:H100"], "clusters": {"east": cluster},
           "queues": {"gpu": queue}, "engine": {"default_queue": "gpu", **engine}}
    with pytest.raises(ConfigError, match="^<test>: " + re.escape(message)):
        parse_config(cfg, source="<test>")


def test_admission_defaults_to_shapes_and_backfill_may_use_node_clusters():
    cfg = parse_config(config(), source="<test>")
    assert cfg.clusters[0].admission == "nodes"
    plain = parse_config(config(admission="shapes") | {"clusters": {"east": {
        "node_shapes": [{"count": 1, "allocatable": NODE}]}}}, source="<test>")
    assert plain.clusters[0].admission == "shapes"
    # Reservations are computed on nodes (below, "Backfill on nodes"): a live change too.
    assert update_queue(cfg.queues[0], {"backfill": True}, cfg).backfill is True


# ----------------------------------------------------------------------------- durability


def _node_engine(store, clock):
    eng = Engine(parse_config(config(), source="<test>"), clock=clock, store=store)
    eng.register_worker("w", "east", 100)
    return eng


def test_reload_keeps_placements_and_node_free_vectors():
    clock = ManualClock()
    store = MemoryStore(4)
    eng = _node_engine(store, clock)
    eng.enqueue_many([blocker("b0"), gang("g", pods=2, gpu=4, cpu=2)])
    placed = eng.tick()
    assert len(placed) == 2
    view = eng.inspect()
    before = {a.action.run: view.placement(a.action) for a in placed}
    free = {k: v.tolist() for k, v in view.node_free("east").items()}
    eng.close()
    again = _node_engine(MemoryStore(store.partitions, backing=store.backing), clock)
    view2 = again.inspect()
    assert {a.action.run: view2.placement(a.action) for a in placed} == before
    assert {k: v.tolist() for k, v in view2.node_free("east").items()} == free
    # And they are released from the reloaded state as from the first.
    for a in placed:
        again.complete(a.action, a.generation)
    assert all(v.tolist() == [8000, 8] for v in view2.node_free("east").values())


def test_a_store_cannot_change_its_placement_width():
    clock = ManualClock()
    store = MemoryStore(4)
    _node_engine(store, clock).close()
    with pytest.raises(ConfigError, match="engine.max_node_pods / clusters.\\*.admission"):
        Engine(parse_config(config(max_node_pods=4), source="<test>"), clock=clock,
               store=MemoryStore(store.partitions, backing=store.backing))


def test_a_store_refuses_nodes_its_live_placements_no_longer_have():
    clock = ManualClock()
    store = MemoryStore(4)
    eng = _node_engine(store, clock)
    eng.enqueue_many([blocker(f"b{i}") for i in range(4)])      # one per node, 0..3
    assert len(eng.tick()) == 4
    eng.close()
    with pytest.raises(ConfigError, match="not a node of cluster row 0: its nodes changed"):
        Engine(parse_config(config(count=2), source="<test>"), clock=clock,
               store=MemoryStore(store.partitions, backing=store.backing))


# ----------------------------------------------------------------------------- invariants


class NodeMachine(RuleBasedStateMachine):
    """Random gangs and single pods enqueued (some with a runtime estimate, in a backfill
    queue: the reservations' node projections run), ticks, completions, aborts, expiries and
    workers' per-node free reports on a cluster of nodes: no node's used vector goes negative
    or past its allocatable, it always equals the pods of the live leases placed on it, no
    node is given more than a report left on it, and all is zero once everything ended."""

    def __init__(self):
        super().__init__()
        self.eng, self.clock = make_engine(
            config(count=3, queue={"backfill": True}) | {"clusters": {"east": {
                "admission": "nodes",
                "node_shapes": [{"name": "big", "count": 2, "allocatable": NODE},
                                {"name": "small", "count": 2,
                                 "allocatable": {"cpu": 4, "gpu:H100": 2}}]}}},
            workers={"w": ("east", 1000)})
        self.view = self.eng.inspect()
        self.n = 0
        self.live = {}      # action -> generation

    @rule(groups=st.lists(st.tuples(st.integers(1, 3), st.integers(0, 4), st.integers(0, 8)),
                          min_size=1, max_size=3),
          estimate=st.sampled_from([None, 10.0, 100.0, 1000.0]))
    def enqueue(self, groups, estimate):
        self.n += 1
        pods = tuple(PodGroup(f"g{k}", n, {"cpu": cpu, "gpu": gpu} if gpu else {"cpu": cpu})
                     for k, (n, cpu, gpu) in enumerate(groups))
        self.eng.enqueue(act(f"r{self.n % 5}", f"a{self.n}", pods=pods,
                             runtime_estimate=estimate))

    @rule(node=st.sampled_from(["big-0", "big-1", "small-0", "small-1"]),
          gpu=st.integers(0, 8), cpu=st.none() | st.integers(0, 8))
    def report(self, node, gpu, cpu):
        free = {"gpu:H100": gpu} if cpu is None else {"gpu:H100": gpu, "cpu": cpu}
        self.eng.heartbeat("w", b"", node_free={node: free})

    @rule(seconds=st.sampled_from([1.0, 50.0, 500.0]))
    def advance(self, seconds):
        self.clock.advance(seconds)

    @rule()
    def tick(self):
        for a in self.eng.tick():
            if a.kind == LeaseKind.RUN:     # (an abort's cleanup is a finalize lease)
                self.live[str(a.action)] = a.generation

    @precondition(lambda self: self.live)
    @rule(data=st.data(), how=st.sampled_from(["ok", "fail", "abort"]))
    def end(self, data, how):
        action = data.draw(st.sampled_from(sorted(self.live)))
        gen = self.live.pop(action)
        if how == "abort":
            self.eng.abort(action)
        else:
            self.eng.complete(action, gen, Phase.SUCCEEDED if how == "ok" else Phase.FAILED)

    @invariant()
    def used_matches_the_live_placements(self):
        arrays = self.view.arrays
        used = np.asarray(arrays.n_used)
        alloc = np.asarray(arrays.n_alloc)
        assert (used >= 0).all() and (used <= alloc).all()
        expect = np.zeros_like(used)
        n_rows = self.view.action_rows
        state = np.asarray(arrays.a_state[:n_rows])
        live = ((state == RowState.SENT) | (state == RowState.RUNNING)) & (
            np.asarray(arrays.a_gen[:n_rows]) != np.asarray(arrays.a_released_gen[:n_rows]))
        for row in np.flatnonzero(live).tolist():
            first, n = int(arrays.a_pg_first[row]), int(arrays.a_pg_n[row])
            k = 0
            for g in range(first, first + n):
                for _ in range(int(arrays.pg_count[g])):
                    expect[int(arrays.a_pnode[row, k])] += arrays.pg_vec[g]
                    k += 1
        assert (used == expect).all()

    @invariant()
    def no_node_is_given_more_than_its_report_left(self):
        arrays = self.view.arrays
        reported = np.asarray(arrays.n_obs) < UNLIMITED
        left = np.asarray(arrays.n_obs) - (np.asarray(arrays.n_adm)
                                           - np.asarray(arrays.n_obs_mark))
        assert (left[reported] >= 0).all(), left

    def teardown(self):
        for action in list(self.live):
            self.eng.abort(action)
        # Everything queued is aborted too: then no node holds anything.
        state = np.asarray(self.view.arrays.a_state[:self.view.action_rows])
        for row in np.flatnonzero((state == RowState.QUEUED)
                                  | (state == RowState.BACKOFF)).tolist():
            self.eng.abort(self.view.action_at(row))
        self.eng.tick()
        assert not np.asarray(self.view.arrays.n_used).any()


TestNodeMachine = NodeMachine.TestCase
TestNodeMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


# ----------------------------------------------------------------------------- simulator


def test_the_simulator_runs_node_aware_admission_without_pending_pods():
    # test_sim_nodes' fragmented gang: under "shapes" it is admitted at t=1 and pends on the
    # nodes until t=50; under "nodes" the engine holds it queued until a node frees, so the
    # same wait is spent queued and no pod ever pends in the cluster.
    from engine._sim import simulate
    from tests.test_sim_nodes import _job, node_config, node_shape

    shapes = [node_shape("h100", 3, cpu=32, gpu=8)]
    six = {"cpu": 1, "gpu:H100": 6}
    jobs = [_job(0, 0, 100, (1, six)), _job(1, 0, 50, (1, six)), _job(2, 1, 10, (2, six)),
            _job(3, 100, 1, (1, {"cpu": 1}))]
    by_shapes = simulate(node_config(shapes), jobs, "greedy")
    by_nodes = simulate(node_config(None, {"a": {"admission": "nodes", "node_shapes": shapes}}),
                        jobs, "greedy")
    assert by_shapes.pended == 1 and by_shapes.pend_max_s == 49.0
    assert by_nodes.pended == 0 and by_nodes.pend_max_s == 0.0
    assert by_nodes.gang_max_wait_s == by_shapes.gang_max_wait_s == 49.0


# ----------------------------------------------------------------------------- node reports


def test_a_workers_node_report_bounds_what_the_gate_places_there():
    """A node reported with no GPU free (taken by pods the engine did not place) takes no
    pod until a later report frees it; what the engine places after a report counts against
    it. The other nodes are the engine's own accounting."""
    eng, _clock = make_engine(config(count=2), workers={"w": ("east", 100)})
    eng.heartbeat("w", b"", node_free={"h100-0": {"gpu:H100": 0}})
    view = eng.inspect()
    assert int(view.node_free("east")["h100-0"][1]) == 0
    assert int(view.node_free("east")["h100-1"][1]) == 8
    [a] = eng.enqueue_many([act("one", resources={"cpu": 1, "gpu": 4})])
    [placed] = eng.tick()
    assert view.placement(placed.action) == ["h100-1"]      # not the node reported full
    eng.heartbeat("w", b"", node_free={"h100-0": {"gpu:H100": 6}})
    eng.enqueue(act("two", resources={"cpu": 1, "gpu": 4}))
    [two] = eng.tick()
    assert view.placement(two.action) == ["h100-0"]
    # 6 reported, 4 placed since: 2 left there, whatever its allocatable says.
    assert int(view.node_free("east")["h100-0"][1]) == 2
    eng.enqueue(act("three", resources={"cpu": 1, "gpu": 4}))
    [three] = eng.tick()
    assert view.placement(three.action) == ["h100-1"]
    eng.enqueue(act("four", resources={"cpu": 1, "gpu": 4}))
    assert eng.tick() == []
    assert eng.explain("acme/ml/prod/four/a").wait == WaitCode.NO_NODE_FIT


@pytest.mark.parametrize(("admission", "report", "message"), [
    ("nodes", {"h100-9": {"gpu:H100": 1}},
     "worker w: node_free: 'h100-9' is not a node of cluster east (its nodes: h100-0 .. "
     "h100-3)"),
    ("nodes", {"h100-1": {"tpu": 1}}, "worker w: node_free.h100-1: "),
    ("nodes", {"h100-1": {"gpu:H100": "lots"}}, "worker w: node_free.h100-1: "),
    ("nodes", ["h100-1"], "worker w: node_free must be a map"),
    ("shapes", {"h100-0": {"gpu:H100": 1}},
     "worker w: node_free: cluster east places no pods on nodes (admission = 'shapes')"),
])
def test_a_bad_node_report_is_refused_naming_it_and_changes_nothing(admission, report,
                                                                      message):
    cfg = config(admission)
    if admission == "shapes":
        cfg["queues"]["gpu"] = {"scheduling": "STRICT_FIFO"}
    eng, _clock = make_engine(cfg, workers={"w": ("east", 100)})
    eng.heartbeat("w", b"", node_free={"h100-1": {"gpu:H100": 5}} if admission == "nodes"
                  else None)
    before = eng.inspect().node_free("east")
    with pytest.raises(SpecError, match="^" + re.escape(message)):
        eng.heartbeat("w", b"", free_capacity={"cpu": 1}, node_free=report)
    after = eng.inspect().node_free("east")
    assert before.keys() == after.keys()
    assert all((before[k] == after[k]).all() for k in before)
    assert eng.inspect().arrays.c_obs[0, 0] == UNLIMITED   # the cluster report neither


def test_a_node_report_travels_in_a_heartbeat_over_the_wire(tmp_path):
    """WorkerConnection.heartbeat(node_free=...) over a real socket: the shard's gate obeys
    it, and a report naming no node of the cluster is an error reply naming it."""
    cfg = config(count=1)
    cfg["queues"]["gpu"]["depth"] = 100
    cfg["storage"] = {"path": str(tmp_path / "data"), "partitions": 1}
    cfg["transport"] = {"endpoints": ["tcp://127.0.0.1:0"]}
    cfg["security"] = {"insecure": True}
    shard = Shard(parse_config(cfg, source="<test>"), store=MemoryStore()).start()
    w = WorkerConnection(shard.endpoint, None, "w", "east", 10, timeout=5.0)
    c = Client(endpoint=shard.endpoint, timeout=5.0)
    try:
        w.connect()
        assert w.heartbeat(b"", node_free={"h100-0": {"gpu:H100": 0}}) == []
        c.enqueue({"id": "acme/ml/prod/r/a", "task": "a", "resources": {"cpu": 1, "gpu": 2}})
        assert w.leases(timeout=0.5) == []
        assert c.explain("acme/ml/prod/r/a")["wait"] == WaitCode.NO_NODE_FIT
        with pytest.raises(ShardError, match="'h100-7' is not a node of cluster east"):
            w.heartbeat(b"", node_free={"h100-7": {"gpu:H100": 8}})
        assert w.heartbeat(b"", node_free={"h100-0": {"gpu:H100": 8}}) == []
        [lease] = w.leases(timeout=5.0)
        assert lease.nodes == ("h100-0",)
    finally:
        c.close()
        w.close()
        shard.stop()


def test_a_worker_is_one_node_of_its_cluster_only_when_the_cluster_has_it(tmp_path):
    cfg = config(count=2)
    cfg["security"] = {"insecure": True}
    cfg["transport"] = {"endpoints": ["tcp://127.0.0.1:0"]}
    parsed = parse_config(cfg, source="<test>")
    assert Worker(parsed, "east", name="w", slots=1, node="h100-1").node == "h100-1"
    with pytest.raises(ConfigError, match="--node 'h100-5' is not a node of cluster east "
                                          r"\(its nodes: h100-0 .. h100-1\)"):
        Worker(parsed, "east", name="w", slots=1, node="h100-5")
    cfg["clusters"]["east"]["admission"] = "shapes"
    with pytest.raises(ConfigError, match="cluster east places no pods on nodes"):
        Worker(parse_config(cfg, source="<test>"), "east", name="w", slots=1, node="h100-0")
