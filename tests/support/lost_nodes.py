"""Test process: one local cluster on which nodes are lost, drained and brought back, and the
four runs that live through it, at once: a session fixture read by ``test_node_loss.py`` and
``test_elastic.py``, so that the cluster's start and the runs' start-up are paid once for all.
(GRPO's fault runs have a cluster of their own, outside ``make test``: ``grpo_faults.py``.)

The cluster (`LocalCluster`, fast failure detection): a head with 6 CPUs and four more nodes,
each run kept on its own nodes by custom resources:

* node loss (``test_node_loss.py``): "spread" on the head and `NODE`, "slot" likewise (1 on the
  head, so that one worker only fits there after the loss), "drain" on the head and
  `PREEMPTED`. Two runs lose `NODE` at once, each held at step 11 after its step-10 checkpoint:
  the one the head has room for is restarted there by Ray Train and completes, the other fails
  with an error that says so, never a hang. A third run, held at step 10, sees `PREEMPTED`
  drained for preemption (what a spot reclaim looks like to Ray): it saves at its next step
  boundary, and at the drain deadline Ray Train restarts it from there.
* elastic (``test_elastic.py``): an "elastic" resource on `NODE_A` (two CPUs, one of them for
  the evaluations: an ``eval`` resource) and `NODE_B` (one CPU), none on the head, which runs
  the driver, the callback actor and Ray Train's controller and trains nothing of this run. A
  run with ``num_workers=[1, 2]`` holds at step 12 (its step-10 checkpoint written) until B's
  raylet is killed, goes on with one worker, and grows back to two when B returns. Its
  reference, the same run on two workers throughout, trains in the test session's own Ray
  while the cluster's runs start.

Every driver is a process of its own (`node_loss_driver.py`); each creates Ray's autoscaling
coordinator with a 0.5 s refresh before its run (whichever comes first makes it; Ray Train's
default would see a lost node or a node's return up to 20 s late). The two scenarios go on side
by side, each in a thread of its own as soon as its runs are held (one change to the cluster at
a time), while the elastic run's reference trains. The cluster is stopped before the fixture
returns: the tests read outcomes and records only.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
from driver_process import driver_outcome, start_driver, wait_for_run
from local_cluster import LocalCluster
from rt_support import AllRanksRecorder, TinyDataset, TinyRegressor, read_records

NODE, PREEMPTED = "127.0.0.3", "127.0.0.4"  # node loss: lost, drained
NODE_A, NODE_B = "127.0.0.5", "127.0.0.6"  # elastic: kept, lost then back
ELASTIC_STEPS = 60
COORDINATOR_TICK_S = 0.5


def records_of(folder: Any) -> list[dict[str, Any]]:
    """Every rank's records in `folder` so far (none while it is not written yet)."""
    try:
        return read_records(str(folder), "all_ranks")
    except (FileNotFoundError, ValueError):  # not written yet, or a line being written
        return []


def reached(folder: Any, world_size: int, step: int, after: int = -1) -> bool:
    """Whether a group of `world_size` workers (an attempt after `after`) ended `step`."""
    return any(
        r["event"] == "on_step_end"
        and r["world_size"] == world_size
        and r["attempt"] > after
        and r["step"] >= step
        for r in records_of(folder)
    )


def rank0_steps(folder: Any, attempt: int) -> list[int]:
    """The steps rank 0 ended in `attempt`."""
    return [
        r["step"]
        for r in read_records(str(folder), "all_ranks")
        if r["rank"] == 0 and r["event"] == "on_step_end" and r["attempt"] == attempt
    ]


def _node_loss_fields(tmp: Path, name: str, hold_at: int, **fields: Any) -> dict[str, Any]:
    """A run of `num_workers=2` whose rank 0 holds at step `hold_at` (its checkpoints of the
    steps before written) until the worker group is restarted or the test releases it: the
    node is lost or drained while the run is at a known step."""
    return {
        "num_workers": 2,
        "placement_strategy": "SPREAD",  # one worker on each node of its pair
        "storage_path": str(tmp),
        "run_name": name,
        "_hold_at": [str(tmp / f"{name}-hold"), hold_at],
        "_coordinator_tick_s": COORDINATOR_TICK_S,
        # Five drivers start at once on 2 cores: a callback actor's start took over the 60 s
        # default in one clean-clone CI run (913006e, the elastic run's).
        "callback_timeout_s": 180,
        **fields,
    }


