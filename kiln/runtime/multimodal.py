"""Images of a request: their pixel tensors, placeholder positions and content hashes
(``ImageFeature``), and the frontend's ``MultimodalProcessor`` that makes them.

A prompt names each image with one placeholder token (``<image>``); the processor expands it to
the image's run of placeholder tokens, whose embeddings the vision encoder computes::

    prompt ids:    [ t t <image> t t <image> t ]              one placeholder per image
    expanded ids:  [ t t i i i i t t i i i i t ]              image k: offset o_k, length n_k
    ImageFeature:  (hash of the pixels, offset 2, length 4, pixel tensors)

Rules kept here:
- Images are preprocessed by transformers' own processor of the model (``AutoProcessor``), never
  by hand; its pixel tensors travel as bytes + shape + dtype (``PackedTensor``), so an
  ``AddRequest`` crosses the process boundary without pickle.
- An image's hash is over its processed pixel tensors (names, shapes, dtypes, bytes): the same
  picture gives the same hash (the encoder cache and the prefix cache share it), another picture
  another hash.
- Bad input raises ValueError naming ``multi_modal_data`` and the image: not an image, a count of
  images that differs from the prompt's placeholders, a model without vision.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Optional

import msgspec
import torch

MM_DATA = "multi_modal_data"


class PackedTensor(msgspec.Struct, frozen=True):
    """A CPU tensor as bytes, its shape and dtype name."""

    data: bytes
    shape: list[int]
    dtype: str

    @classmethod
    def pack(cls, t: torch.Tensor) -> "PackedTensor":
        t = t.detach().cpu().contiguous()
        return cls(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"", list(t.shape),
                   str(t.dtype).removeprefix("torch."))

    def unpack(self) -> torch.Tensor:
        dtype = getattr(torch, self.dtype)
        if not self.data:
            return torch.empty(self.shape, dtype=dtype)
        return torch.frombuffer(bytearray(self.data), dtype=torch.uint8).view(dtype).reshape(self.shape)


class ImageFeature(msgspec.Struct, frozen=True):
    """One image of a prompt: tokens [offset, offset + length) are its placeholders."""

    mm_hash: str
    offset: int
    length: int
    tensors: dict[str, PackedTensor]  # the processor's outputs for this image (batch dim 1)

    @property
    def end(self) -> int:
        return self.offset + self.length

    def unpacked(self) -> dict[str, torch.Tensor]:
        return {name: t.unpack() for name, t in self.tensors.items()}


def image_hash(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def features_overlapping(features: tuple[ImageFeature, ...], start: int, end: int) -> list[ImageFeature]:
    """The images with a placeholder token in positions [start, end)."""
    return [f for f in features if f.offset < end and start < f.end]


class MultimodalProcessor:
    """The model's transformers processor, for images; safe from any thread once built (it only
    reads the processor)."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.image_token: str = processor.image_token
        self.image_token_id: int = processor.tokenizer.convert_tokens_to_ids(self.image_token)

    @classmethod
    def from_model_dir(cls, path: Optional[str]) -> Optional["MultimodalProcessor"]:
        """The processor of a vision-language checkpoint directory, else None."""
        if path is None or not os.path.isfile(os.path.join(path, "processor_config.json")):
            return None
        from kiln.models.hf_generic import import_transformers

        import_transformers()
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(path)
        return cls(processor) if getattr(processor, "image_processor", None) is not None else None

    def expand(self, token_ids: list[int], images: list[Any]) -> tuple[list[int], tuple[ImageFeature, ...]]:
        """``token_ids`` with each image placeholder expanded to its image's tokens, and the images'
        features. ValueError when the placeholders and the images do not pair up."""
        slots = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if len(slots) != len(images):
            raise ValueError(f"{MM_DATA}: the prompt has {len(slots)} image placeholder(s) ({self.image_token}) "
                             f"but {len(images)} image(s) were given; write one {self.image_token} per image")
        if not images:
            return list(token_ids), ()
        counts, tensors = self._preprocess(images)
        ids: list[int] = []
        features = []
        prev = 0
        for slot, count, image_tensors in zip(slots, counts, tensors):
            ids += token_ids[prev:slot]
            features.append(ImageFeature(image_hash(image_tensors), len(ids), count,
                                         {k: PackedTensor.pack(v) for k, v in image_tensors.items()}))
            ids += [self.image_token_id] * count
            prev = slot + 1
        ids += token_ids[prev:]
        return ids, tuple(features)

    def _preprocess(self, images: list[Any]) -> tuple[list[int], list[dict[str, torch.Tensor]]]:
        """Per image: its number of tokens and its pixel tensors, from a processor call over that
        image alone (the processor expands its placeholder by the image's size). Alone, so that an
        image's tensors (and hash) never depend on the others: LLaVA-NeXT pads every image of one
        call to the most tiles among them."""
        from PIL import Image

        for k, img in enumerate(images):
            if not isinstance(img, Image.Image):
                raise ValueError(f"{MM_DATA}: image {k} is a {type(img).__name__}, not a PIL image")
        counts, per_image = [], []
        for k, img in enumerate(images):
            try:
                out = self.processor(text=[self.image_token], images=[img if img.mode == "RGB" else img.convert("RGB")],
                                     return_tensors="pt")
            except (ValueError, OSError, TypeError) as e:
                raise ValueError(f"{MM_DATA}: the model's processor refused image {k}: {e}") from e
            runs = _runs(out["input_ids"][0].tolist(), self.image_token_id)
            if len(runs) != 1:
                raise ValueError(f"{MM_DATA}: the processor made {len(runs)} image token runs for image {k}")
            counts.append(runs[0])
            per_image.append({name: v for name, v in out.items()
                              if name not in ("input_ids", "attention_mask") and isinstance(v, torch.Tensor)})
        return counts, per_image


def _runs(ids: list[int], token: int) -> list[int]:
    """Lengths of the runs of ``token`` in ``ids``."""
    runs, n = [], 0
    for t in ids:
        if t == token:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs + ([n] if n else [])
