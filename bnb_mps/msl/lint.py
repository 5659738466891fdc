"""A lint for the project's Metal kernels: what compiles as C++ but is not valid (or not allowed) MSL.

The emulator compiles `csrc/kernels/*.metal` as C++, so constructs that Metal rejects (`double`,
`std::`, libc calls, lambdas, recursion, pointers without an address space) would pass CI and
only fail on a Mac. This module catches them statically, together with what the project's rules
forbid so that kernels stay emulator- and `compile_shader`-friendly (`[[threadgroup(n)]]`
parameters, function constants, non-constant-size threadgroup arrays, non-metal includes,
non-ASCII text).

It also enforces rules of the Metal Shading Language specification that a kernel here could
break and that neither the emulator nor the address-space check sees: program-scope variables
live in `constant`; `threadgroup` variables are declared in a kernel's body, without an
initializer; kernels return void; every kernel parameter carries a buffer index (unique, below
31, and, because executors bind launch argument i to `[[buffer(i)]]`, numbered 0..k-1) or a
built-in input attribute of a type Metal accepts for it; buffer parameters are device/constant
pointers or references, scalars of a type `bnb_mps.kernel_args` binds; no `goto`, `new`/`delete`,
virtual functions, exceptions, RTTI or `thread_local`; Metal 3.2's memory-model spellings
(`coherent(device)`, `thread_scope_*`) only under `#if __METAL_VERSION__ >= 320`.

It works on the source with comments and string literals blanked out (line numbers kept); the
checks are regular expressions plus a little bracket matching, deliberately conservative.

Usage: `python -m bnb_mps.msl_lint [paths...]` (files or directories; default `csrc/kernels/`).
Prints `file:line: [rule] message` per finding and exits 1 if there is any.
"""

from __future__ import annotations

import bisect
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from .text import split_top_level, strip_comments_and_strings

ADDRESS_SPACES = (
    "device",
    "constant",
    "thread",
    "threadgroup",
    "threadgroup_imageblock",
    "ray_data",
    "object_data",
)
_ADDRESS_SPACE = re.compile(r"\b(?:%s)\b" % "|".join(ADDRESS_SPACES))

LIBC_FUNCTIONS = (
    "printf",
    "fprintf",
    "sprintf",
    "snprintf",
    "puts",
    "malloc",
    "calloc",
    "realloc",
    "free",
    "memcpy",
    "memmove",
    "memset",
    "memcmp",
    "strlen",
    "strcpy",
    "strcmp",
    "exit",
    "abort",
    "assert",
    "rand",
    "srand",
)

# Metal's float math library (metal_math, and the common functions clamp and saturate): under fast math
# (PYTORCH_MPS_FAST_MATH makes torch ask for mathFloatingPointFunctions = Fast) an unqualified call
# takes the function's fast variant, and no pragma in the source changes that; `metal::precise::`
# does not depend on it. These names are float-only in Metal (fma, fdim, frexp and nextafter are left
# out: Metal's library computes them the same under either setting):
FLOAT_MATH_FUNCTIONS = frozenset(
    "acos acosh asin asinh atan atan2 atanh cbrt ceil copysign cos cosh cospi divide exp exp10 exp2 fabs "
    "floor fmax fmax3 fmedian3 fmin fmin3 fmod fract ilogb ldexp log log10 log2 modf "
    "pow powr rint round rsqrt saturate sin sincos sinh sinpi sqrt tan tanh tanpi trunc".split()
)
# ... and these also take integers (then they are exact): flagged where an argument is visibly a
# float (a floating literal or a float conversion); the lint cannot see types otherwise.
OVERLOADED_MATH_FUNCTIONS = frozenset("abs clamp max min max3 min3 median3".split())
_FLOAT_ARGUMENT = re.compile(r"(?<![\w.])(?:\d+\.\d*|\.\d+|\d+[eE][+-]?\d+)[fFhH]?\b|\b(?:float|half|bfloat)\d?\s*\(|"
                             r"as_type\s*<\s*(?:float|half|bfloat)")

# Words that can precede `(` without being a function name.
_NOT_FUNCTIONS = frozenset(
    "if for while switch return sizeof alignof decltype catch static_assert case do else "
    "static_cast reinterpret_cast const_cast dynamic_cast as_type operator new delete throw "
    "defined".split()
)
# Words that can start a statement without being a type.
_NOT_TYPES = frozenset("return else do case goto throw delete new typedef using sizeof".split())

