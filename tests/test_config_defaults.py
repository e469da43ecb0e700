"""``auto`` defaults: decided per device in one place (kiln.config.resolve_for_device), kept when set."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kiln.config import (
    CPU_SPLIT_EVERY, CompileConfig, EngineConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig, default_capture_sizes,
    resolve_for_device,
)


def test_capture_sizes_are_1_2_4_then_every_8():
    assert default_capture_sizes(512) == (1, 2, 4) + tuple(range(8, 513, 8))
    assert default_capture_sizes(20) == (1, 2, 4, 8, 16, 20)  # max_num_seqs itself is always a size
    assert default_capture_sizes(3) == (1, 2, 3)


def test_capture_sizes_cover_the_token_budget_with_piecewise_sizes():
    # Above max_num_seqs only mixed steps (prefill chunks) run: every 256 tokens up to the budget.
    assert default_capture_sizes(512, 2048) == default_capture_sizes(512) + (768, 1024, 1280, 1536, 1792, 2048)
    assert default_capture_sizes(500, 1000) == default_capture_sizes(500) + (512, 768, 1000)
    assert default_capture_sizes(512, 512) == default_capture_sizes(512)
    assert default_capture_sizes(512, 100) == default_capture_sizes(100)  # the budget caps the decode sizes too


def test_cuda_defaults_are_the_fast_path():
    config = EngineConfig().resolved("cuda")
    assert (config.compile.mode, config.compile.cudagraph) == ("kiln", "full_and_piecewise")
    assert config.compile.split_every == 1  # piecewise graphs capture the pieces between attention calls
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (512, 4096)
    assert config.compile.capture_sizes == default_capture_sizes(512, 4096)
    assert config.compile.capture_sizes[-1] == 4096
    assert config.compile.is_resolved and config.scheduler.is_resolved


@pytest.mark.cpu_default
def test_cpu_defaults_build_kiln_in_the_background():
    config = EngineConfig().resolved("cpu")
    assert (config.compile.mode, config.compile.cudagraph, config.compile.build) == ("kiln", "none", "background_when_cold")
    assert config.compile.split_every == CPU_SPLIT_EVERY > 1  # groups of layers, one build each
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (128, 2048)
    assert config.compile.is_resolved
    assert EngineConfig(compile=CompileConfig(split_every=1)).resolved("cpu").compile.split_every == 1
    assert not CompileConfig().is_resolved and CompileConfig().split_every is None
    # Where no background build can run, auto is eager; a mode or build the user set is kept.
    assert EngineConfig(parallel=ParallelConfig(backend="mp")).resolved("cpu").compile.mode == "eager"
    draft = EngineConfig(speculative=SpeculativeConfig(method="draft", draft_model="random:tiny")).resolved("cpu")
    assert (draft.compile.mode, draft.compile.build) == ("eager", "startup")
    assert EngineConfig(compile=CompileConfig(startup="complete")).resolved("cpu").compile.build == "startup"
    compile, _ = resolve_for_device(CompileConfig(mode="kiln"), SchedulerConfig(), "cpu")
    assert (compile.mode, compile.build) == ("kiln", "startup")
    assert resolve_for_device(compile, SchedulerConfig(), "cpu")[0] == compile


def plan(entrypoint="server", **compile):
    c = EngineConfig(compile=CompileConfig(**compile)).resolved("cuda", entrypoint).compile
    return c.build, c.capture


def test_startup_policies_on_cuda():
    # auto: a server loads a cached forward before ready and builds an uncached one on a thread (the
    # runner decides which from the compile cache); an offline batch job builds and captures first.
    assert plan() == ("background_when_cold", "lazy")
    assert plan("offline") == ("startup", "startup")
    assert plan(startup="complete") == plan("offline", startup="complete") == ("startup", "startup")
    assert plan(startup="fast") == plan("offline", startup="fast") == ("background", "lazy")
    # A compile.mode set by hand is built before ready under auto (a sweep of modes times each one);
    # fast still builds it on a thread.
    assert plan(mode="kiln") == ("startup", "lazy")
    assert plan(mode="kiln", startup="fast") == ("background", "lazy")
    # Without graphs nothing is captured between steps.
    assert plan(startup="fast", cudagraph="none") == ("background", "startup")
    # Only kiln's forward is built on a thread; other modes are ready at once anyway.
    assert plan(mode="eager", startup="fast") == ("startup", "lazy")


def test_startup_policies_that_need_one_process_fall_back():
    # Several ranks must switch at the same step and cannot capture between steps; a draft model
    # must not be captured while the target builds.
    mp = EngineConfig(compile=CompileConfig(startup="fast"), parallel=ParallelConfig(backend="mp"))
    assert (mp.resolved("cuda").compile.build, mp.resolved("cuda").compile.capture) == ("startup", "startup")
    assert mp.resolved("cpu").compile.build == "startup"
    draft = SpeculativeConfig(method="draft", draft_model="random:tiny")
    for policy in ("auto", "fast"):
        resolved = EngineConfig(compile=CompileConfig(startup=policy), speculative=draft).resolved("cuda").compile
        assert resolved.build == "startup"
    explicit = EngineConfig(compile=CompileConfig(startup="fast")).resolved("cuda").compile
    assert resolve_for_device(explicit, SchedulerConfig(), "cuda")[0] == explicit  # idempotent


@pytest.mark.cpu_default
def test_the_replaced_startup_keys_name_compile_startup():
    for key in ("build", "capture", "max_startup_capture_size"):
        with pytest.raises(ValueError, match=f"compile.{key} is gone: set compile.startup"):
            EngineConfig.from_kwargs(compile={key: "startup"})
    with pytest.raises(ValueError, match="compile.startup='later' is not allowed"):
        CompileConfig(startup="later")
    with pytest.raises(TypeError):
        CompileConfig(build="background")  # the resolved type's field, not the user's


def test_tests_resolve_the_cpu_default_to_eager():
    # tests/conftest.py: unmarked tests do not start a background build for every engine they make,
    # and their kiln pieces hold one layer each.
    compile = EngineConfig().resolved("cpu").compile
    assert (compile.mode, compile.split_every) == ("eager", 1)


def test_what_the_user_set_is_kept_and_resolution_is_idempotent():
    compile, sched = resolve_for_device(CompileConfig(mode="eager"), SchedulerConfig(max_num_seqs=64), "cuda")
    assert (compile.mode, compile.cudagraph) == ("eager", "full")  # piecewise graphs need kiln mode
    assert sched.max_num_seqs == 64 and sched.max_num_batched_tokens == 4096
    assert compile.capture_sizes == default_capture_sizes(64, 4096)  # decode sizes to 64, piecewise ones to 4096
    assert 64 in compile.capture_sizes and 72 not in compile.capture_sizes and compile.capture_sizes[-1] == 4096
    assert resolve_for_device(compile, sched, "cuda") == (compile, sched)
    compile, _ = resolve_for_device(CompileConfig(capture_sizes=(8, 1, 8)), SchedulerConfig(), "cuda")
    assert compile.capture_sizes == (1, 8)


def test_unresolved_configs_are_refused_where_used():
    from kiln.compiler.forward import build_forward
    from kiln.runtime.kv_cache_manager import KVCacheManager
    from kiln.runtime.scheduler import Scheduler

    with pytest.raises(ValueError, match="resolve"):
        Scheduler(SchedulerConfig(), KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True))
    with pytest.raises(ValueError, match="resolve"):
        build_forward(torch.nn.Linear(1, 1), CompileConfig())
    with pytest.raises(ValueError, match="capture_sizes must be positive"):
        CompileConfig(capture_sizes=(0, 1))
    assert dataclasses.replace(CompileConfig(), mode="kiln").mode == "kiln"
