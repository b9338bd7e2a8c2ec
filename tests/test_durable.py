"""Durable state: write-through, reload equivalence, re-drive after a restart, faults
(failed commits, a full map, corrupt records) and the ownership guard, at the Engine level.

A restart is simulated by opening a second Engine on the same backing (MemoryStore) or the
same directory (LmdbStore) after the first stopped."""

import copy
import os
import random
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cext._bulk import add_by
from engine import (
    ActionId,
    ActionSpec,
    Engine,
    ManualClock,
    NotFound,
    Phase,
    PodGroup,
    RetryPolicy,
    SpecError,
    Timeouts,
    parse_config,
)
from engine._codes import LeaseKind, RowState, Verdict
from engine._errors import ConfigError
from engine._groups import group_key
from engine._records import row_key
from storage import (
    CorruptRecord,
    LmdbStore,
    MemoryStore,
    OwnershipError,
    StoreError,
    StoreFailed,
    StoreFull,
)

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
CONFIG = {
    "resources": ["cpu", "memory", "gpu:H100"],
    "clusters": {
        "east": {"node_shapes": [{"count": 2, "allocatable": {"cpu": 64, "memory": "256Gi",
                                                              "gpu:H100": 8}}]},
        "west": {"capacity": {"cpu": 32, "memory": "128Gi"}},
    },
    "queues": {
        "gpu": {"scheduling": "STRICT_FIFO", "clusters": ["east"], "run_concurrency": 3,
                "backfill": True},
        "cpu": {"scheduling": "GREEDY_CAPACITY", "action_concurrency": 20,
                "max_resources": {"cpu": 40}},
    },
    "engine": {"default_queue": "cpu", "heartbeat_interval": 10, "expiry_missed_beats": 3,
               "expiry_jitter": 2, "system_retries": 2, "initial_capacity": 16,
               # The workload's workers never heartbeat: leases expire and are placed
               # on the same workers again.
               "pause_on_expiry": False},
    "storage": {"partitions": 4},
}
WORKERS = {"we": ("east", 50), "ww": ("west", 50)}


def open_engine(store, clock=None, cfg=CONFIG, workers=WORKERS):
    clock = clock or ManualClock()
    eng = Engine(parse_config(cfg), clock=clock, store=store)
    for wid, (cluster, slots) in workers.items():
        eng.register_worker(wid, cluster, slots)
    return eng, clock


def restart(eng, clock, workers=WORKERS, cfg=CONFIG):
    """Stop ``eng`` and start a new engine on the same store data."""
    store = eng.store
    eng.close()
    if isinstance(store, MemoryStore):
        store = MemoryStore(store.partitions, backing=store.backing)
    else:
        store = LmdbStore(store.path, partitions=store.partitions, map_size=store.map_size)
    return open_engine(store, clock, cfg, workers)


def spec(i, tenant="acme", run=None, **kw):
    if "resources" not in kw and "pods" not in kw:
        kw["resources"] = {"cpu": 1 + i % 3}
    return ActionSpec(id=f"{tenant}/p/d/{run or f'r{i % 4}'}/a{i}", task=f"t{i % 2}", **kw)


def random_workload(eng, clock, rng, steps, n):
    """Enqueue, tick, run, complete, fail, abort, expire at random; returns the acknowledged
    ids and the live assignments. ``n`` is a one-item list: the id counter."""
    acked, live = [], {}

    def new_spec():
        i = n[0] = n[0] + 1
        tenant = rng.choice(["acme", "beta", "corp"])
        kind = rng.random()
        if kind < 0.25:
            return spec(i, tenant, run_queue="gpu", resources={"cpu": 4, "gpu:H100": 2})
        if kind < 0.35:
            return spec(i, tenant, run_queue="gpu",
                        pods=(PodGroup(role="w", replicas=2,
                                       resources={"cpu": 8, "gpu:H100": 8}),))
        return spec(i, tenant, retries=RetryPolicy(count=1),
                    timeouts=Timeouts(max_queued_time=rng.choice([None, 50.0])))

    for _ in range(steps):
        op = rng.random()
        if op < 0.3:
            batch = [new_spec() for _ in range(rng.randint(1, 4))]
            acked += [str(x) for x in eng.enqueue_many(batch)]
        elif op < 0.55:
            for a in eng.tick():
                live[a.token] = a
        elif op < 0.7 and live:
            tok = rng.choice(list(live))
            eng.report(tok, Phase.RUNNING)
        elif op < 0.85 and live:
            tok = rng.choice(list(live))
            a = live.pop(tok)
            if a.kind == LeaseKind.FINALIZE:
                eng.report(tok, Phase.SUCCEEDED)
            elif rng.random() < 0.7:
                eng.report(tok, Phase.SUCCEEDED, cleanup=rng.random() < 0.2)
            else:
                eng.report(tok, Phase.FAILED, error_kind="USER", recoverable=True)
        elif op < 0.9 and acked:
            eng.abort(rng.choice(acked))
        else:
            clock.advance(rng.choice([1, 5, 40]))
            eng.heartbeat("we", [t for t, a in live.items() if a.worker == "we"])
    return acked, live


