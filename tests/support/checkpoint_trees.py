"""Checkpoints written as the workers write them, tampered with, and read by every reader.

Shared by `tests/unit/test_checkpoint_safety.py` (each attack once, by name) and
`tests/unit/test_checkpoint_safety_trees.py` (generated trees). `write_checkpoint` writes a
complete two-rank checkpoint of `make_model` (DDP's ``model.pt`` and ``optimizer.pt``, or FSDP's
DCP shards), `Evil` is a pickle whose ``__reduce__`` creates a marker file, `relist` brings every
manifest up to date with the files as they are now (a forger's last step), and `read_every_way`
reads a checkpoint through each reader of the package and returns what they raised.
"""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from ray_trainer import _checkpoint as ckpt
from ray_trainer._checkpoint.names import ACTOR_STATE_FILE
from ray_trainer._checkpoint.safe import dumps
from ray_trainer._model.spec import ModelSpec
from ray_trainer._storage import locate
from ray_trainer._worker.checkpoints.resume import restore_state
from ray_trainer._worker.checkpoints.saving import sharded_state, write_state


def make_model() -> torch.nn.Module:
    """A model factory that ``module:qualname`` names."""
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


class Evil:
    """A pickle that creates `marker` when it is unpickled."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def evil_bytes(marker: Any) -> bytes:
    return pickle.dumps(Evil(str(marker)))


class Whole:
    """What a run that trains every weight saves and loads (`Adaptation`)."""

    @staticmethod
    def trainable(model, state):
        return state

    @staticmethod
    def load(module, state, name):
        module.load_state_dict(state)


@dataclass
class Parallel:
    """How a one-process run holds its model (`ParallelModel`'s two names that resume uses)."""

    model: torch.nn.Module

    def module(self) -> torch.nn.Module:
        return self.model


def write_checkpoint(
    folder, *, sharded=False, factory=make_model, world=2, actor_state=True, spec=True
):
    """A complete checkpoint of `factory`'s model (DDP: model.pt and optimizer.pt; sharded:
    DCP shards), `world` ranks, a scheduler, callback state, the model spec (unless `spec` is
    False) and the actor's state. The trained model."""
    os.makedirs(folder, exist_ok=True)
    model = factory()
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = scheduler_of(optimizer)  # as a run has one (it adds initial_lr to the groups)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    scheduler.step()
    if sharded:
        files = write_state(str(folder), sharded_state(model, optimizer, Whole), 0, True)
    else:
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        files = write_state(str(folder), state, 0, False)
    trainer = ckpt.TrainerState(global_step=5, strategy="fsdp" if sharded else "ddp")
    for rank in range(world):
        ckpt.write_rank_part(
            str(folder),
            rank=rank,
            world_size=world,
            callback_state={"Counter": {"n": rank, "seen": torch.ones(2), "at": (1, 2.5)}},
            user_state={"note": "hi"},
            save_id="launch.0",
            **(
                dict(
                    extra_files=files,
                    scheduler=scheduler.state_dict(),
                    trainer_state=trainer,
                    model_spec=ModelSpec(model=factory).record() if spec else None,
                )
                if rank == 0
                else {}
            ),
        )
    if actor_state:
        state = {"callbacks": {"Stopper": {"best": 1.0}}, "user_state": {}}
        (folder / ACTOR_STATE_FILE).write_bytes(dumps(state))
    return model


def scheduler_of(optimizer: Any) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, _constant)


def _constant(step: int) -> float:
    return 1.0


def files_of(folder) -> list[str]:
    """Every file of a checkpoint but its manifests, relative to `folder`."""
    found = []
    for root, _, names in os.walk(folder):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), folder)
            if not rel.endswith(".complete"):
                found.append(rel)
    return sorted(found)


