"""The CPU default, kiln built in the background, against eager and kiln built before serving.

Each system starts in a fresh process, with a fresh compile cache ("cold") or the one its cold start
filled ("warm"), and then decodes one request at a time (batch 1, ``--new`` tokens each, greedy) for
``--seconds``. Every request is logged with its end time since the process started, its tok/s and
which forward ran it (``eager`` or ``kiln``). Per start: ready (process start to ``LLM`` built), the
time kiln's forward took over (background build only), and the median tok/s of the requests run
eagerly and of those run by kiln's forward::

    python -m benchmarks.startup background-build                      # SmolLM2, fp32, this machine's threads
    python -m benchmarks.startup background-build --systems auto,eager --seconds 60

Systems: ``auto`` (no compile options: on the CPU kiln, a background build (``compile.startup=auto``), cut at every
10th attention call), ``eager`` (``compile.mode=eager``), ``kiln`` (``compile.mode=kiln``, built before
ready), and ``auto-split1`` / ``kiln-split1``: the same cut at every attention call
(``compile.split_every=1``). Each system has its own cache dir and Inductor cache dir, empty for
its cold start. The converted model is shared from the usual cache dir (converted there first if
missing), so no start pays for a conversion. Writes ``background_build-<model>.{json,md}`` into
``$OUT``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path


from benchmarks.common import child_command, child_env, console_table, out_dir
from kiln.bench.report import device_name

SYSTEMS = {"auto": {}, "eager": {"mode": "eager"}, "kiln": {"mode": "kiln"},
           "auto-split1": {"split_every": 1}, "kiln-split1": {"mode": "kiln", "split_every": 1}}


def child(opts: dict) -> None:
    t_process = opts["t_process"]
    from kiln import LLM, SamplingParams
    from kiln.compiler import KilnForward

    llm = LLM(model=opts["model"], compile=SYSTEMS[opts["system"]], cache={"dir": opts["cache_dir"]})
    ready = time.time() - t_process
    compiled = llm.engine.executor.runner.compiled
    params = SamplingParams(max_tokens=opts["new"], temperature=0.0, ignore_eos=True)
    prompt = [[1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 198]]
    rows, switched = [], None
    deadline = time.time() + opts["seconds"]
    while time.time() < deadline:
        t0 = time.time()
        out = llm.generate(prompt, params, use_tqdm=False)
        end = time.time()
        kind = "kiln" if isinstance(compiled.forward, KilnForward) else "eager"
        if kind == "kiln" and switched is None and compiled.config.build == "background":
            switched = t0 - t_process  # the request that ran kiln's forward first started here
        rows.append({"end_s": end - t_process, "tok_s": len(out[0].outputs[0].token_ids) / (end - t0),
                     "forward": kind})
    print("RESULT " + json.dumps({"ready_s": ready, "switch_s": switched, "rows": rows,
                                  "build": compiled.config.build}), flush=True)


def start(system: str, run: str, cache_dir: str, args) -> dict:
    opts = {"system": system, "model": args.model, "cache_dir": cache_dir, "new": args.new,
            "seconds": args.seconds, "t_process": time.time()}
    env = child_env({**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(cache_dir, "inductor"))})
    out = subprocess.run(child_command("benchmarks.startup.background_build", "--child", json.dumps(opts)),
                         capture_output=True, text=True, env=env)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{system} {run} failed:\n{out.stderr[-3000:]}")
    result = json.loads(line[len("RESULT "):])
    eager = [r["tok_s"] for r in result["rows"] if r["forward"] == "eager"]
    kiln = [r["tok_s"] for r in result["rows"] if r["forward"] == "kiln"]
    return {"system": system, "start": run, "ready_s": result["ready_s"], "kiln_from_s": result["switch_s"],
            "eager_tok_s": statistics.median(eager) if eager else None,
            "kiln_tok_s": statistics.median(kiln) if kiln else None,
            "requests": len(result["rows"]), "rows": result["rows"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--systems", default="auto,eager,kiln")
    ap.add_argument("--seconds", type=float, default=90.0, help="decoding after ready, per start")
    ap.add_argument("--new", type=int, default=32, help="new tokens per request")
    ap.add_argument("--label", default="", help="appended to the result files' names")
    ap.add_argument("--child")
    args = ap.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return
    from kiln.config import default_cache_dir

    shared = Path(default_cache_dir()) / "models"
    if not shared.is_dir() or not any(shared.iterdir()):  # convert once, outside the timed starts
        from kiln import LLM

        LLM(model=args.model, compile={"mode": "eager"})
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for system in args.systems.split(","):
            cache_dir = Path(scratch, system)
            cache_dir.mkdir()
            (cache_dir / "models").symlink_to(shared, target_is_directory=True)
            for run in ("cold", "warm"):
                results.append(start(system, run, str(cache_dir), args))
                r = results[-1]
                print(f"{system} {run}: ready {r['ready_s']:.1f} s, kiln from {r['kiln_from_s']}, "
                      f"eager {r['eager_tok_s']}, kiln {r['kiln_tok_s']} tok/s", flush=True)
    header = ["system", "start", "ready (s)", "kiln's forward from (s)", "eager tok/s", "kiln tok/s", "requests"]
    table = [[r["system"], r["start"], f"{r['ready_s']:.1f}",
              "" if r["kiln_from_s"] is None else f"{r['kiln_from_s']:.1f}",
              "" if r["eager_tok_s"] is None else f"{r['eager_tok_s']:.1f}",
              "" if r["kiln_tok_s"] is None else f"{r['kiln_tok_s']:.1f}", str(r["requests"])] for r in results]
    print(console_table(header, table))
    text = "\n".join("| " + " | ".join(row) + " |" for row in [header, ["---"] * len(header), *table])
    label = f"-{args.label}" if args.label else ""
    out = out_dir() / f"background_build-{args.model.replace(':', '_')}{label}"
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    out.with_suffix(".md").write_text(
        f"# Background build on the CPU: {args.model}, batch 1, {args.new} new tokens a request\n\n"
        f"`python -m benchmarks.startup background-build --systems {args.systems} --seconds {args.seconds:g}`, "
        f"{os.cpu_count()} CPUs ({device_name()}). Seconds since the process started; tok/s medians per forward.\n\n"
        + text + "\n\nEvery request: `background_build-*.json` (rows).\n")


if __name__ == "__main__":
    main()
