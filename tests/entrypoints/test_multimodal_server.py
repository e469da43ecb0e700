"""Images over HTTP: OpenAI chat content parts (data URLs through the ``openai`` client, http(s)
URLs from allowed hosts, file:// URLs under the allowed directory) on a tiny LLaVA served by an
engine-core process, equal to transformers' ``generate``; and hostile images (not an image, a
truncated PNG, a decompression bomb, too many images, hosts and paths not allowed), each a 400
naming the part, after which the server answers normally and holds no image embeddings."""

from __future__ import annotations

import base64
import http.server
import struct
import threading
import zlib

import httpx
import pytest
import torch

from kiln.config import CacheConfig, CompileConfig, EngineConfig, ModelConfig, ServerConfig
from kiln.engine.core_client import EngineCoreClient
from kiln.engine.streams import QueueLimits
from kiln.entrypoints.openai import build_app
from tests.helpers.server import ServerThread, assert_error
from tests.helpers.vision import image, png_bytes, tiny_llava_checkpoint

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_llava_checkpoint(str(tmp_path_factory.mktemp("llava")))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    (d / "cat.png").write_bytes(png_bytes(image(24, 24, 21)))
    return d


class _Images(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    _Images.body = png_bytes(image(36, 12, 22))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def server(checkpoint, media_dir):
    config = EngineConfig(model=ModelConfig(checkpoint, dtype="float32"), compile=CompileConfig(mode="eager"),
                          cache=CacheConfig(block_size=16, num_blocks=128),
                          server=ServerConfig(served_model_name="llava", limit_mm_per_prompt=2,
                                              max_image_pixels=64 * 64, allowed_media_domains=("127.0.0.1",),
                                              allowed_local_media_path=str(media_dir)))
    engine = EngineCoreClient(config, limits=QueueLimits.from_server(config.server))
    engine.wait_ready(timeout=300)
    srv = ServerThread(build_app(engine, config.server))
    yield srv, engine
    srv.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    return AutoProcessor.from_pretrained(checkpoint), LlavaForConditionalGeneration.from_pretrained(checkpoint).eval()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def chat(srv, parts):
    return httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "model": "llava", "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "messages": [{"role": "user", "content": parts}]})


def hf_text(hf, parts, images):
    processor, model = hf
    content = [{"type": "image"} if p["type"] == "image_url" else p for p in parts]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                           tokenize=False)
    inputs = processor(text=[prompt], images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def test_openai_client_with_data_urls_matches_transformers(server, hf):
    srv, _ = server
    client = srv.client()
    one = [image(40, 30, 1)]
    two = [image(64, 64, 2), image(17, 60, 3)]
    cases = [
        [image_part(data_url(png_bytes(one[0]))), {"type": "text", "text": "What is this?"}],
        [{"type": "text", "text": "Compare"}, image_part(data_url(png_bytes(two[0]))), {"type": "text", "text": "and"},
         image_part(data_url(png_bytes(two[1])))],
        [{"type": "text", "text": "no picture here"}],
    ]
    for parts, images in zip(cases, (one, two, [])):
        answer = client.chat.completions.create(model="llava", messages=[{"role": "user", "content": parts}],
                                                max_tokens=MAX_TOKENS, temperature=0.0)
        assert answer.choices[0].message.content == hf_text(hf, parts, images)


def test_responses_input_image_parts(server, hf):
    """/v1/responses takes input_image parts (by URL) as chat takes image_url parts: the same
    answer as transformers'; an uploaded file's id, or a hostile image, is a 400."""
    srv, engine = server
    img = image(40, 30, 11)
    r = httpx.post(srv.url + "/v1/responses", timeout=60, json={
        "model": "llava", "max_output_tokens": MAX_TOKENS, "temperature": 0.0,
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": data_url(png_bytes(img))},
                                               {"type": "input_text", "text": "What is this?"}]}]})
    assert r.status_code == 200, r.text
    text = r.json()["output"][-1]["content"][0]["text"]
    assert text == hf_text(hf, [image_part("x"), {"type": "text", "text": "What is this?"}], [img])
    for part, says in (({"type": "input_image", "file_id": "file-1"}, "image_url"),
                       ({"type": "input_image"}, "image_url"),
                       ({"type": "input_image", "image_url": HOSTILE["truncated_png"](None)}, "content[1]")):
        r = httpx.post(srv.url + "/v1/responses", timeout=60, json={
            "model": "llava", "max_output_tokens": MAX_TOKENS,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "look"}, part]}]})
        error = assert_error(r, 400)
        assert says in error["message"], error
    _answers_normally(srv, engine)


def test_allowed_host_and_local_path(server, hf, image_host, media_dir):
    from PIL import Image

    srv, _ = server
    parts = [image_part(image_host + "/x.png"), {"type": "text", "text": "fetched"}]
    r = chat(srv, parts)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == hf_text(hf, parts, [image(36, 12, 22)])
    parts = [image_part(f"file://{media_dir}/cat.png")]
    r = chat(srv, parts)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == hf_text(hf, parts, [Image.open(media_dir / "cat.png")])


def _bomb_png(width: int, height: int) -> bytes:
    """A small valid PNG whose header claims ``width`` x ``height`` pixels (its data a few zero rows)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # 1-bit greyscale
    rows = zlib.compress(b"\0" * (1 + width // 8) * 4)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


HOSTILE = {
    "not_an_image": lambda d: data_url(b"this is not a picture"),
    "truncated_png": lambda d: data_url(png_bytes(image(32, 32, 5))[:200]),
    "too_many_pixels": lambda d: data_url(png_bytes(image(65, 64, 6))),
    "decompression_bomb": lambda d: data_url(_bomb_png(100_000, 100_000)),
    "bad_base64": lambda d: "data:image/png;base64,@@@",
    "host_not_allowed": lambda d: "http://example.com/cat.png",
    "path_not_allowed": lambda d: "file:///etc/passwd",
    "path_escapes": lambda d: f"file://{d}/../cat.png",
    "other_scheme": lambda d: "ftp://127.0.0.1/cat.png",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_images_are_400s_naming_the_part(server, media_dir, name):
    srv, engine = server
    r = chat(srv, [{"type": "text", "text": "look"}, image_part(HOSTILE[name](media_dir))])
    assert_error(r, 400, "messages[0].content[1]")
    _answers_normally(srv, engine)


def test_too_many_images_is_a_400(server):
    srv, engine = server
    url = data_url(png_bytes(image(8, 8, 1)))
    r = chat(srv, [image_part(url), image_part(url), image_part(url)])
    error = assert_error(r, 400, "messages[0].content[2]")
    assert "limit_mm_per_prompt" in error["message"]
    _answers_normally(srv, engine)


def test_malformed_parts_and_placeholder_counts(server):
    srv, engine = server
    r = chat(srv, [{"type": "image_url", "image_url": "not an object"}])
    assert_error(r, 400)
    r = chat(srv, [{"type": "input_audio", "input_audio": {}}])
    assert_error(r, 400)
    r = chat(srv, [{"type": "text", "text": "a typed <image> is text"}, image_part(data_url(png_bytes(image(8, 8))))])
    assert r.status_code == 200, r.text  # the typed placeholder stays text: one image, one placeholder
    _answers_normally(srv, engine)


def _answers_normally(srv, engine):
    r = chat(srv, [{"type": "text", "text": "still there?"}, image_part(data_url(png_bytes(image(10, 10, 9))))])
    assert r.status_code == 200, r.text
    stats = engine.stats()
    assert stats["num_free_encoder_tokens"] > 0
