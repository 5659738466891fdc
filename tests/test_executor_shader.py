"""The shader tier (torch.mps.compile_shader).

Without an Apple GPU, the compiled library that compile_shader returns cannot exist, so launches
are checked against a stand-in that binds arguments by torch's rules (as read in
torch/csrc/mps/Module.cpp: tensors as buffers, ints as int64 and floats as float32 unless
`arg_casts` names a narrower type) and records the bytes each [[buffer(i)]] would receive. The
`mps` tests run the real thing on a Mac.
"""

from __future__ import annotations

import math
import operator
import re
import struct
import warnings

import pytest
import torch

from bnb_mps.msl import source as kernel_source
from bnb_mps.executors import shader
from bnb_mps.executors.base import CompileUnits, ExecutorUnavailable, KernelUnavailable, PipelineLimitError
from bnb_mps.modelled_mps.library import bind
from bnb_mps.kernel_args import Scalar, bool_, float16, float32, int32, int64, uint32, uint64
from geometry_kernel import GEOMETRY_KERNEL, GEOMETRY_SCALARS, expected_geometry_output

requires_mps = pytest.mark.skipif(not torch.backends.mps.is_available(), reason="needs an mps device")

class FakeKernel:
    """One kernel of the stand-in library: records each call as the bytes Metal would receive (bound by
    torch's rules, as the model of compile_shader binds them: bnb_mps.modelled_mps.library.bind)."""

    def __init__(self, name: str, calls: list) -> None:
        self.name = name
        self.calls = calls

    def __call__(self, *args, threads=None, group_size=None, arg_casts=None):
        bound = bind(args, arg_casts)
        self.calls.append(
            {"kernel": self.name, "bound": bound, "threads": threads, "group_size": group_size, "arg_casts": arg_casts}
        )


class LimitedKernel(FakeKernel):
    """A kernel whose pipeline reports `max_threads_per_threadgroup` (as torch's kernel function
    does), counting how often it is read."""

    def __init__(self, name: str, calls: list, maximum: int) -> None:
        super().__init__(name, calls)
        self.maximum = maximum
        self.limit_reads = 0

    @property
    def max_threads_per_threadgroup(self) -> int:
        self.limit_reads += 1
        return self.maximum


class FakeLibrary:
    """Stands in for torch.mps.compile_shader's result: dir() lists kernels, attributes are kernels.
    Kernels named in `limits` report that pipeline maximum; the others report none (as before torch 2.7)."""

    def __init__(self, names=("k",), limits=None) -> None:
        self._names = list(names)
        self.limits = limits or {}
        self.calls: list = []
        self.lookups = 0
        self.kernels: list = []

    def __dir__(self):
        return list(self._names)

    def __getattr__(self, name):
        if name.startswith("_") or name not in self._names:
            raise RuntimeError(f"Failed to create function state object for: {name}")
        self.lookups += 1
        if name in self.limits:
            self.kernels.append(LimitedKernel(name, self.calls, self.limits[name]))
        else:
            self.kernels.append(FakeKernel(name, self.calls))
        return self.kernels[-1]


class CpuShaderExecutor(shader.ShaderExecutor):
    # lets CPU tensors stand in for mps ones in the stand-in library
    device_type = "cpu"
    _on_device = operator.attrgetter("is_cpu")


EDGE_SCALARS = [
    uint32(0),
    uint32(2**32 - 1),
    uint32(2**31),
    int32(-1),
    int32(-(2**31)),
    int32(2**31 - 1),
    uint64(2**64 - 1),
    int64(-(2**63)),
    int64(123456789012345),
    float32(-0.0),
    float32(1e-45),
    float32(3.4028234663852886e38),
    float32(math.inf),
    float32(0.1),
    float16(65504.0),
    float16(-0.0),
    float16(6e-8),
    float16(0.1),
    bool_(True),
    bool_(False),
    Scalar(255, "uchar"),
    Scalar(-128, "char"),
    Scalar(65535, "ushort"),
    Scalar(-32768, "short"),
]


