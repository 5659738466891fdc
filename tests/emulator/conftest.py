"""Fixtures for the emulator tests: the compilers to build kernels with (g++ and, where one
with _Float16 is installed, clang++)."""

from __future__ import annotations

import pytest

pytest.importorskip("bnb_mps._emu", reason="emulator runtime not built (pip install --no-build-isolation -e .)")

from emu_support import available_compilers  # noqa: E402

COMPILERS = available_compilers()


@pytest.fixture(scope="session", params=COMPILERS)
def compiler(request) -> str:
    return request.param
