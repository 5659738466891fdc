"""The quantization kernels under the emulator, bit for bit against tests/spec_reference.py.

Kernels run through the op layer's launchers (bnb_mps.ops.blockwise, bnb_mps.ops.fourbit) on an executor that
forwards to the emulator with a chosen lane order, race checking and poison byte, so every
case checks the op layer's geometry and the kernel's maths together.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spec_reference as ref
from kernel_harness import EmulatedExecutor, NoLaunch
from bnb_mps.ops import call
from bnb_mps.ops import blockwise, fourbit
from bnb_mps.ops.registry import OPS

emulator = pytest.importorskip("bnb_mps.emulator")

try:
    from bitsandbytes.functional import create_dynamic_map

    CODE = create_dynamic_map(signed=True)
    UCODE = create_dynamic_map(signed=False)
except ImportError:  # pragma: no cover
    CODE = UCODE = None

ORDERS = ("forward", "reverse", "random")
POISONS = (0x00, 0xFF)


def run(name: str, executor, *args):
    return call(OPS[name], args, {}, executor)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, any NaN equal to any NaN."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    as_int = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a[~nan_a].view(as_int), b[~nan_b].view(as_int))


def make_input(n: int, dtype: torch.dtype, blocksize: int, seed: int) -> torch.Tensor:
    """Random values with, when there are enough blocks: an all-zero block, NaN, +-inf, a block of
    tiny and a block of large magnitudes, and a partial tail (n is chosen by the caller)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 2
    info = torch.finfo(dtype)
    blocks = math.ceil(n / blocksize)
    if blocks >= 6:
        x[blocksize : 2 * blocksize] = 0
        x[2 * blocksize + 3] = float("nan")
        x[3 * blocksize + 1] = float("inf")
        x[3 * blocksize + 5] = -float("inf")
        x[4 * blocksize : 5 * blocksize] *= info.tiny * 4  # tiny (normal) magnitudes
        x[5 * blocksize : 6 * blocksize] *= info.max / 8  # large magnitudes
    elif n > 3:
        x[1] = float("nan")
    return x.to(dtype)


def n_for(blocksize: int, blocks: int, tail: int) -> int:
    return blocks * blocksize + tail


# -- reference comparisons ------------------------------------------------------------------------


def check_8bit(executor, A: torch.Tensor, blocksize: int, code=None) -> None:
    code = CODE if code is None else code
    q, absmax = run("quantize_blockwise", executor, A, code, blocksize)
    rq, rabsmax = ref.quantize_blockwise(A, code, blocksize)
    assert torch.equal(q, rq), f"codes differ at {(q != rq).nonzero().flatten()[:10].tolist()}"
    assert same_bits(absmax, rabsmax)
    for dtype in ref.DTYPES:
        out = run("dequantize_blockwise", executor, q, absmax, code, blocksize, dtype)
        assert same_bits(out, ref.dequantize_blockwise(rq, rabsmax, code, blocksize, dtype))


def check_4bit(executor, A: torch.Tensor, blocksize: int, quant_type: str) -> None:
    packed, absmax = run("quantize_4bit", executor, A, blocksize, quant_type, torch.uint8)
    rpacked, rabsmax = ref.quantize_4bit(A, blocksize, quant_type, torch.uint8)
    assert torch.equal(packed, rpacked), f"bytes differ at {(packed != rpacked).nonzero()[:10, 0].tolist()}"
    assert same_bits(absmax, rabsmax)
    shape = tuple(A.shape)
    for dtype in ref.DTYPES:
        out = run("dequantize_4bit", executor, packed, absmax, blocksize, quant_type, shape, dtype)
        assert same_bits(out, ref.dequantize_4bit(rpacked, rabsmax, blocksize, quant_type, shape, dtype))


# -- every lane order, race checking, both poison bytes ---------------------------------------------

