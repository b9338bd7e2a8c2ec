"""A seeded, steady-state scheduling workload for the benchmarks in this directory.

Shared by ``bench/tick.py``, ``bench/test_kernels.py`` and ``bench/callgrind_tick.py``.

Shape of the workload (all drawn from one seed, so a replay is the same workload):

* resources ``cpu, memory, ephemeral_storage, gpu:H100, gpu:A100``;
* 3 clusters with known capacities and node shapes: ``east`` (16 H100x8 + 32 cpu nodes, an
  explicit capacity a little under the shapes' sum), ``west`` (8 A100x8 + 4 H100x8 + 24 cpu
  nodes, capacity derived from the shapes) and ``central`` (cpu-only, 104 nodes, explicit
  capacity; like the example config's cpu-pool); each has 4 workers of 1,000 lease slots
  (plenty: with the gate on, resources bind long before slots do);
* 100 queues, priorities 0..1000, a mix of STRICT_FIFO and GREEDY_CAPACITY, some with
  ``action_concurrency``, ``run_concurrency`` and ``max_resources``/``max_accelerators``:
  60 cpu queues (small cpu actions), 20 H100 and 14 A100 queues (single pods of 1-8 GPUs and
  gangs of 2-4 pods x 8 GPUs), 6 warm-pool queues (one reusable environment each);
* each queue keeps a few live runs (some with ``run_max_action_concurrency``); new actions join
  one of them, and runs are retired and replaced as the workload moves on;
* a small fraction (0.5%) of GPU actions ask for a pod no node shape can hold (a real-world
  mistake), so the engine's UNSCHEDULABLE path runs now and then, as it would in production;
* runtimes (in ticks): cpu 20-200, single GPU pods 50-400, gangs 100-600, warm-pool 5-50.

Steady state: every queue is topped up to ``pending_per_queue`` (10, so 1,000 pending in all)
after each tick; assignments are drained, marked running and completed after a duration drawn
at enqueue (in ticks); the virtual clock advances ``dt`` seconds per tick. With the gate on,
cluster resources are saturated, so each tick places roughly what the previous ones freed
(~45-50) and the rest of the ~280 candidates it examines are told why they wait (mostly
head-of-line behind blocked STRICT_FIFO gang heads, then cluster capacity, run caps, budgets;
a queue of which nothing more can be placed is not examined past its blocked head).

Each queue has its own random stream, so the n-th action of a queue is the same action in every
run with the same seed whatever the scheduling decisions were (that is what makes the
``resource_gate = "off"`` replay in ``tick.py`` the same workload).
"""

import heapq
import random
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine import ActionSpec, Engine, ManualClock, PodGroup, ReusePolicy, parse_config  # noqa: E402
from storage import MemoryStore  # noqa: E402

__all__ = ["Workload", "build_config", "SEED"]

SEED = 20240601
N_QUEUES = 100
KINDS = ("cpu",) * 60 + ("h100",) * 20 + ("a100",) * 14 + ("pool",) * 6
WORKERS_PER_CLUSTER = 4
SLOTS_PER_WORKER = 1000
UNSCHEDULABLE_RATE = 0.005   # fraction of GPU actions whose pod fits no node shape
RUN_RETIRE_RATE = 0.02       # chance a new action retires one of its queue's live runs
RUNS_PER_QUEUE = 3
MAX_RUNTIME_TICKS = 600      # longest runtime drawn below (gangs)
# Share of STRICT_FIFO queues per kind (gang training is the classic strict-FIFO user).
STRICT_SHARE = {"cpu": 0.3, "h100": 0.5, "a100": 0.5, "pool": 0.0}

H100X8 = {"cpu": 190, "memory": "1900Gi", "ephemeral_storage": "25Ti", "gpu:H100": 8}
A100X8 = {"cpu": 94, "memory": "1100Gi", "ephemeral_storage": "7Ti", "gpu:A100": 8}
CPU96 = {"cpu": 94, "memory": "360Gi", "ephemeral_storage": "1Ti"}
CPU64 = {"cpu": 62, "memory": "240Gi", "ephemeral_storage": "1Ti"}

