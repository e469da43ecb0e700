"""Session-wide test set-up: GPU markers, and caches that are never the user's.

Every test session gets a fresh cache dir (``kiln_cache_dir``, also set as ``$KILN_CACHE_DIR`` so
``LLM(...)`` without ``cache.dir`` and subprocess workers use it) and fresh Inductor, Triton,
matplotlib and Ray scratch dirs. They live under pytest's own temp dir (``/tmp/pytest-of-$USER``,
of which pytest keeps the last three runs), except Ray's, whose socket paths must stay short: a
``/tmp/kiln-ray-*`` dir removed when the session ends. Nothing is written into ``~/.cache``.

On the CPU, ``compile.mode=auto`` resolves to eager in tests (``cpu_auto_is_eager``), as with
several processes: users get kiln built in the background, which every test that builds an engine
on the defaults would otherwise start (a compile of its model on a thread, seconds to minutes of
CPU). kiln mode there cuts at every attention call (users get every 10th), so a test's layers are
one small build. Tests of those defaults are marked ``cpu_default``; a ``kiln serve`` started as a
subprocess keeps the user's defaults.

One exception, shared across runs and read-only to the tests: the embedded SmolLM2 converted into
a Hugging Face directory (about 14 s to convert), kept in ``$KILN_TEST_SHARED_DIR`` (default
``.kiln-cache/`` in the checkout, git-ignored) and linked into each session's cache dir. Point it
at ``~/.cache/kiln`` to share the conversion with your own kiln; set it to an empty string to
convert into the session's cache dir every run. A test must never write into a linked entry.

Under pytest-xdist each worker takes its share of the cores (``cores_per_worker``): torch's threads
and ``$OMP_NUM_THREADS``, which the processes a test starts inherit. Two workers that each ran a
thread per core would make every OpenMP region of one wait on threads the other has descheduled; a
test that needs several threads sets them itself.
"""

import contextlib
import os
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_DIR_ENV = "KILN_TEST_SHARED_DIR"

# The shared helpers' asserts (assert_error, mixed_workload, ...) explain a failure as a test's do.
pytest.register_assert_rewrite("tests.helpers")


# The files that take longest, in seconds of one worker (a `make test` on two busy cores): every
# file over 15 s. `make test` gives each xdist worker whole files in collection order
# (`--dist loadfile --no-loadscope-reorder`), so these are collected first, longest first: a long
# file that started last would run alone at the end and bound the run. Only the order depends on
# these numbers.
LONG_FILES = {
    "tests/compiler/test_compiler.py": 130,
    "tests/e2e/test_structured_outputs.py": 80,
    "tests/compiler/test_artifact_cache.py": 80,
    "tests/ops/test_triton_attention.py": 65,
    "tests/entrypoints/test_server.py": 65,
    "tests/runtime/test_tensor_parallel.py": 60,
    "tests/entrypoints/test_cli.py": 60,
    "tests/engine/test_engine_core.py": 60,
    "tests/models/test_weight_reader.py": 50,
    "tests/models/test_hf_generic.py": 50,
    "tests/runtime/test_lora_engine.py": 45,
    "tests/runtime/test_ray_executor.py": 40,
    "tests/ops/test_cpu_linear.py": 35,
    "tests/entrypoints/test_server_edge.py": 35,
    "tests/entrypoints/test_server_robustness.py": 25,
    "tests/entrypoints/test_server_fuzz.py": 25,
    "tests/entrypoints/test_beam_search.py": 25,
    "tests/e2e/test_engine.py": 25,
    "tests/compiler/test_background_build.py": 25,
    "tests/runtime/test_ray_multinode.py": 15,
    "tests/runtime/test_pipeline_parallel.py": 15,
    "tests/models/test_models.py": 15,
    "tests/models/test_hf_multimodal.py": 15,
}


def _longest_files_first(items) -> None:
    rank = {path: i for i, path in enumerate(sorted(LONG_FILES, key=LONG_FILES.get, reverse=True))}
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.nodeid.split("::")[0], i)
    # Stable: a file's tests keep their order, and the other files theirs.
    items.sort(key=lambda item: (rank.get(item.nodeid.split("::")[0], len(rank)), first[item.nodeid.split("::")[0]]))


