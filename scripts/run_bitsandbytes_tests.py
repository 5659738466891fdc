"""Run bitsandbytes' own test suite on bnb-mps' kernels under the emulator, on any machine.

    python scripts/run_bitsandbytes_tests.py PATH_TO_BITSANDBYTES_TESTS [pytest arguments]
    python scripts/run_bitsandbytes_tests.py ~/src/bitsandbytes/tests -k "test_gemv_4bit" -q

PATH is the `tests` directory of a bitsandbytes source tree of the installed version, or a test file
or test id in it (bnb-mps ships none of it and downloads nothing). The tests run with
BNB_TEST_DEVICE=cpu and the pytest plugin bnb_mps.testing_plugin, which serves every bitsandbytes op on
CPU tensors with bnb-mps' Metal kernels under the emulator, and prints at the end which kernels ran and
which tests passed without any (docs/bitsandbytes_tests.md). Without a -m among the arguments, the
selection is bitsandbytes' default (`-m "not slow and not benchmark and not deprecated"`). The exit
status is pytest's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

#: the tests bitsandbytes' pyproject.toml runs by default
DEFAULT_MARKS = "not slow and not benchmark and not deprecated"

USAGE = "usage: run_bitsandbytes_tests.py PATH_TO_BITSANDBYTES_TESTS [pytest arguments]"


def pytest_arguments(argv: list[str]) -> list[str]:
    """pytest's arguments for `argv` (PATH, then pytest's own); ValueError for a PATH that is not a
    bitsandbytes tests directory."""
    if not argv or argv[0] in ("-h", "--help"):
        raise ValueError(USAGE)
    target = argv[0]
    path = Path(target.split("::")[0]).expanduser()
    tests_dir = path.parent if path.is_file() else path
    if not tests_dir.is_dir():
        raise ValueError(f"PATH_TO_BITSANDBYTES_TESTS must be a directory (or a test file in it), got {target!r}"
                         f"\n{USAGE}")  # fmt: skip
    if not (tests_dir / "helpers.py").is_file():
        raise ValueError(f"{str(tests_dir)!r} is not bitsandbytes' tests directory (it has no helpers.py, which "
                         f"chooses the test devices from BNB_TEST_DEVICE)\n{USAGE}")  # fmt: skip
    rest = argv[1:]
    # bitsandbytes' own default selection (its pyproject.toml's addopts), unless the caller chose one
    marks = [] if any(a == "-m" or a.startswith("-m") and len(a) > 2 and not a.startswith("--") for a in rest) \
        else ["-m", DEFAULT_MARKS]
    # (no cache directory written into the caller's bitsandbytes tree)
    return ["-p", "bnb_mps.testing_plugin", "-p", "no:cacheprovider", *marks, target, *rest]


def main(argv: list[str] | None = None) -> int:
    try:
        args = pytest_arguments(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    os.environ["BNB_TEST_DEVICE"] = "cpu"
    import pytest

    return int(pytest.main(args))


if __name__ == "__main__":
    sys.exit(main())
