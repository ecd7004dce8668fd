"""The training loop: `train_loop_per_worker`, run by Ray Train in every worker process.

Runs in each Ray Train worker (rank r of world_size), inside the process group that Ray Train's
TorchTrainer set up (gloo on CPU, nccl on GPU). Accelerate prepares the model and optimizer (DDP,
mixed precision); the data is sharded by our own resumable sampler.

One optimizer step, top to bottom (`_train_step`)::

    on_step_begin
      per micro-batch: on_before_forward, forward, on_after_forward,
                       on_before_backward, backward, on_after_backward
                       (before the LAST backward: start the step's ONE all-reduce of
                        [loss, tokens, stop, save, evaluate, log, abort], asynchronously)
    on_before_optimizer_step, clip, optimizer.step(), on_after_optimizer_step
    on_step_end                      (its `loss` is this rank's loss for the step)
    -- step boundary: read the agreed values (done by now: it overlapped backward) --
    on_log / evaluation + on_evaluate / checkpoint + on_save, as agreed; stop if agreed

Requests made before the last micro-batch's backward (on_step_begin up to on_before_backward,
and any pending from the previous step) take effect at this step's boundary; requests made later
(on_after_backward, the optimizer-step events, on_step_end, and on_log, on_evaluate, on_save
after the boundary) take effect at the next boundary, one step later. Callback-actor requests
are picked up at the same point, when their reply has arrived.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import ray
import ray.train
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from callbacks import TrainerControl, TrainingContext
from ray_trainer import _checkpoint as ckpt
from ray_trainer._config import TrainingArgs
from ray_trainer._hooks import Hooks
from ray_trainer._placement import build_manager, keep_for_worker, unpack
from ray_trainer._run_files import RunFiles
from ray_trainer._sampler import ResumableDistributedSampler
from ray_trainer._workload import Workload, build_workload

_STOP, _SAVE, _EVAL, _LOG, _ABORT = range(5)
# A stop whose reason contains this marker ends training without a final checkpoint
# (DivergenceDetector(action="abort")).
ABORT_MARKER = "(abort)"


@dataclass
class RunSpec:
    """What the driver hands every worker, through `train_loop_config`."""

    args: TrainingArgs  # without callbacks: those travel in `callbacks_ref`
    callbacks_ref: Any  # ray.ObjectRef of cloudpickled {"core", "user", "global"} lists
    run_dir: str
    launch_id: str
    actor_name: str | None = None
    actor_namespace: str = ""
    forward_events: frozenset[str] = frozenset()


@dataclass
class _State:
    """Everything the loop mutates, in one place (passed around, never global)."""

    args: TrainingArgs
    rank: int
    world_size: int
    accelerator: Any
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    workload: Workload
    loader: DataLoader
    sampler: ResumableDistributedSampler
    hooks: Hooks
    ctx: TrainingContext
    files: RunFiles
    total_steps: int
    steps_per_epoch: int
    progress: ckpt.TrainerState = field(default_factory=ckpt.TrainerState)
    last_saved_step: int = -1
    stop_reason: str | None = None
    abort: bool = False


def train_loop_per_worker(config: dict[str, Any]) -> None:
    spec: RunSpec = config["spec"]
    s = _setup(spec)
    hooks = s.hooks
    failed = False
    try:
        hooks.fire("on_init_end")
        _maybe_resume(s, spec)
        hooks.fire("on_train_begin")
        _train(s)
    except BaseException as exc:
        failed = True
        s.ctx.exception = exc
        hooks.fire("on_exception", exception=exc)
        raise
    finally:
        s.ctx.stop_reason = s.stop_reason
        hooks.fire("on_train_end")
        # The actor first drains its queue and waits for in-flight evaluations: allow for both.
        hooks.close(timeout=spec.args.callback_timeout_s * 2 + spec.args.eval_timeout_s)
        if not failed:
            _write_summary(s)


# ---- setup -------------------------------------------------------------------------------


def _setup(spec: RunSpec) -> _State:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    args = spec.args
    train_ctx = ray.train.get_context()
    rank, world = train_ctx.get_world_rank(), train_ctx.get_world_size()
    files = RunFiles(spec.run_dir, spec.launch_id)
    attempt = _agree_attempt(files, rank, world)

    lists = unpack(ray.get(spec.callbacks_ref))
    manager = build_manager(
        lists, keep_for_worker(rank, actor_available=spec.actor_name is not None)
    )

    accelerator = Accelerator(cpu=not args.use_gpu, mixed_precision=_mixed_precision(args))
    set_seed(args.seed)  # same initial weights on every rank; DDP also broadcasts them
    workload = build_workload(args)

    sampler = ResumableDistributedSampler(
        workload.train_dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed
    )
    loader = DataLoader(
        workload.train_dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        collate_fn=workload.collate_fn,
        drop_last=True,  # every rank takes the same number of steps: collectives stay matched
    )
    steps_per_epoch = len(loader) // args.grad_accum_steps
    if steps_per_epoch == 0:
        raise ValueError(
            f"data: {len(workload.train_dataset)} samples are too few for one optimizer step of "
            f"batch_size={args.batch_size} x grad_accum_steps={args.grad_accum_steps} x "
            f"num_workers={world}; add data or lower batch_size"
        )
    total_steps = args.max_steps or steps_per_epoch * args.num_epochs

    decay = [p for p in workload.model.parameters() if p.ndim >= 2]
    no_decay = [p for p in workload.model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0},
        ],
        lr=args.learning_rate,
    )
    # The scheduler is ours, not accelerate's: its wrapper steps once per process per call.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, _lr_lambda(args.lr_schedule, args.warmup_steps, total_steps)
    )
    model, optimizer = accelerator.prepare(workload.model, optimizer)

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
    forwarder = None
    if rank == 0 and spec.actor_name is not None and spec.forward_events:
        from ray_trainer._forward import EventForwarder

        forwarder = EventForwarder(
            spec.actor_name,
            spec.forward_events,
            attempt=attempt,
            namespace=spec.actor_namespace,
            max_batch=args.event_batch_size,
            flush_interval_s=args.event_flush_interval_s,
            max_in_flight=args.event_max_in_flight,
            max_buffer=args.actor_queue_size,
        )
    hooks = Hooks(manager, ctx, forwarder)
    return _State(
        args=args,
        rank=rank,
        world_size=world,
        accelerator=accelerator,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        workload=workload,
        loader=loader,
        sampler=sampler,
        hooks=hooks,
        ctx=ctx,
        files=files,
        total_steps=total_steps,
        steps_per_epoch=steps_per_epoch,
        progress=ckpt.TrainerState(world_size=world),
    )


def _maybe_resume(s: _State, spec: RunSpec) -> None:
    """Restore from the run's newest complete checkpoint (after a restart, or when a new call
    continues the run), else from `resume_from`.

    The newest complete checkpoint on disk is preferred to `ray.train.get_checkpoint()`: Ray
    Train registers a reported checkpoint only when its controller next polls (~2 s), so a crash
    right after a save would otherwise restart from an older one (or from scratch).
    """
    reported = ray.train.get_checkpoint()
    path = ckpt.latest_checkpoint(spec.run_dir)
    if path is None and reported is not None:
        path = reported.path
    if path is None:
        path = spec.args.resume_from
    if path is None:
        return
    loaded = ckpt.load(path, s.rank)
    s.accelerator.unwrap_model(s.model).load_state_dict(loaded.model)
    if loaded.optimizer is not None:
        s.optimizer.load_state_dict(loaded.optimizer)
    if loaded.scheduler is not None:
        s.scheduler.load_state_dict(loaded.scheduler)
    if loaded.rng is not None:
        ckpt.set_rng_state(loaded.rng)
    s.hooks.manager.load_state_dict(loaded.callbacks)
    s.hooks.manager.user_state.update(loaded.user_state)
    s.progress = loaded.state
    s.progress.world_size = s.world_size
    s.last_saved_step = loaded.state.global_step
    _sync_context(s)
    s.hooks.fire("on_load_checkpoint", checkpoint_path=path)


# ---- the loop ----------------------------------------------------------------------------


def _train(s: _State) -> None:
    p, hooks = s.progress, s.hooks
    while p.global_step < s.total_steps:
        s.sampler.set_epoch(p.epoch)
        # Resume mid-epoch: skip the samples this rank already consumed in this epoch.
        s.sampler.set_start(p.step_in_epoch * s.args.grad_accum_steps * s.args.batch_size)
        s.ctx.epoch = p.epoch
        hooks.fire("on_epoch_begin")
        batches = iter(s.loader)
        while p.step_in_epoch < s.steps_per_epoch and p.global_step < s.total_steps:
            micro_batches = [next(batches) for _ in range(s.args.grad_accum_steps)]
            control = _train_step(s, micro_batches)
            if _after_boundary(s, control):
                return
        if p.step_in_epoch >= s.steps_per_epoch:
            hooks.fire("on_epoch_end")
            p.epoch += 1
            p.step_in_epoch = 0
    # Reached max_steps inside an epoch: nothing more to do (the last boundary saved).


def _train_step(s: _State, micro_batches: list[dict[str, torch.Tensor]]) -> TrainerControl:
    """One optimizer step over `grad_accum_steps` micro-batches; returns the agreed control."""
    hooks, ctx, args, acc = s.hooks, s.ctx, s.args, s.accelerator
    started = time.perf_counter()
    hooks.fire("on_step_begin")
    n_micro = len(micro_batches)
    loss_sum: Any = 0
    tokens: Any = 0
    agreement = None
    for i, batch in enumerate(micro_batches):
        batch = {k: v.to(acc.device, non_blocking=True) for k, v in batch.items()}
        last = i == n_micro - 1
        # Only the last micro-batch all-reduces gradients; the others accumulate locally.
        sync = contextlib.nullcontext() if last else acc.no_sync(s.model)
        with sync:
            hooks.fire("on_before_forward", batch=batch, micro_step=i)
            with acc.autocast():
                outputs = s.model(**batch)
                loss = s.workload.loss_fn(outputs, batch)
            hooks.fire("on_after_forward", batch=batch, outputs=outputs, micro_step=i)
            hooks.fire("on_before_backward", batch=batch, outputs=outputs, micro_step=i)
            loss_sum = loss_sum + loss.detach()
            tokens = tokens + _count_tokens(batch)
            if last:
                agreement = _start_agreement(s, loss_sum, tokens)
            acc.backward(loss / n_micro if n_micro > 1 else loss)
            hooks.fire("on_after_backward", batch=batch, outputs=outputs, micro_step=i)

    hooks.fire("on_before_optimizer_step")
    grad_norm = None
    if args.max_grad_norm is not None:
        grad_norm = acc.clip_grad_norm_(s.model.parameters(), args.max_grad_norm)
    s.optimizer.step()
    s.scheduler.step()
    s.optimizer.zero_grad(set_to_none=True)
    hooks.fire("on_after_optimizer_step", grad_norm=grad_norm)

    p = s.progress
    p.global_step += 1
    p.step_in_epoch += 1
    ctx.global_step = p.global_step
    ctx.elapsed_time = time.perf_counter() - started
    if "on_step_end" in hooks.active:
        ctx.loss = float(loss_sum) / n_micro  # this rank's loss: a CPU-GPU sync
        hooks.fire("on_step_end")

    # Step boundary: the agreement started before the last backward is done by now.
    total = agreement.result()
    requested = agreement.requested
    step_time = time.perf_counter() - started
    ctx.loss = total[0] / (n_micro * s.world_size)
    p.tokens_seen += round(total[1])
    p.samples_seen += n_micro * args.batch_size * s.world_size
    ctx.tokens_seen, ctx.samples_seen = p.tokens_seen, p.samples_seen
    ctx.elapsed_time = step_time
    ctx.throughput = total[1] / step_time if step_time > 0 else 0.0
    ctx.learning_rate = s.scheduler.get_last_lr()[0]
    ctx.grad_norm = float(grad_norm) if grad_norm is not None else None
    agreed = TrainerControl(
        should_training_stop=total[2 + _STOP] > 0,
        should_save=total[2 + _SAVE] > 0,
        should_evaluate=total[2 + _EVAL] > 0,
        should_log=total[2 + _LOG] > 0,
    )
    s.abort = total[2 + _ABORT] > 0
    if requested.should_training_stop:
        s.stop_reason = requested.stop_reason
    elif agreed.should_training_stop and s.stop_reason is None:
        s.stop_reason = "a callback on another rank"
    return agreed


class _Agreement:
    """The step's one all-reduce of [loss, tokens, stop, save, evaluate, log, abort], summed
    over ranks, in flight; and this rank's requests that went into it."""

    def __init__(self, values: torch.Tensor, requested: TrainerControl, world: int) -> None:
        self.values = values
        self.requested = requested
        self.work = dist.all_reduce(values, async_op=True) if world > 1 else None

    def result(self) -> list[float]:
        """The summed values (waits if the all-reduce is still running; it rarely is)."""
        if self.work is not None:
            self.work.wait()
        return self.values.tolist()


