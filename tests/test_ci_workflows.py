"""The macOS CI workflow (.github/workflows/macos.yml) and the kernel compile script it runs
(scripts/compile_metal.sh), checked here since neither GitHub's macOS runners nor Xcode exist on
this machine: the workflow's structure, and the script run against a stand-in `xcrun`."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from extras import missing

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "macos.yml"
COMPILE = ROOT / "scripts" / "compile_metal.sh"
KERNELS = ROOT / "csrc" / "kernels"
SPLITK = "gemm_4bit_splitk"
MACOS_MIN = {"metal3.1": "14.0", "metal3.2": "15.0", "metal4.0": "26.0"}


# -- the workflow ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workflow() -> dict:
    try:
        import yaml
    except ImportError as e:  # (pyyaml comes with transformers, a test extra)
        missing("pyyaml", f"transformers installs it: {e}")
    data = yaml.safe_load(WORKFLOW.read_text())
    assert isinstance(data, dict) and data.get("jobs"), "the workflow has no jobs"
    return data


def steps(workflow: dict) -> list[dict]:
    return [s for job in workflow["jobs"].values() for s in job.get("steps", [])]


def commands(workflow: dict) -> list[str]:
    """Every line of every `run:` of the workflow."""
    return [line.strip() for s in steps(workflow) for line in s.get("run", "").splitlines() if line.strip()]


def invocations(workflow: dict, script: str) -> list[list[str]]:
    """The arguments of each `bash <script> ...` line of the workflow."""
    found = []
    for line in commands(workflow):
        if line.startswith(f"bash {script}"):
            words = shlex.split(line)
            assert words[:2] == ["bash", script], line
            found.append(words[2:])
    return found


def ci_script() -> str:
    """The script .ci/run runs (`exec bash scripts/test.sh`)."""
    found = [m.group(1) for line in (ROOT / ".ci" / "run").read_text().splitlines() if not line.lstrip().startswith("#")
             for m in [re.match(r"\s*(?:exec\s+)?bash\s+(\S+\.sh)\b", line)] if m]  # fmt: skip
    assert len(found) == 1, found
    assert (ROOT / found[0]).is_file(), found
    return found[0]


def test_the_workflow_runs_on_macos_14_and_15_arm64_with_python_3_11(workflow):
    assert set(workflow.get("on", workflow.get(True))) >= {"push", "pull_request"}
    (job,) = workflow["jobs"].values()
    # macos-14 and macos-15 are GitHub's arm64 (Apple Silicon) runners; -intel / -large are x86-64
    assert set(job["strategy"]["matrix"]["os"]) == {"macos-14", "macos-15"}
    assert job["runs-on"] == "${{ matrix.os }}"
    assert any('[ "$(uname -m)" = arm64 ]' in line for line in commands(workflow))
    (setup,) = [s for s in steps(workflow) if s.get("uses", "").startswith("actions/setup-python@")]
    assert str(setup["with"]["python-version"]) == "3.11"


def test_the_workflow_builds_as_the_readme_says(workflow):
    readme = (ROOT / "README.md").read_text()
    assert "pip install --no-build-isolation -e ." in readme and "-c constraints.txt torch bitsandbytes" in readme
    lines = commands(workflow)
    assert any("pip install" in c and "-c constraints.txt torch bitsandbytes" in c for c in lines), lines
    assert any("pip install" in c and "--no-build-isolation" in c and c.endswith(" -e .") for c in lines), lines
    assert any("bnb_mps._native" in c for c in lines), "the workflow does not check that the native module was built"


def test_the_workflow_runs_the_script_ci_runs_deselecting_only_the_mps_tests(workflow):
    """scripts/test.sh (what .ci/run calls), with what its full gate adds (--kernel-coverage,
    --durations=25) and the `mps` tests deselected: the runners report an mps device that does not work, so
    tests/conftest.py's skip (torch.backends.mps.is_available()) would not skip them."""
    script = ci_script()
    assert script == "scripts/test.sh"
    (args,) = invocations(workflow, script)
    assert args == ["--kernel-coverage", "--durations=25", "-m", "not mps"], args
    assert "full=(--kernel-coverage --durations=25)" in (ROOT / script).read_text()  # (the full gate's arguments)
    assert "torch.backends.mps.is_available()" in (ROOT / "tests" / "conftest.py").read_text()
    (step,) = [s for s in steps(workflow) if f"bash {script}" in s.get("run", "")]
    assert str(step.get("env", {}).get("CI", "true")).lower() == "true"


