"""The one interface every kernel executor offers.

An executor runs a named kernel from `csrc/kernels/*.metal` over a grid of threadgroups with
positional arguments bound to `[[buffer(0)]]`, `[[buffer(1)]]`, ... in order. Tensors bind as
device buffers (at their storage offset); `bnb_mps.kernel_args.Scalar` values bind as
`constant T&`. Executors know nothing of bitsandbytes; the op layer knows nothing of Metal.

Every tier compiles each compile unit of the kernel source (`bnb_mps.msl.source.units()`: one per
`.metal` file) separately (`CompileUnits`): a unit that does not compile makes only its own kernels
unavailable (their launches raise `KernelUnavailable`), and the tier is unavailable only when no
unit compiles.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, Union

import torch

from ..kernel_args import Scalar

KernelArg = Union[torch.Tensor, Scalar]
Dim3 = tuple[int, int, int]


def first_lines(text: object, n: int = 20) -> str:
    """The first `n` lines of an error message (compiler logs can be very long)."""
    lines = str(text).strip().splitlines()
    if len(lines) <= n:
        return "\n".join(lines)
    return "\n".join(lines[:n] + [f"... ({len(lines) - n} more lines)"])



class Executor(Protocol):
    #: "native", "shader" or "emulated"
    name: str

    def launch(
        self,
        kernel: str,
        *,
        grid: Dim3,
        threadgroup: Dim3,
        args: Sequence[KernelArg],
    ) -> None:
        """Encode `kernel` over `grid` threadgroups of `threadgroup` threads each.

        Asynchronous on the GPU tiers (work is encoded on PyTorch's current MPS stream); the
        emulated tier runs it before returning. Never synchronises the host.
        """
        ...

    # Optional, offered by the GPU tiers:
    #
    #   def prepare(self, kernel: str, grid: Dim3, threadgroup: Dim3) -> Callable[[Sequence[KernelArg]], None]
    #
    # (its one parameter named `args`, as `launch`'s)
    #
    # The same launch as a function of its arguments, with what depends only on the kernel and the
    # geometry (their checks, the kernel's lookup, its pipeline limit) done once, here: the op layer
    # keeps it with a launch plan (bnb_mps.ops.plan) and calls it for every call the plan serves.
    #
    #   def watch_command_buffers(self) -> Optional[watch]   (the native tier)
    #
    # A watch of the GPU's command buffers (first-use verification, bnb_mps.ops.verify): a launch
    # given it, `launch(..., watch=watch)`, has the command buffer that holds it watched; after a
    # synchronisation its `errors()` returns the error text of every watched buffer the device failed
    # to run, and then its `gpu_times()` the (start, end) GPU times of each, in seconds.


class ExecutorUnavailable(RuntimeError):
    """Raised by a tier's `load()` when it cannot serve kernels here; the message is the reason
    shown to the user (e.g. "native library not built: run `pip install -e .` on macOS")."""


class PipelineLimitError(RuntimeError):
    """Raised by a GPU tier's `launch()`, before anything is encoded, when the threadgroup asks for
    more threads than the kernel's compiled pipeline allows on this GPU (Metal's
    maxTotalThreadsPerThreadgroup, which register pressure can bring below 1024, per kernel and GPU).
    The launch did nothing; the op layer routes the op elsewhere (`bnb_mps.ops.routing`)."""

    def __init__(self, kernel: str, threads: int, maximum: int) -> None:
        super().__init__(kernel, threads, maximum)
        self.kernel = kernel
        self.threads = threads  # threads per threadgroup the launch asked for
        self.maximum = maximum  # the pipeline's maxTotalThreadsPerThreadgroup

    def __str__(self) -> str:
        return (f"kernel {self.kernel}: its pipeline allows at most {self.maximum} threads per threadgroup, the "
                f"launch asks for {self.threads}")


def _headline(message: str) -> str:
    """The line of a compiler log that says what is wrong: its first error line, else its first line."""
    lines = [line.strip() for line in str(message).strip().splitlines() if line.strip()]
    for line in lines:
        if "error:" in line.lower():  # a diagnostic: "file:line:col: error: what"
            return line
    return lines[0] if lines else "no message"


class KernelUnavailable(RuntimeError):
    """Raised by an executor's `launch()`, before anything is encoded, when the kernel's compile unit
    (the `.metal` file that defines it, `bnb_mps.msl.source.units()`) did not compile on this tier.
    The other units' kernels still run. The first line of the message names the kernel, the unit and
    the compiler's first error line (what first-use verification records as the family's failure);
    the lines after it are the first lines of the compiler's message."""

    def __init__(self, kernel: str, units: Sequence[str], messages: Mapping[str, str]) -> None:
        super().__init__(kernel, tuple(units))
        self.kernel = kernel
        self.units = tuple(units)  # the failed unit that defines it (several when the text cannot tell)
        self.unit = " or ".join(self.units)
        self.messages = {u: first_lines(messages[u]) for u in self.units}  # unit -> first lines of its log
        self.message = "\n".join(self.messages.values())

    def __str__(self) -> str:
        files = ", ".join(f"{u}.metal" for u in self.units)
        if len(self.units) == 1:
            head = f"kernel {self.kernel!r} is unavailable: its compile unit {files} did not compile"
        else:
            head = (f"kernel {self.kernel!r} is unavailable: it is in none of the compile units that compiled, "
                    f"and {files} did not compile")
        first = self.units[0]
        return f"{head}: {_headline(self.messages[first])}\n" + "\n".join(
            f"[{u}.metal] {m}" for u, m in self.messages.items())


