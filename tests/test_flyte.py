"""Flyte 2 declarations accepted as written: real tasks built with the installed SDK,
serialised offline, wrapped in the flyteidl2 enqueue messages a client sends, enqueued into an
in-process engine; the demand, gang, environment, queue, retries and timeouts it derived are
read back through the public API. Bad input is refused, naming the field.

The flyte extra is part of ``make test`` (setup.py ``flyte``): these tests do not skip."""

import json
import pathlib
from datetime import timedelta

import flyte
import flyte.clustered
import flyte.extras
import pytest
from flyte.models import SerializationContext
from flyteidl2.actions import actions_service_pb2
from flyteidl2.common import identifier_pb2
from flyteidl2.core import tasks_pb2
from flyteidl2.plugins.kubeflow import pytorch_pb2 as kubeflow_pytorch_pb2
from flyteidl2.task import run_pb2, task_definition_pb2
from flyteidl2.workflow import queue_service_pb2, run_definition_pb2
from flyteplugins.dask import Dask, Scheduler, WorkerGroup
from flyteplugins.ray import HeadNodeConfig, RayJobConfig, WorkerNodeConfig
from google.protobuf.json_format import MessageToDict
from kubernetes.client import V1Container, V1PodSpec, V1ResourceRequirements

from engine import Phase, SpecError, WaitCode
from engine.cli import main
from engine.flyte import (
    ACCELERATOR_MODELS,
    decode_request,
    enqueue_flyte,
    flyte_action,
    flyte_fanouts,
    flyte_task_action,
)
from tests.conftest import make_engine

ROOT = pathlib.Path(__file__).resolve().parent.parent
GiB = 1 << 30

CONFIG = {
    "resources": ["cpu", "memory", "ephemeral_storage", "gpu:H100", "gpu:A100",
                  "gpu:A100-1g.5gb"],
    "clusters": {"east": {}},               # unknown capacity: everything fits
    "queues": {"interactive": {"priority": "MAX"}, "gpu": {"priority": 700},
               "batch": {"priority": "MIN"}},
    "engine": {"default_queue": "batch"},
}
NAMES = CONFIG["resources"]

# --------------------------------------------------------------------------- declarations
plain = flyte.TaskEnvironment(
    name="plain", resources=flyte.Resources(cpu=(0.5, 2), memory=("1Gi", "2Gi"), disk="10Gi"))


@plain.task
async def etl(x: int) -> int:
    return x


trainer = flyte.TaskEnvironment(
    name="trainer", resources=flyte.Resources(cpu=8, memory="64Gi", gpu="H100:8"),
    queue="gpu")


@trainer.task
async def train(x: int) -> int:
    return x


@trainer.task(queue="interactive")
async def probe(x: int) -> int:
    return x


@trainer.task(
    retries=flyte.RetryStrategy(count=3, backoff=flyte.Backoff(
        base=timedelta(seconds=5), factor=2.0, cap=timedelta(minutes=1))),
    timeout=flyte.Timeout(max_runtime=timedelta(minutes=30), max_queued_time=60,
                          deadline=timedelta(hours=2)))
async def bounded(x: int) -> int:
    return x


@trainer.task(retries=2)
async def quick_retry(x: int) -> int:
    return x


pool = flyte.TaskEnvironment(
    name="pool", resources=flyte.Resources(cpu=2, memory="4Gi"),
    reusable=flyte.ReusePolicy(replicas=4, idle_ttl=600, concurrency=2))


@pool.task
async def pooled_a(x: int) -> int:
    return x


@pool.task
async def pooled_b(x: int) -> int:
    return x


run_pool = flyte.TaskEnvironment(
    name="run-pool", resources=flyte.Resources(cpu=1, memory="1Gi"),
    reusable=flyte.ReusePolicy(replicas=(1, 3), idle_ttl=120, scope="run"))


@run_pool.task
async def per_run(x: int) -> int:
    return x


ray_env = flyte.TaskEnvironment(
    name="ray", resources=flyte.Resources(cpu=2, memory="8Gi"),
    plugin_config=RayJobConfig(
        head_node_config=HeadNodeConfig(requests=flyte.Resources(cpu="4", memory="16Gi")),
        worker_node_config=[
            WorkerNodeConfig(group_name="gpu", replicas=3,
                             requests=flyte.Resources(cpu="8", memory="64Gi", gpu="H100:8")),
            WorkerNodeConfig(group_name="cpu", replicas=2)]))


@ray_env.task
async def ray_job() -> int:
    return 1


dask_env = flyte.TaskEnvironment(
    name="dask", resources=flyte.Resources(cpu=1, memory="2Gi"),
    plugin_config=Dask(scheduler=Scheduler(resources=flyte.Resources(cpu=2, memory="4Gi")),
                       workers=WorkerGroup(number_of_workers=5, resources=flyte.Resources(
                           cpu=4, memory=("8Gi", "16Gi")))))


@dask_env.task
async def dask_job() -> int:
    return 1


clustered = flyte.clustered.ClusteredTaskEnvironment(
    name="ddp", replicas=4, nproc_per_node=8,
    resources=flyte.Resources(cpu=32, memory="256Gi", gpu="H100:8"))


