"""scripts/bench_op_overhead.py runs, covers every hot op, and its figures are consistent with each other
(bnb-mps' share = total - floor; share per torch.add = share / torch.add). No time limit is checked:
speed targets live in the benchmark, not in tests."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from script_loader import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_op_overhead.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "overhead.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--calls", "20", "--rounds", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, json.loads(out.read_text())


def test_every_hot_op_is_measured_and_printed(run):
    stdout, data = run
    bench = load_script("bench_op_overhead.py")
    assert [c["name"] for c in data["cases"]] == list(bench.OPS)
    assert set(data["no_op_launch"]["rows"]) == set(bench.OPS)
    for name in bench.OPS:
        assert any(line.startswith(name) for line in stdout.splitlines()), name
    for schema in ("gemm_4bit", "gemv_4bit", "dequantize_4bit", "quantize_4bit", "optimizer_update_8bit_blockwise",
                   "optimizer_update_32bit"):  # fmt: skip
        assert schema in bench.SCHEMAS


def test_figures_are_consistent(run):
    stdout, data = run
    result = data["no_op_launch"]
    add = result["torch_add_us"]
    assert add > 0
    for name, r in result["rows"].items():
        assert r["total_us"] > 0 and r["floor_us"] > 0, name
        assert math.isclose(r["share_us"], r["total_us"] - r["floor_us"], rel_tol=1e-9, abs_tol=1e-9), name
        assert math.isclose(r["share_per_add"], r["share_us"] / add, rel_tol=1e-9), name
        assert r["total_median_us"] >= r["total_us"] and r["floor_median_us"] >= r["floor_us"], name
        printed = next(line for line in stdout.splitlines() if line.startswith(name)).split()
        assert float(printed[-4]) == pytest.approx(r["total_us"], abs=0.006)
        assert float(printed[-3]) == pytest.approx(r["floor_us"], abs=0.006)
        assert float(printed[-2]) == pytest.approx(r["share_us"], abs=0.006)
        assert printed[-1] == f"{r['share_per_add']:.1f}x"


def test_it_says_which_metadata_key_served(run):
    from bnb_mps.ops import plan

    _, data = run
    assert data["metadata_key"].startswith("C++" if plan.key is not plan.metadata_key else "Python")
    assert data["mode"] == "host" and "native" not in data  # (--native only on a Mac)


def test_native_mode_says_why_it_is_not_measured_off_a_mac(tmp_path):
    out = tmp_path / "o.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--calls", "2", "--rounds", "1", "--ops", "quantize_4bit",
                           "--native", "--json", str(out)], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "--native: not measured: the native tier does not serve here" in proc.stdout
    assert "native tier does not serve here" in json.loads(out.read_text())["native"]["error"]
