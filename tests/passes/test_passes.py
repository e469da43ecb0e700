"""Graph passes on small traced graphs: each test snapshots the graph before and after a pass,
counts ops, and checks the rewritten graph computes what the original did.

Post-grad passes are tested on graphs traced like Inductor's input (aten level, Inductor's
decompositions, symbolic shapes) and run with the graph's fake mode installed, as Inductor does.
"""

from __future__ import annotations

import collections
import logging

import pytest
import torch
import torch.nn.functional as F
from torch._guards import detect_fake_mode
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.virtualized import V
from torch.fx.experimental.proxy_tensor import make_fx

from kiln.ops.activation import silu_and_mul_reference
from kiln.ops.layernorm import add_rms_norm_reference, rms_norm_reference
from kiln.ops.options import kernel_options
from kiln.passes.add_rms_norm_fusion import AddRMSNormFusionPass
from kiln.ops.registry import AttentionKernel, KernelSet, reference_kernels, select_kernels
from kiln.passes.attention_backend import AttentionBackendPass
from kiln.passes.base import KilnPass
from kiln.passes.heads_view import HeadsViewPass
from kiln.passes.manager import PassConfig, PassManager, build_passes
from kiln.passes.noop_elimination import NoOpEliminationPass
from kiln.passes.silu_mul_fusion import SiluMulFusionPass

aten = torch.ops.aten


def trace(fn, *args) -> torch.fx.GraphModule:
    return make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="symbolic")(*args)


def op_counts(gm: torch.fx.GraphModule) -> collections.Counter:
    """Snapshot: how many calls of each op the graph holds (short names: 'mul', 'silu_and_mul')."""
    return collections.Counter(
        str(n.target).split(".")[-2] if str(n.target).count(".") >= 2 else str(n.target)
        for n in gm.graph.nodes if n.op == "call_function"
    )


def apply(manager: PassManager, gm: torch.fx.GraphModule) -> None:
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    with V.set_fake_mode(detect_fake_mode(vals)):
        manager(gm.graph)
    gm.recompile()


# ---- NoOpEliminationPass --------------------------------------------------------------------------

def _with_noops(x):
    same = aten.reshape.default(x, [x.shape[0], x.shape[1]])  # same shape: no-op
    full = aten.slice.Tensor(same, 1, 0, 9223372036854775807)  # the full range: no-op
    cast = torch.ops.prims.convert_element_type.default(full, torch.float32)  # same dtype: no-op
    split = aten.reshape.default(x, [-1, 2, 4])  # a real reshape: kept
    return cast * 2 + split.sum()


def test_noop_elimination_removes_identity_views_slices_and_casts():
    x = torch.randn(3, 8)
    gm = trace(_with_noops, x)
    before = op_counts(gm)
    assert before["view"] == 2 and before["slice"] == 1 and before["convert_element_type"] == 1
    manager = PassManager([NoOpEliminationPass()])
    apply(manager, gm)
    after = op_counts(gm)
    assert after["view"] == 1 and after["slice"] == 0 and after["convert_element_type"] == 0
    assert after["mul"] == before["mul"] and after["sum"] == 1
    assert manager.num_rewrites["NoOpEliminationPass"] == 3
    torch.testing.assert_close(gm(x), _with_noops(x), rtol=0, atol=0)
    torch.testing.assert_close(gm(torch.randn(5, 8)).shape, torch.Size([5, 8]))  # still dynamic


def test_noop_elimination_keeps_partial_slices():
    def f(x):
        return aten.slice.Tensor(x, 1, 0, 4) * 2

    gm = trace(f, torch.randn(3, 8))
    apply(PassManager([NoOpEliminationPass()]), gm)
    assert op_counts(gm)["slice"] == 1


# ---- HeadsViewPass ----------------------------------------------------------------------------------

def _split_heads(qkv):
    """q/k/v heads of a fused projection viewed after the split (Qwen3's q/k norms, transformers)."""
    q, k, v = qkv.split([32, 16, 16], dim=-1)
    q, k, v = q.reshape(-1, 4, 8), k.reshape(-1, 2, 8), v.reshape(-1, 2, 8)
    return (q * 2).sum(-1), k.float() + 1, v[:, :, :4].contiguous()


