"""PromptEncoder: user text to token ids, where only the chat template writes control tokens.

A control token is one of the tokenizer's special tokens (``<|im_start|>``, ``<|eot_id|>``,
``</s>``): the model reads it as structure, not text. Typed inside a chat message or a completion
prompt, its characters must stay characters, or a user could forge a system or assistant turn.

Rules kept here:
- Every string of a conversation (tools and template variables too) is marked before the template
  renders it: each control token in it is wrapped in private-use markers. In the rendered chat a
  marked token becomes plain text again, also where the template printed a list or dict and repr
  wrote the markers as escapes (``'\\U0010fff0'``); an unmarked one was written by the template
  and stays a control token. A marker the template split off its token (``content[:10]``) is dropped.
- The model's tokenizer is never mutated (the engine thread uses it meanwhile). A fast tokenizer
  gets a private copy that reads special tokens as text and knows one alias (an added token) per
  control token: the template's tokens are written as aliases and the chat is encoded in one pass,
  so it splits exactly where the model's own tokenizer would (lstrip/rstrip included) and a chat
  with no control token in user text encodes to the ids ``apply_chat_template`` gives.
- The three private-use code points markers and aliases are made of are removed from user text
  first, so no user string can forge a marker or an alias.
- Should a tokenizer build a control token out of plain text (its merges reach it), encoding
  raises ValueError rather than let the text through as that token.
"""

from __future__ import annotations

import re
from typing import Any, Optional

_OPEN, _CLOSE, _ALIAS = "\U0010fff0", "\U0010fff1", "\U0010fff2"  # Supplementary Private Use Area-B
_ALIAS_BASE = 0x100000  # alias k is _ALIAS + chr(_ALIAS_BASE + k)
_RESERVED = str.maketrans("", "", _OPEN + _CLOSE + _ALIAS)
# The markers as Python's repr writes them: a template that prints a list or a dict ({{ tools }},
# a tool call's arguments) prints its strings by repr, which escapes private-use characters.
_ESCAPED_OPEN, _ESCAPED_CLOSE = (ascii(c)[1:-1] for c in (_OPEN, _CLOSE))


