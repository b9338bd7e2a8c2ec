"""A process of the ``python`` plugin's warm pool (``transport/_pool.py``, ``docs/plugins.md``).

Run as ``python <this file> <request fd> <result fd> <progress fd> <concurrency>`` (by
path, not ``-m``: importing the ``transport`` package would load ZeroMQ and numpy, some
30 MB of resident memory charged to every pool process and its memory limit). It reads
length-prefixed msgpack frames from the request pipe and runs each call on a thread of its
own (threads are kept and reused: a follow-on call starts no thread unless every kept one is
busy); the parent bounds how many run at once (``concurrency``). With a concurrency of 1 the
one call thread reads the request pipe itself and runs what it reads (no other call can
arrive while it runs), so a call wakes one thread, not a reader and then a call thread.
It writes back, on the result pipe (which the parent sleeps on):

- ``{"op": "hello", "pid": pid}`` once, at start;
- ``{"op": "done", "id": n, "ok": True, "started": True}``, or ``"ok": False`` with
  ``"kind"`` (``"import"``: the function cannot be imported; ``"log"``: the log cannot be
  opened; ``"raise"``: the call raised), ``"type"``, ``"message"`` and ``"tail"`` (the
  traceback's last lines), and ``"started": True`` when the function was imported and
  called;

and on the progress pipe (which the parent reads when it reads the result pipe, or when a
call has run a few milliseconds without an outcome: writing there wakes nobody):

- ``{"op": "started", "id": n}`` when call ``n``'s function is imported and about to run.

Imported functions are cached: a follow-on call of the same function imports nothing. Output
a call prints (``sys.stdout``, ``sys.stderr``) goes to that call's log, chosen per thread;
what other threads print, or what is written to descriptors 1 and 2 directly (C code,
subprocesses), goes to the process's own output. End of file on the request pipe ends the
process.

This file imports nothing of Leasehold, only the standard library and msgpack.
"""

import collections
import importlib
import io
import os
import sys
import threading
import traceback

import msgpack

TAIL_LINES = 12
TAIL_BYTES = 2048
REPR_CHARS = 500


class _Router(io.TextIOBase):
    """``sys.stdout`` / ``sys.stderr`` of the pool process: writes go to the log of the call
    the writing thread runs, else to the original stream."""

    def __init__(self, default):
        self._default = default
        self._local = threading.local()

    def bind(self, stream):
        self._local.stream = stream

    def unbind(self):
        self._local.stream = None

    def _target(self):
        return getattr(self._local, "stream", None) or self._default

    def write(self, s):
        return self._target().write(s)

    def flush(self):
        self._target().flush()

    def fileno(self):
        return self._target().fileno()

    def isatty(self):
        return False

    def writable(self):
        return True

    @property
    def encoding(self):
        return getattr(self._target(), "encoding", "utf-8")

    def __getattr__(self, name):
        # What a text stream has beyond TextIOBase (buffer, line_buffering, reconfigure...):
        # the target's. Never for private names (those of this object: no recursion).
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._target(), name)