def test_the_workflow_compiles_every_unit_at_metal3_1_and_3_2_and_tries_4_0(workflow):
    (args,) = [a for a in invocations(workflow, "scripts/compile_metal.sh") if "--probe" not in a]
    pairs = list(zip(args, args[1:]))
    assert ("--std", "metal3.1") in pairs and ("--std", "metal3.2") in pairs and ("--try-std", "metal4.0") in pairs
    assert "--unit" not in args and "--skip" not in args  # every unit
    names = [s.get("name", "") for s in steps(workflow)]
    compile_at = next(i for i, s in enumerate(steps(workflow)) if "compile_metal.sh --std" in s.get("run", ""))
    test_at = next(i for i, s in enumerate(steps(workflow)) if "scripts/test.sh" in s.get("run", ""))
    assert compile_at < test_at, names


def test_every_step_is_valid_bash_and_the_scripts_it_runs_exist(workflow):
    for step in steps(workflow):
        if "run" in step:
            proc = subprocess.run(["bash", "-n"], input=step["run"], capture_output=True, text=True)
            assert proc.returncode == 0, (step.get("name"), proc.stderr)
    for script in set(re.findall(r"bash (scripts/\S+\.sh)", WORKFLOW.read_text())):
        assert (ROOT / script).is_file(), script


# -- the compile script --------------------------------------------------------------------------------


