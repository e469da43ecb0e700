"""What the CUDA-graph tests share: their workloads (prompts padded to a capture size, greedy tokens,
and a mixed workload of decodes, a chunked prefill and a late prefill under a 64-token budget), the
engine it runs on, and CUDA-graph capture emulated on the CPU."""

from __future__ import annotations

import torch

from kiln import SamplingParams

PROMPT_LENS = (5, 17, 33, 64, 3)  # 5 requests: pads to capture size 8


def graph_prompts(vocab: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    """One prompt of random ids (100 up to ``vocab``, at most 40000) per length in ``lens``."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, min(vocab, 40000), (n,), generator=gen).tolist() for n in lens]


def greedy_ids(llm, prompts, max_tokens: int) -> list[list[int]]:
    """The greedy token ids of each prompt, ``max_tokens`` each (eos ignored)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


MIXED_CAPTURE_SIZES = (1, 2, 4, 8, 16, 32)


def mixed_llm(mode: str, cudagraph: str, device: str = "cuda", dtype: str = "float32", model: str = "random:tiny",
              startup: str = "auto"):
    """A 64-token step budget with capture sizes up to 32: steps of 33-64 tokens run without graphs."""
    from kiln import LLM

    return LLM(model=model, dtype=dtype, device=device, max_model_len=1024,
               compile={"mode": mode, "cudagraph": cudagraph, "capture_sizes": MIXED_CAPTURE_SIZES, "startup": startup},
               cache={"kv_cache_memory_gib": 1.0}, scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 64})


def mixed_workload(llm, vocab: int, max_tokens: int = 16, late_after: int = 2) -> dict[str, list[int]]:
    """Greedy tokens of five prompts submitted together and a sixth after ``late_after`` steps that
    shares its first 32 tokens (two blocks: a prefix-cache hit) with the 64-token one. Under a
    64-token budget the steps mix decodes, a chunked prefill and the late prefill. Checks that every
    block is back in the pool at the end."""
    prompts = graph_prompts(vocab)
    late = prompts[3][:32] + graph_prompts(vocab, lens=(8,), seed=1)[0]
    engine = llm.engine
    engine.kv_manager.reset_prefix_cache()  # a rerun on the same engine schedules the same steps
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    tokens: dict[str, list[int]] = {}
    step = 0
    while step <= late_after or engine.has_unfinished_requests():
        if step == late_after:
            engine.add_request("late", late, params)
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert len(tokens) == len(prompts) + 1
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_usable_blocks  # no block leaked
    return tokens


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def emulated_graph(run):
    """CUDA-graph semantics without CUDA: replay re-runs the piece on the inputs it was captured
    with (the same tensors) and copies the results into the captured outputs."""
    outputs = run()

    def replay():
        fresh = run()
        for static, new in zip(_as_list(outputs), _as_list(fresh)):
            static.copy_(new)

    return replay, outputs


def _as_list(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]
