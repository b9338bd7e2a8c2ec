"""Security (transport/_keys.py, transport/_auth.py, docs/security.md): CURVE keys on disk,
the ZAP handler that names each connection by its key and refuses unknown ones at the
handshake, and the authorisation of every request by role, over real sockets on loopback
with every wait bounded."""

import logging
import os
import random
import stat
import time
import tomllib

import numpy as np
import pytest
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from engine import ActionSpec, ConfigError, parse_config
from engine.cli import main as cli
from tests.conftest import make_engine
from tests.test_protocol import SAMPLES
from transport import (
    ADMIN,
    CLIENT,
    INSECURE_PEER,
    WORKER,
    Abort,
    Authenticator,
    Bye,
    ClientKeys,
    Enqueue,
    EnqueueFanout,
    Error,
    Explain,
    Heartbeat,
    Peer,
    PermissionDenied,
    Ping,
    ProtocolError,
    QueueMetrics,
    QueueUpdate,
    Refused,
    Register,
    Reply,
    Report,
    Status,
    Unauthenticated,
    Unwatch,
    Watch,
    authorize,
    client_socket,
    decode,
    encode,
    generate_keypair,
    load_client_keys,
    load_keyring,
    load_public_key,
    load_secret_key,
    peer_of,
    recv,
    send,
    server_socket,
    visible_metrics,
)

WAIT = 5.0      # the longest any single wait may take (seconds)


def spec(run="acme/ml/prod/r1", name="a", **kw):
    return {"id": f"{run}/{name}", "task": "t", "resources": {"cpu": 1}, **kw}


@pytest.fixture
def keys(tmp_path):
    """A keys directory: the shard's pair, a configured key of each role, and a stranger."""
    d = tmp_path / "keys"
    for name in ("shard", "east-1", "acme-app", "ml-app", "ops", "stranger"):
        generate_keypair(d, name)
    return d


def config_of(keys_dir, **security):
    data = {"resources": ["cpu"], "clusters": {"east": {}, "west": {}},
            "security": {"keys_dir": str(keys_dir), "server_key": "shard", "peers": {
                "east-1": {"role": "worker", "cluster": "east"},
                "acme-app": {"role": "client", "tenants": ["acme"]},
                "ml-app": {"role": "client", "tenants": ["globex/ml", "initech/x/prod"]},
                "ops": {"role": "admin"},
            }, **security}}
    return parse_config(data, source="<test>")


class Shard:
    """A CURVE ROUTER with its ZAP handler, and client sockets in a context of their own;
    everything is closed in :meth:`close`."""

    def __init__(self, keys_dir, keyring):
        self.keys_dir = keys_dir
        self.keyring = keyring
        self.ctx = zmq.Context()
        self.client_ctx = zmq.Context()
        self.sockets = []
        self.auth = None
        if keyring is not None:
            self.auth = Authenticator(self.ctx, keyring).start()
        self.router = server_socket(self.ctx, "tcp://127.0.0.1:*", keyring, self.auth)
        self.sockets.append(self.router)
        self.endpoint = self.router.last_endpoint.decode()

    def dealer(self, name=None, keys=None, raw=False, connect=True, **opts):
        """A DEALER of key ``name`` (from the keys dir), explicit ``keys``, or plain; a raw
        one left unconnected with ``connect=False`` (to monitor it from its first try)."""
        if name is not None:
            keys = load_client_keys(self.keys_dir, name, "shard")
        if raw:     # no helper: messages queue before the handshake (no ZMQ_IMMEDIATE)
            sock = self.client_ctx.socket(zmq.DEALER)
            sock.linger = 0
            # Once a failed handshake dropped its only pipe a DEALER's send blocks: bounded.
            sock.sndtimeo = 2000
            if keys is not None:
                sock.curve_serverkey = keys.server_public
                sock.curve_publickey = keys.public
                sock.curve_secretkey = keys.secret
            if connect:
                sock.connect(self.endpoint)
        else:
            sock = client_socket(self.client_ctx, self.endpoint, keys)
        self.sockets.append(sock)
        return sock

    def close(self):
        for s in self.sockets:
            s.close(0)
        if self.auth is not None:
            self.auth.stop()
        self.client_ctx.term()
        self.ctx.term()


