"""Multi-LoRA through the engine, on the CPU in float32: tiny random Llama and Qwen2 bases with
three random PEFT adapters (non-zero B). A mixed batch (base and adapters interleaved, the same
prompts under every adapter, chunked prefill and prefix caching on) gives, for each request,
transformers' greedy tokens on the base with that adapter merged (``merge_and_unload``); with
more adapters than device slots (and than host slots) too. Adapters load, unload and reload at
run time, and a bad adapter is refused without leaving a request or a block behind; two
tensor-parallel ranks give the same tokens. On CUDA
(``gpu``), the same mixed batch in the joined layout (the shrink inside the base GEMM).
"""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, LoRARequest, SamplingParams
from tests.helpers.hf import random_prompts
from tests.helpers.lora import ADAPTERS, VOCAB, greedy, merged, write_adapter, write_base

pytest.importorskip("peft")

MAX_TOKENS = 6
PROMPT_LENS = [5, 19, 11]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family(request, tmp_path_factory):
    """(base dir, {adapter name: LoRARequest}, prompts, {(adapter or None, prompt index): tokens})."""
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = write_base(request.param, root / "base")
    loras = {}
    for i, (name, spec) in enumerate(ADAPTERS.items()):
        write_adapter(base, root / name, *spec, seed=20 + i)
        loras[name] = LoRARequest(name, i + 1, str(root / name))
    prompts = random_prompts(VOCAB, PROMPT_LENS, seed=1)
    want = {(None, j): greedy(base, p, MAX_TOKENS) for j, p in enumerate(prompts)}
    for name in ADAPTERS:
        model = merged(base, root / name)
        want.update({(name, j): greedy(model, p, MAX_TOKENS) for j, p in enumerate(prompts)})
    return root / "base", loras, prompts, want


def _llm(base_dir, kiln_cache_dir, mode="eager", **lora):
    return LLM(str(base_dir), dtype="float32", compile={"mode": mode, "startup": "complete"},
               cache={"dir": kiln_cache_dir, "block_size": 4}, lora=lora,
               scheduler={"max_num_batched_tokens": 16, "max_num_seqs": 8})


