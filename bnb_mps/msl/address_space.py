"""The address-space check: kernels compiled with Metal's four address spaces as distinct types.

The emulator compiles kernels as C++ with `device`, `constant`, `threadgroup` and `thread` erased,
so a `device float*` passed where a `thread float*` is expected, a reference bound across
address spaces, a cast between them or a write through a `constant` pointer all compile there
and fail only in the Metal compiler. This check finds them on any machine with clang.

How: clang compiles each kernel file as C++ for OpenCL (`-x clcpp -cl-std=clc++2021`, syntax
only) against the small Metal header set in `address_space_include/`, which maps
`device` -> `__global`, `constant` -> `__constant`, `threadgroup` -> `__local`,
`thread` -> `__private`. Why OpenCL rather than `__attribute__((address_space(N)))` in plain C++:
OpenCL's address spaces are part of the language, so local variables are `__private` (Metal's
`thread`) without being written so, templates deduce address spaces from their arguments (as
Metal's do), casts between address spaces are diagnosed, `__constant` implies const, and objects
of class type in device/threadgroup memory can still be copied; in plain C++ a numbered address
space makes every local variable mismatch `thread` pointers and every struct copy fail.

What OpenCL adds that Metal does not have is handled as follows:
- a pointer or reference written without an address space is OpenCL's `__generic`, which accepts
  device, threadgroup and thread pointers; Metal rejects such a pointer outright. clang's AST
  shows every type the source spells: each one holding `__generic` is reported ("no address
  space"), at its line, wherever it is written (parameters, variables, members, casts, template
  arguments, typedefs, return types);
- OpenCL allows `__local` variables only in OpenCL kernels: the pre-pass rewrites
  `threadgroup T name[N];` inside functions into a reference to threadgroup storage;
- clang's vectors have no multi-argument constructors: the pre-pass spells `float4(a, b, c, d)`
  (any Metal vector type name or `vec<T, N>`) as a call of a helper that builds the vector;
- Metal-syntax explicit instantiations `template [[host_name("x")]] [[kernel]] ...` lose their
  attributes (C++ allows none there).
No line is added or removed, and every file is inlined under its own `#line`, so findings name
the kernel file and line.

Limits (what this cannot see): overload resolution and implicit conversions between scalar and
vector types are modelled leniently (the header set declares maths with permissive templates);
member functions are not required to carry an address-space qualifier for objects in device or
threadgroup memory (Metal requires it; OpenCL's `this` is generic); copying a struct out of
`constant` memory is rejected by OpenCL but valid Metal (no kernel here does it); only code that
is compiled is checked: a template that no file instantiates is checked only where it does not
depend on its parameters, and code under a false `#if` not at all.

Usage: `python -m bnb_mps.msl_lint [paths...]` runs this check together with the lint; skipped,
with a message, where no suitable clang exists (set BNB_MPS_CLANG to choose one).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .lint import Finding
from .text import brace_depths, split_top_level, strip_comments

RULE = "address-space"
#: other errors the Metal compiler would give too (a vector of the wrong length, a const write ...)
COMPILE_RULE = "msl-compile"
#: findings of this rule are about the check itself (something its Metal headers lack)
UNSUPPORTED_RULE = "address-space-check"
CLANG_ENV = "BNB_MPS_CLANG"
CLANG_CANDIDATES = ("clang", "clang-20", "clang-19", "clang-18", "clang-17", "clang-16", "clang-15", "clang-14")
_HEADER_NAME = "bnb_metal_as.h"


class CheckUnavailable(RuntimeError):
    """No clang that can run the check (the message says what was tried)."""


def include_dir() -> Path:
    return Path(__file__).resolve().parent / "address_space_include"


def _base_flags(target: list[str]) -> list[str]:
    return [
        "-x", "clcpp", "-cl-std=clc++2021", *target, "-fsyntax-only",
        "-nostdlibinc", "-cl-no-stdinc", "-isystem", str(include_dir()),
        "-Wno-unknown-attributes", "-Wno-ignored-attributes", "-Wno-unused-value",
        "-ferror-limit=0", "-fno-caret-diagnostics", "-fno-color-diagnostics", "-fno-diagnostics-show-option",
    ]


_PROBE_OK = """#include <metal_stdlib>
using namespace metal;
inline float first(thread const float* x) { return x[0]; }
template <typename T>
[[kernel]] void k(device T* out [[buffer(0)]], constant uint& n [[buffer(1)]], uint i [[thread_position_in_grid]]) {
    threadgroup float buf[4];
    float v[2] = {1.0f, 2.0f};
    half4 h = half4(1.0h, 2.0h, out[0], 0);
    out[i] = T(first(v) + buf[0] + float(n) + float(h.x) + as_type<float>(n));
}
template [[host_name("k_f")]] [[kernel]] decltype(k<float>) k<float>;
"""
_PROBE_BAD = """#include <metal_stdlib>
inline float first(thread const float* x) { return x[0]; }
inline float g(device float* x) { return first(x); }
"""


@dataclass(frozen=True)
class Clang:
    path: str
    flags: tuple[str, ...]
    version: str


def _run(cmd: list[str], text: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, input=text, capture_output=True, text=True, timeout=timeout)


@functools.lru_cache(maxsize=None)
def find_clang() -> Clang:
    """The first clang (BNB_MPS_CLANG, else clang, clang-20 ... clang-14 on PATH) that compiles a
    probe kernel in this mode and rejects a probe mismatch. Raises CheckUnavailable."""
    wanted = os.environ.get(CLANG_ENV)
    names = [wanted] if wanted else list(CLANG_CANDIDATES)
    tried = []
    for name in names:
        path = shutil.which(name)
        if path is None:
            tried.append(f"{name}: not found")
            continue
        # SPIR: a target whose syntax checks need no code generator, where _Float16 (bfloat) exists.
        for target in (["-target", "spir64"], []):
            flags = _base_flags(target)
            try:
                ok = _run([path, *flags, "-"], prepass(_PROBE_OK), timeout=120)
                bad = _run([path, *flags, "-"], prepass(_PROBE_BAD), timeout=120)
            except (OSError, subprocess.SubprocessError) as e:
                tried.append(f"{name}: {e}")
                break
            if ok.returncode == 0 and bad.returncode != 0:
                version = _run([path, "--version"], "").stdout.splitlines()
                return Clang(path, tuple(flags), version[0] if version else "clang")
            reason = [ln for ln in (ok.stderr or "").splitlines() if "error" in ln] or ["the probe mismatch was not rejected"]
            tried.append(f"{name} {' '.join(target) or '(host target)'}: {reason[0] if reason else '?'}")
    raise CheckUnavailable(
        "no clang that compiles C++ for OpenCL 2021 (clang >= 14) was found; "
        f"tried: {'; '.join(tried)}. Install clang or set {CLANG_ENV}."
    )


# -- the pre-pass -----------------------------------------------------------------------------------

_SCALARS = ("char", "uchar", "short", "ushort", "int", "uint", "long", "ulong", "half", "bfloat", "float")
_VECTOR_NAMES = tuple(f"{s}{n}" for s in _SCALARS for n in (2, 3, 4))
_VECTOR_CALL = re.compile(r"(?<![\w.>$])(?:metal\s*::\s*)?(%s)\s*\(" % "|".join(_VECTOR_NAMES))
_VEC_TEMPLATE = re.compile(r"(?<![\w.>$])(?:metal\s*::\s*)?vec\s*<")
_EXPLICIT_INSTANCE = re.compile(r"\btemplate\s*((?:\[\[.*?\]\]\s*)+)", re.S)
_THREADGROUP = re.compile(r"\bthreadgroup\b")
_DECLARATOR = re.compile(r"^\s*(?P<type>.*?)\s*\b(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\]]*\]\s*)*)$", re.S)
_NAME_DIMS = re.compile(r"^\s*(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\]]*\]\s*)*)$", re.S)


def _matching_angle(text: str, pos: int) -> int:
    """Index just past the `>` closing the `<` at pos (-1 if none)."""
    depth = 0
    for i in range(pos, len(text)):
        ch = text[i]
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
            if depth == 0:
                return i + 1
        elif ch in ";{}":
            return -1
    return -1


def _rewrite_vector_constructors(text: str) -> str:
    out, last = [], 0
    for m in _VECTOR_CALL.finditer(text):
        out.append(text[last : m.start()])
        out.append(f"::metal::bnb_as::make_vec<{m.group(1)}>(")
        last = m.end()
    out.append(text[last:])
    text = "".join(out)
    out, last = [], 0
    for m in _VEC_TEMPLATE.finditer(text):
        close = _matching_angle(text, m.end() - 1)
        if close < 0:
            continue
        after = re.match(r"\s*\(", text[close:])
        if after is None:
            continue
        out.append(text[last : m.start()])
        out.append(f"::metal::bnb_as::make_vec<{text[m.start():close]}>(")
        last = close + after.end()
    out.append(text[last:])
    return "".join(out)


def _strip_instance_attributes(text: str) -> str:
    return _EXPLICIT_INSTANCE.sub(lambda m: "template" + re.sub(r"[^\n]", " ", m.group(1)), text)


def _rewrite_threadgroup_variables(text: str) -> str:
    """`threadgroup T a[N], b;` inside a function -> references to threadgroup storage.
    Declarations at file scope stay (clang reports them: Metal wants `constant` there)."""
    depths = None
    out, last = [], 0
    for m in _THREADGROUP.finditer(text):
        start = m.start()
        if start < last:
            continue
        prev = text[:start].rstrip()
        if prev and prev[-1] not in ";{}" and not prev.endswith(":"):
            continue  # a qualifier inside a declaration or a parameter list
        end = text.find(";", m.end())
        if end < 0:
            continue
        body = text[m.end() : end]
        outside = re.sub(r"\[[^\]]*\]", "[]", body)
        if not body.strip() or any(ch in outside for ch in "()*&={}\n#"):
            continue  # not a plain declaration (pointer, reference, initializer, ...)
        if depths is None:
            depths = brace_depths(text)
        if depths[start] == 0:
            continue
        parts = split_top_level(body)
        first = _DECLARATOR.match(parts[0])
        if not first or not first.group("type"):
            continue
        ctype = first.group("type")
        decls = [(first.group("name"), first.group("dims"))]
        for p in parts[1:]:
            m2 = _NAME_DIMS.match(p)
            if not m2:
                break
            decls.append((m2.group("name"), m2.group("dims")))
        else:
            stmt = " ".join(
                f"threadgroup {ctype} (&{n}){d.strip()} = ::metal::bnb_as::threadgroup_variable<{ctype} {d.strip()}>();"
                for n, d in decls
            )
            out.append(text[last:start])
            out.append(stmt + "\n" * text.count("\n", start, end))
            last = end + 1
    out.append(text[last:])
    return "".join(out)




def prepass(text: str) -> str:
    """Kernel text -> C++ for OpenCL text with the same lines (see the module docstring)."""
    text = strip_comments(text)
    text = _strip_instance_attributes(text)
    text = _rewrite_threadgroup_variables(text)
    return _rewrite_vector_constructors(text)


_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$')


def translation_unit(path: Path) -> tuple[str, list[Path]]:
    """`path` with its local includes inlined once (each file under its own `#line`), pre-passed.
    Returns the text and the files it holds."""
    seen: list[Path] = []

    def inline(p: Path) -> list[str]:
        p = p.resolve()
        seen.append(p)
        name = json.dumps(str(p))
        out = [f"#line 1 {name}"]
        lines = prepass(p.read_text(encoding="utf-8", errors="replace")).split("\n")
        for lineno, line in enumerate(lines, start=1):
            m = _INCLUDE.match(line)
            if m is None:
                out.append("" if line.strip() == "#pragma once" else line)
                continue
            target = (p.parent / m.group(1)).resolve()
            if not target.is_file():
                out.append(line)  # clang reports the missing file at this line
                continue
            if target not in seen:
                out.extend(inline(target))
            out.append(f"#line {lineno + 1} {name}")
        return out

    return "\n".join(inline(path)) + "\n", seen


# -- running clang and reading its diagnostics ----------------------------------------------------

_DIAG = re.compile(r"^(?P<file>.*?):(?P<line>\d+):(?P<col>\d+): (?P<kind>error|warning|note|fatal error): (?P<msg>.*)$")
_AS_NAMES = {"__global": "device", "__constant": "constant", "__local": "threadgroup", "__private": "thread",
             "__generic": "(no address space)"}
_AS_WORD = re.compile(r"\b(__global|__constant|__local|__private|__generic)\b")
_UNDECLARED = re.compile(r"use of undeclared identifier|no member named .* in namespace 'metal'|unknown type name|"
                         r"no template named|no type named .* in namespace 'metal'")


def _metal_words(msg: str) -> str:
    msg = re.sub(r"([*&])\s*__private\b", r"\1", msg)  # where a pointer variable itself lives: noise
    msg = _AS_WORD.sub(lambda m: _AS_NAMES[m.group(1)], msg).replace("_Float16", "bfloat")
    msg = msg.replace("::metal::bnb_as::make_vec", "vector constructor").replace("metal::bnb_as::make_vec", "vector constructor")
    return msg.replace("metal::bnb_as::threadgroup_variable", "threadgroup variable")


def _explain(msg: str, notes: list[str]) -> str:
    useful = [n for n in notes if _AS_WORD.search(n) or "address space" in n]
    text = _metal_words(msg)
    if useful:
        text += " (" + "; ".join(dict.fromkeys(_metal_words(n) for n in useful[:2])) + ")"
    if "non-kernel function variable cannot be declared in local address space" in msg:
        text = "threadgroup variable with an initializer or an unusual declarator; declare `threadgroup T name[N];` in the kernel body"
    if msg.startswith("read-only variable is not assignable"):
        text = "read-only variable is not assignable (a write through a `constant` pointer or reference, or to a const)"
    if re.search(r"program scope variable must reside in", msg):
        text = "program-scope variables must be in the `constant` address space"
    return text


def _diagnostics(stderr: str, files: set[str]) -> list[Finding]:
    """Errors of a clang run as findings at their file and line. A template error is reported at
    its line in the template (clang notes the instantiation); an error inside the check's own
    headers at the first kernel line clang names for it."""
    findings: list[Finding] = []
    entries: list[tuple[str, int, str, list[tuple[str, int, str]]]] = []
    for line in stderr.splitlines():
        m = _DIAG.match(line)
        if m is None:
            continue
        kind, where = m.group("kind"), (m.group("file"), int(m.group("line")))
        if kind in ("error", "fatal error"):
            entries.append((where[0], where[1], m.group("msg"), []))
        elif kind == "note" and entries:
            entries[-1][3].append((where[0], where[1], m.group("msg")))
    for file, line, msg, notes in entries:
        if file not in files:
            user = [(f, ln) for f, ln, _ in notes if f in files]
            if user:
                file, line = user[0]
        note_texts = [n for _, _, n in notes]
        msg = re.sub(r"; did you mean .*\?\)?$", "", msg)
        if _UNDECLARED.search(msg):
            header = include_dir() / _HEADER_NAME
            name = re.search(r"'([^']+)'", msg)
            what = f"`{name.group(1)}`" if name else "a name"
            findings.append(Finding(file, line, UNSUPPORTED_RULE,
                                    f"{what} is not declared ({msg}); if it is part of the Metal standard library, "
                                    f"the address-space check's headers lack it: declare it in {header}"))
            continue
        if "excess elements in" in msg or "function-style cast to a builtin type can only take one argument" in msg:
            findings.append(Finding(file, line, UNSUPPORTED_RULE,
                                    "a vector constructor the check cannot see (spell it with a Metal vector type name, "
                                    f"e.g. float4(...) or vec<T, 4>(...)): {_metal_words(msg)}"))
            continue
        msg = re.sub(r"; did you mean .*\?$", "", msg)
        quoted = re.match(r"static_assert failed.*?\"(.*)\"$", msg)
        if quoted:
            findings.append(Finding(file, line, COMPILE_RULE, quoted.group(1)))
        elif _AS_WORD.search(msg) or "address space" in msg or "read-only variable" in msg or any(
                _AS_WORD.search(n) or "address space" in n for n in note_texts):
            findings.append(Finding(file, line, RULE, _explain(msg, note_texts)))
        else:
            findings.append(Finding(file, line, COMPILE_RULE, _explain(msg, note_texts)))
    return findings


# -- types without an address space, from clang's AST ---------------------------------------------

_GENERIC = re.compile(r"\b__generic\b")
# AST nodes whose type the source spells (not inferred): declarations, casts, sizeof/alignof.
_DECL_KINDS = {"ParmVarDecl": "parameter", "VarDecl": "variable", "FieldDecl": "member", "TypedefDecl": "typedef",
               "TypeAliasDecl": "alias", "NonTypeTemplateParmDecl": "template parameter"}
_FUNCTION_KINDS = {"FunctionDecl", "CXXMethodDecl", "CXXConversionDecl"}
_CAST_KINDS = {"CStyleCastExpr", "CXXStaticCastExpr", "CXXReinterpretCastExpr", "CXXConstCastExpr",
               "CXXFunctionalCastExpr"}


class _LineMap:
    """Offsets of the translation unit's text -> (original file, line), through its #line directives."""

    def __init__(self, text: str):
        self.starts = [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n"]
        self.lines: list[tuple[str | None, int]] = []
        file, line = None, 1
        for raw in text.split("\n"):
            m = re.match(r'#line (\d+) (".*")$', raw)
            if m:
                self.lines.append((None, 0))
                file, line = json.loads(m.group(2)), int(m.group(1))
            else:
                self.lines.append((file, line))
                line += 1

    def at(self, offset: int) -> tuple[str | None, int]:
        import bisect

        return self.lines[bisect.bisect_right(self.starts, offset) - 1]


def _return_type(function_type: str) -> str:
    """`float (const __generic float *) const __generic` -> `float ` (what precedes the parameters)."""
    depth = 0
    for i, ch in enumerate(function_type):
        if ch == "(":
            if depth == 0 and i > 0:
                return function_type[:i]
            depth += 1
        elif ch == ")":
            depth -= 1
    return function_type


def _spelled(qual_type: str) -> str:
    t = re.sub(r"([*&])\s*__private\b", r"\1", qual_type)  # where the pointer itself lives
    t = _GENERIC.sub("", t)
    t = _AS_WORD.sub(lambda m: _AS_NAMES[m.group(1)], t)
    return " ".join(t.split())


def _generic_types(ast: dict, tu_text: str) -> list[Finding]:
    """Every pointer or reference type the source spells without an address space (OpenCL's
    `__generic`), at the line that spells it."""
    lines = _LineMap(tu_text)
    found: list[Finding] = []
    state = {"file": None}
    patterns: dict[str, str] = {}  # function template specialization id -> its pattern's type

    def bare(loc: dict) -> tuple[str | None, int] | None:
        if "file" in loc:
            state["file"] = loc["file"]
        if "offset" not in loc or state["file"] != "<stdin>":
            return None
        return lines.at(loc["offset"])

    def place(loc: dict | None) -> tuple[str | None, int] | None:
        if not loc:
            return None
        if "spellingLoc" in loc or "expansionLoc" in loc:
            bare(loc.get("spellingLoc", {}))
            return bare(loc.get("expansionLoc", {}))
        return bare(loc)

    def report(where, message: str) -> None:
        if where and where[0]:
            found.append(Finding(where[0], where[1], RULE, message))

    def walk(node: dict, implicit: bool) -> None:
        # `implicit`: compiler-made declarations and template instantiations, whose types come from
        # template arguments (a bad argument is reported where it is written, at the call).
        kind = node.get("kind")
        where = place(node.get("loc"))
        rng = node.get("range") or {}
        begin = place(rng.get("begin"))
        place(rng.get("end"))
        where = where or begin
        implicit = implicit or bool(node.get("isImplicit")) or kind == "ClassTemplateSpecializationDecl"
        qual = (node.get("type") or {}).get("qualType", "")
        if not implicit and where:
            if kind in _DECL_KINDS and _GENERIC.search(qual):
                name = node.get("name")
                report(where, f"{_DECL_KINDS[kind]} {'`' + name + '` ' if name else ''}has a pointer or reference type "
                              f"without an address space (`{_spelled(qual)}`): write device, constant, threadgroup or thread")
            elif kind in _FUNCTION_KINDS and _GENERIC.search(_return_type(qual)):
                report(where, f"`{node.get('name')}` returns a pointer or reference without an address space "
                              f"(`{_spelled(_return_type(qual))}`)")
            elif kind in _CAST_KINDS and _GENERIC.search(qual):
                report(where, f"cast to a pointer or reference type without an address space (`{_spelled(qual)}`)")
            elif kind == "UnaryExprOrTypeTraitExpr" and _GENERIC.search((node.get("argType") or {}).get("qualType", "")):
                report(where, f"`{node.get('name')}` of a pointer or reference type without an address space")
            elif kind == "DeclRefExpr" and _GENERIC.search(qual):
                ref = node.get("referencedDecl") or {}
                pattern = patterns.get(ref.get("id", ""))
                if pattern is not None and not _GENERIC.search(pattern):
                    report(where, f"a template argument of `{ref.get('name')}` is a pointer or reference type "
                                  "without an address space")
        children = node.get("inner", ())
        if kind == "FunctionTemplateDecl":
            functions = [c for c in children if c.get("kind") in _FUNCTION_KINDS]
            for spec in functions[1:]:
                patterns[spec.get("id", "")] = (functions[0].get("type") or {}).get("qualType", "")
            for child in children:
                walk(child, implicit or (bool(functions) and child is not functions[0]))
            return
        for child in children:
            walk(child, implicit)

    walk(ast, False)
    return found


# -- entry points ---------------------------------------------------------------------------------


def _display(path: str, given: dict[str, str]) -> str:
    """How a file is named in findings: as the caller named it, else relative to the current
    directory when below it (as the lint names files)."""
    if path in given:
        return given[path]
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def check_file(path: Path, clang: Clang | None = None, names: dict[str, str] | None = None) -> list[Finding]:
    """Address-space findings for one .metal/.h file (with everything it includes)."""
    clang = clang or find_clang()
    given = dict(names or {})
    given.setdefault(str(path.resolve()), str(path))
    text, files = translation_unit(path)
    # One run: errors on stderr, the AST (for types spelled without an address space) on stdout.
    result = _run([clang.path, *clang.flags, "-Xclang", "-ast-dump=json", "-"], text)
    findings = _diagnostics(result.stderr, {str(f) for f in files})
    if result.stdout.strip():
        try:
            ast = json.loads(result.stdout)
        except json.JSONDecodeError:
            ast = None
        if ast is not None:
            findings += _generic_types(ast, text)
    findings = [Finding(_display(f.path, given), f.line, f.rule, f.message) for f in findings]
    return sorted(set(findings), key=lambda f: (f.path, f.line, f.rule, f.message))


def _given_files(paths: list[Path]) -> list[Path]:
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.suffix in (".metal", ".h"))
        else:
            files.append(path)
    return files


