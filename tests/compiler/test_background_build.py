"""A background build (compile.startup=fast; auto on the CPU, and for a cold server on CUDA): kiln's forward is built on a thread while the model
serves eagerly, and the step after the build switches to it. (The build beside eager steps of the
same model: tests/compiler/test_compiler.py.)"""

from __future__ import annotations

import logging
import time

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.compiler import KilnForward
from kiln.compiler.background_build import BackgroundBuild
from kiln.config import CompileConfig
from kiln.models.llama import LlamaForCausalLM

BACKGROUND = CompileConfig(mode="kiln", startup="fast")
PROMPTS = [[5, 17, 3, 99, 42, 7], [8, 8, 1]]


def _generate(llm: LLM) -> tuple[list[list[int]], list[list[float]]]:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return tokens, logprobs


@pytest.fixture(scope="module")
def eager_outputs():
    llm = LLM(model="random:tiny", compile=CompileConfig(mode="eager"))
    return _generate(llm)


def _assert_like_eager(got, want) -> None:
    assert got[0] == want[0]
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(torch.tensor(g), torch.tensor(w), atol=1e-3, rtol=1e-3)


def test_steps_switch_to_kiln_once_built(eager_outputs):
    llm = LLM(model="random:tiny", compile=BACKGROUND)
    compiled = llm.engine.executor.runner.compiled
    _assert_like_eager(_generate(llm), eager_outputs)  # eager, or kiln if the build was quick
    assert llm.engine.wait_for_build(timeout=600)
    _assert_like_eager(_generate(llm), eager_outputs)  # built: steps switch at the next one, if not yet
    assert not compiled.building and isinstance(compiled.forward, KilnForward)
    assert llm.engine.wait_for_build(timeout=0)


def test_steps_run_eagerly_while_the_forward_loads_from_the_compile_cache(eager_outputs, monkeypatch):
    """A warm start: the build reads the saved graph (an FX trace, which patches ``nn.Module.__call__``
    process-wide) while eager steps run; every step gives eager's tokens. The trace is slowed down
    (2 ms a node) so that steps surely fall inside it."""
    LLM(model="random:tiny", compile=CompileConfig(mode="kiln"))  # the entry exists (built before ready)
    create_proxy = torch.fx.Tracer.create_proxy

    def slow_create_proxy(self, *args, **kwargs):
        time.sleep(0.002)
        return create_proxy(self, *args, **kwargs)

    monkeypatch.setattr(torch.fx.Tracer, "create_proxy", slow_create_proxy)
    llm = LLM(model="random:tiny", compile=BACKGROUND)
    compiled = llm.engine.executor.runner.compiled
    rounds = 0
    while compiled.building:
        _assert_like_eager(_generate(llm), eager_outputs)
        rounds += 1
    assert rounds >= 1 and llm.engine.executor.runner.compiled.forward.cache_hit
    _assert_like_eager(_generate(llm), eager_outputs)


def test_builds_in_one_process_run_one_at_a_time(eager_outputs):
    """Dynamo captures must not overlap: a background build waits while another build holds the
    process's build lock, and steps run eagerly meanwhile."""
    from kiln.compiler import background_build

    with background_build.ONE_BUILD:  # as a build running elsewhere in this process would
        llm = LLM(model="random:tiny", compile=BACKGROUND)
        assert not llm.engine.wait_for_build(timeout=1.0)
        _assert_like_eager(_generate(llm), eager_outputs)
        assert llm.engine.executor.runner.compiled.forward is llm.engine.executor.runner.compiled.model
    assert llm.engine.wait_for_build(timeout=600)
    _assert_like_eager(_generate(llm), eager_outputs)
    assert isinstance(llm.engine.executor.runner.compiled.forward, KilnForward)


