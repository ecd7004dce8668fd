"""Driver and callback actor: whether the cluster can ever run a task, now or once it grows.

Runs in the driver (before training, ``_driver/checks/resources.py``) and in the callback actor (before
each evaluation task, ``_actor/evaluation.py``), both joined to the cluster. `missing` says
why no live node could run a task of some resources. `can_grow` says whether nodes may still
come: a cluster with an autoscaler (`has_autoscaler`), or one whose driver was told so with
``RAY_TRAINER_SKIP_RESOURCE_CHECK=1``.

How the autoscaler is found, as ``ray status`` finds it: the autoscaler's monitor process on the
head publishes its view of the cluster in the GCS: autoscaler v1 as a JSON report under the
internal KV key ``__autoscaling_status``, v2 through the GCS's cluster status
(``ray.autoscaler.v2.sdk.get_cluster_status``). Every head runs a monitor, also ``ray start
--head`` and an embedded ``ray.init()``: without a cluster config it uses Ray's read-only
provider, which adds no node and names each node's type after the node itself
(``node_<56 hex digits of the node id>``). An autoscaler with a config (``ray up``, KubeRay)
names its node types after the config's (``ray.head.default``, ``gpu_workers``...). So the
cluster has an autoscaler when some node type it reports is not such an anonymous one.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger("ray_trainer")

#: The type Ray's read-only provider gives each node: "node_" and the node id's hex.
_ANONYMOUS_NODE_TYPE = re.compile(r"node_[0-9a-f]{56}")
#: Set on the head of an autoscaling cluster (cluster.yaml): trust it to grow.
SKIP_RESOURCE_CHECK = "RAY_TRAINER_SKIP_RESOURCE_CHECK"


def missing(need: dict[str, float], nodes: list[dict[str, float]]) -> str | None:
    """Why none of `nodes` (each node's total resources) could run a task that asks for
    `need`, or None when one could. Zero amounts are not asked for."""
    need = {k: v for k, v in need.items() if v}
    if any(all(node.get(k, 0.0) >= v for k, v in need.items()) for node in nodes):
        return None
    total = ", ".join(f"{k}={sum(n.get(k, 0.0) for n in nodes):g}" for k in need)
    return f"asks for {need}, but no node has that (cluster: {total} over {len(nodes)} node(s))"


def live_nodes() -> list[dict[str, float]]:
    """The total resources of each live node of the cluster this process joined."""
    import ray

    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def can_grow() -> bool:
    """Whether resources that no node has now may still come: the cluster has an autoscaler,
    or ``RAY_TRAINER_SKIP_RESOURCE_CHECK=1`` says the user expects nodes to join."""
    return os.environ.get(SKIP_RESOURCE_CHECK) == "1" or has_autoscaler()


def has_autoscaler() -> bool:
    """Whether an autoscaler that can add nodes runs this cluster (see the module's text).
    False when the GCS has no report yet or cannot be read."""
    try:
        types = reported_node_types()
    except Exception as e:  # a Ray without these internals: assume a fixed cluster
        logger.debug("could not read the autoscaler's status: %s", e)
        return False
    return names_configured_types(types)


def names_configured_types(node_types: Iterable[str]) -> bool:
    """True when some node type comes from an autoscaler's config; Ray's read-only provider
    (a cluster without an autoscaler) names every node ``node_<its id>``."""
    return any(t and not _ANONYMOUS_NODE_TYPE.fullmatch(t) for t in node_types)


def reported_node_types() -> list[str]:
    """The node types that the autoscaler's monitor reports in the GCS, as ``ray status``
    reads them (autoscaler v2: the GCS's cluster status; v1: the monitor's JSON report)."""
    import ray
    from ray.autoscaler.v2.utils import is_autoscaler_v2

    if is_autoscaler_v2(fetch_from_server=True):
        from ray.autoscaler.v2.sdk import get_cluster_status

        status = get_cluster_status(ray.get_runtime_context().gcs_address)
        nodes = [
            *status.active_nodes,
            *status.idle_nodes,
            *status.pending_launches,
            *status.pending_nodes,
        ]
        return [n.ray_node_type_name for n in nodes]
    from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(DEBUG_AUTOSCALING_STATUS)
    return v1_node_types(json.loads(raw) if raw else None)


def v1_node_types(status: dict[str, Any] | None) -> list[str]:
    """The node types in autoscaler v1's ``__autoscaling_status`` report (None: no report)."""
    report = (status or {}).get("autoscaler_report") or {}
    types = list((report.get("node_type_mapping") or {}).values())
    types += list(report.get("active_nodes") or {})
    types += list(report.get("pending_launches") or {})
    types += [entry[1] for entry in report.get("pending_nodes") or [] if len(entry) > 1]
    return types
