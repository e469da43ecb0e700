"""Tensor parallelism on the CPU (gloo): sharding on load (random weights included), the
collective ops against their references and in the graph, the multiprocess executor against the
single-process engine (tied and untied heads, a vocabulary that pads), and its failure modes."""

import dataclasses
import json
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from kiln import LLM, SamplingParams
from kiln.models.arch import PRESETS, ArchConfig
from kiln.models.loader import build_empty_model, init_random_weights, iter_random_weights
from kiln.models.parallel import TensorParallel, check_tensor_parallel, vocab_range
from kiln.ops.collective import all_gather_reference, all_reduce_reference
from kiln.runtime.worker import free_port
from tests.helpers.parallel import assert_same_completions

PROMPTS = ["Hello there", "The capital of France is", list(range(100, 140)), "1, 2, 3"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3)
MP2 = {"tensor_parallel_size": 2, "backend": "mp"}
# Untied LM head, and a vocabulary (one past the borrowed tokenizer's 49152) that no even size divides.
ODD_VOCAB = dataclasses.replace(PRESETS["tiny"], vocab_size=49153, tie_word_embeddings=False)
# Phi-3 stores q/k/v and gate/up fused: each rank cuts its heads and rows out of the fused tensors.
FUSED = dataclasses.replace(PRESETS["tiny"], family="phi3", tie_word_embeddings=False)
ARCHS = {**PRESETS, "tiny-odd-vocab": ODD_VOCAB, "tiny-phi3": FUSED}


def _generate(llm):
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0] for o in outs]


# ---- sharding (no processes) -------------------------------------------------------------------
@pytest.mark.parametrize("source", ["checkpoint", "random"])
def test_moe_experts_shard_along_their_intermediate_dimension(source):
    """Each rank holds every expert's gate/up rows and down columns of its range (the shared
    expert's too) and the whole router: the slices of the very weights TP=1 holds."""
    from tests.helpers.hf import moe_hf_configs

    arch = ArchConfig.from_hf_config(moe_hf_configs()["qwen2_moe"].to_dict())
    full = build_empty_model(arch, torch.device("cpu"), torch.float32)
    init_random_weights(full, seed=0)
    whole = full.layers[0].mlp
    width = whole.w2.shape[-1]
    for rank in range(2):
        model = build_empty_model(arch, torch.device("cpu"), torch.float32, TensorParallel(rank, 2))
        if source == "random":
            init_random_weights(model, seed=0)
        else:
            model.load_weights(full.weight_targets())
        mine = model.layers[0].mlp
        n = mine.w2.shape[-1]
        assert n * 2 == width
        cols = slice(rank * n, (rank + 1) * n)
        assert torch.equal(mine.w13[:, :n], whole.w13[:, :width][:, cols])
        assert torch.equal(mine.w13[:, n:], whole.w13[:, width:][:, cols])
        assert torch.equal(mine.w2, whole.w2[:, :, cols])
        shared = whole.shared_expert.down_proj.weight
        k = mine.shared_expert.down_proj.in_features
        assert torch.equal(mine.shared_expert.down_proj.weight, shared[:, rank * k:(rank + 1) * k])
        assert torch.equal(mine.gate.weight, whole.gate.weight)


@pytest.mark.parametrize("preset,size,source", [
    ("tiny", 2, "checkpoint"), ("tiny-qwen2", 2, "checkpoint"), ("tiny", 4, "checkpoint"),
    ("tiny-odd-vocab", 2, "checkpoint"), ("tiny-odd-vocab", 4, "checkpoint"),
    ("tiny", 2, "random"), ("tiny-qwen2", 2, "random"), ("tiny", 4, "random"), ("tiny-odd-vocab", 2, "random"),
    ("tiny-phi3", 2, "checkpoint"), ("tiny-phi3", 4, "checkpoint"), ("tiny-phi3", 4, "random"),
])
def test_rank_shards_reassemble_the_full_weights(preset, size, source):
    """Every rank loads only its slice; the slices put back together are the single-device weights
    (q heads and gate/up rows by rank, o/down columns by rank, KV heads split or replicated).
    ``random``: each rank draws its own shard from the per-tensor seeded generators, never the
    whole model, and still holds a slice of the very model TP=1 draws. Embedding and LM head rows
    split by vocabulary range, padded with zero rows up to a multiple of ``size``."""
    arch = ARCHS[preset]
    full = build_empty_model(arch, torch.device("cpu"), torch.float32)
    init_random_weights(full, seed=0)
    ranks = []
    for rank in range(size):
        shard = build_empty_model(arch, torch.device("cpu"), torch.float32, TensorParallel(rank, size))
        if source == "random":
            init_random_weights(shard, seed=0)
        else:
            shard.load_weights(full.weight_targets())
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
    vocab, (_, num_rows) = arch.vocab_size, vocab_range(arch, TensorParallel(0, size))
    for name in ["embed_tokens"] + ([] if arch.tie_word_embeddings else ["lm_head"]):
        rows = torch.cat([getattr(r, name).weight for r in ranks])  # [num_rows * size, hidden]
        assert rows.shape[0] == num_rows * size >= vocab
        assert torch.equal(rows[:vocab], getattr(full, name).weight) and not rows[vocab:].any()
    assert all(torch.equal(r.norm.weight, full.norm.weight) for r in ranks)


