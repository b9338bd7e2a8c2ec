"""Bounded memory: rows of ended actions reclaimed, their outcomes retained in the store.

An action's row leaves the engine's arrays once the action has ended (a terminal phase), its
finalize leases have ended and no child of it is still in the table. Its outcome moves, in the
same group commit, to the partition's ``retained`` database (key: an 8-byte digest of the
action's run, then its name; value: the id, the spec, the input reference, the end time and
the outcome record), with an ``expiry`` index entry (key: retention end,
big-endian, then the retained key) from which :meth:`Engine.sweep_retention` deletes expired
outcomes in small batches. ``attempts()``, ``explain()`` and ``phase()`` of a retained action
read the store; re-enqueueing its id is idempotent against it (another spec is
``AlreadyExists``).

The row goes back to a free list with its lease generation kept: the next action in the row
continues counting from it, so a token of the old action is always refused (its generation
is released, or older than the current one). The freed row's fixed record is rewritten as a
FREE record that carries the generation, in the old action's partition, so a reload keeps
counting too (a row reused by another partition's action leaves that FREE record behind;
reload takes, per row, the occupied record, else the FREE one with the highest generation).

Nothing here keeps a Python object per retained action: the retained index is the store's
B-tree, probed for a fan-out's names only when its run has rows here or retained keys there.
A run whose last action is reclaimed leaves memory and the store in the same turn
(:meth:`_retire_runs`).

A part of :class:`engine.Engine` (a mixin over its shared state); see engine/_engine.py.
"""

import itertools
import operator
from dataclasses import dataclass
from hashlib import blake2b

import msgpack
import numpy as np

from cext import DEBUG
from cext._retained import ATTEMPT_LAYOUT, pack_lean_retained
from cext._tree import unlink_children, unlink_roots
from engine._codes import PHASES, TERMINAL_PHASES, Phase
from engine._groups import group_key
from engine._index import ActionEdges
from engine._records import (
    ATTEMPT_FIELDS,
    FINALIZE_DTYPE,
    decode_content,
    decode_outcome,
    digest8,
    encode_outcome,
    row_key,
    same_spec,
    spec_content,
)
from engine._rows import LEAN_TERMINAL, ST_DONE, ST_FREE
from engine._state import ACTION_FIELDS, FINALIZE_FIELDS
from storage import CorruptRecord, Puts, Records

__all__ = ["RETENTION_BATCH", "RetentionMixin", "Retained", "content_key", "is_content_key",
           "retained_key"]

# Columns a reclaimed row keeps: its lease generation (released) and how that lease ended (a
# token of it keeps its verdict until the row's next lease makes it STALE), and the partition
# its FREE record lives in.
_KEEP = frozenset({"a_gen", "a_released_gen", "a_end", "a_part"})
_RESET = tuple(name for name in ACTION_FIELDS
               if name.startswith("a_") and name not in _KEEP)
# Columns a freed finalize row keeps, for the same reason (its partition is its action's).
_FZ_KEEP = frozenset({"fz_gen", "fz_released_gen", "fz_end", "fz_delivered_gen"})
_FZ_RESET = tuple(name for name in FINALIZE_FIELDS if name not in _FZ_KEEP)
# A lean row's outcome is packed by cext._retained in encode_outcome's attempt layout.
if ATTEMPT_LAYOUT != ATTEMPT_FIELDS:
    raise ImportError(f"cext._retained packs attempts as {ATTEMPT_LAYOUT}, the record has "
                      f"{ATTEMPT_FIELDS}: rebuild the extensions")
_PHASE_VALUES = tuple(p.value for p in PHASES)
_SUCCEEDED, _ABORTED = PHASES.index(Phase.SUCCEEDED), PHASES.index(Phase.ABORTED)
# Reclaim at most this many rows per call (a bounded group commit).
RECLAIM_BATCH = 1 << 16
# Expired retained outcomes deleted per partition in one sweep (a small batch: the sweep
# runs inside a tick's group commit).
RETENTION_BATCH = 256


