"""The journal of loop turns: what a turn touched (dirty rows and edges), its group commit,
deferred groups (decide, then commit), and memory restored to what the store holds after a
failed commit.

A part of :class:`engine.Engine` (a mixin over its shared state); see engine/_engine.py."""

import contextlib

import msgpack
import numpy as np

from engine._errors import LeaseholdError
from engine._history import RECORD_SIZE
from engine._records import (
    FINALIZE_DTYPE,
    encode_outcome,
    finalize_columns,
    row_key,
)
from engine._reload import load
from engine._state import W_DRAINING
from storage import (
    OwnershipError,
    Records,
    StoreError,
    StoreFailed,
    StoreFull,
    StoreLost,
)

__all__ = ["JournalMixin", "HISTORY_FLUSH_NS"]

#: Runtime samples reach the store at most this long after they were taken (engine clock),
#: unless a group writes partition 0 sooner (engine/_journal.py, _encode_history).
HISTORY_FLUSH_NS = 1_000_000_000
# msgpack's bin 8 header of one history record (engine._history.RECORD_SIZE bytes).
_BIN_RECORD = b"\xc4" + bytes([RECORD_SIZE])
# Up to this many dirty rows the codec sorts them itself; above, _distinct_rows does (a
# bitmap of the table or numpy's sort beat a C qsort of many rows).
_CODEC_SORTS = 4096


class Group:
    """One deferred loop turn (:meth:`Engine.decide`, :meth:`Engine.deferred_turn`): its
    encoded store group, waiting for :meth:`Engine.commit`. ``state`` is ``"open"`` while
    its turn runs, then ``"pending"``, then ``"committed"`` or ``"discarded"`` (an earlier
    or its own commit failed: nothing of it may be acted on)."""

    __slots__ = ("seq", "state", "batch", "retained", "dispatch_tail", "placed", "swept")

    def __init__(self, seq):
        self.seq = seq
        self.state = "open"
        self.batch = None
        self.retained = None    # partition -> {key: retained outcome} the batch writes
        self.dispatch_tail = 0
        self.placed = 0         # assignments the decision made (decide)
        self.swept = False      # the decision ran the periodic lease-expiry sweep (decide)

    def __repr__(self):
        return f"Group({self.seq}, {self.state}, placed={self.placed})"


def _distinct_rows(parts, n):
    """The distinct rows of the arrays ``parts`` (each row < ``n``), ascending: a set when
    they are few, a bitmap of the table when they are many (a large fan-out, an abort: O(n),
    no sort), else a sort."""
    m = sum(p.size for p in parts)
    if len(parts) == 1 and (m < 2 or (parts[0][1:] > parts[0][:-1]).all()):
        return parts[0]         # already distinct and ascending (one batch's rows, usually)
    if m <= 32:     # a few rows (one action's turn): a set, cheaper than numpy's unique here
        rows = sorted({r for p in parts for r in p.tolist()})
        return np.array(rows, dtype=np.int64)
    if m * 16 >= n:
        mark = np.zeros(n, dtype=bool)
        for p in parts:
            mark[p] = True
        return np.flatnonzero(mark)
    return np.unique(np.concatenate(parts) if len(parts) > 1 else parts[0])


