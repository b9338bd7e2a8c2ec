"""Tenant caps ([tenants.NAME] and [tenant_defaults]: run_concurrency, action_concurrency).

A tenant is the first segment of an action id. Its actions and runs in flight are counted by
the kernel over every queue (charged at placement, fast lane included, released once per lease
generation) and checked in the tick like a run's max_action_concurrency: the action waits
TENANT_ACTIONS / TENANT_RUNS, its lane (one run, so one tenant) is skipped, and it neither
becomes its queue's head nor holds a cluster, so other tenants' work behind it goes on under
STRICT_FIFO as under GREEDY_CAPACITY.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from engine import (
    ActionSpec,
    Engine,
    ManualClock,
    PodGroup,
    RetryPolicy,
    ReusePolicy,
    SpecError,
    WaitCode,
    parse_config,
)
from storage import MemoryStore, StoreError
from tests.conftest import make_engine

STRICT, GREEDY = "STRICT_FIFO", "GREEDY_CAPACITY"


def config(scheduling=GREEDY, **engine):
    return {
        "resources": ["cpu", "memory", "gpu:H100"],
        "clusters": {
            "gpu": {"node_shapes": [{"name": "h100", "count": 2,
                                     "allocatable": {"cpu": 96, "memory": "1Ti",
                                                     "gpu:H100": 8}}]},
        },
        "queues": {
            "main": {"scheduling": scheduling, "priority": 100},
            "low": {"scheduling": GREEDY, "priority": 10},
        },
        "tenant_defaults": {"run_concurrency": 2, "action_concurrency": 3},
        "tenants": {"acme": {"action_concurrency": 2}, "big": {"run_concurrency": 0,
                                                             "action_concurrency": 0}},
        "engine": {"default_queue": "main", "heartbeat_interval": 1e7, **engine},
    }


def act(tenant, run, name, queue="main", **kw):
    if "pods" not in kw:
        kw.setdefault("resources", {"cpu": 1})
    return ActionSpec(id=f"{tenant}/p/d/{run}/{name}", task=name, run_queue=queue, **kw)


def placed_ids(assignments):
    return sorted(str(a.action) for a in assignments)


def in_flight(eng, tenant):
    """(actions, runs) the kernel counts in flight for ``tenant``."""
    view = eng.inspect()
    a, t = view.arrays, view.tenants()[tenant]
    return (int(np.int64(a.tn_adm[t] - a.tn_rel[t])),
            int(np.int64(a.tn_runs_adm[t] - a.tn_runs_rel[t])))


def recount(eng):
    """Per tenant name, (actions, runs) in flight recounted from the action rows: every row
    whose current lease generation is not released, by its run's tenant."""
    view = eng.inspect()
    a, n = view.arrays, view.action_rows
    rows = np.flatnonzero((a.a_gen[:n] != 0) & (a.a_released_gen[:n] != a.a_gen[:n]))
    keys = view.run_keys()
    out = {}
    for tenant in view.tenants():
        runs = {int(u) for u in a.a_run[rows] if keys[int(u)].split("/")[0] == tenant}
        acts = sum(1 for u in a.a_run[rows] if keys[int(u)].split("/")[0] == tenant)
        out[tenant] = (acts, len(runs))
    return out


def counted(eng):
    return {t: in_flight(eng, t) for t in eng.inspect().tenants()}


# ---------------------------------------------------------------------------------------------
# Explain, defaults


