"""The kernel registry: which kernel runs each kiln op on a device, chosen once into a ``KernelSet``.

Every op kiln's graphs can hold has a generic op (``kiln::<verb>_<noun>``, running the pure-torch
reference) and, per device, kernel ops of the same schema. The registry is one table, read in order;
the first candidate of an op whose device matches and whose loader returns a kernel wins::

    op            cuda                      cpu                             any device
    attention     kiln_triton::attend_paged kiln_cpu::attend_paged (kiln._C) kiln::attend_paged
     (rope_op)    kiln_triton::attend_paged_rope  (none)                    kiln::attend_paged_rope
    add_rms_norm  kiln_triton::add_rms_norm                                  kiln::add_rms_norm
    silu_and_mul  kiln_triton::silu_and_mul                                  kiln::silu_and_mul
    moe           kiln_triton::fused_moe                                     kiln::fused_moe
    argmax        kiln_triton::argmax                                        kiln::argmax
    lora          kiln_triton::add_lora                                      kiln::add_lora
     (expand_op)  kiln_triton::expand_lora                                  kiln::expand_lora
    linear_int8   kiln_cuda::linear_int8    kiln_cpu::linear_int8 (aten)     kiln::linear_int8
                  (Triton)
    linear_int4   kiln_cuda::linear_int4_triton, else kiln_cuda::linear_int4 (aten tinygemm)
                                            kiln_cpu::linear_int4 (aten)     kiln::linear_int4
    linear_fp8    kiln_cuda::linear_fp8 (SM89+; Triton at decode rows,       kiln::linear_fp8
                  _scaled_mm above)
    linear_dense  kiln_cuda::linear_dense (Triton GEMV at one row,          kiln::linear_dense
                  cuBLAS above)
    joined_fp8    kiln_cuda::{add_rms_norm,silu_and_mul}_linear_fp8          kiln::..._linear_fp8
                  (fed GEMV at one row; only with fp8 in kernels.gemv_join), else
                  kiln_triton::..._linear_fp8
    joined_dense  kiln_cuda::{add_rms_norm,silu_and_mul}_linear_dense        (none)
    joined_int4   kiln_cuda::{add_rms_norm,silu_and_mul}_linear_int4         (none)
                  (only with int4 in kernels.gemv_join)

A ``joined_<scheme>`` kernel is the add + RMSNorm or SiLU-and-mul and the GEMM it feeds in one op
(``kiln.ops.joined_linear``), for the GEMM ops it names; none (the graph keeps the ops apart) where
no kernel joins them, on the CPU and in ``reference_kernels``. The one-row joins (the GEMV computes
its input from the feeding op's inputs: ``kiln.ops.triton_joined_linear``) follow
``kernels.gemv_join`` (``gemv_join_schemes``), read when the KernelSet is chosen:

    [dense]     the default (measured faster joined on an H100, llama3-8b batch-1 decode: 5.69 -> 5.44 ms)
    []          none: dense and int4 unjoined, fp8's join runs the norm / activation kernel and
                the GEMV apart at one row (as before the fed GEMVs), to measure against
    [dense,fp8], [dense,int4], [dense,fp8,int4]
                fp8 and int4 too. Off by default because each measured no faster joined: the
                fed GEMV recomputes the norm's row in every program, which the narrow tiles of
                1-byte and half-byte weights do not amortize (H100, same process: fp8 3.50 ->
                3.52 ms a step, int4 2.77 -> 3.66 ms)

``select_kernels(device_type)`` returns the ``KernelSet`` a ``CompiledModel`` is built with, chosen
under the process's kernel options (``kiln.ops.options``), which it keeps as ``KernelSet.options``.
Nothing else here is process-global state: two models on two devices in one process hold two
KernelSets, and the passes, the graph split and CUDA-graph capture read the set they are given.
Loaders import the kernel modules lazily, so choosing CPU kernels never imports Triton.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Optional

import torch

from kiln.config import GEMV_JOIN_SCHEMES, KernelConfig
from kiln.forward_context import ForwardContext
from kiln.ops.attention import AttentionImpl
from kiln.ops.options import current

GENERIC_ATTENTION_OP = "kiln::attend_paged"
QUANT_SCHEMES = ("int8", "int4", "fp8")
JOINED_SCHEMES = GEMV_JOIN_SCHEMES  # ("fp8", "dense", "int4")
FP8_GEMMS = ("kiln::linear_fp8", "kiln_cuda::linear_fp8")  # the GEMM ops an FP8 join takes


def gemv_join_schemes() -> tuple[str, ...]:
    """The schemes whose one-row GEMV joins its feeding op (``kernels.gemv_join``), in
    ``JOINED_SCHEMES`` order."""
    chosen = current().gemv_join
    return tuple(s for s in JOINED_SCHEMES if s in chosen)


def op_name(target: Any) -> Optional[str]:
    """'ns::name' of an op overload or packet; None for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def _no_capture_context(max_seq_len: int) -> ContextManager[None]:
    return contextlib.nullcontext()


