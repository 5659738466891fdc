"""Running a kernel under every detection setting and demanding the same bits each time.

A missing threadgroup_barrier or a race makes the output depend on the order in which threads
run; a read of uninitialised threadgroup memory makes it depend on the poison byte. `run_checked`
runs the dispatch on private copies of the tensor arguments under several (order, poison)
settings, plus once with the race checker and once with the coherence check (a read of what another
threadgroup of the dispatch wrote, where the library's Metal version does not make it visible:
CoherenceError; docs/emulator.md, "Memory model"), compares every tensor bit for bit, and finally
copies the first run's results into the caller's tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import EmulatorError

#: (order, poison, seed) settings run by `run_checked`.
SETTINGS = (("forward", 0xFF, 0), ("reverse", 0x00, 0), ("random", 0xA5, 1), ("random", 0x5A, 2))


class NondeterministicOutput(EmulatorError):
    """The same dispatch produced different bits under different lane orders or poison bytes."""

    kind = 11


def _bits(t):
    import torch

    t = t.detach().contiguous().reshape(-1)  # (a 0-dim tensor has no byte view)
    return t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)


def run_checked(library, kernel: str, *, threadgroup, args: Sequence[object], grid=None, threads=None,
                race_check: bool = True, settings=SETTINGS, coherence_check: bool | None = None) -> None:
    """`coherence_check`: None runs the coherence-checked launch wherever the instrumented build can
    be made (a profiling clang, bnb_mps.emulator.build); True demands it, False leaves it out."""
    import torch

    from . import build

    results = []
    for order, poison, seed in settings:
        copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        library.launch(kernel, grid=grid, threads=threads, threadgroup=threadgroup, args=copies, order=order,
                       poison=poison, seed=seed)
        results.append(((order, poison, seed), copies))
    if race_check:
        copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        library.launch(kernel, grid=grid, threads=threads, threadgroup=threadgroup, args=copies, race_check=True)
    if coherence_check is None:
        coherence_check = build.can_find_profile_compiler()
    if coherence_check:
        copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        library.launch(kernel, grid=grid, threads=threads, threadgroup=threadgroup, args=copies, order="random",
                       seed=3, coherence_check=True)
        results.append((("random", 0xFF, 3), copies))
    (s0, first) = results[0]
    for (s, other) in results[1:]:
        for i, (a, b) in enumerate(zip(first, other)):
            if not isinstance(a, torch.Tensor):
                continue
            x, y = _bits(a), _bits(b)
            if not torch.equal(x, y):
                where = int((x != y).nonzero()[0, 0]) // max(1, a.element_size())
                raise NondeterministicOutput(
                    f"kernel '{kernel}': buffer({i}) differs between order={s0[0]}, poison=0x{s0[1]:02X} and "
                    f"order={s[0]}, poison=0x{s[1]:02X} (first at element {where}): a missing threadgroup_barrier, "
                    f"a race, or a read of uninitialised threadgroup memory",
                    kernel=kernel,
                )
    for a, r in zip(args, first):
        if isinstance(a, torch.Tensor):
            a.copy_(r)
