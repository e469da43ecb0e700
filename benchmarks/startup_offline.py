"""Offline throughput right after start-up, for one compile.startup policy (one process per run).

    python benchmarks/startup_offline.py complete     # then: auto, in a fresh process

Builds ``LLM(random:llama3-8b)`` with the policy, runs 512 greedy requests of 256 prompt and 256
new tokens twice, and prints the output tok/s of each run and the ready line's seconds from launch.
Run the policies alternately in one device call; the first process compiles (a cold start).
"""
import json, sys, time
from kiln import LLM, SamplingParams
policy = sys.argv[1]
llm = LLM(model="random:llama3-8b", compile={"startup": policy})
prompts = [[(i * 7919 + j * 31) % 120000 + 100 for j in range(256)] for i in range(512)]
p = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
rates = []
for _ in range(2):
    t0 = time.perf_counter()
    outs = llm.generate(prompts, p, use_tqdm=False)
    rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0))
print("RESULT", json.dumps({"startup": policy, "first_tok_s": rates[0], "second_tok_s": rates[1],
                            "ready_s": llm.engine.startup.since_launch_s}), flush=True)
