"""FP8: the Triton norm/activation + quant kernels against their references, the fusion pass that
uses them, and the ``_scaled_mm`` GEMM on the GPU.

Without CUDA the Triton kernels run in Triton's interpreter in a child process (as in
``tests/ops/test_triton_norm.py``). The interpreter converts to fp8 slightly differently from the GPU
(rounding ties, an occasional exact power of two one binade low), so there the rows are checked
with bounds that allow that, and on the GPU with one fp8 step.
"""

from __future__ import annotations

import collections
import contextlib
import operator
import os

import pytest
import torch

from tests.helpers.quant import fp8_layer
from tests.helpers.triton_interpreter import run_in_triton_interpreter
from torch.fx.experimental.proxy_tensor import make_fx

from kiln.ops import quant
from kiln.ops.registry import op_name
from kiln.passes.gemm_input_fusion import GemmInputFusionPass

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUN_KERNELS_HERE = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(RUN_KERNELS_HERE, reason="kernels run in this process")
def test_fp8_kernels_in_triton_interpreter():
    pytest.importorskip("triton")
    run_in_triton_interpreter(__file__, "interpreted")


@pytest.mark.skipif(not RUN_KERNELS_HERE or DEVICE == "cuda", reason="CPU: runs in the Triton interpreter")
@pytest.mark.parametrize("num_tokens,hidden,intermediate", [(1, 96, 80), (5, 200, 1100), (2, 96, 5000), (2, 64, 17000)])
def test_interpreted_kernels_match_reference(num_tokens, hidden, intermediate):
    # float32 only: the interpreter's bfloat16 rounding differs from the GPU's too.
    from kiln.ops.triton_quant import check_against_reference

    e = check_against_reference(num_tokens, hidden, intermediate, torch.float32, DEVICE, seed=num_tokens)
    # Here values may round to the other neighbour (or a power of two one binade low): the rows agree
    # within that, and as a whole within fp8's own noise.
    assert e["norm_rows"] <= 0.51 and e["silu_rows"] <= 0.51, e
    assert e["norm_l2"] < 0.1 and e["silu_l2"] < 0.1, e  # a wrong row (no weight, no gate) is ~1
    assert e["norm_scales"] < 1e-6 and e["silu_scales"] < 1e-6 and e["residual"] == 0.0, e
    assert e["quant_l2"] < 0.1 and e["quant_scales"] == 0.0, e


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("num_tokens,hidden,intermediate", [(1, 4096, 14336), (300, 4096, 14336)])
def test_gpu_kernels_match_reference(num_tokens, hidden, intermediate):
    from kiln.ops.triton_quant import check_against_reference

    e = check_against_reference(num_tokens, hidden, intermediate, torch.bfloat16, DEVICE, seed=num_tokens)
    assert e["norm_mismatch"] < 0.01 and e["silu_mismatch"] < 0.01, e
    assert e["norm_rows"] <= 0.13 and e["silu_rows"] <= 0.13, e
    assert e["norm_l2"] < 0.01 and e["silu_l2"] < 0.01, e
    assert e["norm_scales"] < 1e-2 and e["silu_scales"] < 1e-2 and e["residual"] < 1e-2, e
    assert e["quant_l2"] < 0.01 and e["quant_scales"] < 1e-6, e


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda" or torch.cuda.get_device_capability() < (8, 9), reason="needs SM89+")
@pytest.mark.parametrize("rows", [33, 300])
def test_scaled_mm_fp8_gemm_matches_reference(rows):
    # Above FP8_TRITON_MAX_ROWS the op quantizes the rows and runs _scaled_mm (tests/ops/test_quant_gemm.py
    # checks the decode rows' weight-only kernel).
    from kiln.ops.quant_cuda import FP8_TRITON_MAX_ROWS
    from kiln.ops.registry import select_kernels

    kernel = select_kernels("cuda").linear_fp8
    assert kernel.name == "triton+scaled_mm" and rows > FP8_TRITON_MAX_ROWS
    n, k = 4096, 4096
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    q, s = quant.quantize_fp8(w)
    got = kernel.op(x, q, s, -1)
    want = quant.linear_fp8_reference(x, q, s, -1)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * want.abs().max().item(), rtol=2e-2)
    dense = x.float() @ w.float().t()
    assert ((got.float() - dense).norm() / dense.norm()).item() < 0.06


