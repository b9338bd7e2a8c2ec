"""The shard loop's worker sessions (``docs/shard.md``, ``docs/protocol.md``): register,
heartbeat and report batches, BYE, and the LEASES pushed down each worker's stream. A
part of ``transport._shard._Loop``."""

import collections
import dataclasses

import numpy as np

from engine._codes import PHASES, TERMINAL_PHASES, Phase
from engine._errors import LeaseholdError
from transport import _protocol as p
from transport._shard_clients import _SPEC_CACHE, _plain
from transport._shard_watches import _Changes

__all__ = []

# Reported phases that are, once accepted, the action's phase (a failure may be a retry).
_AS_REPORTED = frozenset({Phase.INITIALIZING, Phase.RUNNING, Phase.SUCCEEDED})


def _refused_copies(tokens, names, refused):
    """Indexes of the refused reports among the named ones: for a token refused r times,
    its last r copies (a message may carry a token twice: the first copy applies, a later
    one is refused as COMPLETED, and only that one is dropped)."""
    left = collections.Counter(r.token for r in refused)
    skip = set()
    for i in range(len(names) - 1, -1, -1):
        if names[i] is None:
            continue
        tb = tokens[i].astype("<u8").tobytes()
        if left.get(tb, 0) > 0:
            left[tb] -= 1
            skip.add(i)
    return skip


class _NotRegistered(LeaseholdError):
    code = "NOT_FOUND"


class _Displaced(LeaseholdError):
    code = "ALREADY_EXISTS"


def _displaced_text(worker):
    return (f"worker {worker!r} was {p.DISPLACED} after this one: a "
            f"worker's name must be unique (is another process running as {worker!r}?); "
            f"this connection holds no session")


def _refused(rid, refused):
    if not refused:
        return p.Refused(rid=rid, tokens=np.zeros((0, 3), np.uint64),
                         verdicts=np.zeros(0, np.uint8))
    toks = b"".join(r.token for r in refused)
    return p.Refused(rid=rid, tokens=toks,
                     verdicts=np.array([int(r.verdict) for r in refused], np.uint8))


