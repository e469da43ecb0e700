"""The generic path (``model.impl=transformers``): unmodified transformers models against
transformers itself, in eager and kiln modes, the SDPA-to-paged attention pass, and refusals.

Checkpoints are tiny random configs built with transformers' own config classes and saved with
``save_pretrained`` (sharded), for every family kiln also implements natively (Llama, Qwen2,
windowed Mistral, Qwen3, Gemma 2 and Gemma 3 text with sliding-window layers and soft-caps, Phi-3,
OLMo-2, Granite, and the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE) and one it has no code
for (OLMo).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from kiln import LLM, SamplingParams
from kiln.compiler.artifact_cache import key_factors
from kiln.config import CompileConfig, ModelConfig
from kiln.models.arch import PRESETS
from kiln.models.hf_generic import HFGenericForCausalLM, unsupported_reason
from kiln.models.loader import load_model
from kiln.passes.manager import PassConfig, PassManager, build_passes
from kiln.passes.sdpa_to_paged import SDPAToPagedAttentionPass, check_no_sdpa_left, is_sdpa
from tests.helpers.hf import hf_logits, moe_hf_configs, random_prompts, write_toy_tokenizer
from tests.helpers.paged import PagedBatcher, make_kv_caches, run_step, split_rows

CPU = torch.device("cpu")
_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=2,
              bos_token_id=1, pad_token_id=0)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**_SHAPE, head_dim=16),
    "qwen2": lambda: transformers.Qwen2Config(**{**_SHAPE, "tie_word_embeddings": True}),
    # Windows shorter than the prompts, so the window really cuts the context.
    "mistral": lambda: transformers.MistralConfig(**{**_SHAPE, "num_key_value_heads": 1}, head_dim=32,
                                                  sliding_window=8),
    # Layer 0 sliding (window 6), layer 1 full; attention and final logit soft-caps small enough
    # that tanh bends them (Gemma 2); a local RoPE base on the sliding layer (Gemma 3).
    "gemma2": lambda: transformers.Gemma2Config(**_SHAPE, head_dim=16, sliding_window=6, query_pre_attn_scalar=20,
                                                attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(**_SHAPE, head_dim=16, sliding_window=6,
                                                         query_pre_attn_scalar=20, sliding_window_pattern=2,
                                                         rope_theta=10000.0, rope_local_base_freq=100.0),
    # kiln also runs these natively; here they go through transformers' code: q/k norms (qwen3,
    # olmo2), multipliers and logit scaling (granite), fused qkv and gate_up weights (phi3).
    "qwen3": lambda: transformers.Qwen3Config(**_SHAPE, head_dim=16),
    "olmo2": lambda: transformers.Olmo2Config(**_SHAPE),
    "granite": lambda: transformers.GraniteConfig(**_SHAPE, embedding_multiplier=2.0, residual_multiplier=0.5,
                                                  attention_multiplier=0.2, logits_scaling=0.25),
    "phi3": lambda: transformers.Phi3Config(**_SHAPE),
    # No native code in kiln: OLMo (1) normalizes with a LayerNorm that has no weights.
    "olmo": lambda: transformers.OlmoConfig(**_SHAPE),
    # Mixtures of experts (transformers stacks the checkpoint's per-expert tensors): top-2 of 4
    # (Mixtral); top-3 of 6 unnormalized with a gated shared expert and a dense layer (Qwen2-MoE);
    # q/k norms and top-2 of 8 renormalized (Qwen3-MoE).
    **{f: (lambda f=f: moe_hf_configs()[f]) for f in ("mixtral", "qwen2_moe", "qwen3_moe")},
}
NEW_TOKENS = 32


def _random_hf(config, seed: int = 0):
    torch.manual_seed(seed)
    # eager: transformers' reference attention (its SDPA path drops Gemma 2's soft-cap in some versions)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (transformers model, saved checkpoint directory with a toy tokenizer)."""
    out = {}
    for family, make in CONFIGS.items():
        hf = _random_hf(make())
        path = tmp_path_factory.mktemp(f"hf-{family}")
        hf.save_pretrained(path, max_shard_size="100KB")  # sharded
        write_toy_tokenizer(path)
        out[family] = (hf, str(path))
    return out


