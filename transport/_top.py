"""``leasehold top`` and ``leasehold queue list``: what every queue and cluster of a shard is
doing, read from the shard's shared-memory status file (``docs/status.md``) without sending
it a message (``docs/cli.md``). ``queue list --remote`` asks the shard instead
(``QUEUE_METRICS``), for a host that does not have the status files.
"""

import json
import math
import os
import sys
import time

from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from engine._commands import OK, CommandError
from engine._config import load_config
from engine._units import format_quantity
from transport._commands import console, human_seconds, talk
from transport._status import StatusError, StatusReader, snapshot_dict, status_path

__all__ = ["top", "queue_list", "render"]

_QUANTILES = (0.5, 0.9, 0.99)


def _readers(args, cfg, every=False):
    """The status sources of ``--shard`` (of every shard with ``every`` or
    ``--all-shards``; of shard 0 for ``top`` without either)."""
    eps = cfg.transport.endpoints
    if args.shard is not None and args.shard >= len(eps):
        raise CommandError("INVALID_ARGUMENT", f"--shard {args.shard}: {cfg.source} has "
                           f"{len(eps)} endpoint(s) in transport.endpoints")
    if getattr(args, "all_shards", False) or (every and args.shard is None):
        shards = range(len(eps))
    else:
        shards = [args.shard or 0]
    return {i: _Source(status_path(cfg, i)) for i in shards}


class _Source:
    """One shard's status file; opened on first success and kept (the reader follows a
    file replaced under it), retried while it cannot be read."""

    def __init__(self, path):
        self.path = path
        self.reader = None

    def read(self):
        """``(snapshot, None)`` or ``(None, error text)``."""
        try:
            if self.reader is None:
                self.reader = StatusReader(self.path)
            return self.reader.snapshot(), None
        except StatusError as exc:
            if self.reader is not None:
                self.reader.close()
                self.reader = None
            return None, str(exc)

    def close(self):
        if self.reader is not None:
            self.reader.close()


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True         # someone else's process: it exists
    return True


def _amounts(values):
    """``{resource: amount}`` as ``cpu=8, memory=64Gi`` (zeros left out; None unlimited)."""
    parts = []
    for n, v in values.items():
        if v is None:
            parts.append(f"{n}=unlimited")
        elif v:
            parts.append(f"{n}={format_quantity(n, int(v))}")
    return ", ".join(parts) or "-"


def _latency(h):
    if h.count == 0:
        return "-"
    return " ".join(f"p{int(q * 100)}<={_short(h.quantile(q))}" for q in _QUANTILES)


def _short(s):
    if s is None:
        return "-"
    if s == float("inf"):
        return "inf"
    if s < 1e-3:
        return f"{s * 1e6:.0f}us"
    if s < 1:
        return f"{s * 1e3:g}ms"
    return f"{s:g}s"


def _flags(q):
    out = []
    if q.paused:
        out.append("[red]paused[/]")
    if q.draining:
        out.append("[yellow]draining[/]")
    return " ".join(out) or "-"


def _cap(n):
    return "unlimited" if n == 0 else str(n)


def _header(i, s):
    if s.state == "running" and not _alive(s.pid):
        state = f"[red]down[/] (pid {s.pid} gone)"
    else:
        state = f"{s.state} (pid {s.pid})"
    return Text.from_markup(
        f"[bold]shard {i}[/] {state}  published {human_seconds(s.age_s)} ago  "
        f"tick #{s.tick_no} {_latency(s.tick_latency)}  commits {s.commits} "
        f"{_latency(s.commit_latency)}  dispatches {s.dispatches}")


def _queue_table(s):
    t = Table(title="queues", title_justify="left", expand=False)
    for col, just in (("queue", "left"), ("prio", "right"), ("policy", "left"),
                      ("flags", "left"), ("depth", "right"), ("in flight", "right"),
                      ("in-flight resources", "left"), ("head blocked", "left"),
                      ("for", "right"), ("eta", "right"), ("backfilled", "right")):
        t.add_column(col, justify=just)
    for q in s.queues.values():
        h = q.head_blocked
        head = "-" if h is None else f"{h.code}: {h.reason or h.action}"
        t.add_row(q.name, str(q.priority), "STRICT_FIFO" if q.strict else "GREEDY_CAPACITY",
                  _flags(q), str(q.depth), f"{q.actions_in_flight} ({q.runs_in_flight} runs)",
                  _amounts(q.in_flight_resources), head,
                  "-" if h is None else human_seconds(h.blocked_s),
                  "-" if h is None or h.eta_s is None else human_seconds(h.eta_s),
                  str(q.backfilled))
    return t


def _cluster_table(s):
    t = Table(title="clusters", title_justify="left", expand=False)
    for col, just in (("cluster", "left"), ("capacity", "left"), ("in flight", "left"),
                      ("free", "left"), ("leases", "right"), ("workers", "right"),
                      ("slots", "right")):
        t.add_column(col, justify=just)
    for c in s.clusters.values():
        t.add_row(c.name, _amounts(c.capacity), _amounts(c.in_flight_resources),
                  _amounts(c.free), str(c.leases_in_flight), str(c.workers_connected),
                  str(c.slots))
    return t


def render(frames):
    """A rich renderable of ``{shard: (snapshot or None, error or None)}``."""
    parts = []
    for i, (s, err) in frames.items():
        if s is None:
            parts.append(Text.from_markup(f"[bold]shard {i}[/] [red]no status[/]: {err}"))
            continue
        parts += [_header(i, s), _queue_table(s), _cluster_table(s)]
    return Group(*parts)


