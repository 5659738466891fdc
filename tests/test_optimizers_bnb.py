"""bitsandbytes' optimizer classes on bnb_mps' kernels (under the emulator, on CPU tensors), against
torch.optim and plain Lion / AdEMAMix references, with bitsandbytes' own tolerance rules
(docs/semantics.md 5.3, from bitsandbytes' tests/test_optim.py).

Inside `use_emulated_kernels()` every `optimizer_update_*` call bitsandbytes makes runs the Metal
kernel; the recorder counts the launches (one per parameter tensor per step; two with update-norm
clipping). Our dequantized states are compared with reference_optim's dequantization (numpy), so
no other kernel runs.

The default run covers every optimizer at fp32 on 1024x32 and on 4097 elements, every optimizer
once in fp16 and bf16, and the larger shapes for AdamW8bit / Lion8bit; the full matrix carries
`@pytest.mark.slow` and runs with `pytest -m slow` (it is skipped otherwise).
"""

from __future__ import annotations

import contextlib
import io
import math

import bitsandbytes as bnb
import numpy as np
import pytest
import torch
from bitsandbytes.optim.ademamix import _ReferenceAdEMAMix

import optim_inputs as oi
import reference_optim as R
from bnb_mps.testing import use_emulated_kernels

pytest.importorskip("bnb_mps._emu")


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """The reference optimizers' tensor ops are small; with torch's intra-op threads spinning next
    to the emulator's, a 2-core machine runs this module several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class PlainLion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023) in plain torch, as lion_pytorch writes it."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.mul_(1 - lr * wd)
                update = exp_avg.clone().mul_(b1).add(p.grad, alpha=1 - b1).sign_()
                p.add_(update, alpha=-lr)
                exp_avg.mul_(b2).add_(p.grad, alpha=1 - b2)


ADAM_STATES = [("exp_avg", "state1", "qmap1", "absmax1"), ("exp_avg_sq", "state2", "qmap2", "absmax2")]
MIX_STATES = [("m1_m2", "state1", "qmap1", "absmax1"), ("nu", "state2", "qmap2", "absmax2")]

# name -> (reference optimizer, bitsandbytes optimizer, [(reference state, our state, qmap, absmax)])
EIGHT_BIT = {
    "adam8bit": (torch.optim.Adam, bnb.optim.Adam8bit, ADAM_STATES),
    "adamw8bit": (torch.optim.AdamW, bnb.optim.AdamW8bit, ADAM_STATES),
    "paged_adamw8bit": (torch.optim.AdamW, bnb.optim.PagedAdamW8bit, ADAM_STATES),
    "momentum8bit": (lambda p: torch.optim.SGD(p, 0.01, 0.9), lambda p: bnb.optim.SGD8bit(p, 0.01, 0.9),
                     [("momentum_buffer", "state1", "qmap1", "absmax1")]),
    "rmsprop8bit": (lambda p: torch.optim.RMSprop(p, 0.01, 0.9), lambda p: bnb.optim.RMSprop8bit(p, 0.01, 0.9),
                    [("square_avg", "state1", "qmap1", "absmax1")]),
    "adagrad8bit": (lambda p: torch.optim.Adagrad(p, 0.01), lambda p: bnb.optim.Adagrad8bit(p, 0.01),
                    [("sum", "state1", "qmap1", "absmax1")]),
    "lion8bit": (PlainLion, bnb.optim.Lion8bit, [("exp_avg", "state1", "qmap1", "absmax1")]),
    "paged_lion8bit": (PlainLion, bnb.optim.PagedLion8bit, [("exp_avg", "state1", "qmap1", "absmax1")]),
    "ademamix8bit": (_ReferenceAdEMAMix, bnb.optim.AdEMAMix8bit, MIX_STATES),
    "ademamix8bit_scheduled": (lambda p: _ReferenceAdEMAMix(p, t_alpha=100, t_beta3=100),
                               lambda p: bnb.optim.AdEMAMix8bit(p, t_alpha=100, t_beta3=100), MIX_STATES),
}  # fmt: skip

THIRTY_TWO_BIT = {
    "adam": (torch.optim.Adam, bnb.optim.Adam, [("exp_avg", "state1"), ("exp_avg_sq", "state2")]),
    "paged_adamw": (torch.optim.AdamW, bnb.optim.PagedAdamW, [("exp_avg", "state1"), ("exp_avg_sq", "state2")]),
    "momentum": (lambda p: torch.optim.SGD(p, 0.01, 0.9), lambda p: bnb.optim.SGD(p, 0.01, 0.9),
                 [("momentum_buffer", "state1")]),
    "lars": (lambda p: bnb.optim.PytorchLARS(p, 0.01, 0.9), lambda p: bnb.optim.LARS(p, 0.01, 0.9),
             [("momentum_buffer", "state1")]),
    "rmsprop": (lambda p: torch.optim.RMSprop(p, 0.01, 0.9), lambda p: bnb.optim.RMSprop(p, 0.01, 0.9),
                [("square_avg", "state1")]),
    "adagrad": (lambda p: torch.optim.Adagrad(p, 0.01), lambda p: bnb.optim.Adagrad(p, 0.01), [("sum", "state1")]),
    "lion": (PlainLion, bnb.optim.Lion, [("exp_avg", "state1")]),
    "ademamix": (_ReferenceAdEMAMix, bnb.optim.AdEMAMix, [("m1_m2", "state1"), ("nu", "state2")]),
}  # fmt: skip

KERNEL = {"adam": "adam", "adamw": "adam", "momentum": "momentum", "rmsprop": "rmsprop", "adagrad": "adagrad",
          "lion": "lion", "ademamix": "ademamix", "lars": "momentum"}  # fmt: skip
DT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def kernel_name(optim_name: str, dtype, bits: int) -> str:
    base = optim_name.removeprefix("paged_").removesuffix("_scheduled").removesuffix("8bit")
    return f"bnb_optimizer_{bits}bit_{KERNEL[base]}_{DT[dtype]}"


def dequantized(state: dict, key: str, qmap: str, absmax: str) -> torch.Tensor:
    """Our 8-bit state as float32 (reference_optim's dequantization; AdEMAMix's two rows apart)."""
    codes, q, a = state[key], state[qmap].numpy(), state[absmax]
    if a.dim() == 2:  # [2, nblocks]: one row per momentum
        rows = [R.dequantize(codes[i].reshape(-1).numpy(), a[i].numpy(), q) for i in range(2)]
        return torch.from_numpy(np.stack(rows)).reshape(codes.shape)
    return torch.from_numpy(R.dequantize(codes.reshape(-1).numpy(), a.numpy(), q)).reshape(codes.shape)


def not_close(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> torch.Tensor:
    """~torch.isclose(a, b, atol=atol, rtol=rtol) (NaN is never close), written out: torch's own
    takes a quarter of a second on 65 k equal elements on this CPU build."""
    return ~((a == b) | ((a - b).abs() <= atol + rtol * b.abs()))


def reload(optimizer_factory, optimizer, param):
    buf = io.BytesIO()
    torch.save(optimizer.state_dict(), buf)
    buf.seek(0)
    fresh = optimizer_factory([param])
    fresh.load_state_dict(torch.load(buf))
    return fresh


def kernels_on(device: str):
    """Our kernels serve the optimizer ops: the emulated tier for cpu tensors (a recorder counts
    the launches), the tier bnb_mps chose for mps tensors (None: launches are not seen there)."""
    return use_emulated_kernels() if device == "cpu" else contextlib.nullcontext()


def run_8bit(name: str, shape, gtype, steps: int = 50, seed: int = 0, device: str = "cpu") -> None:
    """bitsandbytes' test_optimizer8bit, on our kernels (the reference optimizer runs on the CPU)."""
    make_ref, make_bnb, states = EIGHT_BIT[name]
    torch.manual_seed(seed)
    p1 = torch.randn(*shape, dtype=gtype) * 0.1
    p2 = p1.clone().to(device)
    p1 = p1.float()
    ref_opt, bnb_opt = make_ref([p1]), make_bnb([p2])
    patol, prtol = (1e-4, 1e-2) if gtype == torch.bfloat16 else (1e-5, 1e-3)
    with kernels_on(device) as kernels:
        for i in range(steps):
            g = torch.randn(*shape, dtype=gtype) * 0.01
            p1.grad = g.clone().float()
            p2.grad = g.clone().to(device)
            ref_opt.step()
            bnb_opt.step()

            ours = [dequantized({k: v.cpu() for k, v in _tensors(bnb_opt.state[p2]).items()}, *s[1:]) for s in states]
            for (ref_key, *_), s in zip(states, ours):
                far = not_close(ref_opt.state[p1][ref_key], s, atol=3e-3, rtol=1e-3)
                assert far.sum() < 20, f"step {i}: {int(far.sum())} {ref_key} values differ"
            err = (p1 - p2.float().cpu()).abs()
            relerr = err / (p1.abs() + 1e-9)
            if gtype == torch.bfloat16:
                assert err.mean() <= 0.00017 and relerr.mean() <= 0.0016, (i, err.mean(), relerr.mean())
            else:
                assert err.mean() < 0.00006 and relerr.mean() < 0.0006, (i, err.mean(), relerr.mean())

            if i % 10 == 0 and i > 0:
                raw = {s[1]: bnb_opt.state[p2][s[1]].clone() for s in states}
                bnb_opt = reload(make_bnb, bnb_opt, p2)
                for key, value in raw.items():
                    assert torch.equal(bnb_opt.state[p2][key], value)
                torch.testing.assert_close(p1, p2.float().cpu(), atol=patol, rtol=prtol)

            # keep the parameters and states together, as bitsandbytes' test does
            p1.data = p1.data.to(gtype).float()
            p2.copy_(p1.data)
            for (ref_key, *_), s in zip(states, ours):
                ref_opt.state[p1][ref_key].copy_(s)
    if kernels is not None:
        want = kernel_name(name, gtype, 8)
        assert kernels.launched == [want] * steps, set(kernels.launched)


