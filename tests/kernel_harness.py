"""Executors the kernel tests run the op layer's launchers on: the emulator with the checks a GPU
cannot give (lane orders, race checking, poisoned threadgroup memory), and one that must never be
asked to launch. The kernel library itself is the session fixture `library` (tests/conftest.py)."""

from __future__ import annotations

import torch

from bnb_mps import emulator


class EmulatedExecutor:
    """The Executor protocol over an emulator library.

    By default every launch runs once, in the given lane order with the given race checking and
    poison byte. With `checked=True` every launch runs under forward, reverse and random lane
    orders with different poison bytes plus once with the race checker, and must give the same
    bits every time (bnb_mps.emulator.run_checked, the coherence check included). `float_mode`
    ("apple" or "ieee") runs unchecked launches in that float mode. `coherence_check=True` runs every
    unchecked launch once more, on copies of its tensors, under the emulator's coherence check
    (bnb_mps.emulator.CoherenceError, docs/emulator.md "Memory model"). `launches` lists the kernels
    launched."""

    name = "emulated"

    def __init__(self, lib, order="forward", race_check=False, poison=0xFF, seed=0, *, checked=False, float_mode=None,
                 language_version=(3, 1), coherence_check=False):  # fmt: skip
        self.lib, self.order, self.race_check, self.poison, self.seed = lib, order, race_check, poison, seed
        #: the Metal language version `lib` was compiled at (the session's `library`: the emulator's default)
        self.language_version = language_version
        self.checked = checked
        self.coherence_check = coherence_check
        self.float_mode = float_mode  # "apple", "ieee", or None: the emulator's default (bnb_mps.emulator.Library.launch)
        self.launches: list[str] = []

    @property
    def launched(self) -> list[str]:
        return self.launches

    def launch(self, kernel, *, grid, threadgroup, args):
        self.launches.append(kernel)
        if self.checked:
            if self.float_mode is not None:
                raise ValueError("checked launches run in the emulator's default float mode")
            emulator.run_checked(self.lib, kernel, grid=grid, threadgroup=threadgroup, args=args)
        else:
            if self.coherence_check:
                copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
                self.lib.launch(kernel, grid=grid, threadgroup=threadgroup, args=copies, order="random",
                                seed=self.seed, float_mode=self.float_mode, coherence_check=True)  # fmt: skip
            self.lib.launch(kernel, grid=grid, threadgroup=threadgroup, args=args, order=self.order,
                            race_check=self.race_check, poison=self.poison, seed=self.seed,
                            float_mode=self.float_mode)  # fmt: skip


class NoLaunch:
    """An executor for calls that must launch nothing (empty tensors)."""

    name = "emulated"

    def launch(self, kernel, **_):
        raise AssertionError(f"launched {kernel} for an empty tensor")
