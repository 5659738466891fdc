"""A lint for the project's Metal kernels: what compiles as C++ but is not valid (or not allowed) MSL.

The emulator compiles `csrc/kernels/*.metal` as C++, so constructs that Metal rejects (`double`,
`std::`, libc calls, lambdas, recursion, pointers without an address space) would pass CI and
only fail on a Mac. This module catches them statically, together with what the project's rules
forbid so that kernels stay emulator- and `compile_shader`-friendly (`[[threadgroup(n)]]`
parameters, function constants, non-constant-size threadgroup arrays, non-metal includes,
non-ASCII text).

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

# Words that can precede `(` without being a function name.
_NOT_FUNCTIONS = frozenset(
    "if for while switch return sizeof alignof decltype catch static_assert case do else "
    "static_cast reinterpret_cast const_cast dynamic_cast as_type operator new delete throw "
    "defined".split()
)
# Words that can start a statement without being a type.
_NOT_TYPES = frozenset("return else do case goto throw delete new typedef using sizeof".split())


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
    findings: list[Finding] = []
    for path in paths:
        files = sorted(p for p in path.rglob("*") if p.suffix in (".metal", ".h")) if path.is_dir() else [path]
        for f in files:
            findings.extend(lint_source(f.read_text(encoding="utf-8", errors="replace"), str(f)))
    return findings


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
