"""A family's verdict: what its verification found, as the routing, the cache and `python -m bnb_mps verify` read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Verdict:
    """The outcome of one family's verification on one tier."""

    family: str
    passed: bool
    seconds: float  # wall time of its runs (of the runs that made it, when read from the cache)
    case: Optional[str] = None  # the first case that failed
    error: Optional[str] = None  # what was wrong in it, and by how much
    launches: int = 0  # kernel launches the verification made
    bytes: int = 0  # bytes of the buffers those launches bound
    cached: bool = False  # read from the on-disk cache instead of run in this process
    # Cases not run because the tier refused a launch (PipelineLimitError): "case: why".
    skipped: tuple[str, ...] = ()
    # The verification could not run (not a wrong result): failed in this process, never cached.
    could_not_run: bool = False
    # The device reported an error while it ran the launches (a command buffer's status, a failed
    # synchronisation): a GPU fault, not a verdict on the kernels (could_not_run as well).
    device_error: bool = False
    # A family that did not pass its first run runs a second time, in a fresh command buffer: what
    # the first run found (`describe()` of it). A GPU fault passes the second time; a kernel bug fails twice.
    first_failure: Optional[str] = None

    def describe(self) -> str:
        if self.passed:
            text = "passed"
            if self.first_failure:
                text += f" on its second run, in a fresh command buffer (its first run {self.first_failure})"
            if self.skipped:
                text += f" ({len(self.skipped)} case(s) skipped: " + "; ".join(self.skipped) + ")"
            return text
        if self.could_not_run:
            text = f"could not be verified (case {self.case!r}): {self.error}"
        else:
            text = f"failed in case {self.case!r}: {self.error}"
        return text + (" (and again on a second run, in a fresh command buffer)" if self.first_failure else "")

    @property
    def worth_a_second_run(self) -> bool:
        """A failure that a second run may not repeat: a wrong or unwritten result, a launch the tier
        refused with an error, a device error. (Not a verification that could not run for a reason
        outside the device: no compiler, no tier, a CPU reference that raised.)"""
        return not self.passed and (not self.could_not_run or self.device_error)


class VerificationWarning(UserWarning):
    """A kernel family failed its first-use verification on this machine and does not serve."""
