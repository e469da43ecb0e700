"""Tiny Hugging Face checkpoints and what transformers computes on them: the toy tokenizer a random
checkpoint directory needs to load, the MoE families' configs, random prompts and the logits of a
transformers model."""

from __future__ import annotations

import torch

MOE_VOCAB = 512
_MOE_COMMON = dict(vocab_size=MOE_VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                   max_position_embeddings=256, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def write_toy_tokenizer(path) -> None:
    """A four-word word-level tokenizer (``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, ``hello`` 3) saved into ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(path)


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """A transformers model's float logits of one sequence: [len(ids), vocab]."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # [len(ids), vocab]


def random_prompts(vocab: int, lens: list[int], seed: int = 0) -> list[list[int]]:
    """One prompt of random ids below ``vocab`` per length in ``lens``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def moe_hf_configs():
    """transformers configs of tiny Mixtral, Qwen2-MoE and Qwen3-MoE models (vocabulary ``MOE_VOCAB``)."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    return {
        # Every layer sparse, top-2 of 4 renormalized, head_dim 16.
        "mixtral": MixtralConfig(**_MOE_COMMON, intermediate_size=96, num_hidden_layers=2, num_local_experts=4,
                                 num_experts_per_tok=2, sliding_window=None),
        # Top-3 of 6 not renormalized, a gated shared expert, layer 1 dense (mlp_only_layers).
        "qwen2_moe": Qwen2MoeConfig(**_MOE_COMMON, intermediate_size=128, num_hidden_layers=3, num_experts=6,
                                    num_experts_per_tok=3, moe_intermediate_size=48,
                                    shared_expert_intermediate_size=80, norm_topk_prob=False,
                                    mlp_only_layers=[1], use_sliding_window=False),
        # q/k RMSNorm, head_dim 32 != hidden / heads, top-2 of 8 renormalized.
        "qwen3_moe": Qwen3MoeConfig(**_MOE_COMMON, intermediate_size=128, num_hidden_layers=2, num_experts=8,
                                    num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32,
                                    norm_topk_prob=True),
    }
