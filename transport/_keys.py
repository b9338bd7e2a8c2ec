"""CURVE key files and the keyring a shard authenticates peers with (``docs/security.md``).

A key pair ``NAME`` is two files in a keys directory, in the ZeroMQ certificate format that
``zmq.auth.load_certificate`` reads: ``NAME.key`` (the public key: hand it to the other side)
and ``NAME.key_secret`` (public and secret key: never leaves its owner; created mode 0600).
``leasehold keys generate`` writes them; :func:`load_keyring` reads the shard's own pair and
every configured peer's public key into a :class:`Keyring` mapping public keys to peers.
"""

import datetime
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

from engine._config import _NAME  # the config's rule for names (a key's too)
from engine._errors import ConfigError
from transport._auth import Peer

__all__ = [
    "PUBLIC_SUFFIX",
    "SECRET_SUFFIX",
    "ClientKeys",
    "Keyring",
    "generate_keypair",
    "load_public_key",
    "load_secret_key",
    "load_keyring",
    "load_client_keys",
]

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"

_BANNER = """#   ****  Generated on {when} by leasehold keys generate  ****
#   ZeroMQ CURVE {what} Certificate
#   {note}

"""
_PUBLIC_NOTE = "Hand this file to the other side of the connection (the shard's config)."
_SECRET_NOTE = "DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions."


def _render(what, note, metadata, public, secret=None):
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    lines = [_BANNER.format(when=when, what=what, note=note), "metadata\n"]
    for key, value in (metadata or {}).items():
        lines.append(f'    {key} = "{value}"\n')
    lines.append("curve\n")
    lines.append(f'    public-key = "{public.decode("ascii")}"\n')
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode("ascii")}"\n')
    return "".join(lines)