def _mixed(loras, prompts):
    """Every prompt under the base and each adapter, interleaved."""
    names = [None, *ADAPTERS]
    return [(names[k % len(names)], (k // len(names) + k) % len(prompts)) for k in range(3 * len(names))]


def _check_mixed(llm, loras, prompts, want):
    batch = _mixed(loras, prompts)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([prompts[j] for _, j in batch], params, use_tqdm=False,
                        lora_request=[loras[name] if name else None for name, _ in batch])
    got = {(name, j): out.outputs[0].token_ids for (name, j), out in zip(batch, outs)}
    assert got == {key: want[key] for key in batch}
    assert len({tuple(v) for v in got.values()}) > len(prompts)  # the adapters change the tokens


def test_mixed_batch_matches_peft_merged(family, kiln_cache_dir):
    base_dir, loras, prompts, want = family
    llm = _llm(base_dir, kiln_cache_dir, max_loras=4)
    _check_mixed(llm, loras, prompts, want)
    _check_mixed(llm, loras, prompts, want)  # again: every prefix now cached, keyed by adapter
    assert llm.engine.kv_manager.hit_rate > 0
    stats = llm.engine.stats()["lora"]
    assert stats["a"]["requests"] == 6 and stats["a"]["generation_tokens"] == 6 * MAX_TOKENS
    llm.engine.shutdown()


def test_more_adapters_than_slots(family, kiln_cache_dir):
    base_dir, loras, prompts, want = family
    llm = _llm(base_dir, kiln_cache_dir, max_loras=1, max_cpu_loras=1)  # 3 adapters, 1 slot, 1 on the host
    _check_mixed(llm, loras, prompts, want)
    assert llm.engine.executor.runner.lora.num_slot_writes > len(ADAPTERS)
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_usable_blocks
    llm.engine.shutdown()


def test_load_unload_reload_and_refusals(family, kiln_cache_dir, tmp_path):
    base_dir, loras, prompts, want = family
    llm = _llm(base_dir, kiln_cache_dir, max_loras=2)
    engine = llm.engine
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    assert engine.add_lora(loras["a"]) and not engine.add_lora(loras["a"])
    assert engine.executor.runner.lora.list() == {1: "a"}
    assert engine.remove_lora(1) and not engine.remove_lora(1)
    out = llm.generate([prompts[1]], params, use_tqdm=False, lora_request=loras["a"])  # read again on use
    assert out[0].outputs[0].token_ids == want[("a", 1)]
    with pytest.raises(ValueError, match="names adapter directory"):
        engine.add_lora(LoRARequest("other", 1, loras["b"].lora_path))
    with pytest.raises(ValueError, match="adapter_config.json is missing"):
        llm.generate([prompts[0]], params, use_tqdm=False, lora_request=LoRARequest("bad", 9, str(tmp_path)))
    with pytest.raises(ValueError, match="got 2 LoRA requests for 1 prompts"):
        llm.generate([prompts[0]], params, use_tqdm=False, lora_request=[None, None])
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_usable_blocks
    llm.engine.shutdown()


def test_generic_path_matches_peft_merged(family, kiln_cache_dir):
    """model.impl=transformers: each of transformers' projections is followed by a stack of its own,
    and the mixed batch gives the merged adapters' tokens as the native model does."""
    base_dir, loras, prompts, want = family
    llm = LLM(str(base_dir), dtype="float32", impl="transformers", compile={"mode": "eager"},
              cache={"dir": kiln_cache_dir, "block_size": 4}, lora={"max_loras": 2},
              scheduler={"max_num_batched_tokens": 16, "max_num_seqs": 8})
    assert not hasattr(llm.engine.executor.runner.model, "layers")  # transformers' modules, not kiln's
    _check_mixed(llm, loras, prompts, want)  # 3 adapters through 2 slots
    llm.engine.shutdown()


def test_moe_base_serves_attention_adapters(tmp_path, kiln_cache_dir):
    """A sparse (Mixtral) base: adapters on its attention projections give PEFT's merged tokens; one
    on its experts is refused, naming the tensor."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.hf import MOE_VOCAB, moe_hf_configs, write_toy_tokenizer

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(moe_hf_configs()["mixtral"], dtype=torch.float32).eval()
    with torch.no_grad():
        for p in base.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    base.save_pretrained(tmp_path / "base")
    write_toy_tokenizer(tmp_path / "base")
    write_adapter(base, tmp_path / "attn", 8, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj"], seed=3)
    write_adapter(base, tmp_path / "experts", 4, 8, False, ["w1", "w3"], seed=4)
    prompts = random_prompts(MOE_VOCAB, [7, 12], seed=2)
    attn = merged(base, tmp_path / "attn")
    want = [greedy(base, prompts[0], MAX_TOKENS), greedy(attn, prompts[1], MAX_TOKENS)]
    llm = _llm(tmp_path / "base", kiln_cache_dir, max_loras=1)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False,
                            lora_request=[None, LoRARequest("attn", 1, str(tmp_path / "attn"))])
        assert [o.outputs[0].token_ids for o in outs] == want
        assert want[1] != greedy(base, prompts[1], MAX_TOKENS)  # the adapter changes the tokens
        with pytest.raises(ValueError, match=r"mlp\.experts.*cannot serve"):
            llm.engine.add_lora(LoRARequest("experts", 2, str(tmp_path / "experts")))
    finally:
        llm.engine.shutdown()


def test_chat_runs_each_conversation_with_its_adapter(family, kiln_cache_dir):
    base_dir, loras, _, _ = family
    if base_dir.parent.name.startswith("lora-qwen2"):
        pytest.skip("the toy word-level tokenizer loads as Qwen2's BPE class and encodes no text")
    llm = _llm(base_dir, kiln_cache_dir, max_loras=2)
    llm.tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    chat = [[{"role": "user", "content": "one two three"}]] * 3
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.chat(chat, params, use_tqdm=False,
                                                   lora_request=[loras["a"], None, loras["b"]])]
    text = llm.apply_chat_template(chat[0])
    for lora, tokens in zip([loras["a"], None, loras["b"]], got):
        out = llm.generate([text], params, use_tqdm=False, add_special_tokens=False, lora_request=lora)
        assert out[0].outputs[0].token_ids == tokens
    assert len({tuple(t) for t in got}) == 3  # each adapter (and the base) answers differently
    llm.engine.shutdown()


def test_adapters_on_a_quantized_base(family, kiln_cache_dir):
    """LLM(path, quantization="int8"): the base linears are int8 and the adapters' term is added in
    the model dtype; base rows of a mixed batch equal the quantized engine's without LoRA."""
    base_dir, loras, prompts, _ = family
    if base_dir.parent.name.startswith("lora-qwen2"):
        pytest.skip("one family is enough for the quantized base")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    plain = LLM(str(base_dir), dtype="float32", quantization="int8", compile={"mode": "eager"},
                cache={"dir": kiln_cache_dir, "block_size": 4})
    base = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    plain.engine.shutdown()
    llm = LLM(str(base_dir), dtype="float32", quantization="int8", compile={"mode": "eager"},
              cache={"dir": kiln_cache_dir, "block_size": 4}, lora={"max_loras": 2})
    assert llm.config.model.quantization == "int8"
    assert type(llm.engine.executor.runner.model.layers[0].self_attn.qkv_proj) is not torch.nn.Linear
    mixed = [None, loras["a"], None, loras["b"]]
    outs = llm.generate([prompts[0], prompts[0], prompts[1], prompts[1]], params, use_tqdm=False,
                        lora_request=mixed)
    got = [o.outputs[0].token_ids for o in outs]
    assert got[0] == base[0] and got[2] == base[1]
    assert got[1] != base[0] or got[3] != base[1]  # the adapters change the tokens
    llm.engine.shutdown()


def test_engine_without_lora_refuses_an_adapter(family, kiln_cache_dir):
    base_dir, loras, prompts, _ = family
    llm = LLM(str(base_dir), dtype="float32", compile={"mode": "eager"}, cache={"dir": kiln_cache_dir})
    with pytest.raises(ValueError, match="serves none"):
        llm.generate([prompts[0]], SamplingParams(max_tokens=2), use_tqdm=False, lora_request=loras["a"])
    llm.engine.shutdown()


def test_compiled_forward_serves_every_mix_from_one_capture(family, kiln_cache_dir):
    """compile.mode=kiln: the adapters are graph inputs and the slots data, so one capture serves
    every mix, and LoraBackendPass left the KernelSet's op in the graph."""
    base_dir, loras, prompts, want = family
    if base_dir.parent.name.startswith("lora-qwen2"):
        pytest.skip("one family is enough for the compiled path (Inductor builds take a while on the CPU)")
    llm = _llm(base_dir, kiln_cache_dir, mode="kiln", max_loras=2)
    _check_mixed(llm, loras, prompts, want)
    compiled = llm.engine.executor.runner.compiled
    forward = compiled.forward
    assert forward.num_captures == 1 and forward.num_recompiles == 0
    llm.engine.shutdown()


def test_tensor_parallel_ranks_hold_shards_and_match_peft_merged(family, kiln_cache_dir, tmp_path):
    """parallel.tensor_parallel_size=2 (mp, gloo): each rank reads every adapter and writes its
    shard (q/k/v and gate/up columns of B, o/down columns of A), and the mixed batch gives the
    merged adapters' tokens, as one rank does; a refused adapter leaves both ranks serving."""
    base_dir, loras, prompts, want = family
    if base_dir.parent.name.startswith("lora-qwen2"):
        pytest.skip("one family is enough for two rank processes")
    llm = LLM(str(base_dir), dtype="float32", compile={"mode": "eager"},
              cache={"dir": kiln_cache_dir, "block_size": 4}, lora={"max_loras": 2},
              scheduler={"max_num_batched_tokens": 16, "max_num_seqs": 8},
              parallel={"tensor_parallel_size": 2, "backend": "mp"})
    try:
        _check_mixed(llm, loras, prompts, want)  # 3 adapters through 2 slots
        engine = llm.engine
        with pytest.raises(ValueError, match="adapter_config.json is missing"):
            engine.add_lora(LoRARequest("bad", 9, str(tmp_path)))
        assert engine.remove_lora(1) and not engine.remove_lora(1)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        out = llm.generate([prompts[2]], params, use_tqdm=False, lora_request=loras["a"])
        assert out[0].outputs[0].token_ids == want[("a", 2)]
        assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_usable_blocks
    finally:
        llm.engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_joined_layout_on_cuda_matches_peft_merged(family, kiln_cache_dir):
    """On CUDA the stacks take the joined layout (``kiln.models.lora``, ``LoraShrinkJoinPass``): every
    targeted linear of Llama, all but Qwen2's biased qkv; the compiled mixed batch still gives the
    merged adapters' tokens (float32)."""
    base_dir, loras, prompts, want = family
    llm = _llm(base_dir, kiln_cache_dir, mode="kiln", max_loras=4)
    runner = llm.engine.executor.runner
    qwen2 = base_dir.parent.name.startswith("lora-qwen2")
    assert runner.lora.loras.num_joined == (3 if qwen2 else 4) * len(runner.model.layers)
    _check_mixed(llm, loras, prompts, want)
    llm.engine.shutdown()
