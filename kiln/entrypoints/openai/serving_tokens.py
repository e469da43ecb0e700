"""POST /tokenize and /detokenize, in vLLM's request and response shapes.

A prompt is tokenized as a completion's would be (control tokens typed in it are text), messages
as a chat request's (the chat template renders them, tools included), so the ids are the ones the
engine would run.
"""

from __future__ import annotations

from pydantic import ValidationError

from kiln.entrypoints.openai.errors import bad_request
from kiln.entrypoints.openai.protocol import (
    ChatCompletionRequest, DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse,
)
from kiln.entrypoints.openai.serving import ServingContext
from kiln.entrypoints.openai.serving_chat import render_chat_prompt


def tokenize(ctx: ServingContext, body: TokenizeRequest) -> TokenizeResponse:
    ctx.check(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of `prompt` and `messages`", "prompt")
    encoder = ctx.prompt_encoder()
    if body.messages is not None:
        try:
            chat = ChatCompletionRequest(messages=body.messages, tools=body.tools,
                                         add_generation_prompt=body.add_generation_prompt,
                                         continue_final_message=body.continue_final_message,
                                         chat_template_kwargs=body.chat_template_kwargs)
        except ValidationError as e:  # what a chat request would refuse, refused here too
            error = e.errors()[0]
            field = ".".join(str(part) for part in error["loc"]) or "messages"
            raise bad_request(f"{field}: {error['msg']}", field) from e
        ids = render_chat_prompt(ctx, chat).token_ids
        if body.add_special_tokens and ctx.engine.tokenizer.bos_token_id is not None:
            ids = [ctx.engine.tokenizer.bos_token_id] + ids
    else:
        try:
            ids = encoder.encode_text(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        except ValueError as e:
            raise bad_request(f"prompt: {e}", "prompt") from e
    strs = ctx.engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=ctx.engine.max_model_len, tokens=ids, token_strs=strs)


def detokenize(ctx: ServingContext, body: DetokenizeRequest) -> DetokenizeResponse:
    ctx.check(body.model)
    tokenizer = ctx.engine.tokenizer
    vocab = len(tokenizer)
    bad = [t for t in body.tokens if t >= vocab]
    if bad:
        raise bad_request(f"tokens must be ids in [0, {vocab}); got {bad[:5]}", "tokens")
    return DetokenizeResponse(prompt=tokenizer.decode(body.tokens))
