"""TrainingArgs of preference tuning (issue 35): DPO's fields, and what DPO refuses, named with
the fix before anything is written."""

from __future__ import annotations

import os

import pytest

from ray_trainer import TrainingArgs, run_training
from ray_trainer._errors import TrainingArgsError
from ray_trainer._objectives.dpo import DPO_LOSSES
from ray_trainer._worker.objectives.dpo_loss import check_dpo_options


def test_sft_stays_the_default_and_dpo_takes_trls_defaults():
    args = TrainingArgs()
    assert args.objective == "sft"
    dpo = TrainingArgs(objective="dpo", data="pairs.jsonl")
    assert (dpo.dpo_beta, dpo.dpo_loss, dpo.label_smoothing) == (0.1, "sigmoid", 0.0)
    assert dpo.precompute_reference is True
    # A TrainingArgs passed whole (every field "set") is not refused for its defaults.
    assert TrainingArgs.coerce(dpo).objective == "dpo"
    assert TrainingArgs.coerce(args).objective == "sft"


def test_the_config_and_the_loss_know_the_same_losses():
    assert TrainingArgs.model_fields["dpo_loss"].annotation.__args__ == DPO_LOSSES
    for loss in DPO_LOSSES:
        check_dpo_options(loss, 0.1)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"dpo_beta": 0.2}, "dpo_beta set with objective='sft'"),
        ({"precompute_reference": False}, "set objective='dpo' too"),
        ({"objective": "dpo"}, "objective='dpo' needs data"),
        ({"objective": "dpo", "data": "p.jsonl", "train_on": "all"}, "drop train_on"),
        ({"objective": "dpo", "data": "p.jsonl", "loss_fn": len}, "drop loss_fn"),
        ({"objective": "dpo", "data": "p.jsonl", "dpo_beta": 0}, "dpo_beta"),
        ({"objective": "dpo", "data": "p.jsonl", "dpo_loss": "hinge"}, "dpo_loss"),
        ({"objective": "dpo", "data": "p.jsonl", "label_smoothing": 0.5}, "label_smoothing"),
        (
            {"objective": "dpo", "data": "p.jsonl", "dpo_loss": "ipo", "label_smoothing": 0.1},
            "it has no meaning for IPO",
        ),
        (
            {
                "objective": "dpo",
                "data": "p.jsonl",
                "precompute_reference": False,
                "strategy": "fsdp",
            },
            "keep precompute_reference=True",
        ),
    ],
)
def test_bad_dpo_fields_are_named_with_the_fix(fields, needle, tmp_path):
    with pytest.raises(TrainingArgsError) as info:
        run_training(storage_path=str(tmp_path), **fields)
    assert needle in str(info.value)
    assert os.listdir(tmp_path) == []  # nothing written


def _checkpoint(folder, objective: str | None) -> str:
    """A complete checkpoint whose trainer state records `objective` (None: written before
    DPO existed, an SFT one)."""
    from ray_trainer import _checkpoint as ckpt
    from ray_trainer._model.spec import ModelSpec

    os.makedirs(folder)
    state = ckpt.TrainerState(global_step=2, strategy="ddp")
    if objective is not None:
        state.extra["objective"] = objective
    ckpt.write_rank_part(
        str(folder), rank=0, world_size=1, callback_state={}, user_state={}, extra_files=[],
        trainer_state=state, model_spec=ModelSpec(),
    )  # fmt: skip
    return str(folder)


@pytest.mark.parametrize("recorded", [None, "sft"])
def test_resuming_an_sft_checkpoint_under_dpo_is_refused_with_the_supported_way(tmp_path, recorded):
    from ray_trainer._driver.checks.inputs import _check_objective_resume
    from ray_trainer._storage import locate

    path = _checkpoint(tmp_path / "checkpoint_00000002", recorded)
    args = TrainingArgs(objective="dpo", data="p.jsonl")
    with pytest.raises(TrainingArgsError) as info:
        _check_objective_resume(args, locate(path))
    text = str(info.value)
    assert "trained with objective='sft'" in text
    assert f"model={path + '/hf'!r}" in text and "lora_export='merged'" in text
    _check_objective_resume(TrainingArgs(), locate(path))  # SFT continues SFT


def test_a_dpo_checkpoint_continues_under_dpo_only(tmp_path):
    from ray_trainer._driver.checks.inputs import _check_objective_resume
    from ray_trainer._storage import locate

    path = locate(_checkpoint(tmp_path / "checkpoint_00000004", "dpo"))
    _check_objective_resume(TrainingArgs(objective="dpo", data="p.jsonl"), path)
    with pytest.raises(TrainingArgsError, match="continue it with objective='dpo'"):
        _check_objective_resume(TrainingArgs(), path)
