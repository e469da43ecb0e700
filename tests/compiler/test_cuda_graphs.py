"""CUDA graphs and the CUDA step path: greedy tokens with and without graphs, and against HF.

The ``gpu`` tests need CUDA (skipped without it). The others run anywhere: dispatch decisions, the
padding of step buffers, and piecewise graphs end to end on the CPU with graph capture emulated (each
"graph" re-runs its piece on its static inputs and copies the results into its static outputs,
so a wrong address, a missed copy or attention seeing padding changes the tokens).

Exactness: graphs replay the same kernels on padded batches with fixed decode splits, so in
float32 the greedy tokens must agree exactly with the no-graph run; in bfloat16 the rounding of
differently split attention sums may flip a near-tie late in a sequence, so there only the first
tokens must agree and most of the rest.
"""

from __future__ import annotations

import pytest
import torch

from kiln.compiler.graph_sets import dispatch
from kiln.compiler.cudagraph import GraphMode, wanted_graph_modes
from kiln.compiler.inputs import NULL_BLOCK_ID, InputBuffers, InputLimits
from kiln.compiler.piecewise import PieceGraphs, PiecewiseCUDAGraphs
from tests.helpers.cuda_graphs import (MIXED_CAPTURE_SIZES, agreeing_prefix, emulated_graph, graph_prompts,
                                       greedy_ids, mixed_llm, mixed_workload)

def _llm(model: str, dtype: str, mode: str, cudagraph: str, device: str = "cuda", compile_extra=None, **extra):
    from kiln import LLM

    return LLM(model=model, dtype=dtype, device=device, max_model_len=1024,
               compile={"mode": mode, "cudagraph": cudagraph, "capture_sizes": (1, 2, 4, 8), **(compile_extra or {})},
               cache={"kv_cache_memory_gib": 1.0}, scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 256},
               **extra)


class _Sizes:
    """Stands in for full or piecewise graphs in dispatch decisions."""

    def __init__(self, *sizes: int) -> None:
        self.sizes = list(sizes)

    def padded_size(self, n):
        return next((s for s in self.sizes if s >= n), None)


def test_dispatch_full_pads_uniform_decodes_only():
    full = _Sizes(1, 2, 4, 8)
    assert dispatch(full, None, 5, 5, 5) == (GraphMode.FULL, 8)
    assert dispatch(full, None, 20, 5, 4) == (GraphMode.NONE, 20)  # a prefill in the batch
    assert dispatch(full, None, 9, 9, 9) == (GraphMode.NONE, 9)  # more requests than every capture size
    assert dispatch(None, None, 1, 1, 1) == (GraphMode.NONE, 1)


def test_dispatch_piecewise_pads_every_batch_that_fits():
    pieces = _Sizes(1, 2, 4, 8, 16, 32)
    assert dispatch(None, pieces, 20, 5, 4) == (GraphMode.PIECEWISE, 32)  # mixed: tokens padded
    assert dispatch(None, pieces, 5, 5, 5) == (GraphMode.PIECEWISE, 8)  # decode-only too
    assert dispatch(None, pieces, 17, 1, 0) == (GraphMode.PIECEWISE, 32)  # one prefill chunk
    assert dispatch(None, pieces, 32, 3, 1) == (GraphMode.PIECEWISE, 32)  # exactly a size: no padding
    assert dispatch(None, pieces, 33, 3, 1) == (GraphMode.NONE, 33)  # too big for every size


def test_dispatch_full_and_piecewise():
    full, pieces = _Sizes(1, 2, 4, 8), _Sizes(1, 2, 4, 8, 16, 32)
    assert dispatch(full, pieces, 3, 3, 3) == (GraphMode.FULL, 4)  # decode-only: full graph
    assert dispatch(full, pieces, 20, 5, 4) == (GraphMode.PIECEWISE, 32)  # mixed: piece graphs
    assert dispatch(full, pieces, 12, 12, 12) == (GraphMode.PIECEWISE, 16)  # decodes past the full sizes
    assert dispatch(full, pieces, 40, 5, 4) == (GraphMode.NONE, 40)