@pytest.fixture(scope="module")
def generic(checkpoints):
    """family -> kiln LoadedModel through the generic path."""
    return {f: load_model(ModelConfig(model=p, impl="transformers"), p, CPU, torch.float32)
            for f, (_, p) in checkpoints.items()}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_generic_logits_match_transformers(checkpoints, generic, family):
    hf, _ = checkpoints[family]
    loaded = generic[family]
    assert isinstance(loaded.model, HFGenericForCausalLM) and loaded.arch.impl == "transformers"
    vocab = loaded.arch.vocab_size
    # A flat prefill batch of mixed lengths, then a chunked prefill beside decodes.
    prompts = random_prompts(vocab, [5, 1, 17, 33])
    batcher, caches = PagedBatcher(num_blocks=64, block_size=4), make_kv_caches(loaded.arch, 64, 4)
    step = batcher.step(dict(enumerate(prompts)))
    logits = split_rows(loaded.model.compute_logits(run_step(loaded.model, caches, step)), step)
    for i, prompt in enumerate(prompts):
        ref = hf_logits(hf, prompt)
        assert ref.abs().max() > 0.5
        torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=1e-4)
    full = {"a": prompts[3] + [7, 8, 9], "b": prompts[0] + [4, 5]}
    ref = {r: hf_logits(hf, ids) for r, ids in full.items()}
    for spans in [{"a": (0, 20), "b": (0, 6)}, {"a": (20, 36), "b": (6, 7)}]:
        step = batcher.step({("x", r): full[r][s:e] for r, (s, e) in spans.items()})
        got = split_rows(loaded.model.compute_logits(run_step(loaded.model, caches, step)), step)
        for r, (s, e) in spans.items():
            torch.testing.assert_close(got[("x", r)], ref[r][s:e], atol=1e-4, rtol=1e-4)


def _hf_greedy(hf, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    for p in prompts:
        with torch.no_grad():
            # attention_mask given: else generate masks prompt tokens equal to pad_token_id.
            ids = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.int64),
                              max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, pad_token_id=0, eos_token_id=None)
        out.append(ids[0, len(p):].tolist())
    return out


def _kiln_greedy(path: str, prompts, mode: str) -> tuple[list[list[int]], LLM]:
    # A 16-token budget chunks every longer prompt; 24 blocks of 4 cannot hold all four requests
    # to the end, so some are preempted and recomputed.
    llm = LLM(path, impl="transformers", compile={"mode": mode},
              cache={"block_size": 4, "num_blocks": 24, "enable_prefix_caching": False},
              scheduler={"max_num_batched_tokens": 16, "max_num_seqs": 4})
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


# Eager mode in the default suite: Qwen3, Gemma 2 (windows, soft-caps), Qwen3-MoE (stacked experts).
GREEDY_CASES = [pytest.param(f, "eager", marks=() if f in ("qwen3", "gemma2", "qwen3_moe") else pytest.mark.slow)
                for f in sorted(CONFIGS)]
# kiln mode compiles ~10 s per graph on a CPU: one family in the default suite, the rest slow
# (the attention pass's windows and soft-caps are checked without Inductor below).
GREEDY_CASES += [pytest.param(f, "kiln", marks=() if f == "qwen3" else pytest.mark.slow) for f in sorted(CONFIGS)]
GREEDY_CASES += [pytest.param("qwen3", "stock", marks=pytest.mark.slow)]


@pytest.mark.parametrize("family,mode", GREEDY_CASES)
def test_generic_greedy_matches_transformers_generate(checkpoints, family, mode):
    hf, path = checkpoints[family]
    prompts = random_prompts(hf.config.vocab_size, [5, 1, 23, 40], seed=4)
    got, llm = _kiln_greedy(path, prompts, mode)
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == _hf_greedy(hf, prompts)
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == llm.engine.kv_manager.num_usable_blocks  # nothing leaked
    if mode == "kiln" and family == "qwen3":
        # A second start loads the compiled forward from the artifact cache, bound to the
        # transformers model's parameters by name, and gives the same tokens.
        again, llm2 = _kiln_greedy(path, prompts, mode)
        assert llm2.engine.executor.runner.compiled.forward.cache_hit and again == got


def test_stacked_expert_weights_load_from_per_expert_checkpoint_tensors(checkpoints, generic):
    """transformers holds Qwen2-MoE's experts stacked ([E, 2I, H] gate and up, [E, H, I] down);
    its checkpoints hold one tensor per expert and projection, each placed by the layout map."""
    from kiln.models.hf_generic import CheckpointLayout

    hf, path = checkpoints["qwen2_moe"]
    ours = dict(generic["qwen2_moe"].model.hf.named_parameters())
    for name, p in hf.named_parameters():
        torch.testing.assert_close(ours[name], p, atol=0, rtol=0)
    layout = CheckpointLayout(generic["qwen2_moe"].model.hf)
    assert layout.param_of["model.layers.0.mlp.experts.5.up_proj.weight"] == "model.layers.0.mlp.experts.gate_up_proj"
    assert len(layout.param_of) == 2 * 6 * 3  # two sparse layers, six experts, three projections