def test_explain_names_the_tenant_and_its_action_cap():
    eng, _clock = make_engine(config())
    eng.enqueue_many([act("acme", "r1", f"a{i}") for i in range(3)])
    placed = eng.tick()
    assert placed_ids(placed) == ["acme/p/d/r1/a0", "acme/p/d/r1/a1"]
    exp = eng.explain("acme/p/d/r1/a2")
    assert exp.wait == WaitCode.TENANT_ACTIONS
    assert str(exp.phase) == "QUEUED"       # a count cap, not a resource wait
    assert exp.reason == ("tenant acme: action_concurrency 2 reached "
                          "(2 actions in flight; [tenants.acme])")
    # Its own table leaves run_concurrency at the default (2): a third run waits for it.
    eng.enqueue(act("acme", "r2", "b0"))
    eng.enqueue(act("acme", "r3", "c0"))
    eng.complete(placed[0].action, placed[0].generation)
    eng.complete(placed[1].action, placed[1].generation)
    assert placed_ids(eng.tick()) == ["acme/p/d/r1/a2", "acme/p/d/r2/b0"]
    exp = eng.explain("acme/p/d/r3/c0")
    assert exp.wait == WaitCode.TENANT_RUNS
    assert exp.reason == ("tenant acme: run_concurrency 2 reached "
                          "(2 runs in flight; [tenants.acme])")


def test_an_unnamed_tenant_gets_the_defaults():
    eng, _clock = make_engine(config())
    eng.enqueue_many([act("someone", f"r{i}", "x") for i in range(3)]
                     + [act("big", f"r{i}", f"x{j}") for i in range(4) for j in range(3)])
    placed = placed_ids(eng.tick())
    # run_concurrency 2 from [tenant_defaults]; "big" is named unlimited.
    assert [p for p in placed if p.startswith("someone/")] == \
        ["someone/p/d/r0/x", "someone/p/d/r1/x"]
    assert len([p for p in placed if p.startswith("big/")]) == 12
    exp = eng.explain("someone/p/d/r2/x")
    assert exp.wait == WaitCode.TENANT_RUNS
    assert exp.reason == ("tenant someone: run_concurrency 2 reached "
                          "(2 runs in flight; [tenant_defaults])")
    view = eng.inspect()
    t = view.tenants()["someone"]
    assert (int(view.arrays.tn_run_cap[t]), int(view.arrays.tn_action_cap[t])) == (2, 3)
    # action_concurrency 3 from the defaults: a run of its own may add one more, not two.
    eng.enqueue_many([act("someone", "r0", "y1"), act("someone", "r0", "y2")])
    assert placed_ids(eng.tick()) == ["someone/p/d/r0/y1"]
    assert eng.explain("someone/p/d/r0/y2").wait == WaitCode.TENANT_ACTIONS
    assert in_flight(eng, "someone") == (3, 2)


# ---------------------------------------------------------------------------------------------
# Interplay with the queue: other tenants pass, nothing is held


@pytest.mark.parametrize("scheduling", [STRICT, GREEDY])
def test_other_tenants_are_placed_past_a_capped_tenants_actions(scheduling):
    eng, _clock = make_engine(config(scheduling))
    eng.enqueue_many([act("acme", "r0", f"a{i}") for i in range(2)])
    assert len(eng.tick()) == 2          # acme at its cap from here on
    # Older acme work first, in the same queue, then an uncapped tenant's; and a lower-priority
    # queue's action that needs the whole cluster's GPUs but one pod (a capped head that held
    # the cluster would keep it out).
    eng.enqueue_many([act("acme", "r1", f"b{i}") for i in range(3)]
                     + [act("big", "r9", f"c{i}") for i in range(3)]
                     + [act("big", "r8", "g", queue="low",
                            pods=(PodGroup("w", 2, {"cpu": 1, "gpu": 8}),))])
    placed = placed_ids(eng.tick())
    assert placed == ["big/p/d/r8/g"] + [f"big/p/d/r9/c{i}" for i in range(3)]
    view = eng.inspect()
    q = view.queue_index("main")
    # The capped actions are not the queue's head, and the queue did not stop on them.
    assert int(view.arrays.q_head[q]) == -1
    assert WaitCode(int(view.arrays.q_stop_code[q])) == WaitCode.NONE
    assert {eng.explain(f"acme/p/d/r1/b{i}").wait for i in range(3)} == \
        {WaitCode.TENANT_ACTIONS}


