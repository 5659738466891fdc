"""A pytest plugin that runs bitsandbytes' own test suite on bnb-mps' kernels, under the emulator.

    BNB_TEST_DEVICE=cpu python -m pytest -p bnb_mps.testing_plugin PATH/TO/bitsandbytes/tests -k gemv_4bit

(`scripts/run_bitsandbytes_tests.py PATH [pytest args]` runs exactly that; docs/bitsandbytes_tests.md.)

bitsandbytes' tests choose their devices from BNB_TEST_DEVICE (tests/helpers.py, get_available_devices).
With `cpu`, their cases run on CPU tensors, and this plugin registers bnb-mps' emulated tier for the
`cpu` dispatch key for the whole session (`bnb_mps.testing.use_emulated_kernels`): every bitsandbytes op
with a Metal kernel is then served by that kernel, run by the emulator, with Apple's float semantics.
What is not a bitsandbytes op (the tests' references, bitsandbytes' pure-PyTorch code around the ops)
stays torch on the CPU.

So that a pass cannot silently come from bitsandbytes' own CPU code, the plugin records, per test, the
kernels that ran and the ops that served, prints a summary at the end (kernels, ops by the tier that
served them, and the tests that passed with none of bnb-mps' kernels), and can write them as JSON
(`--bnb-mps-report PATH`). `--bnb-mps-require-kernels` turns a pass without any kernel into a failure.

What an mps run does and a CPU run does not: bitsandbytes takes CPU-only paths where the CPU has
AVX512-BF16 (`bitsandbytes.functional.has_avx512bf16()`): its tests repack 4-bit weights into its own
CPU layout (`_convert_weight_packed_for_cpu`) and loosen their thresholds, and `Linear4bit` repacks at
its first eval forward. None of that exists on mps, so the plugin makes `has_avx512bf16()` answer False
for the session (in `bitsandbytes.functional` and `bitsandbytes.nn.modules`), on every machine: the tests
then take the path and the thresholds they take on mps. Other CPU-only branches (e.g. `MatMul8bitFp` for
int8 training on CPU) are bitsandbytes' own code on CPU tensors; the summary shows what they leave to
bnb-mps' kernels.

The emulator is slow (a 4096 x 16384 gemv takes seconds): select tests with -k, and keep the detection
settings at the executor's defaults (forward lane order, no race checking) unless asked
(`--bnb-mps-order`, `--bnb-mps-race-check`).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import pytest

DEVICE_VAR = "BNB_TEST_DEVICE"

#: where bitsandbytes asks whether the CPU has AVX512-BF16 (the names its modules call)
_AVX512BF16_PROBES = ("bitsandbytes.functional", "bitsandbytes.nn.modules")


@dataclass
class TestRecord:
    """What one test ran: bnb-mps kernels launched (name -> launches) and op calls served (op -> tier
    -> calls), from its setup to the end of its call phase; its outcome (of the call phase, or of the
    setup when that did not pass)."""

    outcome: str = "not run"
    kernels: Counter = field(default_factory=Counter)
    ops: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"outcome": self.outcome, "kernels": dict(self.kernels), "ops": self.ops}


def pytest_addoption(parser):
    group = parser.getgroup("bnb-mps", "bitsandbytes' tests on bnb-mps' emulated kernels")
    group.addoption("--bnb-mps-report", metavar="PATH", default=None,
                    help="write what each test ran (kernels, ops by tier, outcome) as JSON to PATH")
    group.addoption("--bnb-mps-require-kernels", action="store_true",
                    help="fail a test that passes without launching any of bnb-mps' kernels")
    group.addoption("--bnb-mps-order", choices=("forward", "reverse", "random"), default=None,
                    help="the emulator's lane order (default: the executor's, forward)")
    group.addoption("--bnb-mps-race-check", action="store_true",
                    help="check threadgroup memory for races in every launch (slower)")  # fmt: skip


def _diff_calls(before: dict, after: dict) -> dict:
    """{op: {tier: calls}} made between two `bnb_mps.ops.call_counts()` snapshots."""
    out: dict = {}
    for op, tiers in after.items():
        for tier, n in tiers.items():
            d = n - before.get(op, {}).get(tier, 0)
            if d:
                out.setdefault(op, {})[tier] = d
    return out


class EmulatedSession:
    """The plugin's state: the emulated registration for the session, and the per-test records."""

    def __init__(self, config) -> None:
        self.config = config
        self.records: dict[str, TestRecord] = {}
        self.recorder = None
        self._stack = contextlib.ExitStack()
        self._current: Optional[tuple[str, dict]] = None  # (nodeid, call counts at its start)

    # -- the session ----------------------------------------------------------------------------

    def start(self) -> None:
        import bitsandbytes  # noqa: F401  (its op schemas, before bnb-mps registers kernels for them)

        from . import testing
        from .executors.base import ExecutorUnavailable

        for name in _AVX512BF16_PROBES:
            module = __import__(name, fromlist=["has_avx512bf16"])
            if hasattr(module, "has_avx512bf16"):
                self._stack.enter_context(_patched(module, "has_avx512bf16", _no_avx512bf16))
        settings = {}
        if self.config.getoption("--bnb-mps-order"):
            settings["order"] = self.config.getoption("--bnb-mps-order")
        if self.config.getoption("--bnb-mps-race-check"):
            settings["race_check"] = True
        try:
            self.recorder = self._stack.enter_context(testing.use_emulated_kernels(**settings))
        except ExecutorUnavailable as e:
            self._stack.close()
            raise pytest.UsageError(f"bnb_mps.testing_plugin: the emulator is not available here: {e}") from None

    def stop(self) -> None:
        self._stack.close()

    # -- per test -------------------------------------------------------------------------------

    def begin(self, nodeid: str) -> None:
        from . import ops

        self.recorder.clear()  # (launches are described as they run: keep only this test's)
        self._current = (nodeid, ops.call_counts())
        self.records[nodeid] = TestRecord()

    def collect(self, nodeid: str) -> TestRecord:
        """The record of `nodeid` with what ran since `begin`."""
        from . import ops

        record = self.records[nodeid]
        if self._current is not None and self._current[0] == nodeid:
            record.kernels = Counter(self.recorder.launched)
            record.ops = _diff_calls(self._current[1], ops.call_counts())
        return record

    # -- the summary ----------------------------------------------------------------------------

    def summary(self) -> dict:
        kernels: dict[str, dict] = {}
        ops: dict[str, dict] = {}
        for nodeid, r in self.records.items():
            for k, n in r.kernels.items():
                e = kernels.setdefault(k, {"launches": 0, "tests": 0})
                e["launches"] += n
                e["tests"] += 1
            for op, tiers in r.ops.items():
                for tier, n in tiers.items():
                    ops.setdefault(op, {}).setdefault(tier, 0)
                    ops[op][tier] += n
        outcomes = Counter(r.outcome for r in self.records.values())
        no_kernel = sorted(n for n, r in self.records.items() if r.outcome == "passed" and not r.kernels)
        return {"outcomes": dict(outcomes), "kernels": kernels, "ops": ops, "passed_without_kernels": no_kernel,
                "tests": {n: r.as_dict() for n, r in self.records.items()}}  # fmt: skip


