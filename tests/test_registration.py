"""bnb_mps takes over every bitsandbytes schema on mps, quietly, undoably, and never breaks bitsandbytes."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import subprocess
import sys
import textwrap
import warnings

import pytest
import bitsandbytes  # noqa: F401  (its entry point registers bnb_mps)
import torch

import bnb_mps
from bnb_mps import executors, ops, registration

SCHEMAS_0_50 = {
    "quantize_blockwise", "dequantize_blockwise", "dequantize_blockwise.out", "quantize_4bit", "dequantize_4bit",
    "dequantize_4bit.out", "gemv_4bit", "gemv_4bit.out", "gemm_4bit", "int8_vectorwise_quant",
    "int8_vectorwise_dequant", "int8_linear_matmul", "int8_linear_matmul.out", "int8_mm_dequant", "int8_scaled_mm",
    "int8_mixed_scaled_mm", "int8_double_quant", "optimizer_update_8bit_blockwise", "optimizer_update_32bit",
}  # fmt: skip


def has_mps_kernel(name: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"bitsandbytes::{name}", "MPS")


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


@pytest.mark.model  # (a subprocess: tests/tiers.py)
def test_plain_import_of_bitsandbytes_registers_every_schema():
    """No import of bnb_mps: bitsandbytes' entry point does it."""
    proc = run_python(
        """
        import json, sys, torch
        import bitsandbytes
        names = sorted(n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("bitsandbytes::"))
        print(json.dumps({
            "loaded_by_entry_point": "bnb_mps" in sys.modules,
            "schemas": names,
            "mps": [n for n in names if torch._C._dispatch_has_kernel_for_dispatch_key("bitsandbytes::" + n, "MPS")],
        }))
        """
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["loaded_by_entry_point"]
    assert SCHEMAS_0_50 <= set(out["schemas"])
    assert set(out["mps"]) == set(out["schemas"]) & set(registration.SCHEMAS)
    assert SCHEMAS_0_50 <= set(out["mps"])


@pytest.mark.model  # (a subprocess: tests/tiers.py)
def test_entry_point_is_silent_and_cheap_on_linux():
    """Same output with and without bnb_mps' entry point, which loads only the registration
    module and its hooks (paged optimizers, AdEMAMix8bit state loads; the op layer, executors and emulator load on
    first use). Its time is printed by the
    test for information, not asserted (timings belong in benchmarks)."""
    code = """
        import importlib.metadata as md, time, sys
        import torch
        keep = {keep}
        orig = md.entry_points
        cost = []
        class Timed:
            def __init__(self, ep): self.ep, self.name = ep, ep.name
            def load(self):
                def run():
                    t = time.perf_counter(); self.ep.load()(); cost.append(time.perf_counter() - t)
                return run
        def patched(**kw):
            eps = orig(**kw)
            if kw.get("group") != "bitsandbytes.backends":
                return eps
            return [Timed(e) for e in eps if e.value.startswith("bnb_mps")] if keep else []
        md.entry_points = patched
        import bitsandbytes
        print("COST", cost[0] * 1e3 if cost else -1, file=sys.__stdout__)
        print("LOADED", sorted(m for m in sys.modules if m.startswith("bnb_mps")), file=sys.__stdout__)
    """
    with_ep = run_python(code.format(keep=True))
    without = run_python(code.format(keep=False))
    assert with_ep.returncode == 0 and without.returncode == 0, with_ep.stderr + without.stderr
    assert with_ep.stderr == without.stderr
    strip = lambda s: [line for line in s.splitlines() if not line.startswith(("COST", "LOADED"))]  # noqa: E731
    assert strip(with_ep.stdout) == strip(without.stdout)
    cost_ms = float(with_ep.stdout.split("COST")[1].split()[0])
    assert cost_ms > 0  # the entry point ran
    print(f"bnb_mps entry point: {cost_ms:.2f} ms")
    loaded = with_ep.stdout.split("LOADED")[1].strip()
    # the registration, and the hooks it installs (the paged-optimizer functions, AdEMAMix8bit's state
    # load: a few wrapped functions); the version (a constant); bitsandbytes' own kernels it keeps (stock)
    want = ("['bnb_mps', 'bnb_mps._version', 'bnb_mps.ademamix_layout', 'bnb_mps.paged', 'bnb_mps.registration', "
            "'bnb_mps.stock']")
    assert loaded == want, loaded


def test_registered_in_this_process():
    assert set(registration.registered("MPS")) == SCHEMAS_0_50
    assert all(has_mps_kernel(n) for n in SCHEMAS_0_50)


def test_schema_table_matches_the_op_layer():
    assert set(registration.SCHEMAS) == set(ops.OPS)
    for name, params in registration.SCHEMAS.items():
        assert tuple(inspect.signature(ops.OPS[name].check).parameters) == params, name
        schema = ops.op_packet(name)._schema
        assert tuple(a.name for a in schema.arguments) == params, name


@pytest.fixture
def restore_registration():
    yield
    registration._skipped.clear()
    registration.unregister("MPS")
    bnb_mps.register()
    assert set(registration.registered("MPS")) == SCHEMAS_0_50


def test_unregister_restores_bitsandbytes_kernels(restore_registration, fresh_tier_selection):
    """Stand in for bitsandbytes' own MPS kernel (it registers one on a Mac): ours overrides it
    without a warning (here serving through the forced CPU round trip) and unregistering brings
    it back."""
    fresh_tier_selection.setenv("BNB_MPS_EXECUTOR", "cpu")
    bnb_mps.unregister()
    assert not any(has_mps_kernel(n) for n in SCHEMAS_0_50)  # Linux: bitsandbytes has none

    theirs = torch.library.Library("bitsandbytes", "IMPL")
    calls = []
    theirs.impl("quantize_4bit", lambda *a: calls.append("bitsandbytes") or (torch.zeros(1, 1), torch.zeros(1)), "MPS")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            bnb_mps.register()
        ks = torch._C.DispatchKeySet(torch._C.DispatchKey.MPS)
        A = torch.randn(64, 64)
        packed, _ = torch.ops.bitsandbytes.quantize_4bit.default.redispatch(ks, A, 64, "nf4", torch.uint8)
        assert calls == [] and packed.shape == (2048, 1)
        bnb_mps.unregister()
        torch.ops.bitsandbytes.quantize_4bit.default.redispatch(ks, A, 64, "nf4", torch.uint8)
        assert calls == ["bitsandbytes"]
    finally:
        theirs._destroy()
    assert not has_mps_kernel("quantize_4bit")


def test_register_twice_is_a_no_op():
    lib = registration._libraries["MPS"]
    assert set(bnb_mps.register()) == SCHEMAS_0_50 and set(bnb_mps.register()) == SCHEMAS_0_50
    assert registration._libraries["MPS"] is lib  # nothing registered again


def test_entry_point_failure_is_logged_once_and_leaves_bitsandbytes_alone(restore_registration, monkeypatch, caplog):
    bnb_mps.unregister()

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(registration, "register", broken)
    monkeypatch.setattr(bnb_mps, "_entry_failed", False)
    with caplog.at_level("WARNING", logger="bnb_mps"):
        bnb_mps._entry_point()
        bnb_mps._entry_point()
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "boom" in caplog.records[0].getMessage()
    assert not any(has_mps_kernel(n) for n in SCHEMAS_0_50)


def test_failure_midway_registers_nothing(restore_registration, monkeypatch):
    bnb_mps.unregister()
    real = registration._make_kernel
    made = []

    def flaky(name, executor):
        made.append(name)
        if len(made) == 5:
            raise RuntimeError("fifth fails")
        return real(name, executor)


    monkeypatch.setattr(registration, "_make_kernel", flaky)
    bnb_mps._entry_point()
    assert not any(has_mps_kernel(n) for n in SCHEMAS_0_50)


def test_unknown_schema_is_left_to_bitsandbytes_and_reported():
    lib = torch.library.Library("bitsandbytes", "FRAGMENT")
    lib.define("bnb_mps_test_future_op(Tensor A) -> Tensor")
    try:
        assert "bnb_mps_test_future_op" in registration.unknown_schemas()
        info = bnb_mps.backend_info()["bnb_mps_test_future_op"]
        assert info["tier"] == "bitsandbytes" and "unknown" in info["reason"]
        assert not has_mps_kernel("bnb_mps_test_future_op")
    finally:
        lib._destroy()


@pytest.mark.parametrize("stock_cpu", ["this CPU", "AVX-512 model"])
def test_changed_schema_is_handed_back_to_bitsandbytes_on_first_call(restore_registration, monkeypatch, stock_cpu):
    """A bitsandbytes release whose gemv_4bit takes another argument: simulated by bnb_mps
    expecting one more. The first call hands the op back; bitsandbytes' kernel for mps answers it
    (its pure-PyTorch one here: the weight dequantized to A's dtype, then torch's linear), whatever
    bitsandbytes' CPU kernels are (also with those of a CPU with AVX-512, tests/stock_cpu_paths.py)."""
    bnb_mps.unregister()
    params = registration.SCHEMAS["gemv_4bit"] + ("new",)
    monkeypatch.setitem(registration.SCHEMAS, "gemv_4bit", params)
    monkeypatch.setattr(ops.OPS["gemv_4bit"], "check", lambda A, B, shapeB, absmax, code, blocksize, new=None: None)
    bnb_mps.register()
    assert has_mps_kernel("gemv_4bit")  # registration does not inspect schemas (it must stay cheap)
    assert "changed" in bnb_mps.backend_info()["gemv_4bit"]["reason"]

    import op_inputs
    import reference_matmul_4bit as R
    import stock_cpu_paths

    args = next(op_inputs.cases("gemv_4bit"))[1]
    with stock_cpu_paths.avx512_cpu() if stock_cpu != "this CPU" else contextlib.nullcontext():
        got = torch.ops.bitsandbytes.gemv_4bit.default.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.MPS),
                                                                  *args)  # fmt: skip
    A, B, shapeB, absmax, code, blocksize = args
    assert torch.equal(got, R.dequantize_then_linear(A, R.dequantized_weight(B, shapeB, blocksize, code, absmax)))
    assert not has_mps_kernel("gemv_4bit") and has_mps_kernel("gemm_4bit")
    assert "gemv_4bit" not in registration.registered("MPS")
    assert "changed" in registration.skipped()["gemv_4bit"]


