"""Models larger than one device (issue 14): FSDP2 on 2 gloo workers, real Ray, a real HF model.

Reads the session's `fsdp_runs` (`tests/support/shared_runs.py`, shared with
`test_async_checkpoint.py`): one FSDP run whose rank 1 is killed while it writes its shard of
the step-4 checkpoint (it resumes from its sharded step-2 checkpoint), its continuation on 1
worker (DCP reshards), and a DDP run from the same seed for comparison; every checkpoint's
`hf/` export is loaded with `from_pretrained` in an `EvalOnSave` task.
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def runs(fsdp_runs):
    return fsdp_runs


def _logged_losses(records, attempt=0):
    return {
        r["step"]: r["loss"]
        for r in records
        if r["event"] == "on_log" and r["rank"] == 0 and r["attempt"] == attempt
    }


def test_every_rank_holds_about_half_of_the_parameters(runs):
    first = [r for r in runs["shards"] if r["attempt"] == 0]
    assert {r["rank"] for r in first} == {0, 1}
    for r in first:
        assert 0.4 < r["local"] / r["total"] < 0.6, r


def test_the_loss_falls_and_a_crash_on_rank_1_resumes_from_the_sharded_checkpoint(runs):
    result, records = runs["fsdp"], runs["fsdp_records"]
    assert (result.global_step, result.attempts) == (6, 2)
    loads = {(r["rank"], r["step"]) for r in records if r["event"] == "on_load_checkpoint"}
    assert loads == {(0, 2), (1, 2)}
    losses = {**_logged_losses(records, 0), **_logged_losses(records, 1)}
    assert losses[6] < losses[1]
    names = sorted(os.listdir(result.checkpoint_path))
    assert "shards" in names and "model.pt" not in names  # sharded, never gathered whole
    shards = sorted(os.listdir(os.path.join(result.checkpoint_path, "shards")))
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_a_two_worker_checkpoint_continues_on_one_worker(runs):
    one, records = runs["one"], runs["one_records"]
    assert one.global_step == 8 and not one.stopped_early
    loads = [r for r in records if r["event"] == "on_load_checkpoint"]
    assert [(r["rank"], r["world_size"], r["step"]) for r in loads] == [(0, 1, 6)]
    assert [r["step"] for r in records if r["event"] == "on_step_end"] == [7, 8]


def test_the_hf_export_loads_with_from_pretrained_and_equals_load_model(runs):
    evals = runs["fsdp"].evaluations
    assert [e["step"] for e in evals] == [2, 4, 6], evals
    for e in evals:
        assert e["metrics"]["max_abs_diff"] == 0.0
    hf = os.path.join(runs["fsdp"].checkpoint_path, "hf")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(hf))


def test_ddp_and_fsdp_from_the_same_seed_give_the_same_losses(runs):
    # FSDP's step 3 is the resumed attempt's (rank 1 crashed writing the step-4 checkpoint of
    # the first, which resumed from step 2): the resume from the sharded checkpoint is exact too.
    ddp = _logged_losses(runs["ddp_records"])
    fsdp = {**_logged_losses(runs["fsdp_records"], 0), **_logged_losses(runs["fsdp_records"], 1)}
    for step in (1, 2, 3):
        assert fsdp[step] == pytest.approx(ddp[step], rel=1e-3), (step, fsdp, ddp)
