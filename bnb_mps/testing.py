"""Test helpers: run bitsandbytes' own Python API on CPU tensors through bnb_mps' kernel code.

    with bnb_mps.testing.use_emulated_kernels() as kernels:
        q, state = bitsandbytes.functional.quantize_4bit(torch.randn(64, 64))
    assert kernels.launched  # the Metal kernels ran, under the emulator

The emulated tier is registered for the `cpu` dispatch key (ops that have a Metal kernel only),
and bitsandbytes' own CPU kernels are restored on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Optional

from dataclasses import dataclass
from typing import Union

from .executors.base import Dim3, Executor, KernelArg
from .kernel_args import Scalar
from .modelled_mps import ModelledDeadlock, ModelledMPS, use_modelled_mps  # noqa: F401  (public here)


@dataclass(frozen=True)
class BoundTensor:
    """What a launch bound for one tensor argument (the tensor itself is not kept alive)."""

    shape: tuple[int, ...]
    dtype: object
    device: str
    byte_offset: int  # storage_offset * element_size: where the kernel's buffer starts
    nbytes: int
    contiguous: bool


def describe_arg(arg: KernelArg) -> Union[BoundTensor, Scalar]:
    if isinstance(arg, Scalar):
        return arg
    return BoundTensor(tuple(arg.shape), arg.dtype, arg.device.type, arg.storage_offset() * arg.element_size(),
                       arg.numel() * arg.element_size(), arg.is_contiguous())


class RecordingExecutor:
    """Forwards launches to `inner` (if any) and records them: (kernel, grid, threadgroup, args),
    with tensor arguments recorded as `BoundTensor` descriptions, so that recording hundreds of
    launches keeps no tensor alive.

    With `profile=True`, each launch runs through `inner.profile` instead (the emulated executor:
    same effect on the tensors, plus the kernel's memory traffic), and `profiles` holds one
    bnb_mps.emulator.KernelProfile per launch, in the order of `launches`."""

    def __init__(self, inner: Optional[Executor] = None, name: str = "recording", *, profile: bool = False):
        if profile and not callable(getattr(inner, "profile", None)):
            raise TypeError(f"profile=True needs an executor that can profile (the emulated one), got {inner!r}")
        self.inner = inner
        self.name = inner.name if inner is not None else name
        self.profile = profile
        self.launches: list[tuple[str, Dim3, Dim3, list[Union[BoundTensor, Scalar]]]] = []
        self.profiles: list = []

    @property
    def launched(self) -> list[str]:
        return [k for k, *_ in self.launches]

    def clear(self) -> None:
        """Forgets the launches (and profiles) recorded so far."""
        self.launches.clear()
        self.profiles.clear()

    def launch(self, kernel: str, *, grid: Dim3, threadgroup: Dim3, args: Sequence[KernelArg]) -> None:
        self.launches.append((kernel, tuple(grid), tuple(threadgroup), [describe_arg(a) for a in args]))
        if self.profile:
            self.profiles.append(self.inner.profile(kernel, grid=grid, threadgroup=threadgroup, args=args))
        elif self.inner is not None:
            self.inner.launch(kernel, grid=grid, threadgroup=threadgroup, args=args)


@contextlib.contextmanager
def use_emulated_kernels(*, profile: bool = False, **settings) -> Iterator[RecordingExecutor]:
    """Serve bitsandbytes ops on CPU tensors with bnb_mps' Metal kernels under the emulator.

    `settings` (order, race_check, poison, seed, float_mode, metal_version, coherence_check) go to
    the emulated executor for the duration: `metal_version="3.2"` compiles the kernels at Metal 3.2
    (the op layer then routes as for a tier at that version), `coherence_check=True` runs every
    launch under the emulator's memory-model check (bnb_mps.emulator.CoherenceError).
    Yields a RecordingExecutor whose `launched` lists the kernels that ran. With `profile=True`
    every launch is profiled (bnb_mps.emulator.Library.profile) and the recorder's `profiles`
    holds each launch's memory traffic. Not re-entrant.

        with use_emulated_kernels(profile=True) as kernels:
            torch.ops.bitsandbytes.quantize_4bit(A, 64, "nf4", torch.uint8)
        print(kernels.profiles[0])
    """
    from . import ops, registration
    from .executors import emulated, load_tier

    names = [name for name, op in ops.OPS.items() if op.kernel is not None]
    recorder = RecordingExecutor(load_tier("emulated"), profile=profile)
    with emulated.settings(**settings) if settings else contextlib.nullcontext():
        if "CPU" in registration.registered_keys():
            raise RuntimeError("use_emulated_kernels() is already active")
        registration.register("CPU", executor=recorder, names=names)
        try:
            yield recorder
        finally:
            registration.unregister("CPU")


@contextlib.contextmanager
def fixed_timings(times: dict[str, float]) -> Iterator[None]:
    """Under it, tuning's measurement (bnb_mps.ops.tuning) returns `times[route]` seconds for each
    candidate route instead of timing it, so that a test on any machine drives every decision. Each
    candidate still runs once on the fresh inputs (a route that raises is dropped, as when timed); a
    candidate missing from `times` counts as slower than every one named.

    Every shape key met under it is decided from `times` afresh: this process's earlier choices and
    the disk cache are not read (the decisions made are written to the cache as usual). Where
    BNB_MPS_TUNE is not set, tuning is on under it on every tier, the emulated one included. The op
    layer's kept callables are dropped on entry and exit, so no call is served by a choice of before.

        with fixed_timings({"mma": 2e-3, "dequantize+linear": 1e-3}):
            y = torch.ops.bitsandbytes.gemm_4bit(A, B, [N, K], absmax, 64, "nf4")   # dequantize+linear
    """
    from .ops import tuning

    with tuning.fixed(times):
        yield


class AllocationCounter:
    """Counts the tensor storages that PyTorch ops create while it is active (views, in-place
    updates and kernel launches create none), e.g. to check that an op allocates nothing beyond
    its outputs. Works on every device, `meta` included.

        with AllocationCounter() as alloc:
            out = torch.ops.bitsandbytes.gemm_4bit(...)
        assert alloc.bytes == out.numel() * out.element_size()

    `allocations` lists (op name, bytes) for each new storage.
    """

    def __init__(self) -> None:
        self.allocations: list[tuple[str, int]] = []
        self._mode = None

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.allocations)

    @property
    def count(self) -> int:
        return len(self.allocations)

    def __enter__(self) -> "AllocationCounter":
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        counter = self
        seen: set[int] = set()

        def storages(tree) -> set[int]:
            return {t.untyped_storage()._cdata for t in tree_leaves(tree) if isinstance(t, torch.Tensor)}

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                inputs = storages((args, kwargs))
                for t in tree_leaves(out):
                    if not isinstance(t, torch.Tensor):
                        continue
                    storage = t.untyped_storage()
                    if storage._cdata in inputs or storage._cdata in seen:
                        continue
                    seen.add(storage._cdata)
                    counter.allocations.append((str(func), storage.nbytes()))
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self._mode = None
