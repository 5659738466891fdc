"""The `emulated` executor: the project's kernels (bnb_mps.msl.source) run by the Metal-on-CPU
emulator (bnb_mps.emulator). Used by the tests on every OS; selectable for debugging with
BNB_MPS_EXECUTOR=emulated. Tensors must be CPU tensors (the op layer's CPU-key path).

Each compile unit (`bnb_mps.msl.source.units()`, one per `.metal` file) is one emulator Library,
compiled on first use (`UnitLibraries`; units not yet compiled in this process are compiled side by
side, one per CPU core, each a load from the emulator's on-disk module cache where that holds it).
A unit that does not compile makes only its own kernels unavailable: their launches raise
bnb_mps.executors.base.KernelUnavailable with the compiler's message, the other units' kernels run.

Detection settings apply to every launch of the process-wide executor; tests change them with

    with bnb_mps.executors.emulated.settings(order="reverse", race_check=True, poison=0x00):
        ...

`float_mode` is the emulated GPU's float arithmetic: None (the default: $BNB_MPS_EMU_FLOAT, else
"apple", float32 subnormals flushed to zero as on Apple GPUs) or "ieee" (bnb_mps.emulator.Library.launch).

`metal_version` is the Metal language version the units compile at ("3.1", the default, "3.2" or
"4.0"; the executor's `language_version` says it to the op layer as (major, minor)), and
`coherence_check` runs every launch with the emulator's memory-model check (a threadgroup reading
what another threadgroup of the dispatch wrote, where that version does not make it visible, raises
bnb_mps.emulator.CoherenceError).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator, Mapping, Sequence

from .base import CompileUnits, Dim3, ExecutorUnavailable, KernelArg


class UnitLibraries:
    """The project's kernels under the emulator, one emulator Library per compile unit, used as one
    library of all kernels: `launch`, `profile`, `kernels` and `in` dispatch by kernel name to the
    unit that defines it (as `bnb_mps.emulator.Library` does for one source). A kernel of a unit that
    did not compile raises KernelUnavailable; a kernel of no unit, the emulator's KernelError."""

    name = "bnb_mps kernels"

    def __init__(self, units: CompileUnits) -> None:
        self.units = units
        self.failures: dict[str, str] = units.failures  # unit -> the compiler's message

    def library(self, kernel: str):
        """The unit Library that holds `kernel`."""
        try:
            return self.units.library_of(kernel)
        except KeyError:
            pass
        unavailable = self.units.unavailable(kernel)
        if unavailable is not None:
            raise unavailable
        from ..emulator import KernelError

        names = self.kernels
        shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
        raise KernelError(f"kernel '{kernel}' is not in {self.name} (kernels: {shown or 'none'})", kernel=kernel)

    def launch(self, kernel: str, **kwargs) -> None:
        """`bnb_mps.emulator.Library.launch` of the unit that defines `kernel`."""
        self.library(kernel).launch(kernel, **kwargs)

    def profile(self, kernel: str, **kwargs):
        """`bnb_mps.emulator.Library.profile` of the unit that defines `kernel`."""
        return self.library(kernel).profile(kernel, **kwargs)

    @property
    def kernels(self) -> list[str]:
        """Every kernel of the units that compiled, sorted."""
        return self.units.kernels()

    def __contains__(self, kernel: str) -> bool:
        return kernel in self.units.unit_of


_compiled: dict[tuple[str, str], object] = {}  # (unit text, Metal version) -> its Library, or its CompileError
_compiled_lock = threading.Lock()
_compile_lock = threading.Lock()


def compile_unit(name: str, text: str, metal_version: str = "3.1"):
    """The emulator Library of one compile unit's text (`name`: the unit, for messages) at a Metal
    language version, compiled once per process: a text that did not compile raises its CompileError
    (or PrepassError) again."""
    from .. import emulator

    key = (text, metal_version)
    with _compiled_lock:
        found = _compiled.get(key)
    if found is None:
        try:
            found = emulator.Library(text, name=f"{name}.metal", metal_version=metal_version)
        except (emulator.CompileError, emulator.PrepassError) as e:
            found = e
        with _compiled_lock:
            found = _compiled.setdefault(key, found)
    if isinstance(found, Exception):
        raise found
    return found


