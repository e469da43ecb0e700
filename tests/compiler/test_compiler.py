"""compile.mode=stock and kiln against eager: logits, greedy tokens, recompiles, dumps.

Inductor's C++ builds are slow on small CPUs, so every test shares the session's Inductor cache
directory (``$TORCHINDUCTOR_CACHE_DIR``, set in conftest.py) and the tests reuse a few models of the
same shapes: identical pieces then come from the cache instead of being rebuilt.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kiln.compiler import KilnForward, build_forward
from kiln.compiler.background_build import BackgroundBuild
from kiln.config import CompileConfig
from kiln.models.arch import PRESETS
from kiln.models.llama import LlamaForCausalLM
from kiln.passes.manager import PassConfig
from tests.helpers.paged import PagedBatcher, make_kv_caches, run_step

# Four layers: pieces = first, three identical middles, last; the tiny vocab keeps logits cheap.
ARCH = dataclasses.replace(PRESETS["tiny"], num_layers=4, vocab_size=512, max_position_embeddings=512)
NUM_BLOCKS, BLOCK_SIZE = 160, 4


def _model(arch=ARCH, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(arch).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return _model()


@pytest.fixture(scope="module")
def kiln_forward(model) -> KilnForward:
    return build_forward(model, CompileConfig(mode="kiln"))


def _schedule(vocab: int) -> list[dict]:
    """Prefills of mixed lengths (one of a single token), chunked prefill beside decodes, then
    decode batches of 1, 2 and 4 requests."""
    g = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    return [
        {"a": ids(5), "b": ids(17), "c": ids(1)},
        {"a": ids(1), "b": ids(1), "c": ids(1), "d": ids(9)},
        {"a": ids(1), "b": ids(1), "c": ids(1), "d": ids(1)},
        {"b": ids(1), "d": ids(1)},
        {"d": ids(1)},
    ]


def _run_schedule(forward, model, schedule) -> list[torch.Tensor]:
    """Logits of every step's tokens, [num_tokens, vocab] per step."""
    batcher = PagedBatcher(NUM_BLOCKS, BLOCK_SIZE, seed=1)
    caches = make_kv_caches(model.arch, NUM_BLOCKS, BLOCK_SIZE)
    out = []
    for new_tokens in schedule:
        step = batcher.step(new_tokens)
        hidden = run_step(forward, caches, step)
        with torch.inference_mode():
            out.append(model.compute_logits(hidden))
    return out


def _assert_same_logits(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        assert w.abs().max() > 0.5  # far from zero, so atol is a real bound
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
        assert torch.equal(g.argmax(-1), w.argmax(-1))


def test_eager_mode_is_the_model(model):
    assert build_forward(model, CompileConfig(mode="eager")) is model


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match=r"compile.mode='fast' is not allowed; choose one of \['auto', 'eager', 'stock', 'kiln'\]"):
        CompileConfig(mode="fast")


def test_kiln_matches_eager(model, kiln_forward):
    schedule = _schedule(ARCH.vocab_size)
    _assert_same_logits(_run_schedule(kiln_forward, model, schedule), _run_schedule(model, model, schedule))
    # Four layers, five pieces; the three middle ones are one build.
    capture = kiln_forward.backend.capture
    assert (capture.num_pieces, capture.num_unique_pieces) == (5, 3)
    assert kiln_forward.num_captures == 1


def test_eager_steps_run_while_the_forward_is_captured_and_compiled(model, kiln_forward):
    """A background build: the build's Dynamo capture and Inductor compile run on a thread
    beside eager steps of the same model; the steps stay eager's, the capture happens once, and the
    built forward gives eager's logits. (``kiln_forward`` first: its builds are cached.)"""
    steps = _schedule(ARCH.vocab_size)
    want = _run_schedule(model, model, steps)
    forward = build_forward(model, CompileConfig(mode="kiln"))
    assert isinstance(forward, KilnForward)
    build = BackgroundBuild(lambda: forward, torch.device("cpu"))
    build.start()
    while True:  # eager steps on this thread, from the build's start and every half second until its end
        for got, w in zip(_run_schedule(model, model, steps), want, strict=True):
            torch.testing.assert_close(got, w, atol=0, rtol=0)
        if build.wait(0.5):
            break
    assert build.error is None and build.seconds > 0 and build.forward is forward
    assert forward.num_captures == 1
    _assert_same_logits(_run_schedule(forward, model, steps), want)


