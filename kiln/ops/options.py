"""The process's kernel options: the ``KernelConfig`` (``kernels.*``) that kiln's ops read.

Some of these switches are read deep inside an op at launch time (PDL, the decode merge, the K/V
store join, the FP8 register cap, the dense GEMV), in whatever process runs the model, so they
live here, one value per process, rather than in every call's arguments.

Rules kept here:
- Whoever builds a model runner from an engine's config sets the options first
  (``set_kernel_options``): the one-process executor in the engine's process, each ``mp`` worker
  and Ray actor in its own, so every rank of an engine runs the same kernels. Two engines in one
  process share one value: the last one built sets it.
- What changes a compiled graph (the GEMV joins, the rotary join) is read when the KernelSet is
  chosen and travels in ``KernelSet.options``, which the passes and the artifact cache key read;
  only what changes a launch is read from ``current()`` at launch.
- Tests and benchmarks change the options for a scope: ``with kernel_options(pdl="off"): ...``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional

from kiln.config import KernelConfig

_current = KernelConfig()


def current() -> KernelConfig:
    """The options this process runs its kernels with."""
    return _current


def set_kernel_options(options: KernelConfig) -> None:
    """Run this process's kernels with ``options`` from now on (before a model runner is built)."""
    global _current
    if not isinstance(options, KernelConfig):
        raise TypeError(f"kernel options must be a KernelConfig, got {type(options).__name__}")
    _current = options


@contextlib.contextmanager
def kernel_options(options: Optional[KernelConfig] = None, **fields: Any) -> Iterator[KernelConfig]:
    """``options`` (else the current ones) with ``fields`` replaced, for the scope; then the options
    from before. A bad value is the config's ValueError, raised on entry."""
    global _current
    before = _current
    chosen = dataclasses.replace(options if options is not None else before, **fields)
    set_kernel_options(chosen)
    try:
        yield chosen
    finally:
        _current = before
