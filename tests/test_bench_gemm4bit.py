"""The gemm4bit family of scripts/bench_kernels.py: off a Mac it runs every kernel path on the
emulated tier (one launch, nothing allocated beyond the output, no host reads); on a Mac it
covers the issue's shapes, row counts and dtypes (`python -m bnb_mps tune` measures each route of a
shape, the kernel variants among them)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from script_loader import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_kernels.py"


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_kernels.py", "bench_kernels_gemm4bit")


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="measures GPU time on a Mac")
def test_emulated_report(bench, tmp_path, capsys):
    pytest.importorskip("bnb_mps._emu")
    out = tmp_path / "bench.json"
    assert bench.main(["--families", "gemm4bit", "--json", str(out)]) == 0
    assert "no GPU time was measured" in capsys.readouterr().out
    cases = json.loads(out.read_text())["cases"]
    assert len(cases) == 6
    for case in cases:
        assert case["launches"] == 1 and case["extra_alloc_bytes"] == 0 and case["host_reads"] == "none", case
    kernels = [c["kernels"][0] for c in cases]
    assert kernels == [f"bnb_{k}_{sc}_f16" for sc in ("absmax", "nested")
                       for k in ("gemv_4bit", "gemm_4bit_small", "gemm_4bit_mma")]  # fmt: skip


def test_mac_cases(bench):
    """What a Mac measures (nothing is run here)."""
    plain = list(bench.FAMILIES["gemm4bit"]("gpu"))
    assert len(plain) == 2 * 4 * 4 and all(c.stock and c.baseline is not None for c in plain)
    for c in plain:
        if c.name.endswith("4096x14336 M=512") and "bfloat16" in c.name:
            N, K, M = 4096, 14336, 512
            nblocks = N * K // 64
            assert c.required_bytes == N * K // 2 + nblocks + 4 * math.ceil(nblocks / 256) + 2 * M * (K + N)
            break
    else:
        raise AssertionError("missing case")


def test_mac_case_functions_run(bench):
    """The Mac cases' call functions work (run here on CPU tensors by bitsandbytes' own CPU kernels,
    bnb_mps not being registered for the cpu key): the 4-bit op and the dense baseline."""
    cpu = torch.device("cpu")
    cases = {c.name: c for c in bench.FAMILIES["gemm4bit"]("gpu")}
    plain = cases["gemm_4bit nf4 nested float16 4096x4096 M=1"]
    y = plain.make(cpu)()
    assert y.shape == (1, 4096) and y.dtype == torch.float16
    assert plain.baseline(cpu)().shape == (1, 4096)
