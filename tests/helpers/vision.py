"""Tiny random vision-language checkpoints (LLaVA: a CLIP tower, a projector and a Llama decoder)
with their processors, and images made in memory, for the multimodal tests."""

from __future__ import annotations

import io
import os

import torch

IMAGE_TOKEN = "<image>"
IMAGE_SIZE, PATCH_SIZE = 32, 8  # 16 patches: 16 image tokens per image
# A LLaVA-style template: each image part becomes the image token, text parts their text.
LLAVA_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.content is string %}{{ message.content }}{%- else %}"
    "{%- for part in message.content %}{%- if part.type == 'text' %}{{ part.text }}"
    "{%- else %}<image>{%- endif %}{%- endfor %}{%- endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def _tokenizer(path: str, template: str):
    """The SmolLM2 tokenizer with ``<image>`` added and a chat template, saved into ``path``."""
    from transformers import AutoTokenizer

    from kiln.config import default_cache_dir
    from kiln.models.loader import tokenizer_dir

    tok = AutoTokenizer.from_pretrained(tokenizer_dir(default_cache_dir()))
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tok.chat_template = template
    tok.save_pretrained(path)
    return tok


def _towers(tok):
    """A two-layer Llama decoder and a two-layer CLIP tower (32x32 images, 8x8 patches)."""
    from transformers import CLIPVisionConfig, LlamaConfig

    text = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=32)
    return text, vision


def _save_random(model_class, config, path: str) -> str:
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():  # random init leaves the decoder near-uniform; spread its logits out
        for p in model.parameters():
            p.normal_(0, 0.08)
    model.save_pretrained(path)
    assert os.path.exists(os.path.join(path, "config.json"))
    return path


def tiny_llava_checkpoint(path: str) -> str:
    """A LLaVA checkpoint with random weights in ``path``: a two-layer CLIP tower (32x32 images,
    8x8 patches), the projector and a two-layer Llama, the SmolLM2 tokenizer with ``<image>``
    added, a ``LlavaProcessor`` and a chat template that writes image parts as ``<image>``."""
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    tok = _tokenizer(path, LLAVA_TEMPLATE)
    images = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE,
                                "width": IMAGE_SIZE})
    LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=PATCH_SIZE,
                   vision_feature_select_strategy="default", chat_template=LLAVA_TEMPLATE,
                   num_additional_image_tokens=1).save_pretrained(path)
    text, vision = _towers(tok)
    image_token = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token, vision_feature_layer=-1,
                         vision_feature_select_strategy="default", projector_hidden_act="gelu")
    return _save_random(LlavaForConditionalGeneration, config, path)


def tiny_llava_next_checkpoint(path: str) -> str:
    """A LLaVA-NeXT checkpoint with random weights in ``path``: LLaVA's tower and decoder, images
    tiled by the best of a few 32-pixel grids (anyres) plus the whole image scaled down, the tiles'
    features packed by the image's aspect ratio with a newline embedding per row."""
    from transformers import (LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextImageProcessor,
                              LlavaNextProcessor)

    tok = _tokenizer(path, LLAVA_TEMPLATE)
    pinpoints = [[32, 32], [32, 64], [64, 32], [64, 64]]
    images = LlavaNextImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                     crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                     image_grid_pinpoints=pinpoints)
    LlavaNextProcessor(image_processor=images, tokenizer=tok, patch_size=PATCH_SIZE,
                       vision_feature_select_strategy="default", chat_template=LLAVA_TEMPLATE,
                       num_additional_image_tokens=1).save_pretrained(path)
    text, vision = _towers(tok)
    image_token = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    config = LlavaNextConfig(vision_config=vision, text_config=text, image_token_index=image_token, vision_feature_layer=-1,
                             vision_feature_select_strategy="default", projector_hidden_act="gelu",
                             image_grid_pinpoints=pinpoints)
    return _save_random(LlavaNextForConditionalGeneration, config, path)


def image(width: int, height: int, seed: int = 0):
    """An RGB PIL image of random pixels."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()
