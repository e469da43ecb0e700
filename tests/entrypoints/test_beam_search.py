"""Beam search (kiln.entrypoints.beam_search) against transformers' ``generate(num_beams=...)``, and
best_of, offline and over HTTP (serving_beam_search.py).

Two tiny random checkpoints (Llama, Qwen2) are saved with transformers and loaded by kiln by path,
fp32 on the CPU. Each gets as its EOS a token its own unconstrained beams write early, so beams
end at different lengths; the cases with ``ignore_eos`` compare against transformers with no EOS
at all. Token ids are compared exactly, scores closely.
"""

from __future__ import annotations

import contextlib
import json

import httpx
import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.config import EngineConfig, ModelConfig
from kiln.engine.core_client import EngineCoreClient
from kiln.entrypoints.beam_search import BeamSearch
from kiln.entrypoints.openai import build_app
from kiln.sampling_params import BeamSearchParams
from tests.helpers.hf import write_toy_tokenizer
from tests.helpers.server import ServerThread, assert_error, idle_free_blocks

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, pad_token_id=0)
PROMPT_LENS = [5, 21]  # the longer one fills a 16-token block that its beams share
MAX_TOKENS = 12

# (beam_width, n returned, length_penalty, early_stopping, ignore_eos, min_tokens)
CASES = [
    (2, 2, 1.0, False, False, 0),
    (4, 4, 1.0, False, False, 0),
    (4, 4, 1.0, True, False, 0),
    (2, 2, 0.0, False, False, 0),  # no length penalty: beams that end early win
    (4, 3, -0.5, True, False, 0),
    (4, 2, 2.0, True, False, 3),
    (2, 1, 0.5, "never", False, 0),
    (4, 4, 1.0, False, True, 0),
    (2, 2, -0.5, False, True, 0),
]


@contextlib.contextmanager
def _one_thread():
    """transformers' step-by-step generate on tiny models is all per-op overhead: one thread is faster."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _hf_model(family: str):
    import transformers as T

    config = {"llama": T.LlamaConfig, "qwen2": T.Qwen2Config}[family](**COMMON, eos_token_id=2)
    torch.manual_seed({"llama": 0, "qwen2": 1}[family])
    model = T.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.1)
    return model


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _hf_beams(model, ids: list[int], width: int, n: int, length_penalty: float, early_stopping, eos,
              min_tokens: int = 0) -> tuple[list[list[int]], list[float]]:
    """transformers' n best beams of ``ids`` (generated ids only, EOS kept) and their scores."""
    # generate() fills a None it is passed from the model's generation config: set that one instead.
    saved, model.generation_config.eos_token_id = model.generation_config.eos_token_id, eos
    try:
        with torch.no_grad(), _one_thread():
            out = model.generate(torch.tensor([ids]), num_beams=width, num_return_sequences=n, do_sample=False,
                                 max_new_tokens=MAX_TOKENS, min_new_tokens=min_tokens, length_penalty=length_penalty,
                                 early_stopping=early_stopping, pad_token_id=0, return_dict_in_generate=True,
                                 output_scores=True)
    finally:
        model.generation_config.eos_token_id = saved
    lengths = (out.beam_indices != -1).sum(dim=1).tolist()  # generated tokens per beam
    beams = [row[len(ids):len(ids) + k] for row, k in zip(out.sequences.tolist(), lengths)]
    return beams, out.sequences_scores.tolist()


def _pick_eos(model, prompts) -> int:
    """A token the unconstrained beams write at step 2 to 6, so that as EOS it ends some beams early."""
    counts: dict[int, int] = {}
    for ids in prompts:
        for beam in _hf_beams(model, ids, 4, 4, 1.0, False, None)[0]:
            for t in set(beam[1:6]) - {0, 1, 2}:
                counts[t] = counts.get(t, 0) + 1
    return max(counts, key=counts.get)


# The toy tokenizer's words: a chat of "hello"s renders to token ids 3.
CHAT_TEMPLATE = "{% for m in messages %}{{ m.content }} {% endfor %}"