def _start_agreement(s: _State, loss_sum: Any, tokens: Any) -> _Agreement:
    """Start the step's all-reduce without waiting for it (called before the last backward).

    It carries the step's loss and token count and every control request made so far, so the
    ranks agree them at this step's boundary. It runs while backward and the optimizer step
    compute, so the loop does not wait for it: a blocking all-reduce at the boundary cost 3-5%
    of a 50 ms step here. (Riding in DDP's gradient all-reduce through a Python comm hook was
    measured too, and cost more: every bucket then goes through Python instead of DDP's C++
    path.) Requests made later in the step act at the next boundary.
    """
    requested = s.hooks.take_pending()
    flags = [
        requested.should_training_stop,
        requested.should_save,
        requested.should_evaluate,
        requested.should_log,
        requested.should_training_stop and ABORT_MARKER in (requested.stop_reason or ""),
    ]
    values = torch.tensor([0.0, 0.0, *flags], dtype=torch.float64, device=s.accelerator.device)
    values[0] = loss_sum
    values[1] = tokens
    return _Agreement(values, requested, s.world_size)


def _after_boundary(s: _State, agreed: TrainerControl) -> bool:
    """Act on the agreed control at the step boundary; True when training must end now."""
    args, p, hooks, ctx = s.args, s.progress, s.hooks, s.ctx
    step = p.global_step
    finished = step >= s.total_steps
    stop = agreed.should_training_stop or finished

    log_due = agreed.should_log or step % args.log_every_steps == 0 or finished
    if log_due and "on_log" in hooks.active:
        ctx.cuda_mem_allocated = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        ctx.batch_metrics = {
            "loss": ctx.loss,
            "learning_rate": ctx.learning_rate,
            "grad_norm": ctx.grad_norm,
            "step_time": ctx.elapsed_time,
            "tokens_per_s": ctx.throughput,
            "epoch": p.epoch,
        }
        hooks.fire("on_log")
    if agreed.should_evaluate or (args.eval_every_steps and step % args.eval_every_steps == 0):
        _evaluate(s)
    wants_save = agreed.should_save or (args.save_every_steps and step % args.save_every_steps == 0)
    if agreed.should_training_stop and not finished:
        wants_save = not s.abort  # a stop leaves a final checkpoint, an abort does not
    if finished and args.save_at_end and not s.abort:
        wants_save = True
    if wants_save and s.last_saved_step != step:
        _save(s)
    if stop and agreed.should_training_stop:
        p.stop_reason = s.stop_reason
    return stop


