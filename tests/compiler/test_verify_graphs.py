"""Speculative decoding's verify steps in full CUDA graphs: which batches replay one, how their
null requests are laid out, that the attention launch captured for a null batch is right for any
real batch replayed over it (Triton interpreter), and that filling proposals up to a uniform batch
leaves the greedy tokens unchanged."""

import os

import numpy as np
import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.compiler.graph_sets import dispatch
from kiln.compiler.cudagraph import FullCUDAGraphs, GraphMode
from kiln.compiler.inputs import InputBuffers, InputLimits, ModelInputs, VerifyShape
from tests.helpers.triton_interpreter import run_in_triton_interpreter

RUN_KERNELS_HERE = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


class _Sizes:
    """Stands in for full, verify or piecewise graphs in dispatch decisions."""

    def __init__(self, *sizes: int, query_len: int = 1) -> None:
        self.sizes, self.query_len = list(sizes), query_len

    def padded_size(self, n):
        return next((s for s in self.sizes if s >= n), None)


def test_uniform_query_len():
    assert ModelInputs(12, 0, [4, 4, 4], [9, 20, 5]).uniform_query_len == 4
    assert ModelInputs(3, 3, [1, 1, 1], [9, 20, 5]).uniform_query_len == 1
    assert ModelInputs(9, 0, [4, 4, 1], [9, 20, 5]).uniform_query_len == 0  # one request without proposals
    assert ModelInputs(0, 0, [], []).uniform_query_len == 0


def test_dispatch_uniform_verify_replays_the_verify_graph():
    full, pieces, verify = _Sizes(1, 2, 4, 8), _Sizes(1, 2, 4, 8, 16, 32, 64), _Sizes(1, 2, 4, query_len=4)
    assert dispatch(full, pieces, 12, 3, 0, verify, 4) == (GraphMode.FULL, 16)  # 3 requests -> size 4, 16 tokens
    assert dispatch(full, pieces, 4, 1, 0, verify, 4) == (GraphMode.FULL, 4)
    assert dispatch(full, pieces, 3, 3, 3, verify, 1) == (GraphMode.FULL, 4)  # plain decodes: the decode graph
    assert dispatch(full, pieces, 9, 3, 0, verify, 0) == (GraphMode.PIECEWISE, 16)  # uneven proposals
    assert dispatch(full, pieces, 9, 3, 0, verify, 3) == (GraphMode.PIECEWISE, 16)  # k + 1 of another k
    assert dispatch(full, pieces, 20, 5, 0, verify, 4) == (GraphMode.PIECEWISE, 32)  # past the verify sizes
    assert dispatch(full, None, 20, 5, 0, verify, 4) == (GraphMode.NONE, 20)
    assert dispatch(None, None, 12, 3, 0, None, 4) == (GraphMode.NONE, 12)


def test_verify_graph_sizes_count_requests_and_stop_at_the_token_budget():
    buf = InputBuffers(InputLimits(max_num_tokens=64, max_num_reqs=32, max_blocks_per_req=4), torch.device("cpu"))
    sizes = (1, 2, 4, 8, 16, 32)
    assert FullCUDAGraphs(None, buf, sizes).sizes == [1, 2, 4, 8, 16, 32]
    assert FullCUDAGraphs(None, buf, sizes, query_len=5).sizes == [1, 2, 4, 8]  # 12 x 5 tokens fit, 16 x 5 do not
    assert FullCUDAGraphs(None, buf, sizes, query_len=5, max_num_reqs=4).sizes == [1, 2, 4]


def test_null_verify_requests_touch_only_the_null_block():
    buf = InputBuffers(InputLimits(max_num_tokens=32, max_num_reqs=8, max_blocks_per_req=4), torch.device("cpu"))
    buf.table_np[:] = 7  # stale rows of earlier steps
    buf.qsl_np[:2] = [0, 3]  # one real request of 3 tokens, then 2 null ones
    buf.fill_null_requests(1, 3, 3, query_len=3)
    assert buf.ids_np[3:9].tolist() == [0] * 6
    assert buf.pos_np[3:9].tolist() == [0, 1, 2, 0, 1, 2]
    assert buf.slot_np[3:9].tolist() == [0] * 6
    assert buf.seq_lens_np[1:3].tolist() == [3, 3]
    assert buf.qsl_np[:4].tolist() == [0, 3, 6, 9]
    assert buf.table_np[1:3, :3].tolist() == [[0, 0, 0], [0, 0, 0]]
    assert buf.table_np[0].tolist() == [7] * 4  # the real request's row is its own
    buf.fill_null_requests(0, 0, 2)  # decodes: as before
    assert buf.qsl_np[:3].tolist() == [0, 1, 2] and buf.seq_lens_np[:2].tolist() == [1, 1]


# ---- the captured attention launch over a replayed batch -------------------------------------------


@pytest.mark.skipif(RUN_KERNELS_HERE, reason="kernels run in this process")
def test_verify_attention_in_triton_interpreter():
    run_in_triton_interpreter(__file__, "captured_verify_attention", 600)


