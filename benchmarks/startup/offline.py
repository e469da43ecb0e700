"""Offline throughput right after start-up, for one compile.startup policy (one process per run).

    python -m benchmarks.startup offline --startup complete     # then: auto, in a fresh process

Builds ``LLM(random:llama3-8b)`` with the policy, runs 512 greedy requests of 256 prompt and 256
new tokens twice, and prints the output tok/s of each run and the ready line's seconds from launch
(also written to ``startup_offline-<policy>.json``). Run the policies alternately in one device
call; the first process compiles (a cold start).
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks.common import out_dir


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--startup", default="complete", help="compile.startup: auto, complete or fast")
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument("--num-requests", type=int, default=512)
    p.add_argument("--len", type=int, default=256, help="prompt and output tokens of each request")
    p.add_argument("--out", default=str(out_dir()))
    args = p.parse_args(argv)

    from kiln import LLM, SamplingParams

    llm = LLM(model=args.model, compile={"startup": args.startup})
    prompts = [[(i * 7919 + j * 31) % 120000 + 100 for j in range(args.len)] for i in range(args.num_requests)]
    params = SamplingParams(max_tokens=args.len, temperature=0.0, ignore_eos=True)
    rates = []
    for _ in range(2):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0))
    result = {"startup": args.startup, "first_tok_s": rates[0], "second_tok_s": rates[1],
              "ready_s": llm.engine.startup.since_launch_s}
    print("RESULT", json.dumps(result), flush=True)
    with open(f"{args.out}/startup_offline-{args.startup}.json", "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
