"""Training worker: the training loop, run by Ray Train in every worker process.

One optimizer step, top to bottom (`train_step`)::

    on_step_begin
      per micro-batch: on_before_forward, forward, on_after_forward,
                       on_before_backward, backward, on_after_backward
                       (before the LAST backward: start the step's ONE all-reduce of
                        [loss, targets, tokens, positions, stop, save, evaluate, log, abort])
    scale the gradients by the step's global target count, clip
    on_before_optimizer_step, optimizer.step(), on_after_optimizer_step
    on_step_end                      (its `loss` is this rank's loss for the step)

The loss of a step is the mean over every target token of all micro-batches of all ranks
(``workload.py`` says how): each micro-batch backpropagates its token-loss sum over a constant,
and the gradients are rescaled once the all-reduce has summed the targets of every rank.
    -- step boundary (`after_boundary`): act on the PREVIOUS step's agreed control --
    on_log / evaluation + on_evaluate / checkpoint + on_save, as `boundary.decide`s; stop

The agreement is read one step late: reading a step's own all-reduce at its boundary would stall
the CPU behind the GPU every step. So requests made up to `on_before_backward` of step k's last
micro-batch (and any pending from earlier) ride in step k's all-reduce and take effect at the
boundary of step k+1; requests made later in step k (`on_after_backward`, the optimizer-step
events, `on_step_end`, and `on_log`, `on_evaluate`, `on_save` after the boundary) ride in step
k+1's and take effect at boundary k+2. At the last step both take effect at once. Callback-actor
requests join when their reply has arrived. The step's own loss and token count are read at its
boundary only where they are needed: log, evaluation, save and stop boundaries (a sync there).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from callbacks import TrainerControl
from ray_trainer._contract import RunSpec
from ray_trainer._worker.assemble import setup
from ray_trainer._worker.boundary import Schedule, decide
from ray_trainer._worker.checkpoints.resume import maybe_resume
from ray_trainer._worker.checkpoints.saving import save
from ray_trainer._worker.state import WorkerState
from ray_trainer._worker.step.agreement import Agreement, agree
from ray_trainer._worker.step.micro_batches import MicroBatch
from ray_trainer._worker.step.validation import evaluate
from ray_trainer._worker.summary import gather_summary


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
        s.workload.objective.end(s)
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
        s.ctx.epoch = p.epoch
        hooks.fire("on_epoch_begin")
        # Resume mid-epoch: the loader starts at the first step this epoch has not taken.
        # The objective's steps (GRPO: each step's prompts become sampled completions).
        steps = s.workload.objective.steps(s, s.loader.steps(p.epoch, p.step_in_epoch))
        for micro_batches in steps:
            agreement = train_step(s, micro_batches)
            if after_boundary(s, agreement, schedule):
                return
            if p.global_step >= s.total_steps:
                break
        if p.step_in_epoch >= s.steps_per_epoch:
            hooks.fire("on_epoch_end")
            p.epoch += 1
            p.step_in_epoch = 0
    # Reached max_steps inside an epoch: nothing more to do (the last boundary saved).


def train_step(s: WorkerState, micro_batches: list[MicroBatch]) -> Agreement:
    """One optimizer step over this rank's micro-batches of the step; returns its agreement."""
    hooks, acc, wl, n_micro = s.hooks, s.accelerator, s.workload, len(micro_batches)
    started = time.perf_counter()
    autocast, backward = amp_tools(acc)
    hooks.fire("on_step_begin")
    loss_sum: Any = 0  # sum over micro-batches of token-loss sum / norm (a device tensor)
    targets = tokens = positions = 0  # counted on the host by the loader: no sync
    agreement = None
    for i, micro in enumerate(micro_batches):
        batch = {k: v.to(acc.device, non_blocking=True) for k, v in micro.batch.items()}
        last = i == n_micro - 1
        # Only the last micro-batch all-reduces gradients; the others accumulate locally.
        with contextlib.nullcontext() if last else s.parallel.no_sync():
            hooks.fire("on_before_forward", batch=batch, micro_step=i)
            with autocast():
                if s.offload is None:
                    outputs, loss = wl.forward(s.model, batch, micro.targets)
                else:  # offload_activations: what forward saves goes to the host
                    with s.offload:
                        outputs, loss = wl.forward(s.model, batch, micro.targets)
            hooks.fire("on_after_forward", batch=batch, outputs=outputs, micro_step=i)
            hooks.fire("on_before_backward", batch=batch, outputs=outputs, micro_step=i)
            loss_sum = loss_sum + loss.detach()
            targets, tokens = targets + micro.targets, tokens + micro.tokens
            positions += micro.positions
            if last:  # every rank starts the step's agreement here; it runs during backward
                agreement = agree(
                    loss_sum, [targets, tokens, positions], hooks.take_pending(), acc.device,
                    s.world_size, s.copy_stream, *_own_numbers(s),
                )  # fmt: skip
            backward(loss)
            hooks.fire("on_after_backward", batch=batch, outputs=outputs, micro_step=i)

    # The mean over the global batch's targets: a collective under FSDP (the norm of all shards).
    s.grad_norm = s.parallel.scale_and_clip(agreement.scale(wl.norm), s.args.max_grad_norm)
    hooks.fire("on_before_optimizer_step", grad_norm=s.grad_norm)
    _optimizer_step(s)
    hooks.fire("on_after_optimizer_step", grad_norm=s.grad_norm)
    _count_step(s, time.perf_counter() - started)
    if "on_step_end" in hooks.active:
        s.ctx.loss = float(loss_sum) * wl.norm / max(targets, 1)  # this rank's: a CPU-GPU sync
        hooks.fire("on_step_end")
    return agreement


