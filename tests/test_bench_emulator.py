"""scripts/bench_emulator.py runs every product kernel it names on the shapes it is given, the kernels
compute the product (--check, against plain PyTorch products), and its figures are consistent with each
other and with what it prints (M multiply-accumulates per second = M*K*N / seconds / 1e6, ratio =
kernel rate / torch.matmul rate). No speed is checked: speed targets live in the benchmark, not in
tests."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from script_loader import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_emulator.py"
SHAPES = [(40, 64, 72), (3, 48, 24)]  # the second: K % 32 != 0, M not a multiple of any tile


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "emulator.json"
    shapes = ",".join("x".join(map(str, s)) for s in SHAPES)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--shapes", shapes, "--repeat", "1", "--min-time", "0",
                           "--check", "--json", str(out)], capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, json.loads(out.read_text())


def test_every_product_kernel_runs_on_every_shape(run):
    stdout, data = run
    bench = load_script("bench_emulator.py")
    assert [(s["M"], s["K"], s["N"]) for s in data["shapes"]] == SHAPES
    for shape in data["shapes"]:
        names = [k["name"] for k in shape["kernels"]]
        assert names == list(bench.KERNELS)
        skipped = {k["name"]: k["skipped"] for k in shape["kernels"] if "skipped" in k}
        # Only the kernels whose K rule the shape breaks are left out, and the output says why.
        assert skipped == ({} if shape["K"] % 32 == 0 else {"gemv_4bit": "needs K % 32 == 0"})
        for reason in skipped.values():
            assert f"({reason})" in stdout
    lines = stdout.splitlines()
    assert sum("torch.matmul" in line for line in lines) == len(SHAPES) + 1  # (+ the heading line)
    launched = [k["kernel"] for s in data["shapes"] for k in s["kernels"] if "kernel" in k]
    # The kernels the op layer launches for these shapes and K (tile32 for M <= 32, _k16 for K % 16 == 0).
    assert "bnb_int8_linear_matmul_tile64_k16" in launched and "bnb_int8_linear_matmul_tile32_k16" in launched
    assert "bnb_int8_linear_matmul_gemv4_k16" in launched and "bnb_gemm_4bit_mma_absmax_f16" in launched


def test_figures_are_consistent(run):
    stdout, data = run
    assert data["threads"] >= 1 and len(data["loadavg_start"]) == 3 and len(data["loadavg_end"]) == 3
    lines = stdout.splitlines()
    for shape in data["shapes"]:
        macs = shape["M"] * shape["K"] * shape["N"]
        assert shape["macs"] == macs
        # The shape's lines: its torch.matmul line and the kernel lines up to the next shape.
        start = next(i for i, line in enumerate(lines) if line.startswith(f"{shape['M']}x{shape['K']}x{shape['N']} "))
        end = next((i for i in range(start + 1, len(lines)) if lines[i] and not lines[i][0].isspace()), len(lines))
        block = lines[start + 1 : end]
        torch_rate = shape["torch_matmul"]["mmacs_per_s"]
        assert torch_rate == pytest.approx(macs / shape["torch_matmul"]["seconds"] / 1e6)
        for k in shape["kernels"]:
            if "skipped" in k:
                continue
            assert k["seconds"] > 0
            assert k["mmacs_per_s"] == pytest.approx(macs / k["seconds"] / 1e6)
            assert k["ratio"] == pytest.approx(k["mmacs_per_s"] / torch_rate)
            printed = next(line for line in block if line.split()[:2] == [k["name"], k["kernel"]]).split()
            assert float(printed[-2]) == pytest.approx(k["mmacs_per_s"], abs=0.06)
            want = f"1/{1 / k['ratio']:.0f}" if k["ratio"] < 1 else f"{k['ratio']:.2f}x"
            assert printed[-1] == want


def test_check_fails_on_a_wrong_product():
    # --check is a real comparison: each kernel's output passes it, and fails it with one element off.
    from bnb_mps.executors import emulated

    bench = load_script("bench_emulator.py")
    executor = emulated.load()
    x = bench.make_inputs(8, 32, 8)
    for name, product in bench.KERNELS.items():
        launch = product.make(x)
        executor.launch(launch.kernel, grid=launch.grid, threadgroup=launch.threadgroup, args=launch.args)
        bench.check(name, launch, x)
        launch.out[3, 5] += 100
        with pytest.raises(AssertionError, match=name):
            bench.check(name, launch, x)


def test_bad_arguments_are_refused():
    for args, message in ((["--shapes", "12x34"], "MxKxN"), (["--shapes", "0x8x8"], "at least 1"),
                          (["--kernels", "int9_tiled"], "unknown kernels int9_tiled"), (["--repeat", "0"], "at least 1"),
                          (["--min-time", "-1"], "must not be negative")):  # fmt: skip
        proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)
