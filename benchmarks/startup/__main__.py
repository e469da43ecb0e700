"""``python -m benchmarks.startup``: from launch to ready and to full speed."""

import sys

from benchmarks.cli import run

SUBCOMMANDS = {
    "starts": ("benchmarks.startup.starts", "cold and warm starts of kiln serve / LLM, timed from launch"),
    "offline": ("benchmarks.startup.offline", "offline throughput right after start-up, per compile.startup"),
    "background-build": ("benchmarks.startup.background_build", "the CPU default's background build against the others"),
    "load-phases": ("benchmarks.startup.load_phases", "a warm start's weight phase alone, from a checkpoint"),
    "weight-read": ("benchmarks.startup.weight_read", "the weight reader's page-cache-to-GPU speed, by threads and chunks"),
}

if __name__ == "__main__":
    sys.exit(run("startup", __doc__.splitlines()[0], SUBCOMMANDS))
