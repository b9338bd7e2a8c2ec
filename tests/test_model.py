"""The action model: ids, Flyte 2 resource spellings, gangs, queue resolution, environment
identity, and the refusals of bad specs."""

from datetime import timedelta

import numpy as np
import pytest

from engine import (
    ActionId,
    ActionSpec,
    Execution,
    PodGroup,
    RetryPolicy,
    ReusePolicy,
    SpecError,
    Timeouts,
)
from engine._model import compile_spec
from engine._units import ResourceSet, format_quantity, parse_quantity

RES = ResourceSet(("cpu", "memory", "ephemeral_storage", "gpu:H100", "gpu:A100"))
QUEUES = {"default": None, "env-q": None, "task-q": None, "run-q": None}


def compile_(**kw):
    kw.setdefault("id", "acme/proj/dev/r1/a1")
    kw.setdefault("task", "train")
    return compile_spec(ActionSpec(**kw), RES, QUEUES, "default")


def test_action_id_parses_and_names_the_bad_part():
    aid = ActionId.parse("acme/proj/dev/r1/a1")
    assert (aid.run_key, str(aid)) == ("acme/proj/dev/r1", "acme/proj/dev/r1/a1")
    with pytest.raises(SpecError, match="must have 5 parts"):
        ActionId.parse("acme/proj/dev/r1")
    with pytest.raises(SpecError, match="domain '' is invalid"):
        ActionId.parse("acme/proj//r1/a1")
    with pytest.raises(SpecError, match=r"action 'a1\\n' is invalid"):
        ActionId.parse("acme/proj/dev/r1/a1\n")     # ("$" matched before a final newline)


@pytest.mark.parametrize(("name", "value", "expected"), [
    ("cpu", 8, 8000), ("cpu", "500m", 500), ("cpu", "1.5", 1500), ("cpu", 0.25, 250),
    ("memory", "64Gi", 64 * 2**30), ("memory", "1G", 10**9), ("memory", 1024, 1024),
    ("ephemeral_storage", "10Ti", 10 * 2**40), ("gpu:H100", 8, 8),
])
def test_quantities_in_their_units(name, value, expected):
    assert parse_quantity(name, RES.kind(name), value) == expected
    assert parse_quantity(name, RES.kind(name), format_quantity(name, expected)) == expected


@pytest.mark.parametrize(("name", "value", "message"), [
    ("cpu", "1.0001", "finer than one millicore"), ("cpu", "2Gi", "cpu takes cores or 'm'"),
    ("memory", "3Qi", "unknown unit 'Qi'"), ("gpu:H100", 1.5, "whole count"),
    ("cpu", -1, "negative"), ("memory", True, "not a quantity"),
])
def test_bad_quantities_say_what_is_wrong(name, value, message):
    with pytest.raises(ValueError, match=message):
        parse_quantity(name, RES.kind(name), value)


def test_flyte_resource_spellings_become_a_demand_vector():
    c = compile_(resources={"cpu": 8, "memory": "64Gi", "gpu": "H100:8", "disk": "1Ti"})
    assert c.demand.tolist() == [8000, 64 * 2**30, 2**40, 8, 0]
    with pytest.raises(SpecError, match=r"gpu=8 is ambiguous: name the device, e\.g\. "
                                        r"gpu=\"H100:8\""):
        compile_(resources={"gpu": 8})
    with pytest.raises(SpecError, match="device 'gpu:V100' is not configured"):
        compile_(resources={"gpu": "V100:1"})
    only_h100 = ResourceSet(("cpu", "gpu:H100"))
    c = compile_spec(ActionSpec(id="a/b/c/d/e", task="t", resources={"gpu": 2}), only_h100,
                     QUEUES, "default")
    assert c.demand.tolist() == [0, 2]


def test_a_gang_has_per_pod_vectors_and_their_total():
    c = compile_(pods=(PodGroup("head", 1, {"cpu": 4, "memory": "16Gi"}),
                       PodGroup("worker", 3, {"cpu": 8, "gpu": "H100:8"})))
    assert c.pods[:, [0, 3]].tolist() == [[4000, 0], [8000, 8]]
    assert c.pod_counts.tolist() == [1, 3]
    assert c.demand[[0, 1, 3]].tolist() == [28000, 16 * 2**30, 24]


def test_queue_resolves_environment_then_task_then_run_then_default():
    assert compile_().queue == "default"
    assert compile_(run_queue="run-q").queue == "run-q"
    assert compile_(run_queue="run-q", task_queue="task-q").queue == "task-q"
    assert compile_(run_queue="run-q", task_queue="task-q",
                    environment_queue="env-q").queue == "env-q"
    with pytest.raises(SpecError, match="task_queue 'nope' does not exist"):
        compile_(task_queue="nope", environment_queue="env-q")
    with pytest.raises(SpecError, match=r"run_queue \['q'\] does not exist"):
        compile_(run_queue=["q"])            # (a TypeError, "unhashable type", naming nothing)


