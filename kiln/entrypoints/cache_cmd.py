"""``kiln cache``: what kiln keeps on disk, and removing it.

    kiln cache ls [cache.dir=...]              every entry: key, size, age
    kiln cache clear [KEY] [cache.dir=...]     remove one entry (its key or, if unique, its name), or all

The cache directory is ``CacheConfig.resolved_dir`` ($KILN_CACHE_DIR or ~/.cache/kiln by default)::

    <dir>/models/<name>/     converted models (Hugging Face directories)
    <dir>/compile/<name>/    compiled artifacts

An entry is one child of a kind directory (``KINDS``) and its key is ``<kind>/<name>``. Only those
kinds are listed or removed, so a mistyped ``cache.dir`` (say, a home directory) loses nothing.
Each action is one function in ``ACTIONS``; ``inspect`` or ``export`` join the same way.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

KINDS = ("models", "compile")
USAGE = "usage: kiln cache <ls | clear [KEY]> [cache.dir=PATH] [other overrides]"


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
            for path in sorted(kind_dir.iterdir()):
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
        print(f"  {e.key:<{width}}  {human_bytes(e.size_bytes):>10}  {human_age(now - e.modified)}")
    print(f"{len(found)} entries, {human_bytes(sum(e.size_bytes for e in found))}")
    return 0


def cmd_clear(root: Path, key: Optional[str]) -> int:
    found = entries(root)
    chosen = found if key is None else [e for e in found if key in (e.key, e.path.name)]
    if key is not None and len(chosen) != 1:
        what = "matches several entries" if chosen else "is not in the cache"
        keys = [e.key for e in (chosen or found)] or ["(empty)"]
        print(f"kiln: error: {key!r} {what}; choose one of {keys}", file=sys.stderr)
        return 1
    for e in chosen:
        if e.path.is_dir() and not e.path.is_symlink():
            shutil.rmtree(e.path)
        else:
            e.path.unlink()
    print(f"removed {len(chosen)} entries ({human_bytes(sum(e.size_bytes for e in chosen))}) from {root}")
    return 0


ACTIONS: dict[str, Callable[[Path, Optional[str]], int]] = {"ls": cmd_ls, "clear": cmd_clear}


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

    from kiln.entrypoints.cli import compose_config, fail

    try:
        return compose_config(overrides).cache
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        fail(str(exc).strip().splitlines()[0])
