"""Review of the durability + reload + backfill integration: one regression test per bug."""

import copy
import dataclasses
import random
from dataclasses import replace

import numpy as np
import pytest
from test_durable import CONFIG, assert_same, decision_state, open_engine, restart, spec

from engine import (
    ActionSpec,
    AlreadyExists,
    Engine,
    Phase,
    PodGroup,
    RetryPolicy,
    ReusePolicy,
    SpecError,
    Timeouts,
    parse_config,
)
from engine._codes import (
    T_DEADLINE,
    T_FINALIZE,
    T_QUEUED,
    T_RETRY,
    T_RUNTIME,
    LeaseEnd,
    LeaseKind,
    RowState,
)
from engine._history import RuntimeHistory
from engine._rows import LIVE_STATES
from storage import MemoryStore, StoreError

AID = "acme/p/d/r1/a1"


def test_max_queued_time_of_a_retry_fires_after_a_restart_during_its_backoff():
    # The retry attempt's max_queued_time was armed when the backoff began; a restart while
    # the action was in BACKOFF dropped it (only QUEUED rows got their T_QUEUED timer back).
    eng, clock = open_engine(MemoryStore(4), workers={"ww": ("west", 50)})
    eng.enqueue(spec(1, retries=RetryPolicy(count=2, backoff_base=10),
                     timeouts=Timeouts(max_queued_time=5)))
    (a,) = eng.tick()
    eng.report(a.token, Phase.FAILED, error_kind="USER", recoverable=True)
    eng, clock = restart(eng, clock, workers={})     # no worker: the retry stays queued
    clock.advance(11)
    eng.schedule()                                    # backoff over: queued again
    clock.advance(6)
    eng.schedule()                                    # its max_queued_time has passed
    atts = eng.attempts(AID)
    assert atts[1].phase == Phase.TIMED_OUT.value and atts[1].cause == "max_queued_time"
    assert len(atts) == 3


def test_a_failed_registration_leaves_no_worker_whose_identity_is_not_durable():
    # The restore after a failed register_worker re-registered the new worker (it was
    # connected in memory) and dropped the identity record that re-registration wrote: its
    # leases then carried an identity the store never had, and the next reload refused the
    # store (CorruptRecord "lease holder is not a known worker").
    eng, clock = open_engine(MemoryStore(4), workers={})
    eng.store.fail_next(StoreError("injected"))
    try:
        eng.register_worker("new", "west", 5)
    except StoreError:
        pass
    eng.register_worker("new", "west", 5)            # the worker retries its registration
    eng.enqueue(spec(1))
    assert [a.worker for a in eng.tick()] == ["new"]
    eng, clock = restart(eng, clock, workers={"new": ("west", 5)})
    assert eng.phase(AID) == Phase.INITIALIZING


def test_re_enqueue_after_a_restart_of_a_gang_given_as_a_list_is_idempotent():
    # The stored spec comes back with pods as a tuple; compared with ``!=`` against the
    # client's identical spec (pods as a list, which enqueue accepts) it looked different,
    # so a client retrying after a restart got AlreadyExists.
    gang = ActionSpec(id=AID, task="t", run_queue="gpu",
                      pods=[PodGroup(role="w", replicas=2, resources={"cpu": 8, "gpu:H100": 8})])
    eng, clock = open_engine(MemoryStore(4))
    eng.enqueue(gang)
    eng.enqueue(gang)
    eng, clock = restart(eng, clock)
    assert str(eng.enqueue(gang)) == AID
    with pytest.raises(AlreadyExists):
        eng.enqueue(replace(gang, pods=[PodGroup(role="w", replicas=1,
                                                 resources={"cpu": 8, "gpu:H100": 8})]))


def test_a_cluster_added_to_the_config_is_open_to_actions_queued_before_the_restart():
    # The fit mask (clusters an action could ever fit) is derived from the cluster config
    # but was stored and reloaded as is: after a restart with a cluster appended (or a
    # capacity raised) an action acknowledged before could not use it and failed
    # UNSCHEDULABLE ("cluster north: ?"), while the same spec enqueued after ran there.
    eng, clock = open_engine(MemoryStore(4), workers={})
    big = {"cpu": 1, "memory": "300Gi"}               # fits neither east's nodes nor west
    eng.enqueue(spec(1, resources=big))
    cfg = copy.deepcopy(CONFIG)
    cfg["clusters"]["north"] = {"capacity": {"cpu": 128, "memory": "512Gi"}}
    eng, clock = restart(eng, clock, cfg=cfg, workers={"wn": ("north", 5)})
    (a,) = eng.tick()
    assert (str(a.action), a.cluster) == (AID, "north")
    eng, clock = restart(eng, clock, cfg=cfg, workers={"wn": ("north", 5)})
    assert eng.explain(AID).phase == Phase.INITIALIZING


# ---------------------------------------------------------------------------------------------
# Memory equals a fresh reload of the store after every transition (the harness that found
# the timer bug above): rows, counters, Python edges, finalize leases, pending timers,
# undelivered decisions, worker slots, ETAs and positions; with restarts and failed commits.

