"""Driver: checks of a run's input before anything starts (callbacks, args, data, storage).

Runs in the driver, before ``ray.init()``: everything that can be checked without the cluster
(`collect_callbacks`, `check_inputs`, `check_storage`, and `check_enough_samples` once the data
is encoded). What needs the cluster's size is in ``resources.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Iterator
from typing import Any

from callbacks import ALIASES, EVENTS, global_callbacks
from callbacks._serialize import CallbackPicklingError, unpicklable_state, validate_picklable
from callbacks._state import is_stateful
from ray_trainer._checkpoint import (
    STATE_FILE,
    check_complete,
    complete_checkpoints,
    latest_checkpoint,
    verify,
)
from ray_trainer._checkpoint.names import checkpoint_names
from ray_trainer._checkpoint.safe import UnsafeStateError, check_state, plain
from ray_trainer._config.args import TrainingArgs
from ray_trainer._data.sources import DataFileError
from ray_trainer._driver.checks.model import check_model_inputs
from ray_trainer._driver.run_fingerprint import same_run
from ray_trainer._errors import CheckpointError, TrainingArgsError
from ray_trainer._model.spec import ModelLoadError, is_builtin
from ray_trainer._objectives import resume_error
from ray_trainer._placement import CallbackLists, build_manager
from ray_trainer._storage import Location, is_uri, locate

RUN_RECORD = "run.json"


def resolve_paths(args: TrainingArgs) -> TrainingArgs:
    """The args with every local path made absolute, once, in the driver.

    Workers and the callback actor run in other folders (Ray's session directories), so a
    relative ``data``, ``val_data``, ``model``, ``tokenizer``, ``resume_from`` or
    ``storage_path`` means what it means here, where the user typed it. URIs (``s3://...``) and
    Hugging Face names that are not local folders stay as they are.
    """
    update: dict[str, Any] = {}
    local_fields = ["data", "val_data", "resume_from"]
    if args.storage_filesystem is None:  # else storage_path is a path on that filesystem
        local_fields.append("storage_path")
    for name in local_fields:
        value = getattr(args, name)
        if isinstance(value, str) and not is_uri(value):
            update[name] = os.path.abspath(os.path.expanduser(value))
    for name in ("model", "tokenizer"):
        value = getattr(args, name)
        if isinstance(value, str) and not is_builtin(value) and _is_local_path(value):
            update[name] = os.path.abspath(os.path.expanduser(value))
    return args.model_copy(update=update) if update else args


def _is_local_path(value: str) -> bool:
    return value.startswith(("/", "./", "../", "~")) or os.path.exists(os.path.expanduser(value))


def collect_callbacks(args: TrainingArgs) -> CallbackLists:
    """The run's callbacks in contract order, validated (types, events, picklability, and the
    picklability of what `state_dict()` returns, where it can be called before the run)."""
    user: list[Any] = list(args.callbacks)
    labels = [f"callbacks[{i}]" for i in range(len(user))]
    for name in sorted(EVENTS | set(ALIASES)):
        fns = getattr(args, name) or []
        for i, fn in enumerate(fns):
            user.append((name, fn))
            labels.append(name if len(fns) == 1 else f"{name}[{i}]")
    lists: CallbackLists = {"core": [], "user": user, "global": global_callbacks()}
    try:
        build_manager(lists, keep=lambda _: True)  # TypeError/ValueError for bad entries
    except (TypeError, ValueError) as e:
        raise TrainingArgsError(f"callbacks: {e}") from None
    objects = [u[1] if isinstance(u, tuple) else u for u in user] + lists["global"]
    labels += [f"global callback {i}" for i in range(len(lists["global"]))]
    validate_picklable(objects, labels)
    for obj in objects:
        if is_stateful(obj):
            _check_state(obj)
    return lists


def _check_state(callback: Any) -> None:
    """Refuse a callback whose `state_dict()` already returns what a checkpoint cannot hold:
    what cannot be pickled, or anything but plain data (tensors, numbers, strings, bools, None,
    lists, dicts with str keys: a checkpoint is read weights-only), naming the callback and the
    key. One that cannot be called before the run is skipped (the first save refuses it)."""
    try:
        state = callback.state_dict()
    except Exception:  # e.g. it needs on_train_begin first: checked at each save instead
        return
    key = getattr(callback, "state_key", None) or type(callback).__qualname__
    unpicklable_state(key, state)
    try:
        check_state(key, plain(state))
    except UnsafeStateError as e:
        raise CallbackPicklingError(str(e)) from None


def check_inputs(args: TrainingArgs) -> dict[str, Any]:
    """Data, data size and model names, checked in the driver so that no worker starts for
    nothing; returns the data plans (``_driver/data.py``) of the sources ray-trainer encodes."""
    from ray_trainer._driver.data import plan_data

    if isinstance(args.model, str) and not is_builtin(args.model):
        from ray_trainer._model.spec import check_model_ref

        check_model_ref(args.model, allow_download=args.allow_download)
    check_model_inputs(args)
    with library_errors("data", args.data):
        plans = plan_data(args)
    train = plans.get("data")
    records = None
    if train is not None:
        records = train.samples if train.samples is not None else train.source.records
    held_out = args.eval_every_steps is not None and args.val_data is None
    if records is None and train is None:  # a planned source's size is known once encoded
        records = _known_length(args)
        if args.data is None:
            held_out = False  # the demo has its own validation set
    if records is not None:
        _check_enough_data(args, records, held_out)
    if args.packing and args.data is not None and train is None:
        raise TrainingArgsError(
            "packing=True needs data that ray-trainer tokenizes (a JSONL/JSON/Parquet file or "
            "glob, a save_to_disk folder, a datasets.Dataset or a ray.data.Dataset); a torch "
            "Dataset of yours is "
            "batched as it is: pack it yourself, or set packing=False"
        )
    if args.strategy == "fsdp" or args.activation_checkpointing:
        _check_blocks(args)
    if args.lora is not None:
        from ray_trainer._driver.lora_checks import check_lora_model

        check_lora_model(args)
    if args.compile:
        from ray_trainer._model.compile_probe import missing_compile_toolchain

        problem = missing_compile_toolchain(args.use_gpu)  # here; each worker checks again
        if problem:
            raise TrainingArgsError(problem)
    return plans


def check_enough_samples(args: TrainingArgs, plans: dict[str, Any]) -> None:
    """After the data is encoded: enough samples kept for one optimizer step."""
    train = plans.get("data")
    if train is not None and train.samples is not None:
        held_out = args.eval_every_steps is not None and args.val_data is None
        # Pairs count as one sample each (a pair's two sequences always train together).
        samples = int(train.meta.get("pairs", train.samples)) if train.meta else train.samples
        _check_enough_data(args, samples, held_out)


def _check_blocks(args: TrainingArgs) -> None:
    """The blocks FSDP shards (and activation checkpointing recomputes) exist: found on the
    model built on the meta device (no memory, no weights read)."""
    from ray_trainer._model.blocks import find_blocks
    from ray_trainer._model.spec import ModelSpec

    model = ModelSpec.of(args).build_meta_model()
    why = "fsdp" if args.strategy == "fsdp" else "checkpointing"
    find_blocks(model, args.fsdp_shard_modules, why=why)


def _known_length(args: TrainingArgs) -> int | None:
    """The training set's size when the driver knows it without building anything."""
    if args.data is None and is_builtin(args.model):
        from ray_trainer._demo import DEMO_DEFAULTS

        return int(args.demo.get("n_train", DEMO_DEFAULTS["n_train"]))
    data = args.data
    if data is not None and not callable(data) and hasattr(data, "__len__"):
        try:
            return len(data)
        except TypeError:
            return None
    return None


def _check_enough_data(args: TrainingArgs, records: int, hold_out: bool) -> None:
    """At least one optimizer step per epoch: every worker needs batch_size x grad_accum_steps
    samples of its own (after the 5% held out for validation when no val_data is given)."""
    held_out = max(1, records // 20) if hold_out else 0
    needed = args.batch_size * args.grad_accum_steps * args.max_workers
    if records - held_out >= needed:
        return
    source = args.data if isinstance(args.data, str) else "the training data"
    held = f" ({held_out} held out for validation)" if held_out else ""
    raise TrainingArgsError(
        f"data: {source} has {records} sample(s){held}, too few for one optimizer step of "
        f"batch_size={args.batch_size} x grad_accum_steps={args.grad_accum_steps} x "
        f"num_workers={args.max_workers} = {needed}; add data, or lower batch_size"
    )


def check_storage(args: TrainingArgs) -> Location:
    """The run folder on storage (``<storage_path>/<run_name>``: a local path, a URI, or a path
    on ``storage_filesystem``), after checking that ``resume_from`` is a complete checkpoint,
    that storage is writable and is not Ray's cache of a job's working dir, and that the folder
    holds no other run. Nothing is created when a check fails."""
    if args.resume_from is not None:
        _check_resume_from(args.resume_from)
    with library_errors("storage_path", args.storage_path):
        storage = locate(args.storage_path, args.storage_filesystem)
        storage.is_dir()  # a bucket the credentials cannot reach fails here, not in a worker
    if storage.is_local and f"{os.sep}runtime_resources{os.sep}" in storage.path:
        raise TrainingArgsError(
            f"storage_path {args.storage_path!r} resolves to {storage.path}, inside Ray's cache "
            "of this job's working dir, which Ray deletes when it evicts the package "
            "(checkpoints included): give an absolute path on shared storage, or a bucket URI"
        )
    if storage.is_local and os.path.exists(storage.path) and not os.path.isdir(storage.path):
        raise TrainingArgsError(
            f"storage_path {args.storage_path!r} is a file, not a folder; give the folder runs "
            "are written under (it is created if missing), or a bucket URI"
        )
    probe = storage.child(f".write_probe_{os.getpid()}_{secrets.token_hex(4)}")
    try:
        probe.write_text("ok")
        probe.delete()
    except OSError as e:
        raise TrainingArgsError(
            f"storage_path {args.storage_path!r} is not writable ({getattr(e, 'strerror', None) or e}); "
            "choose a folder you can write to (on a multi-node cluster, one every node shares) "
            "or a bucket this process has credentials for"
        ) from None
    run = storage.child(args.run_name)
    latest = next(complete_checkpoints(run), None)
    _check_strategy(args, latest)
    from ray_trainer._driver.lora_checks import check_lora_resume

    # The workers resume from the run's newest checkpoint, else from resume_from.
    resumed = latest or (locate(args.resume_from) if args.resume_from is not None else None)
    check_lora_resume(args, resumed)
    _check_objective_resume(args, resumed)
    record = read_run_record(run)
    # A run that wrote no checkpoint (it failed before its first save) has nothing to protect:
    # a corrected retry under the same name replaces its record.
    if record is not None and not same_run(record.get("fingerprint"), args) and _checkpoints(run):
        raise TrainingArgsError(
            f"run_name {args.run_name!r}: {run.name} already holds a different run "
            f"({record.get('fingerprint')}); pick a new run_name, or delete that folder"
        )
    return run


def _check_objective_resume(args: TrainingArgs, checkpoint: Location | None) -> None:
    """A run continues with the objective its checkpoint was trained with: an SFT checkpoint
    resumed under DPO would take the SFT run's optimizer and schedule, and its adapters' base
    would not be the reference. DPO starts from an SFT checkpoint as ``model=``."""
    if checkpoint is None:
        return
    from ray_trainer._checkpoint import check_complete

    trained = check_complete(checkpoint).extra.get("objective")
    error = resume_error(trained, args.objective, checkpoint.name)
    if error is not None:
        raise TrainingArgsError(error)


def _check_strategy(args: TrainingArgs, checkpoint: Location | None) -> None:
    """A run continues with the strategy its checkpoints were written with (DDP's are whole
    files, FSDP's are shards)."""
    if checkpoint is None:
        return
    written = check_complete(checkpoint).strategy
    if written != args.strategy:
        raise TrainingArgsError(
            f"strategy: {checkpoint.name} was written with strategy={written!r}; continue this run "
            f"with strategy={written!r}, or pick a new run_name"
        )


def _checkpoints(folder: Location) -> list[str]:
    return checkpoint_names(folder.listdir())


def _check_resume_from(path: str) -> None:
    try:
        with library_errors("resume_from", path):
            verify(path)
    except CheckpointError as e:
        folder = locate(path)
        names = _checkpoints(folder)
        if names:  # a run folder, not one of its checkpoints
            latest = latest_checkpoint(path)
            hint = f"e.g. the newest complete one, {latest}" if latest else "none is complete"
            raise TrainingArgsError(
                f"resume_from: {path} is a run folder, not a checkpoint; it holds "
                f"{', '.join(names)}: pass one of them ({hint}), or give its run_name to "
                "continue that run"
            ) from None
        base = path.rstrip("/").rsplit("/", 1)[-1]  # a checkpoint_<step> folder: incomplete
        if not checkpoint_names([base]) and not _looks_like_a_checkpoint(folder):
            raise TrainingArgsError(
                f"resume_from: {path} is not a checkpoint (no {STATE_FILE}, no rank*.complete); "
                "pass a checkpoint_<step> folder that a run wrote (e.g. "
                "<storage_path>/<run_name>/checkpoint_000100), or give its run_name to continue "
                "that run"
            ) from None
        raise TrainingArgsError(f"resume_from: {e}") from None


def _looks_like_a_checkpoint(folder: Location) -> bool:
    """A folder a checkpoint save began (complete or not): its state file or a rank's marker
    (a folder that does not exist says so in `verify`'s own message)."""
    if not folder.is_dir():
        return True
    names = folder.listdir()
    return STATE_FILE in names or any(
        n.startswith("rank") and n.endswith(".complete") for n in names
    )


@contextlib.contextmanager
def library_errors(field: str, value: Any) -> Iterator[None]:
    """A library's error while checking `field` (pyarrow's ``ArrowInvalid`` for an unknown URI
    scheme, an ``OSError`` of a bucket without credentials...) becomes a `TrainingArgsError`
    naming the field: the Python API refuses bad input with one family of errors. Errors of
    ours that already name the input (`DataFileError`, `ModelLoadError`, `CheckpointError`,
    the chat records' own) pass as they are."""
    from pyarrow import ArrowException  # ArrowInvalid is one (and a ValueError)

    try:
        yield
    except (TrainingArgsError, DataFileError, ModelLoadError, CheckpointError):
        raise
    except (ArrowException, OSError) as e:
        shown = value if isinstance(value, str) else type(value).__name__
        raise TrainingArgsError(
            f"{field}: {shown!r} cannot be read ({type(e).__name__}: {e}); check the path and "
            "its permissions, or, for a URI, its scheme (s3://, gs://, hdfs://...) and this "
            "machine's credentials for it"
        ) from e


def read_run_record(run: Location) -> dict[str, Any] | None:
    """``run.json`` of a run folder (what the run trains), or None when there is none."""
    text = run.child(RUN_RECORD).read_text()
    return json.loads(text) if text else None


def write_run_record(run: Location, record: dict[str, Any]) -> None:
    """Write ``run.json`` whole, on the run's storage."""
    text = json.dumps(record, indent=1, sort_keys=True)
    run.child(RUN_RECORD).write_text(text)
