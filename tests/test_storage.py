"""Storage layer: the Store interface (LmdbStore and MemoryStore), ownership claims, map-full
handling, corrupt records, the bulk op (Records blocks), the partition hash and the parallel
reload scan."""

import json
import os
import random
import subprocess
import sys
import tempfile
import textwrap
from collections import Counter
from pathlib import Path

import lmdb
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import storage._lmdb as lmdb_store
from storage import (
    DBS,
    SCHEMA_VERSION,
    Claim,
    CorruptRecord,
    InvalidBatch,
    LmdbStore,
    MemoryStore,
    OwnershipError,
    Puts,
    Records,
    StoreError,
    StoreFailed,
    StoreFull,
    StoreLost,
    partition_of,
    scan_parallel,
)

ROOT = Path(__file__).resolve().parent.parent
T0 = 1_700_000_000 * 10**9          # a fixed wall clock (ns)
S = 10**9
TTL_S = 10.0
P = 4


def k(i: int) -> bytes:
    return i.to_bytes(8, "big")


# --------------------------------------------------------------------------------------------
# a uniform harness over both stores


class Harness:
    """Builds stores of one kind, reopens them, and plays "another process" on the same
    store: for LMDB a real subprocess (LMDB allows one open per process), for memory a second
    MemoryStore on the same backing."""

    def __init__(self, kind, tmp_path):
        self.kind, self.path = kind, tmp_path / "store"
        self.backing = None

    def new(self, partitions=P, **kw):
        kw.setdefault("claim_ttl_s", TTL_S)
        if self.kind == "lmdb":
            kw.setdefault("map_size", 1 << 22)
            return LmdbStore(self.path, partitions=partitions, **kw)
        store = MemoryStore(partitions, backing=self.backing, **kw)
        self.backing = store.backing
        return store

    def other(self, shard, now_ns, partitions=P, then="close"):
        """Open the store as ``shard`` at ``now_ns`` elsewhere; ``then``: "close" (release)
        or "vanish" (keep the claim, as a live or crashed process would). Returns
        ``(ok, message)``."""
        if self.kind == "memory":
            store = MemoryStore(partitions, backing=self.backing, claim_ttl_s=TTL_S)
            try:
                store.open(shard, now_ns)
            except OwnershipError as e:
                return False, str(e)
            if then == "close":
                store.close()
            return True, ""
        code = textwrap.dedent(f"""
            import os, sys
            sys.path.insert(0, {str(ROOT)!r})
            from storage import LmdbStore, OwnershipError
            s = LmdbStore({str(self.path)!r}, partitions={partitions}, map_size={1 << 22},
                          claim_ttl_s={TTL_S})
            try:
                s.open({shard!r}, {now_ns})
            except OwnershipError as e:
                print("REFUSED", e, flush=True)
                sys.exit(0)
            print("OK", os.getpid(), flush=True)
            if {then!r} == "close":
                s.close()
            else:
                os._exit(0)
        """)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.startswith("OK"), r.stdout.strip()

    def tamper(self, partition, db, key, value):
        """Write a raw record behind the store's back (the store must be closed)."""
        if self.kind == "memory":
            self.backing.data[partition][db][key] = value
            return
        env = lmdb.open(str(self.path / f"p{partition:02d}"), max_dbs=len(DBS) + 1,
                        map_size=1 << 22)
        try:
            with env.begin(write=True, db=env.open_db(db.encode())) as txn:
                txn.put(key, value)
        finally:
            env.close()


@pytest.fixture(params=["lmdb", "memory"])
def h(request, tmp_path):
    return Harness(request.param, tmp_path)


@pytest.fixture
def hl(tmp_path):
    return Harness("lmdb", tmp_path)


def content(store, dbs=("actions", "specs", "queues")):
    return {db: sorted(store.scan(db)) for db in dbs}


# --------------------------------------------------------------------------------------------
# round trip


def test_round_trip_across_partitions(h):
    s = h.new()
    s.open("a", T0)
    arr = np.arange(32, dtype=np.uint8)
    s.commit({
        0: [("actions", k(1), b"one"), ("actions", k(2), b"two"), ("specs", b"s1", b"spec")],
        2: [("actions", k(3), bytearray(b"three")), ("queues", b"q", memoryview(b"qq"))],
        3: [("actions", k(4), arr[8:16]), ("meta", b"engine-secret", b"x")],
    })
    assert s.get(0, "actions", k(1)) == b"one"
    assert s.get(2, "actions", k(3)) == b"three"
    assert s.get(3, "actions", k(4)) == bytes(range(8, 16))
    assert s.get(1, "actions", k(1)) is None
    assert s.get(3, "meta", b"engine-secret") == b"x"
    arr[8] = 99                                    # the store copied the buffer
    assert s.get(3, "actions", k(4))[0] == 8
    # overwrite, delete, delete of a missing key, later op on the same key wins
    s.commit({0: [("actions", k(1), b"uno"), ("actions", k(2), None), ("actions", k(9), None),
                  ("specs", b"s1", b"a"), ("specs", b"s1", b"b")]})
    assert s.get(0, "actions", k(1)) == b"uno"
    assert s.get(0, "actions", k(2)) is None
    assert s.get(0, "specs", b"s1") == b"b"
    assert list(s.scan("actions")) == [
        (0, k(1), b"uno"), (2, k(3), b"three"), (3, k(4), bytes(range(8, 16)))]
    assert list(s.scan("history")) == []
    before = content(s)
    s.close()
    s = h.new()
    s.open("a", T0 + S)
    assert content(s) == before
    s.close()


def test_scan_orders_partitions_then_unsigned_keys(h):
    s = h.new()
    s.open("a", T0)
    rows = [0, 1, 255, 256, 2**40, 2**63 + 5]
    s.commit({p: [("actions", k(r), bytes([p])) for r in reversed(rows)] for p in (3, 1)})
    assert [(p, int.from_bytes(key, "big")) for p, key, _ in s.scan("actions")] == (
        [(1, r) for r in rows] + [(3, r) for r in rows])
    s.close()


def test_empty_batch_is_a_no_op_and_closed_store_refuses(h):
    s = h.new()
    with pytest.raises(StoreError, match="not open"):
        s.commit({0: [("actions", k(1), b"x")]})
    s.open("a", T0)
    s.commit({})
    s.commit({0: [], 1: []})
    s.close()
    s.close()                                      # idempotent
    with pytest.raises(StoreError, match="not open"):
        s.commit({0: [("actions", k(1), b"x")]})


def test_claim_record_is_readable(h):
    s = h.new()
    s.open("shard-7", T0)
    c = Claim.decode(s.get(1, "meta", b"claim"))
    assert (c.shard, c.pid, c.expiry_ns) == ("shard-7", os.getpid(), T0 + int(TTL_S * S))
    s.close()
    s = h.new()
    s.open("shard-7", T0)
    s.close()


# --------------------------------------------------------------------------------------------
# atomicity


def test_group_commit_is_atomic_on_injected_failure(h):
    s = h.new()
    s.open("a", T0)
    s.commit({p: [("actions", k(p), b"old")] for p in range(P)})
    before = content(s)
    s.fail_next(RuntimeError("injected"))
    with pytest.raises(RuntimeError, match="injected"):
        s.commit({p: [("actions", k(p), b"new"), ("specs", k(p), b"new")] for p in range(P)})
    assert content(s) == before
    # the store stays usable, and the injection was one-shot
    s.commit({p: [("actions", k(p), b"new")] for p in range(P)})
    assert [v for _, _, v in s.scan("actions")] == [b"new"] * P
    s.close()


BAD_OPS = {
    "unknown db": ("nope", k(1), b"x"),
    "empty key": ("actions", b"", b"x"),
    "oversized key": ("actions", b"k" * 512, b"x"),
    "str key": ("actions", "key", b"x"),
    "int value": ("actions", k(1), 5),
    "reserved meta key": ("meta", b"claim", b"x"),
    "reserved schema": ("meta", b"schema", b"x"),
    "not a triple": ("actions", k(1)),
}


