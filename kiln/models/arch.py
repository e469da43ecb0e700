"""Architecture description of a native model: ``ArchConfig``, the family traits and the presets.

``ArchConfig`` is the one place where a Hugging Face ``config.json`` is read and written, so the
model code never sees a transformers config object. Rules kept here:
- Only the families kiln implements natively are accepted (``FAMILIES``); anything the model would
  silently compute wrong (another activation, MLP bias, an unknown RoPE scaling, bidirectional
  attention) is refused with a ValueError that names the setting.
- What differs between families is either a number of the checkpoint (kept as a field, so it
  round-trips through ``config.json``) or a fixed trait of the family (``FamilyTraits``).
- Mixture-of-experts families (``MOE_FAMILIES``: Mixtral, Qwen2-MoE, Qwen3-MoE) add the expert
  fields; ``is_sparse_layer`` says which layers route to experts (``kiln.models.moe``).
- Sliding-window attention is real: each layer's window comes from ``layer_types`` and
  ``sliding_window``, and the attention kernels mask keys outside it (no context cap).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class FamilyTraits:
    """What a family does that no ``config.json`` number says."""

    architecture: str  # the transformers *ForCausalLM class name
    qk_norm: Optional[str] = None  # "head": RMSNorm per head (Qwen3, Gemma 3); "proj": over all heads (OLMo-2)
    norm: str = "llama"  # RMSNorm numerics: "llama" (w * x.to(dtype)), "olmo" ((w * x).to(dtype)), "gemma" ((1 + w) * x)
    sandwich_norm: bool = False  # Gemma 2/3: norms before and after attention and MLP
    post_norm: bool = False  # OLMo-2: norms after attention and MLP only (none before)
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    fused_checkpoint: bool = False  # Phi-3: qkv_proj and gate_up_proj are stored fused
    window_on_all_layers: bool = False  # Mistral, Phi-3: `sliding_window` applies to every layer
    always_qkv_bias: bool = False  # Qwen2
    qkv_bias_key: Optional[str] = None  # Qwen2-MoE: config.json's `qkv_bias` (default true) sets the bias


TRAITS: dict[str, FamilyTraits] = {
    "llama": FamilyTraits("LlamaForCausalLM"),
    "mistral": FamilyTraits("MistralForCausalLM", window_on_all_layers=True),
    "qwen2": FamilyTraits("Qwen2ForCausalLM", always_qkv_bias=True),
    "qwen3": FamilyTraits("Qwen3ForCausalLM", qk_norm="head"),
    "gemma2": FamilyTraits("Gemma2ForCausalLM", norm="gemma", sandwich_norm=True, scale_embeddings=True),
    "gemma3_text": FamilyTraits("Gemma3ForCausalLM", qk_norm="head", norm="gemma", sandwich_norm=True,
                                scale_embeddings=True),
    "phi3": FamilyTraits("Phi3ForCausalLM", fused_checkpoint=True, window_on_all_layers=True),
    "olmo2": FamilyTraits("Olmo2ForCausalLM", qk_norm="proj", norm="olmo", post_norm=True),
    "granite": FamilyTraits("GraniteForCausalLM"),
    # Mixture of experts (kiln.models.moe): Mixtral always renormalizes the top-k weights; Qwen2-MoE
    # adds a sigmoid-gated shared expert; Qwen3-MoE adds q/k RMSNorm.
    "mixtral": FamilyTraits("MixtralForCausalLM", window_on_all_layers=True),
    "qwen2_moe": FamilyTraits("Qwen2MoeForCausalLM", qkv_bias_key="qkv_bias"),
    "qwen3_moe": FamilyTraits("Qwen3MoeForCausalLM", qk_norm="head"),
}
FAMILIES = tuple(TRAITS)
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
# Families whose config.json windows layers only with use_sliding_window=true (from max_window_layers on).
_QWEN_WINDOWED = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
# Per family, the key of config.json that names the MLP activation (Gemma's is hidden_activation).
_ACT_KEY = {"gemma2": "hidden_activation", "gemma3_text": "hidden_activation"}
_DEFAULT_ACT = {"gemma2": "gelu_pytorch_tanh", "gemma3_text": "gelu_pytorch_tanh"}
# config.json keys of each RoPE type, beyond rope_type and rope_theta (None: optional).
ROPE_KEYS: dict[str, dict[str, bool]] = {
    "linear": {"factor": True},
    "dynamic": {"factor": True},
    "llama3": {"factor": True, "low_freq_factor": True, "high_freq_factor": True,
               "original_max_position_embeddings": True},
    "yarn": {"factor": True, "original_max_position_embeddings": True, "attention_factor": False,
             "beta_fast": False, "beta_slow": False, "mscale": False, "mscale_all_dim": False, "truncate": False},
    "longrope": {"short_factor": True, "long_factor": True, "original_max_position_embeddings": True,
                 "factor": False, "attention_factor": False},
}


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
    rope_scaling: Optional[dict] = None  # None, or {"rope_type": linear|dynamic|llama3|yarn|longrope, ...}
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2 always)
    bos_token_id: Optional[int] = None
    eos_token_id: tuple[int, ...] = ()
    family: str = "llama"
    hidden_act: str = "silu"  # the gate's activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    partial_rotary_factor: float = 1.0  # rotate only the first head_dim * factor dims (Phi-4-mini)
    # Attention: windows, scale and soft-capping.
    sliding_window: Optional[int] = None  # keys a windowed query sees, itself included
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" | "sliding_attention"; () = derived
    local_rope_theta: Optional[float] = None  # Gemma 3: unscaled RoPE with this base on sliding layers
    query_pre_attn_scalar: Optional[float] = None  # Gemma: scale = query_pre_attn_scalar ** -0.5
    attn_logit_softcapping: Optional[float] = None  # Gemma 2: scores = cap * tanh(scores / cap)
    final_logit_softcapping: Optional[float] = None  # Gemma 2: logits = cap * tanh(logits / cap)
    # Granite's multipliers.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: Optional[float] = None  # the attention scale itself
    logits_scaling: float = 1.0  # logits are divided by it
    # Mixture of experts (MOE_FAMILIES only): layer i is sparse unless i is in mlp_only_layers or
    # (i + 1) is not a multiple of decoder_sparse_step; dense layers use intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert, 0 = none
    norm_topk_prob: bool = False  # renormalize the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"ArchConfig.family={self.family!r} is not supported; choose one of {list(FAMILIES)}")
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        _check_moe(self)
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.rotary_dim % 2 != 0 or self.rotary_dim <= 0:
            raise ValueError(f"rotary dims {self.rotary_dim} (head_dim={self.head_dim} times "
                             f"partial_rotary_factor={self.partial_rotary_factor}) must be even and positive")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported; kiln implements {list(ACTIVATIONS)}")
        eos = self.eos_token_id
        eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(int(e) for e in eos)
        object.__setattr__(self, "eos_token_id", eos)
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", check_rope_scaling(self.rope_scaling))
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window={self.sliding_window} must be positive (or None)")
        types = tuple(self.layer_types) or self._default_layer_types()
        if len(types) != self.num_layers or not set(types) <= set(LAYER_TYPES):
            raise ValueError(f"layer_types must give one of {list(LAYER_TYPES)} per layer ({self.num_layers}), "
                             f"got {list(types)}")
        if "sliding_attention" in types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        # Canonical form: () when the family's default says the same, so equal configs compare equal.
        object.__setattr__(self, "layer_types", () if types == self._default_layer_types() else types)

    def __hash__(self) -> int:
        # rope_scaling is a dict, so the generated hash would fail; hash a canonical text instead.
        return hash(json.dumps(dataclasses.asdict(self), sort_keys=True))

    @property
    def traits(self) -> FamilyTraits:
        return TRAITS[self.family]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def _default_layer_types(self) -> tuple[str, ...]:
        windowed = self.sliding_window is not None and self.traits.window_on_all_layers
        return ("sliding_attention" if windowed else "full_attention",) * self.num_layers

    @property
    def all_layer_types(self) -> tuple[str, ...]:
        """One of LAYER_TYPES per layer (``layer_types`` is () where the family default holds)."""
        return self.layer_types or self._default_layer_types()

    def window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window in keys (itself included), 0 for full attention."""
        return self.sliding_window if self.all_layer_types[layer] == "sliding_attention" else 0

    @property
    def attention_scale(self) -> float:
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        if self.query_pre_attn_scalar is not None:
            return self.query_pre_attn_scalar ** -0.5
        return self.head_dim ** -0.5

    @property
    def context_limit(self) -> int:
        """The longest context kiln computes as transformers does: dynamic NTK RoPE changes the
        frequencies of every cached key once a sequence passes the trained length, which a paged
        cache cannot redo, so such a model is served up to that length (where it is exact)."""
        rs = self.rope_scaling
        if rs is not None and rs["rope_type"] == "dynamic":
            return min(self.max_position_embeddings, rs.get("original_max_position_embeddings",
                                                            self.max_position_embeddings))
        return self.max_position_embeddings

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> "ArchConfig":
        """Read a Hugging Face ``config.json`` dict (transformers 4 or 5 layout)."""
        family = d.get("model_type")
        if family not in FAMILIES:
            raise ValueError(f"model_type {family!r} is not supported natively; kiln implements {list(FAMILIES)}")
        traits = TRAITS[family]
        act = d.get(_ACT_KEY.get(family, "hidden_act")) or d.get("hidden_act") or _DEFAULT_ACT.get(family, "silu")
        if act not in ACTIVATIONS or d.get("mlp_bias", False):
            raise ValueError(f"only gated MLPs ({list(ACTIVATIONS)}) without bias are supported "
                             f"(activation={act!r}, mlp_bias={d.get('mlp_bias')})")
        if d.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=true (an encoder) is not supported; kiln serves decoders")
        num_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
        rope_theta, rope_scaling, partial, local_theta = _read_rope(d, family)
        window = d.get("sliding_window")
        if family in _QWEN_WINDOWED and not d.get("use_sliding_window", False):
            window = None
        layer_types = tuple(d.get("layer_types") or ())
        if window is None:
            layer_types = ()  # transformers ignores sliding layer types without a window
        elif not layer_types:
            layer_types = _default_layer_types(d, family, window)
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=d.get("tie_word_embeddings", family in ("gemma2", "gemma3_text")),
            attention_bias=(True if traits.always_qkv_bias
                            else bool(d.get(traits.qkv_bias_key, True)) if traits.qkv_bias_key
                            else bool(d.get("attention_bias", False))),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            family=family,
            hidden_act=act,
            partial_rotary_factor=partial,
            sliding_window=window,
            layer_types=layer_types,
            local_rope_theta=local_theta,
            query_pre_attn_scalar=d.get("query_pre_attn_scalar") if family.startswith("gemma") else None,
            attn_logit_softcapping=d.get("attn_logit_softcapping") if family.startswith("gemma") else None,
            final_logit_softcapping=d.get("final_logit_softcapping") if family.startswith("gemma") else None,
            embedding_multiplier=d.get("embedding_multiplier", 1.0) if family == "granite" else 1.0,
            residual_multiplier=d.get("residual_multiplier", 1.0) if family == "granite" else 1.0,
            attention_multiplier=d.get("attention_multiplier") if family == "granite" else None,
            logits_scaling=d.get("logits_scaling", 1.0) if family == "granite" else 1.0,
            **_read_moe(d, family),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A ``config.json`` dict that transformers loads as the matching *ForCausalLM."""
        family = self.family
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope.update(self.rope_scaling)
        if self.partial_rotary_factor != 1.0:
            rope["partial_rotary_factor"] = self.partial_rotary_factor
        d: dict[str, Any] = {
            "architectures": [self.traits.architecture],
            "model_type": family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            _ACT_KEY.get(family, "hidden_act"): self.hidden_act,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if len(self.eos_token_id) != 1 else self.eos_token_id[0],
            "head_dim": self.head_dim,
            "attention_bias": self.attention_bias,
        }
        if family not in ("llama", "olmo2", "granite"):
            d["sliding_window"] = self.sliding_window
        if family == "qwen2" and (not self.attention_bias or self.head_dim * self.num_heads != self.hidden_size):
            raise ValueError("a qwen2 config.json always means qkv bias and head_dim = hidden_size // num_heads")
        if family in _QWEN_WINDOWED:
            uses = self.sliding_window is not None
            d.update(use_sliding_window=uses, max_window_layers=self._first_sliding_layer() if uses else 0)
        if family not in ("mistral", "phi3", "mixtral"):  # those window every layer and have no layer_types
            d["layer_types"] = list(self.all_layer_types)
        elif self.sliding_window is not None and "full_attention" in self.all_layer_types:
            raise ValueError(f"a {family} config.json cannot say which layers are windowed")
        if family in ("llama", "granite"):
            d["mlp_bias"] = False
        if family.startswith("gemma"):
            d.update(query_pre_attn_scalar=self.query_pre_attn_scalar,
                     attn_logit_softcapping=self.attn_logit_softcapping,
                     final_logit_softcapping=self.final_logit_softcapping)
        if family == "gemma3_text":
            local = {"rope_type": "default", "rope_theta": self.local_rope_theta or self.rope_theta}
            d["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
            d["rope_local_base_freq"] = local["rope_theta"]
        if family == "granite":
            d.update(embedding_multiplier=self.embedding_multiplier, residual_multiplier=self.residual_multiplier,
                     attention_multiplier=self.attention_scale, logits_scaling=self.logits_scaling)
        if family == "phi3" and self.rope_scaling and "original_max_position_embeddings" in self.rope_scaling:
            d["original_max_position_embeddings"] = self.rope_scaling["original_max_position_embeddings"]
        if family in MOE_FAMILIES:
            d.update(_moe_hf_fields(self))
        return d

    def _first_sliding_layer(self) -> int:
        types = self.all_layer_types
        first = types.index("sliding_attention")
        if any(t != "sliding_attention" for t in types[first:]):
            raise ValueError("a qwen config.json windows the layers from max_window_layers on, not others")
        return first


def check_rope_scaling(rs: dict) -> dict:
    """A RoPE scaling dict in kiln's normal form (rope_type and exactly the keys it uses), or a
    ValueError that names the type or key."""
    rope_type = rs.get("rope_type", rs.get("type"))
    if rope_type not in ROPE_KEYS:
        raise ValueError(f"rope scaling type {rope_type!r} is not supported; kiln implements "
                         f"{sorted(ROPE_KEYS)} (or none)")
    keys = ROPE_KEYS[rope_type]
    missing = [k for k, required in keys.items() if required and rs.get(k) is None]
    if missing:
        raise ValueError(f"{rope_type} rope scaling lacks {missing}")
    out: dict[str, Any] = {"rope_type": rope_type}
    for k in keys:
        v = rs.get(k)
        if v is None:
            continue
        if k == "original_max_position_embeddings":
            v = int(v)
        elif k in ("short_factor", "long_factor"):
            v = [float(x) for x in v]
        elif k != "truncate":
            v = float(v)
        out[k] = v
    return out


def _read_rope(d: dict[str, Any], family: str) -> tuple[float, Optional[dict], float, Optional[float]]:
    """(rope_theta, scaling or None, partial_rotary_factor, local theta or None) from either
    ``rope_parameters`` (transformers 5) or the legacy keys."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    local_theta = None
    if family == "gemma3_text":
        if "full_attention" in params or "sliding_attention" in params:
            local = params.get("sliding_attention") or {}
            if local.get("rope_type", local.get("type", "default")) != "default":
                raise ValueError("gemma3 sliding layers with RoPE scaling are not supported")
            local_theta = float(local.get("rope_theta", d.get("rope_local_base_freq", 10000.0)))
            params = params.get("full_attention") or {}
        else:
            local_theta = float(d.get("rope_local_base_freq", 10000.0))
        default_theta = 1e6
    else:
        default_theta = 10000.0
    theta = float(params.get("rope_theta", d.get("rope_theta", default_theta)))
    partial = float(params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) or 1.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None, partial, local_theta
    params = dict(params, rope_type=rope_type)
    if rope_type in ("llama3", "yarn", "longrope"):
        # Phi-3 keeps the trained length outside the rope dict, and it takes precedence there.
        original = d.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = original or d.get("max_position_embeddings", 2048)
    return theta, check_rope_scaling(params), partial, local_theta


