"""Sampler: turns one step's logits into one token per request, plus optional logprobs.

It owns the random generators: one sampler-wide generator for unseeded requests and one per
seeded request (kept until ``forget``), so a seeded request draws the same tokens whatever else
shares its batch. Rules it keeps:

- Per-row options (temperature, top-k, top-p, min-p) are applied as batched tensor ops; Python
  only loops over rows for seeded draws and penalty bookkeeping.
- Order: logits processors (logit bias, min_tokens, the grammar bitmask:
  ``kiln.runtime.logits_processors``), penalties, then greedy rows take the argmax; the others divide by temperature, then
  top-k, top-p, min-p, then draw.
- Reported logprobs come from the log-softmax of the raw logits (before penalties and
  temperature), as vLLM reports them by default.
- The caller's logits tensor is never modified.
- ``launch`` only enqueues device work and ``SampledTokens.result()`` reads it back (the one
  device -> host sync), so on a GPU the engine can do host work while the kernels run. The small
  per-row option tensors go up through pinned memory without waiting for the stream; top-p (one
  ``any()``) and penalties (``unique``) still sync inside ``launch``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kiln.runtime.logits_processors import apply_logits_processors, host_to_device
from kiln.runtime.request import Request
from kiln.sampling_params import SamplingParams

# Below this a temperature is treated as greedy: dividing by it would overflow float32.
_MIN_TEMPERATURE = 1e-5
# Top-p first ranks this many best tokens; a trained model's top_p mass almost always lies in them.
_TOP_P_CANDIDATES = 1024


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per request: {token_id: logprob} for the sampled token and the top-N, or None when not asked.
    logprobs: list[Optional[dict[int, float]]]


@dataclass
class SampledTokens:
    """One step's draws, still on the device; ``result()`` waits for them."""

    token_ids: torch.Tensor  # [num_reqs] int64
    num_reqs: int
    logprob_rows: list[int]  # rows that asked for logprobs
    logprob_counts: list[int]  # per such row: how many top logprobs (params.logprobs)
    sampled_logprobs: Optional[torch.Tensor] = None  # [len(logprob_rows)]
    top_logprobs: Optional[torch.Tensor] = None  # [len(logprob_rows), max count]
    top_ids: Optional[torch.Tensor] = None  # [len(logprob_rows), max count]
    # On a GPU: token_ids copied (non-blocking) into pinned host memory, and the event after the
    # copy, so ``result()`` waits for this step only, not for a step launched after it.
    host_copy: Optional[tuple[torch.Tensor, torch.cuda.Event]] = None

    def result(self) -> SamplerOutput:
        if self.host_copy is not None:
            host, copied = self.host_copy
            copied.synchronize()  # the device -> host sync
            token_ids = host[:self.num_reqs].tolist()
        else:
            token_ids = self.token_ids.tolist()  # the device -> host sync
        logprobs: list[Optional[dict[int, float]]] = [None] * self.num_reqs
        if not self.logprob_rows:
            return SamplerOutput(token_ids, logprobs)
        sampled_lp = self.sampled_logprobs.tolist()
        top_lp = self.top_logprobs.tolist() if self.top_logprobs is not None else [[] for _ in self.logprob_rows]
        top_ids = self.top_ids.tolist() if self.top_ids is not None else [[] for _ in self.logprob_rows]
        for k, (row, n) in enumerate(zip(self.logprob_rows, self.logprob_counts)):
            entry = {token_ids[row]: sampled_lp[k]}
            entry.update(zip(top_ids[k][:n], top_lp[k][:n]))
            logprobs[row] = entry
        return SamplerOutput(token_ids, logprobs)


