"""The one native model: Llama 2/3, Qwen2/3, Mistral, Gemma 2/3, Phi-3/4, OLMo-2, Granite and SmolLM2
differ only in ``ArchConfig`` (numbers of the checkpoint) and its ``FamilyTraits`` (norm numerics and
placement, q/k norms, scaled embeddings, fused checkpoint layouts).
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
- Pipeline parallelism (``kiln.models.pipeline``) builds only the stage's layers (the others are
  weightless ``MissingLayer``s, so module and checkpoint names keep their global layer index); a
  stage after the first reads its input from ``stage_input`` through ``kiln.read_stage_input`` (a
  persistent buffer the runner receives the stage before's hidden states into, so a captured graph
  reads it at one address) and a stage before the last returns its hidden states without the
  final norm. The forward
  itself never communicates; with one stage the graph is unchanged.
- Numerics follow transformers: RMSNorm statistics in float32 (the weight applied where each
  family's code applies it), RoPE table computed in float32 then cast to the model dtype,
  rotate-half (neox) layout.
- Attention options a layer needs (sliding window, logit soft-cap) are passed to the attention op
  only when set, so models without them capture the same graph as before.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

import kiln.ops  # noqa: F401  (registers torch.ops.kiln.attend_paged)
import kiln.ops.collective  # noqa: F401  (registers torch.ops.kiln.all_reduce and all_gather)
import kiln.ops.stage_input  # noqa: F401  (registers torch.ops.kiln.read_stage_input)
from kiln.models.arch import ArchConfig, is_sparse_layer
from kiln.ops.cpu_linear import Q8Head, head_linear
from kiln.models.moe import SparseMoeBlock
from kiln.models.rope import rope_cos_sin_table
from kiln.models.parallel import (SINGLE, Shard, TensorParallel, check_tensor_parallel, column_shard, head_shards,
                                  local_intermediate_size, local_num_heads, local_num_kv_heads, row_shard,
                                  vocab_range, vocab_shard)
from kiln.models.pipeline import WHOLE, PipelineStage


class RMSNorm(nn.Module):
    """RMSNorm with statistics in float32; ``style`` says where the weight is applied, as each
    family's transformers code does: "llama" rounds back to the input dtype before the weight,
    "olmo" multiplies by the weight in float32 and then rounds, "gemma" scales by ``1 + weight`` in
    float32 (its checkpoints store the offset from one)."""

    def __init__(self, hidden_size: int, eps: float, style: str = "llama") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.style = style

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.style == "llama":
            return self.weight * xf.to(x.dtype)
        if self.style == "olmo":
            return (self.weight * xf).to(x.dtype)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [T, n, D]; cos = [cos, cos], sin_signed = [-sin, sin], each [T, 1, R].

    x * cos + roll(x, R/2) * [-sin, sin] equals HF's x * cos + rotate_half(x) * sin term by term
    (negation is exact), in four ops instead of the six of slice-neg-cat. With partial rotary
    (R < D) only the first R dims of each head rotate; the rest pass through.
    """
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + x.roll(rot // 2, dims=-1) * sin_signed
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + x_rot.roll(rot // 2, dims=-1) * sin_signed, x_pass), dim=-1)


def _rope_table(arch: ArchConfig, num_positions: int, theta: Optional[float] = None) -> torch.Tensor:
    """``rope_cos_sin_table``, or on the meta device an empty table of its shape: ``reset_rope_cache``
    fills it once the model is materialized, and computing it on meta runs torch's Python references,
    whose wrappers import torch._dynamo (kiln.models.loader builds models there)."""
    if torch.get_default_device().type == "meta":
        return torch.empty(num_positions, 2 * (arch.rotary_dim // 2))
    return rope_cos_sin_table(arch, num_positions, theta)


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the embedding table (``vocab_range``); with one rank, ``nn.Embedding``.

    A rank looks up the ids in its range and gives zeros for the others; the all-reduce sums the
    one non-zero row per token, so the result is exact."""

    def __init__(self, arch: ArchConfig, tp: TensorParallel = SINGLE) -> None:
        self.vocab_start, num_rows = vocab_range(arch, tp)
        # Built on the meta device (kiln.models.loader), nn.Embedding's normal_ init would run torch's
        # Python reference of it, whose wrapper imports torch._dynamo: seconds of a start that serves
        # eagerly while kiln's forward builds. An empty meta weight skips the init.
        weight = torch.empty(num_rows, arch.hidden_size) if torch.get_default_device().type == "meta" else None
        super().__init__(num_rows, arch.hidden_size, _weight=weight)
        self.tp_size = tp.size

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(input_ids)
        local_ids = input_ids - self.vocab_start  # [T]
        mine = (local_ids >= 0) & (local_ids < self.num_embeddings)
        x = F.embedding(torch.where(mine, local_ids, 0), self.weight)  # [T, hidden]
        return torch.ops.kiln.all_reduce(x.masked_fill(~mine.unsqueeze(-1), 0.0))


class LlamaAttention(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int, tp: TensorParallel = SINGLE,
                 kv_index: Optional[int] = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        # The KV cache this layer reads among its stage's (its own index with one stage).
        self.kv_index = layer_idx if kv_index is None else kv_index
        self.tp_size = tp.size
        # This rank's heads: qkv_proj is column-parallel, o_proj row-parallel.
        self.num_heads, self.num_kv_heads = local_num_heads(arch, tp), local_num_kv_heads(arch, tp)
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * arch.head_dim
        self.kv_size = self.num_kv_heads * arch.head_dim
        self.scale = arch.attention_scale
        # Passed to the attention op only when set, so other models' graphs are unchanged.
        self.attn_options = {}
        if arch.window(layer_idx):
            self.attn_options["sliding_window"] = arch.window(layer_idx)
        if arch.attn_logit_softcapping:
            self.attn_options["logit_softcap"] = float(arch.attn_logit_softcapping)
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias)
        # Qwen2 and Qwen2-MoE bias only q/k/v.
        o_bias = arch.attention_bias and not arch.traits.always_qkv_bias and arch.traits.qkv_bias_key is None
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=o_bias)
        self.qk_norm = arch.traits.qk_norm
        if self.qk_norm is not None:
            # Qwen3 / Gemma 3 normalize each head; OLMo-2 the whole projection (one rank only).
            q_dim, k_dim = (arch.head_dim, arch.head_dim) if self.qk_norm == "head" else (self.q_size, self.kv_size)
            self.q_norm = RMSNorm(q_dim, arch.rms_norm_eps, arch.traits.norm)
            self.k_norm = RMSNorm(k_dim, arch.rms_norm_eps, arch.traits.norm)
        # Multi-LoRA (kiln.models.lora.attach_lora): each adds its adapters' term after its linear.
        self.qkv_lora: Optional[nn.Module] = None
        self.o_lora: Optional[nn.Module] = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        if self.qkv_lora is not None:
            qkv = self.qkv_lora(qkv, x)
        if self.qk_norm is None:
            # Heads first, then the split: a view of the whole (contiguous) projection. A view of a
            # row-strided slice makes Inductor guard num_tokens != 1 while lowering it, and every
            # compiled piece then needs a second build for one token.
            heads = qkv.view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
            qk, v = heads.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
            # q and k heads rotate together: one set of elementwise ops instead of two.
            qk = apply_rope(qk, cos, sin_signed)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H, D], [T, KVH, D]
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            if self.qk_norm == "proj":
                q, k = self.q_norm(q), self.k_norm(k)
            q = q.view(-1, self.num_heads, self.head_dim)
            k = k.view(-1, self.num_kv_heads, self.head_dim)
            if self.qk_norm == "head":
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin_signed), apply_rope(k, cos, sin_signed)
            v = v.view(-1, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        # q, k, v are row-strided views (last dim contiguous); the attention kernels take strides.
        o = torch.ops.kiln.attend_paged(q, k, v, self.kv_index, self.scale, **self.attn_options)  # [T, H, D]
        o = o.flatten(1)  # [T, H * D]
        out = self.o_proj(o)  # [T, hidden]: a partial sum over this rank's heads
        if self.o_lora is not None:
            out = self.o_lora(out, o)
        return torch.ops.kiln.all_reduce(out) if self.tp_size > 1 else out


class LlamaMLP(nn.Module):
    """Gated MLP: act(gate) * up with SiLU (SwiGLU) or tanh-approximated GELU (Gemma's GeGLU)."""

    def __init__(self, arch: ArchConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp_size = tp.size
        self.gelu = arch.hidden_act == "gelu_pytorch_tanh"
        inter = local_intermediate_size(arch, tp)  # gate_up_proj column-parallel, down_proj row-parallel
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, arch.hidden_size, bias=False)
        self.gate_up_lora: Optional[nn.Module] = None  # multi-LoRA, as LlamaAttention's
        self.down_lora: Optional[nn.Module] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate / tp]
        if self.gate_up_lora is not None:
            gate_up = self.gate_up_lora(gate_up, x)
        gate, up = gate_up.chunk(2, dim=-1)  # [T, intermediate / tp] each
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        h = act * up
        out = self.down_proj(h)  # [T, hidden]: a partial sum over this rank's rows
        if self.down_lora is not None:
            out = self.down_lora(out, h)
        return torch.ops.kiln.all_reduce(out) if self.tp_size > 1 else out


class LlamaDecoderLayer(nn.Module):
    """Norm placement by family: pre-norm (Llama), sandwich (Gemma: before and after attention and
    MLP) or post-norm (OLMo-2: after only). Norm modules carry their Hugging Face names."""

    def __init__(self, arch: ArchConfig, layer_idx: int, tp: TensorParallel = SINGLE,
                 kv_index: Optional[int] = None) -> None:
        super().__init__()
        traits = arch.traits
        self.placement = "sandwich" if traits.sandwich_norm else "post" if traits.post_norm else "pre"
        self.residual_multiplier = arch.residual_multiplier
        # Gemma 3's sliding layers read the local RoPE table.
        self.local_rope = arch.local_rope_theta is not None and arch.window(layer_idx) > 0
        self.norm_names = {"pre": ("input_layernorm", "post_attention_layernorm"),
                           "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                                        "post_feedforward_layernorm"),
                           "post": ("post_attention_layernorm", "post_feedforward_layernorm")}[self.placement]
        for name in self.norm_names:
            setattr(self, name, RMSNorm(arch.hidden_size, arch.rms_norm_eps, traits.norm))
        self.self_attn = LlamaAttention(arch, layer_idx, tp, kv_index)
        self.mlp = SparseMoeBlock(arch, tp) if is_sparse_layer(arch, layer_idx) else LlamaMLP(arch, tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        if self.placement == "sandwich":
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin_signed))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        if self.placement == "post":
            x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin_signed))
            return x + self.post_feedforward_layernorm(self.mlp(x))
        h = self.self_attn(self.input_layernorm(x), cos, sin_signed)
        x = x + (h * self.residual_multiplier if self.residual_multiplier != 1.0 else h)
        h = self.mlp(self.post_attention_layernorm(x))
        return x + (h * self.residual_multiplier if self.residual_multiplier != 1.0 else h)


class MissingLayer(nn.Identity):
    """Another pipeline stage's layer: no weights, never called (it keeps the global layer indices)."""


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ArchConfig, tp: TensorParallel = SINGLE, stage: PipelineStage = WHOLE) -> None:
        super().__init__()
        check_tensor_parallel(arch, tp.size, tp.experts)
        if tp.size > 1 and arch.traits.qk_norm == "proj":
            raise ValueError(f"{arch.family} normalizes q and k over all heads, which kiln does not split over "
                             "ranks; use parallel.tensor_parallel_size=1")
        self.arch = arch
        self.tp = tp
        self.stage = stage
        self.layer_ids = stage.layers(arch.num_layers)  # global indices of this stage's layers
        # Embedding and LM head hold this rank's vocabulary rows, norms are replicated (kiln.models.parallel).
        # The last stage of a tied model holds the embedding too, as its LM head.
        holds_embedding = stage.is_first or (stage.is_last and arch.tie_word_embeddings)
        self.embed_tokens = VocabParallelEmbedding(arch, tp) if holds_embedding else None
        # Gemma: sqrt(hidden_size); Granite: embedding_multiplier. A buffer in the model dtype: Gemma
        # rounds the scale to it before multiplying, as its transformers code does.
        self.embed_scale = arch.hidden_size**0.5 if arch.traits.scale_embeddings else arch.embedding_multiplier
        if self.embed_scale != 1.0:
            self.register_buffer("embed_scale_tensor", torch.tensor(self.embed_scale), persistent=False)
        first = self.layer_ids.start
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, i, tp, kv_index=i - first) if i in self.layer_ids
                                    else MissingLayer() for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.traits.norm) if stage.is_last else None
        # Tied models read the embedding matrix in compute_logits instead of holding a second Linear.
        _, num_vocab_rows = vocab_range(arch, tp)
        untied_head = stage.is_last and not arch.tie_word_embeddings
        self.lm_head = nn.Linear(arch.hidden_size, num_vocab_rows, bias=False) if untied_head else None
        # A later stage's input, [max_num_tokens, hidden] (bind_stage_input): None on the first.
        self.register_buffer("stage_input", None, persistent=False)
        self.head_weight: torch.Tensor | None = None
        self.head_q8: Q8Head | None = None  # a CPU one-row head (kiln.ops.cpu_linear.prepare_cpu_decode)
        # Not persistent: recomputed from ArchConfig, never loaded from a checkpoint.
        num_positions = arch.context_limit
        self.register_buffer("cos_sin_cache", _rope_table(arch, num_positions), persistent=False)
        if arch.local_rope_theta is not None:
            self.register_buffer("cos_sin_cache_local", _rope_table(arch, num_positions, arch.local_rope_theta),
                                 persistent=False)

    def reset_rope_cache(self) -> None:
        """Recompute the RoPE tables and the embedding scale in place (after ``to_empty`` from the
        meta device)."""
        with torch.no_grad():
            if self.embed_scale != 1.0:
                self.embed_scale_tensor.copy_(torch.tensor(self.embed_scale))
            self.cos_sin_cache.copy_(rope_cos_sin_table(self.arch, self.cos_sin_cache.shape[0]))
            if self.arch.local_rope_theta is not None:
                self.cos_sin_cache_local.copy_(rope_cos_sin_table(self.arch, self.cos_sin_cache_local.shape[0],
                                                                  self.arch.local_rope_theta))

    @staticmethod
    def _cos_sin(table: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos_sin = table.index_select(0, positions).to(dtype)  # [T, R]
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # [T, 1, R/2] each
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)  # [T, 1, R] each

    def bind_stage_input(self, max_num_tokens: int) -> torch.Tensor:
        """Allocate the buffer a stage after the first reads its input rows from (before the model is
        compiled: a captured graph reads it at this address); the runner receives into it."""
        if self.stage.is_first:
            raise RuntimeError("the first pipeline stage embeds its tokens; it takes no stage input")
        param = next(self.parameters())
        buffer = torch.zeros(max_num_tokens, self.arch.hidden_size, dtype=param.dtype, device=param.device)
        self.register_buffer("stage_input", buffer, persistent=False)
        return buffer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens] int64 -> final hidden states [num_tokens, hidden]
        (a stage before the last: its last layer's, without the final norm)."""
        if self.stage.is_first:
            x = self.embed_tokens(input_ids)  # [T, hidden]
            if self.embed_scale != 1.0:
                x = x * self.embed_scale_tensor
        else:
            x = torch.ops.kiln.read_stage_input(self.stage_input, input_ids)  # [T, hidden]: the stage before's
        rope = self._cos_sin(self.cos_sin_cache, positions, x.dtype)
        local = self._cos_sin(self.cos_sin_cache_local, positions, x.dtype) if self.arch.local_rope_theta else rope
        for i in self.layer_ids:
            layer = self.layers[i]
            x = layer(x, *(local if layer.local_rope else rope))
        return self.norm(x) if self.stage.is_last else x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] (only the rows to sample) -> [N, vocab] float32.

        Under tensor parallelism a collective: every rank must call it for the same rows. Only the
        last pipeline stage has the head."""
        if not self.stage.is_last:
            raise RuntimeError(f"pipeline stage {self.stage.rank} of {self.stage.size} has no LM head; "
                               "the last stage computes the logits")
        if self.lm_head is not None and type(self.lm_head) is not nn.Linear:  # quantized (kiln.models.quantize)
            logits = self.lm_head(hidden).to(hidden.dtype)  # [N, this rank's vocab rows]
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            if self.head_weight is not None:  # a CPU copy in the GEMM's dtype (kiln.ops.cpu_linear.prepare_cpu_decode)
                weight = self.head_weight
            logits = head_linear(hidden, weight, self.head_q8)  # [N, this rank's vocab rows]
        if self.tp.size > 1:
            logits = torch.ops.kiln.all_gather(logits)  # [N, padded vocab], ranks in order
            if logits.shape[-1] != self.arch.vocab_size:
                logits = logits[:, :self.arch.vocab_size]  # the padding's columns (zero rows) never sample
        if self.arch.logits_scaling != 1.0:
            logits = logits / self.arch.logits_scaling
        cap = self.arch.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits.float() if self.tp.size == 1 else logits.float().contiguous()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Optional[torch.Tensor]]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up; every parameter must be given.

        Tensors are full (unsharded); under tensor parallelism each rank copies only its slice. A
        tensor stored fused (Phi-3's qkv_proj) may fill several slices of a kiln parameter. A name
        given with None was read into its place already (one of ``weight_destinations``)."""
        targets = self._weight_places()
        self._zero_vocab_padding()
        loaded: set[str] = set()
        for name, tensor in weights:
            if name not in targets:
                if _is_ignorable(name, self.arch) or self._held_by_another_stage(name):
                    continue
                raise ValueError(f"unexpected weight {name!r} for a {self.arch.family} model "
                                 f"with {self.arch.num_layers} layers")
            for dest, shard in targets[name] if tensor is not None else ():
                part = tensor.narrow(*shard) if shard is not None else tensor
                if tuple(dest.shape) != tuple(part.shape):
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, which does not fit "
                                     f"{tuple(dest.shape)}")
                dest.copy_(part)
                del part
            del tensor  # before the next is drawn or read: one full tensor at a time
            loaded.add(name)
        missing = sorted(set(targets) - loaded)
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise ValueError(f"checkpoint lacks {len(missing)} weight(s): {missing[:5]}{more}")

    def weight_names(self) -> set[str]:
        """The checkpoint tensors this model (this rank's shard of this stage) loads."""
        return set(self._weight_places())

    def _held_by_another_stage(self, name: str) -> bool:
        """A tensor of the whole model that another pipeline stage loads (never one of this stage's),
        or, with expert parallelism, an expert another rank holds."""
        if self.tp.experts and ".experts." in name:
            parts = name.split(".experts.", 1)[1].split(".")
            if parts[0].isdigit():
                local = int(parts[0]) * self.tp.size // max(1, self.arch.num_experts or 1)  # its rank
                return local != self.tp.rank
        if self.stage.size == 1:
            return False
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            return True
        parts = name.split(".")
        return (len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
                and int(parts[2]) < self.arch.num_layers and int(parts[2]) not in self.layer_ids)

    def weight_destinations(self) -> dict[str, torch.Tensor]:
        """The checkpoint tensors that land whole in one contiguous place (no shard, no second
        slice): name -> that part of a parameter, which a loader may read the tensor's bytes into."""
        return {name: places[0][0] for name, places in self._weight_places().items()
                if len(places) == 1 and places[0][1] is None and places[0][0].is_contiguous()}

    def _weight_places(self) -> dict[str, list[tuple[torch.Tensor, Shard]]]:
        """``_weight_slices`` grouped by checkpoint name: every (slice, shard) a tensor fills."""
        places: dict[str, list[tuple[torch.Tensor, Shard]]] = {}
        for name, dest, shard in self._weight_slices():
            places.setdefault(name, []).append((dest, shard))
        return places

    def _zero_vocab_padding(self) -> None:
        """Zero the embedding / LM head rows past the vocabulary (no checkpoint tensor fills them)."""
        _, num_real = vocab_shard(self.arch, self.tp)
        for head in (self.embed_tokens, self.lm_head):
            if head is not None:
                head.weight[num_real:].zero_()

    def weight_targets(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, a kiln parameter of that tensor's full shape) once per checkpoint tensor. With
        one rank these are the Hugging Face tensors' shapes, ready for any rank's ``load_weights``."""
        for name, places in self._weight_places().items():
            dests = [dest for dest, _ in places]
            yield name, dests[0] if len(dests) == 1 else torch.cat(dests, dim=0)

    def _weight_slices(self) -> Iterator[tuple[str, torch.Tensor, Shard]]:
        """(HF name, the slice of a kiln parameter it fills, the slice of the HF tensor this rank
        loads or None for all of it); fused weights are row ranges."""
        arch, tp = self.arch, self.tp
        vocab, num_real = vocab_shard(arch, tp)  # this rank's vocab rows; padding rows take no tensor
        if self.embed_tokens is not None:
            yield "model.embed_tokens.weight", self.embed_tokens.weight[:num_real], vocab
        if self.norm is not None:
            yield "model.norm.weight", self.norm.weight, None
        if self.lm_head is not None:
            yield "lm_head.weight", self.lm_head.weight[:num_real], vocab
        heads = head_shards(arch, tp)
        fused = arch.traits.fused_checkpoint
        full_q, full_kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        for i in self.layer_ids:
            layer = self.layers[i]
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            q, kv = attn.q_size, attn.kv_size
            rows = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
            # Where each projection starts in a fused checkpoint tensor (Phi-3's qkv_proj).
            fused_start = {"q_proj": 0, "k_proj": full_q, "v_proj": full_q + full_kv}
            for proj, (start, end) in rows.items():
                for kind, param in (("weight", attn.qkv_proj.weight), ("bias", attn.qkv_proj.bias)):
                    if param is None:
                        continue
                    if fused:
                        src = heads[proj] or (0, 0, end - start)
                        yield f"{p}self_attn.qkv_proj.{kind}", param[start:end], (0, fused_start[proj] + src[1], src[2])
                    else:
                        yield f"{p}self_attn.{proj}.{kind}", param[start:end], heads[proj]
            yield f"{p}self_attn.o_proj.weight", attn.o_proj.weight, row_shard(arch.num_heads * arch.head_dim, tp)
            if attn.o_proj.bias is not None:
                yield f"{p}self_attn.o_proj.bias", attn.o_proj.bias, None
            if attn.qk_norm is not None:
                yield f"{p}self_attn.q_norm.weight", attn.q_norm.weight, None
                yield f"{p}self_attn.k_norm.weight", attn.k_norm.weight, None
            inter = mlp.down_proj.in_features if not isinstance(mlp, SparseMoeBlock) else 0
            col, row = column_shard(arch.intermediate_size, tp), row_shard(arch.intermediate_size, tp)
            if isinstance(mlp, SparseMoeBlock):  # every expert cut along its intermediate dimension
                yield from mlp.weight_slices(p)
            elif fused:
                gate = col or (0, 0, inter)
                yield f"{p}mlp.gate_up_proj.weight", mlp.gate_up_proj.weight[:inter], gate
                yield f"{p}mlp.gate_up_proj.weight", mlp.gate_up_proj.weight[inter:], \
                    (0, arch.intermediate_size + gate[1], gate[2])
            else:
                yield f"{p}mlp.gate_proj.weight", mlp.gate_up_proj.weight[:inter], col
                yield f"{p}mlp.up_proj.weight", mlp.gate_up_proj.weight[inter:], col
            if not isinstance(mlp, SparseMoeBlock):
                yield f"{p}mlp.down_proj.weight", mlp.down_proj.weight, row
            for norm in layer.norm_names:
                yield f"{p}{norm}.weight", getattr(layer, norm).weight, None


def _is_ignorable(name: str, arch: ArchConfig) -> bool:
    # Old checkpoints store RoPE buffers; tied ones sometimes keep a copy of the embedding as lm_head.
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and arch.tie_word_embeddings)
