"""The index and the edges: action ids to rows (name hashes), enqueue groups, and the Python record
of a row, made from its columns (a lean row) or decoded from the store.

A part of :class:`engine.Engine` (a mixin over its shared state); see engine/_engine.py."""

import copy
import threading
from dataclasses import dataclass, field, replace

import numpy as np

from engine._codes import (
    PHASES,
    Phase,
)
from engine._errors import NotFound
from engine._groups import (
    EnqueueGroup,
    decode_group,
    group_key,
)
from engine._leases import Attempt
from engine._model import ActionId, compile_spec
from engine._records import (
    decode_content,
    decode_outcome,
    name_hash,
    row_key,
)
from engine._rows import FZ_OUTCOMES, ST_DONE, ST_FREE, ST_SENT
from engine._state import NEVER
from storage import (
    CorruptRecord,
)

__all__ = ["IndexMixin"]


@dataclass
class ActionEdges:
    """Python-side record of one action (the edges: spec, names, outcome)."""

    compiled: object
    row: int
    first_enqueued_ns: int = 0
    phase: Phase = Phase.QUEUED
    message: str = ""
    error_kind: str | None = None
    cause: str | None = None
    attempts: list = field(default_factory=list)   # Attempt records, oldest first
    user_retries: int = 0
    system_retries: int = 0

    @property
    def attempt(self):
        return self.attempts[-1]