@pytest.mark.parametrize("block_size", [4, 16])
def test_captured_verify_attention_is_right_for_any_batch_replayed_over_it(block_size):
    """Capture sees a batch of null requests (host values: every seq_len = query_len); a replay
    changes only the buffers' device contents. The Triton launch made with the capture's metadata
    must give, on the replayed real batch (3 requests of k + 1 = 4 tokens over long contexts, one
    null request of padding), the reference's output for the real rows, and write no block but
    theirs and the null block."""
    if not RUN_KERNELS_HERE:
        pytest.skip("CPU: run in the Triton interpreter by test_verify_attention_in_triton_interpreter")
    from kiln.ops.attention import attend_paged_reference
    from kiln.ops.triton_attention import static_decode_splits, triton_attend_paged

    q_len, size, max_model_len = 4, 4, 96
    heads, kv_heads, head_dim = 8, 2, 32
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    buf = InputBuffers(InputLimits(max_num_tokens=64, max_num_reqs=8, max_blocks_per_req=max_model_len // block_size),
                       device)
    buf.fill_null_requests(0, 0, size, q_len)
    buf.upload(size * q_len, size)
    capture_meta = buf.metadata(size * q_len, size, 0, [q_len] * size, [q_len] * size)
    # The replayed batch: 3 real requests, each ending in k + 1 = 4 new tokens, then 1 null request.
    gen = torch.Generator().manual_seed(0)
    num_blocks = 3 * (max_model_len // block_size) + 1
    seq_lens = [37, 90, 6]
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 is the null block
    for i, seq_len in enumerate(seq_lens):
        blocks = perm[:-(-seq_len // block_size)]
        perm = perm[len(blocks):]
        buf.table_np[i, :len(blocks)] = blocks
        pos = np.arange(seq_len - q_len, seq_len)
        buf.slot_np[i * q_len:(i + 1) * q_len] = buf.table_np[i, pos // block_size] * block_size + pos % block_size
        buf.seq_lens_np[i] = seq_len
        buf.qsl_np[i + 1] = (i + 1) * q_len
    buf.fill_null_requests(3, 3 * q_len, size, q_len)
    n = size * q_len
    buf.upload(n, size)  # the replay's batch, over the capture's metadata views
    q = torch.randn(n, heads, head_dim, generator=gen).to(device)
    k = torch.randn(n, kv_heads, head_dim, generator=gen).to(device)
    v = torch.randn(n, kv_heads, head_dim, generator=gen).to(device)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(device)
    ref_cache = cache.clone()
    real = 3 * q_len
    ref = attend_paged_reference(q[:real], k[:real], v[:real], ref_cache,
                                 buf.metadata(real, 3, 0, [q_len] * 3, seq_lens), head_dim ** -0.5)
    with static_decode_splits(max_model_len):
        out = triton_attend_paged(q, k, v, cache, capture_meta, head_dim ** -0.5)
    torch.testing.assert_close(out[:real], ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(cache[:, 1:], ref_cache[:, 1:])  # real blocks: the real tokens' K/V and nothing else


# ---- end to end on the CPU -------------------------------------------------------------------------

PROMPTS = [
    "one two three four five one two three four five one two",
    "The capital of France is",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
]


@pytest.mark.slow
def test_filled_proposals_make_uniform_verify_steps_and_keep_the_greedy_tokens(monkeypatch):
    """With verify graphs present the runner fills every speculating request's proposal up to its
    lookahead (``pad_drafts``), so each verify step is uniform; the tokens equal decoding
    without speculation, and only real proposals are counted."""
    import kiln.compiler.graph_sets as graph_sets

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = LLM("smollm2-135m-instruct")
    reference = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    del plain
    llm = LLM("smollm2-135m-instruct", speculative={"method": "ngram", "num_speculative_tokens": 3})
    compiled = llm.engine.executor.runner.compiled
    compiled.verify_graphs = _Sizes(query_len=4)  # no size fits: the step runs as built, laid out as for a graph
    seen = []

    def recording(full, piecewise, num_tokens, num_reqs, num_decodes, verify=None, query_len=0):
        seen.append((num_tokens, num_reqs, query_len))
        return dispatch(full, piecewise, num_tokens, num_reqs, num_decodes, verify, query_len)

    monkeypatch.setattr(graph_sets, "dispatch", recording)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == reference
    verify_steps = [s for s in seen if s[0] > s[1] and s[2] == 4]
    assert verify_steps and all(t == 4 * r for t, r, _ in verify_steps)
    stats = llm.engine.spec_stats
    assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    # Fillers are not counted: fewer proposed tokens than k for every speculating request and step.
    assert stats.num_draft_tokens < 3 * sum(r for _, r, _ in verify_steps)


def test_verify_shape_follows_the_speculative_config():
    from kiln.config import SchedulerConfig, SpeculativeConfig
    from kiln.runtime.model_runner import verify_shape

    shape = verify_shape(SpeculativeConfig(method="ngram", num_speculative_tokens=4, max_batch_size=16),
                         SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))
    assert shape == VerifyShape(query_len=5, max_num_reqs=8)


@pytest.mark.slow
def test_draft_waits_for_each_upload_before_rewriting_its_inputs(monkeypatch):
    """The draft launches k steps without reading anything back; its host mirrors are pinned
    memory that an upload copies asynchronously, so each step must wait for the last upload before
    writing the next (else a step reads the next one's positions). Greedy tokens stay those of
    decoding without speculation."""
    calls = []
    upload, wait = InputBuffers.upload, InputBuffers.wait_for_upload
    monkeypatch.setattr(InputBuffers, "upload", lambda self, *a: (calls.append(("upload", id(self))), upload(self, *a)))
    monkeypatch.setattr(InputBuffers, "wait_for_upload", lambda self: (calls.append(("wait", id(self))), wait(self)))
    llm = LLM("random:tiny", speculative={"method": "draft", "draft_model": "random:tiny", "num_speculative_tokens": 3})
    draft_buffers = id(llm.engine.executor.runner.proposer.compiled.inputs)
    calls.clear()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    draft_calls = [c for c, buf in calls if buf == draft_buffers]
    assert draft_calls.count("upload") > 3
    assert all(prev != "upload" or cur != "upload" for prev, cur in zip(draft_calls, draft_calls[1:]))
    assert llm.engine.spec_stats.num_accepted_tokens == llm.engine.spec_stats.num_draft_tokens > 0
    plain = LLM("random:tiny")
    assert got == [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
