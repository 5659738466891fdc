"""Moving an AdEMAMix8bit state between bitsandbytes' CUDA layout and bnb-mps' (docs/semantics.md 5.1).

AdEMAMix8bit keeps the slow EMA m2 in the second half of `state1` (shape [2, *p.shape]) and its block
scales in the second row of `absmax1` (shape [2, blocks], blocks = ceil(n / 256)). bnb-mps scales m2's
block b by `absmax1[1, b]`. bitsandbytes' CUDA kernel scales it by the flat `absmax1[(n + 256 b) / 256]`,
which is the same slot only when n is a multiple of 256. Otherwise it is `absmax1[0, blocks - 1 + b]`
counted flat: m2's first block shares its slot with the fast EMA's last block (both thread blocks write
it; whichever writes last scales both on the next step), and the last slot is never used. The codes
are the same in both layouts; only the scales move.

A state saved on CUDA (n not a multiple of 256) and loaded on a Mac, or the reverse, must go through
these functions: the shapes are equal.

    from bnb_mps.ademamix_layout import ademamix8bit_state_from_cuda
    optimizer.load_state_dict(torch.load("cuda_optimizer.pt"))
    ademamix8bit_state_from_cuda(optimizer)              # before the first step on the Mac

On a Mac this happens by itself: `install()` (called by `bnb_mps.register()` for mps, undone by
`unregister()`) wraps bitsandbytes' `Optimizer8bit.load_state_dict` so that, after loading, every
AdEMAMix8bit state of a parameter on mps that is in CUDA's layout (`in_cuda_layout`: its last scale
slot, which CUDA never writes, is 0 while the slow EMA's last block holds codes a zero block never
has) is converted, with a warning that says so. A state in CUDA's layout is therefore never read
with shifted scales through `load_state_dict`; tensors set by other means are the caller's to
convert.

`..._from_cuda` is exact: every element dequantizes to what CUDA's next step would read. `..._to_cuda`
must put two scales into one slot: it keeps the larger and re-quantizes the block of the other (the
fast EMA's last block or the slow EMA's first) to it, with docs/semantics.md section 2's rule and the
sign fix of 5.1; the rest is exact.
"""

from __future__ import annotations

import functools
import threading
import warnings

import torch

BLOCK = 256

#: device types whose AdEMAMix8bit states `install()` checks after a load (bnb-mps serves them)
DEVICE_TYPES = ("mps",)


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def _check(state1: torch.Tensor, absmax1: torch.Tensor) -> tuple[int, int]:
    if not isinstance(state1, torch.Tensor) or state1.dtype != torch.uint8 or state1.dim() < 1 or state1.shape[0] != 2:
        raise ValueError(f"state1 must be AdEMAMix8bit's uint8 state of shape [2, *p.shape], got {_describe(state1)}")
    n = state1[0].numel()
    blocks = _blocks(n)
    if not isinstance(absmax1, torch.Tensor) or absmax1.dtype != torch.float32 or absmax1.numel() != 2 * blocks:
        raise ValueError(f"absmax1 must be float32 with 2 * ceil(n / 256) = {2 * blocks} elements for n = {n}, "
                         f"got {_describe(absmax1)}")  # fmt: skip
    return n, blocks


