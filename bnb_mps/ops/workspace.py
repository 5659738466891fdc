"""Per-device workspaces: buffers a kernel needs between its threadgroups, allocated once per device
and reused by every call, never per call.

The one user is the split-K 4-bit product (csrc/kernels/gemm_4bit_splitk.h): float32 partial sums of
a few output tiles and one counter per tile. A plan asks for a workspace of at least some size
(`PlanBuilder.workspace`); the plan, once bound, holds a view of the device's buffer of that kind, the
buffer grown (a new one, at least twice the old size) when a plan needs more than it has. Plans
bound earlier keep the buffer they hold, so each call is one key lookup and no allocation. Zeroed
buffers (the counters) are zero when allocated. A kernel that meets other threadgroups through a
counter takes a tag per call (`next_tag`): counts under another tag are another call's, so a call
that never finished (a GPU fault) cannot leave counts the next call takes for its own.

Calls of one stream of a device run in order (torch's MPS stream, the emulator), so one buffer per
device, stream and kind serves every plan; a bound plan takes the default stream's buffers when it is
bound, and, where torch has other MPS streams (torch >= 2.15), those of the stream a call runs on
(bnb_mps.ops.plan.BoundPlan), since two streams' kernels may run at the same time. Sizes are
proportional to outputs (M x N x slices floats), not to weights.
A new choice of kernel tier (bnb_mps.executors.reset, which also drops the plans bound before it)
starts new buffers.
"""

from __future__ import annotations

import itertools
import threading

import torch

from .. import executors

_lock = threading.Lock()
_buffers: dict[tuple, torch.Tensor] = {}  # (device, kind, dtype, zeroed, tier generation, stream) -> buffer


def workspace(device, kind: str, numel: int, dtype: torch.dtype, zeroed: bool, stream: int = 0) -> torch.Tensor:
    """A one-dimensional view of `numel` elements of the device's workspace `kind` for calls on the
    torch.mps stream `stream` (its id; 0: the default stream), zeros when allocated where `zeroed` (the
    counters: then the tags of the calls that counted in them, see the module docstring)."""
    if numel < 0:
        raise ValueError(f"workspace {kind!r}: numel must be >= 0, got {numel}")
    key = (torch.device(device), kind, dtype, zeroed, executors.generation, stream)
    with _lock:
        for old in [k for k in _buffers if k[4] != key[4]]:  # (plans bound before keep theirs)
            del _buffers[old]
        buf = _buffers.get(key)
        if buf is None or buf.numel() < numel:
            size = max(numel, 2 * buf.numel() if buf is not None else 0, 1)
            make = torch.zeros if zeroed else torch.empty
            buf = make(size, dtype=dtype, device=key[0])
            _buffers[key] = buf
        return buf[:numel]


#: tags are 1 .. TAGS - 1: 27 bits, above a counter's 5 bits of count (csrc/kernels/gemm_4bit_splitk.h)
TAGS = 1 << 27
_calls = itertools.count(1)  # (next() is atomic under the GIL)


def next_tag() -> int:
    """The tag of a call that counts in a workspace: 1, 2, ..., TAGS - 1, 1, 2, ... Never 0, which
    zeroed counters hold, and unlike the tag of any counter it counts in: that is the tag of the last
    call that counted there, which may be many calls back (calls with fewer tiles leave the higher
    counters alone), but not TAGS - 1 calls back or a multiple of that."""
    return (next(_calls) - 1) % (TAGS - 1) + 1


def release() -> None:
    """Forget every workspace (plans bound before keep theirs); for tests."""
    with _lock:
        _buffers.clear()
