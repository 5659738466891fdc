"""The harness that runs bitsandbytes' own tests on bnb-mps' emulated kernels (bnb_mps.testing_plugin,
scripts/run_bitsandbytes_tests.py), run on a small test directory written here in the shape of
bitsandbytes' (a helpers.py that picks devices from BNB_TEST_DEVICE, tests parametrized by device): no
bitsandbytes source is used.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from script_loader import SCRIPTS, load_script

pytest.importorskip("bitsandbytes")
pytest.importorskip("bnb_mps._emu")

run_tests = load_script("run_bitsandbytes_tests.py")

HELPERS = '''
import os


def get_available_devices():
    # as bitsandbytes' tests/helpers.py: BNB_TEST_DEVICE, when set, is the one device
    if "BNB_TEST_DEVICE" in os.environ:
        return [os.environ["BNB_TEST_DEVICE"]]
    return ["cpu", "cuda"]
'''

TESTS = '''
import bitsandbytes as bnb
import bitsandbytes.functional as F
import pytest
import torch

from helpers import get_available_devices


@pytest.mark.parametrize("device", get_available_devices())
def test_quantize_4bit_round_trip(device):
    A = torch.randn(64, 64, device=device, generator=torch.Generator().manual_seed(0))
    packed, state = F.quantize_4bit(A, blocksize=64, quant_type="nf4")
    out = F.dequantize_4bit(packed, state)
    assert out.shape == A.shape and (out - A).abs().max() < 0.2 * A.abs().max()


@pytest.mark.parametrize("device", get_available_devices())
def test_linear4bit_decode_takes_the_portable_path(device):
    # what the plugin changes: no AVX512-BF16 CPU path (mps has none), so no CPU repacking
    assert F.has_avx512bf16() is False
    layer = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=torch.float32, quant_type="fp4").to(device)
    assert layer.support_avx512bf16_for_cpu is False
    layer.eval()
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y = layer(x)
    assert not getattr(layer.weight.quant_state, "packing_format_for_cpu", False)
    W = F.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    torch.testing.assert_close(y, x @ W.t(), rtol=1e-5, atol=1e-5)


def test_torch_only():
    assert torch.ones(3).sum() == 3


def test_skipped():
    pytest.skip("skipped on purpose")
'''


@pytest.fixture(scope="module")
def bnb_like_tests(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bnb_like") / "tests"
    root.mkdir()
    (root / "helpers.py").write_text(textwrap.dedent(HELPERS))
    (root / "test_small.py").write_text(textwrap.dedent(TESTS))
    return root


def run_script(tests: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """scripts/run_bitsandbytes_tests.py on `tests` in a fresh process (BNB_TEST_DEVICE unset: the
    script sets it); returns the process and the plugin's JSON report."""
    report = tests.parent / "report.json"
    report.unlink(missing_ok=True)
    env = dict(os.environ)
    env.pop("BNB_TEST_DEVICE", None)
    command = [sys.executable, str(SCRIPTS / "run_bitsandbytes_tests.py"), str(tests), "--bnb-mps-report", str(report)]
    proc = subprocess.run([*command, *args], cwd=tests.parent, env=env, capture_output=True, text=True, timeout=600)
    return proc, (json.loads(report.read_text()) if report.exists() else {})


def test_bitsandbytes_style_tests_run_on_the_emulated_kernels(bnb_like_tests):
    proc, report = run_script(bnb_like_tests)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tests = report["tests"]
    quant = tests["tests/test_small.py::test_quantize_4bit_round_trip[cpu]"]  # BNB_TEST_DEVICE=cpu: one device
    assert quant["outcome"] == "passed"
    assert quant["kernels"] == {"bnb_quantize_4bit_nf4_f32_64": 1, "bnb_dequantize_4bit_nf4_f32": 1}
    assert quant["ops"] == {"quantize_4bit": {"emulated": 1}, "dequantize_4bit": {"emulated": 1}}
    decode = tests["tests/test_small.py::test_linear4bit_decode_takes_the_portable_path[cpu]"]
    assert decode["outcome"] == "passed" and decode["kernels"].get("bnb_gemv_4bit_nested_f32") == 1, decode
    assert decode["ops"]["gemm_4bit"] == {"emulated": 1}
    assert tests["tests/test_small.py::test_torch_only"] == {"outcome": "passed", "kernels": {}, "ops": {}}
    assert tests["tests/test_small.py::test_skipped"]["outcome"] == "skipped"
    assert report["passed_without_kernels"] == ["tests/test_small.py::test_torch_only"]
    assert report["kernels"]["bnb_gemv_4bit_nested_f32"] == {"launches": 1, "tests": 1}
    # The summary names the kernels that served and the test that passed without any.
    out = proc.stdout
    assert "bnb-mps: what served bitsandbytes' tests" in out
    assert any(line.split()[:3] == ["bnb_gemv_4bit_nested_f32", "1", "1"] for line in out.splitlines())
    assert "2 of 3 tests (not counting skipped ones) launched bnb-mps kernels" in out
    assert "1 test passed without any bnb-mps kernel" in out and "  tests/test_small.py::test_torch_only" in out


def test_require_kernels_fails_a_pass_without_kernels(bnb_like_tests):
    proc, report = run_script(bnb_like_tests, "-k", "torch_only or skipped", "--bnb-mps-require-kernels")
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert report["tests"]["tests/test_small.py::test_torch_only"]["outcome"] == "failed: no kernel"
    assert "passed without launching any of bnb-mps' kernels" in proc.stdout
    assert "1 failed" in proc.stdout and "1 skipped" in proc.stdout


def test_another_device_is_refused(monkeypatch):
    """The plugin serves CPU tensors only: another BNB_TEST_DEVICE is a usage error (the script sets cpu)."""
    from bnb_mps import testing_plugin

    monkeypatch.setenv("BNB_TEST_DEVICE", "mps")
    with pytest.raises(pytest.UsageError, match="BNB_TEST_DEVICE must be 'cpu' or unset, got 'mps'"):
        testing_plugin.pytest_configure(config=None)


def test_script_arguments(tmp_path):
    with pytest.raises(ValueError, match="usage"):
        run_tests.pytest_arguments([])
    with pytest.raises(ValueError, match="must be a directory"):
        run_tests.pytest_arguments([str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="has no helpers.py"):
        run_tests.pytest_arguments([str(tmp_path)])
    (tmp_path / "helpers.py").write_text("")
    (tmp_path / "test_x.py").write_text("")
    args = run_tests.pytest_arguments([str(tmp_path), "-k", "gemv"])
    assert args[:4] == ["-p", "bnb_mps.testing_plugin", "-p", "no:cacheprovider"]
    assert args[4:] == ["-m", run_tests.DEFAULT_MARKS, str(tmp_path), "-k", "gemv"]
    node = f"{tmp_path / 'test_x.py'}::test_a"  # a test id in the directory
    assert run_tests.pytest_arguments([node, "-m", "slow"])[4:] == [node, "-m", "slow"]
    assert run_tests.main([str(tmp_path / "missing")]) == 2