@pytest.mark.parametrize("bad", list(BAD_OPS))
def test_invalid_batch_applies_nothing(h, bad):
    s = h.new()
    s.open("a", T0)
    before = content(s)
    batch = {p: [("actions", k(p), b"v"), ("specs", k(p), b"v")] for p in range(P - 1)}
    batch[P - 1] = [("actions", k(50), b"v"), BAD_OPS[bad]]
    with pytest.raises(InvalidBatch) as ei:
        s.commit(batch)
    assert isinstance(ei.value, ValueError)
    assert content(s) == before
    for p in (-1, P, "0"):
        with pytest.raises(InvalidBatch, match="out of range"):
            s.commit({0: [("actions", k(1), b"v")], p: [("actions", k(1), b"v")]})
    assert content(s) == before
    s.commit(batch | {P - 1: [("actions", k(50), b"v")]})
    assert len(list(s.scan("actions"))) == P
    s.close()


def test_consecutive_puts_apply_in_op_order_and_a_bad_one_is_named(h):
    """Puts to one database in a row (LMDB writes them with one putmulti) apply exactly as
    their ops one by one: a later put of a key wins, a delete between puts splits them; a
    bad op inside a long run is named and nothing of the batch is applied."""
    s = h.new()
    s.open("a", T0)
    ops = [("actions", k(1), b"a1"), ("actions", k(2), b"b1"), ("actions", k(1), b"a2"),
           ("actions", k(2), None), ("actions", k(2), b"b3"), ("specs", k(1), b"s1"),
           ("actions", k(1), b"a4"), ("actions", k(3), np.frombuffer(b"xyz", np.uint8))]
    s.commit({0: ops})
    assert s.get(0, "actions", k(1)) == b"a4" and s.get(0, "actions", k(2)) == b"b3"
    assert s.get(0, "actions", k(3)) == b"xyz" and s.get(0, "specs", k(1)) == b"s1"
    before = content(s)
    run = [("actions", k(100 + i), b"v") for i in range(100)]
    run[50] = ("actions", k(150), 7)
    with pytest.raises(InvalidBatch, match=r"partition 1\b.*x96") as ei:    # its key, k(150)
        s.commit({1: run})
    assert ei.value.partition == 1
    assert content(s) == before
    s.close()


def test_store_full_applies_nothing_and_resize_lets_it_succeed(hl):
    s = hl.new(map_size=512 << 10)
    s.open("a", T0)
    s.commit({p: [("actions", k(0), b"seed")] for p in range(P)})
    before = content(s)
    batch = {p: [("actions", k(1), b"a" * (100 << 10))] for p in range(P - 1)}
    batch[P - 1] = [("actions", k(i), b"b" * (100 << 10)) for i in range(1, 7)]   # 600 KiB
    with pytest.raises(StoreFull) as ei:
        s.commit(batch)
    e = ei.value
    assert e.partition == P - 1 and e.map_size == 512 << 10
    assert f"partition {P - 1}" in str(e) and "512 KiB" in str(e) and "resize" in str(e)
    assert "raise that setting" in str(e) and "storage.max_map_size" in str(e)  # a shard's cap
    assert content(s) == before
    with pytest.raises(ValueError, match="only grow"):
        s.resize(256 << 10)
    s.resize(4 << 20)
    assert s.map_size == 4 << 20
    s.commit(batch)
    assert s.get(P - 1, "actions", k(6)) == b"b" * (100 << 10)
    assert s.get(0, "actions", k(1)) == b"a" * (100 << 10)
    s.close()
    # a store that grew reopens with the small configured size: LMDB keeps the larger one
    s = hl.new(map_size=512 << 10)
    s.open("a", T0 + S)
    assert s.get(P - 1, "actions", k(6)) == b"b" * (100 << 10)
    s.close()


def test_single_partition_store_full(hl):
    s = hl.new(map_size=256 << 10)
    s.open("a", T0)
    with pytest.raises(StoreFull, match="partition 2"):
        s.commit({2: [("actions", k(i), b"x" * 4000) for i in range(200)]})
    assert list(s.scan("actions")) == []
    s.commit({2: [("actions", k(1), b"x")]})
    s.close()


@pytest.mark.parametrize("stage", ["carrier-committed", "partition-committed"])
def test_failure_after_commit_point_is_completed_by_reopen(hl, monkeypatch, stage):
    s = hl.new()
    s.open("a", T0)
    s.commit({p: [("actions", k(p), b"old")] for p in range(P)})

    def hook(at):
        if at == stage:
            raise OSError(5, "injected I/O error")

    monkeypatch.setattr(lmdb_store, "_crash_hook", hook)
    with pytest.raises(StoreFailed) as ei:
        s.commit({p: [("actions", k(p), b"new"), ("specs", k(p), b"new")] for p in range(P)})
    assert ei.value.outcome == "durable"
    monkeypatch.setattr(lmdb_store, "_crash_hook", None)
    with pytest.raises(StoreFailed, match="reopened"):
        s.commit({0: [("actions", k(9), b"x")]})
    s.close()
    s = hl.new()
    s.open("a", T0 + S)
    assert [v for _, _, v in s.scan("actions")] == [b"new"] * P
    assert [v for _, _, v in s.scan("specs")] == [b"new"] * P
    s.commit({0: [("actions", k(9), b"x")]})
    s.close()


# Issue 15: a full map inside a group of several partitions (after the commit point) and at
# open.


def two_partition_group(g, size=300, carried=300):
    # Partition 0 (the larger part, or the first of two alike) carries partition 1's.
    return {0: [("actions", k(g), b"x" * size)], 1: [("actions", k(g), b"y" * carried)]}


def test_a_carried_partition_that_fills_at_its_commit_is_completed(hl):
    # Near a full map the write phase of a group fits but LMDB's commit of a partition after
    # the commit point (the carrier's) needs a page more: partition 1, 100 KB fuller than the
    # carrier, does ~150 groups in here. The group is durable: the store grows that map for
    # as long as it takes, completes the group and sets the map back, then refuses new groups
    # cleanly (no resize here: as at max_map_size), never StoreFailed.
    s = hl.new(map_size=256 << 10, sync=False)
    s.open("a", T0)
    for i in range(100):
        s.commit({1: [("specs", k(i), b"z" * 1000)]})
    acked = 0
    with pytest.raises(StoreFull):
        for g in range(5000):
            s.commit(two_partition_group(g, size=400))
            acked += 1
    assert acked > 100
    assert [key for _, key, _ in s.scan("actions")] == [k(g) for g in range(acked)] * 2
    s.renew(T0 + S)                   # the store's own records still go in
    s.close()
    for p in (0, 1):                  # past the map by at most what one commit needed
        assert (hl.path / f"p{p:02d}" / "data.mdb").stat().st_size <= (256 + 64) << 10
    for i in range(2):                # the same config opens it, again and again
        s = hl.new(map_size=256 << 10)
        s.open("a", T0 + (i + 2) * S)
        assert len(list(s.scan("actions"))) == 2 * acked
        s.close()


def test_multi_partition_groups_grow_the_maps_with_resize_and_reopen_at_the_configured_size(hl):
    # What the engine does on StoreFull (grow by doubling, retry): never StoreFailed.
    s = hl.new(map_size=256 << 10, sync=False)
    s.open("a", T0)
    for g in range(2000):
        while True:
            try:
                s.commit(two_partition_group(g))
                break
            except StoreFull:
                s.resize(s.map_size * 2)
    assert s.map_size > 256 << 10
    s.close()
    s = hl.new(map_size=256 << 10)
    s.open("a", T0 + S)
    assert len(list(s.scan("actions"))) == 4000
    s.commit(two_partition_group(2000))
    s.close()


