"""Vision-language models on the generic path (LLaVA: CLIP tower, projector, Llama decoder; and
LLaVA-NeXT's tiled images)
against transformers' own ``generate`` on a tiny random checkpoint with its processor: greedy
tokens and logprobs of prompts with one and several images of different sizes, batched with
text-only prompts, chunked prefill cutting inside images, ``LLM.chat`` with image parts, the
compiled path, and the families refused with their reason."""

from __future__ import annotations

import base64

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.models.hf_multimodal import check_vision_supported
from tests.helpers.vision import image, png_bytes, tiny_llava_checkpoint, tiny_llava_next_checkpoint

MAX_TOKENS = 6
PROMPTS = [
    ("USER: <image>\nWhat is this?", [(40, 30, 1)]),
    ("Two pictures <image> and <image>, compare them.", [(64, 64, 2), (17, 90, 3)]),
    ("<image><image><image> three in a row", [(32, 32, 4), (50, 20, 5), (33, 33, 6)]),
]
TEXT_ONLY = "a prompt without pictures"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_llava_checkpoint(str(tmp_path_factory.mktemp("llava")))


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    return AutoProcessor.from_pretrained(checkpoint), LlavaForConditionalGeneration.from_pretrained(checkpoint).eval()


def _engine(checkpoint, **scheduler):
    return LLM(model=checkpoint, dtype="float32", compile={"mode": "eager"},
               cache={"block_size": 16, "num_blocks": 128}, scheduler=scheduler or None)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return _engine(checkpoint)


def _images(specs):
    return [image(w, h, seed) for w, h, seed in specs]


def _hf_generate(hf, prompt, images):
    """transformers' greedy tokens and per-token logprobs."""
    processor, model = hf
    inputs = processor(text=[prompt], images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return tokens, [torch.log_softmax(step[0].float(), -1) for step in out.logits]


def _check(out, expected):
    tokens, logprobs = expected
    assert out.outputs[0].token_ids == tokens
    for step, (token, lp) in enumerate(zip(tokens, out.outputs[0].logprobs)):
        assert abs(lp[token] - logprobs[step][token].item()) < 1e-4, step


def _params():
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)


def test_images_batched_with_text_match_transformers(llm, hf):
    prompts = [{"prompt": p, "multi_modal_data": {"image": _images(s)}} for p, s in PROMPTS] + [TEXT_ONLY]
    outs = llm.generate(prompts, _params(), use_tqdm=False)
    for out, (prompt, specs) in zip(outs, PROMPTS):
        _check(out, _hf_generate(hf, prompt, _images(specs)))
    _check(outs[-1], _hf_generate(hf, TEXT_ONLY, []))


def test_chunked_prefill_cuts_inside_images(checkpoint, hf):
    """Steps of 12 tokens: every 16-token image is split over two or three chunks."""
    small = _engine(checkpoint, max_num_batched_tokens=12, max_num_seqs=4)
    try:
        prompts = [{"prompt": p, "multi_modal_data": {"image": _images(s)}} for p, s in PROMPTS]
        for out, (prompt, specs) in zip(small.generate(prompts, _params(), use_tqdm=False), PROMPTS):
            _check(out, _hf_generate(hf, prompt, _images(specs)))
    finally:
        small.engine.shutdown()


def test_chat_with_image_parts(llm, hf):
    img = image(48, 24, 7)
    url = "data:image/png;base64," + base64.b64encode(png_bytes(img)).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "Describe it."},
                                             {"type": "image_pil", "image_pil": image(20, 20, 8)}]}]
    out = llm.chat(messages, _params(), use_tqdm=False)[0]
    processor, _ = hf
    prompt = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                            "text": "Describe it."}, {"type": "image"}]}],
                                           add_generation_prompt=True, tokenize=False)
    from PIL import Image
    import io

    decoded = Image.open(io.BytesIO(png_bytes(img)))
    _check(out, _hf_generate(hf, prompt, [decoded, image(20, 20, 8)]))


