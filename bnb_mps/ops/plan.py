"""Launch plans: what a call of an op does, worked out once from its arguments' metadata and replayed
for every later call with the same metadata.

An op's planner looks at the metadata of a call's arguments (dtypes, shapes, strides, storage
offsets, devices) and the values of its non-tensor arguments, never at tensor data, and returns a
`Plan`: the outputs to allocate, the tensors to prepare (a contiguous copy of a view the kernels
cannot bind as it is, a temporary for an `out` they cannot write in place), the kernel launches
(name, geometry, and for each buffer index where its value comes from), the write-backs, and what
the call returns. Running a plan is then a few allocations, one launch per kernel and nothing else.

The op layer keeps the plans of the calls it served (one cache per op and dispatcher entry, in
bnb_mps.ops), keyed by `key` (`metadata_key`, or the same key in C++): a call whose arguments have
the same metadata as an earlier one runs that call's plan without binding, checking or planning
again. That is exactly as strict as checking: an op's checks read only the same metadata (dtypes,
shapes, devices, argument values), so a call with the key of a call that passed them passes them
too. Arguments that an op takes per call without planning on them (the
optimizers' hyperparameters and step: `Planned.dynamic`) are left out of the key; the op turns them
into scalar arguments on every call (memoized, see bnb_mps.ops.optim), checking them as it goes.

A launch's buffers are picked from one tuple per call (`pool`): the outputs, then the per-call
scalars, then the plan's constant scalars and its workspaces (bnb_mps.ops.workspace: per-device
buffers taken when the plan is bound), then the call's arguments (as prepared). Indices into it
are fixed when the plan is built, so that a launch's arguments are one `operator.itemgetter` call.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from ..kernel_args import Scalar
from .workspace import workspace

Tensor = torch.Tensor


_VALUES = (bool, int, str)  # kept with their class: 1, 1.0 and True differ
_SKIPPED = ("skipped",)


def metadata_key(args: tuple, skip: int = 0) -> Optional[tuple]:
    """What a plan may depend on, for a call's positional arguments: for each tensor its dtype,
    shape, strides, storage offset and device; ints, bools, strings and floats with their class
    (floats exactly: -0.0 is not 0.0); lists and tuples of ints; dtypes and None; the positions
    whose bit is set in `skip` (per-call values, `Planned.dynamic`) left out. None when an argument
    is none of these (e.g. a sparse tensor, which has no strides): such a call is not planned.

    `key` is this function, or the same key computed in C++ (bnb_mps._opkey, csrc/op_key.cpp)
    where that module is built against the running torch."""
    key = []
    add = key.append
    try:
        for i, a in enumerate(args):
            cls = a.__class__
            if (skip >> i) & 1:
                add(_SKIPPED)
            elif a is None or cls is torch.dtype:
                add(a)
            elif isinstance(a, Tensor):
                if a.layout is not torch.strided or a.is_nested:
                    return None
                add((a.dtype, a.shape, a.stride(), a.storage_offset(), a.device))
            elif cls in _VALUES:
                add((cls, a))
            elif cls is float:
                add((cls, a.hex()))
            elif (cls is list or cls is tuple) and all(x.__class__ is int for x in a):
                add((list, *a))
            else:
                return None
    except RuntimeError:
        return None
    return tuple(key)


def _compiled_key() -> Optional[Callable[[tuple, int], Optional[bytes]]]:
    """bnb_mps._opkey.key, when that module is built and was built against the running torch."""
    spec = importlib.util.find_spec("bnb_mps._opkey")
    if spec is None or not spec.origin:
        return None
    from ..executors.native import build_mismatch, running_torch

    if build_mismatch(Path(spec.origin).with_name("_opkey_build.json"), running_torch()) is not None:
        return None
    try:
        module = importlib.import_module("bnb_mps._opkey")
    except ImportError:
        return None
    return module.key


#: key(args, skip) -> the metadata key of a call (bytes from C++, or metadata_key's tuple), or None
key = _compiled_key() or metadata_key


@dataclass(frozen=True)
class Launch:
    kernel: str
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    #: (buffer index -> position in the call's pool), in buffer order
    picks: tuple[int, ...]


@dataclass
class Plan:
    """What one call does; built by an op's planner (`PlanBuilder`), run by a `BoundPlan`."""

    outputs: tuple  # ((shape, dtype), ...) allocated on `device` per call
    device: Any
    #: (argument position, function of the argument) run before the launches; the result replaces
    #: the argument in the pool
    prepare: tuple
    #: argument positions whose prepared replacement is copied back into the caller's tensor after the launches
    write_back: tuple
    constants: tuple  # Scalars, after the per-call scalars in the pool
    n_dynamic: int  # per-call scalars (`Planned.dynamic`), after the outputs in the pool
    dynamic_base: Any  # what `Planned.dynamic` gets with the call's arguments
    launches: tuple  # Launch, ...
    #: what the call returns: None, or a function of the outputs tuple
    result: Optional[Callable[[tuple], Any]]
    #: run after the launches with (arguments as prepared, outputs): work a plan does without a kernel
    finish: Optional[Callable[[list, tuple], None]] = None
    #: per-device workspaces ((kind, numel, dtype, zeroed), ...; bnb_mps.ops.workspace), after the
    #: constants in the pool: taken once when the plan is bound, never per call
    workspaces: tuple = ()


