"""The package's import graph: layers point down, and no module imports itself back.

Read from the source (``ast``), so lazy imports inside functions count as much as module-level
ones: a cycle through a function-level import is still a cycle in the design. Layers, from
``docs/architecture.md``::

    entrypoints, bench -> engine -> runtime -> compiler -> passes, models -> ops -> config, forward_context, ...

A module may import its own package and anything in a lower layer, never a higher one, and never a
sibling package of its own layer (passes and models stay independent); ``entrypoints`` and
``bench`` are the top and may use each other.

The tests mirror the package: ``tests/<subpackage>/`` holds the tests of ``kiln/<subpackage>/``,
only the tests of kiln's top-level modules (and of the import graph and packaging) sit at the top
of ``tests/``, and a test file never imports another: what several share is in ``tests/helpers/``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kiln

ROOT = Path(kiln.__file__).parent
TESTS = Path(__file__).resolve().parent
# Directories of tests/ that mirror nothing in kiln/: shared helpers, data files, the end-to-end tests.
NOT_MIRRORED = {"helpers", "data", "e2e"}
# The test files at the top of tests/: kiln's top-level modules (config.py; _C, built from csrc/),
# the import graph (this file) and packaging.
TOP_LEVEL_TESTS = {"test_config_defaults.py", "test_csrc_messages.py", "test_import_graph.py", "test_packaging.py"}
LEAVES = ("clock", "config", "errors", "forward_context", "lora_request", "outputs", "progress", "sampling_params", "version", "_C")  # _C: the C++ extension
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


# ---- the tests' layout -------------------------------------------------------------------------------
def _unmirrored_dirs(tests: Path = TESTS) -> list[str]:
    """Directories under ``tests`` (but caches and the trees of ``NOT_MIRRORED``) that mirror no
    kiln package."""
    dirs = (d.relative_to(tests) for d in tests.rglob("*") if d.is_dir() and not d.name.startswith((".", "__")))
    return sorted(str(d) for d in dirs if d.parts[0] not in NOT_MIRRORED and not (ROOT / d / "__init__.py").is_file())


def _stray_top_level_tests(tests: Path = TESTS) -> list[str]:
    return sorted({p.name for p in tests.glob("test_*.py")} - TOP_LEVEL_TESTS)


def _imported_test_files(path: Path) -> set[str]:
    """The test files (``test_*`` modules) that ``path`` imports, under any name."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names = [base] + [f"{base}.{a.name}" if node.module else base + a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            first = next((i for i, part in enumerate(parts) if part.startswith("test_")), None)
            if first is not None:
                found.add(".".join(parts[:first + 1]))
    return found


def test_test_directories_mirror_kiln():
    unmirrored = _unmirrored_dirs()
    assert not unmirrored, f"test directories named after no kiln subpackage: {unmirrored}"


def test_only_tests_of_top_level_modules_sit_at_the_top():
    stray = _stray_top_level_tests()
    assert not stray, f"move into the tests/ directory of the subpackage they test: {stray}"


def test_no_test_file_imports_another():
    wrong = {str(p.relative_to(TESTS)): sorted(_imported_test_files(p)) for p in TESTS.rglob("*.py")}
    wrong = {path: names for path, names in wrong.items() if names}
    assert not wrong, f"test files imported (share through tests/helpers/ instead): {wrong}"


def test_the_layout_checker_sees_stray_dirs_files_and_imports(tmp_path):
    """The layout checks above could pass vacuously; show they catch what they look for."""
    for d in ("ops", "entrypoints/openai", "helpers/deep", "e2e", "nothing", "runtime/nothing", "__pycache__"):
        (tmp_path / d).mkdir(parents=True)
    for f in ("test_config_defaults.py", "test_scheduler.py", "helpers.py"):
        (tmp_path / f).write_text("")
    assert _unmirrored_dirs(tmp_path) == ["nothing", "runtime/nothing"]
    assert _stray_top_level_tests(tmp_path) == ["test_scheduler.py"]
    src = tmp_path / "test_a.py"
    # "from " and "test_server" apart, so that grepping tests/ for test-to-test imports finds none here.
    src.write_text("import tests.ops.test_b\nfrom " "test_server import x\nfrom tests.models import test_models\n"
                   "def f():\n    from .test_c import y\nfrom tests.helpers.server import serve\n")
    assert _imported_test_files(src) == {"tests.ops.test_b", "test_server", "tests.models.test_models", ".test_c"}
