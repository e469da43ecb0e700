"""POST /v1/embeddings for decoder models: each input runs as a prefill-only engine request through
the same scheduler as generation (batched with it), pooled from the final hidden states (last token
by default, ``pooling: "mean"`` for the mean over the input) and L2-normalized.
"""

from __future__ import annotations

import base64
import struct

from fastapi import Request
from fastapi.responses import Response

from kiln.entrypoints.openai.errors import bad_request
from kiln.entrypoints.openai.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, UsageInfo
from kiln.entrypoints.openai.serving import (
    ClientGone, ServingContext, api_error, collect_finals, new_id, until_disconnected,
)
from kiln.sampling_params import SamplingParams


async def create_embeddings(ctx: ServingContext, body: EmbeddingRequest, raw: Request) -> Response:
    ctx.check(body.model)
    inputs = body.inputs()
    if not inputs:
        raise bad_request("input is empty; give a string, a list of strings or token ids", "input")
    encoder = ctx.prompt_encoder()
    prompts = [encoder.encode_text(p) if isinstance(p, str) and encoder is not None else p for p in inputs]
    request_id = new_id("embd")
    streams = await ctx.start(request_id, prompts, SamplingParams(max_tokens=1), prompt_param="input",
                              pooling=body.pooling)
    try:
        finals = await until_disconnected(raw, collect_finals(streams))
    except ClientGone:
        return Response(status_code=499)
    except Exception as e:  # noqa: BLE001
        raise api_error(e, request_id) from e
    data = [EmbeddingData(index=i, embedding=_encode(out.embedding, body.encoding_format))
            for i, out in enumerate(finals)]
    num_tokens = sum(len(out.prompt_token_ids) for out in finals)
    return EmbeddingResponse(data=data, model=ctx.model_name,
                             usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens))


def _encode(vector: list[float], encoding_format: str):
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")  # OpenAI's: float32 LE
