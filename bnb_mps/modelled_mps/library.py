"""The model of `torch.mps.compile_shader`'s library: its kernels execute, under the emulator.

As read in torch/csrc/mps/Module.cpp and aten/src/ATen/native/mps/MetalShaderLibrary.mm:
- `compile_shader(source)` compiles the source (a compile error raises SyntaxError) into a library
  whose `dir()` lists its kernel functions; an attribute that is no kernel raises RuntimeError
  ("Failed to create function state object for: ...");
- a kernel function reports its pipeline's `max_threads_per_threadgroup` and
  `thread_execution_width`; Metal's maxTotalThreadsPerThreadgroup depends on the kernel's register
  use and can be below 1024: the model gives `REGISTER_HEAVY_MAX_THREADS` to the kernels of a compile
  unit that uses simdgroup matrices (`modelled_max_threads`), 1024 to the others;
- calling it `fn(*args, threads=, group_size=, arg_casts=)` binds argument i to [[buffer(i)]]: a
  tensor as its storage's buffer at byte offset storage_offset * element_size (no device check), a
  Python int as 8 bytes (int64) and a float as 4 (float32) unless `arg_casts` names a narrower type
  ("int8", "int16", "int32", "uint8", "fp16", "bf16"); a bool is an int; anything else raises;
- a group larger than the pipeline allows raises RuntimeError (after encoding started);
- it dispatches `threads` threads in all, `group_size` per threadgroup (dispatchThreads: edge
  threadgroups may be smaller).
The model binds exactly those bytes and runs the kernel under the emulator, with the emulated
executor's detection settings, on the CPU tensors that stand in for mps ones. A memory fault of the
kernel is what a GPU address fault is on a Mac: the command buffer completes with an error (which
torch 2.15's synchronize raises); the emulator's other findings (races, barrier divergence) raise at
once, as findings of the test run.
"""

from __future__ import annotations

import struct

import torch

from . import runtime as _runtime

import re

_INT_CAST_WIDTH = {None: 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1}
_FLOAT_CAST_FORMAT = {None: "<f", "fp16": "<e"}
MAX_THREADS_PER_THREADGROUP = 1024  # what a modelled pipeline allows (Metal's general limit)
REGISTER_HEAVY_MAX_THREADS = 512  # ... and one of a register-heavy kernel (simdgroup matrices)
THREAD_EXECUTION_WIDTH = 32
_SIMDGROUP_MATRIX = re.compile(r"\bsimdgroup_(?:matrix\b|(?:float|half|bfloat)8x8\b)")


def modelled_max_threads(source: str) -> int:
    """maxTotalThreadsPerThreadgroup of the pipelines of kernels compiled from `source` (one compile unit),
    in the models of torch's compile_shader and of Metal (tests/metal_model): Metal lowers it below 1024
    for kernels that need many registers per thread; the models take a unit that uses simdgroup matrices
    (8x8 tiles held in registers) as such, per unit, not per kernel."""
    return REGISTER_HEAVY_MAX_THREADS if _SIMDGROUP_MATRIX.search(source) else MAX_THREADS_PER_THREADGROUP


def bind(args, arg_casts) -> list:
    """The buffers of a call, by torch's rules: tensors as they are, Python numbers as their bytes."""
    casts = arg_casts or {}
    bound = []
    for i, arg in enumerate(args):
        cast = casts.get(i)
        if isinstance(arg, torch.Tensor):
            bound.append(arg)
        elif isinstance(arg, float):
            if cast == "bf16":
                bound.append(struct.pack("<f", arg)[2:])
            else:
                bound.append(struct.pack(_FLOAT_CAST_FORMAT[cast], arg))
        elif isinstance(arg, int):  # bool included, as pybind11's int check is
            # static_cast<intN_t>(int64_t): the low N bytes, two's complement
            bound.append(int(arg).to_bytes(8, "little", signed=True)[: _INT_CAST_WIDTH[cast]])
        else:
            raise RuntimeError("Unsupported argument type")
    return bound


class ModelledKernel:
    def __init__(self, library: "ModelledLibrary", name: str) -> None:
        self._library, self.name = library, name
        self.max_threads_per_threadgroup = library._max_threads
        self.thread_execution_width = THREAD_EXECUTION_WIDTH

    def __call__(self, *args, threads=None, group_size=None, arg_casts=None) -> None:
        bound = bind(args, arg_casts)
        threads = list(threads) + [1] * (3 - len(threads))
        group = list(group_size) + [1] * (3 - len(group_size))
        if group[0] * group[1] * group[2] > self.max_threads_per_threadgroup:
            raise RuntimeError(f"Threadgroup size {group} exceeds the pipeline's maximum {self.max_threads_per_threadgroup}")
        self._library.encode(self.name, bound, threads, group)


class ModelledLibrary:
    def __init__(self, runtime: _runtime.Runtime, source: str) -> None:
        from .. import emulator
        from ..executors import emulated

        try:
            self._emulated = emulated.compile_unit("compile_shader", source)
        except (emulator.CompileError, emulator.PrepassError) as e:
            raise SyntaxError(str(e)) from None
        self._runtime = runtime
        self._names = list(self._emulated.kernels)
        self._max_threads = modelled_max_threads(source)

    def __dir__(self):
        return list(self._names)

    def __getattr__(self, name: str):
        if name.startswith("_") or name not in self._names:
            raise RuntimeError(f"Failed to create function state object for: {name}")
        return ModelledKernel(self, name)

    def encode(self, kernel: str, bound: list, threads: list, group: list) -> None:
        from ..emulator import errors
        from ..executors import emulated

        settings = emulated.load()

        def run():
            try:
                self._emulated.launch(kernel, threads=tuple(threads), threadgroup=tuple(group), args=bound,
                                      order=settings.order, race_check=settings.race_check, poison=settings.poison,
                                      seed=settings.seed, float_mode=settings.float_mode)  # fmt: skip
            except (errors.OutOfBounds, errors.MemoryFault) as e:
                return f"Execution of the command buffer was aborted due to an error during execution. ({e})"
            return None

        self._runtime.encode_kernel(kernel, run)
