"""The effective configuration: every section and every key of a validated
:class:`~engine._config.Config`, defaults filled in, as plain data (``--json``) or as a TOML
file that says exactly that (``leasehold config check``, ``docs/cli.md``).

The TOML form is a valid config file: loading it gives back the same effective config
(``tests/test_commands.py`` checks the round trip), so it can be saved and edited. Values the
file format cannot hold (a key that is not set and has no value: the worker's measured
capacity, a peer's key read from its file) are written as comments that say what applies.

Sections the renderer does not know (added to ``Config`` later) are still shown, generically,
so the view never silently omits part of a config.
"""

import dataclasses
import json
import os
import re

import numpy as np

from engine._units import DEVICE, UNLIMITED, format_quantity

__all__ = ["effective_config", "render_toml"]

_KNOWN = ("source", "resources", "engine", "storage", "transport", "security", "worker",
          "status", "supervisor", "clusters", "queues", "tenants", "tenant_defaults")
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+\Z")


def _quantity(name, value):
    """A vector entry as the config file writes it: ``500m``, ``64Gi``, or a number."""
    text = format_quantity(name, int(value))
    return int(text) if text.isdigit() else text


def _vector(resources, vec, skip_unlimited=False):
    return {n: _quantity(n, v) for n, v in zip(resources.names, vec, strict=True)
            if not (skip_unlimited and int(v) >= UNLIMITED)}


def _shapes(resources, shapes):
    return [{"name": s.name, "count": s.count,
             "allocatable": _vector(resources, s.allocatable)} for s in shapes]


def _size(value):
    return format_quantity("memory", int(value))


def _plain(value):
    # Generic: a section this module has no special case for.
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return value


def effective_config(cfg):
    """``cfg`` as plain data shaped like its TOML file, every key present (None where a key
    is not set and nothing is put in its place)."""
    res = cfg.resources
    out = {"resources": list(res.names)}
    out["engine"] = _plain(cfg.engine)
    st = _plain(cfg.storage)
    st["map_size"] = _size(cfg.storage.map_size)
    st["max_map_size"] = _size(cfg.storage.max_map_size)
    out["storage"] = st
    out["transport"] = _plain(cfg.transport)
    sec = cfg.security
    peers = {}
    for p in sec.peers:
        entry = {"role": p.role}
        if p.cluster is not None:
            entry["cluster"] = p.cluster
        if p.tenants:
            entry["tenants"] = list(p.tenants)
        entry["public_key"] = p.public_key     # None: read from KEYS_DIR/NAME.key
        peers[p.name] = entry
    out["security"] = {"insecure": sec.insecure, "keys_dir": sec.keys_dir,
                       "server_key": sec.server_key, "peers": peers}
    w = _plain(cfg.worker)
    w["capacity"] = None if cfg.worker.capacity is None else _vector(res, cfg.worker.capacity)
    w["node_shapes"] = _shapes(res, cfg.worker.node_shapes)
    out["worker"] = w
    # The directory the status files really go to (the default is derived from storage.path).
    out["status"] = {"dir": cfg.status.dir if cfg.status.dir is not None
                     else os.path.join(cfg.storage.path, "run"),
                     "interval": cfg.status.interval,
                     # TOML has no nil: no metrics endpoint is written `metrics = false`.
                     "metrics": cfg.status.metrics if cfg.status.metrics is not None else False}
    out["supervisor"] = _plain(cfg.supervisor)
    out["clusters"] = {
        c.name: {"capacity": None if c.capacity is None else _vector(res, c.capacity),
                 "node_shapes": _shapes(res, c.node_shapes)}
        for c in cfg.clusters}
    devices = [res.kind(n) == DEVICE for n in res.names]
    queues = {}
    for q in cfg.queues:
        limits = _vector(res, q.max_resources, skip_unlimited=True)
        queues[q.name] = {
            "priority": q.priority, "scheduling": q.scheduling,
            "run_concurrency": q.run_concurrency, "action_concurrency": q.action_concurrency,
            "depth": q.depth,
            "max_resources": {n: v for (n, v), d in
                              zip(_all(res, limits), devices, strict=True) if v is not None
                              and not d},
            "max_accelerators": {n: v for (n, v), d in
                                 zip(_all(res, limits), devices, strict=True) if v is not None
                                 and d},
            "clusters": list(q.clusters), "backfill": q.backfill, "paused": q.paused,
            "draining": q.draining,
        }
    out["queues"] = queues
    d = cfg.tenant_defaults
    out["tenant_defaults"] = {"run_concurrency": d.run_concurrency,
                              "action_concurrency": d.action_concurrency}
    out["tenants"] = {t.name: {"run_concurrency": t.run_concurrency,
                               "action_concurrency": t.action_concurrency}
                      for t in cfg.tenants}
    for f in dataclasses.fields(cfg):
        if f.name not in _KNOWN:
            out[f.name] = _plain(getattr(cfg, f.name))
    return out


