"""The shape of the package: one import name, no import circles, rooms that import downwards only,
a CLI that starts without loading torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = {
    "cag": "cag",
    "store": "cag.store",
    "api": "cag.api",
    "cli": "cag.cli",
    "rag": "cag.rag",
    "compare": "cag.compare",
}


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, pkg in FOLDERS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            dotted = ".".join((pkg, *path.relative_to(REPO / folder).with_suffix("").parts))
            mods[dotted.removesuffix(".__init__")] = path
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


# cag's rooms, lowest first: a module imports only from its own room, a lower one, or the shared
# base (config, errors, hashing, results, store); the engine sits above them all.
ROOMS = ("cag.kernels", "cag.model", "cag.runtime", ("cag.knowledge", "cag.answering"), "cag.engine")
BASE = ("cag.config", "cag.errors", "cag.hashing", "cag.results", "cag.store")


def _rank(module: str) -> int | None:
    for i, room in enumerate(ROOMS):
        for r in (room if isinstance(room, tuple) else (room,)):
            if module == r or module.startswith(r + "."):
                return i
    return None


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """The imports in `graph` (module -> modules it imports) that point into a higher room of cag, or
    sideways into another room of the same rank."""
    wrong = []
    for name, deps in sorted(graph.items()):
        if _rank(name) is None:
            continue
        for dep in sorted(deps):
            if dep.startswith(BASE) or dep == "cag":
                continue
            rank = _rank(dep)
            if (
                rank is None
                or rank > _rank(name)
                or (rank == _rank(name) and dep.split(".")[:2] != name.split(".")[:2])
            ):
                wrong.append(f"{name} -> {dep}")
    return wrong


def test_the_rooms_of_cag_point_down():
    mods = _modules()
    assert {_rank(m) for m in mods if _rank(m) is not None} == set(range(len(ROOMS))), (
        "a room is empty: the walk is broken"
    )
    assert _upward({name: _imports(name, path, set(mods)) for name, path in mods.items()}) == []


def test_the_room_check_sees_an_upward_or_sideways_import():
    graph = {"cag.model.weights": {"cag.kernels.native", "cag.errors", "cag.runtime.step"},
             "cag.knowledge.ingest": {"cag.runtime.kv_cache", "cag.answering.chat", "cag.store.index"},
             "cag.kernels.native": {"cag.engine"}}
    assert _upward(graph) == ["cag.kernels.native -> cag.engine", "cag.knowledge.ingest -> cag.answering.chat",
                              "cag.model.weights -> cag.runtime.step"]


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


def test_every_room_of_cag_is_packaged():
    """A non-editable install carries only the packages pyproject lists: every folder of cag/ with an
    __init__.py is one of them, and the kernels' C++ sources travel as package data."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    rooms = {"cag." + p.parent.name for p in (REPO / "cag").glob("*/__init__.py")}
    assert rooms and rooms <= set(project["packages"])
    kernels = REPO / "cag" / "kernels"
    shipped = {f for glob in project["package-data"]["cag.kernels"] for f in kernels.glob(glob)}
    sources = {f for f in kernels.rglob("*") if f.suffix in (".cpp", ".h")}
    assert sources and sources <= shipped, f"kernel sources not in the wheel: {sorted(map(str, sources - shipped))}"


# Where a kernel's name may appear as a string: the backends themselves, the library that builds and
# resolves them, the one resolver at load, and the setting's declaration.
KERNEL_NAMES = {"amx", "avx512", "avx2"}
RESOLVERS = {"cag.kernels.backends", "cag.kernels.native", "cag.model.loading", "cag.config"}


def _kernel_names(path: Path) -> list[int]:
    """Lines of `path` whose code holds a kernel's name as a string (docstrings and comments aside)."""
    tree = ast.parse(path.read_text(), str(path))
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and n.value in KERNEL_NAMES and id(n) not in docs]


def test_kernel_names_are_compared_only_where_the_backend_is_resolved():
    """What a model decodes on is a Backend object (cag.kernels.backends): no module outside the resolvers
    compares or passes a kernel's name as a string."""
    found = {
        name: lines for name, path in _modules().items() if name not in RESOLVERS and (lines := _kernel_names(path))
    }
    assert not found, f"kernel names as strings outside cag.kernels.backends: {found}"


def test_the_kernel_name_check_sees_a_string(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('"""Runs on "avx2" CPUs."""\nif mode == "avx2":\n    pass\n')
    assert _kernel_names(bad) == [2]


# knowledge/ and answering/ take what they use (an index, a model, settings, a SnapshotSetup, a callable), never
# the Engine: an `engine` parameter there would let them read any of its members and call back up into it,
# which the import walk above cannot see.
BELOW_THE_ENGINE = ("cag.knowledge", "cag.answering")


def _engine_uses(path: Path) -> list[str]:
    """`engine` parameters, and members of anything named engine read by a private name, in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg)))]
            found += [f"line {node.lineno}: parameter {n!r}" for n in names if "engine" in n.lower()]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", "")
            if "engine" in owner.lower():
                found.append(f"line {node.lineno}: {owner}.{node.attr}")
    return sorted(found, key=lambda f: int(f.split()[1].rstrip(":")))


def test_knowledge_and_answering_never_take_the_engine():
    mods = {name: path for name, path in _modules().items() if name.startswith(BELOW_THE_ENGINE)}
    assert "cag.answering.questions" in mods and "cag.knowledge.ingest" in mods, "the walk is broken"
    found = {name: uses for name, path in mods.items() if (uses := _engine_uses(path))}
    assert not found, f"the Engine passed below it (take the index, model, settings it uses): {found}"


def test_the_engine_check_sees_a_parameter_and_a_private_member(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def check(engine, corpus):\n    return engine._layouts()\n\n\n"
                   "def fine(index, model):\n    return self.engine._lm, model._private, lambda engine: 1\n")
    assert _engine_uses(bad) == ["line 1: parameter 'engine'", "line 2: engine._layouts", "line 6: engine._lm",
                                 "line 6: parameter 'engine'"]
