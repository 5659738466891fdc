"""The Metal-on-CPU emulator: runs the project's `.metal` kernels on the CPU, in CI.

    lib = bnb_mps.emulator.load(msl_text_or_path)
    lib.launch("my_kernel", grid=(4,), threadgroup=(64,), args=[x, y, uint32(n)],
               order="random", race_check=True, poison=0x00)
    print(lib.profile("my_kernel", grid=(4,), threadgroup=(64,), args=[x, y, uint32(n)]))

Kernel text is compiled as C++ against shim Metal headers (csrc/emu/include) and run with one
fiber per simulated thread; see docs/emulator.md (how simdgroup_matrix is modelled, what it
costs and why) and `Library.launch`.
`Library.profile` runs a kernel in an instrumented build and reports its memory traffic
(bnb_mps.emulator.profile). `Library(source, metal_version="3.2")` compiles at another Metal
language version; `launch(..., coherence_check=True)` fails a read of what another threadgroup of
the dispatch wrote unless that version's memory model makes it visible (CoherenceError).
"""

from .build import find_compiler
from .errors import (
    BarrierDivergence,
    CoherenceError,
    CompileError,
    DivergentCollective,
    EmulatorError,
    KernelError,
    LimitExceeded,
    MemoryFault,
    OutOfBounds,
    RaceDetected,
    StackOverflow,
    UnboundBuffer,
)
from .harness import NondeterministicOutput, run_checked
from .library import METAL_VERSIONS, Library, load
from .profile import LINE_BYTES, BufferTraffic, Estimate, KernelProfile, summarize
from .prepass import PrepassError, translate

__all__ = [
    "BarrierDivergence", "BufferTraffic", "CoherenceError", "CompileError", "DivergentCollective", "EmulatorError", "Estimate",
    "KernelError", "KernelProfile", "LINE_BYTES", "LimitExceeded", "Library", "MemoryFault", "NondeterministicOutput", "OutOfBounds", "PrepassError", "RaceDetected", "StackOverflow", "UnboundBuffer",
    "METAL_VERSIONS", "find_compiler", "load", "run_checked", "summarize", "translate",
]