def decision_state(eng):
    """What must survive a restart: per row and per counter (in flight = adm - rel)."""
    view = eng.inspect()
    st, n = view.arrays, view.action_rows
    rows = {name: getattr(st, name)[:n].copy() for name in (
        "a_state", "a_gen", "a_released_gen", "a_end", "a_cluster", "a_queue", "a_run",
        "a_env", "a_fit", "a_demand", "a_charged", "a_attempt", "a_parent",
        "a_deadline_due", "a_queued_due", "a_retry_due", "a_runtime_due", "a_task",
        "a_pred_end", "a_backfilled")}
    rows["holder"] = np.where(st.a_worker[:n] >= 0,
                              [view.worker_at(w) if w >= 0 else "" for w in st.a_worker[:n]],
                              "")
    live = (st.a_state[:n] == RowState.SENT) | (st.a_state[:n] == RowState.RUNNING)
    rows["holder"] = np.where(live, rows["holder"], "")
    counters = {
        "q": st.q_adm - st.q_rel, "q_res": st.q_res_adm - st.q_res_rel,
        "q_runs": st.q_runs_adm - st.q_runs_rel, "c": st.c_adm - st.c_rel,
        "pending": st.q_pending.copy(),
        # Runs with actions in the table (a retired run's row is free: engine/_retain.py).
        "u": (st.u_adm - st.u_rel)[sorted(view.runs().values())],
    }
    qr = {key: int(st.qr_adm[r] - st.qr_rel[r]) for key, r in view.qruns().items()}
    recs = [view.record(r) for r in range(n) if st.a_state[r] != RowState.FREE]
    phases = {str(rec.action): (rec.phase, len(rec.attempts), rec.user_retries,
                                rec.system_retries) for rec in recs}
    fz = {f: (int(st.fz_state[f]), int(st.fz_gen[f]), int(st.fz_action[f]))
          for f in range(view.finalize_rows)}
    phases["history"] = {t: eng.history.encode(t) for t in view.tasks()
                         if eng.history.count(t)}
    phases["runs"] = view.runs()
    return rows, counters, qr, phases, fz


def assert_same(a, b):
    ra, ca, qa, pa, fa = a
    rb, cb, qb, pb, fb = b
    for name in ra:
        np.testing.assert_array_equal(ra[name], rb[name], err_msg=name)
    for name in ca:
        np.testing.assert_array_equal(ca[name], cb[name], err_msg=name)
    assert {k: v for k, v in qa.items() if v} == {k: v for k, v in qb.items() if v}
    assert pa == pb
    assert fa == fb


@pytest.mark.parametrize("seed", range(6))
def test_a_restart_rebuilds_the_same_decision_state_and_carries_on(seed):
    rng = random.Random(seed)
    eng, clock = open_engine(MemoryStore(4))
    counter = [0]
    for _round in range(3):
        acked, live = random_workload(eng, clock, rng, 120, counter)
        before = decision_state(eng)
        eng, clock = restart(eng, clock)
        assert_same(before, decision_state(eng))
        for aid in acked:
            eng.explain(aid)                      # every acknowledged action is there
    # Drain everything with the restored engine: all counts return to zero.
    for _ in range(200):
        for a in eng.tick():
            eng.report(a.token, Phase.SUCCEEDED)
        clock.advance(40)
    st = eng.inspect().arrays
    assert (st.q_adm - st.q_rel == 0).all() and (st.c_adm - st.c_rel == 0).all()
    assert not np.isin(st.a_state[:eng.inspect().action_rows],
                       (RowState.SENT, RowState.RUNNING, RowState.QUEUED)).any()


def test_reconnecting_worker_adopts_its_leases_and_its_tokens_validate():
    eng, clock = open_engine(MemoryStore(4), workers={"ww": ("west", 50)})
    eng.enqueue_many([spec(i) for i in range(3)])
    assigned = eng.tick()
    assert len(assigned) == 3
    eng.report(assigned[0].token, Phase.RUNNING)
    clock.advance(20)
    eng, clock = restart(eng, clock, workers={})
    # Before the worker is back, its leases wait with a fresh window (not expired).
    clock.advance(25)
    assert eng.expired_leases() == []
    eng.register_worker("ww", "west", 50)
    assert eng.heartbeat("ww", [a.token for a in assigned]) == []
    assert eng.report(assigned[1].token, Phase.SUCCEEDED) == Verdict.OK
    assert eng.phase(assigned[1].action) == Phase.SUCCEEDED
    assert eng.phase(assigned[0].action) == Phase.RUNNING
    # A forged holder: another worker presenting those tokens is refused.
    eng.register_worker("other", "west", 5)
    refused = eng.heartbeat("other", [assigned[2].token])
    assert [r.verdict for r in refused] == [Verdict.UNKNOWN]


def test_a_worker_that_never_returns_loses_its_leases_after_the_fresh_window():
    eng, clock = open_engine(MemoryStore(4), workers={"ww": ("west", 50)})
    eng.enqueue(spec(1))
    [a] = eng.tick()
    eng, clock = restart(eng, clock, workers={"ww2": ("west", 5)})
    clock.advance(33)                           # ttl = 10 s x 3 + 2 s
    eng.schedule()
    att = eng.attempts(a.action)
    assert (att[0].phase, att[0].cause) == ("FAILED", "EXPIRED")
    clock.advance(2)
    [b] = [x for x in eng.tick() if x.kind == LeaseKind.RUN]
    assert b.action == a.action and b.generation == a.generation + 1 and b.worker == "ww2"


