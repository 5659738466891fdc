"""Hundreds of emulated launches run in bounded memory (nothing on the launch path keeps buffers,
staging copies, fiber stacks or compiled libraries per launch)."""

from __future__ import annotations

import gc

import extras
import pytest
import torch

psutil = extras.require("psutil")

import bitsandbytes.functional as F  # noqa: E402

from bnb_mps import executors  # noqa: E402
from bnb_mps.executors import emulated  # noqa: E402
from bnb_mps.testing import use_emulated_kernels  # noqa: E402

try:
    emulated.load()
except executors.ExecutorUnavailable as e:  # pragma: no cover (the runtime is not built here)
    pytest.skip(str(e), allow_module_level=True)


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def growth(rounds: int, step) -> int:
    """Resident memory growth over `rounds` calls of `step`, after a warm-up that fills caches."""
    for _ in range(10):
        step()
    before = rss()
    for _ in range(rounds):
        step()
    return rss() - before


# A leak of any buffer per round would grow by >= 64 KiB x rounds; the bound leaves room for the
# allocator's own noise only.
BOUND = 16 << 20


def test_use_emulated_kernels_keeps_nothing_per_launch():
    A = torch.randn(128, 512, dtype=torch.float16)  # 128 KiB in, 128 KiB out per round

    with use_emulated_kernels() as kernels:

        def step():
            q, state = F.quantize_4bit(A, blocksize=64, quant_type="nf4")
            F.dequantize_4bit(q, state)

        grown = growth(150, step)  # 300 launches
        assert len(kernels.launches) == 320
    assert grown < BOUND, f"resident memory grew by {grown >> 20} MiB over 300 launches"


def test_staged_and_race_checked_launches_keep_nothing():
    """The staging executor (mps tensors through the emulator) and race-checked launches."""
    ex = executors.StagedExecutor(emulated.load(), to_host=lambda t: t.clone())
    A = torch.randn(64 * 1024)
    code = F.create_dynamic_map(signed=True)
    out = torch.empty(64 * 1024, dtype=torch.uint8)
    absmax = torch.empty(256, dtype=torch.float32)
    from bnb_mps.kernel_args import uint32

    def step():
        ex.launch("bnb_quantize_blockwise_f32_256", grid=(64, 1, 1), threadgroup=(128, 1, 1),
                  args=[A, code, out, absmax, uint32(A.numel())])

    with emulated.settings(race_check=True):
        grown = growth(300, step)
    assert grown < BOUND, f"resident memory grew by {grown >> 20} MiB over 300 launches"
    # and the staged results came back into the caller's tensors
    q, am = torch.ops.bitsandbytes.quantize_blockwise.default(A, code, 256)
    assert torch.equal(absmax, am)
