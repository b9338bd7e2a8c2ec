"""transport (to come)."""

__all__ = []