def node_loss_runs(tmp: Path) -> dict[str, dict[str, Any]]:
    """The three node-loss runs: "spread" and "no-room" lose `NODE`, both held at step 11 after
    their step-10 checkpoint (the head still has room for the first's workers, not for the
    second's: each of its workers needs a "slot", and the head has 1); "preempted" is held at
    step 10 while `PREEMPTED` is drained, then released."""
    lost = {"max_steps": 40, "save_every_steps": 5, "max_failures": 1}
    preempted = {
        "max_steps": 150,  # 15 s of 0.1 s steps: the deadline falls well inside the run
        "save_every_steps": 1000,  # no scheduled save before the end: any other is the notice's
        "resources_per_worker": {"CPU": 1, "drain": 1},
        "_records": str(tmp / "records"),
        "_env": {"RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.5"},
    }
    return {
        "spread": _node_loss_fields(tmp, "spread", 11, **lost,
                                    resources_per_worker={"CPU": 1, "spread": 1}),
        "no-room": _node_loss_fields(tmp, "no-room", 11, **lost,
                                     resources_per_worker={"CPU": 1, "slot": 1},
                                     worker_start_timeout_s=10, max_start_retries=0),
        "preempted": _node_loss_fields(tmp, "preempted", 10, **preempted),
    }  # fmt: skip


def elastic_fields(tmp: Path, name: str, records: Path, **extra: Any) -> dict[str, Any]:
    """The elastic run's fields (and its reference's, which keeps the training ones)."""
    return {
        **extra,
        "num_workers": [1, 2],
        "placement_strategy": "SPREAD",  # a worker on each node: B's loss takes one
        # Only A and B offer "elastic" (one each): the head, which has CPUs for the node-loss
        # runs, never takes a worker of this run.
        "resources_per_worker": {"CPU": 1, "elastic": 1},
        "elastic_resize_interval_s": 3.0,
        "max_steps": ELASTIC_STEPS,
        "save_every_steps": 5,
        "log_every_steps": 1,
        "learning_rate": 0.01,
        "storage_path": str(tmp / "storage"),
        "run_name": name,
        # Ray Train waits this long for a placement group only: its first restart after the
        # loss asks for the old size, which can no longer be placed, and waits it out (a start
        # that times out is retried: ELASTIC_MAX_FAILURES times for an elastic run).
        "worker_start_timeout_s": 5,
        "_records": str(records),
        "_eval": {"num_gpus": 0, "num_cpus": 1, "resources": {"eval": 1}},  # one of A's CPUs
        "_coordinator_tick_s": COORDINATOR_TICK_S,
        "callback_timeout_s": 180,  # as the node-loss runs' (_node_loss_fields)
    }


def _elastic_reference(tmp: Path, records: Path) -> Any:
    """The same run on two workers throughout (a fixed size: the session's own autoscaling
    coordinator never sizes it), in this process's shared session, without the pace and the
    evaluations of the cluster's run: neither changes a loss."""
    from ray_trainer import run_training

    keep = ("max_steps", "save_every_steps", "log_every_steps", "learning_rate", "storage_path")
    fields = elastic_fields(tmp, "ref", records)
    return run_training(
        model=TinyRegressor,
        data=TinyDataset,
        batch_size=8,  # as node_loss_driver.py's runs
        num_workers=2,
        run_name="ref",
        callbacks=[AllRanksRecorder(str(records))],
        **{k: fields[k] for k in keep},
    )


