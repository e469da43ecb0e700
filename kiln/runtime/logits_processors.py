"""Per-request logits edits applied before sampling: logit bias, min_tokens and grammar bitmasks.

Rules it keeps:
- The caller's logits are never modified; a row nothing applies to is left as it is, and when no
  row asks for anything the input comes back untouched (the sampler's fast path stays).
- Order: logit bias, then min_tokens (EOS and the request's stop ids at -inf while its output is
  shorter), then the grammar bitmask (xgrammar's ``apply_token_bitmask_inplace``: its CUDA kernel on
  the GPU, a vectorized loop on the CPU), so nothing a grammar forbids can be biased back in.
- The sampler reports logprobs of the raw logits, before these edits (as vLLM does by default).
"""

from __future__ import annotations

from typing import Optional

import torch

from kiln.runtime.request import Request


def apply_logits_processors(logits: torch.Tensor, requests: list[Request],
                            bitmask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """logits: [num_reqs, vocab] float32, one row per request; bitmask: ``GrammarBitmasks.fill``'s."""
    params = [r.sampling_params for r in requests]
    bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
    min_rows = [i for i, r in enumerate(requests) if len(r.output_token_ids) < r.sampling_params.min_tokens]
    if not bias_rows and not min_rows and bitmask is None:
        return logits
    logits = logits.clone()
    dev, vocab = logits.device, logits.shape[1]
    if bias_rows:
        pairs = [(i, t, b) for i in bias_rows for t, b in params[i].logit_bias.items() if t < vocab]
        if pairs:
            rows, ids, values = zip(*pairs)
            logits.index_put_((_ids(rows, dev), _ids(ids, dev)), host_to_device(values, dev, logits.dtype),
                              accumulate=True)
    if min_rows:
        pairs = [(i, t) for i in min_rows for t in _stop_ids(requests[i]) if 0 <= t < vocab]
        if pairs:
            rows, ids = zip(*pairs)
            logits[_ids(rows, dev), _ids(ids, dev)] = float("-inf")
    if bitmask is not None:
        import xgrammar as xgr

        constrained = [i for i, p in enumerate(params) if p.structured_outputs is not None]
        indices = None if len(constrained) == len(params) else host_to_device(constrained, dev, torch.int32)
        # The bitmask's host memory is pinned on a GPU: the upload does not wait for the stream.
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(dev, non_blocking=True), indices=indices)
    return logits


def _stop_ids(request: Request) -> list[int]:
    ids = list(request.sampling_params.stop_token_ids)
    if not request.sampling_params.ignore_eos:
        ids.extend(request.eos_token_ids)
    return ids


def _ids(values, device: torch.device) -> torch.Tensor:
    return host_to_device(values, device, torch.int64)


def host_to_device(values: list, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A small host list on ``device``. On CUDA through pinned memory, without waiting: a plain
    (pageable) copy would synchronize the stream, i.e. wait for the forward just launched."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
