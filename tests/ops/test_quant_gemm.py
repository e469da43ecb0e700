"""The Triton weight-only GEMMs (``kiln.ops.triton_quant_gemm``) against the pure-torch references on
fresh random inputs: fp8 / int8 per-channel and int4 group-scaled weights, the one-row GEMV tile and
the dot tile, split-K, K not a multiple of the tile, and fp8 rows with their scales.

Without CUDA the kernels run in Triton's interpreter in a child process (float32 activations: the
interpreter's bfloat16 arithmetic differs from the GPU's); on the GPU in bfloat16, at the llama3-8b
decode shapes, through the KernelSet's ops.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.triton_interpreter import run_in_triton_interpreter

from kiln.ops import quant

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUN_KERNELS_HERE = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _weights(scheme: str, n: int, k: int, gen: torch.Generator, group_size: int = 32):
    w = torch.randn(n, k, generator=gen, device=DEVICE) * 0.05
    if scheme == "fp8":
        return quant.quantize_fp8(w)
    if scheme == "int8":
        return quant.quantize_int8(w)
    return quant.quantize_int4(w, group_size)


def _weight_only_reference(scheme: str, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, group_size: int):
    """x (model dtype, not quantized) @ dequant(w).T in float32."""
    return x.float() @ quant.dequant_reference(scheme)(w, s, group_size, torch.float32).t()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.skipif(RUN_KERNELS_HERE, reason="kernels run in this process")
def test_quant_gemm_kernels_in_triton_interpreter():
    pytest.importorskip("triton")
    out = run_in_triton_interpreter(__file__, "interpreted")
    assert " failed" not in out


# (rows, N, K, config): the GEMV tile, split-K with K not a multiple of the tile, the dot tile
# with and without split-K, more rows than one dot tile.
INTERPRETED_CASES = [(1, 40, 256, (1, 16, 64, 1)), (1, 20, 256, (1, 8, 128, 1)), (1, 40, 192, (1, 16, 128, 2)), (5, 40, 256, (16, 16, 64, 3)),
                     (5, 72, 320, (16, 32, 64, 1)), (20, 24, 128, (16, 16, 64, 1)),
                     (1, 40, 192, (16, 32, 128, 1)), (1, 72, 448, (16, 64, 128, 2))]


@pytest.mark.skipif(not RUN_KERNELS_HERE or DEVICE == "cuda", reason="CPU: runs in the Triton interpreter")
@pytest.mark.parametrize("scheme", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("rows,n,k,cfg", INTERPRETED_CASES)
def test_interpreted_gemm_matches_reference(scheme, rows, n, k, cfg):
    from kiln.ops.triton_quant_gemm import GemmConfig, triton_linear

    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    w, s = _weights(scheme, n, k, gen)
    x = torch.randn(rows, k, generator=gen)
    got = triton_linear(scheme, x, w, s, 32, config=GemmConfig(*cfg))
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert _rel(got, _weight_only_reference(scheme, x, w, s, 32)) < 1e-5
    # Each output row depends on its own input row only.
    got_first = triton_linear(scheme, x[:1], w, s, 32, config=GemmConfig(*cfg) if cfg[0] > 1 else None)
    assert _rel(got_first, got[:1]) < 1e-5


@pytest.mark.skipif(not RUN_KERNELS_HERE or DEVICE == "cuda", reason="CPU: runs in the Triton interpreter")
@pytest.mark.parametrize("n,k,cfg", [(40, 256, (1, 16, 64, 1)), (72, 448, (1, 32, 128, 2))])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_interpreted_int4_gemv_bf16_rows(n, k, cfg, scale_dtype):
    """bf16 rows take the GEMV's cheaper high-nibble float (the whole word, its offset taken off per
    group): within 1e-4 of the reference in float32 output; bf16 scales and zeros are read as one
    32-bit word per group."""
    from kiln.ops.triton_quant_gemm import GemmConfig, triton_linear

    gen = torch.Generator().manual_seed(n + k)
    w, sz = _weights("int4", n, k, gen)
    sz = sz.to(scale_dtype)
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
    got = triton_linear("int4", x, w, sz, 32, out_dtype=torch.float32, config=GemmConfig(*cfg))
    assert _rel(got, _weight_only_reference("int4", x, w, sz, 32)) < 1e-4


# (n, k, group, (block_n, block_k, split_k, num_warps, num_stages)): one tile, several, a K that is
# not a multiple of the tile, split-K; weight loads pipelined (num_stages 2) and not.
GEMV_TILE_CASES = [(24, 256, 32, (8, 256, 1, 4, 1)), (24, 1024, 32, (8, 256, 1, 4, 2)),
                   (40, 448, 64, (16, 128, 1, 4, 2)), (16, 1152, 128, (8, 256, 1, 4, 2)),
                   (24, 640, 32, (8, 128, 2, 4, 2)), (24, 640, 32, (8, 128, 2, 4, 1))]


@pytest.mark.skipif(not RUN_KERNELS_HERE or DEVICE == "cuda", reason="CPU: runs in the Triton interpreter")
@pytest.mark.parametrize("n,k,group,cfg", GEMV_TILE_CASES)
def test_interpreted_int4_gemv_tiles(n, k, group, cfg):
    """The one-row GEMV at groups 32 / 64 / 128 with bf16 rows and scales, loads pipelined and not."""
    from kiln.ops.triton_quant_gemm import GemmConfig, triton_linear

    gen = torch.Generator().manual_seed(n + k + group)
    w, sz = _weights("int4", n, k, gen, group)
    sz = sz.to(torch.bfloat16)
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
    bn, bk, split, warps, stages = cfg
    got = triton_linear("int4", x, w, sz, group, out_dtype=torch.float32,
                        config=GemmConfig(1, bn, bk, split, num_warps=warps, num_stages=stages))
    assert _rel(got, _weight_only_reference("int4", x, w, sz, group)) < 1e-4


@pytest.mark.skipif(not RUN_KERNELS_HERE or DEVICE == "cuda", reason="CPU: runs in the Triton interpreter")
@pytest.mark.parametrize("rows,cfg", [(1, (1, 16, 64, 2)), (3, (16, 16, 64, 1))])
def test_interpreted_fp8_rows_with_scales(rows, cfg):
    from kiln.ops.triton_quant_gemm import GemmConfig, triton_linear

    gen = torch.Generator().manual_seed(rows)
    w, s = _weights("fp8", 48, 256, gen)
    xq, xs = quant.quantize_fp8_per_token(torch.randn(rows, 256, generator=gen))
    got = triton_linear("fp8", xq, w, s, -1, x_scales=xs, out_dtype=torch.float32, config=GemmConfig(*cfg))
    assert _rel(got, quant.linear_fp8_prequant_reference(xq, xs, w, s, torch.float32)) < 1e-5


def test_default_configs_take_every_shape():
    pytest.importorskip("triton")
    from kiln.ops.triton_quant_gemm import config_for

    for m in (1, 2, 16, 17, 64, 300):
        for n, k in ((6144, 4096), (4096, 14336), (40, 96)):
            for group in (32, 128):
                cfg = config_for("int4", m, n, k, group)
                assert cfg.block_k % group == 0 and (cfg.block_m == 1) == (m == 1) and cfg.block_m >= min(m, 16)
                assert cfg.split_k >= 1


def test_measured_configs_fit_their_shapes():
    pytest.importorskip("triton")
    from kiln.ops.triton_quant_gemm import MEASURED, MEASURED_ON, _measured, config_for

    for table in (MEASURED, *MEASURED_ON.values()):
        for (scheme, bucket, n, k), cfg in table.items():
            assert cfg.block_m == bucket and k % cfg.block_k == 0, (scheme, bucket, n, k)
            assert scheme != "int4" or cfg.block_k % 32 == 0
    for (scheme, bucket, n, k), cfg in _measured().items():  # this card's table: MEASURED and its own entries
        assert config_for(scheme, bucket, n, k) == cfg
    assert config_for("int8", 1, 4096, 4096) == config_for("fp8", 1, 4096, 4096)


LLAMA3_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("scheme", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 16, 64, 300])
def test_gpu_gemm_matches_reference(scheme, rows):
    from kiln.ops.triton_quant_gemm import triton_linear

    if scheme == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs SM89+")
    gen = torch.Generator(device=DEVICE).manual_seed(rows)
    for n, k in LLAMA3_8B:
        w, s = _weights(scheme, n, k, gen)
        s = s if scheme == "fp8" else s.to(torch.bfloat16)
        x = torch.randn(rows, k, generator=gen, device=DEVICE).to(torch.bfloat16)
        got = triton_linear(scheme, x, w, s, 32)
        assert got.dtype == torch.bfloat16
        assert _rel(got, _weight_only_reference(scheme, x, w, s, 32)) < 1e-2, (n, k)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("scheme", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("rows", [1, 8, 48, 300])
def test_gpu_kernel_set_ops_match_reference(scheme, rows):
    """The KernelSet's op for each scheme: weight-only at decode rows, ``_scaled_mm`` (FP8 with
    per-token activations) above ``FP8_TRITON_MAX_ROWS``."""
    from kiln.ops.quant_cuda import FP8_TRITON_MAX_ROWS
    from kiln.ops.registry import select_kernels

    if scheme == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs SM89+")
    kernel = select_kernels("cuda").quant_linear(scheme)
    assert kernel.name in ("triton", "triton+scaled_mm")
    gen = torch.Generator(device=DEVICE).manual_seed(rows)
    w, s = _weights(scheme, 4096, 4096, gen)
    w, s = kernel.pack(w, s if scheme == "fp8" else s.to(torch.bfloat16), 32)
    x = torch.randn(rows, 4096, generator=gen, device=DEVICE).to(torch.bfloat16)
    got = kernel.op(x, w, s, 32)
    if scheme == "fp8" and rows > FP8_TRITON_MAX_ROWS:
        want = quant.linear_fp8_reference(x, w, s, 32)
    else:
        want = _weight_only_reference(scheme, x, w, s, 32)
    assert _rel(got, want) < 1e-2


@pytest.mark.skipif(not RUN_KERNELS_HERE or DEVICE == "cuda", reason="CPU: runs in the Triton interpreter")
@pytest.mark.parametrize("n,k,group", [(40, 256, 32), (24, 320, 64)])
def test_interpreted_int4_dequant_matches_reference(n, k, group):
    from kiln.ops.triton_quant_gemm import triton_dequant_int4

    gen = torch.Generator().manual_seed(n + k)
    w, sz = _weights("int4", n, k, gen, group)
    got = triton_dequant_int4(w, sz, group, torch.float32)
    torch.testing.assert_close(got, quant.dequant_int4_reference(w, sz, group, torch.float32), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
def test_gpu_int4_dequant_matches_reference():
    from kiln.ops.triton_quant_gemm import triton_dequant_int4

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    w, sz = _weights("int4", 6144, 4096, gen)
    sz = sz.to(torch.bfloat16)
    torch.testing.assert_close(triton_dequant_int4(w, sz, 32, torch.bfloat16),
                               quant.dequant_int4_reference(w, sz, 32, torch.bfloat16), rtol=1e-2, atol=1e-3)