def test_a_conversion_that_changes_values_is_refused(generic):
    """A checkpoint conversion that is more than a layout change (here: it doubles values) cannot
    be replayed on element indices: refused, never loaded wrong."""
    from kiln.models.hf_generic import CheckpointLayout

    model = generic["qwen2_moe"].model.hf
    layout = CheckpointLayout(model)
    real = layout.revert
    layout.revert = lambda m, state: {k: v * 2 for k, v in real(m, state).items()}
    name = "model.layers.0.mlp.experts.0.down_proj.weight"
    with pytest.raises(ValueError, match="do not cover it exactly once"):
        layout.fill(name, torch.zeros(64, 48))


# ---- the pass -------------------------------------------------------------------------------------
def _targets(gm: torch.fx.GraphModule) -> list[str]:
    return [str(getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes
            if n.op in ("call_function", "call_method")]


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_sdpa_pass_replaces_attention_and_removes_the_mask(checkpoints, generic, family):
    """Dynamo captures the model as compile.mode=kiln does (attention as SDPA); kiln's passes then
    run on that graph, and Dynamo runs the rewritten graph (no Inductor, to keep it quick).
    Gemma 2: the sliding layer's window and both layers' soft-cap reach the paged op."""
    loaded = generic[family]
    seen = {}
    # (window, soft-cap) per layer, as the load-time probe recorded them from transformers' calls.
    options = {"qwen3": ((0, 0.0), (0, 0.0)), "gemma2": ((6, 2.0), (0, 2.0))}[family]
    assert loaded.model.attention_layers == options
    manager = PassManager(build_passes(PassConfig(attention_layers=options)))

    def backend(gm, example_inputs):
        seen["before"], seen["num_sdpa"] = _targets(gm), sum(is_sdpa(n) for n in gm.graph.nodes)
        manager.run_dynamo(gm)
        check_no_sdpa_left(gm.graph)
        seen["after"] = _targets(gm)
        seen["layers"] = [n.args[3:] for n in gm.graph.nodes if "attend_paged" in str(n.target)]
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b: loaded.model(a, b), backend=backend, fullgraph=True, dynamic=False)
    hf, _ = checkpoints[family]
    prompts = random_prompts(512, [6, 11])  # longer than gemma2's window
    step = PagedBatcher(num_blocks=16, block_size=4).step(dict(enumerate(prompts)))
    for t in (step.input_ids, step.positions):
        torch._dynamo.mark_dynamic(t, 0)  # as KilnForward captures: num_tokens symbolic
    with loaded.model.capture_scope():
        hidden = run_step(compiled, make_kv_caches(loaded.arch, 16, 4), step)
    assert seen["num_sdpa"] == 2
    # The mask construction transformers traces: packed-sequence ids from the positions, index grids.
    assert {"diff", "cumsum", "arange"} <= set(seen["before"])
    assert manager.num_rewrites["SDPAToPagedAttentionPass"] == 2 and not manager.failed
    scale = {"qwen3": 0.25, "gemma2": 20 ** -0.5}[family]
    # The layer (KV cache) of each call, its scale, and the window and soft-cap where set.
    expected = {"qwen3": [(0, scale), (1, scale)], "gemma2": [(0, scale, 6, 2.0), (1, scale, 0, 2.0)]}[family]
    assert [len(a) for a in seen["layers"]] == [len(e) for e in expected]
    assert [x for a in seen["layers"] for x in a] == pytest.approx([x for e in expected for x in e])
    left = {"diff", "cumsum", "arange", "scaled_dot_product_attention"} & set(seen["after"])
    assert not left, f"mask construction or SDPA left after the pass: {sorted(left)}"
    # The GQA repeats of k and v (an expand each, per layer) are gone; an expand of the rotary
    # table may stay (some transformers versions trace one).
    assert list(seen["after"]).count("expand") <= list(seen["before"]).count("expand") - 2 * 2
    logits = split_rows(loaded.model.compute_logits(hidden), step)
    for i, p in enumerate(prompts):
        torch.testing.assert_close(logits[i], hf_logits(hf, p), atol=1e-4, rtol=1e-4)


