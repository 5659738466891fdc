"""The CPU-transfer fallback returns what bitsandbytes' CPU ops return, and the docs/semantics.md
result where those depend on the CPU.

Every schema is called through `op.redispatch(DispatchKeySet(MPS), ...)` on CPU tensors, which
reaches bnb_mps' MPS kernel (the fallback tier, forced with BNB_MPS_EXECUTOR=cpu), and compared,
including every in-place update (parameters, states, absmax, `out`), with what it must return on
copies of the same inputs:
- bitsandbytes' own CPU op, bit for bit, for the ops whose CPU result is the same on every CPU;
- for the 4-bit dequantize and products, whose stock CPU kernels give other (wrong) results on CPUs
  with AVX-512 (tests/stock_cpu_paths.py), the docs/semantics.md weight (tests/spec_reference.py)
  and its float32 product rounded once (docs/semantics.md section 4), bit for bit.
The ops whose stock CPU kernels depend on the CPU are also run with those kernels replaced by
models of their AVX-512 / AVX512-BF16 paths, so that the comparisons are seen to hold on such CPUs.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch._C import DispatchKey, DispatchKeySet

import op_inputs
import reference_matmul_4bit as R
import spec_reference as ref
import stock_cpu_paths
from bnb_mps import registration

pytestmark = pytest.mark.filterwarnings("ignore::bnb_mps.executors.SlowTierWarning")

MPS = DispatchKeySet(DispatchKey.MPS)


@pytest.fixture(autouse=True)
def cpu_round_trip(fresh_tier_selection):
    fresh_tier_selection.setenv("BNB_MPS_EXECUTOR", "cpu")
    yield
ALL = list(registration.SCHEMAS)
# bitsandbytes 0.50.2 has no CPU implementation of these; the fallback composes them (below).
NO_STOCK_CPU = {"dequantize_blockwise.out", "dequantize_4bit.out", "gemv_4bit.out", "int8_double_quant"}
# Their stock CPU results depend on the CPU's instruction set: compared with the docs/semantics.md result.
BY_REFERENCE = {"dequantize_4bit", "gemv_4bit", "gemm_4bit"}
# Served by (or through) the stock CPU kernels that tests/stock_cpu_paths.py models.
ON_MODELLED_PATHS = {"dequantize_4bit", "dequantize_4bit.out", "gemv_4bit", "gemv_4bit.out", "gemm_4bit",
                     "int8_linear_matmul", "int8_scaled_mm", "int8_mixed_scaled_mm"}  # fmt: skip


def packet(name):
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.bitsandbytes, base), overload or "default")


def assert_identical(got, want, what):
    if isinstance(want, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want)):
            assert_identical(g, w, f"{what}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), what
        assert got.dtype == want.dtype and got.shape == want.shape and got.device == want.device, what
        assert torch.equal(got, want) or (got.isnan() == want.isnan()).all() and torch.equal(
            got.nan_to_num(0), want.nan_to_num(0)
        ), what
    else:
        assert got == want, what


def expected(name, args):
    """What the fallback must return for schema `name` (and leave in `args`, updated in place)."""
    base = name.removesuffix(".out")
    if base not in BY_REFERENCE:
        return stock(name, args)
    if name.endswith(".out"):
        *inputs, out = args
        out.copy_(reference(base, inputs))
        return None
    return reference(base, args)


def stock(name, args):
    """What bitsandbytes' own CPU path gives (composed for the schemas it lacks)."""
    if name.endswith(".out"):
        *inputs, out = args
        if name in NO_STOCK_CPU:
            out.copy_(packet(name.removesuffix(".out"))(*inputs))
            return None
    if name == "int8_double_quant":
        return int8_double_quant_reference(*args)
    return packet(name)(*args)


def float32_linear(A, W, bias=None):
    """docs/semantics.md section 4: a float32 product with the weight in A's dtype (bias added in
    float32), rounded once to A's dtype."""
    b = None if bias is None else bias.float()
    return torch.nn.functional.linear(A.float(), torch.from_numpy(R.in_dtype(W, A.dtype)).float(), b).to(A.dtype)


def reference(name, args):
    """docs/semantics.md's 4-bit weight (float32, then in A's dtype), then its float32 product rounded once."""
    if name == "dequantize_4bit":
        A, absmax, blocksize, quant_type, shape, dtype = args
        return ref.dequantize_4bit(A, absmax, blocksize, quant_type, shape, dtype)
    if name == "gemv_4bit":
        A, B, shapeB, absmax, code, blocksize = args
        return float32_linear(A, R.dequantized_weight(B, shapeB, blocksize, code, absmax))
    A, B, shapeB, absmax, blocksize, quant_type, bias, absmax_8bit, absmax_code, absmax_offset = args
    W = R.dequantized_weight(B, shapeB, blocksize, quant_type, absmax, absmax_8bit, absmax_code, absmax_offset)
    return float32_linear(A, W, bias)


