"""`run_training`: validate, start (or join) Ray, launch the workers, collect the result.

Runs in the driver process: a user's script, `ray-trainer run`, or a Ray job's entrypoint.
Everything that can be checked without Ray is checked before `ray.init()`, and everything that
needs the cluster's size is checked before a worker starts.
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets
from dataclasses import dataclass
from typing import Any

from callbacks import (
    ALIASES,
    EVENTS,
    global_callbacks,
    validate_picklable,
)
from ray_trainer._actor import NAMESPACE, actor_name, start_actor
from ray_trainer._checkpoint import CheckpointError, latest_checkpoint, verify
from ray_trainer._config import TrainingArgs, TrainingArgsError, is_builtin
from ray_trainer._placement import (
    CallbackLists,
    build_manager,
    keep_for_actor,
    pack,
    subscribed_events,
)
from ray_trainer._result import TrainingResult
from ray_trainer._run_files import RunFiles

logger = logging.getLogger("ray_trainer")


class ResourceRequestError(RuntimeError):
    """The cluster can never fit the requested workers; raised instead of waiting forever."""


class RunFailedError(RuntimeError):
    """Training failed and could not be recovered (see `__cause__` and the message)."""


def run_training(args: TrainingArgs | dict | None = None, **fields: Any) -> TrainingResult:
    """Train on Ray: validate, launch `num_workers` Ray Train workers, and wait for the result.

    Runs in the driver. Accepts a `TrainingArgs`, a dict, or the fields themselves. Uses the Ray
    cluster at ``ray_address`` / ``RAY_ADDRESS`` if set, else starts an embedded local Ray (and
    shuts it down at the end).

    Example:
        >>> result = run_training(max_steps=100, num_workers=2, on_save=lambda ctx: print(ctx))
        >>> result.global_step
        100
    """
    args = TrainingArgs.coerce(args, **fields)
    if args.run_name is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        args = args.model_copy(update={"run_name": f"run-{stamp}-{secrets.token_hex(2)}"})
    lists = collect_callbacks(args)
    _check_inputs(args)
    run_dir = _check_storage(args)

    import ray

    started_ray = _init_ray(args)
    try:
        check_resources(args)
        return _fit(args, lists, run_dir)
    finally:
        if started_ray:
            ray.shutdown()


# ---- validation (no Ray) -----------------------------------------------------------------


def collect_callbacks(args: TrainingArgs) -> CallbackLists:
    """The run's callbacks in contract order, validated (types, events, picklability)."""
    user: list[Any] = list(args.callbacks)
    for name in sorted(EVENTS | set(ALIASES)):
        for fn in getattr(args, name) or []:
            user.append((name, fn))
    lists: CallbackLists = {"core": [], "user": user, "global": global_callbacks()}
    try:
        build_manager(lists, keep=lambda _: True)  # TypeError/ValueError for bad entries
    except (TypeError, ValueError) as e:
        raise TrainingArgsError(f"callbacks: {e}") from None
    objects = lists["core"] + [u[1] if isinstance(u, tuple) else u for u in user] + lists["global"]
    validate_picklable(objects)
    return lists


def _check_storage(args: TrainingArgs) -> str:
    storage = os.path.abspath(os.path.expanduser(args.storage_path))
    run_dir = os.path.join(storage, args.run_name)
    try:
        os.makedirs(storage, exist_ok=True)
        probe = os.path.join(storage, f".write_probe_{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise TrainingArgsError(
            f"storage_path {args.storage_path!r} is not writable ({e.strerror or e}); choose a "
            "folder you can write to (on a multi-node cluster, one every node shares)"
        ) from None
    record = RunFiles(run_dir).read_run_record()
    if record is not None and record.get("fingerprint") != _fingerprint(args):
        raise TrainingArgsError(
            f"run_name {args.run_name!r}: {run_dir} already holds a different run "
            f"({record.get('fingerprint')}); pick a new run_name, or delete that folder"
        )
    if args.resume_from is not None:
        try:
            verify(args.resume_from)
        except CheckpointError as e:
            raise TrainingArgsError(f"resume_from: {e}") from None
    return run_dir