def test_an_sdpa_the_pass_cannot_rewrite_is_refused():
    def attn(q, k, v):  # batch 2: not a flat batch; the pass must refuse it
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)

    x = torch.randn(2, 4, 8, 16)
    gm = torch.fx.symbolic_trace(attn)
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            n.meta["example_value"] = x
    manager = PassManager([SDPAToPagedAttentionPass()])
    manager.run_dynamo(gm)
    assert manager.failed and is_sdpa(next(n for n in gm.graph.nodes if n.op == "call_function"))
    with pytest.raises(RuntimeError, match="could not rewrite"):
        check_no_sdpa_left(gm.graph)


# ---- choosing the path, random presets, the cache key -----------------------------------------------
def test_impl_auto_picks_native_for_kiln_families_and_generic_otherwise(checkpoints):
    llama = load_model(ModelConfig(model=checkpoints["llama"][1]), "", CPU, torch.float32)
    olmo = load_model(ModelConfig(model=checkpoints["olmo"][1]), "", CPU, torch.float32)
    assert not isinstance(llama.model, HFGenericForCausalLM) and isinstance(olmo.model, HFGenericForCausalLM)
    with pytest.raises(ValueError, match="no native implementation of model_type 'olmo'"):
        load_model(ModelConfig(model=checkpoints["olmo"][1], impl="native"), "", CPU, torch.float32)
    with pytest.raises(ValueError, match="model.impl='bogus' is not allowed"):
        ModelConfig(impl="bogus")


def test_random_preset_through_transformers_is_the_same_model(kiln_cache_dir, monkeypatch, tmp_path):
    write_toy_tokenizer(tmp_path)
    monkeypatch.setenv("KILN_TOKENIZER_DIR", str(tmp_path))
    native = load_model(ModelConfig(model="random:tiny-qwen2", seed=3), kiln_cache_dir, CPU, torch.float32)
    hf = load_model(ModelConfig(model="random:tiny-qwen2", seed=3, impl="transformers"), kiln_cache_dir, CPU,
                    torch.float32)
    assert isinstance(hf.model, HFGenericForCausalLM) and hf.name == native.name
    prompts = random_prompts(native.arch.vocab_size, [9, 4])
    logits = []
    for loaded in (native, hf):
        step = PagedBatcher(num_blocks=16, block_size=4).step(dict(enumerate(prompts)))
        caches = make_kv_caches(loaded.arch, 16, 4)
        logits.append(loaded.model.compute_logits(run_step(loaded.model, caches, step)))
    assert logits[0].abs().max() > 0.01
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-4)
    # The compile cache never mixes the two: the key holds the impl.
    config = CompileConfig(mode="kiln")
    passes = PassManager(build_passes(PassConfig()))
    keys = [key_factors(m.model, m.name, config, passes, 64)["model"] for m in (native, hf)]
    assert [k["impl"] for k in keys] == ["native", "transformers"]


# ---- refusals ---------------------------------------------------------------------------------------
REFUSED = {
    "layer kinds": (lambda: transformers.Qwen3Config(**_SHAPE, layer_types=["full_attention", "chunked_attention"]),
                    "chunked_attention"),
    "dynamic rope": (lambda: transformers.LlamaConfig(**_SHAPE, rope_parameters={
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}), "picks frequencies"),
    "encoder-decoder": (lambda: transformers.T5Config(), "encoder-decoder"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_architectures_are_refused_with_the_reason(case, tmp_path):
    make, reason = REFUSED[case]
    config = make()
    assert reason in (unsupported_reason(config) or "")
    if case == "encoder-decoder":
        return  # no *ForCausalLM to save
    d = config.to_dict()
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=f"model.impl=transformers cannot run .*{reason}"):
        load_model(ModelConfig(model=str(tmp_path), impl="transformers"), "", CPU, torch.float32)


def test_tensor_parallel_is_refused_on_the_generic_path(checkpoints):
    from kiln.models.parallel import TensorParallel

    with pytest.raises(ValueError, match="does not support tensor parallelism"):
        load_model(ModelConfig(model=checkpoints["olmo"][1]), "", CPU, torch.float32, TensorParallel(0, 2))


def test_preset_arch_round_trips_through_transformers_config():
    from kiln.models.hf_generic import GenericArch, hf_config_from_dict

    arch = dataclasses.replace(PRESETS["qwen2.5-0.5b"], eos_token_id=(7,))
    generic = GenericArch.from_hf_config(hf_config_from_dict(arch.to_hf_config()))
    assert (generic.num_layers, generic.num_kv_heads, generic.head_dim, generic.vocab_size, generic.eos_token_id) == \
        (arch.num_layers, arch.num_kv_heads, arch.head_dim, arch.vocab_size, (7,))
