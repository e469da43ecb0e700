"""Tensor parallelism on the CPU (gloo): sharding on load, the all-reduce op in the graph, the
multiprocess executor against the single-process engine, and its failure modes."""

import dataclasses
import os
import signal
import socket
import time

import pytest
import torch
import torch.distributed as dist

from kiln import LLM, SamplingParams
from kiln.models.arch import PRESETS
from kiln.models.loader import build_empty_model, init_random_weights
from kiln.models.parallel import TensorParallel, check_tensor_parallel
from kiln.ops.collective import all_reduce_reference

PROMPTS = ["Hello there", "The capital of France is", list(range(100, 140)), "1, 2, 3"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3)
MP2 = {"tensor_parallel_size": 2, "backend": "mp"}


def _generate(llm):
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0] for o in outs]


# ---- sharding (no processes) -------------------------------------------------------------------
@pytest.mark.parametrize("preset,size", [("tiny", 2), ("tiny-qwen2", 2), ("tiny", 4)])
def test_rank_shards_reassemble_the_full_weights(preset, size):
    """Every rank loads only its slice; the slices put back together are the single-device weights
    (q heads and gate/up rows by rank, o/down columns by rank, KV heads split or replicated)."""
    arch = PRESETS[preset]
    full = build_empty_model(arch, torch.device("cpu"), torch.float32)
    init_random_weights(full, seed=0)
    ranks = []
    for rank in range(size):
        shard = build_empty_model(arch, torch.device("cpu"), torch.float32, TensorParallel(rank, size))
        shard.load_weights(full._weight_targets())
        ranks.append(shard)
    d, kvh = arch.head_dim, arch.num_kv_heads
    for layer in range(arch.num_layers):
        attn = [r.layers[layer].self_attn for r in ranks]
        mlp = [r.layers[layer].mlp for r in ranks]
        f_attn, f_mlp = full.layers[layer].self_attn, full.layers[layer].mlp
        q = torch.cat([a.qkv_proj.weight[: a.q_size] for a in attn])
        assert torch.equal(q, f_attn.qkv_proj.weight[: f_attn.q_size])
        k_full = f_attn.qkv_proj.weight[f_attn.q_size: f_attn.q_size + f_attn.kv_size]
        for rank, a in enumerate(attn):
            head = rank * kvh // size  # split: contiguous ranges; replicated: shared heads
            assert torch.equal(a.qkv_proj.weight[a.q_size: a.q_size + a.kv_size],
                               k_full[head * d: head * d + a.kv_size])
            if a.qkv_proj.bias is not None:
                assert a.qkv_proj.bias.shape[0] == a.q_size + 2 * a.kv_size
        assert torch.equal(torch.cat([a.o_proj.weight for a in attn], dim=1), f_attn.o_proj.weight)
        assert torch.equal(torch.cat([m.down_proj.weight for m in mlp], dim=1), f_mlp.down_proj.weight)
        gate = torch.cat([m.gate_up_proj.weight.chunk(2)[0] for m in mlp])
        assert torch.equal(gate, f_mlp.gate_up_proj.weight.chunk(2)[0])
    if size > kvh:
        assert all(r.layers[0].self_attn.num_kv_heads == 1 for r in ranks)


def test_uneven_heads_are_a_clear_error():
    smollm2 = dataclasses.replace(PRESETS["tiny"], num_heads=9, num_kv_heads=3, hidden_size=576, head_dim=64,
                                  intermediate_size=1536)  # SmolLM2-135M's heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide .*num_heads=9"):
        check_tensor_parallel(smollm2, 2)
    check_tensor_parallel(smollm2, 3)  # 9 heads, 3 KV heads: fine
    with pytest.raises(ValueError, match="num_kv_heads=2"):
        check_tensor_parallel(dataclasses.replace(PRESETS["tiny"], num_heads=12, num_kv_heads=2), 3)


# ---- the all-reduce op --------------------------------------------------------------------------
@pytest.fixture
def one_rank_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_all_reduce_is_one_graph_node(one_rank_group):
    """The row-parallel MLP compiles as one graph (no break) that calls torch.ops.kiln.all_reduce."""
    from kiln.models.llama import LlamaMLP

    mlp = LlamaMLP(PRESETS["tiny"], TensorParallel(0, 2))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    x = torch.randn(5, PRESETS["tiny"].hidden_size)
    torch._dynamo.reset()
    out = torch.compile(mlp, backend=backend, fullgraph=True)(x)
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    op = torch.ops.kiln.all_reduce
    assert sum(t in (op, op.default) for t in targets) == 1
    torch.testing.assert_close(out, all_reduce_reference([mlp(x)]))  # one rank: the sum is the input


# ---- the multiprocess executor ------------------------------------------------------------------
# Each TP=2 engine spawns two processes that import torch and kiln (tens of seconds on a busy CPU):
# one engine per preset, shared by the module; the last test kills a rank of the qwen2 engine.
@pytest.fixture(scope="module")
def tp2_engines(kiln_cache_dir):
    engines = {}

    def get(preset):
        if preset not in engines:
            engines[preset] = LLM(f"random:{preset}", compile={"mode": "eager"}, cache={"dir": kiln_cache_dir},
                                  parallel=MP2)
        return engines[preset]

    yield get
    for llm in engines.values():
        procs = list(llm.engine.executor.procs)
        llm.engine.shutdown()
        assert not any(p.is_alive() for p in procs)  # shutdown leaves no process behind


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2"])
def test_tp2_matches_tp1(preset, tp2_engines, kiln_cache_dir):
    single = _generate(LLM(f"random:{preset}", compile={"mode": "eager"}, cache={"dir": kiln_cache_dir}))
    sharded = _generate(tp2_engines(preset))
    assert [o.token_ids for o in sharded] == [o.token_ids for o in single]
    for a, b in zip(sharded, single):
        for lp_a, lp_b in zip(a.logprobs, b.logprobs):
            assert lp_a.keys() == lp_b.keys()
            keys = sorted(lp_b)
            torch.testing.assert_close(torch.tensor([lp_a[k] for k in keys]), torch.tensor([lp_b[k] for k in keys]),
                                       atol=1e-4, rtol=1e-4)


def test_backends_that_cannot_run_say_why(kiln_cache_dir):
    cache = {"dir": kiln_cache_dir}
    with pytest.raises(ValueError, match="needs parallel.backend=mp"):
        LLM("random:tiny", cache=cache, parallel={"tensor_parallel_size": 2, "backend": "uni"})
    try:
        import ray  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="needs the package 'ray'"):
            LLM("random:tiny", cache=cache, parallel={"tensor_parallel_size": 2, "backend": "ray"})


def test_a_killed_rank_fails_the_engine_fast(tp2_engines):
    llm = tp2_engines("tiny-qwen2")
    procs = list(llm.engine.executor.procs)
    os.kill(procs[1].pid, signal.SIGKILL)
    procs[1].join(10)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) died with exit code -9"):
        llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)
    assert time.monotonic() - t0 < 15
    assert not any(p.is_alive() for p in procs)  # the surviving rank is stopped too
    with pytest.raises(RuntimeError, match="has failed"):
        llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)


def test_a_hung_rank_fails_the_engine_after_the_step_timeout(tp2_engines):
    llm = tp2_engines("tiny")
    executor = llm.engine.executor
    procs = list(executor.procs)
    executor.step_timeout_s = 2.0
    os.kill(procs[1].pid, signal.SIGSTOP)  # alive but silent, as in a deadlock
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[(0, )?1\] gave no answer within 2 s"):
        llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)
    assert time.monotonic() - t0 < 15
    assert not any(p.is_alive() for p in procs)