def test_random_weights_are_seeded_per_tensor():
    """A tensor depends on (seed, its name) only: not on the order or on which others are drawn."""
    arch = PRESETS["tiny"]
    one_layer = dataclasses.replace(arch, num_layers=1)
    draws = {}
    for key, a, seed in (("full", arch, 0), ("one layer", one_layer, 0), ("seed 1", arch, 1)):
        draws[key] = dict(iter_random_weights(a, seed, torch.device("cpu"), torch.float32))
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(draws["full"][name], draws["one layer"][name])
    assert not torch.equal(draws["full"][name], draws["seed 1"][name])
    assert not torch.equal(draws["full"][name].flatten()[:64],
                           draws["full"]["model.layers.1.mlp.down_proj.weight"].flatten()[:64])
    assert torch.equal(draws["full"]["model.norm.weight"], torch.ones(arch.hidden_size))


def test_uneven_heads_are_a_clear_error():
    smollm2 = dataclasses.replace(PRESETS["tiny"], num_heads=9, num_kv_heads=3, hidden_size=576, head_dim=64,
                                  intermediate_size=1536)  # SmolLM2-135M's heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide .*num_heads=9"):
        check_tensor_parallel(smollm2, 2)
    check_tensor_parallel(smollm2, 3)  # 9 heads, 3 KV heads: fine
    with pytest.raises(ValueError, match="num_kv_heads=2"):
        check_tensor_parallel(dataclasses.replace(PRESETS["tiny"], num_heads=12, num_kv_heads=2), 3)


# ---- the collective ops -------------------------------------------------------------------------
@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _collectives_on_rank(rank: int, size: int, port: int, inputs: list[torch.Tensor], results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        x = inputs[rank]
        outs = torch.ops.kiln.all_reduce(x), torch.ops.kiln.all_gather(x), torch.ops.kiln.all_gather(x.mT)
        results.put([t.numpy() for t in outs])  # by value: this process exits before the test reads
    finally:
        dist.destroy_process_group()


def test_collectives_match_their_references():
    """Two gloo ranks on fresh random inputs: every rank gets the reference sum and concatenation
    (along the last dim, in rank order; a non-contiguous input too)."""
    import torch.multiprocessing as mp

    size = 2
    inputs = [torch.randn(2, 3, 5) for _ in range(size)]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_collectives_on_rank, args=(r, size, port, inputs, results)) for r in range(size)]
    for p in procs:
        p.start()
    outs = [results.get() for _ in range(size)]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    for reduced, gathered, gathered_t in ([torch.from_numpy(a) for a in out] for out in outs):
        torch.testing.assert_close(reduced, all_reduce_reference(inputs))
        assert torch.equal(gathered, all_gather_reference(inputs))
        assert gathered.shape == (2, 3, 10)
        assert torch.equal(gathered_t, all_gather_reference([x.mT for x in inputs]))


def _compiled_graph(fn, *args):
    # kiln._C loads (and registers its ops' fakes) on the first gemv_available(), which a loaded
    # model calls when it is prepared, before any compile; a bare module here would make that first
    # call inside the trace, where Dynamo cannot follow torch.library.register_fake.
    from kiln.ops.cpu_linear import gemv_available

    gemv_available()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return out, [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]


def _count(targets, op) -> int:
    return sum(t in (op, op.default) for t in targets)


def test_all_reduce_is_one_graph_node(one_rank_group):
    """The row-parallel MLP compiles as one graph (no break) that calls torch.ops.kiln.all_reduce."""
    from kiln.models.llama import LlamaMLP

    mlp = LlamaMLP(PRESETS["tiny"], TensorParallel(0, 2))
    x = torch.randn(5, PRESETS["tiny"].hidden_size)
    out, targets = _compiled_graph(mlp, x)
    assert _count(targets, torch.ops.kiln.all_reduce) == 1
    torch.testing.assert_close(out, all_reduce_reference([mlp(x)]))  # one rank: the sum is the input


