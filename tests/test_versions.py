"""The tested versions are the installed ones: constraints.txt pins bitsandbytes (and the libraries
the end-to-end tests run), every install of scripts/setup_env.sh and scripts/mac_acceptance.sh
takes it, and pyproject.toml's bitsandbytes floor is the pinned release."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pins() -> dict[str, str]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    found = [re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line.strip()) for line in lines]
    return {m[1].lower(): m[2] for m in found if m}


def test_constraints_pin_bitsandbytes_and_the_end_to_end_libraries():
    assert {"bitsandbytes", "transformers", "peft", "accelerate"} <= set(pins())
    assert "torch" not in pins()  # setup_env.sh pins torch itself (BNB_MPS_TORCH_VERSION); a Mac takes its own


def test_pyproject_floor_is_the_pinned_bitsandbytes():
    text = (ROOT / "pyproject.toml").read_text()
    floors = re.findall(r'"bitsandbytes>=([^"]+)"', text)
    assert floors == [pins()["bitsandbytes"]]


def test_setup_env_installs_everything_with_the_constraints(tmp_path):
    """Runs scripts/setup_env.sh with a stand-in Python that records its arguments (and without
    apt-get on the PATH, so the optional tools are not installed)."""
    log = tmp_path / "calls"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nprintf "%s " "$@" >> "{log}"\necho >> "{log}"\n')
    python.chmod(0o755)
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("dirname", "id"):
        (tools / tool).symlink_to(shutil.which(tool))
    proc = subprocess.run(["/bin/bash", str(ROOT / "scripts" / "setup_env.sh")], capture_output=True, text=True,
                          env={"PATH": str(tools), "PYTHON": str(python)}, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    installs = [c for c in log.read_text().splitlines() if c.startswith("-m pip install")]
    assert len(installs) == 3  # torch, bitsandbytes and the build tools, bnb-mps with its extras
    assert all("-c constraints.txt" in c for c in installs), installs
    assert any(" bitsandbytes " in c for c in installs) and any("-e .[test,e2e]" in c for c in installs)


def test_mac_acceptance_installs_with_the_constraints():
    """Every install that resolves packages from an index (not pip itself, not the dry run's
    --no-deps install of the checkout) takes constraints.txt."""
    text = (ROOT / "scripts" / "mac_acceptance.sh").read_text()
    installs = [line for line in text.splitlines() if "pip install" in line and not line.lstrip().startswith("#")]
    resolving = [line for line in installs if "--upgrade pip" not in line and "--no-deps" not in line]
    assert len(resolving) == 2 and all('-c "$REPO/constraints.txt"' in line for line in resolving), resolving
