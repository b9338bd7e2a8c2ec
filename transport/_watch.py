"""The shard's watch log: per run, a sequence-numbered, bounded ring of state changes, and
who watches it (``docs/shard.md``, "Watches").

A run gets a log when someone first WATCHes it; from then on every state change of its
actions the shard sees (enqueue, assignment, running, terminal, abort, and what the backstop
re-check finds: expiry, retry, timeout) is appended with the next sequence number and pushed
to the connections watching it. The log stays after its watchers leave (a watcher that
reconnects resumes from the last ``seq`` it saw) until the run is evicted when more than
``max_runs`` runs have logs: the least recently watched of those nobody watches now, else the
least recently watched of those only the connection asking for a new one watches. When every
log is watched by another connection, the new WATCH is refused (RESOURCE_EXHAUSTED): one
client watching many runs must not stop another's watch.

Bounds: ``ring`` events a run (the oldest are dropped), ``max_runs`` runs, ``max_live``
actions tracked a run for the backstop re-check. A resume from a ``seq`` the ring no longer
holds is refused (:class:`WatchGap`): the watcher re-reads status instead of silently missing
changes.

Sequence numbers start, per run, at ``epoch + 1`` where ``epoch`` is the shard's start time
in microseconds shifted left 10 bits: gap-free within one shard process, and always larger after
a restart, so a watcher holding a ``seq`` from before the restart is told its events are gone
instead of being handed new events it would drop as already seen. A log made again for a
run whose log was evicted starts above every seq an evicted log reached, so a watcher of the
evicted log is refused too, not resumed into the new log's numbering.
"""

import collections
import itertools
import operator
import time

import numpy as np

from engine._codes import PHASE_CODE, PHASES, TERMINAL_PHASES, Phase
from engine._errors import ResourceExhausted

# A phase or its name -> the Phase: a dict lookup (Phase(x) costs an enum call, and every
# recorded change of a watched run takes one).
_PHASE_OF = {**{p.value: p for p in Phase}, **{p: p for p in Phase}}


def _phase(phase):
    found = _PHASE_OF.get(phase)
    return found if found is not None else Phase(phase)    # else: ValueError naming it

__all__ = ["Logged", "WatchGap", "WatchLog", "RING", "MAX_RUNS", "MAX_LIVE", "RECHECK"]

#: Events kept a run.
RING = 4096
#: Runs with a log.
MAX_RUNS = 1024
#: Non-terminal actions a run tracks for the backstop re-check.
MAX_LIVE = 10_000
#: Tracked actions the re-check reads in one loop turn (:meth:`WatchLog.sweep`).
RECHECK = 4096


class WatchGap(Exception):
    """A resume from a ``seq`` the log no longer holds (too old, or from before a restart)."""


class Logged:
    """Consecutive events of one run recorded together, as columns (what an EVENTS
    message carries): event ``i`` is ``actions[i]`` entering phase ``codes[i]`` (uint8,
    ``engine._codes.PHASES``) in attempt ``attempts[i]`` (int32), numbered ``seq + i``, all
    at ``time_ns``; ``details``: each one's text or None (None when none has one)."""

    __slots__ = ("seq", "actions", "codes", "attempts", "time_ns", "details")

    def __init__(self, seq, actions, codes, attempts, time_ns, details=None):
        self.seq, self.actions, self.codes, self.attempts = seq, actions, codes, attempts
        self.time_ns, self.details = time_ns, details

    def __len__(self):
        return len(self.actions)

    @property
    def last(self):
        """The seq of the last event."""
        return self.seq + len(self.actions) - 1

    def part(self, lo, hi):
        """Events ``lo`` to ``hi`` (indexes) as a :class:`Logged` of their own."""
        return Logged(self.seq + lo, self.actions[lo:hi], self.codes[lo:hi],
                      self.attempts[lo:hi], self.time_ns,
                      None if self.details is None else self.details[lo:hi])

    def events(self):
        """The events as ``(seq, action, phase name, attempt, time_ns, detail)`` tuples."""
        n, t = len(self.actions), self.time_ns
        details = self.details if self.details is not None else [None] * n
        return [(self.seq + i, a, PHASES[c].value, att, t, d) for i, (a, c, att, d) in
                enumerate(zip(self.actions, self.codes.tolist(), self.attempts.tolist(),
                              details, strict=True))]


