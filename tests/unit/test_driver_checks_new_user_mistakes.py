"""What a new user hits (issue 12): each mistake gets one clear message, before anything runs.

No Ray here: every case is refused in the driver (or by the command line) before `ray.init`.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import pytest

from callbacks import CallbackPicklingError, TrainerCallback
from ray_trainer import ResourceRequestError, TrainingArgs, TrainingArgsError, run_training
from ray_trainer._data.records import scan
from ray_trainer._data.sources import DataFileError, read_piece, resolve
from ray_trainer._driver.checks.demand import MAX_SHARE
from ray_trainer._driver.checks.inputs import check_storage, resolve_paths, write_run_record
from ray_trainer._model.spec import ModelLoadError
from ray_trainer._storage import locate
from ray_trainer.cli import main


def _jsonl(path, records, bom=False):
    text = "".join(json.dumps(r) + "\n" for r in records)
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode())
    return path


@pytest.fixture
def no_ray():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("a Ray session is already up in this process")
    yield
    assert not ray.is_initialized(), "the check started Ray"


# -- 1. paths are resolved once, in the driver; a failed first try blocks no retry -----------


def test_relative_paths_become_absolute_where_the_user_typed_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model_dir").mkdir()
    args = resolve_paths(
        TrainingArgs(
            data="good.jsonl",
            val_data="sub/val.jsonl",
            model="./model_dir",
            tokenizer="model_dir",
            resume_from="runs/r/checkpoint_00000002",
            storage_path="runs",
        )
    )
    assert args.data == str(tmp_path / "good.jsonl")
    assert args.val_data == str(tmp_path / "sub" / "val.jsonl")
    assert args.model == str(tmp_path / "model_dir") == args.tokenizer
    assert args.resume_from == str(tmp_path / "runs" / "r" / "checkpoint_00000002")
    assert args.storage_path == str(tmp_path / "runs")
    # Hugging Face names and URIs are not paths here.
    other = resolve_paths(TrainingArgs(model="org/model", data="s3://bucket/d.jsonl"))
    assert (other.model, other.data) == ("org/model", "s3://bucket/d.jsonl")


def test_a_run_that_wrote_no_checkpoint_does_not_block_a_corrected_retry(tmp_path):
    run_dir = tmp_path / "retry"
    write_run_record(
        locate(str(run_dir)), {"fingerprint": "model=None;data=/old/typo.jsonl;demo=[]"}
    )
    args = TrainingArgs(run_name="retry", storage_path=str(tmp_path))
    assert check_storage(args).name == str(run_dir)  # nothing to protect: accepted


# -- 2. the embedded local Ray shares the machine's cores, up to a bound -----------------------


def test_more_workers_than_the_machine_can_share_are_refused_before_ray_starts(tmp_path, no_ray):
    started = time.monotonic()
    with pytest.raises(ResourceRequestError) as info:
        run_training(num_workers=64, max_steps=1, storage_path=str(tmp_path / "s"))
    assert time.monotonic() - started < 30
    msg, cores = str(info.value), os.cpu_count()
    assert "num_workers=64" in msg and f"this machine: {cores} cores" in msg
    assert f"CPU={MAX_SHARE * cores}" in msg.replace(".0", "")  # each core shared at most 4 ways
    assert "{'CPU': 0.5}" in msg  # the fix for oversubscribing on purpose


# -- 4. a state_dict() that cannot be pickled --------------------------------------------------


class LockInState(TrainerCallback):
    def on_log(self, context, **kwargs):
        pass

    def state_dict(self):
        return {"steps": 1, "guard": threading.Lock()}

    def load_state_dict(self, state):
        pass


def test_an_unpicklable_state_dict_is_refused_before_the_run(tmp_path):
    with pytest.raises(CallbackPicklingError) as info:
        run_training(callbacks=[LockInState()], storage_path=str(tmp_path / "s"))
    msg = str(info.value)
    assert "LockInState" in msg and "['guard']" in msg and "_thread.lock" in msg
    assert not (tmp_path / "s").exists()


# -- 6. checks that used to happen in the workers ----------------------------------------------


def test_batch_size_larger_than_the_data_is_refused_in_the_driver(tmp_path):
    data = _jsonl(tmp_path / "small.jsonl", [{"text": f"line {i}"} for i in range(10)])
    with pytest.raises(TrainingArgsError) as info:
        run_training(data=str(data), batch_size=32, storage_path=str(tmp_path / "s"))
    msg = str(info.value)
    assert "small.jsonl has 10 sample(s)" in msg and "batch_size=32" in msg
    assert "x num_workers=2 = 64" in msg
    assert not (tmp_path / "s").exists()


def test_data_whose_texts_are_all_empty_is_refused_in_the_driver(tmp_path):
    data = _jsonl(tmp_path / "empty.jsonl", [{"text": ""}] * 50)
    with pytest.raises(DataFileError, match=r"all 50 record\(s\) have empty text"):
        run_training(data=str(data), batch_size=4, storage_path=str(tmp_path / "s"))
    assert not (tmp_path / "s").exists()


def test_a_bad_resume_from_creates_nothing(tmp_path):
    with pytest.raises(TrainingArgsError, match="resume_from"):
        run_training(resume_from=str(tmp_path / "nope"), storage_path=str(tmp_path / "s"))
    assert not (tmp_path / "s").exists()


# -- 7. messages that point the right way -----------------------------------------------------


def test_a_missing_model_suggests_a_field_that_exists():
    pytest.importorskip("transformers")
    with pytest.raises(ModelLoadError) as info:
        run_training(model="no-such-org/no-such-model-xyz")
    assert "TrainingArgs.allow_download=True" in str(info.value)
    assert TrainingArgs(allow_download=True).allow_download  # and the field exists


def test_resume_from_a_run_folder_names_its_checkpoints(tmp_path):
    run = tmp_path / "myrun"
    (run / "checkpoint_00000004").mkdir(parents=True)
    (run / "checkpoint_00000008").mkdir()
    with pytest.raises(TrainingArgsError) as info:
        run_training(resume_from=str(run), storage_path=str(tmp_path / "s"))
    msg = str(info.value)
    assert "is a run folder, not a checkpoint" in msg
    assert "checkpoint_00000004, checkpoint_00000008" in msg
    assert "not fully written" not in msg


def test_an_on_save_closure_holding_a_lock_is_named_by_its_field(tmp_path):
    lock = threading.Lock()

    def on_save(context):
        with lock:
            pass

    with pytest.raises(CallbackPicklingError) as info:
        run_training(on_save=on_save, storage_path=str(tmp_path / "s"))
    msg = str(info.value)
    assert "(on_save)" in msg and "callbacks[0]" not in msg and "closure variable 'lock'" in msg


# -- 10. a byte-order mark ----------------------------------------------------------------------


def test_a_jsonl_file_with_a_byte_order_mark_is_read(tmp_path):
    data = _jsonl(tmp_path / "bom.jsonl", [{"text": "héllo"}, {"text": "world"}], bom=True)
    source = scan(resolve(str(data), "data"))
    assert source.records == 2
    (where, first), _ = read_piece(source, source.pieces[0])
    assert first == {"text": "héllo"} and where == f"{data}:1"  # the mark is not part of the text


# -- 5, 8, 9. the command line -------------------------------------------------------------------


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module of the user's, importable from the config: callbacks that misbehave."""
    (tmp_path / "my_callbacks.py").write_text(
        "import threading\n"
        "from callbacks import TrainerCallback\n"
        "class HoldsLock(TrainerCallback):\n"
        "    def __init__(self):\n"
        "        self.lock = threading.Lock()\n"
        "    def on_log(self, context, **kwargs):\n"
        "        pass\n"
        "class Picky(TrainerCallback):\n"
        "    def __init__(self, limit):\n"
        "        raise ValueError(f'limit {limit} is not allowed')\n"
        "    def on_log(self, context, **kwargs):\n"
        "        pass\n"
    )
    (tmp_path / "broken_module.py").write_text("raise RuntimeError('cannot import me')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("my_callbacks", "broken_module"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("my_callbacks:HoldsLock", ["callbacks[0]", "HoldsLock", "self.lock", "_thread.lock"]),
        ("broken_module:Anything", ["callbacks[0]", "broken_module", "cannot import me"]),
        (
            {"class": "my_callbacks:Picky", "limit": 3},
            ["callbacks[0]", "Picky(limit) raised ValueError", "limit 3 is not allowed"],
        ),
    ],
)
def test_bad_callbacks_in_a_config_exit_2_with_one_message(
    user_module, tmp_path, capsys, entry, expected
):
    import yaml

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"callbacks": [entry], "storage_path": str(tmp_path / "s")}))
    assert main(["run", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert str(config) in err
    for part in expected:
        assert part in err, (part, err)


def test_demo_max_steps_0_and_an_empty_set_value_are_refused(capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["demo", "--max-steps", "0"])
    assert info.value.code == 2
    assert "--max-steps: must be at least 1, got 0" in capsys.readouterr().err
    assert main(["demo", "--set", "max_steps="]) == 2
    err = capsys.readouterr().err
    assert "--set 'max_steps='" in err and "max_steps=null" in err
    config = tmp_path / "run.yaml"
    config.write_text("max_steps: 10\n")
    assert main(["run", str(config), "--set", "max_steps="]) == 2
    assert "the value is empty" in capsys.readouterr().err


def test_help_explains_set_and_the_demo_options_with_defaults(capsys):
    for argv in (["--help"], ["demo", "--help"], ["run", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        out = capsys.readouterr().out
        assert "``" not in out and "`" not in out  # no reStructuredText markup
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    assert "(default: 1200)" in out and "(default: 2)" in out
    assert "override a TrainingArgs field" in out