def _evaluate(s: _State) -> None:
    """Validation pass on this rank's shard, reduced across ranks, then `on_evaluate`."""
    wl, acc = s.workload, s.accelerator
    if wl.val_dataset is None:
        return
    model = acc.unwrap_model(s.model)  # no DDP hooks: ranks may see different batch counts
    sampler = torch.utils.data.distributed.DistributedSampler(
        wl.val_dataset, num_replicas=s.world_size, rank=s.rank, shuffle=False
    )
    loader = DataLoader(
        wl.val_dataset, batch_size=s.args.batch_size, sampler=sampler, collate_fn=wl.collate_fn
    )
    was_training = model.training
    model.eval()
    loss_sum, count = 0.0, 0
    with torch.no_grad():
        for i, batch in enumerate(loader):
            if s.args.eval_max_batches is not None and i >= s.args.eval_max_batches:
                break
            batch = {k: v.to(acc.device) for k, v in batch.items()}
            with acc.autocast():
                loss = wl.loss_fn(model(**batch), batch)
            n = len(next(iter(batch.values())))
            loss_sum += float(loss) * n
            count += n
        extra = wl.rank0_metrics(model) if wl.rank0_metrics and s.rank == 0 else {}
    model.train(was_training)
    names = sorted(extra) if s.rank == 0 else []
    if s.world_size > 1:
        # Every rank must join; rank 0 tells the others which extra metrics it computed.
        holder = [names]
        dist.broadcast_object_list(holder, src=0)
        names = holder[0]
    vec = torch.tensor([loss_sum, count, *(extra.get(n, 0.0) for n in names)], dtype=torch.float64)
    if s.world_size > 1:
        vec = vec.to(acc.device)
        dist.all_reduce(vec)
    values = vec.tolist()
    metrics = {"val_loss": values[0] / max(values[1], 1)}
    metrics.update(zip(names, values[2:], strict=True))
    s.ctx.val_metrics = metrics
    s.hooks.fire("on_evaluate", val_metrics=metrics, eval_step=s.progress.global_step)