def test_the_server_reports_a_running_build_until_it_ends():
    """``kiln_compile_building`` on /metrics (what ``kiln bench``'s serve runs wait on) reads the
    build as it is: 1 while it runs, 0 once it has ended, with no request in between (the engine
    thread is idle then, and its other stats are as of its last turn)."""
    from kiln.compiler import background_build
    from kiln.config import EngineConfig, ModelConfig
    from kiln.entrypoints.openai.metrics import ServerMetrics
    from kiln.engine.async_engine import AsyncEngine

    def gauge(engine) -> float:
        text = ServerMetrics(engine.stats, engine.is_healthy).render().decode()
        return float(next(line.split()[1] for line in text.splitlines() if line.startswith("kiln_compile_building ")))

    with background_build.ONE_BUILD:  # the build waits while the test holds the lock
        engine = AsyncEngine.from_config(EngineConfig(model=ModelConfig("random:tiny"), compile=BACKGROUND))
        engine.wait_ready(timeout=300)
        assert gauge(engine) == 1.0
    try:
        deadline = time.monotonic() + 600
        while gauge(engine) == 1.0:
            assert time.monotonic() < deadline, "the build did not end"
            time.sleep(0.1)
        assert engine.stats()["compile_building"] == 0
    finally:
        engine.shutdown()


def test_a_failed_build_keeps_the_model_eager(eager_outputs, monkeypatch, caplog):
    def fail(self, device):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(KilnForward, "build", fail)
    llm = LLM(model="random:tiny", compile=BACKGROUND)
    compiled = llm.engine.executor.runner.compiled
    assert llm.engine.wait_for_build(timeout=60)
    with caplog.at_level(logging.WARNING, logger="kiln.compiler.compiled_model"):
        _assert_like_eager(_generate(llm), eager_outputs)
    assert "keeps running eagerly: RuntimeError: no compiler here" in caplog.text
    assert not compiled.building and compiled.forward is compiled.model
    _assert_like_eager(_generate(llm), eager_outputs)


def test_a_model_that_changes_while_captured_is_built_before_serving(monkeypatch):
    """A model with ``capture_scope`` (the generic path runs attention as SDPA inside it) would
    change under the eager steps; it is built at start-up instead."""
    started = []
    monkeypatch.setattr(BackgroundBuild, "__init__", lambda self, *a: started.append(a))
    monkeypatch.setattr(LlamaForCausalLM, "capture_scope", lambda self: _NullScope(), raising=False)
    llm = LLM(model="random:tiny", compile=BACKGROUND)
    compiled = llm.engine.executor.runner.compiled
    assert not started and not compiled.building and isinstance(compiled.forward, KilnForward)


class _NullScope:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.cpu_default
def test_the_cpu_default_serves_at_once_and_builds_kiln(eager_outputs, caplog):
    """The CPU default: a start whose forward the compile cache lacks serves at once and builds on a
    thread; the next start finds it and loads it before ready, so its first step runs kiln's forward."""
    with caplog.at_level(logging.INFO):
        llm = LLM(model="random:tiny")
    assert llm.engine.config.compile.build == "background_when_cold"
    assert "compile.mode=kiln (loaded before ready when cached, else built in the background)" in caplog.text
    assert llm.engine.startup.building == llm.engine.executor.runner.compiled.building
    assert llm.engine.wait_for_build(timeout=600)
    _assert_like_eager(_generate(llm), eager_outputs)
    assert isinstance(llm.engine.executor.runner.compiled.forward, KilnForward)
    llm.engine.shutdown()
    warm = LLM(model="random:tiny")  # the same cache dir: built here before
    runner = warm.engine.executor.runner
    assert runner.compile_config.build == "startup" and not runner.compiled.building
    assert isinstance(runner.compiled.forward, KilnForward) and runner.compiled.forward.cache_hit
    _assert_like_eager(_generate(warm), eager_outputs)


_EAGER_START = """
import sys
from kiln import LLM, SamplingParams
from kiln.compiler import background_build
HEAVY = ("torch._dynamo", "torch._inductor", "kiln.passes.manager", "sympy")
eager = LLM(model="random:tiny", compile={"mode": "eager"})
eager.generate([[5, 17, 3]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
print("EAGER", [m for m in HEAVY if m in sys.modules])
with background_build.ONE_BUILD:  # the background build waits before importing anything of its own
    llm = LLM(model="random:tiny", compile={"mode": "kiln", "startup": "fast"})
    llm.generate([[5, 17, 3]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    print("BACKGROUND", [m for m in HEAVY if m in sys.modules])
"""


