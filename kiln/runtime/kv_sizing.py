"""How many KV blocks a device holds, and the KV cache tensors themselves.

The budget, in order of precedence: ``cache.num_blocks``; ``cache.kv_cache_memory_gib``; on CUDA
``cache.gpu_memory_fraction`` of the card minus what is in use (weights, CUDA context, other
processes), the profiled peak activations of the largest step, and a reserve for CUDA graphs
(captured after the cache is allocated); on the CPU a fixed 1 GiB. A budget under two blocks is an
error that names the settings to raise. Under tensor parallelism the caller takes the minimum over
ranks, so every rank holds the same block ids.

Cache layout, one tensor per layer (``kiln.ops.attention``)::

    kv_cache[0 = K | 1 = V][block_id][offset in block][kv_head][head_dim]
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from kiln.compiler import CompiledModel, ModelInputs
from kiln.config import CacheConfig

logger = logging.getLogger(__name__)

CPU_KV_BUDGET_GIB = 1.0
GRAPH_RESERVE_BYTES = 512 * 2**20  # kept free for CUDA graphs, which are captured after the KV cache


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
    return [torch.zeros(dims, dtype=shape.dtype, device=device) for _ in range(shape.num_layers)]


def decide_num_blocks(config: CacheConfig, shape: KVShape, device: torch.device, activation_bytes: int = 0,
                      graph_reserve_bytes: int = 0) -> int:
    """The number of blocks this device's budget holds (see the module docstring)."""
    if config.num_blocks is not None:
        return config.num_blocks
    if config.kv_cache_memory_gib is not None:
        budget = config.kv_cache_memory_gib * 2**30
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free  # weights, CUDA context, other processes
        budget = config.gpu_memory_fraction * total - used - activation_bytes - graph_reserve_bytes
        logger.info("GPU memory: %.2f GiB total, %.2f GiB in use, %.2f GiB peak activations, "
                    "%.2f GiB kept for graphs -> %.2f GiB for the KV cache", total / 2**30, used / 2**30,
                    activation_bytes / 2**30, graph_reserve_bytes / 2**30, budget / 2**30)
    else:
        budget = CPU_KV_BUDGET_GIB * 2**30
    num_blocks = int(budget // shape.bytes_per_block)
    if num_blocks < 2:
        raise ValueError(
            f"the KV cache budget ({budget / 2**30:.2f} GiB) holds fewer than 2 blocks; "
            "raise cache.kv_cache_memory_gib or cache.gpu_memory_fraction"
        )
    return num_blocks


@torch.inference_mode()
def profile_activation_bytes(compiled: CompiledModel, shape: KVShape, max_model_len: int,
                             max_num_tokens: int, max_num_reqs: int) -> int:
    """Peak CUDA bytes, beyond the weights, of one forward over ``max_num_tokens`` prefill tokens
    plus logits for ``max_num_reqs`` rows. Runs twice: the first call also captures/compiles (whose
    scratch memory is not the serving peak), the second is measured. Binds a temporary KV cache to
    ``compiled``; the caller binds the real one afterwards."""
    device, bs, buf = compiled.device, shape.block_size, compiled.inputs
    req_len = max(bs, min(max_num_tokens, max_model_len) // bs * bs)
    num_reqs = -(-max_num_tokens // req_len)
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
        logits = compiled.model.compute_logits(hidden[:max_num_reqs])
        logits.softmax(-1)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(device) - base
        del hidden, logits
    compiled.bind_kv_caches([])
    torch.cuda.empty_cache()
    logger.info("profiled forward: %d tokens in %d requests, peak activations %.2f GiB",
                max_num_tokens, num_reqs, peak / 2**30)
    return peak
