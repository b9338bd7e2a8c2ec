"""The ``leasehold`` commands that talk to a shard: ``submit``, ``status``, ``explain``,
``abort``, ``watch``, ``queue update``, ``queue drain`` (``docs/cli.md``). Their arguments
and exit codes are declared in ``engine/_commands.py``; each function here takes the parsed
arguments and returns the exit status.

Every shard answer goes through :func:`talk`, which turns the client's errors into
:class:`~engine._commands.CommandError` (one line, and the exit status: 1 for NOT_FOUND,
2 for everything else). Without ``--shard`` the client routes: each action or run goes to
the shard owning its tenant, and the queue commands act on every shard (``docs/cli.md``).
Waiting (``submit --wait``, ``watch``) follows the push stream (:class:`RunTracker`), never
polling ``STATUS``; ``queue drain --wait`` asks ``QUEUE_METRICS`` twice a second (queue
counts have no push stream).
"""

import collections
import contextlib
import json
import os
import shlex
import sys
import time
import tomllib
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from engine._codes import TERMINAL_PHASES, Phase, WaitCode
from engine._commands import NO, OK, CommandError
from engine._config import load_config
from engine._errors import SpecError, empty_file
from engine._model import ActionId, ActionSpec
from engine._units import UNLIMITED, format_quantity
from transport._client import Client, CrossShardBatch, WatchLost
from transport._shards import split_by_shard
from transport._worker import ShardError, ShardTimeout

__all__ = ["RunTracker", "talk", "console", "submit", "status", "explain", "abort", "watch",
           "queue_update", "queue_drain", "human_seconds"]

_PHASES = tuple(Phase)
_ENDED_BADLY = (Phase.FAILED, Phase.ABORTED, Phase.TIMED_OUT)


# ------------------------------------------------------------------------------ plumbing

@contextlib.contextmanager
def talk(args):
    """``(config, Client)`` for ``args`` (``--config``, ``--shard``, ``--key``,
    ``--request-timeout``): pinned to ``--shard``, else routing by tenant over every shard
    of the config; the shards' errors become :class:`CommandError`."""
    cfg = load_config(args.config)
    eps = cfg.transport.endpoints
    if args.shard is not None and args.shard >= len(eps):
        raise CommandError("INVALID_ARGUMENT", f"--shard {args.shard}: {cfg.source} has "
                           f"{len(eps)} endpoint(s) in transport.endpoints")
    key, given = args.key, "--key"
    if key is None:
        key, given = os.environ.get("LEASEHOLD_KEY"), "$LEASEHOLD_KEY"
    if cfg.security.insecure and key:
        # The connection would be plain and unauthenticated while the user believes a key
        # is in use: say so instead of dropping the key.
        drop = "drop --key" if given == "--key" else "unset $LEASEHOLD_KEY"
        raise CommandError("INVALID_ARGUMENT", f"{given} {key}: {cfg.source} sets "
                           f"security.insecure = true, so no key is used (the connection is "
                           f"plain: no encryption, no authentication); {drop}, or use a "
                           f"config with CURVE keys")
    if not cfg.security.insecure and not key:
        raise CommandError("INVALID_ARGUMENT", f"--key NAME is needed: {cfg.source} runs "
                           f"CURVE (security.insecure is false); NAME is a client or admin "
                           f"key in {cfg.security.keys_dir} (or set $LEASEHOLD_KEY)")
    timeout = 10.0 if args.request_timeout is None else args.request_timeout
    client = Client(cfg, key=key or None, shard=args.shard, timeout=timeout)
    try:
        yield cfg, client
    except ShardError as exc:
        raise CommandError(exc.code, f"{exc.error_message} (shard {exc.shard})",
                           NO if exc.code == "NOT_FOUND" else 2) from None
    except ShardTimeout as exc:
        raise CommandError("UNAVAILABLE", str(exc)) from None
    except CrossShardBatch as exc:
        raise CommandError(exc.code, str(exc)) from None
    finally:
        client.close()


def console():
    """The rich console of the commands: the terminal's width, or 200 columns when the
    output is not a terminal (a file, a CI log) and $COLUMNS does not say."""
    con = Console(highlight=False)
    if not con.is_terminal and "COLUMNS" not in os.environ:
        con = Console(highlight=False, width=200)
    return con


