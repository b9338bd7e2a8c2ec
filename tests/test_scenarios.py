"""The seed's scenarios, end to end through the Engine and the Cython tick."""

from engine import ActionSpec, Phase, PodGroup, WaitCode
from tests.conftest import make_engine

GPU_NODE = {"cpu": 96, "memory": "1Ti", "gpu:H100": 8}


def one_cluster(gpus_per_node=8, nodes=2, scheduling="STRICT_FIFO", **queue):
    return {
        "resources": ["cpu", "memory", "gpu:H100"],
        "clusters": {
            "east": {
                "node_shapes": [{"name": "h100", "count": nodes,
                                 "allocatable": {**GPU_NODE, "gpu:H100": gpus_per_node}}],
            }
        },
        "queues": {"gpu": {"scheduling": scheduling, **queue}},
        "engine": {"default_queue": "gpu"},
    }


def act(run, name="a", task="train", **kw):
    return ActionSpec(id=f"acme/ml/prod/{run}/{name}", task=task, **kw)


def gang(run, pods, gpus_per_pod, name="a"):
    return act(run, name, pods=(PodGroup("worker", pods, {"cpu": 4, "gpu": gpus_per_pod}),))


def small(run, gpus, name="a", cpu=1):
    return act(run, name, task="small", resources={"cpu": cpu, "gpu": gpus})


def test_hundred_8gpu_gangs_on_16_gpus_admit_two_and_the_rest_wait_for_capacity():
    eng, _ = make_engine(one_cluster(action_concurrency=100))
    eng.enqueue_many([gang(f"r{i}", 2, 4) for i in range(100)])
    placed = eng.tick()
    assert len(placed) == 2
    assert eng.cluster_in_flight("east")["gpu:H100"] == 16
    waiting = [eng.explain(f"acme/ml/prod/r{i}/a") for i in range(2, 100)]
    assert all(w.phase == Phase.WAITING_FOR_RESOURCES for w in waiting)
    assert {w.wait for w in waiting} == {WaitCode.CLUSTER_CAPACITY}
    assert "needs gpu:H100=8; cluster east has 0 free" in waiting[0].reason
    # A second tick changes nothing: no over-commit, nothing leaks.
    assert eng.tick() == []
    assert eng.queue_metrics("gpu")["actions_in_flight"] == 2


def _stream_against_gang(scheduling, steps=12):
    """8 GPUs busy with 2-GPU actions; a 6-GPU gang arrives; each step one 2-GPU action
    ends and a new one arrives. Returns the step at which the gang started, or None."""
    eng, _ = make_engine(one_cluster(nodes=1, scheduling=scheduling))
    running = []
    for i in range(4):
        eng.enqueue(small(f"s{i}", 2))
    running += eng.tick()
    assert len(running) == 4
    eng.enqueue(gang("g", 3, 2))
    for step in range(steps):
        for a in eng.tick():
            if a.action.run == "g":
                return step
            running.append(a)
        done = running.pop(0)
        eng.complete(done.action, done.generation)
        eng.enqueue(small(f"t{step}", 2))
    return None


def test_strict_fifo_does_not_starve_a_gang_behind_a_stream_of_small_actions():
    started = _stream_against_gang("STRICT_FIFO")
    assert started is not None and started <= 4


def test_greedy_capacity_starves_the_gang_behind_the_same_stream():
    assert _stream_against_gang("GREEDY_CAPACITY") is None


def test_blocked_gang_on_cluster_a_does_not_block_work_only_cluster_b_can_run():
    cfg = {
        "resources": ["cpu", "memory", "gpu:H100"],
        "clusters": {
            "a": {"node_shapes": [{"count": 1, "allocatable": GPU_NODE}]},
            "b": {"node_shapes": [{"count": 4, "allocatable": {"cpu": 64, "memory": "256Gi"}}]},
        },
        "queues": {"mixed": {"scheduling": "STRICT_FIFO"}},
        "engine": {"default_queue": "mixed"},
    }
    eng, _ = make_engine(cfg)
    eng.enqueue(small("busy", 4))
    assert len(eng.tick()) == 1           # 4 of a's 8 GPUs now busy
    eng.enqueue(gang("g", 1, 8))          # needs all of a: blocked
    eng.enqueue_many([act(f"c{i}", task="etl", resources={"cpu": 8}) for i in range(5)])
    eng.enqueue(small("later-gpu", 2))    # fits a's free GPUs but is behind the head
    placed = eng.tick()
    runs = sorted(a.action.run for a in placed)
    assert runs == [f"c{i}" for i in range(5)]
    assert all(a.cluster == "b" for a in placed)
    assert eng.explain("acme/ml/prod/g/a").wait == WaitCode.CLUSTER_CAPACITY
    later = eng.explain("acme/ml/prod/later-gpu/a")
    assert later.wait == WaitCode.HEAD_OF_LINE
    assert "head-of-line blocked by g/train (needs gpu:H100=8; cluster a has 4 free)" in (
        later.reason)


