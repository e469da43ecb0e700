"""``kiln cache``: what kiln keeps on disk, looking into it, shipping it, and removing it.

    kiln cache ls [cache.dir=...]              every entry: key, size, age (and what a compile entry is for)
    kiln cache inspect KEY [cache.dir=...]     one entry: its files; for a compile entry its key factors,
                                               pieces and builds, and whether every checksum holds
    kiln cache clear [KEY] [cache.dir=...]     remove one entry (its key or, if unique, its name), or all
    kiln cache export PATH [cache.dir=...]     copy every entry to PATH (a directory, or a .tar/.tar.gz
                                               file) that another machine of the same kind uses as its
                                               cache dir: cache.dir=PATH or KILN_CACHE_DIR=PATH

The cache directory is ``CacheConfig.resolved_dir`` ($KILN_CACHE_DIR or ~/.cache/kiln by default)::

    <dir>/models/<name>/      converted models (Hugging Face directories)
    <dir>/tokenizers/<name>/  converted tokenizers (borrowed by random:<preset> models)
    <dir>/compile/<key>/      compiled forwards (``kiln.compiler.artifact_cache``)
    <dir>/memory/<key>.json   profiled start-up memory of a compiled forward (``kiln.runtime.kv_sizing``)
    <dir>/kernels/triton/, <dir>/kernels/inductor/
                              Triton's and Inductor's own caches, on a GPU unless the environment
                              names them (``use_kernel_caches``)

An entry is one child of a kind directory (``KINDS``) and its key is ``<kind>/<name>``. Only those
kinds are listed, exported or removed, so a mistyped ``cache.dir`` (say, a home directory) loses
nothing. Hidden children (``compile/.tmp-*``: entries being written) are not entries; ``clear``
without a KEY removes them too. Each action is one function in ``ACTIONS``.

``ls`` reads metadata only and imports neither torch nor transformers, so it answers in a fraction of
a second (a test holds it to that); ``inspect`` and ``export`` check checksums through
``kiln.compiler``, which imports torch.
"""

from __future__ import annotations

import json
import shutil
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from kiln.errors import first_line

KINDS = ("models", "tokenizers", "compile", "memory", "kernels")
USAGE = "usage: kiln cache <ls | inspect KEY | clear [KEY] | export PATH> [cache.dir=PATH] [other overrides]"
_TARBALL_SUFFIXES = (".tar", ".tar.gz", ".tgz")
FACTORS_FILE = "factors.json"  # kiln.compiler.artifact_cache.FACTORS (tests/entrypoints/test_cli.py checks they agree)


@dataclass(frozen=True)
class Entry:
    key: str  # <kind>/<name>
    path: Path
    size_bytes: int
    modified: float  # newest mtime inside, seconds since the epoch


def entries(root: Path) -> list[Entry]:
    found = []
    for kind in KINDS:
        kind_dir = root / kind
        if kind_dir.is_dir():
            for path in sorted(p for p in kind_dir.iterdir() if not p.name.startswith(".")):
                size, modified = _du(path)
                found.append(Entry(f"{kind}/{path.name}", path, size, modified))
    return found


def _du(path: Path) -> tuple[int, float]:
    """Bytes under ``path`` and its newest mtime; links are counted, not followed."""
    st = path.lstat()
    if not path.is_dir() or path.is_symlink():
        return st.st_size, st.st_mtime
    size, newest = 0, st.st_mtime
    for child in path.rglob("*"):
        cst = child.lstat()
        size += cst.st_size if not child.is_dir() else 0
        newest = max(newest, cst.st_mtime)
    return size, newest


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def human_age(seconds: float) -> str:
    for unit, span in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f} {unit} ago"
    return "just now"


def cmd_ls(root: Path, key: Optional[str]) -> int:
    if key is not None:
        print(f"kiln: error: `kiln cache ls` takes no KEY, got {key!r}", file=sys.stderr)
        return 2
    found = entries(root)
    print(f"cache dir: {root}")
    if not found:
        print("(empty)")
        return 0
    now = time.time()
    width = max(len(e.key) for e in found)
    for e in found:
        about = _compile_summary(e.path) if e.key.startswith("compile/") else ""
        print(f"  {e.key:<{width}}  {human_bytes(e.size_bytes):>10}  {human_age(now - e.modified):<11}  {about}".rstrip())
    print(f"{len(found)} entries, {human_bytes(sum(e.size_bytes for e in found))}")
    return 0


def _compile_summary(path: Path) -> str:
    # Read here, not through kiln.compiler (which imports torch): `ls` stays well under a second.
    try:
        factors = json.loads((path / FACTORS_FILE).read_text())
    except (OSError, ValueError):
        return f"(no {FACTORS_FILE})"
    return f"{factors.get('model', {}).get('name')}, {factors.get('dtype')}, torch {factors.get('torch')}, " \
           f"{factors.get('device', {}).get('type')}"


def _choose(found: list[Entry], key: str) -> Optional[Entry]:
    """The one entry named by ``key`` (its key, or its name if unique); prints why not otherwise."""
    chosen = [e for e in found if key in (e.key, e.path.name)]
    if len(chosen) == 1:
        return chosen[0]
    what = "matches several entries" if chosen else "is not in the cache"
    keys = [e.key for e in (chosen or found)] or ["(empty)"]
    print(f"kiln: error: {key!r} {what}; choose one of {keys}", file=sys.stderr)
    return None


