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


ADDRESS_FORMS = ["'auto'", "'local'", "'host:port'", "'ray://host:port'"]
HUGE_DEMO = [
    "demo: the built-in model of d_model=100000000, n_layers=2",
    "GiB of memory",
    "lower demo's d_model or n_layers",
]
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
    ({"ray_address": "CPU:0"}, ["ray_address='CPU:0' is not a Ray address", *ADDRESS_FORMS]),
    ({"ray_address": "10.0.0.1"}, ["ray_address='10.0.0.1' is not a Ray address"]),
    ({"demo": {"d_model": 100_000_000, "n_heads": 1}}, HUGE_DEMO),
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
        {"ray_address": "CPU:0"},
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


# ---- the cluster's address answers (issue 74, point 4) -----------------------------------------


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_address_where_nothing_listens_is_refused_before_anything_is_written(tmp_path):
    port = _closed_port()
    with pytest.raises(TrainingArgsError) as info:
        run_training(max_steps=1, ray_address=f"127.0.0.1:{port}", storage_path=str(tmp_path))
    message = str(info.value)
    assert f"ray_address='127.0.0.1:{port}': the connection failed" in message
    assert "`ray status` on its head node" in message and "unset ray_address" in message
    assert os.listdir(tmp_path) == []


def test_an_address_that_does_not_answer_is_refused_after_the_stated_time(monkeypatch):
    """A host that drops the packets: the TCP connect gives up after CONNECT_TIMEOUT_S (10 s),
    and the refusal says so (socket's connect is replaced: no 10 s wait here)."""
    import socket

    from ray_trainer._driver.checks import address

    waited = []

    def silent(target, timeout):
        waited.append((target, timeout))
        raise TimeoutError("timed out")

    monkeypatch.setattr(socket, "create_connection", silent)
    with pytest.raises(TrainingArgsError, match="nothing answered within 10 s") as info:
        address.check_reachable("ray://10.1.2.3:10001", "ray_address")
    assert waited == [(("10.1.2.3", 10001), 10.0)] and address.CONNECT_TIMEOUT_S == 10.0
    assert "the Ray Client server (port 10001 by default)" in str(info.value)

    def unknown(target, timeout):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "create_connection", unknown)
    with pytest.raises(TrainingArgsError, match="the host 'cuda' is not known here"):
        address.check_reachable("cuda:7", "ray_address")


def test_ray_address_env_is_checked_too_and_a_live_address_reaches_ray_init(monkeypatch, tmp_path):
    """RAY_ADDRESS, which TrainingArgs does not see, is refused by the same rule, naming the
    variable; an address that answers (a listening socket here) goes on to `ray.init`."""
    import socket

    monkeypatch.setenv("RAY_ADDRESS", "CPU:0")
    with pytest.raises(TrainingArgsError, match="RAY_ADDRESS='CPU:0' is not a Ray address"):
        run_training(max_steps=1, storage_path=str(tmp_path / "a"))
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{server.getsockname()[1]}")
        with pytest.raises(AssertionError, match=r"ray\.init"):
            run_training(max_steps=1, storage_path=str(tmp_path / "b"))


def test_the_built_in_model_is_held_to_this_machines_memory(monkeypatch):
    """`demo`'s model, counted from its shape (4 bytes a parameter), against the machine's
    memory (`machine_memory`, 1 GiB here): the default passes; d_model=8192 with 4 layers
    (3.2e9 parameters, ~12 GiB) is refused naming demo's fields; on text the position table
    of max_length rows counts too."""
    from ray_trainer import TrainingArgs
    from ray_trainer._driver.checks import model

    monkeypatch.setattr(model, "machine_memory", lambda: 2**30)
    model.check_model_inputs(TrainingArgs.coerce())
    big = TrainingArgs.coerce(demo={"d_model": 8192, "n_layers": 4})
    with pytest.raises(TrainingArgsError, match="demo: the built-in model of d_model=8192, "
                       "n_layers=4, mlp_ratio=4, tie_weights=True has") as info:  # fmt: skip
        model.check_model_inputs(big)
    assert "GiB in float32" in str(info.value) and "this machine's 1.0 GiB" in str(info.value)
    wide = TrainingArgs.coerce(data="x.jsonl", demo={"d_model": 4096}, max_length=8192)
    with pytest.raises(TrainingArgsError, match="max_length=8192 positions"):
        model.check_model_inputs(wide)
    monkeypatch.setattr(model, "machine_memory", lambda: None)  # the OS does not say
    model.check_model_inputs(big)
