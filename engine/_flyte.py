"""Flyte 2 declarations as actions: flyteidl2 enqueue messages to :class:`ActionSpec`.

A Flyte 2 client enqueues an action with the queue service's ``EnqueueActionRequest`` or the
actions service's ``EnqueueRequest``; both carry the action's identifiers, its ``TaskAction``
(the task's ``TaskSpec`` as the SDK serialised it, plus the queue) and, for a run's first
action, the ``RunSpec``. This module turns those messages (objects or their bytes) into the
engine's action specs, and says at once what it cannot honour.

Every field a message sets is looked up in a table (``_FIELDS``): a field is either *used*
(it becomes part of the spec: identifiers, requests and limits, the accelerator, the reuse
policy, retries, the three timeouts, the queues, the run's max action concurrency, the gang
shape of a plugin) or *accepted* (it matters to the worker or the UI, not to the decision:
the command line, environment variables, the interface, cache and notification settings...).
A field in neither set, a field this flyteidl2 does not know (an unknown wire field), a
plugin whose gang shape the engine cannot derive, or a value the engine cannot honour raises
``SpecError`` naming the field: nothing is defaulted in silence. docs/flyte.md is the full
mapping.

Decoding is on the enqueue path, so the part of a request that a fan-out shares (its
``TaskAction`` and ``RunSpec``) is derived once per distinct serialised form and cached.
"""

import math
import re
import threading
from dataclasses import dataclass, replace

from flyteidl2.actions import actions_service_pb2
from flyteidl2.core import tasks_pb2
from flyteidl2.plugins import clustered_pb2, dask_pb2, ray_pb2
from flyteidl2.plugins.kubeflow import pytorch_pb2 as kubeflow_pytorch_pb2
from flyteidl2.task import run_pb2
from flyteidl2.workflow import queue_service_pb2
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from engine._errors import LeaseholdError, SpecError
from engine._model import ActionSpec, PodGroup, RetryPolicy, ReusePolicy, Timeouts
from engine._units import BYTES, CPU, format_quantity, parse_quantity

__all__ = [
    "FlyteAction",
    "FlyteFanOut",
    "ACCELERATOR_MODELS",
    "decode_request",
    "flyte_action",
    "flyte_fanouts",
    "flyte_task_action",
    "enqueue_flyte",
    "enqueue_fanouts",
]

EnqueueActionRequest = queue_service_pb2.EnqueueActionRequest
EnqueueRequest = actions_service_pb2.EnqueueRequest

# --------------------------------------------------------------------------- the field table
# Per message: the fields this module reads (USED) and those it accepts without reading
# (not scheduling inputs). Any other set field is refused, naming its path.
_ACCEPT = {
    # Identity and data references for the worker: the engine decides where and when.
    # trace and condition are read (and refused) through the request's ``spec`` oneof.
    "flyteidl2.workflow.EnqueueActionRequest": (
        {"action_id", "parent_action_name", "run_spec", "task", "input_uri", "trace",
         "condition"},
        {"run_output_base", "group", "subject"}),
    "flyteidl2.actions.Action": (
        {"action_id", "parent_action_name", "task", "input_uri", "trace", "condition"},
        {"run_output_base", "group", "subject", "recovered_from"}),
    "flyteidl2.actions.EnqueueRequest": ({"action", "run_spec"}, set()),
    "flyteidl2.common.ActionIdentifier": ({"run", "name"}, set()),
    "flyteidl2.common.RunIdentifier": ({"org", "project", "domain", "name"}, set()),
    # The cache key decides whether the worker runs the code, not where the pod may go.
    "flyteidl2.workflow.TaskAction": ({"id", "spec", "queue"}, {"cache_key"}),
    "flyteidl2.task.TaskIdentifier": ({"name"}, {"org", "project", "domain", "version"}),
    "flyteidl2.task.TaskSpec": (
        {"task_template", "environment"}, {"default_inputs", "short_name", "documentation"}),
    "flyteidl2.task.Environment": ({"name"}, {"description"}),
    "flyteidl2.core.TaskTemplate": (
        {"id", "type", "metadata", "custom", "container", "k8s_pod", "extended_resources",
         "config", "reuse_policy", "task_type_version"},
        {"interface", "security_context"}),
    "flyteidl2.core.Identifier": ({"name"}, {"resource_type", "project", "domain", "org",
                                             "version"}),
    "flyteidl2.core.TaskMetadata": (
        {"retries", "timeout", "timeouts"},
        # Cache and display settings, and interruptible: the cluster's own scheduler puts an
        # interruptible pod on spot nodes; admission counts the same requests either way.
        {"discoverable", "runtime", "discovery_version", "deprecated_error_message",
         "interruptible", "cache_serializable", "tags", "cache_ignore_input_vars", "is_eager",
         "generates_deck", "metadata", "debuggable", "log_links", "image_build_run",
         "is_entrypoint", "code_bundle_uri", "produces_artifacts", "cache_max_age"}),
    "flyteidl2.core.RetryStrategy": ({"retries", "backoff"}, set()),
    "flyteidl2.core.Backoff": ({"base", "factor", "cap"}, set()),
    "flyteidl2.core.TimeoutStrategy": ({"queued_timeout", "deadline"}, set()),
    "flyteidl2.core.Container": (
        {"image", "resources"},
        {"command", "args", "env", "config", "ports", "data_config"}),
    "flyteidl2.core.Resources": ({"requests", "limits"}, set()),
    "flyteidl2.core.K8sPod": ({"pod_spec", "primary_container_name"},
                              {"metadata", "data_config"}),
    "flyteidl2.core.ExtendedResources": ({"gpu_accelerator"}, {"shared_memory"}),
    "flyteidl2.core.GPUAccelerator": ({"device", "partition_size", "device_class",
                                       "unpartitioned"}, set()),
    "flyteidl2.core.ReusePolicy": (
        {"min_replicas", "max_replicas", "concurrency", "idle_ttl", "scope"},
        # The engine holds max_replicas for the pool's whole life, so when extra replicas
        # scale down does not change what it reserves.
        {"scaledown_ttl"}),
    "flyteidl2.task.RunSpec": (
        {"queue", "max_action_concurrency"},
        {"labels", "annotations", "envs", "interruptible", "overwrite_cache",
         "raw_data_storage", "security_context", "cache_config", "notification_rule_name",
         "notification_rules", "run_start_time", "run_base_dir", "related_to",
         "task_spec_source", "relation", "recover"}),
    # Plugins (the task template's ``custom``).
    "flyteidl2.plugins.RayJob": (
        {"ray_cluster"},
        {"runtime_env", "shutdown_after_job_finishes", "ttl_seconds_after_finished",
         "runtime_env_yaml"}),
    "flyteidl2.plugins.RayCluster": (
        {"head_group_spec", "worker_group_spec", "enable_autoscaling", "autoscaler_options"},
        set()),
    "flyteidl2.plugins.HeadGroupSpec": ({"k8s_pod", "extended_resources"},
                                        {"ray_start_params"}),
    "flyteidl2.plugins.WorkerGroupSpec": (
        {"group_name", "replicas", "min_replicas", "max_replicas", "k8s_pod",
         "extended_resources"}, {"ray_start_params"}),
    "flyteidl2.plugins.AutoscalerOptions": (
        {"resources"}, {"upscaling_mode", "idle_timeout_seconds", "env", "image"}),
    "flyteidl2.plugins.DaskJob": ({"scheduler", "workers"}, set()),
    "flyteidl2.plugins.DaskScheduler": ({"resources"}, {"image"}),
    "flyteidl2.plugins.DaskWorkerGroup": ({"number_of_workers", "resources"}, {"image"}),
    "flyteidl2.plugins.ClusteredTaskSpec": (
        {"replicas"},
        {"nproc_per_node", "runtime", "interconnect", "failure_policy",
         "ttl_seconds_after_finished"}),
    "flyteidl2.plugins.kubeflow.DistributedPyTorchTrainingTask": (
        {"worker_replicas", "master_replicas", "elastic_config"}, {"run_policy"}),
    "flyteidl2.plugins.kubeflow.DistributedPyTorchTrainingReplicaSpec": (
        {"replicas", "resources", "common"}, {"image", "restart_policy"}),
    "flyteidl2.plugins.CommonReplicaSpec": ({"replicas", "resources"},
                                            {"image", "restart_policy"}),
    "flyteidl2.plugins.kubeflow.ElasticConfig": (
        {"min_replicas", "max_replicas"},
        {"rdzv_backend", "nproc_per_node", "max_restarts"}),
}

