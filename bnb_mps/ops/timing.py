"""How long one route takes, measured on the GPU's clock.

One warm-up call (it compiles, plans, allocates), then one timed call, which says how many calls make
a batch of at least about `MIN_SECONDS`; then batches of that many calls until `SAMPLES` batches are
timed (the first call counts as one where it alone took long enough). The time is the median batch's
time per call.

On mps tensors with a GPU tier, a batch is timed between two `torch.mps.Event`s recorded on PyTorch's
MPS stream: the GPU's clock, so the host's share of a call (which the GPU hides behind its queue)
does not count, nor does anything else the machine's CPU does. Elsewhere (the emulated tier, CPU
tensors) the host's clock times the batch: such figures say nothing about speed on a GPU, and the
tuning table marks them ("host").
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

MIN_SECONDS = 1e-3  # a timed batch runs at least about this long
SAMPLES = 5  # timed batches, of which the median counts
MAX_BATCH = 10_000  # calls per batch at most (a call that takes no time at all)


def gpu_clock_available(device_type: str, tier: str) -> bool:
    """Whether calls on `tier` with tensors of `device_type` can be timed on the GPU's clock."""
    mps = getattr(torch, "mps", None)
    return device_type == "mps" and tier in ("native", "shader") and hasattr(mps, "Event")


def seconds(call: Callable[[], object], gpu: bool) -> float:
    """The median time per call of `call`, in seconds: on the GPU's clock (`gpu`), else the host's."""
    batch = _gpu_batch if gpu else _host_batch
    call()
    _synchronize(gpu)
    first = batch(call, 1)
    n = 1 if first >= MIN_SECONDS else min(MAX_BATCH, math.ceil(MIN_SECONDS / max(first, MIN_SECONDS / MAX_BATCH)))
    samples = [first] if n == 1 else []
    while len(samples) < SAMPLES:
        samples.append(batch(call, n) / n)
    return statistics.median(samples)


def _gpu_batch(call: Callable[[], object], n: int) -> float:
    start, end = torch.mps.Event(enable_timing=True), torch.mps.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _host_batch(call: Callable[[], object], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        call()
    return time.perf_counter() - start


def _synchronize(gpu: bool) -> None:
    if gpu:
        torch.mps.synchronize()