CPU32 = {"cpu": 30, "memory": "120Gi", "ephemeral_storage": "500Gi"}

CLUSTERS = {
    "east": {
        # Explicit capacity a little under the node-shape sum (headroom for system pods).
        "capacity": {"cpu": 5800, "memory": "40Ti", "ephemeral_storage": "400Ti",
                     "gpu:H100": 128},
        "node_shapes": [
            {"name": "h100x8", "count": 16, "allocatable": H100X8},
            {"name": "cpu96", "count": 32, "allocatable": CPU96},
        ],
    },
    "west": {
        # No capacity table: derived as the sum of count x allocatable.
        "node_shapes": [
            {"name": "a100x8", "count": 8, "allocatable": A100X8},
            {"name": "h100x8", "count": 4, "allocatable": H100X8},
            {"name": "cpu64", "count": 24, "allocatable": CPU64},
        ],
    },
    "central": {
        # A cpu-only cluster (like the example config's cpu-pool).
        "capacity": {"cpu": 6000, "memory": "24Ti", "ephemeral_storage": "80Ti"},
        "node_shapes": [
            {"name": "cpu96", "count": 40, "allocatable": CPU96},
            {"name": "cpu32", "count": 64, "allocatable": CPU32},
        ],
    },
}
GPU_CLUSTERS = {"h100": ("east", "west"), "a100": ("west",)}
GPU_NAME = {"h100": "H100", "a100": "A100"}


def _subset(rng, names):
    """A non-empty random subset of ``names`` (in their order)."""
    while True:
        out = [n for n in names if rng.random() < 0.6]
        if out:
            return out


def build_config(seed=SEED, resource_gate="enforce", max_candidates=4096, dt=0.1,
                 admission="shapes"):
    """The config mapping (as TOML would parse it) and per-queue metadata for the workload.
    ``admission``: every cluster's ``admission`` ("nodes": pods placed on nodes by the gate,
    docs/nodes.md; the warm-pool queues' actions then never fit, see bench/README.md)."""
    rng = random.Random(seed)
    queues, meta = {}, []
    for i, kind in enumerate(KINDS):
        name = f"q{i:03d}-{kind}"
        table = {
            "priority": rng.randrange(0, 1001),
            "scheduling": ("STRICT_FIFO" if rng.random() < STRICT_SHARE[kind]
                           else "GREEDY_CAPACITY"),
            "depth": 5000,
        }
        if kind == "cpu":
            table["clusters"] = _subset(rng, list(CLUSTERS))
            if rng.random() < 0.35:
                table["max_resources"] = {"cpu": rng.choice([64, 128, 256, 512]),
                                          "memory": rng.choice(["512Gi", "1Ti", "2Ti"])}
            if rng.random() < 0.3:
                table["action_concurrency"] = rng.choice([20, 50, 100, 200])
        elif kind in ("h100", "a100"):
            table["clusters"] = _subset(rng, list(GPU_CLUSTERS[kind]))
            if rng.random() < 0.4:
                # At least one 4 x 8 gang's worth, so no gang is refused by the queue cap.
                table["max_accelerators"] = {f"gpu:{GPU_NAME[kind]}": rng.choice([32, 48, 64])}
                table["max_resources"] = {"cpu": 1024}
            if rng.random() < 0.3:
                table["action_concurrency"] = rng.choice([8, 16, 32])
        else:  # pool
            table["clusters"] = _subset(rng, list(CLUSTERS))
            if rng.random() < 0.5:
                table["action_concurrency"] = 64
        if rng.random() < 0.25:
            table["run_concurrency"] = rng.choice([2, 3, 5])
        queues[name] = table
        meta.append((name, kind))
    engine = {"default_queue": meta[0][0], "resource_gate": resource_gate,
              "max_candidates": max_candidates, "initial_capacity": 65536}
    data = {
        "resources": ["cpu", "memory", "ephemeral_storage", "gpu:H100", "gpu:A100"],
        "engine": engine,
        "clusters": (CLUSTERS if admission == "shapes" else
                     {name: {**c, "admission": admission} for name, c in CLUSTERS.items()}),
        "queues": queues,
    }
    return data, meta


