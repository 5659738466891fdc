"""The report of `scripts/mac_acceptance.sh`: one Markdown file to paste into an issue and the same
facts as JSON.

    python scripts/acceptance_report.py --out DIR --work DIR [--dry-run] [--repo DIR]

Reads what the shell script left in the work directory (`steps.tsv`: one line per step with its
exit status, seconds, log and whether it timed out; `junit.xml` from pytest; `verify_*.json` from the verification steps;
`bench_*.json` from the benchmarks) and asks this Python (the acceptance venv's) about the machine:
model, chip, memory, macOS, torch, bitsandbytes, the Metal language version the native library asks
for, which executor tier loaded and which tier serves each op. Writes `acceptance-report.md` and `acceptance-report.json`
into --out. Nothing here needs a Mac: off macOS the machine section says so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import OrderedDict
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
REPORT_MD = "acceptance-report.md"
REPORT_JSON = "acceptance-report.json"
GPU_TIERS = ("native", "shader")


# -- facts about this machine -----------------------------------------------------------------------


def _run(cmd: list[str], timeout: float = 30) -> Optional[str]:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def _version(module: str) -> Optional[str]:
    try:
        mod = __import__(module)
    except Exception:
        return None
    return str(getattr(mod, "__version__", "installed"))


def machine_info() -> dict[str, Any]:
    """Model, chip, memory, OS and the Python stack of this machine (None where unknown)."""
    info: dict[str, Any] = {
        "os": platform.system(),
        "arch": platform.machine(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "bitsandbytes": _version("bitsandbytes"),
        "bnb_mps": _version("bnb_mps"),
        "model": None,
        "chip": None,
        "gpu_cores": None,
        "peak_bandwidth_gbps": None,
        "memory_bytes": None,
        "macos": None,
        "macos_build": None,
        "mps_available": False,
        "mps_bfloat16": None,
    }
    if info["os"] == "Darwin":
        info["model"] = _run(["sysctl", "-n", "hw.model"])
        info["chip"] = _run(["sysctl", "-n", "machdep.cpu.brand_string"])
        mem = _run(["sysctl", "-n", "hw.memsize"])
        info["memory_bytes"] = int(mem) if mem and mem.isdigit() else None
        info["macos"] = platform.mac_ver()[0] or _run(["sw_vers", "-productVersion"])
        info["macos_build"] = _run(["sw_vers", "-buildVersion"])
        try:
            from bnb_mps import chips

            chip = chips.detect()
            if chip is not None:
                info["gpu_cores"], info["peak_bandwidth_gbps"] = chip.gpu_cores, chip.bandwidth_gbps
        except Exception:
            pass
    else:
        info["chip"] = _cpu_name()
        info["memory_bytes"] = _linux_memory()
    try:
        import torch

        mps = getattr(torch.backends, "mps", None)
        info["mps_available"] = bool(mps and mps.is_available())
        if info["mps_available"]:
            try:
                torch.ones(1, dtype=torch.bfloat16, device="mps").sum().item()
                info["mps_bfloat16"] = True
            except Exception:
                info["mps_bfloat16"] = False
    except Exception:
        pass
    return info


def _cpu_name() -> Optional[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _linux_memory() -> Optional[int]:
    try:
        m = re.search(r"MemTotal:\s*(\d+) kB", Path("/proc/meminfo").read_text())
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def metal_info(macos: Optional[str], repo: Path = REPO) -> dict[str, Any]:
    """What bnb-mps asks of Metal here. The language version is what the native library requests
    (read from csrc/mps_ops.mm and csrc/mps.cmake rules, not measured); the OS's Metal support is
    what system_profiler says, when it is there."""
    info: dict[str, Any] = {"native_library": None, "native_kernels_from": None, "language_version": None,
                            "language_version_source": None, "os_metal_support": None, "shader_tier": None}
    native = None
    try:
        import importlib

        native = importlib.import_module("bnb_mps._native")
        info["native_library"] = "built and importable"
    except ImportError as e:
        info["native_library"] = f"not built or not loadable ({e})"
    except Exception as e:
        info["native_library"] = f"failed to load ({type(e).__name__}: {e})"
    if native is not None:
        try:
            from bnb_mps.executors import native as native_tier

            runtime = native_tier.runtime_language_version(native)
            kind, _ = native_tier.choose_library(native.embedded_source(), native_tier.current_kernel_source(),
                                                 Path(native.__file__).with_name(native_tier.METALLIB_NAME),
                                                 runtime)  # fmt: skip
            info["native_kernels_from"] = {"metallib": "the metallib built at install time (xcrun metal)",
                                           "source": "the kernel source, compiled at first use"}[kind]
            if kind == "metallib":
                info["language_version"] = "Metal 3.1 (-std=metal3.1)"
                info["language_version_source"] = "csrc/mps.cmake builds the metallib with -std=metal3.1"
            elif runtime is not None:
                info["language_version"] = f"MSL {runtime[0]}.{runtime[1]}"
                info["language_version_source"] = ("what the native library's compile_library requests here "
                                                   "(bnb_mps._native.language_version())")
        except Exception as e:
            info["native_kernels_from"] = f"unknown ({type(e).__name__}: {e})"
    if info["language_version"] is None:
        major = _major(macos)
        if major is None:
            info["language_version"] = "n/a (not macOS)"
        elif major >= 15:
            info["language_version"] = "MSL 3.2 (MTLLanguageVersion3_2)"
        elif major >= 14:
            info["language_version"] = "MSL 3.1 (MTLLanguageVersion3_1)"
        else:
            info["language_version"] = "the OS compiler's default (macOS < 14: no version requested)"
        info["language_version_source"] = ("csrc/mps_ops.mm requests MTLLanguageVersion3_2 when compiling the "
                                           "kernel source on macOS 15 and later, 3_1 on macOS 14")
    if platform.system() == "Darwin":
        out = _run(["system_profiler", "SPDisplaysDataType"], timeout=60) or ""
        m = re.search(r"Metal(?: Support| Family)?:\s*(.+)", out)
        info["os_metal_support"] = m.group(1).strip() if m else None
    try:
        from bnb_mps.executors import load_tier

        load_tier("shader")
        info["shader_tier"] = "loads"
    except Exception as e:
        info["shader_tier"] = f"unavailable: {e}"
    return info


def _major(version: Optional[str]) -> Optional[int]:
    m = re.match(r"(\d+)", version or "")
    return int(m.group(1)) if m else None


def tier_info() -> dict[str, Any]:
    """The executor tier that loaded, why, the tiers that did not, and the tier of every op."""
    try:
        import bitsandbytes  # noqa: F401  (registers bnb_mps)

        import bnb_mps
        from bnb_mps import executors

        sel = executors.selection()
        return {"tier": sel.tier, "reason": sel.reason, "unavailable": executors.load_errors(),
                "ops": bnb_mps.backend_info()}
    except Exception as e:
        return {"tier": None, "reason": f"{type(e).__name__}: {e}", "unavailable": {}, "ops": {}}


def git_info(repo: Path) -> dict[str, Any]:
    commit = _run(["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"])
    status = _run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"])
    return {"commit": commit, "modified": bool(status)}


# -- what the steps left behind ---------------------------------------------------------------------


#: how much of a timed-out step's output the report shows (its last lines)
TIMED_OUT_LINES = 40


def read_steps(path: Path) -> list[dict[str, Any]]:
    """steps.tsv: `name<TAB>exit status<TAB>seconds<TAB>log file<TAB>note<TAB>outcome<TAB>expected`
    per line; outcome "timed out" when the step ran out of its time limit (scripts/time_limit.py),
    expected "timed-out" for the dry run's planted hanging step. A step that timed out carries the
    last TIMED_OUT_LINES lines of its log (`output`)."""
    steps = []
    if not path.is_file():
        return steps
    for line in path.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) < 3:
            continue
        rc = int(parts[1]) if parts[1].lstrip("-").isdigit() else None
        step = {"name": parts[0], "status": rc, "seconds": float(parts[2] or 0),
                "log": parts[3] if len(parts) > 3 and parts[3] else None,
                "note": parts[4] if len(parts) > 4 and parts[4] else None,
                "timed_out": len(parts) > 5 and parts[5] == "timed out",
                "planted_hang": len(parts) > 6 and parts[6] == "timed-out"}
        if step["timed_out"]:
            step["output"] = _log_tail(step["log"])
        steps.append(step)
    return steps


def _log_tail(log: Optional[str]) -> str:
    try:
        lines = Path(log).read_text(errors="replace").splitlines() if log else []
    except OSError as e:
        return f"(its log {log} cannot be read: {e})"
    return "\n".join(lines[-TIMED_OUT_LINES:])


def step_failed(step: dict[str, Any]) -> bool:
    """A step failed when it exited with an error or timed out, and the planted hang when it did not
    time out."""
    if step.get("planted_hang"):
        return not step.get("timed_out")
    return bool(step.get("timed_out")) or step["status"] not in (0, None)


def _step_result(step: dict[str, Any]) -> str:
    if step.get("timed_out"):
        return "timed out" + (" (as planted)" if step.get("planted_hang") else "")
    if step.get("planted_hang"):
        return f"DID NOT TIME OUT (exit status {step['status']})"
    return "ok" if step["status"] == 0 else ("not run" if step["status"] is None else f"exit status {step['status']}")


def parse_junit(path: Path) -> list[dict[str, Any]]:
    """Every test case of a pytest junit XML: file, name, outcome (passed/failed/error/skipped),
    seconds and the first line of the failure or skip message."""
    if not path.is_file():
        return []
    root = ET.parse(path).getroot()
    tests = []
    for case in root.iter("testcase"):
        classname = case.get("classname", "")
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (el.get("message") or el.text or "").strip().splitlines()[0:1]
                message = message[0][:300] if message else ""
                break
        tests.append({"file": classname.replace(".", "/") + ".py" if classname else "", "name": case.get("name", ""),
                      "outcome": outcome, "seconds": float(case.get("time") or 0), "message": message})
    return tests


def _param(name: str) -> str:
    m = re.search(r"\[(.*)\]$", name)
    return m.group(1) if m else ""


def group_tests(tests: list[dict[str, Any]], families: dict[str, tuple[str, ...]]) -> dict[str, Any]:
    """Per kernel family and GPU tier (tests/test_mps.py::test_family_on_gpu), per op for the CPU
    round trip (test_cpu_round_trip_on_mps), and per test file for everything else."""
    gpu: "OrderedDict[str, dict[str, dict[str, Any]]]" = OrderedDict((f, {}) for f in families)
    fallback: "OrderedDict[str, dict[str, Any]]" = OrderedDict()
    files: "OrderedDict[str, dict[str, Any]]" = OrderedDict()

    def add(bucket: dict[str, Any], test: dict[str, Any]) -> None:
        bucket.setdefault("passed", 0), bucket.setdefault("failed", 0), bucket.setdefault("skipped", 0)
        bucket.setdefault("failures", [])
        key = "failed" if test["outcome"] in ("failed", "error") else test["outcome"]
        bucket[key] += 1
        if key == "failed":
            bucket["failures"].append(f"{test['name']}: {test['message']}")
        elif key == "skipped" and "skip_reason" not in bucket:
            bucket["skip_reason"] = test["message"]

    for t in tests:
        base = t["name"].split("[")[0]
        if base == "test_family_on_gpu":
            tokens = _param(t["name"]).split("-")
            tier = next((x for x in tokens if x in GPU_TIERS), "?")
            family = next((x for x in tokens if x in families), tokens[0] if tokens else "?")
            add(gpu.setdefault(family, {}).setdefault(tier, {}), t)
        elif base == "test_cpu_round_trip_on_mps":
            op = _param(t["name"]).split("-")[0]
            add(fallback.setdefault(op, {}), t)
        else:
            add(files.setdefault(t["file"] or "?", {}), t)
    totals = {k: sum(1 for t in tests if (t["outcome"] if t["outcome"] != "error" else "failed") == k)
              for k in ("passed", "failed", "skipped")}
    return {"gpu_families": gpu, "cpu_round_trip": fallback, "files": files, "totals": totals}


def load_families(repo: Path) -> dict[str, tuple[str, ...]]:
    """Family name -> ops, from tests/mps_families.py (empty if it cannot be imported)."""
    tests = repo / "tests"
    if not (tests / "mps_families.py").is_file():
        return {}
    sys.path.insert(0, str(tests))
    try:
        import mps_families

        return {f.name: tuple(f.ops) for f in mps_families.FAMILIES}
    except Exception:
        return {}
    finally:
        sys.path.remove(str(tests))


def read_benchmark(path: Path) -> Optional[dict[str, Any]]:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return {"error": f"unreadable ({e})"}


# -- Markdown -----------------------------------------------------------------------------------------


def _cell(x: Any) -> str:
    if x is None:
        return "?"
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
    if isinstance(x, (list, tuple)):
        return ", ".join(map(str, x))
    return str(x).replace("|", "\\|").replace("\n", " ")


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def benchmark_markdown(bench: Optional[dict[str, Any]]) -> str:
    """A table of one benchmark JSON: the GPU columns on a Mac, the emulated ones elsewhere, any
    other format column by column."""
    if bench is None:
        return "(not run)"
    if "error" in bench:
        return f"(results {bench['error']})"
    if bench.get("mode") == "host":  # scripts/bench_op_overhead.py
        out = []
        for key, title in (("no_op_launch", "op layer, kernel launch replaced by a no-op"),
                           ("native", "native tier, real launches on mps")):  # fmt: skip
            result = bench.get(key)
            if not result:
                continue
            if "error" in result:
                out.append(f"{title}: not measured ({result['error']})")
                continue
            rows = [[name, r["total_us"], r["floor_us"], r["share_us"], f"{r['share_per_add']:.1f}x"]
                    for name, r in result["rows"].items()]  # fmt: skip
            out.append(f"{title} (torch.add on tiny tensors: {result['torch_add_us']:.2f} us; "
                       f"op keys: {bench.get('metadata_key', '?')})\n\n"
                       + markdown_table(["call", "total us", "floor us", "bnb-mps us", "bnb-mps / torch.add"], rows))
        return "\n\n".join(out) or "(no results)"
    cases = bench.get("cases") or bench.get("results") or []
    if not cases:
        return "(no results)"
    if bench.get("mode") == "gpu":
        rows = []
        for c in cases:
            speed = f"{c['stock_ms'] / c['ms']:.2f}x" if c.get("stock_ms") and c.get("ms") else ""
            rows.append([c.get("name"), c.get("ms"), c.get("gbps"),
                         f"{c['pct_of_peak']:.0f}%" if c.get("pct_of_peak") is not None else "?",
                         c.get("stock_ms", c.get("stock_error", "n/a")), speed])
        return markdown_table(["op", "ours ms", "GB/s", "% of peak", "stock bitsandbytes ms", "speed-up"], rows)
    if bench.get("mode") == "emulated":
        rows = [[c.get("name"), c.get("launches"), c.get("extra_alloc_bytes"), c.get("host_reads"), c.get("kernels")]
                for c in cases]
        return ("No GPU time measured (no mps device): kernels ran on the emulated tier.\n\n"
                + markdown_table(["op", "launches", "bytes allocated beyond outputs", "host reads", "kernels"], rows))
    keys: list[str] = []
    for c in cases:
        keys += [k for k in c if k not in keys]
    return markdown_table(keys, [[c.get(k) for k in keys] for c in cases])


def verification_markdown(v: dict[str, Any]) -> str:
    """Each family's first-use verification with an empty cache (cold) and from the cache."""
    cold, cached = v.get("cold"), v.get("cached")
    if not cold or "families" not in cold:
        return "(not run)" if not cold else f"(results {cold.get('error', 'incomplete')})"
    rows = []
    for name, c in cold["families"].items():
        if c.get("passed"):
            verdict = "passed"
        elif c.get("could_not_run"):
            verdict = f"COULD NOT RUN ({c.get('case')}): {c.get('error')}"
        else:
            verdict = f"FAILED in {c.get('case')!r}: {c.get('error')}"
        if c.get("first_failure"):
            verdict += f" (on a second run; the first {c['first_failure']})"
        if c.get("passed") and c.get("skipped"):
            verdict += f" ({len(c['skipped'])} case(s) skipped: {'; '.join(c['skipped'])})"
        rows.append([name, verdict, c.get("seconds"), c.get("launches"), c.get("bytes")])
    lines = [f"Tier {cold.get('tier')}, kernels {cold.get('kernels')}.", "",
             markdown_table(["family", "verdict", "seconds", "launches", "bytes"], rows), ""]  # fmt: skip
    if "load_seconds" in cold:
        lines.append(f"Loading the tier and compiling its kernels, first process: {cold['load_seconds']:.3f} s"
                     + (f"; from the cache of a later process: {cached['load_seconds']:.3f} s."
                        if cached and "load_seconds" in cached else "."))  # fmt: skip
    lines.append(f"Whole verification, cold (empty cache): {cold.get('seconds', 0):.3f} s.")
    if cached and "seconds" in cached:
        hits = sum(1 for c in cached.get("families", {}).values() if c.get("cached"))
        lines.append(f"Whole verification, cached: {cached['seconds']:.3f} s ({hits} of {len(cached.get('families', {}))} "
                     "families read from the cache).")  # fmt: skip
    lines += ["", fault_markdown(v.get("fault"))]
    return "\n".join(lines)


