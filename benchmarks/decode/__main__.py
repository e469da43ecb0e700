"""``python -m benchmarks.decode``: batch-1 decode, its roofline, kernels and host costs."""

import sys

from benchmarks.cli import run

SUBCOMMANDS = {
    "static": ("benchmarks.decode.static", "kiln against a static-cache torch.compile decode, one process"),
    "profile": ("benchmarks.decode.profile", "step time and the GPU kernels of one step, as served"),
    "gpu": ("benchmarks.decode.gpu", "batch-1 decode against the HBM roofline, with and without CUDA graphs"),
    "cpu-bound": ("benchmarks.decode.cpu_bound", "what bounds a CPU fp32 step: weight bytes or per-op work"),
    "cpu-step": ("benchmarks.decode.cpu_step", "the default model's CPU step by part (kernels, graphs, host)"),
    "split-every": ("benchmarks.decode.split_every", "CPU kiln mode cut at every Nth attention call, interleaved"),
    "step-pipeline": ("benchmarks.decode.step_pipeline", "the engine step's host phases, with and without overlap"),
    "op-dispatch": ("benchmarks.decode.op_dispatch", "the host cost of one kiln op call, by registration"),
}

if __name__ == "__main__":
    sys.exit(run("decode", __doc__.splitlines()[0], SUBCOMMANDS))
