"""Tiny random Llama and Qwen2 checkpoints with random PEFT LoRA adapters (non-zero B), and the
greedy tokens transformers computes for each merged adapter (``merge_and_unload``)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from tests.helpers.hf import write_toy_tokenizer

VOCAB = 128
BASES = ("llama", "qwen2")
# (r, lora_alpha, use_rslora, target_modules) of the adapters written next to each base.
ADAPTERS = {
    "a": (8, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "b": (4, 8, True, ["q_proj", "v_proj", "down_proj"]),
    "c": (16, 8, False, ["k_proj", "o_proj", "up_proj"]),
}


def hf_config(family: str):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return LlamaConfig(**common) if family == "llama" else Qwen2Config(**common, use_sliding_window=False)


def write_base(family: str, path: Path, seed: int = 0):
    """A random base checkpoint of ``family`` in ``path``; returns the transformers model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    model.save_pretrained(path)
    write_toy_tokenizer(path)
    return model


def write_adapter(base, path: Path, r: int, alpha: int, rslora: bool, targets: list[str], seed: int) -> None:
    """A PEFT LoRA adapter of ``base`` with random A and B (B non-zero, large enough to change tokens)."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora,
                                                                target_modules=targets, lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    peft_model.save_pretrained(path)


def merged(base, adapter_dir: Path):
    """The base with the adapter merged into its weights (PEFT's ``merge_and_unload``)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base), str(adapter_dir)).merge_and_unload().eval()


def greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy tokens (full recompute each step, EOS ignored)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def edit_config(adapter_dir: Path, **changes) -> None:
    path = adapter_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
