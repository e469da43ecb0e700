"""What does one call of a kiln op cost on the host, by the way the op is registered?

The same kernel behind three doors, called in a loop (inference mode, as kiln's runner calls them):

- ``direct``: the Python kernel itself, no dispatcher;
- ``library``: an op registered with ``torch.library.Library`` define + impl (``kiln.ops.library``);
- ``custom_op``: the same op through ``torch.library.custom_op``.

Each door is timed on a no-op kernel (one ``new_empty``: the door's own cost) and on kiln's Triton
RMSNorm kernel on a [4, 4096] row block (what a decode step pays per norm), eagerly and while
capturing a CUDA graph (what start-up pays per call). ``triton launch`` is the Triton kernel launched
bare (``kernel[grid](...)``), ``torch.mm`` a cuBLAS launch of the same size, for scale.

    python -m benchmarks.decode op-dispatch [--calls 2000] [--out DIR]

Prints microseconds per call (median of 5 rounds) and writes ``op_dispatch.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def _per_call_us(fn, calls: int, rounds: int = 5) -> float:
    fn()  # first call: compile, allocate
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return statistics.median(times)


def _captured_per_call_us(fn, calls: int) -> float:
    """Host time per call while a CUDA graph records ``calls`` calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        seconds = time.perf_counter() - t0
    del graph
    return seconds / calls * 1e6


def _doors(name: str, kernel, fake):
    """(direct, library op, custom_op op) of ``kernel``."""
    from kiln.ops.library import define_op

    lib_op = define_op(f"kiln_bench_lib::{name}", kernel, fake)
    custom = torch.library.custom_op(f"kiln_bench_custom::{name}", kernel, mutates_args=())
    custom.register_fake(fake)
    return {"direct": kernel, "library": lib_op, "custom_op": custom}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def noop(x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape)

    x = torch.randn(4, 4096, device=device, dtype=torch.bfloat16)
    res, w = torch.randn_like(x), torch.randn(4096, device=device, dtype=torch.bfloat16)
    rows = []
    with torch.inference_mode():
        for door, op in _doors("noop", noop, lambda x: x.new_empty(x.shape)).items():
            rows.append(("no-op", door, _per_call_us(lambda: op(x), args.calls), None))
        if device == "cuda":
            from kiln.ops import triton_norm

            def norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
                return triton_norm.triton_add_rms_norm(x, residual, weight, eps)

            def norm_fake(x, residual, weight, eps):
                return x.new_empty(x.shape), x.new_empty(x.shape)

            for door, op in _doors("add_rms_norm", norm, norm_fake).items():
                eager = _per_call_us(lambda: op(x, res, w, 1e-5), args.calls)
                captured = _captured_per_call_us(lambda: op(x, res, w, 1e-5), min(args.calls, 500))
                rows.append(("add_rms_norm", door, eager, captured))
            out, new_res = torch.empty_like(x), torch.empty_like(x)

            def launch():
                triton_norm._add_rms_norm_kernel[(4,)](x, res, w, out, new_res, 4096, 1e-5, 4096, 4096, 4096, 4096,
                                                       BLOCK=4096, num_warps=8)

            rows.append(("add_rms_norm", "triton launch", _per_call_us(launch, args.calls),
                         _captured_per_call_us(launch, min(args.calls, 500))))
            b = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
            rows.append(("mm [4,4096]x[4096,4096]", "torch.mm", _per_call_us(lambda: torch.mm(x, b), args.calls),
                         _captured_per_call_us(lambda: torch.mm(x, b), min(args.calls, 500))))
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"host us per call on {name} (median of 5 rounds of {args.calls} calls)")
    print(f"{'kernel':<26} {'door':<14} {'eager':>8} {'capturing':>10}")
    for kernel, door, eager, captured in rows:
        print(f"{kernel:<26} {door:<14} {eager:8.1f} {'' if captured is None else f'{captured:10.1f}'}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "op_dispatch.json").write_text(json.dumps(
            {"device": name, "torch": torch.__version__, "calls": args.calls,
             "rows": [{"kernel": k, "door": d, "eager_us": e, "capturing_us": c} for k, d, e, c in rows]}, indent=1))


if __name__ == "__main__":
    main()
