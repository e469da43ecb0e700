"""ModelRunner: owns the model, its KV cache tensors and the sampler on one device.

One call per engine step: ``execute(SchedulerOutput) -> RunnerOutput``. It lays the scheduled
requests out as one flat batch (decodes first, then prefill chunks), builds the attention metadata,
runs the model inside ``forward_context``, computes logits only for the rows that sample, and
samples. It never decides what runs: that is the scheduler's job.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from kiln.compiler import build_forward
from kiln.config import CacheConfig, CompileConfig, ModelConfig
from kiln.forward_context import AttentionMetadata, ForwardContext, forward_context
from kiln.models.loader import LoadedModel, load_model, resolve_dtype
from kiln.runtime.sampler import Sampler
from kiln.runtime.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

_CPU_KV_BUDGET_GIB = 1.0


@dataclass
class RunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, Optional[dict[int, float]]] = field(default_factory=dict)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("model.device=cuda but no CUDA device is available; use model.device=cpu")
    return torch.device(name)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, compile_config: CompileConfig):
        self.device = resolve_device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        self.block_size = cache_config.block_size
        t0 = time.perf_counter()
        self.loaded: LoadedModel = load_model(model_config, cache_config.resolved_dir, self.device, self.dtype)
        self.load_seconds = time.perf_counter() - t0
        self.model = self.loaded.model
        self.arch = self.loaded.arch
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = self.loaded.max_model_len
        self.compile_config = compile_config
        self.forward = build_forward(self.model, compile_config)  # eager: the model itself
        self.num_blocks = self._decide_num_blocks(cache_config)
        self.kv_caches = self._allocate_kv_caches(self.num_blocks)
        self.sampler = Sampler(seed=model_config.seed)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens of context) in %.2f GiB",
            self.num_blocks, self.block_size, self.num_blocks * self.block_size,
            self.num_blocks * self._bytes_per_block() / 2**30,
        )

    # ---- KV cache -------------------------------------------------------------------------------
    def _bytes_per_block(self) -> int:
        a = self.arch
        per_token = 2 * a.num_layers * a.num_kv_heads * a.head_dim * self.dtype.itemsize
        return per_token * self.block_size

    def _decide_num_blocks(self, cache_config: CacheConfig) -> int:
        if cache_config.num_blocks is not None:
            return cache_config.num_blocks
        if cache_config.kv_cache_memory_gib is not None:
            budget = cache_config.kv_cache_memory_gib * 2**30
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used_by_others = total - free
            budget = cache_config.gpu_memory_fraction * total - used_by_others - 2 * 2**30
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
        shape = (2, num_blocks, self.block_size, a.num_kv_heads, a.head_dim)
        # Zeros, not empty: padded decode reads multiply masked (zero) weights by cache values,
        # and garbage NaNs would poison them.
        return [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(a.num_layers)]

    # ---- one step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        if sched.is_empty:
            return RunnerOutput()
        input_ids, positions, meta, sample_rows = self._prepare_inputs(sched)
        with forward_context(ForwardContext(attn=meta, kv_caches=self.kv_caches)):
            hidden = self.forward(input_ids, positions)  # [num_tokens, hidden]
        if not sample_rows:
            return RunnerOutput()
        rows = torch.tensor(sample_rows, device=self.device)
        logits = self.model.compute_logits(hidden[rows])  # [num_sampled, vocab] float32
        requests = [sched.scheduled[i].request for i in self._sampled_request_indices]
        out = self.sampler(logits, requests)
        result = RunnerOutput()
        for req, tok, lp in zip(requests, out.token_ids, out.logprobs):
            result.sampled_token_ids[req.request_id] = tok
            result.logprobs[req.request_id] = lp
        return result

    def _prepare_inputs(self, sched: SchedulerOutput):
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        self._sampled_request_indices: list[int] = []
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
                self._sampled_request_indices.append(i)
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

    def forget(self, request_id: str) -> None:
        """Drop per-request state (seeded generators) once a request finishes."""
        self.sampler.forget(request_id)
