"""Pipeline parallelism on the worker side: a rank's groups, and the hand-over of hidden states
from stage to stage (which layers a stage holds: ``kiln.models.pipeline``).

One step, every rank given the same step (``kiln.runtime.step_delta``), so each knows its token
count T before anything arrives::

    stage 0: embed, its layers ─ send [T, hidden] ─> stage 1: receive into the model's stage input,
    its layers ─ send ─> ... ─> last stage: its layers, final norm, logits, sample (tp rank 0 answers)

Tensor-parallel rank t of stage s sends to rank t of stage s + 1 (global rank + tp): after the
stage's last all-reduce every rank of a stage holds the same hidden states, so each sends its own
copy and no stage gathers or scatters.

Rules kept here:
- Point to point over the default group (gloo on CPU, NCCL on CUDA) with ``torch.distributed``'s
  blocking ``send`` / ``recv``; the collective ops run over the stage's own tensor-parallel group
  (``kiln.ops.collective.set_tensor_parallel_group``), made here by every rank in the same order
  (``new_group`` is itself collective).
- One step in flight through the stages: a stage receives, runs and sends within the step, so the
  stages take their turns and no rank overlaps another (micro-batches are not kept in flight).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from kiln.models.parallel import TensorParallel
from kiln.models.pipeline import PipelineStage, global_rank
from kiln.ops.collective import set_tensor_parallel_group


def init_stage_groups(tp: TensorParallel, stage: PipelineStage) -> None:
    """Every stage's tensor-parallel group (each rank keeps its own for the collective ops); after
    ``init_process_group``, before the model is built."""
    if stage.size == 1:
        return
    for s in range(stage.size):
        group = dist.new_group([global_rank(t, tp.size, s) for t in range(tp.size)])
        if s == stage.rank:
            set_tensor_parallel_group(group)


class StageLink:
    """This rank's neighbours in the pipeline: where its input comes from, where its output goes."""

    def __init__(self, tp: TensorParallel, stage: PipelineStage, stage_input: Optional[torch.Tensor]):
        self.prev = None if stage.is_first else global_rank(tp.rank, tp.size, stage.rank - 1)
        self.next = None if stage.is_last else global_rank(tp.rank, tp.size, stage.rank + 1)
        self.stage_input = stage_input  # the model's [max_num_tokens, hidden] buffer (not on stage 0)

    def receive(self, num_tokens: int) -> None:
        """The previous stage's hidden states of this step's ``num_tokens`` rows, into the stage input."""
        if self.prev is not None:
            dist.recv(self.stage_input[:num_tokens], src=self.prev)

    def send(self, hidden: torch.Tensor) -> None:
        """This stage's output rows, [num_tokens, hidden], to the next stage."""
        if self.next is not None:
            dist.send(hidden.contiguous(), dst=self.next)
