"""Training worker: what the training loop, setup and validation ask of an objective.

An objective's worker-side module (``sft.py``, ``dpo.py``, ``grpo.py`` here; the module its shared
description names, ``ray_trainer._objectives``) has ``build(args)``, which returns a
:class:`WorkerObjective`: its loss (a micro-batch to the sum the loop backpropagates), its batch
layout (the token cache as is, or a dataset over it that lays out its own padded and packed
micro-batches and fillers: ``padded``, ``packed``, ``fill_filler``, which the step loader
asks for; ``steps``, what each step's micro-batches become before training: GRPO's rollouts),
its step metrics, and its validation step. The loop, setup and validation ask these methods and
never the objective's name. The defaults here are those of an objective that needs nothing
before or after the model is placed and logs no metric of its own.
"""

from __future__ import annotations

from typing import Any

import torch

from ray_trainer._objectives import Objective


class WorkerObjective:
    """One run's objective in a training worker (one instance per rank, built by setup)."""

    #: The objective's shared description (its name, fields, metrics, data formats).
    description: Objective
    #: Optimizer steps taken on each step of the loader (GRPO's ``num_iterations``: passes
    #: over each rollout's completions); an epoch has this many times the loader's steps.
    iterations: int = 1

    # ---- the workload: once per worker-group start, before the model is placed -----------

    def begin(self, spec: Any, rank: int, attempt: int) -> None:
        """Called first, before the model is built: start here what takes long and needs no
        model of this rank (GRPO's rollout engines load while the rank loads its model)."""

    def prepare(self, model: torch.nn.Module, adaptation: Any) -> None:
        """Called once the model is built (LoRA added, not yet placed on its device)."""

    def dataset(self, cached: Any, field: str, args: Any, references: dict[str, str]) -> Any:
        """The dataset of a token cache (the loader's ``CachedDataset``) for `field`."""
        return cached

    def targets_per_sample(self, args: Any, cached: bool) -> int:
        """About how many targets a sample holds (for the loss's constant norm)."""
        return 1

    def after_placement(self, workload: Any, parallel: Any) -> None:
        """Called once the model is placed, before any step changes it."""

    def before_training(self, state: Any, references: dict[str, str]) -> None:
        """Called on every rank once the worker state is built, before it resumes or trains."""

    # ---- the step ----------------------------------------------------------------------

    def steps(self, state: Any, steps: Any) -> Any:
        """The micro-batches of each step, from the loader's (`steps`, an iterator over the
        steps of an epoch): called once per epoch; the default is the loader's own, so the
        step pays nothing. GRPO turns each step's prompts into its completions here."""
        return steps

    def end(self, state: Any) -> None:
        """Called on every rank after the run's last step (not after a failure): the last step
        is trained (GRPO notes it in its prompt ledger)."""

    def step_loss(
        self, workload: Any, model: torch.nn.Module, batch: dict[str, Any], targets: int
    ) -> tuple[Any, torch.Tensor]:
        """(outputs, the micro-batch's loss sum over ``workload.norm``) for backward; `targets`
        is what the loader counted in `batch` (the loop sums it over the step's ranks)."""
        raise NotImplementedError

    def take_sums(self) -> torch.Tensor | None:
        """The step's metric sums so far (a device tensor, in the order of the description's
        ``metrics``), for the step's all-reduce; starts the next step's. None: no metrics."""
        return None

    def metrics_from_sums(self, sums: Any, targets: float) -> dict[str, float]:
        """The step's metrics from their sums over every rank and its agreed target count."""
        return {}

    # ---- validation --------------------------------------------------------------------

    #: Rows of a validation batch per item the sampler deals (a pair: 2).
    rows_per_item = 1

    def val_collate(self, workload: Any) -> Any:
        """The collate function of the validation DataLoader over ``workload.val_dataset``."""
        return workload.collate_fn

    def val_items(self, batch: dict[str, Any]) -> int:
        """The items (samples, pairs...) of a validation batch, on the host."""
        return len(next(iter(batch.values())))

    def val_targets(self, workload: Any, batch: dict[str, Any]) -> int:
        """What a validation batch's loss is the sum over (the validation loss's weight)."""
        raise NotImplementedError

    def val_sums(
        self, workload: Any, model: torch.nn.Module, batch: dict[str, Any], targets: int
    ) -> tuple[Any, torch.Tensor | None]:
        """A validation batch's loss SUM over its `targets` (no gradient), and its metric sums
        (None without metrics). Under FSDP the forward is a collective: always run it."""
        raise NotImplementedError
