"""The wire protocol: versioned, schema-checked messages (``docs/protocol.md``).

A message is a list of ZeroMQ frames (after the ROUTER's routing id, on the shard side):

- frame 0: one byte, ``version << 5 | type`` (version 1..7, type 1..31; 0 is never valid);
- frame 1: a msgpack map, the *header*, whose keys each type fixes;
- frames 2..: raw little-endian columns (numpy buffers, sent and received without a copy),
  ``n`` rows each, ``n`` given in the header; their number, order and dtypes are fixed by
  the type.

:func:`decode` checks everything about a message against its type's schema and the limits
of a :class:`~engine._config.TransportSettings` (frame count and sizes, header keys and
value types, list lengths, column lengths and value ranges) and returns a typed message, or
raises :class:`ProtocolError` naming what was wrong; on arbitrary input it raises nothing
else. :func:`encode` turns a message into frames for ``send_multipart(copy=False)``.

The hot messages (HEARTBEAT, REPORT, LEASES, REFUSED) carry their tokens and codes as
columns, so their cost does not grow with a Python step per token: a heartbeat of 1,000
tokens decodes into a read-only ``n x 3`` uint64 view of the received frame.
"""

import dataclasses
import enum
import itertools
import re
from dataclasses import dataclass

import msgpack
import numpy as np

from engine._codes import PHASES, LeaseKind, Phase, Verdict
from engine._config import TransportSettings
from engine._errors import LeaseholdError, SpecError
from transport import _schema as sc
from transport._schema import SchemaError

__all__ = [
    "VERSION",
    "MsgType",
    "ProtocolError",
    "ERROR_CODES",
    "TOKEN_DTYPE",
    "Decoder",
    "decode",
    "encode",
    "tokens_array",
    "Message",
    "Enqueue",
    "EnqueueFanout",
    "Abort",
    "Status",
    "Explain",
    "QueueMetrics",
    "QueueUpdate",
    "Watch",
    "Unwatch",
    "Ping",
    "Reply",
    "Error",
    "Event",
    "Register",
    "Heartbeat",
    "Report",
    "Bye",
    "Registered",
    "Leases",
    "Refused",
]

#: The protocol version this side speaks (frame 0's top three bits).
VERSION = 1
_VERSION_SHIFT = 5
_TYPE_MASK = (1 << _VERSION_SHIFT) - 1

#: A token on the wire: three little-endian uint64 (lease id, generation, MAC), 24 bytes.
TOKEN_DTYPE = np.dtype("<u8")


class MsgType(enum.IntEnum):
    """Message types (frame 0's low five bits). Numbers are never reused."""

    # client -> shard (each carries a request id ``rid`` echoed in the REPLY or ERROR)
    ENQUEUE = 1
    ENQUEUE_FANOUT = 2
    ABORT = 3
    STATUS = 4
    EXPLAIN = 5
    QUEUE_METRICS = 6
    QUEUE_UPDATE = 7
    WATCH = 8
    UNWATCH = 9
    PING = 10
    ENQUEUE_FLYTE = 11
    # shard -> client (ERROR goes to workers too)
    REPLY = 12
    ERROR = 13
    EVENT = 14
    EVENTS = 15
    # worker -> shard
    REGISTER = 16
    HEARTBEAT = 17
    REPORT = 18
    BYE = 19
    # shard -> worker
    REGISTERED = 24
    LEASES = 25
    REFUSED = 26


class ProtocolError(LeaseholdError):
    """A message that cannot be taken as it is: ``code`` is BAD_VERSION, UNKNOWN_TYPE,
    TOO_LARGE or BAD_MESSAGE and the text names what was wrong. ``rid`` is the request id
    when the header was readable (so the ERROR reply can echo it), else None; ``type`` the
    message type when known."""

    def __init__(self, code, text, rid=None, type=None):
        super().__init__(text)
        self.code = code
        self.text = text
        self.rid = rid
        self.type = type


#: Codes an ERROR may carry (``docs/protocol.md``); a decoder accepts any upper-case code.
ERROR_CODES = (
    "BAD_VERSION", "UNKNOWN_TYPE", "TOO_LARGE", "BAD_MESSAGE",      # the message itself
    "UNAUTHENTICATED", "PERMISSION_DENIED",                         # who sent it
    "INVALID_ARGUMENT", "INVALID_CONFIG", "NOT_FOUND", "ALREADY_EXISTS",
    "RESOURCE_EXHAUSTED",                                           # what the engine said
    "UNAVAILABLE", "INTERNAL", "UNIMPLEMENTED",                     # the shard
    "WRONG_SHARD",              # another shard owns the tenant (appended: indices stay)
)


# ---------------------------------------------------------------------------------------------
# Messages: one class a type. Field names are the header keys; columns are numpy arrays.


class Message:
    """Base class of every message; ``TYPE`` is its :class:`MsgType`."""

    __slots__ = ()
    TYPE = None


def _message(type_):
    def wrap(cls):
        cls.TYPE = type_
        return dataclass(slots=True)(cls)
    return wrap


@_message(MsgType.ENQUEUE)
class Enqueue(Message):
    """Enqueue a batch of actions atomically (``Engine.enqueue_many``): ``specs`` are maps as
    ``ActionSpec.from_dict`` takes them. REPLY body: ``{"ids": [action id, ...]}``."""

    rid: int
    specs: list


