"""`python -m bnb_mps.msl_lint [options] [paths...]`: every static check of Metal kernel source.

Runs the MSL lint (`bnb_mps.msl.lint`: constructs that compile as C++ under the emulator but are
not valid, or not allowed, MSL) and the address-space check (`bnb_mps.msl.address_space`: clang
compiles the kernels with Metal's address spaces as distinct types) over .metal/.h files or
directories (default: the project's `csrc/kernels/`). Prints `file:line: [rule] message` per
finding; exit status 1 if there is any, 2 for bad arguments.

Where no suitable clang exists the address-space check is skipped with a message on stderr (the
exit status then reflects the lint alone), unless --require-address-space is given.

Options:
  --no-address-space       run the lint only
  --require-address-space  a missing clang is an error (exit status 2)
"""

from __future__ import annotations

import sys
from pathlib import Path

from . import address_space, lint
from .lint import Finding


def run(paths: list[Path], address_space_check: str = "auto") -> tuple[list[Finding], str | None]:
    """(findings of both checks, the reason the address-space check was skipped or None).
    `address_space_check`: "auto" (skip without clang), "require" (raise), "off"."""
    findings = lint.lint_paths(paths)
    skipped = None
    if address_space_check == "off":
        skipped = "disabled (--no-address-space)"
    else:
        try:
            checked = address_space.check_paths(paths)
            # The lint's textual address-space rule and the compiler's overlap: one finding a line.
            seen = {(f.path, f.line) for f in checked if f.rule == address_space.RULE}
            findings = [f for f in findings if f.rule != "address-space" or (f.path, f.line) not in seen] + checked
        except address_space.CheckUnavailable as e:
            if address_space_check == "require":
                raise
            skipped = str(e)
    return sorted(set(findings), key=lambda f: (f.path, f.line, f.rule, f.message)), skipped


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__.strip())
        return 0
    mode = "auto"
    if "--no-address-space" in args:
        mode = "off"
    if "--require-address-space" in args:
        mode = "require"
    unknown = [a for a in args if a.startswith("--") and a not in ("--no-address-space", "--require-address-space")]
    if unknown:
        print(f"msl_lint: unknown option {unknown[0]} (see --help)", file=sys.stderr)
        return 2
    paths = [Path(a) for a in args if not a.startswith("--")] or [lint._default_dir()]
    missing = [p for p in paths if not p.exists()]
    if missing:
        print(f"msl_lint: no such file or directory: {', '.join(map(str, missing))}", file=sys.stderr)
        return 2
    try:
        findings, skipped = run(paths, mode)
    except address_space.CheckUnavailable as e:
        print(f"msl_lint: the address-space check cannot run: {e}", file=sys.stderr)
        return 2
    for f in findings:
        print(f)
    if skipped and mode != "off":
        print(f"msl_lint: address-space check skipped: {skipped}", file=sys.stderr)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
