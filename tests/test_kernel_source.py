"""The kernel amalgamation every executor compiles: local includes inlined once, line mapping kept."""

import re

import pytest

from bnb_mps.msl import source as kernel_source
from bnb_mps.msl.text import strip_comments


def write(tmp_path, name, text):
    (tmp_path / name).write_text(text)


def test_includes_inlined_once_with_line_directives(tmp_path):
    write(tmp_path, "common.h", "#pragma once\n#include <metal_stdlib>\ninline float two() { return 2.0f; }\n")
    write(tmp_path, "a.metal", '#include "common.h"\nkernel void a() {}\n')
    write(tmp_path, "b.metal", '// b\n#include "common.h"\nkernel void b() {}\n')
    src = kernel_source.amalgamate(tmp_path)
    lines = src.splitlines()
    assert src.count("inline float two()") == 1 and "#pragma once" not in src
    assert src.count("#include <metal_stdlib>") == 1  # system includes stay for the compiler
    # after each inlined header, a #line directive puts the compiler back on the includer's next line
    assert lines[lines.index("kernel void a() {}") - 1] == '#line 2 "a.metal"'
    assert lines[lines.index("kernel void b() {}") - 1] == '#line 3 "b.metal"'
    assert lines.index("kernel void a() {}") < lines.index("kernel void b() {}")  # files in name order


def test_missing_include_names_the_file_and_line(tmp_path):
    write(tmp_path, "a.metal", '\n#include "nope.h"\n')
    with pytest.raises(FileNotFoundError, match=r"a.metal:2: .*nope.h"):
        kernel_source.amalgamate(tmp_path)


def test_non_ascii_source_is_rejected(tmp_path):
    write(tmp_path, "a.metal", "// caf\u00e9\n")
    with pytest.raises(ValueError, match="ASCII"):
        kernel_source.amalgamate(tmp_path)


def test_the_project_source_is_stable_and_names_its_kernels():
    src = kernel_source.source()
    assert src == kernel_source.amalgamate() and src.isascii()
    assert "bnb_quantize_blockwise" in src


def test_the_source_pins_safe_math_and_no_contraction_before_any_kernel_code():
    # csrc/kernels/bnb_math_mode.h, first: no contraction at every Metal version, then for Metal >= 3.2
    # the METAL pragmas, all at file scope ahead of <metal_stdlib> and every kernel
    # and the same lines again right after <metal_stdlib> (bnb_common.h), before any kernel code
    code = [line.strip() for line in strip_comments(kernel_source.source()).splitlines()]
    code = [line for line in code if line and not line.startswith("#line ")]
    guard = "#if defined(__METAL_VERSION__) && __METAL_VERSION__ >= 320"
    pins = ["#pragma clang fp contract(off)", guard, "#pragma METAL fp math_mode(safe)",
            "#pragma METAL fp contract(off)", "#endif"]  # fmt: skip
    assert code.count(guard) == 2
    assert code[:5] == pins  # nothing of the kernels' own comes first
    at = code.index("#include <metal_stdlib>")
    assert at == 5 and code[at + 1 : at + 6] == pins and code.count("#include <metal_stdlib>") == 1
    # and nothing later loosens it again
    loosening = re.compile(r"#\s*pragma\s+(METAL|clang)\s+fp\b.*\b(fast|relaxed|on)\b")
    assert not [line for line in code if loosening.search(line)]


def test_each_metal_file_is_a_compile_unit_with_its_own_includes(tmp_path):
    write(tmp_path, "common.h", "#pragma once\ninline float two() { return 2.0f; }\n")
    write(tmp_path, "mid.h", '#pragma once\n#include "common.h"\ninline float four() { return two() * two(); }\n')
    write(tmp_path, "a.metal", '#include "mid.h"\n#include "common.h"\nkernel void a() {}\n')
    write(tmp_path, "b.metal", '#include "common.h"\nkernel void b() {}\n')
    units = kernel_source.split_units(tmp_path)
    assert list(units) == ["a", "b"]
    a, b = units["a"], units["b"]
    # each unit inlines every header it reaches, once, whatever the other units include
    assert a.count("inline float two()") == 1 and a.count("inline float four()") == 1 and "kernel void b" not in a
    assert b.count("inline float two()") == 1 and "four" not in b and "kernel void a" not in b
    la, lb = a.splitlines(), b.splitlines()
    assert la[0] == '#line 1 "a.metal"' and lb[0] == '#line 1 "b.metal"'
    assert la[la.index("inline float two() { return 2.0f; }") - 2] == '#line 1 "common.h"'
    assert la[la.index("kernel void a() {}") - 1] == '#line 3 "a.metal"'
    assert units == {p.stem: kernel_source.unit_text(p) for p in sorted(tmp_path.glob("*.metal"))}


def test_a_unit_with_a_missing_include_or_non_ascii_text_is_refused(tmp_path):
    write(tmp_path, "a.metal", '#include "nope.h"\n')
    with pytest.raises(FileNotFoundError, match=r"a.metal:1: .*nope.h"):
        kernel_source.split_units(tmp_path)
    write(tmp_path, "a.metal", "// caf\u00e9\n")
    with pytest.raises(ValueError, match="a.metal must be ASCII"):
        kernel_source.split_units(tmp_path)


def test_kernel_name_prefixes_are_read_from_the_text_without_comments():
    text = ('// BNB_KERNEL_INSTANTIATE("bnb_commented_", f, t)\n'
            'BNB_KERNEL_INSTANTIATE("bnb_inst_" #t, f, t)\n'
            'template [[host_name("bnb_host")]] [[kernel]] decltype(f<1>) f<1>;\n'
            "[[kernel]] void bnb_plain(device float* x) {}\n"
            "kernel void bnb_old_style() {}\n"
            "#define BNB_KERNEL_INSTANTIATE(host, fn, ...) template [[host_name(host)]] [[kernel]] decltype(fn)\n")  # fmt: skip
    assert kernel_source.kernel_name_prefixes(text) == {"bnb_inst_", "bnb_host", "bnb_plain", "bnb_old_style"}