class _Child:
    def __init__(self, rfd, wfd, pfd=None, concurrency=0):
        self.rfd = rfd
        self.wfd = wfd
        self.pfd = wfd if pfd is None else pfd
        self.concurrency = concurrency
        self.pid = os.getpid()
        self._inbuf = bytearray()
        self.write_lock = threading.Lock()
        self.import_lock = threading.Lock()
        self.functions = {}
        self.stdout = _Router(sys.stdout)
        self.stderr = _Router(sys.stderr)
        # Calls waiting for a thread; threads kept, and how many of them run a call.
        self._calls = collections.deque()
        self._ready = threading.Condition()
        self._threads = self._busy = 0

    def send(self, msg, fd=None):
        data = msgpack.packb(msg)
        frame = len(data).to_bytes(4, "big") + data
        with self.write_lock:
            view = memoryview(frame)
            while view:
                n = os.write(self.wfd if fd is None else fd, view)
                view = view[n:]

    def read_frame(self):
        """The next request frame's body, or None at end of file (one read a frame, most
        often: whatever the pipe holds is read at once and kept)."""
        buf = self._inbuf
        while True:
            if len(buf) >= 4:
                n = int.from_bytes(buf[:4], "big")
                if len(buf) >= 4 + n:
                    body = bytes(buf[4:4 + n])
                    del buf[:4 + n]
                    return body
            chunk = os.read(self.rfd, 65536)
            if not chunk:
                return None
            buf += chunk

    def resolve(self, spec):
        fn = self.functions.get(spec)
        if fn is not None:
            return fn
        with self.import_lock:
            fn = self.functions.get(spec)
            if fn is None:
                module, _, name = spec.partition(":")
                fn = getattr(importlib.import_module(module), name)
                if not callable(fn):
                    raise TypeError(f"{spec} is not callable ({type(fn).__name__})")
                self.functions[spec] = fn
        return fn

    def run(self):
        self.send({"op": "hello", "pid": self.pid})
        if self.concurrency == 1:
            # One call at a time: the call thread reads, runs, answers; this thread waits.
            self._threads = 1
            threading.Thread(target=self._serve_inline, daemon=True, name="call").start()
            threading.Event().wait()
        while True:
            body = self.read_frame()
            if body is None:
                break
            msg = msgpack.unpackb(body)
            if msg.get("op") == "call":
                self._dispatch(msg)
        # The parent closed the pipe: it frees the pool (no call runs) or is gone (calls
        # that still run have no one to report to). Either way, end now.
        os._exit(0)

    def _serve_inline(self):
        while True:
            body = self.read_frame()
            if body is None:
                os._exit(0)         # as run(): the pool is freed, or the parent is gone
            msg = msgpack.unpackb(body)
            if msg.get("op") != "call":
                continue
            try:
                done = self.call(msg)
            except BaseException as exc:    # its log could not be written: a done still
                done = {"op": "done", "id": msg["id"], "ok": False, "kind": "log",
                        "type": type(exc).__name__, "message": str(exc), "tail": ""}
            try:
                self.send(done)
            except OSError:         # the parent is gone
                os._exit(0)

    def _dispatch(self, msg):
        # To a kept thread that is free, else to a new one (kept afterwards): as many
        # threads as calls ever ran at once, each started once. A thread counts as free
        # before its call's "done" leaves, so the parent's next call finds it free.
        with self._ready:
            self._calls.append(msg)
            if len(self._calls) + self._busy <= self._threads:
                self._ready.notify()
                return
            self._threads += 1
        threading.Thread(target=self._serve, daemon=True, name="call").start()

    def _serve(self):
        while True:
            with self._ready:
                while not self._calls:
                    self._ready.wait()
                msg = self._calls.popleft()
                self._busy += 1
            try:
                done = self.call(msg)
            except BaseException as exc:    # its log could not be written: a done still
                done = {"op": "done", "id": msg["id"], "ok": False, "kind": "log",
                        "type": type(exc).__name__, "message": str(exc), "tail": ""}
            with self._ready:
                self._busy -= 1
            try:
                self.send(done)
            except OSError:         # the parent is gone: this process ends at end of file
                with self._ready:
                    self._threads -= 1
                return

    def call(self, msg):
        """Run one call (its output to its log); returns its ``done`` message, sent by the
        caller once the log is closed."""
        cid = msg["id"]
        try:
            logf = open(msg["log"], "a", buffering=1, encoding="utf-8", errors="replace")
        except OSError as exc:
            return {"op": "done", "id": cid, "ok": False, "kind": "log",
                    "type": type(exc).__name__, "message": str(exc), "tail": ""}
        self.stdout.bind(logf)
        self.stderr.bind(logf)
        try:
            logf.write(f"leasehold: python pool process pid {self.pid}: {msg['function']} "
                       f"(action {msg['action']}, attempt {msg['attempt']})\n")
            try:
                fn = self.resolve(msg["function"])
            except BaseException as exc:    # reported, never re-raised
                return self._failed(cid, "import", exc, logf)
            # Said where nobody sleeps: a call that ends soon says it with its done.
            self.send({"op": "started", "id": cid}, self.pfd)
            kwargs = dict(msg.get("args") or {})
            if msg.get("input") is not None:
                kwargs["inputs"] = msg["input"]
            try:
                result = fn(**kwargs)
            except BaseException as exc:    # SystemExit in a call fails it too
                done = self._failed(cid, "raise", exc, logf)
                done["started"] = True
                return done
            try:
                text = repr(result)
            except BaseException as exc:    # the value is ignored: its repr may not fail it
                text = f"a {type(result).__name__} (its repr raised {type(exc).__name__})"
            if len(text) > REPR_CHARS:
                text = text[:REPR_CHARS] + "..."
            logf.write(f"leasehold: returned {text}\n")
            return {"op": "done", "id": cid, "ok": True, "started": True}
        finally:
            self.stdout.unbind()
            self.stderr.unbind()
            try:
                logf.close()
            except OSError:
                pass

    def _failed(self, cid, kind, exc, logf):
        tb = exc.__traceback__
        if kind == "raise" and tb is not None and tb.tb_next is not None:
            tb = tb.tb_next         # from the function down: this file's frame says nothing
        lines = traceback.format_exception(type(exc), exc, tb)
        text = "".join(lines)
        try:
            logf.write(text)
        except (OSError, ValueError):
            pass
        tail = "\n".join(text.rstrip("\n").splitlines()[-TAIL_LINES:])[-TAIL_BYTES:]
        return {"op": "done", "id": cid, "ok": False, "kind": kind,
                "type": type(exc).__qualname__, "message": str(exc), "tail": tail}


def main(argv):
    rfd, wfd = int(argv[1]), int(argv[2])
    pfd = int(argv[3]) if len(argv) > 3 else None
    concurrency = int(argv[4]) if len(argv) > 4 else 0
    # Run by path, sys.path[0] is this file's directory: make it the working directory, as
    # under ``python -m``, so user modules import as they would there (and this package's
    # private modules do not shadow anything).
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") == here:
        sys.path[0] = os.getcwd()
    # The pipes are for this process only: a subprocess or fork a call makes must not hold
    # them open (the parent sees end of file only when every writer is gone).
    for fd in (rfd, wfd, pfd):
        if fd is not None:
            os.set_inheritable(fd, False)
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and hasattr(stream, "reconfigure"):
            # Line by line: the process ends with os._exit, which flushes nothing.
            stream.reconfigure(line_buffering=True)
    child = _Child(rfd, wfd, pfd, concurrency)
    sys.stdout, sys.stderr = child.stdout, child.stderr
    child.run()


if __name__ == "__main__":
    main(sys.argv)
