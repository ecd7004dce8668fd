"""Every process: the checkpoint format, written by the workers, complete or refused.

Written in the training processes; read there (resume), in the callback actor (its state), in
the driver (``resume_from``) and in evaluation tasks and notebooks (``load_model_state``). Every rank writes its own part into its own temporary folder
(its RNG state and the state of its stateful callbacks); rank 0 also writes the model, optimizer,
scheduler and trainer state. Ray Train merges the folders of all ranks into one persisted
checkpoint. Each rank writes ``rank<r>.complete`` last: a JSON manifest of its files and their
sizes. A checkpoint is trusted only when rank 0's manifest is there, names the world size, and the
manifest of every rank matches the files on disk; anything else is an incomplete checkpoint.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import cloudpickle

from ray_trainer._contract import CHECKPOINT_PREFIX

if TYPE_CHECKING:
    import torch  # noqa: F401  (imported lazily: the callback actor reads manifests without torch)

FORMAT_VERSION = 1
MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
STATE_FILE = "trainer_state.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing files, incomplete, or of an unknown format."""


@dataclass
class TrainerState:
    """Where training stands; enough to resume at the same step and data position."""

    global_step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0  # optimizer steps already taken in `epoch`
    samples_seen: int = 0
    tokens_seen: int = 0
    world_size: int = 1
    stop_reason: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class LoadedCheckpoint:
    path: str
    state: TrainerState
    model: dict[str, Any]
    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any] | None
    rng: dict[str, Any] | None
    callbacks: dict[str, Any]  # state_key -> state of this rank's stateful callbacks
    user_state: dict[str, Any]


def rng_state() -> dict[str, Any]:
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import torch

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_rank_part(
    folder: str,
    *,
    rank: int,
    world_size: int,
    callback_state: dict[str, Any],
    user_state: dict[str, Any],
    model: dict[str, Any] | None = None,
    optimizer: dict[str, Any] | None = None,
    scheduler: dict[str, Any] | None = None,
    trainer_state: TrainerState | None = None,
) -> None:
    """Write this rank's files into `folder`, the completion manifest last."""
    import torch

    files = {}

    def put(name: str, obj: Any) -> None:
        torch.save(obj, os.path.join(folder, name))
        files[name] = os.path.getsize(os.path.join(folder, name))

    if rank == 0:
        assert model is not None and trainer_state is not None
        put(MODEL_FILE, model)
        if optimizer is not None:
            put(OPTIMIZER_FILE, optimizer)
        if scheduler is not None:
            put(SCHEDULER_FILE, scheduler)
        state_path = os.path.join(folder, STATE_FILE)
        with open(state_path, "w") as f:
            json.dump({"format": FORMAT_VERSION, **trainer_state.__dict__}, f, indent=1)
        files[STATE_FILE] = os.path.getsize(state_path)
    # Callback state can hold any picklable object: cloudpickle, not torch's weights-only format.
    put(
        f"rank{rank}.pt",
        {
            "rng": rng_state(),
            "callbacks": cloudpickle.dumps(callback_state),
            "user_state": cloudpickle.dumps(user_state),
        },
    )
    manifest = {"format": FORMAT_VERSION, "rank": rank, "world_size": world_size, "files": files}
    tmp = os.path.join(folder, f".rank{rank}.complete.tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, f"rank{rank}.complete"))


def verify(path: str) -> TrainerState:
    """Check that every rank's part of the checkpoint at `path` is there and whole."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: checkpoint folder does not exist")
    manifest0 = _read_manifest(path, 0)
    for rank in range(manifest0["world_size"]):
        manifest = manifest0 if rank == 0 else _read_manifest(path, rank)
        for name, size in manifest["files"].items():
            full = os.path.join(path, name)
            if not os.path.isfile(full) or os.path.getsize(full) != size:
                raise CheckpointError(
                    f"{path}: incomplete checkpoint: {name} is missing or truncated; "
                    "resume from an earlier checkpoint"
                )
    with open(os.path.join(path, STATE_FILE)) as f:
        raw = json.load(f)
    raw.pop("format", None)
    return TrainerState(**raw)


def load(path: str, rank: int) -> LoadedCheckpoint:
    """Load a verified checkpoint for `rank` (a rank the checkpoint did not have uses rank 0's)."""
    import torch

    state = verify(path)
    part_rank = rank if os.path.exists(os.path.join(path, f"rank{rank}.pt")) else 0
    part = torch.load(os.path.join(path, f"rank{part_rank}.pt"), weights_only=False)

    def opt(name: str) -> Any:
        full = os.path.join(path, name)
        return (
            torch.load(full, map_location="cpu", weights_only=False)
            if os.path.exists(full)
            else None
        )

    return LoadedCheckpoint(
        path=path,
        state=state,
        model=torch.load(os.path.join(path, MODEL_FILE), map_location="cpu", weights_only=True),
        optimizer=opt(OPTIMIZER_FILE),
        scheduler=opt(SCHEDULER_FILE),
        rng=part["rng"] if part_rank == rank else None,
        callbacks=cloudpickle.loads(part["callbacks"]),
        user_state=cloudpickle.loads(part["user_state"]),
    )


def load_model_state(path: str) -> dict[str, Any]:
    """The model weights (a state dict, on CPU) of a complete checkpoint.

    Runs anywhere the checkpoint folder is readable, e.g. in an `EvalOnSave` task.

    Example:
        >>> model = build_my_model()
        >>> model.load_state_dict(load_model_state(checkpoint_path))
    """
    import torch

    verify(path)
    return torch.load(os.path.join(path, MODEL_FILE), map_location="cpu", weights_only=True)


def latest_checkpoint(run_dir: str) -> str | None:
    """The newest complete checkpoint folder under a run folder, or None."""
    if not os.path.isdir(run_dir):
        return None
    names = sorted(n for n in os.listdir(run_dir) if n.startswith(CHECKPOINT_PREFIX))
    for name in reversed(names):
        try:
            verify(os.path.join(run_dir, name))
        except CheckpointError:
            continue
        return os.path.join(run_dir, name)
    return None


def _read_manifest(path: str, rank: int) -> dict[str, Any]:
    full = os.path.join(path, f"rank{rank}.complete")
    try:
        with open(full) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(
            f"{path}: incomplete checkpoint (no rank{rank}.complete): it was not fully written; "
            "resume from an earlier checkpoint"
        ) from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{full}: corrupt manifest ({e})") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{full}: unknown checkpoint format {manifest.get('format')!r}")
    return manifest
