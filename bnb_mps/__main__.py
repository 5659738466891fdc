"""`python -m bnb_mps` (or `bnb-mps`): `info` (the default) prints what serves bitsandbytes on this
machine and how to get the fast path; `verify` runs first-use verification now; `tune` measures the
routes of 4-bit linear layers on this machine (bnb_mps.tune_command); `demo` fine-tunes a small model
with QLoRA end to end."""

from __future__ import annotations

import argparse
import importlib
import platform
import sys
import textwrap
from pathlib import Path


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


def op_table(info: dict[str, dict[str, str]], width: int = 100) -> list[str]:
    """One row per op (name, tier, a short key of its reason); each distinct reason once below."""
    keys: dict[str, str] = {}
    for row in info.values():
        keys.setdefault(row["reason"], f"[{len(keys) + 1}]")
    name_width = max(map(len, info), default=10)
    tier_width = max((len(row["tier"]) for row in info.values()), default=4)
    out = [f"{'op':<{name_width}}  {'tier':<{tier_width}}  why", f"{'-' * name_width}  {'-' * tier_width}  ---"]
    for name, row in info.items():
        out.append(f"{name:<{name_width}}  {row['tier']:<{tier_width}}  {keys[row['reason']]}")
    out.append("")
    for reason, key in keys.items():
        out += textwrap.wrap(reason, width=width, initial_indent=f"{key} ", subsequent_indent=" " * (len(key) + 1),
                             break_long_words=False, break_on_hyphens=False)  # fmt: skip
    for name, row in info.items():  # calls the kernels do not cover, served by another route
        if row.get("note"):
            out += textwrap.wrap(f"{name}: {row['note']}", width=width, subsequent_indent="  ",
                                 break_long_words=False, break_on_hyphens=False)  # fmt: skip
    return out


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
    if sel.tier == "native":  # (its Metal language version follows the build's SDK and the OS)
        lines.append(f"  native kernels compiled at {_language(getattr(sel.executor, 'language_version', None))} "
                     f"({getattr(sel.executor, 'origin', '?')})")
    for tier, why in executors.load_errors().items():
        lines.append(f"  {tier:<9} unavailable: {why}")
    for unit, why in getattr(sel.executor, "unit_failures", {}).items():  # (its kernels' ops route away)
        lines.append(f"  compile unit {unit}.metal did not compile: {why.strip().splitlines()[0] if why.strip() else '?'}")
    lines += [""] + op_table(bnb_mps.backend_info())
    lines += [""] + tuning_lines(bnb_mps.tuning_table())
    unknown = registration.unknown_schemas()
    if unknown:
        lines += ["", "bitsandbytes schemas unknown to this bnb_mps (left to bitsandbytes): " + ", ".join(unknown)]
    if sel.tier != "native":
        lines += ["", "To build the native Metal library (macOS on Apple Silicon):", "    " + executors.BUILD_HINT]
    return "\n".join(lines)


def tuning_lines(rows: list[dict], limit: int = 40) -> list[str]:
    """What tuning chose on this machine (this process's choices and the cached ones), a line each."""
    from bnb_mps.ops import tuning

    head = f"Tuning (BNB_MPS_TUNE={tuning.mode('native', True)} on the GPU tiers; cache: {tuning.cache_path()}):"
    if not rows:
        return [head, "  no route measured yet on this machine for this bnb-mps (`python -m bnb_mps tune` measures "
                      "4-bit linear layers now)"]  # fmt: skip
    out = [head]
    for r in sorted(rows, key=lambda r: (r["tier"], r["op"], r["key"]))[:limit]:
        times = ", ".join(f"{n} {t * 1e3:.3g} ms" for n, t in r["times"].items() if t != float("inf"))
        clock = "" if r["clock"] == "gpu" else f", {r['clock']} clock"
        out.append(f"  {r['tier']}: {r['key']}: {r['choice']} (built-in {r['default']}; {times}{clock})")
    if len(rows) > limit:
        out.append(f"  ... and {len(rows) - limit} more (bnb_mps.tuning_table())")
    return out


def _language(version) -> str:
    return f"Metal {version[0]}.{version[1]}" if version else "the OS compiler's default Metal version"


def verify_table(verdicts: dict) -> list[str]:
    """One row per kernel family: verdict, time, launches and bytes; below, each failure's case, each
    family that passed only on its second run (with its first run's failure) and each skipped case."""
    out = [f"{'family':<18}  {'verdict':<7}  {'seconds':>7}  {'launches':>8}  {'bytes':>9}  from",
           f"{'-' * 18}  {'-' * 7}  {'-' * 7}  {'-' * 8}  {'-' * 9}  ----"]  # fmt: skip
    for name, v in verdicts.items():
        out.append(f"{name:<18}  {'passed' if v.passed else 'FAILED':<7}  {v.seconds:7.2f}  {v.launches:8d}  "
                   f"{v.bytes:9d}  {'cache' if v.cached else 'run now'}")  # fmt: skip
    for name, v in verdicts.items():
        if not v.passed or v.skipped or v.first_failure:
            out += [""] + textwrap.wrap(f"{name}: {v.describe()}", width=100, subsequent_indent="    ",
                                        break_long_words=False, break_on_hyphens=False)  # fmt: skip
    return out


def _load_kernels(tier: str, sel) -> None:
    """Loads `tier` with its kernels compiled (the native and shader tiers compile when they load; the
    emulated tier compiles at its first launch, so here: into the emulator's module cache, from which
    that launch reads it back)."""
    from bnb_mps import executors

    if sel.executor is None or sel.tier != tier:
        executors.load_tier(tier)
    if tier == "emulated":
        from bnb_mps import emulator
        from bnb_mps.msl import source

        emulator.load(source.source())


