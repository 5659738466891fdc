"""The CPU-transfer fallback: the last resort, always correct, slow.

Works per op, not per kernel: copy the op's tensor arguments to the CPU, run bitsandbytes' own
CPU implementation of the same schema, copy the results back to the caller's device, and write
in-place updates (optimizer states, `out=` tensors) back into the caller's tensors.

Where the op layer registers a composition (`OpDef.composite`), that runs instead: for schemas
bitsandbytes has no CPU implementation of, and for those whose CPU implementation gives results
that depend on the CPU's instruction set (the 4-bit dequantize and products, see
bnb_mps/ops/fourbit.py and matmul_4bit.py; the int8 product, exact only with AVX-512, see
bnb_mps/ops/int8.py). An `.out` overload whose functional form has a composition, or that
bitsandbytes has no CPU implementation of, runs that functional form then copies into `out`.
"""

from __future__ import annotations

import functools

import torch

from .registry import OPS, op_packet

_CPU = torch.device("cpu")


@functools.cache
def _written_args(name: str) -> tuple[int, ...]:
    """Positions of the arguments the schema marks as mutated (Tensor(a!))."""
    args = op_packet(name)._schema.arguments
    return tuple(i for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write)


def _has_cpu_kernel(name: str) -> bool:
    return torch._C._dispatch_has_computed_kernel_for_dispatch_key(f"bitsandbytes::{name}", "CPU")


def _to(x, device: torch.device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_to(v, device) for v in x)
    return x


def _device_of(args) -> torch.device:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    return _CPU


def cpu_call(name: str, args: list):
    """Run schema `name` on CPU arguments: the op layer's composition if it has one, else
    bitsandbytes' CPU implementation."""
    composite = OPS[name].composite
    if composite is not None:
        return composite(*args)
    base = name.removesuffix(".out")
    if base != name and (OPS[base].composite is not None or not _has_cpu_kernel(name)):
        *inputs, out = args  # the functional form (its composition, if any), copied into `out`
        out.copy_(cpu_call(base, inputs))
        return None
    if _has_cpu_kernel(name):
        from ..stock import stock_kernel

        # bitsandbytes' own CPU kernel, also where bnb_mps is registered for the CPU key (its emulated
        # tier in tests, bnb_mps.modelled_mps): never bnb_mps' kernels, which this must check
        stock = stock_kernel("CPU", name)
        return stock(*args) if stock is not None else op_packet(name)(*args)
    raise NotImplementedError(f"bitsandbytes has no CPU implementation of {name} and bnb_mps no composition")


def run(name: str, args: list):
    """Serve op `name` (arguments bound in schema order) through the CPU."""
    device = _device_of(args)
    cpu_args = [_to(a, _CPU) for a in args]
    result = cpu_call(name, cpu_args)
    for i in _written_args(name):
        if args[i] is not None and cpu_args[i] is not args[i]:
            args[i].copy_(cpu_args[i])
    return _to(result, device)