def _check_inputs(args: TrainingArgs) -> None:
    """Data files and model names, checked in the driver so that no worker starts for nothing."""
    for field_name in ("data", "val_data"):
        value = getattr(args, field_name)
        if isinstance(value, str):
            from ray_trainer._data import validate_jsonl

            validate_jsonl(value, text_field=args.text_field)
    if isinstance(args.model, str) and not is_builtin(args.model):
        from ray_trainer._hf import check_model_ref

        check_model_ref(args.model)


def _fingerprint(args: TrainingArgs) -> str:
    def name(v: Any) -> str:
        if v is None or isinstance(v, str):
            return str(v)
        return getattr(v, "__qualname__", type(v).__qualname__)

    return f"model={name(args.model)};data={name(args.data)};demo={sorted(args.demo.items())}"


# ---- Ray ---------------------------------------------------------------------------------


def _init_ray(args: TrainingArgs) -> bool:
    """Join the cluster at ray_address/RAY_ADDRESS, or start an embedded local Ray. True if started."""
    import ray

    if ray.is_initialized():
        return False
    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return False
    ray.init(num_cpus=max(os.cpu_count() or 1, args.num_workers), include_dashboard=False)
    return True


def _per_worker(args: TrainingArgs) -> dict[str, float]:
    res = dict(args.resources_per_worker) if args.resources_per_worker else {"CPU": 1.0}
    if args.use_gpu:
        res.setdefault("GPU", 1.0)
    return res


def check_resources(args: TrainingArgs) -> None:
    """Fail fast when the cluster can never place `num_workers` workers of the requested size."""
    import ray

    if os.environ.get("RAY_TRAINER_SKIP_RESOURCE_CHECK") == "1":  # autoscaling clusters
        return
    per_worker = _per_worker(args)
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    fits = 0
    for res in nodes:
        fits += int(min(res.get(k, 0.0) / v for k, v in per_worker.items() if v > 0))
    if fits >= args.num_workers:
        return
    total = ray.cluster_resources()
    have = ", ".join(f"{k}={total.get(k, 0):g}" for k in per_worker)
    raise ResourceRequestError(
        f"num_workers={args.num_workers} x resources_per_worker={per_worker} cannot be placed: "
        f"the cluster has {have} over {len(nodes)} node(s), room for {fits} such worker(s). "
        "Lower num_workers or resources_per_worker, set use_gpu=False, or add nodes."
    )


@dataclass
class Launch:
    """What a run hands its workers (`spec`), and its callback actor if it has one."""

    spec: Any  # ray_trainer._loop.RunSpec
    files: RunFiles
    actor: Any = None
    actor_ready: Any = None


def prepare_launch(args: TrainingArgs, lists: CallbackLists, run_dir: str) -> Launch:
    """Record the run, put the callbacks in the object store, start the callback actor if some
    callback runs there. Ray is initialised; no worker exists yet."""
    import ray

    from ray_trainer._loop import RunSpec

    launch_id = secrets.token_hex(4)
    files = RunFiles(run_dir, launch_id)
    files.write_run_record({"fingerprint": _fingerprint(args), "run_name": args.run_name})
    callbacks_ref = ray.put(pack(lists))
    # The args travel as a plain pydantic object; the callbacks only through `callbacks_ref`.
    worker_args = args.model_copy(
        update={"callbacks": [], **{e: None for e in EVENTS | set(ALIASES)}}
    )
    spec = RunSpec(
        args=worker_args, callbacks_ref=callbacks_ref, run_dir=run_dir, launch_id=launch_id
    )
    launch = Launch(spec=spec, files=files)
    actor_events = subscribed_events(lists, keep_for_actor)
    if actor_events:
        launch.actor, launch.actor_ready = start_actor(
            callbacks_ref,
            args.run_name,
            run_dir,
            max_queue=args.actor_queue_size,
            end_timeout_s=args.callback_timeout_s,
            eval_timeout_s=args.eval_timeout_s,
        )
        spec.actor_name, spec.actor_namespace = actor_name(args.run_name), NAMESPACE
        # on_save also feeds the actor's state writer; on_train_end ends the actor's run.
        spec.forward_events = actor_events | {"on_save", "on_train_end"}
    return launch


