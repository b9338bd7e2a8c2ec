"""The shard's status in shared memory (``docs/status.md``): written only by its shard, read by
anyone (supervisor, CLI, metrics) without a message to the shard and without blocking it.

One file per shard, ``<status.dir>/shard-N.status`` (default ``<storage.path>/run``), mapped
with ``mmap`` by the writer and by every reader. Its layout is declared once, below, as field
lists; every numpy dtype, offset and size is derived from them and from three numbers fixed
when the file is made (resources, queue slots, clusters) plus the width of names. The
preamble carries a magic, a version and a hash of the whole declaration, so a reader built
from another layout refuses the file instead of misreading it.

Consistency is a seqlock: the writer fills a private staging copy of the body, makes the
sequence odd, copies the staging bytes into the mapping (one memcpy), makes the sequence even.
A reader reads the sequence, copies the body, reads the sequence again, and keeps the copy only
when both reads are the same even number; otherwise it retries, for a bounded time, then
raises :class:`StatusBusy`. Memory ordering: the sequence is an aligned 8-byte word, each
store of it and the body copy are separate C calls the compiler cannot reorder, and x86-64
(TSO) keeps stores in program order and loads in program order, which is all a seqlock needs.
On a weakly ordered CPU (ARM, POWER) that does not hold without fences, which Python cannot
issue: :class:`StatusWriter` logs a warning once there (docs/status.md).
"""

import bisect
import contextlib
import dataclasses
import hashlib
import logging
import mmap
import os
import platform
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine._codes import RowState, Verdict, WaitCode
from engine._errors import LeaseholdError
from engine._units import UNLIMITED
from transport._protocol import ERROR_CODES

__all__ = [
    "StatusWriter",
    "StatusReader",
    "StatusSnapshot",
    "QueueStatus",
    "ClusterStatus",
    "HeadBlocked",
    "Histogram",
    "StatusError",
    "StatusLayoutError",
    "StatusBusy",
    "status_path",
    "snapshot_dict",
    "LAYOUT_VERSION",
    "TICK_EDGES_US",
    "COMMIT_EDGES_US",
    "WAIT_EDGES_US",
    "WAIT_REASONS",
]

log = logging.getLogger("leasehold.status")

# ------------------------------------------------------------------------------------ layout
# Everything below this line and above "derived" is the layout: change any of it and the hash
# changes, so old readers refuse new files (and the other way round). Bump LAYOUT_VERSION too.

LAYOUT_VERSION = 5
MAGIC = b"LHSTATUS"

#: Upper bounds (microseconds) of the histogram buckets; one more bucket holds the rest (+Inf).
TICK_EDGES_US = (10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000,
                 100_000, 250_000, 1_000_000)
COMMIT_EDGES_US = (100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000,
                   250_000, 1_000_000, 5_000_000)
# Queue wait: enqueue of the attempt to its assignment (the lease leaving the shard).
WAIT_EDGES_US = (10_000, 50_000, 100_000, 500_000, 1_000_000, 5_000_000, 10_000_000, 30_000_000,
                 60_000_000, 300_000_000, 900_000_000, 3_600_000_000, 14_400_000_000,
                 86_400_000_000)
#: The queue wait's reasons: every WaitCode, by value. A run lease's wait is counted under the
#: code that held its action just before the tick that placed it (DispatchBatch.wait_code:
#: what Engine.explain said then), NONE when no tick held it (docs/status.md, "reason").
WAIT_REASONS = tuple(c.name for c in WaitCode)

#: The shard loop's counters copied into every snapshot (``transport.Shard.counters`` keys).
SHARD_COUNTERS = ("received", "replies", "errors", "protocol_errors", "refused_auth",
                  "unauthenticated", "exhausted", "leases_pushed", "leases_unsent", "events",
                  "events_unsent", "turns", "failed_commits", "ticks", "stops_pushed",
                  "stops_unsent", "store_commits", "handshakes_accepted", "handshakes_refused",
                  "decide_ns", "commit_ns", "send_ns", "watch_ns", "status_ns",
                  "recheck_turns", "recheck_turn_ns", "recheck_ns", "recheck_reads")
VERDICTS = tuple(v.name for v in Verdict)           # refusal counts by Verdict value
ERROR_KINDS = (*ERROR_CODES, "OTHER")               # ERROR replies by wire code
STATES = ("starting", "running", "stopped")         # the shard record's ``state``
SPARE_QUEUES = 8        # queue slots beyond the config's (a live added queue fits in place)
TEXT_BYTES = 256        # head action id and reason: UTF-8, cut to this many bytes
MIN_NAME_BYTES = 64     # names (queues, clusters, resources): at least this wide

