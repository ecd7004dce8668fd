"""Every file of a run on shared or cloud storage (issue 13), with real Ray and real S3 calls.

The bucket is moto's S3-compatible server on 127.0.0.1. The runs' drivers are processes of
their own (`tests/support/storage_driver.py`) whose Ray job carries the endpoint and credentials
to every worker, the callback actor and every evaluation task, as a cluster's instance profile
would.
The second test makes a real second "machine": a Ray node in a private mount namespace that
sees an empty folder where the driver writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from local_cluster import LocalCluster
from rt_support import read_records
from s3_server import S3Server
from support_paths import SUPPORT

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


def _drive(address: str, scenario: dict, env: dict, cwd, timeout: float = 600) -> list:
    done = subprocess.run(
        [sys.executable, os.path.join(SUPPORT, "storage_driver.py"), address, json.dumps(scenario)],
        env={**os.environ, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("OUTCOME ")), None)
    assert line, f"rc={done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return json.loads(line[len("OUTCOME ") :])


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
    first, second = _drive(address, scenario, s3.env(), cwd)
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
        for name in ("rank0.complete", "rank1.complete", "model.pt", "model_spec.pkl"):
            assert f"runs/in-a-bucket/checkpoint_{step:08d}/{name}" in keys
    assert "runs/in-a-bucket/checkpoint_00000006/actor_state.pkl" in keys
    assert "runs/in-a-bucket/run.json" in keys and "runs/in-a-bucket/metrics.jsonl" in keys
    logged = s3.client().get_object(Bucket=BUCKET, Key="runs/in-a-bucket/metrics.jsonl")
    steps = [json.loads(x)["step"] for x in logged["Body"].read().decode().splitlines()]
    assert {2, 4, 6} <= set(steps)
    # Nothing of the run on the local disk: not in the working dir, not in the default storage.
    assert list(cwd.iterdir()) == [] and not os.path.exists(default_storage)


def test_a_second_node_that_cannot_see_local_storage_refuses_it_and_a_bucket_works(s3, tmp_path):
    hidden = tmp_path / "looks-shared"  # the second node sees an empty tmpfs here
    records = tmp_path / "records"
    cluster = LocalCluster(num_cpus=1)
    cluster.start()
    try:
        cluster.add_node("127.0.0.3", num_cpus=1, hide=str(hidden))
        data = hidden / "train.jsonl"  # only the driver sees it: shipped with the run
        data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
        common = {
            "data": str(data),
            "batch_size": 4,
            "num_workers": 2,
            "max_steps": 4,
            "save_every_steps": 2,
            "callbacks": [{"class": "AllRanksRecorder", "folder": str(records)}],
            **TINY_LM,
        }
        scenario = {
            "env": s3.env(),
            "runs": [
                {**common, "run_name": "local-storage", "storage_path": str(hidden / "runs")},
                {**common, "run_name": "bucket-storage", "storage_path": f"s3://{BUCKET}/two"},
                # A local path that every node sees passes: test_multinode's job run keeps its
                # checkpoints in one, from workers on two nodes.
            ],
        }
        env = {**cluster.env(), **s3.env()}
        refused, trained = _drive(cluster.gcs_address, scenario, env, tmp_path)
    finally:
        cluster.stop()
    assert "StorageNotShared" in refused["error"], refused
    assert "127.0.0.3" in refused["error"] and "s3://" in refused["error"]
    assert "error" not in trained, trained
    assert trained["global_step"] == 4
    mine = [r for r in read_records(str(records), "all_ranks") if r["event"] == "on_step_end"]
    assert {r["rank"] for r in mine} == {0, 1}
    assert len({r["node"] for r in mine}) == 2  # one worker on each node
    assert "two/bucket-storage/checkpoint_00000004/rank1.complete" in s3.keys(BUCKET)
