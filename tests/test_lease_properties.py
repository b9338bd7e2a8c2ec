"""Property tests (hypothesis, stateful) of the lease life cycle on the in-process ``Engine``.

A ``RuleBasedStateMachine`` drives one engine on a ``ManualClock``: it enqueues actions (with
retry policies, the three timeouts and parents), ticks, heartbeats random subsets of what each
worker holds mixed with stale, foreign, forged and edited tokens, reports progress and outcomes
(and late or forged reports), aborts subtrees, disconnects and reconnects workers, applies stale
expiry snapshots and moves the clock. Next to the engine it keeps its own model of every lease
generation ever handed out: who holds it (worker and session), when it expires (assignment or
last accepted heartbeat + ttl), and how it ended (report, abort, expiry, runtime backstop).

Checked after every step (and in teardown):

* one live holder per lease: every token the engine accepts is the current generation held by
  the presenting session; older generations are refused STALE; a token is accepted exactly when
  the model says it is live; a refused report changes nothing; once refused (stale, ended,
  expired, forged) a token is never accepted again;
* every action ends in exactly one terminal phase, which never changes after, and its history
  is frozen from then on;
* attempts are never lost or duplicated: numbered 1..n, one generation per assigned attempt,
  the generations handed out (+1 per assignment), retries only within the policy and after its
  backoff, and no retry lost (a failure with budget left ends the action only when the retry
  would be due after the deadline);
* phases shown move forward: INITIALIZING while a lease is live, RUNNING once reported so;
* in-flight counts (per queue and per cluster) equal a recount of live run leases, a worker
  session never holds more leases than its slots, and after teardown (everything reported or
  expired, clock moved on, ticked until terminal) every count is zero, every slot is free and
  every attempt that needed cleanup had a finalize lease run to its end;
* a forged token, or a real one with any byte edited, is refused UNKNOWN.

``ZombieLeaseMachine`` also lets a worker that reconnected report what its lost session held.
A reconnect (a new session of the same worker) ends the old session's live leases at once, as
expired: their tokens are refused on heartbeat and report alike, and they are retried.
"""

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import Phase as Phase_
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from engine import (
    ActionId,
    ActionSpec,
    Engine,
    ManualClock,
    NotFound,
    Phase,
    RetryPolicy,
    Timeouts,
    parse_config,
)
from engine._codes import TERMINAL_PHASES, LeaseKind, Verdict
from storage import MemoryStore

HEARTBEAT_INTERVAL = 1.0
MISSED_BEATS = 2
JITTER = 0.5
SYSTEM_RETRIES = 2
RUNTIME_GRACE = 1.0
TTL_NS = int((HEARTBEAT_INTERVAL * MISSED_BEATS + JITTER) * 1e9)
GI = 2**30
KIND_BIT = 1 << 63

CONFIG = {
    "resources": ["cpu", "memory"],
    "clusters": {
        "east": {"capacity": {"cpu": 4, "memory": "16Gi"}},
        "west": {},  # unknown capacity: unlimited
    },
    "queues": {
        "main": {"clusters": ["east", "west"]},
        "side": {"clusters": ["east"], "scheduling": "GREEDY_CAPACITY"},
    },
    "engine": {
        "default_queue": "main",
        "initial_capacity": 16,
        "heartbeat_interval": HEARTBEAT_INTERVAL,
        "expiry_missed_beats": MISSED_BEATS,
        "expiry_jitter": JITTER,
        "system_retries": SYSTEM_RETRIES,
        "runtime_grace": RUNTIME_GRACE,
        "finalize_timeout": 3600.0,  # never reached by a run of this machine
        # The oracle places expired work on any connected worker (test_leases.py covers
        # the pause of a worker that let a lease expire).
        "pause_on_expiry": False,
    },
}
QUEUE_CLUSTERS = {"main": ("east", "west"), "side": ("east",)}
CLUSTERS = ("east", "west")
WORKERS = {"e1": ("east", 3), "e2": ("east", 2), "w1": ("west", 3)}
RUNS = ("r0", "r1", "r2")
CPUS = {0: 0, 0.5: 500, 1: 1000, 2: 2000, 8: 8000}  # cores -> millicores
MEMS = {"0": 0, "1Gi": GI, "4Gi": 4 * GI}

RETRIES = st.none() | st.builds(
    RetryPolicy,
    count=st.integers(0, 2),
    backoff_base=st.sampled_from([0.5, 1.0]),
    backoff_factor=st.sampled_from([1.0, 2.0]),
    backoff_cap=st.sampled_from([1.0, 2.0, 4.0]),
)
TIMEOUTS = st.none() | st.builds(
    Timeouts,
    deadline=st.none() | st.sampled_from([3.0, 8.0, 20.0]),
    max_queued_time=st.none() | st.sampled_from([1.0, 4.0]),
    max_runtime=st.none() | st.sampled_from([1.0, 3.0]),
)
# run, cpu, memory, queue, retries, timeouts, parent (an index among the run's live actions)
ENQUEUE_ITEM = st.tuples(
    st.sampled_from(RUNS), st.sampled_from(sorted(CPUS)), st.sampled_from(sorted(MEMS)),
    st.sampled_from(["main", "main", "side"]), RETRIES, TIMEOUTS,
    st.none() | st.integers(0, 1000))
