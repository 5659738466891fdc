"""The emulator's hand-written fiber switch on each architecture it supports, and the ucontext
fallback: tests/emulator/native/context_selftest.cpp built per target and run (aarch64 under
qemu-user when a cross compiler and qemu are installed; scripts/setup_env.sh installs them)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "tests/emulator/native/context_selftest.cpp", ROOT / "csrc/emu/src/context.cpp"]

TARGETS = {
    "host": (["c++"], []),
    "ucontext-fallback": (["c++", "-DBNB_EMU_USE_UCONTEXT=1"], []),
    "aarch64-qemu": (["aarch64-linux-gnu-g++", "-static"], ["qemu-aarch64"]),
}


@pytest.mark.parametrize("target", list(TARGETS))
def test_context_switch(target, tmp_path):
    compiler, runner = TARGETS[target]
    for tool in compiler[:1] + runner[:1]:
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    exe = tmp_path / "context_selftest"
    build = subprocess.run(
        [*compiler, "-std=c++17", "-O2", "-ffp-contract=off", f"-I{ROOT / 'csrc/emu/src'}", *map(str, SOURCES),
         "-o", str(exe)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr
    run = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr
