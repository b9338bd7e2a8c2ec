"""The plugin interface: how a cluster worker runs an attempt (``docs/worker.md``).

The worker (``transport.Worker``) owns leases, tokens, heartbeats, reports, timeouts and
refusals; a plugin only runs things. The worker calls a plugin from its one loop thread:

- ``start(attempt)`` begins an attempt (every pod of a gang at once, all or nothing) and
  returns quickly; a failure to start raises :class:`PluginError` (reported SYSTEM with the
  error's ``cause``) or, for a fault of the declaration, :class:`UserError` (reported USER).
  ``start_many(attempts)`` starts consecutive attempts of one spec (the worker's call for a
  LEASES message's fan-out) and returns those that failed with their errors; by default it
  calls ``start`` for each.
- ``poll()`` returns what changed since the last call, as :class:`Change` entries: RUNNING
  once every pod runs, then exactly one terminal :class:`Outcome`. An attempt that was
  stopped is never reported by ``poll()`` again.
- ``fds()`` are file descriptors that become readable when ``poll()`` has news (the worker
  sleeps on them with its sockets); ``due()`` the monotonic time by which ``poll()`` must be
  called at the latest even if nothing became readable (None: no such time).
- ``stop(key, reason)`` stops an attempt now (its processes are signalled at once and
  killed after a short grace), without blocking the loop.
- ``cleanup(attempt)`` runs the finalize lease of an attempt this worker ran (remove what the
  attempt left behind); it may block briefly.
- ``close(timeout)`` stops everything and frees pools.

A Kubernetes plugin would implement the same six calls: ``start`` creates the pods (one pod
group for a gang, scheduled all or nothing), ``poll`` maps pod phases and container statuses
to RUNNING and outcomes (``OOMKilled`` -> SYSTEM/OOM, eviction -> SYSTEM/EVICTED), ``fds``
is a watch stream's socket, ``stop`` deletes the pods, ``cleanup`` deletes what the attempt
created.
"""

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import NamedTuple

from cext import DEBUG
from engine._codes import Phase
from engine._config import WorkerSettings
from engine._errors import LeaseholdError
from engine._execution import Execution
from engine._model import ActionSpec

__all__ = ["Attempt", "Change", "LogLimit", "Outcome", "Plugin", "PluginError", "Pod",
           "UserError", "make_plugins"]


def frozen_instance(cls, values):
    """An instance of the frozen dataclass ``cls`` holding ``values`` (a dict naming every
    field), made without running ``__init__``: its ``object.__setattr__`` per field costs
    about 2 us an instance, paid per lease on the worker's hot path (a lease, its attempt,
    its changes). For values the caller built itself; the debug build checks the names."""
    if DEBUG:
        names = {f.name for f in fields(cls)}
        if set(values) != names:
            raise TypeError(f"{cls.__name__}: fields {sorted(values)}, expected "
                            f"{sorted(names)}")
    obj = object.__new__(cls)
    obj.__dict__.update(values)
    return obj


class PluginError(LeaseholdError):
    """An attempt could not be started or run for a reason of the system (reported FAILED,
    SYSTEM, with ``cause``)."""

    def __init__(self, message, cause="START_FAILED"):
        super().__init__(message)
        self.cause = cause


class UserError(LeaseholdError):
    """An attempt could not be started because of its own declaration (reported FAILED,
    USER, not recoverable): a command that does not exist, a function that cannot be
    imported."""


@dataclass(frozen=True)
class Pod:
    """One pod of an attempt: ``role`` and ``index`` within its group (a single-pod action is
    role ``main``, index 0), its request as declared, and its memory limit in bytes (None:
    none declared)."""

    role: str
    index: int
    resources: dict
    memory_limit: int | None = None

    @property
    def name(self):
        """``role/index``: how an outcome names the pod that failed."""
        return f"{self.role}/{self.index}"


class Attempt(NamedTuple):
    """One attempt a plugin runs. ``key`` (the lease token) identifies it in every call;
    ``workdir`` is the attempt's own scratch directory (a process runs in it; the worker
    removes it at cleanup), None for a plugin without finalize leases
    (``Plugin.finalizes``: ``sim``, ``python``); ``log_path`` the file its output goes to
    (kept after cleanup), None for a plugin without logs (``Plugin.logs``: ``sim``);
    ``env`` is the engine's identity of the warm pool (reusable actions only).

    Immutable (a named tuple: the worker makes one a lease, and a tuple is made in one C
    call where a frozen dataclass set each of its ten fields through ``object.__setattr__``,
    about 1 us a lease)."""

    key: bytes
    action: str
    attempt: int
    spec: ActionSpec
    execute: Execution
    pods: tuple
    workdir: Path | None
    log_path: Path | None
    input_ref: str | None = None
    env: str | None = None

    @property
    def gang(self):
        """Whether the attempt has several pods (all start together, one failure fails all)."""
        return len(self.pods) > 1


@dataclass(frozen=True)
class Outcome:
    """How an attempt ended: SUCCEEDED, or FAILED with ``error_kind`` USER or SYSTEM (a
    SYSTEM failure names its ``cause``: OOM, EVICTED, ...), ``message`` (for a process: the
    exit code and the tail of stderr), and ``pod``, the pod that failed in a gang."""

    phase: Phase
    error_kind: str | None = None
    cause: str | None = None
    message: str = ""
    recoverable: bool = True
    pod: str | None = None

    @classmethod
    def succeeded(cls):
        return cls(Phase.SUCCEEDED)

    @classmethod
    def user(cls, message, recoverable=True, pod=None):
        return cls(Phase.FAILED, "USER", None, message, recoverable, pod)

    @classmethod
    def system(cls, cause, message, pod=None):
        return cls(Phase.FAILED, "SYSTEM", cause, message, True, pod)


