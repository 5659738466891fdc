"""The table the `mps` suite (tests/test_mps.py) runs on Apple hardware: every kernel family, on
both GPU tiers, through `torch.ops.bitsandbytes.*` on mps tensors, against the references the
emulator tests use.

A family is one `Family` entry in `FAMILIES`:

    Family(
        name="blockwise_8bit",                        # test ids and the acceptance report group by it
        ops=("quantize_blockwise", ...),               # every schema its cases call (checked below)
        cases=blockwise_8bit_cases,                    # n -> iterable of Case, for n in `sizes`
        sizes=(1, 3, 1_000, ..., 16_777_213),          # element counts on a Mac (1 .. 16 M)
        cpu_sizes=(1, 3, 1_000),                       # small ones, run here under the emulator
    )

and a `Case` is one call with its reference:

    Case(label, op, args, want, want_args={}, compare=assert_same_bits, run=None)

- `args`: the schema's arguments in order, on the CPU: tensors (moved to the device as they
  are), plain values, or `DeviceView(base, make)` for a view that must exist on the device
  (`make(base_on_device)`: a transposed or mid-storage view);
- `want`: the reference result (computed on the CPU from the family's reference module, e.g.
  tests/spec_reference.py) or None for ops that return nothing;
- `want_args`: argument index -> reference content after the call (in-place outputs, `out=`);
- `compare(got, want, what)`: raises AssertionError; `assert_same_bits` (bit-exact, NaN equal to
  NaN whatever its sign and payload) or `assert_close(rtol, atol)`;
- `run(device_args)`: a custom call (e.g. bitsandbytes.functional's API); default: the op through
  the dispatcher, `torch.ops.bitsandbytes.<op>(*device_args)`;
- `ieee_want`: for cases of float32 values that Apple GPUs flush (docs/semantics.md section 7), the
  result under IEEE arithmetic, which `compare` must reject (so the case does exercise the flush).

Inputs come from `special_input`, which places NaN, +-inf, -0.0, subnormals, an all-zero block, a
block of tiny and one of huge magnitudes and a block of exact ties inside blocks (never at a block's
first element, never in the first block only), so that almost every block exercises the code search.
The int8 and optimizer families add the special values their sections define (rows and columns of
subnormals, statistics and states near 2^-126 or above 2^126, subnormal gradients). References model
the Apple GPU's float arithmetic (docs/semantics.md section 7: the reference modules' flush mode,
their default). `tests/test_mps_families.py` checks this machinery on the CPU and runs every
family's cases at `cpu_sizes` through the emulator; `test_every_kernel_is_in_a_family` fails when an
op gains a Metal kernel without a table entry.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

import spec_reference as ref

# -- cases and views ----------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceView:
    """An argument that is a view of a larger tensor on the device: `make(base.to(device))`."""

    base: torch.Tensor
    make: Callable[[torch.Tensor], torch.Tensor]

    def on(self, device: str) -> torch.Tensor:
        return self.make(self.base.to(device) if device != "cpu" else self.base.clone())

    def reference(self) -> torch.Tensor:
        """The same view on the CPU, contiguous (what the reference sees)."""
        return self.make(self.base).contiguous()


def assert_same_bits(got: Any, want: Any, what: str = "result") -> None:
    """Bit-exact equality of tensors (and tuples/lists of them), NaN equal to any NaN."""
    if isinstance(want, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(want), f"{what}: {type(got)} vs {type(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_bits(g, w, f"{what}[{i}]")
        return
    if not isinstance(want, torch.Tensor):
        assert got == want, f"{what}: {got!r} != {want!r}"
        return
    assert isinstance(got, torch.Tensor), f"{what}: not a tensor ({type(got)})"
    got = got.detach().cpu()
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    g, w = got.contiguous().reshape(-1), want.contiguous().reshape(-1)
    if g.is_floating_point():
        nan_g, nan_w = torch.isnan(g), torch.isnan(w)
        if not torch.equal(nan_g, nan_w):
            idx = (nan_g != nan_w).nonzero().flatten()[:8].tolist()
            raise AssertionError(f"{what}: NaN positions differ, e.g. at {idx}")
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[g.element_size()]
        g, w = g.masked_fill(nan_g, 0).view(bits), w.masked_fill(nan_w, 0).view(bits)
    if not torch.equal(g, w):
        idx = (g != w).nonzero().flatten()[:8].tolist()
        n_bad = int((g != w).sum())
        sample = [(i, got.reshape(-1)[i].item(), want.reshape(-1)[i].item()) for i in idx[:4]]
        raise AssertionError(f"{what}: {n_bad} of {g.numel()} elements differ; (index, got, want): {sample}")


def assert_close(rtol: float, atol: float) -> Callable[[Any, Any, str], None]:
    """A comparison within `rtol`/`atol` (torch.testing semantics), NaN equal to NaN, same dtype and shape."""

    def compare(got: Any, want: Any, what: str = "result") -> None:
        if isinstance(want, (tuple, list)):
            assert isinstance(got, (tuple, list)) and len(got) == len(want), what
            for i, (g, w) in enumerate(zip(got, want)):
                compare(g, w, f"{what}[{i}]")
            return
        if not isinstance(want, torch.Tensor) or not want.is_floating_point():
            assert_same_bits(got, want, what)
            return
        torch.testing.assert_close(got.detach().cpu(), want, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{what}: {m}")

    return compare


@dataclass
class Case:
    label: str
    op: str
    args: tuple
    want: Any
    want_args: dict[int, Any] = field(default_factory=dict)
    compare: Callable[[Any, Any, str], None] = assert_same_bits
    run: Optional[Callable[[list], Any]] = None
    #: for a case whose inputs hold float32 values the Apple GPU flushes: what the call gives under
    #: IEEE arithmetic (in the form of its result, or of `run`'s), which `compare` must tell from
    #: `want` (tests/test_mps_families.py checks that the case exercises the flush)
    ieee_want: Any = None


@dataclass(frozen=True)
class Family:
    name: str
    ops: tuple[str, ...]
    cases: Callable[[int], Iterable[Case]]
    sizes: tuple[int, ...]
    cpu_sizes: tuple[int, ...]


def to_device(x: Any, device: str) -> Any:
    if isinstance(x, DeviceView):
        return x.on(device)
    if isinstance(x, torch.Tensor):
        return x.to(device) if device != "cpu" else x.clone()
    return x


def _to_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (tuple, list)):
        return type(x)(_to_cpu(v) for v in x)
    return x


def uses_dtype(case: Case, dtype: torch.dtype) -> bool:
    """Whether any input, dtype argument or reference of `case` is of `dtype`."""

    def has(x: Any) -> bool:
        if isinstance(x, DeviceView):
            return x.base.dtype == dtype
        if isinstance(x, torch.Tensor):
            return x.dtype == dtype
        if isinstance(x, (tuple, list)):
            return any(has(v) for v in x)
        if isinstance(x, dict):
            return any(has(v) for v in x.values())
        return x == dtype if isinstance(x, torch.dtype) else False

    return has(case.args) or has(case.want) or has(case.want_args)


def run_case(case: Case, device: str) -> None:
    """Runs one case on `device` and compares its result and in-place outputs with the reference."""
    from bnb_mps.ops import op_packet

    args = [to_device(a, device) for a in case.args]
    got = case.run(args) if case.run is not None else op_packet(case.op)(*args)
    if device != "cpu" and hasattr(torch, device) and hasattr(getattr(torch, device), "synchronize"):
        getattr(torch, device).synchronize()
    case.compare(_to_cpu(got), case.want, f"{case.label}: result")
    for i, want in case.want_args.items():
        case.compare(_to_cpu(args[i]), want, f"{case.label}: argument {i} after the call")


# -- inputs with special values inside blocks -------------------------------------------------------

POINT_SPECIALS = ("nan", "+inf", "-inf", "-0.0", "subnormal")
BLOCK_SPECIALS = ("zero_block", "tiny_block", "huge_block", "tie_block")


def _subnormal(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).tiny) / 4


def tie_values(kind: str) -> torch.Tensor:
    """Values that land exactly on the quantizer's decision points when a block's absmax is 1."""
    if kind == "8bit":
        code = ref.thresholds(np.asarray(signed_code(), dtype=np.float32))
    elif kind == "nf4":
        code = ref.thresholds(ref.NF4_TABLE)
    else:  # fp4: CUDA's tree constants, both signs
        c = np.array([0.29166667, 0.583333, 0.8333333, 0.4166667, 0.0859375, 0.20833333, 0.00260417], np.float32)
        code = np.concatenate([c, -c])
    return torch.from_numpy(np.asarray(code, dtype=np.float32))


def special_input(n: int, dtype: torch.dtype, blocksize: int, seed: int, ties: str = "8bit",
                  scale: float = 2.0) -> tuple[torch.Tensor, dict[str, int]]:
    """`n` values N(0, scale^2) in `dtype`, with special values placed inside blocks.

    Returns the tensor and where each special went: point specials (`POINT_SPECIALS`) map to an
    element index that is never the first element of its block; block specials (`BLOCK_SPECIALS`)
    map to a block index (never the first block nor the partial last one), spread over the tensor.
    With fewer blocks than needed, the block specials that do not fit are left out, and with fewer
    interior positions than point specials, the last point specials. `ties` picks the decision points of the tie block ("8bit", "nf4", "fp4"): it holds
    1.0 at an interior position and those values elsewhere, so that s == threshold exactly (for
    float32 input; 16-bit inputs hold the nearest representable values).
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * scale
    where: dict[str, int] = {}
    if n == 0:
        return x.to(dtype), where
    info = torch.finfo(dtype)
    full_blocks = n // blocksize
    # Block specials: full blocks other than the first, spread evenly.
    usable = list(range(1, full_blocks))
    chosen = [usable[(i * len(usable)) // len(BLOCK_SPECIALS)] for i in range(len(BLOCK_SPECIALS))] \
        if len(usable) >= len(BLOCK_SPECIALS) else []
    for name, b in zip(BLOCK_SPECIALS, chosen):
        lo, hi = b * blocksize, (b + 1) * blocksize
        if name == "zero_block":
            x[lo:hi] = 0
        elif name == "tiny_block":
            x[lo:hi] *= float(info.tiny) * 4
        elif name == "huge_block":
            x[lo:hi] = x[lo:hi].clamp(-3, 3) * (float(info.max) / 4)
        else:
            t = tie_values(ties)
            vals = t[torch.randint(0, t.numel(), (blocksize,), generator=g)]
            x[lo:hi] = vals
            x[lo + blocksize // 3] = 1.0  # the block's absmax, at an interior position
        where[name] = b
    # Point specials: interior positions (not a block's first element) of the other blocks,
    # spread evenly over all of them.
    nblocks = math.ceil(n / blocksize)
    blocks = np.array([b for b in range(nblocks) if b not in set(chosen)], dtype=np.int64)
    interior = np.minimum(n, (blocks + 1) * blocksize) - blocks * blocksize - 1
    cumulative = np.cumsum(interior)
    total = int(cumulative[-1]) if len(cumulative) else 0
    k = len(POINT_SPECIALS)
    for i, name in enumerate(POINT_SPECIALS[: min(k, total)]):
        target = (total * (2 * i + 1)) // (2 * k) if total >= k else i
        j = int(np.searchsorted(cumulative, target, side="right"))
        within = target - (int(cumulative[j - 1]) if j else 0)
        pos = int(blocks[j]) * blocksize + 1 + within
        x[pos] = {"nan": float("nan"), "+inf": float("inf"), "-inf": -float("inf"), "-0.0": -0.0,
                  "subnormal": _subnormal(dtype)}[name]
        where[name] = pos
    return x.to(dtype), where


def finite_input(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Weight-like values: N(0, 1) with an all-zero run of 64 elements in the middle, no inf/NaN."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    if n >= 256:
        x[n // 2 - n // 2 % 64 : n // 2 - n // 2 % 64 + 64] = 0
    return x.to(dtype)


# -- the quantization families (docs/semantics.md sections 1-3, reference: tests/spec_reference.py) --


def signed_code() -> torch.Tensor:
    from bitsandbytes.functional import create_dynamic_map

    return create_dynamic_map(signed=True)


def unsigned_code() -> torch.Tensor:
    from bitsandbytes.functional import create_dynamic_map

    return create_dynamic_map(signed=False)


QUANT_SIZES = (1, 2, 3, 63, 1_000, 4_097, 65_539, 1_048_583, 16_777_213)
QUANT_CPU_SIZES = (1, 3, 1_000, 4_097)
#: sizes that also get the feature cases (views, .out, storage types, functional API, empty)
FEATURE_SIZES = (1_000, 65_539)
LARGE = 100_000
HUGE = 4_000_000


def _grid(n: int, *axes: tuple) -> list[tuple]:
    """Every combination for small n; for large n a rotation that visits every value of every
    axis; for huge n (16 M) two combinations (keeps the CPU reference affordable)."""
    import itertools

    full = list(itertools.product(*axes))
    if n < LARGE:
        return full
    longest = max(len(a) for a in axes)
    rotation = [tuple(a[(i + k) % len(a)] for k, a in enumerate(axes)) for i in range(longest)]
    return rotation if n < HUGE else rotation[:: max(1, len(rotation) // 2)][:2]


def _seed(*parts) -> int:
    """A seed that is the same in every process (unlike hash())."""
    return zlib.crc32(repr(parts).encode())


def blockwise_8bit_cases(n: int) -> Iterator[Case]:
    code = signed_code()
    for dtype, bs in _grid(n, ref.DTYPES, ref.BLOCKSIZES_8BIT):
        A, _ = special_input(n, dtype, bs, seed=_seed("8bit", n, dtype, bs), ties="8bit")
        q, absmax = ref.quantize_blockwise(A, code, bs)
        tag = f"n={n} {dtype} blocksize={bs}"
        yield Case(f"quantize_blockwise {tag}", "quantize_blockwise", (A, code, bs), (q, absmax))
        for out_dtype in ref.DTYPES if n < LARGE else (dtype,):
            yield Case(f"dequantize_blockwise {tag} -> {out_dtype}", "dequantize_blockwise",
                       (q, absmax, code, bs, out_dtype), ref.dequantize_blockwise(q, absmax, code, bs, out_dtype))
    if n in FEATURE_SIZES:
        yield from _blockwise_8bit_features(n)


def _blockwise_8bit_features(n: int) -> Iterator[Case]:
    code, bs = signed_code(), 256
    rows = 8
    cols = math.ceil(n / rows)
    # A transposed (non-contiguous) input: the result of its contiguous copy.
    base, _ = special_input(rows * cols, torch.float16, bs, seed=_seed("8bit-t", n))
    view = DeviceView(base.reshape(cols, rows), lambda b: b.t())
    yield Case(f"quantize_blockwise transposed input {rows}x{cols}", "quantize_blockwise", (view, code, bs),
               ref.quantize_blockwise(view.reference(), code, bs))
    # A mid-storage input (storage offset not a multiple of 16 bytes).
    big, _ = special_input(n + 13, torch.bfloat16, bs, seed=_seed("8bit-m", n))
    mid = DeviceView(big, lambda b: b[5 : 5 + n])
    yield Case(f"quantize_blockwise mid-storage input n={n}", "quantize_blockwise", (mid, code, bs),
               ref.quantize_blockwise(mid.reference(), code, bs))
    # The unsigned code, non-negative data.
    pos, _ = special_input(n, torch.float32, 64, seed=_seed("8bit-u", n))
    pos = pos.abs()
    ucode = unsigned_code()
    yield Case(f"quantize_blockwise unsigned code n={n}", "quantize_blockwise", (pos, ucode, 64),
               ref.quantize_blockwise(pos, ucode, 64))
    # Dequantize from mid-storage codes and absmax.
    A, _ = special_input(n, torch.float32, bs, seed=_seed("8bit-d", n))
    q, absmax = ref.quantize_blockwise(A, code, bs)
    qv = DeviceView(torch.cat([torch.zeros(3, dtype=torch.uint8), q]), lambda b: b[3:])
    av = DeviceView(torch.cat([torch.ones(1), absmax]), lambda b: b[1:])
    yield Case(f"dequantize_blockwise mid-storage inputs n={n}", "dequantize_blockwise",
               (qv, av, code, bs, torch.float16), ref.dequantize_blockwise(q, absmax, code, bs, torch.float16))
    # .out: contiguous, transposed and mid-storage outputs (the op returns nothing).
    want = ref.dequantize_blockwise(q, absmax, code, bs, torch.bfloat16)
    outs = {
        "contiguous": DeviceView(torch.full((n,), 7.0, dtype=torch.bfloat16), lambda b: b),
        "mid-storage": DeviceView(torch.full((n + 9,), 7.0, dtype=torch.bfloat16), lambda b: b[9:]),
    }
    for name, out in outs.items():
        yield Case(f"dequantize_blockwise.out {name} out n={n}", "dequantize_blockwise.out",
                   (q, absmax, code, bs, torch.bfloat16, out), None, want_args={5: want})
    q2 = q[: rows * (n // rows)].reshape(rows, n // rows)
    want2 = ref.dequantize_blockwise(q2, absmax, code, bs, torch.float32)
    tout = DeviceView(torch.full((n // rows, rows), 7.0), lambda b: b.t())
    yield Case(f"dequantize_blockwise.out transposed out {rows}x{n // rows}", "dequantize_blockwise.out",
               (q2, absmax, code, bs, torch.float32, tout), None, want_args={5: want2})
    # Empty tensors.
    empty = torch.empty(0, 16, dtype=torch.float16)
    yield Case("quantize_blockwise empty", "quantize_blockwise", (empty, code, bs),
               (torch.empty(0, 16, dtype=torch.uint8), torch.empty(0)))
    yield Case("dequantize_blockwise empty", "dequantize_blockwise",
               (torch.empty(0, 16, dtype=torch.uint8), torch.empty(0), code, bs, torch.float32), torch.empty(0, 16))
    # bitsandbytes.functional, with nested (double) quantization of the absmax (finite weights:
    # an inf would make the mean of absmax, the offset, inf).
    yield _functional_8bit_nested(finite_input(n, torch.float16, seed=_seed("8bit-fn", n)), 4096 if n >= 8192 else 64)


def _functional_8bit_nested(A: torch.Tensor, bs: int) -> Case:
    """F.quantize_blockwise(nested=True) then F.dequantize_blockwise: codes, nested statistics
    and the round trip against the reference (the offset is the device's mean of absmax,
    checked against float64)."""
    code = signed_code()
    q_ref, absmax_ref = ref.quantize_blockwise(A, code, bs)

    def run(args):
        import bitsandbytes.functional as F

        q, state = F.quantize_blockwise(args[0], blocksize=bs, nested=True)
        out = F.dequantize_blockwise(q, state)
        return q, state.absmax, state.state2.absmax, state.offset.reshape(1).float(), out

    def compare(got, want, what):
        q, qabsmax, nested, offset, out = got
        assert_same_bits(q, q_ref, f"{what} codes")
        mean = float(np.mean(absmax_ref.numpy().astype(np.float64)))
        assert abs(float(offset[0]) - mean) <= 1e-6 * max(1.0, abs(mean)), f"{what} offset {float(offset[0])} vs {mean}"
        off = offset[0]
        q8, nested_ref = ref.quantize_blockwise(absmax_ref - off, code, bs)
        assert_same_bits(qabsmax, q8, f"{what} quantized absmax")
        assert_same_bits(nested, nested_ref, f"{what} nested absmax")
        # bitsandbytes adds the offset to the dequantized absmax on the device: float32 arithmetic too
        scales = ref.nested_scales(q8, code, nested_ref, off, blocksize=bs)
        assert_same_bits(out, ref.dequantize_blockwise(q_ref, scales, code, bs, A.dtype), f"{what} dequantized")

    return Case(f"functional quantize_blockwise(nested=True) blocksize={bs} n={A.numel()}", "quantize_blockwise",
                (A,), None, compare=compare, run=run)


def fourbit_cases(n: int) -> Iterator[Case]:
    for dtype, bs, qt in _grid(n, ref.DTYPES, ref.BLOCKSIZES_4BIT, ("nf4", "fp4")):
        A, _ = special_input(n, dtype, bs, seed=_seed("4bit", n, dtype, bs, qt), ties=qt)
        packed, absmax = ref.quantize_4bit(A, bs, qt)
        tag = f"{qt} n={n} {dtype} blocksize={bs}"
        yield Case(f"quantize_4bit {tag}", "quantize_4bit", (A, bs, qt, torch.uint8), (packed, absmax))
        for out_dtype in ref.DTYPES if n < LARGE else (dtype,):
            yield Case(f"dequantize_4bit {tag} -> {out_dtype}", "dequantize_4bit",
                       (packed, absmax, bs, qt, [n], out_dtype),
                       ref.dequantize_4bit(packed, absmax, bs, qt, (n,), out_dtype))
    if n in FEATURE_SIZES:
        yield from _fourbit_features(n)


def _fourbit_features(n: int) -> Iterator[Case]:
    bs, qt = 64, "nf4"
    rows = 8
    n8 = rows * (n // rows)  # a multiple of 8: packed bytes divide into every storage itemsize
    A, _ = special_input(n8, torch.float16, bs, seed=_seed("4bit-f", n), ties=qt)
    A2 = A.reshape(rows, n8 // rows)
    packed, absmax = ref.quantize_4bit(A2, bs, qt)
    # Non-uint8 quant_storage: the packed bytes viewed as that dtype; dequantize reads the bytes.
    for storage in (torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.int32):
        want = ref.quantize_4bit(A2, bs, qt, storage)
        yield Case(f"quantize_4bit quant_storage={storage} {rows}x{n8 // rows}", "quantize_4bit",
                   (A2, bs, qt, storage), want)
        yield Case(f"dequantize_4bit from quant_storage={storage}", "dequantize_4bit",
                   (want[0], want[1], bs, qt, [rows, n8 // rows], torch.float32),
                   ref.dequantize_4bit(want[0], want[1], bs, qt, (rows, n8 // rows), torch.float32))
    # Transposed and mid-storage inputs.
    tv = DeviceView(A2.t().contiguous(), lambda b: b.t())
    yield Case("quantize_4bit transposed input", "quantize_4bit", (tv, 32, "fp4", torch.uint8),
               ref.quantize_4bit(tv.reference(), 32, "fp4"))
    big, _ = special_input(n + 11, torch.float32, 128, seed=_seed("4bit-m", n), ties="fp4")
    mid = DeviceView(big, lambda b: b[3 : 3 + n])
    yield Case(f"quantize_4bit mid-storage input n={n}", "quantize_4bit", (mid, 128, "fp4", torch.uint8),
               ref.quantize_4bit(mid.reference(), 128, "fp4"))
    pv = DeviceView(torch.cat([torch.zeros(5, dtype=torch.uint8), packed.reshape(-1)]), lambda b: b[5:].reshape(-1, 1))
    av = DeviceView(torch.cat([torch.ones(2), absmax]), lambda b: b[2:])
    yield Case("dequantize_4bit mid-storage inputs", "dequantize_4bit", (pv, av, bs, qt, [rows, n8 // rows], torch.bfloat16),
               ref.dequantize_4bit(packed, absmax, bs, qt, (rows, n8 // rows), torch.bfloat16))
    # .out into contiguous, transposed and mid-storage outputs.
    shape = [rows, n8 // rows]
    want = ref.dequantize_4bit(packed, absmax, bs, qt, tuple(shape), torch.float16)
    outs = {
        "contiguous": DeviceView(torch.full(shape, 3.0, dtype=torch.float16), lambda b: b),
        "transposed": DeviceView(torch.full(shape[::-1], 3.0, dtype=torch.float16), lambda b: b.t()),
        "mid-storage": DeviceView(torch.full((n8 + 6,), 3.0, dtype=torch.float16), lambda b: b[6:].reshape(shape)),
    }
    for name, out in outs.items():
        yield Case(f"dequantize_4bit.out {name} out", "dequantize_4bit.out",
                   (packed, absmax, bs, qt, shape, torch.float16, out), None, want_args={6: want})
    # Empty tensors.
    yield Case("quantize_4bit empty", "quantize_4bit", (torch.empty(0, 16), bs, qt, torch.uint8),
               (torch.empty(0, 1, dtype=torch.uint8), torch.empty(0)))
    yield Case("dequantize_4bit empty", "dequantize_4bit",
               (torch.empty(0, 1, dtype=torch.uint8), torch.empty(0), bs, qt, [0, 16], torch.float32), torch.empty(0, 16))
    # bitsandbytes.functional with double quantization (compress_statistics=True).
    W = finite_input(n8, torch.bfloat16, seed=_seed("4bit-fn", n)).reshape(rows, n8 // rows)
    for quant_type in ("nf4", "fp4"):
        yield _functional_4bit_double_quant(W, 64, quant_type)


def _functional_4bit_double_quant(A: torch.Tensor, bs: int, qt: str) -> Case:
    """F.quantize_4bit(compress_statistics=True) and F.dequantize_4bit: packed bytes, the 8-bit
    absmax with its nested absmax and offset, and the dequantized weights (docs/semantics.md section 3)."""
    code = signed_code()
    packed_ref, absmax_ref = ref.quantize_4bit(A, bs, qt)

    def run(args):
        import bitsandbytes.functional as F

        packed, state = F.quantize_4bit(args[0], blocksize=bs, compress_statistics=True, quant_type=qt)
        out = F.dequantize_4bit(packed, state)
        return packed, state.absmax, state.state2.absmax, state.offset.reshape(1).float(), out

    def compare(got, want, what):
        packed, qabsmax, nested, offset, out = got
        assert_same_bits(packed, packed_ref, f"{what} packed")
        mean = float(np.mean(absmax_ref.numpy().astype(np.float64)))
        assert abs(float(offset[0]) - mean) <= 1e-6 * max(1.0, abs(mean)), f"{what} offset {float(offset[0])} vs {mean}"
        off = offset[0]
        q8, nested_ref = ref.quantize_blockwise(absmax_ref - off, code, 256)
        assert_same_bits(qabsmax, q8, f"{what} 8-bit absmax")
        assert_same_bits(nested, nested_ref, f"{what} nested absmax")
        scales = ref.nested_scales(q8, code, nested_ref, off)
        assert_same_bits(out, ref.dequantize_4bit(packed_ref, scales, bs, qt, tuple(A.shape), A.dtype), f"{what} dequantized")

    return Case(f"functional quantize_4bit(compress_statistics=True) {qt} {tuple(A.shape)}", "quantize_4bit", (A,), None,
                compare=compare, run=run)


# -- 4-bit matrix products (gemv_4bit, gemm_4bit) ----------------------------------------------------
# n counts the weight's elements (N * K); each size gets the three kernel paths (M = 1, 5, 40), fp16,
# bf16 and fp32, plain and nested absmax, with and without bias, compared with the float64
# reference of docs/semantics.md section 4 under its accuracy rule (reference_matmul_4bit.check_accuracy).

MATMUL_SHAPES = {1: (1, 1), 4_160: (4, 1_040), 4_096: (64, 64), 16_777_216: (4_096, 4_096)}


def _matmul_compare(got: Any, want: Any, what: str = "result") -> None:
    import reference_matmul_4bit as R

    if want is None:
        assert got is None, f"{what}: expected nothing, got {type(got)}"
        return
    A, W, bias, N = want
    try:
        R.check_accuracy(got.reshape(-1, N), A.reshape(-1, A.shape[-1]), W, bias,
                         linear_device="mps" if torch.backends.mps.is_available() else "cpu")  # fmt: skip
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from None


def matmul_4bit_cases(n: int) -> Iterator[Case]:
    import matmul_4bit_cases as mc
    import reference_matmul_4bit as R

    N, K = MATMUL_SHAPES[n]
    for i, (M, dtype, nested, bias) in enumerate(_grid(n, (1, 5, 40), ref.DTYPES, (False, True), (False, True))):
        c = mc.Case(M, N, K, dtype=dtype, blocksize=64 if K % 64 == 0 or K < 64 else 32, nested=nested, bias=bias,
                    seed=_seed("gemm", n, i))  # fmt: skip
        A, args, W, b = mc.gemm_args(c)
        yield Case(f"gemm_4bit {c}", "gemm_4bit", tuple(args), (A, W, b, N), compare=_matmul_compare)
    for i, (M, dtype, qt) in enumerate(_grid(n, (1, 3), ref.DTYPES, ("nf4", "fp4"))):
        c = mc.Case(M, N, K, dtype=dtype, quant_type=qt, seed=_seed("gemv", n, i))
        A, (_, packed, shapeB, absmax, *_rest), W, _ = mc.gemm_args(c)
        code = torch.from_numpy(R.table(qt).copy())
        args = (A, packed, shapeB, absmax, code, c.blocksize)
        yield Case(f"gemv_4bit {c}", "gemv_4bit", args, (A, W, None, N), compare=_matmul_compare)
        out = torch.full((M, N), float("nan"), dtype=dtype)
        yield Case(f"gemv_4bit.out {c}", "gemv_4bit.out", args + (out,), None, want_args={6: (A, W, None, N)},
                   compare=_matmul_compare)  # fmt: skip
    if n == 4_096:
        yield from matmul_4bit_flush_cases()


# docs/semantics.md section 7 on the three paths of the 4-bit products (M = 1: gemv, 5: small, 40: mma,
# at K = 128), the model the emulator's "apple" float mode was built on (tests/test_kernels_matmul_4bit.py
# runs the same inputs in both of its float modes): what a Mac computes here checks that model.
APPLE_PATHS = {"gemv": 1, "small": 5, "mma": 40}
HUGE_SCALES = [1.5 * 2.0**126, 2.0**126 * (1 + 2.0**-23), 2.0**127, 1e38, 3e38, float(torch.finfo(torch.float32).max)]
SUBNORMAL_SCALES = [1e-39, -5e-40, 2.0**-149, float(torch.finfo(torch.float32).tiny) * (1 - 2.0**-23), 3e-39]


def _unit_blocks(N: int, K: int, blocksize: int, quant_type: str, seed: int) -> torch.Tensor:
    """Packed nibbles of a random weight whose every block has absmax 1: with a block scale s the weight
    is table[nibble] * s (the cases set the scales)."""
    W = torch.randn(N * K, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).reshape(-1, blocksize)
    W = (W / W.abs().amax(1, keepdim=True)).float().reshape(N, K)
    nib, absmax = ref.quantize_4bit_nibbles(W, blocksize, quant_type, flush=False)
    assert (absmax == 1).all()
    return torch.from_numpy(ref.pack_nibbles(nib)).reshape(-1, 1)


def _flush_compare(got: Any, want: Any, what: str = "result") -> None:
    """docs/semantics.md section 4's accuracy rule against the flushed reference (section 7)."""
    import reference_matmul_4bit as R

    A, W, N = want
    try:
        R.check_accuracy(got.reshape(-1, N), A.reshape(-1, A.shape[-1]), W,
                         linear_device="mps" if torch.backends.mps.is_available() else "cpu")  # fmt: skip
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from None


def matmul_4bit_flush_cases() -> Iterator[Case]:
    """On each path, float32 and bfloat16 activations, NF4 and FP4 (one per dtype):
    - block scales above 2^126 up to the float32 maximum: the IEEE product (no float32 value below
      2^-126 arises);
    - activations below 2^-126 meeting blocks above 2^126: they count as zero (IEEE's products, about
      0.01 to 1 each, would change the result);
    - block scales below 2^-126: their rows' outputs are exactly 0 (IEEE's, with activations near
      1e30, about 1e-9).
    The last two carry the IEEE answer (`ieee_want`), which their comparison must reject."""
    import reference_matmul_4bit as R

    K, bs = 128, 64
    tiny = float(torch.finfo(torch.float32).tiny)
    for path, M in APPLE_PATHS.items():
        for dtype, qt in ((torch.float32, "nf4"), (torch.bfloat16, "fp4")):
            g = torch.Generator().manual_seed(_seed("apple-4bit", M, str(dtype)))
            N = 9
            packed = _unit_blocks(N, K, bs, qt, seed=_seed("unit", M, qt))
            huge = torch.tensor([HUGE_SCALES[b % len(HUGE_SCALES)] for b in range(N * K // bs)], dtype=torch.float32)
            A = (torch.randn(M, K, generator=g) * 2.0**-24).to(dtype)  # |y| stays below the float32 maximum
            yield _flush_case(f"gemm_4bit {path} M={M} {dtype} {qt} block scales above 2^126", A, packed, huge, N, K,
                              bs, qt, R, ieee=False)  # fmt: skip
            A = torch.randn(M, K, generator=g)
            A[:, : K // 2] = (torch.rand(M, K // 2, generator=g) - 0.5) * 2 * tiny  # subnormals, both signs
            A[:, : K // 2 : 7] = 0.0
            A = A.to(dtype)
            # each weight row: block 0 (the columns of the subnormal activations) huge, block 1 ordinary
            mixed = torch.tensor([HUGE_SCALES[b // 2 % 6] if b % 2 == 0 else 1.0 for b in range(2 * N)])
            yield _flush_case(f"gemm_4bit {path} M={M} {dtype} {qt} activations below 2^-126", A, packed, mixed, N, K,
                              bs, qt, R, ieee=True)  # fmt: skip
            N = 10
            packed = _unit_blocks(N, K, bs, qt, seed=_seed("unit-sub", M, qt))
            scales = torch.tensor([SUBNORMAL_SCALES[b // 2 % 5] if b // 2 % 2 == 0 else 2.0**-100
                                   for b in range(2 * N)])  # fmt: skip  (rows 0, 2, ...: every block subnormal)
            A = (torch.randn(M, K, generator=g) * 1e30).to(dtype)
            yield _flush_case(f"gemm_4bit {path} M={M} {dtype} {qt} block scales below 2^-126", A, packed, scales, N,
                              K, bs, qt, R, ieee=True)  # fmt: skip


def _flush_case(label, A, packed, absmax, N, K, bs, qt, R, ieee: bool) -> Case:
    W = R.dequantized_weight(packed, (N, K), bs, qt, absmax)
    ieee_want = None
    if ieee:
        W_ieee = R.dequantized_weight(packed, (N, K), bs, qt, absmax, flush=False)
        ieee_want = torch.from_numpy(R.matmul(A, W_ieee)).to(A.dtype)
    return Case(label, "gemm_4bit", (A, packed, [N, K], absmax, bs, qt), (A, W, N), compare=_flush_compare,
                ieee_want=ieee_want)


# -- LLM.int8() ------------------------------------------------------------------------------------
# n counts the activation's elements (M * K); the weight is [N, K] with a small N so that the float64
# / int64 references stay affordable at 16 M. Codes, statistics, outlier columns and int32 products
# must be bit-exact; dequantized outputs within what tests/test_int8_mps.py allows a GPU compiler
# (one spacing of the dtype plus a few float32 roundings of the magnitudes involved).

INT8_SHAPES = {1: (1, 1, 1), 4_096: (16, 24, 256), 1_048_576: (256, 64, 4_096), 16_777_216: (4_096, 32, 4_096)}


def _int8_activations(M: int, K: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * 1.5
    if K > 2:
        x[:, 1] = 7.0  # outlier feature columns (|x| >= 6.0), not the first column
        x[:, K - 1] = -9.5
    return x.to(dtype)


def _int8_specials(x: torch.Tensor) -> torch.Tensor:
    """x with the values docs/semantics.md sections 6 and 7 define, where x has room (at least 6 rows
    and 8 columns): a row of zeros and subnormals of x's dtype (float32 and bfloat16 ones count as
    zero: row statistic 0, codes 0; float16's are ordinary values), subnormal elements in an
    ordinary row, a column of subnormals (column statistic 0), a NaN (left out of the maxima, code
    0) and a -inf (its row's maximum at threshold 0, where every code of the row is 0; an outlier
    column at threshold 6)."""
    M, K = x.shape
    if M < 6 or K < 8:
        return x
    g = torch.Generator().manual_seed(M * K)
    tiny = float(torch.finfo(x.dtype).tiny)
    sub = lambda *shape: ((torch.rand(*shape, generator=g, dtype=torch.float64) - 0.5) * 1.98 * tiny).to(  # noqa: E731
        x.dtype)
    x = x.clone()
    x[2] = sub(K)
    x[2, ::4] = 0
    x[3, 3::5] = sub(len(range(3, K, 5)))
    x[:, 2] = sub(M)
    x[4, K // 2] = float("nan")
    x[5, K // 3] = -float("inf")
    return x


def _close_within(bound: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[Any, Any, str], None]:
    """A comparison: |got - want| <= bound(got, want) elementwise (float64), same dtype and shape."""

    def compare(got: Any, want: Any, what: str = "result") -> None:
        if want is None:
            assert got is None, what
            return
        assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), f"{what}: {got.dtype} {tuple(got.shape)}"
        err = (got.double() - want.double()).abs()
        allowed = bound(got, want)
        bad = err > allowed
        assert not bad.any(), f"{what}: {int(bad.sum())} of {err.numel()} elements beyond the bound"

    return compare


def int8_cases(n: int) -> Iterator[Case]:
    import reference_int8 as R8

    M, N, K = INT8_SHAPES[n]
    for i, (dtype, threshold) in enumerate(_grid(n, ref.DTYPES, (0.0, 6.0))):
        A = _int8_specials(_int8_activations(M, K, dtype, _seed("int8q", n, i)))
        apple = dtype != torch.float16 and M >= 6 and K >= 8  # holds float32 subnormals
        tag = f"{M}x{K} {dtype} t={threshold}{' specials' if M >= 6 and K >= 8 else ''}"
        yield Case(f"int8_vectorwise_quant {tag}", "int8_vectorwise_quant", (A, threshold),
                   R8.int8_vectorwise_quant(A, threshold),
                   ieee_want=R8.int8_vectorwise_quant(A, threshold, flush=False) if apple else None)  # fmt: skip
        yield Case(f"int8_double_quant {tag}", "int8_double_quant", (A, threshold), R8.int8_double_quant(A, threshold),
                   ieee_want=R8.int8_double_quant(A, threshold, flush=False) if apple else None)  # fmt: skip
    X = _int8_activations(M, K, torch.float16, _seed("int8x", n))
    W = _int8_activations(N, K, torch.float16, _seed("int8w", n)) * 0.05
    CA, SCA, cols = R8.int8_vectorwise_quant(X, 6.0)
    CB, SCB, _ = R8.int8_vectorwise_quant(W, 0.0)
    acc = R8.int8_linear_matmul(CA, CB)
    yield Case(f"int8_linear_matmul {M}x{N}x{K}", "int8_linear_matmul", (CA, CB), acc)
    yield Case(f"int8_linear_matmul.out {M}x{N}x{K}", "int8_linear_matmul.out",
               (CA, CB, torch.full((M, N), -1, dtype=torch.int32)), None, want_args={2: acc})  # fmt: skip
    deq = R8.int8_vectorwise_dequant(CB, SCB)
    yield Case(f"int8_vectorwise_dequant {N}x{K}", "int8_vectorwise_dequant", (CB, SCB), deq,
               compare=_close_within(lambda g, w: 2 * R8.spacing(w, torch.float32)))  # fmt: skip

    def dequant_bound(bias):
        mag = acc.double().abs() * SCA.double()[:, None] * SCB.double()[None, :] / 16129
        if bias is not None:
            mag = mag + bias.double().abs()[None, :]
        return lambda g, w: R8.spacing(w, g.dtype) + 8 * 2.0**-24 * mag

    for i, (dtype, with_bias) in enumerate(_grid(n, ref.DTYPES, (False, True))):
        bias = torch.randn(N, generator=torch.Generator().manual_seed(_seed("bias", n, i))).to(dtype) if with_bias else None
        label = f"{M}x{N}x{K} {dtype}{' bias' if with_bias else ''}"
        yield Case(f"int8_mm_dequant {label}", "int8_mm_dequant", (acc, SCA, SCB, dtype, bias),
                   R8.int8_mm_dequant(acc, SCA, SCB, dtype, bias), compare=_close_within(dequant_bound(bias)))
        yield Case(f"int8_scaled_mm {label}", "int8_scaled_mm", (CA, CB, SCA, SCB, bias, dtype),
                   R8.int8_scaled_mm(CA, CB, SCA, SCB, bias, dtype), compare=_close_within(dequant_bound(bias)))
    bias = torch.randn(N, generator=torch.Generator().manual_seed(_seed("mixed", n))).half()
    want, want_sub, exact = R8.int8_mixed_scaled_mm(X, CA, CB, SCA, SCB, cols, bias)

    def mixed_compare(got: Any, _want: Any, what: str = "result") -> None:
        out, subA = got
        assert_same_bits(subA, want_sub, f"{what}: subA")
        allowed = R8.mixed_allowance(out, exact, X, CA, CB, SCA, SCB, cols, bias) * 2
        assert ((out.double() - exact).abs() <= allowed).all(), f"{what}: out beyond the float32 allowance"

    yield Case(f"int8_mixed_scaled_mm {M}x{N}x{K} outliers={cols.numel()}", "int8_mixed_scaled_mm",
               (X, CA, CB, SCA, SCB, cols, bias), (want, want_sub), compare=mixed_compare)  # fmt: skip
    if n < LARGE and M * N > 1:
        yield from _int8_flush_cases(CA, CB, SCA, SCB, acc)


def _int8_flush_cases(CA, CB, SCA, SCB, acc) -> Iterator[Case]:
    """The dequantizers with statistics near 2^-64 (products and results below 2^-126: zeros on the
    GPU) and a float32 / bfloat16 subnormal bias (counts as zero): the flushed reference bit for bit
    (these kernels round the way docs/semantics.md writes it)."""
    import reference_int8 as R8

    M, K = CA.shape
    N = CB.shape[0]
    tiny = float(torch.finfo(torch.float32).tiny)
    tiny_scb = SCB * 2.0**-120
    yield Case(f"int8_vectorwise_dequant {N}x{K} statistics near 2^-120", "int8_vectorwise_dequant", (CB, tiny_scb),
               R8.int8_vectorwise_dequant(CB, tiny_scb),
               compare=_close_within(lambda g, w: 2 * R8.spacing(w, torch.float32)),
               ieee_want=R8.int8_vectorwise_dequant(CB, tiny_scb, flush=False))  # fmt: skip
    rs, cs = SCA * 2.0**-64, SCB * 2.0**-64
    mag = acc.double().abs() * rs.double()[:, None] * cs.double()[None, :] / 16129
    bound = _close_within(lambda g, w: R8.spacing(w, g.dtype) + 8 * 2.0**-24 * mag)  # as the ordinary cases
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(_seed("int8-tiny-bias", M, N, K))
        bias = ((torch.rand(N, generator=g) - 0.5) * 2 * tiny).to(dtype)
        tag = f"{M}x{N}x{K} {dtype} statistics near 2^-64, subnormal bias"
        yield Case(f"int8_mm_dequant {tag}", "int8_mm_dequant", (acc, rs, cs, dtype, bias),
                   R8.int8_mm_dequant(acc, rs, cs, dtype, bias), compare=bound,
                   ieee_want=R8.int8_mm_dequant(acc, rs, cs, dtype, bias, flush=False))  # fmt: skip
        yield Case(f"int8_scaled_mm {tag}", "int8_scaled_mm", (CA, CB, rs, cs, bias, dtype),
                   R8.int8_scaled_mm(CA, CB, rs, cs, bias, dtype), compare=bound,
                   ieee_want=R8.int8_scaled_mm(CA, CB, rs, cs, bias, dtype, flush=False))  # fmt: skip


# -- optimizers -----------------------------------------------------------------------------------------
# n counts the parameter's elements; every optimizer name of each op and every dtype (a rotation at
# the large sizes), from random quantized / float32 states, one step, compared with the docs/semantics.md 5
# reference under docs/semantics.md 5.3's one-step rules (tests/optim_inputs.py: p within 2 ulp of its operands,
# codes equal except next to a threshold, absmax within 1 ulp; 32-bit states within a float32
# rounding where a GPU compiler may contract a multiply-add).

OPTIM_SIZES = (1, 4_173, 1_048_576, 16_777_216)


def _run_in_place(op: str) -> Callable[[list], Any]:
    def run(args: list) -> list:
        from bnb_mps.ops import op_packet

        op_packet(op)(*args)
        return list(args)

    return run


def _compare_8bit(args: list) -> Callable[[Any, Any, str], None]:
    """docs/semantics.md 5.3's one-step rules (tests/optim_inputs.py)."""
    import optim_inputs as oi

    p_before = args[2].clone()

    def compare(got, want, what):
        oi.compare_8bit(got, want, p_before=p_before)

    return compare


def state_bound_32bit(args: list, want: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """How far a float32 state after one step of optimizer_update_32bit (arguments `args`, before the
    call) may lie from the reference `want` (old value `old`): a GPU compiler that contracts the
    update's multiply-adds (beta * s + (1 - beta) * g', g * gnorm_scale + weight_decay * p, ...)
    skips the rounding of one product each, at most 2^-24 of it; so 2^-23 of the magnitudes of the
    update's terms (old state, scaled gradient with its weight decay, its square), and one ulp of the
    state for the rounding of the sum. No contraction (csrc/kernels/optimizer.h asks for none) gives
    the reference's bits. Float64, want's shape."""
    g = args[1].double().abs() * args[16] + args[13] * args[2].double().abs()
    terms = old.double().abs() + g + g * g
    tiny = float(torch.finfo(torch.float32).tiny)
    ulp = 2.0 ** torch.floor(torch.log2(want.double().abs().clamp_min(tiny))) * 2.0**-23
    return 2.0**-23 * terms + ulp


def _compare_32bit(args: list, zeros_exact: bool = False) -> Callable[[Any, Any, str], None]:
    """docs/semantics.md 5.3's one-step rule for p (2 ulps of its dtype) and the update norm; each state
    within `state_bound_32bit`; with `zeros_exact`, the states that are 0 in the reference are 0, and
    only those (the states Apple GPUs flush)."""
    import optim_inputs as oi

    before = oi.clone(args)

    def compare(got, want, what):
        # (states: the bound below, in magnitudes of their terms; a distance in ulps of the state
        # itself cannot bound a state that is the small difference of large terms)
        oi.compare_32bit(got, want, max_state_ulps=math.inf, p_before=before[2])
        for g, w, old in ((got[3], want.state1, before[3]), (got[4], want.state2, before[4])):
            if w is None:
                continue
            err = (g.cpu().double() - w.double()).abs()
            bound = state_bound_32bit(before, w, old)
            bad = ~(err <= bound)
            assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} states beyond 2^-23 of their terms "
                                   f"plus an ulp (worst excess {float((err - bound).max()):.3g})")
            if zeros_exact:
                assert torch.equal(g.cpu() == 0, w == 0), f"{what}: zero states differ"

    return compare


def _after(args: list, result) -> list:
    """The arguments as an optimizer step with `result` (a reference_optim Result8 / Result32) leaves
    them: the form `run=_run_in_place` gives."""
    out = list(args)
    out[2], out[3], out[4] = result.p, result.state1, result.state2
    if hasattr(result, "absmax1"):
        out[14], out[15] = result.absmax1, result.absmax2
    return out


def optimizer_cases(n: int) -> Iterator[Case]:
    import optim_inputs as oi
    import reference_optim as R

    op8, op32 = "optimizer_update_8bit_blockwise", "optimizer_update_32bit"
    for i, (name, dtype) in enumerate(_grid(n, oi.NAMES_8BIT, oi.DTYPES)):
        args = oi.args_8bit(name, n, dtype, seed=_seed("opt8", n, i))
        want = R.optimizer_8bit(*oi.clone(args))
        yield Case(f"{op8} {name} {dtype} n={n}", op8, tuple(args), want, compare=_compare_8bit(args),
                   run=_run_in_place(op8))  # fmt: skip
    for i, (name, dtype, max_unorm) in enumerate(_grid(n, oi.NAMES_32BIT, oi.DTYPES, (0.0, 0.002))):
        args = oi.args_32bit(name, n, dtype, seed=_seed("opt32", n, i), max_unorm=max_unorm)
        want = R.optimizer_32bit(*oi.clone(args))
        yield Case(f"{op32} {name} {dtype} clip={max_unorm} n={n}", op32, tuple(args), want,
                   compare=_compare_32bit(args), run=_run_in_place(op32))  # fmt: skip
    if 600 <= n < LARGE:
        yield from _optimizer_special_cases(n)


def _optimizer_special_cases(n: int) -> Iterator[Case]:
    """docs/semantics.md section 7 for the optimizers, and section 5's non-finite gradients:
    - 8-bit state blocks above 2^126 (momentum's first moment, Adam's second moment) re-quantize
      to the reference's codes and absmax (the reciprocal of such an absmax is a float32 subnormal);
    - float32 / bfloat16 subnormal gradients count as 0, also for skip_zeros, which then leaves the
      element alone (IEEE would update it);
    - 32-bit states that decay below 2^-126 become 0 (IEEE keeps subnormals)."""
    import optim_inputs as oi
    import reference_optim as R

    op8, op32 = "optimizer_update_8bit_blockwise", "optimizer_update_32bit"
    f32 = torch.float32
    tiny = float(torch.finfo(f32).tiny)
    g = torch.Generator().manual_seed(_seed("opt-special", n))
    signs = lambda: torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)  # noqa: E731

    big = torch.randn(n, generator=g) * 1e37
    big[::97] = 3.3e38  # every block's first moment above 2^126
    args = oi.args_8bit("momentum", n, f32, step=1, weight_decay=0.0, gnorm_scale=1.0, g=big)
    yield Case(f"{op8} momentum state blocks above 2^126 n={n}", op8, tuple(args), R.optimizer_8bit(*oi.clone(args)),
               compare=_compare_8bit(args), run=_run_in_place(op8))  # fmt: skip
    big = torch.randn(n, generator=g) * 1e19
    big[::89] = 1.7e20  # (1 - beta2) * g * g = 1.4e38: every block's second moment above 2^126
    args = oi.args_8bit("adam", n, f32, step=1, weight_decay=0.0, gnorm_scale=1.0, g=big)
    yield Case(f"{op8} adam second moment above 2^126 n={n}", op8, tuple(args), R.optimizer_8bit(*oi.clone(args)),
               compare=_compare_8bit(args), run=_run_in_place(op8))  # fmt: skip

    # section 5: a NaN or infinite gradient resets the two-state optimizers' element (states 0, p kept)
    for name in ("adam", "ademamix"):
        grad = torch.randn(n, generator=g) * 0.01
        grad[3::37], grad[4::41], grad[5::43] = float("nan"), float("inf"), -float("inf")
        args = oi.args_8bit(name, n, f32, seed=_seed("opt-nonfinite", n, name), g=grad)
        yield Case(f"{op8} {name} NaN and infinite gradients n={n}", op8, tuple(args),
                   R.optimizer_8bit(*oi.clone(args)), compare=_compare_8bit(args), run=_run_in_place(op8))  # fmt: skip

    for dtype in (f32, torch.bfloat16):
        grad = torch.randn(n, generator=g) * 0.01
        grad[::3] = torch.rand(grad[::3].shape, generator=g) * tiny * signs()[::3]  # subnormals
        grad[1::7] = 0.0
        grad = grad.to(dtype)
        for op, tag, names, make, reference, compare in (
            (op8, "opt-sub8", ("momentum", "lion"), oi.args_8bit, R.optimizer_8bit, _compare_8bit),
            (op32, "opt-sub32", ("momentum", "adam"), oi.args_32bit, R.optimizer_32bit, _compare_32bit),
        ):
            for name in names:
                args = make(name, n, dtype, seed=_seed(tag, n, name), g=grad.clone(), skip_zeros=True)
                yield Case(f"{op} {name} {dtype} subnormal gradients skip_zeros n={n}", op, tuple(args),
                           reference(*oi.clone(args)), compare=compare(args), run=_run_in_place(op),
                           ieee_want=_after(args, reference(*oi.clone(args), flush=False)))  # fmt: skip

    for name in ("adam", "rmsprop", "momentum"):
        args = oi.args_32bit(name, n, f32, seed=_seed("opt-decay", n, name), g=torch.zeros(n), weight_decay=0.0,
                             gnorm_scale=1.0)  # fmt: skip
        just_above = lambda: (1 + torch.rand(n, generator=g) * 0.002) * tiny  # noqa: E731
        args[3] = just_above() * (1.0 if name == "rmsprop" else signs())
        if args[4] is not None:
            args[4] = just_above()
        yield Case(f"{op32} {name} states decaying below 2^-126 n={n}", op32, tuple(args),
                   R.optimizer_32bit(*oi.clone(args)), compare=_compare_32bit(args, zeros_exact=True),
                   run=_run_in_place(op32),
                   ieee_want=_after(args, R.optimizer_32bit(*oi.clone(args), flush=False)))  # fmt: skip


# -- the table --------------------------------------------------------------------------------------

FAMILIES: list[Family] = [
    Family(
        name="blockwise_8bit",
        ops=("quantize_blockwise", "dequantize_blockwise", "dequantize_blockwise.out"),
        cases=blockwise_8bit_cases,
        sizes=QUANT_SIZES,
        cpu_sizes=QUANT_CPU_SIZES,
    ),
    Family(
        name="nf4_fp4",
        ops=("quantize_4bit", "dequantize_4bit", "dequantize_4bit.out"),
        cases=fourbit_cases,
        sizes=QUANT_SIZES,
        cpu_sizes=QUANT_CPU_SIZES,
    ),
    Family(
        name="matmul_4bit",
        ops=("gemm_4bit", "gemv_4bit", "gemv_4bit.out"),
        cases=matmul_4bit_cases,
        sizes=tuple(sorted(MATMUL_SHAPES)),
        cpu_sizes=(1, 4_096),
    ),
    Family(
        name="int8",
        ops=("int8_vectorwise_quant", "int8_double_quant", "int8_vectorwise_dequant", "int8_linear_matmul",
             "int8_linear_matmul.out", "int8_mm_dequant", "int8_scaled_mm", "int8_mixed_scaled_mm"),
        cases=int8_cases,
        sizes=tuple(sorted(INT8_SHAPES)),
        cpu_sizes=(1, 4_096),
    ),
    Family(
        name="optimizers",
        ops=("optimizer_update_8bit_blockwise", "optimizer_update_32bit"),
        cases=optimizer_cases,
        sizes=OPTIM_SIZES,
        cpu_sizes=(1, 4_173),
    ),
]


def family_of(op: str) -> Optional[Family]:
    return next((f for f in FAMILIES if op in f.ops), None)
