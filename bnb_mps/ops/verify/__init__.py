"""First-use verification: every kernel family proves itself on this machine's GPU before it serves.

bnb-mps compiles its kernels at run time, with the user's Metal compiler, for the user's GPU: a
combination the project has not run. So when a kernel tier first serves an op of a family in a
process, the family runs once on small fixed inputs (`FAMILIES`), on that tier, and its results
are compared on the CPU, after one synchronisation, with the CPU round trip of the same ops
(bitsandbytes' CPU implementation and the project's compositions, as the `cpu` route runs them).
A family that fails never serves: routing sends its ops to the next route, with the reason
(`bnb_mps.ops.routing`). Verdicts are cached on disk per machine (`cache`).

The package, in the order a verification runs:

    first_use     the process's verdicts: verdict() on first use, failure() for routing; a second run
                  after a failure; the lock (reentrant)
    families      the table: each family's ops and cases
    cases_*       the cases of each family group (quant, special, matmul, int8, optim), on `cases`'
                  Case / Family / Unaligned, compared with `compare`'s exact / close, special values
                  with `spec`'s reference arithmetic
    runner        one run of a family: launches, one synchronisation, comparisons
    launches      what stands between the op layer and the executor during a run (counts, errors,
                  the command buffers' status)
    sentinel      outputs the kernels never wrote, told apart from wrong values
    machine_key   the machine, the tier's float arithmetic: the cache key
    cache         the verdicts on disk (bnb_mps.json_cache: merged under a lock)
    verdicts      Verdict

The cases keep to inputs where bitsandbytes' CPU code computes docs/semantics.md exactly, so
that the comparison can be bit-exact where the page is exact: its 8-bit CPU quantizer is a
lookup table that differs from the nearest-code rule next to decision points and among the
smallest codes, so those cases take values that are code values away from both; its FP4
quantizer uses exact midpoints, so FP4 values keep clear of every decision point; its pure-PyTorch
NF4 quantizer stores 0x77 for an all-zero block, so there is none. Ties are placed where the rule
is defined and shared (NF4 to the lower nibble, int8's round half to even). Float results
(products, optimizer steps) are compared within tolerances derived from their magnitudes.

Where docs/semantics.md defines results that bitsandbytes' CPU code does not compute (NaN,
infinities, all-zero blocks, float32 subnormals, block maxima above 2^126: sections 2, 3, 6 and 7),
a case carries its expected result, computed here from the page (`spec`), and is compared bit for
bit, NaN as NaN.

What a run can meet, and what comes of it:
- a wrong result: the family fails (cached), with the case and by how much;
- an output the kernels never wrote: filled with a sentinel before the launches, reported as
  unwritten (`sentinel`), a failure like a wrong result;
- a GPU fault (a watchdog timeout, a page fault, memory pressure): on the native tier the status
  of every command buffer that ran the launches is read after the synchronisation (`launches`); an
  error there, or a synchronisation that raises, means the family could not be verified, with
  Metal's error text (a device error: never cached);
- a launch the tier refuses because the kernel's pipeline allows fewer threads per threadgroup than
  the op launches (PipelineLimitError): that case is skipped, recorded in the verdict
  (`Verdict.skipped`), no failure, since the op itself leaves the tier when a user's call meets the
  limit (`bnb_mps.ops.routing.refuse`);
- a verification that could not run at all (no C++ compiler for the emulated tier, a CPU reference
  that raised): the family fails in this process only, never cached.
A family that fails, or meets a device error, runs a second time after a synchronisation, in a fresh
command buffer (`first_use`): a fault passes then, and the family serves with its first run's failure
in the verdict (`Verdict.first_failure`, shown by `python -m bnb_mps verify`); a kernel bug fails
twice and is cached as failed.

To plant a fault in the first run only (tests), wrap `run_family`, which `first_use` looks up on this
package at every run (and which looks up `runner.run_family` in turn: either can be wrapped); e.g.
with an executor that drops the launches of the first run (a command buffer the GPU never ran):

    real = verify.run_family
    runs = []
    def first_run_faulted(family, executor, device):
        runs.append(family.name)
        return real(family, Dropping(executor) if runs.count(family.name) == 1 else executor, device)
    monkeypatch.setattr(verify, "run_family", first_run_faulted)

(tests/test_verify.py does this, and also plants a fault in the kernel source of one run only.)

    BNB_MPS_VERIFY=1       verify at first use, reading and writing the cache (the default)
    BNB_MPS_VERIFY=always  verify at first use in every process (ignore the cache)
    BNB_MPS_VERIFY=0       never verify (at the user's risk)
    BNB_MPS_VERIFY_CACHE   the cache file (default $BNB_MPS_CACHE_DIR/verify.json, else
                           ~/.cache/bnb_mps/verify.json)
"""

from __future__ import annotations

from typing import Optional

from . import runner
from .cache import CACHE_ENV_VAR, cache_path
from .cases import DTYPES, Case, Family, Unaligned
from .compare import close, exact
from .families import FAMILIES, families_behind, families_of
from .first_use import ENV_VAR, MODES, failed_reason, failure, mode, on_stale_routes, reset, verdict, warn_once
from .machine_key import cache_key, machine, math_mode
from .verdicts import VerificationWarning, Verdict


def run_family(family: Family, executor, device: str) -> Verdict:
    """One run of `family` (`runner.run_family`, looked up at each call). first_use calls this for
    every run: the seam a test wraps, here or in `runner`, to plant a fault in one run."""
    return runner.run_family(family, executor, device)


def unverified(families: tuple, tier: str, executor) -> Optional[str]:
    """Why kernels of these families must not run on `tier` (one did not pass first-use verification
    there, verified now if need be; `verdict` is looked up on this package at each call), or None
    (also with BNB_MPS_VERIFY=0). For the routes whose failure takes no op off the tier: tuning's
    candidates, a built-in path's fallback (bnb_mps.ops.candidates)."""
    if mode() == "0":
        return None
    for family in families:
        if family not in FAMILIES:
            return f"its kernel family {family} is not verified by this bnb-mps"
        v = verdict(family, tier, executor)
        if not v.passed:
            warn_once(failed_reason(family, tier, v), "bnb-mps does not run those kernels; the other kernel paths "
                      "serve their calls")  # fmt: skip
            return f"its kernel family {family} did not pass first-use verification"
    return None


__all__ = ["CACHE_ENV_VAR", "DTYPES", "ENV_VAR", "FAMILIES", "MODES", "Case", "Family", "Unaligned",
           "VerificationWarning", "Verdict", "cache_key", "cache_path", "close", "exact", "failure", "families_behind",
           "families_of", "machine", "math_mode", "mode", "on_stale_routes", "reset", "run_family", "unverified",
           "verdict"]
