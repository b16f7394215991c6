"""No import cycles among the project's modules, lazy (function-level) imports included.

The project installs one namespace from three folders (pyproject's package-dir): python/pagedweight,
sgl-kernel-ext (pagedweight.kernels) and patches (pagedweight.patches). Every `import` / `from ... import` of a
project module anywhere in a file, inside functions too, is an edge; a strongly connected component of more than
one module is a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"pagedweight": "python/pagedweight", "pagedweight.kernels": "sgl-kernel-ext",
                "pagedweight.patches": "patches"}


def project_modules() -> dict[str, Path]:
    mods = {}
    for pkg, folder in PACKAGE_DIRS.items():
        base = ROOT / folder
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([pkg, *parts])] = path
    return mods


def import_edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            edges[mod].update(t for t in targets if t in mods and t != mod)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    u = stack.pop()
                    on_stack.discard(u)
                    comp.append(u)
                    if u == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_cycle_finder_sees_a_lazy_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_project_has_no_import_cycles():
    mods = project_modules()
    assert "pagedweight.kernels.align" in mods and "pagedweight.patches" in mods
    assert cycles(import_edges(mods)) == []


# The modules that may sit at the top of python/pagedweight: the SGLang entry point, the flags and the command line.
TOP_LEVEL = {"pagedweight.plugin", "pagedweight.config", "pagedweight.cli", "pagedweight.__main__"}
# Packages that must run without SGLang (and without the serving side that adapts to it).
SGLANG_FREE = ("pagedweight.runtime", "pagedweight.format", "pagedweight.planner")
SERVING_SIDE = ("sglang", "pagedweight.serving", "pagedweight.kvcache", "pagedweight.patches", "pagedweight.tools")


def imported_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_every_module_sits_in_a_package_that_says_what_it_is():
    loose = sorted(m for m, path in project_modules().items()
                   if m.count(".") == 1 and path.name != "__init__.py" and m not in TOP_LEVEL
                   and m not in ("pagedweight.kernels", "pagedweight.patches"))
    assert not loose, f"modules loose at the top of python/pagedweight (move them into a package): {loose}"


def test_the_core_imports_neither_sglang_nor_the_serving_side():
    leaks = {}
    for mod, path in project_modules().items():
        if mod.startswith(SGLANG_FREE):
            bad = sorted(n for n in imported_names(path) if n == "sglang" or n.startswith(tuple(f"{s}." for s in SERVING_SIDE)) or n in SERVING_SIDE)
            if bad:
                leaks[mod] = bad
    assert not leaks, f"SGLang-free packages import the serving side: {leaks}"