def _durable_on_a_grown_map_then_reopen(hl, monkeypatch, big):
    """Commit ``big`` on a map grown past the configured 256 KiB, fail right after the
    carrier's commit (the group is durable), reopen at the configured size; returns the error
    and the reopened store."""
    s = hl.new(map_size=256 << 10)
    s.open("a", T0)
    s.resize(4 << 20)

    def hook(at):
        if at == "carrier-committed":
            raise OSError(5, "injected I/O error")

    monkeypatch.setattr(lmdb_store, "_crash_hook", hook)
    with pytest.raises(StoreFailed) as ei:
        s.commit(big)
    monkeypatch.setattr(lmdb_store, "_crash_hook", None)
    s.close()
    s = hl.new(map_size=256 << 10)
    s.open("a", T0 + S)
    return ei.value, s


def test_reopen_grows_a_partition_that_the_replay_needs(hl, monkeypatch):
    # A durable group written while the map was grown; the reopen at the configured (smaller)
    # map size must grow the map to replay it, not refuse to open.
    big = {p: [("actions", k(i), bytes([p]) * (100 << 10)) for i in range(6)] for p in (0, 1)}
    err, s = _durable_on_a_grown_map_then_reopen(hl, monkeypatch, big)
    assert err.outcome == "durable"
    assert s.map_size > 600 << 10
    assert sorted(s.scan("actions")) == sorted(
        (p, key, value) for p, ops in big.items() for _, key, value in ops)
    s.close()
    s = hl.new(map_size=256 << 10)
    s.open("a", T0 + 2 * S)
    assert len(list(s.scan("actions"))) == 12
    s.close()


def test_redo_records_are_deleted_before_they_fill_a_small_map(hl):
    # A map far below the 64 MiB checkpoint threshold: the carrier's redo records (6 KB a
    # group here, 1.2 MB in all) would fill its 256 KiB; a checkpoint deletes them first.
    s = hl.new(map_size=256 << 10)
    s.open("a", T0)
    for g in range(200):
        s.commit({p: [("actions", k(p), bytes([g % 251]) * 2000)] for p in range(P)})
    s.close()
    s = hl.new(map_size=256 << 10)
    s.open("a", T0 + S)
    assert [v for _, _, v in s.scan("actions")] == [bytes([199]) * 2000] * P
    s.close()


def test_a_group_that_fits_only_without_the_redo_records_deletes_them_and_goes_in(hl):
    # Below the checkpoint threshold (a quarter of the 256 KiB map) the carrier, partition 0,
    # holds ~56 KiB of redo records; the next group (100 KiB of its own, 3 x 8 KiB to carry)
    # fits only once they are gone: they are deleted (checkpoint), not the group refused.
    s = hl.new(map_size=256 << 10, sync=False)
    s.open("a", T0)
    for g in range(17):
        s.commit({p: [("actions", k(p), bytes([g]) * 1100)] for p in range(P)})
    big = {p: [("specs", k(p), bytes([p]) * ((100 if p == 0 else 8) << 10))] for p in range(P)}
    s.commit(big)
    s.close()
    s = hl.new(map_size=256 << 10)
    s.open("a", T0 + S)
    assert [v for _, _, v in s.scan("specs")] == [ops[0][2] for ops in big.values()]
    assert [v for _, _, v in s.scan("actions")] == [bytes([16]) * 1100] * P
    s.close()


# --------------------------------------------------------------------------------------------
# the bulk op: Records blocks


def block(db, rows, value_size=180, fill=None, key_size=8):
    """A Records block of ``rows`` (big-endian keys of ``key_size`` bytes); record ``i``'s
    value is ``value_size`` bytes derived from its row and ``fill``."""
    rows = np.asarray(rows, dtype=np.uint64)
    be = rows.astype(">u8").view(np.uint8).reshape(-1, 8)
    keys = np.zeros((len(rows), key_size), np.uint8)        # right-aligned, zero-padded
    keys[:, max(key_size - 8, 0):] = be[:, max(8 - key_size, 0):]
    values = ((rows[:, None] * 7 + np.arange(value_size) + (fill or 0)) % 251).astype(np.uint8)
    return Records(db, keys, values, key_size, value_size)


def expand(batch):
    """The same batch with every block spelt out as triples."""
    out = {}
    for p, ops in batch.items():
        out[p] = []
        for op in ops:
            if isinstance(op, (Records, Puts)):
                out[p].extend((op.db, key, value) for key, value in op.pairs())
            else:
                out[p].append(op)
    return out


def model_apply(model, batch):
    for p, ops in expand(batch).items():
        for db, key, value in ops:
            if value is None:
                model.pop((p, db, bytes(key)), None)
            else:
                model[(p, db, bytes(key))] = bytes(value)


def state(store, dbs=("actions", "finalize", "specs")):
    return {(p, db, key): value for db in dbs for p, key, value in store.scan(db)}


def test_records_api():
    r = block("actions", [3, 1, 2], value_size=4)
    assert len(r) == 3 and r.db == "actions" and (r.key_size, r.value_size) == (8, 4)
    assert r.key(0) == k(3) and r.value(1) == bytes([7, 8, 9, 10])
    assert list(r) == [(r.key(i), r.value(i)) for i in range(3)]
    assert list(r.pairs(1, 2)) == [(k(1), r.value(1))]
    assert list(r.pairs(2)) == [(k(2), r.value(2))] and list(r.pairs(2, 1)) == []
    assert next(r.pairs()) == (k(3), r.value(0))        # an iterator, as it always was
    assert all(type(x) is bytes for pair in r.pairs() for x in pair)
    assert list(block("specs", [5, 6], key_size=3, value_size=0)) == [
        (bytes([0, 0, 5]), b""), (bytes([0, 0, 6]), b"")]
    assert not r.ascending() and block("actions", [1, 2, 3]).ascending()
    assert not block("actions", [1, 2, 2]).ascending()          # duplicates: not strictly
    assert block("actions", [0, 1, 255, 256, 2**40, 2**63 + 5]).ascending()
    # sizes that are not whole words, trailing zero bytes (keys compare as unsigned bytes)
    for ks in (1, 3, 12, 511):
        rows = [0, 1, 2, 255] if ks < 8 else [0, 1, 256, 2**63]
        assert block("specs", rows, key_size=ks, value_size=0).ascending()
        assert not block("specs", rows[::-1], key_size=ks, value_size=0).ascending()
    ks12 = np.zeros((3, 12), np.uint8)
    ks12[1, 0], ks12[2, 0], ks12[2, 11] = 1, 1, 1       # differ in the first or last byte
    assert Records("specs", ks12, b"", 12, 0).ascending()
    assert not Records("specs", ks12[[0, 2, 1]].copy(), b"", 12, 0).ascending()
    with pytest.raises(IndexError):
        r.key(3)
    assert r == block("actions", [3, 1, 2], value_size=4) != block("actions", [3, 1, 2])
    assert "3 records" in repr(r)
    empty = Records("actions", b"", b"", 8, 180)
    assert len(empty) == 0 and list(empty) == [] and empty.ascending()
    # no copy: the block sees the caller's buffer until commit copies it
    buf = bytearray(k(1))
    r = Records("actions", buf, bytearray(2), 8, 2)
    buf[7] = 9
    assert r.key(0) == k(9)


BAD_BLOCKS = {
    "unknown db": (("nope", k(1), b"v"), "unknown database 'nope'"),
    "key_size 0": (("actions", b"", b"", 0, 0), "key_size 0 must be 1..511"),
    "key_size 512": (("actions", b"k" * 512, b"", 512, 0), "key_size 512 must be 1..511"),
    "negative value_size": (("actions", k(1), b"", 8, -1), "value_size -1 must be >= 0"),
    "float size": (("actions", k(1), b"v", 8.0, 1), "key_size must be an int, not float"),
    "bool size": (("actions", k(1), b"v", 8, True), "value_size must be an int, not bool"),
    "keys not a multiple": (("actions", k(1) + b"x", b"vv", 8, 1), "9 bytes, not a multiple"),
    "values too short": (("actions", k(1) + k(2), b"v", 8, 1), "expected 2 records"),
    "values too long": (("actions", k(1), b"vv", 8, 1), "expected 1 records"),
    "str keys": (("actions", "k" * 8, b"v", 8, 1), "keys of type str is not bytes-like"),
    "no values": (("actions", k(1), None, 8, 1), "values of type NoneType"),
    "strided keys": (("actions", np.arange(4, dtype=">u8")[::2], b"vv", 8, 1),
                     "keys must be C-contiguous"),
}