class _QueueStream:
    """The action stream of one queue: its own RNG, its live runs, its environment."""

    def __init__(self, seed, index, name, kind, allowed, plain_pools=False):
        self.rng = random.Random(seed * 1009 + index)
        # The warm-pool queues submit the same pods without reuse (admission = "nodes" does
        # not place pools on nodes yet; docs/nodes.md).
        self.plain_pools = plain_pools
        self.name = name
        self.kind = kind
        self.tenant = f"t{index % 12}"
        self.project = f"p{index}"
        self.domain = "production" if index % 3 else "development"
        self.next_run = 0
        self.next_action = 0
        self.runs = []          # live runs: [run name, run_max_action_concurrency]
        self.run_pending = {}   # run name -> its pending actions (queued, not yet placed)
        for _ in range(RUNS_PER_QUEUE):
            self.runs.append(self._new_run())
        if kind == "pool":
            # Half the pools hold one H100 per replica (where the queue may use an H100
            # cluster), the others are cpu-only.
            if self.rng.random() < 0.5 and {"east", "west"} & set(allowed):
                self.env_pod = {"cpu": 16, "memory": "64Gi", "gpu": "H100:1"}
            else:
                self.env_pod = {"cpu": 4, "memory": "16Gi"}
            self.env_reuse = ReusePolicy(replicas=self.rng.choice([2, 3, 4]),
                                         concurrency=self.rng.choice([4, 8]), idle_ttl=60.0)
            self.env_name = f"env-{index}"

    def _new_run(self):
        self.next_run += 1
        mac = self.rng.choice([2, 4, 8]) if self.rng.random() < 0.1 else 0
        self.run_pending[f"r{self.next_run}"] = 0
        return [f"r{self.next_run}", mac]

    def _pick_run(self):
        # New work goes to the live run with the least pending work (ties at random): a run
        # held back by its max_action_concurrency keeps its backlog without absorbing the
        # whole queue's share, as independent clients submitting per run would behave.
        low = min(self.run_pending[r[0]] for r in self.runs)
        return self.rng.choice([r for r in self.runs if self.run_pending[r[0]] == low])

    def left_queue(self, run):
        """One pending action of ``run`` was placed or failed."""
        left = self.run_pending[run] - 1
        if left or any(r[0] == run for r in self.runs):
            self.run_pending[run] = left
        else:
            del self.run_pending[run]   # retired and drained

    def next_spec(self):
        """The queue's next action spec and its runtime in ticks."""
        rng = self.rng
        if rng.random() < RUN_RETIRE_RATE:
            self.runs[rng.randrange(len(self.runs))] = self._new_run()
        run, mac = self._pick_run()
        self.run_pending[run] += 1
        self.next_action += 1
        aid = f"{self.tenant}/{self.project}/{self.domain}/{run}/a{self.next_action}"
        kw = {"id": aid, "task": f"{self.kind}-task", "run_queue": self.name,
              "run_max_action_concurrency": mac}
        if self.kind == "cpu":
            kw["resources"] = {"cpu": rng.choice(["250m", "500m", 1, 2, 4, 8]),
                               "memory": rng.choice(["512Mi", "1Gi", "4Gi", "8Gi", "16Gi"]),
                               "ephemeral_storage": rng.choice(["1Gi", "10Gi"])}
            duration = rng.randint(20, 200)
        elif self.kind in ("h100", "a100"):
            model = GPU_NAME[self.kind]
            if rng.random() < UNSCHEDULABLE_RATE:
                # 16 GPUs in one pod: no node shape holds it; fails at once as UNSCHEDULABLE.
                kw["resources"] = {"cpu": 32, "memory": "256Gi", "gpu": f"{model}:16"}
                duration = 1
            elif rng.random() < 0.65:
                g = rng.choice([1, 1, 2, 4, 8])
                kw["resources"] = {"cpu": 8 * g, "memory": f"{64 * g}Gi", "gpu": f"{model}:{g}"}
                duration = rng.randint(50, 400)
            else:
                pods = rng.choice([2, 3, 4])
                kw["pods"] = (
                    PodGroup(role="worker", replicas=pods,
                             resources={"cpu": 64, "memory": "800Gi",
                                        "ephemeral_storage": "2Ti", "gpu": f"{model}:8"}),
                )
                duration = rng.randint(100, MAX_RUNTIME_TICKS)
        else:
            kw["environment"] = self.env_name
            kw["image"] = "registry.example/pool:1"
            kw["resources"] = self.env_pod
            if not self.plain_pools:
                kw["reuse"] = self.env_reuse
            duration = rng.randint(5, 50)
        return ActionSpec(**kw), duration