def drain(cluster: LocalCluster, ip: str, deadline_s: int = 5) -> None:
    """What the cloud's autoscaler does on a spot reclaim notice: drain the node, with the time
    left before it goes away (`deadline_s`)."""
    done = subprocess.run(
        ["ray", "drain-node", f"--address={cluster.gcs_address}",
         f"--node-id={cluster.node_id(ip)}", "--reason=DRAIN_NODE_REASON_PREEMPTION",
         "--reason-message=spot reclaim (test)", f"--deadline-remaining-seconds={deadline_s}"],
        env=cluster.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def _outcomes(drivers: dict[str, Any], after: str, timeout_s: float = 240) -> dict[str, Any]:
    """Each driver's outcome, every output read to its end at once (a pipe left unread would
    fill and stall its driver)."""
    with concurrent.futures.ThreadPoolExecutor(len(drivers)) as pool:
        futures = {
            name: pool.submit(driver_outcome, driver, f"{name}'s {after}", timeout_s)
            for name, driver in drivers.items()
        }
        return {name: future.result() for name, future in futures.items()}


def _lose_and_drain(cluster, lock, drivers, runs, tmp: Path) -> dict[str, Any]:
    """The node-loss runs (a thread of the fixture): once all three are held, `NODE`'s raylet
    killed and `PREEMPTED` drained, then their outcomes."""
    for name, driver in drivers.items():
        held = tmp / f"{name}-hold" / "held"
        wait_for_run(driver, held.exists, f"{name}'s hold", timeout_s=300)
    with lock:
        cluster.raylet(NODE).kill()
    at = max(rank0_steps(runs["preempted"]["_records"], 0))
    with lock:
        # 10 s: the notice reaches rank 0 through Ray Train's watcher (polled every 0.5 s) and
        # the save must be written before the node goes, while three other runs share the 2
        # cores; with 5 s one clean-clone CI run (a5dc2b8) saw the node go first, no save made
        drain(cluster, PREEMPTED, deadline_s=10)
    (tmp / "preempted-hold" / "release").write_text("go")
    outcomes = _outcomes(drivers, "node was lost or drained")
    return {"tmp_path": tmp, "at": at, "outcomes": outcomes}


def _shrink_and_grow(cluster, lock, driver, records: Path, hold: Path) -> tuple[dict, str]:
    """The elastic run (a thread of the fixture, beside the node-loss runs): `NODE_B`'s raylet
    killed once the run holds step 12 on two workers, the node back once one worker trained
    step 20; the run's outcome."""
    wait_for_run(
        driver,
        lambda: (hold / "held").exists() and reached(records, 2, 12),
        "step 12 on two workers",
        timeout_s=300,
    )
    with lock:
        cluster.raylet(NODE_B).kill()  # one worker's node is gone
    wait_for_run(driver, lambda: reached(records, 1, 20), "step 20 on the remaining node")
    with lock:
        cluster.add_node(NODE_B, num_cpus=1, resources={"elastic": 1})  # back: the group grows
    return driver_outcome(driver, "the node's return", 300)


def _scenario(cluster: LocalCluster, tmp: Path) -> dict[str, Any]:
    loss_tmp, el_tmp = tmp / "node-loss", tmp / "elastic"
    for folder in (loss_tmp, el_tmp):
        folder.mkdir()
    runs = node_loss_runs(loss_tmp)
    el_records, el_hold = el_tmp / "records", el_tmp / "hold"
    # Saves are written in the background. Rank 0 holds step 12 on the first attempt (until
    # the loss restarts the group), so the reference below can run while this one starts.
    runs["elastic"] = elastic_fields(el_tmp, "elastic", el_records, async_checkpoint=True,
                                     _hold_while_small=[30, 2], _hold_at=[str(el_hold), 12])  # fmt: skip
    drivers = {name: start_driver(cluster, fields) for name, fields in runs.items()}
    losing = {name: drivers[name] for name in ("spread", "no-room", "preempted")}
    lock = threading.Lock()  # one change to the cluster at a time
    pool = concurrent.futures.ThreadPoolExecutor(2)
    try:
        # Each scenario goes on as soon as its own runs are where it needs them.
        lost = pool.submit(_lose_and_drain, cluster, lock, losing, runs, loss_tmp)
        elastic = pool.submit(_shrink_and_grow, cluster, lock, drivers["elastic"], el_records,
                              el_hold)  # fmt: skip
        ref_records = el_tmp / "ref-records"
        reference = _elastic_reference(el_tmp, ref_records)
        node_loss, el_outcome = lost.result(), elastic.result()
    finally:
        for driver in drivers.values():
            if driver.poll() is None:
                driver.kill()
        pool.shutdown(wait=True)
    return {
        "node_loss": node_loss,
        "elastic": {"outcome": el_outcome, "storage": el_tmp / "storage" / "elastic",
                    "reference": (reference.global_step, reference.attempts),
                    "records": records_of(el_records), "ref_records": records_of(ref_records)},
    }  # fmt: skip


@pytest.fixture(scope="session")
def lost_nodes(ray_session, tmp_path_factory):
    """The four runs' outcomes and records (see the module's docstring), once per session."""
    tmp = tmp_path_factory.mktemp("lost-nodes")
    # Head: 6 CPUs (each node-loss run's restarted workers fit there at once).
    cluster = LocalCluster(
        num_cpus=6,
        resources={"spread": 2, "slot": 1, "drain": 2},
        fast_failure_detection=True,
    )
    cluster.start()
    try:
        cluster.add_node(NODE, num_cpus=2, resources={"spread": 1, "slot": 2})
        cluster.add_node(PREEMPTED, num_cpus=1, resources={"drain": 1})
        cluster.add_node(NODE_A, num_cpus=2, resources={"eval": 1, "elastic": 1})
        cluster.add_node(NODE_B, num_cpus=1, resources={"elastic": 1})
        return _scenario(cluster, tmp)
    finally:
        cluster.stop()
