"""scripts/mac_acceptance.sh and its report (scripts/acceptance_report.py): the report module on
synthetic inputs, and the script's dry run end to end (everything except the mps parts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from script_loader import load_script

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "mac_acceptance.sh"


def load_report_module():
    return load_script("acceptance_report.py")


ar = load_report_module()

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="8">
<testcase classname="tests.test_mps" name="test_family_on_gpu[blockwise_8bit-n1-native]" time="0.5"/>
<testcase classname="tests.test_mps" name="test_family_on_gpu[blockwise_8bit-n1-shader]" time="0.5">
  <failure message="AssertionError: quantize_blockwise n=1: result[0]: 1 of 1 elements differ">trace</failure></testcase>
<testcase classname="tests.test_mps" name="test_family_on_gpu[nf4_fp4-n3-native]" time="0.1">
  <skipped message="the native tier is unavailable here: not built"/></testcase>
<testcase classname="tests.test_mps" name="test_cpu_round_trip_on_mps[gemv_4bit.out-torch.float16-nf4]" time="0.2"/>
<testcase classname="tests.test_mps" name="test_cpu_round_trip_on_mps[gemv_4bit.out-torch.float32-nf4]" time="0.2">
  <error message="RuntimeError: boom"/></testcase>
<testcase classname="tests.test_kernels_quant" name="test_8bit_all_orders[forward-0]" time="1.0"/>
<testcase classname="tests.test_kernels_quant" name="test_4bit_all_orders[forward-0]" time="1.0"/>
<testcase classname="tests.test_device" name="test_x" time="0.0"><skipped message="no mps"/></testcase>
</testsuite></testsuites>
"""
FAMILIES = {"blockwise_8bit": ("quantize_blockwise",), "nf4_fp4": ("quantize_4bit",)}


def test_junit_is_grouped_per_family_and_tier_per_op_and_per_file(tmp_path):
    (tmp_path / "junit.xml").write_text(JUNIT)
    tests = ar.parse_junit(tmp_path / "junit.xml")
    assert len(tests) == 8
    g = ar.group_tests(tests, FAMILIES)
    assert g["totals"] == {"passed": 4, "failed": 2, "skipped": 2}
    fam = g["gpu_families"]
    assert fam["blockwise_8bit"]["native"]["passed"] == 1 and fam["blockwise_8bit"]["shader"]["failed"] == 1
    assert "1 of 1 elements differ" in fam["blockwise_8bit"]["shader"]["failures"][0]
    assert fam["nf4_fp4"]["native"]["skipped"] == 1 and "not built" in fam["nf4_fp4"]["native"]["skip_reason"]
    assert g["cpu_round_trip"]["gemv_4bit.out"]["passed"] == 1 and g["cpu_round_trip"]["gemv_4bit.out"]["failed"] == 1
    assert g["files"]["tests/test_kernels_quant.py"]["passed"] == 2
    assert g["files"]["tests/test_device.py"]["skipped"] == 1


def fake_report(tmp_path, junit=JUNIT, dry_run=False, steps=((("test suite", 0, 3.0),))):
    work = tmp_path / "work"
    work.mkdir(parents=True)
    (work / "junit.xml").write_text(junit)
    (work / "steps.tsv").write_text("".join(f"{n}\t{rc}\t{s}\tlog\t\n" for n, rc, s in steps))
    (work / "bench_kernels.json").write_text(json.dumps({"mode": "gpu", "cases": [
        {"family": "quant", "name": "quantize_4bit nf4", "required_bytes": 1, "ms": 0.5, "gbps": 100.0,
         "pct_of_peak": 50.0, "stock_ms": 1.0}]}))
    report = ar.build_report(work, dry_run, REPO)
    report["families"] = FAMILIES
    report["tests"] = ar.group_tests(ar.parse_junit(work / "junit.xml"), FAMILIES)
    report["verdict"] = ar.verdict(report)
    return report


def test_report_files_hold_the_machine_tiers_tests_and_benchmarks(tmp_path):
    report = fake_report(tmp_path)
    md_path, json_path = ar.write_report(report, tmp_path / "out")
    md = md_path.read_text()
    data = json.loads(json_path.read_text())
    assert md_path.name == "acceptance-report.md" and json_path.name == "acceptance-report.json"
    assert report["verdict"].startswith("FAIL (2 failed tests")
    for text in ("## Machine", "torch", "bitsandbytes", "Metal language version requested", "tier that loaded",
                 "| blockwise_8bit | quantize_blockwise | passed (1/1) | FAILED (1 of 1) |",
                 "| gemv_4bit.out |", "tests/test_kernels_quant.py", "| quantize_4bit nf4 | 0.5 | 100 | 50% | 1 | 2.00x |",
                 "scripts/bench_optimizers.py"):
        assert text in md, text
    assert data["machine"]["python"] and data["tests"]["totals"]["failed"] == 2
    assert data["benchmarks"]["kernels (scripts/bench_kernels.py --short)"]["data"]["mode"] == "gpu"


