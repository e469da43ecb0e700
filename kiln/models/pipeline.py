"""Pipeline parallelism: which layers a stage holds, and which rank is which stage.

The layers split into ``size`` consecutive runs, as vLLM's ``get_pp_indices``: an even share each,
the remainder one layer apiece to the stages before the last, counting back from the one before it
(the last stage also holds the final norm, LM head and sampler)::

    5 layers, 3 stages:  stage 0: layers 0-1   stage 1: layers 2-3   stage 2: layer 4
    6 layers, 4 stages:  stage 0: layer 0      stage 1: 1-2          stage 2: 3-4        stage 3: 5

Stage 0 alone embeds the tokens; a later stage takes the hidden states of the stage before it.
Ranks are laid out as vLLM's, tensor-parallel rank fastest::

    global rank = stage * tensor_parallel_size + tensor-parallel rank
    tp=2, pp=2:   stage 0: ranks 0, 1     stage 1: ranks 2, 3     (rank r sends to r + tp)

Rules kept here:
- ``PipelineStage(rank=0, size=1)`` holds every layer: exactly the whole model.
- A stage holds at least one layer: more stages than layers is a ValueError naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineStage:
    """This process's place in the pipeline."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"pipeline stage {self.rank} is outside a pipeline of {self.size} stages")

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def layers(self, num_layers: int) -> range:
        """The global indices of the layers this stage holds of a model of ``num_layers``."""
        check_pipeline_parallel(num_layers, self.size)
        return range(*stage_layers(num_layers, self.rank, self.size))


WHOLE = PipelineStage()


def check_pipeline_parallel(num_layers: int, size: int) -> None:
    """Raise a ValueError when ``size`` stages cannot each hold a layer."""
    if size > num_layers:
        raise ValueError(f"parallel.pipeline_parallel_size={size} is more than this model's num_layers={num_layers}: "
                         f"every stage needs a layer; choose a size of at most {num_layers}")


def stage_layers(num_layers: int, rank: int, size: int) -> tuple[int, int]:
    """``[start, end)`` of stage ``rank``'s layers (vLLM's ``get_pp_indices``)."""
    counts = [num_layers // size] * size
    for i in range(2, num_layers % size + 2):
        counts[-i] += 1
    start = sum(counts[:rank])
    return start, start + counts[rank]


def global_rank(tp_rank: int, tp_size: int, stage: int) -> int:
    return stage * tp_size + tp_rank


def driver_rank(tp_size: int, pp_size: int) -> int:
    """The rank that samples and answers the engine: tensor-parallel rank 0 of the last stage."""
    return global_rank(0, tp_size, pp_size - 1)
