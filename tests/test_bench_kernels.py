"""scripts/bench_kernels.py off a Mac: it says no GPU time was measured and reports, per op, one
launch, no allocation beyond the outputs and no host reads, and the emulator's traffic figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from script_loader import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_kernels.py"


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_kernels.py", "bench_kernels")


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="measures GPU time on a Mac")
def test_emulated_report(bench, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--families", "quant", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "no GPU time was measured" in text
    report = json.loads(out.read_text())
    assert report["mode"] == "emulated" and len(report["cases"]) == 4
    for case in report["cases"]:
        assert case["launches"] == 1, case
        assert case["extra_alloc_bytes"] == 0, case
        assert case["host_reads"] == "none", case
    # The emulator's traffic figures (when clang can build the profiling kernels): a kernel touches
    # at least the bytes its op must move, and no instruction does better than whole lines.
    assert "Memory traffic measured by the emulator" in text
    for case in report["cases"]:
        profile = case["profile"]
        if "error" in profile:
            continue
        assert sorted(set(profile["kernels"])) == case["kernels"], case
        assert profile["unique_bytes"] >= case["required_bytes"], case
        assert 0 < profile["coalescing_efficiency"] <= 1, case
        assert profile["traffic_bytes"] >= profile["lines"] * 128, case


def test_unknown_family_is_refused(bench):
    with pytest.raises(SystemExit):
        bench.main(["--families", "nope"])
