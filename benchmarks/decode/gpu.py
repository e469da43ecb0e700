"""How close is kiln's batch-1 decode to the HBM roofline, with and without CUDA graphs, on one GPU?

For each model (random weights with real shapes, bf16) it measures, in this one process:

- the device copy bandwidth (a large device-to-device copy, bytes read + written per second), the
  ceiling a batch-1 decode step is bound by: roofline tok/s = bandwidth / weight bytes per step
  (every weight read once; the embedding table is not read by a step unless it is the tied lm_head);
- batch-1 decode: ``--prompt-len`` prompt, ``--output-len`` new tokens, ``ignore_eos``. Reported:
  end-to-end output tok/s (prefill included, the number ``GPU.md``'s table uses) and the decode step
  time ``(t(output_len) - t(1)) / (output_len - 1)`` with its percent of the roofline;
- where a batch-1 decode step goes (``--breakdown-steps``): host time per phase of ``engine.step``
  (schedule, prepare + launch, sample incl. the GPU wait, update, detokenize) next to the device
  time of one graph replay and of the lm_head + argmax alone, plus a kernel table of three steps
  run without graphs (``profile-<model>-<system>.txt``);
- offline throughput for ``--throughput-model``: ``--num-requests`` prompts at once (for the
  systems in ``--tp-systems``; capture sizes reach 512 so a 512-request decode replays a graph);

for HF transformers ``generate`` (eager, same weights) and kiln ``compile.mode`` eager / kiln, each
with ``compile.cudagraph`` none and full, and kiln with ``full_and_piecewise`` (``kiln-pw``). "none" is the same engine as "full" with graph dispatch
switched off (``runner.compiled.full_graphs = None``), so both rows share one build and one KV cache.

Phases run in priority order and stop starting new ones after ``--deadline-s``; results are
written after every phase (``--out``: one JSON of all records and a markdown table).

    python -m benchmarks.decode gpu --out /tmp/gpu_decode
    python -m benchmarks.decode gpu --models qwen2.5-0.5b --throughput-model none --output-len 32
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from benchmarks.common import (  # noqa: F401  (re-exported for decode.static and decode.profile)
    append_table_rows, console_table, copy_bandwidth, make_record, out_dir, weight_bytes_per_step,
)

MAX_MODEL_LEN = 2048
CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512)  # up to the throughput run's batch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="qwen2.5-0.5b,llama3-8b", help="random presets for batch-1 decode")
    p.add_argument("--throughput-model", default="llama3-8b", help="preset for offline throughput, or none")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--tp-prompt-len", type=int, default=256)
    p.add_argument("--tp-output-len", type=int, default=256)
    p.add_argument("--modes", default="hf,eager,kiln,kiln-pw",
                   help="systems: hf, eager (kiln eager), kiln (compiled), kiln-pw (compiled, full + piecewise graphs)")
    p.add_argument("--tp-systems", default="hf-generate,kiln-eager-full,kiln-kiln-full,kiln-kiln-full_and_piecewise",
                   help="systems that also run the offline throughput phase (each costs a full run)")
    p.add_argument("--breakdown-steps", type=int, default=48, help="decode steps timed per phase; 0: none")
    p.add_argument("--deadline-s", type=float, default=1e9, help="start no new phase after this many seconds")
    p.add_argument("--out", default=str(out_dir()), help="directory for the JSON and markdown")
    return p.parse_args(argv)


def make_prompts(num: int, length: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (num, length), generator=gen).tolist()


# ---- systems: each is generate(prompts, new_tokens) -> new token ids per prompt --------------


def hf_system(preset: str):
    """HF transformers with the weights kiln's loader makes for ``random:<preset>`` (seed 0)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kiln.models.arch import PRESETS
    from kiln.models.loader import build_empty_model, init_random_weights

    arch = PRESETS[preset]
    kiln_model = build_empty_model(arch, torch.device("cuda"), torch.bfloat16)
    init_random_weights(kiln_model, seed=0)
    d = arch.to_hf_config()
    config = AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    missing, unexpected = hf.load_state_dict(dict(kiln_model.weight_targets()), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    weight_bytes = weight_bytes_per_step(kiln_model)
    del kiln_model
    hf.generation_config.eos_token_id = None  # like ignore_eos

    @torch.inference_mode()
    def generate(prompts, new_tokens):
        ids = torch.tensor(prompts, device="cuda")
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=new_tokens, pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()

    return generate, hf, weight_bytes


def kiln_system(preset: str, mode: str, max_num_seqs: int, cudagraph: str = "full"):
    from kiln import LLM, SamplingParams

    llm = LLM(model=f"random:{preset}", dtype="bfloat16", max_model_len=MAX_MODEL_LEN,
              compile={"mode": mode, "cudagraph": cudagraph, "capture_sizes": CAPTURE_SIZES},
              cache={"gpu_memory_fraction": 0.85},
              scheduler={"max_num_seqs": max_num_seqs, "max_num_batched_tokens": 2048})

    def generate(prompts, new_tokens):
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    return generate, llm


def timed_generate(generate, prompts, new_tokens, repeats: int = 2) -> tuple[float, list[list[int]]]:
    best, outs = float("inf"), None
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = generate(prompts, new_tokens)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    if sum(len(o) for o in outs) != len(prompts) * new_tokens:
        raise RuntimeError(f"made {sum(len(o) for o in outs)} tokens, wanted {len(prompts) * new_tokens}")
    return best, outs


def decode_metrics(generate, args, roofline_tok_s: float) -> tuple[dict, list[int]]:
    prompts = make_prompts(1, args.prompt_len)
    generate(prompts, 8)  # warm-up
    t1, _ = timed_generate(generate, prompts, 1)
    tn, outs = timed_generate(generate, prompts, args.output_len)
    step_s = (tn - t1) / (args.output_len - 1)
    return {
        "output_tok_s": args.output_len / tn,
        "decode_step_ms": 1e3 * step_s,
        "decode_tok_s": 1 / step_s,
        "roofline_pct": 100 / step_s / roofline_tok_s,
        "prefill_ms": 1e3 * t1,
    }, outs[0]


def throughput_metrics(generate, args) -> dict:
    prompts = make_prompts(args.num_requests, args.tp_prompt_len, seed=1)
    generate(prompts[:4], 4)  # warm-up
    t, _ = timed_generate(generate, prompts, args.tp_output_len, repeats=1)
    return {"output_tok_s": args.num_requests * args.tp_output_len / t, "elapsed_s": t}


# ---- where a batch-1 decode step goes ------------------------------------------------------------


class _PhaseTimers:
    """Wall-clock seconds per phase, by wrapping callables on live objects (undone by ``restore``)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._undo: list = []

    def wrap(self, obj, attr: str, key: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t0

        had_own = attr in vars(obj)
        setattr(obj, attr, timed)
        self._undo.append((obj, attr, fn if had_own else None))

    def restore(self) -> None:
        for obj, attr, fn in reversed(self._undo):
            if fn is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, fn)
        self._undo.clear()


def _gpu_ms(fn, iters: int = 50) -> float:
    """Median device time of ``fn`` (events around each call)."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def step_breakdown(llm, args, preset: str, system: str) -> dict:
    """Per-phase host time of ``engine.step`` over ``--breakdown-steps`` batch-1 decode steps, and the
    device time of the work alone. ``sample_ms`` includes waiting for the GPU (the read-back sync);
    ``graph_gpu_ms`` is one replay of the size-1 graph (forward, logits and argmax when captured),
    ``logits_gpu_ms`` the lm_head + argmax run eagerly. Also writes a kernel table of 3 steps run
    without graphs (``profile-<preset>-<system>.txt`` under ``--out``)."""
    from kiln import SamplingParams

    engine = llm.engine
    runner = engine.executor.runner
    n = args.breakdown_steps
    params = SamplingParams(max_tokens=n + 8, temperature=0.0, ignore_eos=True)
    engine.add_request(f"breakdown-{system}", make_prompts(1, args.prompt_len, seed=2)[0], params)
    engine.step()  # the prefill
    engine.step()
    timers = _PhaseTimers()
    timers.wrap(engine.scheduler, "schedule", "schedule_ms")
    timers.wrap(runner.input_batch, "prepare", "prepare_ms")
    timers.wrap(runner.compiled, "run", "launch_ms")
    timers.wrap(runner, "collect", "sample_ms")
    timers.wrap(engine.scheduler, "update", "update_ms")
    timers.wrap(engine.output_processor, "process", "process_ms")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        engine.step()
    total = time.perf_counter() - t0
    timers.restore()
    out = {k: 1e3 * v / n for k, v in timers.seconds.items()}
    out["step_ms"] = 1e3 * total / n
    out["other_ms"] = out["step_ms"] - sum(1e3 * v / n for v in timers.seconds.values())
    graphs = runner.compiled.full_graphs
    if graphs is not None and 1 in graphs.sizes:
        # The buffers hold the last step's inputs: a replay rewrites that step's K/V with the same values.
        out["graph_gpu_ms"] = _gpu_ms(lambda: graphs.replay(1))
        g = graphs.replay(1)
        if g.greedy_ids is not None:
            t0 = time.perf_counter()
            for _ in range(20):
                graphs.replay(1).greedy_ids.tolist()
            out["replay_readback_ms"] = 1e3 * (time.perf_counter() - t0) / 20
        hidden = g.hidden[:1].clone()
        out["logits_gpu_ms"] = _gpu_ms(lambda: runner.model.compute_logits(hidden).argmax(-1))
    if system.endswith("-full"):  # the table runs without graphs: one per build is enough
        _kernel_table(engine, runner, Path(args.out) / f"profile-{preset}-{system}.txt")
    while engine.has_unfinished_requests():
        engine.step()
    return out


def _kernel_table(engine, runner, path: Path, steps: int = 3) -> None:
    from torch.profiler import ProfilerActivity, profile

    graphs, runner.compiled.full_graphs = runner.compiled.full_graphs, None
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
        avg = prof.key_averages()
        try:
            table = avg.table(sort_by="self_device_time_total", row_limit=25)
        except Exception:  # older profilers name it after CUDA
            table = avg.table(sort_by="self_cuda_time_total", row_limit=25)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{steps} decode steps, no CUDA graphs\n{table}")
    except Exception as e:  # the profile is a diagnosis: never lose the run for it
        print(f"profile failed: {type(e).__name__}: {e}", flush=True)
    finally:
        runner.compiled.full_graphs = graphs


# ---- the run -------------------------------------------------------------------------------------


class Results:
    def __init__(self, out_dir: Path, card: str):
        self.out_dir, self.records = out_dir, []
        stem = "gpu_decode-" + "".join(c if c.isalnum() else "_" for c in card).strip("_")
        self.json_path = out_dir / f"{stem}.json"
        self.md_path = out_dir / f"{stem}.md"

    def add(self, model: str, config: dict, metrics: dict) -> None:
        self.records.append(make_record("gpu_decode", model, config, metrics))
        print(f"  {model} {config} -> " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()
                                                     if isinstance(v, (int, float))), flush=True)

    def save(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.json_path.write_text(json.dumps(self.records, indent=1))
        if self.md_path.exists():
            self.md_path.unlink()
        append_table_rows(self.md_path, self.records, ["system", "bench", "batch"])


def free_cuda() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def run_model(preset: str, args, bandwidth: float, results: Results, t_start: float) -> None:
    with_tp = preset == args.throughput_model
    roofline = None
    hf_tokens = None
    for mode in args.modes.split(","):
        if time.perf_counter() - t_start > args.deadline_s:
            print(f"deadline: skipping {preset} {mode}", flush=True)
            continue
        print(f"== {preset}: {mode}", flush=True)
        t0 = time.perf_counter()
        if mode == "hf":
            generate, handle, weight_bytes = hf_system(preset)
            roofline = bandwidth / weight_bytes
            variants = {"hf-generate": None}
        elif mode == "kiln-pw":  # full graphs for decode-only batches, piecewise for mixed ones
            generate, handle = kiln_system(preset, "kiln", max(args.num_requests if with_tp else 1, 1),
                                           cudagraph="full_and_piecewise")
            runner = handle.engine.executor.runner
            roofline = bandwidth / weight_bytes_per_step(runner.model)
            graphs = runner.compiled.full_graphs
            variants = {"kiln-kiln-full_and_piecewise": graphs}
        else:
            generate, handle = kiln_system(preset, mode, max_num_seqs=max(args.num_requests if with_tp else 1, 1))
            runner = handle.engine.executor.runner
            roofline = bandwidth / weight_bytes_per_step(runner.model)
            graphs = runner.compiled.full_graphs
            variants = {f"kiln-{mode}-none": None, f"kiln-{mode}-full": graphs}
        startup_s = time.perf_counter() - t0
        for system, graphs in variants.items():
            if mode != "hf":
                runner.compiled.full_graphs = graphs
            metrics, tokens = decode_metrics(generate, args, roofline)
            if mode == "hf":
                hf_tokens = tokens
            elif hf_tokens is not None:
                metrics["agree_with_hf_tokens"] = agreeing_prefix(tokens, hf_tokens)
            metrics["startup_s"] = startup_s
            metrics["roofline_tok_s"] = roofline
            results.add(f"random:{preset}", {"system": system, "bench": "decode", "batch": 1}, metrics)
            if mode != "hf" and args.breakdown_steps:
                results.add(f"random:{preset}", {"system": system, "bench": "breakdown", "batch": 1},
                            step_breakdown(handle, args, preset, system))
            if with_tp and system in args.tp_systems.split(","):
                metrics = throughput_metrics(generate, args)
                results.add(f"random:{preset}", {"system": system, "bench": "throughput",
                                                 "batch": args.num_requests}, metrics)
            results.save()
        del handle, generate, variants
        runner = graphs = None
        free_cuda()


def agreeing_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main(argv=None) -> None:
    import logging
    import sys

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    t_start = time.perf_counter()
    card = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth()
    print(f"{card}: device copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    results = Results(Path(args.out), card)
    results.records.append(make_record("gpu_decode", "-", {"system": "device-copy", "bench": "bandwidth", "batch": 0},
                                       {"bandwidth_tb_s": bandwidth / 1e12}))
    models = args.models.split(",")
    if args.throughput_model != "none" and args.throughput_model not in models:
        models.append(args.throughput_model)
    for preset in models:
        try:
            run_model(preset, args, bandwidth, results, t_start)
        except Exception as e:  # record and go on: one broken phase must not lose the others
            import traceback

            traceback.print_exc()
            results.records.append(make_record("gpu_decode", f"random:{preset}", {"system": "error"},
                                               status="error", error=f"{type(e).__name__}: {e}"))
            free_cuda()
        results.save()
    rows = [[r["model"], r["config"].get("system"), r["config"].get("bench"), r["config"].get("batch"),
             r["metrics"].get("output_tok_s", r["metrics"].get("bandwidth_tb_s")),
             r["metrics"].get("decode_step_ms", ""), r["metrics"].get("roofline_pct", "")]
            for r in results.records if r["status"] == "ok" and r["config"].get("bench") != "breakdown"]
    phases = ["step_ms", "schedule_ms", "prepare_launch_ms", "sample_ms", "update_ms", "process_ms",
              "other_ms", "graph_gpu_ms", "replay_readback_ms", "logits_gpu_ms"]
    rows_bd = [[r["model"], r["config"]["system"]] + [r["metrics"].get(k, "") for k in phases]
               for r in results.records if r["status"] == "ok" and r["config"].get("bench") == "breakdown"]
    if rows_bd:
        print("\nbatch-1 decode step breakdown (ms per step; sample includes the GPU wait)")
        print(console_table(["model", "system"] + [k[:-3] for k in phases], rows_bd))
    print(f"\n{card}, bf16, decode: prompt {args.prompt_len} + {args.output_len} new; throughput: "
          f"{args.num_requests} x ({args.tp_prompt_len} in, {args.tp_output_len} out)")
    print(console_table(["model", "system", "bench", "batch", "out tok/s", "step ms", "% roofline"], rows))


if __name__ == "__main__":
    main()