# Field lists: (name, dtype, shape). dtype "name" is a name field (S<name_bytes>); a shape
# entry "R" is the number of resources.
PREAMBLE_FIELDS = (         # written once, before the file is visible; never seqlocked
    ("magic", "S8", ()),                # offsets of magic, version, layout_hash never change
    ("version", "<u4", ()),
    ("preamble_bytes", "<u4", ()),
    ("layout_hash", "S16", ()),
    ("seq", "<u8", ()),                 # the seqlock: odd while the writer copies the body
    ("file_bytes", "<u8", ()),
    ("body_offset", "<u8", ()),
    ("n_resources", "<u4", ()),
    ("queue_slots", "<u4", ()),
    ("n_clusters", "<u4", ()),
    ("name_bytes", "<u4", ()),
    ("shard_index", "<u4", ()),
    ("pid", "<u4", ()),
    ("start_ns", "<i8", ()),            # wall clock, when the writer made the file
)
SHARD_FIELDS = (
    ("generation", "<u8", ()),          # publishes so far; every record below carries it too
    ("state", "u1", ()),                # index into STATES
    ("n_queues", "<u4", ()),            # queue slots in use
    ("published_ns", "<i8", ()),        # wall clock of this publish
    ("engine_now_ns", "<i8", ()),       # the engine's clock at this publish (heads' times)
    ("last_turn_ns", "<i8", ()),        # wall clock of the end of the last loop turn (0: none)
    ("reload_ns", "<i8", ()),           # how long the engine took to load from the store
    ("tick_no", "<u8", ()),             # the engine's ticks
    ("dispatches", "<u8", ()),          # leases handed out (after their commit), both kinds
    ("commits", "<u8", ()),             # store group commits
    ("commit_failures", "<u8", ()),     # store group commits that raised
    ("counters", "<u8", (len(SHARD_COUNTERS),)),
    ("heartbeat_refusals", "<u8", (len(VERDICTS),)),
    ("report_refusals", "<u8", (len(VERDICTS),)),
    ("errors", "<u8", (len(ERROR_KINDS),)),
    ("tick_counts", "<u8", (len(TICK_EDGES_US) + 1,)),
    ("tick_sum_ns", "<u8", ()),
    ("commit_counts", "<u8", (len(COMMIT_EDGES_US) + 1,)),
    ("commit_sum_ns", "<u8", ()),
    ("resource_names", "name", ("R",)),
)
QUEUE_FIELDS = (
    ("generation", "<u8", ()),
    ("name", "name", ()),
    ("priority", "<i8", ()),
    ("strict", "u1", ()),               # STRICT_FIFO
    ("action_concurrency", "<i8", ()),  # 0: unlimited
    ("run_concurrency", "<i8", ()),     # 0: unlimited
    ("paused", "u1", ()),               # the tick places nothing from it (live flag)
    ("draining", "u1", ()),             # it takes no new actions (live flag)
    ("depth", "<i8", ()),               # queued actions
    ("actions_in_flight", "<i8", ()),
    ("runs_in_flight", "<i8", ()),
    ("in_flight_resources", "<i8", ("R",)),
    ("dispatched", "<u8", ()),          # leases of this queue handed out, both kinds
    ("backfilled", "<u8", ()),          # placements by EASY backfill
    ("head_blocked", "u1", ()),         # the head is queued: the fields below describe it
    ("head_code", "u1", ()),            # its WaitCode
    ("head_since_ns", "<i8", ()),       # engine clock: since this action is the head
    ("head_eta_ns", "<i8", ()),         # engine clock: its estimated start; -1 unknown
    ("head_action", f"S{TEXT_BYTES}", ()),
    ("head_reason", f"S{TEXT_BYTES}", ()),
    ("wait_counts", "<u8", (len(WAIT_REASONS), len(WAIT_EDGES_US) + 1)),    # [reason, bucket]
    ("wait_sum_ns", "<u8", (len(WAIT_REASONS),)),
)
CLUSTER_FIELDS = (
    ("generation", "<u8", ()),
    ("name", "name", ()),
    ("capacity", "<i8", ("R",)),        # UNLIMITED (2**62): unknown or no limit
    ("in_flight_resources", "<i8", ("R",)),
    ("free", "<i8", ("R",)),            # the gate: capacity less in flight, capped by workers
    ("leases_in_flight", "<i8", ()),    # leases held by its workers (run and finalize)
    ("workers_connected", "<i8", ()),
    ("slots", "<i8", ()),               # slots of its connected workers
    ("dispatched", "<u8", ()),          # leases placed on it, both kinds
)

# ----------------------------------------------------------------------------------- derived


def _layout_hash():
    text = repr((LAYOUT_VERSION, MAGIC, PREAMBLE_FIELDS, SHARD_FIELDS, QUEUE_FIELDS,
                 CLUSTER_FIELDS, TICK_EDGES_US, COMMIT_EDGES_US, WAIT_EDGES_US, WAIT_REASONS,
                 SHARD_COUNTERS, VERDICTS, ERROR_KINDS, STATES, TEXT_BYTES))
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


LAYOUT_HASH = _layout_hash()


def _dtype(fields, n_res, name_bytes):
    out = []
    for name, dt, shape in fields:
        dt = f"S{name_bytes}" if dt == "name" else dt
        shape = tuple(n_res if s == "R" else s for s in shape)
        out.append((name, dt, shape) if shape else (name, dt))
    return np.dtype(out, align=True)


PREAMBLE = _dtype(PREAMBLE_FIELDS, 0, 0)
_PREAMBLE_BYTES = 128       # the body starts here (cache-line aligned)
assert PREAMBLE.itemsize <= _PREAMBLE_BYTES
_SEQ = PREAMBLE.fields["seq"][1]
assert _SEQ % 8 == 0        # an aligned 8-byte word: one store, one load
_SEQ_WORD = struct.Struct("<Q")
_FIXED = struct.Struct("<8sII16s")      # magic, version, preamble bytes, hash: never moves

_US = 1000
_TICK_EDGES_NS = [e * _US for e in TICK_EDGES_US]
_COMMIT_EDGES_NS = [e * _US for e in COMMIT_EDGES_US]
_WAIT_EDGES_NS = np.array([e * _US for e in WAIT_EDGES_US], dtype=np.int64)
_VERDICT_INDEX = {v: i for i, v in enumerate(Verdict)}
# A wait code is its reason's index (the fold indexes the counts with the batch's codes).
assert [int(c) for c in WaitCode] == list(range(len(WAIT_REASONS))), \
    "WaitCode values must be 0..n-1 for the status file's wait reasons"
_ERROR_INDEX = {k: i for i, k in enumerate(ERROR_KINDS)}
_QUEUED = int(RowState.QUEUED)
_WAIT_FIELDS = ("wait_counts", "wait_sum_ns")     # decoded apart (by reason) in snapshot()
_EXPLAIN_EVERY_NS = 1_000_000_000   # a head's reason text and ETA are re-read at most this often
_EXPLAIN_BUDGET_NS = 100_000        # ... and for at most this long per publish (then the next)


class _Layout:
    """The dtypes and sizes of one file, from its three counts and its name width."""

    def __init__(self, n_res, queue_slots, n_clusters, name_bytes):
        self.n_res, self.queue_slots = int(n_res), int(queue_slots)
        self.n_clusters, self.name_bytes = int(n_clusters), int(name_bytes)
        self.shard = _dtype(SHARD_FIELDS, self.n_res, self.name_bytes)
        self.queue = _dtype(QUEUE_FIELDS, self.n_res, self.name_bytes)
        self.cluster = _dtype(CLUSTER_FIELDS, self.n_res, self.name_bytes)
        self.body = np.dtype([("shard", self.shard), ("queues", self.queue, (self.queue_slots,)),
                              ("clusters", self.cluster, (self.n_clusters,))], align=True)
        self.body_offset = _PREAMBLE_BYTES
        self.file_bytes = self.body_offset + self.body.itemsize


