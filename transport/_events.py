"""A client's watched runs and the events it has received and not taken yet
(``Client.watch``, ``next_event``, ``next_events``; docs/shard.md, "Watches").

Per watched run the last seq taken (0: its WATCH not answered yet); the events in order of
arrival, each new one once (at-least-once from the shard, a seq seen is dropped here); a gap
(a push the shard could not send) flags the run for a resume from its last seq instead of
being skipped; events pushed before a WATCH from since=0 was answered wait for the replay
that answer announces. No I/O: the client reads its sockets and hands messages here.
"""

import collections

import numpy as np

from engine._codes import PHASE_CODE, Phase
from transport import _protocol as p

__all__ = ["EventQueue"]


class EventQueue:
    """The event side of one client's watches (not thread-safe, as the client)."""

    def __init__(self):
        self.queue = collections.deque()        # events received, not yet taken
        self.watching = {}                      # run -> last seq seen (0: none)
        self.resync = set()                     # runs whose event stream had a gap
        # Events pushed before a WATCH from since=0 was answered (a turn committed just
        # before it: they come after the replay the answer announces), held until that
        # replay has been taken: run -> events, and run -> the answer's latest seq.
        self.early = {}
        self.replay_end = {}
        self.answering = set()                  # runs whose WATCH answer is awaited now

    def awaiting(self, run):
        """A WATCH of ``run`` was sent: its events pushed before the answer are held."""
        self.answering.add(run)

    def answered(self, run, first, seq):
        """WATCH ``run`` was answered: its replay starts at seq ``first``, its log's latest
        is ``seq``; events held meanwhile follow that replay."""
        # What comes next is the replay's first seq (a seq is never 0 once known, so a
        # gap before the first event is seen too, and a shard that restarted since
        # refuses a resume from it: WatchLost).
        if run in self.watching:
            self.watching[run] = max(self.watching[run], first - 1)
            if run in self.early:
                self.replay_end[run] = seq
                self.release_early(run)

    def answer_done(self, run):
        """The WATCH of ``run`` was answered or will not be (its call ended)."""
        self.answering.discard(run)
        if run in self.early and run not in self.replay_end:
            # No answer came (timed out, refused): what was held is fetched again by
            # the resume the next wait for an event makes.
            del self.early[run]
            self.resync.add(run)

    def drop(self, runs):
        """Forget the events of ``runs`` (a collection) not taken yet."""
        self.queue = collections.deque(e for e in self.queue if e.run not in runs)

    def take_events(self, msg):
        """Queue the new events of an EVENTS message (consecutive seqs of one run, from
        ``msg.seq``) as one batch; returns it (None: none was new)."""
        if self.watching.get(msg.run) == 0:
            self.hold(msg.run, msg.events())
            return None
        skip = self.new_events(msg.run, msg.seq, len(msg.actions))
        if skip is None:
            return None
        if skip:
            msg = _batch_slice(msg, skip)
        self.queue.append(msg)
        if msg.run in self.replay_end:
            self.release_early(msg.run)
        return msg

    def hold(self, run, events):
        """Events of a run not yet told where its log starts (``_watching`` 0): held for
        after the replay while its WATCH answer is awaited, else a resume is flagged."""
        if run in self.answering:
            self.early.setdefault(run, []).extend(events)
        else:
            self.resync.add(run)

    def forget_early(self, run):
        self.early.pop(run, None)
        self.replay_end.pop(run, None)

    def release_early(self, run):
        """Queue the events held back by :attr:`_early` once the replay before them has
        been taken (a gap among them flags a resume, as any gap does)."""
        end = self.replay_end.get(run)
        if end is None or self.watching.get(run, 0) < end:
            return
        del self.replay_end[run]
        for e in self.early.pop(run, ()):
            if self.new_events(run, e.seq, 1) is not None:
                self.queue.append(e)

    def new_events(self, run, seq, n):
        """For ``n`` consecutive events of ``run`` from ``seq``: how many of them were seen
        already (the rest are new: the run's last seq moves past them), or None when none
        is to be taken: the run is not watched, every seq was seen, or a push was lost
        before them (the shard drops a watcher it cannot send to): the run is then resumed
        from the last seq seen instead of skipping the gap. At-least-once."""
        last = self.watching.get(run)
        if last is None or n == 0 or seq + n - 1 <= last:
            return None
        if seq > last + 1:
            self.resync.add(run)
            return None
        self.watching[run] = seq + n - 1
        return last + 1 - seq if seq <= last else 0

    def take_event(self, e):
        """Queue ``e`` if it is the next new event of a watched run."""
        if self.watching.get(e.run) == 0:
            self.hold(e.run, (e,))
            return False
        if self.new_events(e.run, e.seq, 1) is None:
            return False
        self.queue.append(e)
        if e.run in self.replay_end:
            self.release_early(e.run)
        return True

    # The queue of events not taken yet (``_events``) holds, in order of arrival: an
    # ``Event`` (a single push, or one held back during a WATCH), an ``Events`` batch of new
    # events as pushed (trimmed of those seen before), or a ``_Taking`` batch being taken
    # one event at a time. A batch becomes Event objects only when next_event reaches it.

    def take_one(self, i):
        """Take the first event of entry ``i`` of the queue."""
        q = self.queue
        item = q[i]
        kind = type(item)
        if kind is p.Event:
            del q[i]
            return item
        if kind is p.Events:
            item = q[i] = _Taking(item.run, collections.deque(item.events()))
        e = item.events.popleft()
        if not item.events:
            del q[i]
        return e

    def take_batch(self, i):
        """Take entry ``i`` of the queue whole, as an ``Events`` batch."""
        q = self.queue
        item = q[i]
        del q[i]
        kind = type(item)
        if kind is p.Events:
            return item
        return _batch_of([item] if kind is p.Event else list(item.events))


class _Taking:
    """A batch of the event queue that ``next_event`` has begun to take, one at a time."""

    __slots__ = ("run", "events")

    def __init__(self, run, events):
        self.run, self.events = run, events


def _batch_slice(msg, start):
    """EVENTS ``msg`` from its entry ``start`` on."""
    return p.Events(run=msg.run, seq=msg.seq + start, actions=msg.actions[start:],
                    phases=msg.phases[start:], attempts=msg.attempts[start:],
                    time_ns=msg.time_ns[start:],
                    details=msg.details[start:] if msg.details is not None else None)


def _batch_of(events):
    """Consecutive :class:`Event` messages of one run as one EVENTS batch."""
    details = [e.detail for e in events]
    return p.Events(run=events[0].run, seq=events[0].seq, actions=[e.action for e in events],
                    phases=np.array([PHASE_CODE[Phase(e.phase)] for e in events], np.uint8),
                    attempts=np.array([e.attempt for e in events], np.int32),
                    time_ns=np.array([e.time_ns for e in events], np.int64),
                    details=details if any(d is not None for d in details) else None)
