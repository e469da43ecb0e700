"""How long from launch until kiln runs at full speed, cold and warm? (``compile.startup``)

Every start is a fresh process, timed from its launch:

- ``llm``: ``LLM(model, compile={"startup": POLICY})``, then batch-1 decodes of 32 tokens, one after
  another, for ``--watch`` seconds (and until a background build has ended), then the same decode
  once everything is built and captured (steady state).
- ``serve``: ``kiln serve`` with the same options and ``--load`` client threads that start as soon as
  ``/health`` answers, each sending non-streamed requests of 32 new tokens one after another.

Each row: launch to ready (as the parent saw it), the ready line's own sum of phases (which must
match within 0.5 s), launch to the first token, and launch to **full speed**: the start of the
first window of three decodes (under load, four requests) after which every window's median runs
at least 95% of steady state's tokens per second (the median of the last five decodes, or of the
last 5 s of load, once everything is built).

- ``cold``: an empty kiln cache dir (and fresh Inductor, Triton and temp dirs), as on a new machine;
  with ``--checkpoint`` the checkpoint's pages are dropped from the page cache first.
- ``warm``: the cache dir the cold start filled, with fresh Inductor, Triton and temp dirs again: a
  restarted container whose image ships the cache (on a GPU kiln keeps Triton's and Inductor's
  caches in its own cache dir, so the warm start finds them too).

    python -m benchmarks.startup starts                                  # SmolLM2 on the CPU, both entrypoints
    python -m benchmarks.startup starts --checkpoint llama3-8b --checkpoint-dir /tmp/ckpt --startup auto,complete

``--checkpoint PRESET`` first writes a random ``PRESET`` model as a Hugging Face checkpoint (config.json,
sharded safetensors with an index, the tokenizer files) and starts from it. Writes
``startup-<system>-<time>.json`` and a table ``startup-<time>.md`` into ``$OUT``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Optional


from benchmarks.common import REPO, child_command, child_env, console_table, make_record, out_dir, save_results, stop_process

SHARED_KINDS = ("models", "tokenizers")  # converted once, linked into every start's cache dir
PROMPT = [100, 200, 300, 400, 500, 600, 700, 800]
NEW_TOKENS = 32
FULL_SPEED = 0.95  # of steady state's tokens per second
READY = re.compile(r"kiln: ready.* ([0-9.]+) s from launch \((.*)\)")


def full_speed_at(samples: list[tuple[float, float]], steady: float, window: int = 1) -> Optional[float]:
    """The earliest start time of a sample (start s, tok/s) from which every later window of
    ``window`` samples has a median of at least FULL_SPEED x ``steady``; None if none."""
    ordered = sorted(samples)
    medians = [statistics.median(r for _, r in ordered[i:i + window]) for i in range(len(ordered) - window + 1)]
    at = None
    for i in range(len(medians) - 1, -1, -1):
        if medians[i] < FULL_SPEED * steady:
            break
        at = ordered[i][0]
    return at


def llm_child(opts: dict) -> None:
    """One ``LLM`` start (the parent's launch time in ``opts``): timings as one JSON line."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)7.0f ms %(name)s: %(message)s")
    from kiln import LLM, SamplingParams

    llm = LLM(model=opts["model"], compile={"startup": opts["startup"]}, cache={"dir": opts["cache_dir"]},
              device=opts["device"], **({"max_model_len": opts["max_model_len"]} if opts.get("max_model_len") else {}))
    ready = time.time()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

    def decode() -> tuple[float, float, list[int]]:
        t0 = time.time()
        out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
        return t0, NEW_TOKENS / (time.time() - t0), list(out.token_ids)

    samples, first = [], None
    while time.time() < ready + opts["watch_s"] or llm.engine.building:
        t0, rate, tokens = decode()
        first = first if first is not None else (t0, tokens)
        samples.append((t0 - opts["launch"], rate))
    llm.engine.wait_for_build()
    while getattr(llm.engine, "capture_idle", lambda: False)():
        pass
    for _ in range(5):  # steady state, after them
        t0, rate, _ = decode()
        samples.append((t0 - opts["launch"], rate))
    steady = statistics.median(r for _, r in samples[-5:])
    report = llm.engine.startup
    runner = llm.engine.executor.runner
    print("RESULT " + json.dumps({
        "ready_s": ready - opts["launch"], "ready_line_s": report.since_launch_s,
        "timeline": [list(row) for row in report.timeline], "first_decode_s": first[0] - opts["launch"],
        "full_speed_s": full_speed_at(samples, steady, window=3), "steady_tok_s": steady, "samples": samples,
        "first_tokens": first[1][:8], "cache_hit": bool(getattr(runner.compiled.forward, "cache_hit", False)),
        "build": llm.engine.config.compile.build,
    }), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _building(base: str) -> bool:
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        return any(line.startswith("kiln_compile_building ") and float(line.split()[1]) > 0
                   for line in r.read().decode().splitlines())


def serve_start(opts: dict, env: dict, launch_cmd: list[str]) -> dict:
    """One ``kiln serve`` start under ``opts["load"]`` client threads from its first second."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = launch_cmd + ["serve", f"model={opts['model']}", f"compile.startup={opts['startup']}",
                        f"cache.dir={opts['cache_dir']}", f"server.port={port}", f"model.device={opts['device']}"]
    if opts.get("max_model_len"):
        cmd.append(f"model.max_model_len={opts['max_model_len']}")
    log = open(Path(opts["scratch"]) / f"serve-{opts['run']}.log", "w+")
    launch = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"kiln serve exited {proc.returncode}:\n{log.read()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.02)
        ready = time.time()
        samples: list[tuple[float, float]] = []
        stop = threading.Event()
        body = {"model": opts["model"], "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0.0,
                "ignore_eos": True}

        def client() -> None:
            while not stop.is_set():
                t0 = time.time()
                out = _post(f"{base}/v1/completions", body)
                samples.append((t0 - launch, out["usage"]["completion_tokens"] / (time.time() - t0)))

        threads = [threading.Thread(target=client, daemon=True) for _ in range(opts["load"])]
        for t in threads:
            t.start()
        while time.time() < ready + opts["watch_s"] or _building(base):
            time.sleep(0.5)
        # Steady state: the last 5 s of load, once nothing is built any more and captures had time.
        time.sleep(opts["settle_s"])
        steady_from = time.time() - launch
        time.sleep(5.0)
        stop.set()
        for t in threads:
            t.join(timeout=60)
        steady = statistics.median(r for t0, r in samples if t0 >= steady_from)
        log.seek(0)
        text = log.read()
        if opts.get("log_dir"):
            Path(opts["log_dir"], f"serve-{opts['run']}.log").write_text(text)
        match = READY.search(text)
        return {"ready_s": ready - launch, "ready_line_s": float(match.group(1)) if match else None,
                "timeline": match.group(2) if match else None, "first_decode_s": min(t for t, _ in samples),
                "full_speed_s": full_speed_at(samples, steady, window=4), "steady_tok_s": steady,
                "requests": len(samples), "warm_hit": "loaded from the compile cache" in text}
    finally:
        stop_process(proc)
        log.close()


def start_env(scratch: Path, run: str, on_gpu: bool) -> dict:
    fresh = {name: scratch / f"{run}-{name}" for name in ("inductor", "triton", "tmp")}
    for path in fresh.values():
        path.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(fresh["inductor"]), "TRITON_CACHE_DIR": str(fresh["triton"]),
           "TMPDIR": str(fresh["tmp"])}
    env = child_env(env)
    if on_gpu:  # kiln keeps them in its cache dir there (use_kernel_caches), fresh for cold
        env.pop("TORCHINDUCTOR_CACHE_DIR")
        env.pop("TRITON_CACHE_DIR")
    env.pop("KILN_CACHE_READ_ONLY", None)
    return env


def llm_start(opts: dict, env: dict) -> dict:
    launch = time.time()
    proc = subprocess.run(child_command("benchmarks.startup.starts", "--child", json.dumps({**opts, "launch": launch})),
                          env=env, capture_output=True, text=True, cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{opts['run']} start failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    result.pop("samples")
    result["timeline"] = ", ".join(f"{name} {s:.1f}" for name, s in result["timeline"] if s >= 0.05)
    return result


def write_checkpoint(preset: str, out_dir: Path, shard_bytes: int = 5 * 2**30) -> Path:
    """A random ``preset`` model (seed 0, bf16) as a Hugging Face checkpoint in ``out_dir``: config.json,
    model-0000i-of-0000n.safetensors shards of about ``shard_bytes`` with their index, and the
    tokenizer files random presets borrow. Tensors are drawn on the GPU when there is one."""
    import torch
    from safetensors.torch import save_file

    from kiln.models.arch import PRESETS
    from kiln.models.loader import tokenizer_dir, iter_random_weights

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
    tokenizer = Path(tokenizer_dir(str(out_dir / ".tokenizer-cache")))
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
    cache_dir.mkdir(parents=True)
    for kind in SHARED_KINDS:
        if (source / kind).is_dir():
            (cache_dir / kind).symlink_to((source / kind).resolve(), target_is_directory=True)
    return cache_dir


def ensure_converted(model: str, cache_dir: Path) -> None:
    """Convert a registered model (or a random preset's tokenizer) once, outside the timed starts."""
    from kiln.config import ModelConfig
    from kiln.models.loader import tokenizer_dir, load_model
    from kiln.models.registry import REGISTERED_MODELS

    if model in REGISTERED_MODELS:
        import torch

        load_model(ModelConfig(model=model), str(cache_dir), torch.device("cpu"), torch.float32)
    elif model.startswith("random:"):
        tokenizer_dir(str(cache_dir))


def main(argv=None) -> None:
    from kiln.config import default_cache_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--checkpoint", help="write a random PRESET as an HF checkpoint and start from it")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="where --checkpoint writes (default: a temp dir); a checkpoint already there is reused")
    parser.add_argument("--startup", default="auto", help="compile.startup values, comma-separated")
    parser.add_argument("--entry", default="llm,serve", help="llm, serve or both (comma-separated)")
    parser.add_argument("--starts", default="cold,warm", help="cold, warm or both (cold first: warm reuses its cache)")
    parser.add_argument("--watch", type=float, default=20.0, help="seconds of decodes / load after ready")
    parser.add_argument("--settle", type=float, default=5.0, help="serve: seconds after the build before steady state")
    parser.add_argument("--load", type=int, default=4, help="serve: client threads from the first second")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--kiln", default=None, help="the kiln command for serve (default: this Python's kiln CLI)")
    parser.add_argument("--out", default=None, help="write the records here rather than $OUT")
    parser.add_argument("--no-save", action="store_true", help="print only; write no results files")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return llm_child(json.loads(args.child))
    import torch

    on_gpu = args.device != "cpu" and torch.cuda.is_available()
    source = Path(default_cache_dir()).expanduser()
    scratch = Path(tempfile.mkdtemp(prefix="kiln-startup-"))
    checkpoint = None
    if args.checkpoint and args.checkpoint_dir and (Path(args.checkpoint_dir) / "model.safetensors.index.json").exists():
        checkpoint = Path(args.checkpoint_dir)  # written by an earlier run
    elif args.checkpoint:
        t0 = time.time()
        checkpoint = write_checkpoint(args.checkpoint, Path(args.checkpoint_dir or scratch / "checkpoint"))
        print(f"wrote {checkpoint} in {time.time() - t0:.1f} s", flush=True)
    if checkpoint is not None:
        args.model = str(checkpoint)
    else:
        ensure_converted(args.model, source)
    launch_cmd = args.kiln.split() if args.kiln else [sys.executable, "-m", "kiln.entrypoints.cli"]
    rows = []
    try:
        for policy in args.startup.split(","):
            for entry in args.entry.split(","):
                cache_dir = prepared_cache_dir(scratch / f"{policy}-{entry}", source)
                for run in args.starts.split(","):
                    opts = {"model": args.model, "startup": policy, "device": args.device, "cache_dir": str(cache_dir),
                            "max_model_len": args.max_model_len, "watch_s": args.watch, "settle_s": args.settle,
                            "load": args.load, "run": f"{policy}-{entry}-{run}", "scratch": str(scratch),
                            "log_dir": args.out}
                    if checkpoint is not None and run == "cold":
                        drop_page_cache(checkpoint)
                    env = start_env(scratch, opts["run"], on_gpu)
                    result = llm_start(opts, env) if entry == "llm" else serve_start(opts, env, launch_cmd)
                    rows.append({"startup": policy, "entry": entry, "start": run, **result})
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report(args, rows)


def report(args, rows: list[dict]) -> None:
    keys = ["ready_s", "ready_line_s", "first_decode_s", "full_speed_s", "steady_tok_s"]
    table = [[r["startup"], r["entry"], r["start"], *(None if r.get(k) is None else round(r[k], 2) for k in keys)]
             for r in rows]
    print(console_table(["compile.startup", "entry", "start", *keys], table))
    for r in rows:
        print(f"{r['startup']} {r['entry']} {r['start']}: {r['timeline']}")
    if args.no_save:
        return
    model = f"checkpoint:{args.checkpoint}" if args.checkpoint else args.model
    records = [make_record("startup", model, {"system": f"{r['startup']}-{r['entry']}-{r['start']}",
                                               "compile.startup": r["startup"], "entry": r["entry"], "start": r["start"]},
                           {k: r[k] for k in keys if r.get(k) is not None}) for r in rows]
    where = [Path(args.out)] if args.out else []
    json_paths, table_path = save_results("startup", records, *where, config_keys=["compile.startup", "entry", "start"])
    print(f"wrote {', '.join(str(p) for p in json_paths)} and {table_path}")


if __name__ == "__main__":
    main()
