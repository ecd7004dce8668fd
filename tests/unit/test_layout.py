"""The layout: no import circle anywhere, the rooms by process, and which process each module names.

Reads every module's imports with `ast` (`tests/support/import_graph.py`; no import is
executed), so an import inside a function or under `TYPE_CHECKING` counts like any other.

Circles are checked twice: between modules, and between folders. A folder is a package
directory under ray_trainer/ or callbacks/; folders are compared with their siblings, the
sub-packages of one parent (`_worker/step/` with `_worker/model/`, `_lora/` with `_config/`),
each standing for every module at or under it. Package A may import package B only where B
imports nothing of A, directly or through other sibling packages, whichever modules make the
imports: two folders that import each other are one room cut in two, even with no module circle.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import import_graph
import pytest

ROOT = import_graph.ROOT
PACKAGE = ROOT / "ray_trainer"
CALLBACKS = ROOT / "callbacks"
ROOMS = ("ray_trainer._driver", "ray_trainer._worker", "ray_trainer._actor", "ray_trainer._client")
# The first line of every module's docstring names the process (or processes) that run it.
PROCESS_WORDS = (
    "driver", "worker", "actor", "every process", "terminal", "eval task", "anywhere",
    "preparation task",
)  # fmt: skip
GRAPH = import_graph.build()


def _modules(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def _write_tree(root: Path, files: dict[str, str]) -> None:
    """A small tree of modules under `root` (never inside the package), for the checks' own tests."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))


def _imports_of(prefix: str) -> list[tuple[str, str]]:
    """(importer, imported) for every project import made by the modules under `prefix`."""
    return [
        (src, dst)
        for src, targets in GRAPH.edges.items()
        if src == prefix or src.startswith(prefix + ".")
        for dst in targets
    ]


def test_no_import_circle_anywhere():
    found = import_graph.circles(GRAPH)
    assert not found, "\n\n".join(import_graph.describe(GRAPH, c) for c in found)


def test_no_import_circle_between_folders():
    found = import_graph.folder_circles(GRAPH)
    assert not found, "\n\n".join(import_graph.describe_folders(g, c) for g, c in found)


def test_the_folder_check_catches_a_circle_without_a_module_circle(tmp_path):
    # pkg/a/x.py imports pkg/b/y.py and pkg/b/z.py imports pkg/a/w.py: no module circle, but
    # the folders a and b import each other. pkg/c/ imports a and b and nothing imports c.
    files = {
        "ray_trainer/__init__.py": "",
        "ray_trainer/pkg/__init__.py": "",
        "ray_trainer/pkg/shared.py": "from ray_trainer.pkg.c import v\n",
        "ray_trainer/pkg/a/__init__.py": "",
        "ray_trainer/pkg/a/x.py": "from ray_trainer.pkg.b.y import thing\n",
        "ray_trainer/pkg/a/w.py": "",
        "ray_trainer/pkg/b/__init__.py": "",
        "ray_trainer/pkg/b/y.py": "thing = 1\n",
        "ray_trainer/pkg/b/z.py": "def f():\n    from ray_trainer.pkg.a import w\n",
        "ray_trainer/pkg/c/__init__.py": "import ray_trainer.pkg.a.x, ray_trainer.pkg.shared\n",
        "ray_trainer/pkg/c/v.py": "",
        "callbacks/__init__.py": "",
        "bench/_support.py": "",
    }
    _write_tree(tmp_path, files)
    graph = import_graph.build(tmp_path)
    assert import_graph.circles(graph) == []  # pkg.c and pkg.shared: a module, not a folder
    found = import_graph.folder_circles(graph)
    assert [c for _, c in found] == [["ray_trainer.pkg.a", "ray_trainer.pkg.b"]]
    text = import_graph.describe_folders(*found[0])
    assert "ray_trainer.pkg.b -> ray_trainer.pkg.a: ray_trainer.pkg.b.z:2 imports" in text
    (tmp_path / "ray_trainer/pkg/b/z.py").write_text("")
    assert import_graph.folder_circles(import_graph.build(tmp_path)) == []