_KERNEL_MARK = re.compile(r"\bkernel\b|\[\[\s*kernel\s*\]\]")
# Built-in kernel inputs: the position-like ones take uint/ushort scalars or 2-/3-vectors, the
# others a uint or ushort scalar.
_POSITION_INPUTS = frozenset(
    "thread_position_in_grid thread_position_in_threadgroup threadgroup_position_in_grid threads_per_threadgroup "
    "threadgroups_per_grid threads_per_grid dispatch_threads_per_threadgroup grid_origin grid_size".split()
)
_INDEX_INPUTS = frozenset(
    "thread_index_in_threadgroup thread_index_in_simdgroup simdgroup_index_in_threadgroup threads_per_simdgroup "
    "simdgroups_per_threadgroup dispatch_simdgroups_per_threadgroup thread_execution_width thread_index_in_quadgroup "
    "quadgroup_index_in_threadgroup quadgroups_per_threadgroup dispatch_quadgroups_per_threadgroup".split()
)
_BUILTIN_INPUTS = _POSITION_INPUTS | _INDEX_INPUTS
_POSITION_TYPES = frozenset("uint uint2 uint3 ushort ushort2 ushort3".split())
_INDEX_TYPES = frozenset("uint ushort".split())
#: the scalar types bnb_mps.kernel_args binds to `constant T&` parameters
_BINDABLE_SCALARS = ("bool", "char", "uchar", "short", "ushort", "int", "uint", "long", "ulong", "half", "float")
#: built-in scalars a launch cannot pass as a `constant T&` scalar (pointer-sized, or no kernel_args type)
_UNBINDABLE_SCALARS = frozenset("size_t ptrdiff_t intptr_t uintptr_t bfloat".split())
_NOT_VARIABLE_STARTS = frozenset(
    "template typedef using namespace struct class union enum static_assert extern return operator friend "
    "public private protected".split()
)


def _blank_preprocessor(code: str) -> str:
    """Preprocessor lines (with their continuations) -> spaces, newlines kept."""
    out, lines, cont = [], code.split("\n"), False
    for line in lines:
        if cont or line.lstrip().startswith("#"):
            cont = line.rstrip().endswith("\\")
            out.append(" " * len(line))
        else:
            out.append(line)
    return "\n".join(out)


def _top_level_statements(code: str) -> list[tuple[int, int]]:
    """(start, end) of statements outside every function, type and initializer body (namespace
    bodies are transparent); a braced body ends the statement it belongs to unless a `;` or `,`
    follows (then the body is an initializer or a type with declarators)."""
    spans: list[tuple[int, int]] = []
    i, n, start = 0, len(code), 0
    while i < n:
        ch = code[i]
        if ch == ";":
            spans.append((start, i))
            start = i + 1
        elif ch == "{":
            before = code[start:i]
            if re.search(r"\bnamespace\b[^;{}]*$", before) or re.search(r'\bextern\s*"', before):
                start = i + 1  # namespace body: keep scanning at the top level
            else:
                close = _match_bracket(code, i)
                after = code[close:].lstrip()
                if after[:1] in (";", ",") or re.search(r"=\s*$", before):
                    i = close
                    continue
                spans.append((start, close))
                start = close
                i = close
                continue
        elif ch == "}":
            start = i + 1  # end of a namespace body
        i += 1
    return [(s, e) for s, e in spans if code[s:e].strip()]


def _before_initializer(text: str) -> str:
    """The declaration part of a statement: up to its first `=` outside brackets (or a body)."""
    depth = 0
    for i, ch in enumerate(text):
        if ch in "([{":
            if ch == "{" and depth == 0 and "(" in text[:i]:
                return text[:i]
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "=" and depth == 0 and text[i + 1 : i + 2] != "=" and text[i - 1 : i] not in "<>!=":
            return text[:i]
    return text


def _skip_macro_calls(text: str) -> str:
    """Drops leading macro invocations written without a semicolon, e.g. `INSTANTIATE(a, b)`."""
    while True:
        m = re.match(r"\s*[A-Z_][A-Z0-9_]*\s*\(", text)
        if m is None:
            return text.strip()
        close = _match_bracket(text, m.end() - 1)
        rest = text[close:]
        if not rest.strip() or re.match(r"\s*[;{=\[]", rest):
            return text.strip() if re.match(r"\s*[=\[{]", rest) else ""
        text = rest


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: [{self.rule}] {self.message}"


