"""Kernel compile units: every tier compiles each `.metal` file (with its includes inlined) as a
unit of its own, so that a unit that does not compile takes out only its own kernels.

A syntax error is planted at the end of int8.metal in a copy of the kernel source that
BNB_MPS_KERNEL_DIR points the tiers at. On the emulated tier (and on stand-ins for the shader and
native tiers that run the same unit texts under the emulator, binding arguments by those tiers'
rules), the int8 unit's kernels raise KernelUnavailable with the compiler's message, every other
unit's kernels run and compute what docs/semantics.md says (tests/spec_reference.py), first-use
verification fails exactly the int8 families with the compiler's message, and routing sends only
their ops elsewhere.
"""

from __future__ import annotations

import importlib.util
import itertools
import operator
import shutil
import types
from pathlib import Path

import pytest
import torch

import bnb_mps
import spec_reference as ref
from bnb_mps import executors
from bnb_mps.executors import emulated, native, shader
from bnb_mps.executors.base import KernelUnavailable
from bnb_mps.msl import source
from bnb_mps.ops import call
from bnb_mps.ops import verify as verification
from bnb_mps.ops.registry import OPS

if importlib.util.find_spec("bnb_mps._emu") is None:  # pragma: no cover
    pytest.skip("the emulator runtime is not built", allow_module_level=True)

from bnb_mps import emulator  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::bnb_mps.executors.SlowTierWarning"),
    pytest.mark.filterwarnings("ignore::bnb_mps.ops.verify.VerificationWarning"),
]

KERNELS = Path(__file__).resolve().parents[1] / "csrc" / "kernels"
UNITS = {"gemm_4bit", "gemm_4bit_splitk", "int8", "optimizer", "quantize_4bit", "quantize_8bit"}
BROKEN = "int8"  # the unit with the planted error, and its families
BROKEN_FAMILIES = {"int8_quant", "int8_products"}
PLANTED = "bnb_planted_syntax_error +;"


@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> tuple[Path, str]:
    """(a copy of the kernel source with a syntax error appended to int8.metal, "int8.metal:<its line>")."""
    d = tmp_path_factory.mktemp("broken") / "kernels"
    shutil.copytree(KERNELS, d)
    text = (d / "int8.metal").read_text()
    (d / "int8.metal").write_text(text + PLANTED + "\n")
    return d, f"int8.metal:{len(text.splitlines()) + 1}:"


@pytest.fixture
def kernel_dir(monkeypatch, broken):
    """BNB_MPS_KERNEL_DIR at the broken copy for the test."""
    monkeypatch.setenv(source.KERNEL_DIR_ENV, str(broken[0]))
    return broken


def unit_kernels(library, unit: str) -> list[str]:
    return library.units.libraries[unit].kernels


def check_other_units_compute(executor) -> None:
    """A kernel of each quantization unit, through the op layer, bit for bit against docs/semantics.md."""
    from bitsandbytes.functional import create_dynamic_map

    code = create_dynamic_map(signed=True)
    A = torch.randn(3 * 256 + 17, generator=torch.Generator().manual_seed(5)).to(torch.float16)
    q, absmax = call(OPS["quantize_blockwise"], (A, code, 256), {}, executor)  # quantize_8bit unit
    want_q, want_absmax = ref.quantize_blockwise(A, code, 256)
    assert torch.equal(q, want_q) and torch.equal(absmax, want_absmax)
    packed, absmax4 = call(OPS["quantize_4bit"], (A.reshape(1, -1)[:, :768], 64, "nf4", torch.uint8), {}, executor)
    want_packed, want_absmax4 = ref.quantize_4bit(A.reshape(1, -1)[:, :768], 64, "nf4")  # quantize_4bit unit
    assert torch.equal(packed, want_packed) and torch.equal(absmax4, want_absmax4)