_DESCRIPTORS = {m.DESCRIPTOR.full_name: m.DESCRIPTOR for m in (
    EnqueueActionRequest, EnqueueRequest, actions_service_pb2.Action)}
_DESCRIPTORS.update({f.message_type.full_name: f.message_type
                     for f in actions_service_pb2.Action.DESCRIPTOR.fields
                     if f.message_type is not None})
_DESCRIPTORS.update({f.message_type.full_name: f.message_type
                     for f in _DESCRIPTORS["flyteidl2.common.ActionIdentifier"].fields
                     if f.message_type is not None})

# Why some known fields are refused (the engine cannot honour them); the rest of the refusals
# say "not supported".
_REFUSED = {
    "trace": "a trace action records work its parent already did; there is nothing to schedule",
    "condition": "a condition action waits for a signal, not for resources; it is not "
                 "scheduled by the engine",
    "sql": "a SQL task runs in a query engine, not in a pod the engine can admit",
    "pod_template_name": "a named pod template lives on the cluster; the engine cannot see "
                         "the resources it adds",
    "cluster_pool": "the engine routes by queue (a queue's clusters), not by cluster pool",
    "default_settings": "platform resource defaults are not applied by the engine; declare "
                        "the task's requests",
    "architecture": "node shapes have no CPU architecture, so the engine cannot keep the pod "
                    "off nodes of another one",
    "worker_kind": "the engine admits pods; it has no sandbox worker kind",
    "accelerator_model": "the SDK names the accelerator in `device`; set that instead",
}


# Messages whose every field is in their table need no field walk (the per-request ones).
_TOTAL = {name for name, (used, accepted) in _ACCEPT.items() if name in _DESCRIPTORS
          and {f.name for f in _DESCRIPTORS[name].fields} <= used | accepted}


def _check(msg, path):
    """Refuse a set field of ``msg`` outside its table, or a field this flyteidl2 does not
    know (an unknown wire field)."""
    desc = msg.DESCRIPTOR
    name = desc.full_name
    if name not in _TOTAL:
        used, accepted = _ACCEPT[name]
        for fd, _value in msg.ListFields():
            if fd.name not in used and fd.name not in accepted:
                why = _REFUSED.get(fd.name, "not supported by the engine")
                raise SpecError(f"{path}{fd.name}: {why}")
    unknown = UnknownFieldSet(msg)
    if len(unknown):
        raise SpecError(f"{path.rstrip('.') or 'the request'}: field number "
                        f"{unknown[0].field_number} is not a field of {name} in this "
                        f"flyteidl2 (a newer client?); refused rather than ignored")


# --------------------------------------------------------------------------- quantities
# Flyte resource names (``Resources.ResourceName``) and Kubernetes resource names, as the
# engine's names. GPU counts are a device count; the model comes from ``extended_resources``.
_FLYTE_NAMES = {
    tasks_pb2.Resources.CPU: "cpu",
    tasks_pb2.Resources.MEMORY: "memory",
    tasks_pb2.Resources.EPHEMERAL_STORAGE: "ephemeral_storage",
    tasks_pb2.Resources.GPU: "gpu",
}
_K8S_NAMES = {
    "cpu": "cpu",
    "memory": "memory",
    "ephemeral-storage": "ephemeral_storage",
    "nvidia.com/gpu": "gpu",
    "amd.com/gpu": "gpu",
    "google.com/tpu": "gpu",
    "aws.amazon.com/neuron": "gpu",
    "aws.amazon.com/neuroncore": "gpu",
    "habana.ai/gaudi": "gpu",
}
_MIG = re.compile(r"^nvidia\.com/mig-([0-9A-Za-z.]+)\Z")
_KIND = {"cpu": CPU, "memory": BYTES, "ephemeral_storage": BYTES}

# The SDK's device names on the wire (flyte/_internal/runtime/resources_serde.py,
# ACCELERATOR_DEVICE_MAP) back to the names users write in ``gpu="H100:8"``; a device the SDK
# does not rename (B200, H200, MI300X, Trn1...) keeps its name.
ACCELERATOR_MODELS = {
    "nvidia-tesla-a100": "A100",
    "nvidia-a100-80gb": "A100_80G",
    "nvidia-tesla-h100": "H100",
    "nvidia-a10": "A10",
    "nvidia-a10g": "A10G",
    "nvidia-a100g": "A100G",
    "nvidia-l4": "L4",
    "nvidia-l40s": "L40s",
    "nvidia-l4-vws": "L4_VWS",
    "nvidia-tesla-k80": "K80",
    "nvidia-tesla-m60": "M60",
    "nvidia-tesla-p4": "P4",
    "nvidia-tesla-p100": "P100",
    "nvidia-rtx-pro-4500": "RTX_PRO_4500",
    "nvidia-rtx-pro-6000": "RTX_PRO_6000",
    "nvidia-tesla-t4": "T4",
    "nvidia-tesla-v100": "V100",
    "tpu-v5-lite-podslice": "V5E",
    "tpu-v5p-slice": "V5P",
    "tpu-v6e-slice": "V6E",
}
# Device class -> the engine's resource kind (``kind:model``, e.g. gpu:H100, tpu:V5E).
_DEVICE_KIND = {
    tasks_pb2.GPUAccelerator.NVIDIA_GPU: "gpu",
    tasks_pb2.GPUAccelerator.AMD_GPU: "gpu",
    tasks_pb2.GPUAccelerator.GOOGLE_TPU: "tpu",
    tasks_pb2.GPUAccelerator.AMAZON_NEURON: "neuron",
    tasks_pb2.GPUAccelerator.HABANA_GAUDI: "gaudi",
}


def _amount(name, value, where):
    """One quantity in the engine's unit (millicores, bytes, devices)."""
    try:
        return parse_quantity(name, _KIND.get(name, "count"), value)
    except ValueError as exc:
        raise SpecError(f"{where}: {exc}") from None