@pytest.mark.parametrize("scalar", EDGE_SCALARS, ids=lambda s: f"{s.type}={s.value!r}")
def test_scalars_bind_exactly_their_bytes(scalar):
    lib = FakeLibrary()
    CpuShaderExecutor(lib).launch("k", grid=(1, 1, 1), threadgroup=(1, 1, 1), args=[scalar])
    (call,) = lib.calls
    assert call["bound"] == [scalar.to_bytes()]
    assert len(call["bound"][0]) == scalar.nbytes


def test_nan_payload_of_a_half_survives():
    nan_bits = b"\x01\x7e"  # a quiet NaN with a payload
    scalar = Scalar(struct.unpack("<e", nan_bits)[0], "half")
    lib = FakeLibrary()
    CpuShaderExecutor(lib).launch("k", grid=(1, 1, 1), threadgroup=(1, 1, 1), args=[scalar])
    assert lib.calls[0]["bound"] == [scalar.to_bytes()]


def test_mixed_arguments_keep_order_casts_and_geometry():
    x = torch.arange(10, dtype=torch.float32)
    y = torch.zeros(6, dtype=torch.uint8)[2:]
    lib = FakeLibrary(["gemv", "other"])
    ex = CpuShaderExecutor(lib)
    ex.launch("gemv", grid=(3, 2, 5), threadgroup=(32, 2, 1), args=[x, uint32(7), y, float32(0.5), int64(-3)])
    (call,) = lib.calls
    assert call["kernel"] == "gemv"
    assert call["bound"][0] is x and call["bound"][2] is y
    assert call["bound"][1] == struct.pack("<I", 7)
    assert call["bound"][3] == struct.pack("<f", 0.5)
    assert call["bound"][4] == struct.pack("<q", -3)
    # 4-byte scalars (the uint and the float's bits) need the int32 cast; the int64 binds as is
    assert call["arg_casts"] == {1: "int32", 3: "int32"}
    assert call["threads"] == [3 * 32, 2 * 2, 5 * 1]
    assert call["group_size"] == [32, 2, 1]


def test_float32_binds_through_its_bits():
    # A float32 Scalar travels as the int32 with its bits: exact for every value, -0.0 included.
    lib = FakeLibrary()
    CpuShaderExecutor(lib).launch("k", grid=(1, 1, 1), threadgroup=(1, 1, 1), args=[float32(-0.0)])
    assert lib.calls[0]["arg_casts"] == {0: "int32"}
    assert lib.calls[0]["bound"] == [b"\x00\x00\x00\x80"]


def test_no_casts_when_no_narrow_scalars():
    lib = FakeLibrary()
    CpuShaderExecutor(lib).launch("k", grid=(1, 1, 1), threadgroup=(8, 1, 1), args=[torch.zeros(8), uint64(5)])
    assert lib.calls[0]["arg_casts"] is None


def test_kernel_function_is_looked_up_once():
    lib = FakeLibrary()
    ex = CpuShaderExecutor(lib)
    for _ in range(3):
        ex.launch("k", grid=(1, 1, 1), threadgroup=(1, 1, 1), args=[])
    assert len(lib.calls) == 3 and lib.lookups == 1