def test_backend_info_names_a_tier_and_reason_for_every_op(fresh_tier_selection):
    info = bnb_mps.backend_info()
    assert SCHEMAS_0_50 <= set(info)
    for name in SCHEMAS_0_50:
        assert info[name]["tier"] in ops.routing.TIERS and info[name]["reason"]


def test_forced_cpu_tier(fresh_tier_selection):
    fresh_tier_selection.setenv("BNB_MPS_EXECUTOR", "cpu")
    sel = executors.selection()
    assert sel.tier == "cpu" and sel.executor is None and "BNB_MPS_EXECUTOR" in sel.reason


def test_invalid_tier_name_is_ignored_with_a_warning(fresh_tier_selection, caplog):
    fresh_tier_selection.setenv("BNB_MPS_EXECUTOR", "metal")
    with caplog.at_level("WARNING", logger="bnb_mps"):
        sel = executors.selection()
    assert "metal" in caplog.text and "native, shader, emulated, cpu" in caplog.text
    assert sel.tier in executors.TIERS


def test_unavailable_forced_tier_falls_back_with_reason(fresh_tier_selection):
    fresh_tier_selection.setenv("BNB_MPS_EXECUTOR", "native")
    sel = executors.selection()
    assert sel.tier != "native" and "BNB_MPS_EXECUTOR=native unavailable" in sel.reason


