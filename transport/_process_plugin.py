"""The ``process`` plugin: ``execute.command`` as one subprocess per pod (``docs/plugins.md``).

Every pod is its own session and process group (``start_new_session``), so a stop signals
the pod's whole tree with one ``killpg``. The worker learns of exits without polling: each
pod's leader has a pidfd (``os.pidfd_open``), all of them in one epoll whose descriptor is
the plugin's only entry in ``fds()``. Without pidfds the plugin asks to be polled every
``poll_interval`` seconds through ``due()`` instead.

The helpers here (:class:`_Reaper`, the RSS watch, the cgroup probe) are shared with the
``python`` plugin (``transport/_pool.py``).
"""

import collections
import errno
import logging
import os
import re
import select
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil

from engine._codes import Phase
from transport._plugins import Change, LogLimit, Outcome, Plugin, PluginError, UserError

__all__ = ["ProcessPlugin", "find_memory_cgroup", "pod_log_path"]

log = logging.getLogger(__name__)

#: How much of a failed pod's log its outcome message quotes.
TAIL_BYTES = 2048
TAIL_LINES = 20
#: Tries (one per poll interval) to remove a pod's cgroup after its processes exited.
CGROUP_TRIES = 50

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def pod_log_path(attempt, pod):
    """The log file of ``pod``: ``attempt.log_path`` itself for a single-pod attempt, and
    ``<stem>.<role>-<index><suffix>`` next to it for each pod of a gang (the attempt's own
    log then lists the pods, their pids and their logs)."""
    path = Path(attempt.log_path)
    if not attempt.gang:
        return path
    role = _UNSAFE.sub("_", pod.role)
    return path.with_name(f"{path.stem}.{role}-{pod.index}{path.suffix or '.log'}")