def test_a_threadgroup_above_the_pipelines_maximum_is_refused_before_the_function_is_called():
    lib = FakeLibrary(["small", "big"], limits={"small": 256, "big": 1024})
    ex = CpuShaderExecutor(lib)
    with pytest.raises(PipelineLimitError) as info:
        ex.launch("small", grid=(4, 1, 1), threadgroup=(128, 4, 1), args=[torch.zeros(8), uint32(1)])
    assert (info.value.kernel, info.value.threads, info.value.maximum) == ("small", 512, 256)
    assert "kernel small: its pipeline allows at most 256 threads per threadgroup" in str(info.value)
    assert lib.calls == []
    ex.launch("small", grid=(4, 1, 1), threadgroup=(256, 1, 1), args=[])  # at the maximum: runs
    ex.launch("big", grid=(1, 1, 1), threadgroup=(512, 1, 1), args=[])  # another kernel, its own maximum
    with pytest.raises(PipelineLimitError):
        ex.launch("small", grid=(1, 1, 1), threadgroup=(257, 1, 1), args=[])
    assert [(c["kernel"], c["group_size"]) for c in lib.calls] == [("small", [256, 1, 1]), ("big", [512, 1, 1])]
    # the maximum is read once per kernel, with the function, not per launch
    assert lib.lookups == 2 and [k.limit_reads for k in lib.kernels] == [1, 1]


def test_a_prepared_launch_is_refused_when_prepared_and_looks_its_kernel_up_once():
    """prepare(): what a launch plan keeps. The pipeline limit refuses a launch when it is prepared;
    a prepared launch binds each call's arguments (Scalars cast to their width) with the kernel, its
    limit and the thread counts found once."""
    lib = FakeLibrary(["small"], limits={"small": 256})
    ex = CpuShaderExecutor(lib)
    with pytest.raises(PipelineLimitError):
        ex.prepare("small", (4, 1, 1), (512, 1, 1))
    assert lib.calls == []
    run = ex.prepare("small", (4, 1, 1), (64, 2, 1))
    x = torch.zeros(8)
    for n in (1, 2, 3):
        run([x, uint32(n), float16(0.5)])
    assert [c["bound"][1] for c in lib.calls] == [uint32(n).to_bytes() for n in (1, 2, 3)]
    assert all(c["bound"][2] == float16(0.5).to_bytes() for c in lib.calls)
    assert all(c["threads"] == [256, 2, 1] and c["group_size"] == [64, 2, 1] for c in lib.calls)
    assert lib.lookups == 1 and lib.kernels[0].limit_reads == 1
    with pytest.raises(ValueError, match="on cpu"):
        shader.ShaderExecutor(lib).prepare("small", (1, 1, 1), (1, 1, 1))([x])  # (a CPU tensor, never bound)


def test_unknown_kernel_is_a_value_error_naming_it():
    lib = FakeLibrary(["k"])
    with pytest.raises(ValueError, match="'nope'"):
        CpuShaderExecutor(lib).launch("nope", grid=(1, 1, 1), threadgroup=(1, 1, 1), args=[])
    assert lib.calls == []


def test_tensor_on_the_wrong_device_is_refused_before_binding():
    lib = FakeLibrary()
    with pytest.raises(ValueError, match="argument 1 .* on cpu; expected a tensor on mps"):
        shader.ShaderExecutor(lib).launch("k", grid=(1, 1, 1), threadgroup=(1, 1, 1), args=[uint32(1), torch.zeros(2)])
    assert lib.calls == []


@pytest.mark.parametrize("bad", [3, 2.5, b"\x00\x00\x00\x00", None])
def test_untyped_arguments_are_refused(bad):
    lib = FakeLibrary()
    with pytest.raises(TypeError, match="argument 0 .*Scalar"):
        CpuShaderExecutor(lib).launch("k", grid=(1, 1, 1), threadgroup=(1, 1, 1), args=[bad])
    assert lib.calls == []


def test_empty_grid_launches_nothing():
    lib = FakeLibrary()
    CpuShaderExecutor(lib).launch("k", grid=(0, 4, 1), threadgroup=(32, 1, 1), args=[torch.zeros(1)])
    assert lib.calls == []


@pytest.mark.parametrize(
    "grid, threadgroup, error",
    [((1, 1), (1, 1, 1), ValueError), ((1, 1, 1), (0, 1, 1), ValueError), ((1, 1, 1), (64, 32, 1), ValueError),
     ((1.0, 1, 1), (1, 1, 1), TypeError), ((-1, 1, 1), (1, 1, 1), ValueError)],
)
def test_bad_geometry_is_refused(grid, threadgroup, error):
    lib = FakeLibrary()
    with pytest.raises(error):
        CpuShaderExecutor(lib).launch("k", grid=grid, threadgroup=threadgroup, args=[])
    assert lib.calls == []