def test_environment_identity_is_stable_and_changes_with_what_defines_the_pool():
    base = {"environment": "trainer", "image": "torch:2", "resources": {"cpu": 8},
            "reuse": ReusePolicy(replicas=4, concurrency=2, idle_ttl=600)}
    a = compile_(**base)
    assert a.env_key == compile_(id="acme/proj/dev/r2/other", task="eval", **base).env_key
    assert (a.env_slots, a.env_idle_ttl_ns) == (8, 600 * 10**9)
    assert a.demand.tolist() == [32000, 0, 0, 0, 0]          # footprint: 4 replicas x pod
    for change in ({"image": "torch:3"}, {"resources": {"cpu": 4}},
                   {"reuse": ReusePolicy(replicas=2, concurrency=2, idle_ttl=600)},
                   {"environment": "other"}):
        assert compile_(**{**base, **change}).env_key != a.env_key
    assert compile_(id="other/proj/dev/r1/a1", **base).env_key != a.env_key   # per tenant


@pytest.mark.parametrize(("kw", "message"), [
    ({"task": ""}, "task name is required"),
    ({"resources": {"cpu": 1}, "pods": (PodGroup("w", 1, {"cpu": 1}),)}, "not both"),
    ({"pods": ()}, "at least one pod group"),
    ({"pods": (PodGroup("w", 0, {"cpu": 1}),)}, r"pods\[w\]\.replicas: 0 must be >= 1"),
    ({"pods": (PodGroup("w", 1, {}), PodGroup("w", 1, {}))}, "role 'w' appears twice"),
    ({"reuse": ReusePolicy()}, "reuse needs an environment name"),
    ({"environment": "e", "reuse": ReusePolicy(), "pods": (PodGroup("w", 1, {}),)},
     "a gang cannot be reused"),
    ({"run_max_action_concurrency": 1}, "must be 0 \\(unlimited\\) or >= 2"),
    ({"retries": RetryPolicy(count=-1)}, "retries.count: -1 must be >= 0"),
    ({"retries": RetryPolicy(backoff_factor=0.5)}, "backoff_factor: 0.5 must be >= 1"),
    ({"timeouts": Timeouts(deadline=0)}, "timeouts.deadline: 0 must be positive"),
    ({"timeouts": Timeouts(max_runtime="1h")}, "is not a duration"),
    ({"parent": "acme/proj/dev/OTHER/p"}, "is in another run"),
    ({"parent": "acme/proj/dev/r1/a1"}, "cannot be its own parent"),
    ({"task": "t\0x"}, "task: 't.x00x' contains a NUL byte"),
    ({"environment": {"bogus": 1}}, "environment: {'bogus': 1} is not a name"),
    ({"image": 7}, "image: 7 is not a name"),
    ({"pods": (PodGroup("w\0", 1, {}),)}, "pods: role: 'w.x00' contains a NUL byte"),
    ({"timeouts": Timeouts(max_queued_time=1e12)}, "timeouts.max_queued_time: .* is too long"),
])
def test_bad_specs_are_refused_naming_the_action_and_the_field(kw, message):
    with pytest.raises(SpecError, match=message) as err:
        compile_(**kw)
    assert str(err.value).startswith("action acme/proj/dev/r1/a1: ")


def test_timedeltas_and_from_dict():
    c = compile_(timeouts=Timeouts(deadline=timedelta(hours=2)))
    assert c.spec.timeouts.deadline == 7200.0      # stored and computed in seconds
    spec = ActionSpec.from_dict({"id": "acme/proj/dev/r1/a1", "task": "t",
                                 "pods": [{"role": "w", "replicas": 2,
                                           "resources": {"gpu": "H100:4"}}],
                                 "retries": {"count": 2}})
    c = compile_spec(spec, RES, QUEUES, "default")
    assert c.demand[3] == 8 and c.spec.retries.count == 2
    with pytest.raises(SpecError, match="unknown key\\(s\\) colour"):
        ActionSpec.from_dict({"id": "a/b/c/d/e", "task": "t", "colour": "red"})
    with pytest.raises(SpecError, match="retries: unknown key\\(s\\) tries"):
        ActionSpec.from_dict({"id": "a/b/c/d/e", "task": "t", "retries": {"tries": 1}})
    # A missing key is named, not a Python call's complaint about its arguments.
    with pytest.raises(SpecError,
                       match="^action spec: missing key\\(s\\) task \\(required: id, task\\)"):
        ActionSpec.from_dict({"id": "a/b/c/d/e"})
    with pytest.raises(SpecError, match="^pods\\[\\]: missing key\\(s\\) replicas, resources"):
        ActionSpec.from_dict({"id": "a/b/c/d/e", "task": "t", "pods": [{"role": "w"}]})
    assert np.array_equal(compile_(resources=None).demand, np.zeros(5, dtype=np.int64))


