"""Every process: reading a complete checkpoint, of either strategy, from any storage.

Runs in the training workers (resume), in evaluation tasks, notebooks and scripts
(``load_model``, ``load_model_state``), and in the driver. A checkpoint is verified first (its
manifests, read where it is), then read from a local folder: the checkpoint itself on local or
shared storage, else a download into a temporary folder (``_storage.local_copy``), whose every
file must match the SHA-256 its manifest lists before any is read. Nothing is unpickled: state
is read weights-only and the model spec is JSON (``safe.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ray_trainer._checkpoint import safe
from ray_trainer._checkpoint.format import (
    MODEL_FILE,
    MODEL_SPEC_FILE,
    OPTIMIZER_FILE,
    SCHEDULER_FILE,
    SHARDS_DIR,
    TIED_WEIGHTS,
    TrainerState,
    check_complete,
    check_content,
    differs,
    listed_files,
    shared_storage_aliases,
)
from ray_trainer._errors import CheckpointError
from ray_trainer._storage import Location, local_copy, locate


@dataclass
class LocalCheckpoint:
    """A verified checkpoint in a local folder (valid inside `open_checkpoint`'s block)."""

    folder: str
    name: str  # its path or URI, as users see it
    state: TrainerState

    @property
    def sharded(self) -> bool:
        """Written under FSDP: model and optimizer are DCP shards in ``shards/``."""
        return os.path.isdir(os.path.join(self.folder, SHARDS_DIR))

    @property
    def shards_dir(self) -> str:
        return os.path.join(self.folder, SHARDS_DIR)

    def rank_part(self, rank: int) -> dict[str, Any]:
        """A rank's RNG state (None for a rank the checkpoint did not have: another world
        size), callback state and user_state (rank 0's for such a rank)."""
        own = os.path.exists(os.path.join(self.folder, f"rank{rank}.pt"))
        part = self.load(f"rank{rank if own else 0}.pt")
        if not isinstance(part, dict) or not {"rng", "callbacks", "user_state"} <= set(part):
            raise CheckpointError(f"{self.name}: rank{rank}.pt is not a rank's part")
        return {
            "rng": part["rng"] if own else None,
            "callbacks": part["callbacks"],
            "user_state": part["user_state"],
        }

    def load(self, name: str, weights_only: bool = True) -> Any:
        """A file of tensors and plain data (``model.pt``, ``optimizer.pt``...), read
        weights-only (nothing in it runs), or None. `weights_only` is accepted for callers of
        older versions; it cannot be turned off."""
        path = os.path.join(self.folder, name)
        if not os.path.exists(path):
            return None
        return safe.load_file(path, f"{self.name}/{name}")

    def scheduler(self) -> Any:
        return self.load(SCHEDULER_FILE)

    def model_spec(self, model: Any = None) -> Any:
        """How to build the checkpoint's model (a `ModelSpec`), from its JSON record; `model`,
        a factory, builds it instead (needed where the run's factory had no importable name)."""
        from ray_trainer._model.spec import ModelSpec

        path = os.path.join(self.folder, MODEL_SPEC_FILE)
        if not os.path.exists(path):
            if model is not None:
                return ModelSpec(model=model)
            raise CheckpointError(
                f"{self.name}: this checkpoint does not record how to build its model; build "
                "the model yourself and use load_model_state(), or pass load_model(path, "
                "model=factory)"
            )
        with open(path, "rb") as f:
            try:
                record = json.loads(f.read())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{self.name}/{MODEL_SPEC_FILE}: not JSON ({e})") from None
        if not isinstance(record, dict):
            raise CheckpointError(f"{self.name}/{MODEL_SPEC_FILE}: not a model spec")
        try:
            return ModelSpec.from_record(record, model=model, where=self.name)
        except (KeyError, TypeError) as e:
            raise CheckpointError(
                f"{self.name}/{MODEL_SPEC_FILE}: not a model spec ({e})"
            ) from None

    def model_state(self, template: dict[str, Any] | None = None) -> dict[str, Any]:
        """The whole model's weights: ``model.pt``, or the FSDP shards gathered into
        ``template`` (a model's own state dict to fill) or, without one, into a new dict."""
        if not self.sharded:
            return self.load(MODEL_FILE, weights_only=True)
        import torch.distributed.checkpoint as dcp

        reader = safe.dcp_reader(self.shards_dir, f"{self.name}/{SHARDS_DIR}")
        if template is not None:  # one process, no process group: DCP reads every shard
            aliases = shared_storage_aliases(template)  # a tied weight is stored once
            state = {"model": {k: v for k, v in template.items() if k not in aliases}}
            with safe.shard_errors(self.name):
                dcp.load(state, storage_reader=reader)
            weights = state["model"]
        else:  # every shard gathered whole, in this process (what dcp_to_torch_save reads)
            from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
            from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

            whole: dict[str, Any] = {}
            with safe.shard_errors(self.name):
                _load_state_dict(
                    whole,
                    storage_reader=reader,
                    planner=_EmptyStateDictLoadPlanner(),
                    no_dist=True,
                )
            weights = whole["model"]
            aliases = self.state.extra.get(TIED_WEIGHTS, {})
        for alias, kept in aliases.items():
            weights[alias] = weights[kept]
        return weights


@dataclass
class LoadedCheckpoint:
    """What a rank resumes from: a checkpoint read whole into memory (DDP's format; a sharded
    checkpoint's `model` and `optimizer` are None: a worker reads its shards itself)."""

    path: str
    state: TrainerState
    model: dict[str, Any] | None
    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any] | None
    rng: dict[str, Any] | None
    callbacks: dict[str, Any]  # state_key -> state of this rank's stateful callbacks
    user_state: dict[str, Any]