def test_bad_multimodal_prompts_are_refused(llm):
    with pytest.raises(ValueError, match="2 image placeholder"):
        llm.generate({"prompt": "<image> <image>", "multi_modal_data": {"image": [image(8, 8)]}}, _params())
    with pytest.raises(ValueError, match="not a PIL image"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"image": [b"png"]}}, _params())
    with pytest.raises(ValueError, match="no other modality"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"audio": [1]}}, _params())
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.encoder_cache.num_free == llm.engine.scheduler.encoder_cache.num_tokens


def test_compiled_forward_matches_eager(checkpoint, hf):
    compiled = LLM(model=checkpoint, dtype="float32", compile={"mode": "kiln"},
                   cache={"block_size": 16, "num_blocks": 64})
    try:
        prompt, specs = PROMPTS[1]
        out = compiled.generate([{"prompt": prompt, "multi_modal_data": {"image": _images(specs)}}, TEXT_ONLY],
                                _params(), use_tqdm=False)
        _check(out[0], _hf_generate(hf, prompt, _images(specs)))
        _check(out[1], _hf_generate(hf, TEXT_ONLY, []))
    finally:
        compiled.engine.shutdown()


def test_text_model_refuses_images():
    llm = LLM(model="random:tiny", compile={"mode": "eager"}, cache={"num_blocks": 32})
    try:
        with pytest.raises(ValueError, match="reads text only"):
            llm.generate({"prompt": "<image>", "multi_modal_data": {"image": [image(8, 8)]}}, _params())
    finally:
        llm.engine.shutdown()


def test_llava_next_tiles_match_transformers(tmp_path):
    """LLaVA-NeXT (anyres): each image is the best 32-pixel grid of tiles plus the whole image
    scaled down, its features packed by aspect ratio with a newline row, so images of different
    sizes take different numbers of tokens; batched with text and with 12-token chunks cutting
    inside images, kiln gives transformers' tokens and logprobs."""
    from transformers import AutoProcessor, LlavaNextForConditionalGeneration

    path = tiny_llava_next_checkpoint(str(tmp_path / "llava-next"))
    hf = AutoProcessor.from_pretrained(path), LlavaNextForConditionalGeneration.from_pretrained(path).eval()
    # The 17x90 image again, alone: fewer tiles than the 64x64 one it is padded to beside it.
    batch = [*PROMPTS, ("<image> again", [PROMPTS[1][1][1]])]
    prompts = [{"prompt": p, "multi_modal_data": {"image": _images(s)}} for p, s in batch] + [TEXT_ONLY]
    want = [_hf_generate(hf, p, _images(s)) for p, s in batch] + [_hf_generate(hf, TEXT_ONLY, [])]
    counts = {len(hf[0](text=["<image>"], images=_images([s]), return_tensors="pt")["input_ids"][0])
              for s in PROMPTS[1][1] + PROMPTS[2][1]}
    assert len(counts) > 1  # the sizes take different numbers of image tokens
    for scheduler in ({}, {"max_num_batched_tokens": 12, "max_num_seqs": 4}):
        llm = _engine(path, **scheduler)
        try:
            for out, expected in zip(llm.generate(prompts, _params(), use_tqdm=False), want):
                _check(out, expected)
            if not scheduler:  # one step: the repeated image has one hash and is encoded once
                assert llm.engine.executor.runner.encoder_cache.num_encoded == 6
        finally:
            llm.engine.shutdown()


@pytest.mark.parametrize("model_type, reason", [("qwen2_vl", "M-RoPE"), ("gemma3", "bidirectionally")])
def test_other_vision_families_are_refused_with_the_reason(model_type, reason):
    class Config:
        pass

    config = Config()
    config.model_type = model_type
    with pytest.raises(ValueError, match=reason):
        check_vision_supported(config)
