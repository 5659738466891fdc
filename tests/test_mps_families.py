"""The machinery of the `mps` suite, here on the CPU: inputs place special values where they say,
comparisons treat NaN as NaN, every op with a Metal kernel belongs to a family, and every family's
cases (at small sizes) pass through the project's kernels under the emulator, which checks the
table's references and calls before a Mac runs them."""

from __future__ import annotations

import contextlib

import pytest
import torch

import mps_families as fam
import spec_reference as ref
from bnb_mps import ops


@pytest.mark.parametrize("n,blocksize", [(6, 64), (100, 64), (1000, 32), (4097, 4096), (64 * 40 + 5, 64), (12_345, 256)])
@pytest.mark.parametrize("dtype", ref.DTYPES, ids=str)
def test_specials_are_inside_blocks(n, blocksize, dtype):
    x, where = fam.special_input(n, dtype, blocksize, seed=1)
    assert x.shape == (n,) and x.dtype == dtype
    for name in fam.POINT_SPECIALS:
        assert name in where, name  # enough interior positions: every point special is placed
        i = where[name]
        assert 0 <= i < n and i % blocksize != 0, (name, i)
        v = x[i].float()
        check = {"nan": torch.isnan(v), "+inf": v == float("inf"), "-inf": v == -float("inf"),
                 "-0.0": v == 0 and torch.signbit(v), "subnormal": 0 < v < torch.finfo(dtype).tiny}[name]
        assert bool(check), (name, v)
    assert len(set(where[k] for k in fam.POINT_SPECIALS)) == len(fam.POINT_SPECIALS)
    full_blocks = n // blocksize
    if full_blocks - 1 >= len(fam.BLOCK_SPECIALS):
        blocks = [where[k] for k in fam.BLOCK_SPECIALS]
        assert len(set(blocks)) == len(blocks) and all(0 < b < full_blocks for b in blocks)
        zero = x[where["zero_block"] * blocksize : (where["zero_block"] + 1) * blocksize]
        assert torch.all(zero == 0)
        tie = x[where["tie_block"] * blocksize : (where["tie_block"] + 1) * blocksize].float()
        assert tie.abs().max() == 1.0 and tie[0].abs() != 1.0  # the block max is inside the block


@pytest.mark.parametrize("blocksize", [64, 4096])
def test_most_blocks_exercise_the_code_search(blocksize):
    """Unlike inputs that start with [0, nan, inf], almost every block has a finite, non-zero
    absmax, so its elements go through the nearest-code search."""
    n = 200 * blocksize + 7
    x, _ = fam.special_input(n, torch.float32, blocksize, seed=3)
    _, absmax = ref.quantize_blockwise(x, fam.signed_code(), blocksize)
    normal = torch.isfinite(absmax) & (absmax > 0)
    assert normal.float().mean() >= 0.95


def test_small_inputs_keep_specials_off_block_starts():
    x, where = fam.special_input(3, torch.float16, 64, seed=0)
    assert set(where) == {"nan", "+inf"} and where["nan"] != where["+inf"] and 0 not in where.values()
    x, where = fam.special_input(1, torch.float16, 64, seed=0)
    assert where == {} and torch.isfinite(x).all()
    assert fam.special_input(0, torch.float32, 64, seed=0)[0].numel() == 0


def test_same_bits_treats_nan_as_nan_and_checks_everything_else():
    a = torch.tensor([1.0, float("nan"), -0.0], dtype=torch.float16)
    other_nan = torch.tensor([1.0, 0.0, -0.0], dtype=torch.float16)
    other_nan[1] = torch.tensor(0x7E01, dtype=torch.int16).view(torch.float16)  # another payload
    negative_nan = a.clone().view(torch.int16)
    negative_nan[1] = negative_nan[1] | -0x8000
    fam.assert_same_bits(a, other_nan)
    fam.assert_same_bits(a, negative_nan.view(torch.float16))
    with pytest.raises(AssertionError, match="NaN positions"):
        fam.assert_same_bits(a, torch.tensor([1.0, 2.0, -0.0], dtype=torch.float16))
    with pytest.raises(AssertionError, match="1 of 3 elements differ"):
        fam.assert_same_bits(a, torch.tensor([1.0, float("nan"), 0.0], dtype=torch.float16))  # -0.0 vs +0.0
    with pytest.raises(AssertionError, match="dtype"):
        fam.assert_same_bits(a, a.float())
    with pytest.raises(AssertionError, match="shape"):
        fam.assert_same_bits(a, a[:2])
    fam.assert_same_bits((a, torch.tensor([3], dtype=torch.uint8)), (other_nan, torch.tensor([3], dtype=torch.uint8)))
    with pytest.raises(AssertionError):
        fam.assert_same_bits((a, torch.tensor([3], dtype=torch.uint8)), (a, torch.tensor([4], dtype=torch.uint8)))


