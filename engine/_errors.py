"""Errors raised by the public API. Each carries a stable status ``code``."""

__all__ = [
    "LeaseholdError",
    "ConfigError",
    "SpecError",
    "ResourceExhausted",
    "NotFound",
    "empty_file",
]


class LeaseholdError(Exception):
    """Base class of every error the engine raises on purpose."""

    code = "INTERNAL"


class ConfigError(LeaseholdError):
    """The configuration (file or live update) is invalid; nothing was applied."""

    code = "INVALID_CONFIG"


class SpecError(LeaseholdError):
    """An action spec or request argument is invalid; nothing was stored."""

    code = "INVALID_ARGUMENT"


class ResourceExhausted(LeaseholdError):
    """A queue is at its depth, or draining; nothing was stored."""

    code = "RESOURCE_EXHAUSTED"


class NotFound(LeaseholdError):
    """The named action, queue or worker does not exist."""

    code = "NOT_FOUND"


def empty_file(path):
    """What every command that reads a file of actions (specs, Flyte requests, a trace) says
    of an empty one."""
    return f"{path} is empty: no actions"
