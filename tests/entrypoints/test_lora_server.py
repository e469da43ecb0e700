"""Multi-LoRA over HTTP, through an engine-core process: ``server.lora_modules`` adapters chosen with
``"model": name`` give transformers + PEFT's merged tokens, ``/v1/models`` lists them with their
parent, adapters load and unload at run time (behind the API key), and unknown names are 404s in
OpenAI's error schema."""

from __future__ import annotations

import httpx
import pytest

from kiln.config import CacheConfig, CompileConfig, EngineConfig, LoraConfig, ModelConfig, ServerConfig
from kiln.engine.core_client import EngineCoreClient
from kiln.engine.streams import QueueLimits
from kiln.entrypoints.openai.api_server import build_app
from tests.helpers.hf import random_prompts
from tests.helpers.lora import ADAPTERS, VOCAB, greedy, merged, write_adapter, write_base
from tests.helpers.server import ServerThread, assert_error

pytest.importorskip("peft")

KEY = "secret-key"
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    base = write_base("llama", root / "base")
    for i, (name, spec) in enumerate(ADAPTERS.items()):
        write_adapter(base, root / name, *spec, seed=30 + i)
    prompt = random_prompts(VOCAB, [13], seed=2)[0]
    want = {None: greedy(base, prompt, MAX_TOKENS)}
    want.update({name: greedy(merged(base, root / name), prompt, MAX_TOKENS) for name in ADAPTERS})
    config = EngineConfig(model=ModelConfig(str(root / "base"), dtype="float32"), compile=CompileConfig(mode="eager"),
                          cache=CacheConfig(block_size=4, num_blocks=128), lora=LoraConfig(max_loras=2),
                          server=ServerConfig(api_key=KEY, served_model_name="base",
                                              lora_modules=(f"a={root / 'a'}", f"b={root / 'b'}")))
    engine = EngineCoreClient(config, limits=QueueLimits.from_server(config.server))
    engine.wait_ready(timeout=300)
    thread = ServerThread(build_app(engine, config.server))
    yield thread.url, root, prompt, want
    thread.stop()
    engine.shutdown()


def _post(url, path, body):
    return httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def _tokens(url, model, prompt):
    r = _post(url, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                      "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_adapters_by_model_name_match_peft(server):
    url, _, prompt, want = server
    for model in ("base", "a", "b", "a", "base"):
        assert _tokens(url, model, prompt) == want[None if model == "base" else model]
    r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    cards = {c["id"]: c for c in r.json()["data"]}
    assert set(cards) == {"base", "a", "b"} and cards["a"]["parent"] == "base" and cards["base"]["parent"] is None
    assert_error(_post(url, "/v1/completions", {"model": "nope", "prompt": prompt, "max_tokens": 1}), 404, "model")


def test_load_unload_reload_at_run_time(server):
    url, root, prompt, want = server
    assert httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(root / "c")}
                      ).status_code == 401  # behind the API key
    assert _post(url, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(root / "c")}).status_code == 200
    assert _tokens(url, "c", prompt) == want["c"]
    assert_error(_post(url, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(root / "c")}), 400,
                 "lora_name")
    error = assert_error(_post(url, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(root / "base")}),
                         400, "lora_path")
    assert "adapter_config.json is missing" in error["message"]
    assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "c"}).status_code == 200
    assert_error(_post(url, "/v1/completions", {"model": "c", "prompt": prompt, "max_tokens": 1}), 404, "model")
    assert_error(_post(url, "/v1/unload_lora_adapter", {"lora_name": "c"}), 404, "lora_name")
    assert _post(url, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(root / "c")}).status_code == 200
    assert _tokens(url, "c", prompt) == want["c"]  # reloaded under a fresh id
