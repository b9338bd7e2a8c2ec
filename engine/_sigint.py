"""A Ctrl-C the command line never loses.

Python raises ``KeyboardInterrupt`` wherever its main thread is when SIGINT arrives. If that
is a weakref callback or a finalizer (the import system's module locks are freed through
one, many times a second while the commands' modules load), the exception is reported as
"unraisable" and dropped, and the command went on: a ``leasehold status`` interrupted a
tenth of a second after it started waited out its request timeout (a minute). The
command line installs :func:`install`'s handler, which notes the interrupt before raising
(and keeps Python from printing the one it drops); :func:`check` raises it again where the
command next asks. Only the standard library: the
entry point imports this before anything heavy.
"""

import signal
import sys

__all__ = ["install", "check"]

_interrupted = False


def _handler(signum, frame):
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def install():
    """Handle SIGINT in this process by noting it, then raising ``KeyboardInterrupt``; a
    ``KeyboardInterrupt`` Python then drops as unraisable is not printed (it is noted)."""
    signal.signal(signal.SIGINT, _handler)
    if sys.unraisablehook is not _unraisable:
        global _hook
        _hook = sys.unraisablehook
        sys.unraisablehook = _unraisable


_hook = sys.__unraisablehook__


def _unraisable(unraisable):
    if unraisable.exc_type is KeyboardInterrupt and _interrupted:
        return      # noted: check() raises it again
    _hook(unraisable)


def check():
    """Raise ``KeyboardInterrupt`` if SIGINT came since :func:`install` (once handled, it
    stays noted: the command is ending)."""
    if _interrupted:
        raise KeyboardInterrupt