def _emit_json(data):
    print(json.dumps(data, indent=2))


def human_seconds(s):
    """``s`` seconds for people: ``0.4s``, ``12s``, ``4m 10s``, ``2h 05m``, ``3d 4h``."""
    if s is None:
        return "-"
    if s == float("inf"):
        return "inf"
    if s < 10:
        return f"{s:.1f}s"
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def _eta_text(eta_s):
    if eta_s is None:
        return "unknown"
    at = time.strftime("%H:%M:%S", time.localtime(time.time() + eta_s))
    return f"in {human_seconds(eta_s)} (at {at})"


def _run_of(action):
    return action.rsplit("/", 1)[0]


def _check_run(run):
    parts = run.split("/")
    if len(parts) != 4:
        raise CommandError("INVALID_ARGUMENT", f"run {run!r}: a run is "
                           f"tenant/project/domain/run (4 parts)")
    ActionId.parse(f"{run}/x")      # the same character rules as an action id
    return run


# ------------------------------------------------------------------------------ following

class RunTracker:
    """The phase of every action of some runs that the push stream told about, kept exact
    across replays and resyncs.

    :meth:`start` subscribes to each run from seq 0 (the shard replays what it keeps) and
    reads ``STATUS`` of the given ids once; an event then changes an action only if its
    ``seq`` is newer than what set the action's phase (a STATUS read counts as the run's
    latest seq at the subscribe, so an older replayed event cannot undo it). A watch that
    fell behind the shard's ring (:class:`WatchLost`) is subscribed again and the known
    actions that had not ended are read again. Counts per phase are kept as it goes."""

    def __init__(self, client, runs, max_batch):
        self.client = client
        self.runs = tuple(runs)
        self.max_batch = max_batch
        self.state = {}                 # action -> (Phase, seq that set it)
        self.counts = collections.Counter()
        self.unended = set()
        self.floor = {}                 # run -> its latest seq when (re)subscribed
        self.started = time.monotonic()

    def start(self, ids=()):
        """Subscribe to the runs, then read the phase of ``ids`` (in batches)."""
        for run in self.runs:
            self.floor[run] = self.client.subscribe(run, 0)
        self._read(list(ids))

    def close(self):
        """Unsubscribe (best effort)."""
        for run in self.runs:
            self.client.unsubscribe(run)

    def _read(self, ids):
        for lo in range(0, len(ids), self.max_batch):
            part = ids[lo:lo + self.max_batch]
            for a, ph in zip(part, self.client.status(part), strict=True):
                self._set(a, ph, self.floor[_run_of(a)])

    def _set(self, action, phase, seq):
        cur = self.state.get(action)
        if cur is not None and seq <= cur[1]:
            return False
        if cur is not None:
            self.counts[cur[0]] -= 1
        self.state[action] = (phase, seq)
        self.counts[phase] += 1
        if phase in TERMINAL_PHASES:
            self.unended.discard(action)
        else:
            self.unended.add(action)
        return True

    def phase(self, action):
        """The action's phase as known (None: not heard of)."""
        got = self.state.get(action)
        return None if got is None else got[0]

    @property
    def all_ended(self):
        """Some action is known and every known action has ended."""
        return bool(self.state) and not self.unended

    def next(self, timeout=None):
        """Wait for the next event (``timeout`` seconds; None: for ever) and apply it.
        Returns ``(event, applied)``, or ``(None, False)`` after a resync; raises
        :class:`~transport.ShardTimeout` when no event came in time."""
        try:
            e = self.client.next_event(timeout=timeout, runs=self.runs)
        except WatchLost:
            self._resync()
            return None, False
        return e, self._set(e.action, Phase(e.phase), e.seq)

    def _resync(self):
        for run in self.runs:
            self.client.unsubscribe(run)
            self.floor[run] = self.client.subscribe(run, 0)
        self._read(sorted(self.unended))


def _deadline(timeout):
    return None if timeout is None else time.monotonic() + timeout