def check_broken_unit(executor, kernels: list[str], where: str) -> None:
    """Every kernel of the broken unit raises KernelUnavailable naming the unit, the planted line and
    the compiler's message (in its first line: what verification records)."""
    assert kernels
    for kernel in kernels:
        with pytest.raises(KernelUnavailable) as info:
            executor.launch(kernel, grid=(1, 1, 1), threadgroup=(32, 1, 1), args=[])
        e = info.value
        assert e.kernel == kernel and e.units == (BROKEN,), (kernel, e.units)
        first = str(e).splitlines()[0]
        assert f"{BROKEN}.metal did not compile" in first and where in first and "bnb_planted_syntax_error" in first


# -- the project's units ---------------------------------------------------------------------------------


def test_one_unit_per_metal_file_with_its_includes_inlined():
    units = source.units()
    assert set(units) == UNITS == {p.stem for p in KERNELS.glob("*.metal")}
    for name, text in units.items():
        lines = text.splitlines()
        assert lines[0] == f'#line 1 "{name}.metal"' and text.isascii()
        assert not any(line.lstrip().startswith('#include "') for line in lines)  # local includes inlined
        assert text.count("#define BNB_KERNEL_INSTANTIATE") == 1  # bnb_common.h, once, in every unit
    assert source.units() is units  # read once per directory


def test_every_kernel_is_in_exactly_one_unit(library):
    """No host name in two units (in the one-text amalgamation that was a compile error; as units
    it would silently take the first), and every unit defines kernels."""
    per_unit = {u: set(unit_kernels(library, u)) for u in UNITS}
    assert all(per_unit.values())
    for a, b in itertools.combinations(UNITS, 2):
        assert not per_unit[a] & per_unit[b], (a, b, per_unit[a] & per_unit[b])
    assert set().union(*per_unit.values()) == set(library.kernels)
    for unit, kernels in per_unit.items():  # each unit's kernels are attributed to it from its text alone
        failed = executors.base.CompileUnits({}, {}, {u: "error: x" for u in UNITS}, source.units())
        assert all(failed.unavailable(k).units == (unit,) for k in kernels), unit


def test_the_source_hash_follows_every_unit(tmp_path):
    d = tmp_path / "kernels"
    shutil.copytree(KERNELS, d)
    hashes = {source.source_hash(source.amalgamate(d))}
    for f in ("int8.metal", "quantize_layout.h", "bnb_math_mode.h"):
        (d / f).write_text((d / f).read_text() + "// changed\n")
        hashes.add(source.source_hash(source.amalgamate(d)))
    assert len(hashes) == 4


# -- the emulated tier -----------------------------------------------------------------------------------


def test_emulated_a_broken_unit_takes_out_only_its_own_kernels(library, kernel_dir):
    ex = emulated.load()
    libs = ex._load()
    assert set(libs.failures) == {BROKEN}
    assert kernel_dir[1] in libs.failures[BROKEN] and "bnb_planted_syntax_error" in libs.failures[BROKEN]
    check_broken_unit(ex, unit_kernels(library, BROKEN), kernel_dir[1])
    for unit in UNITS - {BROKEN}:
        # the unchanged units were not compiled again: the same texts, the session's libraries
        assert libs.units.libraries[unit] is library.units.libraries[unit]
        assert all(k in libs for k in unit_kernels(library, unit))
    check_other_units_compute(ex)


