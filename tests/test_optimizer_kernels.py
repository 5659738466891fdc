"""The optimizer kernels under the emulator, against tests/reference_optim.py (docs/semantics.md section 5).

Every call goes through the op layer's launchers (bnb_mps.ops.optim) on an executor that forwards
to the emulator with a chosen lane order, race checking and poison byte, so each case checks the
op layer's scalars, flags and geometry together with the kernel's maths.

The emulator computes in float32 without fused multiply-adds, as the reference does, and in its
default "apple" float mode flushes float32 subnormals as Apple GPUs do, which the reference models
(docs/semantics.md section 7; tests/reference_optim.py's flush mode, its default). So here the results
are not only within docs/semantics.md 5.3's one-step tolerances (asserted by `compare_*`) but identical
to the reference; the update-norm sum is the one exception (float32 summation order), which moves
p by at most a couple of ulps. The Apple float tests run the emulator in both float modes, each
against the reference of that mode.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import optim_inputs as oi
import reference_optim as R
from kernel_harness import EmulatedExecutor
from bnb_mps.ops import OPS, call
from bnb_mps.ops import optim as optim_ops
from bnb_mps.testing import AllocationCounter, RecordingExecutor

emulator = pytest.importorskip("bnb_mps.emulator")

ORDERS = ("forward", "reverse", "random")
POISONS = (0x00, 0xFF)
OP8, OP32 = "optimizer_update_8bit_blockwise", "optimizer_update_32bit"


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """torch's intra-op threads spinning next to the emulator's slow a 2-core machine down."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run(name: str, executor, args: list) -> list:
    """Runs the op on a copy of `args` and returns the copy (the in-place results)."""
    mine = oi.clone(args)
    assert call(OPS[name], tuple(mine), {}, executor) is None
    return mine


def check8(executor, args, exact=True, flush=None) -> oi.Deviation:
    want = R.optimizer_8bit(*oi.clone(args), flush=flush)
    got = run(OP8, executor, args)
    dev = oi.compare_8bit(got, want)
    if exact:
        assert dev.exact, dev
    return dev


def check32(executor, args, exact=True, flush=None) -> oi.Deviation:
    want = R.optimizer_32bit(*oi.clone(args), flush=flush)
    got = run(OP32, executor, args)
    dev = oi.compare_32bit(got, want)
    if exact:
        if args[6] > 0:  # clipping: the update-norm sum's order moves p slightly, nothing else
            assert dev.state_ulps == 0 and dev.p_ulps <= 2, dev
        else:
            assert dev.exact, dev
    return dev


# -- one step, every optimizer name x dtype ---------------------------------------------------------

N8 = 3 * 256 + 77  # three whole blocks and a tail
N32 = 2 * 2048 + 77


@pytest.mark.parametrize("dtype", oi.DTYPES, ids=str)
@pytest.mark.parametrize("name", oi.NAMES_8BIT)
def test_8bit_one_step(library, name, dtype):
    ex = EmulatedExecutor(library)
    check8(ex, oi.args_8bit(name, N8, dtype, seed=1))
    assert ex.launches == [f"bnb_optimizer_8bit_{name}_{optim_ops.DTYPE_NAMES[dtype]}"]


@pytest.mark.parametrize("dtype", oi.DTYPES, ids=str)
@pytest.mark.parametrize("name", oi.NAMES_32BIT)
def test_32bit_one_step(library, name, dtype):
    ex = EmulatedExecutor(library)
    check32(ex, oi.args_32bit(name, N32, dtype, seed=2))
    kernel = f"{optim_ops.KERNEL_OPTIMIZER[name]}_{optim_ops.DTYPE_NAMES[dtype]}"
    assert ex.launches == [f"bnb_optimizer_32bit_{kernel}"]


@pytest.mark.parametrize("name", oi.NAMES_32BIT)
def test_32bit_update_norm_clipping(library, name):
    """max_unorm > 0: the norm pass, then the update with lr * scale; unorm_vec[0] = sum u^2."""
    dtype = oi.DTYPES[oi.NAMES_32BIT.index(name) % 3]
    ex = EmulatedExecutor(library, order="random", seed=3)
    for max_unorm, seed in ((0.002, 4), (1e3, 5)):  # clipped, and not clipped
        args = oi.args_32bit(name, N32, dtype, seed=seed, max_unorm=max_unorm)
        want = R.optimizer_32bit(*oi.clone(args))
        check32(ex, args)
        if max_unorm < 1:  # the reference did clip: the step is smaller than the unclipped one
            plain = R.optimizer_32bit(*oi.clone(args[:6] + [0.0] + args[7:]))
            moved = (want.p.float() - args[2].float()).abs().sum()
            assert moved < (plain.p.float() - args[2].float()).abs().sum() or name == "lion"
    kernel = f"{optim_ops.KERNEL_OPTIMIZER[name]}_{optim_ops.DTYPE_NAMES[dtype]}"
    assert ex.launches == [f"bnb_optimizer_32bit_unorm_{kernel}", f"bnb_optimizer_32bit_{kernel}"] * 2