def _describe(t) -> str:
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def ademamix8bit_from_cuda(state1: torch.Tensor, absmax1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(state1, absmax1) of a state in CUDA's layout, in bnb-mps' (new tensors; state1 unchanged)."""
    n, blocks = _check(state1, absmax1)
    flat = absmax1.reshape(-1)
    out = flat.clone()
    if n % BLOCK:
        out[blocks:] = flat[blocks - 1 : 2 * blocks - 1]
    return state1.clone(), out.reshape(absmax1.shape)


def ademamix8bit_to_cuda(state1: torch.Tensor, absmax1: torch.Tensor,
                         qmap1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(state1, absmax1) of a state in bnb-mps' layout, in CUDA's (new tensors). qmap1 is the state's
    signed dynamic code (256 float32 values)."""
    n, blocks = _check(state1, absmax1)
    if not isinstance(qmap1, torch.Tensor) or qmap1.numel() != 256 or not qmap1.is_floating_point():
        raise ValueError(f"qmap1 must be the 256-entry float code, got {_describe(qmap1)}")
    rows = absmax1.reshape(2, blocks)
    codes = state1.reshape(2, -1).clone()
    out = torch.zeros(2 * blocks, dtype=torch.float32, device=absmax1.device)
    out[:blocks] = rows[0]
    if n % BLOCK == 0:
        out[blocks:] = rows[1]
        return codes.reshape(state1.shape), out.reshape(absmax1.shape)
    out[blocks : 2 * blocks - 1] = rows[1, 1:]
    last = slice((blocks - 1) * BLOCK, n)  # the fast EMA's last block
    first = slice(0, min(BLOCK, n))  # the slow EMA's first block
    fast, slow = rows[0, blocks - 1], rows[1, 0]
    shared = torch.maximum(fast, slow)
    code = qmap1.reshape(-1).float().to(absmax1.device)
    codes[0, last] = _requantize(codes[0, last], fast, shared, code)
    codes[1, first] = _requantize(codes[1, first], slow, shared, code)
    out[blocks - 1] = shared
    return codes.reshape(state1.shape), out.reshape(absmax1.shape)


def _requantize(q: torch.Tensor, old: torch.Tensor, new: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """The codes of the values code[q] * old in a block scaled by new: section 2's nearest code of
    fl32(x * fl32(1 / new)) (ties to the even index), then 5.1's sign fix."""
    if bool(old == new):
        return q
    x = code[q.long()] * old
    s = x * (1.0 / new)
    t = (code[:-1] + code[1:]) / 2
    idx = torch.searchsorted(t, s, right=False)  # number of decision points strictly below s
    tie = (idx < t.numel()) & (t[idx.clamp(max=t.numel() - 1)] == s) & (idx % 2 == 1)
    idx = (idx + tie.long()).clamp(0, 255)
    fix = torch.signbit(code[idx]) != torch.signbit(x)
    idx = torch.where(fix, torch.where(x > 0, idx + 1, idx - 1) % 256, idx)
    return idx.to(torch.uint8)


def ademamix8bit_state_from_cuda(optimizer) -> int:
    """Converts, in place, every AdEMAMix8bit parameter state of `optimizer` (a bitsandbytes optimizer
    whose state_dict was saved on CUDA) to bnb-mps' layout. Returns the number of states converted."""
    return _convert(optimizer, lambda st: ademamix8bit_from_cuda(st["state1"], st["absmax1"]))


def ademamix8bit_state_to_cuda(optimizer) -> int:
    """Converts, in place, every AdEMAMix8bit parameter state of `optimizer` to CUDA's layout (before
    saving it for CUDA). Returns the number of states converted."""
    return _convert(optimizer, lambda st: ademamix8bit_to_cuda(st["state1"], st["absmax1"], st["qmap1"]))


def _convert(optimizer, fn) -> int:
    count = 0
    for st in optimizer.state.values():
        if _is_ademamix8(st):
            new1, newa = fn(st)
            st["state1"].copy_(new1)
            st["absmax1"].copy_(newa)
            count += 1
    return count


# -- telling the layouts apart after a load ------------------------------------------------------------


def in_cuda_layout(state1: torch.Tensor, absmax1: torch.Tensor) -> bool:
    """Whether an AdEMAMix8bit state (n not a multiple of 256) is in CUDA's layout: CUDA never writes
    the last scale slot (it stays 0 from the optimizer's initialisation), while in bnb-mps' layout that
    slot is the slow EMA's last block's maximum, 0 only when the whole block is zero, whose codes are
    then 0 or 255 (section 2's NaN path for 0 / 0, then the sign fix). Reads the data (host side)."""
    n, blocks = _check(state1, absmax1)
    if n % BLOCK == 0 or float(absmax1.reshape(-1)[-1]) != 0.0:
        return False
    last = state1.reshape(2, -1)[1, (blocks - 1) * BLOCK : n]
    return bool(((last != 0) & (last != 255)).any())


_lock = threading.Lock()
_original = None


def _is_ademamix8(st) -> bool:
    s1, a1 = (st.get("state1"), st.get("absmax1")) if isinstance(st, dict) else (None, None)
    return (isinstance(s1, torch.Tensor) and s1.dtype == torch.uint8 and s1.dim() >= 2 and s1.shape[0] == 2
            and isinstance(a1, torch.Tensor) and a1.dim() == 2 and a1.shape[0] == 2)  # fmt: skip


def _converting_load(original):
    @functools.wraps(original)
    def load_state_dict(self, state_dict, *args, **kwargs):
        out = original(self, state_dict, *args, **kwargs)
        for p, st in self.state.items():
            device = getattr(p, "device", None)
            if device is None or device.type not in DEVICE_TYPES or not _is_ademamix8(st):
                continue
            if in_cuda_layout(st["state1"], st["absmax1"]):
                st["absmax1"].copy_(ademamix8bit_from_cuda(st["state1"], st["absmax1"])[1])
                warnings.warn(
                    f"bnb_mps: an AdEMAMix8bit state of a parameter of {p.numel()} elements was in bitsandbytes' "
                    "CUDA layout (the slow EMA's scales one slot early); converted to bnb-mps' layout "
                    "(bnb_mps.ademamix_layout, docs/semantics.md section 5.1)", stacklevel=2)  # fmt: skip
        return out

    return load_state_dict


def install() -> bool:
    """Wrap bitsandbytes' Optimizer8bit.load_state_dict (idempotent); False if bitsandbytes has none."""
    global _original
    try:
        from bitsandbytes.optim.optimizer import Optimizer8bit
    except ImportError:
        return False
    with _lock:
        if _original is None:
            current = getattr(Optimizer8bit, "load_state_dict", None)
            if not callable(current):
                return False
            _original = current
            Optimizer8bit.load_state_dict = _converting_load(current)
        return True


def uninstall() -> None:
    """Put bitsandbytes' own load_state_dict back (if ours is still there)."""
    global _original
    with _lock:
        if _original is None:
            return
        from bitsandbytes.optim.optimizer import Optimizer8bit

        if getattr(Optimizer8bit.load_state_dict, "__wrapped__", None) is _original:
            Optimizer8bit.load_state_dict = _original
        _original = None
