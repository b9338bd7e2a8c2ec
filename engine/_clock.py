"""Time for the engine: injectable, in integer nanoseconds."""

import time

__all__ = ["Clock", "SystemClock", "ManualClock"]


class Clock:
    """What the engine asks of a clock: ``now_ns()``."""

    def now_ns(self):  # pragma: no cover - interface
        raise NotImplementedError


class SystemClock(Clock):
    """Wall-clock time (comparable across restarts, which leases need)."""

    def now_ns(self):
        return time.time_ns()


class ManualClock(Clock):
    """A virtual clock for tests and simulation: time moves only when told."""

    def __init__(self, start_ns=0):
        self._now = int(start_ns)

    def now_ns(self):
        return self._now

    def advance(self, seconds):
        """Move time forward by ``seconds`` (never backwards)."""
        if seconds < 0:
            raise ValueError("a clock never goes backwards")
        self._now += int(round(seconds * 1e9))
        return self._now

    def set_ns(self, now_ns):
        """Jump to ``now_ns`` (not earlier than now)."""
        if now_ns < self._now:
            raise ValueError("a clock never goes backwards")
        self._now = int(now_ns)
        return self._now