@pytest.mark.parametrize(("kw", "message"), [
    ({"resources": {"cpu": 2**70}}, "cpu: 1180591620717411303424 is too large"),
    ({"resources": {"cpu": float("inf")}}, "cpu: inf is not a finite quantity"),
    ({"resources": {"memory": float("nan")}}, "memory: nan is not a finite quantity"),
    ({"pods": (PodGroup("w", 8, {"memory": "1Ei"}),)}, r"pods: the total memory .* is too large"),
    ({"pods": (PodGroup("w", 10**7, {"cpu": 1}),)}, "must be >= 1 and <= 1000000"),
    ({"environment": "e", "resources": {"cpu": 1},
      "reuse": ReusePolicy(replicas=10**7, concurrency=1)}, "reuse.replicas"),
])
def test_oversized_quantities_are_refused_not_wrapped(kw, message):
    with pytest.raises(SpecError, match=message):
        compile_(**kw)


def test_an_execute_declaration_round_trips_and_is_kept_on_the_spec():
    spec = ActionSpec.from_dict({"id": "t/p/d/r/a", "task": "t", "resources": {"cpu": 1},
                                 "execute": {"plugin": "sim", "duration": [0.5, 2],
                                             "fail": "SYSTEM:OOM", "fail_attempts": 1}})
    c = compile_spec(spec, RES, QUEUES, "default")
    assert c.spec.execute == Execution(plugin="sim", duration=(0.5, 2), fail="SYSTEM:OOM",
                                       fail_attempts=1)
    assert c.spec.execute.sim_failure() == ("SYSTEM", "OOM")


@pytest.mark.parametrize("execute, message", [
    ({"duration": 1}, "execute needs a plugin"),
    ({"plugin": "k8s"}, "execute.plugin 'k8s' is not one of process, python, sim"),
    ({"plugin": {"a": 1}}, "execute.plugin {'a': 1} is not one of process, python, sim"),
    ({"plugin": "sim", "colour": 1}, "execute: unknown key(s) colour"),
    ({"plugin": "sim", "command": ["x"]}, "execute.command does not apply to the sim plugin"),
    ({"plugin": "process"}, "execute.command must be a non-empty list of strings"),
    ({"plugin": "process", "command": ["ls", 3]}, "execute.command must be a non-empty list"),
    ({"plugin": "process", "command": ["ls"], "env": {"1X": "a"}},
     "execute.env: '1X' is not an environment variable name"),
    ({"plugin": "process", "command": ["ls"], "env": {"X": 1}}, "execute.env.X must be a string"),
    ({"plugin": "process", "command": ["ls", "a\0b"]}, "execute.command[1] contains a NUL"),
    ({"plugin": "process", "command": ["ls"], "env": {"X": "\0"}}, "execute.env.X contains a NUL"),
    ({"plugin": "sim", "duration": 1e300}, "at most 315360000"),
    ({"plugin": "python", "function": "os.getpid"}, "must be \"package.module:function\""),
    ({"plugin": "python", "function": "os:getpid", "args": [1]}, "execute.args must be a table"),
    ({"plugin": "sim", "duration": -1}, "execute.duration -1 must be seconds >= 0"),
    ({"plugin": "sim", "duration": [2, 1]}, "execute.duration (2, 1) must be seconds"),
    ({"plugin": "sim", "fail": "OOM"}, "execute.fail 'OOM' must be \"USER\" or"),
    ({"plugin": "sim", "fail": "SYSTEM:oom"}, "execute.fail 'SYSTEM:oom' must be"),
    ({"plugin": "sim", "fail_attempts": 1}, "execute.fail_attempts needs execute.fail"),
    ({"plugin": "sim", "fail": "USER", "fail_attempts": 0}, "execute.fail_attempts 0 must be"),
])
def test_a_bad_execute_declaration_is_refused_naming_the_key(execute, message):
    with pytest.raises(SpecError) as info:
        compile_spec({"id": "t/p/d/r/a", "task": "t", "resources": {"cpu": 1},
                      "execute": execute}, RES, QUEUES, "default")
    assert message in str(info.value)


def test_the_python_plugin_refuses_a_gang():
    pods = [{"role": "w", "replicas": 2, "resources": {"cpu": 1}}]
    with pytest.raises(SpecError, match="python plugin runs single-pod actions"):
        compile_spec({"id": "t/p/d/r/a", "task": "t", "pods": pods,
                      "execute": {"plugin": "python", "function": "os:getpid"}},
                     RES, QUEUES, "default")