# ---- the fusion pass, with the reference ops --------------------------------------------------------

def _targets(gm) -> collections.Counter:
    return collections.Counter(op_name(n.target) or getattr(n.target, "__name__", str(n.target))
                               for n in gm.graph.nodes if n.op == "call_function")


def test_fp8_quant_fusion_pass_fuses_norm_and_activation():
    import kiln.ops.activation  # noqa: F401
    import kiln.ops.layernorm  # noqa: F401

    hidden, inter = 64, 96
    qkv_w, qkv_s = quant.quantize_fp8(torch.randn(hidden, hidden))
    gu_w, gu_s = quant.quantize_fp8(torch.randn(2 * inter, hidden))
    down_w, down_s = quant.quantize_fp8(torch.randn(hidden, inter))
    x, res, w_norm = torch.randn(5, hidden), torch.randn(5, hidden), torch.rand(hidden) + 0.5
    args = (x, res, w_norm, qkv_w, qkv_s, gu_w, gu_s, down_w, down_s)
    gm = make_fx(fp8_layer, tracing_mode="fake")(*args)
    want = gm(*args)
    before = _targets(gm)
    assert before["kiln::linear_fp8"] == 3 and before["kiln::add_rms_norm"] == 1 and before["kiln::silu_and_mul"] == 1
    assert GemmInputFusionPass()(gm.graph) == 2
    gm.graph.lint()
    gm.recompile()
    after = _targets(gm)
    assert after["kiln::add_rms_norm_linear_fp8"] == 1 and after["kiln::silu_and_mul_linear_fp8"] == 1
    assert after["kiln::linear_fp8"] == 1  # its input (h) comes from a GEMM: nothing to fuse
    assert after["kiln::add_rms_norm"] == 0 and after["kiln::silu_and_mul"] == 0
    # The references compute what the unfused ops did, bit for bit.
    torch.testing.assert_close(gm(*args), want, rtol=0, atol=0)


def test_fp8_quant_fusion_pass_keeps_a_norm_with_other_users():
    import kiln.ops.layernorm  # noqa: F401

    w, s = quant.quantize_fp8(torch.randn(32, 32))

    def f(x, res, wn):
        normed, new_res = torch.ops.kiln.add_rms_norm(x, res, wn, 1e-5)
        return torch.ops.kiln.linear_fp8(normed, w, s, -1) + normed + new_res

    gm = make_fx(f)(torch.randn(3, 32), torch.randn(3, 32), torch.ones(32))
    assert GemmInputFusionPass()(gm.graph) == 0
    assert GemmInputFusionPass(joins=())(gm.graph) == 0
    assert operator.getitem in {n.target for n in gm.graph.nodes}


