"""A wheel built from the checkout carries everything the kernels need at run time.

Builds the wheel (into a temporary build directory, so the checkout's editable build is left
alone), installs it into a fresh virtual environment that sees torch and bitsandbytes but not
the checkout, and there runs a kernel under the emulator through bitsandbytes' own op, whose
result is compared here with the docs/semantics.md reference.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

import spec_reference as ref

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import torch

    import bnb_mps
    from bnb_mps.msl import source
    from bnb_mps.emulator.build import include_dir
    from bnb_mps.testing import use_emulated_kernels

    site = Path(sys.argv[1]).resolve()
    package = Path(bnb_mps.__file__).resolve().parent
    assert package.parent == site, f"bnb_mps imported from {package}, not from the wheel"
    assert source.kernel_dir() == package / "kernels", source.kernel_dir()
    assert include_dir() == package / "emulator" / "include", include_dir()
    assert "bnb_quantize_4bit" in source.source()
    from bnb_mps.demo import data  # the demo's corpus is package data
    assert "Alice" in data.corpus_text()

    import bitsandbytes  # noqa: F401  (defines the ops)

    A = torch.load(sys.argv[2])
    with use_emulated_kernels() as kernels:
        packed, absmax = torch.ops.bitsandbytes.quantize_4bit(A, 64, "nf4", torch.uint8)
    assert kernels.launched == ["bnb_quantize_4bit_nf4_f32_64"], kernels.launched
    torch.save((packed, absmax), sys.argv[3])
    """
)


def _run(cmd, **kw):
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.skipif(shutil.which("cmake") is None, reason="no cmake to build the wheel with")
def test_wheel_installs_and_runs_a_kernel_elsewhere(tmp_path):
    dist, build = tmp_path / "dist", tmp_path / "build"
    _run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-build-isolation", "--no-deps", "-q",
          "-w", str(dist), "-C", f"build-dir={build}"], cwd=tmp_path, timeout=900)  # fmt: skip
    (wheel,) = dist.glob("bnb_mps-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        (entry_points,) = [n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt")]
        assert "bnb-mps = bnb_mps.__main__:main" in zf.read(entry_points).decode()

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)])
    # torch and bitsandbytes from this environment, as a plain path entry (its .pth files, among
    # them the checkout's editable install, are not processed), after the wheel's own site.
    (site / "zz_parent.pth").write_text(str(Path(torch.__file__).resolve().parents[1]) + "\n")

    A = ref._to_dtype(torch.randn(37, 29).numpy() * 3, torch.float32)
    A[5, :] = 0  # (an all-zero stretch)
    torch.save(A, tmp_path / "in.pt")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    _run([str(python), "-c", SCRIPT, str(site), str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
         cwd=tmp_path, env=env, timeout=600)  # fmt: skip

    packed, absmax = torch.load(tmp_path / "out.pt")
    want_packed, want_absmax = ref.quantize_4bit(A, 64, "nf4", torch.uint8)
    assert torch.equal(packed, want_packed)
    assert torch.equal(absmax, want_absmax)
