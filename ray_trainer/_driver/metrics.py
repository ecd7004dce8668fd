"""Driver: `RayMetrics` on by default where someone can watch it.

A run that joins a cluster by address (``ray_address``, ``RAY_ADDRESS``: a job submitted with
``ray job submit`` or ``ray-trainer submit`` has it) gets a ``RayMetrics()`` when it has none and
some node of the cluster exports metrics (``MetricsExportPort`` in ``ray.nodes()``, what Ray's
Prometheus service discovery lists): that cluster's Prometheus and Grafana, and the ray-trainer
dashboard, then show the run with nothing to configure. It costs rank 0 the forwarding of its
``on_log`` events (batched, a few calls a second at most) and the actor a few metric updates.

Not by default on the embedded local Ray that a run starts for itself: no Prometheus scrapes
it, and its metrics end with it when the run returns; nor when the caller started Ray itself
(a notebook, the tests), which ``ray_metrics=True`` covers. ``ray_metrics=False`` never adds it.
"""

from __future__ import annotations

from typing import Any

from callbacks import RayMetrics
from ray_trainer._placement import CallbackLists


def exports_metrics(nodes: list[dict[str, Any]]) -> bool:
    """Whether some alive node of ``ray.nodes()`` has a metrics export port."""
    return any(n.get("Alive") and int(n.get("MetricsExportPort") or 0) > 0 for n in nodes)


def wants_ray_metrics(setting: bool | None, joined: bool, nodes: list[dict[str, Any]]) -> bool:
    """`ray_metrics`: True or False as given; None: on a cluster joined by address whose nodes
    export metrics."""
    if setting is not None:
        return setting
    return joined and exports_metrics(nodes)


def with_default_metrics(lists: CallbackLists, setting: bool | None, joined: bool) -> CallbackLists:
    """`lists` with a ``RayMetrics()`` after the user's callbacks when `wants_ray_metrics` and
    the run has none (of its own, or global)."""
    if any(isinstance(cb, RayMetrics) for cb in (*lists["user"], *lists["global"])):
        return lists
    nodes: list[dict[str, Any]] = []
    if setting is None and joined:
        import ray

        nodes = ray.nodes()
    if not wants_ray_metrics(setting, joined, nodes):
        return lists
    return {**lists, "user": [*lists["user"], RayMetrics()]}
