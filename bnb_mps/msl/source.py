"""The project's Metal kernel source: its compile units, and all of it as one text.

Kernels live in `csrc/kernels/`: `*.h` headers hold templated kernel bodies, `*.metal` files
instantiate them. Metal's runtime compiler (`newLibraryWithSource`, `torch.mps.compile_shader`)
cannot resolve local includes, so sources are handed to it with their local `#include "..."`
lines inlined, each piece preceded by a `#line` directive so that compiler errors and emulator
reports name the original file and line.

- `units()`: every executor tier compiles each `.metal` file (with its includes inlined) as a compile
  unit of its own, named after the file (`quantize_8bit`, `quantize_4bit`, `gemm_4bit`, `int8`,
  `optimizer`), and looks each kernel up in the unit that defines it. A unit that does not compile
  takes only its own kernels out of service (bnb_mps.executors.base.KernelUnavailable), not the tier.
- `source()`: the amalgamation, all `.metal` files in name order with each header inlined once: one
  text for what wants one (the source hash, the native library's embedded copy and its offline
  metallib, tools).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

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


def _ascii(text: str, what: str) -> str:
    if not text.isascii():
        raise ValueError(f"{what} must be ASCII (torch.mps.compile_shader requires it)")
    return text


def amalgamate(directory: Path | str | None = None, *, line_directives: bool = True) -> str:
    """All kernels of `directory` (default: the project's) as one ASCII MSL source string."""
    directory = Path(directory) if directory is not None else kernel_dir()
    seen: set[Path] = set()
    lines: list[str] = []
    for path in sorted(directory.glob("*.metal")):
        seen.add(path.resolve())
        lines.extend(_inline(path, seen, line_directives))
    return _ascii("\n".join(lines) + "\n", "kernel source")


def unit_text(path: Path | str, *, line_directives: bool = True) -> str:
    """One compile unit: the `.metal` file at `path` with its local includes inlined (each header
    once), as ASCII MSL source."""
    path = Path(path)
    lines = _inline(path, {path.resolve()}, line_directives)
    return _ascii("\n".join(lines) + "\n", f"kernel source {path.name}")


def split_units(directory: Path | str | None = None, *, line_directives: bool = True) -> dict[str, str]:
    """The compile units of `directory` (default: the project's): {name: text} for each `.metal`
    file in name order, the name being the file's stem."""
    directory = Path(directory) if directory is not None else kernel_dir()
    return {path.stem: unit_text(path, line_directives=line_directives) for path in sorted(directory.glob("*.metal"))}


def source() -> str:
    """The kernel amalgamation of `kernel_dir()` (the packaged kernels, or $BNB_MPS_KERNEL_DIR's),
    read once per directory per process."""
    return _source_of(kernel_dir())


@functools.cache
def _source_of(directory: Path) -> str:
    return amalgamate(directory)


def units() -> Mapping[str, str]:
    """The compile units of `kernel_dir()`, {name: text} in name order (read-only), read once per
    directory per process: the same object until $BNB_MPS_KERNEL_DIR names another directory."""
    return _units_of(kernel_dir())


@functools.cache
def _units_of(directory: Path) -> Mapping[str, str]:
    return MappingProxyType(split_units(directory))


# What a unit's text says about the kernels it defines, without compiling it: the host names of
# its instantiations as far as they are literal ("bnb_quantize_4bit_" of
# BNB_KERNEL_INSTANTIATE("bnb_quantize_4bit_" #qname ...)), and the names of its kernel functions.
_KERNEL_NAMES = re.compile(r'(?:BNB_KERNEL_INSTANTIATE|host_name)\s*\(\s*"([^"]*)"|'
                           r'(?:\[\[\s*kernel\s*\]\]|\bkernel)\s+void\s+(\w+)')


@functools.lru_cache(maxsize=64)
def kernel_name_prefixes(text: str) -> frozenset[str]:
    """Prefixes of the kernel names a unit's source text defines (comments ignored): a failed unit's
    kernels cannot be listed by a compiler, so a kernel is attributed to the failed unit whose text
    names it most specifically (`bnb_mps.executors.base.CompileUnits`)."""
    from .text import strip_comments

    return frozenset(a or b for a, b in _KERNEL_NAMES.findall(strip_comments(text)) if a or b)


def source_hash(text: str | None = None) -> str:
    """A short digest of the kernel source (`source()` by default): what a compiled kernel, or a
    verification verdict, was made from. The amalgamation holds every `.metal` file and every header
    they include, so the digest changes whenever any file that a unit compiles changes."""
    return hashlib.sha256((source() if text is None else text).encode()).hexdigest()[:16]