def test_wanted_graph_modes(caplog):
    assert wanted_graph_modes("none") == set()
    assert wanted_graph_modes("full") == wanted_graph_modes("full", has_pieces=False) == {GraphMode.FULL}
    assert wanted_graph_modes("piecewise") == {GraphMode.PIECEWISE}
    assert wanted_graph_modes("full_and_piecewise") == {GraphMode.FULL, GraphMode.PIECEWISE}
    assert not caplog.records
    # eager / stock: no pieces to capture; piecewise falls back, loudly.
    assert wanted_graph_modes("piecewise", has_pieces=False) == set()
    assert "running without CUDA graphs" in caplog.text
    assert wanted_graph_modes("full_and_piecewise", has_pieces=False) == {GraphMode.FULL}
    assert "mixed batches run without graphs" in caplog.text


def test_pad_tokens_fills_null_rows_and_metadata_stays_real():
    buf = InputBuffers(InputLimits(16, 4, 8), torch.device("cpu"))
    buf.ids_np[:16], buf.pos_np[:16], buf.slot_np[:16] = 7, 9, 99  # stale values of an earlier step
    # Two requests: a decode at position 20 (block 3) and a 4-token prefill (block 5).
    buf.ids_np[:5], buf.pos_np[:5] = [11, 12, 13, 14, 15], [20, 0, 1, 2, 3]
    buf.slot_np[:5] = [3 * 16 + 4, 5 * 16, 5 * 16 + 1, 5 * 16 + 2, 5 * 16 + 3]
    buf.seq_lens_np[:2], buf.qsl_np[:3] = [21, 4], [0, 1, 5]
    buf.pad_tokens(5, 8)
    assert buf.ids_np[:9].tolist() == [11, 12, 13, 14, 15, 0, 0, 0, 7]
    assert buf.pos_np[:9].tolist() == [20, 0, 1, 2, 3, 0, 0, 0, 9]
    assert buf.slot_np[5:9].tolist() == [NULL_BLOCK_ID] * 3 + [99]
    buf.upload(8, 2)
    assert buf.input_ids[:8].tolist() == [11, 12, 13, 14, 15, 0, 0, 0]
    meta = buf.metadata(5, 2, 1, [1, 4], [21, 4])
    assert meta.slot_mapping.shape == (5,) and meta.query_start_loc.tolist() == [0, 1, 5]
    assert meta.seq_lens.tolist() == [21, 4] and meta.block_tables.shape == (2, 8)


class _Owner:
    """The part of PiecewiseCUDAGraphs a PieceGraphs reads."""

    def __init__(self, constants):
        self.step, self.record, self.constant_ids = None, emulated_graph, {id(t) for t in constants}


def test_piece_graph_copies_inputs_that_moved_and_checks_scalars():
    from kiln.compiler.piecewise import _Step

    weight = torch.full((4,), 2.0)
    calls = []

    def piece(x, w, n):
        calls.append(n)
        return (x * w + n, x[:1].clone())

    owner = _Owner(constants=[weight])
    wrapper = PieceGraphs("submod_0", piece, owner)
    static_x = torch.zeros(8, 4)
    owner.step = _Step(8, 1, capturing=True)
    wrapper(static_x, weight, 8)  # warm-up, then capture
    owner.step = _Step(8, 3, capturing=False)
    graph = wrapper.graphs[8]
    assert graph.checked == [0] and graph.scalars == [(2, 8)]  # the weight is never compared
    static_x.fill_(1.0)  # same address: read in place
    out, first = wrapper(static_x, weight, 8)
    assert out is graph.outputs[0] and torch.equal(out, torch.full((8, 4), 10.0))
    moved = torch.full((8, 4), 3.0)  # another address: copied into the captured input
    out, first = wrapper(moved, weight, 8)
    assert torch.equal(out, torch.full((8, 4), 14.0)) and torch.equal(static_x, moved)
    with pytest.raises(RuntimeError, match="captured with 8"):
        wrapper(static_x, weight, 4)
    owner.step = None  # outside a step: straight through, no graph
    assert wrapper(torch.ones(2, 4), weight, 2)[0].shape == (2, 4)