def math_mode_markdown(probe: Optional[dict[str, Any]]) -> str:
    """scripts/probe_math_mode.py's rows: per tier, Metal language version and source (the probes as
    written, or behind bnb_math_mode.h as every bnb-mps kernel), with and without PYTORCH_MPS_FAST_MATH."""
    if not probe or "rows" not in probe:
        return "(not run)"
    rows = []
    for r in probe["rows"]:
        env = "1" if r.get("fast_math_env") else "unset"
        if "error" in r:
            rows.append([r.get("tier"), r.get("metal"), r.get("source"), env, f"not run: {r['error']}", "", "", ""])
            continue
        mad, fma, sq = r["probe_mad"], r["probe_fma"], r["sqrt"]
        rows.append([r["tier"], r["metal"], r["source"], env, f"{mad['contracted']} of {mad['distinguishing']}",
                     f"{fma['contracted']} of {fma['distinguishing']}", f"{r['nan_is_nan']} of {r['n']}",
                     f"{sq['unqualified_vs_precise_differ']} of {r['n']} (precise not correctly rounded: "
                     f"{sq['precise_not_correctly_rounded']})"])  # fmt: skip
    pinned = [r for r in probe["rows"] if r.get("source") == "pinned" and "probe_mad" in r]
    contracted = sum(r["probe_mad"]["contracted"] for r in pinned)
    summary = ("Expected: 0 contracted in every pinned row (bnb_math_mode.h), and the fma control fused in every "
               f"row. Pinned rows: {len(pinned)}, contracted results in them: {contracted}.")
    header = ["tier", "Metal", "source", "PYTORCH_MPS_FAST_MATH", "a*b+c contracted", "fma control fused",
              "NaN != NaN true", "unqualified sqrt != precise::sqrt"]  # fmt: skip
    return summary + "\n\n" + markdown_table(header, rows)


