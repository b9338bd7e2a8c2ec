"""The ``leasehold`` command line: the entry point (``leasehold = engine.cli:main``, and
``python -m engine.cli``).

Only the standard library is imported here; the commands (``engine/_cli.py``) are imported
inside :func:`main`, so a Ctrl-C while numpy, the engine and their dependencies load (about
half a second) is the commands' own ``leasehold: INTERRUPTED`` line and exit 130, not a
KeyboardInterrupt traceback. (``engine/__init__.py`` imports nothing until asked, for the
same reason: the package is imported before this module.)
"""

import sys

from engine import _sigint  # (the standard library only, as this module)

__all__ = ["main"]


def main(argv=None):
    """Entry point of the ``leasehold`` console script."""
    try:
        if argv is None:    # the program itself, not a call from Python (a test's)
            _sigint.install()
        with _sigint.deferred():    # a Ctrl-C meanwhile: raised once they are imported
            from engine._cli import main as run
        return run(argv)
    except BaseException as exc:
        # Raised while the commands were still importing, or before their guard ran; also
        # a Ctrl-C Python 3.11 turned into RuntimeError (a class being made at import).
        if not _sigint.is_interrupt(exc):
            raise
        return _sigint.interrupted()


if __name__ == "__main__":
    sys.exit(main())