# A phase or its name -> its code (what the columns hold).
_CODE_OF = {**PHASE_CODE, **{p.value: c for p, c in PHASE_CODE.items()}}


def _codes(phases, n):
    try:
        return np.fromiter(map(_CODE_OF.__getitem__, phases), np.uint8, n)
    except KeyError:
        for ph in phases:
            _phase(ph)          # the ValueError naming the bad one
        raise


class _Run:
    __slots__ = ("ring", "held", "base", "seq", "watchers", "live", "ended")

    def __init__(self, ring, base):
        self.ring = collections.deque()     # Logged, in seq order
        self.held = 0               # events in the ring
        self.base = base            # the seq before this log's first event
        self.seq = base
        self.watchers = set()       # routing ids
        self.live = {}              # action id -> (phase, attempt), non-terminal only
        # The actions that ended last, with their terminal phase: a repeat is found in O(1)
        # (scanning the ring for it made a large fan-out quadratic).
        self.ended = _Ended(ring)


class _Ended:
    """Action id -> terminal phase of the actions that ended most recently: at least the
    last ``bound`` of them, at most twice that. Two generations of plain dicts: a batch
    goes in with one ``dict.update``, the older generation is dropped whole when the newer
    fills (an ordered map that dropped its oldest entry one at a time cost most of a
    fan-out's terminal batch)."""

    __slots__ = ("bound", "new", "old")

    def __init__(self, bound):
        self.bound = max(1, bound)
        self.new, self.old = {}, {}

    def get(self, action):
        told = self.new.get(action)
        return told if told is not None else self.old.get(action)

    def holds_any(self, actions):
        """Whether any of ``actions`` is here (C passes)."""
        return not (self.new.keys().isdisjoint(actions)
                    and self.old.keys().isdisjoint(actions))

    def add(self, action, phase):
        """``action`` ended in ``phase`` (again, if here: it becomes the newest)."""
        self.old.pop(action, None)
        new = self.new
        new.pop(action, None)
        new[action] = phase
        if len(new) >= self.bound:
            self.old, self.new = new, {}

    def add_new(self, actions, phase):
        """:meth:`add` of each of ``actions`` in order, none of them here nor twice in it
        (the caller checked): the same generations as one at a time, in slices."""
        i, n = 0, len(actions)
        while i < n:
            k = self.bound - len(self.new)
            self.new.update(zip(actions[i:i + k], itertools.repeat(phase)))
            i += k
            if len(self.new) >= self.bound:
                self.old, self.new = self.new, {}


