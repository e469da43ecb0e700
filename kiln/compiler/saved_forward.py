"""What a compile cache entry holds for one ``KilnForward``, and turning it back into one.

``write_forward`` (after a cold compile) and ``read_forward`` (on a hit) own these files of an
entry (``kiln.compiler.artifact_cache`` owns the entry itself: key, manifest, atomic rename)::

    plan.json      argument plan, submodule -> piece key (and layer base), each piece's builds, C++ libraries
    graph.pkl      the split GraphModule, every compiled piece an empty stub module
    graph.py       its code and the attention submodules' code, for people; never loaded
    pieces/<piece key>/dynamic.bin, size<N>.bin    Inductor standalone artifacts (binary format)
    inductor/<xx>/<name>.so                        C++ kernels the artifacts load (CPU)

Rules kept here:
- Reading builds nothing kiln-side: no Dynamo trace, no Inductor compile. The graph is unpickled
  (``torch.fx`` regenerates its code), each build is ``CompiledArtifact.load``-ed and installed
  over its stub as the backend installs a fresh build, and the argument plan names parameters and
  buffers by qualified name, so it binds to the model of this process.
- Reading writes nothing into the entry; the C++ libraries are copied into Inductor's own cache
  dir, under the same relative names, where Inductor looks before compiling a kernel.
- No absolute path is stored.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from kiln.compiler.piece import CompiledPiece

PLAN, GRAPH, GRAPH_CODE = "plan.json", "graph.pkl", "graph.py"


# ---- C++ kernels --------------------------------------------------------------------------------
# Both context managers patch an Inductor internal for the length of a block. Where a torch version
# lacks it they do nothing: a warm start then compiles the C++ kernels again, correct but slower.
@contextlib.contextmanager
def record_cpp_binaries() -> Iterator[set[str]]:
    """Paths of the C++ libraries Inductor builds or loads in this block.

    Inductor's standalone artifacts hold the C++ source of CPU kernels, not the built library, so
    loading them on a machine with an empty Inductor cache would rebuild every kernel. Best effort:
    a kernel this process had already loaded before the block is not seen (a later warm start then
    rebuilds it, correctly, at the cost of a compile).
    """
    from torch._inductor.cpp_builder import CppBuilder

    seen: set[str] = set()
    original = getattr(CppBuilder, "get_target_file_path", None)
    if original is None:  # another torch: record nothing (see the section comment)
        yield seen
        return

    def recording(self):
        path = original(self)
        seen.add(path)
        return path

    CppBuilder.get_target_file_path = recording
    try:
        yield seen
    finally:
        CppBuilder.get_target_file_path = original


def _inductor_cache_dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def copy_cpp_binaries(paths: set[str], entry_dir: Path) -> list[str]:
    """Copy the built libraries under Inductor's cache dir into ``entry_dir/inductor``."""
    root, copied = _inductor_cache_dir(), []
    for path in sorted(Path(p) for p in paths):
        if path.suffix != ".so" or not path.is_file() or root not in path.parents:
            continue
        rel = path.relative_to(root).as_posix()
        (entry_dir / "inductor" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, entry_dir / "inductor" / rel)
        copied.append(rel)
    return copied


@contextlib.contextmanager
def no_precompiled_header_builds() -> Iterator[None]:
    """Inductor builds its precompiled header (on CPU, ~150 MB and seconds of g++) before it looks
    for a kernel's library; with the libraries installed from the entry that build is wasted.
    Skipped while loading: a kernel that must still be compiled includes the plain header instead
    (``-include``: g++ uses the ``.gch`` only when there is one), slower but the same library."""
    from torch._inductor import codecache

    original = getattr(codecache, "_worker_compile_cpp", None)
    if original is None:  # another torch: skip nothing (see the section comment)
        yield
        return

    def without_headers(lock_path, builders):
        builders = [b for b in builders if not b.get_target_file_path().endswith((".gch", ".pch"))]
        if builders:
            original(lock_path, builders)

    codecache._worker_compile_cpp = without_headers
    try:
        yield
    finally:
        codecache._worker_compile_cpp = original


def install_cpp_binaries(entry_dir: Path, rels: list[str]) -> None:
    """Put the entry's libraries where Inductor will look for them (never over an existing one)."""
    root = _inductor_cache_dir()
    for rel in rels:
        target = root / rel
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}")
        shutil.copyfile(entry_dir / "inductor" / rel, tmp)
        os.replace(tmp, target)


# ---- the forward's files ------------------------------------------------------------------------
@dataclass
class SavedForward:
    """What a warm start needs to run the forward without Dynamo or Inductor."""

    split_gm: torch.fx.GraphModule  # attention submodules as they are, compiled pieces shadowed
    pieces: dict[str, CompiledPiece]  # submodule name -> its compiled piece
    single_output: dict[str, bool]  # piece key -> its graph returns one value, not a tuple
    args: list[dict[str, Any]]  # argument plan (``kiln.compiler.capture._CallPlan.to_json``)
    cpp_binaries: set[str]  # C++ libraries the builds load (``record_cpp_binaries``)


def _fresh_module(gm: torch.fx.GraphModule, root: dict[str, torch.nn.Module]) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    out, out_node = graph.graph_copy(gm.graph, {}, return_output_node=True)
    graph.output(out, type_expr=out_node.type)
    return torch.fx.GraphModule(root, graph)


