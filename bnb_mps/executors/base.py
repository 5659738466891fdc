"""The one interface every kernel executor offers.

An executor runs a named kernel from `csrc/kernels/*.metal` over a grid of threadgroups with
positional arguments bound to `[[buffer(0)]]`, `[[buffer(1)]]`, ... in order. Tensors bind as
device buffers (at their storage offset); `bnb_mps.kernel_args.Scalar` values bind as
`constant T&`. Executors know nothing of bitsandbytes; the op layer knows nothing of Metal.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, Union

import torch

from ..kernel_args import Scalar

KernelArg = Union[torch.Tensor, Scalar]
Dim3 = tuple[int, int, int]


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


# Each tier module (`native`, `shader`, `emulated`) exposes `load() -> Executor`, which either
# returns a ready executor (compiled library, warm pipeline cache) or raises ExecutorUnavailable.
# `bnb_mps.executors` calls it lazily, once per process, and picks the best tier that loads.
