"""The address-space check (bnb_mps.msl.address_space): planted bugs are reported at their file and
line, legitimate MSL (and the project's kernels) is not. Skipped where no suitable clang exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import extras
import pytest

from bnb_mps.msl import address_space, checks
from bnb_mps.msl import source as kernel_source

CASES = Path(__file__).parent / "address_space_cases"
BAD_CASES = sorted(p for p in CASES.glob("*.metal") if p.name != "clean.metal")


@pytest.fixture(scope="module")
def clang():
    try:
        return address_space.find_clang()
    except address_space.CheckUnavailable as e:
        extras.missing("clang", f"address-space check unavailable here: {e}")


def expected(path: Path) -> set[tuple[int, str]]:
    text = path.read_text(encoding="utf-8")
    return {(i, m.group(1)) for i, line in enumerate(text.splitlines(), 1) for m in re.finditer(r"expect: ([\w-]+)", line)}


@pytest.mark.parametrize("path", BAD_CASES, ids=lambda p: p.stem)
def test_planted_bug_reported_at_its_file_and_line(clang, path):
    marks = expected(path)
    assert marks, f"{path.name} has no `// expect:` markers"
    findings = address_space.check_file(path, clang)
    assert {(f.line, f.rule) for f in findings} == marks, "\n".join(map(str, findings))
    assert {f.path for f in findings} == {str(path)}


def test_the_four_named_bugs_have_cases():
    names = {p.stem for p in BAD_CASES}
    assert {"device_to_thread", "threadgroup_as_device", "constant_write", "no_address_space"} <= names


def test_legitimate_msl_passes(clang):
    """Templates, vec<T, N>, swizzles, vector constructors, simdgroup matrices, atomics, as_type,
    reinterpret_cast within one address space, metal:: maths, constant tables, threadgroup arrays."""
    assert address_space.check_paths([CASES / "clean.metal"], clang) == []


def test_project_kernels_pass(clang):
    kernels = kernel_source.kernel_dir()
    findings = address_space.check_paths([kernels], clang)
    assert findings == [], "\n".join(map(str, findings))


def test_project_kernels_pass_at_metal_3_2(clang):
    """The spellings only Metal 3.2 compiles (the split-K kernel's atomic_thread_fence and
    coherent(device), bnb_math_mode.h's pragmas) are compiled out everywhere else in CI: checked
    here with __METAL_VERSION__ 320, where a name the language lacks would be an error."""
    import dataclasses

    at_32 = dataclasses.replace(clang, flags=(*clang.flags, "-D__METAL_VERSION__=320"))
    unit = kernel_source.kernel_dir() / "gemm_4bit_splitk.metal"
    assert address_space.check_file(unit, at_32) == []
    text, _ = address_space.translation_unit(unit)
    assert "atomic_thread_fence(mem_flags::mem_device" in text and "coherent(device)" in text


def test_errors_in_included_headers_name_the_header(clang, tmp_path):
    (tmp_path / "helpers.h").write_text(
        "#pragma once\n#include <metal_stdlib>\nusing namespace metal;\n"
        "template <typename T>\ninline void fill(thread T* v, const device T* src) {\n    v[0] = src[0];\n}\n"
        "template <typename T>\ninline void copy_in(device T* dst, const device T* src) {\n"
        "    fill(dst, src);\n}\n")
    (tmp_path / "k.metal").write_text(
        '#include "helpers.h"\n\nkernel void k(device float* a [[buffer(0)]], device const float* b [[buffer(1)]]) {\n'
        "    copy_in(a, b);\n}\n")
    findings = address_space.check_paths([tmp_path / "k.metal"], clang)
    assert [(Path(f.path).name, f.line, f.rule) for f in findings] == [("helpers.h", 10, "address-space")]
    assert "device" in findings[0].message and "thread" in findings[0].message


def test_names_missing_from_the_header_set_are_reported_clearly(clang, tmp_path):
    (tmp_path / "k.metal").write_text(
        "#include <metal_stdlib>\nusing namespace metal;\n"
        "kernel void k(device float* a [[buffer(0)]]) {\n    a[0] = metal::not_a_metal_function(a[1]);\n}\n")
    findings = address_space.check_paths([tmp_path / "k.metal"], clang)
    assert [(f.line, f.rule) for f in findings] == [(4, address_space.UNSUPPORTED_RULE)]
    assert "not_a_metal_function" in findings[0].message and "bnb_metal_as.h" in findings[0].message


def test_prepass_keeps_lines():
    src = (CASES / "clean.metal").read_text()
    out = address_space.prepass(src)
    assert out.count("\n") == src.count("\n")
    assert "make_vec<float4>(" in out and "threadgroup_variable<" in out and "[[host_name" not in out


def test_command_runs_both_checks(clang, tmp_path):
    bad = tmp_path / "bad.metal"
    bad.write_text("#include <metal_stdlib>\nusing namespace metal;\n"
                   "inline float f(thread const float* x) { return x[0]; }\n"
                   "kernel void k(device float* o [[buffer(0)]]) {\n    double d = 0;\n    o[0] = f(o) + float(d);\n}\n")
    r = subprocess.run([sys.executable, "-m", "bnb_mps.msl_lint", str(bad)], capture_output=True, text=True)
    assert r.returncode == 1
    assert f"{bad}:5: [double]" in r.stdout  # the lint
    assert f"{bad}:6: [address-space]" in r.stdout  # the address-space check
    ok = subprocess.run([sys.executable, "-m", "bnb_mps.msl_lint", str(CASES / "clean.metal")], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout == "", ok.stdout


def test_missing_clang_skips_with_a_message(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bnb_mps.msl_lint", str(CASES / "clean.metal")], capture_output=True,
                       text=True, env={**__import__("os").environ, "BNB_MPS_CLANG": "no-such-clang"})
    assert r.returncode == 0 and "address-space check skipped" in r.stderr and "no-such-clang" in r.stderr
    r = subprocess.run([sys.executable, "-m", "bnb_mps.msl_lint", "--require-address-space", str(CASES / "clean.metal")],
                       capture_output=True, text=True, env={**__import__("os").environ, "BNB_MPS_CLANG": "no-such-clang"})
    assert r.returncode == 2 and "cannot run" in r.stderr


def test_overlapping_lint_findings_are_merged(clang):
    findings, skipped = checks.run([CASES / "no_address_space.metal"])
    assert skipped is None
    lines = [f.line for f in findings if f.rule == "address-space"]
    assert len(lines) == len(set(lines))


def test_a_header_given_alone_is_checked_as_instantiated(clang, tmp_path):
    """A template in a header is only fully checked where it is instantiated: the .metal files
    beside it that include it are compiled, and only the header's findings are reported."""
    (tmp_path / "helpers.h").write_text(
        "#pragma once\n#include <metal_stdlib>\nusing namespace metal;\n"
        "template <typename T>\ninline void copy_in(device T* dst, const device T* src, uint i) {\n"
        "    thread T* p = dst;\n    p[i] = src[i];\n}\n")
    (tmp_path / "k.metal").write_text(
        '#include "helpers.h"\n\ntemplate <typename T>\n[[kernel]] void k(device T* a [[buffer(0)]], '
        "device const T* b [[buffer(1)]], uint i [[thread_position_in_grid]]) {\n    copy_in(a, b, i);\n}\n"
        'template [[host_name("k_f")]] [[kernel]] decltype(k<float>) k<float>;\n'
        "kernel void unrelated(device float* o [[buffer(0)]]) { thread float* q = o; q[0] = 1; }\n")
    findings = address_space.check_paths([tmp_path / "helpers.h"], clang)
    assert [(Path(f.path).name, f.line, f.rule) for f in findings] == [("helpers.h", 6, "address-space")]
    both = address_space.check_paths([tmp_path], clang)
    assert sorted((Path(f.path).name, f.line) for f in both) == [("helpers.h", 6), ("k.metal", 8)]


def test_a_coherent_pointer_keeps_its_qualifier_and_exists_from_metal_3_2_only(clang, tmp_path):
    """coherent(device) is checked as a qualifier of the pointee at 3.2 (passing the workspace to a helper
    that takes a plain device pointer drops it, and the helper's accesses are then not coherent), and is
    unknown at 3.1, as in Metal."""
    import dataclasses

    (tmp_path / "k.metal").write_text(
        "#include <metal_stdlib>\nusing namespace metal;\n"
        "inline void put(device float* w, float v) {\n    w[0] = v;\n}\n"
        "kernel void k(coherent(device) device float* w [[buffer(0)]]) {\n    put(w, 1.0f);\n}\n")
    at_32 = dataclasses.replace(clang, flags=(*clang.flags, "-D__METAL_VERSION__=320"))
    findings = address_space.check_paths([tmp_path / "k.metal"], at_32)
    assert [f.line for f in findings] == [7] and findings[0].rule == "address-space"
    (tmp_path / "k.metal").write_text((tmp_path / "k.metal").read_text().replace(
        "inline void put(device float* w", "inline void put(coherent(device) device float* w"))
    assert address_space.check_paths([tmp_path / "k.metal"], at_32) == []
    assert address_space.check_paths([tmp_path / "k.metal"], clang) != []  # 3.1: no such qualifier
