"""A family's verdict: what its verification found, as the routing, the cache and `python -m bnb_mps verify` read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Verdict:
    """The outcome of one family's verification on one tier."""

    family: str
    passed: bool
    seconds: float  # wall time of the run (of the run that made it, when read from the cache)
    case: Optional[str] = None  # the first case that failed
    error: Optional[str] = None  # what was wrong in it, and by how much
    launches: int = 0  # kernel launches the verification made
    bytes: int = 0  # bytes of the buffers those launches bound
    cached: bool = False  # read from the on-disk cache instead of run in this process
    # Cases not run because the tier refused a launch (PipelineLimitError): "case: why".
    skipped: tuple[str, ...] = ()
    # The verification could not run (not a wrong result): failed in this process, never cached.
    could_not_run: bool = False

    def describe(self) -> str:
        if self.passed:
            if not self.skipped:
                return "passed"
            return f"passed ({len(self.skipped)} case(s) skipped: " + "; ".join(self.skipped) + ")"
        if self.could_not_run:
            return f"could not be verified (case {self.case!r}): {self.error}"
        return f"failed in case {self.case!r}: {self.error}"


class VerificationWarning(UserWarning):
    """A kernel family failed its first-use verification on this machine and does not serve."""
