"""The emulator's memory model (docs/emulator.md, "Memory model"): with `coherence_check=True`, a
read of device memory that another threadgroup of the same dispatch wrote raises CoherenceError
unless the Metal language version the kernel was compiled at makes that write visible. The probe
kernels (kernels/handover.metal) hand partial results to the last threadgroup of a dispatch; which
ordering they carry is chosen by macros, so each ingredient of Metal 3.2's hand-over can be left out
on its own."""

from __future__ import annotations

import pytest
import torch

from bnb_mps import emulator
from bnb_mps.kernel_args import uint32

from emu_support import KERNELS
from extras import profile_compiler

profile_compiler()  # the check runs the instrumented build (a missing clang++ skips, and fails under CI)

GROUPS, THREADS = 6, 64
SOURCE = (KERNELS / "handover.metal").read_text()


def handover(metal_version: str, *, order: str = "forward", check: bool = True, **macros):
    """Runs the hand-over probe; returns (output, expected)."""
    text = "".join(f"#define {k} {v}\n" for k, v in macros.items()) + SOURCE
    lib = emulator.Library(text, name="handover.metal", metal_version=metal_version)
    work = torch.zeros(GROUPS * THREADS)
    counter = torch.zeros(1, dtype=torch.int32)
    out = torch.zeros(THREADS)
    lib.launch("handover", grid=GROUPS, threadgroup=THREADS, args=[work, counter, out], order=order,
               coherence_check=check)
    expected = sum(torch.arange(THREADS, dtype=torch.float64) + g * THREADS for g in range(GROUPS)).float()
    return out, expected


@pytest.mark.parametrize("metal_version", ["3.2", "4.0"])
@pytest.mark.parametrize("order", ["forward", "reverse", "random"])
def test_the_hand_over_of_metal_3_2_passes_with_every_ingredient(metal_version, order):
    out, expected = handover(metal_version, order=order)
    assert torch.equal(out, expected)


def test_below_metal_3_2_no_ordering_makes_another_threadgroups_write_visible():
    with pytest.raises(emulator.CoherenceError) as info:
        handover("3.1")
    e = info.value
    assert isinstance(e, emulator.EmulatorError) and e.kernel == "handover"
    message = str(e)
    assert "kernel 'handover'" in message and "buffer(0)" in message and "Metal 3.1" in message
    # Both threadgroups named: the reader (the last to count, in forward order threadgroup 5) and the
    # writer of byte 0 (threadgroup 0).
    assert f"threadgroup ({GROUPS - 1}, 0, 0) thread 0 reads what threadgroup (0, 0, 0) thread 0 wrote" in message
    assert "byte 0" in message


def test_without_the_check_the_host_hides_the_missing_ordering():
    """Why the check exists: x86 is coherent, so the unordered hand-over gives the right answer here
    and the fault would be invisible to every test."""
    out, expected = handover("3.1", check=False, RELEASE=0, ACQUIRE=0, COHERENT="")
    assert torch.equal(out, expected)


@pytest.mark.parametrize("missing, macros, reason", [
    ("coherent(device)", {"COHERENT": ""}, r"not coherent\(device\)"),
    ("the release fence", {"RELEASE": 0}, "no device-scope release fence"),
    ("the acquire fence", {"ACQUIRE": 0}, "no device-scope acquire fence"),
    ("both fences", {"RELEASE": 0, "ACQUIRE": 0}, "no device-scope release fence"),
    ("release in every writer (thread 0 only)", {"RELEASE": 2}, "no device-scope release fence"),
    ("acquire in every reader (thread 0 only)", {"ACQUIRE": 2}, "no device-scope acquire fence"),
    ("the barrier before the count", {"BARRIER": 0}, "no device-scope release fence"),
])  # fmt: skip
@pytest.mark.parametrize("metal_version", ["3.2", "4.0"])
def test_each_ingredient_of_the_hand_over_is_needed(missing, macros, reason, metal_version):
    with pytest.raises(emulator.CoherenceError, match=reason):
        handover(metal_version, **macros)


def test_reads_of_ones_own_threadgroup_and_of_an_earlier_dispatch_are_not_checked():
    lib = emulator.Library(SOURCE, name="handover.metal", metal_version="3.1")
    work, out = torch.zeros(GROUPS * THREADS), torch.zeros(GROUPS * THREADS)
    lib.launch("own_slot", grid=GROUPS, threadgroup=THREADS, args=[work, out], coherence_check=True, order="random")
    idx = torch.arange(GROUPS * THREADS)
    assert torch.equal(out, (idx // THREADS * THREADS + THREADS - 1 - idx % THREADS).float())
    total = torch.zeros(THREADS)
    lib.launch("sum_slots", grid=1, threadgroup=THREADS, args=[work, total, uint32(GROUPS)], coherence_check=True)
    assert torch.equal(total, work.view(GROUPS, THREADS).sum(0))


@pytest.mark.parametrize("metal_version, number", [("3.1", 310), ("3.2", 320), ("4.0", 400)])
def test_the_library_compiles_at_the_language_version_it_is_given(metal_version, number):
    lib = emulator.Library(SOURCE, name="handover.metal", metal_version=metal_version)
    out = torch.zeros(1, dtype=torch.int32)
    lib.launch("metal_version", grid=1, threadgroup=1, args=[out])
    assert lib.metal_version == metal_version and int(out) == number


def test_an_unknown_language_version_is_refused():
    with pytest.raises(ValueError, match="metal_version"):
        emulator.Library(SOURCE, metal_version="3.0")
