"""The supervisor (``leasehold serve --config FILE``, ``docs/operations.md``).

It starts one ``leasehold shard`` process per ``transport.endpoints`` entry, pins each to a
CPU, restarts a shard that dies, serves the Prometheus metrics of the shards' status files,
and stops everything on SIGTERM or SIGINT. It decides nothing: every decision is a shard's.

Before it starts anything it refuses, with one line, what could not work:

- an invalid config (``load_config``'s error, naming the key);
- a store already held: a supervisor lock file, ``<storage.path>/supervisor.lock``, locked
  with ``flock`` for as long as the supervisor lives and holding its pid, config and start
  time (the kernel drops the lock when the process dies, however it dies, so a stale file
  never blocks a restart); and the partition claims of each shard's store, read without
  opening it for writing, so a ``leasehold shard`` started by hand is named too;
- an endpoint or metrics port already taken (a bind test before any process is spawned).

Shards are spawned in sessions of their own (a Ctrl-C in the terminal reaches the
supervisor, which stops them in order) with ``PR_SET_PDEATHSIG`` = SIGTERM on Linux, so a
supervisor that is killed outright still has its shards stop cleanly (commit, release the
claims). Their output is forwarded line by line, prefixed ``[shard N]``.

A shard that exits when it was not asked to is restarted: at once after a run of at least
``STABLE_S`` seconds, otherwise after ``min(0.25 * 2**(k-2), 5)`` seconds for its k-th exit
in a row; after ``MAX_FAILURES`` exits in a row the supervisor gives up, stops the others and
exits 1. The restarted shard takes over its own claims (same shard name), reloads its
partitions from LMDB and serves again; its workers re-register on their next request
("has not registered"), the shard adopts the leases they hold, and their work continues.
"""

import collections
import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import lmdb
import psutil

from engine._config import Config, load_config
from engine._errors import LeaseholdError
from storage._lmdb import data_file, partition_dir
from storage._store import DBS, META_CLAIM, Claim
from transport._keys import load_keyring
from transport._locks import (
    SHARD_LOCK_NAME,
    SUPERVISOR_LOCK_NAME,
    LockHeld,
    hold_lock,
    holds_store,
    lock_holder,
)
from transport._metrics import serve_metrics
from transport._shards import shard_store_path
from transport._status import StatusError, StatusReader, status_path

__all__ = ["Supervisor", "SupervisorError", "run_supervisor", "LOCK_NAME", "STABLE_S",
           "MAX_FAILURES"]

log = logging.getLogger("leasehold.supervisor")

#: The lock file under ``storage.path``.
LOCK_NAME = SUPERVISOR_LOCK_NAME
#: A shard that served this long before it died is restarted at once.
STABLE_S = 10.0
#: Exits in a row (each within STABLE_S of its start) after which the supervisor gives up.
MAX_FAILURES = 5
_BACKOFF_BASE_S = 0.25
_BACKOFF_CAP_S = 5.0
_TICK_S = 0.02          # the monitor loop's wait between checks of the shard processes
_ROOT = Path(__file__).resolve().parent.parent     # the checkout / install the shards import


class SupervisorError(LeaseholdError):
    """The supervisor cannot start (a store held, a port taken, a shard that does not come
    up) or had to give up; the message names what and who."""

    code = "UNAVAILABLE"


