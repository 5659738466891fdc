"""The MSL lint: each forbidden construct is reported at its line; legitimate MSL is not."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import extras
import pytest

from bnb_mps.msl import lint as msl_lint
from bnb_mps.msl import source as kernel_source

CASES = Path(__file__).parent / "lint_cases"
BAD_CASES = sorted(p for p in CASES.glob("*.metal") if p.name != "clean.metal")
RULES = {"double", "std", "libc", "lambda", "recursion", "address-space", "threadgroup-param",
         "include", "function-constant", "threadgroup-array", "non-ascii",
         # rules of the Metal Shading Language specification / the executors' binding contract
         "program-scope", "threadgroup-scope", "threadgroup-init", "kernel-return", "buffer-index",
         "kernel-param", "unsupported-cxx",
         # what the fast-math setting must not reach: the math library (the fp pragma is a unit rule, below)
         "float-math",
         # spellings of a later Metal language version outside a guard for it
         "metal-version"}


def expected_findings(path: Path) -> list[tuple[int, str]]:
    """(line, rule) pairs marked in a case file with `// expect: <rule>`, sorted, once per marker (a line
    with two findings of one rule carries the marker twice)."""
    text = path.read_text(encoding="utf-8")
    return sorted((i, m.group(1)) for i, line in enumerate(text.splitlines(), 1)
                  for m in re.finditer(r"expect: ([\w-]+)", line))


@pytest.mark.parametrize("path", BAD_CASES, ids=lambda p: p.stem)
def test_bad_case_reported_at_marked_lines(path):
    """Every finding counts, not only its line: faults L2 and L3 (the lint took `metal::` or `fast::`
    calls for `precise::` ones) hid behind another finding on the same line when findings were
    compared as a set."""
    expected = expected_findings(path)
    assert expected, f"{path.name} has no `// expect:` markers"
    found = sorted((f.line, f.rule) for f in msl_lint.lint_source(path.read_text(encoding="utf-8"), path.name))
    assert found == expected


def test_every_rule_has_a_case():
    covered = {rule for p in BAD_CASES for _, rule in expected_findings(p)}
    assert covered == RULES


def test_clean_case_passes():
    assert msl_lint.lint_paths([CASES / "clean.metal", CASES / "clean_helper.h", CASES / "local.h"]) == []


def test_project_kernels_pass():
    kernels = kernel_source.kernel_dir()
    assert list(kernels.glob("*.metal"))
    findings = msl_lint.lint_paths([kernels])
    assert findings == [], "\n".join(map(str, findings))


LEGIT = [
    "inline float f(device const float* x) { return x[0]; }",
    "inline void f(thread float& r) { r = 1.0f; }",
    "kernel void k(constant uint& n [[buffer(1)]], device float* o [[buffer(0)]]) { o[0] = float(n); }",
    "kernel void k(device float* o [[buffer(0)]]) { threadgroup float buf[256]; buf[0] = 1; o[0] = buf[0]; }",
    "template <typename T, uint N> kernel void g(device T* v [[buffer(0)]]) { threadgroup T t[N]; t[0] = v[0]; }",
    "inline float f(float a, float b) { return metal::precise::divide(a, b); }",
    "inline float f(float a) { return metal::precise::sqrt(a) * a; }",
    "inline uint f(uint a, uint b) { uint c = a & b; uint d = a * b; return c + d; }",
    "inline float f(thread const float* v) { float w[2] = {v[0] * v[1], v[1] & 1}; return w[0]; }",
    "inline int f(int a) { return metal::abs(a); }",
    "struct S { device float* p; thread int& r; };",
    "inline float f(device float* x) { return x->y; }",
]


@pytest.mark.parametrize("snippet", LEGIT)
def test_no_false_positive(snippet):
    assert msl_lint.lint_source("#include <metal_stdlib>\nusing namespace metal;\n" + snippet) == []


@pytest.mark.parametrize("snippet,rule", [
    ("inline float f(float a) { return a; }\nkernel void k() { float* p = 0; }", "address-space"),
    ("struct S { float* p; };", "address-space"),
    ("inline float& f(thread float* x) { return x[0]; }", "address-space"),
    ("inline float f(device float* x) { return *reinterpret_cast<float*>(x); }", "address-space"),
    ("inline void f() { ::printf(\"x\"); }", "libc"),
    ("inline void f() { int v[4]; auto g = [&v]() mutable { v[0] = 1; }; }", "lambda"),
    ("#include <metal_stdlib>\n#include MACRO_HEADER\n", "include"),
])
def test_more_violations(snippet, rule):
    assert rule in {f.rule for f in msl_lint.lint_source(snippet)}


def test_comments_and_strings_are_ignored_but_lines_kept():
    src = '/* double\n std:: */ // printf(\ninline float f() { return 0.0f; } // double\nconstant char* s = "double";\ndouble x;\n'
    code, no_strings = msl_lint.strip_comments_and_strings(src)
    assert code.count("\n") == src.count("\n") and len(code) == len(src) == len(no_strings)
    findings = msl_lint.lint_source(src)
    assert [(f.line, f.rule) for f in findings if f.rule == "double"] == [(5, "double")]


@pytest.mark.parametrize("snippet", [
    # top-level declarations that are not variables
    "struct S { float a; float get() const thread { return a; } S() = default; S(const thread S&) = delete; };\n"
    "enum E { kA = 1 };\ntypedef float real;\n"
    "using real2 = float2;\nbool helper(uint x);\nstatic_assert(sizeof(float) == 4, \"float\");\n"
    "template <typename T> inline T twice(T x) { return x + x; }\n",
    # macro invocations without a semicolon, then a constant table
    "#define INST(n) kernel void k##n(device float* o [[buffer(0)]]) { o[0] = n; }\nINST(1)\nINST(2)\n"
    "constant float kTable[2] = {1.0f, 2.0f};\n",
    # namespaces are transparent
    "namespace detail {\nconstant float kOne = 1.0f;\ninline float one() { return kOne; }\n}\n",
    # every built-in input type Metal accepts
    "kernel void k(device float* o [[buffer(0)]], uint3 a [[thread_position_in_grid]], ushort2 b [[threadgroup_position_in_grid]],"
    " ushort c [[thread_index_in_simdgroup]], uint d [[simdgroups_per_threadgroup]], uint3 e [[threads_per_grid]]) { o[0] = 0; }",
])
def test_metal_rules_accept_legitimate_source(snippet):
    assert msl_lint.lint_source("#include <metal_stdlib>\nusing namespace metal;\n" + snippet) == []


@pytest.mark.model  # (a subprocess: tests/tiers.py)
def test_cli_exit_codes():
    bad = subprocess.run([sys.executable, "-m", "bnb_mps.msl_lint", str(CASES / "double.metal")],
                         capture_output=True, text=True)
    assert bad.returncode == 1
    assert f"{CASES / 'double.metal'}:5: [double]" in bad.stdout
    good = subprocess.run([sys.executable, "-m", "bnb_mps.msl_lint", str(CASES / "clean.metal")],
                          capture_output=True, text=True)
    assert good.returncode == 0 and good.stdout == ""


# -- the floating-point mode: every unit pins no-contraction, the math library is called precisely ------


def _kernels_copy(tmp_path: Path) -> Path:
    import shutil

    copy = tmp_path / "kernels"
    shutil.copytree(kernel_source.kernel_dir(), copy)
    return copy


def _lint(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bnb_mps.msl_lint", "--no-address-space", str(path)],
                          capture_output=True, text=True)  # fmt: skip


@pytest.mark.model  # (a subprocess: tests/tiers.py)
def test_a_kernel_calling_an_unqualified_sqrt_fails_the_lint(tmp_path):
    kernels = _kernels_copy(tmp_path)
    assert _lint(kernels).returncode == 0  # the clean source passes
    header = kernels / "int8.h"
    text = header.read_text()
    planted = text.replace("metal::precise::clamp(metal::precise::rint(v), -127.0f, 127.0f)",
                           "metal::precise::clamp(metal::precise::rint(sqrt(v * v)), -127.0f, 127.0f)")  # fmt: skip
    assert planted != text
    header.write_text(planted)
    r = _lint(kernels)
    assert r.returncode == 1 and "[float-math] `sqrt(...)`" in r.stdout and "metal::precise::sqrt" in r.stdout


@pytest.mark.model  # (a subprocess: tests/tiers.py)
def test_a_unit_without_the_contraction_pragma_first_fails_the_lint(tmp_path):
    kernels = _kernels_copy(tmp_path)
    unit = kernels / "quantize_8bit.metal"
    unit.write_text(unit.read_text().replace('#include "bnb_math_mode.h"\n', ""))
    # quantize_8bit.h includes bnb_common.h, which includes bnb_math_mode.h first: still pinned
    assert _lint(kernels).returncode == 0
    common = kernels / "bnb_common.h"
    common.write_text(common.read_text().replace('#include "bnb_math_mode.h"\n#include <metal_stdlib>',
                                                 '#include <metal_stdlib>\n#include "bnb_math_mode.h"'))  # fmt: skip
    r = _lint(kernels)
    assert r.returncode == 1 and f"{unit}:1: [fp-contract]" in r.stdout
    assert r.stdout.count("[fp-contract]") == 1  # the other units include bnb_math_mode.h first themselves
    mode = kernels / "bnb_math_mode.h"
    mode.write_text(mode.read_text().replace("#pragma clang fp contract(off)\n",
                                             "#if __METAL_VERSION__ >= 320\n#pragma clang fp contract(off)\n#endif\n"))
    units = len(list(kernels.glob("*.metal")))
    assert _lint(kernels).stdout.count("[fp-contract]") == units  # under a condition it pins nothing at 3.1


@pytest.mark.model  # (a subprocess: tests/tiers.py)
def test_a_standard_library_not_followed_by_the_pragmas_fails_the_lint(tmp_path):
    """A pragma of <metal_stdlib>'s own would hold for every kernel after it: the pragmas are repeated
    right after it (bnb_common.h), and a unit without that repetition fails the rule fp-contract."""
    kernels = _kernels_copy(tmp_path)
    common = kernels / "bnb_common.h"
    text = common.read_text()
    repeated = "#include <metal_stdlib>\n"
    start = text.index(repeated) + len(repeated)
    end = text.index("#endif\n", start) + len("#endif\n")
    assert "#pragma clang fp contract(off)" in text[start:end]
    common.write_text(text[:start] + text[end:].replace("#pragma clang fp contract(off)\n", "", 1))
    r = _lint(kernels)
    units = len(list(kernels.glob("*.metal")))
    assert r.returncode == 1 and r.stdout.count("[fp-contract]") == units and "right after <metal_stdlib>" in r.stdout


@pytest.mark.parametrize("version", [310, 320, 400])
@pytest.mark.model  # (a subprocess: tests/tiers.py)
def test_every_unit_preprocessed_at_each_language_version_pins_contraction_first(version):
    """What each tier hands Metal (one text per unit, local headers inlined), preprocessed as at Metal
    3.1, 3.2 and 4.0: `#pragma clang fp contract(off)` comes before the first line of code and before
    <metal_stdlib>; from 3.2 on the METAL pragmas too."""
    from bnb_mps.msl import math_mode

    if math_mode.find_preprocessor() is None:
        extras.missing("clang", "no C preprocessor here")
    units = kernel_source.units()
    assert set(units) == {p.stem for p in kernel_source.kernel_dir().glob("*.metal")}
    for name, text in units.items():
        out = math_mode.preprocess(text, version)
        assert math_mode.preprocessed_finding(out) is None, (name, version)
        first_code = out.splitlines()[math_mode._first_code_line(out.splitlines())]
        assert first_code.startswith(f"{math_mode.SYSTEM_HEADER_MARK} metal_stdlib"), (name, first_code)
        head, _, tail = out.partition(math_mode.SYSTEM_HEADER_MARK)
        tail = tail.splitlines()[1:]
        tail = "\n".join(tail[: math_mode._first_code_line(tail)])  # (after <metal_stdlib>, before code)
        for part in (head, tail):
            assert "#pragma clang fp contract(off)" in part, (name, version)
            assert ("#pragma METAL fp contract(off)" in part) == (version >= 320), (name, version)
            assert ("#pragma METAL fp math_mode(safe)" in part) == (version >= 320), (name, version)


@pytest.mark.model  # (a subprocess: tests/tiers.py)
def test_the_preprocessed_check_fails_a_unit_that_pins_too_late():
    from bnb_mps.msl import math_mode

    if math_mode.find_preprocessor() is None:
        extras.missing("clang", "no C preprocessor here")
    late = "#include <metal_stdlib>\n#pragma clang fp contract(off)\nkernel void k() {}\n"
    conditional = "#if __METAL_VERSION__ >= 320\n#pragma clang fp contract(off)\n#endif\nkernel void k() {}\n"
    assert math_mode.preprocessed_finding(math_mode.preprocess(late, 320)) is not None
    assert math_mode.preprocessed_finding(math_mode.preprocess(conditional, 310)) is not None
    assert math_mode.preprocessed_finding(math_mode.preprocess(conditional, 320)) is None
    once = "#pragma clang fp contract(off)\n#include <metal_stdlib>\nkernel void k() {}\n"
    assert "right after" in math_mode.preprocessed_finding(math_mode.preprocess(once, 320))
    assert math_mode.preprocessed_finding(math_mode.preprocess(once.replace("kernel void", "#pragma clang fp contract(off)\n"
                                                                            "kernel void"), 320)) is None
