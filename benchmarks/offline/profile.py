"""Where offline throughput goes: kernel time by category, steps and host gaps, for several engine
configurations in one process.

For each ``--systems`` entry (``name=JSON`` of ``LLM`` keywords merged over the defaults, kernel
options among them: ``apart={"kernels":{"max_store_join_pairs":0}}``; its key ``"env"`` environment
variables set while that system runs; or one of the names below), on ``random:<model>`` with
``max_model_len``:

- a warm-up run (all prompts, ``--warmup-tokens`` new tokens), then a timed run of ``--num-requests``
  prompts of ``--prompt-len`` tokens, ``--output-len`` new tokens each, greedy, ``ignore_eos``; each
  engine step is recorded (decode rows, prefill tokens, time between step returns), so the run
  splits into mixed steps (prefill chunks + decodes) and decode-only steps;
- with ``--profile``: the same run again under torch.profiler (CUDA kernels, CUDA-graph replays
  included); kernel time is grouped by category (``category`` below) and the host gap is the wall
  time of the run minus the time at least one kernel runs.

With ``--steps 64,256,512``: after the timed runs, one profiled run per batch size (that many
requests of ``--prompt-len`` tokens; ``--steps-output-len`` new tokens, ``--output-len`` for the
largest) with a marker kernel before each step's launch, so every kernel lands in its step. The
table is per step: the decode-only steps at each batch and the mixed (prefill + decode) steps of
the largest run, each kernel category against its bound on this card: bytes over the measured copy
bandwidth (weights, K/V read at each decode's context, activations) or FLOPs over
``--peak-tflops`` (GEMMs at their rows, prefill attention), whichever is larger for GEMMs. Results:
``<out>/offline_steps.json`` and ``.md`` (``--run`` renames them).

Named systems: ``bf16`` (``LLM(model=...)`` defaults), ``fp8+kv`` (defaults with
``model.quantization=fp8`` and ``cache.dtype=fp8``). Results: ``<out>/offline_profile.json`` and
``.md``, written after every system; systems past ``--deadline-s`` are skipped.

    python -m benchmarks.offline profile --profile --out $OUT          # H100: about 4 minutes
    python -m benchmarks.offline profile --steps 64,256,512 --systems bf16 --out $OUT  # per-step table
    python -m benchmarks.offline profile --model tiny --num-requests 8 --prompt-len 16 --output-len 8 \\
        --systems 'cpu={"compile": {"mode": "eager"}}' --out /tmp/op   # smoke, CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import os
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
    p.add_argument("--steps", default="", help="','-separated decode batch sizes: per-step kernel tables "
                                                 "(the decode-only steps at each, the mixed steps of the largest)")
    p.add_argument("--steps-output-len", type=int, default=48, help="new tokens of each --steps run but the largest")
    p.add_argument("--peak-tflops", type=float, default=790.0, help="the bf16 matmul rate the bounds use "
                                                                    "(twice this for FP8 weights)")
    p.add_argument("--run", default="", help="name of the result files (default offline_profile, offline_steps)")
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

    env = {k: str(v) for k, v in kwargs.get("env", {}).items()}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return _run_system(name, kwargs, args, profile, LLM, SamplingParams)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run_system(name: str, kwargs: dict, args, profile: bool, LLM, SamplingParams) -> dict:
    t0 = time.perf_counter()
    model = merge({"model": f"random:{args.model}", "max_model_len": args.max_model_len}, kwargs.get("model", {}))
    llm = LLM(model=model, **{k: v for k, v in kwargs.items() if k not in ("model", "env")})
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
    if args.steps:
        rec["step_table"] = step_tables(llm, kwargs, args, seeds)
    engine.shutdown()
    del llm, engine, log, outs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rec


# ---------------------------------------------------------------------------------------------
# Per-step kernel tables (--steps)

MARKER = "spin_kernel"  # torch.cuda._sleep's kernel: one before each step's launch
CPU_MARKER = "kiln_step_mark"  # the same as a CPU range (a smoke run on the CPU)
# Bound rows: each groups kernel categories and has a bound (None: none is computed).
GROUPS = (
    ("GEMM", ("GEMM", "GEMM fp8 (Triton weight-only)", "GEMM fp8 (scaled_mm)")),
    ("attention decode", ("attention decode",)),
    ("attention prefill", ("attention prefill",)),
    ("kv store", ("kv store",)),
    ("norms, activations, rotary (Triton + Inductor)", (
        "norm / silu (Triton)", "Inductor fused (rotary, norms, elementwise)",
        "activation quant (fused norm/silu + quant)", "activation quant (standalone)", "other aten elementwise")),
    ("sampling / logits", ("sampling / logits (aten)",)),
    ("copies", ("copies",)),
    ("other", ("other",)),
)


def model_shape(runner) -> dict:
    """What the bounds need: parameters in the body's linears and in the LM head, weight bytes a step
    reads, K/V bytes per token of context (all layers), and the attention shape."""
    from benchmarks.common import weight_bytes_per_step
    from kiln.models.quantize import QuantLinear

    model, arch = runner.model, runner.arch
    linear = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n)
    linear += sum(m.qweight.numel() for m in model.modules() if isinstance(m, QuantLinear))  # fp8: one a weight
    head = arch.vocab_size * arch.hidden_size
    body = linear - (head if getattr(model, "lm_head", None) is not None else 0)
    caches = [c for c in runner.kv_caches if isinstance(c, torch.Tensor)]
    kv_token = sum(c.numel() * c.element_size() for c in caches) // max(runner.num_blocks * caches[0].shape[2], 1)
    elem = 2 if next(model.parameters()).dtype in (torch.bfloat16, torch.float16) else 4
    # Activations an elementwise pass reads and writes per token and layer: two add + RMSNorms
    # (x and residual in, both out), SiLU-and-mul (2 x intermediate in, 1 out), rotary of q and k.
    act = elem * (2 * 4 * arch.hidden_size + 3 * arch.intermediate_size
                  + 2 * (arch.num_heads + arch.num_kv_heads) * arch.head_dim)
    return {"body_params": int(body), "head_params": int(head), "weight_bytes": int(weight_bytes_per_step(model)),
            "kv_bytes_per_token": int(kv_token), "num_layers": arch.num_layers, "num_heads": arch.num_heads,
            "head_dim": arch.head_dim, "act_bytes_per_token": int(act * arch.num_layers)}


class StepMarks:
    """Puts a marker kernel in the stream before each launch and notes what the step holds: decode
    rows and the sum of their contexts, prefill tokens and the (query, key) pairs they attend, rows
    sampled."""

    def __init__(self, runner):
        self.on, self.info = False, []
        launch = runner.launch
        cuda = torch.cuda.is_available()

        def marked(sched, *a, **k):
            if self.on and not sched.is_empty:
                self.info.append(step_info(sched))
                if cuda:
                    torch.cuda._sleep(1)
                else:
                    with torch.profiler.record_function(CPU_MARKER):
                        pass
            return launch(sched, *a, **k)

        runner.launch = marked


def step_info(sched) -> dict:
    rows = ctx = pre = pairs = sampled = 0
    for s in sched.scheduled:
        n, start, req = s.num_new_tokens, s.start, s.request
        if n == 1 and start >= req.num_prompt_tokens:
            rows, ctx, sampled = rows + 1, ctx + start + 1, sampled + 1
        else:
            pre += n
            pairs += n * start + n * (n + 1) // 2
            sampled += start + n >= req.num_prompt_tokens
    return {"rows": rows, "ctx": ctx, "prefill_tokens": pre, "pairs": pairs, "sampled": sampled}


def split_steps(prof, num_steps: int) -> list[dict]:
    """Kernels (device events, or the CPU's top-level ops) between one marker and the next: per step
    the microseconds by category, their sum, the span from the first kernel's start to the last's
    end, and the idle time before the first (after the step before's last kernel)."""
    cuda = torch.cuda.is_available()
    device_type = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    evs = [e for e in prof.events() if e.device_type == device_type and (cuda or e.cpu_parent is None)]
    evs.sort(key=lambda e: e.time_range.start)
    marker = MARKER if cuda else CPU_MARKER
    steps, cur, prev_end = [], None, None
    for e in evs:
        if marker in e.name:
            cur = {"cats_us": {}, "kernel_us": 0.0, "start": None, "end": None}
            steps.append(cur)
            continue
        if cur is None:
            continue
        s, t = e.time_range.start, e.time_range.end
        cat = category(e.name)
        cur["cats_us"][cat] = cur["cats_us"].get(cat, 0.0) + (t - s)
        cur["kernel_us"] += t - s
        cur["start"] = s if cur["start"] is None else cur["start"]
        cur["end"] = t if cur["end"] is None else max(cur["end"], t)
    out = []
    for st in steps:
        if st["start"] is None:
            st["start"] = st["end"] = prev_end or 0.0
        st["span_us"] = st["end"] - st["start"]
        st["gap_us"] = max(st["start"] - prev_end, 0.0) if prev_end is not None else 0.0
        prev_end = st["end"]
        out.append({k: st[k] for k in ("cats_us", "kernel_us", "span_us", "gap_us")})
    if len(out) != num_steps:
        print(f"warning: {len(out)} step markers for {num_steps} launches; the per-step split is off", flush=True)
    return out[:num_steps]


def step_bounds(info: dict, shape: dict, bw: float, peak: float, fp8_weights: bool) -> dict:
    """Milliseconds each bound row needs at the card's rates (None: no bound)."""
    tokens = info["rows"] + info["prefill_tokens"]
    flops = 2 * (shape["body_params"] * tokens + shape["head_params"] * info["sampled"])
    gemm_peak = peak * (2 if fp8_weights else 1)
    heads, dim, layers = shape["num_heads"], shape["head_dim"], shape["num_layers"]
    q_out = info["rows"] * layers * heads * dim * 2 * 2  # q read, output written (bf16)
    return {
        "GEMM": 1e3 * max(flops / gemm_peak, shape["weight_bytes"] / bw),
        "attention decode": 1e3 * (info["ctx"] * shape["kv_bytes_per_token"] + q_out) / bw if info["rows"] else 0.0,
        "attention prefill": 1e3 * 4 * heads * dim * layers * info["pairs"] / peak,
        "kv store": 1e3 * 2 * tokens * shape["kv_bytes_per_token"] / bw,
        "norms, activations, rotary (Triton + Inductor)": 1e3 * tokens * shape["act_bytes_per_token"] / bw,
        "sampling / logits": None, "copies": None, "other": None,
    }


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else 0.0


def summarize_steps(infos: list[dict], times: list[dict], shape: dict, bw: float, peak: float,
                    fp8_weights: bool) -> dict:
    """The mean step of a set of steps: ms per bound row with its bound, kernels, span and gap."""
    n = max(len(infos), 1)
    mean = lambda xs: sum(xs) / n  # noqa: E731
    info = {k: mean([i[k] for i in infos]) for k in ("rows", "ctx", "prefill_tokens", "pairs", "sampled")}
    bounds = step_bounds(info, shape, bw, peak, fp8_weights)
    rows = {}
    for group, cats in GROUPS:
        ms = mean([sum(t["cats_us"].get(c, 0.0) for c in cats) for t in times]) / 1e3
        if ms > 0 or bounds[group]:
            rows[group] = {"ms": ms, "bound_ms": bounds[group]}
    bound = sum(b for b in bounds.values() if b)
    return {"num_steps": len(infos), "rows": info["rows"], "mean_ctx": info["ctx"] / max(info["rows"], 1),
            "prefill_tokens": info["prefill_tokens"], "groups": rows,
            "kernel_ms": mean([t["kernel_us"] for t in times]) / 1e3,
            "span_ms": mean([t["span_us"] for t in times]) / 1e3,
            # The median: one stall (a collection of the profiler's own objects) outweighs the rest.
            "gap_ms": median([t["gap_us"] for t in times]) / 1e3, "max_gap_ms": max(t["gap_us"] for t in times) / 1e3,
            "bound_ms": bound}


def step_tables(llm, kwargs: dict, args, seeds) -> dict:
    """Profiled runs at each --steps batch; the decode-only steps at that batch and the mixed
    steps of the largest, summarized (``summarize_steps``)."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    from benchmarks.common import copy_bandwidth
    from kiln import SamplingParams

    runner = llm.engine.executor.runner
    shape = model_shape(runner)
    bw = copy_bandwidth()
    peak = args.peak_tflops * 1e12
    fp8_weights = kwargs.get("model", {}).get("quantization") == "fp8"
    marks = StepMarks(runner)
    batches = sorted({int(b) for b in args.steps.split(",") if b})
    activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU
    kinds, per_step = {}, {}
    for b in batches:
        out_len = args.output_len if b == batches[-1] else args.steps_output_len
        params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
        batch = prompts(b, args.prompt_len, seed=next(seeds))
        sync()
        marks.info, marks.on = [], True
        with tprofile(activities=[activity]) as prof:
            t = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            sync()
            wall = time.perf_counter() - t
        marks.on = False
        times = split_steps(prof, len(marks.info))
        del prof
        infos = marks.info[:len(times)]
        per_step[str(b)] = {"wall_s": wall, "steps": [
            [i["rows"], i["prefill_tokens"], i["ctx"], round(t["kernel_us"]), round(t["span_us"]), round(t["gap_us"])]
            for i, t in zip(infos, times)]}
        dec = [k for k, i in enumerate(infos) if i["prefill_tokens"] == 0 and i["rows"] == b]
        if not dec:
            dec = [k for k, i in enumerate(infos) if i["prefill_tokens"] == 0 and i["rows"] >= 0.9 * b]
        if dec:
            kinds[f"decode {b}"] = summarize_steps([infos[k] for k in dec], [times[k] for k in dec], shape, bw, peak,
                                                   fp8_weights)
        if b == batches[-1]:
            sizes = [i["rows"] + i["prefill_tokens"] for i in infos]
            mixed = [k for k, i in enumerate(infos) if i["prefill_tokens"] > 0 and sizes[k] >= 0.9 * max(sizes)]
            if mixed:
                kinds["mixed"] = summarize_steps([infos[k] for k in mixed], [times[k] for k in mixed], shape, bw,
                                                 peak, fp8_weights)
        print(f"steps: batch {b}, {len(infos)} steps in {wall:.2f} s (profiled)", flush=True)
    return {"shape": shape, "copy_bw": bw, "peak_flops": peak, "kinds": kinds, "per_step": per_step}


def steps_markdown(records: list[dict], meta: dict) -> str:
    lines = [f"# per-step kernel time, random:{meta['model']}, prompts of {meta['prompt_len']} ({meta['device']})", ""]
    for r in records:
        st = r.get("step_table")
        if not st:
            continue
        kinds = st["kinds"]
        lines += [f"{r['system']}: ms per step (bound ms, x bound); copy {st['copy_bw'] / 1e12:.2f} TB/s measured, "
                  f"{st['peak_flops'] / 1e12:.0f} TFLOP/s; offline {meta['num_requests']} x "
                  f"{meta['prompt_len']}/{meta['output_len']} in the same process: {r['output_tok_s']:,.0f} tok/s", ""]
        head = []
        for name, k in kinds.items():
            what = (f"{k['rows']:.0f} rows, ctx {k['mean_ctx']:.0f}" if name.startswith("decode")
                    else f"{k['prefill_tokens']:.0f} prefill + {k['rows']:.0f} decode")
            head.append(f"{name} ({what}; {k['num_steps']} steps)")
        lines += ["| kernels | " + " | ".join(head) + " |", "| --- |" + " --- |" * len(kinds)]
        groups = []
        for k in kinds.values():
            groups += [g for g in k["groups"] if g not in groups]
        for g in groups:
            cells = []
            for k in kinds.values():
                row = k["groups"].get(g)
                if row is None or row["ms"] < 0.005:
                    cells.append("" if row is None or not row["bound_ms"] else f"- ({row['bound_ms']:.2f})")
                elif row["bound_ms"]:
                    cells.append(f"{row['ms']:.2f} ({row['bound_ms']:.2f}, {row['ms'] / row['bound_ms']:.1f}x)")
                else:
                    cells.append(f"{row['ms']:.2f}")
            lines.append(f"| {g} | " + " | ".join(cells) + " |")
        lines.append("| **kernels, summed** | " + " | ".join(
            f"**{k['kernel_ms']:.2f}** ({k['bound_ms']:.2f}, {k['kernel_ms'] / k['bound_ms']:.2f}x)"
            for k in kinds.values()) + " |")
        lines.append("| GPU span of the step | " + " | ".join(
            f"{k['span_ms']:.2f} ({k['span_ms'] / k['bound_ms']:.2f}x)" for k in kinds.values()) + " |")
        lines.append("| GPU idle before the step, median (max) | " + " | ".join(
            f"{k['gap_ms']:.2f} ({k.get('max_gap_ms', 0):.1f})" for k in kinds.values()) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


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
            shown = {k: v for k, v in rec.items() if k not in ("profile", "cprofile", "step_table")}
            print(json.dumps(shown), flush=True)
        stem = args.run or ("offline_steps" if args.steps else "offline_profile")
        (out / f"{stem}.json").write_text(json.dumps({"device": device, "meta": meta, "records": records}, indent=1))
        text = markdown(records, meta)
        if args.steps:
            text += "\n" + steps_markdown(records, meta)
        (out / f"{stem}.md").write_text(text)
    print(markdown(records, meta))
    if args.steps:
        print(steps_markdown(records, meta))
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
