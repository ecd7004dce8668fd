"""A driver for the Prometheus test: joins the test cluster, trains the demo with `RayMetrics`,
and holds its last step until the test has read every panel; prints a JSON outcome line.

Runs as its own process (`python metrics_driver.py ADDRESS FIELDS_JSON`), so that the pytest
process, which holds the shared embedded Ray session, never joins the test cluster. The job's
processes get `tests/support` through the job's `runtime_env`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import ray
from support_paths import SUPPORT

from callbacks import TrainerCallback


class HoldLastStep(TrainerCallback):
    """Rank 0, in the training process: at step `at`, write `held` and wait (up to `timeout_s`)
    until `release` exists, so that every metric of the run is on the endpoint at once while
    the test queries Prometheus (the gauges lapse soon after a run ends)."""

    runs_on = "rank0"

    def __init__(self, at: int, held: str, release: str, timeout_s: float = 180.0) -> None:
        self.at, self.held, self.release, self.timeout_s = at, held, release, timeout_s

    def on_step_end(self, context: Any, **kwargs: Any) -> None:
        if context.global_step != self.at:
            return
        with open(self.held, "w") as f:
            f.write(str(context.global_step))
        deadline = time.monotonic() + self.timeout_s
        while not os.path.exists(self.release) and time.monotonic() < deadline:
            time.sleep(0.1)  # released by the test process: a file is all the two share


def constant_eval(checkpoint_path: str, step: int) -> dict[str, float]:
    """The evaluation of every save: one metric, so `save_to_eval_seconds` and an EvalOnSave
    metric exist."""
    return {"score": 1.0}


def main() -> None:
    address, fields = sys.argv[1], json.loads(sys.argv[2])
    hold = fields.pop("_hold")  # {"at": step, "held": path, "release": path}
    ray.init(address=address, runtime_env={"env_vars": {"PYTHONPATH": SUPPORT}})
    from callbacks import EvalOnSave, RayMetrics
    from ray_trainer import run_training

    callbacks = [
        RayMetrics(report_every_s=1.0),
        EvalOnSave(constant_eval, num_gpus=0, num_cpus=1),
        HoldLastStep(**hold),
    ]
    result = run_training(callbacks=callbacks, **fields)
    outcome = {
        "global_step": result.global_step,
        "evaluations": len(result.evaluations),
        "callback_errors": result.callback_errors,
    }
    print("OUTCOME " + json.dumps(outcome, default=str), flush=True)


if __name__ == "__main__":
    main()
