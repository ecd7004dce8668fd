"""The examples still match the public API, without running them (no Ray, no training): each one
imports, its ``--help`` parses, every keyword it passes to a `ray_trainer` name is one that name
takes (a `TrainingArgs` field for `run_training`), and `examples/demo.yaml` loads with its
callbacks. CI runs no example (each is minutes of training); these checks catch the rot an
example meets first, a public name or field renamed under it.

What they cannot see: a value the run refuses (`run_training` checks values before Ray starts,
on the run itself) and how well an example trains; docs/testing.md records the examples' runs.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
from pathlib import Path

import pytest

from ray_trainer import run_training
from ray_trainer._config.args import TrainingArgs

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCRIPTS = sorted(EXAMPLES.glob("*.py"))


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _calls(tree: ast.AST, names: set[str]):
    """Every call of a bare name in `names` in the example: (line, name, positional count,
    keywords written out). A ``**common`` splat's keys are not in the call: its written
    keywords are still checked. A ``*args`` call is left out."""
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id not in names or any(isinstance(a, ast.Starred) for a in node.args):
            continue
        keywords = [k.arg for k in node.keywords if k.arg is not None]
        yield node.lineno, node.func.id, len(node.args), keywords


def _unknown_keywords(obj, positional: int, keywords: list[str]) -> str | None:
    """Why `obj` would refuse this call's shape, or None. `run_training` takes `TrainingArgs`'
    fields as keywords."""
    if obj is run_training:
        unknown = sorted(set(keywords) - set(TrainingArgs.model_fields))
        return f"not TrainingArgs fields: {unknown}" if unknown else None
    try:
        inspect.signature(obj).bind_partial(*[None] * positional, **dict.fromkeys(keywords))
    except TypeError as e:
        return str(e)
    return None


def test_every_example_is_listed_in_getting_started():
    """docs/getting-started.md's table of examples names each one, so a new one is shown."""
    listed = (EXAMPLES.parent / "docs" / "getting-started.md").read_text()
    names = [p.name for p in SCRIPTS] + ["demo.yaml"]  # cluster_run.yaml: test_cluster_yaml
    assert len(SCRIPTS) >= 8, names
    assert [n for n in names if f"(../examples/{n})" not in listed] == []


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_example_imports_and_parses_help(path, monkeypatch, capsys):
    module = _load(path)
    assert callable(getattr(module, "main", None)), f"{path.name} has no main()"
    monkeypatch.setattr(sys, "argv", [path.name, "--help"])
    with pytest.raises(SystemExit) as stop:
        module.main()
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_example_calls_match_the_public_api(path):
    module = _load(path)
    ours = {
        name
        for name, obj in vars(module).items()
        if callable(obj) and getattr(obj, "__module__", "").startswith("ray_trainer")
    }
    calls = list(_calls(ast.parse(path.read_text()), ours))
    problems = [
        f"{path.name}:{line}: {name}(...): {why}"
        for line, name, positional, keywords in calls
        if (why := _unknown_keywords(getattr(module, name), positional, keywords))
    ]
    assert not problems, "\n".join(problems)
    if "run_training" in ours:  # the check saw the example's runs
        assert any(name == "run_training" for _, name, _, _ in calls), path.name


def test_the_check_sees_a_renamed_field_and_a_wrong_keyword():
    from ray_trainer import EvalOnSave

    assert (
        _unknown_keywords(run_training, 0, ["max_steps", "max_step"])
        == "not TrainingArgs fields: ['max_step']"
    )
    assert _unknown_keywords(run_training, 0, ["max_steps", "lora", "objective"]) is None
    assert _unknown_keywords(EvalOnSave, 1, ["num_cpus"]) is None
    assert "num_cpu" in _unknown_keywords(EvalOnSave, 1, ["num_cpu"])


def test_demo_yaml_loads_with_its_callbacks():
    args = TrainingArgs.from_yaml(EXAMPLES / "demo.yaml", [])
    assert args.max_steps == 600 and args.num_workers == 2
    assert [type(c).__name__ for c in args.callbacks] == [
        "ProgressBar",
        "JsonlLogger",
        "RayMetrics",
    ]