STEPS = st.sampled_from([0.25, 0.5, 1.0, 1.5, 2.5, 3.0, 6.0])
# (phase, keyword arguments) a worker may report for a run lease / a finalize lease
RUN_REPORTS = [
    (Phase.RUNNING, {}),
    (Phase.INITIALIZING, {}),
    (Phase.SUCCEEDED, {}),
    (Phase.FAILED, {"error_kind": "USER", "recoverable": True}),
    (Phase.FAILED, {"error_kind": "USER", "recoverable": False}),
    (Phase.FAILED, {"error_kind": "SYSTEM", "cause": "OOM"}),
    (Phase.FAILED, {"error_kind": "SYSTEM", "cause": "EVICTED"}),
    (Phase.TIMED_OUT, {"cause": "max_runtime"}),
    (Phase.TIMED_OUT, {"cause": "max_queued_time"}),
    (Phase.TIMED_OUT, {"cause": "deadline"}),
]
FINALIZE_REPORTS = [
    (Phase.RUNNING, {}),
    (Phase.SUCCEEDED, {}),
    (Phase.FAILED, {"error_kind": "SYSTEM", "cause": "CLEANUP_FAILED"}),
]


def lease_of(token):
    """(kind, row, generation) of a token (the layout documented in engine._leases)."""
    lease = int.from_bytes(token[:8], "little")
    return LeaseKind(lease >> 63), lease & (KIND_BIT - 1), int.from_bytes(token[8:16], "little")


def new_engine():
    clock = ManualClock(start_ns=1_000_000_000)
    # A fixed secret: the same draws make the same tokens, so failures replay and shrink.
    return Engine(parse_config(CONFIG, source="<lease-test>"), clock=clock, store=MemoryStore(),
                  secret=bytes(range(16))), clock


class MLease:
    """The model of one lease generation (one token)."""

    def __init__(self, a, session, now, max_runtime):
        self.token = a.token
        self.kind = a.kind
        self.key = a.token[:8]  # lease id: kind bit + row
        self.gen = a.generation
        self.action = a.action
        self.worker = a.worker
        self.session = session
        self.queue = a.queue
        self.cluster = a.cluster
        self.attempt = a.attempt
        self.expiry_ns = now + TTL_NS
        self.end = None  # None (live), "COMPLETED", "ABORTED", "EXPIRED"
        self.running = False
        self.cleanup = False  # a finalize lease was asked for when it was reported
        self.max_runtime = max_runtime
        self.backstop_ns = None
        self.overdue_since = None  # first tick that saw it past expiry, still unswept

    @property
    def live(self):
        return self.end is None


class MAction:
    def __init__(self, aid, spec, queue, demand):
        self.aid = aid
        self.spec = spec
        self.queue = queue
        self.demand = demand  # (cpu millicores, memory bytes)
        self.children = []