def _default_layer_types(d: dict[str, Any], family: str, window: int) -> tuple[str, ...]:
    """layer_types as transformers derives them for a config.json that lacks the key."""
    n = d["num_hidden_layers"]
    if family in _QWEN_WINDOWED:
        first = d.get("max_window_layers", 28)
        return tuple("sliding_attention" if i >= first else "full_attention" for i in range(n))
    if family in ("gemma2", "gemma3_text"):
        pattern = d.get("sliding_window_pattern", 2 if family == "gemma2" else 6)
        return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n))
    if TRAITS[family].window_on_all_layers:
        return ("sliding_attention",) * n
    return ()  # llama, olmo2, granite: no windows


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
    return out


def _moe_hf_fields(arch: "ArchConfig") -> dict[str, Any]:
    d: dict[str, Any] = dict(num_experts_per_tok=arch.num_experts_per_tok)
    if arch.family == "mixtral":
        d.update(num_local_experts=arch.num_experts, intermediate_size=arch.moe_intermediate_size,
                 router_jitter_noise=0.0)
        return d
    d.update(num_experts=arch.num_experts, moe_intermediate_size=arch.moe_intermediate_size,
             norm_topk_prob=arch.norm_topk_prob, decoder_sparse_step=arch.decoder_sparse_step,
             mlp_only_layers=list(arch.mlp_only_layers))
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


