"""A model of the part of torch's MPS runtime that bnb-mps uses: the default stream's command
buffers, timing events, `torch.mps.synchronize()`, per torch version. Written from torch's sources:
aten/src/ATen/mps/MPSEvent.mm and MPSEvent.h (the events and their pool), MPSStream.mm (commit,
commit-and-wait), MPSHooks.mm (`recordEvent` commits: syncEvent = true) and torch/mps/ (the Python
layer, which runs unchanged on top of this model: the model replaces the `torch._C._mps_*` functions
it calls).

How the modelled GPU runs work. CPU tensors stand in for mps ones and the emulator runs each kernel
when it is encoded, so its results are in the tensors at once (reading an mps tensor on a Mac waits
for the GPU: no reader can see the difference). What is asynchronous is everything that reports
completion: a committed command buffer completes, its events are signalled and their listeners
called, only when the host waits for the GPU (`torch.mps.synchronize()`, an event's
`synchronize()`, `elapsed_time`). So the GPU is never done by the host's next step, as with any real
batch on a Mac, and a sequence that deadlocks when the host gets there first deadlocks here every
time.

The modelled GPU clock: a timing event is stamped with the time at the end of the command buffer that
signals it (torch >= 2.15: that buffer's GPUEndTime, MPSEvent.mm; before, the host's time when the
shared-event listener runs, modelled with no delivery latency). By default that time is the host's
when the buffer is committed (the work before it ran while it was encoded, under the emulator). With
`Runtime.kernel_ns` set (a test sets it: kernel name -> ns) the clock is deterministic instead: the GPU
runs the command buffers back to back, each taking `BUFFER_NS` plus `kernel_ns(name)` per kernel that
ran in it, so a batch's elapsed_time is the sum of the modelled costs of the work between its events
(torch's own ops, which run on the host here, cost nothing on it).

A command buffer that faulted (a kernel's memory fault) stops there: the event signals encoded after
the fault never happen (Metal runs nothing of a failed buffer after its error), so an event recorded
into it never completes, `query()` stays False, and a wait for it (`elapsed_time` waits in
MPSEvent::waitForCpuSync with no timeout on torch 2.13 and 2.14) never returns: ModelledDeadlock.

The event deadlock (pytorch#162872), torch 2.13 and 2.14: `record()` on a timing event registers a
shared-event listener that stamps the completion time and sets `m_cpu_sync_completed`, one bool;
`synchronize()` before the GPU is done registers a second listener and waits for the bool, then
clears it; `elapsed_time()` commits and waits for the stream, then waits for the bool again: both
listeners have run, the bool is clear, and it waits forever (holding the GIL). The model raises
ModelledDeadlock there. From 2.15 the event's completion is a count, not a bool (and its time the GPU
end time of the command buffer that signalled it): no deadlock.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional


#: modelled GPU time of one command buffer (its scheduling), on the deterministic clock
BUFFER_NS = 2_000


class ModelledDeadlock(BaseException):
    """Where torch's MPS runtime would wait forever. A BaseException, as the hang it stands for
    cannot be caught: no `except Exception` of the code under test hides it."""


@dataclass(frozen=True)
class TorchBehaviour:
    """What differs between the torch versions the model covers (read in each version's sources,
    headers and binaries)."""

    version: str
    #: MPSEvent::m_cpu_sync_completed is a bool consumed by each wait: the double-listener deadlock
    event_sync_is_a_bool: bool
    #: public streams (torch.mps.Stream, torch.mps.stream(), current_stream, default_stream);
    #: Event.record() raises NotImplementedError off the default stream
    public_streams: bool
    #: torch.mps.synchronize() raises an earlier command buffer's error (once)
    synchronize_raises_buffer_errors: bool
    # (torch._int_mm on mps from 2.15 needs no field: bnb-mps reads torch.__version__, which the model sets)


VERSIONS = {
    "2.13": TorchBehaviour("2.13.0", True, False, False),
    "2.14": TorchBehaviour("2.14.1", True, False, False),
    "2.15": TorchBehaviour("2.15.0", False, True, True),
}


@dataclass
class CommandBuffer:
    number: int
    work_ns: int = BUFFER_NS  # modelled GPU time of its work: BUFFER_NS plus each kernel's (kernel_ns set)
    end_ns: int = 0  # the modelled GPU end, set at commit (see the module docstring)
    committed: bool = False
    completed: bool = False
    error: Optional[str] = None  # Metal's error text of a buffer that faulted
    signals: list = field(default_factory=list)  # (event, value) in encoding order
    kernels: list = field(default_factory=list)  # names of the kernels encoded into it


class Event:
    """MPSEvent: a shared event, its signal counter, its listeners and its CPU-sync flag."""

    def __init__(self, runtime: "Runtime", event_id: int, enable_timing: bool, stream: "Stream") -> None:
        self.runtime, self.id, self.enable_timing, self.stream = runtime, event_id, enable_timing, stream
        self.signal_counter = 0  # m_signalCounter
        self.signaled_value = 0  # m_event.signaledValue
        self.listeners: list[tuple[int, Callable[[int], None]]] = []  # (value, block(time ns))
        self.completion_ns = 0  # m_completion_time
        self.cpu_sync_completed = 0  # m_cpu_sync_completed: a bool before 2.15 (0 or 1), a count after

    # MPSEvent::notifyLocked: a listener at the current counter, unless the event was signalled already
    def _notify(self) -> bool:
        if self.signaled_value >= self.signal_counter:
            return False
        self.listeners.append((self.signal_counter, self._stamp))
        return True

    def _stamp(self, ns: int) -> None:  # the listener block: completion time, then notifyCpuSync()
        self.completion_ns = ns
        if self.runtime.behaviour.event_sync_is_a_bool:
            self.cpu_sync_completed = 1
        else:
            self.cpu_sync_completed += 1

    def wait_for_cpu_sync(self) -> None:  # MPSEvent::waitForCpuSync
        if not self.cpu_sync_completed and self.signaled_value < self.signal_counter:
            raise ModelledDeadlock(
                f"torch {self.runtime.behaviour.version}: MPSEvent {self.id} waits for a signal that was recorded "
                "into a command buffer that failed, so it never comes (the wait has no timeout); the process "
                "would hang here forever"
            )
        if not self.cpu_sync_completed:
            raise ModelledDeadlock(
                f"torch {self.runtime.behaviour.version}: MPSEvent {self.id} waits for a CPU sync that every "
                "listener already delivered and a wait already consumed (an Event.synchronize() before "
                "elapsed_time(): pytorch#162872); the process would hang here forever"
            )
        if self.runtime.behaviour.event_sync_is_a_bool:
            self.cpu_sync_completed = 0
        else:
            self.cpu_sync_completed -= 1

    def signal(self, value: int, ns: int) -> None:
        self.signaled_value = max(self.signaled_value, value)
        due = [block for v, block in self.listeners if v <= value]
        self.listeners = [(v, block) for v, block in self.listeners if v > value]
        for block in due:
            block(ns)


class Stream:
    def __init__(self, runtime: "Runtime", number: int) -> None:
        self.runtime, self.number = runtime, number
        self.current: Optional[CommandBuffer] = None

    def command_buffer(self) -> CommandBuffer:
        if self.current is None:
            self.current = CommandBuffer(next(self.runtime._buffer_numbers))
        return self.current

    def commit(self) -> None:  # SyncType::COMMIT
        buffer, self.current = self.current, None
        if buffer is not None:
            if self.runtime.kernel_ns is None:
                self.runtime.gpu_ns = time.perf_counter_ns()
            else:  # (back to back, in commit order)
                self.runtime.gpu_ns += buffer.work_ns
            buffer.committed, buffer.end_ns = True, self.runtime.gpu_ns
            self.runtime._in_flight.append(buffer)


class Runtime:
    """One modelled device: its streams, command buffers in flight, events. Thread-safe as torch's
    (one lock, as the stream's serial queue)."""

    def __init__(self, behaviour: TorchBehaviour) -> None:
        self.behaviour = behaviour
        self.lock = threading.RLock()
        self._buffer_numbers = itertools.count(1)
        self._event_ids = itertools.count(1)
        self.default_stream = Stream(self, 0)
        self.current_stream = self.default_stream
        self._in_flight: list[CommandBuffer] = []
        self.completed: list[CommandBuffer] = []
        self._unreported_errors: list[str] = []
        self.events: dict[int, Event] = {}
        self.streams: dict[int, Stream] = {0: self.default_stream}  # stream_id -> stream
        self.gpu_ns = 1_000_000_000  # the modelled GPU clock (see the module docstring)
        self.kernel_ns: Optional[Callable[[str], int]] = None  # (None: the host's clock)
        self.counts = {"synchronize": 0, "event_synchronize": 0, "elapsed_time": 0, "record": 0, "kernels": 0,
                       "events": 0}

    # -- the GPU --------------------------------------------------------------------------------------

    def encode_kernel(self, name: str, run: Callable[[], Optional[str]]) -> None:
        """A kernel encoded on the current stream: `run()` executes it under the emulator and returns
        Metal's error text where the GPU would fault (the command buffer then completes with an error)."""
        with self.lock:
            buffer = self.current_stream.command_buffer()
            buffer.kernels.append(name)
            self.counts["kernels"] += 1
            if buffer.error is not None:
                return  # (a failed buffer runs nothing after its fault)
            error = run()
            if self.kernel_ns is not None:
                buffer.work_ns += int(self.kernel_ns(name))
            if error is not None:
                buffer.error = error

    def complete_in_flight(self) -> None:
        """The GPU finishes every committed command buffer, in order: its events are signalled and their
        listeners called with the signal's time."""
        while self._in_flight:
            buffer = self._in_flight.pop(0)
            if buffer.error is None:  # (a failed buffer signals nothing: see the module docstring)
                for event, value in buffer.signals:
                    event.signal(value, buffer.end_ns)
            buffer.completed = True
            self.completed.append(buffer)
            if buffer.error is not None:
                self._unreported_errors.append(buffer.error)

    def commit_and_wait(self, stream: Optional[Stream] = None) -> None:  # SyncType::COMMIT_AND_WAIT
        (stream or self.current_stream).commit()
        self.complete_in_flight()

    # -- torch._C._mps_* --------------------------------------------------------------------------------

    def device_synchronize(self) -> None:  # torch.mps.synchronize()
        with self.lock:
            self.counts["synchronize"] += 1
            self.commit_and_wait()
            if self.behaviour.synchronize_raises_buffer_errors and self._unreported_errors:
                error, self._unreported_errors = self._unreported_errors[0], []
                raise RuntimeError(f"Command buffer execution failed: {error}")

    def acquire_event(self, enable_timing: bool) -> int:
        with self.lock:
            self.counts["events"] += 1
            event_id = next(self._event_ids)
            self.events[event_id] = Event(self, event_id, bool(enable_timing), self.default_stream)
            return event_id

    def release_event(self, event_id: int) -> None:
        with self.lock:
            self.events.pop(event_id, None)

    def _event(self, event_id: int) -> Event:
        found = self.events.get(event_id)
        if found is None:
            raise RuntimeError(f"Invalid Event ID: {event_id}")
        return found

    def record_event(self, event_id: int) -> None:  # MPSEvent::recordLocked(syncEvent = true)
        with self.lock:
            event = self._event(event_id)
            if self.behaviour.public_streams and self.current_stream is not self.default_stream:
                raise NotImplementedError("MPS Event.record() is only supported on the default stream")
            self.counts["record"] += 1
            event.signal_counter += 1
            if event.enable_timing:
                event._notify()
            stream = self.current_stream
            stream.command_buffer().signals.append((event, event.signal_counter))
            stream.commit()

    def wait_for_event(self, event_id: int) -> None:  # the GPU waits: nothing for the host to do here
        with self.lock:
            self._event(event_id)

    def query_event(self, event_id: int) -> bool:
        with self.lock:
            event = self._event(event_id)
            return bool(event.signal_counter) and event.signaled_value >= event.signal_counter

    def synchronize_event(self, event_id: int) -> None:  # MPSEvent::synchronize
        with self.lock:
            self.counts["event_synchronize"] += 1
            event = self._event(event_id)
            if event._notify():
                self.complete_in_flight()  # (the GPU gets there; the host wakes after every listener ran)
                event.wait_for_cpu_sync()

    def elapsed_time(self, start_id: int, end_id: int) -> float:  # MPSEventPool::elapsedTime
        with self.lock:
            self.counts["elapsed_time"] += 1
            self.commit_and_wait(self.default_stream)
            start, end = self._event(start_id), self._event(end_id)
            end.wait_for_cpu_sync()
            if not (start.completion_ns > 0 and end.completion_ns > 0):
                raise RuntimeError("Events were not created with argument 'enable_timing=True'")
            if not end.completion_ns > start.completion_ns:
                raise RuntimeError(f"End event {end_id} was not recorded after start event {start_id}")
            return (end.completion_ns - start.completion_ns) * 1e-6
