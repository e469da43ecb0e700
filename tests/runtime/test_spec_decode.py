"""Speculative decoding: the n-gram proposer, verification (greedy and exact rejection sampling),
lookahead slots in the scheduler and KV manager, and end to end against decoding without it."""

import math

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from kiln.runtime.kv_cache_manager import KVCacheManager
from kiln.runtime.ngram_proposer import propose_ngram
from kiln.runtime.rejection_sampler import verify
from kiln.runtime.request import Request, RequestStatus
from kiln.runtime.sampler import Sampler
from kiln.runtime.scheduler import Scheduler

def chisquare_pvalue(observed, expected) -> float:
    """Pearson's chi-square goodness-of-fit p-value (df = cells - 1), via the upper regularized
    incomplete gamma function: P(X > x) = Q(df / 2, x / 2)."""
    observed, expected = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    expected = expected * observed.sum() / expected.sum()
    stat = ((observed - expected) ** 2 / expected).sum()
    df = torch.tensor((observed.numel() - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(df, stat / 2).item()


def test_chisquare_pvalue_matches_known_values():
    assert chisquare_pvalue([50, 50], [50, 50]) == pytest.approx(1.0)
    assert chisquare_pvalue([60, 40], [50, 50]) == pytest.approx(0.0455, abs=1e-4)  # x = 4, df = 1
    assert chisquare_pvalue([30, 30, 40], [40, 30, 30]) == pytest.approx(math.exp(-35 / 12))  # x = 35/6, df = 2


# ---- n-gram proposer ------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_longest_latest_match():
    contexts = [
        [1, 2, 3, 4, 9, 8, 1, 2, 3],  # "1 2 3" seen at 0: propose 4 9 8
        [5, 6, 7],  # no earlier occurrence
        [4, 1, 2, 7, 7, 3, 1, 2, 5, 5, 5, 1, 2],  # "1 2" twice: the latest followed by k tokens wins
        [8, 9, 8, 9, 8],  # n = 3 "8 9 8" at 0 wins over n = 2; only 2 tokens follow it
        [7],
    ]
    got = propose_ngram(contexts, [3, 3, 3, 3, 2], min_n=2, max_n=3)
    assert got == [[4, 9, 8], [], [5, 5, 5], [9, 8], []]
    # near the end of the context a repeat proposes what there is; k caps the proposal
    assert propose_ngram([[3, 1, 2, 3, 4, 1, 2]], [2], 1, 3) == [[3, 4]]
    assert propose_ngram([[7] * 10], [4], 2, 4) == [[7, 7, 7, 7]]
    assert propose_ngram([[1, 2, 1, 2]], [0], 1, 2) == [[]]


def test_ngram_matches_a_per_request_reference_on_random_contexts():
    gen = torch.Generator().manual_seed(0)

    def reference(ctx, k, min_n, max_n):
        for n in range(max_n, min_n - 1, -1):
            if len(ctx) < n + 1:
                continue
            suffix = ctx[-n:]
            hits = [w for w in range(len(ctx) - n) if ctx[w:w + n] == suffix]
            if hits:
                full = [w for w in hits if w + n + k <= len(ctx)]
                w = full[-1] if full else hits[0]
                return ctx[w + n:w + n + k]
        return []

    contexts = [torch.randint(0, 4, (int(n),), generator=gen).tolist()
                for n in torch.randint(1, 40, (64,), generator=gen)]
    ks = torch.randint(1, 6, (64,), generator=gen).tolist()
    assert propose_ngram(contexts, ks, 2, 4) == [reference(c, k, 2, 4) for c, k in zip(contexts, ks)]


# ---- verification ---------------------------------------------------------------------------------


def _requests(n, **params):
    return [Request(f"r{i}", [1, 2, 3], SamplingParams(**params)) for i in range(n)]


def test_greedy_verification_keeps_drafts_up_to_the_first_mismatch():
    vocab = 10
    argmax = [[4, 5, 6, 7], [1, 2, 3], [9]]  # per request, per row
    drafts = [[4, 5, 0], [1, 8], []]
    rows = [t for r in argmax for t in r]
    logits = torch.randn(len(rows), vocab) - 10
    logits[torch.arange(len(rows)), torch.tensor(rows)] = 10
    out = verify(Sampler(), logits, _requests(3, temperature=0.0, logprobs=1), drafts).result()
    assert out.token_ids == [[4, 5, 6], [1, 2], [9]]
    assert out.num_accepted == [2, 1, 0]
    lsm = logits.log_softmax(-1)
    assert [list(e) [0] for e in out.logprobs[0]] == [4, 5, 6]
    assert out.logprobs[0][2][6] == pytest.approx(lsm[2, 6].item())
    assert out.logprobs[1][1][2] == pytest.approx(lsm[5, 2].item())


def _target_probs(logits, temperature, top_k):
    """The sampler's distribution for one row: temperature, then the top-k kept."""
    scaled = logits / temperature
    kth = scaled.topk(top_k).values[-1]
    return scaled.masked_fill(scaled < kth, float("-inf")).softmax(-1)


def _chi2_pvalue(samples, probs):
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return chisquare_pvalue(counts[keep].tolist(), (probs[keep].double() * len(samples)).tolist())


def _wrong_verify(logits, drafts, temperature, top_k, gen):
    """A classic mistake: on a rejection, draw from p itself instead of p without the draft."""
    p = torch.stack([_target_probs(row, temperature, top_k) for row in logits])  # [k + 1, V]
    out = []
    for _ in range(len(drafts)):
        tokens = []
        for i, d in enumerate(drafts[0] + [None]):
            if d is not None and torch.rand((), generator=gen) < p[i, d]:
                tokens.append(d)
                continue
            tokens.append(int(torch.multinomial(p[i], 1, generator=gen)))
            break
        out.append(tokens)
    return out


def test_rejection_sampling_keeps_the_target_distribution_and_the_test_can_fail():
    """Many requests, each with the same logits and drafts: the first emitted token must follow
    row 0's distribution, the second (after a kept d_1) row 1's. A sampler that skips removing
    the rejected draft fails the same test."""
    torch.manual_seed(0)
    vocab, trials, temperature, top_k = 8, 6000, 0.8, 5
    logits = torch.randn(3, vocab) * 1.5
    p0, p1 = (_target_probs(logits[i], temperature, top_k) for i in range(2))
    d1, d2 = int(p0.argmax()), int(p1.argsort()[-2])  # a likely and a less likely proposal
    drafts = [[d1, d2]] * trials
    out = verify(Sampler(seed=1), logits.repeat(trials, 1), _requests(trials, temperature=temperature,
                                                                       top_k=top_k), drafts).result()
    first = torch.tensor([t[0] for t in out.token_ids])
    second = torch.tensor([t[1] for t in out.token_ids if len(t) > 1])
    assert _chi2_pvalue(first, p0) > 1e-3
    assert _chi2_pvalue(second, p1) > 1e-3
    assert (first == d1).float().mean() == pytest.approx(p0[d1].item(), abs=0.03)  # drafts are kept
    wrong = _wrong_verify(logits, [[d1, d2]] * trials, temperature, top_k, torch.Generator().manual_seed(2))
    assert _chi2_pvalue(torch.tensor([t[0] for t in wrong]), p0) < 1e-6


def test_seeded_verification_does_not_depend_on_the_batch():
    torch.manual_seed(3)
    logits = torch.randn(9, 50)
    params = SamplingParams(temperature=1.0, seed=1234)
    alone = verify(Sampler(seed=0), logits[:3], [Request("s", [1], params)], [[5, 6]]).result()
    others = _requests(2, temperature=1.0)
    crowded = verify(Sampler(seed=7), torch.cat([logits[3:6], logits[:3], logits[6:]]),
                     [others[0], Request("s", [1], params), others[1]], [[1, 2], [5, 6], [3, 3]]).result()
    assert crowded.token_ids[1] == alone.token_ids[0]


def test_penalties_see_the_kept_drafts():
    """Row 1 of a request with repetition_penalty sees d_1 in its output: a draft token that is the
    argmax of row 1 only without the penalty is rejected."""
    logits = torch.zeros(2, 6)
    logits[0, 3] = 5.0  # row 0: d_1 = 3 kept
    logits[1, 3], logits[1, 4] = 5.0, 4.0  # row 1: 3 best raw, 4 best once 3 is penalized
    req = Request("p", [1], SamplingParams(temperature=0.0, repetition_penalty=2.0))
    assert verify(Sampler(), logits, [req], [[3]]).result().token_ids == [[3, 4]]


# ---- scheduler and KV manager ---------------------------------------------------------------------


def _scheduler(k=3, num_blocks=32, max_batch_size=8, **config):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=4, enable_prefix_caching=True)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=k, max_batch_size=max_batch_size)
    config = {"max_num_seqs": 128, "max_num_batched_tokens": 2048, **config}
    return Scheduler(SchedulerConfig(**config), kv, spec), kv


