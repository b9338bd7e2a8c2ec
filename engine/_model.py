"""The action model: identifiers, the spec an action is enqueued with, and its compiled form.

A spec is data, checked once at enqueue: a bad spec raises ``SpecError`` saying what is
wrong and nothing is stored. Compiling turns it into what the tick needs: the queue, the total
demand vector, the per-pod vectors (a gang), and for reusable environments a stable identity,
the pool footprint (replicas x per-pod vector) and its slots (replicas x concurrency).
"""

import hashlib
import math
import re
from dataclasses import dataclass, field, replace
from datetime import timedelta

import numpy as np

from engine._errors import SpecError
from engine._execution import Execution, check_execution
from engine._tables import table_of
from engine._units import MAX_SECONDS, UNLIMITED

__all__ = [
    "ActionId",
    "PodGroup",
    "ReusePolicy",
    "RetryPolicy",
    "Timeouts",
    "ActionSpec",
    "CompiledAction",
    "compile_spec",
    "fit_problem",
]

_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
# The whole id in one match (fast path); a mismatch is explained segment by segment.
_ID = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.-]*)/([A-Za-z0-9][A-Za-z0-9_.-]*)/"
                 r"([A-Za-z0-9][A-Za-z0-9_.-]*)/([A-Za-z0-9][A-Za-z0-9_.-]*)/"
                 r"([A-Za-z0-9][A-Za-z0-9_.-]*)\Z")


@dataclass(frozen=True, order=True)
class ActionId:
    """``tenant/project/domain/run/action``."""

    tenant: str
    project: str
    domain: str
    run: str
    action: str

    @classmethod
    def parse(cls, text):
        """Parse ``t/p/d/r/a``; raises ``SpecError`` naming the bad part."""
        if isinstance(text, ActionId):
            return text
        if not isinstance(text, str):
            raise SpecError(f"action id must be a string tenant/project/domain/run/action, "
                            f"not {text!r}")
        m = _ID.match(text)
        if m is not None:
            return cls(*m.groups())
        parts = text.split("/")
        if len(parts) != 5:
            raise SpecError(f"action id {text!r} must have 5 parts "
                            f"tenant/project/domain/run/action, it has {len(parts)}")
        names = ("tenant", "project", "domain", "run", "action")
        for name, part in zip(names, parts, strict=True):
            if not _SEGMENT.match(part):
                raise SpecError(f"action id {text!r}: {name} {part!r} is invalid "
                                f"(letters, digits, '_', '.', '-'; not empty)")
        return cls(*parts)

    @property
    def run_key(self):
        """``tenant/project/domain/run``: the run this action belongs to."""
        return f"{self.tenant}/{self.project}/{self.domain}/{self.run}"

    def __str__(self):
        return f"{self.run_key}/{self.action}"


def _seconds(value, what, allow_none=True, allow_zero=False, cap=MAX_SECONDS):
    if value is None:
        if allow_none:
            return None
        raise SpecError(f"{what} is required")
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpecError(f"{what}: {value!r} is not a duration (seconds or timedelta)")
    if value < 0 or (value == 0 and not allow_zero):
        raise SpecError(f"{what}: {value!r} must be {'>= 0' if allow_zero else 'positive'}")
    if cap is not None and value > cap:
        # Durations become int64 nanoseconds added to the clock: longer would overflow.
        raise SpecError(f"{what}: {value!r} is too long (at most {MAX_SECONDS} s, 10 years)")
    return float(value)


# Replicas, concurrency and retries are bounded so that every product stays far from int64.
MAX_COUNT = 1_000_000


def _count(value, what, minimum):
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{what}: {value!r} is not an integer")
    if value < minimum or value > MAX_COUNT:
        raise SpecError(f"{what}: {value!r} must be >= {minimum} and <= {MAX_COUNT}")
    return value


def _total(resources, pods, counts, what):
    # Exact totals: a gang's demand must stay below UNLIMITED, never wrap. Quantities are
    # never negative, so when the largest times the replica count stays below UNLIMITED no
    # sum can reach it and int64 is exact (the usual case, one numpy pass).
    if counts.shape[0] == 1 and counts[0] == 1:
        return pods[0].copy()           # one pod: its vector (each entry below UNLIMITED)
    if int(pods.max()) * int(counts.sum()) < UNLIMITED:
        return (pods * counts[:, None]).sum(axis=0)
    total = [sum(int(pods[p, r]) * int(counts[p]) for p in range(len(counts)))
             for r in range(pods.shape[1])]
    for name, value in zip(resources.names, total, strict=True):
        if value >= UNLIMITED:
            raise SpecError(f"{what}: the total {name} ({value}) is too large")
    return np.array(total, dtype=np.int64)