def test_the_graph_counts_every_kind_of_import(tmp_path):
    # The circle test would pass vacuously if imports were missed: build a small tree in a
    # temporary folder (never inside the package) and check each rule of the graph.
    files = {
        "ray_trainer/__init__.py": "",
        "ray_trainer/a.py": """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from ray_trainer.pkg import b
        """,
        "ray_trainer/pkg/__init__.py": "from ray_trainer.pkg.b import thing\n",
        "ray_trainer/pkg/b.py": """
            def f():
                from .. import a
            thing = 1
        """,
        "ray_trainer/pkg/c.py": "from ray_trainer.pkg import thing\nimport ray_trainer.pkg.b\n",
        "callbacks/__init__.py": "",
        "bench/_support.py": "",
        "bench/bench_x.py": "import _support\nfrom _support import y\n",
        "bench/sub/bench_y.py": "import _support\nfrom bench_x import z\nimport _helper\n",
        "bench/sub/_helper.py": "",
        "callbacks/builtin/generation/child/run.py": "from pkg.main import main\n",
        "callbacks/builtin/generation/child/pkg/__init__.py": "",
        "callbacks/builtin/generation/child/pkg/main.py": "from .session import s\n",
        "callbacks/builtin/generation/child/pkg/session.py": "",
    }
    _write_tree(tmp_path, files)
    graph = import_graph.build(tmp_path)
    edges = {src: set(dst) for src, dst in graph.edges.items()}
    assert edges["ray_trainer.a"] == {"ray_trainer.pkg.b"}  # under TYPE_CHECKING, a submodule
    assert edges["ray_trainer.pkg.b"] == {"ray_trainer.a"}  # inside a function, relative
    # `thing` is no submodule: the package's __init__; the parent run implicitly is no edge.
    assert edges["ray_trainer.pkg.c"] == {"ray_trainer.pkg", "ray_trainer.pkg.b"}
    assert edges["bench.bench_x"] == {"bench._support"}  # plain imports resolve inside bench/
    # ... from any bench folder, to any bench folder (bench/_bench_path.py puts them all on the path)
    assert edges["bench.sub.bench_y"] == {"bench._support", "bench.bench_x", "bench.sub._helper"}
    # The generation child's root is on its own path: a plain import there resolves inside it.
    child = "callbacks.builtin.generation.child"
    assert edges[f"{child}.run"] == {f"{child}.pkg.main"}
    assert edges[f"{child}.pkg.main"] == {f"{child}.pkg.session"}
    found = import_graph.circles(graph)
    assert found == [["ray_trainer.a", "ray_trainer.pkg.b"]]
    assert "ray_trainer/pkg/b.py:3 imports ray_trainer.a" in import_graph.describe(graph, found[0])


def test_project_modules_are_never_imported_by_string():
    # importlib.import_module("ray_trainer.x") would hide an edge from the circle test.
    project = (*import_graph.PACKAGES, import_graph.BENCH)
    found = []
    for path in GRAPH.files.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called not in ("import_module", "__import__"):
                continue
            strings = [n.value for n in ast.walk(node.args[0]) if isinstance(n, ast.Constant)]
            if any(isinstance(s, str) and s.startswith(project) for s in strings):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


def test_worker_and_actor_never_import_each_other():
    assert [e for e in _imports_of("ray_trainer._worker") if e[1].startswith(ROOMS[2])] == []
    assert [e for e in _imports_of("ray_trainer._actor") if e[1].startswith(ROOMS[1])] == []


def test_no_run_process_imports_the_client():
    # The client room runs in the user's terminal: a run's driver, workers and actor never load it.
    for room in ROOMS[:3]:
        assert [e for e in _imports_of(room) if e[1].startswith(ROOMS[3])] == [], room
    # ...and it stands on the shared floor only: it asks a run through its actor or the job API.
    assert [e for e in _imports_of(ROOMS[3]) if e[1].startswith(ROOMS[:3])] == []


def test_the_driver_reaches_the_worker_only_through_its_door():
    # The entry module imports the loop inside the function Ray Train runs in the worker.
    reached = {dst for _, dst in _imports_of("ray_trainer._driver") if dst.startswith(ROOMS[1])}
    assert reached <= {"ray_trainer._worker.entry"}, reached
    entry = ast.parse((PACKAGE / "_worker" / "entry.py").read_text())
    top = [n for n in entry.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not [n for n in top if (getattr(n, "module", "") or "").startswith("ray_trainer")]
    assert set(GRAPH.edges["ray_trainer._worker.entry"]) == {"ray_trainer._worker.step.loop"}


def test_shared_modules_import_no_process_room():
    # What several processes share (config, contract, checkpoint format, storage, data,
    # pretrained loading, LoRA's config...) must not pull one process's code into another.
    shared = [
        name
        for name in GRAPH.files
        if name.startswith("ray_trainer")
        and not name.startswith(ROOMS)
        and name not in ("ray_trainer", "ray_trainer.cli")
    ]
    found = [
        f"{src} imports {dst}"
        for src in shared
        for dst in GRAPH.edges.get(src, {})
        if dst.startswith(ROOMS)
    ]
    assert found == []
    assert not [dst for dst in GRAPH.edges["ray_trainer"] if dst.startswith(ROOMS[1:3])]


def test_the_top_holds_at_most_ten_shared_modules():
    # Beside the rooms and the shared packages, a few modules of their own: what belongs
    # together is a package (`_config/`, `_model/`), not more files at the top.
    top = [p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "cli")]
    assert len(top) <= 10, sorted(top)


