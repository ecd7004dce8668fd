"""Every process: reading a complete checkpoint, of either strategy, from any storage.

Runs in the training workers (resume), in evaluation tasks, notebooks and scripts
(``load_model``, ``load_model_state``), and in the driver. A checkpoint is verified first (its
manifests, read where it is), then read from a local folder: the checkpoint itself on local or
shared storage, else a download into a temporary folder (``_storage.local_copy``), whose every
file must match the SHA-256 its manifest lists before any is read. A reader opens only the
files the manifests list: the strategy that wrote the checkpoint is its trainer state's word,
never what the folder holds, and a folder that holds a file a reader opens but no manifest
lists is refused, naming it (``format.check_unlisted``). Nothing is unpickled: state is read
weights-only and the model spec is JSON (``safe.py``); a model factory that the spec names is
imported and called only when the caller says it trusts it (``trust_factory=True``) or passes
its own (``model=``).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ray_trainer._checkpoint import safe
from ray_trainer._checkpoint.format import (
    MODEL_FILE,
    MODEL_SPEC_FILE,
    OPTIMIZER_FILE,
    SCHEDULER_FILE,
    SHARD_METADATA,
    SHARDS_DIR,
    TIED_WEIGHTS,
    TrainerState,
    check_complete,
    check_content,
    check_unlisted,
    differs,
    listed_files,
    shared_storage_aliases,
)
from ray_trainer._errors import CheckpointError
from ray_trainer._storage import Location, local_copy, locate

#: The local folders that an `open_checkpoint` block around this code verified (folder ->
#: trainer state, listed files): a reader opening one again inside the block (``load_model`` in
#: an ``EvalOnSave`` function, handed the folder that `_run_eval` verified) does not hash it again.
_VERIFIED: contextvars.ContextVar[tuple[tuple[str, TrainerState, dict[str, Any]], ...]] = (
    contextvars.ContextVar("ray_trainer_verified_checkpoints", default=())
)


@dataclass
class LocalCheckpoint:
    """A verified checkpoint in a local folder (valid inside `open_checkpoint`'s block). It
    reads only `files`, the files its manifests list (and `open_checkpoint` hashed)."""

    folder: str
    name: str  # its path or URI, as users see it
    state: TrainerState
    files: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def sharded(self) -> bool:
        """Written under FSDP (its trainer state's ``strategy``): model and optimizer are DCP
        shards in ``shards/``."""
        return self.state.strategy == "fsdp"

    @property
    def shards_dir(self) -> str:
        """The folder of the FSDP shards, whose ``.metadata`` the manifests list."""
        self.require(SHARD_METADATA)
        return os.path.join(self.folder, SHARDS_DIR)

    def require(self, name: str) -> str:
        """The local path of `name`, a file the manifests must list (`CheckpointError` else)."""
        if name not in self.files:
            raise CheckpointError(
                f"{self.name}: its manifests do not list {name}, which a checkpoint written "
                f"with strategy={self.state.strategy!r} holds: it was not written by this "
                "version of ray-trainer, or it was changed; resume from an earlier checkpoint"
            )
        return os.path.join(self.folder, name)

    def rank_part(self, rank: int) -> dict[str, Any]:
        """A rank's RNG state (None for a rank the checkpoint did not have: another world
        size), callback state and user_state (rank 0's for such a rank)."""
        own = f"rank{rank}.pt" in self.files
        part = self.read(f"rank{rank if own else 0}.pt")
        if not isinstance(part, dict) or not {"rng", "callbacks", "user_state"} <= set(part):
            raise CheckpointError(f"{self.name}: rank{rank}.pt is not a rank's part")
        if not isinstance(part["callbacks"], dict) or not isinstance(part["user_state"], dict):
            raise CheckpointError(f"{self.name}: rank{rank}.pt is not a rank's part")
        return {
            "rng": part["rng"] if own else None,
            "callbacks": part["callbacks"],
            "user_state": part["user_state"],
        }

    def load(self, name: str, weights_only: bool = True) -> Any:
        """A listed file of tensors and plain data (``scheduler.pt``...), read weights-only
        (nothing in it runs), or None when the manifests do not list it (a file there that they
        do not list is never read). `weights_only` is accepted for callers of older versions;
        it cannot be turned off."""
        if name not in self.files:
            return None
        return safe.load_file(os.path.join(self.folder, name), f"{self.name}/{name}")

    def read(self, name: str) -> Any:
        """`load` of a file the checkpoint must hold (`CheckpointError` when it is unlisted)."""
        self.require(name)
        return self.load(name)

    def scheduler(self) -> Any:
        return self.load(SCHEDULER_FILE)

    def optimizer(self) -> dict[str, Any]:
        """DDP's whole optimizer state (``optimizer.pt``)."""
        state = self.read(OPTIMIZER_FILE)
        if not isinstance(state, dict):
            raise CheckpointError(f"{self.name}/{OPTIMIZER_FILE}: not an optimizer's state")
        return state

    def model_spec(self, model: Any = None, trust_factory: bool = False) -> Any:
        """How to build the checkpoint's model (a `ModelSpec`), from its JSON record; `model`,
        a factory, builds it instead (needed where the run's factory had no importable name).
        A factory the record names is imported and called only with `trust_factory`."""
        from ray_trainer._model.spec import ModelLoadError, ModelSpec

        if MODEL_SPEC_FILE not in self.files:
            if model is not None:
                return ModelSpec.from_record(None, model=model, where=self.name)
            raise CheckpointError(
                f"{self.name}: this checkpoint does not record how to build its model; build "
                "the model yourself and use load_model_state(), or pass load_model(path, "
                "model=factory)"
            )
        with open(os.path.join(self.folder, MODEL_SPEC_FILE), "rb") as f:
            try:
                record = json.loads(f.read())
            except ValueError as e:  # not JSON, or not UTF-8
                raise CheckpointError(f"{self.name}/{MODEL_SPEC_FILE}: not JSON ({e})") from None
        if not isinstance(record, dict):
            raise CheckpointError(f"{self.name}/{MODEL_SPEC_FILE}: not a model spec")
        try:
            return ModelSpec.from_record(
                record, model=model, where=self.name, trust_factory=trust_factory
            )
        except ModelLoadError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"{self.name}/{MODEL_SPEC_FILE}: not a model spec ({type(e).__name__}: {e})"
            ) from None

    def model_state(self, template: dict[str, Any] | None = None) -> dict[str, Any]:
        """The whole model's weights: ``model.pt``, or the FSDP shards gathered into
        ``template`` (a model's own state dict to fill) or, without one, into a new dict."""
        if not self.sharded:
            return _weights(self.read(MODEL_FILE), f"{self.name}/{MODEL_FILE}")
        import torch.distributed.checkpoint as dcp

        reader = safe.dcp_reader(self.shards_dir, f"{self.name}/{SHARDS_DIR}")
        if template is not None:  # one process, no process group: DCP reads every shard
            aliases = shared_storage_aliases(template)  # a tied weight is stored once
            state = {"model": {k: v for k, v in template.items() if k not in aliases}}
            with safe.shard_errors(self.name):
                dcp.load(state, storage_reader=reader)
            weights = state["model"]
        else:  # every shard of the model gathered whole, in this process (as dcp_to_torch_save)
            from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
            from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

            whole: dict[str, Any] = {}
            with safe.shard_errors(self.name):
                _load_state_dict(
                    whole,
                    storage_reader=reader,
                    planner=_EmptyStateDictLoadPlanner(keys={"model"}),
                    no_dist=True,
                )
            weights = _weights(whole.get("model"), f"{self.name}/{SHARDS_DIR}")
            aliases = self.state.extra.get(TIED_WEIGHTS, {})
            if not isinstance(aliases, dict) or not all(
                isinstance(a, str) and kept in weights for a, kept in aliases.items()
            ):
                raise CheckpointError(f"{self.name}: its trainer state's {TIED_WEIGHTS} is bad")
        for alias, kept in aliases.items():
            weights[alias] = weights[kept]
        return weights


def _weights(value: Any, name: str) -> dict[str, Any]:
    """`value` when it is a model's weights (a dict of tensors by name; a module's
    ``_extra_state`` may be plain data), else `CheckpointError`."""
    import torch

    if not isinstance(value, dict) or not all(
        isinstance(k, str) and (isinstance(v, torch.Tensor) or k.endswith("_extra_state"))
        for k, v in value.items()
    ):
        raise CheckpointError(f"{name}: not a model's weights (a dict of tensors by name)")
    return value


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
            model=checkpoint.model_state() if whole else None,
            optimizer=checkpoint.optimizer() if whole else None,
            scheduler=checkpoint.scheduler(),
            rng=part["rng"],
            callbacks=part["callbacks"],
            user_state=part["user_state"],
        )


