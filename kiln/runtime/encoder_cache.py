"""The encoder cache: each image's vision embeddings computed once and kept while a request needs them.

Two halves, one per side of the step contract:

- ``EncoderCacheManager`` (the scheduler's): which image hashes have embeddings, which requests
  hold each, and how many embedding tokens are free. A step may compute at most ``budget``
  tokens of new embeddings; what it newly holds and what was freed travel in the
  ``SchedulerOutput`` (``encoder_inputs``, ``freed_encoder_hashes``).
- ``EncoderCache`` (the model runner's): the embeddings themselves, keyed by hash. Per step it
  drops the freed ones, runs the vision encoder on the new ones, and gathers the slices the
  step's chunks cover (a chunk may start or end inside an image's tokens)::

      image tokens  [o, o + n)      chunk [start, end)      slice [max(start, o) - o, min(end, o + n) - o)

Rules kept here:
- An entry lives while some request holds it: a request holds an image from the step that first
  schedules any of its tokens until its tokens are all computed (or it finishes or is preempted).
  Two requests with the same image share one entry, computed once.
- An entry freed and held again before the runner heard of the free is kept, not recomputed; one
  held and released within one schedule (its request preempted) is never computed.
- An image that is larger than the budget or the cache can never run: the scheduler refuses its
  request at add time.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from kiln.runtime.multimodal import ImageFeature, features_overlapping


class EncoderCacheManager:
    """Scheduler side: embedding tokens held per image hash, within ``num_tokens``."""

    def __init__(self, num_tokens: int, budget: int) -> None:
        self.num_tokens = num_tokens  # the cache's size in embedding tokens
        self.budget = budget  # new embedding tokens one step may compute
        self.num_free = num_tokens
        self._length: dict[str, int] = {}  # hash -> tokens, for every entry
        self._users: dict[str, set[str]] = {}  # hash -> request ids holding it
        self._held: dict[str, set[str]] = {}  # request id -> hashes it holds
        self._new: dict[str, ImageFeature] = {}  # held since the last take_step: the runner computes them
        self._freed: list[str] = []  # freed since the last take_step: the runner drops them

    def has(self, mm_hash: str) -> bool:
        return mm_hash in self._length

    def holds(self, request_id: str, mm_hash: str) -> bool:
        return mm_hash in self._held.get(request_id, ())

    def hold(self, request_id: str, feature: ImageFeature) -> None:
        h = feature.mm_hash
        if h not in self._length:
            if feature.length > self.num_free:
                raise ValueError(f"the encoder cache has {self.num_free} tokens free, image {h} needs {feature.length}")
            self.num_free -= feature.length
            self._length[h] = feature.length
            if h in self._freed:  # the runner still has it
                self._freed.remove(h)
            else:
                self._new[h] = feature
        self._users.setdefault(h, set()).add(request_id)
        self._held.setdefault(request_id, set()).add(h)

    def release(self, request_id: str, mm_hash: Optional[str] = None) -> None:
        """Drop the request's hold on ``mm_hash`` (None: on every image); entries nobody holds are freed."""
        held = self._held.get(request_id)
        if not held:
            return
        for h in ([mm_hash] if mm_hash is not None else list(held)):
            if h not in held:
                continue
            held.discard(h)
            users = self._users[h]
            users.discard(request_id)
            if not users:
                del self._users[h]
                self.num_free += self._length.pop(h)
                if self._new.pop(h, None) is None:  # never computed: nothing to drop
                    self._freed.append(h)
        if not held:
            del self._held[request_id]

    def take_step(self) -> tuple[list[ImageFeature], list[str]]:
        """(images to compute, hashes to drop) since the last call: one step's share."""
        new, freed = list(self._new.values()), self._freed
        self._new, self._freed = {}, []
        return new, freed


class EncoderCache:
    """Model runner side: vision embeddings by image hash, on the model's device."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model = model  # has encode_images(tensors) -> list of [tokens, hidden]
        self.device = device
        self.embeds: dict[str, torch.Tensor] = {}  # hash -> [tokens, hidden]
        self.num_encoded = 0  # images run through the vision encoder since start

    def update(self, freed: list[str], new: list[ImageFeature]) -> None:
        """Drop the freed entries, then compute the new ones (images of one shape in one call)."""
        for h in freed:
            self.embeds.pop(h, None)
        groups: dict[tuple, list[ImageFeature]] = {}
        for f in new:
            key = tuple((name, tuple(t.shape), t.dtype) for name, t in sorted(f.tensors.items()))
            groups.setdefault(key, []).append(f)
        for features in groups.values():
            tensors = [f.unpacked() for f in features]
            batch = {name: torch.cat([t[name] for t in tensors]).to(self.device) for name in tensors[0]}
            for f, e in zip(features, self.model.encode_images(batch)):
                if e.shape[0] != f.length:
                    raise ValueError(f"image {f.mm_hash}: the vision encoder made {e.shape[0]} embeddings for "
                                     f"{f.length} placeholder tokens")
                self.embeds[f.mm_hash] = e
            self.num_encoded += len(features)

    def gather(self, requests: list[tuple[Any, int, int, int]]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """``requests``: (request, first token row, start, end) of each scheduled chunk -> (token
        rows [M], embeddings [M, hidden]) of every image token in them, or None."""
        rows, parts = [], []
        for request, first_row, start, end in requests:
            for f in features_overlapping(request.mm_features, start, end):
                lo, hi = max(start, f.offset), min(end, f.end)
                parts.append(self.embeds[f.mm_hash][lo - f.offset:hi - f.offset])
                rows.append(torch.arange(first_row + lo - start, first_row + hi - start))
        if not rows:
            return None
        return torch.cat(rows).to(self.device), torch.cat(parts)