def test_momentum_first_step(library):
    """step == 1: m = g' (the old state is ignored), in both ops."""
    ex = EmulatedExecutor(library)
    for dtype in oi.DTYPES:
        args8 = oi.args_8bit("momentum", N8, dtype, seed=6, step=1)
        check8(ex, args8)
        args32 = oi.args_32bit("momentum", N32, dtype, seed=7, step=1, weight_decay=0.0, gnorm_scale=1.0)
        got = run(OP32, ex, args32)
        assert torch.equal(got[3], args32[1].float())  # m = g exactly


# -- lane orders, race checking, poison bytes ---------------------------------------------------------


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("order", ORDERS)
def test_all_orders(library, order, poison):
    """Every kernel variant's output does not depend on lane order or uninitialised threadgroup
    memory, has no threadgroup race, and equals the reference."""
    ex = EmulatedExecutor(library, order=order, race_check=True, poison=poison, seed=9,
                          coherence_check=order == "random" and poison == 0x00)
    for i, name in enumerate(oi.NAMES_8BIT):
        check8(ex, oi.args_8bit(name, 2 * 256 + 31, oi.DTYPES[i % 3], seed=10 + i, skip_zeros=True))
    for i, name in enumerate(oi.NAMES_32BIT):
        check32(ex, oi.args_32bit(name, 2048 + 33, oi.DTYPES[i % 3], seed=20 + i,
                                  max_unorm=0.002 if name in ("lamb", "lars") else 0.0))  # fmt: skip


# -- edge cases ----------------------------------------------------------------------------------------


def specials(n, dtype, seed):
    """A gradient with NaN (both signs), +-inf and zeros in the first block."""
    r = oi.gen(seed)
    g = torch.randn(n, generator=r) * 0.01
    nan = torch.tensor(float("nan"))
    g[3], g[4], g[5], g[6], g[7] = nan, -nan, float("inf"), -float("inf"), 0.0
    return g.to(dtype)


@pytest.mark.parametrize("name", oi.NAMES_8BIT)
def test_8bit_non_finite_gradients(library, name):
    """2-state: where g is NaN or +-inf the element's states become 0 and p stays; 1-state: the
    values propagate (docs/semantics.md 5.1); the rest of the block is unaffected either way."""
    ex = EmulatedExecutor(library, order="reverse")
    for dtype in oi.DTYPES:
        args = oi.args_8bit(name, N8, dtype, seed=30, g=specials(N8, dtype, 31))
        check8(ex, args)
        got = run(OP8, ex, args)
        if name in ("adam", "ademamix"):
            assert torch.equal(got[2][3:7], args[2][3:7])  # p unchanged
            # m = +0.0 in a block with a non-zero absmax: code 127 (+0.0); v = 0: code 0
            assert got[3].reshape(-1)[3:7].tolist() == [127] * 4
            assert got[4][3:7].tolist() == [0] * 4
        else:
            assert torch.isnan(got[2][3:5].float()).all() or name == "lion"
        assert not torch.isnan(got[14]).any()  # NaN is left out of the block maxima (inf is not)


def test_32bit_non_finite_gradients(library):
    """No reset in the 32-bit op: NaN and inf flow into states and p as the formulas say."""
    ex = EmulatedExecutor(library)
    for name in oi.NAMES_32BIT:
        args = oi.args_32bit(name, N32, torch.float32, seed=32, g=specials(N32, torch.float32, 33))
        check32(ex, args)


