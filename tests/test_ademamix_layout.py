"""bnb_mps.ademamix_layout: moving an AdEMAMix8bit state between bitsandbytes' CUDA layout (the slow
EMA's block b scaled by the flat absmax1[(n + 256 b) / 256]) and bnb-mps' padded one (absmax1[1, b]),
docs/semantics.md 5.1. References: the two indexing rules as that page states them, and section 2's
quantizer from tests/spec_reference.py; CUDA's own state from tests/data/cuda_golden/."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cuda_golden as golden
import spec_reference as sref
from bnb_mps.ademamix_layout import (
    ademamix8bit_from_cuda,
    ademamix8bit_state_from_cuda,
    ademamix8bit_state_to_cuda,
    ademamix8bit_to_cuda,
)


def _code() -> torch.Tensor:
    import bitsandbytes.functional as F

    return F.create_dynamic_map(signed=True).float()


def _values_cuda(state1, absmax1, code) -> np.ndarray:
    """Both EMAs dequantized as CUDA's kernel reads them: m_j with absmax1[j / 256], m2_j with the flat
    absmax1[(n + j - j % 256) / 256]."""
    n = state1[0].numel()
    flat = absmax1.reshape(-1).numpy()
    j = np.arange(n)
    c = code.numpy()
    m = c[state1[0].reshape(-1).numpy()] * flat[j // 256]
    m2 = c[state1[1].reshape(-1).numpy()] * flat[(n + j - j % 256) // 256]
    return np.stack([m, m2]).astype(np.float32)


def _values_padded(state1, absmax1, code) -> np.ndarray:
    n = state1[0].numel()
    rows = absmax1.reshape(2, -1).numpy()
    j = np.arange(n)
    c = code.numpy()
    return np.stack([c[state1[r].reshape(-1).numpy()] * rows[r][j // 256] for r in (0, 1)]).astype(np.float32)


def _cuda_state(dt: str):
    stored, _ = golden.load("main")
    out = stored[f"opt/ademamix8/{dt}"]
    keys = out[-1].split(",")
    return out[1 + keys.index("state1")], out[1 + keys.index("absmax1")]


@pytest.mark.parametrize("dt", ["fp32", "fp16", "bf16"])
def test_from_cuda_reads_what_cudas_next_step_reads(dt):
    """CUDA's state after three steps (n = 8292, not a multiple of 256), moved to the padded layout:
    every element of both EMAs dequantizes to what CUDA's kernel would read from the original."""
    state1, absmax1 = _cuda_state(dt)
    assert state1[0].numel() % 256 != 0
    code = _code()
    s1, a1 = ademamix8bit_from_cuda(state1, absmax1)
    assert torch.equal(s1, state1) and a1.shape == absmax1.shape
    assert np.array_equal(_values_padded(s1, a1, code), _values_cuda(state1, absmax1, code))