def test_a_decision_never_handed_out_is_dispatched_again_with_the_same_lease():
    eng, clock = open_engine(MemoryStore(4), workers={"ww": ("west", 50)})
    eng.enqueue(spec(1))
    assert eng.schedule() == 1                  # decided and durable, not drained
    eng, clock = restart(eng, clock, workers={"ww": ("west", 50)})
    [a] = eng.drain_dispatch()
    assert a.generation == 1 and a.worker == "ww"
    assert eng.heartbeat("ww", [a.token]) == []
    # Handed out: a second restart does not dispatch it again.
    eng, clock = restart(eng, clock, workers={"ww": ("west", 50)})
    assert eng.drain_dispatch() == []


def test_timers_survive_a_restart():
    eng, clock = open_engine(MemoryStore(4), workers={})      # no worker: it waits
    slow = ActionSpec(id="acme/p/d/r/slow", task="t", resources={"cpu": 1},
                      timeouts=Timeouts(max_queued_time=30, deadline=100))
    eng.enqueue(slow)
    eng.tick()
    eng, clock = restart(eng, clock, workers={})
    clock.advance(31)
    eng.schedule()
    att = eng.attempts(slow.id)
    assert att[0].cause == "max_queued_time"
    clock.advance(70)
    eng.schedule()
    assert eng.phase(slow.id) == Phase.TIMED_OUT


def test_live_queue_updates_survive_a_restart():
    eng, clock = open_engine(MemoryStore(4))
    eng.update_queue("cpu", action_concurrency=7)
    eng, clock = restart(eng, clock)
    view = eng.inspect()
    assert view.queue("cpu").action_concurrency == 7
    assert int(view.arrays.q_action_cap[view.queue_index("cpu")]) == 7


TRANSITIONS = {
    "enqueue": lambda eng, ctx: eng.enqueue_many([spec(100), spec(101)]),
    "tick": lambda eng, ctx: eng.tick(),
    "report": lambda eng, ctx: eng.report(ctx["token"], Phase.SUCCEEDED, cleanup=True),
    "fail": lambda eng, ctx: eng.report(ctx["token"], Phase.FAILED, error_kind="USER"),
    "abort": lambda eng, ctx: eng.abort(ctx["queued"]),
    "update_queue": lambda eng, ctx: eng.update_queue("cpu", action_concurrency=3),
    "register": lambda eng, ctx: eng.register_worker("new", "west", 3),
    "expire": lambda eng, ctx: [eng.expire(x) for x in eng.expired_leases(ctx["later"])],
}


@pytest.mark.parametrize("what", sorted(TRANSITIONS))
def test_a_failed_commit_restores_memory_and_loses_nothing(what):
    store = MemoryStore(4)
    eng, clock = open_engine(store)
    eng.enqueue_many([spec(i) for i in range(4)])
    [a, *_] = eng.tick()
    eng.enqueue(spec(50, resources={"cpu": 30}))       # waits (cpu budget)
    ctx = {"token": a.token, "queued": "acme/p/d/r2/a50", "later": clock.now_ns() + 10**12}
    if what == "expire":
        clock.advance(40)
    before = decision_state(eng)
    store.fail_next(StoreError("injected I/O error"))
    with pytest.raises(StoreError, match="injected"):
        TRANSITIONS[what](eng, ctx)
    assert_same(before, decision_state(eng))
    # Memory equals disk: a fresh reload sees the same, and the transition then succeeds.
    eng2, _ = restart(eng, clock)
    assert_same(before, decision_state(eng2))
    TRANSITIONS[what](eng2, ctx)


def test_store_failed_reopens_and_reloads():
    store = MemoryStore(4)
    eng, clock = open_engine(store)
    eng.enqueue(spec(1))
    before = decision_state(eng)
    store.fail_next(StoreFailed("disk gone", outcome="unknown"))
    with pytest.raises(StoreFailed):
        eng.enqueue(spec(2))
    assert_same(before, decision_state(eng))
    assert eng.enqueue(spec(2)) is not None


def test_a_store_that_cannot_be_reopened_after_a_failed_commit_stops_the_engine():
    # A full disk: the reopen failed, the store stayed closed, and every later turn failed
    # on it ("store is not open"), four times a second, serving nothing, for good.
    class NoReopen(MemoryStore):
        refuse = False

        def open(self, shard, now_ns):
            if self.refuse:
                raise StoreError("Input/output error")
            super().open(shard, now_ns)

    store = NoReopen(4)
    eng, clock = open_engine(store)
    eng.enqueue(spec(1))
    store.fail_next(StoreFailed("disk full", outcome="unknown"))
    store.refuse = True
    with pytest.raises(StoreError, match="Input/output error"):
        eng.enqueue(spec(2))
    assert eng.stopped is not None
    assert "could not be reopened after a failed commit" in eng.stopped
    assert "Input/output error" in eng.stopped


def test_lost_ownership_stops_the_shard():
    backing = MemoryStore(4)
    eng, clock = open_engine(backing)
    eng.enqueue(spec(1))
    # Another shard takes the partitions over (e.g. ours was presumed dead).
    thief = MemoryStore(4, backing=backing.backing)
    thief.open("shard-9", time.time_ns() + 10**12)   # after our claim's expiry
    with pytest.raises(OwnershipError, match="shard-9"):
        eng.enqueue(spec(2))
    with pytest.raises(StoreError, match="shard stopped: ownership lost"):
        eng.tick()


