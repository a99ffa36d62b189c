"""Tests of pipemark.runtime.schedules.csv_cells: torch's schedule CSV cells, parsed and written
back, and the cells it refuses."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipemark.runtime.schedules.csv_cells import (
    CELL_TYPES,
    COMPUTE,
    OVERLAP,
    Cell,
    CellError,
    format_cell,
    parse_cell,
    read_rows,
    write_rows,
)

_NO_MICROBATCH = ("REDUCE_GRAD", "UNSHARD", "RESHARD")


def test_every_type_of_torch_reads():
    # torch's _ComputationType, less OVERLAP_F_B (a pair, below).
    assert set(CELL_TYPES) == {
        "F", "I", "W", "B", "UNSHARD", "RESHARD", "SEND_F", "RECV_F", "SEND_B", "RECV_B",
        "OVERLAP_F_B", "REDUCE_GRAD",
    }  # fmt: skip
    assert parse_cell("12RECV_B3") == Cell(12, "RECV_B", 3)
    assert parse_cell(" 0UNSHARD ") == Cell(0, "UNSHARD", None)
    assert parse_cell("") is parse_cell("   ") is None
    pair = parse_cell("(2F7;1I5)OVERLAP_F_B")
    assert pair.type == OVERLAP and pair.parts == (Cell(2, "F", 7), Cell(1, "I", 5))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("2X0", "is not an action"),
        ("2F0x", "is not an action"),  # torch's regex would read 2F0
        ("F0", "is not an action"),
        ("1REDUCE_GRAD0", "names a stage, no microbatch"),
        ("1F", "names a microbatch"),
        ("(0F3;3B1)", "is not an overlapped pair"),
        ("(0F3)OVERLAP_F_B", "a forward and then a backward"),
        ("(3B1;0F3)OVERLAP_F_B", "a forward and then a backward"),
        ("(0F3;3W1)OVERLAP_F_B", "a forward and then a backward"),
    ],
)
def test_bad_cells_are_refused_saying_why(text, match):
    with pytest.raises(CellError, match=match):
        parse_cell(text)


_single = st.one_of(
    st.builds(lambda s, t: Cell(s, t), st.integers(0, 99), st.sampled_from(_NO_MICROBATCH)),
    st.builds(
        lambda s, t, m: Cell(s, t, m),
        st.integers(0, 99),
        st.sampled_from([t for t in CELL_TYPES if t not in (*_NO_MICROBATCH, OVERLAP)]),
        st.integers(0, 999),
    ),
)
_pair = st.builds(
    lambda f, b: Cell(-1, OVERLAP, None, (f, b)),
    st.builds(lambda s, m: Cell(s, "F", m), st.integers(0, 9), st.integers(0, 9)),
    st.builds(
        lambda s, t, m: Cell(s, t, m), st.integers(0, 9), st.sampled_from("BI"), st.integers(0, 9)
    ),
)


@given(st.lists(st.lists(st.one_of(st.none(), _single, _pair), max_size=6), max_size=4))
def test_rows_written_read_back_as_they_were(rows):
    back = [[parse_cell(c) for c in row] for row in read_rows(write_rows(rows))]
    while rows and not any(rows[-1]):  # trailing idle rows are no rows of the file
        rows = rows[:-1]
    assert back == rows


def test_compute_types_name_the_action_kinds():
    assert COMPUTE == {"F": "forward", "B": "backward", "I": "backward", "W": "weight"}
    assert format_cell(Cell(3, "W", 0)) == "3W0" and format_cell(None) == ""
