"""The norm / activation joined with the dense, fp8 and int4 GEMMs they feed.

Kernels (``kiln.ops.triton_joined_linear``, the fed one-row GEMVs of ``kiln.ops.triton_quant_gemm``)
against float64 products on fresh random inputs: in Triton's interpreter on the CPU (a child
process, as in ``test_dense_linear.py``) and on the GPU at llama3-8b's shapes, with both outputs of
the norm join (the GEMM and the new residual), a bias, K tails, one row (one kernel) and three
(the unfused kernels inside the op); fp8 at prefill rows runs ``kiln_triton``'s quantizing op.
``GemmInputFusionPass``: which nodes it joins and that the graph computes the same values; the
KernelSet carries the joins ``kernels.gemv_join`` asks for where the GEMMs are CUDA's.
"""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from kiln.ops import quant
from kiln.ops.registry import reference_joined, reference_kernels, select_kernels
from kiln.passes.gemm_input_fusion import GemmInputFusionPass
from tests.helpers.triton_interpreter import run_in_triton_interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUN_KERNELS_HERE = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
EPS = 1e-5


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _norm_want(x, res, gamma, w, bias=None):
    """float64 weight * rms_norm(x + residual) @ w.T (+ bias), and x + residual rounded as the op rounds it."""
    h = (x.double() + res.double()).to(x.dtype)
    hd = h.double()
    y = (hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + EPS) * gamma.double()) @ w.t()
    return (y if bias is None else y + bias.double()), h


def _silu_want(gate_up, w):
    g = gate_up.double()
    d = g.shape[-1] // 2
    return (F.silu(g[:, :d]) * g[:, d:]) @ w.t()


def _inputs(rows, k, dtype, gen, device=DEVICE):
    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    return randn(rows, k), randn(rows, k), (torch.rand(k, generator=gen, device=device) + 0.5).to(dtype), randn(rows, 2 * k)


# ---- kernels in Triton's interpreter ----------------------------------------------------------------

@pytest.mark.skipif(RUN_KERNELS_HERE, reason="kernels run in this process")
def test_gemv_join_in_triton_interpreter():
    pytest.importorskip("triton")
    out = run_in_triton_interpreter(__file__, "interpreted")
    assert " failed" not in out