@pytest.mark.parametrize("name", oi.NAMES_8BIT)
def test_8bit_all_zero_blocks(library, name):
    """A block whose new states are all zero: absmax 0, no 0 * inf; +0.0 in state1 is stored as
    code 255 (docs/semantics.md 5.1 step 4 read literally, as CUDA does), -0.0 as 0; state2 codes are 0."""
    ex = EmulatedExecutor(library, order="random", seed=2)
    n = 3 * 256 + 5
    args = oi.args_8bit(name, n, torch.float32, seed=34, weight_decay=0.0)
    g = args[1]
    g[256:512] = 0.0
    args[3].reshape(-1)[256:512] = 0  # state codes 0 with absmax 0: old states are exactly -0.0
    args[14].reshape(-1)[1] = 0.0
    if name == "ademamix":
        args[3][1, 256:512] = 0
        args[14][1, 1] = 0.0
    if args[4] is not None:
        args[4][256:512] = 0
        args[15][1] = 0.0
    check8(ex, args)
    got = run(OP8, ex, args)
    assert got[14].reshape(-1)[1] == 0
    if name == "momentum":  # m = beta1 * (-0.0) + 0.0 = +0.0 ... except at step 1
        assert got[3][256:512].tolist() == [255] * 256
    if name == "adam":
        assert got[3][256:512].tolist() == [255] * 256 and got[4][256:512].tolist() == [0] * 256
    assert torch.equal(got[2][256:512], args[2][256:512])  # zero gradient, zero state: p stays


def test_8bit_tiny_negative_state_keeps_its_sign(library):
    """A small negative m that rounds to code 127 (+0.0) is stored as 126 (the sign fix)."""
    ex = EmulatedExecutor(library)
    n = 256
    g = torch.full((n,), 1e-3)
    g[10] = -1e-10  # step 1: m_new = g = -1e-10, scaled by 1 / 1e-3: -1e-7, nearer 0.0 than -5.5e-7
    g[11] = -1e-9  # scaled -1e-6: nearest code is 126 anyway
    args = oi.args_8bit("momentum", n, torch.float32, seed=35, g=g, step=1, weight_decay=0.0, gnorm_scale=1.0)
    got = run(OP8, ex, args)
    check8(ex, args)
    assert got[3][10] == 126 and got[3][11] == 126 and got[3][12] != 126


@pytest.mark.parametrize("n", [1, 7, 8, 9, 255, 256, 257, 511, 8 * 256 + 3])
def test_tails(library, n):
    """Tensors shorter than a block, and tails shorter than 256 (8-bit) / 2048 (32-bit)."""
    ex = EmulatedExecutor(library, order="random", seed=n)
    for i, name in enumerate(oi.NAMES_8BIT):
        check8(ex, oi.args_8bit(name, n, oi.DTYPES[(i + n) % 3], seed=n + i))
    for i, name in enumerate(("adam", "ademamix", "lars", "lion")):
        check32(ex, oi.args_32bit(name, n, oi.DTYPES[(i + n) % 3], seed=n + i,
                                  max_unorm=0.01 if name == "lars" else 0.0))  # fmt: skip


@pytest.mark.parametrize("dtype", oi.DTYPES, ids=str)
def test_skip_zeros(library, dtype):
    """skip_zeros: 1-state optimizers (both ops) and 32-bit adam leave elements with g == 0
    untouched (8-bit: their old state still enters the block maximum and is re-quantized);
    2-state 8-bit optimizers and AdEMAMix ignore it."""
    ex = EmulatedExecutor(library, order="reverse")
    r = oi.gen(36)
    g = torch.randn(N8, generator=r) * 0.01
    g[::3] = 0.0
    g = g.to(dtype)
    for name in oi.NAMES_8BIT:
        args = oi.args_8bit(name, N8, dtype, seed=37, g=g.clone(), skip_zeros=True)
        got = run(OP8, ex, args)
        check8(ex, args)
        if name not in ("adam", "ademamix"):
            assert torch.equal(got[2][::3], args[2][::3]), name
    g32 = torch.randn(N32, generator=r) * 0.01
    g32[::3] = 0.0
    g32 = g32.to(dtype)
    for name in oi.NAMES_32BIT:
        args = oi.args_32bit(name, N32, dtype, seed=38, g=g32.clone(), skip_zeros=True)
        got = run(OP32, ex, args)
        check32(ex, args)
        if name != "ademamix":
            assert torch.equal(got[2][::3], args[2][::3]) and torch.equal(got[3][::3], args[3][::3]), name


def test_large_values_and_overflow(library):
    """Gradients whose squares overflow float32: v = inf, absmax inf, codes by docs/semantics.md's arithmetic."""
    ex = EmulatedExecutor(library)
    g = torch.randn(N8, generator=oi.gen(39)) * 0.01
    g[:20] = 3e19
    for name in oi.NAMES_8BIT:
        check8(ex, oi.args_8bit(name, N8, torch.float32, seed=40, g=g.clone()))


