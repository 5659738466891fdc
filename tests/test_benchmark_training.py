"""Tests for scripts/benchmark_training.py (run here on the CPU with tiny sizes)."""

import importlib.util
import os
import re
import runpy
import sys

import extras
import pytest

from script_loader import load_script
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "benchmark_training.py")
TINY = ["--hidden", "8", "--layers", "1", "--batch-size", "4", "--steps", "2", "--warmup", "1", "--repeats", "3"]


@pytest.fixture(scope="module")
def bench():
    try:
        yield load_script("benchmark_training.py")
    finally:
        sys.modules.pop("benchmark_training", None)


def table_rows(text):
    """(device, dtype, ms/step, samples/s) of every row that ran."""
    return [
        (m.group(1), m.group(2), float(m.group(3)), float(m.group(4)))
        for m in re.finditer(r"^(cpu|mps|cuda)\s+(fp32|bf16|fp16)\s+([\d.]+)\s+([\d.]+)", text, re.M)
    ]


def test_main_prints_a_consistent_table(bench, capsys):
    results = bench.main(["--devices", "cpu", "--dtypes", "fp32,bf16", "--no-chart"] + TINY)
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert [(d, t) for d, t, _, _ in rows] == [("cpu", "fp32"), ("cpu", "bf16")]
    for (_, _, ms, per_s), r in zip(rows, results):
        assert ms > 0 and per_s > 0
        # samples/s and ms/step describe the same median: batch / seconds per step.
        assert per_s == pytest.approx(4 / (ms / 1e3), rel=1e-2)
        assert ms == pytest.approx(r.ms_per_step, abs=1e-3)
    assert "Best: cpu" in out and "Recommendation:" in out
    assert "x CPU fp32" in out


def test_script_runs_as_a_program(tmp_path, monkeypatch, capsys):
    chart = tmp_path / "c.png"
    argv = [SCRIPT, "--devices", "cpu", "--dtypes", "fp32", "--chart", str(chart)] + TINY
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(SCRIPT, run_name="__main__")
    out = capsys.readouterr().out
    assert [(d, t) for d, t, _, _ in table_rows(out)] == [("cpu", "fp32")]
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib is not installed" in out and not chart.exists()
    else:
        assert chart.read_bytes().startswith(b"\x89PNG")


def test_chart_is_a_png(bench, tmp_path):
    extras.require("matplotlib")
    results = [bench.Result("cpu", "fp32", 2.0, 2000.0), bench.Result("cpu", "bf16", 1.0, 4000.0)]
    path = bench.write_chart(results, str(tmp_path / "chart.png"))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_warmup_is_excluded_and_each_repeat_timed(bench):
    """A fake clock: warm-up steps cost 100 s each, timed steps 1, 2 and 3 s per repeat."""
    now = [0.0]
    costs = iter([100.0, 100.0] + [1.0] * 4 + [2.0] * 4 + [3.0] * 4)

    def step():
        now[0] += next(costs)

    per_step = bench.time_steps(step, steps=4, warmup=2, repeats=3, clock=lambda: now[0])
    assert per_step == [1.0, 2.0, 3.0]


def test_the_step_really_trains(bench):
    step = bench.build_step(torch.device("cpu"), torch.float32, hidden=64, layers=1, batch_size=32)
    first = float(step())
    for _ in range(40):
        last = float(step())
    assert last < 0.5 * first  # AdamW memorises one fixed batch


def test_unsupported_configuration_is_skipped_not_fatal(bench, monkeypatch, capsys):
    real = bench.build_step

    def build(device, dtype, *a, **k):
        if dtype == torch.float16:
            raise RuntimeError("fp16 autocast is not supported on this device")
        return real(device, dtype, *a, **k)

    monkeypatch.setattr(bench, "build_step", build)
    results = bench.main(["--devices", "cpu", "--dtypes", "fp32,fp16", "--no-chart"] + TINY)
    assert [r.skipped is None for r in results] == [True, False]
    assert "skipped (RuntimeError: fp16 autocast is not supported" in capsys.readouterr().out


def test_speedup_and_recommendation(bench):
    R = bench.Result
    results = [R("cpu", "fp32", 10.0, 100.0), R("cpu", "bf16", 8.0, 125.0),
               R("mps", "fp32", 4.0, 250.0), R("mps", "bf16", 2.0, 500.0), R("mps", "fp16", None, None, "no")]
    table = bench.format_table(results)
    speedups = {(m.group(1), m.group(2)): float(m.group(3))
                for m in re.finditer(r"^(\w+)\s+(\w+)\s+[\d.]+\s+[\d.]+\s+([\d.]+)$", table, re.M)}
    assert speedups == {("cpu", "fp32"): 1.0, ("cpu", "bf16"): 1.25, ("mps", "fp32"): 2.5, ("mps", "bf16"): 5.0}
    summary = bench.summarize(results)
    assert "Best: mps bf16" in summary
    assert "4.00x" in summary  # 500 / 125, against the best CPU configuration
    assert "train on mps in bf16" in summary


def test_low_precision_needs_a_clear_margin(bench):
    R = bench.Result
    close = [R("cpu", "fp32", 10.0, 100.0), R("cpu", "bf16", 9.5, 105.0)]
    assert "train on the CPU in fp32" in bench.summarize(close)
    clear = [R("cpu", "fp32", 10.0, 100.0), R("cpu", "bf16", 5.0, 200.0)]
    assert "train on the CPU in bf16" in bench.summarize(clear)
    accel_slower = [R("cpu", "fp32", 1.0, 1000.0), R("mps", "fp32", 2.0, 500.0)]
    assert "No accelerator (mps) beat the CPU" in bench.summarize(accel_slower)


@pytest.mark.parametrize(
    "argv,phrase",
    [(["--devices", "tpu"], "unknown device"), (["--dtypes", "int8"], "unknown dtype"),
     (["--steps", "0"], "--steps"), (["--warmup", "-1"], "--warmup")],
)
def test_bad_arguments(bench, capsys, argv, phrase):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert phrase in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_device_is_refused(bench, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--devices", "cuda"])
    assert "not available here" in capsys.readouterr().err