def _spy_attention(graphs: PiecewiseCUDAGraphs) -> list[tuple[int, int, int]]:
    """Per attention call: (rows of q, tokens in the metadata, slots in the metadata)."""
    from kiln.forward_context import get_forward_context

    seen = []
    for call in graphs.attention_calls:
        def spy(q, *args, inner=call.inner):
            meta = get_forward_context().attn
            seen.append((q.shape[0], int(meta.query_start_loc[-1]), meta.slot_mapping.shape[0]))
            return inner(q, *args)

        call.inner = spy
    return seen


def _assert_mixed_batches_padded(log) -> None:
    assert any(mode is GraphMode.PIECEWISE and prefill and padded > n for mode, n, padded, prefill in log), log
    assert any(mode is GraphMode.NONE and n > MIXED_CAPTURE_SIZES[-1] for mode, n, _, _ in log), log
    assert all(padded >= n for _, n, padded, _ in log)


def test_piecewise_graphs_emulated_on_cpu_match_no_graphs(dispatch_log):
    """The whole piecewise path (dispatch, padding, wrappers, static buffers, attention on the real
    rows) on CPU, with graph capture emulated: same greedy tokens as without graphs."""
    llm = mixed_llm("kiln", "none", device="cpu")
    vocab = llm.engine.executor.vocab_size
    want = mixed_workload(llm, vocab)
    compiled = llm.engine.executor.runner.compiled
    graphs = PiecewiseCUDAGraphs(compiled.forward, compiled.inputs, MIXED_CAPTURE_SIZES + (128,), record=emulated_graph)
    assert graphs.sizes == list(MIXED_CAPTURE_SIZES)  # 128 > max_num_batched_tokens: dropped
    assert len(graphs.pieces) == len(graphs.attention_calls) + 1
    assert {c.buffer_key for c in graphs.attention_calls} == {"shared"}
    graphs.capture(compiled._capture_scope, compiled.kv_caches)
    assert graphs.captured_sizes == set(MIXED_CAPTURE_SIZES)
    assert all(set(p.graphs) == set(MIXED_CAPTURE_SIZES) for p in graphs.pieces)
    seen = _spy_attention(graphs)
    compiled.piecewise_graphs = graphs
    dispatch_log.clear()
    assert mixed_workload(llm, vocab) == want
    _assert_mixed_batches_padded(dispatch_log)
    assert seen and all(q_rows == num_tokens == num_slots for q_rows, num_tokens, num_slots in seen)  # no padding
    compiled.piecewise_graphs = None  # the wrappers stay installed and call straight through
    assert mixed_workload(llm, vocab) == want


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "kiln"])
def test_full_graphs_match_no_graphs_float32(mode):
    prompts = graph_prompts(49152)
    want = greedy_ids(_llm("random:tiny", "float32", "eager", "none"), prompts, 24)
    llm = _llm("random:tiny", "float32", mode, "full")
    assert llm.engine.executor.runner.compiled.full_graphs is not None
    assert greedy_ids(llm, prompts, 24) == want
    assert greedy_ids(llm, prompts[:1], 24) == want[:1]  # batch 1: capture size 1, no padding


