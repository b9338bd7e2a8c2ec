"""Workload traces for the simulator: JSON lines and the Standard Workload Format (SWF).

:func:`load_trace` reads a file into a list of :class:`Job` sorted by submission time (ties in
file order). Two formats, chosen by the file name (``.swf`` is SWF, anything else JSON lines)
or by ``fmt``:

- **JSON lines**: one object per line (``docs/simulator.md`` has the schema):
  ``{"submit": 0, "runtime": 600, "queue": "gpu", "task": "train",
  "pods": [{"count": 2, "resources": {"cpu": 32, "gpu:H100": 8}}]}``, or a flat
  ``"resources": {...}`` for one pod. Blank lines and lines starting with ``#`` are skipped.
- **SWF** (Parallel Workloads Archive): ``;`` comment lines, then 18 whitespace-separated
  fields per job. A job becomes one pod group of ``processors`` pods, each asking
  ``per_processor`` of ``resource`` (:class:`SwfMapping`). Jobs with a run time <= 0, or a
  missing (-1) submit time, run time or processor count are skipped and counted.

Bad input raises :class:`TraceError` naming the file, the line and the field; nothing else
escapes (no traceback for a user's typo). A file that holds no job (empty, only comments,
or SWF jobs all skipped) is bad input too: :func:`load_trace` refuses it.
"""

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from engine._errors import LeaseholdError, empty_file

__all__ = ["Job", "Trace", "TraceError", "SwfMapping", "load_trace", "parse_jsonl", "parse_swf"]

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
_JSONL_KEYS = ("id", "submit", "runtime", "queue", "task", "pods", "resources", "estimate")
_POD_KEYS = ("count", "resources")
_MAX_POD_COUNT = 1_000_000
# Seconds; far beyond any trace, and far from overflowing int64 nanoseconds.
_MAX_SECONDS = 1e9


class TraceError(LeaseholdError):
    """A trace file is unreadable or malformed; the message names file, line and field."""

    code = "INVALID_TRACE"


@dataclass(frozen=True)
class Job:
    """One job of a trace.

    ``pods`` is a tuple of ``(count, {resource: quantity})``: the job is a gang of all those
    pods (quantities in the config spellings: ``8``, ``"500m"``, ``"64Gi"``). ``queue`` None
    means the config's default queue. ``estimate`` is the user's runtime estimate (SWF field 9,
    JSON ``estimate``) when given. ``where`` is ``file:line`` for messages.
    """

    id: str
    submit: float
    runtime: float
    pods: tuple
    task: str
    queue: str | None = None
    estimate: float | None = None
    where: str = ""

    @property
    def n_pods(self):
        """Pods in total (a gang has more than one)."""
        return sum(count for count, _ in self.pods)


@dataclass
class Trace:
    """The jobs of a file (sorted by submission) and what was skipped, with why."""

    source: str
    jobs: list
    skipped: int = 0
    skipped_reasons: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SwfMapping:
    """How an SWF job's processors become pods: each processor is one pod asking
    ``per_processor`` of ``resource``; the job goes to ``queue`` (None: the default queue)."""

    resource: str = "cpu"
    per_processor: object = 1
    queue: str | None = None