def test_fp8_quant_fusion_pass_keeps_the_residual_used_before_the_gemm():
    # The residual's user comes before the GEMM: it must read the joined op's residual output.
    import kiln.ops.layernorm  # noqa: F401

    def f(x, res, wn, w, s):
        normed, new_res = torch.ops.kiln.add_rms_norm(x, res, wn, 1e-5)
        doubled = new_res * 2
        return torch.ops.kiln.linear_fp8(normed, w, s, -1), doubled

    args = (torch.randn(3, 32), torch.randn(3, 32), torch.rand(32) + 0.5, *quant.quantize_fp8(torch.randn(48, 32)))
    gm = make_fx(f, tracing_mode="fake")(*args)
    want = gm(*args)
    assert GemmInputFusionPass()(gm.graph) == 1
    gm.graph.lint()
    gm.recompile()
    assert _targets(gm)["kiln::add_rms_norm"] == 0
    for got, expected in zip(gm(*args), want):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_joined_ops_quantize_rows_only_above_the_weight_only_rows(monkeypatch):
    pytest.importorskip("triton")
    from kiln.ops import triton_quant
    from kiln.ops.quant import FP8_TRITON_MAX_ROWS

    w = torch.empty(64, 96, dtype=torch.float8_e4m3fn)
    odd = torch.empty(40, 96, dtype=torch.float8_e4m3fn)  # N not a multiple of 16: no _scaled_mm at any rows
    for rows, want in ((1, False), (FP8_TRITON_MAX_ROWS, False), (FP8_TRITON_MAX_ROWS + 1, True), (512, True)):
        assert triton_quant.joined_op_quantizes(torch.empty(rows, 96), w) is want, rows
        assert triton_quant.joined_op_quantizes(torch.empty(rows, 96), odd) is False
    monkeypatch.setattr(triton_quant, "QUANTIZE_DECODE_ROWS", True)
    assert triton_quant.joined_op_quantizes(torch.empty(1, 96), w) is True


@pytest.mark.skipif(not RUN_KERNELS_HERE, reason="the Triton kernels run in the interpreter's child process")
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_interpreted_joined_ops_match_reference(rows):
    # Decode rows: the plain norm / activation and the weight-only GEMM on unquantized rows, so the
    # result is the dequantized weight's product (up to float32 sums); prefill rows: quantized rows,
    # the reference of the unfused ops within fp8's rounding of the activations.
    from kiln.ops import triton_quant
    from kiln.ops.activation import silu_and_mul_reference
    from kiln.ops.layernorm import add_rms_norm_reference

    gen = torch.Generator().manual_seed(rows)
    hidden, inter, dtype = 96, 80, torch.float32
    w, s = quant.quantize_fp8(torch.randn(64, hidden, generator=gen))
    dw, ds = quant.quantize_fp8(torch.randn(hidden, inter, generator=gen))
    x, res = torch.randn(rows, hidden, generator=gen), torch.randn(rows, hidden, generator=gen)
    wn, gu = torch.rand(hidden, generator=gen) + 0.5, torch.randn(rows, 2 * inter, generator=gen)
    x, res, gu = (t.to(DEVICE) for t in (x, res, gu))
    wn, w, s, dw, ds = (t.to(DEVICE) for t in (wn, w, s, dw, ds))
    y, new_res = triton_quant.add_rms_norm_linear_fp8(x, res, wn, 1e-5, w, s, dtype)
    y2 = triton_quant.silu_and_mul_linear_fp8(gu, dw, ds, dtype)
    normed, want_res = add_rms_norm_reference(x, res, wn, 1e-5)
    act = silu_and_mul_reference(gu)
    assert y.shape == (rows, 64) and y2.shape == (rows, hidden) and y.dtype == y2.dtype == dtype
    torch.testing.assert_close(new_res, want_res)

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    exact = normed @ quant.dequant_fp8_reference(w, s, -1, dtype).t()
    exact2 = act @ quant.dequant_fp8_reference(dw, ds, -1, dtype).t()
    if triton_quant.joined_op_quantizes(x, w):
        assert rows > quant.FP8_TRITON_MAX_ROWS
        # (the interpreter's fp8 conversion rounds some values to the other neighbour: a looser bound there)
        bound = 0.02 if DEVICE == "cuda" else 0.1
        assert rel(y, quant.linear_fp8_reference(normed, w, s, -1)) < bound
        assert rel(y2, quant.linear_fp8_reference(act, dw, ds, -1)) < bound
        assert rel(y, exact) > 1e-3 and rel(y2, exact2) > 1e-3  # the rows were quantized
    else:
        assert rel(y, exact) < 1e-5 and rel(y2, exact2) < 1e-5


# ---- FP8 KV cache ------------------------------------------------------------------------------------