def int8_double_quant_reference(A, threshold):
    """docs/semantics.md section 6, as CUDA computes it: rows like int8_vectorwise_quant; columns scaled by
    their absmax over non-outliers, outliers zeroed, rounded half to even."""
    rows = torch.ops.bitsandbytes.int8_vectorwise_quant(A.clone(), threshold)
    A32 = A.float()
    keep = (A32.abs() < threshold) if threshold > 0 else torch.ones_like(A32, dtype=torch.bool)
    kept = torch.where(keep, A32, torch.zeros_like(A32))
    col_stats = kept.abs().amax(dim=0)
    # fp16 A * 127 is formed in fp16 (as A.mul(127.0) does), then divided in fp32
    scaled = torch.where(keep, A, torch.zeros_like(A)).mul(127.0).float() / col_stats
    quant_col = torch.round(scaled).to(torch.int8)
    return rows[0], quant_col, rows[1], col_stats, rows[2]


CASES = [(name, label) for name in ALL for label, _ in op_inputs.cases(name)]
MODELLED_CASES = [(name, label) for name, label in CASES if name in ON_MODELLED_PATHS]


def check_round_trip(name, label):
    args = dict(op_inputs.cases(name))[label]
    mine = copy.deepcopy(args)
    theirs = copy.deepcopy(args)
    got = packet(name).redispatch(MPS, *mine)
    want = expected(name, theirs)
    assert_identical(got, want, f"{name} result")
    for i, (m, t) in enumerate(zip(mine, theirs)):  # in-place updates and untouched inputs alike
        if isinstance(t, torch.Tensor):
            assert_identical(m, t, f"{name} argument {i} after the call")
    if name.startswith("optimizer_update"):  # the call did update the parameter
        assert not torch.equal(mine[2], args[2])


@pytest.mark.parametrize("name,label", CASES, ids=[f"{n}-{l}" for n, l in CASES])
def test_round_trip_result_and_updates(name, label):
    check_round_trip(name, label)


@pytest.mark.parametrize("name,label", MODELLED_CASES, ids=[f"{n}-{l}" for n, l in MODELLED_CASES])
def test_round_trip_with_bitsandbytes_avx512_cpu_kernels(name, label):
    """As on a CPU with AVX-512 and AVX512-BF16, whose stock CPU kernels differ (modelled)."""
    with stock_cpu_paths.avx512_cpu():
        check_round_trip(name, label)


def test_modelled_avx512_kernels_give_other_results_than_docs_semantics():
    """The models give the wrong results bitsandbytes' AVX-512 kernels give, so the test above can
    tell a fallback that used them; and the gemv model is right on bitsandbytes' own CPU layout
    (it reads the weight as the kernel does)."""
    from bitsandbytes.functional import _convert_weight_packed_for_cpu, quantize_4bit

    N, K, bs = 64, 128, 64
    W = op_inputs.randn(N, K, seed=1)
    packed, state = quantize_4bit(W, blocksize=bs, quant_type="nf4", compress_statistics=False)
    A = op_inputs.randn(3, K, dtype=torch.bfloat16, seed=2)
    Wq = R.dequantized_weight(packed, [N, K], bs, "nf4", state.absmax)
    want, S = R.matmul(A, Wq), R.magnitude(A, Wq)
    with stock_cpu_paths.avx512_cpu():
        got = torch.ops.bitsandbytes.gemv_4bit(A, packed, [N, K], state.absmax, state.code, bs)
        assert R.max_abs(R.as_f64(got) - want) > 0.5 * R.max_abs(want)  # the standard layout, misread
        cpu_packed, cpu_state = _convert_weight_packed_for_cpu(packed.clone(), copy.deepcopy(state))
        got = torch.ops.bitsandbytes.gemv_4bit(A, cpu_packed, [N, K], cpu_state.absmax, state.code, bs)
        # bfloat16 weights, scales and output: within a few bfloat16 ulps of each sum's magnitude
        assert (abs(R.as_f64(got) - want) <= 4 * R.ulp(S, torch.bfloat16)).all()

        # dequantize_4bit: rows of 96 in blocks of 64 (blocks straddle rows) misread; whole blocks not
        for bs, right in ((64, False), (32, True)):
            packed, absmax = op_inputs.quantized_4bit((6, 96), bs, "nf4")
            got = torch.ops.bitsandbytes.dequantize_4bit(packed, absmax, bs, "nf4", [6, 96], torch.float32)
            assert torch.equal(got, ref.dequantize_4bit(packed, absmax, bs, "nf4", (6, 96), torch.float32)) == right


def test_every_schema_has_cases():
    assert {n for n, _ in CASES} == set(ALL) and len(ALL) == 19