@pytest.mark.parametrize("bad", list(BAD_BLOCKS))
def test_a_malformed_block_is_refused_by_name(bad):
    args, message = BAD_BLOCKS[bad]
    if len(args) == 3:
        args = (*args, 8, 1)
    with pytest.raises(InvalidBatch, match=message) as ei:
        Records(*args)
    assert isinstance(ei.value, ValueError)


def test_a_block_with_a_reserved_meta_key_applies_nothing(h):
    s = h.new()
    s.open("a", T0)
    s.commit({0: [block("actions", [1, 2])]})
    before = state(s)
    bad = Records("meta", b"engine" + b"claim!" + b"layout", b"x" * 9, 6, 3)   # "layout"
    for batch in ({p: [block("actions", [5, 6]), ("specs", k(1), b"v")] for p in range(P - 1)}
                  | {P - 1: [block("actions", [7]), bad]},
                  {0: [("actions", k(9), b"v"), bad]}):
        with pytest.raises(InvalidBatch, match="meta key b'layout'.*record 2") as ei:
            s.commit(batch)
        assert ei.value.partition in (0, P - 1) and ei.value.key == b"layout"
        assert state(s) == before
    # other meta keys are fine in a block
    s.commit({0: [Records("meta", b"engine", b"xyz", 6, 3)]})
    assert s.get(0, "meta", b"engine") == b"xyz"
    assert s.get(0, "meta", b"layout") != b"xyz"
    s.close()


def mixed_batch(g):
    """Group ``g``: blocks (ascending, descending, with duplicates, empty) between triples
    that overwrite and delete some of the same keys, in several partitions."""
    return {
        0: [("actions", k(2), b"before"), block("actions", range(g * 10, g * 10 + 10), fill=g),
            ("actions", k(g * 10 + 3), None), ("actions", k(g * 10 + 4), b"after"),
            block("finalize", [9, 3, 3, 1], value_size=40, fill=g)],
        1: [block("actions", [5, 1, 5], value_size=0), Records("specs", b"", b"", 8, 3),
            ("specs", k(1), b"spec"), block("specs", [1], value_size=3, fill=g)],
        3: [("actions", k(g), None), block("actions", range(100 + g, 130, 3), fill=g),
            ("finalize", k(1), b"f")],
    }


@pytest.mark.parametrize("single", [False, True], ids=["multi-partition", "single-partition"])
def test_a_block_equals_the_same_records_given_as_triples(h, single):
    s = h.new()
    s.open("a", T0)
    model = {}
    for g in range(4):
        batch = mixed_batch(g)
        if single:
            batch = {3: batch[0] + batch[1] + batch[3]}
        s.commit(batch)
        model_apply(model, batch)
        assert state(s) == model
    # the same groups as triples, into a second store of the same kind
    h2 = Harness(h.kind, h.path.parent / "triples")
    t = h2.new()
    t.open("a", T0)
    for g in range(4):
        batch = mixed_batch(g)
        if single:
            batch = {3: batch[0] + batch[1] + batch[3]}
        t.commit(expand(batch))
    assert state(t) == state(s)
    t.close()
    s.close()
    s = h.new()
    s.open("a", T0 + S)                     # and after a reopen
    assert state(s) == model
    s.close()


def puts_batch(g):
    """A group of every partition mixing Puts blocks (variable sizes, a key repeated inside
    a block and by a triple after it) with triples and a delete."""
    batch = {}
    for p in range(P):
        head = b"r" + bytes([g, p])
        keys = [head + b"x" * i for i in range(1, 40)] + [head + b"x"]     # the last repeats
        values = [bytes([i % 251]) * (i * 7 % 300) for i in range(len(keys))]
        batch[p] = [("specs", b"before", b"v"), Puts("specs", keys, values),
                    ("specs", keys[3], b"triple after"), ("specs", keys[4], None),
                    Puts("specs", [], [])]
    return batch


@pytest.mark.parametrize("single", [False, True], ids=["multi-partition", "single-partition"])
def test_a_puts_block_equals_its_triples_in_list_order(h, single):
    s = h.new()
    s.open("a", T0)
    model = {}
    for g in range(3):
        batch = puts_batch(g)
        if single:
            batch = {1: batch[1]}
        s.commit(batch)
        model_apply(model, batch)
    assert state(s) == model
    assert s.get(1, "specs", b"r\x00\x01x") == bytes([39 % 251]) * (39 * 7 % 300)
    s.close()
    s = h.new()
    s.open("a", T0 + S)                     # and after a reopen
    assert state(s) == model
    s.close()


def test_a_bad_puts_block_is_refused_by_name_and_applies_nothing(h):
    for args, what in ((("meta", [b"k"], [b"v"]), "meta"),
                       (("nope", [b"k"], [b"v"]), "nope"),
                       (("specs", (b"k",), [b"v"]), "lists"),
                       (("specs", [b"k", b"j"], [b"v"]), "2 keys but 1 values")):
        with pytest.raises(InvalidBatch, match=what):
            Puts(*args)
    s = h.new()
    s.open("a", T0)
    for bad_key in (b"", b"x" * 512):
        with pytest.raises(InvalidBatch):
            s.commit({0: [("specs", b"a", b"1")],
                      2: [Puts("specs", [b"ok", bad_key, b"ok2"], [b"1", b"2", b"3"])]})
    assert state(s) == {}
    s.close()


def test_a_carried_puts_block_is_replayed_after_a_failure_past_the_commit_point(
        hl, monkeypatch):
    s = hl.new()
    s.open("a", T0)

    def hook(at):
        if at == "carrier-committed":
            raise OSError(5, "injected I/O error")

    monkeypatch.setattr(lmdb_store, "_crash_hook", hook)
    batch = puts_batch(1)
    with pytest.raises(StoreFailed) as ei:
        s.commit(batch)
    assert ei.value.outcome == "durable"
    monkeypatch.setattr(lmdb_store, "_crash_hook", None)
    s.close()
    model = {}
    model_apply(model, batch)
    s = hl.new()
    s.open("a", T0 + S)                     # the replay applies the blocks from the carrier
    assert state(s) == model
    s.close()


def test_a_block_larger_than_a_put_chunk_applies_in_list_order(h):
    # The LMDB store writes a block a chunk of records at a time (1,024): a block of 2,500
    # whose keys repeat across chunks (the later record wins) and overwrite existing keys
    # ends as its triples would.
    s = h.new()
    s.open("a", T0)
    first = block("actions", range(0, 3000, 2), fill=1)
    rows = list(range(2500))
    rows[2400] = rows[10]                   # chunk 3 repeats a key of chunk 1
    second = block("actions", rows, value_size=180, fill=2)
    model = {}
    for batch in ({0: [first]}, {0: [second]}):
        s.commit(batch)
        model_apply(model, batch)
    assert state(s) == model
    assert s.get(0, "actions", k(10)) == second.value(2400)
    s.close()


def test_a_block_copies_the_callers_buffers(h):
    s = h.new()
    s.open("a", T0)
    keys = np.arange(1, 4, dtype=">u8")
    values = np.full((3, 4), 7, np.uint8)
    s.commit({p: [Records("actions", keys, values, 8, 4)] for p in (0, 1)})
    keys[:] = 9
    values[:] = 0
    assert [v for _, _, v in s.scan("actions")] == [b"\x07" * 4] * 6
    assert [key for _, key, _ in s.scan("actions")] == [k(1), k(2), k(3)] * 2
    s.close()


