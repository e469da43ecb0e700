"""Paged attention: ``torch.ops.kiln.attend_paged``.

One op writes the step's new K/V into the paged cache and attends each request's queries over its
whole context (cached prefix plus the new tokens), causally. Cache and metadata come from the
forward context (``kiln.forward_context``), so the compiled graph carries no cache tensors and no
Python objects: the op is opaque to Dynamo and a natural split point for the compiler.

``torch.ops.kiln.attend_paged_rope`` is the same op on q and k before their rotary, with the
model's per-token rotary tables (``[cos, cos]`` and ``[-sin, sin]``, ``rotate_reference``): a
kernel that rotates as it loads saves the model's rotary kernel (``RopeAttentionFusionPass``).

Cache layout, one tensor per layer::

    kv_cache[0 = K | 1 = V][block_id][offset in block][kv_head][head_dim]
    slot = block_id * block_size + offset

This module holds the schema, the fake (meta) implementation and the pure-torch reference. Faster
kernels (C++ on CPU, Triton on GPU) define ops of the same schema with ``define_attention_op``;
``kiln.ops.registry`` chooses among them. The generic op runs the kernel the forward context names
(``ForwardContext.attention_impl``), else the reference: that is how eager and stock modes reach the
device's kernel, while kiln's attention pass writes the kernel's own op into the graph.

An FP8 cache (``cache.dtype=fp8``) may carry per-layer, per-tensor scales (``kv_scale``: a float32
[2] tensor, k_scale then v_scale, from ``ForwardContext.kv_scales``): the cache holds
``clamp(x / scale, +-448)`` in float8_e4m3fn and a read multiplies by the scale again. Kernels fold
k_scale into the score scale and v_scale into the output; no scale (None) means 1. Scales of a
cache that is not FP8 are ignored.

Every attention op reads layer ``ForwardContext.layer_base + layer_idx``: a compiled piece holding
the calls of several layers numbers them from 0 and sets its first layer with ``set_layer_base``
while it runs (``kiln.compiler.piece``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from kiln.forward_context import AttentionMetadata, get_forward_context
from kiln.ops.library import define_op

# impl(q, k, v, kv_cache, meta, scale, sliding_window=0, logit_softcap=0.0, *, kv_scale=None) -> out
AttentionImpl = Callable[..., torch.Tensor]
# impl(q, k, v, cos, sin_signed, kv_cache, meta, scale, sliding_window=0, logit_softcap=0.0, *, kv_scale=None):
# the same on q and k before their rotary (``attend_paged_rope_reference``)
RopeAttentionImpl = Callable[..., torch.Tensor]


_FP8_DTYPES = (torch.float8_e4m3fn,)  # cache.dtype=fp8: indexing ops lack it on the CPU, so bytes move
FP8_KV_MAX = 448.0  # the largest float8_e4m3fn: scaled values are clamped to +-this, never NaN
# Calibrated scales leave this much room above the first prefill's amax for later, larger values.
CALIBRATION_HEADROOM = 2.0


def _rows(kv: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``kv[index]``, for float8 caches too."""
    return kv.view(torch.uint8)[index].view(kv.dtype) if kv.dtype in _FP8_DTYPES else kv[index]


