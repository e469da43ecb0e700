"""C++ CPU paged attention (``csrc/paged_attention.cpp``, ``kiln/ops/cpu_attention.py``) vs the reference.

Every case draws fresh random q/k/v/cache (never zeros), lays each request's blocks out of order,
gives contexts a partial last block, hands the kernel q/k/v as row-strided views of one fused qkv
tensor, poisons the output with NaN, and requires the cache to match the reference bit for bit
and the output within the dtype's tolerance (float32 1e-5, bfloat16 2e-2).

The kernel runs on two threads (a test worker may have a share of one core): a batch with enough
work splits its items between them, a batch of one request its heads. The module skips only when
``kiln._C`` is not built (``pip install --no-build-isolation -e .`` builds it; the Makefile does).
"""

from __future__ import annotations

import pytest
import torch

from kiln.forward_context import ForwardContext, forward_context
from kiln.ops import cpu_attention as ca
from kiln.ops.attention import attend_paged_reference
from kiln.ops.registry import select_kernels
from tests.helpers.threads import torch_threads

if not ca.load_extension():
    pytest.skip("kiln._C is not built: run `pip install --no-build-isolation -e .`", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def two_threads():
    with torch_threads(2):
        yield


def _check(seed, *, decodes=(), prefills=(), group=4, num_kv_heads=2, head_dim=64, block_size=16,
           dtype=torch.float32, fused_qkv=True, sliding_window=0, logit_softcap=0.0):
    spec = ca.PagedBatchSpec(decode_seq_lens=decodes, prefill_chunks=prefills, num_heads=group * num_kv_heads,
                             num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype,
                             fused_qkv=fused_qkv)
    batch = ca.random_paged_batch(spec, seed=seed)
    if fused_qkv:
        assert batch.q.stride(0) > batch.q.shape[1] * head_dim  # really a strided view
    return ca.check_against_reference(batch, sliding_window, logit_softcap)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_decode_matches_reference(group, head_dim):
    _check(1, decodes=(1, 23, 50, 16), group=group, head_dim=head_dim)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_prefill_with_cached_prefix_matches_reference(group, head_dim):
    # Chunks longer than one work-item tile (32 rows) so a prefill spans several tiles.
    _check(2, prefills=((45, 19), (19, 19), (90, 70)), group=group, head_dim=head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16])