@contextlib.contextmanager
def open_checkpoint(location: Location) -> Iterator[LocalCheckpoint]:
    """Verify the checkpoint at `location` and hand it over as a local folder for the block
    (downloaded first when it is on remote storage), after checking every file of that folder
    against the SHA-256 its manifest lists (`CheckpointError` names the file that differs) and
    that it holds no file a reader opens that they do not list. Inside the block, opening the
    same local folder again checks only the latter (it was hashed on the way in)."""
    verified = {folder: (state, files) for folder, state, files in _VERIFIED.get()}
    known = verified.get(location.path) if location.is_local else None
    if known is not None:
        state, files = known
        check_unlisted(location, files)
        yield LocalCheckpoint(location.path, location.name, state, files)
        return
    state = check_complete(location)
    with local_copy(location) as folder:
        files = check_content(folder, location)
        token = _VERIFIED.set((*_VERIFIED.get(), (os.path.abspath(folder), state, files)))
        try:
            yield LocalCheckpoint(folder, location.name, state, files)
        finally:
            _VERIFIED.reset(token)


def load_model_state(path: str, filesystem: Any = None) -> dict[str, Any]:
    """The model weights (a state dict, on CPU) of a complete checkpoint on any storage, of
    either strategy (FSDP shards are gathered here, in one process).

    Runs anywhere the storage is reachable, e.g. in an `EvalOnSave` task.

    Example:
        >>> model = build_my_model()
        >>> model.load_state_dict(load_model_state(checkpoint_path))
    """
    location = locate(path, filesystem)
    state = check_complete(location)
    files = listed_files(location)
    check_unlisted(location, files)
    if state.strategy == "ddp":  # one file, read where it is
        entry = files.get(MODEL_FILE)
        if entry is None:
            raise CheckpointError(f"{location.name}: its manifests do not list {MODEL_FILE}")
        data = location.child(MODEL_FILE).read_bytes()
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise differs(location.name, MODEL_FILE)
        name = f"{location.name}/{MODEL_FILE}"
        return _weights(safe.loads(data, name), name)
    with open_checkpoint(location) as checkpoint:
        return checkpoint.model_state()


