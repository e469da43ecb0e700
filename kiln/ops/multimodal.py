"""``torch.ops.kiln.merge_mm_embeds``: a step's image embeddings written over its token embeddings.

A vision-language model embeds every token of the flat batch, then this op replaces the rows of
image placeholder tokens with their vision embeddings (the slices of the encoder cache that the
step's chunks cover, ``ForwardContext.mm_embeds``)::

    embeds  [T, H]: | t t t | i i i i | t t |      rows 3..6 are one image's tokens 5..8
    mm rows [M]   :         [ 3 4 5 6 ]
    mm embeds     :         [ e5 e6 e7 e8 ]        -> rows 3..6 take e5..e8

The embeddings are data read at run time, never graph constants, so one compiled graph serves
steps with and without images. A step without images gets its input back unchanged.
"""

from __future__ import annotations

import torch

from kiln.forward_context import get_forward_context
from kiln.ops.library import define_op


def merge_mm_embeds_reference(embeds: torch.Tensor) -> torch.Tensor:
    """embeds: [T, H] -> [T, H], the step's image rows replaced by their vision embeddings."""
    out = embeds.clone()  # outputs never alias inputs (kiln.ops.library)
    mm = get_forward_context().mm_embeds
    if mm is not None:
        rows, values = mm
        out[rows] = values.to(out.dtype)
    return out


def _fake(embeds):
    return torch.empty_like(embeds)


merge_mm_embeds = define_op("kiln::merge_mm_embeds", merge_mm_embeds_reference, _fake)