def is_sparse_layer(arch: "ArchConfig", layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` is a mixture of experts (transformers' rule for Qwen2/3-MoE)."""
    return (arch.num_experts > 0 and layer_idx not in arch.mlp_only_layers
            and (layer_idx + 1) % arch.decoder_sparse_step == 0)


_LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA3_VOCAB = dict(vocab_size=128256, bos_token_id=128000, eos_token_id=(128001, 128008, 128009))
_SMOL_VOCAB = dict(vocab_size=49152, bos_token_id=1, eos_token_id=(2,))


def _alternating(num_layers: int, pattern: int) -> tuple[str, ...]:
    """Gemma's layer types: every ``pattern``-th layer full, the others windowed."""
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers))


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
    "qwen3-8b": ArchConfig(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8,
        head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6, bos_token_id=151643,
        eos_token_id=(151645,), family="qwen3",
    ),
    "gemma2-9b": ArchConfig(
        vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_layers=42, num_heads=16, num_kv_heads=8,
        head_dim=256, max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=2, eos_token_id=(1, 107), family="gemma2", hidden_act="gelu_pytorch_tanh", sliding_window=4096,
        layer_types=_alternating(42, 2), query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    ),
    "gemma3-12b": ArchConfig(
        vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_layers=48, num_heads=16, num_kv_heads=8,
        head_dim=256, max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1e6,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, tie_word_embeddings=True, bos_token_id=2,
        eos_token_id=(1, 106), family="gemma3_text", hidden_act="gelu_pytorch_tanh", sliding_window=1024,
        layer_types=_alternating(48, 6), local_rope_theta=10000.0, query_pre_attn_scalar=256,
    ),
    "phi3-mini": ArchConfig(  # Phi-3-mini-4k: head_dim 96, every layer windowed to 2047 keys
        vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_layers=32, num_heads=32, num_kv_heads=32,
        head_dim=96, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1,
        eos_token_id=(32000, 32007), family="phi3", sliding_window=2047,
    ),
    "phi4-mini": ArchConfig(  # Phi-4-mini: LongRoPE, three quarters of each head rotated
        vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_layers=32, num_heads=24, num_kv_heads=8,
        head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": 4096,
                      "short_factor": [1.0] * 48, "long_factor": [1.0 + i / 8 for i in range(48)]},
        tie_word_embeddings=True, bos_token_id=199999, eos_token_id=(199999, 200020), family="phi3",
        partial_rotary_factor=0.75,
    ),
    "olmo2-7b": ArchConfig(
        vocab_size=100352, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32, num_kv_heads=32,
        head_dim=128, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=500000.0, bos_token_id=None,
        eos_token_id=(100257,), family="olmo2",
    ),
    "granite3-8b": ArchConfig(
        vocab_size=49155, hidden_size=4096, intermediate_size=12800, num_layers=40, num_heads=32, num_kv_heads=8,
        head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=10_000_000.0,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=(0,), family="granite", embedding_multiplier=12.0,
        residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=16.0,
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
        norm_topk_prob=True, **_QWEN_VOCAB,
    ),
})
