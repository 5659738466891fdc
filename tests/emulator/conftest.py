"""Fixtures for the emulator tests: the compilers to build kernels with (g++ and, where one
with _Float16 is installed, clang++)."""

from __future__ import annotations

import pytest

from bnb_mps.emulator import EmulatorError  # noqa: E402
from bnb_mps.emulator.library import _runtime  # noqa: E402

try:
    _runtime()
except EmulatorError as e:  # the extension is not built here
    pytest.skip(str(e), allow_module_level=True)

from emu_support import available_compilers  # noqa: E402

COMPILERS = available_compilers()


@pytest.fixture(scope="session", params=COMPILERS)
def compiler(request) -> str:
    return request.param