def test_a_second_shard_on_a_live_store_stops_with_the_holder_named(tmp_path):
    cfg = {**CONFIG, "storage": {"path": str(tmp_path / "s"), "partitions": 2,
                                 "shard": "shard-a"}}
    eng = Engine(parse_config(cfg), clock=ManualClock())
    eng.enqueue(spec(1))
    # Another process, configured as shard-b, on the same store (LMDB: one open per process).
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
        "from engine import Engine, ManualClock, parse_config\n"
        "from storage import OwnershipError\n"
        f"cfg = {cfg!r}\n"
        "cfg['storage']['shard'] = 'shard-b'\n"
        "try:\n"
        "    Engine(parse_config(cfg), clock=ManualClock()).close()\n"
        "    print('OPENED')\n"
        "except OwnershipError as exc:\n"
        "    print('REFUSED', exc)\n"
    )

    def second():
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    refused = second()
    assert refused.startswith("REFUSED") and "shard-a" in refused, refused
    eng.close()
    # Released on close: the successor starts at once.
    assert second().startswith("OPENED")


def test_full_map_refuses_the_transition_and_keeps_what_was_acknowledged(tmp_path):
    cfg = {**CONFIG, "storage": {"path": str(tmp_path / "s"), "partitions": 1,
                                 "map_size": "1Mi", "max_map_size": "1Mi"}}
    cfg["queues"] = {**CONFIG["queues"], "cpu": {"depth": 100000}}
    eng = Engine(parse_config(cfg), clock=ManualClock())
    acked, err = [], None
    for k in range(200):
        try:
            acked += eng.enqueue_many([spec(k * 100 + i, run=f"r{k}") for i in range(100)])
        except StoreFull as exc:
            err = exc
            break
    assert err is not None and "partition 0" in str(err) and "1" in str(err)
    n = eng.inspect().action_rows
    assert n == len(acked)
    eng.close()
    eng2 = Engine(parse_config(cfg), clock=ManualClock())
    assert eng2.inspect().action_rows == len(acked)
    eng2.close()


def test_a_full_map_grows_up_to_max_map_size(tmp_path):
    cfg = {**CONFIG, "storage": {"path": str(tmp_path / "s"), "partitions": 1,
                                 "map_size": "1Mi", "max_map_size": "64Mi"}}
    cfg["queues"] = {**CONFIG["queues"], "cpu": {"depth": 100000}}
    eng = Engine(parse_config(cfg), clock=ManualClock())
    for k in range(30):
        eng.enqueue_many([spec(k * 100 + i, run=f"r{k}") for i in range(100)])
    assert eng.store.map_size > 1 << 20
    eng.close()


def test_a_full_map_grows_to_a_max_below_twice_its_size(tmp_path):
    # Doubling would pass the maximum: the map grows to the maximum itself.
    cfg = {**CONFIG, "storage": {"path": str(tmp_path / "s"), "partitions": 1,
                                 "map_size": "1Mi", "max_map_size": "1536Ki"}}
    cfg["queues"] = {**CONFIG["queues"], "cpu": {"depth": 100000}}
    eng = Engine(parse_config(cfg), clock=ManualClock())
    grown = False
    for k in range(30):
        try:
            eng.enqueue_many([spec(k * 100 + i, run=f"r{k}") for i in range(100)])
        except StoreFull:
            break
        grown = grown or eng.store.map_size == 1536 << 10
    assert grown and eng.store.map_size == 1536 << 10
    eng.close()


# Issue 15: groups spanning two partitions (so one carries the other's redo record) on a small
# map.
TENANTS6 = ["acme", "beta", "corp", "dyn", "echo", "fox"]     # partitions 1 0 1 0 1 1 of 2


def mixed_config(path, max_map_size):
    return parse_config({
        "resources": ["cpu"],
        "clusters": {"c": {"capacity": {"cpu": 64}}},
        "queues": {"q": {"scheduling": "GREEDY_CAPACITY", "depth": 1000000}},
        "engine": {"default_queue": "q"},
        "storage": {"path": str(path), "partitions": 2, "map_size": "1Mi",
                    "max_map_size": max_map_size},
    })


def mixed_batch(b, size=20):
    """Batch ``b``: ``size`` actions of the six tenants in turn (both partitions)."""
    ids = range(b * size, (b + 1) * size)
    return [ActionSpec(id=f"{TENANTS6[i % 6]}/p/d/r{b % 5}/a{i}", task="t",
                       resources={"cpu": 1}) for i in ids]


def assert_queued_exactly(eng, acked):
    assert eng.queue_metrics("q")["depth"] == len(acked)
    for aid in acked[::97] + acked[-3:]:
        assert eng.phase(aid) == Phase.QUEUED


def test_mixed_tenant_groups_on_a_small_map_grow_and_reopen_with_the_same_config(tmp_path):
    # About 2,700 actions in, a partition's commit after the commit point needed one more page
    # than the write phase: the shard used to fail (StoreFailed, then a reopen at the
    # configured map size could not replay the group) and could not restart with its own
    # config.
    path = tmp_path / "s"
    cfg = mixed_config(path, "1Gi")
    eng = Engine(cfg, clock=ManualClock())
    acked = []
    for b in range(300):                                  # 6,000 actions
        acked += [str(a) for a in eng.enqueue_many(mixed_batch(b))]
    assert_queued_exactly(eng, acked)
    eng.close()
    sizes = [os.path.getsize(path / f"p{p:02d}" / "data.mdb") for p in range(2)]   # layout
    assert max(sizes) > 1 << 20, sizes                    # it grew past the configured map
    eng = Engine(cfg, clock=ManualClock())                # the same config reopens it
    assert_queued_exactly(eng, acked)
    for b in range(300, 400):                             # and it keeps growing from there
        acked += [str(a) for a in eng.enqueue_many(mixed_batch(b))]
    eng.close()
    eng = Engine(cfg, clock=ManualClock())
    assert_queued_exactly(eng, acked)
    eng.close()