# --- load() --------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="MPS is available here")
def test_load_says_why_it_is_unavailable_here():
    with pytest.raises(ExecutorUnavailable) as info:
        shader.load()
    message = str(info.value)
    assert "MPS is not available" in message or "torch >= 2.7" in message


def test_load_names_the_torch_version_it_needs(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.6.0")
    with pytest.raises(ExecutorUnavailable, match=r"torch 2\.6\.0 .*torch >= 2\.7"):
        shader.load()


def _pretend_mps(monkeypatch, compile_shader):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "compile_shader", compile_shader)


def test_load_compiles_each_unit_once(monkeypatch):
    monkeypatch.setattr(kernel_source, "units", lambda: {"k": "kernel void k() {}\n"})
    seen = []

    def compile_shader(source):
        seen.append(source)
        return FakeLibrary(["k"])

    _pretend_mps(monkeypatch, compile_shader)
    ex = shader.load()
    assert seen == ["kernel void k() {}\n"]
    assert ex.name == "shader"


@pytest.mark.parametrize("width", [32, 64])
def test_a_gpu_with_another_simd_width_disables_the_tier(monkeypatch, width):
    monkeypatch.setattr(kernel_source, "units", lambda: {"k": "kernel void k() {}\n"})
    library = FakeLibrary(["k"])
    monkeypatch.setattr(FakeKernel, "thread_execution_width", width, raising=False)
    _pretend_mps(monkeypatch, lambda source: library)
    if width == 32:
        assert shader.load().name == "shader"
    else:
        with pytest.raises(ExecutorUnavailable, match="SIMD width of 64"):
            shader.load()


class StandInCompiler:
    """compile_shader for stand-in units: a text `kernel void <name>() {}` per line compiles to a
    FakeLibrary of those names; a text holding `@error <message>` raises SyntaxError(<message>), as
    torch does for a compile error."""

    def __init__(self) -> None:
        self.libraries: list = []

    def __call__(self, source: str):
        if "@error" in source:
            raise SyntaxError(source.split("@error", 1)[1].strip())
        library = FakeLibrary(re.findall(r"kernel void (\w+)\(", source))
        self.libraries.append(library)
        return library


UNITS = {
    "alpha": ('BNB_KERNEL_INSTANTIATE("bnb_alpha_" #t, f, t)\n'
              "kernel void bnb_alpha_f16() {}\nkernel void bnb_alpha_f32() {}\n"),
    "beta": "kernel void bnb_beta() {}\n",
}


def test_each_unit_is_its_own_library_and_kernels_are_looked_up_in_theirs(monkeypatch):
    monkeypatch.setattr(kernel_source, "units", lambda: dict(UNITS))
    compiler = StandInCompiler()
    _pretend_mps(monkeypatch, compiler)
    ex = shader.load()
    alpha, beta = compiler.libraries
    assert sorted(dir(alpha)) == ["bnb_alpha_f16", "bnb_alpha_f32"] and dir(beta) == ["bnb_beta"]
    ex.__class__ = CpuShaderExecutor  # (CPU tensors stand in for mps ones)
    ex.launch("bnb_beta", grid=(1, 1, 1), threadgroup=(1, 1, 1), args=[uint32(3)])
    ex.launch("bnb_alpha_f32", grid=(2, 1, 1), threadgroup=(4, 1, 1), args=[])
    assert [c["kernel"] for c in beta.calls] == ["bnb_beta"] and [c["kernel"] for c in alpha.calls] == ["bnb_alpha_f32"]
    assert ex.unit_failures == {}


