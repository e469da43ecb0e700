"""Start-up time counted from the process's own start, so a ready line can account for every second.

``process_age_s`` reads the kernel's start time of this process (Linux ``/proc``); elsewhere it
counts from the first ``import kiln`` (``KILN_IMPORTED``), and the interpreter's own start is then
not seen.
"""

from __future__ import annotations

import os
import time

KILN_IMPORTED = time.perf_counter()  # kiln/__init__.py imports this module first
_AGE_AT_IMPORT = None


def process_age_s(pid: str | int = "self") -> float:
    """Seconds since this process (or process ``pid``) started (10 ms resolution on Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
        start_ticks = int(after_name[19])  # field 22, starttime: clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - KILN_IMPORTED


def age_at_kiln_import() -> float:
    """``process_age_s`` as of the first ``import kiln``: the interpreter's start and what ran before."""
    global _AGE_AT_IMPORT
    if _AGE_AT_IMPORT is None:
        _AGE_AT_IMPORT = max(0.0, process_age_s() - (time.perf_counter() - KILN_IMPORTED))
    return _AGE_AT_IMPORT
