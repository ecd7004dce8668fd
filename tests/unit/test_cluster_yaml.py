"""`cluster.yaml` is a valid Ray cluster launcher config (checked offline, no cloud credentials)."""

from __future__ import annotations

import copy
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def raw():
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


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


def test_setup_installs_torch_as_a_range_and_this_project(prepared):
    setup = " ".join(prepared["setup_commands"])
    assert '"torch>=' in setup and "<" in setup.split('"torch>=')[1].split('"')[0]
    assert "ray[default" in setup  # the job server and the metrics agent
    remote = next(k for k, v in prepared["file_mounts"].items() if v == ".")
    assert f"pip install --user -q -e {remote}" in setup


def test_documents_how_to_use_it():
    text = (ROOT / "cluster.yaml").read_text()
    for line in ("ray up cluster.yaml", "ray dashboard cluster.yaml", "ray-trainer submit"):
        assert line in text
    assert "--address http://127.0.0.1:8265" in text
