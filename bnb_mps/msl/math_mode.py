"""Whether a compile unit pins no-contraction before its first line of code, as the Metal compiler sees it.

`csrc/kernels/bnb_math_mode.h` holds `#pragma clang fp contract(off)` at file scope, outside any
`#if`, and every `.metal` file includes it first, before <metal_stdlib>, so that no function of the
unit (the kernels, and the standard library's inline functions they use) is compiled with `a*b + c`
contracted into a fused multiply-add, at every Metal language version (bnb_math_mode.h says why).

Two ways to check that, both on a unit as the tiers hand it to Metal (`bnb_mps.msl.source.unit_text`):
- `unit_finding(text)`: textually (the MSL lint's rule `fp-contract`, no tools needed): the pragma
  stands at `#if` depth 0 before the first line that is not a comment, blank or preprocessor line,
  and again right after each system header (whose own pragmas would otherwise hold for the kernels);
- `preprocess(text, version)` then `preprocessed_finding(out)`: the machine's C preprocessor
  evaluates the unit's conditionals as a Metal compiler of that language version would
  (`__METAL_VERSION__` 310, 320, 400), each system header (<metal_stdlib>) standing for the code it
  brings as a line of its own; the pragma must come before the first line of code, and again
  after each system header.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Optional

from .text import strip_comments

CONTRACT_PRAGMA = "#pragma clang fp contract(off)"
_PRAGMA = re.compile(r"^\s*#\s*pragma\s+clang\s+fp\s+contract\s*\(\s*off\s*\)\s*$")
_SYSTEM_INCLUDE = re.compile(r"^\s*#\s*include\s*<([^>]+)>\s*$", re.M)
#: what `preprocess` puts in place of a system header
SYSTEM_HEADER_MARK = "__bnb_system_header__"
_MARKED = re.compile(rf"^\s*{SYSTEM_HEADER_MARK} ([^;]+);\s*$")
#: the Metal language versions the tiers compile at: 3.1, 3.2, 4.0 (as __METAL_VERSION__)
LANGUAGE_VERSIONS = (310, 320, 400)


def _first_code_line(lines: list[str]) -> int:
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            return i
    return len(lines)


def unit_finding(text: str) -> Optional[tuple[int, str]]:
    """(line index, message) when the unit's text lacks the contraction pragma at `#if` depth 0
    before its first line of code or its first system header, or right after a system header (before
    the next code); None when it has it in every place."""
    lines = strip_comments(text).splitlines()
    first = next((i for i, line in enumerate(lines)
                  if line.strip() and (not line.strip().startswith("#") or _SYSTEM_INCLUDE.match(line))),
                 len(lines))  # fmt: skip
    if not _pinned_before(lines, 0, first):
        return (min(first, max(len(lines) - 1, 0)),
                f"no `{CONTRACT_PRAGMA}` at file scope before the unit's first code or system header: include "
                "\"bnb_math_mode.h\" first (the same bits at every Metal language version)")  # fmt: skip
    return _repeated_after_system_headers(lines)


def _pinned_before(lines: list[str], start: int, stop: int) -> bool:
    """Whether the contraction pragma stands at `#if` depth 0 among lines[start:stop]."""
    depth = 0
    for line in lines[start:stop]:
        directive = re.match(r"\s*#\s*(\w+)", line)
        word = directive.group(1) if directive else ""
        if word in ("if", "ifdef", "ifndef"):
            depth += 1
        elif word == "endif":
            depth -= 1
        elif depth == 0 and _PRAGMA.match(line):
            return True
    return False


def _first_inclusions(lines: list[str], pattern: re.Pattern) -> list[int]:
    """The lines that include a system header for the first time in the unit: a header included
    again brings nothing (its include guard), so it cannot change the pragmas either."""
    seen, out = set(), []
    for i, line in enumerate(lines):
        m = pattern.match(line)
        if m and m.group(1) not in seen:
            seen.add(m.group(1))
            out.append(i)
    return out


def _repeated_after_system_headers(lines: list[str]) -> Optional[tuple[int, str]]:
    """(line index, message) for the first system header not followed by the contraction pragma at
    `#if` depth 0 before the next line of code (after the last of consecutive system headers); None
    when every one is."""
    headers = _first_inclusions(lines, _SYSTEM_INCLUDE)
    for n, at in enumerate(headers):
        code = next((j for j in range(at + 1, len(lines))
                     if lines[j].strip() and not lines[j].strip().startswith("#")), len(lines))  # fmt: skip
        if n + 1 < len(headers) and headers[n + 1] < code:
            continue  # (the next header's check covers this one)
        if not _pinned_before(lines, at + 1, code):
            name = _SYSTEM_INCLUDE.match(lines[at]).group(1)
            return (at, f"no `{CONTRACT_PRAGMA}` at file scope right after <{name}>, before the next code: a "
                        "pragma of the header's own would hold for the kernels (repeat the pragmas there, as "
                        "bnb_common.h does)")  # fmt: skip
    return None


def find_preprocessor() -> Optional[str]:
    for name in ("c++", "g++", "clang++", "clang", "gcc", "cc"):
        path = shutil.which(name)
        if path:
            return path
    return None


class PreprocessorUnavailable(RuntimeError):
    """No C preprocessor on this machine."""


def preprocess(text: str, metal_version: int, compiler: Optional[str] = None) -> str:
    """`text` preprocessed as a Metal compiler of language version `metal_version` (310, 320, 400)
    sees it, by this machine's C preprocessor; each system header (<metal_stdlib>, ...) becomes the
    line `__bnb_system_header__ <name>;`, which stands for the code it brings."""
    compiler = compiler or find_preprocessor()
    if compiler is None:
        raise PreprocessorUnavailable("no C/C++ compiler to preprocess with (tried c++, g++, clang++, clang, gcc, cc)")
    marked = _SYSTEM_INCLUDE.sub(lambda m: f"{SYSTEM_HEADER_MARK} {m.group(1)};", text)
    command = [compiler, "-E", "-P", "-x", "c++", "-undef", "-nostdinc", f"-D__METAL_VERSION__={metal_version}",
               "-D__METAL__=1", "-"]  # fmt: skip
    done = subprocess.run(command, input=marked, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[:2000]}")
    return done.stdout


def preprocessed_finding(preprocessed: str) -> Optional[str]:
    """None when the contraction pragma comes before the first line of code of a preprocessed unit,
    and again after each system header (`__bnb_system_header__` line) before the next code."""
    lines = preprocessed.splitlines()
    first = _first_code_line(lines)
    if not any(_PRAGMA.match(line) for line in lines[:first]):
        code = lines[first].strip() if first < len(lines) else "(end of unit)"
        return f"`{CONTRACT_PRAGMA}` does not come before the first code of the unit ({code[:80]!r})"
    for at in _first_inclusions(lines, _MARKED):
        after = lines[at + 1 :]
        code = _first_code_line(after)
        if code < len(after) and _MARKED.match(after[code]):
            continue  # (consecutive system headers: the last one's check covers them)
        if not any(_PRAGMA.match(x) for x in after[:code]):
            return f"`{CONTRACT_PRAGMA}` does not come again right after {lines[at].strip()[:80]!r}"
    return None