@_message(MsgType.ENQUEUE_FLYTE)
class EnqueueFlyte(Message):
    """Flyte 2 enqueues as the SDK serialises them (``docs/flyte.md``): ``requests`` are
    serialised flyteidl2 queue-service ``EnqueueActionRequest``s or actions-service
    ``EnqueueRequest``s (``kind`` "queue" or "actions"; absent: each is tried as the
    first, then the second). The shard decodes them, checks every action's tenant, and
    enqueues each fan-out as ``engine.flyte.enqueue_flyte`` does (a child takes its run's
    queue from its parent's stored spec). REPLY body: ``{"ids": [action id, ...]}``."""

    rid: int
    requests: list
    kind: str | None = None


@_message(MsgType.ENQUEUE_FANOUT)
class EnqueueFanout(Message):
    """``len(names)`` actions sharing ``template`` (``Engine.enqueue_fanout``), with optional
    input references. REPLY body: ``{"n": count}`` (ids are the template's run + names)."""

    rid: int
    template: dict
    names: list
    inputs: list | None = None


@_message(MsgType.ABORT)
class Abort(Message):
    """Abort an action and its descendants. REPLY body: ``{"ended": [action id, ...]}``."""

    rid: int
    action: str
    reason: str | None = None


@_message(MsgType.STATUS)
class Status(Message):
    """Phases of actions. REPLY body: ``{"phases": [phase, ...]}`` in order."""

    rid: int
    actions: list


@_message(MsgType.EXPLAIN)
class Explain(Message):
    """Why an action is where it is. REPLY body: the Explanation as a map (action, phase,
    wait, reason, eta_ns, position, projected_start_ns, projected_why)."""

    rid: int
    action: str


@_message(MsgType.QUEUE_METRICS)
class QueueMetrics(Message):
    """``Engine.queue_metrics`` of one queue (or all when ``queue`` is None); the REPLY body
    is its map."""

    rid: int
    queue: str | None = None


@_message(MsgType.QUEUE_UPDATE)
class QueueUpdate(Message):
    """Change a queue live (admin): ``changes`` as ``Engine.update_queue(name, **changes)``
    takes them. REPLY body: the queue's new settings as a map."""

    rid: int
    queue: str
    changes: dict


@_message(MsgType.WATCH)
class Watch(Message):
    """Stream the state changes of ``run`` (``tenant/project/domain/run``) as EVENTs with
    sequence numbers greater than ``since`` (a reconnecting watcher passes the last it saw).
    REPLY body: ``{"seq": the run's latest sequence number, "first": the seq the replay
    starts at (seq + 1 when nothing is replayed)}``; EVENTs follow."""

    rid: int
    run: str
    since: int = 0


@_message(MsgType.UNWATCH)
class Unwatch(Message):
    """Stop streaming ``run`` to this connection. REPLY body: nil."""

    rid: int
    run: str


@_message(MsgType.PING)
class Ping(Message):
    """Any peer: is the shard there? REPLY body: ``{"shard": name, "version": VERSION}``."""

    rid: int


@_message(MsgType.REPLY)
class Reply(Message):
    """The answer to request ``rid``; ``body`` is plain data (its shape per request type)."""

    rid: int
    body: object = None


@_message(MsgType.ERROR)
class Error(Message):
    """Request ``rid`` (None when unknown) failed: ``code`` (ERROR_CODES) and a message
    naming what was wrong."""

    rid: int | None
    code: str
    message: str


@_message(MsgType.EVENT)
class Event(Message):
    """One state change of a watched run: action ``action`` entered ``phase`` in attempt
    ``attempt`` at ``time_ns`` (the shard's clock); ``seq`` numbers the run's changes from 1
    without gaps. ``detail``: the error or wait text, when there is one."""

    run: str
    seq: int
    action: str
    phase: str
    attempt: int
    time_ns: int
    detail: str | None = None


@_message(MsgType.EVENTS)
class Events(Message):
    """Consecutive state changes of one watched run, ``seq`` numbering the first (the rest
    follow without gaps): entry ``i`` is action ``actions[i]`` entering phase
    ``phases[i]`` (uint8 code, ``engine._codes.PHASES``) in attempt ``attempts[i]`` at
    ``time_ns[i]``; ``details``: each entry's text or nil (None when none has one). What
    the shard sends instead of one EVENT per change: a turn's changes of a run in one
    message. :meth:`events` gives them as :class:`Event` messages."""

    run: str
    seq: int
    actions: list
    phases: np.ndarray
    attempts: np.ndarray
    time_ns: np.ndarray
    details: list | None = None

    def events(self):
        """The entries as :class:`Event` messages, in seq order."""
        # Positional (run, seq, action, phase, attempt, time_ns, detail): a watcher makes
        # one an event, and with keywords each cost about twice as much.
        run, seq, n = self.run, self.seq, len(self.actions)
        det = self.details if self.details is not None else itertools.repeat(None, n)
        return [Event(run, seq + i, a, _PHASE_NAMES[ph], att, t, d)
                for i, (a, ph, att, t, d) in enumerate(zip(
                    self.actions, self.phases.tolist(), self.attempts.tolist(),
                    self.time_ns.tolist(), det, strict=True))]