def load(location: Location, rank: int) -> LoadedCheckpoint:
    """Load a verified checkpoint for `rank` (a rank the checkpoint did not have uses rank 0's
    callback state and no RNG state). A checkpoint on remote storage is downloaded first."""
    with open_checkpoint(location) as checkpoint:
        part = checkpoint.rank_part(rank)
        whole = not checkpoint.sharded
        return LoadedCheckpoint(
            path=checkpoint.name,
            state=checkpoint.state,
            model=checkpoint.load(MODEL_FILE) if whole else None,
            optimizer=checkpoint.load(OPTIMIZER_FILE) if whole else None,
            scheduler=checkpoint.scheduler(),
            rng=part["rng"],
            callbacks=part["callbacks"],
            user_state=part["user_state"],
        )


@contextlib.contextmanager
def open_checkpoint(location: Location) -> Iterator[LocalCheckpoint]:
    """Verify the checkpoint at `location` and hand it over as a local folder for the block
    (downloaded first when it is on remote storage), after checking every file of that folder
    against the SHA-256 its manifest lists (`CheckpointError` names the file that differs)."""
    state = check_complete(location)
    with local_copy(location) as folder:
        check_content(folder, location)
        yield LocalCheckpoint(folder, location.name, state)


def load_model_state(path: str, filesystem: Any = None) -> dict[str, Any]:
    """The model weights (a state dict, on CPU) of a complete checkpoint on any storage, of
    either strategy (FSDP shards are gathered here, in one process).

    Runs anywhere the storage is reachable, e.g. in an `EvalOnSave` task.

    Example:
        >>> model = build_my_model()
        >>> model.load_state_dict(load_model_state(checkpoint_path))
    """
    location = locate(path, filesystem)
    check_complete(location)
    entry = listed_files(location).get(MODEL_FILE)
    if entry is not None:  # DDP: one file, read where it is
        data = location.child(MODEL_FILE).read_bytes()
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise differs(location.name, MODEL_FILE)
        return safe.loads(data, f"{location.name}/{MODEL_FILE}")
    with open_checkpoint(location) as checkpoint:
        return checkpoint.model_state()


def load_model(
    path: str,
    device: str = "cpu",
    filesystem: Any = None,
    merge: bool = True,
    model: Any = None,
) -> Any:
    """The trained ``nn.Module`` of a complete checkpoint on any storage and of either strategy,
    in eval mode on ``device``: rebuilt from the model spec the checkpoint records (the built-in
    demo, a Hugging Face model, or a model factory, imported from this environment by the
    ``"module:qualname"`` it records), then loaded with the checkpoint's weights. `model`, a
    factory (a callable returning the ``nn.Module``), builds it instead: a checkpoint of a run
    whose factory had no importable name (a lambda, a local function) needs it.

    Every file is checked against the SHA-256 its manifest lists, and nothing in the checkpoint
    is unpickled: its weights are read weights-only, its model spec is JSON.

    Runs anywhere the storage is reachable: an evaluation task, a notebook, a script. Needs no
    process group: FSDP shards are read in this one process.

    A LoRA checkpoint holds the adapters alone: the base is built from the model the run was
    given (read from its bucket when it is a URI), the adapters loaded into it, and with
    ``merge=True`` (the default) merged, giving a plain model (a Hugging Face model for a
    Hugging Face base); ``merge=False`` returns the ``peft.PeftModel``.

    Example:
        >>> model = load_model("s3://bucket/runs/my-run/checkpoint_00000400", device="cuda")
    """
    with open_checkpoint(locate(path, filesystem)) as checkpoint:
        module = checkpoint.model_spec(model).build_model()
        lora = checkpoint.state.extra.get("lora")
        if lora is None:
            module.load_state_dict(checkpoint.model_state(module.state_dict()))
            return module.to(device).eval()
        from ray_trainer._lora import trainable_names, wrap

        module = wrap(module, {**lora["config"], "target_modules": lora["target_modules"]})
        keep = set(trainable_names(module))
        template = {k: v for k, v in module.state_dict().items() if k in keep}
        adapters = checkpoint.model_state(template)
        missing = sorted(keep - set(adapters))
        if missing:
            raise CheckpointError(f"{checkpoint.name} holds no {missing[0]}")
        module.load_state_dict(adapters, strict=False)
    if merge:
        module = module.merge_and_unload()
    return module.to(device).eval()
