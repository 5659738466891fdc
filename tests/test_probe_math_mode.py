"""scripts/probe_math_mode.py, the acceptance run's probe of contraction and fast math on a Mac: its
exact reference and its classification are checked here, and its probes run end to end under the
emulator, whose compiles never contract (so the explicit fma control must come out fused, and
a * b + c separately rounded); on a Mac (`mps`) every pinned row must show no contraction."""

from __future__ import annotations

import importlib.util
import json
from fractions import Fraction
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("probe_math_mode", ROOT / "scripts" / "probe_math_mode.py")
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)


def test_the_fused_reference_is_one_rounding_of_the_exact_value():
    a, b, c = probe.triples(512, seed=3)
    fused = probe.exact_fma(a, b, c)
    for i in range(0, 512, 7):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        # the float32 nearest to the exact value: neither neighbour is closer
        f = float(fused[i])
        up = float(torch.nextafter(fused[i : i + 1], torch.tensor([float("inf")]))[0])
        down = float(torch.nextafter(fused[i : i + 1], torch.tensor([float("-inf")]))[0])
        assert abs(Fraction(f) - exact) <= abs(Fraction(up) - exact) and abs(Fraction(f) - exact) <= abs(Fraction(down) - exact)
    separate = (a * b) + c
    assert (fused != separate).float().mean() > 0.5  # the inputs tell the two apart


def test_classify_counts_only_distinguishing_triples():
    fused = torch.tensor([1.0, 2.0, 3.0, 4.0])
    separate = torch.tensor([1.5, 2.0, 3.5, 4.5])
    got = torch.tensor([1.0, 9.0, 3.5, 7.0])
    assert probe.classify(got, fused, separate) == {"distinguishing": 3, "contracted": 1, "separate": 1, "neither": 1}


def test_the_probes_run_end_to_end_under_the_emulator(tmp_path):
    pytest.importorskip("bnb_mps._emu")
    out = tmp_path / "probe.json"
    assert probe.main(["--tier", "emulated", "--n", "1024", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["source"] for r in rows} == {"bare", "pinned"}
    for r in rows:
        mad, fma = r["probe_mad"], r["probe_fma"]
        assert mad["distinguishing"] > 900
        assert mad["contracted"] == 0 and mad["separate"] == mad["distinguishing"]
        assert fma["contracted"] == fma["distinguishing"]  # the control: a real fused multiply-add
        assert r["nan_is_nan"] == r["n"] and r["sqrt"]["precise_not_correctly_rounded"] == 0


@pytest.mark.mps
def test_pinned_kernels_never_contract_on_this_mac(tmp_path):
    """On the GPU: at every language version each tier compiles at, a * b + c behind bnb_math_mode.h is
    rounded twice, and the fma control is fused (so the probe can see a contraction)."""
    out = tmp_path / "probe.json"
    probe.main(["--n", "65536", "--json", str(out)])
    rows = [r for r in json.loads(out.read_text())["rows"] if "error" not in r]
    assert rows, "no tier ran the probes"
    for r in rows:
        assert r["probe_fma"]["contracted"] == r["probe_fma"]["distinguishing"], r
        if r["source"] == "pinned":
            assert r["probe_mad"]["contracted"] == 0, r
