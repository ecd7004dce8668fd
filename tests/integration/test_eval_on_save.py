"""EvalOnSave: evaluation tasks on each checkpoint while training goes on (real Ray).

The first test reads the session's `evals_run` (`tests/support/shared_runs.py`, shared with
`test_faults.py`). The last one drives a GRPO rollout engine (`ray_trainer/_rollout/`), the
other engine kept warm in an actor of its own: it generates, takes new weights in buckets
through the object store without restarting, passes the probe, takes weights posted during a
long request between two of its batches (the request crossing versions), and is seen dead once
killed."""

from __future__ import annotations

import os

import pytest
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


def test_a_rollout_engine_actor_generates_syncs_in_buckets_and_passes_the_probe(
    ray_session, tmp_path
):
    import ray
    import torch

    from ray_trainer._demo.chat import make_tiny_chat_model
    from ray_trainer._model.spec import ModelSpec
    from ray_trainer._rollout.actor import RemoteEngine, RolloutEngineDied
    from ray_trainer._rollout.engine import EngineSpec, SamplingParams
    from ray_trainer._rollout.probe import Probe, logprob_diff, trainer_logprobs
    from ray_trainer._rollout.transport import post_weights

    model = ModelSpec(model=str(make_tiny_chat_model(tmp_path / "chat")))
    spec = EngineSpec(model, device="cpu", batch_size=2)
    engine = RemoteEngine("hf", spec, {"CPU": 0.5}, timeout_s=120)
    try:
        params = SamplingParams(num_generations=2, max_completion_length=5, seed=1)
        before = engine.generate([[5, 6, 7], [8, 9]], params)
        info = engine.info()
        assert info["backend"] == "hf" and info["pid"] != os.getpid()
        assert [c.prompt_index for c in before] == [0, 0, 1, 1]
        assert {c.version for c in before} == {0}
        trainer = spec.model.build_model().eval()
        with torch.no_grad():  # the trainer's weights move
            generator = torch.Generator().manual_seed(0)
            for p in trainer.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
        stats = engine.sync(trainer.named_parameters(), 1, bucket_bytes=32768)
        full = sum(p.numel() * p.element_size() for p in trainer.parameters())
        assert stats.bytes == full and stats.buckets == -(-full // 32768)
        assert stats.largest_bucket <= 32768 and stats.metrics()["sync/seconds"] > 0
        after = engine.generate([[5, 6, 7], [8, 9]], params)
        assert {c.version for c in after} == {1}
        assert engine.info()["pid"] == info["pid"]  # the same engine, never restarted
        assert [c.logprobs for c in after] != [c.logprobs for c in before]
        probe = Probe.of(after[0])
        assert logprob_diff(engine.probe(probe), trainer_logprobs(trainer, probe)) < 1e-5
        # Pause-and-update: weights posted while a long request samples (64 rows, 32 batches)
        # are answered at once, taken between two of its batches, and probed after the load.
        # Posted once the request's first batch has its weights (its first boundary passed):
        # that it started (`requests`) let a post under load land before that boundary.
        passed = engine.info()["boundaries"]
        long = engine.submit([[5, 6, 7], [8, 9]], SamplingParams(32, 48, seed=2))
        wait_until(
            lambda: engine.info()["boundaries"] > passed, 60, "the long request's first batch"
        )
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
        posted = post_weights(trainer.named_parameters(), 2, bucket_bytes=32768)
        assert engine.post(posted, probe) == 1  # answered while version 1 samples
        assert not ray.wait([long], timeout=0)[0]  # the request is still running
        versions = [c.version for c in engine.result(long)[0]]
        assert versions[0] == 1 and versions[-1] == 2 and versions == sorted(versions)
        assert logprob_diff(engine.probed(2), trainer_logprobs(trainer, probe)) < 1e-5
        engine.kill()  # Ray ends the actor asynchronously: a call sent at once may still be served
        wait_until(lambda: not engine.alive(timeout_s=5), 30, "the killed engine to be gone")
        with pytest.raises(RolloutEngineDied):
            engine.generate([[5, 6, 7]], params)
    finally:
        engine.kill()
