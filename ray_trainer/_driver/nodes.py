"""Driver: what every node of the cluster sees: a shared storage path, and the run's data files.

Runs in the driver after Ray is up and before any worker starts. A real cluster shares no disk:
a local ``storage_path`` must be a mount every node sees (NFS, EFS...), and a local data file
the driver reads may exist nowhere else. On a cluster of more than one node the driver writes a
marker into storage and a tiny Ray task on every node (``num_cpus=0``, pinned to the node)
checks that it reads the same marker; a small local data file is shipped to the workers
through Ray's object store, a large one must be visible on every node.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

from ray_trainer._config import TrainingArgs, TrainingArgsError
from ray_trainer._storage import is_uri, locate

#: Local data files up to this size travel with the run through Ray's object store when the
#: cluster has several nodes; larger ones must be visible at the same path on every node.
SHIP_LIMIT_BYTES = 100 * 1024 * 1024
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


def ship_data(args: TrainingArgs, nodes: list[dict[str, Any]]) -> dict[str, Any]:
    """The data files to send through Ray's object store (field -> ObjectRef of the bytes).

    On one node nothing is shipped (the workers read the file where the driver does). On
    several, a local file up to `SHIP_LIMIT_BYTES` is shipped; a larger one is refused unless
    every node sees a file of the same size at that path.
    """
    import ray

    shipped: dict[str, Any] = {}
    if len(nodes) < 2:
        return shipped
    for field in ("data", "val_data"):
        path = getattr(args, field)
        if not isinstance(path, str) or is_uri(path):
            continue
        size = os.path.getsize(path)
        if size <= SHIP_LIMIT_BYTES:
            with open(path, "rb") as f:
                shipped[field] = ray.put(f.read())
            continue
        seen = _probe(nodes, path, size_only=True)
        blind = [node for node, found in seen if found != size]
        if blind:
            raise TrainingArgsError(
                f"{field}: {path} is {size / 2**20:.0f} MiB, over the {SHIP_LIMIT_BYTES // 2**20} "
                f"MiB that travel with the run, and {_describe(blind)} cannot see it (or sees "
                "another file there): put it on shared storage or in a bucket "
                f"({field}='s3://my-bucket/{os.path.basename(path)}'), or copy it to the same "
                "path on every node"
            )
    return shipped


def _probe(nodes: list[dict[str, Any]], path: str, size_only: bool = False) -> list[tuple]:
    """(node, what it read at `path`) for every node: the text, or the size with `size_only`
    (None when it sees no such file)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(_read_on_node)
    refs = [
        task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
        ).remote(path, size_only)
        for node in nodes
    ]
    results = ray.get(refs, timeout=PROBE_TIMEOUT_S)
    return list(zip(nodes, results, strict=True))


def _read_on_node(path: str, size_only: bool) -> Any:
    """The probe task's body, on one node: what that node sees at `path`."""
    try:
        if size_only:
            return os.path.getsize(path)
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _describe(nodes: list[dict[str, Any]]) -> str:
    names = [f"{n.get('NodeManagerAddress', '?')} (node {n['NodeID'][:12]})" for n in nodes]
    return ("node " if len(names) == 1 else "nodes ") + ", ".join(names)
