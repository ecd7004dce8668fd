"""A driver for the multi-node suite's checks before training: joins the test cluster, reports
where it runs and what it sees of the autoscaler, encodes data sources, and tries a run that
must be refused; prints one JSON outcome line.

Runs as its own process (`python multinode_driver.py ADDRESS SCENARIO_JSON`) on the head, as a
submitted job's driver does, so that the pytest process, which holds the shared embedded Ray
session, never joins the test cluster. The job's processes get `tests/support` and the S3
endpoint through the job's `runtime_env`.
"""

from __future__ import annotations

import json
import sys
import time

import ray
from support_paths import pythonpath


def main() -> None:
    address, scenario = sys.argv[1], json.loads(sys.argv[2])
    env = {"PYTHONPATH": pythonpath(), **scenario.get("env", {})}
    ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=True)
    outcome = {"where": _where()}
    for name, fields in scenario.get("encode", {}).items():
        outcome[name] = _encode(fields)
    if "refuse" in scenario:
        outcome["refuse"] = _refused(scenario["refuse"])
    print("OUTCOME " + json.dumps(outcome), flush=True)


def _where() -> dict:
    """The driver's node, the cluster's nodes, and the autoscaler as ray-trainer sees it (once
    the head's monitor has reported every node: it reports each a few seconds after it joins)."""
    from waiting import wait_until

    from ray_trainer import _cluster

    node_id = ray.get_runtime_context().get_node_id()
    mine = next(n for n in ray.nodes() if n["NodeID"] == node_id)
    alive = sum(1 for n in ray.nodes() if n.get("Alive"))
    wait_until(
        lambda: len(set(_cluster.reported_node_types())) >= alive,
        60,
        f"the autoscaler monitor's report of all {alive} nodes",
    )
    return {
        "driver_resources": mine["Resources"],
        "nodes": sorted(n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")),
        "reported_node_types": _cluster.reported_node_types(),
        "has_autoscaler": _cluster.has_autoscaler(),
    }


def _encode(fields: dict) -> dict:
    """Plan and encode one source as `run_training` does before training (no worker)."""
    from ray_trainer import TrainingArgs
    from ray_trainer._data import records
    from ray_trainer._driver.data import plan_data, prepare_data

    fields = dict(fields)
    if "dataset_rows" in fields:  # an in-memory datasets.Dataset
        import datasets

        fields["data"] = datasets.Dataset.from_list(fields.pop("dataset_rows"))
    # Smaller pieces than the 4,096 records of a real one: more pieces than run at once.
    piece_records = fields.pop("piece_records", records.PIECE_RECORDS)
    args = TrainingArgs(**fields)
    started = time.monotonic()
    default, records.PIECE_RECORDS = records.PIECE_RECORDS, piece_records
    try:
        plans = plan_data(args)
    finally:
        records.PIECE_RECORDS = default
    caches = prepare_data(plans, args)
    meta = plans["data"].meta
    return {
        "cache": caches["data"],
        "pieces": len(plans["data"].source.pieces),
        "seconds": round(time.monotonic() - started, 1),
        **{k: meta[k] for k in ("format", "records", "samples", "dropped")},
    }


def _refused(fields: dict) -> dict:
    """A run whose EvalOnSave keeps its default num_gpus=1: its error, or how it ended."""
    from callbacks import EvalOnSave
    from ray_trainer import ResourceRequestError, run_training

    try:
        result = run_training(callbacks=[EvalOnSave(_never_called)], **fields)
    except ResourceRequestError as e:
        return {"error": str(e)}
    return {"global_step": result.global_step, "evaluations": result.evaluations}


def _never_called(checkpoint_path: str, step: int) -> dict:
    raise AssertionError("the refused run evaluated a checkpoint")


if __name__ == "__main__":
    main()
