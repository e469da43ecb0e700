"""A warm start's weight phase alone, from an on-disk Llama-3-8B checkpoint in the page cache:
``load_model(background=True)`` (the empty model built while the read runs ahead) and then the
wait until every weight has landed, each variant in fresh processes taking turns.

Variants change what the start reads ahead and how (module settings of ``kiln.models.loader`` and
``kiln.models.weight_reader``): ``base`` is kiln's as it stands; a variant is
``name=SETTING:VALUE+SETTING:VALUE`` with ``ahead`` (READ_AHEAD_MAX_BYTES, GiB), ``threads``,
``chunk`` (MiB) and ``buffers``; ``tokenizer:0`` leaves out the tokenizer thread a start runs beside
them.

    python -m benchmarks.startup load-phases --variants base,ahead32=ahead:32 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path


def child(opts: dict) -> None:
    t0 = time.perf_counter()
    import torch

    from kiln.config import ModelConfig
    from kiln.models import loader, weight_reader

    torch.cuda.init()
    torch.empty(1, device="cuda")
    for key, value in opts["settings"].items():
        if key == "ahead":
            loader.READ_AHEAD_MAX_BYTES = int(value * 2**30)
        elif key == "threads":
            weight_reader.NUM_THREADS = int(value)
        elif key == "chunk":
            weight_reader.CHUNK_BYTES = int(value) << 20
        elif key == "buffers":
            weight_reader.NUM_BUFFERS = int(value)
        elif key == "tokenizer" and not value:  # no tokenizer thread beside the read
            loader._load_tokenizer = lambda path: None
        else:
            raise ValueError(f"unknown setting {key!r}")
    t_ready = time.perf_counter()
    loaded = loader.load_model(ModelConfig(model=opts["checkpoint"]), opts["cache_dir"], torch.device("cuda"),
                               torch.bfloat16, background=True)
    t_built = time.perf_counter()
    loaded.wait_for_weights()
    t_filled = time.perf_counter()
    loaded.wait_for_tokenizer()
    t_tokenizer = time.perf_counter()
    print("RESULT " + json.dumps({
        "import_s": t_ready - t0, "build_s": t_built - t_ready, "weights_s": t_filled - t_ready,
        "waited_s": t_filled - t_built, "tokenizer_s": t_tokenizer - t_ready,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "checksum": float(sum(p.float().sum().item() for p in list(loaded.model.parameters())[:4])),
    }), flush=True)


def parse_variant(text: str) -> tuple[str, dict]:
    if "=" not in text:
        return text, {}
    name, settings = text.split("=", 1)
    return name, {k: float(v) for k, v in (s.split(":") for s in settings.split("+"))}


def main(argv=None) -> None:
    from benchmarks.common import child_command, child_env, out_dir
    from benchmarks.startup.starts import write_checkpoint
    from kiln.bench.report import device_name

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint-dir", default="/tmp/ckpt")
    ap.add_argument("--variants", default="base")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(out_dir()))
    ap.add_argument("--tag", default="")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(json.loads(args.child))
    ckpt = Path(args.checkpoint_dir)
    if not (ckpt / "model.safetensors.index.json").exists():
        t0 = time.time()
        write_checkpoint("llama3-8b", ckpt)
        print(f"wrote {ckpt} in {time.time() - t0:.1f} s", flush=True)
    cache_dir = Path(args.checkpoint_dir + "-cache")
    variants = [parse_variant(v) for v in args.variants.split(",")]
    results: dict[str, list[dict]] = {name: [] for name, _ in variants}
    for r in range(-1, args.rounds):  # round -1: fills the page cache, not counted
        for name, settings in variants if r >= 0 else variants[:1]:
            opts = {"checkpoint": str(ckpt), "cache_dir": str(cache_dir), "settings": settings}
            proc = subprocess.run(child_command("benchmarks.startup.load_phases", "--child", json.dumps(opts)),
                                  capture_output=True, text=True, env=child_env({**os.environ, "TQDM_DISABLE": "1"}))
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"variant {name} failed:\n{proc.stderr[-3000:]}")
            rec = json.loads(line[len("RESULT "):])
            print(f"round {r} {name:>12}: " + "  ".join(f"{k} {v:.3f}" for k, v in rec.items()), flush=True)
            if r >= 0:
                results[name].append(rec)
    keys = ("build_s", "waited_s", "weights_s", "tokenizer_s", "peak_gib")
    lines = ["| variant | settings | " + " | ".join(keys) + " |", "|" + " --- |" * (len(keys) + 2)]
    for name, settings in variants:
        med = {k: statistics.median(rec[k] for rec in results[name]) for k in keys}
        lines.append(f"| {name} | {settings or 'kiln as is'} | " + " | ".join(f"{med[k]:.2f}" for k in keys) + " |")
    sums = {name: {rec["checksum"] for rec in results[name]} for name, _ in variants}
    table = "\n".join(lines)
    print(f"\n{device_name()}, medians of {args.rounds} rounds (seconds from torch imported and CUDA up)\n\n{table}"
          f"\n\nchecksums: {sums}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"load_phases{args.tag}-{device_name().replace(' ', '_')}"
    (out / f"{stem}.json").write_text(json.dumps({"device": device_name(), "results": results,
                                                  "variants": dict(variants)}, indent=1))
    (out / f"{stem}.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