def _pod_requests(requests, limits, where):
    """A container's requests as Kubernetes derives them: a name with a limit and no request
    requests its limit; a limit below its request is refused (Kubernetes refuses the pod);
    an accelerator's request and limit must be equal. Returns ``{name: amount}``."""
    out = dict(requests)
    for name, limit in limits.items():
        req = out.get(name)
        if req is None:
            out[name] = limit
        elif name == "gpu" or name.startswith("mig:"):
            if req != limit:
                raise SpecError(f"{where}: {name} request {req} and limit {limit} differ "
                                f"(Kubernetes requires them equal for devices)")
        elif limit < req:
            shown = format_quantity(name, req), format_quantity(name, limit)
            raise SpecError(f"{where}: {name} limit {shown[1]} is below its request "
                            f"{shown[0]}")
    return out


def _flyte_resources(res, where):
    """``tasks_pb2.Resources`` to requests ``{name: amount}`` (see :func:`_pod_requests`)."""
    _check(res, where + ".")
    sides = []
    for side in ("requests", "limits"):
        got = {}
        for i, entry in enumerate(getattr(res, side)):
            name = _FLYTE_NAMES.get(entry.name)
            at = f"{where}.{side}[{i}]"
            if name is None:
                try:
                    label = tasks_pb2.Resources.ResourceName.Name(entry.name)
                except ValueError:      # a value this flyteidl2 does not know
                    label = f"name {entry.name}"
                raise SpecError(f"{at}: resource {label} is not supported (cpu, memory, "
                                f"ephemeral storage and gpu are)")
            if name in got:
                raise SpecError(f"{at}: {name} is given twice")
            got[name] = _amount(name, entry.value, at)
        sides.append(got)
    return _pod_requests(sides[0], sides[1], where)


def _k8s_resources(table, where):
    """One side (``requests`` or ``limits``) of a pod spec container's resources."""
    if not isinstance(table, dict):
        raise SpecError(f"{where}: {table!r} is not a table of resource quantities")
    got = {}
    for key, value in table.items():
        name = _K8S_NAMES.get(key)
        if name is None:
            m = _MIG.match(key)
            if m is None:
                raise SpecError(f"{where}.{key}: resource {key!r} is not supported (cpu, "
                                f"memory, ephemeral-storage and accelerators are)")
            name = "mig:" + m.group(1)
        if name in got:
            raise SpecError(f"{where}.{key}: {name} is given twice")
        got[name] = _amount(name, value, f"{where}.{key}")
    return got


def _pod_spec_requests(pod_spec, where):
    """A Kubernetes pod spec's effective requests: the sum of its containers, or the largest
    init container where that is more (what the Kubernetes scheduler reserves)."""
    for key in ("resources", "overhead"):
        if key in pod_spec:
            raise SpecError(f"{where}.{key}: pod-level {key} is not supported; declare "
                            f"container resources")
    total = {}
    containers = pod_spec.get("containers") or []
    if not isinstance(containers, list) or not containers:
        raise SpecError(f"{where}.containers: a pod needs at least one container")
    for i, c in enumerate(containers):
        total = _add(total, _container_requests(c, f"{where}.containers[{i}]"))
    inits = pod_spec.get("initContainers") or []
    if not isinstance(inits, list):
        raise SpecError(f"{where}.initContainers: {inits!r} is not a list of containers")
    for i, c in enumerate(inits):
        init = _container_requests(c, f"{where}.initContainers[{i}]")
        total = {n: max(total.get(n, 0), init.get(n, 0)) for n in total.keys() | init.keys()}
    return total


def _container_requests(c, where):
    if not isinstance(c, dict):
        raise SpecError(f"{where}: {c!r} is not a container")
    res = c.get("resources") or {}
    if not isinstance(res, dict):
        raise SpecError(f"{where}.resources: {res!r} is not a table")
    extra = set(res) - {"requests", "limits", "claims"}
    if extra or res.get("claims"):
        key = sorted(extra)[0] if extra else "claims"
        raise SpecError(f"{where}.resources.{key}: not supported (requests and limits are)")
    return _pod_requests(_k8s_resources(res.get("requests") or {}, f"{where}.resources.requests"),
                         _k8s_resources(res.get("limits") or {}, f"{where}.resources.limits"),
                         f"{where}.resources")


def _add(a, b):
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out


def _accelerator(ext, where):
    """``(kind, model, partition)`` of an ``ExtendedResources``' accelerator, or None."""
    if ext is None or not ext.HasField("gpu_accelerator"):
        return None
    acc = ext.gpu_accelerator
    at = f"{where}.gpu_accelerator"
    _check(acc, at + ".")
    kind = _DEVICE_KIND.get(acc.device_class)
    if kind is None:
        raise SpecError(f"{at}.device_class: device class {acc.device_class} is not supported "
                        f"(NVIDIA_GPU, AMD_GPU, GOOGLE_TPU, AMAZON_NEURON, HABANA_GAUDI are)")
    if not acc.device:
        raise SpecError(f"{at}.device: the accelerator names no device")
    model = ACCELERATOR_MODELS.get(acc.device, acc.device)
    partition = acc.partition_size if acc.WhichOneof("partition_size_value") else ""
    if partition and acc.unpartitioned:
        raise SpecError(f"{at}: partition_size {partition!r} and unpartitioned both set")
    return kind, model, partition


def _engine_names(requests, acc, resources, where, ext_where):
    """Requests ``{name: amount}`` with the accelerator named as the engine's resource:
    ``kind:MODEL`` for whole devices, ``kind:MODEL-PARTITION`` for partitions (MIG slices,
    TPU slices) where configured. Returns ``{engine name: quantity}``."""
    out = {}
    for name, amount in requests.items():
        if name != "gpu" and not name.startswith("mig:"):
            out[name] = format_quantity(name, amount) if name in _KIND else amount
            continue
        if amount == 0:
            continue
        partition = name[4:] if name.startswith("mig:") else ""
        if acc is None:
            if partition:
                raise SpecError(f"{where}: MIG slice {partition} requested without "
                                f"{ext_where}.gpu_accelerator naming the GPU model")
            out["gpu"] = amount     # the engine's Flyte spelling: the one gpu:* configured
            continue
        kind, model, acc_partition = acc
        if partition and acc_partition and partition != acc_partition:
            raise SpecError(f"{where}: MIG slice {partition} differs from "
                            f"{ext_where}.gpu_accelerator.partition_size {acc_partition!r}")
        partition = partition or acc_partition
        full = f"{kind}:{model}-{partition}" if partition else f"{kind}:{model}"
        if resources is not None and full not in resources.names:
            configured = ", ".join(n for n in resources.names if ":" in n) or "none"
            if partition:
                raise SpecError(
                    f"{ext_where}.gpu_accelerator.partition_size: {model} partition "
                    f"{partition!r}: the engine counts whole devices unless a resource "
                    f"{full!r} is configured for these slices (configured devices: "
                    f"{configured})")
            raise SpecError(f"{ext_where}.gpu_accelerator.device: {model} (wire name "
                            f"{_wire(model)!r}) is not a configured resource {full!r} "
                            f"(configured devices: {configured})")
        if full in out:
            raise SpecError(f"{where}: {full} is given twice")
        out[full] = amount
    if resources is not None and "gpu" in out:
        models = [n for n in resources.names if n.startswith("gpu:")]
        if len(models) != 1:
            raise SpecError(f"{where}: {out['gpu']} GPU(s) requested without "
                            f"{ext_where}.gpu_accelerator.device, and "
                            f"{len(models)} GPU models are configured "
                            f"({', '.join(models) or 'none'}): name the device")
        out[models[0]] = out.pop("gpu")
    if resources is not None:
        for name in out:
            if name not in resources.names:
                raise SpecError(f"{where}: the task requests {name}, which this engine does "
                                f"not track (configured: {', '.join(resources.names)})")
        if acc is not None and not any(n.startswith(acc[0] + ":") for n in out):
            # An accelerator named with no count of it: nothing to charge, but a device this
            # engine does not know is a mistake in the declaration, not a CPU-only task.
            kind, model, _ = acc
            if not any(n.startswith(f"{kind}:{model}") for n in resources.names):
                configured = ", ".join(n for n in resources.names if ":" in n) or "none"
                raise SpecError(f"{ext_where}.gpu_accelerator.device: {model} (wire name "
                                f"{_wire(model)!r}) is not a configured resource "
                                f"{kind + ':' + model!r} (configured devices: {configured})")
    return out


