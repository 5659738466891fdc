import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # shared test helpers (op_inputs, references)

import tiers  # noqa: E402

TESTS = Path(__file__).resolve().parent


def _mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()


def pytest_addoption(parser):
    parser.addoption(
        "--kernel-coverage", action="store_true",
        help="fail the run unless every kernel of the library was launched under the emulator (the rule for "
        "`slow` markers: the default run covers every kernel variant; scripts/test.sh sets it for a full run)",
    )  # fmt: skip


_launched_kernels: set = set()


def pytest_configure(config):
    if not config.getoption("--kernel-coverage"):
        return
    from bnb_mps.emulator.library import Library

    for name in ("launch", "profile"):
        original = getattr(Library, name)

        def recording(self, kernel, *args, _original=original, **kwargs):
            _launched_kernels.add(kernel)
            return _original(self, kernel, *args, **kwargs)

        setattr(Library, name, recording)


_coverage_report: list = []  # (line, failed) for the terminal summary


def pytest_sessionfinish(session, exitstatus):
    if not session.config.getoption("--kernel-coverage") or exitstatus != 0:
        return
    from bnb_mps import emulator
    from bnb_mps.executors import emulated

    try:
        kernels = set(emulated.unit_libraries().kernels)  # (the session's compiled units, at Metal 3.1)
        # and the kernels compiled from Metal 3.2 only (the one-dispatch split-K kernels)
        from bnb_mps.msl import source

        at_3_2 = emulated.compile_unit("gemm_4bit_splitk", source.units()["gemm_4bit_splitk"], metal_version="3.2")
        kernels |= set(at_3_2.kernels)
    except emulator.EmulatorError as e:
        _coverage_report.append((f"kernel coverage: not checked, no emulator here ({e})", False))
        return
    missing = sorted(kernels - _launched_kernels)
    if missing:
        _coverage_report.append((f"kernel coverage: {len(missing)} of {len(kernels)} kernels never launched under "
                                 f"the emulator in this run: {', '.join(missing)}", True))  # fmt: skip
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    else:
        _coverage_report.append((f"kernel coverage: all {len(kernels)} kernels launched under the emulator", False))


def pytest_terminal_summary(terminalreporter):
    for line, failed in _coverage_report:
        terminalreporter.write_line(line, red=failed, bold=failed)


def pytest_collection_modifyitems(config, items):
    # Tiers (tests/tiers.py): each test carries its module's tier marker, unless it has one of its own.
    for item in items:
        if not any(item.get_closest_marker(t) for t in tiers.TIERS):
            relative = Path(str(item.fspath)).resolve().relative_to(TESTS).as_posix()
            item.add_marker(getattr(pytest.mark, tiers.tier_of(relative)))
    # `slow` cases (the long tails of matrices whose every kernel variant the default run already
    # covers) run only when selected: `pytest -m slow`, or any -m expression naming slow.
    if "slow" not in (config.getoption("-m") or ""):
        skip_slow = pytest.mark.skip(reason="slow: run with -m slow")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip_slow)
    if _mps_available():
        return
    skip = pytest.mark.skip(reason="needs Apple Silicon with a working mps device")
    for item in items:
        if "mps" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def library():
    """The project's kernels under the emulator, one emulator Library per compile unit built once per
    test session (shared with the emulated executor), used as one library of all kernels: `launch`,
    `profile`, `kernels` dispatch by kernel name (bnb_mps.executors.emulated.UnitLibraries)."""
    from bnb_mps import emulator
    from bnb_mps.executors import emulated

    try:
        emulator.library._runtime()
    except emulator.EmulatorError as e:  # the runtime extension is not built here
        pytest.skip(str(e))
    libraries = emulated.unit_libraries()
    if libraries.failures:  # the project's own kernels must compile
        pytest.fail("kernel compile units that do not compile under the emulator:\n"
                    + "\n".join(f"{u}.metal: {m}" for u, m in libraries.failures.items()), pytrace=False)
    return libraries


@pytest.fixture(scope="session")
def library32(library):
    """The split-K compile unit (csrc/kernels/gemm_4bit_splitk.metal) under the emulator at Metal 3.2,
    where its one-dispatch kernel exists (below 3.2 it is not compiled: the session's `library` has the
    two-dispatch kernels only)."""
    from bnb_mps.executors import emulated
    from bnb_mps.msl import source

    return emulated.compile_unit("gemm_4bit_splitk", source.units()["gemm_4bit_splitk"], metal_version="3.2")