def test_grid_cap_loops(library, monkeypatch):
    """With the grid capped below the tensor's size, threadgroups loop over their share."""
    monkeypatch.setattr(optim_ops, "MAX_GROUPS", 2)
    ex = EmulatedExecutor(library, order="random", race_check=True, seed=4)
    n = 40 * 256 + 9  # 41 blocks: 16 simdgroups, up to 3 blocks each
    for name in ("adam", "ademamix", "lion"):
        check8(ex, oi.args_8bit(name, n, torch.bfloat16, seed=41))
    for name in ("adam", "lamb", "rmsprop"):
        check32(ex, oi.args_32bit(name, 5 * 2048 + 1, torch.float16, seed=42,
                                  max_unorm=0.002 if name == "lamb" else 0.0))  # fmt: skip


def test_ademamix_absmax_rows(library):
    """AdEMAMix's m2 scales are absmax1[1, b] (row 1 of a [2, nblocks] tensor), also when n is not a
    multiple of 256, where CUDA's (n + i) / 256 would index elsewhere; and with a wider row."""
    ex = EmulatedExecutor(library)
    n = 2 * 256 + 100
    args = oi.args_8bit("ademamix", n, torch.float32, seed=43)
    check8(ex, args)
    wide = oi.clone(args)
    wide[14] = torch.cat([args[14], torch.full((2, 2), 7.0)], dim=1)  # [2, nblocks + 2]
    got = run(OP8, ex, wide)
    plain = run(OP8, ex, args)
    assert torch.equal(got[3], plain[3]) and torch.equal(got[14][:, :3], plain[14])
    assert torch.equal(got[14][:, 3:], torch.full((2, 2), 7.0))  # untouched beyond the blocks


# -- vector and scalar paths, views --------------------------------------------------------------------


def offset_view(t: torch.Tensor, k: int) -> torch.Tensor:
    """The same values in a view `k` elements into its storage."""
    base = torch.zeros(t.numel() + k, dtype=t.dtype, device=t.device)
    v = base[k:].view(t.shape)
    v.copy_(t)
    return v


@pytest.mark.parametrize("k", [1, 2, 3])
def test_misaligned_views(library, k):
    """Views that do not start on a vector boundary take the scalar path (flags) with the same
    results; the in-place updates land in the caller's views."""
    ex = EmulatedExecutor(library, order="random", seed=k)
    for i, name in enumerate(oi.NAMES_8BIT):
        args = oi.args_8bit(name, N8, oi.DTYPES[i % 3], seed=50 + i)
        moved = [offset_view(a, k) if isinstance(a, torch.Tensor) and a.dim() else a for a in args]
        want = R.optimizer_8bit(*oi.clone(args))
        call(OPS[OP8], tuple(moved), {}, ex)
        assert oi.compare_8bit(moved, want).exact
    for i, name in enumerate(oi.NAMES_32BIT):
        args = oi.args_32bit(name, N32, oi.DTYPES[i % 3], seed=60 + i, max_unorm=0.002 if i % 2 else 0.0)
        moved = [offset_view(a, k) if isinstance(a, torch.Tensor) and a.dim() else a for a in args]
        want = R.optimizer_32bit(*oi.clone(args))
        call(OPS[OP32], tuple(moved), {}, ex)
        dev = oi.compare_32bit(moved, want)
        assert dev.state_ulps == 0


def meta(args: list) -> list:
    return [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]


def _flags(args: list, name: str) -> int:
    rec = RecordingExecutor()
    call(OPS[name], tuple(args), {}, rec)
    kernel, grid, tg, bound = rec.launches[-1]
    return bound[10].value if name == OP8 else bound[7].value


def test_vector_flags_follow_alignment():
    F = optim_ops
    args = meta(oi.args_8bit("ademamix", 1002, torch.float16, seed=0, step=1, skip_zeros=True))
    f = _flags(args, OP8)
    assert f == F.VEC_G | F.VEC_P | F.VEC_S1 | F.VEC_S2 | F.FIRST_STEP | F.SKIP_ZEROS  # m2 at byte 1002: no
    args = meta(oi.args_8bit("ademamix", 1024, torch.float16, seed=0))
    assert _flags(args, OP8) == F.VEC_G | F.VEC_P | F.VEC_S1 | F.VEC_S2 | F.VEC_M2
    args[2] = offset_view(args[2], 2)  # fp16 p two elements in: 4 bytes, not 8
    args[3] = offset_view(args[3], 4)  # codes four bytes in: still aligned for uchar4
    assert _flags(args, OP8) == F.VEC_G | F.VEC_S1 | F.VEC_S2 | F.VEC_M2
    args[3] = offset_view(args[3], 2)  # m2 at byte 2 + 1024: both halves misaligned
    assert _flags(args, OP8) == F.VEC_G | F.VEC_S2
    args = meta(oi.args_32bit("ademamix", 1002, torch.float32, seed=0))
    assert _flags(args, OP32) == F.VEC_G | F.VEC_P | F.VEC_S1 | F.VEC_S2  # m2 at float 1002: no
    args = meta(oi.args_32bit("lion", 1000, torch.float32, seed=0, max_unorm=1.0))
    args[1] = offset_view(args[1], 4)
    assert _flags(args, OP32) == F.VEC_G | F.VEC_P | F.VEC_S1 | F.CLIP


