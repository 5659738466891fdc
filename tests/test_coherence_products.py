"""bitsandbytes' 4-bit products through the op layer on the emulated tier compiled at Metal 3.1 and
3.2, with the emulator's memory model on (docs/emulator.md, "Memory model"): at M = 2..32 the
built-in route is a split-K path (two dispatches at 3.1, the one-dispatch hand-over at 3.2) or the
small kernel, and no route may read what another threadgroup of its dispatch wrote unless the
version makes it visible. Results are held to docs/semantics.md section 4's bound against the
float64 reference (tests/reference_matmul_4bit.py)."""

from __future__ import annotations

import pytest
import torch

import reference_matmul_4bit as R
from bnb_mps.testing import use_emulated_kernels
from extras import profile_compiler
from matmul_4bit_cases import Case, gemm_args

profile_compiler()  # the check runs the instrumented build (a missing clang++ skips, and fails under CI)

CASES = [
    Case(2, 96, 1024, torch.float16, nested=True, seed=1),
    Case(5, 200, 512, torch.bfloat16, 64, "fp4", bias=True, seed=2),
    Case(8, 136, 1984, torch.float32, nested=True, seed=3),
    Case(13, 64, 2048, torch.float16, 128, "nf4", seed=4),
    Case(32, 48, 768, torch.float16, 64, "fp4", nested=True, bias=True, seed=5),
]


@pytest.mark.parametrize("metal_version", ["3.1", "3.2"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_small_batch_products_under_the_memory_model(case, metal_version, monkeypatch):
    monkeypatch.setenv("BNB_MPS_TUNE", "0")  # the built-in routes, which depend on the language version
    A, args, W, bias = gemm_args(case)
    with use_emulated_kernels(metal_version=metal_version, coherence_check=True) as kernels:
        y = torch.ops.bitsandbytes.gemm_4bit(*args)
    split = [k for k in kernels.launched if "splitk" in k]
    if metal_version == "3.1":  # no one-dispatch hand-over below 3.2
        assert not any(k.startswith("bnb_gemm_4bit_splitk_") and "partial" not in k and "sum" not in k for k in split)
    R.check_accuracy(y, A, W, bias)


def test_the_split_k_route_differs_by_version_where_it_is_built_in(monkeypatch):
    """A shape whose built-in route at 3.2 is the one-dispatch split-K runs it there, and the two
    dispatches at 3.1: both under the check, both within the bound."""
    monkeypatch.setenv("BNB_MPS_TUNE", "0")
    case = Case(8, 256, 4096, torch.float16, nested=True, seed=7)
    A, args, W, bias = gemm_args(case)
    launched = {}
    for version in ("3.1", "3.2"):
        with use_emulated_kernels(metal_version=version, coherence_check=True) as kernels:
            y = torch.ops.bitsandbytes.gemm_4bit(*args)
        R.check_accuracy(y, A, W, bias)
        launched[version] = kernels.launched
    assert launched["3.2"] == ["bnb_gemm_4bit_splitk_nested_f16"]
    assert launched["3.1"] == ["bnb_gemm_4bit_splitk_partial_nested_f16", "bnb_gemm_4bit_splitk_sum_f16"]
