"""The in-cluster scheduler the trace simulator models: nodes, and pods placed on them.

A cluster with node shapes is its nodes: each shape's ``count`` nodes with its
``allocatable`` vector, in config order (shapes as listed, then node 0, 1, ... of a shape).
:meth:`Nodes.place` places every pod of one action, **first fit decreasing**:

- pods are taken largest first. "Largest" compares, in this order, the pod's accelerators
  (all ``kind:model`` resources summed), then ``cpu``, then ``memory``, then every other
  resource in config order; equal pods keep their order in the action;
- each pod goes on the first node (in the order above) with room for all of it;
- an action is placed whole or not at all (a gang's pods run together): when one pod finds
  no node, nothing of the action is placed.

:class:`Placer` keeps the actions of one cluster that were admitted but not placed yet, in
admission order, and retries them (oldest first, each on its own: one that still does not
fit does not hold back a later one that does) whenever it is asked, i.e. whenever capacity
frees up.
"""

import numpy as np

__all__ = ["Nodes", "Placer", "node_index", "node_names", "size_order", "unknown_node"]


def node_names(cluster):
    """The names of ``cluster``'s nodes (a ``ClusterConfig``), in node order: ``<shape>-<k>``
    for node ``k`` of each shape, shapes as listed."""
    return [f"{s.name}-{k}" for s in cluster.node_shapes for k in range(s.count)]


def node_index(cluster):
    """``{node name: index in node order}`` of ``cluster`` (a ``ClusterConfig`` with
    admission = "nodes"); ``ValueError`` saying so when it places no pods on nodes."""
    if cluster.admission != "nodes":
        raise ValueError(f"cluster {cluster.name} places no pods on nodes (admission = "
                         f"{cluster.admission!r})")
    return {name: k for k, name in enumerate(node_names(cluster))}


def unknown_node(cluster, name):
    """The error text for ``name``, which is not a node of ``cluster``."""
    names = node_names(cluster)
    return (f"{name!r} is not a node of cluster {cluster.name} (its nodes: {names[0]} .. "
            f"{names[-1]})")


def size_order(resources, pods):
    """Indices of the rows of ``pods`` ([P, R] int64, engine units), largest first: by
    accelerators summed, then cpu, then memory, then the other resources in config order;
    ties keep their order (a stable sort)."""
    names = resources.names
    accel = resources.accelerator_mask.astype(bool)
    keys = [pods[:, accel].sum(axis=1)] if accel.any() else []
    first = [names.index(n) for n in ("cpu", "memory") if n in names]
    keys += [pods[:, r] for r in first]
    keys += [pods[:, r] for r in range(len(names)) if not accel[r] and r not in first]
    # np.lexsort sorts by the last key first and is stable; negated keys sort descending.
    return np.lexsort([-k for k in reversed(keys)])


class Nodes:
    """The nodes of one cluster and what each has free."""

    def __init__(self, cluster, resources):
        self.resources = resources
        self.names = node_names(cluster)
        self.allocatable = np.array([s.allocatable for s in cluster.node_shapes
                                     for _ in range(s.count)], dtype=np.int64)
        self.free = self.allocatable.copy()

    def place(self, pods, counts):
        """Place ``counts[p]`` pods of shape ``pods[p]`` (pod groups, [P, R] and [P]) first
        fit decreasing. On success the capacity is taken and the result is one array of
        node indices per group (its pods' nodes, in pod order); None when some pod fits no
        node, and then nothing is taken."""
        free = self.free.copy()
        placed = [None] * pods.shape[0]
        for p in size_order(self.resources, pods):
            nodes = _first_fit(free, pods[p], int(counts[p]))
            if nodes is None:
                return None
            placed[p] = nodes
        self.free = free
        return placed

    def release(self, pods, placed):
        """Give back what :meth:`place` took for these pod groups."""
        for p, nodes in enumerate(placed):
            np.add.at(self.free, nodes, pods[p])


def _first_fit(free, pod, count):
    """Node indices of ``count`` identical pods placed first fit on ``free`` (updated in
    place), or None if they do not all fit. Identical pods placed one by one on the first
    node with room fill node 0 as far as it goes, then node 1, ...: so each node takes as
    many as fit, in order, which is computed per node rather than per pod."""
    need = pod > 0
    if not need.any():
        room = np.full(free.shape[0], count, dtype=np.int64)   # an empty pod fits anywhere
    else:
        room = (free[:, need] // pod[need]).min(axis=1)
    room = np.minimum(room, count)     # no node takes more than all of them (no overflow)
    take = np.minimum(room, np.maximum(0, count - (np.cumsum(room) - room)))
    if int(take.sum()) < count:
        return None
    free -= take[:, None] * pod
    return np.repeat(np.arange(free.shape[0]), take)


class Placer:
    """Admitted actions of one cluster waiting for nodes, in admission order."""

    def __init__(self, nodes):
        self.nodes = nodes
        self.pending = []          # (key, pods, counts), oldest first
        self.placed = {}           # key -> (pods, node indices per group)

    def admit(self, key, pods, counts):
        """An action the engine assigned to this cluster: it waits for nodes."""
        self.pending.append((key, pods, counts))

    def place_pending(self):
        """Try every waiting action, oldest first; returns the keys placed now, in order."""
        done, left = [], []
        for key, pods, counts in self.pending:
            where = self.nodes.place(pods, counts)
            if where is None:
                left.append((key, pods, counts))
            else:
                self.placed[key] = (pods, where)
                done.append(key)
        self.pending = left
        return done

    def finish(self, key):
        """An action placed earlier ended: its nodes' capacity is free again."""
        pods, where = self.placed.pop(key)
        self.nodes.release(pods, where)