def test_lookahead_slots_are_budgeted_allocated_and_given_back():
    scheduler, kv = _scheduler(k=5)
    req = Request("a", list(range(10, 17)), SamplingParams(max_tokens=20))  # 7 prompt tokens
    scheduler.add_request(req)
    out = scheduler.schedule()
    assert [(s.num_new_tokens, s.num_lookahead_tokens) for s in out.scheduled] == [(7, 0)]  # a prefill
    scheduler.update(out, {"a": 50})
    free_before = kv.num_free_blocks
    out = scheduler.schedule()
    s = out.scheduled[0]
    assert (s.num_new_tokens, s.num_lookahead_tokens) == (6, 5)  # token 7, then 5 slots: positions 7..12
    assert len(s.block_ids) == 4 and kv.num_free_blocks == free_before - 2
    scheduler.update(out, {"a": [51]})  # every proposal rejected: one token, the 4th block goes back
    assert req.num_computed_tokens == 8 and req.output_token_ids == [50, 51]
    assert kv.get_block_ids("a") == s.block_ids[:3] and kv.num_free_blocks == free_before - 1
    out = scheduler.schedule()
    assert out.scheduled[0].num_lookahead_tokens == 5
    scheduler.update(out, {"a": [52, 53, 54, 55, 56, 57]})  # all 5 kept, plus one
    assert req.num_computed_tokens == 14 and req.num_tokens == 15
    assert len(kv.get_block_ids("a")) == 4  # positions 8..13 computed; 14 gets its slot next step
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_lookahead_never_passes_max_tokens_and_update_stops_at_eos():
    scheduler, kv = _scheduler(k=4)
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=3), eos_token_ids=(2,))
    scheduler.add_request(req)
    scheduler.update(scheduler.schedule(), {"a": 9})
    out = scheduler.schedule()
    assert out.scheduled[0].num_lookahead_tokens == 1  # 2 more tokens at most: 1 + 1
    scheduler.update(out, {"a": [9, 9]})
    assert req.status is RequestStatus.FINISHED_LENGTH and req.output_token_ids == [9, 9, 9]
    req = Request("b", [1, 2, 3], SamplingParams(max_tokens=10), eos_token_ids=(2,))
    scheduler.add_request(req)
    scheduler.update(scheduler.schedule(), {"b": 9})
    scheduler.update(scheduler.schedule(), {"b": [9, 2, 9, 9]})  # eos second: the rest dropped
    assert req.status is RequestStatus.FINISHED_STOPPED and req.output_token_ids == [9, 9, 2]
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_no_speculation_above_max_batch_size():
    scheduler, _ = _scheduler(k=2, max_batch_size=1)
    for rid in "ab":
        scheduler.add_request(Request(rid, [1, 2, 3], SamplingParams(max_tokens=10)))
    scheduler.update(scheduler.schedule(), {"a": 5, "b": 5})
    assert [s.num_lookahead_tokens for s in scheduler.schedule().scheduled] == [0, 0]