def pytest_collection_modifyitems(config, items):
    _longest_files_first(items)
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA devices")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "multi_gpu" in item.keywords and torch.cuda.device_count() < 2:
            item.add_marker(skip_multi)


@pytest.fixture(scope="session", autouse=True)
def cores_per_worker():
    """The cores of one xdist worker, which it and its child processes use (see the module docstring);
    all of them without xdist."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = max(1, (os.cpu_count() or 1) // workers)
    if workers == 1:
        yield cores
        return
    before = torch.get_num_threads()
    torch.set_num_threads(cores)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", str(cores))
        yield cores
    torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def kiln_cache_dir(tmp_path_factory):
    """The session's cache dir (converted models, compiled artifacts); see the module docstring."""
    root = tmp_path_factory.mktemp("kiln-cache")
    ray_dir = tempfile.mkdtemp(prefix="kiln-ray-")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_CACHE_DIR", str(root))
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
        mp.setenv("TRITON_CACHE_DIR", str(root / "triton"))
        mp.setenv("MPLCONFIGDIR", str(root / "matplotlib"))  # its font cache, else under ~/.cache
        mp.setenv("RAY_TMPDIR", ray_dir)
        # Ray enables token auth for the local clusters it starts; with a token given here it writes
        # none into ~/.ray/auth_token.
        mp.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
        _link_shared_models(root)
        yield str(root)
    shutil.rmtree(ray_dir, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def cpu_auto_is_eager():
    """``compile.mode=auto`` on the CPU resolves to eager, and kiln mode cuts at every attention call
    (see the module docstring): tests compile small pieces, and the layers of a piece once."""
    import kiln.config

    users = {"split_every": kiln.config.CPU_SPLIT_EVERY}
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(kiln.config.DEVICE_DEFAULTS, "cpu", ("eager", *kiln.config.DEVICE_DEFAULTS["cpu"][1:]))
        mp.setattr(kiln.config, "CPU_SPLIT_EVERY", 1)
        yield users


@pytest.fixture(autouse=True)
def cpu_default(request, cpu_auto_is_eager):
    """The user's CPU default for a test marked ``cpu_default`` (engines it builds itself, not in
    fixtures of a wider scope)."""
    if request.node.get_closest_marker("cpu_default") is None:
        yield
        return
    import kiln.config

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(kiln.config.DEVICE_DEFAULTS, "cpu", (kiln.config.CPU_COMPILE_MODE, *kiln.config.DEVICE_DEFAULTS["cpu"][1:]))
        mp.setattr(kiln.config, "CPU_SPLIT_EVERY", cpu_auto_is_eager["split_every"])
        yield


_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def free_cuda_memory():
    """On a GPU, an engine a test dropped holds its KV cache and graphs in reference cycles until
    the collector runs: free them after each test, so the next engine sizes its KV cache against a
    free device rather than failing for memory an earlier test's engine still held."""
    yield
    if _CUDA:
        import gc

        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture
def kernel_config():
    """``kernel_config(pdl="off")`` sets this process's kernel options (``kiln.ops.options``) for the
    rest of the test, each call over the one before; the options from before the test come back
    after it."""
    from kiln.ops.options import kernel_options

    with contextlib.ExitStack() as stack:
        yield lambda **fields: stack.enter_context(kernel_options(**fields))


def _link_shared_models(root: Path) -> None:
    """Convert the embedded model once into the shared dir and link it into ``root``."""
    from kiln.models.gguf import convert_gguf
    from kiln.models.registry import REGISTERED_MODELS

    shared = os.environ.get(SHARED_DIR_ENV, str(REPO / ".kiln-cache"))
    if not shared:
        return
    for name, source in REGISTERED_MODELS.items():
        gguf_path = source.find()
        if gguf_path is None:
            continue  # the tests that need it skip
        model_dir = Path(convert_gguf(gguf_path, os.path.expanduser(shared), name))
        (root / "models").mkdir(exist_ok=True)
        (root / "models" / model_dir.name).symlink_to(model_dir, target_is_directory=True)