def test_a_unit_that_does_not_compile_takes_out_only_its_own_kernels(monkeypatch):
    log = "program_source:2:9: error: use of undeclared identifier 'flaot'\n" + "note: more\n" * 40
    monkeypatch.setattr(kernel_source, "units", lambda: {**UNITS, "alpha": UNITS["alpha"] + "@error " + log})
    compiler = StandInCompiler()
    _pretend_mps(monkeypatch, compiler)
    ex = shader.load()  # the tier stays available: one unit compiled
    (beta,) = compiler.libraries
    assert set(ex.unit_failures) == {"alpha"} and "undeclared identifier 'flaot'" in ex.unit_failures["alpha"]
    ex.__class__ = CpuShaderExecutor
    with pytest.raises(KernelUnavailable) as info:
        ex.launch("bnb_alpha_f16", grid=(1, 1, 1), threadgroup=(1, 1, 1), args=[])
    e = info.value
    assert (e.kernel, e.units) == ("bnb_alpha_f16", ("alpha",))
    first = str(e).splitlines()[0]  # what verification records: kernel, unit and the compiler's error line
    assert "bnb_alpha_f16" in first and "alpha.metal" in first and "undeclared identifier 'flaot'" in first
    assert "more lines" in str(e) and str(e).count("note: more") < 40
    ex.launch("bnb_beta", grid=(1, 1, 1), threadgroup=(1, 1, 1), args=[])  # the other unit's kernel runs
    assert [c["kernel"] for c in beta.calls] == ["bnb_beta"]
    # A name in no compiled unit may be the failed unit's (its kernels cannot be listed): unavailable too.
    with pytest.raises(KernelUnavailable, match="alpha.metal"):
        ex.launch("bnb_gamma", grid=(1, 1, 1), threadgroup=(1, 1, 1), args=[])


def test_a_kernel_is_attributed_to_the_failed_unit_whose_text_names_it():
    units = {"quant": 'BNB_KERNEL_INSTANTIATE("bnb_quantize_4bit_" #q, bnb_quantize_4bit, q)\n',
             "gemm": "[[kernel]] void bnb_quantize_4bit(device float* x) {}\n"
                     'BNB_KERNEL_INSTANTIATE("bnb_gemv_4bit_" #s, bnb_gemv_4bit, s)\n'}  # fmt: skip
    failed = CompileUnits({}, {}, {"gemm": "gemm.metal:1:1: error: one", "quant": "quant.metal:1:1: error: two"}, units)
    # both texts name bnb_quantize_4bit*; the instantiation's literal host-name prefix is the more specific
    assert failed.unavailable("bnb_quantize_4bit_nf4_f16_64").units == ("quant",)
    assert "error: two" in str(failed.unavailable("bnb_quantize_4bit_nf4_f16_64")).splitlines()[0]
    assert failed.unavailable("bnb_gemv_4bit_nested_f16").units == ("gemm",)
    assert failed.unavailable("bnb_other").units == ("gemm", "quant")  # named by neither: either may hold it
    assert CompileUnits({}, {}, {}, units).unavailable("bnb_other") is None  # nothing failed: an unknown kernel


def test_the_tier_is_unavailable_when_no_unit_compiles(monkeypatch):
    monkeypatch.setattr(kernel_source, "units", lambda: {"a": "@error a.metal:1:1: error: one",
                                                         "b": "@error b.metal:2:2: error: two"})
    _pretend_mps(monkeypatch, StandInCompiler())
    with pytest.raises(ExecutorUnavailable) as info:
        shader.load()
    message = str(info.value)
    assert "rejected every kernel compile unit" in message and "error: one" in message and "error: two" in message


