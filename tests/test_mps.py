"""On Apple hardware: every kernel family of tests/mps_families.py on both GPU tiers, through
`torch.ops.bitsandbytes.*` on mps tensors, against the references the emulator tests use; and the
CPU round trip with its in-place write-back for every op. Skipped elsewhere (marker `mps`).

The machinery (inputs, comparisons, the family table) is tested on the CPU by
tests/test_mps_families.py, which also runs every family's cases under the emulator.
"""

from __future__ import annotations

import copy

import pytest
import torch

import mps_families
import op_inputs
from bnb_mps import backend_info, executors, ops
from bnb_mps.ops import op_packet

pytestmark = pytest.mark.mps

CASES = [(f, n) for f in mps_families.FAMILIES for n in f.sizes]


def use_tier(monkeypatch, tier: str) -> None:
    """Force `tier` for the test (skip when it cannot load here) and check the ops are served by it."""
    monkeypatch.setenv(executors.ENV_VAR, tier)
    executors.reset()
    selected = executors.selection()
    if selected.tier != tier:
        pytest.skip(f"the {tier} tier is unavailable here: {executors.load_errors().get(tier, selected.reason)}")


@pytest.mark.parametrize("tier", executors.GPU_TIERS)
@pytest.mark.parametrize("family,n", CASES, ids=[f"{f.name}-n{n}" for f, n in CASES])
def test_family_on_gpu(fresh_tier_selection, tier, family, n):
    use_tier(fresh_tier_selection, tier)
    info = backend_info()
    for op in family.ops:
        assert info[op]["tier"] == tier, (op, info[op])
    bf16 = _mps_has_bfloat16()
    count = 0
    for case in family.cases(n):
        if not bf16 and mps_families.uses_dtype(case, torch.bfloat16):
            continue  # bf16 tensors on mps need macOS 14
        try:
            mps_families.run_case(case, "mps")
        except AssertionError:
            raise
        except Exception as e:  # name the case that raised
            raise AssertionError(f"{case.label}: {type(e).__name__}: {e}") from e
        count += 1
    assert count > 0


def _mps_has_bfloat16() -> bool:
    try:
        torch.ones(1, dtype=torch.bfloat16, device="mps").sum().item()
        return True
    except Exception:
        return False


FALLBACK = [(name, label) for name in ops.OPS for label, _ in op_inputs.cases(name)]


@pytest.mark.parametrize("name,label", FALLBACK, ids=[f"{n}-{l}" for n, l in FALLBACK])
def test_cpu_round_trip_on_mps(fresh_tier_selection, name, label):
    """The CPU-transfer fallback on mps tensors (forced with BNB_MPS_EXECUTOR=cpu; the default for
    ops without a Metal kernel): results back on mps, equal to what test_fallback expects on copies
    (bitsandbytes' CPU op, or the docs/semantics.md result where that depends on the CPU), and every
    in-place update (parameters, states, absmax, out) written back into the caller's tensors."""
    from test_fallback import assert_identical, expected

    fresh_tier_selection.setenv(executors.ENV_VAR, "cpu")
    executors.reset()
    assert backend_info()[name]["tier"] == "cpu"
    args = dict(op_inputs.cases(name))[label]
    theirs = copy.deepcopy(args)
    mine = [a.to("mps") if isinstance(a, torch.Tensor) else a for a in copy.deepcopy(args)]
    got = op_packet(name)(*mine)
    want = expected(name, theirs)
    for leaf in (got if isinstance(got, (tuple, list)) else [got]):
        if isinstance(leaf, torch.Tensor):
            assert leaf.device.type == "mps", f"{name}: result on {leaf.device}"
    to_cpu = lambda x: x.cpu() if isinstance(x, torch.Tensor) else (type(x)(to_cpu(v) for v in x) if isinstance(x, (tuple, list)) else x)  # noqa: E731
    assert_identical(to_cpu(got), want, f"{name} result")
    for i, (m, t) in enumerate(zip(mine, theirs)):
        if isinstance(t, torch.Tensor):
            assert m.device.type == "mps"
            assert_identical(m.cpu(), t, f"{name} argument {i} after the call")
    if name.startswith("optimizer_update"):
        assert not torch.equal(mine[2].cpu(), args[2])


def test_ops_without_kernels_use_the_round_trip_by_default(fresh_tier_selection):
    info = backend_info()
    for name, op in ops.OPS.items():
        if op.kernel is None:
            assert info[name]["tier"] == "cpu", (name, info[name])
        else:
            assert info[name]["tier"] in executors.GPU_TIERS, (name, info[name])