def _split_batched_heads(qkv):
    """transformers' layout: [1, T, N] viewed as [1, T, heads, D]; k from a step-1 slice. (The split's
    sizes fix N: a real projection's width is known.)"""
    q, kv = qkv.split([32, 32], dim=-1)
    k = qkv[..., 32:48]
    return q.reshape(1, -1, 4, 8).transpose(1, 2) * 3, k.reshape(1, -1, 2, 8) + 1, kv.sum(-1)


@pytest.mark.parametrize("fn,shape,parts,splits_left", [(_split_heads, (5, 64), 3, 0),
                                                        (_split_batched_heads, (1, 5, 64), 2, 1)])
def test_heads_view_takes_heads_of_the_whole_projection(fn, shape, parts, splits_left):
    qkv = torch.randn(shape)
    gm = trace(fn, qkv)
    want = [n.meta["val"].stride() for n in gm.graph.nodes if n.op == "call_function" and "view" in str(n.target)]
    before = op_counts(gm)
    manager = PassManager([HeadsViewPass()])
    apply(manager, gm)
    after = op_counts(gm)
    assert manager.num_rewrites["HeadsViewPass"] == parts
    assert after["view"] == 1 and before["view"] == parts  # one heads view of the whole projection
    assert after["split_with_sizes"] == splits_left  # a split whose parts were all viewed goes
    sliced = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.slice.Tensor
              and n.args[0].target is aten.view.default]
    assert [n.meta["val"].stride() for n in sliced] == want  # the same tensors: same strides
    for n in (3, 1):
        x = torch.randn(*shape[:-2], n, shape[-1])
        for got, ref in zip(gm(x), fn(x), strict=True):
            torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_heads_view_leaves_views_that_are_not_whole_heads_alone():
    def f(qkv):
        a, b = qkv.split([20, 44], dim=-1)  # 20 columns: not whole heads of 8 (nor of 20: 64 % 20)
        c = qkv[:, 4:36]  # starts inside a head of 8
        return a.reshape(-1, 2, 10) * 2, b.sum(-1), c.reshape(-1, 4, 8) + 1

    qkv = torch.randn(5, 64)
    gm = trace(f, qkv)
    before = op_counts(gm)
    manager = PassManager([HeadsViewPass()])
    apply(manager, gm)
    assert manager.num_rewrites["HeadsViewPass"] == 0 and op_counts(gm) == before


# ---- SiluMulFusionPass ------------------------------------------------------------------------------

def _mlp(x, w_gate_up, w_down):
    gate, up = (x @ w_gate_up).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w_down


def test_silu_mul_fusion_rewrites_split_silu_mul():
    x, w1, w2 = torch.randn(5, 8), torch.randn(8, 32), torch.randn(16, 8)
    gm = trace(_mlp, x, w1, w2)
    before = op_counts(gm)
    assert before["split"] == 1 and before["exp"] == 1 and before["silu_and_mul"] == 0
    manager = PassManager([SiluMulFusionPass()])
    apply(manager, gm)
    after = op_counts(gm)
    assert after["silu_and_mul"] == 1
    assert after["split"] == after["exp"] == after["neg"] == after["div"] == 0
    assert after["mm"] == 2
    torch.testing.assert_close(gm(x, w1, w2), _mlp(x, w1, w2))