def test_compile_error_becomes_unavailable_with_the_message(monkeypatch):
    monkeypatch.setattr(kernel_source, "units", lambda: {"k": "kernel void k( {}\n"})
    log = "program_source:1:15: error: expected parameter declarator\n" + "note: more\n" * 40

    def compile_shader(source):
        raise SyntaxError(log)

    _pretend_mps(monkeypatch, compile_shader)
    with pytest.raises(ExecutorUnavailable) as info:
        shader.load()
    message = str(info.value)
    assert "expected parameter declarator" in message
    assert "more lines" in message and message.count("note: more") < 40


def test_missing_kernel_sources_become_unavailable(monkeypatch):
    def no_sources():
        raise FileNotFoundError("bnb_mps kernel sources not found")

    monkeypatch.setattr(kernel_source, "units", no_sources)
    _pretend_mps(monkeypatch, lambda source: pytest.fail("must not compile"))
    with pytest.raises(ExecutorUnavailable, match="kernel sources not found"):
        shader.load()


# --- math mode -----------------------------------------------------------------------------------

# The Metal language version torch.mps.compile_shader asks for, (torch, macOS) -> MSL, as read in
# the released macOS arm64 wheels (MetalShaderLibrary::compileLibrary in libtorch_cpu.dylib):
# torch 2.7 and 2.8: 3.1 from macOS 14; 2.9 and 2.10: 3.1 always; 2.11 to 2.13: 4.0 from macOS 26,
# 3.2 from macOS 15, else 3.1. The kernel source's `#pragma METAL fp` lines are compiled for 3.2 on.
COMPILE_SHADER_MSL = {
    ((2, 7), (14, 6)): (3, 1),
    ((2, 8), (15, 3)): (3, 1),
    ((2, 9), (15, 0)): (3, 1),
    ((2, 10), (26, 0)): (3, 1),
    ((2, 11), (14, 7)): (3, 1),
    ((2, 11), (15, 0)): (3, 2),
    ((2, 12), (26, 1)): (4, 0),
    ((2, 13), (14, 4)): (3, 1),
    ((2, 13), (15, 6)): (3, 2),
    ((2, 13), (26, 0)): (4, 0),
}


@pytest.mark.parametrize(("torch_ver", "macos"), sorted(COMPILE_SHADER_MSL))
def test_math_mode_is_pinned_where_compile_shader_uses_metal_3_2(torch_ver, macos):
    assert shader.math_mode_pinned(macos, torch_ver) == (COMPILE_SHADER_MSL[torch_ver, macos] >= (3, 2))


@pytest.mark.parametrize(("torch_ver", "macos", "value", "pinned"), [
    ((2, 15), (15, 0), "3.1", False),  # torch 2.15 reads PYTORCH_MPS_METAL_VERSION: 3.1 drops the pins
    ((2, 15), (14, 6), "3.2", True),
    ((2, 15), (26, 0), "4.0", True),
    ((2, 15), (15, 0), "not-a-version", True),  # (ignored: its default, 3.2)
    ((2, 15), (15, 0), "3.0", True),  # (torch takes 3.1, 3.2 and 4.0 only, as spelled: MPSDevice.mm)
    ((2, 15), (15, 0), " 3.1", True),
    ((2, 15), (26, 0), "4.1", True),
    ((2, 13), (15, 0), "3.1", True),  # torch 2.13 does not read it
])  # fmt: skip
def test_metal_version_override_of_torch_2_15_decides_the_math_mode(torch_ver, macos, value, pinned):
    environ = {shader.METAL_VERSION_ENV: value, shader.FAST_MATH_ENV: "1"}
    assert shader.math_mode_pinned(macos, torch_ver, environ) is pinned


def test_math_mode_is_not_pinned_off_macos():
    assert not shader.math_mode_pinned(None, (2, 13))


@pytest.mark.parametrize(
    ("value", "fast"),
    # torch 2.13: fast math when the variable is set to anything but "0"
    [(None, False), ("0", False), ("1", True), ("2", True), ("true", True), ("", True), ("00", True)],
)
def test_fast_math_is_requested_as_torch_reads_the_variable(value, fast):
    environ = {} if value is None else {shader.FAST_MATH_ENV: value}
    assert shader.fast_math_requested(environ) is fast


