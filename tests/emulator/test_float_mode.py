"""The emulator's float modes on planted kernels (kernels/float_mode.metal).

"apple" (the default) computes like an Apple GPU: float32 subnormal inputs count as zero and
subnormal float32 results flush to zero with their sign, fp16 subnormals are kept, bfloat
subnormals (float32 ones) flush. "ieee" keeps float32 subnormals, as the host CPU does. The
references are numpy float32/float16 arithmetic with the flush applied explicitly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bnb_mps.emulator.library import FLOAT_MODE_ENV, default_float_mode
from bnb_mps.kernel_args import float32, uint32

from emu_support import KERNELS, ORDERS, load_kernels

F32 = np.float32
TINY = F32(2.0**-126)  # the smallest normal float32


@pytest.fixture(scope="module")
def lib(compiler):
    return load_kernels("float_mode.metal", compiler)


def flush(x: np.ndarray) -> np.ndarray:
    """float32 subnormals -> zero of the same sign (NaN and everything else unchanged)."""
    x = np.asarray(x, dtype=F32)
    return np.where(np.abs(x) < TINY, np.copysign(F32(0), x), x).astype(F32)


def bits(x) -> np.ndarray:
    return np.asarray(x, dtype=F32).view(np.uint32)


# Pairs (a, b): subnormal inputs of both signs, normal inputs whose product or sum is subnormal,
# and ordinary values, so that each mode's difference shows in some element.
A = np.array([1e-40, -1e-40, 2.0**-100, -(2.0**-100), 3.0, 2.0**-125, 1.5, -2.5e-39], dtype=F32)
B = np.array([1.0, 1.0, 2.0**-30, 2.0**-30, 0.5, -(2.0**-125) * 0.75, 1e-39, 1.0], dtype=F32)


def run_mul_add(lib, mode, order="forward"):
    out = torch.full((2 * A.size,), float("nan"))
    kwargs = {} if mode is None else {"float_mode": mode}
    lib.launch("f32_mul_add", grid=1, threadgroup=A.size, order=order,
               args=[torch.from_numpy(A.copy()), torch.from_numpy(B.copy()), out, uint32(A.size)], **kwargs)  # fmt: skip
    return out.numpy()[: A.size], out.numpy()[A.size :]


@pytest.mark.parametrize("order", ORDERS)
def test_apple_mode_flushes_float32_subnormal_inputs_and_results(lib, order):
    prod, total = run_mul_add(lib, "apple", order)
    a, b = flush(A), flush(B)
    assert np.array_equal(bits(prod), bits(flush(a * b)))
    assert np.array_equal(bits(total), bits(flush(a + b)))
    # What the modes differ on, stated directly: a subnormal input times 1 is a signed zero, and
    # 2^-100 * 2^-30 (normal operands, subnormal product) is a signed zero.
    assert bits(prod[:4]).tolist() == bits(np.array([0.0, -0.0, 0.0, -0.0], F32)).tolist()


def test_ieee_mode_keeps_float32_subnormals(lib):
    prod, total = run_mul_add(lib, "ieee")
    assert np.array_equal(bits(prod), bits(A * B))
    assert np.array_equal(bits(total), bits(A + B))
    assert prod[0] == F32(1e-40) and prod[2] == F32(2.0**-130)


def test_comparisons_see_subnormals_as_zero_in_apple_mode(lib):
    a = np.array([1e-40, -1e-40, TINY, 0.0, 1.0], dtype=F32)
    for mode, want in (("apple", [2, 2, 1, 2, 1]), ("ieee", [1, 0, 1, 2, 1])):
        flags = torch.zeros(a.size, dtype=torch.int32)
        lib.launch("f32_compare", grid=1, threadgroup=a.size, args=[torch.from_numpy(a.copy()), flags, uint32(a.size)],
                   float_mode=mode)  # fmt: skip
        assert flags.tolist() == want, mode


@pytest.mark.parametrize("mode", ["apple", "ieee"])
def test_fp16_subnormals_are_kept_in_both_modes(lib, mode):
    a = np.array([2.0**-20, -(2.0**-20), 2.0**-24, 2.0**-14, 0.5, 3.0], dtype=np.float16)
    b = np.array([0.5, 0.25, 1.0, 2.0**-3, 2.0**-20, 2.0**-16], dtype=np.float16)
    want = a * b  # float16 arithmetic rounds each product to fp16, subnormals included
    assert (np.abs(want[:5]) < np.finfo(np.float16).tiny).sum() >= 4  # mostly fp16 subnormal results
    out = torch.zeros(a.size, dtype=torch.float16)
    lib.launch("f16_mul", grid=1, threadgroup=a.size,
               args=[torch.from_numpy(a.copy()), torch.from_numpy(b.copy()), out, uint32(a.size)], float_mode=mode)  # fmt: skip
    assert np.array_equal(out.numpy().view(np.uint16), want.view(np.uint16))


def test_bfloat_subnormals_flush_in_apple_mode_only(lib):
    x = torch.tensor([1e-39, -2e-39, 1e-30, 3.0]).to(torch.bfloat16)
    assert (x[:2].float().abs() < float(TINY)).all()  # bfloat subnormals
    for mode in ("apple", "ieee"):
        out = torch.full_like(x, float("nan"))
        lib.launch("bf16_scale", grid=1, threadgroup=4, args=[x, out, float32(1.0), uint32(4)], float_mode=mode)
        want = x.float().numpy()
        if mode == "apple":
            want = flush(want)
        assert np.array_equal(out.float().numpy().view(np.uint32), want.view(np.uint32)), mode


@pytest.mark.parametrize("order", ORDERS)
def test_simd_reductions_run_in_the_mode(lib, order):
    a = np.full(64, 2.0**-140, dtype=F32)  # subnormal lanes: 2^-135 summed exactly in IEEE
    a[32:] = 2.0**-100
    for mode, want in (("apple", [0.0, 32 * 2.0**-100]), ("ieee", [32 * 2.0**-140, 32 * 2.0**-100])):
        sums = torch.full((2,), float("nan"))
        lib.launch("f32_simd_sum", grid=2, threadgroup=32, args=[torch.from_numpy(a.copy()), sums], order=order,
                   float_mode=mode)  # fmt: skip
        assert sums.tolist() == [float(F32(w)) for w in want], mode


def test_modes_do_not_leak_between_launches_or_into_the_host(lib):
    for mode in ("apple", "ieee", "apple", "ieee"):
        prod, _ = run_mul_add(lib, mode)
        assert (prod[0] == 0) == (mode == "apple")
    # The caller's thread stays IEEE (the mode is set on the emulator's worker threads only).
    assert F32(1e-40) * F32(1.0) == F32(1e-40)
    assert torch.tensor([1e-40]).mul(1.0).item() != 0


def test_default_mode_is_apple_and_the_environment_switches_it(lib, monkeypatch):
    monkeypatch.delenv(FLOAT_MODE_ENV, raising=False)
    assert default_float_mode() == "apple"
    assert run_mul_add(lib, None)[0][0] == 0
    monkeypatch.setenv(FLOAT_MODE_ENV, "ieee")
    assert default_float_mode() == "ieee"
    assert run_mul_add(lib, None)[0][0] == F32(1e-40)
    monkeypatch.setenv(FLOAT_MODE_ENV, "fast")
    with pytest.raises(ValueError, match=FLOAT_MODE_ENV):
        run_mul_add(lib, None)


def test_bad_float_mode_is_a_clear_error(lib):
    with pytest.raises(ValueError, match="float_mode must be 'apple' or 'ieee'"):
        run_mul_add(lib, "IEEE754")


def _conversion_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Every half bit pattern; float bit patterns with every sign, exponent and top 7 mantissa
    bits, each with low bits at a rounding boundary (a tie with an even and with an odd kept bit,
    just below a tie) or random."""
    h = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    upper = torch.arange(65536, dtype=torch.int64) << 16
    g = torch.Generator().manual_seed(5)
    lows = [torch.full((65536,), v, dtype=torch.int64) for v in (0x1000, 0x3000, 0x0FFF)]
    lows.append(torch.randint(0, 65536, (65536,), dtype=torch.int64, generator=g))
    f = torch.cat([upper | low for low in lows])
    f = torch.where(f >= 2**31, f - 2**32, f).to(torch.int32)
    return h.repeat(len(lows)), f