def _no_forward_scope(ctx: ForwardContext) -> ContextManager[None]:
    return contextlib.nullcontext()


@dataclass(frozen=True)
class Kernel:
    """One kernel of one op: the op a graph pass writes, and what the kernel is known to be worth."""

    name: str  # "triton", "cpu", "reference": for logs and cache keys
    op: Any  # a torch.ops packet with the generic op's schema
    # Faster than the ops Inductor would generate for the same computation: fusion passes that
    # replace Inductor's code with this op only pay when it is.
    fast: bool = False

    @property
    def op_name(self) -> str:
        name = op_name(self.op)
        if name is None:
            raise TypeError(f"kernel {self.name}: {self.op!r} is not a torch.ops op")
        return name


@dataclass(frozen=True)
class AttentionKernel(Kernel):
    # What the generic op runs in eager and stock modes (through the forward context).
    impl: Optional[AttentionImpl] = None
    # Entered around CUDA-graph capture with the longest context a graph must serve, so launches
    # recorded there stay valid for every batch (the Triton decode kernel sizes its splits by it).
    graph_capture: Callable[[int], ContextManager[None]] = _no_capture_context
    # Entered around every forward with its context, inside ``forward_context`` (the CPU kernel
    # hands the step's caches and metadata to its C++ op there).
    forward_scope: Callable[[ForwardContext], ContextManager[None]] = _no_forward_scope
    # The same kernel on q and k before their rotary (the schema of ``kiln::attend_paged_rope``):
    # what ``RopeAttentionFusionPass`` writes. None: the kernel has none, and the rotary stays in
    # the graph.
    rope_op: Any = None

    @property
    def rope_op_name(self) -> Optional[str]:
        return op_name(self.rope_op) if self.rope_op is not None else None


@dataclass(frozen=True)
class LoraKernel(Kernel):
    """``kiln::add_lora``'s kernel (``op``) and the same kernels' expand alone (``expand_op``, the
    schema of ``kiln::expand_lora``), for a linear whose GEMM computed the shrink."""

    expand_op: Any = None

    @property
    def expand_op_name(self) -> str:
        name = op_name(self.expand_op)
        if name is None:
            raise TypeError(f"kernel {self.name}: {self.expand_op!r} is not a torch.ops op")
        return name


def _no_pack(w: torch.Tensor, scales: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return w, scales


def _fits_any(n: int, k: int, group_size: int) -> bool:
    return True


@dataclass(frozen=True)
class QuantLinearKernel(Kernel):
    """A quantized GEMM (``kiln.ops.quant``): ``op(x, w, scales, group_size)`` on the weight layout
    ``pack`` makes from the canonical one, and ``dequant`` (same arguments plus a dtype) to read
    that layout back. ``fits(N, K, group_size)`` says which shapes the kernel takes."""

    dequant: Any = None
    # What an eager call runs: ``op``'s Python implementation itself where it has one, skipping the
    # custom op's dispatch (about 15 us a call on the CPU, 120 calls a SmolLM2 step).
    eager: Optional[Callable[..., torch.Tensor]] = None
    pack: Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] = _no_pack
    fits: Callable[[int, int, int], bool] = _fits_any
    # The dtype ``op`` computes its activations in, if it casts them (the CPU kernels: bfloat16).
    # ``QuantLinearPass`` then casts in the graph, before and after the op, where Inductor fuses the
    # casts into the kernels around it (the norm writes bfloat16, the residual add reads it): the op
    # converts nothing, and a decode step makes no cast calls (two a linear, 240 a SmolLM2 step).
    activation_dtype: Optional[torch.dtype] = None

    @property
    def dequant_name(self) -> str:
        name = op_name(self.dequant)
        if name is None:
            raise TypeError(f"kernel {self.name}: {self.dequant!r} is not a torch.ops op")
        return name


