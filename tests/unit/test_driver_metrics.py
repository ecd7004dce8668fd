"""`RayMetrics` on by default: where the run joins a cluster that exports metrics, and only there."""

from __future__ import annotations

from callbacks import ProgressBar, RayMetrics
from ray_trainer import TrainingArgs
from ray_trainer._driver.metrics import exports_metrics, wants_ray_metrics, with_default_metrics

HEAD = {"Alive": True, "MetricsExportPort": 8080}
NO_EXPORT = {"Alive": True, "MetricsExportPort": 0}
DEAD = {"Alive": False, "MetricsExportPort": 8080}


def lists(*user, global_=()):
    return {"core": [], "user": list(user), "global": list(global_)}


def test_a_cluster_exports_metrics_when_an_alive_node_has_the_port():
    assert exports_metrics([NO_EXPORT, HEAD])
    assert not exports_metrics([NO_EXPORT, DEAD]) and not exports_metrics([])


def test_the_default_is_on_only_for_a_joined_cluster_that_exports_metrics():
    assert wants_ray_metrics(None, joined=True, nodes=[HEAD])
    assert not wants_ray_metrics(None, joined=True, nodes=[NO_EXPORT])
    assert not wants_ray_metrics(None, joined=False, nodes=[HEAD])  # the embedded local Ray
    assert wants_ray_metrics(True, joined=False, nodes=[])
    assert not wants_ray_metrics(False, joined=True, nodes=[HEAD])


def test_added_after_the_users_callbacks_unless_the_run_has_one():
    bar = ProgressBar()
    added = with_default_metrics(lists(bar), True, joined=False)
    assert added["user"][0] is bar and isinstance(added["user"][1], RayMetrics)
    assert len(added["user"]) == 2
    own = RayMetrics(prefix="mine")
    assert with_default_metrics(lists(own), True, joined=False)["user"] == [own]
    assert with_default_metrics(lists(global_=[own]), True, joined=False)["user"] == []
    assert with_default_metrics(lists(bar), None, joined=False)["user"] == [bar]  # no Ray call


def test_the_field_defaults_to_automatic():
    assert TrainingArgs().ray_metrics is None
    assert TrainingArgs(ray_metrics=False).ray_metrics is False
