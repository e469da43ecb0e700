"""How fast ``kiln.models.weight_reader`` moves a checkpoint from the page cache into GPU memory,
per reader configuration, against ``safetensors.safe_open(device="cuda")`` in the same run.

A warm start reads its checkpoint from the page cache; that read is the floor of the start's
weight phase. This writes a random Llama-3-8B checkpoint (bf16, 4 shards, 15 GiB; the one
``python -m benchmarks.startup starts --checkpoint llama3-8b`` writes) to ``--dir``, reads it once so every page
is cached, then times ``iter_files_to_device`` over all shards for each configuration (reader threads, chunk MiB,
pinned buffers), the pinned buffers' allocation included. Each configuration is timed quiet and
beside a thread that runs Python without pause with the GIL's switch interval at 0.1 ms, as a
start's main thread does while it builds the model the read fills (``quick_gil_handoff``).

    python -m benchmarks.startup weight-read --configs 8:16:16,16:16:32
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch


def checkpoint_shards(directory: Path) -> list[str]:
    """The shards of a random Llama-3-8B checkpoint in ``directory`` (``python -m benchmarks.startup starts``'s,
    written there unless an earlier run did)."""
    from benchmarks.startup import write_checkpoint

    if not (directory / "model.safetensors.index.json").exists():
        write_checkpoint("llama3-8b", directory)
    return sorted(str(p) for p in directory.glob("*.safetensors"))


def cache_pages(paths: list[str]) -> float:
    t0 = time.perf_counter()
    buf = bytearray(64 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t0


def read_all(paths: list[str], device: torch.device) -> tuple[float, int]:
    from kiln.models.weight_reader import iter_files_to_device

    t0 = time.perf_counter()
    total = 0
    for _, t in iter_files_to_device(paths, device):
        total += t.nbytes
        del t
    return time.perf_counter() - t0, total


def read_safetensors(paths: list[str], device: torch.device) -> tuple[float, int]:
    from safetensors import safe_open

    t0 = time.perf_counter()
    total = 0
    for p in paths:
        with safe_open(p, framework="pt", device=str(device)) as f:
            for k in f.keys():
                total += f.get_tensor(k).nbytes
    torch.cuda.synchronize(device)
    return time.perf_counter() - t0, total


def busy_python(stop: threading.Event) -> None:
    x: dict = {}
    while not stop.is_set():
        for i in range(1000):
            x[i] = (i, str(i))
        x.clear()


def main(argv=None) -> None:
    from benchmarks.common import device_name, out_dir
    from kiln.models import weight_reader
    from kiln.models.loader import quick_gil_handoff

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/ckpt", help="the checkpoint's directory (reused if written before)")
    ap.add_argument("--configs", default="8:16:16,16:16:32,8:32:16,16:32:32,8:64:8,16:64:16,32:16:64",
                    help="threads:chunk MiB:buffers, comma-separated; the first is the baseline")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--safetensors", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", default=str(out_dir()))
    args = ap.parse_args(argv)

    device = torch.device("cuda", 0)
    torch.cuda.init()
    torch.empty(1, device=device)
    t0 = time.perf_counter()
    paths = checkpoint_shards(Path(args.dir))
    print(f"checkpoint: {len(paths)} shards ready in {time.perf_counter() - t0:.1f} s; "
          f"page cache filled in {cache_pages(paths):.1f} s", flush=True)
    configs = [tuple(int(v) for v in c.split(":")) for c in args.configs.split(",")]
    rows = []
    if args.safetensors:
        secs, total = read_safetensors(paths, device)
        rows.append({"config": "safetensors safe_open(device=cuda)", "beside": "quiet", "seconds": [secs],
                     "gb_s": total / secs / 1e9})
        print(f"{rows[-1]['config']:>36}  quiet   {secs:6.2f} s  {total / secs / 1e9:6.2f} GB/s", flush=True)
    # Configurations take turns within each repetition, so drift hits all alike.
    results: dict[tuple, list[float]] = {}
    total = 0
    for rep in range(args.reps):
        for beside in ("quiet", "python"):
            for threads, chunk_mib, buffers in configs:
                weight_reader.NUM_THREADS, weight_reader.CHUNK_BYTES, weight_reader.NUM_BUFFERS = (
                    threads, chunk_mib << 20, buffers)
                stop = threading.Event()
                spinner = threading.Thread(target=busy_python, args=(stop,), daemon=True)
                with quick_gil_handoff() if beside == "python" else contextlib.nullcontext():
                    if beside == "python":
                        spinner.start()
                    secs, total = read_all(paths, device)
                    stop.set()
                    if beside == "python":
                        spinner.join()
                torch.cuda.empty_cache()
                results.setdefault((threads, chunk_mib, buffers, beside), []).append(secs)
                print(f"rep {rep} {threads:>3} threads {chunk_mib:>3} MiB x {buffers:>3}  {beside:6}  "
                      f"{secs:6.2f} s  {total / secs / 1e9:6.2f} GB/s", flush=True)
    for (threads, chunk_mib, buffers, beside), secs in results.items():
        med = statistics.median(secs)
        rows.append({"config": f"{threads} threads, {chunk_mib} MiB x {buffers}", "beside": beside,
                     "seconds": secs, "gb_s": total / med / 1e9})
    lines = [f"| reader | beside | median s | GB/s | runs (s) |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['beside']} | {statistics.median(r['seconds']):.2f} | {r['gb_s']:.2f} | "
                     + ", ".join(f"{s:.2f}" for s in r["seconds"]) + " |")
    table = "\n".join(lines)
    print(f"\n{device_name()}: {total / 2**30:.2f} GiB in {len(paths)} shards, from the page cache\n\n{table}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"weight_read-{device_name().replace(' ', '_')}"
    (out / f"{name}.json").write_text(json.dumps({"device": device_name(), "bytes": total, "rows": rows,
                                                  "python": sys.version.split()[0], "cpus": os.cpu_count(),
                                                  "torch": torch.__version__}, indent=1))
    (out / f"{name}.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