def test_verdicts(tmp_path):
    passing = JUNIT.replace('<failure message="AssertionError: quantize_blockwise n=1: result[0]: 1 of 1 elements differ">trace</failure>', "")
    passing = passing.replace('<error message="RuntimeError: boom"/>', "")
    assert fake_report(tmp_path / "a", passing)["verdict"] == "PASS"
    assert fake_report(tmp_path / "b", passing, steps=[("kernel benchmarks (short)", 1, 2.0)])["verdict"].startswith("FAIL")
    assert fake_report(tmp_path / "c", passing, dry_run=True)["verdict"].startswith("DRY RUN passed")
    none_ran = ('<testsuites><testsuite><testcase classname="tests.test_mps" name="test_family_on_gpu[nf4_fp4-n3-native]">'
                '<skipped message="x"/></testcase></testsuite></testsuites>')
    assert fake_report(tmp_path / "d", none_ran)["verdict"].startswith("INCOMPLETE")


def test_metal_language_version_is_what_the_native_library_requests():
    assert ar.metal_info("15.1")["language_version"].startswith("MSL 3.2")
    assert ar.metal_info("26.0")["language_version"].startswith("MSL 3.2")
    assert ar.metal_info("14.5")["language_version"].startswith("MSL 3.1")
    assert "no version requested" in ar.metal_info("13.6")["language_version"]
    assert ar.metal_info(None)["language_version"].startswith("n/a")
    # the rule quoted in the report is the one in the source
    mm = (REPO / "csrc" / "mps_ops.mm").read_text()
    assert "MTLLanguageVersion3_2" in mm and "MTLLanguageVersion3_1" in mm and "@available(macOS 15.0, *)" in mm


def test_benchmark_tables_for_every_format():
    emulated = {"mode": "emulated", "cases": [{"name": "q", "launches": 1, "extra_alloc_bytes": 0,
                                               "host_reads": "none", "kernels": ["k"]}]}
    assert "| q | 1 | 0 | none | k |" in ar.benchmark_markdown(emulated)
    other = {"results": [{"optimizer": "adam", "ms": 1.5}]}
    assert "| optimizer | ms |" in ar.benchmark_markdown(other) and "| adam | 1.5 |" in ar.benchmark_markdown(other)
    assert ar.benchmark_markdown(None) == "(not run)"
    host = {"mode": "host", "metadata_key": "C++", "no_op_launch": {"torch_add_us": 2.0, "rows": {
        "gemv_4bit": {"total_us": 12.0, "floor_us": 10.0, "share_us": 2.0, "share_per_add": 1.0}}},
        "native": {"error": "the native tier does not serve here"}}  # fmt: skip
    md = ar.benchmark_markdown(host)
    assert "| gemv_4bit | 12 | 10 | 2 | 1.0x |" in md and "torch.add on tiny tensors: 2.00 us" in md
    assert "native tier, real launches on mps: not measured (the native tier does not serve here)" in md


def test_tuning_table_in_the_report():
    tune = {"tier": "native", "dtype": "float16", "meaningful": True, "seconds": 3.5, "rows": [
        {"shape": "4096x4096", "M": 1, "times": {"gemv": 1.1e-4, "gemv/tglut": 1.0e-4, "mma": 3e-4}, "choice": "gemv/tglut",
         "default": "gemv", "errors": {"batch": "RuntimeError: x"}, "gbps": 84.2, "share_of_peak": 0.7, "tflops": None,
         "dense_fp16_linear": 2.9e-4, "mlx_quantized_matmul": None}]}  # fmt: skip
    md = ar.tuning_markdown(tune, "tune.png")
    assert "| 4096x4096 | 1 | 0.11 | 0.1 * | 0.3 | gemv/tglut | gemv | 84.2 | 70% |  | 0.29 | - |" in md
    assert "- 4096x4096 M=1 batch: `RuntimeError: x`" in md and "![route times](tune.png)" in md
    assert "on the GPU's clock" in md and ar.tuning_markdown(None) == "(not run)"


