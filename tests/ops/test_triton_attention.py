"""Triton KV store and paged attention (``kiln/ops/triton_attention.py``) vs the pure-torch reference.

Every case draws fresh random q/k/v/cache (never zeros), lays each request's blocks out of order,
gives contexts a partial last block, poisons the output with NaN, and requires the cache to match
the reference bit for bit and the output within the dtype's tolerance.

Each test runs at two sizes: ``tiny`` everywhere and ``large`` (realistic shapes, ``gpu`` marker)
only on CUDA. Without CUDA the tiny cases need Triton's interpreter, and ``TRITON_INTERPRET=1``
must be set before ``triton`` is first imported (its own ``@jit`` helpers such as ``tl.zeros``
are wrapped at import). So on a CPU machine this module runs itself again in a child pytest with
the variable set (``test_kernels_in_triton_interpreter``) and skips the cases in the parent: the
variable never reaches the parent process or any other test module.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from tests.helpers.triton_interpreter import run_in_triton_interpreter

pytest.importorskip("triton")

from kiln.forward_context import ForwardContext, forward_context  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUN_KERNELS_HERE = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
SIZES = ["tiny", pytest.param("large", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INTERPRETER_TIMEOUT_S = 600


@pytest.mark.skipif(RUN_KERNELS_HERE, reason="kernels run in this process")
def test_kernels_in_triton_interpreter():
    """Run this module's tiny cases in a child process whose environment has TRITON_INTERPRET=1."""
    stdout = run_in_triton_interpreter(__file__, "not test_kernels_in_triton_interpreter", INTERPRETER_TIMEOUT_S)
    print(stdout[-4000:])


@pytest.fixture(scope="module")
def kernels():
    """The kernel module; every kernel case takes it, so this is where the CPU parent skips them."""
    if not RUN_KERNELS_HERE:
        pytest.skip("CPU: run in the Triton interpreter by test_kernels_in_triton_interpreter")
    return importlib.import_module("kiln.ops.triton_attention")


def _spec(kernels, size, *, decodes=(), prefills=(), group=4, head_dim=64, dtype=torch.float32, block_size=16):
    if size == "large":  # llama3-8b-like: 8 kv heads, contexts in the thousands
        def scale_len(n):  # 1 stays 1; others grow to hundreds/thousands with a partial last block
            return n if n == 1 else n * 61 + 5

        decodes = tuple(scale_len(n) for n in decodes)
        prefills = tuple((scale_len(s), scale_len(q)) for s, q in prefills)
        num_kv_heads = 8
    else:
        num_kv_heads = 2
    return kernels.PagedBatchSpec(
        decode_seq_lens=decodes, prefill_chunks=prefills, num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype,
    )


