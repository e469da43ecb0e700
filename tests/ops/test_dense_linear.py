"""Dense one-row GEMMs (``kiln.ops.dense_linear``) and ``DenseLinearPass``.

The Triton GEMV (scheme ``dense`` of ``kiln.ops.triton_quant_gemm``) is checked against a float64
product on fresh random inputs: in Triton's interpreter on the CPU (a child process, as in
``test_quant_gemm.py``) and on the GPU through ``kiln_cuda::linear_dense`` at llama3-8b's shapes.
The pass is checked on a traced graph: which linears it rewrites and that the graph still computes
the same values.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.helpers.triton_interpreter import run_in_triton_interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUN_KERNELS_HERE = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.skipif(RUN_KERNELS_HERE, reason="kernels run in this process")
def test_dense_gemv_in_triton_interpreter():
    pytest.importorskip("triton")
    out = run_in_triton_interpreter(__file__, "interpreted")
    assert " failed" not in out


@pytest.mark.skipif(not RUN_KERNELS_HERE or DEVICE == "cuda", reason="CPU: runs in the Triton interpreter")
@pytest.mark.parametrize("n,k,cfg", [(40, 256, (1, 8, 64, 1, 4, 1)), (24, 320, (1, 4, 128, 1, 2, 3)),
                                     (36, 512, (1, 16, 256, 1, 4, 2))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreted_dense_gemv_matches_reference(n, k, cfg, dtype):
    """One row, K a multiple of the tile or not, N not a multiple of the row tile."""
    from kiln.ops.triton_quant_gemm import GemmConfig, triton_linear

    gen = torch.Generator().manual_seed(n * k)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    x = torch.randn(1, k, generator=gen).to(dtype)
    got = triton_linear("dense", x, w, None, 0, config=GemmConfig(*cfg))
    assert got.shape == (1, n) and got.dtype == dtype
    assert _rel(got, x.double() @ w.double().t()) < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1000, 576)])
@pytest.mark.parametrize("rows", [1, 3])
def test_gpu_linear_dense_matches_reference(n, k, rows):
    """kiln_cuda::linear_dense at one row (the Triton GEMV) and three (cuBLAS), with a bias."""
    from kiln.ops.dense_linear import gemv_fits

    gen = torch.Generator(device="cuda").manual_seed(n + k + rows)
    w = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).bfloat16()
    x = torch.randn(rows, k, generator=gen, device="cuda").bfloat16()
    bias = torch.randn(n, generator=gen, device="cuda").bfloat16()
    assert gemv_fits(x, w) == (rows == 1)
    want = x.double() @ w.double().t()
    got = torch.ops.kiln_cuda.linear_dense(x, w)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    assert _rel(got, want) < 1e-2
    assert _rel(torch.ops.kiln_cuda.linear_dense(x, w, bias), want + bias.double()) < 1e-2


class _Linears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 24, bias=False).bfloat16()
        self.b = nn.Linear(24, 8).bfloat16()
        self.c = nn.Linear(8, 4)  # float32: stays a linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.a.weight)
        h = torch._C._nn.linear(h, self.b.weight, self.b.bias)
        return self.c(h.float())


def _traced():
    torch.manual_seed(0)
    model = _Linears()
    gm = torch.fx.symbolic_trace(model)
    x = torch.randn(1, 16).bfloat16()
    torch.fx.passes.shape_prop.ShapeProp(gm).propagate(x)
    for node in gm.graph.nodes:  # Dynamo's graphs carry example values; ShapeProp leaves tensor_meta
        if node.op == "get_attr":
            node.meta["example_value"] = gm.get_parameter(node.target)
        elif "tensor_meta" in node.meta:
            tm = node.meta["tensor_meta"]
            node.meta["example_value"] = torch.empty(tm.shape, dtype=tm.dtype)
    return model, gm, x


def test_dense_linear_pass_rewrites_16_bit_linears_of_its_device():
    from kiln.passes.dense_linear import DenseLinearPass

    model, gm, x = _traced()
    want = model(x)
    op = torch.ops.kiln.linear_dense
    assert DenseLinearPass(enabled=True, op=op, device_type="cuda")(gm.graph) == 0  # another device's weights
    assert DenseLinearPass(enabled=False, op=op, device_type="cpu")(gm.graph) == 0
    assert DenseLinearPass(enabled=True, op=op, device_type="cpu")(gm.graph) == 2
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_module")]
    assert targets.count(torch.ops.kiln.linear_dense.default) == 2
    assert "c" in targets  # the float32 layer is untouched
    torch.testing.assert_close(gm(x), want)


def test_kernel_sets_choose_the_dense_gemm_and_the_pass_follows():
    from kiln.ops.registry import reference_kernels, select_kernels
    from kiln.passes.dense_linear import DenseLinearPass
    from kiln.passes.manager import PassConfig, build_passes

    cpu = select_kernels("cpu")
    assert cpu.linear_dense.name == "reference" and cpu.describe()["linear_dense"] == "reference"
    passes = [p for p in build_passes(PassConfig(kernels=reference_kernels())) if isinstance(p, DenseLinearPass)]
    assert len(passes) == 1 and not passes[0].enabled  # the reference is F.linear: nothing to swap in
    if torch.cuda.is_available():
        cuda = select_kernels("cuda")
        assert cuda.linear_dense.op is torch.ops.kiln_cuda.linear_dense
        passes = [p for p in build_passes(PassConfig(kernels=cuda)) if isinstance(p, DenseLinearPass)]
        assert passes[0].enabled and passes[0].device_type == "cuda"


def test_linear_dense_with_mismatched_shapes_raises_like_f_linear():
    """A weight whose K is not x's never reaches the GEMV (which would read past x's row): the op
    raises F.linear's error, on every device."""
    from kiln.ops import dense_linear  # noqa: F401  (defines the ops)

    x = torch.randn(1, 16, device=DEVICE).bfloat16()
    w = torch.randn(8, 24, device=DEVICE).bfloat16()
    assert not dense_linear.gemv_fits(x, w)
    for op in (torch.ops.kiln_cuda.linear_dense, torch.ops.kiln.linear_dense):
        with pytest.raises(RuntimeError, match="shape|size"):
            op(x, w)
