"""Losing a node mid-run, on a real three-node local cluster (a head and two more raylets).

Killing a node's raylet takes down the workers on it. Two runs lose the node 127.0.0.3 at once,
each held at a known step: the one the remaining nodes have room for is restarted on the head by
Ray Train and completes from its latest checkpoint; the other fails with an error that says so,
never a hang. At the same time a third run, with a worker on 127.0.0.4, sees that node drained
for preemption (what a spot reclaim looks like to Ray): it saves at its next step boundary; at
the drain deadline Ray Train restarts the workers and the run resumes from there. Custom
resources keep each run on its own pair of nodes: "spread" on the head and the lost node,
"slot" likewise (1 on the head, so that one worker only fits there after the loss), "drain" on
the head and the preempted node. The three runs share the cluster's start and their own
start-up time.
"""

from __future__ import annotations

import subprocess

import pytest
from driver_process import driver_outcome, start_driver, wait_for_run
from local_cluster import LocalCluster
from rt_support import read_records

NODE, PREEMPTED = "127.0.0.3", "127.0.0.4"


@pytest.fixture(scope="module")
def cluster():
    # Head: 6 CPUs (each run's restarted workers fit there at once); the lost node: 2 CPUs; the
    # preempted node: 1 CPU.
    c = LocalCluster(
        num_cpus=6,
        resources={"spread": 2, "slot": 1, "drain": 2},
        fast_failure_detection=True,
    )
    c.start()
    try:
        c.add_node(NODE, num_cpus=2, resources={"spread": 1, "slot": 2})
        c.add_node(PREEMPTED, num_cpus=1, resources={"drain": 1})
        yield c
    finally:
        c.stop()


def _fields(tmp_path, name, hold_at, **fields):
    """A run of `num_workers=2` whose rank 0 holds at step `hold_at` (its checkpoints of the
    steps before written) until the worker group is restarted or the test releases it: the
    node is lost or drained while the run is at a known step."""
    return {
        "num_workers": 2,
        "placement_strategy": "SPREAD",  # one worker on each node of its pair
        "storage_path": str(tmp_path),
        "run_name": name,
        "_hold_at": [str(tmp_path / f"{name}-hold"), hold_at],
        **fields,
    }


@pytest.fixture(scope="module")
def runs(cluster, tmp_path_factory):
    """The three runs at once. The lost node goes under "spread" and "no-room", both held at
    step 11 after their step-10 checkpoint: the head alone still has room for the first's
    workers, not for the second's (each of its workers needs a "slot", and the head has 1).
    The preempted node is drained under "preempted", held at step 10, then released."""
    tmp_path = tmp_path_factory.mktemp("node-loss")
    node_id = cluster.node_id(PREEMPTED)
    lost = {"max_steps": 40, "save_every_steps": 5, "max_failures": 1}
    preempted = {
        "max_steps": 150,  # 15 s of 0.1 s steps: the deadline falls well inside the run
        "save_every_steps": 1000,  # no scheduled save before the end: any other is the notice's
        "resources_per_worker": {"CPU": 1, "drain": 1},
        "_records": str(tmp_path / "records"),
        "_env": {"RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.5"},
    }
    runs = {
        "spread": _fields(tmp_path, "spread", 11, **lost,
                          resources_per_worker={"CPU": 1, "spread": 1}),
        "no-room": _fields(tmp_path, "no-room", 11, **lost,
                           resources_per_worker={"CPU": 1, "slot": 1},
                           worker_start_timeout_s=10, max_start_retries=0),
        "preempted": _fields(tmp_path, "preempted", 10, **preempted),
    }  # fmt: skip
    drivers = {name: start_driver(cluster, fields) for name, fields in runs.items()}
    try:
        for name, driver in drivers.items():
            held = tmp_path / f"{name}-hold" / "held"
            wait_for_run(driver, held.exists, f"{name}'s hold", timeout_s=300)
        cluster.raylet(NODE).kill()
        at = max(_rank0_steps(runs["preempted"]["_records"], 0))
        # What the cloud's autoscaler does on a spot reclaim notice: drain the node, with the
        # time left before it goes away.
        drain = subprocess.run(
            ["ray", "drain-node", f"--address={cluster.gcs_address}",
             f"--node-id={node_id}", "--reason=DRAIN_NODE_REASON_PREEMPTION",
             "--reason-message=spot reclaim (test)", "--deadline-remaining-seconds=5"],
            env=cluster.env(),
            capture_output=True,
            text=True,
            timeout=60,
        )  # fmt: skip
        assert drain.returncode == 0, drain.stdout + drain.stderr
        (tmp_path / "preempted-hold" / "release").write_text("go")
        outcomes = {
            name: driver_outcome(driver, f"{name}'s node was lost or drained")
            for name, driver in drivers.items()
        }
    finally:
        for driver in drivers.values():
            if driver.poll() is None:
                driver.kill()
    return {"tmp_path": tmp_path, "at": at, "outcomes": outcomes}


def test_lost_node_restarts_on_the_remaining_node(runs):
    assert runs["outcomes"]["spread"][0] == {"global_step": 40, "attempts": 2}


def test_lost_node_without_room_fails_clearly(runs):
    outcome = runs["outcomes"]["no-room"][0]
    assert "error" in outcome, outcome
    assert "can no longer place the workers" in outcome["error"]
    assert "room for 1 such worker(s)" in outcome["error"]


def _rank0_steps(folder, attempt):
    return [
        r["step"]
        for r in read_records(folder, "all_ranks")
        if r["rank"] == 0 and r["event"] == "on_step_end" and r["attempt"] == attempt
    ]


def test_preemption_notice_saves_then_the_run_resumes_from_that_checkpoint(runs):
    tmp_path, at = runs["tmp_path"], runs["at"]
    outcome, out = runs["outcomes"]["preempted"]
    # One unscheduled save after the notice, then the restart at the deadline resumed from it.
    saved = sorted(
        int(p.name.split("_")[1]) for p in (tmp_path / "preempted").glob("checkpoint_0*")
    )
    assert len(saved) == 2 and saved[-1] == 150, saved
    assert at <= saved[0] < 100
    assert outcome == {"global_step": 150, "attempts": 2}, out[-3000:]
    assert min(_rank0_steps(str(tmp_path / "records"), 1)) == saved[0] + 1
