"""How long from process start to the first token, cold and warm? (the compiled-artifact cache)

Every start is a fresh process building ``LLM(model, compile.mode=kiln)`` and generating one token.

- ``cold``: nothing compiled anywhere: an empty kiln compile cache, and empty Inductor, Triton and
  temp dirs (Inductor keeps its precompiled C++ header under the temp dir), as on a new machine.
- ``warm``: the kiln cache dir the cold start filled, with empty Inductor, Triton and temp dirs
  again: a restarted container whose image ships the cache (``kiln cache export``). On a GPU kiln
  keeps Triton's and Inductor's caches in its cache dir, so the warm start finds those too.
- ``restart`` (``--restart``): a warm start that also keeps the cold start's Inductor, Triton and
  temp dirs, as a restart on the same machine.

Converted weights are shared by both (linked from the usual cache dir), so neither pays for a
conversion. Each row has time to first token (interpreter start included), the engine's start-up
breakdown (load weights, Dynamo, Inductor, compile cache load, CUDA graphs, KV allocation, ready),
the time to the first token of kiln's compiled forward (``kiln_token_s``: later than the first
token where that token was served eagerly while the forward was built in the background,
``eager_first``) and the warm/cold ratio.

    python benchmarks/startup.py                                      # SmolLM2 on the CPU
    python benchmarks/startup.py --model random:llama3-8b --cudagraph piecewise   # on a GPU

From a real checkpoint on disk (``--checkpoint PRESET``): first a random ``PRESET`` model is written
as a Hugging Face checkpoint (config.json, sharded safetensors with an index, the tokenizer files)
under ``--checkpoint-dir``, then every start loads it from there (weights read from disk, on CUDA
straight into GPU memory). Before the cold start the checkpoint's pages are dropped from the page
cache (``posix_fadvise(DONTNEED)``), so it reads the disk; the warm start finds them cached, as a
restarted server would::

    python benchmarks/startup.py --checkpoint llama3-8b --checkpoint-dir /tmp/ckpt --mode auto --cudagraph auto

Writes ``benchmarks/results/startup-<system>-<time>.json`` and appends rows to ``results/startup.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks.common, when run as a script

from benchmarks.common import console_table, make_record, save_results  # noqa: E402

SHARED_KINDS = ("models", "tokenizers")  # converted once, linked into every start's cache dir
PHASES = ("load_weights_s", "weights_wait_s", "dynamo_s", "inductor_s", "cache_load_s", "cudagraph_s", "profile_s", "kv_alloc_s",
          "tokenizer_wait_s", "eager_warm_up_s", "ready_s")



def capture_option(capture: str) -> dict:
    """The ``compile.capture`` keyword for ``--capture`` (none for ``unset``)."""
    return {} if capture == "unset" else {"capture": capture}

def child(opts: dict) -> None:
    """One start: build the engine, generate one token, print the timings as one JSON line."""
    import logging

    marks = {"child_start_wall": time.time()}
    sampler = None
    if opts.get("sample_dir"):  # --sample-stacks: where the main thread spends the start
        from benchmarks.stack_sampler import StackSampler

        sampler = StackSampler()
        sampler.start()
    import torch

    marks["torch_wall"] = time.time()
    if opts["device"] != "cpu" and torch.cuda.is_available():
        torch.cuda.init()
    marks["cuda_wall"] = time.time()
    from kiln import LLM, SamplingParams

    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)7.0f ms %(name)s: %(message)s")

    t_import = time.time()
    build = {} if opts.get("build", "unset") == "unset" else {"build": opts["build"]}
    llm = LLM(model=opts["model"], compile={"mode": opts.get("mode", "kiln"), "cudagraph": opts["cudagraph"],
                                           **capture_option(opts.get("capture", "lazy")), **build},
              cache={"dir": opts["cache_dir"]}, device=opts["device"],
              **({"max_model_len": opts["max_model_len"]} if opts.get("max_model_len") else {}))
    ready = time.time()
    out = llm.generate([[100, 200, 300, 400, 500, 600, 700, 800]], SamplingParams(max_tokens=1, temperature=0.0),
                       use_tqdm=False)
    first_token = time.time()
    runner = llm.engine.executor.runner
    eager_first = bool(getattr(runner.compiled, "building", False))  # compile.build=background: served eagerly
    # The first token of kiln's forward: once a background build ends, the next step switches to it.
    llm.engine.wait_for_build()
    llm.generate([[100, 200, 300, 400, 500, 600, 700, 800]], SamplingParams(max_tokens=1, temperature=0.0),
                 use_tqdm=False)
    kiln_token = time.time()
    if sampler is not None:
        sampler.stop()
        Path(opts["sample_dir"], f"stacks-{opts['run']}.txt").write_text(sampler.report())
    batch = then_batch(llm, opts["then_batch"]) if opts.get("then_batch") and opts["run"].startswith("warm") else {}
    drained = {}
    if eager_first and opts["run"] == "cold":  # as an idle server would: the graphs' memory is kept for the warm start
        drained = {"cold_capture_drain_s": capture_while_idle(llm)}
    print("RESULT " + json.dumps({**batch, **drained,
        "ready_wall": ready, "first_token_wall": first_token, "import_done_wall": t_import, **marks,
        "kiln_token_wall": kiln_token, "eager_first": eager_first,
        "background_cache_load_s": getattr(runner.compiled.forward, "cache_load_seconds", 0.0) if eager_first else 0.0,
        "token": out[0].outputs[0].token_ids[0],
        "cache_hit": bool(getattr(runner.compiled.forward, "cache_hit", False)), **runner.startup_seconds,
    }), flush=True)


def capture_while_idle(llm) -> float:
    """Capture every pending CUDA-graph size, as an idle server does (``capture_idle``, where the
    engine has it); the seconds it took."""
    t0 = time.time()
    while getattr(llm.engine, "capture_idle", lambda: False)():
        pass
    return time.time() - t0


def then_batch(llm, shape: str) -> dict:
    """``--then-batch N,T``: right after the first token, N greedy requests of T new tokens (offline
    throughput while lazily captured graphs are still being captured), then every pending size
    captured (``capture_idle``, where the engine has it) and the same batch again (steady state)."""
    from kiln import SamplingParams

    n, max_tokens = (int(x) for x in shape.split(","))
    prompts = [[100 + i] + [200, 300, 400, 500, 600, 700, 800] * 4 for i in range(n)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def timed() -> tuple[float, list[list[int]]]:
        t0 = time.time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return n * max_tokens / (time.time() - t0), [list(o.outputs[0].token_ids) for o in outs]

    during, tokens = timed()
    drain = capture_while_idle(llm)
    after, tokens_after = timed()
    same = sum(a == b for a, b in zip(tokens, tokens_after)) / n
    return {"batch_first_tok_s": during, "capture_drain_s": drain, "batch_steady_tok_s": after,
            "batch_same_tokens": same, "batch_first_tokens": tokens[0][:8],
            "batch_steady_hash": hashlib.sha256(json.dumps(tokens_after).encode()).hexdigest()[:12]}


def start(opts: dict, scratch: Path, run: str, machine: Optional[str] = None) -> dict:
    """One start in a fresh process with fresh Inductor, Triton and temp dirs, or with those of the
    earlier start ``machine`` (a restart on the same machine, whose Triton and Inductor caches
    survived)."""
    fresh = {name: scratch / f"{machine or run}-{name}" for name in ("inductor", "triton", "tmp")}
    for path in fresh.values():
        path.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(fresh["inductor"]), "TRITON_CACHE_DIR": str(fresh["triton"]),
           "TMPDIR": str(fresh["tmp"]),
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    if _on_gpu(opts["device"]):  # kiln keeps them in its cache dir there (use_kernel_caches), fresh for cold
        env.pop("TORCHINDUCTOR_CACHE_DIR")
        env.pop("TRITON_CACHE_DIR")
    env.pop("KILN_CACHE_READ_ONLY", None)
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps({**opts, "run": run})],
                          env=env, capture_output=True, text=True, cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{run} start failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    result["first_token_s"] = result["first_token_wall"] - result["ready_wall"]
    # interpreter, torch and kiln imports, split into interpreter start, torch, CUDA init, kiln
    result["interpreter_s"] = result["child_start_wall"] - t0
    result["torch_import_s"] = result["torch_wall"] - result.pop("child_start_wall")
    result["cuda_init_s"] = result["cuda_wall"] - result.pop("torch_wall")
    result["kiln_import_s"] = result["import_done_wall"] - result.pop("cuda_wall")
    result["import_s"] = result.pop("import_done_wall") - t0
    result["ttft_s"] = result.pop("first_token_wall") - t0
    result["kiln_token_s"] = result.pop("kiln_token_wall") - t0  # a token from kiln's forward (after a background build)
    result["process_to_ready_s"] = result.pop("ready_wall") - t0
    if os.environ.get("KILN_STARTUP_LOG_DIR"):  # every log line of the start, with its time
        Path(os.environ["KILN_STARTUP_LOG_DIR"], f"{run}.log").write_text(proc.stderr)
    for line in proc.stderr.splitlines():
        if "compile cache" in line or "start-up:" in line:
            print(f"  [{run}] {line.split(': ', 1)[-1]}")
    return result


def _on_gpu(device: str) -> bool:
    if device == "cpu":
        return False
    import torch

    return torch.cuda.is_available()


def write_checkpoint(preset: str, out_dir: Path, shard_bytes: int = 5 * 2**30) -> Path:
    """A random ``preset`` model (seed 0, bf16) as a Hugging Face checkpoint in ``out_dir``: config.json,
    model-0000i-of-0000n.safetensors shards of about ``shard_bytes`` with their index, and the
    tokenizer files random presets borrow. Tensors are drawn on the GPU when there is one."""
    import torch
    from safetensors.torch import save_file

    from kiln.models.arch import PRESETS
    from kiln.models.loader import _tokenizer_dir, iter_random_weights

    arch = PRESETS[preset]
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shards: list[list[str]] = []  # tensor names per shard, each shard written once full
    current, size, total = {}, 0, 0

    def flush() -> None:
        save_file(current, str(out_dir / f"shard-{len(shards)}.tmp"), metadata={"format": "pt"})
        shards.append(list(current))

    for name, tensor in iter_random_weights(arch, 0, device, torch.bfloat16):
        current[name] = tensor.cpu()
        size += tensor.numel() * tensor.element_size()
        if size >= shard_bytes:
            flush()
            total, current, size = total + size, {}, 0
    if current:
        flush()
        total += size
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (out_dir / f"shard-{i}.tmp").rename(out_dir / fname)
        weight_map.update({name: fname for name in names})
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out_dir / "config.json").write_text(json.dumps({**arch.to_hf_config(), "torch_dtype": "bfloat16"}, indent=1))
    tokenizer = Path(_tokenizer_dir(str(out_dir / ".tokenizer-cache")))
    for f in tokenizer.iterdir():
        if f.is_file():
            shutil.copy(f, out_dir / f.name)
    return out_dir


def drop_page_cache(directory: Path) -> None:
    """Ask the kernel to forget the cached pages of every file in ``directory`` (clean pages only)."""
    for f in directory.iterdir():
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


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
    parser.add_argument("--mode", default="kiln", choices=("auto", "kiln"), help="compile.mode (auto: kiln on CUDA)")
    parser.add_argument("--checkpoint", help="write a random PRESET as an HF checkpoint and start from it")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="where --checkpoint writes (default: a temp dir); a checkpoint already there is reused")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--out", default=None, help="also write the records as JSON / markdown here")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--repeats", type=int, default=1, help="warm starts to time (the best is reported)")
    parser.add_argument("--restart", action="store_true",
                        help="also time a warm start that keeps the cold start's Triton and Inductor caches "
                             "(a restart on the same machine; the plain warm start is a fresh machine)")
    parser.add_argument("--no-save", action="store_true", help="print only; write no results files")
    parser.add_argument("--sample-stacks", default=None, metavar="DIR",
                        help="sample each start's main-thread stack; write the top functions to DIR/stacks-<run>.txt")
    parser.add_argument("--capture", default="lazy", choices=("startup", "lazy", "unset"),
                        help="compile.capture (lazy: what kiln serve does by default; LLM's default is startup; "
                             "unset: pass none, for trees older than the option)")
    parser.add_argument("--build", default="unset", choices=("unset", "auto", "startup", "background"),
                        help="compile.build (unset: pass none, the default; background: serve eagerly while a "
                             "warm start loads kiln's forward)")
    parser.add_argument("--then-batch", default=None, metavar="N,T",
                        help="after the first token of a warm start: N requests of T tokens, twice (tok/s)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))

    source = Path(default_cache_dir()).expanduser()
    scratch = Path(tempfile.mkdtemp(prefix="kiln-startup-"))
    checkpoint = None
    if args.checkpoint and args.checkpoint_dir and (Path(args.checkpoint_dir) / "model.safetensors.index.json").exists():
        checkpoint = Path(args.checkpoint_dir)  # written by an earlier run
        args.model = str(checkpoint)
    elif args.checkpoint:
        t0 = time.time()
        checkpoint = write_checkpoint(args.checkpoint, Path(args.checkpoint_dir or scratch / "checkpoint"))
        print(f"wrote {checkpoint} in {time.time() - t0:.1f} s "
              f"({sum(f.stat().st_size for f in checkpoint.iterdir() if f.is_file()) / 2**30:.1f} GiB)", flush=True)
        args.model = str(checkpoint)
    else:
        ensure_converted(args.model, source)
    try:
        opts = {"model": args.model, "cudagraph": args.cudagraph, "device": args.device, "mode": args.mode,
                "capture": args.capture, "build": args.build,
                "max_model_len": args.max_model_len, "cache_dir": str(prepared_cache_dir(scratch, source)),
                "sample_dir": args.sample_stacks, "then_batch": args.then_batch}
        if checkpoint is not None:
            drop_page_cache(checkpoint)
        cold = start(opts, scratch, "cold")
        warms = [start(opts, scratch, f"warm{i}") for i in range(args.repeats)]
        restart = start(opts, scratch, "restart", machine="cold") if args.restart else None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    warm = min(warms, key=lambda r: r["ttft_s"])
    if cold["cache_hit"] or not warm["cache_hit"]:
        raise RuntimeError(f"expected a cold miss and a warm hit, got {cold['cache_hit']=} {warm['cache_hit']=}")
    if warm["token"] != cold["token"]:
        raise RuntimeError(f"warm start generated {warm['token']}, cold {cold['token']}")
    report(args, cold, warm, restart)


def report(args, cold: dict, warm: dict, restart: Optional[dict] = None) -> None:
    header = ["start", "ttft_s", "process_to_ready_s", "import_s", "interpreter_s", "torch_import_s", "cuda_init_s",
              "kiln_import_s", *PHASES, "first_token_s", "kiln_token_s", "eager_first",
              "background_cache_load_s", "cold_capture_drain_s"]
    starts = [("cold", cold), ("warm", warm)] + ([("restart", restart)] if restart else [])
    rows = [[name, *(round(float(r.get(k, 0.0)), 2) for k in header[1:])] for name, r in starts]
    ratio = warm["ttft_s"] / cold["ttft_s"]
    print(console_table(header, rows))
    print(f"warm / cold time to first token: {ratio:.2f}")
    if "batch_first_tok_s" in warm:
        print("warm, then a batch: " + ", ".join(f"{k} {warm[k]:.3g}" if isinstance(warm[k], float) else f"{k} {warm[k]}"
                                                 for k in ("batch_first_tok_s", "capture_drain_s", "batch_steady_tok_s",
                                                           "batch_same_tokens", "batch_first_tokens",
                                                           "batch_steady_hash")))
    if args.no_save and not args.out:
        return
    records = []
    for name, r in starts:
        metrics = {k: round(float(r.get(k, 0.0)), 3) for k in header[1:]}
        metrics["warm_over_cold_ttft"] = round(ratio, 3)
        model = f"checkpoint:{args.checkpoint}" if args.checkpoint else args.model
        config = {"system": f"{name}-{model.replace(':', '_')}", "start": name, "model": model,
                  "compile.mode": args.mode, "compile.cudagraph": args.cudagraph, "compile.capture": args.capture,
                  "compile.build": args.build}
        records.append(make_record("startup", model, config, metrics))
    if args.out:
        json_paths, table = save_results("startup", records, Path(args.out), config_keys=["start", "compile.cudagraph"])
    else:
        json_paths, table = save_results("startup", records, config_keys=["start", "compile.cudagraph"])
    print(f"wrote {', '.join(str(p) for p in json_paths)} and {table}")


if __name__ == "__main__":
    main()