def _left(deadline):
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _wait_ended(client, cfg, ids, timeout):
    """``{id: Phase}`` once every id has ended (push stream); CommandError past timeout."""
    runs = sorted({_run_of(a) for a in ids})
    t = RunTracker(client, runs, cfg.transport.max_batch)
    deadline = _deadline(timeout)
    t.start(ids)
    want = {a for a in ids if t.phase(a) not in TERMINAL_PHASES}
    try:
        while want:
            try:
                e, _ = t.next(_left(deadline))
            except ShardTimeout:
                raise CommandError("DEADLINE_EXCEEDED", f"{len(want)} of {len(ids)} "
                                   f"action(s) not ended within {timeout}s (e.g. "
                                   f"{min(want)})", NO) from None
            if e is None:
                want = {a for a in want if t.phase(a) not in TERMINAL_PHASES}
            elif e.action in want and t.phase(e.action) in TERMINAL_PHASES:
                want.discard(e.action)
        return {a: t.phase(a) for a in ids}
    finally:
        t.close()


# ------------------------------------------------------------------------------ submit

_FLAG_DESTS = ("id", "task", "cpu", "memory", "gpu", "queue", "parent", "image", "retries",
               "max_runtime", "max_queued_time", "deadline", "runtime_estimate", "plugin",
               "duration", "fail",
               "fail_attempts", "command", "function")


def _flags_given(args):
    return ([f"--{d.replace('_', '-')}" for d in _FLAG_DESTS if getattr(args, d) is not None]
            + (["--resource"] if args.resource else []) + (["--env"] if args.env else [])
            + (["--replicas"] if args.replicas != 1 else []))


