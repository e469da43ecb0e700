"""What the Ray executor tests share: Ray itself (None when it is not installed, and a mark that
skips without it) and the workload whose completions they compare with the single-process engine's."""

from __future__ import annotations

import pytest

from kiln import SamplingParams

try:
    import ray
except ImportError:
    ray = None
needs_ray = pytest.mark.skipif(ray is None, reason="needs the package 'ray' (requirements-dev.txt)")

PROMPTS = ["Hello there", "The capital of France is", list(range(100, 140)), "1, 2, 3"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3)
