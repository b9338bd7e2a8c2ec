"""Spec dataclasses from plain data (JSON, msgpack, TOML): the one check of their keys."""

from dataclasses import MISSING, fields

from engine._errors import SpecError

__all__ = ["table_of"]


def table_of(cls, data, what, check_required=True):
    """``data`` (a dict) as keyword arguments of dataclass ``cls``; a value that is not a
    table, a key ``cls`` does not have, or (``check_required``) a missing key ``cls`` has no
    default for raises ``SpecError`` naming ``what``."""
    if not isinstance(data, dict):
        raise SpecError(f"{what} must be a table, not {data!r}")
    allowed = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise SpecError(f"{what}: unknown key(s) {', '.join(unknown)} "
                        f"(allowed: {', '.join(sorted(allowed))})")
    required = [f.name for f in fields(cls)
                if f.default is MISSING and f.default_factory is MISSING]
    missing = [name for name in required if name not in data]
    if missing and check_required:
        raise SpecError(f"{what}: missing key(s) {', '.join(missing)} "
                        f"(required: {', '.join(required)})")
    return dict(data)
