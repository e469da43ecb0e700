"""Tiny random checkpoints with real chat templates, for tests that parse what a model writes:
the borrowed SmolLM2 tokenizer plus a family's marker tokens and a template modelled on the
family's (``tiny_chat_checkpoint``), and regexes that force an exact text (``exact_regex``)."""

from __future__ import annotations

import os

import torch

# Qwen3's template, cut to what the tests read: tools in <tools>, calls and results in Hermes
# tags, the thinking switch (enable_thinking=false closes an empty <think> block in the prompt)
# and a reasoning_effort variable, as gpt-oss's template has.
QWEN3_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n"
    "</tools>\nFor each call return <tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
    "</tool_call><|im_end|>\n{%- endif %}"
    "{%- if reasoning_effort is defined %}<|im_start|>system\nReasoning: {{ reasoning_effort }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}\n<tool_call>\n"
    "{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}{%- endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
)


def tiny_chat_checkpoint(path: str, chat_template: str, tokens: tuple[str, ...] = (),
                         special_tokens: tuple[str, ...] = ()) -> str:
    """A two-layer Llama with random weights in ``path``: the SmolLM2 tokenizer with ``tokens``
    (plain added tokens, as Qwen3's ``<think>``) and ``special_tokens`` added, and ``chat_template``."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from kiln.config import default_cache_dir
    from kiln.models.loader import tokenizer_dir

    tok = AutoTokenizer.from_pretrained(tokenizer_dir(default_cache_dir()))
    tok.add_tokens(list(tokens))
    if special_tokens:
        tok.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    tok.chat_template = chat_template
    tok.save_pretrained(path)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    assert os.path.exists(os.path.join(path, "config.json"))
    return path


_REGEX_SPECIAL = set(".^$*+?()[]{}|\\/-")


def exact_regex(text: str) -> str:
    """A regex (xgrammar's dialect) whose one match is ``text``."""
    out = []
    for ch in text:
        out.append("\\n" if ch == "\n" else ("\\" + ch if ch in _REGEX_SPECIAL else ch))
    return "".join(out)


def streamed(chunks) -> tuple[str, str, list[dict], list[str]]:
    """(reasoning, content, tool calls, finish reasons) of a streamed chat answer (choice 0)."""
    reasoning, content, calls, finishes = "", "", [], []
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            calls += [{"name": c.function.name, "arguments": c.function.arguments} for c in delta.tool_calls or []]
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    return reasoning, content, calls, finishes