class WatchLog:
    """The watched runs of one shard (used from its decision thread only)."""

    def __init__(self, ring=RING, max_runs=MAX_RUNS, max_live=MAX_LIVE, epoch=None):
        self.ring = ring
        self.max_runs = max_runs
        self.max_live = max_live
        # Microseconds, so that even a restart within the same second starts above
        # every seq of the process before (unless a run had more than 1,024 events a
        # microsecond of that process's life).
        self.epoch = ((time.time_ns() // 1000) << 10) if epoch is None else epoch
        self._runs = collections.OrderedDict()
        self.evicted = 0
        # Where a new log starts: above every seq an evicted log handed out, so a watcher of
        # an evicted log is refused when it resumes (WatchGap) from a log of the same run
        # made again later, instead of being handed that log's events from its old seq on.
        self._floor = self.epoch
        # The re-check's round over every log's tracked actions (sweep): the runs left, and
        # the one being read (its actions as they were when the round reached it).
        self._round = collections.deque()
        self._keys = ()
        self._at = 0
        self._run = None

    def __contains__(self, run):
        return run in self._runs

    def __len__(self):
        return len(self._runs)

    def watched(self):
        """The runs someone watches now (a log outlives its watchers)."""
        return [run for run, r in self._runs.items() if r.watchers]

    def watch(self, run, conn, since):
        """Subscribe ``conn`` to ``run``; returns ``(latest seq, events after since)``, the
        events a list of :class:`Logged`.
        Raises :class:`WatchGap` when events after ``since`` were dropped or belong to an
        earlier shard process."""
        r = self._runs.get(run)
        new = r is None
        if new:
            # Kept only once the watch is accepted: a refused first WATCH that made the log
            # left the next one not the first, and the shard has the re-check follow a run's
            # live actions at its first WATCH only (its expiries never became events).
            r = _Run(self.ring, self._floor)
        else:
            self._runs.move_to_end(run)
        first = r.ring[0].seq if r.ring else r.seq + 1
        if since and since < self.epoch:
            raise WatchGap(f"watch {run}: seq {since} is from before the shard restarted; "
                           f"the changes since are not kept (re-read the status)")
        if since and since < r.base:
            raise WatchGap(f"watch {run}: seq {since} is from a log of this run that was "
                           f"evicted (more than {self.max_runs} runs watched, or an error in "
                           f"the shard lost its events); the changes since are not kept "
                           f"(re-read the status)")
        if since > r.seq:
            raise WatchGap(f"watch {run}: seq {since} is past the latest ({r.seq})")
        if since and since + 1 < first:
            raise WatchGap(f"watch {run}: events after seq {since} are no longer kept (the "
                           f"ring holds {first}..{r.seq}, {self.ring} a run); re-read status")
        victim = None
        if new and len(self._runs) >= self.max_runs:   # (never more: one out for one in)
            victim = self._victim(conn)
            if victim is None:
                raise ResourceExhausted(
                    f"watch {run}: {self.max_runs} runs are watched, each by another "
                    f"connection (a shard keeps that many logs); unwatch a run this "
                    f"connection watches, or try again")
        r.watchers.add(conn)
        if victim is not None:
            self.forget(victim)
        if new:
            self._runs[run] = r
        return r.seq, [c if c.seq > since else c.part(since + 1 - c.seq, len(c))
                       for c in r.ring if c.last > since]

    def _victim(self, conn):
        """The log to evict for a new one ``conn`` asks for: the least recently watched of
        those nobody watches now, else of those only ``conn`` watches;
        None when every other log has another watcher. (Until 2026-12-03 the least recently
        watched of all: a run watched by a client taking its events, which sends no WATCH
        while they come, went before runs nobody watched any more; until 2026-12-05 also
        when another connection watched it: one client's WATCHes of many runs stopped
        another's watch.)"""
        mine = None
        for run, r in self._runs.items():
            if not r.watchers:
                return run
            if mine is None and r.watchers <= {conn}:
                mine = run
        return mine

    def forget(self, run):
        """Drop ``run``'s log as an eviction does (its watchers stop; one resuming is
        refused, :class:`WatchGap`): the shard does so when the events of a change may have
        been lost (a bug while a turn's records joined the log), so that none of its
        watchers misses them silently."""
        r = self._runs.pop(run, None)
        if r is not None:
            self._floor = max(self._floor, r.seq + 1)
            self.evicted += 1

    def unwatch(self, run, conn):
        """Stop pushing ``run`` to ``conn`` (its log stays, for a resume)."""
        r = self._runs.get(run)
        if r is not None:
            r.watchers.discard(conn)

    def drop(self, conn):
        """Forget ``conn`` everywhere (it is gone or cannot take more)."""
        for r in self._runs.values():
            r.watchers.discard(conn)

    def track_many(self, run, actions, phases, attempts):
        """Have the backstop re-check follow each non-terminal one of ``actions`` (of a
        watched ``run``) whose changes this log did not see (enqueued or assigned before the
        run was first watched), without recording an event, in order, with its phase and
        attempt as the events of its later changes will number it (until 2026-12-03 every
        one was tracked at attempt 0: the events of an action assigned before its run was
        first watched said attempt 0 until its next assignment; the STATUS path did so until
        2026-12-03, through a ``track`` of one action, now gone)."""
        r = self._runs.get(run)
        if r is None:
            return
        live, room = r.live, self.max_live - len(r.live)
        given = phase = terminal = None
        for action, p, attempt in zip(actions, phases, attempts, strict=True):
            if room <= 0:
                break
            if p is not given:      # looked up once a run of equal phases (as record_changes)
                given = p
                phase = _phase(p)
                terminal = phase in TERMINAL_PHASES
            if not terminal and action not in live:
                live[action] = (phase, attempt)
                room -= 1

    def record(self, run, action, phase, attempt, time_ns, detail=None):
        """Append a change of ``action`` (in a watched run) unless it repeats the last one
        seen for it; returns ``(Logged, watchers)`` or None."""
        logged, watchers = self.record_changes(run, (action,), (phase,), (attempt,), time_ns,
                                               (detail,))
        return (logged, watchers) if logged is not None else None

    def record_many(self, run, actions, phase, attempt, time_ns):
        """:meth:`record` of each of ``actions`` (of one run) with the same non-terminal
        phase, attempt and time, in order (a fan-out's QUEUED); returns ``(Logged,
        watchers)``, ``(None, set())`` when none was new or the run is not watched."""
        phase = _phase(phase)
        if phase in TERMINAL_PHASES:
            raise ValueError(f"record_many takes non-terminal phases, not {phase}")
        r = self._runs.get(run)
        if r is None:
            return None, set()
        # record_changes' loop for one non-terminal phase and attempt (a fan-out's QUEUED,
        # every entry new): no per-entry phase lookup or terminal bookkeeping.
        live, max_live = r.live, self.max_live
        state = (phase, attempt)
        drop = []
        if (len(live) + len(actions) <= max_live and live.keys().isdisjoint(actions)
                and len(set(actions)) == len(actions)):
            # Every entry new and tracked (a fan-out's QUEUED): C passes, no loop.
            live.update(zip(actions, itertools.repeat(state)))
        else:
            for i, action in enumerate(actions):
                last = live.get(action)
                if last is not None:
                    if last == state:
                        drop.append(i)
                        continue
                    live[action] = state
                elif len(live) < max_live:
                    live[action] = state
        kept = _without(actions, drop)
        n = len(kept)
        if not n:
            return None, r.watchers
        logged = Logged(r.seq + 1, kept, np.full(n, PHASE_CODE[phase], np.uint8),
                        np.full(n, attempt, np.int32), time_ns)
        self._append(r, logged)
        return logged, r.watchers

    def record_changes(self, run, actions, phases, attempts, time_ns, details=None):
        """:meth:`record` of each ``(actions[i], phases[i], attempts[i], details[i])`` of
        one run, in order, at one time (a worker's report batch in one loop); returns
        ``(Logged, watchers)``, ``(None, set())`` when none was new or the run is not
        watched."""
        r = self._runs.get(run)
        if r is None:
            return None, set()
        live, ended, max_live = r.live, r.ended, self.max_live
        n = len(actions)
        if len(phases) != n or len(attempts) != n:
            raise ValueError(f"record_changes: {n} actions, {len(phases)} phases, "
                             f"{len(attempts)} attempts")
        drop = []
        given = phase = terminal = None
        # One phase, nothing to leave out (the common batch): applied whole, no loop.
        alike = n > 1 and type(phases) in (list, tuple) and phases.count(phases[0]) == n and \
            self._record_alike(r, actions, _PHASE_OF.get(phases[0]) or _phase(phases[0]),
                               attempts)
        # (Every phase checked before anything changes: a bad one changes nothing.)
        codes = np.full(n, _CODE_OF[phases[0]], np.uint8) if alike else _codes(phases, n)
        for i, (action, p, attempt) in enumerate(zip(() if alike else actions, phases,
                                                     attempts, strict=False)):
            if p is not given:
                # A batch repeats a few phases: each looked up once a run of equal ones.
                given = p
                phase = _PHASE_OF.get(p) or _phase(p)
                terminal = phase in TERMINAL_PHASES
            if terminal:
                last = live.pop(action, None)
                if last is None and ended.get(action) == phase:
                    drop.append(i)  # already told (a second report, a re-check)
                    continue
                ended.add(action, phase)
            else:
                last = live.get(action)
                if last is not None:
                    if last[1] == attempt and last[0] == phase:
                        drop.append(i)
                        continue
                    live[action] = (phase, attempt)
                elif len(live) < max_live:
                    live[action] = (phase, attempt)
        if len(drop) == n:
            return None, r.watchers
        attempts = np.array(attempts, np.int32)
        if details is not None:
            details = list(details)
        if drop:
            mask = np.ones(n, bool)
            mask[drop] = False
            codes, attempts = codes[mask], attempts[mask]
            actions = _without(actions, drop)
            if details is not None:
                details = _without(details, drop)
        elif type(actions) is not list:
            actions = list(actions)
        if details is not None:
            details = [d or None for d in details] if any(details) else None
        logged = Logged(r.seq + 1, actions, codes, attempts, time_ns, details)
        self._append(r, logged)
        return logged, r.watchers

    def _record_alike(self, r, actions, phase, attempts):
        """The bookkeeping of :meth:`record_changes` for a batch of one phase (a fan-out's
        leases, a worker's successes) in a few C passes, when no change of it is a repeat
        to leave out: no action twice, none already in that state, none ended before, none
        past ``max_live``. Returns False, having changed nothing, when one might be (the
        per-change loop decides those)."""
        live, ended = r.live, r.ended
        if len(set(actions)) != len(actions):
            return False
        if phase in TERMINAL_PHASES:
            if ended.holds_any(actions):
                return False
            collections.deque(map(live.pop, actions, itertools.repeat(None)), 0)
            ended.add_new(actions, phase)
            return True
        lasts = list(map(live.get, actions))
        if type(attempts) in (list, tuple) and attempts.count(attempts[0]) == len(attempts):
            # One attempt for all (a fan-out's leases): one state tuple shared.
            state = (phase, attempts[0])
            if state in lasts or len(live) + lasts.count(None) > self.max_live:
                return False
            live.update(zip(actions, itertools.repeat(state)))
            return True
        states = list(zip(itertools.repeat(phase), attempts))
        if any(map(operator.eq, lasts, states)):
            return False
        if len(live) + lasts.count(None) > self.max_live:
            return False
        live.update(zip(actions, states, strict=True))
        return True

    def _append(self, r, logged):
        """Number ``logged`` (its seq already the next) into ``r``'s ring, dropping the
        oldest events past ``ring``."""
        r.ring.append(logged)
        r.seq = logged.last
        r.held += len(logged)
        over = r.held - self.ring
        while over > 0:
            oldest = r.ring[0]
            if len(oldest) <= over:
                r.ring.popleft()
                r.held -= len(oldest)
                over -= len(oldest)
            else:
                r.ring[0] = oldest.part(over, len(oldest))
                r.held -= over
                over = 0

    def live(self):
        """``(run, action, last phase, attempt)`` of every tracked non-terminal action."""
        for run, r in self._runs.items():
            for action, (phase, attempt) in r.live.items():
                yield run, action, phase, attempt

    def sweep(self, budget=RECHECK):
        """The next ``budget`` (at most) tracked live actions ``(run, action)`` of a round
        over every log's, continuing where the last call stopped, and whether the round
        ended with them (the next call starts a new one). Each action tracked when the
        round reached its run comes once a round; one tracked later waits for the next
        round (its changes since are events already: it was recorded to be tracked)."""
        out = []
        if not self._round and self._at >= len(self._keys):
            self._round.extend(self._runs)      # a new round
        while True:
            if self._at < len(self._keys):
                r = self._runs.get(self._run)
                if r is None:                   # evicted meanwhile
                    self._keys = ()
                    continue
                take = self._keys[self._at:self._at + budget - len(out)]
                self._at += len(take)
                live, run = r.live, self._run
                out.extend((run, a) for a in take if a in live)
                if len(out) >= budget:
                    return out, not self._round and self._at >= len(self._keys)
                continue
            if not self._round:
                return out, True
            self._run = self._round.popleft()
            r = self._runs.get(self._run)
            self._keys = list(r.live) if r is not None else ()
            self._at = 0

    def last(self, run, action):
        """The last ``(phase, attempt)`` recorded for tracked live ``action``, or None."""
        r = self._runs.get(run)
        return r.live.get(action) if r is not None else None

    def tracked(self, run):
        """The tracked live actions of ``run`` (a list)."""
        r = self._runs.get(run)
        return list(r.live) if r is not None else []

    def attempt_of(self, run, action):
        """The last attempt recorded for ``action`` (0 when none)."""
        r = self._runs.get(run)
        if r is None:
            return 0
        last = r.live.get(action)
        return last[1] if last is not None else 0


def _without(items, drop):
    """``items`` (a sequence) as a list without the entries at indexes ``drop`` (ascending)."""
    if not drop:
        return items if type(items) is list else list(items)
    out, lo = [], 0
    for i in drop:
        out.extend(items[lo:i])
        lo = i + 1
    out.extend(items[lo:])
    return out