def _pdeathsig():
    """A ``preexec_fn`` making the child get SIGTERM when the spawning thread's process dies
    (Linux); None elsewhere. libc is resolved here, in the parent: the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    prctl = libc.prctl
    parent = os.getpid()

    def preexec():
        prctl(1, int(signal.SIGTERM), 0, 0, 0)      # PR_SET_PDEATHSIG
        if os.getppid() != parent:                  # the parent died before the prctl
            os._exit(1)
    return preexec


class _ShardProc:
    """One shard slot: its process (None between a death and its restart) and history."""

    def __init__(self, index, endpoint, cpu):
        self.index = index
        self.endpoint = endpoint
        self.cpu = cpu
        self.proc = None
        self.started = 0.0          # monotonic: spawn of the current process
        self.serving = False        # its status file says running, under its pid
        self.served_at = 0.0        # monotonic: when it was seen serving
        self.failures = 0           # exits in a row without STABLE_S of service
        self.restarts = 0
        self.restart_at = None      # monotonic: when to spawn again
        self.died_at = None         # monotonic: the last unexpected exit
        self.last_lines = collections.deque(maxlen=20)
        self.reader = None          # the output forwarding thread

    @property
    def pid(self):
        return self.proc.pid if self.proc is not None else None


class Supervisor:
    """Run the shards of ``config`` (a Config or a path) as ``leasehold shard`` processes.

    ``config_path`` is the file the shards load (default: ``config`` when it is a path, else
    ``config.source``). ``output`` receives the shards' output lines (default: stderr).
    ``start_timeout`` bounds a shard's start (process spawn to serving); ``stop_timeout``
    the wait for the shards after SIGTERM before SIGKILL (None: ``[supervisor]``'s).

    :meth:`start` checks, locks the store, spawns every shard and returns once all serve
    (or raises :class:`SupervisorError` having stopped what it started); :meth:`run` then
    watches them (restarts) until :meth:`request_stop` (signal-safe), stops them and returns
    the exit code; :meth:`close` stops everything from any state."""

    def __init__(self, config, *, config_path=None, output=None, start_timeout=None,
                 stop_timeout=None, python=None):
        if config_path is None and not isinstance(config, Config):
            config_path = config
        self.config = config if isinstance(config, Config) else load_config(config)
        self.config_path = Path(config_path if config_path is not None
                                else self.config.source).resolve()
        self.output = output if output is not None else sys.stderr
        sv = self.config.supervisor
        self.start_timeout = float(sv.start_timeout if start_timeout is None else start_timeout)
        self.stop_timeout = float(sv.stop_timeout if stop_timeout is None else stop_timeout)
        self.python = python or sys.executable
        self._stop = threading.Event()
        self._out_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._lock_fd = None
        self.metrics = None
        self.exit_code = None
        self.gave_up = None         # the message, when run() gave up on a shard
        try:
            cpus = sorted(psutil.Process().cpu_affinity())
        except (AttributeError, psutil.Error):
            cpus = None             # no affinity on this platform: logged at start
        self.cpus = cpus
        eps = self.config.transport.endpoints
        self.shards = [_ShardProc(i, ep, None if cpus is None else cpus[i % len(cpus)])
                       for i, ep in enumerate(eps)]
        self._preexec = _pdeathsig()

    # ------------------------------------------------------------------ checks

    def check(self):
        """Every refusal that needs no process: the shard's keys, the store held, a port
        taken."""
        load_keyring(self.config.security)      # ConfigError naming the key or file
        self._check_claims()
        for i, ep in enumerate(self.config.transport.endpoints):
            _check_endpoint(f"transport.endpoints[{i}]", ep)
        m = self.config.status.metrics
        if m is not None:
            host, port = _host_port(m)
            if port:
                _check_tcp(f"status.metrics {m}", host, port)

    def _acquire_lock(self):
        try:
            self._lock_fd = hold_lock(self.config.storage.path, LOCK_NAME, "supervisor",
                                      self.config_path)
        except LockHeld as exc:
            raise SupervisorError(str(exc)) from None

    def _release_lock(self):
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._lock_fd, 0)
            os.close(self._lock_fd)     # drops the flock
            self._lock_fd = None

    def _check_claims(self):
        for sh in self.shards:
            problem = store_held(shard_store_path(self.config, sh.index))
            if problem is not None:
                raise SupervisorError(problem)

    # ------------------------------------------------------------------ start

    def start(self):
        """:meth:`launch`, then :meth:`wait_serving`. Returns self."""
        self.launch()
        self.wait_serving()
        return self

    def launch(self):
        """Lock the store, check, serve the metrics and spawn every shard (without waiting
        for them). Raises :class:`SupervisorError` having undone what it did."""
        try:
            self._acquire_lock()
            self.check()
            m = self.config.status.metrics
            if m is not None:
                host, port = _host_port(m)
                paths = [status_path(self.config, sh.index) for sh in self.shards]
                try:
                    self.metrics = serve_metrics(paths, host, port)
                except OSError as exc:
                    raise SupervisorError(f"status.metrics {m}: {exc.strerror or exc}") from None
                log.info("metrics on %s", self.metrics.url)
            if self.cpus is None:
                log.warning("this platform has no CPU affinity: shards are not pinned")
            for sh in self.shards:
                self._spawn(sh)
        except BaseException:
            self.close()
            raise
        return self

    def wait_serving(self):
        """Wait until every shard serves (at most ``start_timeout`` seconds from now). A
        shard that exits meanwhile, or the timeout, raises :class:`SupervisorError` after
        everything was stopped."""
        try:
            deadline = time.monotonic() + self.start_timeout
            while not all(sh.serving for sh in self.shards):
                for sh in self.shards:
                    if sh.serving:
                        continue
                    rc = sh.proc.poll()
                    if rc is not None:
                        sh.reader.join(2.0)
                        raise SupervisorError(f"shard {sh.index} ({sh.endpoint}) exited "
                                              f"{_exit_text(rc)} while starting"
                                              f"{_last_line(sh)}")
                    self._check_serving(sh)
                if all(sh.serving for sh in self.shards):
                    break
                if time.monotonic() >= deadline:
                    late = [str(sh.index) for sh in self.shards if not sh.serving]
                    raise SupervisorError(f"shard(s) {', '.join(late)} not serving within "
                                          f"{self.start_timeout:g}s of their start")
                if self._stop.wait(_TICK_S):
                    raise SupervisorError("asked to stop while starting")
        except BaseException:
            self.close()
            raise
        return self

    def _spawn(self, sh):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(_ROOT), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
        env["PYTHONUNBUFFERED"] = "1"
        cmd = [self.python, "-m", "engine.cli", "shard", "--config", str(self.config_path),
               "--shard", str(sh.index)]
        sh.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   start_new_session=True, preexec_fn=self._preexec)
        sh.started = time.monotonic()
        sh.serving = False
        sh.restart_at = None
        sh.reader = threading.Thread(target=self._forward, args=(sh, sh.proc),
                                     name=f"shard-{sh.index}-output", daemon=True)
        sh.reader.start()
        log.info("shard %d: started pid %d (%s)", sh.index, sh.proc.pid, sh.endpoint)

    def _forward(self, sh, proc):
        prefix = f"[shard {sh.index}] "
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            sh.last_lines.append(line)
            with self._out_lock:
                try:
                    self.output.write(prefix + line + "\n")
                    self.output.flush()
                except (OSError, ValueError):   # the output went away: keep draining
                    pass
        proc.stdout.close()

    def _check_serving(self, sh):
        """Whether the shard's status file says it runs, under its current pid; pins it
        then (after its reload, which may use every core)."""
        try:
            with StatusReader(status_path(self.config, sh.index)) as r:
                snap = r.snapshot()
        except (StatusError, OSError):
            return False            # not made yet, or the old one being replaced
        if snap.pid != sh.pid or snap.state != "running":
            return False
        sh.serving = True
        sh.served_at = time.monotonic()
        where = ""
        if sh.cpu is not None:
            try:
                psutil.Process(sh.pid).cpu_affinity([sh.cpu])
                where = f", pinned to CPU {sh.cpu}"
            except psutil.Error as exc:
                log.warning("shard %d: cannot pin pid %d to CPU %d: %s", sh.index, sh.pid,
                            sh.cpu, exc)
        log.info("shard %d: serving (pid %d, started in %.2fs, reload %.3fs%s)", sh.index,
                 sh.pid, sh.served_at - sh.started, snap.reload_s, where)
        return True

    # ------------------------------------------------------------------ run

    def request_stop(self):
        """Ask :meth:`run` to stop the shards and return (safe from a signal handler)."""
        self._stop.set()

    def install_signal_handlers(self):
        """SIGTERM and SIGINT stop the supervisor (call from the main thread)."""
        def handler(signum, frame):
            self._stop.set()
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def run(self):
        """Watch the shards until asked to stop (restarting those that die), then stop
        them. Returns the exit code: 0 when every shard stopped cleanly, else 1."""
        try:
            while not self._stop.wait(_TICK_S):
                now = time.monotonic()
                for sh in self.shards:
                    self._watch(sh, now)
                if self.gave_up is not None:
                    break
        finally:
            code = self.close()
        return 1 if self.gave_up is not None else code

    def _watch(self, sh, now):
        if sh.proc is None:
            if sh.restart_at is not None and now >= sh.restart_at:
                sh.restarts += 1
                self._spawn(sh)
            return
        rc = sh.proc.poll()
        if rc is None:
            if not sh.serving:
                self._check_serving(sh)
                if sh.serving and sh.died_at is not None:
                    log.info("shard %d: serving again %.2fs after it died (restart %d)",
                             sh.index, sh.served_at - sh.died_at, sh.restarts)
            return
        sh.reader.join(1.0)
        pid = sh.pid
        stable = sh.serving and now - sh.served_at >= STABLE_S
        sh.failures = 1 if stable else sh.failures + 1
        sh.proc = None
        sh.serving = False
        sh.died_at = now
        if sh.failures > MAX_FAILURES:
            self.gave_up = (f"shard {sh.index} ({sh.endpoint}) exited {MAX_FAILURES + 1} "
                            f"times in a row (last: {_exit_text(rc)}{_last_line(sh)}); "
                            f"giving up")
            log.error("%s", self.gave_up)
            return
        delay = 0.0 if sh.failures == 1 else \
            min(_BACKOFF_BASE_S * 2 ** (sh.failures - 2), _BACKOFF_CAP_S)
        sh.restart_at = now + delay
        log.warning("shard %d: pid %d exited %s%s; restarting it in %.2fs (exit %d in a "
                    "row)", sh.index, pid, _exit_text(rc), _last_line(sh) if rc > 0 else "",
                    delay, sh.failures)

    # ------------------------------------------------------------------ stop

    def close(self):
        """Stop every shard (SIGTERM; SIGKILL past ``stop_timeout``), the metrics server,
        release the lock. Idempotent; returns 0 when every shard exited 0, else 1."""
        self._stop.set()
        with self._close_lock:      # run()'s own close on its thread, and the caller's
            return self._close()

    def _close(self):
        live = [sh for sh in self.shards if sh.proc is not None]
        for sh in live:
            if sh.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    sh.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        clean = True
        for sh in live:
            try:
                rc = sh.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("shard %d: pid %d still running %gs after SIGTERM: SIGKILL",
                          sh.index, sh.pid, self.stop_timeout)
                sh.proc.kill()
                rc = sh.proc.wait(5.0)
            if rc != 0:
                clean = False
                log.error("shard %d: pid %d exited %s on stop%s", sh.index, sh.pid,
                          _exit_text(rc), _last_line(sh))
            else:
                log.info("shard %d: pid %d stopped", sh.index, sh.pid)
            if sh.reader is not None:
                sh.reader.join(2.0)
            sh.proc = None
            sh.serving = False
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        self._release_lock()
        if self.exit_code is None or not clean:
            self.exit_code = 0 if clean else 1
        return self.exit_code

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------------- checks


def _host_port(text):
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def _check_endpoint(what, ep):
    if ep.startswith("tcp://"):
        host, port = _host_port(ep[len("tcp://"):])
        if port == 0:
            raise SupervisorError(f"{what} {ep}: port 0 picks a new port at every start, so "
                                  f"workers and clients could not find the shard; give a "
                                  f"fixed port")
        _check_tcp(f"{what} {ep}", host, port)
    elif ep.startswith("ipc://"):
        path = ep[len("ipc://"):]
        if os.path.exists(path):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                try:
                    s.connect(path)
                except OSError:
                    return          # a stale socket file: the shard's bind replaces it
            raise SupervisorError(f"{what} {ep}: something is listening on {path}")
    else:
        raise SupervisorError(f"{what} {ep}: inproc endpoints live in one process; the "
                              f"supervisor runs each shard in its own (use tcp:// or ipc://)")


def _check_tcp(what, host, port):
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise SupervisorError(f"{what}: cannot resolve {host!r}: {exc.strerror}") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # As the shard's own bind does (libzmq sets SO_REUSEADDR): a port held only by
        # connections in TIME_WAIT is free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            raise SupervisorError(f"{what}: port {port} on {host} is taken"
                                  f"{_port_holder(port)} ({exc.strerror})") from None


def _port_holder(port):
    """`` by pid N (name)`` of a local listener on ``port`` when psutil can see it."""
    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                try:
                    return f" by pid {c.pid} ({' '.join(psutil.Process(c.pid).cmdline())})"
                except psutil.Error:
                    return f" by pid {c.pid}"
    except (psutil.Error, OSError):
        pass                        # naming the holder is a courtesy; the refusal stands
    return ""


def store_held(path, now_ns=None):
    """Why a shard may not open the store at ``path`` now (a ``leasehold shard`` holds its
    lock file, or its claim is live and held by a process on this host that has it open,
    or by any shard on another host), or None. A claim of a process that is gone (a crash)
    is its successor's to take over, even once its pid is another process's. The store itself
    lets a shard of the same name take a live claim over (a restart), fencing the old
    holder out: this check is what stops a second process from doing that to a running
    one. ``SupervisorError`` if the claim cannot be read."""
    now = time.time_ns() if now_ns is None else now_ns
    # A shard holds its lock from its start to its exit, claim or no claim (yet, or still).
    holder = lock_holder(path, SHARD_LOCK_NAME, "shard")
    if holder is not None:
        return f"store {path} is held by a live shard: {holder}; stop it first (SIGTERM)"
    claim = _read_claim(path)
    if claim is None or not claim.live(now):
        return None
    if claim.host == socket.gethostname():
        if claim.pid == os.getpid() or not holds_store(claim.pid, path):
            return None     # a dead holder's claim (its pid may be another's now)
        return (f"store {path} is held by a live process that has it open (or that this "
                f"user may not inspect): {claim.describe(now)}; stop it first (SIGTERM "
                f"{claim.pid})")
    return (f"store {path} is claimed from another host: {claim.describe(now)}; "
            f"stop that shard or wait until its claim expires")


def _read_claim(path):
    """Partition 0's claim of the store at ``path`` (None: no store, or never claimed).
    A store is claimed whole (``LmdbStore.open``), so partition 0 speaks for all."""
    p0 = partition_dir(path, 0)
    if not data_file(path, 0).exists():
        return None
    try:
        env = lmdb.open(str(p0), subdir=True, readonly=True, create=False, lock=True,
                        max_dbs=len(DBS))
    except lmdb.Error as exc:
        raise SupervisorError(f"store {path}: cannot read its claims: {exc}") from None
    try:
        try:
            meta = env.open_db(b"meta", create=False)
        except lmdb.Error:
            return None             # made but never opened by a shard
        with env.begin() as txn:
            raw = txn.get(META_CLAIM, db=meta)
        return Claim.decode(raw, 0) if raw is not None else None
    finally:
        env.close()


def _exit_text(rc):
    if rc is None:
        return "(running)"
    if rc < 0:
        try:
            return f"by signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"by signal {-rc}"
    return f"with code {rc}"


def _last_line(sh):
    for line in reversed(sh.last_lines):
        if line.strip():
            return f": {line.strip()}"
    return ""


def run_supervisor(config_path, *, start_timeout=None, stop_timeout=None):
    """``leasehold serve``: start, serve until SIGTERM/SIGINT, stop; returns the exit code."""
    sup = Supervisor(config_path, start_timeout=start_timeout, stop_timeout=stop_timeout)
    sup.install_signal_handlers()
    sup.start()
    log.info("serving %d shard(s) of %s; SIGTERM or Ctrl-C stops them", len(sup.shards),
             sup.config_path)
    code = sup.run()
    if sup.gave_up is not None:
        raise SupervisorError(sup.gave_up)
    return code
