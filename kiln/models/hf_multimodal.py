"""Vision-language models on the generic path: an unmodified transformers
``*ForConditionalGeneration`` (vision tower, projector, text decoder) split into kiln's two calls.

- ``encode_images(tensors)``: the vision tower and projector over one image's pixel tensors (as
  transformers' own processor made them), through the model's ``get_image_features``: one
  ``[num_image_tokens, hidden]`` embedding per image, which the runner keeps in its encoder cache.
- ``forward(input_ids, positions)``: the text decoder over the flat batch, as on the generic
  path, except that the token embeddings pass through ``torch.ops.kiln.merge_mm_embeds``, which
  writes the step's image embeddings over the rows of image placeholder tokens.

Rules kept here:
- Only the text decoder's attention is kiln's paged attention; the vision tower keeps
  transformers' SDPA (bidirectional over one image's patches).
- Families are served only where their image tokens are plain causal tokens at consecutive 1-D
  positions (LLaVA, and LLaVA-NeXT, whose ``get_image_features`` packs an image's tiles into the
  run of tokens its processor wrote); the others are refused with the reason (``check_vision_supported``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import kiln.ops.multimodal  # noqa: F401  (registers torch.ops.kiln.merge_mm_embeds)
from kiln.models.hf_generic import HFGenericForCausalLM, build_generic

VISION_FAMILIES = ("llava", "llava_next")
# Why the other vision-language families are refused.
REFUSED_VISION = {
    "qwen2_vl": "its M-RoPE positions (time, height, width per image token) are not kiln's 1-D positions",
    "qwen2_5_vl": "its M-RoPE positions (time, height, width per image token) are not kiln's 1-D positions",
    "gemma3": "its image tokens attend to each other bidirectionally, and kiln's paged attention is causal only",
}


def check_vision_supported(config: Any) -> None:
    """ValueError, with the reason, for a vision-language config kiln cannot serve."""
    model_type = getattr(config, "model_type", "?")
    if model_type in VISION_FAMILIES:
        return
    reason = REFUSED_VISION.get(model_type, f"kiln serves images for {list(VISION_FAMILIES)} only")
    raise ValueError(f"model.impl=transformers cannot run the vision-language model {model_type!r}: {reason}")


class HFGenericForImageTextToText(HFGenericForCausalLM):
    """kiln's model contract around a transformers vision-language model, plus ``encode_images``."""

    def __init__(self, hf_model: nn.Module, arch: Any) -> None:
        super().__init__(hf_model, arch)
        config = hf_model.config
        self.image_token_id = int(getattr(config, "image_token_id", None) or config.image_token_index)

    @property
    def text_model(self) -> nn.Module:
        return self.hf.model.language_model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens] int64 -> final hidden states [num_tokens, hidden]."""
        embeds = torch.ops.kiln.merge_mm_embeds(self.hf.get_input_embeddings()(input_ids))  # [T, hidden]
        out = self.text_model(inputs_embeds=embeds.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False)
        return out[0][0]

    @torch.no_grad()
    def encode_images(self, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Pixel tensors of images (the processor's, batched along dim 0) -> one [tokens, hidden]
        embedding per image, in the decoder's dtype."""
        out = self.hf.model.get_image_features(**tensors, return_dict=True).pooler_output
        dtype = self.hf.get_input_embeddings().weight.dtype
        return [e.reshape(-1, e.shape[-1]).to(dtype) for e in out]


def build_vision_generic(config: Any, device: torch.device, dtype: torch.dtype,
                         tp_size: int = 1) -> HFGenericForImageTextToText:
    """``build_generic`` of a vision-language config kiln serves (else ValueError with the reason)."""
    check_vision_supported(config)
    return build_generic(config, device, dtype, tp_size, wrapper=HFGenericForImageTextToText)


def is_vision_config(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None


__all__ = ["HFGenericForImageTextToText", "REFUSED_VISION", "VISION_FAMILIES", "build_vision_generic",
           "check_vision_supported", "is_vision_config"]
