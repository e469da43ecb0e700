"""``kiln.add_lora`` and ``kiln.expand_lora`` (``kiln/ops/lora.py``) and their Triton kernels
(``kiln/ops/triton_lora.py``).

The reference is checked against a per-token loop over each slice's own rank rows (the
definition); the kernels against the reference on fresh random inputs: one token, a few, one
tile and tiles across slot boundaries; one slice, qkv's three unequal ones and gate_up's two;
every slot and base-model tokens mixed (which must come back exactly), one slot for all, all
base. Without CUDA the kernels run in Triton's interpreter in a child process.
"""

from __future__ import annotations

import os

import pytest
import torch

from kiln.forward_context import ForwardContext, forward_context
from kiln.ops.lora import add_lora_reference, expand_lora_reference
from tests.helpers.triton_interpreter import run_in_triton_interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUN_KERNELS_HERE = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _loop(y, x, a, b, slots, slice_sizes):
    out = y.clone()
    rank = a.shape[1] // len(slice_sizes)
    for t in range(x.shape[0]):
        s = int(slots[t])
        col = 0
        for j, size in enumerate(slice_sizes):
            rows = slice(j * rank, (j + 1) * rank)
            if s:
                out[t, col:col + size] += (x[t] @ a[s - 1, rows].T) @ b[s - 1, rows, col:col + size]
            col += size
    return out


@pytest.mark.parametrize("num_tokens,slice_sizes,seed", [(1, [24], 0), (7, [12, 6, 6], 1), (33, [10, 14], 2)])
def test_reference_is_the_per_token_sum(num_tokens, slice_sizes, seed):
    g = torch.Generator().manual_seed(seed)
    out_f, ranks = sum(slice_sizes), 4 * len(slice_sizes)
    y, x = torch.randn(num_tokens, out_f, generator=g), torch.randn(num_tokens, 40, generator=g)
    # B dense: its rows off each slice's block must be ignored
    a, b = torch.randn(3, ranks, 40, generator=g), torch.randn(3, ranks, out_f, generator=g)
    slots = torch.randint(0, 4, (num_tokens + 5,), generator=g, dtype=torch.int32)  # longer: padded buffers
    got = add_lora_reference(y, x, a, b, slice_sizes, slots)
    torch.testing.assert_close(got, _loop(y, x, a, b, slots, slice_sizes), rtol=1e-5, atol=1e-5)
    base = slots[:num_tokens] == 0
    assert torch.equal(got[base], y[base])


@pytest.mark.parametrize("num_tokens,slice_sizes,seed", [(1, [24], 0), (7, [12, 6, 6], 1), (33, [10, 14], 2)])
def test_expand_of_the_joined_gemm_is_add_lora(num_tokens, slice_sizes, seed):
    """x @ [W; A[0]; ...].T then expand_lora equals linear then add_lora."""
    g = torch.Generator().manual_seed(seed)
    out_f, ranks, num_slots = sum(slice_sizes), 4 * len(slice_sizes), 3
    x, w = torch.randn(num_tokens, 40, generator=g), torch.randn(out_f, 40, generator=g)
    a, b = torch.randn(num_slots, ranks, 40, generator=g), torch.randn(num_slots, ranks, out_f, generator=g)
    slots = torch.randint(0, num_slots + 1, (num_tokens + 5,), generator=g, dtype=torch.int32)
    y_ext = x @ torch.cat([w, a.reshape(-1, 40)]).T  # [T, out + S * ranks]
    got = expand_lora_reference(y_ext, b, slice_sizes, slots)
    torch.testing.assert_close(got, add_lora_reference(x @ w.T, x, a, b, slice_sizes, slots), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="slice_sizes"):
        expand_lora_reference(y_ext[:, 1:], b, slice_sizes, slots)


def test_op_reads_the_forward_contexts_slots():
    g = torch.Generator().manual_seed(3)
    y, x = torch.randn(4, 8, generator=g), torch.randn(4, 6, generator=g)
    a, b = torch.randn(2, 4, 6, generator=g), torch.randn(2, 4, 8, generator=g)
    slots = torch.tensor([0, 1, 2, 1], dtype=torch.int32)
    with forward_context(ForwardContext(attn=None, kv_caches=[], lora_slots=slots)):
        got = torch.ops.kiln.add_lora(y, x, a, b, [8])
    torch.testing.assert_close(got, _loop(y, x, a, b, slots, [8]))
    with forward_context(ForwardContext(attn=None, kv_caches=[])):  # no slots: the base model
        assert torch.equal(torch.ops.kiln.add_lora(y, x, a, b, [8]), y)
        y_ext = torch.randn(4, 8 + 2 * 4, generator=g)
        base = torch.ops.kiln.expand_lora(y_ext, b, [8])
        assert base.is_contiguous() and torch.equal(base, y_ext[:, :8])