class LeaseMachine(RuleBasedStateMachine):
    """The lease life cycle against a model. ``ZOMBIE_REPORTS``: whether a worker may still
    report leases of a session it lost (a reconnect) after the new session was refused them."""

    ZOMBIE_REPORTS = False

    def __init__(self):
        super().__init__()
        self.eng, self.clock = new_engine()
        self.session = {}      # worker -> session number (current connection)
        self.adoptable = set()  # workers whose leases a reload restored, not back yet
        self.connected = {}
        for w in WORKERS:
            self._connect(w)
        self.actions = {}      # ActionId -> MAction
        self.order = []        # ActionIds in enqueue order
        self.n_enqueued = 0
        self.leases = {}       # token -> MLease
        self.current = {}      # lease id (token[:8]) -> newest MLease
        self.holding = {w: [] for w in WORKERS}  # tokens the current session still holds
        self.lost = {w: [] for w in WORKERS}  # held by a lost session, still presented
        self.zombies = []      # tokens of lost sessions a zombie may still report
        self.run_gens = {}     # ActionId -> run lease generations assigned, in order
        self.terminal = {}     # ActionId -> (phase, frozen history)
        self.refused = {}      # token -> first verdict that refused it for good

    # ------------------------------------------------------------------ helpers

    def now(self):
        return self.clock.now_ns()

    def _connect(self, w):
        cluster, slots = WORKERS[w]
        old = self.session.get(w)
        self.eng.register_worker(w, cluster, slots)
        if w in self.adoptable:
            # Back after a reload: the new session adopts the leases the worker held.
            self.adoptable.discard(w)
            for x in self.current.values():
                if x.live and (x.worker, x.session) == (w, old):
                    x.session = old + 1
        elif old is not None:
            # A new session proves the old one gone: its live leases expire at once.
            for x in self.current.values():
                if x.live and (x.worker, x.session) == (w, old):
                    x.end = "EXPIRED"
        self.session[w] = self.session.get(w, 0) + 1
        self.connected[w] = True

    def expected(self, token, presenter=None):
        """The verdict the engine must give ``token`` now, presented in a heartbeat by
        ``presenter`` = (worker, session), or in a report (``None``: any holder). The order
        of the checks is the engine's: MAC, generation, how it ended, expiry, holder."""
        lease = self.leases.get(token)
        if lease is None:
            return Verdict.UNKNOWN
        if lease.gen < self.current[lease.key].gen:
            return Verdict.STALE
        if lease.end == "COMPLETED":
            return Verdict.COMPLETED
        if lease.end == "ABORTED":
            return Verdict.ABORTED
        if lease.end == "EXPIRED" or lease.expiry_ns < self.now():
            return Verdict.EXPIRED
        if presenter is not None and (lease.worker, lease.session) != presenter:
            # An earlier session of the same worker: that session's leases moved on.
            return Verdict.STALE if lease.worker == presenter[0] else Verdict.UNKNOWN
        return Verdict.OK

    def _note_refusal(self, token, verdict):
        # Refusals that are final: the token is stale, forged, or its generation ended.
        if verdict != Verdict.OK and (verdict != Verdict.UNKNOWN or token not in self.leases):
            self.refused.setdefault(token, verdict)

    def _accepted(self, token, how):
        first = self.refused.get(token)
        assert first is None, (f"{how}: token {token.hex()} accepted after it was refused "
                               f"{first.name}")

    def _drop(self, token):
        for held in (*self.holding.values(), *self.lost.values()):
            if token in held:
                held.remove(token)
        if token in self.zombies:
            self.zombies.remove(token)

    def _snapshot(self):
        """Everything a refused report must leave alone."""
        eng = self.eng
        return (
            [(aid, eng.phase(aid), eng.attempts(aid)) for aid in self.order],
            eng.queue_metrics(),
            {c: eng.cluster_in_flight(c) for c in CLUSTERS},
        )

    def _recent(self, n=64):
        """The newest tokens handed out (any kind, generation or holder), oldest first."""
        return list(self.leases)[-n:]

    def _live_run_leases(self):
        return [x for x in self.current.values() if x.live and x.kind == LeaseKind.RUN]

    def _edited(self, token, index, flip):
        b = bytearray(token)
        b[index] ^= flip
        return bytes(b)

    # ------------------------------------------------------------------ the tick

    def _tick(self):
        eng = self.eng
        now = self.now()
        # Runtime backstop (a timer of the tick): still RUNNING past max_runtime + grace.
        for lease in self._live_run_leases():
            if lease.running and lease.backstop_ns is not None and lease.backstop_ns <= now:
                lease.end = "EXPIRED"
        assignments = eng.tick()
        # The sweep ended the leases past expiry; those still listed are left for a later
        # sweep, which must come within a heartbeat interval.
        unswept = {(k, r, g) for k, r, g, _w in eng.expired_leases()}
        for lease in list(self.current.values()):
            if not lease.live or lease.expiry_ns >= now:
                continue
            if lease_of(lease.token) in unswept:
                if lease.overdue_since is None:
                    lease.overdue_since = now
                assert now - lease.overdue_since < int(HEARTBEAT_INTERVAL * 1e9), (
                    f"lease {lease.token.hex()} expired at {lease.expiry_ns} is still not "
                    f"swept at {now}")
            else:
                lease.end = "EXPIRED"
        for a in assignments:
            self._assigned(a, now)
        # Slots: a session never holds more live leases than it offered.
        for w, (_c, slots) in WORKERS.items():
            held = sum(1 for x in self.current.values()
                       if x.live and (x.worker, x.session) == (w, self.session[w]))
            assert held <= slots, f"worker {w} holds {held} leases on {slots} slots"
        return assignments

    def _assigned(self, a, now):
        assert len(a.token) == 24
        kind, _row, gen = lease_of(a.token)
        assert kind == a.kind and gen == a.generation
        assert self.connected.get(a.worker), f"assigned to disconnected worker {a.worker}"
        assert WORKERS[a.worker][0] == a.cluster
        prev = self.current.get(a.token[:8])
        if prev is None:
            assert a.generation == 1, f"first generation of a lease is {a.generation}"
        else:
            assert prev.end is not None, (
                f"{a.action}: generation {a.generation} assigned while generation {prev.gen} "
                f"is live (two holders)")
            assert a.generation == prev.gen + 1, (
                f"{a.action}: generation {prev.gen} then {a.generation}")
        rec = self.actions[a.action]
        attempts = self.eng.attempts(a.action)
        if a.kind == LeaseKind.RUN:
            assert a.action not in self.terminal, f"{a.action} assigned after it ended"
            assert a.cluster in QUEUE_CLUSTERS[rec.queue]
            assert a.attempt == len(attempts), "a run lease goes to the newest attempt"
            att = attempts[-1]
            assert att.generation == a.generation and att.end_ns is None
            assert (att.cluster, att.worker) == (a.cluster, a.worker)
            self.run_gens.setdefault(a.action, []).append(a.generation)
        else:
            att = attempts[a.attempt - 1]
            assert att.generation > 0 and att.end_ns is not None
            assert att.finalize == "SENT"
            assert a.cluster == att.cluster, "finalize is sticky to the attempt's cluster"
        lease = MLease(a, self.session[a.worker], now, rec.spec.timeouts.max_runtime)
        self.leases[a.token] = lease
        self.current[lease.key] = lease
        self.holding[a.worker].append(a.token)

    # ------------------------------------------------------------------ rules

    @initialize(items=st.lists(ENQUEUE_ITEM, min_size=3, max_size=8))
    def some_work(self, items):
        for item in items:
            self._enqueue(*item)
        self._tick()

    @rule(items=st.lists(ENQUEUE_ITEM, min_size=1, max_size=4), then_tick=st.booleans())
    def enqueue(self, items, then_tick):
        for item in items:
            self._enqueue(*item)
        if then_tick:
            self._tick()

    def _enqueue(self, run, cpu, mem, queue, retries, timeouts, parent):
        name = f"a{self.n_enqueued}"
        self.n_enqueued += 1
        aid = ActionId("acme", "proj", "dev", run, name)
        candidates = [p for p in self.order if p.run == run and p not in self.terminal]
        parent_id = candidates[parent % len(candidates)] if parent is not None and candidates \
            else None
        kw = {"resources": {"cpu": cpu, "memory": mem}}
        if retries is not None:
            kw["retries"] = retries
        if timeouts is not None:
            kw["timeouts"] = timeouts
        if parent_id is not None:
            kw["parent"] = str(parent_id)
        if queue != "main":
            kw["task_queue"] = queue
        spec = ActionSpec(id=str(aid), task="work", **kw)
        assert self.eng.enqueue(spec) == aid
        self.actions[aid] = MAction(aid, spec, queue, (CPUS[cpu], MEMS[mem]))
        self.order.append(aid)
        if parent_id is not None:
            self.actions[parent_id].children.append(aid)
        assert self.eng.attempts(aid)[0].number == 1

    @rule()
    def tick(self):
        self._tick()

    @rule(seconds=STEPS, then_tick=st.booleans())
    def advance_clock(self, seconds, then_tick):
        self.clock.advance(seconds)
        if then_tick:
            self._tick()

    @precondition(lambda self: self.leases and any(self.connected.values()))
    @rule(data=st.data(), after=st.sampled_from([0.0, 0.0, 0.5, 1.0, 2.0]),
          then_report=st.booleans())
    def heartbeat(self, data, after, then_report):
        self.clock.advance(after)   # the worker's beat, some time after the last step
        self._heartbeat(data)
        if then_report:
            self._report(data)

    def _heartbeat(self, data):
        w = data.draw(st.sampled_from(sorted(w for w, c in self.connected.items() if c)))
        presenter = (w, self.session[w])
        held = self.holding[w]
        tokens = []
        if held:
            tokens = list(held) if data.draw(st.booleans()) else data.draw(
                st.lists(st.sampled_from(held), unique=True))
        lost = self.lost[w]
        if lost:
            # still holding leases from before it reconnected (the seed's first race)
            tokens += lost if data.draw(st.booleans()) else data.draw(
                st.lists(st.sampled_from(lost), unique=True))
        known = self._recent()
        forged = []
        if known:
            # stale generations, other workers' tokens, lost sessions', ended ones
            tokens += data.draw(st.lists(st.sampled_from(known), max_size=3))
            for _ in range(data.draw(st.integers(0, 2))):
                token = data.draw(st.sampled_from(known))
                index = data.draw(st.integers(0, 23))
                forged.append(self._edited(token, index, data.draw(st.integers(1, 255))))
        forged += data.draw(st.lists(st.binary(min_size=24, max_size=24), max_size=2))
        tokens += forged
        tokens = data.draw(st.permutations(tokens))
        want = [self.expected(t, presenter) for t in tokens]
        before = self._snapshot() if not any(v == Verdict.OK for v in want) else None
        payload = b"".join(tokens) if data.draw(st.booleans()) else list(tokens)
        refusals = self.eng.heartbeat(w, payload)
        got = [(r.token, r.verdict) for r in refusals]
        assert got == [(t, v) for t, v in zip(tokens, want, strict=True) if v != Verdict.OK]
        accepted = {}
        now = self.now()
        for t, v in zip(tokens, want, strict=True):
            if v == Verdict.OK:
                self._accepted(t, f"heartbeat from {w}")
                lease = self.leases[t]
                assert lease.gen == self.current[lease.key].gen
                accepted.setdefault(lease.key, set()).add(lease.gen)
                lease.expiry_ns = now + TTL_NS
                lease.overdue_since = None
            else:
                self._note_refusal(t, v)
                for mine in (held, lost):
                    if t in mine:
                        mine.remove(t)  # the worker stops the attempt behind a refusal
        assert all(len(g) == 1 for g in accepted.values()), "two generations accepted"
        if before is not None:
            assert self._snapshot() == before, "a heartbeat that accepted nothing changed state"

    @precondition(lambda self: any(not c for c in self.connected.values()))
    @rule(data=st.data())
    def heartbeat_while_disconnected(self, data):
        w = data.draw(st.sampled_from(sorted(w for w, c in self.connected.items() if not c)))
        before = self._snapshot()
        try:
            self.eng.heartbeat(w, list(self.holding[w]))
        except NotFound:
            pass
        else:
            raise AssertionError(f"a heartbeat from disconnected worker {w} was served")
        assert self._snapshot() == before

    @rule(data=st.data(), n=st.integers(1, 4))
    def report(self, data, n):
        for _ in range(n):
            self._report(data)

    def _report(self, data):
        sources = ["forged"]
        held = [t for w, ts in self.holding.items() if self.connected[w] for t in ts]
        if held:
            sources += ["held", "held", "held"]
        late = [t for t in self._recent() if self.expected(t) != Verdict.OK]
        if late:
            sources.append("late")
        if self.ZOMBIE_REPORTS and self.zombies:
            sources += ["zombie", "zombie"]
        source = data.draw(st.sampled_from(sources))
        if source == "forged":
            if self.leases and data.draw(st.booleans()):
                token = self._edited(data.draw(st.sampled_from(self._recent())),
                                     data.draw(st.integers(0, 23)),
                                     data.draw(st.integers(1, 255)))
            else:
                token = data.draw(st.binary(min_size=24, max_size=24))
        else:
            pool = {"held": held, "late": late, "zombie": self.zombies}[source]
            token = data.draw(st.sampled_from(sorted(pool)))
        lease = self.leases.get(token)
        choices = FINALIZE_REPORTS if lease is not None and lease.kind == LeaseKind.FINALIZE \
            else RUN_REPORTS
        phase, kw = data.draw(st.sampled_from(choices))
        cleanup = data.draw(st.booleans())
        if lease is not None and lease.kind == LeaseKind.RUN:
            kw = {**kw, "cleanup": cleanup}
        want = self.expected(token)
        if source == "forged":
            assert want == Verdict.UNKNOWN
        before = self._snapshot() if want != Verdict.OK else None
        got = self.eng.report(token, phase, **kw)
        if source == "zombie" and want == Verdict.OK and got == Verdict.STALE:
            self._note_refusal(token, got)   # the engine may refuse what a lost session
            self._drop(token)                # reports (then it must change nothing)
            return
        assert got == want, f"report {phase} from {source}: {got!r}, expected {want!r}"
        if got != Verdict.OK:
            self._note_refusal(token, got)
            self._drop(token)
            assert self._snapshot() == before, "a refused report changed state"
            return
        self._accepted(token, f"report {phase} ({source})")
        if lease.kind == LeaseKind.FINALIZE:
            if phase != Phase.RUNNING:
                lease.end = "COMPLETED"
                self._drop(token)
                att = self.eng.attempts(lease.action)[lease.attempt - 1]
                assert att.finalize == phase.value
            return
        if phase in (Phase.RUNNING, Phase.INITIALIZING):
            if phase == Phase.RUNNING and not lease.running:
                lease.running = True
                if lease.max_runtime is not None:
                    lease.backstop_ns = self.now() + int(
                        (lease.max_runtime + RUNTIME_GRACE) * 1e9)
            # Phases only move forward: a late INITIALIZING does not undo RUNNING.
            shown = self.eng.phase(lease.action)
            want = Phase.RUNNING if lease.running else Phase.INITIALIZING
            assert shown == want, f"{lease.action}: {phase} reported, shows {shown}"
            return
        lease.end = "COMPLETED"
        lease.cleanup = cleanup
        self._drop(token)
        attempts = self.eng.attempts(lease.action)
        att = attempts[lease.attempt - 1]
        assert att.end_ns == self.now() and att.phase == phase.value
        assert att.error_kind == kw.get("error_kind")
        outcome = self.eng.phase(lease.action)
        if outcome in TERMINAL_PHASES:
            assert len(attempts) == lease.attempt
            if phase == Phase.SUCCEEDED or outcome != Phase.TIMED_OUT:
                assert outcome == phase
        else:
            assert phase != Phase.SUCCEEDED
            assert len(attempts) == lease.attempt + 1, "a retry is exactly one new attempt"

    @rule(data=st.data())
    def abort(self, data):
        if not self.order:
            return
        aid = data.draw(st.sampled_from(self.order))
        subtree, stack = [], [aid]
        while stack:
            a = stack.pop()
            subtree.append(a)
            stack.extend(self.actions[a].children)
        want = {a for a in subtree if self.eng.phase(a) not in TERMINAL_PHASES}
        got = self.eng.abort(aid)
        assert len(got) == len(set(got)) and set(got) == want
        for a in got:
            assert self.eng.phase(a) == Phase.ABORTED
        for lease in self._live_run_leases():
            if lease.action in want:
                lease.end = "ABORTED"

    @precondition(lambda self: any(self.connected.values()))
    @rule(data=st.data())
    def disconnect(self, data):
        w = data.draw(st.sampled_from(sorted(w for w, c in self.connected.items() if c)))
        held = self.eng.unregister_worker(w)
        want = {x.action for x in self._live_run_leases()
                if (x.worker, x.session) == (w, self.session[w])}
        assert sorted(held) == sorted(want)
        self.connected[w] = False

    @rule(w=st.sampled_from(sorted(WORKERS)))
    def reconnect(self, w):
        if w in self.adoptable:     # first registration after a reload: it adopts them
            self._connect(w)
            return
        # A new session: the worker may no longer present what the old one held.
        self.lost[w] += self.holding[w]
        self.zombies += self.holding[w]
        self.holding[w] = []
        self._connect(w)

    @rule(crash=st.booleans(), back=st.lists(st.booleans(), min_size=len(WORKERS),
                                             max_size=len(WORKERS)))
    def restart(self, crash, back):
        """A new engine on the same store, after a close or as after a crash: phases,
        attempts and counts are unchanged; every lease in flight gets a fresh window and
        its worker (those in ``back`` register again at once) adopts it on its return
        (docs/storage.md, "Semantics a restart changes")."""
        before = self._observed()
        store = self.eng.store
        if not crash:
            self.eng.close()
        self.eng = Engine(parse_config(CONFIG, source="<lease-test>"), clock=self.clock,
                          store=MemoryStore(store.partitions, backing=store.backing),
                          secret=bytes(range(16)))
        now = self.now()
        for x in self.current.values():
            if x.live:
                x.expiry_ns, x.overdue_since = now + TTL_NS, None
        # A lease refused EXPIRED only because its window had passed, not swept yet, is in
        # flight for the reload: it gets the fresh window too (not a final refusal).
        for token, verdict in list(self.refused.items()):
            if verdict == Verdict.EXPIRED and self.leases[token].live:
                del self.refused[token]
        self.adoptable = set(WORKERS)
        for w, up in zip(sorted(WORKERS), back, strict=True):
            self.connected[w] = False
            if up:
                self._connect(w)
        assert self._observed() == before, "a reload changed what users see"

    def _observed(self):
        """Phases (waiting reads as queued: a wait reason is the last tick's), attempts,
        queue counts and cluster use."""
        eng = self.eng

        def phase(aid):
            p = eng.phase(aid)
            return Phase.QUEUED if p == Phase.WAITING_FOR_RESOURCES else p
        return ([(aid, phase(aid), eng.attempts(aid)) for aid in self.order],
                {q: {k: m[k] for k in ("actions_in_flight", "runs_in_flight", "depth",
                                       "in_flight_resources")}
                 for q, m in eng.queue_metrics().items()},
                {c: eng.cluster_in_flight(c) for c in CLUSTERS})

    @rule(ahead=st.sampled_from([0.0, 0.0, 1.0, 3.0]),
          between=st.lists(st.sampled_from(["tick", "report", "abort", 1.0, 3.0]),
                           max_size=4),
          data=st.data())
    def apply_stale_expiry_snapshot(self, ahead, between, data):
        """The expiration monitor works from a snapshot (maybe taken for a later time); by
        the time it applies it, leases may have been reported, aborted or extended."""
        snap = self._expiry_snapshot(ahead)
        for step in between:
            if step == "tick":
                self._tick()
            elif isinstance(step, float):
                self.clock.advance(step)
            elif step == "report":
                self._report(data)
            else:
                self.abort(data)
        self._apply_snapshot(snap)

    @rule()
    def apply_expiry_snapshot_older_than_a_reassignment(self):
        """The seed's race: the monitor's snapshot is older than a reassignment, and by the
        time it is applied the new generation is past its own expiry too."""
        snap = self._expiry_snapshot(3.0)  # what will have expired 3 s from now
        self.clock.advance(3.0)
        self._tick()                        # swept: retried after its backoff (<= 4 s)
        self.clock.advance(4.0)
        self._tick()                        # reassigned: a new generation
        self.clock.advance(3.0)             # which expired too, unswept
        self._apply_snapshot(snap)

    def _expiry_snapshot(self, ahead):
        at = self.now() + int(ahead * 1e9)
        snap = self.eng.expired_leases(now=at)
        live = {lease_of(x.token): x for x in self.current.values() if x.live}
        assert {(k, r, g) for k, r, g, _w in snap} == {
            key for key, x in live.items() if x.expiry_ns < at}
        return snap

    def _apply_snapshot(self, snap):
        for entry in snap:
            lease = next((x for x in self.current.values()
                          if lease_of(x.token) == tuple(entry[:3])), None)
            want = lease is not None and lease.live and lease.expiry_ns < self.now()
            assert self.eng.expire(entry) == want, f"expire({entry}) should be {want}"
            if want:
                lease.end = "EXPIRED"

    # ------------------------------------------------------------------ invariants

    @invariant()
    def lease_and_history_properties(self):
        self.check()

    def check(self):
        eng = self.eng
        # In-flight counts equal a recount of the live run leases.
        live = self._live_run_leases()
        metrics = eng.queue_metrics()
        for q in QUEUE_CLUSTERS:
            mine = [x for x in live if x.queue == q]
            m = metrics[q]
            assert m["actions_in_flight"] == len(mine), (q, m, len(mine))
            assert m["runs_in_flight"] == len({x.action.run_key for x in mine})
            assert m["in_flight_resources"] == {
                "cpu": sum(self.actions[x.action].demand[0] for x in mine),
                "memory": sum(self.actions[x.action].demand[1] for x in mine)}
        for c in CLUSTERS:
            mine = [x for x in live if x.cluster == c]
            assert eng.cluster_in_flight(c) == {
                "cpu": sum(self.actions[x.action].demand[0] for x in mine),
                "memory": sum(self.actions[x.action].demand[1] for x in mine)}, c
        live_actions = {x.action: x for x in live}
        assert len(live_actions) == len(live), "an action with two live run leases"
        for aid in self.order:
            self.check_action(aid, live_actions.get(aid))

    def check_action(self, aid, live_lease):
        eng = self.eng
        rec = self.actions[aid]
        phase = eng.phase(aid)
        atts = eng.attempts(aid)
        history = [(a.number, a.generation, a.end_ns, a.phase, a.error_kind, a.cause)
                   for a in atts]
        # Attempts: 1..n, every assignment one attempt, generations in assignment order.
        assert [a.number for a in atts] == list(range(1, len(atts) + 1))
        assert [a.generation for a in atts if a.generation] == self.run_gens.get(aid, [])
        assert all(a.end_ns is not None for a in atts[:-1])
        # Terminal exactly once, never changed after.
        if aid in self.terminal:
            first, frozen = self.terminal[aid]
            assert phase == first, f"{aid} ended {first}, now {phase}"
            assert history == frozen, f"{aid}: history changed after it ended"
        elif phase in TERMINAL_PHASES:
            self.terminal[aid] = (phase, history)
        if phase in TERMINAL_PHASES:
            assert live_lease is None, f"{aid} is {phase} with a live run lease"
            assert atts[-1].end_ns is not None
        elif live_lease is not None:
            want = Phase.RUNNING if live_lease.running else Phase.INITIALIZING
            assert phase == want, f"{aid}: {phase}, its lease says {want}"
            assert atts[-1].end_ns is None and atts[-1].generation == live_lease.gen
        else:
            assert phase in (Phase.QUEUED, Phase.WAITING_FOR_RESOURCES), (aid, phase)
            assert atts[-1].end_ns is None and not atts[-1].generation
        # Retries: only failed attempts are retried, within the policy, after the backoff.
        policy = rec.spec.retries
        user = system = 0
        for prev, nxt in zip(atts, atts[1:], strict=False):
            assert prev.phase in (Phase.FAILED.value, Phase.TIMED_OUT.value), prev
            assert prev.cause not in ("deadline", "UNSCHEDULABLE"), prev
            if prev.error_kind == "SYSTEM":
                system += 1
            else:
                assert prev.recoverable, prev
                user += 1
            n = user + system - 1
            delay = min(policy.backoff_base * policy.backoff_factor ** n, policy.backoff_cap)
            assert nxt.enqueued_ns == prev.end_ns + int(delay * 1e9), (prev, nxt)
        assert system <= SYSTEM_RETRIES and user <= policy.count, (aid, user, system)
        if phase in (Phase.SUCCEEDED, Phase.ABORTED, Phase.FAILED):
            assert atts[-1].phase == phase.value
        # ... and no retry is lost: a failure with budget left ends the action only when
        # the retry would be due after the deadline.
        last = atts[-1]
        if (phase in (Phase.FAILED, Phase.TIMED_OUT)
                and last.cause not in ("deadline", "UNSCHEDULABLE")):
            if last.error_kind == "SYSTEM":
                left = system < SYSTEM_RETRIES
            else:
                left = last.recoverable and user < policy.count
            if left:
                n = user + system
                delay = min(policy.backoff_base * policy.backoff_factor ** n,
                            policy.backoff_cap)
                deadline = rec.spec.timeouts.deadline
                assert phase == Phase.TIMED_OUT and deadline is not None, (aid, phase, last)
                assert last.end_ns + int(delay * 1e9) >= atts[0].enqueued_ns + int(
                    deadline * 1e9), (aid, last)

    # ------------------------------------------------------------------ teardown

    def _all_done(self):
        if any(x.live for x in self.current.values()):
            return False
        for aid in self.order:
            if self.eng.phase(aid) not in TERMINAL_PHASES:
                return False
            if any(a.finalize in ("PENDING", "SENT") for a in self.eng.attempts(aid)):
                return False
        return True

    def teardown(self):
        eng = self.eng
        for w, up in list(self.connected.items()):
            if not up:
                self.reconnect(w)
        last, stalled = None, 0
        for _ in range(100):
            if self._all_done() or stalled >= 3:   # done, or nothing moves any more
                break
            # Every holder reports what it holds; what a lost session held expires.
            for w in WORKERS:
                for token in list(self.holding[w]):
                    if self.expected(token, (w, self.session[w])) == Verdict.OK:
                        assert eng.report(token, Phase.SUCCEEDED) == Verdict.OK
                        self.leases[token].end = "COMPLETED"
                    self.holding[w].remove(token)
            self.clock.advance(TTL_NS / 1e9 + 1.0)   # past every expiry and backoff
            self._tick()
            self.check()
            # Attempts count as progress: a retry can time out (max_queued_time) before any
            # tick sees it when the clock jumps, and still end once its retries run out.
            progress = (len(self.leases),
                        [(eng.phase(a), len(eng.attempts(a))) for a in self.order])
            stalled = stalled + 1 if progress == last else 0
            last = progress
        assert self._all_done(), "work left after teardown: " + ", ".join(
            f"{a}={eng.phase(a)}" for a in self.order if eng.phase(a) not in TERMINAL_PHASES)
        for q, m in eng.queue_metrics().items():
            assert m["actions_in_flight"] == 0 and m["runs_in_flight"] == 0, (q, m)
            assert set(m["in_flight_resources"].values()) == {0}, (q, m)
        for c in CLUSTERS:
            assert set(eng.cluster_in_flight(c).values()) == {0}, c
        # Cleanup: every attempt that ended by expiry, abort or a report asking for it got a
        # finalize lease, which ran to an end; the others got none.
        for lease in self.leases.values():
            if lease.kind != LeaseKind.RUN:
                continue
            att = eng.attempts(lease.action)[lease.attempt - 1]
            if lease.end in ("EXPIRED", "ABORTED") or lease.cleanup:
                assert att.finalize in ("SUCCEEDED", "FAILED"), (lease.action, att)
            else:
                assert att.finalize is None, (lease.action, att)
        # No slot leaked: every connected worker takes as many new leases as it offered.
        slots = sum(s for _c, s in WORKERS.values())
        eng.enqueue_many([ActionSpec(id=f"acme/proj/dev/free/s{i}", task="probe")
                          for i in range(slots + 1)])
        placed = eng.tick()
        per_worker = {w: sum(1 for a in placed if a.worker == w) for w in WORKERS}
        assert per_worker == {w: s for w, (_c, s) in WORKERS.items()}, per_worker


