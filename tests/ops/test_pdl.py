"""``kiln.ops.pdl``: which kernels launch with programmatic dependent launch."""

from __future__ import annotations

import re
import types

import pytest
import torch

from kiln.ops import pdl
from kiln.ops.options import current, kernel_options


def _cuda_tensor():  # stands in for a CUDA tensor on a machine without one
    return types.SimpleNamespace(is_cuda=True, device=types.SimpleNamespace(index=0))


def test_pdl_only_on_sm90_cuda_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert pdl.pdl_args(torch.zeros(1)) == {"USE_PDL": False}
    monkeypatch.setattr(pdl, "_sm_major", lambda index: 9)
    assert pdl.pdl_args(_cuda_tensor()) == {"USE_PDL": True, "launch_pdl": True}
    monkeypatch.setattr(pdl, "_sm_major", lambda index: 8)
    assert not pdl.use_pdl(_cuda_tensor())
    monkeypatch.setattr(pdl, "_sm_major", lambda index: 9)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.use_pdl(_cuda_tensor())


def test_kernels_pdl_setting(monkeypatch, kernel_config):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(pdl, "_sm_major", lambda index: 9)
    for setting, gemm, other in (("on", True, True), ("off", False, False), ("gemm", True, False)):
        kernel_config(pdl=setting)
        assert pdl.use_pdl(_cuda_tensor(), "gemm") is gemm
        assert pdl.use_pdl(_cuda_tensor()) is other


def test_pdl_setting_a_clear_error_at_config_time():
    with pytest.raises(ValueError, match=re.escape("kernels.pdl='maybe' is not allowed; choose one of "
                                                   "['on', 'off', 'gemm']")):
        with kernel_options(pdl="maybe"):
            pass
    assert current().pdl == "on"  # refused before it was set