def _small_tiles(kernels, size):
    """Tiny shapes need narrow tiles to cover several query blocks, key tiles and splits."""
    if size == "large":
        return kernels.LaunchConfig()
    return kernels.LaunchConfig(
        decode_block_n=16, prefill_block_m=32, prefill_block_n=16, min_split_tokens=16, programs_per_sm=8
    )


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_matches_reference_on_strided_views(kernels, size, dtype):
    from kiln.ops.attention import store_kv_reference
    from kiln.ops.triton_kv_store import triton_store_kv

    spec = _spec(kernels, size, decodes=(3, 17), prefills=((40, 21),), dtype=dtype)
    batch = kernels.random_paged_batch(spec, DEVICE, seed=1)
    # k and v as the model produces them: strided views into one fused qkv projection.
    kv_size = spec.num_kv_heads * spec.head_dim
    qkv = torch.randn(batch.k.shape[0], spec.num_heads * spec.head_dim + 2 * kv_size, device=DEVICE).to(dtype)
    _, k, v = qkv.split([spec.num_heads * spec.head_dim, kv_size, kv_size], dim=-1)
    k, v = k.view(-1, spec.num_kv_heads, spec.head_dim), v.view(-1, spec.num_kv_heads, spec.head_dim)
    ref_cache, cache = batch.kv_cache.clone(), batch.kv_cache.clone()
    store_kv_reference(k, v, ref_cache, batch.meta.slot_mapping)
    triton_store_kv(k, v, cache, batch.meta.slot_mapping)
    assert not torch.equal(ref_cache, batch.kv_cache)
    assert torch.equal(cache, ref_cache)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_matches_reference(kernels, size, group, head_dim):
    spec = _spec(kernels, size, decodes=(1, 23, 50), group=group, head_dim=head_dim)
    kernels.check_against_reference(kernels.random_paged_batch(spec, DEVICE, seed=2), _small_tiles(kernels, size))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_split_k_with_empty_splits(kernels, size, dtype):
    # One long context sets the split count; the short ones leave most of their splits empty.
    spec = _spec(kernels, size, decodes=(90, 2, 17), group=4, dtype=dtype)
    batch = kernels.random_paged_batch(spec, DEVICE, seed=3)
    cfg = _small_tiles(kernels, size)
    max_len = max(spec.decode_seq_lens)
    assert kernels.num_decode_splits(3, spec.num_kv_heads, max_len, 132 if size == "large" else 4, cfg) > 1
    kernels.check_against_reference(batch, cfg)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_with_cached_prefix_matches_reference(kernels, size, group, head_dim):
    spec = _spec(kernels, size, prefills=((45, 19), (19, 19)), group=group, head_dim=head_dim)
    kernels.check_against_reference(kernels.random_paged_batch(spec, DEVICE, seed=4), _small_tiles(kernels, size))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_batch_matches_reference(kernels, size, dtype):
    # Decodes, a chunk after a cached prefix, a fresh prefill, and a one-token prefill chunk.
    spec = _spec(kernels, size, decodes=(7, 33), prefills=((37, 6), (21, 21), (30, 1)), group=4, dtype=dtype)
    kernels.check_against_reference(kernels.random_paged_batch(spec, DEVICE, seed=5), _small_tiles(kernels, size))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("block_size", [8, 32, 64])
def test_block_sizes_wider_and_narrower_than_tiles_odd_group(kernels, size, block_size):
    spec = _spec(kernels, size, decodes=(5, 70), prefills=((75, 11),), group=3, block_size=block_size)
    kernels.check_against_reference(kernels.random_paged_batch(spec, DEVICE, seed=6), _small_tiles(kernels, size))


@pytest.mark.parametrize("size", SIZES)
def test_default_launch_config(kernels, size):
    spec = _spec(kernels, size, decodes=(3, 40), prefills=((50, 20),), group=4)
    kernels.check_against_reference(kernels.random_paged_batch(spec, DEVICE, seed=7))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("window, softcap", [(1, 0.0), (0, 0.7), (20, 0.7)])
def test_sliding_window_and_softcap_match_reference(kernels, size, window, softcap):
    # A window of one key and one wider than a key tile (16); a cap small enough that tanh saturates.
    # Split decodes whose early splits fall before the window, prefill rows whose window starts
    # past a whole key tile.
    spec = _spec(kernels, size, decodes=(5, 90, 40), prefills=((75, 11), (45, 45), (30, 1)), group=4, block_size=8)
    if size == "large":
        window *= 61
    kernels.check_against_reference(kernels.random_paged_batch(spec, DEVICE, seed=9), _small_tiles(kernels, size),
                                    sliding_window=window, logit_softcap=softcap)


@pytest.mark.parametrize("size", SIZES)
def test_head_dim_not_a_power_of_two(kernels, size):
    """Phi-3's head_dim 96 is padded to 128 inside the kernels; the store writes only 96 dims."""
    spec = _spec(kernels, size, decodes=(5, 40), prefills=((37, 6), (21, 21)), group=4, head_dim=96)
    kernels.check_against_reference(kernels.random_paged_batch(spec, DEVICE, seed=10), _small_tiles(kernels, size),
                                    sliding_window=9)


