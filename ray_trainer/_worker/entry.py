"""Training worker: the worker's door, the one module of ``_worker`` that the driver imports.

The driver hands Ray Train ``train_loop_per_worker``; Ray Train runs it in every worker
process. It imports the training loop only there, inside the function, so that the driver
process never imports the loop or anything the loop stands on.
"""

from __future__ import annotations

from typing import Any


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Run one rank of the training loop on the ``RunSpec`` whose object ref is
    ``config["spec"]`` (worker). A ref, not the spec: Ray Train's controller holds the config as
    well, and never needs to unpickle what the spec names (the model's and callbacks' modules)."""
    import ray

    from ray_trainer._worker.step.loop import run_worker

    run_worker(ray.get(config["spec"]))
