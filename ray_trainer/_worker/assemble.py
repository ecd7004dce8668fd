"""Training worker: building one rank's model, optimizer, scheduler, data and hooks.

Runs in each training worker, once per worker-group start, inside the process group that Ray
Train set up (gloo on CPU, nccl on GPU). Accelerate prepares the model and optimizer (DDP,
mixed precision); the data is sharded by our own resumable sampler.
"""

from __future__ import annotations

import math
from typing import Any

import ray
import ray.train
import torch

from callbacks import TrainingContext
from ray_trainer import _checkpoint as ckpt
from ray_trainer._config.args import TrainingArgs
from ray_trainer._contract import RunSpec
from ray_trainer._placement import build_manager, keep_for_worker, unpack
from ray_trainer._storage import locate
from ray_trainer._worker.checkpoints.export import choose_export
from ray_trainer._worker.checkpoints.resume import agree_attempt
from ray_trainer._worker.model.offload import build_offload
from ray_trainer._worker.model.packing_check import check_packed_attention
from ray_trainer._worker.model.parallel import prepare
from ray_trainer._worker.objectives import worker_objective
from ray_trainer._worker.state import WorkerState
from ray_trainer._worker.step.hooks import Hooks
from ray_trainer._worker.step.micro_batches import StepLoader
from ray_trainer._worker.step.throughput import model_shape, peak_flops
from ray_trainer._worker.workload import Workload, build_workload


def setup(spec: RunSpec) -> WorkerState:
    """Build this rank's model, optimizer, scheduler, data loader, callbacks and context."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    args = spec.args
    train_ctx = ray.train.get_context()
    rank, world = train_ctx.get_world_rank(), train_ctx.get_world_size()
    run = locate(spec.run_dir, args.storage_filesystem)  # every file of the run is below it
    attempt = agree_attempt(spec, run, rank, world)
    forwarder = _forwarder(spec, rank, attempt, world)  # first: the actor counts this start at once

    lists = unpack(ray.get(spec.callbacks_ref))
    manager = build_manager(lists, keep_for_worker(rank))

    precision = mixed_precision(args)
    if args.use_gpu and precision != "no":  # TF32 for the fp32 matmuls that remain
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    # Under FSDP, mixed precision is FSDP's own policy (parallel.py), not accelerate's autocast.
    accelerator = Accelerator(
        cpu=not args.use_gpu, mixed_precision="no" if args.strategy == "fsdp" else precision
    )
    set_seed(args.seed)  # same initial weights on every rank (FSDP shards each rank's copy)
    # The objective first (its registry entry names its module): the workload is built around it.
    objective = worker_objective(args)
    objective.begin(spec, rank, attempt)  # GRPO: its engines start loading beside this rank
    prompts = {f: ray.get(ref) for f, ref in spec.prompts.items()}  # GRPO's, encoded
    workload = build_workload(
        args, objective, spec.data_caches, spec.chat_template, spec.references, prompts
    )
    loader = _loader(args, workload, world, rank)
    steps_per_epoch = loader.steps_per_epoch * objective.iterations
    if steps_per_epoch == 0:
        raise ValueError(
            f"data: {len(workload.train_dataset)} samples are too few for one optimizer step of "
            f"batch_size={args.batch_size} x grad_accum_steps={args.grad_accum_steps} x "
            f"num_workers={loader.step_world}; add data or lower batch_size"
        )
    total_steps = args.max_steps or steps_per_epoch * args.num_epochs

    def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
        return _optimizer(model, args, accelerator.device)

    parallel = prepare(
        workload.model, args, accelerator, make_optimizer, precision, workload.materialize
    )
    model, optimizer = parallel.model, parallel.optimizer
    objective.after_placement(workload, parallel)  # before any step changes the model
    if args.packing:  # on the real model, before any step: packed samples must stay apart
        check_packed_attention(
            parallel.module(), accelerator.device, accelerator.autocast, loader.pad_to,
            loader.layout,
        )  # fmt: skip
    # The scheduler is ours, not accelerate's: its wrapper steps once per process per call.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(args.lr_schedule, args.warmup_steps, total_steps)
    )

    ctx = TrainingContext(
        rank=rank,
        world_size=world,
        local_rank=train_ctx.get_local_rank(),
        is_world_process_zero=rank == 0,
        is_local_process_zero=train_ctx.get_local_rank() == 0,
        run_name=args.run_name,
        attempt=attempt,
        max_steps=total_steps,
        args=args.to_public_dict(),
        user_state=manager.user_state,
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        global_step=0,
        epoch=0,
        samples_seen=0,
        tokens_seen=0,
    )
    saves = None
    notice = preemption_notice() if rank == 0 else None
    if args.async_checkpoint:
        from ray_trainer._worker.checkpoints.async_save import AsyncSaves

        saves = AsyncSaves()
        notice = saves.watch(notice)  # a preemption save waits for its write
    state = WorkerState(
        spec=spec,
        args=args,
        rank=rank,
        world_size=world,
        accelerator=accelerator,
        parallel=parallel,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        workload=workload,
        loader=loader,
        hooks=Hooks(manager, ctx, forwarder, notice),
        ctx=ctx,
        total_steps=total_steps,
        steps_per_epoch=steps_per_epoch,
        progress=ckpt.TrainerState(world_size=loader.step_world),
        model_shape=model_shape(model),
        peak_flops=peak_flops(accelerator.device, args.peak_flops),
        copy_stream=torch.cuda.Stream(accelerator.device)
        if accelerator.device.type == "cuda"
        else None,
        offload=build_offload(args.offload_activations, accelerator.device, rank),
        saves=saves,
        export=choose_export(parallel, workload, args.save_hf_format),
        run=run,
    )
    objective.before_training(state, spec.references)  # DPO: the references left to it (FSDP)
    return state


def _loader(args: TrainingArgs, workload: Workload, world: int, rank: int) -> StepLoader:
    """This rank's step loader: every step takes batch_size x grad_accum_steps x num_workers
    samples of the epoch (an elastic run's `max`, whatever the size of this worker group;
    drop_last: every rank takes the same number of steps, collectives match)."""
    max_tokens = args.tokens_per_micro_batch
    cache = getattr(workload.train_dataset, "cache", None)
    return StepLoader(
        workload.train_dataset,
        world=world,
        logical_world=args.max_workers,
        rank=rank,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum_steps,
        seed=args.seed,
        pad_id=workload.pad_id if workload.pad_id is not None else 0,
        shifts_labels=workload.shifts_labels,
        collate=workload.collate_fn,
        max_tokens=max_tokens,
        # compile=True: one shape for every packed row, no recompilation per length.
        pad_to=max_tokens if (max_tokens and args.compile) else 1,
        prefetch=cache is not None and not cache.location.is_local,
        layout=workload.packed_layout,
        pin=args.use_gpu and torch.cuda.is_available(),
    )


def preemption_notice() -> Any:
    """A callable that is True once, when Ray Train's preemption watcher has told this worker
    that a node of the run is about to be preempted (a spot reclaim); None on a Ray without
    one. Rank 0 alone reads it (Ray's watcher tells every rank, maybe at different steps: one
    reader asks for one save), with no collective: the step's all-reduce agrees the save."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        holder = get_train_context().preemption_context
    except Exception:  # another Ray: no notices
        return None
    seen = []

    def noticed() -> bool:
        if seen or holder.preemption_info is None:
            return False
        seen.append(holder.preemption_info)
        return True

    return noticed