def _convert(lib, mode):
    h, f = _conversion_inputs()
    h_to_f, f_to_h = torch.zeros(h.numel(), dtype=torch.int32), torch.zeros(f.numel(), dtype=torch.int16)
    lib.launch("half_float_conversions", threads=h.numel(), threadgroup=256, args=[h, h_to_f, f, f_to_h],
               float_mode=mode)  # fmt: skip
    return h_to_f, f_to_h


@pytest.mark.parametrize("mode", ["apple", "ieee"])
def test_half_conversions_by_instruction_equal_the_library_ones(lib, compiler, monkeypatch, mode):
    # Kernel modules are built with -mf16c where the CPU has F16C (bnb_mps.emulator.build.isa_flags):
    # one instruction per conversion instead of a libgcc call. The bits must be the library's, for
    # every half and the float rounding boundaries, flushing or not.
    from bnb_mps import emulator
    from bnb_mps.emulator import build

    if "-mf16c" not in build.isa_flags(build.find_compiler(compiler)):
        pytest.skip("kernel modules are not built with -mf16c here")
    monkeypatch.setenv("BNB_MPS_EMU_CXXFLAGS", "-mno-f16c")
    library_calls = emulator.load(KERNELS / "float_mode.metal", compiler=compiler)
    h_to_f, f_to_h = _convert(lib, mode)
    by_library = _convert(library_calls, mode)
    assert torch.equal(h_to_f, by_library[0]) and torch.equal(f_to_h, by_library[1])
    # And both are IEEE round-to-nearest-even, against numpy (NaNs compared as NaNs).
    h, f = _conversion_inputs()
    want_f = h.numpy().view(np.float16).astype(F32)
    got_f = h_to_f.numpy().view(F32)
    assert np.array_equal(np.isnan(got_f), np.isnan(want_f))
    assert np.array_equal(got_f[~np.isnan(want_f)].view(np.uint32), want_f[~np.isnan(want_f)].view(np.uint32))
    src = f.numpy().view(F32)
    with np.errstate(over="ignore"):
        want_h = (flush(src) if mode == "apple" else src).astype(np.float16)
    got_h = f_to_h.numpy().view(np.float16)
    assert np.array_equal(np.isnan(got_h), np.isnan(want_h))
    assert np.array_equal(got_h[~np.isnan(want_h)].view(np.uint16), want_h[~np.isnan(want_h)].view(np.uint16))


