"""The quality text (``tests/data/python_execution_model.txt``, 2,702 tokens of SmolLM2's tokenizer)
and the perplexity of a model over it in one prefill: what the quantization quality checks measure."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tests.helpers.paged import PagedBatcher, make_kv_caches, run_step
from tests.helpers.paths import DATA_DIR

TEXT = DATA_DIR / "python_execution_model.txt"
BLOCK_SIZE = 16


def perplexity(model, ids: list[int], dtype: torch.dtype) -> float:
    """exp(mean next-token NLL) of ``ids`` in one prefill."""
    num_blocks = len(ids) // BLOCK_SIZE + 2
    caches = make_kv_caches(model.arch, num_blocks, BLOCK_SIZE, dtype=dtype)
    step = PagedBatcher(num_blocks, BLOCK_SIZE).step({"text": ids})
    hidden = run_step(model, caches, step)
    with torch.inference_mode():
        logits = model.compute_logits(hidden[:-1])
    return math.exp(F.cross_entropy(logits, torch.tensor(ids[1:])).item())
