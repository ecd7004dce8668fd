"""Driver: the Ray Train trainer class a run is launched with (Ray Train's `TorchTrainer`,
without what a run that passes no Ray Dataset never uses).

Runs in the driver, where `_fit` builds the trainer. Ray Train 2.60 gives every run a Ray Data
callback (``DatasetsCallback``), which starts a ``DatasetManager`` actor beside the controller
each time a worker group starts, whether or not the run has a Ray Dataset. A run of ours never
has one: the workers read the token cache themselves (``_worker/step/micro_batches.py``). That
actor is one more process per start and per restart, importing Ray Train and Ray Data (about 3 CPU-seconds
each on the 2-core test machine, against some 35 for a whole two-worker start). The callback is
left out only where this Ray has it as this module knows it; any other Ray gets its
`TorchTrainer` unchanged (and `test_driver_trainer.py` fails on the Ray that changed).
"""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def torch_trainer_class() -> type:
    """`TorchTrainer`, or a subclass of it whose runs without a Ray Dataset start no
    ``DatasetManager`` actor (where this Ray Train has the callback that starts one)."""
    from ray.train.torch import TorchTrainer

    try:
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    except ImportError:  # another Ray Train: its trainer as it is
        return TorchTrainer
    if not callable(getattr(TorchTrainer, "_create_default_callbacks", None)):
        return TorchTrainer  # Ray Train V1 (RAY_TRAIN_V2_ENABLED=0)

    class TorchTrainerWithoutDatasets(TorchTrainer):
        """Ray Train's `TorchTrainer`; without a Ray Dataset, no Ray Data callback."""

        def _create_default_callbacks(self) -> list[Any]:
            callbacks = super()._create_default_callbacks()
            if self.datasets:
                return callbacks
            return [c for c in callbacks if not isinstance(c, DatasetsCallback)]

    return TorchTrainerWithoutDatasets
