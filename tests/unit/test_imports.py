"""slimtune's import graph has no cycle, hidden or not: every import statement counts (inside
functions and under TYPE_CHECKING too), and so do the engine modules slimtune.engines imports by
discovery. A cycle would mean a layer that cannot be read, tested or imported on its own."""

import ast
from pathlib import Path

import slimtune

ROOT = Path(slimtune.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    edges = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package up
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            edges[name] |= {t for t in targets if t in modules and t != name}
    # slimtune.engines imports every module beside it (pkgutil discovery), not seen by ast.
    engines = ROOT / "engines"
    edges["slimtune.engines"] |= {f"slimtune.engines.{p.stem}" for p in engines.glob("*.py")
                                  if p.stem not in ("__init__", "base", "registry")}
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_graph_has_no_cycle():
    edges = graph()
    assert edges["slimtune.train"] >= {"slimtune.assembly", "slimtune.planning.planner"}  # the scan sees real edges
    cycle = find_cycle(edges)
    assert cycle is None, " -> ".join(cycle)


def test_a_cycle_would_be_found():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