@clustered.task
async def ddp() -> int:
    return 1


mig = flyte.TaskEnvironment(
    name="mig", resources=flyte.Resources(cpu=1, memory="1Gi",
                                          gpu=flyte.GPU("A100", 2, "1g.5gb")))


@mig.task
async def sliced() -> int:
    return 1


with_sidecar = flyte.TaskEnvironment(
    name="pod", resources=flyte.Resources(cpu=2, memory="4Gi"),
    pod_template=flyte.PodTemplate(primary_container_name="primary", pod_spec=V1PodSpec(
        containers=[V1Container(name="primary"),
                    V1Container(name="proxy", image="envoy", resources=V1ResourceRequirements(
                        requests={"cpu": "250m", "memory": "256Mi"}))])))


@with_sidecar.task
async def proxied() -> int:
    return 1


everything = flyte.TaskEnvironment(
    name="kitchen-sink", resources=flyte.Resources(cpu=1, memory="1Gi", shm="auto"),
    env_vars={"MODE": "test"}, secrets=["token"], cache="auto", interruptible=True)


@everything.task(report=True)
async def decorated(x: int = 3) -> int:
    return x


# --------------------------------------------------------------------------- helpers
def ctx(org="acme", project="ml", domain="dev"):
    return SerializationContext(version="v1", org=org, project=project, domain=domain,
                                root_dir=ROOT)


def task_spec(task):
    return flyte.extras.serialize(task, ctx())


def request(task, action="a0", run="r1", parent=None, queue=None, run_queue=None,
            max_action_concurrency=None, input_uri="", spec=None):
    """The queue-service EnqueueActionRequest a Flyte client sends for ``task``."""
    spec = spec or task_spec(task)
    tid = spec.task_template.id
    req = queue_service_pb2.EnqueueActionRequest(
        action_id=identifier_pb2.ActionIdentifier(
            run=identifier_pb2.RunIdentifier(org="acme", project="ml", domain="dev", name=run),
            name=action),
        task=run_definition_pb2.TaskAction(
            id=task_definition_pb2.TaskIdentifier(org=tid.org, project=tid.project,
                                                  domain=tid.domain, name=tid.name,
                                                  version=tid.version),
            spec=spec, queue=queue if queue is not None else (task.queue or "")),
        input_uri=input_uri)
    if parent is not None:
        req.parent_action_name = parent
    if run_queue is not None or max_action_concurrency is not None:
        req.run_spec.CopyFrom(run_pb2.RunSpec(
            queue=run_queue or "", max_action_concurrency=max_action_concurrency or 0))
    return req


def engine():
    eng, clock = make_engine(CONFIG)
    return eng, clock


def demand(eng, action):
    insp = eng.inspect()
    return dict(zip(NAMES, insp.arrays.a_demand[insp.find(action)].tolist(), strict=True))


def stored(eng, action):
    insp = eng.inspect()
    return insp.record(insp.find(action)).spec


def vec(eng, table):
    return dict(zip(NAMES, eng.config.resources.vector(table).tolist(), strict=True))


def one(**kw):
    return {n: kw.get(n.replace(":", "_").replace("-", "_").replace(".", "_"), 0)
            for n in NAMES}


# --------------------------------------------------------------------------- accepted
def test_plain_task_requests_are_the_demand_limits_above_them_accepted():
    eng, _ = engine()
    [aid] = enqueue_flyte(eng, request(etl).SerializeToString())
    assert str(aid) == "acme/ml/dev/r1/a0"
    # cpu=(0.5, 2): fractional cpu in millicores; the request (not the limit) is the demand.
    assert demand(eng, aid) == one(cpu=500, memory=GiB, ephemeral_storage=10 * GiB)
    spec = stored(eng, aid)
    assert spec.task == "plain.etl" and spec.environment == "plain" and spec.reuse is None
    assert spec.image.startswith("ghcr.io/flyteorg/flyte:")
    [a] = eng.tick()
    assert a.queue == "batch"           # no queue anywhere: the engine's default


def test_gpu_task_names_the_configured_device_and_its_queue():
    eng, _ = engine()
    [aid] = enqueue_flyte(eng, request(train))
    assert demand(eng, aid) == one(cpu=8000, memory=64 * GiB, gpu_H100=8)
    [a] = eng.tick()
    assert a.queue == "gpu"             # the environment's queue, carried on the TaskAction


def test_a_task_overriding_its_environments_queue_goes_to_its_own():
    eng, _ = engine()
    enqueue_flyte(eng, [request(probe, "a0", run="r1", run_queue="batch"),
                        request(train, "a0", run="r2", run_queue="interactive")])
    by_action = {str(a.action): a.queue for a in eng.tick()}
    # The action's queue wins over the run's; the environment's queue is the task's default.
    assert probe.queue == "interactive"
    assert by_action == {"acme/ml/dev/r1/a0": "interactive", "acme/ml/dev/r2/a0": "gpu"}


