"""The package's import graph: layers point down, and no module imports itself back.

Read from the source (``ast``), so lazy imports inside functions count as much as module-level
ones: a cycle through a function-level import is still a cycle in the design. Layers, from
``docs/architecture.md``::

    entrypoints, bench -> engine -> runtime -> compiler -> passes, models -> ops -> config, forward_context, ...

A module may import its own package and anything in a lower layer, never a higher one, and never a
sibling package of its own layer (passes and models stay independent); ``entrypoints`` and
``bench`` are the top and may use each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kiln

ROOT = Path(kiln.__file__).parent
LEAVES = ("clock", "config", "errors", "forward_context", "outputs", "progress", "sampling_params", "version", "_C")  # _C: the C++ extension
LAYERS = {"ops": 1, "passes": 2, "models": 2, "compiler": 3, "runtime": 4, "engine": 5, "entrypoints": 6, "bench": 6}
TOP = 6


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    mods["kiln._C"] = Path("kiln/_C.so")  # built by setup.py; imports nothing of kiln
    return mods


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The kiln module ``name`` refers to (the longest existing prefix), or None outside kiln."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in mods:
            return candidate
        parts.pop()
    return None


def _imports(module: str, path: Path, mods: dict[str, Path]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from kiln.ops import attention` imports the submodule when there is one.
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name, mods)
            if target and target != module:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, mods) if p.suffix == ".py" else set() for m, p in mods.items()}


def _layer(module: str) -> tuple[str, int]:
    parts = module.split(".")
    if len(parts) == 1:
        return "kiln", TOP + 1  # the package root re-exports the public API
    top = parts[1]
    if top in LEAVES:
        return top, 0
    return top, LAYERS[top]


def test_every_package_has_a_layer():
    for module in _graph():
        _layer(module)  # raises KeyError for a package the layers do not name


def test_imports_point_down():
    wrong = []
    for module, targets in _graph().items():
        pkg, level = _layer(module)
        for target in targets:
            tpkg, tlevel = _layer(target)
            same_package = tpkg == pkg
            both_top = level == tlevel == TOP
            if not (same_package or tlevel < level or both_top):
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(sorted(wrong))


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checker_sees_lazy_and_upward_imports(tmp_path, monkeypatch):
    """The checks above could pass vacuously; show they catch what they look for."""
    mods = {"kiln.ops.a": tmp_path / "a.py", "kiln.runtime.b": tmp_path / "b.py", "kiln.ops": tmp_path / "i.py"}
    mods["kiln.ops.a"].write_text("def f():\n    from kiln.runtime.b import g\n")
    assert _imports("kiln.ops.a", mods["kiln.ops.a"], mods) == {"kiln.runtime.b"}
    assert _layer("kiln.ops.a")[1] < _layer("kiln.runtime.b")[1]
