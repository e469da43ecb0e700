"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers, on the CPU.

Each family is a tiny random model built with transformers' own config class and saved with
``save_pretrained``, so kiln reads a real checkpoint directory (per-expert tensors, the family's
config.json keys). Checked: logits of a flat paged batch (mixed lengths, one chunked prefill next
to decodes) within 1e-4 of transformers; greedy tokens of the LLM API that transformers' greedy
``generate`` would write for 32 tokens (each is its argmax after the prompt and the tokens before
it, read from one forward over the whole sequence), with the prompts submitted together, with
chunked prefill and with preemption; the grouped reference op against a dense per-token
definition; config handling.
The Triton kernel's checks are in ``tests/ops/test_triton_moe.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from kiln import LLM, SamplingParams
from kiln.config import ModelConfig
from kiln.models.arch import PRESETS, ArchConfig, is_sparse_layer
from kiln.models.loader import build_empty_model, load_model
from kiln.models.moe import SparseMoeBlock
from kiln.ops.moe import fused_moe_reference
from tests.helpers.hf import MOE_VOCAB, hf_logits, moe_hf_configs, write_toy_tokenizer
from tests.helpers.paged import PagedBatcher, make_kv_caches, run_step, split_rows

CPU = torch.device("cpu")
VOCAB = MOE_VOCAB  # the vocabulary of moe_hf_configs()


def _randomize(model, seed: int = 0) -> None:
    """Weights large enough that every term shows in the logits and the routing varies by token."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)  # not ones: a dropped norm weight shows
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe"])
def moe(request, tmp_path_factory):
    """(transformers model, kiln LoadedModel, checkpoint dir) of the same random weights."""
    from transformers import AutoModelForCausalLM

    config = moe_hf_configs()[request.param]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _randomize(hf)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    write_toy_tokenizer(path)
    loaded = load_model(ModelConfig(model=str(path)), str(path), CPU, torch.float32)
    assert loaded.arch.family == request.param
    assert ArchConfig.from_hf_config(loaded.arch.to_hf_config()) == loaded.arch
    return hf, loaded, str(path)


def _prompts(vocab: int, lens: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]  # no pad/bos/eos ids


def test_paged_batch_logits_match_hf(moe):
    hf, loaded, _ = moe
    layers = loaded.model.layers
    assert sum(isinstance(layer.mlp, SparseMoeBlock) for layer in layers) == 2  # qwen2_moe: layer 1 of 3 dense
    long, short, other = _prompts(VOCAB, [21, 9, 14], seed=1)
    full = {"a": long + [5, 6, 7], "b": short + [8, 9], "c": other}
    ref = {r: hf_logits(hf, ids) for r, ids in full.items()}
    assert all(v.abs().max() > 0.5 for v in ref.values())  # far from zero, so atol is a real bound
    batcher, caches = PagedBatcher(num_blocks=24, block_size=4, seed=3), make_kv_caches(loaded.arch, 24, 4)
    # A chunked prefill of "a" next to decodes of "b" and a whole prefill of "c", then decodes.
    schedule = [{"a": (0, 12), "b": (0, 9), "c": (0, 14)}, {"a": (12, 21), "b": (9, 10)},
                {"b": (10, 11), "a": (21, 22)}, {"a": (22, 23)}, {"a": (23, 24)}]
    for spans in schedule:
        step = batcher.step({r: full[r][s:e] for r, (s, e) in spans.items()})
        logits = split_rows(loaded.model.compute_logits(run_step(loaded.model, caches, step)), step)
        for r, (s, e) in spans.items():
            torch.testing.assert_close(logits[r], ref[r][s:e], atol=1e-4, rtol=1e-4)


PROMPT_LENS = [5, 17, 33, 9, 2, 24]
MAX_TOKENS = 32


def _generate(path: str, **overrides) -> tuple[list[list[int]], LLM]:
    llm = LLM(path, **overrides)
    prompts = _prompts(VOCAB, PROMPT_LENS, seed=7)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.stats()  # nothing left running, no KV block leaked
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == llm.engine.kv_manager.num_usable_blocks
    return [o.outputs[0].token_ids for o in outs], llm


def _assert_hf_greedy(hf, got: list[list[int]]) -> None:
    """transformers' greedy ``generate`` (no end of text, as ignore_eos) would write ``got``: each
    token is its argmax after the prompt and the tokens before it, from one forward per prompt."""
    assert all(len(ours) == MAX_TOKENS for ours in got) and len({tuple(ours) for ours in got}) > 1
    for ids, ours in zip(_prompts(VOCAB, PROMPT_LENS, seed=7), got, strict=True):
        logits = hf_logits(hf, ids + list(ours))  # [prompt + ours, vocab]
        assert list(ours) == logits[len(ids) - 1:-1].argmax(-1).tolist(), ids


@pytest.mark.parametrize("mode", ["together", "chunked_and_preempted"])
def test_greedy_generate_matches_hf(moe, mode, kiln_cache_dir):
    hf, _, path = moe
    overrides = {"cache": {"dir": kiln_cache_dir}}
    if mode == "chunked_and_preempted":
        # Prefills cut into chunks of at most 8 tokens, and 8 blocks of 16 tokens that cannot hold
        # the six requests at once: some are preempted and recomputed.
        overrides = {"scheduler": {"max_num_batched_tokens": 8, "max_num_seqs": 4},
                     "cache": {"dir": kiln_cache_dir, "num_blocks": 8, "enable_prefix_caching": False}}
    got, llm = _generate(path, **overrides)
    if mode == "chunked_and_preempted":
        assert llm.engine.scheduler.num_preemptions > 0
    _assert_hf_greedy(hf, got)


@pytest.mark.slow
def test_compiled_kiln_mode_matches_hf(moe, kiln_cache_dir):
    """The op survives Dynamo capture, the kiln passes (MoEBackendPass) and Inductor."""
    hf, loaded, path = moe
    if loaded.arch.family != "qwen3_moe":
        pytest.skip("one family is enough for the compiled path (the op is the same)")
    got, llm = _generate(path, cache={"dir": kiln_cache_dir}, compile={"mode": "kiln"})
    _assert_hf_greedy(hf, got)


def _dense_moe(x, w13, w2, topk_weights, topk_ids):
    """The definition, one token and one slot at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += topk_weights[t, k] * (w2[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(0, 4, 2), (1, 4, 1), (13, 6, 3), (40, 3, 3)])