def _wire(model):
    for wire, m in ACCELERATOR_MODELS.items():
        if m == model:
            return wire
    return model


# --------------------------------------------------------------------------- durations
def _duration(d, where, zero_is_none=True):
    if d.seconds < 0 or d.nanos < 0:
        raise SpecError(f"{where}: a duration cannot be negative")
    if d.nanos > 999_999_999:
        # (google.protobuf.Duration: nanos is the fraction of a second; the SDK never
        # writes more, and a value of more is not a duration.)
        raise SpecError(f"{where}.nanos: {d.nanos} is over 999999999 (the seconds' fraction)")
    value = d.seconds + d.nanos / 1e9
    if value == 0 and zero_is_none:
        return None         # Flyte: a zero bound is no bound
    return value


# --------------------------------------------------------------------------- the task part
@dataclass(frozen=True, eq=False)     # cached singletons: compared by identity
class _Task:
    """What a ``TaskAction`` contributes to every action enqueued with it."""

    task: str
    environment: str | None
    image: str | None
    resources: dict | None
    pods: tuple | None
    reuse: ReusePolicy | None
    run_scoped: bool            # a reuse policy of scope RUN: one pool per run
    retries: RetryPolicy
    timeouts: Timeouts
    task_queue: str | None


@dataclass(frozen=True, eq=False)
class _Run:
    """What a ``RunSpec`` contributes."""

    run_queue: str | None
    max_action_concurrency: int


_NO_RUN = _Run(None, 0)


def _task_part(ta, resources):
    path = "task."
    _check(ta, path)
    if not ta.HasField("spec"):
        raise SpecError("task.spec: the TaskAction carries no TaskSpec")
    spec = ta.spec
    _check(spec, "task.spec.")
    if not spec.HasField("task_template"):
        raise SpecError("task.spec.task_template: the TaskSpec carries no task template")
    tt = spec.task_template
    tp = "task.spec.task_template."
    _check(tt, tp)
    if tt.HasField("id"):
        _check(tt.id, tp + "id.")
    name = tt.id.name
    if ta.HasField("id"):
        _check(ta.id, "task.id.")
        if name and ta.id.name and ta.id.name != name:
            raise SpecError(f"task.id.name {ta.id.name!r} differs from the template's "
                            f"task.spec.task_template.id.name {name!r}")
        name = ta.id.name or name
    if not name:
        raise SpecError("task.id.name: the task has no name")
    env = None
    if spec.HasField("environment"):
        _check(spec.environment, "task.spec.environment.")
        env = spec.environment.name or None

    # --- the pod: container or pod template
    task_ext = tt.extended_resources if tt.HasField("extended_resources") else None
    if task_ext is not None:
        _check(task_ext, tp + "extended_resources.")
    acc = _accelerator(task_ext, tp + "extended_resources")
    target = tt.WhichOneof("target")
    if target == "container":
        c = tt.container
        _check(c, tp + "container.")
        image = c.image or None
        req = _flyte_resources(c.resources, tp + "container.resources")
        where = tp + "container.resources"
    elif target == "k8s_pod":
        pod = tt.k8s_pod
        _check(pod, tp + "k8s_pod.")
        primary, named_by = next(((n, w) for n, w in (
            (tt.config.get("primary_container_name"), "config.primary_container_name"),
            (pod.primary_container_name, "k8s_pod.primary_container_name")) if n),
            ("primary", "k8s_pod.primary_container_name (absent: 'primary')"))
        spec_dict = _struct(pod.pod_spec, tp + "k8s_pod.pod_spec")
        req = _pod_spec_requests(spec_dict, tp + "k8s_pod.pod_spec")
        named = [c for c in spec_dict.get("containers", [])
                 if isinstance(c, dict) and c.get("name") == primary]
        if not named:
            # (Flyte's propeller fails such a task at start; here it ran with no image.)
            raise SpecError(f"{tp}{named_by}: no container of the pod spec is named "
                            f"{primary!r}")
        image = named[0].get("image")
        where = tp + "k8s_pod.pod_spec"
    elif target == "sql":
        raise SpecError(f"{tp}sql: {_REFUSED['sql']}")
    else:
        raise SpecError(f"{tp}container: the task template has no container or pod")
    own = _engine_names(req, acc, resources, where, tp + "extended_resources")

    # --- plugins: the task type decides the workload shape
    pods = None
    kind = tt.type
    custom = _struct(tt.custom, tp + "custom") if tt.HasField("custom") else None
    shape = _PLUGINS.get(kind)
    if shape is None:
        raise SpecError(f"{tp}type: unsupported plugin {kind!r}: the engine derives the "
                        f"workload shape of {', '.join(sorted(_PLUGINS))} tasks")
    pods = shape(custom, tt, own, acc, resources, tp)

    # --- reuse
    reuse, run_scoped = None, False
    if tt.HasField("reuse_policy"):
        if pods is not None:
            raise SpecError(f"{tp}reuse_policy: a reusable {kind} cluster is a gang; the "
                            f"engine's warm pools are single pods")
        reuse, run_scoped = _reuse(tt.reuse_policy, tp + "reuse_policy.")
        if env is None:
            raise SpecError("task.spec.environment.name: a reusable task needs its "
                            "environment's name (its pool is shared by name)")
    if kind == "actor":
        _check_actor(custom, tt, reuse, tp)

    retries, timeouts = RetryPolicy(), Timeouts()
    if tt.HasField("metadata"):
        md = tt.metadata
        _check(md, tp + "metadata.")
        retries = _retries(md, tp + "metadata.")
        timeouts = _timeouts(md, tp + "metadata.")
    return _Task(task=name, environment=env, image=image,
                 resources=None if pods is not None else own, pods=pods, reuse=reuse,
                 run_scoped=run_scoped, retries=retries, timeouts=timeouts,
                 task_queue=ta.queue or None)


