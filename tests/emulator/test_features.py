"""Feature kernels (kernels/features.metal) against plain references, under every lane order and
with every available compiler. Integer and bit-level results must match exactly; float results
of libm functions within a few ulp."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import torch

from bnb_mps import emulator
from bnb_mps.kernel_args import float32, uint32

from emu_support import ORDERS, load_kernels


@pytest.fixture(scope="module")
def lib(compiler):
    return load_kernels("features.metal", compiler)


def launch_all_orders(lib, kernel, *, make_args, check, **geometry):
    """Runs `kernel` under each lane order on fresh arguments and checks each result."""
    for order in ORDERS:
        args = make_args()
        lib.launch(kernel, args=args, order=order, seed=7, **geometry)
        check(args)


def test_registry_lists_plain_and_template_kernels(lib):
    names = set(lib.kernels)
    assert {"type_sizes", "vectors", "simd_fns", "scale_by_f32", "scale_by_f16"} <= names
    assert "scale_by" not in names  # a template is only reachable through its instantiations


def test_type_sizes_match_msl(lib):
    out = torch.zeros(10, dtype=torch.int32)
    lib.launch("type_sizes", grid=1, threadgroup=1, args=[out])
    assert out.tolist() == [16, 16, 8, 8, 4, 12, 4, 2, 8, 16]


def test_vectors(lib):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=g)

    def check(args):
        out = args[1].view(64, 10, 4)
        r = x.flip(1)
        torch.testing.assert_close(out[:, 0], r, rtol=0, atol=0)
        torch.testing.assert_close(out[:, 1], torch.stack([x[:, 0] + x[:, 2], x[:, 1] + x[:, 3], x[:, 0], torch.ones(64)], 1), rtol=0, atol=0)
        t = x.clone()
        t[:, 0], t[:, 2] = 7.0, 8.0
        t[:, 1] += 1
        torch.testing.assert_close(out[:, 2], t, rtol=0, atol=0)
        torch.testing.assert_close(out[:, 3, :3], x[:, :3] * 2 - 1, rtol=0, atol=0)
        torch.testing.assert_close(out[:, 4], torch.where(x > 0, x, torch.zeros(())), rtol=0, atol=0)
        torch.testing.assert_close(out[:, 5], x.clamp(-0.5, 0.5), rtol=0, atol=0)
        torch.testing.assert_close(out[:, 6], x + (r - x) * 0.25, rtol=0, atol=0)
        torch.testing.assert_close(out[:, 7, :2], torch.minimum(x, r)[:, :2], rtol=0, atol=0)
        torch.testing.assert_close(out[:, 7, 2:], torch.maximum(x, r)[:, 2:], rtol=0, atol=0)
        dot = (x * r).sum(1)
        torch.testing.assert_close(out[:, 8, 0], dot, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out[:, 8, 1], x[:, :2].norm(dim=1), rtol=1e-6, atol=0)
        assert (out[:, 8, 2] == 1).all() and (out[:, 8, 3] == 0).all()
        iv = (x.abs() * 10).to(torch.int64)
        torch.testing.assert_close(out[:, 9], (iv >> 1).float(), rtol=0, atol=0)

    launch_all_orders(lib, "vectors", grid=2, threadgroup=32, check=check,
                      make_args=lambda: [x.clone(), torch.zeros(64 * 10 * 4)])


def _bfloat_rne(v: torch.Tensor) -> torch.Tensor:
    # Independent reference: round the float bits to the upper 16 with ties to even.
    u = v.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    return (r << 16).to(torch.int32).view(torch.float32) if False else (r << 16).to(torch.uint32).view(torch.float32)


def test_half_and_bfloat(lib):
    vals = torch.tensor([0.0, 1.0, -2.5, 1.00048828125, 3.14159, 65504.0, 1e-5, 1.0 + 2**-8, 1.0 + 3 * 2**-8,
                         -7.77, 0.1, 123.456, 2.0**-20, 1000.0, -0.5, 0.333] * 2, dtype=torch.float32)
    n = vals.numel()

    def check(args):
        _, h, b, f = args
        assert torch.equal(h, vals.half())
        assert torch.equal(b.float(), vals.bfloat16().float())  # torch also rounds to nearest even
        assert torch.equal(b.float(), _bfloat_rne(vals))
        hh = vals.half()
        p = (hh * hh + torch.tensor(1.5, dtype=torch.half)).float()  # torch half ops round per op too
        f = f.view(n, 4)
        assert torch.equal(f[:, 0], p)
        assert torch.equal(f[:, 1], (hh * torch.tensor(0.5, dtype=torch.half)).float())
        assert torch.equal(f[:, 2], vals.bfloat16().float() * 2)
        assert torch.equal(f[:, 3], (vals.bfloat16().float() + 1).bfloat16().float())

    launch_all_orders(lib, "half_bfloat", grid=1, threadgroup=n, check=check,
                      make_args=lambda: [vals.clone(), torch.zeros(n, dtype=torch.half),
                                         torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n * 4)])


def test_math(lib):
    x = torch.linspace(-3, 3, 96, dtype=torch.float32)

    def check(args):
        o = args[1].view(96, 12).double()
        xd = x.double()
        a = xd.abs() + 0.5
        lut = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.float64)[torch.arange(96) % 4]
        ref = [xd.exp(), a.log(), a.sqrt(), 1 / a, xd - xd.floor(), (x * 3).round().double(),
               torch.sign(xd * 3) * torch.floor((xd * 3).abs() + 0.5), xd.floor(), torch.exp2(xd), xd * 2 + 1,
               a ** 1.5, a.sqrt() * lut]
        for i, r in enumerate(ref):
            torch.testing.assert_close(o[:, i], r.float().double(), rtol=4e-7, atol=1e-7, msg=f"column {i}")

    launch_all_orders(lib, "math_fns", grid=3, threadgroup=32, check=check,
                      make_args=lambda: [x.clone(), torch.zeros(96 * 12)])


def _int_ref(x: int) -> list[int]:
    m = 0xFFFFFFFF
    rot = ((x << 7) | (x >> 25)) & m
    ins = (x & ~(0xF << 8) & m) | (0x5 << 8)
    rev = int(f"{x:032b}"[::-1], 2)
    b = x.to_bytes(4, "little")
    f = struct.unpack("<I", struct.pack("<f", float(x & 0xFFFF)))[0]
    return [bin(x).count("1"), 32 - x.bit_length(), (x & -x).bit_length() - 1 if x else 32, (x >> 4) & 0xFF, ins,
            rev, rot, (x * 0x9E3779B9) >> 32, abs(x - 0x80000000), min(x + 0x80000000, m), b[0] + (b[3] << 8), f]


def test_integer_functions(lib):
    rng = np.random.default_rng(3)
    vals = [0, 1, 0x80000000, 0xFFFFFFFF, 0x12345678] + [int(v) for v in rng.integers(0, 2**32, 59, dtype=np.uint64)]
    x = torch.tensor(np.array(vals, dtype=np.uint32).view(np.int32))

    def check(args):
        got = args[1].numpy().view(np.uint32).reshape(64, 12)
        for i, v in enumerate(vals):
            assert got[i].tolist() == _int_ref(v), f"value {v:#x}"

    launch_all_orders(lib, "int_fns", grid=2, threadgroup=32, check=check,
                      make_args=lambda: [x.clone(), torch.zeros(64 * 12, dtype=torch.int32)])


def _simd_ref(x: np.ndarray, bits: np.ndarray, n_threads: int):
    out = np.zeros((n_threads, 12), np.float32)
    uout = np.zeros((n_threads, 8), np.uint32)
    for sg in range(0, n_threads, 32):
        lanes = list(range(sg, min(sg + 32, n_threads)))
        xs = x[lanes]
        bs = bits[lanes]
        s = np.float32(0)
        for v in xs:  # lane order, in float32
            s = np.float32(s + v)
        prefix = np.cumsum(xs.astype(np.float64))
        run = np.float32(0)
        incl = []
        for v in xs:
            run = np.float32(run + v)
            incl.append(run)
        ballot = sum(1 << i for i, v in enumerate(xs) if v > 0)
        sign_prod = np.float32(np.prod(np.where(xs > 0, 1.0, -1.0)))
        n = len(lanes)
        for i, t in enumerate(lanes):
            def at(j):
                return xs[j] if 0 <= j < n else 0.0  # inactive lanes read as zero
            out[t] = [s, xs.min(), xs.max(), incl[i], incl[i] - xs[i] if i else 0.0, at((i + 5) % 32),
                      at(i + 3) if i + 3 < 32 else xs[i], at(i - 2) if i >= 2 else xs[i], at(i ^ 1), xs[7] if n > 7 else 0,
                      xs[0], sign_prod]
            out[t, 4] = incl[i - 1] if i else 0.0
            uout[t] = [np.bitwise_and.reduce(bs), np.bitwise_or.reduce(bs), np.bitwise_xor.reduce(bs), ballot,
                       int((xs > 2).any()), int((xs > -100).all()), int(i == 0), n]
        del prefix
    return out, uout


@pytest.mark.parametrize("threads", [48, 64])
def test_simd_functions(lib, threads):
    rng = np.random.default_rng(threads)
    x = rng.standard_normal(threads).astype(np.float32) * 2
    bits = rng.integers(0, 2**32, threads, dtype=np.uint64).astype(np.uint32)
    ref, uref = _simd_ref(x, bits, threads)

    def check(args):
        got = args[2].numpy().reshape(threads, 12)
        np.testing.assert_array_equal(got, ref)
        assert (args[3].numpy().view(np.uint32).reshape(threads, 8) == uref).all()

    launch_all_orders(lib, "simd_fns", grid=1, threadgroup=threads, check=check,
                      make_args=lambda: [torch.from_numpy(x.copy()), torch.from_numpy(bits.view(np.int32).copy()),
                                         torch.zeros(threads * 12), torch.zeros(threads * 8, dtype=torch.int32)])


def test_threadgroup_reduction_and_transpose(lib):
    x = torch.randint(-50, 50, (4 * 256,)).float()

    def check(args):
        assert torch.equal(args[1], x.view(4, 256).sum(1))
        assert torch.equal(args[2].view(4, 16, 16), x.view(4, 16, 16).transpose(1, 2))

    launch_all_orders(lib, "tg_reduce", grid=4, threadgroup=(16, 16), check=check,
                      make_args=lambda: [x.clone(), torch.zeros(4), torch.zeros(4 * 256)])
    emulator.run_checked(lib, "tg_reduce", grid=4, threadgroup=(16, 16), args=[x.clone(), torch.zeros(4), torch.zeros(4 * 256)])


def test_simdgroup_matrix(lib):
    a = torch.randint(-4, 4, (8, 16)).float()
    b = torch.randint(-4, 4, (16, 8)).float()

    def check(args):
        assert torch.equal(args[2].view(8, 8), a @ b)

    launch_all_orders(lib, "sg_matmul", grid=1, threadgroup=32, check=check,
                      make_args=lambda: [a.flatten().clone(), b.flatten().clone(), torch.zeros(64)])
    emulator.run_checked(lib, "sg_matmul", grid=1, threadgroup=32, args=[a.flatten(), b.flatten(), torch.zeros(64)])


@pytest.mark.parametrize("threads", [32, 16, 5])
def test_simdgroup_matrix_forms(lib, threads):
    g = torch.Generator().manual_seed(threads)
    a = torch.randint(-4, 4, (8, 8), generator=g).half()
    b = torch.randint(-4, 4, (8, 8), generator=g).half()
    c = torch.randint(-4, 4, (8, 8), generator=g).float()
    d = a.double() @ b.double().T  # small integers: exact in every order
    e = d @ c.double()

    def check(args):
        assert torch.equal(args[3].view(8, 8).double(), d)
        assert torch.equal(args[4].view(8, 8).double(), e.T)  # stored transposed
        assert torch.equal(args[5], torch.zeros(64))

    def make_args():
        return [a.flatten().clone(), b.flatten().clone(), c.flatten().clone(), torch.full((64,), 7.0),
                torch.full((64,), 7.0), torch.full((64,), 7.0)]  # fmt: skip

    launch_all_orders(lib, "sg_matrix_forms", grid=1, threadgroup=threads, check=check, make_args=make_args)
    emulator.run_checked(lib, "sg_matrix_forms", grid=1, threadgroup=threads, args=make_args())


def test_atomics_histogram(lib):
    n = 1000
    values = torch.randint(0, 1 << 20, (n,), dtype=torch.int32)

    def check(args):
        ref = torch.bincount(values % 16, minlength=16)
        assert torch.equal(args[1].long(), ref)

    launch_all_orders(lib, "histogram", threads=n, threadgroup=64, check=check,
                      make_args=lambda: [values.clone(), torch.zeros(16, dtype=torch.int32), uint32(n)])
    emulator.run_checked(lib, "histogram", threads=n, threadgroup=64,
                         args=[values, torch.zeros(16, dtype=torch.int32), uint32(n)])


def test_weak_compare_exchange_fails_spuriously_and_a_retry_loop_counts_every_lane(lib):
    """A GPU's weak compare-exchange may fail with the value equal to the expected one; x86's never does,
    so the emulator fails some on purpose (docs/emulator.md). Lanes that try once on a cell nobody else
    touches: some fail, each failure leaving the cell as it was and reporting the value it found (0);
    the retry loop on a shared counter still counts every lane once."""
    n = 256

    def check(args):
        cells, tries, counter = args[0], args[1].view(n, 2), args[2]
        ok = tries[:, 0] == 1
        assert 0 < int(ok.sum()) < n, int(ok.sum())
        assert torch.equal(cells[ok], torch.arange(1, n + 1, dtype=torch.int32)[ok])
        assert torch.equal(cells[~ok], torch.zeros(int((~ok).sum()), dtype=torch.int32))
        assert torch.equal(tries[:, 1], torch.zeros(n, dtype=torch.int32))
        assert int(counter[0]) == n

    def make_args():
        return [torch.zeros(n, dtype=torch.int32), torch.full((2 * n,), 7, dtype=torch.int32),
                torch.zeros(1, dtype=torch.int32)]  # fmt: skip

    launch_all_orders(lib, "cas_weak", threads=n, threadgroup=64, check=check, make_args=make_args)


@pytest.mark.skipif(os.environ.get("BNB_MPS_EMU_THREADS") == "1", reason="one emulator worker: nothing runs beside")
def test_a_threadgroup_may_stall_after_a_device_atomic_while_the_others_run(lib):
    """A GPU may deschedule a threadgroup right after it published a count; the emulator stalls the
    threadgroup after a device atomic while the others run (docs/emulator.md). A hand-over that does not
    order the threadgroup's writes before its count then shows the last threadgroup elements another
    one had not written yet; with a device-memory barrier before the count it sees every one."""
    groups = 8
    want = torch.arange(1, groups * 64 + 1, dtype=torch.int32)

    def run(ordered: int, order: str) -> torch.Tensor:
        args = [torch.zeros(groups * 64, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                torch.full((groups * 64,), -1, dtype=torch.int32), uint32(ordered)]  # fmt: skip
        lib.launch("hand_over", grid=groups, threadgroup=64, args=args, order=order, seed=7)
        assert int(args[1][0]) == groups
        return args[2]

    for order in ORDERS:
        assert torch.equal(run(1, order), want), order
    unordered = run(0, "forward")  # (thread 0 runs first: it counts before the others write)
    assert not torch.equal(unordered, want)
    assert int((unordered == 0).sum()) > 0  # elements not written when the last threadgroup read them


@pytest.mark.parametrize("mode", ["groups", "threads"])
def test_position_attributes(lib, mode):
    tg = (4, 2, 2)
    if mode == "groups":
        grid_groups, total = (2, 2, 1), (8, 4, 2)
        geometry = dict(grid=grid_groups, threadgroup=tg)
    else:
        total = (5, 3, 3)
        geometry = dict(threads=total, threadgroup=tg)
    count = total[0] * total[1] * total[2]

    def check(args):
        o = args[0].view(total[2], total[1], total[0], 8).numpy()
        for z in range(total[2]):
            for y in range(total[1]):
                for x in range(total[0]):
                    g = (x // tg[0], y // tg[1], z // tg[2])
                    t = (x % tg[0], y % tg[1], z % tg[2])
                    size = [min(tg[k], total[k] - g[k] * tg[k]) for k in range(3)]
                    idx = t[0] + size[0] * (t[1] + size[1] * t[2])
                    assert o[z, y, x].tolist() == [x + 1, y, z, g[0] + 100 * g[1] + 10000 * g[2],
                                                   t[0] + 100 * t[1] + 10000 * t[2],
                                                   size[0] + 100 * size[1] + 10000 * size[2], idx,
                                                   total[0] + 100 * total[1] + 10000 * total[2]]

    launch_all_orders(lib, "positions", check=check, make_args=lambda: [torch.zeros(count * 8, dtype=torch.int32)],
                      **geometry)


def test_constant_struct_and_views(lib):
    base = torch.arange(20, dtype=torch.float32)
    view = base[4:14]  # binds at its storage offset
    params = struct.pack("<If", 8, 2.5)
    lib.launch("with_params", grid=1, threadgroup=16, args=[view, params])
    ref = torch.arange(20, dtype=torch.float32)
    ref[4:12] *= 2.5
    assert torch.equal(base, ref)


def test_template_instantiations(lib):
    x = torch.linspace(-1, 1, 32)
    lib.launch("scale_by_f32", grid=1, threadgroup=32, args=[x, float32(3.0)])
    assert torch.equal(x, torch.linspace(-1, 1, 32) * 3)
    h = torch.linspace(-1, 1, 32).half()
    lib.launch("scale_by_f16", grid=1, threadgroup=32, args=[h, float32(0.5)])
    assert torch.equal(h, (torch.linspace(-1, 1, 32).half().float() * 0.5).half())


def test_one_element_tensor_as_scalar(lib):
    x = torch.ones(32)
    lib.launch("scale_by_f32", grid=1, threadgroup=32, args=[x, torch.tensor([4.0])])
    assert torch.equal(x, torch.full((32,), 4.0))


def test_empty_grid_is_a_noop(lib):
    x = torch.ones(4)
    lib.launch("scale_by_f32", grid=0, threadgroup=32, args=[x, float32(3.0)])
    assert torch.equal(x, torch.ones(4))


def test_simdgroup_matrix_fused_multiply_add_and_thread_elements(lib):
    # A fused multiply-add rounds a * b + c once: with a = b = 1 + 2^-12 and c = -1, a * b = 1 + 2^-11
    # + 2^-24 exactly, and fma gives 2^-11 + 2^-24, where a rounded product (a tie, to even: 1 + 2^-11)
    # would give 2^-11. Element (0, 0) takes that path at k = 0 and then adds seven exact zeros.
    g = torch.Generator().manual_seed(3)
    a = torch.randint(-4, 4, (8, 8), generator=g).float()
    b = torch.randint(-4, 4, (8, 8), generator=g).float()
    c = torch.randint(-4, 4, (8, 8), generator=g).float()
    a[0] = 0
    b[:, 0] = 0
    a[0, 0] = b[0, 0] = 1 + 2.0**-12
    c[0, 0] = -1
    a64, b64, c64 = a.double(), b.double(), c.double()

    def check(args):
        fused, sums, prod = (x.view(8, 8).double() for x in args[3:])
        want = a64 @ b64 + c64  # small integers elsewhere: exact in every order
        assert fused[0, 0].item() == 2.0**-11 + 2.0**-24  # one rounding (exact here), not two
        assert torch.equal(fused, want)
        want_sums = a64 @ b64 + 2 * c64
        want_sums[0, 0] = float(torch.tensor(1 + 2.0**-11 + 2.0**-24).float()) - 2  # the product rounded once
        assert torch.equal(sums, want_sums)
        assert torch.equal(prod, (c64.T + 1) @ b64)

    def make_args():
        return [a.flatten().clone(), b.flatten().clone(), c.flatten().clone(), torch.zeros(64), torch.zeros(64),
                torch.zeros(64)]  # fmt: skip

    launch_all_orders(lib, "sg_fma_elements", grid=1, threadgroup=32, check=check, make_args=make_args)
    emulator.run_checked(lib, "sg_fma_elements", grid=1, threadgroup=32, args=make_args())