def test_split_count_fills_the_gpu_but_not_below_min_split_tokens(kernels):
    cfg = kernels.LaunchConfig(min_split_tokens=512, programs_per_sm=2)
    # batch 1, 8 kv heads on 132 SMs wants 33 splits; 4096 keys allow at most 8 of 512.
    assert kernels.num_decode_splits(1, 8, 4096, 132, cfg) == 8
    assert kernels.num_decode_splits(1, 8, 100_000, 132, cfg) == 33
    assert kernels.num_decode_splits(256, 8, 4096, 132, cfg) == 1  # already 2048 programs
    assert kernels.num_decode_splits(4, 8, 300, 132, cfg) == 1
    # static splits (CUDA graphs, sized for max_model_len): narrower, so batch 1 fills the GPU
    static = kernels.LaunchConfig(static_min_split_tokens=64, programs_per_sm=2)
    assert kernels.num_decode_splits(1, 8, 2048, 132, static, static=True) == 32
    assert kernels.num_decode_splits(1, 2, 2048, 132, static, static=True) == 32
    assert kernels.num_decode_splits(1, 8, 100_000, 132, static, static=True) == 33


def test_static_narrow_splits_match_reference_at_short_contexts(kernels):
    """Inside static_decode_splits a context far shorter than the bound runs in many narrow splits,
    most of them empty: the merge must still give the reference's output."""
    spec = _spec(kernels, "tiny", decodes=(5, 70, 1), prefills=(), group=4)
    batch = kernels.random_paged_batch(spec, DEVICE, seed=9)
    cfg = kernels.LaunchConfig(decode_block_n=16, static_min_split_tokens=16, programs_per_sm=64)
    with kernels.static_decode_splits(1024):
        kernels.check_against_reference(batch, cfg)


def test_plugs_into_attend_paged_op(kernels):
    from kiln.ops.attention import attend_paged_reference

    spec = _spec(kernels, "tiny", decodes=(9,), prefills=((26, 10),), group=4)
    batch = kernels.random_paged_batch(spec, DEVICE, seed=8)
    scale = spec.head_dim**-0.5
    for options in ({}, {"sliding_window": 5, "logit_softcap": 0.7}):
        ref = attend_paged_reference(batch.q, batch.k, batch.v, batch.kv_cache.clone(), batch.meta, scale, **options)
        for op in (torch.ops.kiln.attend_paged, torch.ops.kiln_triton.attend_paged):
            cache = batch.kv_cache.clone()
            ctx = ForwardContext(attn=batch.meta, kv_caches=[cache], attention_impl=kernels.triton_attend_paged)
            with forward_context(ctx):
                out = op(batch.q, batch.k, batch.v, 0, scale, **options)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 7])
def test_decode_with_fused_store_matches_reference(kernels, size, dtype, window):
    """A decode-only batch: the decode kernel stores the new K/V itself and reads them from
    registers; the cache (random in the new slots before) must still match the reference bit for
    bit. Contexts of one key, a block boundary, several splits with empty ones (static splits)."""
    spec = _spec(kernels, size, decodes=(1, 16, 17, 45, 3), group=4, dtype=dtype)
    batch = kernels.random_paged_batch(spec, DEVICE, seed=11)
    kernels.check_against_reference(batch, _small_tiles(kernels, size), sliding_window=window, fused_store=True)
    cfg = kernels.LaunchConfig(decode_block_n=16, static_min_split_tokens=16, programs_per_sm=64)
    with kernels.static_decode_splits(4096):
        kernels.check_against_reference(batch, cfg, sliding_window=window, fused_store=True)


