"""``kiln.ops.pdl``: which kernels launch with programmatic dependent launch."""

from __future__ import annotations

import types

import pytest
import torch

from kiln.ops import pdl


def _cuda_tensor():  # stands in for a CUDA tensor on a machine without one
    return types.SimpleNamespace(is_cuda=True, device=types.SimpleNamespace(index=0))


def test_pdl_only_on_sm90_cuda_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("KILN_PDL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert pdl.pdl_args(torch.zeros(1)) == {"USE_PDL": False}
    monkeypatch.setattr(pdl, "_sm_major", lambda index: 9)
    assert pdl.pdl_args(_cuda_tensor()) == {"USE_PDL": True, "launch_pdl": True}
    monkeypatch.setattr(pdl, "_sm_major", lambda index: 8)
    assert not pdl.use_pdl(_cuda_tensor())
    monkeypatch.setattr(pdl, "_sm_major", lambda index: 9)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.use_pdl(_cuda_tensor())


def test_kiln_pdl_setting(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(pdl, "_sm_major", lambda index: 9)
    for setting, gemm, other in (("1", True, True), ("0", False, False), ("gemm", True, False)):
        monkeypatch.setenv("KILN_PDL", setting)
        assert pdl.use_pdl(_cuda_tensor(), "gemm") is gemm
        assert pdl.use_pdl(_cuda_tensor()) is other


def test_pdl_setting_words_and_a_clear_error(monkeypatch):
    monkeypatch.setattr(pdl, "_sm_major", lambda index: 9)
    for off in ("0", "off", "False"):
        monkeypatch.setenv("KILN_PDL", off)
        assert not pdl.use_pdl(_cuda_tensor())
    monkeypatch.setenv("KILN_PDL", "on")
    assert pdl.use_pdl(_cuda_tensor())
    monkeypatch.setenv("KILN_PDL", "maybe")
    with pytest.raises(ValueError, match="KILN_PDL='maybe'.*choose 1"):
        pdl.use_pdl(_cuda_tensor())
