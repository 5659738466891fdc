"""Clocks that time a batch of calls: the GPU's, where a GPU tier serves, else the host's.

`clock.batch(call, n)` runs `call` n times and returns the seconds the batch took on that clock.
An exception of `call` itself propagates as `CallRaised` (the caller's route raised); anything that
goes wrong with the clock (an error of torch's events, times that come out reversed or not at all)
raises `ClockFailed`, so that a caller never mistakes a clock's trouble for its route's.

- `EventClock` (the shader tier; any tier that encodes on torch's MPS stream): two timing events
  around the batch, both recorded, then `torch.mps.synchronize()`, then `query()` of both (an event
  recorded into a command buffer that failed never completes, and `elapsed_time` would wait for it
  forever on torch 2.13 and 2.14), then `elapsed_time`. A timing
  event is never synchronized: on torch 2.13 and 2.14 `Event.synchronize()` before the GPU is done,
  followed by `elapsed_time`, waits forever (pytorch#162872: `record()` and `synchronize()` each
  register a completion callback that sets one boolean, `MPSEvent::m_cpu_sync_completed`;
  `synchronize()` consumes it, and `elapsed_time()` then waits for a signal that was already taken).
  What the figure covers: torch stamps each event with the host's clock when Metal's shared-event
  listener reports that the GPU passed it (torch <= 2.14), or with the GPU end time of the command
  buffer that signalled it (torch >= 2.15); each `record()` commits the stream's command buffer. So
  the batch is timed from the end of the GPU work before it to the end of its own: where nothing
  commits inside the batch (its calls in one command buffer, committed by the end event's
  `record()`), the host's time to encode the calls plus the GPU's time to run them, and, before 2.15,
  the listener's delivery latency (microseconds) at each end (docs/tuning.md, "The clock, exactly").
- `CommandBufferClock` (the native tier, whose module reads command buffers' GPU times): after a
  synchronisation (so no earlier work shares the batch's first command buffer), every launch of the
  batch is given a `_native.CommandBufferWatch` (per thread: `watching`), whose completed handler each
  launch attaches to its own command buffer inside its own step on the stream's queue, and after each
  call the stream's current command buffer, if it has one, is watched too (`track()`: it holds the
  work of torch's own ops, e.g. the linear of dequantize+linear or a route of bitsandbytes'; after a
  route that synchronised there is none, and none is made); after a second synchronisation, a batch
  with a buffer that failed is refused (ClockFailed), else the
  batch is max(GPUEndTime) - min(GPUStartTime) over the watched buffers: GPU time, idle gaps between
  the batch's command buffers included.
- `HostClock`: `time.perf_counter` around the batch (the emulated tier, CPU tensors): figures that
  say nothing about a GPU.

Only calls on torch's default MPS stream are timed on a GPU clock: torch 2.15's public streams
refuse `Event.record()` elsewhere (`gpu_clock_refusal`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Optional

import torch

#: how long the native clock waits for watched command buffers to report, after a synchronisation
REPORT_TIMEOUT = 10.0


class ClockFailed(Exception):
    """The clock could not time a batch (its own trouble, not the route's)."""


class CallRaised(Exception):
    """The timed call raised (`__cause__` is its exception)."""


def _run(call: Callable[[], object], n: int) -> None:
    try:
        for _ in range(n):
            call()
    except ClockFailed:
        raise
    except Exception as e:
        raise CallRaised(str(e)) from e


def _checked(seconds: float, what: str) -> float:
    if not (isinstance(seconds, float) and math.isfinite(seconds) and seconds > 0):
        raise ClockFailed(f"{what} gave {seconds!r} s for a batch (reversed or no time)")
    return seconds


class HostClock:
    name = "host"

    def batch(self, call: Callable[[], object], n: int) -> float:
        start = time.perf_counter()
        _run(call, n)
        return _checked(float(time.perf_counter() - start), "the host's clock")


class EventClock:
    name = "gpu"

    def batch(self, call: Callable[[], object], n: int) -> float:
        mps = torch.mps
        try:
            start, end = mps.Event(enable_timing=True), mps.Event(enable_timing=True)
            start.record()
        except Exception as e:
            raise ClockFailed(f"torch.mps.Event: {e}") from e
        _run(call, n)
        try:
            end.record()
            mps.synchronize()  # (the device's, never the event's: see the module docstring)
            # An event recorded into a command buffer that failed never completes, and elapsed_time waits
            # for it with no timeout (torch 2.13, 2.14: MPSEvent::waitForCpuSync): ask first.
            if not (start.query() and end.query()):
                raise ClockFailed("a timing event did not complete after torch.mps.synchronize() (a command "
                                  "buffer of the batch failed?)")
            ms = float(start.elapsed_time(end))
        except ClockFailed:
            raise
        except Exception as e:
            raise ClockFailed(f"torch.mps.Event: {e}") from e
        return _checked(ms / 1e3, "torch.mps.Event.elapsed_time")


class CommandBufferClock:
    name = "gpu"

    def __init__(self, executor) -> None:
        self._executor = executor  # the native executor: synchronize(), watch_command_buffers(), watching(watch)

    def batch(self, call: Callable[[], object], n: int) -> float:
        try:
            self._executor.synchronize()
            watch = self._executor.watch_command_buffers()
        except Exception as e:
            raise ClockFailed(f"watching command buffers: {e}") from e

        def watched() -> None:
            call()
            try:
                watch.track()  # (the stream's current buffer: work of torch's own ops, e.g. a route's linear)
            except Exception as e:
                raise ClockFailed(f"watching the stream's command buffer: {e}") from e

        with self._executor.watching(watch):  # (each launch attaches the handler to its own buffer)
            _run(watched, n)
        try:
            self._executor.synchronize()
            errors = watch.errors(REPORT_TIMEOUT)
            spans = [(float(s), float(e)) for s, e in watch.gpu_times() if e > s]
        except Exception as e:
            raise ClockFailed(f"reading command buffers' GPU times: {e}") from e
        if errors:
            raise ClockFailed(f"a timed command buffer did not complete: {errors[0]}")
        if not spans:
            raise ClockFailed("no watched command buffer reported GPU times")
        return _checked(max(e for _, e in spans) - min(s for s, _ in spans), "the command buffers' GPU times")


def gpu_clock_refusal() -> Optional[str]:
    """Why calls made now cannot be timed on a GPU clock (not on torch's default MPS stream), or None."""
    mps = getattr(torch, "mps", None)
    current, default = getattr(mps, "current_stream", None), getattr(mps, "default_stream", None)
    if current is None or default is None:  # (torch < 2.15: one stream, the default one)
        return None
    try:  # (stream ids: torch/mps/streams.py makes a new Stream wrapper at each call)
        if current().stream_id != default().stream_id:
            return "the calls run on a torch.mps stream other than the default one, where torch cannot time them"
    except Exception as e:  # noqa: BLE001
        return f"torch.mps cannot say which stream is current ({e})"
    return None
