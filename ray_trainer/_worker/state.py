"""Training worker: `WorkerState`, everything one rank's loop mutates, in one place.

Built by ``assemble.py`` once per worker-group start and passed to every function of the loop (never
a global). It stands beneath the modules that read it (the loop, saving, resume, validation,
the asynchronous saves), so none of them imports the setup that builds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from callbacks import TrainingContext
from ray_trainer._checkpoint import TrainerState
from ray_trainer._config.args import TrainingArgs
from ray_trainer._contract import RunSpec
from ray_trainer._storage import Location
from ray_trainer._worker.checkpoints.export import Export
from ray_trainer._worker.model.parallel import Replicated, Sharded
from ray_trainer._worker.step.hooks import Hooks
from ray_trainer._worker.step.micro_batches import StepLoader
from ray_trainer._worker.step.throughput import ModelShape, Window
from ray_trainer._worker.workload import Workload


@dataclass
class WorkerState:
    """Everything the loop mutates, in one place (passed around, never global)."""

    spec: RunSpec
    args: TrainingArgs
    rank: int
    world_size: int
    accelerator: Any
    parallel: Replicated | Sharded  # DDP or FSDP2: how the model is spread over the ranks
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    workload: Workload
    loader: StepLoader
    hooks: Hooks
    ctx: TrainingContext
    total_steps: int
    steps_per_epoch: int
    progress: TrainerState = field(default_factory=TrainerState)
    last_saved_step: int = -1
    stop_reason: str | None = None
    abort: bool = False
    pending: Any = None  # the last step's agreement, read (and acted on) at the next boundary
    grad_norm: Any = None  # the last step's gradient norm, a tensor until logged
    window: Window = field(default_factory=Window)  # tokens and time since the last log
    model_shape: ModelShape = field(default_factory=lambda: ModelShape(0))
    peak_flops: float | None = None  # of one device, for MFU
    copy_stream: Any = None  # on a GPU: the side stream that copies agreements to the host
    offload: Any = None  # offload_activations on a GPU: the ActivationOffload (offload.py)
    saves: Any = None  # with async_checkpoint: the AsyncSaves (async_save.py)
    export: Export | None = None  # the hf/ export of every checkpoint (export.py), or None
    run: Location | None = None  # the run folder on storage, located once (spec.run_dir)
    # The objective's metrics of the last agreed step (DPO's: TRL's names), added to every
    # log's batch_metrics.
    objective_metrics: dict[str, float] = field(default_factory=dict)
