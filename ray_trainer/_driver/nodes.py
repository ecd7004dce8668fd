"""Driver: what every node of the cluster sees: a shared storage path.

Runs in the driver after Ray is up and before any worker starts. A real cluster shares no disk:
a local ``storage_path`` must be a mount every node sees (NFS, EFS...). On a cluster of more
than one node the driver writes a marker into storage and a tiny Ray task on every node
(``num_cpus=0``, pinned to the node) checks that it reads the same marker. (A local data file
the driver reads may exist nowhere else: the driver sends its pieces to the preparation tasks
through the object store, and they encode it into the run's token cache on that storage, which
every worker reads; ``_driver/data.py``.)
"""

from __future__ import annotations

import secrets
from typing import Any

from ray_trainer._config.args import TrainingArgs
from ray_trainer._errors import TrainingArgsError
from ray_trainer._storage import is_uri, locate

PROBE_TIMEOUT_S = 120.0


class StorageNotShared(TrainingArgsError):
    """A local path that some node of the cluster cannot see."""


def alive_nodes() -> list[dict[str, Any]]:
    """The live nodes of the cluster this driver joined (``ray.nodes()`` entries)."""
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def check_shared_storage(args: TrainingArgs, nodes: list[dict[str, Any]]) -> None:
    """Refuse a local `storage_path` that some node cannot see (one node, a URI or a custom
    filesystem pass at once)."""
    if len(nodes) < 2 or args.storage_filesystem is not None or is_uri(args.storage_path):
        return
    root = locate(args.storage_path)
    token = secrets.token_hex(8)
    marker = root.child(".ray_trainer", f"probe-{token}")
    marker.write_text(token)
    try:
        seen = _probe(nodes, marker.path)
    finally:
        marker.delete()
    blind = [node for node, text in seen if text != token]
    if blind:
        raise StorageNotShared(
            f"storage_path {root.name} is not shared by every node: "
            f"{_describe(blind)} cannot see what the driver wrote there. Every file of a run "
            "(checkpoints, the run record, the callback actor's state) must be reachable from "
            "every node: use a shared mount every node has (NFS, EFS) or a bucket URI such as "
            "storage_path='s3://my-bucket/runs'"
        )


def _probe(nodes: list[dict[str, Any]], path: str) -> list[tuple]:
    """(node, the text it read at `path`) for every node (None when it sees no such file)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(_read_on_node)
    refs = [
        task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
        ).remote(path)
        for node in nodes
    ]
    results = ray.get(refs, timeout=PROBE_TIMEOUT_S)
    return list(zip(nodes, results, strict=True))


def _read_on_node(path: str) -> Any:
    """The probe task's body, on one node: what that node sees at `path`."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _describe(nodes: list[dict[str, Any]]) -> str:
    names = [f"{n.get('NodeManagerAddress', '?')} (node {n['NodeID'][:12]})" for n in nodes]
    return ("node " if len(names) == 1 else "nodes ") + ", ".join(names)
