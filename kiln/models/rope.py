"""RoPE frequencies of every scaling type kiln serves, as transformers' rope init computes them.

``rope_inv_freq(arch)`` gives the inverse frequencies and the cos/sin scale (YaRN's and LongRoPE's
attention factor); ``rope_cos_sin_table`` the per-position table the model indexes. Types:
default, linear, llama3, YaRN and LongRoPE as transformers defines them; dynamic NTK only up to
the trained length (``ArchConfig.context_limit``), where it equals the default.

LongRoPE (Phi-3) uses the short factors for positions below ``original_max_position_embeddings``
and the long ones from there on. That is transformers' rotary for a cached step; but transformers'
Phi-3 ``generate`` additionally drops its cache once a sequence passes that length and recomputes
every earlier position with the long factors, which a paged cache does not redo. So kiln matches
transformers exactly while a sequence stays within the trained length (4096 for Phi-3-mini-128k),
and past it differs for the keys cached before the crossing.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from kiln.models.arch import ArchConfig


def rope_inv_freq(arch: ArchConfig, long: bool = False, theta: Optional[float] = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim // 2] float32, cos/sin scale), as transformers' rope init
    computes them. ``long``: LongRoPE's long factors (positions past the trained length).
    ``theta``: an unscaled table with this base (Gemma 3's sliding layers)."""
    dim = arch.rotary_dim
    base = arch.rope_theta if theta is None else theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = arch.rope_scaling
    if rs is None or theta is not None:
        return inv_freq, 1.0
    kind = rs["rope_type"]
    if kind == "linear":
        return inv_freq / rs["factor"], 1.0
    if kind == "dynamic":
        return inv_freq, 1.0  # exact up to the trained length, which ``context_limit`` keeps to
    if kind == "llama3":
        # Llama 3.1: stretch low frequencies by `factor`, keep high ones, blend in between.
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_len = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(arch, base, dim, rs)
    # longrope
    factor = rs.get("factor") or arch.max_position_embeddings / rs["original_max_position_embeddings"]
    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        old_len = rs["original_max_position_embeddings"]
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    ext = torch.tensor(rs["long_factor" if long else "short_factor"], dtype=torch.float32)
    if ext.numel() != dim // 2:
        raise ValueError(f"longrope factors have {ext.numel()} entries, expected rotary_dim / 2 = {dim // 2}")
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * base**shape), attention_factor


def _yarn_inv_freq(arch: ArchConfig, base: float, dim: int, rs: dict) -> tuple[torch.Tensor, float]:
    factor, old_len = rs["factor"], rs["original_max_position_embeddings"]

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(old_len / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_cos_sin_table(arch: ArchConfig, num_positions: int, theta: Optional[float] = None) -> torch.Tensor:
    """[num_positions, rotary_dim] float32: cos in the first half, sin in the second, times the
    type's attention factor. ``theta``: the unscaled table of Gemma 3's sliding layers."""
    positions = torch.arange(num_positions, dtype=torch.float32)
    inv_freq, attention_factor = rope_inv_freq(arch, theta=theta)
    freqs = torch.outer(positions, inv_freq)  # [num_positions, rotary_dim // 2]
    rs = arch.rope_scaling
    if theta is None and rs is not None and rs["rope_type"] == "longrope":
        old_len = rs["original_max_position_embeddings"]
        if num_positions > old_len:
            long_freq, _ = rope_inv_freq(arch, long=True)
            freqs[old_len:] = torch.outer(positions[old_len:], long_freq)
    return torch.cat((freqs.cos() * attention_factor, freqs.sin() * attention_factor), dim=-1)
