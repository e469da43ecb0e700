"""Two kiln trees' CPU start-up, side by side: ``LLM()`` on the embedded model, then one token.

Each round starts a fresh process per tree (alternating which goes first), with the converted
model and compile cache as the usual cache dir holds them (run ``kiln generate`` once first), so
it times a restart: imports, the engine's start-up phases (``ModelRunner.startup_seconds``) and
the first token. With ``--first`` every start gets an empty cache dir instead: a first start on a
new machine, which converts the embedded GGUF. Medians over the rounds; the baseline is measured in
the same run.

    python benchmarks/startup_cpu_ab.py --base /tmp/base --rounds 8 --out benchmarks/results

where ``/tmp/base`` holds the baseline's ``kiln`` package (e.g. ``git archive REV kiln | tar -x -C
/tmp/base``, plus a built ``kiln/_C*.so``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import console_table  # noqa: E402
from kiln.bench.report import cpu_model  # noqa: E402

CHILD = r'''
import json, time
t0 = time.time()
from kiln import LLM, SamplingParams
t1 = time.time()
llm = LLM()
t2 = time.time()
llm.generate(["Hello, my name is"], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
t3 = time.time()
phases = llm.engine.executor.runner.startup_seconds
print("RESULT " + json.dumps({"import_s": t1 - t0, "ready_s": t2 - t1, "first_token_s": t3 - t2, **phases}))
'''
COLUMNS = ("total_s", "import_s", "ready_s", "first_token_s", "load_weights_s", "kv_alloc_s", "tokenizer_wait_s")


def one_start(tree: str, first: bool = False) -> dict:
    """One start of ``tree``'s kiln in a fresh process; ``first``: from an empty cache dir (the
    embedded model converted from its GGUF, as on a new machine)."""
    env = {**os.environ, "PYTHONPATH": tree}
    with tempfile.TemporaryDirectory(prefix="kiln-first-start-") as empty:
        if first:
            env["KILN_CACHE_DIR"] = empty
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, cwd="/")
        total_s = time.time() - t0
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"a start of {tree} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {**json.loads(lines[-1][len("RESULT "):]), "total_s": total_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--this", default=str(REPO), help="the tree measured (default: this one)")
    parser.add_argument("--base", required=True, help="the baseline tree (a directory holding kiln/)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--first", action="store_true",
                        help="every start from an empty cache dir: a first start, converting the embedded GGUF")
    parser.add_argument("--out", type=Path, help="write startup_cpu_ab[-first]-<cpu>.json there")
    args = parser.parse_args()
    trees = {"base": args.base, "this": args.this}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for name in order:
            runs[name].append(one_start(trees[name], args.first))
    medians = {name: {c: statistics.median(run[c] for run in rs) for c in COLUMNS} for name, rs in runs.items()}
    print(f"{cpu_model()}, {args.rounds} rounds{', first starts' if args.first else ''}, medians in seconds")
    print(console_table(["tree", *COLUMNS], [[name, *(m[c] for c in COLUMNS)] for name, m in medians.items()]))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        slug = "-".join(cpu_model().lower().split()[:2]) or "cpu"
        path = args.out / f"startup_cpu_ab{'-first' if args.first else ''}-{slug}.json"
        path.write_text(json.dumps({"cpu": cpu_model(), "rounds": args.rounds, "first": args.first, "trees": trees,
                                    "medians": medians, "runs": runs}, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