def tuning_markdown(tune: Optional[dict[str, Any]], chart: Optional[str] = None) -> str:
    """`python -m bnb_mps tune --json`: per weight shape and M, each route's time, the choice, the
    built-in route, GB/s and share of peak at M = 1, TFLOPS from M = 64, and the reference rows."""
    if not tune or "rows" not in tune:
        return "(not run)" if not tune else f"(results {tune.get('error', 'incomplete')})"
    order = ("gemv", "gemv/tglut", "batch", "small", "small/wide", "splitk", "splitk/two", "mma", "dequantize+linear",
             "bitsandbytes")
    routes = [n for n in order if any(n in r["times"] for r in tune["rows"])]

    def ms(t: Any) -> str:
        return "-" if t is None else f"{t * 1e3:.4g}"

    rows = []
    for r in tune["rows"]:
        times = [ms(r["times"][n]) + (" *" if n == r["choice"] else "") if n in r["times"]
                 else ("error" if n in r.get("errors", {}) else "") for n in routes]  # fmt: skip
        rows.append([r["shape"], r["M"], *times, r["choice"], r["default"],
                     f"{r['gbps']:.1f}" if r.get("gbps") else "", f"{100 * r['share_of_peak']:.0f}%"
                     if r.get("share_of_peak") else "", f"{r['tflops']:.2f}" if r.get("tflops") else "",
                     ms(r.get("dense_fp16_linear")), ms(r.get("mlx_quantized_matmul"))])  # fmt: skip
    head = (f"Tier {tune.get('tier')}, {tune.get('dtype')} activations, NF4 blocksize 64 with nested block scales; "
            f"ms per call on the {'GPU' if tune.get('meaningful') else 'host'}'s clock (* the choice)."
            + ("" if tune.get("meaningful") else " These host-clock times of emulated kernels mean nothing for a GPU."))
    table = markdown_table(["N x K", "M", *routes, "choice", "built-in", "GB/s", "% peak", "TFLOPS",
                            "fp16 linear (dense)", "MLX quantized_matmul"], rows)  # fmt: skip
    errors = [f"- {r['shape']} M={r['M']} {n}: `{e}`" for r in tune["rows"] for n, e in r.get("errors", {}).items()]
    parts = [head, "", table]
    if errors:
        parts += ["", "Routes that raised (dropped):", *errors]
    parts += ["", f"Measured in {tune.get('seconds', 0):.1f} s in all."]
    if chart:
        parts += ["", f"![route times]({chart})"]
    return "\n".join(parts)


