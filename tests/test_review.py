"""Review of the durability + reload + backfill integration: one regression test per bug."""

import copy
from dataclasses import replace

import pytest
from test_durable import CONFIG, open_engine, restart, spec

from engine import ActionSpec, Phase, PodGroup, RetryPolicy, Timeouts
from engine._engine import AlreadyExists
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
    eng._store.fail_next(StoreError("injected"))
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
