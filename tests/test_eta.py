"""The ETA projection (issue 14, item 6): a projected start for every queued action, in
explain and queue metrics; none when unknown; exact on a hand-built case with exact
predictions; non-decreasing in a STRICT_FIFO queue."""

import heapq

from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine import ActionSpec, Timeouts
from tests.conftest import make_engine, start_running

S = 1_000_000_000
NODE = {"cpu": 96, "memory": "1Ti", "gpu:H100": 8}


def config(backfill=True, nodes=1, scheduling="STRICT_FIFO", **queue):
    return {
        "resources": ["cpu", "memory", "gpu:H100"],
        "clusters": {"east": {"node_shapes": [{"name": "h100", "count": nodes,
                                               "allocatable": NODE}]}},
        "queues": {"gpu": {"scheduling": scheduling, "backfill": backfill, **queue}},
        "engine": {"default_queue": "gpu", "heartbeat_interval": 1e7},
    }


def job(run, n_gpu, est_s=None, task=None, **kw):
    """One pod of ``n_gpu`` GPUs; ``est_s`` its runtime_estimate (None: no prediction)."""
    return ActionSpec(id=f"acme/ml/prod/{run}/a", task=task or f"t-{run}",
                      resources={"cpu": 1, "gpu": n_gpu}, runtime_estimate=est_s, **kw)


def aid(run):
    return f"acme/ml/prod/{run}/a"


def drive(eng, clock, runtimes_s, live):
    """Run the engine until nothing is queued or running: each placed action is reported
    running at once and succeeds ``runtimes_s[run]`` later (``live``: the assignments
    already running, started at 0). Returns ``{run: start_ns}``."""
    starts, running = {}, []
    for a in live:
        heapq.heappush(running, (round(runtimes_s[a.action.run] * S), a.action.run,
                                 a.action, a.generation))

    def place():
        for a in eng.tick():
            eng.mark_running(a.action, a.generation)
            run = a.action.run
            starts[run] = clock.now_ns()
            heapq.heappush(running, (clock.now_ns() + round(runtimes_s[run] * S), run,
                                     a.action, a.generation))

    place()
    while running:
        t = running[0][0]
        clock.set_ns(t)
        while running and running[0][0] == t:
            _, _, action, gen = heapq.heappop(running)
            eng.complete(action, gen)
        place()
    return starts


def start(eng, clock, specs):
    """Enqueue and place ``specs`` now, running; returns the assignments."""
    return start_running(eng, specs)


def test_exact_predictions_give_the_actual_starts():
    # One 8-GPU node: A runs 100 s. Queued: B (4 GPUs, 50 s), C (8, 30 s), D (4, 20 s).
    # Projected: B at 100 (A ends), C at 150 (B ends), D at 100 beside B (ends by 120, so
    # EASY backfills it before C). With exact estimates those are the starts.
    eng, clock = make_engine(config())
    rt = {"A": 100, "B": 50, "C": 30, "D": 20}
    live = start(eng, clock, [job("A", 8, 100)])
    eng.enqueue_many([job("B", 4, 50), job("C", 8, 30), job("D", 4, 20)])
    eng.tick()      # nothing fits now: B is the blocked head
    eta = {r: eng.projected_start(aid(r)).eta_ns for r in "BCD"}
    assert eta == {"B": 100 * S, "C": 150 * S, "D": 100 * S}
    starts = drive(eng, clock, rt, live)
    assert {r: starts[r] for r in "BCD"} == eta


def test_no_eta_behind_a_lease_with_no_prediction():
    eng, clock = make_engine(config())
    start(eng, clock, [job("A", 6)])            # no estimate, no max_runtime, no history
    eng.enqueue_many([job("B", 4, 10), job("C", 2, 10)])
    eng.tick()
    b = eng.projected_start(aid("B"))
    assert b.eta_ns is None and "no predicted runtime" in b.why
    # C fits in what A leaves free: its start is known (now), whatever A does.
    assert eng.projected_start(aid("C")).eta_ns == clock.now_ns()
    e = eng.explain(aid("B"))
    assert e.projected_start_ns is None and e.projected_why == b.why


def test_a_queued_action_with_no_prediction_hides_what_it_holds():
    # B itself has no prediction: it gets its start (A's end), but what it then holds is
    # never released in the projection, so C, which needs it, has no ETA.
    eng, clock = make_engine(config())
    start(eng, clock, [job("A", 8, 100)])
    eng.enqueue_many([job("B", 8), job("C", 8, 10)])
    eng.tick()
    assert eng.projected_start(aid("B")).eta_ns == 100 * S
    assert eng.projected_start(aid("C")).eta_ns is None