class WorkersMixin:
    """The worker sessions of the shard loop (a part of ``_Loop``)."""

    def on_register(self, conn, c, peer, msg):
        current = self.worker_conn.get(msg.worker)
        if c.displaced == msg.worker and current not in (None, conn) and current in self.conns:
            # Registered again from another connection since: two live workers share one
            # name, each taking the name back from the other at its next request (every
            # lease of both then expired). The later one keeps it; this one is told so.
            raise _Displaced(_displaced_text(msg.worker))
        self.eng.register_worker(msg.worker, msg.cluster, msg.slots, capacity=msg.capacity)
        c.displaced = None
        old = current
        if old is not None and old != conn and old in self.conns:
            self.conns[old].worker = None
            self.conns[old].displaced = msg.worker
        self.worker_conn[msg.worker] = conn
        c.worker = msg.worker
        self.session_no += 1
        self.out.append((conn, p.Registered(rid=msg.rid, worker=msg.worker,
                                            session=self.session_no, **self.reg), True))
        self.want_tick = True

    def _worker(self, conn, c, msg):
        # (The loop prefixes the message type to what is raised here.)
        if c.worker is None and c.displaced is not None:
            raise _Displaced(_displaced_text(c.displaced))
        if c.worker is None or self.worker_conn.get(c.worker) != conn:
            raise _NotRegistered("this connection has not registered a worker (send "
                                 "REGISTER first)")
        return c.worker

    def on_heartbeat(self, conn, c, peer, msg):
        worker = self._worker(conn, c, msg)
        # An empty heartbeat still counts: its free capacity (an idle worker's is the only
        # report that the capacity its last leases held is free again) and its proof that
        # the worker is alive (a worker paused after an expiry takes work again).
        refused = self.eng.heartbeat(worker, msg.tokens, msg.free, msg.node_free)
        self.shard._status.record_refusals("heartbeat", refused)
        self.out.append((conn, _refused(msg.rid, refused), True))
        if msg.free is not None or msg.node_free is not None or refused:
            self.want_tick = True       # capacity seen, or work ended

    def on_report(self, conn, c, peer, msg):
        worker = self._worker(conn, c, msg)
        n = msg.tokens.shape[0]
        codes = msg.phases.tolist()
        phases = [PHASES[x] for x in codes]
        kw = {}
        if msg.details:
            cols = {k: [None] * n for k in ("error_kinds", "causes", "messages")}
            cols["recoverable"] = [True] * n
            cols["cleanup"] = [False] * n
            cols["messages"] = [""] * n
            for d in msg.details:
                i = d["i"]
                for wire, col in (("error_kind", "error_kinds"), ("cause", "causes"),
                                  ("message", "messages"), ("recoverable", "recoverable"),
                                  ("cleanup", "cleanup")):
                    if d.get(wire) is not None:
                        cols[col][i] = d[wire]
            kw = cols
        # One phase for the whole batch (a worker's successes): given once, so the engine
        # checks it once instead of per report.
        same = not kw and n and codes.count(codes[0]) == n
        # What each report names, read before they are applied (the engine names only
        # live leases): when the lease map names them all, of one run (a fan-out's), in
        # columns; else a name a report.
        watching = len(self.watch) > 0
        named = self.leases.named_run(msg.tokens) if watching else None
        names = self._lease_names(msg.tokens) if watching and named is None else None
        refused = self.eng.report_many(msg.tokens, phases[0] if same else phases,
                                       worker=worker, **kw)
        self.shard._status.record_refusals("report", refused)
        self.out.append((conn, _refused(msg.rid, refused), True))
        self.want_tick = True
        if not watching:
            return
        if named is not None and same and not refused and phases[0] in _AS_REPORTED:
            # All accepted, of one phase the actions are now in (a worker's successes):
            # the records and the lease map's removals without a step a report.
            run, aids, attempts = named
            changes = _Changes(run, self.eng.clock.now_ns())
            changes.extend(aids, phases[0], attempts)
            self.records.append(changes)
            if phases[0] in TERMINAL_PHASES:
                self.leases.drop(msg.tokens[:, 0])
            return
        if names is None:
            names = self.leases.names(msg.tokens)   # (every one in the map: no engine read)
        self._watched_reports(msg.tokens, names, phases, refused, msg.details)

    def _lease_names(self, tokens):
        """``(run, action, attempt)`` of each token's lease where its run is watched (None
        elsewhere), read before the reports are applied (the engine names only live
        leases): from the lease map, else, for a lease it does not hold (pushed before its
        run was first watched: ``Client.wait`` subscribes after its enqueue), from the
        engine (``Engine.lease_actions``), its attempt then None (not known here)."""
        # The entry is this lease's only if the generations agree (a stale token of the
        # row, or an entry left by a lease that expired unreported, is not).
        names = self.leases.names(tokens)
        miss = [i for i, name in enumerate(names) if name is None]
        watched = self.watch.watched() if miss else ()
        if watched:
            for i, aid in zip(miss, self.eng.lease_actions(tokens[miss], watched),
                              strict=True):
                if aid is not None:
                    names[i] = (None, aid.rsplit("/", 1)[0], aid, None)
        return names

    def _watched_reports(self, tokens, names, phases, refused, details=None):
        """The watch records of a report message's accepted reports of watched runs
        (``names`` from :meth:`_lease_names`), in the message's order; a failure's (it may
        be a retry) from the phase the engine shows at once, before this turn's tick may
        lease a retry again (``details``: the message's, for the failure's text)."""
        skip = _refused_copies(tokens, names, refused) if refused else ()
        by_run = {}
        failed = []
        ended = []
        for i, name in enumerate(names):
            if name is None or i in skip:
                continue
            _gen, run, aid, attempt = name
            ph = phases[i]
            if ph in _AS_REPORTED:
                # An accepted report of these is the phase the action is now in: no need
                # to ask the engine (which would give a lean row its record). Its attempt
                # is its lease's (kept with the lease when it was pushed).
                changes = by_run.get(run)
                if changes is None:
                    changes = by_run[run] = _Changes(run, self.eng.clock.now_ns())
                changes.add(aid, ph, attempt if attempt is not None else
                            self.attempt_of(run, aid))
            else:
                failed.append((run, aid))
                self.check.add((run, aid))  # and after the turn (an abort's cleanup)
            if ph in TERMINAL_PHASES:
                ended.append(i)
        if ended:
            self.leases.drop(tokens[ended, 0])
        self.records.extend(by_run.values())
        if failed:
            # Read now: a retry due at once is leased again by this turn's tick, and read
            # after it the action was INITIALIZING again, so the failure of the attempt
            # before never became an event (docs/protocol.md promises QUEUED on a retry).
            why = {}
            for d in details or ():
                text = ": ".join(x for x in (d.get("cause"), d.get("message")) if x)
                name = names[d["i"]]
                if text and name is not None:
                    why[name[2]] = text
            self.reread(failed, self.eng.clock.now_ns(), why)

    def on_bye(self, conn, c, peer, msg):
        if msg.drain:
            self.eng.drain_worker(self._worker(conn, c, msg))
            self.reply(conn, msg.rid)
            return
        if c.worker is not None and self.worker_conn.get(c.worker) == conn:
            self.eng.unregister_worker(c.worker)
            del self.worker_conn[c.worker]
        c.worker = None
        self.conns.pop(conn, None)

    # ------------------------------------------------------------------ leases

    def push_leases(self, batch):
        """LEASES messages, one a worker (at most max_batch rows each), sent after commit."""
        workers = batch.worker
        distinct = dict.fromkeys(workers.tolist())
        for w in distinct:
            # (one worker, the common case: every row, no comparison)
            idx = np.arange(len(workers)) if len(distinct) == 1 else \
                np.flatnonzero(workers == w)
            wid = batch.worker_id(int(idx[0]))
            conn = self.worker_conn.get(wid)
            for lo in range(0, idx.size, self.settings.max_batch):
                part = idx[lo:lo + self.settings.max_batch]
                if conn is None:
                    self.shard._count("leases_unsent", int(part.size))
                    continue
                for frames, n in self._lease_frames(batch, part):
                    self.pushes.append((conn, frames, n))
        if len(self.watch):
            self._watched_leases(batch)

    def _lease_frames(self, batch, part):
        """``[(frames, leases)]``: the LEASES of rows ``part`` of ``batch``, halved until each
        message is within the frame limits a worker decodes with (leases of many distinct,
        large specs could pass them; the worker would drop the message whole)."""
        frames = p.encode(self._leases(batch, part))
        s = self.settings
        if part.size > 1 and (len(frames[1]) > s.max_header_bytes or any(
                memoryview(f).nbytes > s.max_frame_bytes for f in frames[2:])):
            half = part.size // 2
            return (self._lease_frames(batch, part[:half])
                    + self._lease_frames(batch, part[half:]))
        return [(frames, int(part.size))]

    def _watched_leases(self, batch):
        """The INITIALIZING watch records of the run leases of ``batch`` whose runs are
        watched, in the batch's order, and the lease map entries that name their actions
        when they are reported: a segment of consecutive leases of one enqueue group (a
        fan-out's, usually the whole batch) at a time, no Python loop over its leases
        beyond making their ids (text, from the group's names: no ActionId a lease)."""
        runs = np.flatnonzero(batch.kind == 0)   # (a finalize lease changes no action)
        if not runs.size:
            return
        now = self.eng.clock.now_ns()
        gids = batch.group[runs]
        cuts = np.flatnonzero(gids[1:] != gids[:-1]) + 1
        watched = {}            # group id -> (run key, names, its changes), None: unwatched
        by_run = {}
        initializing = Phase.INITIALIZING   # (an enum member read is a metaclass lookup)
        new_leases = self.new_leases
        for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), runs.size], strict=True):
            seg = runs[lo:hi]
            gid = int(gids[lo])
            hit = watched.get(gid, False)
            if hit is False:
                g = batch.group_of(int(seg[0]))
                run = g.compiled.id.run_key
                if run in self.watch:
                    changes = by_run.get(run)
                    if changes is None:
                        changes = by_run[run] = _Changes(run, now)
                    hit = (run, g.names, changes)
                else:
                    hit = None
                watched[gid] = hit
            if hit is None:
                continue
            run, names, changes = hit
            prefix = run + "/"
            aids = list(map(prefix.__add__, map(names.__getitem__,
                                                batch.index[seg].tolist())))
            # The lease map's entries: lease id -> (generation, run, action, attempt).
            new_leases.add(batch.tokens[seg, 0], batch.tokens[seg, 1], run, aids,
                           batch.attempt[seg])
            changes.extend(aids, initializing, batch.attempt[seg].tolist())
        self.records.extend(by_run.values())

    def _leases(self, batch, idx):
        # Groups in order of first appearance: lists and a dict, no sort (a LEASES message
        # of one lease, the idle round trip, costs what its one group costs).
        gids = batch.group[idx]
        if gids.size and (gids == gids[0]).all():
            # One group (a fan-out's leases, the common case): no step a lease.
            slot, firsts = {int(gids[0]): 0}, [int(idx[0])]
            inverse = np.zeros(idx.size, np.int32)
        else:
            slot, firsts = {}, []  # group id -> its index in groups; first entry of each
            inverse = []
            for i, gid in zip(idx.tolist(), gids.tolist(), strict=True):
                k = slot.get(gid)
                if k is None:
                    k = slot[gid] = len(firsts)
                    firsts.append(i)
                inverse.append(k)
            inverse = np.array(inverse, dtype=np.int32)
        groups, objs, bounds = [], [], []
        for gid, first in zip(slot, firsts, strict=True):
            g = batch.group_of(first)
            objs.append(g)
            entry = self.specs.get(gid)
            if entry is None or entry[2] is not g:
                aid = batch.action(first)
                spec = self.wire_specs.pop(str(g.compiled.spec.id), None)
                if spec is not None and (g.content is None
                                         or self.eng.content_of(spec) != g.content):
                    # Another declaration under that id (two fan-outs of one template id,
                    # say): the group's own spec, never the last one sent.
                    spec = None
                if spec is None:
                    spec = _plain(dataclasses.asdict(g.compiled.spec))
                entry = (aid.run_key, spec, g)
                if len(self.specs) >= _SPEC_CACHE:
                    self.specs.pop(next(iter(self.specs)))
                self.specs[gid] = entry
            env = g.compiled.env_key
            groups.append({"run": entry[0], "spec": entry[1]} if env is None else
                          {"run": entry[0], "spec": entry[1], "env": env})
            t = g.compiled.spec.timeouts
            bounds.append((t.deadline, t.max_queued_time))
        n = idx.size
        deadline = np.full(n, -1, np.int64)
        queued = np.full(n, -1, np.int64)
        if any(d is not None or q is not None for d, q in bounds):
            run = batch.kind[idx] == 0      # a finalize lease has neither bound
            for k, (d, q) in enumerate(bounds):
                sel = (inverse == k) & run
                if d is not None:
                    deadline[sel] = batch.first_enqueued_ns[idx[sel]] + int(d * 1e9)
                if q is not None:
                    queued[sel] = batch.attempt_enqueued_ns[idx[sel]] + int(q * 1e9)
        # Names (and input references) by group and index: lists, no numpy scalar a lease.
        at = batch.index[idx].tolist()
        if len(objs) == 1:
            names = list(map(objs[0].names.__getitem__, at))
        else:
            at = list(zip(inverse.tolist(), at, strict=True))
            names = [objs[k].names[j] for k, j in at]
        inputs = None
        if any(g.inputs is not None for g in objs):
            inputs = (list(map(objs[0].input_ref, at)) if len(objs) == 1 else
                      [objs[k].input_ref(j) for k, j in at])
            if all(ref is None for ref in inputs):
                inputs = None
        # The node hint (admission = "nodes"): each lease's pods' nodes, nil for the others.
        hints = batch.nodes
        nodes = [list(hints[i]) if i in hints else None for i in idx.tolist()] if hints else None
        return p.Leases(tokens=batch.tokens[idx], kind=batch.kind[idx],
                        attempt=batch.attempt[idx], group=inverse,
                        deadline_ns=deadline, queued_deadline_ns=queued, groups=groups,
                        names=names, inputs=inputs,
                        nodes=nodes if nodes and any(n is not None for n in nodes) else None)