def generate_keypair(keys_dir, name, metadata=None, force=False):
    """Make a CURVE key pair ``name`` in ``keys_dir`` (created 0700 if missing) and return
    the paths ``(public file, secret file)``. The secret file is created mode 0600 (never
    readable by others, not even for a moment); an existing pair is kept unless ``force``.
    ``metadata`` (``{key: text}``, e.g. the role) is written into both files, for people."""
    keys_dir = Path(keys_dir)
    keys_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    public_path = keys_dir / f"{name}{PUBLIC_SUFFIX}"
    secret_path = keys_dir / f"{name}{SECRET_SUFFIX}"
    if not force:
        for path in (public_path, secret_path):
            if path.exists():
                raise FileExistsError(f"{path} exists (--force replaces the key pair)")
    for value in (metadata or {}).values():
        if '"' in str(value) or "\n" in str(value):
            raise ValueError(f"metadata value {value!r} may not hold quotes or newlines")
    public, secret = zmq.curve_keypair()
    meta = {"name": name, **(metadata or {})}
    # The secret first, created 0600 atomically: a crash leaves no readable secret behind.
    tmp = secret_path.with_name(secret_path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(_render("**Secret**", _SECRET_NOTE, meta, public, secret))
    os.chmod(tmp, 0o600)        # O_CREAT's mode is cut by the umask, never widened: be sure
    os.replace(tmp, secret_path)
    public_path.write_text(_render("Public", _PUBLIC_NOTE, meta, public))
    return public_path, secret_path


def _check_file(path, what):
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the {what}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{path}: the {what} is not a regular file")
    return mode


def _load(path, what):
    _check_file(path, what)
    try:
        public, secret = zmq.auth.load_certificate(path)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the {what}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ConfigError(f"{path}: not a CURVE certificate: {exc}") from None
    if public is None or len(public) != 40:
        raise ConfigError(f"{path}: no 40-character public-key in the {what}")
    return public, secret


def load_public_key(path):
    """The Z85 public key (40 bytes) in the certificate file ``path``; ConfigError if there
    is none."""
    return _load(path, "public key file")[0]


def load_secret_key(path):
    """``(public, secret)`` (Z85, 40 bytes each) from the secret file ``path``. Refuses a
    file that others may read (mode & 0o077): a secret that leaked is no secret."""
    mode = _check_file(path, "secret key file")
    if mode & 0o077:
        raise ConfigError(f"{path}: the secret key file is readable by others "
                          f"(mode {stat.S_IMODE(mode):04o}); chmod 600 it")
    public, secret = _load(path, "secret key file")
    if secret is None or len(secret) != 40:
        raise ConfigError(f"{path}: no 40-character secret-key (is this the public file?)")
    return public, secret


@dataclass(frozen=True)
class ClientKeys:
    """What a DEALER needs for CURVE: its own pair and the shard's public key (Z85)."""

    public: bytes
    secret: bytes
    server_public: bytes


def load_client_keys(keys_dir, name, server_key):
    """The :class:`ClientKeys` of key pair ``name`` (``KEYS_DIR/NAME.key_secret``) talking
    to the shard whose public key is ``KEYS_DIR/SERVER_KEY.key``."""
    keys_dir = Path(keys_dir)
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", ".."):
        raise ConfigError(f"key {name!r}: not a key name (letters, digits, '_', '.', '-': "
                          f"the file {keys_dir}/NAME{SECRET_SUFFIX})")
    public, secret = load_secret_key(keys_dir / f"{name}{SECRET_SUFFIX}")
    server = load_public_key(keys_dir / f"{server_key}{PUBLIC_SUFFIX}")
    return ClientKeys(public=public, secret=secret, server_public=server)


class Keyring:
    """The shard's own key pair and the peer behind every accepted public key.

    Lookups are by Z85 public key (:meth:`peer_of_key`, what the ZAP handler sees) and by
    key name (:meth:`peer_named`, the User-Id ZAP gives each connection's messages)."""

    __slots__ = ("server_name", "server_public", "server_secret", "_by_key", "_by_name")

    def __init__(self, server_name, server_public, server_secret, peers):
        self.server_name = server_name
        self.server_public = server_public
        self.server_secret = server_secret
        self._by_key = {}
        self._by_name = {}
        for key, peer in peers:
            if key in self._by_key:
                raise ConfigError(f"security.peers: {peer.name} and "
                                  f"{self._by_key[key].name} have the same public key")
            self._by_key[key] = peer
            self._by_name[peer.name] = peer

    def peer_of_key(self, public_z85):
        """The Peer of a Z85 public key (bytes), or None for an unknown key."""
        return self._by_key.get(bytes(public_z85))

    def peer_named(self, name):
        """The Peer of key ``name``, or None."""
        return self._by_name.get(name)

    def __len__(self):
        return len(self._by_key)


def load_keyring(security):
    """The :class:`Keyring` of a config's ``[security]`` table (a SecuritySettings): the
    shard's pair from ``keys_dir/server_key.key_secret`` and each peer's public key (inline
    ``public_key``, else ``keys_dir/NAME.key``). None when ``insecure``. Raises ConfigError
    naming the key or file on any problem, and when no peer is configured (nobody could
    connect; ``insecure = true`` is the explicit way to run without keys)."""
    if security.insecure:
        return None
    keys_dir = Path(security.keys_dir)
    if not security.peers:
        raise ConfigError("security.peers: no keys configured, so nobody could connect; add "
                          "[security.peers.NAME] tables (leasehold keys generate), or set "
                          "security.insecure = true to run without CURVE")
    public, secret = load_secret_key(keys_dir / f"{security.server_key}{SECRET_SUFFIX}")
    peers = []
    for p in security.peers:
        if p.public_key is not None:
            key = p.public_key.encode("ascii")
            try:
                zmq.utils.z85.decode(key)
            except (ValueError, KeyError, IndexError):
                raise ConfigError(f"security.peers.{p.name}.public_key: not a valid Z85 "
                                  f"key") from None
        else:
            try:
                key = load_public_key(keys_dir / f"{p.name}{PUBLIC_SUFFIX}")
            except ConfigError as exc:
                raise ConfigError(f"security.peers.{p.name}: {exc}") from None
        peers.append((key, Peer(role=p.role, name=p.name, cluster=p.cluster,
                                tenants=p.tenants)))
    return Keyring(security.server_key, public, secret, peers)