def test_max_runtime_alone_is_a_prediction():
    eng, clock = make_engine(config())
    start(eng, clock, [ActionSpec(id=aid("A"), task="tA", resources={"cpu": 1, "gpu": 8},
                                  timeouts=Timeouts(max_runtime=300))])
    eng.enqueue_many([job("B", 8, 10)])
    eng.tick()
    assert eng.projected_start(aid("B")).eta_ns == 300 * S


def test_explain_and_queue_metrics_carry_the_projection():
    eng, clock = make_engine(config())
    start(eng, clock, [job("A", 8, 100)])
    eng.enqueue_many([job(f"q{i}", 8, 10) for i in range(4)])
    eng.tick()
    e = eng.explain(aid("q2"))
    assert e.projected_start_ns == 120 * S and e.projected_why == ""
    m = eng.queue_metrics("gpu")["projection"]
    assert m == {"queued": 4, "with_eta": 4, "p50_ns": 110 * S, "p90_ns": 130 * S,
                 "last_ns": 130 * S}
    assert eng.projection() == ([aid(f"q{i}") for i in range(4)],
                                [(100 + 10 * i) * S for i in range(4)], ["gpu"] * 4)
    # A running action has no projection.
    assert eng.explain(aid("A")).projected_start_ns is None
    assert eng.explain(aid("A")).projected_why is None


def test_a_paused_queue_projects_nothing():
    eng, clock = make_engine(config())
    eng.enqueue_many([job("B", 1, 10)])
    eng.update_queue("gpu", paused=True)
    eng.tick()
    p = eng.projected_start(aid("B"))
    assert p.eta_ns is None and "paused" in p.why
    assert eng.queue_metrics("gpu")["projection"]["with_eta"] == 0


def test_the_projection_follows_the_clock_and_releases():
    # Cached per state: a completion and a later clock move the projection.
    eng, clock = make_engine(config())
    start(eng, clock, [job("A", 8, 100)])
    eng.enqueue_many([job("B", 8, 10)])
    eng.tick()
    assert eng.projected_start(aid("B")).eta_ns == 100 * S
    clock.set_ns(40 * S)
    a = eng.inspect()
    assert a is not None
    assert eng.projected_start(aid("B")).eta_ns == 100 * S
    # A overruns its estimate: the projection extends it as the tick does (1 minute step).
    clock.set_ns(101 * S)
    assert eng.projected_start(aid("B")).eta_ns == 160 * S


def test_no_worker_no_eta():
    eng, clock = make_engine(config(), workers={})
    eng.enqueue_many([job("B", 1, 10)])
    eng.tick()
    p = eng.projected_start(aid("B"))
    assert p.eta_ns is None and "worker" in p.why


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 8), st.integers(1, 500)), min_size=1, max_size=12),
       st.lists(st.tuples(st.integers(1, 8), st.integers(1, 500)), min_size=1, max_size=4))
def test_strict_fifo_etas_never_decrease_in_queue_order(queued, running):
    # STRICT_FIFO without backfill: an action starts no earlier than the one ahead of it.
    # With exact estimates it is also what happens: nothing after an action starts before
    # it, so what is free from its start on only grows, as the projection assumes.
    eng, clock = make_engine(config(backfill=False, nodes=2))
    rt = {}
    specs = []
    for i, (n, t) in enumerate(running):
        rt[f"r{i}"] = t
        specs.append(job(f"r{i}", n, t))
    live = start(eng, clock, specs)
    qspecs = []
    for i, (n, t) in enumerate(queued):
        rt[f"q{i:02d}"] = t
        qspecs.append(job(f"q{i:02d}", n, t))
    live += start(eng, clock, qspecs)        # what fits now starts now
    ids, etas, _ = eng.projection()
    assert all(e >= 0 for e in etas)
    assert etas == sorted(etas)
    starts = drive(eng, clock, rt, live)
    for action, eta in zip(ids, etas, strict=True):
        run = action.split("/")[3]
        assert starts[run] == eta


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 8), st.integers(1, 500), st.booleans()),
                min_size=1, max_size=30),
       st.lists(st.tuples(st.integers(1, 8), st.integers(1, 500)), min_size=1, max_size=6),
       st.sampled_from([("STRICT_FIFO", True), ("STRICT_FIFO", False),
                        ("GREEDY_CAPACITY", False)]))
# A search that jumped ahead by a longer runtime's bound once marked the segments it skipped
# as short of the class for good, so a later, shorter action of the class (q09: 3 GPUs for
# 1 s, which fits at 8 s) got no ETA.
@example([(1, 1, False), (1, 1, False), (1, 1, False), (1, 1, True), (4, 1, False),
          (5, 62, True), (4, 1, False), (3, 54, True), (3, 1, False), (3, 1, True)],
         [(1, 1)], ("STRICT_FIFO", True))
