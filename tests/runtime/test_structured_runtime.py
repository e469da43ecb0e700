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


def test_background_batched_fill_follows_one_matcher_per_request(tokenizer, compiler):
    """The engine's GPU path (fills on the worker thread, one batched accept per step) gives each
    row the bitmask a lone matcher fed token by token gives; a refused token frees that row only."""
    import random

    vocab, rng = len(tokenizer), random.Random(0)
    # Grammars no 16 tokens can complete, so every row stays open.
    specs = [StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string", "minLength": 300}},
                                           "required": ["a"]}),
             None, StructuredOutputsParams(regex="[a-z ]{300}"),
             StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}, "minItems": 40})]
    reqs = [Request(str(i), [1], SamplingParams(structured_outputs=s)) for i, s in enumerate(specs)]
    batched = GrammarBitmasks(compiler, background=True)
    alone = {i: GrammarBitmasks(compiler) for i, s in enumerate(specs) if s is not None}
    for step in range(16):
        got = batched.start_fill(reqs).result()
        for row, req in enumerate(reqs):
            want = alone[row].fill([req]) if row in alone else None
            allowed = _allowed(got, row, vocab)
            assert allowed == (_allowed(want, 0, vocab) if want is not None and not (row == 2 and step > 5)
                               else set(range(vocab))), (step, row)
            # Row 2 takes a token its grammar refuses at step 5; from then on it is unconstrained.
            token = 0 if (row == 2 and step == 5) else rng.choice(sorted(allowed - {tokenizer.eos_token_id}))
            req.output_token_ids.append(token)
    batched.shutdown()


def test_json_schema_objects_take_only_their_listed_properties(tokenizer, compiler):
    """``strict`` or not, a schema compiles one way (vLLM enforces it regardless too): an object
    without ``additionalProperties`` takes only the properties it lists, as OpenAI's strict mode
    asks, so no output carries a key the client did not name; every output still validates."""
    from kiln.entrypoints.openai.protocol import ChatCompletionRequest

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    keys = {ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], response_format={
        "type": "json_schema", "json_schema": {"name": "n", "schema": schema, **strict}}).structured_outputs_params().key
        for strict in ({}, {"strict": True}, {"strict": False})}
    assert len(keys) == 1
    req = Request("s", [1], SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)))
    req.output_token_ids = tokenizer.encode('{"a": 7', add_special_tokens=False)
    allowed = {tokenizer.decode([t]) for t in _allowed(GrammarBitmasks(compiler).fill([req]), 0, len(tokenizer))}
    assert allowed == {*"0123456789", "}"}  # no ", " to a second key


def test_a_grammar_after_token_ids_starts_after_them(tokenizer, compiler):
    vocab = len(tokenizer)
    marker = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    spec = StructuredOutputsParams(choice=["alpha beta"], after_token_ids=marker)
    req = Request("t", [1], SamplingParams(structured_outputs=spec), eos_token_ids=(tokenizer.eos_token_id,))
    masks = GrammarBitmasks(compiler)
    thinking = tokenizer.encode("Hmm, what now?", add_special_tokens=False)
    req.output_token_ids = list(thinking)
    assert len(_allowed(masks.fill([req]), 0, vocab)) == vocab  # the thinking is free
    req.output_token_ids = thinking + list(marker)
    plain_start = _allowed(GrammarBitmasks(compiler).fill(
        [Request("u", [1], SamplingParams(structured_outputs=StructuredOutputsParams(choice=["alpha beta"])))]), 0, vocab)
    assert _allowed(masks.fill([req]), 0, vocab) == plain_start  # the grammar begins after the marker
    req.output_token_ids = thinking + list(marker) + tokenizer.encode("alpha beta", add_special_tokens=False)
    assert _allowed(masks.fill([req]), 0, vocab) == {tokenizer.eos_token_id}
    req.output_token_ids = thinking[:2]  # taken back before the marker: free again
    assert len(_allowed(masks.fill([req]), 0, vocab)) == vocab
