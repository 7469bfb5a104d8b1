"""The shape of the package: one import name, no import circles, small engine modules, a CLI that
starts without loading torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDERS = {"cag": "cag", "store": "cag.store", "api": "cag.api", "cli": "cag.cli", "rag": "cag.rag", "compare": "cag.compare"}


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, pkg in FOLDERS.items():
        for path in sorted((REPO / folder).glob("*.py")):
            mods[pkg if path.stem == "__init__" else f"{pkg}.{path.stem}"] = path
    return mods


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module of the package that `name` imports, at any depth of its code (lazy imports
    inside functions and TYPE_CHECKING blocks count: they are circles all the same)."""
    is_pkg = path.stem == "__init__"
    base = name if is_pkg else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = base.rsplit(".", node.level - 1)[0] if node.level > 1 else base
                mod = f"{parent}.{node.module}" if node.module else parent
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_another_that_imports_it_back():
    mods = _modules()
    graph = {name: _imports(name, path, set(mods)) for name, path in mods.items()}
    assert graph["cag.engine"], "the import walk found nothing: it is broken"
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_engine_never_imports_the_layers_above_it():
    """Dependency direction: cli/api -> compare -> rag -> engine -> store, nothing pointing back up."""
    mods = _modules()
    above = ("cag.api", "cag.cli", "cag.rag", "cag.compare")
    core = [m for m in mods if not m.startswith(above) and m != "cag.__main__"]  # the engine and cag.store
    assert "cag.engine" in core and "cag.store.index" in core
    for name in core:
        assert not {m for m in _imports(name, mods[name], set(mods)) if m.startswith(above)}, name
    for name in (m for m in mods if m.startswith("cag.store")):
        assert "cag.engine" not in _imports(name, mods[name], set(mods)), name


def test_engine_modules_stay_small():
    sizes = {p.name: len(p.read_text().splitlines()) for p in (REPO / "cag").glob("*.py")}
    assert {name: n for name, n in sizes.items() if n > 300} == {}


def test_the_cli_starts_without_torch():
    code = ("import sys, cag.cli.main; heavy = [m for m in ('torch', 'transformers', 'fastapi', 'safetensors') "
            "if m in sys.modules]; print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_only_one_import_name_is_installed():
    from importlib.metadata import distribution

    top = distribution("cag").read_text("top_level.txt")
    if top is not None:  # editable installs of some setuptools versions write none
        assert top.split() == ["cag"]
    out = subprocess.run([sys.executable, "-c", "import api"], capture_output=True, text=True, cwd="/")
    assert out.returncode != 0 and "No module named 'api'" in out.stderr
