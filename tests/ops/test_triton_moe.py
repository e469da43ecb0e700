"""Triton fused MoE (``kiln/ops/triton_moe.py``) vs the grouped pure-torch reference.

Fresh random inputs per case; shapes with masked tails (hidden and intermediate sizes not multiples
of the tiles), experts that get no token, and each of the three tile configurations. Without CUDA
the kernel runs in Triton's interpreter in a child process (``TRITON_INTERPRET=1`` must be set
before ``triton`` is imported), in float32, where it must match the reference to float32 rounding.
On CUDA: bfloat16 at Qwen3-30B-A3B's expert shapes, and replay from a captured CUDA graph.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.triton_interpreter import run_in_triton_interpreter

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUN_KERNELS_HERE = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(RUN_KERNELS_HERE, reason="kernels run in this process")
def test_kernel_in_triton_interpreter():
    run_in_triton_interpreter(__file__, "not test_kernel_in_triton_interpreter")


@pytest.mark.skipif(not RUN_KERNELS_HERE, reason="CPU: runs in the Triton interpreter")
@pytest.mark.parametrize("num_tokens,hidden,inter,num_experts,top_k", [
    (1, 48, 40, 4, 2),  # decode tiles; two of four experts idle
    (7, 96, 72, 8, 3),
    (60, 40, 24, 5, 2),  # 120 slots: the middle tiles
    (520, 32, 16, 3, 2),  # 1040 slots: the large tiles
])
def test_float32_matches_reference(num_tokens, hidden, inter, num_experts, top_k):
    from kiln.ops.triton_moe import check_against_reference

    err = check_against_reference(num_tokens, hidden, inter, num_experts, top_k, torch.float32, DEVICE,
                                  seed=num_tokens)
    assert err < 1e-5, err


@pytest.mark.skipif(not RUN_KERNELS_HERE, reason="CPU: runs in the Triton interpreter")
def test_alignment_pads_each_expert_to_the_block():
    from kiln.ops.triton_moe import align_by_expert

    ids = torch.tensor([[1, 3], [1, 0], [3, 2]], device=DEVICE)  # slots 0..5; expert 4 gets none
    sorted_ids, block_expert, total = align_by_expert(ids, 5, 4)
    sentinel = 6
    assert int(total) == 16  # experts 0..3 each pad one slot run to 4
    assert block_expert.tolist()[:4] == [0, 1, 2, 3]  # later blocks lie past the total: never read
    runs = sorted_ids[:16].view(4, 4).tolist()
    assert [[s for s in run if s != sentinel] for run in runs] == [[3], [0, 2], [5], [1, 4]]
    assert (sorted_ids[16:] == sentinel).all()


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 64, 512])
def test_bfloat16_qwen3_moe_shapes_match_reference(num_tokens):
    from kiln.ops.triton_moe import check_against_reference

    err = check_against_reference(num_tokens, 2048, 768, 128, 8, torch.bfloat16, DEVICE, seed=num_tokens)
    assert err < 2e-2, err


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
def test_cuda_graph_replay_follows_new_routing():
    """Captured once, replayed with other tokens and experts: no size is read on the host. The
    generic op on CUDA tensors runs the Triton kernel, so it captures too."""
    from kiln.ops.moe import fused_moe_reference
    from kiln.ops.triton_moe import random_moe_inputs  # registers the generic op's CUDA kernel

    x, w13, w2, weights, ids = random_moe_inputs(16, 256, 128, 16, 4, torch.bfloat16, DEVICE, seed=0)
    static = [x.clone(), weights.clone(), ids.clone()]
    torch.ops.kiln.fused_moe(static[0], w13, w2, static[1], static[2])  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.kiln.fused_moe(static[0], w13, w2, static[1], static[2])
    for seed in (1, 2):
        x2, _, _, weights2, ids2 = random_moe_inputs(16, 256, 128, 16, 4, torch.bfloat16, DEVICE, seed=seed)
        for dst, src in zip(static, (x2, weights2, ids2)):
            dst.copy_(src)
        graph.replay()
        want = fused_moe_reference(x2, w13, w2, weights2, ids2).float()
        assert float((out.float() - want).abs().max() / want.abs().max()) < 2e-2


def test_cuda_kernel_set_selects_the_triton_moe():
    from kiln.ops.registry import reference_kernels, select_kernels

    assert select_kernels("cuda").moe.op_name == "kiln_triton::fused_moe" and select_kernels("cuda").moe.fast
    # Choosing the CUDA kernels also gave the generic op its CUDA kernel (graph-safe eager mode).
    assert torch._C._dispatch_has_kernel_for_dispatch_key("kiln::fused_moe", "CUDA")
    assert select_kernels("cpu").moe.op_name == "kiln::fused_moe"
    assert reference_kernels().moe.name == "reference"
