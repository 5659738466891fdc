"""How long one route takes per call, on a clock (bnb_mps.executors.clocks).

One warm-up call (it compiles, plans, allocates), then one timed call, which says how many calls make
a batch of at least about `MIN_SECONDS`; then batches of that many calls until `SAMPLES` batches are
timed (the first call counts as one where it alone took long enough). The time is the median batch's
time per call.

A batch whose timing fails (the clock's trouble: an error of torch's events, times reversed or
missing) is timed once more; a second failure raises `TimingFailed`, which says nothing about the
route: the caller must not drop the route for it, nor keep any decision measured with it. What the
route itself raises propagates as it is.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

from ..executors.clocks import CallRaised, ClockFailed

MIN_SECONDS = 1e-3  # a timed batch runs at least about this long
SAMPLES = 5  # timed batches, of which the median counts
MAX_BATCH = 10_000  # calls per batch at most (a call that takes no time at all)


class TimingFailed(Exception):
    """A batch could not be timed, twice: the clock's trouble, not the route's."""


def seconds(call: Callable[[], object], clock) -> float:
    """The median time per call of `call`, in seconds, on `clock` (bnb_mps.executors.clocks)."""
    call()  # warm-up (its errors are the route's)
    first = _batch(call, 1, clock)
    n = 1 if first >= MIN_SECONDS else min(MAX_BATCH, math.ceil(MIN_SECONDS / max(first, MIN_SECONDS / MAX_BATCH)))
    samples = [first] if n == 1 else []
    while len(samples) < SAMPLES:
        samples.append(_batch(call, n, clock) / n)
    return statistics.median(samples)


def _batch(call: Callable[[], object], n: int, clock) -> float:
    """One batch of `n` calls timed on `clock`, retried once where the clock fails."""
    for attempt in (1, 2):
        try:
            return clock.batch(call, n)
        except CallRaised as e:
            raise e.__cause__ from None
        except ClockFailed as e:
            if attempt == 2:
                raise TimingFailed(f"{clock.name} clock, twice: {e}") from None
    raise AssertionError("unreachable")