class ZombieLeaseMachine(LeaseMachine):
    """As above, and a worker that reconnected may still report what its lost session held
    (a zombie pod of the old session finishing). A token the engine refused (STALE) to the
    new session must not be accepted in a report afterwards."""

    ZOMBIE_REPORTS = True


# LEASEHOLD_PROP_EXAMPLES / _STEPS raise the example count / length for a long local hunt.
SETTINGS = settings(max_examples=int(os.environ.get("LEASEHOLD_PROP_EXAMPLES", 100)),
                    stateful_step_count=int(os.environ.get("LEASEHOLD_PROP_STEPS", 40)),
                    deadline=None,
                    report_multiple_bugs=False,  # shrink one failure, not every distinct one
                    phases=[Phase_.explicit, Phase_.reuse, Phase_.generate, Phase_.shrink],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
LeaseMachine.TestCase.settings = SETTINGS
ZombieLeaseMachine.TestCase.settings = SETTINGS
TestLeaseLifecycle = LeaseMachine.TestCase
TestLeaseLifecycleWithZombieReports = ZombieLeaseMachine.TestCase


# ------------------------------------------------------------------ focused properties


def _one_lease(**spec):
    eng, clock = new_engine()
    for w, (cluster, slots) in WORKERS.items():
        eng.register_worker(w, cluster, slots)
    eng.enqueue(ActionSpec(id="acme/proj/dev/r/a", task="work",
                           resources={"cpu": 1}, **spec))
    (a,) = eng.tick()
    return eng, clock, a


@settings(max_examples=100, deadline=None)
@given(index=st.integers(0, 23), flip=st.integers(1, 255), field=st.sampled_from(["hb", "rp"]))
def test_any_edited_byte_makes_a_token_unknown(index, flip, field):
    eng, _clock, a = _one_lease()
    edited = bytearray(a.token)
    edited[index] ^= flip
    edited = bytes(edited)
    if field == "hb":
        refusals = eng.heartbeat(a.worker, [edited, a.token])
        assert [(r.token, r.verdict) for r in refusals] == [(edited, Verdict.UNKNOWN)]
    else:
        assert eng.report(edited, Phase.SUCCEEDED) == Verdict.UNKNOWN
        assert eng.phase(a.action) == Phase.INITIALIZING
    assert eng.heartbeat(a.worker, [a.token]) == []   # the real one is still good


def test_forging_the_current_generation_from_a_stale_token_is_unknown():
    eng, clock, a = _one_lease(retries=RetryPolicy(count=1, backoff_base=0.5))
    assert eng.report(a.token, Phase.FAILED, error_kind="USER") == Verdict.OK
    clock.advance(1)
    (b,) = [x for x in eng.tick() if x.kind == LeaseKind.RUN]
    assert b.generation == a.generation + 1
    forged = a.token[:8] + b.token[8:16] + a.token[16:]   # old MAC, new generation
    assert eng.report(forged, Phase.SUCCEEDED) == Verdict.UNKNOWN
    assert eng.report(a.token, Phase.SUCCEEDED) == Verdict.STALE
    assert [(r.verdict) for r in eng.heartbeat(b.worker, [forged, a.token, b.token])] == [
        Verdict.UNKNOWN, Verdict.STALE]
    assert eng.report(os.urandom(24), Phase.SUCCEEDED) == Verdict.UNKNOWN
    assert eng.phase(a.action) == Phase.INITIALIZING


def test_a_token_refused_after_a_reconnect_is_not_accepted_by_a_report():
    """Seed: a worker reconnects still holding leases from before; its heartbeats carry the
    old session and are refused, so it drops them. The engine must not accept a report on a
    token it has just refused (the reconnect ended the old session's leases as expired)."""
    eng, _clock, a = _one_lease()
    eng.register_worker(a.worker, *WORKERS[a.worker])          # reconnect: a new session
    (refusal,) = eng.heartbeat(a.worker, [a.token])
    assert refusal.verdict == Verdict.EXPIRED
    assert eng.report(a.token, Phase.SUCCEEDED) == Verdict.EXPIRED


def test_max_queued_time_ending_one_action_keeps_the_rest_of_its_queue():
    """An action whose max_queued_time passes (no retries) leaves the queue; the action
    queued before it in the same run must stay queued and be placed."""
    eng, clock = new_engine()                       # no worker yet: both wait
    first = eng.enqueue(ActionSpec(id="acme/proj/dev/r/a", task="work"))
    late = eng.enqueue(ActionSpec(id="acme/proj/dev/r/b", task="work",
                                  timeouts=Timeouts(max_queued_time=1.0)))
    assert eng.queue_metrics("main")["depth"] == 2
    clock.advance(2)
    assert eng.tick() == []
    assert eng.phase(late) == Phase.TIMED_OUT
    assert eng.queue_metrics("main")["depth"] == 1
    eng.register_worker("w1", *WORKERS["w1"])
    assert [a.action for a in eng.tick()] == [first]


def test_a_late_initializing_report_does_not_move_a_running_attempt_back():
    """Reports may arrive out of order; phases shown to users only move forward."""
    eng, _clock, a = _one_lease()
    assert eng.report(a.token, Phase.RUNNING) == Verdict.OK
    assert eng.phase(a.action) == Phase.RUNNING
    assert eng.report(a.token, Phase.INITIALIZING) == Verdict.OK
    assert eng.phase(a.action) == Phase.RUNNING