def test_assert_close_treats_nan_as_nan():
    close = fam.assert_close(rtol=1e-3, atol=0)
    close(torch.tensor([1.0, float("nan")]), torch.tensor([1.0005, float("nan")]))
    with pytest.raises(AssertionError):
        close(torch.tensor([1.0, float("nan")]), torch.tensor([1.01, float("nan")]))
    with pytest.raises(AssertionError):
        close(torch.tensor([1.0, 2.0]), torch.tensor([1.0, float("nan")]))


def test_device_views_are_views_on_the_device():
    base = torch.arange(20.0)
    mid = fam.DeviceView(base, lambda b: b[3:13])
    v = mid.on("cpu")
    assert v.storage_offset() == 3 and v.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    t = fam.DeviceView(base.reshape(4, 5), lambda b: b.t()).on("cpu")
    assert not t.is_contiguous() and t.shape == (5, 4)


def test_every_kernel_is_in_a_family():
    """An op that gains a Metal kernel must get a table entry (one `Family`), so a Mac checks it."""
    with_kernel = {name for name, op in ops.OPS.items() if op.kernel is not None}
    covered = {op for f in fam.FAMILIES for op in f.ops}
    assert with_kernel <= covered, f"ops with a kernel but no family in tests/mps_families.py: {sorted(with_kernel - covered)}"
    assert covered <= set(ops.OPS)
    for f in fam.FAMILIES:
        assert min(f.sizes) == 1 and max(f.sizes) >= 16 * 2**20 - 64, f.name
        assert set(f.cpu_sizes) <= set(f.sizes) or max(f.cpu_sizes) < 100_000


def test_cases_cover_every_op_of_their_family():
    for f in fam.FAMILIES:
        seen = {c.op for n in f.sizes if n < 100_000 for c in f.cases(n)}
        assert seen == set(f.ops), (f.name, set(f.ops) - seen)


@contextlib.contextmanager
def emulated_kernels(float_mode: str = "apple"):
    """bnb_mps.testing.use_emulated_kernels, skipping only where the emulator's runtime is not built:
    any other error (a bad float mode, a kernel that does not compile) fails."""
    import bitsandbytes  # noqa: F401  (first: importing it later would put its own CPU kernels back)

    from bnb_mps import executors
    from bnb_mps.testing import use_emulated_kernels

    try:
        executors.load_tier("emulated")
    except executors.ExecutorUnavailable as e:
        pytest.skip(f"emulator unavailable: {e}")
    with use_emulated_kernels(float_mode=float_mode) as recorder:
        yield recorder


@pytest.fixture(scope="module")
def emulated():
    # The emulator computes like an Apple GPU (float32 subnormals flushed), and the families'
    # references expect what the hardware computes (tests/spec_reference.py's flush mode): the cases
    # pass here exactly as they must on a Mac.
    with emulated_kernels(float_mode="apple") as recorder:
        yield recorder


def test_the_emulated_kernels_fail_on_anything_but_a_missing_emulator():
    """(A bad float mode once skipped the whole Linux run of the family table.)"""
    with pytest.raises(ValueError, match="float_mode must be 'apple' or 'ieee'"):
        with emulated_kernels(float_mode="fast"):
            pass


CPU_RUNS = [(f, n) for f in fam.FAMILIES for n in f.cpu_sizes]


@pytest.mark.parametrize("family,n", CPU_RUNS, ids=[f"{f.name}-n{n}" for f, n in CPU_RUNS])
def test_family_cases_pass_under_the_emulator(emulated, family, n):
    """The same cases a Mac runs, on CPU tensors through the project's kernels (emulated)."""
    before = len(emulated.launched)
    count = 0
    for case in family.cases(n):
        fam.run_case(case, "cpu")
        count += 1
    assert count > 0
    launched = emulated.launched[before:]
    assert launched, "no kernel ran"


@pytest.mark.parametrize("family", [f for f in fam.FAMILIES if set(fam.FEATURE_SIZES) <= set(f.sizes)],
                         ids=lambda f: f.name)  # fmt: skip
def test_feature_cases_pass_under_the_emulator(emulated, family):
    """Views, .out, storage types, empty tensors and bitsandbytes.functional (double quantization)."""
    n = min(fam.FEATURE_SIZES)
    labels = []
    for case in family.cases(n):
        if "n=" in case.label and f"n={n} " in case.label and "blocksize=" in case.label and "functional" not in case.label:
            continue  # the plain grid is covered above
        fam.run_case(case, "cpu")
        labels.append(case.label)
    text = " ".join(labels)
    for feature in ("mid-storage", "transposed", ".out", "empty", "functional"):
        assert feature in text, (family.name, feature)


