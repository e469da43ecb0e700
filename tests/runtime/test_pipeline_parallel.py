"""Pipeline parallelism on the CPU (gloo): how layers split over stages, what each stage loads, the
multiprocess executor's PP=2, PP=3 and TP=2 x PP=2 against the single-process engine (Llama and
Qwen2, chunked prefill, greedy tokens and logprobs), and the layouts refused with the key to change."""

import dataclasses
import json

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.config import EngineConfig, ModelConfig, ParallelConfig
from kiln.models.arch import PRESETS, ArchConfig
from kiln.models.loader import build_empty_model, init_random_weights, iter_random_weights, load_model
from kiln.models.parallel import TensorParallel
from kiln.models.pipeline import PipelineStage, driver_rank, stage_layers
from kiln.runtime.executor.base import check_ranks_fit, rank_layout
from tests.helpers.hf import moe_hf_configs, write_toy_tokenizer
from tests.helpers.parallel import assert_same_completions

PROMPTS = ["Hello there", "The capital of France is", list(range(100, 140)), "1, 2, 3"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, logprobs=3)
# Five layers: 3-2 over two stages, 2-2-1 over three. A tied head (Llama) and an untied one (Qwen2).
LLAMA_5L = dataclasses.replace(PRESETS["tiny"], num_layers=5)
QWEN2_5L = dataclasses.replace(PRESETS["tiny-qwen2"], num_layers=5, tie_word_embeddings=False)
# Qwen2-MoE, three layers: experts, a dense MLP (mlp_only_layers), experts; 1-1-1 over three stages.
QWEN2_MOE = ArchConfig.from_hf_config(moe_hf_configs()["qwen2_moe"].to_dict())
ARCHS = {"llama": LLAMA_5L, "qwen2": QWEN2_5L, "qwen2_moe": QWEN2_MOE}
# 16 tokens a step: the 40-token prompt runs as three chunks, beside the others' decodes; 15 blocks
# of 4 tokens hold fewer than the four requests need together, so the scheduler preempts.
SCHEDULER = {"max_num_batched_tokens": 16, "max_num_seqs": 8}
CACHE = {"block_size": 4, "num_blocks": 16}


def _generate(llm):
    return [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


# ---- the split (no processes) -------------------------------------------------------------------
@pytest.mark.parametrize("num_layers,size,counts", [
    (4, 2, [2, 2]), (5, 2, [3, 2]), (5, 3, [2, 2, 1]), (6, 4, [1, 2, 2, 1]), (7, 4, [2, 2, 2, 1]), (2, 1, [2]),
])
def test_layers_split_as_vllm_does(num_layers, size, counts):
    """An even share each, the remainder to the stages before the last (vLLM's get_pp_indices)."""
    ranges = [stage_layers(num_layers, rank, size) for rank in range(size)]
    assert [end - start for start, end in ranges] == counts
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_ranks_are_laid_out_tensor_parallel_fastest():
    layout = rank_layout(ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, backend="mp"))
    assert [(tp.rank, stage.rank) for tp, stage in layout] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert driver_rank(2, 2) == 2 and driver_rank(1, 3) == 2 and driver_rank(2, 1) == 0


@pytest.mark.parametrize("preset", ["llama", "qwen2", "qwen2_moe"])
@pytest.mark.parametrize("size", [2, 3])
def test_each_stage_loads_only_its_layers(preset, size):
    """A stage holds its layers' weights (the same tensors the whole model draws), stage 0 the
    embedding, the last the final norm and LM head (a tied model's: the embedding); other stages'
    layers are weightless placeholders."""
    arch = ARCHS[preset]
    full = build_empty_model(arch, torch.device("cpu"), torch.float32)
    init_random_weights(full, seed=0)
    full_weights = dict(full.named_parameters())
    owners: dict[str, int] = {}
    for rank in range(size):
        stage = PipelineStage(rank, size)
        model = build_empty_model(arch, torch.device("cpu"), torch.float32, stage=stage)
        init_random_weights(model, seed=0)
        layers = range(*stage_layers(arch.num_layers, rank, size))
        assert list(model.layer_ids) == list(layers)
        assert [layer.self_attn.kv_index for layer in (model.layers[i] for i in layers)] == list(range(len(layers)))
        assert (model.embed_tokens is not None) == (stage.is_first or (stage.is_last and arch.tie_word_embeddings))
        assert (model.norm is not None) == stage.is_last
        assert (model.lm_head is not None) == (stage.is_last and not arch.tie_word_embeddings)
        for name, param in model.named_parameters():
            assert torch.equal(param, full_weights[name]), name
            if not name.startswith("embed_tokens"):  # a tied model's embedding is on two stages
                assert name not in owners, f"{name} on stages {owners.get(name)} and {rank}"
                owners[name] = rank
    assert set(owners) | {n for n in full_weights if n.startswith("embed_tokens")} == set(full_weights)


