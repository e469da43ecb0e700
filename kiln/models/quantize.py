"""Quantized weights at load time: ``QuantLinear`` and ``quantize_model``.

After the weights are loaded in the model dtype, ``quantize_model`` replaces every ``nn.Linear``
of the decoder layers (the fused q/k/v and gate/up projections, o_proj, down_proj; never the
embedding or the LM head) with a ``QuantLinear`` holding the weight in the layout of the
``KernelSet``'s kernel for the scheme (``kiln.ops.registry.QuantLinearKernel``); the float weight
is dropped. A layer whose shape the kernel does not take keeps the canonical layout and the
reference op.

``QuantLinear.forward`` runs the kernel op in eager mode. Under compilation it writes
``linear(x, dequant(w, scales))`` instead: the dequantized weight marks the linear as quantized,
``kiln.passes.quant_linear.QuantLinearPass`` swaps the pair for the kernel op, and a graph that
never saw the pass (``compile.mode=stock``) still computes the same result.

Where the weights come from, ``quantization=auto`` resolves (``resolve_quantization``): the
checkpoint's ``quantization_config`` (``fp8``, ``compressed-tensors`` FP8 -> fp8, whose tensors
``dequantize_fp8_checkpoint`` reads per-tensor, per-channel or block-scaled; 4-bit ``awq``, ``gptq``
-> int4, their packed integers and group scales kept exactly, ``kiln.models.int4_checkpoint``), and
a GGUF source runs in its own blocks' scheme (``gguf_quantization``): Q4_0, Q4_1 and Q4_K as int4
weights exactly (``read_gguf_int4``: ``q * d + m`` is ``(q - 8) * s + z`` with ``s = d``,
``z = m + 8d``), never expanded to float; Q8_0 as int8; float types unquantized.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import mmap
import os
import re
import struct
from typing import Any, Iterable, Iterator, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kiln.config import QUANTIZATIONS
from kiln.models.int4_checkpoint import Int4CheckpointFormat, int4_checkpoint_format
from kiln.ops import quant
from kiln.ops.registry import QUANT_SCHEMES, KernelSet, QuantLinearKernel, reference_kernels

logger = logging.getLogger(__name__)

# Fused kiln linears and the checkpoint projections whose rows they stack, in order.
FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class QuantLinear(nn.Module):
    """``y = x @ dequant(qweight, scales).T (+ bias)`` through one quantized GEMM op."""

    def __init__(self, in_features: int, out_features: int, scheme: str, kernel: QuantLinearKernel,
                 qweight: torch.Tensor, scales: torch.Tensor, group_size: int,
                 bias: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.scheme, self.kernel, self.group_size = scheme, kernel, group_size
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # A linear on a weight marked quantized: QuantLinearPass turns it into the kernel op.
            w = self.kernel.dequant(self.qweight, self.scales, self.group_size, x.dtype)
            return F.linear(x, w, self.bias)
        y = (self.kernel.eager or self.kernel.op)(x, self.qweight, self.scales, self.group_size)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}, "
                f"kernel={self.kernel.name}, group_size={self.group_size}")


def quantize_weight(w: torch.Tensor, scheme: str, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The canonical (weight, scales) of ``kiln.ops.quant`` for float weight ``w`` [N, K]."""
    if scheme == "int8":
        return quant.quantize_int8(w)
    if scheme == "int4":
        return quant.quantize_int4(w, group_size)
    if scheme == "fp8":
        return quant.quantize_fp8(w)
    raise ValueError(f"unknown quantization scheme {scheme!r}; choose one of {list(QUANT_SCHEMES)}")


