"""One run of a family on a kernel tier: its launches, one synchronisation, then the comparisons."""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch

from ..registry import OPS, bind
from . import sentinel
from .cases import Family, Unaligned
from .launches import LaunchFailed, Recorder, cannot_run
from .verdicts import Verdict

logger = logging.getLogger("bnb_mps")


def run_family(family: Family, executor, device: str) -> Verdict:
    """Runs `family`'s cases with `executor` on `device` tensors (every launch first, the outputs
    the ops allocate filled with a sentinel before them; then one synchronisation), reads whether
    the device ran them (where the tier reports its command buffers' status), then compares each
    case with its reference (the CPU round trip, or the result docs/semantics.md defines). Never
    raises: a case that cannot run fails the family, a refused launch skips its case (see the
    package docstring), a device error fails it in this process only."""
    from ...executors import PipelineLimitError
    from ..cpu_round_trip import cpu_call

    start = time.perf_counter()
    recorder = Recorder(executor)
    label = None
    skipped: list[str] = []

    def verdict(passed: bool, error: Optional[str] = None, could_not_run: bool = False,
                device_error: bool = False) -> Verdict:  # fmt: skip
        return Verdict(family.name, passed, time.perf_counter() - start, None if passed else label, error,
                       recorder.launches, recorder.bytes, skipped=tuple(skipped),
                       could_not_run=(could_not_run or device_error) and not passed, device_error=device_error)  # fmt: skip

    needs = family.language_version
    if needs is not None and not _at_least(recorder.language_version, needs):
        have = "an unknown version" if recorder.language_version is None else "Metal {}.{}".format(*recorder.language_version)
        skipped.append(f"every case: its kernels are compiled at Metal >= {needs[0]}.{needs[1]} only, this tier's at "
                       f"{have}, and no route takes them")  # fmt: skip
        return verdict(True)
    try:  # (what ran before is not the family's: torch >= 2.15 raises an earlier command buffer's error here, once)
        synchronize(executor)
    except Exception as e:  # noqa: BLE001
        logger.info("bnb_mps: before verifying %s: the GPU reported an earlier error: %s", family.name, first_line(e))
    try:
        pending = []
        for case in family.cases():
            label = case.label
            op = OPS[case.op]
            bound = bind(case.op, tuple(to_device(a, device) for a in case.args), {})
            op.check(*bound)
            try:
                routed = {"route": case.route} if case.route is not None else {}
                with sentinel.fresh_outputs():
                    pending.append((case, op.kernel(recorder, *bound, **routed), bound))
            except LaunchFailed as e:
                if isinstance(e.error, PipelineLimitError):  # the op leaves the tier when a user's call meets it
                    skipped.append(f"{case.label}: {e.error}")
                    continue
                return verdict(False, first_line(e.error), could_not_run=cannot_run(e.error))
        label = "(after the launches)"
        try:
            synchronize(executor)
            errors = recorder.device_errors()
        except Exception as e:  # (an error of the device, not of one case)
            return verdict(False, f"synchronising after the launches: {first_line(e)}", device_error=True)
        if errors:
            return verdict(False, "the GPU reported an error in a command buffer of the launches: " + "; ".join(errors),
                           device_error=True)  # fmt: skip
        for case, got, bound in pending:
            label = case.label
            want_args = [on_cpu(a) for a in case.args]
            want = case.expected(want_args) if case.expected is not None else cpu_call(case.op, want_args)
            got, got_args = to_cpu(got), to_cpu(bound)
            error = case.compare(got, want, got_args, want_args)
            if error is not None:
                if case.expected is not None:
                    error = error.replace("the CPU gives", "docs/semantics.md gives")
                never_written = sentinel.unwritten(got, want) or sentinel.unwritten(got_args, want_args, "arguments")
                return verdict(False, f"{never_written}; {error}" if never_written else error)
    except Exception as e:  # the verification itself could not run (its inputs, the CPU reference)
        return verdict(False, first_line(e), could_not_run=True)
    return verdict(True)


def _at_least(version: Optional[tuple], needs: tuple) -> bool:
    return version is not None and tuple(version) >= tuple(needs)


def to_device(x: Any, device: str) -> Any:
    """A case argument for the kernel tier, on `device` (a copy: the case keeps its own)."""
    if isinstance(x, Unaligned):
        return x.on(device)
    if isinstance(x, torch.Tensor):
        return x.to(device) if device != "cpu" else x.clone()
    if isinstance(x, list):
        return list(x)
    return x


def on_cpu(x: Any) -> Any:
    """A case argument for the CPU side (a copy)."""
    if isinstance(x, Unaligned):
        return x.tensor.clone()
    return to_device(x, "cpu")


def to_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (tuple, list)):
        return type(x)(to_cpu(v) for v in x)
    return x


def synchronize(executor) -> None:
    """Waits for what `executor` encoded (a GPU tier: torch.mps.synchronize(), which commits the command
    buffer and waits for it; the next launch starts a new one). From torch 2.15 it raises an earlier
    command buffer's error, once."""
    wait = getattr(executor, "synchronize", None)
    if wait is not None:
        wait()


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
