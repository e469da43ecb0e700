"""AWQ and GPTQ 4-bit checkpoints: written here from random integers, group zeros and fp16 scales
with packing functions of the test's own, loaded by kiln, and checked against ``(q - z) * s``:
each QuantLinear's weight exactly, the model's logits against the same model in float32, and a
checkpoint packed in the wrong nibble order fails that comparison.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kiln.config import ModelConfig
from kiln.models.int4_checkpoint import dequantize_int4_checkpoint, int4_checkpoint_format
from kiln.models.llama import LlamaForCausalLM
from kiln.models.loader import iter_random_weights, load_model
from kiln.models.quantize import QuantLinear, checkpoint_quantization
from kiln.ops.registry import reference_kernels
from tests.helpers.hf import write_toy_tokenizer
from tests.helpers.paged import PagedBatcher, make_kv_caches, run_step
from tests.helpers.quant import checkpoint_arch

CPU = torch.device("cpu")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _words(nibbles: np.ndarray) -> np.ndarray:
    """[..., M, 8] values 0..15 -> int32 [..., M], value i in bits 4i..4i+3."""
    words = np.zeros(nibbles.shape[:-1], dtype=np.uint32)
    for i in range(8):
        words |= nibbles[..., i].astype(np.uint32) << np.uint32(4 * i)
    return words.view(np.int32)


def pack_gptq(q: np.ndarray, stored_zeros: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q [N, K] -> qweight [K/8, N] (8 consecutive k per word); zeros [N, K/g] -> qzeros [K/g, N/8]."""
    n, k = q.shape
    qweight = _words(q.T.reshape(k // 8, 8, n).transpose(0, 2, 1))
    qzeros = _words(stored_zeros.T.reshape(stored_zeros.shape[1], n // 8, 8))
    return qweight, qzeros


def pack_awq(q: np.ndarray, zeros: np.ndarray, order=AWQ_ORDER) -> tuple[np.ndarray, np.ndarray]:
    """q [N, K] -> qweight [K, N/8], word j nibble i = column 8j + order[i]; zeros likewise."""
    def pack(rows: np.ndarray) -> np.ndarray:  # [R, N]
        r, n = rows.shape
        return _words(rows.reshape(r, n // 8, 8)[..., order])
    return pack(q.T), pack(zeros.T)


def _quantized_projection(rng, n: int, k: int, group: int, zero_range) -> tuple:
    q = rng.integers(0, 16, size=(n, k))
    z = rng.integers(*zero_range, size=(n, k // group))
    s = rng.uniform(0.004, 0.03, size=(n, k // group)).astype(np.float16)
    w = (q - np.repeat(z, group, axis=1)) * np.repeat(s.astype(np.float32), group, axis=1)
    return q, z, s, torch.from_numpy(w.astype(np.float32))


def write_int4_checkpoint(path, preset: str, qc: dict, seed: int = 0, awq_order=AWQ_ORDER) -> dict:
    """A random ``preset`` model whose decoder projections are AWQ/GPTQ tensors in ``path``; returns
    every checkpoint tensor's float value by Hugging Face name (projections: ``(q - z) * s``)."""
    from safetensors.torch import save_file

    arch, rng = checkpoint_arch(preset), np.random.default_rng(seed)
    v1 = qc["quant_method"] == "gptq" and qc.get("checkpoint_format", "gptq") == "gptq"
    tensors, floats = {}, {}
    for name, t in iter_random_weights(arch, seed, CPU, torch.float32):
        if not name.endswith("proj.weight"):
            tensors[name] = floats[name] = t.contiguous()
            continue
        n, k = t.shape
        group = k if qc["group_size"] == -1 else qc["group_size"]
        q, z, s, floats[name] = _quantized_projection(rng, n, k, group, (1, 17) if v1 else (0, 16))
        base = name.removesuffix(".weight")
        if qc["quant_method"] == "awq":
            qweight, qzeros = pack_awq(q, z, awq_order)
        else:
            qweight, qzeros = pack_gptq(q, z - 1 if v1 else z)  # the original format stores zero - 1
            tensors[f"{base}.g_idx"] = torch.arange(k, dtype=torch.int32) // group
        tensors[f"{base}.qweight"] = torch.from_numpy(qweight)
        tensors[f"{base}.qzeros"] = torch.from_numpy(qzeros)
        tensors[f"{base}.scales"] = torch.from_numpy(np.ascontiguousarray(s.T))
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**arch.to_hf_config(), "quantization_config": qc}))
    write_toy_tokenizer(path)
    return floats


def _float_model(preset: str, floats: dict) -> LlamaForCausalLM:
    model = LlamaForCausalLM(checkpoint_arch(preset)).eval()
    model.load_weights(iter(floats.items()))
    return model


def _logits(model) -> torch.Tensor:
    """Logits of a prefill and a decode step, through the float32 embedding (a quantized CPU model's
    own head runs in bfloat16)."""
    g = torch.Generator().manual_seed(0)
    schedule = [{"a": torch.randint(0, 512, (9,), generator=g).tolist(), "b": [5, 8]}, {"a": [3], "b": [7]}]
    batcher = PagedBatcher(16, 4, seed=1)
    caches = make_kv_caches(model.arch, 16, 4)
    out = []
    for new_tokens in schedule:
        with torch.inference_mode():
            out.append(F.linear(run_step(model, caches, batcher.step(new_tokens)), model.embed_tokens.weight))
    return torch.cat(out)


def _fused_reference(floats: dict, module: str) -> torch.Tensor:
    parent, proj = module.rsplit(".", 1)
    return torch.cat([floats[f"model.{parent}.{p}.weight"] for p in FUSED.get(proj, (proj,))])


VARIANTS = {
    "awq-g128": ("tiny", {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "GEMM", "zero_point": True}),
    "gptq-g128": ("tiny", {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": False}),
    "gptq_v2-g64-bias": ("tiny-qwen2", {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False,
                                        "checkpoint_format": "gptq_v2"}),
    "gptq-per-channel": ("tiny", {"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_int4_checkpoint_loads_exactly(variant, tmp_path):
    preset, qc = VARIANTS[variant]
    floats = write_int4_checkpoint(tmp_path, preset, qc)
    assert checkpoint_quantization(str(tmp_path)) == "int4"
    loaded = load_model(ModelConfig(model=str(tmp_path), quantization="auto"), "", CPU, torch.float32,
                        kernels=reference_kernels("cpu"))
    assert loaded.model.quantization == "int4"
    quantized = {n: m for n, m in loaded.model.named_modules() if isinstance(m, QuantLinear)}
    assert len(quantized) == 4 * loaded.arch.num_layers
    for name, m in quantized.items():
        want = _fused_reference(floats, name)
        assert m.group_size == (m.in_features if qc["group_size"] == -1 else qc["group_size"]), name
        assert torch.equal(m.kernel.dequant(m.qweight, m.scales, m.group_size, torch.float32), want), name
    reference = _float_model(preset, floats)
    want = _logits(reference)
    assert want.abs().max() > 0.5  # far above the tolerance below
    torch.testing.assert_close(_logits(loaded.model), want, atol=1e-5, rtol=1e-4)


def test_awq_nibble_order_matters(tmp_path):
    """A checkpoint packed in plain nibble order (not AWQ's) loads to a model the comparison above rejects."""
    preset, qc = VARIANTS["awq-g128"]
    floats = write_int4_checkpoint(tmp_path, preset, qc, awq_order=list(range(8)))
    loaded = load_model(ModelConfig(model=str(tmp_path), quantization="auto"), "", CPU, torch.float32,
                        kernels=reference_kernels("cpu"))
    err = (_logits(loaded.model) - _logits(_float_model(preset, floats))).abs().max()
    assert err > 1e-1, err


def test_int4_checkpoint_on_the_cpu_kernels_and_unquantized(tmp_path):
    preset, qc = VARIANTS["awq-g128"]
    floats = write_int4_checkpoint(tmp_path, preset, qc)
    want = _logits(_float_model(preset, floats))
    served = load_model(ModelConfig(model=str(tmp_path), quantization="int4"), "", CPU, torch.float32)
    kinds = {m.kernel.name for m in served.model.modules() if isinstance(m, QuantLinear)}
    assert kinds and "reference" not in kinds, kinds  # torch's packed CPU kernel, bfloat16 activations
    torch.testing.assert_close(_logits(served.model), want, atol=5e-2 * want.abs().max().item(), rtol=0)
    dense = load_model(ModelConfig(model=str(tmp_path), quantization="none"), "", CPU, torch.float32)
    assert dense.model.quantization == "none"
    for name, m in dense.model.named_modules():
        if name.endswith("_proj") and isinstance(m, torch.nn.Linear):
            assert torch.equal(m.weight, _fused_reference(floats, name)), name


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "only 4-bit"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "GEMM packing"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "desc_act=false"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "plain GPTQ packing"),
])
def test_unsupported_variants_say_what_to_do(qc, match, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": qc}))
    with pytest.raises(ValueError, match=match):
        checkpoint_quantization(str(tmp_path))


def test_act_order_g_idx_is_refused():
    fmt = int4_checkpoint_format({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False})
    g_idx = torch.arange(64, dtype=torch.int32) // 32
    assert list(dequantize_int4_checkpoint(iter([("m.g_idx", g_idx)]), fmt, torch.float32)) == []
    with pytest.raises(ValueError, match="desc_act=false"):
        list(dequantize_int4_checkpoint(iter([("m.g_idx", g_idx.flip(0))]), fmt, torch.float32))
    with pytest.raises(ValueError, match="lack one of"):
        list(dequantize_int4_checkpoint(iter([("m.qweight", torch.zeros(8, 8, dtype=torch.int32))]), fmt,
                                        torch.float32))


def test_int4_checkpoint_shards_under_tensor_parallelism(tmp_path):
    """Each rank's int4 linears hold exactly its slice of the float weights load_weights gives it."""
    from kiln.models.parallel import TensorParallel

    preset, qc = VARIANTS["gptq_v2-g64-bias"]
    floats = write_int4_checkpoint(tmp_path, preset, qc)
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        int4 = load_model(ModelConfig(model=str(tmp_path), quantization="auto"), "", CPU, torch.float32, tp,
                          kernels=reference_kernels("cpu"))
        dense = load_model(ModelConfig(model=str(tmp_path), quantization="none"), "", CPU, torch.float32, tp)
        quantized = {n: m for n, m in int4.model.named_modules() if isinstance(m, QuantLinear)}
        assert len(quantized) == 4 * int4.arch.num_layers
        for name, m in quantized.items():
            want = dense.model.get_submodule(name).weight
            assert 2 * m.out_features * m.in_features == _fused_reference(floats, name).numel(), name  # half each
            assert torch.equal(m.kernel.dequant(m.qweight, m.scales, m.group_size, torch.float32), want), (rank, name)


def test_int4_groups_split_across_ranks_are_refused(tmp_path):
    from kiln.models.parallel import TensorParallel

    preset, qc = VARIANTS["gptq-g128"]  # o_proj's 128 input columns: 64 a rank, half a group
    write_int4_checkpoint(tmp_path, preset, qc)
    with pytest.raises(ValueError, match="whole int4 groups"):
        load_model(ModelConfig(model=str(tmp_path), quantization="auto"), "", CPU, torch.float32, TensorParallel(0, 2))


def test_desc_act_with_one_group_loads(tmp_path):
    preset, qc = VARIANTS["gptq-per-channel"]
    floats = write_int4_checkpoint(tmp_path, preset, {**qc, "desc_act": True})
    loaded = load_model(ModelConfig(model=str(tmp_path), quantization="auto"), "", CPU, torch.float32,
                        kernels=reference_kernels("cpu"))
    m = loaded.model.layers[0].mlp.down_proj
    assert torch.equal(m.kernel.dequant(m.qweight, m.scales, m.group_size, torch.float32),
                       floats["model.layers.0.mlp.down_proj.weight"])


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["awq-g128", "gptq_v2-g64-bias"])
def test_int4_checkpoint_on_the_cuda_kernels(variant, tmp_path):
    """The same checkpoints served on a GPU: bfloat16 activations through the Triton int4 kernels,
    each weight the checkpoint's within bfloat16 rounding of its scales, logits close to float32's."""
    cuda = torch.device("cuda")
    preset, qc = VARIANTS[variant]
    floats = write_int4_checkpoint(tmp_path, preset, qc)
    want = _logits(_float_model(preset, floats))
    served = load_model(ModelConfig(model=str(tmp_path), quantization="auto"), "", cuda, torch.bfloat16)
    quantized = {n: m for n, m in served.model.named_modules() if isinstance(m, QuantLinear)}
    assert len(quantized) == 4 * served.arch.num_layers
    assert {m.kernel.name for m in quantized.values()} == {"triton"}
    for name, m in quantized.items():
        got = m.kernel.dequant(m.qweight, m.scales, m.group_size, torch.float32).cpu()
        want_w = _fused_reference(floats, name)  # bfloat16 scales and zeros: within their rounding
        torch.testing.assert_close(got, want_w, atol=1e-2 * want_w.abs().max().item(), rtol=1e-2, msg=name)
    g = torch.Generator().manual_seed(0)
    schedule = [{"a": torch.randint(0, 512, (9,), generator=g).tolist(), "b": [5, 8]}, {"a": [3], "b": [7]}]
    batcher = PagedBatcher(16, 4, seed=1, device=cuda)
    caches = make_kv_caches(served.arch, 16, 4, dtype=torch.bfloat16, device=cuda)
    head = _float_model(preset, floats).embed_tokens.weight.detach()
    got = []
    for new_tokens in schedule:
        with torch.inference_mode():
            hidden = run_step(served.model, caches, batcher.step(new_tokens)).float().cpu()
            got.append(F.linear(hidden, head))
    torch.testing.assert_close(torch.cat(got), want, atol=5e-2 * want.abs().max().item(), rtol=0)