@pytest.fixture
def shard(keys):
    s = Shard(keys, load_keyring(config_of(keys).security))
    yield s
    s.close()


def send_when_connected(sock, msg):
    """Send ``msg`` once the connection is up (ZMQ_IMMEDIATE: no queueing before it)."""
    deadline = time.monotonic() + WAIT
    while not send(sock, encode(msg)):
        assert time.monotonic() < deadline, "the connection never came up"
        time.sleep(0.005)


def serve_one(shard):
    """What the shard loop does with one message: name the peer, decode, authorise, answer
    (REPLY ok, or ERROR with the code). Returns (peer, decoded message)."""
    frames = recv(shard.router, WAIT)
    assert frames is not None, "nothing arrived"
    routing, body = frames[0], frames[1:]
    peer = peer_of(body[0], shard.keyring)
    msg = None
    try:
        msg = decode(body)
        authorize(peer, msg)
        answer = Reply(rid=getattr(msg, "rid", 0), body={"peer": peer.name})
    except ProtocolError as exc:
        answer = Error(rid=exc.rid, code=exc.code, message=str(exc))
    except PermissionDenied as exc:
        answer = Error(rid=getattr(msg, "rid", None), code=exc.code, message=str(exc))
    assert send(shard.router, encode(answer), routing_id=routing.bytes)
    return peer, msg


def ask(shard, sock, msg):
    """Send a request, let the shard serve it, and return the answer (bounded)."""
    send_when_connected(sock, msg)
    serve_one(shard)
    frames = recv(sock, WAIT)
    assert frames is not None, "no answer"
    return decode(frames)


def denied(answer, text):
    assert isinstance(answer, Error), answer
    assert answer.code == "PERMISSION_DENIED"
    assert text in answer.message, answer.message


# ---------------------------------------------------------------------------------------------
# Keys on disk


def test_generated_keys_are_zeromq_certificates_with_a_private_secret(tmp_path):
    public, secret = generate_keypair(tmp_path / "k", "east-1", metadata={"role": "worker"})
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "k").st_mode) == 0o700
    pub, sec = zmq.auth.load_certificate(secret)
    assert zmq.auth.load_certificate(public) == (pub, None)
    assert zmq.curve_public(sec) == pub         # a real pair
    assert load_public_key(public) == pub and load_secret_key(secret) == (pub, sec)
    assert 'role = "worker"' in public.read_text()
    with pytest.raises(FileExistsError, match=r"east-1.key exists \(--force replaces"):
        generate_keypair(tmp_path / "k", "east-1")
    generate_keypair(tmp_path / "k", "east-1", force=True)
    assert load_public_key(public) != pub


def test_a_secret_readable_by_others_or_a_missing_file_is_refused(tmp_path):
    _public, secret = generate_keypair(tmp_path, "x")
    os.chmod(secret, 0o640)
    with pytest.raises(ConfigError, match=r"readable by others \(mode 0640\); chmod 600"):
        load_secret_key(secret)
    # The system's reason, not pyzmq's "Invalid certificate file".
    with pytest.raises(ConfigError, match="nope.key: cannot read the public key file: No "
                                          "such file or directory$"):
        load_public_key(tmp_path / "nope.key")
    # A directory where the secret should be: not "readable by others ... chmod 600 it".
    (tmp_path / "d.key_secret").mkdir(mode=0o755)
    with pytest.raises(ConfigError, match="d.key_secret: the secret key file is not a "
                                          "regular file$"):
        load_secret_key(tmp_path / "d.key_secret")
    with pytest.raises(ConfigError, match=r"key '\.\./x': not a key name"):
        load_client_keys(tmp_path, "../x", "x")
    with pytest.raises(ConfigError, match="no 40-character secret-key"):
        os.chmod(tmp_path / "x.key", 0o600)
        load_secret_key(tmp_path / "x.key")


def test_the_keyring_maps_each_public_key_to_its_peer(keys):
    ring = load_keyring(config_of(keys).security)
    assert len(ring) == 4
    w = ring.peer_of_key(load_public_key(keys / "east-1.key"))
    assert w == Peer(role=WORKER, name="east-1", cluster="east")
    assert ring.peer_named("acme-app") == Peer(role=CLIENT, name="acme-app", tenants=("acme",))
    assert ring.peer_of_key(load_public_key(keys / "stranger.key")) is None
    assert ring.server_public == load_public_key(keys / "shard.key")


