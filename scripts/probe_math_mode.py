#!/usr/bin/env python3
"""What the Metal compiler does with bnb-mps' float arithmetic, measured on the GPU of this Mac.

    python scripts/probe_math_mode.py [--tier native,shader] [--n 65536] [--json PATH]

For each tier and each Metal language version it can compile at (native: 3.1, 3.2 and 4.0 where the
build's SDK and this macOS have them; shader: the version torch picks), the probe kernels of
scripts/probes/math_mode.metal run twice: as they are ("bare") and behind
csrc/kernels/bnb_math_mode.h ("pinned", as every bnb-mps kernel is compiled):

- contraction: `o = a*b + c` on n random triples chosen so that a fused multiply-add and two
  roundings differ, compared with both (computed exactly on the CPU): how many results are the
  fused one ("contracted"), how many the separately rounded one, how many neither. Expected for
  "pinned": 0 contracted, at every version. The explicit `fma` kernel is the control.
- fast math: the same contraction probe on the shader tier in a fresh process started with
  PYTORCH_MPS_FAST_MATH=1 (torch reads it once, at its first Metal compile), plus `x != x` on NaNs
  (1 under IEEE rules; fast math may assume there are no NaNs), plus an unqualified `sqrt` against
  `metal::precise::sqrt` (how many results differ, and from the correctly rounded square root).
  This documents what the variable does; bnb-mps' kernels call only `metal::precise::` functions.

`--tier emulated` runs the same probes under the Metal-on-CPU emulator (any machine; its compiles
never contract): what CI runs to keep this script working. Prints a table; --json writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
PROBES = Path(__file__).resolve().parent / "probes" / "math_mode.metal"
VERSIONS = ((3, 1), (3, 2), (4, 0))


def probe_sources() -> dict[str, str]:
    """{"bare": the probes as written, "pinned": behind the kernels' math-mode header}."""
    from bnb_mps.msl import source

    bare = PROBES.read_text(encoding="ascii")
    header = (source.kernel_dir() / "bnb_math_mode.h").read_text(encoding="ascii")
    header = "\n".join(line for line in header.splitlines() if line.strip() != "#pragma once")
    return {"bare": bare, "pinned": header + "\n" + bare}


# -- inputs and the exact references -------------------------------------------------------------------------


def triples(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """a, b in [1, 2), c = -fl32(a * b) nudged by a few ulps: a * b + c is then a small number whose
    fused and separately rounded results differ in most triples (never subnormal, never overflowing)."""
    g = torch.Generator().manual_seed(seed)
    a = 1 + torch.rand(n, generator=g)
    b = 1 + torch.rand(n, generator=g)
    nudge = torch.randint(-3, 4, (n,), generator=g).float()
    c = -(a * b) * (1 + nudge * 2.0**-23)
    return a, b, c.float()


def _f32(x: Fraction) -> float:
    return float(torch.tensor(float(x), dtype=torch.float64).float())  # (exact: see exact_fma)


def exact_fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fl32(a * b + c) with one rounding. a * b of two float32s is exact in float64 (48 bits), and
    here a * b + c cancels to within a few ulps of a * b, so its float64 sum is exact too: one
    rounding to float32, as a fused multiply-add does. Checked against Fraction arithmetic."""
    exact = a.double() * b.double() + c.double()
    for i in range(min(64, a.numel())):
        want = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        assert Fraction(float(exact[i])) == want, "the float64 sum is not exact for these inputs"
    return exact.float()


def classify(got: torch.Tensor, fused: torch.Tensor, separate: torch.Tensor) -> dict[str, int]:
    """Counts over the triples where the fused and the separately rounded results differ."""
    differ = fused != separate
    got, fused, separate = got[differ], fused[differ], separate[differ]
    return {"distinguishing": int(differ.sum()), "contracted": int((got == fused).sum()),
            "separate": int((got == separate).sum()), "neither": int(((got != fused) & (got != separate)).sum())}


# -- the tiers: compile a text, run a kernel over n threads ---------------------------------------------------

Runner = Callable[[str, list[torch.Tensor]], None]


def emulated_compile(text: str, version: Optional[tuple[int, int]]) -> Runner:
    from bnb_mps import emulator

    library = emulator.load(text)

    def run(kernel: str, args: list[torch.Tensor]) -> None:
        n = args[0].numel()
        library.launch(kernel, grid=(n // 256, 1, 1), threadgroup=(256, 1, 1), args=args)

    return run


def native_compile(text: str, version: Optional[tuple[int, int]]) -> Runner:
    import bnb_mps._native as native

    library = native.compile_library(text, version)

    def run(kernel: str, args: list[torch.Tensor]) -> None:
        n = args[0].numel()
        library.launch(kernel, (n // 256, 1, 1), (256, 1, 1), args)

    return run


def shader_compile(text: str, version: Optional[tuple[int, int]]) -> Runner:
    library = torch.mps.compile_shader(text)

    def run(kernel: str, args: list[torch.Tensor]) -> None:
        getattr(library, kernel)(*args, threads=args[0].numel(), group_size=256)

    return run


def tier_versions(tier: str) -> list[Optional[tuple[int, int]]]:
    """The language versions a tier compiles at here (None: the tier chooses and says nothing more)."""
    if tier == "native":
        return list(VERSIONS)
    if tier == "shader":
        from bnb_mps.device import _macos_version
        from bnb_mps.executors import shader

        return [shader.language_version(_macos_version(), shader.torch_version())]
    return [None]


COMPILERS = {"emulated": emulated_compile, "native": native_compile, "shader": shader_compile}


def probe_tier(tier: str, n: int, fast_math: bool = False) -> list[dict[str, Any]]:
    """One row per (language version, source) of `tier`, each with the contraction counts of the
    `a*b + c` kernel and of the explicit fma control, and the NaN and sqrt probes."""
    device = "cpu" if tier == "emulated" else "mps"
    a, b, c = triples(n)
    fused = exact_fma(a, b, c)
    separate = ((a * b) + c)  # (the CPU's float32 ops, each rounded: torch does not contract here)
    nan = torch.full((n,), float("nan"))
    roots = torch.rand(n, generator=torch.Generator().manual_seed(1)) * 1000 + 1e-3
    correct_root = roots.double().sqrt().float()
    rows = []
    for version in tier_versions(tier):
        for kind, text in probe_sources().items():
            row: dict[str, Any] = {"tier": tier, "metal": f"{version[0]}.{version[1]}" if version else "default",
                                   "source": kind, "fast_math_env": fast_math}  # fmt: skip
            try:
                run = COMPILERS[tier](text, version)
            except Exception as e:  # a version this SDK or macOS does not have, or a compile error
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                rows.append(row)
                continue
            on = [t.to(device) for t in (a, b, c)]
            for kernel in ("probe_mad", "probe_fma"):
                out = torch.empty(n, device=device)
                run(kernel, [*on, out])
                row[kernel] = classify(out.cpu(), fused, separate)
            flags = torch.empty(n, device=device)
            run("probe_nan", [nan.to(device), on[1], on[2], flags])
            row["nan_is_nan"] = int(flags.cpu().sum())
            plain, precise = torch.empty(n, device=device), torch.empty(n, device=device)
            run("probe_sqrt", [roots.to(device), on[1], plain, precise])
            plain, precise = plain.cpu(), precise.cpu()
            row["sqrt"] = {"unqualified_vs_precise_differ": int((plain != precise).sum()),
                           "unqualified_not_correctly_rounded": int((plain != correct_root).sum()),
                           "precise_not_correctly_rounded": int((precise != correct_root).sum())}  # fmt: skip
            row["n"] = n
            rows.append(row)
    return rows


def fast_math_rows(n: int) -> list[dict[str, Any]]:
    """The shader tier's probes in a fresh process started with PYTORCH_MPS_FAST_MATH=1."""
    env = {**os.environ, "PYTORCH_MPS_FAST_MATH": "1"}
    done = subprocess.run([sys.executable, __file__, "--tier", "shader", "--n", str(n), "--rows-only"],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    if done.returncode != 0:
        return [{"tier": "shader", "fast_math_env": True, "error": done.stderr.strip().splitlines()[-1:]}]
    rows = json.loads(done.stdout)
    for row in rows:
        row["fast_math_env"] = True
    return rows


def available_tiers() -> list[str]:
    tiers = []
    if torch.backends.mps.is_available():
        try:
            import bnb_mps._native  # noqa: F401

            tiers.append("native")
        except ImportError:
            pass
        if hasattr(torch.mps, "compile_shader"):
            tiers.append("shader")
    return tiers


def table(rows: list[dict[str, Any]]) -> str:
    head = "| tier | Metal | source | PYTORCH_MPS_FAST_MATH | a*b+c contracted | fma control fused | NaN != NaN | sqrt: unqualified != precise |"
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['tier']} | {r.get('metal', '?')} | {r.get('source', '?')} | "
                         f"{'1' if r.get('fast_math_env') else 'unset'} | {r['error']} | | | |")  # fmt: skip
            continue
        mad, fma = r["probe_mad"], r["probe_fma"]
        lines.append(f"| {r['tier']} | {r['metal']} | {r['source']} | {'1' if r['fast_math_env'] else 'unset'} | "
                     f"{mad['contracted']} of {mad['distinguishing']} | {fma['contracted']} of {fma['distinguishing']} | "
                     f"{r['nan_is_nan']} of {r['n']} | {r['sqrt']['unqualified_vs_precise_differ']} of {r['n']} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tier", default=None, help="comma-separated: native, shader, emulated (default: the GPU "
                                                     "tiers this machine has)")  # fmt: skip
    parser.add_argument("--n", type=int, default=65536, help="elements per probe (a multiple of 256)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--no-fast-math-process", action="store_true",
                        help="skip the shader tier's fresh process with PYTORCH_MPS_FAST_MATH=1")
    parser.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)  # (the fresh process)
    args = parser.parse_args(argv)
    if args.n < 256 or args.n % 256:
        parser.error(f"--n must be a positive multiple of 256, got {args.n}")
    tiers = args.tier.split(",") if args.tier else available_tiers()
    unknown = [t for t in tiers if t not in COMPILERS]
    if unknown:
        parser.error(f"--tier: unknown tier {unknown[0]!r} (native, shader, emulated)")
    if not tiers:
        print("probe_math_mode: no GPU tier here (no mps device); use --tier emulated to exercise the probes")
        return 0
    rows = [row for tier in tiers for row in probe_tier(tier, args.n)]
    if args.rows_only:
        print(json.dumps(rows))
        return 0
    if "shader" in tiers and not args.no_fast_math_process:
        rows += fast_math_rows(args.n)
    print(table(rows))
    if tiers == ["emulated"]:
        print("\n(emulated: the emulator compiles as C++ without contraction or fast math; this only checks the probes)")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    pinned_contracted = sum(r["probe_mad"]["contracted"] for r in rows if r.get("source") == "pinned" and "probe_mad" in r)
    return 1 if pinned_contracted else 0


if __name__ == "__main__":
    sys.exit(main())