@_message(MsgType.REGISTER)
class Register(Message):
    """A worker connects: its id, its cluster, the lease slots it offers, and optionally the
    capacity it sees (``{resource: quantity}``) and its node shapes (maps of ``name``,
    ``count``, ``allocatable``). Answered by REGISTERED or ERROR."""

    rid: int
    worker: str
    cluster: str
    slots: int
    capacity: dict | None = None
    node_shapes: list | None = None


@_message(MsgType.HEARTBEAT)
class Heartbeat(Message):
    """Tokens a worker holds (column ``tokens``, ``n x 3`` uint64, at most ``max_tokens``),
    the free capacity it sees in its cluster (``free``) and on nodes of it (``node_free``:
    node name -> quantities, for a cluster with admission = "nodes"); answered by REFUSED
    (possibly empty) echoing ``rid``."""

    rid: int
    tokens: np.ndarray
    free: dict | None = None
    node_free: dict | None = None


@_message(MsgType.REPORT)
class Report(Message):
    """Reports on leases: columns ``tokens`` (``n x 3`` uint64) and ``phases`` (uint8 codes
    of ``engine._codes.PHASES``); ``details`` lists, for the reports that need them
    (failures, cleanup), maps of ``i`` (the row) and ``error_kind``, ``cause``, ``message``,
    ``recoverable``, ``cleanup``. Answered by REFUSED (possibly empty) echoing ``rid``, sent
    once the reports are durable."""

    rid: int
    tokens: np.ndarray
    phases: np.ndarray
    details: list | None = None


@_message(MsgType.BYE)
class Bye(Message):
    """A worker leaves: nothing new is placed on it, its session ends (its leases run on
    until they expire). No answer. With ``drain`` true it only stops taking leases: the
    session stays, so it heartbeats and reports what it holds, and the shard answers REPLY;
    a later BYE (or a REGISTER, which takes leases again) ends the drain."""

    rid: int
    reason: str | None = None
    drain: bool = False


@_message(MsgType.REGISTERED)
class Registered(Message):
    """The answer to REGISTER: the session number, the heartbeat interval and lease time to
    live the worker must keep to (seconds), and the most tokens a HEARTBEAT may carry."""

    rid: int
    worker: str
    session: int
    heartbeat_interval: float
    lease_ttl: float
    max_tokens: int


@_message(MsgType.LEASES)
class Leases(Message):
    """A batch of leases pushed to a worker (the columnar drain, ``engine.DispatchBatch``).
    Columns, one row a lease: ``tokens`` (``n x 3`` uint64), ``kind`` (uint8 LeaseKind),
    ``attempt`` (int32 >= 1), ``group`` (int32 index into ``groups``), ``deadline_ns`` and
    ``queued_deadline_ns`` (int64, -1 = none). Header: ``groups`` (maps of ``run``, the run
    key, ``spec``, the action spec as a map, each spec once a batch, and for a reusable
    action ``env``, the engine's identity of its warm pool), ``names`` (the
    action part of each lease's id: its id is ``groups[group].run + "/" + name``),
    ``inputs`` (the input reference of each lease, or nil; None when no lease has one) and
    ``nodes`` (the node hint of each lease: the node name of each of its pods when its
    cluster has admission = "nodes", or nil; None when no lease has one; docs/nodes.md)."""

    tokens: np.ndarray
    kind: np.ndarray
    attempt: np.ndarray
    group: np.ndarray
    deadline_ns: np.ndarray
    queued_deadline_ns: np.ndarray
    groups: list
    names: list
    inputs: list | None = None
    nodes: list | None = None


@_message(MsgType.REFUSED)
class Refused(Message):
    """Tokens the shard refused (columns ``tokens`` and ``verdicts``, uint8 Verdict codes,
    never OK): the worker stops the attempt behind each. The answer to HEARTBEAT or REPORT
    ``rid`` (an empty one acknowledges it), or pushed unsolicited with ``rid`` None (an
    abort: stop these now)."""

    rid: int | None
    tokens: np.ndarray
    verdicts: np.ndarray


# ---------------------------------------------------------------------------------------------
# Schemas

_NAME = re.compile(r"^[A-Za-z0-9_.-]+\Z")
_NAME_RULE = "a name of letters, digits, '_', '.', '-'"
# engine/_model.py's segment rule, for whole ids and run keys.
_SEG = r"[A-Za-z0-9][A-Za-z0-9_.-]*"
_ACTION_ID = re.compile(rf"^{_SEG}/{_SEG}/{_SEG}/{_SEG}/{_SEG}\Z")
_RUN_KEY = re.compile(rf"^{_SEG}/{_SEG}/{_SEG}/{_SEG}\Z")
_ID_RULE = "an action id tenant/project/domain/run/action"
_RUN_RULE = "a run key tenant/project/domain/run"
_PHASE_NAMES = tuple(p.value for p in Phase)
_N_PHASES = len(PHASES)
_MAX_VERDICT = int(max(Verdict))
_MAX_KIND = int(max(LeaseKind))
_DETAIL_KEYS = frozenset({"i", "error_kind", "cause", "message", "recoverable", "cleanup"})
_SHAPE_KEYS = frozenset({"name", "count", "allocatable"})
_GROUP_KEYS = frozenset({"run", "spec", "env"})


