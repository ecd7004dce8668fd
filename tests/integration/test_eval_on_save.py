"""EvalOnSave: evaluation tasks on each checkpoint while training goes on (real Ray).

The first test reads the session's `evals_run` (`tests/support/shared_runs.py`, shared with
`test_faults.py`)."""

from __future__ import annotations

import os
import sys

from rt_support import SlowSteps, tiny_run
from waiting import wait_until

from callbacks import EvalOnSave


def test_one_evaluation_per_save_in_step_order_without_waiting(evals_run):
    # The session's `evals_run` (shared_runs.py): beside these held evaluations it runs
    # test_faults.py's failing, hanging and callable ones at each save.
    result = evals_run["result"]
    held = [e for e in result.evaluations if "checkpoint_step" in e.get("metrics", {})]
    assert [e["step"] for e in held] == [5, 10, 15]
    for e in held:
        assert e["metrics"]["checkpoint_step"] == e["step"]  # the task read that checkpoint
        assert e["checkpoint_path"].endswith(f"checkpoint_{e['step']:08d}")
        assert e["metrics"]["pid"] != os.getpid()
    # No held evaluation failed: the only errors are test_faults.py's raising and hanging ones.
    errors = [e["error"] for e in result.evaluations if "error" in e]
    assert all("broke" in e or "timed out" in e or "not finished" in e for e in errors), errors
    # The loop went on after each save: it took 2 more steps while that checkpoint's
    # evaluation was still running (a loop that waited for it never could).
    went_on = {e["step"]: e["metrics"].get("training_went_on") for e in held}
    assert went_on == {5: 1.0, 10: 1.0, 15: None}
    # The last checkpoint's evaluation finished before run_training returned.
    assert result.events["on_train_end"] == 1


def test_early_stopping_on_an_eval_on_save_metric_stops_the_run(ray_session, tmp_path):
    from rt_support import constant_score_eval

    from callbacks import EarlyStopping
    from ray_trainer import run_training

    result = run_training(
        **tiny_run(
            tmp_path,
            max_steps=200,
            save_every_steps=4,
            run_name="early-stop",
            callbacks=[
                SlowSteps(0.05),
                EvalOnSave(constant_score_eval, num_gpus=0, num_cpus=1),
                # The score never improves after the first evaluation: stop after 2 more.
                EarlyStopping("score", mode="max", patience=2),
            ],
        )
    )
    assert result.stopped_early
    assert "EarlyStopping" in result.stop_reason
    assert 12 <= result.global_step < 200
    steps = [e["step"] for e in result.evaluations]
    assert steps[:3] == [4, 8, 12] and steps == sorted(steps)


def test_generation_eval_in_an_eval_task_scores_a_chat_checkpoint_and_keeps_its_samples(
    ray_session, tmp_path
):
    import json

    from callbacks import GenerationEval
    from ray_trainer import run_training
    from ray_trainer._demo.chat import chat_conversations, make_tiny_chat_model

    model = make_tiny_chat_model(tmp_path / "model", style="chatml")
    data = tmp_path / "train.jsonl"
    conversations = chat_conversations(32, seed=1)
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    # Held-out chat rows: the last assistant turn of each is the reference.
    held_out = chat_conversations(3, seed=2)
    prompts = [{"messages": m} for m in held_out]
    # One-off: a task per checkpoint, transformers in the task. Kept: one evaluator actor for
    # the run, the generation in a subprocess of an interpreter (python=, as for a vLLM env).
    kept = GenerationEval(prompts, name="kept", backend="hf", max_new_tokens=8,
                          python=sys.executable, keep_engine=True)  # fmt: skip
    result = run_training(
        model=str(model), data=str(data), batch_size=4, max_length=128, num_workers=1,
        max_steps=4, save_every_steps=2, storage_path=str(tmp_path / "storage"),
        run_name="generation-eval",
        callbacks=[
            EvalOnSave(
                GenerationEval(prompts, name="chat", backend="hf", max_new_tokens=8,
                               metrics=["exact_match", "contains"]),
                num_gpus=0, every_n_saves=2,
            ),
            EvalOnSave(kept, num_gpus=0),
        ],
    )  # fmt: skip
    for e in result.evaluations:
        assert "error" not in e, e
        assert 0 < e["seconds_after_save"] < 120  # from its save to its metrics
    (evaluation,) = [e for e in result.evaluations if "chat/vllm" in e["metrics"]]
    kept_runs = [e for e in result.evaluations if "kept/vllm" in e["metrics"]]
    assert sorted(e["step"] for e in kept_runs) == [2, 4], result.evaluations
    assert all(0 <= e["metrics"]["kept/exact_match"] <= 1 for e in kept_runs)
    # The evaluator actor and its generation subprocess ended with the run.
    assert not _processes_running("run_generation_child.py")
    # It held a CPU for the whole run (num_cpus=1): every CPU is free again once it is gone.
    total = ray_session.cluster_resources()["CPU"]
    wait_until(lambda: ray_session.available_resources().get("CPU") == total, 30,
               "the evaluator actor to give its CPU back")  # fmt: skip
    metrics = evaluation["metrics"]
    assert 0.0 <= metrics["chat/exact_match"] <= metrics["chat/contains"] <= 1.0
    assert metrics["chat/vllm"] == 0.0 and 0 < metrics["chat/answer_tokens_mean"] <= 8
    samples_path = os.path.join(evaluation["checkpoint_path"], "eval", "chat.jsonl")
    assert metrics["chat/samples"] == samples_path
    with open(samples_path) as f:
        samples = [json.loads(line) for line in f]
    assert [s["reference"] for s in samples] == [m[-1]["content"] for m in held_out]
    assert [s["prompt"] for s in samples] == [m[:-1] for m in held_out]
    assert {s["step"] for s in samples} == {evaluation["step"]}


def _processes_running(needle: str) -> list[int]:
    """The pids whose command line holds `needle` (this machine's /proc)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found