def test_appended_and_searched_puts_give_the_same_store(hl, monkeypatch):
    # With _APPEND (off by default) a sorted block past the database's last key is appended
    # (MDB_APPEND) from the first record beyond it; the result is the same as with ordinary
    # puts only.
    splits = []
    real = lmdb_store.bisect_right

    def spy(*a, **kw):
        splits.append(real(*a, **kw))
        return splits[-1]

    monkeypatch.setattr(lmdb_store, "bisect_right", spy)
    groups = [{0: [block("actions", range(0, 50))]},            # empty db: all appended
              {0: [block("actions", range(40, 70))]},           # 10 overwrites, 20 appends
              {0: [block("actions", [10, 20, 30])]},            # nothing past the end
              {0: [block("actions", [75, 72, 80])]},            # unsorted: no append
              {0: [("actions", k(200), b"x"), block("actions", range(150, 210, 5))]},
              {0: [block("actions", [300, 300, 301])]}]         # duplicates: no append
    results = []
    for append in (True, False):
        monkeypatch.setattr(lmdb_store, "_APPEND", append)
        splits.clear()
        h = Harness("lmdb", hl.path.parent / f"append-{append}")
        s = h.new()
        s.open("a", T0)
        model = {}
        for batch in groups:
            s.commit(batch)
            model_apply(model, batch)
        assert state(s) == model
        results.append(state(s))
        s.close()
        assert splits == ([10, 11] if append else [])   # the first group: empty db, no search
    assert results[0] == results[1]


def test_an_append_lmdb_refuses_is_put_again(hl, monkeypatch):
    # Should the order check ever pass a block it should not, LMDB refuses the out-of-order
    # appends (MDB_KEYEXIST, nothing written) and the store puts the block again, ordinarily.
    monkeypatch.setattr(lmdb_store, "_APPEND", True)
    monkeypatch.setattr(Records, "ascending", lambda self: True)
    s = hl.new()
    s.open("a", T0)
    model = {}
    for batch in ({0: [block("actions", [1, 2, 3])]},
                  {0: [block("actions", [9, 5, 7, 9, 4], fill=1)]}):
        s.commit(batch)
        model_apply(model, batch)
    assert state(s) == model
    s.close()


def carried_records(path, partition):
    """The redo records partition ``partition`` of the store at ``path`` carries, read by
    another process (LMDB opens an environment once per process: this one may hold the
    store open)."""
    code = (f"import json, lmdb; e = lmdb.open({str(path / f'p{partition:02d}')!r}, "
            f"max_dbs=32, readonly=True); t = e.begin(); print(json.dumps("
            f"[bytes(v).hex() for _, v in t.cursor(e.open_db(b'carried', txn=t))]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return [bytes.fromhex(v) for v in json.loads(r.stdout)]


@pytest.mark.parametrize("stage", ["carrier-committed", "partition-committed"])
def test_a_carried_block_is_replayed_after_a_failure_past_the_commit_point(
        hl, monkeypatch, stage):
    s = hl.new()
    s.open("a", T0)
    model = {}
    first = mixed_batch(0)
    s.commit(first)
    model_apply(model, first)

    def hook(at):
        if at == stage:
            raise OSError(5, "injected I/O error")

    monkeypatch.setattr(lmdb_store, "_crash_hook", hook)
    big = {p: [block("actions", range(1000, 1300), fill=p), ("actions", k(1100), None)]
           for p in range(P)}
    with pytest.raises(StoreFailed) as ei:
        s.commit(big)
    assert ei.value.outcome == "durable"
    monkeypatch.setattr(lmdb_store, "_crash_hook", None)
    s.close()
    # Partition 0 (the first of equal parts) carries the others' blocks as they came: 300 *
    # (8 + 180) bytes each, not 300 triples; its own part is not in the record.
    records = carried_records(hl.path, 0)
    entry = msgpack.unpackb(records[-1])
    assert sorted(dict(entry)) == list(range(1, P))
    ops = dict(entry)[P - 1]
    assert isinstance(ops[0], msgpack.ExtType) and ops[0].code == lmdb_store._EXT_RECORDS
    assert len(ops[0].data) == lmdb_store._RECORDS_HEADER.size + 300 * (8 + 180)
    assert len(records[-1]) < (P - 1) * (300 * 188 + 100)
    model_apply(model, big)
    s = hl.new()
    s.open("a", T0 + S)
    assert state(s) == model
    s.commit({0: [block("actions", [1, 2])]})
    s.close()
    assert carried_records(hl.path, 0) == []    # applied everywhere at open, then deleted


def test_a_replay_never_undoes_a_single_partition_group(hl, monkeypatch):
    # A single partition's group records no group number there (only multi-partition groups are
    # replayed): a replay of an older multi-partition group must still leave its writes alone.
    s = hl.new()
    s.open("a", T0)
    s.commit({0: [("actions", k(7), b"a0")], 1: [("actions", k(7), b"a1")]})   # two partitions
    s.commit({0: [("actions", k(7), b"b0"), ("actions", k(8), b"new")]})         # single
    s.commit({1: [("actions", k(7), b"b1")]})                                    # single

    def hook(at):
        if at == "carrier-committed":
            raise OSError(5, "injected I/O error")

    monkeypatch.setattr(lmdb_store, "_crash_hook", hook)
    with pytest.raises(StoreFailed) as ei:
        s.commit({1: [("actions", k(9), b"c1")], 2: [("actions", k(9), b"c2")]})
    assert ei.value.outcome == "durable"
    monkeypatch.setattr(lmdb_store, "_crash_hook", None)
    s.close()                               # failed: no checkpoint, the records stay
    s = hl.new()
    s.open("a", T0 + S)                     # replays both multi-partition groups where missing
    assert state(s) == {(0, "actions", k(7)): b"b0", (0, "actions", k(8)): b"new",
                        (1, "actions", k(7)): b"b1", (1, "actions", k(9)): b"c1",
                        (2, "actions", k(9)): b"c2"}
    s.commit({0: [("actions", k(1), b"x")], 3: [("actions", k(1), b"y")]})    # and goes on
    s.close()
    s = hl.new()
    s.open("a", T0 + 2 * S)
    assert s.get(0, "actions", k(1)) == b"x" and s.get(0, "actions", k(7)) == b"b0"
    s.close()


def test_blocks_on_a_small_map_that_must_grow(hl, monkeypatch):
    # Issue 15's paths with blocks: StoreFull before the commit point (nothing applied, the
    # caller grows the map and retries), and a group of two partitions whose second commit
    # (partition 1, 100 KB fuller than the carrier) needs a page more after the commit point
    # (the store completes it itself).
    completed = []
    real = LmdbStore._complete
    monkeypatch.setattr(LmdbStore, "_complete",
                        lambda self, *a: (completed.append(a[0]), real(self, *a))[1])
    s = hl.new(map_size=256 << 10, sync=False)
    s.open("a", T0)
    model = {}
    fill = {1: [("specs", k(i), b"z" * 1000) for i in range(100)]}
    s.commit(fill)
    model_apply(model, fill)
    acked = 0
    with pytest.raises(StoreFull):
        for g in range(5000):
            batch = {0: [block("actions", [g * 3, g * 3 + 1, g * 3 + 2], value_size=150)],
                     1: [block("actions", [g * 3, g * 3 + 1], value_size=150, fill=1)]}
            s.commit(batch)
            model_apply(model, batch)
            acked += 1
    assert acked > 100 and completed == [1] * len(completed) and completed, \
        "the commit after the commit point never met a full map"
    assert state(s) == model
    s.close()
    s = hl.new(map_size=256 << 10)
    s.open("a", T0 + S)
    assert state(s) == model
    # the engine's policy: double the map and retry the same group
    resized = 0
    for g in range(acked, acked + 600):
        batch = {p: [block("actions", range(g * 4, g * 4 + 4), value_size=150, fill=p)]
                 for p in (0, 1, 2)}
        while True:
            try:
                s.commit(batch)
                break
            except StoreFull:
                s.resize(s.map_size * 2)
                resized += 1
        model_apply(model, batch)
    assert resized
    assert state(s) == model
    s.close()
    s = hl.new(map_size=256 << 10)
    s.open("a", T0 + 2 * S)
    assert state(s) == model
    s.close()


def test_reopen_grows_a_partition_to_replay_a_block(hl, monkeypatch):
    big = {p: [block("actions", range(3000), value_size=200, fill=p)] for p in (0, 1)}
    _err, s = _durable_on_a_grown_map_then_reopen(hl, monkeypatch, big)
    model = {}
    model_apply(model, big)
    assert s.map_size > 600 << 10
    assert state(s) == model
    s.close()


OPS = st.lists(st.one_of(
    st.tuples(st.just("t"), st.integers(0, 12), st.one_of(st.none(), st.binary(max_size=6)),
              st.sampled_from(("actions", "specs"))),
    st.tuples(st.just("b"), st.lists(st.integers(0, 12), max_size=8), st.integers(0, 5),
              st.integers(0, 255), st.booleans()),
), max_size=8)


def _batch_of(drawn):
    batch = {}
    for p, ops in drawn.items():
        out = batch.setdefault(p, [])
        for op in ops:
            if op[0] == "t":
                out.append((op[3], k(op[1]), op[2]))
            else:
                rows = sorted(set(op[1])) if op[4] else op[1]      # strictly ascending, or not
                out.append(block("actions", rows, value_size=op[2], fill=op[3]))
    return batch


@settings(max_examples=60, deadline=None)
@given(st.lists(st.dictionaries(st.integers(0, 2), OPS, max_size=3), min_size=1, max_size=4),
       st.booleans())
def test_property_blocks_and_triples_in_list_order(groups, append):
    # Any mix of blocks (sorted or not, duplicate keys, any size) and triples (puts and
    # deletes, in two databases: LmdbStore writes a run of puts to one database in one
    # putmulti) in any partitions: both stores end in the state of the ops applied one by
    # one, with LmdbStore's optional MDB_APPEND path on or off.
    saved, lmdb_store._APPEND = lmdb_store._APPEND, append
    try:
        _check_property(groups)
    finally:
        lmdb_store._APPEND = saved


def _check_property(groups):
    with tempfile.TemporaryDirectory() as tmp:
        stores = [LmdbStore(Path(tmp) / "s", partitions=3, map_size=1 << 20, sync=False),
                  MemoryStore(3)]
        model = {}
        for s in stores:
            s.open("a", T0)
        for drawn in groups:
            batch = _batch_of(drawn)
            for s in stores:
                s.commit(batch)
            model_apply(model, batch)
            for s in stores:
                assert state(s, ("actions", "specs")) == model
        for s in stores:
            s.close()
        s = LmdbStore(Path(tmp) / "s", partitions=3, map_size=1 << 20)
        s.open("a", T0 + S)
        assert state(s, ("actions", "specs")) == model
        s.close()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.dictionaries(st.integers(0, 3), OPS, min_size=1, max_size=4), min_size=1,
                max_size=5),
       st.sampled_from(("carrier-committed", "partition-committed")), st.integers(1, 4))
