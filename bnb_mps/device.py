"""Device, dtype, DataLoader and training-config helpers for Apple Silicon (``mps``).

The practice around training on MPS is well known but scattered; this module turns it
into small functions:

- :func:`get_device` picks a device (explicit preference, ``BNB_MPS_DEVICE``, or the best
  accelerator), confirms it with a tiny allocation and falls back with a logged reason.
- :func:`get_dtype_from_string` and :func:`check_mps_limitations` cover dtype limits and
  the other MPS caveats (bf16, fp16 training, ``torch.compile``, distributed, CPU fallback,
  which bitsandbytes ops run on the GPU).
- :func:`dataloader_kwargs` and :func:`training_config` propose DataLoader and
  ``transformers.TrainingArguments`` settings per device.
- :func:`find_max_batch_size` probes the largest batch that fits, treating the
  out-of-memory errors of every backend alike; :func:`memory_stats` reports memory.

Importing this module imports torch only; bitsandbytes, transformers and the rest of
bnb_mps are imported inside the functions that need them.
"""

from __future__ import annotations

import gc
import functools
import logging
import os
import platform
import re
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
from torch.torch_version import TorchVersion, Version

__all__ = [
    "Finding",
    "check_mps_limitations",
    "dataloader_kwargs",
    "find_max_batch_size",
    "get_device",
    "get_dtype_from_string",
    "is_mps_available",
    "is_out_of_memory",
    "memory_stats",
    "mps_bf16_support",
    "training_config",
]

logger = logging.getLogger(__name__)

DeviceLike = Union[str, torch.device]

#: Environment variable that overrides the ``preferred_device`` argument of get_device().
DEVICE_ENV_VAR = "BNB_MPS_DEVICE"

_DEVICE_CHOICES = "'auto', 'cpu', 'cuda', 'cuda:N', 'mps' or a torch.device of those types"
_DEVICE_TYPES = ("cpu", "cuda", "mps")
# Accelerators in order of preference for "auto"; the CPU is always the last resort.
_AUTO_ORDER = ("cuda", "mps")

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}

# bitsandbytes ops are fast on MPS only when one of these executor tiers serves them.
GPU_TIERS = ("native", "shader")


# --------------------------------------------------------------------------- versions


def _torch_version() -> tuple:
    """(major, minor) of the installed torch, e.g. (2, 8) (torch's own version parsing; local
    suffixes such as +cpu are ignored)."""
    return tuple(Version(TorchVersion(torch.__version__)).release[:2])


def _macos_version() -> Optional[tuple]:
    """(major, minor) of the running macOS, or None when not on macOS."""
    release = platform.mac_ver()[0]
    if not release:
        return None
    parts = [int(p) for p in re.findall(r"\d+", release)[:2]]
    while len(parts) < 2:
        parts.append(0)
    return tuple(parts)


def _version_str(version: tuple) -> str:
    return ".".join(str(v) for v in version)


# --------------------------------------------------------------------------- devices


def is_mps_available() -> bool:
    """True when this torch build has MPS and the machine offers an MPS device."""
    try:
        return bool(torch.backends.mps.is_built() and torch.backends.mps.is_available())
    except Exception:  # very old or stripped torch builds
        return False


def _parse_device(value: Optional[DeviceLike], source: str) -> Optional[torch.device]:
    """Turn a preference into a torch.device; None means "auto".

    ``source`` names the argument (or environment variable) for error messages.
    """
    if value is None:
        return None
    if isinstance(value, torch.device):
        device = value
    elif isinstance(value, str):
        text = value.strip().lower()
        if text in ("", "auto"):
            return None
        try:
            device = torch.device(text)
        except RuntimeError:
            raise ValueError(
                f"{source}: unknown device {value!r}; expected {_DEVICE_CHOICES}"
            ) from None
    else:
        raise TypeError(
            f"{source}: expected a str or torch.device, got {type(value).__name__}"
        )
    if device.type not in _DEVICE_TYPES:
        raise ValueError(f"{source}: unsupported device {str(device)!r}; expected {_DEVICE_CHOICES}")
    return device


def _as_device(device: DeviceLike, name: str = "device") -> torch.device:
    """A concrete torch.device for helpers that take one ("auto" resolves through get_device)."""
    parsed = _parse_device(device, name)
    return get_device() if parsed is None else parsed


