"""Beam search and best_of > n for the completions and chat handlers (``use_beam_search``,
``best_of``, ``length_penalty``, ``early_stopping``), run as ``kiln.entrypoints.beam_search`` runs
them offline: every step of a search is one engine request per running beam, started like any
other request (its checks, limits and metrics), closed in a ``finally``.

Neither streams: the answer is known once every beam has finished, so ``stream: true`` is a 400
(vLLM answers such a request unstreamed instead, which a streaming client cannot read).
"""

from __future__ import annotations

from kiln.entrypoints.beam_search import best_of_params, keep_best, new_search, ranks_outputs, search_output
from kiln.entrypoints.openai.errors import APIError, bad_request
from kiln.entrypoints.openai.serving import Prompt, ServingContext, collect_finals
from kiln.outputs import RequestOutput
from kiln.runtime.input_processor import TokenizedPrompt
from kiln.sampling_params import SamplingParams


def refuse_stream(params: SamplingParams, stream: bool) -> None:
    if stream and ranks_outputs(params):
        what = "use_beam_search" if params.use_beam_search else "best_of > n"
        raise bad_request(f"stream: {what} answers once every candidate has finished, so it cannot be streamed; "
                          "send stream=false", "stream")


async def run_ranked(ctx: ServingContext, request_id: str, prompts: list[Prompt], params: SamplingParams,
                     priority: int = 0, add_special_tokens: bool = True, prompt_param: str = "prompt",
                     lora=None) -> list[RequestOutput]:
    """The finished outputs (one per prompt, ``params.n`` samples each) of a request that
    ``ranks_outputs``: a beam search of each prompt, or best_of samples cut to the best n."""
    extra = {"lora": lora} if lora is not None else {}
    if not params.use_beam_search:
        streams = await ctx.start(request_id, prompts, best_of_params(params), priority, add_special_tokens,
                                  prompt_param=prompt_param, **extra)
        return [keep_best(out, params) for out in await collect_finals(streams)]
    _check_size(ctx, len(prompts), params.beam_width)
    tokenized = [_tokenize(ctx, p, add_special_tokens, prompt_param) for p in prompts]
    try:
        searches = [new_search(t.token_ids, params, ctx.engine.eos_token_ids, ctx.engine.max_model_len)
                    for t in tokenized]
    except ValueError as e:
        raise bad_request(str(e), "max_tokens" if "max_tokens" in str(e) else "n") from e
    num_cached = [0] * len(searches)
    step = 0
    while live := [i for i, s in enumerate(searches) if not s.done]:
        beams = [(i, ids) for i in live for ids in searches[i].step_prompts()]
        streams = await ctx.start(f"{request_id}-{step}", [ids for _, ids in beams], searches[live[0]].step_params(),
                                  priority, prompt_param=prompt_param, **extra)
        finals = iter(await collect_finals(streams))
        for i in live:
            outs = [next(finals) for _ in searches[i].running]
            if step == 0:
                num_cached[i] = outs[0].num_cached_tokens
            searches[i].advance([out.outputs[0].logprobs[0] for out in outs])
        step += 1
    return [search_output(s, f"{request_id}-{i}", t.text, params, ctx.engine.tokenizer, num_cached[i])
            for i, (s, t) in enumerate(zip(searches, tokenized))]


def _check_size(ctx: ServingContext, num_prompts: int, beam_width: int) -> None:
    """A search runs up to prompts x beam_width requests a step: within the server's per-request limits."""
    limit = min(ctx.server.max_seqs_per_request, ctx.server.max_prompts_per_request)
    if num_prompts * beam_width > limit:
        raise APIError(400, f"{num_prompts} prompt(s) x a beam width of {beam_width} is {num_prompts * beam_width} "
                            f"beams, more than this server runs for one request (server.max_seqs_per_request and "
                            f"server.max_prompts_per_request: {limit}); lower best_of or n, or send fewer prompts",
                       "n", "limit_exceeded")


def _tokenize(ctx: ServingContext, prompt: Prompt, add_special_tokens: bool, prompt_param: str) -> TokenizedPrompt:
    try:
        return ctx.engine.process(prompt, SamplingParams(max_tokens=1), add_special_tokens)
    except ValueError as e:
        raise bad_request(str(e), prompt_param) from e
