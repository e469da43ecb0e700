"""The compiled-artifact cache across processes: hit, miss with its reason, corruption, races,
read-only copies, and the ``kiln cache`` actions on its entries.

Each start is a subprocess running ``_WORKER`` (random:tiny, compile.mode=kiln on the CPU): it
prints one JSON line with the greedy token ids, how far the compiled forward is from eager on a
mixed prefill + decode batch, whether the cache hit, and what ran: Dynamo frames, captures,
Inductor builds, C++ builds. One cold start fills a cache dir for the module; every other start
works on a copy of it, so the tests do not depend on each other's order.

Inductor's own cache (``TORCHINDUCTOR_CACHE_DIR``) is shared by the cold starts of the session, so
only the first compiles from scratch. A warm start gets an empty one, as on a fresh machine: it
must then rebuild nothing.

Read-only: CI runs as root, for whom ``chmod -R a-w`` stops no write. The read-only starts set
``KILN_CACHE_READ_ONLY=1`` and, to hold the code to it, the worker installs an audit hook that
records every open-for-writing, rename, mkdir, remove or copy under the cache dir: there must be
none.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from kiln.compiler.artifact_cache import (
    FACTORS, MANIFEST, ArtifactCache, cache_key, differing_factors, key_factors, verify_entry,
)
from kiln.config import CompileConfig
from kiln.entrypoints import cache_cmd
from kiln.models.arch import PRESETS
from kiln.models.llama import LlamaForCausalLM
from kiln.passes.manager import PassConfig, PassManager, build_passes
from kiln.passes.noop_elimination import NoOpEliminationPass
from tests.helpers.paths import REPO

_WORKER = r'''
import json, os, sys, time
opts = json.loads(sys.argv[1])
writes = []
if opts.get("watch_dir"):
    watch = os.path.abspath(opts["watch_dir"])
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    # event -> positions of the arguments that are written (a copy only writes its destination)
    written_args = {"os.rename": (0, 1), "shutil.move": (0, 1), "shutil.copyfile": (1,), "shutil.copytree": (1,),
                    "os.symlink": (1,), "os.link": (1,), "os.mkdir": (0,), "os.remove": (0,), "os.rmdir": (0,),
                    "os.chmod": (0,), "os.truncate": (0,), "os.utime": (0,), "shutil.rmtree": (0,)}

    def under(p):
        if isinstance(p, int) or p is None:
            return False
        p = os.path.abspath(os.fsdecode(p))
        return p == watch or p.startswith(watch + os.sep)

    def hook(event, args):
        if event == "open" and len(args) >= 3 and under(args[0]):
            mode, flags = args[1], args[2]
            if (isinstance(flags, int) and flags > 0 and flags & write_flags) or \
                    (isinstance(mode, str) and any(c in mode for c in "wax+")):
                writes.append(f"open {args[0]} {mode} {flags}")
        elif event in written_args and any(under(args[i]) for i in written_args[event]
                                           if isinstance(args[i], (str, bytes, os.PathLike))):
            writes.append(f"{event} {args[:2]}")

    sys.addaudithook(hook)

import logging
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
import torch
from torch._dynamo.utils import counters
from torch._inductor.cpp_builder import CppBuilder

cpp_builds = []  # compiles and links; Inductor's header preprocessing (.i, to name its header) is not one
_build = CppBuilder.build
def counting_build(self, *a, **k):
    if not self.get_target_file_path().endswith(".i"):
        cpp_builds.append(os.path.basename(self.get_target_file_path()))
    return _build(self, *a, **k)
CppBuilder.build = counting_build

from kiln import LLM, SamplingParams
from tests.helpers.paged import PagedBatcher, make_kv_caches, run_step

t0 = time.perf_counter()
llm = LLM(model="random:tiny", compile={"mode": "kiln"}, cache={"dir": opts["cache_dir"], "num_blocks": 64})
ready_s = time.perf_counter() - t0
runner = llm.engine.executor.runner
forward = runner.compiled.forward
prompts = [[1, 2, 3, 4, 5, 6, 7], [900, 800, 700, 600, 500, 400, 300, 200, 100, 11, 12, 13]]
outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)

# Compiled against eager on one prefill batch, a one-token decode (a static build) and a 2-token decode.
schedule = [{"a": list(range(1, 24)), "b": [5, 6, 7, 8, 9]}, {"a": [3]}, {"a": [4], "b": [10]}]
max_diff = 0.0
kv_c, kv_e = make_kv_caches(runner.arch, 32, 16), make_kv_caches(runner.arch, 32, 16)
batcher = PagedBatcher(32, 16)
for new_tokens in schedule:
    step = batcher.step(new_tokens)
    compiled, eager = run_step(forward, kv_c, step), run_step(runner.model, kv_e, step)
    max_diff = max(max_diff, (compiled - eager).abs().max().item())
print("RESULT " + json.dumps({
    "token_ids": [o.outputs[0].token_ids for o in outs],
    "max_diff_vs_eager": max_diff,
    "cache_hit": forward.cache_hit,
    "dynamo_frames": counters["frames"]["total"],
    "num_captures": forward.num_captures,
    "inductor_builds": forward.num_compiles,
    "cpp_builds": cpp_builds,
    "startup_seconds": runner.startup_seconds,
    "ready_s": ready_s,
    "cache_writes": writes,
}), flush=True)
'''


class Worker:
    """One worker process, started now; ``result()`` waits for it and parses its JSON line."""

    def __init__(self, cache_dir: Path, inductor_dir: Path, env: dict | None = None, watch: bool = False) -> None:
        opts = {"cache_dir": str(cache_dir), "watch_dir": str(cache_dir) if watch else None}
        full_env = {**os.environ, "PYTHONPATH": str(REPO), "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir),
                    "KILN_CACHE_DIR": str(cache_dir), **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER, json.dumps(opts)], cwd=REPO, env=full_env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def result(self) -> tuple[dict, str]:
        out, err = self.proc.communicate(timeout=600)
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert self.proc.returncode == 0 and lines, f"worker failed ({self.proc.returncode}):\n{err[-4000:]}"
        return json.loads(lines[-1][len("RESULT "):]), err


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, symlinks=True)
    return dest


def _only_entry(cache_dir: Path) -> Path:
    entries = [p for p in (cache_dir / "compile").iterdir()]
    assert len(entries) == 1, entries
    return entries[0]


def _same_outputs(result: dict, reference: dict) -> None:
    assert result["token_ids"] == reference["token_ids"]
    assert result["max_diff_vs_eager"] < 1e-4


@pytest.fixture(scope="module")
def env_base(kiln_cache_dir):
    """Environment for the workers: the borrowed tokenizer converted once, outside the test caches."""
    from kiln.models.loader import tokenizer_dir

    return {"KILN_TOKENIZER_DIR": tokenizer_dir(kiln_cache_dir)}


@pytest.fixture(scope="module")
def shared_inductor(kiln_cache_dir) -> Path:
    return Path(kiln_cache_dir) / "inductor"


@pytest.fixture(scope="module")
def cold(tmp_path_factory, shared_inductor, env_base):
    """One cold start into an empty cache dir: (cache dir, result)."""
    cache_dir = tmp_path_factory.mktemp("cold") / "cache"
    result, log = Worker(cache_dir, shared_inductor, env_base).result()
    assert not result["cache_hit"] and result["num_captures"] == 1 and result["inductor_builds"] > 0
    assert "compile cache miss" in log and "no entries in" in log and "stored compile cache entry" in log
    assert result["max_diff_vs_eager"] < 1e-4
    entry = _only_entry(cache_dir)
    assert verify_entry(entry) is None
    assert str(cache_dir) not in "".join(p.read_text(errors="ignore") for p in entry.glob("*.json"))
    return cache_dir, result


# ---- across processes ---------------------------------------------------------------------------
def test_warm_start_from_read_only_copy_skips_dynamo_and_inductor(cold, tmp_path, env_base):
    """A copy of the cache dir (another path, as on another machine), read-only, with empty Inductor
    and temp dirs: the start hits, runs no Dynamo frame, no Inductor build, no C++ build, writes
    nothing under the cache dir, and gives the cold start's outputs."""
    cache_dir, reference = cold
    copy = _copy(cache_dir, tmp_path / "image-layer")
    for p in [copy, *copy.rglob("*")]:
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        (tmp_path / "tmp").mkdir()  # Inductor keeps precompiled headers under the temp dir, not its cache dir
        env = {**env_base, "KILN_CACHE_READ_ONLY": "1", "TMPDIR": str(tmp_path / "tmp")}
        result, log = Worker(copy, tmp_path / "fresh-inductor", env, watch=True).result()
    finally:
        for p in [copy, *copy.rglob("*")]:
            p.chmod(p.stat().st_mode | stat.S_IWUSR)
    assert result["cache_hit"] and "compile cache hit" in log and "Dynamo and Inductor skipped" in log
    assert result["dynamo_frames"] == 0 and result["num_captures"] == 0 and result["inductor_builds"] == 0
    assert result["cpp_builds"] == []
    assert result["cache_writes"] == []
    _same_outputs(result, reference)
    startup = result["startup_seconds"]
    assert startup["dynamo_s"] == 0 and startup["inductor_s"] == 0 and startup["cache_load_s"] > 0
    assert "start-up: load weights" in log