def test_the_runs_queue_applies_when_the_action_has_none_and_children_inherit_it():
    eng, _ = engine()
    enqueue_flyte(eng, request(etl, "a0", run_queue="interactive", max_action_concurrency=4))
    # A child is sent without a RunSpec (the SDK sends it with the run's first action only).
    enqueue_flyte(eng, request(etl, "c1", parent="a0"))
    child = stored(eng, "acme/ml/dev/r1/c1")
    assert child.parent == "acme/ml/dev/r1/a0" and child.run_queue == "interactive"
    assert stored(eng, "acme/ml/dev/r1/a0").run_max_action_concurrency == 4
    assert {a.queue for a in eng.tick()} == {"interactive"}


def test_run_max_action_concurrency_caps_the_run():
    eng, _ = engine()
    enqueue_flyte(eng, [request(etl, f"a{i}", max_action_concurrency=2) for i in range(3)])
    assert len(eng.tick()) == 2
    assert eng.explain("acme/ml/dev/r1/a2").wait == WaitCode.RUN_ACTIONS
    with pytest.raises(SpecError, match=r"run_spec.max_action_concurrency: 1 is refused"):
        flyte_action(request(etl, max_action_concurrency=1))


def test_retries_backoff_and_the_three_timeouts():
    eng, clock = engine()
    t0 = clock.now_ns()
    [aid] = enqueue_flyte(eng, request(bounded))
    spec = stored(eng, aid)
    assert (spec.retries.count, spec.retries.backoff_base, spec.retries.backoff_factor,
            spec.retries.backoff_cap) == (3, 5.0, 2.0, 60.0)
    assert (spec.timeouts.max_runtime, spec.timeouts.max_queued_time,
            spec.timeouts.deadline) == (1800.0, 60.0, 7200.0)
    [a] = eng.tick()
    assert a.max_runtime_s == 1800.0
    assert a.deadline_ns == t0 + 7200 * 10**9 and a.queued_deadline_ns == t0 + 60 * 10**9


def test_retries_without_a_backoff_fire_back_to_back():
    eng, clock = engine()
    [aid] = enqueue_flyte(eng, request(quick_retry))
    spec = stored(eng, aid)
    assert (spec.retries.count, spec.retries.backoff_base, spec.retries.backoff_cap) == (
        2, 0.0, 0.0)
    [a] = eng.tick()
    eng.report(a.token, Phase.FAILED, error_kind="USER", message="boom")
    [again] = eng.tick()               # no clock advance: the retry is due at once
    assert again.attempt == 2 and str(again.action) == str(aid)


def test_reusable_environment_identity_and_footprint():
    eng, _ = engine()
    enqueue_flyte(eng, [request(pooled_a, "a0"), request(pooled_b, "a1"),
                        request(pooled_a, "a0", run="r2")])
    insp = eng.inspect()
    env = insp.arrays.a_env
    rows = [insp.find(f"acme/ml/dev/{r}") for r in ("r1/a0", "r1/a1", "r2/a0")]
    # One pool for the environment (GLOBAL scope): its tasks and runs share it.
    assert env[rows[0]] >= 0 and env[rows[0]] == env[rows[1]] == env[rows[2]]
    assert insp.env_rows == 1
    # The footprint is replicas x the pod, counted once; slots are replicas x concurrency.
    assert demand(eng, "acme/ml/dev/r1/a0") == one(cpu=4 * 2000, memory=4 * 4 * GiB)
    assert insp.arrays.e_slots[env[rows[0]]] == 8
    spec = stored(eng, "acme/ml/dev/r1/a0")
    assert (spec.reuse.replicas, spec.reuse.concurrency, spec.reuse.idle_ttl) == (4, 2, 600.0)


def test_a_run_scoped_pool_is_one_pool_per_run_and_reserves_max_replicas():
    eng, _ = engine()
    enqueue_flyte(eng, [request(per_run, "a0", run="r1"), request(per_run, "a0", run="r2")])
    insp = eng.inspect()
    rows = [insp.find(f"acme/ml/dev/{r}/a0") for r in ("r1", "r2")]
    assert insp.arrays.a_env[rows[0]] != insp.arrays.a_env[rows[1]]
    assert stored(eng, "acme/ml/dev/r1/a0").environment == "run-pool@acme/ml/dev/r1"
    # replicas=(1, 3): the pool may grow to 3, so 3 pods are reserved.
    assert demand(eng, "acme/ml/dev/r1/a0") == one(cpu=3000, memory=3 * GiB)


def test_ray_gang_head_and_worker_groups():
    eng, _ = engine()
    [aid] = enqueue_flyte(eng, request(ray_job))
    pods = stored(eng, aid).pods
    assert [(g.role, g.replicas) for g in pods] == [("head", 1), ("gpu", 3), ("cpu", 2)]
    head, gpu, cpu = (vec(eng, g.resources) for g in pods)
    assert head == one(cpu=4000, memory=16 * GiB)
    assert gpu == one(cpu=8000, memory=64 * GiB, gpu_H100=8)
    assert cpu == one(cpu=2000, memory=8 * GiB)    # a group without requests: the task's
    assert sum(g.replicas for g in pods) == 6
    assert demand(eng, aid) == one(cpu=4000 + 24000 + 4000, memory=(16 + 192 + 16) * GiB,
                                   gpu_H100=24)


