"""Validates tests/spec_reference.py against stock bitsandbytes on the CPU.

Exact where docs/semantics.md says bitsandbytes agrees with it (dequantize paths, absmax, NF4 codes of the
PyTorch path); within docs/semantics.md's documented deviations elsewhere (the native CPU 8-bit quantizer's
lookup table, the PyTorch path's tie / all-zero / FP4-threshold behaviour).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import spec_reference as ref

bnb = pytest.importorskip("bitsandbytes")
from bitsandbytes.functional import create_dynamic_map, get_4bit_type  # noqa: E402

OPS = torch.ops.bitsandbytes
# bitsandbytes' pure-PyTorch ("default") kernels are registered as CompositeExplicitAutograd.
_DEFAULT = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
CODE = create_dynamic_map(signed=True)
UCODE = create_dynamic_map(signed=False)


@pytest.fixture(autouse=True, scope="module")
def _eager_default_path():
    """bitsandbytes wraps its PyTorch path in torch.compile; eager is the same maths, much faster here."""
    import torch._dynamo

    old = torch._dynamo.config.disable
    torch._dynamo.config.disable = True
    yield
    torch._dynamo.config.disable = old


def default_path(op, *args):
    return op.redispatch(_DEFAULT, *args)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (distinguishes -0.0 from 0.0 and compares NaN payloads)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


def make_input(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 3).to(dtype)


# -- tables ---------------------------------------------------------------------------------------


def test_code_anchors_and_order():
    c = CODE.numpy()
    assert c.dtype == np.float32 and c.size == 256 and np.all(np.diff(c) > 0)
    assert c[0] == np.float32(-0.99296875) and c[127] == 0 and c[255] == 1
    u = UCODE.numpy()
    assert u[0] == 0 and u[255] == 1 and np.all(np.diff(u) > 0)


def test_4bit_tables_match_bitsandbytes():
    assert np.array_equal(ref.NF4_TABLE, get_4bit_type("nf4", device="cpu").numpy())
    # Equal as numbers; docs/semantics.md makes nibble 8 a negative zero (bnb's table stores +0.0 there).
    assert np.array_equal(ref.FP4_TABLE, get_4bit_type("fp4", device="cpu").numpy())
    assert np.signbit(ref.FP4_TABLE[8])


# -- 8-bit ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ref.DTYPES)
@pytest.mark.parametrize("blocksize", ref.BLOCKSIZES_8BIT)
def test_dequantize_blockwise_exact(dtype, blocksize):
    n = 3 * blocksize + 37
    g = torch.Generator().manual_seed(blocksize)
    q = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    absmax = torch.rand(math.ceil(n / blocksize), generator=g) * 10
    absmax[0] = 0
    expected = ref.dequantize_blockwise(q, absmax, CODE, blocksize, dtype)
    assert bits_equal(OPS.dequantize_blockwise(q, absmax, CODE, blocksize, dtype), expected)
    assert bits_equal(default_path(OPS.dequantize_blockwise.default, q, absmax, CODE, blocksize, dtype), expected)


def exact_ties(A: torch.Tensor, absmax: torch.Tensor, blocksize: int) -> np.ndarray:
    """Elements whose scaled value equals a threshold exactly (frequent with bf16 inputs)."""
    s = ref.scaled_values(A.float().reshape(-1).numpy(), absmax.numpy(), blocksize)
    return np.isin(s, ref.thresholds(CODE.numpy()))


@pytest.mark.parametrize("dtype", ref.DTYPES)
@pytest.mark.parametrize("blocksize", [64, 256, 4096])
def test_quantize_blockwise_vs_native_cpu(dtype, blocksize):
    n = (1 << 16) + 11
    A = make_input(n, dtype, blocksize)
    q, absmax = ref.quantize_blockwise(A, CODE, blocksize)
    q_bnb, absmax_bnb = OPS.quantize_blockwise(A, CODE, blocksize)
    assert torch.equal(absmax, absmax_bnb)
    diff = (q.int() - q_bnb.int()).abs().numpy()
    # docs/semantics.md: the CPU lookup-table quantizer differs by 1-3 codes in about 0.1-0.25% of elements
    # (more with bf16, whose values often hit a threshold exactly: docs/semantics.md breaks those ties to even).
    assert diff.max() <= 3
    assert (diff[~exact_ties(A, absmax, blocksize)] > 0).mean() <= 0.003
    # The reference is a nearest code of the float32 scaled value (up to the rounding of the
    # float32 midpoints, a few ulps of s).
    s = ref.scaled_values(A.float().numpy(), absmax.numpy(), blocksize)
    c = CODE.numpy()
    err = np.abs(c[q.numpy().astype(int)] - s)
    best = np.abs(c[None, :] - s[:, None]).min(axis=1)
    assert np.all(err <= best + 4 * np.spacing(np.abs(s)) + 1e-40)


@pytest.mark.parametrize("dtype", ref.DTYPES)
@pytest.mark.parametrize("blocksize", [64, 1024])
def test_quantize_blockwise_vs_pytorch_path(dtype, blocksize):
    n = 6 * blocksize + 3  # a short tail
    A = make_input(n, dtype, 7)
    A[blocksize : 2 * blocksize] = 0  # an all-zero block
    q, absmax = ref.quantize_blockwise(A, CODE, blocksize)
    q_def, absmax_def = default_path(OPS.quantize_blockwise.default, A, CODE, blocksize)
    assert torch.equal(absmax, absmax_def)
    q, q_def = q.numpy().astype(int), q_def.numpy().astype(int)
    full = (n // blocksize) * blocksize
    zero_block = np.zeros(n, dtype=bool)
    zero_block[blocksize : 2 * blocksize] = True
    ties = exact_ties(A, absmax, blocksize)
    ties[full:] = False
    plain = ~zero_block & ~ties
    plain[full:] = False
    # Full blocks without ties: identical.
    assert np.array_equal(q[plain], q_def[plain])
    # Exact ties: docs/semantics.md goes to the even index of {k, k+1}, the PyTorch path to k.
    assert np.all(q[ties] % 2 == 0) and np.array_equal(q[ties], q_def[ties] + q_def[ties] % 2)
    # All-zero block: docs/semantics.md index 0, the PyTorch path 127.
    assert np.all(q[zero_block] == 0) and np.all(q_def[zero_block] == 127)
    # Tail: the PyTorch path divides instead of multiplying by the reciprocal (1 ulp apart at most).
    assert np.abs(q[full:] - q_def[full:]).max() <= 1


def test_quantize_blockwise_ties_go_to_even():
    t = ref.thresholds(CODE.numpy())
    A = torch.from_numpy(np.concatenate([[1.0], t]).astype(np.float32))  # absmax 1: s == t_k exactly
    q, absmax = ref.quantize_blockwise(A, CODE, 256)
    assert absmax.item() == 1.0
    k = np.arange(255)
    assert np.array_equal(q.numpy()[1:], np.where(k % 2 == 0, k, k + 1))
    q_def, _ = default_path(OPS.quantize_blockwise.default, A, CODE, 256)
    assert np.array_equal(q_def.numpy()[1:], k)  # the PyTorch path: lower index


def test_quantize_blockwise_special_values():
    nan, inf = float("nan"), float("inf")
    A = torch.randn(64 * 5)
    A[0:64] = nan  # all-NaN block
    A[64:128] = 0  # all-zero block
    A[130], A[131] = nan, 1.0
    A[192], A[200], A[201] = inf, 0.5, -2.0
    A[256], A[257] = -inf, 3.0
    q, absmax = ref.quantize_blockwise(A, CODE, 64)
    assert absmax.tolist()[:2] == [0, 0] and absmax[3] == inf and absmax[4] == inf
    assert torch.all(q[:128] == 0)
    assert q[130] == 0  # NaN element -> 0, the rest of its block unaffected
    assert absmax[2] == A[128:192].abs().nan_to_num(0).max()
    # absmax inf: r = 0, so finite elements scale to (-)0 -> code 127, and inf * 0 = NaN -> 0.
    assert q[192] == 0 and q[200] == 127 and q[201] == 127
    assert q[256] == 0 and q[257] == 127
    _, absmax_bnb = OPS.quantize_blockwise(A, CODE, 64)
    assert torch.equal(absmax, absmax_bnb)
    out = ref.dequantize_blockwise(q, absmax, CODE, 64, torch.float32)
    assert torch.all(out[64:128] == 0)


# -- 4-bit ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", ref.DTYPES)
@pytest.mark.parametrize("blocksize", ref.BLOCKSIZES_4BIT)
def test_dequantize_4bit_exact(quant_type, dtype, blocksize):
    # Rows a multiple of blocksize and even: the shape where bitsandbytes' CPU kernel is right.
    shape = (3, 2 * blocksize)
    n = math.prod(shape)
    g = torch.Generator().manual_seed(blocksize)
    packed = torch.randint(0, 256, (n // 2, 1), dtype=torch.uint8, generator=g)
    absmax = torch.rand(n // blocksize, generator=g) * 4
    expected = ref.dequantize_4bit(packed, absmax, blocksize, quant_type, shape, dtype)
    # bitsandbytes' FP4 tables give +0.0 for nibble 8 where docs/semantics.md gives -0.0: compare as numbers there.
    same = bits_equal if quant_type == "nf4" else torch.equal
    assert same(OPS.dequantize_4bit(packed, absmax, blocksize, quant_type, shape, dtype), expected)
    assert same(default_path(OPS.dequantize_4bit.default, packed, absmax, blocksize, quant_type, shape, dtype), expected)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_dequantize_4bit_odd_shape_and_storage(quant_type):
    shape = (5, 77)  # odd rows, blocks straddle rows
    n = math.prod(shape)
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, ((n + 1) // 2, 1), dtype=torch.uint8, generator=g)
    absmax = torch.rand(math.ceil(n / 64), generator=g)
    expected = ref.dequantize_4bit(packed, absmax, 64, quant_type, shape, torch.float16)
    got = default_path(OPS.dequantize_4bit.default, packed, absmax, 64, quant_type, shape, torch.float16)
    assert torch.equal(got, expected)
    # Non-uint8 storage is read as its bytes.
    as_bf16 = torch.cat([packed.reshape(-1), torch.zeros(1, dtype=torch.uint8)]).view(torch.bfloat16)
    assert torch.equal(ref.dequantize_4bit(as_bf16, absmax, 64, quant_type, shape, torch.float16), expected)


@pytest.mark.parametrize("dtype", ref.DTYPES)
@pytest.mark.parametrize("blocksize", [32, 128, 4096])
@pytest.mark.parametrize("n", [4 * 4096 + 64, 4 * 4096 + 67])
def test_quantize_nf4_vs_pytorch_path(dtype, blocksize, n):
    A = make_input(n, dtype, n + blocksize)
    A[blocksize : 2 * blocksize] = 0
    packed, absmax = ref.quantize_4bit(A, blocksize, "nf4", torch.uint8)
    p_def, absmax_def = default_path(OPS.quantize_4bit.default, A, blocksize, "nf4", torch.uint8)
    assert packed.shape == p_def.shape == ((n + 1) // 2, 1)
    assert torch.equal(absmax[:-1], absmax_def[:-1])
    tail_zero = bool(torch.all(A[(n - 1) // blocksize * blocksize :] == 0))
    assert tail_zero or absmax[-1] == absmax_def[-1]
    zero_bytes = slice(blocksize // 2, blocksize)
    assert torch.all(packed[zero_bytes] == 0) and torch.all(p_def[zero_bytes] == 0x77)
    nib = ref.unpack_nibbles(packed, n + n % 2).astype(int)
    nib_def = ref.unpack_nibbles(p_def, n + n % 2).astype(int)
    full = (n // blocksize) * blocksize
    keep = np.ones(full, dtype=bool)
    keep[blocksize : 2 * blocksize] = False
    assert np.array_equal(nib[:full][keep], nib_def[:full][keep])
    assert np.abs(nib[full:] - nib_def[full:]).max(initial=0) <= 1  # tail: division vs reciprocal


@pytest.mark.parametrize("dtype", ref.DTYPES)
@pytest.mark.parametrize("blocksize", [64, 512])
def test_quantize_fp4_vs_pytorch_path(dtype, blocksize):
    n = 16 * blocksize
    A = make_input(n, dtype, 3)
    packed, absmax = ref.quantize_4bit(A, blocksize, "fp4", torch.uint8)
    p_def, absmax_def = default_path(OPS.quantize_4bit.default, A, blocksize, "fp4", torch.uint8)
    assert torch.equal(absmax, absmax_def)
    nib = ref.unpack_nibbles(packed, n)
    nib_def = ref.unpack_nibbles(p_def, n)
    differ = nib != nib_def
    # docs/semantics.md: about 0.5% of FP4 nibbles differ (tiny values' sign, the hand-written thresholds).
    assert differ.mean() <= 0.01
    # Where they differ, the values are neighbours in FP4's sorted levels (or both zeros).
    levels = np.unique(ref.FP4_TABLE)
    pos = np.searchsorted(levels, ref.FP4_TABLE[nib[differ]])
    pos_def = np.searchsorted(levels, ref.FP4_TABLE[nib_def[differ]])
    assert np.all(np.abs(pos - pos_def) <= 1)


def test_fp4_tree_boundaries():
    T = ref._FP4_T
    s = np.array([T["root"], np.nextafter(T["root"], np.float32(1)), T["lo_lo"], np.nextafter(T["lo_lo"], np.float32(1)),
                  -0.0, np.nan, -1e-9, 1.0, -1.0, 0.5, -0.25], dtype=np.float32)
    got = ref.index_fp4(s).tolist()
    assert got == [7, 4, 0, 1, 0, 0, 8, 3, 11, 5, 15]


def test_quantize_4bit_packing_odd_and_zero_blocks():
    A = torch.tensor([0.0] * 32 + [1.0, -1.0, 0.5], dtype=torch.float32)  # n = 35 (odd)
    for qt, zero_code in (("nf4", 7), ("fp4", 0)):
        nib, absmax = ref.quantize_4bit_nibbles(A, 32, qt)
        assert absmax.tolist() == [0.0, 1.0]
        assert np.all(nib[:32] == 0)
        assert nib[35] == zero_code  # the padding nibble is the code of s = 0
        packed, _ = ref.quantize_4bit(A, 32, qt, torch.uint8)
        assert packed.shape == (18, 1) and packed[16, 0] == (nib[32] << 4 | nib[33])
    nib, _ = ref.quantize_4bit_nibbles(torch.zeros(33), 32, "nf4")
    assert nib[33] == 0  # padding of an all-zero block


@pytest.mark.parametrize("storage", [torch.uint8, torch.int8, torch.float16, torch.bfloat16, torch.float32, torch.int32])
def test_quant_storage_is_a_byte_view(storage):
    A = make_input(256, torch.float16, 5)
    p8, absmax = ref.quantize_4bit(A, 64, "nf4", torch.uint8)
    p, absmax2 = ref.quantize_4bit(A, 64, "nf4", storage)
    itemsize = p.element_size()
    assert p.dtype == storage and p.shape == ((256 + 1) // (2 * itemsize), 1)
    assert torch.equal(p.reshape(-1).view(torch.uint8), p8.reshape(-1)) and torch.equal(absmax, absmax2)
    p_def, _ = default_path(OPS.quantize_4bit.default, A, 64, "nf4", storage)
    assert torch.equal(p_def.reshape(-1).view(torch.uint8), p8.reshape(-1))


def test_nested_absmax_reconstruction_matches_bitsandbytes():
    W = make_input(64 * 600, torch.float16, 11).reshape(600, 64)
    packed, state = bnb.functional.quantize_4bit(W, blocksize=64, compress_statistics=True, quant_type="nf4")
    scales = ref.nested_scales(state.absmax, state.state2.code, state.state2.absmax, state.offset)
    bnb_scales = bnb.functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
    assert torch.equal(scales, bnb_scales)
    # Our double quantization of the same plain absmax: the offset is identical, the codes within
    # the CPU quantizer's documented deviation.
    _, plain_absmax = ref.quantize_4bit(W, 64, "nf4")
    q, nested, offset = ref.double_quantize(plain_absmax, CODE)
    assert torch.equal(offset, state.offset)
    assert torch.equal(nested, state.state2.absmax)
    diff = (q.int() - state.absmax.int()).abs()
    assert diff.max() <= 3 and (diff > 0).float().mean() <= 0.01
    out = ref.dequantize_4bit(packed, scales, 64, "nf4", W.shape, torch.float16)
    assert torch.equal(out, bnb.functional.dequantize_4bit(packed, state))


def test_bad_arguments():
    with pytest.raises(ValueError, match="blocksize"):
        ref.quantize_blockwise(torch.zeros(8), CODE, 32)
    with pytest.raises(ValueError, match="quant_type"):
        ref.quantize_4bit(torch.zeros(8), 64, "int4")
    with pytest.raises(TypeError, match="A must be"):
        ref.quantize_4bit(torch.zeros(8, dtype=torch.float64), 64, "nf4")