def _quantity(text):
    """A quantity as typed: numbers become numbers (``8``, ``0.5``), the rest stays text."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def _pairs(items, flag):
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise CommandError("INVALID_ARGUMENT", f"{flag} {item!r}: allowed: NAME=VALUE")
        if key in out:
            raise CommandError("INVALID_ARGUMENT", f"{flag}: {key!r} given twice")
        out[key] = value
    return out


def _spec_from_flags(args):
    if args.id is None:
        raise CommandError("INVALID_ARGUMENT", "submit: give FILE, or --id "
                           "tenant/project/domain/run/action (and resources) for one action")
    aid = ActionId.parse(args.id)
    res = {k: _quantity(v) for k, v in _pairs(args.resource, "--resource").items()}
    for flag, name, value in (("--cpu", "cpu", args.cpu), ("--memory", "memory", args.memory),
                              ("--gpu", "gpu", args.gpu)):
        if value is not None:
            if name in res:
                raise CommandError("INVALID_ARGUMENT", f"{flag} and --resource {name}=... "
                                   f"both given")
            res[name] = _quantity(value) if name == "cpu" else value
    if not res:
        raise CommandError("INVALID_ARGUMENT", "submit: give the action's resources: --cpu, "
                           "--memory, --gpu or --resource NAME=QTY")
    if args.replicas < 1:
        raise CommandError("INVALID_ARGUMENT", f"--replicas {args.replicas}: allowed: >= 1")
    spec = {"id": str(aid), "task": aid.action if args.task is None else args.task}
    if args.replicas > 1:
        spec["pods"] = [{"role": "worker", "replicas": args.replicas, "resources": res}]
    else:
        spec["resources"] = res
    for key, value in (("run_queue", args.queue), ("parent", args.parent),
                       ("image", args.image)):
        if value is not None:
            spec[key] = value
    if args.retries is not None:
        spec["retries"] = {"count": args.retries}
    timeouts = {k: v for k, v in (("max_runtime", args.max_runtime),
                                  ("max_queued_time", args.max_queued_time),
                                  ("deadline", args.deadline)) if v is not None}
    if timeouts:
        spec["timeouts"] = timeouts
    if args.runtime_estimate is not None:
        spec["runtime_estimate"] = args.runtime_estimate
    spec_execute = _execute_from_flags(args)
    if spec_execute is not None:
        spec["execute"] = spec_execute
    return spec


_PLUGIN_FLAGS = {"duration": "sim", "fail": "sim", "fail_attempts": "sim",
                 "command": "process", "function": "python"}


def _execute_from_flags(args):
    for dest, plugin in _PLUGIN_FLAGS.items():
        if getattr(args, dest) is not None and args.plugin != plugin:
            raise CommandError("INVALID_ARGUMENT", f"--{dest.replace('_', '-')} is for "
                               f"--plugin {plugin}")
    if args.env and args.plugin not in ("process", "python"):
        raise CommandError("INVALID_ARGUMENT", "--env is for --plugin process or python")
    if args.plugin is None:
        return None
    ex = {"plugin": args.plugin}
    if args.plugin == "sim":
        if args.duration is None:
            # (It ran every attempt for 0 s, silently: no default is documented.)
            raise CommandError("INVALID_ARGUMENT", "--plugin sim needs --duration S: the "
                               "seconds each attempt holds (0 for none)")
        ex["duration"] = args.duration
        if args.fail is not None:
            ex["fail"] = args.fail
        if args.fail_attempts is not None:
            ex["fail_attempts"] = args.fail_attempts
    elif args.plugin == "process":
        if not args.command:
            raise CommandError("INVALID_ARGUMENT", "--plugin process needs --command")
        try:
            ex["command"] = shlex.split(args.command)
        except ValueError as exc:
            raise CommandError("INVALID_ARGUMENT", f"--command: {exc}") from None
    else:
        if not args.function:
            raise CommandError("INVALID_ARGUMENT", "--plugin python needs --function")
        ex["function"] = args.function
    if args.env:
        ex["env"] = _pairs(args.env, "--env")
    return ex


def _load_file(path):
    """``("specs", [spec, ...])`` or ``("fanout", template, names, inputs)`` from a file."""
    p = Path(path)
    kind = p.suffix.lower()
    if kind not in (".json", ".jsonl", ".toml"):
        raise CommandError("INVALID_ARGUMENT", f"{path}: a .json, .jsonl or .toml file of "
                           f"action specs (docs/cli.md), not {kind or 'no suffix'}")
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise CommandError("INVALID_ARGUMENT", f"cannot read {path}: "
                           f"{exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise CommandError("INVALID_ARGUMENT", f"{path}: not UTF-8 text ({exc.reason} at "
                           f"byte {exc.start})") from None
    if not text.strip():
        raise CommandError("INVALID_ARGUMENT", empty_file(path))
    try:
        if kind == ".toml":
            data = tomllib.loads(text)
        elif kind == ".json":
            data = json.loads(text)
        else:
            data = []
            for n, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        data.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise CommandError("INVALID_ARGUMENT", f"{path}:{n}: not JSON: "
                                           f"{exc.msg}") from None
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise CommandError("INVALID_ARGUMENT", f"{path}: invalid {kind[1:].upper()}: "
                           f"{exc}") from None
    except RecursionError:
        raise CommandError("INVALID_ARGUMENT", f"{path}: invalid {kind[1:].upper()}: "
                           f"nested too deeply") from None
    if isinstance(data, dict) and "template" in data:
        unknown = sorted(set(data) - {"template", "names", "inputs"})
        if unknown:
            raise CommandError("INVALID_ARGUMENT", f"{path}: fan-out table: unknown key(s) "
                               f"{', '.join(unknown)} (allowed: template, names, inputs)")
        names = data.get("names")
        if not isinstance(names, list) or not names or \
                not all(isinstance(n, str) for n in names):
            raise CommandError("INVALID_ARGUMENT", f"{path}: fan-out names: a non-empty "
                               f"list of action names")
        inputs = data.get("inputs")
        if inputs is not None and (not isinstance(inputs, list) or len(inputs) != len(names)):
            raise CommandError("INVALID_ARGUMENT", f"{path}: fan-out inputs: a list with "
                               f"one entry per name ({len(names)})")
        _check_spec(path, "template", data["template"])
        return ("fanout", data["template"], names, inputs)
    if isinstance(data, dict) and set(data) == {"actions"}:
        data = data["actions"]
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list) or not data:
        raise CommandError("INVALID_ARGUMENT", f"{path}: no action specs (a spec, a list of "
                           f"specs, [[actions]] tables, or a fan-out table)")
    for i, spec in enumerate(data):
        _check_spec(path, f"item {i}", spec)
    return ("specs", data)


def _check_spec(path, where, spec):
    # The shape here (so a typo names the file and item); the shard checks the rest.
    try:
        ActionSpec.from_dict(spec)
    except (SpecError, TypeError) as exc:
        raise CommandError("INVALID_ARGUMENT", f"{path}: {where}: {exc}") from None


def _read_bytes(path):
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise CommandError("INVALID_ARGUMENT", f"--flyte {path}: cannot read it: "
                           f"{exc.strerror or exc}") from None
    if not raw:
        raise CommandError("INVALID_ARGUMENT", empty_file(path))
    return raw


def _read_flyte_files(paths):
    """The bytes of each ``--flyte`` file, in order. A file given twice, or two files naming
    one action, is refused naming them: the shard would say only that a fan-out's
    ``names[i]`` "appears twice" (consecutive requests of one task are one fan-out)."""
    raws, seen = [], {}
    for i, path in enumerate(paths):
        raws.append(_read_bytes(path))
        try:
            st = os.stat(path)
        except OSError:
            continue                # (read just above: it went since)
        first = paths[seen.setdefault((st.st_dev, st.st_ino), i)]
        if seen[(st.st_dev, st.st_ino)] != i:
            again = f"--flyte {path} is given twice" if first == path else \
                f"--flyte {path} is the file --flyte {first} given again"
            raise CommandError("INVALID_ARGUMENT", f"{again}: give each file once")
    named = {}
    for path, aid in _flyte_actions(paths, raws):
        first = named.setdefault(aid, path)
        if first != path:
            raise CommandError("INVALID_ARGUMENT", f"action {aid} appears twice: in --flyte "
                               f"{first} and in --flyte {path}; give each action once")
    return raws


def _flyte_actions(paths, raws):
    """``(path, action id)`` of what each file declares, decoded here when the flyte extra
    is installed (else nothing: the shard checks). A file that does not decode is left to
    the shard's error, which names it as ``requests[i]``."""
    try:
        from engine.flyte import flyte_fanouts
    except ImportError:
        return []
    out = []
    for path, raw in zip(paths, raws, strict=True):
        try:
            fanouts = flyte_fanouts([raw])
        except SpecError:
            continue
        for f in fanouts:
            run = f.template.id.rsplit("/", 1)[0]
            out += [(path, f"{run}/{name}") for name in dict.fromkeys(f.names)]
    return out


