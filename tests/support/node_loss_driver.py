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
    # An EvalOnSave scoring every save: on one CPU (True), or with these EvalOnSave arguments.
    evaluate = fields.pop("_eval", False)
    hold = fields.pop("_hold_while_small", None)  # [step, size]: see HoldWhileSmall
    hold_at = fields.pop("_hold_at", None)  # [folder, step]: see multinode_job.HoldAt
    tick_s = fields.pop("_coordinator_tick_s", None)  # see start_autoscaling_coordinator
    ray.init(address=address, runtime_env={"env_vars": {"PYTHONPATH": SUPPORT, **env}})
    from rt_support import (
        AllRanksRecorder,
        HoldWhileSmall,
        SlowSteps,
        TinyDataset,
        TinyRegressor,
        constant_score_eval,
        start_autoscaling_coordinator,
    )

    from callbacks import EvalOnSave
    from ray_trainer import RunFailedError, run_training

    if tick_s is not None:
        start_autoscaling_coordinator(tick_s)
    step_s = fields.pop("_step_s", 0.1)  # each step paced to this long
    report_cluster = fields.pop("_cluster_report", False)  # the node types, the autoscaler
    callbacks = [SlowSteps(step_s)] + ([AllRanksRecorder(records)] if records else [])
    if hold:
        callbacks.append(HoldWhileSmall(*hold))
    if hold_at:
        from multinode_job import HoldAt

        callbacks.append(HoldAt(*hold_at))
    if evaluate:
        options = evaluate if isinstance(evaluate, dict) else {"num_gpus": 0, "num_cpus": 1}
        callbacks.append(EvalOnSave(constant_score_eval, **options))
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
    if report_cluster:  # what the autoscaler's monitor reports at the end, and the conclusion
        from ray_trainer import _cluster

        outcome["node_types"] = sorted(set(_cluster.reported_node_types()))
        outcome["autoscaler"] = _cluster.has_autoscaler()
    if evaluate:
        ok = [e for e in result.evaluations if not e.get("error")]
        outcome["evaluated"] = sorted(e["step"] for e in ok)
        outcome["eval_gpus"] = sorted({e["metrics"]["gpus"] for e in ok})
        outcome["eval_errors"] = [e["error"] for e in result.evaluations if e.get("error")]
    print("OUTCOME " + json.dumps(outcome), flush=True)


if __name__ == "__main__":
    main()
