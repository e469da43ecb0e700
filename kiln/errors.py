"""What every layer says of a library's exception: its first line, the rest (tracebacks of C++
loggers, rendered chats, schema dumps) being noise in a one-line error."""

from __future__ import annotations


def first_line(exc: BaseException) -> str:
    """The first non-empty line of ``str(exc)``, or the exception's class name when it has none."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
