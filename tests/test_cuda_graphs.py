"""CUDA graphs and the CUDA step path: greedy tokens with and without graphs, and against HF.

The ``gpu`` tests need CUDA (skipped without it). The first test runs anywhere: it drives the CUDA
runner's persistent-buffer step path on the CPU (reference attention) and checks it against the
plain CPU path, so the buffer layout is covered by CI.

Exactness: graphs replay the same kernels on padded batches with fixed decode splits, so in
float32 the greedy tokens must agree exactly with the no-graph run; in bfloat16 the rounding of
differently split attention sums may flip a near-tie late in a sequence, so there only the first
tokens must agree and most of the rest.
"""

from __future__ import annotations

import pytest
import torch

from kiln import SamplingParams
from kiln.compiler.cudagraph import GraphMode, StepBuffers, dispatch

PROMPT_LENS = (5, 17, 33, 64, 3)  # 5 requests: pads to capture size 8


def _prompts(vocab: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, min(vocab, 40000), (n,), generator=gen).tolist() for n in lens]


def _greedy(llm, prompts, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _llm(model: str, dtype: str, mode: str, cudagraph: str, device: str = "cuda", **extra):
    from kiln import LLM

    return LLM(model=model, dtype=dtype, device=device, max_model_len=1024,
               compile={"mode": mode, "cudagraph": cudagraph, "capture_sizes": (1, 2, 4, 8)},
               cache={"kv_cache_memory_gib": 1.0}, scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 256},
               **extra)


def test_dispatch_pads_uniform_decodes_only():
    class Sizes:
        sizes = [1, 2, 4, 8]

        def padded_size(self, n):
            return next((s for s in self.sizes if s >= n), None)

    assert dispatch(Sizes(), 5, 5) == (GraphMode.FULL, 8)
    assert dispatch(Sizes(), 5, 4) == (GraphMode.NONE, 5)  # a prefill in the batch
    assert dispatch(Sizes(), 9, 9) == (GraphMode.NONE, 9)  # larger than every capture size
    assert dispatch(None, 1, 1) == (GraphMode.NONE, 1)


def test_buffer_step_path_matches_cpu_path():
    """The persistent-buffer step (the CUDA path) on CPU tensors gives the CPU path's tokens."""
    llm = _llm("random:tiny", "float32", "eager", "none", device="cpu")
    prompts = _prompts(llm.engine.executor.vocab_size)
    want = _greedy(llm, prompts, 12)
    runner = llm.engine.executor.runner
    runner.buffers = StepBuffers(256, 8, -(-runner.max_model_len // runner.block_size), runner.device)
    assert _greedy(llm, prompts, 12) == want


def _agreeing_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "kiln"])
def test_full_graphs_match_no_graphs_float32(mode):
    prompts = _prompts(49152)
    want = _greedy(_llm("random:tiny", "float32", "eager", "none"), prompts, 24)
    llm = _llm("random:tiny", "float32", mode, "full")
    assert llm.engine.executor.runner.cuda_graphs is not None
    assert _greedy(llm, prompts, 24) == want
    assert _greedy(llm, prompts[:1], 24) == want[:1]  # batch 1: capture size 1, no padding


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["random:tiny", "random:qwen2.5-0.5b"])
def test_full_graphs_match_no_graphs_bfloat16(model):
    prompts = _prompts(49152)
    llm = _llm(model, "bfloat16", "eager", "full")
    runner = llm.engine.executor.runner
    got = _greedy(llm, prompts, 32)
    graphs, runner.cuda_graphs = runner.cuda_graphs, None  # the same engine, graph dispatch off
    want = _greedy(llm, prompts, 32)
    runner.cuda_graphs = graphs
    prefixes = [_agreeing_prefix(g, w) for g, w in zip(got, want)]
    assert min(prefixes) >= 4, prefixes
    assert sum(prefixes) >= 0.5 * 32 * len(prompts), prefixes


def _hf_from_kiln(runner):
    """A transformers model holding the kiln model's (random) weights, in the same dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = runner.arch.to_hf_config()
    config = AutoConfig.for_model(d.pop("model_type"), **d)
    hf = AutoModelForCausalLM.from_config(config, dtype=runner.dtype).to(runner.device).eval()
    state = {name: t.detach().clone() for name, t in runner.model._weight_targets()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return hf


@pytest.mark.gpu
def test_full_graphs_match_hf_float32():
    llm = _llm("random:tiny", "float32", "kiln", "full")
    prompts = _prompts(49152, lens=(16, 40))
    got = _greedy(llm, prompts, 16)
    hf = _hf_from_kiln(llm.engine.executor.runner)
    hf.generation_config.eos_token_id = None  # like ignore_eos: an eos token is just a token
    for prompt, tokens in zip(prompts, got):
        ids = torch.tensor([prompt], device="cuda")
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                              pad_token_id=0)
        assert out[0, len(prompt):].tolist() == tokens
