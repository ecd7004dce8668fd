"""Every process: reading a complete checkpoint, of either strategy, from any storage.

Runs in the training workers (resume), in evaluation tasks, notebooks and scripts
(``load_model``, ``load_model_state``), and in the driver. A checkpoint is verified first (its
manifests, read where it is), then read from a local folder: the checkpoint itself on local or
shared storage, else a download into a temporary folder (``_storage.local_copy``).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import cloudpickle

from ray_trainer._checkpoint.format import (
    MODEL_FILE,
    MODEL_SPEC_FILE,
    OPTIMIZER_FILE,
    SCHEDULER_FILE,
    SHARDS_DIR,
    TIED_WEIGHTS,
    TrainerState,
    check_complete,
    shared_storage_aliases,
)
from ray_trainer._errors import CheckpointError
from ray_trainer._storage import Location, local_copy, locate

# Where `ModelSpec` lived before the rooms of issue 47 (`_model/spec.py` now): a checkpoint
# written then names it in its model_spec.pkl. Spelt in parts so that the rewrite of module
# paths that moved it leaves this name alone.
_OLD_SPEC_MODULE = ".".join(("ray_trainer", "_models"))


class _SpecUnpickler(pickle.Unpickler):
    """Reads a model_spec.pkl (cloudpickle writes plain pickle), older module names mapped."""

    def find_class(self, module: str, name: str) -> Any:
        if module == _OLD_SPEC_MODULE:
            module = "ray_trainer._model.spec"
        return super().find_class(module, name)


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
        import torch

        own = os.path.exists(os.path.join(self.folder, f"rank{rank}.pt"))
        part = torch.load(
            os.path.join(self.folder, f"rank{rank if own else 0}.pt"), weights_only=False
        )
        return {
            "rng": part["rng"] if own else None,
            "callbacks": cloudpickle.loads(part["callbacks"]),
            "user_state": cloudpickle.loads(part["user_state"]),
        }

    def load(self, name: str, weights_only: bool = False) -> Any:
        """A file saved with torch.save (``model.pt``, ``optimizer.pt``...), or None."""
        import torch

        path = os.path.join(self.folder, name)
        if not os.path.exists(path):
            return None
        return torch.load(path, map_location="cpu", weights_only=weights_only)

    def scheduler(self) -> Any:
        return self.load(SCHEDULER_FILE)

    def model_spec(self) -> Any:
        path = os.path.join(self.folder, MODEL_SPEC_FILE)
        if not os.path.exists(path):
            raise CheckpointError(
                f"{self.name}: this checkpoint does not record how to build its model "
                "(written by an older ray-trainer); build the model yourself and use "
                "load_model_state()"
            )
        with open(path, "rb") as f:
            return _SpecUnpickler(f).load()

    def model_state(self, template: dict[str, Any] | None = None) -> dict[str, Any]:
        """The whole model's weights: ``model.pt``, or the FSDP shards gathered into
        ``template`` (a model's own state dict to fill) or, without one, into a new dict."""
        if not self.sharded:
            return self.load(MODEL_FILE, weights_only=True)
        import torch.distributed.checkpoint as dcp

        if template is not None:  # one process, no process group: DCP reads every shard
            aliases = shared_storage_aliases(template)  # a tied weight is stored once
            state = {"model": {k: v for k, v in template.items() if k not in aliases}}
            dcp.load(state, storage_reader=dcp.FileSystemReader(self.shards_dir))
            weights = state["model"]
        else:
            from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

            with tempfile.TemporaryDirectory(prefix="ray_trainer_dcp_") as tmp:
                whole = os.path.join(tmp, "whole.pt")
                dcp_to_torch_save(self.shards_dir, whole)
                import torch

                weights = torch.load(whole, map_location="cpu", weights_only=False)["model"]
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
            model=checkpoint.load(MODEL_FILE, weights_only=True) if whole else None,
            optimizer=checkpoint.load(OPTIMIZER_FILE) if whole else None,
            scheduler=checkpoint.scheduler(),
            rng=part["rng"],
            callbacks=part["callbacks"],
            user_state=part["user_state"],
        )


@contextlib.contextmanager
def open_checkpoint(location: Location) -> Iterator[LocalCheckpoint]:
    """Verify the checkpoint at `location` and hand it over as a local folder for the block
    (downloaded first when it is on remote storage)."""
    state = check_complete(location)
    with local_copy(location) as folder:
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
    model_file = location.child(MODEL_FILE)
    if model_file.size() is not None:  # DDP: one file, read where it is
        import torch

        return torch.load(
            io.BytesIO(model_file.read_bytes()), map_location="cpu", weights_only=True
        )
    with open_checkpoint(location) as checkpoint:
        return checkpoint.model_state()


def load_model(path: str, device: str = "cpu", filesystem: Any = None, merge: bool = True) -> Any:
    """The trained ``nn.Module`` of a complete checkpoint on any storage and of either strategy,
    in eval mode on ``device``: rebuilt from the model spec the checkpoint records (the built-in
    demo, a model factory, or a Hugging Face model), then loaded with the checkpoint's weights.

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
        model = checkpoint.model_spec().build_model()
        lora = checkpoint.state.extra.get("lora")
        if lora is None:
            model.load_state_dict(checkpoint.model_state(model.state_dict()))
            return model.to(device).eval()
        from ray_trainer._lora import trainable_names, wrap

        model = wrap(model, {**lora["config"], "target_modules": lora["target_modules"]})
        keep = set(trainable_names(model))
        template = {k: v for k, v in model.state_dict().items() if k in keep}
        adapters = checkpoint.model_state(template)
        missing = sorted(keep - set(adapters))
        if missing:
            raise CheckpointError(f"{checkpoint.name} holds no {missing[0]}")
        model.load_state_dict(adapters, strict=False)
    if merge:
        model = model.merge_and_unload()
    return model.to(device).eval()
