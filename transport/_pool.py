"""The ``python`` plugin: ``execute.function`` called in a pool process (``docs/plugins.md``).

A reusable action (``attempt.env`` set and the spec has ``reuse``) runs in the warm pool of
its environment identity: ``reuse.replicas`` processes started when the pool's first action
arrives, each running up to ``reuse.concurrency`` calls at once (a thread per call), kept
until ``reuse.idle_ttl`` seconds pass with no call running or waiting. Any other action runs
in a pool of one process of its own, freed after the call.

The processes run ``transport/_pool_child.py`` (its text describes the frames). The plugin's
side of every pipe is non-blocking; the result pipes and the processes' pidfds sit in one
epoll, the plugin's only descriptor in ``fds()``. A call's "started" comes on a third pipe,
the progress pipe, which nobody sleeps on: the plugin reads it with the result pipe, and
``PROGRESS`` seconds after a call was sent (then less and less often) while the call has
neither started nor ended, so a short call wakes the worker once (its outcome, with its
RUNNING), not twice.
"""

import collections
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import msgpack

from engine._codes import Phase
from transport._plugins import Change, LogLimit, Outcome, Plugin, PluginError, UserError
from transport._process_plugin import _Reaper, log_tail, mib, signal_name, tree_rss

__all__ = ["PoolInfo", "PythonPlugin"]

CHILD = str(Path(__file__).with_name("_pool_child.py"))
#: A pool whose processes exit this many times in a row before saying hello is failing to
#: start at all: its waiting calls fail (SYSTEM, START_FAILED) and it is freed.
START_FAILURES = 3
#: A result frame larger than this is not one the pool process sent.
MAX_FRAME = 64 * 2**20
#: Seconds after a call is sent before its progress pipe is first read for its "started"
#: (its outcome brings that earlier); later reads come at a quarter of the time it has
#: waited since, at most ``PROGRESS_MAX`` apart.
PROGRESS = 0.005
PROGRESS_MAX = 0.25
_READ = 65536                   # bytes a read of a pipe asks for


class PoolInfo(NamedTuple):
    """One pool as :meth:`PythonPlugin.pools` shows it: ``env`` (the engine's identity of a
    warm pool; None for an action's pool of one), the ``pids`` of its processes, and
    ``busy``, the calls running in them."""

    env: str | None
    pids: tuple
    busy: int


class _Call:
    __slots__ = ("key", "attempt", "id", "frame", "pool", "child", "started", "sent")

    def __init__(self, key, attempt, cid, frame):
        self.key = key
        self.attempt = attempt
        self.id = cid
        self.frame = frame
        self.pool = None
        self.child = None           # the process it was sent to (None: waiting for a slot)
        self.started = False
        self.sent = 0.0             # when it was sent to the process (monotonic)


class _Child:
    __slots__ = ("pool", "group", "pid", "wfd", "rfd", "pfd", "inbuf", "pbuf", "outbuf",
                 "calls", "hello", "oom")

    def __init__(self, pool):
        self.pool = pool
        self.group = None
        self.pid = None
        self.wfd = None
        self.rfd = None
        self.pfd = None             # the progress pipe (not in the epoll)
        self.inbuf = bytearray()
        self.pbuf = bytearray()
        self.outbuf = bytearray()
        self.calls = {}             # call id -> _Call, sent to this process
        self.hello = False
        self.oom = None             # the message, once the RSS watch killed it


class _Pool:
    __slots__ = ("env_id", "reusable", "replicas", "concurrency", "idle_ttl", "env",
                 "memory_limit", "output", "children", "pending", "idle_since",
                 "start_failures")

    def __init__(self, env_id, reusable, replicas, concurrency, idle_ttl, env, memory_limit,
                 output):
        self.env_id = env_id
        self.reusable = reusable
        self.replicas = replicas
        self.concurrency = concurrency
        self.idle_ttl = idle_ttl
        self.env = env
        self.memory_limit = memory_limit
        self.output = output        # a pool of one: its action's log; else None (inherit)
        self.children = []
        self.pending = collections.deque()
        self.idle_since = None
        self.start_failures = 0

    def busy(self):
        return sum(len(c.calls) for c in self.children)


def _child_env(execute_env):
    env = dict(os.environ)
    for name, value in (execute_env or {}).items():
        if name == "PYTHONPATH" and os.environ.get("PYTHONPATH"):
            # The worker's own path stays: the pool imports what the worker could.
            value = f"{value}{os.pathsep}{os.environ['PYTHONPATH']}"
        env[name] = value
    return env


