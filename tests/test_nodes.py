"""The simulator's node model (engine._nodes): pods taken largest first, each on the first
node with room, gangs placed whole or not at all, pending actions retried oldest first."""

import numpy as np

from engine._nodes import Nodes, Placer, size_order
from tests.test_sim_nodes import node_config, node_shape


def _vec(cfg, **res):
    if "gpu" in res:
        res["gpu:H100"] = res.pop("gpu")
    return cfg.resources.vector(res)


def test_pods_are_taken_largest_first_accelerators_then_cpu_then_memory():
    cfg = node_config([node_shape("h100", 2, cpu=32, gpu=8)])
    pods = np.array([_vec(cfg, cpu=8, memory="1Gi"),
                     _vec(cfg, cpu=32),
                     _vec(cfg, cpu=1, gpu=1),
                     _vec(cfg, cpu=8, memory="2Gi"),
                     _vec(cfg, cpu=8, memory="1Gi")])
    # The GPU pod, then the most cpu, then more memory; equal pods keep their order.
    assert size_order(cfg.resources, pods).tolist() == [2, 1, 3, 0, 4]


def test_first_fit_decreasing_places_the_large_pod_before_the_small_one():
    # Nodes in config order: one of 8 GPUs, then one of 4. The gang lists its 4-GPU pod
    # first; placed in that order it would take the 8-GPU node and leave the 8-GPU pod
    # nowhere. Largest first, the 8-GPU pod takes node 0 and the 4-GPU pod node 1.
    cfg = node_config([node_shape("big", 1, cpu=16, gpu=8), node_shape("small", 1, cpu=16, gpu=4)])
    nodes = Nodes(cfg.cluster("a"), cfg.resources)
    assert nodes.names == ["big-0", "small-0"]
    pods = np.array([_vec(cfg, cpu=1, gpu=4), _vec(cfg, cpu=1, gpu=8)])
    placed = nodes.place(pods, np.array([1, 1]))
    assert [p.tolist() for p in placed] == [[1], [0]]
    assert nodes.free[:, 2].tolist() == [0, 0]
    nodes.release(pods, placed)
    assert (nodes.free == nodes.allocatable).all()


def test_identical_pods_fill_nodes_in_order_and_a_gang_is_placed_whole_or_not_at_all():
    cfg = node_config([node_shape("n", 3, cpu=16, gpu=8)])
    nodes = Nodes(cfg.cluster("a"), cfg.resources)
    pod = np.array([_vec(cfg, cpu=4, gpu=2)])
    assert nodes.place(pod, np.array([5]))[0].tolist() == [0, 0, 0, 0, 1]
    before = nodes.free.copy()
    assert nodes.place(pod, np.array([8])) is None        # 7 more fit, not 8
    assert (nodes.free == before).all()                   # nothing taken
    # A placer retries what pends, oldest first, whenever asked; on fresh nodes (12 pods).
    placer = Placer(Nodes(cfg.cluster("a"), cfg.resources))
    placer.admit("w", pod, np.array([5]))
    placer.admit("x", pod, np.array([8]))
    placer.admit("y", pod, np.array([7]))
    assert placer.place_pending() == ["w", "y"]           # x pends; y fits and is not held back
    placer.finish("y")
    assert placer.place_pending() == []                   # 7 free: x still does not fit
    placer.finish("w")
    assert placer.place_pending() == ["x"]