ALL_ORDER_8BIT = [(bs, n_for(bs, blocks, tail)) for bs, blocks, tail in ((64, 7, 13), (512, 6, 77), (4096, 2, 1))]
ALL_ORDER_4BIT = [(bs, n_for(bs, blocks, tail)) for bs, blocks, tail in ((32, 7, 5), (128, 6, 0), (1024, 6, 333))]


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("order", ORDERS)
def test_8bit_all_orders(library, order, poison):
    ex = EmulatedExecutor(library, order=order, race_check=True, poison=poison, seed=7,
                          coherence_check=order == "random" and poison == 0x00)
    for dtype in ref.DTYPES:
        for bs, n in ALL_ORDER_8BIT:
            check_8bit(ex, make_input(n, dtype, bs, seed=bs + n), bs)


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("order", ORDERS)
def test_4bit_all_orders(library, order, poison):
    ex = EmulatedExecutor(library, order=order, race_check=True, poison=poison, seed=11,
                          coherence_check=order == "random" and poison == 0x00)
    for dtype in ref.DTYPES:
        for bs, n in ALL_ORDER_4BIT:
            for qt in ("nf4", "fp4"):
                check_4bit(ex, make_input(n, dtype, bs, seed=bs + n), bs, qt)


# -- every blocksize, one order -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ref.DTYPES, ids=str)
@pytest.mark.parametrize("blocksize", ref.BLOCKSIZES_8BIT)
def test_8bit_every_blocksize(library, blocksize, dtype):
    ex = EmulatedExecutor(library, order="forward")
    check_8bit(ex, make_input(n_for(blocksize, 6, 3), dtype, blocksize, seed=blocksize), blocksize)
    check_8bit(ex, make_input(blocksize - 1, dtype, blocksize, seed=1), blocksize)  # one partial block


@pytest.mark.parametrize("dtype", ref.DTYPES, ids=str)
@pytest.mark.parametrize("blocksize", ref.BLOCKSIZES_4BIT)
@pytest.mark.parametrize("quant_type", ("nf4", "fp4"))
def test_4bit_every_blocksize(library, quant_type, blocksize, dtype):
    ex = EmulatedExecutor(library, order="forward")
    check_4bit(ex, make_input(n_for(blocksize, 6, 1), dtype, blocksize, seed=blocksize), blocksize, quant_type)
    check_4bit(ex, make_input(3, dtype, blocksize, seed=2), blocksize, quant_type)  # odd and tiny


def test_8bit_unsigned_code_and_2d_shape(library):
    ex = EmulatedExecutor(library, order="random", seed=3)
    A = torch.rand(37, 29) * 5  # non-negative data for the unsigned code; blocks straddle rows
    check_8bit(ex, A, 64, code=UCODE)
    check_8bit(ex, A.t(), 128)  # non-contiguous input: the result of its contiguous copy


def test_8bit_thresholds_and_ties(library):
    """Values that land exactly on thresholds (ties to even) and just beside them."""
    t = torch.from_numpy(ref.thresholds(CODE.numpy()))
    A = torch.cat([torch.tensor([1.0]), t, torch.nextafter(t, torch.tensor(2.0)), torch.nextafter(t, torch.tensor(-2.0))])
    check_8bit(EmulatedExecutor(library), A, 1024)


def test_fp4_tree_boundaries(library):
    c = torch.tensor([0.29166667, 0.583333, 0.8333333, 0.4166667, 0.0859375, 0.20833333, 0.00260417])
    vals = torch.cat([torch.tensor([1.0]), c, -c, torch.nextafter(c, torch.tensor(2.0)), torch.tensor([-0.0, -1e-9, 1e-9])])
    check_4bit(EmulatedExecutor(library), vals, 64, "fp4")
    check_4bit(EmulatedExecutor(library), vals, 64, "nf4")