@pytest.mark.parametrize("max_map_size", ["1Mi", "1536Ki"])
def test_mixed_tenant_groups_at_max_map_size_are_refused_and_the_store_reopens(
        tmp_path, max_map_size):
    path = tmp_path / "s"
    cfg = mixed_config(path, max_map_size)
    acked, nxt = [], 0
    for _ in range(3):                      # fill, refuse, reopen with the same config; again
        eng = Engine(cfg, clock=ManualClock())
        assert_queued_exactly(eng, acked)
        err = None
        for b in range(nxt, nxt + 1000):
            try:
                acked += [str(a) for a in eng.enqueue_many(mixed_batch(b))]
            except StoreFull as exc:
                err, nxt = exc, b
                break
        assert err is not None, "the map never filled"
        # Memory restored: everything acknowledged is there, the refused batch is not.
        assert_queued_exactly(eng, acked)
        with pytest.raises(NotFound):
            eng.phase(mixed_batch(nxt)[0].id)
        eng.close()
    eng = Engine(cfg, clock=ManualClock())
    assert_queued_exactly(eng, acked)
    eng.close()


def test_corrupt_or_foreign_records_stop_the_reload_naming_partition_and_key():
    store = MemoryStore(4)
    eng, clock = open_engine(store)
    eng.enqueue_many([spec(i) for i in range(3)])
    eng.close()
    data = store.backing.data
    part = next(p for p in range(4) if data[p]["actions"])
    key = next(iter(data[part]["actions"]))
    data[part]["actions"][key] = data[part]["actions"][key][:-3]
    with pytest.raises(CorruptRecord) as info:
        Engine(parse_config(CONFIG), clock=clock,
               store=MemoryStore(4, backing=store.backing))
    assert f"partition {part}" in str(info.value) and "actions" in str(info.value)


def test_a_config_that_reorders_queues_is_refused_with_a_clear_error():
    store = MemoryStore(4)
    eng, _ = open_engine(store)
    eng.close()
    cfg = {**CONFIG, "queues": {"cpu": CONFIG["queues"]["cpu"], "gpu": CONFIG["queues"]["gpu"]}}
    with pytest.raises(ConfigError, match="only append queues"):
        Engine(parse_config(cfg), clock=ManualClock(),
               store=MemoryStore(4, backing=store.backing))


def test_one_group_commit_per_loop_turn():
    store = MemoryStore(4)
    eng, clock = open_engine(store)
    before = store.commits
    eng.enqueue_many([spec(i, tenant=t) for i, t in enumerate(["acme", "beta", "corp"] * 5)])
    assert store.commits == before + 1
    eng.tick()                                   # schedule + drain: one turn
    assert store.commits == before + 2
    with eng.turn():
        eng.enqueue(spec(99))
        eng.tick()
    assert store.commits == before + 3
    eng.heartbeat("ww", [])                      # best-effort: never written
    assert store.commits == before + 3


def test_the_records_land_in_the_tenants_partition():
    store = MemoryStore(4)
    eng, _ = open_engine(store)
    ids = eng.enqueue_many([spec(i, tenant=t) for i, t in enumerate(["acme", "beta", "corp"])])
    from storage import partition_of
    for aid in ids:
        view = eng.inspect()
        row = view.row_of(aid)
        p = partition_of(aid.tenant, 4)
        assert row_key(row) in store.backing.data[p]["actions"]
        # Its spec is stored once for its enqueue group, in the same partition.
        assert group_key(int(view.arrays.a_group[row])) in store.backing.data[p]["specs"]


def test_spec_records_round_trip_every_declaration():
    from engine import ReusePolicy
    from engine._records import decode_spec, encode_spec
    full = ActionSpec(
        id="acme/p/d/r/a", task="t", parent="acme/p/d/r/root", environment="env",
        image="img:1", pods=(PodGroup(role="w", replicas=2, resources={"cpu": "500m"}),
                             PodGroup(role="ps", replicas=1, resources={"memory": "1Gi"})),
        reuse=ReusePolicy(replicas=2, concurrency=3, idle_ttl=60.0),
        retries=RetryPolicy(count=2, backoff_base=0.5), timeouts=Timeouts(deadline=9.0),
        environment_queue="cpu", run_max_action_concurrency=4)
    assert decode_spec(encode_spec(full)) == full


def test_the_loop_renews_the_claims_before_they_expire():
    from storage import Claim
    from storage._store import META_CLAIM  # noqa: PLC0415 - the claim record itself
    store = MemoryStore(4, claim_ttl_s=30.0)
    wall = _Wall(time.time_ns())
    eng = Engine(parse_config(CONFIG), clock=ManualClock(), store=store, wall_clock=wall)
    first = Claim.decode(store.backing.data[0]["meta"][META_CLAIM])
    wall.now += 9 * 10**9                       # less than a third of the ttl: no renewal
    eng.schedule()
    assert Claim.decode(store.backing.data[0]["meta"][META_CLAIM]) == first
    wall.now += 2 * 10**9                       # a third of the ttl has passed
    eng.schedule()
    renewed = Claim.decode(store.backing.data[0]["meta"][META_CLAIM])
    assert renewed.expiry_ns == wall.now + 30 * 10**9 > first.expiry_ns