@pytest.mark.parametrize("every,pieces", [(2, 3), (0, 1)])
def test_kiln_split_every_keeps_attention_inside_pieces(model, every, pieces):
    """compile.split_every: cut at every 2nd attention call (layers 0 and 2; the calls of layers 1
    and 3 compiled inside the pieces) or nowhere; the same logits as eager with fewer pieces."""
    forward = build_forward(model, CompileConfig(mode="kiln", split_every=every))
    schedule = _schedule(ARCH.vocab_size)
    _assert_same_logits(_run_schedule(forward, model, schedule), _run_schedule(model, model, schedule))
    capture = forward.backend.capture
    assert capture.num_pieces == pieces
    calls = [n for _, m in capture.split_gm.named_children() for n in m.graph.nodes
             if n.op == "call_function" and "attend_paged" in str(n.target)]
    assert len(calls) == ARCH.num_layers  # every call: alone in its piece or inside a compiled one
    with pytest.raises(ValueError, match="split_every must be >= 0"):
        CompileConfig(mode="kiln", split_every=-1)


def test_groups_of_layers_share_one_build_and_read_their_own_caches(tmp_path):
    """split_every=2 over six layers cuts at the attention calls of layers 0, 2 and 4; the pieces
    between hold the calls of layers 1 and 3 (and 5, with the final norm), each numbered from 0, so
    the two middle pieces are one build, run at layer base 1 and 3. Eager's logits over prefills and
    decodes (a piece attending over another layer's cache would not give them), compiled and then
    loaded back from the compile cache."""
    from kiln.compiler import ArtifactCache
    from kiln.compiler.piece import CompiledPiece

    six = dataclasses.replace(ARCH, num_layers=6)
    model = _model(six)
    config = CompileConfig(mode="kiln", split_every=2)
    schedule = _schedule(six.vocab_size)
    want = _run_schedule(model, model, schedule)
    forward = build_forward(model, config, artifact_cache=ArtifactCache(str(tmp_path), "six"))
    _assert_same_logits(_run_schedule(forward, model, schedule), want)
    capture = forward.backend.capture
    assert (capture.num_pieces, capture.num_unique_pieces) == (4, 3)
    pieces = [p for p in capture.split_gm.__dict__.values() if isinstance(p, CompiledPiece)]
    assert sorted(p.layer_base for p in pieces) == [0, 1, 3, 5]
    loaded = build_forward(model, config, artifact_cache=ArtifactCache(str(tmp_path), "six"))
    _assert_same_logits(_run_schedule(loaded, model, schedule), want)
    assert loaded.cache_hit and loaded.num_captures == 0


def test_split_every_is_refused_with_piecewise_cuda_graphs():
    from kiln.config import SchedulerConfig, resolve_for_device

    with pytest.raises(ValueError, match="piecewise CUDA graphs cannot capture"):
        resolve_for_device(CompileConfig(mode="kiln", split_every=4), SchedulerConfig(), "cuda")
    compile, _ = resolve_for_device(CompileConfig(mode="kiln", cudagraph="full", split_every=4), SchedulerConfig(), "cuda")
    assert compile.split_every == 4
    compile, _ = resolve_for_device(CompileConfig(mode="kiln", split_every=0), SchedulerConfig(), "cpu")
    assert compile.cudagraph == "none" and compile.split_every == 0


def test_stock_matches_eager(model):
    schedule = _schedule(ARCH.vocab_size)
    stock = build_forward(model, CompileConfig(mode="stock"))
    _assert_same_logits(_run_schedule(stock, model, schedule), _run_schedule(model, model, schedule))


def test_stock_does_not_recompile_over_the_step_buffers_layout(model, monkeypatch):
    """kiln's step buffers hand positions over as a view at offset max_num_tokens. A first step of
    exactly that many tokens made Dynamo's duck sizing guard offset == num_tokens, and the next
    step (another size) compiled the model again. Guards are Dynamo's, so Inductor is left out."""
    import functools

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    stock = build_forward(model, CompileConfig(mode="stock"))
    first = {"a": list(range(5, 17)), "b": list(range(20, 32))}  # 24 tokens = the buffer's capacity
    capacity = sum(map(len, first.values()))

    def through_buffers(input_ids, positions):  # as kiln.compiler.inputs.InputBuffers lays them out
        buf = torch.zeros(2 * capacity, dtype=positions.dtype)
        buf[capacity:capacity + len(positions)] = positions
        return stock(input_ids, buf[capacity:capacity + len(positions)])

    batcher = PagedBatcher(NUM_BLOCKS, BLOCK_SIZE, seed=4)
    caches, eager_caches = (make_kv_caches(ARCH, NUM_BLOCKS, BLOCK_SIZE) for _ in range(2))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for new_tokens in (first, {"a": [3], "b": [4]}, {"a": [5, 6, 7], "b": [8]}):
        step = batcher.step(new_tokens)
        got, want = run_step(through_buffers, caches, step), run_step(model, eager_caches, step)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1