@pytest.fixture(scope="session", autouse=True)
def _verification_cache(tmp_path_factory):
    """First-use verification's verdicts go to a file of this session (BNB_MPS_VERIFY_CACHE), never
    to the user's ~/.cache/bnb_mps/verify.json: stand-in tiers named "shader" and planted kernel
    faults would otherwise leave verdicts there under this machine's real keys. The emulator's
    compiled kernel modules stay where BNB_MPS_CACHE_DIR (or ~/.cache/bnb_mps) keeps them, shared
    across sessions: recompiling them costs tens of seconds per kernel source."""
    from bnb_mps.ops import verify

    path = tmp_path_factory.mktemp("verification") / "verify.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(verify.CACHE_ENV_VAR, str(path))
        verify.reset()
        yield path
    verify.reset()


@pytest.fixture(scope="session", autouse=True)
def _tuning_cache(tmp_path_factory):
    """Tuning's choices go to a file of this session (BNB_MPS_TUNE_CACHE), never to the user's
    ~/.cache/bnb_mps/tune.json: timings fixed by tests (bnb_mps.testing.fixed_timings) would otherwise
    decide the user's routes under this machine's real keys."""
    from bnb_mps.ops import tuning

    path = tmp_path_factory.mktemp("tuning") / "tune.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(tuning.CACHE_ENV_VAR, str(path))
        yield path


@pytest.fixture(autouse=True)
def _bnb_mps_kernels_reinstated():
    """Ops that a test's calls handed back to bitsandbytes (no GPU tier here) are registered
    again afterwards, so that every test starts with bnb_mps' kernels in place."""
    yield
    from bnb_mps import registration

    if registration.skipped():
        registration.reinstate()


@pytest.fixture
def fresh_tier_selection(monkeypatch):
    """Let a test choose BNB_MPS_EXECUTOR; the tier choice is recomputed before and after."""
    from bnb_mps import executors

    monkeypatch.delenv("BNB_MPS_EXECUTOR", raising=False)
    executors.reset()
    yield monkeypatch
    monkeypatch.undo()
    executors.reset()


@pytest.fixture
def offline(monkeypatch):
    """No network (the transformers tests build their models from configs): huggingface_hub reads
    the variables at import, so its constant is patched too."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(params=["native", "shader"])
def executor(request):
    """Each GPU tier in turn (for `mps` tests); skipped where the tier does not load."""
    from bnb_mps import executors
    from bnb_mps.executors.base import ExecutorUnavailable

    try:
        return executors.load_tier(request.param)
    except ExecutorUnavailable as e:
        pytest.skip(f"{request.param} tier unavailable: {e}")


@pytest.fixture(autouse=True)
def _tier_guard(request):
    """What a test's tier allows (tests/tiers.py): a `unit` test starts no subprocess and launches
    nothing on the emulator; a `kernels` test runs no program of the project's in a subprocess (Python,
    a script: the emulator's own compiler runs are its business)."""
    unit, kernels = (request.node.get_closest_marker(t) is not None for t in ("unit", "kernels"))
    if not (unit or kernels):
        yield
        return
    tier = "unit" if unit else "kernels"
    # (a MonkeyPatch of its own, undone last: the test's `monkeypatch` must be undone before the
    # other fixtures' teardowns, which an autouse fixture requesting it would delay)
    monkeypatch = pytest.MonkeyPatch()

    def violation(what):
        return tiers.TierViolation(f"a `{tier}` test {what}: mark it (or list its module) as a later tier in "
                                   "tests/tiers.py")

    popen_init = subprocess.Popen.__init__

    def guarded_popen(self, args, *rest, **kwargs):
        command = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        program = os.path.basename(str(command[0])) if command else ""
        if unit or program.startswith("python") or os.path.realpath(str(command[0])) == os.path.realpath(
                sys.executable) or program in ("bash", "sh") or program.endswith(".sh"):  # fmt: skip
            raise violation(f"started a subprocess ({' '.join(map(str, command))[:120]})")
        popen_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded_popen)
    if unit:
        from bnb_mps.emulator import library

        def refused(*args, **kwargs):
            raise violation("used the emulator")

        monkeypatch.setattr(library, "_runtime", refused)
    try:
        yield
    finally:
        monkeypatch.undo()