@dataclass(frozen=True, slots=True)
class _Schema:
    cls: type
    fields: tuple          # ((key, check, required), ...)
    columns: tuple = ()    # ((key, dtype, width), ...)
    n_max: int = 0         # most rows of the columns
    n_min: int = 0
    n_limit: str = ""      # the setting named in a TOO_LARGE error
    post: object = None    # cross-field check(msg, limits) -> None, raises SchemaError


def _build_schemas(lim):
    """Every type's schema under the limits ``lim`` (a TransportSettings)."""
    rid = sc.integer(0, sc.MAX_INT)
    opt_rid = sc.optional(rid)
    name = sc.string(lim.max_name, _NAME, _NAME_RULE)
    action = sc.string(lim.max_name, _ACTION_ID, _ID_RULE)
    run = sc.string(lim.max_name, _RUN_KEY, _RUN_RULE)
    text = sc.string(lim.max_text, empty=True)
    spec = sc.spec_map(lim.max_name)
    i64 = sc.integer(-sc.MAX_INT, sc.MAX_INT)

    count = sc.integer(1, sc.MAX_INT)
    row = sc.integer(0, lim.max_batch)
    word = sc.string(64, _NAME, _NAME_RULE)

    def shape(value, key):
        if type(value) is not dict:
            raise SchemaError(f"{key} must be a map (name, count, allocatable)")
        _keys(value, _SHAPE_KEYS, ("count", "allocatable"), key)
        if "name" in value:
            name(value["name"], f"{key}.name")
        count(value["count"], f"{key}.count")
        sc.quantities(value["allocatable"], f"{key}.allocatable")

    def group(value, key):
        if type(value) is not dict:
            raise SchemaError(f"{key} must be a map (run, spec)")
        _keys(value, _GROUP_KEYS, ("run", "spec"), key)
        run(value["run"], f"{key}.run")
        spec(value["spec"], f"{key}.spec")
        if value.get("env") is not None:
            name(value["env"], f"{key}.env")

    def detail(value, key):
        if type(value) is not dict:
            raise SchemaError(f"{key} must be a map (i, error_kind, cause, message, ...)")
        _keys(value, _DETAIL_KEYS, ("i",), key)
        try:    # keys named bare, and the detail's place added only to an error
            row(value["i"], "i")
            for k in ("error_kind", "cause"):
                if value.get(k) is not None:
                    word(value[k], k)
            if value.get("message") is not None:
                text(value["message"], "message")
            for k in ("recoverable", "cleanup"):
                if value.get(k) is not None:
                    sc.boolean(value[k], k)
        except SchemaError as exc:
            raise SchemaError(f"{key}: {exc.text}", exc.code) from None

    def fanout_post(m, lim):
        if m.inputs is not None and len(m.inputs) != len(m.names):
            raise SchemaError(f"'inputs' has {len(m.inputs)} items for {len(m.names)} names")
        # Each action's id (its run, '/', its name) within max_name, as every request that
        # names it must be (STATUS, EXPLAIN, ABORT refused a longer one TOO_LARGE).
        run = m.template["id"].rsplit("/", 1)[0]
        j = long_action_id(run, m.names, lim.max_name)
        if j is not None:
            raise SchemaError(f"'names'[{j}]: the action id is {len(run) + 1 + len(m.names[j])} "
                              f"characters, over the limit {lim.max_name}", "TOO_LARGE")

    def report_post(m, lim):
        n = len(m.phases)
        if n and int(m.phases.max()) >= _N_PHASES:
            bad = int(np.flatnonzero(m.phases >= _N_PHASES)[0])
            raise SchemaError(f"'phases'[{bad}] = {int(m.phases[bad])} is not a phase code "
                              f"(0..{_N_PHASES - 1})")
        if m.details is not None:
            seen = set()
            for j, d in enumerate(m.details):
                i = d["i"]
                if i >= n:
                    raise SchemaError(f"'details'[{j}].i = {i} is not a row (n = {n})")
                if i in seen:
                    raise SchemaError(f"'details'[{j}].i = {i} appears twice")
                seen.add(i)

    def leases_post(m, lim):
        n = len(m.kind)
        if len(m.names) != n:
            raise SchemaError(f"'names' has {len(m.names)} items for {n} leases")
        if m.inputs is not None and len(m.inputs) != n:
            raise SchemaError(f"'inputs' has {len(m.inputs)} items for {n} leases")
        if m.nodes is not None and len(m.nodes) != n:
            raise SchemaError(f"'nodes' has {len(m.nodes)} items for {n} leases")
        if n == 0:
            return
        # Each column's bounds by min and max (a few leases: as lists, no numpy call; an
        # idle round trip's one lease paid ~14 us for five compares and their .any()).
        small = n <= 16
        for key, lo, hi, rule in (
                ("kind", 0, int(_MAX_KIND), f"a lease kind (0..{int(_MAX_KIND)})"),
                ("attempt", 1, None, "an attempt number (>= 1)"),
                ("group", 0, len(m.groups) - 1,
                 f"an index into 'groups' (0..{len(m.groups) - 1})"),
                ("deadline_ns", -1, None, "a time in ns or -1"),
                ("queued_deadline_ns", -1, None, "a time in ns or -1")):
            col = getattr(m, key)
            values = col.tolist() if small else col
            if min(values) < lo if small else int(col.min()) < lo:
                bad = col < lo
            elif hi is not None and (max(values) > hi if small else int(col.max()) > hi):
                bad = col > hi
            else:
                continue
            i = int(np.flatnonzero(bad)[0])
            raise SchemaError(f"{key!r}[{i}] = {int(col[i])} is not {rule}")

    def events_post(m, lim):
        n = len(m.phases)
        if len(m.actions) != n:
            raise SchemaError(f"'actions' has {len(m.actions)} items for {n} events")
        if m.details is not None and len(m.details) != n:
            raise SchemaError(f"'details' has {len(m.details)} items for {n} events")
        if n and int(m.phases.max()) >= len(_PHASE_NAMES):
            i = int(np.flatnonzero(m.phases >= len(_PHASE_NAMES))[0])
            raise SchemaError(f"'phases'[{i}] = {int(m.phases[i])} is not a phase code "
                              f"(0..{len(_PHASE_NAMES) - 1})")
        if n and int(m.attempts.min()) < 0:
            raise SchemaError("'attempts' holds a negative attempt number")

    def refused_post(m, lim):
        v = m.verdicts
        if len(v) and (v.min() == 0 or v.max() > _MAX_VERDICT):    # two reductions
            bad = (v == 0) | (v > _MAX_VERDICT)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise SchemaError(f"'verdicts'[{i}] = {int(v[i])} is not a refusal verdict "
                                  f"(1..{int(_MAX_VERDICT)})")

    tokens = ("tokens", TOKEN_DTYPE, 3)
    batch = "transport.max_batch"
    S = _Schema
    schemas = [
        S(Enqueue, (("rid", rid, True),
                    ("specs", sc.list_of(spec, lim.max_batch, batch), True))),
        S(EnqueueFlyte, (("rid", rid, True),
                         ("requests", sc.binaries(lim.max_frame_bytes, lim.max_batch, batch),
                          True),
                         ("kind", sc.optional(sc.choice(("queue", "actions"))), False))),
        S(EnqueueFanout, (("rid", rid, True), ("template", spec, True),
                          ("names", sc.strings(lim.max_name, lim.max_fanout,
                                               "transport.max_fanout"), True),
                          ("inputs", sc.optional(sc.strings(
                              lim.max_text, lim.max_fanout, "transport.max_fanout",
                              nullable=True)), False)),
          post=fanout_post),
        S(Abort, (("rid", rid, True), ("action", action, True),
                  ("reason", sc.optional(text), False))),
        S(Status, (("rid", rid, True),
                   ("actions", sc.strings(lim.max_name, lim.max_batch, batch, _ACTION_ID,
                                          _ID_RULE), True))),
        S(Explain, (("rid", rid, True), ("action", action, True))),
        S(QueueMetrics, (("rid", rid, True), ("queue", sc.optional(name), False))),
        S(QueueUpdate, (("rid", rid, True), ("queue", name, True),
                        ("changes", sc.plain_map(empty=False), True))),
        S(Watch, (("rid", rid, True), ("run", run, True),
                  ("since", sc.integer(0, sc.MAX_INT), False))),
        S(Unwatch, (("rid", rid, True), ("run", run, True))),
        S(Ping, (("rid", rid, True),)),
        S(Reply, (("rid", rid, True), ("body", sc.plain, False))),
        S(Error, (("rid", opt_rid, True),
                  ("code", sc.string(40, sc.CODE, "an error code (upper-case words)"), True),
                  ("message", text, True))),
        S(Event, (("run", run, True), ("seq", sc.integer(1, sc.MAX_INT), True),
                  ("action", action, True), ("phase", sc.choice(_PHASE_NAMES), True),
                  ("attempt", sc.integer(0, 1 << 31), True), ("time_ns", i64, True),
                  ("detail", sc.optional(text), False))),
        S(Events, (("run", run, True), ("seq", sc.integer(1, sc.MAX_INT), True),
                   ("actions", sc.strings(lim.max_name, lim.max_batch, batch), True),
                   ("details", sc.optional(sc.strings(lim.max_text, lim.max_batch, batch,
                                                      nullable=True)), False)),
          columns=(("phases", np.dtype("u1"), 1), ("attempts", np.dtype("<i4"), 1),
                   ("time_ns", np.dtype("<i8"), 1)),
          n_max=lim.max_batch, n_min=1, n_limit=batch, post=events_post),
        S(Register, (("rid", rid, True), ("worker", name, True), ("cluster", name, True),
                     ("slots", sc.integer(1, 1 << 31), True),
                     ("capacity", sc.optional(sc.quantities), False),
                     ("node_shapes", sc.optional(sc.list_of(shape, 256, "256 node shapes")),
                      False))),
        S(Heartbeat, (("rid", rid, True), ("free", sc.optional(sc.quantities), False),
                      ("node_free", sc.optional(sc.map_of(name, sc.quantities, 4096,
                                                          "4096 nodes")), False)),
          columns=(tokens,), n_max=lim.max_tokens, n_limit="transport.max_tokens"),
        S(Report, (("rid", rid, True),
                   ("details", sc.optional(sc.list_of(detail, lim.max_batch, batch)), False)),
          columns=(tokens, ("phases", np.dtype("u1"), 1)), n_max=lim.max_batch, n_min=1,
          n_limit=batch, post=report_post),
        S(Bye, (("rid", rid, True), ("reason", sc.optional(text), False),
                ("drain", sc.boolean, False))),
        S(Registered, (("rid", rid, True), ("worker", name, True),
                       ("session", sc.integer(0, sc.MAX_INT), True),
                       ("heartbeat_interval", sc.number(), True),
                       ("lease_ttl", sc.number(), True),
                       ("max_tokens", sc.integer(1, sc.MAX_INT), True))),
        S(Leases, (("groups", sc.list_of(group, lim.max_batch, batch), True),
                   ("names", sc.strings(lim.max_name, lim.max_batch, batch), True),
                   ("inputs", sc.optional(sc.strings(lim.max_text, lim.max_batch, batch,
                                                     nullable=True)), False),
                   ("nodes", sc.optional(sc.list_of(
                       sc.optional(sc.strings(lim.max_name, lim.max_batch, batch)),
                       lim.max_batch, batch)), False)),
          columns=(tokens, ("kind", np.dtype("u1"), 1), ("attempt", np.dtype("<i4"), 1),
                   ("group", np.dtype("<i4"), 1), ("deadline_ns", np.dtype("<i8"), 1),
                   ("queued_deadline_ns", np.dtype("<i8"), 1)),
          n_max=lim.max_batch, n_min=1, n_limit=batch, post=leases_post),
        S(Refused, (("rid", opt_rid, True),),
          columns=(tokens, ("verdicts", np.dtype("u1"), 1)), n_max=lim.max_batch,
          n_limit=batch, post=refused_post),
    ]
    return {s.cls.TYPE: s for s in schemas}