class IndexMixin:
    """The index and the edges (a part of Engine)."""

    def _start_name_index(self, hashes, rows):
        """Sort restored name hashes (of ``rows``) into the lookup index in a background
        thread."""
        def build():
            order = np.argsort(hashes, kind="stable")
            self._idx_hash, self._idx_row = hashes[order], rows[order].astype(np.int64)

        self._index_thread = threading.Thread(target=build, name="leasehold-name-index",
                                              daemon=True)
        self._index_thread.start()

    def _lookup(self, aid):
        """The row of action ``aid``, or None."""
        text = str(aid)
        return self._find(name_hash(text), text, aid)

    def _find(self, h, text, aid=None):
        row = self._hash_rows.get(h)
        if row is not None and str(self._aid(row)) == text:
            return row
        if self._collided:
            row = self._collided.get(aid if aid is not None else ActionId.parse(text))
            if row is not None:
                return row
        if not self._restored_index().size:
            return None
        i = int(np.searchsorted(self._idx_hash, np.uint64(h)))
        while i < self._idx_hash.size and self._idx_hash[i] == h:
            r = int(self._idx_row[i])
            if self._state.a_state[r] != ST_FREE and str(self._aid(r)) == text:
                # (a 64-bit hash may collide: verified; a reclaimed row holds no name)
                self._index_row(h, r, aid if aid is not None else ActionId.parse(text))
                return r
            i += 1
        return None

    def _restored_index(self):
        """The sorted name hashes of the rows restored at load (``_idx_hash``, their rows
        in ``_idx_row``), once the thread that sorts them has finished."""
        if self._index_thread is not None:
            self._index_thread.join()
            self._index_thread = None
        return self._idx_hash

    def _index_row(self, h, row, aid):
        if self._hash_rows.setdefault(h, row) != row:
            self._collided[aid] = row

    def _probe(self, hashes, texts):
        """Rows of the given names (-1 where new): one pass over the batch."""
        out = np.full(len(texts), -1, dtype=np.int64)
        index, hl = self._hash_rows, hashes.tolist()
        # New names are the common case: one C pass says none is indexed.
        hits = [] if index.keys().isdisjoint(hl) else [
            i for i, h in enumerate(hl) if h in index]
        if self._restored_index().size:
            pos = np.searchsorted(self._idx_hash, hashes)
            pos = np.minimum(pos, self._idx_hash.size - 1)
            hits += np.flatnonzero(self._idx_hash[pos] == hashes).tolist()
        if self._collided:
            hits = range(len(texts))
        for i in sorted(set(hits)):
            row = self._find(int(hashes[i]), texts[i])
            if row is not None:
                out[i] = row
        return out

    def _group_of(self, row):
        gid = int(self._state.a_group[row])
        g = self._groups.get(gid)
        if g is None:
            g = self._load_group(gid, int(self._state.a_part[row]))
        return g

    def _load_group(self, gid, part):
        key = group_key(gid)
        raw = self._store.get(part, "specs", key)
        if raw is None:
            raise CorruptRecord(part, "specs", key, f"enqueue group {gid} has no record")
        try:
            content, names, inputs = decode_group(raw)
            spec = decode_content(content, names[0])
            # As it was accepted: a store written before a check was added still reloads.
            c = compile_spec(spec, self._resources, self._queues,
                             self.config.engine.default_queue, strict=False)
        except Exception as exc:
            raise CorruptRecord(part, "specs", key, f"undecodable enqueue group: {exc}") \
                from None
        g = self._groups[gid] = EnqueueGroup(gid, c, names, inputs, content)
        return g

    def _compiled_of(self, row):
        """The compiled spec of ``row`` (its group's template for a lean row: the same but
        for the id)."""
        rec = self._recs.get(row)
        return rec.compiled if rec is not None else self._group_of(row).compiled

    def _spec_of(self, row):
        """The exact spec of ``row`` (its group's, with its own id)."""
        g = self._group_of(row)
        aid = g.action_id(int(self._state.a_gidx[row]))
        return g.compiled.spec if aid == g.compiled.id else replace(g.compiled.spec,
                                                                      id=str(aid))

    def _input_ref(self, row):
        return self._group_of(row).input_ref(int(self._state.a_gidx[row]))

    def _phase_of(self, row):
        rec = self._recs.get(row)
        if rec is not None:
            return rec.phase
        if self._state.a_edges[row]:
            return self._rec(row).phase
        return PHASES[self._state.a_phase[row]]

    def _finalize_status(self, f):
        # What an attempt's record says of its finalize lease ``f`` (lean rows derive it).
        st = self._state
        if st.fz_state[f] == ST_DONE:
            return FZ_OUTCOMES[st.fz_outcome[f]]
        if st.fz_state[f] == ST_SENT and st.fz_delivered_gen[f] == st.fz_gen[f]:
            return "SENT"
        return "PENDING"

    def _rec(self, row):
        """The Python record of ``row``, made from its columns (a lean row) or decoded from
        the store on first use after a load."""
        rec = self._recs.get(row)
        if rec is None:
            rec = self._materialize(row)
        return rec

    def _aid(self, row):
        rec = self._recs.get(row)
        if rec is not None:
            return rec.compiled.id
        return self._group_of(row).action_id(int(self._state.a_gidx[row]))

    def _materialize(self, row):
        st = self._state
        part, key = int(st.a_part[row]), row_key(row)
        g = self._group_of(row)
        aid = g.action_id(int(st.a_gidx[row]))
        # The group's compiled template with this row's id; its spec stays the group's (the
        # same but for the id: _spec_of gives the exact one).
        c = copy.copy(g.compiled)
        c.id = aid
        c.queue = self._queue_names[int(st.a_queue[row])]
        if st.a_lean[row] and not st.a_edges[row]:
            # Its columns are its outcome: one attempt on the common path.
            if int(st.a_attempt[row]) != 1:
                raise CorruptRecord(part, "actions", key, f"lean action row {row} is on "
                                                          f"attempt {int(st.a_attempt[row])}")
            att = Attempt(number=1, enqueued_ns=int(st.a_enqueued[row]))
            start = int(st.a_start[row])
            if start != NEVER:
                att.generation = int(st.a_gen[row])
                att.cluster = self._clusters[st.a_cluster[row]]
                att.worker = self._worker_names[st.a_worker[row]]
                att.start_ns = start
            if int(st.a_running[row]) != NEVER:
                att.running_ns = int(st.a_running[row])
            phase = PHASES[st.a_phase[row]]
            message = ""
            if phase in (Phase.SUCCEEDED, Phase.ABORTED):
                att.end_ns = int(st.a_done[row])
                att.phase = phase.value
            if phase == Phase.ABORTED:
                message = att.message = self._abort_reason(row)
            f = int(st.a_final[row])
            if f >= 0:
                att.finalize = self._finalize_status(f)
            rec = ActionEdges(compiled=c, row=row, first_enqueued_ns=int(st.a_enqueued[row]),
                          phase=phase, message=message, attempts=[att])
        else:
            raw_out = self._store.get(part, "attempts", key)
            if raw_out is None:
                raise CorruptRecord(part, "attempts", key, f"action row {row} has no such "
                                                           f"record")
            try:
                phase, message, kind, cause, ur, sr, attempts = decode_outcome(raw_out)
            except Exception as exc:
                raise CorruptRecord(part, "attempts", key, f"undecodable action record: "
                                                           f"{exc}") from None
            rec = ActionEdges(compiled=c, row=row, first_enqueued_ns=int(st.a_enqueued[row]),
                          phase=Phase(phase), message=message, error_kind=kind, cause=cause,
                          attempts=attempts, user_retries=ur, system_retries=sr)
        self._recs[row] = rec
        st.a_edges[row] = 1
        return rec

    def _row_of(self, action):
        aid = ActionId.parse(action)
        row = self._lookup(aid)
        if row is None:
            raise NotFound(f"action {aid} not found")
        return row

    def _row_or_retained(self, action):
        """``(row, None)`` for an action in the table, ``(-1, Retained)`` for one whose row
        was reclaimed (its outcome retained in the store); NotFound otherwise."""
        aid = ActionId.parse(action)
        row = self._lookup(aid)
        if row is not None:
            return row, None
        ret = self._retained(aid)
        if ret is None:
            raise NotFound(f"action {aid} not found")
        return -1, ret

    def _record(self, action):
        return self._rec(self._row_of(action))
