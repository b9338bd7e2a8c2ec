"""Checks of decoded header values, one small function per kind of field.

A check takes ``(value, key)`` and returns the value (possibly normalised: a tuple of tenants,
a float from an int) or raises :class:`SchemaError` naming the key and what was wrong. The
checks that take limits are made per :class:`~engine._config.TransportSettings` by the
decoder (``transport/_protocol.py``), so a decode never looks limits up per value.

Free-form values (action specs, queue changes, reply bodies) are checked to be *plain data*
(maps with string keys, lists, strings, integers, finite floats, booleans, nil) to a bounded
depth: msgpack can also produce bytes, timestamps and extension objects, which nothing behind
the wire expects.
"""

import math
import re

from engine._model import SPEC_NAMES

__all__ = [
    "binaries",
    "SchemaError",
    "kind_of",
    "MAX_DEPTH",
    "MAX_INT",
    "boolean",
    "integer",
    "number",
    "string",
    "optional",
    "list_of",
    "map_of",
    "strings",
    "choice",
    "plain",
    "plain_map",
    "quantities",
    "spec_map",
    "CODE",
]

#: Deepest nesting of a free-form value (a spec, a queue change, a reply body).
MAX_DEPTH = 16
#: Largest integer a header carries where no smaller bound applies (int64).
MAX_INT = (1 << 63) - 1
_MIN_INT = -(1 << 63)


class SchemaError(Exception):
    """A header value is not what its message type takes (``code`` BAD_MESSAGE, or
    TOO_LARGE for a value over a size limit)."""

    def __init__(self, text, code="BAD_MESSAGE"):
        super().__init__(text)
        self.code = code
        self.text = text


def kind_of(value):
    """How a value's type is named in errors."""
    return "nil" if value is None else type(value).__name__


def boolean(value, key):
    """True or false."""
    if type(value) is not bool:
        raise SchemaError(f"{key!r} must be true or false, not {kind_of(value)}")
    return value


def integer(lo=0, hi=MAX_INT):
    """An integer ``lo <= v <= hi`` (a boolean is not an integer)."""

    def check(value, key):
        if type(value) is not int:
            raise SchemaError(f"{key!r} must be an integer, not {kind_of(value)}")
        if not lo <= value <= hi:
            raise SchemaError(f"{key!r} = {value} is out of range {lo}..{hi}")
        return value

    return check


def number(positive=True):
    """A finite number (> 0, or >= 0), as a float."""

    def check(value, key):
        if type(value) not in (int, float) or not math.isfinite(value) or (
                value <= 0 if positive else value < 0):
            raise SchemaError(f"{key!r} must be a finite number {'>' if positive else '>='} 0, "
                              f"not {value!r}")
        return float(value)

    return check


def string(limit, pattern=None, rule=None, empty=False):
    """A string of at most ``limit`` characters (non-empty unless ``empty``), matching
    ``pattern`` when given (``rule`` says what it is in the error)."""

    def check(value, key):
        if type(value) is not str:
            raise SchemaError(f"{key!r} must be a string, not {kind_of(value)}")
        if len(value) > limit:
            raise SchemaError(f"{key!r} is {len(value)} characters, over the limit {limit}",
                              "TOO_LARGE")
        if not value and not empty:
            raise SchemaError(f"{key!r} must not be empty")
        if pattern is not None and not pattern.match(value):
            raise SchemaError(f"{key!r} = {value[:80]!r} is not {rule}")
        return value

    return check


def optional(inner):
    """``inner``, or nil (None)."""

    def check(value, key):
        return None if value is None else inner(value, key)

    return check


def _sized_list(value, key, limit, limit_name, minimum):
    """``value``'s length, if it is a list of ``minimum``..``limit`` items."""
    if type(value) is not list:
        raise SchemaError(f"{key!r} must be a list, not {kind_of(value)}")
    n = len(value)
    if n > limit:
        raise SchemaError(f"too many items in {key!r}: {n} > {limit} ({limit_name})",
                          "TOO_LARGE")
    if n < minimum:
        raise SchemaError(f"{key!r} must have at least {minimum} item(s)")
    return n


