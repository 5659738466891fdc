"""Profiling the project's kernels through the op layer: `use_emulated_kernels(profile=True)`
records one KernelProfile per launch, leaves the results bit-identical, and the traffic it
reports matches the layout docs/semantics.md gives each op's buffers."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("bitsandbytes")

from bnb_mps import emulator  # noqa: E402
from bnb_mps.emulator import build  # noqa: E402
from bnb_mps.testing import RecordingExecutor, use_emulated_kernels  # noqa: E402
from extras import profile_compiler  # noqa: E402

profile_compiler()  # (a missing profiling clang++ skips here, and fails under CI: tests/extras.py)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_quantize_4bit_profile(dtype):
    n, bs = 64 * 96, 64
    A = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(dtype)
    with use_emulated_kernels() as plain:
        q0, absmax0 = torch.ops.bitsandbytes.quantize_4bit(A, bs, "nf4", torch.uint8)
    with use_emulated_kernels(profile=True) as prof:
        q1, absmax1 = torch.ops.bitsandbytes.quantize_4bit(A, bs, "nf4", torch.uint8)
    assert torch.equal(q0, q1) and torch.equal(absmax0, absmax1)
    assert prof.launched == plain.launched and len(prof.profiles) == 1
    p = prof.profiles[0]
    assert p.kernel == prof.launched[0]
    a, packed, absmax, scalar = p.buffers
    assert scalar is None
    # docs/semantics.md section 3: A is read once, every packed byte and every absmax written once.
    assert (a.load_bytes, a.unique_bytes, a.store_bytes) == (n * dtype.itemsize, n * dtype.itemsize, 0)
    assert (packed.store_bytes, packed.unique_bytes, packed.load_bytes) == (n // 2, n // 2, 0)
    assert (absmax.store_bytes, absmax.unique_bytes) == (4 * (n // bs), 4 * (n // bs))
    assert a.lines == math.ceil(n * dtype.itemsize / 128) and a.coalescing_efficiency == 1.0
    assert p.threads == n // 2  # two elements per thread at blocksize 64
    assert p.unique_bytes == n * dtype.itemsize + n // 2 + 4 * (n // bs)


def test_dequantize_blockwise_profile():
    from bitsandbytes.functional import create_dynamic_map

    n, bs = 4096, 256
    code = create_dynamic_map(signed=True)
    q, absmax = torch.ops.bitsandbytes.quantize_blockwise(torch.randn(n), code, bs)
    with use_emulated_kernels(profile=True) as prof:
        out = torch.ops.bitsandbytes.dequantize_blockwise(q, absmax, code, bs, torch.float16)
    with use_emulated_kernels():
        ref = torch.ops.bitsandbytes.dequantize_blockwise(q, absmax, code, bs, torch.float16)
    assert torch.equal(out, ref)
    (p,) = prof.profiles
    a, c, m, o, *scalars = p.buffers
    assert scalars == [None, None]
    assert a.unique_bytes == n and o.unique_bytes == 2 * n and o.store_bytes == 2 * n
    assert c.unique_bytes == 4 * 256  # each threadgroup copies the whole code into threadgroup memory
    assert c.lines_summed_over_threadgroups == p.threadgroups * (4 * 256 // 128)
    assert m.unique_bytes == 4 * (n // bs)
    assert p.threadgroup_memory_bytes == 4 * 256 and p.barriers == 1


def test_recorder_profiles_only_through_an_executor_that_can():
    with pytest.raises(TypeError, match="profile"):
        RecordingExecutor(profile=True)
    rec = RecordingExecutor()
    assert rec.profiles == [] and not rec.profile