def run_32bit(name: str, shape, gtype, steps: int = 20, seed: int = 0, device: str = "cpu") -> None:
    """bitsandbytes' test_optimizer32bit, on our kernels. Its rules (states within atol / rtol,
    at most 15 parameters not close, 10 after a reload; fp32 parameters never re-synchronised)
    are calibrated for its 20 steps: Lion's sign(beta1*m + (1-beta1)*g) flips wherever that sum
    is within a rounding of 0, and any rounding other than torch's own (CUDA's fused
    multiply-adds, docs/semantics.md's one rounding per operation) leaves such a parameter 2*lr apart for
    good: measured here for docs/semantics.md's float32 formulas against PlainLion, 10 at step 20 and 31 at
    step 50 on 1024x4097 (see test_32bit_lion_over_50_steps for docs/semantics.md 5.3's rules)."""
    make_ref, make_bnb, states = THIRTY_TWO_BIT[name]
    torch.manual_seed(seed)
    p1 = torch.randn(*shape, dtype=gtype) * 0.1
    p2 = p1.clone().to(device)
    p1 = p1.float()
    ref_opt, bnb_opt = make_ref([p1]), make_bnb([p2])
    atol, rtol = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (1e-3, 1e-2), torch.float16: (1e-4, 1e-3)}[gtype]
    reload_every = max(1, steps // 5)
    with kernels_on(device) as kernels:
        for i in range(steps):
            g = torch.randn(*shape, dtype=gtype) * 0.01
            p1.grad = g.clone().float()
            p2.grad = g.clone().to(device)
            bnb_opt.step()
            ref_opt.step()
            for ref_key, key in states:  # torch.testing.assert_close's rule
                far = not_close(ref_opt.state[p1][ref_key], bnb_opt.state[p2][key].cpu(), atol=atol, rtol=rtol)
                assert not far.any(), f"step {i}: {int(far.sum())} {ref_key} values differ"
            far = not_close(p1, p2.float().cpu(), atol=atol, rtol=rtol)
            assert far.sum() <= 15, f"step {i}: {int(far.sum())} parameters differ"
            if i % reload_every == 0 and i > 0:
                bnb_opt = reload(make_bnb, bnb_opt, p2)
                far = not_close(p1, p2.float().cpu(), atol=atol, rtol=rtol)
                assert far.sum() <= 10
            if gtype != torch.float32:
                p1.data = p1.data.to(p2.dtype).float()
                p2.copy_(p1.data)
            if name == "lars":
                assert bnb_opt.state[p2]["unorm_vec"].cpu() > 0.0
    if kernels is not None:
        launches_per_step = 2 if name == "lars" else 1
        assert len(kernels.launched) == steps * launches_per_step
        assert kernels.launched[-1] == kernel_name(name, gtype, 32)


# -- the default run -----------------------------------------------------------------------------------

SMALL = [(1024, 32), (4097,)]
ALL_8BIT = [n for n in EIGHT_BIT if not n.startswith("paged_")]
# each optimizer once in fp16 and once in bf16, spread over the two small shapes
HALF_CASES = [(n, SMALL[i % 2], torch.float16 if i % 2 else torch.bfloat16) for i, n in enumerate(ALL_8BIT)] + [
    (n, SMALL[(i + 1) % 2], torch.bfloat16 if i % 2 else torch.float16) for i, n in enumerate(ALL_8BIT)
]


def shape_id(shape) -> str:
    return "x".join(map(str, shape))


@pytest.mark.parametrize("shape", SMALL, ids=shape_id)
@pytest.mark.parametrize("name", list(EIGHT_BIT))
def test_8bit_fp32(name, shape):
    run_8bit(name, shape, torch.float32)


@pytest.mark.parametrize("name,shape,gtype", HALF_CASES, ids=[f"{n}-{shape_id(s)}-{DT[d]}" for n, s, d in HALF_CASES])
def test_8bit_half(name, shape, gtype):
    run_8bit(name, shape, gtype)


@pytest.mark.parametrize("name,shape", [("adamw8bit", (1024, 1024)), ("lion8bit", (1024, 4097))], ids=shape_id)
def test_8bit_large(name, shape):
    run_8bit(name, shape, torch.bfloat16 if name == "lion8bit" else torch.float32, steps=20)


@pytest.mark.parametrize("shape", SMALL, ids=shape_id)
@pytest.mark.parametrize("name", list(THIRTY_TWO_BIT))
def test_32bit_fp32(name, shape):
    run_32bit(name, shape, torch.float32, steps=50)


@pytest.mark.parametrize("name", ["adam", "momentum", "lion", "ademamix"])
def test_32bit_half(name):
    for gtype in (torch.float16, torch.bfloat16):
        run_32bit(name, (1024, 32), gtype, steps=20)


# -- the full matrix (pytest -m slow) ------------------------------------------------------------------

FULL_SHAPES = [(1024, 32), (1024, 1024), (1024, 4097), (4097,)]


@pytest.mark.slow
@pytest.mark.parametrize("gtype", oi.DTYPES, ids=str)
@pytest.mark.parametrize("shape", FULL_SHAPES, ids=shape_id)
@pytest.mark.parametrize("name", list(EIGHT_BIT))
def test_8bit_full_matrix(name, shape, gtype):
    run_8bit(name, shape, gtype)


@pytest.mark.slow
@pytest.mark.parametrize("gtype", oi.DTYPES, ids=str)
@pytest.mark.parametrize("shape", FULL_SHAPES, ids=shape_id)
@pytest.mark.parametrize("name", list(THIRTY_TWO_BIT))
def test_32bit_full_matrix(name, shape, gtype):
    if name == "lars" and gtype != torch.float32:
        pytest.skip("PytorchLARS asserts float32 parameters")
    run_32bit(name, shape, gtype)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(1024, 1024), (1024, 4097)], ids=shape_id)