def test_keyring_errors_name_the_key_or_file(keys):
    with pytest.raises(ConfigError, match="no keys configured.*security.insecure = true"):
        load_keyring(parse_config({"resources": ["cpu"], "clusters": {"east": {}}}).security)
    (keys / "ops.key").unlink()
    with pytest.raises(ConfigError, match="^security.peers.ops: .*ops.key: cannot read the "
                                          "public key file: No such file or directory$"):
        load_keyring(config_of(keys).security)
    inline = load_public_key(keys / "stranger.key").decode()
    ring = load_keyring(config_of(keys, peers={"ops": {"role": "admin", "public_key": inline}})
                        .security)
    assert ring.peer_of_key(inline.encode()).name == "ops"
    same = {"a": {"role": "admin", "public_key": inline}, "b": {"role": "admin",
                                                                 "public_key": inline}}
    with pytest.raises(ConfigError, match="each public key under one name"):
        config_of(keys, peers=same)
    assert load_keyring(parse_config({"resources": ["cpu"], "clusters": {"east": {}},
                                      "security": {"insecure": True}}).security) is None


@pytest.mark.parametrize(("security", "text"), [
    ({"peers": {"w": {"role": "worker"}}}, "security.peers.w.cluster: missing"),
    ({"peers": {"w": {"role": "worker", "cluster": "north"}}},
     "security.peers.w.cluster: 'north' is invalid; allowed: a configured cluster (east, west)"),
    ({"peers": {"c": {"role": "client"}}}, "security.peers.c.tenants: None is invalid"),
    ({"peers": {"c": {"role": "client", "tenants": ["a/b/c/d"]}}},
     "security.peers.c.tenants: 'a/b/c/d' is invalid"),
    ({"peers": {"c": {"role": "client", "tenants": ["a"], "cluster": "east"}}},
     "security.peers.c.cluster: 'east' is invalid; allowed: no cluster for a client"),
    ({"peers": {"o": {"role": "admin", "tenants": ["a"]}}}, "security.peers.o.tenants"),
    ({"peers": {"o": {"role": "root"}}},
     "security.peers.o.role: 'root' is invalid; allowed: worker, client, admin"),
    ({"peers": {"o": {}}}, "security.peers.o.role: missing"),
    ({"peers": {"o": {"role": "admin", "public_key": "short"}}},
     "security.peers.o.public_key: 'short' is invalid"),
    ({"peers": {"o": {"role": "admin", "colour": 1}}}, "security.peers.o.colour: unknown key"),
    ({"insecure": "yes"}, "security.insecure: 'yes' is invalid; allowed: true or false"),
    ({"insecure": True, "peers": {"o": {"role": "admin"}}},
     "security.insecure: True is invalid; allowed: false while security.peers are configured"),
    ({"keys": "x"}, "security.keys: unknown key"),
    ({"peers": {"east": {"role": "worker", "cluster": "east"},
                "east.1": {"role": "worker", "cluster": "east"}}},
     "security.peers.east.1: worker key 'east' may register as worker 'east.1'"),
])
def test_security_config_errors_name_the_key(security, text):
    data = {"resources": ["cpu"], "clusters": {"east": {}, "west": {}}, "security": security}
    with pytest.raises(ConfigError) as info:
        parse_config(data, source="leasehold.toml")
    assert str(info.value).startswith("leasehold.toml: ")
    assert text in str(info.value), str(info.value)


def test_the_cli_writes_a_pair_and_prints_its_config(tmp_path, capsys):
    d = tmp_path / "keys"
    assert cli(["keys", "generate", "--dir", str(d), "--name", "shard"]) == 0
    assert cli(["keys", "generate", "--dir", str(d), "--name", "acme-app", "--role", "client",
                "--tenant", "acme", "--tenant", "globex/ml"]) == 0
    assert cli(["keys", "generate", "--dir", str(d), "--name", "east-1", "--role", "worker",
                "--cluster", "east"]) == 0
    out = capsys.readouterr().out
    assert stat.S_IMODE(os.stat(d / "acme-app.key_secret").st_mode) == 0o600
    # What it printed is the config: paste it in and the keys load.
    toml = "\n".join(line for line in out.splitlines()
                     if not line.startswith(("wrote", "#")))
    data = tomllib.loads(toml)
    cfg = parse_config({"resources": ["cpu"], "clusters": {"east": {}}, **data})
    ring = load_keyring(cfg.security)
    assert ring.peer_named("acme-app").tenants == ("acme", "globex/ml")
    assert ring.peer_named("east-1").cluster == "east"
    assert cli(["keys", "generate", "--dir", str(d), "--name", "w", "--role", "worker"]) == 2
    assert "needs --cluster" in capsys.readouterr().err
    assert cli(["keys", "generate", "--dir", str(d), "--name", "shard"]) == 2
    assert "exists" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# The handshake: known keys get a name, others get nothing


