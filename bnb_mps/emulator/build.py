"""Compiling translated kernel source into a kernel module (a shared object), with a disk cache.

The compiler is the `compiler` argument, else BNB_MPS_EMU_CXX, else c++ / g++ / clang++ from
PATH. Kernels are built as C++17 with -O2, IEEE float (no fast-math, no FMA contraction) so that
results are reproducible, and -Werror=vla. BNB_MPS_EMU_CXXFLAGS adds flags (the sanitizer script
uses it). Modules are cached under $BNB_MPS_CACHE_DIR/emu (default ~/.cache/bnb_mps/emu), keyed
by the source, the shim headers, the compiler and the flags; writes go to a temporary file that
is renamed into place, so concurrent test processes share the cache safely.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from .errors import CompileError

ABI_VERSION = 3  # must match BNB_EMU_ABI_VERSION in csrc/emu/include/bnb_emu/abi.h


def include_dir() -> Path:
    """The shim headers: inside an installed wheel, or in the source checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "include", here.parents[1] / "csrc" / "emu" / "include"):
        if (candidate / "bnb_emu" / "prelude.h").is_file():
            return candidate
    raise FileNotFoundError(f"emulator shim headers not found (looked in {here / 'include'} and the source checkout)")


def cache_dir() -> Path:
    root = os.environ.get("BNB_MPS_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "bnb_mps"
    d = base / "emu"
    d.mkdir(parents=True, exist_ok=True)
    return d


def find_compiler(compiler: str | None = None) -> str:
    """Path of the C++ compiler to use: `compiler`, else BNB_MPS_EMU_CXX, else c++/g++/clang++."""
    wanted = compiler or os.environ.get("BNB_MPS_EMU_CXX")
    candidates = [wanted] if wanted else ["c++", "g++", "clang++"]
    for c in candidates:
        path = shutil.which(c)
        if path:
            return path
    raise CompileError(f"no C++ compiler found (tried {', '.join(candidates)}); set BNB_MPS_EMU_CXX")


@functools.lru_cache(maxsize=None)
def compiler_identity(path: str) -> str:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise CompileError(f"cannot run the C++ compiler {path}: {e}") from None
    return out.strip()


def is_clang(path: str) -> bool:
    return "clang" in compiler_identity(path).lower()


def flags(path: str, race_check: bool) -> list[str]:
    f = [
        "-std=c++17", "-O2", "-g1", "-fPIC", "-shared",
        "-fvisibility=hidden", "-fvisibility-inlines-hidden",
        "-fno-fast-math", "-ffp-contract=off", "-fno-strict-aliasing",
        "-Werror=vla", "-Wno-attributes",
        # Probe every page of a large stack frame, so that overflowing a fiber stack hits its
        # guard page instead of another simulated thread's stack.
        "-fstack-clash-protection",
    ]
    if is_clang(path):
        f += ["-Wno-unknown-attributes", "-Wno-ignored-attributes", "-Wno-duplicate-decl-specifier",
              "-Wno-gnu-anonymous-struct", "-Wno-nested-anon-types", "-Wno-unused-command-line-argument"]
    else:
        f += ["-fno-gnu-unique"]
    if race_check:
        f.append("-DBNB_EMU_RACE_CHECK=1")
    f += shlex.split(os.environ.get("BNB_MPS_EMU_CXXFLAGS", ""))
    return f


def _headers_digest(inc: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(inc.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(inc)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def build(cpp: str, *, compiler: str | None = None, race_check: bool = False, name: str = "kernel") -> Path:
    """Compiles translated source into a kernel module; returns the cached shared object."""
    cxx = find_compiler(compiler)
    inc = include_dir()
    fl = flags(cxx, race_check)
    key = hashlib.sha256(
        "\0".join([str(ABI_VERSION), cpp, _headers_digest(inc), cxx, compiler_identity(cxx), " ".join(fl)]).encode()
    ).hexdigest()[:32]
    out = cache_dir() / f"{key}.so"
    if out.is_file():
        return out
    with tempfile.TemporaryDirectory(prefix="bnb_emu_", dir=cache_dir()) as tmp:
        src = Path(tmp) / "kernels.cpp"
        src.write_text(cpp)
        so = Path(tmp) / "kernels.so"
        cmd = [cxx, *fl, "-I", str(inc), "-include", "bnb_emu/prelude.h", "-x", "c++", str(src), "-o", str(so)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            lines = (proc.stderr or proc.stdout).splitlines()
            shown = "\n".join(lines[:60]) + ("\n..." if len(lines) > 60 else "")
            raise CompileError(f"{name}: compiling kernels for the emulator failed ({Path(cxx).name}):\n{shown}")
        os.replace(so, out)
        try:  # keep the translated source next to the module, for debugging
            os.replace(src, out.with_suffix(".cpp"))
        except OSError:
            pass
    return out
