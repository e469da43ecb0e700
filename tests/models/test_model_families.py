"""Native model families against transformers: Qwen3, Gemma 2, Gemma 3 text, Phi-3, OLMo-2, Granite,
Mistral with a real sliding window, RoPE scaling types, and stop on every EOS id.

Each family is a tiny random config built with transformers' own config class, saved with
``save_pretrained`` as a checkpoint directory (config.json, safetensors, generation_config.json)
and loaded by kiln by path. Configs are chosen so each family's special parts show: windows shorter
than the prompts (and alternating with full layers where the family alternates), a soft-cap small
enough that tanh bends the scores, partial rotary, LongRoPE, and Granite's multipliers away from 1.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.models.arch import PRESETS, ArchConfig
from kiln.models.loader import build_empty_model, stop_token_ids
from kiln.models.rope import rope_inv_freq
from tests.helpers.hf import write_toy_tokenizer
from tests.helpers.paged import PagedBatcher, make_kv_caches, run_step, split_rows

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
PROMPT_LENS = [5, 1, 17, 33]  # longer than every window below
MAX_TOKENS = 32


def _configs():
    import transformers as T

    return {
        # Windowed layers from max_window_layers=1 on; head_dim * heads != hidden.
        "qwen3": T.Qwen3Config(**COMMON, head_dim=24, use_sliding_window=True, sliding_window=5,
                               max_window_layers=1),
        "gemma2": T.Gemma2Config(**COMMON, head_dim=16, sliding_window=6, query_pre_attn_scalar=20,
                                 attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
        "gemma3_text": T.Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=6, query_pre_attn_scalar=20,
                                          sliding_window_pattern=2, rope_theta=10000.0, rope_local_base_freq=100.0,
                                          rope_scaling={"rope_type": "linear", "factor": 2.0}),
        # LongRoPE within its trained length (prompt + output <= 64; its attention factor is not 1
        # since max_position_embeddings is 4x that), three quarters of each head rotated, every
        # layer windowed.
        "phi3": T.Phi3Config(**COMMON, original_max_position_embeddings=64, partial_rotary_factor=0.75,
                             rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(6)],
                                           "long_factor": [2.0 + i for i in range(6)]}, sliding_window=7),
        "olmo2": T.Olmo2Config(**COMMON),
        "granite": T.GraniteConfig(**COMMON, embedding_multiplier=3.0, residual_multiplier=0.5,
                                   attention_multiplier=0.3, logits_scaling=2.5),
        "mistral": T.MistralConfig(**COMMON, head_dim=16, sliding_window=8),
    }


FAMILIES = ["qwen3", "gemma2", "gemma3_text", "phi3", "olmo2", "granite", "mistral"]


@contextlib.contextmanager
def _one_thread():
    """transformers' step-by-step generate on tiny models is all per-op overhead: one thread is
    many times faster than several contending for the cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _save_hf(config, path, seed=0):
    """A transformers model of ``config`` with weights large enough that every term shows, saved."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # not ones (or, for Gemma, zeros): a dropped norm weight shows
            else:
                p.normal_(0.0, 0.1)
    model.generation_config.eos_token_id = None  # like ignore_eos: an eos token is just a token
    model.save_pretrained(path)
    write_toy_tokenizer(path)
    return model


def _prompts(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(family, HF model, checkpoint dir, HF greedy continuations of PROMPTS)."""
    path = tmp_path_factory.mktemp(request.param)
    hf = _save_hf(_configs()[request.param], path)
    prompts = _prompts(PROMPT_LENS)
    ref = []
    for ids in prompts:
        with torch.no_grad(), _one_thread():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        ref.append(out[0, len(ids):].tolist())
    return request.param, hf, str(path), prompts, ref


def test_logits_match_transformers(family):
    name, hf, path, prompts, _ = family
    with open(f"{path}/config.json") as f:
        arch = ArchConfig.from_hf_config(json.load(f))
    assert arch.family == name
    if arch.sliding_window:
        assert arch.sliding_window < max(PROMPT_LENS)  # the window really cuts the context
    model = build_empty_model(arch, torch.device("cpu"), torch.float32)
    from kiln.models.loader import iter_safetensors

    model.load_weights(iter_safetensors(path))
    step = PagedBatcher(num_blocks=64, block_size=4).step(dict(enumerate(prompts)))
    logits = split_rows(model.compute_logits(run_step(model, make_kv_caches(arch, 64, 4), step)), step)
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        assert ref.abs().max() > 0.5  # logits far from zero, so atol is a real bound
        torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=1e-4)


