"""The shard loop's client requests (``docs/shard.md``, ``docs/protocol.md``): ping, the
enqueues (one, Flyte declarations, a fan-out), abort, status, explain, queue metrics and
update, watch. A part of ``transport._shard._Loop``: each handler runs inside the loop's
turn and leaves its answer in the turn's outbox."""

import dataclasses

import numpy as np

from engine._codes import Phase, Verdict
from engine._errors import LeaseholdError, NotFound
from transport import _protocol as p
from transport import _schema as sc
from transport._auth import (
    ADMIN,
    INSECURE,
    check_tenants,
    visible_metrics,
)
from transport._shard_watches import _Queued, _wire_attempts
from transport._shards import check_owned
from transport._watch import WatchGap

__all__ = []

_SPEC_CACHE = 4096          # enqueue groups whose wire spec is kept for LEASES


def _plain(value):
    """A value as plain data for a reply body (enums by value, tuples as lists)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):   # a queue's budget vector: a list, not its str()
        return value.tolist()
    if isinstance(value, Phase):
        return value.value
    if hasattr(value, "value") and not isinstance(value, (str, int, float, bool)):
        return value.value
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


class _Unimplemented(LeaseholdError):
    code = "UNIMPLEMENTED"


class ClientsMixin:
    """The client requests of the shard loop (a part of ``_Loop``)."""

    def on_ping(self, conn, c, peer, msg):
        body = {"shard": self.shard.name, "version": p.VERSION}
        if peer.role in (ADMIN, INSECURE):
            body["counters"] = self.shard.counters   # operators (and benches) read them
        self.reply(conn, msg.rid, body)

    def _keep_spec(self, spec):
        if len(self.wire_specs) >= _SPEC_CACHE:
            self.wire_specs.pop(next(iter(self.wire_specs)))
        self.wire_specs[spec["id"]] = spec

    def on_enqueue(self, conn, c, peer, msg):
        ids = self.eng.enqueue_many(msg.specs)
        out = [str(a) for a in ids]
        for spec in msg.specs[:_SPEC_CACHE]:
            self._keep_spec(spec)
        self.reply(conn, msg.rid, {"ids": out})
        self.want_tick = True
        if len(self.watch):
            # The ids it enqueued (one that existed is a no-op: no event), as the engine's
            # own checks found them (Engine.known asked first read the store twice an id).
            self.record_queued(out if ids.added.all() else
                               [a for a, new in zip(out, ids.added.tolist(), strict=True)
                                if new])

    def on_enqueue_flyte(self, conn, c, peer, msg):
        try:
            from engine.flyte import enqueue_fanouts, flyte_fanouts
        except ImportError as exc:
            raise _Unimplemented(f"this shard cannot read Flyte messages: {exc}") from None
        fanouts = flyte_fanouts(msg.requests, resources=self.eng.config.resources,
                                kind=msg.kind)
        # The tenants are known only now: every action and parent is checked before any
        # is enqueued.
        keys = [key for f in fanouts for key in (
            [f"{f.template.id.rsplit('/', 1)[0]}/{n}" for n in f.names]
            + ([f.template.parent] if f.template.parent else []))]
        check_tenants(peer, "ENQUEUE_FLYTE", keys)
        check_owned(keys, self.shard.shard_index, self.shard.n_shards)
        self._check_flyte_limits(fanouts)
        known = self.known_watched([f"{f.template.id.rsplit('/', 1)[0]}/{n}" for f in fanouts
                                    for n in f.names]) if len(self.watch) else ()
        try:
            out = [str(a) for a in enqueue_fanouts(self.eng, fanouts)]
        except LeaseholdError as exc:
            # A later fan-out refused: the earlier ones are enqueued, and watched (the error
            # names them).
            done = getattr(exc, "enqueued", None)
            if done:
                self.want_tick = True
                self.record_queued(done, known)
            raise
        self.reply(conn, msg.rid, {"ids": out})
        self.want_tick = True
        self.record_queued(out, known)

    def _check_flyte_limits(self, fanouts):
        """Each decoded fan-out within the limits its ENQUEUE_FANOUT would meet and every
        lease of it must meet on its way to a worker: its ids, parent and the spec's names
        within ``transport.max_name``, its inputs within ``max_text`` (an over-long name was
        stored, and every LEASES message carrying it was dropped by the worker, with the
        other leases in it). TOO_LARGE names the request; nothing is enqueued."""
        s = self.settings
        name, text = s.max_name, s.max_text
        first = 0
        for f in fanouts:
            t = f.template
            run = t.id.rsplit("/", 1)[0]
            bad = None
            j = p.long_action_id(run, f.names, name)
            if j is not None:
                bad = (j, f"the action id is {len(run) + 1 + len(f.names[j])} characters, "
                          f"over the limit {name} (transport.max_name)")
            elif t.parent is not None and len(t.parent) > name:
                bad = (0, f"the parent id is {len(t.parent)} characters, over the limit "
                          f"{name} (transport.max_name)")
            elif f.inputs is not None and max(
                    (len(r) for r in f.inputs if r is not None), default=0) > text:
                j = next(j for j, r in enumerate(f.inputs) if r is not None and len(r) > text)
                bad = (j, f"input_uri is {len(f.inputs[j])} characters, over the limit {text} "
                          f"(transport.max_text)")
            else:
                for field, value in sc.spec_names(t):
                    if len(value) > name:
                        bad = (0, f"its {field} is {len(value)} characters, over the limit "
                                  f"{name} (transport.max_name)")
                        break
            if bad is not None:
                raise p.ProtocolError("TOO_LARGE", f"requests[{first + bad[0]}]: {bad[1]}")
            first += len(f.names)

    def on_enqueue_fanout(self, conn, c, peer, msg):
        run = msg.template["id"].rsplit("/", 1)[0]
        done = self.eng.enqueue_fanout(msg.template, msg.names, msg.inputs)
        self._keep_spec(msg.template)
        self.reply(conn, msg.rid, {"n": len(done)})
        self.want_tick = True
        if run in self.watch:
            # The names it enqueued (a name that existed is a no-op: no event), as the
            # engine's own probe found them (Engine.known asked first cost ~2.5 us a name).
            names = msg.names
            added = done.added
            prefix = run + "/"
            self.record_queued(list(map(prefix.__add__, names if added.all() else map(
                names.__getitem__, np.flatnonzero(added).tolist()))), run=run)

    def known_watched(self, ids):
        """The ids (texts; None or another type for a spec without one) of watched runs
        among ``ids`` that the engine knows already (``Engine.known``), read before their
        enqueue: an enqueue of a known id with its spec changes nothing (with another it is
        refused), so it records no event. (Until 2026-12-03 every id an enqueue answered was
        recorded QUEUED of attempt 0: a client's retried enqueue told the watchers that a
        running action, or one that had ended, was queued again.)"""
        watched = [a for a in ids if type(a) is str and a.rsplit("/", 1)[0] in self.watch]
        if not watched:
            return ()
        return {a for a, k in zip(watched, self.eng.known(watched).tolist(), strict=True)
                if k}

    def record_queued(self, ids, known=(), run=None):
        """QUEUED watch records of the enqueued ids (action id texts) of watched runs, but
        for those in ``known`` (:meth:`known_watched`: they existed before; ENQUEUE and
        ENQUEUE_FANOUT pass only the ids their enqueue added instead). ``run``: every id
        is of that watched run (a fan-out's)."""
        if not len(self.watch):
            return
        if run is not None:
            if ids:
                self.records.append(_Queued(run, ids, self.eng.clock.now_ns()))
            return
        by_run = {}
        for a in ids:
            run = a.rsplit("/", 1)[0]
            if run in self.watch and a not in known:
                by_run.setdefault(run, []).append(a)
        # One entry a run (a fan-out's thousands of records in one record_many pass).
        now = self.eng.clock.now_ns()
        for run, run_ids in by_run.items():
            self.records.append(_Queued(run, run_ids, now))

    def on_abort(self, conn, c, peer, msg):
        held = self.eng.live_leases(msg.action)
        ended = [str(a) for a in self.eng.abort(msg.action, msg.reason or "aborted")]
        self.reply(conn, msg.rid, {"ended": ended})
        # Their holders stop now (an unsolicited REFUSED after the commit), not at their
        # next heartbeat; a holder that is not connected learns it from that heartbeat.
        for worker, tokens in held.items():
            wconn = self.worker_conn.get(worker)
            if wconn is None:
                continue
            for lo in range(0, tokens.shape[0], self.settings.max_batch):
                part = tokens[lo:lo + self.settings.max_batch]
                self.stops.append((wconn, p.encode(p.Refused(
                    rid=None, tokens=part,
                    verdicts=np.full(part.shape[0], int(Verdict.ABORTED), np.uint8))),
                    part.shape[0]))
        self.want_tick = True       # ended work frees capacity
        run = msg.action.rsplit("/", 1)[0]
        if run in self.watch:
            self.check.update((a.rsplit("/", 1)[0], a) for a in ended)
            # The run's other tracked actions too (a cleanup ends, a queued one is gone).
            self.check.update((run, a) for a in self.watch.tracked(run))

    def on_status(self, conn, c, peer, msg):
        # In one pass (Engine.phases / states: one by one, 10,000 ids held the loop for
        # 140-160 ms); the attempts only when a run is watched.
        actions = msg.actions
        watching = len(self.watch) > 0
        if watching:
            phases, attempts = self.eng.states(actions)
        else:
            phases, attempts = self.eng.phases(actions), None
        if None in phases:
            # Unknown: the engine's own NOT_FOUND for the first such id.
            missing = actions[phases.index(None)]
            self.eng.phase(missing)
            raise NotFound(f"action {missing} not found")
        self.reply(conn, msg.rid, {"phases": [ph.value for ph in phases]})
        if watching:
            # A watcher reads STATUS once after subscribing (Client.wait): what it found
            # still running may have been assigned before the watch began, so no report
            # of it would be recorded; the backstop re-check follows it from now on, from
            # its attempt now (until 2026-12-03 from attempt 0: the events of one assigned
            # before said attempt 0 until its next assignment).
            by_run = {}             # watched run -> indexes of its ids, in order
            last = hit = None
            for i, a in enumerate(actions):
                run = a.rpartition("/")[0]
                if run != last:
                    last = run
                    hit = by_run.get(run)
                    if hit is None and run in self.watch:
                        hit = by_run[run] = []
                if hit is not None:
                    hit.append(i)
            for run, idx in by_run.items():
                ph = [phases[i] for i in idx]
                self.watch.track_many(run, [actions[i] for i in idx], ph,
                                      _wire_attempts(ph, [attempts[i] for i in idx]))

    def on_explain(self, conn, c, peer, msg):
        # A head of another tenant's is not named (as visible_metrics blanks it).
        e = self.eng.explain(msg.action, reveal=lambda aid: peer.owns(str(aid)))
        body = {f.name: _plain(getattr(e, f.name)) for f in dataclasses.fields(e)} \
            if dataclasses.is_dataclass(e) else _plain(e._asdict())
        self.reply(conn, msg.rid, body)

    def on_queue_metrics(self, conn, c, peer, msg):
        m = self.eng.queue_metrics(msg.queue)
        self.reply(conn, msg.rid, _plain(visible_metrics(peer, m)))

    def on_queue_update(self, conn, c, peer, msg):
        q = self.eng.update_queue(msg.queue, **msg.changes)
        self.reply(conn, msg.rid, _plain(dataclasses.asdict(q)))
        self.want_tick = True
        self.shard._status.mark_dirty()     # published after this turn, whatever the interval

    def on_watch(self, conn, c, peer, msg):
        fresh = msg.run not in self.watch
        try:
            latest, events = self.watch.watch(msg.run, conn, msg.since)
        except WatchGap as exc:
            self.error(conn, msg.rid, "NOT_FOUND", str(exc))
            return
        if fresh:
            # The run's changes before its first WATCH (in this process: a restart starts
            # every log afresh) were not recorded: have the re-check follow what is live,
            # from its phase and attempt now (read in one pass: one by one, a run of 10,000
            # live actions held the loop for 230 ms).
            ids, phases, attempts = self.eng.live_states(msg.run, self.watch.max_live)
            self.watch.track_many(msg.run, ids, phases, _wire_attempts(phases, attempts))
        # "first": the seq the replay starts at (latest + 1 when it is empty), so a watcher
        # from since=0 knows which seq comes next and sees a gap even before its first event.
        self.reply(conn, msg.rid, {"seq": latest, "first": events[0].seq if events else latest + 1})
        for batch in self._batches(msg.run, events):    # the replay, after the reply
            self.out.append((conn, batch, False))

    def on_unwatch(self, conn, c, peer, msg):
        self.watch.unwatch(msg.run, conn)
        self.reply(conn, msg.rid)