def test_the_compile_script_is_bash_and_globs_the_kernel_units():
    assert COMPILE.is_file() and os.access(COMPILE, os.X_OK)
    proc = subprocess.run(["bash", "-n", str(COMPILE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = COMPILE.read_text()
    assert 'KERNELS="$ROOT/csrc/kernels"' in text and '"$KERNELS"/*.metal' in text
    assert "SPLITK=gemm_4bit_splitk" in text


def fake_xcrun(tmp_path: Path, fail: tuple[str, str] | None = None, no_std: tuple[str, ...] = (),
               no_contract: bool = False) -> tuple[dict, Path]:
    """A stand-in `xcrun` on PATH that logs its arguments (tab-separated, a line per call) and writes
    the file after -o. `fail` = (unit, version): that unit fails at that version with a compiler error;
    `no_std`: versions this "SDK" lacks (even a one-line kernel fails); `no_contract`: -ffp-contract=off
    refused."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "xcrun.log"
    rules = "".join(f'  *"-std={v} "*) echo "error: invalid value \'{v}\' in \'-std={v}\'" >&2; exit 1;;\n'
                    for v in no_std)
    if no_contract:
        rules += '  *"-ffp-contract=off"*) echo "error: unknown argument: \'-ffp-contract=off\'" >&2; exit 1;;\n'
    if fail:
        unit, version = fail
        rules += (f'  *"-std={version} "*"/{unit}.metal "*) echo "$src:3:1: error: planted fault" >&2;'
                  f' echo "1 error generated." >&2; exit 1;;\n')  # fmt: skip
    script = bindir / "xcrun"
    script.write_text(f"""#!/bin/sh
{{ for a; do printf '%s\\t' "$a"; done; echo; }} >> '{log}'
src=""; prev=""
for a; do [ "$prev" = -c ] && src=$a; prev=$a; done
case "$* " in
{rules}esac
for a; do out=$a; done
: > "$out"
exit 0
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}, log


def calls(log: Path) -> list[list[str]]:
    return [line.rstrip("\t").split("\t") for line in log.read_text().splitlines()] if log.exists() else []


def unit_calls(log: Path) -> list[list[str]]:
    """The compile calls of units (not of the one-line probe)."""
    return [c for c in calls(log) if c[2] == "metal" and not c[c.index("-c") + 1].endswith("probe.metal")]


def run(script: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=env, timeout=120)


def expected_units(kernels: Path) -> list[str]:
    names = sorted(p.stem for p in kernels.glob("*.metal"))
    return ([SPLITK] if SPLITK in names else []) + [n for n in names if n != SPLITK]


def expected_call(kernels: Path, unit: str, version: str, contract: bool = True) -> list[str]:
    return ["-sdk", "macosx", "metal", f"-std={version}", f"-mmacosx-version-min={MACOS_MIN[version]}",
            "-fno-fast-math", *(["-ffp-contract=off"] if contract else []), "-I", str(kernels), "-c",
            str(kernels / f"{unit}.metal"), "-o"]  # fmt: skip


def test_every_unit_is_compiled_at_each_version_with_the_build_flags(tmp_path):
    env, log = fake_xcrun(tmp_path)
    proc = run(COMPILE, env, "--std", "metal3.1", "--std", "metal3.2", "--try-std", "metal4.0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    units = expected_units(KERNELS)
    assert len(units) >= 5 and "gemm_4bit" in units
    versions = ["metal3.1", "metal3.2", "metal4.0"]
    assert proc.stdout.splitlines() == [f"{u} {v}: ok" for u in units for v in versions]
    made = unit_calls(log)
    assert [c[:-1] for c in made] == [expected_call(KERNELS, u, v) for u in units for v in versions]
    assert all(c[-1].endswith(".air") for c in made)


def test_the_flags_at_the_builds_version_are_the_native_builds(tmp_path):
    """csrc/metal_toolchain.cmake's BNB_MPS_METAL_FLAGS (the offline metallib's), then
    BNB_MPS_METAL_NO_CONTRACT where the compiler takes it."""
    cmake = (ROOT / "csrc" / "metal_toolchain.cmake").read_text()
    values = dict(re.findall(r'^set\((BNB_MPS_METAL_(?:STD|MACOS_MIN)) "([^"]+)"\)', cmake, re.M))
    flags = re.search(r"^set\(BNB_MPS_METAL_FLAGS (.*)\)$", cmake, re.M).group(1)
    for name, value in values.items():
        flags = flags.replace("${%s}" % name, value)
    no_contract = re.search(r"^set\(BNB_MPS_METAL_NO_CONTRACT (.*)\)$", cmake, re.M).group(1)
    assert "${" not in flags and values["BNB_MPS_METAL_STD"] == "metal3.1"
    env, log = fake_xcrun(tmp_path)
    unit = expected_units(KERNELS)[0]
    proc = run(COMPILE, env, "--std", values["BNB_MPS_METAL_STD"], "--unit", unit)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ((*args, _),) = unit_calls(log)
    assert args[3:args.index("-I")] == [*flags.split(), no_contract]


def test_the_split_k_unit_is_compiled_first_whatever_the_name_order(tmp_path):
    """In a tree of its own (the split-K unit may not exist in this checkout yet): gemm_4bit_splitk
    first, then the others in name order; the defaults are metal3.1, metal3.2 and (tried) metal4.0."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    kernels = repo / "csrc" / "kernels"
    kernels.mkdir(parents=True)
    shutil.copy(COMPILE, repo / "scripts" / COMPILE.name)
    for name in ("aaa", SPLITK, "gemm_4bit", "zzz"):
        (kernels / f"{name}.metal").write_text("// a unit\n")
    (kernels / "bnb_common.h").write_text("// a header, no unit\n")
    env, log = fake_xcrun(tmp_path)
    proc = run(repo / "scripts" / COMPILE.name, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    units = [SPLITK, "aaa", "gemm_4bit", "zzz"]
    versions = ["metal3.1", "metal3.2", "metal4.0"]
    assert proc.stdout.splitlines() == [f"{u} {v}: ok" for u in units for v in versions]
    assert [c[:-1] for c in unit_calls(log)] == [expected_call(kernels, u, v) for u in units for v in versions]
    # --unit / --skip: the split-K unit alone, then the others (as scripts/mac_acceptance.sh runs it)
    script = repo / "scripts" / COMPILE.name
    assert run(script, env, "--std", "metal3.1", "--unit", SPLITK).stdout == f"{SPLITK} metal3.1: ok\n"
    rest = run(script, env, "--std", "metal3.1", "--skip", SPLITK).stdout.splitlines()
    assert rest == [f"{u} metal3.1: ok" for u in units[1:]]
    assert run(script, env, "--unit", "nope").returncode == 2


def test_a_unit_that_fails_is_reported_with_its_first_error_and_fails_the_run(tmp_path):
    units = expected_units(KERNELS)
    bad = units[-1]
    env, log = fake_xcrun(tmp_path, fail=(bad, "metal3.2"))
    proc = run(COMPILE, env, "--std", "metal3.1", "--std", "metal3.2")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    expected = [f"{u} {v}: ok" for u in units for v in ("metal3.1", "metal3.2")]
    failed = f"{bad} metal3.2: FAILED: csrc/kernels/{bad}.metal:3:1: error: planted fault"
    expected[expected.index(f"{bad} metal3.2: ok")] = failed
    assert proc.stdout.splitlines() == expected
    assert len(unit_calls(log)) == 2 * len(units)  # (the others are still compiled)


def test_a_version_the_sdk_lacks_is_reported_and_fails_only_when_required(tmp_path):
    units = expected_units(KERNELS)
    env, log = fake_xcrun(tmp_path, no_std=("metal4.0",))
    proc = run(COMPILE, env, "--std", "metal3.2", "--try-std", "metal4.0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    why = "(error: invalid value 'metal4.0' in '-std=metal4.0')"
    assert proc.stdout.splitlines() == [line for u in units for line in
                                        (f"{u} metal3.2: ok", f"{u} metal4.0: not in this SDK {why}")]  # fmt: skip
    assert all("-std=metal4.0" not in c for c in unit_calls(log))
    proc = run(COMPILE, env, "--std", "metal4.0")
    assert proc.returncode == 1
    assert proc.stdout.splitlines() == [f"{u} metal4.0: FAILED: not in this SDK {why}" for u in units]
    probe = run(COMPILE, env, "--probe", "--std", "metal3.1", "--try-std", "metal4.0")
    assert probe.returncode == 0 and probe.stdout.splitlines()[1] == f"metal4.0: not in this SDK {why}"
    assert run(COMPILE, env, "--probe", "--std", "metal4.0").returncode == 1


def test_no_contract_is_passed_only_where_the_compiler_takes_it_and_metallib_links(tmp_path):
    units = expected_units(KERNELS)
    env, log = fake_xcrun(tmp_path, no_contract=True)
    proc = run(COMPILE, env, "--std", "metal3.1", "--metallib")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [f"{u} metal3.1: ok" for u in units]
    assert [c[:-1] for c in unit_calls(log)] == [expected_call(KERNELS, u, "metal3.1", contract=False) for u in units]
    linked = [c for c in calls(log) if c[2] == "metallib"]
    assert [(Path(c[3]).name, c[4], Path(c[5]).name) for c in linked] == [
        (f"{u}.metal3.1.air", "-o", f"{u}.metal3.1.metallib") for u in units]


@pytest.mark.skipif(shutil.which("xcrun") is not None, reason="this machine has an xcrun")
def test_without_xcrun_the_script_says_so(tmp_path):
    proc = run(COMPILE, dict(os.environ))
    assert proc.returncode == 2 and "no xcrun" in proc.stderr and proc.stdout == ""


# -- scripts/mac_acceptance.sh ----------------------------------------------------------------------------


def test_the_acceptance_run_compiles_the_split_k_unit_first_on_a_step_of_its_own():
    text = (ROOT / "scripts" / "mac_acceptance.sh").read_text()
    body = text[text.index("compile_kernels() {"):text.index("\n}\n", text.index("compile_kernels() {"))]
    assert "scripts/compile_metal.sh\" --probe" in body
    assert body.index("--unit gemm_4bit_splitk") < body.index("--skip gemm_4bit_splitk")
    assert 'step "compile the split-K unit (xcrun metal)"' in body
    # a real run compiles before everything else; the dry run after its other steps
    assert text.index('[ "$DRY" = 0 ] && compile_kernels') < text.index('step "create the venv and install bnb-mps"')
    assert text.index('step "tuning (python -m bnb_mps tune)"') < text.index('[ "$DRY" = 1 ] && compile_kernels')
    doc = (ROOT / "docs" / "mac-acceptance.md").read_text()
    assert "scripts/compile_metal.sh" in doc and "split-K unit" in doc
