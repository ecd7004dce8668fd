"""`cluster.yaml` is a valid Ray cluster launcher config (checked offline, no cloud credentials)
that a production user can keep: training never on the head, autoscaled GPU workers, shared
storage on every node, exact pins; and `examples/cluster_run.yaml` is the run that goes with it.

What these checks cannot see offline: that the EFS id, the AMI parameter and the pinned
versions exist in the cloud and on PyPI (docs/cluster.md says what was checked and how).
"""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def raw():
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


@pytest.fixture(scope="module")
def run_config():
    from ray_trainer._config.args import TrainingArgs

    return TrainingArgs.from_yaml(ROOT / "examples" / "cluster_run.yaml", [])


@pytest.fixture(scope="module")
def prepared(raw):
    util = pytest.importorskip("ray.autoscaler._private.util")
    cfg = util.prepare_config(copy.deepcopy(raw))  # fills defaults; validate_config needs them
    util.validate_config(cfg)
    return cfg


def _flags(commands: list[str]) -> list[str]:
    return [word for cmd in commands for word in shlex.split(cmd.replace(";", " ; "))]


def test_validates_with_the_ray_autoscaler(prepared):
    assert prepared["provider"]["type"] == "aws"
    assert prepared["head_node_type"] in prepared["available_node_types"]


def test_has_a_gpu_worker_type_and_a_head_without_gpu(prepared):
    types = prepared["available_node_types"]
    head = types[prepared["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0
    gpu_types = {
        name: t
        for name, t in types.items()
        if name != prepared["head_node_type"] and t["resources"].get("GPU", 0) >= 1
    }
    assert gpu_types, "no worker node type with GPU resources"
    for t in gpu_types.values():
        assert 0 <= t["min_workers"] <= t["max_workers"] <= prepared["max_workers"]
        assert t["node_config"]["InstanceType"].startswith(("g", "p"))  # a GPU instance family


def test_dashboard_only_on_the_head_loopback(prepared):
    flags = _flags(prepared["head_start_ray_commands"])
    assert "--head" in flags
    assert "--dashboard-host=127.0.0.1" in flags
    assert "--dashboard-port=8265" in flags  # what `ray dashboard cluster.yaml` forwards
    assert not any(
        f.startswith("--dashboard-host") for f in _flags(prepared["worker_start_ray_commands"])
    )


def test_the_head_provisions_the_grafana_dashboard_after_ray_starts(prepared):
    commands = prepared["head_start_ray_commands"]
    start = next(i for i, c in enumerate(commands) if "ray start --head" in c)
    install = [i for i, c in enumerate(commands) if "ray-trainer grafana install" in c]
    assert install and install[0] > start  # Ray empties its Grafana folder when it starts
    assert "--wait" in _flags([commands[install[0]]])


def test_training_never_lands_on_the_head(prepared):
    head = prepared["available_node_types"][prepared["head_node_type"]]
    # Passed to the head's `ray start` (RAY_OVERRIDE_RESOURCES): no CPU or GPU to offer, so
    # only zero-CPU actors (the callback actor, Train's controller, job drivers) run there.
    assert head["resources"].get("CPU") == 0 and head["resources"].get("GPU", 0) == 0


def test_gpu_workers_autoscale_from_zero(prepared):
    types = prepared["available_node_types"]
    workers = [t for name, t in types.items() if name != prepared["head_node_type"]]
    assert workers and all(t["min_workers"] == 0 < t["max_workers"] for t in workers)
    # min_workers 0 means no GPU is up when a run starts: the driver must not refuse it.
    head_start = " ".join(prepared["head_start_ray_commands"])
    assert "RAY_TRAINER_SKIP_RESOURCE_CHECK=1" in head_start


def _setup(prepared) -> str:
    return " ".join(prepared["setup_commands"])


def test_every_node_mounts_the_shared_storage(prepared):
    setup = _setup(prepared)  # setup_commands run on every node, head and workers
    assert re.search(
        r"mount -t nfs4 .*\$EFS_ID\.efs\.\$EFS_REGION\.amazonaws\.com:/ /mnt/shared", setup
    )
    region = re.search(r"EFS_REGION=(\S+?);", setup)
    assert region and region[1] == prepared["provider"]["region"]
    assert "mountpoint -q /mnt/shared ||" in setup  # `ray up` again does not mount twice
    assert "put your EFS file system id" in setup  # the placeholder fails with the fix


def test_every_node_gets_the_same_exact_pins_and_this_project(prepared):
    setup = _setup(prepared)
    pins = dict(re.findall(r'"([a-z\[\],]+)==([0-9][0-9.]*)"', setup))
    for name in ("torch", "ray[default,train]", "transformers", "accelerate"):
        assert name in pins, f"{name} is not pinned exactly (==) in setup_commands"
    remote = next(k for k, v in prepared["file_mounts"].items() if v == ".")
    # The synced repository, with the extras the documented features need.
    assert f'-e "$HOME/{remote.removeprefix("~/")}[hf,lora,eval,mlflow]"' in setup
    installs = [c for c in prepared["setup_commands"] if "pip install" in c and "==" in c]
    assert len(installs) == 1  # one resolver run: the pins and the project agree


def test_the_ray_pin_matches_the_ray_here(prepared):
    ray = pytest.importorskip("ray")
    assert f'"ray[default,train]=={ray.__version__}"' in _setup(prepared)


def test_the_cluster_run_trains_on_gpus_on_the_shared_storage(run_config):
    assert run_config.use_gpu and run_config.resources_per_worker["GPU"] == 1
    assert run_config.resources_per_worker["CPU"] <= 4  # fits a g5.xlarge worker
    assert run_config.storage_path.startswith("/mnt/shared/")
    # Covers a GPU node's boot and install on an autoscaling cluster (default 60 s does not).
    assert run_config.worker_start_timeout_s >= 600 and run_config.max_start_retries >= 1
    assert run_config.run_name


def test_documents_how_to_use_it():
    text = (ROOT / "cluster.yaml").read_text()
    for line in ("ray up cluster.yaml", "ray dashboard cluster.yaml", "ray-trainer submit"):
        assert line in text
    assert "--address http://127.0.0.1:8265" in text
    assert "examples/cluster_run.yaml" in text
    for doc in ("README.md", "docs/cluster.md"):
        assert "examples/cluster_run.yaml" in (ROOT / doc).read_text(), doc