def make_quant_linear(linear: nn.Linear, scheme: str, kernels: KernelSet, group_size: int = quant.INT4_GROUP_SIZE,
                      canonical: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> QuantLinear:
    """``linear`` quantized to ``scheme`` (or given its canonical quantized weight) in the layout of
    ``kernels``' kernel, falling back to the reference layout for shapes the kernel does not take.
    A canonical int4 weight brings its own group size (a checkpoint's, per linear)."""
    n, k = linear.out_features, linear.in_features
    if scheme == "int4" and canonical is not None:
        group_size = k // canonical[1].shape[0]
    elif scheme == "int4" and k % group_size:
        group_size = math.gcd(k, group_size)  # the largest group that divides this linear's columns
    gs = group_size if scheme == "int4" else -1
    kernel = kernels.quant_linear(scheme)
    if not kernel.fits(n, k, gs):
        kernel = reference_kernels(kernels.device_type).quant_linear(scheme)
    w, scales = canonical if canonical is not None else quantize_weight(linear.weight.detach(), scheme, group_size)
    if scheme != "fp8":
        scales = scales.to(linear.weight.dtype)
    w, scales = kernel.pack(w.to(linear.weight.device), scales.to(linear.weight.device), gs)
    bias = None if linear.bias is None else linear.bias.detach()
    return QuantLinear(k, n, scheme, kernel, w, scales, gs, bias)


# The LM head of a model quantized to the key, on CUDA, is stored in the value's scheme.
# llama3-8b's bf16 head is 1.05 GB, a fifth of what an int4 decode step reads besides it and a
# third of an FP8 step's; one byte a weight halves it. Weight-only models take int8 per channel
# (a rounding well under int4's groups); an FP8 model takes FP8 per channel, its own precision,
# so that many rows (offline batches) run the FP8 GEMM (``torch._scaled_mm``) as its other linears
# do. With the int8 head, its weight-only GEMM at 476 rows took an offline decode step from 16.5 to
# 18.5 ms (H100, llama3-8b, FP8 + FP8 KV: 18,640 against 20,379 tok/s, 1.37x against 1.50x bf16's
# 13,596; batch 1 alike, 3.23 and 3.26 ms). Elsewhere (the CPU, which
# has its own Q8_0 one-row head, and tied heads) the head stays in the model dtype.
HEAD_SCHEMES = {"int4": "int8", "int8": "int8", "fp8": "fp8"}


def quantize_lm_head(model: nn.Module, scheme: str, kernels: KernelSet) -> Optional[str]:
    """Replace ``model.lm_head`` with a ``QuantLinear`` of ``HEAD_SCHEMES[scheme]`` when the rule
    above says so; returns the head's scheme, or None if it stays as it was."""
    head_scheme = HEAD_SCHEMES.get(scheme)
    head = getattr(model, "lm_head", None)
    if head_scheme is None or kernels.device_type != "cuda" or type(head) is not nn.Linear:
        return None
    model.lm_head = make_quant_linear(head, head_scheme, kernels)
    return head_scheme


def quantizable_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(qualified name, module) of every ``nn.Linear`` but the LM head."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] != "lm_head"]


@torch.no_grad()
def quantize_model(model: nn.Module, scheme: str, kernels: KernelSet, group_size: int = quant.INT4_GROUP_SIZE,
                   canonical: Optional[dict[str, tuple[torch.Tensor, torch.Tensor]]] = None) -> int:
    """Replace the linears in place; ``canonical`` maps a module name to its already-quantized
    weight (a quantized checkpoint). Returns how many linears were quantized."""
    canonical = canonical or {}
    count = 0
    for name, linear in quantizable_linears(model):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make_quant_linear(linear, scheme, kernels, group_size, canonical.get(name)))
        count += 1
    model.quantization = scheme
    return count


# ---- which quantization a checkpoint asks for -----------------------------------------------------

def _quantization_config(hf_dir: Optional[str]) -> Optional[dict]:
    path = None if hf_dir is None else os.path.join(hf_dir, "config.json")
    if path is None or not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f).get("quantization_config") or None


def checkpoint_int4_format(hf_dir: Optional[str]) -> Optional[Int4CheckpointFormat]:
    """The AWQ/GPTQ format of a 4-bit checkpoint, None for any other."""
    qc = _quantization_config(hf_dir)
    return int4_checkpoint_format(qc) if qc and qc.get("quant_method") in ("awq", "gptq") else None


def checkpoint_quantization(hf_dir: Optional[str]) -> str:
    """The scheme a checkpoint's ``quantization_config`` names, or "none"."""
    qc = _quantization_config(hf_dir)
    if not qc:
        return "none"
    method = qc.get("quant_method")
    if method == "fp8":
        return "fp8"
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        for group in groups.values():
            weights = group.get("weights") or {}
            if weights.get("type") == "float" and weights.get("num_bits") == 8:
                return "fp8"
        raise ValueError("this compressed-tensors checkpoint is not FP8; kiln loads only its FP8 weights "
                         "(model.quantization=none cannot load it either)")
    if method in ("awq", "gptq"):
        int4_checkpoint_format(qc)  # refuses the variants kiln does not read
        return "int4"
    raise ValueError(f"quantization_config.quant_method={method!r} is not supported; kiln reads fp8, "
                     f"compressed-tensors (FP8) and 4-bit awq / gptq checkpoints")


