"""Sampler: greedy, filters, seeded draws, penalties and logprobs against direct computations."""

import pytest
import torch

from kiln.runtime.request import Request
from kiln.runtime.sampler import Sampler, _apply_top_p, apply_penalties
from kiln.sampling_params import SamplingParams

# Probabilities chosen so filter thresholds fall well clear of float rounding.
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def make_requests(num: int, prefix: str = "r", prompt=(1, 2, 3), **params) -> list[Request]:
    return [Request(f"{prefix}{i}", list(prompt), SamplingParams(**params)) for i in range(num)]


def frequencies(sampler: Sampler, logits_row: torch.Tensor, num: int, **params) -> torch.Tensor:
    """Empirical token distribution of `num` draws, in steps of 1000 identical rows."""
    logits = logits_row.expand(1000, -1)  # [1000, vocab]
    requests = make_requests(1000, **params)
    tokens = [t for _ in range(num // 1000) for t in sampler(logits, requests).token_ids]
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[1]).float() / len(tokens)


def test_greedy_is_argmax():
    logits = torch.randn(8, 1000)
    out = Sampler()(logits, make_requests(8, temperature=0.0))
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8


def test_temperature_frequencies_match_softmax():
    freq = frequencies(Sampler(seed=3), LOGITS, 20000, temperature=0.7)
    expected = (LOGITS / 0.7).softmax(dim=-1)
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)


def test_top_k_one_is_greedy():
    logits = torch.randn(16, 500)
    out = Sampler(seed=1)(logits, make_requests(16, temperature=1.5, top_k=1))
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_renormalizes_over_k_best():
    freq = frequencies(Sampler(seed=4), LOGITS, 20000, top_k=2)
    expected = torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)


def test_tiny_top_p_keeps_only_top_token():
    logits = torch.randn(16, 500)
    out = Sampler(seed=2)(logits, make_requests(16, top_p=1e-6))
    assert out.token_ids == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("top_p, kept", [(0.75, 2), (0.85, 3)])
def test_top_p_keeps_smallest_set_reaching_p(top_p, kept):
    freq = frequencies(Sampler(seed=5), LOGITS, 20000, top_p=top_p)
    expected = torch.zeros(4)
    expected[:kept] = PROBS[:kept] / PROBS[:kept].sum()
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)


def reference_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    out = torch.full_like(logits, float("-inf"))
    for row in range(logits.shape[0]):
        probs = logits[row].softmax(dim=-1).double()
        order = probs.argsort(descending=True).tolist()
        mass = 0.0
        for token in order:
            out[row, token] = logits[row, token]
            mass += probs[token].item()
            if mass >= top_p:
                break
    return out


@pytest.mark.parametrize("scale", [8.0, 0.5])  # peaked: the short list suffices; flat: full sort
def test_top_p_matches_reference_on_large_vocab(scale):
    logits = torch.randn(4, 5000) * scale
    out = _apply_top_p(logits, torch.full((4,), 0.9), num_candidates=5000)
    assert torch.equal(out.isfinite(), reference_top_p(logits, 0.9).isfinite())
    torch.testing.assert_close(out[out.isfinite()], logits[out.isfinite()])


def test_rare_tokens_stay_rare_over_a_large_vocab():
    # The other tokens' probs are ~1e-26: none should ever be drawn. A noise value of exactly 0
    # (a uniform draw of 0 with -log1p(-u)) would hand one the draw about 5 times in these 80M.
    logits = torch.full((1, 200_000), -60.0)
    logits[0, 0] = 0.0
    sampler, requests = Sampler(seed=8), make_requests(200)
    tokens = [t for _ in range(2) for t in sampler(logits.expand(200, -1), requests).token_ids]
    assert set(tokens) == {0}


def test_min_p_drops_tokens_below_fraction_of_max():
    # min_p 0.2 of max prob 0.5 is 0.1: only the 0.05 token goes.
    freq = frequencies(Sampler(seed=6), LOGITS, 20000, min_p=0.2)
    expected = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)