# ~10 s; a start that misses and names the factor is tested by the next test, a pass edit changing
# the key by test_a_pass_source_change_changes_the_key.
@pytest.mark.slow
def test_edited_pass_misses_and_names_it(cold, tmp_path, shared_inductor, env_base):
    cache_dir, reference = cold
    copy = _copy(cache_dir, tmp_path / "cache")
    factors = json.dumps({"passes.NoOpEliminationPass": "edited"})
    result, log = Worker(copy, shared_inductor, {**env_base, "KILN_TEST_KEY_FACTORS": factors}).result()
    assert not result["cache_hit"] and result["num_captures"] == 1
    assert "differs in passes.NoOpEliminationPass" in log
    assert len(list((copy / "compile").iterdir())) == 2  # the new key stored beside the old one
    _same_outputs(result, reference)


def test_other_torch_on_read_only_dir_misses_and_compiles_in_memory(cold, tmp_path, shared_inductor, env_base):
    cache_dir, reference = cold
    copy = _copy(cache_dir, tmp_path / "cache")
    env = {**env_base, "KILN_TEST_KEY_FACTORS": json.dumps({"torch": "0.0.0-other"}), "KILN_CACHE_READ_ONLY": "1"}
    result, log = Worker(copy, shared_inductor, env, watch=True).result()
    assert not result["cache_hit"] and "differs in torch" in log
    assert "read-only" in log and "nothing stored" in log
    assert result["cache_writes"] == []
    assert len(list((copy / "compile").iterdir())) == 1
    _same_outputs(result, reference)