@dataclass(frozen=True)
class JoinedLinearKernel(Kernel):
    """add + RMSNorm (``op``) and SiLU-and-mul (``silu_op``) joined with the GEMM they feed
    (``kiln.ops.joined_linear``), for a GEMM of quantization ``scheme`` whose op is one of ``gemm_ops``."""

    silu_op: Any = None
    scheme: str = ""
    gemm_ops: tuple[str, ...] = ()


def _joined(name: str, namespace: str, scheme: str, gemm_ops: tuple[str, ...], fast: bool) -> JoinedLinearKernel:
    ns = getattr(torch.ops, namespace)
    return JoinedLinearKernel(name, getattr(ns, f"add_rms_norm_linear_{scheme}"), fast=fast,
                              silu_op=getattr(ns, f"silu_and_mul_linear_{scheme}"), scheme=scheme, gemm_ops=gemm_ops)


def reference_joined(scheme: str) -> JoinedLinearKernel:
    """The pure-torch joined ops of ``scheme``, joining the scheme's generic GEMM op (fp8: and the
    CUDA one, as ``joined_fp8`` has always joined both)."""
    import kiln.ops.dense_linear  # noqa: F401  (defines the ops)
    import kiln.ops.quant  # noqa: F401

    gemm_ops = FP8_GEMMS if scheme == "fp8" else (f"kiln::linear_{scheme}",)
    return _joined("reference", "kiln", scheme, gemm_ops, fast=False)


def _reference_joined_fp8() -> JoinedLinearKernel:
    return reference_joined("fp8")


def _reference_quant(scheme: str) -> QuantLinearKernel:
    import kiln.ops.quant  # noqa: F401  (defines the ops)

    return QuantLinearKernel("reference", getattr(torch.ops.kiln, f"linear_{scheme}"),
                             dequant=getattr(torch.ops.kiln, f"dequant_{scheme}"))


def _reference_linear_dense() -> Kernel:
    import kiln.ops.dense_linear  # noqa: F401  (defines the op)

    return Kernel("reference", torch.ops.kiln.linear_dense)


def _reference_argmax() -> Kernel:
    import kiln.ops.sampling  # noqa: F401

    return Kernel("reference", torch.ops.kiln.argmax)


def _reference_lora() -> LoraKernel:
    import kiln.ops.lora  # noqa: F401  (defines the op)

    return LoraKernel("reference", torch.ops.kiln.add_lora, expand_op=torch.ops.kiln.expand_lora)


def _triton_lora() -> LoraKernel:
    import kiln.ops.triton_lora  # noqa: F401

    return LoraKernel("triton", torch.ops.kiln_triton.add_lora, fast=True, expand_op=torch.ops.kiln_triton.expand_lora)


def _triton_argmax() -> Optional[Kernel]:
    from kiln.ops import quant_cuda

    if not quant_cuda.triton_supported():
        return None
    import kiln.ops.triton_argmax  # noqa: F401

    return Kernel("triton", torch.ops.kiln_triton.argmax, fast=True)


def _reference_int8() -> QuantLinearKernel:
    return _reference_quant("int8")


def _reference_int4() -> QuantLinearKernel:
    return _reference_quant("int4")


def _reference_fp8() -> QuantLinearKernel:
    return _reference_quant("fp8")


