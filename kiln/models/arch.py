"""Architecture description of a Llama-family model: ``ArchConfig`` and the random-weight presets.

``ArchConfig`` is the one place where a Hugging Face ``config.json`` is read and written, so the
model code never sees a transformers config object. Rules kept here:
- Only the families kiln implements are accepted (llama, qwen2, mistral; mixture of experts:
  mixtral, qwen2_moe, qwen3_moe); anything the model would
  silently compute wrong (another activation, MLP bias, an unknown RoPE scaling) is refused.
- Sliding-window attention is not implemented, so a model that uses one gets its context capped to
  the window: within it, full attention and windowed attention agree exactly.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Optional

FAMILIES = ("llama", "qwen2", "mistral")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
# Mixture-of-experts families (kiln.models.moe): Mixtral always renormalizes the top-k weights;
# Qwen2-MoE adds a sigmoid-gated shared expert; Qwen3-MoE adds q/k RMSNorm.
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
FAMILIES += MOE_FAMILIES
_ARCHITECTURES.update(mixtral="MixtralForCausalLM", qwen2_moe="Qwen2MoeForCausalLM", qwen3_moe="Qwen3MoeForCausalLM")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class ArchConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # None, or llama3 style (rope_type, factor, ...)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    bos_token_id: Optional[int] = None
    eos_token_id: tuple[int, ...] = ()
    family: str = "llama"
    # Mixture of experts (MOE_FAMILIES only): layer i is sparse unless i is in mlp_only_layers or
    # (i + 1) is not a multiple of decoder_sparse_step; dense layers use intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert, 0 = none
    norm_topk_prob: bool = False  # renormalize the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"ArchConfig.family={self.family!r} is not supported; choose one of {list(FAMILIES)}")
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        _check_moe(self)
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        eos = self.eos_token_id
        eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(int(e) for e in eos)
        object.__setattr__(self, "eos_token_id", eos)
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", _check_rope_scaling(self.rope_scaling))

    def __hash__(self) -> int:
        # rope_scaling is a dict, so the generated hash would fail; hash a canonical text instead.
        return hash(json.dumps(dataclasses.asdict(self), sort_keys=True))

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> "ArchConfig":
        """Read a Hugging Face ``config.json`` dict (transformers 4 or 5 layout)."""
        family = d.get("model_type")
        if family not in FAMILIES:
            raise ValueError(f"model_type {family!r} is not supported; kiln implements {list(FAMILIES)}")
        act = d.get("hidden_act", "silu")
        if act != "silu" or d.get("mlp_bias", False):
            raise ValueError(f"only SwiGLU MLPs without bias are supported (hidden_act={act!r}, mlp_bias={d.get('mlp_bias')})")
        num_heads = d["num_attention_heads"]
        rope_theta, rope_scaling = _read_rope(d)
        moe = _read_moe(d, family)
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            max_position_embeddings=_context_len(d, family),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v bias; Qwen2-MoE unless qkv_bias=false.
            attention_bias=(d.get("qkv_bias", True) if family in ("qwen2", "qwen2_moe")
                            else d.get("attention_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            family=family,
            **moe,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A ``config.json`` dict that transformers loads as the matching *ForCausalLM."""
        d: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.family]],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if len(self.eos_token_id) != 1 else self.eos_token_id[0],
        }
        if self.family == "qwen2":
            if self.head_dim * self.num_heads != self.hidden_size or not self.attention_bias:
                raise ValueError("a qwen2 config.json always means qkv bias and head_dim = hidden_size // num_heads")
            d.update(use_sliding_window=False, sliding_window=None)
        else:
            d.update(head_dim=self.head_dim, attention_bias=self.attention_bias, mlp_bias=False)
        if self.family == "mistral":
            d["sliding_window"] = None  # transformers' Mistral default is a 4096 window
        if self.family in MOE_FAMILIES:
            d.update(_moe_hf_fields(self))
        return d


def _check_rope_scaling(rs: dict) -> dict:
    rope_type = rs.get("rope_type", rs.get("type"))
    if rope_type != "llama3":
        raise ValueError(f"rope scaling type {rope_type!r} is not supported; kiln implements 'llama3' (or none)")
    missing = [k for k in _LLAMA3_ROPE_KEYS if k not in rs]
    if missing:
        raise ValueError(f"llama3 rope scaling lacks {missing}")
    out = {k: float(rs[k]) for k in _LLAMA3_ROPE_KEYS}
    out["original_max_position_embeddings"] = int(rs["original_max_position_embeddings"])
    out["rope_type"] = "llama3"
    return out