def test_verification_fails_exactly_the_broken_units_families_and_routing_follows(fresh_tier_selection, tmp_path,
                                                                                   kernel_dir):  # fmt: skip
    mp = fresh_tier_selection
    mp.setenv("BNB_MPS_EXECUTOR", "emulated")
    mp.setenv("BNB_MPS_CACHE_DIR", str(tmp_path / "cache"))
    mp.delenv("BNB_MPS_VERIFY", raising=False)
    verification.reset()
    executors.reset()
    try:
        verdicts = bnb_mps.verify(tier="emulated", refresh=True)
        assert {n for n, v in verdicts.items() if not v.passed} == BROKEN_FAMILIES, {
            n: v.describe() for n, v in verdicts.items() if not v.passed}
        for name in BROKEN_FAMILIES:
            error = verdicts[name].error
            assert error.startswith("KernelUnavailable: ") and f"{BROKEN}.metal did not compile" in error
            assert kernel_dir[1] in error and "bnb_planted_syntax_error" in error  # the compiler's message
        bad_ops = {op for f in BROKEN_FAMILIES for op in verification.FAMILIES[f].ops}
        info = bnb_mps.backend_info()
        for op in {op for f in verification.FAMILIES.values() for op in f.ops}:
            if op in bad_ops:
                assert info[op]["tier"] in ("bitsandbytes", "cpu"), (op, info[op])
                assert "failed verification" in info[op]["reason"] and kernel_dir[1] in info[op]["reason"], info[op]
            else:
                assert info[op]["tier"] == "emulated", (op, info[op])
    finally:
        verification.reset()


def test_without_verification_an_op_of_the_broken_unit_moves_on_at_its_first_call(fresh_tier_selection, tmp_path,
                                                                                  kernel_dir, caplog):  # fmt: skip
    """BNB_MPS_VERIFY=0 (at the user's risk): nothing found the broken unit beforehand, so its kernel's
    launch refuses (KernelUnavailable) and the op takes the next route, with the compiler's line as
    the reason, as a refused pipeline does; the call still returns the next route's result."""
    from torch._C import DispatchKey, DispatchKeySet

    import op_inputs
    from bnb_mps import ops

    mp = fresh_tier_selection
    mp.setenv("BNB_MPS_EXECUTOR", "emulated")
    mp.setenv("BNB_MPS_VERIFY", "0")
    verification.reset()
    executors.reset()
    try:
        name = "int8_vectorwise_quant"
        args = next(op_inputs.cases(name))[1]
        got = ops.op_packet(name).redispatch(DispatchKeySet(DispatchKey.MPS), *args)
        r = ops.route(name)
        assert r.tier in ("bitsandbytes", "cpu") and f"{BROKEN}.metal did not compile" in r.reason, r
        want = ops.op_packet(name).redispatch(DispatchKeySet(DispatchKey.MPS), *args)  # now the next route's own
        for g, w in zip(got, want):
            assert (g is None and w is None) or torch.equal(g, w)
        assert ops.route("quantize_4bit").tier == "emulated"  # another unit's op keeps its kernels
        assert any(f"{name} is served by" in m for m in caplog.messages)
        from bnb_mps.__main__ import diagnostics

        report = diagnostics()  # python -m bnb_mps names the unit and the compiler's first error line
        assert f"compile unit {BROKEN}.metal did not compile: " in report and kernel_dir[1] in report
    finally:
        verification.reset()


# -- stand-ins for the GPU tiers: the same unit texts, run by the emulator ------------------------------

def emulator_library(text: str):
    """The emulator Library of a unit text (`#line 1 "<unit>.metal"` first), compiled once per
    process with the emulated tier's (bnb_mps.executors.emulated.compile_unit)."""
    return emulated.compile_unit(text.split('"', 2)[1].removesuffix(".metal"), text)


# torch's casts for compile_shader's kernel calls (as tests/test_executor_shader.py binds them)
_INT_CAST_WIDTH = {None: 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1}


