"""Every file of a run on shared or cloud storage (issue 13), with real Ray and real S3 calls.

The bucket is moto's S3-compatible server on 127.0.0.1. The runs' drivers are processes of
their own (`tests/support/storage_driver.py`) whose Ray job carries the endpoint and credentials
to every worker, the callback actor and every evaluation task, as a cluster's instance profile
would. A local `storage_path` that a second node cannot see is refused, and a bucket works
there, on `test_multinode.py`'s cluster.
"""

from __future__ import annotations

import json
import os

import pytest
from driver_process import scenario_outcome
from rt_support import read_records
from s3_server import S3Server

BUCKET = "ray-trainer-tests"
TEXTS = [f"the quick brown fox jumps over the lazy dog number {i}" for i in range(200)]
TINY_LM = {"demo": {"d_model": 32, "n_layers": 1, "n_heads": 2}, "max_length": 32}


@pytest.fixture(scope="module")
def s3():
    server = S3Server()
    server.start()
    server.client().create_bucket(Bucket=BUCKET)
    body = "".join(json.dumps({"text": t}) + "\n" for t in TEXTS).encode()
    server.client().put_object(Bucket=BUCKET, Key="data/train.jsonl", Body=body)
    yield server
    server.stop()


def test_a_run_lives_in_a_bucket(ray_session, s3, tmp_path):
    cwd, records = tmp_path / "cwd", tmp_path / "records"
    cwd.mkdir()
    default_storage = os.path.expanduser("~/ray_trainer_runs/in-a-bucket")
    storage = f"s3://{BUCKET}/runs"
    common = {
        "run_name": "in-a-bucket",
        "storage_path": storage,
        "data": f"s3://{BUCKET}/data/train.jsonl",
        "batch_size": 4,
        "num_workers": 2,
        "log_every_steps": 2,
        "save_every_steps": 2,
        **TINY_LM,
    }
    scenario = {
        "env": s3.env(),
        "runs": [
            {
                **common,
                "max_steps": 6,
                "max_failures": 1,
                "callbacks": [
                    {"class": "KillRank1Once", "step": 3},  # the restart reads the bucket
                    {"class": "EvalOnSave", "eval_fn": "eval_local_checkpoint", "num_gpus": 0},
                    {"class": "StatusProbe", "folder": str(records), "step": 5, "attempt": 1},
                    {"class": "JsonlLogger"},
                ],
            },
            # A new call with the same run_name continues it, here through a filesystem object
            # (`storage_filesystem`, as for a custom endpoint) and a path on it.
            {
                **common,
                "max_steps": 8,
                "storage_path": f"{BUCKET}/runs",
                "s3_filesystem_object": True,
            },
        ],
        "load_model_of": 0,
    }
    address = ray_session.get_runtime_context().gcs_address
    first, second = scenario_outcome("storage_driver.py", address, scenario, s3.env(), cwd)
    run = f"{storage}/in-a-bucket"
    assert "error" not in first, first
    assert (first["global_step"], first["attempts"]) == (6, 2)
    assert first["checkpoint_path"] == f"{run}/checkpoint_00000006"
    # One evaluation per checkpoint (step 2 from before the crash), each given a local folder.
    evals = first["evaluations"]
    assert [e["step"] for e in evals] == [2, 4, 6], evals
    for e in evals:
        m = e["metrics"]
        assert m["local_is_dir"] and m["local_has_manifest"]
        assert m["checkpoint_step"] == e["step"]
        assert m["uri"] == e["checkpoint_path"] == f"{run}/checkpoint_{e['step']:08d}"
    # load_model from the bucket, in the driver, gives the weights the task evaluated.
    assert first["loaded_param_sum"] == pytest.approx(evals[-1]["metrics"]["param_sum"])
    # `ray-trainer status` answered for the live run.
    [probe] = read_records(str(records), "status")
    assert probe["returncode"] == 0, probe["stderr"]
    status = json.loads(probe["stdout"])
    assert status["run_name"] == "in-a-bucket" and status["events"]["on_save"] >= 1
    # The continued run resumed from the bucket (named by its path on the filesystem object).
    assert "error" not in second, second
    assert second["global_step"] == 8
    assert second["checkpoint_path"] == f"{BUCKET}/runs/in-a-bucket/checkpoint_00000008"
    keys = s3.keys(BUCKET)
    for step in (2, 4, 6, 8):
        for name in ("rank0.complete", "rank1.complete", "model.pt", "model_spec.json"):
            assert f"runs/in-a-bucket/checkpoint_{step:08d}/{name}" in keys
    assert "runs/in-a-bucket/checkpoint_00000006/actor_state.pt" in keys
    assert "runs/in-a-bucket/run.json" in keys and "runs/in-a-bucket/metrics.jsonl" in keys
    logged = s3.client().get_object(Bucket=BUCKET, Key="runs/in-a-bucket/metrics.jsonl")
    steps = [json.loads(x)["step"] for x in logged["Body"].read().decode().splitlines()]
    assert {2, 4, 6} <= set(steps)
    # Nothing of the run on the local disk: not in the working dir, not in the default storage.
    assert list(cwd.iterdir()) == [] and not os.path.exists(default_storage)
