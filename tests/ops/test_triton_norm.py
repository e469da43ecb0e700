"""Triton add+RMSNorm and silu*mul (``kiln/ops/triton_norm.py``) vs their pure-torch references.

Fresh random inputs per case, odd row widths (masked tails). On CUDA: bf16 at real shapes. Without
CUDA the kernels run in Triton's interpreter in a child process (``TRITON_INTERPRET=1`` must be set
before ``triton`` is imported; see ``tests/ops/test_triton_attention.py``), in float32, where they
must match the references to float32 rounding.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.triton_interpreter import run_in_triton_interpreter

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUN_KERNELS_HERE = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(RUN_KERNELS_HERE, reason="kernels run in this process")
def test_kernels_in_triton_interpreter():
    run_in_triton_interpreter(__file__, "not test_kernels_in_triton_interpreter")


@pytest.mark.skipif(not RUN_KERNELS_HERE, reason="CPU: runs in the Triton interpreter")
@pytest.mark.parametrize("num_tokens,hidden,intermediate,seed", [(1, 96, 80, 0), (5, 200, 1100, 1)])
def test_float32_matches_reference(num_tokens, hidden, intermediate, seed):
    from kiln.ops.triton_norm import check_against_reference

    errors = check_against_reference(num_tokens, hidden, intermediate, torch.float32, DEVICE, seed=seed)
    assert max(errors.values()) < 1e-5, errors


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("num_tokens,hidden,intermediate", [(1, 4096, 14336), (7, 896, 4864), (300, 4096, 14336)])
def test_bfloat16_matches_reference(num_tokens, hidden, intermediate):
    from kiln.ops.triton_norm import check_against_reference

    errors = check_against_reference(num_tokens, hidden, intermediate, torch.bfloat16, DEVICE, seed=num_tokens)
    assert max(errors.values()) < 1e-2, errors


def test_cuda_kernel_set_selects_both_kernels():
    from kiln.ops.registry import select_kernels

    kernels = select_kernels("cuda")
    assert kernels.add_rms_norm.fast and kernels.silu_and_mul.fast
    assert kernels.add_rms_norm.op_name == "kiln_triton::add_rms_norm"
    assert kernels.silu_and_mul.op_name == "kiln_triton::silu_and_mul"