@pytest.mark.parametrize("n", [512, 700, 8292])
def test_to_cuda_then_back(n):
    """A padded state moved to CUDA's layout reads, under CUDA's indexing, the same values as before
    everywhere but in the two blocks that share a slot; those take the larger scale and their codes
    are section 2's re-quantization (with the sign fix) of their old values. Back in the padded
    layout, the values are those CUDA's layout held. A multiple of 256 moves unchanged."""
    g = torch.Generator().manual_seed(n)
    blocks = -(-n // 256)
    state1 = torch.randint(0, 256, (2, n), generator=g, dtype=torch.uint8)
    absmax1 = torch.rand(2, blocks, generator=g) + 0.1
    code = _code()
    before = _values_padded(state1, absmax1, code)
    s1, a1 = ademamix8bit_to_cuda(state1, absmax1, code)
    after = _values_cuda(s1, a1, code)
    if n % 256 == 0:
        assert torch.equal(s1, state1) and torch.equal(a1, absmax1)
        return
    last = slice((blocks - 1) * 256, n)
    shared = float(max(absmax1[0, -1], absmax1[1, 0]))
    assert float(a1.reshape(-1)[blocks - 1]) == shared and float(a1.reshape(-1)[-1]) == 0.0
    keep = np.ones_like(before, dtype=bool)
    keep[0, last] = False
    keep[1, :256] = False
    assert np.array_equal(after[keep], before[keep])
    for row, cols in ((0, last), (1, slice(0, 256))):
        x = before[row, cols]
        s = x * (np.float32(1) / np.float32(shared))
        q = sref.index_8bit(s, code.numpy()).astype(np.int64)
        fix = np.signbit(code.numpy()[q]) != np.signbit(x)
        q = np.where(fix, np.where(x > 0, q + 1, q - 1) % 256, q)
        assert np.array_equal(s1[row, cols].numpy(), q.astype(np.uint8))
    back_s1, back_a1 = ademamix8bit_from_cuda(s1, a1)
    assert np.array_equal(_values_padded(back_s1, back_a1, code), after)


def test_optimizer_states_convert_in_place():
    """The optimizer-level functions convert every AdEMAMix8bit state of a bitsandbytes optimizer in
    place (as the tensor-level ones do) and leave other states alone."""
    import bitsandbytes as bnb

    big, small = torch.nn.Parameter(torch.randn(4100)), torch.nn.Parameter(torch.randn(10))
    opt = bnb.optim.AdEMAMix8bit([big, small], lr=1e-3)
    st = opt.state[big]
    st["state1"] = torch.randint(0, 256, (2, 4100), dtype=torch.uint8)
    st["absmax1"] = torch.rand(2, 17) + 0.1
    st["qmap1"] = _code()
    opt.state[small]["state1"] = torch.zeros(2, 10)  # a 32-bit state (below min_8bit_size): untouched
    want = ademamix8bit_to_cuda(st["state1"], st["absmax1"], st["qmap1"])
    assert ademamix8bit_state_to_cuda(opt) == 1
    assert torch.equal(st["state1"], want[0]) and torch.equal(st["absmax1"], want[1])
    want = ademamix8bit_from_cuda(st["state1"], st["absmax1"])
    assert ademamix8bit_state_from_cuda(opt) == 1
    assert torch.equal(st["absmax1"], want[1])
    assert torch.equal(opt.state[small]["state1"], torch.zeros(2, 10))


@pytest.mark.parametrize(
    "state1,absmax1,match",
    [
        (torch.zeros(300, dtype=torch.uint8), torch.zeros(2, 2), "state1"),
        (torch.zeros(2, 300), torch.zeros(2, 2), "state1"),
        (torch.zeros(2, 300, dtype=torch.uint8), torch.zeros(2, 3), "absmax1"),
        (torch.zeros(2, 300, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.float16), "absmax1"),
    ],
)
def test_bad_input_is_named(state1, absmax1, match):
    with pytest.raises(ValueError, match=match):
        ademamix8bit_from_cuda(state1, absmax1)
    with pytest.raises(ValueError, match=match):
        ademamix8bit_to_cuda(state1, absmax1, _code())


def _step_once(opt, p):
    from bnb_mps.testing import use_emulated_kernels

    with use_emulated_kernels():
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(1))
        opt.step()


def test_load_state_dict_converts_a_cuda_layout_state_with_a_warning(monkeypatch):
    """bitsandbytes' load_state_dict, wrapped by ademamix_layout.install() (as bnb_mps.register() does
    for mps; here the CPU tensors of the emulated tier stand in): CUDA's H100 state is recognised and
    converted, with a warning; a state in bnb-mps' layout loads unchanged and silently."""
    import warnings

    import bitsandbytes as bnb
    from bnb_mps import ademamix_layout

    monkeypatch.setattr(ademamix_layout, "DEVICE_TYPES", ("cpu",))
    was_installed = ademamix_layout._original is not None
    assert ademamix_layout.install()
    try:
        p = torch.nn.Parameter(torch.randn(8292))
        opt = bnb.optim.AdEMAMix8bit([p], lr=1e-3)
        _step_once(opt, p)
        ours, before = opt.state_dict(), opt.state[p]["absmax1"].clone()
        assert not ademamix_layout.in_cuda_layout(opt.state[p]["state1"], opt.state[p]["absmax1"])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt.load_state_dict(ours)  # our own layout: no warning, nothing changed
        assert torch.equal(opt.state[p]["absmax1"], before)

        state1, absmax1 = _cuda_state("fp32")
        assert ademamix_layout.in_cuda_layout(state1, absmax1)
        cuda_sd = opt.state_dict()
        entry = cuda_sd["state"][0]
        entry = entry.get(opt._FSDP_WRAPPED_QUANT_STATE_KEY, entry)  # (bitsandbytes wraps the 8-bit state)
        entry["state1"], entry["absmax1"] = state1.clone(), absmax1.clone()
        with pytest.warns(UserWarning, match="CUDA layout"):
            opt.load_state_dict(cuda_sd)
        want = ademamix8bit_from_cuda(state1, absmax1)
        assert torch.equal(opt.state[p]["state1"], want[0]) and torch.equal(opt.state[p]["absmax1"], want[1])
    finally:
        if not was_installed:
            ademamix_layout.uninstall()
            from bitsandbytes.optim.optimizer import Optimizer8bit

            assert not hasattr(Optimizer8bit.load_state_dict, "__wrapped__")
