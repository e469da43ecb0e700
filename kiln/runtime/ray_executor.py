"""RayExecutor: tensor-parallel ranks as Ray actors (for multi-host serving).

Not available in this build: the ``ray`` package is not a dependency of kiln. On one host,
``parallel.backend=mp`` runs the same ranks as local processes with the same worker protocol
(``kiln.runtime.worker``). This module only turns a request for Ray into a clear error.
"""

from __future__ import annotations

from typing import Optional

from kiln.config import CacheConfig, CompileConfig, ModelConfig, ParallelConfig, SchedulerConfig


def make_ray_executor(model: ModelConfig, cache: CacheConfig, compile: CompileConfig, parallel: ParallelConfig,
                      scheduler: Optional[SchedulerConfig] = None):
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ValueError("parallel.backend=ray needs the package 'ray' (pip install 'ray[default]'), which is "
                         "not installed; on one host use parallel.backend=mp") from None
    raise ValueError("parallel.backend=ray is not implemented yet (ray is installed, but kiln has no Ray "
                     "workers); on one host use parallel.backend=mp")