def test_mixed_batch_applies_each_rows_options():
    logits = torch.randn(3, 300)
    reqs = [Request("g", [1], SamplingParams(temperature=0.0)),
            Request("k", [1], SamplingParams(temperature=2.0, top_k=1)),
            Request("s", [1], SamplingParams(temperature=1.0, min_p=1.0))]
    out = Sampler()(logits, reqs)
    # min_p == 1 keeps only tokens tied with the max: the argmax.
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def run_seeded(sampler: Sampler, logits: torch.Tensor, req: Request, others: int, row: int) -> list[int]:
    """Sample `req` for len(logits) steps at batch position `row` among `others` unseeded rows."""
    tokens = []
    for step_logits in logits:
        batch = make_requests(others, prefix=f"o{len(tokens)}-")
        batch.insert(row, req)
        rows = torch.randn(others + 1, logits.shape[1])
        rows[row] = step_logits
        token = sampler(rows, batch).token_ids[row]
        req.output_token_ids.append(token)
        tokens.append(token)
    return tokens


def test_seeded_request_ignores_batch_and_sampler():
    logits = torch.randn(6, 200)  # [steps, vocab]
    alone = run_seeded(Sampler(seed=0), logits, Request("x", [1], SamplingParams(seed=42)), 0, 0)
    crowded = run_seeded(Sampler(seed=9), logits, Request("x", [1], SamplingParams(seed=42)), 7, 3)
    assert alone == crowded
    other_seed = run_seeded(Sampler(seed=0), logits, Request("x", [1], SamplingParams(seed=43)), 0, 0)
    assert other_seed != alone


def test_forget_restarts_the_seeded_stream():
    sampler, logits = Sampler(), torch.randn(1, 5000)
    first = sampler(logits, [Request("x", [1], SamplingParams(seed=7))]).token_ids
    sampler.forget("x")
    again = sampler(logits, [Request("x", [1], SamplingParams(seed=7))]).token_ids
    assert first == again


def reference_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    out = logits.clone()
    for row, req in enumerate(requests):
        p = req.sampling_params
        for t in set(req.all_token_ids):
            value = out[row, t]
            out[row, t] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        for t in set(req.output_token_ids):
            count = req.output_token_ids.count(t)
            out[row, t] -= p.frequency_penalty * count + p.presence_penalty
    return out


def test_penalties_match_direct_computation():
    vocab = 50
    reqs = [Request("a", [1, 2, 3, 3], SamplingParams(repetition_penalty=1.3)),
            Request("b", [4, 5], SamplingParams(frequency_penalty=0.7, presence_penalty=0.4)),
            Request("c", [6], SamplingParams()),
            Request("d", [7, 1], SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.5,
                                                presence_penalty=1.1))]
    for i, req in enumerate(reqs):
        req.output_token_ids = torch.randint(0, vocab, (12,)).tolist() + [i, i, i]
    logits = torch.randn(4, vocab)
    before = logits.clone()
    expected = reference_penalties(logits, reqs)
    torch.testing.assert_close(apply_penalties(logits, reqs), expected)
    assert torch.equal(logits, before)
    for req in reqs:
        req.sampling_params.temperature = 0.0
    assert Sampler()(logits, reqs).token_ids == expected.argmax(dim=-1).tolist()


def test_penalties_skip_work_and_ignore_ids_beyond_logits():
    logits = torch.randn(2, 10)
    plain = make_requests(2)
    assert apply_penalties(logits, plain) is logits
    beyond = make_requests(1, prompt=(3, 999), repetition_penalty=2.0)
    within = make_requests(1, prompt=(3,), repetition_penalty=2.0)
    torch.testing.assert_close(apply_penalties(logits[:1], beyond), reference_penalties(logits[:1], within))


def test_logprobs_hold_sampled_and_top_n_from_raw_logits():
    logits = torch.randn(3, 100)
    reqs = [Request("a", [1], SamplingParams(logprobs=5, temperature=1.0, repetition_penalty=1.5)),
            Request("b", [1], SamplingParams(logprobs=0, temperature=0.5)),
            Request("c", [1], SamplingParams(temperature=0.0))]
    out = Sampler(seed=11)(logits, reqs)
    reference = logits.log_softmax(dim=-1)
    top5 = reference[0].topk(5).indices.tolist()
    assert set(out.logprobs[0]) == set(top5) | {out.token_ids[0]}
    assert set(out.logprobs[1]) == {out.token_ids[1]}
    assert out.logprobs[2] is None
    for row in (0, 1):
        for token, lp in out.logprobs[row].items():
            assert lp == pytest.approx(reference[row, token].item(), abs=1e-5)