class Change(NamedTuple):
    """What ``poll()`` reports for one attempt: ``phase`` RUNNING, or the terminal
    ``outcome`` (``phase`` is then the outcome's). Immutable (a named tuple, as
    :class:`Attempt`: two a lease)."""

    key: bytes
    phase: Phase
    outcome: Outcome | None = None


class Plugin:
    """The base of every plugin (the calls are described in the module text). ``name`` is
    what ``execute.plugin`` names; ``options`` come from the worker's config."""

    name = ""
    #: Whether an attempt ends with a finalize lease (docs/worker.md): its ``cleanup`` is
    #: called and its scratch directory (``Attempt.workdir``, made only for such plugins)
    #: removed. False for a plugin that leaves nothing behind an attempt.
    finalizes = True
    #: Whether an attempt writes its output to a log file of its own (``Attempt.log_path``,
    #: whose directory the worker makes). False for a plugin that runs nothing that prints.
    logs = True

    def start(self, attempt):
        raise NotImplementedError

    def start_many(self, attempts):
        """Start each of ``attempts`` (consecutive leases of one spec: a fan-out's), in
        order; returns ``[(attempt, exception)]`` for those that could not start (what
        :meth:`start` raised for each), the rest started. A plugin that starts many at once
        more cheaply than one at a time overrides this; it must not raise for one
        attempt's failure."""
        failed = []
        for attempt in attempts:
            try:
                self.start(attempt)
            except Exception as exc:    # reported for this attempt alone
                failed.append((attempt, exc))
        return failed

    def poll(self):
        raise NotImplementedError

    def fds(self):
        return ()

    def due(self):
        return None

    def stop(self, key, reason):
        raise NotImplementedError

    def cleanup(self, attempt):
        """Default finalize: nothing beyond the worker's removal of the workdir."""

    def close(self, timeout=5.0):
        """Default: nothing to free."""


class LogLimit:
    """What a plugin whose attempts write logs bounds them to: options ``max_log_bytes`` (an
    attempt that wrote more than this to one log is stopped and fails USER; 0: no limit;
    default ``worker.max_log_bytes``'s) and ``log_interval`` (seconds between checks of the
    running attempts' log sizes, 1.0). A log is checked, not cut: a process writes to its
    file directly, so what it writes between two checks is kept."""

    __slots__ = ("max_bytes", "interval", "next")

    def __init__(self, opts, plugin):
        self.max_bytes = opts.pop("max_log_bytes", WorkerSettings.max_log_bytes)
        self.interval = float(opts.pop("log_interval", 1.0))
        if type(self.max_bytes) is not int or self.max_bytes < 0:
            raise PluginError(f"{plugin} plugin: max_log_bytes must be a byte count >= 0 (0: "
                              f"no limit), not {self.max_bytes!r}", cause="CONFIG")
        if not self.interval > 0:
            raise PluginError(f"{plugin} plugin: log_interval must be > 0 seconds, not "
                              f"{self.interval!r}", cause="CONFIG")
        self.next = 0.0

    def due(self, watching):
        """When the next check is due while ``watching`` (attempts with logs run), or None."""
        return self.next if watching and self.max_bytes else None

    def check_now(self, now, watching):
        """Whether a check is due at ``now`` (monotonic); if so, the next one is scheduled."""
        if not (watching and self.max_bytes) or now < self.next:
            return False
        self.next = now + self.interval
        return True

    def over(self, path):
        """The size of the log at ``path`` if it is over the limit, else None."""
        try:
            size = os.stat(path).st_size
        except OSError:
            return None     # not made yet, or removed: nothing to bound
        return size if size > self.max_bytes else None

    def message(self, where, path, size):
        return (f"{where}wrote {size} bytes to its log {path}, over the worker's limit of "
                f"{self.max_bytes} bytes (worker.max_log_bytes): stopped")


def make_plugins(options=None):
    """The worker's plugins by name: ``{"process": ProcessPlugin, "python": PythonPlugin,
    "sim": SimPlugin}``, each built with ``options[name]`` (a dict; absent: defaults). An
    unknown name in ``options`` raises :class:`PluginError` (cause CONFIG)."""
    # Imported here: the plugin modules import this one.
    from transport._pool import PythonPlugin
    from transport._process_plugin import ProcessPlugin
    from transport._sim_plugin import SimPlugin

    classes = {"process": ProcessPlugin, "python": PythonPlugin, "sim": SimPlugin}
    options = dict(options or {})
    unknown = sorted(set(options) - set(classes))
    if unknown:
        raise PluginError(f"plugin options for unknown plugin(s) {', '.join(unknown)} "
                          f"(plugins: {', '.join(classes)})", cause="CONFIG")
    plugins = {}
    try:
        for name, cls in classes.items():
            plugins[name] = cls(options.get(name))
    except BaseException:
        for plugin in plugins.values():
            plugin.close(0)
        raise
    return plugins


def make_attempt(key, action, attempt, spec, execute, pods, workdir, log_path, input_ref,
                 env):
    """An :class:`Attempt` of its ten fields given positionally (the worker's hot path: no
    keyword parsing, no defaults)."""
    return _new_tuple(Attempt, (key, action, attempt, spec, execute, pods, workdir, log_path,
                                input_ref, env))


def make_change(key, phase, outcome):
    """A :class:`Change` of its three fields given positionally."""
    return _new_tuple(Change, (key, phase, outcome))


_new_tuple = tuple.__new__
