"""Leasehold: a resource-aware, lease-based scheduling engine (in-process core).

The names below are imported when first used (PEP 562), not with the package: ``leasehold``
(``engine/cli.py``) imports the package before anything of its own runs, and numpy and the
engine take about half a second to load, during which a Ctrl-C could only be a traceback.
"""

import importlib

TYPE_CHECKING = False   # not typing's: importing typing alone takes milliseconds
if TYPE_CHECKING:       # for linters and type checkers: the same names, imported at once
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

# Each public name and the module that defines it.
_WHERE = {
    "ManualClock": "engine._clock",
    "SystemClock": "engine._clock",
    "Phase": "engine._codes",
    "Verdict": "engine._codes",
    "WaitCode": "engine._codes",
    "Config": "engine._config",
    "QueueConfig": "engine._config",
    "TenantConfig": "engine._config",
    "load_config": "engine._config",
    "parse_config": "engine._config",
    "DispatchBatch": "engine._dispatch",
    "AlreadyExists": "engine._engine",
    "Assignment": "engine._engine",
    "Engine": "engine._engine",
    "Explanation": "engine._engine",
    "Group": "engine._engine",
    "Refusal": "engine._engine",
    "ConfigError": "engine._errors",
    "LeaseholdError": "engine._errors",
    "NotFound": "engine._errors",
    "ResourceExhausted": "engine._errors",
    "SpecError": "engine._errors",
    "Execution": "engine._execution",
    "ActionIds": "engine._groups",
    "ActionRecord": "engine._inspect",
    "DispatchEntry": "engine._inspect",
    "Inspection": "engine._inspect",
    "PendingTimer": "engine._inspect",
    "ActionId": "engine._model",
    "ActionSpec": "engine._model",
    "PodGroup": "engine._model",
    "RetryPolicy": "engine._model",
    "ReusePolicy": "engine._model",
    "Timeouts": "engine._model",
}


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


def __getattr__(name):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value     # once: later lookups do not come here
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