def fault_markdown(fault: Optional[dict[str, Any]]) -> str:
    """The forced command-buffer error (tests/command_buffer_fault.py): "could not be verified", not cached."""
    head = "A command-buffer error forced during verification (tests/fault_kernels/address_fault.metal)"
    if not fault:
        return f"{head}: not run."
    if "error" in fault:
        return f"{head}: results {fault['error']}."
    if not fault.get("ran"):
        return f"{head}: not run ({fault.get('why')})."
    if "verdict" not in fault:
        return f"{head}: FAILED ({fault.get('why')})."
    result = "as it must be" if fault.get("ok") else "FAILED: it must be \"could not be verified\", a device error, not cached"
    return (f"{head}, {fault['fault_launches']} fault launches in family {fault['family']}: {result}. Verdict: "
            f"{fault['verdict']}; cached: {'yes' if fault.get('cached') else 'no'}; a clean verification right "
            f"after: {fault.get('clean_after')}.")


def _counts(b: dict[str, Any]) -> str:
    if not b:
        return "not run"
    total = b["passed"] + b["failed"] + b["skipped"]
    if b["failed"]:
        return f"FAILED ({b['failed']} of {total})"
    if b["passed"] == 0 and b["skipped"]:
        return f"skipped ({b['skipped']})"
    return f"passed ({b['passed']}/{total})" + (f", {b['skipped']} skipped" if b["skipped"] else "")