def test_grouped_reference_matches_definition(num_tokens, num_experts, top_k):
    from kiln.ops.triton_moe import random_moe_inputs

    args = random_moe_inputs(num_tokens, 24, 20, num_experts, top_k, torch.float32, "cpu", seed=num_tokens)
    torch.testing.assert_close(fused_moe_reference(*args), _dense_moe(*args), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.ops.kiln.fused_moe(*args), _dense_moe(*args), atol=1e-5, rtol=1e-5)
    if num_tokens:
        torch.library.opcheck(torch.ops.kiln.fused_moe.default, args)


def test_moe_config_fields_and_sparse_layers():
    configs = moe_hf_configs()
    mixtral = ArchConfig.from_hf_config(configs["mixtral"].to_dict())
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (4, 2, 96)
    assert mixtral.norm_topk_prob and not mixtral.attention_bias and mixtral.traits.qk_norm is None
    qwen2 = ArchConfig.from_hf_config(configs["qwen2_moe"].to_dict())
    assert qwen2.attention_bias and qwen2.shared_expert_intermediate_size == 80 and not qwen2.norm_topk_prob
    assert [is_sparse_layer(qwen2, i) for i in range(3)] == [True, False, True]
    stepped = dataclasses.replace(qwen2, decoder_sparse_step=2, mlp_only_layers=())
    assert [is_sparse_layer(stepped, i) for i in range(4)] == [False, True, False, True]
    qwen3 = ArchConfig.from_hf_config(configs["qwen3_moe"].to_dict())
    assert qwen3.traits.qk_norm == "head" and qwen3.norm_topk_prob and qwen3.head_dim == 32
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        dataclasses.replace(qwen3, num_experts_per_tok=9)
    with pytest.raises(ValueError, match="o_proj"):
        ArchConfig.from_hf_config({**configs["qwen3_moe"].to_dict(), "attention_bias": True})
    with pytest.raises(ValueError, match="has no experts"):
        dataclasses.replace(PRESETS["tiny"], num_experts=4)
    from kiln.models.parallel import TensorParallel, check_tensor_parallel

    with torch.device("meta"):  # tensor parallelism cuts each expert; expert parallelism places them whole
        cut = SparseMoeBlock(qwen3, TensorParallel(rank=0, size=2))
        placed = SparseMoeBlock(qwen3, TensorParallel(rank=1, size=2, experts=True))
    assert cut.w2.shape == (qwen3.num_experts, qwen3.hidden_size, qwen3.moe_intermediate_size // 2)
    assert placed.w2.shape == (qwen3.num_experts // 2, qwen3.hidden_size, qwen3.moe_intermediate_size)
    assert placed.first_expert == qwen3.num_experts // 2
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        check_tensor_parallel(dataclasses.replace(qwen3, moe_intermediate_size=33), 2)
    with pytest.raises(ValueError, match="num_experts"):
        check_tensor_parallel(dataclasses.replace(qwen3, num_experts=9, num_experts_per_tok=2), 2, experts=True)
    from kiln.config import ParallelConfig

    with pytest.raises(ValueError, match="tensor_parallel_size above 1"):
        ParallelConfig(enable_expert_parallel=True)


def test_moe_presets_have_published_sizes():
    with torch.device("meta"):
        counts = {name: sum(p.numel() for p in build_empty_model(PRESETS[name], torch.device("meta"),
                                                                 torch.bfloat16).parameters())
                  for name in ("mixtral-8x7b", "qwen1.5-moe-a2.7b", "qwen3-30b-a3b")}
    assert counts == {"mixtral-8x7b": 46_702_792_704, "qwen1.5-moe-a2.7b": 14_315_784_192,
                      "qwen3-30b-a3b": 30_532_122_624}
    for name in ("mixtral-8x7b", "qwen1.5-moe-a2.7b", "qwen3-30b-a3b"):
        assert ArchConfig.from_hf_config(PRESETS[name].to_hf_config()) == PRESETS[name]


@pytest.mark.gpu
def test_cuda_graphs_with_triton_moe_match_hf(moe, kiln_cache_dir):
    """On the GPU in float32: the Triton MoE kernel inside full and piecewise CUDA graphs gives
    transformers' greedy tokens (IEEE float32 matmuls in the kernel)."""
    hf, _, path = moe
    got, llm = _generate(path, device="cuda", dtype="float32", cache={"dir": kiln_cache_dir},
                         compile={"mode": "kiln", "cudagraph": "full_and_piecewise", "capture_sizes": (1, 2, 4, 8)})
    compiled = llm.engine.executor.runner.compiled
    assert compiled.kernels.moe.name == "triton" and compiled.full_graphs is not None
    _assert_hf_greedy(hf, got)


@pytest.mark.gpu
def test_qwen2_moe_shapes_capture_in_kiln_mode_on_cuda(kiln_cache_dir):
    """Qwen1.5-MoE's shapes (hidden 2048, a router over 60 experts and a 1-wide shared-expert
    gate: matmuls with unaligned widths) capture in bf16 without a guard on num_tokens."""
    name = "qwen1.5-moe-a2.7b-1l-test"
    PRESETS[name] = dataclasses.replace(PRESETS["qwen1.5-moe-a2.7b"], num_layers=1, vocab_size=4096)
    try:
        llm = LLM(f"random:{name}", device="cuda", dtype="bfloat16", cache={"dir": kiln_cache_dir},
                  compile={"mode": "kiln", "cudagraph": "none"})
        out = llm.generate([[5, 6, 7], [9] * 40], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
    finally:
        del PRESETS[name]
