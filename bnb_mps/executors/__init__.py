"""Which executor serves the ops, and the one-time message when it is not the native one.

Tiers, in order of preference: native (the built Objective-C++ library), shader (the same kernels through
`torch.mps.compile_shader`), emulated (the Metal-on-CPU emulator; debugging and tests only, never
picked by default), cpu (the op-level CPU round trip, bnb_mps.ops.cpu_round_trip). `BNB_MPS_EXECUTOR` forces one.
Tiers are loaded lazily, once per process, on the first op or `backend_info()` call. Which of
them serves a given op (or whether bitsandbytes' own implementation does) is the op layer's
choice: `bnb_mps.ops.routing`.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Optional

from .base import Executor, ExecutorUnavailable, KernelUnavailable, PipelineLimitError  # noqa: F401  (re-exported)

logger = logging.getLogger("bnb_mps")

TIERS = ("native", "shader", "emulated", "cpu")
GPU_TIERS = ("native", "shader")
ENV_VAR = "BNB_MPS_EXECUTOR"

BUILD_HINT = (
    "xcode-select --install  # once: the Apple clang that compiles the Objective-C++ executor\n"
    "    pip install --no-build-isolation -e /path/to/bnb-mps  # from a bnb-mps checkout, with torch installed"
)


class SlowTierWarning(UserWarning):
    """bitsandbytes ops on mps are served by a tier slower than the native Metal library."""


@dataclass(frozen=True)
class Selection:
    tier: str
    executor: Optional[Executor]
    reason: str
    forced: bool = False  # chosen by BNB_MPS_EXECUTOR


_lock = threading.Lock()
_selection: Optional[Selection] = None
_load_errors: dict[str, str] = {}
_warned = False
#: changes whenever the tier choice is forgotten (`reset`), so that what was bound to an executor
#: (the op layer's launch plans) is dropped with it
generation = 0


def load_tier(name: str) -> Executor:
    """Load one executor tier (raises ExecutorUnavailable with the reason)."""
    if name not in TIERS or name == "cpu":
        raise ValueError(f"no executor tier named {name!r}; tiers with executors: native, shader, emulated")
    try:
        module = importlib.import_module(f"{__name__}.{name}")
    except ImportError as e:
        raise ExecutorUnavailable(f"{name} executor is not part of this installation ({e})") from None
    return module.load()


def _try(name: str) -> Optional[Executor]:
    try:
        return load_tier(name)
    except ExecutorUnavailable as e:
        _load_errors[name] = str(e)
    except Exception as e:  # a broken tier must never break the user's program
        _load_errors[name] = f"{type(e).__name__}: {e}"
        logger.warning("bnb_mps: the %s executor failed to load: %s", name, _load_errors[name])
    return None


def _select() -> Selection:
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    prefix = ""
    if forced:
        if forced not in TIERS:
            logger.warning("bnb_mps: ignoring %s=%r; expected one of %s", ENV_VAR, forced, ", ".join(TIERS))
            prefix = f"{ENV_VAR}={forced!r} is not a tier; "
        elif forced == "cpu":
            return Selection("cpu", None, f"forced by {ENV_VAR}=cpu", forced=True)
        else:
            executor = _try(forced)
            if executor is not None:
                return Selection(forced, executor, f"forced by {ENV_VAR}={forced}", forced=True)
            logger.warning("bnb_mps: %s=%s cannot be used: %s", ENV_VAR, forced, _load_errors[forced])
            prefix = f"{ENV_VAR}={forced} unavailable ({_load_errors[forced]}); "
    for name in GPU_TIERS:
        executor = _try(name)
        if executor is not None:
            return Selection(name, executor, prefix + ("native Metal library loaded" if name == "native" else
                             f"native library unavailable ({_load_errors.get('native', '?')})"))  # fmt: skip
    why = "; ".join(f"{n}: {_load_errors[n]}" for n in GPU_TIERS if n in _load_errors)
    return Selection("cpu", None, prefix + (why or "no GPU executor available"))


def selection() -> Selection:
    """The process-wide tier choice (computed on first use)."""
    global _selection
    if _selection is None:
        with _lock:
            if _selection is None:
                _selection = _select()
    return _selection


def reset() -> None:
    """Forget the tier choice (tests; after changing BNB_MPS_EXECUTOR)."""
    global _selection, _warned, generation
    with _lock:
        _selection = None
        _load_errors.clear()
        _warned = False
        generation += 1


def load_errors() -> dict[str, str]:
    selection()
    return dict(_load_errors)


class StagedExecutor:
    """Runs a CPU executor (the emulator) on tensors of another device: every tensor argument is
    copied to the CPU, the kernel runs, and every tensor argument is copied back (which of them
    the kernel wrote is not the executor's knowledge). For debugging only: it synchronises."""

    def __init__(self, inner: Executor, to_host=None):
        self.inner = inner
        self.name = inner.name
        self._to_host = to_host or (lambda t: t.cpu())

    def launch(self, kernel, *, grid, threadgroup, args) -> None:
        import torch

        staged = [self._to_host(a) if isinstance(a, torch.Tensor) else a for a in args]
        self.inner.launch(kernel, grid=grid, threadgroup=threadgroup, args=staged)
        for a, s in zip(args, staged):
            if isinstance(a, torch.Tensor) and s is not a:
                a.copy_(s)


def executor_for(device_type: str) -> Executor:
    """The selected executor, for kernels on tensors of `device_type` (call only when the
    selection has an executor): the GPU tiers take mps tensors as they are; the emulated tier
    runs CPU tensors directly and stages other devices' tensors through the CPU."""
    sel = selection()
    if sel.tier in GPU_TIERS or device_type == "cpu":
        return sel.executor
    return StagedExecutor(sel.executor)


def notify_slow_tier(op_name: str, tier: str, reason: str) -> None:
    """Say once per process that mps ops run on a slower tier, why, and how to get the fast one."""
    global _warned
    if _warned or tier == "native" or selection().tier == "native":
        return  # (with the native tier loaded, an op without a kernel is served as well as it can be)
    _warned = True
    what = {
        "cpu": "bitsandbytes' CPU implementation, with a copy to the CPU and back",
        "bitsandbytes": "bitsandbytes' own implementation (bnb_mps stepped aside for this op)",
        "shader": "the same Metal kernels, compiled at run time by torch.mps.compile_shader",
        "emulated": "the Metal-on-CPU emulator (for debugging)",
    }.get(tier, tier)
    warnings.warn(
        f"bnb_mps: bitsandbytes ops on mps (first: {op_name}) are served by the {tier} tier: {what}. "
        f"Why: {reason}. To get the native Metal kernels:\n    {BUILD_HINT}\n"
        f"Run `python -m bnb_mps` to see which tier serves each op.",
        SlowTierWarning,
        stacklevel=3,
    )
