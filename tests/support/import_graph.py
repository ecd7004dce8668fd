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

Folders: `folder_graph` condenses the graph at each package: its sub-packages are the nodes, an
edge A -> B wherever a module at or under A imports one at or under B; `folder_circles` are that
graph's circles, so two sibling packages that import each other (even through different modules,
with no module circle) are found. Modules beside the sub-packages are not nodes: a package may
stand on its parent's modules (`_worker/state.py`) and they on it.

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
    # A folder graph's edges: the module import that makes each (importer, imported, line).
    via: dict[str, dict[str, tuple[str, str, int]]] = field(default_factory=dict)

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


def packages(graph: Graph) -> list[str]:
    """The packages of the graph (a module whose file is an `__init__.py`), bench excluded."""
    return sorted(n for n, p in graph.files.items() if p.name == "__init__.py")


def folder_graph(graph: Graph, parent: str) -> Graph:
    """The sub-packages of `parent` as one node each, with the imports between them (each edge
    at the first module import that makes it)."""
    prefix = parent + "."
    subs = {n for n in packages(graph) if n.startswith(prefix) and "." not in n[len(prefix) :]}
    folders = Graph(root=graph.root, files={s: graph.files[s] for s in sorted(subs)})

    def folder(name: str) -> str | None:
        if not name.startswith(prefix):
            return None
        top = prefix + name[len(prefix) :].split(".")[0]
        return top if top in subs else None

    for src, targets in sorted(graph.edges.items()):
        a = folder(src)
        for dst in targets:
            b = folder(dst)
            if a and b and a != b and b not in folders.edges.get(a, {}):
                folders.edges.setdefault(a, {})[b] = 0
                folders.via.setdefault(a, {})[b] = (src, dst, targets[dst])
    return folders


def folder_circles(graph: Graph) -> list[tuple[Graph, list[str]]]:
    """Every circle between sibling packages, under every package of the project."""
    found = []
    for parent in packages(graph):
        folders = folder_graph(graph, parent)
        found += [(folders, c) for c in circles(folders)]
    return found


def describe_folders(folders: Graph, component: list[str]) -> str:
    """A folder circle and, for each of its edges, one module import that makes it."""
    members = set(component)
    lines = [f"folder circle of {len(component)} packages: {', '.join(component)}"]
    for src in component:
        for dst, (module, imported, line) in sorted(folders.via.get(src, {}).items()):
            if dst in members:
                lines.append(f"  {src} -> {dst}: {module}:{line} imports {imported}")
    return "\n".join(lines)


if __name__ == "__main__":
    g = build()
    found = circles(g)
    for c in found:
        print(describe(g, c))
    folder_found = folder_circles(g)
    for folders, c in folder_found:
        print(describe_folders(folders, c))
    print(f"{len(found)} circle(s) in {len(g.files)} modules, {len(folder_found)} between folders")
    sys.exit(1 if found or folder_found else 0)
