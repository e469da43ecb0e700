"""Triton argmax of the logits (``kiln/ops/triton_argmax.py``) against ``logits.argmax(-1)``.

Fresh random rows, vocabularies that leave a masked tail in the last chunk, ties placed across
chunks (the first index must win), rows of -inf, and NaN. Without CUDA the kernels run in Triton's
interpreter in a child process (``tests.helpers.triton_interpreter``).
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
@pytest.mark.parametrize("rows,vocab,dtype,seed", [(1, 3000, torch.float32, 0), (5, 2048, torch.float32, 1),
                                                   (3, 1500, torch.bfloat16, 2)])
def test_matches_torch_argmax(rows, vocab, dtype, seed):
    from kiln.ops.triton_argmax import CHUNK, triton_argmax

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    # Ties: row 0's max also sits in a later chunk and earlier in the same chunk as the drawn max.
    top = logits[0].float().max() + 1
    hot = sorted(torch.randperm(vocab, generator=gen)[:3].tolist())
    logits[0, hot] = top.to(dtype)
    if rows > 1:
        logits[1] = float("-inf")  # every entry equal: index 0
    if rows > 2:
        logits[2, vocab - 1] = float("nan")  # NaN counts as the largest
    want = logits.argmax(dim=-1)
    got = triton_argmax(logits.to(DEVICE))
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert got.cpu().tolist() == want.tolist(), (got, want, hot, CHUNK)
    assert got[0].item() == hot[0]


@pytest.mark.skipif(not RUN_KERNELS_HERE, reason="CPU: runs in the Triton interpreter")
def test_strided_rows_and_empty_batch():
    from kiln.ops.triton_argmax import triton_argmax

    logits = torch.randn(4, 2 * 1100, generator=torch.Generator().manual_seed(3))[:, :1100]  # row stride 2200
    assert triton_argmax(logits.to(DEVICE)).cpu().tolist() == logits.argmax(-1).tolist()
    assert triton_argmax(torch.empty(0, 10, device=DEVICE)).shape == (0,)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 7, 512])
def test_real_vocabulary_on_cuda(rows):
    from kiln.ops.triton_argmax import triton_argmax

    logits = torch.randn(rows, 128256, device=DEVICE) * 4
    assert torch.equal(triton_argmax(logits), logits.argmax(-1))
    assert torch.equal(triton_argmax(logits.bfloat16()), logits.bfloat16().argmax(-1))


def test_kernel_sets_choose_the_argmax():
    from kiln.ops.registry import reference_kernels, select_kernels

    assert reference_kernels("cuda").argmax.op_name == "kiln::argmax"
    assert select_kernels("cpu").argmax.op_name == "kiln::argmax"
    want = "kiln_triton::argmax" if torch.cuda.is_available() else "kiln::argmax"
    assert select_kernels("cuda").argmax.op_name == want
    assert select_kernels("cpu").describe()["argmax"] == "reference"
    logits = torch.randn(3, 50)
    assert torch.equal(torch.ops.kiln.argmax(logits), logits.argmax(-1))