class _Wall:
    """An injectable wall clock (``time_ns``) for the claims."""

    def __init__(self, now):
        self.now = now

    def time_ns(self):
        return self.now


def test_runtime_samples_reach_the_store_within_a_second_not_with_each_turn():
    """A success's runtime sample waits for the flush a second after it (HISTORY_FLUSH_NS),
    even when later turns write partition 0; the flush then writes the key once with every
    sample since (docs/architecture.md, "Runtime history")."""
    eng, clock = open_engine(MemoryStore(4))
    eng.enqueue_many([spec(0, tenant="acme")])
    key = eng.history_key(spec(0, tenant="acme"))

    def stored_count():
        store = MemoryStore(eng.store.partitions, backing=copy.deepcopy(eng.store.backing))
        copy_ = Engine(parse_config(CONFIG), clock=clock, store=store)
        try:
            return copy_.history.count(key)
        finally:
            copy_.close()

    [asg] = eng.tick()
    eng.mark_running(asg.action, asg.generation)
    clock.advance(5)
    eng.complete(asg.action, asg.generation)
    assert eng.history.count(key) == 1 and stored_count() == 0
    # Turns that write every partition, within the second: the sample still waits.
    clock.advance(0.5)
    eng.enqueue_many([spec(i, tenant=t) for i, t in enumerate(("acme", "globex", "initech"), 1)])
    eng.tick()
    assert stored_count() == 0
    clock.advance(0.6)
    eng.tick()                      # the first turn past the second flushes it
    assert stored_count() == 1


def test_a_failed_tick_leaves_no_suspicion_of_the_expiry_it_undid():
    """A tick's sweep expires a lease and (pause_on_expiry) suspects its worker; the commit
    fails, so memory is the store's again: the lease is in flight (a fresh window, as after
    any reload) and the worker is not suspect, exactly as a reload gives it (found by the
    failed-commit rule of tests/test_properties.py)."""
    cfg = {**CONFIG, "engine": {**CONFIG["engine"], "pause_on_expiry": True}}
    eng, clock = open_engine(MemoryStore(4), cfg=cfg, workers={"ww": ("west", 50)})
    eng.enqueue(spec(1))
    [a] = eng.tick()
    clock.advance(40)                           # past its window (ttl 32 s), not swept
    eng.store.fail_next(StoreError("injected I/O error"))
    with pytest.raises(StoreError, match="injected"):
        eng.tick()
    fresh, _ = open_engine(MemoryStore(4, backing=copy.deepcopy(eng.store.backing)), clock,
                           cfg=cfg, workers={"ww": ("west", 50)})
    np.testing.assert_array_equal(eng.inspect().arrays.w_paused,
                                  fresh.inspect().arrays.w_paused)
    # The worker takes new work (no heartbeat needed), as it does after a reload; its
    # lease is still valid.
    for e in (eng, fresh):
        e.enqueue(spec(2))
        assert [b.action for b in e.tick()] == [ActionId.parse("acme/p/d/r2/a2")]
        assert e.heartbeat("ww", [a.token]) == []


def test_a_lease_refused_expired_but_never_swept_is_in_flight_after_a_restart():
    """Documented (docs/storage.md, "Semantics a restart changes"): the refusal of a lease
    past its window is not written; until a sweep ends it, a restart gives it the fresh
    window of every lease in flight, and its token is valid again."""
    eng, clock = open_engine(MemoryStore(4), workers={"ww": ("west", 50)})
    eng.enqueue(spec(1))
    [a] = eng.tick()
    clock.advance(40)                           # past its window (ttl 32 s), not swept
    assert [r.verdict for r in eng.heartbeat("ww", [a.token])] == [Verdict.EXPIRED]
    assert eng.report(a.token, Phase.SUCCEEDED) == Verdict.EXPIRED
    eng, clock = restart(eng, clock, workers={"ww": ("west", 50)})
    assert eng.heartbeat("ww", [a.token]) == []
    assert eng.phase(a.action) == Phase.INITIALIZING


class _BuggySeconds(float):
    """A duration whose arithmetic raises: it passes every check of the spec (it is a finite
    positive float) and fails where the engine first computes with it, inside the enqueue's
    turn, as a bug there would."""

    def __mul__(self, other):
        raise RuntimeError("injected bug")


@pytest.mark.parametrize("backing", ["memory", "lmdb"])
def test_an_unexpected_error_inside_an_enqueue_leaves_memory_as_the_store_holds_it(tmp_path,
                                                                                  backing):
    # The second enqueue fails after its row was taken and before anything was marked dirty
    # (it shares its task: no new history row). Memory must go back to what the store
    # holds: the next action takes that row, and the store reloads. (Before, the next
    # enqueue took the row after it, and no reload could read the store: "rows are not
    # dense".)
    store = (MemoryStore(4) if backing == "memory"
             else LmdbStore(str(tmp_path / "data"), partitions=4))
    eng, clock = open_engine(store)
    eng.enqueue_many([ActionSpec(id="acme/p/d/r/a1", task="t", resources={"cpu": 1})])
    buggy = ActionSpec(id="acme/p/d/r/a2", task="t", resources={"cpu": 1},
                       timeouts=Timeouts(max_runtime=_BuggySeconds(60)))
    with pytest.raises(RuntimeError, match="injected bug"):
        eng.enqueue_many([buggy])
    with pytest.raises(NotFound):
        eng.phase("acme/p/d/r/a2")
    eng.enqueue_many([ActionSpec(id="acme/p/d/r/a3", task="t", resources={"cpu": 1})])
    assert eng.inspect().action_rows == 2
    again, _ = restart(eng, clock)
    assert again.phase("acme/p/d/r/a1") == again.phase("acme/p/d/r/a3") == Phase.QUEUED
    assert again.inspect().action_rows == 2
    with pytest.raises(NotFound):
        again.phase("acme/p/d/r/a2")
    again.close()


