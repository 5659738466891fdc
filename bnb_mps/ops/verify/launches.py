"""What verification puts between the op layer and the tier's executor (`Recorder`): it counts the
launches and the bytes they bind, tells the executor's errors from the op layer's (`LaunchFailed`),
and where the executor reports the status of the GPU's command buffers (the native tier:
`watch_command_buffers()`), has the buffer of every launch watched (each launch is given the watch),
to read after the synchronisation whether the device ran them (`device_errors()`)."""

from __future__ import annotations

import torch


class LaunchFailed(Exception):
    """The executor raised in a launch (carries what it raised)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class Recorder:
    """An executor for the op layer that forwards every launch to `inner` (see the module docstring)."""

    def __init__(self, inner) -> None:
        from ..plan import language_version_of

        self.inner, self.name = inner, inner.name
        self.language_version = language_version_of(inner)  # (the kernels the op layer may launch)
        self.launches = self.bytes = 0
        watch = getattr(inner, "watch_command_buffers", None)
        self._watch = watch() if watch is not None else None  # (None: the tier does not report them)

    def launch(self, kernel, *, grid, threadgroup, args) -> None:
        from ...executors import PipelineLimitError

        # (watched: the command buffer that holds this launch, its handler attached by the launch)
        watched = {} if self._watch is None else {"watch": self._watch}
        try:
            self.inner.launch(kernel, grid=grid, threadgroup=threadgroup, args=args, **watched)
        except Exception as e:
            if not isinstance(e, PipelineLimitError):  # (a refused launch did not run)
                self._count(args)
            raise LaunchFailed(e) from e
        self._count(args)

    def _count(self, args) -> None:
        self.launches += 1
        self.bytes += sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))

    def device_errors(self) -> list[str]:
        """After the synchronisation: the errors of the watched command buffers (Metal's text), if any."""
        return list(dict.fromkeys(self._watch.errors())) if self._watch is not None else []


def cannot_run(e: BaseException) -> bool:
    """Whether a launch error says the tier cannot run kernels here at all (no C++ compiler for the
    emulator, the emulator runtime or the tier missing, out of memory), as opposed to a fault of
    the kernels (an emulator fault, kernel source that does not compile, a GPU tier's error), which
    fails the family for good."""
    from ... import emulator
    from ...emulator import build
    from ...executors import ExecutorUnavailable, KernelUnavailable

    if isinstance(e, KernelUnavailable) and e.__cause__ is not None:  # its compile unit's own error
        e = e.__cause__
    if isinstance(e, emulator.CompileError):
        try:
            build.compiler_identity(build.find_compiler())
        except emulator.CompileError:
            return True  # no compiler that runs: nothing was compiled
        return False
    return isinstance(e, (ExecutorUnavailable, ImportError, OSError, MemoryError))
