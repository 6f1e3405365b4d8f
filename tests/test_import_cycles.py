"""No import circles in ``hf_kvreuse/``: each package reads top-down.

What counts as an edge ``A -> B``: any ``import`` / ``from ... import`` in module ``A`` that names module ``B`` of the
package, **function-local imports included** (a lazy import hides a circle from the interpreter, not from the
reader: the five circles this test was written against were all function-local on one side). ``from . import x``
names the module ``x``; ``from .m import name`` names ``m``; ``from hf_kvreuse import X`` names the package's
``__init__``. Not an edge: a module's implicit dependency on its parent packages' ``__init__`` (Python imports the
parents first whatever the module says; counting it would make every subpackage a circle with the top level).
Circles are the strongly connected components of that graph with more than one module.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "hf_kvreuse"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PKG) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}`` for every ``.py`` under ``root``."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    top = root.name
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            named = []
            if isinstance(node, ast.Import):
                named = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                named = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for name in named:
                if not (name == top or name.startswith(top + ".")):
                    continue
                while name not in files and "." in name:  # an attribute of a module: the module
                    name = name.rpartition(".")[0]
                if name in files and name != mod:
                    graph[mod].add(name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_the_check_finds_a_function_local_circle(tmp_path):
    """Planted bug: two modules that import each other, one of them inside a function, and a three-module circle
    through a package ``__init__``; a parent-package import alone is no circle."""
    pkg = tmp_path / "hf_kvreuse"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .c import C\n")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("def f():\n    from .a import g\n")
    (pkg / "c.py").write_text("from .sub import leaf\nC = 1\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "leaf.py").write_text("from hf_kvreuse import C\n")
    (pkg / "sub" / "ok.py").write_text("from .. import a\n")
    found = circles(import_graph(pkg))
    assert ["hf_kvreuse.a", "hf_kvreuse.b"] in found
    assert ["hf_kvreuse", "hf_kvreuse.c", "hf_kvreuse.sub.leaf"] in found
    assert len(found) == 2


def test_no_import_circles_in_hf_kvreuse():
    graph = import_graph()
    assert len(graph) > 50 and graph["hf_kvreuse.rope"], "the graph reads the package"
    found = circles(graph)
    assert not found, "import circles (function-local imports count): " + "; ".join(" <-> ".join(c) for c in found)