ENGINES = {
    "batch": dict(),
    # Prefill chunks of at most 8 tokens, and 6 usable blocks of 16 tokens that cannot hold the
    # four requests' 32-token continuations at once: some are preempted and recomputed.
    "chunked-preempt": dict(scheduler={"max_num_batched_tokens": 8, "max_num_seqs": 3},
                            cache={"num_blocks": 7, "enable_prefix_caching": False}),
}


def _check_engine(family, engine, kiln_cache_dir):
    name, _, path, prompts, ref = family
    kwargs = ENGINES[engine]
    cache = {"dir": kiln_cache_dir, **kwargs.get("cache", {})}
    llm = LLM(path, cache=cache, **{k: v for k, v in kwargs.items() if k != "cache"})
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)  # submitted together
    for ids, out, expected in zip(prompts, outs, ref):
        assert out.outputs[0].token_ids == expected, (name, engine, len(ids))
    if engine == "chunked-preempt":
        assert llm.engine.scheduler.num_preemptions > 0


def test_greedy_tokens_match_transformers_generate(family, kiln_cache_dir):
    _check_engine(family, "batch", kiln_cache_dir)


# Chunked prefill with preemption: Gemma 2 (windows alternating with full layers, soft-caps) in
# the default suite, every other family under -m slow.
@pytest.mark.parametrize("family", ["gemma2"], indirect=True)
def test_chunked_prefill_and_preemption_match_transformers(family, kiln_cache_dir):
    _check_engine(family, "chunked-preempt", kiln_cache_dir)


@pytest.mark.slow  # ~10 s each on two busy cores
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gemma2"], indirect=True)
def test_chunked_prefill_and_preemption_match_transformers_all_families(family, kiln_cache_dir):
    _check_engine(family, "chunked-preempt", kiln_cache_dir)


@pytest.mark.slow  # one compile of a tiny model through kiln's passes (1-4 min on two busy cores)
def test_gemma2_compiled_by_kiln_matches_transformers(tmp_path, kiln_cache_dir):
    """Window, soft-cap, GeGLU and Gemma's norms through the capture, the passes and Inductor."""
    hf = _save_hf(_configs()["gemma2"], tmp_path)
    prompts = _prompts(PROMPT_LENS, seed=1)
    llm = LLM(str(tmp_path), cache={"dir": kiln_cache_dir}, compile={"mode": "kiln"})
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for ids, out in zip(prompts, outs):
        with torch.no_grad(), _one_thread():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()


def _pick_stop_ids(runs: list[list[int]]) -> list[int]:
    """One id per run, taken from it at step 2 or later, such that no run meets any of the three
    before its own: each id then stops exactly its run."""
    import itertools

    for ks in itertools.product(range(2, 20), repeat=len(runs)):
        ids = [r[k] for r, k in zip(runs, ks)]
        if len(set(ids)) == len(ids) and all(not set(r[:k]) & set(ids) for r, k in zip(runs, ks)):
            return ids
    raise AssertionError("no three distinct stop ids found in the greedy runs")