class PythonPlugin(Plugin):
    """Calls ``execute.function(**execute.args)`` (plus ``inputs=`` the input reference) in a
    warm pool per environment identity, or a process of its own for a non-reusable action
    (the module text and ``docs/plugins.md`` say how). Options: ``kill_grace`` (seconds
    between SIGTERM and SIGKILL, 2.0), ``memory_interval`` (seconds between RSS checks,
    0.05), ``pidfd``, ``poll_interval``, ``max_log_bytes`` and ``log_interval`` (as for the
    process plugin: a call that wrote more than ``max_log_bytes`` to its log fails USER, and
    its process goes, as for :meth:`stop`)."""

    name = "python"
    # Calls run in the pool process's own directory (threads share one) and leave only
    # their log: nothing for a finalize lease to clean.
    finalizes = False

    def __init__(self, options=None):
        opts = dict(options or {})
        self.kill_grace = float(opts.pop("kill_grace", 2.0))
        self.memory_interval = float(opts.pop("memory_interval", 0.05))
        use_pidfd = opts.pop("pidfd", True)
        self.poll_interval = float(opts.pop("poll_interval", 0.02))
        self._logs = LogLimit(opts, "python")
        if opts:
            raise PluginError(f"python plugin: unknown option(s) {', '.join(sorted(opts))} "
                              f"(known: kill_grace, log_interval, max_log_bytes, "
                              f"memory_interval, pidfd, poll_interval)", cause="CONFIG")
        self._reaper = _Reaper(use_pidfd, self.poll_interval)
        self._pools = {}            # env identity -> _Pool (warm pools)
        self._once = set()          # pools of one
        self._calls = {}            # key -> _Call, the attempts poll() still reports
        self._changes = []          # found outside poll() (stop), returned by the next one
        self._unflushed = set()     # _Child with bytes its request pipe did not take yet
        self._unstarted = {}        # key -> _Call sent, neither started nor ended yet
        self._progress_at = None    # when to read the progress pipes of those calls
        self._ids = itertools.count(1)
        self._mem_next = 0.0
        self._closed = False

    # -- the interface

    def start(self, attempt):
        if self._closed:
            raise PluginError("python plugin is closed")
        key = attempt.key
        if key in self._calls:
            raise PluginError(f"attempt {key.hex()} is already running")
        if attempt.gang:
            raise UserError("the python plugin runs single-pod actions")
        ex = attempt.execute
        if not ex.function:
            raise UserError("execute.function is empty")
        cid = next(self._ids)
        try:
            body = msgpack.packb({
                "op": "call", "id": cid, "function": ex.function, "args": ex.args or {},
                "input": attempt.input_ref, "log": str(attempt.log_path),
                "action": str(attempt.action), "attempt": attempt.attempt})
        except (TypeError, ValueError, OverflowError) as exc:
            raise UserError(f"execute.args cannot be passed to the function: {exc}") from exc
        call = _Call(key, attempt, cid, len(body).to_bytes(4, "big") + body)
        reuse = attempt.spec.reuse
        if attempt.env is not None and reuse is not None:
            pool = self._pools.get(attempt.env)
            if pool is None:
                pool = _Pool(attempt.env, True, reuse.replicas, reuse.concurrency,
                             float(reuse.idle_ttl), _child_env(ex.env),
                             attempt.pods[0].memory_limit, None)
                self._new_pool(pool)
                self._pools[attempt.env] = pool
        else:
            pool = _Pool(None, False, 1, 1, 0.0, _child_env(ex.env),
                         attempt.pods[0].memory_limit, attempt.log_path)
            self._new_pool(pool)
            self._once.add(pool)
        self._calls[key] = call
        call.pool = pool
        pool.pending.append(call)
        pool.idle_since = None
        self._dispatch(pool)

    def poll(self):
        if self._closed:
            return []
        changes, self._changes = self._changes, []
        now = time.monotonic()
        for child in list(self._unflushed):
            self._flush(child)
        self._reaper.tick(now)
        exited, readable = self._reaper.ready()
        for child in readable:
            self._read(child, changes)
        for group in exited:
            self._died(group.owner, group.returncode, changes)
        if self._progress_at is not None and now >= self._progress_at:
            self._check_progress(now, changes)
        if now >= self._mem_next and self._limited():
            self._mem_next = now + self.memory_interval
            self._check_memory(changes)
        if self._logs.check_now(now, self._calls):
            self._check_logs(changes)
        for pool in list(self._pools.values()):
            if pool.idle_since is not None and now >= pool.idle_since + pool.idle_ttl:
                self._free(pool)
        return changes

    def fds(self):
        return () if self._closed else self._reaper.fds()

    def due(self):
        if self._closed:
            return None
        if self._changes:
            return 0.0
        when = self._reaper.due()
        later = []
        if self._progress_at is not None:
            later.append(self._progress_at)
        if self._unflushed:
            later.append(time.monotonic() + self.poll_interval)
        if self._limited():
            later.append(self._mem_next)
        logs = self._logs.due(self._calls)
        if logs is not None:
            later.append(logs)
        later.extend(p.idle_since + p.idle_ttl for p in self._pools.values()
                     if p.idle_since is not None)
        if later:
            soonest = min(later)
            when = soonest if when is None else min(when, soonest)
        return when

    def stop(self, key, reason=None):
        call = self._calls.pop(key, None)
        if call is None:
            return
        self._started(key)
        self._end_call(call, self._changes)

    def _end_call(self, call, changes):
        """End ``call`` (taken out of ``_calls``): a call cannot be interrupted inside its
        thread, so its process goes, and with it the other calls it runs (EVICTED)."""
        child = call.child
        if child is None:
            call.pool.pending.remove(call)
            self._settle(call.pool)
            return
        child.calls.pop(call.id, None)
        evicted = Outcome.system(
            "EVICTED", f"pool process pid {child.pid} was stopped because another call in it "
                       f"(action {call.attempt.action}) was stopped")
        self._retire(child, self.kill_grace, evicted, changes)

    def _check_logs(self, changes):
        for call in list(self._calls.values()):
            if call.child is None or self._calls.get(call.key) is not call:
                continue        # not sent yet (nothing written), or ended by an eviction
            size = self._logs.over(call.attempt.log_path)
            if size is None:
                continue
            del self._calls[call.key]
            self._started(call.key)
            outcome = Outcome.user(self._logs.message("", call.attempt.log_path, size))
            changes.append(Change(call.key, outcome.phase, outcome))
            self._end_call(call, changes)

    def close(self, timeout=5.0):
        self._closed = True
        for pool in itertools.chain(list(self._pools.values()), list(self._once)):
            for child in list(pool.children):
                self._close_pipes(child)
            pool.children.clear()
            pool.pending.clear()
        self._pools.clear()
        self._once.clear()
        self._calls.clear()
        self._changes.clear()
        self._unflushed.clear()
        self._unstarted.clear()
        self._progress_at = None
        self._reaper.close(timeout)

    def pools(self):
        """Every pool now: a list of :class:`PoolInfo` ``(env, pids, busy)``."""
        return [PoolInfo(p.env_id, tuple(c.pid for c in p.children), p.busy())
                for p in itertools.chain(self._pools.values(), self._once)]

    # -- processes

    def _fill(self, pool):
        """Start processes until the pool has its replicas (PluginError when one cannot
        start)."""
        while len(pool.children) < pool.replicas:
            pool.children.append(self._spawn(pool))

    def _new_pool(self, pool):
        try:
            self._fill(pool)
        except PluginError:
            for child in pool.children:
                self._close_pipes(child)
                self._reaper.stop(child.group, 0)
            raise

    def _spawn(self, pool):
        child = _Child(pool)
        req_r, req_w = os.pipe()
        res_r, res_w = os.pipe()
        pro_r, pro_w = os.pipe()
        out = None
        try:
            if pool.output is not None:
                out = open(pool.output, "ab")
            child.group = self._reaper.spawn(
                [sys.executable, CHILD, str(req_r), str(res_w), str(pro_w),
                 str(pool.concurrency)], child,
                pass_fds=(req_r, res_w, pro_w), stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT if out is not None else None, env=pool.env)
        except (OSError, PluginError) as exc:
            os.close(req_w)
            os.close(res_r)
            os.close(pro_r)
            raise PluginError(f"cannot start a python pool process ({sys.executable}): "
                              f"{exc}") from exc
        finally:
            os.close(req_r)
            os.close(res_w)
            os.close(pro_w)
            if out is not None:
                out.close()
        child.pid = child.group.pid
        child.wfd, child.rfd, child.pfd = req_w, res_r, pro_r
        os.set_blocking(req_w, False)
        os.set_blocking(res_r, False)
        os.set_blocking(pro_r, False)
        self._reaper.add_pipe(res_r, child)
        return child

    def _dispatch(self, pool):
        while pool.pending:
            free = [c for c in pool.children if len(c.calls) < pool.concurrency]
            if not free:
                return
            child = min(free, key=lambda c: len(c.calls))
            call = pool.pending.popleft()
            call.child = child
            child.calls[call.id] = call
            child.outbuf += call.frame
            self._flush(child)
            call.sent = now = time.monotonic()
            self._unstarted[call.key] = call
            if self._progress_at is None or self._progress_at > now + PROGRESS:
                self._progress_at = now + PROGRESS

    def _flush(self, child):
        if child.wfd is None:
            self._unflushed.discard(child)
            return
        while child.outbuf:
            try:
                n = os.write(child.wfd, child.outbuf)
            except BlockingIOError:
                break
            except BrokenPipeError:
                child.outbuf.clear()    # it died: its pidfd reports it
                break
            del child.outbuf[:n]
        if child.outbuf:
            self._unflushed.add(child)
        else:
            self._unflushed.discard(child)

    def _read(self, child, changes):
        """Take what ``child`` wrote: its progress (read first: a "started" precedes the
        same call's outcome), then its results."""
        if child.pfd is not None:
            self._read_progress(child, changes)
        if child.rfd is None:
            return
        while True:
            try:
                data = os.read(child.rfd, _READ)
            except BlockingIOError:
                break
            if not data:
                self._reaper.remove_pipe(child.rfd)
                os.close(child.rfd)
                child.rfd = None
                break
            child.inbuf += data
            if len(data) < _READ:
                break           # the pipe is empty now: no read to be told so
        self._frames(child, child.inbuf, "result", changes)

    def _read_progress(self, child, changes):
        while child.pfd is not None:
            try:
                data = os.read(child.pfd, _READ)
            except BlockingIOError:
                break
            if not data:
                os.close(child.pfd)
                child.pfd = None
                break
            child.pbuf += data
            if len(data) < _READ:
                break
        self._frames(child, child.pbuf, "progress", changes)

    def _frames(self, child, buf, pipe, changes):
        while len(buf) >= 4 and child.group.owner is not None:
            n = int.from_bytes(buf[:4], "big")
            if n > MAX_FRAME:
                self._broken(child, f"a frame of {n} bytes", pipe, changes)
                return
            if len(buf) < 4 + n:
                break
            try:
                msg = msgpack.unpackb(bytes(buf[4:4 + n]))
                if not isinstance(msg, dict):
                    raise ValueError(f"{type(msg).__name__}, not a map")
            except ValueError as exc:     # msgpack's errors are ValueErrors
                self._broken(child, f"an undecodable frame ({exc})", pipe, changes)
                return
            del buf[:4 + n]
            self._message(child, msg, changes)

    def _started(self, key):
        """Forget ``key`` among the calls whose progress is awaited (it started, ended or
        was stopped); with none left, no progress read is due."""
        if self._unstarted.pop(key, None) is not None and not self._unstarted:
            self._progress_at = None

    def _check_progress(self, now, changes):
        """Read the progress pipes of the processes running calls not known to have
        started; the next read is due sooner for calls sent lately."""
        for child in {call.child for call in self._unstarted.values()}:
            if child.pfd is not None:
                self._read_progress(child, changes)
        if not self._unstarted:
            self._progress_at = None
            return
        waited = now - min(call.sent for call in self._unstarted.values())
        self._progress_at = now + min(PROGRESS_MAX, max(PROGRESS, waited / 4))

    def _broken(self, child, what, pipe, changes):
        # Only this file's protocol runs on the pipe, so a bad frame means something in the
        # process wrote to the pipe's descriptor: nothing it says can be trusted any more.
        if child in child.pool.children:
            child.pool.children.remove(child)
        self._retire(child, 0, Outcome.system(
            "KILLED", f"pool process pid {child.pid} sent {what} on its {pipe} pipe; "
                      f"killed"), changes)

    def _message(self, child, msg, changes):
        op = msg.get("op")
        if op == "hello":
            child.hello = True
            child.pool.start_failures = 0
            return
        call = child.calls.get(msg.get("id"))
        if call is None:
            return
        if op == "started":
            if not call.started and self._calls.get(call.key) is call:
                call.started = True
                self._started(call.key)
                changes.append(Change(call.key, Phase.RUNNING))
        elif op == "done":
            del child.calls[call.id]
            if self._calls.get(call.key) is call:
                del self._calls[call.key]
                self._started(call.key)
                if msg.get("started") and not call.started:
                    call.started = True
                    changes.append(Change(call.key, Phase.RUNNING))
                outcome = self._outcome(call, msg)
                changes.append(Change(call.key, outcome.phase, outcome))
            pool = child.pool
            self._dispatch(pool)
            self._settle(pool)

    @staticmethod
    def _outcome(call, msg):
        if msg.get("ok"):
            return Outcome.succeeded()
        fn = call.attempt.execute.function
        kind, typ, text = msg.get("kind"), msg.get("type"), msg.get("message")
        if kind == "import":
            return Outcome.user(f"cannot import {fn}: {typ}: {text}", recoverable=False)
        if kind == "log":
            return Outcome.system("START_FAILED", f"cannot open the log "
                                                  f"{call.attempt.log_path}: {text}")
        return Outcome.user(f"{fn} raised {typ}: {text}\ntraceback (last lines):\n"
                            f"{msg.get('tail', '')}")

    def _died(self, child, returncode, changes):
        """A pool process exited on its own (or was killed by something not this plugin)."""
        pool = child.pool
        if child in pool.children:
            pool.children.remove(child)     # before reading: a freed slot must not be its
        self._read(child, changes)   # what it reported before it died still counts
        how = (f"killed by {signal_name(-returncode)}" if returncode < 0
               else f"exited with status {returncode}")
        if child.hello:
            message = f"pool process pid {child.pid} {how} while running the call"
        else:
            pool.start_failures += 1
            where = (f"; tail of its output:\n{log_tail(pool.output)}" if pool.output
                     else " (its output goes to the worker's stderr)")
            message = f"pool process pid {child.pid} {how} before it was ready{where}"
        outcome = Outcome.system("KILLED", message)
        self._retire(child, 0, outcome, changes)

    def _retire(self, child, grace, outcome, changes):
        """Take ``child`` out of its pool and end it; report ``outcome`` for the calls it was
        running; the pool gets a replacement (a warm pool) or is freed (a pool of one)."""
        pool = child.pool
        if child in pool.children:
            pool.children.remove(child)
        self._close_pipes(child)
        self._reaper.stop(child.group, grace)
        for call in child.calls.values():
            self._started(call.key)
            if self._calls.get(call.key) is call:
                del self._calls[call.key]
                changes.append(Change(call.key, outcome.phase, outcome))
        child.calls.clear()
        self._replace(pool, changes)

    def _replace(self, pool, changes):
        live = self._pools.get(pool.env_id) is pool or (pool in self._once and pool.pending)
        if not live:
            self._settle(pool)
            return
        error = None
        if pool.start_failures >= START_FAILURES:
            error = (f"its processes exited {pool.start_failures} times in a row before "
                     f"they were ready")
        else:
            try:
                self._fill(pool)
            except PluginError as exc:
                error = str(exc)
        if error is not None:
            failed = Outcome.system("START_FAILED", f"python pool: {error}")
            for call in pool.pending:
                if self._calls.pop(call.key, None) is call:
                    changes.append(Change(call.key, failed.phase, failed))
            pool.pending.clear()
            self._free(pool)
            return
        self._dispatch(pool)
        self._settle(pool)

    def _settle(self, pool):
        """After a call left ``pool``: a pool of one with nothing left is freed; a warm pool
        with nothing running or waiting starts its idle time."""
        if pool.pending or pool.busy():
            return
        if not pool.reusable:
            self._free(pool)
        elif pool.idle_since is None:
            pool.idle_since = time.monotonic()

    def _free(self, pool):
        if self._pools.get(pool.env_id) is pool:
            del self._pools[pool.env_id]
        self._once.discard(pool)
        for child in pool.children:
            # End of file on its request pipe makes it exit; the signals are in case not.
            self._close_pipes(child)
            self._reaper.stop(child.group, self.kill_grace, term=False)
        pool.children = []

    def _close_pipes(self, child):
        self._unflushed.discard(child)
        if child.wfd is not None:
            os.close(child.wfd)
            child.wfd = None
        if child.rfd is not None:
            self._reaper.remove_pipe(child.rfd)
            os.close(child.rfd)
            child.rfd = None
        if child.pfd is not None:
            os.close(child.pfd)
            child.pfd = None

    # -- memory

    def _limited(self):
        return any(p.memory_limit is not None and p.children
                   for p in itertools.chain(self._pools.values(), self._once))

    def _check_memory(self, changes):
        children = [c for p in itertools.chain(self._pools.values(), self._once)
                    if p.memory_limit is not None for c in p.children]
        rss = tree_rss([c.pid for c in children])
        for child in children:
            seen = rss.get(child.pid, 0)
            limit = child.pool.memory_limit
            if seen <= limit:
                continue
            child.oom = (f"pool process pid {child.pid} exceeded the memory limit "
                         f"{mib(limit)}: resident set {mib(seen)} seen (RSS watch); killed "
                         f"with the {len(child.calls)} call(s) it ran")
            self._retire(child, 0, Outcome.system("OOM", child.oom), changes)
