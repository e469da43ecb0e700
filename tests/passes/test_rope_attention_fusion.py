"""``RopeAttentionFusionPass``: the rotary of q and k moves into ``kiln::attend_paged_rope``.

Graph tests capture tiny models with Dynamo (as kiln's backend does, the token count symbolic),
snapshot the graph's ops before and after the pass, then run the rewritten graph against the
eager model on the same steps (a prefill, decodes beside a prefill chunk, decodes alone): the
outputs and the KV cache written must match. The op's kernels themselves are checked in
``tests/ops/test_triton_attention.py``.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from kiln.compiler import build_forward
from kiln.config import CompileConfig
from kiln.forward_context import ForwardContext, forward_context
from kiln.models.arch import PRESETS
from kiln.models.llama import LlamaForCausalLM
from kiln.ops.registry import op_name, reference_kernels
from kiln.passes.attention_backend import AttentionBackendPass
from kiln.passes.manager import PassConfig
from kiln.passes.rope_attention_fusion import RopeAttentionFusionPass
from tests.helpers.paged import PagedBatcher, make_kv_caches

NUM_BLOCKS, BLOCK_SIZE = 64, 4
SMALL = dict(num_layers=2, vocab_size=256, max_position_embeddings=256)
ARCHS = {
    "llama": dataclasses.replace(PRESETS["tiny"], **SMALL),  # q and k rotate together
    "qwen3": dataclasses.replace(PRESETS["qwen3-8b"], hidden_size=64, intermediate_size=128, num_heads=4,
                                 num_kv_heads=2, head_dim=16, **SMALL),  # per-head norms: one at a time
    "partial": dataclasses.replace(PRESETS["tiny"], partial_rotary_factor=0.5, **SMALL),  # 8 of 16 dims
    "window": dataclasses.replace(PRESETS["tiny"], sliding_window=3, layer_types=("sliding_attention",) * 2,
                                  **SMALL),  # the window is kept
}


def _model(arch) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(arch).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.2)
    return model


def _name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return node.target
    return op_name(node.target) or getattr(node.target, "__name__", str(node.target))


def _counts(graph: torch.fx.Graph) -> collections.Counter:
    return collections.Counter(_name(n) for n in graph.nodes if n.op in ("call_function", "call_method"))


def _steps(vocab: int):
    g = torch.Generator().manual_seed(1)

    def ids(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    return [{"a": ids(6), "b": ids(3)},  # prefills
            {"a": ids(1), "b": ids(1), "c": ids(5)},  # decodes beside a prefill
            {"a": ids(1), "b": ids(1), "c": ids(1)}]  # decodes alone


def _run(forward, arch, steps, dtype=torch.float32, device="cpu"):
    """(hidden states per step, the KV caches after the last step)."""
    batcher = PagedBatcher(NUM_BLOCKS, BLOCK_SIZE, seed=2, device=device)
    caches = make_kv_caches(arch, NUM_BLOCKS, BLOCK_SIZE, dtype, device)
    outs = []
    for new_tokens in steps:
        step = batcher.step(new_tokens)
        ctx = ForwardContext(attn=step.meta, kv_caches=caches)
        with torch.inference_mode(), forward_context(ctx):
            outs.append(forward(step.input_ids, step.positions))
    return outs, caches


def _captured(model, passes):
    """The model captured by Dynamo; ``passes`` rewrite its graph. Returns (forward, graphs) where
    graphs collects (op counts before, op counts after, the rewritten graph)."""
    graphs = []

    def backend(gm, example_inputs):
        before = _counts(gm.graph)
        for p in passes:
            p(gm.graph)
        gm.graph.lint()
        gm.recompile()
        graphs.append((before, _counts(gm.graph), gm.graph))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    return compiled, graphs


@pytest.mark.parametrize("family", list(ARCHS))
def test_pass_moves_the_rotary_into_the_attention_op(family):
    arch = ARCHS[family]
    model = _model(arch)
    steps = _steps(arch.vocab_size)
    want, want_caches = _run(model, arch, steps)
    rope_pass = RopeAttentionFusionPass(reference_kernels(), enabled=True)
    forward, graphs = _captured(model, [AttentionBackendPass(reference_kernels()), rope_pass])
    got, got_caches = _run(forward, arch, steps)
    assert len(graphs) == 1  # one capture served every step
    before, after, graph = graphs[0]
    layers = arch.num_layers
    assert (before["kiln::attend_paged"], before["roll"]) == (layers, layers * (1 if family != "qwen3" else 2))
    assert after["kiln::attend_paged"] == 0 and after["kiln::attend_paged_rope"] == layers
    assert after["roll"] == 0  # every layer's rotary went into the op
    assert before["add"] - after["add"] == before["roll"]  # x * cos + roll(x) * sin: one add a rotation
    assert before["mul"] - after["mul"] >= 2 * before["roll"]
    if family == "partial":
        assert before["cat"] - after["cat"] == layers  # the pass-through dims' cat went too
    # The op takes the tensors before the rotary, then the model's cos and sin tables.
    for node in graph.nodes:
        if _name(node) == "kiln::attend_paged_rope":
            cos, sin = node.args[3], node.args[4]
            assert _name(cos) == _name(sin) == "cat"  # [cos, cos] and [-sin, sin] of LlamaForCausalLM
            if family == "window":
                assert (*node.args[7:], *node.kwargs.values()) == (3,)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    for g, w in zip(got_caches, want_caches, strict=True):
        assert w.abs().sum() > 0
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)


def test_disabled_pass_and_a_set_without_rotating_kernel_change_nothing():
    kernels = reference_kernels()
    no_rope = dataclasses.replace(kernels, attention=dataclasses.replace(kernels.attention, rope_op=None))
    for p in (RopeAttentionFusionPass(kernels, enabled=False), RopeAttentionFusionPass(no_rope, enabled=True)):
        assert not p.enabled and p.options() == {"enabled": False}
    on = RopeAttentionFusionPass(kernels, enabled=True)
    assert on.options() == {"enabled": True, "op": "kiln::attend_paged_rope"}
    assert on.uuid() != RopeAttentionFusionPass(kernels, enabled=False).uuid()
    forward, graphs = _captured(_model(ARCHS["llama"]), [RopeAttentionFusionPass(no_rope, enabled=True)])
    _run(forward, ARCHS["llama"], _steps(256)[:1])
    before, after, _ = graphs[0]
    assert before["roll"] == 2 and before == after


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class _OtherRotaries(torch.nn.Module):
    """Rotaries the pass must not take: transformers' rotate_half (slice-neg-cat), a roll by the
    wrong amount, and a cos that varies per head (the kernel reads one row per token)."""

    def forward(self, x, cos, sin, cos_heads):
        qk = x.view(-1, 6, 16)
        a = qk * cos + _rotate_half(qk) * sin
        b = qk * cos + qk.roll(4, dims=-1) * sin
        c = qk * cos_heads + qk.roll(8, dims=-1) * sin
        outs = []
        for i, r in enumerate((a, b, c)):
            q, k = r.split([4, 2], dim=1)
            outs.append(torch.ops.kiln.attend_paged(q, k, k, i, 0.25))
        return torch.stack(outs)


def test_other_rotaries_are_left_alone():
    x, cos, sin, cos_heads = torch.randn(5, 96), torch.randn(5, 1, 16), torch.randn(5, 1, 16), torch.randn(5, 6, 16)
    rope_pass = RopeAttentionFusionPass(reference_kernels(), enabled=True)
    seen = []

    def backend(gm, example_inputs):
        before = _counts(gm.graph)
        seen.append((rope_pass(gm.graph), before == _counts(gm.graph)))
        return gm.forward

    torch._dynamo.reset()
    with pytest.raises(RuntimeError):  # the op needs a forward context to run; the pass ran before
        torch.compile(_OtherRotaries(), backend=backend, fullgraph=True, dynamic=True)(x, cos, sin, cos_heads)
    assert seen == [(0, True)]


def test_kiln_forward_with_the_rotary_joined_matches_eager():
    """compile.mode=kiln with the pass on (the reference set, fusions forced on): the graph splits
    at the rotating op, the pieces no longer rotate, and the steps give eager's outputs."""
    arch = ARCHS["llama"]
    model = _model(arch)
    steps = _steps(arch.vocab_size)
    forward = build_forward(model, CompileConfig(mode="kiln"), PassConfig(kernels=reference_kernels(), fusion="on"))
    got, got_caches = _run(forward, arch, steps)
    want, want_caches = _run(model, arch, steps)
    assert forward.backend.passes.num_rewrites["RopeAttentionFusionPass"] == arch.num_layers
    for g, w in zip([*got, *got_caches], [*want, *want_caches], strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3", "partial"])
def test_cuda_kiln_forward_rotates_in_the_triton_kernel(family, kernel_config):
    """On CUDA the pass is on by default and writes the Triton op: its steps (prefill, decodes
    beside a chunk, decodes alone, where the decode kernel rotates) match the same model compiled
    with ``kernels.rope_join=false``, outputs and cache."""
    arch = dataclasses.replace(ARCHS[family], head_dim=64, hidden_size=256, num_heads=4, num_kv_heads=2)
    if family == "qwen3":
        arch = dataclasses.replace(arch, intermediate_size=256)
    model = _model(arch).cuda()
    steps = _steps(arch.vocab_size)
    joined = build_forward(model, CompileConfig(mode="kiln"))
    got = _run(joined, arch, steps, device="cuda")
    assert joined.backend.passes.num_rewrites["RopeAttentionFusionPass"] == arch.num_layers
    kernel_config(rope_join=False)
    apart = build_forward(model, CompileConfig(mode="kiln"))
    want = _run(apart, arch, steps, device="cuda")
    assert apart.backend.passes.num_rewrites["RopeAttentionFusionPass"] == 0
    for g, w in zip([*got[0], *got[1]], [*want[0], *want[1]], strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_rope_op_calibrates_fp8_scales_on_the_rotated_keys():
    """A step that calibrates an FP8 cache's scales measures them on the rotated keys: the rope
    op then sets the same scales, cache and output as the plain op on rotated q and k."""
    from kiln.ops.attention import rotate_reference
    from kiln.ops.paged_batch import PagedBatchSpec, random_paged_batch

    spec = PagedBatchSpec(decode_seq_lens=(9,), prefill_chunks=((26, 10),), num_heads=4, num_kv_heads=2, head_dim=16)
    batch = random_paged_batch(spec, seed=3)
    cache0 = batch.kv_cache.to(torch.float8_e4m3fn)
    angles = torch.rand(batch.q.shape[0], 1, 8) * 50
    cos, sin = torch.cat((angles.cos(),) * 2, -1), torch.cat((-angles.sin(), angles.sin()), -1)
    # Rotation moves mass between the halves of each key: its amax differs from the unrotated one.
    assert rotate_reference(batch.k, cos, sin).abs().amax() != batch.k.abs().amax()
    results = []
    for rope in (True, False):
        cache, kv_scale = cache0.clone(), torch.ones(2)
        ctx = ForwardContext(attn=batch.meta, kv_caches=[cache], kv_scales=[kv_scale], calibrate_kv_scales=True)
        with torch.inference_mode(), forward_context(ctx):
            if rope:
                out = torch.ops.kiln.attend_paged_rope(batch.q, batch.k, batch.v, cos, sin, 0, 0.25)
            else:
                q, k = rotate_reference(batch.q, cos, sin), rotate_reference(batch.k, cos, sin)
                out = torch.ops.kiln.attend_paged(q, k, batch.v, 0, 0.25)
        results.append((out, cache.view(torch.uint8), kv_scale))
    assert results[0][2].ne(1.0).all()
    for got, want in zip(*results):
        assert torch.equal(got, want)
