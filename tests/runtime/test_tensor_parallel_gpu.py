"""Tensor parallelism on two GPUs (NCCL) against one: fp32 ``random:tiny``, where a different
all-reduce order moves a logit by about 1e-6, far less than the gap between the best two logits of
any step of these prompts, so greedy tokens must agree over all 32 steps and the top logprobs (the
logits less each step's logsumexp: what the engine returns) must stay within 1e-4. bf16 models,
whose near-ties may flip legitimately, are checked on their logits by ``python -m benchmarks.offline tp-check``."""

import gc
import random

import pytest
import torch

from kiln import LLM, SamplingParams
from tests.helpers.parallel import assert_same_completions

pytestmark = pytest.mark.multi_gpu

NUM_STEPS = 32
PROMPTS = [[random.Random(0).randrange(1000, 30000) for _ in range(128)], "The capital of France is"]
GREEDY = SamplingParams(max_tokens=NUM_STEPS, temperature=0.0, ignore_eos=True, logprobs=20)


def _generate(kiln_cache_dir, tp: int, mode: str, cudagraph: str):
    llm = LLM("random:tiny", dtype="float32", device="cuda", compile={"mode": mode, "cudagraph": cudagraph},
              cache={"dir": kiln_cache_dir, "kv_cache_memory_gib": 1.0},
              parallel={"tensor_parallel_size": tp, "backend": "uni" if tp == 1 else "mp"})
    try:
        return [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()  # TP = 1 ran in this process: its GPU memory goes back before the ranks start
        torch.cuda.empty_cache()


@pytest.mark.parametrize("mode,cudagraph", [("eager", "none"), ("kiln", "full")])
def test_tp2_fp32_greedy_tokens_and_logprobs_match_tp1(mode, cudagraph, kiln_cache_dir):
    single = _generate(kiln_cache_dir, 1, mode, cudagraph)
    sharded = _generate(kiln_cache_dir, 2, mode, cudagraph)
    assert all(len(o.token_ids) == NUM_STEPS for o in single)
    margins = [a - b for o in single for a, b in (sorted(lp.values(), reverse=True)[:2] for lp in o.logprobs)]
    assert min(margins) > 1e-3, "a near-tie in the reference: these prompts cannot tell a bug from rounding"
    assert_same_completions(sharded, single, atol=1e-4)
