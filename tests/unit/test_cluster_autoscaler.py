"""`_cluster`: whether a task can run on the nodes there are, and whether an autoscaler can add
more, decided from what the autoscaler's monitor reports (no Ray started).

The reports below have the shape Ray 2.60's monitor writes under ``__autoscaling_status``: the
first as an embedded ``ray.init()`` wrote it here (Ray's read-only provider), the second with
the node types of a ``ray up`` cluster. A real embedded Ray and a real ``ray start`` cluster are
asked in ``tests/integration/test_multinode.py``.
"""

from __future__ import annotations

import pytest

from ray_trainer import _cluster

NODE_ID = "5ca9957117d34bade193998b5b189ab86952eac5403243aaa19fedcd"
EMBEDDED_REPORT = {
    "autoscaler_report": {
        "active_nodes": {f"node_{NODE_ID}": 1},
        "idle_nodes": None,
        "pending_nodes": [],
        "pending_launches": {},
        "failed_nodes": [],
        "node_type_mapping": {NODE_ID: f"node_{NODE_ID}"},
        "legacy": True,
    },
    "load_metrics_report": {"usage": {"CPU": [0.0, 4.0]}},
}
CLUSTER_YAML_REPORT = {
    "autoscaler_report": {
        "active_nodes": {"ray.head.default": 1},
        "pending_nodes": [["10.0.0.7", "gpu_workers", "setting-up"]],
        "pending_launches": {"gpu_workers": 1},
        "node_type_mapping": {"10.0.0.5": "ray.head.default"},
    }
}


def test_the_read_only_provider_of_a_cluster_without_autoscaler_is_no_autoscaler():
    types = _cluster.v1_node_types(EMBEDDED_REPORT)
    assert types == [f"node_{NODE_ID}", f"node_{NODE_ID}"]
    assert not _cluster.names_configured_types(types)


def test_node_types_from_a_cluster_config_are_an_autoscaler():
    types = _cluster.v1_node_types(CLUSTER_YAML_REPORT)
    assert set(types) == {"ray.head.default", "gpu_workers"}
    assert _cluster.names_configured_types(types)
    # A config's own type that merely starts like an anonymous one is still a config's.
    assert _cluster.names_configured_types(["node_gpu"])
    assert _cluster.names_configured_types([f"node_{NODE_ID}", "cpu_pool"])


def test_no_report_yet_is_no_autoscaler():
    assert _cluster.v1_node_types(None) == []
    assert _cluster.v1_node_types({"gcs_request_time": 0.1}) == []  # the monitor's first lines
    assert not _cluster.names_configured_types([])
    assert not _cluster.names_configured_types([""])


def test_an_unreadable_status_is_no_autoscaler(monkeypatch):
    def broken():
        raise RuntimeError("GCS unavailable")

    monkeypatch.setattr(_cluster, "reported_node_types", broken)
    assert _cluster.has_autoscaler() is False
    monkeypatch.setattr(_cluster, "reported_node_types", lambda: ["ray.head.default"])
    assert _cluster.has_autoscaler() is True


def test_the_skip_variable_says_the_cluster_grows_without_asking_it(monkeypatch):
    def unasked():
        raise AssertionError("the GCS was read")

    monkeypatch.setattr(_cluster, "has_autoscaler", unasked)
    monkeypatch.setenv("RAY_TRAINER_SKIP_RESOURCE_CHECK", "1")
    assert _cluster.can_grow()
    monkeypatch.setenv("RAY_TRAINER_SKIP_RESOURCE_CHECK", "0")
    monkeypatch.setattr(_cluster, "has_autoscaler", lambda: False)
    assert not _cluster.can_grow()


CPU_HEAD = {"CPU": 0.0, "memory": 1e9}
CPU_NODE = {"CPU": 4.0, "memory": 8e9}
GPU_NODE = {"CPU": 8.0, "GPU": 1.0}


@pytest.mark.parametrize(
    ("need", "nodes", "fits"),
    [
        ({"CPU": 1, "GPU": 0}, [CPU_HEAD, CPU_NODE], True),  # a zero amount is not asked for
        ({"CPU": 1, "GPU": 1}, [CPU_HEAD, CPU_NODE], False),
        ({"CPU": 1, "GPU": 1}, [CPU_HEAD, CPU_NODE, GPU_NODE], True),
        ({"CPU": 2, "GPU": 1}, [{"CPU": 1.0, "GPU": 1.0}, {"CPU": 4.0}], False),  # one node
        ({"CPU": 0.5, "eval_slot": 1}, [CPU_NODE], False),
        ({"CPU": 1}, [CPU_HEAD], False),  # a head with no CPU alone
    ],
)
def test_a_task_fits_when_one_node_has_everything_it_asks_for(need, nodes, fits):
    assert (_cluster.missing(need, nodes) is None) is fits


def test_what_is_missing_names_the_request_and_the_cluster():
    reason = _cluster.missing({"CPU": 1, "GPU": 1}, [CPU_HEAD, CPU_NODE])
    assert reason == (
        "asks for {'CPU': 1, 'GPU': 1}, but no node has that (cluster: CPU=4, GPU=0 over 2 node(s))"
    )
