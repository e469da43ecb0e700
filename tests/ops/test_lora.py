"""``kiln.add_lora`` (``kiln/ops/lora.py``) and its Triton kernels (``kiln/ops/triton_lora.py``).

The reference is checked against a per-token loop (the definition); the kernels against the
reference on fresh random inputs, mixing every slot and base-model tokens (which must come back
exactly). Without CUDA the kernels run in Triton's interpreter in a child process.
"""

from __future__ import annotations

import os

import pytest
import torch

from kiln.forward_context import ForwardContext, forward_context
from kiln.ops.lora import add_lora_reference
from tests.helpers.triton_interpreter import run_in_triton_interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUN_KERNELS_HERE = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _loop(y, x, a, b, slots):
    out = y.clone()
    for t in range(x.shape[0]):
        s = int(slots[t])
        if s:
            out[t] += (x[t] @ a[s - 1].T) @ b[s - 1]
    return out


@pytest.mark.parametrize("num_tokens,seed", [(1, 0), (7, 1), (33, 2)])
def test_reference_is_the_per_token_sum(num_tokens, seed):
    g = torch.Generator().manual_seed(seed)
    y, x = torch.randn(num_tokens, 24, generator=g), torch.randn(num_tokens, 40, generator=g)
    a, b = torch.randn(3, 8, 40, generator=g), torch.randn(3, 8, 24, generator=g)
    slots = torch.randint(0, 4, (num_tokens + 5,), generator=g, dtype=torch.int32)  # longer: padded buffers
    got = add_lora_reference(y, x, a, b, slots)
    torch.testing.assert_close(got, _loop(y, x, a, b, slots), rtol=1e-5, atol=1e-5)
    base = slots[:num_tokens] == 0
    assert torch.equal(got[base], y[base])


def test_op_reads_the_forward_contexts_slots():
    g = torch.Generator().manual_seed(3)
    y, x = torch.randn(4, 8, generator=g), torch.randn(4, 6, generator=g)
    a, b = torch.randn(2, 4, 6, generator=g), torch.randn(2, 4, 8, generator=g)
    slots = torch.tensor([0, 1, 2, 1], dtype=torch.int32)
    with forward_context(ForwardContext(attn=None, kv_caches=[], lora_slots=slots)):
        got = torch.ops.kiln.add_lora(y, x, a, b)
    torch.testing.assert_close(got, _loop(y, x, a, b, slots))
    with forward_context(ForwardContext(attn=None, kv_caches=[])):  # no slots: the base model
        assert torch.equal(torch.ops.kiln.add_lora(y, x, a, b), y)


@pytest.mark.skipif(RUN_KERNELS_HERE, reason="kernels run in this process")
def test_kernels_in_triton_interpreter():
    pytest.importorskip("triton")
    run_in_triton_interpreter(__file__, "test_triton_matches_reference")


@pytest.mark.skipif(not RUN_KERNELS_HERE, reason="CPU: runs in the Triton interpreter")
@pytest.mark.parametrize("num_tokens,in_f,out_f,rank,slots,seed",
                         [(1, 64, 96, 8, 1, 0), (9, 100, 70, 24, 3, 1), (5, 256, 200, 48, 4, 2)])
def test_triton_matches_reference(num_tokens, in_f, out_f, rank, slots, seed):
    from kiln.ops.triton_lora import check_against_reference

    assert check_against_reference(num_tokens, in_f, out_f, rank, slots, torch.float32, DEVICE, seed) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
def test_triton_bfloat16_at_real_shapes():
    from kiln.ops.triton_lora import check_against_reference

    assert check_against_reference(300, 4096, 6144, 48, 8, torch.bfloat16, DEVICE, 0) < 2e-2


def test_cuda_kernel_set_selects_the_triton_kernel():
    from kiln.ops.registry import select_kernels

    assert select_kernels("cuda").lora.op_name == "kiln_triton::add_lora"
    assert select_kernels("cpu").lora.op_name == "kiln::add_lora"