def test_32bit_lion_over_50_steps(shape):
    """32-bit Lion over 50 steps with docs/semantics.md 5.3's rules (states within 1e-6 / 1e-5, parameter mean
    errors below 6e-5 / 6e-4): the sign flips near 0 (see run_32bit) stay a handful of elements."""
    torch.manual_seed(0)
    p1 = torch.randn(*shape) * 0.1
    p2 = p1.clone()
    ref_opt, bnb_opt = PlainLion([p1]), bnb.optim.Lion([p2])
    with use_emulated_kernels() as kernels:
        for i in range(50):
            g = torch.randn(*shape) * 0.01
            p1.grad, p2.grad = g.clone(), g.clone()
            ref_opt.step()
            bnb_opt.step()
            far = not_close(ref_opt.state[p1]["exp_avg"], bnb_opt.state[p2]["state1"], atol=1e-6, rtol=1e-5)
            assert not far.any(), f"step {i}: {int(far.sum())} states differ"
            err = (p1 - p2).abs()
            assert err.mean() < 6e-5 and (err / (p1.abs() + 1e-9)).mean() < 6e-4, i
            assert not_close(p1, p2, atol=1e-6, rtol=1e-5).sum() <= 50, i  # the flips, a few dozen
    assert kernels.launched == ["bnb_optimizer_32bit_lion_f32"] * 50


