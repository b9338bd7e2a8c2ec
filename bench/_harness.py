"""What the process benches share: a free port, CPU seconds of a process, stopping one, waiting
for a shard."""

import socket
import subprocess
import sys
import time

__all__ = ["cpu_seconds", "free_port", "round_or_none", "stop", "until", "wait_up"]


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(proc):
    """User + system CPU seconds of ``proc`` (a ``psutil.Process``), every thread."""
    t = proc.cpu_times()
    return t.user + t.system


def stop(proc, timeout=60):
    """SIGTERM ``proc`` and wait; SIGKILL it if it is still there after ``timeout`` s."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_up(client, timeout=30):
    """``client.ping()`` once the shard answers (reconnecting between tries), within
    ``timeout`` seconds, else the last error."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.ping()
        except Exception:
            if time.monotonic() > deadline:
                raise
            client.reconnect()


def until(cond, timeout, what, step=0.005):
    """``cond()``'s first truthy value, polled every ``step`` s for at most ``timeout`` s;
    else the bench exits naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(step)
    raise SystemExit(f"{sys.argv[0]}: timed out after {timeout}s waiting for {what}")


def round_or_none(value, digits):
    """``round(value, digits)``, or None for a figure that does not exist (None)."""
    return None if value is None else round(value, digits)
