"""Helpers shared by the emulator tests (imported by conftest.py and the test modules)."""

from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

KERNELS = Path(__file__).resolve().parent / "kernels"
ORDERS = ("forward", "reverse", "random")
@functools.lru_cache(maxsize=None)
def _supports_emulator(cxx: str) -> bool:
    """Whether `cxx` can build kernels (C++17 with _Float16)."""
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "t.cpp"
        src.write_text("_Float16 f(_Float16 a) { return a * a; }\n")
        r = subprocess.run([cxx, "-std=c++17", "-c", str(src), "-o", str(Path(d) / "t.o")], capture_output=True)
        return r.returncode == 0


def available_compilers() -> list[str]:
    found = []
    gnu = shutil.which("g++")
    if gnu and _supports_emulator(gnu):
        found.append("g++")
    for clang in ("clang++", "clang++-19", "clang++-18", "clang++-17", "clang++-16", "clang++-15"):
        path = shutil.which(clang)
        if path and _supports_emulator(path):
            found.append(clang)
            break
    return found


def load_kernels(name: str, compiler: str | None = None):
    from bnb_mps import emulator

    return emulator.load(KERNELS / name, compiler=compiler)