@dataclass(frozen=True)
class PodGroup:
    """Pods of one role in a workload shape (Ray head/workers, Spark driver/executors...)."""

    role: str
    replicas: int
    resources: dict


@dataclass(frozen=True)
class ReusePolicy:
    """A reusable warm pool: ``replicas`` containers, each running ``concurrency`` actions."""

    replicas: int = 1
    concurrency: int = 1
    idle_ttl: float = 300.0  # seconds idle before the pool is freed


@dataclass(frozen=True)
class RetryPolicy:
    """Retries and their backoff ``min(base * factor**n, cap)`` seconds (a base or cap of 0
    retries at once: Flyte's retries without a ``Backoff``)."""

    count: int = 0
    backoff_base: float = 1.0
    backoff_factor: float = 2.0
    backoff_cap: float = 300.0


@dataclass(frozen=True)
class Timeouts:
    """The three bounds, in seconds (``None`` = unbounded)."""

    deadline: float | None = None
    max_queued_time: float | None = None
    max_runtime: float | None = None


@dataclass(frozen=True)
class ActionSpec:
    """Everything an action is enqueued with (its full infrastructure declaration).

    Exactly one of ``resources`` (one pod) or ``pods`` (a gang of pod groups) describes the
    workload. The queue resolves environment -> task -> run: the most specific given wins,
    else the engine's default queue.
    """

    id: str
    task: str
    parent: str | None = None
    environment: str | None = None
    image: str | None = None
    resources: dict | None = None
    pods: tuple | None = None
    reuse: ReusePolicy | None = None
    retries: RetryPolicy = field(default_factory=RetryPolicy)
    timeouts: Timeouts = field(default_factory=Timeouts)
    environment_queue: str | None = None
    task_queue: str | None = None
    run_queue: str | None = None
    run_max_action_concurrency: int = 0
    execute: Execution | None = None
    # How long one attempt is expected to run (seconds), when the client knows better than
    # the task's history: EASY backfill predicts from it (docs/predictions.md).
    runtime_estimate: float | None = None

    @classmethod
    def from_dict(cls, data):
        """Build a spec from plain data (JSON/msgpack); unknown keys are refused."""
        if not isinstance(data, dict):
            raise SpecError(f"action spec must be a table, not {type(data).__name__}")
        kw = table_of(cls, data, "action spec")
        if kw.get("pods") is not None:
            if not isinstance(kw["pods"], (list, tuple)):
                raise SpecError("pods must be a list of {role, replicas, resources}")
            kw["pods"] = tuple(_sub(PodGroup, p, "pods[]") for p in kw["pods"])
        for key, typ in (("reuse", ReusePolicy), ("retries", RetryPolicy),
                         ("timeouts", Timeouts)):
            if isinstance(kw.get(key), dict):
                kw[key] = _sub(typ, kw[key], key)
        if isinstance(kw.get("execute"), dict):
            kw["execute"] = Execution.from_dict(kw["execute"])
        return cls(**kw)


def _sub(cls, data, what):
    if isinstance(data, cls):
        return data
    return cls(**table_of(cls, data, what))


@dataclass
class CompiledAction:
    """A checked spec in the form the engine stores and the tick reads."""

    id: ActionId
    spec: ActionSpec
    queue: str
    demand: np.ndarray          # int64[R]: total (the pool footprint when reusable)
    pods: np.ndarray            # int64[P, R]: one row per pod group
    pod_counts: np.ndarray      # int64[P]: replicas per group
    parent: ActionId | None
    env_key: str | None         # stable identity of the warm pool, None if not reusable
    env_slots: int              # replicas x concurrency
    env_idle_ttl_ns: int


