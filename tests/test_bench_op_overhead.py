"""The op-overhead benchmark runs and reports every quantization op."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_op_overhead.py"


def test_bench_op_overhead_runs():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--calls", "20"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for name in ("quantize_4bit", "dequantize_4bit", "quantize_blockwise", "dequantize_blockwise"):
        line = next(line for line in proc.stdout.splitlines() if line.strip().startswith(name))
        assert float(line.split()[-1]) > 0