@pytest.mark.parametrize("storage", [torch.int8, torch.float16, torch.bfloat16, torch.float32, torch.int32, torch.float64])
def test_quant_storage_is_a_byte_view(library, storage):
    ex = EmulatedExecutor(library)
    A = make_input(8 * 64, torch.float16, 64, seed=5)
    packed, absmax = run("quantize_4bit", ex, A, 64, "nf4", storage)
    rpacked, _ = ref.quantize_4bit(A, 64, "nf4", storage)
    assert packed.dtype == storage and packed.shape == rpacked.shape
    assert torch.equal(packed.reshape(-1).view(torch.uint8), rpacked.reshape(-1).view(torch.uint8))
    out = run("dequantize_4bit", ex, packed, absmax, 64, "nf4", (8, 64), torch.float32)
    assert same_bits(out, ref.dequantize_4bit(rpacked, absmax, 64, "nf4", (8, 64), torch.float32))


def test_out_overloads_with_strided_out(library):
    ex = EmulatedExecutor(library, order="reverse")
    A = make_input(40 * 24, torch.float32, 64, seed=9).reshape(40, 24)
    q, absmax = run("quantize_blockwise", ex, A, CODE, 64)
    out = torch.full((24, 40), 7.0, dtype=torch.bfloat16).t()  # non-contiguous view of shape (40, 24)
    assert run("dequantize_blockwise.out", ex, q, absmax, CODE, 64, torch.bfloat16, out) is None
    assert same_bits(out.contiguous(), ref.dequantize_blockwise(q, absmax, CODE, 64, torch.bfloat16))
    packed, absmax4 = run("quantize_4bit", ex, A, 32, "fp4", torch.uint8)
    out4 = torch.empty(40, 24, dtype=torch.float16)
    run("dequantize_4bit.out", ex, packed, absmax4, 32, "fp4", [40, 24], torch.float16, out4)
    assert same_bits(out4, ref.dequantize_4bit(packed, absmax4, 32, "fp4", (40, 24), torch.float16))


def test_random_codes_dequantize(library):
    """Dequantize arbitrary bytes (not only what quantize produces), with storage offsets."""
    ex = EmulatedExecutor(library, order="random", seed=5)
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=g)
    q = raw[3 : 3 + 4001]  # a view at a storage offset
    absmax = (torch.rand(100, generator=g) * 100)[1 : 1 + math.ceil(4001 / 64)]
    absmax4 = (torch.rand(300, generator=g) * 100)[2 : 2 + math.ceil(8001 / 32)]
    for dtype in ref.DTYPES:
        out = run("dequantize_blockwise", ex, q, absmax, CODE, 64, dtype)
        assert same_bits(out, ref.dequantize_blockwise(q, absmax, CODE, 64, dtype))
        for qt in ("nf4", "fp4"):
            out = run("dequantize_4bit", ex, q, absmax4, 32, qt, (8001,), dtype)
            assert same_bits(out, ref.dequantize_4bit(q, absmax4, 32, qt, (8001,), dtype))


def test_empty_tensors_launch_nothing():
    A = torch.empty(0, 16, dtype=torch.float16)
    q, absmax = run("quantize_blockwise", NoLaunch(), A, CODE, 64)
    assert q.shape == (0, 16) and q.dtype == torch.uint8 and absmax.shape == (0,)
    packed, absmax = run("quantize_4bit", NoLaunch(), A, 64, "nf4", torch.uint8)
    assert packed.shape == (0, 1) and absmax.shape == (0,)
    out = run("dequantize_4bit", NoLaunch(), packed, absmax, 64, "nf4", [0, 16], torch.float32)
    assert out.shape == (0, 16)
    out = run("dequantize_blockwise", NoLaunch(), q, absmax, CODE, 64, torch.bfloat16)
    assert out.shape == (0, 16) and out.dtype == torch.bfloat16


