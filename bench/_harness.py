"""What the process benches share: a free port, stopping a process, waiting for a shard."""

import socket
import subprocess
import time

__all__ = ["free_port", "stop", "wait_up"]


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