def test_slices_must_fit_the_stack():
    a, b = torch.zeros(2, 6, 5), torch.zeros(2, 6, 9)
    with pytest.raises(ValueError, match="slice_sizes"):
        add_lora_reference(torch.zeros(1, 9), torch.zeros(1, 5), a, b, [4, 4, 1, 0], torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="slice_sizes"):
        add_lora_reference(torch.zeros(1, 9), torch.zeros(1, 5), a, b, [4, 4], torch.zeros(1, dtype=torch.int32))


@pytest.mark.skipif(RUN_KERNELS_HERE, reason="kernels run in this process")
def test_kernels_in_triton_interpreter():
    pytest.importorskip("triton")
    run_in_triton_interpreter(__file__, "test_triton_matches_reference or test_triton_expand_matches_reference")


@pytest.mark.skipif(not RUN_KERNELS_HERE, reason="CPU: runs in the Triton interpreter")
@pytest.mark.parametrize("num_tokens", [1, 3, 64, 130])
@pytest.mark.parametrize("slice_sizes,rank", [([96], 8), ([128, 40, 40], 12), ([160, 160], 16)])
@pytest.mark.parametrize("mix", ["mixed", "one_slot", "base"])
def test_triton_matches_reference(num_tokens, slice_sizes, rank, mix):
    from kiln.ops.triton_lora import check_against_reference

    num_slots, seed = 4, num_tokens + rank
    in_f = 256 if num_tokens <= 3 else 72  # long K (split across programs) where the interpreter is quick
    slots = {"mixed": None, "one_slot": torch.full((num_tokens + 3,), 3, dtype=torch.int32),
             "base": torch.zeros(num_tokens, dtype=torch.int32)}[mix]
    if mix == "mixed" and num_tokens > 3:  # runs of one slot across tile boundaries, base tokens among them
        slots = (torch.arange(num_tokens, dtype=torch.int32) // 11) % (num_slots + 1)
        slots[::7] = 0
    err = check_against_reference(num_tokens, in_f, slice_sizes, rank, num_slots, torch.float32, DEVICE, seed,
                                  slots=None if slots is None else slots.to(DEVICE))
    assert err < 1e-5


@pytest.mark.skipif(not RUN_KERNELS_HERE, reason="CPU: runs in the Triton interpreter")
@pytest.mark.parametrize("num_tokens", [1, 3, 64, 130])
@pytest.mark.parametrize("slice_sizes,rank", [([96], 8), ([128, 40, 40], 12), ([160, 160], 16)])
@pytest.mark.parametrize("mix", ["mixed", "one_slot", "base"])
def test_triton_expand_matches_reference(num_tokens, slice_sizes, rank, mix):
    from kiln.ops.triton_lora import check_expand_against_reference

    num_slots, seed = 4, num_tokens + rank
    slots = {"mixed": None, "one_slot": torch.full((num_tokens + 3,), 3, dtype=torch.int32),
             "base": torch.zeros(num_tokens, dtype=torch.int32)}[mix]
    if mix == "mixed" and num_tokens > 3:  # runs of one slot across tile boundaries, base tokens among them
        slots = (torch.arange(num_tokens, dtype=torch.int32) // 11) % (num_slots + 1)
        slots[::7] = 0
    err = check_expand_against_reference(num_tokens, slice_sizes, rank, num_slots, torch.float32, DEVICE, seed,
                                         slots=None if slots is None else slots.to(DEVICE))
    assert err < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
def test_triton_bfloat16_at_real_shapes():
    from kiln.ops.triton_lora import check_against_reference, check_expand_against_reference

    for num_tokens in (1, 64, 300):
        assert check_against_reference(num_tokens, 4096, [4096, 1024, 1024], 16, 8, torch.bfloat16, DEVICE, 0) < 2e-2
        assert check_against_reference(num_tokens, 14336, [4096], 16, 8, torch.bfloat16, DEVICE, 1) < 2e-2
        assert check_expand_against_reference(num_tokens, [4096, 1024, 1024], 16, 8, torch.bfloat16, DEVICE, 2) < 2e-2
        assert check_expand_against_reference(num_tokens, [14336, 14336], 16, 8, torch.bfloat16, DEVICE, 3) < 2e-2


def test_cuda_kernel_set_selects_the_triton_kernel():
    from kiln.ops.registry import select_kernels

    assert select_kernels("cuda").lora.op_name == "kiln_triton::add_lora"
    assert select_kernels("cuda").lora.expand_op_name == "kiln_triton::expand_lora"
    assert select_kernels("cpu").lora.op_name == "kiln::add_lora"
    assert select_kernels("cpu").lora.expand_op_name == "kiln::expand_lora"
