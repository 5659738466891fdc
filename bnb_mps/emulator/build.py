"""Compiling translated kernel source into a kernel module (a shared object), with a disk cache.

The compiler is the `compiler` argument, else BNB_MPS_EMU_CXX, else c++ / g++ / clang++ from
PATH. Kernels are built as C++17 with -O2, IEEE float (no fast-math, no FMA contraction) so that
results are reproducible, and -Werror=vla; on an x86-64 CPU with F16C also with -mf16c
(`isa_flags`), which changes no result. BNB_MPS_EMU_CXXFLAGS adds flags (the sanitizer script uses
it; `-mno-f16c` there builds without F16C). Modules are cached under $BNB_MPS_CACHE_DIR/emu
(default ~/.cache/bnb_mps/emu), keyed by the source, the shim headers, the compiler and the flags;
writes go to a temporary file that is renamed into place, so concurrent test processes share the
cache safely.

Profiling modules (`Library.profile`) are a separate build: clang's
`-fsanitize-coverage=trace-loads,trace-stores` makes every load and store of the kernel code call
the module's hooks (bnb_emu/kernel.h), so the runtime sees each device access with its address
and width. Vectorisers and VectorCombine are off there, so that the accesses are those of the
source (a `uchar4` load one 4-byte access, four `uchar` loads four accesses), and so are the
memset/memcpy idioms (the instrumentation does not see those calls). The compiler is the
`compiler` argument if it is a clang that can do this, else BNB_MPS_EMU_PROFILE_CXX, else the
newest such clang++ on PATH; BNB_MPS_EMU_PROFILE_CXXFLAGS adds flags (BNB_MPS_EMU_CXXFLAGS does not
apply: its flags are for the default compiler). Plain launches keep using the uninstrumented module.
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

ABI_VERSION = 8  # must match BNB_EMU_ABI_VERSION in csrc/emu/include/bnb_emu/abi.h


def include_dir() -> Path:
    """The shim headers: inside an installed wheel, or in the source checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "include", here.parents[1] / "csrc" / "emu" / "include"):
        if (candidate / "bnb_emu" / "prelude.h").is_file():
            return candidate
    raise FileNotFoundError(f"emulator shim headers not found (looked in {here / 'include'} and the source checkout)")


def cache_dir() -> Path:
    """The module cache: `bnb_mps.json_cache.cache_root()`/emu, created."""
    from ..json_cache import cache_root

    d = cache_root() / "emu"
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


PROFILE_FLAGS = [
    "-DBNB_EMU_PROFILE=1",
    "-fsanitize-coverage=func,trace-loads,trace-stores",
    "-fno-vectorize", "-fno-slp-vectorize", "-mllvm", "-disable-vector-combine",
    "-fno-builtin-memset", "-fno-builtin-memcpy", "-fno-builtin-memmove",
]
#: clang++ names tried for profiling builds, newest first (_Float16 on x86-64 needs clang >= 15).
PROFILE_COMPILERS = ("clang++", *(f"clang++-{v}" for v in range(22, 14, -1)))


@functools.lru_cache(maxsize=None)
def can_profile(path: str) -> bool:
    """Whether `path` is a clang that builds profiling modules (trace-loads/stores, _Float16)."""
    if not is_clang(path):
        return False
    with tempfile.TemporaryDirectory(prefix="bnb_emu_probe_") as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_text("_Float16 f(const _Float16* p) { return p[0] * p[1]; }\n")
        cmd = [path, "-std=c++17", "-O2", *PROFILE_FLAGS, "-c", str(src), "-o", str(Path(tmp) / "probe.o")]
        try:
            return subprocess.run(cmd, capture_output=True, timeout=120).returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False


@functools.lru_cache(maxsize=None)
def can_find_profile_compiler() -> bool:
    """Whether `find_profile_compiler()` finds a clang that builds instrumented modules."""
    try:
        find_profile_compiler()
    except CompileError:
        return False
    return True