@dataclass(frozen=True)
class KernelSet:
    """The kernels of one compiled model, chosen once from the device."""

    device_type: str
    attention: AttentionKernel
    add_rms_norm: Kernel
    silu_and_mul: Kernel
    moe: Kernel
    linear_int8: QuantLinearKernel = field(default_factory=_reference_int8)
    linear_int4: QuantLinearKernel = field(default_factory=_reference_int4)
    linear_fp8: QuantLinearKernel = field(default_factory=_reference_fp8)
    linear_dense: Kernel = field(default_factory=_reference_linear_dense)
    joined_fp8: JoinedLinearKernel = field(default_factory=_reference_joined_fp8)
    joined_dense: Optional[JoinedLinearKernel] = None
    joined_int4: Optional[JoinedLinearKernel] = None
    argmax: Kernel = field(default_factory=_reference_argmax)  # greedy rows' tokens in full graphs
    lora: LoraKernel = field(default_factory=_reference_lora)  # batched LoRA of the targeted linears
    # The kernel options the set was chosen under; the passes read the graph's from here
    # (``kernels.rope_join``), the artifact cache key ``options.graph_factors()``.
    options: KernelConfig = field(default_factory=current)

    def quant_linear(self, scheme: str) -> QuantLinearKernel:
        """The GEMM of quantization ``scheme`` (int8 | int4 | fp8)."""
        return getattr(self, f"linear_{scheme}")

    def split_op_names(self) -> tuple[str, ...]:
        """The ops the graph is split at: the generic attention op, this set's attention kernel and
        its rotating variant (``AttentionKernel.rope_op``) where it has one."""
        names = (GENERIC_ATTENTION_OP, self.attention.op_name, self.attention.rope_op_name)
        return tuple(dict.fromkeys(n for n in names if n is not None))

    def describe(self) -> dict[str, str]:
        """op -> kernel name, for logs and the artifact cache key."""
        rope = self.attention.name if self.attention.rope_op is not None else "none"
        return {"attention": self.attention.name, "attention_rope": rope, "add_rms_norm": self.add_rms_norm.name,
                "silu_and_mul": self.silu_and_mul.name, "moe": self.moe.name, "linear_dense": self.linear_dense.name,
                "argmax": self.argmax.name, "lora": self.lora.name,
                **{f"linear_{s}": self.quant_linear(s).name for s in QUANT_SCHEMES},
                **{f"joined_{s}": getattr(getattr(self, f"joined_{s}"), "name", "none") for s in JOINED_SCHEMES}}


# ---- the table ---------------------------------------------------------------------------------

def _reference_attention() -> AttentionKernel:
    from kiln.ops.attention import attend_paged_reference

    return AttentionKernel("reference", torch.ops.kiln.attend_paged, impl=attend_paged_reference,
                           rope_op=torch.ops.kiln.attend_paged_rope)


def _cpu_attention() -> Optional[AttentionKernel]:
    from kiln.ops import cpu_attention

    if not cpu_attention.load_extension():
        return None
    if not cpu_attention.has_context_op():  # a stale build: the kernel through the Python op
        return AttentionKernel("cpu", torch.ops.kiln_cpu.attend_paged_py, fast=True, impl=cpu_attention.cpu_attend_paged)
    return AttentionKernel("cpu", torch.ops.kiln_cpu.attend_paged, fast=True, impl=cpu_attention.cpu_attend_paged,
                           forward_scope=cpu_attention.attention_context)


def _triton_attention() -> AttentionKernel:
    from kiln.ops import triton_attention

    return AttentionKernel("triton", torch.ops.kiln_triton.attend_paged, fast=True,
                           impl=triton_attention.triton_attend_paged,
                           graph_capture=triton_attention.static_decode_splits,
                           rope_op=torch.ops.kiln_triton.attend_paged_rope)


def _reference_add_rms_norm() -> Kernel:
    import kiln.ops.layernorm  # noqa: F401  (defines the op)

    return Kernel("reference", torch.ops.kiln.add_rms_norm)


def _triton_add_rms_norm() -> Kernel:
    import kiln.ops.triton_norm  # noqa: F401

    return Kernel("triton", torch.ops.kiln_triton.add_rms_norm, fast=True)


def _reference_silu_and_mul() -> Kernel:
    import kiln.ops.activation  # noqa: F401

    return Kernel("reference", torch.ops.kiln.silu_and_mul)


def _triton_silu_and_mul() -> Kernel:
    import kiln.ops.triton_norm  # noqa: F401

    return Kernel("triton", torch.ops.kiln_triton.silu_and_mul, fast=True)


