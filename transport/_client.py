"""The client (``transport.Client``): enqueue, abort, status, explain, queue metrics, live
queue updates, and watches that push every state change of a run (``docs/shard.md``).

Routing (``docs/operations.md``, "Several shards"): a client of a config with several
``transport.endpoints`` keeps one lazily opened connection per shard and sends each request
about an action or run to the shard that owns its tenant (``transport.tenant_shard``, the
partition map every shard enforces). A batch (``enqueue_many``, ``enqueue_flyte``) is atomic
on one shard only, so one naming tenants of several shards is refused before anything is sent
(:class:`CrossShardBatch`); ``status`` splits its ids (a read needs no atomicity). Queue
metrics, queue updates and ``ping`` are per shard: they go to every shard and answer
``{shard index: answer}``. ``shard=N`` or ``endpoint=`` pins a client to one shard (it then
sends everything there, and a shard that does not own a tenant refuses: ``WRONG_SHARD``).

Every request waits at most ``timeout`` seconds; a timeout raises :class:`ShardTimeout`, an
ERROR answer :class:`ShardError`, both naming the shard and the request. Not thread-safe: one
thread drives one client.
"""

import itertools
import math
import time

import numpy as np
import zmq

from engine._codes import PHASE_CODE, PHASES, TERMINAL_PHASES, Phase
from engine._config import Config, TransportSettings, load_config
from engine._errors import LeaseholdError, SpecError
from engine._model import ActionId
from transport import _protocol as p
from transport._events import EventQueue
from transport._keys import load_client_keys
from transport._shards import split_by_shard, tenant_of, tenant_shard
from transport._sockets import client_socket, send
from transport._worker import ShardError, ShardTimeout

__all__ = ["Client", "ClientClosed", "CrossShardBatch", "WatchLost"]

_TERMINAL_CODES = np.array(sorted(PHASE_CODE[ph] for ph in TERMINAL_PHASES), np.uint8)


class WatchLost(ShardError):
    """A watch cannot resume: the shard no longer holds the events after the last ``seq``
    seen (its ring moved on, or it restarted). Re-read the status and watch again."""


class ClientClosed(LeaseholdError):
    """A request on a :class:`Client` after its ``close()``."""

    code = "UNAVAILABLE"


#: The kind ``ENQUEUE_FLYTE`` names for each flyteidl2 enqueue message.
_FLYTE_KINDS = {"flyteidl2.workflow.EnqueueActionRequest": "queue",
                "flyteidl2.actions.EnqueueRequest": "actions"}


def _items(value, what):
    """``value`` as a list of items: a list, tuple or other iterable, not a string, bytes
    or a map (whose characters or keys would be taken for the items)."""
    if value is None or isinstance(value, (str, bytes, bytearray, memoryview, dict)):
        raise SpecError(f"{what} must be a list, not {type(value).__name__}")
    try:
        return list(value)
    except TypeError:
        raise SpecError(f"{what} must be a list, not {type(value).__name__}") from None


class CrossShardBatch(LeaseholdError):
    """A batch given to a routing client names tenants of several shards. A batch is atomic
    on one shard only, so it is refused whole before anything is sent; ``shards`` maps each
    shard index to the positions of the batch it owns (send one batch per shard)."""

    code = "INVALID_ARGUMENT"

    def __init__(self, what, keys, groups):
        where = "; ".join(f"shard {s}: {len(ix)} (e.g. tenant {tenant_of(keys[ix[0]])!r})"
                          for s, ix in sorted(groups.items()))
        super().__init__(f"{what}: the batch spans {len(groups)} shards ({where}); a batch "
                         f"is atomic on one shard only: send one batch per shard "
                         f"(transport.split_by_shard groups them)")
        self.shards = {s: list(ix) for s, ix in groups.items()}


class _Link:
    """One shard the client talks to: its index (None: an endpoint given without one), its
    endpoint, the name errors give it, and its socket (opened on first use)."""

    __slots__ = ("index", "endpoint", "label", "sock")

    def __init__(self, index, endpoint):
        self.index = index
        self.endpoint = endpoint
        self.label = endpoint if index is None else f"{index} at {endpoint}"
        self.sock = None