@pytest.mark.parametrize("field", ["deadline", "max_queued_time", "max_runtime"])
def test_a_spec_duration_over_ten_years_is_refused_naming_it(field):
    eng, _ = open_engine(MemoryStore(4))
    too_long = 10 * 365 * 86400 + 1
    with pytest.raises(SpecError, match=f"timeouts.{field}: .* is too long"):
        eng.enqueue_many([ActionSpec(id="acme/p/d/r/a1", task="t", resources={"cpu": 1},
                                     timeouts=Timeouts(**{field: too_long}))])
    with pytest.raises(SpecError, match="runtime_estimate: 1e\\+300 is too long"):
        eng.enqueue_many([ActionSpec(id="acme/p/d/r/a1", task="t", resources={"cpu": 1},
                                     runtime_estimate=1e300)])
    assert eng.inspect().action_rows == 0
    eng.close()


def test_a_store_written_before_the_spec_duration_bound_still_reloads(monkeypatch):
    # Stored specs are compiled again on reload: one an earlier version accepted (a max_runtime
    # of 20 years meant "no bound") must not make the store unreadable ("corrupt").
    import engine._model

    twenty_years = 20 * 365 * 86400
    eng, clock = open_engine(MemoryStore(4))
    monkeypatch.setattr(engine._model, "MAX_SECONDS", float("inf"))    # the earlier rules
    eng.enqueue_many([ActionSpec(id="acme/p/d/r/a1", task="t", resources={"cpu": 1},
                                 timeouts=Timeouts(max_runtime=twenty_years,
                                                   deadline=twenty_years))])
    monkeypatch.undo()
    with pytest.raises(SpecError, match="too long"):     # refused now at enqueue
        eng.enqueue_many([ActionSpec(id="acme/p/d/r/a2", task="t", resources={"cpu": 1},
                                     timeouts=Timeouts(max_runtime=twenty_years))])
    again, clock = restart(eng, clock)
    assert again.phase("acme/p/d/r/a1") == Phase.QUEUED
    assert again.explain("acme/p/d/r/a1").phase == Phase.QUEUED
    placed = again.tick()
    assert [str(a.action) for a in placed] == ["acme/p/d/r/a1"]
    again.close()


def test_an_error_caught_inside_an_outer_turn_still_undoes_that_turn(tmp_path):
    # A shard runs every request inside one loop turn and answers an error without ending
    # the turn: the half-made enqueue must not be committed with the turn's other work.
    store = LmdbStore(str(tmp_path / "data"), partitions=4)
    eng, clock = open_engine(store)
    eng.enqueue_many([ActionSpec(id="acme/p/d/r/a1", task="t", resources={"cpu": 1})])
    buggy = ActionSpec(id="acme/p/d/r/a2", task="t", resources={"cpu": 1},
                       timeouts=Timeouts(max_runtime=_BuggySeconds(60)))
    with pytest.raises(StoreError, match="failed unexpectedly: memory was restored"):
        with eng.turn():
            eng.enqueue_many([ActionSpec(id="acme/p/d/r/b1", task="u",
                                         resources={"cpu": 1})])
            with pytest.raises(RuntimeError, match="injected bug"):
                eng.enqueue_many([buggy])
            assert eng.turn_failed
    assert not eng.turn_failed
    for aid in ("acme/p/d/r/a2", "acme/p/d/r/b1"):      # nothing of that turn was written
        with pytest.raises(NotFound):
            eng.phase(aid)
    eng.enqueue_many([ActionSpec(id="acme/p/d/r/a3", task="t", resources={"cpu": 1})])
    again, _ = restart(eng, clock)
    assert again.phase("acme/p/d/r/a3") == Phase.QUEUED
    assert again.inspect().action_rows == 2
    again.close()


def test_a_refused_history_record_changes_nothing_and_reloads_nothing():
    eng, _ = open_engine(MemoryStore(4))
    history = eng.history
    with pytest.raises(ValueError, match="bad record header|bytes"):
        eng.load_history(("t", "cpu=1"), b"not a history record")
    assert not eng.turn_failed
    assert eng.history is history           # memory was not reloaded from the store
    eng.close()


def _enqueue_in_one_turn(eng, first, second, second_raises):
    """Enqueue ``first``, then ``second`` in one outer turn, going on when the second raises
    ``second_raises`` (as a shard answers an error and serves the turn's other requests)."""
    with eng.turn():
        eng.enqueue_many([first])
        if second_raises is None:
            eng.enqueue_many([second])
        else:
            with pytest.raises(second_raises):
                eng.enqueue_many([second])


@settings(max_examples=40, deadline=None)
@given(plan=st.lists(st.tuples(st.sampled_from(["ok", "bug", "refused", "tick"]),
                               st.booleans(), st.integers(0, 2)),
                     min_size=1, max_size=10))
