"""scripts/bench_kernels.py's int8 family off a Mac: int8_scaled_mm is one launch with nothing
allocated beyond its output and no host read; the Linear8bitLt step (threshold 6.0) is three
launches and reads the device once (the outlier count)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from script_loader import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_kernels.py"


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_kernels.py", "bench_kernels_int8")


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="measures GPU time on a Mac")
def test_int8_family_emulated_report(bench, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--families", "int8", "--json", str(out)]) == 0
    assert "no GPU time was measured" in capsys.readouterr().out
    cases = json.loads(out.read_text())["cases"]
    assert len(cases) == 6
    for case in cases:
        if case["name"].startswith("int8_scaled_mm"):
            assert case["launches"] == 1 and case["extra_alloc_bytes"] == 0 and case["host_reads"] == "none", case
        else:
            assert case["launches"] == 3, case
            assert case["host_reads"].startswith("yes") and "item()" in case["host_reads"], case