def test_draft_needs_a_model_and_the_one_process_backend():
    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig.from_kwargs(speculative={"method": "draft"})
    with pytest.raises(ValueError, match="parallel.backend=uni"):
        EngineConfig.from_kwargs(speculative={"method": "ngram"}, parallel={"backend": "mp"})
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        SpeculativeConfig(method="ngram", prompt_lookup_min=4, prompt_lookup_max=2)


# ---- end to end -----------------------------------------------------------------------------------

REPEATING = [
    "A B C D E F G A B C D E F G A B C D E F G A B",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "The capital of France is",
    "one two three four five one two three four five one two",
]


def _greedy_tokens(llm, prompts, max_tokens=12):
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _assert_no_leak(llm):
    stats = llm.engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == llm.engine.kv_manager.num_usable_blocks


@pytest.fixture(scope="module")
def smol_reference(kiln_cache_dir):
    llm = LLM("smollm2-135m-instruct")
    return _greedy_tokens(llm, REPEATING)


def test_greedy_tokens_identical_with_ngram_speculation_on_smollm2(smol_reference):
    """The one end-to-end check of the default suite: prompt lookup on the real model, with some
    proposals kept and some rejected, gives the tokens of decoding without it and leaks no block."""
    ngram = LLM("smollm2-135m-instruct", speculative={"method": "ngram", "num_speculative_tokens": 3})
    assert _greedy_tokens(ngram, REPEATING) == smol_reference
    stats = ngram.engine.spec_stats
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    _assert_no_leak(ngram)


