"""What serves a call signature once it is resolved (bnb_mps.ops.resolve): a callable of the call's
positional arguments, `served(args)`, with `counted`, the op layer's call-count key (op, what serves).

- a launch plan (bnb_mps.ops.plan.BoundPlan): the op's kernels on one kernel path, on one executor;
- `DequantizeLinear` (bnb_mps.ops.dequantize_linear): bnb-mps' dequantize kernels into a temporary
  weight, then torch's linear;
- `Unplanned`: the kernel function of an op that has no planner, on one executor;
- `Stock`: bitsandbytes' own implementation for the dispatch key, for this signature only;
- `RoundTrip`: the CPU round trip (bnb_mps.ops.cpu_round_trip);
- `HandedBack`: bitsandbytes' own implementation after the whole op was handed back to it;
- `IntMM`: int8_linear_matmul as torch._int_mm, where torch runs it on the device.

A dispatcher entry calls them with the arguments as the dispatcher gave them, which may leave out
trailing arguments that equal their defaults: those that need every argument fill the defaults in.
"""

from __future__ import annotations

from collections.abc import Callable

from . import cpu_round_trip
from .registry import argument_spec


class _Filled:
    """Fills in the trailing defaults the dispatcher leaves out (none missing: the arguments as they are)."""

    __slots__ = ("name", "counted", "_defaults", "_n")

    def __init__(self, name: str, counted: tuple) -> None:
        spec = argument_spec(name)
        self.name, self.counted = name, counted
        self._defaults, self._n = tuple(default for _, default in spec), len(spec)

    def full(self, args: tuple) -> tuple:
        return args if len(args) == self._n else (*args, *self._defaults[len(args):])


class Stock(_Filled):
    """bitsandbytes' own implementation of the op for the dispatch key bnb_mps was registered for
    (bnb_mps.registration.stock_kernel), called directly: bnb_mps stays registered for the op."""

    __slots__ = ("fn",)

    def __init__(self, name: str, fn: Callable) -> None:
        super().__init__(name, (name, "bitsandbytes"))
        self.fn = fn

    def __call__(self, args: tuple):
        return self.fn(*self.full(args))


class RoundTrip(_Filled):
    """The CPU round trip: the op on CPU copies of the arguments, results and in-place updates copied back."""

    __slots__ = ()

    def __init__(self, name: str) -> None:
        super().__init__(name, (name, "cpu"))

    def __call__(self, args: tuple):
        return cpu_round_trip.run(self.name, list(self.full(args)))


class Unplanned(_Filled):
    """The kernel function of an op without a planner (`fn(executor, *args)`), on one executor."""

    __slots__ = ("kernel", "executor")

    def __init__(self, name: str, kernel: Callable, executor, tier: str) -> None:
        super().__init__(name, (name, tier))
        self.kernel, self.executor = kernel, executor

    def __call__(self, args: tuple):
        return self.kernel(self.executor, *self.full(args))


class HandedBack:
    """bitsandbytes' own implementation, once the op was handed back to it whole (bnb_mps.registration
    withdrew its kernel, so later calls do not reach bnb_mps): `fn` runs a call as the dispatcher now
    resolves it."""

    __slots__ = ("fn", "counted")

    def __init__(self, name: str, fn: Callable) -> None:
        self.fn, self.counted = fn, (name, "bitsandbytes")

    def __call__(self, args: tuple):
        return self.fn(*args)


class IntMM:
    """int8_linear_matmul(A, B) = A @ B^T in int32 as torch._int_mm, exact as the kernel is (a tuning
    route where torch runs it on the device, bnb_mps.ops.candidates.int_mm_runs)."""

    __slots__ = ("counted",)

    def __init__(self, name: str, tier: str) -> None:
        self.counted = (name, tier)

    def __call__(self, args: tuple):
        import torch

        A, B = args[0], args[1]
        out = torch._int_mm(A.reshape(-1, A.shape[-1]), B.t())
        return out.reshape(*A.shape[:-1], B.shape[0])
