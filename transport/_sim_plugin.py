"""The ``sim`` plugin: holds an attempt for ``execute.duration`` seconds, runs nothing
(``docs/plugins.md``).

Built for load: one heap of due times, and a queue of the attempts due at once (zero
duration: in start order, which is due order, so no heap), no threads, no descriptors.
``start()`` is a push, ``poll()`` costs the changes it returns (plus the entries of stopped
attempts it pops, each once), ``due()`` is the earliest due time.
"""

import collections
import heapq
import random
import time

from engine._codes import Phase
from transport._plugins import Outcome, Plugin, PluginError, make_change

__all__ = ["SimPlugin"]

_RUNNING = Phase.RUNNING
_SUCCEEDED = Outcome.succeeded()


class SimPlugin(Plugin):
    """Holds each attempt for its ``execute.duration`` (a float, or ``(low, high)`` sampled
    uniformly), then reports its outcome: SUCCEEDED, or the declared ``execute.fail``
    (``"USER"`` or ``"SYSTEM:<CAUSE>"``) when ``execute.fail_attempts`` is None or the
    attempt number is at most ``fail_attempts``. A gang's failure names its last pod.

    ``poll()`` reports RUNNING for every attempt started since the last call, then the
    outcomes that are due; an attempt whose duration has passed by then (zero, say) gets
    both in the same call, RUNNING first. Options: ``seed`` (of the duration sampler).
    ``clock`` (a monotonic-seconds callable) is for tests."""

    name = "sim"
    finalizes = False       # it keeps no files
    logs = False

    def __init__(self, options=None, clock=time.monotonic):
        opts = dict(options or {})
        seed = opts.pop("seed", None)
        if opts:
            raise PluginError(f"sim plugin: unknown option(s) {', '.join(sorted(opts))} "
                              f"(known: seed)", cause="CONFIG")
        self._random = random.Random(seed)
        self._clock = clock
        self._live = {}             # key -> (seq, outcome or None), the attempts to report
        self._heap = []             # (due, seq, key); a stopped attempt's entry is skipped
        # (due, seq, key) of zero-duration attempts, due at their start, in start order (a
        # heap pop was ~0.7 us of a zero-duration attempt's ~3.4 us on the worker).
        self._at_once = collections.deque()
        self._new = []              # keys whose RUNNING the next poll() reports
        self._seq = 0
        self._dead = 0              # heap entries of stopped attempts

    def start(self, attempt):
        failed = self.start_many((attempt,))
        if failed:
            raise failed[0][1]

    def start_many(self, attempts):
        """Start each of ``attempts`` (``start`` is this for one), due times from one clock
        reading (the worker starts them in one loop turn)."""
        failed = []
        live, heap, new = self._live, self._heap, self._new
        now = self._clock()
        seq = self._seq
        uniform = self._random.uniform
        push = heapq.heappush
        at_once = self._at_once.append
        for attempt in attempts:
            key = attempt.key
            if key in live:
                failed.append((attempt, PluginError(f"attempt {key.hex()} is already "
                                                    f"running")))
                continue
            ex = attempt.execute
            d = ex.duration
            if type(d) is tuple:
                d = uniform(d[0], d[1])
            outcome = None
            if ex.fail is not None and (ex.fail_attempts is None
                                        or attempt.attempt <= ex.fail_attempts):
                outcome = self._failure(attempt, ex)
            seq += 1
            live[key] = (seq, outcome)
            if d > 0:
                push(heap, (now + d, seq, key))
            else:
                at_once((now, seq, key))
            new.append(key)
        self._seq = seq
        return failed

    @staticmethod
    def _failure(attempt, ex):
        kind, cause = ex.sim_failure()
        pod = attempt.pods[-1].name if len(attempt.pods) > 1 else None
        where = f" in pod {pod}" if pod else ""
        message = (f"declared sim failure: execute.fail = {ex.fail!r}{where} "
                   f"(attempt {attempt.attempt})")
        if kind == "USER":
            return Outcome.user(message, pod=pod)
        return Outcome.system(cause, message, pod=pod)

    def poll(self):
        changes = []
        live = self._live
        if self._new:
            changes = [make_change(k, _RUNNING, None) for k in self._new if k in live]
            self._new = []
        heap, q = self._heap, self._at_once
        if heap or q:
            now = self._clock()
            pop = heapq.heappop
            while True:
                # The earliest (due, seq) of the two, if it is due.
                if q and (not heap or q[0] < heap[0]):
                    if q[0][0] > now:
                        break
                    _, seq, key = q.popleft()
                elif heap and heap[0][0] <= now:
                    _, seq, key = pop(heap)
                else:
                    break
                entry = live.get(key)
                if entry is None or entry[0] != seq:
                    self._dead -= 1
                    continue
                del live[key]
                outcome = entry[1] or _SUCCEEDED
                changes.append(make_change(key, outcome.phase, outcome))
        return changes

    def due(self):
        if self._new:
            return 0.0
        heap, q = self._heap, self._at_once
        if q:
            return min(q[0][0], heap[0][0]) if heap else q[0][0]
        return heap[0][0] if heap else None

    def stop(self, key, reason=None):
        if self._live.pop(key, None) is None:
            return
        self._dead += 1
        # Stopped entries wait in the heap until their due time; when they are most of it
        # (long durations stopped en masse), rebuild it so it stays proportional to the live.
        if self._dead > 1024 and self._dead * 2 > len(self._heap) + len(self._at_once):
            live = self._live
            self._heap = [e for e in self._heap if e[2] in live and live[e[2]][0] == e[1]]
            heapq.heapify(self._heap)
            self._at_once = collections.deque(
                e for e in self._at_once if e[2] in live and live[e[2]][0] == e[1])
            self._dead = 0

    def close(self, timeout=5.0):
        self._live.clear()
        self._heap.clear()
        self._at_once.clear()
        self._new.clear()
        self._dead = 0

    def running(self):
        """How many attempts are being held (started, not reported terminal nor stopped)."""
        return len(self._live)
