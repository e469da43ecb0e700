"""Prompt-lookup n-gram proposer: guess a request's next tokens from its own context.

For each request the last n tokens (n from ``max_n`` down to ``min_n``; the longest that matches
wins) are looked up earlier in its context (prompt and output), and the tokens that followed the
latest match are proposed::

    context:  a b c d x y a b c          suffix "a b c" (n = 3) matched at 0
    proposal:       d x y ...            the k tokens that followed it

Of several matches the latest that is followed by k tokens wins, else the earliest (whose
continuation is the longest there is).

The whole batch is one set of array ops: contexts are right-aligned in one padded matrix, every
window of n tokens is compared with its row's suffix at once (one [B, L] comparison per n, the
matches of n built on those of n - 1), and the latest matching window of each row is found with
one argmax. Python loops over requests only to build the matrix and read
the proposals back, never over tokens.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

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
    # Windows are indexed by their last token e in [0, width - 2] (never the suffix itself). A window
    # of n tokens ending at e matches when ctx[:, e - i] == suffix token i for every i < n, so the
    # matches of n are those of n - 1 and one more [B, width - 1] comparison: no [B, L, n] arrays.
    ends = np.arange(width - 1)
    agree = np.ones((num_reqs, width - 1), dtype=bool)  # [B, L - 1]: windows ending at e agree so far
    matches = {}
    for n in range(1, min(max_n, width - 1) + 1):
        i = n - 1
        agree[:, i:] &= ctx[:, :width - 1 - i] == ctx[:, width - 1 - i, None]
        agree[:, :i] = False  # a window of n tokens ends at n - 1 or later
        if n >= min_n:
            matches[n] = agree & (lens >= n + 1)[:, None]  # a row shorter than n + 1 has no earlier window
    # start[b]: where in row b the proposal begins (the token after the matched window); 0: none yet.
    start = np.zeros(num_reqs, dtype=np.int64)
    for n in sorted(matches, reverse=True):
        match = matches[n]
        # The latest match followed by k tokens; else (a repeat near the end) the earliest match.
        full = match & (ends[None, :] <= (width - 1 - k)[:, None])
        last_full = width - 2 - full[:, ::-1].argmax(axis=1)
        end = np.where(full.any(axis=1), last_full, match.argmax(axis=1))
        found = match.any(axis=1) & (start == 0)
        start = np.where(found, end + 1, start)
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