@pytest.mark.gpu
def test_groups_of_layers_in_full_graphs_match_eager_float32():
    """compile.split_every=4 on CUDA (full graphs; piecewise ones need 1): the five pieces between
    the cuts of Qwen2.5-0.5B's 24 layers hold four attention calls each, numbered from 0, and share
    one build; each sets its first layer while it runs, also while its graph is captured. A piece
    reading another layer's cache would lose eager's tokens from the first decode on."""
    prompts = graph_prompts(151936)
    want = greedy_ids(_llm("random:qwen2.5-0.5b", "float32", "eager", "none"), prompts, 24)
    llm = _llm("random:qwen2.5-0.5b", "float32", "kiln", "full", compile_extra={"split_every": 4})
    from kiln.compiler.piece import CompiledPiece

    graph = llm.engine.executor.runner.compiled.forward.split_graph  # captured, or loaded from the cache
    pieces = [p for p in graph.__dict__.values() if isinstance(p, CompiledPiece)]
    assert len({p.key for p in pieces}) == 3 and sorted(p.layer_base for p in pieces) == [0, 1, 5, 9, 13, 17, 21]
    got = greedy_ids(llm, prompts, 24)
    prefixes = [agreeing_prefix(g, w) for g, w in zip(got, want)]
    assert min(prefixes) >= 8 and sum(prefixes) >= 0.75 * 24 * len(prompts), prefixes


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["random:tiny", "random:qwen2.5-0.5b"])
def test_full_graphs_match_no_graphs_bfloat16(model):
    prompts = graph_prompts(49152)
    llm = _llm(model, "bfloat16", "eager", "full")
    runner = llm.engine.executor.runner
    got = greedy_ids(llm, prompts, 32)
    graphs, runner.compiled.full_graphs = runner.compiled.full_graphs, None  # the same engine, graph dispatch off
    want = greedy_ids(llm, prompts, 32)
    runner.compiled.full_graphs = graphs
    prefixes = [agreeing_prefix(g, w) for g, w in zip(got, want)]
    assert min(prefixes) >= 4, prefixes
    assert sum(prefixes) >= 0.5 * 32 * len(prompts), prefixes


