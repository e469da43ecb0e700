"""How long from process start to the first token, cold and warm? (the compiled-artifact cache)

Every start is a fresh process building ``LLM(model, compile.mode=kiln)`` and generating one token.

- ``cold``: nothing compiled anywhere: an empty kiln compile cache, and empty Inductor, Triton and
  temp dirs (Inductor keeps its precompiled C++ header under the temp dir), as on a new machine.
- ``warm``: the kiln cache dir the cold start filled, with empty Inductor, Triton and temp dirs
  again: a restarted container whose image ships the cache (``kiln cache export``).

Converted weights are shared by both (linked from the usual cache dir), so neither pays for a
conversion. Each row has time to first token (interpreter start included), the engine's start-up
breakdown (load weights, Dynamo, Inductor, compile cache load, CUDA graphs, KV allocation, ready)
and the warm/cold ratio.

    python benchmarks/startup.py                                      # SmolLM2 on the CPU
    python benchmarks/startup.py --model random:llama3-8b --cudagraph piecewise   # on a GPU

Writes ``benchmarks/results/startup-<system>-<time>.json`` and appends rows to ``results/startup.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks.common, when run as a script

from benchmarks.common import console_table, make_record, save_results  # noqa: E402

SHARED_KINDS = ("models", "tokenizers")  # converted once, linked into every start's cache dir
PHASES = ("load_weights_s", "dynamo_s", "inductor_s", "cache_load_s", "cudagraph_s", "kv_alloc_s", "ready_s")


def child(opts: dict) -> None:
    """One start: build the engine, generate one token, print the timings as one JSON line."""
    import logging

    from kiln import LLM, SamplingParams

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    llm = LLM(model=opts["model"], compile={"mode": "kiln", "cudagraph": opts["cudagraph"]},
              cache={"dir": opts["cache_dir"]}, device=opts["device"])
    ready = time.time()
    out = llm.generate([[100, 200, 300, 400, 500, 600, 700, 800]], SamplingParams(max_tokens=1, temperature=0.0),
                       use_tqdm=False)
    first_token = time.time()
    runner = llm.engine.executor.runner
    print("RESULT " + json.dumps({
        "ready_wall": ready, "first_token_wall": first_token, "token": out[0].outputs[0].token_ids[0],
        "cache_hit": bool(getattr(runner.compiled.forward, "cache_hit", False)), **runner.startup_seconds,
    }), flush=True)


def start(opts: dict, scratch: Path, run: str) -> dict:
    """One start in a fresh process with fresh Inductor, Triton and temp dirs."""
    fresh = {name: scratch / f"{run}-{name}" for name in ("inductor", "triton", "tmp")}
    for path in fresh.values():
        path.mkdir(parents=True)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(fresh["inductor"]), "TRITON_CACHE_DIR": str(fresh["triton"]),
           "TMPDIR": str(fresh["tmp"]), "PYTHONPATH": str(REPO)}
    env.pop("KILN_CACHE_READ_ONLY", None)
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(opts)],
                          env=env, capture_output=True, text=True, cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{run} start failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    result["ttft_s"] = result.pop("first_token_wall") - t0
    result["process_to_ready_s"] = result.pop("ready_wall") - t0
    for line in proc.stderr.splitlines():
        if "compile cache" in line or "start-up:" in line:
            print(f"  [{run}] {line.split(': ', 1)[-1]}")
    return result


def prepared_cache_dir(scratch: Path, source: Path) -> Path:
    """An empty cache dir but for links to the converted models and tokenizers of ``source``."""
    cache_dir = scratch / "cache"
    cache_dir.mkdir()
    for kind in SHARED_KINDS:
        if (source / kind).is_dir():
            (cache_dir / kind).symlink_to((source / kind).resolve(), target_is_directory=True)
    return cache_dir


def ensure_converted(model: str, cache_dir: Path) -> None:
    """Convert a registered model (or a random preset's tokenizer) once, outside the timed starts."""
    from kiln.config import ModelConfig
    from kiln.models.loader import _tokenizer_dir, load_model
    from kiln.models.registry import REGISTERED_MODELS

    if model in REGISTERED_MODELS:
        import torch

        load_model(ModelConfig(model=model), str(cache_dir), torch.device("cpu"), torch.float32)
    elif model.startswith("random:"):
        _tokenizer_dir(str(cache_dir))


def main() -> None:
    from kiln.config import CUDAGRAPH_MODES, default_cache_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--cudagraph", default="none", choices=CUDAGRAPH_MODES)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--repeats", type=int, default=1, help="warm starts to time (the best is reported)")
    parser.add_argument("--no-save", action="store_true", help="print only; write no results files")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))

    source = Path(default_cache_dir()).expanduser()
    ensure_converted(args.model, source)
    scratch = Path(tempfile.mkdtemp(prefix="kiln-startup-"))
    try:
        opts = {"model": args.model, "cudagraph": args.cudagraph, "device": args.device,
                "cache_dir": str(prepared_cache_dir(scratch, source))}
        cold = start(opts, scratch, "cold")
        warms = [start(opts, scratch, f"warm{i}") for i in range(args.repeats)]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    warm = min(warms, key=lambda r: r["ttft_s"])
    if cold["cache_hit"] or not warm["cache_hit"]:
        raise RuntimeError(f"expected a cold miss and a warm hit, got {cold['cache_hit']=} {warm['cache_hit']=}")
    if warm["token"] != cold["token"]:
        raise RuntimeError(f"warm start generated {warm['token']}, cold {cold['token']}")
    report(args, cold, warm)


def report(args, cold: dict, warm: dict) -> None:
    header = ["start", "ttft_s", "process_to_ready_s", *PHASES]
    rows = [[name, *(round(r[k], 2) for k in header[1:])] for name, r in (("cold", cold), ("warm", warm))]
    ratio = warm["ttft_s"] / cold["ttft_s"]
    print(console_table(header, rows))
    print(f"warm / cold time to first token: {ratio:.2f}")
    if args.no_save:
        return
    records = []
    for name, r in (("cold", cold), ("warm", warm)):
        metrics = {k: round(r[k], 3) for k in header[1:]}
        metrics["warm_over_cold_ttft"] = round(ratio, 3)
        config = {"system": f"{name}-{args.model.replace(':', '_')}", "start": name, "model": args.model,
                  "compile.mode": "kiln", "compile.cudagraph": args.cudagraph}
        records.append(make_record("startup", args.model, config, metrics))
    json_paths, table = save_results("startup", records, config_keys=["start", "compile.cudagraph"])
    print(f"wrote {', '.join(str(p) for p in json_paths)} and {table}")


if __name__ == "__main__":
    main()