def test_mixed_batch_matches_reference(block_size, dtype):
    # Decodes, a chunk after a cached prefix, a fresh prefill, and a one-token prefill chunk.
    _check(3, decodes=(7, 33), prefills=((37, 6), (21, 21), (30, 1)), group=4, block_size=block_size, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_odd_group_and_block_size_bf16_and_fp32(dtype):
    _check(4, decodes=(5, 70), prefills=((75, 11),), group=3, num_kv_heads=3, block_size=8, dtype=dtype)


def test_contiguous_inputs_and_single_request():
    # Batch 1 over 160 keys is work enough for two threads (kMinParallelWork): the group is split.
    _check(5, decodes=(160,), group=8, fused_qkv=False)
    _check(6, prefills=((64, 64),), group=1, num_kv_heads=1, fused_qkv=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window, softcap", [(7, 0.0), (20, 0.0), (1, 0.0), (0, 0.7), (13, 0.7)])
def test_sliding_window_and_softcap_match_reference(window, softcap, dtype):
    # Windows shorter than a key tile (16), than a work-item tile, and of one key; a cap small enough
    # that tanh saturates (random scores are of order 1). Contexts both shorter and longer than W.
    _check(8, decodes=(5, 40, 70), prefills=((75, 11), (45, 45), (30, 1)), group=4, block_size=8, dtype=dtype,
           sliding_window=window, logit_softcap=softcap)
    _check(9, decodes=(160,), group=8, fused_qkv=False, sliding_window=window, logit_softcap=softcap)  # batch 1


def test_window_and_softcap_change_the_output():
    """The reference really masks and caps (else the test above would compare two no-ops)."""
    batch = ca.random_paged_batch(ca.PagedBatchSpec(decode_seq_lens=(40,), prefill_chunks=((45, 45),)), seed=10)
    outs = [attend_paged_reference(batch.q, batch.k, batch.v, batch.kv_cache.clone(), batch.meta, 0.125, w, c)
            for w, c in ((0, 0.0), (7, 0.0), (0, 0.7))]
    assert not torch.allclose(outs[0], outs[1]) and not torch.allclose(outs[0], outs[2])
    # A window at least as long as every context changes nothing.
    wide = attend_paged_reference(batch.q, batch.k, batch.v, batch.kv_cache.clone(), batch.meta, 0.125, 45)
    torch.testing.assert_close(wide, outs[0])


@pytest.fixture
def lanes_of_this_cpu():
    """The vector widths (floats) this CPU runs the kernel at, widest last; width restored after."""
    widest = ca.set_attention_lanes(0)
    yield [w for w in (4, 8, 16) if w <= widest]
    ca.set_attention_lanes(0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_vector_width_matches_reference(lanes_of_this_cpu, dtype):
    # Each instruction set's width (16 floats on AVX-512, 8 on AVX2, 4 on the baseline) tiles the
    # keys by its own width: blocks smaller than a tile, a padded head_dim, windows and soft-caps.
    for lanes in lanes_of_this_cpu:
        assert ca.set_attention_lanes(lanes) == lanes
        _check(20 + lanes, decodes=(3, 41), prefills=((50, 17), (12, 12)), group=3, num_kv_heads=2, head_dim=96,
               block_size=4, dtype=dtype)
        _check(40 + lanes, decodes=(1, 29), prefills=((66, 33),), group=4, num_kv_heads=2, block_size=8, dtype=dtype,
               sliding_window=9, logit_softcap=0.7)


def test_vector_width_beyond_the_cpu_is_refused(lanes_of_this_cpu):
    ca.set_attention_lanes(4)
    for bad in (3, 32, -1, *(w for w in (8, 16) if w not in lanes_of_this_cpu)):
        with pytest.raises(ValueError, match="set_attention_lanes"):
            ca.set_attention_lanes(bad)
        assert torch.ops.kiln_cpu.set_attention_lanes(bad) == 4  # the op itself leaves the width as it was
    assert ca.set_attention_lanes(0) == lanes_of_this_cpu[-1] == torch.ops.kiln_cpu.max_attention_lanes()


def test_store_writes_exactly_the_new_slots():
    batch = ca.random_paged_batch(ca.PagedBatchSpec(decode_seq_lens=(3, 17), prefill_chunks=((40, 21),)), seed=7)
    cache = batch.kv_cache.clone()
    m = batch.meta
    torch.ops.kiln_cpu.attend_paged_cpu(batch.q, batch.k, batch.v, cache, m.slot_mapping, m.block_tables,
                                        m.seq_lens, m.query_start_loc, 0.125)
    changed = (cache != batch.kv_cache).flatten(3).any(-1)  # [2, num_blocks, block_size]
    slots = changed.flatten(1).any(0).nonzero().flatten()
    assert torch.equal(slots, m.slot_mapping.sort().values)
    kvh, hd = batch.k.shape[1:]
    assert torch.equal(cache[0].view(-1, kvh, hd)[m.slot_mapping], batch.k)
    assert torch.equal(cache[1].view(-1, kvh, hd)[m.slot_mapping], batch.v)


# Each bad input and the message it must raise, with the offending values in it (the C++ builds
# these messages without std::ostream: csrc/error.h).
BAD_INPUTS = {
    "block id": (lambda b, m: dict(block_tables=torch.full_like(m.block_tables, 10_000)),
                 r"request 0: block id 10000 out of range"),
    "slot": (lambda b, m: dict(slot_mapping=torch.full_like(m.slot_mapping, 10**9)),
             r"token 0: slot 1000000000 out of range"),
    "query longer than context": (lambda b, m: dict(seq_lens=torch.zeros_like(m.seq_lens)),
                                  r"request 0: query length 1 vs seq_len 0"),
    "table too narrow": (lambda b, m: dict(block_tables=m.block_tables[:, :1]),
                         r"request 0: seq_len 9 needs 3 blocks, table has 1"),
    "heads": (lambda b, m: dict(q=b.q[:, :3]), r"num_heads \(3\) must be a multiple of num_kv_heads \(2\)"),
    "dtype": (lambda b, m: dict(q=b.q.half(), k=b.k.half(), v=b.v.half()),
              r"supports float32 and bfloat16, got Half"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_metadata_is_an_error_not_a_crash(case):
    batch = ca.random_paged_batch(ca.PagedBatchSpec(decode_seq_lens=(9,), num_heads=8, num_kv_heads=2,
                                                    block_size=4), seed=8)
    m = batch.meta
    args = dict(q=batch.q, k=batch.k, v=batch.v, kv_cache=batch.kv_cache, slot_mapping=m.slot_mapping,
                block_tables=m.block_tables, seq_lens=m.seq_lens, query_start_loc=m.query_start_loc)
    change, message = BAD_INPUTS[case]
    args.update(change(batch, m))
    with pytest.raises(RuntimeError, match=message):
        torch.ops.kiln_cpu.attend_paged_cpu(*args.values(), 0.125)


def test_a_layer_past_the_context_caches_is_an_error():
    batch = _small_batch(seed=13)
    with ca.attention_context(ForwardContext(attn=batch.meta, kv_caches=[batch.kv_cache])):
        with pytest.raises(RuntimeError, match="attend_paged: layer 5 of 1"):
            torch.ops.kiln_cpu.attend_paged(batch.q, batch.k, batch.v, 5, 0.125)


def _small_batch(seed=9):
    spec = ca.PagedBatchSpec(decode_seq_lens=(9, 30), prefill_chunks=((26, 10),), num_heads=8, num_kv_heads=2)
    return ca.random_paged_batch(spec, seed=seed)


def test_cpu_kernels_route_kiln_attend_paged_to_the_kernel():
    batch = _small_batch()
    scale = batch.q.shape[-1] ** -0.5
    ref = attend_paged_reference(batch.q, batch.k, batch.v, batch.kv_cache.clone(), batch.meta, scale)
    kernels = select_kernels("cpu")
    assert kernels.attention.impl is ca.cpu_attend_paged
    assert "kiln_cpu::attend_paged" in kernels.split_op_names()
    # The generic op runs the forward context's kernel (eager and stock modes); the kernel op its own.
    for op in (torch.ops.kiln.attend_paged, torch.ops.kiln_cpu.attend_paged):
        cache = batch.kv_cache.clone()
        ctx = ForwardContext(attn=batch.meta, kv_caches=[cache], attention_impl=kernels.attention.impl)
        with forward_context(ctx):
            out = op(batch.q, batch.k, batch.v, 0, scale)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_attention_context_runs_the_kernel_from_cpp(monkeypatch):
    """Inside ``attention_context`` the C++ op reads the caches and metadata handed to C++: no
    Python op runs (the Python path is made to fail), and every layer gets its own cache."""
    batch = _small_batch(seed=12)
    scale = batch.q.shape[-1] ** -0.5
    kernels = select_kernels("cpu")
    assert kernels.attention.forward_scope is ca.attention_context
    ref_cache = batch.kv_cache.clone()
    ref = attend_paged_reference(batch.q, batch.k, batch.v, ref_cache, batch.meta, scale)
    caches = [torch.zeros_like(batch.kv_cache), batch.kv_cache.clone()]
    ctx = ForwardContext(attn=batch.meta, kv_caches=caches, attention_impl=kernels.attention.impl)

    def python_path(*args, **kwargs):
        raise AssertionError("the Python attention path ran inside the attention context")

    monkeypatch.setattr(ca, "cpu_attend_paged", python_path)
    with forward_context(ctx), ca.attention_context(ctx):
        assert torch.ops.kiln_cpu.has_attention_context()
        with pytest.raises(RuntimeError, match="already set"):
            with ca.attention_context(ctx):
                pass
        out = torch.ops.kiln_cpu.attend_paged(batch.q, batch.k, batch.v, 1, scale)
    assert not torch.ops.kiln_cpu.has_attention_context()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(caches[1], ref_cache) and not caches[0].any()


def test_a_build_without_the_context_op_runs_the_kernel_through_python(monkeypatch):
    monkeypatch.setattr(ca, "has_context_op", lambda: False)
    kernels = select_kernels("cpu")
    assert kernels.attention.op_name == "kiln_cpu::attend_paged_py"
    assert kernels.attention.impl is ca.cpu_attend_paged
    batch = _small_batch(seed=14)
    with ca.attention_context(ForwardContext(attn=batch.meta, kv_caches=[batch.kv_cache])):
        assert not torch.ops.kiln_cpu.has_attention_context()


def test_attention_context_is_left_to_python_on_a_calibration_step():
    batch = _small_batch(seed=13)
    ctx = ForwardContext(attn=batch.meta, kv_caches=[batch.kv_cache], calibrate_kv_scales=True)
    with ca.attention_context(ctx):
        assert not torch.ops.kiln_cpu.has_attention_context()


def test_without_the_extension_the_reference_is_selected(monkeypatch):
    monkeypatch.setattr(ca, "_extension_loaded", False)
    kernels = select_kernels("cpu")
    assert kernels.attention.impl is attend_paged_reference
    assert "kiln_cpu::attend_paged" not in kernels.split_op_names()
    batch = _small_batch()  # and the drop-in still works, on the reference
    scale = batch.q.shape[-1] ** -0.5
    ref = attend_paged_reference(batch.q, batch.k, batch.v, batch.kv_cache.clone(), batch.meta, scale)
    out = ca.cpu_attend_paged(batch.q, batch.k, batch.v, batch.kv_cache.clone(), batch.meta, scale)
    torch.testing.assert_close(out, ref)


def test_float16_falls_back_to_the_reference():
    batch = ca.random_paged_batch(ca.PagedBatchSpec(decode_seq_lens=(5,), prefill_chunks=((9, 4),),
                                                    dtype=torch.float16), seed=11)
    scale = batch.q.shape[-1] ** -0.5
    ref = attend_paged_reference(batch.q, batch.k, batch.v, batch.kv_cache.clone(), batch.meta, scale)
    out = ca.cpu_attend_paged(batch.q, batch.k, batch.v, batch.kv_cache.clone(), batch.meta, scale)
    torch.testing.assert_close(out, ref)


def test_ops_trace_under_torch_compile_fullgraph():
    """Both ops compile with fullgraph=True: shapes come from their fake impls."""
    batch = _small_batch(seed=10)
    scale = batch.q.shape[-1] ** -0.5
    ref_cache = batch.kv_cache.clone()
    ref = attend_paged_reference(batch.q, batch.k, batch.v, ref_cache, batch.meta, scale)
    m = batch.meta

    @torch.compile(fullgraph=True, backend="aot_eager")
    def layer(qkv, cache):  # the model's view: split the fused projection, attend, project out
        q, k, v = (t.view(t.shape[0], -1, 64) for t in qkv.split([8 * 64, 2 * 64, 2 * 64], dim=-1))
        o = torch.ops.kiln_cpu.attend_paged(q, k, v, 0, scale)
        o2 = torch.ops.kiln_cpu.attend_paged_cpu(q, k, v, cache, m.slot_mapping, m.block_tables, m.seq_lens,
                                                 m.query_start_loc, scale)
        return o.flatten(1) * 2, o2.flatten(1)

    qkv = torch.cat([batch.q.flatten(1), batch.k.flatten(1), batch.v.flatten(1)], dim=-1)
    ctx_cache, op_cache = batch.kv_cache.clone(), batch.kv_cache.clone()
    with forward_context(ForwardContext(attn=m, kv_caches=[ctx_cache])):
        o, o2 = layer(qkv, op_cache)
    torch.testing.assert_close(o, ref.flatten(1) * 2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o2, ref.flatten(1), rtol=1e-5, atol=1e-5)
    assert torch.equal(ctx_cache, ref_cache) and torch.equal(op_cache, ref_cache)  # the store survived tracing