@dataclass
class PlanBuilder:
    """Builds a Plan: `arg`, `output` and `dynamic` hand out references (kind, index) that `launch`
    takes next to Scalars (the plan's constants); `build` turns them into pool positions."""

    device: Any  # where the outputs are allocated
    op: str = ""  # the op's name, for error messages
    #: how many scalars the op's `Planned.dynamic` returns per call (a fixed number per plan; 0: not called)
    n_dynamic: int = 0
    #: what the op's `Planned.dynamic` gets next to the call's arguments (e.g. flags the plan fixed)
    dynamic_base: Any = None
    _outputs: list = field(default_factory=list)
    _prepare: list = field(default_factory=list)
    _write_back: list = field(default_factory=list)
    _constants: list = field(default_factory=list)
    _launches: list = field(default_factory=list)
    _workspaces: list = field(default_factory=list)

    def arg(self, i: int, prepare: Optional[Callable[[Tensor], Tensor]] = None, *, write_back: bool = False):
        """Argument `i`, bound as it is, or as `prepare(argument)` when given (copied back into the
        caller's tensor after the launches with `write_back`)."""
        if prepare is not None:
            self._prepare.append((i, prepare))
            if write_back:
                self._write_back.append(i)
        return ("arg", i)

    def output(self, shape, dtype) -> tuple:
        self._outputs.append((tuple(shape), dtype))
        return ("out", len(self._outputs) - 1)

    def dynamic(self, k: int) -> tuple:
        """The k-th per-call scalar (`Planned.dynamic`'s k-th value)."""
        if not 0 <= k < self.n_dynamic:
            raise IndexError(f"{self.op}: per-call scalar {k} of {self.n_dynamic}")
        return ("dyn", k)

    def workspace(self, kind: str, numel: int, dtype, zeroed: bool = False) -> tuple:
        """A view of at least `numel` elements of the device's workspace `kind` (bnb_mps.ops.workspace),
        taken when the plan is bound: shared between plans and calls, never allocated per call."""
        self._workspaces.append((kind, int(numel), dtype, zeroed))
        return ("work", len(self._workspaces) - 1)

    def launch(self, kernel: str, grid, threadgroup, args: Sequence) -> None:
        picks = []
        for a in args:
            if isinstance(a, Scalar):
                self._constants.append(a)
                picks.append(("const", len(self._constants) - 1))
            elif isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], str):
                picks.append(a)
            else:
                raise TypeError(f"launch argument must be a reference or a Scalar, got {a!r}")
        self._launches.append((kernel, tuple(grid), tuple(threadgroup), picks))

    def build(self, result=None, finish=None) -> Plan:
        """`result`: None, an output reference, a tuple of them, or a function of the outputs tuple."""
        n_out, n_dyn, n_const = len(self._outputs), self.n_dynamic, len(self._constants)
        n_work = len(self._workspaces)
        base = {"out": 0, "dyn": n_out, "const": n_out + n_dyn, "work": n_out + n_dyn + n_const,
                "arg": n_out + n_dyn + n_const + n_work}

        def pos(ref):
            return base[ref[0]] + ref[1]

        launches = tuple(Launch(k, g, t, tuple(pos(r) for r in picks)) for k, g, t, picks in self._launches)
        if result is None or callable(result):
            get = result
        elif isinstance(result, tuple) and result and isinstance(result[0], tuple):
            get = operator.itemgetter(*(r[1] for r in result))  # several outputs: a tuple
        else:
            get = operator.itemgetter(result[1])
        return Plan(tuple(self._outputs), self.device, tuple(self._prepare), tuple(self._write_back),
                    tuple(self._constants), n_dyn, self.dynamic_base, launches, get, finish,
                    tuple(self._workspaces))  # fmt: skip


