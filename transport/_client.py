"""The client (``transport.Client``): enqueue, abort, status, explain, queue metrics, live
queue updates, and watches that push every state change of a run (``docs/shard.md``).

Routing: the config has no partition map yet (one shard endpoint per shard index in
``transport.endpoints``, and nothing that says which shard owns which tenant), so a client
talks to one shard: ``endpoints[shard]`` (default the first). When a partition map lands,
:meth:`Client._shard_for` is where a tenant picks its shard.

Every request waits at most ``timeout`` seconds; a timeout raises :class:`ShardTimeout`, an
ERROR answer :class:`ShardError`, both naming the shard and the request. Not thread-safe: one
thread drives one client.
"""

import collections
import dataclasses
import itertools
import time

import zmq

from engine._codes import TERMINAL_PHASES, Phase
from engine._config import Config, TransportSettings, load_config
from engine._model import ActionId
from transport import _protocol as p
from transport._keys import load_client_keys
from transport._sockets import client_socket, send
from transport._worker import ShardError, ShardTimeout

__all__ = ["Client", "WatchLost"]


class WatchLost(ShardError):
    """A watch cannot resume: the shard no longer holds the events after the last ``seq``
    seen (its ring moved on, or it restarted). Re-read the status and watch again."""


def _spec_map(spec):
    if isinstance(spec, dict):
        return spec
    d = dataclasses.asdict(spec)
    return {k: v for k, v in d.items() if v is not None}


