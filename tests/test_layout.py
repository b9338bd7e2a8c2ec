"""Codes and constants shared by the Cython kernel and the Python engine are spelled twice
(cext/_types.pxd, and engine/_codes.py with a few constants elsewhere in engine): each must
have the same names and values on both sides, as the compiled kernel exposes them."""

import enum

import pytest

from cext import _types
from engine import _codes
from engine._config import MAX_CLUSTERS
from engine._leases import KIND_BIT
from engine._state import NEVER
from engine._units import UNLIMITED

# Each cpdef enum of cext/_types.pxd, the prefix of its members there, and its Python mirror.
MIRRORS = [
    (_types.ActionState, "ST_", _codes.RowState),
    (_types.WaitCode, "W_", _codes.WaitCode),
    (_types.LeaseEnd, "END_", _codes.LeaseEnd),
    (_types.TokenVerdict, "TOK_", _codes.Verdict),
    (_types.LeaseKind, "KIND_", _codes.LeaseKind),
]


@pytest.mark.parametrize(("c_enum", "prefix", "py_enum"), MIRRORS,
                         ids=[c.__name__ for c, _, _ in MIRRORS])
def test_each_code_has_one_value_on_both_sides(c_enum, prefix, py_enum):
    assert all(m.name.startswith(prefix) for m in c_enum)
    c_side = {m.name.removeprefix(prefix): int(m) for m in c_enum}
    assert c_side == {m.name: int(m) for m in py_enum}


def test_every_enum_the_kernel_exports_has_a_mirror():
    exported = {v for v in vars(_types).values() if isinstance(v, enum.EnumType)}
    assert exported == {c for c, _, _ in MIRRORS}


def test_shared_constants_agree():
    assert _types.constants() == {"UNLIMITED": UNLIMITED, "NEVER": NEVER, "KIND_BIT": KIND_BIT,
                                  "MAX_CLUSTERS": MAX_CLUSTERS}


# ------------------------------------------------------------------------- table layouts


def test_every_record_field_is_a_column_of_a_compatible_type():
    # The durable records (engine/_records.py) are the one declaration of what is stored;
    # reload's column list derives from them. Each copied field must be a State column
    # (engine/_state.py) whose values fit the record's type, and back.
    import numpy as np

    from engine._records import (
        ACTION_RECORD_DERIVED,
        FINALIZE_DTYPE,
        FINALIZE_RECORD_DERIVED,
        action_columns,
        action_dtype,
        finalize_columns,
    )
    from engine._state import ACTION_FIELDS, FINALIZE_FIELDS

    dtype = action_dtype(3)
    assert set(action_columns(3)) | set(ACTION_RECORD_DERIVED) == set(dtype.names)
    for name in action_columns(3):
        column = "a_" + name
        assert column in ACTION_FIELDS, f"record field {name} has no column {column}"
        col_type = np.dtype(ACTION_FIELDS[column][0])
        rec_type = dtype[name].base
        assert col_type.kind == rec_type.kind or (col_type.kind, rec_type.kind) == ("u", "i"), (
            name, col_type, rec_type)
        assert rec_type.itemsize >= col_type.itemsize, (name, col_type, rec_type)
    assert set(finalize_columns()) | set(FINALIZE_RECORD_DERIVED) == set(FINALIZE_DTYPE.names)
    for name in finalize_columns():
        column = "fz_" + name
        assert column in FINALIZE_FIELDS, f"finalize field {name} has no column {column}"
        assert FINALIZE_DTYPE[name].itemsize >= np.dtype(FINALIZE_FIELDS[column][0]).itemsize