def _struct(struct, where):
    try:
        return json_format.MessageToDict(struct)
    except Exception as exc:     # a Struct that is not JSON (NaN, a bad value kind)
        raise SpecError(f"{where}: not readable as JSON ({exc})") from None


def _parse(custom, cls, where):
    """The plugin message ``cls`` from the task's ``custom`` (as the SDK writes it, with
    ``MessageToDict``); an unknown key is refused, naming it."""
    if custom is None:
        raise SpecError(f"{where}: the plugin's spec is missing")
    try:
        return json_format.ParseDict(custom, cls())
    except json_format.ParseError as exc:
        raise SpecError(f"{where}: not a {cls.DESCRIPTOR.full_name}: {exc}") from None


def _single(custom, tt, own, acc, resources, tp):
    """One pod: plain python, raw-container and reusable (actor) tasks."""
    if custom is not None and tt.type not in ("actor", "python-task"):
        raise SpecError(f"{tp}custom: a {tt.type!r} task carries no plugin spec; "
                        f"{sorted(custom)[0] if custom else 'it'} is not supported")
    if custom is not None and tt.type == "python-task":
        # flyteplugins-pytorch writes a one-node elastic job as a python-task (torchrun in
        # one pod) and still attaches its spec: accept it when it is that one pod.
        job = _parse(custom, kubeflow_pytorch_pb2.DistributedPyTorchTrainingTask, tp + "custom")
        shape = _pytorch(job, own, tp + "custom.")
        if shape is not None and (len(shape) != 1 or shape[0].replicas != 1):
            raise SpecError(f"{tp}type: a python-task with {sum(g.replicas for g in shape)} "
                            f"PyTorch workers; a multi-node job is type 'pytorch'")
    return None


def _group_pod(pod, ext, fallback_acc, own, resources, where, extra=None):
    """The per-pod vector of a plugin's group: its pod template's requests, or the task's own
    pod when it gives none (Flyte's plugins default a group to the task's resources)."""
    acc = _accelerator(ext, where + ".extended_resources") if ext is not None else None
    acc = acc or fallback_acc
    if pod is not None:
        _check(pod, where + ".k8s_pod.")
        spec = _struct(pod.pod_spec, where + ".k8s_pod.pod_spec")
        req = _pod_spec_requests(spec, where + ".k8s_pod.pod_spec")
        if extra:
            req = _add(req, extra)
        return _engine_names(req, acc, resources, where + ".k8s_pod.pod_spec",
                             where + ".extended_resources")
    if extra:
        raise SpecError(f"{where}: extra containers need the group's own pod template")
    return dict(own)


def _ray(custom, tt, own, acc, resources, tp):
    """Ray (flyteplugins-ray): one head pod plus each worker group's replicas."""
    where = tp + "custom"
    job = _parse(custom, ray_pb2.RayJob, where)
    _check(job, where + ".")
    cluster = job.ray_cluster
    cw = where + ".ray_cluster"
    _check(cluster, cw + ".")
    autoscale = cluster.enable_autoscaling
    sidecar = None
    if cluster.HasField("autoscaler_options"):
        opts = cluster.autoscaler_options
        _check(opts, cw + ".autoscaler_options.")
        if opts.HasField("resources"):
            # The autoscaler runs as a sidecar of the head pod: its requests are the head's.
            sidecar = _flyte_resources(opts.resources, cw + ".autoscaler_options.resources")
    head = cluster.head_group_spec
    hw = cw + ".head_group_spec"
    _check(head, hw + ".")
    groups = [PodGroup("head", 1, _group_pod(
        head.k8s_pod if head.HasField("k8s_pod") else None,
        head.extended_resources if head.HasField("extended_resources") else None,
        acc, own, resources, hw, extra=sidecar))]
    if not cluster.worker_group_spec:
        raise SpecError(f"{cw}.worker_group_spec: a Ray cluster needs a worker group")
    for i, g in enumerate(cluster.worker_group_spec):
        gw = f"{cw}.worker_group_spec[{i}]"
        _check(g, gw + ".")
        if not g.group_name:
            raise SpecError(f"{gw}.group_name: a worker group needs a name")
        count = g.replicas
        if autoscale:
            # An autoscaling cluster may grow to max_replicas: the engine reserves that, so a
            # started gang can never be stranded below its workers' demand.
            count = max(g.replicas, g.max_replicas)
        elif g.max_replicas and g.replicas > g.max_replicas:
            raise SpecError(f"{gw}.replicas: {g.replicas} is above max_replicas "
                            f"{g.max_replicas}")
        if count < 1:
            raise SpecError(f"{gw}.replicas: a worker group needs at least one replica")
        groups.append(PodGroup(g.group_name, count, _group_pod(
            g.k8s_pod if g.HasField("k8s_pod") else None,
            g.extended_resources if g.HasField("extended_resources") else None,
            acc, own, resources, gw)))
    return tuple(groups)


def _dask(custom, tt, own, acc, resources, tp):
    """Dask (flyteplugins-dask): the job runner (the task's pod), the scheduler, and
    ``number_of_workers`` workers; a part without resources takes the task's."""
    where = tp + "custom"
    job = _parse(custom, dask_pb2.DaskJob, where)
    _check(job, where + ".")
    parts = []
    for role, msg in (("scheduler", job.scheduler), ("workers", job.workers)):
        _check(msg, f"{where}.{role}.")
        if msg.HasField("resources"):
            req = _flyte_resources(msg.resources, f"{where}.{role}.resources")
            vec = _engine_names(req, acc, resources, f"{where}.{role}.resources",
                                tp + "extended_resources")
        else:
            vec = dict(own)
        parts.append(vec)
    workers = job.workers.number_of_workers
    if workers < 1:
        raise SpecError(f"{where}.workers.number_of_workers: {workers}: a Dask cluster "
                        f"needs at least one worker")
    return (PodGroup("runner", 1, dict(own)), PodGroup("scheduler", 1, parts[0]),
            PodGroup("worker", workers, parts[1]))


def _clustered(custom, tt, own, acc, resources, tp):
    """Clustered training (``flyte.clustered``, a JobSet): ``replicas`` identical pods."""
    where = tp + "custom"
    spec = _parse(custom, clustered_pb2.ClusteredTaskSpec, where)
    _check(spec, where + ".")
    if spec.replicas < 1:
        raise SpecError(f"{where}.replicas: {spec.replicas}: at least one pod")
    return (PodGroup("worker", spec.replicas, dict(own)),)


def _pytorch_task(custom, tt, own, acc, resources, tp):
    """PyTorch (flyteplugins-pytorch, kubeflow PyTorchJob)."""
    where = tp + "custom"
    if tt.task_type_version != 1:
        raise SpecError(f"{tp}task_type_version: {tt.task_type_version}: the engine reads "
                        f"the PyTorch spec of version 1 (flyteplugins-pytorch 2.x)")
    job = _parse(custom, kubeflow_pytorch_pb2.DistributedPyTorchTrainingTask, where)
    shape = _pytorch(job, own, where + ".", acc, resources, tp)
    if shape is None:
        raise SpecError(f"{where}.worker_replicas: a PyTorch job needs workers")
    return shape


