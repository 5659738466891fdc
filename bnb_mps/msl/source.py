"""The project's Metal kernel source, as one translation unit.

Kernels live in `csrc/kernels/`: `*.h` headers hold templated kernel bodies, `*.metal` files
instantiate them. Metal's runtime compiler (`newLibraryWithSource`, `torch.mps.compile_shader`)
cannot resolve local includes, so every executor compiles the same amalgamation: all `.metal`
files in name order with their local `#include "..."` lines inlined once, each piece preceded by
a `#line` directive so that compiler errors and emulator reports name the original file and line.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from pathlib import Path

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


#: A directory of `.metal`/`.h` files that every tier compiles instead of the packaged kernels (a
#: kernel developer trying a change without reinstalling; tests planting faults).
KERNEL_DIR_ENV = "BNB_MPS_KERNEL_DIR"


def kernel_dir() -> Path:
    """Where the `.metal` files are: $BNB_MPS_KERNEL_DIR when set, else inside an installed wheel,
    else in the source checkout."""
    return _kernel_dir(os.environ.get(KERNEL_DIR_ENV, "").strip())


@functools.cache
def _kernel_dir(override: str) -> Path:
    if override:
        path = Path(override).expanduser()
        if not path.is_dir() or not any(path.glob("*.metal")):
            raise FileNotFoundError(f"{KERNEL_DIR_ENV}={override!r} is not a directory holding .metal files")
        return path.resolve()
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / "kernels", package.parent / "csrc" / "kernels"):
        if candidate.is_dir() and any(candidate.glob("*.metal")):
            return candidate
    raise FileNotFoundError(
        f"bnb_mps kernel sources not found (looked in {package / 'kernels'} and {package.parent / 'csrc' / 'kernels'})"
    )


def _inline(path: Path, seen: set[Path], line_directives: bool) -> list[str]:
    out = [f'#line 1 "{path.name}"'] if line_directives else []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip() == "#pragma once":  # each header is inlined once; Metal would warn in a main file
            out.append("")
            continue
        m = _INCLUDE.match(line)
        if m is None:
            out.append(line)
            continue
        target = (path.parent / m.group(1)).resolve()
        if not target.is_file():
            raise FileNotFoundError(f"{path.name}:{lineno}: included file {m.group(1)!r} not found")
        if target not in seen:
            seen.add(target)
            out.extend(_inline(target, seen, line_directives))
        if line_directives:
            out.append(f'#line {lineno + 1} "{path.name}"')
        else:
            out.append("")
    return out


def amalgamate(directory: Path | str | None = None, *, line_directives: bool = True) -> str:
    """All kernels of `directory` (default: the project's) as one ASCII MSL source string."""
    directory = Path(directory) if directory is not None else kernel_dir()
    seen: set[Path] = set()
    lines: list[str] = []
    for path in sorted(directory.glob("*.metal")):
        seen.add(path.resolve())
        lines.extend(_inline(path, seen, line_directives))
    text = "\n".join(lines) + "\n"
    if not text.isascii():
        raise ValueError("kernel source must be ASCII (torch.mps.compile_shader requires it)")
    return text


def source() -> str:
    """The kernel amalgamation of `kernel_dir()` (the packaged kernels, or $BNB_MPS_KERNEL_DIR's),
    read once per directory per process."""
    return _source_of(kernel_dir())


@functools.cache
def _source_of(directory: Path) -> str:
    return amalgamate(directory)


def source_hash(text: str | None = None) -> str:
    """A short digest of the kernel source (`source()` by default): what a compiled kernel, or a
    verification verdict, was made from."""
    return hashlib.sha256((source() if text is None else text).encode()).hexdigest()[:16]
