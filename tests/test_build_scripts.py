"""The native build's CMake logic, run in CMake script mode with stand-ins for the tools it asks
(a Python that imports some torch, Apple's `xcrun`), since the build itself needs macOS.

csrc/torch_env.cmake: which torch the build links against vs the torch of the user's environment.
csrc/metal_toolchain.cmake: the offline Metal compiler, probed by compiling a one-line kernel.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CMAKE = shutil.which("cmake")
pytestmark = pytest.mark.skipif(CMAKE is None, reason="needs cmake")


def executable(path: Path, text: str) -> Path:
    path.write_text("#!/bin/sh\n" + text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def run_script(tmp_path: Path, body: str, env: dict | None = None) -> subprocess.CompletedProcess:
    script = tmp_path / "check.cmake"
    script.write_text(body)
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([CMAKE, "-P", str(script)], capture_output=True, text=True, cwd=tmp_path, env=full_env,
                          timeout=120)  # fmt: skip


# -- torch ---------------------------------------------------------------------------------------------


def fake_python(tmp_path: Path, build: str, user: str | None) -> Path:
    """A 'python' that imports torch `build` under pip's build isolation (PYTHONPATH set) and
    torch `user` (or none) without it; each as (version, abi, location) lines."""
    user_branch = f'printf "{user}"' if user is not None else 'echo "ModuleNotFoundError: torch" >&2; exit 1'
    return executable(tmp_path / "python", f'if [ -n "$PYTHONPATH" ]; then printf "{build}"; else {user_branch}; fi\n')


CHECK = """
include("{root}/csrc/torch_env.cmake")
bnb_mps_query_torch("{python}" BUILD)
if(NOT BUILD_FOUND)
  message(FATAL_ERROR "build torch not found")
endif()
message(STATUS "build torch ${{BUILD_VERSION}} abi ${{BUILD_CXX11_ABI}} at ${{BUILD_LOCATION}}")
bnb_mps_check_user_torch("{python}" BUILD)
"""


def check_torch(tmp_path, build, user):
    python = fake_python(tmp_path, build, user)
    return run_script(tmp_path, CHECK.format(root=ROOT, python=python), env={"PYTHONPATH": "/tmp/pip-build-env-x"})


def test_isolated_build_against_another_torch_warns_clearly(tmp_path):
    proc = check_torch(tmp_path, "2.14.1\\n0\\n/tmp/pip-build-env-x/torch\\n", "2.13.0\\n0\\n/venv/torch\\n")
    assert proc.returncode == 0, proc.stderr
    assert "build torch 2.14.1 abi 0 at /tmp/pip-build-env-x/torch" in proc.stdout
    err = " ".join(proc.stderr.split())
    assert "CMake Warning" in proc.stderr
    assert "torch 2.14.1 at /tmp/pip-build-env-x/torch" in err and "runs torch 2.13.0 at /venv/torch" in err
    assert "pip install --no-build-isolation" in err


def test_isolated_build_without_torch_in_the_user_environment_warns(tmp_path):
    proc = check_torch(tmp_path, "2.14.1\\n0\\n/tmp/pip-build-env-x/torch\\n", None)
    assert proc.returncode == 0, proc.stderr
    assert "has no importable torch" in " ".join(proc.stderr.split())


def test_the_same_torch_is_reported_without_a_warning(tmp_path):
    proc = check_torch(tmp_path, "2.13.0\\n0\\n/venv/torch\\n", "2.13.0\\n0\\n/venv/torch\\n")
    assert proc.returncode == 0, proc.stderr
    assert "CMake Warning" not in proc.stderr
    assert "the torch of this environment" in proc.stdout


def test_a_different_cxx11_abi_counts_as_another_torch(tmp_path):
    proc = check_torch(tmp_path, "2.13.0\\n1\\n/b/torch\\n", "2.13.0\\n0\\n/venv/torch\\n")
    assert "CMake Warning" in proc.stderr


# -- the offline Metal compiler --------------------------------------------------------------------------

PROBE = """
include("{root}/csrc/metal_toolchain.cmake")
bnb_mps_probe_metal_compiler(OK WHY "${{CMAKE_CURRENT_LIST_DIR}}/probe")
message(STATUS "probe ok=${{OK}} why=${{WHY}}")
message(STATUS "flags=${{BNB_MPS_METAL_FLAGS}}")
"""


def fake_xcrun(tmp_path: Path, metal_works: bool, takes_no_contract: bool = True) -> dict:
    """An `xcrun` that logs its arguments; `-f metal` always succeeds (as the real one does without
    the Metal toolchain); compiling works only when `metal_works`, and with -ffp-contract=off only
    when `takes_no_contract`."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "xcrun.log"
    compile_branch = (
        'for a; do out=$a; done; touch "$out"; exit 0' if metal_works else
        'echo "error: cannot execute tool \'metal\' due to missing Metal Toolchain" >&2; exit 1'
    )  # fmt: skip
    refuse = "" if takes_no_contract else '  *" metal "*"-ffp-contract=off"*) echo "error: unknown argument" >&2; exit 1;;\n'
    executable(bindir / "xcrun", f"""echo "$@" >> {log}
case "$*" in
  *"-f metal"*) echo /usr/bin/metal; exit 0;;
{refuse}  *" metal "*) {compile_branch};;
  *" metallib "*) for a; do out=$a; done; touch "$out"; exit 0;;
esac
exit 1
""")
    return {"PATH": f"{bindir}:{os.environ['PATH']}"}, log