def test_slow_tier_message_once_per_process(fresh_tier_selection):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        executors.notify_slow_tier("quantize_4bit", "cpu", "native: not built")
        executors.notify_slow_tier("gemv_4bit", "cpu", "native: not built")
        executors.notify_slow_tier("gemv_4bit", "shader", "native: not built")
    assert len(caught) == 1 and issubclass(caught[0].category, executors.SlowTierWarning)
    msg = str(caught[0].message)
    assert "cpu tier" in msg and "native: not built" in msg and "pip install --no-build-isolation" in msg


def test_mps_calls_trigger_the_message_once_and_cpu_key_calls_do_not(fresh_tier_selection):
    """Calls through the MPS key on a slower route say so once per process; the emulated
    kernels registered for the CPU key (tests, debugging) never do."""
    from bnb_mps.testing import use_emulated_kernels

    fresh_tier_selection.setenv("BNB_MPS_EXECUTOR", "cpu")
    code = torch.linspace(-1, 1, 256)
    mps = torch._C.DispatchKeySet(torch._C.DispatchKey.MPS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if importlib.util.find_spec("bnb_mps._emu") is not None:
            with use_emulated_kernels():
                torch.ops.bitsandbytes.quantize_blockwise(torch.randn(64), code, 64)
        assert not [w for w in caught if issubclass(w.category, executors.SlowTierWarning)]
        for _ in range(2):
            torch.ops.bitsandbytes.quantize_blockwise.default.redispatch(mps, torch.randn(64), code, 64)
    slow = [w for w in caught if issubclass(w.category, executors.SlowTierWarning)]
    assert len(slow) == 1 and "quantize_blockwise" in str(slow[0].message) and "cpu tier" in str(slow[0].message)


@pytest.mark.model  # (a subprocess: tests/tiers.py)
def test_diagnostics_command():
    proc = subprocess.run([sys.executable, "-m", "bnb_mps"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for needle in ("platform", "macOS", "torch", "bitsandbytes", "mps available", "native lib", "executor tier"):
        assert needle in out
    for name in SCHEMAS_0_50:
        assert f"\n{name} " in out
    # Each distinct reason once, under a short key; the table rows fit a terminal.
    info = json.loads(subprocess.run([sys.executable, "-c", "import json, bnb_mps; print(json.dumps(bnb_mps.backend_info()))"],
                                     capture_output=True, text=True, timeout=300).stdout)  # fmt: skip
    rows = [ln for ln in out.splitlines() if ln.split(" ", 1)[0] in info]
    assert len(rows) == len(info) and max(map(len, rows)) <= 100
    keys = {ln.split()[-1] for ln in rows}
    assert len(keys) == len({row["reason"] for row in info.values()})
    flat = " ".join(out.split())
    for key in keys:
        assert flat.count(f"{key} ") == 1 + sum(1 for ln in rows if ln.split()[-1] == key)
    for reason in {row["reason"] for row in info.values()}:
        assert flat.count(" ".join(reason.split())) == 1


def test_forced_emulated_tier_serves_kernels_and_stages_other_devices(fresh_tier_selection):
    pytest.importorskip("bnb_mps._emu")
    fresh_tier_selection.setenv("BNB_MPS_EXECUTOR", "emulated")
    assert executors.selection().tier == "emulated"
    assert executors.executor_for("cpu").name == "emulated"
    assert isinstance(executors.executor_for("mps"), executors.StagedExecutor)
    for name, op in ops.OPS.items():
        assert ops.route(name).tier == "emulated" if op.kernel is not None else ops.route(name).tier != "emulated"

    # Staging: tensors go to the host for the launch and every one comes back (the device is
    # simulated: "to host" is a copy here).
    class Writer:
        name = "emulated"

        def launch(self, kernel, *, grid, threadgroup, args):
            args[1].copy_(args[0] * 2)

    src, dst = torch.arange(4.0), torch.zeros(4)
    staged = executors.StagedExecutor(Writer(), to_host=lambda t: t.clone())
    staged.launch("k", grid=(1, 1, 1), threadgroup=(1, 1, 1), args=[src, dst])
    assert torch.equal(dst, torch.arange(4.0) * 2)
