"""The Python API of the emulator: argument validation, binding rules (views, non-contiguous
tensors, aliasing), the pre-pass, compile errors, the cache, and the emulated executor."""

from __future__ import annotations

import pytest
import torch

from bnb_mps import emulator
from bnb_mps.kernel_args import float32, uint32

SRC = """
#include <metal_stdlib>
using namespace metal;
kernel void axpy(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                 constant float& a [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  y[gid] = a * x[gid] + y[gid];
}
kernel void strided_copy(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                         constant uint& stride [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  y[gid] = x[gid * stride];
}
"""


@pytest.fixture(scope="module")
def lib():
    return emulator.load(SRC)


def test_launch_validates_arguments(lib):
    x, y = torch.ones(4), torch.zeros(4)
    with pytest.raises(ValueError, match="exactly one of grid"):
        lib.launch("axpy", threadgroup=4, args=[x, y, float32(1)])
    with pytest.raises(ValueError, match="order"):
        lib.launch("axpy", grid=1, threadgroup=4, args=[x, y, float32(1)], order="sideways")
    with pytest.raises(ValueError, match="poison"):
        lib.launch("axpy", grid=1, threadgroup=4, args=[x, y, float32(1)], poison=256)
    with pytest.raises(TypeError, match="threadgroup"):
        lib.launch("axpy", grid=1, threadgroup=(1, 2, 3, 4), args=[x, y, float32(1)])
    with pytest.raises(ValueError, match="threadgroup"):
        lib.launch("axpy", grid=1, threadgroup=0, args=[x, y, float32(1)])
    with pytest.raises(TypeError, match=r"args\[2\].*uint32"):
        lib.launch("axpy", grid=1, threadgroup=4, args=[x, y, 2.0])
    with pytest.raises(TypeError, match=r"args\[0\]"):
        lib.launch("axpy", grid=1, threadgroup=4, args=[[1.0], y, float32(1)])
    with pytest.raises(emulator.KernelError, match="'nope' is not in"):
        lib.launch("nope", grid=1, threadgroup=4, args=[])


def test_view_binds_at_its_offset(lib):
    base = torch.zeros(16)
    lib.launch("axpy", grid=1, threadgroup=4, args=[torch.ones(4), base[8:12], float32(2.0)])
    assert torch.equal(base, torch.cat([torch.zeros(8), torch.full((4,), 2.0), torch.zeros(4)]))


def test_non_contiguous_tensor_binds_its_storage_span(lib):
    m = torch.arange(12, dtype=torch.float32).view(4, 3)
    col = m[:, 1]  # stride 3: the kernel sees the storage from m[0, 1] on
    out = torch.zeros(4)
    lib.launch("strided_copy", grid=1, threadgroup=4, args=[col, out, uint32(3)])
    assert torch.equal(out, col.contiguous())
    with pytest.raises(emulator.OutOfBounds):  # one stride too far runs past the span
        lib.launch("strided_copy", grid=1, threadgroup=4, args=[col, out, uint32(4)])


def test_aliased_arguments_share_one_copy(lib):
    y = torch.arange(8, dtype=torch.float32)
    lib.launch("axpy", grid=1, threadgroup=8, args=[y, y, float32(1.0)])  # y = y + y
    assert torch.equal(y, torch.arange(8, dtype=torch.float32) * 2)


def test_prepass_preserves_lines_and_rewrites_threadgroup_declarations():
    src = "kernel void k(device float* o [[buffer(0)]]) {\n  threadgroup float a[4 * 2], b[3];\n" \
          "  threadgroup half* p = 0; // threadgroup float c[1];\n  o[0] = 1.5h; }\n"
    t = emulator.translate(src, "x.metal")
    body = t.cpp.split("\n", 1)[1]
    assert body.count("\n") >= src.count("\n")
    lines = body.split("\n")
    assert "BNB_EMU_THREADGROUP(a, [4*2], float)" in lines[1] and "BNB_EMU_THREADGROUP(b, [3], float)" in lines[1]
    assert "threadgroup half* p" in lines[2] and "BNB_EMU" not in lines[2]
    assert "((half)(1.5))" in lines[3]
    assert t.kernels == ["k"]


def test_threadgroup_outside_a_function_is_rejected():
    with pytest.raises(emulator.PrepassError, match="x.metal:1"):
        emulator.translate("threadgroup float g[4];\n", "x.metal")


def test_compile_error_names_the_metal_line():
    with pytest.raises(emulator.CompileError, match=r"kernel.metal:3"):
        emulator.load("#include <metal_stdlib>\nusing namespace metal;\nkernel void k() { undefined_thing(); }\n")


def test_vla_is_an_error():
    with pytest.raises(emulator.CompileError, match="vla|variable"):
        emulator.load("kernel void k(device float* o [[buffer(0)]], uint n [[threads_per_grid]]) "
                      "{ float t[n]; t[0] = 1; o[0] = t[0]; }\n")


def test_cache_reuses_the_module(lib):
    again = emulator.load(SRC)
    assert again._module(False).path == lib._module(False).path


def test_emulated_executor_settings():
    from bnb_mps.executors import emulated

    ex = emulated.load()
    assert ex.name == "emulated"
    assert (ex.order, ex.race_check, ex.poison, ex.seed) == ("forward", False, 0xFF, 0)
    with emulated.settings(order="random", race_check=True, poison=0, seed=5) as e:
        assert e is ex and (ex.order, ex.race_check, ex.poison, ex.seed) == ("random", True, 0, 5)
    assert (ex.order, ex.race_check, ex.poison, ex.seed) == ("forward", False, 0xFF, 0)
    with pytest.raises(ValueError):
        with emulated.settings(order="backwards"):
            pass


def test_emulated_executor_serves_the_project_kernels():
    from bnb_mps.msl import source as kernel_source
    from bnb_mps.executors import emulated

    try:
        kernel_source.kernel_dir()
    except FileNotFoundError:
        pytest.skip("no kernels in csrc/kernels yet")
    ex = emulated.load()
    names = ex._load().kernels
    assert names, "the project's kernel source registers no kernels"
    ex.launch(names[0], grid=(0, 1, 1), threadgroup=(32, 1, 1), args=[])  # an empty grid is a no-op
    with pytest.raises(emulator.KernelError, match="not in"):
        ex.launch("no_such_kernel", grid=(1, 1, 1), threadgroup=(1, 1, 1), args=[])
