"""Enqueue groups: actions enqueued together with one spec.

A fan-out (a map task: N actions that differ only in their names) is one group; so is every
run of identical content in an ``enqueue_many`` batch (a batch of distinct specs is one group
per spec). A group's spec is compiled, checked and stored once (``specs`` database, key
:func:`group_key`), with the names of its actions and their input references; each action's
fixed record carries its group and its index in it. An action of a group is *lean* while its
fixed record is its whole outcome (see ``engine/_engine.py``): no Python object per action.
"""

import re
from collections.abc import Sequence

import msgpack

from engine._errors import SpecError
from engine._model import ActionId

__all__ = ["ActionIds", "EnqueueGroup", "abort_key", "group_key", "encode_group",
           "decode_group", "check_names", "MAX_INPUT_REF"]

#: Longest input reference a fan-out action may carry (bytes of UTF-8).
MAX_INPUT_REF = 4096

# The action part of an id (engine/_model.py's segment rule).
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# Many names joined by newlines (which no name may hold): one match for a whole fan-out.
_NAMES = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(?:\n[A-Za-z0-9][A-Za-z0-9_.-]*)*")


def group_key(gid):
    """The ``specs`` key of group ``gid``: ``b"g"`` and 8 bytes big-endian (a row's key is 8
    bytes, so the two never meet)."""
    return b"g" + int(gid).to_bytes(8, "big")


class EnqueueGroup:
    """One group in memory: its compiled template (the first action's id), the names of its
    actions by index, their input references (None when the group has none), and its spec's
    content (``engine._records.spec_content``: what :meth:`Engine.content_of` gives for a
    spec of the same declaration; None when not plain data)."""

    __slots__ = ("gid", "compiled", "names", "inputs", "parts", "content")

    def __init__(self, gid, compiled, names, inputs, content=None):
        self.gid = gid
        self.compiled = compiled
        self.names = names
        self.inputs = inputs
        self.content = content
        aid = compiled.id
        self.parts = (aid.tenant, aid.project, aid.domain, aid.run)

    def action_id(self, index):
        """The ActionId of the group's action ``index``."""
        return ActionId(*self.parts, self.names[index])

    def input_ref(self, index):
        """The input reference of action ``index``, or None."""
        return None if self.inputs is None else self.inputs[index]


class ActionIds(Sequence):
    """Action ids in order: a sequence of :class:`~engine.ActionId` made on access (equal to
    any sequence of the same ids). A fan-out returns the ids of its names; an abort the ids
    of the rows it ended.

    ``added``: for an enqueue (``enqueue_many``, ``enqueue_fanout``), a bool array, True
    where this call enqueued the action and False where it existed already (the same spec:
    a no-op); None otherwise."""

    __slots__ = ("_get", "_n", "added")

    def __init__(self, get, n, added=None):
        self._get = get     # index -> ActionId
        self._n = n
        self.added = added

    @classmethod
    def of_names(cls, parts, names, added=None):
        """The ids ``parts + name`` of every name (one run)."""
        return cls(lambda i: ActionId(*parts, names[i]), len(names), added)

    @classmethod
    def of_rows(cls, groups, gids, gidx):
        """The ids of rows given by their groups (``{gid: EnqueueGroup}``), group ids and
        indexes (arrays of the caller's own, not views of the columns: later changes of the
        rows do not show). Kept as arrays: an abort of a large tree returns at once."""
        return cls(lambda i: groups[int(gids[i])].action_id(int(gidx[i])), len(gids))

    def __len__(self):
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._get(k) for k in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"index {i} out of range for {self._n} ids")
        return self._get(i)

    def __eq__(self, other):
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(other) == len(self) and all(a == b for a, b in zip(self, other,
                                                                      strict=True))

    __hash__ = None

    def __repr__(self):
        return f"ActionIds({list(self[:3])}{' ...' if self._n > 3 else ''}, {self._n} ids)"


def abort_key(row):
    """The ``attempts`` key of an abort's reason, by the row it was called on (a row's key
    is 8 bytes, so the two never meet)."""
    return b"a" + int(row).to_bytes(8, "big")


def encode_group(content, names, inputs):
    """The stored record of a group: its spec's content (``engine._records.spec_content``:
    the spec less the action name), the names and the input references."""
    return msgpack.packb([content, names, inputs], use_bin_type=True)


def decode_group(raw):
    """``(content, names, inputs)`` of :func:`encode_group` output."""
    content, names, inputs = msgpack.unpackb(raw, raw=False)
    return content, names, inputs


def check_names(names, inputs):
    """Check a fan-out's names (and input references); returns them as lists. Raises
    ``SpecError`` naming the first bad item."""
    if isinstance(names, (str, bytes)):
        raise SpecError("names must be a list of action names, not one string")
    names = list(names)
    if not names:
        raise SpecError("a fan-out needs at least one name")
    try:
        joined = "\n".join(names)
    except TypeError:
        joined = None               # not all str: the loop below names the first
    if joined is None or joined.count("\n") != len(names) - 1 or (
            _NAMES.fullmatch(joined) is None):
        match = _NAME.fullmatch
        for i, name in enumerate(names):
            if not isinstance(name, str) or match(name) is None:
                raise SpecError(f"names[{i}]: {name!r} is not an action name (a letter or "
                                f"digit, then letters, digits, '_', '.', '-')")
    if len(set(names)) != len(names):
        seen = set()
        for i, name in enumerate(names):
            if name in seen:
                raise SpecError(f"names[{i}]: {name!r} appears twice")
            seen.add(name)
    if inputs is not None:
        inputs = list(inputs)
        if len(inputs) != len(names):
            raise SpecError(f"inputs has {len(inputs)} items for {len(names)} names")
        for i, ref in enumerate(inputs):
            if ref is not None and (not isinstance(ref, str) or "\0" in ref
                                    or len(ref.encode()) > MAX_INPUT_REF):
                # (It reaches the attempt as an environment variable: no NUL byte.)
                raise SpecError(f"inputs[{i}]: an input reference is a string of at most "
                                f"{MAX_INPUT_REF} bytes without a NUL byte, not {ref!r:.80}")
    return names, inputs