def _save(s: _State) -> None:
    """Write a checkpoint through `ray.train.report` (a barrier across ranks), then `on_save`."""
    p, acc = s.progress, s.accelerator
    name = f"checkpoint_{p.global_step:08d}"
    manager = s.hooks.manager
    with tempfile.TemporaryDirectory(prefix="ray_trainer_ckpt_") as folder:
        if s.rank == 0:
            ckpt.write_rank_part(
                folder,
                rank=0,
                world_size=s.world_size,
                callback_state=manager.state_dict(),
                user_state=dict(manager.user_state),
                model=acc.unwrap_model(s.model).state_dict(),
                optimizer=s.optimizer.state_dict(),
                scheduler=s.scheduler.state_dict(),
                trainer_state=p,
            )
        else:
            ckpt.write_rank_part(
                folder,
                rank=s.rank,
                world_size=s.world_size,
                callback_state=manager.state_dict(),
                user_state=dict(manager.user_state),
            )
        metrics = {"global_step": p.global_step, "epoch": p.epoch, "loss": s.ctx.loss}
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(folder),
            checkpoint_dir_name=name,
        )
    s.last_saved_step = p.global_step
    path = os.path.join(s.files.run_dir, name)
    s.ctx.checkpoint_path = path
    s.hooks.fire("on_save", checkpoint_path=path)


