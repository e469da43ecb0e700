"""``python -m benchmarks.kernels``: single kernels against their references and torch's."""

import sys

from benchmarks.cli import run

SUBCOMMANDS = {
    "attention": ("benchmarks.kernels.attention", "Triton paged attention against the reference (CUDA)"),
    "decode-attention": ("benchmarks.kernels.decode_attention", "decode attention at the offline batch, bf16 vs FP8 KV"),
    "fp8-kv-scales": ("benchmarks.kernels.fp8_kv_scales", "what per-tensor FP8 KV scales cost attention and store"),
    "gemm-rates": ("benchmarks.kernels.gemm_rates", "bf16 GEMMs at llama3-8b's shapes by rows: cuBLAS and max-autotune"),
    "quant-gemm": ("benchmarks.kernels.quant_gemm", "quantized GEMMs per llama3-8b shape at decode rows"),
    "int4-split": ("benchmarks.kernels.int4_split", "int4 one-row GEMV: split-K against one pass per row block"),
    "gemv-join": ("benchmarks.kernels.gemv_join", "norm / activation + GEMV, apart and joined"),
    "lora": ("benchmarks.kernels.lora", "LoRA at llama3-8b's linears: GEMM + add_lora against the joined GEMM + expand"),
    "argmax": ("benchmarks.kernels.argmax", "greedy argmax at decode rows: torch against kiln's Triton kernel"),
    "cpu-attention": ("benchmarks.kernels.cpu_attention", "the C++ CPU paged attention against the reference"),
    "cpu-gemv": ("benchmarks.kernels.cpu_gemv", "one-row CPU GEMVs at SmolLM2's shapes against MKL"),
    "cpu-int4": ("benchmarks.kernels.cpu_int4", "int4 weight-only CPU linears against torch's"),
}

if __name__ == "__main__":
    sys.exit(run("kernels", __doc__.splitlines()[0], SUBCOMMANDS))
