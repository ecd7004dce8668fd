"""Asynchronous checkpoints (issue 21, point 2): training goes on while slow storage is written.

Reads the session's `fsdp_runs` (`tests/support/shared_runs.py`, shared with `test_fsdp.py`):
one FSDP run on 2 gloo workers with a real Hugging Face model writes its checkpoints through a
filesystem that writes slowly (`slow_storage.py`, as network storage) and kills rank 1 while
it writes its shard of the step-4 checkpoint; one DDP run writes to a local folder. Each
checkpoint's ``hf/`` export is opened with ``from_pretrained`` in an ``EvalOnSave`` task.
"""

from __future__ import annotations

import json
import os

import pytest


@pytest.fixture(scope="module")
def runs(fsdp_runs):
    return {**fsdp_runs, "records": fsdp_runs["fsdp_records"]}


def _lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f.read().splitlines()]


def test_steps_go_on_while_a_checkpoint_is_written(runs):
    rank0 = [r for r in runs["records"] if r["rank"] == 0 and r["attempt"] == 0]
    saved = next(i for i, r in enumerate(rank0) if r["event"] == "on_save")
    assert rank0[saved]["step"] == 2  # the checkpoint's own step, announced late
    later = [r["step"] for r in rank0[:saved] if r["event"] == "on_step_end" and r["step"] > 2]
    assert later, "no step ran while the step-2 checkpoint was written"


def test_on_save_fires_only_once_every_rank_has_written(runs):
    for name in ("fsdp", "ddp"):
        announced = runs["on_save"][name]
        assert announced, name
        for record in announced:
            assert record["error"] is None, record
            assert record["verified"] == record["announced"], record


def test_a_worker_killed_mid_write_leaves_the_previous_checkpoint_as_the_latest(runs):
    result, records = runs["fsdp"], runs["records"]
    assert "checkpoint_00000004" in runs["crashed"] and result.attempts == 2
    loads = {(r["rank"], r["step"]) for r in records if r["event"] == "on_load_checkpoint"}
    assert loads == {(0, 2), (1, 2)}  # not the half-written step 4
    # Each checkpoint announced once per attempt that completed it; step 4 after the restart.
    steps = [(r["attempt"], r["announced"]) for r in runs["on_save"]["fsdp"]]
    assert steps == [(0, 2), (1, 4), (1, 6)], steps


def test_the_final_save_is_complete_when_run_training_returns(runs):
    from ray_trainer._checkpoint import verify

    for name, step in (("fsdp", 6), ("ddp", 4)):
        result = runs[name]
        assert result.global_step == step
        assert result.checkpoint_path.endswith(f"checkpoint_{step:08d}")
        assert verify(result.checkpoint_path).global_step == step  # every manifest there
        folder = result.checkpoint_path
        manifests = [_lines(os.path.join(folder, f"rank{r}.complete"))[0] for r in (0, 1)]
        assert manifests[0]["save"] == manifests[1]["save"]


def test_the_hf_export_written_in_the_background_equals_the_checkpoint(runs):
    for name, steps in (("fsdp", [2, 4, 6]), ("ddp", [2, 4])):
        evals = runs[name].evaluations
        assert [e["step"] for e in evals] == steps, evals
        for e in evals:
            assert e["metrics"]["max_abs_diff"] == 0.0, e
