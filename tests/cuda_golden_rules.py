"""The rules by which bnb-mps' outputs are compared with bitsandbytes' CUDA outputs (tests/data/cuda_golden/).

bitsandbytes builds its CUDA kernels with fast math: an approximate reciprocal (`x * (1 / absmax)`
and `__fdividef`), contraction, flush to zero. Its codes can therefore land on the other side of a
code boundary where the exact scaled value lies within an ulp or two of it. Each rule below allows
exactly that, and shows every such element to be one: the differing codes are neighbours and the
IEEE scaled value (docs/semantics.md, written out in tests/spec_reference.py and reference_int8.py)
lies within `BOUNDARY_ULPS` float32 ulps of the boundary between them. Every function returns a list
of what is wrong (empty when the rule holds).
"""

from __future__ import annotations

import numpy as np
import torch

import spec_reference as sref

F32 = np.float32
BOUNDARY_ULPS = 2  # float32 ulps of the boundary an approximate reciprocal can cross
RECIP_SUBNORMAL = 2.0**126  # above this absmax, fl32(1 / absmax) is a float32 subnormal (CUDA flushes it)

# FP4: the nibble of each magnitude's neighbour above, and the tree constant between them.
_FP4_ORDER = (0, 1, 6, 7, 4, 5, 2, 3)  # nibbles by increasing magnitude
_FP4_BETWEEN = (0.00260417, 0.0859375, 0.20833333, 0.29166667, 0.4166667, 0.583333, 0.8333333)


def _boundary(quant: str, a: int, b: int) -> float | None:
    """The scaled value that separates codes a and b (neighbours), or None if they are not neighbours.
    quant: "q8" (the signed dynamic code), "nf4" or "fp4"."""
    if quant == "q8":
        if abs(a - b) != 1:
            return None
        return float(sref.thresholds(dynamic_code())[min(a, b)])
    if quant == "nf4":
        if abs(a - b) != 1:
            return None
        return float(sref.thresholds(sref.NF4_TABLE)[min(a, b)])
    if (a ^ b) == 8 and (a & 7) == 0:  # +0 and -0: the sign of a value near 0
        return 0.0
    if (a & 8) != (b & 8):
        return None
    i, j = _FP4_ORDER.index(a & 7), _FP4_ORDER.index(b & 7)
    if abs(i - j) != 1:
        return None
    return float(F32(_FP4_BETWEEN[min(i, j)])) * (-1.0 if a & 8 else 1.0)


_CODE8 = None


def dynamic_code() -> np.ndarray:
    global _CODE8
    if _CODE8 is None:
        import bitsandbytes.functional as F

        _CODE8 = F.create_dynamic_map().float().numpy()
    return _CODE8


def near_boundary(s: float, boundary: float) -> bool:
    """|s - boundary| within BOUNDARY_ULPS float32 ulps of the boundary (of the smallest normal at 0)."""
    ulp = float(np.spacing(F32(max(abs(boundary), 2.0**-126))))
    return abs(s - boundary) <= BOUNDARY_ULPS * ulp


def codes(quant: str, ours: np.ndarray, cuda: np.ndarray, scaled: np.ndarray, huge_block: np.ndarray) -> list[str]:
    """Quantize codes (per element, 8-bit indices or 4-bit nibbles): equal to CUDA's except where the
    IEEE scaled value `scaled` is within BOUNDARY_ULPS of the boundary between the two codes, or in a
    block whose absmax is above 2^126 (`huge_block`: CUDA flushes the subnormal reciprocal; ours is
    checked against the IEEE reference elsewhere)."""
    bad = []
    for i in np.flatnonzero(ours != cuda):
        if huge_block[i]:
            continue
        b = _boundary(quant, int(ours[i]), int(cuda[i]))
        if b is None or not near_boundary(float(scaled[i]), b):
            bad.append(f"element {i}: ours {ours[i]}, CUDA {cuda[i]}, scaled value {scaled[i]!r}"
                       f" (boundary {b!r})")  # fmt: skip
    return bad


def int8_codes(ours: torch.Tensor, cuda: torch.Tensor, scaled: np.ndarray) -> list[str]:
    """int8 codes: equal except where the IEEE scaled value lies within BOUNDARY_ULPS of the .5 between
    the two (neighbouring) codes."""
    o, c = ours.numpy().reshape(-1).astype(np.int32), cuda.numpy().reshape(-1).astype(np.int32)
    s = scaled.reshape(-1)
    bad = []
    for i in np.flatnonzero(o != c):
        b = (o[i] + c[i]) / 2.0
        if abs(o[i] - c[i]) != 1 or not near_boundary(float(s[i]), b):
            bad.append(f"element {i}: ours {o[i]}, CUDA {c[i]}, scaled value {s[i]!r}")
    return bad


def ulps(ours: torch.Tensor, cuda: torch.Tensor, floor: float = 0.0) -> float:
    """The largest distance between ours and CUDA's, in ulps of the dtype at max(|CUDA's value|, floor)
    (NaN only equal to NaN, infinities only to themselves: inf ulps otherwise)."""
    a, b = ours.double(), cuda.double()
    both_nan = a.isnan() & b.isnan()
    same = (a == b) | both_nan
    if bool(same.all()):
        return 0.0
    if bool(((~same) & (a.isnan() | b.isnan() | a.isinf() | b.isinf())).any()):
        return float("inf")
    finfo = torch.finfo(cuda.dtype)
    mag = torch.maximum(b.abs(), torch.full_like(b, max(floor, finfo.tiny)))
    ulp = 2.0 ** (torch.floor(torch.log2(mag)) - _NMANT[cuda.dtype])
    return float(((a - b).abs() / ulp).masked_fill(same, 0.0).max())


_NMANT = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}  # explicit significand bits


def bits_equal(ours: torch.Tensor, cuda: torch.Tensor) -> list[str]:
    """Equal bit for bit (NaN equal to NaN), same shape and dtype."""
    if ours.shape != cuda.shape or ours.dtype != cuda.dtype:
        return [f"shape/dtype {tuple(ours.shape)} {ours.dtype}, CUDA {tuple(cuda.shape)} {cuda.dtype}"]
    same = (ours == cuda) | (ours.isnan() & cuda.isnan()) if ours.is_floating_point() else ours == cuda
    n = int((~same).sum())
    return [f"{n} of {ours.numel()} elements differ"] if n else []