def _fit(args: TrainingArgs, lists: CallbackLists, run_dir: str) -> TrainingResult:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_trainer._loop import train_loop_per_worker

    launch = prepare_launch(args, lists, run_dir)
    spec, files, actor, actor_ready = launch.spec, launch.files, launch.actor, launch.actor_ready
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"spec": spec},
        scaling_config=ScalingConfig(
            num_workers=args.num_workers,
            use_gpu=args.use_gpu,
            resources_per_worker=_per_worker(args),
            placement_strategy=args.placement_strategy,
        ),
        run_config=RunConfig(
            name=args.run_name,
            storage_path=os.path.dirname(run_dir),
            # Ray Train retries a worker group that cannot start forever by default: bound it.
            failure_config=FailureConfig(
                max_failures=args.max_failures, controller_failure_limit=args.max_start_retries
            ),
            checkpoint_config=CheckpointConfig(num_to_keep=args.num_checkpoints_to_keep),
        ),
    )
    error: BaseException | None = None
    # Read by Ray Train's controller (RAY_TRAIN_* variables travel from the driver to it).
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(args.worker_start_timeout_s)
    try:
        trainer.fit()
    except Exception as e:  # ray.train.TrainingFailedError and friends
        error = e
    actor_summary = _finish_actor(actor, actor_ready, args, error)
    if error is not None:
        capacity = ""
        try:
            check_resources(args)
        except ResourceRequestError as lost:  # e.g. a node was lost during the run
            capacity = f" The cluster can no longer place the workers: {lost}"
        raise RunFailedError(
            f"run {args.run_name!r} failed after {files.attempts()} attempt(s) "
            f"(max_failures={args.max_failures}): {_root_message(error)}.{capacity} "
            f"Latest checkpoint: {latest_checkpoint(run_dir)}"
        ) from error
    summary = files.read_summary() or {}
    undelivered = summary.get("undelivered_events", 0)
    return TrainingResult(
        global_step=summary.get("global_step", 0),
        metrics={
            k: summary[k]
            for k in ("loss", "samples_seen", "tokens_seen", "epoch")
            if summary.get(k) is not None
        }
        | dict(summary.get("val_metrics") or {}),
        checkpoint_path=summary.get("checkpoint_path") or latest_checkpoint(run_dir),
        evaluations=actor_summary.get("evaluations", []),
        stopped_early=bool(summary.get("stopped_early")),
        stop_reason=summary.get("stop_reason"),
        callback_errors=list(summary.get("callback_errors") or [])
        + actor_summary.get("callback_errors", []),
        events=actor_summary.get("events", {}),
        attempts=files.attempts(),
        run_name=args.run_name,
        run_dir=run_dir,
        undelivered_events=undelivered,
    )


def _finish_actor(
    actor: Any, ready: Any, args: TrainingArgs, error: BaseException | None
) -> dict[str, Any]:
    """Make sure the actor ran `on_train_end` (rank 0 may have died), collect its summary, and
    remove it. Bounded by the callback and evaluation timeouts."""
    if actor is None:
        return {}
    import ray

    timeout = args.callback_timeout_s * 2 + args.eval_timeout_s
    try:
        ray.get(ready, timeout=args.callback_timeout_s)
    except Exception as e:  # its constructor failed: report it, the training result stands
        ray.kill(actor, no_restart=True)
        failure = {"callback": "<callback actor>", "event": "start", "step": None, "error": str(e)}
        return {"callback_errors": [failure]}
    try:
        ray.get(actor.end.remote(_root_message(error) if error else None), timeout=timeout)
        return ray.get(actor.summary.remote(), timeout=args.callback_timeout_s)
    except Exception as e:  # the actor is gone for good: the run's result still stands
        logger.warning("callback actor did not finish cleanly: %s", e)
        return {}
    finally:
        ray.kill(actor, no_restart=True)


def _root_message(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__
