"""Driver: checks of a run before anything starts (callbacks, inputs, storage, resources).

Runs in the driver. Everything that can be checked without Ray is checked before ``ray.init()``
(`collect_callbacks`, `check_inputs`, `check_storage`); what needs the cluster's size before a
worker starts (`check_resources`).
"""

from __future__ import annotations

import json
import os
from typing import Any

from callbacks import ALIASES, EVENTS, global_callbacks, validate_picklable
from ray_trainer._checkpoint import CheckpointError, verify
from ray_trainer._config import TrainingArgs, TrainingArgsError, is_builtin
from ray_trainer._placement import CallbackLists, build_manager

RUN_RECORD = "run.json"


class ResourceRequestError(RuntimeError):
    """The cluster can never fit the requested workers; raised instead of waiting forever."""


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


def check_inputs(args: TrainingArgs) -> None:
    """Data files and model names, checked in the driver so that no worker starts for nothing."""
    for field_name in ("data", "val_data"):
        value = getattr(args, field_name)
        if isinstance(value, str):
            from ray_trainer._data import validate_jsonl

            validate_jsonl(value, text_field=args.text_field)
    if isinstance(args.model, str) and not is_builtin(args.model):
        from ray_trainer._hf import check_model_ref

        check_model_ref(args.model)


def check_storage(args: TrainingArgs) -> str:
    """The run folder ``<storage_path>/<run_name>``, after checking that storage is writable,
    that the folder holds no other run, and that ``resume_from`` is a complete checkpoint."""
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
    record = read_run_record(run_dir)
    if record is not None and record.get("fingerprint") != fingerprint(args):
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


def fingerprint(args: TrainingArgs) -> str:
    """What a run trains, in one line: a later run under the same name must match it."""

    def name(v: Any) -> str:
        if v is None or isinstance(v, str):
            return str(v)
        return getattr(v, "__qualname__", type(v).__qualname__)

    return f"model={name(args.model)};data={name(args.data)};demo={sorted(args.demo.items())}"


def read_run_record(run_dir: str) -> dict[str, Any] | None:
    """``run.json`` of a run folder (what the run trains), or None when there is none."""
    try:
        with open(os.path.join(run_dir, RUN_RECORD)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def write_run_record(run_dir: str, record: dict[str, Any]) -> None:
    """Write ``run.json`` whole (to a temporary name, then renamed)."""
    path = os.path.join(run_dir, RUN_RECORD)
    os.makedirs(run_dir, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def per_worker(args: TrainingArgs) -> dict[str, float]:
    """The Ray resources of one training worker."""
    res = dict(args.resources_per_worker) if args.resources_per_worker else {"CPU": 1.0}
    if args.use_gpu:
        res.setdefault("GPU", 1.0)
    return res


def check_resources(args: TrainingArgs) -> None:
    """Fail fast when the cluster can never place `num_workers` workers of the requested size."""
    import ray

    if os.environ.get("RAY_TRAINER_SKIP_RESOURCE_CHECK") == "1":  # autoscaling clusters
        return
    need = per_worker(args)
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    fits = 0
    for res in nodes:
        fits += int(min(res.get(k, 0.0) / v for k, v in need.items() if v > 0))
    if fits >= args.num_workers:
        return
    total = ray.cluster_resources()
    have = ", ".join(f"{k}={total.get(k, 0):g}" for k in need)
    raise ResourceRequestError(
        f"num_workers={args.num_workers} x resources_per_worker={need} cannot be placed: "
        f"the cluster has {have} over {len(nodes)} node(s), room for {fits} such worker(s). "
        "Lower num_workers or resources_per_worker, set use_gpu=False, or add nodes."
    )
