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
"""

import _thread
import sys
import threading
import time

__all__ = ["install", "is_interrupt"]

#: How long after a dropped ``KeyboardInterrupt`` the main thread is interrupted again (out
#: of the callback that dropped it by then).
AGAIN_S = 0.01

_dropped = threading.Event()
_hook = sys.__unraisablehook__


def install():
    """Raise again, in the main thread, each ``KeyboardInterrupt`` Python drops in a
    callback or finalizer (and do not print it). Call once, from the main thread."""
    global _hook
    if sys.unraisablehook is _unraisable:
        return
    _hook = sys.unraisablehook
    sys.unraisablehook = _unraisable
    threading.Thread(target=_again, name="leasehold-sigint", daemon=True).start()


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
