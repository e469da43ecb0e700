"""What an int8 LM head does to quality: SmolLM2 perplexity with its head in float and in int8.

``kiln.models.quantize.HEAD_SCHEMES`` stores an int4 model's LM head in int8 on CUDA. SmolLM2 (the
embedded model) ties its head to the embedding and runs on the CPU, where the rule does not apply,
so this untie the head (a copy of the embedding), applies ``quantize_lm_head`` as on CUDA with the
reference kernels, and measures perplexity over ``tests/data/python_execution_model.txt`` (one
prefill, as ``tests/models/test_quant_quality.py``) for fp32 and int4 weights, each with both heads.

On the CPU a quantized model's one-row logits go through a Q8_0 head (the GGUF's own blocks,
``kiln.ops.cpu_linear.Q8Head``, activations quantized per block of 32 as llama.cpp does). The same
text scored one row at a time through it (``ppl_q8_0_head``) against the float32 head
(``ppl_fp32_head``) measures that.

    python benchmarks/head_quant_quality.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kiln.config import ModelConfig  # noqa: E402
from kiln.models.loader import load_model  # noqa: E402
from kiln.models.quantize import quantize_lm_head, read_gguf_head_q8_0  # noqa: E402
from kiln.models.registry import REGISTERED_MODELS  # noqa: E402
from kiln.ops.cpu_linear import q8_0_head  # noqa: E402
from kiln.ops.registry import reference_kernels  # noqa: E402
from tests.helpers.perplexity import TEXT, perplexity  # noqa: E402


def untie(model) -> None:
    emb = model.embed_tokens.weight
    model.lm_head = nn.Linear(emb.shape[1], emb.shape[0], bias=False, dtype=emb.dtype)
    with torch.no_grad():
        model.lm_head.weight.copy_(emb)


def q8_0_head_perplexities(model, ids: list[int]) -> dict:
    """Perplexity with the float32 head (all rows at once) and with the Q8_0 head (one row a call,
    the decode path); leaves the model's heads as they were."""
    saved = model.head_weight, model.head_q8
    model.head_weight, model.head_q8 = None, None
    fp32_head = perplexity(model, ids, torch.float32)
    blocks = read_gguf_head_q8_0(REGISTERED_MODELS["smollm2-135m-instruct"].find(), tied=True)
    model.head_q8 = q8_0_head(model.embed_tokens.weight, blocks)
    assert model.head_q8 is not None, "kiln._C has no gemv_q8_0"
    logits_all_rows = model.compute_logits
    model.compute_logits = lambda h: torch.cat([logits_all_rows(h[i:i + 1]) for i in range(h.shape[0])])
    try:
        q8_head = perplexity(model, ids, torch.float32)
    finally:
        del model.compute_logits
        model.head_weight, model.head_q8 = saved
    return {"ppl_fp32_head": fp32_head, "ppl_q8_0_head": q8_head, "q8_0_increase_pct": 100 * (q8_head / fp32_head - 1)}


def main() -> None:
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as cache_dir:
        ids = None
        for quantization in ("none", "int4"):
            loaded = load_model(ModelConfig(quantization=quantization), cache_dir, torch.device("cpu"), torch.float32)
            model = loaded.model
            if ids is None:
                ids = loaded.tokenizer(TEXT.read_text())["input_ids"]
            q8 = q8_0_head_perplexities(model, ids)
            untie(model)
            float_head = perplexity(model, ids, torch.float32)
            assert quantize_lm_head(model, "int4", reference_kernels("cuda")) == "int8"
            int8_head = perplexity(model, ids, torch.float32)
            rows.append({"weights": quantization, "tokens": len(ids), "ppl_float_head": float_head,
                         "ppl_int8_head": int8_head, "increase_pct": 100 * (int8_head / float_head - 1), **q8})
            print(rows[-1], flush=True)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
