"""Running one family on a kernel tier: its launches, one synchronisation, then the comparisons."""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from ..registry import OPS, bind
from .cases import Family, Unaligned
from .verdicts import Verdict


def _to(x: Any, device: str) -> Any:
    """A case argument for the kernel tier, on `device` (a copy: the case keeps its own)."""
    if isinstance(x, Unaligned):
        return x.on(device)
    if isinstance(x, torch.Tensor):
        return x.to(device) if device != "cpu" else x.clone()
    if isinstance(x, list):
        return list(x)
    return x


def _plain(x: Any) -> Any:
    """A case argument for the CPU side (a copy)."""
    if isinstance(x, Unaligned):
        return x.tensor.clone()
    return _to(x, "cpu")


def _cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (tuple, list)):
        return type(x)(_cpu(v) for v in x)
    return x


def _synchronize(device: str) -> None:
    module = getattr(torch, device, None)
    if device != "cpu" and module is not None and hasattr(module, "synchronize"):
        module.synchronize()


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


class _LaunchFailed(Exception):
    """The executor raised in a launch (carries what it raised)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class _Counting:
    """Forwards launches to an executor, counting them and the bytes of the tensors they bind; what
    the executor raises comes out wrapped (_LaunchFailed), to tell it from the op layer's errors."""

    def __init__(self, inner) -> None:
        self.inner, self.name = inner, inner.name
        self.launches = self.bytes = 0

    def launch(self, kernel, *, grid, threadgroup, args) -> None:
        from ...executors import PipelineLimitError

        try:
            self.inner.launch(kernel, grid=grid, threadgroup=threadgroup, args=args)
        except Exception as e:
            if not isinstance(e, PipelineLimitError):  # (a refused launch did not run)
                self._count(args)
            raise _LaunchFailed(e) from e
        self._count(args)

    def _count(self, args) -> None:
        self.launches += 1
        self.bytes += sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))


def cannot_run(e: BaseException) -> bool:
    """Whether a launch error says the tier cannot run kernels here at all (no C++ compiler for the
    emulator, the emulator runtime or the tier missing, out of memory), as opposed to a fault of
    the kernels (an emulator fault, kernel source that does not compile, a GPU tier's error), which
    fails the family for good."""
    from ... import emulator
    from ...emulator import build
    from ...executors import ExecutorUnavailable, KernelUnavailable

    if isinstance(e, KernelUnavailable) and e.__cause__ is not None:  # its compile unit's own error
        e = e.__cause__
    if isinstance(e, emulator.CompileError):
        try:
            build.compiler_identity(build.find_compiler())
        except emulator.CompileError:
            return True  # no compiler that runs: nothing was compiled
        return False
    return isinstance(e, (ExecutorUnavailable, ImportError, OSError, MemoryError))


def run_family(family: Family, executor, device: str) -> Verdict:
    """Runs `family`'s cases with `executor` on `device` tensors (every launch first, then one
    synchronisation), then compares each with its reference (the CPU round trip, or the result
    docs/semantics.md defines). Never raises: a case that cannot run fails the family, a refused
    launch skips its case (see the module docstring)."""
    from ...executors import PipelineLimitError
    from ..cpu_round_trip import cpu_call

    start = time.perf_counter()
    recorder = _Counting(executor)
    label = None
    skipped: list[str] = []

    def verdict(passed: bool, error: Optional[str] = None, could_not_run: bool = False) -> Verdict:
        return Verdict(family.name, passed, time.perf_counter() - start, None if passed else label, error,
                       recorder.launches, recorder.bytes, skipped=tuple(skipped),
                       could_not_run=could_not_run and not passed)  # fmt: skip

    try:
        pending = []
        for case in family.cases():
            label = case.label
            op = OPS[case.op]
            bound = bind(case.op, tuple(_to(a, device) for a in case.args), {})
            op.check(*bound)
            try:
                routed = {"route": case.route} if case.route is not None else {}
                pending.append((case, op.kernel(recorder, *bound, **routed), bound))
            except _LaunchFailed as e:
                if isinstance(e.error, PipelineLimitError):  # the op leaves the tier when a user's call meets it
                    skipped.append(f"{case.label}: {e.error}")
                    continue
                return verdict(False, first_line(e.error), could_not_run=cannot_run(e.error))
        label = None
        try:
            _synchronize(device)
        except Exception as e:  # (an error of the device, not of one case: verified again next time)
            return verdict(False, f"synchronising after the launches: {first_line(e)}", could_not_run=True)
        for case, got, bound in pending:
            label = case.label
            want_args = [_plain(a) for a in case.args]
            want = case.expected(want_args) if case.expected is not None else cpu_call(case.op, want_args)
            error = case.compare(_cpu(got), want, _cpu(bound), want_args)
            if error is not None:
                if case.expected is not None:
                    error = error.replace("the CPU gives", "docs/semantics.md gives")
                return verdict(False, error)
    except Exception as e:  # the verification itself could not run (its inputs, the CPU reference)
        return verdict(False, first_line(e), could_not_run=True)
    return verdict(True)