def load_model(
    path: str,
    device: str = "cpu",
    filesystem: Any = None,
    merge: bool = True,
    model: Any = None,
    trust_factory: bool = False,
) -> Any:
    """The trained ``nn.Module`` of a complete checkpoint on any storage and of either strategy,
    in eval mode on ``device``: rebuilt from the model spec the checkpoint records (the built-in
    demo, a Hugging Face model, or a model factory), then loaded with the checkpoint's weights.

    A model factory is code: the checkpoint records it as a ``"module:qualname"``, and anyone
    who can write the checkpoint can name any importable callable there. So it is imported and
    called only when you say so: ``trust_factory=True`` (you trust this checkpoint: it imports
    the factory from this environment), or ``model=``, a factory of yours (a callable returning
    the ``nn.Module``) that builds it instead (and is how a checkpoint of a run whose factory had
    no importable name, a lambda or a local function, loads). Without either, a factory's
    checkpoint raises `ModelLoadError` naming the factory, before anything is imported. The
    built-in demo and a Hugging Face model (by name or path, built by ray-trainer's own loader)
    need neither.

    Every file is checked against the SHA-256 its manifest lists, a checkpoint that holds files
    a reader would open but that no manifest lists is refused, and nothing in the checkpoint is
    unpickled: its weights are read weights-only, its model spec is JSON.

    Runs anywhere the storage is reachable: an evaluation task, a notebook, a script. Needs no
    process group: FSDP shards are read in this one process.

    A LoRA checkpoint holds the adapters alone: the base is built from the model the run was
    given (read from its bucket when it is a URI), the adapters loaded into it, and with
    ``merge=True`` (the default) merged, giving a plain model (a Hugging Face model for a
    Hugging Face base); ``merge=False`` returns the ``peft.PeftModel``.

    Example:
        >>> model = load_model("s3://bucket/runs/my-run/checkpoint_00000400", device="cuda")
        >>> model = load_model(path, model=build_my_model)  # a run whose model was a factory

    A ``device`` that is not a torch device, or that this machine does not have (``"CPU:0"``,
    ``"cuda:7"`` with fewer GPUs), raises ``ValueError`` naming it, before anything is read.
    """
    device = existing_device(device)
    with open_checkpoint(locate(path, filesystem)) as checkpoint:
        module = _build(checkpoint.model_spec(model, trust_factory), checkpoint.name)
        lora = checkpoint.state.extra.get("lora")
        if lora is None:
            _fill(module, checkpoint.model_state(module.state_dict()), checkpoint.name)
            return module.to(device).eval()
        from ray_trainer._lora import trainable_names, wrap

        if not isinstance(lora, dict) or not isinstance(lora.get("config"), dict):
            raise CheckpointError(f"{checkpoint.name}: its trainer state's lora record is bad")
        module = wrap(module, {**lora["config"], "target_modules": lora.get("target_modules")})
        keep = set(trainable_names(module))
        template = {k: v for k, v in module.state_dict().items() if k in keep}
        adapters = checkpoint.model_state(template)
        missing = sorted(keep - set(adapters))
        if missing:
            raise CheckpointError(f"{checkpoint.name} holds no {missing[0]}")
        _fill(module, adapters, checkpoint.name, strict=False)
    if merge:
        module = module.merge_and_unload()
    return module.to(device).eval()


