"""The line-preserving pre-pass that turns MSL text into C++ for the emulator.

It rewrites only what macros cannot:
- `threadgroup T name[N];` inside a kernel -> `BNB_EMU_THREADGROUP(name, [N], T);`, one array
  shared by the threadgroup (allocated by the first thread that arrives, filled with poison);
- `1.5h` half literals -> `((half)(1.5))`;
- Metal-syntax explicit instantiations `template [[host_name("x")]] [[kernel]] ... f<T>(...);`
  -> removed, and registered under "x";
and appends a registration for every plain kernel. Comments become blanks. No line is added or
removed before the end of the text, so compiler errors and fault reports name the `.metal` line;
a `#line 1 "<name>"` comes first unless the text starts with its own `#line`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..msl.text import brace_depths, split_top_level, strip_comments


class PrepassError(ValueError):
    """The source uses a construct the emulator cannot translate; the message names the line."""


@dataclass
class Translation:
    cpp: str
    kernels: list[str] = field(default_factory=list)  # plain kernels, in source order
    instances: list[str] = field(default_factory=list)  # host names of template instantiations


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


_HALF_LITERAL = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)[hH](?![\w.])")


def _rewrite_half_literals(text: str) -> str:
    def repl(m: re.Match) -> str:
        num = m.group(1)
        if "." not in num and "e" not in num.lower():
            num += ".0"
        return f"((half)({num}))"

    return _HALF_LITERAL.sub(repl, text)


_DECLARATOR = re.compile(r"^\s*(?P<type>.*?)\s*\b(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\]]*\]\s*)*)$", re.S)
_NAME_DIMS = re.compile(r"^\s*(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\]]*\]\s*)*)$", re.S)
_THREADGROUP = re.compile(r"\bthreadgroup\b")


def _rewrite_threadgroup_decls(text: str, name: str) -> str:
    depth = None
    out: list[str] = []
    last = 0
    for m in _THREADGROUP.finditer(text):
        start = m.start()
        if start < last:
            continue
        end = text.find(";", m.end())
        if end < 0:
            continue
        body = text[m.end() : end]
        # An address-space qualifier (pointer, reference, parameter), not a declaration. Array
        # bounds may hold any constant expression: look outside the brackets only.
        outside = re.sub(r"\[[^\]]*\]", "[]", body)
        if any(ch in outside for ch in "()*&={}") or not body.strip():
            continue
        prev = text[:start].rstrip()
        if prev and prev[-1] not in ";{}" and not prev.endswith(":"):
            continue
        if depth is None:
            depth = brace_depths(text)
        line = _line_of(text, start)
        if depth[start] == 0:
            raise PrepassError(f"{name}:{line}: threadgroup variables must be declared inside a kernel")
        parts = split_top_level(body)
        first = _DECLARATOR.match(parts[0])
        if not first or not first.group("type"):
            raise PrepassError(f"{name}:{line}: cannot parse the threadgroup declaration {body.strip()!r}")
        ctype = " ".join(first.group("type").split())
        decls = [(first.group("name"), first.group("dims"))]
        for p in parts[1:]:
            m2 = _NAME_DIMS.match(p)
            if not m2:
                raise PrepassError(f"{name}:{line}: cannot parse the threadgroup declaration {body.strip()!r}")
            decls.append((m2.group("name"), m2.group("dims")))
        stmt = "; ".join(f"BNB_EMU_THREADGROUP({n}, {''.join(d.split())}, {ctype})" for n, d in decls)
        out.append(text[last:start])
        out.append(stmt + ";" + "\n" * text.count("\n", start, end))
        last = end + 1
    out.append(text[last:])
    return "".join(out)


_KERNEL = re.compile(r"(?:\bkernel\b|\[\[\s*kernel\s*\]\])\s*(?:\[\[[^\]]*\]\]\s*)*void\s+([A-Za-z_]\w*)\s*\(")
_INSTANCE = re.compile(r"\btemplate\s*\[\[\s*host_name\s*\(\s*\"([^\"]+)\"\s*\)\s*\]\]")


def _statement_start(text: str, pos: int) -> int:
    i = max(text.rfind(";", 0, pos), text.rfind("}", 0, pos), text.rfind("{", 0, pos))
    return i + 1


def _balanced_angle(text: str, pos: int) -> int:
    """Index just past the `>` matching the `<` at text[pos]."""
    depth = 0
    for i in range(pos, len(text)):
        if text[i] == "<":
            depth += 1
        elif text[i] == ">":
            depth -= 1
            if depth == 0:
                return i + 1
    return -1


def _rewrite_instances(text: str, name: str, instances: list[tuple[str, str]]) -> str:
    out, last = [], 0
    for m in _INSTANCE.finditer(text):
        if m.start() < last:
            continue
        end = text.find(";", m.end())
        line = _line_of(text, m.start())
        stmt = text[m.end() : end] if end >= 0 else ""
        # The instantiated function: the last `name<...>` before the parameter list.
        fm = None
        for cand in re.finditer(r"([A-Za-z_][\w:]*)\s*<", stmt):
            close = _balanced_angle(stmt, cand.end() - 1)
            if close > 0 and re.match(r"\s*(\(|;|$)", stmt[close:]):
                fm = (cand.group(1), stmt[cand.end() - 1 : close])
        if end < 0 or fm is None:
            raise PrepassError(f"{name}:{line}: cannot parse the explicit kernel instantiation")
        instances.append((m.group(1), fm[0] + fm[1]))
        out.append(text[last : m.start()])
        out.append("\n" * text.count("\n", m.start(), end))
        last = end + 1
    out.append(text[last:])
    return "".join(out)


def translate(source: str, name: str = "kernel.metal") -> Translation:
    """MSL text -> C++ text for the emulator (same line numbers)."""
    text = strip_comments(source)
    kernels: list[str] = []
    for m in _KERNEL.finditer(text):
        head = text[_statement_start(text, m.start()) : m.start()]
        if re.search(r"\btemplate\b", head):
            continue  # template kernels are registered by their instantiations
        kernels.append(m.group(1))
    instances: list[tuple[str, str]] = []
    text = _rewrite_instances(text, name, instances)
    text = _rewrite_threadgroup_decls(text, name)
    text = _rewrite_half_literals(text)
    if not text.lstrip().startswith("#line"):
        text = f'#line 1 "{name}"\n' + text
    tail = ["", '#line 1 "<emulator registrations>"']
    for k in dict.fromkeys(kernels):
        tail.append(f"BNB_EMU_REGISTER_KERNEL({k})")
    for host, call in instances:
        tail.append(f'BNB_EMU_REGISTER_INSTANCE("{host}", {call})')
    return Translation(text + "\n" + "\n".join(tail) + "\n", list(dict.fromkeys(kernels)), [h for h, _ in instances])