class PromptEncoder:
    """Encodes completion prompts and chat conversations of one tokenizer, control tokens in user
    text as text. Holds only immutable state after construction, so any thread may call it."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        control = sorted((tid, tok) for tid, tok in added.items() if getattr(tok, "special", False))
        self._control_ids = {tok.content: tid for tid, tok in control}
        self._control_id_set = frozenset(self._control_ids.values())
        contents = "|".join(re.escape(c) for c in sorted(self._control_ids, key=len, reverse=True)) or "(?!)"
        self._control_re = re.compile(contents)
        # In a rendered chat: a marked token (user text, its markers as characters or as repr's
        # escapes), an unmarked one (the template's), a lone marker.
        self._rendered_re = re.compile(
            f"{_OPEN}({contents}){_CLOSE}|{re.escape(_ESCAPED_OPEN)}({contents}){re.escape(_ESCAPED_CLOSE)}"
            f"|({contents})|[{_OPEN}{_CLOSE}]")
        self._text_tokenizer = None  # the private copy, for fast tokenizers
        self._alias_of: dict[str, str] = {}
        self._id_of_alias: dict[int, int] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            self._build_text_tokenizer(backend, control)

    def _build_text_tokenizer(self, backend: Any, control: list) -> None:
        from tokenizers import AddedToken, Tokenizer

        copy = Tokenizer.from_str(backend.to_str())
        copy.no_truncation()
        copy.no_padding()
        copy.encode_special_tokens = True  # every special token is text to the copy ...
        self._alias_of = {tok.content: _ALIAS + chr(_ALIAS_BASE + k) for k, (_, tok) in enumerate(control)}
        copy.add_tokens([  # ... except the aliases: added, not special, so they still split
            AddedToken(self._alias_of[tok.content], single_word=getattr(tok, "single_word", False),
                       lstrip=getattr(tok, "lstrip", False), rstrip=getattr(tok, "rstrip", False),
                       normalized=False, special=False)
            for _, tok in control
        ])
        self._id_of_alias = {copy.token_to_id(self._alias_of[tok.content]): tid for tid, tok in control}
        self._text_tokenizer = copy

    # ---- completions ---------------------------------------------------------------------------
    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text`` as plain text: a control token typed in it is encoded as its characters.
        ``add_special_tokens``: what the tokenizer adds around a prompt (a BOS token)."""
        text = text.translate(_RESERVED)
        if self._text_tokenizer is not None:
            ids = self._text_tokenizer.encode(text, add_special_tokens=add_special_tokens)
            # The post-processor's own tokens (a BOS) are the tokenizer's, not the text's.
            return self._checked(ids.ids, [i for i, m in zip(ids.ids, ids.special_tokens_mask) if not m])
        ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens, split_special_tokens=True)
        return self._checked(ids, self._tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    # ---- chat ----------------------------------------------------------------------------------
    def render_chat(self, conversation: list[dict], add_generation_prompt: bool = True,
                    tools: Optional[list[dict]] = None, continue_final_message: bool = False,
                    template_kwargs: Optional[dict[str, Any]] = None) -> str:
        """The chat template applied to ``conversation`` (and ``tools``, OpenAI's function
        definitions, and ``template_kwargs``, more of the template's variables) with every string
        marked (see the module docstring); ``continue_final_message`` ends the chat inside the last
        message, as transformers does. ``encode_chat`` turns the result into ids, ``plain`` into
        the text it stands for."""
        marked = self._mark(conversation)
        marked_tools = [{"type": "function", "function": self._mark(t)} for t in tools] if tools else None
        return self._tokenizer.apply_chat_template(marked, tools=marked_tools, tokenize=False,
                                                   add_generation_prompt=add_generation_prompt,
                                                   continue_final_message=continue_final_message,
                                                   **self._mark(template_kwargs or {}))

    def encode_chat(self, rendered: str) -> list[int]:
        """The ids of a chat ``render_chat`` rendered: the template's control tokens as control
        tokens, those from the conversation as text."""
        if self._text_tokenizer is not None:
            aliased = self._rendered_re.sub(self._aliased, rendered)
            ids = self._checked(self._text_tokenizer.encode(aliased, add_special_tokens=False).ids)
            return [self._id_of_alias.get(i, i) for i in ids]
        return self._encode_in_pieces(rendered)

    def plain(self, rendered: str) -> str:
        """The rendered chat as text, markers removed."""
        return self._rendered_re.sub(lambda m: m.group(1) or m.group(2) or m.group(3) or "", rendered)

    def _mark(self, value: Any) -> Any:
        if isinstance(value, str):
            return self._control_re.sub(lambda m: _OPEN + m.group(0) + _CLOSE, value.translate(_RESERVED))
        if isinstance(value, dict):
            return {k: self._mark(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._mark(v) for v in value]
        return value

    def _aliased(self, m: re.Match) -> str:
        if m.group(1) is not None or m.group(2) is not None:
            return m.group(1) or m.group(2)  # from the conversation: text
        if m.group(3) is not None:
            return self._alias_of[m.group(3)]  # the template's own
        return ""  # a lone marker

    def _encode_in_pieces(self, rendered: str) -> list[int]:
        # Tokenizers without a Rust backend: text between the template's control tokens is encoded
        # piece by piece with special tokens read as text (``split_special_tokens``, a per-call
        # option there). The model's tokenizer splits at control tokens too, so pieces join as it would.
        ids: list[int] = []
        start = 0
        pending = ""
        for m in self._rendered_re.finditer(rendered):
            pending += rendered[start:m.start()] + (m.group(1) or m.group(2) or "")
            start = m.end()
            if m.group(3) is not None:
                ids += self._encode_piece(pending) + [self._control_ids[m.group(3)]]
                pending = ""
        return ids + self._encode_piece(pending + rendered[start:])

    def _encode_piece(self, text: str) -> list[int]:
        if not text:
            return []
        return self._checked(self._tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    def _checked(self, ids: list[int], text_ids: Optional[list[int]] = None) -> list[int]:
        """``ids``, unless the text's own ids (``text_ids``, default all) hold a control token."""
        made = [i for i in (ids if text_ids is None else text_ids) if i in self._control_id_set]
        if made:
            raise ValueError(f"the tokenizer turns plain text into the control token id {made[0]}, which kiln "
                             "does not let text become; rephrase the text")
        return ids