def test_a_start_that_serves_eagerly_leaves_dynamo_and_inductor_to_the_build():
    """Importing Dynamo, Inductor and kiln's passes takes seconds (7-11 s on a GPU machine); a
    background build imports them on its thread, so a start that serves eagerly meanwhile, or an
    eager model, never waits for them: not in kiln's imports, nor in building the model on the
    meta device (torch's Python references of meta ops import Dynamo, and sympy), nor in its first
    steps."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _EAGER_START], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.startswith(("BACKGROUND", "EAGER")))
    assert lines == {"BACKGROUND": "[]", "EAGER": "[]"}, proc.stdout


@pytest.mark.gpu
def test_cuda_starts_serve_eagerly_then_capture_over_kiln_and_keep_the_graphs_memory(tmp_path, caplog):
    """compile.startup=fast on CUDA. A first start starts the build as the weights load, sizes
    the KV cache after the eager forward and a guess of the graphs' memory, and serves eagerly while
    kiln's forward compiles; once built, the sizes up to startup_capture_max (8) are captured
    between steps, smallest first, then the rest, and what the graphs took is kept. A warm start
    reads that profile, starts the build once ready, serves eagerly while the forward loads from
    the compile cache, then captures over it."""
    import gc

    from kiln.compiler import background_build

    sizes = [1, 2, 4, 8, 16]
    options = dict(model="random:tiny", device="cuda", dtype="float32", max_model_len=256,
                   cache={"dir": str(tmp_path)},
                   compile={"mode": "kiln", "startup": "fast", "capture_sizes": sizes})
    for start in ("first", "warm"):
        caplog.clear()
        with caplog.at_level(logging.INFO), background_build.ONE_BUILD:  # the build waits: steps surely run eagerly
            llm = LLM(**options)
            runner, compiled = llm.engine.executor.runner, llm.engine.executor.runner.compiled
            assert compiled.building and compiled.forward is compiled.model
            assert runner.has_pending_captures and compiled.num_pending_captures == 0
            eager = _generate(llm)
            assert llm.engine.capture_idle()  # nothing to capture yet: it waits a moment and says so
            assert compiled.full_graphs is None and compiled.piecewise_graphs is None
        profiles = list((tmp_path / "memory").glob("*.json"))
        messages = [r.getMessage() for r in caplog.records]
        started = next(i for i, m in enumerate(messages) if "building kiln's forward on a thread" in m)
        sized = next(i for i, m in enumerate(messages) if m.startswith("KV cache:"))
        assert (started < sized) == (start == "first")  # a first start builds beside the weight read
        if start == "first":
            assert "a guess" in caplog.text and not profiles
            want = eager
        else:
            assert "memory profile from the cache" in caplog.text and "a guess" not in caplog.text
            _assert_like_eager(eager, want)
        assert llm.engine.wait_for_build(timeout=300)
        assert llm.engine.capture_idle() and compiled.full_graphs.captured_sizes == []  # plans every size
        for _ in range(4):  # then the sizes a capture before ready would take (up to 8), smallest first
            assert llm.engine.capture_idle()
        assert compiled.full_graphs.captured_sizes == [1, 2, 4, 8] and not compiled.piecewise_graphs.captured_sizes
        while llm.engine.capture_idle():
            pass
        assert isinstance(compiled.forward, KilnForward) and compiled.forward.cache_hit == (start == "warm")
        assert compiled.full_graphs.captured_sizes == sizes
        assert compiled.piecewise_graphs.captured_sizes and not compiled.has_pending_captures
        assert len(list((tmp_path / "memory").glob("*.json"))) == 1  # kept by the first start
        _assert_like_eager(_generate(llm), want)
        del llm, runner, compiled
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.gpu
def test_the_cuda_server_answers_while_kiln_builds_then_captures_when_idle(tmp_path):
    """kiln serve's defaults on CUDA (compile.startup=auto): a cold engine answers eagerly while kiln's
    forward builds; once built, the idle engine captures every size over it and keeps the graphs'
    memory for the next start; it answers with the same tokens. The next start (warm) loads the
    forward from the compile cache before ready: no eager step, the same tokens."""
    import asyncio

    from kiln.compiler import background_build
    from kiln.config import CacheConfig, EngineConfig, ModelConfig
    from kiln.engine.async_engine import AsyncEngine

    config = EngineConfig(model=ModelConfig("random:tiny", device="cuda", dtype="float32", max_model_len=256),
                          cache=CacheConfig(dir=str(tmp_path)), compile=CompileConfig(capture_sizes=(1, 2, 4, 8)))
    assert config.resolved("cuda").compile.build == "background_when_cold"

    async def tokens(engine, request_id: str) -> list[int]:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        outs = [out async for out in engine.generate(request_id, PROMPTS[0], params)]
        return list(outs[-1].outputs[0].token_ids)

    with background_build.ONE_BUILD:  # the build waits: the first request surely runs eagerly
        engine = AsyncEngine.from_config(config)
        engine.wait_ready(timeout=300)
        assert engine.stats()["compile_building"] == 1
        eager = asyncio.run(tokens(engine, "eager"))
    try:
        deadline = time.monotonic() + 600
        while engine.stats()["compile_building"] or not list((tmp_path / "memory").glob("*.json")):
            assert time.monotonic() < deadline, "the build, or the idle engine's captures, did not end"
            time.sleep(0.1)
        assert len(eager) == 6 and asyncio.run(tokens(engine, "kiln")) == eager
    finally:
        engine.shutdown()
    warm = AsyncEngine.from_config(config)
    try:
        warm.wait_ready(timeout=300)
        assert warm.stats()["compile_building"] == 0  # built (loaded) before ready
        assert asyncio.run(tokens(warm, "warm")) == eager
    finally:
        warm.shutdown()


def test_the_eager_warm_up_writes_only_the_null_block():
    """``CompiledModel.warm_up`` (before a background build on CUDA) runs a decode and a prefill of
    null requests: their keys and values go to block 0, which the pool never hands out; every
    other block keeps its contents."""
    llm = LLM(model="random:tiny", compile=CompileConfig(mode="eager"), cache={"num_blocks": 16})
    compiled = llm.engine.executor.runner.compiled
    for cache in compiled.kv_caches:
        cache.normal_()
    before = [cache.clone() for cache in compiled.kv_caches]
    compiled.warm_up()
    for got, was in zip(compiled.kv_caches, before, strict=True):
        assert torch.equal(got[:, 1:], was[:, 1:]) and not torch.equal(got[:, :1], was[:, :1])  # [K/V, block, ...]


def test_a_warm_up_over_caches_of_its_own_leaves_the_bound_ones_alone():
    """The runner's warm-up while the weights still land writes a scratch cache: the bound caches
    keep every block, the null block too, and the scratch cache's null block is written."""
    from kiln.runtime import kv_sizing

    llm = LLM(model="random:tiny", compile=CompileConfig(mode="eager"), cache={"num_blocks": 16})
    runner = llm.engine.executor.runner
    compiled = runner.compiled
    for cache in compiled.kv_caches:
        cache.normal_()
    before = [cache.clone() for cache in compiled.kv_caches]
    scratch = kv_sizing.allocate_kv_caches(runner.kv_shape, 4, runner.device)
    compiled.warm_up(scratch, kv_sizing.allocate_kv_scales(runner.kv_shape, {}, runner.device))
    assert all(torch.equal(got, was) for got, was in zip(compiled.kv_caches, before, strict=True))
    assert all(cache[:, :1].abs().sum() > 0 and not cache[:, 1:].any() for cache in scratch)