def fp8_kv_scale(kv_cache: torch.Tensor, kv_scale: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The scales a kernel applies: ``kv_scale`` for an FP8 cache, else None (none to apply)."""
    return kv_scale if kv_scale is not None and kv_cache.dtype in _FP8_DTYPES else None


def quantize_kv_reference(x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in float32, clamped to the FP8 range, rounded to ``dtype`` (what every store writes)."""
    return (x.float() / scale).clamp(-FP8_KV_MAX, FP8_KV_MAX).to(dtype)


def calibrate_kv_scale(k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, kv_scale: torch.Tensor) -> None:
    """Set ``kv_scale`` (in place) to amax / 448 times ``CALIBRATION_HEADROOM`` over the step's real
    tokens (padding rows excluded); an all-zero tensor keeps scale 1."""
    n = sum(meta.query_lens_cpu)
    amax = torch.stack([k[:n].abs().amax().float(), v[:n].abs().amax().float()])  # [2]
    kv_scale.copy_(torch.where(amax > 0, amax * (CALIBRATION_HEADROOM / FP8_KV_MAX), 1.0))


def store_kv_reference(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       *, kv_scale: Optional[torch.Tensor] = None) -> None:
    """Write new keys/values into their slots. k, v: [num_tokens, num_kv_heads, head_dim]."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    if kv_cache.dtype in _FP8_DTYPES:  # clamped, never NaN (e4m3 has no infinity); no scale: 1
        k_scale, v_scale = (kv_scale[0], kv_scale[1]) if kv_scale is not None else (1.0, 1.0)
        k = quantize_kv_reference(k, k_scale, kv_cache.dtype).view(torch.uint8)
        v = quantize_kv_reference(v, v_scale, kv_cache.dtype).view(torch.uint8)
        kv_cache = kv_cache.view(torch.uint8)  # indexing ops lack float8 on the CPU: bytes move
    else:
        k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _gather_context(kv: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """kv: [num_blocks, block_size, H, D] -> [seq_len, H, D] for one request."""
    block_size = kv.shape[1]
    num_blocks = -(-seq_len // block_size)
    return _rows(kv, block_table[:num_blocks].long()).flatten(0, 1)[:seq_len]


def visible_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int) -> torch.Tensor:
    """[len(q_pos), len(k_pos)] bool: key j is visible to the query at position p when j <= p and,
    with a window W > 0, j > p - W (W keys, the query's own included: transformers' definition)."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window > 0:
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return mask


def softcap_scores(scores: torch.Tensor, logit_softcap: float) -> torch.Tensor:
    """Gemma 2's soft-capping of the scaled scores: cap * tanh(scores / cap); 0 means none."""
    return torch.tanh(scores / logit_softcap) * logit_softcap if logit_softcap > 0 else scores


def attend_paged_reference(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int = 0,  # > 0: each query sees only the last `sliding_window` keys up to itself
    logit_softcap: float = 0.0,  # > 0: scores = cap * tanh(scores / cap) before the softmax
    *,
    kv_scale: Optional[torch.Tensor] = None,  # [2] float32 (k_scale, v_scale) of an FP8 cache
) -> torch.Tensor:
    """Pure-torch paged attention: the definition every kernel is checked against."""
    store_kv_reference(k, v, kv_cache, meta.slot_mapping, kv_scale=kv_scale)
    kv_scale = fp8_kv_scale(kv_cache, kv_scale)
    num_heads = q.shape[1]
    group = num_heads // k.shape[1]
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd > 0:
        _attend_decodes(q[:nd], kv_cache, meta, scale, group, out[:nd], sliding_window, logit_softcap, kv_scale)
    start_loc = meta.query_start_loc.tolist() if nd < meta.num_reqs else []
    for i in range(nd, meta.num_reqs):
        s, e = start_loc[i], start_loc[i + 1]
        seq_len, q_len = meta.seq_lens_cpu[i], e - s
        keys = _gather_context(kv_cache[0], meta.block_tables[i], seq_len)  # [seq_len, kvh, D]
        vals = _gather_context(kv_cache[1], meta.block_tables[i], seq_len)
        if kv_scale is not None:  # dequantize: cached value times its scale
            keys, vals = keys.float() * kv_scale[0], vals.float() * kv_scale[1]
        # Query j (0-based in the chunk) sits at context position seq_len - q_len + j.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = visible_keys(q_pos, torch.arange(seq_len, device=q.device), sliding_window)  # [q_len, seq_len]
        qh = q[s:e].transpose(0, 1)  # [H, q_len, D]
        kh = keys.transpose(0, 1).to(q.dtype).repeat_interleave(group, 0)  # [H, seq_len, D]
        vh = vals.transpose(0, 1).to(q.dtype).repeat_interleave(group, 0)
        if logit_softcap > 0:
            scores = softcap_scores(torch.matmul(qh.float(), kh.float().transpose(1, 2)) * scale, logit_softcap)
            probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            o = torch.matmul(probs, vh.float()).to(q.dtype)
        else:
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
        out[s:e] = o.transpose(0, 1)
    return out


def _attend_decodes(q, kv_cache, meta, scale, group, out, sliding_window, logit_softcap, kv_scale=None) -> None:
    """All decode requests at once: pad each context to the longest, mask the tail (and, with a
    window, the keys before it)."""
    nd = q.shape[0]
    seq_lens = meta.seq_lens[:nd].long()
    block_size = kv_cache.shape[2]
    max_blocks = -(-max(meta.seq_lens_cpu[:nd]) // block_size)
    table = meta.block_tables[:nd, :max_blocks].long()  # [nd, max_blocks]
    keys = _rows(kv_cache[0], table).flatten(1, 2)  # [nd, max_len, kvh, D]
    vals = _rows(kv_cache[1], table).flatten(1, 2)
    if kv_scale is not None:
        keys, vals = keys.float() * kv_scale[0], vals.float() * kv_scale[1]
    max_len = keys.shape[1]
    kvh, head_dim = keys.shape[2], keys.shape[3]
    qg = q.view(nd, kvh, group, head_dim).to(torch.float32)  # [nd, kvh, group, D]
    scores = softcap_scores(torch.einsum("nhgd,nlhd->nhgl", qg, keys.to(torch.float32)) * scale, logit_softcap)
    # The query sits at position seq_len - 1.
    valid = visible_keys(seq_lens - 1, torch.arange(max_len, device=q.device), sliding_window)  # [nd, max_len]
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    o = torch.einsum("nhgl,nlhd->nhgd", probs, vals.to(torch.float32))
    out.copy_(o.reshape(nd, kvh * group, head_dim).to(out.dtype))


def rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (neox layout, the Llama family's ``apply_rope``) in float32, rounded once to
    x's dtype, as the fused kernel Inductor makes of the model's own rotary computes it.
    x: [T, n, D]; cos = [cos, cos], sin_signed = [-sin, sin]: [T or 1, 1, R], R <= D even; the
    dims past R pass through unchanged."""
    rot = cos.shape[-1]
    xf = x[..., :rot].float()
    out = (xf * cos.float() + xf.roll(rot // 2, dims=-1) * sin_signed.float()).to(x.dtype)
    return out if rot == x.shape[-1] else torch.cat((out, x[..., rot:]), dim=-1)


def attend_paged_rope_reference(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], not yet rotated
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], not yet rotated
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, rotary_dim]: [cos, cos] of each token's position
    sin_signed: torch.Tensor,  # [num_tokens, 1, rotary_dim]: [-sin, sin]
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
    *,
    kv_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``attend_paged_reference`` of the rotated q and k: the definition of ``kiln::attend_paged_rope``."""
    return attend_paged_reference(rotate_reference(q, cos, sin_signed), rotate_reference(k, cos, sin_signed), v,
                                  kv_cache, meta, scale, sliding_window, logit_softcap, kv_scale=kv_scale)


# Where else the layer base must be set: the CPU extension's C++ attention context adds its setter
# when it loads (``kiln.ops.cpu_attention.load_extension``).
layer_base_setters: list[Callable[[int], object]] = []


def set_layer_base(base: int) -> None:
    """Make the attention calls that follow read layer ``base + layer_idx`` (0: their own index)."""
    get_forward_context().layer_base = base
    for setter in layer_base_setters:
        setter(base)


def define_attention_op(qualname: str, impl: Optional[AttentionImpl]):
    """Define op ``qualname`` with the schema of ``kiln::attend_paged``: it runs ``impl`` on the
    cache and metadata of the forward context (``impl=None``: the context's ``attention_impl``, else
    the reference). Kernel packages define theirs with this, so every attention op a graph can hold
    reads the context the same way."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, scale: float,
               sliding_window: int = 0, logit_softcap: float = 0.0) -> torch.Tensor:
        ctx = get_forward_context()
        if ctx.attn is None:
            raise RuntimeError(f"{qualname} needs attention metadata in the forward context")
        run = impl or ctx.attention_impl or attend_paged_reference
        layer = ctx.layer_base + layer_idx
        kv_scale = ctx.kv_scales[layer] if ctx.kv_scales is not None else None
        if kv_scale is not None and ctx.calibrate_kv_scales:
            calibrate_kv_scale(k, v, ctx.attn, kv_scale)
        return run(q, k, v, ctx.kv_caches[layer], ctx.attn, scale,
                   sliding_window=sliding_window, logit_softcap=logit_softcap, kv_scale=kv_scale)

    return define_op(qualname, attend,
                     lambda q, k, v, layer_idx, scale, sliding_window=0, logit_softcap=0.0: torch.empty_like(q))


# Store k/v of the new tokens in layer ``layer_idx``'s cache and attend; returns [T, H, D].
# attend_paged(q, k, v, layer_idx, scale, sliding_window=0, logit_softcap=0.0): a window W > 0 lets
# each query see only keys p - W < j <= p; a cap > 0 soft-caps the scaled scores (Gemma 2).
attend_paged = define_attention_op("kiln::attend_paged", None)


def define_rope_attention_op(qualname: str, impl: Optional[RopeAttentionImpl]):
    """Define op ``qualname`` with the schema of ``kiln::attend_paged_rope``: ``kiln::attend_paged``
    on q and k that are not yet rotated, with the rotary's [cos, cos] and [-sin, sin] of each token
    (``rotate_reference``). ``impl`` rotates inside its kernels; ``impl=None`` (the generic op)
    rotates first and runs the context's attention kernel, else the reference. A step that
    calibrates FP8 cache scales rotates first too: the scales are measured on the rotated keys."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
               layer_idx: int, scale: float, sliding_window: int = 0, logit_softcap: float = 0.0) -> torch.Tensor:
        ctx = get_forward_context()
        if ctx.attn is None:
            raise RuntimeError(f"{qualname} needs attention metadata in the forward context")
        layer = ctx.layer_base + layer_idx
        kv_scale = ctx.kv_scales[layer] if ctx.kv_scales is not None else None
        calibrate = kv_scale is not None and ctx.calibrate_kv_scales
        if impl is not None and not calibrate:
            return impl(q, k, v, cos, sin_signed, ctx.kv_caches[layer], ctx.attn, scale,
                        sliding_window=sliding_window, logit_softcap=logit_softcap, kv_scale=kv_scale)
        q, k = rotate_reference(q, cos, sin_signed), rotate_reference(k, cos, sin_signed)
        if calibrate:
            calibrate_kv_scale(k, v, ctx.attn, kv_scale)
        run = ctx.attention_impl or attend_paged_reference
        return run(q, k, v, ctx.kv_caches[layer], ctx.attn, scale,
                   sliding_window=sliding_window, logit_softcap=logit_softcap, kv_scale=kv_scale)

    return define_op(qualname, attend, lambda q, k, v, cos, sin_signed, layer_idx, scale, sliding_window=0,
                     logit_softcap=0.0: torch.empty_like(q))


# attend_paged on q and k before their rotary: what ``RopeAttentionFusionPass`` writes where the
# KernelSet's attention kernel rotates inside (``AttentionKernel.rope_op``).
# attend_paged_rope(q, k, v, cos, sin_signed, layer_idx, scale, sliding_window=0, logit_softcap=0.0)
attend_paged_rope = define_rope_attention_op("kiln::attend_paged_rope", None)
