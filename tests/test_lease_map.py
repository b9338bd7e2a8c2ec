"""The shard's lease map (transport/_lease_map.py): what action a reported token names."""

import numpy as np

from transport._lease_map import LeaseBatch, LeaseMap

KIND_BIT = np.uint64(1 << 63)   # a finalize lease's id (engine._leasing): never a row


def tokens(*pairs):
    """n x 3 uint64 tokens of (lease id, generation) pairs (the MAC is not read)."""
    out = np.zeros((len(pairs), 3), np.uint64)
    for i, (lid, gen) in enumerate(pairs):
        out[i, 0], out[i, 1] = lid, gen
    return out


def batch(run, ids, gens, attempts=None):
    b = LeaseBatch()
    ids = np.array(ids, np.uint64)
    b.add(ids, np.array(gens, np.uint64), run, [f"{run}/a{i}" for i in ids.tolist()],
          np.array(attempts or [1] * len(ids), np.int64))
    return b


def test_a_token_names_its_entry_only_at_the_entry_generation():
    m = LeaseMap()
    assert m.names(tokens((0, 1))) == [None] and m.named_run(tokens((0, 1))) is None
    empty = LeaseBatch()
    assert not empty
    m.join(empty)
    m.join(batch("acme/p/d/r", [3, 5000], [2, 7], [1, 3]))
    assert len(m) == 2
    got = m.names(tokens((3, 2), (3, 1), (5000, 7), (4, 0), (10**6, 1), (int(KIND_BIT) | 3, 2)))
    assert got == [(2, "acme/p/d/r", "acme/p/d/r/a3", 1), None,
                   (7, "acme/p/d/r", "acme/p/d/r/a5000", 3), None, None, None]
    assert m.named_run(tokens((5000, 7), (3, 2))) == (
        "acme/p/d/r", ["acme/p/d/r/a5000", "acme/p/d/r/a3"], [3, 1])
    assert m.named_run(tokens((5000, 7), (3, 1))) is None      # one stale: not all named


def test_a_later_lease_of_a_row_replaces_its_entry_and_a_drop_forgets_it():
    m = LeaseMap()
    m.join(batch("acme/p/d/r", [1, 2], [1, 1]))
    m.join(batch("acme/p/d/s", [2], [4]))       # row 2 leased again, another run's action
    assert m.names(tokens((2, 1))) == [None]
    assert m.names(tokens((2, 4))) == [(4, "acme/p/d/s", "acme/p/d/s/a2", 1)]
    assert m.named_run(tokens((1, 1), (2, 4))) is None          # two runs
    m.drop(np.array([2, 10**9, int(KIND_BIT) | 2], np.uint64))  # past the map: ignored
    assert m.names(tokens((2, 4), (1, 1))) == [None, (1, "acme/p/d/r", "acme/p/d/r/a1", 1)]
    assert len(m) == 1
