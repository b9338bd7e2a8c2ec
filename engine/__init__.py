"""Leasehold: a resource-aware, lease-based scheduling engine (in-process core)."""

from engine._clock import ManualClock, SystemClock
from engine._codes import Phase, Verdict, WaitCode
from engine._config import Config, QueueConfig, TenantConfig, load_config, parse_config
from engine._dispatch import DispatchBatch
from engine._engine import AlreadyExists, Assignment, Engine, Explanation, Group, Refusal
from engine._errors import ConfigError, LeaseholdError, NotFound, ResourceExhausted, SpecError
from engine._execution import Execution
from engine._groups import ActionIds
from engine._inspect import ActionRecord, DispatchEntry, Inspection, PendingTimer
from engine._model import ActionId, ActionSpec, PodGroup, RetryPolicy, ReusePolicy, Timeouts

__all__ = [
    "ActionId",
    "ActionIds",
    "ActionRecord",
    "DispatchBatch",
    "DispatchEntry",
    "Group",
    "Inspection",
    "PendingTimer",
    "Refusal",
    "ActionSpec",
    "AlreadyExists",
    "Assignment",
    "Config",
    "ConfigError",
    "Engine",
    "Execution",
    "Explanation",
    "LeaseholdError",
    "ManualClock",
    "NotFound",
    "Phase",
    "PodGroup",
    "QueueConfig",
    "ResourceExhausted",
    "RetryPolicy",
    "ReusePolicy",
    "SpecError",
    "SystemClock",
    "TenantConfig",
    "Timeouts",
    "Verdict",
    "WaitCode",
    "load_config",
    "parse_config",
]