@pytest.mark.slow
def test_greedy_identical_with_a_small_random_draft_under_chunked_prefill_and_preemption(smol_reference):
    """A draft that is a small random model with SmolLM2's vocabulary (it proposes badly, so most
    proposals are rejected), with prompts cut into chunks and a pool too small for the batch."""
    draft = LLM("smollm2-135m-instruct", cache={"num_blocks": 16, "block_size": 4},
                scheduler={"max_num_batched_tokens": 16},
                speculative={"method": "draft", "draft_model": "random:tiny", "num_speculative_tokens": 2})
    assert _greedy_tokens(draft, REPEATING) == smol_reference
    assert draft.engine.scheduler.num_preemptions > 0 and draft.engine.spec_stats.num_drafts > 0
    _assert_no_leak(draft)


@pytest.mark.slow
def test_greedy_identical_with_the_target_as_its_own_draft(smol_reference):
    llm = LLM("smollm2-135m-instruct", speculative={"method": "draft", "draft_model": "smollm2-135m-instruct",
                                                   "num_speculative_tokens": 3})
    assert _greedy_tokens(llm, REPEATING) == smol_reference
    stats = llm.engine.spec_stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0  # the same model agrees with itself
    _assert_no_leak(llm)


@pytest.mark.slow
def test_ngram_under_chunked_prefill_and_preemption(smol_reference):
    llm = LLM("smollm2-135m-instruct", cache={"num_blocks": 16, "block_size": 4},
              scheduler={"max_num_batched_tokens": 16}, speculative={"method": "ngram", "num_speculative_tokens": 3})
    assert _greedy_tokens(llm, REPEATING) == smol_reference
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.spec_stats.num_accepted_tokens > 0
    _assert_no_leak(llm)


@pytest.fixture(scope="module")
def tiny():
    return LLM("random:tiny", cache={"num_blocks": 1024, "block_size": 4})


@pytest.fixture(scope="module")
def tiny_draft():
    return LLM("random:tiny", cache={"num_blocks": 1024, "block_size": 4},
               speculative={"method": "draft", "draft_model": "random:tiny", "num_speculative_tokens": 1,
                            "max_batch_size": 128})