def test_live_queue_update_lowers_a_cap_without_touching_running_work():
    eng, _ = make_engine(one_cluster(action_concurrency=4))
    eng.enqueue_many([small(f"r{i}", 0) for i in range(6)])
    running = eng.tick()
    assert len(running) == 4
    eng.update_queue("gpu", action_concurrency=2)
    assert eng.queue_metrics("gpu")["actions_in_flight"] == 4   # nothing killed
    assert all(eng.phase(a.action) == Phase.INITIALIZING for a in running)
    assert eng.tick() == []
    assert eng.explain("acme/ml/prod/r4/a").reason == "queue gpu: action_concurrency 2 reached"
    for a in running[:2]:
        eng.complete(a.action, a.generation)
    assert eng.tick() == []                # 2 in flight = the new cap
    eng.complete(running[2].action, running[2].generation)
    assert len(eng.tick()) == 1


def test_eight_free_gpus_split_four_and_four_do_not_admit_one_8gpu_pod():
    eng, _ = make_engine(one_cluster(gpus_per_node=4, nodes=2))
    eng.enqueue(act("big", resources={"cpu": 8, "gpu": 8}))
    eng.enqueue(gang("split", 2, 4))
    placed = eng.tick()
    assert [a.action.run for a in placed] == ["split"]
    big = eng.explain("acme/ml/prod/big/a")
    assert big.phase == Phase.FAILED
    assert big.reason.startswith("UNSCHEDULABLE: pod (cpu=8, gpu:H100=8) fits no node shape "
                                 "of cluster east")
    assert eng.cluster_in_flight("east")["gpu:H100"] == 8


def test_a_queue_of_equal_priority_does_not_starve_a_blocked_gang():
    """Only a queue of higher priority may take capacity a STRICT head waits for: a stream of
    2-GPU actions in an equal-priority queue (earlier in config order) must not starve it."""
    cfg = one_cluster(nodes=1)
    cfg["queues"] = {"stream": {"priority": 500}, "gangs": {"priority": 500}}
    cfg["engine"] = {"default_queue": "stream"}
    eng, _ = make_engine(cfg)
    running = []
    for i in range(4):
        eng.enqueue(act(f"s{i}", resources={"cpu": 1, "gpu": 2}, run_queue="stream"))
    running += eng.tick()
    eng.enqueue(act("g", pods=(PodGroup("w", 3, {"cpu": 1, "gpu": 2}),), run_queue="gangs"))
    started = None
    for step in range(12):
        placed = eng.tick()
        if any(a.action.run == "g" for a in placed):
            started = step
            break
        running += placed
        done = running.pop(0)
        eng.complete(done.action, done.generation)
        eng.enqueue(act(f"t{step}", resources={"cpu": 1, "gpu": 2}, run_queue="stream"))
    assert started is not None and started <= 4
    # A higher-priority stream may take it: that is what priority means.
    cfg["queues"]["stream"]["priority"] = 600
    eng, _ = make_engine(cfg)
    for i in range(4):
        eng.enqueue(act(f"s{i}", resources={"cpu": 1, "gpu": 2}, run_queue="stream"))
    running = eng.tick()
    eng.enqueue(act("g", pods=(PodGroup("w", 3, {"cpu": 1, "gpu": 2}),), run_queue="gangs"))
    for step in range(12):
        placed = eng.tick()
        assert not any(a.action.run == "g" for a in placed), step
        running += placed
        done = running.pop(0)
        eng.complete(done.action, done.generation)
        eng.enqueue(act(f"t{step}", resources={"cpu": 1, "gpu": 2}, run_queue="stream"))