def test_the_forced_command_buffer_error_in_the_report():
    """tests/command_buffer_fault.py's result: "could not be verified" and not cached is as it must be;
    anything else says FAILED (the step's exit status fails the run too)."""
    head = "A command-buffer error forced during verification"
    assert ar.fault_markdown(None) == f"{head} (tests/fault_kernels/address_fault.metal): not run."
    assert "not run (the native tier does not serve here: x)" in ar.fault_markdown(
        {"ran": False, "why": "the native tier does not serve here: x"})
    good = {"ran": True, "ok": True, "family": "int8_quant", "fault_launches": 42, "cached": False,
            "verdict": "could not be verified (case '(after the launches)'): the GPU reported an error in a command "
                       "buffer of the launches: Caused GPU Address Fault Error", "could_not_run": True,
            "device_error": True, "clean_after": "passed", "clean_passed": True}  # fmt: skip
    md = ar.fault_markdown(good)
    assert "42 fault launches in family int8_quant: as it must be" in md and "Caused GPU Address Fault Error" in md
    assert "cached: no; a clean verification right after: passed." in md
    bad = {**good, "ok": False, "cached": True, "verdict": "failed in case 'x': y", "could_not_run": False}
    assert "FAILED: it must be" in ar.fault_markdown(bad) and "cached: yes" in ar.fault_markdown(bad)
    assert "FAILED (boom)" in ar.fault_markdown({"ran": True, "ok": False, "why": "boom"})
    family_rows = {"cold": {"tier": "native", "kernels": "k", "seconds": 1.0, "families": {
        "nf4_fp4": {"passed": True, "first_failure": "failed in case 'q': 3 of 8 elements differ", "seconds": 0.1,
                    "launches": 4, "bytes": 8},
        "int8_quant": {"passed": False, "could_not_run": True, "case": "(after the launches)", "error": "GPU error",
                       "seconds": 0.1, "launches": 4, "bytes": 8}}}}  # fmt: skip
    md = ar.verification_markdown(family_rows)
    assert "passed (on a second run; the first failed in case 'q': 3 of 8 elements differ)" in md
    assert "COULD NOT RUN ((after the launches)): GPU error" in md


TIME_LIMIT = REPO / "scripts" / "time_limit.py"


def test_a_command_that_runs_out_of_time_is_stopped_with_what_it_started(tmp_path):
    """scripts/time_limit.py (macOS has no `timeout`): at the limit the command's whole process group
    is stopped (a child it started too), the status is 124 as GNU timeout's, the mark file says so,
    and the output written before the limit is kept."""
    mark, pid_file = tmp_path / "mark", tmp_path / "child.pid"
    hang = f"echo started; sleep 300 & echo $! > {pid_file}; wait"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(TIME_LIMIT), "2", "--mark", str(mark), "--", "bash", "-c", hang],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 124 and 2 <= time.monotonic() - t0  # (a real hang: the subprocess timeout)
    assert r.stdout.startswith("started") and "timed out after 2 s" in r.stderr
    assert mark.read_text().strip() == "timed out"
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.1)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # (a zombie is gone for our purpose)
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return True