def compile_spec(spec, resources, queue_names, default_queue, strict=True):
    """Check ``spec`` against the shard's resources and queues and compile it.

    Raises ``SpecError`` with a message naming the action and what is wrong. ``strict=False``
    (a spec read back from the store) leaves out the checks added after specs were first
    stored (the 10-year bound of durations, names without a NUL byte), so a store written
    by an earlier version reloads as it was accepted.
    """
    if isinstance(spec, dict):
        spec = ActionSpec.from_dict(spec)
    if not isinstance(spec, ActionSpec):
        raise SpecError(f"expected an ActionSpec, got {type(spec).__name__}")
    aid = ActionId.parse(spec.id)
    try:
        return _compile(spec, aid, resources, queue_names, default_queue, strict)
    except SpecError as exc:
        raise SpecError(f"action {aid}: {exc}") from None


#: The fields of an action spec that are names (besides ``id`` and ``parent``): bounded by
#: ``transport.max_name`` on the wire; the first three name things outside the engine (a
#: process, a path, an image) and are checked here, the queues against the config.
SPEC_NAMES = ("task", "environment", "image", "environment_queue", "task_queue", "run_queue")


def _name(value, what, optional=True):
    """A name of a spec (task, environment, image, pod role): a string without a NUL byte
    (it names things in other systems: a process, a path, an image reference)."""
    if value is None and optional:
        return
    if not isinstance(value, str) or not value:
        raise SpecError(f"{what}: {value!r} is not a name (a non-empty string)")
    if "\0" in value:
        raise SpecError(f"{what}: {value!r} contains a NUL byte")