def test_each_message_carries_the_user_id_of_its_key(shard):
    for name, role in (("east-1", WORKER), ("acme-app", CLIENT), ("ops", ADMIN)):
        sock = shard.dealer(name)
        send_when_connected(sock, Ping(rid=1))
        frames = recv(shard.router, WAIT)
        assert frames is not None
        assert frames[1].get("User-Id") == name
        assert frames[0].get("User-Id") == name     # the routing id frame carries it too
        peer = peer_of(frames[1], shard.keyring)
        assert (peer.name, peer.role) == (name, role)
    assert shard.auth.accepted == 3 and shard.auth.refused == 0


def wait_for(cond, what):
    deadline = time.monotonic() + WAIT
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def send_raw(sock, frames):
    """Queue ``frames`` on a raw DEALER; a refused handshake may already have dropped its
    pipe, and then nothing can be queued at all (the bounded send times out)."""
    try:
        sock.send_multipart(frames)
    except zmq.Again:
        pass


def handshake_events(sock):
    """Monitor ``sock``; returns a function that collects the events seen so far."""
    mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                  | zmq.EVENT_HANDSHAKE_SUCCEEDED
                                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                  | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    seen = []

    def collect():
        while mon.poll(0):
            seen.append(recv_monitor_message(mon)["event"])
        return seen

    return mon, collect


def test_an_unknown_key_is_refused_at_the_handshake_and_counted(shard, caplog):
    caplog.set_level(logging.WARNING, logger="leasehold.auth")
    stranger = load_client_keys(shard.keys_dir, "stranger", "shard")
    sock = shard.dealer(keys=stranger, raw=True, connect=False)   # queues messages: none
    mon, events = handshake_events(sock)                            # may get through
    sock.connect(shard.endpoint)
    try:
        sock.send_multipart(encode(Ping(rid=1)))
        send_raw(sock, encode(Enqueue(rid=2, specs=[spec()])))
        wait_for(lambda: zmq.EVENT_HANDSHAKE_FAILED_AUTH in events(), "the refused handshake")
        assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in events()
        wait_for(lambda: shard.auth.refused >= 1, "the refusal count")
        assert shard.router.poll(300) == 0           # nothing reached the shard
        assert shard.auth.accepted == 0
        # The ZAP thread logs just after it counts: wait for the record, do not race it.
        wait_for(lambda: any("unknown public key" in r.getMessage() for r in caplog.records),
                 "the refusal log")
        logged = [r for r in caplog.records if "unknown public key" in r.getMessage()]
        assert stranger.public.decode() in logged[0].getMessage()
        # The helper's socket (ZMQ_IMMEDIATE) cannot even queue: send says so at once.
        helper = shard.dealer(keys=stranger)
        time.sleep(0.2)
        assert send(helper, encode(Ping(rid=3))) is False
        assert shard.router.poll(100) == 0
        # A known key on the same shard still works.
        assert isinstance(ask(shard, shard.dealer("acme-app"), Ping(rid=4)), Reply)
    finally:
        sock.disable_monitor()
        mon.close(0)


