"""One rank's training state from the worker's own assembly, without Ray: for the tests and
benchmarks that run the loop's ``train_step`` in a gloo group of their own.

`step_state` builds what ``_worker/assemble.setup`` builds for a step (``worker_objective``,
``build_workload``, the step loader, ``prepare`` with the runner's AdamW), on the CPU, without
mixed precision, a run directory, callbacks or an event forwarder, and with a constant learning
rate.
"""

from __future__ import annotations

from typing import Any


def step_state(args: Any, cache: str, rank: int, world: int, total_steps: int) -> Any:
    """A `WorkerState` for `args` (a ``TrainingArgs``) on the tokenized cache named `cache`
    (its ``data`` field), rank `rank` of `world` in the process group already set up; the model
    seeded 0."""
    import torch
    from accelerate import Accelerator

    from callbacks import CallbackManager, TrainingContext
    from ray_trainer._worker import assemble
    from ray_trainer._worker.model.parallel import prepare
    from ray_trainer._worker.objectives import worker_objective
    from ray_trainer._worker.state import WorkerState
    from ray_trainer._worker.step.hooks import Hooks
    from ray_trainer._worker.workload import build_workload

    torch.manual_seed(0)
    acc = Accelerator(cpu=True, mixed_precision="no")
    objective = worker_objective(args)
    workload = build_workload(args, objective, {"data": cache})
    loader = assemble._loader(args, workload, world, rank)

    def make_optimizer(m: torch.nn.Module) -> torch.optim.Optimizer:
        return assemble._optimizer(m, args, acc.device)

    parallel = prepare(workload.model, args, acc, make_optimizer, "no", workload.materialize)
    ctx = TrainingContext(rank=rank, world_size=world, model=parallel.module())
    return WorkerState(
        spec=None, args=args, rank=rank, world_size=world, accelerator=acc, parallel=parallel,
        model=parallel.model, optimizer=parallel.optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(parallel.optimizer, lambda _: 1.0),
        workload=workload, loader=loader, hooks=Hooks(CallbackManager(), ctx), ctx=ctx,
        total_steps=total_steps, steps_per_epoch=loader.steps_per_epoch,
    )  # fmt: skip


def write_token_cache(root: str, name: str, samples: list[tuple[list[int], list[int]]]) -> str:
    """A tokenized cache of one piece under `root` holding `samples` ((ids, labels) pairs, -100
    for a position not trained on), as the driver's encoding writes it; its name, for
    `step_state` (a ``data`` cache name)."""
    import numpy as np

    from ray_trainer._data.cache import PieceResult, cache_location, write_meta, write_piece
    from ray_trainer._storage import locate

    location = cache_location(locate(str(root)), name)
    write_piece(location, 0, samples)
    lengths = np.array([len(ids) for ids, _ in samples], dtype=np.int32)
    targets = np.array([sum(x != -100 for x in lab[1:]) for _, lab in samples], dtype=np.int32)
    write_meta(location, {}, [PieceResult(0, lengths, targets, len(samples), 0, 0, [])])
    return location.name
