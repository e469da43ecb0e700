"""Where offline throughput goes: kernel time by category, steps and host gaps, for several engine
configurations in one process.

For each ``--systems`` entry (``name=JSON`` of ``LLM`` keywords merged over the defaults, or one of
the names below), on ``random:<model>`` with ``max_model_len``:

- a warm-up run (all prompts, ``--warmup-tokens`` new tokens), then a timed run of ``--num-requests``
  prompts of ``--prompt-len`` tokens, ``--output-len`` new tokens each, greedy, ``ignore_eos``; each
  engine step is recorded (decode rows, prefill tokens, time between step returns), so the run
  splits into mixed steps (prefill chunks + decodes) and decode-only steps;
- with ``--profile``: the same run again under torch.profiler (CUDA kernels, CUDA-graph replays
  included); kernel time is grouped by category (``category`` below) and the host gap is the wall
  time of the run minus the time at least one kernel runs.

Named systems: ``bf16`` (``LLM(model=...)`` defaults), ``fp8+kv`` (defaults with
``model.quantization=fp8`` and ``cache.dtype=fp8``). Results: ``<out>/offline_profile.json`` and
``.md``, written after every system; systems past ``--deadline-s`` are skipped.

    python -m benchmarks.offline profile --profile --out $OUT          # H100: about 4 minutes
    python -m benchmarks.offline profile --model tiny --num-requests 8 --prompt-len 16 --output-len 8 \\
        --systems 'cpu={"compile": {"mode": "eager"}}' --out /tmp/op   # smoke, CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from benchmarks.common import out_dir

NAMED = {
    "bf16": {},
    "fp8+kv": {"model": {"quantization": "fp8"}, "cache": {"dtype": "fp8"}},
}

# (category, substrings of the kernel name); first match wins.
CATEGORIES = (
    ("attention decode", ("_decode_kernel", "_merge_splits_kernel")),
    ("attention prefill", ("_prefill_kernel",)),
    ("kv store", ("_store_kv_kernel",)),
    ("activation quant (fused norm/silu + quant)", ("_add_rms_norm_quant_kernel", "_silu_and_mul_quant_kernel", "_silu_and_mul_quant_row_kernel")),
    ("activation quant (standalone)", ("_per_token_quant_kernel",)),
    ("GEMM fp8 (Triton weight-only)", ("_fp8", "_w8", "quant_gemm", "_gemv")),
    ("GEMM fp8 (scaled_mm)", ("e4m3", "f8f8", "qqtst", "_fp8_", "float8")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "wgmma", "sm90_", "sm80_", "ampere", "cublas", "splitk",
              "triton_tem_", "mm_kernel")),
    ("norm / silu (Triton)", ("_add_rms_norm_kernel", "_silu_and_mul_kernel")),
    ("Inductor fused (rotary, norms, elementwise)", ("triton_poi", "triton_red", "triton_per")),
    ("sampling / logits (aten)", ("argmax", "argmin", "softmax", "topk", "sort", "gather", "scatter", "cumsum",
                                  "reduce_kernel", "exponential", "distribution")),
    ("copies", ("memcpy", "memset", "copy_kernel", "cat", "index")),
    ("other aten elementwise", ("elementwise", "vectorized")),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k.lower() in low for k in keys):
            return cat
    return "other"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama3-8b", help="random preset")
    p.add_argument("--systems", default="bf16;fp8+kv",
                   help="';'-separated: a named system, or name=JSON of LLM keywords over the defaults "
                        "(a name 'fp8+kv/...' starts from fp8+kv)")
    p.add_argument("--num-requests", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--warmup-tokens", type=int, default=16, help="new tokens of the warm-up run; 0: no warm-up")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per system (the best counts)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--cprofile", action="store_true", help="also run once under cProfile and print the top functions")
    p.add_argument("--profile-systems", default="", help="','-separated names to profile (default: all)")
    p.add_argument("--deadline-s", type=float, default=330.0)
    p.add_argument("--out", default=str(out_dir()))
    return p.parse_args(argv)


def merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def system_kwargs(spec: str) -> tuple[str, dict]:
    if "=" not in spec:
        return spec, NAMED[spec]
    name, js = spec.split("=", 1)
    base = NAMED.get(name.split("/")[0], {})
    return name, merge(base, json.loads(js))


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prompts(num: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, 30000, (num, length), generator=gen).tolist()


class StepLog:
    """Wraps the engine's scheduler and step: per step (decode rows, prefill tokens, seconds since
    the previous step returned)."""

    def __init__(self, engine):
        self.engine, self.steps = engine, []
        self._schedule, self._step = engine.scheduler.schedule, engine.step
        self._last = None

        def schedule():
            t = time.perf_counter()
            out = self._schedule()
            self.phases["scheduler.schedule"] = self.phases.get("scheduler.schedule", 0.0) + time.perf_counter() - t
            dec = sum(1 for s in out.scheduled if s.num_new_tokens == 1 and s.request.num_computed_tokens > 0)
            pre = sum(s.num_new_tokens for s in out.scheduled) - dec
            self.steps.append([dec, pre, 0.0, 0.0])  # decode rows, prefill tokens, step s, launch s
            return out

        def step(*a, **k):
            outs = self._step(*a, **k)
            now = time.perf_counter()
            if self._last is not None and self.steps:
                self.steps[-1][2] = now - self._last
            self._last = now
            return outs

        engine.scheduler.schedule, engine.step = schedule, step
        # Host seconds per phase of the step loop (GPU waits included in "wait").
        self.phases: dict[str, float] = {}
        runner = getattr(engine.executor, "runner", None)
        for obj, attr, key in ((engine.scheduler, "update", "scheduler.update"),
                               (engine.executor, "wait", "wait (GPU + read back)"),
                               (runner, "launch", "launch (prepare + enqueue)"),
                               (engine.output_processor, "process", "output processing")):
            if obj is not None:
                self._time(obj, attr, key)

    def _time(self, obj, attr, key):
        f = getattr(obj, attr)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                dt = time.perf_counter() - t
                self.phases[key] = self.phases.get(key, 0.0) + dt
                if attr == "launch" and self.steps:
                    self.steps[-1][3] += dt

        setattr(obj, attr, timed)

    def start(self):
        self.steps, self._last, self.phases = [], time.perf_counter(), {}

    def summary(self) -> dict:
        # With the engine's overlap a step's time lands on the step scheduled after it; totals hold.
        mixed = [s for s in self.steps if s[1] > 0]
        dec = [s for s in self.steps if s[1] == 0 and s[0] > 0]
        return {"steps": len(self.steps), "mixed_steps": len(mixed), "decode_steps": len(dec),
                "mixed_s": sum(s[2] for s in mixed), "decode_s": sum(s[2] for s in dec),
                "mixed_tokens_per_step": sum(s[0] + s[1] for s in mixed) / max(len(mixed), 1),
                "decode_rows_per_step": sum(s[0] for s in dec) / max(len(dec), 1),
                "decode_ms_per_step": 1e3 * sum(s[2] for s in dec) / max(len(dec), 1),
                "mixed_ms_per_step": 1e3 * sum(s[2] for s in mixed) / max(len(mixed), 1),
                "host_ms_per_step": {k: 1e3 * v / max(len(self.steps), 1) for k, v in self.phases.items()},
                "launch_ms_mixed": 1e3 * sum(s[3] for s in mixed) / max(len(mixed), 1),
                "launch_ms_decode": 1e3 * sum(s[3] for s in dec) / max(len(dec), 1)}


def kernel_table(prof, wall_s: float) -> dict:
    device_type = torch.autograd.DeviceType.CUDA if torch.cuda.is_available() else torch.autograd.DeviceType.CPU
    kernels: dict[str, list] = {}
    intervals = []
    for e in prof.events():
        if e.device_type != device_type or (device_type == torch.autograd.DeviceType.CPU and e.cpu_parent is not None):
            continue
        us = e.time_range.elapsed_us()
        entry = kernels.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += us
        intervals.append((e.time_range.start, e.time_range.end))
    intervals.sort()
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in intervals:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    cats: dict[str, float] = {}
    for name, (_, us) in kernels.items():
        cats[category(name)] = cats.get(category(name), 0.0) + us / 1e6
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:40]
    return {"categories_s": dict(sorted(cats.items(), key=lambda kv: -kv[1])), "kernel_s": sum(cats.values()),
            "busy_s": busy / 1e6, "wall_s": wall_s, "host_gap_s": wall_s - busy / 1e6,
            "top_kernels": [{"name": n[:160], "count": c, "s": us / 1e6, "category": category(n)}
                            for n, (c, us) in top]}


def run_system(name: str, kwargs: dict, args, profile: bool) -> dict:
    from kiln import LLM, SamplingParams

    t0 = time.perf_counter()
    model = merge({"model": f"random:{args.model}", "max_model_len": args.max_model_len}, kwargs.get("model", {}))
    llm = LLM(model=model, **{k: v for k, v in kwargs.items() if k != "model"})
    startup = time.perf_counter() - t0
    engine = llm.engine
    cfg = engine.config
    log = StepLog(engine)
    # Every run gets prompts of its own seed: a repeated prompt would hit the prefix cache.
    seeds = iter(range(1, 100))
    t = time.perf_counter()
    if args.warmup_tokens > 0:  # 0: the first timed run is the first the engine sees
        llm.generate(prompts(args.num_requests, args.prompt_len, seed=next(seeds)),
                     SamplingParams(max_tokens=args.warmup_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    warmup = time.perf_counter() - t
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    best, steps, times = float("inf"), None, []
    for _ in range(args.repeats):
        sync()
        batch = prompts(args.num_requests, args.prompt_len, seed=next(seeds))
        log.start()
        t = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        sync()
        t = time.perf_counter() - t
        times.append(t)
        assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
        if t < best:
            best, steps = t, log.summary()
    rec = {"system": name, "kwargs": kwargs, "startup_s": startup, "warmup_s": warmup, "offline_s": best, "run_s": times,
           "first_run_tok_s": args.num_requests * args.output_len / times[0],
           "output_tok_s": args.num_requests * args.output_len / best, **steps,
           "max_num_seqs": cfg.scheduler.max_num_seqs, "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
           "num_capture_sizes": len(cfg.compile.capture_sizes or ()), "mode": cfg.compile.mode,
           "cudagraph": cfg.compile.cudagraph, "kv_tokens": engine.executor.num_blocks * cfg.cache.block_size}
    if args.cprofile:
        import cProfile
        import io
        import pstats

        pr = cProfile.Profile()
        batch = prompts(args.num_requests, args.prompt_len, seed=next(seeds))
        pr.enable()
        llm.generate(batch, params, use_tqdm=False)
        sync()
        pr.disable()
        text = io.StringIO()
        st = pstats.Stats(pr, stream=text)
        st.sort_stats("tottime").print_stats(30)
        st.sort_stats("cumulative").print_stats(50)
        rec["cprofile"] = text.getvalue()
    if profile:
        from torch.profiler import ProfilerActivity, profile as tprofile

        sync()
        activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU  # CPU: a smoke run
        with tprofile(activities=[activity]) as prof:
            batch = prompts(args.num_requests, args.prompt_len, seed=next(seeds))
            t = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            sync()
            t = time.perf_counter() - t
        rec["profile"] = kernel_table(prof, t)
        del prof
    engine.shutdown()
    del llm, engine, log, outs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rec


def markdown(records: list[dict], meta: dict) -> str:
    lines = [f"# offline {meta['num_requests']} x {meta['prompt_len']}/{meta['output_len']}, random:{meta['model']} "
             f"({meta['device']})", ""]
    base = records[0]["output_tok_s"] if records else 1.0
    lines += ["| system | tok/s (best run) | first run | x first system | s | steps (mixed / decode) | "
              "mixed ms/step, tokens | decode ms/step, rows | seqs / batched tokens / sizes | KV tokens | start s |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        lines.append(f"| {r['system']} | {r['output_tok_s']:,.0f} | {r.get('first_run_tok_s', 0):,.0f} | "
                     f"{r['output_tok_s'] / base:.3f} | "
                     f"{r['offline_s']:.2f} | {r['mixed_steps']} / {r['decode_steps']} | "
                     f"{r['mixed_ms_per_step']:.1f}, {r['mixed_tokens_per_step']:.0f} | "
                     f"{r['decode_ms_per_step']:.1f}, {r['decode_rows_per_step']:.0f} | "
                     f"{r['max_num_seqs']} / {r['max_num_batched_tokens']} / {r['num_capture_sizes']} | "
                     f"{r['kv_tokens']:,} | {r['startup_s']:.1f} |")
    lines += ["", "| system | launch ms, mixed step | launch ms, decode step |", "| --- | --- | --- |"]
    lines += [f"| {r['system']} | {r.get('launch_ms_mixed', 0):.2f} | {r.get('launch_ms_decode', 0):.2f} |"
              for r in records]
    phases = []
    for r in records:
        phases += [p for p in r.get("host_ms_per_step", {}) if p not in phases]
    if phases:
        lines += ["", "Host time of the step loop, ms per step (timed run):", "",
                  "| phase | " + " | ".join(r["system"] for r in records) + " |", "| --- |" + " --- |" * len(records)]
        for p in phases:
            lines.append(f"| {p} | " + " | ".join(f"{r.get('host_ms_per_step', {}).get(p, 0.0):.2f}" for r in records)
                         + " |")
    profiled = [r for r in records if "profile" in r]
    if profiled:
        cats = []
        for r in profiled:
            cats += [c for c in r["profile"]["categories_s"] if c not in cats]
        lines += ["", "Kernel time of one profiled run (seconds; the run is slower under the profiler):", "",
                  "| category | " + " | ".join(r["system"] for r in profiled) + " |",
                  "| --- |" + " --- |" * len(profiled)]
        for c in cats:
            lines.append(f"| {c} | " + " | ".join(f"{r['profile']['categories_s'].get(c, 0.0):.3f}" for r in profiled)
                         + " |")
        for key in ("kernel_s", "busy_s", "wall_s", "host_gap_s"):
            lines.append(f"| **{key}** | " + " | ".join(f"{r['profile'][key]:.3f}" for r in profiled) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    meta = {"model": args.model, "num_requests": args.num_requests, "prompt_len": args.prompt_len,
            "output_len": args.output_len, "max_model_len": args.max_model_len, "device": device}
    t_start = time.perf_counter()
    records = []
    only = set(filter(None, args.profile_systems.split(",")))
    for spec in filter(None, args.systems.split(";")):
        name, kwargs = system_kwargs(spec)
        if time.perf_counter() - t_start > args.deadline_s:
            print(f"skipped {name}: past the deadline", flush=True)
            continue
        try:
            rec = run_system(name, kwargs, args, args.profile and (not only or name in only))
        except Exception as exc:  # one failing configuration must not lose the others
            rec = None
            print(f"{name} failed: {type(exc).__name__}: {exc}", flush=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            print(f"after {name}: {torch.cuda.memory_allocated() / 2**30:.2f} GiB still allocated", flush=True)
        if rec is not None:
            records.append(rec)
            print(json.dumps({k: v for k, v in rec.items() if k not in ("profile", "cprofile")}), flush=True)
        (out / "offline_profile.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
        (out / "offline_profile.md").write_text(markdown(records, meta))
    print(markdown(records, meta))
    for r in records:
        if "cprofile" in r:
            print(f"--- cProfile {r['system']}")
            print("\n".join(line[:150] for line in r["cprofile"].splitlines() if line.strip()))
    for r in records:
        if "profile" in r:
            print(f"--- top kernels {r['system']}")
            for k in r["profile"]["top_kernels"][:25]:
                print(f"{k['s']:8.3f} s {k['count']:7d}  {k['category'][:24]:24s} {k['name'][:110]}")


if __name__ == "__main__":
    main()
