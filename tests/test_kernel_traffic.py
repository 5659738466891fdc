"""The memory-traffic regression gate: every case of tests/kernel_traffic.py, profiled under the
emulator, must do at least as well as its row in tests/kernel_traffic.md (lines, lines summed over
threadgroups, SIMD transactions, coalescing and traffic efficiency). When a kernel legitimately
changes, refresh the table: `python tests/kernel_traffic.py --write` (and say why in the commit)."""

from __future__ import annotations

import warnings

import pytest

from extras import profile_compiler

import kernel_traffic as kt

pytest.importorskip("bitsandbytes")

REFRESH = "if the change is intended, refresh the table: python tests/kernel_traffic.py --write"
TOLERANCE = 0.0005  # efficiencies are recorded with 3 decimals


@pytest.fixture(scope="module")
def recorded():
    profile_compiler()
    return kt.read_table()


def test_every_case_has_a_row_and_every_row_a_case():
    rows = kt.read_table()
    missing = [n for n in kt.CASES if n not in rows]
    stale = [n for n in rows if n not in kt.CASES]
    assert not missing, f"cases without a row in {kt.TABLE.name}: {missing}; {REFRESH}"
    assert not stale, f"rows of {kt.TABLE.name} without a case in kernel_traffic.py: {stale}; {REFRESH}"


def test_table_round_trips():
    rows = list(kt.read_table().values())
    assert rows
    assert [kt.Row.from_cells(r.cells()) for r in rows] == rows


@pytest.mark.parametrize("name", list(kt.CASES))
def test_traffic_does_not_regress(recorded, name):
    if name not in recorded:
        pytest.fail(f"{name}: no row in {kt.TABLE.name}; {REFRESH}")
    want = recorded[name]
    got = kt.measure(kt.CASES[name])
    row = " | ".join(got.cells())
    assert got.kernels == want.kernels, f"{name}: launches {got.kernels}, recorded {want.kernels}; {REFRESH}"
    assert got.required_bytes == want.required_bytes, f"{name}: the case changed; {REFRESH}"
    worse = []
    for what, g, w in (("lines", got.lines, want.lines), ("lines summed over threadgroups", got.lines_summed,
                                                            want.lines_summed),
                       ("SIMD transactions", got.transactions, want.transactions)):  # fmt: skip
        if g > w:
            worse.append(f"{what} {g} > recorded {w}")
    for what, g, w in (("coalescing efficiency", got.coalescing, want.coalescing),
                       ("traffic efficiency", got.traffic, want.traffic)):
        if g < w - TOLERANCE:
            worse.append(f"{what} {g:.3f} < recorded {w:.3f}")
    assert not worse, f"{name}: {'; '.join(worse)}.\nmeasured row: | {row} |\n{REFRESH}"
    if got.cells() != want.cells():
        warnings.warn(f"{name}: better than recorded (| {row} |); {REFRESH}", stacklevel=1)
