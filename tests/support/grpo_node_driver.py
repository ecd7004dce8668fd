"""A driver for the multi-node GRPO fault runs (`grpo_nodes.py`, `grpo_faults.py`): joins the test
cluster, trains, prints a JSON outcome.

Runs as its own process (`python grpo_node_driver.py ADDRESS FIELDS_JSON`, started by
`driver_process.start_driver`), as `node_loss_driver.py` does, so that the pytest process never
joins the test cluster. Python puts this script's folder, `tests/support`, first on `sys.path`;
the job's workers and reward tasks get it (and this process's PYTHONPATH) through PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import sys

import ray
from support_paths import pythonpath


def main() -> None:
    address, fields = sys.argv[1], json.loads(sys.argv[2])
    records = fields.pop("_records")  # see grpo_nodes.cluster_fields
    hold = fields.pop("_hold", None)  # the engine-node loss's folder (LoseEngineNode)
    hold_at = fields.pop("_hold_at", None)  # [folder, step]: see multinode_job.HoldAt
    env = fields.pop("_env", {})  # environment for the job's processes
    step_s = fields.pop("_step_s", None)  # each step paced to at least this long
    os.makedirs(records, exist_ok=True)
    # This folder, then this process's PYTHONPATH: the checkout's ray_trainer named there first.
    ray.init(address=address, runtime_env={"env_vars": {"PYTHONPATH": pythonpath(), **env}})
    from grpo_nodes import LoseEngineNode, StepLogs, scored_to
    from multinode_job import HoldAt

    from ray_trainer import RunFailedError, run_training

    callbacks = [StepLogs(records)]
    if hold is not None:
        callbacks.append(LoseEngineNode(hold, records))
    if hold_at is not None:
        callbacks.append(HoldAt(*hold_at))
    if step_s is not None:
        from rt_support import SlowSteps

        callbacks.append(SlowSteps(step_s))
    try:
        result = run_training(reward_fns=[scored_to(records)], callbacks=callbacks, **fields)
    except RunFailedError as e:
        print("OUTCOME " + json.dumps({"error": str(e)}), flush=True)
        return
    outcome = {"global_step": result.global_step, "attempts": result.attempts}
    print("OUTCOME " + json.dumps(outcome), flush=True)


if __name__ == "__main__":
    main()
