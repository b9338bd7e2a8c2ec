"""The user commands of the ``leasehold`` CLI (``docs/cli.md``): their arguments, the exit
codes, and the guard that turns every error into one line ``leasehold: CODE: message``.

``register(sub)`` adds them to the CLI's subparsers. The commands that talk to a shard or read
its status live in ``transport/_commands.py`` and ``transport/_top.py``, imported only when one
of them runs (so ``leasehold config check`` and the other local commands never import
ZeroMQ); ``config check`` is here, on ``engine/_config_view.py``.

Exit codes: 0 ok; 1 the command ran and the answer is "no" (an action ended other than
SUCCEEDED, an action or queue was not found, a wait ran out of time); 2 usage, config,
key, permission or connection errors; 130 interrupted (Ctrl-C).
"""

import argparse
import gc
import importlib
import json
import math
import os
import sys

from engine import _sigint
from engine._config import MAX_SECONDS
from engine._errors import LeaseholdError

__all__ = ["register", "guard", "load", "positive_seconds", "freeze_heap", "SERVER_GC_THRESHOLD",
           "CommandError", "OK", "NO", "ERROR", "INTERRUPTED"]

OK, NO, ERROR = 0, 1, 2
INTERRUPTED = _sigint.INTERRUPTED


class CommandError(LeaseholdError):
    """A command failed: ``code`` (a wire-style error code) and the exit status to return."""

    def __init__(self, code, message, exit_code=ERROR):
        super().__init__(message)
        self.code = code
        self.exit_code = exit_code


#: The cyclic collector's thresholds in a server process (``gc.set_threshold``). Python's
#: (700, 10, 10) run a young collection every 700 net allocations of containers and a full
#: one, which walks every object made since start-up, every 100 young ones (once the heap
#: grew by a quarter). Over ``bench/dispatch.py --actions 200000`` the shard process made 23
#: to 24 full collections with them, up to 15-17 ms each, inside loop turns, and spent 0.36
#: to 0.43 s in the collector; with these, one full collection (start-up's) and 0.24 s.
#: Cycles are rare in this code (objects go by reference count), so collecting them less
#: often costs little memory. The young threshold is 50,000: a worker holding a fan-out's
#: backlog keeps most of what it allocates alive for a while (a held lease, its attempt),
#: so a young collection walks nearly all of it; over ``bench/dispatch.py`` (50,000
#: actions) the worker made 30 to 33 collections, 25 to 31 ms, at 5,000, and one, 5 to 12
#: ms, at 50,000 (the shard 4 to 6 either way: it allocates arrays, not objects a lease).
SERVER_GC_THRESHOLD = (50_000, 20, 20)