def test_truncated_artifact_is_detected_recompiled_and_replaced(cold, tmp_path, shared_inductor, env_base):
    cache_dir, reference = cold
    copy = _copy(cache_dir, tmp_path / "cache")
    entry = _only_entry(copy)
    artifact = sorted(entry.glob("pieces/*/dynamic.bin"))[0]
    artifact.write_bytes(artifact.read_bytes()[:100])
    assert "has 100 bytes" in verify_entry(entry)
    result, log = Worker(copy, shared_inductor, env_base).result()
    assert not result["cache_hit"] and result["num_captures"] == 1
    assert "is corrupt" in log and artifact.relative_to(entry).as_posix() in log
    assert verify_entry(_only_entry(copy)) is None  # replaced by a whole entry
    _same_outputs(result, reference)


def test_two_cold_starts_at_once_leave_one_valid_entry(cold, tmp_path, shared_inductor, env_base):
    _, reference = cold
    cache_dir = tmp_path / "cache"
    starts = [Worker(cache_dir, shared_inductor, env_base) for _ in range(2)]
    results = [s.result() for s in starts]
    for result, _ in results:
        _same_outputs(result, reference)
    entry = _only_entry(cache_dir)
    assert verify_entry(entry) is None
    assert not [p for p in (cache_dir / "compile").iterdir() if p.name.startswith(".")]
    logs = "".join(log for _, log in results)
    stored, lost_race = logs.count("kiln: stored compile cache entry"), logs.count("kiln: another process stored")
    assert stored == 1 and stored + lost_race + sum(r["cache_hit"] for r, _ in results) == 2