def amp_tools(acc: Any) -> tuple[Any, Any]:
    """The step's autocast context and backward: accelerate's under mixed precision (fp16: its
    scaler), else a null context and torch's own backward. accelerate's autocast builds its
    state on every call and its backward divides the loss by its accumulation steps (1: the loop
    accumulates itself), a cost a host-bound step sees (``bench/runner/bench_host_step.py``)."""
    autocast = acc.autocast if acc.native_amp else contextlib.nullcontext
    return autocast, (acc.backward if acc.scaler is not None else _backward)


def _backward(loss: torch.Tensor) -> None:
    loss.backward()


def _own_numbers(s: WorkerState) -> tuple[tuple[float, ...], Any]:
    """What the step's agreement carries of the loop's own: which asynchronous save each rank
    has written, and the objective's metric sums (DPO's, a device tensor; else None)."""
    return s.saves.numbers() if s.saves is not None else (), s.workload.objective.take_sums()


def after_boundary(s: WorkerState, agreement: Agreement, schedule: Schedule) -> bool:
    """Act at the step boundary on the previous step's agreed control (and, at the last step,
    on this one's too); True when training must end now."""
    step = s.progress.global_step
    previous, s.pending = s.pending, agreement
    agreed = TrainerControl()
    if previous is not None:
        agreed.merge(_read(s, previous, apply=True))
    if step >= schedule.total_steps:  # nothing follows: this step's requests act now
        agreed.merge(_read(s, agreement, apply=True))
    decision = decide(step, agreed, schedule, s.last_saved_step)
    s.abort = decision.abort
    if decision.log or decision.evaluate or decision.save or decision.stop:
        _read(s, agreement, apply=False)  # this step's loss and tokens: the one sync, here
    if decision.log and "on_log" in s.hooks.active:
        _fill_log_metrics(s)
        s.hooks.fire("on_log")
    if decision.evaluate:
        evaluate(s)
    if s.saves is not None:  # an asynchronous save written by every rank: published now
        s.saves.settle(s, previous, decision)
    if decision.save:
        save(s, final=decision.stop)
    if decision.stop and agreed.stops:
        s.progress.stop_reason = s.stop_reason
    return decision.stop


def _optimizer_step(s: WorkerState) -> None:
    """Step the optimizer and the scheduler, zero the gradients.

    Under accelerate's wrapper (DDP) without an fp16 scaler, torch's optimizer itself after the
    first step: the wrapper's `step` searches sys.path for the LOMO package twice per call
    (about 0.5 ms of host time per step on a worker's path) and its `zero_grad` inspects a
    signature, and they do nothing else here (the loop accumulates gradients itself; no XLA).
    The first step goes through the wrapper: the scheduler checks then that it was called."""
    optimizer = s.optimizer
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and getattr(optimizer, "scaler", None) is None and s.progress.global_step:
        optimizer = inner
    optimizer.step()
    s.scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def _count_step(s: WorkerState, seconds: float) -> None:
    """Count the step locally (every step takes batch_size x grad_accum_steps x world samples
    of the epoch, packed or not: samples are counted, not reduced)."""
    p, ctx = s.progress, s.ctx
    p.global_step += 1
    p.step_in_epoch += 1
    samples = s.loader.per_step
    p.samples_seen += samples
    ctx.global_step, ctx.samples_seen, ctx.elapsed_time = p.global_step, p.samples_seen, seconds
    s.window.add_step(seconds, samples)


def _read(s: WorkerState, agreement: Agreement, apply: bool) -> TrainerControl:
    """Take a step's agreed numbers into the progress, once; return its agreed control, and
    with `apply` note who asked to stop (the control is acted on now)."""
    agreed = agreement.result()
    if not agreement.recorded:
        agreement.recorded = True
        s.progress.tokens_seen += round(agreed.tokens)
        s.ctx.tokens_seen = s.progress.tokens_seen
        # The mean over every target token of the step (all micro-batches of all ranks).
        s.ctx.loss = agreed.loss_sum * s.workload.norm / max(agreed.targets, 1)
        s.window.add_agreed(agreed.tokens, agreed.positions)
        if agreed.sums:  # the objective's metrics (DPO's: means over the step's pairs)
            s.objective_metrics = s.workload.objective.metrics_from_sums(
                agreed.sums, agreed.targets
            )
    if apply:
        requested = agreement.requested
        if requested.stops:
            s.stop_reason = requested.stop_reason
        elif agreed.control.stops and s.stop_reason is None:
            s.stop_reason = "a callback on another rank"
    return agreed.control


def _fill_log_metrics(s: WorkerState) -> None:
    """The log's numbers: loss, learning rate, gradient norm, and the window's throughput,
    padding share and MFU (tokens that are not padding, over the steps since the last log)."""
    ctx = s.ctx
    ctx.cuda_mem_allocated = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    ctx.learning_rate = s.scheduler.get_last_lr()[0]
    ctx.grad_norm = float(s.grad_norm) if s.grad_norm is not None else None  # a sync: logs only
    window = s.window.close(s.model_shape, s.peak_flops, s.world_size)
    ctx.throughput = window.get("tokens_per_s")
    ctx.batch_metrics = {
        "loss": ctx.loss,
        "learning_rate": ctx.learning_rate,
        "grad_norm": ctx.grad_norm,
        "step_time": ctx.elapsed_time,
        "epoch": s.progress.epoch,
        **window,
        **s.objective_metrics,
    }
