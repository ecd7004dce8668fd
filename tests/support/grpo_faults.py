"""Test process: GRPO's fault runs on a local cluster of their own, at once: the session fixture
``grpo_faults`` read by ``test_grpo_nodes.py`` (``make test-faults``; outside ``make test``, as
issue 51 lets the long fault runs be).

The cluster (`LocalCluster`, fast failure detection): a head with 7 CPUs, two engine nodes and a
trainer node, each run kept on its own nodes by custom resources:

* an engine's node lost and back (`grpo_nodes.py`): the two training workers on the head (a
  ``grpo`` resource), an ``hf`` rollout engine on each of `ENGINE_A` and `ENGINE_B` (an
  ``engine`` resource, one CPU each: a whole node). Rank 0 holds at the end of step 2 until B's
  raylet is killed; two steps go on with the engine left, then the test brings B back and the
  replacement engine joins. Its twin, the same run on two engines throughout, trains in the test
  session's own Ray meanwhile.
* a trainer's node drained for preemption (what a spot reclaim looks like to Ray): an
  asynchronous run (``max_staleness=1``: a request in flight at every step point) whose two
  workers are spread over the head and `TRAINER` (a ``rldrain`` resource: two on the head, one on
  `TRAINER`) and whose engine is on the head. Rank 0 holds at the end of step `DRAIN_AT`; the
  test drains `TRAINER` with a 5 s deadline and releases it: the notice's save at the next step
  boundary records the rollout queue's state, and at the deadline Ray Train restarts the worker
  group on the head from it.

Every driver is a process of its own (`grpo_node_driver.py`). The cluster is stopped before the
fixture returns: the tests read outcomes and records only.
"""

from __future__ import annotations

import concurrent.futures
import threading
from pathlib import Path
from typing import Any

import grpo_nodes
import pytest
from driver_process import driver_outcome, start_driver, wait_for_run
from grpo_nodes import ENGINE_A, ENGINE_B
from local_cluster import LocalCluster
from lost_nodes import drain

ENGINE = {"engine": 1}  # an engine node's one engine (ENGINE_A kept, ENGINE_B lost, back)
TRAINER = "127.0.0.9"  # the drained run's second worker's node
DRAIN_AT, DRAIN_STEPS = 3, 15  # held at step 3's end, drained; five epochs of three steps


def drain_fields(model: str, data: str, tmp: Path) -> dict[str, Any]:
    """The drained run: asynchronous rollouts, its workers over the head and `TRAINER`, its
    engine and reward tasks on the head."""
    return {
        **grpo_nodes.run_fields(model, data, tmp / "storage", "grpo-drain"),
        "max_staleness": 1, "max_steps": DRAIN_STEPS, "max_failures": 1,
        "placement_strategy": "SPREAD",  # one worker on each node of the pair
        "resources_per_worker": {"CPU": 1, "rldrain": 1},
        "rollout_resources": {"CPU": 1, "rlengine": 1},
        "reward_resources": {"CPU": 0.25, "grpo": 0.25},
        "_records": str(tmp / "records"),
        "_hold_at": [str(tmp / "hold"), DRAIN_AT],
        # Steps of 1 s at least: the 12 after the release outlast the drain's 5 s deadline (a
        # run this small can otherwise end before its node goes, and never restart).
        "_step_s": 1.0,
        "_env": {"RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.5"},
    }  # fmt: skip


def _lose_engine_node(cluster, lock, driver, hold: Path) -> tuple[dict, str]:
    """The engine-loss run (a thread of the fixture): `ENGINE_B`'s raylet killed while rank 0
    holds the end of step `grpo_nodes.LOSE_AT`, the node back once two steps have gone on with
    the engine left (rank 0 then holds until the replacement engine answers); its outcome."""
    wait_for_run(driver, (hold / "held").exists, "GRPO's step 2 on two engines", timeout_s=600)
    with lock:
        cluster.raylet(ENGINE_B).kill()  # an engine's node is gone
    (hold / "release").write_text("go")
    wait_for_run(driver, (hold / "short").exists, "GRPO's steps on the engine left", 300)
    with lock:
        cluster.add_node(ENGINE_B, num_cpus=1, resources=ENGINE)  # back: a replacement fits
    return driver_outcome(driver, "the engine node's return", 600)


def _drain_trainer(cluster, lock, driver, hold: Path) -> tuple[dict, str]:
    """The drained run (a thread of the fixture): `TRAINER` drained while rank 0 holds the end
    of step `DRAIN_AT`, then released; its outcome."""
    wait_for_run(driver, (hold / "held").exists, "the drained run's step 2", timeout_s=600)
    with lock:
        drain(cluster, TRAINER)
    (hold / "release").write_text("go")
    return driver_outcome(driver, "the trainer node's drain", 600)


@pytest.fixture(scope="session")
def grpo_faults(ray_session, tmp_path_factory):
    """The runs' outcomes and folders (see the module's docstring), once per session."""
    tmp = tmp_path_factory.mktemp("grpo-faults")
    loss, drained = tmp / "grpo", tmp / "drain"
    for folder in (loss, drained):
        folder.mkdir()
    model, prompts = grpo_nodes.write_data(tmp)
    # Head: the engine-loss run's two workers and the drained run's (after the drain), its
    # engine, and both runs' reward tasks ("grpo").
    cluster = LocalCluster(
        num_cpus=7,
        resources={"grpo": 4, "rldrain": 2, "rlengine": 2},
        fast_failure_detection=True,
    )
    cluster.start()
    drivers: dict[str, Any] = {}
    pool = concurrent.futures.ThreadPoolExecutor(2)
    try:
        cluster.add_node(ENGINE_A, num_cpus=1, resources=ENGINE)
        cluster.add_node(ENGINE_B, num_cpus=1, resources=ENGINE)
        cluster.add_node(TRAINER, num_cpus=1, resources={"rldrain": 1})
        loss_fields = grpo_nodes.cluster_fields(model, prompts, loss)
        drivers["grpo"] = start_driver(cluster, loss_fields, script="grpo_node_driver.py")
        fields = drain_fields(model, prompts, drained)
        drivers["drain"] = start_driver(cluster, fields, script="grpo_node_driver.py")
        lock = threading.Lock()  # one change to the cluster at a time
        lost = pool.submit(_lose_engine_node, cluster, lock, drivers["grpo"], loss / "hold")
        drain_run = pool.submit(_drain_trainer, cluster, lock, drivers["drain"], drained / "hold")
        twin = grpo_nodes.twin(loss, model, prompts)
        loss_outcome, drain_outcome = lost.result(), drain_run.result()
    finally:
        for driver in drivers.values():
            if driver.poll() is None:
                driver.kill()
        pool.shutdown(wait=True)
        cluster.stop()
    return {
        "grpo": {"outcome": loss_outcome, "tmp": loss, "twin": (twin.global_step, twin.attempts)},
        "drain": {"outcome": drain_outcome, "tmp": drained},
    }
