"""``DebugDump``: what ``compile.debug_dump_dir`` writes, as readable Python.

Layout under the directory::

    depyf/                      decompiled Dynamo bytecode (only with depyf: pip install 'kiln[debug]')
    dynamo_graph.py             the captured graph, after the dynamo-stage passes
    split_graph.py              the split graph, then every piece's code
    passes/<graph>/NN_<Pass>_before.py, NN_<Pass>_after.py

While dumping, Inductor's caches are bypassed (``inductor_config_patches``): a cache hit would
skip the passes, and their before/after would be missing.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

import torch

logger = logging.getLogger(__name__)


class DebugDump:
    def __init__(self, root: str) -> None:
        self.root = root
        self._counts: dict[str, int] = {}
        os.makedirs(root, exist_ok=True)

    def write(self, relpath: str, text: str) -> None:
        path = os.path.join(self.root, relpath)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)

    def pass_graph(self, label: str, pass_name: str, when: str, code: str) -> None:
        """The ``PassManager`` dump hook: one file per pass and side."""
        if when == "before":
            self._counts[label] = self._counts.get(label, 0) + 1
        n = self._counts.get(label, 0)
        self.write(f"passes/{label}/{n:02d}_{pass_name}_{when}.py", code)

    def split(self, split_gm: torch.fx.GraphModule, piece_labels: dict[str, str]) -> None:
        parts = ["# split graph\n", split_gm.code]
        for name, module in split_gm.named_children():
            parts.append(f"\n\n# ---- {name} ({piece_labels.get(name, 'attention, run eagerly')})\n")
            parts.append(module.code)
        self.write("split_graph.py", "".join(parts))

    @contextlib.contextmanager
    def depyf(self) -> Iterator[None]:
        try:
            import depyf
        except ImportError:
            logger.warning("compile.debug_dump_dir: depyf is not installed, so %s has no decompiled bytecode "
                           "(depyf/); pip install 'kiln[debug]' for it", self.root)
            yield
            return
        try:
            ctx = depyf.prepare_debug(os.path.join(self.root, "depyf"))
            ctx.__enter__()
        except Exception as e:  # noqa: BLE001  (a debugging aid must never break compilation)
            logger.warning("depyf could not start (%s); skipping decompiled bytecode", e)
            yield
            return
        try:
            yield
        finally:
            try:
                ctx.__exit__(None, None, None)
            except Exception as e:  # noqa: BLE001
                logger.warning("depyf could not finish writing (%s)", e)

    @staticmethod
    def inductor_config_patches() -> dict:
        return {"force_disable_caches": True}