def test_dask_gang_runner_scheduler_and_workers():
    eng, _ = engine()
    [aid] = enqueue_flyte(eng, request(dask_job))
    pods = stored(eng, aid).pods
    assert [(g.role, g.replicas) for g in pods] == [("runner", 1), ("scheduler", 1),
                                                   ("worker", 5)]
    assert [vec(eng, g.resources) for g in pods] == [
        one(cpu=1000, memory=2 * GiB), one(cpu=2000, memory=4 * GiB),
        one(cpu=4000, memory=8 * GiB)]
    assert demand(eng, aid) == one(cpu=23000, memory=46 * GiB)


def test_clustered_training_is_a_gang_of_identical_pods():
    eng, _ = engine()
    [aid] = enqueue_flyte(eng, request(ddp))
    [group] = stored(eng, aid).pods
    assert (group.role, group.replicas) == ("worker", 4)
    assert vec(eng, group.resources) == one(cpu=32000, memory=256 * GiB, gpu_H100=8)
    assert demand(eng, aid)["gpu:H100"] == 32


def test_pytorch_elastic_workers_as_the_plugin_writes_them():
    # flyteplugins-pytorch needs torch; its custom_config is the kubeflow message below
    # (MessageToDict of DistributedPyTorchTrainingTask, type "pytorch", version 1).
    spec = task_spec(train)
    tt = spec.task_template
    tt.type, tt.task_type_version = "pytorch", 1
    tt.custom.update(MessageToDict(kubeflow_pytorch_pb2.DistributedPyTorchTrainingTask(
        worker_replicas=kubeflow_pytorch_pb2.DistributedPyTorchTrainingReplicaSpec(replicas=4),
        elastic_config=kubeflow_pytorch_pb2.ElasticConfig(
            rdzv_backend="c10d", min_replicas=2, max_replicas=4, nproc_per_node=8))))
    eng, _ = engine()
    [aid] = enqueue_flyte(eng, request(train, spec=spec))
    [group] = stored(eng, aid).pods
    assert (group.role, group.replicas) == ("worker", 4)
    assert demand(eng, aid)["gpu:H100"] == 32


def test_mig_partitions_count_as_their_configured_slice_else_refused():
    eng, _ = engine()
    [aid] = enqueue_flyte(eng, request(sliced))
    assert demand(eng, aid) == one(cpu=1000, memory=GiB, gpu_A100_1g_5gb=2)
    whole, _ = make_engine(dict(CONFIG, resources=["cpu", "memory", "gpu:A100"]))
    with pytest.raises(SpecError) as err:
        enqueue_flyte(whole, request(sliced))
    assert ("task.spec.task_template.extended_resources.gpu_accelerator.partition_size: "
            "A100 partition '1g.5gb': the engine counts whole devices") in str(err.value)
    assert whole.inspect().action_rows == 0


def test_limits_without_requests_request_the_limits_and_a_limit_below_is_refused():
    spec = task_spec(etl)
    res = spec.task_template.container.resources
    del res.requests[:]                  # limits cpu 2, memory 2Gi only
    eng, _ = engine()
    [aid] = enqueue_flyte(eng, request(etl, spec=spec))
    assert demand(eng, aid) == one(cpu=2000, memory=2 * GiB)
    spec = task_spec(etl)
    spec.task_template.container.resources.limits[0].value = "100m"
    with pytest.raises(SpecError, match=r"container.resources: cpu limit 100m is below its "
                                        r"request 500m"):
        flyte_action(request(etl, spec=spec))


def test_a_pod_templates_containers_add_up_as_kubernetes_reserves_them():
    eng, _ = engine()
    [aid] = enqueue_flyte(eng, request(proxied))
    # The task's resources go to the primary container; the sidecar's requests add to them.
    assert demand(eng, aid) == one(cpu=2250, memory=4 * GiB + 256 * (1 << 20))


def test_values_this_flyteidl2_does_not_know_are_refused_naming_the_field():
    # Each was a raw ValueError / TypeError (INTERNAL from flyte-decode), or, for the
    # scope, taken for GLOBAL: one pool shared by every run.
    spec = task_spec(etl)
    spec.task_template.container.resources.requests.add(name=99, value="1")
    with pytest.raises(SpecError, match=r"container.resources.requests\[\d\]: resource name "
                                        r"99 is not supported"):
        flyte_action(request(etl, spec=spec))
    spec = task_spec(proxied)
    spec.task_template.k8s_pod.pod_spec["initContainers"] = 5
    with pytest.raises(SpecError, match=r"pod_spec.initContainers: 5.0 is not a list"):
        flyte_action(request(proxied, spec=spec))
    spec = task_spec(proxied)
    spec.task_template.k8s_pod.primary_container_name = "main"
    spec.task_template.config["primary_container_name"] = "main"
    with pytest.raises(SpecError, match=r"config.primary_container_name: no container of "
                                        r"the pod spec is named 'main'"):
        flyte_action(request(proxied, spec=spec))
    spec = task_spec(etl)
    spec.task_template.metadata.timeout.nanos = 2_000_000_000
    with pytest.raises(SpecError, match=r"metadata.timeout.nanos: 2000000000 is over"):
        flyte_action(request(etl, spec=spec))
    spec = task_spec(per_run)
    spec.task_template.reuse_policy.scope = 7
    with pytest.raises(SpecError, match=r"reuse_policy.scope: 7 is not a scope"):
        flyte_action(request(per_run, spec=spec))