@pytest.mark.parametrize("swapped", [True, False])
def test_silu_mul_fusion_leaves_other_products_alone(swapped):
    """silu(up) * gate is not silu_and_mul; nor is silu(a) * b of two unrelated tensors."""
    def halves_swapped(x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(up) * gate

    def unrelated(a, b):
        return F.silu(a) * b

    fn, args = (halves_swapped, (torch.randn(4, 16),)) if swapped else (unrelated, (torch.randn(4, 8), torch.randn(4, 8)))
    gm = trace(fn, *args)
    before = op_counts(gm)
    apply(PassManager([SiluMulFusionPass()]), gm)
    assert op_counts(gm) == before
    torch.testing.assert_close(gm(*args), fn(*args))


def test_silu_mul_fusion_disabled_is_a_noop():
    gm = trace(_mlp, torch.randn(5, 8), torch.randn(8, 32), torch.randn(16, 8))
    before = op_counts(gm)
    apply(PassManager([SiluMulFusionPass(enabled=False)]), gm)
    assert op_counts(gm) == before


# ---- AddRMSNormFusionPass ---------------------------------------------------------------------------

def _decoder_tail(x, residual, w_norm, w_next, eps):
    """Residual add, RMSNorm, the next matmul; the new residual is an output too (as in a layer)."""
    new_residual = residual + x
    return rms_norm_reference(new_residual, w_norm, eps) @ w_next, new_residual


@pytest.mark.parametrize("dtype,eps", [(torch.float32, 1e-5), (torch.float32, 1e-6), (torch.bfloat16, 1e-5)])
def test_add_rms_norm_fusion(dtype, eps):
    args = [torch.randn(6, 16, dtype=dtype), torch.randn(6, 16, dtype=dtype),
            torch.randn(16, dtype=dtype), torch.randn(16, 16, dtype=dtype)]

    def fn(x, residual, w_norm, w_next):
        return _decoder_tail(x, residual, w_norm, w_next, eps)

    gm = trace(fn, *args)
    before = op_counts(gm)
    assert before["rsqrt"] == 1 and before["mean"] == 1 and before["add"] >= 2
    manager = PassManager([AddRMSNormFusionPass()])
    apply(manager, gm)
    after = op_counts(gm)
    assert after["add_rms_norm"] == 1
    assert after["rsqrt"] == after["mean"] == after["pow"] == 0
    fused = next(n for n in gm.graph.nodes if "add_rms_norm" in str(n.target))
    assert fused.args[3] == eps
    for got, want in zip(gm(*args), fn(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_add_rms_norm_fusion_gives_the_op_rows_of_a_batched_model():
    """transformers' modeling code keeps a batch dimension ([1, T, hidden]); the kernels take rows,
    so the fused op must be called on [T, hidden] views (else a kernel falls back to its reference)."""
    args = [torch.randn(1, 6, 16), torch.randn(1, 6, 16), torch.randn(16), torch.randn(16, 16)]

    def fn(x, residual, w_norm, w_next):
        return _decoder_tail(x, residual, w_norm, w_next, 1e-6)

    gm = trace(fn, *args)
    apply(PassManager([AddRMSNormFusionPass()]), gm)
    fused = [n for n in gm.graph.nodes if "add_rms_norm" in str(n.target)]
    assert len(fused) == 1
    for arg in fused[0].args[:2]:
        assert arg.meta["val"].dim() == 2 and tuple(arg.meta["val"].shape) == (6, 16)
    for got, want in zip(gm(*args), fn(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_add_rms_norm_fusion_leaves_plain_rms_norm():
    """The first layer's norm has no residual add: nothing to fuse."""
    def fn(x, w):
        return rms_norm_reference(x, w, 1e-5)

    gm = trace(fn, torch.randn(4, 16), torch.randn(16))
    before = op_counts(gm)
    apply(PassManager([AddRMSNormFusionPass()]), gm)
    assert op_counts(gm) == before


# ---- MergeSiblingLinearsPass ------------------------------------------------------------------------

class _Attention(torch.nn.Module):
    """q/k/v projections of one input (with biases) and an output projection of another."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(16, 12, bias=bias)
        self.k_proj = torch.nn.Linear(16, 4, bias=bias)
        self.v_proj = torch.nn.Linear(16, 4, bias=bias)
        self.o_proj = torch.nn.Linear(12, 16, bias=False)

    def forward(self, x):
        q = self.q_proj(x).view(1, -1, 3, 4)
        k, v = self.k_proj(x).view(1, -1, 1, 4), self.v_proj(x).view(1, -1, 1, 4)
        return self.o_proj((q * k.sum(-1, keepdim=True) + v).flatten(2))


def _dynamo_linears_after_merge(model: torch.nn.Module, x: torch.Tensor,
                                target=torch._C._nn.linear) -> tuple[int, int, torch.Tensor]:
    """(linears captured, linears after the pass, the rewritten graph's output); ``target`` is the
    linear counted."""
    from kiln.passes.merge_linears import MergeSiblingLinearsPass

    counts = []

    def backend(gm, example_inputs):
        count = lambda: sum(n.target in (target, getattr(target, "default", None)) for n in gm.graph.nodes)  # noqa: E731
        counts.append(count())
        MergeSiblingLinearsPass()(gm.graph)
        gm.graph.lint()
        gm.recompile()
        counts.append(count())
        return gm.forward

    torch._dynamo.reset()
    torch._dynamo.mark_dynamic(x, 1)  # the token count is symbolic, as in kiln's capture
    out = torch.compile(model, backend=backend, fullgraph=True)(x)
    return counts[0], counts[1], out


@pytest.mark.parametrize("bias", [True, False])
def test_merge_sibling_linears_joins_adjacent_weights_of_one_input(bias):
    from kiln.models.hf_generic import lay_out_sibling_linears

    torch.manual_seed(0)
    model = _Attention(bias)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert lay_out_sibling_linears(model) == 1  # q, k, v (and o when it has no bias): one buffer
    model.load_state_dict(state)
    x = torch.randn(1, 5, 16)
    want = model(x)
    before, after, got = _dynamo_linears_after_merge(model, x)
    assert (before, after) == (4, 2)  # q, k, v -> one GEMM; o reads another input
    torch.testing.assert_close(got, want)


@pytest.mark.skipif(not __import__("kiln.ops.cpu_linear").ops.cpu_linear.gemv_available(),
                    reason="kiln._C not built with the CPU GEMVs")
def test_merge_sibling_linears_joins_kiln_cpu_gemv_linears():
    """A CPU model's float32 linears are kiln's GEMV op (``prepare_cpu_decode``): they merge into one
    such op, whose one-row output matches the model's."""
    from kiln.models.hf_generic import lay_out_sibling_linears
    from kiln.ops.cpu_linear import use_decode_gemv

    torch.manual_seed(0)
    model = _Attention(bias=True)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert lay_out_sibling_linears(model) == 1
    model.load_state_dict(state)
    assert use_decode_gemv(model) == 4
    for tokens in (1, 5):  # one row: the GEMV; more: F.linear inside the op
        x = torch.randn(1, tokens, 16)
        want = model(x)
        before, after, got = _dynamo_linears_after_merge(model, x, torch.ops.kiln_cpu.linear_f32)
        assert (before, after) == (4, 2)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_merge_sibling_linears_leaves_separate_weights_alone():
    model = _Attention(bias=True)  # each linear owns its weight: nothing is adjacent
    x = torch.randn(1, 5, 16)
    before, after, got = _dynamo_linears_after_merge(model, x)
    assert before == after == 4
    torch.testing.assert_close(got, model(x))


# ---- AttentionBackendPass and the split points ------------------------------------------------------

@torch.library.custom_op("kiln_test::attend_paged", mutates_args=())
def _test_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, scale: float) -> torch.Tensor:
    return q * scale


@_test_kernel.register_fake
def _(q, k, v, layer_idx, scale):
    return torch.empty_like(q)


def _attention_graph() -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    q, k, v = (graph.placeholder(n) for n in "qkv")
    o = graph.call_function(torch.ops.kiln.attend_paged, (q, k, v, 0, 0.25))
    graph.output(graph.call_function(torch.ops.kiln.attend_paged, (o, k, v, 1, 0.25)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _test_kernels(device_type: str = "cpu") -> KernelSet:
    """The reference set with the test op as its attention kernel."""
    import dataclasses

    return dataclasses.replace(reference_kernels(device_type),
                               attention=AttentionKernel("test", torch.ops.kiln_test.attend_paged))


def test_attention_backend_pass_swaps_in_the_kernel_set_op():
    gm = _attention_graph()
    assert AttentionBackendPass(reference_kernels())(gm.graph) == 0  # the reference: untouched
    kernels = _test_kernels()
    # The test kernel has no rotating variant (AttentionKernel.rope_op None): no third split op.
    assert kernels.split_op_names() == ("kiln::attend_paged", "kiln_test::attend_paged")
    manager = PassManager([AttentionBackendPass(kernels)])
    manager.run_dynamo(gm)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.kiln_test.attend_paged] * 2
    assert manager.num_rewrites["AttentionBackendPass"] == 2
    assert AttentionBackendPass(reference_kernels("cuda"))(_attention_graph().graph) == 0
    assert reference_kernels().split_op_names() == ("kiln::attend_paged", "kiln::attend_paged_rope")
    # Two sets never interfere: building one changes nothing the other's pass writes.
    assert AttentionBackendPass(kernels).options() != AttentionBackendPass(reference_kernels()).options()


def test_split_graph_cuts_at_every_attention_call():
    from kiln.compiler.split import split_graph

    graph = torch.fx.Graph()
    q, k, v = (graph.placeholder(n) for n in "qkv")
    q2 = graph.call_function(torch.mul, (q, 2))
    o = graph.call_function(torch.ops.kiln.attend_paged, (q2, k, v, 0, 0.25))
    o2 = graph.call_function(torch.add, (o, 1))
    o3 = graph.call_function(torch.ops.kiln.attend_paged, (o2, k, v, 1, 0.25))
    graph.output(graph.call_function(torch.neg, (o3,)))
    split_gm, pieces = split_graph(torch.fx.GraphModule(torch.nn.Module(), graph))
    assert [p.is_split_op for p in pieces] == [False, True, False, True, False]


# ---- PassManager: order, uuid, fallback -------------------------------------------------------------

class _BrokenPass(KilnPass):
    """Rewrites half the graph, then fails: the manager must undo the half."""

    def __call__(self, graph: torch.fx.Graph) -> int:
        node = next(n for n in graph.nodes if n.op == "call_function")
        node.target = aten.sub.Tensor
        raise RuntimeError("pattern went wrong")


def test_failing_pass_is_logged_and_undone(caplog):
    x, w1, w2 = torch.randn(5, 8), torch.randn(8, 32), torch.randn(16, 8)
    gm = trace(_mlp, x, w1, w2)
    before = op_counts(gm)
    manager = PassManager([_BrokenPass(), SiluMulFusionPass()])
    with caplog.at_level(logging.WARNING, logger="kiln.passes.manager"):
        apply(manager, gm)
    assert "_BrokenPass failed" in caplog.text and "pattern went wrong" in caplog.text
    assert manager.failed == ["graph:_BrokenPass"]
    after = op_counts(gm)
    # The broken pass left no trace (no sub), and the passes after it still ran.
    assert after["sub"] == 0 and after["silu_and_mul"] == 1 and after["mm"] == before["mm"]
    torch.testing.assert_close(gm(x, w1, w2), _mlp(x, w1, w2))


def test_rope_join_switch_keys_the_pass_list():
    """``kernels.rope_join=false`` (the options a KernelSet is chosen under) turns the rotary pass
    off where it would run, and the pass list's uuid (the artifact cache key's) changes with it."""
    on = PassManager(build_passes(PassConfig(kernels=select_kernels("cuda"))))
    with kernel_options(rope_join=False):
        off = PassManager(build_passes(PassConfig(kernels=select_kernels("cuda"))))
    assert {p.name: p.options() for p in off.passes}["RopeAttentionFusionPass"] == {"enabled": False}
    assert on.uuid() != off.uuid()


def test_uuid_tracks_source_and_options():
    assert SiluMulFusionPass().uuid() == SiluMulFusionPass().uuid()
    assert SiluMulFusionPass(enabled=True).uuid() != SiluMulFusionPass(enabled=False).uuid()
    assert NoOpEliminationPass().uuid() != SiluMulFusionPass().uuid()
    on = PassManager(build_passes(PassConfig(fusion="on"))).uuid()
    off = PassManager(build_passes(PassConfig(fusion="off"))).uuid()
    assert on != off


def test_pass_list_order_and_auto_fusion():
    names = [p.name for p in build_passes(PassConfig())]
    assert names == ["SDPAToPagedAttentionPass", "MergeSiblingLinearsPass", "AttentionBackendPass",
                     "RopeAttentionFusionPass", "MoEBackendPass", "LoraShrinkJoinPass", "LoraBackendPass",
                     "QuantLinearPass",
                     "DenseLinearPass", "NoOpEliminationPass", "SiluMulFusionPass", "AddRMSNormFusionPass",
                     "GemmInputFusionPass", "HeadsViewPass"]
    cpu = {p.name: p.options() for p in build_passes(PassConfig(kernels=select_kernels("cpu")))}
    cuda = {p.name: p.options() for p in build_passes(PassConfig(kernels=select_kernels("cuda")))}
    assert cpu["SiluMulFusionPass"] == {"enabled": False}  # no CPU kernel beats Inductor's loop
    assert cuda["SiluMulFusionPass"] == {"enabled": True, "op": "kiln_triton::silu_and_mul"}
    assert cuda["AddRMSNormFusionPass"] == {"enabled": True, "op": "kiln_triton::add_rms_norm"}
    assert cuda["MoEBackendPass"] == {"device_type": "cuda", "kernel": "kiln_triton::fused_moe"}
    assert cpu["MoEBackendPass"] == {"device_type": "cpu", "kernel": "kiln::fused_moe"}
    assert cuda["LoraBackendPass"] == {"device_type": "cuda", "kernel": "kiln_triton::add_lora",
                                       "expand_kernel": "kiln_triton::expand_lora"}
    assert cpu["LoraBackendPass"] == {"device_type": "cpu", "kernel": "kiln::add_lora",
                                      "expand_kernel": "kiln::expand_lora"}
    assert cuda["LoraShrinkJoinPass"] == {"enabled": True} and cpu["LoraShrinkJoinPass"] == {"enabled": False}
    assert not cpu["DenseLinearPass"]["enabled"]  # the CPU's dense linear is F.linear itself
    # The rotary joins the attention op where the set's kernel rotates (Triton) and fusions are on.
    assert cpu["RopeAttentionFusionPass"] == {"enabled": False}
    assert cuda["RopeAttentionFusionPass"] == {"enabled": True, "op": "kiln_triton::attend_paged_rope"}
    off = {p.name: p.options() for p in build_passes(PassConfig(kernels=select_kernels("cuda"), fusion="off"))}
    assert off["RopeAttentionFusionPass"] == {"enabled": False}
    assert select_kernels("cuda").split_op_names() == ("kiln::attend_paged", "kiln_triton::attend_paged",
                                                       "kiln_triton::attend_paged_rope")
    with pytest.raises(ValueError, match="fusion"):
        PassConfig(fusion="sometimes")


# ---- the fused ops against their references ---------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_op_matches_reference(dtype):
    x = torch.randn(7, 2 * 24, dtype=dtype)
    out = torch.ops.kiln.silu_and_mul(x)
    gate, up = x[:, :24], x[:, 24:]
    torch.testing.assert_close(out, F.silu(gate) * up)
    torch.testing.assert_close(out, silu_and_mul_reference(x))
    torch.library.opcheck(torch.ops.kiln.silu_and_mul.default, (x,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_op_matches_reference(dtype):
    x, res, w = torch.randn(5, 32, dtype=dtype), torch.randn(5, 32, dtype=dtype), torch.randn(32, dtype=dtype)
    normed, new_res = torch.ops.kiln.add_rms_norm(x, res, w, 1e-6)
    want_res = res + x
    want = w * (want_res.float() * torch.rsqrt(want_res.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    torch.testing.assert_close(new_res, want_res, rtol=0, atol=0)
    torch.testing.assert_close(normed, want)
    torch.testing.assert_close((normed, new_res), add_rms_norm_reference(x, res, w, 1e-6))
    torch.library.opcheck(torch.ops.kiln.add_rms_norm.default, (x, res, w, 1e-6))