def _checkpoint(family: str, path) -> tuple[object, int, list[list[int]]]:
    """A saved checkpoint of ``family`` with its EOS picked (and a chat template): (HF model, EOS, prompts)."""
    from transformers import PreTrainedTokenizerFast

    model = _hf_model(family)
    prompts = _prompts()
    eos = _pick_eos(model, prompts)
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    model.save_pretrained(path)
    write_toy_tokenizer(path)
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    assert json.loads((path / "config.json").read_text())["eos_token_id"] == eos
    return model, eos, prompts


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family(request, tmp_path_factory):
    """(HF model, its EOS id, kiln LLM over the same checkpoint, prompts)."""
    path = tmp_path_factory.mktemp(request.param)
    model, eos, prompts = _checkpoint(request.param, path)
    llm = LLM(str(path), dtype="float32", compile={"mode": "eager"})
    assert llm.engine.executor.eos_token_ids == (eos,)
    return model, eos, llm, prompts


@pytest.mark.parametrize("width,n,length_penalty,early_stopping,ignore_eos,min_tokens", CASES)
def test_beam_search_equals_transformers(family, width, n, length_penalty, early_stopping, ignore_eos, min_tokens):
    model, eos, llm, prompts = family
    params = BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, ignore_eos=ignore_eos,
                              length_penalty=length_penalty, early_stopping=early_stopping, min_tokens=min_tokens)
    outs = llm.beam_search(prompts, params)
    for ids, out in zip(prompts, outs):
        want, want_scores = _hf_beams(model, ids, width, n, length_penalty, early_stopping,
                                      None if ignore_eos else eos, min_tokens)
        got = out.sequences[:n]
        assert len(out.sequences) == width
        assert [s.output_token_ids for s in got] == want, (ids, [s.score for s in got], want_scores)
        assert [s.score for s in got] == pytest.approx(want_scores, abs=1e-4)
        assert all(s.tokens[:len(ids)] == ids for s in got)
        for s in got:
            ended = s.output_token_ids[-1] == eos and not ignore_eos
            assert s.finish_reason == ("stop" if ended else "length")
            assert eos not in s.output_token_ids[:-1] or ignore_eos
            assert len(s.output_token_ids) > min_tokens
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_usable_blocks"]  # every step's blocks given back


def test_eos_ends_beams_early_and_ignore_eos_does_not(family):
    """The chosen EOS really shapes the search: without a length penalty some of the best beams
    end before the cap, and without EOS a beam writes that token mid-way."""
    _, eos, llm, prompts = family
    with_eos = llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, length_penalty=0.0))
    assert any(s.finish_reason == "stop" and len(s.output_token_ids) < MAX_TOKENS
               for out in with_eos for s in out.sequences)
    free = llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert any(eos in s.output_token_ids[:-1] for out in free for s in out.sequences)
    assert all(len(s.output_token_ids) == MAX_TOKENS for out in free for s in out.sequences)


def test_beams_share_prefix_blocks(family):
    """After the first step every beam request finds the prompt's full block in the prefix cache."""
    _, _, llm, prompts = family
    kv = llm.engine.kv_manager
    hits, queried = kv.num_hit_tokens, kv.num_queries_tokens
    llm.beam_search([prompts[1]], BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, ignore_eos=True))
    block = llm.config.cache.block_size
    # MAX_TOKENS steps, 4 beams from the second: all but the first request hit the prompt's full block.
    assert kv.num_hit_tokens - hits >= (1 + 4 * (MAX_TOKENS - 1) - 1) * block
    assert kv.num_queries_tokens > queried
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_usable_blocks"]


def test_generate_with_use_beam_search_returns_the_best_n(family):
    _, _, llm, prompts = family
    params = SamplingParams(n=2, best_of=4, use_beam_search=True, temperature=0.0, max_tokens=MAX_TOKENS,
                            length_penalty=1.0, logprobs=2)
    outs = llm.generate(prompts, params, use_tqdm=False)
    ref = llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS))
    for out, beams, ids in zip(outs, ref, prompts):
        assert out.finished and out.prompt_token_ids == ids
        assert [c.token_ids for c in out.outputs] == [s.output_token_ids for s in beams.sequences[:2]]
        assert [c.index for c in out.outputs] == [0, 1]
        for c, s in zip(out.outputs, beams.sequences):
            assert c.cumulative_logprob == pytest.approx(s.cum_logprob)
            assert len(c.logprobs) == len(c.token_ids)
            assert all(t in lp and len(lp) <= 3 for t, lp in zip(c.token_ids, c.logprobs))
            assert sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs)) == pytest.approx(c.cumulative_logprob)
    # A batch mixing beam search with plain sampling keeps the prompts' order.
    mixed = llm.generate(prompts, [params, SamplingParams(max_tokens=3, temperature=0.0)], use_tqdm=False)
    assert [c.token_ids for c in mixed[0].outputs] == [c.token_ids for c in outs[0].outputs]
    assert len(mixed[1].outputs) == 1 and len(mixed[1].outputs[0].token_ids) == 3


