"""``PassManager``: the one ordered list of kiln's graph passes, and how each is applied.

The list (``build_passes``) runs in order; each pass says where it runs (``KilnPass.stage``):

1. ``SDPAToPagedAttentionPass`` (dynamo): a captured transformers model's
   ``scaled_dot_product_attention`` becomes ``kiln.attend_paged``; its dead mask construction goes.
   ``MergeSiblingLinearsPass`` (dynamo): linears of one input whose weights lie end to end in one
   buffer (q/k/v, gate/up of the generic path) -> one GEMM, split.
2. ``AttentionBackendPass`` (dynamo): the generic attention call becomes the KernelSet's kernel op.
   ``RopeAttentionFusionPass`` (dynamo): the rotary of q and k moves into that op's rotating
   variant (``AttentionKernel.rope_op``: the Triton decode kernel rotates as it loads).
   ``MoEBackendPass`` (dynamo): likewise the generic ``kiln.fused_moe`` (mixture-of-experts models).
   ``LoraShrinkJoinPass`` (dynamo): a LoRA stack's A laid out after its linear's weight -> one GEMM
   over both (the shrink) and ``kiln.expand_lora``, in place of the linear and ``kiln.add_lora``.
   ``LoraBackendPass`` (dynamo): likewise the generic ``kiln.add_lora`` / ``kiln.expand_lora`` (a
   model served with adapters).
3. ``QuantLinearPass`` (dynamo): a linear on a dequantized weight -> the KernelSet's quantized GEMM.
   ``DenseLinearPass`` (dynamo): a linear on a bf16/fp16 weight -> the set's dense GEMM (CUDA: a
   Triton GEMV at one row, cuBLAS above).
4. ``NoOpEliminationPass`` (post_grad): views, slices and casts that return their input.
5. ``SiluMulFusionPass`` (post_grad): ``silu(gate) * up`` -> ``kiln.silu_and_mul``.
6. ``AddRMSNormFusionPass`` (post_grad): residual add + RMSNorm -> ``kiln.add_rms_norm``.
7. ``GemmInputFusionPass`` (post_grad): add + RMSNorm or SiLU-and-mul and the GEMM it feeds -> one
   op, the KernelSet's ``joined_<scheme>``: FP8 (quantizes the rows it writes at prefill row
   counts) and dense, one fed GEMV kernel at one row (``kernels.gemv_join``: FP8's and int4's too, or none).
8. ``HeadsViewPass`` (post_grad): heads of a split projection viewed from the whole projection
   (a view of a row-strided part would make Inductor guard on the token count).

``run_dynamo(gm)`` applies the dynamo-stage passes to the captured graph before it is split;
the manager itself is Inductor's ``post_grad_custom_pre_pass`` (a ``CustomGraphPass``) and applies
the post_grad ones to every piece. ``uuid()`` combines the passes' uuids, so Inductor's cache
keys on exactly the passes that ran and their options.

Every pass that writes a kiln op writes the op of the ``KernelSet`` in ``PassConfig.kernels``
(``kiln.ops.registry``), so the graph holds the device's kernel and nothing is looked up later.
Fusions swap Inductor's generated code for an opaque op, so they only pay where that op's kernel
beats Inductor's own fused loop. ``PassConfig.fusion="auto"`` turns them on where the set's kernel
is marked ``fast`` (the Triton kernels on CUDA) and off otherwise: on CPU, Inductor's C++ codegen
already fuses silu*mul and add+RMSNorm into single loops, and the pure-torch references would be
slower.

Failure rule: a pass that raises, or leaves a graph that fails ``Graph.lint()``, is logged and
undone (the graph is restored to its state before that pass); compilation continues without it.
A pass never half-applies.

Not here, on purpose: re-inplacing of functionalized cache writes. ``kiln.attend_paged`` takes
the KV cache from the forward context, so no cache tensor is a graph input and no functionalized
copy of the cache exists for a re-inplacing pass to remove; the cache write happens inside the
opaque attention op (with the rotary, where ``RopeAttentionFusionPass`` moved it there).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from kiln.ops.registry import JoinedLinearKernel, Kernel, KernelSet, reference_kernels
from kiln.passes.add_rms_norm_fusion import AddRMSNormFusionPass
from kiln.passes.attention_backend import AttentionBackendPass
from kiln.passes.base import STAGES, KilnPass, source_hash
from kiln.passes.dense_linear import DenseLinearPass
from kiln.passes.gemm_input_fusion import GemmInputFusionPass
from kiln.passes.heads_view import HeadsViewPass
from kiln.passes.lora_backend import LoraBackendPass
from kiln.passes.lora_shrink_join import LoraShrinkJoinPass
from kiln.passes.merge_linears import MergeSiblingLinearsPass
from kiln.passes.moe_backend import MoEBackendPass
from kiln.passes.noop_elimination import NoOpEliminationPass
from kiln.passes.quant_linear import QuantLinearPass
from kiln.passes.rope_attention_fusion import RopeAttentionFusionPass
from kiln.passes.sdpa_to_paged import SDPAToPagedAttentionPass
from kiln.passes.silu_mul_fusion import SiluMulFusionPass

logger = logging.getLogger(__name__)

# (graph label, pass name, "before" | "after", code)
DumpFn = Callable[[str, str, str, str], None]


@dataclass(frozen=True)
class PassConfig:
    kernels: KernelSet = field(default_factory=reference_kernels)
    fusion: str = "auto"  # auto | on | off (see the module docstring)
    # (sliding window, logit soft-cap) per attention layer of a captured transformers model, for
    # SDPAToPagedAttentionPass (SDPA cannot carry them); () when no layer has either.
    attention_layers: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if self.fusion not in ("auto", "on", "off"):
            raise ValueError(f"PassConfig.fusion={self.fusion!r} is not allowed; choose one of ['auto', 'on', 'off']")

    def fusion_enabled(self, kernel: Kernel) -> bool:
        if self.fusion != "auto":
            return self.fusion == "on"
        return kernel.fast


def build_passes(config: PassConfig) -> list[KilnPass]:
    """The one ordered list."""
    k = config.kernels
    return [
        SDPAToPagedAttentionPass(config.attention_layers),
        MergeSiblingLinearsPass(),
        AttentionBackendPass(k),
        RopeAttentionFusionPass(k, enabled=config.fusion_enabled(k.attention) and k.options.rope_join),
        MoEBackendPass(k),
        LoraShrinkJoinPass(enabled=config.fusion_enabled(k.lora)),
        LoraBackendPass(k),
        QuantLinearPass(k),
        DenseLinearPass(enabled=config.fusion_enabled(k.linear_dense), op=k.linear_dense.op, device_type=k.device_type),
        NoOpEliminationPass(),
        SiluMulFusionPass(enabled=config.fusion_enabled(k.silu_and_mul), op=k.silu_and_mul.op),
        AddRMSNormFusionPass(enabled=config.fusion_enabled(k.add_rms_norm), op=k.add_rms_norm.op),
        GemmInputFusionPass(joins=_joins(config)),
        HeadsViewPass(),
    ]


def _joins(config: PassConfig) -> tuple[JoinedLinearKernel, ...]:
    """The KernelSet's joined kernels that fusion enables: FP8's where its GEMM's kernel is worth
    fusing for (the references join there too, with ``fusion="on"``), dense and int4 where the set
    has a joined kernel at all (the CPU and the reference sets keep the ops apart; int4 on CUDA
    only with int4 in ``kernels.gemv_join``; FP8's one-row fed GEMV only with fp8 in it)."""
    k = config.kernels
    chosen = ((k.joined_fp8, k.linear_fp8), (k.joined_dense, k.joined_dense), (k.joined_int4, k.joined_int4))
    return tuple(join for join, gate in chosen if join is not None and config.fusion_enabled(gate))


def _snapshot(graph: torch.fx.Graph) -> torch.fx.Graph:
    copy = torch.fx.Graph()
    out, out_node = copy.graph_copy(graph, {}, return_output_node=True)
    copy.output(out, type_expr=out_node.type)
    return copy


def _restore(graph: torch.fx.Graph, snapshot: torch.fx.Graph) -> None:
    """Make ``graph`` (owned by its GraphModule, so it must stay the same object) equal ``snapshot``."""
    for node in reversed(list(graph.nodes)):
        node.users.clear()  # a failed pass may leave dangling uses; everything goes anyway
        graph.erase_node(node)
    out, out_node = graph.graph_copy(snapshot, {}, return_output_node=True)
    graph.output(out, type_expr=out_node.type)


class PassManager(CustomGraphPass):
    def __init__(self, passes: list[KilnPass], dump: Optional[DumpFn] = None) -> None:
        for p in passes:
            if p.stage not in STAGES:
                raise ValueError(f"{p.name}.stage={p.stage!r}; choose one of {list(STAGES)}")
        self.passes = passes
        self.dump = dump
        self.label = "graph"  # which graph is being rewritten, for dumps and logs
        self.num_rewrites: dict[str, int] = {p.name: 0 for p in passes}
        self.failed: list[str] = []

    def run_dynamo(self, gm: torch.fx.GraphModule) -> None:
        self._run_stage("dynamo", gm.graph)
        gm.recompile()

    def __call__(self, graph: torch.fx.Graph) -> None:
        self._run_stage("post_grad", graph)

    def uuid(self) -> str:
        h = hashlib.sha256(source_hash(PassManager).encode())
        for p in self.passes:
            h.update(p.uuid().encode())
        return h.hexdigest()

    def _run_stage(self, stage: str, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            if p.stage == stage:
                self._run_one(p, graph)

    def _run_one(self, p: KilnPass, graph: torch.fx.Graph) -> None:
        before = _snapshot(graph)
        if self.dump:
            self.dump(self.label, p.name, "before", before.python_code("self").src)
        try:
            count = p(graph)
            graph.lint()
        except Exception as e:  # noqa: BLE001  (any failure: fall back to the graph without this pass)
            logger.warning("pass %s failed on %s and was skipped (graph restored): %s: %s",
                           p.name, self.label, type(e).__name__, e)
            _restore(graph, before)
            self.failed.append(f"{self.label}:{p.name}")
            return
        self.num_rewrites[p.name] += count
        if count:
            logger.debug("pass %s rewrote %d site(s) in %s", p.name, count, self.label)
        if self.dump:
            self.dump(self.label, p.name, "after", graph.python_code("self").src)
