"""Kernel entry points check the rows they are given from Python, in both builds: past the
entry point the release build indexes unchecked."""

import numpy as np
import pytest

from cext._lease import validate
from engine import ActionSpec
from tests.conftest import make_engine

CONFIG = {
    "resources": ["cpu"],
    "clusters": {"east": {"capacity": {"cpu": 8}}},
    "queues": {"q": {}},
    "engine": {"default_queue": "q"},
}


def test_kernel_entry_points_check_the_rows_they_are_given():
    eng, _ = make_engine(CONFIG)
    k, st = eng._kernel, eng._state
    n = st.a_state.shape[0]
    nf = st.fz_state.shape[0]
    for bad in (-1, n):
        for call in (k.push, k.remove, lambda a: k.release(a, 0), lambda a: k.head_eta(a, 0),
                     lambda a: k.budget_eta(a, 0)):
            with pytest.raises(IndexError, match=rf"^[ah]={bad} is not an action row "):
                call(bad)
    for bad in (-1, nf):
        for call in (k.push_finalize, k.remove_finalize, k.release_finalize):
            with pytest.raises(IndexError, match=rf"^f={bad} is not a finalize row "):
                call(bad)
    with pytest.raises(IndexError, match=r"^c=-1 is not a cluster row \(0 <= c < 1\)"):
        k.cluster_free(-1)
    with pytest.raises(IndexError, match=r"^q=1 is not a queue row \(0 <= q < 1\)"):
        k.gate_bench(1, np.zeros(0, dtype=np.int32), 1)
    with pytest.raises(IndexError, match=r"^rows\[1\]=-1 is not an action row"):
        k.push_many(np.array([0, -1], dtype=np.int32))
    with pytest.raises(IndexError, match=r"^rows\[0\]=-1 is not an action row"):
        eng._codec_records.encode_actions(np.array([-1], dtype=np.int64), bytearray(4096))

    # The dispatch ring stores what it is given: every field is checked first.
    with pytest.raises(IndexError, match=r"^row=-1 is not an action row"):
        k.push_dispatch(0, -1, 1, 0, 0)
    with pytest.raises(IndexError, match=rf"^row={nf} is not a finalize row"):
        k.push_dispatch(1, nf, 1, 0, 0)
    with pytest.raises(ValueError, match=r"^kind=2 is not a LeaseKind"):
        k.push_dispatch(2, 0, 1, 0, 0)
    with pytest.raises(IndexError, match=r"^c=1 is not a cluster row"):
        k.push_dispatch(0, 0, 1, 1, 0)
    with pytest.raises(IndexError, match=r"^w=1 is not a worker row in use \(0 <= w < 1\)"):
        k.push_dispatch(0, 0, 1, 0, 1)
    assert k.d_tail == 0

    # Counts bound the tick's loops over rows: refused when past their tables, kept as set.
    with pytest.raises(ValueError, match=r"^n_workers=-1 is not in"):
        k.set_counts(-1, 0)
    with pytest.raises(ValueError, match=rf"^n_envs={st.e_cluster.shape[0] + 1} is not in"):
        k.set_counts(1, st.e_cluster.shape[0] + 1)
    with pytest.raises(ValueError, match=r"^n=1 is not in \[0, 0\]"):
        k.set_pools_live(1)

    tokens = np.zeros((1, 3), dtype=np.uint64)
    verdicts = np.zeros(1, dtype=np.uint8)
    with pytest.raises(IndexError, match=r"^worker=1 is not -1 or a worker row in use"):
        validate(k, tokens, 1, 0, 0, 0, verdicts, True)

    # Nothing was linked by the refused push_many: the engine still works as before.
    assert st.a_state[0] == 0
    aid = eng.enqueue(ActionSpec(id="acme/p/d/r/a", task="t", resources={"cpu": 1}))
    assert [a.action for a in eng.tick()] == [aid]