def _pytorch(job, own, where, acc=None, resources=None, tp=""):
    """Master (not for elastic jobs: torchrun's rendezvous needs none) and workers; a replica
    spec without resources takes the task's. None when it names no workers."""
    _check(job, where)
    groups = []
    elastic = job.HasField("elastic_config")
    if elastic:
        _check(job.elastic_config, where + "elastic_config.")
    for role, field in (("master", "master_replicas"), ("worker", "worker_replicas")):
        if not job.HasField(field):
            continue
        spec = getattr(job, field)
        at = f"{where}{field}"
        _check(spec, at + ".")
        count = spec.replicas
        res = spec.resources if spec.HasField("resources") else None
        if spec.HasField("common"):
            _check(spec.common, at + ".common.")
            count = count or spec.common.replicas
            if res is None and spec.common.HasField("resources"):
                res = spec.common.resources
        if role == "master" and elastic and count:
            raise SpecError(f"{at}: an elastic job has no master replica")
        if count < 1:
            if role == "master":
                continue
            raise SpecError(f"{at}.replicas: {count}: a PyTorch job needs at least one "
                            f"worker")
        if elastic and job.elastic_config.max_replicas and count > (
                job.elastic_config.max_replicas):
            raise SpecError(f"{at}.replicas: {count} is above elastic_config.max_replicas "
                            f"{job.elastic_config.max_replicas}")
        if res is not None:
            req = _flyte_resources(res, at + ".resources")
            vec = _engine_names(req, acc, resources, at + ".resources",
                                tp + "extended_resources")
        else:
            vec = dict(own)
        groups.append(PodGroup(role, count, vec))
    if not any(g.role == "worker" for g in groups):
        return None
    return tuple(groups)


_PLUGINS = {
    "python": _single,
    "python-task": _single,
    "raw-container": _single,
    "actor": _single,
    "ray": _ray,
    "dask": _dask,
    "clustered-task": _clustered,
    "pytorch": _pytorch_task,
}


def _reuse(rp, where):
    _check(rp, where)
    if rp.max_replicas < 1:
        raise SpecError(f"{where}max_replicas: {rp.max_replicas}: a pool needs a replica")
    if rp.min_replicas > rp.max_replicas:
        raise SpecError(f"{where}min_replicas: {rp.min_replicas} is above max_replicas "
                        f"{rp.max_replicas}")
    if rp.concurrency < 1:
        raise SpecError(f"{where}concurrency: {rp.concurrency}: at least 1")
    if not rp.HasField("idle_ttl"):
        raise SpecError(f"{where}idle_ttl: required (the SDK always sets it)")
    idle = _duration(rp.idle_ttl, where + "idle_ttl", zero_is_none=False)
    if idle <= 0:
        raise SpecError(f"{where}idle_ttl: must be positive")
    if rp.scope not in (tasks_pb2.ReusePolicy.GLOBAL, tasks_pb2.ReusePolicy.RUN):
        # (An unknown value was taken for GLOBAL: one pool for every run.)
        raise SpecError(f"{where}scope: {rp.scope} is not a scope (GLOBAL = 0, RUN = 1)")
    # The pool may scale between min and max; the engine reserves max_replicas (the
    # footprint it can reach), so admitting the pool never overcommits a cluster.
    return (ReusePolicy(replicas=rp.max_replicas, concurrency=rp.concurrency, idle_ttl=idle),
            rp.scope == tasks_pb2.ReusePolicy.RUN)


_ACTOR_KEYS = {"name", "version", "type", "spec"}
_ACTOR_SPEC = {"container_image", "backlog_length", "parallelism", "min_replica_count",
               "replica_count", "ttl_seconds", "scaledown_ttl_seconds"}


def _check_actor(custom, tt, reuse, tp):
    """The SDK repeats a reusable python task's policy in ``custom`` (type "actor", for
    readers older than ``reuse_policy``): it must say what ``reuse_policy`` says."""
    where = tp + "custom"
    if reuse is None:
        raise SpecError(f"{tp}reuse_policy: an 'actor' task without a reuse policy")
    if not isinstance(custom, dict):
        raise SpecError(f"{where}: an 'actor' task without its spec")
    for key in custom:
        if key not in _ACTOR_KEYS:
            raise SpecError(f"{where}.{key}: not a field of the actor spec")
    spec = custom.get("spec") or {}
    for key in spec:
        if key not in _ACTOR_SPEC:
            raise SpecError(f"{where}.spec.{key}: not a field of the actor spec")
    for key, want in (("replica_count", reuse.replicas), ("parallelism", reuse.concurrency)):
        got = spec.get(key)
        if got is not None and got != want:
            raise SpecError(f"{where}.spec.{key}: {got} differs from the reuse policy's "
                            f"{want}")


def _retries(md, where):
    if not md.HasField("retries"):
        return RetryPolicy()
    rs = md.retries
    _check(rs, where + "retries.")
    if not rs.HasField("backoff"):
        # Flyte: without a Backoff, retries fire back to back.
        return RetryPolicy(count=rs.retries, backoff_base=0.0, backoff_factor=1.0,
                           backoff_cap=0.0)
    b = rs.backoff
    at = where + "retries.backoff."
    _check(b, at)
    base = _duration(b.base, at + "base", zero_is_none=False) if b.HasField("base") else 0.0
    factor = b.factor
    if not math.isfinite(factor) or factor < 1:
        raise SpecError(f"{at}factor: {factor!r} must be >= 1")
    if b.HasField("cap"):
        cap = _duration(b.cap, at + "cap", zero_is_none=False)
    elif factor == 1:
        cap = base          # a constant delay: the cap never binds
    else:
        raise SpecError(f"{at}cap: required when factor > 1 (the SDK requires it too)")
    return RetryPolicy(count=rs.retries, backoff_base=base, backoff_factor=float(factor),
                       backoff_cap=cap)


def _timeouts(md, where):
    runtime = _duration(md.timeout, where + "timeout") if md.HasField("timeout") else None
    queued = deadline = None
    if md.HasField("timeouts"):
        ts = md.timeouts
        _check(ts, where + "timeouts.")
        if ts.HasField("queued_timeout"):
            queued = _duration(ts.queued_timeout, where + "timeouts.queued_timeout")
        if ts.HasField("deadline"):
            deadline = _duration(ts.deadline, where + "timeouts.deadline")
    return Timeouts(deadline=deadline, max_queued_time=queued, max_runtime=runtime)


def _run_part(rs):
    _check(rs, "run_spec.")
    mac = rs.max_action_concurrency
    if mac == 1:
        raise SpecError("run_spec.max_action_concurrency: 1 is refused (0 is unlimited, "
                        "else at least 2: a parent and one child)")
    return _Run(run_queue=rs.queue or None, max_action_concurrency=mac)


# --------------------------------------------------------------------------- decoding
@dataclass(frozen=True)
class FlyteAction:
    """One decoded enqueue: the engine's spec and the action's input reference (what the
    worker is handed with the lease; ``None`` if the request names none)."""

    spec: ActionSpec
    input_uri: str | None = None


@dataclass(frozen=True)
class FlyteFanOut:
    """Consecutive requests that differ only in their action names and inputs: one
    ``engine.enqueue_fanout(template, names, inputs)``."""

    template: ActionSpec
    names: list
    inputs: list | None