def test_one_launch_per_op(library):
    ex = EmulatedExecutor(library)
    A = make_input(1000, torch.float16, 256, seed=1)
    run("quantize_blockwise", ex, A, CODE, 256)
    run("quantize_4bit", ex, A, 256, "fp4", torch.uint8)
    assert ex.launches == ["bnb_quantize_blockwise_f16_256", "bnb_quantize_4bit_fp4_f16_256"]


# -- random inputs ----------------------------------------------------------------------------------

_floats = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    values=st.lists(_floats, min_size=1, max_size=600),
    dtype=st.sampled_from(ref.DTYPES),
    blocksize8=st.sampled_from((64, 128, 256, 512)),
    blocksize4=st.sampled_from((32, 64, 128, 512)),
    quant_type=st.sampled_from(("nf4", "fp4")),
    scale=st.sampled_from((1.0, 1e-3, 1e4)),
)
def test_random_values(library, values, dtype, blocksize8, blocksize4, quant_type, scale):
    A = (torch.tensor(values, dtype=torch.float32) * scale).to(dtype)
    ex = EmulatedExecutor(library, order="random", seed=len(values))
    check_8bit(ex, A, blocksize8)
    check_4bit(ex, A, blocksize4, quant_type)


def test_no_hidden_host_reads_on_meta():
    """The launchers only allocate and launch: they run on meta tensors (no data to read)."""

    class Recorder:
        name = "recording"

        def __init__(self):
            self.calls = []

        def launch(self, kernel, *, grid, threadgroup, args):
            self.calls.append((kernel, grid, threadgroup))

    rec = Recorder()
    A = torch.empty(1000, 3, dtype=torch.bfloat16, device="meta")
    code = torch.empty(256, dtype=torch.float32, device="meta")
    q, absmax = blockwise.quantize_blockwise(rec, A, code, 512)
    blockwise.dequantize_blockwise(rec, q, absmax, code, 512, torch.float16)
    packed, absmax4 = fourbit.quantize_4bit(rec, A, 32, "nf4", torch.bfloat16)
    fourbit.dequantize_4bit(rec, packed, absmax4, 32, "nf4", [1000, 3], torch.float32)
    assert packed.shape == (750, 1) and packed.dtype == torch.bfloat16
    assert rec.calls == [
        ("bnb_quantize_blockwise_bf16_512", (6, 1, 1), (64, 1, 1)),
        ("bnb_dequantize_blockwise_f16", (2, 1, 1), (256, 1, 1)),
        ("bnb_quantize_4bit_nf4_bf16_32", (12, 1, 1), (128, 1, 1)),
        ("bnb_dequantize_4bit_nf4_f32", (2, 1, 1), (256, 1, 1)),
    ]


@pytest.mark.parametrize("blocksize", (64, 256, 1024))
def test_8bit_quantize_with_a_capped_grid_loops_over_chunks(library, monkeypatch, blocksize):
    """Threadgroups that take several chunks each (the grid cap that bounds how often the
    thresholds are built), under every lane order, race checking and both poison bytes."""
    monkeypatch.setattr(blockwise, "MAX_QUANTIZE8_THREADGROUPS", 3)
    n = n_for(blocksize, 13, 7)  # 14 blocks: 4 chunks per threadgroup for blocksize 64
    for order, poison in (("forward", 0xFF), ("reverse", 0x00), ("random", 0x5A)):
        ex = EmulatedExecutor(library, order=order, race_check=True, poison=poison, seed=3,
                          coherence_check=order == "random" and poison == 0x00)
        for dtype in ref.DTYPES:
            check_8bit(ex, make_input(n, dtype, blocksize, seed=blocksize), blocksize)
    rec = []

    class Recorder:
        name = "recording"

        def launch(self, kernel, *, grid, threadgroup, args):
            rec.append(grid)

    blockwise.quantize_blockwise(Recorder(), torch.empty(n, device="meta"), torch.empty(256, device="meta"), blocksize)
    assert rec == [(3, 1, 1)]