# The ninth byte of a spec content's key (content_key).
_CONTENT_BYTE = 0xFE
_CONTENT = bytes([_CONTENT_BYTE])

#: Longest name kept whole in a retained key; a longer one keeps this much less 9 bytes of
#: its start, a NUL (never in a name) and its digest, so keys stay within LMDB's 511 bytes.
NAME_KEY_MAX = 400


def _name_key(name):
    """The name part of a retained key: the name itself (ASCII, engine._groups), so a run's
    actions sort by name and the outcomes one reclaim writes (a fan-out's names, usually
    numbered) land side by side in few B-tree pages; a name over ``NAME_KEY_MAX`` bytes is
    cut and ends in its digest."""
    raw = name.encode()
    if len(raw) <= NAME_KEY_MAX:
        return raw
    return raw[:NAME_KEY_MAX - 9] + b"\0" + digest8(name)


def retained_key(text):
    """The ``retained`` key of action id ``text``: an 8-byte digest of its run, then its
    name (:func:`_name_key`). A run's actions sit side by side, in name order, so a reclaim
    dirties a few B-tree pages per run instead of one per action: a synced commit of 1,000
    outcomes into a run already holding 100,000 took 15 ms with an 8-byte digest of the
    name in its place and 1.1 ms in key order (LMDB writes every page a commit dirtied).
    The stored id is checked on every read."""
    run, _, name = text.rpartition("/")
    return digest8(run) + _name_key(name)


def _retained_keys(texts):
    """``[retained_key(t) for t in texts]``, each run hashed once (a fan-out's ids share
    theirs)."""
    runs, digests, names = {}, [], []
    for text in texts:
        run, _, name = text.rpartition("/")
        digest = runs.get(run)
        if digest is None:
            digest = runs[run] = digest8(run)
        digests.append(digest)
        names.append(name)
    return _keys_of(digests, names)


def content_key(content):
    """The ``retained`` key of a spec's ``content`` (bytes), under which its retained
    outcomes find it: 16 bytes of its blake2b digest with ``fe`` after the eighth. No
    outcome key is that (its ninth byte starts a name: ASCII), nor a run's marker (``ff``)."""
    d = blake2b(content, digest_size=16).digest()
    return d[:8] + _CONTENT + d[8:]


def is_content_key(key):
    """Whether ``key`` (of the ``retained`` database, or an ``expiry`` key without its
    first eight bytes) names a spec's content rather than an action's outcome."""
    return len(key) == 17 and key[8] == _CONTENT_BYTE


def _run_marker(run_digest):
    """The key under which a turn notes that a run left memory and its outcomes are not in
    the store yet: its digest then ``ff``, which no retained key is (a name is ASCII)."""
    return run_digest + b"\xff"


def _objects(values):
    """A 1-d object array of ``values`` (a list), each element kept as it is."""
    out = np.empty(len(values), object)
    out[:] = values
    return out


def _keys_of(run_digests, names):
    """Retained keys of ``names``, each after its run's 8-byte digest (``run_digests``: one
    ``bytes`` per name)."""
    # Every name encoded in one call (a valid id's name holds no newline; a batch with one,
    # or with a name too long to keep whole, takes the per-name path).
    raw = "\n".join(names).encode().split(b"\n") if names else []
    if len(raw) != len(names) or max(map(len, raw), default=0) > NAME_KEY_MAX:
        raw = [_name_key(name) for name in names]
    keys = list(map(operator.add, run_digests, raw))
    if len(keys) != len(raw):
        raise ValueError(f"{len(keys)} run digests for {len(raw)} names")
    return keys


@dataclass
class Retained:
    """A reclaimed action's retained outcome, as read back from the store."""

    id: str
    content: bytes
    input_ref: str | None
    ended_ns: int
    queue: str
    record: ActionEdges

    def spec(self):
        """The action's exact spec."""
        return decode_content(self.content, self.id.rsplit("/", 1)[1])