class Workload:
    """An ``Engine`` plus the seeded churn that keeps it in a steady state.

    ``tick_timed()`` runs ``Engine.schedule()`` under ``perf_counter_ns`` and then the untimed
    churn (drain, mark running, complete what is due, top up every queue).
    """

    def __init__(self, seed=SEED, resource_gate="enforce", pending_per_queue=10, dt=0.1,
                 max_candidates=4096, admission="shapes", plain_pools=None):
        data, meta = build_config(seed, resource_gate, max_candidates, dt, admission)
        # Pools are plain single pods under admission = "nodes" (or when asked, to compare).
        self.plain_pools = admission == "nodes" if plain_pools is None else plain_pools
        self.config = parse_config(data, "<bench>")
        self.clock = ManualClock(start_ns=1_700_000_000 * 10**9)
        self.engine = Engine(self.config, clock=self.clock, store=MemoryStore())
        self.view = self.engine.inspect()
        self.state = self.view.arrays
        self.dt = dt
        self.pending_per_queue = pending_per_queue
        for c in self.config.clusters:
            for w in range(WORKERS_PER_CLUSTER):
                self.engine.register_worker(f"{c.name}-w{w}", c.name, SLOTS_PER_WORKER)
        self.streams = [
            _QueueStream(seed, i, name, kind, data["queues"][name]["clusters"],
                         self.plain_pools)
            for i, (name, kind) in enumerate(meta)
        ]
        self.queue_rows = [self.view.queue_index(s.name) for s in self.streams]
        self.stream_of = {s.name: s for s in self.streams}
        # Heartbeats: every worker sends the tokens of the leases it holds once per
        # heartbeat_interval (staggered across workers), in batches of up to 1,000, as the
        # design's workers do; without them leases would expire. Only where the engine has
        # lease tokens (Engine.heartbeat).
        self.beats = hasattr(self.engine, "heartbeat")
        self.held = {name: {} for name in self.view.worker_sessions_by_id()}   # worker -> tokens
        self.hb_ticks = max(1, round(self.config.engine.heartbeat_interval / dt)
                            if hasattr(self.config.engine, "heartbeat_interval") else 1)
        self.duration = {}      # ActionId -> runtime in ticks
        self.running = []       # heap of (due tick, seq, ActionId, generation)
        self.seq = 0
        self.ticks = 0
        self.failed_total = 0
        self.top_up()

    # -------------------------------------------------------------- churn (untimed)

    def top_up(self):
        """Enqueue replacements so every queue has ``pending_per_queue`` pending actions."""
        pending = self.state.q_pending
        specs = []
        for stream, q in zip(self.streams, self.queue_rows, strict=True):
            for _ in range(self.pending_per_queue - int(pending[q])):
                spec, duration = stream.next_spec()
                specs.append(spec)
                self.duration[spec.id] = duration
        if specs:
            ids = self.engine.enqueue_many(specs)
            dur = self.duration
            for spec, aid in zip(specs, ids, strict=True):
                dur[aid] = dur.pop(spec.id)
        return len(specs)

    def after_tick(self, assignments=None):
        """Drain (unless given), mark running, complete what is due, top up."""
        eng = self.engine
        st, view = self.state, self.view
        for i in range(view.unschedulable_count):
            row = int(st.f_action[i])
            aid = view.action_at(row)
            self.duration.pop(aid)
            self.stream_of[eng.config.queues[int(st.a_queue[row])].name].left_queue(aid.run)
        if assignments is None:
            assignments = eng.drain_dispatch()
        for asg in assignments:
            self.stream_of[asg.queue].left_queue(asg.action.run)
            eng.mark_running(asg.action, asg.generation)
            self.seq += 1
            heapq.heappush(self.running, (self.ticks + self.duration.pop(asg.action),
                                          self.seq, asg.action, asg.generation, asg.worker))
            if self.beats:
                self.held[asg.worker][asg.action] = asg.token
        running = self.running
        while running and running[0][0] <= self.ticks:
            _, _, aid, gen, worker = heapq.heappop(running)
            eng.complete(aid, gen)
            if self.beats:
                del self.held[worker][aid]
        if self.beats:
            self.heartbeat()
        self.top_up()
        return len(assignments)

    def heartbeat(self):
        """The workers whose turn it is send their tokens (batches of <= 1,000)."""
        names = list(self.held)
        stride = max(1, self.hb_ticks // len(names))
        for i, name in enumerate(names):
            if (self.ticks + i * stride) % self.hb_ticks:
                continue
            tokens = list(self.held[name].values())
            for j in range(0, len(tokens), 1000):
                refused = self.engine.heartbeat(name, tokens[j:j + 1000])
                if refused:
                    raise RuntimeError(f"bench workload: {len(refused)} live tokens of "
                                       f"{name} refused ({refused[0].verdict!r})")

    # -------------------------------------------------------------- ticks

    def candidates_last_tick(self):
        """Actions the last tick examined (every examined action is stamped with tick_no)."""
        n = self.view.action_rows
        return int(np.count_nonzero(self.state.a_wait_tick[:n] == self.view.tick_no))

    def pending(self):
        return int(self.state.q_pending.sum())

    def in_flight(self):
        st = self.state
        return int((st.q_adm - st.q_rel).sum())

    def advance(self):
        self.clock.advance(self.dt)
        self.ticks += 1

    def tick_untimed(self):
        """One full cycle without timing (warm-up)."""
        self.advance()
        self.engine.schedule()
        self.failed_total += self.view.unschedulable_count
        self.after_tick()

    def warm_up(self, ticks):
        for _ in range(ticks):
            self.tick_untimed()

    def tick_timed(self, perf_counter_ns):
        """One cycle, ``Engine.schedule()`` as its two halves: the decision
        (``Engine.decide()``: timers, expiry sweep, the Cython tick, the failures it found)
        and the group commit (``Engine.commit()``: encode + the in-memory store), each
        timed; returns a dict of what they did."""
        self.advance()
        pending = self.pending()
        eng = self.engine
        t0 = perf_counter_ns()
        group = eng.decide()
        t1 = perf_counter_ns()
        eng.commit(group)
        t2 = perf_counter_ns()
        failed = self.view.unschedulable_count
        self.failed_total += failed
        out = {"ns": t1 - t0, "commit_ns": t2 - t1, "kernel_ns": self.view.last_kernel_ns,
               "placed": group.placed, "failed": failed,
               "pending": pending,
               "candidates": self.candidates_last_tick(),
               # This decision ran the engine's periodic lease-expiry sweep.
               "sweep": group.swept}
        self.after_tick()
        return out