@pytest.mark.parametrize("script, status", [("exit 0", 0), ("exit 3", 3), ("kill -TERM $$", 128 + 15)])
def test_a_command_within_its_limit_keeps_its_exit_status(tmp_path, script, status):
    mark = tmp_path / "mark"
    r = subprocess.run([sys.executable, str(TIME_LIMIT), "30", "--mark", str(mark), "--", "bash", "-c", script],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == status and not mark.exists() and "timed out" not in r.stderr


def test_a_timed_out_step_is_reported_with_its_output_and_the_planted_hang_must_time_out(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "hang.log").write_text("".join(f"line {i}\n" for i in range(100)) + "time_limit: timed out after 3 s\n")
    (work / "tune.log").write_text("tuning...\n")
    (work / "planted.log").write_text("planted step: hanging now\n")
    rows = [("planted", 124, 3, work / "planted.log", "must time out", "timed out", "timed-out"),
            ("tuning", 124, 3600, work / "tune.log", "", "timed out", ""),
            ("after", 0, 1, "", "", "", "")]
    (work / "steps.tsv").write_text("".join("\t".join(map(str, r)) + "\n" for r in rows))
    steps = ar.read_steps(work / "steps.tsv")
    assert [(s["timed_out"], s["planted_hang"]) for s in steps] == [(True, True), (True, False), (False, False)]
    assert [ar.step_failed(s) for s in steps] == [False, True, False]
    report = {"steps": steps, "tests": None, "dry_run": True}
    assert ar.verdict(report) == "FAIL (0 failed tests; failed steps: tuning)"
    planted_only = {**report, "steps": [steps[0], steps[2]]}
    assert ar.verdict(planted_only).startswith("DRY RUN passed")
    not_stopped = {**steps[0], "timed_out": False, "status": 0}
    assert ar.step_failed(not_stopped) and ar._step_result(not_stopped).startswith("DID NOT TIME OUT")
    assert ar._step_result(steps[0]) == "timed out (as planted)" and ar._step_result(steps[1]) == "timed out"
    assert steps[1]["output"] == "tuning..." and steps[0]["output"] == "planted step: hanging now"
    (work / "steps.tsv").write_text(f"hang\t124\t5\t{work}/hang.log\t\ttimed out\t\n")
    (long,) = ar.read_steps(work / "steps.tsv")
    lines = long["output"].splitlines()
    assert len(lines) == ar.TIMED_OUT_LINES and lines[0] == "line 61" and lines[-1].startswith("time_limit: timed out")


def test_refuses_to_run_without_apple_silicon(tmp_path):
    if sys.platform == "darwin":
        pytest.skip("this is a Mac")
    r = subprocess.run(["bash", str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "no mps device" in r.stderr and "--dry-run" in r.stderr
    assert not (tmp_path / "acceptance-report.md").exists()


@pytest.mark.skipif(os.environ.get("BNB_MPS_ACCEPTANCE") == "1", reason="inside an acceptance run already")
def test_dry_run_completes_and_writes_its_report(tmp_path):
    """The whole script on this machine, except the mps parts: a venv with bnb-mps installed into
    it (--no-build-isolation), python -m bnb_mps, part of the suite, the benchmarks' emulated mode."""
    env = {**os.environ, "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=900, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    md = (tmp_path / "acceptance-report.md").read_text()
    data = json.loads((tmp_path / "acceptance-report.json").read_text())
    assert data["dry_run"] and data["verdict"].startswith("DRY RUN passed")
    planted = "a hanging step is stopped (planted, dry run)"
    assert [s["name"] for s in data["steps"]][:10] == ["create the venv and install bnb-mps", "python -m bnb_mps",
                                                       planted, "test suite", "kernel verification (cold)",
                                                       "kernel verification (cached)",
                                                       "kernel verification meets a command-buffer error",
                                                       "math mode probes", "kernel benchmarks (short)",
                                                       "host cost per op call"]
    # every step ran under a time limit: the planted hang was stopped at its 3 s, recorded as timed out
    # with its output, and the run went on to the next steps, which passed
    hang = data["steps"][2]
    assert hang["timed_out"] and hang["status"] == 124 and 3 <= hang["seconds"]
    assert "planted step: hanging now" in hang["output"] and "timed out after 3 s" in hang["output"]
    assert "| timed out (as planted) |" in md and "### Timed out: " + planted in md
    assert all(s["status"] == 0 and not s["timed_out"] for s in data["steps"][:10] if s is not hang)
    # the float-semantics probes (the emulator here): every row rounds a*b + c twice, the fma control fuses
    rows = data["math_mode"]["rows"]
    assert {r["source"] for r in rows} == {"bare", "pinned"}
    assert all(r["probe_mad"]["contracted"] == 0 and r["probe_fma"]["contracted"] == r["probe_fma"]["distinguishing"]
               for r in rows)  # fmt: skip
    assert "## Float semantics on this GPU" in md and "contracted results in them: 0" in md
    # First-use verification, cold then from the cache (the emulated tier here: no GPU tier).
    cold, cached = data["verification"]["cold"], data["verification"]["cached"]
    assert cold["tier"] == "emulated" and all(f["passed"] and not f["cached"] for f in cold["families"].values())
    assert all(f["cached"] for f in cached["families"].values())  # (read, not run: no timing needed to tell)
    assert "## Kernel verification" in md and "Whole verification, cached" in md
    # The forced command-buffer error needs the native tier: not run here, and the report says why.
    assert data["verification"]["fault"] == {"ran": False, "why": data["verification"]["fault"]["why"]}
    assert "the native tier does not serve here" in md
    assert data["tests"]["totals"]["passed"] > 0 and data["tests"]["totals"]["failed"] == 0
    assert set(data["tests"]["gpu_families"]) >= {"blockwise_8bit", "nf4_fp4"}
    assert data["benchmarks"]["kernels (scripts/bench_kernels.py --short)"]["data"]["mode"] == "emulated"
    # the op layer's host cost per call, here without the native tier (said so in the report)
    overhead = data["benchmarks"]["host cost per op call (scripts/bench_op_overhead.py --native)"]["data"]
    assert overhead["mode"] == "host" and set(overhead["no_op_launch"]["rows"]) and "error" in overhead["native"]
    assert "op layer, kernel launch replaced by a no-op" in md and "native tier, real launches on mps: not measured" in md
    assert data["machine"]["torch"] and data["tiers"]["ops"]
    # python -m bnb_mps tune on a small shape (the emulated tier here: host-clock times, said so)
    tune = data["tuning"]
    assert tune["tier"] == "emulated" and not tune["meaningful"] and [r["M"] for r in tune["rows"]] == [1, 8, 40]
    assert "## Tuning" in md and "mean nothing for a GPU" in md and (tmp_path / "tune.png").is_file() == (
        "![route times](tune.png)" in md)  # fmt: skip
    # bnb-mps ran from the new venv, installed there
    venv_site = tmp_path / "acceptance-work" / "venv"
    assert list(venv_site.glob("lib/python*/site-packages/_editable_skbc_bnb_mps.pth"))
    assert "## Machine" in md and "## Benchmarks" in md
