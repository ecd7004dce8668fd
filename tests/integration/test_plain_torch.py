"""The plain PyTorch path (real Ray, gloo, accelerate): a torch Dataset of ``{"x", "y"}`` items
without labels or tokens, a model whose ``forward(x, y)`` returns its loss as a scalar tensor,
or its predictions with a ``loss_fn``; on 1 worker and on 2, as docs/api.md describes it.

Each configuration trains once (a module fixture, shared by the tests that read it): 10 steps
of 2 micro-batches of 8 samples per worker. Two configurations, not four: each run took 19 to
44 s on the shared 2-core machine (the four: 112 s); the other two pairings (1 worker with a
``loss_fn``, 2 workers with the model's own loss) differ from these only in what
``tests/unit/test_worker_workload_plain.py`` checks without Ray.
"""

from __future__ import annotations

import os

import pytest
import torch
from plain_torch_support import (
    LossModel,
    PlainPairs,
    PlainRecorder,
    PredictModel,
    mse,
    read_params,
)
from rt_support import read_records

STEPS, BATCH, ACCUM = 10, 8, 2
CONFIGS = {  # name: (workers, loss_fn)
    "1-worker-own-loss": (1, False),  # issue 47's regression: it failed at its first step
    "2-workers-loss-fn": (2, True),
}
#: Runs with Ray Train's state tracking on, as on a cluster with a dashboard (the session's Ray
#: has none, where the runner turns it off): the controller asks rank 0 for torch's version.
STATE_TRACKED = {"2-workers-loss-fn"}
#: Per state-tracked configuration, the framework versions Ray Train's state actor recorded.
TRACKED_VERSIONS: dict[str, dict] = {}


#: Per configuration, the class of every Ray actor its run started (from the GCS's actor table,
#: which keeps those that ended).
STARTED_ACTORS: dict[str, list[str]] = {}


def _actors(ray) -> dict[str, str]:
    return {i: a["ActorClassName"] for i, a in ray._private.state.actors().items()}


@pytest.fixture(scope="module")
def runs(ray_session, tmp_path_factory):
    """The result and records of each configuration, trained on first use."""
    from ray_trainer import run_training

    done: dict = {}

    def get(name: str):
        if name not in done:
            before = _actors(ray_session)
            workers, with_loss_fn = CONFIGS[name]
            folder = str(tmp_path_factory.mktemp(name))
            tracked = name in STATE_TRACKED
            if tracked:  # a value the user set is kept (`_driver/console.py`)
                os.environ["RAY_TRAIN_ENABLE_STATE_TRACKING"] = "1"
            try:
                result = run_training(
                    model=PredictModel if with_loss_fn else LossModel,
                    loss_fn=mse if with_loss_fn else None,
                    data=PlainPairs(512),
                    num_workers=workers,
                    batch_size=BATCH,
                    grad_accum_steps=ACCUM,
                    max_steps=STEPS,
                    learning_rate=0.05,
                    lr_schedule="constant",
                    log_every_steps=1,
                    storage_path=str(tmp_path_factory.mktemp("storage")),
                    run_name=name,
                    callbacks=[PlainRecorder(folder)],
                )
            finally:
                os.environ.pop("RAY_TRAIN_ENABLE_STATE_TRACKING", None)
            if tracked:  # then the detached state actor goes: nothing else here reads it
                from ray.train.v2._internal.state.state_actor import get_state_actor

                actor = get_state_actor()
                runs_ = ray_session.get(actor.get_train_runs.remote()).values()
                TRACKED_VERSIONS[name] = next(r for r in runs_ if r.name == name).framework_versions
                ray_session.kill(actor)
            done[name] = (result, read_records(folder, "plain"), folder)
            after = _actors(ray_session)
            STARTED_ACTORS[name] = sorted(c for i, c in after.items() if i not in before)
        return done[name]

    return get