def test_non_contiguous_tensors_are_updated_in_place(library):
    ex = EmulatedExecutor(library)
    args = oi.args_8bit("lion", 64 * 40, torch.float32, seed=70)
    want = run(OP8, ex, args)
    strided = oi.clone(args)
    strided[2] = args[2].reshape(40, 64).t().contiguous().t()  # same values, column-major storage
    strided[1] = args[1].reshape(40, 64).t().contiguous().t()
    call(OPS[OP8], tuple(strided), {}, ex)
    assert torch.equal(strided[2].reshape(-1), want[2]) and torch.equal(strided[3], want[3])
    args = oi.args_32bit("adam", 64 * 40, torch.bfloat16, seed=71)
    want = run(OP32, ex, args)
    strided = oi.clone(args)
    strided[3] = args[3].reshape(40, 64).t().contiguous().t()
    call(OPS[OP32], tuple(strided), {}, ex)
    assert torch.equal(strided[3].reshape(-1), want[3]) and torch.equal(strided[2], want[2])


# -- op-layer properties ----------------------------------------------------------------------------------


def test_no_temporaries():
    """Nothing proportional to the parameter is allocated: nothing at all for the 8-bit op and
    the unclipped 32-bit op, one float per threadgroup (at most 4 KiB) for the clipping partials."""
    n = 1 << 22
    meta = lambda args: tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)  # noqa: E731
    for name in oi.NAMES_8BIT:
        args = meta(oi.args_8bit(name, 300, torch.bfloat16))
        args = list(args)
        args[1], args[2] = torch.empty(n, dtype=torch.bfloat16, device="meta"), torch.empty(n, dtype=torch.bfloat16,
                                                                                            device="meta")
        mix = 2 if name == "ademamix" else 1
        nb = -(-n // 256)
        args[3] = torch.empty(*((2, n) if mix == 2 else (n,)), dtype=torch.uint8, device="meta")
        args[14] = torch.empty(*((2, nb) if mix == 2 else (nb,)), device="meta")
        if args[4] is not None:
            args[4], args[15] = torch.empty(n, dtype=torch.uint8, device="meta"), torch.empty(nb, device="meta")
        with AllocationCounter() as alloc:
            call(OPS[OP8], tuple(args), {}, RecordingExecutor())
        assert alloc.bytes == 0, alloc.allocations
    for name in oi.NAMES_32BIT:
        for max_unorm in (0.0, 1.0):
            args = list(meta(oi.args_32bit(name, 300, torch.float16, max_unorm=max_unorm)))
            args[1], args[2] = (torch.empty(n, dtype=torch.float16, device="meta") for _ in range(2))
            args[3] = torch.empty(*((2, n) if name == "ademamix" else (n,)), device="meta")
            if args[4] is not None:
                args[4] = torch.empty(n, device="meta")
            with AllocationCounter() as alloc:
                call(OPS[OP32], tuple(args), {}, RecordingExecutor())
            want = 4 * optim_ops.groups_32bit(n) if max_unorm > 0 else 0
            assert alloc.bytes == want <= 4096, alloc.allocations


def test_geometry_is_capped():
    assert optim_ops.groups_8bit(1) == 1 and optim_ops.groups_8bit(8 * 256) == 1
    assert optim_ops.groups_8bit(8 * 256 + 1) == 2
    assert optim_ops.groups_8bit(10**9) == optim_ops.MAX_GROUPS
    assert optim_ops.groups_32bit(2048) == 1 and optim_ops.groups_32bit(2049) == 2
    assert optim_ops.groups_32bit(10**9) == optim_ops.MAX_GROUPS


def test_empty_tensors_launch_nothing():
    class NoLaunch:
        name = "emulated"

        def launch(self, kernel, **_):
            raise AssertionError(f"launched {kernel} for an empty tensor")

    for name in oi.NAMES_8BIT:
        call(OPS[OP8], tuple(oi.args_8bit(name, 0, torch.float32)), {}, NoLaunch())
    for name in oi.NAMES_32BIT:
        call(OPS[OP32], tuple(oi.args_32bit(name, 0, torch.float32)), {}, NoLaunch())


def test_scalars_are_float32_as_spec_computes_them():
    """bc1, bc2 and the decay factor: each operation rounded to float32 (checked against numpy)."""
    for beta1, beta2, lr, wd, step in ((0.9, 0.999, 1e-3, 0.01, 1), (0.95, 0.98, 3e-4, 0.1, 1000),
                                       (0.0, 0.0, 1.0, 0.0, 7), (0.99, 0.9999, 2e-5, 1e-4, 123456)):  # fmt: skip
        got = [s.value for s in optim_ops._hyper(beta1, beta2, 0.5, 5.0, 1e-8, lr, wd, 1.0, step)]
        b1, b2, lr32, wd32 = np.float32(beta1), np.float32(beta2), np.float32(lr), np.float32(wd)
        bc1 = np.float32(1) - np.float32(np.float64(b1) ** step)
        bc2 = np.sqrt(np.float32(1) - np.float32(np.float64(b2) ** step))
        decay = np.float32(1) - lr32 * wd32
        assert got[6] == bc1 and got[7] == bc2 and got[8] == decay
        assert got[0] == b1 and got[5] == lr32 and got[9] == wd32


# -- errors ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_8bit_refuses_lamb_and_lars(name):
    args = oi.args_8bit("adam" if name == "lamb" else "momentum", 300, torch.float32)
    args[0] = name
    with pytest.raises(ValueError, match=rf"optimizer_update_8bit_blockwise: optimizer '{name}'.*32"):
        call(OPS[OP8], tuple(args), {}, RecordingExecutor())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 1e39])
