"""Progress bars for the slow parts of start-up: GGUF conversion, weight loading, compilation.

Rules kept here:
- A bar draws only when stderr is a terminal (tqdm's ``disable=None``): logs, pipes, tests and CI
  get nothing from it, so anything a user must know also goes to the log as one line.
- Under a process group only rank 0 draws: the ranks share one terminal.
- Bars are for start-up work, never for a step: creating and updating one costs microseconds per
  tensor or Inductor build, and a disabled bar does nothing at all.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Optional

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm


def progress_bar(iterable: Optional[Iterable] = None, *, desc: str, total: Optional[int] = None,
                 unit: str = "it", bar_format: Optional[str] = None) -> tqdm:
    """A tqdm bar over ``iterable`` (or updated by hand), quiet off a terminal and off rank 0."""
    return tqdm(iterable, desc=desc, total=total, unit=unit, bar_format=bar_format,
                disable=True if _off_rank_zero() else None, dynamic_ncols=True)


@contextlib.contextmanager
def logs_above(bar: tqdm) -> Iterator[None]:
    """While ``bar`` is drawn, console log lines are printed above it rather than through it."""
    if bar.disable:
        yield
        return
    with logging_redirect_tqdm():
        yield


def _off_rank_zero() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_rank() != 0
