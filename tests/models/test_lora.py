"""PEFT adapters read by ``kiln.models.lora``: each module's A and scaled B give PEFT's merged
weights, and every adapter kiln cannot serve is refused naming the file and the field."""

from __future__ import annotations

import shutil

import pytest
import torch

from kiln.models.lora import read_adapter
from tests.helpers.lora import ADAPTERS, edit_config, merged, write_adapter, write_base

pytest.importorskip("peft")

NUM_LAYERS = 2
SHAPES = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
          "gate_proj": (64, 96), "up_proj": (64, 96), "down_proj": (96, 64)}


@pytest.fixture(scope="module")
def base_and_adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = write_base("llama", root / "base")
    dirs = {}
    for i, (name, spec) in enumerate(ADAPTERS.items()):
        dirs[name] = root / name
        write_adapter(base, dirs[name], *spec, seed=10 + i)
    return base, dirs


def _read(path, max_rank=64):
    return read_adapter("x", str(path), SHAPES, NUM_LAYERS, max_rank, torch.float32)


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_scaled_modules_give_peft_merged_weights(base_and_adapters, name):
    base, dirs = base_and_adapters
    adapter = _read(dirs[name])
    want = dict(merged(base, dirs[name]).named_parameters())
    base_w = dict(base.named_parameters())
    targets = ADAPTERS[name][3]
    assert {t for _, t in adapter.modules} == set(targets)
    for (layer, target), (a, b_t) in adapter.modules.items():
        owner = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        key = f"model.layers.{layer}.{owner}.{target}.weight"
        got = base_w[key] + b_t.T @ a  # W + scale * B @ A
        torch.testing.assert_close(got, want[key], rtol=1e-5, atol=1e-5)


def test_refusals_name_the_file_and_field(base_and_adapters, tmp_path):
    _, dirs = base_and_adapters
    with pytest.raises(ValueError, match="adapter_model.safetensors is missing"):
        bad = tmp_path / "no_weights"
        shutil.copytree(dirs["a"], bad)
        (bad / "adapter_model.safetensors").unlink()
        _read(bad)
    with pytest.raises(ValueError, match="is not a directory"):
        _read(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"adapter_config.json: r=16 is above lora.max_lora_rank=8"):
        _read(dirs["c"], max_rank=8)
    for field, value, message in (("target_modules", ["lm_head"], "not the embedding or LM head"),
                                  ("target_modules", ["dense_h_to_4h"], "not a projection kiln serves"),
                                  ("use_dora", True, "use_dora"), ("bias", "all", "bias is 'all'"),
                                  ("modules_to_save", ["lm_head"], "modules_to_save"),
                                  ("peft_type", "IA3", "peft_type")):
        bad = tmp_path / f"bad_{field}_{value}"
        shutil.copytree(dirs["a"], bad)
        edit_config(bad, **{field: value})
        with pytest.raises(ValueError, match=f"adapter_config.json.*{message}"):
            _read(bad)
    other = dict(SHAPES, q_proj=(64, 128))  # another base model's q_proj
    with pytest.raises(ValueError, match=r"adapter_model.safetensors: model.layers.0.q_proj .*another base model"):
        read_adapter("x", str(dirs["a"]), other, NUM_LAYERS, 64, torch.float32)
    with pytest.raises(ValueError, match="the base model has 1 layers"):
        read_adapter("x", str(dirs["a"]), SHAPES, 1, 64, torch.float32)