def _read_rope(d: dict[str, Any]) -> tuple[float, Optional[dict]]:
    """(rope_theta, llama3 scaling or None) from either ``rope_parameters`` (v5) or the legacy keys."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    return theta, _check_rope_scaling(params)


def _context_len(d: dict[str, Any], family: str) -> int:
    max_pos = d.get("max_position_embeddings", 2048)
    window = d.get("sliding_window")
    uses_window = (d.get("use_sliding_window", False) if family in ("qwen2", "qwen2_moe", "qwen3_moe")
                   else family in ("mistral", "mixtral"))
    if uses_window and window:
        return min(max_pos, window)
    return max_pos


def _read_moe(d: dict[str, Any], family: str) -> dict[str, Any]:
    """The ArchConfig fields of a mixture-of-experts ``config.json``; {} for dense families."""
    if family not in MOE_FAMILIES:
        return {}
    if family == "qwen3_moe" and d.get("attention_bias", False):
        raise ValueError("qwen3_moe with attention_bias=true (bias on o_proj too) is not supported")
    num_experts = d.get("num_experts") or d.get("num_local_experts") or 0
    out = dict(
        num_experts=num_experts,
        num_experts_per_tok=d.get("num_experts_per_tok", 0),
        decoder_sparse_step=d.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
        norm_topk_prob=d.get("norm_topk_prob", False),
    )
    if family == "mixtral":  # every layer sparse, experts of intermediate_size, top-k renormalized
        out.update(moe_intermediate_size=d["intermediate_size"], norm_topk_prob=True)
    else:
        out.update(moe_intermediate_size=d["moe_intermediate_size"])
    if family == "qwen2_moe":
        out.update(shared_expert_intermediate_size=d["shared_expert_intermediate_size"])
    if family == "qwen3_moe":
        out.update(qk_norm=True)
    return out


def _moe_hf_fields(arch: "ArchConfig") -> dict[str, Any]:
    d: dict[str, Any] = dict(num_experts_per_tok=arch.num_experts_per_tok, head_dim=arch.head_dim)
    if arch.family == "mixtral":
        d.update(num_local_experts=arch.num_experts, intermediate_size=arch.moe_intermediate_size,
                 sliding_window=None, router_jitter_noise=0.0)
        return d
    d.update(num_experts=arch.num_experts, moe_intermediate_size=arch.moe_intermediate_size,
             norm_topk_prob=arch.norm_topk_prob, decoder_sparse_step=arch.decoder_sparse_step,
             mlp_only_layers=list(arch.mlp_only_layers), use_sliding_window=False, sliding_window=None)
    if arch.family == "qwen2_moe":
        d.update(shared_expert_intermediate_size=arch.shared_expert_intermediate_size, qkv_bias=arch.attention_bias)
    return d


def _check_moe(arch: "ArchConfig") -> None:
    if arch.family not in MOE_FAMILIES:
        if arch.num_experts:
            raise ValueError(f"family {arch.family!r} has no experts; experts need one of {list(MOE_FAMILIES)}")
        return
    if arch.num_experts < 1 or not 1 <= arch.num_experts_per_tok <= arch.num_experts:
        raise ValueError(f"{arch.family}: need num_experts >= 1 and 1 <= num_experts_per_tok <= num_experts "
                         f"(got {arch.num_experts}, {arch.num_experts_per_tok})")
    if arch.moe_intermediate_size < 1 or arch.decoder_sparse_step < 1:
        raise ValueError(f"{arch.family}: moe_intermediate_size and decoder_sparse_step must be >= 1")
    if arch.family == "mixtral" and (not arch.norm_topk_prob or arch.moe_intermediate_size != arch.intermediate_size):
        raise ValueError("mixtral: experts have intermediate_size and always renormalize the top-k weights")
    if (arch.family == "qwen2_moe") != (arch.shared_expert_intermediate_size > 0):
        raise ValueError("a shared expert (shared_expert_intermediate_size > 0) is Qwen2-MoE's, and it always has one")
    if arch.qk_norm != (arch.family == "qwen3_moe"):
        raise ValueError("among the MoE families, q/k RMSNorm is Qwen3-MoE's, and it always has it")


def is_sparse_layer(arch: "ArchConfig", layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` is a mixture of experts (transformers' rule for Qwen2/3-MoE)."""
    return (arch.num_experts > 0 and layer_idx not in arch.mlp_only_layers
            and (layer_idx + 1) % arch.decoder_sparse_step == 0)


_LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA3_VOCAB = dict(vocab_size=128256, bos_token_id=128000, eos_token_id=(128001, 128009))
_SMOL_VOCAB = dict(vocab_size=49152, bos_token_id=1, eos_token_id=(2,))

# Real shapes with random weights, for benchmarks and tests (``random:<preset>``).
PRESETS: dict[str, ArchConfig] = {
    "tiny": ArchConfig(
        hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True, **_SMOL_VOCAB,
    ),
    "tiny-qwen2": ArchConfig(
        hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
        attention_bias=True, family="qwen2", **_SMOL_VOCAB,
    ),
    "qwen2.5-0.5b": ArchConfig(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
        num_kv_heads=2, head_dim=64, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=True, attention_bias=True, bos_token_id=151643, eos_token_id=(151645,),
        family="qwen2",
    ),
    "llama3-8b": ArchConfig(
        hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE, **_LLAMA3_VOCAB,
    ),
    "llama3-70b": ArchConfig(
        hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
        max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE, **_LLAMA3_VOCAB,
    ),
}


_QWEN_VOCAB = dict(vocab_size=151936, bos_token_id=151643)
PRESETS.update({
    # Mixtral-8x7B: 46.7B parameters (about 93 GB in bf16, more than one 80 GB card holds).
    "mixtral-8x7b": ArchConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, max_position_embeddings=32768, rope_theta=1e6, bos_token_id=1, eos_token_id=(2,),
        family="mixtral", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336, norm_topk_prob=True,
    ),
    # Qwen1.5-MoE-A2.7B (Qwen2-MoE): 60 experts, top-4 unnormalized, one gated shared expert.
    "qwen1.5-moe-a2.7b": ArchConfig(
        hidden_size=2048, intermediate_size=5632, num_layers=24, num_heads=16, num_kv_heads=16, head_dim=128,
        max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=1e6, attention_bias=True,
        eos_token_id=(151643,), family="qwen2_moe", num_experts=60, num_experts_per_tok=4,
        moe_intermediate_size=1408, shared_expert_intermediate_size=5632, **_QWEN_VOCAB,
    ),
    # Qwen3-30B-A3B: 128 experts, top-8 renormalized, q/k RMSNorm.
    "qwen3-30b-a3b": ArchConfig(
        hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6, eos_token_id=(151645,),
        family="qwen3_moe", num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        norm_topk_prob=True, qk_norm=True, **_QWEN_VOCAB,
    ),
})