class BoundPlan:
    """A plan ready to run on one executor: its launches as callables of their argument tuple.
    `bound(args)` runs a call (its per-call scalars from `dynamic`, the op's `Planned.dynamic`)."""

    __slots__ = ("plan", "counted", "calls", "_allocate", "_constants", "_simple", "_dynamic", "_stream",
                 "_by_stream")

    def __init__(self, plan: Plan, executor, counted: tuple = (), dynamic=None) -> None:
        self.plan = plan
        self.counted = counted  # the op layer's call-count key, (op, tier)
        if plan.n_dynamic and dynamic is None:
            raise TypeError(f"a plan with {plan.n_dynamic} per-call scalars needs its op's `Planned.dynamic`")
        self._dynamic = dynamic if plan.n_dynamic else None
        self.calls = tuple(
            (operator.itemgetter(*L.picks) if len(L.picks) > 1 else _single(L.picks[0]),
             _prepared(executor, L))
            for L in plan.launches
        )  # fmt: skip
        self._allocate = _allocator(plan.outputs, plan.device)
        # (the workspaces sit in the pool after the constants: one tuple, taken once per stream; where
        # torch has several streams, on the stream that first uses them, so that a new buffer's
        # zeroing is ordered before that stream's kernels: taken when bound, it could run on another)
        self._stream = _stream_id_reader() if plan.workspaces else None
        self._constants = plan.constants + (_workspaces(plan.workspaces, plan.device) if self._stream is None else ())
        self._by_stream: dict = {}
        self._simple = not (plan.prepare or plan.write_back or plan.finish)

    def __call__(self, args: tuple):
        """Run the plan for a call with positional arguments `args`."""
        plan = self.plan
        dynamic = self._dynamic(args, plan.dynamic_base) if self._dynamic is not None else ()  # (checks them)
        outs = self._allocate()
        constants = self._constants if self._stream is None else self._constants_on_stream()
        if self._simple:
            pool = (outs + dynamic + constants + args) if dynamic else (outs + constants + args)
            for pick, launch in self.calls:
                launch(args=pick(pool))
        else:
            prepared = list(args)
            for i, fn in plan.prepare:
                prepared[i] = fn(prepared[i])
            pool = outs + dynamic + constants + tuple(prepared)
            for pick, launch in self.calls:
                launch(args=pick(pool))
            for i in plan.write_back:
                args[i].copy_(prepared[i].view(args[i].shape))
            if plan.finish is not None:
                plan.finish(prepared, outs)
        return None if plan.result is None else plan.result(outs)

    def _constants_on_stream(self) -> tuple:
        """The constants and workspaces of a call on torch's current MPS stream: another stream's
        kernels may run while the default stream's do, so each stream has workspaces of its own,
        taken (allocated and zeroed where new) while that stream is current."""
        stream = self._stream()
        constants = self._by_stream.get(stream)
        if constants is None:
            constants = self._by_stream[stream] = self.plan.constants + _workspaces(
                self.plan.workspaces, self.plan.device, stream)
        return constants


def _stream_id_reader() -> Optional[Callable[[], int]]:
    """A function giving the id of torch's current MPS stream (0: the default one) where torch has
    more than one (torch >= 2.15: torch._C._mps_getCurrentStream, which torch.mps.current_stream reads),
    else None (one stream: nothing to ask per call)."""
    get = getattr(torch._C, "_mps_getCurrentStream", None)
    if get is None:
        return None
    try:
        get().stream_id
    except Exception:  # noqa: BLE001 (a torch without an MPS device: no streams to tell apart)
        return None
    return lambda: get().stream_id


