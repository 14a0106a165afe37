"""Every module, function, file and setting that README.md and docs/**/*.md name exists.

The pages are read as a newcomer reads them, so a name that no longer exists (a module moved, a
function renamed, a setting dropped) is a wrong turn. What is checked:
  - paths: `slimtune/...`, `tests/...`, `benchmarks/...`, `configs/...`, `scripts/...`, `docs/...`
    anywhere in the text exist from the repository root; a bare or partial `x.py` or `a/b.py` is the
    end of some file's path in the repository;
  - links: a relative markdown link resolves from the page's folder, and its #anchor is a heading there;
  - dotted names in code (inline `...` and fenced blocks): a setting key (`slimtune train --help`), or
    `module.name[.member]` (a module named by its last dotted parts: `train.build`,
    `engines.base.Engine`), or `Class.member`, found in the source by its syntax tree (nothing is
    imported). A dotted name that starts with none of these must start with a name of FOREIGN.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *ROOT.glob("CONTRIBUTING.md"), *(ROOT / "docs").rglob("*.md")])

# Names code in the pages may start with that are not slimtune's: other libraries, and the variables
# the examples use.
FOREIGN = {"torch", "F", "nn", "peft", "transformers", "AutoModelForCausalLM", "bitsandbytes", "datasets",
           "mlflow", "wandb", "np", "os", "sys", "json", "math", "cfg", "self", "e", "i",
           "resumed",  # resumed.<key>: the tag MLflow gets for a setting a resume changed
           "llama"}  # llama.cpp
# Names ending in one of these are file names (a .py one is checked as a path).
FILE_SUFFIXES = {"py", "md", "yaml", "yml", "json", "jsonl", "safetensors", "gguf", "pt", "png", "txt", "sh", "jinja",
                 "csv", "parquet", "toml", "lock", "internal"}
SKIP_DIRS = {".git", ".venv", "runs", "models", "__pycache__", "build", ".device_kit"}

CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
DOTTED = re.compile(r"(?<![\w./-])[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
ROOTED_PATH = re.compile(r"(?<![\w./-])(?:slimtune|tests|benchmarks|configs|scripts|docs)/[\w./*<>-]*")
PY_PATH = re.compile(r"(?<![\w./-])[\w/-]*\w\.py\b")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _repo_files() -> list[str]:
    found = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if path.is_file() and not SKIP_DIRS.intersection(rel.parts) and "egg-info" not in str(rel):
            found.append(rel.as_posix())
    return found


REPO_FILES = _repo_files()


class SourceIndex:
    """slimtune's modules by dotted name: each one's top-level names, and each class's members."""

    def __init__(self) -> None:
        self.modules: dict[str, dict[str, ast.AST]] = {}
        self.classes: dict[str, list[set[str]]] = {}
        for rel in REPO_FILES:
            if rel.startswith("slimtune/") and rel.endswith(".py"):
                dotted = rel[:-3].replace("/", ".").removesuffix(".__init__")
                self.modules[dotted] = self._top_level(ast.parse((ROOT / rel).read_text()))

    def _top_level(self, tree: ast.Module) -> dict[str, ast.AST]:
        names: dict[str, ast.AST] = {}
        for node in tree.body:
            for name in _defined_names(node):
                names[name] = node
            if isinstance(node, ast.ClassDef):
                self.classes.setdefault(node.name, []).append(_members(node))
        return names

    def module_candidates(self, parts: list[str]) -> list[str]:
        wanted = ".".join(parts)
        return [m for m in self.modules if m == wanted or m.endswith("." + wanted)]

    def class_has(self, cls: str, member: str) -> bool:
        return any(member in members for members in self.classes.get(cls, []))

    def resolves(self, parts: list[str]) -> bool:
        for k in range(len(parts), 0, -1):
            for module in self.module_candidates(parts[:k]):
                if self._attributes(module, parts[k:]):
                    return True
        return parts[0] in self.classes and len(parts) == 2 and self.class_has(parts[0], parts[1])

    def _attributes(self, module: str, rest: list[str]) -> bool:
        if not rest:
            return True
        node = self.modules[module].get(rest[0])
        if node is None:
            return False
        if len(rest) == 1:
            return True
        return len(rest) == 2 and self.class_has(rest[0], rest[1])

    def known_start(self, name: str) -> bool:
        return bool(self.module_candidates([name])) or name in self.classes