def test_a_stage_skips_the_other_stages_tensors_of_a_checkpoint():
    """A checkpoint holds every stage's tensors: each stage loads its own and passes over the rest,
    while a tensor no stage knows is still an error."""
    full = dict(iter_random_weights(LLAMA_5L, 0, torch.device("cpu"), torch.float32))
    model = build_empty_model(LLAMA_5L, torch.device("cpu"), torch.float32, stage=PipelineStage(1, 2))
    model.load_weights(full.items())
    assert list(model.layer_ids) == [3, 4]
    torch.testing.assert_close(model.layers[3].mlp.down_proj.weight, full["model.layers.3.mlp.down_proj.weight"])
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.5.mlp.down_proj.weight'"):
        model.load_weights([*full.items(), ("model.layers.5.mlp.down_proj.weight", torch.zeros(1))])


# ---- refused layouts -----------------------------------------------------------------------------
@pytest.mark.parametrize("groups,match", [
    ({"parallel": {"pipeline_parallel_size": 2}}, r"pipeline_parallel_size=2 runs one process per stage: set "
                                                  r"parallel.backend=mp"),
    ({"parallel": {"pipeline_parallel_size": 0, "backend": "mp"}}, r"parallel.pipeline_parallel_size must be > 0"),
    ({"parallel": {"pipeline_parallel_size": 2, "backend": "mp", "data_parallel_size": 2}},
     r"data_parallel_size=2 runs each replica in one process"),
    ({"parallel": {"pipeline_parallel_size": 2, "backend": "mp", "all_reduce": "symm_mem"}},
     r"all_reduce=symm_mem reduces over every rank"),
    ({"parallel": {"pipeline_parallel_size": 2, "backend": "mp"}, "lora": {"max_loras": 2}},
     r"LoRA adapters are served with parallel.pipeline_parallel_size=1"),
    ({"parallel": {"pipeline_parallel_size": 2, "backend": "mp"}, "speculative": {"method": "ngram"}},
     r"speculative.method=ngram does not run with parallel.pipeline_parallel_size=2"),
    ({"parallel": {"pipeline_parallel_size": 2, "backend": "mp"}, "model": {"model": "random:tiny",
                                                                            "quantization": "int8"}},
     r"model.quantization=int8 does not run with parallel.pipeline_parallel_size=2"),
])
def test_unsupported_combinations_name_the_key(groups, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs(**groups)


def test_more_ranks_than_gpus_names_both_sizes():
    parallel = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=3, backend="mp")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 x parallel.pipeline_parallel_size=3 needs 6 GPUs, "
                                         r"one per rank; this machine has 4"):
        check_ranks_fit(parallel, 4)
    check_ranks_fit(parallel, 8)


def test_more_stages_than_layers_and_the_generic_path_are_refused(kiln_cache_dir):
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=3 is more than this model's num_layers=2"):
        load_model(ModelConfig(model="random:tiny"), kiln_cache_dir, cpu, torch.float32, stage=PipelineStage(0, 3))
    with pytest.raises(ValueError, match=r"the generic path .* runs whole models only, not "
                                         r"parallel.pipeline_parallel_size=2"):
        load_model(ModelConfig(model="random:tiny", impl="transformers"), kiln_cache_dir, cpu, torch.float32,
                   stage=PipelineStage(1, 2))


@pytest.mark.slow  # three processes that start only to refuse (the message itself: the test above)
def test_a_rank_refusing_the_layout_fails_the_engine_with_its_error(kiln_cache_dir):
    """The check runs in the ranks (only they read the model's config); its ValueError reaches the user."""
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=3 is more than this model's num_layers=2"):
        LLM("random:tiny", compile={"mode": "eager"}, cache={"dir": kiln_cache_dir},
            parallel={"pipeline_parallel_size": 3, "backend": "mp"})


# ---- the multiprocess executor ------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, kiln_cache_dir) -> dict[str, str]:
    """Hugging Face directories of the models: random weights, the presets' tokenizer (the MoE
    model's vocabulary is smaller: a toy tokenizer; its prompts' text is unknown words)."""
    import shutil

    from safetensors.torch import save_file

    from kiln.models.loader import tokenizer_dir

    dirs = {}
    for name, arch in ARCHS.items():
        path = tmp_path_factory.mktemp(f"pp_{name}")
        if arch.vocab_size == PRESETS["tiny"].vocab_size:
            shutil.copytree(tokenizer_dir(kiln_cache_dir), path, dirs_exist_ok=True)
        else:
            write_toy_tokenizer(path)
        (path / "config.json").write_text(json.dumps(arch.to_hf_config()))
        save_file(dict(iter_random_weights(arch, 0, torch.device("cpu"), torch.float32, std=0.1)),
                  str(path / "model.safetensors"))
        dirs[name] = str(path)
    return dirs