def _labels(links):
    return ", ".join(link.label for link in links)


class Client:
    """A client of the shards of one config (routing by tenant), or of one shard.

    Either ``config`` (a Config or a path: endpoints from ``transport.endpoints``, limits
    from ``[transport]``) and ``key`` (the key name: ``keys_dir/KEY.key_secret``, with the
    shards' ``server_key.key`` from ``[security]``), or ``endpoint`` and ``keys`` (a
    :class:`~transport.ClientKeys`, None for a shard run insecure).

    With a config of several endpoints and no ``shard``, the client routes: each request
    goes to the shard owning its tenant (see the module text); ``shard=N`` pins it to
    ``endpoints[N]``, as does ``endpoint=``. :attr:`routed` says which; :attr:`endpoints`
    are the shards it may talk to, :attr:`endpoint` the one shard of a client that talks to
    one (None when it routes)."""

    def __init__(self, config=None, *, key=None, endpoint=None, keys=None, shard=None,
                 timeout=10.0, settings=None, context=None, heartbeat=None):
        if config is not None and not isinstance(config, Config):
            config = load_config(config)
        self.config = config
        if endpoint is not None:
            links = [_Link(shard, endpoint)]
        elif config is None:
            raise ValueError("Client needs a config or an endpoint")
        else:
            eps = config.transport.endpoints
            if shard is None:
                links = [_Link(i, ep) for i, ep in enumerate(eps)]
            elif isinstance(shard, int) and 0 <= shard < len(eps):
                links = [_Link(shard, eps[shard])]
            else:
                raise ValueError(f"Client: shard {shard!r}: {config.source} has {len(eps)} "
                                 f"endpoint(s) in transport.endpoints (0..{len(eps) - 1})")
        if keys is None and config is not None and not config.security.insecure:
            if key is None:
                raise ValueError("Client: a CURVE shard needs key= (the client key's name)")
            keys = load_client_keys(config.security.keys_dir, key, config.security.server_key)
        self._links = links
        #: Whether requests are routed by tenant over several shards.
        self.routed = len(links) > 1
        #: The endpoints this client may talk to (index: shard, when routed).
        self.endpoints = tuple(link.endpoint for link in links)
        #: The endpoint of a client of one shard; None when it routes.
        self.endpoint = None if self.routed else links[0].endpoint
        self.keys = keys
        self.settings = settings or (config.transport if config is not None
                                     else TransportSettings())
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
                0 < timeout < math.inf):
            raise ValueError(f"Client: timeout must be a positive number of seconds, not "
                             f"{timeout!r}")
        self.timeout = timeout
        self._closed = False
        self._own_ctx = context is None
        self._ctx = context if context is not None else zmq.Context()
        self._heartbeat = heartbeat
        self._decoder = p.Decoder(self.settings)
        self._rids = itertools.count(1)
        self._q = EventQueue()                  # watched runs, events not taken yet

    # ------------------------------------------------------------------ routing

    def _link_of(self, key):
        """The link owning the tenant of action id or run key ``key``."""
        if not self.routed:
            return self._links[0]
        if not isinstance(key, (str, ActionId)):
            raise SpecError(f"{key!r} is not an action id or run key: a client of several "
                            f"shards routes by its tenant (its first segment)")
        return self._links[tenant_shard(tenant_of(key), len(self._links))]

    def endpoint_of(self, key):
        """The endpoint a request about action id or run key ``key`` goes to."""
        return self._link_of(key).endpoint

    def _one_link(self, what, keys):
        """The one link every key of a batch goes to; :class:`CrossShardBatch` if none."""
        if not self.routed:
            return self._links[0]
        for i, key in enumerate(keys):
            if not isinstance(key, str):
                raise SpecError(f"{what}: specs[{i}] has no string id: a client of several "
                                f"shards routes a spec by its id's tenant")
        groups = split_by_shard(keys, len(self._links))
        if len(groups) > 1:
            raise CrossShardBatch(what, keys, groups)
        return self._links[next(iter(groups))]

    # ------------------------------------------------------------------ connection

    def _check_open(self):
        if self._closed:
            raise ClientClosed("this client is closed: make a new Client")

    def _socket(self, link):
        self._check_open()
        if link.sock is None:
            link.sock = client_socket(self._ctx, link.endpoint, self.keys, self.settings,
                                      heartbeat=self._heartbeat)
        return link.sock

    def _drop(self, link):
        if link.sock is not None:
            link.sock.close(0)
            link.sock = None

    def reconnect(self):
        """Drop every connection and open new ones as needed; watches resume from their
        last seq."""
        self._check_open()
        for link in self._links:
            self._drop(link)
        for run in list(self._q.watching):
            self._resume(run)

    def _reconnect_link(self, link, runs=None):
        self._drop(link)
        for run in [r for r in self._q.watching if self._link_of(r) is link]:
            if runs is None or run in runs:
                self._resume(run)
            else:
                self._q.resync.add(run)     # resumed when asked for (next_event)

    def close(self):
        """Close the sockets (and the context this client made); every later request
        raises :class:`ClientClosed`. Closing twice is harmless."""
        self._closed = True
        for link in self._links:
            self._drop(link)
        if self._own_ctx:
            # destroy, not term: a socket a Ctrl-C left half made (created, never kept)
            # would block term for ever.
            self._ctx.destroy(linger=0)
            self._own_ctx = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ requests

    def _per_shard(self, make, what):
        """``make()`` sent to every shard: the answer, or ``{shard: answer}`` when routed.
        Shard by shard in index order; an error names the shards that already took it."""
        if not self.routed:
            return self._call(self._links[0], make(), what)
        out = {}
        for link in self._links:
            try:
                out[link.index] = self._call(link, make(), what)
            except ShardError as exc:
                if not out:
                    raise
                raise type(exc)(exc.shard, what, exc.code, f"{exc.error_message} (shard(s) "
                                f"{', '.join(map(str, out))} took it already)") from None
            except ShardTimeout as exc:
                if not out:
                    raise
                raise ShardTimeout(f"{exc} (shard(s) {', '.join(map(str, out))} took it "
                                   f"already)") from None
        return out

    def ping(self):
        """The shard's name and protocol version (``{shard: answer}`` when routed)."""
        return self._per_shard(lambda: p.Ping(rid=next(self._rids)), "PING")

    def enqueue(self, spec):
        """Enqueue one action (an ActionSpec or a map); returns its id."""
        return self.enqueue_many([spec])[0]

    def enqueue_many(self, specs):
        """Enqueue a batch atomically (durable when this returns); returns the ids. The
        batch goes to one shard: a routing client refuses, before sending anything, a batch
        whose specs' tenants belong to several shards (:class:`CrossShardBatch`; split it
        with ``transport.split_by_shard``)."""
        maps = [p.spec_map(s) for s in _items(specs, "specs")]
        link = self._one_link("ENQUEUE", [m.get("id") for m in maps])
        return self._call(link, p.Enqueue(rid=next(self._rids), specs=maps), "ENQUEUE")["ids"]

    def enqueue_fanout(self, template, names, inputs=None):
        """Enqueue ``len(names)`` actions sharing ``template`` (one run: one shard);
        returns how many."""
        template = p.spec_map(template)
        link = self._one_link("ENQUEUE_FANOUT", [template.get("id")])
        return self._call(link, p.EnqueueFanout(rid=next(self._rids), template=template,
                                                names=_items(names, "names"),
                                                inputs=_items(inputs, "inputs")
                                                if inputs is not None else None),
                          "ENQUEUE_FANOUT")["n"]

    def enqueue_flyte(self, requests, kind=None):
        """Enqueue Flyte 2 declarations as the SDK writes them (``docs/flyte.md``): one or a
        list of flyteidl2 ``EnqueueActionRequest`` / ``EnqueueRequest`` messages or their
        serialised bytes (``kind`` "queue" or "actions" when known). The shard decodes them
        (it needs ``leasehold[flyte]``) and enqueues each fan-out atomically; returns the
        action ids, in order. A routing client decodes them too, to find their tenants'
        shard (so it needs ``leasehold[flyte]`` as well); one shard a call, as
        :meth:`enqueue_many`."""
        if isinstance(requests, (bytes, bytearray, memoryview)) or hasattr(
                requests, "SerializeToString"):
            requests = [requests]
        raw = []
        requests = _items(requests, "requests")
        for i, r in enumerate(requests):
            if isinstance(r, (bytes, bytearray, memoryview)):
                raw.append(bytes(r))
            elif hasattr(r, "SerializeToString") and hasattr(r, "DESCRIPTOR"):
                raw.append(r.SerializeToString())
            else:
                raise SpecError(f"requests[{i}]: a flyteidl2 enqueue message or its bytes, "
                                f"not {type(r).__name__}")
        if kind is None and requests and all(hasattr(r, "DESCRIPTOR") for r in requests):
            # Message objects say what they are (bytes are tried as either by the shard).
            kinds = {_FLYTE_KINDS.get(r.DESCRIPTOR.full_name) for r in requests}
            kind = kinds.pop() if len(kinds) == 1 else None
        link = self._links[0]
        if self.routed:
            link = self._one_link("ENQUEUE_FLYTE", _flyte_keys(raw, kind))
        return self._call(link, p.EnqueueFlyte(rid=next(self._rids), requests=raw, kind=kind),
                          "ENQUEUE_FLYTE")["ids"]

    def abort(self, action, reason=None):
        """Abort ``action`` and its descendants; returns the ids that ended at once."""
        return self._call(self._link_of(action),
                          p.Abort(rid=next(self._rids), action=str(action), reason=reason),
                          "ABORT")["ended"]

    def status(self, actions):
        """The phase of each action id (a list in, a list of Phase out; one id, one Phase).
        A routing client asks each owning shard for its ids (one request a shard)."""
        one = isinstance(actions, (str, ActionId))
        ids = [str(actions)] if one else [str(a) for a in _items(actions, "actions")]
        groups = split_by_shard(ids, len(self._links)) if self.routed and ids else \
            {None: list(range(len(ids)))}
        phases = [None] * len(ids)
        for shard, idx in groups.items():
            link = self._links[0] if shard is None else self._links[shard]
            part = [ids[i] for i in idx]
            got = self._call(link, p.Status(rid=next(self._rids), actions=part),
                             "STATUS")["phases"]
            for i, x in zip(idx, got, strict=True):
                phases[i] = Phase(x)
        return phases[0] if one else phases

    def explain(self, action):
        """Why ``action`` is where it is (a map: action, phase, wait, reason, ...)."""
        return self._call(self._link_of(action),
                          p.Explain(rid=next(self._rids), action=str(action)), "EXPLAIN")

    def queue_metrics(self, queue=None):
        """``Engine.queue_metrics`` over the wire (one queue, or all). Queues are per
        shard: a routing client asks every shard and returns ``{shard: metrics}`` (not
        merged: each shard's depth, in-flight counts and blocked head are its own)."""
        return self._per_shard(lambda: p.QueueMetrics(rid=next(self._rids), queue=queue),
                               "QUEUE_METRICS")

    def queue_update(self, queue, **changes):
        """Change a queue live (an admin key); returns its new settings. A routing client
        changes it on every shard, in index order, and returns ``{shard: settings}``; this
        is not atomic across shards: an error names the shards that took it already (every
        shard checks a change by the same config rules, so a refusal comes from the first)."""
        return self._per_shard(lambda: p.QueueUpdate(rid=next(self._rids), queue=queue,
                                                     changes=changes), "QUEUE_UPDATE")

    # ------------------------------------------------------------------ watches

    def watch(self, run, since=0, timeout=None, refresh=2.0):
        """Iterate over the state changes of ``run`` (``tenant/project/domain/run``) as
        :class:`~transport.Event` messages, in ``seq`` order, each once, for as long as the
        caller iterates; ``timeout`` (None: forever) bounds the wait for each event (then
        :class:`ShardTimeout`). Silence for ``refresh`` seconds re-sends WATCH from the last
        seq (so a push lost to a dropped connection is replayed); a shard that does not
        answer is reconnected. :class:`WatchLost` when the shard no longer holds the
        events to resume from."""
        self.subscribe(run, since)
        try:
            while True:
                yield self.next_event(timeout=timeout, refresh=refresh, runs=(run,))
        finally:
            self.unsubscribe(run)

    def subscribe(self, run, since=0):
        """Start receiving EVENTs of ``run`` (from the shard owning it) after ``since``;
        returns the run's latest seq."""
        self._link_of(run)          # a bad key is refused before it is watched
        before = self._q.watching.get(run)
        self._q.watching[run] = since
        try:
            return self._subscribe(run, since)
        except ShardTimeout:
            raise       # it may be watched there: its events will resume the watch
        except LeaseholdError:
            # Refused: watched as before this call, not from a ``since`` every later
            # resume would send again (and be refused again).
            if before is None:
                self._q.watching.pop(run, None)
            else:
                self._q.watching[run] = before
            raise

    def unsubscribe(self, run):
        """Stop receiving EVENTs of ``run`` (best effort)."""
        self._check_open()
        self._q.forget_early(run)
        if self._q.watching.pop(run, None) is not None:
            link = self._link_of(run)
            if link.sock is not None:
                send(link.sock, p.encode(p.Unwatch(rid=next(self._rids), run=run)))
        self._q.drop((run,))

    def _resume(self, run):
        # From the last seq accounted for: the last event taken, or the seq just before the
        # first one a WATCH said it would replay. Never from an answer's latest seq: events
        # up to it may still have been on their way (a reconnect drops them).
        self._q.forget_early(run)       # the resume replays them
        return self._subscribe(run, self._q.watching[run])

    def _subscribe(self, run, since):
        link = self._link_of(run)
        msg = self._watch_request(run, since)
        try:
            return self._watched(run, self._call(link, msg, f"WATCH {run}"))
        except ShardError as exc:
            raise _watch_lost(exc, link, run) from None
        finally:
            self._watch_answered(run)

    def _watch_request(self, run, since):
        """The WATCH of ``run`` from ``since``, its answer awaited from now on (pushed
        events of the run are held until it comes: ``EventQueue.hold``)."""
        self._q.awaiting(run)
        return p.Watch(rid=next(self._rids), run=run, since=since)

    def _watched(self, run, body):
        """Take WATCH ``run``'s answer ``body``; returns the run's latest seq."""
        self._q.answered(run, body["first"], body["seq"])
        return body["seq"]

    def _watch_answered(self, run):
        """The WATCH of ``run`` was answered or will not be (its call ended)."""
        self._q.answer_done(run)

    def _watched_labels(self, runs):
        runs = self._q.watching if runs is None else runs
        links = {id(lk): lk for lk in (self._link_of(r) for r in runs)}
        return _labels(sorted(links.values(), key=lambda lk: lk.index or 0)) or \
            _labels(self._links)

    def next_event(self, timeout=None, refresh=2.0, runs=None):
        """The next new EVENT of a subscribed run (of ``runs`` when given), from whichever
        shard pushes it (every open connection is polled); see :meth:`watch`."""
        return self._next(self._q.take_one, timeout, refresh, runs)

    def next_events(self, timeout=None, refresh=2.0, runs=None):
        """The next new events of a subscribed run (of ``runs`` when given) as one
        :class:`~transport.Events` batch: consecutive seqs of one run, in columns (the
        phases as ``engine._codes.PHASES`` codes; ``events()`` gives them as
        :class:`~transport.Event` messages), as many as have arrived together (one pushed
        message's, less those already taken). The same events, order and guarantees as
        :meth:`next_event` (which takes them one at a time; the two may be mixed), without
        an object an event: for a caller that follows large runs."""
        return self._next(self._q.take_batch, timeout, refresh, runs)

    def _next(self, take, timeout, refresh, runs):
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # Only the runs asked for (all when ``runs`` is None): another run's resume waits
            # until it is asked for, so its WatchLost cannot end a wait for these.
            if self._q.resync:        # (a comprehension an event cost ~0.3 us)
                for run in [r for r in self._q.resync if runs is None or r in runs]:
                    self._q.resync.discard(run)
                    if run in self._q.watching:
                        self._resume_or_retry(run)
            if runs is None:
                if self._q.queue:
                    return take(0)
            else:
                for i, e in enumerate(self._q.queue):
                    if e.run in runs:
                        return take(i)
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise ShardTimeout(f"shard {self._watched_labels(runs)}: watch: no event "
                                   f"within {timeout}s")
            wait = refresh if deadline is None else min(refresh, deadline - now)
            msg = self._recv_any(time.monotonic() + wait)
            if msg is None:
                # Silence: resubscribe from the last seq (replays anything a lost push
                # missed); a shard that cannot answer gets a new connection.
                redone = set()          # links reconnected (their runs resumed) just now
                for run in list(self._q.watching):
                    if runs is not None and run not in runs:
                        continue        # resumed when asked for (see the top of the loop)
                    link = self._link_of(run)
                    if run not in self._q.watching or id(link) in redone:
                        continue
                    try:
                        self._resume_or_retry(run)
                    except ShardTimeout:
                        redone.add(id(link))
                        self._reconnect_link(link, runs)

    def _resume_or_retry(self, run):
        """:meth:`_resume`, where an UNAVAILABLE answer (the WATCH's turn was undone with a
        failed commit: retry) leaves the watch as it was, to be resumed at the next silence;
        it ended ``next_event`` (and ``wait``) with a ShardError."""
        try:
            self._resume(run)
        except ShardError as exc:
            if exc.code != "UNAVAILABLE":
                raise

    def wait(self, actions, timeout=60.0):
        """Wait until every action (ids, one run or several, on one shard or several) is
        terminal, by watch pushes (no polling: one STATUS after subscribing, then events).
        Returns ``{action id: Phase}``."""
        ids = [str(a) for a in ([actions] if isinstance(actions, (str, ActionId))
                                else _items(actions, "actions"))]
        return self._wait(ids, timeout)

    def run_fanout(self, template, names, inputs=None, timeout=60.0):
        """Enqueue a fan-out as :meth:`enqueue_fanout` does and wait until each of its
        actions has ended, as :meth:`wait` does, in one round trip before the events: its
        run's WATCH (unless watched already), the ENQUEUE_FANOUT and the STATUS of its ids go
        back to back. Returns ``{action id: Phase}``; an enqueue the shard refuses raises
        its ShardError (nothing is enqueued, and nothing stays watched)."""
        template = p.spec_map(template)
        tid = template.get("id")
        run = ActionId.parse(tid).run_key       # (SpecError naming what is wrong)
        link = self._one_link("ENQUEUE_FANOUT", [tid])
        enqueue = p.EnqueueFanout(rid=next(self._rids), template=template,
                                  names=_items(names, "names"),
                                  inputs=_items(inputs, "inputs") if inputs is not None else None)
        return self._wait([f"{run}/{n}" for n in enqueue.names], timeout,
                          (link, enqueue, "ENQUEUE_FANOUT"))

    def _wait(self, ids, timeout, first=None):
        runs = {a.rsplit("/", 1)[0] for a in ids}
        deadline = time.monotonic() + timeout
        mine = [r for r in runs if r not in self._q.watching]
        try:
            done = {}
            for a, ph in zip(ids, self._watch_and_status(mine, ids, first), strict=True):
                if ph in TERMINAL_PHASES:
                    done[a] = ph
            want = set(ids) - set(done)
            while want:
                left = deadline - time.monotonic()
                if left <= 0:
                    late = {a.rsplit("/", 1)[0] for a in want}
                    raise ShardTimeout(f"shard {self._watched_labels(late)}: wait: "
                                       f"{len(want)} action(s) not ended within {timeout}s "
                                       f"(e.g. {min(want)})")
                try:
                    got = self.next_events(timeout=left, runs=runs)
                except ShardTimeout:
                    if time.monotonic() < deadline:
                        raise       # a shard that cannot answer, not the wait running out
                    continue        # the top of the loop says which actions did not end
                except WatchLost:
                    # Fell behind the ring: watch from now on, and read what changed
                    # meanwhile (nothing is missed: status first, then new events).
                    for r in runs:
                        self._q.watching[r] = 0
                        self._q.watching[r] = self._subscribe(r, 0)
                        self._q.release_early(r)
                    self._q.resync.difference_update(runs)
                    self._q.drop(runs)
                    pending = sorted(want)
                    for a, ph in zip(pending, self.status(pending), strict=True):
                        if ph in TERMINAL_PHASES:
                            done[a] = ph
                            want.discard(a)
                    continue
                # A batch's terminal entries only (the phases as codes: no Event objects).
                for i in np.flatnonzero(np.isin(got.phases, _TERMINAL_CODES)).tolist():
                    a = got.actions[i]
                    if a in want:
                        done[a] = PHASES[int(got.phases[i])]
                        want.discard(a)
            return done
        finally:
            for r in mine:
                self.unsubscribe(r)

    def _watch_and_status(self, runs, ids, first=None):
        """Subscribe to ``runs`` (from seq 0) and read the phase of each of ``ids``: to each
        shard its WATCHes then its STATUS, sent back to back, so that one loop turn
        registers the watches and reads the phases after them (no change falls between
        the two) in one round trip. ``first``: ``(link, request, what)`` sent on ``link``
        between its WATCHes and its STATUS (its ERROR raised, as its ShardError, once the
        watches are taken). The phases, in the order of ``ids``."""
        by_link = {}        # id(link) -> [link, runs, positions of ids]
        if first is not None:
            by_link[id(first[0])] = [first[0], [], []]
        for r in runs:
            link = self._link_of(r)         # a bad key is refused before it is watched
            by_link.setdefault(id(link), [link, [], []])[1].append(r)
        for i, a in enumerate(ids):
            link = self._link_of(a)
            by_link.setdefault(id(link), [link, [], []])[2].append(i)
        phases = [None] * len(ids)
        for link, link_runs, idx in by_link.values():
            msgs, whats = [], []
            for r in link_runs:
                self._q.watching[r] = 0
                msgs.append(self._watch_request(r, 0))
                whats.append(f"WATCH {r}")
            extra = first is not None and link is first[0]
            if extra:
                msgs.append(first[1])
                whats.append(first[2])
            if idx:
                msgs.append(p.Status(rid=next(self._rids), actions=[ids[i] for i in idx]))
                whats.append("STATUS")
            try:
                got = self._call_many(link, msgs, whats)
                for r, body in zip(link_runs, got, strict=False):
                    if isinstance(body, ShardError):
                        raise _watch_lost(body, link, r)
                    self._watched(r, body)
            finally:
                for r in link_runs:
                    self._watch_answered(r)
            if extra and isinstance(got[len(link_runs)], ShardError):
                raise got[len(link_runs)]
            if idx:
                if isinstance(got[-1], ShardError):
                    raise got[-1]
                for i, x in zip(idx, got[-1]["phases"], strict=True):
                    phases[i] = Phase(x)
        return phases

    # ------------------------------------------------------------------ plumbing

    def _call_many(self, link, msgs, whats):
        """Requests ``msgs`` (``whats`` naming each) sent to ``link`` back to back, so the
        shard decides them in one loop turn, in order: their answers (each an ERROR as a
        ShardError in its place), awaited together, as one round trip."""
        sock = self._socket(link)
        for msg, what in zip(msgs, whats, strict=True):
            self._send_request(link, sock, msg, what)
        out = {msg.rid: None for msg in msgs}
        left = len(out)
        deadline = time.monotonic() + self.timeout
        while left:
            got = self._recv(sock, deadline)
            if got is None:
                late = [w for m, w in zip(msgs, whats, strict=True) if out[m.rid] is None]
                raise ShardTimeout(f"shard {link.label}: {', '.join(late)}: no answer "
                                   f"within {self.timeout}s")
            rid = getattr(got, "rid", None)
            if rid not in out or out[rid] is not None or isinstance(got, (p.Event, p.Events)):
                continue
            what = whats[[m.rid for m in msgs].index(rid)]
            out[rid] = ShardError(link.label, what, got.code, got.message) \
                if isinstance(got, p.Error) else got.body
            left -= 1
        return [out[m.rid] for m in msgs]

    def _send_request(self, link, sock, msg, what):
        frames = p.encode_request(msg, what, self.settings)
        if not send(sock, frames):
            deadline = time.monotonic() + self.timeout
            while True:
                if time.monotonic() >= deadline:
                    raise ShardTimeout(f"shard {link.label}: {what}: cannot send (not "
                                       f"connected within {self.timeout}s: down, unreachable "
                                       f"or key refused)")
                if sock.poll(20, zmq.POLLOUT) and send(sock, frames):
                    break

    def _call(self, link, msg, what):
        body = self._call_many(link, [msg], [what])[0]
        if isinstance(body, ShardError):
            raise body
        return body

    def _recv(self, sock, deadline):
        """The next message on ``sock`` before ``deadline``; EVENTs of watched runs are
        queued (new seqs only) and returned as well."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if not sock.poll(max(1, int(left * 1000)), zmq.POLLIN):
                return None
            msg = self._take(sock)
            if msg is not None:
                return msg

    def _recv_any(self, deadline):
        """As :meth:`_recv`, over every open connection (events come from any shard)."""
        socks = [link.sock for link in self._links if link.sock is not None]
        if len(socks) == 1:
            return self._recv(socks[0], deadline)
        poller = zmq.Poller()
        for sock in socks:
            poller.register(sock, zmq.POLLIN)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if not socks:
                time.sleep(left)        # nothing open: nothing can arrive
                return None
            ready = poller.poll(max(1, int(left * 1000)))
            if not ready:
                return None
            for sock, _ in ready:
                msg = self._take(sock)
                if msg is not None:
                    return msg

    def _take(self, sock):
        """Read one waiting message of ``sock``: the message, or None when there was none,
        it was not valid, or it carried only events already seen."""
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            msg = self._decoder.decode(frames)
        except zmq.Again:
            return None
        except p.ProtocolError:
            return None
        if isinstance(msg, p.Events):
            return self._q.take_events(msg)
        if isinstance(msg, p.Event) and not self._q.take_event(msg):
            return None
        return msg

def _flyte_keys(raw, kind):
    """The action ids of serialised Flyte enqueues (decoded here only to route them)."""
    try:
        from engine.flyte import flyte_fanouts
    except ImportError as exc:
        raise _NoFlyte(f"ENQUEUE_FLYTE: a client of several shards decodes Flyte enqueues to "
                       f"route them by tenant: {exc}; or pin the shard (Client(config, "
                       f"shard=N))") from None
    return [f.template.id for f in flyte_fanouts(raw, kind=kind)]


class _NoFlyte(LeaseholdError):
    code = "UNIMPLEMENTED"


def _watch_lost(exc, link, run):
    """The ShardError of WATCH ``run`` on ``link`` as the client raises it: NOT_FOUND (the
    events to resume from are gone) is :class:`WatchLost`."""
    if exc.code == "NOT_FOUND":
        return WatchLost(link.label, f"WATCH {run}", exc.code, exc.error_message)
    return exc