class _Cache:
    """Derived task and run parts by their serialised bytes (a fan-out shares them)."""

    LIMIT = 4096

    def __init__(self):
        self.lock = threading.Lock()
        self.tasks = {}
        self.runs = {}

    def put(self, table, key, value):
        with self.lock:
            if len(table) >= self.LIMIT:
                table.clear()
            table[key] = value
        return value


_CACHES = {}    # id(resources) -> (resources, _Cache): a config's device names shape the parts


def _cache_for(resources):
    entry = _CACHES.get(id(resources))
    if entry is None or entry[0] is not resources:
        if len(_CACHES) >= 16:
            _CACHES.clear()
        entry = _CACHES[id(resources)] = (resources, _Cache())
    return entry[1]


_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*\Z")


def decode_request(request, kind=None):
    """``request`` (bytes or a message) as a flyteidl2 message: an ``EnqueueActionRequest``
    (queue service) or an ``EnqueueRequest`` (actions service). Bytes are read as
    ``kind`` ("queue" or "actions"; None: whichever of the two they are, the queue
    service's first). Raises ``SpecError`` on bytes that are not that message."""
    if isinstance(request, (EnqueueActionRequest, EnqueueRequest)):
        return request
    if isinstance(request, Message):
        raise SpecError(f"expected a flyteidl2 EnqueueActionRequest or EnqueueRequest, not "
                        f"{request.DESCRIPTOR.full_name}")
    if isinstance(request, (bytearray, memoryview)):
        request = bytes(request)
    if not isinstance(request, bytes):
        raise SpecError(f"expected a flyteidl2 enqueue message or its bytes, not "
                        f"{type(request).__name__}")
    if kind is None:
        return _either(request)
    cls = {"queue": EnqueueActionRequest, "actions": EnqueueRequest}.get(kind)
    if cls is None:
        raise SpecError(f"kind {kind!r}: 'queue' (EnqueueActionRequest) or 'actions' "
                        f"(EnqueueRequest)")
    try:
        return cls.FromString(request)
    except DecodeError:
        raise SpecError(f"not a serialised {cls.DESCRIPTOR.full_name} "
                        f"({len(request)} bytes; the wire format is corrupt)") from None


