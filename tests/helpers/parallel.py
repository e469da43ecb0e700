"""The tensor-parallel tests' one check: two engines' completions agree."""

from __future__ import annotations

import torch


def assert_same_completions(got, want, atol: float = 1e-4) -> None:
    """Same token ids, and the same top logprobs within ``atol``, completion by completion."""
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got, want):
        for lp_a, lp_b in zip(a.logprobs, b.logprobs):
            assert lp_a.keys() == lp_b.keys()
            keys = sorted(lp_b)
            torch.testing.assert_close(torch.tensor([lp_a[k] for k in keys]), torch.tensor([lp_b[k] for k in keys]),
                                       atol=atol, rtol=atol)
