"""scripts/ stands on its own: every script sits on a shelf (a package under scripts/), none imports
tests/, the imports among scripts form no cycle, and every script module imports."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py under scripts/."""
    return {".".join(path.relative_to(ROOT).with_suffix("").parts): path for path in sorted(SCRIPTS.rglob("*.py"))}


def _imported(path: Path, module: str) -> set[str]:
    """Every module a file imports, at any depth (function-level imports too); `from package import
    name` counts `package.name` where that is a module. Relative imports resolve against `module`."""
    names: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _graph() -> dict[str, list[str]]:
    """Script module -> the script modules it imports (packages' __init__ left out: they only document)."""
    modules = _modules()
    scripts = {name for name in modules if not name.endswith("__init__")}
    return {name: sorted(_imported(modules[name], name) & scripts) for name in sorted(scripts)}


def _cycle(graph: dict[str, list[str]]) -> list[str]:
    """One import cycle (its modules, the first repeated at the end), or [] if the graph is a DAG."""
    state: dict[str, str] = {}  # module -> "open" while on the path, "done" after
    path: list[str] = []

    def visit(name: str) -> list[str]:
        state[name] = "open"
        path.append(name)
        for dep in graph[name]:
            if state.get(dep) == "open":
                return path[path.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        state[name] = "done"
        path.pop()
        return []

    for name in graph:
        if name not in state and (found := visit(name)):
            return found
    return []


def test_every_script_sits_on_a_shelf() -> None:
    loose = sorted(p.name for p in SCRIPTS.iterdir() if p.is_file() and p.suffix in (".py", ".sh"))
    assert loose == ["__init__.py"], f"scripts directly under scripts/, not on a shelf: {loose}"
    shelves = sorted(p for p in SCRIPTS.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert shelves, "no shelves under scripts/"
    assert [s.name for s in shelves if not (s / "__init__.py").is_file()] == [], "a shelf is not a package"


def test_no_script_imports_tests() -> None:
    modules = _modules()
    bad = {
        name: sorted(n for n in _imported(path, name) if n == "tests" or n.startswith("tests."))
        for name, path in modules.items()
    }
    assert not {name: names for name, names in bad.items() if names}


def test_the_imports_among_scripts_form_no_cycle() -> None:
    graph = _graph()
    assert any(graph.values()), "no import among scripts found: the resolution is broken"
    assert _cycle(graph) == []


def test_the_cycle_finder_finds_one() -> None:
    assert _cycle({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == ["a", "b", "c", "a"]
    assert _cycle({"a": ["b", "c"], "b": ["c"], "c": []}) == []


def _importable(path: Path) -> bool:
    """Whether every third-party top-level module the file imports is installed here (triton, for one,
    is not on every CPU machine)."""
    tops = {name.split(".")[0] for name in _imported(path, "")} - {"", "scripts", "ledgerserve", "tests"}
    return all(importlib.util.find_spec(top) is not None for top in sorted(tops))


def test_every_script_module_imports() -> None:
    names = [name for name, path in _modules().items() if _importable(path)]
    assert len(names) >= len(_modules()) - 3, "most scripts should import on this machine"
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    done = subprocess.run([sys.executable, "-c", code, *names], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
