"""A driver for the storage tests: joins a Ray cluster with the run's storage settings in its
job's environment, trains, prints a JSON outcome.

Runs as its own process (`python storage_driver.py ADDRESS SCENARIO_JSON`): the S3 endpoint and
credentials travel to every worker, the callback actor and every evaluation task through the
job's `runtime_env`, as they would on a cluster (an instance profile, or env vars). Python puts
this script's folder, `tests/support`, first on `sys.path`; the job's processes get it through
PYTHONPATH.
"""

from __future__ import annotations

import json
import sys

import ray
from support_paths import pythonpath


def main() -> None:
    address, scenario = sys.argv[1], json.loads(sys.argv[2])
    # The workers import this checkout's ray_trainer when the caller's PYTHONPATH names one.
    env = {"PYTHONPATH": pythonpath(), **scenario.get("env", {})}
    ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=True)
    import rt_support

    from ray_trainer import RunFailedError, TrainingArgsError, load_model, run_training

    outcomes = []
    for fields in scenario["runs"]:
        callbacks = [_callback(rt_support, spec) for spec in fields.pop("callbacks", [])]
        if fields.pop("s3_filesystem_object", False):  # storage_filesystem, not a URI
            fields["storage_filesystem"] = _s3_filesystem(scenario["env"])
        try:
            result = run_training(callbacks=callbacks, **fields)
        except (RunFailedError, TrainingArgsError) as e:
            outcomes.append({"error": f"{type(e).__name__}: {e}"})
            continue
        outcomes.append(
            {
                "global_step": result.global_step,
                "attempts": result.attempts,
                "checkpoint_path": result.checkpoint_path,
                "evaluations": result.evaluations,
                "callback_errors": result.callback_errors,
                "loss": result.metrics.get("loss"),
            }
        )
    if scenario.get("load_model_of") is not None:  # as a notebook would, after the runs
        target = outcomes[scenario["load_model_of"]]
        model = load_model(target["checkpoint_path"])
        target["loaded_param_sum"] = float(sum(p.detach().sum() for p in model.parameters()))
    print("OUTCOME " + json.dumps(outcomes), flush=True)


def _s3_filesystem(env: dict[str, str]):
    """A pyarrow S3 filesystem object with its own endpoint and keys (what a user passes as
    `storage_filesystem` for a custom endpoint or credentials)."""
    from pyarrow.fs import S3FileSystem

    scheme, host = env["AWS_ENDPOINT_URL"].split("://")
    return S3FileSystem(
        access_key=env["AWS_ACCESS_KEY_ID"],
        secret_key=env["AWS_SECRET_ACCESS_KEY"],
        region=env["AWS_DEFAULT_REGION"],
        endpoint_override=host,
        scheme=scheme,
    )


def _callback(module, spec):
    """A callback from rt_support: {"class": name, ...constructor arguments}; functions for
    EvalOnSave by name."""
    spec = dict(spec)
    name = spec.pop("class")
    import callbacks

    if name == "EvalOnSave":
        return callbacks.EvalOnSave(getattr(module, spec.pop("eval_fn")), **spec)
    cls = getattr(module, name, None) or getattr(callbacks, name)
    return cls(**spec)


if __name__ == "__main__":
    main()
