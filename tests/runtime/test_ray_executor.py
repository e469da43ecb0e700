"""The Ray executor on the CPU (gloo, a local Ray cluster): TP=2 against the single-process engine,
a rank's start-up error, a killed and a hung rank, and no actor left behind."""

import logging
import os
import signal
import sys
import time

import pytest

from kiln import LLM, SamplingParams
from tests.helpers.parallel import assert_same_completions
from tests.helpers.ray_executor import GREEDY, PROMPTS, needs_ray, ray

RAY2 = {"tensor_parallel_size": 2, "backend": "ray"}


def _generate(llm):
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _pids(llm):
    return [pid for _, pid in llm.engine.executor.whereabouts]


def _gone(pids, within_s=10.0):
    """Whether every process exited (zombies count as exited) within the time given."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if os.path.exists(f"/proc/{p}") and _state(p) != "Z"]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_without_ray_the_backend_says_how_to_install_it(monkeypatch, kiln_cache_dir):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, installed or not
    with pytest.raises(ValueError, match=r"needs the package 'ray', which is not installed \(pip install 'kiln\[ray"):
        LLM("random:tiny", cache={"dir": kiln_cache_dir}, parallel=RAY2)


@needs_ray
def test_a_cluster_kiln_starts_stops_with_the_engine(monkeypatch, kiln_cache_dir):
    """The default for a user: no cluster yet, so kiln starts a local one (RAY_ADDRESS=local: never
    one found running on this host) and stops it again, with every actor, at shutdown."""
    if ray.is_initialized():
        pytest.skip("runs before the module's cluster starts")
    monkeypatch.setenv("RAY_ADDRESS", "local")
    llm = LLM("random:tiny", compile={"mode": "eager"}, cache={"dir": kiln_cache_dir}, parallel=RAY2)
    assert ray.is_initialized()
    assert len(llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2
    pids = _pids(llm)
    llm.engine.shutdown()
    assert not ray.is_initialized()
    assert _gone(pids)


# One local cluster for the module (starting one takes seconds). Its CPUs are logical, one per rank:
# enough for the two engines kept by tp2_engines and one more started beside them (the two cores
# are shared anyway). The executors join it and must leave it running: kiln never shuts down a
# cluster it did not start.
@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(address="local", num_cpus=6, include_dashboard=False, logging_level=logging.WARNING)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tp2_engines(ray_cluster, kiln_cache_dir):
    engines = {}

    def get(preset):
        if preset not in engines:
            engines[preset] = LLM(f"random:{preset}", compile={"mode": "eager"}, cache={"dir": kiln_cache_dir},
                                  parallel=RAY2)
        return engines[preset]

    yield get
    for llm in engines.values():
        pids = _pids(llm)
        llm.engine.shutdown()
        llm.engine.shutdown()  # idempotent
        assert _gone(pids)  # shutdown leaves no actor process behind
    assert ray.is_initialized()
    assert _placement_groups_left() == []


def _placement_groups_left():
    return sorted(pg["placement_group_id"] for pg in ray.util.placement_group_table().values()
                  if pg["state"] != "REMOVED")


@needs_ray
# Qwen2 (qkv bias) at TP=2 is covered by tests/runtime/test_tensor_parallel.py over mp, and Ray's own path
# by the tiny case and tests/runtime/test_ray_multinode.py: the Qwen2-over-Ray case runs with `slow`.
@pytest.mark.parametrize("preset", ["tiny", pytest.param("tiny-qwen2", marks=pytest.mark.slow)])
def test_tp2_matches_tp1(preset, tp2_engines, kiln_cache_dir):
    single = _generate(LLM(f"random:{preset}", compile={"mode": "eager"}, cache={"dir": kiln_cache_dir}))
    sharded = _generate(tp2_engines(preset))
    assert_same_completions(sharded, single)


@needs_ray
def test_one_actor_per_rank_in_one_placement_group(tp2_engines):
    executor = tp2_engines("tiny").engine.executor
    assert len(executor.actors) == 2 and len(set(_pids(tp2_engines("tiny")))) == 2
    table = ray.util.placement_group_table(executor._placement)
    assert table["strategy"] == "PACK" and table["bundles"] == {0: {"CPU": 1.0}, 1: {"CPU": 1.0}}


@needs_ray
def test_a_rank_start_up_error_keeps_its_type(ray_cluster, kiln_cache_dir):
    """Raised by every rank while loading (after the group met): the user gets the ValueError itself."""
    before = _placement_groups_left()
    with pytest.raises(ValueError, match="max_model_len=100000 exceeds"):
        LLM("random:tiny", max_model_len=100000, compile={"mode": "eager"},
            cache={"dir": kiln_cache_dir}, parallel=RAY2)
    assert _placement_groups_left() == before  # its actors and placement group are gone


@needs_ray
def test_a_killed_rank_fails_the_engine_fast(tp2_engines):
    llm = tp2_engines("tiny-qwen2")
    pids = _pids(llm)
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+ on .*\) died"):
        llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)
    assert time.monotonic() - t0 < 15
    assert _gone(pids)  # the surviving rank is stopped too
    with pytest.raises(RuntimeError, match="has failed"):
        llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)


@needs_ray
def test_a_hung_rank_fails_the_engine_after_the_step_timeout(tp2_engines):
    llm = tp2_engines("tiny")
    executor = llm.engine.executor
    pids = _pids(llm)
    executor.step_timeout_s = 2.0
    os.kill(pids[1], signal.SIGSTOP)  # alive but silent, as in a deadlock
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[(0, )?1\] gave no answer within 2 s"):
        llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)
    assert time.monotonic() - t0 < 15
    assert _gone(pids)
