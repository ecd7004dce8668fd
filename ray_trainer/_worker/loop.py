"""Training worker: the training loop, run by Ray Train in every worker process.

One optimizer step, top to bottom (`train_step`)::

    on_step_begin
      per micro-batch: on_before_forward, forward, on_after_forward,
                       on_before_backward, backward, on_after_backward
                       (before the LAST backward: start the step's ONE all-reduce of
                        [loss, tokens, stop, save, evaluate, log, abort], asynchronously)
    on_before_optimizer_step, clip, optimizer.step(), on_after_optimizer_step
    on_step_end                      (its `loss` is this rank's loss for the step)
    -- step boundary: read the agreed values (done by now: it overlapped backward) --
    on_log / evaluation + on_evaluate / checkpoint + on_save, as `boundary.decide`s; stop

Requests made before the last micro-batch's backward (on_step_begin up to on_before_backward,
and any pending from the previous step) take effect at this step's boundary; requests made later
(on_after_backward, the optimizer-step events, on_step_end, and on_log, on_evaluate, on_save
after the boundary) take effect at the next boundary, one step later. Callback-actor requests
are picked up at the same point, when their reply has arrived.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from callbacks import TrainerControl
from ray_trainer._contract import RunSpec
from ray_trainer._worker.agreement import Agreement
from ray_trainer._worker.boundary import Schedule, decide
from ray_trainer._worker.resume import maybe_resume
from ray_trainer._worker.saving import evaluate, gather_summary, save
from ray_trainer._worker.setup import WorkerState, setup


def run_worker(spec: RunSpec) -> None:
    """One worker-group start on this rank: set up, resume, train, end (every exit path)."""
    s = setup(spec)
    hooks = s.hooks
    failed = False
    try:
        hooks.fire("on_init_end")
        maybe_resume(s)
        hooks.fire("on_train_begin")
        train(s)
    except BaseException as exc:
        failed = True
        s.ctx.exception = exc
        hooks.fire("on_exception", exception=exc)
        raise
    finally:
        s.ctx.stop_reason = s.stop_reason
        hooks.fire("on_train_end")
        # A collective: only when every rank got here (after a failure a peer may be gone).
        summary = None if failed else gather_summary(s)
        # The actor first drains its queue and waits for in-flight evaluations: allow for both.
        hooks.close(spec.args.callback_timeout_s * 2 + spec.args.eval_timeout_s, summary)


def train(s: WorkerState) -> None:
    """Epochs of steps until `total_steps`, or until a boundary decides to stop."""
    p, hooks, args = s.progress, s.hooks, s.args
    schedule = Schedule(
        total_steps=s.total_steps,
        log_every_steps=args.log_every_steps,
        eval_every_steps=args.eval_every_steps,
        save_every_steps=args.save_every_steps,
        save_at_end=args.save_at_end,
    )
    while p.global_step < s.total_steps:
        s.sampler.set_epoch(p.epoch)
        # Resume mid-epoch: skip the samples this rank already consumed in this epoch.
        s.sampler.set_start(p.step_in_epoch * args.grad_accum_steps * args.batch_size)
        s.ctx.epoch = p.epoch
        hooks.fire("on_epoch_begin")
        batches = iter(s.loader)
        while p.step_in_epoch < s.steps_per_epoch and p.global_step < s.total_steps:
            micro_batches = [next(batches) for _ in range(args.grad_accum_steps)]
            agreed = train_step(s, micro_batches)
            if after_boundary(s, agreed, schedule):
                return
        if p.step_in_epoch >= s.steps_per_epoch:
            hooks.fire("on_epoch_end")
            p.epoch += 1
            p.step_in_epoch = 0
    # Reached max_steps inside an epoch: nothing more to do (the last boundary saved).


def train_step(s: WorkerState, micro_batches: list[dict[str, torch.Tensor]]) -> TrainerControl:
    """One optimizer step over `grad_accum_steps` micro-batches; returns the agreed control."""
    hooks, acc, n_micro = s.hooks, s.accelerator, len(micro_batches)
    started = time.perf_counter()
    hooks.fire("on_step_begin")
    loss_sum: Any = 0
    tokens: Any = 0
    agreement = None
    for i, batch in enumerate(micro_batches):
        batch = {k: v.to(acc.device, non_blocking=True) for k, v in batch.items()}
        last = i == n_micro - 1
        # Only the last micro-batch all-reduces gradients; the others accumulate locally.
        with contextlib.nullcontext() if last else s.parallel.no_sync():
            hooks.fire("on_before_forward", batch=batch, micro_step=i)
            with acc.autocast():
                outputs = s.model(**batch)
                loss = s.workload.loss_fn(outputs, batch)
            hooks.fire("on_after_forward", batch=batch, outputs=outputs, micro_step=i)
            hooks.fire("on_before_backward", batch=batch, outputs=outputs, micro_step=i)
            loss_sum = loss_sum + loss.detach()
            tokens = tokens + count_tokens(batch)
            if last:  # every rank starts the step's agreement here; it runs during backward
                agreement = Agreement(
                    loss_sum, tokens, hooks.take_pending(), acc.device, s.world_size
                )
            acc.backward(loss / n_micro if n_micro > 1 else loss)
            hooks.fire("on_after_backward", batch=batch, outputs=outputs, micro_step=i)

    hooks.fire("on_before_optimizer_step")
    grad_norm = _optimizer_step(s)
    hooks.fire("on_after_optimizer_step", grad_norm=grad_norm)
    s.progress.global_step += 1
    s.progress.step_in_epoch += 1
    s.ctx.global_step = s.progress.global_step
    s.ctx.elapsed_time = time.perf_counter() - started
    if "on_step_end" in hooks.active:
        s.ctx.loss = float(loss_sum) / n_micro  # this rank's loss: a CPU-GPU sync
        hooks.fire("on_step_end")
    # Step boundary: the agreement started before the last backward is done by now.
    return _record_step(s, agreement, grad_norm, n_micro, started)


def after_boundary(s: WorkerState, agreed: TrainerControl, schedule: Schedule) -> bool:
    """Act on the agreed control at the step boundary; True when training must end now."""
    step = s.progress.global_step
    decision = decide(step, agreed, schedule, s.last_saved_step)
    s.abort = decision.abort
    if decision.log and "on_log" in s.hooks.active:
        _fill_log_metrics(s)
        s.hooks.fire("on_log")
    if decision.evaluate:
        evaluate(s)
    if decision.save:
        save(s)
    if decision.stop and agreed.stops:
        s.progress.stop_reason = s.stop_reason
    return decision.stop


def _optimizer_step(s: WorkerState) -> Any:
    """Clip, step the optimizer and the scheduler, zero the gradients; the gradient norm."""
    grad_norm = None
    if s.args.max_grad_norm is not None:  # a collective under FSDP (the norm of all shards)
        grad_norm = s.parallel.clip_grad_norm(s.args.max_grad_norm)
    s.optimizer.step()
    s.scheduler.step()
    s.optimizer.zero_grad(set_to_none=True)
    return grad_norm


def _record_step(
    s: WorkerState, agreement: Agreement, grad_norm: Any, n_micro: int, started: float
) -> TrainerControl:
    """Read the agreed values into the progress and the context; return the agreed control."""
    loss_sum, tokens, agreed = agreement.result()
    p, ctx = s.progress, s.ctx
    step_time = time.perf_counter() - started
    ctx.loss = loss_sum / (n_micro * s.world_size)
    p.tokens_seen += round(tokens)
    # Every rank takes the same number of micro-batches of the same size: count, don't reduce.
    p.samples_seen += n_micro * s.args.batch_size * s.world_size
    ctx.tokens_seen, ctx.samples_seen = p.tokens_seen, p.samples_seen
    ctx.elapsed_time = step_time
    ctx.throughput = tokens / step_time if step_time > 0 else 0.0
    ctx.learning_rate = s.scheduler.get_last_lr()[0]
    ctx.grad_norm = float(grad_norm) if grad_norm is not None else None
    requested = agreement.requested
    if requested.stops:
        s.stop_reason = requested.stop_reason
    elif agreed.stops and s.stop_reason is None:
        s.stop_reason = "a callback on another rank"
    return agreed


def _fill_log_metrics(s: WorkerState) -> None:
    ctx = s.ctx
    ctx.cuda_mem_allocated = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    ctx.batch_metrics = {
        "loss": ctx.loss,
        "learning_rate": ctx.learning_rate,
        "grad_norm": ctx.grad_norm,
        "step_time": ctx.elapsed_time,
        "tokens_per_s": ctx.throughput,
        "epoch": s.progress.epoch,
    }


def count_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor | int:
    """Tokens in a batch: the attention mask's ones, else the input ids, else 0 (not text)."""
    mask = batch.get("attention_mask")
    if mask is not None:
        return mask.sum()
    ids = batch.get("input_ids")
    return ids.numel() if ids is not None else 0
