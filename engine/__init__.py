"""Leasehold: a resource-aware, lease-based scheduling engine (in-process core).

The names below are imported when first used (PEP 562), not with the package: ``leasehold``
(``engine/cli.py``) imports the package before anything of its own runs, and numpy and the
engine take about half a second to load, during which a Ctrl-C could only be a traceback.
"""

import importlib

# Each public name, by the module that defines it: the one list (``__all__`` is derived).
_PUBLIC = {
    "engine._clock": ("ManualClock", "SystemClock"),
    "engine._codes": ("Phase", "Verdict", "WaitCode"),
    "engine._config": ("Config", "QueueConfig", "TenantConfig", "load_config", "parse_config"),
    "engine._dispatch": ("DispatchBatch",),
    "engine._engine": ("AlreadyExists", "Assignment", "Engine", "Explanation", "Group",
                       "Refusal"),
    "engine._errors": ("ConfigError", "LeaseholdError", "NotFound", "ResourceExhausted",
                       "SpecError"),
    "engine._execution": ("Execution",),
    "engine._groups": ("ActionIds",),
    "engine._inspect": ("ActionRecord", "DispatchEntry", "Inspection", "PendingTimer"),
    "engine._model": ("ActionId", "ActionSpec", "PodGroup", "RetryPolicy", "ReusePolicy",
                      "Timeouts"),
    "engine._retain": ("is_content_key",),
}
_WHERE = {name: module for module, names in _PUBLIC.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value     # once: later lookups do not come here
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