# -- checkpoints -------------------------------------------------------------------------------------


def _train(opt, p, grads):
    for g in grads:
        p.grad = g.clone()
        opt.step()


def _tensors(state: dict) -> dict:
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("factory", [
    lambda p: bnb.optim.AdamW8bit(p), lambda p: bnb.optim.Lion8bit(p, lr=1e-3),
    lambda p: bnb.optim.AdEMAMix8bit(p, t_alpha=30, t_beta3=30), lambda p: bnb.optim.SGD8bit(p, 0.01, 0.9),
    lambda p: bnb.optim.Adam(p), lambda p: bnb.optim.LARS(p, 0.01, 0.9),
], ids=["adamw8bit", "lion8bit", "ademamix8bit_scheduled", "sgd8bit", "adam32", "lars32"])  # fmt: skip
def test_state_dict_reload_continues_bit_identically(factory):
    """A state_dict saved after 10 steps reloads into a fresh optimizer, which then continues
    exactly as the uninterrupted one does."""
    r = oi.gen(5)
    grads = [torch.randn(300, 20, generator=r) * 0.01 for _ in range(20)]
    start = torch.randn(300, 20, generator=r) * 0.1
    with use_emulated_kernels():
        p_a = torch.nn.Parameter(start.clone())
        opt_a = factory([p_a])
        _train(opt_a, p_a, grads)
        p_b = torch.nn.Parameter(start.clone())
        opt_b = factory([p_b])
        _train(opt_b, p_b, grads[:10])
        buf = io.BytesIO()
        torch.save(opt_b.state_dict(), buf)
        buf.seek(0)
        p_c = torch.nn.Parameter(p_b.detach().clone())
        opt_c = factory([p_c])
        opt_c.load_state_dict(torch.load(buf))
        _train(opt_c, p_c, grads[10:])
    assert torch.equal(p_c, p_a)
    a, c = _tensors(opt_a.state[p_a]), _tensors(opt_c.state[p_c])
    assert a.keys() == c.keys()
    for k in a:
        assert torch.equal(a[k], c[k]), k