FUZZ_CONFIG = copy.deepcopy(CONFIG)
FUZZ_CONFIG["engine"].update(finalize_timeout=60, runtime_grace=5)
WORKER_CLUSTERS = {"we": "east", "ww": "west"}


def _reload_copy(eng, clock):
    store = MemoryStore(eng.store.partitions, backing=copy.deepcopy(eng.store.backing))
    return Engine(parse_config(FUZZ_CONFIG), clock=clock, store=store)


def _pending_timers(eng):
    """Timers that would still act when they fire, as (due, kind, row)."""
    ins = eng.inspect()
    st, out, now = ins.arrays, set(), eng.clock.now_ns()
    for t in ins.timers():          # set since the load and restored, not fired yet
        due, kind, row, ref = t.due_ns, t.kind, t.row, t.ref
        if kind == T_FINALIZE:
            # Only the bound its finalize row holds (a freed or reused row holds another).
            ok = (st.fz_state[row] not in (RowState.DONE, RowState.FREE)
                  and st.fz_give_up[row] == due)
        else:
            s = st.a_state[row]
            # A timer acts only while its row's due column still holds it (re-armed or
            # reclaimed rows hold another due).
            armed = {T_DEADLINE: st.a_deadline_due, T_QUEUED: st.a_queued_due,
                     T_RETRY: st.a_retry_due, T_RUNTIME: st.a_runtime_due}[kind][row] == due
            ok = armed and s != RowState.DONE and {
                T_DEADLINE: not (due <= now and s in LIVE_STATES),
                T_QUEUED: s in (RowState.QUEUED, RowState.BACKOFF) and ref == st.a_attempt[row],
                T_RETRY: s == RowState.BACKOFF and ref == st.a_attempt[row],
                T_RUNTIME: s == RowState.RUNNING and ref == st.a_gen[row],
            }[kind]
        if ok:
            out.add((due, kind, row))
    return sorted(out)


def _undelivered(eng):
    ins = eng.inspect()
    st = ins.arrays
    out = set()
    for e in ins.dispatch():        # the ring from its head to its tail
        row, gen, kind = e.row, e.generation, int(e.kind)
        if kind == LeaseKind.FINALIZE:
            live = (st.fz_gen[row] == gen and st.fz_end[row] == LeaseEnd.LIVE
                    and st.fz_state[row] == RowState.SENT)
        else:
            live = (st.a_gen[row] == gen and st.a_end[row] == LeaseEnd.LIVE
                    and st.a_state[row] in LIVE_STATES)
        if live:
            out.add((kind, row, gen, e.worker))
    return sorted(out)


def _full_state(eng):
    rows, counters, qr, phases, fz = decision_state(eng)
    ins = eng.inspect()
    st, n = ins.arrays, ins.action_rows
    counters = {k: v.copy() for k, v in counters.items()}
    for e in range(ins.env_rows):   # idle warm pools are not restored (documented)
        if st.e_cluster[e] >= 0 and st.e_adm[e] == st.e_rel[e]:
            counters["q_res"][st.e_queue[e]] -= st.e_footprint[e].astype(np.uint64)
            counters["c"][st.e_cluster[e]] -= st.e_footprint[e].astype(np.uint64)
    recs = {r: ins.record(r) for r in range(n) if st.a_state[r] != RowState.FREE}
    edges = {r: (rec.message, rec.cause, [dataclasses.asdict(a) for a in rec.attempts])
             for r, rec in recs.items()}
    slots = {}
    for w in range(ins.worker_sessions):
        name = ins.worker_at(w)
        slots[name] = slots.get(name, 0) + int(st.w_adm[w] - st.w_rel[w])
    queued = [r for r in range(n) if st.a_state[r] == RowState.QUEUED]
    extra = {
        "fz": [(int(st.fz_end[f]), int(st.fz_released_gen[f]), int(st.fz_give_up[f]),
                int(st.fz_attempt[f])) for f in range(ins.finalize_rows)],
        "timers": _pending_timers(eng), "undelivered": _undelivered(eng), "slots": slots,
        "eta": [ins.head_eta(r) for r in queued], "position": [ins.position(r) for r in queued],
        "pred": st.t_pred_rt[:len(ins.tasks())].tolist(), "tasks": ins.tasks(),
        "queues": ins.queue_changes(), "edges": edges,
    }
    return (rows, counters, qr, phases, fz), extra


