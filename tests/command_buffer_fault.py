"""A command-buffer error forced during first-use verification on a Mac's native tier: the family must
come out as "could not be verified" with Metal's error text (a device error), must not be cached, and
must pass a clean verification right after.

    python tests/command_buffer_fault.py --json OUT.json [--family int8_quant]

scripts/mac_acceptance.sh runs it (its report shows the result) with BNB_MPS_VERIFY_CACHE pointing at a
file of its own, and tests/test_verify.py's mps test calls `run`. The fault is a test-only kernel,
tests/fault_kernels/address_fault.metal, compiled by the native tier's own compile path
(bnb_mps._native.compile_library, as the tier compiles csrc/kernels) and launched after each launch
of the family, into the same command buffer. The library's kernels never contain it.

Where the native tier does not serve (not a Mac, the library not built) it records why and exits 0;
it exits 1 when the verdicts are not what is said above.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

FAULT_KERNEL = Path(__file__).resolve().with_name("fault_kernels") / "address_fault.metal"
FAULT_NAME = "bnb_test_address_fault"
FAR_ELEMENTS = 1 << 36  # uints past the start of a 32-element buffer: 256 GiB away, mapped nowhere


class FaultingExecutor:
    """The native tier, each launch followed by one of the fault kernel (in the same command buffer)."""

    name = "native"
    device_type = "mps"

    def __init__(self, inner, fault_library, device: str = "mps") -> None:
        """`device`: where the fault kernel's target lives (tests/metal_model's CPU stand-ins: "cpu")."""
        import torch

        from bnb_mps.kernel_args import uint64

        self.inner, self.fault, self.device_type = inner, fault_library, device
        self.target = torch.zeros(32, dtype=torch.int32, device=device)
        self.far = uint64(FAR_ELEMENTS).to_bytes()
        self.faults = 0

    def launch(self, kernel, *, grid, threadgroup, args, watch=None) -> None:
        self.inner.launch(kernel, grid=grid, threadgroup=threadgroup, args=args, watch=watch)
        self.fault.launch(FAULT_NAME, (1, 1, 1), (32, 1, 1), [self.target, self.far])
        self.faults += 1

    def watch_command_buffers(self):
        return self.inner.watch_command_buffers()

    def synchronize(self) -> None:  # (verification waits through its executor)
        self.inner.synchronize()


def run(family: str = "int8_quant") -> dict[str, Any]:
    """Verifies `family` through FaultingExecutor, then cleanly; what came out (see the module docstring)."""
    import bitsandbytes  # noqa: F401  (the schemas)

    from bnb_mps import executors
    from bnb_mps.msl import source
    from bnb_mps.ops import verify as verification

    try:
        native = executors.load_tier("native")
    except executors.ExecutorUnavailable as e:
        return {"ran": False, "why": f"the native tier does not serve here: {e}"}
    import bnb_mps._native as _native

    if native.watch_command_buffers() is None:
        return {"ran": True, "ok": False, "why": "the native library has no CommandBufferWatch: rebuild it"}
    faulting = FaultingExecutor(native, _native.compile_library(FAULT_KERNEL.read_text()))
    verification.reset()
    faulted = verification.verdict(family, "native", faulting, refresh=True)
    key = verification.cache_key("native", source.source_hash(), native)
    try:
        stored = json.loads(verification.cache_path().read_text()).get(key, {})
    except (OSError, ValueError):
        stored = {}
    clean = verification.verdict(family, "native", native, refresh=True)
    out = {"ran": True, "family": family, "fault_launches": faulting.faults, "verdict": faulted.describe(),
           "could_not_run": faulted.could_not_run, "device_error": faulted.device_error,
           "cached": family in stored, "clean_after": clean.describe(), "clean_passed": clean.passed}  # fmt: skip
    out["ok"] = bool(faulted.could_not_run and faulted.device_error and family not in stored and clean.passed)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="where to write what came out")
    parser.add_argument("--family", default="int8_quant")
    ns = parser.parse_args(argv)
    try:
        result = run(ns.family)
    except Exception as e:  # (reported, never a traceback into the acceptance log alone)
        result = {"ran": True, "ok": False, "why": f"{type(e).__name__}: {e}"}
    Path(ns.json).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0 if not result["ran"] or result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
