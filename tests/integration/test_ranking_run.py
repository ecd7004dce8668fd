"""Keeping the best checkpoints, in real runs, with MLflow and W&B watching (real Ray).

Two launches of one run share the work: the first evaluates checkpoints 2, 4, 6, 8 (best at 4;
the evaluation of 2 is slow and lasts until 8 exists), keeps 1 by ``score`` and crashes at
step 9; the second resumes, saves 10 and 12 (both worse than 4) and ends. MLflowLogger (a real
server) and WandbLogger (offline) log both launches.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

import pytest
from rt_support import KillRank1Once
from tracker_support import wandb_offline_runs, wandb_run
from waiting import wait_until

from callbacks import EvalOnSave, MLflowLogger, TrainerCallback, WandbLogger
from ray_trainer.demo import make_tiny_causal_lm

RUN = "ranked"
SCORES = {2: 0.1, 4: 0.9, 6: 0.5, 8: 0.3, 10: 0.2, 12: 0.4}
TEXTS = ["the cat sat on the mat", "what did the dog do ? it ran home"]


class ScoreByStep:
    """Runs in the evaluation task: the score of each checkpoint, by step. The evaluation of
    `slow_step` lasts until checkpoint `until_step` exists, then says whether its own
    checkpoint is still there (the ranking would have deleted it meanwhile, were it not being
    evaluated)."""

    def __init__(self, slow_step: int | None = None, until_step: int | None = None) -> None:
        self.slow_step, self.until_step = slow_step, until_step

    def __call__(self, checkpoint_path: str, step: int) -> dict[str, float]:
        metrics = {"score": SCORES[step]}
        if step == self.slow_step:
            later = os.path.join(
                os.path.dirname(checkpoint_path), f"checkpoint_{self.until_step:08d}"
            )
            with contextlib.suppress(AssertionError):  # bounded; the test judges the metric
                wait_until(lambda: os.path.isdir(later), 120, f"{later} to exist")
            metrics["still_there"] = float(
                os.path.isfile(os.path.join(checkpoint_path, "rank0.complete"))
            )
        return metrics


class StatusProbe(TrainerCallback):
    """Rank 0, once: asks the run's callback actor for its status (what `ray-trainer status`
    shows) until checkpoint `evaluated` has its evaluation, and writes it to a file."""

    runs_on = "rank0"

    def __init__(self, path: str, step: int, evaluated: str) -> None:
        self.path, self.step, self.evaluated = path, step, evaluated

    def on_step_end(self, context, **kwargs):
        if context.global_step != self.step:
            return
        import ray

        from ray_trainer._contract import NAMESPACE, actor_name

        actor = ray.get_actor(actor_name(context.run_name), namespace=NAMESPACE)
        status: dict = {}

        def evaluated() -> bool:  # done, or failed: the test says
            status.clear()
            status.update(ray.get(actor.status.remote(), timeout=30))
            rows = {r["name"]: r for r in status.get("checkpoints", [])}
            return bool(rows.get(self.evaluated, {}).get("evaluations"))

        started = time.monotonic()
        with contextlib.suppress(AssertionError):  # the evaluation runs beside training
            wait_until(evaluated, 120, f"{self.evaluated}'s evaluation", interval=0.2)
        status["probe"] = {
            "waited_s": time.monotonic() - started,
            "available": ray.available_resources(),
        }
        with open(self.path, "w") as f:
            json.dump(status, f, default=str)


def _checkpoints(run_dir):
    return sorted(n for n in os.listdir(run_dir) if n.startswith("checkpoint_0"))


@pytest.fixture(scope="module")
def runs(ray_session, mlflow_server, tmp_path_factory):
    from ray_trainer import RunFailedError, run_training

    tmp = tmp_path_factory.mktemp("ranking")
    data = tmp / "train.jsonl"
    data.write_text("".join(json.dumps({"text": TEXTS[i % 2]}) + "\n" for i in range(200)))
    common = dict(
        model=str(make_tiny_causal_lm(tmp / "gpt2", n_layer=1, n_embd=32)),
        data=str(data),
        batch_size=4,
        max_length=16,
        num_workers=2,
        save_every_steps=2,
        log_every_steps=1,
        storage_path=str(tmp / "storage"),
        run_name=RUN,
        num_checkpoints_to_keep=1,
        checkpoint_score_attribute="score",
        checkpoint_score_order="max",
    )

    def trackers(**kwargs):
        return [
            MLflowLogger(mlflow_server.uri, "ranking", **kwargs),
            WandbLogger("ranking", mode="offline"),
        ]

    run_dir = str(tmp / "storage" / RUN)
    with pytest.raises(RunFailedError):
        run_training(
            **common,
            max_steps=10,
            callbacks=[
                EvalOnSave(ScoreByStep(slow_step=2, until_step=8), num_gpus=0, num_cpus=0.5),
                KillRank1Once(9),
                *trackers(),
            ],
        )
    with open(os.path.join(run_dir, "ranking.json")) as f:
        after_crash = {"checkpoints": _checkpoints(run_dir), "ranking": json.load(f)}
    status_file = str(tmp / "status.json")
    resumed = run_training(
        **common,
        max_steps=12,
        callbacks=[
            EvalOnSave(ScoreByStep(), num_gpus=0, num_cpus=0.5),
            StatusProbe(status_file, 11, "checkpoint_00000010"),
            *trackers(log_best_model=True),
        ],
    )
    with open(status_file) as f:
        status = json.load(f)
    return {"after_crash": after_crash, "resumed": resumed, "run_dir": run_dir, "status": status}


def test_the_crashed_run_kept_the_best_and_the_newest_checkpoint(runs):
    after = runs["after_crash"]
    assert after["checkpoints"] == ["checkpoint_00000004", "checkpoint_00000008"]
    by_name = {c["name"]: c for c in after["ranking"]["checkpoints"]}
    assert by_name["checkpoint_00000004"]["metrics"]["score"] == 0.9


def test_resume_keeps_the_ranking_and_the_best_checkpoint(runs):
    result, run_dir = runs["resumed"], runs["run_dir"]
    assert result.global_step == 12
    assert _checkpoints(run_dir) == ["checkpoint_00000004", "checkpoint_00000012"]
    assert result.best_checkpoint_path == os.path.join(run_dir, "checkpoint_00000004")
    assert result.best_metrics["score"] == 0.9  # evaluated by the first launch's actor
    assert result.checkpoint_path.endswith("checkpoint_00000012")
    assert [e["step"] for e in result.evaluations] == [10, 12]


def test_status_shows_the_best_checkpoint_and_the_evaluations_per_checkpoint(runs):
    from ray_trainer._client.status import format_status

    status = runs["status"]
    print(json.dumps(status, indent=1, default=str))  # shown when an assertion fails
    assert status["best_checkpoint"].endswith("checkpoint_00000004")
    rows = {r["name"]: r for r in status["checkpoints"]}
    assert rows["checkpoint_00000004"]["metrics"] == {"score": 0.9}
    assert rows["checkpoint_00000010"]["metrics"] == {"score": 0.2}
    text = format_status(status)
    assert "best        " in text and "checkpoint_00000004 (score 0.9)" in text


def test_mlflow_holds_both_launches_in_one_run(runs, mlflow_server):
    client = mlflow_server.client()
    (run,) = client.search_runs([client.get_experiment_by_name("ranking").experiment_id])
    assert run.info.run_name == RUN and run.info.status == "FINISHED"
    assert run.data.params["checkpoint_score_attribute"] == "score"
    assert run.data.tags["ray_trainer.changed.max_steps"] == "12"  # the first launch had 10
    evals = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "eval/score")}
    assert evals == SCORES
    (slow,) = client.get_metric_history(run.info.run_id, "eval/still_there")
    assert (slow.step, slow.value) == (2, 1.0)  # its checkpoint survived its evaluation
    steps = sorted({m.step for m in client.get_metric_history(run.info.run_id, "train/loss")})
    assert steps[0] == 1 and steps[-1] == 12
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "best_model")]
    assert "best_model/config.json" in artifacts
    assert run.data.tags["ray_trainer.best_checkpoint"].endswith("checkpoint_00000004")


def test_wandb_continues_the_same_offline_run(runs):
    first, second = (wandb_run(d) for d in wandb_offline_runs(runs["run_dir"]))
    assert first["id"] == second["id"] and first["name"] == RUN
    assert first["exit_code"] == 1 and second["exit_code"] == 0
    late = [h for h in first["history"] if "eval/still_there" in h]
    assert [h["trainer/global_step"] for h in late] == [2]
    assert {h["trainer/global_step"] for h in second["history"] if "eval/score" in h} == {10, 12}