def _match_bracket(code: str, start: int) -> int:
    """Index just past the bracket that closes the one at `start` (or len(code))."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    opening = code[start]
    closing = pairs[opening]
    depth = 0
    for k in range(start, len(code)):
        ch = code[k]
        if ch == opening:
            depth += 1
        elif ch == closing:
            depth -= 1
            if depth == 0:
                return k + 1
    return len(code)


def _remove_attributes(text: str) -> str:
    """Blanks `[[...]]` attributes (same length, so offsets stay valid)."""
    return re.sub(r"\[\[.*?\]\]", lambda m: " " * len(m.group(0)), text, flags=re.S)


@dataclass
class _Function:
    name: str
    name_pos: int
    params_start: int  # index of "("
    params_end: int  # index just past ")"
    body_start: int  # index of "{"
    body_end: int  # index just past "}"
    return_type: str


# After a parameter list: cv / address-space qualifiers of member functions, attributes, then `{`.
_AFTER_PARAMS = re.compile(r"(?:\s*(?:const|volatile|noexcept|thread|device|constant|threadgroup|\[\[.*?\]\]))*\s*\{", re.S)


def _find_functions(code: str) -> list[_Function]:
    """Function definitions: `name(params) [qualifiers] {`, name not a keyword or a lambda."""
    functions = []
    for m in re.finditer(r"(?<![\w.])([A-Za-z_]\w*)\s*\(", code):
        name = m.group(1)
        if name in _NOT_FUNCTIONS or name in ADDRESS_SPACES:
            continue
        params_start = m.end() - 1
        params_end = _match_bracket(code, params_start)
        after = _AFTER_PARAMS.match(code, params_end)
        if after is None:
            continue
        body_start = after.end() - 1
        # The return type: what precedes the name on its declaration (back to ; { } or >> of a template head).
        head_start = max(code.rfind(";", 0, m.start()), code.rfind("{", 0, m.start()), code.rfind("}", 0, m.start()))
        return_type = code[head_start + 1 : m.start()]
        if re.search(r"[=(,]\s*$", return_type) or re.search(r"\breturn\s*$", return_type):
            continue  # a call or initializer followed by a brace, not a definition
        functions.append(
            _Function(name, m.start(1), params_start, params_end, body_start, _match_bracket(code, body_start), return_type)
        )
    return functions


def _is_block_brace(code: str, pos: int) -> bool:
    """Whether the `{` at pos opens a block/class body (not a braced initializer)."""
    before = code[:pos].rstrip()
    if not before or before[-1] in "){};:":
        return True
    if re.search(r"\b(?:else|do|try)$", before):
        return True
    return re.search(r"\b(?:struct|class|union|enum|namespace)\b[^;{}()=]*$", before) is not None


class _Linter:
    def __init__(self, text: str, path: str):
        self.path = path
        self.raw = text
        self.code_with_strings, self.code = strip_comments_and_strings(text)
        self._line_starts = [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n"]
        self.findings: list[Finding] = []

    def line_of(self, pos: int) -> int:
        return bisect.bisect_right(self._line_starts, pos)

    def report(self, pos: int, rule: str, message: str) -> None:
        self.findings.append(Finding(self.path, self.line_of(pos), rule, message))

    def run(self) -> list[Finding]:
        self.check_ascii()
        self.check_includes()
        self.check_simple_patterns()
        self.check_lambdas()
        functions = _find_functions(self.code)
        self.check_recursion(functions)
        self.check_signatures(functions)
        self.check_declarations()
        self.check_threadgroup_arrays()
        self.check_kernels(functions)
        self.check_threadgroup_variables(functions)
        self.check_program_scope()
        self.check_unsupported_cxx()
        self.check_float_math()
        self.check_metal_version()
        return sorted(set(self.findings), key=lambda f: (f.line, f.rule, f.message))

    # -- rules ------------------------------------------------------------------------------

    def check_ascii(self) -> None:
        for m in re.finditer(r"[^\x00-\x7f]", self.raw):
            self.report(m.start(), "non-ascii", f"non-ASCII character U+{ord(m.group(0)):04X} (kernel source must be ASCII)")

    def check_includes(self) -> None:
        for m in re.finditer(r"^[ \t]*#[ \t]*(include|import)\b[ \t]*(.*)$", self.code_with_strings, re.M):
            directive, target = m.group(1), m.group(2).strip()
            if directive == "import":
                self.report(m.start(), "include", "#import is not allowed; use #include")
            elif re.fullmatch(r"<metal_\w+>", target) or re.fullmatch(r'"[^"]+"', target):
                continue
            else:
                self.report(m.start(), "include", f"#include {target}: only <metal_*> headers and local \"...\" headers are allowed")

    def check_simple_patterns(self) -> None:
        code = self.code
        for m in re.finditer(r"\bdouble\b", code):
            self.report(m.start(), "double", "`double` is not supported by Metal (use float)")
        for m in re.finditer(r"\bstd\s*::", code):
            self.report(m.start(), "std", "`std::` is not available in Metal (use metal::)")
        libc = "|".join(LIBC_FUNCTIONS)
        for m in re.finditer(r"(?<![\w.])(%s)\s*\(" % libc, code):
            before = code[max(0, m.start(1) - 80) : m.start(1)]
            if before.rstrip().endswith("->") or re.search(r"\b(?!std\b)\w+\s*::\s*$", before):
                continue  # a member, or qualified by another namespace (e.g. metal::): not libc
            self.report(m.start(1), "libc", f"C library call `{m.group(1)}` is not available in Metal")
        for m in re.finditer(r"\[\[\s*threadgroup\s*\(", code):
            self.report(m.start(), "threadgroup-param", "[[threadgroup(n)]] parameters are not allowed (declare a fixed-size threadgroup array in the kernel)")
        for m in re.finditer(r"\bfunction_constant\b", code):
            self.report(m.start(), "function-constant", "function constants are not allowed (pass a constant buffer or instantiate a template)")

    def check_lambdas(self) -> None:
        code = self.code
        for m in re.finditer(r"\[([^\[\]]*)\]\s*(?:\(|\{|mutable\b)", code):
            start = m.start()
            if start > 0 and code[start - 1] == "[" or code[m.end(1) + 1 : m.end(1) + 2] == "]":
                continue  # part of an [[attribute]]
            before = code[:start].rstrip()
            if before and (before[-1].isalnum() or before[-1] in "_])"):
                continue  # subscript or array declarator: a[i](...), float v[4]{...}
            self.report(start, "lambda", "lambdas are not supported by Metal")

    def check_recursion(self, functions: list[_Function]) -> None:
        code = self.code
        by_name: dict[str, list[_Function]] = {}
        for f in functions:
            by_name.setdefault(f.name, []).append(f)
        calls: dict[str, set[str]] = {}
        for f in functions:
            body = code[f.body_start : f.body_end]
            for m in re.finditer(r"(?<![\w.>:])([A-Za-z_]\w*)\s*\(", body):
                callee = m.group(1)
                if callee not in by_name:
                    continue
                if callee == f.name:
                    self.report(f.body_start + m.start(), "recursion", f"`{f.name}` calls itself; Metal does not support recursion")
                else:
                    calls.setdefault(f.name, set()).add(callee)
        # Mutual recursion: a cycle in the call graph among this file's functions.
        state: dict[str, int] = {}
        reported: set[str] = set()

        def visit(name: str, stack: list[str]) -> None:
            state[name] = 1
            stack.append(name)
            for callee in sorted(calls.get(name, ())):
                if state.get(callee) == 1:
                    cycle = stack[stack.index(callee) :]
                    for member in cycle:
                        if member not in reported:
                            reported.add(member)
                            f = by_name[member][0]
                            self.report(f.name_pos, "recursion", f"`{member}` is part of a recursive cycle ({' -> '.join(cycle + [callee])})")
                elif state.get(callee) is None:
                    visit(callee, stack)
            stack.pop()
            state[name] = 2

        for name in sorted(calls):
            if state.get(name) is None:
                visit(name, [])

    def check_signatures(self, functions: list[_Function]) -> None:
        code = _remove_attributes(self.code)
        for f in functions:
            params = code[f.params_start + 1 : f.params_end - 1]
            offset = f.params_start + 1
            for param in split_top_level(params):
                declared = split_top_level(param, "=")[0]
                if re.search(r"[*&]", declared) and not _ADDRESS_SPACE.search(declared):
                    pos = offset + (len(param) - len(param.lstrip()))
                    self.report(pos, "address-space", f"parameter `{' '.join(declared.split())}` of `{f.name}` is a pointer/reference without an address space")
                offset += len(param) + 1
            ret = re.sub(r"template\s*<.*>", " ", f.return_type, flags=re.S)
            ret = re.sub(r"\b(?:operator)\b.*", " ", ret)
            if re.search(r"[*&]\s*$", ret) and not _ADDRESS_SPACE.search(ret):
                self.report(f.name_pos, "address-space", f"return type of `{f.name}` is a pointer/reference without an address space")

    _DECL = re.compile(
        r"\s*(?:(?:const|volatile|static|constexpr|inline)\s+)*"
        r"((?:[A-Za-z_]\w*\s*::\s*)*[A-Za-z_]\w*(?:\s*<[^;{}()]*?>)?)"
        r"((?:\s*(?:const\s*)?[*&])+)\s*([A-Za-z_]\w*)\s*(?=[=;,\[{:])"
    )

    def check_declarations(self) -> None:
        """Local/global/member declarations `T* p = ...;` / `T& r = ...;` without an address space."""
        code = _remove_attributes(self.code)
        anchors = [m.end() for m in re.finditer(r"[;}]", code)]
        anchors += [m.end() for m in re.finditer(r"\{", code) if _is_block_brace(code, m.start())]
        anchors += [m.end() for m in re.finditer(r"\bfor\s*\(", code)]
        for a in sorted(set(anchors)):
            m = self._DECL.match(code, a)
            if m is None:
                continue
            type_name = m.group(1)
            first_word = re.match(r"[A-Za-z_]\w*", type_name).group(0)
            if first_word in _NOT_TYPES or first_word in ADDRESS_SPACES or first_word in ("public", "private", "protected", "default"):
                continue
            if code[a : m.start(1)].strip().startswith("#"):
                continue
            pos = m.start(1)
            self.report(pos, "address-space", f"declaration of `{m.group(3)}` as `{' '.join((type_name + m.group(2)).split())}` has no address space")
        for m in re.finditer(r"\b(?:static_cast|reinterpret_cast|const_cast)\s*<([^<>;]*(?:<[^<>;]*>[^<>;]*)*)>", code):
            target = m.group(1)
            if re.search(r"[*&]", target) and not _ADDRESS_SPACE.search(target):
                self.report(m.start(), "address-space", f"cast to `{' '.join(target.split())}` has no address space")

    def _compile_time_names(self) -> set[str]:
        names = _compile_time_names_in(self.code)
        # Names from local headers this file includes (transitively), e.g. a #define'd size.
        seen: set[Path] = set()
        pending = [(Path(self.path).parent, self.code_with_strings)]
        while pending:
            directory, text = pending.pop()
            for header in re.findall(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', text, re.M):
                target = (directory / header).resolve()
                if target in seen or not target.is_file():
                    continue
                seen.add(target)
                with_strings, stripped = strip_comments_and_strings(target.read_text(encoding="utf-8", errors="replace"))
                names |= _compile_time_names_in(stripped)
                pending.append((target.parent, with_strings))
        return names

    def check_threadgroup_arrays(self) -> None:
        code = self.code
        constants = None
        allowed_words = {"sizeof", "alignof", "int", "uint", "short", "ushort", "char", "uchar", "float", "half", "bfloat", "size_t", "long", "ulong", "unsigned"}
        for m in re.finditer(r"\bthreadgroup\b[^;(){}=]*?\b([A-Za-z_]\w*)\s*((?:\[[^\]]*\]\s*)+)(?=[;=])", code):
            if constants is None:
                constants = self._compile_time_names()
            for extent in re.findall(r"\[([^\]]*)\]", m.group(2)):
                if not extent.strip():
                    self.report(m.start(), "threadgroup-array", f"threadgroup array `{m.group(1)}` has no size (threadgroup arrays must have a fixed size)")
                    continue
                # Drop `ns::` qualifiers' namespaces and member accesses of compile-time types.
                words = re.findall(r"(?<![\w.])(?:[A-Za-z_]\w*\s*::\s*)*([A-Za-z_]\w*)", extent)
                unknown = [w for w in words if w not in constants and w not in allowed_words]
                if unknown:
                    self.report(m.start(), "threadgroup-array", f"threadgroup array `{m.group(1)}` has a size that is not a compile-time constant (`{extent.strip()}`)")


    # -- kernel signatures --------------------------------------------------------------------

    def check_kernels(self, functions: list[_Function]) -> None:
        code = self.code
        for f in functions:
            head = _blank_preprocessor(f.return_type)
            if not _KERNEL_MARK.search(head):
                continue
            ret = _KERNEL_MARK.sub(" ", re.sub(r"template\s*<.*>", " ", head, flags=re.S))
            ret = re.sub(r"\[\[.*?\]\]|\b(?:inline|static|METAL_FUNC)\b", " ", ret, flags=re.S).split()
            if ret != ["void"]:
                self.report(f.name_pos, "kernel-return", f"kernel `{f.name}` must return void (returns `{' '.join(ret)}`)")
            params = code[f.params_start + 1 : f.params_end - 1]
            offset = f.params_start + 1
            buffers: list[tuple[int, int]] = []
            for param in split_top_level(params):
                pos = offset + (len(param) - len(param.lstrip()))
                offset += len(param) + 1
                if not param.strip():
                    continue
                attrs = re.findall(r"\[\[(.*?)\]\]", param, flags=re.S)
                declared = " ".join(re.sub(r"\[\[.*?\]\]", " ", param, flags=re.S).split())
                names = [re.match(r"\s*(\w+)", a).group(1) for a in attrs if re.match(r"\s*(\w+)", a)]
                if "threadgroup" in names:
                    continue  # reported by the threadgroup-param rule
                bound = [a for a in attrs if re.match(r"\s*buffer\s*\(", a)]
                builtin = [n for n in names if n in _BUILTIN_INPUTS]
                unknown = [n for n in names if n not in _BUILTIN_INPUTS and n != "buffer"]
                if unknown:
                    self.report(pos, "kernel-param", f"parameter `{declared}` of kernel `{f.name}` has an unknown attribute `[[{unknown[0]}]]`")
                    continue
                if not bound and not builtin:
                    self.report(pos, "kernel-param", f"parameter `{declared}` of kernel `{f.name}` needs [[buffer(n)]] or a built-in input attribute")
                    continue
                if builtin:
                    self._check_builtin_type(pos, f.name, declared, builtin[0])
                    continue
                m = re.match(r"\s*buffer\s*\(\s*(\d+)\s*\)\s*$", bound[0])
                if m is None:
                    self.report(pos, "buffer-index", f"buffer index of `{declared}` in kernel `{f.name}` must be an integer literal")
                    continue
                buffers.append((int(m.group(1)), pos))
                self._check_buffer_type(pos, f.name, declared)
            self._check_buffer_indices(f, buffers)

    def _check_builtin_type(self, pos: int, kernel: str, declared: str, attr: str) -> None:
        type_words = re.sub(r"\b(?:const|metal\s*::)\b|metal::", " ", declared).split()[:-1]
        allowed = _POSITION_TYPES if attr in _POSITION_INPUTS else _INDEX_TYPES
        if len(type_words) != 1 or type_words[0] not in allowed:
            self.report(pos, "kernel-param", f"[[{attr}]] parameter `{declared}` of kernel `{kernel}` must be one of "
                                             f"{', '.join(sorted(allowed))}")

    def _check_buffer_type(self, pos: int, kernel: str, declared: str) -> None:
        m = re.match(r"^(.*?)([*&])\s*(?:const\s+)?\w+$", declared)
        if m is not None and not _ADDRESS_SPACE.search(m.group(1)):
            return  # the address-space rule reports it
        if m is None or not re.search(r"\b(?:device|constant)\b", m.group(1)):
            self.report(pos, "kernel-param", f"buffer parameter `{declared}` of kernel `{kernel}` must be a device or "
                                             "constant pointer or reference")
            return
        pointee = re.sub(r"\b(?:device|constant|const|volatile|metal\s*::)\b|metal::", " ", m.group(1)).split()
        if m.group(2) == "&" and pointee and pointee[-1] in _UNBINDABLE_SCALARS:
            self.report(pos, "kernel-param", f"scalar parameter `{declared}` of kernel `{kernel}`: `{pointee[-1]}` has no "
                                             "fixed host-side size that bnb_mps.kernel_args binds; use one of "
                                             f"{', '.join(_BINDABLE_SCALARS)}")

    def _check_buffer_indices(self, f: _Function, buffers: list[tuple[int, int]]) -> None:
        seen: dict[int, int] = {}
        for index, pos in buffers:
            if index > 30:
                self.report(pos, "buffer-index", f"[[buffer({index})]] in kernel `{f.name}`: Metal has buffer indices 0..30")
            elif index in seen:
                self.report(pos, "buffer-index", f"[[buffer({index})]] is used twice in kernel `{f.name}`")
            seen.setdefault(index, pos)
        expected = set(range(len(seen)))
        if buffers and set(seen) != expected and all(i <= 30 for i in seen):
            missing = sorted(expected - set(seen))
            self.report(f.name_pos, "buffer-index", f"buffer indices of kernel `{f.name}` must be 0..{len(seen) - 1} "
                                                    f"(executors bind launch argument i to [[buffer(i)]]); missing {missing}")

    # -- threadgroup variables ------------------------------------------------------------------

    def check_threadgroup_variables(self, functions: list[_Function]) -> None:
        code = self.code
        for m in re.finditer(r"\bthreadgroup\b", code):
            start = m.start()
            prev = code[:start].rstrip()
            if prev and prev[-1] not in ";{}" and not prev.endswith(":"):
                continue  # a qualifier inside a declaration, parameter or cast
            if prev.endswith("::"):
                continue
            end = code.find(";", m.end())
            if end < 0:
                continue
            body = code[m.end() : end]
            outside = re.sub(r"\[[^\]]*\]", "[]", body)
            if re.search(r"[()*&]", outside.split("=")[0]) or not body.strip():
                continue  # pointer, reference or function: not a threadgroup variable
            name = re.search(r"(\w+)\s*(?:\[[^\]]*\]\s*)*(?:=|\{|$)", outside.split("=")[0].split("{")[0].strip())
            label = f"`{name.group(1)}`" if name else "variable"
            enclosing = [f for f in functions if f.body_start < start < f.body_end]
            if not enclosing or not _KERNEL_MARK.search(_blank_preprocessor(enclosing[-1].return_type)):
                where = "at program scope" if not enclosing else f"in `{enclosing[-1].name}`, which is not a kernel"
                self.report(start, "threadgroup-scope", f"threadgroup variable {label} declared {where}: declare threadgroup "
                                                        "variables in the kernel's body and pass helpers a threadgroup pointer")
            if "=" in outside or re.search(r"\w\s*(?:\[[^\]]*\]\s*)*\{", outside):
                self.report(start, "threadgroup-init", f"threadgroup variable {label} has an initializer: Metal does not "
                                                       "initialize threadgroup memory (assign it after the declaration, then barrier)")

    # -- program scope ------------------------------------------------------------------------------

    def check_program_scope(self) -> None:
        """Variables declared outside functions and types must be in the constant address space."""
        code = _blank_preprocessor(self.code)
        for start, end in _top_level_statements(code):
            stmt = code[start:end]
            lead = len(stmt) - len(stmt.lstrip())
            text = _skip_macro_calls(stmt.strip())
            if not text or text.startswith("[["):
                text = re.sub(r"^(?:\[\[.*?\]\]\s*)+", "", text, flags=re.S)
            words = re.match(r"[A-Za-z_]\w*", text)
            if words is None or words.group(0) in _NOT_VARIABLE_STARTS or words.group(0) == "threadgroup":
                continue  # (threadgroup variables: the threadgroup-scope rule)
            decl = _before_initializer(text)
            if "(" in decl and not re.search(r"\[[^\]]*\(", decl):
                continue  # a function declaration
            name = re.search(r"([A-Za-z_]\w*)\s*(?:\[[^\]]*\]\s*)*(?:\{.*)?$", decl.strip(), flags=re.S)
            if name is None or name.group(1) in _NOT_VARIABLE_STARTS:
                continue
            if not re.search(r"\bconstant\b", decl):
                pos = start + lead + (stmt.strip().find(text[:20]) if text[:20] in stmt else 0)
                self.report(pos, "program-scope", f"program-scope variable `{name.group(1)}` must be declared in the "
                                                  "constant address space (e.g. `constant float table[4] = {...};`)")

    # -- C++ that Metal does not have ---------------------------------------------------------------

    def check_unsupported_cxx(self) -> None:
        code = self.code
        for m in re.finditer(r"\b(goto|new|delete|virtual|dynamic_cast|typeid|try|catch|throw|thread_local|register)\b", code):
            word = m.group(1)
            if word == "delete" and re.search(r"=\s*$", code[max(0, m.start() - 20) : m.start()]):
                continue  # a deleted function (`= delete`), not the operator
            self.report(m.start(), "unsupported-cxx", f"`{word}` is not supported by Metal")


    # -- the math library under fast math -------------------------------------------------------------

    def check_float_math(self) -> None:
        """Float math-library calls go through `metal::precise::`, so that fast math cannot change them."""
        code = self.code
        names = "|".join(sorted(FLOAT_MATH_FUNCTIONS | OVERLOADED_MATH_FUNCTIONS))
        for m in re.finditer(r"(?<![\w.])(%s)\s*\(" % names, code):
            name = m.group(1)
            before = code[max(0, m.start(1) - 80) : m.start(1)]
            if re.search(r"(?:->|\.)\s*$", before):
                continue  # a member function
            qualifier = re.search(r"(\w+)\s*::\s*$", before)
            if qualifier is not None and qualifier.group(1) == "precise":
                continue
            if qualifier is not None and qualifier.group(1) not in ("metal", "fast"):
                continue  # a function of another namespace
            if re.search(r"\b(?:inline|constexpr|void|float|half|int|uint|auto|T)\s+$", before):
                continue  # a declaration of a function of that name
            if name in OVERLOADED_MATH_FUNCTIONS:
                close = _match_bracket(code, m.end() - 1)
                if not _FLOAT_ARGUMENT.search(code[m.end() : close - 1]):
                    continue  # no visibly float argument: taken as the integer overload
            spelled = f"{qualifier.group(1)}::{name}" if qualifier is not None else name
            self.report(m.start(1), "float-math",
                        f"`{spelled}(...)` on floats follows the fast-math setting (PYTORCH_MPS_FAST_MATH selects the fast "
                        f"math functions); call `metal::precise::{name}`")  # fmt: skip


    # -- spellings of a later language version ---------------------------------------------------------

    def check_metal_version(self) -> None:
        """Metal 3.2's memory-model spellings (coherent(device), a fence's thread_scope_* argument) only
        where the preprocessor keeps them at __METAL_VERSION__ >= 320: the same source is compiled
        at 3.1 too (the offline metallib, macOS 14, torch's shader tier before 2.11), where the
        compiler rejects them, and with them the whole compile unit."""
        conditions: list[tuple[str, bool]] = []  # (condition, in its #else branch)
        pos = 0
        for line in self.code.splitlines(keepends=True):
            directive = re.match(r"[ \t]*#[ \t]*(if|ifdef|ifndef|elif|else|endif)\b(.*)", line)
            if directive:
                word, rest = directive.group(1), directive.group(2).strip()
                if word in ("if", "ifdef", "ifndef"):
                    conditions.append((rest if word == "if" else "", False))
                elif word == "elif" and conditions:
                    conditions[-1] = (rest, False)
                elif word == "else" and conditions:
                    conditions[-1] = (conditions[-1][0], True)
                elif word == "endif" and conditions:
                    conditions.pop()
            else:
                guarded = any(not negated and _at_least_320(cond) for cond, negated in conditions)
                if not guarded:
                    for m in _METAL_3_2_SPELLINGS.finditer(line):
                        self.report(pos + m.start(), "metal-version",
                                    f"`{m.group(0).strip()}` is Metal 3.2; keep it under `#if __METAL_VERSION__ >= 320` "
                                    "(the unit is also compiled at 3.1, where it fails to compile)")  # fmt: skip
            pos += len(line)


_METAL_3_2_SPELLINGS = re.compile(r"\bcoherent\s*\(|\bthread_scope_\w+")


def _at_least_320(condition: str) -> bool:
    """Whether an #if condition holds only at __METAL_VERSION__ >= 320 (a conjunct `__METAL_VERSION__
    >= n` or `> n` with n at least 320, or 319 for `>`)."""
    if "||" in condition:
        return False
    for m in re.finditer(r"__METAL_VERSION__\s*(>=|>)\s*(\d+)", condition):
        if int(m.group(2)) + (1 if m.group(1) == ">" else 0) >= 320:
            return True
    return False


def _compile_time_names_in(code: str) -> set[str]:
    """Names usable in constant expressions: #defines, constexpr/constant variables, enumerators,
    non-type template parameters."""
    names: set[str] = set()
    names.update(re.findall(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)", code, re.M))
    names.update(re.findall(r"\b(?:constexpr|constant)\b[^;=()]*?\b([A-Za-z_]\w*)\s*(?:=|\{)", code))
    for body in re.findall(r"\benum\b[^{;]*\{([^}]*)\}", code):
        names.update(re.findall(r"([A-Za-z_]\w*)\s*(?:=[^,]*)?(?:,|$)", body))
    for m in re.finditer(r"\btemplate\s*<", code):
        end = m.end()
        depth = 1
        while end < len(code) and depth:
            depth += {"<": 1, ">": -1}.get(code[end], 0)
            end += 1
        for param in split_top_level(code[m.end() : end - 1]):
            words = re.findall(r"[A-Za-z_]\w*", split_top_level(param, "=")[0])
            if len(words) >= 2 and words[0] not in ("typename", "class"):
                names.add(words[-1])
    return names


def lint_source(text: str, path: str = "<string>") -> list[Finding]:
    """All findings for one MSL source text."""
    return _Linter(text, path).run()


def _default_dir() -> Path:
    from .source import kernel_dir

    return kernel_dir()


def lint_paths(paths: list[Path]) -> list[Finding]:
    """Every file's findings, and for each `.metal` file (a compile unit, its local headers inlined as
    the tiers inline them) the rule `fp-contract`: no-contraction pinned before the unit's first code."""
    findings: list[Finding] = []
    for path in paths:
        files = sorted(p for p in path.rglob("*") if p.suffix in (".metal", ".h")) if path.is_dir() else [path]
        for f in files:
            findings.extend(lint_source(f.read_text(encoding="utf-8", errors="replace"), str(f)))
            if f.suffix == ".metal":
                findings.extend(_unit_findings(f))
    return findings


def _unit_findings(path: Path) -> list[Finding]:
    from .math_mode import unit_finding
    from .source import unit_text

    try:
        text = unit_text(path, line_directives=False)
    except (OSError, ValueError):
        return []  # (a missing local header or non-ASCII text: the include and non-ascii rules say so)
    found = unit_finding(text)
    return [] if found is None else [Finding(str(path), 1, "fp-contract", found[1])]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print(__doc__.strip())
        return 0
    paths = [Path(a) for a in args] or [_default_dir()]
    missing = [p for p in paths if not p.exists()]
    if missing:
        print(f"msl_lint: no such file or directory: {', '.join(map(str, missing))}", file=sys.stderr)
        return 2
    findings = lint_paths(paths)
    for f in findings:
        print(f)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