def unit_libraries(units: Mapping[str, str] | None = None, metal_version: str = "3.1") -> UnitLibraries:
    """The emulator Libraries of `units` ({name: text}; default: `bnb_mps.msl.source.units()`) at a
    Metal language version.
    Each unit text is compiled once per process (`compile_unit`; its module is also cached on disk by
    the emulator), so the executor and the tests share them, and pointing BNB_MPS_KERNEL_DIR at a
    copy with one changed file compiles that file's unit only. Units not compiled yet are compiled
    side by side, one per CPU core."""
    from .. import emulator
    from ..msl import source as kernel_source

    if units is None:
        units = kernel_source.units()
    with _compile_lock:
        missing = sum((text, metal_version) not in _compiled for text in units.values())
        compile = functools.partial(compile_unit, metal_version=metal_version)
        return UnitLibraries(CompileUnits.compile(units, compile, lambda lib: lib.kernels,
                                                  (emulator.CompileError, emulator.PrepassError),
                                                  workers=min(missing, os.cpu_count() or 1)))  # fmt: skip


class EmulatedExecutor:
    name = "emulated"
    device_type = "cpu"  # where its tensors live (other devices' are staged: executors.StagedExecutor)

    def __init__(self) -> None:
        self.order = "forward"
        self.race_check = False
        self.poison = 0xFF
        self.seed = 0
        self.float_mode: str | None = None
        self.metal_version = "3.1"
        self.coherence_check = False
        self._library: UnitLibraries | None = None
        self._key = None  # the unit texts and Metal version the library was compiled from
        self._lock = threading.Lock()

    @property
    def language_version(self) -> tuple[int, int]:
        """The Metal language version the kernels are compiled at, (major, minor)."""
        major, minor = self.metal_version.split(".")
        return int(major), int(minor)

    @property
    def unit_failures(self) -> dict[str, str]:
        """The compile units that did not compile, with the compiler's message (known once the
        units were compiled, at the first launch)."""
        return dict(self._library.units.failures) if self._library is not None else {}

    def _load(self) -> UnitLibraries:
        """Compiles the kernel source's units (once per source: BNB_MPS_KERNEL_DIR may point
        elsewhere later in the process); a missing source is reported at launch."""
        from .. import emulator
        from ..msl import source as kernel_source

        try:
            units = kernel_source.units()
        except (FileNotFoundError, ValueError) as e:
            raise emulator.KernelError(f"no kernel source to run: {e}") from None
        with self._lock:
            key = (units, self.metal_version)
            if self._library is None or self._key is None or self._key[0] is not units or self._key[1] != key[1]:
                self._library = unit_libraries(units, self.metal_version)
                self._key = key
            return self._library

    def launch(self, kernel: str, *, grid: Dim3, threadgroup: Dim3, args: Sequence[KernelArg]) -> None:
        self._load().launch(kernel, grid=tuple(grid), threadgroup=tuple(threadgroup), args=args, order=self.order,
                            race_check=self.race_check, poison=self.poison, seed=self.seed, float_mode=self.float_mode,
                            coherence_check=self.coherence_check)

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
             seed: int | None = None, float_mode: str | None = None, metal_version: str | None = None,
             coherence_check: bool | None = None) -> Iterator[EmulatedExecutor]:
    """Temporarily changes the detection settings (and the float mode, the Metal language version)
    of the process-wide executor."""
    from ..emulator.library import FLOAT_MODES, METAL_VERSIONS

    if order is not None and order not in ("forward", "reverse", "random"):
        raise ValueError(f"order must be 'forward', 'reverse' or 'random', got {order!r}")
    if poison is not None and not (isinstance(poison, int) and 0 <= poison <= 255):
        raise ValueError(f"poison must be a byte value 0..255, got {poison!r}")
    if float_mode is not None and float_mode not in FLOAT_MODES:
        raise ValueError(f"float_mode must be 'apple' or 'ieee', got {float_mode!r}")
    if metal_version is not None and metal_version not in METAL_VERSIONS:
        raise ValueError(f"metal_version must be one of {sorted(METAL_VERSIONS)}, got {metal_version!r}")
    ex = load()
    saved = (ex.order, ex.race_check, ex.poison, ex.seed, ex.float_mode, ex.metal_version, ex.coherence_check)
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
    # Another language version means other kernels (and routes): what the op layer bound to this tier's
    # kernels is dropped with the tier choice (bnb_mps.executors.reset), on the way in and out.
    from . import reset

    changed = metal_version is not None and metal_version != ex.metal_version
    if metal_version is not None:
        ex.metal_version = metal_version
    if coherence_check is not None:
        ex.coherence_check = bool(coherence_check)
    if changed:
        reset()
    try:
        yield ex
    finally:
        ex.order, ex.race_check, ex.poison, ex.seed, ex.float_mode, ex.metal_version, ex.coherence_check = saved
        if changed:
            reset()
