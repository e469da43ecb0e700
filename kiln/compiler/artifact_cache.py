"""The compiled-artifact cache: a restart with the same model and config skips Dynamo and Inductor.

One entry per key, a directory under ``<cache.dir>/compile/``::

    <key>/
      factors.json          what the key is a hash of (read to explain a miss)
      manifest.json         sha256 and size of every other file; written last
      plan.json, graph.pkl, graph.py, pieces/, inductor/
                            the compiled forward (``kiln.compiler.saved_forward``)

The key is a hash of ``key_factors``: the model (name, impl, architecture, dtype, tensor shapes,
quantization), the compile config, every pass's uuid, kiln's own source, torch/triton/Python
versions, the device (name and capability) and, on CPU, the ``kiln_cpu`` ops ``kiln._C`` registers
(the graphs call them by name). A miss names the factors that differ from the nearest existing entry.

Rules kept here:
- Loading never writes into the cache dir: a read-only copy (an image layer) works. The C++
  kernels are copied into Inductor's own cache dir (``TORCHINDUCTOR_CACHE_DIR``, a temp dir by
  default), where Inductor looks for them, so a fresh machine does not rebuild them.
- An entry appears whole or not at all: it is written into ``compile/.tmp-*`` and renamed into
  place. If another process renamed first, ours is dropped and theirs kept.
- Every file is checked against the manifest before use; a missing, truncated or altered file
  makes the entry a miss (logged with the file), it is recompiled and, where writable, replaced.
- No absolute path is stored: an entry works from any directory on a machine of the same kind
  (same device, same Python environment path; the C++ kernels' names depend on its include paths).
- The cache dir holds code (pickles, kernels): trust it as you trust the installed packages.

Environment:
- ``KILN_CACHE_READ_ONLY=1``: treat the cache dir as read-only even where it is writable (a cache
  shared by several deploys; tests, since root writes through ``chmod a-w``).
- ``KILN_TEST_KEY_FACTORS='{"torch": "0.0", "passes.NoOpEliminationPass": "edited"}'``: tests
  only; a JSON object whose items (dotted names reach into nested factors) replace or add key
  factors, to simulate another torch version or an edited pass without installing or editing one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import platform
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from kiln.compiler.saved_forward import GRAPH, PLAN, LoadedForward, read_forward
from kiln.config import CompileConfig
from kiln.ops.cpu_attention import extension_ops

if TYPE_CHECKING:  # the passes import Inductor: only a build imports them (kiln.compiler's rule)
    from kiln.ops.registry import KernelSet
    from kiln.passes.manager import PassManager

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
READ_ONLY_ENV = "KILN_CACHE_READ_ONLY"
TEST_FACTORS_ENV = "KILN_TEST_KEY_FACTORS"
KIND = "compile"  # the entries' directory under the cache dir
FACTORS, MANIFEST = "factors.json", "manifest.json"
FORWARDS = ".forwards"  # one empty file per forward_key built or loaded here (ArtifactCache.note_forward)


# ---- the key ------------------------------------------------------------------------------------
def key_factors(model: torch.nn.Module, model_name: str, config: CompileConfig, passes: Optional[PassManager],
                capture_num_tokens: int) -> dict[str, Any]:
    """Everything the compiled artifacts depend on, as JSON-able values (without ``passes``: all but
    the passes' uuids, for ``forward_key``)."""
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    arch = getattr(model, "arch", None)
    factors = {
        "format": FORMAT_VERSION,
        "model": {
            "name": model_name,
            "impl": getattr(model, "impl", "native"),  # model.impl: kiln's code or transformers'
            "class": f"{type(model).__module__}.{type(model).__qualname__}",
            "arch": dataclasses.asdict(arch) if dataclasses.is_dataclass(arch) else None,
            "tensors": _tensors_hash(model),
            "quantization": getattr(model, "quantization", "none"),
        },
        "dtype": str(param.dtype if param is not None else None),
        # When graphs are captured, or the forward built, changes no compiled artifact.
        "compile": {k: v for k, v in dataclasses.asdict(config).items()
                    if k not in ("debug_dump_dir", "startup", "capture", "build")},
        "capture_num_tokens": capture_num_tokens,
        **({"passes": {p.name: p.uuid() for p in passes.passes} | {"PassManager": passes.uuid()}}
           if passes is not None else {}),
        "kiln_source": kiln_source_hash(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "python": platform.python_version(),
        "device": device_factors(device),
        "extension": extension_ops() if device.type == "cpu" else None,
    }
    factors = json.loads(json.dumps(factors, default=str))  # tuples -> lists: equal to what is read back
    for dotted, value in json.loads(os.environ.get(TEST_FACTORS_ENV) or "{}").items():
        *parents, leaf = dotted.split(".")
        node = factors
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
    return factors


def cache_key(factors: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:20]


def forward_key(model: torch.nn.Module, model_name: str, config: CompileConfig, kernels: KernelSet,
                capture_num_tokens: int) -> str:
    """A key of kiln's compiled forward known before its passes are built (they import Inductor,
    which a background build leaves to its thread): the compile key's factors with the kernels the
    passes write into the graph in place of the passes' uuids, which are a function of those and of
    kiln's source, hashed already. What is kept beside a compiled forward (its memory profile) is
    filed under it."""
    factors = key_factors(model, model_name, config, None, capture_num_tokens)
    factors["kernels"] = kernels.describe()  # the passes' inputs
    factors["kernel_options"] = kernels.options.graph_factors()  # and the options they read (kernels.rope_join)
    factors["attention_layers"] = json.loads(json.dumps(getattr(model, "attention_layers", ())))
    return cache_key(factors)


def kiln_source_hash() -> str:
    """sha256 over every .py file of the kiln package (relative path and contents)."""
    root = Path(__file__).resolve().parents[1]  # the kiln package
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()


def device_factors(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        return {"type": "cuda", "name": torch.cuda.get_device_name(device),
                "capability": ".".join(map(str, torch.cuda.get_device_capability(device)))}
    return {"type": device.type, "name": _cpu_name(), "machine": platform.machine(),
            "capability": torch.backends.cpu.get_cpu_capability()}


def differing_factors(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Dotted names of the factors whose values differ (nested dicts compared item by item)."""
    fa, fb = flatten_factors(a), flatten_factors(b)
    return sorted(k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k))


def flatten_factors(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten_factors(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _tensors_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        h.update(f"{name} {tuple(t.shape)} {t.dtype}\n".encode())
    return h.hexdigest()[:16]


def _triton_version() -> Optional[str]:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


# ---- entry files --------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(entry_dir: Path) -> None:
    files = {}
    for path in sorted(p for p in entry_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(entry_dir).as_posix()
        if rel != MANIFEST:
            files[rel] = {"sha256": _sha256(path), "bytes": path.stat().st_size}
    (entry_dir / MANIFEST).write_text(json.dumps({"format": FORMAT_VERSION, "created": time.time(),
                                                  "files": files}, indent=1))


def verify_entry(entry_dir: Path) -> Optional[str]:
    """None if every file of the manifest is present and intact, else what is wrong."""
    try:
        manifest = json.loads((entry_dir / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} unreadable ({type(e).__name__})"
    for required in (FACTORS, PLAN, GRAPH):
        if required not in files:
            return f"{required} missing from the manifest"
    for rel, info in files.items():
        path = entry_dir / rel
        try:
            size = path.stat().st_size
        except OSError:
            return f"{rel} missing"
        if size != info["bytes"]:
            return f"{rel} has {size} bytes, the manifest says {info['bytes']}"
        if _sha256(path) != info["sha256"]:
            return f"{rel} checksum mismatch"
    return None


def read_factors(entry_dir: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads((entry_dir / FACTORS).read_text())
    except (OSError, ValueError):
        return None


# ---- Triton's and Inductor's own caches -----------------------------------------------------------
KERNELS = "kernels"  # <cache.dir>/kernels/{triton,inductor}
KERNEL_CACHE_ENVS = {"TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor"}


def use_kernel_caches(cache_dir: str) -> dict[str, str]:
    """Point Triton's and Inductor's caches (JIT-compiled kernels, autotuning results) into
    ``<cache_dir>/kernels/`` unless the environment already names them, before anything compiles;
    then a restart, or another machine given the cache dir (``kiln cache export``), also finds the
    kernels kiln's own ops and Inductor's dynamic builds compile at their first run (several
    seconds on a GPU). A read-only cache dir is copied to a temp dir first (those caches write as
    they go). Returns what was set."""
    chosen = {}
    base = Path(cache_dir).expanduser() / KERNELS
    writable = ArtifactCache(cache_dir, "").writable()
    for env, sub in KERNEL_CACHE_ENVS.items():
        if os.environ.get(env):
            continue
        target = base / sub
        if not writable:
            scratch = Path(tempfile.mkdtemp(prefix=f"kiln-{sub}-"))
            if target.is_dir():
                shutil.copytree(target, scratch, dirs_exist_ok=True, symlinks=True)
            target = scratch
        target.mkdir(parents=True, exist_ok=True)
        os.environ[env] = chosen[env] = str(target)
    return chosen


# ---- the cache ----------------------------------------------------------------------------------
class ArtifactCache:
    """``<cache_dir>/compile``: entries of compiled forwards, one per key."""

    def __init__(self, cache_dir: str, model_name: str) -> None:
        self.dir = Path(cache_dir).expanduser() / KIND
        self.model_name = model_name

    def writable(self) -> bool:
        if os.environ.get(READ_ONLY_ENV, "") not in ("", "0"):
            return False
        existing = self.dir
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        return os.access(existing, os.W_OK | os.X_OK)

    def has_forward(self, forward_key: Optional[str]) -> bool:
        """Whether a forward of ``forward_key`` (``forward_key()``) was built or loaded here before
        (``note_forward``): a start that finds it expects a compile-cache hit."""
        return forward_key is not None and (self.dir / FORWARDS / forward_key).exists()

    def note_forward(self, forward_key: Optional[str]) -> None:
        """Remember that the forward of ``forward_key`` is in the cache (best effort)."""
        if forward_key is None or not self.writable():
            return
        try:
            (self.dir / FORWARDS).mkdir(parents=True, exist_ok=True)
            (self.dir / FORWARDS / forward_key).touch()
        except OSError as e:
            logger.debug("could not note the built forward %s: %s", forward_key, e)

    def entry(self, factors: dict[str, Any]) -> "CacheEntry":
        return CacheEntry(self, factors)

    def entry_dirs(self) -> list[Path]:
        if not self.dir.is_dir():
            return []
        return sorted(p for p in self.dir.iterdir() if p.is_dir() and not p.name.startswith("."))

    def nearest(self, factors: dict[str, Any], exclude: str) -> Optional[tuple[str, list[str]]]:
        """The existing entry whose factors differ from ``factors`` in the fewest places."""
        best = None
        for path in self.entry_dirs():
            other = read_factors(path)
            if path.name == exclude or other is None:
                continue
            diff = differing_factors(factors, other)
            if best is None or len(diff) < len(best[1]):
                best = (path.name, diff)
        return best


class CacheEntry:
    """One key's entry: ``load`` on start-up, ``store`` after a cold compile."""

    def __init__(self, cache: ArtifactCache, factors: dict[str, Any]) -> None:
        self.cache = cache
        self.factors = factors
        self.key = cache_key(factors)
        self.dir = cache.dir / self.key
        self.corrupt: Optional[str] = None  # what was wrong with the entry found on disk

    def load(self) -> Optional[LoadedForward]:
        """The loaded forward, or None: a miss, logged with its reason."""
        t0 = time.perf_counter()
        if not self.dir.is_dir():
            logger.info("kiln: compile cache miss %s: %s", self.key, self._miss_reason())
            return None
        self.corrupt = verify_entry(self.dir)
        if self.corrupt is None and read_factors(self.dir) != self.factors:
            self.corrupt = f"{FACTORS} does not match the key"
        loaded = None
        if self.corrupt is None:
            try:
                loaded = read_forward(self.dir)
            except Exception as e:  # noqa: BLE001  (any failure to load: compile instead)
                self.corrupt = f"loading failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if self.corrupt is not None:
            logger.warning("kiln: compile cache entry %s is corrupt or unusable (%s); recompiling, never using it",
                           self.key, self.corrupt)
            return None
        logger.info("kiln: compile cache hit %s: %d pieces, %d builds loaded in %.2f s; Dynamo and Inductor skipped",
                    self.key, loaded.num_pieces, loaded.num_builds, time.perf_counter() - t0)
        return loaded

    def _miss_reason(self) -> str:
        near = self.cache.nearest(self.factors, exclude=self.key)
        if near is None:
            return f"no entries in {self.cache.dir}"
        name, diff = near
        return f"nearest entry {name} differs in {', '.join(diff) or 'nothing (another key format)'}"

    def store(self, write: Callable[[Path], None]) -> None:
        """Write the entry with ``write(tmp_dir)`` and rename it into place; never raises."""
        if not self.cache.writable():
            logger.info("kiln: cache dir %s is read-only: the compiled forward stays in memory, nothing stored",
                        self.cache.dir)
            return
        tmp = None
        try:
            self.cache.dir.mkdir(parents=True, exist_ok=True)
            tmp = self.cache.dir / f".tmp-{self.key}-{os.getpid()}-{secrets.token_hex(4)}"
            tmp.mkdir()
            write(tmp)
            (tmp / FACTORS).write_text(json.dumps(self.factors, indent=1, sort_keys=True))
            write_manifest(tmp)
            self._rename_into_place(tmp)
        except Exception as e:  # noqa: BLE001  (a failed store costs the next start a compile, nothing more)
            logger.warning("kiln: could not store compile cache entry %s: %s: %s", self.key, type(e).__name__, e)
        finally:
            if tmp is not None and tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def _rename_into_place(self, tmp: Path) -> None:
        size = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
        if self.dir.exists() and (self.corrupt is not None or verify_entry(self.dir) is not None):
            trash = self.cache.dir / f".trash-{self.key}-{os.getpid()}-{secrets.token_hex(4)}"
            with contextlib.suppress(OSError):
                os.rename(self.dir, trash)  # the corrupt entry: out of the way, then gone
                shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(tmp, self.dir)
        except OSError:
            if not self.dir.is_dir():
                raise
            logger.info("kiln: another process stored compile cache entry %s first; keeping its entry", self.key)
            return
        logger.info("kiln: stored compile cache entry %s (%.1f MiB) in %s", self.key, size / 2**20, self.cache.dir)