class EmulatedShaderLibrary:
    """Stands in for torch.mps.compile_shader(text): compile errors are SyntaxError with the
    compiler's log, dir() lists the kernels, and a kernel call binds its arguments by torch's rules
    (tensors as buffers, ints as int64 unless `arg_casts` narrows them) and runs the emulator over
    `threads` in groups of `group_size`."""

    def __init__(self, text: str) -> None:
        try:
            self._lib = emulator_library(text)
        except emulator.CompileError as e:
            raise SyntaxError(str(e)) from None

    def __dir__(self):
        return self._lib.kernels

    def __getattr__(self, name):
        if name.startswith("_") or name not in self._lib:
            raise RuntimeError(f"Failed to create function state object for: {name}")

        def kernel(*args, threads, group_size, arg_casts=None):
            casts = arg_casts or {}
            bound = [a if isinstance(a, torch.Tensor) else
                     int(a).to_bytes(8, "little", signed=True)[: _INT_CAST_WIDTH[casts.get(i)]]
                     for i, a in enumerate(args)]  # fmt: skip
            self._lib.launch(name, threads=tuple(threads), threadgroup=tuple(group_size), args=bound)

        return kernel


class CpuShaderExecutor(shader.ShaderExecutor):
    device_type = "cpu"  # CPU tensors stand in for mps ones
    _on_device = operator.attrgetter("is_cpu")


class EmulatedNativeLibrary:
    """Stands in for a `_native.KernelLibrary` compiled from one unit text (compile errors are the
    module's RuntimeError with the compiler's log): launches run the emulator with the tensors and
    the scalars' bytes."""

    origin = "source"

    def __init__(self, text: str) -> None:
        try:
            self._lib = emulator_library(text)
        except emulator.CompileError as e:
            raise RuntimeError(f"the Metal compiler rejected the kernel source: {e}") from None

    def function_names(self):
        return self._lib.kernels

    def pipeline_info(self, kernel):
        return {"max_total_threads_per_threadgroup": 1024, "thread_execution_width": 32,
                "static_threadgroup_memory_length": 0}  # fmt: skip

    def launch(self, kernel, grid, threadgroup, args):
        self._lib.launch(kernel, grid=tuple(grid), threadgroup=tuple(threadgroup), args=args)


def emulated_native_module():
    def load_metallib(path):
        raise RuntimeError("no metallib here")

    return types.SimpleNamespace(__file__="/nonexistent/_native.so", embedded_source=lambda: "",
                                 compile_library=EmulatedNativeLibrary, load_metallib=load_metallib,
                                 language_version=lambda: (3, 2))


def shader_stand_in(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "synchronize", lambda: None)  # (the stand-in's launches are done when they return)
    monkeypatch.setattr(torch.mps, "compile_shader", EmulatedShaderLibrary)
    ex = shader.load()  # one unit does not compile: the tier loads
    ex.__class__ = CpuShaderExecutor
    return ex


def native_stand_in(monkeypatch):
    monkeypatch.setattr(torch.mps, "synchronize", lambda: None)  # (the stand-in's launches are done when they return)
    return native.NativeExecutor(native._open_library(emulated_native_module()))


@pytest.mark.parametrize("make", [shader_stand_in, native_stand_in], ids=["shader", "native"])
def test_gpu_tier_stand_ins_a_broken_unit_takes_out_only_its_own_kernels(library, kernel_dir, monkeypatch, make):
    ex = make(monkeypatch)
    assert set(ex.unit_failures) == {BROKEN} and kernel_dir[1] in ex.unit_failures[BROKEN]
    check_broken_unit(ex, unit_kernels(library, BROKEN), kernel_dir[1])
    check_other_units_compute(ex)
    # Verification of a family of the broken unit fails with the compiler's message; another passes.
    v = verification.run_family(verification.FAMILIES["int8_quant"], ex, "cpu")
    assert not v.passed and v.error.startswith("KernelUnavailable: ") and kernel_dir[1] in v.error, v
    assert verification.run_family(verification.FAMILIES["blockwise_8bit"], ex, "cpu").passed


@pytest.mark.parametrize("make", [shader_stand_in, native_stand_in], ids=["shader", "native"])
def test_gpu_tier_stand_ins_without_a_broken_unit_serve_every_kernel(library, monkeypatch, make):
    monkeypatch.delenv(source.KERNEL_DIR_ENV, raising=False)
    ex = make(monkeypatch)
    assert ex.unit_failures == {}
    check_other_units_compute(ex)