def log_tail(path, max_bytes=TAIL_BYTES, max_lines=TAIL_LINES):
    """The last lines of ``path`` (at most ``max_bytes`` and ``max_lines``), '' if unreadable."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - max_bytes))
            data = f.read(max_bytes)
    except OSError:
        return ""
    lines = data.decode("utf-8", "replace").splitlines()
    if size > max_bytes and len(lines) > 1:
        lines = lines[1:]           # the first line was cut by the seek
    elif size > max_bytes and lines:
        lines[0] = "\u2026" + lines[0]    # one line longer than the tail: its end, marked
    return "\n".join(lines[-max_lines:])


def _why_not_run(exc, command):
    """Why ``command`` could not be run, as a user reads it (the OS says "Permission denied"
    of a directory, and "not found" of a script whose #! interpreter is missing)."""
    path = shutil.which(command) if os.sep not in command else command
    if path is not None and os.path.isdir(path):
        return "it is a directory"
    if isinstance(exc, FileNotFoundError):
        if path is not None and os.path.isfile(path):
            return "not found (its #! interpreter?)"
        return "not found"
    return exc.strerror


def signal_name(number):
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def mib(n):
    return f"{n / 2**20:.1f} MiB"


# ---------------------------------------------------------------------------------------------
# Process groups: spawn, watch for exit, stop with a grace, reap.


class _Group:
    """A process this plugin started as the leader of its own session and group. ``owner``
    is what its exit is reported to (None once it is being stopped: its exit is only
    reaped)."""

    __slots__ = ("popen", "pid", "pidfd", "owner", "cgroup", "returncode", "oom_kills")

    def __init__(self, popen, owner, cgroup=None):
        self.popen = popen
        self.pid = popen.pid
        self.pidfd = None
        self.owner = owner
        self.cgroup = cgroup
        self.returncode = None
        self.oom_kills = 0          # the kernel's OOM kills in the pod's cgroup, read at reap

    def signal(self, sig):
        # The leader is never reaped before its group is signalled for the last time, so
        # its pid (the group's id) cannot have been reused by then.
        if sig == signal.SIGKILL and self.cgroup is not None:
            self.cgroup.kill()      # also what left the group (setsid) but not the cgroup
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def exited(self):
        """Whether the leader has exited (it is not reaped: WNOWAIT)."""
        try:
            return os.waitid(os.P_PID, self.pid,
                             os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True


class _Reaper:
    """The process groups a plugin started, and the pipes it reads, behind one epoll.

    ``ready()`` returns the groups whose leader exited and the owners of the pipes that
    became readable; ``stop(group, grace)`` sends SIGTERM to the group now and SIGKILL when
    the grace runs out (``tick()``, which ``poll()`` calls, and ``due()`` says when). When a
    leader exits, its group gets SIGKILL (whatever the leader left behind in it is a stray)
    and the leader is reaped."""

    def __init__(self, use_pidfd=True, poll_interval=0.02):
        self.use_pidfd = bool(use_pidfd) and hasattr(os, "pidfd_open")
        self.poll_interval = poll_interval
        self.live = {}              # pid -> _Group, every group not reaped yet
        self._kill_at = {}          # pid -> monotonic time of its SIGKILL (being stopped)
        self._fds = {}              # fd -> ("pid", _Group) | ("pipe", owner)
        self._cgroups = []          # [_Cgroup, tries]: emptied pod cgroups not removed yet
        self._epoll = select.epoll() if hasattr(select, "epoll") else None
        self._poll = None if self._epoll is not None else select.poll()

    # -- descriptors

    def fds(self):
        if self._epoll is not None:
            return (self._epoll.fileno(),)
        return tuple(self._fds)

    def add_pipe(self, fd, owner):
        self._register(fd, ("pipe", owner))

    def remove_pipe(self, fd):
        self._unregister(fd)

    def _register(self, fd, entry):
        self._fds[fd] = entry
        if self._epoll is not None:
            self._epoll.register(fd, select.EPOLLIN)
        else:
            self._poll.register(fd, select.POLLIN)

    def _unregister(self, fd):
        if self._fds.pop(fd, None) is None:
            return
        try:
            (self._epoll or self._poll).unregister(fd)
        except (OSError, KeyError, ValueError):
            pass

    # -- processes

    def spawn(self, argv, owner, cgroup=None, **popen_kw):
        """Start ``argv`` as a new session; OSError from the spawn propagates."""
        popen = subprocess.Popen(argv, start_new_session=True, **popen_kw)
        group = _Group(popen, owner, cgroup)
        self.live[group.pid] = group
        if self.use_pidfd:
            try:
                group.pidfd = os.pidfd_open(group.pid)
            except OSError as exc:
                # The process exists (it is ours and not reaped), so this is the kernel
                # refusing pidfds; without one the group would never be seen to exit.
                self.stop(group, 0)
                raise PluginError(f"pidfd_open({group.pid}) failed: {exc}") from exc
            self._register(group.pidfd, ("pid", group))
        return group

    def stop(self, group, grace, term=True):
        """Detach ``group`` from its owner and end it: SIGTERM now (unless ``term`` is
        False: it was asked to exit some other way), SIGKILL after ``grace`` seconds (at once
        when ``grace`` <= 0)."""
        group.owner = None
        if group.pid not in self.live:
            return
        if grace <= 0:
            group.signal(signal.SIGKILL)
            self._kill_at.pop(group.pid, None)
        else:
            if term:
                group.signal(signal.SIGTERM)
            self._kill_at[group.pid] = time.monotonic() + grace

    def ready(self):
        """``(exited, pipe_owners)``: groups whose leader exited, reaped (each with its
        ``returncode``; a stopped group is reaped silently and not returned), and the owners
        of readable pipes."""
        exited, pipes = [], []
        if self._epoll is not None:
            events = self._epoll.poll(0) if self._fds else ()
        else:
            events = self._poll.poll(0) if self._fds else ()
        for fd, _ in events:
            entry = self._fds.get(fd)
            if entry is None:
                continue
            if entry[0] == "pipe":
                pipes.append(entry[1])
            else:
                exited.append(entry[1])
        if not self.use_pidfd:
            exited = [g for g in self.live.values() if g.exited()]
        reported = []
        for group in exited:
            if group.pid in self.live:
                self._reap(group)
                if group.owner is not None:
                    reported.append(group)
        return reported, pipes

    def _reap(self, group):
        group.signal(signal.SIGKILL)
        group.returncode = group.popen.wait()
        del self.live[group.pid]
        self._kill_at.pop(group.pid, None)
        if group.pidfd is not None:
            self._unregister(group.pidfd)
            os.close(group.pidfd)
            group.pidfd = None
        if group.cgroup is not None:
            group.oom_kills = group.cgroup.oom_kills()
            if not group.cgroup.remove():
                self._cgroups.append([group.cgroup, 0])

    def tick(self, now):
        """SIGKILL the stopped groups whose grace ran out; retry removing pod cgroups."""
        if self._kill_at:
            for pid, when in list(self._kill_at.items()):
                if when <= now:
                    del self._kill_at[pid]
                    self.live[pid].signal(signal.SIGKILL)
        if self._cgroups:
            self._retry_cgroups()

    def _retry_cgroups(self):
        # A cgroup stays busy for a moment while its last killed process exits; a few tries
        # over about a second, then it is left behind (and said so).
        left = []
        for entry in self._cgroups:
            entry[1] += 1
            if entry[0].remove():
                continue
            if entry[1] >= CGROUP_TRIES:
                log.warning("cannot remove cgroup %s; leaving it", entry[0].path)
                continue
            left.append(entry)
        self._cgroups = left

    def due(self):
        when = min(self._kill_at.values()) if self._kill_at else None
        if self._cgroups or (not self.use_pidfd and self.live):
            nxt = time.monotonic() + self.poll_interval
            when = nxt if when is None else min(when, nxt)
        return when

    def close(self, timeout):
        """Stop every group (SIGTERM), wait up to ``timeout`` seconds for them to exit,
        SIGKILL what is left and reap it (waiting at most one more second)."""
        for group in list(self.live.values()):
            if group.pid not in self._kill_at:
                group.owner = None
                group.signal(signal.SIGTERM)
        deadline = time.monotonic() + max(0.0, timeout)
        self._wait_all(deadline)
        for group in list(self.live.values()):
            group.signal(signal.SIGKILL)
        self._wait_all(time.monotonic() + 1.0)
        for group in list(self.live.values()):
            log.warning("process %d did not exit after SIGKILL; leaving it", group.pid)
        self._kill_at.clear()
        for _ in range(CGROUP_TRIES):
            if not self._cgroups:
                break
            self._retry_cgroups()
            time.sleep(0.02)
        for fd in list(self._fds):
            entry = self._fds[fd]
            self._unregister(fd)
            if entry[0] == "pid":
                os.close(fd)
        if self._epoll is not None:
            self._epoll.close()

    def _wait_all(self, deadline):
        while self.live:
            for group in list(self.live.values()):
                group.owner = None
                if group.exited():
                    self._reap(group)
            left = deadline - time.monotonic()
            if not self.live or left <= 0:
                return
            time.sleep(min(0.01, left))


# ---------------------------------------------------------------------------------------------
# Memory: the RSS of process trees, and cgroup v2 limits.


def tree_rss(roots):
    """``{root_pid: bytes}``: the resident set of each root and all its descendants (one
    scan of the process table for all roots; a process that vanishes mid-scan counts 0)."""
    if not roots:
        return {}
    children = collections.defaultdict(list)
    for proc in psutil.process_iter(["ppid"]):
        ppid = proc.info.get("ppid")
        if ppid is not None:
            children[ppid].append(proc.pid)
    out = {}
    for root in roots:
        total, stack, seen = 0, [root], set()
        while stack:
            pid = stack.pop()
            if pid in seen:
                continue
            seen.add(pid)
            try:
                total += psutil.Process(pid).memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
            stack.extend(children.get(pid, ()))
        out[root] = total
    return out


def find_memory_cgroup(proc_cgroup="/proc/self/cgroup", mountinfo="/proc/self/mountinfo"):
    """``(path, None)``: the cgroup v2 directory pods get their own cgroups in, with memory
    limits, else ``(None, reason)``. It must enable the memory controller for its children
    (``cgroup.subtree_control``) and be writable: this process's own cgroup (possible only
    at the root: a cgroup with processes cannot enable controllers for children), else its
    parent (the usual delegation: a service cgroup, the worker in a leaf of it, the pods in
    sibling leaves)."""
    try:
        own = None
        for line in Path(proc_cgroup).read_text().splitlines():
            if line.startswith("0::"):
                own = line[3:].strip()
        if own is None:
            return None, "no cgroup v2 membership in /proc/self/cgroup"
        mounts = [line.split(" - ")[0].split()[4]
                  for line in Path(mountinfo).read_text().splitlines()
                  if " - cgroup2 " in line]
    except OSError as exc:
        return None, f"cannot read the cgroup of this process: {exc}"
    if not mounts:
        return None, "no cgroup2 file system is mounted"
    reasons = []
    for mount in mounts:
        path = Path(mount) / own.lstrip("/")
        for candidate in (path, path.parent) if own.strip("/") else (path,):
            reason = _memory_delegated(candidate)
            if reason is None:
                return candidate, None
            reasons.append(reason)
    return None, "; ".join(reasons)


def _memory_delegated(path):
    try:
        subtree = (path / "cgroup.subtree_control").read_text().split()
    except OSError as exc:
        return f"{path}: {exc}"
    if "memory" not in subtree:
        return f"{path}: the memory controller is not enabled for child cgroups " \
               f"(cgroup.subtree_control: {' '.join(subtree) or 'empty'})"
    if not os.access(path, os.W_OK):
        return f"{path} is not writable"
    return None


class _Cgroup:
    """One pod's cgroup under the plugin's base: ``memory.max`` set, the pod moved in before
    it execs (``preexec_fn``), ``memory.events`` read at exit, removed after."""

    def __init__(self, base, name, limit):
        self.path = Path(base) / name
        self.limit = limit
        self.path.mkdir()
        try:
            (self.path / "memory.max").write_text(f"{limit}\n")
            if (self.path / "memory.swap.max").exists():
                (self.path / "memory.swap.max").write_text("0\n")
            if (self.path / "memory.oom.group").exists():
                (self.path / "memory.oom.group").write_text("1\n")
        except OSError:
            self.remove()
            raise

    def enter(self):
        # Runs in the forked child before exec: only async-signal-safe-ish calls.
        fd = os.open(str(self.path / "cgroup.procs"), os.O_WRONLY)
        try:
            os.write(fd, b"0\n")
        finally:
            os.close(fd)

    def oom_kills(self):
        try:
            for line in (self.path / "memory.events").read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def kill(self):
        try:
            (self.path / "cgroup.kill").write_text("1\n")
        except OSError:
            pass                    # before Linux 5.14: killpg alone

    def remove(self):
        """Whether the cgroup is gone (False: still busy, try again later)."""
        try:
            self.path.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno in (errno.EBUSY, errno.ENOTEMPTY):
                return False
            log.warning("cannot remove cgroup %s: %s; leaving it", self.path, exc)
        return True


# ---------------------------------------------------------------------------------------------
# The plugin.


class _Pod:
    __slots__ = ("run", "pod", "group", "log_path", "rss_limit")

    def __init__(self, run, pod, log_path):
        self.run = run
        self.pod = pod
        self.group = None
        self.log_path = log_path
        self.rss_limit = None       # set when the RSS watch enforces the pod's limit


class _Run:
    __slots__ = ("attempt", "pods", "live", "running_sent")

    def __init__(self, attempt):
        self.attempt = attempt
        self.pods = []
        self.live = 0
        self.running_sent = False


class ProcessPlugin(Plugin):
    """Runs ``execute.command`` as one subprocess per pod (the module text and
    ``docs/plugins.md`` say how). Options: ``kill_grace`` (seconds between SIGTERM and
    SIGKILL, default 2.0), ``memory_interval`` (seconds between RSS checks, 0.05), ``pidfd``
    (False: poll for exits every ``poll_interval`` seconds, 0.02, instead), ``cgroup``
    (``"auto"``: use the worker's cgroup v2 when it can hold memory limits, else the RSS
    watch; ``"off"``: always the RSS watch; a path: that cgroup v2 directory, which must
    qualify), ``max_log_bytes`` and ``log_interval`` (:class:`transport._plugins.LogLimit`:
    a pod that wrote more than that to its log fails its attempt USER)."""

    name = "process"

    def __init__(self, options=None):
        opts = dict(options or {})
        self.kill_grace = float(opts.pop("kill_grace", 2.0))
        self.memory_interval = float(opts.pop("memory_interval", 0.05))
        use_pidfd = opts.pop("pidfd", True)
        poll_interval = float(opts.pop("poll_interval", 0.02))
        cgroup = opts.pop("cgroup", "auto")
        self._logs = LogLimit(opts, "process")
        if opts:
            raise PluginError(f"process plugin: unknown option(s) {', '.join(sorted(opts))} "
                              f"(known: cgroup, kill_grace, log_interval, max_log_bytes, "
                              f"memory_interval, pidfd, poll_interval)", cause="CONFIG")
        self._reaper = _Reaper(use_pidfd, poll_interval)
        if cgroup == "off":
            self._cgroup_base, why = None, "disabled by the cgroup option"
        elif cgroup == "auto":
            self._cgroup_base, why = find_memory_cgroup()
        else:
            why = _memory_delegated(Path(cgroup))
            if why is not None:
                raise PluginError(f"process plugin: cgroup {cgroup}: {why}", cause="CONFIG")
            self._cgroup_base = Path(cgroup)
        #: How memory limits are enforced: ``"cgroup:<dir>"`` or ``"rss"`` (and why not a
        #: cgroup, in ``memory_note``).
        self.memory_mechanism = (f"cgroup:{self._cgroup_base}" if self._cgroup_base
                                 else "rss")
        self.memory_note = why
        self._runs = {}             # key -> _Run, the attempts poll() still reports
        self._new = []              # keys whose RUNNING the next poll() reports
        self._watched = set()       # _Pod whose memory limit the RSS watch enforces
        self._mem_next = 0.0
        self._seq = 0
        self._closed = False

    # -- the interface

    def start(self, attempt):
        if self._closed:
            raise PluginError("process plugin is closed")
        if attempt.key in self._runs:
            raise PluginError(f"attempt {attempt.key.hex()} is already running")
        ex = attempt.execute
        if not ex.command:
            raise UserError("execute.command is empty")
        run = _Run(attempt)
        base_env = dict(os.environ)
        if ex.env:
            base_env.update(ex.env)
        base_env["LEASEHOLD_ACTION"] = str(attempt.action)
        base_env["LEASEHOLD_ATTEMPT"] = str(attempt.attempt)
        base_env["LEASEHOLD_GANG_SIZE"] = str(len(attempt.pods))
        if attempt.input_ref is not None:
            base_env["LEASEHOLD_INPUT"] = str(attempt.input_ref)
        else:
            base_env.pop("LEASEHOLD_INPUT", None)
        try:
            for pod in attempt.pods:
                self._spawn(run, pod, base_env)
        except BaseException:
            for p in run.pods:
                if p.group is not None:
                    self._reaper.stop(p.group, 0)
                self._watched.discard(p)
            raise
        if attempt.gang:
            self._write_index(run)
        self._runs[attempt.key] = run
        self._new.append(attempt.key)

    def poll(self):
        if self._closed:
            return []
        changes = []
        for key in self._new:
            run = self._runs.get(key)
            if run is not None and not run.running_sent:
                run.running_sent = True
                changes.append(Change(key, Phase.RUNNING))
        self._new.clear()
        now = time.monotonic()
        self._reaper.tick(now)
        exited, _ = self._reaper.ready()
        for group in exited:
            pod = group.owner
            if pod is None:
                continue    # stopped meanwhile: a gang sibling that failed first ended it
            run = pod.run
            if run.attempt.key not in self._runs:
                continue
            self._watched.discard(pod)
            outcome = self._exit_outcome(pod, group)
            if outcome is None:
                run.live -= 1
                if run.live == 0:
                    self._finish(run, Outcome.succeeded(), changes)
            else:
                self._finish(run, outcome, changes)
        if self._watched and now >= self._mem_next:
            self._mem_next = now + self.memory_interval
            self._check_memory(changes)
        if self._logs.check_now(now, self._runs):
            self._check_logs(changes)
        return changes

    def fds(self):
        return () if self._closed else self._reaper.fds()

    def due(self):
        if self._closed:
            return None
        when = self._reaper.due()
        if self._new:
            when = 0.0
        if self._watched:
            when = self._mem_next if when is None else min(when, self._mem_next)
        logs = self._logs.due(self._runs)
        if logs is not None:
            when = logs if when is None else min(when, logs)
        return when

    def stop(self, key, reason=None):
        run = self._runs.pop(key, None)
        if run is None:
            return
        self._end(run, self.kill_grace)

    def close(self, timeout=5.0):
        self._closed = True
        self._runs.clear()
        self._new.clear()
        self._watched.clear()
        self._reaper.close(timeout)

    # -- inside

    def _spawn(self, run, pod, base_env):
        attempt = run.attempt
        env = dict(base_env)
        env["LEASEHOLD_POD_ROLE"] = pod.role
        env["LEASEHOLD_POD_INDEX"] = str(pod.index)
        p = _Pod(run, pod, pod_log_path(attempt, pod))
        cgroup = None
        if pod.memory_limit is not None and self._cgroup_base is not None:
            self._seq += 1
            name = f"leasehold-{attempt.key.hex()[:16]}-{self._seq}"
            try:
                cgroup = _Cgroup(self._cgroup_base, name, pod.memory_limit)
            except OSError as exc:
                raise PluginError(f"pod {pod.name}: cannot set its memory limit in cgroup "
                                  f"{self._cgroup_base / name}: {exc}") from exc
        try:
            logf = open(p.log_path, "ab")
        except OSError as exc:
            if cgroup is not None:
                cgroup.remove()
            raise PluginError(f"pod {pod.name}: cannot open its log {p.log_path}: "
                              f"{exc}") from exc
        try:
            p.group = self._reaper.spawn(
                list(attempt.execute.command), p, cgroup=cgroup, cwd=attempt.workdir,
                env=env, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                preexec_fn=cgroup.enter if cgroup is not None else None)
        except (FileNotFoundError, PermissionError, NotADirectoryError) as exc:
            if cgroup is not None:
                cgroup.remove()
            if exc.filename is not None and str(exc.filename) == str(attempt.workdir):
                raise PluginError(f"pod {pod.name}: workdir {attempt.workdir}: "
                                  f"{exc.strerror}") from exc
            raise UserError(f"pod {pod.name}: command {attempt.execute.command[0]!r} "
                            f"cannot be run: {_why_not_run(exc, attempt.execute.command[0])}"
                            ) from exc
        except OSError as exc:
            if exc.errno != errno.ENOEXEC:
                if cgroup is not None:
                    cgroup.remove()
                raise PluginError(f"pod {pod.name}: cannot start "
                                  f"{attempt.execute.command[0]!r}: {exc}") from exc
            # Not a program this machine runs (no #! line, another architecture): the
            # declaration's fault, not the machine's; a retry would fail the same way.
            if cgroup is not None:
                cgroup.remove()
            raise UserError(f"pod {pod.name}: command {attempt.execute.command[0]!r} "
                            f"cannot be run: {exc.strerror}") from exc
        except subprocess.SubprocessError as exc:
            # SubprocessError: preexec_fn failed, the pod could not enter its cgroup.
            if cgroup is not None:
                cgroup.remove()
            raise PluginError(f"pod {pod.name}: cannot start "
                              f"{attempt.execute.command[0]!r}: {exc}") from exc
        finally:
            logf.close()
        run.pods.append(p)
        run.live += 1
        if pod.memory_limit is not None and cgroup is None:
            p.rss_limit = pod.memory_limit
            self._watched.add(p)

    def _write_index(self, run):
        lines = [f"leasehold: gang of {len(run.pods)} pods, one log each\n"]
        lines += [f"leasehold: pod {p.pod.name}: pid {p.group.pid}, log {p.log_path}\n"
                  for p in run.pods]
        try:
            with open(run.attempt.log_path, "a", encoding="utf-8") as f:
                f.writelines(lines)
        except OSError as exc:
            self._end(run, 0)
            raise PluginError(f"cannot write the log {run.attempt.log_path}: {exc}") from exc

    def _exit_outcome(self, pod, group):
        """None for exit 0, else the outcome of the attempt because of this pod."""
        rc = group.returncode
        name = pod.pod.name if pod.run.attempt.gang else None
        where = f"pod {pod.pod.name} " if name else ""
        if group.oom_kills:
            return Outcome.system(
                "OOM", f"{where}exceeded its memory limit {mib(group.cgroup.limit)}: "
                       f"killed by the kernel OOM killer (cgroup {group.cgroup.path})", pod=name)
        if rc == 0:
            return None
        if rc < 0:
            return Outcome.system("KILLED", f"{where}was killed by {signal_name(-rc)} "
                                            f"(not sent by the worker)", pod=name)
        tail = log_tail(pod.log_path)
        return Outcome.user(f"{where}exited with code {rc}; tail of its log "
                            f"{pod.log_path}:\n{tail}", pod=name)

    def _check_memory(self, changes):
        pods = list(self._watched)
        rss = tree_rss([p.group.pid for p in pods])
        for p in pods:
            seen = rss.get(p.group.pid, 0)
            if seen <= p.rss_limit or p.run.attempt.key not in self._runs:
                continue
            name = p.pod.name if p.run.attempt.gang else None
            where = f"pod {p.pod.name} " if name else ""
            self._reaper.stop(p.group, 0)
            self._finish(p.run, Outcome.system(
                "OOM", f"{where}exceeded its memory limit {mib(p.rss_limit)}: resident set "
                       f"{mib(seen)} seen (RSS watch); killed", pod=name), changes)

    def _check_logs(self, changes):
        for run in list(self._runs.values()):
            for p in run.pods:
                size = self._logs.over(p.log_path)
                if size is not None:
                    name = p.pod.name if run.attempt.gang else None
                    where = f"pod {p.pod.name} " if name else ""
                    self._finish(run, Outcome.user(
                        self._logs.message(where, p.log_path, size), pod=name), changes)
                    break

    def _finish(self, run, outcome, changes):
        """Report ``outcome`` for ``run`` and stop its pods still running."""
        key = run.attempt.key
        if self._runs.pop(key, None) is None:
            return
        if not run.running_sent:
            run.running_sent = True
            changes.append(Change(key, Phase.RUNNING))
        changes.append(Change(key, outcome.phase, outcome))
        self._end(run, self.kill_grace)

    def _end(self, run, grace):
        for p in run.pods:
            self._watched.discard(p)
            if p.group is not None and p.group.owner is not None:
                self._reaper.stop(p.group, grace)
