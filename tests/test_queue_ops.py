"""Live queue operations in the engine: ``paused`` (the tick places nothing from the queue)
and ``draining`` (admission refuses new actions), as ``update_queue`` keys: applied on the
next tick, nothing in flight touched, durable across a restart, settable in the file."""

import pytest

from engine import ActionSpec, ConfigError, Phase, ResourceExhausted, WaitCode
from engine._config import parse_config
from storage import LmdbStore
from tests.conftest import make_engine


def config(**queue):
    return {
        "resources": ["cpu"],
        "clusters": {"east": {"capacity": {"cpu": 8}}},
        "queues": {"q": {"scheduling": "STRICT_FIFO", **queue}, "other": {}},
        "engine": {"default_queue": "q"},
    }


def spec(name, queue="q", cpu=1):
    return ActionSpec(id=f"acme/p/d/r/{name}", task="t", resources={"cpu": cpu},
                      run_queue=queue)


def test_a_paused_queue_places_nothing_and_resumes_on_the_next_tick():
    eng, _ = make_engine(config())
    eng.enqueue(spec("a"))
    (running,) = eng.tick()
    eng.report(running.token, Phase.RUNNING)
    eng.update_queue("q", paused=True)
    eng.enqueue(spec("b"))
    eng.enqueue(spec("c", queue="other"))
    placed = eng.tick()
    assert [str(a.action) for a in placed] == ["acme/p/d/r/c"]     # other queues unaffected
    exp = eng.explain("acme/p/d/r/b")
    assert exp.phase == Phase.QUEUED and exp.wait == WaitCode.QUEUE_PAUSED
    assert "paused" in exp.reason and "--paused false" in exp.reason
    assert eng.explain("acme/p/d/r/a").phase == Phase.RUNNING      # nothing in flight killed
    m = eng.queue_metrics("q")
    assert m["paused"] is True and m["depth"] == 1 and m["actions_in_flight"] == 1
    assert m["head_blocked"] is None        # a paused queue holds no capacity for its head
    eng.update_queue("q", paused=False)
    assert [str(a.action) for a in eng.tick()] == ["acme/p/d/r/b"]


def test_a_paused_strict_head_stops_holding_capacity():
    eng, _ = make_engine(config())
    eng.enqueue(spec("big", cpu=6))
    (big,) = eng.tick()
    eng.enqueue(spec("gang", cpu=8))        # cannot fit while big runs: holds the cluster
    eng.tick()
    assert eng.explain("acme/p/d/r/gang").wait == WaitCode.CLUSTER_CAPACITY
    eng.update_queue("q", paused=True)
    eng.tick()
    assert eng.explain("acme/p/d/r/gang").wait == WaitCode.QUEUE_PAUSED
    assert eng.queue_metrics("q")["head_blocked"] is None


def test_a_draining_queue_refuses_new_actions_and_lets_what_it_has_run():
    eng, _ = make_engine(config(action_concurrency=1))
    eng.enqueue_many([spec("a"), spec("b")])
    (a,) = eng.tick()
    eng.update_queue("q", draining=True)
    with pytest.raises(ResourceExhausted, match="queue q: draining.*nothing was enqueued"):
        eng.enqueue(spec("new"))
    with pytest.raises(ResourceExhausted, match="draining"):
        eng.enqueue_fanout(spec("t"), ["x", "y"])
    assert eng.enqueue(spec("a")) is not None          # a re-enqueue of a known id: a no-op
    eng.enqueue(spec("elsewhere", queue="other"))      # other queues still take work
    eng.report(a.token, Phase.SUCCEEDED)
    (b,) = [x for x in eng.tick() if x.action.action == "b"]   # what was queued still runs
    eng.report(b.token, Phase.SUCCEEDED)
    m = eng.queue_metrics("q")
    assert m["draining"] is True and m["depth"] == 0 and m["actions_in_flight"] == 0
    eng.update_queue("q", draining=False)
    eng.enqueue(spec("new"))


def test_the_flags_survive_a_restart_and_can_be_set_in_the_file(tmp_path):
    cfg = parse_config(config(), "<test>")
    store = LmdbStore(str(tmp_path / "data"), partitions=2)
    eng, _ = make_engine(config(), store=store)
    eng.update_queue("q", paused=True, draining=True)
    eng.close()
    again, _ = make_engine(config(), store=LmdbStore(str(tmp_path / "data"), partitions=2))
    q = again.inspect().queue("q")
    assert q.paused and q.draining
    again.enqueue(spec("x", queue="other"))
    with pytest.raises(ResourceExhausted):
        again.enqueue(spec("y"))
    again.close()
    assert not cfg.queue("q").paused
    assert parse_config(config(paused=True), "<test>").queue("q").paused


def test_a_change_may_give_the_queues_own_name_but_not_another():
    # The name was also update_queue's own parameter: "got multiple values for argument".
    eng, _ = make_engine(config())
    assert eng.update_queue("q", name="q", paused=True).paused is True
    with pytest.raises(ConfigError, match="a queue cannot be renamed"):
        eng.update_queue("q", name="other")
