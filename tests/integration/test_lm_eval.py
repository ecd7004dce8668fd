"""LmEval: lm-evaluation-harness on a checkpoint's hf/ export, offline, on CPU.

The task is the test's own: a multiple-choice YAML and a JSONL file in an include folder
(its data path relative to the folder). Once in an EvalOnSave task of a real run, its metric
reaching on_evaluate (JsonlLogger's lines), the result and the ranking; once directly on a
PEFT adapter export, which loads through its base model.
"""

from __future__ import annotations

import json

import pytest
from generation_support import TINY_CHOICE_TASK

from callbacks import EvalOnSave, JsonlLogger, LmEval
from ray_trainer.demo import make_tiny_causal_lm

QUESTIONS = [
    {"query": "the cat sat on the", "choices": ["mat", "ran"], "gold": 0},
    {"query": "what did the dog do ? it", "choices": ["ran", "mat"], "gold": 0},
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lm_eval")
    tasks = tmp / "tasks"
    (tasks / "data").mkdir(parents=True)
    (tasks / "tiny.yaml").write_text(TINY_CHOICE_TASK)
    (tasks / "data" / "tiny.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS * 4))
    model = make_tiny_causal_lm(tmp / "gpt2", n_layer=1, n_embd=32)
    return tmp, tasks, model


def test_lm_eval_in_an_eval_on_save_task_reaches_on_evaluate_and_the_result(ray_session, setup):
    from ray_trainer import run_training

    tmp, tasks, model = setup
    data = tmp / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"text": "the cat sat on the mat"}) + "\n" for _ in range(64))
    )
    result = run_training(
        model=str(model),
        data=str(data),
        batch_size=4,
        max_length=16,
        num_workers=2,
        max_steps=2,
        save_every_steps=2,
        storage_path=str(tmp / "storage"),
        run_name="lm-eval",
        checkpoint_score_attribute="tiny_choice/acc",
        callbacks=[
            EvalOnSave(LmEval(["tiny_choice"], include_path=tasks, batch_size=4), num_gpus=0),
            JsonlLogger(),
        ],
    )
    (evaluation,) = result.evaluations
    assert "error" not in evaluation, evaluation
    metrics = evaluation["metrics"]
    assert 0.0 <= metrics["tiny_choice/acc"] <= 1.0 and "tiny_choice/acc_stderr" in metrics
    # on_evaluate on the actor: JsonlLogger's line, and the ranking by the lm-eval metric.
    lines = (tmp / "storage" / "lm-eval" / "metrics.jsonl").read_text().splitlines()
    evaluated = [json.loads(line) for line in lines if '"on_evaluate"' in line]
    assert [e["val_metrics"]["tiny_choice/acc"] for e in evaluated] == [metrics["tiny_choice/acc"]]
    assert result.best_checkpoint_path == evaluation["checkpoint_path"]
    assert result.best_metrics["tiny_choice/acc"] == metrics["tiny_choice/acc"]


def test_lm_eval_loads_a_peft_adapter_through_its_base_model(setup):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    tmp, tasks, model = setup
    base = AutoModelForCausalLM.from_pretrained(str(model))
    adapter = get_peft_model(
        base, LoraConfig(r=2, target_modules=["c_attn"], task_type="CAUSAL_LM")
    )
    checkpoint = tmp / "adapter-checkpoint"
    adapter.save_pretrained(str(checkpoint / "hf"))
    metrics = LmEval("tiny_choice", include_path=tasks, batch_size=4)(str(checkpoint), 0)
    assert 0.0 <= metrics["tiny_choice/acc"] <= 1.0