def submit(args):
    """``leasehold submit``: enqueue, print the ids, optionally wait for the outcomes."""
    if args.flyte:
        given = _flags_given(args) + ([args.file] if args.file is not None else [])
        if given:
            raise CommandError("INVALID_ARGUMENT", f"submit: give --flyte FILE alone, not "
                               f"with {', '.join(given)}")
        plan = ("flyte", _read_flyte_files(args.flyte))
    elif args.file is not None:
        given = _flags_given(args)
        if given:
            raise CommandError("INVALID_ARGUMENT", f"submit: give FILE or flags, not both "
                               f"({', '.join(given)} with {args.file})")
        plan = _load_file(args.file)
    else:
        plan = ("specs", [_spec_from_flags(args)])
    if args.timeout is not None and not args.wait:
        raise CommandError("INVALID_ARGUMENT", "--timeout is for --wait")
    ids = []
    with talk(args) as (cfg, client):
        try:
            if plan[0] == "flyte":
                ids += client.enqueue_flyte(plan[1])
            elif plan[0] == "fanout":
                _, template, names, inputs = plan
                run = _run_of(str(ActionId.parse(template.get("id"))))
                step = cfg.transport.max_fanout
                for lo in range(0, len(names), step):
                    part = names[lo:lo + step]
                    client.enqueue_fanout(template, part, None if inputs is None
                                          else inputs[lo:lo + step])
                    ids += [f"{run}/{n}" for n in part]
            else:
                got = [None] * len(plan[1])
                try:
                    _enqueue_specs(client, cfg, plan[1], got)
                finally:
                    ids += [a for a in got if a is not None]
        except (ShardError, ShardTimeout):
            if ids:     # earlier batches are durable: say which, then fail
                print("\n".join(ids))
                print(f"leasehold: {len(ids)} action(s) above were enqueued before the error "
                      f"below", file=sys.stderr)
            raise
        phases = _wait_ended(client, cfg, ids, args.timeout) if args.wait else None
    if args.json:
        out = {"ids": ids}
        if phases is not None:
            out["phases"] = {a: ph.value for a, ph in phases.items()}
        _emit_json(out)
    else:
        if phases is None:
            print("\n".join(ids))
        else:
            _phase_table(phases, title=f"{len(ids)} action(s) ended")
    if phases is not None and any(ph != Phase.SUCCEEDED for ph in phases.values()):
        return NO
    return OK


