"""storage (to come)."""

__all__ = []
