"""End-to-end engine tests on the CPU: the LLM API against HF transformers, batching features,
sampling and bad input. SmolLM2 (the real embedded model) where outputs must be decisive."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from kiln import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a dragon who",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "Water boils at a temperature of",
    "In machine learning, a transformer is a model architecture that relies on self-attention to process "
    "sequences. It was introduced in the paper",
    "Hello",
    "A list of fruits: apple, banana,",
]
MAX_TOKENS = 24
# The GGUF's weights dequantized to float32, as transformers runs them (the default keeps them int4).
SMOL = {"model": "smollm2-135m-instruct", "quantization": "none"}


@pytest.fixture(scope="module")
def smol(kiln_cache_dir):
    return LLM(SMOL, cache={"dir": kiln_cache_dir})


@pytest.fixture(scope="module")
def smol_greedy(smol):
    outs = smol.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _assert_no_leak(llm):
    stats = llm.engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == llm.engine.kv_manager.num_usable_blocks


def test_greedy_matches_hf_generate(smol, smol_greedy):
    """transformers' greedy ``generate`` would write our tokens: each is its argmax after the prompt
    and our tokens before it, read from one forward over the whole sequence (24 times fewer
    forwards than ``generate``'s, token by token); and no end of text came before the 24th."""
    hf_dir = smol.engine.executor.runner.loaded.hf_dir
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    for prompt, ours in zip(PROMPTS, smol_greedy):
        ids = smol.tokenizer(prompt).input_ids
        with torch.no_grad():
            logits = hf(torch.tensor([ids + list(ours)])).logits[0]  # [prompt + ours, vocab]
        assert len(ours) == MAX_TOKENS, prompt
        assert list(ours) == logits[len(ids) - 1:-1].argmax(-1).tolist(), prompt
    _assert_no_leak(smol)


def test_outputs_have_text_prompt_ids_and_finish_reason(smol):
    out = smol.generate(["The capital of France is"], SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)[0]
    assert out.prompt_token_ids == smol.tokenizer.encode("The capital of France is")
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 5
    assert c.text == smol.tokenizer.decode(c.token_ids, skip_special_tokens=True)


def test_chunked_prefill_small_budget_and_preemption_match(kiln_cache_dir, smol_greedy):
    """One engine (a SmolLM2 build is the expensive part) under both pressures: an 8-token step
    budget chunks every prompt longer than 8 tokens, and 8 blocks of 16 tokens cannot hold three
    running requests of up to 4 blocks each, so some are preempted and recomputed."""
    llm = LLM(SMOL, cache={"dir": kiln_cache_dir, "num_blocks": 8, "enable_prefix_caching": False},
              scheduler={"max_num_batched_tokens": 8, "max_num_seqs": 3})
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == smol_greedy
    _assert_no_leak(llm)


def test_prefix_cache_hits_and_same_outputs(smol):
    shared = "You are a helpful assistant. Answer briefly and precisely. " * 4
    prompts = [shared + "What is 2+2?", shared + "Name a color."]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    first = smol.generate(prompts, params, use_tqdm=False)
    again = smol.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    assert all(o.num_cached_tokens >= 16 for o in again)
    assert smol.engine.kv_manager.hit_rate > 0
    _assert_no_leak(smol)


def test_seeded_sampling_is_reproducible(smol):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    a = smol.generate(["Tell me a story about"], params, use_tqdm=False)[0].outputs[0].token_ids
    b = smol.generate(["Tell me a story about", "Other prompt"], params, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b


def test_n_samples_and_logprobs(smol):
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=7, logprobs=2)
    out = smol.generate(["The weather today is"], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        for tok, lp in zip(c.token_ids, c.logprobs):
            assert tok in lp and len(lp) >= 2 and all(v <= 0 for v in lp.values())
    _assert_no_leak(smol)


def test_stop_strings_and_stop_tokens(smol, smol_greedy):
    full = smol.tokenizer.decode(smol_greedy[0], skip_special_tokens=True)
    word = full.split()[1] if len(full.split()) > 1 else full.strip()[:2]
    out = smol.generate([PROMPTS[0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=[word]),
                        use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and word not in out.text
    assert full.startswith(out.text)
    stop_id = smol_greedy[0][3]
    out = smol.generate([PROMPTS[0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=[stop_id]),
                        use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop_id
    assert out.token_ids == smol_greedy[0][: len(out.token_ids)]
    _assert_no_leak(smol)


def test_chat_uses_template(smol):
    out = smol.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda llm: llm.generate([""], SamplingParams()), "empty"),
        (lambda llm: llm.generate(["hi " * 9000], SamplingParams()), "context"),
        (lambda llm: llm.generate(["hi"], SamplingParams(max_tokens=10**6)), "max_tokens"),
        (lambda llm: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda llm: SamplingParams(temperature=-1), "temperature"),
        (lambda llm: SamplingParams(top_p=0.0), "top_p"),
        (lambda llm: SamplingParams(top_p=1.5), "top_p"),
        (lambda llm: llm.generate([[10**9]], SamplingParams()), "token ids"),
    ],
)
def test_bad_input_is_a_clear_value_error(smol, make, match):
    with pytest.raises(ValueError, match=match):
        make(smol)
    _assert_no_leak(smol)


def test_unknown_model_and_missing_dir(kiln_cache_dir, tmp_path):
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        LLM("no-such-model", cache={"dir": kiln_cache_dir})
    with pytest.raises(ValueError):
        LLM(str(tmp_path / "missing"), cache={"dir": kiln_cache_dir})


# ---- the step pipeline: step k's outputs are processed while step k+1 runs -----------------------
def _pipeline_workload(texts: list[str], smol_greedy) -> list[tuple[str, object, SamplingParams]]:
    """Stop strings that hit mid-generation, a stop token, length, eos (a short chat answer), and
    seeded n=2 sampling with logprobs, all in one batch."""
    greedy = dict(max_tokens=MAX_TOKENS, temperature=0.0)
    work = []
    for i in range(6):
        words = texts[i].split()
        stop = [words[len(words) // 2]] if len(words) > 2 else []
        work.append((f"s{i}", PROMPTS[i], SamplingParams(stop=stop, **greedy)))
    work.append(("tok", PROMPTS[0], SamplingParams(stop_token_ids=[smol_greedy[0][4]], **greedy)))
    work.append(("len", PROMPTS[7], SamplingParams(max_tokens=3, temperature=0.0)))
    work.append(("eos", [{"role": "user", "content": "What is 2+2? Answer with one number."}],
                 SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)))
    work.append(("n2", PROMPTS[8], SamplingParams(n=2, max_tokens=10, temperature=0.8, seed=11, logprobs=1,
                                                  stop=[","])))
    return work


def _stream(llm, work) -> dict[str, list[tuple]]:
    """Every RequestOutput of every request, in order, as comparable tuples; checks that nothing is
    reported after its finish."""
    engine = llm.engine
    for rid, prompt, params in work:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            prompt = llm.apply_chat_template(prompt)
            engine.add_request(rid, prompt, params, add_special_tokens=False)
        else:
            engine.add_request(rid, prompt, params)
    stream: dict[str, list[tuple]] = {rid: [] for rid, _, _ in work}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen = stream[out.request_id]
            assert not (seen and seen[-1][0]), f"{out.request_id} reported after it finished"
            seen.append((out.finished, [(c.text, c.token_ids, c.finish_reason, c.stop_reason,
                                         [sorted(lp) for lp in c.logprobs or []]) for c in out.outputs]))
    return stream


def test_pipelined_steps_match_serial_steps(smol, smol_greedy, monkeypatch):
    """The same stream of outputs with and without the pipeline, though stop strings are found while
    the next step already runs the stopped request; no block or generator is left behind."""
    texts = [smol.tokenizer.decode(ids, skip_special_tokens=True) for ids in smol_greedy]
    work = _pipeline_workload(texts, smol_greedy)
    engine = smol.engine
    dropped = []  # requests that reached update() already finished: their in-flight token is dropped
    update = engine.scheduler.update

    def spying_update(sched, sampled):
        dropped.extend(s.request.request_id for s in sched.scheduled if s.request.is_finished)
        return update(sched, sampled)

    monkeypatch.setattr(engine.scheduler, "update", spying_update)
    monkeypatch.setattr(engine, "_overlap", False)
    serial = _stream(smol, work)
    assert dropped == []
    _assert_no_leak(smol)
    monkeypatch.setattr(engine, "_overlap", True)
    pipelined = _stream(smol, work)
    assert dropped  # the case this test is about happened
    _assert_no_leak(smol)
    assert engine.executor.runner.sampler._seeded == {}  # forgets queued behind the step in flight
    assert pipelined.keys() == serial.keys()
    for rid in serial:
        assert pipelined[rid] == serial[rid], rid
    finals = {rid: s[-1][1] for rid, s in serial.items()}
    reasons = {c[2] for outs in finals.values() for c in outs}
    assert reasons == {"stop", "length"}
    assert finals["eos"][0][2] == "stop" and finals["eos"][0][3] is None  # ended by eos
    assert finals["tok"][0][1][-1] == smol_greedy[0][4]
    for i in range(6):  # a stop string ends the text where the full greedy text has it
        text, ids, reason, stop, _ = finals[f"s{i}"][0]
        assert texts[i].startswith(text) and ids == smol_greedy[i][:len(ids)]


def test_steps_scheduled_ahead_match_serial_steps(smol, smol_greedy, monkeypatch):
    """Scheduling ahead (the GPU's loop: step k+1 launched before step k's tokens are read back,
    its decodes fed from step k's sampled ids) forced on the CPU, where the runner launches
    synchronously: the same outputs as the serial loop, with placeholders fed and nothing left."""
    texts = [smol.tokenizer.decode(ids, skip_special_tokens=True) for ids in smol_greedy]
    work = _pipeline_workload(texts, smol_greedy)
    work.append(("pen", PROMPTS[4], SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3)))
    engine, runner = smol.engine, smol.engine.executor.runner
    monkeypatch.setattr(engine, "_overlap", False)
    serial = _stream(smol, work)
    monkeypatch.setattr(engine, "_overlap", True)
    monkeypatch.setattr(engine, "_schedule_ahead", True)
    monkeypatch.setattr(engine.executor, "can_schedule_ahead", True)
    monkeypatch.setattr(engine.executor, "_launch_in_submit", True)
    counts = {"ahead": 0, "fed": 0, "behind": 0}
    schedule_ahead, fed = engine.scheduler.schedule_ahead, runner._fed_input_ids

    def spy_ahead(in_flight):
        counts["ahead"] += 1
        return schedule_ahead(in_flight)

    def spy_fed(placeholders, after):
        counts["fed"] += 1
        return fed(placeholders, after)

    monkeypatch.setattr(engine.scheduler, "schedule_ahead", spy_ahead)
    monkeypatch.setattr(runner, "_fed_input_ids", spy_fed)
    ahead = _stream(smol, work)
    assert counts["ahead"] > 5 and counts["fed"] > 5
    _assert_no_leak(smol)
    assert runner.sampler._seeded == {}
    assert ahead.keys() == serial.keys()
    for rid in serial:
        assert ahead[rid] == serial[rid], rid
    # A penalized request is never scheduled ahead of (the sampler reads its tokens): alone, the
    # loop falls back to scheduling after each wait.
    counts["ahead"] = 0
    alone = _stream(smol, [work[-1]])
    assert counts["ahead"] == 0 and alone["pen"] == serial["pen"]
    _assert_no_leak(smol)


def test_schedule_ahead_only_of_steps_launched_with_plain_rows(smol, monkeypatch):
    """A step with a row the sampler edits (here min_tokens) is never scheduled ahead of, even once
    that row's request finished while the step was in flight: the step was launched with it."""
    from kiln.runtime.request import Request, RequestStatus
    from kiln.runtime.scheduler_output import ScheduledRequest, SchedulerOutput

    engine = smol.engine
    monkeypatch.setattr(engine, "_schedule_ahead", True)
    plain = Request("p", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0))
    edited = Request("e", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0, min_tokens=2))
    for r in (plain, edited):
        r.status = RequestStatus.RUNNING
    step = SchedulerOutput([ScheduledRequest(plain, 3, [1]), ScheduledRequest(edited, 3, [2])])
    assert not engine._can_schedule_ahead(step)
    edited.status = RequestStatus.FINISHED_ABORTED
    assert not engine._can_schedule_ahead(step)
    assert engine._can_schedule_ahead(SchedulerOutput([ScheduledRequest(plain, 3, [1])]))



def test_abort_while_scheduled_ahead(smol, smol_greedy, monkeypatch):
    """Scheduling ahead forced on the CPU: a request aborted while the step scheduled ahead of the
    one before is in flight leaves no blocks behind, is never reported again, and the other
    request's tokens are the greedy ones."""
    engine = smol.engine
    monkeypatch.setattr(engine, "_schedule_ahead", True)
    monkeypatch.setattr(engine.executor, "can_schedule_ahead", True)
    monkeypatch.setattr(engine.executor, "_launch_in_submit", True)
    ahead = []
    schedule_ahead = engine.scheduler.schedule_ahead
    monkeypatch.setattr(engine.scheduler, "schedule_ahead", lambda s: ahead.append(s) or schedule_ahead(s))
    engine.add_request("a", PROMPTS[2], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    engine.add_request("b", PROMPTS[3], SamplingParams(max_tokens=6, temperature=0.0))
    engine.step()
    engine.step()  # the prefill's outputs; the first decode of both was scheduled ahead of them
    assert len(ahead) == 1 and ahead[0].advanced is not None
    _abort_a_and_finish_b(smol, smol_greedy)


def _abort_a_and_finish_b(smol, smol_greedy):
    """With the first decode of requests a and b in flight: abort a (its blocks freed at once, its
    step still writing them), run b to the end; a is never reported again, b's tokens are greedy."""
    engine = smol.engine
    assert [s.request.request_id for s in engine._in_flight[0].scheduled] == ["a", "b"]
    out = engine.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.kv_manager.get_block_ids("a") == []
    later = []
    while engine.has_unfinished_requests():
        later += engine.step()
    assert "a" not in {o.request_id for o in later}
    assert later[-1].request_id == "b" and later[-1].outputs[0].token_ids == smol_greedy[3][:6]
    _assert_no_leak(smol)
    return out


def test_a_step_is_processed_while_the_next_one_is_in_flight(smol, monkeypatch):
    engine = smol.engine
    monkeypatch.setattr(engine, "_schedule_ahead", False)  # the loop that waits before it schedules (on a GPU too)
    log = []
    for obj, name in [(engine.executor, "submit"), (engine.executor, "wait"), (engine.output_processor, "process")]:
        def spy(*args, _inner=getattr(obj, name), _name=name):
            log.append(_name)
            return _inner(*args)

        monkeypatch.setattr(obj, name, spy)
    engine.add_request("order", PROMPTS[0], SamplingParams(max_tokens=3, temperature=0.0))
    num_tokens = []
    while engine.has_unfinished_requests():
        num_tokens.append([len(o.outputs[0].token_ids) for o in engine.step()])
        log.append("|")
    assert num_tokens == [[], [1], [2], [3]]  # each call returns the step before it
    assert " ".join(log) == ("submit process | wait submit process | wait submit process | "
                             "wait process |")  # the last step schedules nothing: nothing submitted
    _assert_no_leak(smol)


def test_abort_while_its_step_is_in_flight(smol, smol_greedy):
    engine = smol.engine
    engine.add_request("a", PROMPTS[2], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    engine.add_request("b", PROMPTS[3], SamplingParams(max_tokens=6, temperature=0.0))
    engine.step()
    engine.step()  # outputs of the prefill; the first decode of both is in flight
    out = _abort_a_and_finish_b(smol, smol_greedy)
    assert len(out.outputs[0].token_ids) == 1


@pytest.mark.gpu
def test_gpu_steps_scheduled_ahead_match_serial_steps(kiln_cache_dir, monkeypatch):
    """On CUDA with the default graphs: the loop that schedules ahead (decodes fed on the device,
    full graphs and piecewise mixed steps) gives the serial loop's tokens, stops included."""
    llm = LLM(model={"model": "random:tiny", "max_model_len": 256}, cache={"dir": kiln_cache_dir},
              scheduler={"max_num_batched_tokens": 96})
    engine = llm.engine
    assert engine._schedule_ahead
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 200, (int(n),), generator=gen).tolist()
               for n in torch.randint(3, 70, (24,), generator=gen)]
    greedy = [SamplingParams(max_tokens=5 + i % 13, temperature=0.0, ignore_eos=True) for i in range(24)]
    monkeypatch.setattr(engine, "_overlap", False)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    # Stop on a token each greedy run reaches mid-way; seeded sampling beside it.
    params = [SamplingParams(max_tokens=p.max_tokens, temperature=0.0, ignore_eos=True,
                             stop_token_ids=[r[len(r) // 2]] if i % 3 == 0 else []) for i, (p, r) in
              enumerate(zip(greedy, ref))]
    params += [SamplingParams(max_tokens=12, temperature=0.9, seed=i, ignore_eos=True) for i in range(6)]
    serial = [o.outputs[0].token_ids for o in llm.generate(prompts + prompts[:6], params, use_tqdm=False)]
    monkeypatch.setattr(engine, "_overlap", True)
    calls = []
    schedule_ahead = engine.scheduler.schedule_ahead
    monkeypatch.setattr(engine.scheduler, "schedule_ahead", lambda s: calls.append(1) or schedule_ahead(s))
    ahead = [o.outputs[0].token_ids for o in llm.generate(prompts + prompts[:6], params, use_tqdm=False)]
    assert len(calls) > 10
    assert ahead == serial
    for i in range(0, 24, 3):  # the stop token ended those where the greedy run first has it
        r = ref[i]
        assert ahead[i] == r[:r.index(r[len(r) // 2]) + 1]
    stats = engine.stats()
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == engine.kv_manager.num_usable_blocks
