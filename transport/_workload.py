"""The devbox's bundled example workload (``leasehold devbox``, ``docs/devbox.md``).

Four steps, run one after the other through :class:`~transport.Client` on a single-cluster
devbox, with every action's demand a fraction of the cluster's CPU (``u`` = an eighth of it),
so the same picture comes out on any machine:

1. **fan-out over two queues**: 16 ``etl`` actions (2u, 0.6-1.2 s) in ``batch`` (priority 300)
   are enqueued first, then 24 ``lookup`` actions (1u, 0.15-0.35 s) in ``interactive``
   (priority MAX); the cluster holds 8u, so both wait, and freed capacity goes to the
   higher-priority queue first.
2. **a gang held under STRICT_FIFO, backfill in the gap** (queue ``train``, backfill on): a
   4u ``etl`` blocker runs; a gang of 2 pods x 4u (the whole cluster) is the head and waits,
   holding the cluster, with an estimated start from the blocker's declared
   ``runtime_estimate``; behind it one more ``etl`` (3u, a size no task ran at yet: no
   history, no prior of its shape, nothing proves it ends in time) may not pass it (head of
   line), while 6 ``lookup``
   actions (1u), predicted by their history (step 1) to end before, are backfilled into the
   idle capacity.
3. **a warm pool reused**: 6 ``python`` actions of one reusable environment (1 replica, 2 calls
   at once) run ``devbox_tasks:score``: the first starts the pool process, the follow-ons
   run in it (each call writes its pid).
4. **a failure retried**: a ``sim`` action declared to fail (USER) on its first attempt, with
   one retry: attempt 1 fails, attempt 2 succeeds.

Progress is fed by the watch stream (``Client.subscribe`` / ``next_event``), never by polling;
waits are read from ``Client.explain`` while the actions wait. The summary is computed from
what the client saw: the events (phases, attempts, times on the shard's clock), the
explanations, and the pool's pid file.
"""

import statistics
import time
from dataclasses import dataclass, field

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from engine._codes import TERMINAL_PHASES, Phase, WaitCode
from engine._errors import LeaseholdError
from transport._worker import ShardTimeout

__all__ = ["ExampleWorkload", "WorkloadFailed", "WORKLOADS"]

RUN = "devbox/demo/dev"
_STEP_TIMEOUT_S = 60.0


class WorkloadFailed(LeaseholdError):
    """The workload did not end as it should (an action failed, a step did not finish)."""

    code = "WORKLOAD_FAILED"


@dataclass
class _Seen:
    """One action as the client saw it."""

    step: str
    queue: str
    task: str
    queued_ns: int | None = None
    started_ns: int | None = None     # first INITIALIZING (assignment)
    ended_ns: int | None = None
    phase: str | None = None          # the last phase seen
    attempts: int = 0                 # the highest attempt number seen
    retried: bool = False             # QUEUED again after it had been assigned


@dataclass
class _Explained:
    action: str
    phase: str
    code: str | None
    reason: str
    eta_s: float | None


@dataclass
class Summary:
    """What the example workload saw; :meth:`lines` prints it."""

    actions: int
    outcomes: dict
    elapsed_s: float
    waits: dict                       # queue -> [seconds enqueue to assignment]
    reasons: dict                     # wait code -> an example reason
    retries: int
    backfilled: int
    gang_wait_s: float | None
    gang_eta_s: float | None
    pool_pids: list
    explained: list = field(default_factory=list)

    @property
    def ok(self):
        return self.outcomes.get("SUCCEEDED", 0) == self.actions

    def lines(self):
        out = []
        rate = self.actions / self.elapsed_s if self.elapsed_s > 0 else 0.0
        outcome = ", ".join(f"{n} {k}" for k, n in sorted(self.outcomes.items()))
        out.append(f"summary: {self.actions} actions, {outcome}; {self.retries} "
                   f"retr{'y' if self.retries == 1 else 'ies'}; {self.elapsed_s:.1f}s from the "
                   f"first enqueue to the last completion seen ({rate:.1f} actions/s; the sim "
                   f"durations set the pace)")
        for q, ws in sorted(self.waits.items()):
            out.append(f"  queue {q}: {len(ws)} assigned, wait enqueue->assignment "
                       f"mean {statistics.fmean(ws):.2f}s, max {max(ws):.2f}s")
        for code, reason in sorted(self.reasons.items()):
            out.append(f"  reason seen: {code}: {reason}")
        if self.gang_wait_s is not None:
            eta = "unknown" if self.gang_eta_s is None else f"{self.gang_eta_s:.2f}s"
            out.append(f"  gang: held the line {self.gang_wait_s:.2f}s (estimated start "
                       f"shown: {eta}); {self.backfilled} short actions backfilled meanwhile")
        if self.pool_pids:
            pids = sorted(set(self.pool_pids))
            out.append(f"  warm pool: {len(self.pool_pids)} calls ran in {len(pids)} "
                       f"process(es) (pid {', '.join(map(str, pids))})")
        return out


