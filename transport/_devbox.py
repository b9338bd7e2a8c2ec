"""The devbox (``leasehold devbox``, ``docs/devbox.md``): a whole local engine in one command.

In a fresh directory (a temporary one, or ``--dir``): a config from the bundled template
``engine/examples/devbox.toml`` sized from this machine (its CPUs and memory are the one
cluster's capacity; the worker holds 8 leases per CPU), CURVE keys for the shard, the worker,
a client and an admin, then the supervisor (in this process: :class:`~transport.Supervisor`),
its shard process and one ``leasehold worker`` process with the ``process``, ``python`` and
``sim`` plugins. Once the worker is registered (the shard's status file counts it), the
bundled example workload runs through :class:`~transport.Client` (``transport/_workload.py``)
with live progress, and its summary is printed. Then everything stops, in order: the
workload's client, the worker (SIGTERM: it drains), the supervisor and its shards (SIGTERM:
last commit, claims released). Exit 0; anything that failed is one line
``leasehold: CODE: message`` naming the log to read, and exit 2. A temporary directory is
removed after a success and kept after a failure (or with ``--keep``).
"""

import contextlib
import logging
import os
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import psutil
from rich.console import Console

from engine._config import load_config
from engine._errors import LeaseholdError, SpecError
from transport._daemon import measured_capacity
from transport._keys import generate_keypair
from transport._status import StatusError, StatusReader, status_path
from transport._supervisor import Supervisor, _pdeathsig
from transport._worker import ShardError, ShardTimeout
from transport._workload import WORKLOADS, WorkloadFailed

__all__ = ["Devbox", "DevboxError", "run_devbox", "TEMPLATE"]

log = logging.getLogger("leasehold.devbox")

_EXAMPLES = Path(__file__).resolve().parent.parent / "engine" / "examples"
#: The config template the devbox fills in.
TEMPLATE = _EXAMPLES / "devbox.toml"
CLUSTER = "local"
WORKER = "local-1"
CLIENT_KEY = "devbox-app"
SLOTS_PER_CPU = 8
_READY_TIMEOUT_S = 30.0
_WORKER_STOP_S = 10.0


#: Seconds between two looks at the worker and the supervisor while serving (--no-workload).
_WATCH_S = 0.5


class DevboxError(LeaseholdError):
    """The devbox could not start, or something it started failed."""

    code = "UNAVAILABLE"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path, n=1):
    try:
        lines = [x for x in Path(path).read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])


