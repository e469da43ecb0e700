"""The structured-output runtime without a model: grammar cache, matcher rollback and rebuild, and
the logits processors (logit bias, min_tokens, bitmask) against a plain-torch reference."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from kiln.runtime.logits_processors import apply_logits_processors
from kiln.runtime.request import Request
from kiln.runtime.structured_output import GrammarBitmasks, GrammarCompiler, GrammarError
from kiln.sampling_params import SamplingParams, StructuredOutputsParams


@pytest.fixture(scope="module")
def tokenizer(kiln_cache_dir):
    from transformers import AutoTokenizer

    dirs = glob.glob(os.path.join(kiln_cache_dir, "models", "*"))
    if not dirs:
        pytest.skip("the embedded model is not installed")
    return AutoTokenizer.from_pretrained(dirs[0])


@pytest.fixture(scope="module")
def compiler(tokenizer):
    c = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    yield c
    c.shutdown()


def _allowed(bitmask: torch.Tensor, row: int, vocab: int) -> set[int]:
    bits = (bitmask[row].view(-1, 1) >> torch.arange(32)) & 1  # [words, 32]
    return set(torch.nonzero(bits.flatten()[:vocab]).flatten().tolist())


def test_cache_and_errors(compiler):
    spec = StructuredOutputsParams(regex="ab(c|d)e")
    assert compiler.submit(spec) is compiler.submit(StructuredOutputsParams(regex="ab(c|d)e"))
    with pytest.raises(GrammarError, match="regex"):
        compiler.compile(StructuredOutputsParams(regex="a(b"))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])


def test_matcher_follows_the_request_through_rollback_and_rebuild(tokenizer, compiler):
    vocab = len(tokenizer)
    spec = StructuredOutputsParams(choice=["alpha beta", "alpha gamma"])
    req = Request("r", [1, 2], SamplingParams(structured_outputs=spec), eos_token_ids=(tokenizer.eos_token_id,))
    masks = GrammarBitmasks(compiler)
    first = _allowed(masks.fill([req]), 0, vocab)
    assert first and all(("alpha beta".startswith(tokenizer.decode([t])) or "alpha gamma".startswith(
        tokenizer.decode([t]))) for t in first)
    req.output_token_ids = tokenizer.encode("alpha", add_special_tokens=False)
    after_alpha = _allowed(masks.fill([req]), 0, vocab)
    assert after_alpha != first and tokenizer.eos_token_id not in after_alpha
    req.output_token_ids = []  # preempted and resumed with fewer tokens, or a step dropped: roll back
    assert _allowed(masks.fill([req]), 0, vocab) == first
    req.output_token_ids = tokenizer.encode("alpha beta", add_special_tokens=False)
    assert _allowed(masks.fill([req]), 0, vocab) == {tokenizer.eos_token_id}  # complete: only stop
    fresh = GrammarBitmasks(compiler)  # another rank or a rebuilt matcher: from the request's tokens
    assert _allowed(fresh.fill([req]), 0, vocab) == {tokenizer.eos_token_id}
    plain = Request("p", [1], SamplingParams())
    assert fresh.fill([plain]) is None and len(_allowed(fresh.fill([plain, req]), 0, vocab)) == vocab


def test_logits_processors_match_a_reference(tokenizer, compiler):
    torch.manual_seed(0)
    vocab = len(tokenizer)
    eos = tokenizer.eos_token_id
    spec = StructuredOutputsParams(regex="[0-9]+")
    reqs = [Request("a", [1], SamplingParams(logit_bias={5: 3.0, 7: -100.0}), eos_token_ids=(eos,)),
            Request("b", [1], SamplingParams(min_tokens=2, stop_token_ids=[9]), eos_token_ids=(eos,)),
            Request("c", [1], SamplingParams(structured_outputs=spec), eos_token_ids=(eos,)),
            Request("d", [1], SamplingParams(), eos_token_ids=(eos,))]
    logits = torch.randn(4, vocab)
    bitmask = GrammarBitmasks(compiler).fill(reqs)
    got = apply_logits_processors(logits, reqs, bitmask)
    want = logits.clone()
    want[0, 5] += 3.0
    want[0, 7] -= 100.0
    want[1, [eos, 9]] = float("-inf")
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[list(_allowed(bitmask, 2, vocab))] = True
    want[2] = want[2].masked_fill(~allowed, float("-inf"))
    assert torch.equal(got, want) and not torch.equal(got, logits)
    assert all(tokenizer.decode([t]).isdigit() for t in _allowed(bitmask, 2, vocab))
    assert apply_logits_processors(logits, [reqs[3]]) is logits  # nothing asked: untouched


def test_batched_fill_equals_one_by_one(tokenizer, compiler):
    vocab = len(tokenizer)
    specs = [StructuredOutputsParams(regex="[0-9]+"), StructuredOutputsParams(json_object=True),
             StructuredOutputsParams(choice=["yes", "no"])]
    reqs = [Request(str(i), [1], SamplingParams(structured_outputs=s)) for i, s in enumerate(specs)]
    reqs.insert(1, Request("plain", [1], SamplingParams()))
    together = GrammarBitmasks(compiler).fill(reqs)
    for row, req in enumerate(reqs):
        alone = GrammarBitmasks(compiler).fill([req])
        assert (alone is None and len(_allowed(together, row, vocab)) == vocab) or torch.equal(alone[0], together[row])
