"""Paged optimizers (`PagedAdamW8bit`, `PagedAdamW`, `PagedLion8bit`, ..., transformers'
`optim="paged_adamw_8bit"`) on `mps`.

On CUDA, bitsandbytes keeps a paged optimizer's large states in CUDA managed memory, which the
driver pages between GPU and CPU under memory pressure. Apple GPUs share one memory with the CPU,
so on `mps` a plain mps tensor already is what paging emulates. bitsandbytes reaches the CUDA
library for paging in three functions of `bitsandbytes.functional`, and nowhere else:
- `get_paged(*shape, dtype, device)` allocates managed memory (`lib.cget_managed_ptr`);
- `prefetch_tensor(A, to_cpu)` asks the driver to migrate it (`lib.cprefetch`);
- `elementwise_func(name, A, B, value)` (behind `fill` and `_mul`) runs a CUDA kernel on it
  (`lib.cfill_fp32`, ...), then `torch.cuda.synchronize()`.
On a Mac, bitsandbytes' library is the CPU one, so every paged optimizer fails in the first call
("cget_managed_ptr not available"). `install()` wraps these three functions: for `mps` devices
and tensors they allocate a plain mps tensor (marked `is_paged` like bitsandbytes' own, so the
optimizer's code paths stay those of CUDA), do nothing for a prefetch, and fill / multiply with
torch ops on the same stream as every other op (no synchronisation needed); any other device
goes to bitsandbytes' original function unchanged. `uninstall()` puts the originals back.

`bnb_mps.register()` installs the hook (registration with the `mps` key calls `install()`) and
`bnb_mps.unregister()` removes it. bitsandbytes' optimizer classes call these functions through
the module (`F.get_paged`, ...), so wrapping the module attributes is enough: no class is patched.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Optional

import torch

#: the functions of bitsandbytes.functional that this module wraps
WRAPPED = ("get_paged", "prefetch_tensor", "elementwise_func")

#: device types served here (unified memory: a plain device tensor is the paged buffer)
DEVICE_TYPES = ("mps",)

_lock = threading.Lock()
_originals: dict[str, object] = {}
_module = None


def _serves(device) -> bool:
    return device is not None and torch.device(device).type in DEVICE_TYPES


def _get_paged(original):
    @functools.wraps(original)
    def get_paged(*shape, dtype=torch.float32, device=None):
        if not _serves(device):
            return original(*shape, dtype=dtype) if device is None else original(*shape, dtype=dtype, device=device)
        device = torch.device(device)
        out = torch.empty(shape, dtype=dtype, device=device)
        out.is_paged = True
        out.page_deviceid = device.index
        return out

    return get_paged


def _prefetch_tensor(original):
    @functools.wraps(original)
    def prefetch_tensor(A, to_cpu=False):
        if _serves(A.device):
            return None  # one memory for CPU and GPU: nothing to migrate
        return original(A, to_cpu)

    return prefetch_tensor


def _elementwise_func(original):
    @functools.wraps(original)
    def elementwise_func(func_name, A, B, value, prefetch=True):
        if _serves(A.device):
            if func_name == "fill":
                A.fill_(value)
                return None
            if func_name == "_mul":
                A.mul_(B)
                return None
        return original(func_name, A, B, value, prefetch)

    return elementwise_func


_WRAPPERS = {"get_paged": _get_paged, "prefetch_tensor": _prefetch_tensor, "elementwise_func": _elementwise_func}


def install() -> list[str]:
    """Wrap bitsandbytes' paging functions for mps (idempotent); returns the names wrapped.

    Does nothing when bitsandbytes is not imported yet or lacks a function (a version that pages
    differently keeps its own behaviour)."""
    global _module
    functional = sys.modules.get("bitsandbytes.functional")
    if functional is None:
        try:
            import bitsandbytes.functional as functional
        except Exception:
            return []
    with _lock:
        if _module is not None:
            return list(_originals)
        for name in WRAPPED:
            original = getattr(functional, name, None)
            if callable(original):
                _originals[name] = original
                setattr(functional, name, _WRAPPERS[name](original))
        _module = functional
        return list(_originals)


def uninstall() -> None:
    """Put bitsandbytes' own functions back (those still wrapped by us)."""
    global _module
    with _lock:
        if _module is None:
            return
        for name, original in _originals.items():
            current = getattr(_module, name, None)
            if getattr(current, "__wrapped__", None) is original:
                setattr(_module, name, original)
        _originals.clear()
        _module = None


def installed() -> bool:
    return _module is not None


def original(name: str) -> Optional[object]:
    """bitsandbytes' own function `name` while the hook is installed (None otherwise)."""
    return _originals.get(name)
