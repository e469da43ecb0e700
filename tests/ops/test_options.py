"""``kernels.*`` (``KernelConfig``) and ``kiln.ops.options``: the values each key takes, the errors a
bad one gets at config time, the scope of ``kernel_options``, the process options each executor
sets before it builds a runner, and the cache keys the graph-changing options enter."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from kiln.config import CompileConfig, EngineConfig, KernelConfig
from kiln.ops.options import current, kernel_options, set_kernel_options


def test_defaults_are_the_measured_choices():
    assert KernelConfig() == KernelConfig(pdl="on", gemv_join=("dense",), dense_gemv=True, decode_merge="fused",
                                          max_store_join_pairs=256, fp8_decode_maxnreg=None, rope_join=True,
                                          lora_join=True)
    assert EngineConfig().kernels == KernelConfig()


@pytest.mark.parametrize("fields,message", [
    ({"pdl": "maybe"}, "kernels.pdl='maybe' is not allowed; choose one of ['on', 'off', 'gemm']"),
    ({"pdl": "1"}, "kernels.pdl='1' is not allowed; choose one of ['on', 'off', 'gemm']"),
    ({"decode_merge": "split"}, "kernels.decode_merge='split' is not allowed; choose one of ['fused', 'kernel']"),
    ({"gemv_join": ["dense", "int5"]},
     "kernels.gemv_join=['dense', 'int5']: 'int5' is not a scheme; choose from ['fp8', 'dense', 'int4'] ([] joins none)"),
    ({"gemv_join": "fp8"}, "kernels.gemv_join takes a list of schemes, e.g. [dense,fp8], got 'fp8'"),
    ({"rope_join": "0"}, "kernels.rope_join takes true or false, got '0'"),
    ({"max_store_join_pairs": -1}, "kernels.max_store_join_pairs must be >= 0 (0: never joined), got -1"),
    ({"fp8_decode_maxnreg": -8}, "kernels.fp8_decode_maxnreg must be >= 0 (0: no cap) or null, got -8"),
])
def test_a_bad_value_names_the_key_and_what_it_takes(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        KernelConfig(**fields)
    with pytest.raises(ValueError, match=re.escape(message)):  # LLM(kernels={...}) builds it the same way
        EngineConfig.from_kwargs(kernels=fields)


def test_llm_style_groups_build_the_config():
    config = EngineConfig.from_kwargs(kernels={"pdl": "gemm", "gemv_join": ["dense", "fp8"], "rope_join": False})
    assert config.kernels == KernelConfig(pdl="gemm", gemv_join=("dense", "fp8"), rope_join=False)
    assert config.resolved("cpu").kernels == config.kernels
    # what a saved config holds (JSON: lists) builds the same config again
    assert EngineConfig.from_kwargs(kernels=dataclasses.asdict(config.kernels)).kernels == config.kernels
    with pytest.raises(ValueError, match=re.escape("unknown kernels option(s) ['pdll']; choose from")):
        EngineConfig.from_kwargs(kernels={"pdll": "off"})


def test_kernel_options_scope_nests_and_restores():
    assert current() == KernelConfig()
    with kernel_options(pdl="off") as outer:
        assert current() is outer and outer.pdl == "off"
        with kernel_options(decode_merge="kernel"):
            assert (current().pdl, current().decode_merge) == ("off", "kernel")
        assert current() == outer
        with kernel_options(KernelConfig(rope_join=False)):
            assert current() == KernelConfig(rope_join=False)
    assert current() == KernelConfig()
    with pytest.raises(TypeError, match="KernelConfig"):
        set_kernel_options({"pdl": "off"})


class _Built(Exception):
    """Raised where a runner would be built: the options set by then are the runner's."""


def test_the_one_process_executor_sets_the_options_before_its_runner(monkeypatch):
    from kiln.entrypoints.llm import LLM
    from kiln.runtime import model_runner

    seen = []

    def runner(*args, **kwargs):
        seen.append(current())
        raise _Built

    monkeypatch.setattr(model_runner, "ModelRunner", runner)
    with kernel_options():  # the process's options come back after the test
        with pytest.raises(_Built):
            LLM(model="random:tiny", kernels={"pdl": "off", "max_store_join_pairs": 0})
    assert seen == [KernelConfig(pdl="off", max_store_join_pairs=0)]


def test_a_rank_process_sets_the_options_before_its_runner(monkeypatch):
    import torch.distributed as dist

    from kiln.config import CacheConfig, ModelConfig
    from kiln.models.parallel import TensorParallel
    from kiln.runtime import worker

    seen = []

    def init_process_group(*args, **kwargs):  # the first step of a rank's start after the options
        seen.append(current())
        raise _Built

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    spec = worker.WorkerSpec(ModelConfig("random:tiny", device="cpu"), CacheConfig(), CompileConfig(), None,
                             TensorParallel(0, 2), "tcp://127.0.0.1:1", 1.0, kernels=KernelConfig(decode_merge="kernel"))
    with kernel_options(), pytest.raises(_Built):
        worker._start(spec)
    assert seen == [KernelConfig(decode_merge="kernel")]


def _forward_key(kernels) -> str:
    from kiln.compiler.artifact_cache import forward_key

    model = torch.nn.Linear(4, 4)
    return forward_key(model, "toy", CompileConfig(mode="kiln", split_every=1), kernels, 64)


def test_options_that_change_the_graph_change_the_forward_key():
    """What is kept beside a compiled forward is filed under a key that differs with every option
    that changes the graph (the rotary join, the GEMV joins, the LoRA layout), and not with those
    that only change a launch."""
    from kiln.ops.registry import select_kernels

    default = _forward_key(select_kernels("cpu"))
    assert _forward_key(select_kernels("cpu")) == default
    for fields in ({"rope_join": False}, {"gemv_join": ()}, {"gemv_join": ("dense", "int4")}, {"lora_join": False}):
        with kernel_options(**fields):
            assert _forward_key(select_kernels("cpu")) != default, fields
    for fields in ({"pdl": "off"}, {"decode_merge": "kernel"}, {"max_store_join_pairs": 0},
                   {"fp8_decode_maxnreg": 0}, {"dense_gemv": False}):
        with kernel_options(**fields):
            assert _forward_key(select_kernels("cpu")) == default, fields


def test_a_kernel_set_keeps_the_options_it_was_chosen_under():
    from kiln.ops.registry import reference_kernels, select_kernels

    with kernel_options(rope_join=False, gemv_join=()):
        chosen, reference = select_kernels("cpu"), reference_kernels()
    assert chosen.options == reference.options == KernelConfig(rope_join=False, gemv_join=())
    assert select_kernels("cpu").options == KernelConfig()