def find_profile_compiler(compiler: str | None = None) -> str:
    """Path of the clang++ that builds profiling modules: `compiler` if it can, else
    BNB_MPS_EMU_PROFILE_CXX, else the first of PROFILE_COMPILERS on PATH that can."""
    if compiler:
        path = shutil.which(compiler)
        if path and can_profile(path):
            return path
    wanted = os.environ.get("BNB_MPS_EMU_PROFILE_CXX")
    if wanted:
        path = shutil.which(wanted)
        if path and can_profile(path):
            return path
        raise CompileError(f"BNB_MPS_EMU_PROFILE_CXX={wanted} cannot build profiling modules (it must be a "
                           f"clang++ >= 15 with -fsanitize-coverage=trace-loads,trace-stores)")
    for c in PROFILE_COMPILERS:
        path = shutil.which(c)
        if path and can_profile(path):
            return path
    raise CompileError("profiling kernels needs clang++ >= 15 (-fsanitize-coverage=trace-loads,trace-stores "
                       "and _Float16), and none was found on PATH; install clang (e.g. apt-get install clang-16) "
                       "or set BNB_MPS_EMU_PROFILE_CXX")


@functools.lru_cache(maxsize=None)
def isa_flags(path: str) -> tuple[str, ...]:
    """Instruction-set flags for kernel modules on this machine that make them faster and change
    no result: `-mf16c` on an x86-64 CPU with F16C (as the compiler sees the host with
    -march=native). Without it, g++ and clang convert every `half` to and from float with a libgcc
    call (__extendhfsf2, __truncsfhf2) instead of one instruction (vcvtph2ps, vcvtps2ph), which made
    the half-precision kernels (the int8 products' simdgroup_matrix tiles) several times slower. The
    instructions give the same bits as the library functions for every one of the 65,536 halves
    and 2^32 floats, with and without the flushing float mode (checked exhaustively when this was
    introduced; tests/emulator/test_float_mode.py checks every half and a sample of floats). Nothing
    wider (AVX2, FMA, AVX-512) is enabled: AVX-512 FP16 would compute `half` arithmetic natively,
    rounding differently from the float arithmetic the emulator models."""
    try:
        out = subprocess.run([path, "-march=native", "-dM", "-E", "-x", "c++", os.devnull], capture_output=True,
                             text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    macros = set(line.split()[1] for line in out.splitlines() if line.startswith("#define "))
    if "__x86_64__" in macros and "__F16C__" in macros:
        return ("-mf16c",)
    return ()


def flags(path: str, race_check: bool, profile: bool = False, metal_version: int = 310) -> list[str]:
    f = [
        "-std=c++17", "-O2", "-g1", "-fPIC", "-shared",
        "-fvisibility=hidden", "-fvisibility-inlines-hidden",
        "-fno-fast-math", "-ffp-contract=off", "-fno-strict-aliasing",
        "-Werror=vla", "-Wno-attributes",
        # Probe every page of a large stack frame, so that overflowing a fiber stack hits its
        # guard page instead of another simulated thread's stack.
        "-fstack-clash-protection",
        *isa_flags(path),
    ]
    if is_clang(path):
        f += ["-Wno-unknown-attributes", "-Wno-ignored-attributes", "-Wno-duplicate-decl-specifier",
              "-Wno-gnu-anonymous-struct", "-Wno-nested-anon-types", "-Wno-unused-command-line-argument"]
    else:
        f += ["-fno-gnu-unique"]
    f.append(f"-D__METAL_VERSION__={int(metal_version)}")
    if race_check:
        f.append("-DBNB_EMU_RACE_CHECK=1")
    if profile:
        f += PROFILE_FLAGS
        f += shlex.split(os.environ.get("BNB_MPS_EMU_PROFILE_CXXFLAGS", ""))
    else:
        f += shlex.split(os.environ.get("BNB_MPS_EMU_CXXFLAGS", ""))
    return f


def _headers_digest(inc: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(inc.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(inc)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def build(cpp: str, *, compiler: str | None = None, race_check: bool = False, profile: bool = False,
          name: str = "kernel", metal_version: int = 310) -> Path:
    """Compiles translated source into a kernel module; returns the cached shared object.
    `profile`: the instrumented build that `Library.profile` and the coherence check run (needs clang,
    see above). `metal_version`: __METAL_VERSION__ (310, 320, 400)."""
    cxx = find_profile_compiler(compiler) if profile else find_compiler(compiler)
    inc = include_dir()
    fl = flags(cxx, race_check, profile, metal_version)
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