def verify_command(tier, refresh: bool = True, json_path=None) -> int:
    import dataclasses
    import json
    import os
    import time

    import bnb_mps
    from bnb_mps import executors
    from bnb_mps.ops import verify as verification

    _version("bitsandbytes")  # defines the schemas
    # Two figures: loading the tier with its kernels compiled (what a process pays once, whether or
    # not it verifies), then the verification itself.
    start = time.perf_counter()
    if tier is not None:
        os.environ["BNB_MPS_EXECUTOR"] = tier  # the tier to verify serves this process: loaded once
        executors.reset()
    sel = executors.selection()
    if tier is None:
        tier = sel.tier if sel.executor is not None else "emulated"
        if sel.executor is None:
            print(f"No GPU tier serves ops here ({sel.reason}); verifying the kernels under the emulator.\n")
    elif sel.tier != tier:
        print(f"cannot verify the {tier} tier: {executors.load_errors().get(tier, sel.reason)}")
        return 1
    try:
        _load_kernels(tier, sel)
    except Exception as e:  # e.g. the tier does not load here, no C++ compiler for the emulator
        print(f"cannot verify the {tier} tier: {type(e).__name__}: {e}")
        return 1
    load_seconds = time.perf_counter() - start
    m = verification.machine()
    print(f"Verifying bnb_mps' {tier} kernels on {m['gpu']}, {m['os']}, torch {m['torch']}, "
          f"bitsandbytes {m['bitsandbytes']} (kernels {bnb_mps_source_hash()})\n")
    how = "compiled now, or read from the emulator's module cache" if tier == "emulated" else "compiled now"
    print(f"Loaded the {tier} tier and its kernels in {load_seconds:.2f} s ({how})\n")
    start = time.perf_counter()
    try:
        verdicts = bnb_mps.verify(tier, refresh=refresh)
    except Exception as e:  # pragma: no cover (verification itself never raises)
        print(f"cannot verify the {tier} tier: {type(e).__name__}: {e}")
        return 1
    seconds = time.perf_counter() - start
    print("\n".join(verify_table(verdicts)))
    print(f"\n{sum(v.passed for v in verdicts.values())} of {len(verdicts)} families passed in "
          f"{seconds:.2f} s; cache: {verification.cache_path()}")
    if json_path:
        Path(json_path).write_text(json.dumps({
            "tier": tier, "machine": m, "kernels": bnb_mps_source_hash(), "refresh": refresh,
            "load_seconds": load_seconds, "seconds": seconds,
            "families": {name: dataclasses.asdict(v) for name, v in verdicts.items()},
        }, indent=1) + "\n")  # fmt: skip
    return 0 if all(v.passed for v in verdicts.values()) else 1


def bnb_mps_source_hash() -> str:
    from bnb_mps.msl import source

    try:
        return source.source_hash()
    except (OSError, ValueError) as e:
        return f"unreadable: {e}"


def main(argv=None) -> int:
    # the console script `bnb-mps` and `python -m bnb_mps` share this entry: name the one the user ran
    prog = "bnb-mps" if Path(sys.argv[0]).stem == "bnb-mps" else "python -m bnb_mps"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    commands = parser.add_subparsers(dest="command", metavar="{info,verify,tune,demo}")
    commands.add_parser("info", help="which tier serves each bitsandbytes op here (the default)")
    verify_parser = commands.add_parser(
        "verify", help="verify every kernel family on this machine now and print the table",
        description="Runs every kernel family once on small fixed inputs on a kernel tier and compares it with "
        "the CPU round trip (what bnb-mps does at first use, cached per machine). Exit status 1 if a family fails.",
    )  # fmt: skip
    verify_parser.add_argument("--tier", choices=("native", "shader", "emulated"),
                               help="the tier to verify (default: the one serving ops here, else emulated)")
    verify_parser.add_argument("--cached", action="store_true",
                               help="take verdicts from the cache where it has them (default: run every family now)")
    verify_parser.add_argument("--json", metavar="PATH", help="also write the verdicts and the time taken as JSON")
    tune_parser = commands.add_parser(
        "tune", help="measure the routes of 4-bit linear layers on this machine now and print the speed table",
        description="Measures every candidate route of gemm_4bit (kernel paths and variants, dequantize+linear, "
        "bitsandbytes' own) for each weight shape and row count, as tuning does at first use, caches the choices, "
        "and prints each route's time, the choice, GB/s at M=1 and TFLOPS at large M, against dense fp16 linear "
        "(and MLX's quantized_matmul where mlx is installed).",
    )  # fmt: skip
    from . import tune_command

    tune_command.add_arguments(tune_parser)
    demo_parser = commands.add_parser(
        "demo", help="QLoRA fine-tuning of a small Llama, end to end (needs transformers, peft, matplotlib)",
        description="QLoRA fine-tuning of a small Llama built from a config (nothing downloaded): 4-bit NF4 "
        "weights, LoRA adapters, a bitsandbytes 8-bit optimizer; prints where each bitsandbytes op ran and "
        "writes summary.json and demo_loss.png.",
    )  # fmt: skip
    from . import demo

    demo.add_arguments(demo_parser)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo.main(args)
    if args.command == "verify":
        return verify_command(args.tier, refresh=not args.cached, json_path=args.json)
    if args.command == "tune":
        return tune_command.main(args)
    print(diagnostics())
    return 0


if __name__ == "__main__":
    sys.exit(main())
