"""Elastic training on a real cluster whose head trains nothing: a node lost, then back.

The cluster is shaped as `cluster.yaml`'s: a head that offers no CPU (it runs the driver, the
callback actor and Ray Train's controller) and two worker nodes, A with two CPUs and B with
one. The run has an `EvalOnSave` on one CPU and an ``eval`` resource that only A offers, so its
evaluations are A's. The callback actor holds that bundle in a placement group, and reserves it
in Ray's autoscaling coordinator: Ray Train never counts A's second CPU as room for a worker
(its sizing), nor takes it (Ray Train 2.60's first restart after a loss, at the old size, would
otherwise put both workers on A whenever no evaluation held that CPU at that moment). A run
with ``num_workers=[1, 2]`` starts on two workers; when B's raylet is killed it goes on with ONE
worker from its latest checkpoint, and when B returns Ray Train grows the group back to two.
Its checkpoints are written in the background (`async_checkpoint`): each attempt resumes from a
complete one. Each step takes the samples of two workers at every size, so the loss of every
step after a change is the loss of an uninterrupted two-worker run (fp32, gloo: the reduction
order alone differs). From step 30 on, the smaller group holds each step until Ray Train has
grown it back, so the run cannot end first. The tiny model has no dropout: a rank that was not
in a checkpoint has no RNG state.

The reference losses come from the same run on two workers throughout, in the test session's
own Ray, while the cluster's run starts: that run holds at step 12 (its step-10 checkpoint
written) until B is lost, so the reference's length cannot move where the loss falls.
"""

from __future__ import annotations

import os

import pytest
from driver_process import driver_outcome, start_driver, wait_for_run
from local_cluster import LocalCluster
from rt_support import AllRanksRecorder, TinyDataset, TinyRegressor, read_records

from ray_trainer._checkpoint import verify

NODE_A, NODE_B = "127.0.0.3", "127.0.0.4"
STEPS = 60


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster(num_cpus=0, fast_failure_detection=True)
    c.start()
    c.add_node(NODE_A, num_cpus=2, resources={"eval": 1})
    c.add_node(NODE_B, num_cpus=1)
    yield c
    c.stop()


def _fields(tmp_path, name, records, **extra):
    return {
        **extra,
        "num_workers": [1, 2],
        "placement_strategy": "SPREAD",  # a worker on each node: B's loss takes one
        "elastic_resize_interval_s": 3.0,
        "max_steps": STEPS,
        "save_every_steps": 5,
        "log_every_steps": 1,
        "learning_rate": 0.01,
        "storage_path": str(tmp_path / "storage"),
        "run_name": name,
        "worker_start_timeout_s": 15,  # the first restart after the loss waits it out
        "_records": str(records),
        "_eval": {"num_gpus": 0, "num_cpus": 1, "resources": {"eval": 1}},  # one of A's CPUs
        # Ray Train sizes the group from Ray's autoscaling coordinator, whose view of the nodes
        # is refreshed every 20 s: the loss and the return would be seen up to 20 s late each.
        "_coordinator_tick_s": 0.5,
    }


def _records(folder):
    try:
        return read_records(str(folder), "all_ranks")
    except (FileNotFoundError, ValueError):  # not written yet, or a line being written
        return []


def _reached(folder, world_size, step, after=-1):
    """Whether a group of `world_size` workers (an attempt after `after`) ended `step`."""
    return any(
        r["event"] == "on_step_end"
        and r["world_size"] == world_size
        and r["attempt"] > after
        and r["step"] >= step
        for r in _records(folder)
    )


def _losses(records):
    """The logged loss of each step, as the last attempt that logged it saw it."""
    losses = {}
    for r in sorted(records, key=lambda r: (r["attempt"], r["t"])):
        if r["event"] == "on_log" and r["rank"] == 0:
            losses[r["step"]] = r["loss"]
    return losses


def _reference(tmp_path, records):
    """The same run on two workers throughout (a fixed size: the session's own autoscaling
    coordinator never sizes it), in this process's shared session, without the pace and the
    evaluations of the cluster's run: neither changes a loss."""
    from ray_trainer import run_training

    keep = ("max_steps", "save_every_steps", "log_every_steps", "learning_rate", "storage_path")
    fields = _fields(tmp_path, "ref", records)
    return run_training(
        model=TinyRegressor,
        data=TinyDataset,
        batch_size=8,  # as node_loss_driver.py's runs
        num_workers=2,
        run_name="ref",
        callbacks=[AllRanksRecorder(str(records))],
        **{k: fields[k] for k in keep},
    )


def test_a_lost_node_shrinks_the_group_its_return_grows_it_and_the_losses_match(
    cluster, ray_session, tmp_path
):
    records, hold = tmp_path / "records", tmp_path / "hold"
    # Saves are written in the background. Rank 0 holds step 12 on the first attempt (until
    # the loss restarts the group), so the reference below can run while this one starts.
    driver = start_driver(
        cluster,
        _fields(tmp_path, "elastic", records, async_checkpoint=True,
                _hold_while_small=[30, 2], _hold_at=[str(hold), 12]),
    )  # fmt: skip
    ref_records = tmp_path / "ref-records"
    try:
        reference = _reference(tmp_path, ref_records)
        assert (reference.global_step, reference.attempts) == (STEPS, 1)
    except BaseException:
        driver.kill()
        raise

    wait_for_run(
        driver,
        lambda: (hold / "held").exists() and _reached(records, 2, 12),
        "step 12 on two workers",
    )
    cluster.raylet(NODE_B).kill()  # one worker's node is gone
    wait_for_run(driver, lambda: _reached(records, 1, 20), "step 20 on the remaining node")
    cluster.add_node(NODE_B, num_cpus=1)  # the node is back: the group grows
    outcome, out = driver_outcome(driver, "the node's return", 300)
    assert outcome.get("global_step") == STEPS, out[-4000:]
    # The evaluations ran beside the workers at every size (never starved: their CPU stays theirs).
    assert outcome["evaluated"][-1] == STEPS and len(outcome["evaluated"]) >= STEPS // 5

    rs = _records(records)
    # Each attempt resumed from a checkpoint that is complete (never one half-written).
    loaded = {r["checkpoint_path"] for r in rs if r["event"] == "on_load_checkpoint"}
    assert len(loaded) >= 2
    for name in loaded:
        verify(str(tmp_path / "storage" / "elastic" / os.path.basename(name)))
    # The size of each attempt that trained (a start that failed while Ray Train still saw
    # the lost node has none): 2, then 1 (A's 2 CPUs hold 1 worker + the evaluations), then 2.
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

    want, got = _losses(_records(ref_records)), _losses(rs)
    assert set(got) == set(want) == set(range(1, STEPS + 1))
    resumed = min(r["step"] for r in rs if r["attempt"] == small and r["event"] == "on_log")
    assert resumed <= 26  # from a checkpoint saved around the loss
    for step in range(resumed, STEPS + 1):
        assert got[step] == pytest.approx(want[step], rel=1e-4), step
    # The console told of each change (printed by the callback actor, shown by the driver).
    assert "training on 1 worker(s), was 2" in out
    assert "training on 2 worker(s), was 1" in out