class Client:
    """A client of one shard.

    Either ``config`` (a Config or a path: endpoints from ``transport.endpoints``, limits
    from ``[transport]``) and ``key`` (the key name: ``keys_dir/KEY.key_secret``, with the
    shard's ``server_key.key`` from ``[security]``), or ``endpoint`` and ``keys`` (a
    :class:`~transport.ClientKeys`, None for a shard run insecure)."""

    def __init__(self, config=None, *, key=None, endpoint=None, keys=None, shard=0,
                 timeout=10.0, settings=None, context=None, heartbeat=None):
        if config is not None and not isinstance(config, Config):
            config = load_config(config)
        self.config = config
        if endpoint is None:
            if config is None:
                raise ValueError("Client needs a config or an endpoint")
            endpoint = config.transport.endpoints[shard]
        if keys is None and config is not None and not config.security.insecure:
            if key is None:
                raise ValueError("Client: a CURVE shard needs key= (the client key's name)")
            keys = load_client_keys(config.security.keys_dir, key, config.security.server_key)
        self.endpoint = endpoint
        self.keys = keys
        self.settings = settings or (config.transport if config is not None
                                     else TransportSettings())
        self.timeout = timeout
        self._own_ctx = context is None
        self._ctx = context if context is not None else zmq.Context()
        self._heartbeat = heartbeat
        self._decoder = p.Decoder(self.settings)
        self._rids = itertools.count(1)
        self._sock = None
        self._events = collections.deque()      # EVENTs received, not yet consumed
        self._watching = {}                     # run -> last seq seen (0: none)
        self._resync = set()                    # runs whose event stream had a gap
        self._floor = {}                        # run -> latest seq at its last WATCH

    # ------------------------------------------------------------------ connection

    def _shard_for(self, tenant):
        """The endpoint owning ``tenant`` (one shard until the config has a partition map)."""
        return self.endpoint

    def _socket(self):
        if self._sock is None:
            self._sock = client_socket(self._ctx, self.endpoint, self.keys, self.settings,
                                       heartbeat=self._heartbeat)
        return self._sock

    def reconnect(self):
        """Drop the connection and open a new one; watches resume from their last seq."""
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        for run in list(self._watching):
            self._resume(run)

    def close(self):
        """Close the socket (and the context this client made)."""
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        if self._own_ctx:
            self._ctx.term()
            self._own_ctx = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ requests

    def ping(self):
        """The shard's name and protocol version."""
        return self._call(p.Ping(rid=next(self._rids)), "PING")

    def enqueue(self, spec):
        """Enqueue one action (an ActionSpec or a map); returns its id."""
        return self.enqueue_many([spec])[0]

    def enqueue_many(self, specs):
        """Enqueue a batch atomically (durable when this returns); returns the ids."""
        return self._call(p.Enqueue(rid=next(self._rids), specs=[_spec_map(s) for s in specs]),
                          "ENQUEUE")["ids"]

    def enqueue_fanout(self, template, names, inputs=None):
        """Enqueue ``len(names)`` actions sharing ``template``; returns how many."""
        return self._call(p.EnqueueFanout(rid=next(self._rids), template=_spec_map(template),
                                          names=list(names),
                                          inputs=list(inputs) if inputs is not None else None),
                          "ENQUEUE_FANOUT")["n"]

    def enqueue_flyte(self, requests, kind=None):
        """Enqueue Flyte 2 declarations as the SDK writes them (``docs/flyte.md``): one or a
        list of flyteidl2 ``EnqueueActionRequest`` / ``EnqueueRequest`` messages or their
        serialised bytes (``kind`` "queue" or "actions" when known). The shard decodes them
        (it needs ``leasehold[flyte]``) and enqueues each fan-out atomically; returns the
        action ids, in order."""
        if isinstance(requests, (bytes, bytearray, memoryview)) or hasattr(
                requests, "SerializeToString"):
            requests = [requests]
        raw = [bytes(r) if isinstance(r, (bytes, bytearray, memoryview))
               else r.SerializeToString() for r in requests]
        return self._call(p.EnqueueFlyte(rid=next(self._rids), requests=raw, kind=kind),
                          "ENQUEUE_FLYTE")["ids"]

    def abort(self, action, reason=None):
        """Abort ``action`` and its descendants; returns the ids that ended at once."""
        return self._call(p.Abort(rid=next(self._rids), action=str(action), reason=reason),
                          "ABORT")["ended"]

    def status(self, actions):
        """The phase of each action id (a list in, a list of Phase out; one id, one Phase)."""
        one = isinstance(actions, (str, ActionId))
        ids = [str(actions)] if one else [str(a) for a in actions]
        phases = [Phase(x) for x in
                  self._call(p.Status(rid=next(self._rids), actions=ids), "STATUS")["phases"]]
        return phases[0] if one else phases

    def explain(self, action):
        """Why ``action`` is where it is (a map: action, phase, wait, reason, ...)."""
        return self._call(p.Explain(rid=next(self._rids), action=str(action)), "EXPLAIN")

    def queue_metrics(self, queue=None):
        """``Engine.queue_metrics`` over the wire (one queue, or all)."""
        return self._call(p.QueueMetrics(rid=next(self._rids), queue=queue), "QUEUE_METRICS")

    def queue_update(self, queue, **changes):
        """Change a queue live (an admin key); returns its new settings."""
        return self._call(p.QueueUpdate(rid=next(self._rids), queue=queue, changes=changes),
                          "QUEUE_UPDATE")

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
        """Start receiving EVENTs of ``run`` after ``since``; returns the run's latest seq."""
        self._watching[run] = since
        return self._subscribe(run, since)

    def unsubscribe(self, run):
        """Stop receiving EVENTs of ``run`` (best effort)."""
        if self._watching.pop(run, None) is not None and self._sock is not None:
            send(self._sock, p.encode(p.Unwatch(rid=next(self._rids), run=run)))
        self._events = collections.deque(e for e in self._events if e.run != run)

    def _resume(self, run):
        # From the last seq seen, or the latest the shard had when we subscribed if no
        # event came since: a shard that restarted meanwhile then refuses (WatchLost)
        # instead of silently starting a new log past what we missed.
        return self._subscribe(run, max(self._watching[run], self._floor.get(run, 0)))

    def _subscribe(self, run, since):
        try:
            latest = self._call(p.Watch(rid=next(self._rids), run=run, since=since),
                                f"WATCH {run}")["seq"]
            self._floor[run] = latest
            return latest
        except ShardError as exc:
            if exc.code == "NOT_FOUND":
                raise WatchLost(self.endpoint, f"WATCH {run}", exc.code,
                                exc.error_message) from None
            raise

    def next_event(self, timeout=None, refresh=2.0, runs=None):
        """The next new EVENT of a subscribed run (of ``runs`` when given); see
        :meth:`watch`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            while self._resync:
                run = self._resync.pop()
                if run in self._watching:
                    self._resume(run)
            for i, e in enumerate(self._events):
                if runs is None or e.run in runs:
                    del self._events[i]
                    return e
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise ShardTimeout(f"shard {self.endpoint}: watch: no event within "
                                   f"{timeout}s")
            wait = refresh if deadline is None else min(refresh, deadline - now)
            msg = self._recv(time.monotonic() + wait)
            if msg is None:
                # Silence: resubscribe from the last seq (replays anything a lost push
                # missed); a shard that cannot answer gets a new connection.
                for run in list(self._watching):
                    try:
                        self._resume(run)
                    except ShardTimeout:
                        self.reconnect()
                        break

    def wait(self, actions, timeout=60.0):
        """Wait until every action (ids, one run or several) is terminal, by watch pushes
        (no polling: one STATUS after subscribing, then events). Returns
        ``{action id: Phase}``."""
        ids = [str(a) for a in ([actions] if isinstance(actions, (str, ActionId))
                                else actions)]
        runs = {a.rsplit("/", 1)[0] for a in ids}
        deadline = time.monotonic() + timeout
        mine = [r for r in runs if r not in self._watching]
        for r in mine:
            self.subscribe(r, 0)
        try:
            done = {}
            for a, ph in zip(ids, self.status(ids), strict=True):
                if ph in TERMINAL_PHASES:
                    done[a] = ph
            want = set(ids) - set(done)
            while want:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ShardTimeout(f"shard {self.endpoint}: wait: {len(want)} action(s) "
                                       f"not ended within {timeout}s (e.g. {min(want)})")
                try:
                    e = self.next_event(timeout=left, runs=runs)
                except WatchLost:
                    # Fell behind the ring: watch from now on, and read what changed
                    # meanwhile (nothing is missed: status first, then new events).
                    for r in runs:
                        self._watching[r] = self._floor[r] = 0
                        self._watching[r] = self._subscribe(r, 0)
                    self._resync.difference_update(runs)
                    self._events = collections.deque(
                        ev for ev in self._events if ev.run not in runs)
                    pending = sorted(want)
                    for a, ph in zip(pending, self.status(pending), strict=True):
                        if ph in TERMINAL_PHASES:
                            done[a] = ph
                            want.discard(a)
                    continue
                ph = Phase(e.phase)
                if e.action in want and ph in TERMINAL_PHASES:
                    done[e.action] = ph
                    want.discard(e.action)
            return done
        finally:
            for r in mine:
                self.unsubscribe(r)

    # ------------------------------------------------------------------ plumbing

    def _call(self, msg, what):
        sock = self._socket()
        if not send(sock, p.encode(msg)):
            deadline = time.monotonic() + self.timeout
            while True:
                if time.monotonic() >= deadline:
                    raise ShardTimeout(f"shard {self.endpoint}: {what}: cannot send (not "
                                       f"connected within {self.timeout}s: down, unreachable "
                                       f"or key refused)")
                if sock.poll(20, zmq.POLLOUT) and send(sock, p.encode(msg)):
                    break
        deadline = time.monotonic() + self.timeout
        while True:
            got = self._recv(deadline)
            if got is None:
                raise ShardTimeout(f"shard {self.endpoint}: {what}: no answer within "
                                   f"{self.timeout}s")
            if getattr(got, "rid", None) != msg.rid or isinstance(got, (p.Event, p.Events)):
                continue
            if isinstance(got, p.Error):
                raise ShardError(self.endpoint, what, got.code, got.message)
            return got.body

    def _recv(self, deadline):
        """The next message before ``deadline``; EVENTs of watched runs are queued (new
        seqs only) and returned as well."""
        sock = self._socket()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if not sock.poll(max(1, int(left * 1000)), zmq.POLLIN):
                return None
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                msg = self._decoder.decode(frames)
            except zmq.Again:
                continue
            except p.ProtocolError:
                continue
            if isinstance(msg, p.Events):
                got = [e for e in msg.events() if self._take_event(e)]
                if not got:
                    continue
                return got[-1]
            if isinstance(msg, p.Event):
                if not self._take_event(msg):
                    continue
            return msg

    def _take_event(self, e):
        """Queue ``e`` if it is the next new event of a watched run."""
        last = self._watching.get(e.run)
        if last is None or e.seq <= last:
            return False        # at-least-once: a seq already seen, or not watched
        if last and e.seq != last + 1:
            # A push was lost (the shard drops a watcher it cannot send to): ask for the
            # replay from the last seq seen instead of skipping the gap.
            self._resync.add(e.run)
            return False
        self._watching[e.run] = e.seq
        self._events.append(e)
        return True