def test_no_key_or_a_plain_socket_gets_nothing(shard):
    plain = shard.dealer(raw=True, connect=False)    # NULL mechanism against a CURVE server
    # Monitored before it connects: a handshake that fails at once is seen, not missed.
    mon, events = handshake_events(plain)
    plain.connect(shard.endpoint)
    try:
        send_raw(plain, encode(Ping(rid=1)))
        wait_for(lambda: any(e != zmq.EVENT_HANDSHAKE_SUCCEEDED for e in events()),
                 "the failed handshake")
        assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in events()
        # A CURVE client that has the wrong server key never completes the handshake either.
        good = load_client_keys(shard.keys_dir, "acme-app", "shard")
        wrong = ClientKeys(good.public, good.secret, load_public_key(shard.keys_dir / "ops.key"))
        misled = shard.dealer(keys=wrong, raw=True)
        send_raw(misled, encode(Ping(rid=2)))
        assert shard.router.poll(500) == 0
        assert shard.auth.accepted == 0
    finally:
        plain.disable_monitor()
        mon.close(0)


def test_a_curve_server_needs_a_running_authenticator(keys):
    ctx = zmq.Context()
    try:
        ring = load_keyring(config_of(keys).security)
        with pytest.raises(RuntimeError, match="needs a running Authenticator"):
            server_socket(ctx, "tcp://127.0.0.1:*", ring, None)
        auth = Authenticator(ctx, ring)         # made, not started
        with pytest.raises(RuntimeError, match="every key would be accepted"):
            server_socket(ctx, "tcp://127.0.0.1:*", ring, auth)
    finally:
        ctx.term()


def test_insecure_is_explicit_and_loud(keys, caplog):
    caplog.set_level(logging.CRITICAL, logger="leasehold.transport")
    s = Shard(keys, None)
    try:
        assert any("INSECURE" in r.getMessage() for r in caplog.records)
        answer = ask(s, s.dealer(), QueueUpdate(rid=1, queue="q", changes={"priority": 1}))
        assert isinstance(answer, Reply) and answer.body == {"peer": INSECURE_PEER.name}
    finally:
        s.close()


def test_sockets_bound_their_queues_and_never_linger(keys):
    ctx = zmq.Context()
    limits = parse_config({"resources": ["cpu"], "clusters": {"east": {}},
                           "transport": {"hwm": 77, "max_frame_bytes": 2048,
                                         "max_header_bytes": 4096}}).transport
    try:
        router = server_socket(ctx, "tcp://127.0.0.1:*", settings=limits, heartbeat=0.5)
        dealer = client_socket(ctx, router.last_endpoint.decode(), settings=limits,
                               routing_id=b"me")
        try:
            for sock in (router, dealer):
                assert (sock.linger, sock.sndhwm, sock.rcvhwm) == (0, 77, 77)
            assert router.maxmsgsize == 4096
            assert (router.heartbeat_ivl, router.heartbeat_timeout) == (500, 1500)
            assert dealer.immediate == 1 and dealer.routing_id == b"me"
            # ROUTER_MANDATORY: a send to a peer that is not there is refused, not dropped.
            assert send(router, encode(Ping(rid=1)), routing_id=b"nobody") is False
            # A frame past the socket's size limit drops the connection before it is read.
            send_when_connected(dealer, Ping(rid=2))
            assert recv(router, WAIT) is not None
            dealer.send_multipart([b"\x2a", b"x" * 5000])
            assert recv(router, 0.3) is None
        finally:
            router.close(0)
            dealer.close(0)
    finally:
        ctx.term()


def test_a_message_without_user_id_is_unauthenticated(shard):
    with pytest.raises(Unauthenticated, match="no ZAP User-Id"):
        peer_of(zmq.Frame(b"x"), shard.keyring)
    with pytest.raises(Unauthenticated, match="no ZAP User-Id"):
        peer_of(b"x", shard.keyring)


# ---------------------------------------------------------------------------------------------
# Authorisation, each refusal over the wire