# ---- in this process: key, store, kiln cache ----------------------------------------------------
def _factors() -> dict:
    model = LlamaForCausalLM(PRESETS["tiny"])
    passes = PassManager(build_passes(PassConfig()))
    return key_factors(model, "random:tiny", CompileConfig(mode="kiln"), passes, 64)


def test_a_pass_source_change_changes_the_key(monkeypatch):
    before = _factors()
    monkeypatch.setattr(NoOpEliminationPass, "uuid", lambda self: "another source")
    after = _factors()
    assert cache_key(before) != cache_key(after)
    assert differing_factors(before, after) == ["passes.NoOpEliminationPass", "passes.PassManager"]


def test_a_cpu_extension_without_an_op_the_graphs_call_changes_the_key(monkeypatch):
    import kiln.compiler.artifact_cache as artifact_cache
    from kiln.ops.cpu_attention import extension_ops
    from kiln.ops.cpu_linear import gemv_available

    ops = extension_ops()
    if gemv_available():  # the real list names the GEMV op the CPU graphs call
        assert any(op.startswith("kiln_cpu::linear_f32(") for op in ops)
    before = _factors()
    monkeypatch.setattr(artifact_cache, "extension_ops",
                        lambda: [op for op in ops if not op.startswith("kiln_cpu::linear_f32(")] or ["none"])
    after = _factors()
    assert cache_key(before) != cache_key(after)
    assert differing_factors(before, after) == ["extension"]


def test_test_factors_env_reaches_nested_factors(monkeypatch):
    monkeypatch.setenv("KILN_TEST_KEY_FACTORS", json.dumps({"torch": "0.0", "device.name": "x"}))
    factors = _factors()
    assert factors["torch"] == "0.0" and factors["device"]["name"] == "x" and factors["device"]["type"] == "cpu"


def _write_fake(entry_dir: Path, payload: bytes = b"artifact") -> None:
    (entry_dir / "plan.json").write_text("{}")
    (entry_dir / "graph.pkl").write_bytes(b"graph")
    (entry_dir / "pieces").mkdir()
    (entry_dir / "pieces" / "dynamic.bin").write_bytes(payload)


def test_store_is_atomic_and_keeps_the_first_whole_entry(tmp_path):
    cache = ArtifactCache(str(tmp_path), "m")
    entry = cache.entry({"a": 1})
    entry.store(lambda d: _write_fake(d, b"first"))
    assert verify_entry(entry.dir) is None and json.loads((entry.dir / FACTORS).read_text()) == {"a": 1}
    entry.store(lambda d: _write_fake(d, b"second"))  # lost the race: the first entry stays
    assert (entry.dir / "pieces" / "dynamic.bin").read_bytes() == b"first"
    (entry.dir / "pieces" / "dynamic.bin").write_bytes(b"firsT")  # corrupt: the next store replaces it
    assert "checksum mismatch" in verify_entry(entry.dir)
    entry.store(lambda d: _write_fake(d, b"third"))
    assert verify_entry(entry.dir) is None and (entry.dir / "pieces" / "dynamic.bin").read_bytes() == b"third"

    def failing(d: Path) -> None:
        _write_fake(d)
        raise OSError("disk full")

    cache.entry({"a": 2}).store(failing)  # logged, nothing left behind
    assert sorted(p.name for p in cache.dir.iterdir()) == [entry.key]


