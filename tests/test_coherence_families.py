"""Every kernel family under the emulator's memory model, at each Metal language version the tiers
compile at: the first-use verification cases of each family (bnb_mps.ops.verify, compared there with
the CPU round trip and docs/semantics.md) run on the emulated tier compiled at 3.1, 3.2 and 4.0 with
the coherence check on, so that no kernel reads what another threadgroup of its dispatch wrote
unless that version's memory model makes the write visible (docs/emulator.md, "Memory model")."""

from __future__ import annotations

import pytest

from bnb_mps import executors
from bnb_mps.executors import emulated
from bnb_mps.ops import verify
from bnb_mps.ops.verify import runner

from extras import profile_compiler

profile_compiler()  # the check runs the instrumented build (a missing clang++ skips, and fails under CI)

#: the families whose kernels exist only from Metal 3.2 (the one-dispatch split-K hand-over)
FROM_3_2 = {"matmul_4bit_splitk"}


@pytest.mark.parametrize("metal_version", ["3.1", "3.2", "4.0"])
def test_every_family_passes_its_cases_under_the_coherence_check(metal_version):
    ex = executors.load_tier("emulated")
    with emulated.settings(metal_version=metal_version, coherence_check=True):
        assert ex.language_version == tuple(int(v) for v in metal_version.split("."))
        verdicts = {name: runner.run_family(family, ex, "cpu") for name, family in verify.FAMILIES.items()}
    failed = {name: v.describe() for name, v in verdicts.items() if not v.passed}
    assert not failed
    skipped = {name for name, v in verdicts.items() if v.skipped}
    # Below 3.2 the one-dispatch split-K is not compiled and every one of its cases is skipped; from
    # 3.2 every case of every family runs.
    assert skipped == (FROM_3_2 if metal_version == "3.1" else set())
    if metal_version == "3.1":
        assert all(v.launches == 0 for name, v in verdicts.items() if name in FROM_3_2)