@pytest.mark.parametrize("mode", ["apple", "ieee"])
def test_fused_multiply_adds_run_in_the_mode(lib, mode):
    # fma() and the fused multiply-adds of simdgroup_matrix products (csrc/emu: one per k, in k order)
    # take and give float32 subnormals as the mode says: a * b + c rounded once, with the operands
    # and the result flushed in "apple" mode.
    c = np.array([0.0, 1e-40, 0.0, 2.0**-126, -3.0, 2.0**-125, 0.0, 1.0], dtype=F32)
    z = flush if mode == "apple" else (lambda x: np.asarray(x, dtype=F32))

    def fused(x, y, acc):  # exact in float64 for these operands, then one rounding to float32
        return z(F32(np.float64(z(x)) * np.float64(z(y)) + np.float64(z(acc))))

    out, prod = torch.full((8,), float("nan")), torch.full((64,), float("nan"))
    lib.launch("f32_fma", grid=1, threadgroup=32, float_mode=mode,
               args=[torch.from_numpy(A.copy()), torch.from_numpy(B.copy()), torch.from_numpy(c.copy()), out, prod])
    want = np.array([fused(A[i], B[i], c[i]) for i in range(8)], dtype=F32)
    assert np.array_equal(bits(out.numpy()), bits(want))
    # element (i, i) of the product: c[i], then for k = 0..7 one fused multiply-add, of zeros but at k = i
    diag = []
    for i in range(8):
        acc = z(c[i])
        for k in range(8):
            acc = fused(A[i], B[i], acc) if k == i else fused(F32(0), F32(0), acc)
        diag.append(acc)
    got = prod.numpy().reshape(8, 8)
    assert np.array_equal(bits(np.diag(got)), bits(np.array(diag, dtype=F32)))
    assert (got[~np.eye(8, dtype=bool)] == 0).all()
    if mode == "apple":  # 2^-100 * 2^-30: normal operands, a subnormal fused result, flushed
        assert out[2].item() == 0.0 and got[2, 2] == 0.0
    else:
        assert out[2].item() == 2.0**-130 and got[2, 2] == F32(2.0**-130)
