"""``torch.ops.kiln.read_stage_input``: the rows a pipeline stage after the first starts from.

Such a stage's first layer reads the hidden states the stage before sent, which the runner
receives into a persistent buffer of the model (``kiln.models.llama``: ``stage_input``, one
address for CUDA graphs to replay)::

    buffer [max_num_tokens, H]: | this step's T rows | stale rows |  -> [T, H], a copy of the first T

As an op, its output is ``[T, H]`` for the step's symbolic token count T: slicing the buffer in
the traced forward would give ``min(max_num_tokens, T)`` rows, a size the capture's example batch
(more tokens than a small buffer holds) cannot match.
"""

from __future__ import annotations

import torch

from kiln.ops.library import define_op


def read_stage_input_reference(buffer: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """buffer: [R, H], input_ids: [T] (only its length is read) -> [T, H], rows 0..T-1 of buffer."""
    return buffer[:input_ids.shape[0]].clone()  # outputs never alias inputs (kiln.ops.library)


def _fake(buffer: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    return buffer.new_empty((input_ids.shape[0], buffer.shape[1]))


read_stage_input = define_op("kiln::read_stage_input", read_stage_input_reference, _fake)