@pytest.mark.parametrize("num_pending", [0, 3])
def test_a_first_start_keeps_what_its_graphs_took_for_the_next_start(tmp_path, num_pending):
    """After a first background start (graphs' memory guessed), the runner keeps a profile of what
    the captured graphs took: the eager activations it was sized with, and per size the measured
    bytes of the sizes captured, for every size (an over-estimate of the ones left when capture
    stopped at the guess). The next start's estimate covers what the graphs took."""
    from types import SimpleNamespace

    from kiln.compiler import ArtifactCache, GraphMemoryEstimate
    from kiln.runtime import kv_sizing
    from kiln.runtime.startup import MemoryProfiler

    sizes = (1, 2, 4, 8, 16, 32, 64, 128)
    used = 3 * 2**30
    cache = kv_sizing.MemoryProfileCache(ArtifactCache(str(tmp_path), "m"), "key", max_num_seqs=128)
    profiler = MemoryProfiler(cache, None, torch.device("cpu"), 256, None, want_graphs=True)
    profiler.unmeasured_bytes = 600 * 2**20  # what a first background start's profile leaves
    guess = GraphMemoryEstimate(sizes, largest_bytes=2**30, per_size_bytes=2**20)
    compiled = SimpleNamespace(graph_memory_bytes=used, num_pending_captures=num_pending)
    profiler.keep_measured(guess, compiled)
    kept = cache.load()
    assert kept is not None and kept.activation_bytes == 600 * 2**20 and kept.graphs.sizes == sizes
    captured = len(sizes) - num_pending
    assert kept.graphs.bytes() >= used * len(sizes) / captured
    profiler.keep_measured(guess, compiled)  # once only: a later call keeps nothing new
    assert profiler.unmeasured_bytes is None


