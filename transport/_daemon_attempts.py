"""The cluster worker's attempts (``docs/worker.md``): a LEASES message started as
attempts through their plugins (a gang's pods all at once), their bounds
(``max_runtime``, ``max_queued_time``), the plugins' changes (RUNNING, outcomes), a stop
after a refusal, and finalize leases (cleanup). A part of ``transport._daemon.Worker``."""

import hashlib
import heapq
import logging
import os
import shutil
import time
from pathlib import Path

import msgpack
import numpy as np

from engine._codes import PHASE_CODE, LeaseKind, Phase
from engine._errors import SpecError
from engine._execution import Execution
from engine._model import ActionSpec
from engine._units import BYTES, parse_quantity
from transport._daemon_reports import (
    _PHASE_INITIALIZING,
    _PHASE_RUNNING,
    _PHASE_SUCCEEDED,
    _SUCCEEDED,
    _Pending,
)
from transport._plugins import (
    Attempt,
    Outcome,
    PluginError,
    Pod,
    UserError,
    make_attempt,
)
from transport._worker import lease_rows

__all__ = []
log = logging.getLogger("leasehold.worker")

_FINALIZE = LeaseKind.FINALIZE
_SPEC_CACHE = 256           # parsed specs kept, by the content of their wire map
_OUTCOME_COUNTER = {Phase.SUCCEEDED: "succeeded", Phase.FAILED: "failed",
                    Phase.TIMED_OUT: "timed_out"}


class _Held:
    """One lease this worker holds: the fields of its lease (``transport.Lease``: ``number``
    is its attempt number, ``spec`` its spec map; the worker makes no Lease object, one a
    lease was ~1 us and two objects for the garbage collector to trace) and its attempt."""

    __slots__ = ("token", "action", "number", "spec", "input_ref", "env", "deadline_ns",
                 "queued_deadline_ns", "finalize", "shard", "attempt", "plugin", "phase",
                 "demand", "cleanup")

    def __init__(self, shard, action, token, kind, number, spec, input_ref, deadline_ns,
                 queued_deadline_ns, env):
        self.token = token
        self.action = action
        self.number = number
        self.spec = spec
        self.input_ref = input_ref
        self.env = env
        self.deadline_ns = deadline_ns
        self.queued_deadline_ns = queued_deadline_ns
        self.finalize = kind == _FINALIZE
        self.shard = shard
        self.attempt = None
        self.plugin = None
        self.phase = _PHASE_INITIALIZING
        self.demand = None
        self.cleanup = False


#: Action ids up to this long have no path segment that needs cutting (_path_segment).
_SHORT_SEGMENTS = 200
_SEGMENT_KEEP = 160


def _path_segment(segment):
    """``segment`` as a file name: itself up to _SHORT_SEGMENTS characters, else its first
    _SEGMENT_KEEP and a digest of the whole (room is left for ``.ATTEMPT.log``)."""
    if len(segment) <= _SHORT_SEGMENTS:
        return segment
    digest = hashlib.blake2b(segment.encode(), digest_size=8).hexdigest()
    return f"{segment[:_SEGMENT_KEEP]}~{digest}"


def _make_dir(path):
    """``Path(path).mkdir(parents=True, exist_ok=True)`` in one system call when the parent
    exists (a directory an attempt, made on the way to starting it)."""
    try:
        os.mkdir(path)
    except FileExistsError:
        if not os.path.isdir(path):
            raise
    except FileNotFoundError:
        os.makedirs(path, exist_ok=True)


def _memory(resources):
    v = (resources or {}).get("memory")
    return None if v is None else parse_quantity("memory", BYTES, v)


def _message(outcome):
    return outcome.message if outcome.pod is None or outcome.pod in outcome.message \
        else f"pod {outcome.pod}: {outcome.message}"