def test_probe_compiles_a_kernel_with_the_build_flags(tmp_path):
    env, log = fake_xcrun(tmp_path, metal_works=True)
    proc = run_script(tmp_path, PROBE.format(root=ROOT), env=env)
    assert proc.returncode == 0, proc.stderr
    assert "probe ok=TRUE" in proc.stdout
    calls = log.read_text().splitlines()
    assert any(" metal " in c and "-std=metal3.1" in c and "-mmacosx-version-min=14.0" in c and "-fno-fast-math" in c
               for c in calls), calls  # fmt: skip
    assert any(" metallib " in c for c in calls), calls
    assert (tmp_path / "probe" / "probe.metal").read_text().startswith("kernel void")
    assert "flags=-std=metal3.1;-mmacosx-version-min=14.0;-fno-fast-math;-ffp-contract=off" in proc.stdout


def test_probe_adds_no_contract_only_where_the_compiler_takes_it(tmp_path):
    env, _ = fake_xcrun(tmp_path, metal_works=True, takes_no_contract=False)
    proc = run_script(tmp_path, PROBE.format(root=ROOT), env=env)
    assert proc.returncode == 0, proc.stderr
    assert "probe ok=TRUE" in proc.stdout
    assert "flags=-std=metal3.1;-mmacosx-version-min=14.0;-fno-fast-math\n" in proc.stdout.replace("\r", "")


def test_probe_fails_when_the_metal_toolchain_is_missing(tmp_path):
    env, _ = fake_xcrun(tmp_path, metal_works=False)
    proc = run_script(tmp_path, PROBE.format(root=ROOT), env=env)
    assert proc.returncode == 0, proc.stderr
    assert "probe ok=FALSE" in proc.stdout
    assert "missing Metal Toolchain" in proc.stdout and "cannot compile a one-line kernel" in proc.stdout


RECORD = """
include("{root}/csrc/torch_env.cmake")
set(BNB_MPS_OUTPUT_DIR "{out}")
set(T_VERSION "{version}")
set(T_CXX11_ABI {abi})
bnb_mps_build_record(_opkey_build.json T)
"""


@pytest.mark.parametrize("abi", [0, 1])
def test_the_build_record_is_what_the_loaders_read(tmp_path, abi):
    """bnb_mps_build_record (the native executor and bnb_mps._opkey) writes the record that
    bnb_mps.executors.native.build_mismatch reads: it accepts its own torch, refuses another."""
    from bnb_mps.executors import native

    out = tmp_path / "out"
    out.mkdir()
    proc = run_script(tmp_path, RECORD.format(root=ROOT, out=out, version="2.13.0+cpu", abi=abi))
    assert proc.returncode == 0, proc.stderr
    record = out / "_opkey_build.json"
    assert native.build_mismatch(record, ("2.13.0+cpu", bool(abi))) is None
    assert "2.12.0" in native.build_mismatch(record, ("2.12.0", bool(abi)))
    assert "C++11 ABI" in native.build_mismatch(record, ("2.13.0+cpu", not abi))
    for cmake in ("mps.cmake", "op_key.cmake"):
        assert "bnb_mps_build_record(" in (ROOT / "csrc" / cmake).read_text()


def test_the_native_build_uses_the_probe_and_says_which_path_it_took():
    text = (ROOT / "csrc" / "mps.cmake").read_text()
    assert "bnb_mps_probe_metal_compiler(" in text and "${_bnb_metal_flags}" in text
    assert "kernel library: offline metallib" in text and "kernel library: compiled from the embedded source" in text
    assert "bnb_mps_check_user_torch(" in text and "_native_build.json" in text