class CompileUnits:
    """A tier's kernels as compiled per compile unit: the library of each unit that compiled, which
    unit each kernel is in, and the compiler's message for each unit that did not.

    `library_of(kernel)` is the per-launch lookup (one dict lookup); a kernel in no compiled unit
    gets `unavailable(kernel)`: a KernelUnavailable naming the failed unit whose source names it
    most specifically (a failed unit cannot be asked for its kernels, so its text is read for
    their literal host-name prefixes), or None when every unit compiled (an unknown kernel: each
    tier raises its own error for that, as before)."""

    def __init__(self, libraries: Mapping[str, Any], kernels: Mapping[str, str], failures: Mapping[str, str],
                 sources: Mapping[str, str] | None = None, errors: Mapping[str, BaseException] | None = None) -> None:
        self.libraries = dict(libraries)  # unit -> compiled library
        self.unit_of = dict(kernels)  # kernel -> unit
        self.failures = dict(failures)  # unit -> the compiler's message
        self._sources = dict(sources or {})  # unit -> its text (to attribute a kernel to a failed unit)
        self._errors = dict(errors or {})  # unit -> the exception its compile raised (a KernelUnavailable's cause)

    @classmethod
    def compile(cls, sources: Mapping[str, str], compile: Callable[[str, str], Any],
                names: Callable[[Any], Iterable[str]], errors: tuple = (Exception,), *,
                workers: int = 1) -> "CompileUnits":
        """Compiles each unit with `compile(name, text)` (`workers` at a time); `names(library)` lists
        a compiled library's kernels. An exception of a type in `errors` fails that unit only, its
        message kept; the others propagate. A kernel defined by two units is looked up in the
        first (in name order)."""

        def one(item):
            unit, text = item
            try:
                return unit, compile(unit, text), None
            except errors as e:
                return unit, None, e

        items = list(sources.items())
        if workers > 1 and len(items) > 1:
            with ThreadPoolExecutor(min(workers, len(items))) as pool:
                results = list(pool.map(one, items))
        else:
            results = [one(item) for item in items]
        libraries, kernels, failures, raised = {}, {}, {}, {}
        for unit, library, error in results:
            if library is None:
                failures[unit] = f"{type(error).__name__}: {error}" if not str(error).strip() else str(error)
                raised[unit] = error
                continue
            libraries[unit] = library
            for kernel in names(library):
                kernels.setdefault(kernel, unit)
        return cls(libraries, kernels, failures, sources, raised)

    def library_of(self, kernel: str):
        """The library that holds `kernel`; KeyError when none does (see `unavailable`)."""
        return self.libraries[self.unit_of[kernel]]

    def unavailable(self, kernel: str) -> KernelUnavailable | None:
        """Why `kernel`, in no compiled unit, cannot run: KernelUnavailable when a unit failed, else None."""
        if not self.failures:
            return None
        from ..msl.source import kernel_name_prefixes

        best, candidates = 0, []
        for unit in self.failures:
            match = max((len(p) for p in kernel_name_prefixes(self._sources.get(unit, "")) if kernel.startswith(p)),
                        default=0)  # fmt: skip
            if match > best:
                best, candidates = match, [unit]
            elif match == best and match:
                candidates.append(unit)
        unavailable = KernelUnavailable(kernel, candidates or list(self.failures), self.failures)
        unavailable.__cause__ = self._errors.get(unavailable.units[0])  # (e.g. a compiler that could not run)
        return unavailable

    def kernels(self) -> list[str]:
        """Every kernel of the units that compiled, sorted."""
        return sorted(self.unit_of)

    def describe_failures(self) -> str:
        """The failed units with the first lines of their compiler messages."""
        return "\n".join(f"{unit}.metal: {first_lines(message)}" for unit, message in self.failures.items())


# Each tier module (`native`, `shader`, `emulated`) exposes `load() -> Executor`, which either
# returns a ready executor (compiled library, warm pipeline cache) or raises ExecutorUnavailable.
# `bnb_mps.executors` calls it lazily, once per process, and picks the best tier that loads.