def _fp8_batch(device: str, dtype: torch.dtype = torch.float32):
    from kiln.ops.paged_batch import PagedBatchSpec, random_paged_batch

    spec = PagedBatchSpec(decode_seq_lens=(5, 33), prefill_chunks=((20, 20), (40, 7)), num_heads=4, num_kv_heads=2,
                          head_dim=32, block_size=4, dtype=dtype)
    batch = random_paged_batch(spec, device=device, seed=3)
    batch.kv_cache = batch.kv_cache.to(torch.float8_e4m3fn)
    return batch


def test_fp8_kv_cache_round_trip():
    from kiln.ops.attention import _gather_context, store_kv_reference

    batch = _fp8_batch("cpu")
    store_kv_reference(batch.k, batch.v, batch.kv_cache, batch.meta.slot_mapping)
    slots = batch.meta.slot_mapping
    stored_k = batch.kv_cache[0].view(torch.uint8).flatten(0, 1)[slots].view(torch.float8_e4m3fn)
    assert torch.equal(stored_k.float(), batch.k.to(torch.float8_e4m3fn).float())  # what was written, exactly
    rel = ((stored_k.float() - batch.k).abs() / (batch.k.abs() + 2 ** -6)).max().item()
    assert rel <= 1 / 16 + 1e-6  # half an e4m3 step
    ctx = _gather_context(batch.kv_cache[1], batch.meta.block_tables[2], 20)  # the first prefill's values
    start = batch.meta.query_start_loc[2].item()
    assert torch.equal(ctx.float(), batch.v[start:start + 20].to(torch.float8_e4m3fn).float())


def test_fp8_kv_cache_model_logits_stay_close():
    from tests.helpers.paged import PagedBatcher, make_kv_caches, run_step
    from tests.helpers.quant import float_model

    model = float_model()
    g = torch.Generator().manual_seed(0)
    schedule = [{"a": torch.randint(0, 512, (9,), generator=g).tolist(), "b": [5]}, {"a": [3], "b": [7]},
                {"a": [4], "b": [8]}]
    logits = {}
    for dtype in (torch.float32, torch.float8_e4m3fn):
        batcher, caches = PagedBatcher(64, 4, seed=1), make_kv_caches(model.arch, 64, 4, dtype=dtype)
        with torch.no_grad():
            steps = [run_step(model, caches, batcher.step(s)) for s in schedule]
            logits[dtype] = torch.cat([model.compute_logits(h) for h in steps])
    full, fp8 = logits[torch.float32], logits[torch.float8_e4m3fn]
    rel = ((fp8 - full).norm() / full.norm()).item()
    assert 0 < rel < 0.06, rel


def test_fp8_kv_cache_config_halves_block_bytes():
    from kiln.config import CacheConfig
    from kiln.models.loader import kv_cache_dtype
    from kiln.runtime.kv_sizing import KVShape

    assert kv_cache_dtype("fp8", torch.bfloat16, torch.device("cpu")) == torch.float8_e4m3fn
    assert kv_cache_dtype("auto", torch.bfloat16, torch.device("cpu")) == torch.bfloat16
    bf16, fp8 = (KVShape(32, 16, 8, 128, d).bytes_per_block for d in (torch.bfloat16, torch.float8_e4m3fn))
    assert bf16 == 2 * fp8
    with pytest.raises(ValueError, match=r"cache.dtype='int8' is not allowed"):
        CacheConfig(dtype="int8")


