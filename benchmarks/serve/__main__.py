"""``python -m benchmarks.serve``: the OpenAI server under load."""

import sys

from benchmarks.cli import run

SUBCOMMANDS = {
    "load": ("benchmarks.serve.load", "streaming requests arriving at a given rate: TTFT, TPOT, tok/s"),
    "split": ("benchmarks.serve.split", "the server against offline LLM.generate on one workload"),
    "soak": ("benchmarks.serve.soak", "hours of mixed and hostile traffic: the server drains, memory stays flat"),
    "llamacpp": ("benchmarks.serve.llamacpp", "the default model against llama.cpp on the CPU: batch 1 and 8 streams"),
    "structured": ("benchmarks.serve.structured", "what a JSON-schema constraint costs a batch decode"),
}

if __name__ == "__main__":
    sys.exit(run("serve", __doc__.splitlines()[0], SUBCOMMANDS))
