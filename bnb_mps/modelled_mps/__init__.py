"""A model of torch's MPS runtime, so that the host code only a Mac runs executes anywhere.

    with bnb_mps.testing.use_modelled_mps(torch_version="2.13") as mps:
        q, state = bitsandbytes.functional.quantize_4bit(torch.randn(64, 64))
    assert mps.runtime.counts["kernels"]  # the shader tier's kernels ran, under the emulator

Under it, bitsandbytes ops on CPU tensors are served the way a Mac serves them on mps: bnb-mps is
registered for the CPU dispatch key with no executor of its own, so each op takes its route
(bnb_mps.ops.routing: first-use verification of its kernel families on the shader tier, tuning on
the GPU clock with torch's timing events, launch plans, hand-back to bitsandbytes); the shader tier
loads through `torch.mps.compile_shader`, whose library here runs every kernel under the emulator
(`library`), and `torch.mps.Event` and `torch.mps.synchronize` are torch's own Python code over a
model of its C++ runtime (`runtime`), as each supported torch version behaves, deadlocks included
(ModelledDeadlock). CPU tensors stand in for mps ones.

This is a test-side model of what cannot run here (an Apple GPU): it lives in the package, not under
tests/, because the demo's kernel check and `python -m bnb_mps tune|verify` run on it too. Nothing
a Mac user runs enters it.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from . import runtime as _runtime
from .library import ModelledLibrary
from .runtime import VERSIONS, ModelledDeadlock, Runtime, TorchBehaviour

__all__ = ["ModelledDeadlock", "ModelledMPS", "VERSIONS", "use_modelled_mps"]

#: the torch._C functions the model stands in for
_C_FUNCTIONS = ("_has_mps", "_mps_is_available", "_mps_acquireEvent", "_mps_releaseEvent", "_mps_recordEvent",
                "_mps_waitForEvent", "_mps_queryEvent", "_mps_synchronizeEvent", "_mps_elapsedTimeOfEvents",
                "_mps_deviceSynchronize", "_mps_compileShader", "_mps_getCurrentStream")  # fmt: skip
_STREAM_API = ("Stream", "current_stream", "default_stream", "stream", "set_stream")
_active = False


@dataclass
class ModelledMPS:
    """What `use_modelled_mps` yields: the modelled runtime (its counts, command buffers, events) and
    the torch version it behaves as."""

    runtime: Runtime
    behaviour: TorchBehaviour

    @property
    def launched(self) -> list[str]:
        """The kernels encoded so far, in order, across every command buffer."""
        buffers = self.runtime.completed + self.runtime._in_flight
        current = self.runtime.current_stream.current
        return [k for b in buffers + ([current] if current is not None else []) for k in b.kernels]


class _ModelledStream:
    """torch.mps.Stream of torch >= 2.15, as torch/mps/streams.py makes it: a wrapper of a stream id
    (`Stream(stream_id=...)`), a new one at each current_stream()/default_stream() call. No __eq__:
    equality of these wrappers is not modelled (object identity), so code must compare `stream_id`s."""

    def __init__(self, runtime: Runtime, stream_id=None) -> None:
        self._runtime = runtime
        if stream_id is None:  # torch.mps.Stream(): a new stream
            stream = _runtime.Stream(runtime, id(self))
            runtime.streams[stream.number] = stream
            stream_id = stream.number
        self._stream_id = stream_id

    @property
    def stream_id(self) -> int:
        return self._stream_id

    @property
    def _stream(self):  # (the model's stream: tests read its number)
        return self._runtime.streams[self._stream_id]

    def __repr__(self) -> str:
        return f"<torch.mps.Stream stream_id={self.stream_id}>"


@dataclass(frozen=True)
class _CurrentStream:
    """torch._C._mps_getCurrentStream()'s result (torch >= 2.15): the stream's id, 0 for the default."""

    stream_id: int


def _stream_api(rt: Runtime) -> dict:
    # torch/mps/streams.py: current_stream() = Stream(stream_id=torch._C._mps_getCurrentStream().stream_id),
    # default_stream() = Stream(stream_id=0); stream(s) sets s and restores the one current before
    @contextlib.contextmanager
    def stream(s):
        if s is None:
            yield s
            return
        before, rt.current_stream = rt.current_stream, s._stream
        try:
            yield s
        finally:
            rt.current_stream = before

    def set_stream(s) -> None:
        if s is not None:
            rt.current_stream = s._stream

    return {"Stream": lambda: _ModelledStream(rt), "current_stream": lambda: _ModelledStream(rt, rt.current_stream.number),
            "default_stream": lambda: _ModelledStream(rt, 0), "stream": stream,
            "set_stream": set_stream}  # fmt: skip


def _forget_availability() -> None:
    """torch.backends.mps.is_available() keeps its first answer (an lru_cache): forget it."""
    clear = getattr(torch.backends.mps.is_available, "cache_clear", None)
    if clear is not None:
        clear()


@contextlib.contextmanager
def use_modelled_mps(torch_version: str = "2.13") -> Iterator[ModelledMPS]:
    """Serve bitsandbytes ops on CPU tensors through bnb-mps' shader tier over the model of torch
    `torch_version`'s MPS runtime ("2.13", "2.14" or "2.15"; see the package docstring). Not
    re-entrant; not where a real mps device is available."""
    global _active
    behaviour = VERSIONS.get(str(torch_version))
    if behaviour is None:
        raise ValueError(f"torch_version must be one of {', '.join(VERSIONS)}, got {torch_version!r}")
    if _active:
        raise RuntimeError("use_modelled_mps() is already active")
    if getattr(torch._C, "_has_mps", False):
        raise RuntimeError("use_modelled_mps() models torch's MPS runtime where torch has none; this torch has one")
    from .. import executors, registration
    from ..executors import _gpu_common
    from ..ops import routing, tuning

    if "CPU" in registration.registered_keys():
        raise RuntimeError("bnb_mps is registered for the CPU key already (use_emulated_kernels() is active)")
    rt = Runtime(behaviour)
    functions = {
        "_has_mps": True,
        "_mps_is_available": lambda: True,
        "_mps_acquireEvent": rt.acquire_event,
        "_mps_releaseEvent": rt.release_event,
        "_mps_recordEvent": rt.record_event,
        "_mps_waitForEvent": rt.wait_for_event,
        "_mps_queryEvent": rt.query_event,
        "_mps_synchronizeEvent": rt.synchronize_event,
        "_mps_elapsedTimeOfEvents": rt.elapsed_time,
        "_mps_deviceSynchronize": rt.device_synchronize,
        "_mps_compileShader": lambda source: ModelledLibrary(rt, source),
    }
    if behaviour.public_streams:  # (torch >= 2.15: what torch.mps.current_stream() reads, torch/mps/streams.py)
        functions["_mps_getCurrentStream"] = lambda: _CurrentStream(rt.current_stream.number)
    import torch.mps.event as torch_event

    events = weakref.WeakSet()  # torch.mps.Event objects made under the model
    saved_init = torch_event.Event.__init__

    def tracked_init(self, *args, **kwargs):
        saved_init(self, *args, **kwargs)
        events.add(self)

    saved_c = {name: getattr(torch._C, name) for name in _C_FUNCTIONS if hasattr(torch._C, name)}
    saved_mps = {name: getattr(torch.mps, name) for name in _STREAM_API if hasattr(torch.mps, name)}
    saved_version, saved_device = torch.__version__, _gpu_common._tensor_device
    saved_env = os.environ.get(executors.ENV_VAR)
    _active = True
    try:
        for name, value in functions.items():
            setattr(torch._C, name, value)
        torch_event.Event.__init__ = tracked_init
        # The stream API of the modelled version; also where the running torch's own Python layer has one
        # (torch >= 2.15: Event.record() asks it for the current stream, which a CPU build cannot make).
        if behaviour.public_streams or hasattr(torch.mps, "current_stream"):
            for name, value in _stream_api(rt).items():
                setattr(torch.mps, name, value)
        torch.__version__ = type(saved_version)(behaviour.version)  # (torch's TorchVersion, a str)
        _forget_availability()
        _gpu_common._tensor_device = "cpu"
        os.environ[executors.ENV_VAR] = "shader"
        executors.reset()
        routing.forget()
        tuning.reset()
        registration.register("CPU")
        try:
            yield ModelledMPS(rt, behaviour)
        finally:
            registration.unregister("CPU")
    finally:
        torch_event.Event.__init__ = saved_init
        for event in list(events):  # (released now: torch's own release would fail without an MPS backend)
            rt.release_event(event._Event__eventId)
            event._Event__eventId = 0
        for name in _C_FUNCTIONS:
            if name in saved_c:
                setattr(torch._C, name, saved_c[name])
            elif hasattr(torch._C, name):
                delattr(torch._C, name)
        for name in _STREAM_API:
            if name in saved_mps:
                setattr(torch.mps, name, saved_mps[name])
            elif hasattr(torch.mps, name):
                delattr(torch.mps, name)
        torch.__version__ = saved_version
        _forget_availability()
        _gpu_common._tensor_device = saved_device
        if saved_env is None:
            os.environ.pop(executors.ENV_VAR, None)
        else:
            os.environ[executors.ENV_VAR] = saved_env
        executors.reset()
        routing.forget()
        tuning.reset()
        registration.reinstate()
        _active = False