def test_redispatch_reaches_bnb_mps(monkeypatch):
    """The redispatched call runs bnb_mps' glue, not some other kernel."""
    from bnb_mps.ops import cpu_round_trip as cpu

    seen = []
    real = cpu.run
    monkeypatch.setattr(cpu, "run", lambda name, args: seen.append(name) or real(name, args))
    A = torch.randn(256)
    q, absmax = packet("quantize_blockwise").redispatch(MPS, A, op_inputs.signed_code(), 256)
    assert seen == ["quantize_blockwise"]
    assert torch.equal(q, torch.ops.bitsandbytes.quantize_blockwise(A, op_inputs.signed_code(), 256)[0])


def test_keyword_and_default_arguments():
    A = op_inputs.randn(8, 16, dtype=torch.float16, scale=3)
    got = packet("int8_vectorwise_quant").redispatch(MPS, A, threshold=2.0)
    want = torch.ops.bitsandbytes.int8_vectorwise_quant(A.clone(), 2.0)
    assert_identical(got, want, "threshold by keyword")
    got = packet("int8_vectorwise_quant").redispatch(MPS, A)
    assert_identical(got, torch.ops.bitsandbytes.int8_vectorwise_quant(A.clone()), "default threshold")


def test_non_contiguous_input_gives_its_contiguous_result():
    A = op_inputs.randn(64, 96).t()
    got = packet("quantize_4bit").redispatch(MPS, A, 64, "nf4", torch.uint8)
    want = torch.ops.bitsandbytes.quantize_4bit(A.contiguous(), 64, "nf4", torch.uint8)
    assert_identical(got, want, "transposed input")


def test_results_go_back_to_the_input_device(monkeypatch):
    """On mps the fallback returns results on mps; simulated with `meta` as the caller's device."""
    from bnb_mps.ops import cpu_round_trip as cpu

    monkeypatch.setattr(cpu, "_device_of", lambda args: torch.device("meta"))
    q, absmax = cpu.run("quantize_blockwise", [torch.randn(300), op_inputs.signed_code(), 256])
    assert q.device.type == "meta" and absmax.device.type == "meta"


@pytest.mark.parametrize("name", ["optimizer_update_8bit_blockwise", "optimizer_update_32bit", "gemv_4bit.out"])
def test_in_place_updates_are_written_back(monkeypatch, name):
    """When the op runs on copies (as it does for mps tensors), the caller's tensors get the updates."""
    from bnb_mps.ops import cpu_round_trip as cpu

    real = cpu._to
    monkeypatch.setattr(cpu, "_to", lambda x, d: x.clone() if isinstance(x, torch.Tensor) else real(x, d))
    label, args = next(op_inputs.cases(name))
    mine, theirs = copy.deepcopy(args), copy.deepcopy(args)
    cpu.run(name, mine)
    expected(name, theirs)
    for i, (m, t) in enumerate(zip(mine, theirs)):
        if isinstance(t, torch.Tensor):
            assert_identical(m, t, f"{name} argument {i}")


def int8_linear_matmul_float32_in_order(A, B):
    """bitsandbytes' default CPU int8_linear_matmul (a float32 matmul, its path on CPUs without
    AVX-512, Macs included) with the sums taken in order, as a BLAS may: not exact past 2^24."""
    prods = A.reshape(-1, A.shape[-1]).float()[:, None, :] * B.float()[None, :, :]
    acc = torch.zeros(prods.shape[:-1], dtype=torch.float32)
    for k in range(prods.shape[-1]):  # (torch's own cumsum would accumulate in float64)
        acc = acc + prods[..., k]
    return acc.to(torch.int32).reshape(*A.shape[:-1], B.shape[0])


def test_round_trip_int8_product_is_exact_on_every_cpu():
    """K * 127^2 passes 2^24 at K = 1088: a float32 path loses the integer, the round trip must not."""
    from bnb_mps.ops import cpu_round_trip as cpu

    g = torch.Generator().manual_seed(0)
    A = torch.randint(-127, 128, (3, 1088), generator=g, dtype=torch.int8)
    B = torch.randint(-127, 128, (5, 1088), generator=g, dtype=torch.int8)
    A[0], B[0], B[1] = 127, 127, -127
    want = (A.long() @ B.long().T).int()
    lib = torch.library.Library("bitsandbytes", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lib.impl("int8_linear_matmul", int8_linear_matmul_float32_in_order, "CPU")
        assert not torch.equal(torch.ops.bitsandbytes.int8_linear_matmul.default(A, B), want)  # the model is inexact
        assert torch.equal(cpu.cpu_call("int8_linear_matmul", [A, B]), want)
        out = torch.full((3, 5), -1, dtype=torch.int32)
        cpu.cpu_call("int8_linear_matmul.out", [A, B, out])
        assert torch.equal(out, want)
    finally:
        lib._destroy()
