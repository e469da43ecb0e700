"""``python -m benchmarks.offline``: ``LLM.generate`` throughput and what moves it."""

import sys

from benchmarks.cli import run

SUBCOMMANDS = {
    "throughput": ("benchmarks.offline.throughput", "kiln eager against transformers' generate on the CPU"),
    "profile": ("benchmarks.offline.profile", "where offline throughput goes: kernels by category, host gaps"),
    "quant-gpu": ("benchmarks.offline.quant_gpu", "GPU decode by weight precision: bf16, FP8, int4"),
    "quant-cpu": ("benchmarks.offline.quant_cpu", "CPU decode by precision and compile mode"),
    "spec-decode": ("benchmarks.offline.spec_decode", "what speculative decoding buys, by batch size"),
    "lora": ("benchmarks.offline.lora", "LoRA adapters mixed in a batch and at batch 1, against the base model"),
    "moe": ("benchmarks.offline.moe", "the fused MoE kernel, then a MoE model offline"),
    "generic-vs-native": ("benchmarks.offline.generic_vs_native", "transformers' modeling code against kiln's"),
    "tp-decode": ("benchmarks.offline.tp_decode", "tensor parallelism: batch-1 decode and throughput at TP 1-8"),
    "tp-check": ("benchmarks.offline.tp_check", "tensor parallelism's logits and greedy tokens against TP 1"),
    "compile-modes": ("benchmarks.offline.compile_modes", "eager, stock torch.compile and kiln, taking turns"),
}

if __name__ == "__main__":
    sys.exit(run("offline", __doc__.splitlines()[0], SUBCOMMANDS))