def test_property_a_group_failing_past_its_commit_point_is_whole_after_the_reopen(
        groups, stage, nth):
    # Groups of any partitions (the largest part carries the others' redo record); a failure
    # injected at the nth point of a stage stops the store. After the reopen every group
    # before it is there, and the failed one entirely when it had passed its commit point
    # ("durable"); else ("unknown") entirely or not at all.
    seen = [0]

    def hook(at):
        if at == stage:
            seen[0] += 1
            if seen[0] == nth:
                raise OSError(5, "injected I/O error")

    with tempfile.TemporaryDirectory() as tmp:
        s = LmdbStore(Path(tmp) / "s", partitions=4, map_size=1 << 20, sync=False)
        s.open("a", T0)
        model = {}
        failed = None
        saved, lmdb_store._crash_hook = lmdb_store._crash_hook, hook
        try:
            for drawn in groups:
                batch = _batch_of({p: ops for p, ops in drawn.items() if ops})
                if not batch:
                    continue
                try:
                    s.commit(batch)
                except StoreFailed as e:
                    failed = (batch, e.outcome)
                    break
                model_apply(model, batch)
        finally:
            lmdb_store._crash_hook = saved
        s.close()
        s = LmdbStore(Path(tmp) / "s", partitions=4, map_size=1 << 20)
        s.open("a", T0 + S)
        got = state(s, ("actions", "specs"))
        s.close()
    if failed is None:
        assert got == model
        return
    batch, outcome = failed
    with_it = dict(model)
    model_apply(with_it, batch)
    if outcome == "durable":
        assert len(batch) > 1 and got == with_it
    else:
        assert got in (model, with_it)


# --------------------------------------------------------------------------------------------
# ownership


def test_second_shard_refused_while_claim_is_live(h):
    s = h.new()
    s.open("alpha", T0)
    ok, msg = h.other("beta", T0 + 2 * S)
    assert not ok
    assert "shard 'alpha'" in msg and f"pid {os.getpid()}" in msg and "host" in msg
    assert "expires" in msg and "refusing to open it as shard 'beta'" in msg
    # the refused open claimed nothing: alpha still owns everything
    s.commit({p: [("actions", k(p), b"v")] for p in range(P)})
    assert Claim.decode(s.get(P - 1, "meta", b"claim")).shard == "alpha"
    s.close()


def test_ownership_error_names_the_holder():
    s = MemoryStore(P, claim_ttl_s=TTL_S)
    s.open("alpha", T0)
    other = MemoryStore(P, backing=s.backing, claim_ttl_s=TTL_S)
    with pytest.raises(OwnershipError) as ei:
        other.open("beta", T0 + 2 * S)
    e = ei.value
    assert e.partition == 0 and e.during == "open" and e.shard == "beta"
    assert (e.holder.shard, e.holder.pid, e.holder.expiry_ns) == (
        "alpha", os.getpid(), T0 + int(TTL_S * S))
    assert "in 8.000 s" in str(e)


def test_takeover_after_expiry_and_renew_detects_it(h):
    s = h.new()
    s.open("alpha", T0)
    s.commit({0: [("actions", k(1), b"v")]})
    ok, msg = h.other("beta", T0 + int(TTL_S * S) + 1, then="vanish")
    assert ok, msg
    with pytest.raises(OwnershipError) as ei:
        s.renew(T0 + int(TTL_S * S) + 2)
    assert "shard 'beta'" in str(ei.value) and "must stop" in str(ei.value)
    assert ei.value.during == "renew"
    with pytest.raises(OwnershipError):              # every further write is refused
        s.commit({1: [("actions", k(2), b"v")]})
    s.close()
    s = h.new()
    s.open("beta", T0 + int(TTL_S * S) + 3)         # same shard name: a restart
    assert s.get(1, "actions", k(2)) is None
    assert s.get(0, "actions", k(1)) == b"v"
    s.close()


def test_commit_is_fenced_after_a_takeover(h):
    s = h.new()
    s.open("alpha", T0)
    ok, _ = h.other("beta", T0 + int(TTL_S * S) + 1, then="vanish")
    assert ok
    with pytest.raises(OwnershipError) as ei:
        s.commit({2: [("actions", k(1), b"v")], 3: [("actions", k(1), b"v")]})
    assert ei.value.during == "commit" and ei.value.holder.shard == "beta"
    s.close()


def test_same_shard_restart_takes_over_and_fences_the_old_incarnation(h):
    s = h.new()
    s.open("alpha", T0)
    ok, msg = h.other("alpha", T0 + S, then="vanish")   # live claim, same shard: a restart
    assert ok, msg
    with pytest.raises(OwnershipError):
        s.commit({0: [("actions", k(1), b"v")]})
    s.close()


def test_renew_extends_the_claim(h):
    s = h.new()
    s.open("alpha", T0)
    assert s.renew(T0 + 8 * S) == T0 + 8 * S + int(TTL_S * S)
    assert not h.other("beta", T0 + 15 * S)[0]
    # renewing an expired claim nobody took is fine
    assert s.renew(T0 + 30 * S) == T0 + 30 * S + int(TTL_S * S)
    assert not h.other("beta", T0 + 39 * S)[0]
    assert h.other("beta", T0 + 41 * S)[0]
    s.close()


def test_close_releases_the_claims(h):
    s = h.new()
    s.open("alpha", T0)
    s.close()
    ok, msg = h.other("beta", T0 + S)
    assert ok, msg