def _probe(device: torch.device) -> None:
    """A tiny allocation and kernel launch on ``device``; raises when the device is unusable."""
    x = torch.zeros(2, device=device)
    x.add_(1)
    # Reading the value back forces the work to finish, so late failures surface here.
    if float(x.sum().item()) != 2.0:
        raise RuntimeError(f"test computation on {device} returned a wrong result")


def _unusable_reason(device: torch.device) -> Optional[str]:
    """Why ``device`` cannot be used, or None when it passed the availability checks and probe."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "torch.cuda.is_available() is False (no CUDA build of torch or no NVIDIA GPU/driver)"
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            return f"CUDA device index {device.index} is out of range ({count} device(s) visible)"
    elif device.type == "mps":
        if not is_mps_available():
            if not torch.backends.mps.is_built():
                return "this torch build has no MPS support"
            return "torch.backends.mps.is_available() is False (needs Apple Silicon and macOS >= 12.3)"
        if device.index not in (None, 0):
            return f"MPS has a single device (index 0); got index {device.index}"
    try:
        _probe(device)
    except Exception as exc:  # any failure here means "do not use this device"
        return f"test allocation failed: {type(exc).__name__}: {exc}"
    return None


def _auto_candidates() -> list:
    """Available accelerators in order of preference, then the CPU."""
    found = []
    if torch.cuda.is_available():
        found.append(torch.device("cuda"))
    if is_mps_available():
        found.append(torch.device("mps"))
    found.append(torch.device("cpu"))
    return found


def get_device(
    preferred_device: Optional[DeviceLike] = None, fallback_on_error: bool = True
) -> torch.device:
    """Pick the device to run on and confirm it with a tiny allocation.

    The preference is, in order: the ``BNB_MPS_DEVICE`` environment variable, then
    ``preferred_device`` ("mps", "cuda", "cuda:1", "cpu", "auto" or a ``torch.device``;
    an explicit index is honoured). Without a preference ("auto") the best available
    accelerator is chosen (CUDA, then MPS), else the CPU.

    When the chosen device is unavailable or its test allocation fails, the next candidate
    is tried (the other accelerators, then the CPU) and the reason is logged as a warning.
    With ``fallback_on_error=False`` a RuntimeError naming the reason is raised instead.
    Unknown device names raise ValueError listing the choices.
    """
    if not isinstance(fallback_on_error, bool):
        raise TypeError(
            f"fallback_on_error: expected a bool, got {type(fallback_on_error).__name__}"
        )
    env_value = os.environ.get(DEVICE_ENV_VAR, "").strip()
    if env_value:
        requested = _parse_device(env_value, DEVICE_ENV_VAR)
        source = DEVICE_ENV_VAR
    else:
        requested = _parse_device(preferred_device, "preferred_device")
        source = "preferred_device"

    if requested is None:
        candidates = _auto_candidates()
    else:
        candidates = [requested] + [d for d in _auto_candidates() if d.type != requested.type]

    failures = []
    for device in candidates:
        reason = _unusable_reason(device)
        if reason is None:
            if failures:
                logger.warning(
                    "%s; using %s instead",
                    "; ".join(f"device {d} is not usable ({r})" for d, r in failures),
                    device,
                )
            return device
        if not fallback_on_error:
            origin = f" (from {source})" if requested is not None else ""
            raise RuntimeError(
                f"device {device}{origin} is not usable: {reason}. "
                "Pass fallback_on_error=True to fall back to another device."
            )
        failures.append((device, reason))
    raise RuntimeError(
        "no usable device: " + "; ".join(f"{d}: {r}" for d, r in failures)
    )


# --------------------------------------------------------------------------- dtypes


def get_dtype_from_string(name: str) -> torch.dtype:
    """Map "fp32"/"float32", "fp16"/"float16"/"half", "bf16"/"bfloat16" to a torch dtype."""
    if not isinstance(name, str):
        raise TypeError(f"name: expected a str such as 'bf16', got {type(name).__name__}")
    key = name.strip().lower()
    if key not in _DTYPES:
        raise ValueError(f"name: unknown dtype {name!r}; expected one of {', '.join(_DTYPES)}")
    return _DTYPES[key]


@dataclass(frozen=True)
class Finding:
    """One observation from check_mps_limitations().

    topic: "bf16", "fp16_training", "compile", "distributed", "mps_fallback" or "bitsandbytes".
    level: "info" (good to know) or "warning" (likely to hurt this run).
    """

    topic: str
    level: str
    message: str

    def __str__(self) -> str:
        return f"[{self.level}] {self.topic}: {self.message}"


def mps_bf16_support() -> tuple:
    """Whether bf16 works on MPS here: ("yes" | "no" | "unknown", reason).

    bf16 on MPS needs macOS >= 14 (Sonoma) and torch >= 2.3. When an MPS device is present
    a tiny bf16 computation decides; otherwise the answer is reasoned from the versions.
    """
    tv = _torch_version()
    if tv < (2, 3):
        return "no", f"torch {_version_str(tv)} is older than 2.3, the first with bf16 on MPS"
    if is_mps_available():
        try:
            x = torch.ones(4, dtype=torch.bfloat16, device="mps")
            ok = float((x * 2).sum().item()) == 8.0
        except Exception as exc:
            return "no", f"a bf16 computation on mps failed: {type(exc).__name__}: {exc}"
        if ok:
            return "yes", "a bf16 computation on mps succeeded"
        return "no", "a bf16 computation on mps returned a wrong result"
    mac = _macos_version()
    if mac is None:
        return "unknown", "not running on macOS, so MPS bf16 support cannot be determined"
    if mac < (14, 0):
        return "no", f"macOS {_version_str(mac)} is older than 14 (Sonoma), the first with bf16 on MPS"
    return "yes", (
        f"macOS {_version_str(mac)} >= 14 and torch {_version_str(tv)} >= 2.3 "
        "(not confirmed on a device: MPS is not available)"
    )


def _compile_finding(tv: tuple) -> Finding:
    v = _version_str(tv)
    if tv < (2, 7):
        return Finding("compile", "warning", (
            f"torch {v}: torch.compile's default (inductor) backend has no MPS code generator; "
            "compiling a model on mps fails or, with backend='aot_eager', gives no speed-up. "
            "Leave torch.compile off."
        ))
    if tv < (2, 8):
        return Finding("compile", "warning", (
            f"torch {v}: torch.compile on MPS is an early prototype (torch warns about it); "
            "whole models are likely to fail to compile. Leave it off."
        ))
    return Finding("compile", "info", (
        f"torch {v} includes the MPS inductor backend, but coverage and speed are still "
        "maturing (some patterns fail to compile, some reductions are slower than eager). "
        "Measure before enabling torch.compile."
    ))


def _backend_tiers() -> tuple:
    """(op -> (tier, reason), error). Falls back to "cpu" for everything when unavailable."""
    try:
        from bnb_mps import backend_info  # lazy: may load bitsandbytes and the executors

        info = backend_info()
        if not info:
            # bitsandbytes defines its ops when imported; until then there is nothing to report.
            import bitsandbytes  # noqa: F401

            info = backend_info()
        return {op: (str(d.get("tier", "cpu")), str(d.get("reason", ""))) for op, d in info.items()}, None
    except Exception as exc:
        return {}, f"bnb_mps backend info is unavailable ({type(exc).__name__}: {exc})"


def _op_tier(op: str) -> tuple:
    """(tier, reason) that serves one bitsandbytes op on MPS."""
    tiers, error = _backend_tiers()
    if error is not None:
        return "cpu", error
    if op not in tiers:
        return "cpu", f"bnb_mps reports no implementation of {op}"
    return tiers[op]


def _paged_optimizers_on_mps() -> bool:
    """bnb_mps' hook that runs bitsandbytes' paged optimizers on mps is installed."""
    try:
        from . import paged
    except Exception:
        return False
    return paged.installed()


def _bitsandbytes_finding() -> Finding:
    tiers, error = _backend_tiers()
    if error is not None:
        return Finding("bitsandbytes", "warning", (
            f"{error}; assuming every bitsandbytes op runs on the CPU fallback (slow)."
        ))
    if not tiers:
        return Finding("bitsandbytes", "warning", "bnb_mps reports no bitsandbytes ops.")
    slow = {op: t for op, t in sorted(tiers.items()) if t[0] not in GPU_TIERS}
    if not slow:
        used = sorted({t for t, _ in tiers.values()})
        return Finding("bitsandbytes", "info", (
            f"all {len(tiers)} bitsandbytes ops run on the GPU ({', '.join(used)} tier)."
        ))
    details = "; ".join(f"{op}: {tier} ({reason})" for op, (tier, reason) in slow.items())
    return Finding("bitsandbytes", "warning", (
        f"{len(slow)} of {len(tiers)} bitsandbytes ops are not on a GPU tier: {details}"
    ))


def check_mps_limitations(
    device: DeviceLike,
    dtype: Union[str, torch.dtype] = torch.float32,
    training: bool = False,
    logger: Optional[logging.Logger] = None,
) -> list:
    """List the MPS caveats that apply to running (``training=True``: training) in ``dtype``.

    Returns a list of :class:`Finding`; each is also logged to ``logger`` when one is given
    (warnings at WARNING, the rest at INFO). A device that is not MPS has none of these
    caveats and gets an empty list.
    """
    dev = _as_device(device)
    if isinstance(dtype, str):
        dtype = get_dtype_from_string(dtype)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype or a name such as 'bf16', got {type(dtype).__name__}")
    if dev.type != "mps":
        return []

    tv = _torch_version()
    findings = []

    status, reason = mps_bf16_support()
    bf16_level = "warning" if dtype == torch.bfloat16 and status != "yes" else "info"
    findings.append(Finding("bf16", bf16_level, f"bf16 on MPS: {status} ({reason})."))

    if dtype == torch.float16:
        if training:
            scaler = (
                "available" if tv >= (2, 8) else f"not available (needs torch >= 2.8, found {_version_str(tv)})"
            )
            findings.append(Finding("fp16_training", "warning", (
                "fp16 training is fragile: values above 65504 overflow and small gradients "
                "underflow without loss scaling. torch.amp.GradScaler on MPS is "
                f"{scaler}. Prefer fp32 weights with autocast, or bf16 where supported."
            )))
        else:
            findings.append(Finding("fp16_training", "info", (
                "fp16 is fine for inference on MPS; for training keep fp32 weights and use loss scaling."
            )))

    findings.append(_compile_finding(tv))

    findings.append(Finding("distributed", "info", (
        "distributed training is not available on MPS: torch.distributed has no MPS backend "
        "(NCCL is CUDA-only; gloo handles CPU tensors). Train on the single MPS device."
    )))

    fallback = os.environ.get("PYTORCH_ENABLE_MPS_FALLBACK", "")
    if fallback.strip() not in ("", "0"):
        findings.append(Finding("mps_fallback", "info", (
            f"PYTORCH_ENABLE_MPS_FALLBACK={fallback}: ops without an MPS kernel silently run on "
            "the CPU (correct but slow)."
        )))
    else:
        findings.append(Finding("mps_fallback", "info", (
            "PYTORCH_ENABLE_MPS_FALLBACK is not set: an op without an MPS kernel raises "
            "NotImplementedError. Set it to 1 before torch is imported to run such ops on the CPU."
        )))

    findings.append(_bitsandbytes_finding())

    if logger is not None:
        for f in findings:
            logger.log(logging.WARNING if f.level == "warning" else logging.INFO, "%s", f)
    return findings


# --------------------------------------------------------------------------- data and configs


def dataloader_kwargs(device: DeviceLike, num_workers: Optional[int] = None) -> dict:
    """Keyword arguments for ``torch.utils.data.DataLoader`` suited to ``device``.

    ``pin_memory`` only for CUDA (pinned host memory helps host-to-GPU copies there; MPS
    shares memory with the CPU and does not support it). On MPS ``num_workers`` defaults
    to 0: macOS starts workers by spawning fresh interpreters, which costs more than it
    saves for the usual small fine-tuning datasets. ``persistent_workers`` only with workers.
    """
    dev = _as_device(device)
    if num_workers is None:
        cpus = os.cpu_count() or 1
        num_workers = {"mps": 0, "cuda": min(4, cpus), "cpu": min(2, cpus)}[dev.type]
    elif isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers: expected a non-negative int, got {num_workers!r}")
    return {
        "num_workers": num_workers,
        "pin_memory": dev.type == "cuda",
        "persistent_workers": num_workers > 0,
    }


def _bitsandbytes_importable() -> bool:
    try:
        import bitsandbytes  # noqa: F401  (lazy: heavy, and absent on some installs)
    except Exception:
        return False
    return True


@functools.lru_cache(maxsize=None)
def checkpointing_field() -> str:
    """The name under which the installed ``transformers.TrainingArguments`` takes gradient
    checkpointing without a warning: ``activation_checkpointing`` from transformers 5.24 on (where
    ``gradient_checkpointing`` is a deprecated alias, to be removed in v6), else
    ``gradient_checkpointing``; the newer name when transformers is not installed."""
    import dataclasses
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return "activation_checkpointing"
    try:
        from transformers import TrainingArguments
    except Exception:  # (a broken install: the name the current transformers takes)
        return "activation_checkpointing"
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def training_config(device: DeviceLike) -> dict:
    """``transformers.TrainingArguments`` fields suited to ``device``.

    Keys: optim, fp16, bf16, dataloader_pin_memory, gradient_accumulation_steps, and gradient
    checkpointing under the name the installed transformers takes without a warning
    (``checkpointing_field()``: ``activation_checkpointing`` from transformers 5.24 on, else
    ``gradient_checkpointing``).

    - MPS: when bnb_mps serves ``optimizer_update_8bit_blockwise`` on a GPU tier (native or
      shader), bitsandbytes' 8-bit AdamW: ``optim="paged_adamw_8bit"`` while bnb_mps' paged
      hook is installed (on mps its states are plain device tensors, so it is the same
      computation as ``"adamw_bnb_8bit"``, and the same arguments page on CUDA), else
      ``"adamw_bnb_8bit"``; without a GPU tier ``"adamw_torch"``; no fp16 (see
      check_mps_limitations); bf16 when MPS bf16 works here
      and torch >= 2.6 (bf16 autocast on MPS); gradient checkpointing and 4 accumulation
      steps, because unified memory is shared with the whole system.
    - CUDA: the bitsandbytes 8-bit AdamW when bitsandbytes imports; bf16 where the GPU
      supports it, else fp16; pinned memory.
    - CPU: ``"adamw_torch"`` in fp32.
    """
    dev = _as_device(device)
    if dev.type == "mps":
        tier, reason = _op_tier("optimizer_update_8bit_blockwise")
        if tier in GPU_TIERS:
            optim = "paged_adamw_8bit" if _paged_optimizers_on_mps() else "adamw_bnb_8bit"
        else:
            optim = "adamw_torch"
        logger.info("8-bit optimizer update on MPS is served by the %s tier (%s): optim=%s", tier, reason, optim)
        bf16 = mps_bf16_support()[0] == "yes" and _torch_version() >= (2, 6)
        return {
            "optim": optim,
            "fp16": False,
            "bf16": bf16,
            "dataloader_pin_memory": False,
            checkpointing_field(): True,
            "gradient_accumulation_steps": 4,
        }
    if dev.type == "cuda":
        bf16 = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
        return {
            "optim": "adamw_bnb_8bit" if _bitsandbytes_importable() else "adamw_torch",
            "fp16": not bf16,
            "bf16": bf16,
            "dataloader_pin_memory": True,
            checkpointing_field(): False,
            "gradient_accumulation_steps": 1,
        }
    return {
        "optim": "adamw_torch",
        "fp16": False,
        "bf16": False,
        "dataloader_pin_memory": False,
        checkpointing_field(): False,
        "gradient_accumulation_steps": 1,
    }


# --------------------------------------------------------------------------- memory

# Substrings of out-of-memory messages: CUDA and MPS ("... out of memory"), the CPU
# allocator ("DefaultCPUAllocator: can't allocate memory" / "... not enough memory").
_OOM_MESSAGES = ("out of memory", "can't allocate memory", "not enough memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """True for the out-of-memory errors of CUDA, MPS and the CPU allocator, and MemoryError."""
    if isinstance(exc, MemoryError):
        return True
    oom_types = tuple(
        t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None))
        if isinstance(t, type)
    )
    if oom_types and isinstance(exc, oom_types):
        return True
    if isinstance(exc, RuntimeError):
        message = str(exc).lower()
        return any(m in message for m in _OOM_MESSAGES)
    return False


def _free_memory(device: Optional[torch.device], collect: bool) -> None:
    """Return cached allocator memory so the next try starts clean; never fails.

    ``collect`` runs a full garbage collection first (a tenth of a second with torch
    loaded), worth it after an out-of-memory error whose remains may sit in cycles.
    """
    if collect:
        gc.collect()
    kind = device.type if device is not None else None
    try:
        if kind in (None, "cuda") and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    except Exception:
        pass
    try:
        if kind in (None, "mps") and is_mps_available():
            torch.mps.empty_cache()
    except Exception:
        pass


def _largest_fitting(fits: Callable[[int], bool], start: int, limit: Optional[int]) -> int:
    """Largest n in [start, limit] with fits(n), assuming fits is monotone; 0 if not fits(start).

    Doubling from ``start`` until a failure (or ``limit``), then bisection between the last
    success and the first failure: about 2*log2(answer) calls.
    """
    if not fits(start):
        return 0
    good, bad = start, None
    while bad is None:
        if limit is not None and good >= limit:
            return good
        trial = good * 2 if limit is None else min(good * 2, limit)
        if fits(trial):
            good = trial
        else:
            bad = trial
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def find_max_batch_size(
    step_fn: Callable[[int], object],
    start: int = 8,
    device: Optional[DeviceLike] = None,
    limit: Optional[int] = None,
) -> int:
    """The largest batch size for which ``step_fn(batch_size)`` runs without running out of memory.

    Tries ``start``, then doubles until a size fails (or ``limit`` is reached), then
    bisects between the last success and the first failure. Out-of-memory errors of every
    backend count as failure (see :func:`is_out_of_memory`); any other exception is
    re-raised. Allocator caches are emptied after every try (``device`` says which
    backend's; None: every backend in use), with a garbage collection after a failure.

    Returns 0 when ``start`` itself does not fit (a warning is logged); call again with a
    smaller ``start``. Assumes memory use grows with the batch size.
    """
    if not callable(step_fn):
        raise TypeError(f"step_fn: expected a callable taking a batch size, got {type(step_fn).__name__}")
    if isinstance(start, bool) or not isinstance(start, int) or start < 1:
        raise ValueError(f"start: expected a positive int, got {start!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < start):
        raise ValueError(f"limit: expected None or an int >= start ({start}), got {limit!r}")
    dev = None if device is None else _as_device(device)

    def fits(batch_size: int) -> bool:
        try:
            step_fn(batch_size)
            ok = True
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            ok = False
            first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
            logger.info("batch size %d: out of memory (%s)", batch_size, first_line[:200])
        # Outside the except block the exception and the frames holding its tensors are
        # released, so emptying the caches can actually return their memory.
        _free_memory(dev, collect=not ok)
        return ok

    best = _largest_fitting(fits, start, limit)
    if best == 0:
        logger.warning("batch size %d (the start) already runs out of memory; returning 0", start)
    return best


def memory_stats(device: DeviceLike) -> dict:
    """Memory figures in bytes for ``device``; None where the backend does not report one.

    Keys: "device", "allocated" (tensors alive), "driver_allocated" (held from the driver:
    MPS driver allocation, CUDA caching-allocator reservation), "recommended_max" (MPS
    recommended working-set size, CUDA total device memory). The CPU reports none.
    """
    dev = _as_device(device)
    stats = {"device": str(dev), "allocated": None, "driver_allocated": None, "recommended_max": None}
    if dev.type == "mps" and is_mps_available():
        stats["allocated"] = int(torch.mps.current_allocated_memory())
        stats["driver_allocated"] = int(torch.mps.driver_allocated_memory())
        if hasattr(torch.mps, "recommended_max_memory"):  # absent in older torch
            stats["recommended_max"] = int(torch.mps.recommended_max_memory())
    elif dev.type == "cuda" and torch.cuda.is_available():
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        stats["allocated"] = int(torch.cuda.memory_allocated(index))
        stats["driver_allocated"] = int(torch.cuda.memory_reserved(index))
        stats["recommended_max"] = int(torch.cuda.get_device_properties(index).total_memory)
    return stats