def test_a_client_acts_only_for_its_tenants(shard):
    acme = shard.dealer("acme-app")
    assert isinstance(ask(shard, acme, Enqueue(rid=1, specs=[spec()])), Reply)
    denied(ask(shard, acme, Enqueue(rid=2, specs=[spec(), spec("globex/ml/prod/r1")])),
           "ENQUEUE: globex/ml/prod/r1/a is outside the tenants of key 'acme-app' (acme)")
    # A parent in another tenant is someone else's run too.
    denied(ask(shard, acme, Enqueue(rid=3, specs=[spec(parent="globex/ml/prod/r1/root")])),
           "globex/ml/prod/r1/root is outside")
    denied(ask(shard, acme, EnqueueFanout(rid=4, template=spec("acme2/x/y/r"), names=["a"])),
           "acme2/x/y/r/a is outside")         # a prefix is whole segments: acme is not acme2
    for msg in (Abort(rid=5, action="globex/ml/prod/r1/a"),
                Status(rid=6, actions=["acme/p/d/r/a", "globex/ml/prod/r1/a"]),
                Explain(rid=7, action="globex/ml/prod/r1/a"),
                Watch(rid=8, run="globex/ml/prod/r1"), Unwatch(rid=9, run="globex/ml/prod/r1")):
        answer = ask(shard, acme, msg)
        denied(answer, "is outside the tenants of key 'acme-app'")
        assert answer.rid == msg.rid
    for msg in (Abort(rid=10, action="acme/p/d/r/a"), Watch(rid=11, run="acme/p/d/r"),
                QueueMetrics(rid=12)):
        assert isinstance(ask(shard, acme, msg), Reply)


def test_tenant_prefixes_are_project_and_domain_deep(shard):
    ml = shard.dealer("ml-app")
    assert isinstance(ask(shard, ml, Watch(rid=1, run="globex/ml/prod/r")), Reply)
    assert isinstance(ask(shard, ml, Watch(rid=2, run="initech/x/prod/r")), Reply)
    denied(ask(shard, ml, Watch(rid=3, run="globex/web/prod/r")), "globex/web/prod/r")
    denied(ask(shard, ml, Watch(rid=4, run="initech/x/dev/r")), "initech/x/dev/r")


def test_a_queue_update_needs_an_admin(shard):
    update = QueueUpdate(rid=1, queue="gpu", changes={"priority": 900})
    denied(ask(shard, shard.dealer("acme-app"), update), "queue changes need an admin key")
    denied(ask(shard, shard.dealer("east-1"), update), "is a worker key")
    assert isinstance(ask(shard, shard.dealer("ops"), update), Reply)


def test_a_worker_registers_only_for_its_cluster_and_as_itself(shard):
    w = shard.dealer("east-1")
    denied(ask(shard, w, Register(rid=1, worker="east-1", cluster="west", slots=8)),
           "key 'east-1' is bound to cluster east, not west")
    denied(ask(shard, w, Register(rid=2, worker="west-9", cluster="east", slots=8)),
           "may register as worker 'east-1' or east-1.<suffix>, not 'west-9'")
    assert isinstance(ask(shard, w, Register(rid=3, worker="east-1", cluster="east", slots=8)),
                      Reply)
    assert isinstance(ask(shard, w, Register(rid=4, worker="east-1.node7", cluster="east",
                                             slots=8)), Reply)
    tokens = np.zeros((2, 3), np.uint64)
    for msg in (Heartbeat(rid=5, tokens=tokens),
                Report(rid=6, tokens=tokens, phases=np.zeros(2, np.uint8)), Bye(rid=7)):
        assert isinstance(ask(shard, w, msg), Reply)


def test_roles_stay_in_their_lane(shard):
    denied(ask(shard, shard.dealer("east-1"), Enqueue(rid=1, specs=[spec()])),
           "only client and admin keys may send it")
    for name in ("acme-app", "ops"):
        denied(ask(shard, shard.dealer(name), Register(rid=2, worker="x", cluster="east",
                                                       slots=1)),
               "only worker keys may send it")
    denied(ask(shard, shard.dealer("ops"), Refused(rid=3, tokens=np.zeros((0, 3), np.uint64),
                                                   verdicts=np.zeros(0, np.uint8))),
           "REFUSED is sent by a shard, not to one")
    # An admin acts for every tenant.
    ops = shard.dealer("ops")
    assert isinstance(ask(shard, ops, Abort(rid=4, action="globex/ml/prod/r1/a")), Reply)


def test_authorize_and_owns_without_sockets():
    client = Peer(role=CLIENT, name="c", tenants=("acme", "globex/ml"))
    assert client.owns("acme/p/d/r/a") and client.owns("acme/p/d/r")
    assert client.owns("globex/ml/dev/r/a") and not client.owns("globex/web/dev/r/a")
    assert not client.owns("acme2/p/d/r/a") and not client.owns("acm/p/d/r/a")
    worker = Peer(role=WORKER, name="w", cluster="east")
    assert not worker.owns("acme/p/d/r/a")
    assert Peer(role=ADMIN, name="o").owns("anyone/p/d/r")
    with pytest.raises(PermissionDenied):
        authorize(worker, Status(rid=1, actions=["acme/p/d/r/a"]))
    with pytest.raises(PermissionDenied, match="key 'o' is an admin key; only worker keys"):
        authorize(Peer(role=ADMIN, name="o"), Bye(rid=1))
    authorize(client, Status(rid=1, actions=["acme/p/d/r/a"]))
    for peer in (client, worker, Peer(role=ADMIN, name="o"), INSECURE_PEER):
        authorize(peer, Ping(rid=1))


