"""int4 one-row GEMV per llama3-8b shape: a baseline tree's kernel against this tree's, config by config.

For each linear (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336), group 32, bf16
rows and scales: the baseline's ``triton_linear`` with its own configuration, then this tree's
kernel for every configuration of a sweep (row tile x K tile x warps x stages). Each call is timed
as the op runs it, replayed from a CUDA graph over weight copies past the L2 (``quant_gemm.graph_time``),
and checked against the pure-torch dequantization reference on fresh random inputs (a candidate
off by more than the baseline's error is dropped as wrong). Then groups 64 and 128 and an odd K
check the best configurations' correctness, and a chain of decoder layers without attention
(add_rms_norm, qkv, o, add_rms_norm, gate_up, silu_and_mul, down; PDL on as in the served graph)
times the baseline's GEMVs, this tree's with its ``MEASURED`` table and with the sweep's best.

    PYTHONPATH=<tree> python benchmarks/int4_gemv_shapes.py --baseline-root <main tree> --out $OUT
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import console_table, copy_bandwidth, device_name  # noqa: E402
from quant_gemm import SHAPES, graph_time  # noqa: E402

GROUP = 32
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# --tiny: the same code on shapes the Triton interpreter runs in seconds (a dry run of the script)
TINY_SHAPES = {"qkv": (96, 64), "o": (64, 64), "gate_up": (448, 64), "down": (64, 224)}
SHAPE_SET = dict(SHAPES)


def load_baseline(root: str):
    """The baseline tree's ``kiln/ops/triton_quant_gemm.py`` as a module of its own (it imports this
    tree's ``kiln.ops.pdl``, which both trees share)."""
    path = Path(root) / "kiln" / "ops" / "triton_quant_gemm.py"
    spec = importlib.util.spec_from_file_location("baseline_triton_quant_gemm", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def time_call(fn, copies: int, reps: int = 3) -> float:
    """Seconds per call: CUDA-graph replays on the GPU, wall time on the CPU (a dry run)."""
    if DEVICE == "cuda":
        return graph_time(fn, copies, reps=reps)
    t0 = time.perf_counter()
    for i in range(copies):
        fn(i)
    return (time.perf_counter() - t0) / copies


# (block_n, block_k, num_warps, num_stages), the likelier winners first (a deadline cuts the tail)
SWEEP = [(8, 2048, 4, 2), (16, 1024, 4, 2), (16, 2048, 8, 2), (8, 1024, 2, 2), (16, 1024, 8, 2), (8, 4096, 4, 1),
         (16, 1024, 4, 1), (8, 2048, 4, 1), (8, 1024, 2, 1), (8, 1024, 4, 2), (16, 2048, 8, 1), (8, 4096, 8, 2),
         (16, 4096, 8, 1), (16, 512, 4, 2), (32, 512, 4, 2), (32, 1024, 8, 2), (4, 2048, 2, 2)]


# --dot: the tensor-core kernel at one row (x padded to 16 rows by masking), (block_n, block_k,
# split_k, num_warps, num_stages): dequantizing in bf16x2 takes about half the GEMV's ALU work a
# weight byte, for cards whose bandwidth outruns the GEMV's arithmetic.
DOT_SWEEP = [(64, 256, 1, 4, 3), (128, 256, 1, 4, 3), (64, 512, 1, 4, 2), (128, 128, 1, 4, 4), (64, 256, 2, 4, 3),
             (128, 256, 1, 8, 3), (32, 512, 1, 4, 3), (64, 128, 1, 4, 4), (128, 512, 1, 8, 2), (64, 256, 4, 4, 3)]


def sweep(max_configs: int, dot: bool = False):
    from kiln.ops.triton_quant_gemm import GemmConfig

    for bn, bk, nw, stages in SWEEP[:max_configs]:
        yield GemmConfig(1, bn, bk, 1, num_warps=nw, num_stages=stages)
    for bn, bk, split, nw, stages in DOT_SWEEP if dot else ():
        yield GemmConfig(16, bn, bk, split, num_warps=nw, num_stages=stages)


def config_list(cfg) -> list:
    """A configuration as JSON: [block_n, block_k, warps, stages] for a one-program GEMV tile (the
    form decode_profile.py --int4-configs also reads), else every GemmConfig field in order."""
    if cfg.block_m == 1 and cfg.split_k == 1:
        return [cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages]
    return [cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps, cfg.num_stages]


def config_of(entry: list):
    from kiln.ops.triton_quant_gemm import GemmConfig

    if len(entry) == 4:
        bn, bk, nw, ns = entry
        return GemmConfig(1, bn, bk, 1, num_warps=nw, num_stages=ns)
    return GemmConfig(*entry)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def check(linear, n: int, k: int, group: int, cfg, gen) -> float:
    """Relative error of one call against the reference on fresh random weights and row."""
    from kiln.ops import quant

    w = torch.randn(n, k, generator=gen, device=DEVICE) * 0.02
    q4, sz4 = quant.quantize_int4(w, group, torch.bfloat16)
    x = torch.randn(1, k, generator=gen, device=DEVICE).to(torch.bfloat16)
    want = x.float() @ quant.dequant_int4_reference(q4, sz4, group, torch.float32).T
    return rel_err(linear("int4", x, q4, sz4, group, config=cfg), want)


def time_shapes(base, args, bandwidth: float, t0: float):
    from kiln.ops import quant
    from kiln.ops.triton_quant_gemm import config_for, triton_linear

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    records, best = [], {}
    for name in args.shapes.split(","):
        n, k = SHAPE_SET[name]
        w = torch.randn(n, k, generator=gen, device=DEVICE) * 0.02
        q4, sz4 = quant.quantize_int4(w, GROUP, torch.bfloat16)
        copies = max(2, -(-(200 << 20) // (n * k // 2))) if DEVICE == "cuda" else 2
        weights = [(q4.clone(), sz4.clone()) for _ in range(copies)]
        x = torch.randn(1, k, generator=gen, device=DEVICE).to(torch.bfloat16)
        want = x.float() @ quant.dequant_int4_reference(q4, sz4, GROUP, torch.float32).T
        nbytes = n * k // 2 + (k // GROUP) * n * 4

        def add(system, linear, cfg):
            got = linear("int4", x, q4, sz4, GROUP, config=cfg)
            err = rel_err(got, want)
            sec = time_call(lambda i: linear("int4", x, *weights[i], GROUP, config=cfg), copies)
            rec = {"shape": name, "n": n, "k": k, "system": system, "us": sec * 1e6,
                   "copy_bw_pct": 100 * nbytes / sec / bandwidth, "rel_err": err,
                   "config": config_list(cfg)}
            records.append(rec)
            return rec

        b = add("baseline", base.triton_linear, base.config_for("int4", 1, n, k, GROUP))
        print(f"{name}: baseline {b['us']:.2f} us {b['copy_bw_pct']:.0f}% err {b['rel_err']:.2e}", flush=True)
        tol = max(2 * b["rel_err"], 1e-3)
        results = []
        configs = [config_for("int4", 1, n, k, GROUP)] + list(sweep(args.max_configs, args.dot))
        for cfg in dict.fromkeys(configs):
            if time.perf_counter() - t0 > args.deadline_s:
                print(f"deadline: {name} {cfg} not run", flush=True)
                break
            try:
                rec = add("new", triton_linear, cfg)
            except Exception as e:  # a tile that does not compile or fit is skipped
                print(f"{name} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            if not rec["rel_err"] < tol:
                rec["system"] = "WRONG"
                print(f"{name} {cfg}: WRONG, relative error {rec['rel_err']:.3g}", flush=True)
                continue
            results.append(rec)
            print(f"{name} {rec['config']}: {rec['us']:.2f} us {rec['copy_bw_pct']:.0f}%", flush=True)
        if results:
            top = min(results, key=lambda r: r["us"])
            top["system"] = "new (best)"
            best[name] = top["config"]
        torch.cuda.empty_cache()
    return records, best


def check_groups(best: dict, gen) -> list[dict]:
    """The best configurations at groups 64 and 128, and with K not a multiple of the tile."""
    from kiln.ops.triton_quant_gemm import triton_linear

    out = []
    for name, entry in best.items():
        n, k = SHAPE_SET[name]
        cfg = config_of(entry)
        bk = cfg.block_k
        for group in (g for g in (64, 128) if k % g == 0 and bk % g == 0):
            out.append({"shape": name, "group": group, "k": k, "config": entry,
                        "rel_err": check(triton_linear, n, k, group, cfg, gen)})
        odd_k = k - bk // 2 if k - bk // 2 > 0 else k + bk // 2
        out.append({"shape": name, "group": 32, "k": odd_k, "config": entry,
                    "rel_err": check(triton_linear, n, odd_k, 32, cfg, gen)})
    for rec in out:
        print(f"check {rec}", flush=True)
    return out


def layer_chain(base, best: dict, num_layers: int) -> list[dict]:
    """us per layer of norm, qkv, o, norm, gate_up, silu_and_mul, down over ``num_layers`` layers of
    distinct weights, one CUDA graph, PDL as served: the baseline's GEMVs, this tree's (MEASURED),
    this tree's with the sweep's best per shape."""
    from kiln.ops import quant
    from kiln.ops.triton_norm import triton_add_rms_norm, triton_silu_and_mul
    from kiln.ops.triton_quant_gemm import config_for, triton_linear

    gen = torch.Generator(device=DEVICE).manual_seed(1)
    hidden = SHAPE_SET["o"][0]
    layers = []
    for _ in range(num_layers):
        layer = {}
        for name in ("qkv", "o", "gate_up", "down"):
            n, k = SHAPE_SET[name]
            w = torch.randn(n, k, generator=gen, device=DEVICE) * 0.02
            layer[name] = quant.quantize_int4(w, GROUP, torch.bfloat16)
            del w
        layer["norm"] = torch.ones(hidden, device=DEVICE, dtype=torch.bfloat16)
        layers.append(layer)
    x0 = torch.randn(1, hidden, generator=gen, device=DEVICE).to(torch.bfloat16)

    def chain(linear, cfgs):
        h, res = x0, torch.zeros_like(x0)
        for layer in layers:
            normed, res = triton_add_rms_norm(h, res, layer["norm"], 1e-5)
            qkv = linear("int4", normed, *layer["qkv"], GROUP, config=cfgs["qkv"])
            o = linear("int4", qkv[:, :hidden].contiguous(), *layer["o"], GROUP, config=cfgs["o"])
            normed, res = triton_add_rms_norm(o, res, layer["norm"], 1e-5)
            gu = linear("int4", normed, *layer["gate_up"], GROUP, config=cfgs["gate_up"])
            h = linear("int4", triton_silu_and_mul(gu), *layer["down"], GROUP, config=cfgs["down"])
        return h

    systems = {
        "baseline": (base.triton_linear, {s: base.config_for("int4", 1, *SHAPE_SET[s], GROUP) for s in SHAPE_SET}),
        "new MEASURED": (triton_linear, {s: config_for("int4", 1, *SHAPE_SET[s], GROUP) for s in SHAPE_SET}),
    }
    if best:
        cfgs = {s: config_for("int4", 1, *SHAPE_SET[s], GROUP) for s in SHAPE_SET}
        cfgs.update({s: config_of(entry) for s, entry in best.items()})
        systems["new best"] = (triton_linear, cfgs)
    out, ref = [], None
    for label, (linear, cfgs) in systems.items():
        y = chain(linear, cfgs).float()
        ref = y if ref is None else ref
        sec = time_call(lambda i: chain(linear, cfgs), 1, reps=5)
        out.append({"system": label, "us_per_layer": sec * 1e6 / num_layers, "rel_err_vs_baseline": rel_err(y, ref),
                    "configs": {s: config_list(c) for s, c in cfgs.items()}})
        print(f"chain {label}: {out[-1]['us_per_layer']:.2f} us/layer", flush=True)
    return out


def main(argv=None) -> None:
    global GROUP
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline-root", required=True, help="a kiln tree whose int4 GEMV is the baseline")
    p.add_argument("--shapes", default="qkv,o,gate_up,down")
    p.add_argument("--chain-layers", type=int, default=8)
    p.add_argument("--deadline-s", type=float, default=200.0, help="stop sweeping after this many seconds")
    p.add_argument("--max-configs", type=int, default=len(SWEEP))
    p.add_argument("--group", type=int, default=GROUP, help="int4 group size of the timed weights")
    p.add_argument("--dot", action="store_true", help="also sweep the tensor-core kernel at one row (DOT_SWEEP)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (a dry run, e.g. in the Triton interpreter)")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    GROUP = args.group
    if args.tiny:
        SHAPE_SET.clear()
        SHAPE_SET.update(TINY_SHAPES)
    t0 = time.perf_counter()
    base = load_baseline(args.baseline_root)
    bandwidth = copy_bandwidth()
    records, best = time_shapes(base, args, bandwidth, t0)
    checks = check_groups(best, torch.Generator(device=DEVICE).manual_seed(2))
    chain = layer_chain(base, best, args.chain_layers)
    rows = [[r["shape"], r["system"], str(r["config"]), r["us"], r["copy_bw_pct"], r["rel_err"]]
            for r in records if r["system"] != "new"]
    print(console_table(["shape", "system", "config", "us", "% copy bw", "rel err"], rows))
    print(console_table(["chain", "us/layer", "rel err vs baseline"],
                        [[c["system"], c["us_per_layer"], c["rel_err_vs_baseline"]] for c in chain]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": device_name(), "torch": torch.__version__, "copy_bandwidth_gb_s": bandwidth / 1e9,
            "group_size": GROUP}
    # For an end-to-end run (decode_profile.py --int4-configs): the faster chain of this tree's two.
    fastest = min((c for c in chain if c["system"] != "baseline"), key=lambda c: c["us_per_layer"])
    (out / "int4_gemv_shapes.json").write_text(json.dumps(
        {"meta": meta, "records": records, "best": best, "checks": checks, "chain": chain,
         "e2e": fastest["configs"], "e2e_from": fastest["system"]}, indent=1))


if __name__ == "__main__":
    main()