def _compile(spec, aid, resources, queue_names, default_queue, strict):
    if not isinstance(spec.task, str) or not spec.task:
        raise SpecError("task name is required (a non-empty string)")
    cap = MAX_SECONDS if strict else None
    if strict:
        for field_name in SPEC_NAMES[:3]:
            _name(getattr(spec, field_name), field_name)
    parent = None
    if spec.parent is not None:
        parent = ActionId.parse(spec.parent)
        if parent.run_key != aid.run_key:
            raise SpecError(f"parent {parent} is in another run")
        if parent == aid:
            raise SpecError("an action cannot be its own parent")

    queue = None
    for level in ("environment_queue", "task_queue", "run_queue"):
        name = getattr(spec, level)
        if name is not None:
            if not isinstance(name, str) or name not in queue_names:
                raise SpecError(f"{level} {name!r} does not exist "
                                f"(queues: {', '.join(sorted(queue_names))})")
            queue = queue or name
    queue = queue or default_queue

    if spec.pods is not None and spec.resources is not None:
        raise SpecError("give either resources (one pod) or pods (a gang), not both")
    if spec.pods is not None:
        if not spec.pods:
            raise SpecError("pods must list at least one pod group")
        roles = set()
        rows, counts = [], []
        for group in spec.pods:
            if not isinstance(group, PodGroup):
                raise SpecError(f"pods: {group!r} is not a PodGroup")
            if not isinstance(group.role, str) or not group.role:
                raise SpecError("pods: every group needs a role")
            if strict:
                _name(group.role, "pods: role")
            if group.role in roles:
                raise SpecError(f"pods: role {group.role!r} appears twice")
            roles.add(group.role)
            counts.append(_count(group.replicas, f"pods[{group.role}].replicas", 1))
            rows.append(_vector(resources, group.resources, f"pods[{group.role}].resources"))
        pods = np.stack(rows)
        pod_counts = np.array(counts, dtype=np.int64)
    else:
        pods = _vector(resources, spec.resources, "resources")[None, :]
        pod_counts = np.ones(1, dtype=np.int64)
    demand = _total(resources, pods, pod_counts, "pods" if spec.pods is not None else "resources")

    env_key, env_slots, idle_ns = None, 0, 0
    if spec.reuse is not None:
        reuse = spec.reuse
        if not isinstance(reuse, ReusePolicy):
            raise SpecError(f"reuse: {reuse!r} is not a ReusePolicy")
        if spec.pods is not None:
            raise SpecError("reuse applies to single-pod environments; a gang cannot be reused")
        if not spec.environment:
            raise SpecError("reuse needs an environment name (its pool is shared by name)")
        replicas = _count(reuse.replicas, "reuse.replicas", 1)
        concurrency = _count(reuse.concurrency, "reuse.concurrency", 1)
        idle = _seconds(reuse.idle_ttl, "reuse.idle_ttl", allow_none=False, cap=cap)
        env_slots = replicas * concurrency
        idle_ns = int(idle * 1e9)
        demand = _total(resources, pods[:1], np.array([replicas]), "reuse")
        ident = hashlib.blake2b(digest_size=12)
        for part in (aid.tenant, aid.project, aid.domain, queue, spec.environment,
                     spec.image or "", pods[0].tobytes(), replicas, concurrency, idle):
            ident.update(repr(part).encode())
            ident.update(b"\0")
        env_key = ident.hexdigest()

    retries = spec.retries
    if not isinstance(retries, RetryPolicy):
        raise SpecError(f"retries: {retries!r} is not a RetryPolicy")
    _count(retries.count, "retries.count", 0)
    _seconds(retries.backoff_base, "retries.backoff_base", allow_none=False, allow_zero=True,
             cap=cap)
    if isinstance(retries.backoff_factor, bool) or not isinstance(
            retries.backoff_factor, (int, float)) or not retries.backoff_factor >= 1:
        raise SpecError(f"retries.backoff_factor: {retries.backoff_factor!r} must be >= 1")
    _seconds(retries.backoff_cap, "retries.backoff_cap", allow_none=False, allow_zero=True,
             cap=cap)

    timeouts = spec.timeouts
    if not isinstance(timeouts, Timeouts):
        raise SpecError(f"timeouts: {timeouts!r} is not a Timeouts")
    bounds = {name: _seconds(getattr(timeouts, name), f"timeouts.{name}", cap=cap)
              for name in ("deadline", "max_queued_time", "max_runtime")}
    # Durations given as timedelta are stored as seconds, the unit the engine computes in.
    if any(isinstance(getattr(timeouts, n), timedelta) for n in bounds):
        spec = replace(spec, timeouts=Timeouts(**bounds))
    if isinstance(retries.backoff_base, timedelta) or isinstance(retries.backoff_cap,
                                                                 timedelta):
        spec = replace(spec, retries=replace(
            retries, backoff_base=_seconds(retries.backoff_base, "retries.backoff_base",
                                           allow_zero=True, cap=cap),
            backoff_cap=_seconds(retries.backoff_cap, "retries.backoff_cap", allow_zero=True,
                                 cap=cap)))
    if spec.reuse is not None and isinstance(spec.reuse.idle_ttl, timedelta):
        spec = replace(spec, reuse=replace(spec.reuse, idle_ttl=float(idle)))
    estimate = _seconds(spec.runtime_estimate, "runtime_estimate", cap=cap)
    if estimate is not None:
        if bounds["max_runtime"] is not None and estimate > bounds["max_runtime"]:
            raise SpecError(f"runtime_estimate {estimate:g}s exceeds timeouts.max_runtime "
                            f"{bounds['max_runtime']:g}s (the attempt is stopped there)")
        if isinstance(spec.runtime_estimate, timedelta):
            spec = replace(spec, runtime_estimate=estimate)

    if spec.execute is not None:
        check_execution(spec.execute, gang=int(pod_counts.sum()) > 1, strict=strict)

    mac = spec.run_max_action_concurrency
    if isinstance(mac, bool) or not isinstance(mac, int) or mac < 0 or mac == 1:
        raise SpecError(f"run_max_action_concurrency: {mac!r} must be 0 (unlimited) or >= 2")

    return CompiledAction(
        id=aid, spec=spec, queue=queue, demand=demand, pods=pods, pod_counts=pod_counts,
        parent=parent, env_key=env_key, env_slots=env_slots, env_idle_ttl_ns=idle_ns,
    )


def fit_problem(c, capacity, shapes):
    """Why compiled action ``c`` can never run on a cluster of total ``capacity`` (int64[R];
    None = unknown, unlimited) and node ``shapes`` ([S, R]; None = unknown, anything fits):
    ``("capacity", r)`` for the first resource its total exceeds, ``("shape", p)`` for the
    first pod group no shape holds, or None. Callers word the reason."""
    if capacity is not None:
        short = np.nonzero(c.demand > capacity)[0]
        if short.size:
            return "capacity", int(short[0])
    if shapes is not None:
        for p in range(c.pods.shape[0]):
            if not (c.pods[p] <= shapes).all(axis=1).any():
                return "shape", p
    return None


def _vector(resources, mapping, what):
    try:
        return resources.vector(mapping)
    except ValueError as exc:
        raise SpecError(f"{what}: {exc}") from None