def test_vocab_parallel_embedding_and_head_are_graph_nodes(one_rank_group):
    """Rank 0 of 2 (in a group of one, so the collectives return their input): the embedding looks
    up ids in its vocab range, zeros the rest, then one all_reduce; the head ends in one all_gather."""
    model = build_empty_model(ODD_VOCAB, torch.device("cpu"), torch.float32, TensorParallel(0, 2))
    init_random_weights(model, seed=0)
    emb = model.embed_tokens
    num_rows = emb.num_embeddings  # 24577: ids 0..24576 are rank 0's
    ids = torch.tensor([0, 5, num_rows - 1, num_rows, ODD_VOCAB.vocab_size - 1])
    x, targets = _compiled_graph(emb, ids)
    assert _count(targets, torch.ops.kiln.all_reduce) == 1
    mine = ids < num_rows
    expected = torch.where(mine.unsqueeze(-1), emb.weight[ids.clamp(max=num_rows - 1)], 0.0)
    assert torch.equal(x, all_reduce_reference([expected]))
    hidden = torch.randn(3, ODD_VOCAB.hidden_size)
    logits, targets = _compiled_graph(model.compute_logits, hidden)
    assert _count(targets, torch.ops.kiln.all_gather) == 1
    torch.testing.assert_close(logits, all_gather_reference([hidden @ model.lm_head.weight.T]))


# ---- the multiprocess executor ------------------------------------------------------------------
# Each TP=2 engine spawns two processes that import torch and kiln (tens of seconds on a busy CPU):
# one engine per preset, shared by the module; the last test kills a rank of the qwen2 engine.
@pytest.fixture(scope="module")
def odd_vocab_dir(tmp_path_factory, kiln_cache_dir) -> str:
    """A Hugging Face directory of ODD_VOCAB: random weights, the random presets' tokenizer."""
    import shutil

    from safetensors.torch import save_file

    from kiln.models.loader import tokenizer_dir

    path = tmp_path_factory.mktemp("odd_vocab")
    shutil.copytree(tokenizer_dir(kiln_cache_dir), path, dirs_exist_ok=True)
    (path / "config.json").write_text(json.dumps(ODD_VOCAB.to_hf_config()))
    save_file(dict(iter_random_weights(ODD_VOCAB, 0, torch.device("cpu"), torch.float32, std=0.05)),
              str(path / "model.safetensors"))
    return str(path)


@pytest.fixture(scope="module")
def tp2_engines(kiln_cache_dir):
    engines = {}

    def get(model):
        if model not in engines:
            engines[model] = LLM(model, compile={"mode": "eager"}, cache={"dir": kiln_cache_dir}, parallel=MP2)
        return engines[model]

    yield get
    for llm in engines.values():
        procs = list(llm.engine.executor.procs)
        llm.engine.shutdown()
        assert not any(p.is_alive() for p in procs)  # shutdown leaves no process behind


@pytest.mark.parametrize("model", ["random:tiny", "random:tiny-qwen2", "odd-vocab"])
def test_tp2_matches_tp1(model, tp2_engines, kiln_cache_dir, odd_vocab_dir):
    """Same tokens and logprobs; odd-vocab: an untied head over 49153 ids, padded to 49154 by TP=2."""
    model = odd_vocab_dir if model == "odd-vocab" else model
    single = _generate(LLM(model, compile={"mode": "eager"}, cache={"dir": kiln_cache_dir}))
    sharded = _generate(tp2_engines(model))
    assert_same_completions(sharded, single)
    if model == odd_vocab_dir:
        token_ids = [t for o in single for t in o.token_ids]
        assert min(token_ids) < 24577 <= max(token_ids)  # both ranks' vocab ranges were sampled


def test_tp2_stop_strings_found_while_the_ranks_run_the_next_step(tp2_engines, kiln_cache_dir):
    """The ranks already run step k+1 when step k's text shows a stop string: the outputs are those
    of a serial single-process run, and the stopped requests are forgotten on every rank."""
    single = LLM("random:tiny", compile={"mode": "eager"}, cache={"dir": kiln_cache_dir})
    single.engine._overlap = False  # the reference: each step run to the end
    full = _generate(single)
    params = [SamplingParams(max_tokens=12, temperature=0.0, stop=[o.text[len(o.text) // 2:][:2]] if o.text else [])
              for o in full]
    want = [o.outputs[0] for o in single.generate(PROMPTS, params, use_tqdm=False)]
    llm = tp2_engines("random:tiny")
    got = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert [(o.text, o.token_ids, o.finish_reason) for o in got] == [(o.text, o.token_ids, o.finish_reason)
                                                                     for o in want]
    assert any(o.finish_reason == "stop" and len(o.token_ids) < 12 for o in got)
    assert len(llm.engine.executor._encoder) == 0 and not llm.engine.has_unfinished_requests()


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
    llm = tp2_engines("random:tiny-qwen2")
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
    llm = tp2_engines("random:tiny")
    executor = llm.engine.executor
    procs = list(executor.procs)
    executor.step_timeout_s = 2.0
    os.kill(procs[1].pid, signal.SIGSTOP)  # alive but silent, as in a deadlock
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[(0, )?1\] gave no answer within 2 s"):
        llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)
    assert time.monotonic() - t0 < 15
    assert not any(p.is_alive() for p in procs)
