"""slimtune's imports go down the declared layers and never round a cycle. Every import statement
counts (inside functions and under TYPE_CHECKING too; `from x import y` where y is a module counts
as an import of y), and so do the engine modules slimtune.engines imports by discovery. A module
that imports from a layer above its own, or a cycle, would mean a layer that cannot be read, tested
or imported on its own."""

import ast
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

import slimtune

pytestmark = pytest.mark.quick  # the layers, read from the source: cheap

ROOT = Path(slimtune.__file__).parent

# The layers, bottom to top, each named by the top-level modules and packages of slimtune/ in it
# (a package's submodules sit in its layer). A module may import from its own layer or a lower one.
# The empty slimtune/__init__.py is the ground everything stands on.
LAYERS = (
    ("slimtune", "errors", "units", "local_paths", "config_sources", "config", "progress"),
    ("device",),
    ("dist", "data"),
    ("store",),
    ("model", "presets"),
    ("step", "optim"),
    ("engines",),
    ("assembly",),
    ("planning", "run"),
    ("export", "export_gguf"),
    ("serve", "train"),
    ("cli", "launch", "__main__", "demo"),
)


class Import(NamedTuple):
    importer: str  # the module whose source holds the statement
    line: int
    imported: str  # a slimtune module


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def imports_in(name: str, source: str, known: set[str], is_package: bool = False) -> list[Import]:
    """The slimtune modules that `source` (module `name`'s text) imports, one per target and statement."""
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package up
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        found += [Import(name, node.lineno, t) for t in dict.fromkeys(targets) if t in known and t != name]
    return found


def discovered_engines() -> list[Import]:
    """slimtune.engines imports every engine beside it by pkgutil discovery (a module, or a folder's
    engine.py), which ast does not see."""
    engines = ROOT / "engines"
    found = [f"slimtune.engines.{p.stem}" for p in engines.glob("*.py") if p.stem not in ("__init__", "base", "registry")]
    found += [f"slimtune.engines.{p.parent.name}.engine" for p in engines.glob("*/engine.py")]
    return [Import("slimtune.engines", 0, target) for target in sorted(found)]


def all_imports() -> list[Import]:
    found_modules = modules()
    known = set(found_modules)
    found = discovered_engines()
    for name, path in found_modules.items():
        found += imports_in(name, path.read_text(), known, is_package=path.name == "__init__.py")
    return found


def graph(imports: list[Import]) -> dict[str, set[str]]:
    edges = {name: set() for name in modules()}
    for imp in imports:
        edges[imp.importer].add(imp.imported)
    return edges


def layer_of(module: str) -> int | None:
    top = module.split(".")[1] if "." in module else module
    return next((i for i, names in enumerate(LAYERS) if top in names), None)


def unplaced(names) -> list[str]:
    """Modules in no declared layer (a new top-level module or package must be given one)."""
    return sorted(name for name in names if layer_of(name) is None)


def upward(imports: list[Import]) -> list[str]:
    """Each import of a module in a layer above the importer's, as 'file:line: a (layer i) imports b (layer j)'."""
    found = []
    for imp in imports:
        low, high = layer_of(imp.importer), layer_of(imp.imported)
        if low is not None and high is not None and high > low:
            path = modules()[imp.importer].relative_to(ROOT.parent)
            found.append(f"{path}:{imp.line}: {imp.importer} (layer {low}) imports {imp.imported} (layer {high})")
    return found


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


def test_every_module_has_a_layer():
    assert unplaced(modules()) == []


def test_imports_go_down_the_layers():
    imports = all_imports()
    assert {("slimtune.train", "slimtune.assembly"), ("slimtune.engines", "slimtune.engines.slide.engine")} <= {
        (imp.importer, imp.imported) for imp in imports}  # the scan sees real edges, discovered ones too
    violations = upward(imports)
    assert violations == [], "imports from a higher layer:\n" + "\n".join(violations)


def test_the_import_graph_has_no_cycle():
    cycle = find_cycle(graph(all_imports()))
    assert cycle is None, " -> ".join(cycle)


def test_an_upward_import_would_be_found():
    """device/memory.py (layer 1) importing from train.py (layer 10), at the top or inside a function."""
    known = set(modules())
    path = ROOT / "device" / "memory.py"
    source = path.read_text() + "\n\ndef late():\n    from slimtune.train import fit\n    from ..serve import chat\n"
    found = upward(imports_in("slimtune.device.memory", source, known))
    lines = len(path.read_text().splitlines())
    assert found == [
        f"slimtune/device/memory.py:{lines + 4}: slimtune.device.memory (layer 1) imports slimtune.train (layer 10)",
        f"slimtune/device/memory.py:{lines + 5}: slimtune.device.memory (layer 1) imports slimtune.serve.chat (layer 10)",
    ]


def test_a_module_in_no_layer_would_be_found():
    assert unplaced(["slimtune.config", "slimtune.helpers", "slimtune.engines.slide.engine"]) == ["slimtune.helpers"]


def test_a_cycle_would_be_found():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_run_or_plan_imports_torch_dynamo():
    """torch._dynamo costs about a second of every process's start on two cores (the CLI, the planner's
    worker, training), and nothing slimtune runs compiles: a module that needs a part of torch which
    imports it (torch.nn.attention.bias did) imports it where it is used. In a fresh interpreter, as a
    command starts."""
    probe = ("import sys, slimtune.cli, slimtune.train, slimtune.engines, slimtune.planning.planner; "
             "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