class RetentionMixin:
    """Reclaiming rows and retained outcomes (a part of Engine)."""

    def reclaim(self, limit=RECLAIM_BATCH):
        """Reclaim the rows of up to ``limit`` ended actions now (the engine also does so
        when it needs rows for new work): their outcomes move to the store for
        ``storage.retention``, their rows to the free list. One loop turn; returns the
        number of rows reclaimed."""
        with self._turn():
            return self._reclaim(limit)

    def _reclaimable(self, keep=()):
        st = self._state
        n = self._next_row
        state = st.a_state[:n]
        rows = np.flatnonzero((state == ST_DONE) & (st.a_child[:n] < 0))
        if not rows.size:
            return rows
        lean = st.a_edges[rows] == 0
        ok = np.zeros(rows.size, dtype=bool)
        ok[lean] = np.isin(st.a_phase[rows[lean]], LEAN_TERMINAL)
        for i in np.flatnonzero(~lean).tolist():
            ok[i] = self._phase_of(int(rows[i])) in TERMINAL_PHASES
        rows = rows[ok]
        nf = self._n_finalize
        if nf and rows.size:
            busy = st.fz_action[:nf][st.fz_state[:nf] != ST_DONE]
            if busy.size:
                rows = rows[~np.isin(rows, busy)]
        if keep:
            rows = rows[~np.isin(rows, np.fromiter(keep, dtype=np.int64))]
        return rows

    def _reclaim(self, limit=RECLAIM_BATCH, keep=(), keep_runs=()):
        rows = self._reclaimable(keep)[:limit]
        if not rows.size:
            return 0
        st = self._state
        if self._reclaimed_names.add(st.a_name_hash[rows]):
            # The filter was full and starts afresh: no run's reclaimed names are all in
            # it any more.
            self._runs_fresh.clear()
        runs, first = np.unique(st.a_run[rows], return_index=True)
        run_parts = st.a_part[rows[first]]
        # A run's first reclaim (of its life in memory) tells whether its retained
        # outcomes will all be in the filter: only if the store holds none of it yet.
        judged = self._runs_judged
        for u, part in zip(runs.tolist(), run_parts.tolist(), strict=True):
            if u not in judged:
                judged.add(u)
                if not self._stored_retained(part, self._run_keys[u]):
                    self._runs_fresh.add(u)
        now = self.clock.now_ns()
        expire = (now + int(self.config.storage.retention * 1e9)).to_bytes(8, "big")
        self._retain_outcomes(rows, expire, now)
        self._prune_abort_rows(rows)
        self._free_finalize(rows)
        # Out of the children lists of parents still in the table, and of their runs' lists.
        mark = np.zeros(self._next_row, dtype=np.uint8)
        mark[rows] = 1
        unlink_children(st.a_child, st.a_sibling, st.a_parent, mark, rows)
        roots = rows[st.a_parent[rows] < 0]
        if roots.size:
            unlink_roots(st.u_child, st.a_sibling, st.a_run, mark,
                         np.zeros(st.u_child.shape[0], dtype=np.uint8), roots)
        # Out of the index and the edges.
        index, recs = self._hash_rows, self._recs
        listed = rows.tolist()
        # (an entry that names another row is a collision's: it stays)
        hashes = st.a_name_hash[rows].tolist()
        held = np.fromiter(map(index.pop, hashes, itertools.repeat(-1)), np.int64,
                           len(hashes))
        # An entry that named a row kept in the table (a collision's) goes back (rare).
        other = np.flatnonzero((held != rows) & (held >= 0))
        if other.size:
            for i in other[~np.isin(held[other], rows)].tolist():
                index[hashes[i]] = int(held[i])
        if recs:                    # (lean rows, a fan-out's, have no record)
            for r in listed:
                recs.pop(r, None)
        if self._collided:
            gone = set(rows.tolist())
            for aid in [a for a, r in self._collided.items() if r in gone]:
                del self._collided[aid]
        # Groups no row refers to any more: their record goes too.
        gids, counts = np.unique(st.a_group[rows], return_counts=True)
        for gid, k in zip(gids.tolist(), counts.tolist(), strict=True):
            left = self._group_rows[gid] - k
            if left:
                self._group_rows[gid] = left
                continue
            del self._group_rows[gid]
            g = self._groups.pop(gid, None)
            part = self._part_of(g.compiled.id.tenant) if g is not None else int(
                st.a_part[rows[np.flatnonzero(st.a_group[rows] == gid)[0]]])
            self._op(part, "specs", group_key(gid), None)
        # The row: every column back to its fill but its generation (released), FREE.
        gen = st.a_gen[rows]
        st.reset_rows("actions", rows, _RESET)
        st.a_released_gen[rows] = gen
        st.a_state[rows] = ST_FREE
        # A queue's blocked head is a row number the kernel keeps until its next scan of
        # the queue: one that names a freed row would name whatever action takes it next.
        stale = np.isin(st.q_head, rows)
        if stale.any():
            st.q_head[stale] = -1
        # Its FREE record in the old action's partition (a_part is kept), written even if
        # the row is reused in this turn by another partition's action.
        self._action_blocks([rows], self._ops)
        self._free_rows = np.union1d(self._free_rows, rows)
        self._retire_runs(runs, run_parts, keep_runs)
        return int(rows.size)

    def _retain_outcomes(self, rows, expire, now):
        """The retained outcome and expiry entry of each of ``rows`` (being reclaimed), and
        the deletes of their attempts and abort records; made column by column, a Python
        record read only for rows whose columns are not their whole outcome."""
        st = self._state
        n = rows.size
        # Each group's spec content, id prefix and run digest once (a fan-out's rows share
        # one group), then per row by its index among the groups.
        _gids, first, inv = np.unique(st.a_group[rows], return_index=True,
                                      return_inverse=True)
        info, contents = [], {}
        for r in rows[first].tolist():
            g = self._group_of(r)
            run_key = g.compiled.id.run_key
            content = spec_content(g.compiled.spec)
            ckey = content_key(content)
            contents[ckey] = content
            info.append((g, ckey, run_key + "/", digest8(run_key)))
        which = inv.reshape(-1).tolist()
        gidx = st.a_gidx[rows].tolist()
        if len(info) == 1:
            # One group (a fan-out's rows, the common case): per-row columns made whole.
            names = list(map(info[0][0].names.__getitem__, gidx))
            ckeys, prefixes, digests = ([info[0][i]] * n for i in (1, 2, 3))
        else:
            # Several groups (a reclaim batch spans fan-out batches): each group's names
            # taken in one map, placed by an object-array scatter; the per-group values by
            # an object-array gather. No Python step a row.
            inv = inv.reshape(-1)
            at = np.empty(n, object)
            for j, (g, *_rest) in enumerate(info):
                sel = np.flatnonzero(inv == j)
                at[sel] = list(map(g.names.__getitem__, st.a_gidx[rows[sel]].tolist()))
            names = at.tolist()
            ckeys, prefixes, digests = (
                _objects([e[i] for e in info])[inv].tolist() for i in (1, 2, 3))
        refs = ([info[j][0].input_ref(k) for j, k in zip(which, gidx, strict=True)]
                if any(e[0].inputs is not None for e in info) else [None] * n)
        keys = _keys_of(digests, names)
        lean = st.a_lean[rows] == 1
        quick = (st.a_edges[rows] == 0) & lean
        if quick.all():             # the common case: every value packed in one pass
            values = self._lean_retained(rows, prefixes, names, ckeys, refs)
        else:
            values = [None] * n
            q = np.flatnonzero(quick).tolist()
            for i, value in zip(q, self._lean_retained(
                    rows[quick], [prefixes[i] for i in q], [names[i] for i in q],
                    [ckeys[i] for i in q], [refs[i] for i in q]), strict=True):
                values[i] = value
            queues = self._queue_names
            pack = msgpack.Packer(use_bin_type=True).pack
            qis = st.a_queue[rows].tolist()
            for i in np.flatnonzero(~quick).tolist():
                rec = self._rec(int(rows[i]))
                ended = max((a.end_ns or 0) for a in rec.attempts) if rec.attempts else now
                values[i] = pack([prefixes[i] + names[i], ckeys[i], refs[i], ended,
                                  queues[qis[i]], encode_outcome(rec)])
        # The ops a partition (distinct keys: their order does not matter), and the values
        # a lookup must find before the store has them.
        ops, turn = self._ops, self._retained_turn
        parts = st.a_part[rows]
        after = (int.from_bytes(expire, "big") + 1).to_bytes(8, "big")
        for part in np.unique(parts).tolist():
            sel = np.flatnonzero(parts == part)
            if sel.size == n:
                pkeys, pvalues = keys, values
            else:
                pick = sel.tolist()
                pkeys, pvalues = [keys[i] for i in pick], [values[i] for i in pick]
            out = ops.setdefault(part, [])
            heavy = rows[sel[~lean[sel]]]
            out.extend(("attempts", row_key(r), None) for r in heavy.tolist())
            # One block each (a triple a row cost ~0.4 us to apply and, in a group of
            # several partitions, to carry in a redo record): the outcomes, then the
            # expiry entries (retention end, then the key; no value).
            out.append(Puts("retained", pkeys, pvalues))
            turn.setdefault(part, {}).update(zip(pkeys, pvalues, strict=True))
            out.append(Puts("expiry", list(map(expire.__add__, pkeys)), [b""] * len(pkeys)))
            # The specs their values name, once each, kept a nanosecond past the last
            # outcome naming one (a later reclaim's end, or a stored later one, wins): the
            # sweep reaches a spec after every outcome of it, however its batches fall.
            for ckey in sorted(set(ckeys) if sel.size == n else
                               {ckeys[i] for i in sel.tolist()}):
                held = self._content_expiry(part, ckey)
                until = after if held is None or held < after else held
                self._op(part, "retained", ckey, until + contents[ckey])
                if until == after:
                    self._op(part, "expiry", after + ckey, b"")

    def _retire_runs(self, runs, parts, keep_runs=()):
        """Runs among ``runs`` (run rows of just reclaimed actions, their records in
        ``parts``) with no action left in the table leave memory, but those in ``keep_runs``
        (an enqueue's own runs): the run row, its (queue, run) pairs and their lanes go back
        to free lists, the run record is deleted. A later action of the run starts it afresh
        (its ``max_action_concurrency`` with it); its retained outcomes are found in the
        store (``_run_may_have_retained``)."""
        st = self._state
        # A run with an action in the table has a parentless one in its list (a parent is
        # reclaimed only after its children).
        gone = st.u_child[runs] < 0
        if DEBUG:
            held = st.a_run[:self._next_row]
            alive = np.zeros(len(self._run_keys), dtype=bool)
            alive[held[(held >= 0) & (st.a_state[:self._next_row] != ST_FREE)]] = True
            if (gone != ~alive[runs]).any():
                raise AssertionError(f"run lists disagree with the table for runs "
                                     f"{runs[gone != ~alive[runs]].tolist()}")
        if keep_runs:
            gone &= ~np.isin(runs, np.fromiter(keep_runs, dtype=np.int64))
        if not gone.any():
            return
        runs, parts = runs[gone], parts[gone]
        gone_runs = runs.tolist()
        self._runs_fresh.difference_update(gone_runs)
        self._runs_judged.difference_update(gone_runs)
        pairs = np.flatnonzero(np.isin(st.qr_run[:self._n_qruns], runs))
        lanes = np.concatenate([2 * pairs, 2 * pairs + 1])
        if DEBUG and ((st.ln_head[lanes] >= 0).any() or st.ln_in_ring[lanes].any() or (
                st.qr_adm[pairs] != st.qr_rel[pairs]).any() or (
                st.u_adm[runs] != st.u_rel[runs]).any()):
            raise AssertionError(f"runs {runs.tolist()} retired with work in their lanes")
        for q, u in zip(st.qr_queue[pairs].tolist(), st.qr_run[pairs].tolist(), strict=True):
            del self._qruns[(q, u)]
        st.reset_rows("qruns", pairs)
        st.reset_rows("lanes", lanes)
        st.reset_rows("runs", runs)
        self._free_qruns.extend(pairs.tolist())
        for u, part in zip(gone_runs, parts.tolist(), strict=True):
            key = self._run_keys[u]
            del self._runs[key]
            self._run_keys[u] = None
            self._op(part, "runs", row_key(u), None)
            # Until this turn commits, the store may not hold the run's retained outcomes
            # yet: a marker says so, under its digest and ff (no outcome key is that: a
            # name is ASCII, even one with no characters, which a malformed id may have).
            self._retained_turn.setdefault(part, {})[_run_marker(digest8(key))] = b""
        self._free_runs.extend(gone_runs)

    def _lean_retained(self, rows, prefixes, names, contents, inputs):
        """The retained values of lean ``rows`` (each one's id as ``prefixes[i] +
        names[i]``, spec content key and input reference given): packed from the columns in
        one compiled pass, the outcome being what ``encode_outcome`` of their materialised
        record gives (their one attempt)."""
        st = self._state
        n = rows.size
        if not n:
            return []
        phase = st.a_phase[rows]
        messages = [""] * n
        for i in np.flatnonzero(phase == _ABORTED).tolist():
            messages[i] = self._abort_reason(int(rows[i]))
        finalizes = [None] * n
        fz = st.a_final[rows]
        for i in np.flatnonzero(fz >= 0).tolist():
            finalizes[i] = self._finalize_status(int(fz[i]))
        return pack_lean_retained(
            prefixes, names, contents, inputs, st.a_queue[rows], tuple(self._queue_names),
            phase, _PHASE_VALUES,
            st.a_enqueued[rows], st.a_gen[rows], st.a_start[rows], st.a_running[rows],
            st.a_done[rows], st.a_cluster[rows], tuple(self._clusters), st.a_worker[rows],
            tuple(self._worker_names), messages, finalizes, _SUCCEEDED, _ABORTED)

    def _free_finalize(self, rows):
        # The finalize rows of reclaimed action rows (all ended: _reclaimable waits for them)
        # go back to their free list, FREE, every column at its fill but the kept ones. Their
        # FREE record is written here, in the old action's partition (a FREE finalize row is
        # never dirty: it has no action to name a partition); a reuse by another partition's
        # action leaves it behind, and reload keeps the newest record of the row.
        nf = self._n_finalize
        if not nf:
            return
        st = self._state
        fz = np.flatnonzero(np.isin(st.fz_action[:nf], rows))
        if not fz.size:
            return
        parts = st.a_part[st.fz_action[fz]]
        st.reset_rows("finalize", fz, _FZ_RESET)
        st.fz_state[fz] = ST_FREE
        for part in np.unique(parts).tolist():
            idx = fz[parts == part]
            self._ops.setdefault(part, []).append(
                Records("finalize", idx.astype(">u8"), self._finalize_records(idx), 8,
                        FINALIZE_DTYPE.itemsize))
        if st.a_final.shape[0]:
            st.a_final[rows] = -1
        self._free_fz = np.union1d(self._free_fz, fz)

    def _alloc_finalize(self, m):
        """``m`` finalize rows, ascending: freed rows first, then new ones (the table grows
        by doubling only when none are free)."""
        free = self._free_fz
        take = free[:m]
        self._free_fz = free[take.size:]
        fresh = m - take.size
        if fresh:
            first = self._n_finalize
            if self._state.ensure("finalize", first + fresh):
                self._bind()
            self._n_finalize += fresh
            take = np.concatenate([take, np.arange(first, first + fresh, dtype=np.int64)])
        return take

    def _alloc_rows(self, n, keep=(), keep_runs=()):
        """``n`` rows for new actions, ascending: reclaimed rows first, then new ones (the
        table grows by doubling only when reclaiming cannot make room). A reclaim it makes
        leaves rows ``keep`` and the runs ``keep_runs`` (run rows) in memory."""
        st = self._state
        free = self._free_rows
        fresh = n - free.size
        if fresh > 0 and self._next_row + fresh > st.rows["actions"]:
            got = self._reclaim(keep=keep, keep_runs=keep_runs)
            free = self._free_rows
            fresh = n - free.size
            if got < st.rows["actions"] // 8 and st.ensure("actions", st.rows["actions"] + 1):
                # Live work fills the table: double it now, so the next scan for ended rows
                # comes only after as many new actions again (amortised O(1) per action).
                self._bind()
        if fresh <= 0:
            rows = free[:n]
            self._free_rows = free[n:]
            return rows
        first = self._next_row
        if st.ensure("actions", first + fresh):
            self._bind()
        self._next_row += fresh
        fresh_rows = np.arange(first, first + fresh, dtype=np.int64)
        if not free.size:
            return fresh_rows
        self._free_rows = free[:0]
        return np.concatenate([free, fresh_rows])

    # ------------------------------------------------------------------ retained outcomes

    def _retained(self, aid):
        """The retained outcome of action ``aid`` (an ActionId), or None."""
        text, part = str(aid), self._part_of(aid.tenant)
        key = retained_key(text)
        found, raw = self._unwritten_retained(part, key)
        if not found:
            raw = self._store.get(part, "retained", key)
        return None if raw is None else self._decode_retained(text, part, raw)

    def _run_may_have_retained(self, aid):
        """False when no action of ``aid``'s run can be a retained outcome: the run has no
        row here, no retained key under its digest is written or waiting to be, and the
        store has none (one B-tree probe instead of one per name)."""
        if aid.run_key in self._runs:
            return True
        return self._stored_retained(self._part_of(aid.tenant), aid.run_key)

    def _stored_retained(self, part, run_key):
        """Whether the store (partition ``part``), or a turn not yet in it, may hold a
        retained outcome of run ``run_key``."""
        run = digest8(run_key)
        if self._unwritten_retained(part, _run_marker(run))[0]:
            return True     # its run row was freed in a turn not yet committed
        # A retained key is the run's digest then a name (ASCII): every one under ``run``
        # sorts below ``run + ff``.
        return bool(self._store.scan_range(part, "retained", run, run + b"\xff", 1))

    def _retained_many(self, tenant, texts, keys=None):
        """Retained outcomes of the ids ``texts`` (one tenant), None where there is none
        (``keys``: their retained keys when the caller has them)."""
        part = self._part_of(tenant)
        if keys is None:
            keys = _retained_keys(texts)
        raws = self._store.get_many(part, "retained", keys)
        # What turns not yet in the store write (a pipelined loop nearly always has one in
        # commit): probed a key at a time only when some map holds entries.
        # (A fan-out's new names are in none: one C pass a map says so.)
        unwritten = [m[part] for m in self._unwritten_maps()
                     if part in m and not m[part].keys().isdisjoint(keys)]
        if unwritten:
            for i, key in enumerate(keys):
                for m in unwritten:
                    if key in m:
                        raws[i] = m[key]
                        break
        contents = {}           # (a fan-out's outcomes name one spec: read once)
        return [None if raw is None else self._decode_retained(t, part, raw, contents)
                for t, raw in zip(texts, raws, strict=True)]

    def _retained_names(self, aid, names, texts):
        """:meth:`_retained_many` of ids ``texts``, each ``aid.run_key/name`` of ``names``
        (one run: a fan-out's), its keys made with the run's digest computed once."""
        keys = _keys_of(itertools.repeat(digest8(aid.run_key), len(names)), names)
        return self._retained_many(aid.tenant, texts, keys)

    def _unwritten_maps(self):
        """The non-empty maps ``partition -> {key: raw}`` (raw None: a delete) of retained
        outcomes written by this turn, then by each group decided and not yet committed,
        newest first: the store does not have them yet (two levels: a reclaim adds a
        partition's thousands of keys with one ``dict.update``)."""
        return [m for m in (self._retained_turn, *(g.retained for g in reversed(
            self._pending))) if m]

    def _unwritten_retained(self, part, key):
        """``(found, raw)``: a retained outcome this turn, or a group decided and not yet
        committed, writes (raw None: deletes). The store does not have it yet; a lookup
        that missed it would take a reclaimed action for one never enqueued."""
        for m in self._unwritten_maps():
            keys = m.get(part)
            if keys is not None and key in keys:
                return True, keys[key]
        return False, None

    def _decode_retained(self, aid, part, raw, contents=None):
        """The :class:`Retained` of action id text ``aid`` from its record in ``part``
        (``contents``: spec contents already read, by key, filled in as read)."""
        key = retained_key(aid)
        try:
            text, ckey, ref, ended, queue, outcome = msgpack.unpackb(raw, raw=False)
            phase, message, kind, cause, ur, sr, attempts = decode_outcome(outcome)
            phase = Phase(phase)
        except Exception as exc:
            raise CorruptRecord(part, "retained", key, f"undecodable retained outcome: "
                                                      f"{exc}") from None
        if text != aid:
            raise CorruptRecord(part, "retained", key, f"retained outcome of {text} found "
                                                      f"under the key of {aid}")
        if type(ckey) is not bytes or not is_content_key(ckey):
            raise CorruptRecord(part, "retained", key, f"retained outcome of {aid} names no "
                                                      f"spec content ({ckey!r:.40})")
        content = None if contents is None else contents.get(ckey)
        if content is None:
            value = self._content_entry(part, ckey)
            if value is None:
                raise CorruptRecord(part, "retained", ckey, f"the spec content the retained "
                                                           f"outcome of {aid} names is missing")
            content = value[8:]
            if contents is not None:
                contents[ckey] = content
        rec = ActionEdges(compiled=None, row=-1, phase=phase, message=message,
                          error_kind=kind, cause=cause, attempts=attempts, user_retries=ur,
                          system_retries=sr,
                          first_enqueued_ns=attempts[0].enqueued_ns if attempts else 0)
        return Retained(text, content, ref, ended, queue, rec)

    def _content_entry(self, part, ckey):
        """A spec content's entry in ``part`` as it is now (what this turn and turns not
        yet committed write included): its retention end (8 bytes big-endian), then the
        content; None when there is none."""
        found, value = self._unwritten_retained(part, ckey)
        return value if found else self._store.get(part, "retained", ckey)

    def _content_expiry(self, part, ckey):
        """The retention end a spec content's entry in ``part`` holds now, or None."""
        value = self._content_entry(part, ckey)
        return None if value is None else value[:8]

    def _same_retained(self, ret, spec, input_ref=None, any_input=False):
        if not any_input and ret.input_ref != input_ref:
            return False
        return same_spec(ret.spec(), spec)

    def sweep_retention(self, limit=RETENTION_BATCH):
        """Delete up to ``limit`` retained outcomes per partition whose retention has
        passed (``storage.retention`` after their row was reclaimed), in one loop turn (the
        limit counts expiry entries: the spec contents that outlived the outcomes naming
        them are deleted too).
        ``schedule()`` calls it about once a second, and every tick while a batch comes
        back full (``decide()`` does not: a loop built on it calls this when idle).
        Returns the number deleted."""
        with self._turn():
            return self._sweep_retention(self.clock.now_ns(), limit)[0]

    def _sweep_retention(self, now, limit):
        # (deleted, whether some partition had more expired than ``limit``)
        stop = (now + 1).to_bytes(8, "big")
        deleted, full = 0, False
        for part in range(self._store.partitions):
            expired = self._store.scan_range(part, "expiry", b"", stop, limit)
            for key, _value in expired:
                self._op(part, "expiry", key, None)
                target = key[8:]
                # A spec's content goes with the last outcome naming it: kept while a later
                # reclaim (written, or in a turn not committed yet) holds it longer.
                if is_content_key(target):
                    held = self._content_expiry(part, target)
                    if held is None or held <= key[:8]:
                        self._op(part, "retained", target, None)
                    continue
                found, raw = self._unwritten_retained(part, target)
                if found and raw is not None:
                    # Reclaimed again since (the entry found is the store's, and an earlier
                    # sweep's delete of it is not committed yet): the new outcome keeps its
                    # own entry and retention.
                    continue
                self._op(part, "retained", target, None)
                deleted += 1
            full = full or len(expired) == limit
        return deleted, full

