"""bnb-mps: Metal kernels for bitsandbytes on Apple Silicon.

Installed next to bitsandbytes, bnb_mps registers (through bitsandbytes' `bitsandbytes.backends`
entry point) a kernel for the `mps` device for every bitsandbytes op, so that unchanged
bitsandbytes / transformers / peft code runs them on the GPU. See `python -m bnb_mps`.
"""

from __future__ import annotations

import logging

from ._version import __version__
__all__ = ["register", "unregister", "backend_info", "verify", "tuning_table", "__version__"]

_logger = logging.getLogger("bnb_mps")


def register() -> list[str]:
    """Serve bitsandbytes' ops on `mps` with bnb_mps' kernels; returns the op names registered.

    Called automatically when bitsandbytes is imported; calling it again is a no-op.
    """
    import torch

    if not hasattr(torch.ops.bitsandbytes, "quantize_4bit"):
        import bitsandbytes  # noqa: F401  (defines the schemas, then calls our entry point)
    from . import registration

    return registration.register("MPS")


def unregister() -> None:
    """Remove bnb_mps' `mps` kernels; bitsandbytes' own (if any) serve again."""
    from . import registration

    registration.unregister("MPS")


def backend_info() -> dict[str, dict[str, str]]:
    """For each bitsandbytes op: what serves it on `mps` and why. The tier is "native", "shader"
    or "emulated" (bnb_mps' Metal kernel), "bitsandbytes" (bitsandbytes' own implementation: its
    mps kernel, its pure-PyTorch default kernel, or whatever it registered where bnb_mps left the
    op alone) or "cpu" (bitsandbytes' CPU implementation with transfers). An op some of whose calls
    took another route in this process, because bitsandbytes accepts their arguments but bnb_mps'
    kernels do not cover them (an 8-bit blocksize above 4096, say), has a "note" saying which calls
    and what served them."""
    import torch

    if not hasattr(torch.ops.bitsandbytes, "quantize_4bit"):
        import bitsandbytes  # noqa: F401  (defines the schemas and registers bnb_mps)
    from . import ops, registration

    mine = set(registration.registered("MPS"))
    skipped = registration.skipped()
    info: dict[str, dict[str, str]] = {}
    for name in registration.bitsandbytes_schemas():
        if name not in ops.OPS:
            tier, reason = "bitsandbytes", "schema unknown to this bnb_mps version"
        elif name in skipped:
            tier, reason = "bitsandbytes", skipped[name]
        elif registration.schema_mismatch(name):
            tier, reason = "bitsandbytes", registration.schema_mismatch(name)
        elif name in mine:
            r = ops.route(name)
            tier, reason = r.tier, r.reason
        else:
            tier, reason = "bitsandbytes", "bnb_mps is not registered (bnb_mps.register() was undone)"
        info[name] = {"tier": tier, "reason": reason}
    for name, notes in ops.not_covered_notes().items():
        if name in info:
            info[name]["note"] = "; ".join(notes)
    return info


def verify(tier: str | None = None, *, refresh: bool = False) -> dict:
    """Verify bnb_mps' kernel families on a tier of this machine: {family: Verdict}.

    Each family runs once on small fixed inputs and is compared with the CPU round trip of the
    same ops (bnb_mps.ops.verify). `tier`: "native", "shader" or "emulated" (runs on CPU tensors,
    on any machine); None: the tier that serves ops here. Verdicts come from this process or the
    on-disk cache unless `refresh`, which runs every family again and rewrites the cache. A
    `Verdict` has `passed`, `seconds`, `launches`, `bytes`, `skipped` (cases whose launch the tier
    refused for its pipeline's thread limit: no failure), and for a failure the first failing `case`
    and its `error` (`could_not_run` when the verification itself could not run: never cached).
    """
    import torch

    if not hasattr(torch.ops.bitsandbytes, "quantize_4bit"):
        import bitsandbytes  # noqa: F401  (defines the schemas)
    from . import executors
    from .ops import routing
    from .ops import verify as verification

    if tier is not None and not isinstance(tier, str):
        raise TypeError(f"verify: tier must be a str or None, got {type(tier).__name__}")
    sel = executors.selection()
    if tier is None:
        if sel.executor is None:
            raise ValueError(f"verify: no kernel tier serves ops here ({sel.reason}); pass tier='emulated' to verify "
                             "the kernels under the emulator")  # fmt: skip
        tier = sel.tier
    elif tier not in ("native", "shader", "emulated"):
        raise ValueError(f"verify: tier must be 'native', 'shader', 'emulated' or None, got {tier!r}")
    executor = sel.executor if sel.tier == tier and sel.executor is not None else executors.load_tier(tier)
    verdicts = {name: verification.verdict(name, tier, executor, refresh=refresh) for name in verification.FAMILIES}
    if refresh:
        routing.forget()  # routes follow the new verdicts
    return verdicts


def tuning_table() -> list[dict]:
    """The routes tuning chose on this machine: one entry per shape key, this process's choices and the
    cached ones (bnb_mps.ops.tuning, docs/tuning.md). Each entry has `op`, `key` (the shape key, readable),
    `choice` (the route that serves it), `default` (the route of the built-in order), `times` ({route:
    seconds per call} of every candidate measured; inf for one testing.fixed_timings left out), `cached`
    (True when read from disk), `tier`, `errors` ({route: error} of candidates that raised), `left_out`
    ({route: why} of routes that were no candidates), `clock` ("gpu"; "host" where the times mean nothing
    for a GPU, e.g. the emulated tier; "fixed" under testing.fixed_timings) and `seconds` (what measuring
    took)."""
    import torch

    if not hasattr(torch.ops.bitsandbytes, "quantize_4bit"):
        import bitsandbytes  # noqa: F401  (defines the schemas)
    from .ops import tuning

    return tuning.table()


_entry_failed = False


def _entry_point() -> None:
    """Target of the `bitsandbytes.backends` entry point: register quietly, never raise."""
    global _entry_failed
    try:
        from . import registration

        registration.register("MPS")
    except Exception as e:  # must never make `import bitsandbytes` fail
        if not _entry_failed:
            _entry_failed = True
            _logger.warning("bnb_mps: registration failed, bitsandbytes' own kernels stay in place: %r", e)
        try:
            from . import registration

            registration.unregister("MPS")
        except Exception:
            pass