def list_of(inner, limit, limit_name, minimum=1):
    """A list of ``minimum``..``limit`` items, each checked by ``inner`` (its key in errors
    is ``key[i]``); ``limit_name`` names the setting in a TOO_LARGE error."""

    def check(value, key):
        _sized_list(value, key, limit, limit_name, minimum)
        if inner is not None:
            for i, item in enumerate(value):
                inner(item, f"{key}[{i}]")
        return value

    return check


def map_of(key_check, inner, limit, limit_name, minimum=1):
    """A map of ``minimum``..``limit`` entries, each key checked by ``key_check`` and each
    value by ``inner`` (their key in errors is ``key.k``); ``limit_name`` names the bound in
    a TOO_LARGE error."""

    def check(value, key):
        if type(value) is not dict:
            raise SchemaError(f"{key!r} must be a map, not {kind_of(value)}")
        if len(value) > limit:
            raise SchemaError(f"too many entries in {key!r}: {len(value)} > {limit} "
                              f"({limit_name})", "TOO_LARGE")
        if len(value) < minimum:
            raise SchemaError(f"{key!r} must have at least {minimum} entr(ies)")
        for k, v in value.items():
            key_check(k, f"{key} key")
            inner(v, f"{key}.{k}")
        return value

    return check


def strings(limit, count, count_name, pattern=None, rule=None, nullable=False, minimum=1):
    """A list of strings (or nils when ``nullable``), each of 1..``limit`` characters and
    matching ``pattern`` when given. The fan-out names: the checks run as C-level passes
    over the list (types, lengths, matches), and only a failure walks it item by item to
    name the bad one."""
    allowed = {str, type(None)} if nullable else {str}
    one = string(limit, pattern, rule)

    def check(value, key):
        if not _sized_list(value, key, count, count_name, minimum):
            return value
        texts = [v for v in value if v is not None] if nullable else value
        if (set(map(type, value)) <= allowed and "" not in texts
                and max(map(len, texts), default=0) <= limit
                and (pattern is None or all(map(pattern.match, texts)))):
            return value
        for i, v in enumerate(value):      # name the first bad item
            if v is None and nullable:
                continue
            if type(v) is not str:
                raise SchemaError(f"{key}[{i}] must be a string"
                                  f"{' or nil' if nullable else ''}, not {kind_of(v)}")
            one(v, f"{key}[{i}]")
        raise AssertionError("unreachable: some item failed the fast check")

    return check


def binaries(limit, count, count_name):
    """A list of 1..``count`` byte strings, each of 1..``limit`` bytes (serialised messages
    of another protocol, such as Flyte's)."""

    def check(value, key):
        if not _sized_list(value, key, count, count_name, 1):
            return value
        for i, v in enumerate(value):
            if type(v) is not bytes:
                raise SchemaError(f"{key}[{i}] must be bytes, not {kind_of(v)}")
            if not 0 < len(v) <= limit:
                raise SchemaError(f"{key}[{i}] has {len(v)} bytes; allowed: 1..{limit}")
        return value

    return check


def choice(values):
    """One of ``values`` (strings)."""
    allowed = frozenset(values)
    listing = ", ".join(values)

    def check(value, key):
        if type(value) is not str or value not in allowed:
            raise SchemaError(f"{key!r} = {value!r} is not one of {listing}")
        return value

    return check


def _is_plain(value, depth):
    # The fast walk: no paths built; plain() walks again to name what failed.
    t = type(value)
    if t is str or t is bool or value is None:
        return True
    if t is int:
        return _MIN_INT <= value <= MAX_INT
    if t is float:
        return math.isfinite(value)
    if depth >= MAX_DEPTH:
        return False
    if t is list:
        for item in value:
            if not _is_plain(item, depth + 1):
                return False
        return True
    if t is dict:
        for k, item in value.items():
            if type(k) is not str or not _is_plain(item, depth + 1):
                return False
        return True
    return False


def plain(value, key, depth=0):
    """``value`` if it is plain data to :data:`MAX_DEPTH` levels, else SchemaError naming
    the first part that is not."""
    if _is_plain(value, depth):
        return value
    _explain(value, key, depth)
    raise AssertionError("unreachable: _explain raises")