def _fuzz_spec(rng, i, acked):
    tenant = rng.choice(["acme", "beta"])
    kw = {"timeouts": Timeouts(deadline=rng.choice([None, None, 30.0, 200.0]),
                               max_queued_time=rng.choice([None, 20.0, 60.0]),
                               max_runtime=rng.choice([None, 10.0])),
          "retries": RetryPolicy(count=rng.choice([0, 1, 2]),
                                 backoff_base=rng.choice([1.0, 5.0]))}
    run = None
    if acked and rng.random() < 0.3:
        parent = rng.choice(acked)
        if parent.split("/")[0] == tenant:
            kw["parent"], run = parent, parent.split("/")[3]
    k = rng.random()
    if k < 0.25:
        return spec(i, tenant, run, run_queue="gpu", resources={"cpu": 4, "gpu:H100": 2}, **kw)
    if k < 0.35:
        return spec(i, tenant, run, run_queue="gpu", pods=(PodGroup(
            role="w", replicas=2, resources={"cpu": 8, "gpu:H100": 8}),), **kw)
    if k < 0.5:
        kw.pop("timeouts")
        return spec(i, tenant, run, environment="env1", resources={"cpu": 2},
                    reuse=ReusePolicy(replicas=1, concurrency=2, idle_ttl=30.0), **kw)
    return spec(i, tenant, run, **kw)


def _connected(eng, worker):
    """Whether ``worker``'s current session is connected."""
    ins = eng.inspect()
    return bool(ins.arrays.w_connected[ins.worker_sessions_by_id()[worker]])


def _fuzz_step(eng, clock, rng, acked, live, counter):
    op = rng.random()
    if op < 0.2:
        batch = []
        for _ in range(rng.randint(1, 3)):
            counter[0] += 1
            batch.append(_fuzz_spec(rng, counter[0], acked))
        acked += [str(x) for x in eng.enqueue_many(batch)]
        eng.enqueue_many(batch[:1])                       # idempotent
    elif op < 0.35:
        live.update((a.token, a) for a in eng.tick())
    elif op < 0.4:
        eng.schedule()
    elif op < 0.45:
        live.update((a.token, a) for a in eng.drain_dispatch(rng.choice([None, 1])))
    elif op < 0.55 and live:
        eng.report(rng.choice(list(live)), Phase.RUNNING)
    elif op < 0.68 and live:
        token = rng.choice(list(live))
        a = live.pop(token)
        x = rng.random()
        if a.kind == LeaseKind.FINALIZE or x < 0.5:
            eng.report(token, Phase.SUCCEEDED, cleanup=rng.random() < 0.3)
        elif x < 0.8:
            eng.report(token, Phase.FAILED, error_kind=rng.choice(["USER", "SYSTEM"]),
                       cause="OOM", cleanup=rng.random() < 0.3)
        else:
            eng.report(token, Phase.TIMED_OUT, cause="max_runtime")
    elif op < 0.73 and acked:
        eng.abort(rng.choice(acked))
    elif op < 0.76:
        w = rng.choice(list(WORKER_CLUSTERS))
        eng.register_worker(w, WORKER_CLUSTERS[w], 50)   # a new session ends the old one
        for token in [t for t, a in live.items() if a.worker == w]:
            live.pop(token)
    elif op < 0.78:
        w = rng.choice(list(WORKER_CLUSTERS))
        if _connected(eng, w):
            eng.unregister_worker(w)
        else:
            eng.register_worker(w, WORKER_CLUSTERS[w], 50)
    elif op < 0.8:
        eng.update_queue("cpu", action_concurrency=rng.choice([5, 20]))
    elif op < 0.82:
        h = RuntimeHistory()
        key = eng.history_key(spec(rng.choice([0, 2, 4])))     # task t0 at 1, 3 or 2 cpu
        h.record_ns(key, rng.choice([1, 5, 50]) * 10**9)
        eng.load_history(key, h.encode(key))
    else:
        clock.advance(rng.choice([1, 5, 15, 40, 70]))
        for w in WORKER_CLUSTERS:
            if rng.random() < 0.8 and _connected(eng, w):
                eng.heartbeat(w, [t for t, a in live.items() if a.worker == w])


@pytest.mark.parametrize("seed", range(6))
def test_memory_equals_a_reload_of_the_store_after_every_transition(seed):
    rng = random.Random(seed)
    eng, clock = open_engine(MemoryStore(4), cfg=FUZZ_CONFIG)
    acked, live, counter = [], {}, [0]
    for step in range(120):
        failing = rng.random() < 0.1
        if failing:
            eng.store.fail_next(StoreError("injected"))
        try:
            _fuzz_step(eng, clock, rng, acked, live, counter)
        except StoreError:
            assert failing
            live.clear()
        except SpecError:
            pass                                          # e.g. the parent was aborted
        eng.store.clear_failure()                         # not consumed: withdrawn
        if rng.random() < 0.05:                           # a restart
            again = _reload_copy(eng, clock)
            eng.close()
            eng = again
            for w, cluster in WORKER_CLUSTERS.items():
                eng.register_worker(w, cluster, 50)
        # Runtime samples reach the store within a second, not with their transition
        # (docs/architecture.md, "Runtime history"): compare with them written.
        eng.flush_history()
        copy_ = _reload_copy(eng, clock)
        a, b = _full_state(eng), _full_state(copy_)
        copy_.close()
        assert_same(a[0], b[0])
        for key in a[1]:
            assert a[1][key] == b[1][key], (step, key)
