"""TrainingArgs and the checks run_training makes before it takes any Ray resource."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from callbacks import ALIASES, EVENTS, CallbackPicklingError, TrainerCallback
from ray_trainer import TrainingArgs, TrainingArgsError, run_training
from ray_trainer._data.sources import DataFileError
from ray_trainer._model.spec import ModelLoadError
from ray_trainer._storage import locate


class Noop(TrainerCallback):
    def on_log(self, context, **kwargs):
        pass


class HoldsSocket(TrainerCallback):
    def __init__(self) -> None:
        self.client = socket.socket()

    def on_log(self, context, **kwargs):
        pass


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    """Every case here must fail before Ray is touched."""
    import ray

    def refuse(*a, **k):
        raise AssertionError("ray.init() was called before the input was validated")

    monkeypatch.setattr(ray, "init", refuse)
    yield


def test_one_flat_field_per_event_and_alias():
    fields = {f for f in TrainingArgs.model_fields if f.startswith("on_")}
    assert fields == EVENTS | set(ALIASES)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"batch_size": 0}, "batch_size: Input should be greater than 0 (got 0)"),
        ({"learning_rate": -1}, "learning_rate"),
        ({"lr_schedule": "steep"}, "lr_schedule"),
        ({"num_workers": "two"}, "num_workers"),
        ({"run_name": "a/b"}, "run_name"),
        ({"max_steps": 0}, "max_steps"),
        ({"data": 3.5}, "data"),
        ({"bach_size": 8}, "bach_size: unknown field; did you mean 'batch_size'?"),
        ({"on_sav": print}, "on_sav: unknown field; did you mean 'on_save'?"),
        ({"on_save": "not callable"}, "on_save"),
        ({"val_data": "x.jsonl"}, "val_data needs data"),
    ],
)
def test_bad_fields_are_named_with_the_fix(fields, needle, tmp_path):
    with pytest.raises(TrainingArgsError) as info:
        run_training(storage_path=str(tmp_path), **fields)
    assert needle in str(info.value)
    assert os.listdir(tmp_path) == []  # nothing written


def test_accepts_args_dict_or_fields():
    a = TrainingArgs.coerce({"max_steps": 5}, batch_size=4)
    assert (a.max_steps, a.batch_size) == (5, 4)
    b = TrainingArgs.coerce(a, max_steps=6)
    assert (b.max_steps, b.batch_size) == (6, 4)
    with pytest.raises(TrainingArgsError, match="TrainingArgs, a dict"):
        TrainingArgs.coerce(42)


def test_class_instead_of_instance(tmp_path):
    with pytest.raises(TrainingArgsError, match=r"Noop\(\)"):
        run_training(callbacks=[Noop], storage_path=str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_unpicklable_callback_names_callback_and_attribute(tmp_path):
    cb = HoldsSocket()
    try:
        with pytest.raises(CallbackPicklingError) as info:
            run_training(callbacks=[Noop(), cb], storage_path=str(tmp_path))
    finally:
        cb.client.close()
    assert "HoldsSocket" in str(info.value) and "client" in str(info.value)
    assert os.listdir(tmp_path) == []


def test_unpicklable_hook_function_names_the_variable(tmp_path):
    lock = threading.Lock()

    def on_save(context):
        with lock:
            pass

    with pytest.raises(CallbackPicklingError, match="lock"):
        run_training(on_save=on_save, storage_path=str(tmp_path))


def test_missing_data_file(tmp_path):
    with pytest.raises(DataFileError, match="does not exist"):
        run_training(data=str(tmp_path / "nope.jsonl"), storage_path=str(tmp_path / "s"))
    assert not (tmp_path / "s").exists()


def test_malformed_jsonl_names_file_and_line(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "ok"}\n{"text": "ok"}\n{"text": broken}\n')
    with pytest.raises(DataFileError, match=r"d\.jsonl:3"):
        run_training(data=str(data), storage_path=str(tmp_path / "s"))
    assert not (tmp_path / "s").exists()


def test_unknown_model_string(tmp_path):
    with pytest.raises(ModelLoadError, match="no-such-model-xyz"):
        run_training(model="no-such-model-xyz", data=None, storage_path=str(tmp_path / "s"))
    assert not (tmp_path / "s").exists()


def test_storage_path_not_writable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(TrainingArgsError, match="storage_path"):
        run_training(storage_path=str(blocker / "runs"))


def test_run_name_of_a_different_existing_run(tmp_path):
    from ray_trainer._driver.checks.inputs import write_run_record

    write_run_record(locate(str(tmp_path / "taken")), {"fingerprint": "model=other;data=x"})
    (tmp_path / "taken" / "checkpoint_00000005").mkdir()  # that run has checkpoints to protect
    with pytest.raises(TrainingArgsError, match="already holds a different run"):
        run_training(run_name="taken", storage_path=str(tmp_path))


def test_resume_from_an_incomplete_checkpoint(tmp_path):
    (tmp_path / "checkpoint_00000003").mkdir()
    with pytest.raises(TrainingArgsError, match="incomplete checkpoint"):
        run_training(resume_from=str(tmp_path / "checkpoint_00000003"), storage_path=str(tmp_path))


def test_yaml_config_with_overrides_and_callbacks(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "max_steps: 10\ncallbacks:\n"
        "  - {class: 'callbacks:EvalOnSave', eval_fn: 'builtins:print', num_gpus: 0}\n"
    )
    # eval_fn from YAML is a string: EvalOnSave refuses it with a clear error.
    with pytest.raises(TrainingArgsError, match="eval_fn must be callable"):
        TrainingArgs.from_yaml(cfg)
    cfg.write_text("max_steps: 10\nbatch_size: 4\nlog_every_steps: 3\n")
    args = TrainingArgs.from_yaml(cfg, ["max_steps=20", "run_name=yaml-run"])
    assert (args.max_steps, args.batch_size, args.run_name) == (20, 4, "yaml-run")
    with pytest.raises(TrainingArgsError, match="key=value"):
        TrainingArgs.from_yaml(cfg, ["max_steps"])
    with pytest.raises(TrainingArgsError, match="not found"):
        TrainingArgs.from_yaml(tmp_path / "missing.yaml")
    cfg.write_text("max_stepz: 3\n")
    with pytest.raises(TrainingArgsError, match="did you mean 'max_steps'"):
        TrainingArgs.from_yaml(cfg)


def test_an_elastic_size_is_min_and_max_with_the_global_batch_of_max(tmp_path):
    args = TrainingArgs(num_workers=[1, 4], elastic_resize_interval_s=5)
    assert args.num_workers == (1, 4) and args.elastic
    assert (args.min_workers, args.max_workers) == (1, 4)
    assert args.failures_allowed == 10  # a lost node does not end an elastic run
    assert args.to_public_dict()["num_workers"] == [1, 4]
    fixed = TrainingArgs(num_workers=3)
    assert not fixed.elastic and fixed.min_workers == fixed.max_workers == 3
    assert fixed.failures_allowed == 0 and TrainingArgs(max_failures=-1).failures_allowed == -1
    # Each node loss may cost one failed start (Ray Train first retries the old size).
    assert args.start_retries_allowed == 10 and fixed.start_retries_allowed == 2
    assert TrainingArgs(num_workers=[1, 2], max_start_retries=0).start_retries_allowed == 0
    assert TrainingArgs(num_workers=[2, 2]).num_workers == 2  # min == max: a fixed size
    config = tmp_path / "run.yaml"
    config.write_text("num_workers: [1, 2]\n")
    assert TrainingArgs.from_yaml(config).num_workers == (1, 2)
    assert TrainingArgs.from_yaml(config, ["num_workers=[2, 3]"]).num_workers == (2, 3)


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"num_workers": [0, 2]}, "an elastic size needs 1 <= min <= max"),
        ({"num_workers": [3, 1]}, "an elastic size needs 1 <= min <= max"),
        ({"num_workers": [1, 2, 3]}, "a number or [min, max]"),
        ({"num_workers": [1.5, 2]}, "a number or [min, max]"),
        ({"num_workers": 0}, "num_workers must be at least 1"),
        ({"num_workers": [1, 2], "placement_strategy": "STRICT_PACK"}, "use 'PACK' or 'SPREAD'"),
        ({"elastic_resize_interval_s": 0}, "elastic_resize_interval_s"),
    ],
)
def test_a_bad_elastic_size_is_refused_with_the_fix(fields, needle):
    with pytest.raises(TrainingArgsError) as e:
        TrainingArgs.coerce(**fields)
    assert needle in str(e.value)


def test_a_ray_dataset_is_data_told_by_its_class_without_importing_ray(monkeypatch):
    """`data` takes a ray.data.Dataset (not indexable, not callable), told by its class through
    the `ray.data` module a process that made one has imported: checking args imports nothing."""
    import sys
    import types

    class Dataset:  # stands for ray.data.Dataset (and its subclass MaterializedDataset)
        pass

    class MaterializedDataset(Dataset):
        pass

    module = types.ModuleType("ray.data")
    module.Dataset = Dataset
    monkeypatch.setitem(sys.modules, "ray.data", module)
    dataset = MaterializedDataset()
    assert TrainingArgs(data=dataset, val_data=Dataset()).data is dataset
    monkeypatch.delitem(sys.modules, "ray.data")  # no ray.data: not a Ray Dataset
    with pytest.raises(TrainingArgsError, match=r"got Dataset; pass .*a ray\.data\.Dataset"):
        TrainingArgs.coerce(data=Dataset())