_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9_.-]*/){4}[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
_FROM_QUEUE = EnqueueActionRequest.FromString
_FROM_ACTIONS = EnqueueRequest.FromString


def _either(raw):
    """Bytes of either kind: protobuf reads most bytes as both messages, so the queue
    service's ``EnqueueActionRequest`` is taken when it carries an action spec and no field
    it does not know, else the actions service's ``EnqueueRequest`` when it carries an
    action and no unknown field, else the first reading (whose checks then say what is
    wrong with it)."""
    try:
        queue = _FROM_QUEUE(raw)
    except DecodeError:
        queue = None
    else:
        if queue.WhichOneof("spec") is not None and not len(UnknownFieldSet(queue)):
            return queue
    try:
        actions = _FROM_ACTIONS(raw)
    except DecodeError:
        pass
    else:
        if actions.HasField("action") and not len(UnknownFieldSet(actions)):
            return actions
    return queue if queue is not None else decode_request(raw, "queue")   # words the error


def _decode(request, kind, cache, resources):
    """``(task part, run part, run key, name, parent, input_uri)`` of one request. The hot
    path of a fan-out: one parse, no walk of the fields the tables fully cover."""
    if kind is None and type(request) is bytes:
        msg = _either(request)
    else:
        msg = decode_request(request, kind)
    run_spec = None
    base = ""
    if type(msg) is EnqueueRequest:
        _check(msg, "")
        if msg.HasField("run_spec"):
            run_spec = msg.run_spec
        msg = msg.action
        base = "action."
        _check(msg, base)
    else:
        _check(msg, "")
        if msg.HasField("run_spec"):
            run_spec = msg.run_spec
    which = msg.WhichOneof("spec")
    if which != "task":
        if which is None:
            raise SpecError(f"{base}task: the request carries no task action")
        raise SpecError(f"{base}{which}: {_REFUSED[which]}")
    aid = msg.action_id
    run = aid.run
    name = aid.name
    run_key = f"{run.org}/{run.project}/{run.domain}/{run.name}"
    if _ID.match(f"{run_key}/{name}") is None:
        parts = (run.org, run.project, run.domain, run.name, name)
        for label, value in zip(("run.org", "run.project", "run.domain", "run.name", "name"),
                                parts, strict=True):
            if not _SEGMENT.match(value):
                raise SpecError(f"{base}action_id.{label}: {value!r} is not a valid name "
                                f"(letters, digits, '_', '.', '-'; not empty)")
    if len(UnknownFieldSet(aid)) or len(UnknownFieldSet(run)):
        _check(aid, base + "action_id.")
        _check(run, base + "action_id.run.")
    parent = msg.parent_action_name or None
    if parent is not None and not _SEGMENT.match(parent):
        raise SpecError(f"{base}parent_action_name: {parent!r} is not a valid action name")
    ta = msg.task
    task = cache.tasks.get(key := ta.SerializeToString())
    if task is None:
        task = cache.put(cache.tasks, key, _prefixed(base, _task_part, ta, resources))
    runp = _NO_RUN
    if run_spec is not None:
        runp = cache.runs.get(key := run_spec.SerializeToString())
        if runp is None:
            runp = cache.put(cache.runs, key, _run_part(run_spec))
    return task, runp, run_key, name, parent, msg.input_uri or None


def _prefixed(base, fn, *args):
    try:
        return fn(*args)
    except SpecError as exc:
        if base:
            raise SpecError(f"{base}{exc}") from None
        raise


def _spec(task, runp, run, name, parent, run_queue=None):
    env = task.environment
    if env is not None and task.run_scoped:
        env = f"{env}@{run}"     # a RUN-scoped pool is one pool per run
    return ActionSpec(
        id=f"{run}/{name}", task=task.task, parent=f"{run}/{parent}" if parent else None,
        environment=env, image=task.image, resources=task.resources, pods=task.pods,
        reuse=task.reuse, retries=task.retries, timeouts=task.timeouts,
        task_queue=task.task_queue, run_queue=runp.run_queue or run_queue,
        run_max_action_concurrency=runp.max_action_concurrency)


def flyte_action(request, *, resources=None, kind=None):
    """Decode one enqueue (a flyteidl2 ``EnqueueActionRequest`` or ``EnqueueRequest``, or
    its bytes: see :func:`decode_request`) into a :class:`FlyteAction`.

    ``resources`` (an engine's ``config.resources``) checks the accelerator and every
    requested resource against the configured names now, so an error names the Flyte field;
    without it the names are checked when the spec is enqueued. Enqueue with
    ``engine.enqueue(a.spec)``, or with its input reference:
    ``engine.enqueue_fanout(a.spec, [name], [a.input_uri])`` (see :func:`enqueue_flyte`).
    Raises ``SpecError`` naming the field on anything the engine cannot honour.
    """
    cache = _cache_for(resources)
    task, runp, run, name, parent, input_uri = _decode(request, kind, cache, resources)
    return FlyteAction(_spec(task, runp, run, name, parent), input_uri)


def flyte_fanouts(requests, *, resources=None, kind=None):
    """Decode a batch of enqueues into fan-outs: consecutive requests of one run, one parent,
    one ``TaskAction`` and one ``RunSpec`` (a map over a task) become one
    :class:`FlyteFanOut`. Every request is decoded before anything is returned, so a bad one
    (``SpecError`` saying which, ``requests[i]: ...``) leaves nothing half done."""
    cache = _cache_for(resources)
    runs = []           # [first decoded, names, inputs]
    key = None
    for i, request in enumerate(requests):
        try:
            task, runp, run, name, parent, ref = _decode(request, kind, cache, resources)
        except SpecError as exc:
            raise SpecError(f"requests[{i}]: {exc}") from None
        k = (task, runp, run, parent)
        if k != key:
            key = k
            runs.append(((task, runp, run, name, parent), [], []))
        runs[-1][1].append(name)
        runs[-1][2].append(ref)
    return [FlyteFanOut(_spec(*first), names,
                        None if all(r is None for r in inputs) else inputs)
            for first, names, inputs in runs]


def enqueue_flyte(engine, requests, *, kind=None):
    """Decode and enqueue flyteidl2 enqueues (messages or bytes; one or a list) into
    ``engine``; returns the ``ActionId`` of each, in order.

    Each fan-out (:func:`flyte_fanouts`) is one ``engine.enqueue_fanout``: compiled once,
    one group commit, atomic. A child enqueued without a ``RunSpec`` (the SDK sends it only
    with a run's first action) takes its run's queue from its parent's stored spec, as Flyte
    runs do. A batch is decoded whole before the first fan-out is enqueued, and two requests
    naming one action with different specs are refused (``SpecError``) before anything is;
    a later fan-out refused by the engine (depth, an existing id with another spec) leaves
    the earlier ones enqueued: the error says so, and its ``enqueued`` holds their ids."""
    if isinstance(requests, (bytes, bytearray, memoryview, Message)):
        requests = [requests]
    return enqueue_fanouts(engine, flyte_fanouts(requests, resources=engine.config.resources,
                                                 kind=kind))


def enqueue_fanouts(engine, fanouts):
    """Enqueue decoded :class:`FlyteFanOut`s (:func:`flyte_fanouts`) as
    :func:`enqueue_flyte` does; returns the ``ActionId`` of each action, in order. (The
    shard decodes first, checks every action's tenant, then calls this.)"""
    _check_distinct(fanouts)
    ids = []
    insp = None
    for f in fanouts:
        t = f.template
        if t.run_queue is None and t.parent is not None:
            insp = insp or engine.inspect()
            row = insp.find(t.parent)
            if row is not None:
                parent_spec = insp.record(row).spec
                if parent_spec.run_queue is not None:
                    t = _with_run_queue(t, parent_spec.run_queue)
        try:
            ids.extend(engine.enqueue_fanout(t, f.names, f.inputs))
        except LeaseholdError as exc:
            if not ids:
                raise
            # The earlier fan-outs stay enqueued (each is atomic, the batch is not): the
            # error says so, and carries their ids (the shard records their events).
            exc.args = (f"{exc}; the batch's first {len(ids)} action(s) were enqueued "
                        f"({ids[0]} .. {ids[-1]}), the rest not",)
            exc.enqueued = [str(a) for a in ids]
            raise
    return ids


def _check_distinct(fanouts):
    """Two requests of one batch that name one action with different specs: SpecError
    before anything is enqueued (the engine would refuse the second as ALREADY_EXISTS
    after storing the first). Two of one fan-out (consecutive requests of one task) naming
    one action: SpecError naming both (the engine would say only that the fan-out's
    ``names[j]`` appears twice)."""
    seen = {}           # action id -> (request index, its template, its input reference)
    first = 0
    for f in fanouts:
        run = f.template.id.rsplit("/", 1)[0]
        refs = f.inputs if f.inputs is not None else [None] * len(f.names)
        for j, (name, ref) in enumerate(zip(f.names, refs, strict=True)):
            aid = f"{run}/{name}"
            prev = seen.setdefault(aid, (first + j, f.template, ref))
            if first <= prev[0] < first + j:
                raise SpecError(f"requests[{prev[0]}] and requests[{first + j}] both name "
                                f"action {aid}; send each action once")
            if prev[0] != first + j and (prev[2] != ref or replace(prev[1], id=aid) != replace(
                    f.template, id=aid)):
                raise SpecError(f"requests[{prev[0]}] and requests[{first + j}] name action "
                                f"{aid} with different specs")
        first += len(f.names)


def _with_run_queue(spec, queue):
    return replace(spec, run_queue=queue)


def flyte_task_action(task, action, *, parent=None, queue=None, run_queue=None,
                      max_action_concurrency=0, input_uri=None, resources=None,
                      serialization_context=None):
    """A Flyte task object (``@env.task``) as a :class:`FlyteAction`, through the SDK's own
    offline serialisation (``flyte.extras.serialize``: no endpoint, no image build).

    ``action`` is ``org/project/domain/run/action``; the task's queue (its own, else its
    environment's) is the action's unless ``queue`` overrides it; ``run_queue`` and
    ``max_action_concurrency`` are the run's. Needs the ``flyte`` package
    (``pip install 'leasehold[flyte]'``)."""
    try:
        import flyte.extras
        from flyte.models import SerializationContext
    except ImportError as exc:
        raise SpecError(f"a Flyte task object needs the flyte SDK ({exc}); install "
                        f"leasehold[flyte]") from None
    from flyteidl2.common import identifier_pb2
    from flyteidl2.task import task_definition_pb2
    from flyteidl2.workflow import run_definition_pb2

    parts = str(action).split("/")
    if len(parts) != 5:
        raise SpecError(f"action {action!r} must be org/project/domain/run/action")
    org, project, domain, run, name = parts
    ctx = serialization_context
    if ctx is None:
        import pathlib
        ctx = SerializationContext(version="leasehold", project=project, domain=domain,
                                   org=org, root_dir=pathlib.Path.cwd())
    try:
        spec = flyte.extras.serialize(task, ctx)
    except Exception as exc:    # the SDK's own errors, whatever their class
        raise SpecError(f"the Flyte SDK could not serialise task "
                        f"{getattr(task, 'name', task)!r}: {exc}") from None
    tid = spec.task_template.id
    req = EnqueueActionRequest(
        action_id=identifier_pb2.ActionIdentifier(
            run=identifier_pb2.RunIdentifier(org=org, project=project, domain=domain, name=run),
            name=name),
        task=run_definition_pb2.TaskAction(
            id=task_definition_pb2.TaskIdentifier(org=tid.org, project=tid.project,
                                                  domain=tid.domain, name=tid.name,
                                                  version=tid.version),
            spec=spec, queue=queue or getattr(task, "queue", None) or ""),
        input_uri=input_uri or "")
    if parent is not None:
        req.parent_action_name = parent
    if run_queue is not None or max_action_concurrency:
        req.run_spec.CopyFrom(run_pb2.RunSpec(queue=run_queue or "",
                                              max_action_concurrency=max_action_concurrency))
    return flyte_action(req, resources=resources)
