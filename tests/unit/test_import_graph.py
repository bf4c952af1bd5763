"""The import graph of xfw/, computed from the code, has no circle.

Edges count every import of an xfw module a file makes: at module level AND inside functions (a deferred
import is still a dependency; deferring it only hides a circle from Python, not from a reader). ``from
xfw.a import b`` counts as an edge to the module ``xfw.a.b`` when that is a module, else to ``xfw.a``.
A package's ``__init__`` is a node like any other module.
"""

import ast

from conftest import ROOT

# Circles another issue is removing right now; each entry names the modules of one circle. Empty: none is allowed.
KNOWN: set[frozenset[str]] = set()


def _modules() -> dict[str, object]:
    found = {}
    for path in (ROOT / "xfw").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for target in targets:
                while target and target not in modules:  # xfw.a.b.attr -> the module that holds it
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1
        stack.append(root); on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]; counter[0] += 1
                    stack.append(nxt); on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop(); on_stack.discard(member); component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(component)
    return out


def test_the_graph_sees_function_level_and_package_imports():
    graph = import_graph()
    assert "xfw.contract.atomic" in graph and "xfw.cli" in graph
    assert any(graph.values())


def test_the_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_of_xfw_has_no_circle():
    found = [sorted(c) for c in circles(import_graph()) if frozenset(c) not in KNOWN]
    assert found == []
