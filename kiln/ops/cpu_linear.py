"""CPU decode GEMMs: one-row bfloat16 and float32 linears through kiln's GEMVs.

At batch-1 decode every linear is ``[1, K] @ W.T``, and the step streams every weight once. On
the CPU, torch's one-row bfloat16 paths do not read faster than float32: ``F.linear`` sends the row
through oneDNN's matmul and ``torch.mv`` through a GEMV that converts each bfloat16 to float; on a
2-core Xeon with AMX-BF16 both take about as long as float32's MKL GEMV on twice the bytes, so a
bfloat16 model decoded no faster than float32. ``torch.ops.kiln_cpu.gemv_bf16`` (``csrc/gemv.cpp``,
built into ``kiln._C``) multiplies bfloat16 pairs with AVX512-BF16 into float32 sums and
prefetches ahead: about 2x float32 per step (``python -m benchmarks.offline quant-cpu``); a CPU with AVX2 but not
AVX512-BF16 widens each bfloat16 to float32 (exact) and multiplies with FMA. More rows keep
``F.linear``: oneDNN's AMX kernels win from a few rows on (batch 16: 2.5x float32 on the LM head).
``torch.ops.kiln_cpu.linear_bf16`` makes that choice in C++ by the row count, so a compiled graph
holds it as one opaque op and serves decode and prefill alike. Without the extension, one eager row
goes through ``torch.mv`` (no worse than ``F.linear``).

Float32 goes the same way through ``torch.ops.kiln_cpu.linear_f32`` (``gemv_f32``: AVX2 + FMA, four
rows sharing each load of the activation, software prefetch). MKL's one-row sgemv, which
``F.linear`` and Inductor's extern ``mm`` call, read 6.3-11.3 GB/s on a 2-vCPU AMD EPYC whose memory
gives 15 GB/s; the GEMV read 12.9-17.7 GB/s there (``python -m benchmarks.kernels cpu-gemv``), and as fast as MKL's
on an Intel Xeon. Off Intel, where MKL's GEMMs at these shapes are slow, up to 64 rows take
register blocks of 3 activation rows by 4 weight rows (each weight tile read once for all rows:
a SmolLM2 layer's linears at 16 rows 2.0 against MKL's 4.5 ms on an AMD EPYC); more rows keep MKL's
GEMM, and a CPU without AVX2 keeps ``F.linear`` (inside the op). bfloat16 weights without
AVX512-BF16 take the blocks at every row count (oneDNN's bf16 matmul on AVX2 is 4-5x slower).

``decode_linear`` is that choice; ``use_decode_gemv`` switches a CPU model's bfloat16 ``nn.Linear``
layers to it (``GemvLinear``), and ``prepare_cpu_decode`` also gives a quantized float32 model a
bfloat16 LM head.

A quantized model's LM head goes further at one row: Q8_0 (int8 values, one float16 scale per
block of 32, as llama.cpp stores a GGUF's embedding) through ``torch.ops.kiln_cpu.gemv_q8_0``
(``csrc/gemv_q8_0.cpp``: float32 activations, the weight widened in registers), half the bytes of
bfloat16. A GGUF's own Q8_0 head is repacked as stored, never re-quantized; another checkpoint's
head is quantized per block of 32 (``quantize_q8_0``). More rows keep the bfloat16 head (oneDNN's
AMX), and so does a ``kiln._C`` built without the op.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

# Weight dtypes whose one-row product goes through a kiln GEMV, and the op (in torch.ops.kiln_cpu)
# that takes it: one row through the GEMV, more through F.linear.
CPU_LINEAR_OPS = {torch.bfloat16: "linear_bf16", torch.float32: "linear_f32"}
_gemv_loaded: Optional[bool] = None  # None: not tried yet


def gemv_available() -> bool:
    """Whether ``kiln._C`` is built with the GEMV ops (``torch.ops.kiln_cpu.gemv_bf16``,
    ``linear_bf16``, ``gemv_f32``, ``linear_f32``, ``linear_int4_packed``)."""
    global _gemv_loaded
    if _gemv_loaded is None:
        from kiln.ops.cpu_attention import load_extension

        _gemv_loaded = (load_extension() and hasattr(torch.ops.kiln_cpu, "linear_bf16")
                        and hasattr(torch.ops.kiln_cpu, "linear_f32"))
        if _gemv_loaded:
            _register_fakes()
    return _gemv_loaded


def _register_fakes() -> None:
    @torch.library.register_fake("kiln_cpu::gemv_bf16")
    def _(x, w):
        return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("kiln_cpu::linear_bf16")
    def _(x, w, bias=None):
        return x.new_empty((*x.shape[:-1], w.shape[0]))

    @torch.library.register_fake("kiln_cpu::gemv_f32")
    def _(x, w):
        return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("kiln_cpu::linear_f32")
    def _(x, w, bias=None):
        return x.new_empty((*x.shape[:-1], w.shape[0]))

    @torch.library.register_fake("kiln_cpu::linear_int4_packed")
    def _(x, w, scales_zeros, group_size):
        return x.new_empty((*x.shape[:-1], scales_zeros.shape[1]))

    if hasattr(torch.ops.kiln_cpu, "gemv_q8_0"):
        @torch.library.register_fake("kiln_cpu::gemv_q8_0")
        def _(x, qweight, scales):
            return x.new_empty((x.shape[0], qweight.shape[0]), dtype=torch.float32)


def gemv_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ w [N, K].T`` in float32 from bfloat16 ``w`` (``x`` rounded to bfloat16)."""
    x = x.to(torch.bfloat16)
    if gemv_available():
        return torch.ops.kiln_cpu.gemv_bf16(x, w)
    return torch.stack([torch.mv(w, row).float() for row in x]) if x.shape[0] else x.new_empty((0, w.shape[0]),
                                                                                               dtype=torch.float32)


