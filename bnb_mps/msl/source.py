"""The project's Metal kernel source, as one translation unit.

Kernels live in `csrc/kernels/`: `*.h` headers hold templated kernel bodies, `*.metal` files
instantiate them. Metal's runtime compiler (`newLibraryWithSource`, `torch.mps.compile_shader`)
cannot resolve local includes, so every executor compiles the same amalgamation: all `.metal`
files in name order with their local `#include "..."` lines inlined once, each piece preceded by
a `#line` directive so that compiler errors and emulator reports name the original file and line.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


def kernel_dir() -> Path:
    """Where the `.metal` files are: inside an installed wheel, or in the source checkout."""
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


@functools.cache
def source() -> str:
    """The project's kernel amalgamation (cached for the process)."""
    return amalgamate()