def test_decode_only_batch_takes_the_fused_store(kernels, monkeypatch):
    """triton_attend_paged on a decode-only batch launches no separate store; with a prefill it does."""
    from kiln.ops.attention import attend_paged_reference

    stores = []
    monkeypatch.setattr(kernels, "triton_store_kv", lambda *a, **kw: (stores.append(1), kernels_store(*a, **kw)))
    kernels_store = importlib.import_module("kiln.ops.triton_kv_store").triton_store_kv
    for decodes, prefills, want_stores in (((9, 30), (), 0), ((9,), ((26, 10),), 1)):
        stores.clear()
        batch = kernels.random_paged_batch(_spec(kernels, "tiny", decodes=decodes, prefills=prefills), DEVICE, seed=12)
        scale = batch.q.shape[2] ** -0.5
        ref_cache = batch.kv_cache.clone()
        ref = attend_paged_reference(batch.q, batch.k, batch.v, ref_cache, batch.meta, scale)
        cache = batch.kv_cache.clone()
        out = kernels.triton_attend_paged(batch.q, batch.k, batch.v, cache, batch.meta, scale)
        assert len(stores) == want_stores
        assert torch.equal(cache, ref_cache)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_large_decode_batch_stores_apart(kernels, monkeypatch, kernel_config):
    """Past ``kernels.max_store_join_pairs`` (decode, kv head) pairs a decode-only batch stores its
    K/V (and rotates q and k) in launches of their own, with the reference's cache and output either
    way."""
    stores = []
    kernels_store = importlib.import_module("kiln.ops.triton_kv_store").triton_store_kv
    monkeypatch.setattr(kernels, "triton_store_kv", lambda *a, **kw: (stores.append(1), kernels_store(*a, **kw)))
    batch = kernels.random_paged_batch(_spec(kernels, "tiny", decodes=(9, 30), prefills=()), DEVICE, seed=13)
    pairs = batch.k.shape[0] * batch.k.shape[1]
    for limit, want_stores in ((pairs, 0), (pairs - 1, 1), (0, 1)):
        kernel_config(max_store_join_pairs=limit)
        stores.clear()
        kernels.check_rope_against_reference(batch, _small_tiles(kernels, "tiny"))
        assert len(stores) == want_stores