def test_queue_metrics_hide_a_blocked_head_of_another_tenant():
    eng, clock = make_engine({"resources": ["cpu"],
                              "clusters": {"east": {"capacity": {"cpu": 4}}},
                              "queues": {"q": {"scheduling": "STRICT_FIFO"}},
                              "engine": {"default_queue": "q"}})
    try:
        eng.enqueue(ActionSpec(id="globex/ml/prod/r/big", task="t", resources={"cpu": 4}))
        eng.enqueue(ActionSpec(id="globex/ml/prod/r/next", task="t", resources={"cpu": 4}))
        clock.advance(1)
        eng.schedule()
        metrics = eng.queue_metrics()
        assert metrics["q"]["head_blocked"]["action"] == "globex/ml/prod/r/next"
        acme = Peer(role=CLIENT, name="acme-app", tenants=("acme",))
        seen = visible_metrics(acme, metrics)["q"]
        assert seen["head_blocked"]["action"] is None and seen["head_blocked"]["reason"] is None
        assert seen["head_blocked"]["code"] == metrics["q"]["head_blocked"]["code"]
        assert seen["depth"] == metrics["q"]["depth"] == 1
        assert metrics["q"]["head_blocked"]["action"] is not None     # the input is untouched
        ml = Peer(role=CLIENT, name="ml-app", tenants=("globex/ml",))
        assert visible_metrics(ml, eng.queue_metrics("q")) == eng.queue_metrics("q")
        assert visible_metrics(Peer(role=ADMIN, name="ops"), metrics) == metrics
    finally:
        eng.close()


def mutate(rng, frames):
    """One to three random byte or frame mutations of a valid message."""
    frames = list(frames)
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(frames))
        f = bytearray(frames[i])
        op = rng.choice(("flip", "cut", "grow", "drop", "dup", "junk"))
        if op == "flip" and f:
            f[rng.randrange(len(f))] ^= 1 << rng.randrange(8)
        elif op == "cut" and f:
            f = f[:rng.randrange(len(f))]
        elif op == "grow":
            f += rng.randbytes(rng.randint(1, 16))
        elif op == "drop" and len(frames) > 1:
            frames.pop(i)
            continue
        elif op == "dup":
            frames.insert(i, bytes(f))
        elif op == "junk":
            f = bytearray(rng.randbytes(rng.randint(0, 40)))
        frames[i] = bytes(f)
    return frames


def test_mutated_messages_over_curve_are_each_answered_and_the_shard_serves_on(shard):
    """2,000 mutated valid messages of every type through a real CURVE connection: each is
    answered (an ERROR naming what was wrong, or a REPLY when the mutation left it valid),
    nothing raises, and a well-formed request is served afterwards."""
    rng = random.Random(10)
    sock = shard.dealer("ops")
    send_when_connected(sock, Ping(rid=0))
    serve_one(shard)
    assert recv(sock, WAIT) is not None
    wire = [[bytes(memoryview(f).cast("B")) for f in encode(m)] for m in SAMPLES]
    codes = {}
    for _ in range(2000):
        frames = mutate(rng, rng.choice(wire))
        assert send(sock, frames)
        serve_one(shard)
        answer = decode(recv(sock, WAIT))
        key = answer.code if isinstance(answer, Error) else "REPLY"
        codes[key] = codes.get(key, 0) + 1
    assert set(codes) <= {"BAD_VERSION", "UNKNOWN_TYPE", "TOO_LARGE", "BAD_MESSAGE",
                          "PERMISSION_DENIED", "REPLY"}
    assert codes.get("BAD_MESSAGE", 0) > 500        # most mutations break the message
    assert isinstance(ask(shard, sock, Ping(rid=99)), Reply)
