"""Triton kernels on the CPU: a test file's kernel tests rerun in a child pytest under Triton's
interpreter (``TRITON_INTERPRET=1`` is read when ``triton`` is imported, so it cannot be set in the
running session)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.paths import REPO


def run_in_triton_interpreter(test_file: str, select: str, timeout: float = 600) -> str:
    """Run ``test_file``'s tests matching ``-k select`` in a child pytest whose environment has
    TRITON_INTERPRET=1 (the flag is read at import), asserting they ran and passed; its stdout."""
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", test_file, "-q", "-m", "not gpu", "-p", "no:cacheprovider", "-k", select]
    child = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert child.returncode == 0, child.stdout[-20000:] + child.stderr[-5000:]
    assert " passed" in child.stdout
    return child.stdout
