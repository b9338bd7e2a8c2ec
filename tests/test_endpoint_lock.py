"""An ``ipc://`` endpoint belongs to one live process (transport/_sockets.py): libzmq's bind
unlinks the socket file and binds anew, so a second ``leasehold shard`` on the endpoint of a
live one used to take its socket over in silence. Now the second refuses, naming the
endpoint and the holder, and the first keeps serving; a shard killed outright leaves files
that do not block its restart (by hand or by the supervisor). Real processes on temporary
ipc paths; every wait is bounded, every process stopped at the end."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from engine._config import TransportSettings
from tests.conftest import until
from transport import Client, server_socket

ROOT = Path(__file__).resolve().parent.parent


def _config(tmp, name, endpoint):
    """An insecure one-shard config named ``name``, its store and status of its own."""
    path = tmp / f"{name}.toml"
    path.write_text(f'resources = ["cpu"]\n[clusters.a]\n[queues.q]\n'
                    f'[engine]\ndefault_queue = "q"\n'
                    f'[storage]\npath = "{tmp / name}"\nshard = "{name}"\nsync = false\n'
                    f'[transport]\nendpoints = ["{endpoint}"]\n'
                    f'[status]\ndir = "{tmp / name}-run"\nmetrics = false\n'
                    f'[security]\ninsecure = true\n')
    return path


class Procs:
    def __init__(self, tmp):
        self.tmp = tmp
        self.procs = []

    def start(self, *args):
        log = open(self.tmp / f"p{len(self.procs)}.log", "w+")
        proc = subprocess.Popen([sys.executable, "-m", "engine.cli", *map(str, args)],
                                env={**os.environ, "PYTHONPATH": str(ROOT),
                                     "LEASEHOLD_TRACEBACK": ""},
                                stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp,
                                start_new_session=True)
        proc.log = log
        self.procs.append(proc)
        return proc

    @staticmethod
    def output(proc):
        proc.log.seek(0)
        return proc.log.read()

    def close(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
            proc.log.close()


@pytest.fixture
def procs(tmp_path):
    p = Procs(tmp_path)
    yield p
    p.close()


def _answers(endpoint):
    """The name of the shard answering PING on ``endpoint`` (its storage.shard), or None
    when none answers within 1 s."""
    c = Client(endpoint=endpoint, timeout=1.0)
    try:
        return c.ping()["shard"].split("@")[0]
    except Exception:
        return None
    finally:
        c.close()


def test_a_second_shard_on_a_live_ipc_endpoint_refuses_and_the_first_keeps_it(tmp_path, procs):
    endpoint = f"ipc://{tmp_path}/shard.sock"
    first = procs.start("shard", "--config", _config(tmp_path, "alpha", endpoint))
    until(lambda: _answers(endpoint) == "alpha", 60, "the first shard to serve")
    second = procs.start("shard", "--config", _config(tmp_path, "beta", endpoint))
    second.wait(timeout=60)
    out = procs.output(second)
    lines = [x for x in out.splitlines() if x.strip()]
    assert second.returncode == 2, out
    assert len(lines) == 1 and "Traceback" not in out, out
    assert lines[0].startswith(f"leasehold: UNAVAILABLE: shard beta@{endpoint}: {endpoint}: "
                               f"another process holds it (pid {first.pid}: "), out
    assert f"(lock file {tmp_path}/shard.sock.lock)" in lines[0], out
    # The first still owns its socket: it answers, and is alive.
    assert _answers(endpoint) == "alpha"
    assert first.poll() is None


def test_a_shard_killed_outright_is_restarted_on_its_ipc_endpoint_at_once(tmp_path, procs):
    # SIGKILL leaves the socket file and the lock file behind; neither blocks the restart.
    endpoint = f"ipc://{tmp_path}/shard.sock"
    config = _config(tmp_path, "alpha", endpoint)
    first = procs.start("shard", "--config", config)
    until(lambda: _answers(endpoint) == "alpha", 60, "the shard to serve")
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    assert (tmp_path / "shard.sock").exists() and (tmp_path / "shard.sock.lock").exists()
    again = procs.start("shard", "--config", config)
    until(lambda: _answers(endpoint) == "alpha", 60, "the restarted shard to serve")
    assert again.poll() is None
    # A clean stop removes the lock file it made.
    again.send_signal(signal.SIGTERM)
    assert again.wait(timeout=30) == 0, procs.output(again)
    assert not (tmp_path / "shard.sock.lock").exists()


def test_the_supervisor_restarts_a_killed_shard_on_its_ipc_endpoint(tmp_path, procs):
    endpoint = f"ipc://{tmp_path}/shard.sock"
    config = _config(tmp_path, "alpha", endpoint)
    sup = procs.start("serve", "--config", config)
    until(lambda: "serving 1 shard(s)" in procs.output(sup), 60, "the supervisor to serve")
    assert _answers(endpoint) == "alpha"
    pid = int((tmp_path / "shard.sock.lock").read_text())
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    until(lambda: "serving again" in procs.output(sup), 60, "the shard to be restarted")
    assert _answers(endpoint) == "alpha"
    assert int((tmp_path / "shard.sock.lock").read_text()) != pid
    assert time.monotonic() - t0 < 15
    assert sup.poll() is None, procs.output(sup)


def test_two_sockets_of_one_process_on_one_ipc_endpoint(tmp_path):
    # flock locks belong to the open file, not to the process: a second bind in the same
    # process is refused too, and the endpoint is free again once the first is closed.
    endpoint = f"ipc://{tmp_path}/s.sock"
    ctx = zmq.Context()
    try:
        first = server_socket(ctx, endpoint)
        held = f"this process holds it \\(pid {os.getpid()}: "
        with pytest.raises(zmq.ZMQError, match=held) as info:
            server_socket(ctx, endpoint)
        assert info.value.errno == zmq.EADDRINUSE
        first.close(0)
        assert not (tmp_path / "s.sock.lock").exists()
        # Again and again: libzmq closes the listener on its own thread after close()
        # returns; the lock went at once, and a bind right after found a listener without
        # its lock and was refused (1 in 2 under load, 1 in 10 in a suite run).
        for _ in range(50):
            server_socket(ctx, endpoint).close(0)
    finally:
        ctx.destroy(linger=0)     # closes what a failed assertion left open



def test_an_endpoint_zeromq_cannot_dial_is_unavailable_naming_it(tmp_path):
    # An ipc path past the system's socket path limit: the connect itself fails. It
    # reached a user as "INTERNAL: ZMQError: File name too long".
    from transport import Unreachable

    endpoint = f"ipc://{tmp_path}/{'a' * 200}"
    c = Client(endpoint=endpoint, timeout=1.0)
    try:
        with pytest.raises(Unreachable, match=r"cannot connect: File name too long$") as info:
            c.ping()
        assert info.value.code == "UNAVAILABLE" and endpoint in str(info.value)
    finally:
        c.close()


@pytest.mark.parametrize("host", ["no-such-host.invalid", "10.250.250.250"])
def test_binding_a_host_that_is_not_this_machines_says_so(host):
    # ZeroMQ said "No such device" (an unresolvable name) or "Cannot assign requested
    # address", and the shard passed that on.
    ctx = zmq.Context()
    try:
        with pytest.raises(zmq.ZMQError, match=f"tcp://{host}:7711: '{host}' is not an "
                                               f"address or interface of this machine"):
            server_socket(ctx, f"tcp://{host}:7711", None, None, TransportSettings())
    finally:
        ctx.term()
