"""scripts/bench_optimizers.py off a Mac: it says no GPU time was measured and reports, per
optimizer, one launch per parameter tensor per step, no allocation and no host reads."""

from __future__ import annotations

import json
from pathlib import Path

import extras
import pytest
import torch

from script_loader import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_optimizers.py"


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_optimizers.py", "bench_optimizers")


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="measures GPU time on a Mac")
def test_emulated_report(bench, tmp_path, capsys):
    pytest.importorskip("bnb_mps._emu")
    out = tmp_path / "bench.json"
    assert bench.main(["--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "no GPU time was measured" in text
    report = json.loads(out.read_text())
    assert report["mode"] == "emulated" and len(report["rows"]) == 3
    for row in report["rows"]:
        assert row["launches"] == row["tensors"] == 3, row
        assert row["alloc_bytes"] == 0, row
        assert row["host_reads"] == "none", row
        assert len(row["kernels"]) == 1 and row["kernels"][0].startswith("bnb_optimizer_"), row


def test_step_bytes_and_sizes(bench):
    """What a step must move: AdamW8bit reads g and p, writes p, reads and writes two byte states
    (and a float per 256-block per state): 16 bytes per fp32 parameter, under a third of torch's."""
    cfg = {c.name: c for c in bench.configs()}
    n = 256 * 1000
    assert cfg["bnb AdamW8bit (bnb-mps)"].step_bytes(n, 4) == 16 * n + 16 * 1000
    assert cfg["bnb Lion8bit (bnb-mps)"].step_bytes(n, 4) == 14 * n + 8 * 1000
    assert cfg["torch AdamW (foreach)"].step_bytes(n, 4) == 28 * n
    assert [bench.parse_size(s) for s in ("10M", "1B", "300k", "5")] == [10**7, 10**9, 300_000, 5]
    sizes = [p.numel() for p in bench.make_params(bench.CHUNK * 2 + 5, torch.float16, "meta")]
    assert sizes == [bench.CHUNK, bench.CHUNK, 5]


def test_chart(bench, tmp_path):
    extras.require("matplotlib")
    rows = [{"config": c, "params": n, "ms": ms, "state_bytes": sb} for c, n, ms, sb in (
        ("a", 10**7, 1.0, 2e7), ("a", 10**8, 9.0, 2e8), ("b", 10**7, 2.0, 8e7), ("b", 10**8, 20.0, 8e8))]
    path = bench.chart(rows, str(tmp_path / "c.png"))
    assert path and Path(path).stat().st_size > 1000
