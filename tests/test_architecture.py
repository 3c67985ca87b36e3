"""The layer picture of docs/architecture.md, enforced: every `glmkit` import (at module level or
inside a function, since a deferred import is still a dependency) goes to the importer's own layer or
one below, and no chain of imports between modules comes back to where it started."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import glmkit

PACKAGE = Path(glmkit.__file__).parent

# Bottom first. A unit is a top-level module of glmkit or a folder (all the modules in it).
LAYERS = [
    ("base", {"__init__", "inputs", "bounds", "config", "report", "outputs", "seal", "tokenizer", "collectives",
              "comparison", "native_log"}),
    ("kernels", {"kernels"}),
    ("checkpoint", {"checkpoint"}),
    ("model", {"model", "reference"}),
    ("serve", {"serve"}),
    ("parity", {"parity"}),
    ("rl", {"rl"}),
    ("launch", {"launch"}),
    ("commands", {"check", "notebook", "commands", "cli", "__main__"}),
]
LAYER_OF = {unit: i for i, (_, units) in enumerate(LAYERS) for unit in units}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def unit(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def imported(module: str) -> set[str]:
    """The glmkit modules `module` imports (`from glmkit.x import name` counts as glmkit.x.name when
    that is a module, else glmkit.x), and whether it imports `widgets`."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names}
    return {m for m in found if m == "glmkit" or m.startswith(("glmkit.", "widgets"))}


GRAPH = {m: {t for t in imported(m) if t in MODULES and t != m} for m in MODULES}


def test_every_module_has_a_layer():
    assert {unit(m) for m in MODULES} <= set(LAYER_OF), sorted({unit(m) for m in MODULES} - set(LAYER_OF))


def test_no_import_reaches_up_a_layer_and_glmkit_never_imports_widgets():
    upward = [f"{m} ({LAYERS[LAYER_OF[unit(m)]][0]}) imports {t} ({LAYERS[LAYER_OF[unit(t)]][0]})"
              for m in MODULES for t in GRAPH[m] if LAYER_OF[unit(t)] > LAYER_OF[unit(m)]]
    widgets = [f"{m} imports {t}" for m in MODULES for t in imported(m) if t.startswith("widgets")]
    assert upward + widgets == []


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_circle_of_imports():
    assert cycles(GRAPH) == []


def test_the_checks_see_a_circle_and_an_upward_import():
    """The rules above would catch the two shapes they exist for."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert LAYER_OF[unit("glmkit.launch.commands")] > LAYER_OF[unit("glmkit.rl.parallel")] > \
        LAYER_OF[unit("glmkit.collectives")]


def test_the_architecture_page_names_every_layer():
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    for name, units in LAYERS:
        assert f"**{name}**" in page, name
        for u in units - {"__init__", "__main__"}:
            assert re.search(rf"\b{u}\b", page), u