def _forwarder(spec: RunSpec, rank: int, attempt: int, world: int) -> Any:
    """Rank 0's event forwarder to the callback actor (None on the other ranks)."""
    if rank != 0:
        return None
    from ray_trainer._worker.step.event_forwarder import EventForwarder

    args = spec.args
    return EventForwarder(
        spec.actor_name,
        spec.forward_events,
        attempt=attempt,
        namespace=spec.actor_namespace,
        world_size=world,
        max_batch=args.event_batch_size,
        flush_interval_s=args.event_flush_interval_s,
        max_in_flight=args.event_max_in_flight,
        max_buffer=args.actor_queue_size,
    )


def _optimizer(
    model: torch.nn.Module, args: TrainingArgs, device: torch.device
) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (a LoRA run's adapters alone), with weight decay on
    matrices only (not on biases and norms); fused on CUDA."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0},
        ],
        lr=args.learning_rate,
        **optimizer_options(device),
    )


def optimizer_options(device: torch.device) -> dict[str, Any]:
    """AdamW's implementation for the device: the fused kernel on CUDA (one kernel for every
    parameter, as torch recommends there); torch's default elsewhere."""
    return {"fused": True} if device.type == "cuda" else {}


def mixed_precision(args: TrainingArgs) -> str:
    """Accelerate's mixed precision for the run: bf16 on a GPU that has it, with ``"auto"``."""
    if args.mixed_precision != "auto":
        return args.mixed_precision
    if args.use_gpu and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "no"


def lr_lambda(kind: str, warmup: int, total: int):
    """The LR factor per step: linear warm-up, then linear, cosine or constant."""

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        progress = min(max(progress, 0.0), 1.0)
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return max(0.0, 1.0 - progress)

    return factor
