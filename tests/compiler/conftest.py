"""Fixtures the compiler's CUDA-graph tests share."""

import pytest

from kiln.compiler.graph_sets import dispatch


@pytest.fixture
def dispatch_log(monkeypatch):
    """Every dispatch decision of the model runner: (mode, num_tokens, padded, has a prefill)."""
    import kiln.compiler.graph_sets as graph_sets

    log = []

    def recording(full, piecewise, num_tokens, num_reqs, num_decodes, verify=None, query_len=0):
        mode, padded = dispatch(full, piecewise, num_tokens, num_reqs, num_decodes, verify, query_len)
        log.append((mode, num_tokens, padded, num_decodes < num_reqs))
        return mode, padded

    monkeypatch.setattr(graph_sets, "dispatch", recording)
    return log