class _CountLaunches:
    """Stands in for a Triton kernel: counts ``kernel[grid](...)`` launches, then runs it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("merge", ["fused", "kernel"])
def test_split_decodes_merge_in_the_decode_kernel_or_their_own(kernels, size, merge, monkeypatch, kernel_config):
    """Split decodes merge either in the decode kernel (the last live split of each decode and kv
    head merges, counted in the device's counters) or in the separate merge kernel
    (``kernels.decode_merge=kernel``); both give the reference's output. The fused merge launches no
    merge kernel and leaves every counter at zero, so the next launch (a graph replay) counts from
    zero again: a second batch through the same counters must match too. Static splits cover
    contexts of one live split (written directly) and of several."""
    kernel_config(decode_merge=merge)
    merges = _CountLaunches(kernels._merge_splits_kernel)
    monkeypatch.setattr(kernels, "_merge_splits_kernel", merges)
    spec = _spec(kernels, size, decodes=(90, 2, 17, 33), group=4)
    cfg = _small_tiles(kernels, size)
    for seed in (13, 14):
        batch = kernels.random_paged_batch(spec, DEVICE, seed=seed)
        kernels.check_against_reference(batch, cfg)
    static = kernels.LaunchConfig(decode_block_n=16, static_min_split_tokens=16, programs_per_sm=64)
    with kernels.static_decode_splits(8192 if size == "large" else 512):  # above every context
        kernels.check_against_reference(batch, static)
        kernels.check_against_reference(batch, static, fused_store=True)
    if merge == "fused":
        assert merges.launches == 0
        assert not kernels._counters[batch.q.device].any()
    else:
        assert merges.launches == 4


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, rotary_dim", [(64, 64), (96, 48)])
def test_decode_rotating_q_and_k_matches_reference(kernels, size, dtype, head_dim, rotary_dim):
    """A decode-only batch through ``triton_attend_paged_rope``: the decode kernel rotates q and the
    new key (full and partial rotary, a head_dim padded inside), stores the key and attends; the
    cache must match the rotate-then-attend reference (fp32 bit for bit in the interpreter). Single and
    split decodes, then static splits with empty ones."""
    spec = _spec(kernels, size, decodes=(1, 16, 17, 45, 3), group=4, dtype=dtype, head_dim=head_dim)
    batch = kernels.random_paged_batch(spec, DEVICE, seed=15)
    kernels.check_rope_against_reference(batch, _small_tiles(kernels, size), rotary_dim=rotary_dim)
    kernels.check_rope_against_reference(batch, _small_tiles(kernels, size), sliding_window=7, logit_softcap=0.7,
                                         rotary_dim=rotary_dim)
    cfg = kernels.LaunchConfig(decode_block_n=16, static_min_split_tokens=16, programs_per_sm=64)
    with kernels.static_decode_splits(4096):
        kernels.check_rope_against_reference(batch, cfg, rotary_dim=rotary_dim)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_and_mixed_batches_rotate_before_attending(kernels, size, dtype, monkeypatch):
    """Batches the decode kernel does not store for (prefills, decodes beside a prefill) rotate q
    and k first and take ``triton_attend_paged``'s way: one separate store each, no rotating
    launch; a decode-only batch stores and rotates in the decode kernel (no separate store)."""
    stores = []
    store = kernels.triton_store_kv
    monkeypatch.setattr(kernels, "triton_store_kv", lambda *a, **kw: (stores.append(1), store(*a, **kw)))
    for decodes, prefills, want_stores in (((7, 33), ((37, 6), (21, 21), (30, 1)), 1), ((), ((45, 19),), 1),
                                           ((9, 30), (), 0)):
        stores.clear()
        spec = _spec(kernels, size, decodes=decodes, prefills=prefills, group=4, dtype=dtype)
        kernels.check_rope_against_reference(kernels.random_paged_batch(spec, DEVICE, seed=16),
                                             _small_tiles(kernels, size))
        assert len(stores) == want_stores


def test_rope_op_plugs_into_the_forward_context(kernels):
    """``kiln::attend_paged_rope`` (rotate, then the context's kernel) and the Triton op (rotating
    inside) give the rotate-then-attend reference, with and without window and soft-cap, and with
    one table row broadcast over the tokens."""
    from kiln.ops.attention import attend_paged_rope_reference

    for decodes, prefills in (((9, 21), ()), ((9,), ((26, 10),))):
        spec = _spec(kernels, "tiny", decodes=decodes, prefills=prefills, group=4)
        batch = kernels.random_paged_batch(spec, DEVICE, seed=17)
        scale = spec.head_dim**-0.5
        cos, sin = kernels.random_rotary(batch.q.shape[0], spec.head_dim, batch.q.dtype, DEVICE, seed=1)
        for options, rows in (({}, None), ({"sliding_window": 5, "logit_softcap": 0.7}, None), ({}, 1)):
            cos, sin = cos[:rows], sin[:rows]  # rows=1: one table row for every token, read at stride 0
            ref_cache = batch.kv_cache.clone()
            ref = attend_paged_rope_reference(batch.q, batch.k, batch.v, cos, sin, ref_cache, batch.meta, scale,
                                              **options)
            for op in (torch.ops.kiln.attend_paged_rope, torch.ops.kiln_triton.attend_paged_rope):
                cache = batch.kv_cache.clone()
                ctx = ForwardContext(attn=batch.meta, kv_caches=[cache], attention_impl=kernels.triton_attend_paged)
                with forward_context(ctx):
                    out = op(batch.q, batch.k, batch.v, cos, sin, 0, scale, **options)
                torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(cache, ref_cache, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, rotary_dim", [(64, 64), (96, 96), (128, 96)])
def test_rotate_qk_matches_reference(kernels, size, dtype, head_dim, rotary_dim):
    """The rotary kernel of prefill and mixed batches: q and k as strided views of one qkv
    projection, full and partial rotary, a head_dim padded inside; fp32 within about an ulp (the
    GPU's kernel fuses a product into the add, one rounding fewer than torch's two ops), 16-bit
    dtypes within their rounding (the interpreter rounds to 16 bits toward zero)."""
    from kiln.ops.attention import rotate_reference
    from kiln.ops.triton_rotary import triton_rotate_qk

    spec = _spec(kernels, size, prefills=((40, 21), (9, 9)), dtype=dtype, head_dim=head_dim)
    batch = kernels.random_paged_batch(spec, DEVICE, seed=18)
    cos, sin = kernels.random_rotary(batch.q.shape[0], rotary_dim, dtype, DEVICE, seed=2)
    q, k = triton_rotate_qk(batch.q, batch.k, cos, sin)
    for got, x in ((q, batch.q), (k, batch.k)):
        want = rotate_reference(x, cos, sin)
        assert not torch.equal(want, x)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        else:
            torch.testing.assert_close(got, want, rtol=kernels.tolerance(dtype), atol=kernels.tolerance(dtype))
        if rotary_dim < head_dim:
            assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:])
