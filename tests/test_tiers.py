"""The suite's tiers (tests/tiers.py): every listed module exists and is in one tier, and a `unit`
test can neither start a subprocess nor launch on the emulator (the guard in conftest.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import tiers

TESTS = Path(__file__).resolve().parent


def test_every_listed_module_exists_and_is_in_one_tier():
    assert not tiers.KERNELS & tiers.MODEL
    for name in tiers.KERNELS | tiers.MODEL:
        assert (TESTS / name).is_file(), f"tests/tiers.py lists {name}, which does not exist"
    assert tiers.tier_of("test_tiers.py") == "unit"


def test_a_unit_test_starts_no_subprocess():
    with pytest.raises(tiers.TierViolation, match="subprocess"):
        subprocess.run([sys.executable, "-c", "pass"], check=False)


def test_a_unit_test_launches_nothing_on_the_emulator():
    from bnb_mps import emulator

    with pytest.raises(tiers.TierViolation, match="emulator"):
        emulator.Library("kernel void k(device float* x [[buffer(0)]]) { x[0] = 1.0f; }\n")


@pytest.mark.kernels
def test_a_kernels_test_runs_no_program_of_the_project_in_a_subprocess():
    with pytest.raises(tiers.TierViolation, match="subprocess"):
        subprocess.run([sys.executable, "-m", "bnb_mps"], check=False)
    assert subprocess.run(["true"], check=False).returncode == 0  # (the emulator's compiler runs are allowed)
