"""The shard's committer: group commits on a thread of their own, so the decision thread
decides turn N+1 while turn N syncs (``docs/shard.md``, "Pipelined commits").

The decision thread runs each loop turn as an engine ``deferred_turn`` and hands its
:class:`~engine.Group` to :meth:`Committer.submit` with the turn's outbox (answers, lease
pushes, watch events). This thread writes ``group.batch`` with the store's ``commit`` (LMDB
releases the GIL while it syncs) and posts the outcome; the decision thread takes outcomes
in order from :meth:`Committer.done` (its poller wakes on :attr:`Committer.fd`), settles each
group with the engine (``Engine.settle``) and only then sends that turn's outbox. So nothing
leaves before its own commit returned, and turns leave in the order they were decided.

Only the store's I/O crosses threads; the engine's memory is touched by the decision thread
alone. Every call on the store goes through :class:`CommitterStore`, which holds one lock
around each one that writes, so the decision thread's own writes (claim renewals, a regrow
after a full map) never overlap a commit; reads run at once. After a failed commit the
committer writes nothing more: every group submitted after it comes back ``skipped``, and
the engine (which discarded them with the failed one) restores its memory from the store
only once the committer is idle (:meth:`CommitterStore.quiesce`), so it reads what the store
will keep.
"""

import collections
import os
import threading
import time

__all__ = ["Committer", "CommitterStore"]

_READS = frozenset({"get", "get_many", "scan_range", "scan", "scan_fixed"})


class CommitterStore:
    """The engine's store in a pipelined shard: every call is serialised with the
    committer's commits by one lock; commits are counted and timed for the status. The
    engine sees the store's whole interface."""

    def __init__(self, store, on_commit):
        self._inner = store
        self._lock = threading.Lock()
        self._on_commit = on_commit     # (ns, ok) of each non-empty commit, any thread
        self._committer = None

    def commit(self, batch):
        """Commit ``batch`` (under the lock); the engine's own synchronous writes come
        here too (a group written again after its store grew)."""
        with self._lock:
            return self._commit(batch)

    def _commit(self, batch):
        t0 = time.perf_counter_ns()
        try:
            out = self._inner.commit(batch)
        except BaseException:
            self._on_commit(time.perf_counter_ns() - t0, False)
            raise
        self._on_commit(time.perf_counter_ns() - t0, True)
        return out

    def quiesce(self, timeout=60.0):
        """Wait until the committer has finished or skipped everything submitted (the
        engine calls it before it reads the store to restore its memory)."""
        if self._committer is not None:
            self._committer.wait_idle(timeout)

    def __getattr__(self, name):
        # Called for what this class does not define, after the normal lookup failed
        # (which formats an AttributeError first): a method is resolved once and kept on
        # the instance (the engine calls several a loop turn), a value is read each time.
        value = getattr(self._inner, name)
        if not callable(value):
            return value
        if name in _READS:
            # Reads are not serialised with commits: an LMDB reader never waits for the
            # writer and sees committed groups only. What a group in commit writes, the
            # engine reads from its own memory (engine/_retain.py, _unwritten_retained).
            self.__dict__[name] = value
            return value
        lock = self._lock

        def locked(*args, **kw):
            with lock:
                return value(*args, **kw)
        self.__dict__[name] = locked
        return locked


class _Job:
    __slots__ = ("group", "outbox", "error", "skipped", "written")

    def __init__(self, group, outbox):
        self.group = group
        self.outbox = outbox
        self.error = None           # the exception the commit raised
        self.skipped = False        # not written: an earlier commit failed, or discarded
        # Its batch is in the store (a group the engine discarded while it was written is
        # still there once the engine's restore has read the store back).
        self.written = False


class Committer:
    """One thread writing submitted groups in order (see the module text).

    ``submit(group, outbox)`` queues a pending group; ``done()`` returns the finished jobs
    in submission order (each with ``group``, ``outbox``, ``error``, ``skipped``);
    :attr:`fd` becomes readable when a job finished. After a failed commit every later
    job is skipped until :meth:`resume`."""

    def __init__(self, store, name="committer"):
        if not isinstance(store, CommitterStore):
            raise TypeError("Committer needs a CommitterStore")
        self._store = store
        store._committer = self
        self._cv = threading.Condition()
        self._todo = collections.deque()
        self._done = collections.deque()
        self._busy = False
        self._failed = False
        self._closing = False
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def fd(self):
        """A descriptor readable while finished jobs wait in :meth:`done`."""
        return self._rfd

    def submit(self, group, outbox):
        """Queue ``group`` (pending, its ``batch`` encoded) with the turn's ``outbox``."""
        job = _Job(group, outbox)
        with self._cv:
            if self._closing:
                raise RuntimeError("the committer is closed")
            self._todo.append(job)
            self._cv.notify_all()
        return job

    def done(self):
        """The jobs finished since the last call, in submission order."""
        try:
            os.read(self._rfd, 4096)
        except BlockingIOError:
            pass
        out = []
        with self._cv:
            while self._done:
                out.append(self._done.popleft())
        return out

    def wait(self, timeout):
        """Block until a finished job waits in :meth:`done` or ``timeout`` seconds pass."""
        with self._cv:
            if not self._done:
                self._cv.wait_for(lambda: self._done, timeout)
            return bool(self._done)

    def wait_idle(self, timeout):
        """Block until nothing is queued or being written (finished jobs may wait)."""
        with self._cv:
            if not self._cv.wait_for(lambda: not self._todo and not self._busy, timeout):
                raise TimeoutError(f"the committer is still busy after {timeout}s")

    def resume(self):
        """Write again after a failure (the engine restored its memory; every job
        submitted before was skipped and taken back)."""
        with self._cv:
            self._failed = False

    def close(self, timeout=60.0):
        """Finish what was submitted, then stop the thread."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(timeout)
        os.close(self._rfd)
        os.close(self._wfd)

    def _run(self):
        store = self._store
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._todo or self._closing)
                if not self._todo:
                    return
                job = self._todo.popleft()
                self._busy = True
            group = job.group
            # A group the engine discarded before this point is never written; one
            # discarded while it is written is in the store when the engine reads it back
            # (its restore waits for quiesce), so memory and store agree either way.
            with store._lock:
                batch = group.batch         # read once: a discard sets it None meanwhile
                if self._failed or group.state != "pending":
                    job.skipped = True
                elif batch:
                    try:
                        store._commit(batch)     # timed and counted there
                        job.written = True
                    except BaseException as exc:    # handed to the decision thread
                        job.error = exc
                        self._failed = True
            with self._cv:
                self._busy = False
                self._done.append(job)
                self._cv.notify_all()
            try:
                os.write(self._wfd, b"x")
            except BlockingIOError:
                pass        # the pipe is full: the decision thread is already woken
