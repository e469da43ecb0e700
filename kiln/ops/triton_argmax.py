"""Triton kernel behind ``kiln::argmax`` on CUDA: each row's argmax of the logits, for greedy rows.

A full decode graph ends with the argmax of every row's logits (``kiln.compiler.cudagraph``). With
one row and a 128K vocabulary, torch's reduction runs the whole row in one block of threads: 28 us
of a 5.6 ms llama3-8b step on an H100, longer than a layer's attention. Here it is two short
launches:

    stage 1  grid (rows, cdiv(vocab, CHUNK))  each chunk's max and the index of its first max
    stage 2  grid (rows,)                     per row, the first chunk holding the row's max

Ties go to the lowest index, as torch's argmax does. NaN counts as +inf (torch returns the first
NaN; a row holding both NaN and +inf may differ). Both launch with programmatic dependent launch on
Hopper (``kiln.ops.pdl``), so stage 1's blocks are resident while the LM head finishes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.pdl import pdl_args
from kiln.ops.sampling import argmax_reference, define_argmax_op

CHUNK = 1024  # entries a stage-1 program reduces: 126 programs a row of a 128K vocabulary


@triton.jit
def _chunk_max_kernel(x_ptr, val_ptr, idx_ptr, vocab, stride_x, chunks, CHUNK: tl.constexpr,
                      USE_PDL: tl.constexpr = False):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row, chunk = tl.program_id(0), tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN as +inf
    best, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * chunks + chunk, best)
    tl.store(idx_ptr + row * chunks + chunk, chunk * CHUNK + at)


@triton.jit
def _row_max_kernel(val_ptr, idx_ptr, out_ptr, chunks, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    vals = tl.load(val_ptr + row * chunks + offs, mask=offs < chunks, other=float("-inf"))
    _, first = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * chunks + first).to(tl.int64))


def triton_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] -> [rows] int64, the index of each row's first maximum."""
    if logits.dim() != 2 or logits.stride(-1) != 1 or logits.shape[-1] == 0:
        return argmax_reference(logits)
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    chunks = triton.cdiv(vocab, CHUNK)
    vals = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    idx = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    pdl = pdl_args(logits)
    _chunk_max_kernel[(rows, chunks)](logits, vals, idx, vocab, logits.stride(0), chunks, CHUNK=CHUNK,
                                      num_warps=4, **pdl)
    _row_max_kernel[(rows,)](vals, idx, out, chunks, BLOCK=max(triton.next_power_of_2(chunks), 16),
                             num_warps=4, **pdl)
    return out


argmax = define_argmax_op("kiln_triton::argmax", triton_argmax)
