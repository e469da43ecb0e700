"""Verification of proposed tokens: which of them the target model keeps, and the token after.

A request with k proposed (draft) tokens d_1..d_k has k + 1 rows of target logits in the step:
row i scores the token at the position of d_{i+1} (row k, the bonus row, the one after d_k)::

    input tokens:  t   d_1  d_2  ...  d_k          (t: the last emitted token)
    logits row:    0    1    2   ...   k
    scores:       d_1  d_2  d_3  ... bonus

Rules kept here:
- Greedy rows keep d_i while it equals the target's argmax; the first mismatch emits the argmax
  instead, and when all are kept the bonus row's argmax follows. The tokens are exactly those
  of decoding without speculation.
- Sampled rows use rejection sampling against a proposer that is deterministic (prompt lookup,
  a greedy draft model): d_i is kept with probability p_i(d_i), where p_i is the target's
  distribution after penalties, temperature, top-k, top-p and min-p; on a rejection the token is
  drawn from p_i with d_i removed (renormalized). Then every emitted token is distributed exactly
  as p_i: P(x) = p(d) [x = d] + (1 - p(d)) p(x) / (1 - p(d)) [x != d] = p(x).
- Penalties of row i see the output as it would be after d_1..d_i were emitted.
- Random draws come from ``Sampler.request_generator``: a seeded request's own generator (its
  draws depend only on its own rows), else the sampler-wide one.
- Logprobs are those of the emitted tokens, from the raw logits' log-softmax, as the sampler's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from kiln.runtime.request import Request
from kiln.runtime.sampler import _MIN_TEMPERATURE, Sampler, _filtered_probs, apply_penalties, host_to_device
from kiln.sampling_params import SamplingParams


@dataclass
class VerifyOutput:
    token_ids: list[list[int]]  # per request: the kept proposed tokens, then one more
    logprobs: list[Optional[list[dict[int, float]]]]  # per request, per emitted token (None: not asked)
    num_accepted: list[int]  # per request: proposed tokens kept


@dataclass
class VerifiedTokens:
    """A verification still on the device; ``result()`` waits for it (one read-back)."""

    drafts: list[list[int]]
    num_accepted: torch.Tensor  # [num_reqs] int64
    final_ids: torch.Tensor  # [num_reqs] int64: the token after the kept ones
    row_offsets: list[int]  # first logits row of each request
    logprob_reqs: list[int] = field(default_factory=list)  # requests that asked for logprobs
    logprob_counts: list[int] = field(default_factory=list)
    logprob_rows: list[int] = field(default_factory=list)  # every row of those requests, in order
    sampled_logprobs: Optional[torch.Tensor] = None  # [len(logprob_rows)]
    top_logprobs: Optional[torch.Tensor] = None  # [len(logprob_rows), max count]
    top_ids: Optional[torch.Tensor] = None

    def result(self) -> VerifyOutput:
        num_accepted, final_ids = self.num_accepted.tolist(), self.final_ids.tolist()
        tokens = [d[:a] + [f] for d, a, f in zip(self.drafts, num_accepted, final_ids)]
        logprobs: list[Optional[list[dict[int, float]]]] = [None] * len(self.drafts)
        if self.logprob_reqs:
            sampled = self.sampled_logprobs.tolist()
            top_lp = self.top_logprobs.tolist() if self.top_logprobs is not None else None
            top_ids = self.top_ids.tolist() if self.top_ids is not None else None
            where = {row: k for k, row in enumerate(self.logprob_rows)}
            for req, n in zip(self.logprob_reqs, self.logprob_counts):
                entries = []
                for i, token in enumerate(tokens[req]):
                    k = where[self.row_offsets[req] + i]
                    entry = {token: sampled[k]}
                    if top_lp is not None:
                        entry.update(zip(top_ids[k][:n], top_lp[k][:n]))
                    entries.append(entry)
                logprobs[req] = entries
        return VerifyOutput(tokens, logprobs, num_accepted)


@dataclass
class _RowView:
    """A request as row i of its verification sees it: d_1..d_i already in its output."""

    request_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@torch.inference_mode()
def verify(sampler: Sampler, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]]
           ) -> VerifiedTokens:
    """Verify ``drafts[b]`` of each request against its ``len(drafts[b]) + 1`` rows of ``logits``
    ([num_rows, vocab], requests' rows consecutive, in order); a request without drafts is
    sampled as the ``Sampler`` would."""
    dev = logits.device
    num_rows_per_req = [len(d) + 1 for d in drafts]
    offsets = [0]
    for n in num_rows_per_req[:-1]:
        offsets.append(offsets[-1] + n)
    row_params = [r.sampling_params for r, n in zip(requests, num_rows_per_req) for _ in range(n)]
    raw = logits.float()  # [R, V]
    penalized = apply_penalties(raw, _row_views(requests, drafts))
    # Per row: the proposed token it scores (0 on bonus rows, never read there).
    row_draft = host_to_device([t for d in drafts for t in d + [0]], dev, torch.long)  # [R]
    has_draft = host_to_device([i < len(d) for d in drafts for i in range(len(d) + 1)], dev)  # [R]
    accepted = penalized.argmax(dim=-1) == row_draft  # [R] greedy rule
    recovered = penalized.argmax(dim=-1)  # [R]
    is_greedy = [p.temperature < _MIN_TEMPERATURE for p in row_params]
    if not all(is_greedy):
        probs = _filtered_probs(penalized, row_params)  # [R, V]
        uniform, noise = _draws(sampler, requests, num_rows_per_req, probs)
        p_draft = probs.gather(1, row_draft.unsqueeze(1)).squeeze(1)  # [R]
        sampled_accept = uniform < p_draft
        # Rejected rows draw from p without the proposed token; bonus rows from p itself.
        residual = probs.scatter(1, row_draft.unsqueeze(1), 0.0).where(has_draft.unsqueeze(1), probs)
        # p(d) rounding to just under 1 can reject with nothing left: draw from p then (it is d).
        residual = residual.where(residual.sum(dim=-1, keepdim=True) > 0, probs)
        sampled_token = residual.div_(noise).argmax(dim=-1)  # the exponential race: a draw from residual
        greedy_rows = host_to_device(is_greedy, dev)
        accepted = torch.where(greedy_rows, accepted, sampled_accept)
        recovered = torch.where(greedy_rows, recovered, sampled_token)
    accepted &= has_draft
    num_accepted, final_ids = _first_rejections(accepted, recovered, num_rows_per_req, offsets, dev)
    out = VerifiedTokens(drafts, num_accepted, final_ids, offsets)
    _launch_logprobs(out, raw, row_draft, recovered, requests, num_rows_per_req)
    return out


def _row_views(requests: list[Request], drafts: list[list[int]]) -> list:
    """One entry per row for ``apply_penalties``: the request itself on its first row, a view with
    the first i proposed tokens appended on row i. Views are built only where a penalty is asked."""
    rows: list = []
    for req, d in zip(requests, drafts):
        rows.append(req)
        p = req.sampling_params
        needs_view = p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        for i in range(1, len(d) + 1):
            rows.append(_RowView(req.request_id, p, req.prompt_token_ids, req.output_token_ids + d[:i])
                        if needs_view else req)
    return rows


def _draws(sampler: Sampler, requests: list[Request], num_rows_per_req: list[int], probs: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms for the acceptance tests [R] and exponential noise for the draws [R, V]: the
    shared generator fills all rows, then each seeded request's rows are refilled from its own."""
    shared = sampler.request_generator(None, probs.device)
    noise = torch.empty_like(probs).uniform_(generator=shared)
    uniform = torch.empty(probs.shape[0], device=probs.device).uniform_(generator=shared)
    row = 0
    for req, n in zip(requests, num_rows_per_req):
        p = req.sampling_params
        if p.seed is not None and p.temperature >= _MIN_TEMPERATURE:
            gen = sampler.request_generator(req, probs.device)
            noise[row:row + n].uniform_(generator=gen)
            uniform[row:row + n].uniform_(generator=gen)
        row += n
    return uniform, noise.log_().neg_()


def _first_rejections(accepted: torch.Tensor, recovered: torch.Tensor, num_rows_per_req: list[int],
                      offsets: list[int], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request: how many leading proposed tokens were kept, and the token of the row after them."""
    width = max(num_rows_per_req)
    counts = host_to_device(num_rows_per_req, dev, torch.long)  # [B]
    first = host_to_device(offsets, dev, torch.long)  # [B]
    cols = torch.arange(width, device=dev)  # [W]
    grid = first.unsqueeze(1) + torch.minimum(cols.unsqueeze(0), counts.unsqueeze(1) - 1)  # [B, W] rows
    kept = accepted[grid] & (cols.unsqueeze(0) < counts.unsqueeze(1) - 1)  # [B, W]
    num_accepted = kept.long().cumprod(dim=1).sum(dim=1)  # [B]
    return num_accepted, recovered[first + num_accepted]


def _launch_logprobs(out: VerifiedTokens, raw: torch.Tensor, row_draft: torch.Tensor, recovered: torch.Tensor,
                     requests: list[Request], num_rows_per_req: list[int]) -> None:
    """Logprobs of every row of the requests that asked, of the token that row emits if it emits one
    (its proposed token, or on the first rejected / bonus row the recovered one)."""
    reqs = [b for b, r in enumerate(requests) if r.sampling_params.logprobs is not None]
    if not reqs:
        return
    dev = raw.device
    rows = [out.row_offsets[b] + i for b in reqs for i in range(num_rows_per_req[b])]
    row_req = host_to_device([b for b in reqs for _ in range(num_rows_per_req[b])], dev, torch.long)
    row_pos = host_to_device([i for b in reqs for i in range(num_rows_per_req[b])], dev, torch.long)
    index = host_to_device(rows, dev, torch.long)
    emitted = torch.where(row_pos == out.num_accepted[row_req], recovered[index], row_draft[index])
    logprobs = raw[index].log_softmax(dim=-1)  # [num_rows, vocab]
    out.logprob_reqs = reqs
    out.logprob_counts = [requests[b].sampling_params.logprobs for b in reqs]
    out.logprob_rows = rows
    out.sampled_logprobs = logprobs.gather(1, emitted.unsqueeze(1)).squeeze(1)
    max_n = max(out.logprob_counts)
    if max_n:
        out.top_logprobs, out.top_ids = logprobs.topk(max_n, dim=-1)
