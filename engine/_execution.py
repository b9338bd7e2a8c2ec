"""What a cluster worker runs for an action: the ``execute`` part of a spec.

The engine does not run anything; it checks the declaration at enqueue (so a worker never
receives a lease it cannot even start) and carries it to the worker in the lease. The worker
picks the plugin by name (``docs/worker.md``):

- ``process``: ``command`` (argv) as a subprocess, ``env`` added to its environment;
- ``python``: ``function`` (``"package.module:function"``) called with ``args`` and the
  action's input reference, in a warm pool when the action is reusable;
- ``sim``: holds the lease for ``duration`` seconds (or a uniform sample of
  ``[low, high]``), then succeeds, or fails as ``fail`` says (``"USER"`` or
  ``"SYSTEM:<cause>"``) on its first ``fail_attempts`` attempts (None: every attempt).
"""

import math
import re
from dataclasses import dataclass, fields

from engine._errors import SpecError
from engine._tables import table_of
from engine._units import MAX_SECONDS

__all__ = ["Execution", "PLUGINS", "check_execution"]

#: The plugins a spec may name, and the keys each takes besides ``plugin``.
PLUGINS = {
    "process": ("command", "env"),
    "python": ("function", "args", "env"),
    "sim": ("duration", "fail", "fail_attempts"),
}

_FUNCTION = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:"
                       r"[A-Za-z_][A-Za-z0-9_]*\Z")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_CAUSE = re.compile(r"^[A-Z][A-Z_]{0,39}\Z")


@dataclass(frozen=True)
class Execution:
    """How a worker runs the action: the plugin and its arguments (see the module text)."""

    plugin: str
    command: tuple | None = None
    env: dict | None = None
    function: str | None = None
    args: dict | None = None
    duration: float | tuple = 0.0
    fail: str | None = None
    fail_attempts: int | None = None

    @classmethod
    def from_dict(cls, data):
        """An :class:`Execution` from plain data; unknown keys are refused."""
        if isinstance(data, cls):
            return data
        kw = table_of(cls, data, "execute", check_required=False)   # (plugin: said below)
        if isinstance(kw.get("command"), list):
            kw["command"] = tuple(kw["command"])
        if isinstance(kw.get("duration"), list):
            kw["duration"] = tuple(kw["duration"])
        if "plugin" not in kw:
            raise SpecError(f"execute needs a plugin ({', '.join(PLUGINS)})")
        return cls(**kw)

    def sim_failure(self):
        """``(error_kind, cause)`` of a sim failure (cause None for USER), or None."""
        if self.fail is None:
            return None
        kind, _, cause = self.fail.partition(":")
        return kind, cause or None


def check_execution(ex, gang, strict=True):
    """Check an :class:`Execution` (``gang``: the action has several pods); raises
    ``SpecError`` naming the key that is wrong. ``strict=False``: a stored one (see
    ``compile_spec``), without the checks added since (NUL bytes, the 10-year bound)."""
    if not isinstance(ex, Execution):
        raise SpecError(f"execute: {ex!r} is not an Execution")
    if not isinstance(ex.plugin, str) or ex.plugin not in PLUGINS:
        raise SpecError(f"execute.plugin {ex.plugin!r} is not one of {', '.join(PLUGINS)}")
    used = PLUGINS[ex.plugin]
    for f in fields(Execution):
        if f.name == "plugin" or f.name in used:
            continue
        if getattr(ex, f.name) != f.default:
            raise SpecError(f"execute.{f.name} does not apply to the {ex.plugin} plugin "
                            f"(it takes {', '.join(used)})")
    if ex.env is not None:
        if not isinstance(ex.env, dict):
            raise SpecError("execute.env must be a table of NAME = \"value\"")
        for k, v in ex.env.items():
            if not isinstance(k, str) or not _ENV_NAME.match(k):
                raise SpecError(f"execute.env: {k!r} is not an environment variable name")
            if not isinstance(v, str):
                raise SpecError(f"execute.env.{k} must be a string, not {v!r}")
            if strict and "\0" in v:
                raise SpecError(f"execute.env.{k} contains a NUL byte (no process can take it)")
    if ex.plugin == "process":
        cmd = ex.command
        if (not isinstance(cmd, tuple) or not cmd
                or not all(isinstance(a, str) for a in cmd) or not cmd[0]):
            raise SpecError("execute.command must be a non-empty list of strings (argv) "
                            "for the process plugin")
        for i, arg in enumerate(cmd if strict else ()):
            if "\0" in arg:
                raise SpecError(f"execute.command[{i}] contains a NUL byte (no process can "
                                f"take it)")
    elif ex.plugin == "python":
        if gang:
            raise SpecError("the python plugin runs single-pod actions; run a gang's pods "
                            "with the process plugin")
        if not isinstance(ex.function, str) or not _FUNCTION.match(ex.function):
            raise SpecError(f"execute.function {ex.function!r} must be "
                            f"\"package.module:function\"")
        if ex.args is not None and not isinstance(ex.args, dict):
            raise SpecError("execute.args must be a table (keyword arguments)")
    else:
        d = ex.duration
        pair = d if isinstance(d, tuple) else (d, d)
        if (len(pair) != 2 or any(isinstance(x, bool) or not isinstance(x, (int, float))
                                  or not math.isfinite(x) or x < 0
                                  or (strict and x > MAX_SECONDS) for x in pair)
                or pair[0] > pair[1]):
            raise SpecError(f"execute.duration {d!r} must be seconds >= 0, or [low, high] "
                            f"with 0 <= low <= high, at most {MAX_SECONDS} (10 years)")
        if ex.fail is not None:
            kind, _, cause = ex.fail.partition(":") if isinstance(ex.fail, str) else ("",) * 3
            if not ((kind == "USER" and not cause)
                    or (kind == "SYSTEM" and _CAUSE.match(cause))):
                raise SpecError(f"execute.fail {ex.fail!r} must be \"USER\" or "
                                f"\"SYSTEM:<CAUSE>\" (e.g. SYSTEM:OOM)")
        fa = ex.fail_attempts
        if fa is not None and (isinstance(fa, bool) or not isinstance(fa, int) or fa < 1):
            raise SpecError(f"execute.fail_attempts {fa!r} must be an integer >= 1 "
                            f"(or absent: every attempt)")
        if fa is not None and ex.fail is None:
            raise SpecError("execute.fail_attempts needs execute.fail")