def test_eager_calls_wait_for_an_fx_trace_on_the_build_thread():
    """While a background build runs, an FX trace on its thread (the passes' patterns, reading a
    saved graph) patches ``nn.Module.__call__`` for the whole process: the eager warm-up and the
    logits wait for the trace to end rather than being traced into it."""
    import threading

    from kiln.compiler import background_build

    with background_build.ONE_BUILD:  # the build waits: the model is still served eagerly
        llm = LLM(model="random:tiny", compile=BACKGROUND)
        compiled = llm.engine.executor.runner.compiled
        assert compiled.building
        tracing, release, order = threading.Event(), threading.Event(), []

        class WaitsInTrace(torch.nn.Module):
            def forward(self, x):
                tracing.set()
                release.wait(timeout=60)
                return x + 1

        def let_the_trace_end() -> None:
            order.append("trace released")
            release.set()

        with background_build.traces_exclude_eager_forwards():
            tracer = threading.Thread(target=torch.fx.symbolic_trace, args=(WaitsInTrace(),))
            tracer.start()
            assert tracing.wait(timeout=60)
            threading.Timer(0.2, let_the_trace_end).start()
            compiled.warm_up()  # would be traced into the trace (and fail) without waiting
            order.append("warm-up done")
            logits = compiled.compute_logits(torch.zeros(2, llm.engine.executor.runner.arch.hidden_size))
            tracer.join(timeout=60)
    assert order == ["trace released", "warm-up done"] and logits.shape[0] == 2
    assert llm.engine.wait_for_build(timeout=300)


def test_the_step_gate_parks_the_builds_python_while_a_step_runs():
    """The StepGate of a CUDA build: a thread under its hook makes (almost) no Python calls while a
    step runs, but for its passes after each longest park, and runs freely between steps."""
    import threading

    from kiln.compiler.background_build import StepGate

    gate, calls, stop = StepGate(), [0], threading.Event()

    def one_call() -> None:
        calls[0] += 1

    def build() -> None:
        import sys

        sys.setprofile(gate.hook)
        while not stop.is_set():
            one_call()
        sys.setprofile(None)

    thread = threading.Thread(target=build)
    thread.start()
    time.sleep(0.05)
    before = calls[0]
    time.sleep(0.2)
    free = calls[0] - before
    with gate.step():
        time.sleep(0.05)  # the build reaches its next call and parks
        before = calls[0]
        time.sleep(0.2)
        parked = calls[0] - before
    time.sleep(0.05)
    after = calls[0]
    time.sleep(0.2)
    freed = calls[0] - after
    stop.set()
    thread.join(timeout=10)
    assert free > 1000 and freed > 1000 and parked < free / 3, (free, parked, freed)


def test_check_cancelled_raises_only_on_the_cancelled_builds_thread():
    import threading

    from kiln.compiler.cancel import BuildCancelled, cancellable, check_cancelled

    cancel = threading.Event()
    check_cancelled()  # no build on this thread: nothing
    with cancellable(cancel):
        check_cancelled()  # not cancelled yet
        cancel.set()
        other = []
        thread = threading.Thread(target=lambda: other.append(check_cancelled()))
        thread.start()
        thread.join()
        assert other == [None]  # another thread is not the build's
        with pytest.raises(BuildCancelled):
            check_cancelled()
    check_cancelled()  # the build's scope has ended


