"""The C++ sources build every multi-part error message with ``kiln::message`` (``csrc/error.h``).

``TORCH_CHECK(cond, a, b, ...)`` formats its parts through a ``std::ostringstream`` compiled into
``kiln._C``, and on some toolchains any ``std::ostringstream`` there crashes the process: a bad
input would kill the server instead of raising. This reads ``csrc/`` (no build needed) and fails
on a check with more than one message part, or on any use of ``std::ostream``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h"))


def call_arguments(text: str, start: int) -> list[str]:
    """The top-level arguments of the call whose '(' is at ``start - 1``."""
    args, depth, current, i, in_string = [], 1, "", start, False
    while True:
        c = text[i]
        if in_string:
            current += c
            if c == "\\":
                current += text[i + 1]
                i += 1
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string, current = True, current + c
        elif c in "([{":
            depth, current = depth + 1, current + c
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return [*args, current.strip()]
            current += c
        elif c == "," and depth == 1:
            args, current = [*args, current.strip()], ""
        else:
            current += c
        i += 1


def multi_part_checks(text: str) -> list[str]:
    found = []
    for m in re.finditer(r"\bTORCH_CHECK\(", text):
        args = call_arguments(text, m.end())
        if len(args) > 2:  # the condition, then more than one message part
            found.append(f"line {text[:m.start()].count(chr(10)) + 1}: {' '.join(args[1:])[:80]}")
    return found


def test_the_scanner_sees_multi_part_messages():
    text = 'TORCH_CHECK(a < f(b, c), "x ", a);\nTORCH_CHECK(ok, kiln::message("y ", b, ")"));\nTORCH_CHECK(ok, "z");'
    assert multi_part_checks(text) == ['line 1: "x " a']


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_error_messages_are_built_without_ostream(path):
    code = "\n".join(line.split("//")[0] for line in path.read_text().splitlines())  # not the comments
    assert multi_part_checks(code) == [], f"{path.name}: wrap the message parts in kiln::message(...)"
    assert not re.search(r"\bstd::(o|i)?stringstream\b|\bstd::ostream\b|\bc10::str\(|\bstd::c(out|err)\b", code), \
        f"{path.name} uses std::ostream; build strings with kiln::message (csrc/error.h)"
