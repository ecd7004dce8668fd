"""Every input of issue 48's part 5 is refused before Ray: a `TrainingArgsError` from the Python
API naming the field and the fix, exit code 2 from the command line. No Ray here: `ray.init`
fails the test if a case reaches it. (An empty JSONL and a fake Parquet file are the data
sources' own: tests/unit/test_data_bounds.py.)
"""

from __future__ import annotations

import os

import pytest
import yaml

from ray_trainer import TrainingArgsError, run_training
from ray_trainer.cli import main


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    import ray

    def refuse(*a, **k):
        raise AssertionError("ray.init() was called before the input was refused")

    monkeypatch.setattr(ray, "init", refuse)


class NotAModule:
    pass


def _make_not_a_module():
    return NotAModule()


@pytest.fixture
def places(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    not_a_checkpoint = tmp_path / "notes"
    not_a_checkpoint.mkdir()
    (not_a_checkpoint / "readme.txt").write_text("x")
    return {"file": str(a_file), "not_a_checkpoint": str(not_a_checkpoint)}


CASES = [
    ({"seed": -5}, ["seed=-5", "0..4294967295", "seed=42"]),
    ({"seed": 2**70}, ["seed=1180591620717411303424", "outside"]),
    ({"demo": {"bogus": 1}}, ["demo: unknown setting 'bogus'", "known: d_model"]),
    ({"demo": {"d_model": 100, "n_heads": 3}}, ["demo:", "divisible by n_heads", "n_heads=5"]),
    ({"demo": {"max_steps": 3}}, ["demo: 'max_steps' is a training setting"]),
    ({"max_length": 10**9}, ["max_length=1000000000", "position limit (8192"]),
    ({"learning_rate": float("inf")}, ["learning_rate: Input should be a finite number"]),
    ({"weight_decay": float("inf")}, ["weight_decay: Input should be a finite number"]),
    ({"callback_timeout_s": float("inf")}, ["callback_timeout_s: Input should be a finite"]),
    ({"eval_timeout_s": float("inf")}, ["eval_timeout_s: Input should be a finite number"]),
    ({"batch_size": True}, ["batch_size: got True: a boolean where a number goes"]),
    ({"resources_per_worker": {"CPU": True}}, ["resources_per_worker: got {'CPU': True}"]),
    ({"run_name": "abc\n"}, ["run_name 'abc\\n' must be"]),
    ({"data": b"text"}, ["data: got a bytes", "datasets.Dataset.from_list"]),
    ({"data": [{"text": "a"}]}, ["data: got a list", "a file path"]),
    ({"data": {"text": "a"}}, ["data: got a dict"]),
    ({"model": _make_not_a_module}, ["model: model factory", "returned NotAModule", "nn.Module"]),
    ({"tokenizer": "gpt2"}, ["tokenizer='gpt2' with the built-in model", "drop tokenizer"]),
    ({"storage_path": "{file}"}, ["is a file, not a folder"]),
    ({"resources_per_worker": {"CPU": 0}}, ["resources_per_worker:", "{'CPU': 0.5}"]),
    ({"resources_per_worker": {"CPU": -1}}, ["resources_per_worker:", "negative"]),
    ({"resume_from": "{not_a_checkpoint}"}, ["is not a checkpoint", "checkpoint_<step>"]),
    ({"storage_path": "foo://bucket/runs"}, ["storage_path: 'foo://bucket/runs' cannot be read"]),
    ({"resume_from": "foo://bucket/x"}, ["resume_from: 'foo://bucket/x' cannot be read"]),
]


def _fields(fields, places, tmp_path):
    out = {k: (v.format(**places) if isinstance(v, str) else v) for k, v in fields.items()}
    out.setdefault("storage_path", str(tmp_path / "runs"))
    return out


@pytest.mark.parametrize(("fields", "needles"), CASES, ids=[str(c[0])[:40] for c in CASES])
def test_refused_before_ray_naming_the_field_and_the_fix(fields, needles, places, tmp_path):
    with pytest.raises(TrainingArgsError) as info:
        run_training(max_steps=1, **_fields(fields, places, tmp_path))
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    assert not (tmp_path / "runs").exists()  # nothing written


@pytest.mark.parametrize(
    "fields",
    [
        {"seed": -5},
        {"batch_size": True},
        {"demo": {"bogus": 1}},
        {"tokenizer": "gpt2"},
        {"resources_per_worker": {"CPU": 0}},
        {"storage_path": "{file}"},
        {"resume_from": "{not_a_checkpoint}"},
    ],
    ids=lambda f: next(iter(f)),
)
def test_the_command_line_exits_2_with_one_line(fields, places, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(_fields(fields, places, tmp_path)))
    assert main(["run", str(config), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and next(iter(fields)) in err, err


def test_a_run_name_with_a_newline_is_refused_from_the_command_line_too(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"run_name": "abc\n", "storage_path": str(tmp_path)}))
    assert main(["run", str(config)]) == 2
    assert "run_name" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["run.yaml"]
