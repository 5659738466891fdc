"""What the test extras install, required: `require("transformers")` instead of
`pytest.importorskip("transformers")`.

A test that needs a package the test extras install (pyproject.toml's `test` and `e2e` extras,
scripts/setup_env.sh) skips where it is missing, as on a developer's machine without the extras; under
CI (CI=true) it fails instead, naming the package, so that a CI run never passes by skipping what it
was meant to run. Skips for what a CI machine cannot have (an Apple GPU, a native build) are plain
skips, not this.
"""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType

import pytest

#: the packages the test extras install and the tools scripts/setup_env.sh installs, which CI must have
EXTRAS = ("transformers", "peft", "accelerate", "matplotlib", "tqdm", "psutil", "hypothesis", "clang")


def under_ci() -> bool:
    """Whether this run is a CI run (CI=true, as CI services set it)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def missing(name: str, detail: str = "") -> None:
    """Skips the test (or the module, at import) because `name` is missing; under CI fails it instead."""
    what = f"{name} is not installed" + (f" ({detail})" if detail else "")
    if under_ci():
        pytest.fail(f"{what}: CI must install the test extras (bash scripts/setup_env.sh), so this test may "
                    f"not skip there", pytrace=False)  # fmt: skip
    raise pytest.skip.Exception(f"{what}; the test extras install it", allow_module_level=True)


def require(name: str) -> ModuleType:
    """The module `name` (e.g. "transformers"), imported; where it cannot be imported, `missing(name)`."""
    if name.split(".")[0] not in EXTRAS:
        raise ValueError(f"require({name!r}): not one of the test extras {EXTRAS}; use pytest.importorskip")
    try:
        return importlib.import_module(name)
    except ImportError as e:
        missing(name.split(".")[0], str(e).splitlines()[0] if str(e) else "")
        raise  # (missing() raised already)


def require_tool(name: str, *commands: str) -> str:
    """The path of the first of `commands` on PATH (a tool setup_env.sh installs, e.g. the package
    "clang" gives clang++); where none is, `missing(name)`."""
    if name not in EXTRAS:
        raise ValueError(f"require_tool({name!r}): not one of the test extras {EXTRAS}")
    for command in commands or (name,):
        path = shutil.which(command)
        if path:
            return path
    missing(name, f"none of {', '.join(commands or (name,))} on PATH")
    raise AssertionError("unreachable")


def profile_compiler() -> str:
    """The clang++ that builds the emulator's profiling modules (clang-16, which setup_env.sh installs);
    a missing one skips the test, and fails it under CI."""
    from bnb_mps import emulator
    from bnb_mps.emulator import build

    try:
        return build.find_profile_compiler()
    except emulator.CompileError as e:
        missing("clang++ for the emulator's profiler", str(e))
