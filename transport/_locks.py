"""Process locks of a store directory, and who holds a store.

A ``leasehold serve`` holds ``<storage.path>/supervisor.lock`` and each ``leasehold shard``
holds ``shard.lock`` in its own store directory, with ``flock`` for as long as the process
lives: the kernel drops the lock of a process that died, however it died, so a crash never
leaves one held and no pid has to be judged. The file names its holder (role, pid, host,
config, start time) for the refusal a second process gets.

A store's partition claim names a pid too, but a pid outlives its process as a number: once
the holder is gone another process may get it. So a live claim on this host counts as held
only while that pid has the store's data file open (:func:`holds_store`).
"""

import datetime
import errno
import fcntl
import json
import os
import socket
from pathlib import Path

import psutil

from engine._errors import LeaseholdError
from storage._lmdb import data_file

__all__ = ["LockHeld", "SHARD_LOCK_NAME", "SUPERVISOR_LOCK_NAME", "hold_lock", "lock_holder",
           "holds_store"]

#: The lock file a ``leasehold shard`` process holds in its store directory.
SHARD_LOCK_NAME = "shard.lock"
#: The lock file a ``leasehold serve`` process holds under ``storage.path``.
SUPERVISOR_LOCK_NAME = "supervisor.lock"


class LockHeld(LeaseholdError):
    """A lock file is held by a live process (the message names it), or cannot be taken."""

    code = "UNAVAILABLE"


def hold_lock(base, name, role, config_path):
    """Lock ``base/name`` (``flock``, made if needed) for as long as this process lives or
    until the returned descriptor is closed, and write who holds it there. A lock held by a
    live process raises :class:`LockHeld` naming it."""
    base = Path(base)
    base.mkdir(parents=True, exist_ok=True)
    path = base / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = _describe(fd, role)
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise LockHeld(f"store {base}: cannot lock {path}: {exc.strerror}") from None
        raise LockHeld(f"store {base} is held by {holder}: stop it first (SIGTERM) or use "
                       f"another storage.path") from None
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({
        "role": role, "pid": os.getpid(), "host": socket.gethostname(),
        "config": str(config_path),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }).encode() + b"\n")
    return fd


def lock_holder(base, name, role):
    """Who holds the lock file ``base/name`` now (as :class:`LockHeld` would name it), or
    None when no live process does (or there is no such file). Made for a check before a
    start: the probe takes the lock for an instant, so a process starting at that very
    instant may be refused and must be started again."""
    try:
        fd = os.open(Path(base) / name, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return _describe(fd, role)
            raise
        return None                 # not held (closing drops the probe's shared lock)
    finally:
        os.close(fd)


def holds_store(pid, path):
    """Whether process ``pid`` lives and has the LMDB store at ``path`` open (the data file
    of its partition 0: a store is opened whole). A process this user may not inspect
    counts as holding it (nothing tells otherwise)."""
    data = os.path.realpath(data_file(path, 0))
    try:
        files = psutil.Process(pid).open_files()
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True     # (AccessDenied: another user's process)
    return any(os.path.realpath(f.path) == data for f in files)


def _describe(fd, role):
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 4096).decode() or "{}")
    except (OSError, ValueError):
        info = {}
    if not isinstance(info, dict):
        info = {}
    role = info.get("role", role)
    if not info.get("pid"):
        return f"another {role} (its lock file names no pid yet)"
    return (f"{role} pid {info['pid']} on host {info.get('host', '?')} (config "
            f"{info.get('config', '?')}, started {info.get('started', '?')})")