def _allocator(outputs: tuple, device) -> Callable[[], tuple]:
    """A function that allocates a plan's outputs (one call of torch.empty each, nothing more)."""
    empty = torch.empty
    if not outputs:
        return tuple
    if len(outputs) == 1:
        ((shape, dtype),) = outputs
        return lambda: (empty(shape, dtype=dtype, device=device),)
    return lambda: tuple([empty(shape, dtype=dtype, device=device) for shape, dtype in outputs])


def _workspaces(wanted: tuple, device, stream: int = 0) -> tuple:
    return tuple(workspace(device, kind, numel, dtype, zeroed, stream) for kind, numel, dtype, zeroed in wanted)


def _prepared(executor, launch: Launch) -> Callable[..., None]:
    """`launch` on `executor` as a function of its arguments (`f(args=...)`): the executor's own prepared launch
    where it offers one (`prepare(kernel, grid, threadgroup)`: the native and shader tiers check the
    geometry and find the kernel once), else its `launch`."""
    prepare = getattr(executor, "prepare", None)
    if prepare is not None:
        return prepare(launch.kernel, launch.grid, launch.threadgroup)
    return functools.partial(executor.launch, launch.kernel, grid=launch.grid, threadgroup=launch.threadgroup)


def _single(i: int):
    return lambda pool: (pool[i],)


@dataclass
class Planned:
    """How an op is planned: its planner (the call's arguments in schema order, defaults filled ->
    Plan) and, for ops with per-call scalars, the argument positions they come from (left out of
    the key) and the function that checks them and returns their Scalars (in `PlanBuilder.dynamic`
    order)."""

    planner: Callable[..., Plan]
    dynamic_positions: int = 0  # bit mask of argument positions
    #: dynamic(args, plan.dynamic_base) -> the call's per-call Scalars (plan.n_dynamic of them)
    dynamic: Optional[Callable[[Sequence, Any], tuple]] = None
    #: paths(*args) -> the kernel paths (route names) worth measuring for a call, the built-in one
    #: first (ops with several paths; their planner takes one as `route=`); None: one path
    paths: Optional[Callable[..., tuple]] = None
    #: whether the planner and `paths` take the tier's Metal language version (`language_version=`,
    #: (major, minor) or None: unknown), on which the kernels an op may launch depend
    versioned: bool = False

    def plan(self, args: Sequence, route: Optional[str] = None, language_version: Optional[tuple] = None) -> Plan:
        """The plan of a call (arguments in schema order, defaults filled) on kernel path `route`
        (None: the built-in one), for kernels compiled at `language_version`."""
        kwargs = {} if route is None else {"route": route}
        if self.versioned:
            kwargs["language_version"] = language_version
        return self.planner(*args, **kwargs)

    def path_names(self, args: Sequence, language_version: Optional[tuple] = None) -> tuple:
        """`paths` of a call at `language_version` (("kernel",) for an op of one path)."""
        if self.paths is None:
            return ("kernel",)
        return self.paths(*args, language_version=language_version) if self.versioned else self.paths(*args)


def language_version_of(executor, tier: Optional[str] = None) -> Optional[tuple[int, int]]:
    """The Metal language version the kernels of `executor` (of `tier`: its name by default) were
    compiled at, (major, minor), or None where it is not known (the OS compiler's default): the
    executor's `language_version`; on the shader tier, what torch's compile_shader asks for here
    (bnb_mps.executors.shader.language_version)."""
    found, inner = None, executor
    while found is None and inner is not None:  # (wrappers that forward launches: their `inner`'s)
        found = getattr(inner, "language_version", None)
        inner = getattr(inner, "inner", None)
    if found is None and (tier or getattr(executor, "name", None)) == "shader":
        found = _shader_language_version()
    if isinstance(found, str):  # ("3.2")
        found = tuple(int(p) for p in found.split("."))
    return None if found is None else (int(found[0]), int(found[1]))


@functools.cache
def _shader_language_version() -> tuple[int, int]:
    """What torch's compile_shader compiles at in this process (torch reads its settings once too)."""
    from ..device import _macos_version
    from ..executors import shader

    return shader.language_version(_macos_version(), shader.torch_version())


def execute(planned: Planned, executor, args: Sequence, route: Optional[str] = None) -> Any:
    """Plan and run one call (arguments in schema order, defaults filled), without caching."""
    args = tuple(args)
    plan = planned.plan(args, route, language_version_of(executor) if planned.versioned else None)
    return BoundPlan(plan, executor, dynamic=planned.dynamic)(args)
