"""What a compiled model's CUDA graphs will take, known before the KV cache is sized after it.

``profile_graph_memory`` measures it (a capture of the largest and the smallest size over a small
temporary cache, freed again); ``guess_graph_memory`` guesses it while a background build has no
forward to profile yet (a first start). Both give a ``GraphMemoryEstimate``, extrapolated to every
capture size with a margin; the runtime keeps it for the next start (``kiln.runtime.kv_sizing``).
Neither leaves a graph behind or changes the sets the model replays.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from kiln.compiler.capture import KilnForward
from kiln.compiler.cudagraph import GraphMode, wanted_graph_modes
from kiln.compiler.graph_sets import GraphSets
from kiln.compiler.piecewise import PiecewiseCUDAGraphs

logger = logging.getLogger(__name__)

# guess_graph_memory, after Llama-3-8B's profile on an H200 (bf16, 81 sizes up to 4096 tokens):
# the largest size's piece graphs took 3,308 MiB, 3.1 hidden states a token and piece, and each
# further size 4 MiB, 0.12 MiB a graph (33 pieces, one full graph). A guess short of what the
# graphs take leaves a first start without its smaller sizes; one beyond it, a little less KV
# cache. Measured on that H200, guess (at 3.5 hidden states) against use: Llama-3-8B 5.47 / 3.49
# GiB, Qwen2.5-0.5B 1.51 / 0.88, Qwen1.5-MoE-A2.7B 2.47 / 2.29; at 4.0 the MoE's is 2.71 GiB.
GUESS_PIECE_OUTPUTS = 4.0  # hidden states a token and piece the largest size's graphs hold
GUESS_BYTES_PER_GRAPH = 2**18


@dataclass(frozen=True)
class GraphMemoryEstimate:
    """What CUDA graphs of ``sizes`` will take, from a profiled capture (``profile_graph_memory``):
    the largest size's working set, which every smaller size reuses (outputs are held weakly), plus
    per size its graph objects. Extrapolated with a margin: the KV cache is sized after it."""

    sizes: tuple[int, ...]
    largest_bytes: int
    per_size_bytes: int
    num_extra_graphs: int = 0  # graphs beyond one per size (verify graphs), each costing per_size_bytes

    MARGIN = 1.25
    SLACK_BYTES = 128 * 2**20

    def bytes(self, num_sizes: Optional[int] = None) -> int:
        """The estimate for the ``num_sizes`` smallest sizes (all by default); the working set is
        taken as proportional to the largest size kept."""
        n = len(self.sizes) if num_sizes is None else num_sizes
        if n <= 0:
            return 0
        working = max(self.largest_bytes, 0) * self.sizes[n - 1] / self.sizes[-1]
        num_graphs = n - 1 + self.num_extra_graphs
        return int(self.MARGIN * (working + max(self.per_size_bytes, 0) * num_graphs) + self.SLACK_BYTES)


@torch.inference_mode()
def profile_graph_memory(graphs: GraphSets, forward: Callable,
                         kv_caches: list[torch.Tensor]) -> Optional[GraphMemoryEstimate]:
    """Measure what the CUDA graphs ``compile.cudagraph`` asks for will take over ``forward``:
    capture the largest size (its working set), then the smallest into the same pool (what each
    further size adds: the graph objects), over ``kv_caches`` (a small temporary cache), and free
    both. None when no graphs are captured."""
    if graphs.device.type != "cuda":
        return None
    modes = wanted_graph_modes(graphs.config.cudagraph, isinstance(forward, KilnForward))
    sizes = graphs.sizes(modes)
    if not sizes:
        return None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free = [torch.cuda.mem_get_info()[0]]
    pool = torch.cuda.graph_pool_handle()
    probes: list = []
    for probe in (sizes[-1], sizes[0]):  # largest first: the smallest then reuses its memory
        if GraphMode.FULL in modes:
            full = graphs.make_full(forward, (probe,))
            full.capture(graphs.capture_scope, kv_caches, pool, log=False)
            probes.append(full)
        if GraphMode.PIECEWISE in modes:
            pieces = PiecewiseCUDAGraphs(forward, graphs.inputs, (probe,))
            pieces.capture(graphs.capture_scope, kv_caches, pool, log=False)
            probes.append(pieces)
            pieces.release()  # takes its wrappers out of the forward; its graphs live on in `probes`
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # only the graphs' memory counts, not the warm-up's cached blocks
        free.append(torch.cuda.mem_get_info()[0])
    del probes, pool
    full = pieces = None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # Verify graphs share the pool and add their graph objects; the working set is taken as
    # proportional to the most tokens any graph runs (a verify graph of n requests runs n (k + 1)).
    largest_bytes, num_verify = free[0] - free[1], 0
    if GraphMode.FULL in modes and graphs.verify_shape is not None:
        verify_sizes = graphs.make_verify(forward, sizes).sizes
        num_verify = len(verify_sizes)
        most_tokens = max(verify_sizes, default=0) * graphs.verify_shape.query_len
        largest_bytes = int(largest_bytes * max(1.0, most_tokens / sizes[-1]))
    estimate = GraphMemoryEstimate(tuple(sizes), largest_bytes=largest_bytes, per_size_bytes=free[1] - free[2],
                                   num_extra_graphs=num_verify)
    logger.info("CUDA graphs profiled: largest size %d takes %.0f MiB, each further size %.1f MiB -> "
                "%.2f GiB kept for %d sizes", sizes[-1], estimate.largest_bytes / 2**20,
                estimate.per_size_bytes / 2**20, estimate.bytes() / 2**30, len(sizes))
    return estimate


def guess_graph_memory(graphs: GraphSets, forward: Callable, activation_bytes: int, max_num_tokens: int,
                       num_pieces: int, hidden_bytes: int) -> Optional[GraphMemoryEstimate]:
    """What the CUDA graphs of kiln's forward will take, guessed while a background build has no
    forward to profile yet (a first start). The largest size's working set: with piece graphs,
    ``GUESS_PIECE_OUTPUTS`` hidden states (``hidden_bytes`` each) a token for each of
    ``num_pieces`` pieces; else the step's peak activations scaled to its tokens. Per further
    size, ``GUESS_BYTES_PER_GRAPH`` for each graph captured at it. The runner keeps what capture
    then takes for the next start. None when no graphs are captured."""
    if graphs.device.type != "cuda":
        return None
    modes = wanted_graph_modes(graphs.config.cudagraph, True)
    sizes = graphs.sizes(modes)
    if not sizes:
        return None
    if GraphMode.PIECEWISE in modes:
        working = int(GUESS_PIECE_OUTPUTS * num_pieces * sizes[-1] * hidden_bytes)
    else:
        working = activation_bytes * sizes[-1] // max(max_num_tokens, 1)
    graphs_per_size = (num_pieces if GraphMode.PIECEWISE in modes else 0) + (GraphMode.FULL in modes)
    num_verify = (len(graphs.make_verify(forward, sizes).sizes)
                  if GraphMode.FULL in modes and graphs.verify_shape else 0)
    estimate = GraphMemoryEstimate(tuple(sizes), largest_bytes=working,
                                   per_size_bytes=graphs_per_size * GUESS_BYTES_PER_GRAPH,
                                   num_extra_graphs=num_verify)
    logger.info("CUDA graphs: %.2f GiB kept for %d sizes, a guess (%d graphs a size) until kiln's forward "
                "is built; what they take is kept for the next start", estimate.bytes() / 2**30, len(sizes),
                graphs_per_size)
    return estimate
