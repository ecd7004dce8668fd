"""Elastic training on a real cluster: a node lost, then back.

The run's workers go on two worker nodes only (a custom resource that the head does not offer):
A with two CPUs and B with one. The head runs the driver, the callback actor and Ray Train's
controller. The run has an `EvalOnSave` on one CPU and an ``eval`` resource that only A offers,
so its evaluations are A's. The callback actor holds that bundle in a placement group, and
reserves it in Ray's autoscaling coordinator: Ray Train never counts A's second CPU as room for
a worker (its sizing). A run with ``num_workers=[1, 2]`` starts on two workers; when B's raylet
is killed it goes on with ONE worker from its latest checkpoint, and when B returns Ray Train
grows the group back to two. Its checkpoints are written in the background
(`async_checkpoint`): each attempt resumes from a complete one. Each step takes the samples of
two workers at every size, so the loss of every step after a change is the loss of an
uninterrupted two-worker run (fp32, gloo: the reduction order alone differs). From step 30 on,
the smaller group holds each step until Ray Train has grown it back, so the run cannot end
first. The tiny model has no dropout: a rank that was not in a checkpoint has no RNG state.

The reference losses come from the same run on two workers throughout, in the test session's
own Ray, while the cluster's run starts: that run holds at step 12 (its step-10 checkpoint
written) until B is lost, so the reference's length cannot move where the loss falls.

The cluster, this run and its reference are the session fixture `lost_nodes`
(`tests/support/lost_nodes.py`), which trains `test_node_loss.py`'s three runs on the same
cluster at the same time.
"""

from __future__ import annotations

import os

import pytest
from lost_nodes import ELASTIC_STEPS as STEPS

from ray_trainer._checkpoint import verify


def _losses(records):
    """The logged loss of each step, as the last attempt that logged it saw it."""
    losses = {}
    for r in sorted(records, key=lambda r: (r["attempt"], r["t"])):
        if r["event"] == "on_log" and r["rank"] == 0:
            losses[r["step"]] = r["loss"]
    return losses


def test_a_lost_node_shrinks_the_group_its_return_grows_it_and_the_losses_match(lost_nodes):
    run = lost_nodes["elastic"]
    assert run["reference"] == (STEPS, 1)
    outcome, out = run["outcome"]
    assert outcome.get("global_step") == STEPS, out[-4000:]
    # The evaluations ran beside the workers at every size (never starved: their CPU stays theirs):
    # every scheduled save was evaluated, the one the loss cut off before its publication too
    # (published by the attempt that resumed from it: the next test). A resize's own save (step
    # 28) is evaluated as well.
    evaluated, saves = outcome["evaluated"], set(range(5, STEPS + 1, 5))
    assert evaluated[-1] == STEPS, evaluated
    assert saves <= set(evaluated), evaluated

    rs = run["records"]
    # Each attempt resumed from a checkpoint that is complete (never one half-written).
    loaded = {r["checkpoint_path"] for r in rs if r["event"] == "on_load_checkpoint"}
    assert len(loaded) >= 2
    for name in loaded:
        verify(str(run["storage"] / os.path.basename(name)))
    # The size of each attempt that trained (a start that failed while Ray Train still saw
    # the lost node has none): 2, then 1 (A holds one worker, and the evaluations), then 2.
    begun = {r["attempt"]: r["world_size"] for r in rs if r["event"] == "on_train_begin"}
    sizes = [begun[a] for a in sorted(begun)]
    assert sizes[0] == 2 and 1 in sizes and sizes[-1] == 2, sizes
    assert sizes.index(1) < len(sizes) - 1, sizes  # grown back after the loss
    small = min(a for a, n in begun.items() if n == 1)
    # One worker took every sample of a two-worker step: two micro-batches of 8.
    one = [r for r in rs if r["attempt"] == small and r["event"] == "on_before_forward"]
    assert {r["micro_step"] for r in one} == {0, 1}
    # Samples are counted per step, whatever the size (a step redone is not counted twice).
    ends = [r for r in rs if r["event"] == "on_step_end" and r["rank"] == 0]
    assert all(r["samples_seen"] == r["step"] * 16 for r in ends)

    want, got = _losses(run["ref_records"]), _losses(rs)
    assert set(got) == set(want) == set(range(1, STEPS + 1))
    resumed = min(r["step"] for r in rs if r["attempt"] == small and r["event"] == "on_log")
    assert resumed <= 26  # from a checkpoint saved around the loss
    for step in range(resumed, STEPS + 1):
        assert got[step] == pytest.approx(want[step], rel=1e-4), step
    # The console told of each change (printed by the callback actor, shown by the driver).
    assert "training on 1 worker(s), was 2" in out
    assert "training on 2 worker(s), was 1" in out


def test_every_checkpoint_resumed_from_was_published_with_on_save(lost_nodes):
    """An asynchronous save that every rank wrote but whose publication fell at a boundary the
    group never reached (B lost first: seen in CI on 2026-11-28 at step 10) is published by the
    attempt that resumes from it, so its evaluation runs like any other's."""
    run = lost_nodes["elastic"]
    outcome, _ = run["outcome"]
    loaded = {r["step"] for r in run["records"] if r["event"] == "on_load_checkpoint" and r["step"]}
    assert loaded <= set(outcome["evaluated"]), (loaded, outcome["evaluated"])