class _Turn:
    """A loop turn (``Engine._turn``): turns nest; the outermost one's exit encodes what it
    touched and commits it (or, in a deferred turn, leaves it for the group), and after an
    error restores memory to what the store holds. A class, not a generator context
    manager: every engine call runs in one, and a tick's decision in two."""

    __slots__ = ("_eng",)

    def __init__(self, eng):
        self._eng = eng

    def __enter__(self):
        eng = self._eng
        if eng._stopped is not None:
            raise StoreError(f"shard stopped: {eng._stopped}")
        if eng._depth == 0 and eng._pending and not eng._deferring:
            raise StoreError(f"{len(eng._pending)} decided group(s) not committed yet: "
                             f"commit them before another turn")
        eng._depth += 1

    def __exit__(self, exc_type, exc, tb):
        eng = self._eng
        eng._depth -= 1
        if exc_type is not None and not issubclass(exc_type, (LeaseholdError, StoreError)):
            # Not a refusal (those are raised before anything changes): memory may hold part
            # of the call (rows taken, counters moved, before any row was marked dirty).
            eng._turn_failed = True
        if eng._depth == 0:
            failed, eng._turn_failed = eng._turn_failed, False
            if exc_type is None and failed:
                # The caller went on after that error (a shard answers it and serves the
                # turn's other requests): nothing of the turn may be written.
                eng._discard_pending()
                eng._restore()
                raise StoreError("a call inside this loop turn failed unexpectedly: memory "
                                 "was restored to what the store holds and nothing of the "
                                 "turn was written")
            if exc_type is None and eng._deferring:
                # (A tick that placed anything has dirty arrays: no _has_dirty call.)
                eng._pending_batch = (eng._encode() if eng._dirty_arrays or eng._has_dirty()
                                      else {})
                eng._pending_retained = eng._retained_turn
                eng._clear_dirty()
            elif exc_type is None:
                eng._commit()
            elif eng._has_dirty() or (failed and eng._stopped is None):
                # An error after memory changed: put memory back to what disk holds
                # (which also discards every pending deferred group). After an unexpected
                # error that is so even with nothing marked dirty: otherwise the next turn
                # could write past a row the store never got, and no reload could read that
                # store back ("rows are not dense").
                eng._discard_pending()
                eng._restore()
        return False


class _DeferredTurn(_Turn):
    """``Engine.deferred_turn``'s context manager: a turn whose group is left pending."""

    __slots__ = ("_hand_out_own", "_group")

    def __init__(self, eng, hand_out_own):
        self._eng = eng
        self._hand_out_own = bool(hand_out_own)

    def __enter__(self):
        eng = self._eng
        if eng._depth:
            raise StoreError("a deferred turn cannot be nested in another turn")
        group = self._group = Group(next(eng._group_seq))
        eng._deferring = True
        eng._hand_out_own = self._hand_out_own
        try:
            _Turn.__enter__(self)
        except BaseException:
            eng._deferring = False
            eng._hand_out_own = False
            raise
        return group

    def __exit__(self, exc_type, exc, tb):
        eng = self._eng
        try:
            _Turn.__exit__(self, exc_type, exc, tb)
        finally:
            eng._deferring = False
            eng._hand_out_own = False
        group = self._group
        if exc_type is None and eng._stopped is None and group.state == "open":
            group.batch = eng._pending_batch
            group.retained = eng._pending_retained or None
            group.dispatch_tail = eng._kernel.d_tail
            group.state = "pending"
            eng._pending_batch = None
            eng._pending_retained = None
            eng._pending.append(group)
        return False