def test_kiln_no_recompiles_over_batch_sizes_1_to_64(model, kiln_forward):
    num_blocks = 640  # 64 requests of 3 prompt tokens plus up to 64 decoded ones
    batcher = PagedBatcher(num_blocks, BLOCK_SIZE, seed=2)
    caches, eager_caches = (make_kv_caches(ARCH, num_blocks, BLOCK_SIZE) for _ in range(2))
    g = torch.Generator().manual_seed(3)
    prompts = {r: torch.randint(0, ARCH.vocab_size, (3,), generator=g).tolist() for r in range(64)}
    warm_up = batcher.step(prompts)  # one 192-token prefill: captures (if not yet) and compiles
    run_step(kiln_forward, caches, warm_up)
    run_step(model, eager_caches, warm_up)
    num_compiles = kiln_forward.num_compiles
    unique_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for n in range(1, 65):
        step = batcher.step({r: [(7 * r + n) % ARCH.vocab_size] for r in range(n)})
        got, want = run_step(kiln_forward, caches, step), run_step(model, eager_caches, step)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert kiln_forward.num_captures == 1 and kiln_forward.num_recompiles == 0
    assert kiln_forward.num_compiles == num_compiles
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == unique_graphs


def test_kiln_static_sizes_and_fusions(model):
    """compile.sizes gets static builds chosen by num_tokens; fusions forced on (CPU's default is
    off) still give eager's logits, and the fused ops really run inside the compiled pieces."""
    forward = build_forward(model, CompileConfig(mode="kiln", sizes=(4,)),
                            PassConfig(kernels=_COUNTING_KERNELS, fusion="on"))
    _FUSED_CALLS.update(silu_and_mul=0, add_rms_norm=0)
    schedule = _schedule(ARCH.vocab_size)
    got = _run_schedule(forward, model, schedule)
    calls = dict(_FUSED_CALLS)
    _assert_same_logits(got, _run_schedule(model, model, schedule))
    # Per forward: one silu_and_mul per layer; add_rms_norm after every residual add that feeds a
    # norm (4 post-attention, 3 next-layer input norms, the final norm).
    assert calls == {"silu_and_mul": 4 * len(schedule), "add_rms_norm": 8 * len(schedule)}
    assert not forward.backend.passes.failed
    pieces = forward.backend.compiler.cache.values()
    # Only the size asked for: the dynamic builds hold no guard on num_tokens (a view of a row-strided
    # slice once made Inductor guard num_tokens != 1, and every piece got a build for 1 too).
    assert all(set(p.by_size) == {4} for p in pieces if p.size_arg is not None)
    # The static build for 4 runs at exactly 4 tokens (step 4 of the schedule is 2 decodes, step 3
    # is 4): patch it to fail and see it chosen.
    middle = next(p for p in pieces if p.size_arg is not None)
    middle.by_size[4] = _raise
    with pytest.raises(RuntimeError, match="static build for 4"):
        _run_schedule(forward, model, schedule[:1] + [{r: [1] for r in "abc"} | {"d": [2]}])


@pytest.mark.parametrize("family", ["qwen3", "olmo2"])
def test_heads_of_a_split_projection_need_no_one_token_build(family):
    """Qwen3 (and Gemma 3) normalize each head of q and k, OLMo-2 the whole projections: the model
    splits the fused projection before viewing heads, which made Inductor guard num_tokens != 1
    and every piece get a second build for one token. HeadsViewPass leaves one build a piece, and
    the one-token steps of the schedule still give eager's logits."""
    arch = dataclasses.replace(ARCH, num_layers=2, family=family)
    model = _model(arch)
    forward = build_forward(model, CompileConfig(mode="kiln"))
    schedule = _schedule(arch.vocab_size)
    _assert_same_logits(_run_schedule(forward, model, schedule), _run_schedule(model, model, schedule))
    backend = forward.backend
    assert backend.passes.num_rewrites["HeadsViewPass"] > 0 and not backend.passes.failed
    assert backend.excluded_sizes == set()
    assert all(not p.by_size for p in backend.compiler.cache.values())


