"""LmEval's parts without lm-eval running: flat metric names, the model arguments for a full
export and for a PEFT adapter, and the include folder that travels with the function. A real
evaluation in an EvalOnSave task: tests/integration/test_lm_eval.py."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import sys

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


# ---- backend="vllm": lm-eval's vllm model in a subprocess of the vLLM env's interpreter ------


def test_the_vllm_backend_is_checked_and_its_lora_arguments_follow_the_adapter(tmp_path):
    with pytest.raises(ValueError, match="backend must be one of"):
        LmEval("t", backend="sglang")
    with pytest.raises(ValueError, match="absolute path"):
        LmEval("t", backend="vllm", python="venv/bin/python")
    config = json.dumps({"base_model_name_or_path": "/models/base", "peft_type": "LORA", "r": 20})
    path = _export(tmp_path / "ckpt", {"adapter_config.json": config})
    hf = os.path.join(path, "hf")
    args = LmEval("t", backend="vllm", device="cpu").vllm_model_arguments(path)
    assert args == {  # unmerged: the base plus the adapter; r=20 rounded up to vLLM's 32
        "pretrained": "/models/base", "lora_local_path": hf, "max_lora_rank": 32,
        "kv_cache_memory_bytes": 1 << 30,  # on a CPU vLLM's cache is bounded
    }  # fmt: skip
    own = LmEval("t", backend="vllm", device="cuda", model_args={"gpu_memory_utilization": 0.3})
    full = _export(tmp_path / "full", {"config.json": "{}"})
    assert own.vllm_model_arguments(full) == {
        "pretrained": os.path.join(full, "hf"), "gpu_memory_utilization": 0.3,
    }  # fmt: skip


def _fake_site(tmp_path, archs):
    """Stand-ins for vllm and lm_eval in a folder the subprocess finds first: vllm knows
    `archs`; lm_eval's simple_evaluate records its call and returns a score."""
    site = tmp_path / "site"
    models = site / "vllm" / "model_executor" / "models"
    models.mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(
        f"class ModelRegistry:\n    get_supported_archs = staticmethod(lambda: {archs!r})\n"
    )
    (site / "vllm" / "model_executor" / "__init__.py").write_text("")
    (models / "__init__.py").write_text(
        "class ModelRegistry:\n    _try_load_model_cls = staticmethod(lambda arch: arch)\n"
    )
    (models / "interfaces.py").write_text("def supports_lora(cls):\n    return True\n")
    (site / "lm_eval").mkdir()
    (site / "lm_eval" / "__init__.py").write_text(
        "import json, os\n"
        "def simple_evaluate(**kwargs):\n"
        "    kwargs.pop('task_manager')\n"
        "    with open(os.environ['FAKE_LM_EVAL_CALLS'], 'w') as f:\n"
        "        json.dump(kwargs, f)\n"
        "    return {'results': {'my_task': {'acc,none': 0.5, 'acc_stderr,none': 0.1}}}\n"
    )
    (site / "lm_eval" / "tasks.py").write_text(
        "class TaskManager:\n"
        "    def __init__(self, **kwargs):\n"
        "        self.all_tasks = ['my_task']\n"
        "def get_task_dict(names, manager):\n"
        "    return {}\n"
    )
    return site


def test_lm_eval_s_vllm_model_runs_in_the_given_interpreter(tmp_path, monkeypatch):
    """The subprocess (this interpreter, with stand-in vllm and lm_eval modules first on its
    path) gets lm-eval's vllm model with the checkpoint; its results come back as flat names."""
    site = _fake_site(tmp_path, ["LlamaForCausalLM"])
    calls = tmp_path / "calls.json"
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("FAKE_LM_EVAL_CALLS", str(calls))
    config = json.dumps({"architectures": ["LlamaForCausalLM"]})
    path = _export(tmp_path / "ckpt", {"config.json": config})
    got = LmEval("my_task", backend="vllm", python=sys.executable, limit=2, device="cpu")(path, 1)
    assert got == {"my_task/acc": 0.5, "my_task/acc_stderr": 0.1, "lm_eval/backend": "vllm"}
    call = json.loads(calls.read_text())
    assert call["model"] == "vllm" and call["tasks"] == ["my_task"] and call["limit"] == 2
    assert call["model_args"]["pretrained"] == os.path.join(path, "hf")


def test_what_vllm_cannot_load_falls_back_to_hf_and_a_missing_vllm_is_named(tmp_path, monkeypatch):
    site = _fake_site(tmp_path, ["LlamaForCausalLM"])
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("FAKE_LM_EVAL_CALLS", str(tmp_path / "calls.json"))
    path = _export(tmp_path / "ckpt", {"config.json": json.dumps({"architectures": ["Odd"]})})
    fn = LmEval("my_task", backend="vllm", python=sys.executable)
    monkeypatch.setattr(fn, "_run_hf", lambda checkpoint: {"my_task/acc": 0.25})
    got = fn(path, 1)
    assert (
        got["lm_eval/backend"] == "hf" and "no model class for ['Odd']" in got["lm_eval/fallback"]
    )
    assert got["my_task/acc"] == 0.25
    monkeypatch.setenv("PYTHONPATH", "")  # this interpreter without vLLM (CI's)
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(RuntimeError, match=r"cannot import .*install vLLM and lm-eval"):
            LmEval("my_task", backend="vllm", python=sys.executable)(path, 1)