def test_the_variable_is_read_once_per_process_as_torch_does(monkeypatch):
    """torch keeps what it read at its first Metal compile: a later change of the variable in the
    same process changes nothing there, and nothing in bnb_mps' reading either."""
    monkeypatch.setattr(shader, "_process_fast_math", None)  # a fresh process
    monkeypatch.setenv(shader.FAST_MATH_ENV, "1")
    assert shader.fast_math_requested() is True
    monkeypatch.setenv(shader.FAST_MATH_ENV, "0")
    assert shader.fast_math_requested() is True
    monkeypatch.setattr(shader, "_process_fast_math", None)
    monkeypatch.delenv(shader.FAST_MATH_ENV)
    assert shader.fast_math_requested() is False


def _fast_math_warnings(monkeypatch, macos, version, value, loads=2):
    """FastMathWarnings of `loads` shader loads in one (pretend) process on that macOS and torch."""
    monkeypatch.setattr(shader, "_fast_math_warned", False)  # a fresh process
    monkeypatch.setattr(shader, "_process_fast_math", None)
    monkeypatch.setattr(shader, "_macos_version", lambda: macos)
    monkeypatch.setattr(torch, "__version__", version)
    if value is None:
        monkeypatch.delenv(shader.FAST_MATH_ENV, raising=False)
    else:
        monkeypatch.setenv(shader.FAST_MATH_ENV, value)
    monkeypatch.setattr(kernel_source, "units", lambda: {"k": "kernel void k() {}\n"})
    _pretend_mps(monkeypatch, lambda source: FakeLibrary(["k"]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(loads):
            assert shader.load().name == "shader"
    return [w for w in caught if issubclass(w.category, shader.FastMathWarning)]


@pytest.mark.parametrize(("macos", "version"), [((14, 6), "2.13.0"), ((26, 0), "2.10.1"), ((15, 1), "2.9.0")])
def test_fast_math_warns_once_where_the_source_cannot_pin_the_mode(monkeypatch, macos, version):
    caught = _fast_math_warnings(monkeypatch, macos, version, "1")
    assert len(caught) == 1
    message = str(caught[0].message)
    assert shader.FAST_MATH_ENV in message and version in message and f"macOS {macos[0]}.{macos[1]}" in message


@pytest.mark.parametrize(
    ("macos", "version", "value"),
    [((15, 0), "2.13.0", "1"), ((26, 0), "2.11.0", "1"), ((14, 6), "2.13.0", None), ((14, 6), "2.13.0", "0")],
)
def test_no_fast_math_warning_where_the_mode_is_pinned_or_not_asked_for(monkeypatch, macos, version, value):
    assert _fast_math_warnings(monkeypatch, macos, version, value) == []


# --- on a Mac ------------------------------------------------------------------------------------


@pytest.mark.mps
@requires_mps
def test_geometry_and_scalars_on_the_gpu():
    if shader.torch_version() < shader.MIN_TORCH:
        pytest.skip("needs torch >= 2.7")
    ex = shader.ShaderExecutor(torch.mps.compile_shader(GEOMETRY_KERNEL))
    grid, tg = (3, 2, 2), (4, 2, 1)
    n = 3 * 2 * 2 * 4 * 2
    storage = torch.full((7 + 5 * n,), -1, dtype=torch.int32, device="mps")  # the kernel writes uint
    out = storage[7:]  # bound at a storage offset
    ex.launch(
        "bnb_test_geometry",
        grid=grid,
        threadgroup=tg,
        args=[out, *GEOMETRY_SCALARS],
    )
    got = storage.cpu().to(torch.int64) & 0xFFFFFFFF
    assert torch.equal(got[:7], torch.full((7,), 0xFFFFFFFF, dtype=torch.int64))  # untouched before the offset
    assert torch.equal(got[7:], expected_geometry_output(n))