@pytest.mark.skipif(not RUN_KERNELS_HERE or DEVICE == "cuda", reason="CPU: runs in the Triton interpreter")
@pytest.mark.parametrize("n,k,cfg", [(40, 256, (1, 8, 64, 1, 4, 1)), (24, 200, (1, 4, 64, 1, 2, 3)),
                                     (36, 333, (1, 16, 128, 1, 4, 2))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreted_fed_dense_gemv_matches_float64(n, k, cfg, dtype):
    """The dense GEMV fed by add + RMSNorm (with a bias) and by SiLU-and-mul; K a multiple of the tile or not."""
    from kiln.ops.triton_quant_gemm import GemmConfig, GemvFeed, triton_linear

    gen = torch.Generator().manual_seed(n * k)
    x, res, gamma, gate_up = _inputs(1, k, dtype, gen, "cpu")
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    new_res = torch.full_like(x, float("nan"))
    feed = GemvFeed("norm", res, gamma, EPS, new_res)
    got = triton_linear("dense", x, w, None, 0, config=GemmConfig(*cfg), feed=feed, bias=bias)
    want, want_res = _norm_want(x, res, gamma, w.double(), bias)
    tol = 1e-6 if dtype == torch.float32 else 2e-2  # bfloat16: the interpreter truncates (see _check_joined_ops)
    assert got.shape == (1, n) and got.dtype == dtype and _rel(got, want) < tol
    assert _rel(new_res, want_res) < tol  # every column written, once
    got = triton_linear("dense", gate_up, w, None, 0, config=GemmConfig(*cfg), feed=GemvFeed("silu"))
    assert got.shape == (1, n) and _rel(got, _silu_want(gate_up, w.double())) < tol


@pytest.mark.skipif(not RUN_KERNELS_HERE or DEVICE == "cuda", reason="CPU: runs in the Triton interpreter")
@pytest.mark.parametrize("n,k,cfg", [(40, 256, (1, 8, 64, 1, 4, 1)), (24, 320, (1, 16, 128, 1, 4, 1))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreted_fed_int4_gemv_matches_float64(n, k, cfg, dtype):
    """The int4 word-wise GEMV fed by add + RMSNorm and SiLU-and-mul (320: a K tail in the last tile)."""
    from kiln.ops.triton_quant_gemm import GemmConfig, GemvFeed, triton_linear

    gen = torch.Generator().manual_seed(n + k)
    q, sz = quant.quantize_int4(torch.randn(n, k, generator=gen), 32, torch.bfloat16)
    wd = quant.dequant_int4_reference(q, sz, 32, torch.float64)
    x, res, gamma, gate_up = _inputs(1, k, dtype, gen, "cpu")
    new_res = torch.full_like(x, float("nan"))
    got = triton_linear("int4", x, q, sz, 32, config=GemmConfig(*cfg), feed=GemvFeed("norm", res, gamma, EPS, new_res))
    want, want_res = _norm_want(x, res, gamma, wd)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.shape == (1, n) and _rel(got, want) < tol and _rel(new_res, want_res) < tol
    got = triton_linear("int4", gate_up, q, sz, 32, config=GemmConfig(*cfg), feed=GemvFeed("silu"))
    assert _rel(got, _silu_want(gate_up, wd)) < tol


@pytest.mark.skipif(not RUN_KERNELS_HERE or DEVICE == "cuda", reason="CPU: runs in the Triton interpreter")
@pytest.mark.parametrize("n,k,cfg", [(40, 256, (1, 8, 64, 1, 4, 1)), (24, 200, (1, 4, 64, 1, 2, 3)),
                                     (36, 333, (1, 16, 128, 1, 4, 2))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreted_fed_fp8_gemv_matches_float64(n, k, cfg, dtype):
    """The fp8 weight-only GEMV (per-channel scales) fed by add + RMSNorm and by SiLU-and-mul, writing
    ``out_dtype``; K a multiple of the tile or not."""
    from kiln.ops.triton_quant_gemm import GemmConfig, GemvFeed, triton_linear

    gen = torch.Generator().manual_seed(3 * n + k)
    w, s = quant.quantize_fp8(torch.randn(n, k, generator=gen))
    wd = w.double() * s.double()[:, None]
    x, res, gamma, gate_up = _inputs(1, k, dtype, gen, "cpu")
    new_res = torch.full_like(x, float("nan"))
    feed = GemvFeed("norm", res, gamma, EPS, new_res)
    got = triton_linear("fp8", x, w, s, -1, config=GemmConfig(*cfg), feed=feed, out_dtype=torch.float32)
    want, want_res = _norm_want(x, res, gamma, wd)
    tol = 1e-6 if dtype == torch.float32 else 2e-2  # bfloat16: the interpreter truncates (see _check_joined_ops)
    assert got.shape == (1, n) and got.dtype == torch.float32 and _rel(got, want) < tol
    assert _rel(new_res, want_res) < tol  # every column written, once
    got = triton_linear("fp8", gate_up, w, s, -1, config=GemmConfig(*cfg), feed=GemvFeed("silu"), out_dtype=dtype)
    assert got.shape == (1, n) and got.dtype == dtype and _rel(got, _silu_want(gate_up, wd)) < tol


def _weights(scheme, n, k, dtype, gen, device, bias=None):
    """(the GEMM arguments of ``scheme`` after its input, the weight in float64)."""
    if scheme == "dense":
        w = (torch.randn(n, k, generator=gen, device=device) * 0.02).to(dtype)
        return (w, bias), w.double()
    if scheme == "fp8":
        w, s = quant.quantize_fp8(torch.randn(n, k, generator=gen, device=device) * 0.02)
        return (w, s, dtype), w.double() * s.double()[:, None]
    q, sz = quant.quantize_int4(torch.randn(n, k, generator=gen, device=device), 32, torch.bfloat16)
    return (q, sz, 32), quant.dequant_int4_reference(q, sz, 32, torch.float64)


def _apart_ops(scheme):
    """What the joined ops must match: the ``kiln::`` references; for fp8 (whose reference quantizes
    the rows, as ``_scaled_mm`` does at prefill) ``kiln_triton``'s joined ops, which at decode rows
    run the norm / activation and the weight-only GEMV apart (``kernels.gemv_join=[]``)."""
    ns = torch.ops.kiln_triton if scheme == "fp8" else torch.ops.kiln
    return getattr(ns, f"add_rms_norm_linear_{scheme}"), getattr(ns, f"silu_and_mul_linear_{scheme}")


def _check_joined_ops(scheme, rows, n, k, dtype, gen, device, bias=None, fused=None):
    """Both joined ops of ``scheme`` against float64 and against the ops they replace (``_apart_ops``)."""
    from kiln.ops import triton_joined_linear as tj

    x, res, gamma, gate_up = _inputs(rows, k, dtype, gen, device)
    args, wd = _weights(scheme, n, k, dtype, gen, device, bias)
    if fused is not None:
        assert tj.fuses(scheme, "norm", x, args, gamma.dtype) == fused
        assert tj.fuses(scheme, "silu", gate_up, args) == fused
    ns = torch.ops.kiln_cuda
    ref_norm, ref_silu = _apart_ops(scheme)
    y, new_res = getattr(ns, f"add_rms_norm_linear_{scheme}")(x, res, gamma, EPS, *args)
    want, want_res = _norm_want(x, res, gamma, wd, bias)
    # Triton's interpreter rounds to bfloat16 by truncation (the GPU: to nearest): a bias of up to
    # one step a rounding, where the kernel rounds h, silu and the product as the unfused ops do.
    tol = (1e-2 if device == "cuda" else 2e-2) if dtype == torch.bfloat16 else 1e-5
    assert y.shape == (rows, n) and y.dtype == dtype and new_res.dtype == dtype
    assert _rel(y, want) < tol and _rel(new_res, want_res) < tol
    ref_y, ref_res = ref_norm(x, res, gamma, EPS, *args)
    assert _rel(y, ref_y) < tol
    torch.testing.assert_close(new_res, ref_res, rtol=1e-2, atol=1e-2)
    y = getattr(ns, f"silu_and_mul_linear_{scheme}")(gate_up, *args)
    want = _silu_want(gate_up, wd) + (0 if bias is None else bias.double())
    assert y.shape == (rows, n) and y.dtype == dtype and _rel(y, want) < tol
    assert _rel(y, ref_silu(gate_up, *args)) < tol


@pytest.mark.skipif(not RUN_KERNELS_HERE or DEVICE == "cuda", reason="CPU: runs in the Triton interpreter")
@pytest.mark.parametrize("scheme", ["dense", "fp8", "int4"])
@pytest.mark.parametrize("rows", [1, 3])
def test_interpreted_joined_ops_fuse_at_one_row(scheme, rows):
    """One row: the fed GEMV (one kernel); three: the norm / activation kernel, then the GEMM."""
    import kiln.ops.triton_joined_linear  # noqa: F401  (defines the ops)

    gen = torch.Generator().manual_seed(rows)
    bias = torch.randn(40, generator=gen).bfloat16() if scheme == "dense" else None
    _check_joined_ops(scheme, rows, 40, 192, torch.bfloat16, gen, "cpu", bias=bias, fused=rows == 1)


@pytest.mark.skipif(not RUN_KERNELS_HERE or DEVICE == "cuda", reason="CPU: runs in the Triton interpreter")
def test_interpreted_joined_op_runs_unfused_where_the_tile_splits_k(kernel_config):
    """A layer too narrow to fill the GPU gets a split-K tile: the joined op runs norm, then GEMV;
    so does every dense call with ``kernels.dense_gemv=false`` (cuBLAS)."""
    import kiln.ops.triton_joined_linear  # noqa: F401
    from kiln.ops.triton_quant_gemm import config_for

    assert config_for("dense", 1, 8, 8192).split_k > 1
    _check_joined_ops("dense", 1, 8, 8192, torch.bfloat16, torch.Generator().manual_seed(0), "cpu", fused=False)
    kernel_config(dense_gemv=False)
    _check_joined_ops("dense", 1, 40, 192, torch.bfloat16, torch.Generator().manual_seed(1), "cpu", fused=False)


@pytest.mark.skipif(not RUN_KERNELS_HERE or DEVICE == "cuda", reason="CPU: runs in the Triton interpreter")
def test_interpreted_fp8_joined_ops_quantize_prefill_rows(monkeypatch):
    """Above the weight-only rows the fp8 joined ops are ``kiln_triton``'s (rows quantized to fp8,
    here ``_scaled_mm``'s reference on the CPU): the same values, bit for bit; so is one row with
    ``QUANTIZE_DECODE_ROWS`` (no fed GEMV then)."""
    import kiln.ops.triton_joined_linear as tj
    from kiln.ops import triton_quant

    for rows in (quant.FP8_TRITON_MAX_ROWS + 8, 1):
        if rows == 1:
            monkeypatch.setattr(triton_quant, "QUANTIZE_DECODE_ROWS", True)
        gen = torch.Generator().manual_seed(rows)
        x, res, gamma, gate_up = _inputs(rows, 96, torch.float32, gen, "cpu")
        args, _ = _weights("fp8", 64, 96, torch.float32, gen, "cpu")
        assert not tj.fuses("fp8", "norm", x, args, gamma.dtype) and not tj.fuses("fp8", "silu", gate_up, args)
        ref_norm, ref_silu = _apart_ops("fp8")
        got = torch.ops.kiln_cuda.add_rms_norm_linear_fp8(x, res, gamma, EPS, *args)
        for a, b in zip(got, ref_norm(x, res, gamma, EPS, *args)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(torch.ops.kiln_cuda.silu_and_mul_linear_fp8(gate_up, *args),
                                   ref_silu(gate_up, *args), rtol=0, atol=0)


# ---- the GPU, llama3-8b's shapes ---------------------------------------------------------------------

LLAMA3_8B = [(6144, 4096), (28672, 4096), (4096, 14336)]  # qkv, gate_up (fed by the norm); down (by silu)


def _skip_without_fp8(scheme):
    if scheme == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs SM89+")


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("scheme", ["dense", "fp8", "int4"])
@pytest.mark.parametrize("n,k", LLAMA3_8B)
@pytest.mark.parametrize("rows", [1, 3])
def test_gpu_joined_ops_match_float64(scheme, n, k, rows):
    """The measured decode tiles of these shapes are one program over K: one row runs one kernel."""
    import kiln.ops.triton_joined_linear  # noqa: F401

    _skip_without_fp8(scheme)

    gen = torch.Generator(device="cuda").manual_seed(n + k + rows)
    bias = torch.randn(n, generator=gen, device="cuda").bfloat16() if scheme == "dense" and n == 6144 else None
    _check_joined_ops(scheme, rows, n, k, torch.bfloat16, gen, "cuda", bias=bias, fused=rows == 1)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("scheme", ["dense", "fp8", "int4"])
def test_gpu_joined_ops_replay_in_a_cuda_graph(scheme):
    """Captured at one row (PDL on where the card has it), replayed on new inputs: the same values as
    the unfused kernels, and one kernel a joined op (the profiler counts launches)."""
    import kiln.ops.triton_joined_linear  # noqa: F401

    _skip_without_fp8(scheme)
    n, k = 6144, 4096
    gen = torch.Generator(device="cuda").manual_seed(7)
    x, res, gamma, gate_up = _inputs(1, k, torch.bfloat16, gen)
    args, _ = _weights(scheme, n, k, torch.bfloat16, gen, "cuda")
    norm_op = getattr(torch.ops.kiln_cuda, f"add_rms_norm_linear_{scheme}")
    silu_op = getattr(torch.ops.kiln_cuda, f"silu_and_mul_linear_{scheme}")

    def step():
        y, r = norm_op(x, res, gamma, EPS, *args)
        return y, r, silu_op(gate_up, *args)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for t in (x, res, gate_up):
        t.copy_(torch.randn(t.shape, generator=gen, device="cuda").bfloat16())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    want = step()
    for got, expected in zip(outs, want):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)  # the same kernels, the same inputs
    y_ref, r_ref = _apart_ops(scheme)[0](x, res, gamma, EPS, *args)
    assert _rel(outs[0], y_ref) < 1e-2 and torch.equal(outs[1], r_ref)
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert not any("rms_norm" in name or "silu" in name for name in kernels), kernels


# ---- the pass ----------------------------------------------------------------------------------------

def _dense_layer(x, res, gamma, qkv_w, qkv_b, gu_w, down_w):
    normed, new_res = torch.ops.kiln.add_rms_norm(x, res, gamma, EPS)
    qkv = torch.ops.kiln.linear_dense(normed, qkv_w, qkv_b)
    gate_up = torch.ops.kiln.linear_dense(qkv[:, :gu_w.shape[1]], gu_w)
    act = torch.ops.kiln.silu_and_mul(gate_up)
    return torch.ops.kiln.linear_dense(act, down_w) + new_res


def _int4_layer(x, res, gamma, qkv_w, qkv_s, gu_w, gu_s, down_w, down_s):
    normed, new_res = torch.ops.kiln.add_rms_norm(x, res, gamma, EPS)
    qkv = torch.ops.kiln.linear_int4(normed, qkv_w, qkv_s, 32)
    gate_up = torch.ops.kiln.linear_int4(qkv, gu_w, gu_s, 32)
    act = torch.ops.kiln.silu_and_mul(gate_up)
    return torch.ops.kiln.linear_int4(act, down_w, down_s, 32) + new_res


def _targets_of(node) -> str:
    from kiln.ops.registry import op_name

    return op_name(node.target) if node.op == "call_function" else ""


def _targets(gm) -> dict[str, int]:
    from collections import Counter

    return Counter(_targets_of(n) for n in gm.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("scheme", ["dense", "int4"])
def test_gemm_input_fusion_pass_joins_norm_and_activation(scheme):
    import kiln.ops.activation  # noqa: F401
    import kiln.ops.dense_linear  # noqa: F401
    import kiln.ops.layernorm  # noqa: F401

    hidden, inter = 64, 96
    g = torch.Generator().manual_seed(0)
    x, res, gamma = torch.randn(5, hidden, generator=g), torch.randn(5, hidden, generator=g), torch.rand(hidden) + 0.5
    if scheme == "dense":
        weights = (torch.randn(hidden + 16, hidden, generator=g), torch.randn(hidden + 16, generator=g),
                   torch.randn(2 * inter, hidden, generator=g), torch.randn(hidden, inter, generator=g))
        args, layer = (x, res, gamma, *weights), _dense_layer
    else:
        mats = [torch.randn(o, i, generator=g) for o, i in ((hidden, hidden), (2 * inter, hidden), (hidden, inter))]
        args, layer = (x, res, gamma, *(t for m in mats for t in quant.quantize_int4(m, 32))), _int4_layer
    gm = make_fx(layer, tracing_mode="fake")(*args)
    want = gm(*args)
    gemm = f"kiln::linear_{scheme}"
    assert _targets(gm)[gemm] == 3
    assert GemmInputFusionPass(joins=(reference_joined("fp8"),))(gm.graph) == 0  # another scheme's GEMMs
    assert GemmInputFusionPass()(gm.graph) == 2
    gm.graph.lint()
    gm.recompile()
    after = _targets(gm)
    assert after[f"kiln::add_rms_norm_linear_{scheme}"] == 1 and after[f"kiln::silu_and_mul_linear_{scheme}"] == 1
    assert after[gemm] == 1  # gate_up's input comes from a GEMM: nothing to join
    assert after["kiln::add_rms_norm"] == 0 and after["kiln::silu_and_mul"] == 0
    # The references compute what the unjoined ops did, bit for bit.
    torch.testing.assert_close(gm(*args), want, rtol=0, atol=0)


def test_kernel_sets_carry_the_joins_where_the_gemms_are_cuda(monkeypatch, kernel_config):
    from kiln.ops import quant_cuda, registry
    from kiln.passes.manager import PassConfig, build_passes

    def joins(kernels, fusion="auto"):
        p = [p for p in build_passes(PassConfig(kernels=kernels, fusion=fusion)) if isinstance(p, GemmInputFusionPass)]
        return [(j.scheme, j.name) for j in p[0].joins]

    for cpu in (select_kernels("cpu"), reference_kernels()):
        assert cpu.joined_dense is None and cpu.joined_int4 is None and cpu.joined_fp8.name == "reference"
        described = cpu.describe()
        assert described["joined_dense"] == described["joined_int4"] == "none"
        assert joins(cpu) == [] and joins(cpu, "off") == []
        assert joins(cpu, "on") == [("fp8", "reference")]  # as before: no dense or int4 join on the CPU
    # The CUDA loaders, on a machine without CUDA: by default the dense join only (fp8's and int4's
    # measured no faster); kernels.gemv_join=[dense,fp8,int4] adds them, [] takes every one-row join off.
    monkeypatch.setattr(quant_cuda, "triton_supported", lambda: True)
    monkeypatch.setattr(quant_cuda, "fp8_supported", lambda: True)
    assert registry.gemv_join_schemes() == ("dense",)
    assert registry._choose("joined_fp8", "cuda").name == "triton"  # fp8: the norm apart at one row
    kernel_config(gemv_join=["dense", "fp8"])
    assert registry.gemv_join_schemes() == ("fp8", "dense")
    dense, fp8 = registry._triton_joined_dense(), registry._choose("joined_fp8", "cuda")
    assert registry._triton_joined_int4() is None
    assert dense.op is torch.ops.kiln_cuda.add_rms_norm_linear_dense and dense.gemm_ops == ("kiln_cuda::linear_dense",)
    assert fp8.op is torch.ops.kiln_cuda.add_rms_norm_linear_fp8
    assert fp8.silu_op is torch.ops.kiln_cuda.silu_and_mul_linear_fp8
    assert fp8.name == "triton_gemv" and fp8.gemm_ops == ("kiln::linear_fp8", "kiln_cuda::linear_fp8")
    cuda_fp8 = registry._cuda_fp8()
    joined = dataclasses.replace(reference_kernels(), device_type="cuda", joined_dense=dense, joined_fp8=fp8,
                                 linear_fp8=cuda_fp8)
    assert joined.describe()["joined_dense"] == "triton" != reference_kernels().describe()["joined_dense"]
    assert joins(joined) == [("fp8", "triton_gemv"), ("dense", "triton")] and joins(joined, "off") == []
    kernel_config(gemv_join=["dense", "fp8", "int4"])
    assert registry.gemv_join_schemes() == ("fp8", "dense", "int4")
    int4 = registry._triton_joined_int4()
    assert int4.silu_op is torch.ops.kiln_cuda.silu_and_mul_linear_int4
    assert int4.gemm_ops == ("kiln_cuda::linear_int4_triton",)  # not tinygemm's layout
    assert registry._triton_joined_dense() is not None and registry._choose("joined_fp8", "cuda").name == "triton_gemv"
    kernel_config(gemv_join=[])
    assert registry.gemv_join_schemes() == ()
    assert registry._triton_joined_dense() is None and registry._triton_joined_int4() is None
    apart = registry._choose("joined_fp8", "cuda")  # fp8 keeps its join (prefill quantizes), norm apart at one row
    assert apart.op is torch.ops.kiln_triton.add_rms_norm_linear_fp8 and apart.name == "triton"
    unjoined = dataclasses.replace(joined, joined_dense=None, joined_fp8=apart)
    assert joins(unjoined) == [("fp8", "triton")]
    assert unjoined.describe()["joined_fp8"] != joined.describe()["joined_fp8"]  # another artifact
    with pytest.raises(ValueError, match=re.escape("kernels.gemv_join=['int5']: 'int5' is not a scheme; "
                                                   "choose from ['fp8', 'dense', 'int4']")):
        kernel_config(gemv_join=["int5"])
    if torch.cuda.is_available():
        kernel_config(gemv_join=["dense"])
        cuda = select_kernels("cuda")
        assert cuda.joined_dense.name == "triton" and cuda.joined_int4 is None


def test_gemm_input_fusion_pass_writes_the_fed_fp8_join(monkeypatch, kernel_config):
    """The CUDA KernelSet's fp8 join (``kernels.gemv_join=[dense,fp8]``) in the graph: ``kiln_cuda``'s ops with the GEMM's output dtype,
    computing (here on the CPU, through their references) what the unjoined ops did, bit for bit."""
    import kiln.ops.activation  # noqa: F401
    import kiln.ops.layernorm  # noqa: F401
    from kiln.ops import quant_cuda, registry
    from tests.helpers.quant import fp8_layer

    monkeypatch.setattr(quant_cuda, "fp8_supported", lambda: True)
    kernel_config(gemv_join=["dense", "fp8"])  # off by default (measured no faster)
    hidden, inter = 64, 96
    g = torch.Generator().manual_seed(1)
    mats = [torch.randn(o, i, generator=g) for o, i in ((hidden, hidden), (2 * inter, hidden), (hidden, inter))]
    x, res, gamma = torch.randn(1, hidden, generator=g), torch.randn(1, hidden, generator=g), torch.rand(hidden) + 0.5
    args = (x, res, gamma, *(t for m in mats for t in quant.quantize_fp8(m)))
    gm = make_fx(fp8_layer, tracing_mode="fake")(*args)
    want = gm(*args)
    assert GemmInputFusionPass(joins=(registry._triton_gemv_joined_fp8(),))(gm.graph) == 2
    gm.graph.lint()
    gm.recompile()
    after = _targets(gm)
    assert after["kiln_cuda::add_rms_norm_linear_fp8"] == 1 and after["kiln_cuda::silu_and_mul_linear_fp8"] == 1
    assert after["kiln::add_rms_norm"] == 0 and after["kiln::silu_and_mul"] == 0 and after["kiln::linear_fp8"] == 1
    joined = [n for n in gm.graph.nodes if _targets_of(n) == "kiln_cuda::silu_and_mul_linear_fp8"]
    assert joined[0].args[-1] == torch.float32  # the GEMM's output dtype
    torch.testing.assert_close(gm(*args), want, rtol=0, atol=0)


@pytest.mark.slow
def test_int4_model_kiln_with_joins_matches_eager():
    """The int4 join through the whole pass chain and Inductor on the CPU (references for every op):
    QuantLinearPass writes the generic int4 GEMM, the fusions the norm and activation ops, and
    GemmInputFusionPass joins them on every piece."""
    from kiln.compiler import build_forward
    from kiln.config import CompileConfig
    from kiln.models.quantize import quantize_model
    from kiln.passes.manager import PassConfig
    from tests.helpers.quant import ARCH, float_model, step_logits

    kernels = dataclasses.replace(reference_kernels(), joined_int4=reference_joined("int4"))
    model = float_model()
    quantize_model(model, "int4", kernels)
    eager = step_logits(model, model)
    forward = build_forward(model, CompileConfig(mode="kiln"), PassConfig(kernels=kernels, fusion="on"))
    torch.testing.assert_close(step_logits(forward, model), eager, atol=1e-4, rtol=1e-4)
    rewrites = forward.backend.passes.num_rewrites
    # per layer: the MLP's norm + gate_up and silu + down (qkv's norm is the first layer's, after the embedding)
    assert rewrites["GemmInputFusionPass"] >= 2 * ARCH.num_layers
    assert not forward.backend.passes.failed


def test_fed_gemv_takes_its_own_measured_tile(monkeypatch):
    """A tile measured for a fed GEMV (``python -m benchmarks.kernels gemv-join --sweep``) serves it;
    the plain GEMV keeps its own, and a split-K entry sends the joined op to the unfused kernels."""
    from kiln.ops import triton_quant_gemm as tq

    monkeypatch.setattr(tq, "LOADED", {})
    tq._device_table.cache_clear()
    plain = tq.config_for("dense", 1, 40, 320)
    tq.load_measured({"dense+silu,1,40,320": [1, 16, 64, 1, 2, 3], "dense+norm,1,40,320": [1, 8, 64, 2, 2, 3]})
    try:
        assert tq.config_for("dense", 1, 40, 320, feed="silu") == tq.GemmConfig(1, 16, 64, 1, 2, 3)
        assert tq.config_for("dense", 1, 40, 320) == plain == tq.config_for("dense", 1, 40, 320, feed="x")
        w = torch.empty(40, 320, dtype=torch.bfloat16)
        assert tq.feed_fits("dense", tq.config_for("dense", 1, 40, 320, feed="silu"), 40, 320, 0, w)
        assert not tq.feed_fits("dense", tq.config_for("dense", 1, 40, 320, feed="norm"), 40, 320, 0, w)
    finally:
        tq._device_table.cache_clear()


def test_a_slightly_wider_gemm_takes_the_measured_tile():
    """A LoRA-joined GEMM (W's rows, then every slot's A rows: 384 more on llama3-8b's qkv with 8
    rank-16 slots) takes the tile measured for W's shape; a much wider one keeps the rule's."""
    from kiln.ops import triton_quant_gemm as tq

    assert tq.config_for("dense", 1, 6144 + 384, 4096) == tq.config_for("dense", 1, 6144, 4096)
    assert tq.config_for("dense", 1, 4096 + 128, 14336) == tq.config_for("dense", 1, 4096, 14336)
    assert tq.config_for("dense", 1, 8192, 4096) == tq.default_config("dense", 1, 8192, 4096)
