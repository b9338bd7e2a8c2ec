"""Resource names and quantities: the Flyte 2 ``Resources`` spellings to int64 vectors.

A shard's resources are named in its config (``cpu``, ``memory``, ``ephemeral_storage``,
``gpu:H100`` ...). A demand or capacity vector is an ``int64`` array in that order:
cpu in millicores, memory and disk in bytes, accelerators (``kind:model``) in whole devices,
any other name as a plain count.
"""

import math
import re
from dataclasses import dataclass
from decimal import Decimal

import numpy as np

__all__ = ["UNLIMITED", "MAX_SECONDS", "ResourceSet", "parse_quantity", "CPU", "BYTES", "DEVICE",
           "COUNT"]

# Sentinel for "no limit" / "unknown capacity" in int64 arrays. Far below INT64_MAX so
# that sums of a few in-flight vectors can never overflow.
UNLIMITED = 1 << 62

#: The longest duration a config or an action's spec may give (10 years): times become int64
#: nanoseconds added to the clock (a deadline is now + ttl), so a longer one would overflow,
#: not wait longer.
MAX_SECONDS = 10 * 365 * 86400

CPU, BYTES, DEVICE, COUNT = "cpu", "bytes", "device", "count"

_BYTE_SUFFIX = {
    "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}
_QUANTITY = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*\Z")
_NAME = re.compile(r"^[a-z][a-z0-9_]*(?::[A-Za-z0-9][A-Za-z0-9_.-]*)?\Z")
# Users write `disk` for ephemeral storage in Flyte 2.
_ALIASES = {"disk": "ephemeral_storage", "mem": "memory"}


def _kind_of(name):
    if name == "cpu":
        return CPU
    if name in ("memory", "ephemeral_storage"):
        return BYTES
    if ":" in name:
        return DEVICE
    return COUNT


def parse_quantity(name, kind, value):
    """Parse one quantity of resource ``name`` (of ``kind``) into its integer unit.

    Exact (decimal, not float) arithmetic; a result must be a whole unit, finite, and below
    :data:`UNLIMITED`. Raises ``ValueError`` with a message naming the resource and the value.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name}: {value!r} is not a quantity")
    if isinstance(value, int):
        number, suffix = Decimal(value), ""
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{name}: {value!r} is not a finite quantity")
        number, suffix = Decimal(repr(value)), ""
    elif isinstance(value, str):
        m = _QUANTITY.match(value)
        if not m:
            raise ValueError(f"{name}: {value!r} is not a quantity (e.g. 8, \"500m\", \"64Gi\")")
        number, suffix = Decimal(m.group(1)), m.group(2)
    else:
        raise ValueError(f"{name}: {value!r} is not a quantity")
    if number < 0:
        raise ValueError(f"{name}: {value!r} is negative")
    if kind == CPU:
        if suffix == "m":
            result = number
        elif suffix == "":
            result = number * 1000
        else:
            raise ValueError(f"{name}: {value!r} has unit {suffix!r}; cpu takes cores or 'm'")
        if result != result.to_integral_value():
            raise ValueError(f"{name}: {value!r} is finer than one millicore")
    elif kind == BYTES:
        if suffix not in _BYTE_SUFFIX:
            allowed = ", ".join(s for s in _BYTE_SUFFIX if s)
            raise ValueError(f"{name}: {value!r} has unknown unit {suffix!r} (allowed: {allowed})")
        result = number * _BYTE_SUFFIX[suffix]
        if result != result.to_integral_value():
            raise ValueError(f"{name}: {value!r} is not a whole number of bytes")
    else:
        if suffix:
            raise ValueError(f"{name}: {value!r} must be a whole count without a unit")
        result = number
        if result != result.to_integral_value():
            raise ValueError(f"{name}: {value!r} must be a whole count")
    if result >= UNLIMITED:
        raise ValueError(f"{name}: {value!r} is too large (the limit is below 2**62 units)")
    return int(result)


@dataclass(frozen=True)
class ResourceSet:
    """The ordered resource names of a shard and how to turn user spellings into vectors."""

    names: tuple

    def __post_init__(self):
        if not self.names:
            raise ValueError("at least one resource must be named")
        seen = set()
        for n in self.names:
            if not isinstance(n, str) or not _NAME.match(n):
                raise ValueError(
                    f"resource name {n!r} is invalid (lower-case word, or kind:model like gpu:H100)"
                )
            if n in seen:
                raise ValueError(f"resource {n!r} is named twice")
            seen.add(n)
        object.__setattr__(self, "_vectors", {})   # parsed tables (see vector)

    def __len__(self):
        return len(self.names)

    def index(self, name):
        """Position of ``name`` in vectors, or ``KeyError``."""
        return self.names.index(name)

    def kind(self, name):
        return _kind_of(name)

    @property
    def accelerator_mask(self):
        """uint8 vector, 1 where the resource is an accelerator (``kind:model``)."""
        return np.array([_kind_of(n) == DEVICE for n in self.names], dtype=np.uint8)

    @property
    def cpu_index(self):
        """Index of ``cpu`` or -1."""
        return self.names.index("cpu") if "cpu" in self.names else -1

    def vector(self, mapping, *, unset=0, flyte_spellings=True):
        """Turn ``{name: quantity}`` into an int64 vector; names not given take ``unset``.

        With ``flyte_spellings`` the Flyte 2 forms are accepted: ``gpu="H100:8"`` (or ``gpu=8``
        when exactly one ``gpu:*`` resource is configured), ``disk`` for ephemeral storage.
        Raises ``ValueError`` naming the resource and value.
        """
        if mapping is None:
            mapping = {}
        if not isinstance(mapping, dict):
            raise ValueError(f"resources must be a table of name = quantity, not {mapping!r}")
        # The same few resource tables come back with every action: parse each once.
        try:
            # Types are part of the key: 1, 1.0 and True hash alike but do not parse alike.
            key = (tuple((k, type(v), v) for k, v in mapping.items()), unset, flyte_spellings)
            hit = self._vectors.get(key)
        except TypeError:       # an unhashable value: parse (and refuse) it below
            key = hit = None
        if hit is not None:
            return hit.copy()
        vec = self._parse_vector(mapping, unset, flyte_spellings)
        if key is not None:
            if len(self._vectors) >= 4096:
                self._vectors.clear()
            self._vectors[key] = vec.copy()
        return vec

    def _parse_vector(self, mapping, unset, flyte_spellings):
        vec = np.full(len(self.names), unset, dtype=np.int64)
        given = set()
        for raw_name, value in mapping.items():
            name, value = self._resolve(raw_name, value, flyte_spellings)
            if name in given:
                raise ValueError(f"resource {name!r} is given twice")
            given.add(name)
            vec[self.names.index(name)] = parse_quantity(name, _kind_of(name), value)
        return vec

    def _resolve(self, raw_name, value, flyte_spellings):
        if not isinstance(raw_name, str):
            raise ValueError(f"resource name {raw_name!r} is not a string")
        name = _ALIASES.get(raw_name, raw_name) if flyte_spellings else raw_name
        if name in self.names:
            return name, value
        kinds = {n.split(":", 1)[0] for n in self.names if ":" in n}
        if flyte_spellings and name in kinds:
            models = [n for n in self.names if n.startswith(name + ":")]
            if isinstance(value, str) and ":" in value:
                model, count = value.split(":", 1)
                full = f"{name}:{model}"
                if full not in self.names:
                    raise ValueError(
                        f"{name}={value!r}: device {full!r} is not configured "
                        f"(configured: {', '.join(models)})"
                    )
                return full, count
            if len(models) == 1:
                return models[0], value
            raise ValueError(
                f"{name}={value!r} is ambiguous: name the device, e.g. "
                f"{name}=\"{models[0].split(':', 1)[1]}:{value}\" (configured: {', '.join(models)})"
            )
        raise ValueError(
            f"unknown resource {raw_name!r} (configured: {', '.join(self.names)})"
        )

    def describe(self, vec):
        """Human form of a vector, non-zero entries only: ``cpu=8, gpu:H100=16``."""
        parts = []
        for name, v in zip(self.names, vec, strict=True):
            v = int(v)
            if v == 0:
                continue
            parts.append(f"{name}={format_quantity(name, v)}")
        return ", ".join(parts) if parts else "nothing"


def format_quantity(name, value):
    """Inverse of :func:`parse_quantity` for messages: ``8``, ``500m``, ``64Gi``."""
    if value >= UNLIMITED:
        return "unlimited"
    kind = _kind_of(name)
    if kind == CPU:
        return str(value // 1000) if value % 1000 == 0 else f"{value}m"
    if kind == BYTES:
        for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
            unit = _BYTE_SUFFIX[suffix]
            if value and value % unit == 0:
                return f"{value // unit}{suffix}"
        return str(value)
    return str(value)
