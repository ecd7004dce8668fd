"""Losing a node mid-run, on a real two-node local cluster (a head and a second raylet).

Killing the second node's raylet takes down the workers on it. Two runs lose it at once, each
held at a known step: the one the remaining node has room for is restarted there by Ray Train and
completes from its latest checkpoint; the other fails with an error that says so, never a hang. A node drained for
preemption (what a spot reclaim looks like to Ray) makes the run save at its next step
boundary; at the drain deadline Ray Train restarts the workers and the run resumes from there.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from driver_process import driver_outcome, start_driver, wait_for_run
from local_cluster import LocalCluster
from rt_support import read_records

NODE = "127.0.0.3"


@pytest.fixture(scope="module")
def cluster():
    # Head: 4 CPUs and 1 "slot"; each second node: 2 CPUs and 2 "slots".
    c = LocalCluster(num_cpus=4, resources={"slot": 1}, fast_failure_detection=True)
    c.start()
    yield c
    c.stop()


def _fields(tmp_path, name, **fields):
    """A 40-step run whose rank 0 holds at step 11 (its checkpoint of step 10 written) until the
    worker group is restarted: the node is lost while the run is at a known step."""
    return {
        "num_workers": 2,
        "max_steps": 40,
        "save_every_steps": 5,
        "max_failures": 1,
        "placement_strategy": "SPREAD",  # one worker on each node
        "storage_path": str(tmp_path),
        "run_name": name,
        "_hold_at": [str(tmp_path / f"{name}-hold"), 11],
        **fields,
    }


@pytest.fixture(scope="module")
def lost_node(cluster, tmp_path_factory):
    """Two runs at once, each with a worker on the second node, which is lost under both: the
    head alone still has room for one run's workers ("spread"), and not for the other's ("no-room":
    each of its workers needs a "slot", and the head has 1)."""
    tmp_path = tmp_path_factory.mktemp("lost-node")
    cluster.add_node(NODE, num_cpus=2, resources={"slot": 2})
    runs = {
        "spread": {},
        "no-room": {
            "resources_per_worker": {"CPU": 1, "slot": 1},
            "worker_start_timeout_s": 10,
            "max_start_retries": 0,
        },
    }
    drivers = {
        name: start_driver(cluster, _fields(tmp_path, name, **f)) for name, f in runs.items()
    }
    for name, driver in drivers.items():
        wait_for_run(driver, lambda n=name: (tmp_path / f"{n}-hold" / "held").exists(), "step 11")
    cluster.raylet(NODE).kill()
    return {
        name: driver_outcome(driver, "the node was lost")[0] for name, driver in drivers.items()
    }


def test_lost_node_restarts_on_the_remaining_node(lost_node):
    assert lost_node["spread"] == {"global_step": 40, "attempts": 2}


def test_lost_node_without_room_fails_clearly(lost_node):
    outcome = lost_node["no-room"]
    assert "error" in outcome, outcome
    assert "can no longer place the workers" in outcome["error"]
    assert "room for 1 such worker(s)" in outcome["error"]


def _node_id(cluster, ip):
    """The Ray node id of the raylet on `ip` (asked from a process of its own, like the driver:
    this pytest process never joins the test cluster)."""
    ask = (
        "import ray, sys; ray.init(address=sys.argv[1]); "
        "print(next(n['NodeID'] for n in ray.nodes() if n['Alive'] "
        "and n['NodeManagerAddress'] == sys.argv[2]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", ask, cluster.gcs_address, ip],
        env=cluster.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def _rank0_steps(folder, attempt):
    return [
        r["step"]
        for r in read_records(folder, "all_ranks")
        if r["rank"] == 0 and r["event"] == "on_step_end" and r["attempt"] == attempt
    ]


def test_preemption_notice_saves_then_the_run_resumes_from_that_checkpoint(cluster, tmp_path):
    cluster.add_node(NODE, num_cpus=2, resources={"slot": 2})
    node_id = _node_id(cluster, NODE)
    records, name = str(tmp_path / "records"), "preempted"
    fields = {
        "num_workers": 2,
        "max_steps": 150,  # 15 s of 0.1 s steps: the deadline falls well inside the run
        "save_every_steps": 1000,  # no scheduled save before the end: any other is the notice's
        "placement_strategy": "SPREAD",  # one worker on the node that will be preempted
        "storage_path": str(tmp_path),
        "run_name": name,
        "_records": records,
        "_env": {"RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.5"},
    }
    driver = start_driver(cluster, fields)
    wait_for_run(
        driver, lambda: os.path.isdir(records) and len(_rank0_steps(records, 0)) >= 10, "step 10"
    )
    at = max(_rank0_steps(records, 0))
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
    outcome, out = driver_outcome(driver, "the preemption notice")
    # One unscheduled save after the notice, then the restart at the deadline resumed from it.
    saved = sorted(int(p.name.split("_")[1]) for p in (tmp_path / name).glob("checkpoint_0*"))
    assert len(saved) == 2 and saved[-1] == 150, saved
    assert at <= saved[0] < 100
    assert outcome == {"global_step": 150, "attempts": 2}, out[-3000:]
    assert min(_rank0_steps(records, 1)) == saved[0] + 1