@pytest.mark.parametrize("which", ["lr", "eps", "beta1", "weight_decay", "gnorm_scale"])
def test_non_finite_hyperparameters_are_not_the_kernels(which, bad):
    """The kernels take hyperparameters that float32 holds as finite values; bitsandbytes computes with
    the others (to infinities and NaNs), so such a call is served by bitsandbytes' own implementation
    (tests/test_not_covered.py) and never reaches a kernel: the checks say so before any launch."""
    from bnb_mps.ops.validation import NotCovered

    pos8 = dict(lr=11, eps=9, beta1=5, weight_decay=16, gnorm_scale=17)[which]
    pos32 = dict(lr=15, eps=12, beta1=8, weight_decay=13, gnorm_scale=16)[which]
    args = oi.args_8bit("adam", 300, torch.float32)
    args[pos8] = bad
    with pytest.raises(NotCovered, match=rf"^{which} .* finite as a float32"):
        OPS[OP8].check(*args)
    args = oi.args_32bit("lamb", 300, torch.float32, max_unorm=1.0)
    args[pos32] = bad
    with pytest.raises(NotCovered, match=rf"^{which} .* finite as a float32"):
        OPS[OP32].check(*args)
    recorder = RecordingExecutor()
    with pytest.raises(NotCovered):
        OPS[OP32].kernel(recorder, *args)  # (the per-call scalars are checked before any launch too)
    assert recorder.launches == []


def test_ademamix_absmax_shape_is_checked():
    args = oi.args_8bit("ademamix", 600, torch.float32)
    args[14] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"ademamix's absmax1 must have shape \(2, 3\)"):
        call(OPS[OP8], tuple(args), {}, RecordingExecutor())


# -- Apple float semantics: float32 subnormals (docs/semantics.md section 7) -------------------------------

TINY = 2.0**-126  # the smallest normal float32


def subnormal_mask(g: torch.Tensor) -> torch.Tensor:
    x = g.float()
    return (x != 0) & (x.abs() < TINY)


# The inputs that made test_random_gradients fail at random before the reference modelled the flush
# (p tens to hundreds of ulps from an IEEE reference): a float32 subnormal gradient, skip_zeros, a
# one-state optimizer. In its minimal form, one element.
SUBNORMAL_GRADIENTS = [([2.0**-133], 2), ([-5e-39], 1), ([1.1e-38], 50),
                       ([1e-3, -2e-39, 0.0, 7e-40, -1e-2, 1.17e-38], 3)]  # fmt: skip


