"""The debug build traps (LEASEHOLD_DEBUG=1; `make test-debug` runs the suite against it).

Wraparound is off in both builds, so in the debug build a -1 index trips the bounds check
instead of reading the last row. Kernel helpers are ``noexcept``: the IndexError cannot
propagate and Cython reports it through ``sys.unraisablehook``, which pyproject.toml turns
into a failure of the test it happened in. Rows handed to the kernel from Python are checked
at the entry point, in both builds. Each test asserts what the build it runs against does.
"""

import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from cext import DEBUG, RecordCodec
from cext._lease import validate
from cext._types import bounds_probe
from engine import ActionSpec
from tests.conftest import make_engine

ROOT = Path(__file__).resolve().parent.parent

CONFIG = {
    "resources": ["cpu"],
    "clusters": {"east": {"capacity": {"cpu": 8}}},
    "queues": {"q": {}},
    "engine": {"default_queue": "q"},
}


@pytest.fixture
def unraisable(monkeypatch):
    """What reaches sys.unraisablehook during the test, as (type, message); the hook is
    replaced, so these do not fail the test itself."""
    seen = []
    # Keep strings only: holding the exception or its object could resurrect them.
    monkeypatch.setattr(sys, "unraisablehook",
                        lambda u: seen.append((u.exc_type, str(u.exc_value))))
    return seen


def test_out_of_range_index_traps_in_the_debug_build_and_is_refused_in_release(unraisable):
    values = np.arange(10, 13, dtype=np.int64)
    assert bounds_probe(values, 2) == 12
    if DEBUG:
        # -1 would read 12 with wraparound on; it traps like the index past the end.
        assert bounds_probe(values, -1) == 0
        assert bounds_probe(values, 3) == 0
        assert unraisable == [(IndexError, "Out of bounds on buffer access (axis 0)")] * 2
    else:
        # No bounds check to trap: the probe refuses the index before reading it.
        with pytest.raises(IndexError, match=r"i=-1 is not an index of values \(0 <= i < 3\)"):
            bounds_probe(values, -1)
        with pytest.raises(IndexError, match="i=3 is not"):
            bounds_probe(values, 3)
        assert unraisable == []


INNER = '''
import numpy as np

from cext._types import bounds_probe


def test_probe_minus_one():
    assert bounds_probe(np.zeros(2, dtype=np.int64), -1) == 0


def test_del_raises():
    class Boom:
        def __del__(self):
            raise RuntimeError("boom in __del__")

    Boom()
'''


def test_an_exception_inside_noexcept_code_fails_the_test_it_happens_in(pytester, monkeypatch):
    # A run of its own with this project's pytest configuration and conftest.
    shutil.copy(ROOT / "pyproject.toml", pytester.path / "pyproject.toml")
    (pytester.path / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", pytester.path / "tests" / "conftest.py")
    (pytester.path / "tests" / "test_inner.py").write_text(INNER)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))     # this checkout's cext and engine
    monkeypatch.setenv("COLUMNS", "400")            # summary lines in full
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rf",
                                           "tests/test_inner.py")
    result.assert_outcomes(failed=2)
    if DEBUG:
        # The probe returned normally: the unraisable IndexError is what fails it.
        result.stdout.fnmatch_lines([
            "IndexError: Out of bounds on buffer access (axis 0)",
            "*PytestUnraisableExceptionWarning: Exception ignored in: 'cext._types._read'*",
        ])
        result.stdout.fnmatch_lines([
            "FAILED tests/test_inner.py::test_probe_minus_one - "
            "pytest.PytestUnraisableExceptionWarning*"])
    else:
        result.stdout.fnmatch_lines([
            "FAILED tests/test_inner.py::test_probe_minus_one - IndexError: i=-1 is not*"])
    # Any unraisable exception fails its test, in either build.
    result.stdout.fnmatch_lines([
        "FAILED tests/test_inner.py::test_del_raises - pytest.PytestUnraisableExceptionWarning*"])


def test_kernel_entry_points_check_the_rows_they_are_given():
    eng, _ = make_engine(CONFIG)
    view = eng.inspect()
    k, st = view.kernel, view.arrays
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
        codec = RecordCodec()
        codec.bind(SimpleNamespace(n_res=st.n_res, **st.copy()))
        codec.encode_actions(np.array([-1], dtype=np.int64), bytearray(4096))

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
