"""The layout by process: who may import whom, module sizes, and which process each module names.

Reads every module's imports with `ast` (no import is executed), so a forbidden import fails
here even when it sits inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ray_trainer"
CALLBACKS = ROOT / "callbacks"
MAX_LINES = 400
MAX_TOP_MODULES = 8  # besides cli.py and __init__.py
# The first line of every module's docstring names the process (or processes) that run it.
PROCESS_WORDS = (
    "driver", "worker", "actor", "every process", "terminal", "eval task", "anywhere",
    "preparation task",
)  # fmt: skip


def _modules(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def _imports(path: Path) -> list[str]:
    """Every module name imported by `path`, absolute, relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            names.append(module)
            names += [f"{module}.{alias.name}" for alias in node.names]
    return names


def _forbidden(folder: Path, prefixes: tuple[str, ...]) -> list[str]:
    found = []
    for path in _modules(folder):
        for name in _imports(path):
            if name.startswith(prefixes):
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


def test_worker_and_actor_never_import_each_other():
    assert _forbidden(PACKAGE / "_worker", ("ray_trainer._actor",)) == []
    assert _forbidden(PACKAGE / "_actor", ("ray_trainer._worker",)) == []


def test_driver_never_imports_the_worker():
    assert _forbidden(PACKAGE / "_driver", ("ray_trainer._worker",)) == []


def test_shared_modules_import_no_process_package():
    # What several processes share (config, contract, checkpoint format, placement...) must not
    # pull one process's code into another.
    shared = [p for p in PACKAGE.glob("*.py") if p.name not in ("cli.py", "__init__.py")]
    rooms = ("ray_trainer._driver", "ray_trainer._worker", "ray_trainer._actor")
    # The one exception: the worker's entry point, which imports the loop once it runs inside
    # the worker process (the driver hands Ray Train this function, never the loop itself).
    allowed = {
        ("_contract.py", "ray_trainer._worker.loop"),
        ("_contract.py", "ray_trainer._worker.loop.run_worker"),
    }
    found = [
        f"{p.name} imports {n}"
        for p in shared
        for n in _imports(p)
        if n.startswith(rooms) and (p.name, n) not in allowed
    ]
    assert found == []
    init = _imports(PACKAGE / "__init__.py")
    assert not [n for n in init if n.startswith("ray_trainer._worker")]


def test_data_preparation_and_data_formats_import_no_process_room():
    # The preparation tasks run on any node, beside the driver, workers and actor; the data
    # formats are shared by all of them.
    rooms = ("ray_trainer._driver", "ray_trainer._worker", "ray_trainer._actor")
    assert _forbidden(PACKAGE / "_prep", rooms) == []
    assert _forbidden(PACKAGE / "_data", (*rooms, "ray_trainer._prep")) == []


def test_callbacks_import_nothing_of_ray_trainer():
    assert _forbidden(CALLBACKS, ("ray_trainer",)) == []


def test_the_checker_sees_a_forbidden_import(tmp_path):
    # The rules above would pass vacuously if `_imports` missed imports: check it on a sample.
    sample = ROOT / "ray_trainer" / "_worker" / "_layout_probe.py"
    sample.write_text(
        "def f():\n    from ray_trainer._actor.actor import CallbackActor\n"
        "from .. import _config\nfrom . import loop\n"
    )
    try:
        names = _imports(sample)
        assert "ray_trainer._actor.actor" in names
        assert "ray_trainer._config" in names and "ray_trainer._worker.loop" in names
        assert _forbidden(PACKAGE / "_worker", ("ray_trainer._actor",)) != []
    finally:
        sample.unlink()


def test_top_level_holds_only_shared_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("cli.py", "__init__.py"))
    assert len(top) <= MAX_TOP_MODULES, top
    assert {"_driver", "_worker", "_actor"} <= {p.name for p in PACKAGE.iterdir() if p.is_dir()}


@pytest.mark.parametrize(
    "path", _modules(PACKAGE) + _modules(CALLBACKS), ids=lambda p: str(p.relative_to(ROOT))
)
def test_module_size_and_process_named_first(path):
    lines = path.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"{len(lines)} lines"
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc, "no module docstring"
    if PACKAGE in path.parents:
        first = doc.splitlines()[0].lower()
        assert any(word in first for word in PROCESS_WORDS), f"first line: {first!r}"


def test_the_training_step_reads_in_one_screen():
    import inspect

    from ray_trainer._worker import loop

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


def test_the_contract_imports_the_worker_loop_only_inside_the_entry_point():
    tree = ast.parse((PACKAGE / "_contract.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not [n for n in top if (getattr(n, "module", "") or "").startswith("ray_trainer._w")]
    entry = next(
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train_loop_per_worker"
    )
    inner = [n for n in ast.walk(entry) if isinstance(n, ast.ImportFrom)]
    assert [n.module for n in inner] == ["ray_trainer._worker.loop"]


def test_test_files_have_unique_basenames():
    # pytest's default import mode puts every test folder on sys.path without a package, so two
    # test files of one name in tests/unit and tests/integration fail the whole collection.
    names = [p.name for p in (ROOT / "tests").rglob("*.py") if "__pycache__" not in p.parts]
    clashes = sorted({n for n in names if names.count(n) > 1 and n != "conftest.py"})
    assert clashes == [], f"rename one of each: {clashes}"
