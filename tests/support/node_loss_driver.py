"""A driver for the node-loss test: joins the test cluster, trains, prints a JSON outcome.

Runs as its own process (`python node_loss_driver.py ADDRESS FIELDS_JSON`), so that the pytest
process, which holds the shared embedded Ray session, never joins the test cluster. Python puts
this script's folder, `tests/support`, first on `sys.path`; the job's workers get it through
PYTHONPATH.
"""

from __future__ import annotations

import json
import sys

import ray
from support_paths import SUPPORT


def main() -> None:
    address, fields = sys.argv[1], json.loads(sys.argv[2])
    # Test-only fields: environment for the job's processes, a folder for every rank's events.
    env, records = fields.pop("_env", {}), fields.pop("_records", None)
    ray.init(address=address, runtime_env={"env_vars": {"PYTHONPATH": SUPPORT, **env}})
    from rt_support import AllRanksRecorder, SlowSteps, TinyDataset, TinyRegressor

    from ray_trainer import RunFailedError, run_training

    callbacks = [SlowSteps(0.1)] + ([AllRanksRecorder(records)] if records else [])
    try:
        result = run_training(
            model=TinyRegressor,
            data=TinyDataset,
            batch_size=8,
            callbacks=callbacks,
            **fields,
        )
    except RunFailedError as e:
        print("OUTCOME " + json.dumps({"error": str(e)}), flush=True)
        return
    outcome = {"global_step": result.global_step, "attempts": result.attempts}
    print("OUTCOME " + json.dumps(outcome), flush=True)


if __name__ == "__main__":
    main()