def load_trace(path, fmt=None, swf=None):
    """Read the trace at ``path`` (format from ``fmt`` "jsonl"/"swf", else the suffix)."""
    source = str(path)
    if fmt is None:
        fmt = "swf" if Path(source).suffix.lower() == ".swf" else "jsonl"
    if fmt not in ("jsonl", "swf"):
        raise TraceError(f"{source}: unknown trace format {fmt!r}; allowed: jsonl, swf")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise TraceError(f"{source}: cannot read the trace: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"{source}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if fmt == "swf":
        trace = parse_swf(text.splitlines(), source, swf or SwfMapping())
    else:
        trace = parse_jsonl(text.splitlines(), source)
    if not trace.jobs:
        # A run over nothing would print a table of zeros and exit 0: a wrong path or a
        # truncated download must not pass for a result.
        if trace.skipped:
            why = ", ".join(f"{n} {r}" for r, n in sorted(trace.skipped_reasons.items()))
            raise TraceError(f"{source}: holds no jobs to simulate: all {trace.skipped} SWF "
                             f"jobs were skipped ({why})")
        if not text.strip():
            raise TraceError(empty_file(source))
        what = "only ; comments and blank lines" if fmt == "swf" else \
            "only # comments and blank lines"
        raise TraceError(f"{source}: holds no jobs ({what})")
    return trace


def _sort(jobs):
    return sorted(jobs, key=lambda j: j.submit)   # stable: ties keep file order


def _unique(source, jobs, seen, job, lineno):
    if job.id in seen:
        raise TraceError(f"{source}:{lineno}: id: {job.id!r} is also the id of line {seen[job.id]}")
    seen[job.id] = lineno
    jobs.append(job)


# ---------------------------------------------------------------------------------------------
# JSON lines


def parse_jsonl(lines, source="<trace>"):
    """Parse JSON-lines text (an iterable of lines) into a :class:`Trace`."""
    jobs, seen = [], {}
    for lineno, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        where = f"{source}:{lineno}"
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: invalid JSON: {exc.msg} (column {exc.colno})") from None
        except RecursionError:
            raise TraceError(f"{where}: invalid JSON: nested too deeply") from None
        job = _jsonl_job(obj, where, lineno)
        _unique(source, jobs, seen, job, lineno)
    return Trace(source=source, jobs=_sort(jobs))


def _known_keys(obj, allowed, where):
    unknown = sorted(set(obj) - set(allowed))
    if unknown:
        raise TraceError(f"{where}: unknown key(s) {', '.join(unknown)}; "
                         f"allowed: {', '.join(allowed)}")


def _jsonl_job(obj, where, lineno):
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: a job must be a JSON object, not {type(obj).__name__}")
    _known_keys(obj, _JSONL_KEYS, where)
    for key in ("submit", "runtime"):
        if key not in obj:
            raise TraceError(f"{where}: {key}: missing (seconds, a number)")
    submit = _number(obj["submit"], f"{where}: submit", minimum=0.0)
    runtime = _number(obj["runtime"], f"{where}: runtime", minimum=0.0, strict=True)
    estimate = None
    if obj.get("estimate") is not None:
        estimate = _number(obj["estimate"], f"{where}: estimate", minimum=0.0, strict=True)

    if ("pods" in obj) == ("resources" in obj):
        raise TraceError(f"{where}: pods/resources: give exactly one of pods (a list of "
                         f"{{count, resources}}) or resources (one pod)")
    if "resources" in obj:
        pods = ((1, _resources(obj["resources"], f"{where}: resources")),)
    else:
        raw = obj["pods"]
        if not isinstance(raw, list) or not raw:
            raise TraceError(f"{where}: pods: {raw!r} is not a non-empty list of "
                             f"{{\"count\": n, \"resources\": {{...}}}}")
        pods = []
        for i, group in enumerate(raw):
            what = f"{where}: pods[{i}]"
            if not isinstance(group, dict):
                raise TraceError(f"{what}: {group!r} is not an object {{count, resources}}")
            _known_keys(group, _POD_KEYS, what)
            count = group.get("count", 1)
            if (isinstance(count, bool) or not isinstance(count, int)
                    or not 1 <= count <= _MAX_POD_COUNT):
                raise TraceError(f"{what}.count: {count!r} is not an integer "
                                 f"1..{_MAX_POD_COUNT}")
            if "resources" not in group:
                raise TraceError(f"{what}.resources: missing")
            pods.append((count, _resources(group["resources"], f"{what}.resources")))
        pods = tuple(pods)

    queue = obj.get("queue")
    if queue is not None and (not isinstance(queue, str) or not queue):
        raise TraceError(f"{where}: queue: {queue!r} is not a queue name")
    task = obj.get("task")
    if task is None:
        task = _derived_task(pods)
    elif not isinstance(task, str) or not task:
        raise TraceError(f"{where}: task: {task!r} is not a non-empty string")
    jid = obj.get("id", lineno)
    if isinstance(jid, bool) or not isinstance(jid, (int, str)) or not _ID.match(str(jid)):
        raise TraceError(f"{where}: id: {jid!r} is not an integer or a name of letters, "
                         f"digits, '_', '.', '-'")
    return Job(id=str(jid), submit=submit, runtime=runtime, pods=pods, task=task, queue=queue,
               estimate=estimate, where=where)


def _number(value, what, minimum, strict=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TraceError(f"{what}: {value!r} is not a number of seconds")
    if value < minimum or (strict and value == minimum):
        op = ">" if strict else ">="
        raise TraceError(f"{what}: {value!r} must be {op} {minimum:g}")
    if value > _MAX_SECONDS:
        raise TraceError(f"{what}: {value!r} is too large (at most {_MAX_SECONDS:g} s)")
    return float(value)


def _resources(value, what):
    if not isinstance(value, dict) or not value:
        raise TraceError(f"{what}: {value!r} is not a non-empty object of resource: quantity")
    for name, qty in value.items():
        if isinstance(qty, bool) or not isinstance(qty, (int, float, str)):
            raise TraceError(f"{what}.{name}: {qty!r} is not a quantity (8, \"500m\", \"64Gi\")")
    return dict(value)


def _derived_task(pods):
    """A stable name from the shape, so jobs of one shape share runtime history."""
    parts = []
    for count, res in pods:
        body = ",".join(f"{k}={res[k]}" for k in sorted(res))
        parts.append(f"{count}x[{body}]")
    return "+".join(parts)


# ---------------------------------------------------------------------------------------------
# SWF

_SWF_FIELDS = (
    "job number", "submit time", "wait time", "run time", "allocated processors",
    "average cpu time", "used memory", "requested processors", "requested time",
    "requested memory", "status", "user id", "group id", "executable number",
    "queue number", "partition number", "preceding job", "think time",
)


def parse_swf(lines, source="<trace>", mapping=None):
    """Parse SWF text (an iterable of lines) into a :class:`Trace`.

    Fields used (1-based): 1 job number (the id), 2 submit time, 4 run time, 5 allocated
    processors (else 8, requested processors), 9 requested time (the estimate), 14 executable
    number (task ``exe<N>``, else 12 user id: ``user<N>``, else ``job``).
    """
    mapping = mapping or SwfMapping()
    jobs, seen = [], {}
    skipped, reasons = 0, {}
    for lineno, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith(";"):
            continue
        where = f"{source}:{lineno}"
        parts = text.split()
        if len(parts) != len(_SWF_FIELDS):
            raise TraceError(f"{where}: expected {len(_SWF_FIELDS)} whitespace-separated "
                             f"fields, found {len(parts)}")
        values = []
        for i, raw in enumerate(parts):
            try:
                v = float(raw)
            except ValueError:
                v = None
            if v is None or not math.isfinite(v):
                raise TraceError(f"{where}: field {i + 1} ({_SWF_FIELDS[i]}): {raw!r} is not "
                                 f"a number")
            values.append(v)
        submit, runtime = values[1], values[3]
        procs = values[4] if values[4] > 0 else values[7]
        reason = None
        if submit < 0:
            reason = "no submit time (-1)"
        elif runtime == -1:
            reason = "no run time (-1)"
        elif runtime <= 0:
            reason = "run time <= 0"
        elif procs <= 0:
            reason = "no processor count (-1)"
        if reason is not None:
            skipped += 1
            reasons[reason] = reasons.get(reason, 0) + 1
            continue
        if procs != int(procs) or procs > _MAX_POD_COUNT:
            field_no = 5 if values[4] > 0 else 8
            raise TraceError(f"{where}: field {field_no} ({_SWF_FIELDS[field_no - 1]}): "
                             f"{parts[field_no - 1]!r} is not a whole processor count "
                             f"<= {_MAX_POD_COUNT}")
        for i, v in ((2, submit), (4, runtime)):
            if v > _MAX_SECONDS:
                raise TraceError(f"{where}: field {i} ({_SWF_FIELDS[i - 1]}): "
                                 f"{parts[i - 1]!r} is too large (at most {_MAX_SECONDS:g} s)")
        if values[13] >= 0:
            task = f"exe{int(values[13])}"
        elif values[11] >= 0:
            task = f"user{int(values[11])}"
        else:
            task = "job"
        estimate = values[8] if 0 < values[8] <= _MAX_SECONDS else None
        jid = parts[0] if _ID.match(parts[0]) else str(lineno)
        job = Job(id=jid, submit=submit, runtime=runtime,
                  pods=((int(procs), {mapping.resource: mapping.per_processor}),),
                  task=task, queue=mapping.queue, estimate=estimate, where=where)
        _unique(source, jobs, seen, job, lineno)
    return Trace(source=source, jobs=_sort(jobs), skipped=skipped, skipped_reasons=reasons)
