"""bnb-mps against bitsandbytes' own CUDA kernels (tests/data/cuda_golden/: bitsandbytes 0.50.2 on an
NVIDIA H100), every stored case, each family to its rule (tests/cuda_golden_rules.py), on the emulated
tier. The 4-bit products are in test_cuda_products.py.

- quantize (8-bit blockwise, NF4, FP4): absmax bit for bit; codes equal to CUDA's except where CUDA's
  approximate reciprocal crosses a code boundary (each such element shown to lie within 2 ulps of
  it), and except the near-float32-maximum block, where bnb-mps keeps the IEEE answer (checked against
  tests/spec_reference.py); ours also equal to the IEEE reference everywhere; dequantized values
  equal to CUDA's where the codes are, and dequantizing CUDA's codes gives CUDA's values bit for bit.
- int8: row codes the same way at the .5 boundaries; statistics and outlier columns bit for bit;
  int8_double_quant's column codes bit for bit; int32 products exact, on our codes and on CUDA's;
  dequantized products from CUDA's accumulators within INT8_DEQUANT_ULPS float16 ulps.
- optimizers (three steps): codes of every state equal to CUDA's but for at most 1 in 2,000, each
  off by one; absmax within OPT_ABSMAX_ULPS float32 ulps; p and 32-bit states within OPT_ULPS ulps
  of their dtype at the tensor's largest magnitude.
- the QLoRA path: packed weights as quantize; given CUDA's state (codes, absmax, nested absmax,
  offset), the dequantized weight equals CUDA's bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cuda_golden as golden
import cuda_golden_rules as rules
import spec_reference as sref
from cuda_golden_inputs import cases

INT8_DEQUANT_ULPS = 1  # float16 ulps: CUDA multiplies by 6.200012e-05 with fast math, we by fl32(1/16129)
OPT_ABSMAX_ULPS = 4
OPT_ULPS = 4
OPT_CODES_OFF = 1 / 2000

FAMILIES = {
    "main": ("q8", "q4", "int8", "int8dq", "opt"),
    "edge": ("q8", "q4", "opt", "edge-q8", "edge-q4", "edge-blocks-q8", "edge-blocks-q4", "edge-opt", "edge-int8"),
    "mmq": ("mmq-w",),
}


@pytest.fixture(scope="module")
def ours():
    """set -> case name -> our outputs (or the exception raised), for every stored case of FAMILIES."""
    import bitsandbytes.functional as F
    import bitsandbytes.nn.modules as M
    from bnb_mps.testing import use_emulated_kernels

    out = {}
    mp = pytest.MonkeyPatch()
    # bitsandbytes switches CPU tensors to its own packed CPU paths on AVX512-BF16 CPUs; the
    # emulated tier serves CPU tensors as a Mac serves mps ones.
    mp.setattr(F, "has_avx512bf16", lambda: False)
    mp.setattr(M, "has_avx512bf16", lambda: False)
    try:
        with use_emulated_kernels():
            for set_name, families in FAMILIES.items():
                stored, errors = golden.load(set_name)
                res = out[set_name] = {}
                for case in cases(set_name):
                    if case.family in families and (case.name in stored or case.name in errors):
                        try:
                            res[case.name] = (case, golden.run(case))
                        except (ValueError, TypeError, RuntimeError) as e:
                            res[case.name] = (case, e)
    finally:
        mp.undo()
    return out


def _each(ours, set_name, family):
    stored, errors = golden.load(set_name)
    checked = 0
    for name, (case, got) in ours[set_name].items():
        if case.family == family:
            checked += 1
            yield name, case, got, stored.get(name), errors.get(name)
    assert checked, f"no {family} case in {set_name}"


def _report(problems: dict) -> str:
    lines = [f"{k}: {v[:3]}" for k, v in problems.items() if v]
    return f"{len(lines)} cases break the rule:\n" + "\n".join(lines[:20])


# -- quantize / dequantize --------------------------------------------------------------------------


def _check_quantize(case, got, cuda) -> list[str]:
    from cuda_golden import DT

    a = case.args
    x = golden.tensor(a["x"], case.dtype, "cpu")
    bs, n = a["blocksize"], x.numel()
    quant = "q8" if case.family.endswith("q8") else a["quant_type"]
    xf = sref._flat_f32(x)
    absmax = sref.blockwise_absmax(xf, bs)
    s = sref.scaled_values(xf, absmax, bs)
    huge = np.repeat(absmax > rules.RECIP_SUBNORMAL, bs)[:n]
    if quant == "q8":
        ref = sref.index_8bit(s, rules.dynamic_code())
        mine, theirs = got[0].numpy().reshape(-1), cuda[0].numpy().reshape(-1)
    else:
        ref = sref.index_nf4(s) if quant == "nf4" else sref.index_fp4(s)
        mine, theirs = sref.unpack_nibbles(got[0], n), sref.unpack_nibbles(cuda[0], n)
    problems = rules.bits_equal(got[1], cuda[1])
    problems += [f"absmax differs from the reference"] if not np.array_equal(got[1].numpy(), absmax) else []
    if not np.array_equal(mine, ref):
        problems.append(f"codes differ from the IEEE reference at {np.flatnonzero(mine != ref)[:5]}")
    problems += rules.codes(quant, mine, theirs, s, huge)
    same = torch.from_numpy(mine == theirs)
    deq_o, deq_c = got[2].reshape(-1), cuda[2].reshape(-1)
    if not bool(((deq_o == deq_c) | (deq_o.isnan() & deq_c.isnan()) | ~same).all()):
        problems.append("dequantized values differ where the codes are equal")
    ops = torch.ops.bitsandbytes
    if quant == "q8":
        theirs_deq = ops.dequantize_blockwise(cuda[0], cuda[1], torch.from_numpy(rules.dynamic_code()), bs, DT[case.dtype])
    else:
        theirs_deq = ops.dequantize_4bit(cuda[0], cuda[1], bs, quant, [n], DT[case.dtype])
    problems += [f"CUDA's codes dequantized: {p}" for p in rules.bits_equal(theirs_deq, cuda[2])]
    return problems




QUANT = [("main", "q8"), ("main", "q4"), ("edge", "q8"), ("edge", "q4"), ("edge", "edge-q8"), ("edge", "edge-q4"),
         ("edge", "edge-blocks-q8"), ("edge", "edge-blocks-q4")]  # fmt: skip


@pytest.mark.parametrize("set_name,family", QUANT)
def test_quantize_matches_cuda(ours, set_name, family):
    from bnb_mps.testing import use_emulated_kernels

    problems = {}
    with use_emulated_kernels():
        for name, case, got, cuda, _ in _each(ours, set_name, family):
            problems[name] = _check_quantize(case, got, cuda)
    assert not any(problems.values()), _report(problems)


def test_near_float32_max_block_keeps_the_ieee_answer(ours):
    """The block whose absmax is 3e38: CUDA's flushed reciprocal sends its largest value to another
    code; ours is the IEEE code (the top code: the value is the block's maximum)."""
    stored, _ = golden.load("edge")
    for dt in ("fp32", "bf16"):
        case, got = ours["edge"][f"edge-blocks-q8/{dt}"]
        assert int(got[0][-1]) == 255 and int(stored[case.name][0][-1]) != 255
        case, got = ours["edge"][f"edge-blocks-q4/{dt}"]
        assert int(got[0].reshape(-1)[-1]) & 15 == 15 and int(stored[case.name][0].reshape(-1)[-1]) & 15 != 15


# -- int8 --------------------------------------------------------------------------------------------


def _row_scaled(X: torch.Tensor, row_stats: torch.Tensor) -> np.ndarray:
    """x * fl32(127 * fl32(1 / row_max)), the IEEE scaled values of the row codes (float32)."""
    a = X.float().numpy()
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        scale = np.float32(127) * (np.float32(1) / row_stats.numpy())
        return a * scale[:, None]


@pytest.mark.parametrize("family", ["int8", "int8dq", "edge-int8"])
def test_int8_matches_cuda(ours, family):
    from bnb_mps.testing import use_emulated_kernels

    ops = torch.ops.bitsandbytes
    set_name = "edge" if family.startswith("edge") else "main"
    problems, compared = {}, 0
    with use_emulated_kernels():
        for name, case, got, cuda, error in _each(ours, set_name, family):
            if cuda is None:  # CUDA's int8 ops take float16 only; we take the other dtypes too
                assert error and not isinstance(got, Exception), name
                continue
            compared += 1
            A = golden.tensor(case.args["A"], case.dtype, "cpu")
            p = problems[name] = []
            sa = cuda[2] if family == "int8dq" else cuda[1]
            p += [f"row codes: {e}" for e in rules.int8_codes(got[0], cuda[0], _row_scaled(A, sa))]
            if family == "edge-int8":
                for i, what in ((1, "row_stats"), (2, "outlier columns")):
                    p += [f"{what}: {e}" for e in rules.bits_equal(got[i], cuda[i])]
                continue
            if family == "int8dq":
                for i, what in ((1, "column codes"), (2, "row_stats"), (3, "col_stats"), (4, "outlier columns")):
                    p += [f"{what}: {e}" for e in rules.bits_equal(got[i], cuda[i])]
                continue
            for i, what in ((1, "row_stats"), (2, "outlier columns"), (4, "W's row_stats")):
                p += [f"{what}: {e}" for e in rules.bits_equal(got[i], cuda[i])]
            W = golden.tensor(case.args["W"], case.dtype, "cpu")
            p += [f"W's codes: {e}" for e in rules.int8_codes(got[3], cuda[3], _row_scaled(W, cuda[4]))]
            exact = got[0].numpy().astype(np.int64) @ got[3].numpy().astype(np.int64).T
            if not np.array_equal(got[5].numpy(), exact):
                p.append("int32 product of our codes is not exact")
            acc = ops.int8_linear_matmul(cuda[0], cuda[3])
            p += [f"int32 product of CUDA's codes: {e}" for e in rules.bits_equal(acc, cuda[5])]
            y = ops.int8_mm_dequant(cuda[5], cuda[1], cuda[4], torch.float16)
            ys = ops.int8_scaled_mm(cuda[0], cuda[3], cuda[1], cuda[4], None, torch.float16)
            for what, o, c in (("int8_mm_dequant", y, cuda[6]), ("int8_scaled_mm", ys, cuda[7])):
                if rules.ulps(o, c) > INT8_DEQUANT_ULPS:
                    p.append(f"{what} on CUDA's accumulator: {rules.ulps(o, c)} float16 ulps from CUDA's")
    assert compared
    assert not any(problems.values()), _report(problems)


# -- optimizers ---------------------------------------------------------------------------------------


def _check_optimizer(case, got, cuda) -> list[str]:
    keys = cuda[-1].split(",")
    if case.args["optimizer"] == "ademamix8" and "absmax1" in keys:
        got, cuda = _ademamix8_comparable(got, list(cuda), keys)
    problems = []
    if got[-1] != cuda[-1]:
        return [f"states {got[-1]}, CUDA {cuda[-1]}"]
    for name, o, c in zip(["p"] + keys, got[:-1], cuda[:-1]):
        if o.shape != c.shape or o.dtype != c.dtype:
            problems.append(f"{name}: {tuple(o.shape)} {o.dtype}, CUDA {tuple(c.shape)} {c.dtype}")
        elif o.dtype == torch.uint8:
            off = (o.int() - c.int()).abs()
            n_off = int((off > 0).sum())
            if n_off > OPT_CODES_OFF * o.numel() or (n_off and int(off.max()) > 1):
                problems.append(f"{name}: {n_off} of {o.numel()} codes off, by up to {int(off.max())}")
        elif name.startswith("absmax"):
            if rules.ulps(o, c) > OPT_ABSMAX_ULPS:
                problems.append(f"{name}: {rules.ulps(o, c)} ulps")
        elif name.startswith("qmap"):
            problems += [f"{name}: {e}" for e in rules.bits_equal(o, c)]
        else:
            scale = float(c.float().abs().nan_to_num(0.0, 0.0, 0.0).max())
            if rules.ulps(o, c, floor=scale) > OPT_ULPS:
                problems.append(f"{name}: {rules.ulps(o, c, floor=scale)} ulps at {scale}")
    return problems


def _ademamix8_comparable(got, cuda, keys):
    """AdEMAMix8bit: CUDA's state moved to our layout (bnb_mps.ademamix_layout). Where n is not a
    multiple of 256, CUDA's fast EMA's last block and slow EMA's first block share one scale, so
    CUDA's own steps read one of them with the other's scale: those two blocks, and the parameters
    they update, are left out (set equal to ours) of the comparison."""
    from bnb_mps.ademamix_layout import ademamix8bit_from_cuda

    i1, is1 = 1 + keys.index("absmax1"), 1 + keys.index("state1")
    cuda[is1], cuda[i1] = ademamix8bit_from_cuda(cuda[is1], cuda[i1])
    n = cuda[0].numel()
    if n % 256:
        got, blocks = list(got), -(-n // 256)
        last = slice((blocks - 1) * 256, n)
        for side in (cuda, got):
            side[0] = side[0].clone()
            side[0].reshape(-1)[last] = 0
            side[0].reshape(-1)[:256] = 0
        for i in (is1, i1):
            cuda[i] = cuda[i].clone()
            cuda[i][0, -1 if i == i1 else last] = got[i][0, -1 if i == i1 else last]
            cuda[i][1, 0 if i == i1 else slice(0, 256)] = got[i][1, 0 if i == i1 else slice(0, 256)]
    return got, cuda


@pytest.mark.parametrize("set_name,family", [("main", "opt"), ("edge", "opt"), ("edge", "edge-opt")])
def test_optimizers_match_cuda(ours, set_name, family):
    problems = {}
    for name, case, got, cuda, error in _each(ours, set_name, family):
        if case.args["optimizer"] == "ademamix32":
            continue  # test_ademamix32bit_refuses_bitsandbytes_short_state
        if cuda is None:  # CUDA's 32-bit classes refuse bfloat16 gradients; we serve them
            assert error and not isinstance(got, Exception), name
            continue
        problems[name] = [f"raised {got}"] if isinstance(got, Exception) else _check_optimizer(case, got, cuda)
    assert not any(problems.values()), _report(problems)


def test_ademamix32bit_refuses_bitsandbytes_short_state(ours):
    """bitsandbytes' AdEMAMix32bit allocates state1 with n elements where its 32-bit kernel reads 2n
    (CUDA then reads past the end); we refuse, naming the cause and what to use instead."""
    for set_name in ("main", "edge"):
        for name, case, got, cuda, error in _each(ours, set_name, "opt"):
            if case.args["optimizer"] == "ademamix32":
                assert isinstance(got, ValueError), name
                msg = str(got)
                assert "AdEMAMix32bit" in msg and "2n" in msg and "AdEMAMix(params, optim_bits=32)" in msg, msg


# -- the QLoRA path: weights ------------------------------------------------------------------------------


def test_qlora_weights_match_cuda(ours):
    import bitsandbytes.functional as F
    from bnb_mps.testing import use_emulated_kernels

    from cuda_golden import DT

    ops = torch.ops.bitsandbytes
    stored, _ = golden.load("mmq")
    code8 = F.create_dynamic_map().float()
    problems = {}
    with use_emulated_kernels():
        for name, case, got, cuda, _ in _each(ours, "mmq", "mmq-w"):
            p = problems[name] = []
            N, K = case.args["W"].shape
            nested = case.args["nested"]
            packed = cuda[0] if not nested else stored[name[:-1] + "0"][0]
            # packed bytes: quantize_4bit's rule (block size 64, NF4)
            x = sref._flat_f32(golden.tensor(case.args["W"], case.dtype, "cpu"))
            absmax = sref.blockwise_absmax(x, 64)
            s = sref.scaled_values(x, absmax, 64)
            mine, theirs = sref.unpack_nibbles(got[0], N * K), sref.unpack_nibbles(packed, N * K)
            p += rules.codes("nf4", mine, theirs, s, np.zeros(N * K, bool))
            if not nested:
                p += [f"absmax: {e}" for e in rules.bits_equal(got[2], cuda[2])]
                scales = cuda[2]
            else:
                if rules.ulps(got[3], cuda[3]) > 1:
                    p.append(f"offset (torch's mean) {rules.ulps(got[3], cuda[3])} ulps from CUDA's")
                scales = ops.dequantize_blockwise(cuda[2], cuda[4], code8, 256, torch.float32) + cuda[3]
            deq = ops.dequantize_4bit(packed, scales, 64, "nf4", [N, K], DT[case.dtype])
            rows = cuda[1].shape[0]
            p += [f"dequantized with CUDA's state: {e}" for e in rules.bits_equal(deq[:rows], cuda[1])]
    assert not any(problems.values()), _report(problems)