def _enqueue_specs(client, cfg, specs, got):
    """Enqueue ``specs`` in batches of ``transport.max_batch``, one shard's specs per batch
    (a batch is atomic on one shard only), setting ``got[i]`` to the id of ``specs[i]`` as
    its batch is acknowledged (so after an error ``got`` says what is durable)."""
    groups = split_by_shard([s["id"] for s in specs], len(client.endpoints)) \
        if client.routed else {None: list(range(len(specs)))}
    step = cfg.transport.max_batch
    for idx in groups.values():
        for lo in range(0, len(idx), step):
            part = idx[lo:lo + step]
            for i, a in zip(part, client.enqueue_many([specs[i] for i in part]), strict=True):
                got[i] = str(a)


def _phase_table(phases, title=None):
    con = console()
    if len(phases) <= 50:
        t = Table(title=title, title_justify="left")
        t.add_column("action")
        t.add_column("phase")
        for a, ph in phases.items():
            t.add_row(a, _styled(ph))
    else:
        counts = collections.Counter(phases.values())
        t = Table(title=title, title_justify="left")
        t.add_column("phase")
        t.add_column("actions", justify="right")
        for ph in _PHASES:
            if counts[ph]:
                t.add_row(_styled(ph), str(counts[ph]))
    con.print(t)


_STYLE = {Phase.SUCCEEDED: "green", Phase.FAILED: "red", Phase.ABORTED: "yellow",
          Phase.TIMED_OUT: "red", Phase.RUNNING: "cyan", Phase.WAITING_FOR_RESOURCES: "magenta"}


def _styled(phase):
    style = _STYLE.get(phase)
    return f"[{style}]{phase.value}[/]" if style else phase.value


# ------------------------------------------------------------------------------ reads

def status(args):
    """``leasehold status``: the phase of each action."""
    ids = [str(ActionId.parse(a)) for a in args.actions]
    phases = {}
    with talk(args) as (cfg, client):
        step = cfg.transport.max_batch
        for lo in range(0, len(ids), step):
            part = ids[lo:lo + step]
            phases.update(zip(part, client.status(part), strict=True))
    if args.json:
        _emit_json({a: ph.value for a, ph in phases.items()})
    else:
        _phase_table(phases)
    return OK


def explain(args):
    """``leasehold explain``: phase, wait reason, position and ETA of one action."""
    action = str(ActionId.parse(args.action))
    with talk(args) as (_cfg, client):
        e = dict(client.explain(action))
    if e.get("wait") is not None:
        e["wait"] = WaitCode(e["wait"]).name      # the wire carries the code's number
    eta_ns = e.get("eta_ns")
    e["eta_s"] = None if eta_ns is None else max(0.0, (eta_ns - time.time_ns()) / 1e9)
    proj = e.get("projected_start_ns")
    e["projected_start_s"] = (None if proj is None
                              else max(0.0, (proj - time.time_ns()) / 1e9))
    if args.json:
        _emit_json(e)
        return OK
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    t.add_row("action", str(e["action"]))
    t.add_row("phase", _styled(Phase(e["phase"])))
    if e.get("wait") is not None:
        t.add_row("waits for", str(e["wait"]))
    if e.get("reason"):
        t.add_row("reason", e["reason"])
    if e.get("position") is not None:
        t.add_row("position", f"{e['position']} in its queue")
    if e.get("wait") is not None:
        t.add_row("eta", _eta_text(e["eta_s"]))
    if e.get("projected_why") is not None:
        # The projection (every queued action): when it is predicted to start, or why not.
        t.add_row("projected start", _eta_text(e["projected_start_s"])
                  if e["projected_start_s"] is not None else f"unknown: {e['projected_why']}")
    console().print(t)
    return OK


def abort(args):
    """``leasehold abort``: abort an action and its descendants."""
    action = str(ActionId.parse(args.action))
    with talk(args) as (_cfg, client):
        ended = client.abort(action, args.reason)
    if args.json:
        _emit_json({"action": action, "ended": ended})
    else:
        print(f"aborted {action}: {len(ended)} action(s) ended now"
              + (f" ({', '.join(ended[:10])}{', ...' if len(ended) > 10 else ''})"
                 if ended else "; running attempts stop at their worker"))
    return OK


