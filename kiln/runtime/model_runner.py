"""ModelRunner: owns the model, its KV cache tensors and the sampler on one device.

One step is ``launch(SchedulerOutput) -> LaunchedStep`` then ``collect(LaunchedStep) -> RunnerOutput``
(``execute`` does both): launch enqueues the device work, collect waits for the sampled tokens, so
on a GPU the engine can process the previous step's outputs in between. It never decides what runs
(the scheduler's job) and never touches graphs or kernels (the ``CompiledModel``'s): a step is
``InputBatch.prepare`` (the step written into the compiled model's persistent buffers), then
``CompiledModel.run`` (graph dispatch, padding, forward context), then logits for the rows that
sample, then the sampler.

Start-up is a list of phases (``__init__``): choose the device and its ``KernelSet``; load the
weights; build the ``CompiledModel`` (compile, or load compiled artifacts); on CUDA profile the
largest step's activations; size and allocate the KV cache (``kiln.runtime.kv_sizing``); capture
CUDA graphs over it; make the sampler. Each phase's time lands in ``startup_seconds``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from kiln.compiler import ArtifactCache, CompiledModel, InputLimits
from kiln.config import CacheConfig, CompileConfig, ModelConfig, SchedulerConfig, resolve_for_device
from kiln.models.loader import LoadedModel, load_model, resolve_device, resolve_dtype
from kiln.models.parallel import SINGLE, TensorParallel, local_num_kv_heads, min_over_ranks
from kiln.ops.registry import select_kernels
from kiln.runtime import kv_sizing
from kiln.runtime.input_batch import InputBatch
from kiln.runtime.kv_sizing import KVShape
from kiln.runtime.sampler import SampledTokens, Sampler, host_to_device
from kiln.runtime.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class RunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, Optional[dict[int, float]]] = field(default_factory=dict)


@dataclass
class LaunchedStep:
    """A step whose device work is enqueued; ``ModelRunner.collect`` turns it into a RunnerOutput."""

    request_ids: list[str] = field(default_factory=list)  # one per sampled row, in row order
    samples: Optional[SampledTokens] = None  # None: nothing sampled here (no row, or rank > 0)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, compile_config: CompileConfig,
                 scheduler_config: Optional[SchedulerConfig] = None, tp: TensorParallel = SINGLE):
        t_start = time.perf_counter()
        self.tp = tp  # under tensor parallelism: this rank's shard; rank 0 alone samples
        self.device = resolve_device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        self.block_size = cache_config.block_size
        self.kernels = select_kernels(self.device.type)
        # The engine resolved these already; a runner built on its own resolves its `auto`s the same way.
        compile_config, scheduler_config = resolve_for_device(compile_config, scheduler_config or SchedulerConfig(),
                                                              self.device.type)
        self.compile_config = compile_config
        t0 = time.perf_counter()
        self.loaded: LoadedModel = load_model(model_config, cache_config.resolved_dir, self.device, self.dtype, tp)
        load_seconds = time.perf_counter() - t0
        self.model, self.arch, self.tokenizer = self.loaded.model, self.loaded.arch, self.loaded.tokenizer
        self.max_model_len = self.loaded.max_model_len
        sched = scheduler_config
        limits = InputLimits(sched.max_num_batched_tokens, sched.max_num_seqs, -(-self.max_model_len // self.block_size))
        self.compiled = CompiledModel(self.model, compile_config, self.kernels, limits, self.max_model_len,
                                      ArtifactCache(cache_config.resolved_dir, self._artifact_name()))
        self.input_batch = InputBatch(self.compiled.inputs, self.block_size)
        self.kv_shape = KVShape(self.arch.num_layers, self.block_size, local_num_kv_heads(self.arch, tp),
                                self.arch.head_dim, self.dtype)
        activation_bytes, self.graph_estimate = 0, None
        t_profile = time.perf_counter()
        if self.device.type == "cuda":
            activation_bytes = kv_sizing.profile_activation_bytes(
                self.compiled, self.kv_shape, self.max_model_len, sched.max_num_batched_tokens, sched.max_num_seqs)
            if cache_config.num_blocks is None and cache_config.kv_cache_memory_gib is None:
                self.graph_estimate = self.compiled.profile_graph_memory(
                    kv_sizing.allocate_kv_caches(self.kv_shape, 2, self.device))
        t_kv = time.perf_counter()
        profile_seconds = t_kv - t_profile
        self.num_blocks, self.kv_caches = self._make_kv_caches(cache_config, activation_bytes)
        kv_seconds = time.perf_counter() - t_kv
        self.compiled.bind_kv_caches(self.kv_caches)
        try:
            self.compiled.capture_graphs()
        except torch.OutOfMemoryError as e:
            raise ValueError(f"CUDA graph capture ran out of GPU memory ({e}); drop the largest "
                             "compile.capture_sizes (or lower scheduler.max_num_seqs), or lower "
                             "cache.gpu_memory_fraction / cache.kv_cache_memory_gib to leave room") from e
        if self.graph_estimate is not None:
            logger.info("CUDA graphs: %.2f GiB used, %.2f GiB was kept for them",
                        self.compiled.graph_memory_bytes / 2**30, self.graph_estimate.bytes() / 2**30)
        self.sampler = Sampler(seed=model_config.seed)
        num_usable = self.num_blocks - 1  # block 0 is the pool's null block (kiln.runtime.block_pool)
        logger.info("KV cache: %d usable blocks of %d tokens (%d tokens of context; 1 more block is reserved) "
                    "in %.2f GiB; CUDA graphs %.2f GiB", num_usable, self.block_size, num_usable * self.block_size,
                    self.num_blocks * self.kv_shape.bytes_per_block / 2**30,
                    self.compiled.graph_memory_bytes / 2**30)
        self.startup_seconds = {"load_weights_s": load_seconds, **self.compiled.startup_seconds(),
                                "profile_s": profile_seconds, "kv_alloc_s": kv_seconds,
                                "ready_s": time.perf_counter() - t_start}
        logger.info("start-up: load weights %.2f s, Dynamo %.2f s, Inductor %.2f s, compile cache load %.2f s, "
                    "CUDA graphs %.2f s, memory profile %.2f s, KV allocation %.2f s; ready in %.2f s",
                    *self.startup_seconds.values())

    def _make_kv_caches(self, cache_config: CacheConfig, activation_bytes: int) -> tuple[int, list[torch.Tensor]]:
        """Size the cache after the activations and the CUDA graphs, the same on every rank, and allocate it."""
        num_blocks = kv_sizing.decide_num_blocks(cache_config, self.kv_shape, self.device, activation_bytes,
                                                 self.graph_estimate, self.max_model_len)
        num_blocks = min_over_ranks(num_blocks, self.tp, self.device)
        return num_blocks, kv_sizing.allocate_kv_caches(self.kv_shape, num_blocks, self.device)

    def _artifact_name(self) -> str:
        # A rank's shard is a different graph from the whole model's; ranks never share a directory.
        name = self.loaded.name
        return name if self.tp.size == 1 else f"{name}-tp{self.tp.size}-rank{self.tp.rank}"

    # ---- one step -------------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        return self.collect(self.launch(sched))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> LaunchedStep:
        """Prepare the inputs and enqueue forward, logits and sampling; on a GPU it returns while
        they run. Everything read from the requests is read here: ``collect`` reads none of it."""
        if sched.is_empty:
            return LaunchedStep()
        inputs, sample_rows = self.input_batch.prepare(sched)
        out = self.compiled.run(inputs)
        if not sample_rows:
            return LaunchedStep()
        greedy_ids = None
        contiguous = len(sample_rows) == sample_rows[-1] + 1  # rows 0..n-1 (decode-only): a view
        rows = slice(0, len(sample_rows)) if contiguous else host_to_device(sample_rows, self.device)
        if out.logits is not None:  # a full graph computed them already
            logits, greedy_ids = out.logits[rows], out.greedy_ids[rows]
        else:
            # Every rank: under tensor parallelism the logits are gathered over the group.
            logits = self.model.compute_logits(out.hidden[rows])  # [num_sampled, vocab] float32
        if self.tp.rank != 0:  # rank 0 alone samples
            return LaunchedStep()
        requests = [s.request for s in sched.scheduled if s.samples]  # one per sample row
        return LaunchedStep([r.request_id for r in requests], self.sampler.launch(logits, requests, greedy_ids))

    def collect(self, launched: LaunchedStep) -> RunnerOutput:
        """Wait for a launched step and read its tokens back to the host."""
        if launched.samples is None:
            return RunnerOutput()
        out = launched.samples.result()
        return RunnerOutput(dict(zip(launched.request_ids, out.token_ids)),
                            dict(zip(launched.request_ids, out.logprobs)))

    def forget(self, request_id: str) -> None:
        """Drop per-request state (seeded generators) once a request finishes."""
        self.sampler.forget(request_id)