@pytest.mark.parametrize("name", list(CONFIGS))
def test_it_trains_and_logs_the_mean_over_the_global_batch(runs, name):
    result, records, _ = runs(name)
    workers = CONFIGS[name][0]
    assert result.global_step == STEPS and not result.callback_errors
    micro = [r for r in records if r["event"] == "micro"]
    logs = {r["step"]: r["loss"] for r in records if r["event"] == "log"}
    assert sorted(logs) == list(range(1, STEPS + 1))
    for step, loss in logs.items():
        mine = [r for r in micro if r["step"] == step]
        # Every micro-batch of every rank is a real one of BATCH samples (no filler).
        assert sorted((r["rank"], r["micro"]) for r in mine) == [
            (rank, m) for rank in range(workers) for m in range(ACCUM)
        ]
        assert {r["samples"] for r in mine} == {BATCH}
        expected = sum(r["sum"] for r in mine) / sum(r["samples"] for r in mine)
        assert loss == pytest.approx(expected, rel=1e-5), step
    if workers == 2:  # the ranks saw different samples: the mean is not rank 0's
        rank0 = [r["sum"] for r in micro if r["step"] == 1 and r["rank"] == 0]
        rank0_mean = sum(rank0) / (BATCH * ACCUM)
        assert logs[1] != pytest.approx(rank0_mean, rel=1e-3)
    assert logs[STEPS] < 0.5 * logs[1], logs  # a learnable regression: the loss falls
    per_step = BATCH * ACCUM * workers
    assert result.metrics["samples_seen"] == STEPS * per_step
    assert result.metrics["tokens_seen"] == 0  # no input_ids: nothing is a token


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_checkpoint_loads_as_the_trained_module(runs, name):
    from ray_trainer import load_model

    result, _, folder = runs(name)
    assert result.checkpoint_path is not None
    assert result.checkpoint_path.endswith(f"checkpoint_{STEPS:08d}")
    trained = [read_params(folder, rank) for rank in range(CONFIGS[name][0])]
    model = load_model(result.checkpoint_path, trust_factory=True)  # a factory of this test
    assert type(model) is (PredictModel if CONFIGS[name][1] else LossModel)
    loaded = model.state_dict()
    assert set(loaded) == set(trained[0]) == {"linear.weight", "linear.bias"}
    for params in trained:  # every rank ends with the weights the checkpoint holds
        for key, value in params.items():
            assert torch.equal(loaded[key], value), key


def test_on_a_ray_without_a_dashboard_no_placement_group_cleaner_starts(runs):
    """The session's Ray has no dashboard (conftest.py): Ray Train's placement-group cleaner,
    which can only ask the dashboard's state API whether the controller lives, is left out of
    the run (`_driver/trainer.py`); a bare `TorchTrainer` on the same Ray starts one per fit."""
    runs("1-worker-own-loss")
    started = STARTED_ACTORS["1-worker-own-loss"]
    assert {"TrainController", "RayTrainWorker", "SynchronizationActor"} <= set(started), started
    assert "PlacementGroupCleaner" not in started, started


def test_the_controller_never_imports_torch(runs):
    """Ray Train's controller unpickles the run's backend config, `LeanTorchConfig`, whose module
    imports no torch (`_driver/torch_backend.py`): its process has no torch library mapped
    while the workers train (a `TorchConfig` loads it there), and the gloo group it set up
    trained both ranks (the other tests of this module)."""
    _, records, _ = runs("2-workers-loss-fn")
    assert [r["torch_loaded"] for r in records if r["event"] == "controller"] == [False]


def test_state_tracking_records_torchs_version_without_torch_in_the_controller(runs):
    """With Ray Train's state tracking on (a cluster with a dashboard), the controller asks rank
    0 for torch's version before the run's function starts; the workers send it as a plain
    `str` (`_driver/torch_backend.py`), so the controller, still without torch when the run
    begins (the test above, on this state-tracked run), and the state actor record it without
    importing torch."""
    runs("2-workers-loss-fn")
    assert "2-workers-loss-fn" in STATE_TRACKED
    versions = TRACKED_VERSIONS["2-workers-loss-fn"]
    assert versions["torch"] == torch.__version__ and type(versions["torch"]) is str, versions
