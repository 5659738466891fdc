"""The `emulated` executor: the project's kernels (bnb_mps.msl.source) run by the Metal-on-CPU
emulator (bnb_mps.emulator). Used by the tests on every OS; selectable for debugging with
BNB_MPS_EXECUTOR=emulated. Tensors must be CPU tensors (the op layer's CPU-key path).

Detection settings apply to every launch of the process-wide executor; tests change them with

    with bnb_mps.executors.emulated.settings(order="reverse", race_check=True, poison=0x00):
        ...

`float_mode` is the emulated GPU's float arithmetic: None (the default: $BNB_MPS_EMU_FLOAT, else
"apple", float32 subnormals flushed to zero as on Apple GPUs) or "ieee" (bnb_mps.emulator.Library.launch).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

from .base import Dim3, ExecutorUnavailable, KernelArg


class EmulatedExecutor:
    name = "emulated"
    device_type = "cpu"  # where its tensors live (other devices' are staged: executors.StagedExecutor)

    def __init__(self) -> None:
        self.order = "forward"
        self.race_check = False
        self.poison = 0xFF
        self.seed = 0
        self.float_mode: str | None = None
        self._library = None
        self._text: str | None = None  # the source the library was compiled from
        self._lock = threading.Lock()

    def _load(self):
        """Compiles the kernel source (once per source text: BNB_MPS_KERNEL_DIR may point elsewhere
        later in the process); a missing source is reported at launch."""
        from .. import emulator
        from ..msl import source as kernel_source

        try:
            text = kernel_source.source()
        except (FileNotFoundError, ValueError) as e:
            raise emulator.KernelError(f"no kernel source to run: {e}") from None
        with self._lock:
            if self._library is None or self._text is not text:
                self._library = emulator.Library(text, name="bnb_mps kernels")
                self._text = text
            return self._library

    def launch(self, kernel: str, *, grid: Dim3, threadgroup: Dim3, args: Sequence[KernelArg]) -> None:
        self._load().launch(kernel, grid=tuple(grid), threadgroup=tuple(threadgroup), args=args, order=self.order,
                            race_check=self.race_check, poison=self.poison, seed=self.seed,
                                float_mode=self.float_mode)

    def profile(self, kernel: str, *, grid: Dim3, threadgroup: Dim3, args: Sequence[KernelArg],
                required_bytes: int | None = None):
        """Runs the kernel as `launch` does (same effect on the tensors) under the emulator's
        profiler and returns its memory traffic (a bnb_mps.emulator.KernelProfile)."""
        return self._load().profile(kernel, grid=tuple(grid), threadgroup=tuple(threadgroup), args=args,
                                    order=self.order, race_check=self.race_check, poison=self.poison, seed=self.seed,
                                    float_mode=self.float_mode, required_bytes=required_bytes)


_executor: EmulatedExecutor | None = None
_lock = threading.Lock()


def load() -> EmulatedExecutor:
    """The process-wide emulated executor (its kernels compile on first use)."""
    global _executor
    from ..emulator import EmulatorError
    from ..emulator.library import _runtime

    try:
        _runtime()
    except EmulatorError as e:
        raise ExecutorUnavailable(str(e)) from None
    with _lock:
        if _executor is None:
            _executor = EmulatedExecutor()
        return _executor


@contextlib.contextmanager
def settings(*, order: str | None = None, race_check: bool | None = None, poison: int | None = None,
             seed: int | None = None, float_mode: str | None = None) -> Iterator[EmulatedExecutor]:
    """Temporarily changes the detection settings (and the float mode) of the process-wide executor."""
    from ..emulator.library import FLOAT_MODES

    if order is not None and order not in ("forward", "reverse", "random"):
        raise ValueError(f"order must be 'forward', 'reverse' or 'random', got {order!r}")
    if poison is not None and not (isinstance(poison, int) and 0 <= poison <= 255):
        raise ValueError(f"poison must be a byte value 0..255, got {poison!r}")
    if float_mode is not None and float_mode not in FLOAT_MODES:
        raise ValueError(f"float_mode must be 'apple' or 'ieee', got {float_mode!r}")
    ex = load()
    saved = (ex.order, ex.race_check, ex.poison, ex.seed, ex.float_mode)
    if order is not None:
        ex.order = order
    if race_check is not None:
        ex.race_check = bool(race_check)
    if poison is not None:
        ex.poison = poison
    if seed is not None:
        ex.seed = int(seed)
    if float_mode is not None:
        ex.float_mode = float_mode
    try:
        yield ex
    finally:
        ex.order, ex.race_check, ex.poison, ex.seed, ex.float_mode = saved
