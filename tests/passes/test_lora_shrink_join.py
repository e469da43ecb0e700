"""``LoraShrinkJoinPass``: a LoRA stack whose A lies after its linear's weight (``join_rows``)
becomes one GEMM over both and ``kiln.expand_lora``; the graph's output is unchanged, and a stack
laid out apart (or a biased linear) keeps ``kiln.add_lora``."""

from __future__ import annotations

import pytest
import torch

from kiln.forward_context import ForwardContext, forward_context
from kiln.models.lora import LoraStack, join_rows
from kiln.passes.lora_shrink_join import LoraShrinkJoinPass

NUM_SLOTS, RANK = 3, 4


class _Projection(torch.nn.Module):
    """A qkv-like linear of three slices and its LoRA stack (random adapters in every slot)."""

    def __init__(self, joined: bool, bias: bool = False) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 20, bias=bias)
        sizes = (12, 4, 4)
        lora_a = join_rows(self.proj, NUM_SLOTS, len(sizes) * RANK, torch.float32) if joined else None
        self.lora = LoraStack(16, sizes, NUM_SLOTS, RANK, torch.float32, torch.device("cpu"), lora_a)
        g = torch.Generator().manual_seed(0)
        for s in range(NUM_SLOTS):
            self.lora.write(s, [(torch.randn(RANK, 16, generator=g), torch.randn(RANK, n, generator=g))
                                for n in sizes])

    def forward(self, x):
        return self.lora(self.proj(x), x) * 2


def _ops(gm: torch.fx.GraphModule) -> dict[str, int]:
    names = {"kiln::add_lora": 0, "kiln::expand_lora": 0, "linear": 0}
    for n in gm.graph.nodes:
        name = getattr(getattr(n.target, "_schema", None), "name", None) or getattr(n.target, "_qualified_op_name", "")
        if name in names:
            names[name] += 1
        elif n.target is torch._C._nn.linear:
            names["linear"] += 1
    return names


def _compiled(model: torch.nn.Module, x: torch.Tensor, enabled: bool = True):
    """(ops before the pass, ops after, the rewritten graph's output)."""
    counts = []

    def backend(gm, example_inputs):
        counts.append(_ops(gm))
        LoraShrinkJoinPass(enabled)(gm.graph)
        gm.graph.lint()
        gm.recompile()
        counts.append(_ops(gm))
        return gm.forward

    torch._dynamo.reset()
    torch._dynamo.mark_dynamic(x, 0)  # the token count is symbolic, as in kiln's capture
    out = torch.compile(model, backend=backend, fullgraph=True)(x)
    return counts[0], counts[1], out


def _step(num_tokens: int) -> torch.Tensor:
    return torch.arange(num_tokens, dtype=torch.int32) % (NUM_SLOTS + 1)  # every slot and the base model


@pytest.mark.parametrize("num_tokens", [1, 6])
def test_joined_layout_becomes_one_gemm_and_the_expand(num_tokens):
    torch.manual_seed(1)
    model = _Projection(joined=True)
    x = torch.randn(num_tokens, 16)
    with forward_context(ForwardContext(attn=None, kv_caches=[], lora_slots=_step(num_tokens))):
        want = model(x)
        before, after, got = _compiled(model, x)
    assert before == {"kiln::add_lora": 1, "kiln::expand_lora": 0, "linear": 1}
    assert after == {"kiln::add_lora": 0, "kiln::expand_lora": 1, "linear": 1}
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_join_rows_keeps_the_weight_and_zeroes_the_tail():
    linear = torch.nn.Linear(16, 20, bias=False)
    w = linear.weight.detach().clone()
    tail = join_rows(linear, NUM_SLOTS, 12, torch.float32)
    assert tail.shape == (NUM_SLOTS, 12, 16) and not tail.any()
    assert torch.equal(linear.weight, w)
    assert tail.untyped_storage().data_ptr() == linear.weight.untyped_storage().data_ptr()
    assert tail.storage_offset() == w.numel()
    assert join_rows(torch.nn.Linear(16, 20, bias=True), NUM_SLOTS, 12, torch.float32) is None
    assert join_rows(torch.nn.Linear(16, 20, bias=False).bfloat16(), NUM_SLOTS, 12, torch.float32) is None


@pytest.mark.parametrize("joined,bias,enabled", [(False, False, True), (True, False, False)])
def test_stacks_apart_or_pass_off_keep_add_lora(joined, bias, enabled):
    model = _Projection(joined=joined, bias=bias)
    x = torch.randn(5, 16)
    with forward_context(ForwardContext(attn=None, kv_caches=[], lora_slots=_step(5))):
        want = model(x)
        before, after, got = _compiled(model, x, enabled)
    assert before == after == {"kiln::add_lora": 1, "kiln::expand_lora": 0, "linear": 1}
    torch.testing.assert_close(got, want)