def test_search_bounds_change_no_answer(queued, running, policy):
    # The projector's per-demand search bounds are a shortcut, not an approximation: the
    # same ETAs as searching every action from scratch (some without a prediction).
    scheduling, backfill = policy
    eng, clock = make_engine(config(backfill=backfill, nodes=2, scheduling=scheduling))
    start(eng, clock, [job(f"r{i}", n, t) for i, (n, t) in enumerate(running)])
    eng.enqueue_many([job(f"q{i:02d}", n, t if known else None)
                      for i, (n, t, known) in enumerate(queued)])
    eng.tick()
    clock.set_ns(7 * S)
    view = eng.inspect()
    fast, plain = view.project(), view.project(classes=False)
    for a, b in zip(fast, plain, strict=True):
        assert (a == b).all()


def test_the_projection_stops_at_the_horizon_and_says_so():
    # One 8-GPU node held for 100 s; six 8-GPU actions queued behind it, horizon 4: the
    # first four in the tick's order get starts 100 s apart, the last two none, with why.
    cfg = config(backfill=False)
    cfg["engine"]["eta_horizon"] = 4
    eng, clock = make_engine(cfg)
    start(eng, clock, [job("A", 8, 100)])
    eng.enqueue_many([job(f"q{i}", 8, 100) for i in range(6)])
    eng.tick()
    got = [eng.explain(aid(f"q{i}")) for i in range(6)]
    assert [e.projected_start_ns for e in got[:4]] == [k * 100 * S for k in range(1, 5)]
    assert [e.projected_start_ns for e in got[4:]] == [None, None]
    assert all("eta_horizon" in e.projected_why for e in got[4:])
    m = eng.queue_metrics("gpu")["projection"]
    assert (m["queued"], m["with_eta"], m["last_ns"]) == (6, 4, None)


def _two_queues(horizon):
    # "gpu" (STRICT_FIFO, no backfill) walks first: h0 has no estimate, so what it takes
    # is held for ever once it starts at 100 s; h1 then has no ETA and h2..h4 are behind
    # it. "cpu" (GREEDY_CAPACITY) has eight 1-GPU actions of 10 s after it.
    cfg = config(backfill=False)
    cfg["queues"]["gpu"]["priority"] = 900
    cfg["queues"]["cpu"] = {"scheduling": "GREEDY_CAPACITY", "priority": 100}
    cfg["engine"]["eta_horizon"] = horizon
    eng, clock = make_engine(cfg)
    start(eng, clock, [job("A", 8, 100)])
    eng.enqueue_many([job(f"h{i}", 8, None if i == 0 else 10) for i in range(5)]
                     + [job(f"c{i}", 1, 10, task_queue="cpu") for i in range(8)])
    eng.tick()
    return eng


def test_the_walk_stops_at_the_horizon_with_the_answers_of_a_whole_walk():
    # Against a walk that reaches everything: the first H actions it projected keep their
    # starts; the rest say why they have none (behind a STRICT head with no ETA, or past
    # the horizon); queue metrics count the same; at most H actions are walked.
    whole = _two_queues(10_000)
    ids, etas, queues = whole.projection()
    runs = [x.split("/")[3] for x in ids]
    # The strict chain stops at h1 (no ETA): h2..h4 are not walked at all.
    assert runs[:2] == ["h0", "h1"] and sorted(runs[2:]) == [f"c{i}" for i in range(8)]
    behind = "an action ahead of it in its STRICT_FIFO queue has no ETA"
    assert all(whole.explain(aid(f"h{i}")).projected_why == behind for i in range(2, 5))
    for h in range(1, len(ids) + 2):
        eng = _two_queues(h)
        got = eng.projection()
        assert got == (ids[:h], etas[:h], queues[:h]), h
        for i, x in enumerate(ids):
            e = eng.explain(x)
            if i < h:
                assert e.projected_start_ns == (None if etas[i] < 0 else etas[i]), (h, x)
            else:
                assert e.projected_start_ns is None and "eta_horizon" in e.projected_why
        # h2..h4 are behind h1 once the walk got past it, else past the horizon too.
        for i in range(2, 5):
            why = eng.explain(aid(f"h{i}")).projected_why
            assert why == behind if h > 2 else "eta_horizon" in why, (h, why)
        for q, n in (("gpu", 5), ("cpu", 8)):
            mine = [t for t, qq in zip(etas[:h], queues[:h], strict=True) if qq == q]
            at = [mine[k] if k < len(mine) and mine[k] >= 0 else None
                  for k in (-(-n // 2) - 1, -(-9 * n // 10) - 1, n - 1)]
            m = eng.queue_metrics(q)["projection"]
            assert m == {"queued": n, "with_eta": sum(t >= 0 for t in mine), "p50_ns": at[0],
                         "p90_ns": at[1], "last_ns": at[2]}, (h, q, m)
