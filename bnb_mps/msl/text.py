"""Small text utilities for Metal Shading Language source, shared by the MSL lint and the
emulator's pre-pass. Everything preserves offsets and line numbers of the input."""

from __future__ import annotations


def strip_comments_and_strings(text: str) -> tuple[str, str]:
    """Returns (code without comments, code without comments and string/char literal contents).

    Removed characters become spaces and newlines are kept, so offsets and line numbers of the
    result are those of the input. String delimiters are kept (`""`) so a literal stays a token.
    """
    no_comments: list[str] = []
    no_strings: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        nxt = text[i + 1] if i + 1 < n else ""
        if c == "/" and nxt == "/":
            j = text.find("\n", i)
            j = n if j < 0 else j
            blank = " " * (j - i)
            no_comments.append(blank)
            no_strings.append(blank)
            i = j
        elif c == "/" and nxt == "*":
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            blank = "".join(ch if ch == "\n" else " " for ch in text[i:j])
            no_comments.append(blank)
            no_strings.append(blank)
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            literal = text[i:j]
            no_comments.append(literal)
            inner = "".join(ch if ch == "\n" else " " for ch in literal[1:-1])
            no_strings.append(c + inner + (literal[-1] if len(literal) > 1 else ""))
            i = j
        else:
            no_comments.append(c)
            no_strings.append(c)
            i += 1
    return "".join(no_comments), "".join(no_strings)


def strip_comments(text: str) -> str:
    """Comments -> spaces (newlines kept); string and character literals untouched."""
    return strip_comments_and_strings(text)[0]


def split_top_level(text: str, sep: str = ",") -> list[str]:
    """Splits at `sep` outside (), [], {} and <> nesting."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth = max(0, depth - 1)
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def brace_depths(text: str) -> list[int]:
    """Brace depth at every position (an opening brace counts at its own position, a closing one
    after it); comments should be stripped first."""
    depths, d = [], 0
    for ch in text:
        if ch == "{":
            d += 1
        depths.append(d)
        if ch == "}":
            d -= 1
    return depths
