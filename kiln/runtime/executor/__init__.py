"""Executors: the boundary between the engine core and the model runner(s).

    base.py     the ``Executor`` contract; the failure rules of the multi-rank executors
    uniproc.py  ``uni``: one runner in this process
    mp.py       ``mp``: one runner shard per rank, each in a local process
    ray.py      ``ray``: one runner shard per rank, each in a Ray actor (the optional package ``ray``)

``make_executor`` picks one by ``parallel.backend``; Ray is imported only when it is asked for.
Every executor sets the kernel options (``kernels.*``, ``kiln.ops.options``) in each process that
builds a model runner, before building it.
"""

from __future__ import annotations

from typing import Optional

from kiln.config import (CacheConfig, CompileConfig, KernelConfig, LoraConfig, ModelConfig, ParallelConfig,
                         SchedulerConfig, SpeculativeConfig)
from kiln.runtime.executor.base import Executor
from kiln.runtime.executor.mp import MultiprocExecutor
from kiln.runtime.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "MultiprocExecutor", "UniProcExecutor", "make_executor"]


def make_executor(model: ModelConfig, cache: CacheConfig, compile: CompileConfig, parallel: ParallelConfig,
                  scheduler: Optional[SchedulerConfig] = None,
                  speculative: SpeculativeConfig = SpeculativeConfig(), lora: LoraConfig = LoraConfig(),
                  kernels: KernelConfig = KernelConfig()) -> Executor:
    if lora.enabled and parallel.backend == "ray":
        raise ValueError("LoRA adapters are served with parallel.backend=uni or mp for now, not ray")
    if parallel.backend == "mp":
        return MultiprocExecutor(model, cache, compile, parallel, scheduler, lora=lora, kernels=kernels)
    if parallel.backend == "ray":
        from kiln.runtime.executor.ray import make_ray_executor  # Ray stays optional

        return make_ray_executor(model, cache, compile, parallel, scheduler, kernels)
    if parallel.tensor_parallel_size != 1:
        raise ValueError(
            f"parallel.backend=uni runs one process; tensor_parallel_size={parallel.tensor_parallel_size} "
            "needs parallel.backend=mp (or ray)"
        )
    return UniProcExecutor(model, cache, compile, scheduler, speculative, lora, kernels)
