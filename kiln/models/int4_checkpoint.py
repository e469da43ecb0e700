"""AWQ and GPTQ 4-bit checkpoints: their packed tensors as kiln's canonical int4, exactly.

Both formats store, per linear of weight W [N, K] (``w[n, k] = (q - z) * s`` with the group
``g = k // group_size``), three tensors next to where ``<module>.weight`` would be:

    format      qweight (int32)                  qzeros (int32)        scales (fp16)   zero z
    GPTQ        [K/8, N]: 8 k's per word         [K/g, N/8]: 8 n's     [K/g, N]        stored + 1 ("gptq")
                (value i in bits 4i..4i+3)       (same nibble order)                   stored ("gptq_v2")
    AWQ (GEMM)  [K, N/8]: 8 n's per word         [K/g, N/8]            [K/g, N]        stored
                in the order 0 2 4 6 1 3 5 7

GPTQ also stores ``g_idx`` [K] (the group of each input column); only the plain order
``g_idx[k] == k // group_size`` is read: act-order (``desc_act``) checkpoints group columns out of
order, which kiln's contiguous groups cannot hold without permuting the activations (with
``group_size=-1`` there is one group, and act-order changes nothing).

``dequantize_int4_checkpoint`` turns the stream of checkpoint tensors into full float weights for
``load_weights`` (so every ``model.quantization`` can serve the checkpoint, fused and sharded as
usual) and, on request, records each projection's canonical int4 (``kiln.ops.quant``: ``(q - 8) *
s + z'``, so ``z' = (8 - z) * s``): the same integers and group scales, nothing re-quantized.
In float32 the canonical weight dequantizes to exactly ``(q - z) * s``; in a 16-bit model dtype the
scales and ``z'`` are rounded to it once. Fusing and tensor-parallel slicing of the canonical weights
follow ``load_weights``' own slices (``kiln.models.quantize.shard_int4_projections``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch

from kiln.ops import quant

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's GEMM packing: nibble i of a word holds column AWQ_ORDER[i]
_PARTS = ("qweight", "qzeros", "scales")


@dataclass(frozen=True)
class Int4CheckpointFormat:
    method: str  # "awq" | "gptq"
    group_size: int  # input columns per scale; -1: one group of all K
    zero_offset: int  # added to a stored zero: 1 for GPTQ's original format, else 0

    def groups(self, k: int) -> int:
        return 1 if self.group_size == -1 else k // self.group_size


def int4_checkpoint_format(qc: dict) -> Int4CheckpointFormat:
    """The format of an ``awq`` / ``gptq`` ``quantization_config``; a ValueError that says what to do
    for the variants kiln does not read."""
    method = qc["quant_method"]
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{method.upper()} checkpoint with bits={bits}: kiln loads only 4-bit AWQ/GPTQ weights; "
                         f"use a 4-bit or the unquantized checkpoint (model.quantization=int8 quantizes it at load)")
    group_size = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if group_size != -1 and (group_size <= 0 or group_size % 8):
        raise ValueError(f"{method.upper()} checkpoint with group_size={group_size}: kiln needs -1 or a multiple of 8")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported: kiln reads the GEMM packing "
                             f"(version: gemm); export the model with AutoAWQ's GEMM version")
        return Int4CheckpointFormat("awq", group_size, 0)
    if qc.get("desc_act") and group_size != -1:  # one group of all K stays contiguous in any order
        raise ValueError("GPTQ checkpoint with desc_act=true (act-order): its groups are not contiguous in K, "
                         "which kiln's int4 layout needs; use a checkpoint quantized with desc_act=false")
    fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported: kiln reads 'gptq' and 'gptq_v2'; "
                         f"convert the checkpoint to the plain GPTQ packing")
    return Int4CheckpointFormat("gptq", group_size, 1 if fmt == "gptq" else 0)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., M] -> int32 [..., M, 8]: nibble i is bits 4i..4i+3."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF


def unpack_int4_checkpoint(fmt: Int4CheckpointFormat, qweight: torch.Tensor, qzeros: torch.Tensor,
                           scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int32 [N, K] in 0..15, z int32 [N, K/g], s float32 [N, K/g]) of one linear."""
    s = scales.float().t()  # [N, K/g]
    n, num_groups = s.shape
    if fmt.method == "gptq":
        k = qweight.shape[0] * 8
        q = _nibbles(qweight).permute(0, 2, 1).reshape(k, -1)  # [K, N]: word row r holds k = 8r..8r+7
        z = _nibbles(qzeros).reshape(num_groups, -1)  # [K/g, N]
    else:
        k = qweight.shape[0]
        inverse = torch.tensor([AWQ_ORDER.index(i) for i in range(8)], device=qweight.device)
        q = _nibbles(qweight)[..., inverse].reshape(k, -1)
        z = _nibbles(qzeros)[..., inverse].reshape(num_groups, -1)
    if q.shape[1] != n or z.shape[1] != n or num_groups != fmt.groups(k):
        raise ValueError(f"{fmt.method.upper()} checkpoint: qweight {tuple(qweight.shape)}, qzeros "
                         f"{tuple(qzeros.shape)} and scales {tuple(scales.shape)} do not fit one "
                         f"group_size={fmt.group_size} linear")
    return q.t().contiguous(), z.t() + fmt.zero_offset, s


def canonical_int4(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q - z) * s`` as kiln's canonical int4 (packed [N, K/2], scales_zeros [K/g, N, 2])."""
    return quant.pack_int4(q), quant.int4_scales_zeros(s, (8.0 - z.float()) * s, dtype)


def dequantize_int4_checkpoint(weights: Iterable[tuple[str, torch.Tensor]], fmt: Int4CheckpointFormat,
                               dtype: torch.dtype, canonical: Optional[dict] = None
                               ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every ``qweight``/``qzeros``/``scales`` triple replaced by the
    full ``<module>.weight`` in ``dtype``; ``canonical``, where given, collects the Hugging Face
    module name -> its canonical int4 (``kiln.models.quantize.fuse_int4_projections`` stacks them)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights:
        base, _, leaf = name.rpartition(".")
        if leaf == "g_idx":
            _check_g_idx(name, t, fmt)
            continue
        if leaf not in _PARTS:
            yield name, t
            continue
        entry = pending.setdefault(base, {})
        entry[leaf] = t
        if len(entry) < len(_PARTS):
            continue
        q, z, s = unpack_int4_checkpoint(fmt, entry["qweight"], entry["qzeros"], entry["scales"])
        del pending[base], entry
        group = q.shape[1] // s.shape[1]
        w = (q - z.repeat_interleave(group, dim=1)).float() * s.repeat_interleave(group, dim=1)  # [N, K]
        yield f"{base}.weight", w.to(dtype)
        if canonical is not None:
            canonical[base] = canonical_int4(q, z, s, dtype)
    if pending:
        raise ValueError(f"{fmt.method.upper()} checkpoint: {sorted(pending)[:3]} lack one of {list(_PARTS)}")


def _check_g_idx(name: str, g_idx: torch.Tensor, fmt: Int4CheckpointFormat) -> None:
    k = g_idx.numel()
    group = k if fmt.group_size == -1 else fmt.group_size
    plain = torch.arange(k, device=g_idx.device) // group
    if not torch.equal(g_idx.to(plain.dtype), plain):
        raise ValueError(f"GPTQ checkpoint: {name} groups the input columns out of order (act-order); kiln's int4 "
                         f"layout needs contiguous groups: use a checkpoint quantized with desc_act=false")
