"""Losing a node mid-run, on a real two-node local cluster (a head and a second raylet).

Killing the second node's raylet takes down the workers on it. With room left for the workers,
Ray Train restarts them on the remaining node and the run completes from its latest checkpoint;
with no room, the run fails with an error that says so, never a hang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from local_cluster import LocalCluster

HERE = os.path.dirname(os.path.abspath(__file__))
NODE = "127.0.0.3"


@pytest.fixture(scope="module")
def cluster():
    # Head: 4 CPUs and 1 "slot"; each second node: 2 CPUs and 2 "slots".
    c = LocalCluster(num_cpus=4, resources={"slot": 1}, fast_failure_detection=True)
    c.start()
    yield c
    c.stop()


def _train_then_kill(cluster, tmp_path, name, **fields):
    """Start a run in a driver process; once its checkpoint at step 10 exists, kill the node."""
    cluster.add_node(NODE, num_cpus=2, resources={"slot": 2})
    fields = {
        "num_workers": 2,
        "max_steps": 40,
        "save_every_steps": 5,
        "max_failures": 1,
        "storage_path": str(tmp_path),
        "run_name": name,
        **fields,
    }
    driver = subprocess.Popen(
        [
            sys.executable,
            os.path.join(HERE, "node_loss_driver.py"),
            cluster.gcs_address,
            json.dumps(fields),
        ],
        env=cluster.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 180
    while not os.path.isdir(tmp_path / name / "checkpoint_00000010"):
        if driver.poll() is not None or time.monotonic() > deadline:
            driver.kill()
            pytest.fail(f"the run never reached step 10:\n{driver.stdout.read()[-4000:]}")
        time.sleep(0.2)
    cluster.raylet(NODE).kill()
    try:
        out, _ = driver.communicate(timeout=240)  # never a hang
    except subprocess.TimeoutExpired:
        driver.kill()
        pytest.fail("the run hung after the node was lost")
    line = next((x for x in out.splitlines() if x.startswith("OUTCOME ")), None)
    assert line, out[-4000:]
    return json.loads(line[len("OUTCOME ") :])


def test_lost_node_restarts_on_the_remaining_node(cluster, tmp_path):
    # SPREAD puts one worker on each node; the head alone still has room for both.
    outcome = _train_then_kill(cluster, tmp_path, "spread", placement_strategy="SPREAD")
    assert outcome == {"global_step": 40, "attempts": 2}


def test_lost_node_without_room_fails_clearly(cluster, tmp_path):
    # Each worker needs a "slot": the head has 1, so after the loss 2 workers cannot fit.
    outcome = _train_then_kill(
        cluster,
        tmp_path,
        "no-room",
        resources_per_worker={"CPU": 1, "slot": 1},
        worker_start_timeout_s=10,
        max_start_retries=0,
    )
    assert "error" in outcome, outcome
    assert "can no longer place the workers" in outcome["error"]
    assert "room for 1 such worker(s)" in outcome["error"]
