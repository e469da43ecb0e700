"""torch's intra-op threads for a block of code (an xdist worker runs on its share of the cores)."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def torch_threads(n: int):
    """Run the block on ``n`` torch (and OpenMP) threads, then restore the caller's count."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
