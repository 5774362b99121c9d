"""The package's import structure: one-way, counting imports inside functions.

Layers, bottom up: the IR and helpers; the registry; the interpreters (tracing, shapes, costing, batching,
execute, chunking, planning); the op families that fill the registry; the front ends (jit, memory, lazy).
A module may import only from its own layer or below, and no two modules import each other, directly or not.
Imports inside functions count; imports under ``if TYPE_CHECKING:`` (annotations only) do not.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import stagetorch

PACKAGE = pathlib.Path(stagetorch.__file__).parent

# Lower number = lower layer. A module not listed sits in the layer of its package's entry.
LAYERS = {
    "errors": 0, "_gc": 0, "_caches": 0, "_tree": 0, "ir": 0, "devices": 0,
    "registry": 1,
    "tracing": 2, "guards": 2, "shapes": 2, "costing": 2, "batching": 2, "execute": 2, "passes": 2, "remat": 2, "rng": 2, "flops": 2,
    "chunking": 3, "planning": 4, "remat_planning": 4,
    "ops": 5, "distributed": 5,
    "api": 6, "lazymode": 7, "lazy": 7, "demo": 8, "integrations": 8, "__init__": 9, "__main__": 9,
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