def test_a_capped_tenant_behind_a_held_head_is_explained_by_its_cap():
    # The cluster is held by a STRICT head (a gang that does not fit); the queue's scan stops
    # behind its own blocked head (QUEUE_HELD), so the capped actions are resolved on demand,
    # the same as when every action is examined.
    got = []
    for examine_all in (False, True):
        eng, _clock = make_engine(config(STRICT))
        eng.inspect().kernel.examine_all = examine_all
        eng.enqueue_many([act("acme", "r0", f"a{i}", resources={"cpu": 1, "gpu": 4})
                          for i in range(2)])
        assert len(eng.tick()) == 2      # 8 of 16 GPUs in use; acme at its cap
        eng.enqueue(act("beta", "g", "gang", pods=(PodGroup("w", 2, {"cpu": 1, "gpu": 8}),)))
        eng.enqueue_many([act("beta", "r1", "one", resources={"cpu": 1, "gpu": 1})]
                         + [act("acme", "r1", f"b{i}", resources={"cpu": 1, "gpu": 1})
                            for i in range(2)])
        assert eng.tick() == []
        view = eng.inspect()
        if not examine_all:
            assert WaitCode(int(view.arrays.q_stop_code[view.queue_index("main")])) == \
                WaitCode.QUEUE_HELD
        got.append([(e.wait, e.reason) for e in map(eng.explain, [
            "beta/p/d/r1/one", "acme/p/d/r1/b0", "acme/p/d/r1/b1"])])
    assert got[0] == got[1]
    assert [w for w, _r in got[0]] == [WaitCode.HEAD_OF_LINE, WaitCode.TENANT_ACTIONS,
                                       WaitCode.TENANT_ACTIONS]


def test_the_queue_wait_reason_of_a_capped_action_is_its_tenants_cap():
    eng, clock = make_engine(config())
    eng.enqueue_many([act("acme", "r0", f"a{i}") for i in range(2)]
                     + [act("someone", f"r{i}", "x") for i in range(2)])
    placed = {str(a.action): a for a in eng.tick()}
    eng.enqueue_many([act("acme", "r1", "late"), act("someone", "r2", "x")])
    eng.tick()
    said = {i: eng.explain(i).wait for i in ("acme/p/d/r1/late", "someone/p/d/r2/x")}
    assert said == {"acme/p/d/r1/late": WaitCode.TENANT_ACTIONS,
                    "someone/p/d/r2/x": WaitCode.TENANT_RUNS}
    for aid in ("acme/p/d/r0/a0", "someone/p/d/r0/x"):
        eng.complete(placed[aid].action, placed[aid].generation)
    clock.advance(1.0)
    eng.schedule()
    batch = eng.drain_columns()
    got = {str(batch.action(i)): WaitCode(int(batch.wait_code[i])) for i in range(len(batch))}
    assert got == said


def test_fast_lane_placements_count_against_the_tenant():
    eng, _clock = make_engine(config())
    pool = dict(environment="env1", reuse=ReusePolicy(replicas=1, concurrency=8))
    eng.enqueue(act("acme", "r0", "p0", **pool))
    assert len(eng.tick()) == 1          # starts the pool
    eng.enqueue_many([act("acme", "r0", f"p{i}", **pool) for i in (1, 2)])
    # The pool has 7 free slots: the fast lane places one (the tenant's second), not two.
    assert placed_ids(eng.tick()) == ["acme/p/d/r0/p1"]
    assert eng.explain("acme/p/d/r0/p2").wait == WaitCode.TENANT_ACTIONS
    assert in_flight(eng, "acme") == (2, 1)