def test_cache_inspect_export_clear(tmp_path, capsys):
    root = tmp_path / "cache"
    entry = ArtifactCache(str(root), "m").entry({"model": {"name": "random:tiny"}, "torch": "2.x"})
    entry.store(_write_fake)
    (root / "models" / "smol-abc").mkdir(parents=True)
    (root / "models" / "smol-abc" / "config.json").write_text("{}")
    (root / "compile" / ".tmp-dead-1").mkdir()  # a writer that died
    (root / "memory").mkdir()
    (root / "memory" / "0123abcd.json").write_text('{"activation_bytes": 1, "graphs": null}')  # a file entry
    (root / "kernels" / "triton" / "k1").mkdir(parents=True)
    (root / "kernels" / "triton" / "k1" / "kernel.cubin").write_bytes(b"cubin")

    assert cache_cmd.main(["ls", f"cache.dir={root}"]) == 0
    out = capsys.readouterr().out
    assert f"compile/{entry.key}" in out and "random:tiny" in out and ".tmp" not in out
    assert cache_cmd.main(["inspect", entry.key, f"cache.dir={root}"]) == 0
    out = capsys.readouterr().out
    assert "status: ok" in out and 'model.name = "random:tiny"' in out and MANIFEST in out

    assert cache_cmd.main(["export", str(tmp_path / "out"), f"cache.dir={root}"]) == 0
    assert verify_entry(tmp_path / "out" / "compile" / entry.key) is None
    assert (tmp_path / "out" / "models" / "smol-abc" / "config.json").exists()
    assert (tmp_path / "out" / "memory" / "0123abcd.json").read_text().startswith('{"activation_bytes"')
    assert (tmp_path / "out" / "kernels" / "triton" / "k1" / "kernel.cubin").read_bytes() == b"cubin"
    assert not (tmp_path / "out" / "compile" / ".tmp-dead-1").exists()
    assert cache_cmd.main(["export", str(tmp_path / "out.tar.gz"), f"cache.dir={root}"]) == 0
    with tarfile.open(tmp_path / "out.tar.gz") as tar:
        names = tar.getnames()
    assert f"compile/{entry.key}/{MANIFEST}" in names and "models/smol-abc/config.json" in names
    assert "memory/0123abcd.json" in names and "kernels/triton/k1/kernel.cubin" in names
    assert cache_cmd.main(["export", str(tmp_path / "out"), f"cache.dir={root}"]) == 1  # not empty
    capsys.readouterr()

    (entry.dir / "pieces" / "dynamic.bin").write_bytes(b"")
    assert cache_cmd.main(["inspect", entry.key, f"cache.dir={root}"]) == 0
    assert "corrupt" in capsys.readouterr().out
    assert cache_cmd.main(["inspect", f"cache.dir={root}"]) == 2
    assert cache_cmd.main(["clear", f"cache.dir={root}"]) == 0
    assert list((root / "compile").iterdir()) == []  # the leftover went too
    assert list((root / "memory").iterdir()) == [] and list((root / "kernels").iterdir()) == []


def test_kernel_caches_go_into_the_cache_dir_unless_the_environment_names_them(tmp_path, monkeypatch):
    from kiln.compiler.artifact_cache import KERNEL_CACHE_ENVS, use_kernel_caches

    for env in KERNEL_CACHE_ENVS:
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))  # the user's choice stays
    chosen = use_kernel_caches(str(tmp_path / "cache"))
    assert chosen == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache" / "kernels" / "inductor")}
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
    assert (tmp_path / "cache" / "kernels" / "inductor").is_dir()

    # A read-only cache dir: a writable copy in a temp dir, with what the cache held.
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    (tmp_path / "cache" / "kernels" / "triton" / "k").mkdir(parents=True)
    (tmp_path / "cache" / "kernels" / "triton" / "k" / "a.cubin").write_bytes(b"x")
    monkeypatch.setenv("KILN_CACHE_READ_ONLY", "1")
    chosen = use_kernel_caches(str(tmp_path / "cache"))
    triton_dir = Path(chosen["TRITON_CACHE_DIR"])
    assert tmp_path not in triton_dir.parents and (triton_dir / "k" / "a.cubin").read_bytes() == b"x"
    assert os.environ["TRITON_CACHE_DIR"] == str(triton_dir)