def _keys(table, allowed, required, where):
    extra = table.keys() - allowed
    if extra:
        raise SchemaError(f"{where}: unknown key(s) {', '.join(sorted(map(repr, extra)))}")
    for k in required:
        if k not in table:
            raise SchemaError(f"{where}: missing key {k!r}")


# ---------------------------------------------------------------------------------------------
# Decoding


# Headers up to this size unpack with msgpack's defaults (strict map keys, str as str, and
# every length bounded by the buffer's): at most this many objects. ExtType and Timestamp
# objects they may hold are refused by the schema checks like any other wrong type.
_SMALL_HEADER = 4096


def _refuse_ext(code, data):
    raise ValueError(f"msgpack extension type {code} is not allowed")


def _buffer(frame):
    """A frame's bytes as a 1-D byte buffer, without a copy."""
    if type(frame) is bytes:
        return frame
    view = memoryview(frame)        # a zmq.Frame's buffer, cheaper than Frame.buffer
    if view.ndim != 1 or view.format != "B":
        if not view.nbytes:
            return b""          # memoryview cannot cast an empty shape
        view = view.cast("B")
    return view


class Decoder:
    """Decodes messages under one set of limits (a ``TransportSettings``; the defaults
    when None). Stateless: one decoder may serve every socket of a process."""

    __slots__ = ("limits", "_schemas", "_unpack_kw", "_by_byte")

    def __init__(self, limits=None):
        self.limits = limits if limits is not None else TransportSettings()
        self._schemas = _build_schemas(self.limits)
        lim = self.limits
        most = max(lim.max_batch, lim.max_fanout, lim.max_tokens)
        # The bounds of a large header (past _SMALL_HEADER): no list or map longer than a
        # valid header can hold, so a few MiB cannot expand into millions of objects;
        # extension types refused at once (bytes and timestamps decode, and the schema
        # refuses them by name).
        self._unpack_kw = dict(raw=False, strict_map_key=True, use_list=True,
                               ext_hook=_refuse_ext, max_str_len=lim.max_header_bytes,
                               max_bin_len=lim.max_header_bytes, max_array_len=most,
                               max_map_len=most, max_ext_len=64)
        # Frame 0's byte -> what decoding it needs, looked up once a message.
        self._by_byte = [None] * 256
        for t, sch in self._schemas.items():
            keys = frozenset(k for k, _c, _r in sch.fields) | ({"n"} if sch.columns else set())
            cols = tuple((key, dtype, width, dtype.itemsize * width)
                         for key, dtype, width in sch.columns)
            self._by_byte[VERSION << _VERSION_SHIFT | t] = (t, sch, keys, cols)

    def decode(self, frames):
        """The message in ``frames`` (a list of ``zmq.Frame``, bytes or buffers: the frames
        after the routing id). Raises :class:`ProtocolError` on anything else."""
        lim = self.limits
        try:
            count = len(frames)
            if count > lim.max_frames:
                raise ProtocolError("TOO_LARGE", f"too many frames: {count} > "
                                                 f"{lim.max_frames} (transport.max_frames)")
            if count < 2:
                raise ProtocolError("BAD_MESSAGE", f"a message has at least 2 frames (type "
                                                   f"byte, header), this one has {count}")
            bufs = [_buffer(f) for f in frames]
        except (TypeError, ValueError) as exc:
            raise ProtocolError("BAD_MESSAGE", f"not a list of byte frames: {exc}") from None
        head = bufs[0]
        if len(head) != 1:
            raise ProtocolError("BAD_MESSAGE", f"frame 0 must be 1 byte (version and type), "
                                               f"it is {len(head)} bytes")
        entry = self._by_byte[head[0]]
        if entry is None:
            raise _bad_type_byte(head[0])
        mtype, schema, keys, cols = entry
        raw = bufs[1]
        if len(raw) > lim.max_header_bytes:
            raise ProtocolError("TOO_LARGE", f"{mtype.name} header of {len(raw)} bytes > "
                                             f"{lim.max_header_bytes} (transport.max_header_bytes)",
                                type=mtype)
        try:
            # msgpack 1.x's defaults bound every length by the buffer's own, and a small
            # header cannot expand far: the explicit bounds are for the large ones.
            header = (msgpack.unpackb(raw) if len(raw) <= _SMALL_HEADER
                      else msgpack.unpackb(raw, **self._unpack_kw))
        except Exception as exc:    # msgpack raises several kinds on malformed input
            raise ProtocolError("BAD_MESSAGE", f"{mtype.name} header is not valid msgpack: "
                                               f"{type(exc).__name__}: {exc}",
                                type=mtype) from None
        if type(header) is not dict:
            raise ProtocolError("BAD_MESSAGE", f"{mtype.name} header must be a map, not "
                                               f"{sc.kind_of(header)}", type=mtype)
        try:
            return self._fields(mtype, schema, keys, cols, header, bufs)
        except SchemaError as exc:
            rid = header.get("rid")
            if type(rid) is not int or not 0 <= rid <= sc.MAX_INT:
                rid = None
            raise ProtocolError(exc.code, f"{mtype.name}: {exc.text}", rid=rid,
                                type=mtype) from None

    def _fields(self, mtype, schema, keys, cols, header, bufs):
        if not keys.issuperset(header):
            extra = sorted(map(repr, header.keys() - keys))
            raise SchemaError(f"unknown key(s) {', '.join(extra)} in the header")
        values = {}
        for key, check, required in schema.fields:
            if key in header:
                values[key] = check(header[key], key)
            elif required:
                raise SchemaError(f"missing key {key!r}")
        if len(bufs) != 2 + len(cols):
            names = ", ".join(["type byte", "header"] + [c[0] for c in cols])
            raise SchemaError(f"{len(bufs)} frames; it takes {2 + len(cols)} ({names})")
        if cols:
            n = header.get("n")
            if type(n) is not int:
                raise SchemaError("missing key 'n' (rows of the columns)" if n is None else
                                  f"'n' must be an integer, not {sc.kind_of(n)}")
            if n > schema.n_max:
                what = "tokens" if mtype == MsgType.HEARTBEAT else "rows"
                raise SchemaError(f"too many {what}: {n} > {schema.n_max} ({schema.n_limit})",
                                  "TOO_LARGE")
            if n < schema.n_min:
                raise SchemaError(f"'n' = {n}; at least {schema.n_min}")
            max_frame = self.limits.max_frame_bytes
            i = 2
            for key, dtype, width, row in cols:
                buf = bufs[i]
                i += 1
                size = len(buf)
                if size != n * row:
                    if size > max_frame:
                        raise SchemaError(f"{key!r} frame of {size} bytes > {max_frame} "
                                          f"(transport.max_frame_bytes)", "TOO_LARGE")
                    what = (f"not a multiple of {row}" if size % row else
                            f"{size // row} rows, not n = {n}")
                    raise SchemaError(f"{key!r} frame of {size} bytes is {what} "
                                      f"({row} bytes a row)")
                if size > max_frame:
                    raise SchemaError(f"{key!r} frame of {size} bytes > {max_frame} "
                                      f"(transport.max_frame_bytes)", "TOO_LARGE")
                arr = np.frombuffer(buf, dtype=dtype)
                if width > 1:
                    arr = arr.reshape(n, width)
                if not arr.flags.aligned:
                    arr = arr.copy()    # ZeroMQ gives no alignment guarantee; kernels want it
                    arr.flags.writeable = False
                values[key] = arr
        msg = schema.cls(**values)
        if schema.post is not None:
            schema.post(msg, self.limits)
        return msg