@pytest.mark.skipif(not RUN_KERNELS_HERE or DEVICE == "cuda", reason="CPU: runs in the Triton interpreter")
def test_interpreted_triton_attention_reads_fp8_cache():
    from kiln.ops.attention import attend_paged_reference
    from kiln.ops.triton_attention import attend_paged_cached

    batch = _fp8_batch("cpu")
    scale = batch.q.shape[-1] ** -0.5
    cache = batch.kv_cache.clone()
    want = attend_paged_reference(batch.q, batch.k, batch.v, cache, batch.meta, scale)
    out = torch.full_like(batch.q, float("nan"))
    attend_paged_cached(batch.q, cache, batch.meta, scale, out)  # reads what the reference stored
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda" or torch.cuda.get_device_capability() < (8, 9), reason="needs SM89+")
def test_triton_attention_with_fp8_cache_matches_reference():
    from kiln.ops.attention import attend_paged_reference
    from kiln.ops.triton_attention import triton_attend_paged

    batch = _fp8_batch("cuda", torch.bfloat16)
    scale = batch.q.shape[-1] ** -0.5
    ref_cache, cache = batch.kv_cache.clone(), batch.kv_cache.clone()
    want = attend_paged_reference(batch.q, batch.k, batch.v, ref_cache, batch.meta, scale)
    got = triton_attend_paged(batch.q, batch.k, batch.v, cache, batch.meta, scale)
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))  # the store casts as torch does
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not RUN_KERNELS_HERE or DEVICE == "cuda", reason="CPU: runs in the Triton interpreter")
@pytest.mark.parametrize("logit_softcap", [0.0, 30.0])
def test_interpreted_triton_attention_prescaled_q_matches_reference(monkeypatch, logit_softcap):
    # The FP8-cache path folds the score scale into q before its cast (PRESCALE_Q): checked here in
    # fp32 (the interpreter's fp16 dot is not the GPU's), so only the folding itself is under test.
    import triton.language as tl

    from kiln.ops import triton_attention
    from kiln.ops.attention import attend_paged_reference

    monkeypatch.setattr(triton_attention, "_dot_args",
                        lambda q, kv_cache=None: dict(DOT_DTYPE=tl.float32, DOT_PRECISION="ieee", PRESCALE_Q=True))
    batch = _fp8_batch("cpu")
    scale = batch.q.shape[-1] ** -0.5
    cache = batch.kv_cache.clone()
    want = attend_paged_reference(batch.q, batch.k, batch.v, cache, batch.meta, scale, logit_softcap=logit_softcap)
    out = torch.full_like(batch.q, float("nan"))
    triton_attention.attend_paged_cached(batch.q, cache, batch.meta, scale, out, logit_softcap=logit_softcap)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda" or torch.cuda.get_device_capability() < (8, 9), reason="needs SM89+")
@pytest.mark.parametrize("seed", [0, 1])
def test_triton_attention_fp8_cache_llama_shapes_matches_reference(seed):
    # Llama-3-8B's attention shapes (32 heads, 8 kv heads, head_dim 128, blocks of 16), long decodes
    # and prefill chunks over cached prefixes: the fp16 products over the FP8 cache against the
    # reference (which computes in float32 over the same cached values), on fresh random inputs.
    from kiln.ops.attention import attend_paged_reference
    from kiln.ops.paged_batch import PagedBatchSpec, random_paged_batch
    from kiln.ops.triton_attention import _dot_args, static_decode_splits, triton_attend_paged

    spec = PagedBatchSpec(decode_seq_lens=(1, 17, 300, 511, 1200), prefill_chunks=((256, 256), (700, 180)),
                          num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
    batch = random_paged_batch(spec, device="cuda", seed=seed)
    batch.kv_cache = batch.kv_cache.to(torch.float8_e4m3fn)
    assert _dot_args(batch.q, batch.kv_cache)["PRESCALE_Q"]
    scale = batch.q.shape[-1] ** -0.5
    for static in (False, True):  # per-batch splits, and the splits CUDA graphs capture
        ref_cache, cache = batch.kv_cache.clone(), batch.kv_cache.clone()
        want = attend_paged_reference(batch.q, batch.k, batch.v, ref_cache, batch.meta, scale)
        with static_decode_splits(2048) if static else contextlib.nullcontext():
            got = triton_attend_paged(batch.q, batch.k, batch.v, cache, batch.meta, scale)
        assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 5e-3
