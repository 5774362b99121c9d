"""The package's import structure: one-way, counting imports inside functions.

Layers, bottom up, one per folder: the IR, the errors, helpers and devices; the registry; staging, transforms and
the interpreters; the op families that fill the registry; planning and data parallel; the runtime (executable <
staged); the front ends (api, then lazymode, then the integrations), so that a budget goes down from the front
ends (jit, memory, lazy) and never back up.
A module may import only from its own layer or below, and no two modules import each other, directly or not.
Imports inside functions count; imports under ``if TYPE_CHECKING:`` (annotations only) do not.
Inside a package the order of its modules is checked too (PACKAGE_LAYERS, below), counting annotations and the
methods a module calls on the session object.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import stagetorch

PACKAGE = pathlib.Path(stagetorch.__file__).parent

# Lower number = lower layer, keyed by the package's folders (a top-level module by its own name): the folder
# listing is the architecture. docs/architecture.md draws its map from this table.
LAYERS = {
    "errors": 0, "ir": 0, "utils": 0, "devices": 0,
    "registry": 1,
    "staging": 2, "transforms": 2, "interpreters": 2,
    "ops": 3,
    "planning": 4, "parallel": 4,
    "runtime": 5,
    "api": 6,
    "lazymode": 7,
    "demo": 8, "integrations": 8,
    "__init__": 9, "__main__": 9,
}


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: pathlib.Path) -> set[str]:
    """Every stagetorch module ``path`` imports, at any depth of the file (functions included)."""
    own = _module_name(path).split(".")
    package = own if path.name == "__init__.py" else own[:-1]
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    # Imports under ``if TYPE_CHECKING:`` never run: they are annotations, not dependencies.
    typing_only = {
        id(n) for block in ast.walk(tree)
        if isinstance(block, ast.If) and getattr(block.test, "id", getattr(block.test, "attr", "")) == "TYPE_CHECKING"
        for stmt in block.body for n in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
            target = [*base, *(node.module.split(".") if node.module else [])]
            names = [".".join([*target, a.name]) for a in node.names] if not node.module else []
            found.add(".".join(target))
            found.update(n for n in names if (PACKAGE / n.replace(".", "/")).with_suffix(".py").exists()
                         or (PACKAGE / n.replace(".", "/")).is_dir())
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("stagetorch"):
            found.add(node.module.removeprefix("stagetorch").lstrip("."))
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix("stagetorch").lstrip(".") for a in node.names if a.name.startswith("stagetorch"))
    return {f for f in found if f and f != _module_name(path)}


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def _layer(module: str) -> int:
    top = module.split(".")[0] or "__init__"
    return LAYERS[top]


def test_no_import_cycle():
    graph = _graph()
    # A package's __init__ importing its own submodules is how it is assembled, not a cycle in the code.
    edges = {m: {d for d in deps if not (d.startswith(m + ".") or m.startswith(d + ".") and d in ("", "ops"))}
             for m, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(edges.get(m, ())):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(d):], d]))
            if d in edges and state.get(d) is None:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if state.get(m) is None:
            visit(m)


def test_imports_go_down_the_layers():
    graph = _graph()
    wrong = [
        f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})"
        for m, deps in graph.items() for d in deps
        if _layer(d) > _layer(m)
    ]
    assert not wrong, "\n".join(wrong)


def test_no_public_function_shadows_a_submodule():
    submodules = {p.stem for p in PACKAGE.glob("*.py")} | {p.name for p in PACKAGE.iterdir() if p.is_dir()}
    shadowed = [n for n in stagetorch.__all__ if n in submodules and callable(getattr(stagetorch, n))
                and not isinstance(getattr(stagetorch, n), type(stagetorch))]
    assert not shadowed, f"public names that hide a submodule of the same name: {shadowed}"


def test_the_checker_finds_a_cycle(tmp_path, monkeypatch):
    """The cycle test itself can fail: a graph with a cycle through a function-level import is caught."""
    fake = tmp_path / "stagetorch"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "ir.py").write_text("def f():\n    from .api import g\n")
    (fake / "api.py").write_text("from .ir import f\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    try:
        test_no_import_cycle()
    except AssertionError as e:
        assert "ir" in str(e) and "api" in str(e)
    else:
        raise AssertionError("the cycle ir -> api -> ir went unnoticed")


def test_import_stagetorch_imports_no_optional_extra():
    """In a fresh interpreter, ``import stagetorch`` (and its integrations package) loads none of the optional
    extras' packages: the library works without matplotlib, transformers, accelerate or lightning."""
    optional = {"matplotlib", "transformers", "accelerate", "lightning", "pytorch_lightning"}
    code = (
        "import sys, stagetorch, stagetorch.integrations; "
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {optional!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"import stagetorch imported {out.strip()}"


# Inside a package: its modules' order, bottom up (a module not listed is an error: place it). Here a
# dependency is an import (at any depth, and under ``if TYPE_CHECKING:`` too: an annotation naming a class
# says the module is written against it), or a call of a method on the session object (``self.`` in a mixin,
# ``session.``, ``x._session.``) that is first declared in another module's class: a mixin calling a method
# only a higher layer defines calls up, however it was imported. A higher layer reaches down by overriding a
# method declared below (the session's interface, declared in ``tensor``).
PACKAGE_LAYERS = {
    "utils": {"caches": 0, "collector": 0, "tree": 0, "__init__": 1},
    "devices": {"budget": 0, "cuda_allocator": 0, "catalog": 1, "__init__": 2},
    "staging": {
        "source": 0, "host_reads": 0, "meta_cache": 0, "grads": 0, "messages": 1, "state": 1,
        "recorder": 2, "guards": 2, "tracer": 3, "__init__": 4,
    },
    "transforms": {"schedule": 0, "rng": 0, "batch_norm_sums": 0, "remat": 1, "commit": 1, "__init__": 2},
    "interpreters": {
        "shape_rules": 0, "shapes": 0, "flops": 0, "batching": 0, "undo": 0, "batch_rules": 1, "eager": 1, "memory": 1, "chunked": 2,
        "__init__": 3,
    },
    "planning": {
        "budget": 0, "chunks": 1, "remat_simulator": 0, "cut": 2, "remat_frontier": 1, "remat_search": 2, "reserved": 2,
        "multipass": 3, "plans": 4, "planner": 5, "__init__": 6,
    },
    "parallel": {"fsdp": 0, "data_parallel": 1, "__init__": 2},
    "runtime": {"grads": 0, "plan_log": 0, "executable": 1, "staged": 2, "fit": 3, "__init__": 4},
    "lazymode": {
        "mode": 0, "shard": 0, "draws": 0,
        "tensor": 1, "autograd_graph": 2, "recording": 3, "tape": 4, "replay": 4, "express": 5, "backward": 6,
        "session": 7, "__init__": 8,
    },
}

# The packages built as mixins of one session object: there a call of a session method is a dependency too.
SESSION_PACKAGES = {"lazymode"}

# The names a package's code calls its session object by.
_SESSION_NAMES = {"self", "session"}


def _package_modules(package: str) -> dict[str, pathlib.Path]:
    return {p.stem: p for p in sorted((PACKAGE / package).glob("*.py"))}


def _package_imports(path: pathlib.Path, package: str, modules: set[str]) -> set[str]:
    """The modules of ``package`` that ``path`` (one of them) imports, TYPE_CHECKING imports included."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                target = node.module
            elif node.level == 0 and (node.module or "").startswith(f"stagetorch.{package}"):
                target = node.module.removeprefix(f"stagetorch.{package}").lstrip(".")
            else:
                continue
            if target:
                found.add(target.split(".")[0])
            else:  # ``from . import x``: the submodule x, or a name the package's __init__ defines
                found.update(a.name if a.name in modules else "__init__" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(
                a.name.split(".")[2] for a in node.names if a.name.startswith(f"stagetorch.{package}.")
            )
    return found - {path.stem}


def _is_session(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id in _SESSION_NAMES) or (
        isinstance(node, ast.Attribute) and node.attr == "_session"
    )


def _package_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it depends on: its imports, and for each method it calls on the
    session object, the lowest module (in PACKAGE_LAYERS) whose classes define a method of that name."""
    modules = _package_modules(package)
    layers = PACKAGE_LAYERS.get(package, {})
    trees = {m: ast.parse(p.read_text()) for m, p in modules.items()}
    defined: dict[str, list[str]] = {}
    for m, tree in trees.items():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for f in cls.body:
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    defined.setdefault(f.name, []).append(m)
    # A name the code assigns on the session (``self.metas = ...``) is its state, whatever a class calls a method.
    state = {
        n.attr for tree in trees.values() for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and _is_session(n.value)
    }
    graph = {}
    for m, tree in trees.items():
        deps = _package_imports(modules[m], package, set(modules))
        if package not in SESSION_PACKAGES:
            graph[m] = deps - {m}
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute) and _is_session(node.value) and node.attr in defined
                and node.attr not in state
            ):
                owners = defined[node.attr]
                if m not in owners:
                    deps.add(min(owners, key=lambda o: (layers.get(o, len(layers)), o)))
        graph[m] = deps - {m}
    return graph


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(edges.get(m, ())):
            if state.get(d) == 1:
                return [*stack[stack.index(d):], d]
            if d in edges and state.get(d) is None and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if state.get(m) is None and (found := visit(m)):
            return found
    return None