def test_a_cancelled_build_stops_at_its_next_safe_point_and_lets_the_next_build_run():
    """A start-up that fails after its build began (``ModelRunner`` calls ``cancel_build``): the
    build's thread raises ``BuildCancelled`` at its next safe point and lets go of the one-build lock."""
    import threading

    from kiln.compiler import background_build
    from kiln.compiler.cancel import BuildCancelled

    making, proceed, built = threading.Event(), threading.Event(), []

    def make_forward():
        making.set()
        proceed.wait(30)
        return torch.nn.Identity()

    def build_now(forward, device):
        built.append(forward)

    original_build_now = background_build.build_now
    background_build.build_now = build_now
    try:
        build = BackgroundBuild(make_forward, torch.device("cpu"))
        build.start()
        assert making.wait(30)
        assert not build.cancel(timeout=0.2)  # it is inside make_forward, which is not a safe point
        proceed.set()
        assert build.wait(30)
    finally:
        background_build.build_now = original_build_now
    assert isinstance(build.error, BuildCancelled) and build.forward is None and built == []
    assert background_build.ONE_BUILD.acquire(timeout=5)
    background_build.ONE_BUILD.release()


def test_a_start_that_fails_after_its_build_began_stops_the_build(monkeypatch):
    """As a first CUDA start does, the build starts before the KV cache is sized; that fails. The
    runner cancels the build, which stops at its next safe point before the error reaches the
    caller, letting go of the one-build lock."""
    from kiln.compiler import background_build
    from kiln.compiler.cancel import BuildCancelled
    from kiln.runtime import model_runner

    started = []

    def start_then_fail(self, *args, **kwargs):
        self.compiled.start_build()
        started.append(self.compiled._building)
        raise ValueError("the KV cache budget holds fewer than 2 blocks")

    monkeypatch.setattr(model_runner.ModelRunner, "_make_kv_caches", start_then_fail)
    with pytest.raises(ValueError, match="fewer than 2 blocks"):
        LLM(model="random:tiny", compile=BACKGROUND)
    (build,) = started
    assert build.done and isinstance(build.error, BuildCancelled) and build.forward is None
    assert background_build.ONE_BUILD.acquire(timeout=1)
    background_build.ONE_BUILD.release()


@pytest.mark.gpu
def test_a_first_cuda_start_that_fails_stops_its_build(tmp_path):
    """A first CUDA start begins its build with the weight read; when the start then fails (here
    a KV cache budget of no blocks), the build stops and the next start in the process builds."""
    from kiln.compiler import background_build

    options = dict(model="random:tiny", device="cuda", dtype="float32", max_model_len=256,
                   compile={"mode": "kiln", "startup": "fast", "capture_sizes": [1, 2, 4]})
    with pytest.raises(ValueError, match="fewer than 2 blocks|short of one request"):  # the KV or graph check
        LLM(**options, cache={"dir": str(tmp_path), "kv_cache_memory_gib": 1e-6})
    assert background_build.ONE_BUILD.acquire(timeout=5), "the failed start's build still holds the lock"
    background_build.ONE_BUILD.release()
    llm = LLM(**options, cache={"dir": str(tmp_path)})
    assert llm.engine.wait_for_build(timeout=300)
    _generate(llm)
    assert isinstance(llm.engine.executor.runner.compiled.forward, KilnForward)


def test_the_build_gate_is_a_cuda_build_s_and_compile_build_gate_turns_it_off():
    """``compile.build_gate`` (default on) reaches the build: on CUDA a StepGate parks the build's
    Python during steps; false, or the CPU, gives none."""
    from kiln.compiler.background_build import StepGate

    assert CompileConfig().build_gate is True
    assert isinstance(BackgroundBuild(KilnForward, torch.device("cuda")).gate, StepGate)
    assert BackgroundBuild(KilnForward, torch.device("cuda"), gate=CompileConfig(build_gate=False).build_gate).gate is None
    assert BackgroundBuild(KilnForward, torch.device("cpu")).gate is None