def _reference_moe() -> Kernel:
    import kiln.ops.moe  # noqa: F401

    return Kernel("reference", torch.ops.kiln.fused_moe)


def _triton_moe() -> Kernel:
    import kiln.ops.triton_moe  # noqa: F401

    return Kernel("triton", torch.ops.kiln_triton.fused_moe, fast=True)


def _cpu_int8() -> Optional[QuantLinearKernel]:
    from kiln.ops import quant

    if not quant.cpu_int8_supported():
        return None
    return QuantLinearKernel("cpu", torch.ops.kiln_cpu.linear_int8, fast=True, dequant=torch.ops.kiln.dequant_int8,
                             pack=quant.pack_int8_cpu, eager=quant._linear_int8_cpu,
                             activation_dtype=quant.CPU_COMPUTE_DTYPE)


def _cpu_int4() -> Optional[QuantLinearKernel]:
    from kiln.ops import quant
    from kiln.ops.cpu_linear import gemv_available, int4_takes_float, linear_int4_eager

    if not quant.cpu_int4_supported():
        return None
    # Compiled graphs hold the C++ wrapper when kiln._C is built: one dispatcher call without the
    # Python op's casts and reshapes (about 20 us a call, 120 calls a SmolLM2 decode step). Where that
    # op runs kiln's float32 kernels (AVX2), the graph keeps float32 activations: no bfloat16 round
    # trip (the op would widen x again and round y, two copies a linear).
    op = torch.ops.kiln_cpu.linear_int4_packed if gemv_available() else torch.ops.kiln_cpu.linear_int4
    return QuantLinearKernel("cpu", op, fast=True, dequant=torch.ops.kiln_cpu.dequant_int4,
                             pack=quant.pack_int4_cpu, fits=quant.cpu_int4_fits, eager=linear_int4_eager(),
                             activation_dtype=None if int4_takes_float() else quant.CPU_COMPUTE_DTYPE)


def _cuda_fp8() -> Optional[QuantLinearKernel]:
    from kiln.ops import quant_cuda

    if not quant_cuda.fp8_supported():
        return None
    # Shapes _scaled_mm cannot take run the Triton kernel at every row count.
    return QuantLinearKernel("triton+scaled_mm", torch.ops.kiln_cuda.linear_fp8, fast=True,
                             dequant=torch.ops.kiln.dequant_fp8)


def _triton_int8() -> Optional[QuantLinearKernel]:
    from kiln.ops import quant_cuda

    if not quant_cuda.triton_supported():
        return None
    return QuantLinearKernel("triton", torch.ops.kiln_cuda.linear_int8, fast=True, dequant=torch.ops.kiln.dequant_int8)


def _triton_int4() -> Optional[QuantLinearKernel]:
    from kiln.ops import quant_cuda

    if not quant_cuda.triton_supported():
        return None
    return QuantLinearKernel("triton", torch.ops.kiln_cuda.linear_int4_triton, fast=True,
                             dequant=torch.ops.kiln.dequant_int4, fits=quant_cuda.int4_triton_fits)


def _triton_linear_dense() -> Optional[Kernel]:
    from kiln.ops import quant_cuda

    if not quant_cuda.triton_supported():
        return None
    import kiln.ops.dense_linear  # noqa: F401

    return Kernel("triton", torch.ops.kiln_cuda.linear_dense, fast=True)


def _triton_joined_fp8() -> Optional[JoinedLinearKernel]:
    """Norm / activation apart from the GEMV at one row, quantized rows at prefill (``kiln.ops.triton_quant``)."""
    from kiln.ops import quant_cuda

    if not quant_cuda.fp8_supported():
        return None
    import kiln.ops.triton_quant  # noqa: F401  (defines the ops)

    return _joined("triton", "kiln_triton", "fp8", FP8_GEMMS, fast=True)


def _triton_gemv_joined_fp8() -> Optional[JoinedLinearKernel]:
    """As ``_triton_joined_fp8``, but one fed GEMV kernel at one row (``kiln.ops.triton_joined_linear``)."""
    from kiln.ops import quant_cuda

    if not quant_cuda.fp8_supported() or "fp8" not in gemv_join_schemes():
        return None
    import kiln.ops.triton_joined_linear  # noqa: F401  (defines the ops)

    return _joined("triton_gemv", "kiln_cuda", "fp8", FP8_GEMMS, fast=True)


