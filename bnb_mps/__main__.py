"""`python -m bnb_mps`: what serves bitsandbytes on this machine, and how to get the fast path."""

from __future__ import annotations

import argparse
import importlib
import platform
import sys


def _version(module: str) -> str:
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception as e:  # report, never fail
        return f"not importable ({type(e).__name__}: {e})"


def _native_status() -> str:
    try:
        importlib.import_module("bnb_mps._native")
    except ImportError as e:
        return f"not built ({e})"
    except Exception as e:
        return f"built but failed to load ({type(e).__name__}: {e})"
    return "built and importable"


def diagnostics() -> str:
    import torch

    import bnb_mps
    from bnb_mps import executors, registration

    bnb_version = _version("bitsandbytes")  # importing it registers bnb_mps (entry point)
    mac = platform.mac_ver()[0]
    mps = getattr(torch.backends, "mps", None)
    lines = [
        f"bnb_mps {bnb_mps.__version__}",
        f"platform      {platform.platform()} ({platform.machine()})",
        f"macOS         {mac or 'not macOS'}",
        f"python        {platform.python_version()}",
        f"torch         {torch.__version__}",
        f"bitsandbytes  {bnb_version}",
        f"mps available {bool(mps and mps.is_available())} (built: {bool(mps and mps.is_built())})",
        f"native lib    {_native_status()}",
    ]
    if not hasattr(torch.ops.bitsandbytes, "quantize_4bit"):
        lines += ["", "bitsandbytes is not importable, so there are no ops to serve: pip install bitsandbytes"]
        return "\n".join(lines)
    sel = executors.selection()
    lines.append(f"executor tier {sel.tier}" + (f" ({sel.reason})" if sel.executor is not None else ""))
    for tier, why in executors.load_errors().items():
        lines.append(f"  {tier:<9} unavailable: {why}")
    info = bnb_mps.backend_info()
    width = max(map(len, info), default=10)
    lines += ["", f"{'op':<{width}}  tier          reason", f"{'-' * width}  ------------  ------"]
    for name, row in info.items():
        lines.append(f"{name:<{width}}  {row['tier']:<12}  {row['reason']}")
    unknown = registration.unknown_schemas()
    if unknown:
        lines += ["", "bitsandbytes schemas unknown to this bnb_mps (left to bitsandbytes): " + ", ".join(unknown)]
    if sel.tier != "native":
        lines += ["", "To build the native Metal library (macOS on Apple Silicon):", "    " + executors.BUILD_HINT]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bnb_mps", description=__doc__)
    parser.parse_args(argv)
    print(diagnostics())
    return 0


if __name__ == "__main__":
    sys.exit(main())
