"""Architecture description of a Llama-family model: ``ArchConfig`` and the random-weight presets.

``ArchConfig`` is the one place where a Hugging Face ``config.json`` is read and written, so the
model code never sees a transformers config object. Rules kept here:
- Only the families kiln implements are accepted (llama, qwen2, mistral); anything the model would
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

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"ArchConfig.family={self.family!r} is not supported; choose one of {list(FAMILIES)}")
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
            attention_bias=True if family == "qwen2" else d.get("attention_bias", False),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            family=family,
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
    uses_window = d.get("use_sliding_window", False) if family == "qwen2" else family == "mistral"
    if uses_window and window:
        return min(max_pos, window)
    return max_pos


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