def _bad_type_byte(byte):
    version = byte >> _VERSION_SHIFT
    if version != VERSION:
        return ProtocolError("BAD_VERSION", f"protocol version {version} is not supported "
                                            f"(this side speaks {VERSION})")
    return ProtocolError("UNKNOWN_TYPE", f"unknown message type {byte & _TYPE_MASK}")


_DEFAULT = Decoder()


def decode(frames, limits=None):
    """:meth:`Decoder.decode` under ``limits`` (the defaults when None; a shard keeps one
    :class:`Decoder` for its configured limits instead)."""
    return (_DEFAULT if limits is None else Decoder(limits)).decode(frames)


# ---------------------------------------------------------------------------------------------
# Encoding

_FRAME0 = {t: bytes([VERSION << _VERSION_SHIFT | t]) for t in MsgType}
_ENCODE = {}
for _s in _DEFAULT._schemas.values():
    _ENCODE[_s.cls] = (_FRAME0[_s.cls.TYPE], tuple((k, r) for k, _c, r in _s.fields),
                       _s.columns)
del _s


def tokens_array(tokens):
    """Tokens as a C-contiguous ``n x 3`` little-endian uint64 array, from bytes (n x 24), a
    list of 24-byte tokens, or an ``n x 3`` array."""
    if isinstance(tokens, np.ndarray):
        arr = np.ascontiguousarray(tokens, dtype=TOKEN_DTYPE)
        return arr.reshape(-1, 3) if arr.ndim != 2 else arr
    if isinstance(tokens, (list, tuple)):
        tokens = b"".join(bytes(t) for t in tokens)
    buf = memoryview(tokens).cast("B")
    if len(buf) % 24:
        raise ValueError(f"a token buffer of {len(buf)} bytes is not whole 24-byte tokens")
    return np.frombuffer(buf, dtype=TOKEN_DTYPE).reshape(-1, 3)


