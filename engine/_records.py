"""The durable records of a shard: fixed-size numpy records for actions and finalize leases
(reload is a bulk copy into the kernel's arrays) and msgpack records for the Python edges
(specs, an action's outcome and attempt history, runs, environments, workers).

Keys are big-endian row numbers (8 bytes), so a cursor scan is in row order. The partition
of every record is its tenant's (:func:`storage.partition_of`); shard-wide records (the
layout, the token secret, worker names) live in partition 0.
"""

import dataclasses
from datetime import timedelta
from hashlib import blake2b

import msgpack
import numpy as np

from cext._digest import name_hashes as _c_name_hashes
from engine._leases import Attempt
from engine._model import ActionSpec

__all__ = [
    "ATTEMPT_FIELDS",
    "action_dtype",
    "action_columns",
    "finalize_columns",
    "ACTION_RECORD_DERIVED",
    "FINALIZE_RECORD_DERIVED",
    "FINALIZE_DTYPE",
    "row_key",
    "digest8",
    "name_hash",
    "name_hashes",
    "encode_spec",
    "decode_spec",
    "same_spec",
    "spec_content",
    "decode_content",
    "encode_outcome",
    "decode_outcome",
    "LAYOUT_KEY",
    "SECRET_KEY",
]

# Shard-wide records in partition 0's meta database (not the store's reserved keys).
LAYOUT_KEY = b"engine-layout"
SECRET_KEY = b"engine-secret"

#: The fields of an attempt in the order an outcome record lists them.
ATTEMPT_FIELDS = tuple(f.name for f in dataclasses.fields(Attempt))


def action_dtype(n_res, n_pods=0):
    """The fixed record of one action row for a shard with ``n_res`` resources, and
    ``n_pods`` placement entries when a cluster places pods on nodes (``State.node_pods``:
    ``engine.max_node_pods``, else 0 and the record has no placement).

    Everything the tick, the timers and the lease checks need; nothing derived (lanes,
    counters, (queue, run) pairs and pool state are rebuilt at reload)."""
    pnode = [("pnode", "<i4", (n_pods,))] if n_pods else []   # node of each pod, -1 none
    return np.dtype([
        ("row", "<i8"),           # the row (also its key: reload reads values only)
        ("state", "u1"),          # RowState
        ("end", "u1"),            # LeaseEnd of the current generation
        ("charged", "u1"),        # demand charged to queue and cluster (not a pool member)
        ("part", "u1"),           # partition (the tenant's)
        ("queue", "<i4"),         # queue index in the layout's queue list
        ("run", "<i4"),           # run row
        ("env", "<i4"),           # environment row, -1 if not reusable
        ("cluster", "<i4"),       # cluster index of the current lease, -1
        ("holder", "<i4"),        # worker identity holding the current lease, -1
        ("parent", "<i4"),        # parent action row, -1
        ("attempt", "<i4"),       # current attempt number (from 1)
        ("fast", "<i4"),          # 1 when it was queued on its warm pool's fast lane
        ("task", "<i4"),          # history key row (task name, shape)
        ("backfilled", "<i4"),    # 1 when the current generation was placed by backfill
        ("fit", "<u8"),           # clusters it could ever fit (bitmask)
        ("gen", "<i8"),           # lease generation (monotonic)
        ("released_gen", "<i8"),  # generation whose in-flight counts were released
        ("delivered_gen", "<i8"),  # generation handed to the dispatcher (drain_dispatch)
        ("enqueued", "<i8"),      # first enqueue (ns)
        ("deadline_due", "<i8"),  # absolute timer dues (ns; NEVER when none)
        ("queued_due", "<i8"),
        ("retry_due", "<i8"),
        ("runtime_due", "<i8"),
        ("name_hash", "<u8"),     # hash of the action id (index at reload)
        ("pred_end", "<i8"),      # predicted end of the live lease (ns; NEVER unknown)
        ("group", "<i8"),         # enqueue group (shared spec and names)
        ("gidx", "<i4"),          # index in the group
        ("lean", "u1"),           # 1: this record is the whole outcome (no attempts record)
        ("phase", "u1"),          # phase code (engine._codes.PHASES) of a lean row
        ("pad", "u2"),
        ("start", "<i8"),         # lean: assignment of its attempt (NEVER: not yet)
        ("running", "<i8"),       # lean: first RUNNING report
        ("done", "<i8"),          # lean: end of its attempt
        ("abort", "<i8"),         # lean ABORTED: the row whose abort ended it (its reason)
        ("seq", "<i8"),           # enqueue order: FIFO at reload (rows are reused)
        ("est_rt", "<i8"),        # the spec's runtime_estimate (ns; NEVER none)
        ("max_rt", "<i8"),        # the spec's max_runtime (ns; NEVER none)
        ("demand", "<i8", (n_res,)),  # total demand (the pool footprint when reusable)
    ] + pnode)


#: Fields of the action record that are not a column copied as is: the row (its key), the
#: holder's durable identity (a_worker mapped through w_ident), the fast-lane bit (a_lane & 1)
#: and padding. Every other field ``f`` is the column ``a_<f>`` (engine/_state.py).
ACTION_RECORD_DERIVED = ("row", "holder", "fast", "pad")


