"""The one Llama-family model: Llama 2/3, Qwen2, Mistral and SmolLM2 differ only in ``ArchConfig``;
Mixtral, Qwen2-MoE and Qwen3-MoE swap sparse layers' MLP for ``kiln.models.moe.SparseMoeBlock``.

Rules this module keeps:
- The forward takes a flat batch (``[num_tokens]`` ids and positions, no padding, decodes and
  prefill chunks mixed) and reads everything else from the forward context through
  ``torch.ops.kiln.attend_paged``; it holds no cache and no per-step Python state.
- The forward is also the graph torch.compile captures: no branches on tensor values, no
  ``.item()``, no lists of tensors; Python control flow only on the (static) architecture.
- q/k/v and gate/up are fused into one Linear each: at batch 1 the step is bound by per-op
  overhead and weight reads, and one matmul reads the same bytes with fewer launches.
- Tensor parallelism (``kiln.models.parallel``) only shrinks the per-rank sizes and adds one
  ``torch.ops.kiln.all_reduce`` after the embedding, o_proj and down_proj, and one
  ``torch.ops.kiln.all_gather`` of the logits; with one rank the graph is unchanged.
- Numerics follow transformers: RMSNorm statistics in float32, RoPE table computed in float32
  then cast to the model dtype, rotate-half (neox) layout.
"""

from __future__ import annotations

import math
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

