"""Spec dataclasses from plain data (JSON, msgpack, TOML): the one check of their keys."""

from dataclasses import fields

from engine._errors import SpecError

__all__ = ["table_of"]


def table_of(cls, data, what):
    """``data`` (a dict) as keyword arguments of dataclass ``cls``; a value that is not a
    table, or a key ``cls`` does not have, raises ``SpecError`` naming ``what``."""
    if not isinstance(data, dict):
        raise SpecError(f"{what} must be a table, not {data!r}")
    allowed = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise SpecError(f"{what}: unknown key(s) {', '.join(unknown)} "
                        f"(allowed: {', '.join(sorted(allowed))})")
    return dict(data)