def test_no_error_inside_a_turn_leaves_memory_apart_from_the_store(plan):
    """Enqueues that succeed, are refused, or fail part-way (a bug), alone or inside an outer
    turn whose caller catches the error and goes on, with ticks between: after every step
    memory is what a reload from the store gives, every acknowledged enqueue is there, and
    nothing of a failed one or of a turn that held one."""
    eng, clock = open_engine(MemoryStore(4))
    acked, gone, n = [], [], 0
    for kind, nested, task in plan:
        if kind == "tick":
            eng.tick()
        else:
            n += 1
            aid = f"acme/p/d/r{task}/a{n}"
            kw = {}
            if kind == "bug":
                kw["timeouts"] = Timeouts(max_runtime=_BuggySeconds(60))
            elif kind == "refused":
                kw["run_queue"] = "no-such-queue"
            one = ActionSpec(id=aid, task=f"t{task}", resources={"cpu": 1}, **kw)
            with_it = ActionSpec(id=f"acme/p/d/r{task}/b{n}", task=f"t{task}",
                                 resources={"cpu": 1})
            expected = RuntimeError if kind == "bug" else SpecError
            if nested:
                if kind == "bug":
                    with pytest.raises(StoreError, match="failed unexpectedly"):
                        _enqueue_in_one_turn(eng, with_it, one, expected)
                    gone += [aid, str(with_it.id)]
                else:
                    _enqueue_in_one_turn(eng, with_it, one, None if kind == "ok" else expected)
                    acked.append(str(with_it.id))
                    (acked if kind == "ok" else gone).append(aid)
            elif kind == "ok":
                eng.enqueue_many([one])
                acked.append(aid)
            else:
                with pytest.raises(expected):
                    eng.enqueue_many([one])
                gone.append(aid)
        assert not eng.turn_failed
        eng, clock = restart(eng, clock)
        assert eng.inspect().action_rows == len(acked)
        for aid in acked:
            eng.phase(aid)          # raises NotFound if an acknowledged enqueue was lost
        for aid in gone:
            with pytest.raises(NotFound):
                eng.phase(aid)
    eng.close()


class _LoadFailsOnce(MemoryStore):
    """A store whose first scan of fixed records fails (a disk error while a start loads)."""

    failed = False

    def scan_fixed(self, *args, **kwargs):
        if not self.failed:
            self.failed = True
            raise OSError("I/O error")
        return super().scan_fixed(*args, **kwargs)


def test_a_first_start_that_fails_writes_nothing_into_the_store():
    # The layout (and secret) of a new store were written before its memory was made: a
    # first start that then failed left a store holding that config's layout, refusing
    # every other config ("a shard with state ...") though it held no state at all.
    store = _LoadFailsOnce(4)
    with pytest.raises(OSError, match="I/O error"):
        Engine(parse_config(CONFIG), clock=ManualClock(), store=store)
    meta = store.backing.data[0]["meta"]
    assert b"engine-layout" not in meta and b"engine-secret" not in meta, sorted(meta)
    cfg = {**CONFIG, "queues": {"cpu": CONFIG["queues"]["cpu"], "gpu": CONFIG["queues"]["gpu"]}}
    eng = Engine(parse_config(cfg), clock=ManualClock(),
                 store=MemoryStore(4, backing=store.backing))
    assert eng.inspect().queue_names() == ["cpu", "gpu"]
    eng.close()
    # The next start reads the layout the successful one wrote.
    with pytest.raises(ConfigError, match="only append queues"):
        Engine(parse_config(CONFIG), clock=ManualClock(),
               store=MemoryStore(4, backing=store.backing))


def test_tables_larger_than_the_machine_are_refused_at_start():
    # initial_capacity 2**31 - 1 is a valid int32 row count, but its tables (~0.7 TiB) grew
    # the process until the system killed it, with no word of why.
    cfg = {**CONFIG, "engine": {**CONFIG.get("engine", {}), "initial_capacity": 2**31 - 1}}
    with pytest.raises(ConfigError, match=r"engine.initial_capacity 2147483647 / "
                                          r"dispatch_capacity \d+: the shard's tables would "
                                          r"take [\d.]+ GiB when made, more than this "
                                          r"machine's memory"):
        Engine(parse_config(cfg), clock=ManualClock(), store=MemoryStore(4))


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 6), width=st.integers(1, 4), seed=st.integers(0, 2**32 - 1),
       m=st.integers(0, 300), stride=st.integers(1, 3))
def test_reload_recount_adds_each_row_where_its_index_says(rows, width, seed, m, stride):
    # cext._bulk.add_by, reload's sums of demand by queue and cluster: what np.add.at gives,
    # over a strided index (the columns are views of the packed record once packed).
    rng = np.random.default_rng(seed)
    index = rng.integers(0, rows, size=m * stride, dtype=np.int32)[::stride]
    values = rng.integers(0, 2**62, size=(m, width), dtype=np.int64)
    out = rng.integers(0, 2**62, size=(rows, width), dtype=np.uint64)
    want = out.copy()
    np.add.at(want, index, values.view(np.uint64))
    add_by(out, index, values)
    assert (out == want).all()


def test_reload_recount_refuses_an_index_outside_and_adds_nothing():
    out = np.zeros((2, 3), dtype=np.uint64)
    values = np.ones((3, 3), dtype=np.int64)
    with pytest.raises(IndexError, match=r"index\[2\]=2 is not a row of out"):
        add_by(out, np.array([0, 1, 2], dtype=np.int32), values)
    with pytest.raises(IndexError, match=r"index\[0\]=-1"):
        add_by(out, np.array([-1, 1, 0], dtype=np.int32), values)
    assert not out.any()
    with pytest.raises(ValueError, match="values of shape"):
        add_by(out, np.array([0, 1], dtype=np.int32), values)