class AttemptsMixin:
    """The attempts a worker holds (a part of ``Worker``)."""

    def _on_leases(self, sh, msg, now):
        """Hold and start the leases of a LEASES message, in order. What starting one needs
        of its spec (parsed, its plugin, demand and pods) is worked out once a group, and
        consecutive leases of one spec map (a fan-out's) start with one ``start_many``."""
        held = self._held
        counts = self._counts
        index = sh.index
        made = {}                   # id(spec map) -> what _how returned
        group, group_spec = [], None    # consecutive leases of one spec map, not started yet
        for action, token, kind, number, spec, ref, d, q, env, _nodes in lease_rows(msg):
            if token in held:
                continue            # a duplicate push of a lease we run
            h = _Held(index, action, token, kind, number, spec, ref, d, q, env)
            held[token] = h
            if spec is not group_spec and group:
                self._start_group(group, made, now)
                group = []
            group_spec = spec
            if h.finalize:
                if group:
                    self._start_group(group, made, now)
                    group = []
                counts["finalize"] += 1
                self._finalize(h)
                continue
            counts["leases"] += 1
            if self._drain.is_set():
                self._end(h, Outcome.system("EVICTED", f"worker {self.name} is draining"),
                          now)
                continue
            group.append(h)
        if group:
            self._start_group(group, made, now)

    def _start_group(self, hs, made, now):
        """Start held leases ``hs`` (of one spec map): their attempts made alike, handed to
        the plugin in one ``start_many``; each that cannot start reports its own failure."""
        h0 = hs[0]
        how = made.get(id(h0.spec))
        if how is None:
            try:
                how = made[id(h0.spec)] = self._how(h0)
            except Exception:
                # Not kept: each lease's own start raises it again and reports its own.
                for h in hs:
                    self._start(h, made, now)
                return
        spec, ex, plugin, demand, pods = how
        attempts = []
        try:
            for h in hs:
                h.demand = demand
                h.attempt = self._attempt(h, spec, ex, plugin, pods)
                h.plugin, h.cleanup = plugin, plugin.finalizes
                attempts.append(h.attempt)
        except Exception:   # (a workdir that cannot be made): one at a time, each its own
            for h in hs:
                h.demand = h.attempt = h.plugin = None
            for h in hs:
                self._start(h, made, now)
            return
        held = self._held_shapes.get(id(demand))
        if held is None:
            self._held_shapes[id(demand)] = [demand, len(hs)]
        else:
            held[1] += len(hs)
        t = spec.timeouts
        if t.max_runtime is not None or any(
                h.queued_deadline_ns is not None or h.deadline_ns is not None for h in hs):
            for h in hs:
                self._arm(h, spec, now)
        try:
            failed = plugin.start_many(attempts)
        except Exception as exc:
            # A plugin's bug (start_many answers each attempt's own failure): none is taken
            # to have started; any it did start is stopped.
            for a in attempts:
                self._stop_quietly(plugin, a.key)
            failed = [(a, exc) for a in attempts]
        if failed:
            why = {a.key: exc for a, exc in failed}
            for h in hs:
                exc = why.get(h.token)
                if exc is not None:
                    self._end(h, self._start_failure(exc, h), now)
            hs = [h for h in hs if h.token not in why]
        self._counts["started"] += len(hs)
        if hs:
            rows = self._reports.get(h0.shard)
            if rows is None:
                rows = self._reports[h0.shard] = _Pending()
            rows.fresh.extend(hs)       # as _progress, for each
            if rows.since is None:
                rows.since = now

    def _how(self, h):
        """``(spec, execute, plugin, demand, pods)`` of a lease: raises UserError,
        PluginError or SpecError when it cannot start."""
        spec, entry = self._spec(h.spec)
        ex = spec.execute
        name = ex.plugin if ex is not None else self.settings.default_plugin
        if name is None:
            raise UserError(f"action {h.action} declares no execute and worker "
                            f"{self.name} has no worker.default_plugin")
        plugin = self.plugins.get(name)
        if plugin is None:
            raise PluginError(f"worker {self.name} has no {name} plugin "
                              f"(it has {', '.join(self.plugins)})", cause="NO_PLUGIN")
        if ex is None:
            ex = Execution(plugin=name)
        shape = entry[1]
        if shape is None:
            shape = entry[1] = self._make_shape(spec)
        demand, pods = shape
        return spec, ex, plugin, demand, pods

    def _start(self, h, made, now):
        try:
            how = made.get(id(h.spec))
            if how is None:         # a failure is not kept: each lease reports its own
                how = made[id(h.spec)] = self._how(h)
            spec, ex, plugin, demand, pods = how
            att = self._attempt(h, spec, ex, plugin, pods)
            h.attempt, h.plugin = att, plugin
            h.cleanup = plugin.finalizes
            # Set only where it is counted: an attempt that failed before (its directory
            # could not be made) has nothing to uncount when it ends.
            h.demand = demand
            held = self._held_shapes.get(id(demand))
            if held is None:
                self._held_shapes[id(demand)] = [demand, 1]
            else:
                held[1] += 1
            self._arm(h, spec, now)
            plugin.start(att)
        except Exception as exc:
            self._end(h, self._start_failure(exc, h), now)
            return
        self._counts["started"] += 1
        self._progress(h, now)

    def _start_failure(self, exc, h):
        """The outcome of lease ``h`` whose start raised ``exc``: USER for a fault of its
        declaration, SYSTEM (the error's cause) for one of the machine or the plugin; any
        other exception is a plugin's bug: logged, counted, and the worker goes on."""
        if isinstance(exc, UserError):
            return Outcome.user(str(exc), recoverable=False)
        if isinstance(exc, (PluginError, OSError)):
            return Outcome.system(getattr(exc, "cause", "START_FAILED"), str(exc))
        if isinstance(exc, SpecError):
            return Outcome.user(f"the lease's spec: {exc}", recoverable=False)
        log.error("worker %s: starting %s failed", self.name, h.action,
                  exc_info=(type(exc), exc, exc.__traceback__))
        self._counts["plugin_errors"] += 1
        return Outcome.system("PLUGIN_ERROR", f"{type(exc).__name__}: {exc}")

    def _stop_quietly(self, plugin, key):
        try:
            plugin.stop(key, "its start failed")
        except Exception:   # a plugin bug must not stop the worker
            log.exception("worker %s: stopping %s failed", self.name, key.hex())

    def _spec(self, wire):
        """``(ActionSpec, cache entry)`` of a lease's spec map (SpecError when it is not
        one). A spec seen before under another id is a copy of the one parsed then, with
        this map's id (a frozen dataclass copied without ``__init__``, ~1 us against ~15 us
        for ``ActionSpec.from_dict`` and ~8 us for its pods and demand)."""
        try:
            key = msgpack.packb([(k, v) for k, v in wire.items() if k != "id"])
        except (AttributeError, TypeError, ValueError, OverflowError):
            return ActionSpec.from_dict(wire), [None, None]     # its own error, if any
        entry = self._parsed.get(key)
        if entry is None:
            entry = [ActionSpec.from_dict(wire), None]
            if len(self._parsed) >= _SPEC_CACHE:
                del self._parsed[next(iter(self._parsed))]
            self._parsed[key] = entry
        spec = entry[0]
        wid = wire.get("id")
        if spec.id != wid:
            if type(wid) is not str:
                return ActionSpec.from_dict(wire), [None, None]
            spec = object.__new__(ActionSpec)
            spec.__dict__.update(entry[0].__dict__)
            spec.__dict__["id"] = wid
        return spec, entry

    def _attempt(self, h, spec, ex, plugin, pods):
        # Paths as _paths makes them; each made only when its plugin needs it (a workdir
        # only where a finalize lease will remove it), each directory with one mkdir.
        if not (plugin.finalizes or plugin.logs):
            return make_attempt(h.token, h.action, h.number, spec, ex, pods, None, None,
                                h.input_ref, h.env)
        workdir = log_path = None
        work, logs, log = self._path_strings(h.action, h.number)
        if plugin.finalizes:
            _make_dir(work)
            workdir = Path(work)
        if plugin.logs:
            # One directory a run, made by its first attempt (a directory an action cost
            # its attempt an ext4 mkdir, 0.3-0.8 ms while the shard's commits sync).
            _make_dir(logs)
            log_path = Path(log)
        return make_attempt(h.token, h.action, h.number, spec, ex, pods, workdir, log_path,
                            h.input_ref, h.env)

    def _path_strings(self, action, attempt):
        # (workdir, its run's log directory, log file) of an attempt. Action ids are
        # segments of [A-Za-z0-9_.-] starting alphanumeric: safe as paths. Strings (joining
        # Path objects cost more than the sim plugin's start).
        run, _, name = action.rpartition("/")
        if len(action) > _SHORT_SEGMENTS:
            # A segment may pass a file system's 255-byte name limit (ids allow 1,024
            # characters): a long one is cut and told apart by a digest of it.
            run = "/".join(map(_path_segment, run.split("/")))
            name = _path_segment(name)
            action = f"{run}/{name}"
        logs = f"{self._logs}/{run}"
        return f"{self._work}/{action}/{attempt}", logs, f"{logs}/{name}.{attempt}.log"

    def _paths(self, action, attempt):
        work, _, log = self._path_strings(action, attempt)
        return Path(work), Path(log)

    def _make_shape(self, spec):
        pods = []
        if spec.pods:
            for g in spec.pods:
                for i in range(g.replicas):
                    pods.append(Pod(g.role, i, dict(g.resources), _memory(g.resources)))
        else:
            res = dict(spec.resources or {})
            pods.append(Pod("main", 0, res, _memory(res)))
        return self._demand_of(spec), tuple(pods)

    def _demand_of(self, spec):
        if spec.pods:
            return sum((self.resources.vector(g.resources) * g.replicas for g in spec.pods),
                       np.zeros(len(self.resources), np.int64))
        return self.resources.vector(spec.resources or {})

    # ------------------------------------------------------------------ bounds

    def _arm(self, h, spec, now):
        t = spec.timeouts
        if t.max_runtime is not None:
            self._timer(now + float(t.max_runtime), h.token, "max_runtime")
        if h.queued_deadline_ns is None and h.deadline_ns is None:
            return
        wall = time.time_ns()
        if h.queued_deadline_ns is not None:
            self._timer(now + (h.queued_deadline_ns - wall) / 1e9, h.token, "max_queued_time")
        if h.deadline_ns is not None:
            self._timer(now + (h.deadline_ns - wall) / 1e9, h.token, "deadline")

    def _timer(self, due, token, bound):
        self._seq += 1
        heapq.heappush(self._timers, (due, self._seq, token, bound))

    def _fire_timers(self, now):
        while self._timers and self._timers[0][0] <= now:
            _due, _s, token, bound = heapq.heappop(self._timers)
            h = self._held.get(token)
            if h is None or h.finalize or h.attempt is None:
                continue
            if bound == "max_queued_time" and h.phase == Phase.RUNNING:
                continue        # it ran in time: the bound no longer applies
            spec = h.attempt.spec
            limit = {"max_runtime": spec.timeouts.max_runtime,
                     "max_queued_time": spec.timeouts.max_queued_time,
                     "deadline": spec.timeouts.deadline}[bound]
            self._stop_attempt(h, f"{bound} reached")
            self._end(h, Outcome(Phase.TIMED_OUT, None, bound,
                                 f"{bound} of {limit}s reached", True), now)

    # ------------------------------------------------------------------ plugin changes

    def _on_changes(self, changes, now):
        """Take a poll's ``changes``, in order: RUNNING is said with the next reports, an
        outcome reported (:meth:`_end`); a success of an attempt without cleanup (a
        fan-out's, the common case) is reported and let go here, without a call of its
        own. A change of an attempt no longer held (stopped, refused) is dropped."""
        held = self._held
        rows = None
        ok = 0
        for ch in changes:
            h = held.get(ch.key)
            if h is None:
                continue            # stopped or refused meanwhile
            out = ch.outcome
            if out is None:
                if ch.phase == _PHASE_RUNNING and h.phase != _PHASE_RUNNING:
                    h.phase = _PHASE_RUNNING
                    self._progress(h, now)
                continue
            if out.phase is not _PHASE_SUCCEEDED or h.cleanup:
                self._end(h, out, now)
                continue
            # _end, _report and _forget of a success, inline.
            if rows is None or rows[0] != h.shard:
                got = self._reports.get(h.shard)
                if got is None:
                    got = self._reports[h.shard] = _Pending()
                rows = (h.shard, got)
            pending = rows[1]
            codes, token = pending.codes, h.token
            if token in codes:
                del codes[token]    # the latest goes last
                pending.details.pop(token, None)
            codes[token] = _SUCCEEDED
            pending.urgent = True
            ok += 1
            del held[token]
            if h.demand is not None:
                shape = self._held_shapes[id(h.demand)]
                shape[1] -= 1
                if not shape[1]:
                    del self._held_shapes[id(h.demand)]
        if ok:
            self._counts["succeeded"] += ok

    def _end(self, h, outcome, now):
        """Report ``outcome`` for ``h`` and let it go (its cleanup comes as a finalize)."""
        detail = None
        if outcome.phase != _PHASE_SUCCEEDED:
            detail = {"error_kind": outcome.error_kind, "cause": outcome.cause,
                      "message": _message(outcome), "recoverable": outcome.recoverable}
        self._counts[_OUTCOME_COUNTER[outcome.phase]] += 1
        if h.cleanup:
            detail = dict(detail or {}, cleanup=True)
        self._report(h, PHASE_CODE[outcome.phase], detail)
        self._forget(h)

    def _forget(self, h):
        if self._held.pop(h.token, None) is not None and h.demand is not None:
            held = self._held_shapes[id(h.demand)]
            held[1] -= 1
            if not held[1]:
                del self._held_shapes[id(h.demand)]

    def _stop_attempt(self, h, reason):
        if h.plugin is not None and h.attempt is not None:
            try:
                h.plugin.stop(h.token, reason)
            except Exception:   # a plugin bug must not stop the worker
                log.exception("worker %s: stopping %s failed", self.name, h.action)
            self._count("stopped")

    # ------------------------------------------------------------------ finalize

    def _finalize(self, h):
        for other in list(self._held.values()):
            if (not other.finalize and other.action == h.action
                    and other.number == h.number):
                self._stop_attempt(other, "cleanup of an ended attempt")
                self._forget(other)
        workdir, _log = self._paths(h.action, h.number)
        try:
            spec, _entry = self._spec(h.spec)
            name = spec.execute.plugin if spec.execute is not None \
                else self.settings.default_plugin
            plugin = self.plugins.get(name) if name else None
            if plugin is not None and spec.execute is not None:
                plugin.cleanup(self._attempt_for_cleanup(h, spec))
            if workdir.exists():
                shutil.rmtree(workdir)
            self._count("cleanups")
            outcome = Outcome.succeeded()
        except (PluginError, OSError, SpecError) as exc:
            outcome = Outcome.system("CLEANUP_FAILED", f"cleanup of {h.action} attempt "
                                     f"{h.number}: {exc}")
        detail = None if outcome.phase == Phase.SUCCEEDED else {
            "error_kind": outcome.error_kind, "cause": outcome.cause,
            "message": outcome.message}
        self._report(h, PHASE_CODE[outcome.phase], detail)
        self._forget(h)

    def _attempt_for_cleanup(self, h, spec):
        workdir, log_path = self._paths(h.action, h.number)
        return Attempt(key=h.token, action=h.action, attempt=h.number,
                       spec=spec, execute=spec.execute, pods=(), workdir=workdir,
                       log_path=log_path, input_ref=h.input_ref, env=h.env)