def test_flush_cases_tell_apple_from_ieee():
    """Every case that holds float32 values an Apple GPU flushes (docs/semantics.md section 7) states what
    IEEE arithmetic would give, and its comparison rejects that: the case does exercise the flush.
    The int8 and optimizer families have such cases at their CPU sizes (rows and columns of
    subnormals, statistics near 2^-64, subnormal gradients, states decaying below 2^-126), and
    special values where their sections define them (NaN and -inf activations, 8-bit state blocks
    above 2^126); the 4-bit products have them on each of their paths (activations and block scales
    below 2^-126)."""
    seen = {}
    for family in fam.FAMILIES:
        for n in family.cpu_sizes:
            for case in family.cases(n):
                if case.ieee_want is None:
                    continue
                seen.setdefault(family.name, []).append(case.label)
                with pytest.raises(AssertionError):
                    case.compare(case.ieee_want, case.want, case.label)
    assert {"int8", "optimizers", "matmul_4bit"} <= set(seen), seen.keys()
    labels = " ".join(label for family in ("int8", "optimizers", "matmul_4bit") for label in seen[family])
    for op in ("int8_vectorwise_quant", "int8_double_quant", "int8_vectorwise_dequant", "int8_mm_dequant",
               "int8_scaled_mm", "optimizer_update_8bit_blockwise", "optimizer_update_32bit"):
        assert op in labels, op
    for path in fam.APPLE_PATHS:  # the 4-bit products' flush model, on each kernel path
        for what in ("activations below 2^-126", "block scales below 2^-126"):
            assert sum(f"gemm_4bit {path} " in label and what in label for label in seen["matmul_4bit"]) == 2
    from bnb_mps.ops.matmul_4bit import choose_path

    for case in fam.matmul_4bit_flush_cases():  # (each on the path its label names)
        (M, K), N = case.args[0].shape, case.args[2][0]
        assert f"gemm_4bit {choose_path(M, N, K)} M={M} " in case.label, case.label
    optim = [c.label for n in fam.FAMILIES[4].cpu_sizes for c in fam.FAMILIES[4].cases(n)]
    assert sum("above 2^126" in label for label in optim) == 2


def test_int8_specials_are_placed():
    x = fam._int8_specials(torch.randn(16, 256).to(torch.bfloat16))
    tiny = torch.finfo(torch.bfloat16).tiny
    assert (x[2].float().abs() < tiny).all() and (x[2] != 0).sum() > 100
    assert (x[:, 2].float().abs() < tiny).all() and torch.isnan(x[4]).sum() == 1 and torch.isinf(x[5]).sum() == 1
    assert fam._int8_specials(torch.ones(1, 1)).equal(torch.ones(1, 1))  # no room: unchanged


def test_a_wrong_reference_is_caught(emulated):
    """The harness fails when the kernel result differs from the reference."""
    case = next(iter(fam.FAMILIES[0].cases(1000)))
    q, absmax = case.want
    bad = fam.Case(case.label, case.op, case.args, (q, absmax * 2))
    with pytest.raises(AssertionError, match="differ"):
        fam.run_case(bad, "cpu")


def test_uses_dtype_sees_inputs_views_dtype_arguments_and_references():
    case = next(c for c in fam.FAMILIES[0].cases(1000) if "bfloat16" in c.label)
    assert fam.uses_dtype(case, torch.bfloat16)
    plain = fam.Case("x", "quantize_blockwise", (torch.zeros(3), fam.signed_code(), 64), (torch.zeros(3, dtype=torch.uint8),))
    assert not fam.uses_dtype(plain, torch.bfloat16)
    view = fam.Case("x", "quantize_blockwise", (fam.DeviceView(torch.zeros(4, dtype=torch.bfloat16), lambda b: b[1:]),), None)
    assert fam.uses_dtype(view, torch.bfloat16)


def test_the_32bit_state_bound_is_what_contracting_the_update_can_change():
    """A 32-bit optimizer case takes the reference's states and states within its bound (2^-23 of the
    magnitudes of the update's terms plus an ulp: fam.state_bound_32bit), and rejects states twice as
    far; and states near 2^-126 off by 1e-20, which an absolute tolerance of 1e-12 took."""
    cases = [c for c in fam.optimizer_cases(4_173) if c.op == "optimizer_update_32bit" and "clip=0.0 " in c.label]
    assert {c.label.split()[1] for c in cases} >= {"adam", "momentum", "rmsprop", "adagrad", "lion", "ademamix"}
    for case in cases:
        args = list(case.args)
        exact = fam._after(args, case.want)
        case.compare(exact, case.want, case.label)
        for scale, passes in ((0.5, True), (2.0, False)):
            got = list(exact)
            for i, w in ((3, case.want.state1), (4, case.want.state2)):
                if w is not None:
                    got[i] = (w.double() + scale * fam.state_bound_32bit(args, w, args[i])).float()
            if passes:
                case.compare(got, case.want, case.label)
            else:
                with pytest.raises(AssertionError, match="states beyond"):
                    case.compare(got, case.want, case.label)
    (tiny,) = [c for c in fam.optimizer_cases(4_173) if "adam states decaying below 2^-126" in c.label]
    got = fam._after(list(tiny.args), tiny.want)
    tiny.compare(got, tiny.want, tiny.label)
    got[3] = got[3] + 1e-20
    with pytest.raises(AssertionError, match="states beyond"):
        tiny.compare(got, tiny.want, tiny.label)
    torch.testing.assert_close(got[3], tiny.want.state1, rtol=1e-6, atol=1e-12)  # (what the old check took)
