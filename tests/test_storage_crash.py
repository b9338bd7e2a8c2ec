"""Crash test of LmdbStore group commits: a child process commits numbered groups (most of them
spanning several partitions, some with deletes) and prints each group number after ``commit``
returns; the parent SIGKILLs it, reopens the store and checks that its whole content equals the
state after the last acknowledged group, or after one more (the group in flight when the kill
landed): every acknowledged group fully present, no group partially present.

Kills land at random times, and (through ``storage._lmdb._crash_hook``) exactly inside the
commit: after the commit point (the carrier partition's commit, which holds the redo record of
the others) before any other partition commit, and between partition commits.

The store runs on a small map (``MAP``, as configured: every open uses it) that the child
grows by doubling on ``StoreFull``, as the engine does, so maps fill and grow between kills:
a partition commit after the commit point meets a full map, and reopens replay the carried
records into maps that LMDB opened no larger than their data.

Run by pytest; the same file is the child (``python tests/test_storage_crash.py child ...``).
"""

import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from storage import LmdbStore, OwnershipError, Records, StoreFull  # noqa: E402

P = 8
SHARD = "crash"
SEED = 20260509
MAP = 32 << 10                  # per partition (the smallest allowed): the data grows past it


def k(i: int) -> bytes:
    return i.to_bytes(8, "big")


def touched(g: int) -> list[int]:
    """The partitions group ``g`` writes its own records to."""
    rng = random.Random(g * 7919 + SEED)
    r = rng.random()
    if r < 0.25:
        return [rng.randrange(P)]
    if r < 0.85:
        return sorted(rng.sample(range(P), rng.randint(2, 4)))
    return list(range(P))


def group_ops(g: int) -> dict:
    """Group ``g``: a record of 8..3000 bytes in each touched partition, the partition's
    ``last`` pointer, sometimes a block of fixed-size records (``storage.Records``: new keys
    in order, appended, or keys of earlier groups out of order), and sometimes the deletion
    of group ``g - 5``'s records."""
    rng = random.Random(g * 104729 + SEED)
    batch = {p: [("actions", k(g), bytes([g % 251]) * rng.randint(8, 3000)),
                 ("queues", b"last", k(g))] for p in touched(g)}
    for p in batch:
        if rng.random() < 0.5:
            rows = range(g * 8, g * 8 + rng.randint(1, 8))
            if rng.random() < 0.3:
                rows = rng.sample(range(max(g * 8 - 40, 0), g * 8 + 8), 6)
            batch[p].append(Records("finalize", b"".join(map(k, rows)),
                                    bytes([g % 251, p]) * (60 * len(rows)), 8, 120))
    if g > 5 and rng.random() < 0.4:
        for p in touched(g - 5):
            batch.setdefault(p, []).append(("actions", k(g - 5), None))
    return batch


def apply(model: dict, g: int) -> None:
    for p, ops in group_ops(g).items():
        for op in ops:
            triples = ([(op.db, key, value) for key, value in op] if isinstance(op, Records)
                       else [op])
            for db, key, value in triples:
                if value is None:
                    model.pop((p, db, key), None)
                else:
                    model[(p, db, key)] = value


def disk_state(path) -> dict:
    store = LmdbStore(path, partitions=P, map_size=MAP)
    store.open(SHARD, time.time_ns())
    try:
        return {(p, db, key): value for db in ("actions", "queues", "finalize")
                for p, key, value in store.scan(db)}
    finally:
        store.close()


def child(path: str, start: int) -> None:
    stage, nth = os.environ.get("LH_CRASH_STAGE"), int(os.environ.get("LH_CRASH_N", "0"))
    if stage:
        import storage._lmdb as lm

        seen = [0]

        def hook(at):
            if at == stage:
                seen[0] += 1
                if seen[0] == nth:
                    os.kill(os.getpid(), signal.SIGKILL)

        lm._crash_hook = hook
    store = LmdbStore(path, partitions=P, map_size=MAP)
    store.open(SHARD, time.time_ns())
    g = start
    while True:
        try:
            store.commit(group_ops(g))
        except StoreFull:
            store.resize(store.map_size * 2)    # nothing was applied: grow and retry
            continue
        sys.stdout.write(f"{g}\n")
        sys.stdout.flush()
        g += 1


def run_child(path, start, kill_after_s=None, stage=None, nth=0):
    env = dict(os.environ)
    if stage:
        env.update(LH_CRASH_STAGE=stage, LH_CRASH_N=str(nth))
    proc = subprocess.Popen([sys.executable, __file__, "child", str(path), str(start)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = b""
    try:
        if kill_after_s:
            # Killed a while after its first acknowledgement, not a fixed time after its
            # spawn: a loaded machine may spend that long starting Python and opening the
            # store, and a child killed before it commits tests nothing.
            ready, _, _ = select.select([proc.stdout], [], [], 30)
            assert ready, "the child acknowledged nothing within 30 s"
            # A raw read (communicate reads the descriptor, not a buffered reader's copy).
            first = os.read(proc.stdout.fileno(), 1 << 16)
            time.sleep(kill_after_s)
            proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    out = first + out
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, err.decode()[-2000:])
    acked = [int(line) for line in out.decode().split("\n")[:-1]]  # complete lines only
    assert acked == list(range(start, start + len(acked)))
    return acked[-1] if acked else start - 1


def test_sigkill_never_leaves_a_partial_group(tmp_path):
    path = tmp_path / "store"
    rng = random.Random(SEED)
    model: dict = {}
    done = 0                      # groups applied to `model`
    plan = [("random", None, 0)] * 7 + [
        ("hook", "carrier-committed", 3), ("hook", "partition-committed", 4),
        ("hook", "carrier-committed", 1), ("hook", "partition-committed", 9),
    ]
    rng.shuffle(plan)
    deadline = time.monotonic() + 60
    checked_refusal = False
    in_flight_present = 0         # kills after which the unacknowledged group was complete
    for mode, stage, nth in plan:
        assert time.monotonic() < deadline, "crash test ran too long"
        if mode == "random":
            last_acked = run_child(path, done + 1, kill_after_s=rng.uniform(0.25, 0.7))
        else:
            last_acked = run_child(path, done + 1, stage=stage, nth=nth)
        if not checked_refusal and last_acked > done:
            # the killed shard's claim is still live: another shard must be refused
            other = LmdbStore(path, partitions=P, map_size=MAP)
            try:
                other.open("intruder", time.time_ns())
                raise AssertionError("a second shard opened a live store")
            except OwnershipError as e:
                assert f"shard {SHARD!r}" in str(e)
            checked_refusal = True
        while done < last_acked:
            done += 1
            apply(model, done)
        state = disk_state(path)
        if state == model:
            assert not (mode == "hook" and stage == "carrier-committed"), (
                "the carrier held the group in flight, the reopen must have completed it")
            continue
        apply(model, done + 1)
        done += 1
        in_flight_present += 1
        assert state == model, (
            f"{mode} kill: disk matches neither group {done - 1} nor {done} "
            f"(last acknowledged {last_acked})")
    assert done > 20, "the children hardly committed anything"
    grown = [(path / f"p{p:02d}" / "data.mdb").stat().st_size for p in range(P)]
    assert max(grown) > MAP, f"the maps never grew: {grown}"
    print(f"{len(plan)} kills, {done} groups, {in_flight_present} with the group in flight "
          f"complete after the reopen")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "child":
        child(sys.argv[2], int(sys.argv[3]))