def _hf_from_kiln(runner):
    """A transformers model holding the kiln model's (random) weights, in the same dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = runner.arch.to_hf_config()
    config = AutoConfig.for_model(d.pop("model_type"), **d)
    hf = AutoModelForCausalLM.from_config(config, dtype=runner.dtype).to(runner.device).eval()
    state = {name: t.detach().clone() for name, t in runner.model.weight_targets()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return hf


@pytest.mark.gpu
def test_full_graphs_match_hf_float32():
    llm = _llm("random:tiny", "float32", "kiln", "full")
    prompts = graph_prompts(49152, lens=(16, 40))
    got = greedy_ids(llm, prompts, 16)
    hf = _hf_from_kiln(llm.engine.executor.runner)
    hf.generation_config.eos_token_id = None  # like ignore_eos: an eos token is just a token
    for prompt, tokens in zip(prompts, got):
        ids = torch.tensor([prompt], device="cuda")
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                              pad_token_id=0)
        assert out[0, len(prompt):].tolist() == tokens


@pytest.mark.gpu
@pytest.mark.parametrize("cudagraph", ["piecewise", "full_and_piecewise"])
def test_piecewise_graphs_match_no_graphs_float32(cudagraph, dispatch_log):
    want = mixed_workload(mixed_llm("kiln", "none"), 49152)
    llm = mixed_llm("kiln", cudagraph, startup="complete")  # every size before the first step (lazy: test_lazy_capture)
    runner = llm.engine.executor.runner
    graphs = runner.compiled.piecewise_graphs
    assert graphs is not None and graphs.captured_sizes == set(MIXED_CAPTURE_SIZES)
    assert graphs.capture_seconds > 0
    assert (runner.compiled.full_graphs is not None) == (cudagraph == "full_and_piecewise")
    dispatch_log.clear()
    assert mixed_workload(llm, 49152) == want
    _assert_mixed_batches_padded(dispatch_log)
    decode_only = {mode for mode, n, _, prefill in dispatch_log if not prefill}
    assert decode_only == ({GraphMode.FULL} if cudagraph == "full_and_piecewise" else {GraphMode.PIECEWISE})
    assert all(mode is not GraphMode.FULL for mode, _, _, prefill in dispatch_log if prefill)


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["random:tiny", "random:qwen2.5-0.5b"])
def test_piecewise_graphs_match_no_graphs_bfloat16(model):
    llm = mixed_llm("kiln", "full_and_piecewise", dtype="bfloat16", model=model)
    runner = llm.engine.executor.runner
    got = mixed_workload(llm, 49152, max_tokens=32)
    graphs = runner.compiled.full_graphs, runner.compiled.piecewise_graphs
    runner.compiled.full_graphs = runner.compiled.piecewise_graphs = None  # the same engine, graph dispatch off
    want = mixed_workload(llm, 49152, max_tokens=32)
    runner.compiled.full_graphs, runner.compiled.piecewise_graphs = graphs
    prefixes = [agreeing_prefix(got[r], want[r]) for r in want]
    assert min(prefixes) >= 4, prefixes
    assert sum(prefixes) >= 0.5 * 32 * len(want), prefixes


@pytest.mark.gpu
def test_piecewise_needs_kiln_mode(caplog):
    """compile.mode=eager has no pieces: piecewise warns and runs without graphs, full still works."""
    want = mixed_workload(mixed_llm("eager", "none"), 49152)
    llm = mixed_llm("eager", "full_and_piecewise")
    runner = llm.engine.executor.runner
    assert runner.compiled.piecewise_graphs is None and runner.compiled.full_graphs is not None
    assert "piecewise graphs need compile.mode=kiln" in caplog.text
    assert mixed_workload(llm, 49152) == want
    runner = mixed_llm("eager", "piecewise").engine.executor.runner
    assert runner.compiled.piecewise_graphs is None and runner.compiled.full_graphs is None


# ---- graph memory in the KV plan ------------------------------------------------------------------
def test_graph_memory_estimate_extrapolates_from_the_profiled_sizes():
    from kiln.compiler import GraphMemoryEstimate

    sizes = (1, 2, 4) + tuple(range(8, 513, 8))
    est = GraphMemoryEstimate(sizes, largest_bytes=1000 * 2**20, per_size_bytes=4 * 2**20)
    margin, slack = GraphMemoryEstimate.MARGIN, GraphMemoryEstimate.SLACK_BYTES
    assert est.bytes() == int(margin * (1000 * 2**20 + 4 * 2**20 * (len(sizes) - 1)) + slack)
    # fewer sizes: the working set shrinks with the largest size kept, and so does the graph count
    assert est.bytes(3) == int(margin * (1000 * 2**20 * 4 / 512 + 4 * 2**20 * 2) + slack)
    assert est.bytes(0) == 0 and est.bytes(3) < est.bytes(10) < est.bytes()


def test_graphs_that_leave_no_room_fail_at_start_saying_what_to_drop():
    from kiln.compiler import GraphMemoryEstimate
    from kiln.runtime.kv_sizing import KVShape, _check_graphs_leave_room

    shape = KVShape(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    sizes = (1, 2, 4) + tuple(range(8, 513, 8))
    est = GraphMemoryEstimate(sizes, largest_bytes=4 * 2**30, per_size_bytes=32 * 2**20)
    need = (8192 // 16 + 1) * shape.bytes_per_block  # one request of max_model_len=8192: ~1 GiB
    _check_graphs_leave_room(est, need, shape, 8192)  # exactly enough: fine
    with pytest.raises(ValueError, match=r"CUDA graphs for 67 capture sizes \(1\.\.512\).*drop the \d+ largest "
                                         r"capture sizes \(compile\.capture_sizes up to \d+"):
        _check_graphs_leave_room(est, need - 2**30, shape, 8192)
    with pytest.raises(ValueError, match="set compile.cudagraph=none"):
        _check_graphs_leave_room(est, -est.bytes(), shape, 8192)  # not even one size fits


def test_piece_graphs_beside_full_graphs_take_a_thinner_size_list():
    from kiln.compiler.cudagraph import GraphMode, piecewise_capture_sizes
    from kiln.config import default_capture_sizes

    sizes = default_capture_sizes(512)
    both = piecewise_capture_sizes(sizes, {GraphMode.FULL, GraphMode.PIECEWISE})
    assert both == (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 320, 384, 448, 512)
    assert piecewise_capture_sizes(sizes, {GraphMode.PIECEWISE}) == sizes  # alone they take every batch
    assert piecewise_capture_sizes((3, 5, 100, 300), {GraphMode.FULL, GraphMode.PIECEWISE}) == (3, 5, 300)
    assert piecewise_capture_sizes(default_capture_sizes(100), {GraphMode.FULL, GraphMode.PIECEWISE})[-1] == 100


def test_memory_profile_cache_round_trip_and_key(tmp_path, monkeypatch, caplog):
    from kiln.compiler import ArtifactCache, GraphMemoryEstimate
    from kiln.runtime.kv_sizing import MemoryProfile, MemoryProfileCache

    artifacts = ArtifactCache(str(tmp_path), "m")
    cache = MemoryProfileCache(artifacts, "key1", max_num_seqs=512, total_memory=80)
    assert cache.load() is None
    profile = MemoryProfile(123 << 20, GraphMemoryEstimate((1, 2, 512), 600 << 20, 4 << 20, 2))
    cache.store(profile)
    assert MemoryProfileCache(artifacts, "key1", max_num_seqs=512, total_memory=80).load() == profile
    # another compiled forward, scheduler or card: not the same profile
    assert MemoryProfileCache(artifacts, "key2", max_num_seqs=512, total_memory=80).load() is None
    assert MemoryProfileCache(artifacts, "key1", max_num_seqs=256, total_memory=80).load() is None
    no_graphs = MemoryProfileCache(artifacts, "key1", max_num_seqs=1, total_memory=80)
    no_graphs.store(MemoryProfile(7, None))
    assert no_graphs.load() == MemoryProfile(7, None)
    cache.path.write_text("{not json")  # a damaged file is a miss, with a warning
    assert cache.load() is None and "unreadable memory profile" in caplog.text
    monkeypatch.setenv("KILN_CACHE_READ_ONLY", "1")  # a read-only cache is never written
    ro = MemoryProfileCache(artifacts, "key3")
    ro.store(profile)
    assert not ro.path.exists()


def test_weak_refs_leave_cpu_tensors_alone():
    from kiln.compiler.cudagraph import weak_refs

    t = torch.ones(3)
    assert weak_refs((t, [t], {"a": t}, 3))[0] is t


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_weak_ref_aliases_cuda_memory_without_owning_it():
    from kiln.compiler.cudagraph import weak_ref

    t = torch.arange(6, device="cuda", dtype=torch.float32).view(2, 3)[1:]
    w = weak_ref(t)
    assert w.data_ptr() == t.data_ptr() and w.shape == t.shape and torch.equal(w, t)
    t.add_(1)
    assert torch.equal(w, t)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_default_config_captures_every_size_and_sizes_the_kv_cache_after_the_graphs(caplog):
    """The default modes on a GPU with compile.startup=complete: kiln mode, full graphs at 1, 2, 4, 8, ...,
    512 and piece graphs, every size captured at start-up; the graph memory of every size is profiled before the
    KV cache is sized, and the tokens match the run without graphs."""
    import logging

    from kiln import LLM

    with caplog.at_level(logging.INFO, logger="kiln"):
        llm = LLM(model="random:tiny", dtype="float32", max_model_len=1024, cache={"gpu_memory_fraction": 0.5},
                  compile={"startup": "complete"})
    runner = llm.engine.executor.runner
    assert (runner.compile_config.mode, runner.compile_config.cudagraph) == ("kiln", "full_and_piecewise")
    assert runner.compiled.full_graphs.sizes == list((1, 2, 4) + tuple(range(8, 513, 8)))
    assert runner.compile_config.capture == "startup" and not llm.engine.has_pending_captures
    assert runner.compiled.full_graphs.captured_sizes == runner.compiled.full_graphs.sizes
    # beside full graphs, a thinner list up to 512, then every 256 tokens up to max_num_batched_tokens
    assert sorted(runner.compiled.piecewise_graphs.captured_sizes) == [1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 320,
                                                                       384, 448, 512, *range(768, 4097, 256)]
    assert runner.graph_estimate is not None
    assert 0 < runner.compiled.graph_memory_bytes <= runner.graph_estimate.bytes()
    assert any("CUDA graphs profiled" in r.getMessage() or "memory profile from the cache" in r.getMessage()
               for r in caplog.records)
    prompts = graph_prompts(runner.arch.vocab_size)
    with_graphs = greedy_ids(llm, prompts, 8)
    full, pieces = runner.compiled.full_graphs, runner.compiled.piecewise_graphs
    runner.compiled.full_graphs = runner.compiled.piecewise_graphs = None
    try:
        assert greedy_ids(llm, prompts, 8) == with_graphs
    finally:
        runner.compiled.full_graphs, runner.compiled.piecewise_graphs = full, pieces
