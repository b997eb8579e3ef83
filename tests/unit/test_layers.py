"""The package's import layers (``[tool.importlinter]`` in pyproject.toml): every module has a
place in them, and no two modules import each other, directly or through others (a cycle), in
the whole package, subpackages included. ``make lint`` runs the layer contracts themselves."""

from __future__ import annotations

import tomllib
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]


def _contracts() -> list[dict[str, object]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    contracts: list[dict[str, object]] = config["contracts"]
    return contracts


def _placed(container: str) -> set[str]:
    for contract in _contracts():
        if contract["containers"] == [container]:
            layers = contract["layers"]
            assert isinstance(layers, list)
            return {name.strip().strip("()") for layer in layers for name in layer.split("|")}
    raise AssertionError(f"no layers contract for {container}")


def test_every_module_has_a_layer() -> None:
    graph = grimp.build_graph("orchestrator")
    for container in ("orchestrator", "orchestrator.engine"):
        children = {m.rsplit(".", 1)[1] for m in graph.find_children(container)}
        missing = children - _placed(container)
        assert not missing, f"add {sorted(missing)} to the layers of {container} in pyproject.toml"


def test_no_module_imports_itself_through_others() -> None:
    graph = grimp.build_graph("orchestrator")  # TYPE_CHECKING and function-local imports too
    modules = sorted(graph.modules)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(start: str) -> None:  # Tarjan's strongly connected components, iteratively
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.find_modules_directly_imported_by(nxt)))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
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
                        cycles.append(sorted(component))

    for module in modules:
        if module not in index:
            visit(module)
    # A package's __init__ importing its own children is not a cycle between modules.
    cycles = [c for c in cycles if not all(m == c[0] or m.startswith(c[0] + ".") for m in c)]
    assert not cycles, f"modules importing each other: {cycles}"