def test_sdk_features_that_are_not_scheduling_inputs_are_accepted_unchanged():
    eng, _ = engine()
    [aid] = enqueue_flyte(eng, request(decorated))
    assert demand(eng, aid) == one(cpu=1000, memory=GiB)


def test_actions_service_enqueue_request_is_accepted_the_same_way():
    q = request(bounded, "a0", run_queue="interactive", input_uri="s3://in/a0")
    a = actions_service_pb2.EnqueueRequest(
        action=actions_service_pb2.Action(
            action_id=q.action_id, task=q.task, input_uri=q.input_uri, group="g"),
        run_spec=q.run_spec)
    from_queue = flyte_action(q.SerializeToString())
    from_actions = flyte_action(a.SerializeToString(), kind="actions")
    assert from_actions == from_queue
    # Without a kind, as the protocol has it: tried as the queue service's, then this one
    # (it was read as an EnqueueActionRequest carrying no task, and refused).
    assert flyte_action(a.SerializeToString()) == from_queue
    assert type(decode_request(a.SerializeToString())) is type(a)
    assert flyte_fanouts([a.SerializeToString(), q.SerializeToString()])[0].names == ["a0",
                                                                                       "a0"]
    assert from_queue.input_uri == "s3://in/a0"
    assert decode_request(a) is a


def test_fan_out_of_serialised_requests_carries_each_actions_inputs():
    eng, _ = engine()
    blobs = [request(train, f"m{i}", parent=None, input_uri=f"s3://in/{i}").SerializeToString()
             for i in range(50)]
    fanouts = flyte_fanouts(blobs, resources=eng.config.resources)
    assert len(fanouts) == 1 and fanouts[0].names == [f"m{i}" for i in range(50)]
    ids = enqueue_flyte(eng, blobs)
    assert [str(i) for i in ids] == [f"acme/ml/dev/r1/m{i}" for i in range(50)]
    refs = {str(a.action): a.input_ref for a in eng.tick()}
    assert refs["acme/ml/dev/r1/m7"] == "s3://in/7" and len(refs) == 50


def test_a_task_object_directly_through_the_sdks_serialisation():
    eng, _ = engine()
    fa = flyte_task_action(train, "acme/ml/dev/r9/a0", input_uri="s3://x",
                           resources=eng.config.resources, serialization_context=ctx())
    assert fa.spec.task_queue == "gpu" and fa.input_uri == "s3://x"
    eng.enqueue(fa.spec)
    assert demand(eng, "acme/ml/dev/r9/a0") == one(cpu=8000, memory=64 * GiB, gpu_H100=8)


def test_accelerator_names_are_the_sdks_own_mapping_reversed():
    from flyte._internal.runtime.resources_serde import (
        ACCELERATOR_DEVICE_MAP,
        DEPRECATED_ACCELERATOR_NOTATIONS,
    )
    sdk = {wire: name for name, wire in ACCELERATOR_DEVICE_MAP.items()
           if name not in DEPRECATED_ACCELERATOR_NOTATIONS}
    assert ACCELERATOR_MODELS == sdk


# --------------------------------------------------------------------------- refused
def test_unknown_wire_field_is_refused_naming_it():
    raw = request(etl).SerializeToString() + bytes([0xF8, 0x06, 0x01])   # field 111
    with pytest.raises(SpecError, match=r"field number 111 is not a field of "
                                        r"flyteidl2.workflow.EnqueueActionRequest"):
        flyte_action(raw)


def test_known_fields_the_engine_cannot_honour_are_refused_naming_them():
    spec = task_spec(etl)
    spec.task_template.metadata.pod_template_name = "gpu-template"
    with pytest.raises(SpecError, match=r"^task.spec.task_template.metadata."
                                        r"pod_template_name: a named pod template"):
        flyte_action(request(etl, spec=spec))
    req = request(etl, run_queue="batch")
    req.run_spec.cluster_pool = "pool-a"
    with pytest.raises(SpecError, match=r"^run_spec.cluster_pool: the engine routes by queue"):
        flyte_action(req)
    spec = task_spec(etl)
    spec.task_template.container.resources.requests.add(
        name=tasks_pb2.Resources.STORAGE, value="1Gi")
    with pytest.raises(SpecError, match=r"requests\[3\]: resource STORAGE is not supported"):
        flyte_action(request(etl, spec=spec))


def test_unsupported_plugin_is_refused_by_name():
    spec = task_spec(etl)
    spec.task_template.type = "spark"
    spec.task_template.custom.update({"sparkConf": {"spark.executor.instances": "4"}})
    eng, _ = engine()
    with pytest.raises(SpecError, match=r"task_template.type: unsupported plugin 'spark'"):
        enqueue_flyte(eng, request(etl, spec=spec))
    assert eng.inspect().action_rows == 0


def test_unknown_key_in_a_plugin_spec_is_refused():
    spec = task_spec(ray_job)
    spec.task_template.custom["rayCluster"]["surprise"] = 1
    with pytest.raises(SpecError, match=r"task_template.custom: not a flyteidl2.plugins."
                                        r"RayJob: .*surprise"):
        flyte_action(request(ray_job, spec=spec))