def verdict(report: dict[str, Any]) -> str:
    failed_steps = [s["name"] for s in report["steps"] if step_failed(s)]
    failed_tests = report["tests"]["totals"]["failed"] if report["tests"] else 0
    if failed_steps or failed_tests:
        what = ", ".join(failed_steps) or "tests"
        return f"FAIL ({failed_tests} failed tests; failed steps: {what})"
    if report["dry_run"]:
        return "DRY RUN passed (everything except the mps parts; no GPU was used)"
    gpu = report["tests"]["gpu_families"] if report["tests"] else {}
    ran = [b for tiers in gpu.values() for b in tiers.values() if b.get("passed")]
    if not ran:
        return "INCOMPLETE (no kernel family ran on a GPU tier)"
    return "PASS"


def render_markdown(r: dict[str, Any]) -> str:
    m, metal, tiers = r["machine"], r["metal"], r["tiers"]
    out = ["# bnb-mps acceptance report", ""]
    out.append(f"**Result: {r['verdict']}**")
    out.append("")
    git = r.get("git") or {}
    out.append(f"Generated {r['generated']} by `bash scripts/mac_acceptance.sh{' --dry-run' if r['dry_run'] else ''}` "
               f"(bnb-mps {m.get('bnb_mps') or '?'}, commit {git.get('commit') or '?'}"
               f"{', with local modifications' if git.get('modified') else ''}).")
    out += ["", "## Machine", ""]
    mem = f"{m['memory_bytes'] / 2**30:.0f} GiB" if m.get("memory_bytes") else None
    chip = m.get("chip")
    if m.get("gpu_cores"):
        chip = f"{chip}, {m['gpu_cores']} GPU cores"
    if m.get("peak_bandwidth_gbps"):
        chip = f"{chip}, {m['peak_bandwidth_gbps']:g} GB/s published peak bandwidth"
    rows = [["model", m.get("model") or "n/a (not a Mac)"], ["chip", chip], ["memory", mem],
            ["OS", f"macOS {m['macos']} ({m.get('macos_build') or '?'})" if m.get("macos") else f"{m['os']} {m['arch']}"],
            ["Python", m.get("python")], ["torch", m.get("torch")], ["bitsandbytes", m.get("bitsandbytes")],
            ["mps device", "available" + ("" if m.get("mps_bfloat16") in (None, True) else ", no bfloat16")
             if m.get("mps_available") else "not available"]]
    out.append(markdown_table(["", ""], rows))
    out += ["", "## Metal and executor tiers", ""]
    unavailable = "; ".join(f"{k}: {v}" for k, v in (tiers.get("unavailable") or {}).items())
    rows = [["tier that loaded", f"{tiers.get('tier')} ({tiers.get('reason')})"],
            ["tiers that did not load", unavailable or "none"],
            ["native library", metal.get("native_library")],
            ["native kernels from", metal.get("native_kernels_from") or "n/a"],
            ["Metal language version requested", f"{metal.get('language_version')}; {metal.get('language_version_source')}"],
            ["OS Metal support (system_profiler)", metal.get("os_metal_support") or "n/a"],
            ["shader tier (torch.mps.compile_shader)", metal.get("shader_tier")]]
    out.append(markdown_table(["", ""], rows))
    out += ["", "## Steps", ""]
    rows = [[s["name"], _step_result(s), f"{s['seconds']:.0f} s", s.get("note") or ""] for s in r["steps"]]
    out.append(markdown_table(["step", "result", "time", "note"], rows))
    for s in r["steps"]:
        if s.get("timed_out"):
            out += ["", f"### Timed out: {s['name']} (after {s['seconds']:.0f} s; the last lines of its output)", "",
                    "```", (s.get("output") or "(no output)").replace("```", "` ` `"), "```"]
    t = r["tests"]
    if t:
        totals = t["totals"]
        out += ["", f"## Tests: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped", ""]
        out += ["### Kernel families on the GPU tiers (tests/test_mps.py)", ""]
        rows = []
        for fam, by_tier in t["gpu_families"].items():
            rows.append([fam, r["families"].get(fam, ()), *[_counts(by_tier.get(tier, {})) for tier in GPU_TIERS]])
        out.append(markdown_table(["family", "ops", *GPU_TIERS], rows) if rows else "(none ran)")
        out += ["", "### CPU round trip on mps tensors, with in-place write-back (BNB_MPS_EXECUTOR=cpu)", ""]
        op_tiers = tiers.get("ops") or {}
        rows = [[op, (op_tiers.get(op) or {}).get("tier", "?"), _counts(b)] for op, b in t["cpu_round_trip"].items()]
        out.append(markdown_table(["op", "tier by default", "round trip"], rows) if rows else "(none ran)")
        out += ["", "### Other tests, per file", ""]
        rows = [[f, b["passed"], b["failed"], b["skipped"]] for f, b in t["files"].items()]
        out.append(markdown_table(["file", "passed", "failed", "skipped"], rows) if rows else "(none)")
        failures = [(name, msg) for group in _all_buckets(t) for name, msg in [(group[0], f) for f in group[1]]]
        if failures:
            out += ["", "### Failures", ""]
            out += [f"- {where}: `{msg}`" for where, msg in failures[:40]]
            if len(failures) > 40:
                out.append(f"- ... and {len(failures) - 40} more (see the pytest log)")
    out += ["", "## Kernel verification (python -m bnb_mps verify)", "", verification_markdown(r.get("verification", {}))]
    out += ["", "## Float semantics on this GPU (scripts/probe_math_mode.py)", "", math_mode_markdown(r.get("math_mode"))]
    out += ["", "## Tuning: the routes of 4-bit linear layers on this machine (python -m bnb_mps tune)", "",
            tuning_markdown(r.get("tuning"), r.get("tuning_chart"))]
    out += ["", "## Benchmarks", ""]
    for name, bench in r["benchmarks"].items():
        out += [f"### {name}", "", bench["note"] if bench.get("note") else benchmark_markdown(bench.get("data")), ""]
    if tiers.get("ops"):
        out += ["## Which tier serves each op (python -m bnb_mps)", ""]
        out.append(markdown_table(["op", "tier", "reason"], [[k, v.get("tier"), v.get("reason")] for k, v in tiers["ops"].items()]))
    return "\n".join(out).rstrip() + "\n"


