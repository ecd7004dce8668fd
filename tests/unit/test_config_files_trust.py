"""A config file names code, but an entry constructs only a TrainerCallback (issue 48, part 4).

The config of the issue (``{class: "subprocess:call", args: "touch MARKER", shell: true}``)
ran its command while the file was loaded, and ``ray-trainer submit`` ran it while
validating. Here it runs nothing: the marker file is never created, through the config loader
(`TrainingArgs.from_yaml`, what ``ray-trainer run`` reads) and through ``submit``'s validation.
"""

from __future__ import annotations

import sys

import pytest
import yaml

from callbacks import TrainerCallback
from ray_trainer import TrainingArgs, TrainingArgsError
from ray_trainer._client.submit import prepare_submission
from ray_trainer.cli import _parser, main


def _config(tmp_path, callbacks, **fields):
    path = tmp_path / "run.yaml"
    body = {"storage_path": str(tmp_path / "runs"), "callbacks": callbacks, **fields}
    path.write_text(yaml.safe_dump(body))
    return path


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "MARKER"
    yield path
    assert not path.exists(), "a config entry ran its command"


def _attack(marker):
    return [{"class": "subprocess:call", "args": f"touch {marker}", "shell": True}]


def test_the_loader_refuses_a_class_entry_that_is_not_a_callback(tmp_path, marker):
    config = _config(tmp_path, _attack(marker))
    with pytest.raises(TrainingArgsError) as info:
        TrainingArgs.from_yaml(config)
    message = str(info.value)
    assert str(config) in message and "callbacks[0]" in message and "subprocess:call" in message
    assert "not a TrainerCallback subclass" in message and "nothing was called" in message


def test_ray_trainer_run_exits_2_and_runs_nothing(tmp_path, marker, capsys):
    config = _config(tmp_path, _attack(marker))
    assert main(["run", str(config)]) == 2
    err = capsys.readouterr().err
    assert "callbacks[0]" in err and "Traceback" not in err


def test_submit_validates_the_fields_without_importing_or_calling_entries(tmp_path, marker):
    """The job builds the callbacks on the cluster; here only the fields are validated: the
    attack config is not called, and a module that only the cluster has is not imported."""
    callbacks = [*_attack(marker), "only_on_the_cluster:Tracker", {"class": "nowhere:Cb"}]
    config = _config(tmp_path, callbacks, on_save="only_on_the_cluster:hook")
    opts = _parser().parse_args(
        ["submit", str(config), "--address", "http://127.0.0.1:8265", "--no-working-dir"]
    )
    job = prepare_submission(opts)
    assert job.entrypoint.startswith("ray-trainer run ")
    assert "only_on_the_cluster" not in sys.modules and "nowhere" not in sys.modules


@pytest.mark.parametrize(
    ("entry", "needle"),
    [
        ({"class": 3}, "expected an import string"),
        ({"metric": "loss"}, "a mapping with a 'class' key"),
        ("no_colon_or_dot", "not an import string"),
    ],
)
def test_submit_still_refuses_a_malformed_entry(tmp_path, entry, needle):
    config = _config(tmp_path, [entry])
    opts = _parser().parse_args(
        ["submit", str(config), "--address", "http://127.0.0.1:8265", "--no-working-dir"]
    )
    with pytest.raises(TrainingArgsError, match=needle):
        prepare_submission(opts)


class Plain:
    """A class that is not a callback: constructing it from a config is refused."""

    built = 0

    def __init__(self) -> None:
        Plain.built += 1


class Counted(TrainerCallback):
    def __init__(self, limit: int) -> None:
        self.limit = limit

    def on_log(self, context, **kwargs):
        pass


def test_only_trainer_callback_subclasses_are_constructed(tmp_path):
    here = __name__
    with pytest.raises(TrainingArgsError, match="Plain' is a class, not a TrainerCallback"):
        TrainingArgs.from_yaml(_config(tmp_path, [f"{here}:Plain"]))
    assert Plain.built == 0
    args = TrainingArgs.from_yaml(_config(tmp_path, [{"class": f"{here}:Counted", "limit": 3}]))
    assert [type(c).__name__ for c in args.callbacks] == ["Counted"]
    assert args.callbacks[0].limit == 3