# --------------------------------------------------------------------------------------------
# corrupt and foreign records


@pytest.mark.parametrize("key,value,expect", [
    (b"schema", msgpack.packb(99), "schema 99"),
    (b"schema", b"\xc1", "undecodable"),
    (b"claim", b"\x93\x01\x02", "claim"),
])
def test_foreign_or_corrupt_meta_raises_corrupt_record(h, key, value, expect):
    s = h.new()
    s.open("a", T0)
    s.close()
    h.tamper(2, "meta", key, value)
    s = h.new()
    with pytest.raises(CorruptRecord) as ei:
        s.open("a", T0 + S)
    e = ei.value
    assert (e.partition, e.db, e.key) == (2, "meta", key)
    assert "partition 2" in str(e) and repr(key) in str(e) and expect in str(e)


def test_a_store_of_the_journal_schema_is_refused_by_name(hl):
    # Schema 5 made a group of several partitions atomic with a journal environment this
    # code never reads: a group it held unapplied would be lost, so that store is refused.
    s = hl.new()
    s.open("a", T0)
    s.close()
    for p in range(P):
        hl.tamper(p, "meta", b"schema", msgpack.packb(5))
    with pytest.raises(CorruptRecord, match="partition 0.*schema 5: a store written by older "
                                            "code.*never converts a store in place"):
        hl.new().open("a", T0 + S)


def test_a_redo_record_naming_its_own_carrier_is_a_corrupt_record(hl):
    s = hl.new()
    s.open("a", T0)
    s.close()
    hl.tamper(1, "carried", k(1), msgpack.packb([[1, [["actions", k(5), b"x"]]]]))
    with pytest.raises(CorruptRecord, match="partition 1, db 'carried'.*names partition 1"):
        hl.new().open("a", T0 + S)


def test_partition_count_mismatch_is_refused(hl):
    s = hl.new(partitions=4)
    s.open("a", T0)
    s.close()
    with pytest.raises(CorruptRecord, match="layout"):
        hl.new(partitions=8).open("a", T0)
    with pytest.raises(CorruptRecord, match="partitions=2"):
        hl.new(partitions=2).open("a", T0)


def test_foreign_lmdb_environment_is_refused(hl):
    d = hl.path / "p01"
    d.mkdir(parents=True)
    env = lmdb.open(str(d))
    with env.begin(write=True) as txn:
        txn.put(b"hello", b"world")
    env.close()
    with pytest.raises(CorruptRecord, match="partition 1.*not a leasehold store"):
        hl.new().open("a", T0)


def test_an_environment_that_cannot_be_opened_is_not_called_corrupt(hl):
    # A partition path that is not a directory (permissions and read-only file systems alike):
    # nothing says the data is bad, so not CorruptRecord (an operator might delete the store).
    hl.path.mkdir(parents=True, exist_ok=True)
    (hl.path / "p00").write_text("not a directory")
    with pytest.raises(StoreError, match="p00: cannot open the LMDB environment") as err:
        hl.new().open("a", T0)
    assert not isinstance(err.value, CorruptRecord)


# --------------------------------------------------------------------------------------------
# partition hash


def test_partition_of_is_pinned():
    # These values are part of the on-disk format: never change them.
    assert [partition_of(t, 16) for t in ("", "acme", "tenant-0", "tenant-1", "Zürich", "租户")] \
        == [4, 1, 2, 3, 8, 10]
    assert [partition_of(t, 7) for t in ("acme", "tenant-0", "Zürich")] == [4, 3, 5]
    assert partition_of("acme", 1 << 20) == 893569
    assert partition_of("anything", 1) == 0


def test_partition_of_spreads_tenants():
    n, parts = 16_000, 16
    counts = Counter(partition_of(f"tenant-{i}", parts) for i in range(n))
    assert set(counts) == set(range(parts))
    mean = n / parts
    assert all(abs(c - mean) < 0.15 * mean for c in counts.values()), counts
    chi2 = sum((c - mean) ** 2 / mean for c in counts.values())
    assert chi2 < 40                                  # 15 dof: p ~ 0.0005


def test_partition_of_rejects_bad_input():
    with pytest.raises(TypeError):
        partition_of(b"acme", 16)
    with pytest.raises(ValueError):
        partition_of("acme", 0)
    with pytest.raises(ValueError):
        partition_of("\ud800", 16)


# --------------------------------------------------------------------------------------------
# parallel reload scan

REC = np.dtype([("row", "<u8"), ("gen", "<u4"), ("state", "u1"), ("pad", "V19")])


def _fill(store, n, partitions):
    rec = np.zeros(n, REC)
    rec["row"] = np.arange(n)
    rec["gen"] = np.arange(n) * 3
    for start in range(0, n, 5000):
        batch = {}
        for row in range(start, min(n, start + 5000)):
            batch.setdefault(row % partitions, []).append(
                ("actions", k(row), rec[row:row + 1].tobytes()))
        store.commit(batch)
    return rec