def _json_frame(frames):
    shards, errors = [], []
    for i, (s, err) in frames.items():
        if s is None:
            errors.append({"shard": i, "error": err})
            continue
        d = snapshot_dict(s)
        d["age_s"] = s.age_s
        d["alive"] = _alive(s.pid)
        d["tick_latency_quantiles"] = {f"p{int(q * 100)}": s.tick_latency.quantile(q)
                                       for q in _QUANTILES}
        shards.append(d)
    return {"shards": shards, "errors": errors}


def _finite(value):
    # An infinite bucket bound (a quantile past the last edge) is not JSON: say "inf".
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _dumps(data):
    return json.dumps(_finite(data), indent=2, allow_nan=False)


def _fail_unread(frames):
    bad = [(i, err) for i, (s, err) in frames.items() if s is None]
    for i, err in bad:
        print(f"leasehold: UNAVAILABLE: shard {i}: {err}", file=sys.stderr)
    return 2 if bad else OK


def top(args):
    """``leasehold top``: a live table per queue and cluster from the status files."""
    cfg = load_config(args.config)
    sources = _readers(args, cfg)
    try:
        def frame():
            return {i: src.read() for i, src in sources.items()}
        if args.json:
            frames = frame()
            print(_dumps(_json_frame(frames)))
            return _fail_unread(frames)
        con = console()
        if args.once:
            frames = frame()
            con.print(render(frames))
            return _fail_unread(frames)
        try:
            with Live(render(frame()), console=con, refresh_per_second=4) as live:
                while True:
                    time.sleep(args.interval)
                    live.update(render(frame()))
        except KeyboardInterrupt:
            return OK       # the way to leave top
    finally:
        for src in sources.values():
            src.close()


def queue_list(args):
    """``leasehold queue list``: every queue, from the status file (or the shard)."""
    if args.remote:
        with talk(args) as (_cfg, client):
            got = client.queue_metrics()
            # A routing client asks every shard ({shard: metrics}); a pinned one its own.
            per_shard = got if client.routed else {args.shard or 0: got}
        rows = [{"shard": i, "name": name, **m} for i, metrics in per_shard.items()
                for name, m in metrics.items()]
        if args.json:
            print(_dumps({"queues": rows}))
            return OK
        several = len(per_shard) > 1
        t = Table(title="queues (from the shards)" if several else "queues (from the shard)",
                  title_justify="left")
        for col in (("shard",) if several else ()) + (
                "queue", "flags", "depth", "in flight", "in-flight resources", "head blocked"):
            t.add_column(col)
        for r in rows:
            flags = " ".join(f for f in ("paused", "draining") if r.get(f)) or "-"
            h = r["head_blocked"]
            head = "-" if h is None else f"{h['code']}: {h['reason'] or h['action'] or ''}"
            t.add_row(*((str(r["shard"]),) if several else ()), r["name"], flags,
                      str(r["depth"]), f"{r['actions_in_flight']} ({r['runs_in_flight']} runs)",
                      _amounts(r["in_flight_resources"]), head)
        console().print(t)
        return OK
    for flag, value in (("--key", args.key), ("--request-timeout", args.request_timeout)):
        if value is not None:
            # Without --remote nothing is sent: a flag for the shard would do nothing.
            raise CommandError("INVALID_ARGUMENT", f"{flag} is for queue list --remote; without "
                               f"it the queues are read from the status file (no key, no "
                               f"request)")
    cfg = load_config(args.config)
    sources = _readers(args, cfg, every=True)
    try:
        frames = {i: src.read() for i, src in sources.items()}
    finally:
        for src in sources.values():
            src.close()
    rows = []
    for i, (s, _err) in frames.items():
        if s is None:
            continue
        for q in s.queues.values():
            h = q.head_blocked
            rows.append({
                "shard": i, "name": q.name, "priority": q.priority,
                "scheduling": "STRICT_FIFO" if q.strict else "GREEDY_CAPACITY",
                "action_concurrency": q.action_concurrency,
                "run_concurrency": q.run_concurrency, "paused": q.paused,
                "draining": q.draining, "depth": q.depth,
                "actions_in_flight": q.actions_in_flight, "runs_in_flight": q.runs_in_flight,
                "in_flight_resources": q.in_flight_resources,
                "head_blocked": None if h is None else {
                    "action": h.action, "code": h.code, "reason": h.reason,
                    "blocked_s": h.blocked_s, "eta_s": h.eta_s},
                "_q": q})
    if args.json:
        print(_dumps({"queues": [{k: v for k, v in r.items() if k != "_q"} for r in rows]}))
        return _fail_unread(frames)
    t = Table(title="queues", title_justify="left")
    for col in ("shard", "queue", "prio", "policy", "action conc.", "run conc.", "flags",
                "depth", "in flight", "head blocked"):
        t.add_column(col)
    for r in rows:
        q = r["_q"]
        h = r["head_blocked"]
        t.add_row(str(r["shard"]), q.name, str(q.priority), r["scheduling"],
                  _cap(q.action_concurrency), _cap(q.run_concurrency), _flags(q),
                  str(q.depth), str(q.actions_in_flight),
                  "-" if h is None else f"{h['code']}: {h['reason'] or h['action']}")
    console().print(t)
    return _fail_unread(frames)
