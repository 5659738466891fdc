"""The table of bitsandbytes ops that bnb_mps serves.

Each op is known by its schema name ("quantize_4bit", "dequantize_4bit.out", ...) and has
- a `check` function whose signature mirrors the bitsandbytes schema and which raises
  ValueError/TypeError for bad input before anything is copied or launched;
- optionally a `kernel` function, `kernel(executor, *args)`, that allocates outputs and launches
  Metal kernels through an executor (native, shader or emulated tier). Most ops declare a
  planner instead (`planner`, bnb_mps.ops.plan): a function of the arguments' metadata that says
  what the call allocates and launches; their `kernel` plans and runs, and the op layer keeps the
  plans of repeated calls.
Ops without a kernel are served by the CPU-transfer fallback. Registration with the dispatcher
(`bnb_mps.registration`) only ever sees this table, so adding a kernel never touches it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

NAMESPACE = "bitsandbytes"


@dataclass
class OpDef:
    name: str
    check: Callable[..., None]
    kernel: Optional[Callable[..., Any]] = None
    #: for the CPU-transfer fallback, in place of bitsandbytes' CPU implementation: where it has
    #: none, or where its result depends on the CPU's instruction set
    composite: Optional[Callable[..., Any]] = None
    #: the schema's arguments (name, default), cached by `argument_spec`
    spec: Optional[tuple] = None
    #: how the op plans its calls (bnb_mps.ops.plan.Planned), for ops declared with `planner`
    planned: Optional[Any] = None

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(inspect.signature(self.check).parameters)


OPS: dict[str, OpDef] = {}


def checks(name: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Declare an op served by bnb_mps, with its argument checks."""

    def deco(fn: Callable[..., None]) -> Callable[..., None]:
        if name in OPS:
            raise RuntimeError(f"op {name!r} declared twice")
        OPS[name] = OpDef(name, fn)
        return fn

    return deco


def kernel(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Attach the GPU implementation of an op: `fn(executor, *args)` with the schema's arguments."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        op = OPS.get(name)
        if op is None:
            raise RuntimeError(f"kernel for unknown op {name!r}; declare its checks first")
        if op.kernel is not None:
            raise RuntimeError(f"op {name!r} has two kernel implementations")
        op.kernel = fn
        return fn

    return deco


def planner(name: str, *, dynamic_positions=(), dynamic=None, paths=None,
            versioned: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:  # fmt: skip
    """Attach an op's planner, `fn(*args) -> bnb_mps.ops.plan.Plan` with the schema's arguments; the
    op's kernel then plans and runs each call. `dynamic_positions` / `dynamic`: arguments taken per
    call (left out of plan keys) and the function that checks them and returns their scalars (also
    per-call scalars of the op's own, as the split-K plans' tag; a plan that asks none never calls it).
    `paths`: for an op with several kernel paths, `paths(*args)` names the paths (route names) worth
    measuring for a call, the built-in one first; the planner then takes one of them as `route=`.
    `versioned`: the planner and `paths` also take `language_version=`, the Metal language version of
    the tier's kernels (bnb_mps.ops.plan.language_version_of), where the kernels it may launch depend on it."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        from .plan import Planned, execute

        planned = Planned(fn, sum(1 << i for i in dynamic_positions), dynamic, paths, versioned)
        kernel(name)(lambda executor, *args, route=None: execute(planned, executor, args, route))
        OPS[name].planned = planned
        return fn

    return deco


def kernel_of(name: str) -> Callable[..., Any]:
    """The kernel function of op `name`: `fn(executor, *args)` (planned ops with several kernel paths
    also take `route=`, see `planner`)."""
    return lambda executor, *args, **route: OPS[name].kernel(executor, *args, **route)


def composite(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Attach a CPU composition of an op (for the CPU-transfer fallback) from bitsandbytes ops
    whose CPU results are the same on every CPU."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        OPS[name].composite = fn
        return fn

    return deco


def op_packet(name: str):
    """torch.ops.bitsandbytes.<base>.<overload> for a schema name."""
    import torch

    base, _, overload = name.partition(".")
    return getattr(getattr(getattr(torch.ops, NAMESPACE), base), overload or "default")


_NO_DEFAULT = object()


def argument_spec(name: str) -> tuple[tuple[str, object], ...]:
    """(argument name, default or _NO_DEFAULT) in schema order, read once from bitsandbytes' schema."""
    op = OPS[name]
    if op.spec is None:
        args = op_packet(name)._schema.arguments
        op.spec = tuple((a.name, a.default_value if a.has_default_value() else _NO_DEFAULT) for a in args)
    return op.spec


def bind(name: str, args: tuple, kwargs: dict) -> list:
    """All of a call's arguments in schema order, defaults filled in.

    The dispatcher hands Python kernels trailing arguments that equal their defaults as missing,
    and callers may pass any argument by keyword.
    """
    spec = argument_spec(name)
    if len(args) == len(spec):
        return list(args)
    out = list(args)
    for arg_name, default in spec[len(args) :]:
        if arg_name in kwargs:
            out.append(kwargs[arg_name])
        elif default is not _NO_DEFAULT:
            out.append(default)
        else:
            raise TypeError(f"{name}: missing argument {arg_name!r}")
    return out
