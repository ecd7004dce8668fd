"""A driver for the multi-node GRPO fault run (`grpo_nodes.py`): joins the test cluster, trains,
prints a JSON outcome.

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
    records, hold = fields.pop("_records"), fields.pop("_hold")  # see grpo_nodes.cluster_fields
    os.makedirs(records, exist_ok=True)
    # This folder, then this process's PYTHONPATH: the checkout's ray_trainer named there first.
    ray.init(address=address, runtime_env={"env_vars": {"PYTHONPATH": pythonpath()}})
    from grpo_nodes import LoseEngineNode, StepLogs, scored_to

    from ray_trainer import RunFailedError, run_training

    try:
        result = run_training(
            reward_fns=[scored_to(records)],
            callbacks=[StepLogs(records), LoseEngineNode(hold, records)],
            **fields,
        )
    except RunFailedError as e:
        print("OUTCOME " + json.dumps({"error": str(e)}), flush=True)
        return
    outcome = {"global_step": result.global_step, "attempts": result.attempts}
    print("OUTCOME " + json.dumps(outcome), flush=True)


if __name__ == "__main__":
    main()
