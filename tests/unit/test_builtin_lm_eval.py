"""LmEval's parts without lm-eval running: flat metric names, the model arguments for a full
export and for a PEFT adapter, and the include folder that travels with the function. A real
evaluation in an EvalOnSave task: tests/integration/test_lm_eval.py."""

from __future__ import annotations

import json
import os
import pickle

import pytest

import callbacks.builtin.lm_eval as lm
from callbacks import LmEval
from callbacks.builtin.lm_eval import flat_lm_eval_metrics


def test_lm_eval_results_become_flat_names():
    results = {
        "arc_easy": {
            "alias": "arc_easy",
            "acc,none": 0.5,
            "acc_stderr,none": 0.1,
            "acc_norm,none": 0.6,
            "acc_norm_stderr,none": "N/A",
        },
        "gsm8k": {
            "exact_match,strict-match": 0.25,
            "exact_match_stderr,strict-match": 0.05,
            "exact_match,flexible-extract": 0.3,
            "sample_len": 10,
        },
    }
    assert flat_lm_eval_metrics(results) == {
        "arc_easy/acc": 0.5,
        "arc_easy/acc_stderr": 0.1,
        "arc_easy/acc_norm": 0.6,
        "gsm8k/exact_match_strict-match": 0.25,
        "gsm8k/exact_match_strict-match_stderr": 0.05,
        "gsm8k/exact_match_flexible-extract": 0.3,
    }


def _export(checkpoint, files):
    hf = checkpoint / "hf"
    hf.mkdir(parents=True)
    for name, text in files.items():
        (hf / name).write_text(text)
    return str(checkpoint)


def test_a_full_export_is_the_pretrained_model(tmp_path):
    path = _export(tmp_path / "ckpt", {"config.json": "{}"})
    args = LmEval("t", model_args={"dtype": "float32"}).model_arguments(path)
    assert args == {"pretrained": os.path.join(path, "hf"), "dtype": "float32"}


def test_an_adapter_loads_through_its_base_model(tmp_path):
    config = json.dumps({"base_model_name_or_path": "/models/base", "peft_type": "LORA"})
    path = _export(tmp_path / "ckpt", {"adapter_config.json": config, "tokenizer.json": "{}"})
    hf = os.path.join(path, "hf")
    assert LmEval("t").model_arguments(path) == {
        "pretrained": "/models/base",
        "peft": hf,
        "tokenizer": hf,
    }
    # The base model lives elsewhere on the evaluating node: the user says where.
    moved = LmEval("t", model_args={"pretrained": "/mnt/base"}).model_arguments(path)
    assert moved["pretrained"] == "/mnt/base" and moved["peft"] == hf


def test_an_adapter_without_a_base_and_a_checkpoint_without_export_are_explained(tmp_path):
    path = _export(tmp_path / "a", {"adapter_config.json": "{}"})
    with pytest.raises(ValueError, match=r"model_args=.*pretrained"):
        LmEval("t").model_arguments(path)
    (tmp_path / "b").mkdir()
    with pytest.raises(FileNotFoundError, match="save_hf_format"):
        LmEval("t").model_arguments(str(tmp_path / "b"))


def test_the_include_folder_travels_and_is_the_working_dir_while_evaluating(tmp_path):
    tasks = tmp_path / "tasks"
    (tasks / "data").mkdir(parents=True)
    (tasks / "my.yaml").write_text("task: my\n")
    (tasks / "data" / "test.jsonl").write_text('{"q": 1}\n')
    fn = pickle.loads(pickle.dumps(LmEval(["my"], include_path=tasks)))
    (tasks / "my.yaml").unlink()  # the node that evaluates does not see the original
    before = os.getcwd()
    with fn._include_folder() as folder:
        assert folder != str(tasks) and os.getcwd() == folder
        with open("my.yaml") as f:
            assert f.read() == "task: my\n"
        assert os.path.isfile(os.path.join("data", "test.jsonl"))
    assert os.getcwd() == before and not os.path.exists(folder)


def test_include_path_is_checked_and_bounded(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="include_path"):
        LmEval("t", include_path=tmp_path / "missing")
    (tmp_path / "big.jsonl").write_text("x" * 100)
    monkeypatch.setattr(lm, "MAX_SHIPPED_BYTES", 50)
    with pytest.raises(ValueError, match="ship_include_path=False"):
        LmEval("t", include_path=tmp_path)
    kept = LmEval("t", include_path=tmp_path, ship_include_path=False)
    with kept._include_folder() as folder:
        assert folder == str(tmp_path)
    with pytest.raises(ValueError, match="task names"):
        LmEval([])


def test_the_evaluation_options_reach_simple_evaluate(tmp_path, monkeypatch):
    """num_fewshot, limit, batch_size, device and any other keyword go to lm-eval as given (a
    stand-in lm_eval module records the call; the real one: tests/integration/test_lm_eval.py)."""
    import sys
    import types

    calls = []

    def simple_evaluate(**kwargs):
        calls.append(kwargs)
        return {"results": {"my_task": {"acc,none": 0.75}}}

    fake = types.ModuleType("lm_eval")
    fake.simple_evaluate = simple_evaluate
    tasks = types.ModuleType("lm_eval.tasks")
    tasks.TaskManager = lambda **kwargs: ("task manager", kwargs)
    fake.tasks = tasks
    monkeypatch.setitem(sys.modules, "lm_eval", fake)
    monkeypatch.setitem(sys.modules, "lm_eval.tasks", tasks)
    path = _export(tmp_path / "ckpt", {"config.json": "{}"})
    evaluate = LmEval(
        "my_task", num_fewshot=5, limit=0.25, batch_size=8, device="cpu", bootstrap_iters=0
    )
    assert evaluate(path, step=3) == {"my_task/acc": 0.75}
    (call,) = calls
    assert call["model"] == "hf" and call["model_args"] == {"pretrained": f"{path}/hf"}
    assert (call["tasks"], call["num_fewshot"], call["limit"]) == (["my_task"], 5, 0.25)
    assert (call["batch_size"], call["device"], call["bootstrap_iters"]) == (8, "cpu", 0)
    assert call["task_manager"] == ("task manager", {}) and call["log_samples"] is False