def cmd_inspect(root: Path, key: Optional[str]) -> int:
    if key is None:
        print("kiln: error: `kiln cache inspect` needs a KEY (see `kiln cache ls`)", file=sys.stderr)
        return 2
    entry = _choose(entries(root), key)
    if entry is None:
        return 1
    print(f"{entry.key}  ({human_bytes(entry.size_bytes)}, {human_age(time.time() - entry.modified)})")
    print(f"  path: {entry.path}")
    if entry.key.startswith("compile/"):
        _inspect_compile(entry.path)
    files = sorted(p for p in entry.path.rglob("*") if p.is_file())
    kernels = [f for f in files if f.relative_to(entry.path).parts[0] == "inductor"]
    print(f"  files ({len(files)}):")
    for f in [f for f in files if f not in kernels][:40]:
        print(f"    {f.relative_to(entry.path).as_posix():<48} {human_bytes(f.stat().st_size):>10}")
    if kernels:
        print(f"    {'inductor/ (' + str(len(kernels)) + ' C++ libraries)':<48} "
              f"{human_bytes(sum(f.stat().st_size for f in kernels)):>10}")
    return 0


def _inspect_compile(path: Path) -> None:
    from kiln.compiler.artifact_cache import flatten_factors, read_factors, verify_entry
    from kiln.compiler.saved_forward import PLAN

    problem = verify_entry(path)
    print(f"  status: {'ok: every file matches the manifest' if problem is None else 'corrupt: ' + problem}")
    factors = read_factors(path) or {}
    print("  key factors:")
    for name, value in flatten_factors(factors).items():
        print(f"    {name} = {json.dumps(value)}")
    try:
        plan = json.loads((path / PLAN).read_text())
    except (OSError, ValueError):
        return
    builds = plan.get("builds", {})
    print(f"  pieces: {len(plan.get('pieces', {}))} ({len(builds)} unique), "
          f"C++ libraries: {len(plan.get('cpp_binaries', []))}")
    for piece_key, build in builds.items():
        sizes = [v for v in build["files"] if v != "dynamic"]
        print(f"    piece {piece_key}: dynamic build" + (f" + sizes {', '.join(sizes)}" if sizes else ""))


def cmd_export(root: Path, dest: Optional[str]) -> int:
    from kiln.compiler.artifact_cache import verify_entry

    if dest is None:
        print("kiln: error: `kiln cache export` needs a PATH (a directory, or a .tar/.tar.gz file)", file=sys.stderr)
        return 2
    out = Path(dest).expanduser()
    chosen = []
    for e in entries(root):
        problem = verify_entry(e.path) if e.key.startswith("compile/") else None
        if problem is not None:
            print(f"kiln: warning: skipping {e.key}: corrupt ({problem})", file=sys.stderr)
        else:
            chosen.append(e)
    if out.name.endswith(_TARBALL_SUFFIXES):
        mode = "w:gz" if out.name.endswith((".gz", ".tgz")) else "w"
        tmp = out.with_name(f".{out.name}.partial")
        with tarfile.open(tmp, mode) as tar:
            for e in chosen:
                tar.add(e.path, arcname=e.key)
        tmp.replace(out)
    else:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            print(f"kiln: error: {out} exists and is not an empty directory", file=sys.stderr)
            return 1
        for e in chosen:
            if e.path.is_dir() and not e.path.is_symlink():
                shutil.copytree(e.path, out / e.key, symlinks=True)
            else:
                (out / e.key).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(e.path, out / e.key, follow_symlinks=False)
    use = "extract it and use that directory" if out.name.endswith(_TARBALL_SUFFIXES) else "use it"
    print(f"exported {len(chosen)} entries ({human_bytes(sum(e.size_bytes for e in chosen))}) to {out}; "
          f"on the other machine, {use} as cache.dir (or $KILN_CACHE_DIR)")
    return 0


def cmd_clear(root: Path, key: Optional[str]) -> int:
    found = entries(root)
    if key is None:
        chosen = found
        _remove_leftovers(root)
    else:
        entry = _choose(found, key)
        if entry is None:
            return 1
        chosen = [entry]
    for e in chosen:
        if e.path.is_dir() and not e.path.is_symlink():
            shutil.rmtree(e.path)
        else:
            e.path.unlink()
    print(f"removed {len(chosen)} entries ({human_bytes(sum(e.size_bytes for e in chosen))}) from {root}")
    return 0


def _remove_leftovers(root: Path) -> None:
    """Hidden children of the kinds' directories: entries a process was writing when it died."""
    for kind in KINDS:
        kind_dir = root / kind
        if kind_dir.is_dir():
            for path in kind_dir.iterdir():
                if path.name.startswith(".") and path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)


ACTIONS: dict[str, Callable[[Path, Optional[str]], int]] = {
    "ls": cmd_ls, "inspect": cmd_inspect, "clear": cmd_clear, "export": cmd_export,
}


def main(args: list[str]) -> int:
    """``args`` after ``kiln cache``: the action, an optional KEY, then Hydra overrides (``key=value``)."""
    if any(a in ("-h", "--help") for a in args):
        print(USAGE)
        return 0
    positional = [a for a in args if "=" not in a]
    overrides = [a for a in args if "=" in a]
    if not positional or positional[0] not in ACTIONS or len(positional) > 2:
        print(f"kiln: error: expected an action, one of {list(ACTIONS)}\n{USAGE}", file=sys.stderr)
        return 2
    root = Path(_cache_config(overrides).resolved_dir).expanduser()
    return ACTIONS[positional[0]](root, positional[1] if len(positional) > 1 else None)


def _cache_config(overrides: list[str]):
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from kiln.entrypoints.cli_config import compose_config, fail

    try:
        return compose_config(overrides).cache
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        fail(first_line(exc))
