"""Driver: the Ray Train trainer class a run is launched with (Ray Train's `TorchTrainer`,
without what a run never uses).

Runs in the driver, where `_fit` builds the trainer. Ray Train 2.60 gives every run two
callbacks that start an actor of their own, and a run of ours may not use either:

- **Ray Data's** (``DatasetsCallback``) starts a ``DatasetManager`` actor beside the controller
  each time a worker group starts, whether or not the run has a Ray Dataset. A run of ours never
  has one: the workers read the token cache themselves (``_worker/step/micro_batches.py``). It
  is left out where the run has no Ray Dataset.
- **The placement group's cleaner** (``PlacementGroupCleanerCallback``) starts a detached
  ``PlacementGroupCleaner`` per run, which removes the workers' placement group should the
  controller die without removing it. It learns that from Ray's state API, which the dashboard
  serves: on a Ray without a dashboard (``TrainingArgs.dashboard=False``, ``ray start
  --include-dashboard=false``) every check fails ("Failed to query Ray Train Controller actor
  state", logged each second for the whole run) and it never cleans anything. It is left out
  there, and kept wherever a dashboard runs or the driver cannot tell.

And **`TorchConfig`**, the run's backend config, whose module imports torch in the controller
that unpickles it, only to send functions to the workers: the run takes ``LeanTorchConfig``
(``torch_backend.py``), the same setup without torch there, where this Ray Train's functions are
as that module knows them.

Each callback is one more process per run or start, importing Ray Train (2-3 CPU-seconds on the 2-core
test machine, against some 15 for a whole one-worker fit). Each is left out only where this Ray
has it as this module knows it; any other Ray gets its `TorchTrainer` unchanged (and
`test_driver_trainer.py` fails on the Ray that changed).
"""

from __future__ import annotations

import functools
from typing import Any

from ray_trainer._driver.console import cluster_has_dashboard


@functools.cache
def torch_trainer_class() -> type:
    """`TorchTrainer`, or a subclass of it that leaves out the callbacks a run does not use
    (where this Ray Train has them as this module knows them)."""
    from ray.train.torch import TorchTrainer

    # imports Ray Train, as the line above does: not at this module's top, which the
    # processes that never build a trainer import (the callback actor, the CLI)
    from ray_trainer._driver.torch_backend import lean_torch_config

    try:
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
        from ray.train.v2._internal.callbacks.placement_group_callback import (
            PlacementGroupCleanerCallback,
        )
    except ImportError:  # another Ray Train: its trainer as it is
        return TorchTrainer
    if not callable(getattr(TorchTrainer, "_create_default_callbacks", None)):
        return TorchTrainer  # Ray Train V1 (RAY_TRAIN_V2_ENABLED=0)

    class TorchTrainerWithoutUnused(TorchTrainer):
        """Ray Train's `TorchTrainer`; without a Ray Dataset, no Ray Data callback; without a
        dashboard, no placement group cleaner; the controller without torch."""

        def __init__(self, *args: Any, torch_config: Any = None, **kwargs: Any) -> None:
            if torch_config is None:
                torch_config = lean_torch_config(kwargs.get("scaling_config"))
            super().__init__(*args, torch_config=torch_config, **kwargs)

        def _create_default_callbacks(self) -> list[Any]:
            callbacks = super()._create_default_callbacks()
            unused: tuple[type, ...] = () if self.datasets else (DatasetsCallback,)
            if not cluster_has_dashboard():
                unused += (PlacementGroupCleanerCallback,)
            return [c for c in callbacks if not isinstance(c, unused)]

    return TorchTrainerWithoutUnused