def test_unparseable_bytes_and_other_messages_are_refused():
    with pytest.raises(SpecError, match=r"not a serialised flyteidl2.workflow."
                                        r"EnqueueActionRequest \(3 bytes"):
        flyte_action(b"\xff\xff\xff")
    with pytest.raises(SpecError, match=r"not \w*TaskSpec|flyteidl2.task.TaskSpec"):
        flyte_action(task_spec(etl))
    with pytest.raises(SpecError, match=r"^requests\[1\]: not a serialised"):
        flyte_fanouts([request(etl).SerializeToString(), b"\x0a\xff"])


def test_trace_actions_are_not_scheduled():
    req = queue_service_pb2.EnqueueActionRequest(
        action_id=identifier_pb2.ActionIdentifier(
            run=identifier_pb2.RunIdentifier(org="acme", project="ml", domain="dev",
                                             name="r1"), name="t1"),
        trace=run_definition_pb2.TraceAction(name="step"))
    with pytest.raises(SpecError, match=r"^trace: a trace action records work"):
        flyte_action(req)


def test_device_not_configured_names_the_accelerator_field():
    eng, _ = make_engine(dict(CONFIG, resources=["cpu", "memory", "gpu:A100"]))
    with pytest.raises(SpecError, match=r"extended_resources.gpu_accelerator.device: H100 "
                                        r"\(wire name 'nvidia-tesla-h100'\) is not a "
                                        r"configured resource 'gpu:H100'"):
        enqueue_flyte(eng, request(train))
    # Named with no count of it: nothing to charge, but still a device this engine does not
    # know (it was accepted as a CPU-only task).
    spec = task_spec(train)
    for side in (spec.task_template.container.resources.requests,
                 spec.task_template.container.resources.limits):
        for entry in [e for e in side if e.name == tasks_pb2.Resources.GPU]:
            side.remove(entry)
    with pytest.raises(SpecError, match=r"extended_resources.gpu_accelerator.device: H100 "
                                        r"\(wire name 'nvidia-tesla-h100'\) is not a "
                                        r"configured resource 'gpu:H100'"):
        enqueue_flyte(eng, request(train, spec=spec))
    eng, _ = engine()           # H100 configured: a task that asks for none of it is fine
    [aid] = enqueue_flyte(eng, request(train, spec=spec))
    assert demand(eng, aid)["gpu:H100"] == 0


