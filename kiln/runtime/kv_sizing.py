"""How many KV blocks a device holds, and the KV cache tensors themselves.

The budget, in order of precedence: ``cache.num_blocks``; ``cache.kv_cache_memory_gib``; on CUDA
``cache.gpu_memory_fraction`` of the card minus what is in use (weights, CUDA context, other
processes), the profiled peak activations of the largest step, and what the CUDA graphs will take
(``CompiledModel.profile_graph_memory``: a profiled capture, extrapolated to every capture size;
the graphs are captured after the cache is allocated); on the CPU a fixed 1 GiB. A budget under two
blocks is an error that names the settings to raise; so is one where the graphs leave no room for
a single request of ``max_model_len`` tokens, which says how many capture sizes to drop. Under tensor parallelism the caller takes the minimum over
ranks, so every rank holds the same block ids.

Cache layout, one tensor per layer (``kiln.ops.attention``)::

    kv_cache[0 = K | 1 = V][block_id][offset in block][kv_head][head_dim]
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import mmap
import os
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from kiln.compiler import ArtifactCache, CompiledModel, GraphMemoryEstimate, ModelInputs
from kiln.config import CacheConfig

logger = logging.getLogger(__name__)

CPU_KV_BUDGET_GIB = 1.0


@dataclass(frozen=True)
class KVShape:
    """One layer's cache of one rank: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``."""

    num_layers: int
    block_size: int
    num_kv_heads: int  # this rank's
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize * self.block_size