def resolve_quantization(requested: str, hf_dir: Optional[str], gguf_path: Optional[str]) -> str:
    """``model.quantization`` with ``auto`` resolved (``quantization_choice``)."""
    return quantization_choice(requested, hf_dir, gguf_path)[0]


def quantization_choice(requested: str, hf_dir: Optional[str], gguf_path: Optional[str]) -> tuple[str, str]:
    """(scheme, why) of ``model.quantization``: ``auto`` follows the source, a GGUF file its own blocks
    (``gguf_quantization``), a checkpoint its ``quantization_config``; any other value is itself."""
    if requested not in QUANTIZATIONS:
        raise ValueError(f"model.quantization={requested!r} is not allowed; choose one of {list(QUANTIZATIONS)}")
    if requested != "auto":
        return requested, f"model.quantization={requested}"
    if gguf_path is not None:
        return gguf_quantization(gguf_path)
    scheme = checkpoint_quantization(hf_dir)
    return scheme, ("the checkpoint's quantization_config" if scheme != "none"
                    else "the checkpoint is not quantized" if hf_dir is not None else "random weights")


# ---- FP8 KV cache scales a checkpoint carries ---------------------------------------------------

# The names vLLM reads: self_attn.k_scale / v_scale (fp8, compressed-tensors), self_attn.kv_scale
# (older: one for both), k_proj.output_scale / v_proj.output_scale (compressed-tensors'
# kv_cache_scheme), k_proj.k_scale / v_proj.v_scale (ModelOpt, Quark), self_attn.attn.k_scale.
_KV_SCALE_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:attn\.|k_proj\.|v_proj\.)?(k_scale|v_scale|kv_scale)$"
    r"|(?:^|\.)layers\.(\d+)\.self_attn\.(k_proj|v_proj)\.output_scale$")