def _no_avx512bf16() -> bool:
    """bitsandbytes' has_avx512bf16() under this plugin: mps has no AVX512-BF16 path (see the module docstring)."""
    return False


@contextlib.contextmanager
def _patched(obj, name: str, value):
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


#: the markers bitsandbytes' pyproject.toml declares (its default run deselects all three)
_BITSANDBYTES_MARKERS = (
    "benchmark: mark test as a benchmark",
    "deprecated: mark test as covering a deprecated feature",
    "slow: mark test as slow",
)

_KEY = pytest.StashKey[EmulatedSession]()


def pytest_configure(config):
    device = os.environ.get(DEVICE_VAR)
    if device not in (None, "cpu"):
        raise pytest.UsageError(f"bnb_mps.testing_plugin runs bitsandbytes' tests on CPU tensors (which bnb-mps' "
                                f"emulated kernels serve): {DEVICE_VAR} must be 'cpu' or unset, got {device!r}")
    os.environ[DEVICE_VAR] = "cpu"  # (read by bitsandbytes' tests/helpers.py at collection)
    for marker in _BITSANDBYTES_MARKERS:  # (declared in bitsandbytes' pyproject.toml, not in its tests directory)
        config.addinivalue_line("markers", marker)
    config.stash[_KEY] = EmulatedSession(config)


def pytest_sessionstart(session):
    session.config.stash[_KEY].start()


def pytest_unconfigure(config):
    state = config.stash.get(_KEY, None)
    if state is not None:
        state.stop()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.config.stash[_KEY].begin(item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    state = item.config.stash[_KEY]
    if call.when == "teardown" or item.nodeid not in state.records:
        return
    if call.when == "setup" and report.passed:
        return
    record = state.collect(item.nodeid)
    record.outcome = report.outcome if call.when == "call" else f"{report.outcome} in setup"
    if hasattr(report, "wasxfail"):
        record.outcome = "xfailed" if report.skipped else "xpassed"
    elif report.skipped:
        record.outcome = "skipped"
    if (call.when == "call" and report.passed and not record.kernels
            and item.config.getoption("--bnb-mps-require-kernels")):  # fmt: skip
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} passed without launching any of bnb-mps' kernels "
                           "(--bnb-mps-require-kernels): what it tested was not bnb-mps")  # fmt: skip
        record.outcome = "failed: no kernel"


def pytest_sessionfinish(session, exitstatus):
    state = session.config.stash[_KEY]
    path = session.config.getoption("--bnb-mps-report")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(state.summary(), f, indent=1, sort_keys=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    state = config.stash.get(_KEY, None)
    if state is None:
        return
    s = state.summary()
    w = terminalreporter
    w.section("bnb-mps: what served bitsandbytes' tests")
    if not s["kernels"]:
        w.write_line("no bnb-mps kernel ran", red=True, bold=True)
    else:
        w.write_line(f"{'kernel (emulated)':<48} {'launches':>9} {'tests':>6}")
        for k, e in sorted(s["kernels"].items()):
            w.write_line(f"{k:<48} {e['launches']:>9} {e['tests']:>6}")
    if s["ops"]:
        w.write_line("bitsandbytes ops served, by tier (emulated: bnb-mps' kernels):")
        for op, tiers in sorted(s["ops"].items()):
            w.write_line(f"  {op:<40} " + ", ".join(f"{t} {n}" for t, n in sorted(tiers.items())))
    tests_run = sum(1 for r in state.records.values() if r.outcome not in ("not run", "skipped"))
    with_kernels = sum(1 for r in state.records.values() if r.kernels)
    w.write_line(f"{with_kernels} of {tests_run} tests (not counting skipped ones) launched bnb-mps kernels")
    passed_without = s["passed_without_kernels"]
    if passed_without:
        n = len(passed_without)
        w.write_line(f"{n} test{'s' if n != 1 else ''} passed without any bnb-mps kernel (what they test is not "
                     "served by a kernel):", yellow=True)  # fmt: skip
        for nodeid in passed_without[:20]:
            w.write_line(f"  {nodeid}")
        if len(passed_without) > 20:
            w.write_line(f"  ... and {len(passed_without) - 20} more (--bnb-mps-report lists them all)")
