"""Codes shared with the Cython kernel (mirror of cext/_types.pxd; tests/test_layout.py fails
when the two differ)."""

import enum

__all__ = ["RowState", "WaitCode", "Phase", "LeaseEnd", "Verdict", "LeaseKind", "PHASES",
           "PHASE_CODE"]


class RowState(enum.IntEnum):
    """State of an action row (and of its run lease)."""

    FREE = 0
    QUEUED = 1
    SENT = 2
    RUNNING = 3
    DONE = 4
    BACKOFF = 5


class WaitCode(enum.IntEnum):
    """Why the tick did not place a queued action (or stopped scanning a queue)."""

    NONE = 0
    PLACED = 1
    QUEUE_ACTIONS = 2
    QUEUE_RUNS = 3
    RUN_ACTIONS = 4
    QUEUE_BUDGET = 5
    CLUSTER_CAPACITY = 6
    HEAD_OF_LINE = 7
    NO_WORKER = 8
    POOL_BUSY = 9
    DISPATCH_FULL = 10
    CANDIDATE_LIMIT = 11
    UNSCHEDULABLE_SHAPE = 12
    UNSCHEDULABLE_CAP = 13
    HEAD_BUDGET = 14
    POOL_ELSEWHERE = 15
    QUEUE_PAUSED = 16
    # A queue's scan stopped after its blocked head because nothing more of it could be
    # placed; the actions behind were not examined, and explain resolves what each waits for
    # (TickKernel.resolve_wait). Never shown as such.
    QUEUE_HELD = 17
    # The tenant's caps ([tenants.NAME] / [tenant_defaults]), counted over every queue.
    TENANT_ACTIONS = 18
    TENANT_RUNS = 19
    # admission = "nodes" (docs/nodes.md): the totals fit a cluster, its nodes cannot hold
    # every pod at once now (free capacity fragmented across nodes).
    NO_NODE_FIT = 20


# Waits that are about resources (the phase is WAITING_FOR_RESOURCES, not QUEUED).
RESOURCE_WAITS = frozenset(
    {
        WaitCode.QUEUE_BUDGET,
        WaitCode.CLUSTER_CAPACITY,
        WaitCode.NO_NODE_FIT,
        WaitCode.HEAD_OF_LINE,
        WaitCode.NO_WORKER,
        WaitCode.POOL_BUSY,
        WaitCode.HEAD_BUDGET,
        WaitCode.POOL_ELSEWHERE,
    }
)


class Phase(enum.StrEnum):
    """Phases shown to users."""

    QUEUED = "QUEUED"
    WAITING_FOR_RESOURCES = "WAITING_FOR_RESOURCES"
    INITIALIZING = "INITIALIZING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    ABORTED = "ABORTED"
    TIMED_OUT = "TIMED_OUT"


TERMINAL_PHASES = frozenset({Phase.SUCCEEDED, Phase.FAILED, Phase.ABORTED, Phase.TIMED_OUT})

# Phases by code (the a_phase column of a lean row, whose fixed record is its whole outcome).
PHASES = tuple(Phase)
PHASE_CODE = {p: i for i, p in enumerate(PHASES)}



class LeaseEnd(enum.IntEnum):
    """How the current generation of a lease ended."""

    LIVE = 0
    COMPLETED = 1
    EXPIRED = 2
    ABORTED = 3


class Verdict(enum.IntEnum):
    """The engine's answer to a presented token (heartbeat or report)."""

    OK = 0
    STALE = 1       # an older generation: the lease moved on
    EXPIRED = 2     # this generation expired
    COMPLETED = 3   # this generation already completed
    ABORTED = 4     # aborted: the worker must stop now
    UNKNOWN = 5     # forged, altered, not this worker's, or no such lease


class LeaseKind(enum.IntEnum):
    """Run lease (one per action) or finalize lease (cleanup of one attempt)."""

    RUN = 0
    FINALIZE = 1


# Engine timer kinds (engine/_engine.py keeps a heap of (due_ns, seq, kind, row, ref); ref
# detects a timer that no longer applies: the attempt number, or the lease generation).
# Plain ints: reload (engine/_reload.py) stores them in a numpy column.
T_DEADLINE, T_QUEUED, T_RETRY, T_RUNTIME, T_FINALIZE = range(5)


def _members_in_class_dict(*enums):
    # Python 3.11 finds an enum member through EnumType.__getattr__ (about 2 us a lookup;
    # 3.12 uses descriptors), and the engine reads these codes on every row it touches. Put
    # each member in its class's own dict, where attribute lookup finds it first: the same
    # member objects, found at the speed of a plain class attribute.
    for cls in enums:
        for name, member in cls.__members__.items():
            if name not in cls.__dict__:
                type.__setattr__(cls, name, member)


_members_in_class_dict(RowState, WaitCode, Phase, LeaseEnd, Verdict, LeaseKind)