@pytest.mark.parametrize("cls", [bnb.optim.AdamW8bit, bnb.optim.Lion8bit, bnb.optim.AdEMAMix8bit])
def test_state_format_is_bitsandbytes_own(cls):
    """The same state_dict keys, dtypes and shapes as bitsandbytes' stock CPU optimizer."""
    r = oi.gen(6)
    grads = [torch.randn(70, 70, generator=r) for _ in range(3)]
    start = torch.randn(70, 70, generator=r)
    p_stock = torch.nn.Parameter(start.clone())
    stock = cls([p_stock])
    _train(stock, p_stock, grads)
    with use_emulated_kernels() as kernels:
        p_ours = torch.nn.Parameter(start.clone())
        ours = cls([p_ours])
        _train(ours, p_ours, grads)
    assert kernels.launched
    s_stock, s_ours = stock.state_dict(), ours.state_dict()
    assert s_stock["param_groups"] == s_ours["param_groups"]

    def layout(sd):
        out = {}
        for idx, st in sd["state"].items():
            flat = dict(st)
            flat.update(flat.pop(bnb.optim.optimizer.Optimizer8bit._FSDP_WRAPPED_QUANT_STATE_KEY, {}))
            out[idx] = {k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v for k, v in flat.items()}
        return out

    assert layout(s_stock) == layout(s_ours)


def test_stock_cpu_state_loads_and_continues():
    """A state written by stock bitsandbytes' CPU optimizer loads and continues on our kernels
    (first step exactly as docs/semantics.md's reference from that state; then as close to the stock
    continuation as bitsandbytes' tolerances ask), and ours loads into the stock one."""
    r = oi.gen(7)
    shape = (256, 40)
    grads = [torch.randn(*shape, generator=r) * 0.01 for _ in range(20)]
    start = torch.randn(*shape, generator=r) * 0.1
    p_stock = torch.nn.Parameter(start.clone())
    stock = bnb.optim.AdamW8bit([p_stock])
    _train(stock, p_stock, grads[:10])
    buf = io.BytesIO()
    torch.save(stock.state_dict(), buf)

    buf.seek(0)
    p = torch.nn.Parameter(p_stock.detach().clone())
    ours = bnb.optim.AdamW8bit([p])
    ours.load_state_dict(torch.load(buf))
    st = ours.state[p]
    want = R.optimizer_8bit("adam", grads[10], p.detach(), st["state1"], st["state2"], 0.9, 0.999, 0.0, 0.0, 1e-8,
                            11, 1e-3, st["qmap1"], st["qmap2"], st["absmax1"], st["absmax2"], 1e-2, 1.0)  # fmt: skip
    with use_emulated_kernels() as kernels:
        _train(ours, p, grads[10:11])
        assert torch.equal(p.detach(), want.p)
        assert torch.equal(st["state1"], want.state1) and torch.equal(st["state2"], want.state2)
        assert torch.equal(st["absmax1"], want.absmax1) and torch.equal(st["absmax2"], want.absmax2)
        _train(ours, p, grads[11:])
    assert kernels.launched == ["bnb_optimizer_8bit_adam_f32"] * 10
    _train(stock, p_stock, grads[10:])
    err = (p - p_stock).abs()
    assert err.mean() < 6e-5 and (err / (p_stock.abs() + 1e-9)).mean() < 6e-4

    # and back: our state continues on the stock CPU optimizer
    buf = io.BytesIO()
    torch.save(ours.state_dict(), buf)
    buf.seek(0)
    p_back = torch.nn.Parameter(p.detach().clone())
    back = bnb.optim.AdamW8bit([p_back])
    back.load_state_dict(torch.load(buf))
    _train(back, p_back, grads[:3])
    assert torch.isfinite(p_back).all() and (p_back - p).abs().max() < 1e-2