#: What an ALREADY_EXISTS answer to a worker's request says when another connection has
#: registered its worker name since (the shard says it, the worker acts on it).
DISPLACED = "registered by another connection"


def clip_text(text, limit):
    """``text`` cut to ``limit`` characters (``transport.max_text``), its end marked: what a
    peer would otherwise refuse whole as over its limit (an error naming a long input, a
    plugin's long message)."""
    if text is None or len(text) <= limit:
        return text
    return text[:max(0, limit - 1)] + "\u2026"


def encode(msg):
    """``msg`` as a list of frames (bytes and numpy arrays) for
    ``socket.send_multipart(frames, copy=False)``: the arrays go out without a copy (do not
    change them until the send is done). Fields that are None are left out of the header.
    Raises ``TypeError`` for a value msgpack cannot carry."""
    frame0, keys, cols = _ENCODE[type(msg)]
    header = {}
    for key, required in keys:
        value = getattr(msg, key)
        if value is not None or required:
            header[key] = value
    try:
        packed = msgpack.packb(header, use_bin_type=True)
    except OverflowError:
        raise OverflowError(_too_big(header, "")) from None
    if not cols:
        return [frame0, packed]
    arrays = []
    for key, dtype, width in cols:
        value = getattr(msg, key)
        if width == 3:
            arr = tokens_array(value)
        else:
            arr = np.ascontiguousarray(value, dtype=dtype).reshape(-1)
        arrays.append(arr)
    n = header["n"] = int(arrays[0].shape[0])
    if not n:
        arrays = [b""] * len(arrays)
    return [frame0, msgpack.packb(header, use_bin_type=True), *arrays]