def _name_width(names):
    longest = max((len(n.encode()) for n in names), default=0)
    return max(MIN_NAME_BYTES, (longest + 15) // 16 * 16)


def _text(value, limit=TEXT_BYTES):
    """UTF-8 of ``value`` cut to ``limit`` bytes at a character boundary."""
    raw = value.encode()
    if len(raw) <= limit:
        return raw
    return raw[:limit].decode(errors="ignore").encode()


def _discard(tmp):
    # Remove a temporary file after a failure; it may never have been made (the directory
    # itself failed), and the failure being reported is the first one, not this.
    with contextlib.suppress(OSError):
        tmp.unlink()


def status_path(config, shard_index):
    """Where shard ``shard_index`` of ``config`` keeps its status file:
    ``<status.dir>/shard-N.status``, ``status.dir`` defaulting to ``<storage.path>/run``."""
    base = config.status.dir if config.status.dir is not None else \
        os.path.join(config.storage.path, "run")
    return Path(base) / f"shard-{int(shard_index)}.status"


# ------------------------------------------------------------------------------------ errors


class StatusError(LeaseholdError):
    """A status file cannot be read (missing, not a status file, cut short) or made."""

    code = "UNAVAILABLE"


class StatusLayoutError(StatusError):
    """The file was written with another layout (version or layout hash) than this reader's."""


class StatusBusy(StatusError):
    """No consistent copy within the reader's bound: the writer kept the sequence odd or
    changing (it is writing very often, was descheduled mid-copy, or died mid-copy)."""


# ------------------------------------------------------------------------------ the snapshot


@dataclass(frozen=True)
class Histogram:
    """Counts of observations by bucket: ``counts[i]`` observations were <= ``edges[i]``
    seconds and > ``edges[i - 1]``; the last count is those above the last edge. ``sum`` is
    the total of the observations in seconds."""

    edges: tuple          # upper bounds, seconds, ascending
    counts: tuple         # len(edges) + 1 ints
    sum: float

    @property
    def count(self):
        """Observations in all."""
        return sum(self.counts)

    def cumulative(self):
        """``[(upper bound, observations <= it), ...]`` ending with ``(inf, count)`` (the
        Prometheus ``le`` buckets)."""
        out, total = [], 0
        for edge, n in zip((*self.edges, float("inf")), self.counts, strict=True):
            total += n
            out.append((edge, total))
        return out

    def quantile(self, q):
        """The upper bound of the bucket holding quantile ``q`` (0 < q <= 1), in seconds; inf
        when it is past the last edge; None without observations."""
        if not 0 < q <= 1:
            raise ValueError(f"quantile {q!r}: allowed: 0 < q <= 1")
        n = self.count
        if n == 0:
            return None
        for edge, total in self.cumulative():
            if total >= q * n:
                return edge
        return float("inf")


@dataclass(frozen=True)
class HeadBlocked:
    """The head of a queue that is not placed (``Engine.queue_metrics``' ``head_blocked``)."""

    action: str           # its id (cut to 256 bytes)
    code: str             # the WaitCode name
    reason: str           # the engine's wording (cut to 256 bytes; at most ~1 s old)
    since_ns: int         # engine clock: head since
    eta_ns: int | None    # engine clock: estimated start (STRICT_FIFO heads), None unknown
    blocked_s: float      # seconds it had been the head, at the publish
    eta_s: float | None   # seconds from the publish to its estimated start (>= 0), None unknown


@dataclass(frozen=True)
class QueueStatus:
    """One queue as its shard last published it."""

    name: str
    priority: int
    strict: bool                # STRICT_FIFO (else GREEDY_CAPACITY)
    action_concurrency: int     # 0: unlimited
    run_concurrency: int        # 0: unlimited
    paused: bool                # the tick places nothing from it
    draining: bool              # it takes no new actions
    depth: int
    actions_in_flight: int
    runs_in_flight: int
    in_flight_resources: dict   # resource -> amount (cpu in millicores, bytes, devices)
    dispatched: int             # leases handed out, cumulative
    backfilled: int             # EASY backfill placements, cumulative
    head_blocked: HeadBlocked | None
    wait: Histogram             # enqueue -> assignment of the run leases handed out
    wait_by_reason: dict        # reason (WaitCode name) -> Histogram: ``wait`` by what held
    #                             the action before the tick that placed it (NONE: nothing);
    #                             only reasons with observations, in WAIT_REASONS order


@dataclass(frozen=True)
class ClusterStatus:
    """One cluster as its shard last published it; resource vectors as ``{name: amount}``,
    None for an unlimited (or unknown) amount."""

    name: str
    capacity: dict
    in_flight_resources: dict
    free: dict
    leases_in_flight: int       # held by its workers, run and finalize leases
    workers_connected: int
    slots: int                  # of its connected workers
    dispatched: int             # leases placed on it, cumulative


@dataclass(frozen=True)
class StatusSnapshot:
    """One consistent copy of a shard's status (:meth:`StatusReader.snapshot`). Times ending
    ``_ns`` are wall-clock nanoseconds since the epoch, except the heads' (the engine's
    clock); counters are cumulative since the shard started."""

    path: str
    shard_index: int
    pid: int
    state: str                  # "starting", "running" or "stopped"
    start_ns: int
    generation: int             # publishes so far
    published_ns: int
    engine_now_ns: int          # the engine's clock at the publish (the heads' clock)
    last_turn_ns: int           # 0: no turn yet
    reload_s: float             # the engine's load from the store at start
    tick_no: int
    resources: tuple
    queues: dict                # name -> QueueStatus, in queue order
    clusters: dict              # name -> ClusterStatus, in config order
    dispatches: int
    commits: int
    commit_failures: int
    counters: dict              # the shard loop's counters (SHARD_COUNTERS)
    heartbeat_refusals: dict    # verdict name -> count (STALE, EXPIRED, ...)
    report_refusals: dict
    errors: dict                # ERROR reply code -> count
    tick_latency: Histogram
    commit_latency: Histogram

    @property
    def age_s(self):
        """Seconds since this was published (wall clock)."""
        return (time.time_ns() - self.published_ns) / 1e9


# ---------------------------------------------------------------------------------- the file


def _open_preamble(mm, path):
    if len(mm) < _PREAMBLE_BYTES:
        raise StatusError(f"{path}: {len(mm)} bytes: too short for a Leasehold status file")
    magic, version, pre, digest = _FIXED.unpack_from(mm, 0)
    if magic != MAGIC:
        raise StatusError(f"{path}: not a Leasehold status file (magic {magic!r})")
    if version != LAYOUT_VERSION or digest != LAYOUT_HASH:
        raise StatusLayoutError(
            f"{path}: written with status layout version {version} (hash {digest.hex()}); "
            f"this reader reads version {LAYOUT_VERSION} (hash {LAYOUT_HASH.hex()}): read it "
            f"with the Leasehold build that wrote it")
    head = np.frombuffer(mm[:PREAMBLE.itemsize], PREAMBLE, count=1)[0]   # a copy: no export
    layout = _Layout(head["n_resources"], head["queue_slots"], head["n_clusters"],
                     head["name_bytes"])
    if int(head["file_bytes"]) != layout.file_bytes or len(mm) != layout.file_bytes \
            or int(head["body_offset"]) != layout.body_offset:
        raise StatusError(f"{path}: {len(mm)} bytes, the header says {int(head['file_bytes'])} "
                          f"and its sizes make {layout.file_bytes}: a damaged status file")
    info = {k: int(head[k]) for k in ("shard_index", "pid", "start_ns")}
    return layout, info


class StatusWriter:
    """The writing side of one shard's status file; only the shard's decision thread calls it.

    ``StatusWriter(config, shard_index, path=None, interval=None)`` makes the file
    (``status_path(config, shard_index)`` by default; ``interval`` defaults to
    ``status.interval``), sized from the config: its resources, its clusters, its queues plus
    ``SPARE_QUEUES`` slots. The loop records what it measures with the ``record_*`` methods
    (cheap: a few list updates) and calls :meth:`publish` when :meth:`due`; a publish reads
    the engine through its public inspection view and copies one staging buffer into the file
    under the seqlock. A queue the engine gained live takes a spare slot; past the spares (or
    with a longer name) the file is made again, larger, and renamed over the old one (readers
    reopen it: :class:`StatusReader` checks the path's inode on every read)."""

    def __init__(self, config, shard_index, path=None, *, interval=None):
        self.config = config
        self.shard_index = int(shard_index)
        self.path = Path(path) if path is not None else status_path(config, shard_index)
        self.interval_ns = int((config.status.interval if interval is None else interval) * 1e9)
        if self.interval_ns < 0:
            raise ValueError(f"status interval {interval!r}: allowed: seconds >= 0")
        self._resources = tuple(config.resources.names)
        self._clusters = tuple(c.name for c in config.clusters)
        self._queues = [q.name for q in config.queues]
        self.pid = os.getpid()
        self.start_ns = time.time_ns()
        self._gen = 0
        self._state = 0
        self._dirty = True
        self._next_ns = 0
        self._reload_ns = 0
        self._last_turn_ns = 0
        # What the loop records between publishes (Python ints and lists: a scalar update is
        # cheaper than on numpy, and nothing of it is in the file until a publish copies it).
        self._tick_counts = [0] * (len(TICK_EDGES_US) + 1)
        self._tick_sum = 0
        self._commit_counts = [0] * (len(COMMIT_EDGES_US) + 1)
        self._commit_sum = 0
        self._commits = 0
        self._commit_failures = 0
        self._dispatches = 0
        self._refusals = {"heartbeat": [0] * len(VERDICTS), "report": [0] * len(VERDICTS)}
        self._errors = [0] * len(ERROR_KINDS)
        self._q_dispatched = np.zeros(0, np.uint64)
        # Queue wait by [queue, reason, bucket] and its sums by [queue, reason]: the staging
        # body's own fields (set in _make), folded into in place. Two thirds of the body, so
        # no second copy to keep and copy over at every publish.
        self._q_wait = self._q_wait_sum = None
        self._c_dispatched = np.zeros(len(self._clusters), np.uint64)
        # Per queue: the head row, its enqueue seq and wait code last published, and when
        # its reason was worded (monotonic ns; -1 never).
        self._head_keys = np.full((0, 4), -1, np.int64)
        self._turns = []            # batches' columns not folded into the counts yet
        self._view = None
        self._engine = None
        self._mm = None
        self._pending = None        # (temporary path, old mapping) of a file not renamed yet
        if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686", "x86"):
            log.warning("status: %s is not x86: the status seqlock assumes stores and loads "
                        "stay in program order (docs/status.md); a reader may see a torn "
                        "snapshot here", platform.machine())
        self._make(len(self._queues) + SPARE_QUEUES)

    # ------------------------------------------------------------------ the file

    def _make(self, queue_slots, install=True):
        """Make the file (under a temporary name) for ``queue_slots`` queue slots; rename it
        over the path now, or (``install`` False: a remake inside a publish) once that
        publish has filled it."""
        names = (*self._resources, *self._clusters, *self._queues)
        layout = _Layout(len(self._resources), queue_slots, len(self._clusters),
                         _name_width(names))
        tmp = self.path.with_name(f".{self.path.name}.{self.pid}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o640)
            try:
                os.ftruncate(fd, layout.file_bytes)
                # Blocks allocated now: a sparse file on a full disk is a SIGBUS at the
                # first store into its map, not an error (a shard restarted on a full
                # store's disk died so, with no word).
                os.posix_fallocate(fd, 0, layout.file_bytes)
                mm = mmap.mmap(fd, layout.file_bytes, mmap.MAP_SHARED,
                               mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        except OSError as exc:
            _discard(tmp)
            raise StatusError(f"{self.path}: cannot make the status file: "
                              f"{exc.strerror or exc} (status.dir sets where it goes)") from None
        pre = np.zeros((), PREAMBLE)
        pre["magic"], pre["version"], pre["preamble_bytes"] = MAGIC, LAYOUT_VERSION, \
            _PREAMBLE_BYTES
        pre["layout_hash"] = LAYOUT_HASH
        pre["seq"] = 2 * self._gen          # even: a complete body follows
        pre["file_bytes"], pre["body_offset"] = layout.file_bytes, layout.body_offset
        pre["n_resources"], pre["queue_slots"] = layout.n_res, layout.queue_slots
        pre["n_clusters"], pre["name_bytes"] = layout.n_clusters, layout.name_bytes
        pre["shard_index"], pre["pid"], pre["start_ns"] = self.shard_index, self.pid, \
            self.start_ns
        mm[:PREAMBLE.itemsize] = pre.tobytes()
        old = self._mm
        self._layout = layout
        self._mm = mm
        self._stage_buf = bytearray(layout.body.itemsize)
        stage = np.ndarray((), layout.body, buffer=self._stage_buf)
        self._sh = {f[0]: stage["shard"][f[0]] for f in SHARD_FIELDS}
        self._q = {f[0]: stage["queues"][f[0]] for f in QUEUE_FIELDS}
        self._c = {f[0]: stage["clusters"][f[0]] for f in CLUSTER_FIELDS}
        self._sh["resource_names"][...] = [n.encode() for n in self._resources]
        self._q["name"][:len(self._queues)] = [n.encode() for n in self._queues]
        self._c["name"][...] = [n.encode() for n in self._clusters]
        for name in ("capacity", "free"):
            self._c[name][...] = UNLIMITED
        for i, c in enumerate(self.config.clusters):
            if c.capacity is not None:
                self._c["capacity"][i] = c.capacity
        self._sh["state"][...] = self._state
        self._grow_queue_counts(queue_slots)
        old_wait, old_sum = self._q_wait, self._q_wait_sum
        self._q_wait, self._q_wait_sum = self._q["wait_counts"], self._q["wait_sum_ns"]
        if old_wait is not None:        # a remade file keeps the counts (it only grows)
            n = old_wait.shape[0]
            self._q_wait[:n], self._q_wait_sum[:n] = old_wait, old_sum
        self._head_keys = np.full((0, 4), -1, np.int64)      # re-read every head
        self._pending = (tmp, old)
        if install:
            self._write()

    def _install(self):
        # Rename the new file over the path: readers see a whole file or the old one, never
        # half of one (StatusReader notices the new inode and reopens).
        tmp, old = self._pending
        self._pending = None
        try:
            os.replace(tmp, self.path)
        except OSError as exc:
            _discard(tmp)
            raise StatusError(f"{self.path}: cannot make the status file: "
                              f"{exc.strerror or exc}") from None
        finally:
            if old is not None:
                old.close()

    def _grow_queue_counts(self, slots):
        n = self._q_dispatched.shape[0]
        if slots > n:
            self._q_dispatched = np.concatenate([self._q_dispatched,
                                                 np.zeros(slots - n, np.uint64)])

    def _write(self):
        """Copy the staging body into the file under the seqlock (odd, copy, even)."""
        self._gen += 1
        gen = self._gen
        self._sh["generation"][...] = gen
        self._q["generation"][...] = gen
        self._c["generation"][...] = gen
        mm, lo = self._mm, self._layout.body_offset
        _SEQ_WORD.pack_into(mm, _SEQ, 2 * gen - 1)          # odd: readers retry
        mm[lo:lo + len(self._stage_buf)] = self._stage_buf
        _SEQ_WORD.pack_into(mm, _SEQ, 2 * gen)              # even: this body is whole
        if self._pending is not None:
            self._install()

    @property
    def generation(self):
        """Publishes so far (the sequence is twice this while no publish is under way)."""
        return self._gen

    # ------------------------------------------------------------------ recording

    def record_tick(self, ns):
        """One tick (``Engine.schedule()``) took ``ns`` nanoseconds."""
        self._tick_counts[bisect.bisect_left(_TICK_EDGES_NS, ns)] += 1
        self._tick_sum += ns

    def record_commit(self, ns, ok=True):
        """One store group commit took ``ns`` nanoseconds (``ok`` False: it raised)."""
        self._commit_counts[bisect.bisect_left(_COMMIT_EDGES_NS, ns)] += 1
        self._commit_sum += ns
        if ok:
            self._commits += 1
        else:
            self._commit_failures += 1

    def record_refusals(self, request, refused):
        """Tokens refused by a ``"heartbeat"`` or ``"report"``: the engine's refusals (each
        with a ``verdict``)."""
        counts = self._refusals[request]
        for r in refused:
            counts[_VERDICT_INDEX[r.verdict]] += 1

    def record_error(self, code):
        """An ERROR reply with wire ``code`` left the shard (a code outside ERROR_CODES is
        counted as OTHER)."""
        self._errors[_ERROR_INDEX.get(code, _ERROR_INDEX["OTHER"])] += 1

    def set_reload(self, seconds):
        """The engine took ``seconds`` to load from the store."""
        self._reload_ns = int(seconds * 1e9)

    def record_turn(self, batch, now_ns):
        """A loop turn committed: ``batch`` (an ``engine.DispatchBatch``) is what it handed
        out, ``now_ns`` the engine clock (the queue wait of each run lease is ``now_ns`` less
        its attempt's enqueue time, counted under the batch's ``wait_code`` of it). Only
        keeps the batch's columns (fresh arrays of the drain, never changed after it): the
        counts are folded in at the next publish, so a turn pays a list append, not a
        handful of numpy calls."""
        self._last_turn_ns = time.time_ns()
        if len(batch):
            self._turns.append((batch.queue, batch.cluster, batch.kind,
                                batch.attempt_enqueued_ns, batch.wait_code, now_ns))
            if len(self._turns) % 256 == 0:     # (kept longer while a queue has no slot)
                self._fold_turns()

    def _fold_turns(self):
        turns = self._turns
        if not turns:
            return
        q = np.concatenate([t[0] for t in turns]).astype(np.int64)
        if int(q.max()) >= self._layout.queue_slots:
            # A queue the file has no slot for yet (the engine gained it live): kept for the
            # next publish, which makes room (_sync_queues) before it folds.
            return
        self._turns = []
        cl = np.concatenate([t[1] for t in turns]).astype(np.int64)
        kind = np.concatenate([t[2] for t in turns])
        wait = np.concatenate([now - enq for _q, _c, _k, enq, _w, now in turns])
        reason = np.concatenate([t[4] for t in turns]).astype(np.int64)
        self._dispatches += int(q.size)
        top = int(q.max()) + 1
        if top > self._q_dispatched.shape[0]:
            self._grow_queue_counts(top)
        self._q_dispatched[:top] += np.bincount(q, minlength=top).astype(np.uint64)
        self._c_dispatched += np.bincount(cl, minlength=self._c_dispatched.shape[0]
                                          ).astype(np.uint64)
        run = kind == 0
        if run.any():
            qr = q[run]
            w = np.maximum(wait[run], 0)
            bucket = np.searchsorted(_WAIT_EDGES_NS, w, side="left")
            rr = reason[run]
            np.add.at(self._q_wait, (qr, rr, bucket), np.uint64(1))
            np.add.at(self._q_wait_sum, (qr, rr), w.astype(np.uint64))

    def mark_dirty(self):
        """Publish at the next :meth:`due` check whatever the interval (a queue changed)."""
        self._dirty = True

    def due(self, now_ns=None):
        """Whether a publish is due: ``interval`` passed since the last one, or marked dirty."""
        if self._dirty:
            return True
        return (time.monotonic_ns() if now_ns is None else now_ns) >= self._next_ns

    def overdue(self, intervals=4, now_ns=None):
        """Whether the last publish is ``intervals`` intervals older than :meth:`due` asked
        for (a pipelined shard waits for a moment with no turn in commit, but not forever)."""
        now = time.monotonic_ns() if now_ns is None else now_ns
        return now >= self._next_ns + intervals * max(self.interval_ns, 1_000_000)

    # ------------------------------------------------------------------ publishing

    def _bind(self, engine):
        if engine is self._engine:
            return
        cfg = engine.config
        if tuple(cfg.resources.names) != self._resources or \
                tuple(c.name for c in cfg.clusters) != self._clusters:
            raise ValueError(f"status {self.path}: the engine's resources or clusters are not "
                             f"those of this writer's config")
        self._engine = engine
        self._view = engine.inspect()
        self._head_keys = np.full((0, 4), -1, np.int64)

    def _sync_queues(self, names):
        """Follow the engine's queue list: new queues take spare slots, or remake the file."""
        known = self._queues
        if names[:len(known)] != known:
            raise ValueError(f"status {self.path}: the engine's queues {names} do not extend "
                             f"the published {known} (queues are only appended)")
        self._queues = list(names)
        width = _name_width((*self._resources, *self._clusters, *names))
        if len(names) > self._layout.queue_slots or width > self._layout.name_bytes:
            self._make(max(len(names) + SPARE_QUEUES, 2 * self._layout.queue_slots),
                       install=False)       # renamed once this publish has filled it
        else:
            self._q["name"][len(known):len(names)] = [n.encode() for n in names[len(known):]]

    def publish(self, engine, counters=None):
        """Copy the engine's queues and clusters, the shard loop's ``counters`` (a mapping
        with every name of ``SHARD_COUNTERS``; None: zeros) and what was recorded into the
        file as one consistent generation."""
        # Due again after the interval even if this one fails (a failing publish is retried
        # at the interval's pace, not on every loop turn).
        self._dirty = False
        self._next_ns = time.monotonic_ns() + self.interval_ns
        self._bind(engine)
        view = self._view
        names = view.queue_names()
        if names != self._queues:
            self._sync_queues(names)
        a = view.arrays
        nq = len(names)
        sh, qf, cf = self._sh, self._q, self._c
        self._state = 1
        sh["state"][...] = 1
        sh["n_queues"][...] = nq
        sh["published_ns"][...] = time.time_ns()
        sh["engine_now_ns"][...] = engine.clock.now_ns()
        sh["last_turn_ns"][...] = self._last_turn_ns
        sh["reload_ns"][...] = self._reload_ns
        tick_no = view.tick_no
        sh["tick_no"][...] = tick_no
        self._fold_turns()
        sh["dispatches"][...] = self._dispatches
        sh["commits"][...] = self._commits
        sh["commit_failures"][...] = self._commit_failures
        if counters is not None:
            try:
                sh["counters"][...] = [counters[k] for k in SHARD_COUNTERS]
            except KeyError as exc:
                raise KeyError(f"status: the shard counters have no {exc.args[0]!r} "
                               f"(transport._status.SHARD_COUNTERS names it)") from None
        sh["heartbeat_refusals"][...] = self._refusals["heartbeat"]
        sh["report_refusals"][...] = self._refusals["report"]
        sh["errors"][...] = self._errors
        sh["tick_counts"][...] = self._tick_counts
        sh["tick_sum_ns"][...] = self._tick_sum
        sh["commit_counts"][...] = self._commit_counts
        sh["commit_sum_ns"][...] = self._commit_sum

        qf["priority"][:nq] = a.q_priority[:nq]
        qf["strict"][:nq] = a.q_strict[:nq]
        qf["action_concurrency"][:nq] = a.q_action_cap[:nq]
        qf["run_concurrency"][:nq] = a.q_run_cap[:nq]
        qf["paused"][:nq] = a.q_paused[:nq]
        qf["draining"][:nq] = a.q_draining[:nq]
        qf["depth"][:nq] = a.q_pending[:nq]
        qf["actions_in_flight"][:nq] = a.q_adm[:nq] - a.q_rel[:nq]
        qf["runs_in_flight"][:nq] = a.q_runs_adm[:nq] - a.q_runs_rel[:nq]
        qf["in_flight_resources"][:nq] = a.q_res_adm[:nq] - a.q_res_rel[:nq]
        qf["backfilled"][:nq] = a.q_backfilled[:nq]
        qf["dispatched"][:nq] = self._q_dispatched[:nq]
        # wait_counts, wait_sum_ns: folded into the staging body in place (_fold_turns)
        self._publish_heads(view, a, nq, tick_no)

        nc = len(self._clusters)
        cf["in_flight_resources"][...] = a.c_adm[:nc] - a.c_rel[:nc]
        for c in range(nc):
            cf["free"][c] = view.cluster_free(c)
        nw = view.worker_sessions
        held = np.zeros(nc, np.int64)
        connected = np.zeros(nc, np.int64)
        slots = np.zeros(nc, np.int64)
        if nw:
            wc = a.w_cluster[:nw]
            ok = wc >= 0
            wc = wc[ok].astype(np.int64)
            on = a.w_connected[:nw][ok] != 0
            # A draining or suspect worker offers no slots (the gate places nothing on it).
            offered = np.where(a.w_paused[:nw][ok] == 0, a.w_slots[:nw][ok], 0)
            held = np.bincount(wc, weights=(a.w_adm[:nw][ok] - a.w_rel[:nw][ok]).astype(
                np.float64), minlength=nc)
            connected = np.bincount(wc[on], minlength=nc)
            slots = np.bincount(wc[on], weights=offered[on].astype(np.float64),
                                minlength=nc)
        cf["leases_in_flight"][...] = held
        cf["workers_connected"][...] = connected
        cf["slots"][...] = slots
        cf["dispatched"][...] = self._c_dispatched
        self._write()
        return self._gen

    def _publish_heads(self, view, a, nq, tick_no):
        # Which heads wait and why, from the arrays on every publish (vectorised); the worded
        # reason and the ETA come from Inspection.wait (explain's wording and shadow-time
        # walk, without its position scan: tens of microseconds each), so they are re-read
        # only for a head that changed (another action, or another wait code) or whose text
        # is over a second old, and within a time budget per publish, least recently worded
        # first. A head not worded yet publishes an empty reason (docs/status.md).
        qf = self._q
        heads = a.q_head[:nq]
        blocked = np.zeros(nq, bool)
        live = np.flatnonzero(heads >= 0)
        if live.size:
            blocked[live] = a.a_state[heads[live]] == _QUEUED
        qf["head_blocked"][:nq] = blocked
        qf["head_since_ns"][:nq] = a.q_head_since[:nq]
        bq = np.flatnonzero(blocked)
        if not bq.size:
            return
        rows = heads[bq]
        # The code Engine.explain gives a queued row (engine/_explain.py): the row's own wait
        # of this tick, else its lane's skip of this tick, else where the queue's scan stopped.
        lanes = a.a_lane[rows]
        code = np.where(a.a_wait_tick[rows] == tick_no, a.a_wait_code[rows],
                        np.where(a.ln_skip_tick[lanes] == tick_no, a.ln_skip_code[lanes],
                                 a.q_stop_code[bq]))
        qf["head_code"][bq] = code
        seq = a.a_seq[rows]
        k = self._head_keys
        if k.shape[0] < nq:
            k = self._head_keys = np.concatenate(
                [k, np.full((nq - k.shape[0], 4), -1, np.int64)])
        now = time.monotonic_ns()
        key = k[bq]
        changed = (key[:, 0] != rows) | (key[:, 1] != seq) | (key[:, 2] != code)
        old = ~changed & (now - key[:, 3] >= _EXPLAIN_EVERY_NS)
        if changed.any():
            # The action and the code are exact at once; the words wait for explain.
            k[bq[changed], :3] = np.stack([rows[changed], seq[changed], code[changed]], 1)
            k[bq[changed], 3] = -_EXPLAIN_EVERY_NS      # never worded: first in line
            for q, row in zip(bq[changed].tolist(), rows[changed].tolist(), strict=True):
                qf["head_action"][q] = _text(str(view.action_at(row)))
                qf["head_reason"][q] = b""
                qf["head_eta_ns"][q] = -1
        todo = np.flatnonzero(changed | old)
        if not todo.size:
            return
        todo = todo[np.argsort(k[bq[todo], 3], kind="stable")]    # least recently worded
        clock = time.perf_counter_ns
        end = clock() + _EXPLAIN_BUDGET_NS
        for i in todo.tolist():
            q, row = int(bq[i]), int(rows[i])
            _code, reason, eta = view.wait(row)
            qf["head_reason"][q] = _text(reason)
            qf["head_eta_ns"][q] = -1 if eta is None else eta
            k[q, 3] = now
            if clock() > end:
                break

    def close(self):
        """Mark the file stopped (the last published figures stay readable) and unmap it.
        The file stays: a reader sees ``state == "stopped"``."""
        if self._mm is None:
            return
        self._state = 2
        self._sh["state"][...] = 2
        self._sh["published_ns"][...] = time.time_ns()
        self._write()
        self._mm.close()
        self._mm = None
        self._engine = self._view = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class StatusReader:
    """The reading side of a status file: ``StatusReader(path)`` maps it read-only.

    :meth:`snapshot` returns a :class:`StatusSnapshot`; :meth:`read` the consistent raw copy
    (a numpy structured scalar of the body's dtype) it is made from. Neither writes anything
    nor talks to the shard. Each read checks that the path still names the mapped file (a
    restarted shard, or a file remade larger, is a new file renamed over it) and reopens it
    when not. ``timeout`` bounds the wait for a consistent copy (:class:`StatusBusy`)."""

    def __init__(self, path, *, timeout=0.1):
        self.path = Path(path)
        self.timeout = float(timeout)
        self.retries = 0        # copies thrown away (mid-publish, or a publish came between)
        self._mm = None
        self._open()

    def _open(self):
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise StatusError(f"{self.path}: no status file (is the shard running? it makes "
                              f"the file when it starts)") from None
        try:
            st = os.fstat(fd)
            if st.st_size == 0:
                raise StatusError(f"{self.path}: empty: not a Leasehold status file")
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        try:
            layout, info = _open_preamble(mm, self.path)
        except BaseException:
            mm.close()
            raise
        if self._mm is not None:
            self._mm.close()
        self._mm, self._ino = mm, (st.st_dev, st.st_ino)
        self.layout = layout
        self.shard_index, self.pid, self.start_ns = info["shard_index"], info["pid"], \
            info["start_ns"]
        self._lo = layout.body_offset
        self._hi = layout.body_offset + layout.body.itemsize
        self._edges = {
            "tick": tuple(e / 1e6 for e in TICK_EDGES_US),
            "commit": tuple(e / 1e6 for e in COMMIT_EDGES_US),
            "wait": tuple(e / 1e6 for e in WAIT_EDGES_US),
        }

    def _current(self):
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise StatusError(f"{self.path}: the status file is gone") from None
        if (st.st_dev, st.st_ino) != self._ino:
            self._open()

    def read(self):
        """One consistent copy of the body, as a read-only numpy structured scalar (fields
        of ``SHARD_FIELDS`` under ``shard``, ``QUEUE_FIELDS`` per slot under ``queues``,
        ``CLUSTER_FIELDS`` under ``clusters``)."""
        self._current()
        mm, lo, hi = self._mm, self._lo, self._hi
        unpack = _SEQ_WORD.unpack_from
        deadline = None
        spins = 0
        while True:
            s1 = unpack(mm, _SEQ)[0]
            if not s1 & 1:
                raw = mm[lo:hi]
                if unpack(mm, _SEQ)[0] == s1:
                    return np.ndarray((), self.layout.body, buffer=raw)
            # Mid-publish (odd) or a publish came between the two reads: try again, briefly
            # yielding the CPU so a descheduled writer can finish.
            spins += 1
            self.retries += 1
            if deadline is None:
                deadline = time.monotonic() + self.timeout
            elif time.monotonic() > deadline:
                raise StatusBusy(self._busy(s1, spins))
            if spins > 16:
                time.sleep(0.0001)

    def _busy(self, seq, spins):
        try:
            os.kill(self.pid, 0)
            alive = "is alive"
        except ProcessLookupError:
            alive = "is not running: it died mid-publish; its next start remakes the file"
        except PermissionError:
            alive = "exists"
        return (f"{self.path}: no consistent copy in {self.timeout}s ({spins} tries, "
                f"sequence {seq}); the writer, pid {self.pid}, {alive}")

    def snapshot(self):
        """A :class:`StatusSnapshot` of one consistent copy."""
        body = self.read()
        sh = body["shard"]
        res = tuple(n.decode() for n in sh["resource_names"].tolist())
        nq = int(sh["n_queues"])
        edges = self._edges
        now = int(sh["engine_now_ns"])

        def vec(values, cap=None):
            # None where the amount has no limit (capacity UNLIMITED: unknown or open).
            if cap is None:
                return dict(zip(res, values, strict=True))
            return {n: (None if c >= UNLIMITED else v)
                    for n, v, c in zip(res, values, cap, strict=True)}

        def hist(kind, counts, sum_ns):
            return Histogram(edges[kind], tuple(counts), sum_ns / 1e9)

        queues = {}
        qa = body["queues"][:nq]
        cols = {f[0]: qa[f[0]].tolist() for f in QUEUE_FIELDS if f[0] not in _WAIT_FIELDS}
        # The wait histograms by reason, vectorised: per queue the total over reasons, and
        # only the reasons with observations become Histograms (most (queue, reason) pairs
        # never see one).
        wc, ws = np.ascontiguousarray(qa["wait_counts"]), np.ascontiguousarray(qa["wait_sum_ns"])
        totals, total_sums = wc.sum(axis=1).tolist(), ws.sum(axis=1).tolist()
        qi, ki = np.nonzero(wc.sum(axis=2))
        by_reason = [{} for _ in range(nq)]
        for i, k, counts, sum_ns in zip(qi.tolist(), ki.tolist(), wc[qi, ki].tolist(),
                                        ws[qi, ki].tolist(), strict=True):
            by_reason[i][WAIT_REASONS[k]] = hist("wait", counts, sum_ns)
        for i in range(nq):
            blocked = None
            if cols["head_blocked"][i]:
                eta = cols["head_eta_ns"][i]
                since = cols["head_since_ns"][i]
                blocked = HeadBlocked(
                    action=cols["head_action"][i].decode(errors="replace"),
                    code=WaitCode(cols["head_code"][i]).name,
                    reason=cols["head_reason"][i].decode(errors="replace"),
                    since_ns=since, eta_ns=None if eta < 0 else eta,
                    blocked_s=max(0, now - since) / 1e9,
                    eta_s=None if eta < 0 else max(0, eta - now) / 1e9)
            name = cols["name"][i].decode()
            queues[name] = QueueStatus(
                name=name, priority=cols["priority"][i], strict=bool(cols["strict"][i]),
                action_concurrency=cols["action_concurrency"][i],
                run_concurrency=cols["run_concurrency"][i], paused=bool(cols["paused"][i]),
                draining=bool(cols["draining"][i]), depth=cols["depth"][i],
                actions_in_flight=cols["actions_in_flight"][i],
                runs_in_flight=cols["runs_in_flight"][i],
                in_flight_resources=vec(cols["in_flight_resources"][i]),
                dispatched=cols["dispatched"][i], backfilled=cols["backfilled"][i],
                head_blocked=blocked, wait=hist("wait", totals[i], total_sums[i]),
                wait_by_reason=by_reason[i])
        clusters = {}
        ca = body["clusters"]
        cols = {f[0]: ca[f[0]].tolist() for f in CLUSTER_FIELDS}
        for i in range(self.layout.n_clusters):
            name = cols["name"][i].decode()
            cap = cols["capacity"][i]
            clusters[name] = ClusterStatus(
                name=name, capacity=vec(cap, cap),
                in_flight_resources=vec(cols["in_flight_resources"][i]),
                free=vec(cols["free"][i], cap), leases_in_flight=cols["leases_in_flight"][i],
                workers_connected=cols["workers_connected"][i], slots=cols["slots"][i],
                dispatched=cols["dispatched"][i])
        s = sh.item()
        f = dict(zip(self.layout.shard.names, s, strict=True))
        return StatusSnapshot(
            path=str(self.path), shard_index=self.shard_index, pid=self.pid,
            state=STATES[f["state"]], start_ns=self.start_ns, generation=f["generation"],
            published_ns=f["published_ns"], engine_now_ns=f["engine_now_ns"],
            last_turn_ns=f["last_turn_ns"],
            reload_s=f["reload_ns"] / 1e9, tick_no=f["tick_no"], resources=res,
            queues=queues, clusters=clusters, dispatches=f["dispatches"],
            commits=f["commits"], commit_failures=f["commit_failures"],
            counters=dict(zip(SHARD_COUNTERS, f["counters"].tolist(), strict=True)),
            heartbeat_refusals=_nonzero_ok(f["heartbeat_refusals"]),
            report_refusals=_nonzero_ok(f["report_refusals"]),
            errors=dict(zip(ERROR_KINDS, f["errors"].tolist(), strict=True)),
            tick_latency=hist("tick", f["tick_counts"].tolist(), f["tick_sum_ns"]),
            commit_latency=hist("commit", f["commit_counts"].tolist(), f["commit_sum_ns"]))

    def close(self):
        """Unmap the file."""
        if self._mm is not None:
            self._mm.close()
            self._mm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _nonzero_ok(counts):
    # Refusal counts by verdict name; OK is never a refusal, so it is left out.
    return {name: n for name, n in zip(VERDICTS, counts.tolist(), strict=True) if name != "OK"}


def snapshot_dict(snapshot):
    """A :class:`StatusSnapshot` as plain data (for ``--json``)."""
    return dataclasses.asdict(snapshot)