# -- launches ----------------------------------------------------------------------------------------


def test_one_launch_per_parameter_tensor_per_step():
    """A model's parameters of mixed sizes and dtypes: 8-bit state for the large ones, 32-bit for
    those below min_8bit_size; each parameter with a gradient is one launch per step."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 8))
    model[2].to(torch.bfloat16)
    x = torch.randn(16, 64, generator=oi.gen(8))
    opt = bnb.optim.AdamW8bit(model.parameters(), min_8bit_size=1000)
    with use_emulated_kernels() as kernels:
        for step in range(3):
            out = model[2](model[1](model[0](x)).to(torch.bfloat16))
            out.float().square().mean().backward()
            model[0].bias.grad = None  # a parameter without a gradient is skipped
            opt.step()
            opt.zero_grad()
    per_step = ["bnb_optimizer_8bit_adam_f32", "bnb_optimizer_32bit_adam_bf16", "bnb_optimizer_32bit_adam_bf16"]
    assert kernels.launched == per_step * 3
    assert opt.state[model[0].weight]["state1"].dtype == torch.uint8
    assert opt.state[model[2].weight]["state1"].dtype == torch.float32


def test_lamb_and_lars_8bit_classes_are_refused():
    """LAMB8bit / LARS8bit call the 8-bit op with "lamb" / "lars": a clear error (as on CUDA)."""
    p = torch.nn.Parameter(torch.randn(64, 128))
    p.grad = torch.randn(64, 128)
    for opt in (bnb.optim.LAMB8bit([p]), bnb.optim.LARS8bit([p], lr=0.01, momentum=0.9)):
        with use_emulated_kernels(), pytest.raises(ValueError, match="no 8-bit blockwise update"):
            opt.step()


def test_scheduled_ademamix_numbers_arrive_as_plain_numbers():
    """AdEMAMix8bit with t_alpha / t_beta3 passes the step's alpha and beta3 as numbers: the
    kernel's step equals docs/semantics.md's reference with the schedule's values."""
    p = torch.nn.Parameter(torch.randn(64, 80, generator=oi.gen(9)) * 0.1)
    opt = bnb.optim.AdEMAMix8bit([p], t_alpha=10, t_beta3=10)
    grads = [torch.randn(64, 80, generator=oi.gen(10 + i)) * 0.01 for i in range(4)]
    with use_emulated_kernels():
        _train(opt, p, grads[:3])
        st = opt.state[p]
        before = {k: v.clone() for k, v in _tensors(st).items()}
        p0 = p.detach().clone()
        _train(opt, p, grads[3:])
    step, alpha, (b1, b2, b3) = 4, 5.0, (0.9, 0.999, 0.9999)
    alpha_t = min(step * alpha / 10, alpha)
    s = step / 10
    beta3_t = min(math.exp((math.log(b1) * math.log(b3)) / ((1 - s) * math.log(b3) + s * math.log(b1))), b3)
    want = R.optimizer_8bit("ademamix", grads[3], p0, before["state1"], before["state2"], b1, b2, beta3_t, alpha_t,
                            1e-8, step, 1e-3, before["qmap1"], before["qmap2"], before["absmax1"], before["absmax2"],
                            1e-2, 1.0)  # fmt: skip
    assert torch.equal(p.detach(), want.p) and torch.equal(st["state1"], want.state1)