@pytest.mark.slow
def test_sampled_tokens_follow_the_target_on_a_tiny_model(tiny, tiny_draft):
    """Chi-square over seeded samples of (t1, t2) from a tiny model whose draft is itself (so its
    argmax proposal is kept only with the target's probability): t1 comes from the prefill, t2
    from a verification. Expected: p(t1) p(t2 | t1) from the model's own logprobs."""
    prompt, top_k, trials = [11, 12, 13, 14, 15], 3, 400
    # max_tokens 3: the step after t1 may verify one proposal (t2 and t3 at most), the last none.
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=top_k, seed=5, n=trials, ignore_eos=True)
    num_drafts = tiny_draft.engine.spec_stats.num_drafts
    out = tiny_draft.generate([prompt], params, use_tqdm=False)[0]
    pairs = [tuple(c.token_ids[:2]) for c in out.outputs]
    assert tiny_draft.engine.spec_stats.num_drafts - num_drafts == trials  # every t2 was verified
    _assert_no_leak(tiny_draft)

    def top_probs(context):  # the top-k distribution after temperature 1, from raw logprobs
        o = tiny.generate([context], SamplingParams(max_tokens=1, temperature=0.0, logprobs=top_k),
                          use_tqdm=False)[0].outputs[0].logprobs[0]
        ids = sorted(o, key=o.get, reverse=True)[:top_k]
        p = torch.tensor([o[i] for i in ids]).softmax(-1)
        return dict(zip(ids, p.tolist()))

    p1 = top_probs(prompt)
    cells, expected = [], []
    for t1, q1 in p1.items():
        for t2, q2 in top_probs(prompt + [t1]).items():
            cells.append((t1, t2))
            expected.append(q1 * q2 * trials)
    observed = [pairs.count(c) for c in cells]
    assert sum(observed) == trials  # nothing outside the top-k cells
    assert chisquare_pvalue(observed, expected) > 1e-3


def test_logprobs_stop_strings_and_n_with_speculation(tiny, tiny_draft):
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [21, 22, 23, 24, 25, 26]]
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True, n=2)
    want = tiny.generate(prompts, params, use_tqdm=False)
    got = tiny_draft.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got):
        for wc, gc in zip(w.outputs, g.outputs):
            assert gc.token_ids == wc.token_ids and gc.text == wc.text
            assert len(gc.logprobs) == len(gc.token_ids)
            for wl, gl, t in zip(wc.logprobs, gc.logprobs, gc.token_ids):
                assert set(gl) == set(wl) and gl[t] == pytest.approx(wl[t], abs=1e-4)
    text = want[0].outputs[0].text
    stop = text[len(text) // 3: len(text) // 3 + 3]  # ends the output mid-way, perhaps inside a step
    stopped = SamplingParams(max_tokens=10, temperature=0.0, stop=[stop], ignore_eos=True)
    w, g = (llm.generate(prompts[:1], stopped, use_tqdm=False)[0].outputs[0] for llm in (tiny, tiny_draft))
    assert (g.text, g.token_ids, g.finish_reason) == (w.text, w.token_ids, w.finish_reason)
    assert g.finish_reason == "stop"
    _assert_no_leak(tiny_draft)


@pytest.mark.slow
def test_server_streams_several_tokens_per_delta_and_reports_metrics():
    import httpx

    from kiln.config import CacheConfig, ModelConfig
    from kiln.entrypoints.openai import build_app
    from kiln.engine.async_engine import AsyncEngine
    from tests.helpers.server import ServerThread, metric

    config = EngineConfig(model=ModelConfig("random:tiny", max_model_len=256), cache=CacheConfig(num_blocks=128),
                          speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    engine = AsyncEngine.from_config(config)
    engine.wait_ready(timeout=300)
    server = ServerThread(build_app(engine, config.server))
    try:
        client = server.client()
        prompt = [5, 6, 7, 8] * 6
        whole = client.completions.create(model="random:tiny", prompt=prompt, max_tokens=24, temperature=0)
        chunks = list(client.completions.create(model="random:tiny", prompt=prompt, max_tokens=24, temperature=0,
                                                stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
        assert whole.usage.completion_tokens == 24
        accepted = metric(server.url, "kiln_spec_decode_num_accepted_tokens_total")
        assert 0 < accepted <= metric(server.url, "kiln_spec_decode_num_draft_tokens_total")
        assert metric(server.url, "kiln_spec_decode_num_accepted_tokens_per_pos_total", {"position": "0"}) > 0
        assert "kiln_spec_decode_num_drafts_total" in httpx.get(server.url + "/metrics").text
    finally:
        server.stop()