def decode_linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` in ``x``'s dtype; for a CPU weight of a GEMV dtype through its op in
    ``CPU_LINEAR_OPS`` (one row: the GEMV; more: ``F.linear``), in eager mode and in compiled graphs
    alike; without the extension, one eager bfloat16 row through ``torch.mv``. A CUDA
    bf16/fp16 weight goes through ``kiln_cuda::linear_dense`` (``kiln.ops.dense_linear``: the
    Triton GEMV at one row, cuBLAS above)."""
    if w.dtype in CPU_LINEAR_OPS and w.device.type == "cpu":
        if gemv_available():
            return getattr(torch.ops.kiln_cpu, CPU_LINEAR_OPS[w.dtype])(x, w, bias)
        if w.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] == 1 and not torch.compiler.is_compiling():
            y = torch.mv(w, x[0].to(w.dtype)).unsqueeze(0).to(x.dtype)
            return y if bias is None else y + bias
    if w.is_cuda:
        from kiln.ops import dense_linear  # defines the op

        if w.dtype in dense_linear.GEMV_DTYPES:
            return torch.ops.kiln_cuda.linear_dense(x.to(w.dtype), w, bias).to(x.dtype)
    return F.linear(x.to(w.dtype), w, bias).to(x.dtype)


def linear_int4_eager():
    """What an eager int4 ``QuantLinear`` on the CPU calls: the C++ op when built (one dispatcher
    call: kiln's float32 int4 kernels where torch packs for AVX2, torch's packed int4 GEMM
    elsewhere), else the Python wrapper of torch's."""
    from kiln.ops import quant

    return torch.ops.kiln_cpu.linear_int4_packed if gemv_available() else quant._linear_int4_cpu


def int4_takes_float() -> bool:
    """Whether ``kiln_cpu::linear_int4_packed`` runs kiln's float32 int4 kernels (``csrc/gemv.cpp``:
    where torch dispatches to AVX2 or AVX512, whose packings they read): its activations then go in
    as float32. Elsewhere torch's kernel computes in bfloat16, so ``QuantLinearPass`` casts around
    the op."""
    return gemv_available() and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


class GemvLinear(nn.Linear):
    """An ``nn.Linear`` whose calls go through ``decode_linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return decode_linear(x, self.weight, self.bias)


def use_decode_gemv(model: nn.Module) -> int:
    """Switch every ``nn.Linear`` of a CPU model whose weight has a GEMV (``CPU_LINEAR_OPS``) to
    ``GemvLinear`` in place (same parameters); returns how many."""
    count = 0
    for m in model.modules():
        if type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype in CPU_LINEAR_OPS:
            m.__class__ = GemvLinear
            count += 1
    return count


# ---- Q8_0 LM head ---------------------------------------------------------------------------------

Q8_BLOCK = 32  # weights per Q8_0 scale
Q8_CHUNK = 64  # two blocks interleaved in the GEMV's layout, the packed row's K padding


def q8_0_available() -> bool:
    """Whether ``kiln._C`` is built with ``torch.ops.kiln_cpu.gemv_q8_0``."""
    return gemv_available() and hasattr(torch.ops.kiln_cpu, "gemv_q8_0")


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` (K a multiple of 32) -> Q8_0 as llama.cpp quantizes: (q int8 [N, K], d float16
    [N, K/32]), ``d = absmax / 127`` per block, ``q = round(w / d)`` (with d before its float16
    rounding)."""
    n, k = w.shape
    blocks = w.detach().float().reshape(n, k // Q8_BLOCK, Q8_BLOCK)
    d = blocks.abs().amax(-1) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv.unsqueeze(-1)).to(torch.int8).reshape(n, k)
    return q, d.to(torch.float16)


def pack_q8_0(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 ``(q int8 [N, K], d float16 [N, K/32])`` -> the GEMV's layout (``csrc/gemv_q8_0.cpp``):
    ``qweight uint8 [N, Kp]`` (q + 128, K padded to a multiple of 64 with zero blocks, each 64-byte
    chunk's two blocks interleaved 4 bytes at a time) and ``scales float16 [N, Kp/32]``."""
    n, k = q.shape
    kp = -(-k // Q8_CHUNK) * Q8_CHUNK
    u = F.pad(q.to(torch.int16) + 128, (0, kp - k), value=128).to(torch.uint8)
    u = u.reshape(n, kp // Q8_CHUNK, 2, 8, 4).transpose(2, 3).reshape(n, kp)  # [block, group, byte] -> [group, block, byte]
    return u.contiguous(), F.pad(d.to(torch.float16), (0, (kp - k) // Q8_BLOCK)).contiguous()


def gemv_q8_0_reference(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """What ``gemv_q8_0`` computes, in float64: ``x [M, K]`` times the Q8_0 weight ``q * d``."""
    n, k = q.shape
    w = q.double().reshape(n, k // Q8_BLOCK, Q8_BLOCK) * d.double().unsqueeze(-1)
    return x.double() @ w.reshape(n, k).t()


class Q8Head(NamedTuple):
    """A CPU LM head in ``gemv_q8_0``'s layout (``pack_q8_0``)."""

    qweight: torch.Tensor  # [N, Kp] uint8
    scales: torch.Tensor  # [N, Kp / 32] float16


# Rows of x the Q8_0 head takes where torch dispatches to AVX512: its AVX-512 kernel reads the
# weight once per 8 rows, faster there than the bfloat16 head through oneDNN up to 8 (one thread,
# SmolLM2's head: 1.9 / 3.9 ms at 2 / 8 rows against 5.1 / 5.2). 9-16 rows take two passes, slower
# than bfloat16 (11.2 against 5.2 ms at 16), and stay on it so that a row's logits are the same sums
# whatever the batch up to 16 (speculative verification of 4 sequences x 4 tokens): across the
# switch to bfloat16 a greedy near-tie flipped under n-gram speculation. Elsewhere one row.
Q8_HEAD_ROWS = 16
_Q8_ROWS = torch.backends.cpu.get_cpu_capability() == "AVX512"


def head_linear(x: torch.Tensor, w: torch.Tensor, q8: Optional[Q8Head] = None) -> torch.Tensor:
    """The LM head ``x @ w.T`` in ``x``'s dtype: one row (up to ``Q8_HEAD_ROWS`` on AVX512) through
    the Q8_0 GEMV when the model has a ``Q8Head`` (``prepare_cpu_decode``), else ``decode_linear``."""
    if q8 is not None and x.dim() == 2 and (x.shape[0] == 1 or (x.shape[0] <= Q8_HEAD_ROWS and _Q8_ROWS)):
        return torch.ops.kiln_cpu.gemv_q8_0(x, q8.qweight, q8.scales).to(x.dtype)
    return decode_linear(x, w)



def q8_0_head(head: torch.Tensor, blocks=None) -> Optional[Q8Head]:
    """``head [N, K]``'s ``Q8Head``: from the checkpoint's Q8_0 ``blocks`` ((q, d) arrays of the same
    shape, repacked as stored) or quantized from ``head``; None without the op or for a K that is
    not whole blocks."""
    n, k = head.shape
    if not q8_0_available() or k % Q8_BLOCK:
        return None
    if blocks is not None and tuple(blocks[0].shape) == (n, k):
        q, d = (torch.as_tensor(a) for a in blocks)
    else:
        q, d = quantize_q8_0(head.detach())
    return Q8Head(*pack_q8_0(q, d))


def prepare_cpu_decode(model: nn.Module, head_blocks=None) -> None:
    """Decode GEMMs of a loaded CPU model: ``GemvLinear`` for its bfloat16 and float32 linears, and for a model
    whose decoder linears are quantized (their kernels compute in bfloat16, ``kiln.ops.quant``) a
    bfloat16 copy of the LM head weight (``model.head_weight``, read by ``compute_logits``), which
    halves the largest read of a float32 model's step; a quantized GGUF's embedding is Q8_0, whose
    values bfloat16 holds to 2^-9 relative. One-row logits of such a model go through a Q8_0 head
    (``model.head_q8``), from ``head_blocks`` (the GGUF's Q8_0 (q, d) of the head) where given."""
    use_decode_gemv(model)
    if getattr(model, "quantization", "none") in ("int8", "int4") and hasattr(model, "embed_tokens"):
        head = model.embed_tokens.weight if getattr(model, "lm_head", None) is None else model.lm_head.weight
        if head.device.type == "cpu" and head.dtype == torch.float32:
            model.head_weight = head.detach().to(torch.bfloat16)
            model.head_q8 = q8_0_head(head, head_blocks)