# ---- what the compile cache can store ------------------------------------------------------------
_SYSTEMS = [("cpu", "none", "float32"), ("cpu", "none", "bfloat16"), ("cpu", "int8", "float32"),
            ("cpu", "int4", "float32")] + [
    pytest.param("cuda", q, "bfloat16", marks=pytest.mark.gpu) for q in ("none", "fp8", "int8", "int4")]


@pytest.mark.parametrize("device,quantization,dtype", _SYSTEMS)
def test_every_precisions_captured_graph_is_one_the_compile_cache_stores(device, quantization, dtype, tmp_path,
                                                                          monkeypatch):
    """The pieces kiln hands Inductor after its passes pass AOTAutograd's cacheability check node by
    node: a node it refuses (a method called on a node a pass created without its fake value) leaves
    the artifact cache without an entry, and every restart compiles again. Captured only (no
    Inductor build): the pieces are recorded where they would be compiled."""
    import torch
    from torch._functorch._aot_autograd.autograd_cache import check_node_safe

    from kiln.compiler.backend import KilnBackend
    from kiln.compiler.forward import build_kiln_forward, build_now
    from kiln.config import ModelConfig
    from kiln.models.loader import load_model
    from kiln.ops import quant
    from kiln.ops.registry import select_kernels

    if device == "cpu" and quantization == "int8" and not quant.cpu_int8_supported():
        pytest.skip("torch's packed int8 CPU GEMM is missing")
    if device == "cpu" and quantization == "int4" and not quant.cpu_int4_supported():
        pytest.skip("torch's packed int4 CPU GEMM is missing")
    if quantization == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs SM89+")
    recorded = []
    monkeypatch.setattr(KilnBackend, "_compile_pieces", lambda self, split_gm, *args: recorded.append(split_gm))
    dev = torch.device(device)
    loaded = load_model(ModelConfig(model="random:tiny", quantization=quantization), str(tmp_path), dev,
                        getattr(torch, dtype))
    kernels = select_kernels(device)
    build_now(build_kiln_forward(loaded.model, CompileConfig(mode="kiln", split_every=2), PassConfig(kernels=kernels)),
              dev)
    (split_gm,) = recorded
    pieces = [m for m in split_gm.children() if isinstance(m, torch.fx.GraphModule)]
    assert len(pieces) >= 2
    targets = set()
    for gm in (split_gm, *pieces):
        for node in gm.graph.nodes:
            check_node_safe(node)  # raises BypassAOTAutogradCache with the node it refuses
            targets.add(str(node.target))
    if quantization != "none":  # the quantized GEMMs are in the graph, not a dequantized weight
        assert any(f"linear_{quantization}" in t for t in targets), sorted(targets)


def test_a_built_forward_is_noted_for_the_next_start(tmp_path, monkeypatch):
    """compile.startup=auto loads a forward before ready only where the cache says it was built
    here before (ArtifactCache.note_forward); a read-only cache notes nothing."""
    from kiln.compiler.artifact_cache import READ_ONLY_ENV, ArtifactCache

    cache = ArtifactCache(str(tmp_path), "random:tiny")
    assert not cache.has_forward("abc") and not cache.has_forward(None)
    cache.note_forward("abc")
    assert cache.has_forward("abc") and not cache.has_forward("abd")
    assert cache.entry_dirs() == []  # the notes are no entry
    monkeypatch.setenv(READ_ONLY_ENV, "1")
    cache.note_forward("xyz")
    assert not cache.has_forward("xyz")