def write_forward(entry_dir: Path, saved: SavedForward) -> None:
    root: dict[str, torch.nn.Module] = {}
    for name, sub in saved.split_gm.named_children():
        # A compiled piece becomes an empty module; its build is installed over it on load.
        root[name] = torch.nn.Module() if name in saved.pieces else _fresh_module(sub, {})
    stub = _fresh_module(saved.split_gm, root)
    (entry_dir / GRAPH).write_bytes(pickle.dumps(stub))
    code = [f"# split graph\n{stub.code}"]
    code += [f"# {n}: attention\n{m.code}" for n, m in stub.named_children() if isinstance(m, torch.fx.GraphModule)]
    (entry_dir / GRAPH_CODE).write_text("\n".join(code))
    builds = {}
    for piece in {p.key: p for p in saved.pieces.values()}.values():
        (entry_dir / "pieces" / piece.key).mkdir(parents=True)
        files = {"dynamic": f"pieces/{piece.key}/dynamic.bin"}
        files |= {str(n): f"pieces/{piece.key}/size{n}.bin" for n in sorted(piece.by_size)}
        for variant, rel in files.items():
            fn = piece.dynamic if variant == "dynamic" else piece.by_size[int(variant)]
            fn.save(path=str(entry_dir / rel), format="binary")
        builds[piece.key] = {"size_arg": piece.size_arg, "single_output": saved.single_output[piece.key],
                             "files": files}
    plan = {"args": saved.args, "pieces": {n: p.key for n, p in saved.pieces.items()}, "builds": builds,
            "layer_base": {n: p.layer_base for n, p in saved.pieces.items() if p.layer_base},
            "cpp_binaries": copy_cpp_binaries(saved.cpp_binaries, entry_dir)}
    (entry_dir / PLAN).write_text(json.dumps(plan, indent=1))


def prefetch_source_keys() -> None:
    """Start hashing torch's and Triton's source trees on a thread. Loading an Inductor artifact
    checks it against ``torch_key()`` (a hash of every file under torch) and kernels are looked up
    under ``triton_key()``: seconds of file reads and hashing at the first load of a process, off
    the GIL for the most part, so they can run while the weights load. Both are cached per process;
    torch >= 2.12 prefetches on its own executor, older versions on a thread of ours."""
    import threading

    from torch._inductor import codecache

    keys = [codecache.torch_key, getattr(codecache, "triton_key", None)]
    keys = [key for key in keys if key is not None]
    if all(hasattr(key, "prefetch") for key in keys):
        for key in keys:
            key.prefetch()
        return

    def compute() -> None:
        for key in keys:
            try:
                key()
            except Exception:  # the load computes it again, and reports what went wrong there
                return

    threading.Thread(target=compute, name="kiln-source-keys", daemon=True).start()


def prefetch_triton_key() -> None:
    """Start Triton's own hash of its compiler sources (``triton.runtime.cache.triton_key``, cached
    per process) on a thread: Triton's JIT computes it at the first launch of any kernel, and on a
    GPU machine that took 3.4 s of a first step that shared the GIL with a background build. Reading
    and hashing files mostly releases the GIL, so it overlaps the weight read. Without Triton, nothing."""
    import threading

    def compute() -> None:
        try:
            from triton.runtime.cache import triton_key

            triton_key()
        except Exception:  # noqa: BLE001 - Triton computes it again at its first launch, and reports there
            return

    threading.Thread(target=compute, name="kiln-triton-key", daemon=True).start()


def _unwrap_single(fn: Callable[..., Any]) -> Callable[..., Any]:
    # A loaded build returns a list of outputs; the fresh build of a piece whose graph returns one
    # value returned that value (Inductor unwraps it outside the cached part), and the split graph
    # expects it.
    return lambda *args: fn(*args)[0]


@dataclass
class LoadedForward:
    split_gm: torch.fx.GraphModule  # every compiled piece loaded and installed
    args: list[dict[str, Any]]  # argument plan
    num_pieces: int
    num_builds: int


def read_forward(entry_dir: Path) -> LoadedForward:
    from torch._inductor import CompiledArtifact

    plan = json.loads((entry_dir / PLAN).read_text())
    install_cpp_binaries(entry_dir, plan["cpp_binaries"])
    loaded: dict[str, CompiledPiece] = {}
    num_builds = 0
    for key, build in plan["builds"].items():
        fns = {}
        for variant, rel in build["files"].items():
            with no_precompiled_header_builds():
                fn = CompiledArtifact.load(path=str(entry_dir / rel), format="binary")
            fns[variant] = _unwrap_single(fn) if build["single_output"] else fn
            num_builds += 1
        by_size = {int(v): fn for v, fn in fns.items() if v != "dynamic"}
        loaded[key] = CompiledPiece(key, fns["dynamic"], build["size_arg"], by_size)
    split_gm = pickle.loads((entry_dir / GRAPH).read_bytes())
    for name, key in plan["pieces"].items():  # as the backend does: shadows the stub submodule
        split_gm.__dict__[name] = loaded[key].at_layer(plan["layer_base"].get(name, 0))
    return LoadedForward(split_gm, plan["args"], len(plan["pieces"]), num_builds)