def _write_summary(s: _State) -> None:
    """Gather what each rank knows (errors, stop reasons) and let rank 0 record the summary."""
    mgr = s.hooks.manager
    local = {
        "rank": s.rank,
        "errors": [{k: v for k, v in vars(e).items() if k != "traceback"} for e in mgr.errors],
        "error_counts": {f"{k[0]}|{k[1]}": v for k, v in mgr.error_counts.items()},
        "stop_reason": s.stop_reason,
    }
    gathered = [local]
    if s.world_size > 1:
        gathered = [None] * s.world_size
        dist.all_gather_object(gathered, local)
    if s.rank != 0:
        return
    p, fwd = s.progress, s.hooks.forwarder
    stop_reason = next((g["stop_reason"] for g in gathered if g["stop_reason"]), None)
    s.files.write_summary(
        {
            "global_step": p.global_step,
            "epoch": p.epoch,
            "samples_seen": p.samples_seen,
            "tokens_seen": p.tokens_seen,
            "loss": s.ctx.loss,
            "val_metrics": dict(s.ctx.val_metrics or {}),
            "checkpoint_path": os.path.join(s.files.run_dir, f"checkpoint_{s.last_saved_step:08d}")
            if s.last_saved_step > 0
            else None,
            "stopped_early": p.global_step < s.total_steps,
            "stop_reason": stop_reason,
            "callback_errors": [e for g in gathered for e in g["errors"]],
            "undelivered_events": fwd.undelivered if fwd is not None else 0,
            "dropped_events": dict(fwd.dropped) if fwd is not None else {},
            "attempt": s.ctx.attempt,
        }
    )


# ---- small helpers ------------------------------------------------------------------------


def _count_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor | int:
    """Tokens in a batch: the attention mask's ones, else the input ids, else 0 (not text)."""
    mask = batch.get("attention_mask")
    if mask is not None:
        return mask.sum()
    ids = batch.get("input_ids")
    return ids.numel() if ids is not None else 0


def _agree_attempt(files: RunFiles, rank: int, world: int) -> int:
    """Rank 0 counts this start of the worker group; every rank learns the count."""
    holder = [files.bump_attempt() if rank == 0 else None]
    if world > 1:
        dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _sync_context(s: _State) -> None:
    p, ctx = s.progress, s.ctx
    ctx.global_step, ctx.epoch = p.global_step, p.epoch
    ctx.samples_seen, ctx.tokens_seen = p.samples_seen, p.tokens_seen


def _mixed_precision(args: TrainingArgs) -> str:
    if args.mixed_precision != "auto":
        return args.mixed_precision
    if args.use_gpu and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "no"


def _lr_lambda(kind: str, warmup: int, total: int):
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