def existing_device(device: Any) -> Any:
    """`device` as a ``torch.device`` this machine has; else ``ValueError`` naming it and what
    there is (a device type whose count torch cannot tell here is taken as given)."""
    import torch

    try:
        found = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(
            f"load_model: device={device!r} is not a torch device; give one as torch names it, "
            "in lower case: e.g. 'cpu', 'cuda', 'cuda:0' or 'mps'"
        ) from None
    counter = getattr(getattr(torch, found.type, None), "device_count", None)
    if found.type in ("cpu", "meta") or counter is None:
        return found
    count = counter()
    if (found.index or 0) < count:
        return found
    has = f"{count} ({found.type}:0 to {found.type}:{count - 1})" if count else "none"
    raise ValueError(
        f"load_model: device={device!r} does not exist on this machine ({found.type} devices: "
        f"{has}); give device='cpu'" + (f" or one of those {found.type} devices" if count else "")
    )


def _build(spec: Any, name: str) -> Any:
    """The module `spec` builds; a recorded spec that cannot build one (its settings refused
    by the model's own code) raises `ModelLoadError` naming the checkpoint. A factory's own
    error (the caller's code) is left as it is."""
    from ray_trainer._model.spec import ModelLoadError

    try:
        return spec.build_model()
    except ModelLoadError:
        raise
    except (TypeError, ValueError, KeyError, OverflowError, RuntimeError) as e:
        if callable(spec.model):
            raise
        raise ModelLoadError(
            f"{name}/{MODEL_SPEC_FILE}: the model it records cannot be built "
            f"({type(e).__name__}: {str(e)[:300]})"
        ) from e


def _fill(module: Any, weights: dict[str, Any], name: str, strict: bool = True) -> None:
    """Load `weights` into `module`; weights of another model are `CheckpointError`."""
    try:
        module.load_state_dict(weights, strict=strict)
    except (RuntimeError, TypeError, ValueError, KeyError) as e:
        said = " ".join(str(e).split()) or type(e).__name__
        raise CheckpointError(
            f"{name}: its weights do not fit the model its spec builds ({said[:300]})"
        ) from None