def relist(folder, add=(), drop=()) -> None:
    """Update every manifest to the files as they are now: the sizes and hashes of the files
    it lists, `add` (relative names) into rank 0's, `drop` out of every one."""
    for manifest in sorted(folder.glob("rank*.complete")):
        content = json.loads(manifest.read_text())
        for name in list(content["files"]):
            if name in drop or not (folder / name).is_file():
                del content["files"][name]
            else:
                content["files"][name] = ckpt.file_entry(str(folder), name)
        if manifest.name == "rank0.complete":
            for name in add:
                content["files"][name] = ckpt.file_entry(str(folder), name)
        manifest.write_text(json.dumps(content))


def poison(folder, names, marker) -> None:
    """Replace `names` by the marker pickle, then update every manifest that lists them."""
    for name in names:
        (folder / name).write_bytes(evil_bytes(marker))
    relist(folder)


def set_spec(folder, **fields) -> None:
    """Change fields of the checkpoint's model spec, its manifest updated to match."""
    spec = folder / ckpt.MODEL_SPEC_FILE
    spec.write_text(json.dumps({**json.loads(spec.read_text()), **fields}))
    relist(folder)


def resume_read(path, rank=0):
    """What a worker's resume reads (`restore_state`: model, optimizer, scheduler, its rank
    part), into a live model, optimizer and scheduler of `make_model`."""
    with ckpt.open_checkpoint(locate(str(path))) as checkpoint:
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters())
        scheduler = scheduler_of(optimizer)
        return restore_state(checkpoint, Parallel(model), optimizer, scheduler, Whole, rank)


def readers(folder, trust: bool = True) -> dict[str, Any]:
    """Every reader of a checkpoint, by name: ``load_model`` (trusting the factory, or with no
    flag when not `trust`; and with ``model=``), ``load_model_state``, ``open_checkpoint``, ``verify``, the driver's
    ``resume_from`` check, the worker's resume read (every rank, and one it did not have), the
    actor's restore, and EvalOnSave's copy (handed to a function that loads the model, and to
    one that reads the ``hf/`` export as evaluation tools do)."""
    from callbacks import CallbackManager
    from ray_trainer._actor.evaluation import _run_eval
    from ray_trainer._actor.state import restore
    from ray_trainer._driver.checks.inputs import _check_resume_from

    path = str(folder)

    def opened():
        with ckpt.open_checkpoint(locate(path)) as checkpoint:
            checkpoint.model_state()

    def actor():  # the actor skips a checkpoint whose state it cannot read
        if restore(CallbackManager([], global_callbacks=[]), locate(str(folder.parent))) is None:
            raise LookupError("the actor restored no state")

    def exported(local, step):
        return sorted(os.listdir(local))

    flagged = {"trust_factory": True} if trust else {}
    return {
        "load_model(trust_factory)" if trust else "load_model()": lambda: ckpt.load_model(
            path, **flagged
        ),
        "load_model(model=)": lambda: ckpt.load_model(path, model=make_model),
        "load_model_state": lambda: ckpt.load_model_state(path),
        "open_checkpoint": opened,
        "verify": lambda: ckpt.verify(path),
        "resume_from check": lambda: _check_resume_from(path),
        "resume rank 0": lambda: resume_read(path, 0),
        "resume rank 1": lambda: resume_read(path, 1),
        "resume rank 3": lambda: resume_read(path, 3),
        "actor restore": actor,
        "EvalOnSave load_model": lambda: _run_eval(
            lambda local, step: ckpt.load_model(local, model=make_model), path, 5
        ),
        "EvalOnSave load_model()": lambda: _run_eval(
            lambda local, step: ckpt.load_model(local, **flagged), path, 5
        ),
        "EvalOnSave export": lambda: _run_eval(exported, path, 5),
    }


def read_every_way(folder, trust: bool = True) -> dict[str, BaseException]:
    """Read the checkpoint at `folder` through every reader (`readers`); what each raised, by
    reader."""
    errors = {}
    for name, read in readers(folder, trust).items():
        try:
            read()
        except Exception as e:  # what matters to the callers is what it was, and the marker
            errors[name] = e
    return errors