def test_best_of_keeps_the_n_most_likely_samples(family):
    _, _, llm, prompts = family
    params = SamplingParams(n=2, best_of=5, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    out = llm.generate(prompts[:1], params, use_tqdm=False)[0]
    every = llm.generate(prompts[:1], SamplingParams(n=5, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True,
                                                     logprobs=0), use_tqdm=False)[0]
    ranked = sorted(every.outputs, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ranked]
    assert [c.index for c in out.outputs] == [0, 1] and all(c.logprobs is None for c in out.outputs)
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_usable_blocks"]


@pytest.mark.parametrize("kwargs,field", [
    (dict(use_beam_search=True, n=2), "temperature"),
    (dict(use_beam_search=True, temperature=0.0, top_p=0.5), "top_p"),
    (dict(use_beam_search=True, temperature=0.0, stop=["x"]), "stop"),
    (dict(use_beam_search=True, temperature=0.0, repetition_penalty=1.2), "repetition_penalty"),
    (dict(n=3, best_of=2), "best_of"),
    (dict(length_penalty=2.0), "length_penalty"),
    (dict(use_beam_search=True, temperature=0.0, length_penalty=float("nan")), "length_penalty"),
    (dict(use_beam_search=True, temperature=0.0, early_stopping="sometimes"), "early_stopping"),
])
def test_unsupported_combinations_say_what_to_change(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_beam_search_params_refuse_sampling_and_wide_beams(family):
    _, _, llm, prompts = family
    with pytest.raises(ValueError, match="temperature must be 0"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)
    with pytest.raises(ValueError, match="beam width of at most 10"):
        llm.beam_search(prompts, BeamSearchParams(beam_width=11, max_tokens=4))
    with pytest.raises(ValueError, match="max_tokens"):
        llm.beam_search(prompts, BeamSearchParams(beam_width=2, max_tokens=llm.engine.max_model_len))
    with pytest.raises(ValueError, match="LLMEngine.add_request takes neither"):
        llm.engine.add_request("x", prompts[0], SamplingParams(n=1, best_of=2))
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_usable_blocks"] and not stats["num_running"]


def _toy_search(width: int, **kw) -> BeamSearch:
    return BeamSearch([1], BeamSearchParams(beam_width=width, max_tokens=3, **kw), eos_token_ids=[2], max_model_len=64)


def test_length_penalty_decides_between_a_short_and_a_long_beam():
    """Step 1: EOS (ln 0.5) or token 3 (ln 0.5); after 3, two tokens of ln 0.8 each. A short beam
    wins without a length penalty that favours length, the long one with it."""
    import math

    def run(length_penalty: float) -> list[int]:
        search = _toy_search(1, length_penalty=length_penalty, early_stopping="never")
        steps = [{2: math.log(0.5), 3: math.log(0.5) - 1e-9}, {4: math.log(0.8), 2: math.log(0.1)},
                 {5: math.log(0.8), 2: math.log(0.1)}]
        for entry in steps:
            if search.done:
                break
            search.advance([entry] * len(search.running))
        return search.results(None)[0].output_token_ids

    assert run(0.0) == [2]  # -0.69 against 3 tokens at -0.69 - 0.45
    assert run(2.0) == [3, 4, 5]  # -1.14 / 9 beats -0.69


# ---- over HTTP ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(server over an engine-core process of the Llama checkpoint, its engine client, HF model, EOS, prompts)."""
    path = tmp_path_factory.mktemp("llama-server")
    model, eos, prompts = _checkpoint("llama", path)
    config = EngineConfig(model=ModelConfig(str(path), dtype="float32", max_model_len=256))
    engine = EngineCoreClient(config)
    engine.wait_ready(timeout=300)
    thread = ServerThread(build_app(engine, config.server))
    yield thread, engine, model, eos, prompts
    thread.stop()
    engine.shutdown()


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


@pytest.mark.parametrize("n,best_of,length_penalty", [(2, 4, 1.0), (2, 2, 0.0), (1, 4, 2.0)])
def test_completions_beam_search_equals_transformers(server, n, best_of, length_penalty):
    thread, engine, model, eos, prompts = server
    r = _post(thread.url, "/v1/completions", {
        "prompt": prompts, "max_tokens": MAX_TOKENS, "n": n, "best_of": best_of, "use_beam_search": True,
        "length_penalty": length_penalty, "return_token_ids": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(len(prompts) * n))
    for i, ids in enumerate(prompts):
        want, _ = _hf_beams(model, ids, best_of, n, length_penalty, False, eos)
        got = choices[i * n:(i + 1) * n]
        assert [c["token_ids"] for c in got] == want
        for c, beam in zip(got, want):
            assert c["finish_reason"] == ("stop" if beam[-1] == eos else "length")
            assert len(c["logprobs"]["tokens"]) == len(beam)
    assert r.json()["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)
    idle_free_blocks(engine)


def test_chat_beam_search_returns_n_beams(server):
    thread, engine, model, eos, _ = server
    messages = [{"role": "user", "content": "hello hello"}, {"role": "user", "content": "hello"}]
    r = _post(thread.url, "/v1/chat/completions", {
        "messages": messages, "max_tokens": MAX_TOKENS, "n": 3, "use_beam_search": True,
        "early_stopping": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    want, _ = _hf_beams(model, [3, 3, 3], 3, 3, 1.0, True, eos)  # the template's "hello hello hello "
    assert [c["token_ids"] for c in r.json()["choices"]] == want
    idle_free_blocks(engine)


def test_best_of_over_http_returns_n_samples(server):
    thread, engine, _, _, prompts = server
    r = _post(thread.url, "/v1/completions", {"prompt": prompts[0], "max_tokens": 4, "n": 2, "best_of": 5,
                                             "temperature": 1.0, "seed": 3})
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in r.json()["choices"])
    idle_free_blocks(engine)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"use_beam_search": True, "n": 2, "stream": True}, "stream"),
    ("/v1/completions", {"best_of": 3, "stream": True}, "stream"),
    ("/v1/chat/completions", {"use_beam_search": True, "n": 2, "stream": True}, "stream"),
    ("/v1/completions", {"use_beam_search": True, "n": 2, "temperature": 0.7}, "use_beam_search"),
    ("/v1/chat/completions", {"use_beam_search": True, "top_p": 0.5}, "use_beam_search"),
    ("/v1/completions", {"use_beam_search": True, "n": 2, "stop": ["x"]}, "use_beam_search"),
    ("/v1/completions", {"use_beam_search": True, "best_of": 11}, None),
    ("/v1/completions", {"n": 3, "best_of": 2}, "best_of"),
    ("/v1/completions", {"length_penalty": 2.0}, "length_penalty"),
    ("/v1/completions", {"use_beam_search": True, "length_penalty": 11}, "length_penalty"),
    ("/v1/completions", {"use_beam_search": True, "early_stopping": "sometimes"}, "early_stopping"),
    ("/v1/chat/completions", {"best_of": 2}, "best_of"),  # completions only, as vLLM's
    ("/v1/completions", {"use_beam_search": True, "max_tokens": 300}, "max_tokens"),
])
def test_beam_search_refusals_are_400s(server, path, body, param):
    thread, engine, _, _, prompts = server
    base = {"prompt": prompts[0], "max_tokens": 4} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    error = assert_error(_post(thread.url, path, {**base, **body}), 400, param)
    assert error["type"] == "invalid_request_error"
    idle_free_blocks(engine)


def test_beam_search_fields_are_in_the_openapi_schema(server):
    thread = server[0]
    schemas = thread.app.openapi()["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        assert {"use_beam_search", "length_penalty", "early_stopping"} <= set(schemas[name]["properties"])
    assert "best_of" in schemas["CompletionRequest"]["properties"]