def test_dynamic_builds_make_no_padding_choice_on_num_tokens(model, monkeypatch):
    """Inductor's matmul padding heuristic compares num_tokens with a matmul's other sizes where
    they are not aligned (on CUDA, torch 2.11: ``K > M`` guarded ``num_tokens < hidden`` for
    Qwen2-MoE's 60-expert router and 1-wide shared-expert gate, and the capture was refused).
    The dynamic build, whose calls skip guards, is compiled without it; static builds keep it."""
    import torch._inductor as inductor

    seen = []
    real = inductor.standalone_compile

    def recording(gm, args, dynamic_shapes, options):
        seen.append((dynamic_shapes, options["config_patches"].get("shape_padding")))
        return real(gm, args, dynamic_shapes=dynamic_shapes, options=options)

    monkeypatch.setattr(inductor, "standalone_compile", recording)  # kiln.compiler.piece imports it per build
    forward = build_forward(model, CompileConfig(mode="kiln", sizes=(1,)))  # the builds other tests made
    _run_schedule(forward, model, _schedule(ARCH.vocab_size)[:1])
    dynamic = {p for d, p in seen if d == "from_tracing_context"}
    static = {p for d, p in seen if d == "from_example_inputs"}
    assert dynamic == {False} and static == {None}


def _counting(name, reference):
    def impl(*args):
        _FUSED_CALLS[name] += 1
        return reference(*args)
    return impl


def _counting_kernels():
    """The reference kernels behind ops of their own that count their calls."""
    import dataclasses

    from kiln.ops import activation, layernorm
    from kiln.ops.registry import Kernel, reference_kernels

    silu = activation.define_silu_and_mul_op(
        "kiln_test_count::silu_and_mul", _counting("silu_and_mul", activation.silu_and_mul_reference))
    norm = layernorm.define_add_rms_norm_op(
        "kiln_test_count::add_rms_norm", _counting("add_rms_norm", layernorm.add_rms_norm_reference))
    return dataclasses.replace(reference_kernels(), silu_and_mul=Kernel("counting", torch.ops.kiln_test_count.silu_and_mul),
                               add_rms_norm=Kernel("counting", torch.ops.kiln_test_count.add_rms_norm)), (silu, norm)


_FUSED_CALLS = {"silu_and_mul": 0, "add_rms_norm": 0}
_COUNTING_KERNELS, _COUNTING_OPS = _counting_kernels()


def _raise(*args):
    raise RuntimeError("static build for 4 was called")


def test_debug_dump_dir(tmp_path):
    arch = dataclasses.replace(ARCH, num_layers=1)
    model = _model(arch)
    forward = build_forward(model, CompileConfig(mode="kiln", debug_dump_dir=str(tmp_path)))
    schedule = _schedule(arch.vocab_size)[:2]
    _assert_same_logits(_run_schedule(forward, model, schedule), _run_schedule(model, model, schedule))
    assert "attend_paged" in (tmp_path / "dynamo_graph.py").read_text()
    split = (tmp_path / "split_graph.py").read_text()
    assert split.count("# ---- submod_") == 3 and "attention, run eagerly" in split
    dumped = sorted(p.name for p in (tmp_path / "passes").rglob("*.py"))
    assert "01_SDPAToPagedAttentionPass_before.py" in dumped  # the first pass
    assert any(name.endswith("_AttentionBackendPass_before.py") for name in dumped)
    assert any(name.endswith("_NoOpEliminationPass_after.py") for name in dumped)
    pieces = [d.name for d in (tmp_path / "passes").iterdir() if d.name.startswith("piece_")]
    assert len(pieces) == 2  # 2 pieces, a dynamic build each (no guard on num_tokens: no static build)
    try:
        import depyf  # noqa: F401
    except ImportError:
        return
    assert any((tmp_path / "depyf").iterdir())


MODES = ["eager", "stock", "kiln"]


@pytest.fixture(scope="module")
def tiny_llm_outputs():
    from kiln import LLM, SamplingParams

    prompts = ["hi", "The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18"]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    return {mode: [o.outputs[0].token_ids for o in LLM("random:tiny", compile={"mode": mode}).generate(
        prompts, params, use_tqdm=False)] for mode in MODES}


# Three engines; the logits tests above and test_artifact_cache's kiln-vs-eager LLM runs cover it.
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["stock", "kiln"])
def test_llm_greedy_tokens_match_eager(tiny_llm_outputs, mode):
    assert tiny_llm_outputs[mode] == tiny_llm_outputs["eager"]


@pytest.mark.slow
def test_smollm2_kiln_greedy_tokens_match_eager():
    from kiln import LLM, SamplingParams

    prompts = ["What is the capital of France?", "Write a haiku about the sea.", "2 + 2 ="]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    outs = {mode: [o.outputs[0].token_ids for o in LLM("smollm2-135m-instruct", compile={"mode": mode}).generate(
        prompts, params, use_tqdm=False)] for mode in ("eager", "kiln")}
    assert outs["kiln"] == outs["eager"]