def _all(res, limits):
    return [(n, limits.get(n)) for n in res.names]


# ------------------------------------------------------------------------------------- TOML

def _key(k):
    return k if _BARE_KEY.match(k) else json.dumps(k)


def _value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)        # JSON string escapes are TOML basic-string escapes
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + " }" \
            if v else "{}"
    raise TypeError(f"config view: {v!r} has no TOML form")


_UNSET = {
    ("worker", "capacity"): "not set: measured on the machine the worker runs on",
    ("worker", "default_plugin"): "not set: an action that declares no execute is refused",
}


# What a value means where the number alone does not say it.
_NOTES = {
    ("queues", "run_concurrency", "0"): "unlimited",
    ("queues", "action_concurrency", "0"): "unlimited",
    ("tenant_defaults", "run_concurrency", "0"): "unlimited",
    ("tenant_defaults", "action_concurrency", "0"): "unlimited",
    ("tenants", "run_concurrency", "0"): "unlimited",
    ("tenants", "action_concurrency", "0"): "unlimited",
    ("queues", "max_resources", "{}"): "no limit",
    ("queues", "max_accelerators", "{}"): "no limit",
    ("worker", "slots", "0"): "the machine's CPU count",
    ("status", "interval", "0.0"): "publish after every turn",
}


def _lines(section, table, out):
    for k, v in table.items():
        if v is None:
            why = _UNSET.get((section, k), "not set")
            out.append(f"# {_key(k)}: {why}")
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            continue        # arrays of tables: written after the scalar keys
        else:
            note = _NOTES.get((section, k, _value(v)))
            out.append(f"{_key(k)} = {_value(v)}" + (f"   # {note}" if note else ""))


def _array_tables(header, table, out):
    for k, v in table.items():
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for item in v:
                out.append("")
                out.append(f"[[{header}.{_key(k)}]]")
                _lines(None, item, out)


def render_toml(cfg):
    """The effective config as TOML text: every key with its value (defaults included)."""
    eff = effective_config(cfg)
    out = [f"resources = {_value(eff['resources'])}"]
    for section in ("engine", "storage", "transport", "status", "supervisor"):
        out += ["", f"[{section}]"]
        _lines(section, eff[section], out)
    sec = dict(eff["security"])
    peers = sec.pop("peers")
    out += ["", "[security]"]
    _lines("security", sec, out)
    for name, peer in peers.items():
        out += ["", f"[security.peers.{_key(name)}]"]
        if peer["public_key"] is None:
            peer = {k: v for k, v in peer.items() if k != "public_key"}
            out.append("# public_key: not set: read from keys_dir/NAME.key")
        _lines(None, peer, out)
    w = dict(eff["worker"])
    out += ["", "[worker]"]
    measured = w["capacity"] is None
    if measured:
        # node_shapes without a capacity would mean "capacity = their sum": write neither.
        w.pop("node_shapes")
    _lines("worker", w, out)
    if measured:
        out.append("# node_shapes: not set: one node of the capacity")
    _array_tables("worker", w, out)
    for name, c in eff["clusters"].items():
        header = f"clusters.{_key(name)}"
        out += ["", f"[{header}]"]
        if c["capacity"] is None:
            out.append("# capacity: unknown (no capacity and no node shapes): unlimited")
        else:
            out.append(f"capacity = {_value(c['capacity'])}")
        if not c["node_shapes"]:
            out.append("# node_shapes: unknown: every pod fits")
        _array_tables(header, {"node_shapes": c["node_shapes"]}, out)
    for name, q in eff["queues"].items():
        out += ["", f"[queues.{_key(name)}]"]
        _lines("queues", q, out)
    # Every tenant not named below has these caps.
    out += ["", "[tenant_defaults]"]
    _lines("tenant_defaults", eff["tenant_defaults"], out)
    for name, t in eff["tenants"].items():
        out += ["", f"[tenants.{_key(name)}]"]
        _lines("tenants", t, out)
    for name, value in eff.items():
        if name in _KNOWN:
            continue
        out += ["", f"[{_key(name)}]"]
        if isinstance(value, dict):
            _lines(name, value, out)
            _array_tables(name, value, out)
        else:
            out.append(f"# {_value(value)}")
    return "\n".join(out) + "\n"
