"""What a verdict holds for: the machine, the tier's float arithmetic, and the cache key made of them."""

from __future__ import annotations

import platform
from typing import Optional

import torch


def machine() -> dict[str, str]:
    """What a verdict holds for: GPU (the Apple chip on a Mac), OS, torch, bitsandbytes, bnb-mps."""
    from ... import chips
    from ..._version import __version__

    chip = chips.detect()
    mac = platform.mac_ver()[0]
    try:
        import bitsandbytes

        bnb_version = bitsandbytes.__version__
    except ImportError:  # pragma: no cover
        bnb_version = "none"
    return {
        "gpu": f"Apple {chip.name}" if chip is not None else f"no Apple GPU ({platform.machine()})",
        "os": f"macOS {mac}" if mac else f"{platform.system()} {platform.release()}",
        "torch": torch.__version__,
        "bitsandbytes": bnb_version,
        "bnb_mps": __version__,
    }


def math_mode(tier: str, executor=None) -> Optional[str]:
    """The float arithmetic the tier's kernels run with, where it can change their results.

    - shader: "safe math", or "fast math" where PYTORCH_MPS_FAST_MATH (read once per process, as
      torch reads it) reaches the kernels' arithmetic: where torch compiles Metal below 3.2, which
      the source's `#pragma METAL fp math_mode(safe)` needs. What it is expected to change there (not
      yet measured on a Mac) is the float arithmetic (reassociation, no NaNs or infinities assumed);
      never contraction (the source's
      unconditional `#pragma clang fp contract(off)`) nor the math functions (the kernels call only
      `metal::precise::` ones): bnb_mps.executors.shader says so in full.
    - native: None (it sets its own compile options, safe math, whatever the variable says).
    - emulated: its float mode (BNB_MPS_EMU_FLOAT, or the executor's own setting)."""
    if tier == "shader":
        from ...executors import shader

        if not shader.fast_math_requested():
            return "safe math"
        mac = platform.mac_ver()[0]
        try:
            macos = tuple(int(p) for p in mac.split(".")[:2]) if mac else None
        except ValueError:
            macos = None
        return "safe math" if shader.math_mode_pinned(macos, shader.torch_version()) else "fast math"
    if tier == "emulated":
        from ...emulator.library import default_float_mode

        mode = getattr(executor, "float_mode", None)
        try:
            return f"float {mode or default_float_mode()}"
        except ValueError as e:  # an unknown BNB_MPS_EMU_FLOAT: launches fail the same way
            return f"float {e}"
    return None


def language(tier: str, executor=None) -> str:
    """The Metal language version the tier's kernels are compiled at ("Metal 3.1"; "Metal default": the
    OS compiler's): it decides which kernels exist (the one-dispatch split-K kernel from 3.2) and what
    the memory model guarantees them (bnb_mps.ops.plan.language_version_of)."""
    from ..plan import language_version_of

    version = language_version_of(executor, tier)
    return "Metal default" if version is None else f"Metal {version[0]}.{version[1]}"


def cache_key(tier: str, source_hash: str, executor=None) -> str:
    """The key of a tier's verdicts (and of tuning's choices): every input that can change a kernel's
    results, the language version they are compiled at included."""
    m = machine()
    parts = [tier, m["gpu"], m["os"], f"torch {m['torch']}", f"bitsandbytes {m['bitsandbytes']}",
             f"bnb-mps {m['bnb_mps']}", f"kernels {source_hash}", language(tier, executor)]  # fmt: skip
    mode_ = math_mode(tier, executor)
    if mode_ is not None:
        parts.append(mode_)
    return " | ".join(parts)