@pytest.mark.parametrize("grads,step", SUBNORMAL_GRADIENTS, ids=str)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_subnormal_gradient_with_skip_zeros(library, dtype, grads, step):
    """A float32 / bfloat16 subnormal gradient counts as 0, also for skip_zeros: the one-state
    optimizers (and 32-bit Adam) leave the element alone, p and a 32-bit state keeping their bits,
    in both ops. Under IEEE arithmetic the element is updated: each mode against the reference of
    that mode."""
    g = torch.tensor(grads).to(dtype)
    sub = subnormal_mask(g)
    assert sub.any()
    n = g.numel()
    apple = EmulatedExecutor(library, float_mode="apple", order="random", seed=n)
    ieee = EmulatedExecutor(library, float_mode="ieee", order="random", seed=n)
    for name in ("momentum", "rmsprop", "lion"):
        args8 = oi.args_8bit(name, n, dtype, seed=n, g=g, step=step, skip_zeros=True)
        got = run(OP8, apple, args8)
        check8(apple, args8)
        assert torch.equal(got[2][sub], args8[2][sub]), "p moved where the gradient is a subnormal"
        check8(ieee, args8, flush=False)
        updated = run(OP8, ieee, args8)  # IEEE updates the element: its p, codes or block scale differ
        assert not all(torch.equal(updated[i], got[i]) for i in (2, 3, 14)), name
    for name in ("momentum", "adam", "adagrad"):
        args32 = oi.args_32bit(name, n, dtype, seed=n, g=g, step=step, skip_zeros=True)
        got = run(OP32, apple, args32)
        check32(apple, args32)
        for i in (2, 3) if name != "adam" else (2, 3, 4):
            assert torch.equal(got[i][sub], args32[i][sub]), f"argument {i} moved where the gradient is a subnormal"
        check32(ieee, args32, flush=False)
        assert not torch.equal(run(OP32, ieee, args32)[3][sub], args32[3][sub])


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_subnormal_gradient_is_a_signed_zero(library, dtype):
    """Without skip_zeros, a subnormal gradient updates exactly as a zero of its sign would: every
    optimizer of both ops gives the same bits for the two gradients, and the reference's. Where the
    gradient is a subnormal, p and the states are 0, so that IEEE arithmetic, which keeps the
    gradient, gives other bits there (tiny states and steps): checked in the "ieee" mode."""
    n = 2 * 256 + 40
    r = oi.gen(80)
    g = torch.randn(n, generator=r) * 0.01
    g[::3] = (torch.rand(g[::3].shape, generator=r) - 0.5) * 2 * TINY  # subnormals of both signs
    g[1::9] = 0.0
    g = g.to(dtype)
    sub = subnormal_mask(g)
    assert sub.sum() > 100
    g0 = torch.where(sub, g * 0, g)  # the same signed zeros
    apple = EmulatedExecutor(library, float_mode="apple", order="reverse")
    ieee = EmulatedExecutor(library, float_mode="ieee")
    zero_code = {1: int((oi.CODE == 0).nonzero()), 4: 0}  # state1 (signed code), state2 (unsigned): 0.0

    def outputs(op, executor, args):
        got = run(op, executor, args)
        return [got[i] for i in ((2, 3, 4, 14, 15) if op == OP8 else (2, 3, 4, 5)) if got[i] is not None]

    for op, names in ((OP8, oi.NAMES_8BIT), (OP32, oi.NAMES_32BIT)):
        for name in names:
            if op == OP8:
                args = oi.args_8bit(name, n, dtype, seed=81, g=g, weight_decay=0.0)
                args[3].reshape(-1, n)[:, sub] = zero_code[1]
                if args[4] is not None:
                    args[4][sub] = zero_code[4]
            else:
                args = oi.args_32bit(name, n, dtype, seed=82, g=g, weight_decay=0.0,
                                     max_unorm=0.01 if name in ("lamb", "lars") else 0.0)  # fmt: skip
                for i in (3, 4):
                    if args[i] is not None:
                        args[i].reshape(-1, n)[:, sub] = 0.0
            args[2][sub] = 0.0
            zeroed = args[:1] + [g0] + args[2:]
            got = outputs(op, apple, args)
            assert all(torch.equal(a, b) for a, b in zip(got, outputs(op, apple, zeroed))), name
            (check8 if op == OP8 else check32)(apple, args)
            (check8 if op == OP8 else check32)(ieee, args, flush=False)
            assert not all(torch.equal(a, b) for a, b in zip(outputs(op, ieee, args), got)), name