def freeze_heap():
    """Collect once, then take every object alive now out of the cyclic collector's view
    (``gc.freeze``): what a server process holds from start-up (modules, config, a shard's
    reloaded state) is kept for its life, and a full collection would otherwise walk all of
    it again, ~30 ms a time here, as a pause inside a loop turn. Then collect less often
    (``SERVER_GC_THRESHOLD``). Only for a process the command owns (``leasehold shard``,
    ``leasehold worker``), never inside a user's process."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVER_GC_THRESHOLD)


def guard(fn):
    """``fn(args)`` with every error as one line ``leasehold: CODE: message`` on stderr and
    its exit code (module docstring); ``LEASEHOLD_TRACEBACK=1`` lets the unexpected through."""
    def run(args):
        try:
            return fn(args)
        except KeyboardInterrupt:
            return _sigint.interrupted()
        except BrokenPipeError:
            # The reader went away (`| head`): stop quietly, and keep the interpreter's exit
            # flush from failing on the closed pipe.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return OK
        except CommandError as exc:
            print(f"leasehold: {exc.code}: {exc}", file=sys.stderr)
            return exc.exit_code
        except LeaseholdError as exc:
            print(f"leasehold: {exc.code}: {exc}", file=sys.stderr)
            return ERROR
        except OSError as exc:
            print(f"leasehold: UNAVAILABLE: {exc}", file=sys.stderr)
            return ERROR
        except Exception as exc:
            if _sigint.is_interrupt(exc):      # a Ctrl-C Python 3.11 wrapped (RuntimeError)
                return _sigint.interrupted()
            if os.environ.get("LEASEHOLD_TRACEBACK"):
                raise
            print(f"leasehold: INTERNAL: {type(exc).__name__}: {exc} (a bug: "
                  f"LEASEHOLD_TRACEBACK=1 shows where)", file=sys.stderr)
            return ERROR
    return run


def load(module, name):
    """``name`` of ``module``, imported as a command starts (not when the CLI does). A
    Ctrl-C meanwhile is raised once the imports are done (engine/_sigint.py): an import
    interrupted half-way may print or leave things half made."""
    with _sigint.deferred():
        return getattr(importlib.import_module(module), name)


def _lazy(module, name):
    """The command ``name`` of ``module``, imported when it runs (:func:`load`)."""
    def run(args):
        return load(module, name)(args)
    return guard(run)


# ------------------------------------------------------------------------------ config check

def config_check(args):
    """Validate a config file and print its effective configuration (every key)."""
    from engine._config import load_config
    from engine._config_view import effective_config, render_toml
    from engine._state import check_fits_memory

    cfg = load_config(args.file)
    check_fits_memory(cfg)      # as a shard's start refuses it (on this machine's memory)
    if args.json:
        print(json.dumps({"source": cfg.source, "ok": True,
                          "config": effective_config(cfg)}, indent=2))
    else:
        print(f"# {cfg.source}: ok. The effective config: every key, defaults filled in "
              f"(a valid config file).")
        sys.stdout.write(render_toml(cfg))
    return OK


# ------------------------------------------------------------------------------ arguments

def _number_of_seconds(text, positive, bounded):
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not ((value > 0 if positive else value >= 0) and value < math.inf
            and (not bounded or value <= MAX_SECONDS)):
        bound = f" and at most {MAX_SECONDS} (10 years)" if bounded else ""
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of seconds {'>' if positive else '>='} 0{bound}")
    return value


def _seconds(text):
    # An action's durations: its spec's own checks bound them.
    return _number_of_seconds(text, positive=False, bounded=False)


def wait_seconds(text):
    """An argparse type: seconds >= 0 (0: do not wait), at most 10 years."""
    # The config's rule for every duration: a longer wait is a typo (1e300 waited for ever).
    return _number_of_seconds(text, positive=False, bounded=True)


def positive_seconds(text):
    """An argparse type: seconds > 0, at most 10 years."""
    return _number_of_seconds(text, positive=True, bounded=True)


def _count(text):
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0")
    return value


def _bool(text):
    low = text.lower()
    if low in ("true", "yes", "on", "1"):
        return True
    if low in ("false", "no", "off", "0"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not true or false")


_ROUTED = ("pin to shard N: transport.endpoints[N] (default: each request goes to the shard "
           "owning its tenant)")
_EVERY = "only shard N: transport.endpoints[N] and its status file (default: every shard)"


def _shard_options(p, needs_key=True, shard_help=_ROUTED):
    env = os.environ.get("LEASEHOLD_CONFIG")
    p.add_argument("--config", default=env, required=env is None,
                   help="the config file (default: $LEASEHOLD_CONFIG)")
    # None (not given) means "route by tenant" or "every shard", as the command says.
    p.add_argument("--shard", type=_count, default=None, metavar="N", help=shard_help)
    if needs_key:
        # Both default to None, not to $LEASEHOLD_KEY and 10: transport._commands.talk tells a
        # flag given from the environment's default, and a command that would not use one
        # refuses it when given (queue list without --remote).
        p.add_argument("--key", default=None,
                       help="the client key's name (keys_dir/NAME.key_secret); needed unless "
                            "security.insecure, refused with it (default: $LEASEHOLD_KEY)")
        p.add_argument("--request-timeout", type=positive_seconds, default=None, metavar="S",
                       help="seconds to wait for each answer of the shard (default 10)")


def _json(p, what="print JSON instead of the table"):
    p.add_argument("--json", action="store_true", help=what)


def _queue_changes(p):
    g = p.add_argument_group("changes (the keys of [queues.NAME]; give at least one)")
    g.add_argument("--priority", help="0..1000, or MIN, MEDIUM, MAX")
    g.add_argument("--scheduling", choices=("STRICT_FIFO", "GREEDY_CAPACITY"))
    g.add_argument("--run-concurrency", type=_count, metavar="N", help="0 = unlimited")
    g.add_argument("--action-concurrency", type=_count, metavar="N", help="0 = unlimited")
    g.add_argument("--depth", type=_count, metavar="N", help="max queued actions (>= 1)")
    g.add_argument("--max-resources", metavar="R=Q,...",
                   help='budget, e.g. cpu=64,memory=256Gi (replaces the non-device part; "" '
                        "lifts it)")
    g.add_argument("--max-accelerators", metavar="R=Q,...",
                   help='device budget, e.g. gpu:H100=16 (replaces the device part; "" '
                        "lifts it)")
    g.add_argument("--clusters", metavar="C,...", help='clusters the queue may use, or "*"')
    g.add_argument("--backfill", type=_bool, metavar="true|false")
    g.add_argument("--paused", type=_bool, metavar="true|false",
                   help="true: the tick places nothing from the queue (in flight runs on)")
    g.add_argument("--draining", type=_bool, metavar="true|false",
                   help="true: the queue takes no new actions (what it has runs out)")


def register(sub):
    """Add the user commands to ``sub`` (the CLI's subparsers)."""
    cmd = "transport._commands"

    p = sub.add_parser("config", help="configuration files (docs/cli.md)")
    cs = p.add_subparsers(dest="config_command", required=True)
    p = cs.add_parser("check", help="validate a config file and print the effective config: "
                      "every section and key, defaults filled in")
    p.add_argument("file", help="the config file")
    _json(p, "print the effective config as JSON")
    p.set_defaults(func=guard(config_check))

    p = sub.add_parser("submit", help="enqueue actions from a file or flags; print their ids")
    p.add_argument("file", nargs="?", help="a .json, .jsonl or .toml file of action specs, or "
                   "of one fan-out table {template, names, inputs} (docs/cli.md)")
    _shard_options(p)
    g = p.add_argument_group("one action from flags (without FILE)")
    g.add_argument("--id", help="tenant/project/domain/run/action")
    g.add_argument("--task", help="task name (default: the action's name)")
    g.add_argument("--cpu", help="cpu per pod: cores (2, 0.5) or millicores (500m)")
    g.add_argument("--memory", help="memory per pod (8Gi)")
    g.add_argument("--gpu", help="accelerators per pod, MODEL:N (H100:8)")
    g.add_argument("--resource", action="append", default=[], metavar="NAME=QTY",
                   help="any configured resource per pod (repeatable)")
    g.add_argument("--replicas", type=_count, default=1, metavar="N",
                   help="pods of the action (> 1: a gang that starts together)")
    g.add_argument("--queue", help="the run's queue (default: the engine's default queue)")
    g.add_argument("--parent", help="the parent action id (same run)")
    g.add_argument("--image")
    g.add_argument("--retries", type=_count, metavar="N", help="user retries")
    g.add_argument("--max-runtime", type=_seconds, metavar="S")
    g.add_argument("--max-queued-time", type=_seconds, metavar="S")
    g.add_argument("--deadline", type=_seconds, metavar="S")
    g.add_argument("--runtime-estimate", type=_seconds, metavar="S",
                   help="how long one attempt runs, when known (backfill predicts from it)")
    g.add_argument("--plugin", choices=("sim", "process", "python"),
                   help="what the worker runs it with")
    g.add_argument("--duration", type=_seconds, metavar="S", help="sim: seconds it holds")
    g.add_argument("--fail", metavar="USER|SYSTEM:CAUSE", help="sim: fail this way")
    g.add_argument("--fail-attempts", type=_count, metavar="N",
                   help="sim: fail the first N attempts only")
    g.add_argument("--command", metavar="ARGV", help="process: the command line (split like "
                   "a shell)")
    g.add_argument("--function", metavar="MODULE:FUNC", help="python: the function to call")
    g.add_argument("--env", action="append", default=[], metavar="K=V",
                   help="process/python: an environment variable (repeatable)")
    p.add_argument("--flyte", action="append", default=[], metavar="FILE",
                   help="a serialised Flyte 2 enqueue (flyteidl2 EnqueueActionRequest or "
                   "EnqueueRequest, docs/flyte.md) instead of FILE or flags (repeatable)")
    p.add_argument("--wait", action="store_true",
                   help="wait until every action ended (exit 1 unless all SUCCEEDED)")
    p.add_argument("--timeout", type=wait_seconds, metavar="S",
                   help="--wait: give up after S seconds (exit 1)")
    _json(p, "print the ids (and with --wait the phases) as JSON")
    p.set_defaults(func=_lazy(cmd, "submit"))

    p = sub.add_parser("status", help="the phase of each action")
    p.add_argument("actions", nargs="+", metavar="ACTION", help="action ids")
    _shard_options(p)
    _json(p)
    p.set_defaults(func=_lazy(cmd, "status"))

    p = sub.add_parser("explain", help="why an action is where it is: phase, wait reason "
                       "naming the blocker, position, ETA")
    p.add_argument("action", help="the action id")
    _shard_options(p)
    _json(p)
    p.set_defaults(func=_lazy(cmd, "explain"))

    p = sub.add_parser("abort", help="abort an action and its descendants")
    p.add_argument("action", help="the action id")
    p.add_argument("--reason", help="recorded with the outcome")
    _shard_options(p)
    _json(p, "print the ended ids as JSON")
    p.set_defaults(func=_lazy(cmd, "abort"))

    p = sub.add_parser("top", help="live per-queue and per-cluster table from the shards' "
                       "shared-memory status (never messages a shard)")
    _shard_options(p, needs_key=False,
                   shard_help="shard index: its status file shard-N.status (default 0)")
    p.add_argument("--all-shards", action="store_true",
                   help="every shard of transport.endpoints (default: --shard only)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--interval", type=positive_seconds, default=0.5, metavar="S",
                   help="seconds between frames, > 0 (default 0.5)")
    _json(p, "print one snapshot as JSON and exit")
    p.set_defaults(func=_lazy("transport._top", "top"))

    p = sub.add_parser("watch", help="progress of a run, fed by the shard's push stream, "
                       "until every action seen has ended (or Ctrl-C)")
    p.add_argument("run", help="tenant/project/domain/run")
    p.add_argument("actions", nargs="*", metavar="ACTION",
                   help="actions to follow from the start (ids or names in RUN)")
    _shard_options(p)
    p.add_argument("--timeout", type=wait_seconds, metavar="S",
                   help="give up after S seconds (exit 1)")
    _json(p, "print every event as a JSON line")
    p.set_defaults(func=_lazy(cmd, "watch"))

    p = sub.add_parser("queue", help="queues: list, live update, drain")
    qs = p.add_subparsers(dest="queue_command", required=True)
    p = qs.add_parser("list", help="every queue: policy, flags, depth, in flight, head")
    _shard_options(p, shard_help=_EVERY)
    p.add_argument("--remote", action="store_true",
                   help="ask the shard (QUEUE_METRICS, needs --key) instead of reading its "
                        "status file")
    _json(p)
    p.set_defaults(func=_lazy("transport._top", "queue_list"))
    p = qs.add_parser("update", help="change a queue live (an admin key): the next tick uses "
                      "it; nothing in flight is stopped")
    p.add_argument("name", help="the queue")
    _queue_changes(p)
    _shard_options(p, shard_help=_EVERY)
    _json(p, "print the queue's new settings as JSON")
    p.set_defaults(func=_lazy(cmd, "queue_update"))
    p = qs.add_parser("drain", help="stop a queue taking new actions (an admin key) and report "
                      "when it is empty")
    p.add_argument("name", help="the queue")
    p.add_argument("--wait", action="store_true",
                   help="wait until nothing is queued or in flight")
    p.add_argument("--timeout", type=wait_seconds, metavar="S",
                   help="--wait: give up after S seconds (exit 1)")
    _shard_options(p, shard_help=_EVERY)
    _json(p)
    p.set_defaults(func=_lazy(cmd, "queue_drain"))