def collect_kv_scales(weights: Iterable[tuple[str, torch.Tensor]],
                      kv_scales: dict[int, list[float]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors without its KV cache scales, which land in ``kv_scales`` as
    {layer: [k_scale, v_scale]} (1.0 for one not given) as the stream is read. A per-head scale
    becomes its largest (one scale per tensor). A cached value times its scale is the real one."""
    for name, t in weights:
        m = _KV_SCALE_NAME.search(name)
        if m is None:
            yield name, t
            continue
        layer = int(m.group(1) or m.group(3))
        which = m.group(2) or {"k_proj": "k_scale", "v_proj": "v_scale"}[m.group(4)]
        value = float(t.float().max())
        if not (value > 0 and value < float("inf")):
            raise ValueError(f"KV cache scale {name!r} is {value}; a scale must be positive and finite")
        entry = kv_scales.setdefault(layer, [1.0, 1.0])
        for i in ((0, 1) if which == "kv_scale" else (0,) if which == "k_scale" else (1,)):
            entry[i] = value


# ---- FP8 checkpoints: fp8 weights with per-tensor, per-channel or block scales --------------------

# kiln scales activations dynamically (a layer's KV cache scales were taken out before: collect_kv_scales)
_STATIC_SCALES = ("input_scale", "k_scale", "v_scale", "output_scale")


def dequantize_fp8_checkpoint(weights: Iterable[tuple[str, torch.Tensor]],
                              dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """An FP8 checkpoint's tensors (``fp8`` / ``compressed-tensors`` formats: float8 ``*.weight``
    with ``*.weight_scale``, or block-wise ``*.weight_scale_inv``) as full weights in ``dtype``,
    one at a time, for ``load_weights``; ``quantize_model`` then stores them per-channel FP8 again.
    Static activation scales are dropped: kiln quantizes activations per token."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights:
        base, _, leaf = name.rpartition(".")
        if leaf in _STATIC_SCALES:
            continue
        if leaf in ("weight_scale", "weight_scale_inv"):
            pending.setdefault(base, {})["scale"] = t
        elif leaf == "weight" and t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            pending.setdefault(base, {})["weight"] = t
        else:
            yield name, t
            continue
        entry = pending[base]
        if "weight" in entry and "scale" in entry:
            yield f"{base}.weight", _dequant_fp8_tensor(entry["weight"], entry["scale"]).to(dtype)
            del pending[base]
    if pending:
        raise ValueError(f"FP8 checkpoint: {sorted(pending)[:3]} lack a weight or its weight_scale")


def _dequant_fp8_tensor(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    s = scale.float()
    if s.numel() == 1:
        return w.float() * s.reshape(())
    if s.numel() == n:  # per output channel
        return w.float() * s.reshape(n, 1)
    if s.dim() == 2:  # blocks of [ceil(N / rows), ceil(K / cols)]
        rows, cols = -(-n // s.shape[0]), -(-k // s.shape[1])
        full = s.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
        return w.float() * full
    raise ValueError(f"FP8 checkpoint: weight_scale of shape {tuple(scale.shape)} does not fit a weight of {(n, k)}")


# ---- GGUF: 4-bit blocks as int4 weights, the Q8_0 LM head -----------------------------------------

# GGUF tensor types whose blocks kiln's int4 weights hold exactly (32 weights per group of q * d + m).
GGUF_INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
# Types kiln serves as they are: Q8_0 as int8 (requantized per output channel), float types unquantized.
GGUF_INT8_TYPES = ("Q8_0",)
GGUF_FLOAT_TYPES = ("F32", "F16", "BF16")
_GGUF_LINEARS = re.compile(r"^blk\.\d+\.(attn_q|attn_k|attn_v|attn_qkv|attn_output|ffn_gate|ffn_up|ffn_down)\.weight$")


# Byte sizes of GGUF metadata value types (gguf's GGUFValueType numbering); 8 is a string, 9 an array.
_GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file, from its header: ``shape`` fastest dimension first (as GGUF lists
    it), ``tensor_type`` gguf's ``GGMLQuantizationType``, ``offset`` and ``nbytes`` its raw bytes'
    place in the file."""

    name: str
    shape: tuple[int, ...]
    tensor_type: Any
    offset: int
    nbytes: int


@functools.lru_cache(maxsize=4)
def _gguf_tensors(path: str, size: int, mtime_ns: int) -> dict[str, GGUFTensor]:
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse_tensors(path, data)
    except (struct.error, ValueError, KeyError, UnicodeDecodeError) as e:
        raise ValueError(f"{path!r} is not a readable GGUF file ({type(e).__name__}: {e}); "
                         "check that it was copied whole") from None


def _parse_tensors(path: str, data) -> dict[str, GGUFTensor]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", data, 0)
    if magic != b"GGUF" or version < 2:
        raise ValueError(f"{path!r} is not a GGUF file of version 2 or later")
    at = 24

    def skip(kind: int, at: int) -> int:
        if kind == 8:
            return at + 8 + struct.unpack_from("<Q", data, at)[0]
        if kind == 9:
            inner, count = struct.unpack_from("<IQ", data, at)
            at += 12
            if inner in _GGUF_SCALAR_SIZES:
                return at + count * _GGUF_SCALAR_SIZES[inner]
            for _ in range(count):
                at = skip(inner, at)
            return at
        return at + _GGUF_SCALAR_SIZES[kind]

    alignment = 32  # GGUF's default, unless general.alignment says otherwise
    for _ in range(n_kv):
        length = struct.unpack_from("<Q", data, at)[0]
        key = data[at + 8:at + 8 + length]
        at += 8 + length
        kind = struct.unpack_from("<I", data, at)[0]
        if key == b"general.alignment" and kind == 4:  # uint32
            alignment = struct.unpack_from("<I", data, at + 4)[0]
        at = skip(kind, at + 4)
    infos = []
    for _ in range(n_tensors):
        length = struct.unpack_from("<Q", data, at)[0]
        name = data[at + 8:at + 8 + length].decode()
        at += 8 + length
        n_dims = struct.unpack_from("<I", data, at)[0]
        shape = struct.unpack_from(f"<{n_dims}Q", data, at + 4)
        at += 4 + 8 * n_dims
        kind, offset = struct.unpack_from("<IQ", data, at)
        at += 12
        infos.append((name, shape, GGMLQuantizationType(kind), offset))
    start = -(-at // alignment) * alignment  # the data section follows the header, aligned
    tensors = {}
    for name, shape, kind, offset in infos:
        block, block_bytes = GGML_QUANT_SIZES[kind]
        tensors[name] = GGUFTensor(name, tuple(int(n) for n in shape), kind, start + offset,
                                   math.prod(shape) // block * block_bytes)
    return tensors


def gguf_tensors(gguf_path: str) -> dict[str, GGUFTensor]:
    """Tensor name -> ``GGUFTensor``, from the file's header alone (gguf's ``GGUFReader`` parses every
    metadata value first, the tokenizer's 100k strings: seconds on 2 cores); remembered per file."""
    st = os.stat(gguf_path)
    return _gguf_tensors(os.path.realpath(gguf_path), st.st_size, st.st_mtime_ns)


def gguf_tensor_types(gguf_path: str) -> dict[str, str]:
    """Tensor name -> GGUF type name (``Q4_1``), from the header alone."""
    return {name: t.tensor_type.name for name, t in gguf_tensors(gguf_path).items()}


@functools.lru_cache(maxsize=1)
def _gguf_bytes(path: str, size: int, mtime_ns: int) -> np.memmap:
    return np.memmap(path, dtype=np.uint8, mode="r")


def gguf_tensor_bytes(gguf_path: str, tensor: GGUFTensor) -> np.ndarray:
    """The tensor's raw bytes (uint8): a view of the file, mapped once per file, not read."""
    st = os.stat(gguf_path)
    return _gguf_bytes(os.path.realpath(gguf_path), st.st_size, st.st_mtime_ns)[tensor.offset:tensor.offset + tensor.nbytes]


def gguf_linear_types(gguf_path: str) -> dict[str, int]:
    """GGUF tensor type name -> how many of the decoder layers' linear weights are stored in it."""
    counts: dict[str, int] = {}
    for name, kind in gguf_tensor_types(gguf_path).items():
        if _GGUF_LINEARS.match(name):
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def gguf_quantization(gguf_path: str) -> tuple[str, str]:
    """(scheme, why) for a GGUF file: the scheme of the type most of its linear weights are stored in."""
    counts = gguf_linear_types(gguf_path)
    if not counts:
        return "none", "the GGUF file has no decoder linear weights kiln recognizes"
    main = max(counts, key=lambda k: (counts[k], k))
    rest = sorted(k for k in counts if k != main)
    if main in GGUF_INT4_TYPES:
        others = [k for k in rest if k not in GGUF_INT4_TYPES]
        return "int4", (f"the GGUF's {main} blocks" + (f"; its {'/'.join(others)} weights requantized to int4 groups"
                                                       if others else ""))
    if main in GGUF_INT8_TYPES:
        return "int8", f"the GGUF's {main} weights, requantized to int8 per output channel"
    if main in GGUF_FLOAT_TYPES:
        return "none", f"the GGUF's weights are {main}"
    return "none", f"kiln has no kernel for the GGUF's {main} blocks: dequantized to float"


def gguf_has_int4(gguf_path: str) -> bool:
    return any(k in GGUF_INT4_TYPES for k in gguf_linear_types(gguf_path))


def q4_1_blocks(data: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A GGUF Q4_1 tensor's raw bytes -> (q uint8 [rows, cols], d float32 [rows, cols/32], m likewise).

    A block is 32 weights in 20 bytes: d (fp16), m (fp16), 16 bytes whose low nibbles are weights
    0..15 and high nibbles 16..31; weight = q * d + m."""
    blocks = np.ascontiguousarray(data).reshape(rows, cols // 32, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:20]
    q = np.concatenate((qs & 0xF, qs >> 4), axis=-1).reshape(rows, cols)
    return q, d, m


def q4_0_blocks(data: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A GGUF Q4_0 tensor's raw bytes -> (q, d, m) as ``q4_1_blocks``'s.

    A block is 32 weights in 18 bytes: d (fp16), then nibbles as Q4_1's; weight = (q - 8) * d."""
    blocks = np.ascontiguousarray(data).reshape(rows, cols // 32, 18)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 2:18]
    q = np.concatenate((qs & 0xF, qs >> 4), axis=-1).reshape(rows, cols)
    return q, d, -8.0 * d


def q4_k_blocks(data: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A GGUF Q4_K tensor's raw bytes -> (q, d, m) as ``q4_1_blocks``'s, one (d, m) per 32 weights.

    A super-block is 256 weights in 144 bytes: d and dmin (fp16), 12 bytes of eight 6-bit scales and
    mins (unpacked by gguf's own ``Q4_K.get_scale_min``), 128 bytes where each 32 bytes hold two
    groups (low nibbles, then high); weight = q * (d * scale) - dmin * min."""
    from gguf.quants import Q4_K

    blocks = np.ascontiguousarray(data).reshape(rows * (cols // 256), 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    qs = blocks[:, 16:144].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & np.uint8(0x0F)).reshape(rows, cols)
    group_d = (d * sc.astype(np.float32)).reshape(rows, cols // 32)
    group_m = -(dmin * mn.astype(np.float32)).reshape(rows, cols // 32)
    return q, group_d, group_m


_GGUF_INT4_READERS = {"Q4_0": q4_0_blocks, "Q4_1": q4_1_blocks, "Q4_K": q4_k_blocks}


def read_gguf_int4(gguf_path: str, num_heads: int, num_kv_heads: int,
                   family: str) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Hugging Face projection name (``model.layers.0.self_attn.q_proj``) -> its 4-bit (q, d, m) for
    every tensor stored as Q4_0, Q4_1 or Q4_K, rows in Hugging Face order (llama.cpp's q/k
    permutation undone, as ``kiln.models.gguf`` does)."""
    from kiln.models.gguf import hf_tensor_name, unpermute_rotary_rows

    out = {}
    for t in gguf_tensors(gguf_path).values():
        reader = _GGUF_INT4_READERS.get(t.tensor_type.name)
        if reader is None or t.name.startswith("token_embd"):
            continue
        cols, rows = t.shape  # GGUF lists the fastest dim first
        q, d, m = reader(gguf_tensor_bytes(gguf_path, t), rows, cols)
        heads = num_heads if ".attn_q." in t.name else num_kv_heads if ".attn_k." in t.name else None
        if family == "llama" and heads is not None:
            q, d, m = (unpermute_rotary_rows(a, heads) for a in (q, d, m))
        out[hf_tensor_name(t.name).removesuffix(".weight")] = (q, d, m)
    return out


def q8_0_blocks(data: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """A GGUF Q8_0 tensor's raw bytes -> (q int8 [rows, cols], d float16 [rows, cols/32]).

    A block is 32 weights in 34 bytes: d (fp16), then 32 int8 values; weight = q * d."""
    blocks = np.ascontiguousarray(data).reshape(rows, cols // 32, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    q = blocks[..., 2:34].copy().view(np.int8).reshape(rows, cols)
    return q, d


def read_gguf_head_q8_0(gguf_path: str, tied: bool) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """The LM head's Q8_0 blocks (``q8_0_blocks``), if the GGUF stores it so: ``output.weight``, or
    for a tied model the embedding ``token_embd.weight``; None otherwise."""
    from gguf import GGMLQuantizationType

    t = gguf_tensors(gguf_path).get("token_embd.weight" if tied else "output.weight")
    if t is None or t.tensor_type != GGMLQuantizationType.Q8_0:
        return None
    cols, rows = t.shape  # GGUF lists the fastest dim first
    return q8_0_blocks(gguf_tensor_bytes(gguf_path, t), rows, cols)


def gguf_canonical_int4(blocks: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
                        dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """kiln module name (``layers.0.self_attn.qkv_proj``) -> canonical int4 (weight, scales_zeros),
    fused projections stacked row-wise in kiln's order."""
    projections = {}
    for hf, (q, d, m) in blocks.items():
        d, m = torch.from_numpy(d), torch.from_numpy(m)
        projections[hf] = (quant.pack_int4(torch.from_numpy(q)), quant.int4_scales_zeros(d, m + 8.0 * d, dtype))
    return fuse_int4_projections(projections)


def shard_int4_projections(model: nn.Module, projections: dict[str, tuple[torch.Tensor, torch.Tensor]]
                           ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each checkpoint projection's canonical int4 cut to the slices ``model.load_weights`` copies of
    its float weight (this rank's rows or input columns; a fused checkpoint tensor's row ranges, in
    order). An input-column slice must hold whole groups."""
    shards: dict[str, list] = {}
    for name, _, shard in model._weight_slices():
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and base in projections:
            shards.setdefault(base, []).append(shard)
    out = {}
    for base, slices in shards.items():
        w, sz = projections[base]  # [N, K/2], [K/g, N, 2]
        if slices == [None]:
            out[base] = (w, sz)
        elif all(s is not None and s[0] == 0 for s in slices):  # output rows
            out[base] = (torch.cat([w.narrow(0, s[1], s[2]) for s in slices]),
                         torch.cat([sz.narrow(1, s[1], s[2]) for s in slices], dim=1))
        elif len(slices) == 1 and slices[0][0] == 1:  # input columns (a row-parallel linear)
            _, start, length = slices[0]
            group = 2 * w.shape[1] // sz.shape[0]
            if start % group or length % group:
                raise ValueError(f"{base}: this rank's {length} input columns do not hold whole int4 groups of "
                                 f"{group}; use a smaller parallel.tensor_parallel_size")
            out[base] = (w.narrow(1, start // 2, length // 2).contiguous(),
                         sz.narrow(0, start // group, length // group).contiguous())
    return out


def fuse_int4_projections(projections: dict[str, tuple[torch.Tensor, torch.Tensor]]
                          ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Hugging Face projection name (``model.layers.0.self_attn.q_proj``) -> canonical int4 becomes
    kiln module name (``layers.0.self_attn.qkv_proj``) -> canonical int4, fused projections stacked
    row-wise in kiln's order (weight rows, scales_zeros' N axis). A fused linear only partly given
    is left out: it is quantized from its float weights instead."""
    out = {}
    by_module: dict[str, list[str]] = {}
    for hf in projections:
        if "." not in hf.removeprefix("model."):
            continue  # lm_head: never quantized by kiln
        parent, proj = hf.removeprefix("model.").rsplit(".", 1)
        fused = next((f for f, parts in FUSED_PROJECTIONS.items() if proj in parts), proj)
        by_module.setdefault(f"{parent}.{fused}", []).append(proj)
    for module, projs in by_module.items():
        parent, fused = module.rsplit(".", 1)
        order = (fused,) if projs == [fused] else FUSED_PROJECTIONS.get(fused, (fused,))  # Phi-3 stores qkv_proj
        if sorted(projs) != sorted(order):
            continue
        parts = [projections[f"model.{parent}.{p}"] for p in order]
        out[module] = (torch.cat([w for w, _ in parts]), torch.cat([sz for _, sz in parts], dim=1))
    return out


def apply_quantization(model: nn.Module, scheme: str, kernels: KernelSet, gguf_path: Optional[str] = None,
                       int4_projections: Optional[dict[str, tuple[torch.Tensor, torch.Tensor]]] = None,
                       group_size: int = quant.INT4_GROUP_SIZE) -> None:
    """Quantize ``model`` (already loaded) to ``scheme``; int4 keeps a GGUF's own blocks, or an AWQ/GPTQ
    checkpoint's (``int4_projections``: Hugging Face projection name -> canonical int4), else groups
    of ``group_size`` columns."""
    if scheme == "none":
        model.quantization = "none"
        return
    canonical, source = None, ""
    if scheme == "int4" and int4_projections:
        canonical = fuse_int4_projections(shard_int4_projections(model, int4_projections))
        source = ", weights from the checkpoint's int4 groups"
    elif scheme == "int4" and gguf_path is not None and gguf_has_int4(gguf_path):
        arch = model.arch
        blocks = read_gguf_int4(gguf_path, arch.num_heads, arch.num_kv_heads, arch.family)
        canonical = gguf_canonical_int4(blocks, next(model.parameters()).dtype)
        source = ", weights from the GGUF's 4-bit blocks"
    if scheme == "int4" and canonical is None:
        source = f", groups of {group_size} columns"
    count = quantize_model(model, scheme, kernels, group_size, canonical=canonical)
    head_scheme = quantize_lm_head(model, scheme, kernels)
    kinds = sorted({m.kernel.name for m in model.modules() if isinstance(m, QuantLinear)})
    logger.info("quantized %d linear layers to %s (%s kernel%s%s)%s", count, scheme, ", ".join(kinds),
                "s" if len(kinds) > 1 else "", source, f", the LM head to {head_scheme}" if head_scheme else "")