@pytest.mark.parametrize("processes", [1, 3])
def test_scan_parallel_matches_the_records(hl, processes):
    parts = 8
    s = hl.new(partitions=parts)
    s.open("a", T0)
    rec = _fill(s, 20_000, parts)
    got = scan_parallel(s, "actions", record_size=REC.itemsize, dtype=REC, processes=processes)
    order = np.lexsort((np.arange(len(rec)), np.arange(len(rec)) % parts))
    assert len(got) == len(rec)
    assert np.array_equal(got.keys, order.astype(np.uint64))
    assert got.values.tobytes() == rec[order].tobytes()
    assert np.array_equal(got.partition, order % parts)
    assert got.counts.tolist() == [len(rec) // parts] * parts
    raw = scan_parallel(s, "actions", record_size=REC.itemsize, processes=processes)
    assert raw.values.shape == (len(rec), REC.itemsize)
    values_only = scan_parallel(s, "actions", record_size=REC.itemsize, dtype=REC,
                                processes=processes, keys=False)
    assert values_only.keys is None
    assert values_only.values.tobytes() == rec[order].tobytes()
    assert np.array_equal(values_only.partition, order % parts)
    assert len(scan_parallel(s, "specs", record_size=4, processes=processes)) == 0
    s.close()
    by_path = scan_parallel(hl.path, "actions", record_size=REC.itemsize, dtype=REC,
                            processes=processes)
    assert by_path.values.tobytes() == rec[order].tobytes()


@pytest.mark.parametrize("processes", [1, 2])
def test_scan_parallel_names_a_bad_record(hl, processes):
    s = hl.new()
    s.open("a", T0)
    _fill(s, 400, P)
    s.commit({3: [("actions", k(1001), b"short")]})
    with pytest.raises(CorruptRecord) as ei:
        scan_parallel(s, "actions", record_size=REC.itemsize, processes=processes)
    assert (ei.value.partition, ei.value.db, ei.value.key) == (3, "actions", k(1001))
    assert "5 bytes, expected 32" in str(ei.value)
    s.close()


def test_scan_parallel_checks_the_schema(hl):
    s = hl.new()
    s.open("a", T0)
    _fill(s, 100, P)
    s.close()
    hl.tamper(1, "meta", b"schema", msgpack.packb(SCHEMA_VERSION + 1))
    with pytest.raises(CorruptRecord, match="partition 1.*b'schema'"):
        scan_parallel(hl.path, "actions", record_size=REC.itemsize, processes=2)


def test_redo_records_are_checkpointed(hl):
    s = hl.new(journal_checkpoint_bytes=1)
    s.open("a", T0)
    for i in range(5):
        s.commit({p: [("actions", k(i), b"v%d" % i)] for p in range(P)})
    s.commit({1: [("actions", k(9), b"single")]})       # single partition: no record
    assert len(carried_records(hl.path, 0)) == 1     # only the last multi-partition group
    s.close()
    assert carried_records(hl.path, 0) == []
    s = hl.new()
    s.open("a", T0 + S)
    assert len(list(s.scan("actions"))) == 5 * P + 1
    for i in range(3):
        s.commit({p: [("actions", k(i), b"w")] for p in range(P)})
    assert len(carried_records(hl.path, 0)) == 3
    # The largest part carries: partition 2 here.
    s.commit({p: [("actions", k(7), b"w" * (9 if p == 2 else 1))] for p in range(P)})
    assert (len(carried_records(hl.path, 0)), len(carried_records(hl.path, 2))) == (3, 1)
    s.close()
    assert carried_records(hl.path, 0) == carried_records(hl.path, 2) == []


def test_partition_and_read_argument_checks(h):
    s = h.new()
    s.open("a", T0)
    s.commit({np.int64(1): [("actions", k(1), b"v")]})   # numpy integers are partitions too
    assert s.get(np.uint8(1), "actions", k(1)) == b"v"
    with pytest.raises(InvalidBatch):
        s.commit({True: [("actions", k(1), b"v")]})
    with pytest.raises(ValueError, match="unknown database"):
        s.get(0, "nope", k(1))
    with pytest.raises(ValueError, match="unknown database"):
        s.scan("nope")
    with pytest.raises(ValueError, match="out of range"):
        s.get(P, "actions", k(1))
    with pytest.raises(ValueError):
        s.get(0, "actions", b"")
    s.close()


def test_a_map_that_does_not_fit_the_address_space_is_not_called_corrupt(tmp_path):
    # Under `ulimit -v` LMDB's mmap fails with ENOMEM: it was reported as a corrupt record,
    # inviting an operator to delete a healthy store.
    script = textwrap.dedent(f"""
        import resource, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
        from storage import CorruptRecord, LmdbStore, StoreError
        vm = int([x for x in open("/proc/self/status") if x.startswith("VmSize")][0]
                 .split()[1]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), resource.RLIM_INFINITY))
        try:
            LmdbStore({str(tmp_path / "data")!r}, partitions=2, map_size=4 << 30).open("s", 0)
        except CorruptRecord as e:
            print("corrupt:", e)
        except StoreError as e:
            print("store:", e)
        """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("store: "), out.stdout
    assert "cannot map the partition (4294967296 bytes) into memory" in out.stdout
    assert "The store itself is intact" in out.stdout


def test_a_store_path_that_is_a_file_is_named_as_such(tmp_path):
    # It said "[Errno 17] File exists: '...'".
    (tmp_path / "afile").write_text("x")
    with pytest.raises(StoreError, match=r"afile: exists and is not a directory$"):
        LmdbStore(str(tmp_path / "afile"), partitions=2).open("s", 0)
    with pytest.raises(StoreError, match=r"cannot make the directory: Not a directory$"):
        LmdbStore(str(tmp_path / "afile" / "sub"), partitions=2).open("s", 0)


def _store_with_work(path):
    """An LMDB store of two partitions holding some records, closed."""
    s = LmdbStore(str(path), partitions=2)
    s.open("shard-a", 1)
    s.commit({p: [("actions", (7).to_bytes(8, "big"), b"v" * 3000)] for p in (0, 1)})
    s.close()
    return [path / f"p{p:02d}" / "data.mdb" for p in (0, 1)]


def test_a_partition_data_file_deleted_is_refused_not_started_empty(tmp_path):
    # It was made again, empty, and the shard served on without the partition's work.
    files = _store_with_work(tmp_path / "s")
    files[1].unlink()
    with pytest.raises(StoreError, match=r"p01/data.mdb missing while the other partitions "
                                         r"hold data"):
        LmdbStore(str(tmp_path / "s"), partitions=2).open("shard-a", 2)
    assert not files[1].exists()                    # not made again
    # A store of which no partition was ever made a store still opens (a first start).
    LmdbStore(str(tmp_path / "fresh"), partitions=2).open("shard-a", 3)


def test_a_truncated_data_file_is_refused_naming_it_instead_of_a_bus_error(tmp_path):
    # LMDB maps the file: reading a page past its end killed the process with SIGBUS.
    files = _store_with_work(tmp_path / "s")
    os.truncate(files[1], files[1].stat().st_size // 2)
    with pytest.raises(CorruptRecord, match=rf"{files[1]} is \d+ bytes, shorter than the "
                                            r"\d+ its meta pages say it holds"):
        LmdbStore(str(tmp_path / "s"), partitions=2).open("shard-a", 2)


def test_a_damaged_page_met_by_the_reload_scan_names_the_file(tmp_path):
    # lmdb.CorruptedError escaped the scan: "INTERNAL ... (a bug)", exit 1, no file named.
    s = LmdbStore(str(tmp_path / "s"), partitions=1)
    s.open("shard-a", 1)
    s.commit({0: [("actions", i.to_bytes(8, "big"), b"v" * 240) for i in range(4000)]})
    s.close()
    f = tmp_path / "s" / "p00" / "data.mdb"
    env = lmdb.open(str(f.parent), readonly=True, lock=False, max_dbs=len(DBS) + 1)
    last, psize = env.info()["last_pgno"], env.stat()["psize"]
    env.close()
    with open(f, "r+b") as fh:          # garbage amid the records' leaves (seeded)
        fh.seek((last // 2 - 3) * psize)
        fh.write(random.Random(7).randbytes(6 * psize))
    with pytest.raises(CorruptRecord, match=rf"partition 0, db 'actions', environment: "
                                            rf"{f}: .*MDB_CORRUPTED"):
        scan_parallel(str(tmp_path / "s"), "actions", record_size=240, processes=1)


def test_a_commit_into_a_deleted_data_file_is_refused_not_acknowledged(tmp_path):
    # The commit wrote into the unlinked file: found by that commit (a stat of each file it
    # wrote), not ~10 s later at the renewal, so the enqueue is refused, never acknowledged.
    from engine import Engine, ManualClock, parse_config

    cfg = parse_config({"resources": ["cpu"], "clusters": {"east": {}},
                        "queues": {"q": {}}, "engine": {"default_queue": "q"},
                        "storage": {"path": str(tmp_path / "s"), "partitions": 2}})
    store = LmdbStore(str(tmp_path / "s"), partitions=2)
    eng = Engine(cfg, clock=ManualClock(0.0), store=store)
    try:
        eng.enqueue({"id": "acme/p/d/r/a", "task": "t", "resources": {"cpu": 1}})
        p = partition_of("acme", 2)
        (tmp_path / "s" / f"p{p:02d}" / "data.mdb").unlink()
        with pytest.raises(StoreLost, match=rf"p{p:02d}/data.mdb is gone since this shard "
                                            r"opened it"):
            eng.enqueue({"id": "acme/p/d/r/b", "task": "t", "resources": {"cpu": 1}})
        assert eng.stopped.startswith("store lost: ")
        # The store refuses every later write, the other partition's too.
        with pytest.raises(StoreLost):
            store.commit({1 - p: [("meta", b"k", b"v")]})
    finally:
        eng.close()


def test_a_data_file_deleted_under_an_open_store_stops_it_at_the_next_renewal(tmp_path):
    # It wrote on into the unlinked file, acknowledging work no restart would read.
    from engine import Engine, ManualClock, parse_config

    cfg = parse_config({"resources": ["cpu"], "clusters": {"east": {}},
                        "queues": {"q": {}}, "engine": {"default_queue": "q"},
                        "storage": {"path": str(tmp_path / "s"), "partitions": 2}})
    eng = Engine(cfg, clock=ManualClock(0.0), store=LmdbStore(str(tmp_path / "s"),
                                                               partitions=2))
    try:
        eng.enqueue({"id": "acme/p/d/r/a", "task": "t", "resources": {"cpu": 1}})
        eng.renew()                                     # the files are the ones opened
        (tmp_path / "s" / "p01" / "data.mdb").unlink()
        with pytest.raises(StoreLost, match=r"p01/data.mdb is gone since this shard "
                                            r"opened it"):
            eng.renew()
        assert eng.stopped.startswith("store lost: ")
        with pytest.raises(StoreError):                 # nothing more is acknowledged
            eng.enqueue({"id": "acme/p/d/r/b", "task": "t", "resources": {"cpu": 1}})
    finally:
        eng.close()