class ExampleWorkload:
    """The example workload (see the module text) on ``client``, whose cluster has
    ``cpu_millis`` of CPU; ``pool_file`` is where the pool's calls write their pids;
    ``console`` a rich Console."""

    name = "example"

    def __init__(self, client, cpu_millis, pool_file, console):
        self.client = client
        self.u = max(1, int(cpu_millis) // 8)
        self.pool_file = pool_file
        self.console = console
        self.seen = {}              # action id -> _Seen
        self.explained = []         # _Explained, in order
        self.progress = None
        self._bars = {}             # step -> rich task id
        self._first_ns = None
        self._last_ns = None

    # ------------------------------------------------------------------ plumbing

    def _spec(self, run, name, task, queue, execute, cpu_u, **kw):
        return {"id": f"{RUN}/{run}/{name}", "task": task, "task_queue": queue,
                "resources": {"cpu": f"{cpu_u * self.u}m", "memory": "128Mi"},
                "execute": execute, **kw}

    def _track(self, step, specs):
        for s in specs:
            self.seen[s["id"]] = _Seen(step, s["task_queue"], s["task"])
        self._bars[step] = self.progress.add_task(step, total=len(specs), note="")

    def _note(self, step, text):
        self.progress.update(self._bars[step], note=text)

    def _say(self, text):
        self.progress.console.print(text, highlight=False)

    def _enqueue(self, specs):
        self.client.enqueue_many(specs)

    def _on(self, e):
        s = self.seen.get(e.action)
        if s is None:
            return
        ph = e.phase
        if ph == Phase.QUEUED:
            if s.queued_ns is None:
                s.queued_ns = e.time_ns
                if self._first_ns is None or e.time_ns < self._first_ns:
                    self._first_ns = e.time_ns
            elif s.started_ns is not None:
                s.retried = True
        elif ph == Phase.INITIALIZING and s.started_ns is None:
            s.started_ns = e.time_ns
        if e.attempt:
            s.attempts = max(s.attempts, int(e.attempt))
        was_done = s.phase in TERMINAL_PHASES
        s.phase = ph
        if ph in TERMINAL_PHASES and not was_done:
            s.ended_ns = e.time_ns
            self._last_ns = max(self._last_ns or 0, e.time_ns)
            self.progress.advance(self._bars[s.step])

    def _pump(self, ids, timeout=_STEP_TIMEOUT_S, until=None):
        """Take events until every action of ``ids`` is terminal, or ``until()`` when given;
        at most ``timeout`` seconds."""
        def ended():
            return all(self.seen[a].phase in TERMINAL_PHASES for a in ids)
        done = until if until is not None else ended
        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                late = [a for a in ids if self.seen[a].phase not in TERMINAL_PHASES]
                what = (f"e.g. {late[0]}: {self.seen[late[0]].phase}" if late
                        else "the step's condition")
                raise WorkloadFailed(f"step not done within {timeout:g}s ({what})")
            try:
                self._on(self.client.next_event(timeout=left))
            except ShardTimeout:
                continue            # the deadline: reported above with what is late

    def _events_for(self, seconds):
        """Take the events that come within ``seconds`` (none may come)."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                self._on(self.client.next_event(timeout=left))
            except ShardTimeout:
                return

    def _explain(self, action):
        e = self.client.explain(action)
        code = WaitCode(e["wait"]).name if e.get("wait") is not None else None
        eta = None
        if e.get("eta_ns") is not None:
            eta = max(0.0, (e["eta_ns"] - time.time_ns()) / 1e9)
        x = _Explained(action, e["phase"], code, e["reason"], eta)
        self.explained.append(x)
        return x

    def _show(self, label, x):
        eta = "" if x.eta_s is None else f" [ETA {x.eta_s:.1f}s]"
        self._say(f"  [bold]{label}[/] {x.action.rsplit('/', 2)[-2]}/"
                  f"{x.action.rsplit('/', 1)[-1]}: {x.phase}{' ' + x.code if x.code else ''}"
                  f"{eta}\n"
                  f"    {x.reason}")

    # ------------------------------------------------------------------ the steps

    def run(self):
        """Run the four steps; returns the :class:`Summary`."""
        columns = (TextColumn("{task.description:<28}"), BarColumn(bar_width=30),
                   MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.fields[note]}"))
        with Progress(*columns, console=self.console, transient=False) as progress:
            self.progress = progress
            for run in ("fanout", "train", "pool", "flaky"):
                self.client.subscribe(f"{RUN}/{run}")   # before enqueueing: every event
            self._fanout()
            gang = self._gang()
            pids = self._pool()
            self._retry()
        return self._summary(gang, pids)

    def _fanout(self):
        step = "1 fan-out, two priorities"
        batch = [self._spec("fanout", f"etl-{i:02d}", "etl", "batch",
                            {"plugin": "sim", "duration": [0.6, 1.2]}, 2) for i in range(16)]
        inter = [self._spec("fanout", f"lookup-{i:02d}", "lookup", "interactive",
                            {"plugin": "sim", "duration": [0.15, 0.35]}, 1) for i in range(24)]
        self._track(step, batch + inter)
        self._say(f"[bold]step 1[/]: 16 etl actions in queue batch (priority 300), then 24 "
                  f"lookups in queue interactive (priority MAX), on a cluster holding "
                  f"{8 * self.u}m CPU")
        self._enqueue(batch)
        self._enqueue(inter)
        self._show("waiting:", self._explain(batch[-1]["id"]))
        self._show("waiting:", self._explain(inter[-1]["id"]))
        self._pump([s["id"] for s in batch + inter])

    def _gang(self):
        step = "2 gang + backfill"
        # It declares how long it runs: the head's estimated start comes from it (its task
        # has no history at this size: history is per task and shape).
        blocker = self._spec("train", "blocker", "etl", "train",
                             {"plugin": "sim", "duration": 1.2}, 4, runtime_estimate=1.2)
        gang = {"id": f"{RUN}/train/gang", "task": "train", "task_queue": "train",
                "pods": [{"role": "worker", "replicas": 2,
                          "resources": {"cpu": f"{4 * self.u}m", "memory": "128Mi"}}],
                "execute": {"plugin": "sim", "duration": 1.0}}
        # A size no task ran at yet: no history of its own, no prior of its shape.
        held = self._spec("train", "etl-after", "etl", "train",
                          {"plugin": "sim", "duration": 0.5}, 3)
        shorts = [self._spec("train", f"short-{i}", "lookup", "train",
                             {"plugin": "sim", "duration": [0.15, 0.35]}, 1) for i in range(6)]
        self._track(step, [blocker, gang, held, *shorts])
        self._say("[bold]step 2[/]: queue train (STRICT_FIFO, backfill): a blocker holds half "
                  "the cluster; a gang of 2 pods needs all of it")
        self._enqueue([blocker])
        self._pump([], until=lambda: self.seen[blocker["id"]].started_ns is not None,
                   timeout=10)
        self._enqueue([gang, held, *shorts])
        g = self._explain(gang["id"])
        self._show("held:", g)
        self._note(step, f"gang: {g.code}")
        # What waits behind the head: sampled while the shorts run (head of line while there
        # is room the hold keeps; plain capacity while the backfilled shorts fill it).
        deadline = time.monotonic() + 1.0
        h = self._explain(held["id"])
        while h.code != WaitCode.HEAD_OF_LINE.name and time.monotonic() < deadline \
                and self.seen[gang["id"]].started_ns is None:
            self._events_for(0.05)
            h = self._explain(held["id"])
        self._show("behind it:", h)
        self._pump([gang["id"]], until=lambda: self.seen[gang["id"]].started_ns is not None)
        self._note(step, "gang started")
        self._pump([s["id"] for s in (blocker, gang, held, *shorts)])
        return gang["id"], held["id"], [s["id"] for s in shorts], g

    def _pool(self):
        step = "3 warm pool reused"
        execute = {"plugin": "python", "function": "devbox_tasks:score",
                   "args": {"out": str(self.pool_file)}}
        reuse = {"replicas": 1, "concurrency": 2, "idle_ttl": 30}
        specs = [self._spec("pool", f"score-{i}", "score", "interactive", execute, 1,
                            environment="scorer", reuse=reuse) for i in range(6)]
        self._track(step, specs)
        self._say("[bold]step 3[/]: 6 python actions of one reusable environment: the first "
                  "starts the pool, the follow-ons run in it")
        self._enqueue(specs[:1])
        self._pump([specs[0]["id"]])
        self._enqueue(specs[1:])
        self._pump([s["id"] for s in specs])
        try:
            lines = self.pool_file.read_text().splitlines()
        except OSError as exc:
            raise WorkloadFailed(f"the pool's calls left no pid file {self.pool_file}: "
                                 f"{exc.strerror}") from None
        return [int(line.split()[0]) for line in lines if line.strip()]

    def _retry(self):
        step = "4 failure retried"
        spec = self._spec("flaky", "flaky", "flaky", "interactive",
                          {"plugin": "sim", "duration": 0.2, "fail": "USER",
                           "fail_attempts": 1}, 1,
                          retries={"count": 1, "backoff_base": 0.2})
        self._track(step, [spec])
        self._say("[bold]step 4[/]: an action declared to fail on its first attempt, with "
                  "one retry")
        self._enqueue([spec])
        s = self.seen[spec["id"]]
        self._pump([spec["id"]], until=lambda: s.retried)
        if s.retried and s.phase not in TERMINAL_PHASES:
            self._show("retrying:", self._explain(spec["id"]))
        self._pump([spec["id"]])

    # ------------------------------------------------------------------ summary

    def _summary(self, gang, pids):
        gang_id, _held, shorts, g = gang
        outcomes = {}
        waits = {}
        for s in self.seen.values():
            outcomes[s.phase] = outcomes.get(s.phase, 0) + 1
            if s.started_ns is not None and s.queued_ns is not None:
                waits.setdefault(s.queue, []).append((s.started_ns - s.queued_ns) / 1e9)
        reasons = {}
        for x in self.explained:
            if x.code is not None and x.code not in reasons:
                reasons[x.code] = x.reason
        gs = self.seen[gang_id]
        backfilled = sum(1 for a in shorts if self.seen[a].started_ns is not None
                         and gs.started_ns is not None
                         and self.seen[a].started_ns < gs.started_ns)
        elapsed = ((self._last_ns - self._first_ns) / 1e9
                   if self._first_ns is not None and self._last_ns is not None else 0.0)
        return Summary(
            actions=len(self.seen), outcomes=outcomes, elapsed_s=elapsed, waits=waits,
            reasons=reasons,
            retries=sum(max(0, s.attempts - 1) for s in self.seen.values()),
            backfilled=backfilled,
            gang_wait_s=(gs.started_ns - gs.queued_ns) / 1e9
            if gs.started_ns and gs.queued_ns else None,
            gang_eta_s=g.eta_s, pool_pids=pids, explained=self.explained)


#: The bundled workloads, by ``--workload`` name.
WORKLOADS = {ExampleWorkload.name: ExampleWorkload}
