"""The project's import graph, read with `ast` (no module is executed), and its circles.

Nodes are modules, a package's `__init__` included (named by the package). Edges are imports
anywhere in a module: at the top, inside functions, under `TYPE_CHECKING`. The rules:

- `from pkg import x` points at the submodule `pkg.x` where one exists, else at `pkg`
  (its `__init__`);
- `import a.b.c` and `from a.b.c import y` point at `a.b.c` (or at `a.b.c.y` when `y` is a
  submodule); the parent packages Python runs on the way are not edges;
- a plain import inside a folder that runs with folders of its own on `sys.path` resolves there
  (`PLAIN_ROOTS`): in `bench/`, `import _support` is `bench/_support.py` from any subfolder
  (`bench/_bench_path.py` puts bench/ and each subfolder on the path); in the generation child's
  root, `import generation_child.main` is
  `callbacks/builtin/generation/child/generation_child/main.py`.

Run it as a script to print the circles: `python tests/support/import_graph.py`.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ray_trainer", "callbacks")
BENCH = "bench"
#: Folders whose modules import by plain name: the root -> whether its subfolders are on the
#: path too (bench/ and every subfolder; the generation child's root only).
PLAIN_ROOTS = {BENCH: True, "callbacks.builtin.generation.child": False}


@dataclass
class Graph:
    """Modules by dotted name (bench modules as `bench.<folder>.<name>`) and, per edge, where."""

    root: Path = ROOT
    files: dict[str, Path] = field(default_factory=dict)
    edges: dict[str, dict[str, int]] = field(default_factory=dict)  # src -> {dst: line}

    def add(self, src: str, dst: str, line: int) -> None:
        if dst != src and dst in self.files:
            self.edges.setdefault(src, {}).setdefault(dst, line)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_files(root: Path = ROOT) -> dict[str, Path]:
    files = {}
    for top in (*PACKAGES, BENCH):
        for path in sorted((root / top).rglob("*.py")):
            if "__pycache__" not in path.parts:
                files[module_name(path, root)] = path
    return files


def _package_of(name: str, path: Path) -> str:
    """The package a relative import in module `name` is relative to."""
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _plain(name: str, target: str, files: dict[str, Path]) -> str:
    """`target` as module `name` finds it by plain name: inside a plain root, the first of the
    root's folders that holds it (see `PLAIN_ROOTS`); else `target` itself."""
    for root, subfolders in PLAIN_ROOTS.items():
        if not name.startswith(root + "."):
            continue
        folders = [root]
        if subfolders:
            folders += sorted({m.rpartition(".")[0] for m in files if m.startswith(root + ".")})
        head = target.partition(".")[0]
        for folder in folders:
            if f"{folder}.{head}" in files:
                return f"{folder}.{target}"
    return target


def _targets(node: ast.AST, name: str, path: Path, files: dict[str, Path]) -> list[str]:
    """The project modules that one import statement runs (see the module docstring)."""
    if isinstance(node, ast.Import):
        return [_plain(name, alias.name, files) for alias in node.names]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = _package_of(name, path).split(".")
        base = base[: len(base) - node.level + 1]
        module = ".".join([*base, node.module] if node.module else base)
    else:
        module = _plain(name, node.module or "", files)
    out = []
    for alias in node.names:
        sub = f"{module}.{alias.name}"
        out.append(sub if sub in files else module)
    return out


def build(root: Path = ROOT) -> Graph:
    graph = Graph(root=root, files=project_files(root))
    for name, path in graph.files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, name, path, graph.files):
                    graph.add(name, target, node.lineno)
    return graph


def circles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in graph.files:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.edges.get(start, {}))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.edges.get(child, {})))))
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


def describe(graph: Graph, component: list[str]) -> str:
    """A circle's modules and the imports between them, with file and line."""
    members = set(component)
    lines = [f"import circle of {len(component)} modules: {', '.join(component)}"]
    for src in component:
        for dst, line in sorted(graph.edges.get(src, {}).items()):
            if dst in members:
                rel = graph.files[src].relative_to(graph.root)
                lines.append(f"  {rel}:{line} imports {dst}")
    return "\n".join(lines)


if __name__ == "__main__":
    g = build()
    found = circles(g)
    for c in found:
        print(describe(g, c))
    print(f"{len(found)} circle(s) in {len(g.files)} modules")
    sys.exit(1 if found else 0)