import kiln.ops  # noqa: F401  (registers torch.ops.kiln.attend_paged)
import kiln.ops.collective  # noqa: F401  (registers torch.ops.kiln.all_reduce and all_gather)
from kiln.models.arch import ArchConfig, is_sparse_layer
from kiln.models.moe import SparseMoeBlock
from kiln.models.parallel import (SINGLE, Shard, TensorParallel, check_tensor_parallel, column_shard, head_shards,
                                  local_intermediate_size, local_num_heads, local_num_kv_heads, row_shard,
                                  vocab_range, vocab_shard)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in float32 even for bf16 models, rounding back before the weight, as HF does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(arch: ArchConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32, with llama3 scaling when configured."""
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = arch.rope_scaling
    if rs is None:
        return inv_freq
    # Llama 3.1: stretch low frequencies by `factor`, keep high ones, blend in between.
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin_table(arch: ArchConfig, num_positions: int) -> torch.Tensor:
    """[num_positions, head_dim] float32: cos in the first half, sin in the second."""
    positions = torch.arange(num_positions, dtype=torch.float32)
    freqs = torch.outer(positions, rope_inv_freq(arch))  # [num_positions, head_dim // 2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [T, n, D]; cos = [cos, cos], sin_signed = [-sin, sin], each [T, 1, D].

    x * cos + roll(x, D/2) * [-sin, sin] equals HF's x * cos + rotate_half(x) * sin term by term
    (negation is exact), in four ops instead of the six of slice-neg-cat.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the embedding table (``vocab_range``); with one rank, ``nn.Embedding``.

    A rank looks up the ids in its range and gives zeros for the others; the all-reduce sums the
    one non-zero row per token, so the result is exact."""

    def __init__(self, arch: ArchConfig, tp: TensorParallel = SINGLE) -> None:
        self.vocab_start, num_rows = vocab_range(arch, tp)
        super().__init__(num_rows, arch.hidden_size)
        self.tp_size = tp.size

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(input_ids)
        local_ids = input_ids - self.vocab_start  # [T]
        mine = (local_ids >= 0) & (local_ids < self.num_embeddings)
        x = F.embedding(torch.where(mine, local_ids, 0), self.weight)  # [T, hidden]
        return torch.ops.kiln.all_reduce(x.masked_fill(~mine.unsqueeze(-1), 0.0))


class LlamaAttention(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.tp_size = tp.size
        # This rank's heads: qkv_proj is column-parallel, o_proj row-parallel.
        self.num_heads, self.num_kv_heads = local_num_heads(arch, tp), local_num_kv_heads(arch, tp)
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * arch.head_dim
        self.kv_size = self.num_kv_heads * arch.head_dim
        self.scale = arch.head_dim**-0.5
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)
        # Qwen3: RMSNorm over head_dim on q and k, before RoPE.
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        # q and k heads rotate together: one set of elementwise ops instead of two.
        qk = apply_rope(qk, cos, sin_signed)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H, D], [T, KVH, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        # q, k, v are row-strided views (last dim contiguous); the attention kernels take strides.
        o = torch.ops.kiln.attend_paged(q, k, v, self.layer_idx, self.scale)  # [T, H, D]
        out = self.o_proj(o.flatten(1))  # [T, hidden]: a partial sum over this rank's heads
        return torch.ops.kiln.all_reduce(out) if self.tp_size > 1 else out


class LlamaMLP(nn.Module):
    def __init__(self, arch: ArchConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp_size = tp.size
        inter = local_intermediate_size(arch, tp)  # gate_up_proj column-parallel, down_proj row-parallel
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, intermediate / tp] each
        out = self.down_proj(F.silu(gate) * up)  # [T, hidden]: a partial sum over this rank's rows
        return torch.ops.kiln.all_reduce(out) if self.tp_size > 1 else out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = LlamaAttention(arch, layer_idx, tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = SparseMoeBlock(arch, tp) if is_sparse_layer(arch, layer_idx) else LlamaMLP(arch, tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin_signed)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ArchConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        check_tensor_parallel(arch, tp.size)
        self.arch = arch
        self.tp = tp
        # Embedding and LM head hold this rank's vocabulary rows, norms are replicated (kiln.models.parallel).
        self.embed_tokens = VocabParallelEmbedding(arch, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, i, tp) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        # Tied models read the embedding matrix in compute_logits instead of holding a second Linear.
        num_vocab_rows = self.embed_tokens.num_embeddings
        self.lm_head = None if arch.tie_word_embeddings else nn.Linear(arch.hidden_size, num_vocab_rows, bias=False)
        # Not persistent: recomputed from ArchConfig, never loaded from a checkpoint.
        self.register_buffer("cos_sin_cache", rope_cos_sin_table(arch, arch.max_position_embeddings), persistent=False)

    def reset_rope_cache(self) -> None:
        """Recompute the RoPE table in place (after ``to_empty`` from the meta device)."""
        table = rope_cos_sin_table(self.arch, self.cos_sin_cache.shape[0])
        with torch.no_grad():
            self.cos_sin_cache.copy_(table)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens] int64 -> final hidden states [num_tokens, hidden]."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos_sin = self.cos_sin_cache.index_select(0, positions).to(x.dtype)  # [T, D]
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2] each
        cos = torch.cat((cos, cos), dim=-1)  # [T, 1, D]
        sin_signed = torch.cat((-sin, sin), dim=-1)  # [T, 1, D]
        for layer in self.layers:
            x = layer(x, cos, sin_signed)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] (only the rows to sample) -> [N, vocab] float32.

        Under tensor parallelism a collective: every rank must call it for the same rows."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, weight)  # [N, this rank's vocab rows]
        if self.tp.size == 1:
            return logits.float()
        logits = torch.ops.kiln.all_gather(logits)  # [N, padded vocab], ranks in order
        if logits.shape[-1] != self.arch.vocab_size:
            logits = logits[:, :self.arch.vocab_size]  # the padding's columns (zero rows) never sample
        return logits.float().contiguous()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up; every parameter must be given.

        Tensors are full (unsharded); under tensor parallelism each rank copies only its slice."""
        targets = {name: (dest, shard) for name, dest, shard in self._weight_slices()}
        self._zero_vocab_padding()
        loaded: set[str] = set()
        for name, tensor in weights:
            if name not in targets:
                if _is_ignorable(name, self.arch):
                    continue
                raise ValueError(f"unexpected weight {name!r} for a {self.arch.family} model "
                                 f"with {self.arch.num_layers} layers")
            dest, shard = targets[name]
            if shard is not None:
                tensor = tensor.narrow(*shard)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            del tensor  # before the next is drawn or read: one full tensor at a time
            loaded.add(name)
        missing = sorted(set(targets) - loaded)
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise ValueError(f"checkpoint lacks {len(missing)} weight(s): {missing[:5]}{more}")

    def _zero_vocab_padding(self) -> None:
        """Zero the embedding / LM head rows past the vocabulary (no checkpoint tensor fills them)."""
        _, num_real = vocab_shard(self.arch, self.tp)
        for head in (self.embed_tokens, self.lm_head):
            if head is not None:
                head.weight[num_real:].zero_()

    def _weight_targets(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, the slice of a kiln parameter it fills); fused weights are row ranges. With one
        rank these are the Hugging Face tensors, ready for any rank's ``load_weights``."""
        for name, dest, _ in self._weight_slices():
            yield name, dest

    def _weight_slices(self) -> Iterator[tuple[str, torch.Tensor, Shard]]:
        """(HF name, the slice of a kiln parameter it fills, the slice of the HF tensor this rank
        loads or None for all of it); fused weights are row ranges."""
        arch, tp = self.arch, self.tp
        vocab, num_real = vocab_shard(arch, tp)  # this rank's vocab rows; padding rows take no tensor
        yield "model.embed_tokens.weight", self.embed_tokens.weight[:num_real], vocab
        yield "model.norm.weight", self.norm.weight, None
        if self.lm_head is not None:
            yield "lm_head.weight", self.lm_head.weight[:num_real], vocab
        heads = head_shards(arch, tp)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            q, kv = attn.q_size, attn.kv_size
            rows = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
            for proj, (start, end) in rows.items():
                yield f"{p}self_attn.{proj}.weight", attn.qkv_proj.weight[start:end], heads[proj]
                if attn.qkv_proj.bias is not None:
                    yield f"{p}self_attn.{proj}.bias", attn.qkv_proj.bias[start:end], heads[proj]
            yield f"{p}self_attn.o_proj.weight", attn.o_proj.weight, row_shard(arch.num_heads * arch.head_dim, tp)
            if attn.q_norm is not None:
                yield f"{p}self_attn.q_norm.weight", attn.q_norm.weight, None
                yield f"{p}self_attn.k_norm.weight", attn.k_norm.weight, None
            if isinstance(mlp, SparseMoeBlock):  # experts are never sharded (the block refuses tp > 1)
                yield from ((name, dest, None) for name, dest in mlp.weight_slices(p))
            else:
                inter = mlp.down_proj.in_features
                col, row = column_shard(arch.intermediate_size, tp), row_shard(arch.intermediate_size, tp)
                yield f"{p}mlp.gate_proj.weight", mlp.gate_up_proj.weight[:inter], col
                yield f"{p}mlp.up_proj.weight", mlp.gate_up_proj.weight[inter:], col
                yield f"{p}mlp.down_proj.weight", mlp.down_proj.weight, row
            yield f"{p}input_layernorm.weight", layer.input_layernorm.weight, None
            yield f"{p}post_attention_layernorm.weight", layer.post_attention_layernorm.weight, None


def _is_ignorable(name: str, arch: ArchConfig) -> bool:
    # Old checkpoints store RoPE buffers; tied ones sometimes keep a copy of the embedding as lm_head.
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and arch.tie_word_embeddings)