@pytest.fixture(scope="module")
def engines(model_dirs, kiln_cache_dir):
    """One engine per (model, tp, pp), built on first use and shared by the module (each spawns
    tp x pp processes that import torch and kiln: seconds apiece on a busy CPU)."""
    built = {}

    def get(model: str, tp: int = 1, pp: int = 1, ep: bool = False):
        key = (model, tp, pp, ep)
        if key not in built:
            parallel = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "backend": "mp" if tp * pp > 1 else "uni",
                        "enable_expert_parallel": ep}
            built[key] = LLM(model_dirs[model], compile={"mode": "eager"}, cache={**CACHE, "dir": kiln_cache_dir},
                             scheduler=SCHEDULER, parallel=parallel)
        return built[key]

    yield get
    for key, llm in built.items():
        procs = list(getattr(llm.engine.executor, "procs", []))
        llm.engine.shutdown()
        assert not any(p.is_alive() for p in procs), key  # shutdown leaves no process behind


@pytest.fixture(scope="module")
def single(engines):
    """Each model's completions on one process, the reference."""
    return {model: _generate(engines(model)) for model in ARCHS}


# The default suite runs each model once (PP=2 and PP=3 each at least once); `-m slow` the rest.
@pytest.mark.parametrize("model,tp,pp", [
    ("llama", 1, 2), ("qwen2", 1, 3), ("qwen2_moe", 1, 3), ("qwen2_moe", 2, 1),
    pytest.param("qwen2", 1, 2, marks=pytest.mark.slow), pytest.param("llama", 1, 3, marks=pytest.mark.slow),
    pytest.param("llama", 2, 2, marks=pytest.mark.slow), pytest.param("qwen2", 2, 2, marks=pytest.mark.slow),
])
def test_pipeline_matches_one_process(model, tp, pp, engines, single):
    """Same tokens and logprobs, the 40-token prompt prefilled in chunks beside the others' decodes,
    requests preempted and recomputed."""
    llm = engines(model, tp, pp)
    got = _generate(llm)
    assert_same_completions(got, single[model])
    assert llm.engine.scheduler.num_preemptions > 0
    assert len({t for o in single[model] for t in o.token_ids}) > 4  # the models do not repeat one token


def test_expert_parallel_matches_one_process(engines, single):
    """parallel.enable_expert_parallel at TP=2: Qwen2-MoE's six experts three to a rank, whole (the
    shared expert and attention still cut): one process's tokens and logprobs."""
    from kiln.models.parallel import TensorParallel

    rank1 = build_empty_model(QWEN2_MOE, torch.device("cpu"), torch.float32, TensorParallel(1, 2, experts=True))
    block = rank1.layers[0].mlp  # the layout each rank builds
    assert block.w13.shape[0] == 3 and block.first_expert == 3
    assert block.w2.shape[-1] == QWEN2_MOE.moe_intermediate_size  # whole experts
    assert_same_completions(_generate(engines("qwen2_moe", 2, 1, ep=True)), single["qwen2_moe"])


@pytest.mark.slow  # kiln's compile of each stage's layers in its own process: tens of seconds on two cores
def test_each_stage_compiles_its_layers_with_kiln(model_dirs, kiln_cache_dir, single):
    """compile.mode=kiln per stage (Dynamo capture, passes, Inductor over the stage's layers only; a
    later stage's input read through kiln.read_stage_input): the same completions."""
    llm = LLM(model_dirs["llama"], compile={"mode": "kiln"}, cache={**CACHE, "dir": kiln_cache_dir}, scheduler=SCHEDULER,
              parallel={"pipeline_parallel_size": 2, "backend": "mp"})
    try:
        assert_same_completions(_generate(llm), single["llama"])
    finally:
        llm.engine.shutdown()


@pytest.mark.slow  # a local Ray cluster and two actors
def test_pipeline_over_ray_matches_one_process(model_dirs, kiln_cache_dir, single, monkeypatch):
    pytest.importorskip("ray")
    monkeypatch.setenv("RAY_ADDRESS", "local")  # a cluster of kiln's own, stopped with the engine
    llm = LLM(model_dirs["qwen2"], compile={"mode": "eager"}, cache={**CACHE, "dir": kiln_cache_dir}, scheduler=SCHEDULER,
              parallel={"pipeline_parallel_size": 2, "backend": "ray"})
    try:
        assert_same_completions(_generate(llm), single["qwen2"])
    finally:
        llm.engine.shutdown()


def test_read_stage_input_is_the_buffer_s_first_rows_in_one_graph_node():
    """The op gives T rows for T tokens (a copy, never a view of the buffer), and compiles as one
    node whose output size follows the token count, whatever the buffer's size."""
    import kiln.ops.stage_input  # noqa: F401

    buffer = torch.randn(16, 8)
    out = torch.ops.kiln.read_stage_input(buffer, torch.zeros(5, dtype=torch.int64))
    assert torch.equal(out, buffer[:5]) and out.data_ptr() != buffer.data_ptr()
    targets = []

    def backend(gm, example_inputs):
        targets.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    fn = torch.compile(lambda ids: torch.ops.kiln.read_stage_input(buffer, ids) * 2, backend=backend,
                       fullgraph=True, dynamic=True)
    for n in (3, 7):
        torch.testing.assert_close(fn(torch.zeros(n, dtype=torch.int64)), buffer[:n] * 2)
    op = torch.ops.kiln.read_stage_input
    assert sum(t in (op, op.default) for t in targets) == 1