def _explain(value, key, depth):
    t = type(value)
    if t is str or t is bool or value is None:
        return
    if t is int:
        if not _MIN_INT <= value <= MAX_INT:
            raise SchemaError(f"{key} = {value} is outside int64")
        return
    if t is float:
        if not math.isfinite(value):
            raise SchemaError(f"{key} = {value} is not a finite number")
        return
    if t not in (list, dict):
        raise SchemaError(f"{key} holds {kind_of(value)}, not plain data (map, list, string, "
                          f"number, boolean, nil)")
    if depth >= MAX_DEPTH:
        raise SchemaError(f"{key} nests deeper than {MAX_DEPTH} levels")
    if t is list:
        for i, item in enumerate(value):
            _explain(item, f"{key}[{i}]", depth + 1)
        return
    for k, item in value.items():
        if type(k) is not str:
            raise SchemaError(f"{key} has a key that is not a string ({kind_of(k)})")
        _explain(item, f"{key}.{k}", depth + 1)


def plain_map(empty=True):
    """A map of plain data (non-empty unless ``empty``)."""

    def check(value, key):
        if type(value) is not dict:
            raise SchemaError(f"{key!r} must be a map, not {kind_of(value)}")
        if not value and not empty:
            raise SchemaError(f"{key!r} must not be empty")
        return plain(value, key)

    return check


def quantities(value, key):
    """``{resource: quantity}``: a quantity is a non-negative integer or number, or a
    string such as ``"64Gi"`` (the engine parses it)."""
    if type(value) is not dict:
        raise SchemaError(f"{key!r} must be a map of resource to quantity, not {kind_of(value)}")
    for k, q in value.items():
        if type(k) is not str or not k or len(k) > 64:
            raise SchemaError(f"{key!r} has a resource name that is not a string of 1..64 "
                              f"characters: {k!r}")
        t = type(q)
        if t is int or t is float:
            if not (math.isfinite(q) and 0 <= q <= MAX_INT):
                raise SchemaError(f"{key}.{k} = {q!r} is not a non-negative quantity")
        elif t is not str or not q or len(q) > 64:
            raise SchemaError(f"{key}.{k} must be a quantity (number, or a string such as "
                              f"\"64Gi\"), not {q!r}")
    return value


def spec_map(name_limit):
    """An action spec as ``ActionSpec.from_dict`` takes it: a map of plain data with a string
    ``id`` (authorisation reads it before the engine sees the spec)."""
    idcheck = string(name_limit)
    namecheck = string(name_limit, empty=True)

    def check(value, key):
        if type(value) is not dict:
            raise SchemaError(f"{key} must be a map (an action spec), not {kind_of(value)}")
        if "id" not in value:
            raise SchemaError(f"{key} has no 'id'")
        idcheck(value["id"], f"{key}.id")
        plain(value, key)
        if value.get("parent") is not None:
            idcheck(value["parent"], f"{key}.parent")
        for field, name in spec_names(value):
            namecheck(name, f"{key}.{field}")
        return value

    return check


def spec_names(spec):
    """``(field, name)`` of every name string an action spec carries besides its id and
    parent (``SPEC_NAMES``, the pod roles), from a map or an ``ActionSpec``: each is
    bounded as ids are, since it travels in each lease of the action and in errors that
    repeat it (the engine checks what they must be; other types are its to refuse)."""
    if type(spec) is dict:
        get = spec.get
    else:
        def get(field):
            return getattr(spec, field, None)
    for field in SPEC_NAMES:
        if type(get(field)) is str:
            yield field, get(field)
    pods = get("pods")
    if isinstance(pods, (list, tuple)):
        for i, group in enumerate(pods):
            role = group.get("role") if type(group) is dict else getattr(group, "role", None)
            if type(role) is str:
                yield f"pods[{i}].role", role


#: Error codes: upper-case words joined by '_' (any such code decodes: newer shards may send
#: codes this side does not know).
CODE = re.compile(r"^[A-Z][A-Z_]{0,39}\Z")
