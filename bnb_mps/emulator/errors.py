"""Exceptions raised by the emulator. Every message names the kernel; faults in a simulated
thread also name its threadgroup and thread positions and, where known, the `.metal` file:line."""

from __future__ import annotations


class EmulatorError(RuntimeError):
    """Base class of every emulator fault."""

    kind = 0

    def __init__(self, message: str, *, kernel: str | None = None, where: str | None = None) -> None:
        super().__init__(message)
        self.kernel = kernel
        self.where = where or None


class OutOfBounds(EmulatorError):
    """A simulated thread read or wrote past the end of a bound buffer (or, when race checking,
    outside a threadgroup array)."""

    kind = 1


class RaceDetected(EmulatorError):
    """Two threads of a threadgroup accessed the same threadgroup memory without a barrier."""

    kind = 2


class BarrierDivergence(EmulatorError):
    """Threads of a threadgroup reached different barriers, or some exited while others waited."""

    kind = 3


class DivergentCollective(EmulatorError):
    """A SIMD-group function was reached in divergent control flow."""

    kind = 4


class LimitExceeded(EmulatorError):
    """A Metal limit was exceeded (threads per threadgroup, threadgroup memory)."""

    kind = 5


class UnboundBuffer(EmulatorError):
    """A kernel parameter [[buffer(i)]] has no argument bound."""

    kind = 6


class MemoryFault(EmulatorError):
    """A simulated thread accessed invalid memory (not next to a bound buffer)."""

    kind = 7


class StackOverflow(MemoryFault):
    """A simulated thread overflowed its fiber stack."""

    kind = 8


class KernelError(EmulatorError):
    """Anything else that stopped a dispatch (unknown kernel, resources)."""

    kind = 9


class CoherenceError(EmulatorError):
    """A threadgroup read device memory that another threadgroup of the same dispatch wrote, where
    the Metal language version the kernel was compiled at does not make that write visible: below
    Metal 3.2 never (an atomic's own value aside); from 3.2 only in a coherent(device) buffer, with a
    device-scope release fence after the write in the writing thread, ordered before an atomic write
    whose value the reading threadgroup observed, and a device-scope acquire fence in the reading
    thread after that observation (docs/emulator.md, "Memory model"). The message names the buffer,
    the byte offset and both threadgroups."""

    kind = 10


class CompileError(EmulatorError):
    """The kernel source did not compile as C++ against the emulator's shim headers."""


BY_KIND = {cls.kind: cls for cls in (OutOfBounds, RaceDetected, BarrierDivergence, DivergentCollective,
                                     LimitExceeded, UnboundBuffer, MemoryFault, StackOverflow, KernelError,
                                     CoherenceError)}