class Sampler:
    """Call it once per step with that step's logits and the requests they belong to, in order."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}
        self._seeded: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        """Drop a finished request's generator (a no-op for unseeded or unknown requests)."""
        self._seeded.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, requests: list[Request],
                 greedy_ids: Optional[torch.Tensor] = None, bitmask: Optional[torch.Tensor] = None) -> SamplerOutput:
        """Sample and read back: ``launch(...).result()``."""
        return self.launch(logits, requests, greedy_ids, bitmask).result()

    @torch.inference_mode()
    def launch(self, logits: torch.Tensor, requests: list[Request],
               greedy_ids: Optional[torch.Tensor] = None, bitmask: Optional[torch.Tensor] = None) -> SampledTokens:
        """Enqueue the sampling; ``greedy_ids``: ``logits.argmax(-1)`` if the caller already has it
        (a CUDA graph does); ``bitmask``: the step's grammar bitmask (``GrammarBitmasks.fill``)."""
        params = [r.sampling_params for r in requests]
        if all(_is_plain_greedy(p) for p in params):  # fast path: one argmax, one read-back
            ids = greedy_ids if greedy_ids is not None else logits.argmax(dim=-1)
            return SampledTokens(ids, len(params), [], [])
        raw = logits.float()  # [num_reqs, vocab]
        penalized = apply_penalties(apply_logits_processors(raw, requests, bitmask), requests)
        is_greedy = [p.temperature < _MIN_TEMPERATURE for p in params]
        token_ids = penalized.argmax(dim=-1)  # [num_reqs]
        if not all(is_greedy):
            probs = _filtered_probs(penalized, params)
            sampled = probs.div_(self._exponential_noise(probs, requests)).argmax(dim=-1)
            token_ids = torch.where(host_to_device(is_greedy, raw.device), token_ids, sampled)
        return _launch_logprobs(raw, token_ids, params)

    def _exponential_noise(self, probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Exponential(1) noise; argmax(probs / noise) is a draw from probs (the exponential race).

        Seeded rows are refilled from their own generator, which advances only when that request
        is sampled, so its draws do not depend on the batch around it.
        """
        # -log(u) of uniform draws: about twice as fast as exponential_ on CPU. u lies in [0, 1),
        # so noise is never 0 (which would crown any token with prob > 0, or give 0/0 = NaN);
        # u == 0 gives inf, a sure loser.
        noise = torch.empty_like(probs).uniform_(generator=self._shared_generator(probs.device))
        for row, req in enumerate(requests):
            if req.sampling_params.seed is None or req.sampling_params.temperature < _MIN_TEMPERATURE:
                continue
            noise[row].uniform_(generator=self.request_generator(req, probs.device))
        return noise.log_().neg_()

    def request_generator(self, request: Optional[Request], device: torch.device) -> torch.Generator:
        """The generator a request draws from: its own when it is seeded (made on first use), else
        (or for None) the sampler-wide one. Speculative verification
        (``kiln.runtime.rejection_sampler``) draws through it."""
        seed = request.sampling_params.seed if request is not None else None
        if seed is None:
            return self._shared_generator(device)
        gen = self._seeded.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=device).manual_seed(seed)
            self._seeded[request.request_id] = gen
        return gen

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._shared.get(device)
        if gen is None:
            gen = torch.Generator(device=device).manual_seed(self.seed)
            self._shared[device] = gen
        return gen


def _is_plain_greedy(p: SamplingParams) -> bool:
    """Greedy, no penalties, no logprobs, no logits processors: the token is the raw logits' argmax."""
    return (p.temperature < _MIN_TEMPERATURE and p.logprobs is None and p.repetition_penalty == 1.0
            and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0 and not p.edits_logits)


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax after temperature, top-k, top-p and min-p, one tensor op per option."""
    dev = logits.device
    temperature = host_to_device([max(p.temperature, _MIN_TEMPERATURE) for p in params], dev)
    logits = logits / temperature.unsqueeze(1)
    vocab = logits.shape[1]
    if any(0 < p.top_k < vocab for p in params):
        logits = _apply_top_k(logits, [p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    top_p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if top_p_rows:
        # Top-k already masked the rest, so top-p need only rank the best max-k candidates.
        ks = [params[i].top_k for i in top_p_rows]
        num_candidates = max(ks) if all(0 < k < vocab for k in ks) else vocab
        top_p = host_to_device([params[i].top_p for i in top_p_rows], dev)
        index = host_to_device(top_p_rows, dev)
        logits = logits.index_copy(0, index, _apply_top_p(logits[index], top_p, num_candidates))
    probs = logits.softmax(dim=-1)  # [num_reqs, vocab]
    if any(p.min_p > 0.0 for p in params):
        min_p = host_to_device([p.min_p for p in params], dev)
        floor = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [num_reqs, 1]
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def _apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Mask to -inf every token below each row's k-th best; top_k is vocab for rows without it.

    One topk over the largest k instead of a full sort; tokens tied with the k-th all stay.
    """
    vocab = logits.shape[1]
    max_k = max(k for k in top_k if k < vocab)
    k = host_to_device(top_k, logits.device).unsqueeze(1)  # [num_reqs, 1]
    best = logits.topk(max_k, dim=-1).values  # [num_reqs, max_k], descending
    kth = best.gather(1, k.clamp(max=max_k) - 1)
    kth = kth.masked_fill(k >= vocab, float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor, num_candidates: int) -> torch.Tensor:
    """Keep each row's smallest set of best tokens whose probability reaches top_p; -inf the rest.

    logits: [num_rows, vocab]; top_p: [num_rows]. Tokens past the num_candidates best are
    dropped (the caller passes vocab unless top-k already dropped them). The best token is always
    kept. A full sort of the vocab is the slow part, so the best few candidates are ranked
    first, and the sort runs only when they don't reach top_p in some row.
    """
    vocab = logits.shape[1]
    k = min(num_candidates, _TOP_P_CANDIDATES)
    values, order = logits.topk(k, dim=-1) if k < vocab else logits.sort(dim=-1, descending=True)
    # [num_rows, k], descending. Probabilities over the whole row, so a short list can tell
    # whether it reaches top_p.
    log_total = logits.logsumexp(dim=-1, keepdim=True)  # [num_rows, 1]
    probs = (values - log_total).exp()
    if k < num_candidates and bool((probs.sum(dim=-1) < top_p).any()):
        values, order = logits.sort(dim=-1, descending=True)  # [num_rows, vocab]
        probs = (values - log_total).exp()
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the better tokens
    values = values.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, values)


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Repetition (HF-style, prompt + output) then presence/frequency (OpenAI-style, output).

    Returns a new tensor; rows whose params ask for no penalty are left as they are, and when
    no row asks the input is returned untouched.
    """
    params = [r.sampling_params for r in requests]
    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    freq_rows = [i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
    if not rep_rows and not freq_rows:
        return logits
    logits = logits.clone()
    dev, vocab = logits.device, logits.shape[1]
    # Both penalties touch only (row, token) pairs seen so far: work is O(tokens), not O(vocab).
    if rep_rows:
        rows, ids = _flatten_ids(dev, vocab, [(i, requests[i].all_token_ids) for i in rep_rows])
        penalty = torch.tensor([p.repetition_penalty for p in params], device=dev)[rows]
        values = logits[rows, ids]  # [num_pairs]; a repeated pair writes the same value twice
        logits[rows, ids] = torch.where(values > 0, values / penalty, values * penalty)
    if freq_rows:
        rows, ids = _flatten_ids(dev, vocab, [(i, requests[i].output_token_ids) for i in freq_rows])
        pairs, counts = torch.unique(rows * vocab + ids, return_counts=True)
        rows, ids = pairs // vocab, pairs % vocab
        freq = torch.tensor([p.frequency_penalty for p in params], device=dev)[rows]
        presence = torch.tensor([p.presence_penalty for p in params], device=dev)[rows]
        logits[rows, ids] -= freq * counts.to(logits.dtype) + presence
    return logits


def _flatten_ids(
    device: torch.device, vocab: int, row_ids: list[tuple[int, list[int]]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) pairs for one scatter over the batch; ids outside the logits are dropped."""
    rows = [row for row, ids in row_ids for t in ids if 0 <= t < vocab]
    ids = [t for _, ids in row_ids for t in ids if 0 <= t < vocab]
    return (torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(ids, dtype=torch.long, device=device))


def _launch_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]) -> SampledTokens:
    """Logprobs of the sampled token and the top-N, from the raw logits' log-softmax (on the device)."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    out = SampledTokens(token_ids, len(params), rows, [params[i].logprobs for i in rows])
    if not rows:
        return out
    index = host_to_device(rows, raw.device)
    logprobs = raw[index].log_softmax(dim=-1)  # [num_rows, vocab]
    out.sampled_logprobs = logprobs.gather(1, token_ids[index].unsqueeze(1)).squeeze(1)
    max_n = max(out.logprob_counts)
    if max_n:
        out.top_logprobs, out.top_ids = logprobs.topk(max_n, dim=-1)  # [num_rows, max_n]
    return out