class JournalMixin:
    """The journal of loop turns (a part of Engine)."""

    @contextlib.contextmanager
    def turn(self):
        """Group everything done inside into one loop turn: one store transaction and one
        sync at the end, and nothing acknowledged before it (calls inside return as usual,
        but the group becomes durable only when the block exits without error). On a
        failed commit memory is restored to what the store holds and the error raised."""
        with self._turn():
            yield self

    def deferred_turn(self, *, hand_out_own=False):
        """A loop turn whose commit is left to the caller: the block's transitions are
        applied in memory and encoded, when it exits, into a :class:`Group` (yielded at
        entry, filled at exit) to pass to :meth:`commit` (or, when another thread wrote
        ``group.batch`` to the store, to :meth:`settle`). Nothing done inside is durable,
        nor may it be acknowledged, until that commit returns. Several groups may be
        pending (decide turn N+1 while turn N syncs); they commit in order. While any is
        pending only deferred turns may run.

        A drain inside hands out only what committed groups decided, unless
        ``hand_out_own``: then it hands out this turn's decisions and those of groups still
        pending too. That is for a caller that holds everything it drained until *this*
        group has committed (a shard loop's outbox): the hand-out record and the decisions
        it hands out then become durable together, or with the groups before it."""
        return _DeferredTurn(self, hand_out_own)

    def commit(self, group):
        """Make a pending :class:`Group` durable (groups commit in the order they were
        decided). On failure memory is restored to what the store holds, which discards
        this group and every later pending one (their state becomes ``"discarded"``), and
        the error is raised: nothing of them may be acted on."""
        self._check_next(group)
        try:
            self._write(group.batch)
        except BaseException:
            self._discard_pending()
            raise
        self._committed(group)

    def settle(self, group, error=None):
        """Record the outcome of a pending group's store commit done outside the engine (a
        committer thread wrote ``group.batch`` with the store's ``commit``, in group order):
        ``error`` None for success, else the exception that commit raised. A failure is
        handled as :meth:`commit` handles it (a full store is grown and the group written
        again here; otherwise memory := the store, this and every later pending group
        discarded) and ``error`` is raised. Call it on the engine's own thread."""
        self._check_next(group)
        if error is None:
            self._committed(group)
            return
        try:
            self._after_failed_commit(error)        # returns only when grown: write again
            self._write(group.batch)
        except BaseException:
            self._discard_pending()
            raise
        self._committed(group)

    def _check_next(self, group):
        if group.state != "pending":
            raise StoreError(f"group {group.seq} is {group.state}, not pending")
        if self._pending[0] is not group:
            raise StoreError(f"group {group.seq} commits after group {self._pending[0].seq}")

    def _committed(self, group):
        self._pending.popleft()
        group.state = "committed"
        group.batch = group.retained = None
        self._committed_tail = group.dispatch_tail

    def _discard_pending(self):
        for g in self._pending:
            g.state = "discarded"
            g.batch = g.retained = None
        self._pending.clear()

    @property
    def pending_groups(self):
        """Deferred groups decided but not committed yet, oldest first."""
        return tuple(self._pending)

    def _turn(self):
        return _Turn(self)

    def _has_dirty(self):
        return bool(self._dirty_rows or self._dirty_arrays or self._dirty_fz
                    or self._dirty_fz_arrays or self._ops or self._history_dirty
                    or self._history_due())

    def _touch(self, row):
        self._dirty_rows.append(row)

    def _touch_many(self, rows):
        """Mark an array of action rows dirty (kept as the array: no Python int per row)."""
        if rows.size:
            self._dirty_arrays.append(rows)

    def _touch_fz_many(self, rows):
        """Mark an array of finalize rows dirty (kept as the array, like _touch_many)."""
        if rows.size:
            self._dirty_fz_arrays.append(rows)

    def _commit(self):
        if self._has_dirty():
            self._write(self._encode())
        self._committed_tail = self._kernel.d_tail

    def _write(self, batch):
        """Commit one encoded group; on failure restore memory := disk and raise."""
        if not batch:
            self._clear_dirty()
            return
        while True:
            try:
                self._store.commit(batch)
                break
            except BaseException as exc:
                self._after_failed_commit(exc)     # returns only when grown: try again
        self._clear_dirty()

    def _after_failed_commit(self, exc):
        """A group's commit raised ``exc`` (nothing of it applied, or, for StoreFailed, an
        unknown outcome): grow a full store and return (the caller writes the group again),
        or restore memory := disk and raise ``exc``."""
        store = self._store
        if isinstance(exc, StoreFull):
            grow = getattr(store, "resize", None)
            size = getattr(store, "map_size", None)
            limit = self.config.storage.max_map_size
            if grow is not None and size is not None and size < limit:
                grow(min(size * 2, limit))   # nothing was applied: retry the group
                return
            self._restore()
            raise exc
        if isinstance(exc, OwnershipError):
            self._stopped = f"ownership lost: {exc}"
            raise exc
        if isinstance(exc, StoreLost):
            # Written into a data file no longer at its path: nothing a restart reads, and
            # every later write refused. Not acknowledged; this engine serves no more.
            self._stopped = f"store lost: {exc}"
            raise exc
        if isinstance(exc, StoreFailed):
            # Unknown outcome: reopen (finishes or discards the group) and reload.
            store.close()
            try:
                store.open(self.config.storage.shard, self._wall.time_ns())
            except BaseException as reopen:
                # Closed for good (a full disk): every later turn would fail on a closed
                # store, serving nothing; stopped, the process exits and its supervisor
                # restarts it (or gives up, naming this).
                self._stopped = (f"the store could not be reopened after a failed commit "
                                 f"({exc}): {reopen}")
                raise
        self._restore()
        raise exc

    def _restore(self):
        """Memory := disk, keeping the connected workers' sessions."""
        # A store written from another thread (a pipelined shard's committer) finishes or
        # drops what it was given first, so what is read here is what the store keeps.
        quiesce = getattr(self._store, "quiesce", None)
        if quiesce is not None:
            quiesce()
        st = self._state
        # A drain was asked for and is never written: kept. A suspicion (pause_on_expiry)
        # is not: the expiry behind it may be one the failed group undid (its lease is in
        # flight again), and a reload forgets it too.
        connected = [(name, self._clusters[st.w_cluster[row]], int(st.w_slots[row]),
                      int(st.w_paused[row]) & W_DRAINING)
                     for name, row in self._workers.items() if st.w_connected[row]]
        self._clear_dirty()
        self._history_samples = set()   # the history is reloaded: what the store holds
        self._load()
        for name, cluster, slots, paused in connected:
            # Only workers whose identity is durable: a registration that failed with this
            # turn is undone (re-registering it here would drop its identity record).
            if name in self._idents:
                self._register(name, cluster, slots)
                self._state.w_paused[self._workers[name]] = paused
        self._clear_dirty()

    def _load(self):
        self._take_over(load(self._store, self.config, self.clock.now_ns()))
        self._committed_tail = self._kernel.d_tail   # restored decisions are durable

    def _encode(self):
        """The turn's group: dirty rows' fixed records, outcomes, and the edges."""
        st = self._state
        # (Each step here is a cold one right after the kernel: none taken for nothing.)
        batch = {p: list(ops) for p, ops in self._ops.items()} if self._ops else {}
        if self._dirty_rows or self._dirty_arrays:
            parts_ = [a if a.dtype == np.int64 else a.astype(np.int64)
                      for a in self._dirty_arrays]
            if self._dirty_rows:
                parts_.append(np.array(self._dirty_rows, dtype=np.int64))
            # Rows whose Python record is their truth get an attempts record, and their
            # fixed record says so (the codec clears their lean flag); a lean row's fixed
            # record is its whole outcome.
            recs = self._recs
            for r in self._action_blocks(parts_, batch):
                rec = recs.get(r)
                if rec is not None:   # else restored and untouched: its record stands
                    batch.setdefault(int(st.a_part[r]), []).append(
                        ("attempts", row_key(r), encode_outcome(rec)))
        if self._dirty_fz or self._dirty_fz_arrays:
            parts_ = [a.astype(np.int64, copy=False) for a in self._dirty_fz_arrays]
            if self._dirty_fz:
                parts_.append(np.fromiter(self._dirty_fz, dtype=np.int64,
                                          count=len(self._dirty_fz)))
            idx = _distinct_rows(parts_, st.fz_state.shape[0])
            # One block per partition (the partition of the action each cleans up), rows
            # ascending within it (idx is ascending: a stable sort by partition keeps that).
            part = st.a_part[st.fz_action[idx]]
            if part.size and (part != part[0]).any():
                idx = idx[np.argsort(part, kind="stable")]
                part = st.a_part[st.fz_action[idx]]
            recs = self._finalize_records(idx)
            keys = idx.astype(">u8")
            size = FINALIZE_DTYPE.itemsize
            bounds = np.flatnonzero(np.diff(part)) + 1
            for lo, hi in zip([0, *bounds.tolist()], [*bounds.tolist(), idx.size], strict=True):
                batch.setdefault(int(part[lo]), []).append(
                    Records("finalize", keys[lo:hi], recs[lo:hi], 8, size))
        self._encode_history(batch)
        return batch

    def _encode_history(self, batch):
        """History key records (partition 0): new key rows always (action records name
        them); runtime samples when a flush is due. Samples are predictions' input, not
        transitions: deferring them (at most HISTORY_FLUSH_NS) keeps a turn that only
        reports successes on its tenant's partition (one environment's syncs, not a
        journaled group over two), and a busy key is written once a flush, not once a
        turn."""
        tasks = self._history_dirty
        if self._history_due():
            tasks = tasks | self._history_samples
            self._history_samples = set()
        if not tasks:
            return
        # [task, shape, record] (msgpack) per key: the key row's history, None before its
        # first success. Records in one pass; each key's store key and packed [task, shape]
        # prefix are kept (a flush after many keys' successes costs little per key).
        keys = list(tasks)
        ops = batch.setdefault(0, [])
        known = self._history_prefix
        for key, data in zip(keys, self.history.records(keys), strict=True):
            entry = known.get(key)
            if entry is None:
                entry = known[key] = (row_key(self._tasks[key]), b"\x93" + msgpack.packb(
                    key[0]) + msgpack.packb(key[1]))
            ops.append(("history", entry[0],
                        entry[1] + (_BIN_RECORD + data if data is not None else b"\xc0")))

    def _add_sample(self, key):
        """History ``key`` has a runtime sample the store does not have yet: it is written
        within HISTORY_FLUSH_NS of the oldest such sample."""
        if not self._history_samples:
            self._history_flush_ns = self.clock.now_ns() + HISTORY_FLUSH_NS
        self._history_samples.add(key)

    def _history_due(self):
        return bool(self._history_samples) and self.clock.now_ns() >= self._history_flush_ns

    def flush_history(self):
        """Write every runtime sample not yet in the store now (one group); the engine does
        it by itself within about a second of a sample, with any group that writes
        partition 0, and at :meth:`close`."""
        if not self._history_samples:
            return
        self._history_flush_ns = 0
        with self._turn():
            pass

    def _action_blocks(self, parts, batch):
        """Append the fixed records of the action rows in the arrays ``parts`` (repeats
        allowed) to ``batch``: one block per partition (the row's ``a_part``), rows ordered
        by (partition, row), deduplicated, keyed and packed by the Cython codec in one call
        and handed to the store as they are. Returns the rows among them whose Python record
        is their truth (``a_edges`` 1), a list: the caller writes their attempts records."""
        if len(parts) == 1:
            rows = parts[0]
        elif len(parts) > 1:
            rows = np.concatenate(parts)
        else:
            return []
        if rows.size > _CODEC_SORTS:
            rows = _distinct_rows([rows], self._next_row)   # O(table) or numpy's sort
        return self._codec_records.encode_into(
            rows if rows.dtype == np.int64 else rows.astype(np.int64), batch, Records.packed)

    def _finalize_records(self, idx):
        """The fixed records of finalize rows ``idx``."""
        st = self._state
        recs = np.zeros(idx.size, FINALIZE_DTYPE)
        recs["row"] = idx
        for name in finalize_columns():
            recs[name] = getattr(st, "fz_" + name)[idx]
        recs["pref"] = self._ident_of_rows(st.fz_pref[idx])
        recs["holder"] = self._ident_of_rows(st.fz_worker[idx])
        return recs

    def _ident_of_rows(self, rows):
        rows = np.asarray(rows)
        return np.where(rows >= 0, self._state.w_ident[np.maximum(rows, 0)], -1)

    def _clear_dirty(self):
        self._history_dirty = set()  # history keys whose record to write
        # Action rows to write (their fixed record, and their attempts record when their
        # Python record is their truth): single rows and arrays of rows, merged at encode.
        self._dirty_rows = []
        self._dirty_arrays = []
        self._dirty_fz = set()      # finalize rows: single rows, and arrays of them
        self._dirty_fz_arrays = []
        self._ops = {}              # partition -> [(db, key, value)] of the edges
        # partition -> {key: retained outcome (None: deleted)} this turn writes: what a
        # lookup must see before the store has it (engine/_retain.py, _unwritten_retained).
        self._retained_turn = {}

    def _op(self, part, db, key, value):
        self._ops.setdefault(part, []).append((db, key, value))
        if db == "retained":
            self._retained_turn.setdefault(part, {})[key] = value
