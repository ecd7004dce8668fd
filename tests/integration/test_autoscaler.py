"""A cluster with a real autoscaler, shaped as `cluster.yaml`'s: a head that offers no CPU and
node types that start only when a run asks for them (`min_workers: 0`).

The head runs Ray's monitor with a cluster config, as `ray up` starts it; its node provider is
Ray's fake multi-node one, which launches each node as a raylet on this host (`LocalCluster`'s
``autoscaler_node_types``). Nothing runs on the worker nodes before the run: the driver (on the
head, with no ``RAY_TRAINER_SKIP_RESOURCE_CHECK``) finds the autoscaler in what the monitor
reports through the GCS, so its checks let the run through; the training worker's request
starts a CPU node, and `EvalOnSave`'s default ``num_gpus=1``, which no node up has, is submitted
all the same, so its demand starts a GPU node and every checkpoint is evaluated there. On a
cluster without an autoscaler the same `EvalOnSave` is refused before training
(`test_multinode.py`).
"""

from __future__ import annotations

import pytest
from driver_process import driver_outcome, start_driver
from local_cluster import LocalCluster

NODE_TYPES = {
    "cpu_workers": {"resources": {"CPU": 2}},
    "gpu_workers": {"resources": {"CPU": 1, "GPU": 1}},  # a GPU that Ray counts, for tasks
}


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster(num_cpus=0, autoscaler_node_types=NODE_TYPES)
    c.start()
    yield c
    c.stop()


def test_the_runs_requests_start_the_nodes_it_needs_and_each_checkpoint_is_evaluated(
    cluster, tmp_path
):
    fields = {
        "num_workers": 1,
        "max_steps": 6,
        "save_every_steps": 3,
        "storage_path": str(tmp_path / "storage"),
        "run_name": "autoscaled",
        "worker_start_timeout_s": 120,  # a node's start here takes a few seconds
        "_eval": {"timeout_s": 120},  # EvalOnSave's defaults: num_gpus=1, num_cpus=1
        "_cluster_report": True,
    }
    # No RAY_TRAINER_SKIP_RESOURCE_CHECK: the driver must find the autoscaler itself.
    env = {k: v for k, v in cluster.env().items() if k != "RAY_TRAINER_SKIP_RESOURCE_CHECK"}
    outcome, out = driver_outcome(start_driver(cluster, fields, env), "the start", 420)
    assert outcome["autoscaler"] is True, outcome
    # The monitor launched both node types for the run: nothing had asked for them before.
    assert {"cpu_workers", "gpu_workers"} <= set(outcome["node_types"]), outcome
    assert outcome["global_step"] == 6, out[-4000:]
    # Each checkpoint was evaluated, each task with the one GPU it asked for.
    assert outcome["evaluated"] == [3, 6] and outcome["eval_gpus"] == [1.0], outcome
    assert outcome["eval_errors"] == [], outcome