def _all_buckets(t: dict[str, Any]):
    for fam, by_tier in t["gpu_families"].items():
        for tier, b in by_tier.items():
            yield (f"{fam} on {tier}", b.get("failures", []))
    for op, b in t["cpu_round_trip"].items():
        yield (f"CPU round trip of {op}", b.get("failures", []))
    for f, b in t["files"].items():
        yield (f, b.get("failures", []))


# -- putting it together ------------------------------------------------------------------------------


BENCHMARKS = (("kernels (scripts/bench_kernels.py --short)", "bench_kernels.json", "scripts/bench_kernels.py"),
              ("optimizers (scripts/bench_optimizers.py --short)", "bench_optimizers.json", "scripts/bench_optimizers.py"),
              ("host cost per op call (scripts/bench_op_overhead.py --native)", "bench_op_overhead.json",
               "scripts/bench_op_overhead.py"))


def build_report(work: Path, dry_run: bool, repo: Path = REPO) -> dict[str, Any]:
    machine = machine_info()
    families = load_families(repo)
    tests = parse_junit(work / "junit.xml")
    benchmarks: dict[str, Any] = {}
    for title, filename, script in BENCHMARKS:
        data = read_benchmark(work / filename)
        note = None
        if not (repo / script).is_file():
            note = f"not available: {script} is not in this checkout yet"
        elif data is None:
            note = "not run (see the steps above)"
        benchmarks[title] = {"data": data, "note": note}
    report = {
        "generated": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "dry_run": dry_run,
        "git": git_info(repo),
        "machine": machine,
        "metal": metal_info(machine.get("macos"), repo),
        "tiers": tier_info(),
        "steps": read_steps(work / "steps.tsv"),
        "families": families,
        "tests": group_tests(tests, families) if tests else None,
        "benchmarks": benchmarks,
        "verification": {"cold": read_benchmark(work / "verify_cold.json"),
                         "cached": read_benchmark(work / "verify_cached.json"),
                         "fault": read_benchmark(work / "verify_fault.json")},
        "math_mode": read_benchmark(work / "probe_math_mode.json"),
        "tuning": read_benchmark(work / "tune.json"),
        "tuning_chart": "tune.png" if (work.parent / "tune.png").is_file() else None,
    }
    report["verdict"] = verdict(report)
    return report


def write_report(report: dict[str, Any], out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / REPORT_MD, out / REPORT_JSON
    md.write_text(render_markdown(report))
    js.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return md, js


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where acceptance-report.md/.json go")
    parser.add_argument("--work", required=True, help="the shell script's work directory (steps.tsv, junit.xml, bench_*.json)")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--repo", default=str(REPO))
    ns = parser.parse_args(argv)
    report = build_report(Path(ns.work), ns.dry_run, Path(ns.repo))
    md, js = write_report(report, Path(ns.out))
    print(f"{report['verdict']}\nreport: {md}\n        {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
