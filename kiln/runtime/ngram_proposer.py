"""Prompt-lookup n-gram proposer: guess a request's next tokens from its own context.

For each request the last n tokens (n from ``max_n`` down to ``min_n``; the longest that matches
wins) are looked up earlier in its context (prompt and output), and the tokens that followed the
latest match are proposed::

    context:  a b c d x y a b c          suffix "a b c" (n = 3) matched at 0
    proposal:       d x y ...            the k tokens that followed it

Of several matches the latest that is followed by k tokens wins, else the earliest (whose
continuation is the longest there is).

The whole batch is one set of array ops: contexts are right-aligned in one padded matrix, every
window of n tokens is compared with its row's suffix at once, and the latest matching window of
each row is found with one argmax. Python loops over requests only to build the matrix and read
the proposals back, never over tokens.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kiln.runtime.scheduler_output import SchedulerOutput

# Left padding of the context matrix: never a token id, so a window over it matches no suffix.
_PAD = -1


def propose_ngram(contexts: Sequence[Sequence[int]], num_tokens: Sequence[int], min_n: int, max_n: int
                  ) -> list[list[int]]:
    """Up to ``num_tokens[i]`` proposed tokens for each context (possibly none)."""
    num_reqs = len(contexts)
    if num_reqs == 0:
        return []
    lens = np.fromiter((len(c) for c in contexts), dtype=np.int64, count=num_reqs)
    width = int(lens.max())
    ctx = np.full((num_reqs, width), _PAD, dtype=np.int64)  # [B, L], right-aligned
    for row, c in enumerate(contexts):
        if len(c):
            ctx[row, width - len(c):] = c
    k = np.asarray(num_tokens, dtype=np.int64)
    # start[b]: where in row b the proposal begins (the token after the matched window); 0: none yet.
    start = np.zeros(num_reqs, dtype=np.int64)
    for n in range(min(max_n, width - 1), min_n - 1, -1):
        windows = sliding_window_view(ctx, n, axis=1)[:, :-1]  # [B, L - n, n]: every window but the suffix
        suffix = ctx[:, width - n:]  # [B, n]
        match = (windows == suffix[:, None, :]).all(axis=-1)  # [B, L - n]
        match &= (lens >= n + 1)[:, None]  # a row shorter than n + 1 has no earlier window
        # The latest match followed by k tokens; else (a repeat near the end) the earliest match.
        full = match & (np.arange(match.shape[1])[None, :] <= (width - n - k)[:, None])
        last_full = match.shape[1] - 1 - full[:, ::-1].argmax(axis=1)
        window = np.where(full.any(axis=1), last_full, match.argmax(axis=1))
        found = match.any(axis=1) & (start == 0)
        start = np.where(found, window + n, start)
    k_max = max(num_tokens, default=0)
    if k_max == 0 or not start.any():
        return [[] for _ in range(num_reqs)]
    # start = window + n >= 1 where a window matched, so 0 means no match.
    count = np.where(start > 0, np.minimum(k, width - start), 0)  # [B]
    index = np.minimum(start[:, None] + np.arange(k_max)[None, :], width - 1)  # [B, K]
    proposed = np.take_along_axis(ctx, index, axis=1)  # [B, K]
    return [proposed[row, :count[row]].tolist() for row in range(num_reqs)]


class NgramProposer:
    """``propose_ngram`` over a step's speculating requests (those given lookahead slots)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, sched: SchedulerOutput) -> dict[str, list[int]]:
        speculating = [s for s in sched.scheduled if s.num_lookahead_tokens and s.samples]
        proposals = propose_ngram([s.request.all_token_ids for s in speculating],
                                  [s.num_lookahead_tokens for s in speculating], self.min_n, self.max_n)
        return {s.request.request_id: p for s, p in zip(speculating, proposals) if p}

    def forget(self, request_id: str) -> None:
        """Nothing is kept per request."""