def test_the_demo_and_the_data_pipeline_stand_on_the_floor_only():
    # `_model/spec.py` builds the demo's model and reads the data's tokenizer: the demo and the
    # data pipeline import nothing of it (nor of `_config`, `_lora`, `_checkpoint`), only the
    # floor's modules (`_storage.py`...), so no folder above them is imported back.
    floor = {f"ray_trainer.{p.stem}" for p in PACKAGE.glob("_*.py")}
    # `_reference.py` (DPO's reference log-probs, cached beside the token cache) leaves the top
    # for the objective seam (issue 47, point 1).
    floor.discard("ray_trainer._reference")
    for package in ("ray_trainer._demo", "ray_trainer._data"):
        found = [
            (src, dst)
            for src, dst in _imports_of(package)
            if dst not in floor and not dst.startswith(package)
        ]
        assert found == [], package
    for module in floor:
        assert not [
            d
            for d in GRAPH.edges.get(module, {})
            if d.startswith(("ray_trainer._demo", "ray_trainer._data"))
        ], module


def test_the_data_pipeline_imports_no_ray():
    # Shared by the driver, the preparation tasks and the workers: plain Python and numpy.
    found = []
    for path in _modules(PACKAGE / "_data"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            found += [f"{path.name}: {n}" for n in names if n == "ray" or n.startswith("ray.")]
    assert found == []


def test_callbacks_import_nothing_of_ray_trainer():
    assert [e for e in _imports_of("callbacks") if e[1].startswith("ray_trainer")] == []


# Libraries that only some runs need, and that cost every process importing them: transformers
# alone is ~3 CPU-seconds, and it imports torchao whenever torchao is installed (0.33-0.45 s,
# ~0.8 s on a loaded machine: `modeling_utils` -> `integrations.finegrained_fp8` ->
# `quantizers.auto` -> `quantizer_torchao`). A run of a plain torch model starts a driver, a
# controller, a callback actor and its workers: none of them should pay for these.
RUN_ONLY_WHEN_NEEDED = ("transformers", "peft", "torchao", "liger_kernel", "datasets", "vllm")


def test_importing_the_package_and_each_process_door_loads_no_optional_library():
    # In a fresh interpreter (what each Ray worker, actor and task is): `import ray_trainer`
    # (the driver, `ray-trainer status`) loads no torch either, nor does the run's backend config
    # where Ray Train's controller unpickles it; the driver's launch, the
    # actor and the worker's loop load none of the optional libraries above, which are imported
    # where a run needs them (an HF model, LoRA, QLoRA, liger kernels, a `datasets.Dataset`).
    import os
    import subprocess
    import sys

    probe = textwrap.dedent(f"""
        import json, sys
        heavy = {(*RUN_ONLY_WHEN_NEEDED, "torch")!r}
        def loaded():
            return sorted({{m.split(".")[0] for m in sys.modules}} & set(heavy))
        import callbacks, ray_trainer
        top = loaded()
        # what Ray Train's controller does with a run's backend config: unpickle it, build its
        # backend (`_driver/torch_backend.py`)
        import pickle, ray_trainer._driver.torch_backend as tb
        pickle.loads(pickle.dumps(tb.LeanTorchConfig(backend="gloo"))).backend_cls()
        controller = loaded()
        import ray_trainer._actor.actor, ray_trainer._driver.launch, ray_trainer._worker.step.loop
        print(json.dumps({{"top": top, "controller": controller, "doors": loaded()}}))
    """)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["top"] == [] and found["controller"] == [], found
    assert found["doors"] == ["torch"], found  # the worker's loop stands on torch, nothing more


@pytest.mark.parametrize(
    "path", _modules(PACKAGE) + _modules(CALLBACKS), ids=lambda p: str(p.relative_to(ROOT))
)
def test_every_module_names_its_process_first(path):
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc, "no module docstring"
    if PACKAGE in path.parents:
        first = doc.splitlines()[0].lower()
        assert any(word in first for word in PROCESS_WORDS), f"first line: {first!r}"


#: The most lines a module of the package may have (issue 70): a longer one holds more than one
#: idea; split it by what it holds (as `_config/args.py` into the fields and `_config/rules.py`).
MAX_MODULE_LINES = 600


def test_no_module_is_over_the_line_limit():
    long = {
        str(p.relative_to(ROOT)): n
        for p in _modules(PACKAGE) + _modules(CALLBACKS)
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}, f"split these by what they hold (at most {MAX_MODULE_LINES} lines): {long}"


def test_the_training_step_reads_in_one_screen():
    import inspect

    from ray_trainer._worker.step import loop

    source = inspect.getsource(loop.train_step).splitlines()
    assert len(source) <= 50, f"train_step is {len(source)} lines"
    body = "\n".join(source)
    for event in (
        "on_step_begin",
        "on_before_forward",
        "on_after_forward",
        "on_before_backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "on_after_optimizer_step",
        "on_step_end",
    ):
        assert f'"{event}"' in body, event


# Unit tests about the repository rather than one module of it.
REPOSITORY_TESTS = {"layout", "cluster_yaml", "docs", "examples", "support_local_cluster"}


def test_a_modules_unit_tests_are_found_by_its_name():
    # tests/unit/test_<name>[_<topic>].py, where <name> ends a module's or package's dotted path
    # (underscores dropped, dots as "_"): `_worker/model/adaptation.py` -> test_adaptation.py,
    # test_model_adaptation_....py or test_worker_model_adaptation.py, `callbacks/builtin/jsonl.py`
    # -> test_builtin_jsonl.py.
    names = set()
    for module in GRAPH.files:
        parts = [p.lstrip("_") for p in module.split(".")]
        names |= {"_".join(parts[k:]) for k in range(len(parts))} - {"ray_trainer"}
    unnamed = [
        p.name
        for p in sorted((ROOT / "tests" / "unit").glob("test_*.py"))
        if p.stem[5:] not in REPOSITORY_TESTS
        and not any(p.stem[5:] == n or p.stem[5:].startswith(n + "_") for n in names)
    ]
    assert unnamed == [], f"name each after the module it tests: {unnamed}"


def test_test_files_have_unique_basenames():
    # pytest's default import mode puts every test folder on sys.path without a package, so two
    # test files of one name in tests/unit and tests/integration fail the whole collection.
    names = [p.name for p in (ROOT / "tests").rglob("*.py") if "__pycache__" not in p.parts]
    clashes = sorted({n for n in names if names.count(n) > 1 and n != "conftest.py"})
    assert clashes == [], f"rename one of each: {clashes}"


# ---- an objective is one seam -----------------------------------------------------------------

#: The folders an objective's code lives in: its shared description, its worker-side module.
OBJECTIVE_PACKAGES = ("ray_trainer/_objectives", "ray_trainer/_worker/objectives")
#: Names an objective has or will have: no other module compares anything with them.
OBJECTIVE_NAMES = frozenset({"sft", "dpo", "grpo"})


def _names_an_objective(node: ast.AST) -> bool:
    """An objective's name as a string, alone or in a tuple/list/set of them."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.lower() in OBJECTIVE_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_an_objective(e) for e in node.elts)
    return False


def _reads_the_objective(node: ast.AST) -> bool:
    """`x.objective`, `x["objective"]` or `x.get("objective")`: the run's objective, read."""
    if isinstance(node, ast.Attribute):
        return node.attr == "objective"
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "objective"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        first = node.args[0] if node.args else None
        return (
            node.func.attr == "get"
            and isinstance(first, ast.Constant)
            and (first.value == "objective")
        )
    return False


def _is_a_variant_class(node: ast.AST) -> bool:
    """A class of one objective (`DpoObjective`, `PairDataset`), in an isinstance check."""
    names = node.elts if isinstance(node, ast.Tuple) else [node]
    return any(
        (n.id if isinstance(n, ast.Name) else getattr(n, "attr", "")).endswith(
            ("Objective", "PairDataset")
        )
        for n in names
    )


def _line(node: ast.AST) -> int:
    return getattr(node, "lineno", 0)


def objective_branches(root: Path) -> list[str]:
    """`path:line what` for each place outside the objective packages under `root` that
    branches on the objective: compares something with an objective's name, or compares or
    tests the run's objective itself, or asks isinstance of an objective's own class. Reads
    the code with `ast`; nothing runs."""
    found = []
    for folder in ("ray_trainer", "callbacks"):
        for path in _modules(root / folder):
            rel = path.relative_to(root).as_posix()
            if rel.startswith(OBJECTIVE_PACKAGES):
                continue
            nodes = sorted(ast.walk(ast.parse(path.read_text())), key=_line)
            for node in nodes:
                why = None
                if isinstance(node, ast.Compare):
                    operands = [node.left, *node.comparators]
                    if any(_names_an_objective(o) for o in operands):
                        why = "compares with an objective's name"
                    elif any(_reads_the_objective(o) for o in operands):
                        why = "compares the objective"
                elif isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
                    tests = node.test.values if isinstance(node.test, ast.BoolOp) else [node.test]
                    tests = [t.operand if isinstance(t, ast.UnaryOp) else t for t in tests]
                    if any(_reads_the_objective(t) for t in tests):
                        why = "tests the objective"
                elif isinstance(node, ast.Match) and _reads_the_objective(node.subject):
                    why = "matches the objective"
                elif (
                    isinstance(node, ast.Call)
                    and getattr(node.func, "id", "") == "isinstance"
                    and len(node.args) == 2
                    and _is_a_variant_class(node.args[1])
                ):
                    why = "asks isinstance of an objective's class"
                if why:
                    found.append(f"{rel}:{node.lineno} {why}")
    return found


def test_no_module_outside_the_objectives_branches_on_one():
    # STYLE.md 13: the rest of the code asks the objective's interface, never its name.
    assert objective_branches(ROOT) == []


def test_the_objective_check_catches_each_kind_of_branch(tmp_path):
    # The check above would pass vacuously if it missed a kind: a small tree, each kind once.
    files = {
        "ray_trainer/a.py": """
            def f(args, wl, ds, status):
                if args.objective == "dpo":
                    pass
                x = 1 if "sft" != args.loss_kind else 2
                if wl.objective is not None:
                    pass
                if not wl.objective:
                    pass
                ok = isinstance(ds, PairDataset) or isinstance(ds, (int, GrpoObjective))
                if status.get("objective") in ("a", "b"):
                    pass
                match args.objective:
                    case _:
                        pass
                return args.kind in ("GRPO",)
        """,
        "ray_trainer/clean.py": """
            def f(args, objective, ds):
                extra = {"objective": args.objective}  # recorded, not branched on
                label = "dpo"  # a string alone is no branch
                if objective.needs_reference(args) and isinstance(ds, dict):
                    return objective.metrics, extra, label
        """,
        "ray_trainer/_objectives/dpo.py": 'def f(a):\n    return a.objective == "dpo"\n',
        "ray_trainer/_worker/objectives/x.py": "def f(d):\n    return isinstance(d, PairDataset)\n",
        "callbacks/b.py": 'def f(context):\n    return context.args["objective"] == "sft"\n',
    }
    _write_tree(tmp_path, files)
    assert objective_branches(tmp_path) == [
        "ray_trainer/a.py:3 compares with an objective's name",
        "ray_trainer/a.py:5 compares with an objective's name",
        "ray_trainer/a.py:6 compares the objective",
        "ray_trainer/a.py:8 tests the objective",
        "ray_trainer/a.py:10 asks isinstance of an objective's class",
        "ray_trainer/a.py:10 asks isinstance of an objective's class",
        "ray_trainer/a.py:11 compares the objective",
        "ray_trainer/a.py:13 matches the objective",
        "ray_trainer/a.py:16 compares with an objective's name",
        "callbacks/b.py:2 compares with an objective's name",
    ]


def test_each_objectives_worker_module_is_named_once_and_closes_no_circle():
    # The registry names each objective's worker module as a dotted string, imported by
    # `_worker/objectives/__init__.py` (the shared floor never imports a room): counted here
    # as that module's import, the graph still has no circle.
    from ray_trainer._objectives import names, objective_of

    resolver = "ray_trainer._worker.objectives"
    workers = {objective_of(n).worker for n in names()}
    assert workers <= set(GRAPH.files), workers
    assert all(w.startswith(resolver + ".") for w in workers), workers
    graph = import_graph.Graph(
        GRAPH.root, dict(GRAPH.files), {src: dict(dst) for src, dst in GRAPH.edges.items()}
    )
    text = GRAPH.files[resolver].read_text().splitlines()
    line = next(i for i, t in enumerate(text, 1) if "import_module(" in t)
    for worker in sorted(workers):
        graph.add(resolver, worker, line)
    assert set(graph.edges[resolver]) >= workers
    found = import_graph.circles(graph)
    assert not found, "\n\n".join(import_graph.describe(graph, c) for c in found)