def _triton_joined(scheme: str, gemm_op: str) -> Optional[JoinedLinearKernel]:
    """The fed one-row GEMV of ``scheme`` joined with its feeding op (``kiln.ops.triton_joined_linear``)."""
    from kiln.ops import quant_cuda

    if not quant_cuda.triton_supported() or scheme not in gemv_join_schemes():
        return None
    import kiln.ops.triton_joined_linear  # noqa: F401  (defines the ops)

    return _joined("triton", "kiln_cuda", scheme, (gemm_op,), fast=True)


def _triton_joined_dense() -> Optional[JoinedLinearKernel]:
    return _triton_joined("dense", "kiln_cuda::linear_dense")


def _triton_joined_int4() -> Optional[JoinedLinearKernel]:
    return _triton_joined("int4", "kiln_cuda::linear_int4_triton")


def _cuda_int4() -> Optional[QuantLinearKernel]:
    from kiln.ops import quant_cuda

    if not quant_cuda.int4_supported():
        return None
    return QuantLinearKernel("tinygemm", torch.ops.kiln_cuda.linear_int4, fast=True,
                             dequant=torch.ops.kiln_cuda.dequant_int4, pack=quant_cuda.pack_int4_cuda,
                             fits=quant_cuda.int4_fits)


ANY_DEVICE = "*"
# op -> ordered (device type, loader); a loader returns None when its kernel cannot run here.
REGISTRY: dict[str, tuple[tuple[str, Callable[[], Optional[Kernel]]], ...]] = {
    "attention": (("cuda", _triton_attention), ("cpu", _cpu_attention), (ANY_DEVICE, _reference_attention)),
    "add_rms_norm": (("cuda", _triton_add_rms_norm), (ANY_DEVICE, _reference_add_rms_norm)),
    "silu_and_mul": (("cuda", _triton_silu_and_mul), (ANY_DEVICE, _reference_silu_and_mul)),
    "moe": (("cuda", _triton_moe), (ANY_DEVICE, _reference_moe)),
    "argmax": (("cuda", _triton_argmax), (ANY_DEVICE, _reference_argmax)),
    "lora": (("cuda", _triton_lora), (ANY_DEVICE, _reference_lora)),
    "linear_int8": (("cuda", _triton_int8), ("cpu", _cpu_int8), (ANY_DEVICE, _reference_int8)),
    "linear_int4": (("cuda", _triton_int4), ("cuda", _cuda_int4), ("cpu", _cpu_int4), (ANY_DEVICE, _reference_int4)),
    "linear_fp8": (("cuda", _cuda_fp8), (ANY_DEVICE, _reference_fp8)),
    "linear_dense": (("cuda", _triton_linear_dense), (ANY_DEVICE, _reference_linear_dense)),
    "joined_fp8": (("cuda", _triton_gemv_joined_fp8), ("cuda", _triton_joined_fp8),
                   (ANY_DEVICE, _reference_joined_fp8)),
    "joined_dense": (("cuda", _triton_joined_dense),),
    "joined_int4": (("cuda", _triton_joined_int4),),
}
OPTIONAL_OPS = ("joined_dense", "joined_int4")  # no kernel: None, and the graph keeps the ops apart


def _choose(op: str, device_type: str) -> Optional[Kernel]:
    for device, load in REGISTRY[op]:
        if device in (device_type, ANY_DEVICE):
            kernel = load()
            if kernel is not None:
                return kernel
    if op in OPTIONAL_OPS:
        return None
    raise LookupError(f"no kernel for {op} on {device_type}")  # unreachable: every other op has a reference


def select_kernels(device_type: str) -> KernelSet:
    """The fastest kernels registered for ``device_type`` ("cuda", "cpu", ...)."""
    return KernelSet(device_type, **{op: _choose(op, device_type) for op in REGISTRY})


def reference_kernels(device_type: str = "cpu") -> KernelSet:
    """The pure-torch references only: the definition every kernel is checked against."""
    return KernelSet(device_type, _reference_attention(), _reference_add_rms_norm(), _reference_silu_and_mul(),
                     _reference_moe())