# ------------------------------------------------------------------------------ watch

class _Bars:
    """Progress bars: one per phase (actions in it / actions known), and the ended ones."""

    def __init__(self, run):
        self.progress = Progress(TextColumn("{task.description:<22}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(),
                                 console=console())
        self.run = run
        self.tasks = {}

    def __enter__(self):
        self.progress.start()
        self.ended = self.progress.add_task("ended", total=None)
        for ph in _PHASES:
            self.tasks[ph] = self.progress.add_task(ph.value, total=None)
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def update(self, tracker, event, applied):
        n = len(tracker.state)
        for ph, task in self.tasks.items():
            self.progress.update(task, total=n, completed=tracker.counts[ph])
        self.progress.update(self.ended, total=n, completed=n - len(tracker.unended))
        if event is not None and applied and Phase(event.phase) in _ENDED_BADLY:
            self.progress.console.print(f"{_styled(Phase(event.phase))} {event.action}"
                                        + (f": {event.detail}" if event.detail else ""))


def watch(args):
    """``leasehold watch``: follow a run's events until every action seen has ended."""
    run = _check_run(args.run)
    ids = []
    for a in args.actions:
        aid = str(ActionId.parse(a if "/" in a else f"{run}/{a}"))
        if _run_of(aid) != run:
            raise CommandError("INVALID_ARGUMENT", f"{a}: not an action of run {run}")
        ids.append(aid)
    deadline = _deadline(args.timeout)
    with talk(args) as (cfg, client):
        t = RunTracker(client, [run], cfg.transport.max_batch)
        try:
            t.start(ids)
            print(f"watching {run} on {client.endpoint_of(run)} from seq {t.floor[run]}"
                  + (f", {len(ids)} action(s) given" if ids else ""), file=sys.stderr,
                  flush=True)
            view = contextlib.nullcontext() if args.json else _Bars(run)
            with view:
                if not args.json:
                    view.update(t, None, False)
                while not t.all_ended:
                    try:
                        e, applied = t.next(_left(deadline))
                    except ShardTimeout:
                        raise CommandError(
                            "DEADLINE_EXCEEDED", f"watch {run}: {len(t.unended)} of "
                            f"{len(t.state)} action(s) seen not ended within {args.timeout}s",
                            NO) from None
                    if args.json:
                        if e is not None:
                            print(json.dumps({"run": e.run, "seq": e.seq, "action": e.action,
                                              "phase": e.phase, "attempt": e.attempt,
                                              "time_ns": e.time_ns, "detail": e.detail}),
                                  flush=True)
                    else:
                        view.update(t, e, applied)
        finally:
            t.close()
    bad = sum(t.counts[ph] for ph in _ENDED_BADLY)
    if not args.json:
        summary = ", ".join(f"{t.counts[ph]} {ph.value}" for ph in _PHASES if t.counts[ph])
        print(f"run {run}: {len(t.state)} action(s) ended ({summary}) after "
              f"{human_seconds(time.monotonic() - t.started)}")
    return NO if bad else OK


# ------------------------------------------------------------------------------ queues

def _budget(text, flag):
    if text.strip() == "":
        return {}
    return {k: _quantity(v) for k, v in _pairs([x.strip() for x in text.split(",")],
                                               flag).items()}


def _changes(args):
    ch = {}
    if args.priority is not None:
        ch["priority"] = int(args.priority) if args.priority.isdigit() else args.priority
    for key in ("scheduling", "run_concurrency", "action_concurrency", "depth", "backfill",
                "paused", "draining"):
        if getattr(args, key) is not None:
            ch[key] = getattr(args, key)
    if args.max_resources is not None:
        ch["max_resources"] = _budget(args.max_resources, "--max-resources")
    if args.max_accelerators is not None:
        ch["max_accelerators"] = _budget(args.max_accelerators, "--max-accelerators")
    if args.clusters is not None:
        names = [c.strip() for c in args.clusters.split(",")]
        if args.clusters.strip() and not all(names):
            raise CommandError("INVALID_ARGUMENT", f"--clusters {args.clusters!r}: an empty "
                                                   f"cluster name")
        ch["clusters"] = [c for c in names if c]
    return ch


def _settings_rows(cfg, q):
    """``(key, text)`` rows of a QUEUE_UPDATE answer (a queue's settings as plain data)."""
    res = cfg.resources
    rows = []
    for key, value in q.items():
        if key == "name":
            continue
        if key == "max_resources":
            value = ", ".join(f"{n}={format_quantity(n, int(v))}"
                              for n, v in zip(res.names, value, strict=True)
                              if int(v) < UNLIMITED) or "no limit"
        elif key in ("run_concurrency", "action_concurrency") and value == 0:
            value = "0 (unlimited)"
        elif isinstance(value, (list, tuple)):
            value = ", ".join(str(v) for v in value)
        rows.append((key, str(value)))
    return rows


def _by_shard(client, answer):
    """``{shard or None: answer}``: a routing client's per-shard map as it is, a pinned
    client's one answer under None."""
    return answer if client.routed else {None: answer}


def queue_update(args):
    """``leasehold queue update``: change a queue live (on every shard, or ``--shard``);
    print its new settings."""
    changes = _changes(args)
    if not changes:
        raise CommandError("INVALID_ARGUMENT", f"queue update {args.name}: give at least one "
                           f"change (--priority, --action-concurrency, --paused, ...)")
    with talk(args) as (cfg, client):
        got = _by_shard(client, client.queue_update(args.name, **changes))
    if args.json:
        _emit_json(got[None] if None in got else
                   {"queue": args.name, "shards": {str(i): q for i, q in got.items()}})
        return OK
    for shard, q in got.items():
        on = "" if shard is None else f" on shard {shard}"
        t = Table(title=f"queue {args.name}{on}: updated ({', '.join(changes)}); the next "
                        f"tick uses it", title_justify="left")
        t.add_column("key")
        t.add_column("value")
        for key, text in _settings_rows(cfg, q):
            t.add_row(f"[bold]{key}[/]" if key in changes else key, text)
        console().print(t)
    return OK


def _left_in(metrics):
    """``(queued, in flight)`` summed over ``{shard: metrics}``."""
    return (sum(m["depth"] for m in metrics.values()),
            sum(m["actions_in_flight"] for m in metrics.values()))


def queue_drain(args):
    """``leasehold queue drain``: stop the queue taking new actions (on every shard, or
    ``--shard``); report when it is empty everywhere."""
    if args.timeout is not None and not args.wait:
        raise CommandError("INVALID_ARGUMENT", "--timeout is for --wait")
    deadline = _deadline(args.timeout)
    with talk(args) as (_cfg, client):
        client.queue_update(args.name, draining=True)
        ms = _by_shard(client, client.queue_metrics(args.name))
        depth, flying = _left_in(ms)
        if not args.json:
            each = "" if None in ms else " (" + ", ".join(
                f"shard {i}: {m['depth']} queued, {m['actions_in_flight']} in flight"
                for i, m in ms.items()) + ")"
            print(f"queue {args.name}: draining (new actions refused): {depth} queued, "
                  f"{flying} in flight{each}", flush=True)
        while args.wait and (depth or flying):
            if deadline is not None and time.monotonic() >= deadline:
                raise CommandError("DEADLINE_EXCEEDED", f"queue {args.name}: not empty "
                                   f"within {args.timeout}s ({depth} queued, "
                                   f"{flying} in flight)", NO)
            time.sleep(0.5 if deadline is None else min(0.5, _left(deadline)))
            ms = _by_shard(client, client.queue_metrics(args.name))
            depth, flying = _left_in(ms)
    empty = not (depth or flying)
    if args.json:
        out = {"queue": args.name, "draining": True, "empty": empty, "depth": depth,
               "actions_in_flight": flying}
        if None not in ms:
            out["shards"] = {str(i): {"depth": m["depth"],
                                      "actions_in_flight": m["actions_in_flight"]}
                             for i, m in ms.items()}
        _emit_json(out)
    elif empty:
        print(f"queue {args.name}: empty (nothing queued or in flight)")
    else:
        print(f"queue {args.name}: not empty yet (`leasehold queue drain {args.name} --wait` "
              f"reports when it is)")
    return OK
