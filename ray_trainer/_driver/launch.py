"""Driver: `run_training` validates, starts Ray, launches the workers, collects the result.

Runs in the driver process: a user's script, `ray-trainer run`, or a Ray job's entrypoint.
Everything that can be checked without Ray is checked before `ray.init()`, and everything that
needs the cluster's size is checked before a worker starts (``checks/resources.py``).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

from callbacks import ALIASES, EVENTS
from ray_trainer._actor.actor import start_actor
from ray_trainer._config.args import TrainingArgs
from ray_trainer._contract import NAMESPACE, ActorSummary, RunSpec, actor_name, forwarded_events
from ray_trainer._driver.checks.address import check_cluster_address, cluster_address
from ray_trainer._driver.checks.demand import embedded_cpus, embedded_where, per_worker, run_demand
from ray_trainer._driver.checks.inputs import (
    check_enough_samples,
    check_inputs,
    check_storage,
    collect_callbacks,
    resolve_paths,
)
from ray_trainer._driver.checks.resources import (
    ResourceRequestError,
    check_evaluations,
    check_resources,
    embedded_resources,
)
from ray_trainer._driver.console import (
    dashboard_line,
    filter_ray_noise,
    joined_line,
    ray_train_settings,
    shared_cores_line,
    start_embedded_ray,
    wait_for_output,
)
from ray_trainer._driver.data import DataPlan, prepare_data
from ray_trainer._driver.lease import RunLease
from ray_trainer._driver.metrics import with_default_metrics
from ray_trainer._driver.nodes import alive_nodes, check_shared_storage
from ray_trainer._driver.reference import prepare_references
from ray_trainer._driver.result import TrainingResult, build_result
from ray_trainer._driver.retention import (
    forget_ray_checkpoint_list,
    record_run,
    remove_crashed_saves,
    retention_of,
)
from ray_trainer._driver.signals import resume_hint, run_with_graceful_signals
from ray_trainer._driver.trainer import torch_trainer_class
from ray_trainer._placement import CallbackLists, keep_for_actor, pack, subscribed_events
from ray_trainer._storage import Location, locate
from ray_trainer._worker.entry import train_loop_per_worker

logger = logging.getLogger("ray_trainer")


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
    args = resolve_paths(TrainingArgs.coerce(args, **fields))
    if args.run_name is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        args = args.model_copy(update={"run_name": f"run-{stamp}-{secrets.token_hex(2)}"})
    lists = collect_callbacks(args)
    plans = check_inputs(args)
    check_cluster_address(args.ray_address)  # RAY_ADDRESS too: its form, and an answer
    run = check_storage(args)
    # One run at a time writes the folder: a live holder refuses this start, before Ray.
    with RunLease(run, args.run_name):
        remove_crashed_saves(run)
        # The name to resume with, before anything can go wrong (again on Ctrl-C: signals.py).
        print(resume_hint(args.run_name), flush=True)
        return _launch(args, lists, run, plans)


def _launch(
    args: TrainingArgs, lists: CallbackLists, run: Location, plans: dict[str, DataPlan]
) -> TrainingResult:
    """Start (or join) Ray, check the cluster, train; shut down the Ray it started."""
    import ray

    # Ray Train's import (~1 s of CPU) runs while ray.init waits for Ray's processes to start.
    train_import = threading.Thread(target=_import_ray_train, name="import-ray-train", daemon=True)
    train_import.start()
    joined = not ray.is_initialized() and bool(args.ray_address or os.environ.get("RAY_ADDRESS"))
    started_ray = _init_ray(args, lists)
    train_import.join()
    try:
        lists = with_default_metrics(lists, args.ray_metrics, joined)
        check_resources(args)
        check_evaluations(lists)
        return _fit(args, lists, run, plans)
    finally:
        if started_ray:
            ray.shutdown()


def _import_ray_train() -> None:
    """Import what `_fit` needs of Ray Train (in a thread, beside `ray.init`). An import that
    fails here fails again, with its traceback, where `_fit` imports it."""
    with contextlib.suppress(Exception):
        import ray.train.torch  # noqa: F401


def _init_ray(args: TrainingArgs, lists: CallbackLists) -> bool:
    """Join the cluster at ray_address/RAY_ADDRESS, or start an embedded local Ray sized to
    the run: this machine's GPUs, and its cores or, where the run needs more at once, that many
    logical CPUs (``checks/demand.py``; a request it cannot fit is refused first). True if
    started."""
    import ray

    if ray.is_initialized():
        return False
    joining = cluster_address(args.ray_address)  # checked by run_training: it answered
    if joining:
        address, _ = joining
        ray.init(address=address, log_to_driver=True)
        filter_ray_noise()
        print(joined_line(address), flush=True)
        return False
    demand = run_demand(args, lists)
    machine = embedded_resources(count_gpus=demand.asks("GPU"))
    cpus = embedded_cpus(demand, machine["CPU"])
    # Before starting anything: GPUs as the machine has them, CPUs as the embedded Ray offers.
    check_resources(args, nodes=[{**machine, "CPU": cpus}], where=embedded_where(machine["CPU"]))
    url = start_embedded_ray(cpus, args.dashboard)
    print(dashboard_line(url), flush=True)
    shared = shared_cores_line(cpus, machine["CPU"], demand.counts())
    if shared:
        print(shared, flush=True)
    return True


@dataclass
class Launch:
    """What a run hands its workers (`spec`), and its callback actor."""

    spec: RunSpec
    actor: Any
    actor_ready: Any


def prepare_launch(
    args: TrainingArgs,
    lists: CallbackLists,
    run: Location,
    plans: dict[str, DataPlan] | None = None,
) -> Launch:
    """Encode the data (where its cache is missing), record the run, put the callbacks in the
    object store, start the callback actor. Ray is initialised; no worker exists yet."""
    import ray

    plans = plans or {}
    caches = prepare_data(plans, args)
    check_enough_samples(args, plans)
    references = prepare_references(plans, args)

    run_id = record_run(run, args)
    packed = pack(lists)
    callbacks_ref = ray.put(packed)
    actor, ready = start_actor(
        packed,
        args.run_name,
        run.name,  # the actor and the workers locate it (with storage_filesystem) themselves
        max_queue=args.actor_queue_size,
        end_timeout_s=args.callback_timeout_s,
        eval_timeout_s=args.eval_timeout_s,
        filesystem=args.storage_filesystem,
        retention=retention_of(args, run_id),
        max_workers=args.max_workers if args.elastic else None,
    )
    # The args travel as a plain pydantic object; the callbacks only through `callbacks_ref`.
    worker_args = args.model_copy(
        update={"callbacks": [], **{e: None for e in EVENTS | set(ALIASES)}}
    )
    spec = RunSpec(
        args=worker_args,
        callbacks_ref=callbacks_ref,
        run_dir=run.name,
        launch_id=f"{run_id}.{secrets.token_hex(4)}",  # save ids start with the run's id
        actor_name=actor_name(args.run_name),
        actor_namespace=NAMESPACE,
        forward_events=forwarded_events(
            subscribed_events(lists, keep_for_actor),
            ranking=args.checkpoint_score_attribute is not None,
        ),
        data_caches=caches,
        chat_template=next((p.settings.chat_template for p in plans.values()), None),
        references=references,
        # Prompt-only records (GRPO): encoded by the driver, put in the object store once.
        prompts={f: ray.put(p.prompts) for f, p in plans.items() if p.prompts is not None},
    )
    return Launch(spec=spec, actor=actor, actor_ready=ready)


def _fit(
    args: TrainingArgs, lists: CallbackLists, run: Location, plans: dict[str, DataPlan]
) -> TrainingResult:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

    # What every node must see, checked before anything of the run is written.
    nodes = alive_nodes()
    check_shared_storage(args, nodes)
    launch = prepare_launch(args, lists, run, plans)
    forget_ray_checkpoint_list(run)
    import ray

    trainer = torch_trainer_class()(
        train_loop_per_worker,
        # The spec by reference: Ray Train hands train_loop_config to its controller too, which
        # would unpickle the spec's model class, callbacks and data there (importing torch, the
        # user's modules, transformers: 2-3 CPU-seconds of every run's start); the workers get it.
        train_loop_config={"spec": ray.put(launch.spec)},
        scaling_config=ScalingConfig(
            num_workers=args.num_workers,
            use_gpu=args.use_gpu,
            resources_per_worker=per_worker(args),
            placement_strategy=args.placement_strategy,
            elastic_resize_monitor_interval_s=args.elastic_resize_interval_s,
        ),
        run_config=RunConfig(
            name=args.run_name,
            storage_path=locate(args.storage_path, args.storage_filesystem).name,
            storage_filesystem=args.storage_filesystem,
            # Ray Train retries a worker group that cannot start forever by default: bound it.
            failure_config=FailureConfig(
                max_failures=args.failures_allowed,
                controller_failure_limit=args.start_retries_allowed,
            ),
            # No num_to_keep: the callback actor ranks and deletes (_driver/retention.py).
            checkpoint_config=CheckpointConfig(),
        ),
    )
    if args.elastic:  # the actor's evaluation reservation comes before the workers' request
        wait_for_actor(launch, args)
    # Read by Ray Train's controller (RAY_TRAIN_* variables travel from the driver to it).
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(args.worker_start_timeout_s)
    with ray_train_settings():  # read by Ray Train's fit, in this process
        error = run_with_graceful_signals(trainer.fit, launch.actor, args.run_name)
    summary = finish_actor(launch, args, error)
    if error is not None:
        capacity = ""
        try:
            check_resources(args)
        except ResourceRequestError as lost:  # e.g. a node was lost during the run
            capacity = f" The cluster can no longer place the workers: {lost}"
        raise RunFailedError(
            f"run {args.run_name!r} failed after {summary.attempts} attempt(s) "
            f"(max_failures={args.failures_allowed}): {root_message(error)}.{capacity} "
            f"Latest checkpoint: {summary.last_checkpoint}"
        ) from error
    return build_result(args.run_name, run.name, summary)


def wait_for_actor(launch: Launch, args: TrainingArgs) -> None:
    """Until the callback actor is up (an elastic run's workers are asked for after it), at
    most `callback_timeout_s`; else the actor is removed and the run fails saying why."""
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        ray.get(launch.actor_ready, timeout=args.callback_timeout_s)
    except GetTimeoutError:
        ray.kill(launch.actor, no_restart=True)
        raise RunFailedError(
            f"run {args.run_name!r}: its callback actor did not start within "
            f"callback_timeout_s={args.callback_timeout_s:g} s (a loaded or full head node: "
            f"`ray status` shows its free CPUs and pending tasks); nothing was trained. Raise "
            f"callback_timeout_s, or free the head node, and start the run again."
        ) from None


def finish_actor(launch: Launch, args: TrainingArgs, error: BaseException | None) -> ActorSummary:
    """Make sure the actor ran `on_train_end` (rank 0 may have died), take its summary (the
    run's result), and remove it. Bounded by the callback and evaluation timeouts."""
    import ray

    actor = launch.actor
    timeout = args.callback_timeout_s * 2 + args.eval_timeout_s
    lost = ActorSummary(worker=None, attempts=0, last_step=0, last_checkpoint=None)
    try:
        ray.get(launch.actor_ready, timeout=args.callback_timeout_s)
    except Exception as e:  # its constructor failed: report it, the training result stands
        ray.kill(actor, no_restart=True)
        failure = {"callback": "<callback actor>", "event": "start", "step": None, "error": str(e)}
        lost.callback_errors = [failure]
        return lost
    try:
        asked = time.monotonic()
        ended = ray.get(actor.end.remote(root_message(error) if error else None), timeout=timeout)
        if ended["printed"]:  # e.g. ProgressBar's summary line: let Ray forward it first
            wait_for_output(ended["pid"], since=asked)
        return ray.get(actor.summary.remote(), timeout=args.callback_timeout_s)
    except Exception as e:  # the actor is gone for good: nothing comes back
        logger.warning("callback actor did not finish cleanly: %s", e)
        return lost
    finally:
        ray.kill(actor, no_restart=True)


def root_message(e: BaseException) -> str:
    """The last line of an error's message (Ray wraps the worker's error in several lines)."""
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__