def test_counts_survive_a_reload_and_a_failed_commit():
    store = MemoryStore(2)
    cfg = parse_config(config(), source="<test>")
    clock = ManualClock()
    eng = Engine(cfg, clock=clock, store=store)
    eng.register_worker("w", "gpu", 100)
    eng.enqueue_many([act("acme", "r0", f"a{i}") for i in range(3)]
                     + [act("someone", f"r{i}", "x") for i in range(3)])
    assert len(eng.tick()) == 4
    before = counted(eng)
    assert before == {"acme": (2, 1), "someone": (2, 2)} == recount(eng)
    # A failed commit of a tick that would place: memory back to what the store holds.
    eng.enqueue(act("big", "r0", "y"))
    store.fail_next(StoreError("injected"))
    with pytest.raises(StoreError):
        eng.tick()
    assert counted(eng) == {**before, "big": (0, 0)} == recount(eng)
    eng.close()
    again = Engine(cfg, clock=clock, store=MemoryStore(2, backing=store.backing))
    again.register_worker("w", "gpu", 100)
    assert counted(again) == {**before, "big": (0, 0)} == recount(again)
    # And the caps still bind after the reload.
    assert placed_ids(again.tick()) == ["big/p/d/r0/y"]
    assert again.explain("acme/p/d/r0/a2").wait == WaitCode.TENANT_ACTIONS
    assert again.explain("someone/p/d/r2/x").wait == WaitCode.TENANT_RUNS


# ---------------------------------------------------------------------------------------------
# Property: the caps hold, and the counts equal a recount from the rows after every step


TENANTS = ("acme", "big", "someone", "solo")
CAPS = {"acme": (2, 2), "big": (0, 0), "someone": (2, 3), "solo": (1, 0)}   # (runs, actions)
MACHINE_CONFIG = {
    "resources": ["cpu", "memory"],
    "clusters": {"east": {"capacity": {"cpu": 8, "memory": "64Gi"}},
                 "west": {"capacity": {"cpu": 8, "memory": "64Gi"}}},
    "queues": {"strict": {"scheduling": STRICT, "priority": 100},
               "greedy": {"scheduling": GREEDY, "priority": 10, "clusters": ["west"]}},
    "tenant_defaults": {"run_concurrency": 2, "action_concurrency": 3},
    "tenants": {"acme": {"action_concurrency": 2},
                "big": {"run_concurrency": 0, "action_concurrency": 0},
                "solo": {"run_concurrency": 1, "action_concurrency": 0}},
    "engine": {"default_queue": "strict", "heartbeat_interval": 5, "expiry_missed_beats": 1,
               "expiry_jitter": 0, "system_retries": 1, "pause_on_expiry": False},
    "storage": {"partitions": 2},
}
WORKERS = {"we": ("east", 6), "ww": ("west", 6)}