class Devbox:
    """A local engine in ``directory`` (None: a new temporary one). :meth:`start` makes the
    config and keys and starts the supervisor, its shard and the worker (returns once the
    worker is registered); :meth:`run_workload` runs a bundled workload; :meth:`stop` stops
    what was started, in order."""

    def __init__(self, directory=None, *, keep=False, console=None, python=None):
        self.temporary = directory is None
        self.keep = keep
        self.dir = Path(tempfile.mkdtemp(prefix="leasehold-devbox-") if directory is None
                        else directory).resolve()
        self.console = console or Console()
        self.python = python or sys.executable
        self.config_path = self.dir / "leasehold.toml"
        self.logs = self.dir / "logs"
        self.supervisor = None
        self.worker = None
        self._monitor = None
        self._log_handler = None
        self._shard_log = None
        self.ready_s = None
        self.failed = False

    # ------------------------------------------------------------------ set up

    def prepare(self):
        """Write the config (sized from this machine) and the keys."""
        if not self.temporary:
            if self.dir.exists() and not self.dir.is_dir():
                raise SpecError(f"--dir {self.dir}: not a directory")
            if self.dir.exists() and any(self.dir.iterdir()):
                raise DevboxError(f"--dir {self.dir} is not empty: give a new or empty "
                                  f"directory (the devbox makes its store, keys and config "
                                  f"there)")
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise SpecError(f"--dir {self.dir}: cannot make it: "
                                f"{exc.strerror or exc}") from None
        self.logs.mkdir()
        keys = self.dir / "keys"
        generate_keypair(keys, "shard")
        generate_keypair(keys, WORKER, metadata={"role": "worker", "cluster": CLUSTER})
        generate_keypair(keys, CLIENT_KEY, metadata={"role": "client", "tenants": "devbox"})
        generate_keypair(keys, "devbox-admin", metadata={"role": "admin"})
        from engine._units import ResourceSet
        cap = measured_capacity(ResourceSet(("cpu", "memory")), self.dir)
        self.cpus = int(cap["cpu"])
        text = string.Template(TEMPLATE.read_text()).substitute(
            cpu=self.cpus, memory=int(cap["memory"]), data=self.dir / "data", keys=keys,
            port=_free_port(), metrics_port=_free_port(), slots=SLOTS_PER_CPU * self.cpus,
            work=self.dir / "work", logs=self.logs / "attempts")
        self.config_path.write_text(text)
        self.config = load_config(self.config_path)
        return self

    def start(self):
        """Start the supervisor (its shard) and the worker; return once the worker is
        registered with the shard (bounded)."""
        t0 = time.monotonic()
        self._log_handler = logging.FileHandler(self.logs / "supervisor.log")
        self._log_handler.setFormatter(logging.Formatter(
            "%(asctime)s %(name)s %(levelname)s %(message)s"))
        root = logging.getLogger("leasehold")
        root.addHandler(self._log_handler)
        root.setLevel(logging.INFO)
        root.propagate = False      # the terminal shows the workload; the logs hold the rest
        self._shard_log = open(self.logs / "shards.log", "a", buffering=1)   # noqa: SIM115
        self.supervisor = Supervisor(self.config, config_path=self.config_path,
                                     output=self._shard_log, python=self.python)
        self.supervisor.launch()
        # The worker starts while the shard loads: it waits for the shard's socket itself.
        self._start_worker()
        self.supervisor.wait_serving()
        self._monitor = threading.Thread(target=self.supervisor.run, name="supervisor",
                                         daemon=True)
        self._monitor.start()
        self._wait_registered(t0 + _READY_TIMEOUT_S)
        self.ready_s = time.monotonic() - t0
        return self

    def _start_worker(self):
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(
            [root, str(_EXAMPLES), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
        env["PYTHONUNBUFFERED"] = "1"
        with open(self.logs / "worker.log", "ab") as out:
            self.worker = subprocess.Popen(
                [self.python, "-m", "engine.cli", "worker", "--config", str(self.config_path),
                 "--cluster", CLUSTER, "--name", WORKER], cwd=self.dir, env=env,
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_pdeathsig())
        log.info("worker %s: started pid %d", WORKER, self.worker.pid)

    def _wait_registered(self, deadline):
        path = status_path(self.config, 0)
        while True:
            rc = self.worker.poll()
            if rc is not None:
                raise DevboxError(f"the worker exited with code {rc} before it registered: "
                                  f"{_tail(self.logs / 'worker.log')} (log "
                                  f"{self.logs / 'worker.log'})")
            try:
                with StatusReader(path) as r:
                    cluster = r.snapshot().clusters.get(CLUSTER)
                if cluster is not None and cluster.workers_connected >= 1:
                    return
            except (StatusError, OSError):
                pass                # remade by a restarting shard: read it again
            if time.monotonic() >= deadline:
                raise DevboxError(f"the worker did not register within {_READY_TIMEOUT_S:g}s "
                                  f"(log {self.logs / 'worker.log'})")
            time.sleep(0.01)

    def problem(self):
        """What stopped working since :meth:`start`, or None: the worker exited (its code
        and the last line of its log; it is reaped here), or the supervisor gave up on its
        shard (restarted too often)."""
        rc = self.worker.poll() if self.worker is not None else None
        if rc is not None:
            how = (f"was killed by {signal.Signals(-rc).name}" if rc < 0 and -rc in
                   signal.valid_signals() else f"exited with code {rc}")
            return (f"the worker {how}: {_tail(self.logs / 'worker.log')} (log "
                    f"{self.logs / 'worker.log'})")
        if self.supervisor is not None and self.supervisor.gave_up is not None:
            return f"the supervisor gave up: {self.supervisor.gave_up}"
        return None

    # ------------------------------------------------------------------ the workload

    def run_workload(self, name):
        """Run the bundled workload ``name``; returns its Summary."""
        from transport._client import Client

        if name not in WORKLOADS:
            raise DevboxError(f"--workload {name!r}: unknown; bundled: {', '.join(WORKLOADS)}")
        client = Client(self.config, key=CLIENT_KEY, timeout=10.0)
        try:
            wl = WORKLOADS[name](client, self.cpus * 1000, self.dir / "pool-pids.txt",
                                 self.console)
            return wl.run()
        except (ShardTimeout, ShardError) as exc:
            raise WorkloadFailed(f"{exc} (logs in {self.logs})") from None
        finally:
            client.close()

    # ------------------------------------------------------------------ stop

    def stop(self):
        """Stop the worker (drain), then the supervisor and its shards; each bounded."""
        problems = []
        if self.worker is not None and self.worker.poll() is None:
            self.worker.send_signal(signal.SIGTERM)
            try:
                rc = self.worker.wait(_WORKER_STOP_S)
            except subprocess.TimeoutExpired:
                self.worker.kill()
                rc = self.worker.wait(5.0)
                problems.append(f"the worker did not stop within {_WORKER_STOP_S:g}s "
                                f"(killed)")
            if rc not in (0, None) and not problems:
                problems.append(f"the worker exited with code {rc} on stop")
        if self.supervisor is not None:
            self.supervisor.request_stop()
            if self._monitor is not None:
                self._monitor.join(self.supervisor.stop_timeout + 10.0)
            code = self.supervisor.close()
            if code != 0:
                problems.append(f"a shard did not stop cleanly (log "
                                f"{self.logs / 'shards.log'})")
        self._leave_no_strays()
        if self._shard_log is not None:
            self._shard_log.close()
        if self._log_handler is not None:
            root = logging.getLogger("leasehold")
            root.removeHandler(self._log_handler)
            root.propagate = True
            self._log_handler.close()
        if self.temporary and not self.keep and not self.failed and not problems:
            shutil.rmtree(self.dir, ignore_errors=True)
        return problems

    def _leave_no_strays(self):
        """After the ordered stop nothing of the devbox should run; whatever still runs
        below this process (a shard or worker that ignored its signals) is killed, and
        logged: a devbox leaves no processes behind."""
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                log.error("devbox: pid %d (%s) still running after the stop: killed",
                          child.pid, " ".join(child.cmdline()))
                child.kill()


def _kept(box):
    return f"; directory kept: {box.dir}" if box.temporary and box.dir.exists() else ""


def run_devbox(directory=None, workload="example", keep=False):
    """``leasehold devbox``: start, run ``workload`` (None: serve until Ctrl-C/SIGTERM),
    print the summary, stop; returns the exit code."""
    if workload is not None and workload not in WORKLOADS:
        raise SpecError(f"--workload {workload!r}: unknown; bundled: {', '.join(WORKLOADS)}")
    console = Console(soft_wrap=True)
    box = Devbox(directory, keep=keep, console=console)

    def on_term(signum, frame):
        raise KeyboardInterrupt
    old = signal.signal(signal.SIGTERM, on_term)
    old_int = signal.getsignal(signal.SIGINT)
    summary = None
    try:
        try:
            box.prepare()
            box.start()
            console.print(f"devbox ready in {box.ready_s:.2f}s: shard "
                          f"{box.config.transport.endpoints[0]}, worker {WORKER} registered, "
                          f"metrics {box.supervisor.metrics.url}; directory {box.dir}",
                          highlight=False)
            if workload is None:
                console.print(f"config {box.config_path}; client key {CLIENT_KEY} (tenant "
                              f"devbox), admin key devbox-admin; Ctrl-C stops", highlight=False)
                while (problem := box.problem()) is None:
                    time.sleep(_WATCH_S)
                raise DevboxError(f"{problem}; stopped the rest")    # (+ directory kept)
            summary = box.run_workload(workload)
            box.failed = not summary.ok         # keep the directory: its logs say why
        except KeyboardInterrupt:
            if workload is not None:
                box.failed = True
                raise DevboxError(f"interrupted{_kept(box)}") from None
        except LeaseholdError as exc:
            box.failed = True
            err = DevboxError(f"{exc}{_kept(box)}")
            err.code = exc.code
            raise err from None
        except Exception as exc:    # a bug: its traceback goes to a file, not the terminal
            box.failed = True
            where = box.logs / "devbox-error.log" if box.logs.is_dir() else None
            if where is not None:
                where.write_text(traceback.format_exc())
            err = DevboxError(f"internal error: {type(exc).__name__}: {exc}"
                              f"{f' (traceback in {where})' if where else ''}{_kept(box)}")
            err.code = "INTERNAL"
            raise err from None
        finally:
            # The ordered stop is not interrupted by a second Ctrl-C (each step is bounded).
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            try:
                problems = box.stop()
            finally:
                signal.signal(signal.SIGINT, old_int)
        if summary is not None:
            for line in summary.lines():
                console.print(line, highlight=False)
            if not summary.ok:
                raise WorkloadFailed(f"not every action succeeded ({summary.outcomes}); "
                                     f"logs in {box.logs}")
        if problems:
            raise DevboxError("; ".join(problems))
        console.print("devbox: stopped the worker, the shard and the supervisor", highlight=False)
        return 0
    finally:
        signal.signal(signal.SIGTERM, old)
        signal.signal(signal.SIGINT, old_int)