def _defined_names(node: ast.AST) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [(alias.asname or alias.name).split(".")[0] for alias in node.names]
    if isinstance(node, (ast.If, ast.Try)):
        return [name for child in node.body for name in _defined_names(child)]
    return []


def _members(cls: ast.ClassDef) -> set[str]:
    """A class's methods, class attributes and fields, and the attributes its methods set on self."""
    members = {name for node in cls.body for name in _defined_names(node)}
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                members.add(node.attr)
    return members


@functools.cache
def settings() -> frozenset[str]:
    """Every setting key, as `slimtune train --help` lists them (cli.main in this process: a process of
    its own would only start torch again)."""
    from slimtune import cli

    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), pytest.raises(SystemExit) as done:
        cli.main(["train", "--help"])
    assert done.value.code == 0, f"slimtune train --help exited {done.value.code}"
    listed = shown.getvalue().partition("Settings")[2]
    return frozenset(re.findall(r"^  ([a-z_][\w.]*)\s", listed, re.M))


@functools.cache
def index() -> SourceIndex:
    return SourceIndex()


def _code_of(text: str) -> list[str]:
    return [m.group(0) for m in FENCE.finditer(text)] + CODE_SPAN.findall(FENCE.sub("", text))


def _dotted_problem(name: str) -> str | None:
    parts = name.split(".")
    if parts[-1] in FILE_SUFFIXES or name in settings():
        return None
    sections = {key.split(".")[0] for key in settings() if "." in key}
    if index().resolves(parts):
        return None
    if parts[0] in sections or index().known_start(parts[0]):
        return f"`{name}`: no such setting, module, function or member"
    if parts[0] in FOREIGN:
        return None
    return f"`{name}`: starts with no slimtune module, class or setting section (add it to FOREIGN if it is not ours)"


def _path_problem(path: str) -> str | None:
    path = path.rstrip(".,;:)")
    if "<" in path or not path:
        return None
    if "*" in path:
        return None if list(ROOT.glob(path)) else f"{path}: matches no file"
    return None if (ROOT / path).exists() else f"{path}: no such file or folder"


def _py_problem(name: str) -> str | None:
    if any(f == name or f.endswith("/" + name) for f in REPO_FILES):
        return None
    return f"{name}: no file of that name"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _link_problem(page: Path, target: str) -> str | None:
    if re.match(r"[a-z]+:", target):
        return None
    path, _, anchor = target.partition("#")
    found = (page.parent / path).resolve() if path else page
    if not found.exists():
        return f"link {target}: no such file"
    if anchor and found.suffix == ".md":
        headings = re.findall(r"^#+ (.+)$", FENCE.sub("", found.read_text()), re.M)
        if anchor not in {_slug(h) for h in headings}:
            return f"link {target}: no heading of that anchor"
    return None


def problems(page: Path) -> list[str]:
    text = page.read_text()
    found = [_dotted_problem(name) for code in _code_of(text) for name in DOTTED.findall(code)]
    found += [_path_problem(path) for path in ROOTED_PATH.findall(text)]
    found += [_py_problem(name) for name in PY_PATH.findall(text) if not name.startswith(ROOTED_PREFIXES)]
    found += [_link_problem(page, target) for target in LINK.findall(text)]
    return sorted({p for p in found if p})


ROOTED_PREFIXES = ("slimtune/", "tests/", "benchmarks/", "configs/", "scripts/", "docs/")


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_name_a_page_gives_exists(page):
    assert problems(page) == [], f"{page.relative_to(ROOT)} names what does not exist"


def test_the_checker_finds_a_stale_name(tmp_path):
    """The layout before the regroup, as the README named it: each kind of stale name is found."""
    page = tmp_path / "old.md"
    page.write_text("`slimtune/conversation.py` and pipeline/step_weights.py; `engines.base.copy_named`,"
                    " `lsp.no_such_setting`, `planner.no_such_function`, `Stack.no_such_method`;"
                    " [a page](no-such-page.md), [a heading](#no-such-heading)\n")
    assert len(problems(page)) == 8, problems(page)