def _packages() -> list[str]:
    return sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))


def test_no_cycle_inside_packages():
    """No two modules of a package depend on each other, directly or not, counting annotations and the
    session methods a module calls."""
    for package in _packages():
        graph = _package_graph(package)
        # The package's __init__ importing its modules is how it is assembled.
        graph.pop("__init__", None)
        cycle = _cycle(graph)
        assert cycle is None, f"stagetorch.{package}: dependency cycle " + " -> ".join(cycle)


def test_dependencies_go_down_the_layers_inside_packages():
    for package, layers in PACKAGE_LAYERS.items():
        graph = _package_graph(package)
        unplaced = sorted(set(graph) - set(layers))
        assert not unplaced, f"stagetorch.{package}: modules without a layer in PACKAGE_LAYERS: {unplaced}"
        wrong = [
            f"{package}.{m} (layer {layers[m]}) depends on {package}.{d} (layer {layers[d]})"
            for m, deps in sorted(graph.items()) for d in sorted(deps) if layers[d] > layers[m]
        ]
        assert not wrong, "\n".join(wrong)


def test_the_package_checker_sees_annotations_and_session_calls(tmp_path, monkeypatch):
    """The package checks can fail: an import under TYPE_CHECKING and a mixin's call of a method that only a
    higher module defines are dependencies."""
    fake = tmp_path / "stagetorch"
    (fake / "pkg").mkdir(parents=True)
    (fake / "pkg" / "__init__.py").write_text("")
    (fake / "pkg" / "low.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .high import High\n"
        "class Low:\n    def run(self):\n        return self.finish()\n"
    )
    (fake / "pkg" / "mid.py").write_text("class Mid:\n    def go(self, session):\n        session.finish()\n")
    (fake / "pkg" / "high.py").write_text("from .low import Low\nclass High(Low):\n    def finish(self):\n        pass\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    monkeypatch.setattr(__import__(__name__), "PACKAGE_LAYERS", {"pkg": {"low": 0, "mid": 1, "high": 2, "__init__": 3}})
    monkeypatch.setattr(__import__(__name__), "SESSION_PACKAGES", {"pkg"})
    assert _package_graph("pkg") == {"__init__": set(), "low": {"high"}, "mid": {"high"}, "high": {"low"}}
    for test in (test_no_cycle_inside_packages, test_dependencies_go_down_the_layers_inside_packages):
        try:
            test()
        except AssertionError as e:
            assert "low" in str(e) and "high" in str(e)
        else:
            raise AssertionError(f"{test.__name__} missed low -> high")


def _private_imports(path: pathlib.Path) -> list[str]:
    """``from .x import _y`` (or ``from stagetorch.x import _y``) in ``path``: a private name of another module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom) or node.module == "__future__":
            continue
        if not (node.level or (node.module or "").startswith("stagetorch")):
            continue
        for a in node.names:
            # ``from . import _mode``-style imports of a module are not private names of another module.
            if a.name.startswith("_") and not a.name.startswith("__"):
                found.append(f"{_module_name(path)}:{node.lineno}: from {'.' * node.level}{node.module or ''} import {a.name}")
    return found


def test_no_private_name_is_imported_across_modules():
    """What two modules share is public in the lower one: no module imports another's ``_private`` name."""
    wrong = [line for p in sorted(PACKAGE.rglob("*.py")) for line in _private_imports(p)]
    assert not wrong, "private names imported across modules:\n" + "\n".join(wrong)


def test_the_private_import_check_can_fail(tmp_path, monkeypatch):
    fake = tmp_path / "stagetorch"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "low.py").write_text("_hidden = 1\n")
    (fake / "high.py").write_text("from .low import _hidden\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    try:
        test_no_private_name_is_imported_across_modules()
    except AssertionError as e:
        assert "high:1: from .low import _hidden" in str(e)
    else:
        raise AssertionError("from .low import _hidden went unnoticed")


def test_the_architecture_page_draws_the_same_layers():
    """docs/architecture.md's table of layers is LAYERS: each row's layer number and the folders and modules
    it names (in backticks) are exactly the table's, and every entry of the table is on the page."""
    page = (pathlib.Path(__file__).parents[2] / "docs" / "architecture.md").read_text()
    drawn: dict[str, int] = {}
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].isdigit():
            for name in cells[1].split("`")[1::2]:
                drawn[name] = int(cells[0])
    assert drawn == LAYERS