def test_every_eos_id_stops_a_request(tmp_path, kiln_cache_dir):
    """A Llama-3.1-style checkpoint lists three EOS ids (config.json and generation_config.json);
    a greedy request stops at the first of any of them, and each of the three stops one."""
    from transformers import LlamaConfig

    prompts = _prompts([4, 9, 13], seed=2)
    free = tmp_path / "free"
    hf = _save_hf(LlamaConfig(**COMMON), free)
    runs = []
    for ids in prompts:
        with torch.no_grad(), _one_thread():
            runs.append(hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                    pad_token_id=0)[0, len(ids):].tolist())
    eos = _pick_stop_ids(runs)
    assert len(eos) == 3
    ckpt = tmp_path / "llama31"
    _save_hf(LlamaConfig(**{**COMMON, "eos_token_id": eos}), ckpt)
    gen_path = ckpt / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen["eos_token_id"] = eos
    gen_path.write_text(json.dumps(gen))
    config = json.loads((ckpt / "config.json").read_text())
    assert config["eos_token_id"] == eos

    llm = LLM(str(ckpt), cache={"dir": kiln_cache_dir})
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
    stopped_by = set()
    for run, out in zip(runs, outs):
        first = min(i for i, t in enumerate(run) if t in eos)
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.token_ids == run[: first + 1]
        stopped_by.add(run[first])
    assert stopped_by == set(eos)
    # generation_config.json adds to config.json's ids (here: one id in config.json, three there).
    config["eos_token_id"] = eos[0]
    (ckpt / "config.json").write_text(json.dumps(config))
    assert stop_token_ids(str(ckpt), ArchConfig.from_hf_config(config)) == tuple(eos)


ROPE_CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "mscale": 0.7,
                    "mscale_all_dim": 1.0, "beta_fast": 16.0, "beta_slow": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 64,
                 "short_factor": [1.0 + 0.05 * i for i in range(16)], "long_factor": [1.5 + i for i in range(16)]},
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_scaling_matches_transformers_rope_init(case):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_theta": 10000.0, **ROPE_CASES[case]}
    config = LlamaConfig(**{**COMMON, "hidden_size": 128, "num_attention_heads": 4}, rope_parameters=dict(rope))
    arch = ArchConfig.from_hf_config(config.to_dict())
    init = ROPE_INIT_FUNCTIONS[arch.rope_scaling["rope_type"]]
    ref, ref_scale = init(config, torch.device("cpu"))
    ours, scale = rope_inv_freq(arch)
    torch.testing.assert_close(ours, ref.float(), atol=0, rtol=1e-6)
    assert scale == pytest.approx(ref_scale, rel=1e-6)
    if case == "longrope":  # long factors, as transformers picks them past the trained length
        ref_long, _ = init(config, torch.device("cpu"), seq_len=65)
        torch.testing.assert_close(rope_inv_freq(arch, long=True)[0], ref_long.float(), atol=0, rtol=1e-6)
    if case == "dynamic":  # served up to the trained length, where it is the default RoPE
        assert arch.context_limit == 256


def test_unsupported_settings_are_clear_errors():
    base = ArchConfig.from_hf_config(PRESETS["tiny"].to_hf_config()).to_hf_config()
    with pytest.raises(ValueError, match="gpt2"):
        ArchConfig.from_hf_config({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="'su'"):
        ArchConfig.from_hf_config({**base, "rope_parameters": {"rope_type": "su", "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="gelu"):
        ArchConfig.from_hf_config({**base, "hidden_act": "gelu"})
    gemma = PRESETS["gemma2-9b"].to_hf_config()
    with pytest.raises(ValueError, match="bidirectional"):
        ArchConfig.from_hf_config({**gemma, "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        from kiln.models.parallel import TensorParallel

        with torch.device("meta"):
            build_empty_model(PRESETS["olmo2-7b"], torch.device("meta"), torch.bfloat16, TensorParallel(0, 2))


def test_family_presets_round_trip_and_build():
    """Every random:<preset> survives config.json and builds (on the meta device) with its windows."""
    counts = {}
    for name in ("qwen3-8b", "gemma2-9b", "gemma3-12b", "phi3-mini", "phi4-mini", "olmo2-7b", "granite3-8b"):
        arch = PRESETS[name]
        assert ArchConfig.from_hf_config(arch.to_hf_config()) == arch
        with torch.device("meta"):
            model = build_empty_model(arch, torch.device("meta"), torch.bfloat16)
        counts[name] = sum(p.numel() for p in model.parameters())
    assert PRESETS["gemma2-9b"].all_layer_types[:2] == ("sliding_attention", "full_attention")
    assert PRESETS["gemma3-12b"].all_layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",)
    # Published sizes.
    assert counts["qwen3-8b"] == 8_190_735_360 and counts["gemma2-9b"] == 9_241_705_984
    assert counts["phi3-mini"] == 3_821_079_552