class TenantMachine(RuleBasedStateMachine):
    """Enqueue (single actions, warm-pool actions, retries) for four tenants over two queues,
    tick, run, succeed or fail (retried), abort, let leases expire, reload from the store and
    fail a commit; after every step the kernel's tenant counts equal a recount from the rows,
    are never negative and never over a cap."""

    @initialize()
    def start(self):
        self.cfg = parse_config(MACHINE_CONFIG, source="<tenants>")
        self.clock = ManualClock()
        self.store = MemoryStore(2)
        self.eng = self._open()
        self.ids = []
        self.k = 0

    def _open(self):
        eng = Engine(self.cfg, clock=self.clock, store=self.store)
        for wid, (cluster, slots) in WORKERS.items():
            eng.register_worker(wid, cluster, slots)
        return eng

    def _live(self):
        """(action id, generation, state, expired) of the leases in flight; ``expired``: past
        its expiry, which the next tick's sweep ends (until then a report is refused)."""
        view = self.eng.inspect()
        a, n = view.arrays, view.action_rows
        rows = np.flatnonzero((a.a_gen[:n] != 0) & (a.a_released_gen[:n] != a.a_gen[:n]))
        now = self.clock.now_ns()
        return [(str(view.action_at(r)), int(a.a_gen[r]), int(a.a_state[r]),
                 bool(a.a_expiry[r] < now)) for r in rows]

    def _report(self, call, expired):
        """A holder's report: accepted while the lease lives, refused EXPIRED once past its
        expiry (the lease is not the holder's any more), never anything else."""
        if not expired:
            call()
            return
        with pytest.raises(SpecError, match="refused: EXPIRED"):
            call()
        event("a report past the lease's expiry refused")

    @rule(tenant=st.sampled_from(TENANTS), run=st.integers(0, 2),
          queue=st.sampled_from(["strict", "greedy"]), cpu=st.sampled_from([1, 1, 2, 4, 7]),
          pool=st.booleans(), retries=st.integers(0, 1), n=st.integers(1, 3))
    def enqueue(self, tenant, run, queue, cpu, pool, retries, n):
        specs = []
        for _ in range(n):
            self.k += 1
            kw = dict(resources={"cpu": cpu}, retries=RetryPolicy(count=retries,
                                                                   backoff_base=0.5))
            if pool:
                kw.update(environment=f"env-{tenant}-{queue}",
                          reuse=ReusePolicy(replicas=1, concurrency=3, idle_ttl=2.0),
                          resources={"cpu": 1})
            specs.append(act(tenant, f"r{run}", f"a{self.k}", queue=queue, **kw))
        self.eng.enqueue_many(specs)
        self.ids += [s.id for s in specs]

    @rule()
    def tick(self):
        self.eng.tick()

    @rule(data=st.data())
    def run(self, data):
        live = [x for x in self._live() if x[2] == 2]       # SENT
        if live:
            aid, gen, _s, expired = data.draw(st.sampled_from(live))
            self._report(lambda: self.eng.mark_running(aid, gen), expired)

    @rule(data=st.data(), ok=st.booleans())
    def end(self, data, ok):
        live = self._live()
        if live:
            aid, gen, _s, expired = data.draw(st.sampled_from(live))
            self._report(lambda: self.eng.complete(aid, gen, **({} if ok else dict(
                phase="FAILED", error_kind="USER", message="boom", recoverable=True))),
                expired)

    @rule(data=st.data())
    def abort(self, data):
        if self.ids:
            self.eng.abort(data.draw(st.sampled_from(self.ids)))

    @rule(seconds=st.sampled_from([0.5, 1.0, 6.0]))
    def advance(self, seconds):
        # Past the lease ttl (5 s, no heartbeats here) the next tick expires what runs.
        self.clock.advance(seconds)
        self.eng.tick()
        if any(self.eng.explain(i).reason.startswith("attempt 2") for i in self.ids[-3:]):
            event("a retry after an expiry or a failure")

    @rule()
    def reload(self):
        if self._live():
            event("reload with leases in flight")
        self.eng.close()
        self.store = MemoryStore(2, backing=self.store.backing)
        self.eng = self._open()

    @rule()
    def failed_commit(self):
        self.store.fail_next(StoreError("injected"))
        try:
            self.eng.tick()
        except StoreError:
            pass
        self.store.clear_failure()

    @invariant()
    def counts_are_the_recount_and_within_the_caps(self):
        if not hasattr(self, "eng"):
            return
        view = self.eng.inspect()
        a = view.arrays
        for tenant, t in view.tenants().items():
            acts = int(np.int64(a.tn_adm[t] - a.tn_rel[t]))
            runs = int(np.int64(a.tn_runs_adm[t] - a.tn_runs_rel[t]))
            assert acts >= 0 and runs >= 0, tenant
            run_cap, action_cap = CAPS[tenant]
            assert (int(a.tn_run_cap[t]), int(a.tn_action_cap[t])) == (run_cap, action_cap)
            assert not run_cap or runs <= run_cap, tenant
            assert not action_cap or acts <= action_cap, tenant
            if (run_cap and runs == run_cap) or (action_cap and acts == action_cap):
                event(f"{tenant} at a cap")
        assert counted(self.eng) == recount(self.eng)
        # Every live run row is its run key's tenant's.
        keys = view.run_keys()
        tenants = view.tenants()
        for u, key in enumerate(keys):
            if key is not None:
                assert int(a.u_tenant[u]) == tenants[key.split("/")[0]]

    def teardown(self):
        if hasattr(self, "eng"):
            self.eng.close()


TestTenantMachine = TenantMachine.TestCase
TestTenantMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])
