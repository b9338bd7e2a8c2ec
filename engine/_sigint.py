"""A Ctrl-C the command line never loses.

Python raises ``KeyboardInterrupt`` wherever its main thread is when SIGINT arrives. If that
is a weakref callback or a finalizer (the import system frees its module locks through one,
many times a second while the commands' modules load), the exception is "unraisable": Python
drops it and the command goes on (a ``leasehold status`` interrupted a tenth of a second after
it started waited out its request timeout, a minute). :func:`install` (the command line's
entry point calls it first) hooks the unraisable ones: a dropped ``KeyboardInterrupt`` is not
printed, and a helper thread interrupts the main thread again a moment later, outside the
callback (again if that one is dropped too). Only the standard library: the entry point
imports this before anything heavy.

Some code catches it and goes on: Cython's module set-up registers its memoryview types in a
bare ``try: ... except: pass``, which every extension module with a memoryview runs as it
loads (ours, pyzmq's). :func:`install` counts each SIGINT, and :func:`check`, called by the
command line once it has imported what a command needs, raises ``KeyboardInterrupt`` for one
that arrived and was swallowed (a ``leasehold status`` interrupted so waited out its request
timeout). :func:`stopping` ignores any later one: the command line has handled the Ctrl-C
and is exiting.

Imports are also where a Ctrl-C does damage of its own: a module interrupted half-way can
print (prometheus_client's generated code printed its source on stderr) or leave a lock or
a socket half made. :func:`deferred` holds a Ctrl-C that arrives while a command's modules
load until they have loaded (a fraction of a second), then raises it; a second one is raised
at once.
"""

import _thread
import contextlib
import signal
import sys
import threading
import time

__all__ = ["install", "is_interrupt", "check", "deferred", "stopping", "interrupted",
           "INTERRUPTED"]

#: The exit status of a command stopped by Ctrl-C (a shell's 128 + SIGINT).
INTERRUPTED = 130

#: How long after a dropped ``KeyboardInterrupt`` the main thread is interrupted again (out
#: of the callback that dropped it by then).
AGAIN_S = 0.01

_dropped = threading.Event()
_hook = sys.__unraisablehook__
_received = 0       # SIGINTs received since install()
_deferred_from = None   # _received as the outermost deferred() block began; None: none


def install():
    """Raise again, in the main thread, each ``KeyboardInterrupt`` Python drops in a
    callback or finalizer (and do not print it). Call once, from the main thread."""
    global _hook
    if sys.unraisablehook is _unraisable:
        return
    _hook = sys.unraisablehook
    sys.unraisablehook = _unraisable
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        # (Not when SIGINT was ignored, as a job started in the background inherits it.)
        signal.signal(signal.SIGINT, _on_sigint)
    threading.Thread(target=_again, name="leasehold-sigint", daemon=True).start()


def _on_sigint(signum, frame):
    global _received
    _received += 1
    if _deferred_from is not None and _received == _deferred_from + 1:
        return      # held: raised as the deferred() block ends (a second one: now)
    raise KeyboardInterrupt


@contextlib.contextmanager
def deferred():
    """Hold a Ctrl-C that arrives inside the block until the block ends, then raise it
    (:func:`check`); a second one is raised at once. Only where :func:`install` set the
    handler; elsewhere Python's own raises at once, as always."""
    global _deferred_from
    outer = _deferred_from
    if outer is None:
        _deferred_from = _received
    try:
        yield
    finally:
        _deferred_from = outer
    check()


def check():
    """Raise ``KeyboardInterrupt`` if a Ctrl-C arrived since :func:`install` and the code it
    interrupted swallowed it: call where none can have been handled yet (after imports)."""
    if _received:
        raise KeyboardInterrupt


def stopping():
    """The Ctrl-C was handled and the process exits: ignore SIGINT from now on (a second
    Ctrl-C, or a swallowed one raised again, would interrupt the exit with a traceback).
    Only where :func:`install` set the handler (the command line's own process)."""
    if signal.getsignal(signal.SIGINT) is _on_sigint:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def interrupted():
    """The command line caught a Ctrl-C: :func:`stopping`, its one line on stderr, and the
    exit status to return (:data:`INTERRUPTED`)."""
    stopping()
    print("leasehold: INTERRUPTED: stopped (Ctrl-C)", file=sys.stderr)
    return INTERRUPTED


def _unraisable(unraisable):
    if unraisable.exc_type is KeyboardInterrupt:
        _dropped.set()      # (no raise here: one raised in this hook is dropped too)
        return
    _hook(unraisable)


def _again():
    while True:
        _dropped.wait()
        _dropped.clear()
        time.sleep(AGAIN_S)
        _thread.interrupt_main()    # SIGINT's handler, in the main thread


def is_interrupt(exc):
    """Whether ``exc`` is a Ctrl-C: a ``KeyboardInterrupt``, or an error Python made of one
    (3.11 wraps an exception raised in ``__set_name__`` while a class is created, e.g.
    ``functools.cached_property`` in numpy's ``finfo`` at import, in ``RuntimeError``
    "Error calling __set_name__ ...", the KeyboardInterrupt its ``__cause__``)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__
    return False