def allocate_kv_caches(shape: KVShape, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    # Zeros, not empty: padded decode reads multiply masked (zero) weights by cache values, and
    # garbage NaNs would poison them.
    dims = (2, num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    if torch.device(device).type == "cpu":
        return [_lazy_zeros(dims, shape.dtype) for _ in range(shape.num_layers)]
    return [torch.zeros(dims, dtype=shape.dtype, device=device) for _ in range(shape.num_layers)]


def _lazy_zeros(dims: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in an anonymous memory mapping: the OS hands each page out zeroed when
    it is first touched, so a start does not fault in and clear the whole cache up front
    (``torch.zeros`` of SmolLM2's 1 GiB cache took 0.36-1.05 s of every CPU restart on a 2-vCPU EPYC,
    benchmarks/results/startup-cpu.md#startup_cpu_ab-amd-epyc). The tensor keeps the mapping alive."""
    count = math.prod(dims)
    if count == 0:
        return torch.zeros(dims, dtype=dtype)
    buffer = mmap.mmap(-1, count * dtype.itemsize)
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(dims)


def allocate_kv_scales(shape: KVShape, checkpoint_scales: dict[int, list[float]],
                       device: torch.device) -> Optional[list[torch.Tensor]]:
    """An FP8 cache's scales: per layer a float32 [2] (k_scale, v_scale), the checkpoint's or 1, views
    of one [num_layers, 2] tensor on ``device`` (kernels read them there; calibration writes them in
    place). None for a cache that is not FP8."""
    if shape.dtype != torch.float8_e4m3fn:
        if checkpoint_scales:
            logger.info("the checkpoint's KV cache scales are unused: the cache is %s (cache.dtype=fp8 uses them)",
                        shape.dtype)
        return None
    scales = torch.ones(shape.num_layers, 2, dtype=torch.float32)
    for layer, pair in checkpoint_scales.items():
        if not 0 <= layer < shape.num_layers:
            raise ValueError(f"the checkpoint has KV cache scales for layer {layer}; the model has {shape.num_layers}")
        scales[layer] = torch.tensor(pair)
    if checkpoint_scales:
        logger.info("FP8 KV cache: k/v scales of %d layers from the checkpoint", len(checkpoint_scales))
    return list(scales.to(device).unbind(0))


def decide_num_blocks(config: CacheConfig, shape: KVShape, device: torch.device, activation_bytes: int = 0,
                      graphs: Optional[GraphMemoryEstimate] = None, max_model_len: Optional[int] = None) -> int:
    """The number of blocks this device's budget holds (see the module docstring)."""
    if config.num_blocks is not None:
        return config.num_blocks
    graph_bytes = graphs.bytes() if graphs is not None else 0
    if config.kv_cache_memory_gib is not None:
        budget = config.kv_cache_memory_gib * 2**30
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free  # weights, CUDA context, other processes
        budget = config.gpu_memory_fraction * total - used - activation_bytes - graph_bytes
        logger.info("GPU memory: %.2f GiB total, %.2f GiB in use, %.2f GiB peak activations, "
                    "%.2f GiB for CUDA graphs -> %.2f GiB for the KV cache", total / 2**30, used / 2**30,
                    activation_bytes / 2**30, graph_bytes / 2**30, budget / 2**30)
        if graphs is not None and max_model_len is not None:
            _check_graphs_leave_room(graphs, budget, shape, max_model_len)
    else:
        budget = CPU_KV_BUDGET_GIB * 2**30
    num_blocks = int(budget // shape.bytes_per_block)
    if num_blocks < 2:
        raise ValueError(
            f"the KV cache budget ({budget / 2**30:.2f} GiB) holds fewer than 2 blocks; "
            "raise cache.kv_cache_memory_gib or cache.gpu_memory_fraction"
        )
    return num_blocks


def _check_graphs_leave_room(graphs: GraphMemoryEstimate, budget: float, shape: KVShape, max_model_len: int) -> None:
    """Fail at start, saying what to drop, when the CUDA graphs leave the KV cache no room for one
    request of ``max_model_len`` tokens (plus the null block)."""
    need = (-(-max_model_len // shape.block_size) + 1) * shape.bytes_per_block
    if budget >= need:
        return
    without = budget + graphs.bytes()
    n = len(graphs.sizes)
    keep = next((k for k in range(n - 1, 0, -1) if without - graphs.bytes(k) >= need), 0)
    short = (need - budget) / 2**30
    if keep:
        hint = (f"drop the {n - keep} largest capture sizes (compile.capture_sizes up to {graphs.sizes[keep - 1]}, "
                f"or scheduler.max_num_seqs={graphs.sizes[keep - 1]})")
    else:
        hint = "set compile.cudagraph=none"
    raise ValueError(
        f"CUDA graphs for {n} capture sizes ({graphs.sizes[0]}..{graphs.sizes[-1]}) need about "
        f"{graphs.bytes() / 2**30:.2f} GiB and leave the KV cache {max(budget, 0) / 2**30:.2f} GiB, "
        f"{short:.2f} GiB short of one request of max_model_len={max_model_len} tokens: {hint}, lower "
        "model.max_model_len, or raise cache.gpu_memory_fraction")


@torch.inference_mode()
def profile_activation_bytes(compiled: CompiledModel, shape: KVShape, max_model_len: int,
                             max_num_tokens: int, max_num_reqs: int) -> int:
    """Peak CUDA bytes, beyond the weights, of one forward over ``max_num_tokens`` prefill tokens
    plus logits for ``max_num_reqs`` rows. Runs twice: the first call also captures/compiles (whose
    scratch memory is not the serving peak), the second is measured. Binds a temporary KV cache to
    ``compiled``; the caller binds the real one afterwards."""
    device, bs, buf = compiled.device, shape.block_size, compiled.inputs
    req_len = max(bs, min(max_num_tokens, max_model_len) // bs * bs)
    # No step holds more than max_num_reqs requests of at most max_model_len tokens.
    num_reqs = min(-(-max_num_tokens // req_len), max_num_reqs)
    max_num_tokens = min(max_num_tokens, num_reqs * req_len)
    compiled.bind_kv_caches(allocate_kv_caches(shape, -(-max_num_tokens // bs) + 1, device))
    query_lens = [min(req_len, max_num_tokens - r * req_len) for r in range(num_reqs)]
    buf.qsl_np[0] = 0
    for r, n in enumerate(query_lens):  # prefills of blocks 1.., block 0 stays null
        t0 = r * req_len
        buf.ids_np[t0:t0 + n] = 0
        buf.pos_np[t0:t0 + n] = np.arange(n)
        buf.slot_np[t0:t0 + n] = np.arange(t0, t0 + n) + bs
        buf.table_np[r, :req_len // bs] = np.arange(1 + t0 // bs, 1 + (t0 + req_len) // bs)
        buf.seq_lens_np[r] = n
        buf.qsl_np[r + 1] = t0 + n
    inputs = ModelInputs(max_num_tokens, 0, query_lens, list(query_lens))
    peak = 0
    for _ in range(2):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        hidden = compiled.run(inputs).hidden
        # A pipeline stage before the last has no LM head (kiln.models.pipeline).
        stage = getattr(compiled.model, "stage", None)
        logits = compiled.compute_logits(hidden[:max_num_reqs]) if stage is None or stage.is_last else hidden
        logits.softmax(-1)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(device) - base
        del hidden, logits
    compiled.bind_kv_caches([])
    torch.cuda.empty_cache()
    logger.info("profiled forward: %d tokens in %d requests, peak activations %.2f GiB",
                max_num_tokens, num_reqs, peak / 2**30)
    return peak


@dataclass(frozen=True)
class MemoryProfile:
    """What start-up profiled before sizing the KV cache."""

    activation_bytes: int
    graphs: Optional[GraphMemoryEstimate]


class MemoryProfileCache:
    """Profiled start-up memory kept beside the compile cache, ``<cache.dir>/memory/<key>.json``, so
    a warm start skips the profile (two forwards of the largest step and two graph captures). The
    key is the compiled forward's artifact key (model, compile config, kiln's source, torch, device)
    with everything else the profile depends on: the scheduler's limits, the KV layout, the card's
    total memory. Like the compile cache it is only written where writable, never while loading."""

    KIND = "memory"

    def __init__(self, artifacts: ArtifactCache, compile_key: str, **shape: Any) -> None:
        self.artifacts = artifacts
        desc = json.dumps({"compile": compile_key, **shape}, sort_keys=True, default=str)
        self.path = artifacts.dir.parent / self.KIND / f"{hashlib.sha256(desc.encode()).hexdigest()[:20]}.json"

    def load(self) -> Optional[MemoryProfile]:
        try:
            data = json.loads(self.path.read_text())
            graphs = data["graphs"]
            return MemoryProfile(int(data["activation_bytes"]), None if graphs is None else GraphMemoryEstimate(
                tuple(graphs["sizes"]), int(graphs["largest_bytes"]), int(graphs["per_size_bytes"]),
                int(graphs["num_extra_graphs"])))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("ignoring the unreadable memory profile %s: %s", self.path, e)
            return None

    def store(self, profile: MemoryProfile) -> None:
        if not self.artifacts.writable():
            return
        data = {"activation_bytes": profile.activation_bytes,
                "graphs": None if profile.graphs is None else dataclasses.asdict(profile.graphs)}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.parent / f".{self.path.name}.{os.getpid()}"  # hidden: never listed as an entry
            tmp.write_text(json.dumps(data))
            os.replace(tmp, self.path)
        except OSError as e:
            logger.warning("could not store the memory profile %s: %s", self.path, e)