def action_columns(n_res, n_pods=0):
    """The record fields that are action columns copied as is (``a_<field>``), derived from
    :func:`action_dtype`: what reload scatters into the columns."""
    return tuple(f for f in action_dtype(n_res, n_pods).names
                 if f not in ACTION_RECORD_DERIVED)


#: Fields of the finalize record that are not a column copied as is (``fz_<field>``).
FINALIZE_RECORD_DERIVED = ("row", "pad", "pref", "holder")


FINALIZE_DTYPE = np.dtype([
    ("row", "<i8"),          # the finalize row (also its key)
    ("state", "u1"),
    ("end", "u1"),
    ("outcome", "u1"),       # how it ended (engine._rows.FZ_OUTCOMES), 0 while it has not
    ("pad", "u1"),
    ("action", "<i4"),       # action row
    ("cluster", "<i4"),
    ("pref", "<i4"),         # worker identity it prefers (the attempt's)
    ("holder", "<i4"),       # worker identity holding it, -1
    ("attempt", "<i4"),      # attempt number it cleans up
    ("gen", "<i8"),
    ("released_gen", "<i8"),
    ("delivered_gen", "<i8"),
    ("give_up", "<i8"),      # its own bound (ns)
])


def finalize_columns():
    """The finalize record fields copied as is into ``fz_<field>``."""
    return tuple(f for f in FINALIZE_DTYPE.names if f not in FINALIZE_RECORD_DERIVED)


def row_key(row):
    """The key of a row: 8 bytes big-endian."""
    return int(row).to_bytes(8, "big")


def digest8(text):
    """The 8-byte blake2b digest of ``text``: name hashes and retained-outcome keys."""
    return blake2b(text.encode(), digest_size=8).digest()


def name_hash(text):
    """64-bit hash of an action id's text (the reload index; verified on lookup)."""
    return int.from_bytes(digest8(text), "little")


def name_hashes(texts):
    """:func:`name_hash` of each of ``texts`` (a list of ``str``), as a uint64 array: hashed
    in one C loop (``cext._digest``, the same BLAKE2b; a fan-out hashes thousands)."""
    return _c_name_hashes(texts)


def _default(value):
    # Nested declarations (pod groups, reuse, retries, timeouts) as their field tables;
    # durations given as timedelta as seconds (what the spec checks accept).
    if isinstance(value, timedelta):
        return value.total_seconds()
    if dataclasses.is_dataclass(value):
        return dict(value.__dict__)
    raise TypeError(f"cannot store {type(value).__name__} in an action spec")


def encode_spec(spec):
    """An :class:`ActionSpec` as msgpack (its plain-data form)."""
    return msgpack.packb(spec.__dict__, default=_default, use_bin_type=True)


def _run_content(data, default=None):
    # A spec's fields (a mapping) packed with its id cut to its run: raises TypeError or
    # ValueError for what msgpack cannot carry.
    aid = data.get("id")
    return msgpack.packb({**data, "id": aid.rsplit("/", 1)[0] if isinstance(aid, str) else aid},
                         default=default, use_bin_type=True)


def spec_content(spec):
    """What two specs of one run must share to be compiled and stored once: everything but
    the action name (bytes; specs of different runs never share it)."""
    try:
        return _run_content(spec.__dict__, _default)
    except (TypeError, ValueError):
        return None     # not plain data: compile_spec words the error


def dict_content(data):
    """:func:`spec_content` of a spec given as plain data (a dict, as read off the wire),
    without building the spec: two dicts with equal bytes here are the same declaration but
    for the action name. ``None`` when it cannot be packed or its id is not a string."""
    if not isinstance(data.get("id"), str):
        return None
    try:
        return b"d" + _run_content(data)
    except (TypeError, ValueError):
        return None


def decode_content(raw, name):
    """The :class:`ActionSpec` of :func:`spec_content` output for action ``name``."""
    data = msgpack.unpackb(raw, raw=False)
    data["id"] = f"{data['id']}/{name}"
    return ActionSpec.from_dict(data)


def same_spec(old, spec):
    """Whether two specs are the same declaration. A restored spec comes back in its stored
    form (pods a tuple): the stored forms are compared when the objects differ."""
    return old == spec or decode_spec(encode_spec(old)) == decode_spec(encode_spec(spec))


def decode_spec(raw):
    """The :class:`ActionSpec` of :func:`encode_spec` output."""
    return ActionSpec.from_dict(msgpack.unpackb(raw, raw=False))


def encode_outcome(rec):
    """The Python side of an action (phase, outcome, retries, attempts) as msgpack."""
    return msgpack.packb([
        rec.phase.value, rec.message, rec.error_kind, rec.cause, rec.user_retries,
        rec.system_retries, [[getattr(a, f) for f in ATTEMPT_FIELDS] for a in rec.attempts],
    ], use_bin_type=True)


def decode_outcome(raw):
    """``(phase, message, error_kind, cause, user_retries, system_retries, attempts)``."""
    phase, message, kind, cause, ur, sr, atts = msgpack.unpackb(raw, raw=False)
    attempts = [Attempt(**dict(zip(ATTEMPT_FIELDS, a, strict=True))) for a in atts]
    return phase, message, kind, cause, ur, sr, attempts