# --------------------------------------------------------------------------- the CLI
def test_cli_flyte_decode_prints_the_derived_action(tmp_path, capsys):
    path = tmp_path / "req.bin"
    path.write_bytes(request(ray_job, input_uri="s3://in").SerializeToString())
    assert main(["flyte-decode", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["id"] == "acme/ml/dev/r1/a0" and out["queue"] == "batch"
    assert [(p["role"], p["replicas"]) for p in out["pods"]] == [("head", 1), ("gpu", 3),
                                                               ("cpu", 2)]
    assert out["demand"] == "cpu=32, memory=224Gi, gpu:H100=24"
    assert out["input_uri"] == "s3://in"


def test_cli_flyte_decode_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "bad.bin"
    path.write_bytes(b"\xff\xff\xff")
    assert main(["flyte-decode", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("leasehold: INVALID_ARGUMENT: ")
    assert main(["flyte-decode", str(tmp_path / "missing.bin")]) == 2
    assert "cannot read" in capsys.readouterr().err


# --------------------------------------------------------------------------- over the wire
@pytest.fixture
def wire_shard(tmp_path):
    from engine import parse_config
    from storage import MemoryStore
    from transport import Client, Shard, generate_keypair, load_client_keys

    keys = tmp_path / "keys"
    for name in ("shard", "acme-app", "globex-app"):
        generate_keypair(keys, name)
    cfg = parse_config(dict(CONFIG, transport={"endpoints": ["tcp://127.0.0.1:0"]},
                            security={"keys_dir": str(keys), "peers": {
                                "acme-app": {"role": "client", "tenants": ["acme"]},
                                "globex-app": {"role": "client", "tenants": ["globex"]}}}))
    shard = Shard(cfg, store=MemoryStore()).start()
    clients = {n: Client(endpoint=shard.endpoint, keys=load_client_keys(keys, n, "shard"),
                         timeout=10.0) for n in ("acme-app", "globex-app")}
    yield clients
    for c in clients.values():
        c.close()
    shard.stop()


def test_the_client_enqueues_flyte_messages_and_a_child_inherits_the_runs_queue(wire_shard):
    c = wire_shard["acme-app"]
    root = request(etl, "a0", run_queue="interactive")
    assert c.enqueue_flyte(root) == ["acme/ml/dev/r1/a0"]
    # Bytes, and a child without a RunSpec: its run's queue comes from the stored parent.
    kids = [request(etl, f"c{i}", parent="a0").SerializeToString() for i in range(3)]
    assert c.enqueue_flyte(kids) == [f"acme/ml/dev/r1/c{i}" for i in range(3)]
    assert "queue interactive" in c.explain("acme/ml/dev/r1/c2")["reason"]
    assert c.status(["acme/ml/dev/r1/c0"]) == [Phase.WAITING_FOR_RESOURCES]   # no worker


def test_flyte_enqueues_are_checked_by_tenant_and_bad_bytes_are_named(wire_shard):
    from transport import ShardError

    other = wire_shard["globex-app"]
    with pytest.raises(ShardError) as info:
        other.enqueue_flyte(request(etl, "a0"))       # an acme action, a globex key
    assert info.value.code == "PERMISSION_DENIED" and "acme/ml/dev/r1/a0" in str(info.value)
    with pytest.raises(ShardError) as info:
        wire_shard["acme-app"].enqueue_flyte(b"\xff not a protobuf")
    assert info.value.code == "INVALID_ARGUMENT"
    with pytest.raises(ShardError):
        wire_shard["acme-app"].status(["acme/ml/dev/r1/a0"])    # nothing was enqueued


def test_a_flyte_name_over_the_wire_limits_is_refused_and_nothing_is_stored(wire_shard):
    # It was stored, and every LEASES message carrying it was dropped by the worker (with
    # the other leases in it); status, explain and abort of it were refused TOO_LARGE.
    from transport import ShardError

    c = wire_shard["acme-app"]
    batch = [request(etl, "ok1"), request(etl, "a" * 1500), request(etl, "ok2")]
    with pytest.raises(ShardError) as info:
        c.enqueue_flyte(batch)
    assert info.value.code == "TOO_LARGE", info.value
    assert ("requests[1]: the action id is 1515 characters, over the limit 1024 "
            "(transport.max_name)") in str(info.value), info.value
    with pytest.raises(ShardError) as info:
        c.enqueue_flyte(request(etl, "ok3", input_uri="s3://b/" + "x" * 70_000))
    assert info.value.code == "TOO_LARGE" and "requests[0]: input_uri is 70007 characters" \
        in str(info.value), info.value
    spec = task_spec(etl)
    spec.environment.name = "e" * 1100
    with pytest.raises(ShardError) as info:
        c.enqueue_flyte(request(etl, "ok4", spec=spec))
    assert info.value.code == "TOO_LARGE" and "requests[0]: its environment is 1100 " \
        "characters" in str(info.value), info.value
    with pytest.raises(ShardError) as info:
        c.status([f"acme/ml/dev/r1/{n}" for n in ("ok1", "ok2", "ok3", "ok4")])
    assert info.value.code == "NOT_FOUND"                   # nothing was enqueued
    assert c.enqueue_flyte(request(etl, "ok1")) == ["acme/ml/dev/r1/ok1"]   # and it serves on


def test_a_flyte_batch_naming_one_action_twice_with_two_specs_stores_nothing(wire_shard):
    from transport import ShardError

    c = wire_shard["acme-app"]
    with pytest.raises(ShardError) as info:
        c.enqueue_flyte([request(etl, "n0"), request(train, "n1"), request(etl, "n1")])
    assert info.value.code == "INVALID_ARGUMENT", info.value
    assert "requests[1] and requests[2] name action acme/ml/dev/r1/n1 with different specs" \
        in str(info.value)
    with pytest.raises(ShardError) as info:
        c.status(["acme/ml/dev/r1/n0"])
    assert info.value.code == "NOT_FOUND"                   # nothing was enqueued
    # The same action twice with one spec is one action (a retried request).
    assert c.enqueue_flyte([request(etl, "n1"), request(train, "n2"), request(etl, "n1")]) \
        == ["acme/ml/dev/r1/n1", "acme/ml/dev/r1/n2", "acme/ml/dev/r1/n1"]


def test_a_flyte_batch_refused_part_way_names_and_watches_what_it_enqueued(wire_shard):
    from transport import ShardError

    c = wire_shard["acme-app"]
    c.subscribe("acme/ml/dev/r1")
    assert c.enqueue_flyte(request(etl, "p0")) == ["acme/ml/dev/r1/p0"]
    assert c.next_event(timeout=10).action == "acme/ml/dev/r1/p0"
    # p1 (etl) is enqueued, then p0 with another task is refused: the error says what was.
    with pytest.raises(ShardError) as info:
        c.enqueue_flyte([request(etl, "p1"), request(train, "p0")])
    assert info.value.code == "ALREADY_EXISTS", info.value
    assert "first 1 action(s) were enqueued (acme/ml/dev/r1/p1 .. acme/ml/dev/r1/p1)" in \
        str(info.value)
    ev = c.next_event(timeout=10)           # its watchers are told, as of any enqueue
    assert (ev.action, ev.phase) == ("acme/ml/dev/r1/p1", "QUEUED"), ev


def test_leasehold_submit_takes_serialised_flyte_files(tmp_path, capsys):
    import socket

    from transport import Shard, generate_keypair

    keys = tmp_path / "keys"
    for name in ("shard", "acme-app"):
        generate_keypair(keys, name)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "leasehold.toml"
    cfg.write_text(f"""resources = {json.dumps(CONFIG["resources"])}
[clusters.east]
[queues.interactive]
priority = "MAX"
[queues.gpu]
priority = 700
[queues.batch]
priority = "MIN"
[engine]
default_queue = "batch"
[storage]
path = "{tmp_path / 'data'}"
partitions = 2
[transport]
endpoints = ["tcp://127.0.0.1:{port}"]
[security]
keys_dir = "{keys}"
[security.peers.acme-app]
role = "client"
tenants = ["acme"]
""")
    files = []
    for name, req in (("root", request(etl, "a0", run_queue="interactive")),
                      ("kid", request(etl, "c1", parent="a0"))):
        files.append(tmp_path / f"{name}.pb")
        files[-1].write_bytes(req.SerializeToString())
    shard = Shard(str(cfg)).start()
    try:
        code = main(["submit", "--config", str(cfg), "--key", "acme-app", "--flyte",
                     str(files[0]), "--flyte", str(files[1])])
        out = capsys.readouterr().out.split()
        assert code == 0 and out == ["acme/ml/dev/r1/a0", "acme/ml/dev/r1/c1"]
        code = main(["submit", "--config", str(cfg), "--key", "acme-app", "--flyte",
                     str(tmp_path / "missing.pb")])
        err = capsys.readouterr().err
        assert code == 2 and "missing.pb: cannot read it" in err and "Traceback" not in err
    finally:
        shard.stop()


def test_a_flyte_file_or_action_given_twice_is_refused_naming_the_files(tmp_path, capsys):
    # Both said "names[1]: 'a0' appears twice" (consecutive requests of one task are one
    # fan-out): neither the file nor the action was named. Refused before anything is sent
    # (no shard listens here).
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'resources = ["cpu", "memory", "ephemeral_storage"]\n[clusters.east]\n'
                   f'[transport]\nendpoints = ["ipc://{tmp_path}/s0"]\n'
                   f"[security]\ninsecure = true\n")
    files = {}
    for name, action in (("a.pb", "a0"), ("b.pb", "a1"), ("again.pb", "a0")):
        files[name] = tmp_path / name
        files[name].write_bytes(request(etl, action).SerializeToString())
    a, b, again = (str(files[n]) for n in ("a.pb", "b.pb", "again.pb"))
    other = f"{tmp_path}/./a.pb"
    for flytes, message in (
            ([a, b, a], f"--flyte {a} is given twice: give each file once"),
            ([a, other], f"--flyte {other} is the file --flyte {a} given again: give each "
                         f"file once"),
            ([a, b, again], f"action acme/ml/dev/r1/a0 appears twice: in --flyte {a} and in "
                            f"--flyte {again}; give each action once")):
        args = ["submit", "--config", str(cfg), "--request-timeout", "1"]
        for f in flytes:
            args += ["--flyte", f]
        assert main(args) == 2
        assert capsys.readouterr().err == f"leasehold: INVALID_ARGUMENT: {message}\n"
    # The engine's own words, for a client sending them together.
    eng, _ = engine()
    with pytest.raises(SpecError, match=r"^requests\[0\] and requests\[2\] both name action "
                                        r"acme/ml/dev/r1/a0; send each action once$"):
        enqueue_flyte(eng, [files[n].read_bytes() for n in ("a.pb", "b.pb", "again.pb")])


def test_flyte_enqueues_are_routed_to_the_tenants_shard_and_refused_by_the_other(tmp_path):
    from engine import parse_config
    from storage import MemoryStore
    from tests.conftest import free_port
    from transport import Client, CrossShardBatch, Shard, ShardError, tenant_shard

    assert tenant_shard("acme", 2) == 1 and tenant_shard("globex", 2) == 0
    eps = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    cfg = parse_config(dict(CONFIG, transport={"endpoints": eps}, status={"metrics": False},
                            storage={"path": str(tmp_path / "data")},
                            security={"insecure": True}))
    shards = [Shard(cfg, i, store=MemoryStore()).start() for i in (0, 1)]
    clients = [Client(cfg, timeout=10.0), Client(cfg, shard=0, timeout=10.0),
               Client(cfg, shard=1, timeout=10.0)]
    routed, on0, on1 = clients
    try:
        acme = request(etl, "a0")
        globex = request(etl, "g0")
        globex.action_id.run.org = "globex"
        # Pinned to the wrong shard: refused once decoded, nothing enqueued anywhere.
        with pytest.raises(ShardError) as info:
            on0.enqueue_flyte(acme)
        assert info.value.code == "WRONG_SHARD" and "tenant 'acme'" in str(info.value)
        with pytest.raises(ShardError) as info:
            on1.status(["acme/ml/dev/r1/a0"])
        assert info.value.code == "NOT_FOUND"
        # Routed: each to its owner.
        assert routed.enqueue_flyte(acme) == ["acme/ml/dev/r1/a0"]
        assert routed.enqueue_flyte(globex.SerializeToString()) == ["globex/ml/dev/r1/g0"]
        assert on1.status("acme/ml/dev/r1/a0") == Phase.WAITING_FOR_RESOURCES
        assert on0.status("globex/ml/dev/r1/g0") == Phase.WAITING_FOR_RESOURCES
        # Both tenants in one call: refused before anything is sent.
        more = request(etl, "a1")
        with pytest.raises(CrossShardBatch):
            routed.enqueue_flyte([more, globex])
        with pytest.raises(ShardError) as info:
            on1.status(["acme/ml/dev/r1/a1"])
        assert info.value.code == "NOT_FOUND"
    finally:
        for c in clients:
            c.close()
        for s in shards:
            s.stop()