def test_32bit_states_below_2_to_126_become_zero(library):
    """A state that decays below 2^-126 is stored as 0, where IEEE keeps a subnormal: zero
    gradient, states just above 2^-126, decay factors below 1 (the zero's sign follows IEEE's rules
    for the flushed operands: beta * m flushes to -0.0 for a negative m, and -0.0 + 0.0 is +0.0)."""
    n = 600
    r = oi.gen(83)
    tiny = lambda: (1 + torch.rand(n, generator=r) * 0.002) * TINY * torch.where(  # noqa: E731
        torch.rand(n, generator=r) < 0.5, -1.0, 1.0)
    apple, ieee = EmulatedExecutor(library, float_mode="apple"), EmulatedExecutor(library, float_mode="ieee")
    for name in ("adam", "ademamix", "momentum", "rmsprop", "lion"):
        args = oi.args_32bit(name, n, torch.float32, seed=84, g=torch.zeros(n), weight_decay=0.0, gnorm_scale=1.0)
        args[3] = torch.stack([tiny(), tiny()]) if name == "ademamix" else tiny()
        if name == "rmsprop":
            args[3] = args[3].abs()
        if args[4] is not None:
            args[4] = tiny().abs()
        got = run(OP32, apple, args)
        check32(apple, args)
        check32(ieee, args, flush=False)
        want_ieee = R.optimizer_32bit(*oi.clone(args), flush=False)
        for state, ieee_state in ((got[3], want_ieee.state1), (got[4], want_ieee.state2)):
            if state is None:
                continue
            decayed = (ieee_state != 0) & (ieee_state.abs() < TINY)
            assert decayed.sum() > n // 2, name  # the case is exercised: IEEE keeps subnormals here
            assert (state[decayed] == 0).all(), name


def test_8bit_state_block_below_2_to_126_is_an_all_zero_block(library):
    """A state block whose absmax lies just above 2^-126: its dequantized values and their decayed
    values lie below 2^-126 and count as zeros, so with a zero gradient the block's new absmax is 0
    and its codes those of signed zeros (255 for +0.0, 0 for -0.0: docs/semantics.md 5.1 step 4), where
    IEEE keeps a block of subnormals."""
    n = 2 * 256
    ex = EmulatedExecutor(library, float_mode="apple", order="random", seed=3)
    g = torch.randn(n, generator=oi.gen(85)) * 0.01
    g[256:] = 0.0
    for name in ("momentum", "lion", "adam"):
        args = oi.args_8bit(name, n, torch.float32, seed=86, g=g, weight_decay=0.0, gnorm_scale=1.0)
        # Block 1's states dequantize to code * 1.004 * 2^-126 (subnormals but for |code| > 0.996), and
        # the decay factors (0.9, 0.995) take the others below 2^-126 too.
        args[14][1] = TINY * 1.004
        if args[15] is not None:
            args[15][1] = TINY * 1.004
        got = run(OP8, ex, args)
        check8(ex, args)
        assert got[14][1] == 0, name
        assert R.optimizer_8bit(*oi.clone(args), flush=False).absmax1[1] > 0  # IEEE: subnormal states
        codes = got[3][256:]
        assert ((codes == 255) | (codes == 0)).all() and (codes == 255).any(), name
        assert torch.equal(got[2][256:], args[2][256:])  # p: zero gradient, zero state


# -- random values ---------------------------------------------------------------------------------------

_floats = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    grads=st.lists(_floats, min_size=1, max_size=300),
    name=st.sampled_from(oi.NAMES_8BIT),
    dtype=st.sampled_from(oi.DTYPES),
    scale=st.sampled_from((1.0, 1e-6, 1e3)),
    step=st.sampled_from((1, 2, 50)),
    skip=st.booleans(),
)
def test_random_gradients(library, grads, name, dtype, scale, step, skip):
    g = (torch.tensor(grads, dtype=torch.float32) * scale).to(dtype)
    n = g.numel()
    ex = EmulatedExecutor(library, order="random", seed=n)
    check8(ex, oi.args_8bit(name, n, dtype, seed=n, g=g, step=step, skip_zeros=skip))
    name32 = oi.NAMES_32BIT[(n + step) % len(oi.NAMES_32BIT)]
    check32(ex, oi.args_32bit(name32, n, dtype, seed=n, g=g, step=step, skip_zeros=skip))


def test_reference_sign_fix_and_zero_block_readings():
    """The reference's readings of docs/semantics.md 5.1 step 4, checked by hand on a few values."""
    c = oi.CODE.numpy()
    q, absmax, _ = R.requantize(np.array([0.0, -0.0, -1e-30, 1e-30] + [0.5] * 252, np.float32), c, signed=True)
    assert absmax[0] == np.float32(0.5)
    assert q[:4].tolist() == [127, 126, 126, 127]  # +0 -> code 127 (+0.0); -0 and tiny negatives -> 126
    q, absmax, _ = R.requantize(np.array([0.0, -0.0], np.float32), c, signed=True)
    assert absmax[0] == 0 and q.tolist() == [255, 0]  # all-zero block: index 0, then the sign fix
    assert math.copysign(1, c[0]) < 0 and c[127] == 0 and math.copysign(1, c[127]) > 0
