"""The small models and graphs several quantization tests share: a one-layer float model and its
logits over a prefill and a decode step, the FP8 layer graph the fusion passes rewrite, and the
architecture of the tiny checkpoints the quantized-checkpoint tests write."""

from __future__ import annotations

import dataclasses

import torch

from kiln.models.arch import PRESETS
from kiln.models.llama import LlamaForCausalLM
from tests.helpers.paged import PagedBatcher, make_kv_caches, run_step

ARCH = dataclasses.replace(PRESETS["tiny"], num_layers=1, vocab_size=512, max_position_embeddings=512)
NUM_BLOCKS, BLOCK_SIZE = 64, 4


def float_model() -> LlamaForCausalLM:
    """``ARCH`` with seeded random weights large enough that every term shows in the logits."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(ARCH).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.1)
    return model


def step_logits(forward, model) -> torch.Tensor:
    """Logits of a prefill step and a decode step of two requests run through ``forward`` (the model
    or a compiled forward of it); ``model`` computes the logits."""
    g = torch.Generator().manual_seed(0)
    schedule = [{"a": torch.randint(0, 512, (9,), generator=g).tolist(), "b": [5]}, {"a": [3], "b": [7]}]
    batcher = PagedBatcher(NUM_BLOCKS, BLOCK_SIZE, seed=1)
    caches = make_kv_caches(model.arch, NUM_BLOCKS, BLOCK_SIZE)
    out = []
    for new_tokens in schedule:
        hidden = run_step(forward, caches, batcher.step(new_tokens))
        with torch.inference_mode():
            out.append(model.compute_logits(hidden))
    return torch.cat(out)


def fp8_layer(x, res, w_norm, qkv_w, qkv_s, gu_w, gu_s, down_w, down_s):
    """add + RMSNorm -> FP8 GEMM; SiLU-and-mul -> FP8 GEMM; the residual flows on."""
    normed, new_res = torch.ops.kiln.add_rms_norm(x, res, w_norm, 1e-5)
    h = torch.ops.kiln.linear_fp8(normed, qkv_w, qkv_s, -1)
    gate_up = torch.ops.kiln.linear_fp8(h, gu_w, gu_s, -1)
    act = torch.ops.kiln.silu_and_mul(gate_up)
    return torch.ops.kiln.linear_fp8(act, down_w, down_s, -1) + new_res


def checkpoint_arch(preset: str):
    """``preset`` at the size of the quantized checkpoints the tests write (two layers, K of 128 and 256)."""
    return dataclasses.replace(PRESETS[preset], hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2,
                               head_dim=32, num_layers=2, vocab_size=512, max_position_embeddings=512)
