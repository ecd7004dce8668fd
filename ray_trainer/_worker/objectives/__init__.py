"""Training worker: one module per objective (its loss, batch layout and validation step).

:func:`worker_objective` builds the run's objective from the module its shared description
(``ray_trainer._objectives``) names: the registry entry is the only place that says which
module an objective's worker side is, so adding an objective edits nothing here.
"""

from __future__ import annotations

import importlib
from typing import Any

from ray_trainer._objectives import objective_of
from ray_trainer._worker.objectives.base import WorkerObjective


def worker_objective(args: Any) -> WorkerObjective:
    """The run's objective in this worker: ``build(args)`` of its registered worker module."""
    description = objective_of(args.objective)
    objective = importlib.import_module(description.worker).build(args)
    objective.description = description
    return objective