def long_action_id(run, names, limit):
    """The index of the first of ``names`` whose action id (``run``, '/', the name) is over
    ``limit`` characters, or None (one C-level pass over the names when none is)."""
    room = limit - len(run) - 1
    if max(map(len, names), default=0) <= room:
        return None
    return next(j for j, n in enumerate(names) if len(n) > room)


def spec_map(spec):
    """An action spec as ENQUEUE carries it: a map as given, or an ``ActionSpec``'s fields
    as plain data (its unset ones left out)."""
    if isinstance(spec, dict):
        return spec
    if not dataclasses.is_dataclass(spec) or isinstance(spec, type):
        raise SpecError(f"a spec is an ActionSpec or a map, not {type(spec).__name__}")
    d = dataclasses.asdict(spec)
    return {k: v for k, v in d.items() if v is not None}


def encode_request(msg, what, settings=None):
    """:func:`encode` of a request this side makes (``what`` names it): a value msgpack
    cannot carry (an integer past 64 bits, an object that is not plain data) is the caller's
    input, refused as ``SpecError`` (INVALID_ARGUMENT) naming it; so is, with ``settings``
    (the transport limits the peer shares), a frame over its limit, which the peer would
    drop with the connection, unanswered (the request timed out instead)."""
    try:
        frames = encode(msg)
    except (OverflowError, TypeError, ValueError) as exc:
        raise SpecError(f"{what}: cannot be sent: {exc}") from None
    if settings is not None:
        header = len(frames[1])
        if header > settings.max_header_bytes:
            raise SpecError(f"{what}: cannot be sent: its header is {header} bytes, over the "
                            f"limit {settings.max_header_bytes} (transport.max_header_bytes): "
                            f"send it in smaller requests")
        for f in frames[2:]:
            n = memoryview(f).nbytes
            if n > settings.max_frame_bytes:
                raise SpecError(f"{what}: cannot be sent: a frame of {n} bytes, over the "
                                f"limit {settings.max_frame_bytes} "
                                f"(transport.max_frame_bytes): send it in smaller requests")
    return frames


def _too_big(value, path):
    """What msgpack's "Integer value out of range" was about: the path of the first integer
    of ``value`` that does not fit 64 bits, and the integer."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        if isinstance(value, int) and not -(1 << 63) <= value < (1 << 64):
            return f"{path or 'a value'} = {value} does not fit in 64 bits"
        return None
    for key, item in items:
        sub = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
        found = _too_big(item, sub)
        if found is not None:
            return found
    return None if path else "an integer does not fit in 64 bits"