def kernel_files(paths: list[Path]) -> list[Path]:
    """The files to compile: every given .metal file; for a given .h file that no given .metal
    file includes, the .metal files beside it that include it (so that its templates are checked
    as instantiated), else the header on its own."""
    files = _given_files(paths)
    metal = [f for f in files if f.suffix == ".metal"]
    included: set[Path] = set()
    for f in metal:
        included.update(translation_unit(f)[1])
    extra: list[Path] = []
    for header in (f for f in files if f.suffix != ".metal" and f.resolve() not in included):
        users = [m for m in sorted(header.resolve().parent.glob("*.metal"))
                 if m not in extra and header.resolve() in translation_unit(m)[1]]
        if users:
            extra += users
            for m in users:
                included.update(translation_unit(m)[1])
        else:
            extra.append(header)
    return metal + extra


def check_paths(paths: list[Path], clang: Clang | None = None) -> list[Finding]:
    """Address-space findings for files and directories (as `python -m bnb_mps.msl_lint` takes
    them): findings in the given files and in what they include (not in a .metal file compiled
    only because it instantiates a given header)."""
    from concurrent.futures import ThreadPoolExecutor

    clang = clang or find_clang()
    given = _given_files(paths)
    names = {str(f.resolve()): str(f) for f in given}
    wanted: set[str] = set()
    for f in given:
        wanted.update(str(p) for p in translation_unit(f)[1])
    files = kernel_files(paths)
    with ThreadPoolExecutor(max_workers=max(1, min(len(files), os.cpu_count() or 1))) as pool:
        results = list(pool.map(lambda f: check_file(f, clang, names), files))
    displayed = {_display(w, names) for w in wanted}
    return _one_per_line([f for r in results for f in r if f.path in displayed])


def _one_per_line(findings: list[Finding]) -> list[Finding]:
    """One finding per file, line and rule: a template error repeats once per instantiation
    (float, half, bfloat, ...) with only the types differing."""
    by_place: dict[tuple[str, int, str], list[str]] = {}
    for f in sorted(set(findings), key=lambda f: (f.path, f.line, f.rule, f.message)):
        by_place.setdefault((f.path, f.line, f.rule), []).append(f.message)
    return [Finding(path, line, rule, msgs[0] + (f" [and {len(msgs) - 1} more like it at this line]" if len(msgs) > 1 else ""))
            for (path, line, rule), msgs in by_place.items()]
