"""ModelRunner: owns the model, its KV cache tensors and the sampler on one device.

One step is ``launch(SchedulerOutput) -> LaunchedStep`` then ``collect(LaunchedStep) -> RunnerOutput``
(``execute`` does both): launch enqueues the device work, collect waits for the sampled tokens, so
on a GPU the engine can process the previous step's outputs in between. It lays the scheduled
requests out as one flat batch (decodes first, then prefill chunks), builds the attention metadata,
runs the model inside ``forward_context``, computes logits only for the rows that sample, and
samples. It never decides what runs: that is the scheduler's job.

On CUDA it also: selects the Triton attention kernels; sizes the KV cache from
``cache.gpu_memory_fraction`` after a profiled forward at the largest batch
(``scheduler.max_num_batched_tokens``); prepares every step in persistent pinned/device buffers
(``kiln.compiler.cudagraph.StepBuffers``); and replays CUDA graphs as ``compile.cudagraph`` asks,
chosen per batch by ``kiln.compiler.cudagraph.dispatch``: a full graph for uniform decode batches,
piece graphs (``kiln.compiler.piecewise``, ``compile.mode=kiln`` only) for any batch of up to the
largest capture size, padded to a capture size with attention run on the real tokens.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from kiln.compiler import ArtifactCache, KilnForward, build_forward, build_now, compile_seconds
from kiln.compiler.cudagraph import (FullCUDAGraphs, GraphMode, GraphOutputs, StepBuffers, dispatch,
                                    wanted_graph_modes)
from kiln.compiler.piecewise import PiecewiseCUDAGraphs
from kiln.config import CacheConfig, CompileConfig, ModelConfig, SchedulerConfig
from kiln.forward_context import AttentionMetadata, ForwardContext, forward_context
from kiln.models.loader import LoadedModel, load_model, resolve_device, resolve_dtype
from kiln.models.parallel import SINGLE, TensorParallel, local_num_kv_heads, min_over_ranks
from kiln.runtime.sampler import SampledTokens, Sampler, host_to_device
from kiln.runtime.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

_CPU_KV_BUDGET_GIB = 1.0
_GRAPH_RESERVE_BYTES = 512 * 2**20  # kept free for CUDA graphs, which are captured after the KV cache


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
        if self.device.type == "cpu":
            # Before build_forward: the compiler swaps in the kernel registered for the device.
            # Process-global (the Triton kernel on CUDA is selected elsewhere); without kiln._C
            # this leaves the pure-torch reference in place.
            from kiln.ops.cpu_attention import enable_cpu_attention

            enable_cpu_attention()
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        self.block_size = cache_config.block_size
        t0 = time.perf_counter()
        self.loaded: LoadedModel = load_model(model_config, cache_config.resolved_dir, self.device, self.dtype, tp)
        self.load_seconds = time.perf_counter() - t0
        self.model = self.loaded.model
        self.arch = self.loaded.arch
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = self.loaded.max_model_len
        self.compile_config = compile_config
        is_cuda = self.device.type == "cuda"
        if is_cuda:
            from kiln.ops.triton_attention import enable_triton_attention
            from kiln.ops.triton_norm import enable_triton_norm_ops

            enable_triton_attention()  # before build_forward: the compiler swaps in the kernel op
            enable_triton_norm_ops()  # the kernels behind the fused add+RMSNorm and silu*mul ops
        self.forward = build_forward(self.model, compile_config,  # eager: the model itself
                                     artifact_cache=ArtifactCache(cache_config.resolved_dir, self._artifact_name()))
        build_now(self.forward, self.device)  # kiln: load the compiled forward from the cache, or compile it
        self.buffers: Optional[StepBuffers] = None
        self.cuda_graphs: Optional[FullCUDAGraphs] = None  # full graphs (uniform decode batches)
        self.piecewise_graphs: Optional[PiecewiseCUDAGraphs] = None
        self.activation_bytes = 0
        if is_cuda:
            sched = scheduler_config or SchedulerConfig()
            self.buffers = StepBuffers(sched.max_num_batched_tokens, sched.max_num_seqs,
                                       -(-self.max_model_len // self.block_size), self.device)
            self.activation_bytes = self._profile_activation_bytes(sched.max_num_batched_tokens, sched.max_num_seqs)
        t_kv = time.perf_counter()
        self.num_blocks = min_over_ranks(self._decide_num_blocks(cache_config), tp, self.device)
        self.kv_caches = self._allocate_kv_caches(self.num_blocks)
        kv_seconds = time.perf_counter() - t_kv
        if is_cuda:
            self._capture_cuda_graphs(compile_config)
        self.sampler = Sampler(seed=model_config.seed)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens of context) in %.2f GiB",
            self.num_blocks, self.block_size, self.num_blocks * self.block_size,
            self.num_blocks * self._bytes_per_block() / 2**30,
        )
        self.startup_seconds = {"load_weights_s": self.load_seconds, **compile_seconds(self.forward),
                                "cudagraph_s": sum(g.capture_seconds for g in (self.cuda_graphs,
                                                                               self.piecewise_graphs) if g),
                                "kv_alloc_s": kv_seconds, "ready_s": time.perf_counter() - t_start}
        logger.info("start-up: load weights %.2f s, Dynamo %.2f s, Inductor %.2f s, compile cache load %.2f s, "
                    "CUDA graphs %.2f s, KV allocation %.2f s; ready in %.2f s", *self.startup_seconds.values())

    def _capture_cuda_graphs(self, compile_config: CompileConfig) -> None:
        """After the KV cache exists: full graphs first (the piece wrappers are not installed yet, so
        nothing nests), then piece graphs; all in one memory pool (graphs never run concurrently)."""
        modes = wanted_graph_modes(compile_config.cudagraph, has_pieces=isinstance(self.forward, KilnForward))
        if not modes:
            return
        pool = torch.cuda.graph_pool_handle()
        if GraphMode.FULL in modes:
            self.cuda_graphs = FullCUDAGraphs(self.forward, self.buffers, compile_config.capture_sizes,
                                              self.max_model_len, compute_logits=self.model.compute_logits)
            self.cuda_graphs.capture(self.kv_caches, pool)
        if GraphMode.PIECEWISE in modes:
            self.piecewise_graphs = PiecewiseCUDAGraphs(self.forward, self.buffers, compile_config.capture_sizes)
            self.piecewise_graphs.capture(self.kv_caches, pool)

    def _artifact_name(self) -> str:
        # A rank's shard is a different graph from the whole model's; ranks never share a directory.
        name = self.loaded.name
        return name if self.tp.size == 1 else f"{name}-tp{self.tp.size}-rank{self.tp.rank}"

    # ---- KV cache -------------------------------------------------------------------------------
    def _bytes_per_block(self) -> int:
        a = self.arch
        per_token = 2 * a.num_layers * local_num_kv_heads(a, self.tp) * a.head_dim * self.dtype.itemsize
        return per_token * self.block_size

    def _decide_num_blocks(self, cache_config: CacheConfig) -> int:
        if cache_config.num_blocks is not None:
            return cache_config.num_blocks
        if cache_config.kv_cache_memory_gib is not None:
            budget = cache_config.kv_cache_memory_gib * 2**30
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free  # weights, CUDA context, other processes
            reserve = _GRAPH_RESERVE_BYTES if self.compile_config.cudagraph != "none" else 0
            budget = cache_config.gpu_memory_fraction * total - used - self.activation_bytes - reserve
            logger.info("GPU memory: %.2f GiB total, %.2f GiB in use, %.2f GiB peak activations, "
                        "%.2f GiB kept for graphs -> %.2f GiB for the KV cache", total / 2**30, used / 2**30,
                        self.activation_bytes / 2**30, reserve / 2**30, budget / 2**30)
        else:
            budget = _CPU_KV_BUDGET_GIB * 2**30
        num_blocks = int(budget // self._bytes_per_block())
        if num_blocks < 2:
            raise ValueError(
                f"the KV cache budget ({budget / 2**30:.2f} GiB) holds fewer than 2 blocks; "
                "raise cache.kv_cache_memory_gib or cache.gpu_memory_fraction"
            )
        return num_blocks

    def _allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        a = self.arch
        shape = (2, num_blocks, self.block_size, local_num_kv_heads(a, self.tp), a.head_dim)
        # Zeros, not empty: padded decode reads multiply masked (zero) weights by cache values,
        # and garbage NaNs would poison them.
        return [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(a.num_layers)]

    @torch.inference_mode()
    def _profile_activation_bytes(self, max_num_tokens: int, max_num_reqs: int) -> int:
        """Peak bytes, beyond the weights, of one forward over ``max_num_tokens`` prefill tokens plus
        logits for ``max_num_reqs`` rows. Runs twice: the first call also captures/compiles (whose
        scratch memory is not the serving peak), the second is measured."""
        bs, buf = self.block_size, self.buffers
        req_len = max(bs, min(max_num_tokens, self.max_model_len) // bs * bs)
        num_reqs = -(-max_num_tokens // req_len)
        caches = self._allocate_kv_caches(-(-max_num_tokens // bs) + 1)
        query_lens = [min(req_len, max_num_tokens - r * req_len) for r in range(num_reqs)]
        buf.qsl_np[0] = 0
        for r, n in enumerate(query_lens):
            t0 = r * req_len
            buf.ids_np[t0:t0 + n] = 0
            buf.pos_np[t0:t0 + n] = np.arange(n)
            buf.slot_np[t0:t0 + n] = np.arange(t0, t0 + n) + bs  # blocks 1.., block 0 stays null
            buf.table_np[r, :req_len // bs] = np.arange(1 + t0 // bs, 1 + (t0 + req_len) // bs)
            buf.seq_lens_np[r] = n
            buf.qsl_np[r + 1] = t0 + n
        buf.upload(max_num_tokens, num_reqs)
        meta = buf.metadata(max_num_tokens, num_reqs, 0, query_lens, list(query_lens))
        peak = 0
        for i in range(2):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            with forward_context(ForwardContext(attn=meta, kv_caches=caches)):
                hidden = self.forward(buf.input_ids[:max_num_tokens], buf.positions[:max_num_tokens])
            logits = self.model.compute_logits(hidden[:max_num_reqs])
            logits.softmax(-1)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated(self.device) - base
            del hidden, logits
        del caches
        torch.cuda.empty_cache()
        logger.info("profiled forward: %d tokens in %d requests, peak activations %.2f GiB",
                    max_num_tokens, num_reqs, peak / 2**30)
        return peak

    # ---- one step -------------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        return self.collect(self.launch(sched))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> LaunchedStep:
        """Prepare the inputs and enqueue forward, logits and sampling; on a GPU it returns while
        they run. Everything read from the requests is read here: ``collect`` reads none of it."""
        if sched.is_empty:
            return LaunchedStep()
        graph_out = None
        if self.buffers is not None:
            hidden, sample_rows, graph_out = self._run_cuda(sched)
        else:
            input_ids, positions, meta, sample_rows = self._prepare_inputs(sched)
            with forward_context(ForwardContext(attn=meta, kv_caches=self.kv_caches)):
                hidden = self.forward(input_ids, positions)  # [num_tokens, hidden]
        if not sample_rows:
            return LaunchedStep()
        greedy_ids = None
        contiguous = len(sample_rows) == sample_rows[-1] + 1  # rows 0..n-1 (decode-only): a view
        rows = slice(0, len(sample_rows)) if contiguous else host_to_device(sample_rows, self.device)
        if graph_out is not None and graph_out.logits is not None:  # the graph computed them already
            logits, greedy_ids = graph_out.logits[rows], graph_out.greedy_ids[rows]
        else:
            # Every rank: under tensor parallelism the logits are gathered over the group.
            logits = self.model.compute_logits(hidden[rows])  # [num_sampled, vocab] float32
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

    def _prepare_inputs(self, sched: SchedulerOutput):
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        max_blocks = max(len(s.block_ids) for s in sched.scheduled)
        table = torch.zeros((len(sched.scheduled), max_blocks), dtype=torch.int32)
        for i, s in enumerate(sched.scheduled):
            start, n = s.start, s.num_new_tokens
            token_ids.extend(s.request.token_ids_slice(start, start + n))
            positions.extend(range(start, start + n))
            blocks = s.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            query_lens.append(n)
            seq_lens.append(start + n)
            if s.samples:
                sample_rows.append(len(token_ids) - 1)
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        dev = self.device
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=table.to(dev),
            num_decodes=num_decodes,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        return input_ids, pos, meta, sample_rows

    def _run_cuda(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[int], Optional[GraphOutputs]]:
        """Fill the persistent buffers, then replay a graph or run the forward on buffer views."""
        buf, bs = self.buffers, self.block_size
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        num_tokens = 0
        for i, s in enumerate(sched.scheduled):
            start, n = s.start, s.num_new_tokens
            end = num_tokens + n
            blocks = s.block_ids
            buf.table_np[i, : len(blocks)] = blocks
            if n == 1:  # a decode: scalar writes, no arrays
                buf.ids_np[num_tokens] = s.request.token_ids_slice(start, start + 1)[0]
                buf.pos_np[num_tokens] = start
                buf.slot_np[num_tokens] = blocks[start // bs] * bs + start % bs
            else:
                pos = np.arange(start, start + n)
                buf.ids_np[num_tokens:end] = s.request.token_ids_slice(start, start + n)
                buf.pos_np[num_tokens:end] = pos
                buf.slot_np[num_tokens:end] = buf.table_np[i, pos // bs].astype(np.int64) * bs + pos % bs
            buf.seq_lens_np[i] = start + n
            num_tokens = end
            buf.qsl_np[i + 1] = num_tokens
            query_lens.append(n)
            seq_lens.append(start + n)
            if s.samples:
                sample_rows.append(num_tokens - 1)
        buf.qsl_np[0] = 0
        num_reqs = len(query_lens)
        num_decodes = 0
        while num_decodes < num_reqs and query_lens[num_decodes] == 1:
            num_decodes += 1
        mode, padded = dispatch(self.cuda_graphs, self.piecewise_graphs, num_tokens, num_reqs, num_decodes)
        if mode is GraphMode.FULL:
            buf.fill_null_requests(num_reqs, num_tokens, padded)
            buf.upload(padded, padded)
            out = self.cuda_graphs.replay(padded)
            return out.hidden, sample_rows, out
        # PIECEWISE: rows [num_tokens, padded) are padding the piece graphs run and attention never
        # sees (its metadata is the real batch's); NONE: padded == num_tokens.
        buf.pad_tokens(num_tokens, padded)
        buf.upload(padded, num_reqs)
        meta = buf.metadata(num_tokens, num_reqs, num_decodes, query_lens, seq_lens)
        graphs = self.piecewise_graphs.replaying(padded, num_tokens) if mode is GraphMode.PIECEWISE \
            else contextlib.nullcontext()
        with forward_context(ForwardContext(attn=meta, kv_caches=self.kv_caches)), graphs:
            hidden = self.forward(buf.input_ids[:padded], buf.positions[:padded])  # [padded, hidden]
        return hidden, sample_rows, None

    def forget(self, request_id: str) -> None:
        """Drop per-request state (seeded generators) once a request finishes."""
        self.sampler.forget(request_id)
