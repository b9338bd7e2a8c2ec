"""Lease records and the token codec.

A token is 24 bytes: lease id (uint64, top bit = kind, rest = row), generation (uint64) and
a SipHash-2-4 MAC of both under the shard's 128-bit secret, all little-endian. Workers treat
it as opaque; the engine refuses any token whose MAC does not match (forged or edited).
"""

import enum
import os
from dataclasses import dataclass

import numpy as np

from cext._lease import mint
from engine._errors import SpecError

__all__ = ["TOKEN_BYTES", "ErrorKind", "Attempt", "TokenCodec"]

TOKEN_BYTES = 24
KIND_BIT = 1 << 63


class ErrorKind(enum.StrEnum):
    """Who an error is attributed to: the user's code or the system around it."""

    USER = "USER"
    SYSTEM = "SYSTEM"


@dataclass
class Attempt:
    """One try of an action, as recorded in its history."""

    number: int                   # from 1
    generation: int = 0           # the run lease generation it ran under (0: never assigned)
    cluster: str | None = None
    worker: str | None = None
    enqueued_ns: int = 0          # when this attempt entered the queue
    start_ns: int | None = None   # assignment
    running_ns: int | None = None  # first RUNNING report
    end_ns: int | None = None
    phase: str | None = None      # terminal phase of the attempt
    error_kind: str | None = None
    cause: str | None = None      # OOM, EVICTED, EXPIRED, UNSCHEDULABLE, ... or the bound
    message: str = ""
    recoverable: bool | None = None
    finalize: str | None = None   # None, PENDING, SENT, SUCCEEDED, FAILED, ABANDONED


class TokenCodec:
    """Mints and parses tokens for one shard secret (16 bytes; random when not given)."""

    def __init__(self, secret=None):
        if secret is None:
            secret = os.urandom(16)
        if not isinstance(secret, (bytes, bytearray)) or len(secret) != 16:
            raise SpecError("the shard secret must be exactly 16 bytes")
        self.secret = bytes(secret)
        self.k0 = int.from_bytes(self.secret[:8], "little")
        self.k1 = int.from_bytes(self.secret[8:], "little")

    def mint(self, kind, row, generation):
        """One token as bytes."""
        arr = np.array([[(int(kind) << 63) | int(row), int(generation), 0]], dtype=np.uint64)
        mint(arr, self.k0, self.k1)
        return arr.astype("<u8").tobytes()

    def mint_array(self, tokens):
        """Fill the MAC column of an n x 3 uint64 array of (lease id, generation, 0) rows in
        one pass."""
        mint(tokens, self.k0, self.k1)
        return tokens

    @staticmethod
    def parse(tokens):
        """Tokens as an n x 3 uint64 array, from bytes (n * 24), one token, a list of tokens,
        or an array already in that shape. Raises ``SpecError`` on a malformed buffer."""
        if isinstance(tokens, np.ndarray):
            if tokens.dtype != np.uint64 or tokens.ndim != 2 or tokens.shape[1] != 3:
                raise SpecError("a token array must be n x 3 uint64")
            return np.ascontiguousarray(tokens)
        if isinstance(tokens, (list, tuple)):
            tokens = b"".join(bytes(t) for t in tokens)
        if not isinstance(tokens, (bytes, bytearray, memoryview)):
            raise SpecError(f"tokens must be bytes, not {type(tokens).__name__}")
        buf = memoryview(tokens).cast("B")
        if len(buf) % TOKEN_BYTES:
            raise SpecError(f"token buffer of {len(buf)} bytes is not a whole number of "
                            f"{TOKEN_BYTES}-byte tokens")
        return np.frombuffer(buf, dtype="<u8").reshape(-1, 3).astype(np.uint64, copy=False)
